"""1-bit Adam's optimizer side (Tang et al. 2021): `gradient_compression={..., "frozen_variance": True}`.

Error feedback keeps the *sum* of what is sent equal to the sum of what was meant, which is enough for an update
linear in the communicated values (SGD), not for Adam: it divides each coordinate by its own RMS, so error
feedback's bursts inflate the variance and shrink the step (measured on the example GPT, 300 AdamW steps at dp=2:
top-k +93%, onebit +250% over the uncompressed loss). 1-bit Adam therefore warms up dense, then freezes Adam's
variance and compresses each rank's *momentum*: the update is linear in what is exchanged again.

`compression.Compressor.sum` asks `momentum` for the momentum of a bucket's parameters and sends
``b1 m + (1 - b1) g`` compressed; `step` then runs torch's Adam/AdamW update with those parameters' variance
kept frozen. Only plain ``torch.optim.Adam``/``AdamW`` at zero_stage 0 (whole parameters, unsharded state) can
be stepped so; anything else is refused when the optimizers are bound. A branch's 1-bit Adam (`branch_layouts`)
is the same exchange over its branch-dp group (`branch.apply.BranchGradientSync`): only its parameters' variance
freezes, the rest of the optimizer steps as torch's Adam/AdamW.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from lightning_npu.parallel.errors import CompressionConfigError


class FrozenVarianceAdam:
    """The Adam optimizers whose momentum is compressed, and their step with the variance frozen."""

    def __init__(self) -> None:
        # id(model parameter) -> (torch Adam/AdamW, what it steps (the parameter or its fp32 master), its group's index)
        self._adam: dict[int, tuple[Any, torch.Tensor, int]] = {}
        # the stepped parameters whose momentum this step sent compressed -> the dense steps their variance saw
        self._frozen_now: dict[int, int] = {}
        self._wrappers: list[Any] = []  # the bound `MixedPrecisionOptimizer`s

    def bind(self, optimizers: list[Any]) -> None:
        """The strategy's `MixedPrecisionOptimizer` wrappers (zero_stage 0: `ParallelConfig` refuses ZeRO 1): each
        must wrap a plain Adam/AdamW; it then steps through `step`."""
        for wrapper in optimizers:
            inner = getattr(wrapper, "optimizer", None)
            if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
                raise CompressionConfigError(
                    f"`gradient_compression` frozen_variance=True (1-bit Adam) freezes the variance of "
                    f"torch.optim.Adam or AdamW; got {type(inner).__name__}. Use frozen_variance=False "
                    "(gradient error feedback) with other optimizers.")
            for group in inner.param_groups:
                bad = [k for k in ("amsgrad", "maximize", "differentiable") if group.get(k)]
                if bad:
                    raise CompressionConfigError(
                        f"`gradient_compression` frozen_variance=True supports Adam/AdamW without {bad}.")
            self._wrappers.append(wrapper)
            self._index(wrapper)
            wrapper.step_override = self.step

    def _index(self, wrapper: Any) -> None:
        masters = {id(m): p for p, m in getattr(wrapper, "master_pairs", ())}
        for i, group in enumerate(wrapper.optimizer.param_groups):  # (by index: a resume's load replaces the dicts)
            for p in group["params"]:
                self._adam[id(masters.get(id(p), p))] = (wrapper.optimizer, p, i)

    def _entry(self, p: torch.Tensor) -> Any:
        """The (optimizer, stepped tensor, group index) of model parameter `p`; groups added while training
        (`add_param_group`, Lightning's `BaseFinetuning`) are indexed when first met."""
        if id(p) not in self._adam:
            for wrapper in self._wrappers:
                self._index(wrapper)
        return self._adam.get(id(p))

    def momentum(self, flat: torch.Tensor, warmup_steps: int, params: Optional[list[torch.Tensor]],
                 parts: int) -> tuple[torch.Tensor, Union[float, torch.Tensor]]:
        """The Adam momentum of the gradients in `flat` (back to back) and its beta1 (one number, or one per value
        where the parameters' groups differ); records the parameters as frozen for this step's `step`."""
        if params is None or parts != 1:
            raise ValueError("frozen_variance compresses Adam's momentum: Compressor.sum needs the bucket's `params` "
                             "in one part (zero_stage=0).")
        ms, betas = [], []
        for p in params:
            entry = self._entry(p)
            if entry is None:
                raise CompressionConfigError(
                    "`gradient_compression` frozen_variance=True: a compressed parameter is not stepped by a bound "
                    "torch.optim.Adam/AdamW.")
            optimizer, stepped, index = entry
            group = optimizer.param_groups[index]
            m = optimizer.state.get(stepped, {}).get("exp_avg")
            ms.append(torch.zeros(p.numel(), device=flat.device) if m is None else m.detach().flatten().float())
            betas.append(float(group["betas"][0]))  # the group's current value (a scheduler may change it)
            self._frozen_now[id(stepped)] = warmup_steps
        m = torch.cat(ms)
        if m.numel() != flat.numel():
            raise ValueError(f"frozen_variance: the bucket holds {flat.numel()} values, its parameters {m.numel()}.")
        if len(set(betas)) == 1:
            return m, betas[0]
        return m, torch.cat([torch.full((p.numel(),), b, device=flat.device) for p, b in zip(params, betas)])

    @torch.no_grad()
    def step(self, optimizer: Any) -> bool:
        """Step `optimizer` (Adam/AdamW) as torch does, except that the parameters whose momentum this step's
        exchange compressed keep their variance (frozen after the warm-up, bias-corrected for the warm-up's steps).
        False (nothing done: the optimizer's own step runs) when no parameter of it was compressed this step."""
        own = {id(p) for g in optimizer.param_groups for p in g["params"]}
        frozen = {k: n for k, n in self._frozen_now.items() if k in own}
        if not frozen:
            return False
        for k in frozen:
            del self._frozen_now[k]
        decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = (float(b) for b in group["betas"])
            lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
            for p in params:
                state = optimizer.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [optimizer.state[p] for p in params]
            grads = [p.grad for p in params]
            if wd and group.get("decoupled_weight_decay", decoupled_default):
                torch._foreach_mul_(params, 1 - lr * wd)
            elif wd:
                grads = torch._foreach_add(grads, params, alpha=wd)
            for state in states:
                state["step"] += 1
            torch._foreach_lerp_([s["exp_avg"] for s in states], grads, 1 - beta1)
            live = [i for i, p in enumerate(params) if id(p) not in frozen]
            if live:
                squares = [states[i]["exp_avg_sq"] for i in live]
                torch._foreach_mul_(squares, beta2)
                torch._foreach_addcmul_(squares, [grads[i] for i in live], [grads[i] for i in live], value=1 - beta2)
            steps = [float(s["step"]) for s in states]
            # the frozen variance averaged the warm-up's dense steps: its bias correction stays theirs
            seen = [frozen.get(id(p), n) for p, n in zip(params, steps)]
            denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
            torch._foreach_div_(denom, [math.sqrt(1 - beta2 ** n) for n in seen])
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denom,
                                    [-lr / (1 - beta1 ** n) for n in steps])
        return True
