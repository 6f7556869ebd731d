"""MixedPrecisionOptimizer and SkippableLRScheduler (lightning_npu.parallel.optim.mixed_precision), in one process."""

from __future__ import annotations

import io

import lightning as L
import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_npu  # noqa: F401  (registers npu_hybrid)
from lightning_npu.callbacks import _stats
from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.optim.distributed import DistributedOptimizer
from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer, SkippableLRScheduler, unwrap_optimizer
from lightning_npu.precision.loss_scaler import DynamicLossScaler


def _bf16_linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).to(torch.bfloat16)


def _backward(model: torch.nn.Module, scale: float, poison: bool = False) -> None:
    loss = model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum() * scale
    loss.backward()
    if poison:
        model.weight.grad.view(-1)[0] = float("inf")


def test_masters_unscale_step_and_skip():
    """bf16 parameters: the user's optimizer steps fp32 masters (not the module's tensors), whose gradients are the
    unscaled model gradients; the bf16 parameters follow the masters; an overflow changes neither and backs the
    scale off (hysteresis 1); a plain step outside a training step (DCP's state init) leaves the scaler alone."""
    model = _bf16_linear()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = DynamicLossScaler(init_scale=8.0, hysteresis=1)
    opt = MixedPrecisionOptimizer(sgd, scaler, master_weights=True)
    masters = opt.main_params()
    assert [m.dtype for m in masters] == [torch.float32] * 2
    assert all(m is not p for m, p in zip(masters, model.parameters()))
    assert opt.param_groups is sgd.param_groups and opt.state is sgd.state  # shared, not copied

    _backward(model, scale=8.0)
    expected_grad = model.weight.grad.float() / 8.0
    before = masters[0].detach().clone()
    assert opt.prepare_grads() is False
    assert torch.equal(masters[0].grad, expected_grad)
    # the module's 16-bit `.grad` shows the unscaled main gradient (Lightning's hooks read it), a copy
    assert model.weight.grad.dtype == torch.bfloat16 and torch.equal(model.weight.grad, expected_grad.bfloat16())
    opt.step()
    assert torch.equal(masters[0], before - 0.5 * expected_grad)
    assert torch.equal(model.weight, masters[0].to(torch.bfloat16))
    assert (opt.steps, opt.step_skipped, scaler.scale) == (1, False, 8.0)

    opt.hide_model_grads()  # the strategy's backward: autograd starts from None, not from the shown copy
    assert model.weight.grad is None
    opt.zero_grad()
    _backward(model, scale=8.0, poison=True)
    weights, master_weights = model.weight.detach().clone(), masters[0].detach().clone()
    assert opt.prepare_grads() is True
    assert opt.clip_grad_norm_(1.0) is None  # nothing to clip on a skipped step
    opt.step()
    assert torch.equal(model.weight, weights) and torch.equal(masters[0], master_weights)
    assert (opt.steps, opt.step_skipped, scaler.scale) == (2, True, 4.0)

    opt.zero_grad()
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt.step()  # not prepared: the plain step
    assert (opt.steps, opt.step_skipped, scaler.scale, scaler.state_dict()["growth_tracker"]) == (2, True, 4.0, 0)


def test_gradient_statistics_once_per_step_and_shared(monkeypatch):
    """Clipping and the guards' `_stats.gradient_statistics` read the one per-step computation (over the unscaled
    gradients, with the pp group the wrapper was given); the next step computes afresh."""
    calls = []
    real = gn.gradient_statistics

    def counting(params, pp_group=None):
        calls.append(pp_group)
        return real(params, pp_group=None)  # (a stand-in group: this test runs without process groups)

    monkeypatch.setattr(gn, "gradient_statistics", counting)
    model = torch.nn.Linear(4, 3)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), DynamicLossScaler(init_scale=4.0),
                                  pp_group="pp-group-token")
    for _ in range(2):
        opt.zero_grad()
        (model(torch.ones(2, 4)).sum() * 4.0).backward()
        reference = torch.nn.utils.get_total_norm([p.grad / 4.0 for p in model.parameters()])
        stats = _stats.gradient_statistics(None, None, LightningOptimizer(opt))
        assert torch.allclose(stats[0], reference)
        total = opt.clip_grad_norm_(1e9)
        assert torch.equal(total, stats[0]) and opt.gradient_statistics() is stats
        opt.step()
    assert calls == ["pp-group-token", "pp-group-token"]


