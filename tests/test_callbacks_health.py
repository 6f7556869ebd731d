"""GradientHealthGuard on a single device: skip, warn, rollback, stop, logging, arguments."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from lightning_npu.callbacks import DynamicCheckpoint, GradientHealthGuard
from lightning_npu.precision import hybrid
from tests._callbacks_helpers import StepSeeded, flat_params, trainer_kwargs


def _fit(tmp_path, max_steps, callbacks, **module_kw):
    model = StepSeeded(**module_kw)
    trainer = L.Trainer(callbacks=callbacks, **trainer_kwargs(tmp_path, max_steps, log_every_n_steps=1))
    trainer.fit(model)
    return model, trainer


def test_default_guard_skips_nan_step_like_a_skipped_step(tmp_path):
    guard = GradientHealthGuard()
    model, trainer = _fit(tmp_path / "a", 8, [guard], nan_at=(3,))
    # the parameters did not move at step 3, and training went on
    torch.testing.assert_close(model.param_log[4], model.param_log[3], rtol=0, atol=0)
    assert not torch.equal(model.param_log[5], model.param_log[4])
    assert trainer.global_step == 8 and torch.isfinite(flat_params(model)).all()
    assert [e["action"] for e in guard.events if e["action"] != "warn"] == ["skip"]
    # bit-identical to Lightning's own skipped step (training_step returning None) without a guard
    ref, _ = _fit(tmp_path / "ref", 8, [], none_at=(3,))
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)
    # and without any guard, the NaN reaches the weights (the test can fail)
    bad, _ = _fit(tmp_path / "bad", 5, [], nan_at=(3,))
    assert not torch.isfinite(flat_params(bad)).all()


def test_warn_changes_nothing_and_metrics_reach_loggers(tmp_path, caplog):
    guard = GradientHealthGuard(grad_norm_range=(0.0, 1e-9), update_ratio_every=1, update_ratio_target=1e-5)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.callbacks.health"):
        model, trainer = _fit(tmp_path / "a", 5, [guard])
    ref, _ = _fit(tmp_path / "ref", 5, [])
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)
    assert "grad_norm expected (0.0, 1e-09)" in caplog.text
    metrics = trainer.callback_metrics
    for key in ("health/grad_norm", "health/grad_variance", "health/loss", "health/update_ratio"):
        assert key in metrics, key
    # the logged statistics are the real ones: the last update ratio and loss, recomputed here
    before, after = model.param_log[4], flat_params(model)
    expected_ratio = ((after - before).norm() / before.norm()).item()
    assert metrics["health/update_ratio"].item() == pytest.approx(expected_ratio, rel=1e-5)
    assert metrics["health/loss"].item() == pytest.approx(model.losses[4], rel=1e-6)


def test_rollback_restores_last_checkpoint_and_scales_lr(tmp_path):
    ck = DynamicCheckpoint(dirpath=str(tmp_path / "ck"), phase_fractions=(), intervals=(3,), keep_last_k=None)
    guard = GradientHealthGuard(nonfinite_action="rollback", rollback_lr_factor=0.5)
    model, trainer = _fit(tmp_path, 8, [ck, guard], nan_at=(5,))
    saved = torch.load(tmp_path / "ck" / "step=00000003.ckpt", weights_only=False)
    at3 = torch.cat([v.flatten() for v in saved["state_dict"].values()])
    assert not torch.equal(model.param_log[5], at3)  # steps 3 and 4 had moved the weights
    torch.testing.assert_close(model.param_log[6], at3, rtol=0, atol=0)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)
    assert trainer.global_step == 8 and torch.isfinite(flat_params(model)).all()
    assert [e["action"] for e in guard.events if e["action"] != "warn"] == ["rollback"]


def test_persistent_nan_escalates_to_rollback_then_stop(tmp_path):
    ck = DynamicCheckpoint(dirpath=str(tmp_path / "ck"), phase_fractions=(), intervals=(2,), keep_last_k=None)
    guard = GradientHealthGuard(escalate_after=2, max_rollbacks=1, rollback_lr_factor=0.5)
    model, trainer = _fit(tmp_path, 30, [ck, guard], nan_from=5, lr_schedule=True)
    assert [e["action"] for e in guard.events if e["action"] != "warn"] == ["skip", "rollback", "skip", "stop"]
    assert trainer.global_step == 9 and guard.stop_reason is not None and "nonfinite" in guard.stop_reason
    # no NaN ever reached the weights; they are those of the last good step (4)
    torch.testing.assert_close(flat_params(model), model.param_log[5], rtol=0, atol=0)
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(0.025)]


def test_repeated_warnings_are_rate_limited_per_check_and_summarised(tmp_path, caplog):
    # a band that every step misses (what LLM bands do to a small model): one full warning, a note that the
    # rest are counted, a reminder at 10x the limit, and a summary at train end with the real counts
    guard = GradientHealthGuard(grad_norm_range=(0.0, 1e-9), grad_variance_range=None, update_ratio_target=None,
                                max_warnings=1)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.callbacks.health"):
        _fit(tmp_path, 12, [guard])
    messages = [r.getMessage() for r in caplog.records if r.name == "lightning_npu.callbacks.health"]
    full = [m for m in messages if m.startswith("GradientHealthGuard: step ")]
    assert len(full) == 1 and "step 0:" in full[0] and "Further grad_norm warnings are counted" in full[0]
    assert [m for m in messages if "has fired" in m] == [
        "GradientHealthGuard: grad_norm has fired 10 times (first step 0, last step 9)."
    ]
    assert messages[-1] == "GradientHealthGuard summary: check grad_norm fired 12 times (first step 0, last step 11)."
    assert len(messages) == 3
    assert len([e for e in guard.events if e["action"] == "warn"]) == 12  # every warning is still recorded


def test_actions_are_always_logged_and_counted_in_the_summary(tmp_path, caplog):
    guard = GradientHealthGuard(max_warnings=0, grad_variance_range=None, update_ratio_target=None,
                                grad_norm_range=None)
    with caplog.at_level(logging.WARNING, logger="lightning_npu.callbacks.health"):
        _fit(tmp_path, 8, [guard], nan_at=(3, 6))
    messages = [r.getMessage() for r in caplog.records if r.name == "lightning_npu.callbacks.health"]
    assert sum("skipped the optimizer step (nonfinite at step" in m for m in messages) == 2
    assert guard.summary() == "GradientHealthGuard summary: check nonfinite fired 2 times (first step 3, last step 6)."


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(nonfinite_action="explode"), "nonfinite_action='explode'"),
        (dict(update_ratio_action="skip"), "update_ratio_action='skip'"),
        (dict(grad_norm_range=(10, 1)), r"grad_norm_range=\(10, 1\)"),
        (dict(grad_norm_range=5), "grad_norm_range=5"),
        (dict(rollback_lr_factor=2.0), "rollback_lr_factor=2.0"),
        (dict(escalate_after=0), "escalate_after=0"),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        GradientHealthGuard(**kwargs)


def test_default_bands_are_quiet_on_healthy_runs_and_fire_on_a_gradient_blowup(tmp_path, caplog):
    """Relative bands: each statistic against its own running mean, after a warm-up. Quiet on the helper model and
    on Lightning's BoringModel (which sat outside the old absolute grad_norm/grad_variance/update_ratio bands from
    step 0: 16 warnings in 10 steps), and a finite x1000 gradient at step 15 is flagged, at that step (and the update it made)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    guard = GradientHealthGuard()
    trainer = L.Trainer(callbacks=[guard], **trainer_kwargs(tmp_path / "boring", 10, log_every_n_steps=1))
    trainer.fit(BoringModel())
    assert guard.events == [] and guard.summary() == ""

    guard = GradientHealthGuard()
    _fit(tmp_path / "quiet", 30, [guard], lr_schedule=True)
    assert guard.events == [] and guard.warnings == 0

    guard = GradientHealthGuard()
    with caplog.at_level(logging.WARNING, logger="lightning_npu.callbacks.health"):
        _fit(tmp_path / "blowup", 30, [guard], blowup_at=(15,))
    # the step's gradients, then the weights it moved by 11% (and Adam's momentum by 10% the next step)
    assert [(e["step"], e["action"], e["checks"]) for e in guard.events] == [
        (15, "warn", ["grad_norm_spike", "grad_variance_spike"]), (15, "warn", ["update_ratio"]),
        (16, "warn", ["update_ratio"])]
    assert "step 15: grad_norm=" in caplog.text and "grad_norm_spike expected <= 10.0 x running mean" in caplog.text


