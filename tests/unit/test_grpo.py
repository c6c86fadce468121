"""The embedded GRPO host on a tiny random policy: the engine's behaviour log-probs line up with the training
forward (ratio 1 on fresh rollouts), the update is the policy gradient of the group-normalised advantages (sign,
masks, offsets), sequences with advantage 0 run without autograd, and the held-out evaluation is repeatable."""
from __future__ import annotations

import pytest
import torch

from drafttrain.config import load_recipe
from tests.conftest import seq_logprobs

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)
REWARDS = [1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0]  # groups 1 and 2 all equal: advantage 0


@pytest.fixture(scope="module")
def setup():
    from drafttrain.engines import build_engine
    from drafttrain.policy import build_policy, build_tokenizer
    from drafttrain.rl.grpo import GRPO

    torch.manual_seed(0)
    policy, tok = build_policy(TINY).eval(), build_tokenizer()
    cfg = load_recipe("eagle3_track", ["drafter.path=null", "rl.prompts_per_step=4", "rl.group_size=4",
                                       "rl.micro_batch=4", "sampling.max_new_tokens=12"])
    grpo = GRPO.from_config(cfg, policy, tok, build_engine(cfg.engine, policy))
    ro = grpo.rollout(0)
    ro.rewards = [float(r) for r in REWARDS]
    return grpo, ro


def test_engine_logprobs_match_the_training_forward(setup):
    grpo, ro = setup
    with torch.no_grad():
        for p, r, old in zip(ro.prompts, ro.responses, ro.logprobs):
            assert len(old) == len(r) > 0
            torch.testing.assert_close(seq_logprobs(grpo.policy, p, r), torch.tensor(old), atol=1e-4, rtol=0)


def test_update_is_the_policy_gradient_and_zero_advantage_rows_skip_autograd(setup, monkeypatch):
    grpo, ro = setup
    policy = grpo.policy
    adv = grpo.advantages(ro.rewards)  # [16]
    assert adv.view(4, 4)[1:3].abs().max() == 0
    assert adv.view(4, 4)[0].tolist() == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)  # + rewarded, - not

    # reference: at ratio 1 the clipped objective's gradient is -sum_i A_i grad log pi(y_i) / tokens, clipped at 1
    n_tok = sum(map(len, ro.responses))
    policy.zero_grad()
    loss = -sum(a * seq_logprobs(policy, p, r).sum() for a, p, r in zip(adv, ro.prompts, ro.responses)) / n_tok
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    ref = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()

    got, grad_rows = {}, []
    monkeypatch.setattr(grpo.opt, "step", lambda: got.update({n: p.grad.clone() for n, p in policy.named_parameters()}))
    log = lambda m, a, kw, out: grad_rows.append((torch.is_grad_enabled(), len(kw["input_ids"])))  # noqa: E731
    h = policy.register_forward_hook(log, with_kwargs=True)
    try:
        rec = grpo.train_step(ro)
    finally:
        h.remove()
    assert rec["clip_frac"] == 0.0  # fresh rollouts: ratio 1 everywhere
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, atol=1e-6, rtol=1e-4, msg=n)
    # 8 rows with an advantage: two micro-batches of 4 with autograd; with no tracker to read them, the 8 without
    # are not forwarded at all
    assert grad_rows == [(True, 4), (True, 4)]


def test_micro_batches_cut_by_rows_and_padded_tokens():
    """A long-tailed batch: before, the 16 longest rows shared one micro-batch padded to the longest (16 x 400
    tokens for one long row); now a micro-batch stops at `rows` rows or `tokens` padded tokens, graded rows first."""
    from drafttrain.rl.grpo import micro_batches

    lens = [30] * 15 + [400] + [20] * 4
    graded = [True] * 16 + [False] * 4
    got = micro_batches(lens, graded, rows=16, tokens=2048)
    assert got == [list(range(15)), [15], [16, 17, 18, 19]]
    assert micro_batches([30] * 20, [True] * 20, rows=16, tokens=2048) == [list(range(16)), list(range(16, 20))]
    assert micro_batches([600, 10], [True, True], rows=4, tokens=500) == [[1], [0]]  # too long for the budget: alone
    for rows, tokens in ((4, 100), (3, 1), (16, 2048)):
        cut = micro_batches(lens, graded, rows, tokens)
        assert sorted(i for b in cut for i in b) == list(range(len(lens)))
        assert all(len(b) <= rows and (len(b) == 1 or len(b) * max(lens[i] for i in b) <= tokens) for b in cut)
        assert all(len({graded[i] for i in b}) == 1 for b in cut)


