"""python bench/probes/drafter_step_cost.py: seconds per drafter step (DrafterTrainer.step) on the shipped policy's
own rollouts, by train.query_frac and batch size, the rest of the default recipe as it is (issue 18: how much training
the 5% budget buys). Prints one line per setting: ms per step, ms per record."""
import time

from drafttrain.config import load_recipe, resolve_path, sampling_params
from drafttrain.drafters import TargetHead, build_drafter
from drafttrain.engines import build_engine
from drafttrain.policy import load_policy
from drafttrain.data import Prompts, stop_ids
from drafttrain.tracking import DrafterTrainer, FeatureBuffer, teacher_forced_features
from drafttrain.tracking.buffer import collate


def setup():
    """(recipe, policy, a FeatureBuffer of the shipped policy's own 128 rollouts) at the default recipe."""
    cfg = load_recipe("eagle3_track")
    policy, tok = load_policy(str(resolve_path(cfg.policy.path)))
    src = Prompts(cfg.data, cfg.reward, tok, stop_ids(policy, tok))
    prompts = [src.encode(r) for r in src.rows(128, seed=5)]
    resp = build_engine(cfg.engine, policy).generate(
        prompts, sampling_params(cfg.sampling, stop_token_ids=src.stop_ids, seed=5), speculative=False).tokens
    drafter = build_drafter(cfg.drafter, policy)
    buf = FeatureBuffer(256 << 20, seed=0)
    for i in range(0, 128, 16):
        buf.add(teacher_forced_features(policy, prompts[i:i + 16], resp[i:i + 16], drafter.aux_layer_ids,
                                        cfg.drafter.ttt_steps))
    return cfg, policy, buf


def sweep():
    cfg, policy, buf = setup()
    for qf in (1.0, 0.5, 0.25, 0.125):
        for bs in (8, 16, 32):
            cfg.train.query_frac, cfg.train.batch_size = qf, bs
            tr = DrafterTrainer(build_drafter(cfg.drafter, policy), cfg.train, cfg.drafter,
                                head=TargetHead.of(policy))
            batches = [collate(g, buf.steps) for g in buf.sample_groups(bs, 12)]
            tr.step(batches[0])
            t = time.perf_counter()
            for b in batches[1:]:
                tr.step(b)
            ms = (time.perf_counter() - t) / (len(batches) - 1) * 1e3
            print(f"query_frac {qf:<5} batch {bs:>2}: {ms:6.1f} ms per step, {ms / bs:5.2f} ms per record", flush=True)


if __name__ == "__main__":
    sweep()
