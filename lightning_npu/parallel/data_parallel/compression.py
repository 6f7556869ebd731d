"""Gradient compression: each mode is a transformation of one bucket's dp reduction.

`Compressor.sum(flat, group, key)` replaces `sync.reduce_bucket`'s SUM of one fp32 bucket: it compresses this
rank's bucket, exchanges the compressed payloads with torch.distributed collectives, and writes the decompressed
sum back into `flat` (the caller divides by the dp size, as for the uncompressed path). Lossy modes keep an error
feedback residual per bucket (`key`): what compression dropped this step is added to the next step's gradient, so
nothing is lost, only delayed.

| mode | payload per rank (vs fp32) | exchange |
| --- | --- | --- |
| ``"bf16"`` | 1/2 | all-reduce in bf16 (fp32 where the backend has no bf16 reduction) |
| ``"int8"`` | 1/4 + a fp32 scale per 256 values | all-gather, error feedback |
| ``"topk"`` | 2 x ratio (fp32 values + int32 indices) | all-gather, error feedback |
| ``"onebit"`` | 1/32 + a fp32 scale per 256 values | all-gather of packed signs, error feedback, fp32 warm-up |
| ``"powersgd"`` | rank x (rows + cols) / numel | two all-reduces (PyTorch's PowerSGD with warm start), error feedback |

With ``frozen_variance=True`` (1-bit Adam, Tang et al. 2021; torch.optim.Adam/AdamW, zero_stage 0) a lossy mode
compresses, after its dense warm-up, each rank's Adam momentum instead of its gradient, and Adam's variance stays
frozen at its warm-up value: the update is then linear in what is communicated, which error feedback needs
(`onebit_adam`).

Compressed modes are synchronous: the bucket's exchange runs when it is launched, so they do not overlap the rest of
backward as the plain all-reduce does.

Per-module globs (``{glob: mode or options or None}``): `Compressor.resolve` gives each parameter the spec of the
first glob that matches its module name or its full name in the LightningModule (no glob: uncompressed); callers
pass each bucket's (or each glob segment's) spec to `Compressor.sum`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_npu.parallel.collectives import all_gather_into
from lightning_npu.parallel.data_parallel.compression_spec import CompressionSpec, _glob_of
from lightning_npu.parallel.data_parallel.onebit_adam import FrozenVarianceAdam

CHUNK = 256  # values per int8/onebit scale
_BURSTY_UNDER_ADAM = ("topk", "onebit", "powersgd")  # gradient error feedback sends these in bursts


def matrices_of(flat: torch.Tensor, parts: int, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """PowerSGD's view of a bucket: `flat` is `parts` equal rank-major parts (ZeRO-1's send buffer; one part
    otherwise), each holding every parameter's dim-0 chunk, zero-padded to ceil(rows / parts) rows, back to back.
    Each gradient becomes a (parts, rows per part, cols) view of `flat`, with its real row count."""
    grid, out, offset = flat.view(parts, -1), [], 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        cols = p.numel() // rows if rows else 0
        per_part = math.ceil(rows / parts)
        out.append((grid[:, offset: offset + per_part * cols].view(parts, per_part, cols), rows))
        offset += per_part * cols
    return out


def _all_gather(flat: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = flat.new_empty(world * flat.numel())
    all_gather_into(out, flat.flatten(), group=group)
    return out.view(world, *flat.shape)


@dataclass
class Compressor:
    """Per-bucket compressed reductions and their state (residuals, PowerSGD's Q); `steps` counts calls per bucket.

    `spec` is one `CompressionSpec` for every gradient, or a dict {glob: spec or None} (`parse_compression`): then
    `resolve` gives each parameter its spec from its name, and callers reduce each bucket (or each run of parameters
    of one spec inside a bucket, `segments`) with `sum(..., spec=spec_of(param))` or uncompressed when it is None.
    """

    spec: Union[CompressionSpec, dict[str, Optional[CompressionSpec]]]
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    q_factors: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    world: Optional[int] = None  # the dp size the state was built for
    # bucket key -> the (parameter name, numel) its residual holds back to back (buckets of whole parameters: DDP's,
    # the pipeline's); a bucket whose parameters change (DDP rebuilds its buckets after the first step, and a resumed
    # run starts from the initial ones) gets each parameter's own residual back, never another parameter's
    layouts: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    _unclaimed: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> its residual, between buckets
    _names: dict[int, str] = field(default_factory=dict)
    _specs: dict[int, Optional[CompressionSpec]] = field(default_factory=dict)
    _globs: dict[int, str] = field(default_factory=dict)  # id(parameter) -> "g<i>": the i-th glob compresses it
    adam: FrozenVarianceAdam = field(default_factory=FrozenVarianceAdam)  # frozen_variance's optimizer side
    # the specs callers pass to `sum` besides `spec` (the branches' `gradient_compression` on a shared compressor):
    # `bind_optimizers` reads them too, so a branch's 1-bit Adam binds its optimizers
    also: list[CompressionSpec] = field(default_factory=list)
    sent_bytes: int = 0  # payload bytes this rank has put into its exchanges (what the wire carries from it)

    def _sent(self, *tensors: torch.Tensor) -> None:
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)

    @property
    def per_module(self) -> bool:
        return isinstance(self.spec, dict)

    def resolve(self, named_parameters: Any) -> set[str]:
        """Give each parameter its spec once, from ``(name, parameter)`` pairs named as in the user's model (the
        LightningModule's ``named_parameters()``: no wrapper prefixes). Returns the globs that matched a parameter."""
        matched: set[str] = set()
        for name, p in named_parameters:
            self._names[id(p)] = name
            if not self.per_module:
                continue
            module = name.rpartition(".")[0]
            glob = _glob_of(self.spec, module, name)
            self._specs[id(p)] = None if glob is None else self.spec[glob]
            if glob is not None:
                matched.add(glob)
                if self.spec[glob] is not None:  # (parameters left uncompressed share one group, "none")
                    self._globs[id(p)] = f"g{list(self.spec).index(glob)}"
        return matched

    def spec_of(self, param: torch.Tensor) -> Optional[CompressionSpec]:
        """The spec of `param` (None: reduced uncompressed); a parameter `resolve` did not see is uncompressed."""
        if not self.per_module:
            return self.spec
        return self._specs.get(id(param))

    def group_of(self, param: torch.Tensor) -> str:
        """A stable name for `param`'s glob (``g<position in the dict>``; ``"none"`` where it is not compressed)."""
        return self._globs.get(id(param), "none")

    def segments(self, params: list[torch.Tensor]) -> list[tuple[str, Optional[CompressionSpec], list[tuple[int, int]]]]:
        """A flat bucket holding `params`' gradients back to back, grouped by glob: ``(group, spec, [(start, end),
        ...])`` in order of first appearance, each group's ranges merged where contiguous."""
        out: dict[str, tuple[str, Optional[CompressionSpec], list[tuple[int, int]]]] = {}
        offset = 0
        for p in params:
            group, end = self.group_of(p), offset + p.numel()
            ranges = out.setdefault(group, (group, self.spec_of(p), []))[2]
            if ranges and ranges[-1][1] == offset:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((offset, end))
            offset = end
        return list(out.values())

    def sum(self, flat: torch.Tensor, group: Any, key: str, spec: Optional[CompressionSpec] = None,
            params: Optional[list[torch.Tensor]] = None, parts: int = 1) -> None:
        """`flat` (fp32, this rank's bucket) <- the decompressed SUM over `group`, compressed as `spec` says
        (default: the one spec of a compressor that has no globs). `params`: the parameters whose gradients `flat`
        holds in `parts` rank-major parts (`matrices_of`), which PowerSGD factorises one by one."""
        if spec is None:
            if self.per_module:
                raise ValueError("Compressor.sum needs the bucket's spec when gradient_compression has globs.")
            spec = self.spec
        self.world = dist.get_world_size(group)
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        if step < spec.warmup_steps:
            self._sent(flat)
            dist.all_reduce(flat, group=group)
            return
        mode = spec.mode
        if mode == "bf16":
            return self._bf16(flat, group)
        momentum = self.adam.momentum(flat, spec.warmup_steps, params, parts) if spec.frozen_variance else None
        if momentum is not None:  # 1-bit Adam: this rank's momentum u = b1 m + (1 - b1) g is what is compressed
            m, beta1 = momentum
            flat.mul_(1 - beta1).add_(beta1 * m)
        if spec.error_feedback:
            residual = self._residual(key, flat, params, parts)
            flat.add_(residual)
            corrected = flat.clone()
        if mode == "powersgd":
            sent = self._powersgd(flat, group, key, spec, params, parts)
        else:  # what this rank contributed, decompressed
            sent = getattr(self, f"_{mode}")(flat, group, key, spec)
        if spec.error_feedback:
            torch.sub(corrected, sent, out=self.residuals[key])
        if momentum is not None:
            # the SUM of the ranks' compressed momenta, as the gradient SUM whose Adam momentum update gives their
            # mean: b1 m + (1 - b1) g = mean  <=>  world * g = (SUM - world b1 m) / (1 - b1)
            flat.sub_(self.world * beta1 * m).div_(1 - beta1)

    def _residual(self, key: str, flat: torch.Tensor, params: Optional[list[torch.Tensor]], parts: int) -> torch.Tensor:
        """Bucket `key`'s error-feedback residual, laid out as `flat` is now."""
        names = [self._names.get(id(p)) for p in params or ()]
        layout = [(n, p.numel()) for n, p in zip(names, params or ())] if parts == 1 and names and all(names) else None
        residual = self.residuals.get(key)
        if residual is not None and residual.shape == flat.shape and self.layouts.get(key) == layout:
            return residual
        if layout is None:  # no parameter names (rank-major ZeRO-1 buckets are fixed): a new bucket starts at zero
            self.residuals[key] = torch.zeros_like(flat)
            return self.residuals[key]
        # another bucket than the residuals were kept for: split every whole-parameter residual by parameter ...
        for old_key, old_layout in list(self.layouts.items()):
            old = self.residuals.pop(old_key, None)
            del self.layouts[old_key]
            if old is not None and old_layout is not None and old.numel() == sum(n for _, n in old_layout):
                self._unclaimed.update(zip((name for name, _ in old_layout), old.split([n for _, n in old_layout])))
        # ... and give this bucket its parameters' own
        residual = torch.zeros_like(flat)
        for piece, (name, numel) in zip(residual.split([n for _, n in layout]), layout):
            own = self._unclaimed.pop(name, None)
            if own is not None and own.numel() == numel:
                piece.copy_(own)
        self.residuals[key], self.layouts[key] = residual, layout
        return residual

    # ---- 1-bit Adam (frozen_variance): `onebit_adam` owns the optimizer side -------------------------------
    def bind_optimizers(self, optimizers: list[Any]) -> None:
        """The strategy's `MixedPrecisionOptimizer` wrappers, once built: with ``frozen_variance`` they step Adam
        through `onebit_adam.FrozenVarianceAdam` (refused for optimizers it cannot step)."""
        specs = (list(self.spec.values()) if self.per_module else [self.spec]) + list(self.also)
        if any(s is not None and s.frozen_variance for s in specs):
            self.adam.bind(optimizers)
        bursty = sorted({s.mode for s in specs if s is not None and s.mode in _BURSTY_UNDER_ADAM
                         and s.error_feedback and not s.frozen_variance})
        adams = sorted({type(w.optimizer).__name__ for w in optimizers
                        if isinstance(getattr(w, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))})
        if bursty and adams:
            rank_zero_warn(
                f"`gradient_compression` {'/'.join(bursty)} with error feedback on the gradients converges poorly under "
                f"{'/'.join(adams)}: Adam divides by each coordinate's RMS, which feedback's bursts inflate (the example "
                "GPT, 300 steps at dp=2: topk +93%, onebit +250%, powersgd +547% over the uncompressed loss). Pass "
                "frozen_variance=True with a dense warm-up (e.g. {'mode': 'topk', 'warmup_steps': 100, "
                "'frozen_variance': True}: 1-bit Adam), or use bf16/int8; see docs/communication.md.")

    # ---- modes: each leaves the decompressed sum in `flat` and returns this rank's own decompressed payload ----
    def _bf16(self, flat: torch.Tensor, group: Any) -> None:
        half = flat.to(torch.bfloat16)
        self._sent(half)
        try:
            dist.all_reduce(half, group=group)
        except RuntimeError:  # a backend without bf16 reductions: fp32
            dist.all_reduce(flat, group=group)
            return
        flat.copy_(half)

    def _int8(self, flat: torch.Tensor, group: Any, key: str, spec: CompressionSpec) -> torch.Tensor:
        chunks = _chunked(flat)
        scale = chunks.abs().amax(dim=1).clamp_min(1e-30) / 127
        q = torch.round(chunks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        own = (q.float() * scale[:, None]).flatten()[: flat.numel()]
        self._sent(q, scale)
        qs, scales = _all_gather(q.flatten(), group), _all_gather(scale, group)
        total = (qs.view(qs.shape[0], *q.shape).float() * scales[:, :, None]).sum(0).flatten()
        flat.copy_(total[: flat.numel()])
        return own

    def _topk(self, flat: torch.Tensor, group: Any, key: str, spec: CompressionSpec) -> torch.Tensor:
        k = max(1, math.ceil(spec.ratio * flat.numel()))
        idx = flat.abs().topk(k, sorted=False).indices
        values = flat[idx]
        own = torch.zeros_like(flat).index_put_((idx,), values)
        self._sent(values, idx.to(torch.int32))
        all_values, all_idx = _all_gather(values, group), _all_gather(idx.to(torch.int32), group)
        flat.zero_().index_add_(0, all_idx.flatten().long(), all_values.flatten())
        return own

    def _onebit(self, flat: torch.Tensor, group: Any, key: str, spec: CompressionSpec) -> torch.Tensor:
        chunks = _chunked(flat)
        scale = chunks.abs().mean(dim=1)
        positive = chunks >= 0
        own = (torch.where(positive, 1.0, -1.0) * scale[:, None]).flatten()[: flat.numel()]
        packed = _pack_bits(positive.flatten())
        self._sent(packed, scale)
        all_packed, scales = _all_gather(packed, group), _all_gather(scale, group)
        signs = torch.stack([_unpack_bits(p, chunks.numel()) for p in all_packed]).view(-1, *chunks.shape)
        total = (torch.where(signs, 1.0, -1.0) * scales[:, :, None]).sum(0).flatten()
        flat.copy_(total[: flat.numel()])
        return own

    # Not torch's `powerSGD_hook`/`PowerSGDState`: they take DDP GradBuckets only (zero 1 and pipeline buckets, and the
    # glob segments of a DDP bucket, are not), and key their state by DDP bucket index. The algorithm is theirs: each
    # weight matrix factorised on its own (a bucket's rows mix unrelated parameters: no low rank to find there),
    # tensors too small to gain left uncompressed, one batched all-reduce for all P and one for all Q, warm start.
    def _powersgd(self, flat: torch.Tensor, group: Any, key: str, spec: CompressionSpec,
                  params: Optional[list[torch.Tensor]], parts: int) -> torch.Tensor:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        if params is None:
            raise ValueError("PowerSGD factorises each gradient: Compressor.sum needs the bucket's `params`.")
        # each matrix's warm-start Q is kept under its parameter's name, whatever bucket holds it (DDP rebuilds them)
        names = [self._names.get(id(p)) or f"{key}.{i}" for i, p in enumerate(params)]
        own = flat.clone()  # uncompressed values are sent exactly: their residual is zero
        compress = [(v, rows, name) for (v, rows), name in zip(matrices_of(flat, parts, params), names)
                    if _powersgd_pays(v.shape[0] * v.shape[1], v.shape[2], spec.rank)]
        covered = torch.zeros_like(flat, dtype=torch.bool)
        for v, _, _ in compress:
            _same_view(covered, flat, v).fill_(True)
        rest = ~covered
        if bool(rest.any()):
            plain = flat[rest]
            self._sent(plain)
            dist.all_reduce(plain, group=group)
            flat[rest] = plain
        if not compress:
            return own
        qs = []
        for i, (v, _, q_key) in enumerate(compress):
            cols, rank = v.shape[2], min(spec.rank, v.shape[0] * v.shape[1], v.shape[2])
            q = self.q_factors.get(q_key)
            if q is None or q.shape != (cols, rank):
                generator = torch.Generator().manual_seed(i)  # the same start on every rank
                q = self.q_factors[q_key] = torch.randn(cols, rank, generator=generator).to(flat.device)
            qs.append(q)
        ps = [torch.matmul(v, q) for (v, _, _), q in zip(compress, qs)]  # (parts, rows, r): M @ Q
        p_all = torch.cat([p.flatten() for p in ps])
        self._sent(p_all)
        dist.all_reduce(p_all, group=group)
        ps = [chunk.view_as(p) for chunk, p in zip(p_all.split([p.numel() for p in ps]), ps)]
        for p in ps:
            _orthogonalize(p.view(1, -1, p.shape[-1]), epsilon=1e-8)
        q_all = torch.cat([torch.einsum("bmn,bmr->nr", v, p).flatten() for (v, _, _), p in zip(compress, ps)])
        self._sent(q_all)
        dist.all_reduce(q_all, group=group)
        world = dist.get_world_size(group)
        for i, ((v, rows, q_key), p, q) in enumerate(zip(compress, ps, q_all.split([q.numel() for q in qs]))):
            q = q.view_as(qs[i])
            self.q_factors[q_key] = q.clone()  # warm start: next step begins from this Q
            total = torch.matmul(p, q.t())  # the low-rank SUM, (parts, rows per part, cols)
            total.view(-1, total.shape[-1])[rows:] = 0  # zero-padded rows (ZeRO-1's last chunk) stay zero
            v.copy_(total)
            _same_view(own, flat, v).copy_(total / world)  # error feedback keeps each rank's part minus the mean
        return own

    # ---- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        spec = ({g: None if v is None else v.__dict__ for g, v in self.spec.items()} if self.per_module
                else self.spec.__dict__)
        return {"spec": spec, "world": self.world, "steps": dict(self.steps), "residuals": dict(self.residuals),
                "layouts": dict(self.layouts), "unclaimed": dict(self._unclaimed), "q_factors": dict(self.q_factors)}

    def load_state_dict(self, state: dict[str, Any], world: int) -> bool:
        """Restore the state saved under the same dp size; under another one the residuals belong to other ranks'
        gradients, so they reset (returns False) and only the step counts (the warm-up) carry over."""
        self.steps = dict(state.get("steps", {}))
        if state.get("world") != world:
            self.residuals, self.layouts, self._unclaimed, self.q_factors = {}, {}, {}, {}
            return False
        self.residuals = dict(state.get("residuals", {}))
        self.layouts = {k: [tuple(e) for e in v] for k, v in state.get("layouts", {}).items()}
        self._unclaimed = dict(state.get("unclaimed", {}))
        self.q_factors = dict(state.get("q_factors", {}))
        return True


def _powersgd_pays(rows: int, cols: int, rank: int) -> bool:
    """torch's rule: compress a matrix where P and Q together are at most half its size."""
    return min(rows, cols) > rank and 2 * (rows + cols) * rank <= rows * cols


def _same_view(other: torch.Tensor, flat: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """`view` (a view of `flat`) as the same view of `other`, a tensor of `flat`'s shape."""
    return other.as_strided(view.shape, view.stride(), view.storage_offset() - flat.storage_offset())


def _chunked(flat: torch.Tensor) -> torch.Tensor:
    pad = (-flat.numel()) % CHUNK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, CHUNK)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    pad = (-bits.numel()) % 8
    b = torch.nn.functional.pad(bits.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (b * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] & weights) != 0).flatten()[:n]
