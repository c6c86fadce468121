"""The main job's command line: recipe -> Config -> the GRPO loop with a DraftTracker (drafttrain/rl/job.py).

    accelerate launch drafttrain/online.py recipe=eagle3_track [key=value ...]
    python -m drafttrain.online recipe=eagle3_track rl.steps=5

Both commands run this module as __main__. Bad input (a config key, a missing file) ends in one line naming it.
"""
import sys

from drafttrain.config import RECIPES_DIR, ConfigError, key_docs, load_recipe
from drafttrain.data import RewardError
from drafttrain.rl.job import main
from drafttrain.rl.runfolder import RunStopped


def recipe_summaries() -> list[tuple[str, str]]:
    """(name, first comment line without its `# name:` prefix) for each recipes/*.yaml."""
    out = []
    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        first = (p.read_text().splitlines() or [""])[0].lstrip("#").strip()
        out.append((p.stem, first.removeprefix(f"{p.stem}:").strip()))
    return out


def usage() -> str:
    """The main job's --help: how to launch it, the recipes, and every key with its default and doc."""
    def show(v) -> str:  # as an override writes it
        if isinstance(v, (bool, type(None))):
            return {None: "null", True: "true", False: "false"}[v]
        return "[" + ",".join(map(str, v)) + "]" if isinstance(v, list) else str(v)

    keys = [(f"{k}={show(v)}", doc) for k, (v, doc) in key_docs().items() if k != "recipe"]  # recipe=: above
    w = max(len(k) for k, _ in keys) + 2
    return "\n".join([
        "usage: accelerate launch [-q] drafttrain/online.py [recipe=NAME] [key=value ...]",
        "       python -m drafttrain.online [recipe=NAME] [key=value ...]",
        "",
        "GRPO on the policy with speculative rollouts and a drafter that tracks it. recipe= names recipes/NAME.yaml or",
        "a .yaml path (default eagle3_track); each key=value overrides the recipe. A rerun into the same run.out_dir",
        "resumes from its latest checkpoint. accelerate's own options go before the script; its -q ends a failed",
        "single-process launch without accelerate's traceback (README: Troubleshooting).",
        "",
        "recipes:",
        *(f"  {name:<22}{line}" for name, line in recipe_summaries()),
        "",
        "keys (key=default  doc):",
        *(f"  {k:<{w}}{doc}" for k, doc in keys),
    ])


def cli(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(usage())
        return
    recipe = [a.split("=", 1)[1] for a in args if a.startswith("recipe=")]
    overrides = [a for a in args if not a.startswith("recipe=")]
    try:
        cfg = load_recipe(recipe[-1] if recipe else "eagle3_track", overrides)
        main(cfg)
    except (ConfigError, FileNotFoundError, RewardError, RunStopped) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    cli()
