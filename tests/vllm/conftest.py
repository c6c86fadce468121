"""The vLLM suite's fixtures: engines from the session pool (tests/conftest.py), one intra-op thread."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def make_engine(pool):
    return pool.get


@pytest.fixture(autouse=True, scope="session")
def few_threads():
    """Tiny models are op-overhead bound; on a shared 2-core box extra intra-op threads only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
