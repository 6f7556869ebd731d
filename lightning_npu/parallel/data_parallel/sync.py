"""Gradient synchronisation over the mesh's ``dp`` dimension: one object per layout, one bucket reduction.

The strategy sees one `GradientSync` whatever the layout: it enters `no_sync()` around accumulating
micro-steps and calls `finish()` once after a stepping backward (or after a pipeline schedule). Every
gradient bucket that data parallelism communicates goes through `reduce_bucket`, the one place that
gradient compression and a hierarchical all-reduce wrap.

===============  ============================================  ===============================================
layout           who launches the bucket reductions            `finish()`
===============  ============================================  ===============================================
zero 0, pp = 1   DDP's reducer (C++ buckets overlapped with    DDP waited inside backward; what was unfrozen
                 backward), its comm hook calls `reduce_bucket`  after DDP wrapped the model: all-reduce it
zero 0, pp > 1   `GradientBuckets` (all-reduce), from each     launch the rest, wait, average (in place:
                 stage's last backward in the schedule         fp32 `.grad` is a view of its bucket, `hold`)
zero 1           `GradientBuckets` (reduce-scatter), from      launch the rest, wait, average; the optimizer
                 post-accumulate-grad hooks (pp = 1), or each  steps the reduced slices
                 stage's last backward (pp > 1)
zero 2 / 3       FSDP2 (reduce-scatter per unit, fp32), its    nothing left
                 custom reduce-scatter calls `reduce_bucket`
===============  ============================================  ===============================================

All reductions are fp32 SUMs divided by the dp size (the gradients of the mean loss over the global batch).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_npu.parallel.collectives import reduce_scatter_into
from lightning_npu.parallel.data_parallel import hierarchical


def reduce_bucket(flat: torch.Tensor, group: Any, out: Optional[torch.Tensor] = None, compressor: Any = None,
                  key: str = "", spec: Any = None, params: Optional[list[torch.Tensor]] = None, parts: int = 1,
                  hierarchy: Any = None, peers: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
    """Launch the SUM of one fp32 gradient bucket over the dp `group`; returns the async work.

    ``out=None``: all-reduce `flat` in place. Otherwise reduce-scatter `flat` (rank-major: rank r's part is
    the r-th of ``world`` equal chunks) into `out`. The caller waits and divides by the dp size.
    ``peers=(send, recv)`` (gloo's in-place ZeRO-1 buckets, whose `flat` is parameter-major): a reduce-scatter as
    one ``all_to_all_single`` that sends each other rank its rows (`send`, rank-major over the other ranks, packed
    by the caller) and receives theirs of this rank's rows (`recv`); the caller adds `recv` into its rows of `flat`.
    The bytes of a ring reduce-scatter, half an all-reduce's; gloo's own reduce-scatter costs more than its
    all-reduce (docs/communication.md).
    With a `compressor` (`compression.Compressor`) the SUM is the compressed exchange of bucket `key`, run
    synchronously; a reduce-scatter is then a compressed all-reduce of which this rank keeps its chunk (the
    wire cost is the compressed all-reduce's, never more than the uncompressed reduce-scatter's for the lossy modes).
    `spec`: the bucket's `CompressionSpec` where `gradient_compression` has per-module globs. `params`: the
    parameters whose gradients `flat` holds, in `parts` rank-major parts (`matrices_of`), for PowerSGD.
    """
    if compressor is not None:
        compressor.sum(flat, group, key, spec=spec, params=params, parts=parts)
        if out is not None:
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            out.copy_(flat.view(world, -1)[rank])
        return hierarchical.DoneWork(flat if out is None else out)  # compressed: synchronous
    if peers is not None:
        send, recv = peers
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        splits = [0 if r == rank else send.numel() // (world - 1) for r in range(world)]  # nothing to itself
        return dist.all_to_all_single(recv, send, splits, splits, group=group, async_op=True)
    if out is None:
        if hierarchy is not None and hierarchy.applies(flat):  # intra-node, inter-node, intra-node
            return hierarchy.all_reduce(flat)
        return dist.all_reduce(flat, group=group, async_op=True)
    return reduce_scatter_into(out, flat, group=group, async_op=True)


# ---- the buckets of zero 0 under pp and zero 1 -----------------------------------------------------
class _Slice:
    """One parameter's place in a bucket and this rank's rows of it (all rows when the bucket is not sharded).

    A 0-dim (scalar) parameter is one row; it only lives in unsharded (all-reduce) buckets, as DDP keeps it.
    """

    def __init__(self, param: nn.Parameter, offset: int, dp: int, rank: int) -> None:
        if param.dim() == 0 and dp > 1:
            raise ValueError("a 0-dim parameter cannot be sliced over dp; it belongs in a replicated bucket.")
        self.param = param
        self.offset = offset  # into this rank's part of the bucket
        self.full_offset = 0  # into the bucket's whole, parameter-major buffer (in-place buckets)
        rows = param.shape[0] if param.dim() else 1
        self.row_numel = (param[0].numel() if rows else 0) if param.dim() else 1
        self.chunk_rows = math.ceil(rows / dp)
        self.numel = self.chunk_rows * self.row_numel  # padded per-rank size
        self.start = min(rows, rank * self.chunk_rows)
        self.rows = max(0, min(rows, self.start + self.chunk_rows) - self.start)

    def rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor shaped like the parameter (a scalar is its own row)."""
        return full[self.start : self.start + self.rows] if full.dim() else full


class _Bucket:
    """Parameters of one dtype whose gradients are reduced together, and this rank's part of the result."""

    def __init__(self, params: list[nn.Parameter], dp: int, rank: int, device: torch.device, spec: Any = None,
                 replicated: bool = False) -> None:
        self.params = params
        self.group: Any = None  # the process group this bucket reduces over, and the size its SUM is divided by
        self.mesh: Optional[DeviceMesh] = None  # the 1-D mesh of `group`
        self.world = dp  # the ranks that share its rows (1: a replicated bucket)
        self.divide_by = dp
        self.flat: Optional[torch.Tensor] = None  # in-place buckets: every parameter's whole gradient, back to back
        self.replicated = replicated  # all-reduced and held whole on every rank, in a sharded (zero 1) set: scalars
        self.dtype = params[0].dtype
        self.spec = spec  # the CompressionSpec of every parameter here (None: uncompressed)
        self.slices: list[_Slice] = []
        offset = 0
        for p in params:
            s = _Slice(p, offset, dp, rank)
            self.slices.append(s)
            offset += s.numel
        self.total = offset
        self.grad = torch.zeros(offset, dtype=torch.float32, device=device)  # this rank's reduced part (sharded)
        self.ready = 0
        self.launched = False
        self.pending = False  # holds reduced gradients zero_grad has not cleared
        self.work: Any = None
        self.send: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None
        self.had_grad: list[bool] = []
        self.touched = False  # an in-place bucket a backward added to since the last sync
        self.held = False  # an in-place bucket a pipeline schedule writes into before zero_grad (`hold`)
        self.rank = rank
        self.peer_plan: Optional[list[tuple[int, list[torch.Tensor], list[tuple[int, int]]]]] = None  # all-to-all
        self.recv: Optional[torch.Tensor] = None

    def local_view(self, flat: torch.Tensor, s: _Slice) -> torch.Tensor:
        shape = (s.rows, *s.param.shape[1:]) if s.param.dim() else ()
        return flat[s.offset : s.offset + s.rows * s.row_numel].view(shape)

    def make_inplace(self) -> None:
        """Gradients accumulate straight into one parameter-major fp32 buffer (``p.grad`` is a view of it), which
        is reduced in place (all-to-all into this rank's rows, `plan_all_to_all`, or all-reduce): no copy at launch
        beyond the other ranks' rows, and this rank's rows of each parameter are views of it."""
        offset = 0
        for s in self.slices:
            s.full_offset = offset
            offset += s.param.numel()
        self.flat = torch.zeros(offset, dtype=torch.float32, device=self.grad.device)
        self.grad = self.flat[:0]  # the reduced slices are views of `flat` (`grad_view`)
        # one view object per parameter: ``p.grad is view`` tells whether autograd added in place
        self._views = [self.flat[s.full_offset : s.full_offset + s.param.numel()].view_as(s.param)
                       for s in self.slices]
        self._view_of = {id(s): v for s, v in zip(self.slices, self._views)}

    def plan_all_to_all(self) -> None:
        """An in-place bucket reduce-scattered by `reduce_bucket`'s all-to-all (gloo): for each other rank, the views
        of its rows of every parameter in `flat` and where they go in the send buffer (rank-major over the other
        ranks, each rank's part laid out as its reduced slices are, `_Slice.offset`), and this rank's own rows."""
        assert self.flat is not None and self.world > 1
        self.peer_plan = []
        for i, q in enumerate(r for r in range(self.world) if r != self.rank):
            srcs, dsts = [], []
            for s in self.slices:
                rows = s.param.shape[0]
                start = min(rows, q * s.chunk_rows)
                n = (max(0, min(rows, start + s.chunk_rows) - start)) * s.row_numel
                if n:
                    a = s.full_offset + start * s.row_numel
                    srcs.append(self.flat[a : a + n])
                    dsts.append((i * self.total + s.offset, n))
            self.peer_plan.append((i, srcs, dsts))
        self._own = [(self.grad_view(s).view(-1), s.offset) for s in self.slices if s.rows]

    def launch_all_to_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The send buffer (the other ranks' rows, one copy) and an empty receive buffer, for `reduce_bucket`."""
        assert self.peer_plan is not None
        send = torch.empty((self.world - 1) * self.total, dtype=torch.float32, device=self.flat.device)
        srcs = [v for _, views, _ in self.peer_plan for v in views]
        dsts = [send[a : a + n] for _, _, places in self.peer_plan for a, n in places]
        if srcs:
            torch._foreach_copy_(dsts, srcs)
        self.recv = torch.empty_like(send)
        return send, self.recv

    def add_received(self) -> None:
        """After the all-to-all: the other ranks' parts of this rank's rows added into them, the SUM averaged."""
        assert self.recv is not None
        own = [v for v, _ in self._own]
        if own:
            for i in range(self.world - 1):
                base = i * self.total
                torch._foreach_add_(own, [self.recv[base + o : base + o + v.numel()] for v, o in self._own])
            torch._foreach_div_(own, self.divide_by)
        self.recv = None

    def rescale_pending(self) -> None:
        """Before a backward adds to reduced rows that no ``zero_grad`` cleared (manual optimization, LBFGS): this
        rank's rows hold the mean and the other ranks' rows this rank's unreduced gradient. Make the rows a SUM's
        share again (mean x divisor, the others' rows zero), so that the next all-to-all gives mean + new mean."""
        if not self.pending or self.peer_plan is None:
            return
        own = [v for v, _ in self._own]
        if own:
            torch._foreach_mul_(own, self.divide_by)
        peers = [v for _, views, _ in self.peer_plan for v in views]
        if peers:
            torch._foreach_zero_(peers)
        self.pending = False

    def full_view(self, s: _Slice) -> torch.Tensor:
        """A parameter's whole gradient in the in-place buffer (what ``p.grad`` is)."""
        return self._view_of[id(s)]

    @torch.no_grad()
    def adopt(self, s: _Slice, keep_none: bool = False) -> None:
        """``p.grad`` becomes its buffer view; a plain gradient set elsewhere (user code, autograd starting from
        None) is copied in first. `keep_none`: a parameter without a gradient keeps None (no gradient this step)."""
        g, view = s.param.grad, self.full_view(s)
        if g is view or (g is None and keep_none):
            return
        if g is not None and not isinstance(g, DTensor) and g.shape == view.shape and g.data_ptr() != view.data_ptr():
            view.copy_(g)
        s.param.grad = view

    def grad_view(self, s: _Slice) -> torch.Tensor:
        """This rank's reduced rows of a parameter's gradient (what its master steps with)."""
        if self.flat is None:
            return self.local_view(self.grad, s)
        start = s.full_offset + s.start * s.row_numel
        shape = (s.rows, *s.param.shape[1:]) if s.param.dim() else ()
        return self.flat[start : start + s.rows * s.row_numel].view(shape)


class _Received:
    """ids of the parameters autograd gave a gradient (a post-accumulate-grad hook; a plain set cannot be one)."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def add_param(self, param: torch.Tensor) -> None:
        self.ids.add(id(param))


class GradientBuckets:
    """Gradients of `params` in fp32 buckets of `bucket_size_mb`, reduced over a dp group bucket by bucket.

    ``shard=True`` (zero 1): each rank keeps the averaged rows it owns (`_Bucket.grad_view`) and the full local
    gradients are dropped. ``shard=False`` (zero 0 under pp): all-reduce; the averaged gradients go back into each
    parameter's ``.grad``. Under ``shard=True`` 0-dim parameters (CLIP's ``logit_scale``) have no rows to split: they
    go in ``replicated`` buckets, all-reduced and kept whole on every rank, as DDP keeps them. With ``overlap`` a
    bucket launches from post-accumulate-grad hooks as soon as its last gradient is ready; otherwise `finish`
    launches them all.

    Under pipeline parallelism (no hooks: `params_ready` launches, from each stage's last backward) the runner
    lets a schedule write into the in-place buffers (`hold`, when zero_grad follows it) or adds its gradients to
    them afterwards (`take`); zero 0's buckets are in place there on every backend (``inplace=True``: an all-reduce
    needs no rank-major layout).

    Two ways to reduce a sharded bucket, the fastest per backend (``inplace=None`` picks):

    * in place (gloo, whose own reduce-scatter costs more than its all-reduce of the same bytes): each bucket is one
      parameter-major fp32 buffer, ``p.grad`` a view of it, so backward accumulates straight into it (Megatron's
      contiguous gradient buffer). Its reduce-scatter is one ``all_to_all_single`` per bucket: each rank sends the
      others their rows (packed once, the only copy) and adds what it receives into its own rows in place, half an
      all-reduce's bytes (``inplace_reduction = "all_reduce"``: the in-place all-reduce measured against it). This
      rank's ``Shard(0)`` rows are views of the buffer, so ``.grad`` and checkpoints keep their layout;
    * reduce-scatter (NCCL, HCCL): the local gradients are copied once into a rank-major send buffer at launch, as
      FSDP2 does (a gradient cannot be a view of a rank-major buffer: its rows land in every rank's chunk), and
      each rank receives only its rows.

    Each `add` may name its own `mesh` (the group its buckets reduce over) and `divide_by` (the ranks the mean is
    over, default that group's size): expert parameters reduce over the ranks holding them, divided by dp.
    """

    # how an in-place sharded bucket is reduced: "all_to_all" (a reduce-scatter of half an all-reduce's bytes,
    # measured faster on gloo, benchmarks/scaling.py --collectives) or "all_reduce" (every rank gets every row)
    inplace_reduction = "all_to_all"

    def __init__(self, params: list[nn.Parameter], dp_mesh: DeviceMesh, bucket_size_mb: float, shard: bool,
                 overlap: bool, compressor: Any = None, key_prefix: str = "buckets", hierarchy: Any = None,
                 inplace: Optional[bool] = None) -> None:
        self.compressor = compressor
        self.hierarchy = hierarchy  # `hierarchical.HierarchicalAllReduce` for the all-reduce buckets, or None
        self.key_prefix = key_prefix
        self.mesh = dp_mesh
        self.group = dp_mesh.get_group()
        self.dp = dp_mesh.size()
        self.shard = shard
        self.bucket_size_mb = bucket_size_mb
        self.overlap = overlap
        if inplace is None:  # compression packs its own buckets; NCCL/HCCL reduce-scatter from a rank-major copy
            inplace = shard and compressor is None and dist.get_backend(self.group) == "gloo"
        self.inplace = inplace
        self.params: list[nn.Parameter] = []
        self.buckets: list[_Bucket] = []
        self.slice_of: dict[int, tuple[_Bucket, _Slice]] = {}
        self.enabled = True
        self._hooks: list[Any] = []
        self._got = _Received()
        self.add(params)

    def add(self, params: list[nn.Parameter], mesh: Optional[DeviceMesh] = None,
            divide_by: Optional[int] = None, replicate: bool = False) -> list[_Bucket]:
        """Bucket `params` (at construction, and for an optimizer's `add_param_group`); returns the new buckets, which
        reduce after the existing ones (one fixed order on every rank). `mesh`: the 1-D mesh they reduce over
        (default the dp mesh given at construction); `divide_by`: the SUM's divisor (default that mesh's size).
        `replicate` (sharded buckets): all-reduced and held whole on every rank, as scalars are (a top-level ZeRO 0
        beside a branch's own ZeRO-1)."""
        mesh = self.mesh if mesh is None else mesh
        size = mesh.size()
        rank = mesh.get_local_rank() if self.shard and not replicate else 0
        device = params[0].device if params else torch.device("cpu")
        # buckets are homogeneous in dtype and compression spec (per-module globs): each is reduced one way
        spec_of = self.compressor.spec_of if self.compressor is not None else (lambda p: None)
        new = _make_buckets(params, self.bucket_size_mb, size if self.shard and not replicate else 1, rank, device,
                            spec_of)
        for bucket in new:
            bucket.group, bucket.mesh = mesh.get_group(), mesh
            bucket.divide_by = size if divide_by is None else divide_by
            if self.shard and (replicate or bucket.params[0].dim() == 0):
                bucket.replicated = True  # scalars (also over one rank) and `replicate`: whole on every rank
            if bucket.replicated:
                if not replicate:  # a few bytes: reduced uncompressed (no compressor handles a bucket of scalars)
                    bucket.spec = None
            elif self.inplace and bucket.dtype == torch.float32 and not any(
                    isinstance(p, DTensor) for p in bucket.params):  # a plain `.grad` cannot be a DTensor's
                bucket.make_inplace()
                if self.inplace_reduction == "all_to_all" and bucket.world > 1:
                    bucket.plan_all_to_all()
                for s in bucket.slices:
                    if s.param.requires_grad:
                        s.param.grad = bucket.full_view(s)
        self.params.extend(params)
        self.buckets.extend(new)
        self.slice_of.update({id(s.param): (b, s) for b in new for s in b.slices})
        if self.overlap:
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params if p.requires_grad]
        elif any(b.flat is not None for b in new):  # pipelined: which parameters a held schedule gave a gradient
            self._hooks += [p.register_post_accumulate_grad_hook(self._got.add_param) for b in new if b.flat is not None
                            for p in b.params if p.requires_grad]
        return new

    def remove_hooks(self) -> None:
        """At fit's end: a later fit of the same module builds its own buckets, and these hooks would go on reducing
        into this optimizer's buffers as well (each bucket once more per fit)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, s = self.slice_of[id(param)]
        if bucket.flat is not None:
            bucket.adopt(s)  # autograd started from None (e.g. `.grad` set to None by the user)
            bucket.touched = True
        if not self.enabled:
            return  # accumulating micro-step: gradients stay local, nothing is communicated
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def attach_views(self) -> None:
        """Before a backward: every in-place bucket's parameters show their buffer view as ``.grad`` (autograd adds
        to it in place); a ``.grad`` someone else set (a plain tensor) is copied in first."""
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.flat is None:
                    continue
                bucket.rescale_pending()
                for s in bucket.slices:
                    if s.param.requires_grad:
                        bucket.adopt(s)

    def params_ready(self, params: list[torch.Tensor]) -> None:
        """`params`' gradients are final (a pipeline stage's last backward): launch the buckets this completes."""
        if not self.enabled:
            return
        for p in params:
            entry = self.slice_of.get(id(p))
            if entry is not None:
                entry[0].ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        # buckets launch in one fixed order on every rank (collectives must match), each once all earlier ones have
        for bucket in self.buckets:
            if bucket.launched:
                continue
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.flat is not None:  # the gradients are already in the buffer: all-to-all (or all-reduce) in place
            for s in bucket.slices:  # (made by autograd from None where no hook re-attached the view: pipelines)
                bucket.adopt(s, keep_none=True)
            bucket.out = bucket.flat
            peers = bucket.launch_all_to_all() if bucket.peer_plan is not None else None
            bucket.send = None if peers is None else peers[0]  # alive until the work is done
            bucket.work = reduce_bucket(bucket.flat, bucket.group, peers=peers,
                                        hierarchy=self.hierarchy if peers is None else None)
            bucket.launched = True
            return
        bucket.had_grad = [p.grad is not None for p in bucket.params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        grads = [g if g.dim() else g.reshape(1) for g in grads]  # a scalar is one row
        parts = dist.get_world_size(bucket.group) if self.shard and not bucket.replicated else 1
        send = torch.empty(parts, bucket.total, dtype=torch.float32, device=bucket.grad.device)
        # rank-major, each gradient's dim 0 chunked and zero-padded: rank r's part is its rows of every gradient
        torch._chunk_cat(grads, dim=0, num_chunks=parts, out=send)
        bucket.send = send.view(-1)
        if self.shard:
            for p in bucket.params:
                p.grad = None  # the reduced slice replaces the full local gradient (no stale full copy to misread)
        if self.shard and not bucket.replicated:
            # a second backward before zero_grad (manual optimization) adds to the reduced slice, as `.grad` would
            bucket.out = torch.empty_like(bucket.grad) if bucket.pending else bucket.grad
            bucket.work = reduce_bucket(bucket.send, bucket.group, out=bucket.out, **self._compression(bucket))
        else:
            bucket.out = bucket.send
            bucket.work = reduce_bucket(bucket.send, bucket.group, hierarchy=self.hierarchy,
                                        **self._compression(bucket))
        bucket.launched = True

    # ---- pipeline parallelism: a schedule's gradients into the in-place buffers -------------------------
    @torch.no_grad()
    def hold(self, params: list[torch.Tensor]) -> set[int]:
        """A pipeline schedule whose backward ``zero_grad`` will follow (Lightning's order: training_step, which runs
        the schedule, then zero_grad, then backward) writes its gradients straight into the in-place buffers of
        `params`: they are zeroed now (what zero_grad would have done), ``.grad`` is their view, and the buckets are
        held: ``zero_grad`` leaves them alone until `take` hands them back. Returns the ids of those parameters."""
        ids = {id(p) for p in params}
        held: set[int] = set()
        for bucket in self.buckets:
            if bucket.flat is None or bucket.launched or not all(id(p) in ids for p in bucket.params):
                continue
            bucket.flat.zero_()
            bucket.pending, bucket.held, bucket.touched = False, True, True
            self._got.ids.difference_update(id(p) for p in bucket.params)
            for s in bucket.slices:
                if s.param.requires_grad:
                    s.param.grad = bucket.full_view(s)
                    held.add(id(s.param))
        return held

    @torch.no_grad()
    def take(self, params: list[torch.Tensor], grads: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """A schedule's gradients (`grads`, of `params`) into the in-place buffers: a held bucket has them already;
        otherwise each is added to the buffer view (the window's running sum, or copied where ``.grad`` was None:
        zero_grad dropped it). Returns `grads` with None for those handled here."""
        out = list(grads)
        for i, (p, g) in enumerate(zip(params, grads)):
            entry = self.slice_of.get(id(p))
            if entry is None or entry[0].flat is None or not p.requires_grad:
                continue
            bucket, s = entry
            view = bucket.full_view(s)
            bucket.rescale_pending()
            current = p.grad
            if bucket.held:
                if g is not None and g is not view:  # autograd did not add into the view (a hook replaced it)
                    view.add_(g)
                elif id(p) not in self._got.ids:  # unused in this step's forward: no gradient, as autograd leaves it
                    p.grad = None
                    out[i] = None
                    continue
            elif g is None:
                if current is None:
                    view.zero_()  # no gradient this step: the reduction sums zeros, ``.grad`` stays None
                    out[i] = None
                    continue
            elif current is view:
                view.add_(g)
            elif current is None or isinstance(current, DTensor) or current.shape != view.shape:
                view.copy_(g)
            else:  # a plain ``.grad`` someone set: the schedule's gradient is added to it, as autograd would
                torch.add(current, g, out=view)
            p.grad = view
            bucket.touched = True
            out[i] = None
        for bucket in self.buckets:
            bucket.held = False
        return out

    def _compression(self, bucket: _Bucket) -> dict[str, Any]:
        if self.compressor is None or bucket.spec is None:
            return {}  # uncompressed (with globs: parameters that no glob compresses)
        return {"compressor": self.compressor, "key": self._key(bucket), "spec": bucket.spec, "params": bucket.params,
                "parts": dist.get_world_size(bucket.group) if self.shard and not bucket.replicated else 1}

    def _key(self, bucket: _Bucket) -> str:
        return f"{self.key_prefix}.{self.buckets.index(bucket)}"

    def has_gradients(self) -> bool:
        if any(b.launched or b.ready or b.touched for b in self.buckets):
            return True
        inplace = {id(s.param) for b in self.buckets if b.flat is not None for s in b.slices}
        return any(p.grad is not None for p in self.params if id(p) not in inplace)

    def finish(self) -> None:
        """Launch what the hooks did not, wait for every bucket, average over dp."""
        for bucket in self.buckets:
            bucket.ready = len(bucket.params)
        self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.recv is not None:  # all-to-all: only this rank's rows are reduced (and averaged)
                bucket.add_received()
            else:
                bucket.out.div_(bucket.divide_by)
            if bucket.flat is not None:
                # the reduced rows are views of the buffer; a later backward adds to it (manual optimization), after
                # `rescale_pending` where the other ranks' rows were not reduced
                bucket.pending = bucket.peer_plan is not None
            elif self.shard:
                if bucket.out is not bucket.grad:
                    # a replicated bucket (all-reduced in place), or one launched inside a pipeline schedule before
                    # Lightning's zero_grad cleared `pending`: add or overwrite
                    bucket.grad.add_(bucket.out) if bucket.pending else bucket.grad.copy_(bucket.out)
                bucket.pending = True
            else:
                for s, had in zip(bucket.slices, bucket.had_grad):
                    if had:  # a parameter without a gradient on this step stays without one (as before the sync)
                        s.param.grad.copy_(bucket.local_view(bucket.out, s))
            bucket.work, bucket.send, bucket.out = None, None, None
            bucket.ready, bucket.launched, bucket.touched = 0, False, False

    def clear(self, set_to_none: bool = True) -> None:
        """zero_grad: the next sync overwrites the reduced slices instead of adding to them; in-place buffers are
        zeroed (their views come back as ``.grad`` before the next backward, `attach_views`)."""
        for bucket in self.buckets:
            if bucket.held:  # a pipeline schedule's gradients, already in the buffer (`hold`): zeroed before it
                continue
            bucket.pending = False
            if bucket.flat is not None:
                bucket.flat.zero_()
                bucket.touched = False
                for s in bucket.slices:
                    if set_to_none:
                        s.param.grad = None
                    elif s.param.requires_grad:
                        s.param.grad = bucket.full_view(s)


def _make_buckets(params: list[nn.Parameter], bucket_size_mb: float, parts: int, rank: int,
                  device: torch.device, spec_of: Any = lambda p: None) -> list[_Bucket]:
    # reverse registration order approximates the order backward produces gradients (as DDP assumes);
    # the first bucket is small (1 MiB, as DDP's): its reduction starts early in backward
    limit = max(1, int(min(1.0, bucket_size_mb) * 2**20))
    buckets: list[_Bucket] = []
    pending: dict[tuple, list[nn.Parameter]] = {}
    sizes: dict[tuple, int] = {}

    def bucket(kind: tuple, group: list[nn.Parameter]) -> _Bucket:
        replicated = kind[2] and parts > 1  # scalars are not sliced: all-reduced, whole on every rank
        return _Bucket(group, 1 if replicated else parts, 0 if replicated else rank, device, kind[1], replicated)

    for p in reversed(params):
        kind = (p.dtype, spec_of(p), p.dim() == 0)
        group = pending.setdefault(kind, [])
        group.append(p)
        sizes[kind] = sizes.get(kind, 0) + p.numel() * 4
        if sizes[kind] >= limit:
            buckets.append(bucket(kind, group))
            pending[kind], sizes[kind] = [], 0
            limit = max(1, int(bucket_size_mb * 2**20))
    buckets.extend(bucket(kind, group) for kind, group in pending.items() if group)
    return buckets


# ---- one object per layout ------------------------------------------------------------------------
class GradientSync:
    """No data parallelism (dp = 1, or evaluation): nothing to communicate."""

    enabled = True
    compressor: Any = None  # the `compression.Compressor` every bucket reduction of this layout goes through

    @property
    def dp_compressor(self) -> Any:
        """The compressor of the top-level dp reduction (`gradient_compression`), which ZeRO-1's buckets take; a
        wrapper adding other reductions (a branch's own compression) returns its inner layout's."""
        return self.compressor

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulating micro-steps: no gradient communication until the stepping one."""
        self.enabled = False
        self._communicate(False)
        try:
            yield
        finally:
            self._communicate(True)
            self.enabled = True

    def _communicate(self, enabled: bool) -> None:
        """Switch this layout's own gradient communication off (accumulating) or back on."""

    def finish(self) -> None:
        """After a stepping backward: every gradient is reduced over dp once this returns."""

    def bind(self, optimizers: list[Any], pipeline: Any = None) -> None:
        """The optimizers exist (Lightning's `setup_optimizers`): a layout whose buckets live in them binds here."""

    def release(self) -> None:
        """Fit's end: remove the hooks this layout put on the parameters (a later fit makes its own)."""


class DDPGradientSync(GradientSync):
    """zero 0: DDP's reducer buckets and overlaps; its comm hook hands each bucket to `reduce_bucket` in fp32."""

    def __init__(self, ddp: Any, fp32: bool = True, compressor: Any = None, hierarchy: Any = None) -> None:
        self.ddp = ddp
        self.compressor = compressor
        ddp.register_comm_hook(_HookState(ddp.process_group, fp32 or compressor is not None, compressor, hierarchy),
                               _ddp_comm_hook)
        # DDP reduces only what required grad when it wrapped the model (or what it was told to ignore); a parameter
        # unfrozen later (Lightning's BaseFinetuning) would keep each rank's own gradient, so `finish` reduces it
        ignored = set(ddp.parameters_to_ignore)
        self._known = {id(p) for n, p in ddp.module.named_parameters() if p.requires_grad or n in ignored}

    def _communicate(self, enabled: bool) -> None:
        self.ddp.require_backward_grad_sync = enabled  # what DDP's own no_sync() toggles

    @torch.no_grad()
    def finish(self) -> None:
        """Average the gradients of the parameters unfrozen after DDP wrapped the model (DDP reduced the rest inside
        backward): one fp32 all-reduce (uncompressed), a missing gradient counted as zeros on that rank."""
        late = [p for p in self.ddp.module.parameters() if p.requires_grad and id(p) not in self._known]
        if not late:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in late])
        dist.all_reduce(flat, group=self.ddp.process_group)
        flat.div_(dist.get_world_size(self.ddp.process_group))
        offset = 0
        for p in late:
            grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)


