"""The tracker at the sizes users bring: random Qwen3 policies with real vocabularies and long rows, on this machine.
Prints a table per part and writes bench/scale.json.

    python scripts/bench_scale.py                                  # every part (about an hour on 2 CPU cores)
    python scripts/bench_scale.py parts=[capture,step]             # the minute-scale parts alone
    python scripts/bench_scale.py parts=[job] job_rows=[32]        # one of the main-job comparisons

A run keeps, from an existing out file, the parts it does not run (`runs` gives each part's settings and start).

Parts, each measurement in a process of its own (its peak memory is its own):
- capture: one policy forward with autograd on (as the RL loss forward runs), with and without the tracker's capture
  (the hooks, build_features, the buffer's copies of every row), interleaved, medians: capture ms per token against
  the forward's own, and the buffer's bytes per stored token against the bound (A+1) * H * 2 + 16 (A aux states of
  H each in bf16, plus the token id); tokens per 64 MB. Vocabularies x hidden sizes.
- step: one drafter step (train.* of the recipe, drafter.eagle3 sized for the policy: a 32k draft vocabulary at a
  152k one) on step_rows records of each length, train.max_len off (whole rows) and at its default: ms and the
  step's peak memory above the process's (the kernel's high-water mark, reset before the step).
- job: the main job AR against tracking (recipe eagle3_track, a fresh drafter, online.budget_frac=0) on a random
  Qwen3 of hidden size 64: peak RSS and wall, at job_rows rows a step (job_vocab: 151,936) and at long_rows rows of
  up to long_tokens tokens (long_vocab: 4,096).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from drafttrain.config import PROJECT_ROOT, script_config
from drafttrain.device import now  # synchronized: a GPU's work, not its kernel launches
from drafttrain.report import format_table, write_json

DEFAULTS = dict(parts=["capture", "step", "job"], vocabs=[32000, 128256, 151936], hiddens=[256, 1024], layers=4,
                capture_batch=4, capture_len=512, repeats=3, step_vocab=151936, step_hidden=256,
                step_lens=[1024, 2048, 4096, 8192], step_rows=4, job_vocab=151936, job_rows=[32, 128], job_steps=3,
                job_new_tokens=64, long_vocab=4096, long_rows=[8], long_tokens=4096, long_steps=2, threads=2,
                device="cpu", out="bench/scale.json")
REWARD = "def has_digit(prompt, response, row):\n    return float(any(c.isdigit() for c in response))\n"


def random_qwen3(vocab: int, hidden: int, layers: int, max_pos: int = 8192, seed: int = 0):
    """A random Qwen3 (heads of 64, 2 KV heads per 4 query heads, MLP 2x hidden), its head sharpened so its
    rollouts have structure; fp32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), head_dim=64, intermediate_size=2 * hidden,
                      max_position_embeddings=max_pos, tie_word_embeddings=False)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


def high_water_reset() -> bool:
    """Reset the kernel's peak-RSS mark of this process (VmHWM); False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_kb(field: str) -> int:
    """VmRSS or VmHWM of this process, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ---- parts, each run in a child process -------------------------------------------------------------------------