class _Rows(L.pytorch.loggers.Logger):
    """What a CSV/TensorBoard logger receives: one dict per written step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    name, version = "rows", 0

    @property
    def experiment(self):
        return None

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.setdefault(step, {}).update(metrics)


class _LoggedLoss(StepSeeded):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_a_logged_row_holds_that_steps_numbers_under_npu_hybrid(tmp_path, monkeypatch):
    """metrics.csv showed step 0's health/grad_norm (8.43) and health/loss (5.59) in step 9's row beside that
    step's grad_norm (2.67) and train_loss (4.00): the guard logged on other steps than the loggers wrote. Now every
    written row's health/* are that step's, health/grad_norm is the precision plugin's npu/grad_norm (pre-clip,
    unscaled), and the plugin's names are namespaced (the bare ones kept this release)."""
    rows = _Rows()
    model = _LoggedLoss()
    trainer = L.Trainer(callbacks=[GradientHealthGuard()], strategy="npu_hybrid", gradient_clip_val=0.01,
                        **trainer_kwargs(tmp_path, 9, log_every_n_steps=3, logger=rows))
    monkeypatch.setattr(hybrid, "_legacy_warned", False)
    with pytest.warns(DeprecationWarning, match="npu/grad_norm") as record:
        trainer.fit(model)
    assert len([w for w in record if "bare names" in str(w.message)]) == 1  # once, not per step
    assert sorted(rows.rows) == [2, 5, 8]
    for step, row in rows.rows.items():
        assert row["health/loss"] == pytest.approx(model.losses[step], rel=1e-6) == row["train_loss"]
        assert row["health/grad_norm"] == pytest.approx(row["npu/grad_norm"], rel=1e-6)
        assert row["npu/grad_norm"] > 0.01  # the pre-clip norm: clipping was active
        before, after = model.param_log[step], model.param_log.get(step + 1, flat_params(model))
        assert row["health/update_ratio"] == pytest.approx(((after - before).norm() / before.norm()).item(), rel=1e-5)
        assert row["grad_norm"] == row["npu/grad_norm"]  # deprecated bare name, this release only