def test_the_update_does_not_depend_on_how_the_rows_are_cut(setup, monkeypatch):
    grpo, ro = setup
    grads = []
    monkeypatch.setattr(grpo.opt, "step", lambda: grads.append(
        {n: p.grad.clone() for n, p in grpo.policy.named_parameters()}))
    for tokens in (2048, 1):  # four rows a forward, then every row alone
        monkeypatch.setattr(grpo.rl, "micro_tokens", tokens)
        grpo.train_step(ro)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-4, msg=n)


class _Reader:
    """A tracker stand-in that reads the rows of the steps in `steps` (and records the capture blocks)."""

    def __init__(self, steps, ungraded=True):
        self.steps, self.ungraded, self.captured, self.extra = steps, ungraded, 0, []

    def reads_rows(self, step, last=False, ungraded=False):
        return step in self.steps and (self.ungraded or not ungraded)

    def capture(self, policy, response_start=None, extra=False):
        import contextlib

        self.captured += 1
        self.extra.append(extra)
        return contextlib.nullcontext()


@pytest.mark.parametrize("reads, ungraded", [(True, True), (True, False), (False, False)])
def test_zero_advantage_rows_are_forwarded_only_where_the_tracker_reads_them(setup, monkeypatch, reads, ungraded):
    """Two graded micro-batches run with autograd; the two zero-advantage ones only where the tracker reads those
    rows too (online.capture_rows=all, or a report step)."""
    grpo, ro = setup
    rows = []
    h = grpo.policy.register_forward_hook(lambda m, a, kw, out: rows.append(torch.is_grad_enabled()),
                                          with_kwargs=True)
    monkeypatch.setattr(grpo.opt, "step", lambda: None)
    reader = _Reader({ro.step} if reads else set(), ungraded)
    monkeypatch.setattr(grpo, "tracker", reader)
    try:
        grpo.train_step(ro)
    finally:
        h.remove()
        grpo.opt.zero_grad(set_to_none=True)
    assert rows == ([True, True, False, False] if ungraded else [True, True])
    assert reader.captured == (4 if ungraded else 2 if reads else 0)  # no capture hooks where nobody reads the rows
    # the zero-advantage forwards run for the tracker alone: their time is the tracker's, not RL time
    assert reader.extra == ([False, False, True, True] if ungraded else [False, False] if reads else [])


def test_evaluate_scores_fixed_held_out_problems(setup):
    grpo, _ = setup
    grpo.rl.eval_prompts = 8
    first, again = grpo.evaluate(), grpo.evaluate()
    assert first == again and set(first) == {"eval_sampled_acc", "eval_greedy_acc"}  # seeded: repeatable
    assert all(0.0 <= v <= 1.0 for v in first.values())


@pytest.mark.parametrize("over", ["sampling.top_k=4", "sampling.top_p=0.5", "sampling.temperature=0.7"])
def test_fresh_rollouts_have_ratio_one_under_truncated_sampling(over):
    """The loss's current log-probs come from the distribution the engine sampled (processed_probs: temperature,
    top-k, top-p). From the full softmax, top-k / top-p rollouts read ratio = the kept mass < 1 on fresh rollouts,
    and every negative-advantage token was clipped (clip_frac 1.0)."""
    from drafttrain.engines import build_engine
    from drafttrain.policy import build_policy, build_tokenizer
    from drafttrain.rl.grpo import GRPO

    torch.manual_seed(0)
    policy, tok = build_policy(TINY).eval(), build_tokenizer()
    cfg = load_recipe("eagle3_track", ["drafter.path=null", "rl.prompts_per_step=2", "rl.group_size=2",
                                       "rl.micro_batch=4", "sampling.max_new_tokens=12", over])
    grpo = GRPO.from_config(cfg, policy, tok, build_engine(cfg.engine, policy))
    ro = grpo.rollout(0)
    ro.rewards = [1.0, 0.0, 0.0, 1.0]
    assert grpo.train_step(ro)["clip_frac"] == 0.0


@pytest.mark.parametrize("over,key", [(["engine.max_len=8"], "engine.max_len"),
                                      (["engine.max_len=2048", "sampling.max_new_tokens=600"],
                                       "sampling.max_new_tokens")])