class _HookState:
    def __init__(self, group: Any, fp32: bool, compressor: Any = None, hierarchy: Any = None) -> None:
        self.group = group
        self.fp32 = fp32
        self.compressor = compressor
        self.hierarchy = hierarchy


def _ddp_comm_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks real annotations)
    buf = bucket.buffer()
    flat = buf.to(torch.float32) if state.fp32 else buf  # the same tensor when the bucket is fp32 already
    compressor, key = state.compressor, f"ddp.{bucket.index()}"
    if compressor is not None and compressor.per_module:
        fut = _reduce_segments(flat, bucket.parameters(), state.group, compressor, key, state.hierarchy)
    else:
        fut = reduce_bucket(flat, state.group, compressor=compressor, key=key, params=bucket.parameters(),
                            hierarchy=state.hierarchy).get_future()
    world = dist.get_world_size(state.group)

    def done(f: torch.futures.Future) -> torch.Tensor:
        if flat is not buf:
            buf.copy_(flat)
        return buf.div_(world)

    return fut.then(done)


def _reduce_segments(flat: torch.Tensor, params: list[torch.Tensor], group: Any, compressor: Any,
                     key: str, hierarchy: Any = None) -> torch.futures.Future:
    """Per-module globs in a DDP bucket (whose parameters' gradients lie back to back in `flat`): the gradients of
    each glob's parameters are one segment, compressed with its spec under the key ``<key>.g<i>`` (i: the glob's
    position in the dict); the parameters no glob compresses are one plain all-reduce. A segment whose parameters
    are not contiguous in the bucket is reduced from a packed copy."""
    pending: list[tuple[Any, torch.Tensor, list[tuple[int, int]]]] = []
    for name, spec, ranges in compressor.segments(params):
        part = flat[ranges[0][0]:ranges[0][1]] if len(ranges) == 1 else torch.cat([flat[a:b] for a, b in ranges])
        if spec is None:
            work = reduce_bucket(part, group, hierarchy=hierarchy)
        else:
            work = reduce_bucket(part, group, compressor=compressor, key=f"{key}.{name}", spec=spec,
                                 params=[p for p in params if compressor.group_of(p) == name])
        pending.append((work, part, ranges))

    def unpack(_: Any) -> torch.Tensor:  # every segment's future is done (no Work.wait() in a callback: it hangs)
        for _work, part, ranges in pending:
            if len(ranges) > 1:
                offset = 0
                for a, b in ranges:
                    flat[a:b].copy_(part[offset: offset + b - a])
                    offset += b - a
        return flat

    futures = [w.get_future() for w, _, _ in pending]
    return torch.futures.collect_all(futures).then(unpack)


