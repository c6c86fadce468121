"""The main job's command line: recipe -> Config -> the GRPO loop with a DraftTracker (drafttrain/rl/job.py).

    accelerate launch drafttrain/online.py recipe=eagle3_track [key=value ...]
    python -m drafttrain.online recipe=eagle3_track rl.steps=5

Both commands run this module as __main__. Bad input (a config key, a missing file) ends in one line naming it.
"""
import sys

from drafttrain.config import ConfigError, load_recipe, usage
from drafttrain.rl.job import main


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
    except (ConfigError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    cli()