def test_skippable_scheduler_skips_exactly_the_step_after_a_skip_and_round_trips():
    """Each skipped optimizer step skips one scheduler step (the next); the user's scheduler keeps its class and its
    own state dict, which loads into a fresh scheduler (also through torch.load(weights_only=True))."""
    model = torch.nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    opt = MixedPrecisionOptimizer(sgd, DynamicLossScaler(init_scale=4.0))
    wrapped = SkippableLRScheduler(sched, opt)
    epochs = []
    for poison in (False, True, True, False, False):
        opt.zero_grad()
        (model(torch.ones(2, 4)).sum() * 4.0).backward()
        if poison:
            model.weight.grad.view(-1)[0] = float("nan")
        opt.prepare_grads()
        opt.step()
        wrapped.step()
        epochs.append(sched.last_epoch)
    assert epochs == [1, 1, 1, 2, 3]
    wrapped.step()  # a second scheduler step after the same optimizer step is not skipped
    assert sched.last_epoch == 4 and wrapped.last_epoch == 4 and wrapped.get_last_lr() == sched.get_last_lr()
    assert type(sched) is torch.optim.lr_scheduler.StepLR
    assert wrapped.state_dict() == sched.state_dict()

    buffer = io.BytesIO()
    torch.save(wrapped.state_dict(), buffer)
    buffer.seek(0)
    fresh_sgd = torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=1.0)
    fresh = SkippableLRScheduler(torch.optim.lr_scheduler.StepLR(fresh_sgd, step_size=1, gamma=0.5),
                                 MixedPrecisionOptimizer(fresh_sgd))
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.scheduler.state_dict() == sched.state_dict() and fresh.last_epoch == 4


def test_wrapper_state_dict_round_trip_keeps_sharing():
    model = torch.nn.Linear(4, 3)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    model(torch.ones(2, 4)).sum().backward()
    opt.prepare_grads()
    opt.step()
    state = opt.state_dict()
    other = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    other.load_state_dict(state)
    assert other.state is other.optimizer.state and other.param_groups is other.optimizer.param_groups
    assert torch.equal(other.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
    assert issubclass(DistributedOptimizer, MixedPrecisionOptimizer)  # ZeRO-1 shares the one step
    with pytest.raises(ValueError, match="already a MixedPrecisionOptimizer"):
        MixedPrecisionOptimizer(opt)


class _Poisoned(BoringModel):
    """A step-interval LambdaLR; an inf gradient after the backward of global step 1."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}

    def on_after_backward(self):
        if self.trainer.global_step == 1:
            self.layer.weight.grad.view(-1)[0] = float("inf")


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_trainer_wraps_optimizer_and_scheduler_without_rewriting_classes(tmp_path, precision):
    """Under npu_hybrid the Trainer's optimizer is the wrapper over the user's optimizer and its step-interval
    scheduler a SkippableLRScheduler over the user's scheduler, whose class is unchanged; the overflow at step 1
    skips that optimizer step and exactly one scheduler step."""
    model = _Poisoned()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="npu_hybrid", precision=precision, max_steps=4,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model)
    opt = unwrap_optimizer(trainer.optimizers[0])
    assert type(opt) is MixedPrecisionOptimizer and type(opt.optimizer) is torch.optim.SGD
    config = trainer.lr_scheduler_configs[0]
    assert isinstance(config.scheduler, SkippableLRScheduler) and config.scheduler.scheduler is model.sched
    assert type(model.sched) is torch.optim.lr_scheduler.LambdaLR
    assert (opt.steps, trainer.precision_plugin.skipped_steps, model.sched.last_epoch) == (4, 1, 3)
    assert (len(opt.master_pairs) > 0) == (precision == "bf16-true")
