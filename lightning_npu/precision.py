"""`HybridPrecision`: bf16/fp16 compute with fp32 norms and softmax, fp32 master weights,
dynamic loss scaling with an all-reduced overflow decision, and global gradient clipping.

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
  softmax statistics in fp32 internally. A recomputation that runs outside ``forward_context`` (activation
  checkpointing) should use :meth:`HybridPrecision.recompute_context` for functional calls.

Loss scaling and skipping: the loss is multiplied by the scale before backward; after backward the
(fp32 master) gradients are unscaled and checked for inf/nan in one fused pass per device, and the
decision is one MAX all-reduce over WORLD. On overflow every rank skips the optimizer step and the
following step-interval LR-scheduler step; the scale then follows :class:`DynamicLossScaler`.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Generator
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_npu.parallel import grad_norm as gn

PrecisionName = Literal["bf16-mixed", "16-mixed", "bf16-true", "16-true", "32-true"]
_SUPPORTED: tuple[str, ...] = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "32-true")
_HALF = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# loss scaler
# ---------------------------------------------------------------------------------------------
class DynamicLossScaler:
    """Megatron/DeepSpeed-style dynamic loss scale.

    * after ``growth_interval`` consecutive overflow-free steps: ``scale *= growth_factor`` and the
      hysteresis budget is refilled;
    * on an overflow: the step is skipped, the growth counter restarts and the hysteresis budget
      drops by one; once it is exhausted (the ``hysteresis``-th overflow since the last growth, and
      every overflow after it) ``scale = max(scale * backoff_factor, min_scale)``.

    ``dynamic=False`` keeps the scale constant (overflowing steps are still skipped).
    """

    def __init__(
        self,
        init_scale: float = 2.0**10,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        dynamic: bool = True,
    ) -> None:
        checks = [
            ("init_scale", init_scale, init_scale > 0 and math.isfinite(init_scale), "a finite number > 0"),
            ("growth_factor", growth_factor, growth_factor >= 1, "a number >= 1, e.g. 2.0"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor <= 1, "a number in (0, 1], e.g. 0.5"),
            ("growth_interval", growth_interval, isinstance(growth_interval, int) and growth_interval >= 1,
             "an int >= 1, e.g. 1000"),
            ("hysteresis", hysteresis, isinstance(hysteresis, int) and hysteresis >= 1, "an int >= 1, e.g. 2"),
            ("min_scale", min_scale, 0 < min_scale <= init_scale, f"a number in (0, init_scale={init_scale}]"),
        ]
        for name, value, ok, fix in checks:
            if not ok:
                raise ValueError(f"HybridPrecision/DynamicLossScaler: `{name}={value!r}` is invalid; pass {fix}.")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.dynamic = dynamic
        self.scale = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


# ---------------------------------------------------------------------------------------------
# fp32 islands: norm and softmax modules
# ---------------------------------------------------------------------------------------------
_NORM_TYPES: tuple[type, ...] = tuple(
    t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None), nn.GroupNorm) if t is not None
)
_NORM_SUFFIXES = ("LayerNorm", "RMSNorm", "RmsNorm")
_SOFTMAX_TYPES: tuple[type, ...] = (nn.Softmax, nn.LogSoftmax)
_SOFTMAX_SUFFIXES = ("Softmax",)


def _class_names(module: nn.Module) -> list[str]:
    return [c.__name__ for c in type(module).__mro__]


def is_fp32_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or any(n.endswith(_NORM_SUFFIXES) for n in _class_names(module))


def is_fp32_softmax(module: nn.Module) -> bool:
    return isinstance(module, _SOFTMAX_TYPES) or any(
        n.endswith(_SOFTMAX_SUFFIXES) and n != "Module" for n in _class_names(module)
    )


def _upcast(x: Any) -> Any:
    return x.float() if isinstance(x, Tensor) and x.dtype in _HALF else x


def _first_float_tensor(tree: Any) -> Optional[Tensor]:
    found: list[Tensor] = []

    def visit(x: Any) -> Any:
        if not found and isinstance(x, Tensor) and x.is_floating_point():
            found.append(x)
        return x

    tree_map(visit, tree)
    return found[0] if found else None


def _island_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    x = _first_float_tensor((args, kwargs))
    stack = module.__dict__.setdefault("_lnpu_fp32_stack", [])
    if x is None:
        stack.append((None, None))
        return args, kwargs
    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.autocast(x.device.type, enabled=False))
    ctx.enter_context(FP32FunctionMode())  # 16-bit weights (bf16-true) join the fp32 math too
    stack.append((ctx, x.dtype))
    return tree_map(_upcast, args), tree_map(_upcast, kwargs)


def _island_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    stack = module.__dict__.get("_lnpu_fp32_stack")
    if not stack:
        return output
    ctx, dtype = stack.pop()
    if ctx is not None:
        ctx.close()
    if dtype in _HALF:
        return tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.dtype == torch.float32 else t, output)
    return output


def install_fp32_islands(module: nn.Module) -> list[str]:
    """Make every norm and softmax submodule of `module` compute in fp32 (idempotent).

    Returns the qualified names of the modules that got the hooks.
    """
    names = []
    for name, m in module.named_modules():
        if not (is_fp32_norm(m) or is_fp32_softmax(m)):
            continue
        names.append(name)
        if m.__dict__.get("_lnpu_fp32_island"):
            continue
        m.register_forward_pre_hook(_island_pre_hook, with_kwargs=True)
        m.register_forward_hook(_island_post_hook, with_kwargs=True, always_call=True)
        m.__dict__["_lnpu_fp32_island"] = True
    return names


# ---------------------------------------------------------------------------------------------
# fp32 islands: functional calls
# ---------------------------------------------------------------------------------------------
_SOFTMAX_FUNCS = {
    torch.softmax, F.softmax, Tensor.softmax, torch.log_softmax, F.log_softmax, Tensor.log_softmax,
}
_NORM_FUNCS = {F.layer_norm, F.group_norm, torch.layer_norm, torch.group_norm}
if hasattr(F, "rms_norm"):
    _NORM_FUNCS |= {F.rms_norm}
_LOSS_FUNCS = {F.cross_entropy, F.nll_loss}


class FP32FunctionMode(TorchFunctionMode):
    """Runs softmax, norm and loss functions in fp32 with autocast off (see the module docstring)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        is_softmax = func in _SOFTMAX_FUNCS
        if not (is_softmax or func in _NORM_FUNCS or func in _LOSS_FUNCS):
            return func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor):
            return func(*args, **kwargs)
        # softmax: a 16-bit input; norms and losses: any 16-bit tensor argument (input, weight, bias)
        half_args = [t for t in (args, kwargs) for t in tree_flatten(t)[0] if isinstance(t, Tensor) and t.dtype in _HALF]
        if not half_args or (is_softmax and x.dtype not in _HALF):
            return func(*args, **kwargs)
        in_dtype = x.dtype
        args, kwargs = tree_map(_upcast, args), tree_map(_upcast, kwargs)
        with torch.autocast(x.device.type, enabled=False):
            out = func(*args, **kwargs)
        if func in _LOSS_FUNCS:
            return out
        explicit_dtype = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
        if is_softmax and explicit_dtype:
            return out
        return out.to(in_dtype) if isinstance(out, Tensor) else out


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _unwrap_module(model: nn.Module) -> nn.Module:
    import lightning.pytorch as pl

    m = model
    while not isinstance(m, pl.LightningModule) and isinstance(getattr(m, "module", None), nn.Module):
        m = m.module
    return m