_ddp_comm_hook.__annotations__ = {}  # `from __future__ import annotations` strings fail DDP's hook check


class BucketedGradientSync(GradientSync):
    """zero 0 under pp: the stage's gradients, all-reduced in `GradientBuckets` after each schedule."""

    def __init__(self, buckets: GradientBuckets) -> None:
        self.buckets = buckets
        self.compressor = buckets.compressor

    def _communicate(self, enabled: bool) -> None:
        self.buckets.enabled = enabled

    def finish(self) -> None:
        if self.buckets.has_gradients():
            self.buckets.finish()

    def release(self) -> None:
        self.buckets.remove_hooks()


class DistributedOptimizerSync(GradientSync):
    """zero 1: each `DistributedOptimizer`'s buckets reduce-scatter its parameters' gradients (bound to the
    optimizers once they exist)."""

    def __init__(self, compressor: Any = None) -> None:
        self.optimizers: list[Any] = []
        self.compressor = compressor

    def bind(self, optimizers: list[Any], pipeline: Any = None) -> None:
        self.optimizers = list(optimizers)
        if pipeline is not None:  # each stage's slices reduce-scatter after its last micro-batch's backward
            pipeline.grad_listeners = [opt.grad_buckets.params_ready for opt in self.optimizers]
            pipeline.grad_buffers = [opt.grad_buckets for opt in self.optimizers]

    def _communicate(self, enabled: bool) -> None:
        for opt in self.optimizers:
            opt.grad_buckets.enabled = enabled

    def finish(self) -> None:
        for opt in self.optimizers:
            opt.finish_gradient_sync()


