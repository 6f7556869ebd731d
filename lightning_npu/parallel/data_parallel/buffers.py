"""Keep module buffers (BatchNorm running statistics, counters) in step over the dp ranks, as DDP does.

DDP (``broadcast_buffers=True``, Lightning's ``"ddp"`` and our zero 0) overwrites every rank's buffers with
dp-rank 0's before a forward; layouts without a DDP wrapper (zero 1, 2 and 3, and zero 0 under pipeline
parallelism) would otherwise let each rank's running statistics drift with its own batches. `BufferBroadcast`
repeats DDP's rule around each Lightning step (the call DDP's forward wraps): broadcast before a step unless
the previous step ran without gradients or without gradient synchronisation (evaluation, an accumulating
micro-step), with the collective DDP uses (``_broadcast_coalesced`` over the dp group, rank 0 authoritative).
A model without buffers costs nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_npu.parallel.mesh import replica_mesh

_BUCKET_BYTES = 250 * 2**20  # DDP's broadcast_bucket_size


class BufferBroadcast:
    """dp-rank 0's buffers to the other dp ranks before each step that DDP would broadcast before."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.module = module
        self.group = group
        self.sync_next = True  # DDP's `require_forward_param_sync`: True before the first forward

    def before_step(self) -> None:
        if not self.sync_next:
            return
        from torch.distributed.utils import _sync_params_and_buffers

        buffers = [b for b in self.module.buffers()]  # read every time: a module may reassign a buffer
        if buffers:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                _sync_params_and_buffers(self.group, buffers, _BUCKET_BYTES, src=0)

    def after_step(self, gradients_synchronised: bool) -> None:
        self.sync_next = torch.is_grad_enabled() and gradients_synchronised


def buffer_broadcast(module: nn.Module, mesh: DeviceMesh, uses_ddp: bool) -> Optional[BufferBroadcast]:
    """The layout's buffer sync: None when DDP already does it, dp is 1, or the module has no buffers."""
    dp_mesh = replica_mesh(mesh)
    if uses_ddp or dp_mesh.size() == 1 or not any(True for _ in module.buffers()):
        return None
    return BufferBroadcast(module, dp_mesh.get_group())
