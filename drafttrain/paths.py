"""Where the project's files are: the installed copy's root and its shipped assets, and how an input path resolves
(config.py re-exports these; drafters import them from here, below the config that imports the drafter registry)."""
from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("checkpoints", "recipes")  # the installed copy's asset folders (resolve_path)


def resolve_path(p: str | None) -> Path | None:
    """An input path, absolute: a relative one against the working directory, unless it names a shipped asset
    (its first part in SHIPPED) that the working directory does not hold and the installed copy does."""
    if p is None:
        return None
    path = Path(p).expanduser()
    if path.is_absolute():
        return path
    here, shipped = Path.cwd() / path, PROJECT_ROOT / path
    if not here.exists() and path.parts[0] in SHIPPED and shipped.exists():
        return shipped
    return here
