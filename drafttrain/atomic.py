"""Checkpoint folders are written whole under a temporary name, then moved into place (never half-written).

Replacing an existing folder takes two renames (POSIX cannot rename over a non-empty directory): the old folder
steps aside to a backup name, the new one moves in, the backup is removed. A crash between the two renames leaves
nothing at the path and the old folder intact at the backup name: `recover_dir`, called by every reader (and by
`replace_dir` itself before it touches the backup), puts it back. `atomic_dir` is the one way a writer uses this.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def backup_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.old")


def recover_dir(path: str | Path) -> None:
    """Undo an interrupted replace_dir: the path is missing and its backup is there."""
    path, backup = Path(path), backup_path(path)
    if not path.exists() and backup.is_dir():
        os.replace(backup, path)


def replace_dir(tmp: str | Path, path: str | Path) -> None:
    """Move the finished folder `tmp` to `path` (same file system), replacing what is there."""
    path, backup = Path(path), backup_path(path)
    recover_dir(path)  # a backup left by a crash is the only copy: back in place before it could be deleted
    shutil.rmtree(backup, ignore_errors=True)
    if path.exists():
        os.replace(path, backup)
    os.replace(tmp, path)
    shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | Path, mode: int | None = 0o755, file_modes: dict[str, int] | None = None) -> Iterator[Path]:
    """`with atomic_dir(path) as tmp:` write the folder's files into tmp; on a clean exit it replaces `path` whole.

    tmp is a new hidden folder beside `path` (same file system, so the rename is atomic). Before the move, tmp gets
    `mode` (None: mkdtemp's 0700 stays) and each named file its mode in `file_modes` (safetensors writes 0600). On
    any exception tmp is removed and the folder at `path` stays as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        for name, file_mode in (file_modes or {}).items():
            os.chmod(tmp / name, file_mode)
        if mode is not None:
            os.chmod(tmp, mode)
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
