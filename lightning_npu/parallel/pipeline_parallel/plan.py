"""Where a model splits into pipeline stages: the declared or found block list, balanced by parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from lightning_npu.parallel.errors import ParallelConfigError

DEFAULT_LOG_NAMES = {"train": "train_loss", "validate": "val_loss", "test": "test_loss"}


class PipelineLayoutError(ParallelConfigError):
    """The model cannot be split as asked; the message names the module/argument and the fix."""


@dataclass
class PipelineLayout:
    """Optional declaration for models the automatic split does not fit (see the module docstring)."""

    blocks: Optional[str] = None
    embed: Optional[list[str]] = None
    head: Optional[list[str]] = None
    embed_fn: Optional[Callable[[Any], torch.Tensor]] = None
    batch_fn: Optional[Callable[[Any], tuple[Any, Any]]] = None
    balance: str = "count"
    split: Optional[list[int]] = None
    virtual_stages: int = 2
    log_names: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_LOG_NAMES))


def declared_layout(module: nn.Module) -> PipelineLayout:
    decl = getattr(module, "pipeline_layout", None)
    if callable(decl):
        decl = decl()
    if decl is None:
        return PipelineLayout()
    if isinstance(decl, PipelineLayout):
        return decl
    if isinstance(decl, dict):
        unknown = set(decl) - set(PipelineLayout.__dataclass_fields__)
        if unknown:
            raise PipelineLayoutError(
                f"{type(module).__name__}.pipeline_layout has unknown keys {sorted(unknown)}; use "
                f"{sorted(PipelineLayout.__dataclass_fields__)}."
            )
        decl = dict(decl)
        if "log_names" in decl:
            decl["log_names"] = {**DEFAULT_LOG_NAMES, **decl["log_names"]}
        return PipelineLayout(**decl)
    raise PipelineLayoutError(
        f"{type(module).__name__}.pipeline_layout must be a dict or lightning_npu.parallel.pipeline_parallel.plan.PipelineLayout "
        f"(or a method returning one), got {type(decl).__name__}."
    )


# ---- planning (no process group) ----------------------------------------------------------------
def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(module: nn.Module) -> str:
    best, best_numel = None, -1
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0:
            n = _numel(sub)
            if n > best_numel:
                best, best_numel = name, n
    if best is None or best_numel <= 0:
        raise PipelineLayoutError(
            f"found no nn.ModuleList of blocks with parameters in {type(module).__name__} (pipeline parallelism and "
            "activation checkpointing work block by block); "
            "declare `pipeline_layout = {'blocks': '<qualified name of the ModuleList>', ...}` on the LightningModule."
        )
    return best


def _units_around(module: nn.Module, blocks_fqn: str) -> tuple[list[str], list[str]]:
    """Outermost parameterised modules registered before / after the blocks (ancestors are descended)."""
    before: list[str] = []
    after: list[str] = []
    seen = False

    def visit(prefix: str, m: nn.Module) -> None:
        nonlocal seen
        own = [n for n, _ in m.named_parameters(recurse=False)]
        if own:
            raise PipelineLayoutError(
                f"`{prefix or type(m).__name__}` holds parameters directly ({', '.join(own)}) and contains the pipeline "
                f"blocks `{blocks_fqn}`; move them into a submodule or declare `pipeline_layout` embed/head explicitly."
            )
        for name, child in m.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if fqn == blocks_fqn:
                seen = True
            elif blocks_fqn.startswith(fqn + "."):
                visit(fqn, child)
            elif _numel(child) > 0:
                (after if seen else before).append(fqn)

    visit("", module)
    return before, after


def _called_after_blocks(module: nn.Module, blocks_fqn: str, fqn: str) -> bool:
    """A module registered before the blocks that the forward applies after them (OPT's ``final_layer_norm``):
    where the blocks' parent ships transformers' ``base_model_pp_plan`` (its modules in forward order) it decides,
    else a leaf named ``final*``."""
    parent_fqn, _, blocks_name = blocks_fqn.rpartition(".")
    parent = module.get_submodule(parent_fqn) if parent_fqn else module
    order = list(getattr(getattr(parent, "config", None), "base_model_pp_plan", None) or ())
    prefix = f"{parent_fqn}." if parent_fqn else ""
    if blocks_name in order and fqn.startswith(prefix):
        child = fqn[len(prefix):].split(".")[0]
        if child in order:
            return order.index(child) > order.index(blocks_name)
    return fqn.rpartition(".")[2].startswith("final")


def balance_blocks(weights: Sequence[int], num_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Contiguous split of blocks with `weights` into `num_stages` non-empty stages minimising the heaviest
    stage (stage 0 also carries `first_extra`, the last stage `last_extra`). Returns blocks per stage."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: minimal max-load splitting the first i blocks into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                load = prefix[i] - prefix[j] + (first_extra if s == 1 else 0) + (last_extra if s == num_stages else 0)
                cand = max(best[s - 1][j], load)
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    sizes, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


@dataclass
class PipelinePlan:
    """Which modules each pipeline stage holds; stage s runs on pp rank ``s % pp_size``."""

    pp_size: int
    num_stages: int
    blocks: str
    num_blocks: int
    embed: list[str]
    head: list[str]
    stage_blocks: list[list[int]]
    layout: PipelineLayout
    # (first stage's name, last stage's name) of each parameter both hold: tied input/output embeddings
    tied: list[tuple[str, str]] = field(default_factory=list)

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if s % self.pp_size == pp_rank]

    def modules_of_stage(self, stage: int) -> list[str]:
        names = [f"{self.blocks}.{i}" for i in self.stage_blocks[stage]]
        if stage == 0:
            names = self.embed + names
        if stage == self.num_stages - 1:
            names = names + self.head
        return names

    def report(self) -> str:
        lines = [f"pipeline: {self.num_stages} stages on {self.pp_size} ranks, blocks `{self.blocks}`"]
        for s in range(self.num_stages):
            b = self.stage_blocks[s]
            extra = (" + embed " + ",".join(self.embed) if s == 0 else "") + (
                " + head " + ",".join(self.head) if s == self.num_stages - 1 else "")
            lines.append(f"  stage {s} (pp rank {s % self.pp_size}): blocks {b[0]}..{b[-1]}{extra}")
        for first, last in self.tied:
            lines.append(f"  tied: {first} (stage 0) = {last} (stage {self.num_stages - 1}), gradients summed")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def tied_parameters(module: nn.Module, embed: list[str], head: list[str]) -> list[tuple[str, str]]:
    """Parameters that an embedding module (first stage) and a head module (last stage) share, by their names there.

    Each end keeps its own copy; the runner sums their gradients between the two stages after backward (Megatron's
    shared-embedding all-reduce), so the copies stay equal."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)

    def within(name: str, fqns: list[str]) -> bool:
        return any(name.startswith(f + ".") for f in fqns)

    tied = []
    for group in names.values():
        first = [n for n in group if within(n, embed)]
        last = [n for n in group if within(n, head)]
        if first and last:
            tied.append((first[0], last[0]))
    return tied


def plan_pipeline(module: nn.Module, pp_size: int, schedule: str = "1f1b",
                  layout: Optional[PipelineLayout] = None) -> PipelinePlan:
    """Split `module` into pipeline stages (validated, no process group). Raises PipelineLayoutError."""
    layout = layout if layout is not None else declared_layout(module)
    if not getattr(module, "automatic_optimization", True):
        raise PipelineLayoutError(
            f"`pipeline_parallel_size={pp_size}` with {type(module).__name__}.automatic_optimization=False: the pipeline "
            "schedule runs forward and backward for you, so manual optimization is not supported; use automatic "
            "optimization (gradient clipping and accumulation are supported through the Trainer flags)."
        )
    if layout.balance not in ("count", "params"):
        raise PipelineLayoutError(f"pipeline_layout balance={layout.balance!r} must be 'count' or 'params'.")
    virtual = 1
    if schedule == "interleaved_1f1b":
        virtual = layout.virtual_stages
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 2:
            raise PipelineLayoutError(
                f"pipeline_layout virtual_stages={virtual!r}: pipeline_schedule='interleaved_1f1b' needs an int >= 2 "
                "stages per rank (or use pipeline_schedule='1f1b')."
            )
    num_stages = pp_size * virtual
    blocks_fqn = layout.blocks or find_blocks(module)
    try:
        blocks = module.get_submodule(blocks_fqn)
    except AttributeError:
        raise PipelineLayoutError(f"pipeline_layout blocks={blocks_fqn!r} is not a submodule of {type(module).__name__}.")
    if not isinstance(blocks, nn.ModuleList):
        raise PipelineLayoutError(f"pipeline_layout blocks={blocks_fqn!r} is a {type(blocks).__name__}, not an nn.ModuleList.")
    n = len(blocks)
    if num_stages > n:
        if virtual == 1:
            raise PipelineLayoutError(
                f"`pipeline_parallel_size={pp_size}` is larger than the {n} blocks of `{blocks_fqn}`; every stage needs "
                f"at least one block: use pipeline_parallel_size<={n}."
            )
        raise PipelineLayoutError(
            f"`pipeline_parallel_size={pp_size}` x virtual_stages={virtual} (pipeline_schedule='interleaved_1f1b') = "
            f"{num_stages} stages is larger than the {n} blocks of `{blocks_fqn}`; lower pipeline_parallel_size or "
            "pipeline_layout virtual_stages, or use pipeline_schedule='1f1b'."
        )
    before, after = _units_around(module, blocks_fqn)
    late = [f for f in before if _called_after_blocks(module, blocks_fqn, f)]
    before, after = [f for f in before if f not in late], late + after
    embed = list(layout.embed) if layout.embed is not None else before
    head = list(layout.head) if layout.head is not None else after
    for fqn in embed + head:
        try:
            module.get_submodule(fqn)
        except AttributeError:
            raise PipelineLayoutError(f"pipeline_layout names `{fqn}`, which is not a submodule of {type(module).__name__}.")
    covered = set(embed) | set(head)
    orphans = [f for f in before + after if f not in covered and not any(f.startswith(c + ".") for c in covered)]
    if orphans:
        raise PipelineLayoutError(
            f"modules with parameters {orphans} are on no pipeline stage; add them to pipeline_layout 'embed' "
            "(stage 0) or 'head' (last stage)."
        )
    tied = tied_parameters(module, embed, head)
    if layout.split is not None:
        split = list(layout.split)
        if len(split) != num_stages or sum(split) != n or min(split) < 1:
            raise PipelineLayoutError(
                f"pipeline_layout split={split} must give {num_stages} positive block counts summing to the {n} "
                f"blocks of `{blocks_fqn}`."
            )
    elif layout.balance == "params":
        first = sum(_numel(module.get_submodule(f)) for f in embed)
        last = sum(_numel(module.get_submodule(f)) for f in head)
        split = balance_blocks([_numel(b) for b in blocks], num_stages, first, last)
    else:
        split = [n // num_stages + (1 if s < n % num_stages else 0) for s in range(num_stages)]
    stage_blocks, start = [], 0
    for size in split:
        stage_blocks.append(list(range(start, start + size)))
        start += size
    return PipelinePlan(pp_size, num_stages, blocks_fqn, n, embed, head, stage_blocks, layout, tied)
