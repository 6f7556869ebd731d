"""Validation of the strategy's parallel layout, before any process-group work.

A bad layout found after `init_process_group` costs the user a cluster allocation and often
a hang; found here it costs a traceback that names the argument, the value and the fix.

An argument that only means something in another layout is never dropped silently. Pipeline and
tensor-parallel tuning (`micro_batches`, `pipeline_schedule`, a `tp_plan` dict) at pp = 1 or tp = 1 is
warned about once and ignored: a config that switches the layout from the command line keeps them, and
the run is the one asked for otherwise. `sequence_parallel=True` at tp = 1 is refused: it is asked for
to save activation memory, which that run would not save.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_npu.ops.verdicts import PATTERNS
from lightning_npu.parallel.branch.spec import check_with_layout, parse_branch_layouts
from lightning_npu.parallel.data_parallel.compression_spec import parse_compression
from lightning_npu.parallel.errors import CompressionConfigError, ParallelConfigError
from lightning_npu.validate import check_bool, check_choice, check_int, check_number

ZERO_STAGES = (0, 1, 2, 3)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CONTEXT_PARALLEL_ATTENTION = ("ring", "allgather")  # K/V blocks point-to-point around the cp ring | all-gathered
GRADIENT_COMPRESSIONS = (None, "bf16", "int8", "topk", "onebit", "powersgd")
TP_STYLES = ("colwise", "rowwise", "vocab", "colwise_rep", "rowwise_rep", "qkv", "gate_up", "replicate_sum_grad",
             "sequence", "replicate", "auto")
HIERARCHICAL = ("auto", True, False)
START_METHODS = ("popen", "spawn", "fork", "forkserver")
# torch.distributed's own backends plus the device plugins' (hccl comes with torch_npu, imported lazily)
KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "hccl", "cncl", "mccl")


def _check_tp_plan_dict(tp_plan: dict) -> None:
    """Keys are module-name globs; values style names (``"auto"``: the automatic plan's choice) or ParallelStyles."""
    from torch.distributed.tensor.parallel import ParallelStyle

    override = "tp_plan={'*': 'auto', 'model.lm_head': 'replicate'}"
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str):
            raise ParallelConfigError(f"`tp_plan` key {pattern!r} must be a module-name glob (str), e.g. '*.mlp.c_fc'.")
        if pattern == "auto":
            raise ParallelConfigError(
                "`tp_plan['auto']`: dict keys are module-name globs, and no module is called 'auto'. To start from "
                f"the automatic plan and override single modules, map a glob to 'auto', e.g. {override}."
            )
        if style is None:
            raise ParallelConfigError(
                f"`tp_plan[{pattern!r}]=None`: to leave a module unsharded use the style 'replicate', e.g. {override}."
            )
        if isinstance(style, ParallelStyle):
            continue
        if not (isinstance(style, str) and style in TP_STYLES):
            raise ParallelConfigError(
                f"`tp_plan[{pattern!r}]={style!r}` is not a known style; use one of {list(TP_STYLES)} "
                "or a torch.distributed.tensor.parallel.ParallelStyle object."
            )


def _check_fuse_ops(value: Any) -> None:
    """True (the device's measured table), False, "all", or a list of pattern names (to measure them)."""
    if isinstance(value, bool) or value == "all":
        return
    if not (isinstance(value, (list, tuple)) and all(isinstance(v, str) and v in PATTERNS for v in value)):
        raise ParallelConfigError(
            f"`fuse_ops={value!r}` must be True (the patterns measured faster on this device), False, 'all' or a "
            f"list of pattern names from {list(PATTERNS)}."
        )


def _check_backend(value: Any) -> None:
    """A backend name, or Lightning's per-device form ``"cpu:gloo,cuda:nccl"``; typos fail here, not at init."""
    if value is None:
        return
    fix = "use a backend name such as 'hccl', 'nccl' or 'gloo', or None to pick it from the device."
    if not isinstance(value, str) or not value:
        raise ParallelConfigError(f"`process_group_backend={value!r}` must be a string: {fix}")
    try:
        import torch.distributed as dist

        registered = {str(b).lower() for b in getattr(dist.Backend, "backend_list", ())}
    except Exception:  # pragma: no cover - torch built without distributed
        registered = set()
    for part in value.split(","):
        name = part.split(":")[-1].strip().lower()
        if name not in KNOWN_BACKENDS and name not in registered:
            raise ParallelConfigError(
                f"`process_group_backend={value!r}`: {name!r} is not a process group backend; {fix}"
            )


