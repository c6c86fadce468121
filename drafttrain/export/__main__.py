"""python -m drafttrain.export RUN_DIR [--step N] OUT: a run's policy with the drafter that served it, ready for vLLM
(tracking/deliverable.py writes it). Prints the one line that serves it (python -m drafttrain.serve); bad input is one line naming it."""
from __future__ import annotations

import argparse
import sys

from drafttrain.tracking.deliverable import export_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafttrain.export", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a drafttrain run folder (run.out_dir)")
    ap.add_argument("out", metavar="OUT", help="the folder to write: OUT/policy, OUT/drafter, OUT/serve.json")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint ckpt/step-N (default: the latest)")
    args = ap.parse_args(argv)
    try:
        export_run(args.run_dir, args.out, args.step)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
