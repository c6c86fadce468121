"""Validation of a drafter's incoming weights: the one place that decides a load is refused (one-line errors)."""
from __future__ import annotations

import torch


def check_finite(weights: dict) -> None:
    """NaN/inf anywhere makes the sum non-finite: one cheap reduction per tensor (isfinite().all() costs 100x).
    A non-finite sum of finite values (it overflowed: an fp16 tensor past 65504) is settled element by element."""
    for name, w in weights.items():
        if w.is_floating_point() and not torch.isfinite(w.sum()) and not torch.isfinite(w).all():
            raise ValueError(f"drafter weights: {name} has NaN or inf values")


def check_tensors(want: dict[str, torch.Tensor], got: dict, what: str = "", hint: str = "",
                  dtype: bool = False, finite: bool = True) -> None:
    """Names the first missing, unexpected, mis-shaped (or, with dtype, mis-typed) or non-finite tensor."""
    what = f"{what} " if what else ""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        raise ValueError(f"drafter weights: missing {what}tensor {missing[0]!r} ({len(missing)} missing)")
    if extra:
        raise ValueError(f"drafter weights: unexpected {what}tensor {extra[0]!r}")
    for name, t in want.items():
        w = got[name]
        if tuple(w.shape) != tuple(t.shape):
            raise ValueError(f"drafter weights: {name} has shape {list(w.shape)}, expected {list(t.shape)}"
                             + (f" ({hint})" if hint else ""))
        if dtype and w.dtype != t.dtype:
            raise ValueError(f"drafter weights: {name} has dtype {w.dtype}, expected {t.dtype}")
    if finite:
        check_finite(got)
