"""`GradientHealthGuard`: catch a diverging or poisoned step before the optimizer applies it.

One NaN in one gradient, applied once, poisons every weight it touches and the run is lost;
caught between backward and `optimizer.step` it costs one skipped step. The guard reads the
statistics that predict such failures (gradient norm and variance, loss level and spikes, the
update-to-weight ratio), takes one decision per step, all-reduces it (max severity) so that every
rank skips, rolls back or stops together, and logs every statistic to the Lightning loggers.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch.callbacks import Callback

from lightning_npu.callbacks import _store
from lightning_npu.callbacks._dist import agree_max, broadcast, find_callback
from lightning_npu.callbacks._stats import gradient_statistics, params_norm_and_delta
from lightning_npu.callbacks.dynamic_checkpoint import DynamicCheckpoint
from lightning_npu.parallel.checkpoint.safe_load import check_plain_data, refusing_unsafe
from lightning_npu.parallel.optim.mixed_precision import stepped_params
from lightning_npu.validate import check_choice, check_int, check_number, check_path, is_number

log = logging.getLogger(__name__)

ACTIONS = {"ignore": 0, "warn": 1, "skip": 2, "rollback": 3, "stop": 4}
_NAMES = {v: k for k, v in ACTIONS.items()}
CHECKS = ("nonfinite", "grad_norm", "loss", "grad_variance", "loss_spike", "update_ratio", "grad_norm_spike",
          "grad_variance_spike")


_OWNER = "GradientHealthGuard"


def _action(arg: str, value: Any, allowed: Sequence[str] = tuple(ACTIONS)) -> int:
    return ACTIONS[check_choice(arg, value, allowed, owner=_OWNER)]


def _range(arg: str, value: Any) -> Optional[tuple[float, float]]:
    """``(low, high)`` of real numbers, low < high; a string or a bool inside is refused, not cast."""
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(is_number(v) for v in value)):
        raise ValueError(f"{_OWNER}({arg}={value!r}): pass (low, high), e.g. (1e-3, 10.0), or None to disable.")
    low, high = (float(v) for v in value)
    if not low < high:
        raise ValueError(f"{_OWNER}({arg}={value!r}): low must be below high, e.g. {arg}=({high}, {low}).")
    return low, high


def _power_of_ten(x: float) -> bool:
    exponent = round(math.log10(x)) if x > 0 else 0
    return x == 10**exponent


class GradientHealthGuard(Callback):
    """Per-step gradient and loss health checks with warn / skip / rollback / stop actions.

    Two kinds of band. Relative (the defaults): the loss, the gradient norm and the gradient variance are flagged
    when they exceed ``*_spike_factor`` times their own running mean (an EMA, decay ``loss_ema_decay``), after
    ``warmup_steps`` good steps; a model of any size is measured against itself. Absolute: ranges are
    ``(low, high)`` or ``None`` to disable a check (only ``loss_range`` is on by default: no model's size or init
    makes a loss above 1e4 healthy). Actions: ``"ignore"``, ``"warn"``,
    ``"skip"`` (drop this optimizer step), ``"rollback"`` (reload weights and optimizer state from the
    newest complete checkpoint, LR times ``rollback_lr_factor``), ``"stop"`` (end training after
    skipping this step). ``escalate_after`` consecutive skipped steps become a rollback, and more
    than ``max_rollbacks`` rollbacks become a stop, so persistent NaN cannot loop forever.
    The update ratio |dw|/|w| is measured on the steps whose ``(step + 1)`` is a multiple of ``update_ratio_every``
    (default: the Trainer's ``log_every_n_steps``, so that every row the loggers write holds that step's ratio; it
    needs a copy of the weights) and flagged, after the warm-up, when it is more than ``update_ratio_tolerance``
    times off ``update_ratio_target`` (1e-3, the usual rule of thumb: Adam moves each weight by about lr, so the
    ratio is about lr / rms(w)); it is known only after the step, so ``"skip"`` is not accepted for it.
    With a `RouterMonitor` among the callbacks, a collapsed mixture-of-experts router (one expert taking more than
    its ``collapse_load`` of a layer's tokens for ``patience`` logged windows) is the ``router_collapse`` check:
    ``router_collapse_action`` is ``"warn"`` (counted and summarised like the others) or ``"ignore"``.

    Every statistic is logged on every step it is computed (``health/grad_norm``, ``health/grad_variance``,
    ``health/loss``; ``health/update_ratio`` when measured), so a logged row holds that step's numbers: ``health/loss``
    is the row's ``train_loss`` and ``health/grad_norm`` is the precision plugin's ``npu/grad_norm`` (both the
    pre-clip norm of the unscaled gradients, from one shared computation).

    Warnings are rate-limited per check: the first ``max_warnings`` of each check are logged in full,
    later ones only at 10x, 100x, ... that number, and the end of training logs how often each check
    fired (first and last step). An absolute band a model sits outside on every step then costs one line per
    check, not a flood.
    Skips, rollbacks and stops are always logged.
    """

    def __init__(
        self,
        nonfinite_action: str = "skip",
        grad_norm_range: Optional[Sequence[float]] = None,
        grad_norm_action: str = "warn",
        loss_range: Optional[Sequence[float]] = (0.0, 1e4),
        loss_action: str = "warn",
        grad_variance_range: Optional[Sequence[float]] = None,
        grad_variance_action: str = "warn",
        loss_spike_factor: Optional[float] = 10.0,
        loss_spike_action: str = "warn",
        loss_spike_warmup: Optional[int] = None,
        loss_ema_decay: float = 0.98,
        update_ratio_target: Optional[float] = 1e-3,
        update_ratio_tolerance: float = 100.0,
        update_ratio_action: str = "warn",
        update_ratio_every: Optional[int] = None,
        escalate_after: Optional[int] = 3,
        max_rollbacks: int = 2,
        rollback_lr_factor: Optional[float] = 0.5,
        checkpoint_dir: Optional[str] = None,
        max_warnings: int = 3,
        grad_norm_spike_factor: Optional[float] = 10.0,
        grad_variance_spike_factor: Optional[float] = 100.0,
        warmup_steps: int = 10,
        router_collapse_action: str = "warn",
    ) -> None:
        _action("router_collapse_action", router_collapse_action, ("ignore", "warn"))
        self.router_collapse_action = router_collapse_action
        self._router_seen: dict[int, int] = {}  # RouterMonitor -> its collapse events already counted
        self._router_limit: Optional[str] = None
        severity = {
            "nonfinite": _action("nonfinite_action", nonfinite_action),
            "grad_norm": _action("grad_norm_action", grad_norm_action),
            "loss": _action("loss_action", loss_action),
            "grad_variance": _action("grad_variance_action", grad_variance_action),
            "loss_spike": _action("loss_spike_action", loss_spike_action),
            "update_ratio": _action(
                "update_ratio_action", update_ratio_action, ("ignore", "warn", "rollback", "stop")
            ),
        }
        # the relative bands act as their absolute check's action says
        severity["grad_norm_spike"], severity["grad_variance_spike"] = severity["grad_norm"], severity["grad_variance"]
        self.severity = severity
        self.grad_norm_range = _range("grad_norm_range", grad_norm_range)
        self.loss_range = _range("loss_range", loss_range)
        self.grad_variance_range = _range("grad_variance_range", grad_variance_range)
        o = _OWNER
        loss_spike_factor = check_number("loss_spike_factor", loss_spike_factor, above=1.0, example=10.0,
                                         allow_none=True, owner=o)
        loss_ema_decay = check_number("loss_ema_decay", loss_ema_decay, above=0.0, below=1.0, example=0.98, owner=o)
        update_ratio_target = check_number("update_ratio_target", update_ratio_target, above=0.0, example=1e-5,
                                           allow_none=True, owner=o)
        update_ratio_tolerance = check_number("update_ratio_tolerance", update_ratio_tolerance, above=1.0,
                                              example=100.0, owner=o)
        check_int("update_ratio_every", update_ratio_every, minimum=1, example=50, allow_none=True, owner=o)
        check_int("loss_spike_warmup", loss_spike_warmup, minimum=0, example=10, allow_none=True, owner=o)
        check_int("warmup_steps", warmup_steps, minimum=0, example=10, owner=o)
        grad_norm_spike_factor = check_number("grad_norm_spike_factor", grad_norm_spike_factor, above=1.0,
                                              example=10.0, allow_none=True, owner=o)
        grad_variance_spike_factor = check_number("grad_variance_spike_factor", grad_variance_spike_factor,
                                                  above=1.0, example=100.0, allow_none=True, owner=o)
        check_int("escalate_after", escalate_after, minimum=1, example=3, allow_none=True, owner=o)
        check_int("max_rollbacks", max_rollbacks, minimum=0, example=2, owner=o)
        check_int("max_warnings", max_warnings, minimum=0, example=3, owner=o)
        rollback_lr_factor = check_number("rollback_lr_factor", rollback_lr_factor, above=0.0, at_most=1.0,
                                          example=0.5, allow_none=True, owner=o)
        checkpoint_dir = check_path("checkpoint_dir", checkpoint_dir, owner=o)
        self.loss_spike_factor = loss_spike_factor
        self.grad_norm_spike_factor = grad_norm_spike_factor
        self.grad_variance_spike_factor = grad_variance_spike_factor
        # `loss_spike_warmup`: the name from when only the loss had a relative band
        self.warmup_steps = warmup_steps if loss_spike_warmup is None else loss_spike_warmup
        self.loss_ema_decay = loss_ema_decay
        self.update_ratio_target = update_ratio_target
        self.update_ratio_tolerance = update_ratio_tolerance
        self.update_ratio_every = update_ratio_every
        self.escalate_after = escalate_after
        self.max_rollbacks = max_rollbacks
        self.rollback_lr_factor = rollback_lr_factor
        self.checkpoint_dir = checkpoint_dir
        self.max_warnings = max_warnings
        # state (saved in checkpoints so that a resumed run judges spikes the same way)
        self.loss_ema: Optional[float] = None
        self.grad_norm_ema: Optional[float] = None
        self.grad_variance_ema: Optional[float] = None
        self.good_steps = 0
        self.skipped_steps = 0
        self.rollbacks = 0
        self.consecutive_bad = 0
        self.warnings = 0
        # check -> [times fired, first step, last step], for the rate limit and the end-of-training summary
        self.fired: dict[str, list[int]] = {}
        self.stop_reason: Optional[str] = None
        self.events: list[dict[str, Any]] = []
        self._losses: list[torch.Tensor] = []
        self._before: Optional[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = None

    # ---- hooks --------------------------------------------------------------------------
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        params = stepped_params(optimizer)
        if all(p.grad is None for p in params):  # no backward this step (training_step returned None)
            return
        stats = gradient_statistics(trainer, pl_module, optimizer)
        have_loss = bool(self._losses)  # manual optimization may step without a loss we saw
        loss = self._step_loss(trainer, pl_module).reshape(1).to(stats.device) if have_loss else stats[:1] * 0
        self._losses.clear()
        grad_norm, grad_var, loss_value = torch.cat([stats, loss]).tolist()
        if not have_loss:
            loss_value = float("nan")
        flags = self._flags(grad_norm, grad_var, loss_value, have_loss)
        agreed = agree_max(trainer, [float(max((self.severity[c] for c in flags), default=0))] + [
            1.0 if c in flags else 0.0 for c in CHECKS
        ])
        severity = int(agreed[0])
        flagged = [c for c, f in zip(CHECKS, agreed[1:]) if f > 0]
        # every step: Lightning keeps a step metric's last value in the rows it writes later, so logging only some
        # steps put step 0's numbers into step 9's row beside that step's train_loss
        self._log(pl_module, {"health/grad_norm": grad_norm, "health/grad_variance": grad_var, "health/loss": loss_value})
        self._act(trainer, pl_module, optimizer, params, severity, flagged,
                  {"grad_norm": grad_norm, "grad_variance": grad_var, "loss": loss_value})
        if severity < ACTIONS["skip"]:
            if math.isfinite(loss_value):
                self.loss_ema = self._ema(self.loss_ema, loss_value)
                self.good_steps += 1
            self.grad_norm_ema = self._ema(self.grad_norm_ema, grad_norm)
            self.grad_variance_ema = self._ema(self.grad_variance_ema, grad_var)
            if self._ratio_due(trainer):
                self._before = (trainer.global_step, params, [p.detach().clone() for p in params])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._check_routers(trainer)
        if self._before is None:
            return
        step, params, before = self._before
        self._before = None
        w, d = params_norm_and_delta(pl_module, params, before)
        ratio = d / w if w > 0 else float("inf")
        self._log(pl_module, {"health/update_ratio": ratio})
        off = self.update_ratio_target is not None and self.good_steps > self.warmup_steps and not (
            self.update_ratio_target / self.update_ratio_tolerance <= ratio <= self.update_ratio_target * self.update_ratio_tolerance
        )
        severity = int(agree_max(trainer, [self.severity["update_ratio"] if off else 0])[0])
        if severity >= ACTIONS["rollback"]:
            self._act(trainer, pl_module, None, [], severity, ["update_ratio"], {"update_ratio": ratio}, step)
        elif severity == ACTIONS["warn"]:
            self._warn(trainer, ["update_ratio"], {"update_ratio": ratio}, step)

    def _check_routers(self, trainer: Any) -> None:
        """A `RouterMonitor`'s collapsed windows (one expert taking most of a layer's tokens for `patience` windows)
        counted and warned about as the ``router_collapse`` check (the monitor computes them, on every rank alike)."""
        if self.router_collapse_action == "ignore":
            return
        for monitor in trainer.callbacks:
            events = getattr(monitor, "collapse_events", None)
            if not isinstance(events, list):
                continue
            seen = self._router_seen.get(id(monitor), 0)
            for event in events[seen:]:
                self._router_limit = f"max_load <= {getattr(monitor, 'collapse_load', '?')} ({event['layer']})"
                self._warn(trainer, ["router_collapse"], {"max_load": event["max_load"]}, event["step"])
            self._router_seen[id(monitor)] = len(events)

    def _step_loss(self, trainer: Any, pl_module: Any) -> torch.Tensor:
        """The step's training loss averaged over the data-parallel replicas (what `train_loss` logs with
        sync_dist). Lightning divides each micro-batch's loss by `accumulate_grad_batches` before backward,
        so under automatic optimization their sum is the mean."""
        losses = torch.stack(self._losses)
        loss = losses.sum() if pl_module.automatic_optimization else losses.mean()
        return trainer.strategy.reduce(loss, reduce_op="mean") if trainer.world_size > 1 else loss

    def _ema(self, ema: Optional[float], value: float) -> float:
        d = self.loss_ema_decay
        return value if ema is None else d * ema + (1 - d) * value

    # ---- decisions ----------------------------------------------------------------------
    def _ratio_due(self, trainer: Any) -> bool:
        """On the steps Lightning's loggers write (``(step + 1) % log_every_n_steps == 0``) unless told otherwise."""
        every = self.update_ratio_every or trainer.log_every_n_steps or 50
        return (
            self.update_ratio_target is not None
            and self.severity["update_ratio"] > 0
            and (trainer.global_step + 1) % every == 0
        )

    def _flags(self, grad_norm: float, grad_var: float, loss: float, have_loss: bool) -> list[str]:
        flags = []
        if not (math.isfinite(grad_norm) and math.isfinite(grad_var) and (math.isfinite(loss) or not have_loss)):
            return ["nonfinite"]
        if not have_loss:
            loss = self.loss_ema if self.loss_ema is not None else 0.0
        if self.grad_norm_range and not self.grad_norm_range[0] <= grad_norm <= self.grad_norm_range[1]:
            flags.append("grad_norm")
        if self.loss_range and not self.loss_range[0] <= loss <= self.loss_range[1]:
            flags.append("loss")
        if self.grad_variance_range and not self.grad_variance_range[0] <= grad_var <= self.grad_variance_range[1]:
            flags.append("grad_variance")
        if self.good_steps >= self.warmup_steps:
            for check, factor, value, ema in (
                ("loss_spike", self.loss_spike_factor, loss, self.loss_ema),
                ("grad_norm_spike", self.grad_norm_spike_factor, grad_norm, self.grad_norm_ema),
                ("grad_variance_spike", self.grad_variance_spike_factor, grad_var, self.grad_variance_ema),
            ):
                if factor is not None and ema is not None and value > factor * ema:
                    flags.append(check)
        return flags

    def _act(
        self, trainer: Any, pl_module: Any, optimizer: Any, params: list, severity: int, flagged: list[str], values: dict,
        step: Optional[int] = None,
    ) -> None:
        step = trainer.global_step if step is None else step
        if severity == 0:
            self.consecutive_bad = 0
            return
        if severity == ACTIONS["warn"]:
            self.consecutive_bad = 0
            self._warn(trainer, flagged, values, step)
            return
        if severity == ACTIONS["skip"]:
            self.consecutive_bad += 1
            if self.escalate_after is not None and self.consecutive_bad >= self.escalate_after:
                severity = ACTIONS["rollback"]
        if severity == ACTIONS["rollback"]:
            if self.rollbacks >= self.max_rollbacks:
                severity = ACTIONS["stop"]
            else:
                self.rollbacks += 1
                self.consecutive_bad = 0
        self._count(step, flagged)
        reason = f"{', '.join(flagged)} at step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items())
        self.events.append({"step": step, "action": _NAMES[severity], "checks": flagged, **values})
        self._drop_step(params)
        if severity == ACTIONS["skip"]:
            self.skipped_steps += 1
            self._log_warning(trainer, f"GradientHealthGuard: skipped the optimizer step ({reason}).")
        elif severity == ACTIONS["rollback"]:
            path = self._rollback(trainer, pl_module)
            self.skipped_steps += 1
            self._log_warning(trainer, f"GradientHealthGuard: rolled back to {path} ({reason}); rollback {self.rollbacks}/{self.max_rollbacks}.")
        else:
            self.skipped_steps += 1
            self.stop_reason = reason
            trainer.should_stop = True
            self._log_warning(trainer, f"GradientHealthGuard: stopping training ({reason}).")
        self._log(pl_module, {"health/skipped_steps": float(self.skipped_steps), "health/rollbacks": float(self.rollbacks)})

    @staticmethod
    def _drop_step(params: list) -> None:
        # optimizers skip parameters without a gradient: no update, no weight decay, no state change
        for p in params:
            p.grad = None

    def _checkpoint_dir(self, trainer: Any) -> Optional[Path]:
        if self.checkpoint_dir is not None:
            return Path(self.checkpoint_dir)
        dyn = find_callback(trainer, DynamicCheckpoint)
        return dyn.dirpath if dyn is not None else None

    def _rollback(self, trainer: Any, pl_module: Any) -> Optional[str]:
        dirpath = self._checkpoint_dir(trainer)
        path = None
        if dirpath is not None and trainer.is_global_zero:
            found = _store.latest_complete(dirpath, warn=log.warning)
            path = str(found) if found is not None else None
        path = broadcast(trainer, path)
        if path is None:
            log.warning("GradientHealthGuard: no complete checkpoint to roll back to; the step is skipped instead.")
        else:
            checkpoint = _read_rollback_checkpoint(trainer.strategy, path)
            trainer.strategy.load_model_state_dict(checkpoint, strict=True)
            trainer.strategy.load_optimizer_state_dict(checkpoint)
        if self.rollback_lr_factor is not None and self.rollback_lr_factor != 1.0:
            self._scale_lr(trainer, self.rollback_lr_factor)
        return path

    @staticmethod
    def _scale_lr(trainer: Any, factor: float) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):  # schedulers recompute lr from base_lrs at every step
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    # ---- reporting ----------------------------------------------------------------------
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        summary = self.summary()
        if summary and trainer.is_global_zero:
            log.warning(summary)

    def summary(self) -> str:
        """How often each check fired this run, e.g. "check grad_norm fired 120 times (first step 3, last step 199)"."""
        parts = [f"check {c} fired {n} time{'s' if n != 1 else ''} (first step {first}, last step {last})"
                 for c, (n, first, last) in self.fired.items()]
        return f"GradientHealthGuard summary: {'; '.join(parts)}." if parts else ""

    def _count(self, step: int, flagged: list[str]) -> None:
        for check in flagged:
            entry = self.fired.setdefault(check, [0, step, step])
            entry[0] += 1
            entry[2] = step

    def _warn(self, trainer: Any, flagged: list[str], values: dict, step: Optional[int] = None) -> None:
        step = trainer.global_step if step is None else step
        self.events.append({"step": step, "action": "warn", "checks": flagged, **values})
        self._count(step, flagged)
        counts = {c: self.fired[c][0] for c in flagged}
        limit = self.max_warnings
        if all(n > limit for n in counts.values()):
            # rate-limited: a reminder when a check reaches 10x, 100x, ... the limit, else only counted
            due = [c for c, n in counts.items() if n >= 10 * max(limit, 1) and _power_of_ten(n / max(limit, 1))]
            if due:
                self.warnings += 1
                if trainer.is_global_zero:
                    log.warning("GradientHealthGuard: " + "; ".join(
                        f"{c} has fired {counts[c]} times (first step {self.fired[c][1]}, last step {self.fired[c][2]})"
                        for c in due) + ".")
            return
        ranges = {
            "grad_norm": self.grad_norm_range,
            "loss": self.loss_range,
            "grad_variance": self.grad_variance_range,
            "loss_spike": f"<= {self.loss_spike_factor} x running mean {_g(self.loss_ema)}",
            "grad_norm_spike": f"<= {self.grad_norm_spike_factor} x running mean {_g(self.grad_norm_ema)}",
            "grad_variance_spike": f"<= {self.grad_variance_spike_factor} x running mean {_g(self.grad_variance_ema)}",
            "update_ratio": f"{self.update_ratio_target} within x{self.update_ratio_tolerance}",
            "router_collapse": self._router_limit,
        }
        detail = "; ".join(f"{c} expected {ranges.get(c)}" for c in flagged)
        values_s = ", ".join(f"{k}={v:.4g}" for k, v in values.items())
        message = f"GradientHealthGuard: step {step}: {values_s} ({detail})."
        quiet = [c for c, n in counts.items() if n == limit]
        if quiet:
            message += (f" Further {' and '.join(quiet)} warnings are counted and summarised at the end of training"
                        " (GradientHealthGuard(max_warnings=...) logs more).")
        self._log_warning(trainer, message)

    def _log_warning(self, trainer: Any, message: str) -> None:
        self.warnings += 1
        if trainer.is_global_zero:
            log.warning(message)

    @staticmethod
    def _log(pl_module: Any, metrics: dict[str, float]) -> None:
        if pl_module._trainer is not None:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_ema": self.loss_ema,
            "grad_norm_ema": self.grad_norm_ema,
            "grad_variance_ema": self.grad_variance_ema,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_ema = state_dict.get("loss_ema")
        self.grad_norm_ema = state_dict.get("grad_norm_ema")
        self.grad_variance_ema = state_dict.get("grad_variance_ema")
        self.good_steps = int(state_dict.get("good_steps", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.rollbacks = int(state_dict.get("rollbacks", 0))


def _g(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _read_rollback_checkpoint(strategy: Any, path: str) -> dict[str, Any]:
    """Any strategy's reader, with nothing in the files able to run code: a directory's non-tensor entries are
    checked as plain data first (Lightning's DCP readers unpickle them with ``weights_only=False``)."""
    if Path(path).is_dir():
        check_plain_data(path)
    with refusing_unsafe(path):
        return strategy.load_checkpoint(path, weights_only=True)
