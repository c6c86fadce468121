"""Does the teacher-forced acceptance estimate read what the engine measures? Both on the very same rollouts.

    python scripts/check_acceptance.py                                   # shipped policy + drafter, 64 rollouts
    python scripts/check_acceptance.py rollouts=256 seed=3 overrides=[engine.drafter_int8=true]

1. The recipe's engine (default eagle3_track: k=5, T=1, the shipped policy and EAGLE-3 drafter; int8 drafter off,
   so that both sides run the same weights) generates `rollouts` responses with speculative decoding and records
   its SpecStats: MAL (response tokens per verify step) and acceptance per position.
2. One teacher-forced policy forward over the same prompt + response pairs (teacher_forced_features), and
   teacher_forced_acceptance of the same drafter: the expected SpecStats on those sequences.
3. End-of-sequence effect: a row's last verify step is cut at its stop token (no bonus token, drafts past the cut
   not counted). `mal_without_cut` = 1 + accepted / verify steps is what the engine read when it counted a bonus
   token there too; `last_step_share` is the share of verify steps that are a row's last.
Writes bench/acceptance.json and prints a table. The two MALs differ by sampling noise only (the engine's accept
draws given the sequences); its standard deviation here is about 0.04 at 64 rollouts.
"""
from __future__ import annotations

import torch

from drafttrain.config import load_recipe, max_draft_len, resolve_path, sampling_params, script_config
from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.engines import build_engine
from drafttrain.tracking.acceptance import teacher_forced_acceptance
from drafttrain.tracking.capture import teacher_forced_features
from drafttrain.policy import encode_prompt, load_policy, make_prompts
from drafttrain.report import format_table, write_json
from drafttrain.spec import SpecStats

DEFAULTS = dict(recipe="eagle3_track", rollouts=64, seed=0, max_new_tokens=256, fwd_batch=16,
                out="bench/acceptance.json", overrides=["engine.drafter_int8=false"])


def main(cfg) -> dict:
    rc = load_recipe(cfg.recipe, list(cfg.overrides))
    s = rc.sampling
    if s.temperature != 1.0 or s.top_k or s.top_p < 1.0:
        raise ValueError("sampling: teacher-forced acceptance scores the policy at temperature 1, no top-k/top-p")
    k = max_draft_len(rc.engine)
    policy, tok = load_policy(str(resolve_path(rc.policy.path)))
    drafter = build_drafter(rc.drafter, policy).eval()
    engine = build_engine(rc.engine, policy, drafter)
    prompts = [encode_prompt(tok, p.prompt) for p in make_prompts(cfg.rollouts, seed=cfg.seed)]
    params = sampling_params(rc.sampling, max_new_tokens=cfg.max_new_tokens, stop_token_ids=(tok.eos_token_id,),
                             seed=cfg.seed)
    b = engine.generate(prompts, params, speculative=True)

    tf, head = SpecStats(), TargetHead.of(policy)
    for i in range(0, len(prompts), cfg.fwd_batch):
        f = teacher_forced_features(policy, prompts[i:i + cfg.fwd_batch], b.tokens[i:i + cfg.fwd_batch],
                                    drafter.aux_layer_ids, k)
        tf = tf.merge(teacher_forced_acceptance(drafter, f, k, head)["stats"])

    rows = []
    for name, st in (("engine", b.stats), ("teacher_forced", tf)):
        rows.append({"side": name, "mal": st.mean_accepted_length, "mal_without_cut": 1 + st.accepted / st.verify_rows,
                     "verify_steps": st.verify_rows, "last_step_share": len(prompts) / st.verify_rows,
                     **{f"acc{i}": a for i, a in enumerate(st.acceptance_per_position)}})
    lens = sorted(len(t) for t in b.tokens)
    result = {"k": k, "rollouts": len(prompts), "resp_len_p50": lens[len(lens) // 2],
              "drafter_int8": rc.engine.drafter_int8, "mal_diff": rows[0]["mal"] - rows[1]["mal"],
              "engine": b.stats.to_dict(), "teacher_forced": tf.to_dict(), "table": rows}
    print(format_table(rows, list(rows[0])))
    print(f"engine - teacher-forced MAL: {result['mal_diff']:+.3f}  (k={k}, {len(prompts)} rollouts, "
          f"response length p50 {result['resp_len_p50']})")
    print(f"wrote {write_json(result, cfg.out)}")
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(script_config(DEFAULTS))
