"""engine.kind=vllm_server's pieces that need no server: its config checks, the row split, the request body and the
SpecStats read from two /metrics pages (the servers themselves: tests/vllm/test_vllm_server.py)."""
from __future__ import annotations

import pytest

from drafttrain.config import ConfigError, load_recipe
from drafttrain.engines.vllm_server_engine import _counters, request_body, spec_from_counters, split_rows
from drafttrain.spec import SamplingParams

PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{{engine="0",model_name="policy"}} {d}
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="policy"}} {t}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="policy"}} {a}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="policy",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="policy",position="1"}} {p1}
vllm:iteration_tokens_total_bucket{{engine="0",le="1.0",model_name="policy"}} 99.0
vllm:iteration_tokens_total_count{{engine="0",model_name="policy"}} {s}
vllm:iteration_tokens_total_sum{{engine="0",model_name="policy"}} 1234.0
"""


@pytest.mark.parametrize("over, key", [(["engine.kind=vllm_server"], "engine.urls"),
                                       (["engine.kind=vllm_server", "engine.urls=[10.0.0.5:8000]"], "engine.urls"),
                                       (["engine.kind=tgi"], "engine.kind")])
def test_bad_server_settings_name_the_key(over, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        load_recipe("eagle3_track", over)


def test_server_settings_load():
    cfg = load_recipe("eagle3_track", ["engine.kind=vllm_server", "engine.urls=[http://a:1,https://b:2]"])
    assert list(cfg.engine.urls) == ["http://a:1", "https://b:2"]


def test_rows_split_contiguously_and_evenly():
    assert [list(r) for r in split_rows(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split_rows(1, 3)] == [[0], [], []]


def test_request_body_carries_the_rows_seed_and_token_ids():
    p = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=[2, 99], seed=3)
    a, b = request_body([5, 6], p, 0, 48), request_body([5, 6], p, 1, 48)
    assert a["prompt"] == [5, 6] and a["seed"] != b["seed"] and a["stop_token_ids"] == [2]
    assert a["return_token_ids"] and a["ignore_eos"] and a["logprobs"] == 0


def test_spec_stats_from_counter_deltas_of_two_servers():
    zero = _counters(PAGE.format(d=0, t=0, a=0, p0=0, p1=0, s=0))
    one = _counters(PAGE.format(d=4, t=8, a=5, p0=3, p1=2, s=6))  # 4 verify steps of k=2, 5 drafts accepted
    st = spec_from_counters([zero, zero], [one, one], emitted=18)  # each verify step emits accepted + 1
    assert (st.drafted, st.accepted, st.target_forwards) == (16, 10, 12)
    assert st.verify_rows == 8 and st.ar_rows == 0 and st.mean_accepted_length == 18 / 8
    assert st.acceptance_per_position == [6 / 8, 4 / 6]
    ar = spec_from_counters([one], [one], emitted=7)  # drafting off: every step AR
    assert ar.drafted == 0 and ar.ar_rows == 7 and ar.mean_accepted_length == 1.0
