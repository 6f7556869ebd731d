"""Vocab-sharded logits that ordinary code can use: what a tensor-parallel LM head returns.

Under tp each rank's LM head computes only its slice of the vocabulary. As a raw DTensor that output breaks
ordinary code (torchmetrics, ``logits.argmax(-1) == y``, ``generate``: "mixed torch.Tensor and DTensor");
gathering it in the head would make every training step hold the full logits on every rank.
:class:`VocabParallelLogits` looks like the full logits (shape, dtype, device, ``requires_grad``) but holds
only this rank's shard:

* the ops a loss applies first (``view``/``reshape``/``flatten``, dtype casts, ``contiguous``, slicing,
  ``transpose``, ``detach``, ...) keep it sharded, and ``F.cross_entropy`` of it inside the strategy's steps
  runs vocab-parallel (`tensor.vocab_parallel_cross_entropy`): the training loss never gathers the logits;
* any other use (``argmax``, ``==``, ``softmax``, torchmetrics, ``generate``'s sampling, ``.cpu()``) first
  gathers the full logits over the tp group, once per tensor (cached, differentiable: gradients flow back to
  this rank's shard), and runs on that plain tensor, so results are ordinary tensors with the values a single
  process computes.

The gather is a collective over the tp group: code that uses the logits must run on every tp rank, as the
forward itself does. ``repr``/``format`` never gather (they show the local shard): printing on one rank is safe.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["VocabParallelLogits", "unwrap_logits"]

# ops that keep the logits vocab-sharded (what a loss does before cross_entropy); run on the DTensor
_SHARDED_OPS: set[Callable] = {
    Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten, Tensor.unflatten,
    Tensor.contiguous, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.to,
    Tensor.clone, torch.clone, Tensor.detach, torch.detach, Tensor.__getitem__,
    Tensor.transpose, torch.transpose, Tensor.permute, torch.permute, Tensor.squeeze, torch.squeeze,
    Tensor.unsqueeze, torch.unsqueeze,
}
# metadata and autograd plumbing: answered by the DTensor (global shape, dtype, device), no communication
_METADATA_OPS: set[Callable] = {
    Tensor.size, Tensor.dim, Tensor.numel, torch.numel, Tensor.nelement, Tensor.element_size,
    Tensor.is_floating_point, torch.is_floating_point, Tensor.is_complex, torch.is_complex, Tensor.get_device,
    Tensor.__len__, Tensor.stride, Tensor.is_contiguous, Tensor.register_hook, Tensor.retain_grad,
}
_METADATA_ATTRS = {
    "shape", "dtype", "device", "ndim", "requires_grad", "grad_fn", "is_leaf", "layout", "grad", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "itemsize", "nbytes", "names",
    "output_nr", "retains_grad", "_version", "_base",
}


def _is_metadata_getter(func: Callable) -> bool:
    return getattr(func, "__name__", None) == "__get__" and getattr(getattr(func, "__self__", None), "__name__",
                                                                       None) in _METADATA_ATTRS


class VocabParallelLogits(Tensor):
    """The full logits, held as this rank's vocabulary shard (a DTensor sharded on one dim); see the module docs.

    ``to_local()`` is the shard, ``full_tensor()`` the gathered plain tensor (the same cached value every other
    op uses), ``dtensor`` the underlying DTensor.
    """

    _dtensor: DTensor
    _full: Optional[Tensor]

    @staticmethod
    def __new__(cls, dtensor: DTensor) -> "VocabParallelLogits":
        self = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, dtensor.shape, strides=dtensor.stride(), dtype=dtensor.dtype, device=dtensor.device,
            requires_grad=False,  # autograd runs on the DTensor or the gathered tensor, never on this wrapper
        )
        self._dtensor = dtensor
        self._full = None
        return self

    def __init__(self, dtensor: DTensor) -> None:  # noqa: D107 (all set in __new__)
        super().__init__()

    # -- explicit access ---------------------------------------------------------------------------------
    @property
    def dtensor(self) -> DTensor:
        return self._dtensor

    def to_local(self) -> Tensor:
        return self._dtensor.to_local()

    def full_tensor(self) -> Tensor:
        """The full logits as a plain tensor (a collective over tp the first time; cached, differentiable)."""
        grad = torch.is_grad_enabled() and self._dtensor.requires_grad
        full = self._full
        if full is None or (grad and full.grad_fn is None):
            full = self._dtensor.full_tensor()
            self._full = full
        return full if grad or not full.requires_grad else full.detach()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        dt = self._dtensor
        return (f"VocabParallelLogits(shape={tuple(dt.shape)}, dtype={dt.dtype}, placements={tuple(dt.placements)}, "
                f"local={dt.to_local()!r})")

    # -- every torch function ------------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _is_metadata_getter(func) or func in _METADATA_OPS:
            return func(*tree_map(unwrap_logits, args), **tree_map(unwrap_logits, kwargs))
        if func is Tensor.__repr__ or func is Tensor.__format__:  # printing never communicates
            return format(args[0].__repr__(), *args[1:])
        if func is Tensor.__hash__:
            return id(args[0])
        if func is Tensor.requires_grad_:
            args[0]._dtensor.requires_grad_(*args[1:], **kwargs)
            return args[0]
        if func in _SHARDED_OPS:
            out = _run_sharded(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*tree_map(_gathered, args), **tree_map(_gathered, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        raise RuntimeError(
            f"{func} reached VocabParallelLogits below the Python layer (its __torch_function__ handles every op); "
            "call `.full_tensor()` on the logits first to get a plain tensor."
        )


def unwrap_logits(x: Any) -> Any:
    """The DTensor inside a VocabParallelLogits; anything else unchanged."""
    return x._dtensor if isinstance(x, VocabParallelLogits) else x


def _gathered(x: Any) -> Any:
    return x.full_tensor() if isinstance(x, VocabParallelLogits) else x


def _run_sharded(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func` on the DTensor; the result stays wrapped while a dim is still sharded. NotImplemented when DTensor
    cannot run it sharded (e.g. an index tensor): the caller then runs it on the gathered tensor. DTensor decides
    the sharding before any communication, so every tp rank takes the same branch."""
    dargs, dkwargs = tree_map(unwrap_logits, args), tree_map(unwrap_logits, kwargs)
    if any(isinstance(t, Tensor) and not isinstance(t, DTensor) for t in tree_leaves((dargs, dkwargs))):
        return NotImplemented  # e.g. logits[mask]: mixed plain/DTensor indexing
    try:
        out = func(*dargs, **dkwargs)
    except (RuntimeError, NotImplementedError, ValueError, AssertionError):
        return NotImplemented
    return tree_map(_wrap, out)


def _wrap(x: Any) -> Any:
    if not isinstance(x, DTensor):
        return x
    if any(p.is_shard() for p in x.placements):
        return VocabParallelLogits(x)
    return x.full_tensor()
