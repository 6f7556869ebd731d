"""An optimizer made before the layout was applied (``optimizer = Adam(model.parameters())`` in ``__init__`` or
before ``trainer.fit``, then returned by ``configure_optimizers``) still holds the parameters the model had then;
FSDP2 (ZeRO 2/3) and tensor parallelism put new parameter objects in their place. It is rebound to them by name,
so that it steps what the model trains, as under Lightning's own strategies, which keep the parameters."""

from __future__ import annotations

from typing import Any

from torch import nn


def parameters_by_id(model: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    """The model's parameters before the layout is applied (kept alive until `rebind` has run)."""
    return {id(p): (name, p) for name, p in model.named_parameters(remove_duplicate=False)}


def rebind(optimizers: list[Any], before: dict[int, tuple[str, nn.Parameter]], model: nn.Module) -> None:
    """Replace, in each optimizer's groups, every parameter the layout replaced by the model's parameter of the same
    name (in place: the LR schedulers hold the same optimizer). State, if any, follows where the shapes agree."""
    now = dict(model.named_parameters(remove_duplicate=False))
    current = {id(p) for p in now.values()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                name = before.get(id(p), (None, None))[0]
                new = now.get(name) if name is not None and id(p) not in current else None
                if new is not None:
                    state = optimizer.state.pop(p, None)
                    if state and all(getattr(v, "shape", None) in (None, new.shape) or v.dim() == 0
                                     for v in state.values()):
                        optimizer.state[new] = state
                    p = new
                params.append(p)
            group["params"] = params