class FullyShardedGradientSync(GradientSync):
    """zero 2/3: FSDP2 reduce-scatters each unit's gradients in fp32 during backward. Under pp (`module` None)
    each stage's schedule reduce-scatters once per step, or not while accumulating: the runner reads `enabled`.

    `replicated`: the buckets of the parameters FSDP2 leaves out (0-dim ones, `wrap.scalar_parameters`), whose
    gradients are all-reduced here after the stepping backward, as DDP reduces them.
    """

    def __init__(self, module: Optional[nn.Module], replicated: Optional[GradientBuckets] = None) -> None:
        self.module = module
        self.replicated = replicated

    def _communicate(self, enabled: bool) -> None:
        if self.module is not None:
            set_gradient_sync(self.module, enabled)

    def finish(self) -> None:
        if self.replicated is not None and self.replicated.has_gradients():
            self.replicated.finish()


# ---- zero 2/3: FSDP2's reduce-scatter, through the same bucket reduction -------------------------------
def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def set_gradient_sync(module: torch.nn.Module, enabled: bool) -> None:
    """FSDP2: skip (False) or perform (True) the gradient reduce-scatter of the next backward(s).

    Accumulating micro-steps then keep unsharded local gradients and communicate nothing.
    """
    for m in fsdp_modules(module):
        m.set_requires_gradient_sync(enabled, recurse=False)


