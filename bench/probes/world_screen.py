"""Screen a task world's knobs (issue 46): SFT a policy, or run AR GRPO on it, with drafttrain.policy.task's knobs set.

    python bench/probes/world_screen.py sft OUT check_p=0.05 check_stop=0.015 [threads=1] [steps=2000]
    python bench/probes/world_screen.py rl POLICY OUT SEED check_p=... [strict=1] [form=1] [sample_offset=0]
        [steps=60] [threads=1] [rl.truncated_reward=0 ...]

`rl` is GRPO with AR rollouts at the default recipe (prompt_seed = SEED), and prints per step the reward, the
wrong-rule share of the written steps (chain and check) and of the check's steps alone, the share of rows that check,
the mean and max response length, the step's rollout and policy-update seconds and the rollout's tail10 seconds (the
decode steps in which only the longest-running 10% of rows were active), then the run's rollout and tail10 shares.
"""
import json
import sys
import time

import torch

from drafttrain.policy import task


def knobs(args):
    kv = dict(a.split("=", 1) for a in args)
    task.CHECK_P = float(kv.pop("check_p", task.CHECK_P))
    task.CHECK_STOP = float(kv.pop("check_stop", task.CHECK_STOP))
    task.CHECK_MAX = int(kv.pop("check_max", task.CHECK_MAX))
    task.STRICT = bool(int(kv.pop("strict", 0)))
    task.CHECK_FORM = bool(int(kv.pop("form", int(task.CHECK_FORM))))
    return kv


def rl(src, out, seed, kv):
    from drafttrain.config import load_recipe
    from drafttrain.engines import build_engine
    from drafttrain.policy import decode, load_policy
    from drafttrain.rl.grpo import GRPO, rollout_metrics

    torch.set_num_threads(int(kv.pop("threads", 1)))
    offset = int(kv.pop("sample_offset", 0))  # another sampling stream on the same prompts (as an SD arm draws)
    if offset:
        import drafttrain.rl.grpo as grpo_mod

        base = grpo_mod.sampling_params
        grpo_mod.sampling_params = lambda cfg, **kw: base(cfg, **{**kw, "seed": kw.get("seed", 0) + offset})
    torch.manual_seed(seed)
    steps = int(kv.pop("steps", 60))
    cfg = load_recipe("eagle3_track", [f"policy.path={src}", f"rl.prompt_seed={seed}", "engine.speculative=false",
                                       *[f"{k}={v}" for k, v in kv.items()]])
    policy, tok = load_policy(src)
    engine = build_engine(cfg.engine, policy, None)
    g = GRPO.from_config(cfg, policy, tok, engine)
    log = []
    for s in range(steps):
        t = time.perf_counter()
        ro = g.rollout(s)
        t_roll = time.perf_counter() - t
        m = rollout_metrics(ro)
        texts = [decode(tok, r) for r in ro.responses]
        checks = [x.split("A:")[-1].split(";", 1)[1] for x in texts if ";" in x.split("A:")[-1]]
        t = time.perf_counter()
        g.train_step(ro)
        engine.update_policy()
        t_train = time.perf_counter() - t
        rec = dict(step=s, reward=round(sum(ro.rewards) / len(ro.rewards), 3),
                   wrong=round(task.wrong_rule_share(texts), 3),
                   check=round(len(checks) / len(texts), 3),
                   check_wrong=round(task.wrong_rule_share([";" + c for c in checks]), 3),
                   len=round(m["resp_len_mean"], 1), max=m["resp_len_max"], roll_s=round(t_roll, 3),
                   train_s=round(t_train, 3), tail10_s=round(m["rollout_tail10_s"] or 0.0, 3))
        log.append(rec)
        print(json.dumps(rec), flush=True)
    roll, train, tail = (sum(r[k] for r in log) for k in ("roll_s", "train_s", "tail10_s"))
    summary = dict(rollout_share=roll / (roll + train), tail10_share=tail / roll, roll_s=roll, train_s=train)
    print(json.dumps(summary), flush=True)
    json.dump(dict(log=log, summary=summary), open(out, "w"))


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "sft":
        sys.path.insert(0, "scripts")
        import make_policy
        from omegaconf import OmegaConf
        kv = knobs(args[1:])
        cfg = OmegaConf.merge(OmegaConf.structured(make_policy.MakePolicyConfig),
                              OmegaConf.from_dotlist([f"out={args[0]}", *[f"{k}={v}" for k, v in kv.items()]]))
        make_policy.main(OmegaConf.to_object(cfg))
    else:
        rl(args[0], args[1], int(args[2]), knobs(args[3:]))