def test_rows_too_short_for_the_task_are_refused_at_start_up(over, key):
    """engine.max_len=8 was accepted and failed later in generate (a ValueError traceback): a row must hold the
    task's longest prompt plus sampling.max_new_tokens, within the policy's positions (512 here)."""
    from drafttrain.config import ConfigError
    from drafttrain.engines import build_engine
    from drafttrain.policy import build_policy, build_tokenizer
    from drafttrain.rl.grpo import GRPO

    policy, tok = build_policy(TINY).eval(), build_tokenizer()
    cfg = load_recipe("eagle3_track", ["drafter.path=null", *over])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        GRPO.from_config(cfg, policy, tok, build_engine(cfg.engine, policy))
    assert str(e.value).startswith(key) and "\n" not in str(e.value)
    short = load_recipe("eagle3_track", ["drafter.path=null", "engine.max_len=504"])  # one position short
    with pytest.raises(ConfigError, match=r"engine\.max_len"):
        GRPO.from_config(short, policy, tok, build_engine(short.engine, policy))
    ok = load_recipe("eagle3_track", ["drafter.path=null", "engine.max_len=505"])  # 9-token prompt + 496 fits
    GRPO.from_config(ok, policy, tok, build_engine(ok.engine, policy))


@pytest.mark.parametrize("speculative", [True, False])
def test_engine_speculative_false_decodes_ar_and_the_unused_drafter_costs_nothing(speculative):
    """engine.speculative=false (bench_e2e's AR arm): rollouts and the held-out evaluation decode without the drafter,
    and with the drafter never trained (online.track=false) nothing is captured, so nothing is measured either."""
    from drafttrain.drafters import build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.policy import build_policy, build_tokenizer
    from drafttrain.rl.grpo import GRPO, rollout_metrics
    from drafttrain.tracking.tracker import DraftTracker

    torch.manual_seed(0)
    policy, tok = build_policy({**TINY, "num_hidden_layers": 4}).eval(), build_tokenizer()
    cfg = load_recipe("eagle3_frozen", ["drafter.path=null", "rl.prompts_per_step=2", "rl.group_size=2",
                                        "rl.micro_batch=4", "sampling.max_new_tokens=8", "rl.eval_prompts=2",
                                        f"engine.speculative={str(speculative).lower()}"])
    drafter = build_drafter(cfg.drafter, policy)
    engine = build_engine(cfg.engine, policy, drafter)
    tracker = DraftTracker(cfg, policy, [engine], drafter)
    grpo = GRPO.from_config(cfg, policy, tok, engine, tracker)
    flags, generate = [], engine.generate
    engine.generate = lambda *a, **kw: (flags.append(kw.get("speculative")), generate(*a, **kw))[1]  # noqa: E731
    ro = grpo.rollout(0)
    grpo.evaluate()
    grpo.train_step(ro)
    assert flags == [speculative, False, False]  # the rollout, then the sampled and the greedy evaluation (AR)
    cfg.rl.eval_decode = "rollout"
    grpo.evaluate()
    assert flags[3:] == [speculative] * 2  # rl.eval_decode=rollout: decoded as the rollouts are
    assert (ro.batch.stats.mean_accepted_length > 1) == speculative  # AR: no draft was ever accepted
    assert rollout_metrics(ro)["live_k"] == (cfg.engine.k if speculative else None)  # every SD step drafted k
    assert bool(tracker.buffer.of_version(0)) == speculative  # captured at the measured step 0: an SD run only
    assert tracker.probe_stop == tuple(grpo.prompts.stop_ids) != ()  # the probe canary stops where rollouts do
    assert ("live_tf_mal" in tracker.measure()) == speculative


def _average_rank(rank: int, store: str, out: str) -> None:
    """One of 2 gloo processes: process 0 has gradients, process 1 ran no backward (None); GRPO.average_grads."""
    import os
    from types import SimpleNamespace

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from accelerate import Accelerator

    from drafttrain.rl.grpo import GRPO
    from drafttrain.tracking.collective import Collective

    lin = torch.nn.Linear(3, 2)
    if rank == 0:
        lin.weight.grad, lin.bias.grad = torch.full_like(lin.weight, 2.0), torch.ones_like(lin.bias)
    acc = Accelerator(cpu=True)
    GRPO.average_grads(SimpleNamespace(acc=acc, policy=lin))
    torch.save({"weight": lin.weight.grad, "bias": lin.bias.grad}, f"{out}/rank{rank}.pt")
    Collective(acc).settle()  # as the main job ends (without it ~5% of these processes died of SIGABRT at exit)
    torch.distributed.destroy_process_group()


