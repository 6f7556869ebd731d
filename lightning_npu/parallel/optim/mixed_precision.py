"""The mixed-precision optimizer: one wrapper prepares, checks, clips and applies every optimizer step.

Modelled on Megatron-core's ``MixedPrecisionOptimizer`` (which its distributed optimizer extends, as
`lightning_npu.parallel.optim.distributed.DistributedOptimizer` extends this class). The strategy wraps each
optimizer in `setup_optimizers`; `HybridPrecision` only scales the loss and calls the parts in Lightning's order:

1. :meth:`MixedPrecisionOptimizer.prepare_grads` after backward: the stepped fp32 "main" parameters get this step's
   gradients (copied from the 16-bit model parameters under ``bf16-true``/``16-true``; ZeRO-1's fp32 slices already
   hold their reduce-scattered share), which are unscaled and checked for inf/nan in one pass per device; the
   decision is one MAX all-reduce over every rank (a per-rank decision deadlocks sharded optimizers);
2. :meth:`~MixedPrecisionOptimizer.gradient_statistics`: the step's global norm and variance, computed once and
   read by clipping, the logged ``grad_norm`` and the health guards;
3. :meth:`~MixedPrecisionOptimizer.clip_grad_norm_` (or ``clip_grad_value_``);
4. :meth:`~MixedPrecisionOptimizer.step`: skipped on every rank after an overflow, else the user's optimizer
   steps the main parameters and the model parameters are refreshed from them; the loss scaler learns the outcome.

`SkippableLRScheduler` skips a step-interval LR scheduler's ``step()`` right after a skipped optimizer step, so the
schedule counts applied updates. It forwards everything else to the user's scheduler, whose class and state dict
stay untouched.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Generator, Iterable
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.tensor_parallel import shards as tp_shards

_HALF = (torch.bfloat16, torch.float16)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The strategy's optimizer behind Lightning's `LightningOptimizer` (itself otherwise)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def stepped_optimizer(optimizer: Any) -> Any:
    """What an optimizer's step updates through: a strategy wrapper's user optimizer (over the fp32 masters; ZeRO-1's
    slices, whose wrapper shows the model's parameters in its own `param_groups`), else the optimizer itself."""
    optimizer = unwrap_optimizer(optimizer)
    return vars(optimizer).get("optimizer", optimizer) if isinstance(optimizer, MixedPrecisionOptimizer) else optimizer


def stepped_groups(optimizer: Any) -> list[dict[str, Any]]:
    """The param groups of what an optimizer's step updates (`stepped_optimizer`)."""
    return stepped_optimizer(optimizer).param_groups


def stepped_params(optimizer: Any) -> list[Tensor]:
    """The tensors of `stepped_groups`, in order."""
    return [p for group in stepped_groups(optimizer) for p in group["params"]]


def needs_closure(optimizer: Optimizer) -> bool:
    """Whether `optimizer.step` cannot run without a closure: it evaluates the loss itself (LBFGS, maybe many times),
    so the step's parts must run inside that closure, as Lightning's own precision plugin runs them."""
    step = type(optimizer).step
    if not inspect.isfunction(step):  # a test's mock of `step`: inspecting it would record calls on the mock
        return False
    closure = inspect.signature(step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def refuse_unflattenable(optimizer: str, named: Iterable[tuple[str, Tensor]], layout: str) -> None:
    """A closure-taking optimizer (LBFGS) flattens every parameter into one vector (``p.view(-1)``, ``torch.cat``);
    on a DTensor (ZeRO 1/2/3 slices and shards) that works only when its rows split evenly over the mesh and
    nothing else is sharded, so anything else is refused here, before training, rather than inside the first step.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for name, p in named:
        if not isinstance(p, DTensor):
            continue
        parts = 1
        for placement, size in zip(p.placements, p.device_mesh.shape):
            if type(placement) is Shard and placement.dim == 0:
                parts *= size
            elif not isinstance(placement, Replicate):
                parts = 0
                break
        if parts == 0 or (p.dim() and p.shape[0] % parts):
            raise ValueError(
                f"{optimizer} flattens every parameter into one vector, which a DTensor allows only "
                f"when its rows split evenly over the ranks; under {layout} `{name}` (shape {tuple(p.shape)}) is "
                f"sharded as {p.placements}. Use zero_stage=0, or make its first dimension a multiple of the data "
                "parallel size (without tensor parallelism)."
            )


def refuse_shared_parameters(optimizers: Iterable[Optimizer], half_only: bool, layout: str) -> None:
    """Each wrapper steps its own fp32 copy of its parameters (ZeRO-1 slices, master weights): a parameter that two
    optimizers step would be overwritten with the other's stale copy at every step, so it is refused.

    `half_only`: only 16-bit parameters have copies (master weights); `layout` names the setting in the error.
    """
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for p in {id(p): p for g in optimizer.param_groups for p in g["params"]}.values():
            if half_only and p.dtype not in _HALF:
                continue
            first = owner.setdefault(id(p), index)
            if first != index:
                raise ValueError(
                    f"Optimizers {first} and {index} from `configure_optimizers` step the same parameter (shape "
                    f"{tuple(p.shape)}); under {layout} each optimizer steps its own fp32 copy of its parameters, "
                    "which the other's steps would overwrite. Give each optimizer its own parameters, or use "
                    "zero_stage=0 with fp32 parameters (precision='32-true' or '*-mixed') or zero_stage 2/3."
                )


def _install_masters(optimizer: Optimizer, groups: Optional[list[dict[str, Any]]] = None,
                     ) -> list[tuple[Tensor, nn.Parameter]]:
    """Put an fp32 master copy in place of every 16-bit parameter in `optimizer`'s groups (or `groups`, and state)."""
    mapping: dict[int, nn.Parameter] = {}
    pairs: list[tuple[Tensor, nn.Parameter]] = []
    groups = optimizer.param_groups if groups is None else groups
    for group in groups:
        for p in group["params"]:
            if p.dtype in _HALF and id(p) not in mapping:
                master = nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
                tp_shards.share_layout(master, p)  # a tp shard's master is one too: the norm counts it so
                mapping[id(p)] = master
                pairs.append((p, master))
    if not pairs:
        return pairs
    if optimizer.state:
        optimizer.state = type(optimizer.state)({mapping.get(id(p), p): s for p, s in optimizer.state.items()})
    for group in groups:  # in place: LBFGS steps the list it took from its first group
        group["params"][:] = [mapping.get(id(p), p) for p in group["params"]]
    return pairs


class MixedPrecisionOptimizer(Optimizer):
    """Wraps the user's optimizer (see the module docstring).

    Args:
        optimizer: the user's optimizer; its ``param_groups`` and ``state`` are shared, not copied, so LR
            schedulers, clipping and checkpoints act on what is stepped.
        scaler: the loss scaler `HybridPrecision` multiplies into the loss (shared); ``None``: no unscaling and no
            overflow check.
        pp_group: the pipeline group the gradient statistics sum over (stages hold disjoint parameters).
        master_weights: step fp32 master copies of the 16-bit parameters (``bf16-true``/``16-true``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        scaler: Optional[Any] = None,
        pp_group: Optional[Any] = None,
        master_weights: bool = False,
    ) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise ValueError(f"The optimizer is already a {type(optimizer).__name__}.")
        self.scaler = scaler
        self.pp_group = pp_group
        # (16-bit model parameter, fp32 master) for each parameter the user's optimizer steps as a master
        self.master_weights = master_weights
        self.master_pairs = _install_masters(optimizer) if master_weights else []
        self.steps = 0  # training steps taken or skipped (what `SkippableLRScheduler` compares against)
        self.step_skipped = False  # the last training step's overflow decision
        self._found_inf: Optional[bool] = None  # None until `prepare_grads` in this step
        self._stats: Optional[Tensor] = None
        # model parameter id -> the `.grad` `publish_model_grads` showed it (a dict: Lightning's LightningOptimizer
        # calls `zero_grad` on a shallow copy of this object's __dict__, so state must live in shared containers)
        self._published: dict[int, Tensor] = {}
        # a replacement of the user's optimizer step (`onebit_adam.FrozenVarianceAdam.step`, 1-bit Adam's frozen
        # variance): called with the user's optimizer, True when it stepped it
        self.step_override: Optional[Callable[[Optimizer], bool]] = None
        # torch.optim.Optimizer bookkeeping (hooks, profiling names), then share the user's groups and state
        Optimizer.__init__(self, [{"params": [torch.zeros(0, requires_grad=True)]}], {})
        self.optimizer = optimizer
        self._share_state()

    def _share_state(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The user's optimizer's groups, always: one that rebinds them (Lightning's `BaseFinetuning` restoring the
        groups it added, torch's `load_state_dict`) rebinds the user's optimizer's, which LR schedulers hold."""
        inner = vars(self).get("optimizer")
        return vars(self)["_own_groups"] if inner is None else inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        inner = vars(self).get("optimizer")
        if inner is None:  # torch's Optimizer.__init__ (the placeholder group)
            vars(self)["_own_groups"] = groups
        else:
            inner.param_groups = groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A new group while training (Lightning's `BaseFinetuning` unfreezing layers) goes to the user's optimizer,
        whose groups this wrapper shares (LR schedulers and `LearningRateMonitor` see it); its 16-bit parameters get
        fp32 master copies, as those of the first groups did."""
        if "optimizer" not in vars(self):  # torch's Optimizer.__init__ adds the placeholder group
            return Optimizer.add_param_group(self, param_group)
        self.optimizer.add_param_group(param_group)
        if self.master_weights:
            self.master_pairs.extend(_install_masters(self.optimizer, self.optimizer.param_groups[-1:]))

    def main_params(self) -> list[Tensor]:
        """What the step updates, in the optimizer's order: fp32 masters, ZeRO-1 slices or the fp32 parameters."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ---- the step's parts, in order ------------------------------------------------------------
    def prepare_grads(self) -> bool:
        """Main gradients from the model's, unscaled; True when any rank saw inf/nan. Once per step; collective."""
        if self._found_inf is None:
            self._copy_model_grads_to_main_grads()
            found = False
            if self.scaler is not None:
                params = self.main_params()
                grads = [p.grad for p in params if p.grad is not None]
                device = gn.local_tensor(grads[0] if grads else params[0]).device if params else torch.device("cpu")
                found = gn.all_ranks_found_inf(gn.unscale_and_check_(grads, 1.0 / self.scaler.scale, device))
            self._found_inf = found
            self.publish_model_grads()  # `on_before_optimizer_step` reads the unscaled gradients, as in Lightning
        return self._found_inf

    def gradient_statistics(self) -> Tensor:
        """This step's fp32 ``[global grad norm, element variance]`` of the unscaled main gradients.

        Computed once per step (clipping, the logged ``grad_norm`` and GradientHealthGuard share it); collective.
        """
        self.prepare_grads()
        if self._stats is None:
            self._stats = gn.gradient_statistics(self.main_params(), pp_group=self.pp_group)
        return self._stats

    def clip_grad_norm_(self, max_norm: float) -> Optional[Tensor]:
        """Clip by the global norm; returns it (None on an overflowing step, which every rank skips)."""
        if self.prepare_grads():
            return None
        total = self.gradient_statistics()[0]
        gn.clip_grads_by_total_norm_(self.main_params(), float(max_norm), total)
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        if not self.prepare_grads():
            torch.nn.utils.clip_grad_value_(self.main_params(), clip_value=clip_value)

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Skip on overflow, else step the main parameters and copy them into the model's.

        Outside a training step (no `prepare_grads` since the last step, e.g. DCP initialising optimizer state
        with zero gradients) this is the user's plain step: nothing is unscaled or counted and the scaler is left
        alone. With a `closure` the user's optimizer evaluates it (see `_step_evaluating`).
        """
        if closure is not None:
            return self._step_evaluating(closure, **kwargs)
        found_inf = self._found_inf
        out = None
        if not found_inf:
            out = self._step_main_params(closure, **kwargs)
            self._copy_main_params_to_model_params()
            # what torch's LR schedulers watch ("optimizer.step() before lr_scheduler.step()"): the user's optimizer,
            # which they keep pointing at (ZeRO-1 steps another instance of its class)
            self.optimizer._opt_called = True
            self._opt_called = True
        if found_inf is not None:
            if self.scaler is not None:
                self.scaler.update(found_inf)
            self.steps += 1
            self.step_skipped = found_inf
            self._found_inf = None
            self._stats = None
        return out

    def _step_evaluating(self, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The user's optimizer steps with `closure` and calls it itself, once (SGD, Adam) or several times (LBFGS).

        Each call first shows the model the current main parameters (LBFGS re-evaluates the loss after moving
        them), runs the closure (Lightning's: training step and backward) and prepares that evaluation's main
        gradients, so that the user's optimizer reads what this wrapper would step. No loss scale: an overflow
        cannot be skipped inside the user's optimizer (`HybridPrecision` refuses the combination).
        """
        if self.scaler is not None:
            raise ValueError(
                f"{type(self.optimizer).__name__}.step(closure) evaluates the loss inside its own step, where a "
                "loss-scaling overflow cannot be skipped; pass HybridPrecision(loss_scale=None) (or precision="
                "'32-true'), or step without a closure."
            )

        def evaluate() -> Any:
            self._copy_main_params_to_model_params()
            self._found_inf, self._stats = None, None  # a fresh backward: its gradients are prepared anew
            with torch.enable_grad():
                loss = closure()
            self.prepare_grads()
            return loss

        try:
            out = self._step_main_params(evaluate, **kwargs)
            self._copy_main_params_to_model_params()
        finally:
            self._found_inf, self._stats = None, None
        self.optimizer._opt_called = True
        self._opt_called = True
        self.steps += 1
        self.step_skipped = False
        return out

    # a scheduler built on the wrapper itself: torch checks that its optimizer's `step` is wrapped to warn about a
    # scheduler stepping first (`_opt_called`, set above), an order Lightning's loop already guarantees
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.hide_model_grads()  # (never zeroed in place: a shown gradient is a copy or a view)
        for p, _ in self.master_pairs:  # the 16-bit gradients, when no step consumed them
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ---- the model's `.grad` in Lightning's hooks ------------------------------------------------
    def publish_model_grads(self) -> None:
        """Show each model parameter this step's main gradient as ``.grad`` (what Lightning's hooks and user code
        read). ``*-true``: the 16-bit ``.grad`` from backward is kept and overwritten with the unscaled fp32 main
        gradient (a copy: editing it does not change the step). fp32 parameters step their own ``.grad``."""
        with torch.no_grad():
            for p, master in self.master_pairs:
                if master.grad is None:
                    p.grad = None
                elif p.grad is not None:
                    gn.local_tensor(p.grad).copy_(gn.local_tensor(master.grad))
                    self._published[id(p)] = p.grad

    def hide_model_grads(self) -> None:
        """Before a backward: drop the ``.grad`` that `publish_model_grads` showed, so that autograd starts from
        None (it cannot add to an unscaled copy or a ZeRO-1 slice); gradients of accumulating micro-steps, which
        were never published, stay."""
        if self._published:
            for p in self._published_params():
                shown = self._published.get(id(p))
                if shown is not None and p.grad is shown:
                    p.grad = None
            self._published.clear()

    def _published_params(self) -> list[Tensor]:
        return [p for p, _ in self.master_pairs]

    # ---- what a subclass changes (ZeRO-1) -------------------------------------------------------
    def _copy_model_grads_to_main_grads(self) -> None:
        for p, master in self.master_pairs:
            master.grad = None if p.grad is None else p.grad.detach().to(torch.float32)

    def _step_main_params(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        if self.step_override is not None and closure is None and self.step_override(self.optimizer):
            return None
        return self.optimizer.step(closure, **kwargs) if closure is not None else self.optimizer.step(**kwargs)

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        for p, master in self.master_pairs:
            p.copy_(master)

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self._share_state()  # torch rebinds `state` and `param_groups` on load

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


@contextlib.contextmanager
def masters_as_parameters(module: nn.Module, optimizers: Iterable[Any]) -> Generator[None, None, None]:
    """While inside, `module`'s 16-bit parameters are replaced by their fp32 master copies (``*-true``).

    The optimizer steps the masters, which are not module parameters, so FQN-keyed state-dict APIs
    (``torch.distributed.checkpoint.state_dict``, used for sharded checkpoints) cannot key the optimizer state by
    parameter name. Inside this context they can, and the module's state dict holds the fp32 masters: the exact
    weights, reshardable like any other tensor and loadable by a ``32-true``/``*-mixed`` run. On exit the 16-bit
    parameters are put back and refreshed from the masters (a no-op after a save, the restored weights after a
    load). A no-op without master weights (ZeRO-1's slices are handled by the checkpoint code itself).
    """
    by_param = {id(p): m for o in optimizers for p, m in getattr(unwrap_optimizer(o), "master_pairs", ())}
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


class SkippableLRScheduler:
    """The user's LR scheduler, whose ``step()`` is skipped right after a skipped optimizer step.

    Everything else (``state_dict``, ``load_state_dict``, ``get_last_lr``, attributes) is the scheduler's own, so
    checkpoints are unchanged. A wrapper rather than a rewritten class: the user's scheduler object keeps its class.
    """

    _OWN = ("scheduler", "_optimizer", "_seen")

    def __init__(self, scheduler: Any, optimizer: MixedPrecisionOptimizer) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_seen", optimizer.steps)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        fresh = self._optimizer.steps != self._seen  # each skipped optimizer step skips one scheduler step
        object.__setattr__(self, "_seen", self._optimizer.steps)
        if fresh and self._optimizer.step_skipped:
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        scheduler = vars(self).get("scheduler")
        if scheduler is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"SkippableLRScheduler({self.scheduler!r})"


def wrap_lr_schedulers(lr_scheduler_configs: Iterable[Any], wrappers: dict[int, MixedPrecisionOptimizer]) -> None:
    """Wrap each step-interval scheduler (not ReduceLROnPlateau) of a wrapper that can skip a step in a
    `SkippableLRScheduler` (`wrappers`: id of the user's optimizer -> its wrapper).

    The schedulers keep pointing at the user's optimizer, whose ``param_groups`` are the wrapper's (shared by
    `MixedPrecisionOptimizer`, aliased to the stepped slices' groups by ZeRO-1's `DistributedOptimizer`): the learning
    rates they write are the ones stepped, and Lightning's `LearningRateMonitor` names and reads the user's optimizer
    exactly as under Lightning's own strategies (``lr-AdamW``, once).
    """
    for config in lr_scheduler_configs:
        sched = config.scheduler
        inner = sched.scheduler if isinstance(sched, SkippableLRScheduler) else sched
        target = inner.optimizer
        owner = target if isinstance(target, MixedPrecisionOptimizer) else wrappers.get(id(target))
        if owner is None:
            continue
        step_interval = getattr(config, "interval", "step") == "step" and not getattr(config, "reduce_on_plateau", False)
        if owner.scaler is not None and step_interval and not isinstance(sched, SkippableLRScheduler):
            config.scheduler = SkippableLRScheduler(sched, owner)