def fsdp_reduce_scatter(divide_by: Optional[int] = None, compressor: Any = None, spec: Any = None,
                        key: str = "") -> Any:
    """A `ReduceScatter` for FSDP2's ``FSDPModule.set_custom_reduce_scatter``: each unit's flat gradient bucket goes
    through `reduce_bucket`, so what wraps it (compression, hierarchy) wraps ZeRO 2/3 too.

    FSDP2 lays the bucket out as `reduce_bucket` expects (rank-major, ``torch._chunk_cat`` of the padded
    gradients), in the fp32 reduce dtype, and asks for ``AVG`` (SUM where dp = 1): the SUM is divided by the dp
    size here, as every other caller of `reduce_bucket` does. `divide_by`: a unit whose mean is over more ranks
    than its group (experts: dp, over their edp group; FSDP2 then asks for a pre-multiplied sum). `compressor`,
    `spec`, `key`: the unit's bucket is compressed (a branch's own gradient_compression under its ZeRO 2/3).
    """
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class _BucketReduceScatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            if divide_by is None and op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
                raise NotImplementedError(f"FSDP2 asked for a {op} reduce-scatter; reduce_bucket sums (then averages).")
            reduce_bucket(input_tensor, group, out=output_tensor, compressor=compressor, key=key, spec=spec).wait()
            if divide_by is not None:
                output_tensor.div_(divide_by)
            elif op == dist.ReduceOp.AVG:
                output_tensor.div_(dist.get_world_size(group))
            return None

    return _BucketReduceScatter()
