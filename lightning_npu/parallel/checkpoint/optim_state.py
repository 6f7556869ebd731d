"""Optimizer state by parameter name or by position: the one conversion between the two forms.

Torch's format (``optimizer.state_dict()``, a single-file checkpoint) keys ``state`` by each parameter's position in
the param groups; the sharded checkpoints, and every re-indexing, use the flat FQN-keyed form
``state.<fqn>.<name>`` (DCP's flattened optimizer state). Positions depend on the layout (a pipeline stage holds
only its part of the groups), names do not, so every conversion goes through the names, here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

STATE_PREFIX = "state."
FLAT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def flat_state(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's state of `optimizer` (unwrapped) in the flat FQN-keyed form, as it holds it: a ZeRO-1
    `DistributedOptimizer`'s DTensor slices, FSDP2's DTensor shards, or plain local tp shards."""
    if hasattr(optimizer, "sharded_state_dict"):
        return optimizer.sharded_state_dict()
    with initialised_state(optimizer):
        return get_optimizer_state_dict(module, optimizer, options=FLAT_OPTIONS)


def state_key(fqn: str, name: str) -> str:
    """The flat key of the state entry `name` (e.g. ``exp_avg``) of the parameter `fqn`."""
    return f"{STATE_PREFIX}{fqn}.{name}"


def split_state_key(key: str, prefix: str = STATE_PREFIX) -> tuple[str, str]:
    """``<prefix><fqn>.<name>`` -> (fqn, name); `key` starts with `prefix`."""
    fqn, _, name = key[len(prefix):].rpartition(".")
    return fqn, name


def by_position(groups: list[dict[str, Any]], flat: dict[str, Any]) -> dict[str, Any]:
    """Groups naming their parameters by FQN (``"params"``) and flat ``state.<fqn>.<name>`` entries -> torch's
    position-indexed format. Entries of parameters that no group holds are left out."""
    index = {fqn: i for i, fqn in enumerate(f for g in groups for f in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        fqn, name = split_state_key(key)
        if fqn in index:
            state.setdefault(index[fqn], {})[name] = value
    return {"state": dict(sorted(state.items())),
            "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in groups]}


def by_name(state_dict: dict[str, Any], fqns: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Inverse of :func:`by_position`: torch's format, whose positions are the parameters `fqns` names (all groups
    in order) -> (flat ``state.<fqn>.<name>`` entries, the groups naming their parameters by FQN)."""
    flat = {state_key(fqns[i], name): v for i, entry in state_dict["state"].items() for name, v in entry.items()}
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in state_dict["param_groups"]]
    return flat, groups


def nested(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat ``state.<fqn>.<name>`` entries -> ``{fqn: {name: value}}`` (`set_optimizer_state_dict`'s ``state``)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        fqn, name = split_state_key(key)
        out.setdefault(fqn, {})[name] = value
    return out


def reindexed(state_dict: dict[str, Any], saved_fqns: list[str], own: list[list[str]]) -> dict[str, Any]:
    """Torch's format whose positions are the parameters `saved_fqns` names -> the same for the groups `own` (each
    a list of FQNs, e.g. one pipeline stage's), with the saved groups' hyper-parameters."""
    flat, _ = by_name(state_dict, saved_fqns)
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": fqns}
              for fqns, saved in zip(own, state_dict["param_groups"])]
    return by_position(groups, flat)


@contextmanager
def initialised_state(optimizer: Any) -> Iterator[None]:
    """DCP's `get/set_optimizer_state_dict` first give an optimizer without state (SGD without momentum, or before its
    first step) zero gradients and step it at lr 0, then call the *user's* ``zero_grad``: a callback counting or
    mocking it (Lightning's accumulation tests) sees a call no training step made. The same here, except that the
    zero gradients stay while DCP runs (it then skips its own) and are dropped directly afterwards."""
    if optimizer.state or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        yield
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step(closure=None)
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if "lr" in g:
                g["lr"] = lr
    try:
        yield
    finally:
        for p in params:
            p.grad = None
