"""Checkpoint folders (drafttrain/atomic.py): replaced whole, and a crash between the two renames of a replacement
leaves the old folder where every reader finds it again (it was left under a hidden backup name: the checkpoint
looked missing)."""
from __future__ import annotations

import os

import pytest
import torch

from drafttrain.atomic import atomic_dir, backup_path, recover_dir, replace_dir
from drafttrain.export import load_drafter, save_drafter
from tests.unit.test_drafter import perturbed


def folder(path, text):
    path.mkdir()
    (path / "f.txt").write_text(text)
    return path


def crash_on_second_replace(monkeypatch):
    """os.replace works once (the old folder steps aside), then the process 'dies' before the new one moves in."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_replace_dir_replaces_whole(tmp_path):
    path = folder(tmp_path / "ckpt", "old")
    replace_dir(folder(tmp_path / ".new", "new"), path)
    assert (path / "f.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or backup left
    replace_dir(folder(tmp_path / ".fresh", "fresh"), tmp_path / "other")  # nothing to replace
    assert (tmp_path / "other" / "f.txt").read_text() == "fresh"


def test_atomic_dir_moves_in_on_success_and_leaves_the_old_folder_on_error(tmp_path):
    path = folder(tmp_path / "ckpt", "old")
    with pytest.raises(RuntimeError, match="half-written"):
        with atomic_dir(path) as tmp:
            (tmp / "f.txt").write_text("new")
            raise RuntimeError("half-written")
    assert (path / "f.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the temp folder is gone
    with atomic_dir(path, file_modes={"f.txt": 0o600}) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        (tmp / "f.txt").write_text("new")
    assert (path / "f.txt").read_text() == "new"
    assert (path.stat().st_mode & 0o777, (path / "f.txt").stat().st_mode & 0o777) == (0o755, 0o600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with atomic_dir(tmp_path / "a" / "b", mode=None) as tmp:  # parents made; mode None keeps mkdtemp's 0700
        pass
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700


def test_a_crash_between_the_renames_keeps_the_old_folder(tmp_path, monkeypatch):
    path = folder(tmp_path / "ckpt", "old")
    crash_on_second_replace(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(folder(tmp_path / ".new", "new"), path)
    monkeypatch.undo()
    assert not path.exists() and backup_path(path).is_dir()
    recover_dir(path)
    assert (path / "f.txt").read_text() == "old" and not backup_path(path).exists()
    # the next replacement after a crash recovers first: the backup (the only copy) is never deleted unread
    crash_on_second_replace(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(folder(tmp_path / ".new2", "new2"), path)
    monkeypatch.undo()
    replace_dir(folder(tmp_path / ".new3", "new3"), path)
    assert (path / "f.txt").read_text() == "new3"


def test_drafter_checkpoint_survives_a_crash_while_replaced(tmp_path, drafter, monkeypatch):
    old, new = perturbed(drafter, seed=1), perturbed(drafter, seed=2)
    path = save_drafter(old, tmp_path / "eagle3")
    crash_on_second_replace(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save_drafter(new, path)
    monkeypatch.undo()
    loaded = load_drafter(path)  # was: FileNotFoundError, the weights sitting in .eagle3.old
    assert torch.equal(loaded.state_dict()["fc.weight"], old.state_dict()["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3"]
