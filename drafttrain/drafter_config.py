"""The drafter's config section (drafter.*): what every kind shares, and one sub-section per registered kind
(drafter.<kind>), each the dataclass its registry entry carries (drafters/base.py), built here from the registry.
Part of the run configuration (config.py imports it); a field's trailing `# ...` comment is its key's doc there too.
A kind registered later (register_drafter) gets its section in the configs loaded after it (with_sections)."""
from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from drafttrain.drafters.base import DRAFTERS


@dataclass
class DrafterCommon:
    kind: str = "eagle3"  # a registered kind (drafters/base.py): eagle3 | mtp | draft_model | selfquant | suffix | auto
    path: Optional[str] = "checkpoints/eagle3"  # speculators-format folder; null = a fresh random drafter
    ttt_steps: int = 3  # training-time-test unroll length n
    ttt_decay: float = 0.8  # step i weighs ttt_decay**i


DrafterConfig = make_dataclass(
    "DrafterConfig", [(kind, k.section, field(default_factory=k.section)) for kind, k in DRAFTERS.items() if k.section],
    bases=(DrafterCommon,))
DrafterConfig.__module__ = __name__


def with_sections(drafter: DictConfig) -> DictConfig:
    """Add the sections of kinds registered after DrafterConfig was built (a structured drafter.* node)."""
    for kind, k in DRAFTERS.items():
        if k.section is not None and kind not in drafter:
            with open_dict(drafter):
                drafter[kind] = OmegaConf.structured(k.section)
    return drafter


def drafter_checks(d) -> list[tuple[bool, str, str]]:
    """(ok, key, message) for what types alone cannot say about drafter.*; config.validate raises the first failure.
    Each registered kind's own checks run on its section."""
    known = d.kind in DRAFTERS
    out = [
        (known, "drafter.kind", f"unknown drafter {d.kind!r} (known: {', '.join(sorted(DRAFTERS))})"),
        (not known or DRAFTERS[d.kind].load is not None or d.path is None, "drafter.path",
         f"must be null for drafter.kind={d.kind} (it is built from the policy, not loaded)"),
        # an empty path read as "no drafter" (a fresh random one), or as the project root / the working directory
        (d.path is None or d.path.strip() != "", "drafter.path",
         "is empty: give a folder, or drafter.path=null for a fresh random drafter"),
    ]
    for kind, k in DRAFTERS.items():
        if k.checks is not None and kind in d:
            out += [(ok, f"drafter.{kind}.{key}", msg) for ok, key, msg in k.checks(d[kind])]
    return out
