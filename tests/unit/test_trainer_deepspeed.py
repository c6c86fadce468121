"""DrafterTrainer's DeepSpeed settings, without starting DeepSpeed: the recipe's batch and clipping win over the
accelerate config's, and a config the trainer cannot honour is refused in one line naming its key. (Training under
ZeRO-2 on 2 processes: tests/integration/test_deepspeed.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from drafttrain.config import ConfigError
from drafttrain.tracking.trainer import _configure_deepspeed, process_group_kwargs


def _acc(**ds):
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 2}, **ds})
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), num_processes=2)


def test_the_recipe_sets_batch_and_clipping():
    acc = _acc(gradient_clipping=5.0, train_micro_batch_size_per_gpu="auto")
    _configure_deepspeed(acc, SimpleNamespace(batch_size=16, max_grad_norm=1.0))
    ds = acc.state.deepspeed_plugin.deepspeed_config
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"], ds["gradient_clipping"]) == (16, 32, 1.0)
    assert ds["gradient_accumulation_steps"] == 1
    _configure_deepspeed(acc, SimpleNamespace(batch_size=4, max_grad_norm=float("inf")))
    assert ds["gradient_clipping"] == 0.0  # DeepSpeed's "no clipping"


@pytest.mark.parametrize("ds,key", [({"zero_optimization": {"stage": 3}}, "deepspeed_config.zero_stage"),
                                    ({"gradient_accumulation_steps": 4}, "deepspeed_config.gradient_accumulation")])
def test_a_config_the_trainer_cannot_honour_is_refused(ds, key):
    with pytest.raises(ConfigError, match=key) as e:
        _configure_deepspeed(_acc(**ds), SimpleNamespace(batch_size=16, max_grad_norm=1.0))
    assert "\n" not in str(e.value)


def test_several_processes_use_gloo_without_a_gpu_and_the_default_with_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert [k.backend for k in process_group_kwargs(cuda=False)] == ["gloo"]
    assert process_group_kwargs(cuda=True) == []  # nccl on a GPU node: gloo there would move every tensor via host
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert process_group_kwargs(cuda=False) == []
