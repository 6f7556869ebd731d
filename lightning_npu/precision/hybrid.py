"""`HybridPrecision`: bf16/fp16 compute with fp32 norms and softmax, and the loss scale.

The optimizer side (fp32 master weights, unscaling, the all-reduced overflow skip, global clipping and the
gradient statistics) is `lightning_npu.parallel.optim.mixed_precision.MixedPrecisionOptimizer`, which the ``npu_hybrid``
strategy wraps every optimizer in; this plugin calls its parts in Lightning's order and shares the loss scaler.

Precision modes (``Trainer(precision=...)``; the ``npu_hybrid`` strategy converts Lightning's own
plugin into this one):

=============  =========================  ==================  ===================================
precision      parameters / optimizer     forward             loss scaling (default)
=============  =========================  ==================  ===================================
``32-true``    fp32                       fp32                off
``bf16-mixed`` fp32                       autocast bf16       dynamic
``16-mixed``   fp32                       autocast fp16       dynamic
``bf16-true``  bf16 + fp32 master copies  bf16                dynamic
``16-true``    fp16 + fp32 master copies  fp16                dynamic
=============  =========================  ==================  ===================================

How fp32 norms and softmax are guaranteed (autocast's op lists differ between CPU, CUDA and NPU,
so they are not relied on):

* **Norm and softmax modules** (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, any class whose
  name ends in ``LayerNorm``/``RMSNorm``/``RmsNorm`` such as ``transformers``' ``LlamaRMSNorm``, and
  ``nn.Softmax``/``nn.LogSoftmax``/any class whose name ends in ``Softmax`` such as the example's
  ``CausalSoftmax``) get a forward pre-hook that upcasts floating inputs to fp32 and disables
  autocast for the module's device type and enters the function mode below (so 16-bit norm weights
  in the ``*-true`` modes are upcast too), and a forward hook (``always_call``) that leaves both and
  casts floating outputs back to the dtype the module received. Hooks, not wrappers: module identity and ``state_dict`` keys are unchanged,
  and activation-checkpoint recomputation re-runs them identically.
* **Functional calls** during the forward (``torch.softmax``/``F.softmax``/``Tensor.softmax``, the
  ``log_softmax`` variants, ``F.layer_norm``/``F.rms_norm``/``F.group_norm``, and the losses
  ``F.cross_entropy``/``F.nll_loss``) are intercepted by a ``TorchFunctionMode`` that is active
  inside ``forward_context``: inputs are upcast to fp32 and run with autocast disabled; softmax and
  norm outputs return in the input dtype (or the ``dtype=`` the caller asked for), losses stay fp32.
  Fused attention kernels (``F.scaled_dot_product_attention``) are not intercepted: they keep their
  softmax statistics in fp32 internally. Activation checkpointing recomputes inside backward, outside
  ``forward_context``; `lightning_npu.parallel.recompute` re-enters the modes the block's forward ran under.

Loss scaling and skipping: the loss is multiplied by the scale before backward; after backward the
optimizer wrapper unscales the (fp32 master) gradients and checks them for inf/nan in one fused pass per
device, and the decision is one MAX all-reduce over WORLD. On overflow every rank skips the optimizer step and
the following step-interval LR-scheduler step (`SkippableLRScheduler`); the scale then follows
:class:`DynamicLossScaler`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer

from lightning_npu import device as dev
from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer, needs_closure, unwrap_optimizer
from lightning_npu.precision.emulation import EmulatedBF16MatmulMode
from lightning_npu.precision.fp32 import FP32FunctionMode, install_fp32_islands
from lightning_npu.precision.loss_scaler import DynamicLossScaler

PrecisionName = Literal["bf16-mixed", "16-mixed", "bf16-true", "16-true", "32-true"]
_SUPPORTED: tuple[str, ...] = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "32-true")
METRIC_PREFIX = "npu/"  # the plugin's metrics, apart from the user's own names (health/* and memory/* are the callbacks')
# the plugin's torch function modes, which activation checkpointing's recompute re-enters (`parallel.recompute`)
FUNCTION_MODES = (EmulatedBF16MatmulMode, FP32FunctionMode)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _unwrap_module(model: nn.Module) -> nn.Module:
    import lightning.pytorch as pl

    m = model
    while not isinstance(m, pl.LightningModule) and isinstance(getattr(m, "module", None), nn.Module):
        m = m.module
    return m


# ---------------------------------------------------------------------------------------------
# the plugin
# ---------------------------------------------------------------------------------------------
class HybridPrecision(Precision):
    """Lightning precision plugin for hybrid-parallel training on NPU, CUDA and CPU.

    Args:
        precision: ``"bf16-mixed"`` (default), ``"16-mixed"``, ``"bf16-true"``, ``"16-true"`` or ``"32-true"``.
        device: device type for autocast; ``None`` = the strategy's accelerator (set by ``npu_hybrid``).
        loss_scale: ``"dynamic"``, a constant ``float`` (static scale, overflowing steps still skipped),
            or ``None`` (no scaling and no overflow check). ``"auto"``: dynamic for the 16-bit modes,
            ``None`` for ``32-true``.
        initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis, min_scale:
            :class:`DynamicLossScaler` settings (2**10, 1000, 2.0, 0.5, 2, 1.0).
        master_weights: keep fp32 master copies of 16-bit parameters for the optimizer (default: on
            for ``*-true``; irrelevant for the other modes, whose parameters are fp32).
        fp32_functions: intercept functional softmax/norm/loss calls in the forward (see module docs).
        fp32_reduce: reduce the gradients of 16-bit parameters over dp in fp32 (the strategy's gradient
            sync reads it; every other reduction is fp32 anyway).
        legacy_metric_names: also log ``grad_norm``, ``loss_scale`` and ``skipped_steps`` under their bare
            pre-0.2 names beside ``npu/grad_norm``, ``npu/loss_scale`` and ``npu/skipped_steps`` (one deprecation
            warning per run); this release only.

    Logged per step: ``npu/loss_scale`` and ``npu/skipped_steps`` (with a loss scale) and ``npu/grad_norm`` (with
    norm clipping): the pre-clip global norm of the unscaled gradients, the same number GradientHealthGuard logs
    as ``health/grad_norm``.
    """

    def __init__(
        self,
        precision: PrecisionName = "bf16-mixed",
        device: Optional[str] = None,
        loss_scale: Union[Literal["auto", "dynamic"], float, None] = "auto",
        initial_scale: float = 2.0**10,
        growth_interval: int = 1000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        master_weights: Optional[bool] = None,
        fp32_functions: bool = True,
        fp32_reduce: bool = True,
        legacy_metric_names: bool = True,
    ) -> None:
        if precision not in _SUPPORTED:
            raise ValueError(
                f"HybridPrecision(precision={precision!r}) is not supported; use one of {list(_SUPPORTED)} "
                "(e.g. Trainer(precision='bf16-mixed'))."
            )
        self.precision = precision
        self.device = device
        self._half_dtype: Optional[torch.dtype] = (
            torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
        )
        self._autocast = precision.endswith("-mixed")
        self._true_half = self._half_dtype is not None and not self._autocast
        if loss_scale == "auto":
            loss_scale = None if self._half_dtype is None else "dynamic"
        if loss_scale is None:
            self.scaler: Optional[DynamicLossScaler] = None
        elif loss_scale == "dynamic":
            self.scaler = DynamicLossScaler(
                initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, dynamic=True
            )
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0:
            self.scaler = DynamicLossScaler(float(loss_scale), min_scale=min(min_scale, float(loss_scale)),
                                            dynamic=False)
        else:
            raise ValueError(
                f"HybridPrecision(loss_scale={loss_scale!r}) is invalid; pass 'dynamic', 'auto', a number > 0 "
                "(static scale) or None (no loss scaling)."
            )
        if master_weights and not self._true_half:
            raise ValueError(
                f"HybridPrecision(master_weights=True) needs 16-bit parameters, but precision={precision!r} keeps "
                "parameters in fp32 already; use precision='bf16-true' or leave master_weights unset."
            )
        self.master_weights = self._true_half if master_weights is None else bool(master_weights)
        self.fp32_functions = fp32_functions
        self.fp32_reduce = fp32_reduce
        self.legacy_metric_names = bool(legacy_metric_names)
        self.skipped_steps = 0
        self.last_grad_norm: Optional[Tensor] = None
        self._pl_module: Optional[nn.Module] = None
        # the npu_hybrid strategy's part of a backward (`NPUHybridStrategy._layout_backward`): runs the module's
        # `backward` hook it is given (or the pipeline's gradients), then the gradient sync; None: the hook alone
        self.layout_backward: Optional[Callable[[Callable[[], None]], None]] = None

    # ---- properties ---------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._half_dtype or torch.float32

    def _device_type(self) -> str:
        if self.device is not None:
            return torch.device(self.device).type
        if self._pl_module is not None:
            p = next(iter(self._pl_module.parameters()), None)
            if p is not None:
                return gn.local_tensor(p).device.type
        return "cpu"

    # ---- module conversion and forward --------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self._half_dtype is None:
            return module
        if self._true_half:
            # all parameters 16-bit (one dtype per ZeRO-1 bucket); norms upcast their weights
            # inside the fp32 island and the optimizer steps fp32 master copies
            module.to(dtype=self._half_dtype)
        install_fp32_islands(module)
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _DtypeContextManager(self._half_dtype) if self._true_half else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if not self._true_half:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._half_dtype)

    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type(), dtype=self._half_dtype, cache_enabled=False)

    @contextlib.contextmanager
    def recompute_context(self) -> Generator[None, None, None]:
        """The function modes of `forward_context` without its autocast and dtype: fp32 functions, and bf16
        matmuls emulated where the CPU has no bf16 instructions."""
        with contextlib.ExitStack() as stack:
            if self._half_dtype is torch.bfloat16 and self._device_type() == "cpu" and not dev.fast_bf16("cpu"):
                stack.enter_context(EmulatedBF16MatmulMode())
            if self._half_dtype is not None and self.fp32_functions:
                stack.enter_context(FP32FunctionMode())
            yield

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with contextlib.ExitStack() as stack:
            if self._true_half:
                stack.enter_context(_DtypeContextManager(self._half_dtype))
            stack.enter_context(self.autocast_context_manager())
            stack.enter_context(self.recompute_context())
            yield

    # ---- wiring into the strategy -------------------------------------------------------
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple:
        # the optimizers are already `MixedPrecisionOptimizer`s (`NPUHybridStrategy.setup_optimizers`)
        self._pl_module = _unwrap_module(model)
        return model, optimizers, lr_schedulers

    # ---- backward and step --------------------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)  # `on_before_backward` sees the training loss, not loss x scale
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    def backward(self, tensor: Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """The LightningModule's `backward` hook (Lightning's), run by the strategy's layout (`layout_backward`)."""
        def module_backward() -> None:
            super(HybridPrecision, self).backward(tensor, model, optimizer, *args, **kwargs)

        if self.layout_backward is None:
            module_backward()
        else:
            self.layout_backward(module_backward)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Lightning's order around the wrapper's parts: backward (the closure), unscale and the all-rank overflow
        check, `on_before_optimizer_step` and clipping, then the step (skipped on every rank after an overflow)."""
        import lightning.pytorch as pl

        opt = _mixed_precision_optimizer(optimizer)
        if isinstance(model, pl.LightningModule):
            self._pl_module = model
        if needs_closure(opt.optimizer):
            if self.scaler is not None:
                raise ValueError(
                    f"HybridPrecision loss scaling does not support {type(opt.optimizer).__name__} (it re-evaluates "
                    "the closure); pass HybridPrecision(loss_scale=None) or precision='32-true', or use another "
                    "optimizer."
                )
            return self._step_with_closure(opt, optimizer, model, closure, **kwargs)
        closure_result = closure()
        automatic = isinstance(model, pl.LightningModule) and model.automatic_optimization
        if closure_result is None and automatic:  # training_step returned None: no backward, no step
            return closure_result
        self.last_grad_norm = None
        opt.prepare_grads()
        self._after_closure(model, optimizer)
        step_output = opt.step(**kwargs)
        if opt.step_skipped:
            self.skipped_steps += 1
        self._log(model)
        return step_output

    def _step_with_closure(self, opt: MixedPrecisionOptimizer, optimizer: Any, model: Any, closure: Callable[[], Any],
                           **kwargs: Any) -> Any:
        """An optimizer that evaluates the closure itself (LBFGS): Lightning's order inside each evaluation, as
        Lightning's `Precision` runs it (backward, `on_before_optimizer_step`, clipping), and the step around it."""

        def evaluate() -> Any:
            self.last_grad_norm = None
            result = closure()
            opt.prepare_grads()
            self._after_closure(model, optimizer)
            return result

        step_output = opt.step(closure=evaluate, **kwargs)
        self._log(model)
        return step_output

    def _log(self, model: Any) -> None:
        import lightning.pytorch as pl

        if not isinstance(model, pl.LightningModule) or model._current_fx_name is None or model._trainer is None:
            return
        metrics: dict[str, Any] = {}
        if self.scaler is not None:
            metrics["loss_scale"] = float(self.scaler.scale)
            metrics["skipped_steps"] = float(self.skipped_steps)
        if self.last_grad_norm is not None:
            metrics["grad_norm"] = self.last_grad_norm
        if not metrics:
            return
        for name, value in metrics.items():
            model.log(f"{METRIC_PREFIX}{name}", value, on_step=True, on_epoch=False)
        if self.legacy_metric_names:
            _warn_legacy_names_once(sorted(metrics))
            for name, value in metrics.items():
                model.log(name, value, on_step=True, on_epoch=False)

    # ---- clipping -------------------------------------------------------------------------
    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = None) -> None:  # type: ignore[override]
        from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
        from lightning.pytorch.utilities import GradClipAlgorithmType

        user_optimizer = _mixed_precision_optimizer(optimizer).optimizer
        if clip_val and clip_val > 0 and self.scaler is not None and _optimizer_handles_unscaling(user_optimizer):
            raise RuntimeError(
                f"{type(user_optimizer).__qualname__} unscales gradients itself (a 'fused' optimizer), so it cannot be "
                "combined with gradient clipping under loss scaling; use a non-fused optimizer or loss_scale=None."
            )
        algorithm = gradient_clip_algorithm if gradient_clip_algorithm is not None else GradClipAlgorithmType.NORM
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the global fp32 L2 norm of the unscaled gradients over all ranks (logged as ``grad_norm``)."""
        total = _mixed_precision_optimizer(optimizer).clip_grad_norm_(float(clip_val))
        if total is not None:
            self.last_grad_norm = total

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        _mixed_precision_optimizer(optimizer).clip_grad_value_(float(clip_val))

    # ---- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"precision": self.precision, "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # (checkpoints written before the optimizer wrapper also hold "master_weights": the same fp32 masters the
        # model state restores)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


_legacy_warned = False


def _warn_legacy_names_once(names: list[str]) -> None:
    """One deprecation warning per process (not per step, not per rank) for the bare metric names."""
    global _legacy_warned
    if _legacy_warned:
        return
    _legacy_warned = True
    rank_zero_deprecation(
        f"HybridPrecision logs {', '.join(names)} as {', '.join(METRIC_PREFIX + n for n in names)}; the bare names are "
        "logged too for this release only and will be removed in the next. Read the 'npu/' names (or pass "
        "HybridPrecision(legacy_metric_names=False) to log only them)."
    )


def _mixed_precision_optimizer(optimizer: Any) -> MixedPrecisionOptimizer:
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, MixedPrecisionOptimizer):
        raise TypeError(
            f"HybridPrecision steps optimizers through lightning_npu.parallel.optim.mixed_precision.MixedPrecisionOptimizer, "
            f"which the npu_hybrid strategy installs; got {type(opt).__name__}. Use Trainer(strategy='npu_hybrid')."
        )
    return opt


def as_hybrid_precision(plugin: Optional[Precision], device: Optional[str]) -> Optional[Precision]:
    """Turn Lightning's plugin for a supported ``precision=`` flag into `HybridPrecision` on `device`.

    Used by `NPUHybridStrategy.precision_plugin`; any other plugin is refused with the fix.
    """
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    if plugin is None:
        return None
    if isinstance(plugin, HybridPrecision):
        if plugin.device is None and device is not None:
            plugin.device = device
        return plugin
    if type(plugin) in (MixedPrecision, HalfPrecision):
        return HybridPrecision(plugin.precision, device=device)  # type: ignore[arg-type]
    if type(plugin) is Precision:
        return HybridPrecision("32-true", device=device)
    raise ValueError(
        f"The npu_hybrid strategy does not support the precision plugin {type(plugin).__name__}"
        f"(precision={getattr(plugin, 'precision', None)!r}); pass Trainer(precision=...) one of "
        f"{list(_SUPPORTED)}, or plugins=[lightning_npu.HybridPrecision(...)] to configure loss scaling."
    )
