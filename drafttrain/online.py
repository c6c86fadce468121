"""Launcher for the main job (see drafttrain/online/run.py):
    accelerate launch drafttrain/online.py recipe=eagle3_track [key=value ...]
Run as a file, so the package folder is dropped from sys.path first (its module names must not shadow others)."""
import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

from drafttrain.online.run import cli  # noqa: E402

if __name__ == "__main__":
    cli()