def _raw_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)


def _scheduler_class(cls: type) -> type:
    """A subclass of `cls` whose `step` is skipped right after a skipped optimizer step."""
    if getattr(cls, "_lnpu_skippable", False):
        return cls
    cache = _scheduler_class.__dict__.setdefault("cache", {})
    if cls not in cache:

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            plugin_ref = _SCHEDULER_PLUGINS.get(id(self))
            plugin = plugin_ref() if plugin_ref is not None else None
            if plugin is not None and plugin._consume_scheduler_skip(self):
                return None
            return cls.step(self, *args, **kwargs)

        cache[cls] = type(cls.__name__, (cls,), {"step": step, "_lnpu_skippable": True, "__module__": cls.__module__,
                                                 "__qualname__": cls.__qualname__})
    return cache[cls]


_SCHEDULER_PLUGINS: dict[int, "weakref.ref[HybridPrecision]"] = {}


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
        self.skipped_steps = 0
        self.last_grad_norm: Optional[Tensor] = None
        self._pl_module: Optional[nn.Module] = None
        self._masters: dict[int, list[tuple[Tensor, Tensor]]] = {}  # id(optimizer) -> [(param, master)]
        self._master_order: list[int] = []
        self._prepared: set[int] = set()
        self._found_inf: dict[int, bool] = {}
        self._grad_stats: dict[int, Tensor] = {}  # id(optimizer) -> this step's [norm, variance]
        self._step_generation = 0
        self._last_step_skipped = False
        self._scheduler_seen: dict[int, int] = {}

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
        """The fp32 function interception alone (for activation-checkpoint recomputation)."""
        with FP32FunctionMode() if (self._half_dtype is not None and self.fp32_functions) else contextlib.nullcontext():
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
        self._pl_module = _unwrap_module(model)
        optimizers = list(optimizers)
        if self.master_weights:
            for i, opt in enumerate(optimizers):
                optimizers[i] = self._install_master_weights(opt, lr_schedulers)
        if self.scaler is not None:
            for config in lr_schedulers:
                if getattr(config, "interval", "step") == "step" and not getattr(config, "reduce_on_plateau", False):
                    sched = config.scheduler
                    sched.__class__ = _scheduler_class(type(sched))
                    _SCHEDULER_PLUGINS[id(sched)] = weakref.ref(self)
                    self._scheduler_seen[id(sched)] = self._step_generation
        return model, optimizers, lr_schedulers

    def _install_master_weights(self, optimizer: Optimizer, lr_schedulers: list[Any]) -> Optimizer:
        raw = _raw_optimizer(optimizer)
        if id(raw) in self._masters:
            return optimizer
        mapping: dict[int, Tensor] = {}
        pairs: list[tuple[Tensor, Tensor]] = []
        for group in raw.param_groups:
            for p in group["params"]:
                if p.dtype in _HALF and id(p) not in mapping:
                    master = nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
                    for attr, value in vars(p).items():  # e.g. the tensor-parallel shard spec `_lnpu_tp`
                        if attr.startswith("_lnpu"):
                            setattr(master, attr, value)
                    mapping[id(p)] = master
                    pairs.append((p, master))
        if not pairs:
            return optimizer
        if raw.state:
            raw.state = type(raw.state)({mapping.get(id(p), p): s for p, s in raw.state.items()})
        for group in raw.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
        self._masters[id(raw)] = pairs
        self._master_order.append(id(raw))
        return optimizer

    # ---- backward and step --------------------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)  # `on_before_backward` sees the training loss, not loss x scale
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    def _prepare_grads(self, optimizer: Any) -> bool:
        """Master grads from model grads, unscale, all-reduced overflow check (once per step)."""
        raw = _raw_optimizer(optimizer)
        if id(raw) in self._prepared:
            return self._found_inf.get(id(raw), False)
        for p, master in self._masters.get(id(raw), ()):
            master.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
            p.grad = None
        found = False
        if self.scaler is not None:
            params = list(self.main_params(raw))
            grads = [p.grad for p in params if p.grad is not None]
            device = gn.local_tensor(grads[0] if grads else params[0]).device if params else torch.device("cpu")
            local = gn.unscale_and_check_(grads, 1.0 / self.scaler.scale, device)
            found = gn.all_ranks_found_inf(local)
        self._prepared.add(id(raw))
        self._found_inf[id(raw)] = found
        return found

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        import lightning.pytorch as pl

        if self.scaler is not None and isinstance(optimizer, LBFGS):
            raise ValueError(
                "HybridPrecision loss scaling does not support LBFGS (it re-evaluates the closure); "
                "pass HybridPrecision(loss_scale=None) or use another optimizer."
            )
        if isinstance(model, pl.LightningModule):
            self._pl_module = model
        closure_result = closure()
        raw = _raw_optimizer(optimizer)
        automatic = isinstance(model, pl.LightningModule) and model.automatic_optimization
        if closure_result is None and automatic:  # training_step returned None: no backward, no step
            self._prepared.discard(id(raw))
            self._grad_stats.pop(id(raw), None)
            return closure_result
        self.last_grad_norm = None
        found_inf = self._prepare_grads(raw)
        self._after_closure(model, optimizer)
        step_output = None
        if found_inf:
            self.skipped_steps += 1
        else:
            step_output = raw.step(**kwargs)
            self._copy_masters_to_params(raw)
        self._last_step_skipped = found_inf
        self._step_generation += 1
        if self.scaler is not None:
            self.scaler.update(found_inf)
        self._prepared.discard(id(raw))
        self._grad_stats.pop(id(raw), None)
        self._log(model)
        return step_output

    def _copy_masters_to_params(self, raw: Any) -> None:
        pairs = self._masters.get(id(raw))
        if not pairs:
            return
        with torch.no_grad():
            for p, master in pairs:
                p.copy_(master)

    def _consume_scheduler_skip(self, scheduler: Any) -> bool:
        key = id(scheduler)
        if self._scheduler_seen.get(key) == self._step_generation:
            return False
        self._scheduler_seen[key] = self._step_generation
        return self._last_step_skipped

    def _log(self, model: Any) -> None:
        import lightning.pytorch as pl

        if not isinstance(model, pl.LightningModule) or model._current_fx_name is None or model._trainer is None:
            return
        if self.scaler is not None:
            model.log("loss_scale", float(self.scaler.scale), on_step=True, on_epoch=False)
            model.log("skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)
        if self.last_grad_norm is not None:
            model.log("grad_norm", self.last_grad_norm, on_step=True, on_epoch=False)

    # ---- clipping -------------------------------------------------------------------------
    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = None) -> None:  # type: ignore[override]
        from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
        from lightning.pytorch.utilities import GradClipAlgorithmType

        if clip_val and clip_val > 0 and self.scaler is not None and _optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__qualname__} unscales gradients itself (a 'fused' optimizer), so it cannot be "
                "combined with gradient clipping under loss scaling; use a non-fused optimizer or loss_scale=None."
            )
        algorithm = gradient_clip_algorithm if gradient_clip_algorithm is not None else GradClipAlgorithmType.NORM
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the global fp32 L2 norm of the unscaled gradients over all ranks (logged as ``grad_norm``)."""
        raw = _raw_optimizer(optimizer)
        if self._prepare_grads(raw):
            return  # overflow: this step is skipped on every rank
        total = self.gradient_statistics(raw)[0]
        gn.clip_grads_by_total_norm_(list(self.main_params(raw)), float(clip_val), total)
        self.last_grad_norm = total

    def gradient_statistics(self, optimizer: Any) -> Tensor:
        """This step's fp32 ``[global grad norm, element variance]`` of the unscaled gradients `optimizer` steps.

        Computed once per step (clipping, the logged ``grad_norm`` and GradientHealthGuard share it); call on
        every rank. Inside `on_before_optimizer_step` the gradients are already unscaled.
        """
        raw = _raw_optimizer(optimizer)
        self._prepare_grads(raw)
        if id(raw) not in self._grad_stats:
            self._grad_stats[id(raw)] = gn.gradient_statistics(self.main_params(raw), pp_group=self._pp_group())
        return self._grad_stats[id(raw)]

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        raw = _raw_optimizer(optimizer)
        if self._prepare_grads(raw):
            return
        super().clip_grad_by_value(raw, clip_val)

    def _pp_group(self) -> Any:
        return gn.pipeline_group(getattr(self._pl_module, "_device_mesh", None))

    # ---- checkpointing ------------------------------------------------------------------
    @contextlib.contextmanager
    def masters_as_parameters(self, module: nn.Module) -> Generator[None, None, None]:
        """While inside, `module`'s 16-bit parameters are replaced by their fp32 master copies (``*-true``).

        The optimizer steps the masters, which are not module parameters, so FQN-keyed state-dict APIs
        (``torch.distributed.checkpoint.state_dict``, used for sharded checkpoints) cannot key the optimizer
        state by parameter name. Inside this context they can, and the module's state dict holds the fp32
        masters: the exact weights, reshardable like any other tensor and loadable by a ``32-true``/``*-mixed``
        run. On exit the 16-bit parameters are put back and refreshed from the masters (a no-op after a save,
        the restored weights after a load). A no-op without master weights.
        """
        by_param = {id(p): master for key in self._master_order for p, master in self._masters[key]}
        swapped: list[tuple[nn.Module, str, Tensor]] = []
        if by_param:
            for sub in module.modules():
                for name, p in list(sub._parameters.items()):
                    if p is not None and id(p) in by_param:
                        sub._parameters[name] = by_param[id(p)]
                        swapped.append((sub, name, p))
        try:
            yield
        finally:
            with torch.no_grad():
                for sub, name, p in swapped:
                    master = sub._parameters[name]
                    sub._parameters[name] = p
                    p.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"precision": self.precision, "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        if self._masters:
            state["master_weights"] = [
                [m.detach().clone() for _, m in self._masters[key]] for key in self._master_order
            ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
        saved = state_dict.get("master_weights")
        if saved is None or not self._masters:
            return  # masters were derived from the restored (16-bit) parameters in `connect`
        if len(saved) != len(self._master_order):
            raise ValueError(
                f"The checkpoint holds master weights for {len(saved)} optimizers but this run has "
                f"{len(self._master_order)}; resume with the same `configure_optimizers`."
            )
        with torch.no_grad():
            for key, tensors in zip(self._master_order, saved):
                pairs = self._masters[key]
                if len(tensors) != len(pairs):
                    raise ValueError(
                        f"The checkpoint holds {len(tensors)} master weights for an optimizer with {len(pairs)} "
                        "16-bit parameters; resume with the same model and optimizer parameter groups."
                    )
                for (p, master), t in zip(pairs, tensors):
                    master.copy_(t.to(gn.local_tensor(master).device) if not hasattr(t, "device_mesh") else t)
                    p.copy_(master)


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
