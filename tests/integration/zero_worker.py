"""One process of tests/integration/test_deepspeed.py's ZeRO-2 check (started by accelerate launch with
recipes/accelerate/zero2.yaml): a DrafterTrainer under DeepSpeed takes a step, a step whose loss is NaN on process 1
only, and, after set_weights, a step at lr 0. Writes OUT/rank<N>.json per process (two processes' prints
interleave)."""
import json
import sys
from pathlib import Path

import torch

from drafttrain.config import load_recipe
from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.policy import load_policy
from drafttrain.tracking import DrafterTrainer, teacher_forced_features
from drafttrain.tracking.trainer import make_accelerator


def main(policy_dir: str, out: str) -> None:
    acc = make_accelerator()
    cfg = load_recipe("eagle3_track", [f"policy.path={policy_dir}", "drafter.path=null", "train.query_frac=1.0"])
    policy, _ = load_policy(policy_dir)
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, policy)
    tr = DrafterTrainer(drafter, cfg.train, cfg.drafter, acc, head=TargetHead.of(policy))
    g = torch.Generator().manual_seed(acc.process_index)
    prompts = [torch.randint(3, 20, (6,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(3, 20, (10,), generator=g).tolist() for _ in range(4)]
    batch = teacher_forced_features(policy, prompts, responses, drafter.aux_layer_ids, cfg.drafter.ttt_steps)

    def weights():
        return {k: v.detach().clone() for k, v in drafter.state_dict().items()}

    def moved(a, b):
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)

    w0 = weights()
    first = tr.step(batch)
    w1 = weights()
    bad = dict(batch, hidden=batch["hidden"] * (float("nan") if acc.process_index == 1 else 1.0))
    second = tr.step(bad)
    w2 = weights()
    tr.set_weights(w0)
    tr.set_lr(0.0)
    tr.step(batch)
    w3 = weights()
    Path(out, f"rank{acc.process_index}.json").write_text(json.dumps({
        "rank": acc.process_index, "deepspeed": tr.deepspeed, "first_nonfinite": first["nonfinite"],
        "first_moved": moved(w1, w0), "second_nonfinite": second["nonfinite"], "second_moved": moved(w2, w1),
        "after_set_weights_moved": moved(w3, w0), "steps": tr.step_count,
        "weight_sum": float(sum(v.double().sum() for v in w1.values()))}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
