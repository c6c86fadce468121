"""Drafters: EAGLE-3 (more kinds register in base.DRAFTERS)."""
from drafttrain.drafters.base import DRAFTERS, Drafter, build_drafter, check_compatible

__all__ = ["Drafter", "DRAFTERS", "build_drafter", "check_compatible"]