def _user_frame() -> int:
    """`warnings.warn`'s stacklevel of the first caller outside this package, so a warning names the user's line."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("lightning_npu."):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: Union[int, str] = "auto"
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    context_parallel_attention: str = "ring"
    zero_stage: int = 1
    micro_batches: Optional[int] = None
    pipeline_schedule: str = "1f1b"
    tp_plan: Any = "auto"
    sequence_parallel: bool = False
    activation_checkpointing: Union[None, int, str] = None
    memory_budget_gb: Optional[float] = None
    fuse_ops: Union[bool, str, list[str]] = False
    gradient_compression: Union[None, str, dict] = None
    bucket_size_mb: float = 25.0
    hierarchical_allreduce: Union[str, bool] = "auto"
    process_group_backend: Optional[str] = None
    timeout: Optional[timedelta] = None
    branch_layouts: Optional[dict] = None
    # filled in by `resolve(world_size)`
    resolved_dp: Optional[int] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- checks that need no world size -------------------------------------------------
    def validate(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, example=2, error=ParallelConfigError)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, example=2, error=ParallelConfigError)
        check_int("expert_parallel_size", self.expert_parallel_size, example=2, error=ParallelConfigError)
        check_int("context_parallel_size", self.context_parallel_size, example=2, error=ParallelConfigError)
        check_choice("context_parallel_attention", self.context_parallel_attention, CONTEXT_PARALLEL_ATTENTION,
                     error=ParallelConfigError)
        if self.data_parallel_size != "auto":
            check_int("data_parallel_size", self.data_parallel_size, example=2, error=ParallelConfigError)
        if not (type(self.zero_stage) is int and self.zero_stage in ZERO_STAGES):  # 1.0 == 1, True == 1
            raise ParallelConfigError(
                f"`zero_stage={self.zero_stage!r}` is not a ZeRO stage; use 0 (replicate), 1 (shard optimizer "
                "state), 2 (+ gradients) or 3 (+ parameters)."
            )
        check_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES, error=ParallelConfigError)
        if self.micro_batches is not None:
            check_int("micro_batches", self.micro_batches, example=2, error=ParallelConfigError)
            if self.pipeline_parallel_size > 1 and self.pipeline_schedule != "gpipe":
                if self.micro_batches < self.pipeline_parallel_size:
                    raise ParallelConfigError(
                        f"`micro_batches={self.micro_batches}` is smaller than `pipeline_parallel_size="
                        f"{self.pipeline_parallel_size}`; schedule {self.pipeline_schedule!r} needs at least one "
                        f"micro-batch per stage: set `micro_batches>={self.pipeline_parallel_size}`."
                    )
        if not (self.tp_plan is None or self.tp_plan == "auto" or isinstance(self.tp_plan, dict)):
            raise ParallelConfigError(
                f"`tp_plan={self.tp_plan!r}` must be 'auto', None or a dict of module-name glob -> style "
                f"({', '.join(TP_STYLES)}) or DTensor ParallelStyle."
            )
        if isinstance(self.tp_plan, dict):
            _check_tp_plan_dict(self.tp_plan)
        check_bool("sequence_parallel", self.sequence_parallel, error=ParallelConfigError)
        _check_fuse_ops(self.fuse_ops)
        if self.sequence_parallel and (self.tensor_parallel_size == 1 or self.tp_plan is None):
            raise ParallelConfigError(
                "`sequence_parallel=True` shards activations over the tensor-parallel group: it needs "
                "`tensor_parallel_size>1` and a tp_plan; set sequence_parallel=False or raise tensor_parallel_size."
            )
        self._warn_other_layouts()
        ac = self.activation_checkpointing
        if not (ac is None or ac in ("full", "selective", "auto")
                or (isinstance(ac, int) and not isinstance(ac, bool) and ac >= 1)):
            raise ParallelConfigError(
                f"`activation_checkpointing={ac!r}` must be None, a positive int N (recompute every N-th block), "
                "'full' (every block), 'selective' (every block, keeping matmul outputs) or 'auto' (fit a memory "
                "budget)."
            )
        budget = self.memory_budget_gb
        check_number("memory_budget_gb", budget, above=0, allow_none=True, example=60, error=ParallelConfigError,
                     what="a positive number of GB (10**9 bytes) per rank, or None for the device's free memory")
        if budget is not None and ac != "auto":
            raise ParallelConfigError(
                f"`memory_budget_gb={budget!r}` is read only by activation_checkpointing='auto' "
                f"(got activation_checkpointing={ac!r}); set both, or drop memory_budget_gb.")
        if ac == "auto" and self.pipeline_parallel_size > 1:
            raise ParallelConfigError(
                "`activation_checkpointing='auto'` measures one ordinary forward, which a pipeline schedule does not "
                f"run (pipeline_parallel_size={self.pipeline_parallel_size}); choose an int N, 'full' or 'selective'.")
        self._check_compression()
        check_number("bucket_size_mb", self.bucket_size_mb, above=0, example=25.0, error=ParallelConfigError,
                     what="a positive, finite number of MiB")
        h = self.hierarchical_allreduce
        if not (isinstance(h, bool) or (isinstance(h, str) and h == "auto")):  # 1 == True: compare types too
            raise ParallelConfigError(
                f"`hierarchical_allreduce={h!r}` must be 'auto' (more than one node and buckets >= 8 MiB), True "
                "(always) or False (never)."
            )
        if h is True and self.zero_stage != 0:
            raise ParallelConfigError(
                f"`hierarchical_allreduce=True` applies to all-reduce buckets (zero_stage=0), but zero_stage="
                f"{self.zero_stage} reduce-scatters gradients; use zero_stage=0, or leave "
                "hierarchical_allreduce='auto'."
            )
        _check_backend(self.process_group_backend)
        if self.context_parallel_size > 1:
            self._check_context_layout()
        check_with_layout(self.branches, self)
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise ParallelConfigError(
                f"`timeout={self.timeout!r}` must be a datetime.timedelta (e.g. timedelta(minutes=30)) or None."
            )

    def _check_context_layout(self) -> None:
        """Context parallelism composes with dp, tp, pp and ZeRO 0-3; what is not built is refused by name."""
        cp = self.context_parallel_size
        unsupported = [
            ("expert_parallel_size", self.expert_parallel_size > 1, "expert_parallel_size=1"),
            ("sequence_parallel", self.sequence_parallel, "sequence_parallel=False"),
            ("gradient_compression", self.gradient_compression is not None, "gradient_compression=None"),
            ("fuse_ops", self.fuse_ops is not False, "fuse_ops=False"),
            ("activation_checkpointing", self.activation_checkpointing in ("selective", "auto"),
             "activation_checkpointing='full' or an int N"),
            ("hierarchical_allreduce", self.hierarchical_allreduce is True, "hierarchical_allreduce='auto'"),
        ]
        for name, bad, fix in unsupported:
            if bad:
                value = getattr(self, name)
                raise ParallelConfigError(
                    f"`context_parallel_size={cp}` with `{name}={value!r}` is not supported yet; set {fix}, or "
                    "context_parallel_size=1.")

    def _warn_other_layouts(self) -> None:
        """Warn (once, on rank 0) about arguments that the chosen layout ignores; see the module doc."""
        unused = []
        if self.pipeline_parallel_size == 1:
            if self.micro_batches is not None:
                unused.append((f"micro_batches={self.micro_batches!r}", "pipeline_parallel_size",
                               f"; for gradient accumulation use Trainer(accumulate_grad_batches={self.micro_batches})"))
            if self.pipeline_schedule != "1f1b":
                unused.append((f"pipeline_schedule={self.pipeline_schedule!r}", "pipeline_parallel_size", ""))
        if self.tensor_parallel_size == 1 and isinstance(self.tp_plan, dict):
            unused.append((f"tp_plan={self.tp_plan!r}", "tensor_parallel_size", ""))
        for arg, size, hint in unused:
            if rank_zero_only.rank == 0:  # each process of a launch builds the strategy
                warnings.warn(f"`{arg}` only applies with `{size}>1`; at `{size}=1` it is ignored. Set {size} to 2 "
                              f"or more, or drop {arg.split('=')[0]}{hint}.", UserWarning, stacklevel=_user_frame())

    @staticmethod
    def check_strategy_options(
        start_method: Any = "popen",
        find_unused_parameters: Any = False,
        static_graph: Any = False,
        async_save: Any = False,
        save_distributed_checkpoint: Any = None,
    ) -> None:
        """The strategy's launch, DDP and checkpoint options, which are not part of the layout but fail as late as it
        does."""
        check_choice("start_method", start_method, START_METHODS, error=ParallelConfigError)
        check_bool("find_unused_parameters", find_unused_parameters, error=ParallelConfigError)
        check_bool("static_graph", static_graph, error=ParallelConfigError)
        check_bool("async_save", async_save, error=ParallelConfigError)
        sdc = save_distributed_checkpoint
        if not (sdc is None or isinstance(sdc, bool) or (isinstance(sdc, str) and sdc == "auto")):
            raise ParallelConfigError(
                f"`save_distributed_checkpoint={save_distributed_checkpoint!r}` must be None or 'auto' (one file where "
                "the layout allows it, a sharded directory otherwise), True (always a sharded directory) or False "
                "(always one Lightning file)."
            )
        if sdc is False and async_save is True:
            raise ParallelConfigError(
                "`save_distributed_checkpoint=False` with `async_save=True`: background saving writes sharded "
                "directories; set `save_distributed_checkpoint=None` (or True), or `async_save=False` for one file."
            )

    def _check_compression(self) -> None:
        value = self.gradient_compression
        if isinstance(value, str) and value not in GRADIENT_COMPRESSIONS:
            raise ParallelConfigError(
                f"`gradient_compression={value!r}` is unknown; choose one of {list(GRADIENT_COMPRESSIONS)}.")
        try:
            parsed = parse_compression(value)
        except (CompressionConfigError, TypeError) as err:
            raise ParallelConfigError(str(err)) from None
        if parsed is None:
            return
        if self.zero_stage in (2, 3):
            raise ParallelConfigError(
                f"`gradient_compression={self.gradient_compression!r}` with `zero_stage={self.zero_stage}`: FSDP2's "
                "reduce-scatter runs per unit inside backward and is not compressed; use zero_stage=0 or 1, or "
                "gradient_compression=None.")
        specs = list(parsed.values()) if isinstance(parsed, dict) else [parsed]
        if self.zero_stage != 0 and any(s is not None and s.frozen_variance for s in specs):
            raise ParallelConfigError(
                f"`gradient_compression={self.gradient_compression!r}` with `zero_stage={self.zero_stage}`: "
                "frozen_variance=True (1-bit Adam) compresses each rank's whole Adam momentum, which ZeRO-1 shards; "
                "use zero_stage=0, or frozen_variance=False.")
        if self.hierarchical_allreduce is True:
            raise ParallelConfigError(
                f"`gradient_compression={self.gradient_compression!r}` with `hierarchical_allreduce=True`: a compressed "
                "bucket is exchanged flat over the dp group; choose one (hierarchical_allreduce='auto' leaves "
                "compressed buckets flat).")

    # ---- checks that need the world size --------------------------------------------------
    def resolve(self, world_size: int) -> "ParallelConfig":
        tp, pp, cp = self.tensor_parallel_size, self.pipeline_parallel_size, self.context_parallel_size
        sizes = f"`tensor_parallel_size={tp}` x `pipeline_parallel_size={pp}`"
        if cp > 1:
            sizes += f" x `context_parallel_size={cp}`"
        if world_size % (tp * pp * cp) != 0:
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by {sizes} = {tp * pp * cp}; change the sizes or the "
                "number of devices."
            )
        dp = world_size // (tp * pp * cp) if self.data_parallel_size == "auto" else int(self.data_parallel_size)
        if tp * pp * cp * dp != world_size:
            raise ParallelConfigError(
                f"{sizes} x `data_parallel_size={dp}` = {tp * pp * cp * dp}, but the world size is {world_size}; "
                f"set `data_parallel_size={world_size // (tp * pp * cp)}` or 'auto'."
            )
        if dp % self.expert_parallel_size:
            raise ParallelConfigError(
                f"`expert_parallel_size={self.expert_parallel_size}` does not divide the data-parallel size {dp}: the "
                "ep group is carved from the dp ranks; choose an expert_parallel_size that divides it.")
        self.resolved_dp = dp
        return self

    @property
    def branches(self) -> list:
        """`branch_layouts` parsed (`branch.spec.BranchLayout`s, in the dict's order)."""
        return parse_branch_layouts(self.branch_layouts, top_zero_stage=self.zero_stage)

    @property
    def dp(self) -> int:
        if self.resolved_dp is None:
            raise RuntimeError("ParallelConfig.resolve(world_size) has not run yet.")
        return self.resolved_dp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, which gradients are averaged over: dp x cp (cp ranks read other tokens)."""
        return self.dp * self.context_parallel_size

    @property
    def uses_distributed_optimizer(self) -> bool:
        """ZeRO-1 over more than one replica (at dp x cp = 1 there is nothing to shard), or a branch's own ZeRO-1
        (`branch_layouts`), whose optimizer state is sharded over the branch's dp ranks whatever the top level's."""
        return (self.zero_stage == 1 and self.replicas > 1) or any(b.zero_stage == 1 for b in self.branches)

    @property
    def overlaps_gradient_reduction(self) -> bool:
        """Reduce each bucket from backward's hooks; under pp the schedule runs backward per micro-batch, so the
        buckets are reduced once after it instead."""
        return self.pipeline_parallel_size == 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(pp, dp, tp), or (pp, dp, cp, tp) under context parallelism (`mesh.build_mesh`)."""
        if self.context_parallel_size > 1:
            return (self.pipeline_parallel_size, self.dp, self.context_parallel_size, self.tensor_parallel_size)
        return (self.pipeline_parallel_size, self.dp, self.tensor_parallel_size)
