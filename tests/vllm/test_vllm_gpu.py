"""The vLLM engine's GPU side, tested here on the CPU: the read-back's dtype-fitted tolerance."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm


# ---- the read-back's tolerance fits the served dtype ---------------------------------------------------------

class _Worker:
    """The worker extension's dt_probe over a stand-in model that holds what was sent in `dtype`."""

    def __init__(self, weights: dict, dtype: torch.dtype):
        from drafttrain.engines.vllm_worker import DrafttrainWorkerExtension

        self.model = torch.nn.Module()
        for name, t in weights.items():
            mod_name, _, pname = name.rpartition(".")
            if not hasattr(self.model, mod_name):
                self.model.add_module(mod_name, torch.nn.Module())
            self.model.get_submodule(mod_name).register_parameter(pname, torch.nn.Parameter(t.to(dtype)))
        self.model_runner = SimpleNamespace(device=torch.device("cpu"))
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
        self.dt_probe = DrafttrainWorkerExtension.dt_probe.__get__(self)

    def get_model(self):
        return self.model


def test_read_back_tolerance_fits_the_dtype():
    from drafttrain.engines.vllm_transfer import read_back

    g = torch.Generator().manual_seed(0)
    sent = {"embed.weight": torch.randn(48, 64, generator=g), "norm.weight": 1 + 0.1 * torch.randn(64, generator=g)}
    worker = _Worker(sent, torch.bfloat16)  # a bf16 model holds the fp32 weights rounded
    def engine(dtype: str):
        return SimpleNamespace(worker_info={"dtype": dtype}, rpc=lambda method, *args: worker.dt_probe(*args))
    read_back(engine("bfloat16"), sent, draft=False, what="update_policy")
    with pytest.raises(ValueError, match="did not land"):  # fp32's tolerance: bf16 rounding reads as a failed push
        read_back(engine("float32"), sent, draft=False, what="update_policy")
    moved = {n: t * 1.05 for n, t in sent.items()}  # a push that did not land, in bf16
    with pytest.raises(ValueError, match="update_policy: read-back of embed.weight does not match"):
        read_back(engine("bfloat16"), moved, draft=False, what="update_policy")
