"""python bench/probes/catch_up.py RUN_DIR [SEED] [variant,...]: how far the drafter a finished eagle3_track run
serves is from what a little more training on the current policy buys (issue 18, session 28: is the gap to the
oracle lag, data, the optimizer or the drafter step?).

At the run's last checkpoint: 128 fresh rollouts of its policy (prompt seed 10000+SEED) to train on, 96 others
(20000+SEED) to score on (teacher-forced MAL at the recipe's k). Prints the frozen step-0 drafter's and the served
drafter's MAL, then per variant the MAL after 0.75 / 1.5 / 3 s of drafter steps (and the steps that took) from the
served weights (or the trainer's latest, `latest`), on the fresh rollouts or on the run's own buffer (`runbuf`, with
its recency weights, or uniform, or its newest version only). `oracle` trains the frozen drafter 25/50/100/300 steps
on every position, as bench_tracking's oracle does. A fresh AdamW unless `runopt` (the run's own moments).
"""
import copy
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
from bench_tracking import features, rollouts  # noqa: E402

from drafttrain.config import load_recipe, max_draft_len, resolve_path  # noqa: E402
from drafttrain.drafters import TargetHead, build_drafter  # noqa: E402
from drafttrain.engines import build_engine  # noqa: E402
from drafttrain.policy import load_policy  # noqa: E402
from drafttrain.spec import SpecStats  # noqa: E402
from drafttrain.tracking.acceptance import teacher_forced_acceptance  # noqa: E402
from drafttrain.tracking.buffer import FeatureBuffer, collate  # noqa: E402
from drafttrain.tracking.trainer import DrafterTrainer  # noqa: E402
from drafttrain.tracking.weightsets import checkpoint_sets  # noqa: E402

VARIANTS = {"base": {}, "ttt1": {"ttt_steps": 1}, "ttt2": {"ttt_steps": 2}, "ttt5": {"ttt_steps": 5},
            "lr6e-4": {"lr": 6e-4}, "ttt2_lr6e-4": {"ttt_steps": 2, "lr": 6e-4}, "bs8": {"batch_size": 8},
            "runopt": {"runopt": True}, "latest": {"latest": True}, "latest_runopt": {"latest": True, "runopt": True},
            "runbuf": {"runbuf": 2.0}, "runbuf_uniform": {"runbuf": None}, "runbuf_hl0.5": {"runbuf": 0.5},
            "runbuf_newest": {"runbuf": 0.5, "newest": True}, "ttt2_runbuf": {"ttt_steps": 2, "runbuf": 2.0},
            "oracle": {"oracle": True}}
BUDGETS_S = (0.75, 1.5, 3.0)
ORACLE_STEPS = (25, 50, 100, 300)


def main(run: pathlib.Path, seed: int, names: list[str]) -> None:
    torch.set_num_threads(2)
    rc = load_recipe("eagle3_track", [f"run.out_dir={run}"])
    k = max_draft_len(rc.engine)
    torch.manual_seed(rc.run.seed)
    pol0, tok = load_policy(str(resolve_path(rc.policy.path)))
    frozen = build_drafter(rc.drafter, pol0).eval()
    last = run / "ckpt" / (run / "ckpt" / "latest").read_text().strip()
    policy, _ = load_policy(str(last / "policy"))
    sets = checkpoint_sets(last)
    served = copy.deepcopy(frozen)
    served.load_state_dict(sets["good_weights"])
    trainer_state = torch.load(last / "trainer.pt", weights_only=False)
    latest = copy.deepcopy(frozen)
    latest.load_state_dict(sets["trained"])
    ar = build_engine(rc.engine, policy, None)
    p_tr, b_tr = rollouts(ar, tok, 128, 10_000 + seed, rc.sampling.max_new_tokens)
    p_ev, b_ev = rollouts(ar, tok, 96, 20_000 + seed, rc.sampling.max_new_tokens)
    f_tr, f_ev = features(policy, frozen, p_tr, b_tr.tokens, k), features(policy, frozen, p_ev, b_ev.tokens, k)
    head = TargetHead.of(policy)

    def score(d) -> float:
        st = SpecStats()
        for f in f_ev:
            st = st.merge(teacher_forced_acceptance(d.eval(), f, k, head)["stats"])
        d.train()
        return round(st.mean_accepted_length, 3)

    print({"frozen": score(frozen), "served": score(served.eval()), "latest": score(latest.eval())}, flush=True)
    for name in names:
        v = VARIANTS[name]
        d = copy.deepcopy(frozen if v.get("oracle") else latest if v.get("latest") else served).train()
        if "runbuf" in v:
            buf = FeatureBuffer(1 << 30, seed=seed, half_life=v["runbuf"])
            recs = trainer_state["buffer"]["records"]
            if v.get("newest"):
                recs = [r for r in recs if r["version"] == max(x["version"] for x in recs)]
            buf.load_state_dict({**trainer_state["buffer"], "records": recs})
        else:
            buf = FeatureBuffer(1 << 30, seed=seed)
            for f in f_tr:
                buf.add(f)
        tc, dc = copy.deepcopy(rc.train), copy.deepcopy(rc.drafter)
        tc.batch_size, tc.lr = v.get("batch_size", tc.batch_size), v.get("lr", tc.lr)
        dc.ttt_steps = v.get("ttt_steps", dc.ttt_steps)
        if v.get("oracle"):
            tc.query_frac = 1.0
        tr = DrafterTrainer(d, tc, dc, buffer=buf, head=head)
        if v.get("runopt"):
            tr.opt.load_state_dict(trainer_state["optimizer"])
        res, spent, n = {}, 0.0, 0
        for mark in (ORACLE_STEPS if v.get("oracle") else BUDGETS_S):
            while (n if v.get("oracle") else spent) < mark:
                batch = collate(buf.sample_groups(tc.batch_size, 1)[0], buf.steps)
                t0 = time.perf_counter()
                tr.step(batch)
                spent, n = spent + time.perf_counter() - t0, n + 1
            res[mark] = (n, score(d))
        print(name, "{mark: (steps, MAL)}", res, flush=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 60,
         sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS))
