"""What a rank holds, counted exactly from the tensors themselves: model state and the activations saved for backward.

Counting storages rather than asking the allocator works on every device (the CPU has no caching allocator) and
splits the total by kind. A storage is counted once however many tensors view it (DDP's gradient buckets, ZeRO-1's
slices, the optimizer's views of its masters), and a DTensor counts its local shard: the bytes on this rank.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch import nn

from lightning_npu.parallel.optim.mixed_precision import stepped_groups, unwrap_optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of the storage under `t`; key 0 for a storage with no memory (FSDP2's freed unsharded weights)."""
    s = _local(t).untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else (0, 0)


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]], exclude: frozenset[int] = frozenset()) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key, nbytes = _storage(t)
            if key and key not in exclude:
                seen[key] = nbytes
    return sum(seen.values())


def storage_keys(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    return frozenset(k for k, _ in map(_storage, tensors) if k)


def _optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    optimizer = unwrap_optimizer(optimizer)
    seen: set[int] = set()
    for opt in (optimizer, getattr(optimizer, "optimizer", None), getattr(optimizer, "inner", None)):
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        for state in opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        for group in stepped_groups(opt):  # masters: what the optimizer steps instead of the model's own parameters
            yield from group["params"]
    yield from getattr(optimizer, "masters", ())  # ZeRO-1: the flat fp32 slices the masters view


def model_state_bytes(module: nn.Module, optimizers: Iterable[Any] = ()) -> dict[str, int]:
    """Bytes this rank holds for the parameters, their gradients and the optimizer (state and fp32 masters)."""
    params = list(module.parameters())
    param_keys = storage_keys(params)
    grads = [p.grad for p in params]
    for opt in optimizers:  # ZeRO-1 / masters: the gradients the step reads live on the masters
        grads += [p.grad for p in _optimizer_tensors(opt) if isinstance(p, torch.Tensor) and p.grad is not None]
    optimizer = [t for opt in optimizers for t in _optimizer_tensors(opt)]
    return {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(grads, exclude=param_keys),
        "optimizer_state": storage_bytes(optimizer, exclude=param_keys | storage_keys(t for t in grads if t is not None)),
    }


_ACTIVE: list["SavedActivations"] = []  # the meters counting now (innermost last)


def note_kept(output: Any) -> None:
    """Outputs that torch's selective checkpointing keeps in its own cache, which saved-tensor hooks never see
    (`recompute` reports them); they count until the meter stops."""
    if _ACTIVE:
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                _ACTIVE[-1]._keep(t)


class SavedActivations:
    """Bytes of the tensors autograd keeps for backward (`torch.autograd.graph.saved_tensors_hooks`), now and at peak.

    A saved tensor counts until autograd lets it go (backward consumed it, or the graph was dropped), so under a
    pipeline schedule, where forwards and backwards interleave, ``peak`` is the real high-water mark. Parameters
    saved by a matmul are not activations and are skipped (leaves that require grad, and the storages in `ignore`,
    which the tp plan's DTensor views of local shards share). What selective checkpointing keeps (`note_kept`) has
    no release signal and counts until `stop`: exact for a step's usual peak at the end of forward, an upper bound
    under an interleaving pipeline schedule.
    """

    def __init__(self, ignore: frozenset[int] = frozenset()) -> None:
        self.ignore = ignore
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage key -> [bytes, live saved tensors viewing it]
        self._hooks: Any = None
        self._kept: list[int] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return t  # a parameter (or its transpose), including FSDP2's all-gathered ones
        key, nbytes = _storage(t)
        if key and key not in self.ignore:
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [nbytes, 0]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            # autograd holds what the hook returns, so its release is the packed object's death. Returning `t`
            # itself would tie a saved *output* (SDPA's, say) to its own grad_fn in a cycle only backward breaks:
            # a graph dropped without backward (the pipeline's shape inference on stage 0) would never be freed.
            t = t.detach()
            weakref.finalize(t, self._release, key)
        return t

    def _keep(self, t: torch.Tensor) -> None:
        key, nbytes = _storage(t)
        if key and key not in self.ignore and key not in self._live:
            self._live[key] = [nbytes, 1]  # never released by a finalizer: cleared at `stop`
            self._kept.append(key)
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self._live[key]

    def start(self) -> None:
        """Count from here (reset the peak), until `stop`."""
        self.peak = self.current
        if self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()
            _ACTIVE.append(self)

    def stop(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            _ACTIVE.remove(self)
        for key in self._kept:
            self._release(key)
        self._kept = []

    def __enter__(self) -> "SavedActivations":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
