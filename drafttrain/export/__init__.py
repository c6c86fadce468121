"""Exporting drafters: the speculators format of EAGLE-3 checkpoints (drafters/speculators.py, where the kind keeps
its save/load) under its public names, and `python -m drafttrain.export` (__main__.py: a run's deliverable).

    save_drafter(drafter, "checkpoints/eagle3", verifier="checkpoints/policy", k=4)
    drafter = load_drafter("checkpoints/eagle3")
"""
from drafttrain.drafters.speculators import (FORMAT_VERSION, check_vllm_target, load_drafter, read_speculators_config,
                                             read_weights, save_drafter, speculators_config, weights_fingerprint)

__all__ = ["FORMAT_VERSION", "check_vllm_target", "load_drafter", "read_speculators_config", "read_weights",
           "save_drafter", "speculators_config", "weights_fingerprint"]
