"""What `branch_layouts` means, validated before any process group exists.

A branch is a submodule (``model.text_model``) that factorizes each top-level tp group into its own
(branch dp x branch tp): its ranks read the same batch, so a branch at a smaller tp splits that batch over its
branch-dp ranks instead of sharding weights as finely. A branch's ``zero_stage`` 2/3 shards it with FSDP2 over all
its dp ranks (the top-level dp x its branch dp), under any top-level zero_stage (ZeRO-1's optimizer leaves FSDP2's
shards to it); its ``zero_stage`` 1 shards its optimizer state over those ranks (ZeRO-1's optimizer, under a top-level
zero_stage 0 or 1). A branch's 1-bit Adam
(``frozen_variance``) needs whole momenta: ZeRO 0 there and at the top level. What is not built yet is refused here,
naming the argument.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_npu.parallel.data_parallel.compression_spec import parse_compression
from lightning_npu.parallel.errors import CompressionConfigError, ParallelConfigError

KEYS = ("tensor_parallel_size", "gradient_compression", "zero_stage")
EXAMPLE = "branch_layouts={'model.text_model': {'tensor_parallel_size': 2}}"


@dataclass(frozen=True)
class BranchLayout:
    glob: str
    tensor_parallel_size: int = 1
    gradient_compression: Any = None  # the raw value (a mode, an options dict); parsed into `compression`
    zero_stage: int = 0
    compression: Any = None  # its `CompressionSpec`, or None

    def data_parallel_size(self, top_tp: int) -> int:
        """Branch-dp ranks: the top-level tp group split into groups of the branch's tp size."""
        return top_tp // self.tensor_parallel_size