def test_several_processes_average_the_policy_gradients(tmp_path):
    """The GRPO host's policy is not DDP-wrapped: its gradients are averaged once per update, a process with no
    backward (every advantage 0) adding zeros, so every process takes the same step."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_average_rank, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.equal(got["weight"], torch.full((2, 3), 1.0)) and torch.equal(got["bias"], torch.full((2,), 0.5))


@pytest.mark.parametrize("recipe", ["eagle3_frozen", "eagle3_track"])
def test_the_live_frozen_scoring_runs_at_its_cadence_and_a_frozen_drafter_reads_only_those_steps(recipe):
    """online.measure_every=3: scored at steps 0, 3, 6 and the last; the other steps' records carry the keys as None.
    A tracking drafter reads every step's rows (it trains on them); a frozen one only those of the scored steps."""
    from drafttrain.drafters import build_drafter
    from drafttrain.engines import build_engine
    from drafttrain.policy import build_policy
    from drafttrain.tracking.tracker import DraftTracker

    torch.manual_seed(0)
    policy = build_policy({**TINY, "num_hidden_layers": 4}).eval()
    cfg = load_recipe(recipe, ["drafter.path=null", "online.measure_every=3", "online.capture_rows=all"])
    drafter = build_drafter(cfg.drafter, policy)
    tracker = DraftTracker(cfg, policy, [build_engine(cfg.engine, policy, drafter)], drafter)
    assert [s for s in range(8) if tracker.scorer.due(s)] == [0, 3, 6]
    assert tracker.scorer.due(7, last=True) and tracker.scorer.due(None)
    reads = [s for s in range(8) if tracker.reads_rows(s)]
    assert reads == (list(range(8)) if recipe == "eagle3_track" else [0, 3, 6])
    assert [s for s in range(8) if tracker.reads_rows(s, ungraded=True)] == reads  # online.capture_rows=all
    tracker.cfg.online.capture_rows = "graded"  # the zero-advantage rows: only at the scored steps
    assert [s for s in range(8) if tracker.reads_rows(s, ungraded=True)] == [0, 3, 6]
    assert [s for s in range(8) if tracker.reads_rows(s)] == reads
    tracker.buffer.records.append({"not": "scored", "version": 0})  # an off-cadence step scores nothing
    off = tracker.measure(step=4)
    assert off["live_tf_mal"] is None and off["frozen_tf_mal"] is None and off["measure_s"] == 0.0


def test_truncated_reward_replaces_the_reward_of_rows_cut_at_the_cap_unfinished(setup, monkeypatch):
    from drafttrain.rl.watch import unfinished

    grpo, _ = setup
    monkeypatch.setattr(grpo.prompts, "reward", lambda row, text: 1.0)  # every answer right, whatever its length
    cap, stop = grpo.sampling.max_new_tokens, set(grpo.prompts.stop_ids)
    monkeypatch.setattr(grpo.rl, "truncated_reward", -0.5)
    ro = grpo.rollout(3)
    cut = [unfinished(t, cap, stop) for t in ro.responses]
    assert any(cut) and ro.rewards == [-0.5 if c else 1.0 for c in cut]
    assert all(len(t) == cap for t, c in zip(ro.responses, cut) if c)
    monkeypatch.setattr(grpo.rl, "truncated_reward", None)  # as scored
    assert grpo.rollout(3).rewards == [1.0] * len(cut)


@pytest.mark.parametrize("over, msg", [("online.measure_every=0", r"^online\.measure_every: must be >= 1, got 0$"),
                                       ("rl.eval_decode=fast", r"^rl\.eval_decode: must be ar or rollout, got 'fast'$"),
                                       ("online.capture_rows=some",
                                        r"^online\.capture_rows: must be all or graded, got 'some'$"),
                                       ("rl.truncated_reward=nan",
                                        r"^rl\.truncated_reward: must be a finite number or null \(as scored\), got nan$")])
def test_cadence_and_eval_decode_are_validated_in_one_line(over, msg):
    from drafttrain.config import ConfigError

    with pytest.raises(ConfigError, match=msg):
        load_recipe("eagle3_track", [over])


def test_tail_seconds_are_the_steps_with_only_the_longest_running_rows_active():
    from drafttrain.engines.base import Timeline
    from drafttrain.rl.grpo import tail_s

    # 20 rows: ceil(0.1 * 20) = 2; steps of 1 s each (ends 1..6), the last three with 2 or 1 rows active
    tl = Timeline(ends=[1.0, 2.0, 3.0, 4.0, 5.5, 6.0], batch=[20, 20, 5, 2, 2, 1])
    assert tail_s(tl, 20, 0.1) == pytest.approx(1.0 + 1.5 + 0.5)
    assert tail_s(Timeline(), 20, 0.1) is None  # an engine that keeps no per-step batch
