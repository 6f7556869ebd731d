"""RouterMonitor on a stock transformers MoE (one process): the logged loads are the router's own choices, a forced
collapse warns once after `patience` windows and GradientHealthGuard counts it, the model's load-balancing loss is
logged, and bad arguments are refused naming the fix."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import GradientHealthGuard, RouterMonitor
from tests._model_zoo_workers import ZooData, ZooModule


def _fit(monitor: RouterMonitor, steps: int, model: ZooModule, *more: L.Callback) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=NPUHybridStrategy(), max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor, *more])
    trainer.fit(model, DataLoader(ZooData("lm", size=4 * steps), batch_size=4))
    return trainer


def test_router_loads_are_logged_and_a_collapse_warns_once():
    L.seed_everything(0, verbose=False)
    model = ZooModule("qwen3-moe")  # 4 experts, top-2
    seen = []
    experts = model.model.model.layers[0].mlp.experts
    experts.register_forward_pre_hook(lambda m, a: seen.append(torch.bincount(a[1].reshape(-1), minlength=4)))
    monitor = RouterMonitor(log_every_n_steps=1)
    trainer = _fit(monitor, 2, model)
    last = monitor.last["model.model.layers.0.mlp.experts"]
    tokens = 4 * 16
    assert last["max_load"] == pytest.approx(float(seen[-1].max()) / tokens)
    assert last["experts_used"] == float((seen[-1] > 0).sum())
    assert "moe/model.model.layers.0.mlp.experts/max_load" in trainer.callback_metrics

    # every token to experts 0 and 1: a collapsed router
    collapsed = ZooModule("qwen3-moe")

    def to_expert_0(module, args, output):
        logits, scores, index = output
        return logits, scores, torch.arange(index.shape[1]).expand_as(index)

    for layer in collapsed.model.model.layers:
        layer.mlp.gate.register_forward_hook(to_expert_0)
    guard = GradientHealthGuard()
    with pytest.warns(UserWarning, match=r"RouterMonitor: step \d+: the router of model\.model\.layers\.0\.mlp\.experts "
                                         r"sent 100% of its tokens to one expert for 2 logged windows") as record:
        _fit(RouterMonitor(log_every_n_steps=1, patience=2), 4, collapsed, guard)
    assert sum("layers.0.mlp.experts sent" in str(w.message) for w in record) == 1
    # the guard counts every collapsed window past the patience (steps 1, 2, 3 of 0..3), both layers
    assert guard.fired["router_collapse"][0] == 2 * 3, guard.fired
    assert "check router_collapse fired 6 times" in guard.summary()


def test_the_load_balancing_loss_is_logged_where_the_model_returns_it():
    L.seed_everything(0, verbose=False)
    model = ZooModule("mixtral")
    model.model.config.output_router_logits = True  # transformers then returns (and adds) the aux loss
    seen = []
    model.model.register_forward_hook(lambda m, a, out: seen.append(float(out.aux_loss.detach())))
    trainer = _fit(RouterMonitor(log_every_n_steps=1), 2, model)
    assert float(trainer.callback_metrics["moe/aux_loss"]) == pytest.approx(seen[-1], rel=1e-6)
    with pytest.raises(ValueError, match=r"router_collapse_action"):
        GradientHealthGuard(router_collapse_action="skip")


def test_bad_arguments_and_a_model_without_experts():
    with pytest.raises(ValueError, match=r"RouterMonitor\(collapse_load=1.5\)"):
        RouterMonitor(collapse_load=1.5)
    with pytest.raises((TypeError, ValueError), match=r"log_every_n_steps"):
        RouterMonitor(log_every_n_steps=0)
    with pytest.warns(UserWarning, match="the model has no mixture-of-experts layers"):
        _fit(RouterMonitor(), 1, ZooModule("llama"))
