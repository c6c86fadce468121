"""Drafters: the protocols (contract.py), the registry (base.py) and one file per kind (eagle3, selfquant, suffix)."""
from drafttrain.drafters.base import DRAFTERS, build_drafter, check_compatible, register_drafter
from drafttrain.drafters.contract import Drafter, Reads, TrainableDrafter

__all__ = ["Drafter", "TrainableDrafter", "Reads", "DRAFTERS", "build_drafter", "register_drafter",
           "check_compatible"]
