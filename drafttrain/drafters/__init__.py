"""Drafters: the protocols (contract.py), the registry (base.py), one file per kind (eagle3, mtp, draft_model,
selfquant, suffix, auto) and the EAGLE-3 speculators format (speculators.py)."""
from drafttrain.drafters.base import DRAFTERS, build_drafter, check_compatible, register_drafter
from drafttrain.drafters.contract import Drafter, Reads, TrainableDrafter
from drafttrain.drafters.targets import TargetHead, Targets

__all__ = ["Drafter", "TrainableDrafter", "Reads", "DRAFTERS", "build_drafter", "register_drafter",
           "check_compatible", "TargetHead", "Targets"]
