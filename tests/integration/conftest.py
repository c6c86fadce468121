"""Shared by the integration tests: the tiny policy's sizes and a saved tiny policy checkpoint (one per module)."""
from __future__ import annotations

import pytest
import torch

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from drafttrain.policy import build_policy, build_tokenizer, save_policy

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("policy") / "policy"
    save_policy(build_policy(TINY), build_tokenizer(), str(path))
    return path