def parse_branch_layouts(value: Any, top_zero_stage: Optional[int] = None) -> list[BranchLayout]:
    """``None`` or ``{module glob: {"tensor_parallel_size": N, "gradient_compression": ..., "zero_stage": 0-3}}``.
    A branch without its own 'zero_stage' under a top-level ZeRO 2/3 (`top_zero_stage`) takes the top level's: FSDP2
    shards it over its own ranks (a ZeRO-0 branch does not compose with a top-level ZeRO 2/3)."""
    if value is None:
        return []
    if not isinstance(value, dict) or not value:
        raise ParallelConfigError(f"`branch_layouts={value!r}` must be None or a non-empty dict of module glob -> "
                                  f"options, e.g. {EXAMPLE}.")
    out = []
    for glob, options in value.items():
        where = f"`branch_layouts[{glob!r}]`"
        if not isinstance(glob, str) or not glob:
            raise ParallelConfigError(f"`branch_layouts` key {glob!r} must be a module-name glob, e.g. 'model.text_model'.")
        if not isinstance(options, dict):
            raise ParallelConfigError(f"{where}={options!r} must be a dict of {list(KEYS)}, e.g. {EXAMPLE}.")
        unknown = sorted(set(options) - set(KEYS))
        if unknown:
            raise ParallelConfigError(f"{where} has unknown options {unknown}; use {list(KEYS)}.")
        tp = options.get("tensor_parallel_size", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ParallelConfigError(f"{where}['tensor_parallel_size']={tp!r} must be a positive int, e.g. 2.")
        zero = options.get("zero_stage", top_zero_stage if top_zero_stage in (2, 3) else 0)
        if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
            raise ParallelConfigError(f"{where}['zero_stage']={zero!r} must be 0, 1, 2 or 3.")
        if zero == 1 and options.get("gradient_compression") is not None:
            raise ParallelConfigError(
                f"{where}: 'zero_stage': 1 with a 'gradient_compression' is not built yet (ZeRO-1's reduce-scatter "
                "over the branch's dp ranks is uncompressed); use 'zero_stage': 3 (or 2, FSDP2's reduce-scatter is "
                "compressed) or 0, or drop the branch's gradient_compression.")
        raw = options.get("gradient_compression")
        try:
            spec = parse_compression(raw)
        except (CompressionConfigError, TypeError) as err:
            raise ParallelConfigError(f"{where}['gradient_compression']: {err}") from None
        if isinstance(spec, dict):
            raise ParallelConfigError(f"{where}['gradient_compression']={raw!r}: one mode or options dict for the "
                                      "whole branch (module globs are the top-level gradient_compression's).")
        if spec is not None and spec.frozen_variance and zero != 0:  # FSDP2 / ZeRO-1 shard the momentum it sends
            raise ParallelConfigError(
                f"{where}['gradient_compression']: frozen_variance=True (1-bit Adam) with the branch's zero_stage="
                f"{zero} is not built: it compresses each rank's whole Adam momentum, which a sharded optimizer "
                "splits; set the branch's 'zero_stage': 0 (or frozen_variance=False).")
        out.append(BranchLayout(glob, tp, raw, zero, spec))
    return out


def check_with_layout(branches: list[BranchLayout], cfg: Any) -> None:
    """The top-level arguments branches do not compose with yet (no world size needed)."""
    if not branches:
        return
    refused = [(cfg.pipeline_parallel_size > 1, f"pipeline_parallel_size={cfg.pipeline_parallel_size}"),
               (cfg.expert_parallel_size > 1, f"expert_parallel_size={cfg.expert_parallel_size}"),
               (cfg.sequence_parallel, "sequence_parallel=True"),
               (getattr(cfg, "context_parallel_size", 1) > 1,
                f"context_parallel_size={getattr(cfg, 'context_parallel_size', 1)}")]
    for bad, arg in refused:
        if bad:
            raise ParallelConfigError(
                f"`branch_layouts` with `{arg}` is not built yet: branches compose with tensor and data parallelism "
                "(zero_stage 0-3); drop branch_layouts or that argument.")
    for b in branches:
        where = f"`branch_layouts[{b.glob!r}]['zero_stage']={b.zero_stage}`"
        if cfg.zero_stage in (2, 3) and b.zero_stage not in (2, 3):
            # FSDP2 at the top level would shard the branch's plain local tp shards, summed over bdp only afterwards
            raise ParallelConfigError(
                f"{where} with the top-level `zero_stage={cfg.zero_stage}` is not built yet: under a top-level "
                "ZeRO 2/3 a branch shards itself; set the branch's 'zero_stage' to 2 or 3.")
        top = parse_compression(cfg.gradient_compression)
        if b.zero_stage == 1 and any(s is not None and s.frozen_variance
                                     for s in (top.values() if isinstance(top, dict) else [top])):
            raise ParallelConfigError(
                f"{where} with a `gradient_compression` of frozen_variance=True is not built yet: 1-bit Adam steps "
                "each rank's whole momentum, which a branch's ZeRO-1 shards; use frozen_variance=False, or the "
                "branch's 'zero_stage' 0.")
    for b in branches:
        if b.compression is not None and b.compression.frozen_variance and cfg.zero_stage != 0:
            raise ParallelConfigError(  # the branch's momentum would be the top-level ZeRO-1's dp slices
                f"`branch_layouts[{b.glob!r}]['gradient_compression']` frozen_variance=True (1-bit Adam) with the "
                f"top-level `zero_stage={cfg.zero_stage}`: it compresses each rank's whole Adam momentum, which "
                "ZeRO shards; use zero_stage=0, or frozen_variance=False.")
        if cfg.tensor_parallel_size % b.tensor_parallel_size:
            raise ParallelConfigError(
                f"`branch_layouts[{b.glob!r}]['tensor_parallel_size']={b.tensor_parallel_size}` does not divide "
                f"`tensor_parallel_size={cfg.tensor_parallel_size}`: a branch splits each top-level tp group into "
                "(branch dp x branch tp); choose a divisor of the top-level tp size.")


def match_branches(model: nn.Module, branches: list[BranchLayout]) -> list[tuple[str, BranchLayout]]:
    """``(module name, layout)`` of every module a branch glob matches; a glob matching nothing, or branches that
    overlap (one inside another), is an error."""
    names = [n for n, _ in model.named_modules() if n]
    found: list[tuple[str, BranchLayout]] = []
    for b in branches:
        matched = [n for n in names if fnmatch.fnmatchcase(n, b.glob)]
        if not matched:
            near = [n for n in names if n.count(".") <= 1][:8]
            raise ParallelConfigError(f"`branch_layouts[{b.glob!r}]` matches no module of {type(model).__name__} "
                                      f"(module names such as {near}); fix the glob.")
        found += [(n, b) for n in matched]
    for i, (a, la) in enumerate(found):
        for b, lb in found[i + 1:]:
            if a == b or b.startswith(a + ".") or a.startswith(b + "."):
                raise ParallelConfigError(
                    f"`branch_layouts`: {la.glob!r} ({a}) and {lb.glob!r} ({b}) overlap; a module belongs to at most "
                    "one branch: make the globs disjoint.")
    return found


def without_branches(tp_plan: Any, model: nn.Module, names: list[str]) -> Any:
    """The top-level `tp_plan` with every branch module kept whole (the branch shards them at its own size): later
    entries win, so 'replicate' on the branches overrides the automatic plan and the user's globs there."""
    if tp_plan is None or not names:
        return tp_plan
    entries = {"*": "auto"} if tp_plan == "auto" else dict(tp_plan)
    for n in names:
        entries[n] = "replicate"
        if any(True for _ in model.get_submodule(n).children()):
            entries[n + ".*"] = "replicate"
    return entries


def in_branch(fqn: str, names: list[str]) -> Optional[str]:
    return next((n for n in names if fqn == n or fqn.startswith(n + ".")), None)
