"""The long-tail comparison of bench_drafters alone (issue 20's chooser): each kind with toggle + auto k, and
drafter.kind=auto, interleaved over many seeds; mean, median and spread of the wall times, auto over the best single.

    python bench/probes/auto_longtail.py [repeats=20] [kinds=[eagle3,mtp,draft_model,suffix]] [out=/tmp/lt.json]
"""
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_drafters import DEFAULTS, long_tail, setup  # noqa: E402

from drafttrain.config import script_config  # noqa: E402


def main(cfg):
    rc, policy, _, _, prompts, params = setup(cfg)
    lt = long_tail(cfg, rc, policy, prompts, params)
    runs = lt["wall_s_runs"]
    med = {k: statistics.median(v) for k, v in runs.items()}
    best_mean = min((k for k in runs if k not in ("auto", "ar")), key=lambda k: lt["wall_s"][k])
    best_med = min((k for k in runs if k not in ("auto", "ar")), key=med.get)
    for k, v in runs.items():
        print(f"{k:12s} mean {statistics.fmean(v):.4f} sd {statistics.stdev(v):.4f} median {med[k]:.4f}")
    print(f"auto/best mean {lt['wall_s']['auto'] / lt['wall_s'][best_mean]:.3f} ({best_mean}); "
          f"median {med['auto'] / med[best_med]:.3f} ({best_med}); steps {lt['auto_kinds_steps']}")
    Path(cfg.out).write_text(json.dumps({**lt, "median": med}, indent=1))


if __name__ == "__main__":
    main(script_config({**DEFAULTS, "kinds": ["eagle3", "mtp", "draft_model", "suffix"], "repeats": 20,
                        "out": "/tmp/lt.json"}))