def capture_point(spec: dict) -> dict:
    """The forward with and without the tracker's capture, interleaved (medians), and the stored bytes per token."""
    from drafttrain.drafters import Reads
    from drafttrain.drafters.eagle3 import default_aux_layer_ids
    from drafttrain.tracking.buffer import FeatureBuffer
    from drafttrain.tracking.capture import PolicyCapture

    dev = spec["device"]
    policy = random_qwen3(spec["vocab"], spec["hidden"], spec["layers"]).to(dev)
    B, T = spec["rows"], spec["length"]
    ids = torch.randint(0, spec["vocab"], (B, T), generator=torch.Generator().manual_seed(1)).to(dev)
    reads = Reads(aux_layers=default_aux_layer_ids(spec["layers"]))
    buf = FeatureBuffer(1 << 40)
    times = {"plain": [], "captured": []}
    for r in range(spec["repeats"] + 1):  # the first round warms up
        for mode in ("plain", "captured"):
            cap = (PolicyCapture(policy, reads, 5, lambda f, t0: buf.add(f), now, response_start=T // 4)
                   if mode == "captured" else None)
            sync(dev)
            t0 = now()
            if cap is not None:
                cap.start()
            try:
                with torch.enable_grad():
                    out = policy(input_ids=ids)
            finally:
                if cap is not None:
                    cap.stop()
            sync(dev)
            if r:
                times[mode].append(now() - t0)
            del out
    plain, captured = statistics.median(times["plain"]), statistics.median(times["captured"])
    toks = sum(rec["ids"].numel() for rec in buf.records)
    A, H = len(reads.aux_layers), spec["hidden"]
    per_tok = buf.nbytes / toks
    return {"forward_ms_per_token": 1e3 * plain / (B * T), "capture_ms_per_token": 1e3 * (captured - plain) / (B * T),
            "capture_over_forward": (captured - plain) / plain, "bytes_per_token": per_tok,
            "bound_bytes_per_token": (A + 1) * H * 2 + 16, "tokens_per_64mb": int((64 << 20) / per_tok)}


def step_point(spec: dict) -> dict:
    """One drafter step of the recipe on `rows` records of `length` tokens: ms (median of the timed steps) and the
    step's peak RSS above the process's before it."""
    from drafttrain.config import load_recipe
    from drafttrain.drafters import TargetHead, build_drafter
    from drafttrain.tracking import DrafterTrainer
    from drafttrain.tracking.buffer import collate

    dev = spec["device"]
    policy = random_qwen3(spec["vocab"], spec["hidden"], spec["layers"]).to(dev)
    cfg = load_recipe("eagle3_track", ["drafter.path=null", f"train.max_len={spec['max_len'] or 'null'}"])
    drafter = build_drafter(cfg.drafter, policy)
    g = torch.Generator().manual_seed(0)
    A, H, L = len(drafter.reads.aux_layers), spec["hidden"], spec["length"]
    recs = [{"aux": torch.randn(L, A * H, generator=g).to(dev, torch.bfloat16),
             "hidden": torch.randn(L, H, generator=g).to(dev, torch.bfloat16),
             "ids": torch.randint(0, spec["vocab"], (L,), generator=g, dtype=torch.int32).to(dev),
             "start": L // 8, "version": 0, "heldout": False} for _ in range(spec["rows"])]
    from accelerate import Accelerator

    acc = Accelerator(cpu=str(dev) == "cpu")  # the trainer's own default is the CPU
    tr = DrafterTrainer(drafter.to(dev), cfg.train, cfg.drafter, acc, head=TargetHead.of(policy))
    steps = max(cfg.drafter.ttt_steps, 5)

    def one() -> float:
        batch = collate(recs, steps, cfg.train.max_len, g)
        sync(dev)
        t0 = now()
        tr.step(batch)
        sync(dev)
        return now() - t0

    del policy
    base = rss_kb("VmRSS")
    exact = high_water_reset()
    ms = [one() for _ in range(spec["repeats"])]
    return {"step_ms": 1e3 * statistics.median(ms), "peak_mb": (rss_kb("VmHWM") - base) / 1024,
            "peak_exact": exact, "positions": min(L, cfg.train.max_len or L) * spec["rows"]}


def child(part: str, spec: dict) -> dict:
    """Runs one point in a fresh process; returns its JSON line (+ the process's peak RSS, from wait4)."""
    cmd = [sys.executable, __file__, f"_child={json.dumps({'part': part, **spec})}"]
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise RuntimeError(f"bench_scale: {part} {spec} failed (status {status})")
    return {**json.loads(out.strip().splitlines()[-1]), "process_peak_mb": usage.ru_maxrss / 1024}


# ---- the main job, AR against tracking -----------------------------------------------------------------------------
def world(root: Path, vocab: int, max_pos: int) -> Path:
    """A random Qwen3 (hidden 64, 4 layers) with the shipped tokenizer, prompts and a reward module in `root`."""
    from drafttrain.policy import build_tokenizer, save_policy

    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    pol = random_qwen3(vocab, 64, 4, max_pos=max_pos)
    pol.config.bos_token_id, pol.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    pol.generation_config.eos_token_id = tok.eos_token_id
    save_policy(pol, tok, str(root / "policy"))
    rows = [{"question": f"Q:{i:03d}*{1 + i % 4}=", "answer": str(i)} for i in range(400)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (root / "scale_reward.py").write_text(REWARD)
    return root


def job(root: Path, mode: str, rows: int, steps: int, new_tokens: int, max_len: int, threads: int) -> dict:
    """One main job in its own process: peak RSS (wait4) and wall."""
    base = ["recipe=eagle3_frozen", "engine.speculative=false", "online.track=false"] if mode == "ar" else [
        "recipe=eagle3_track", "online.budget_frac=0"]
    keys = [*base, f"policy.path={root / 'policy'}", f"data.path={root / 'prompts.jsonl'}", "data.prompt_field=question",
            "reward.fn=scale_reward:has_digit", "data.eval_size=8", "drafter.path=null", f"rl.steps={steps}",
            f"rl.prompts_per_step={max(1, rows // 8)}", "rl.group_size=8", "rl.eval_prompts=0",
            f"sampling.max_new_tokens={new_tokens}", f"engine.max_len={max_len}", "run.tensorboard=false",
            f"run.out_dir={root / f'run-{mode}-{rows}'}", "run.resume=false"]
    env = {**os.environ, "PYTHONPATH": f"{root}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": str(threads)}
    t0 = now()
    proc = subprocess.Popen([sys.executable, "-m", "drafttrain.online", *keys], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise RuntimeError(f"bench_scale: the {mode} job failed: {err.strip().splitlines()[-1:]}")
    recs = [json.loads(x) for x in (root / f"run-{mode}-{rows}" / "metrics.jsonl").read_text().splitlines()]
    return {"mode": mode, "rows": rows, "peak_mb": usage.ru_maxrss / 1024, "wall_s": now() - t0,
            "resp_len_mean": statistics.fmean(r["resp_len_mean"] for r in recs),
            "drafter_steps": sum(r.get("drafter_steps") or 0 for r in recs)}


def job_pairs(cfg, root: Path) -> list[dict]:
    """AR then tracking at each size: tracking's peak and wall over AR's."""
    out = []
    sizes = [(cfg.job_vocab, r, cfg.job_steps, cfg.job_new_tokens) for r in cfg.job_rows]
    sizes += [(cfg.long_vocab, r, cfg.long_steps, cfg.long_tokens) for r in cfg.long_rows]
    for vocab, rows, steps, new in sizes:
        max_len = new + 128
        w = world(root / f"w{vocab}-{max_len}", vocab, max_len)
        ar, tr = (job(w, m, rows, steps, new, max_len, cfg.threads) for m in ("ar", "tracking"))
        out.append({"vocab": vocab, "rows": rows, "max_new_tokens": new, "resp_len_mean": tr["resp_len_mean"],
                    "ar_peak_mb": ar["peak_mb"], "tracking_peak_mb": tr["peak_mb"],
                    "peak_over_ar": tr["peak_mb"] / ar["peak_mb"], "ar_wall_s": ar["wall_s"],
                    "tracking_wall_s": tr["wall_s"], "drafter_steps": tr["drafter_steps"]})
        print(format_table([out[-1]], list(out[-1])), flush=True)
    return out


def main(cfg) -> dict:
    """Runs cfg.parts; the parts it does not run are kept from an existing out file (each part's settings under
    `runs`), so that one part can be measured again without the hour of the others."""
    torch.set_num_threads(cfg.threads)
    old = json.loads(Path(cfg.out).read_text()) if Path(cfg.out).is_file() else {}
    res: dict = {"device": cfg.device, "runs": {p: r for p, r in old.get("runs", {}).items() if p not in cfg.parts}}
    res.update({p: old[p] for p in res["runs"] if p in old})
    for p in cfg.parts:
        res["runs"][p] = {"threads": cfg.threads, "device": cfg.device, "started": time.strftime("%Y-%m-%d %H:%M")}
    if "capture" in cfg.parts:
        res["capture"] = [{"vocab": v, "hidden": h, **child("capture", dict(
            vocab=v, hidden=h, layers=cfg.layers, rows=cfg.capture_batch, length=cfg.capture_len,
            repeats=cfg.repeats, device=cfg.device, threads=cfg.threads))}
            for v in cfg.vocabs for h in cfg.hiddens]
        print(format_table(res["capture"], list(res["capture"][0])), flush=True)
    if "step" in cfg.parts:
        res["step"] = [{"length": L, "max_len": m, **child("step", dict(
            vocab=cfg.step_vocab, hidden=cfg.step_hidden, layers=cfg.layers, rows=cfg.step_rows, length=L,
            max_len=m, repeats=cfg.repeats, device=cfg.device, threads=cfg.threads))}
            for L in cfg.step_lens for m in ([None, 4096] if L > 4096 else [None])]
        print(format_table(res["step"], list(res["step"][0])), flush=True)
    if "job" in cfg.parts:
        with tempfile.TemporaryDirectory() as tmp:
            res["job"] = job_pairs(cfg, Path(tmp))
    write_json(res, cfg.out)
    print(f"wrote {cfg.out}")
    return res


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0].startswith("_child="):
        spec = json.loads(args[0][len("_child="):])
        torch.set_num_threads(spec["threads"])
        point = {"capture": capture_point, "step": step_point}[spec.pop("part")]
        print(json.dumps(point(spec)))
    else:
        main(script_config(DEFAULTS))
