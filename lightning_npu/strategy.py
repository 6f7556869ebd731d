"""`NPUHybridStrategy`: the Lightning glue for hybrid parallel training.

The strategy keeps to Lightning's hooks and delegates every parallel decision to
`lightning_npu.parallel`: layout validation (`config`), the ``("pp", "dp", "tp")`` device
mesh (`mesh`), and the one ordered application of the layout (`parallelize`, whose docstring
follows a training step from batch to checkpoint). It subclasses Lightning's DDPStrategy so that
launchers (popen/spawn/fork, torchrun, SLURM), collectives and checkpoint IO are Lightning's own.
"""

from __future__ import annotations

import atexit
import copy
import functools
import uuid
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_npu import device as dev
from lightning_npu.accelerator import NPUAccelerator, log_availability
from lightning_npu.launch import FullStateMultiProcessingLauncher
from lightning_npu.parallel.branch.apply import plan_branch
from lightning_npu.parallel.branch.spec import in_branch, match_branches, without_branches
from lightning_npu.parallel.checkpoint import commit as ckpt_commit
from lightning_npu.parallel.checkpoint import formats as ckpt_format
from lightning_npu.parallel.checkpoint import safe_load
from lightning_npu.parallel.checkpoint import sharded as ckpt
from lightning_npu.parallel.checkpoint.commit import CommitRequest, new_token
from lightning_npu.parallel.checkpoint.full_state import (
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    shard_optimizer_state,
)
from lightning_npu.parallel import dtensor_equal
from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.context_parallel.runtime import ContextParallel
from lightning_npu.parallel.data_parallel import reduction
from lightning_npu.parallel.data_parallel.hierarchical import setup_hierarchy
from lightning_npu.parallel.data_parallel.sampler import resumable_dataloader
from lightning_npu.parallel.data_parallel.sync import GradientSync
from lightning_npu.parallel.data_parallel.wrap import is_fully_sharded, is_sharded_root
from lightning_npu.parallel.mesh import build_mesh, dp_rank_of
from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.optim.distributed import DistributedOptimizer
from lightning_npu.parallel.optim.mixed_precision import (
    MixedPrecisionOptimizer,
    masters_as_parameters,
    needs_closure,
    refuse_shared_parameters,
    refuse_unflattenable,
    unwrap_optimizer,
    wrap_lr_schedulers,
)
from lightning_npu.parallel.optim.rebind import parameters_by_id, rebind
from lightning_npu.parallel.parallelize import (
    apply_pp,
    check_not_split_elsewhere,
    mark_split,
    parallelize,
    split_layout,
)
from lightning_npu.parallel.pipeline_parallel.plan import plan_pipeline
from lightning_npu.parallel.tensor_parallel.plan import plan_tensor_parallel, vocab_parallel_cross_entropy
from lightning_npu.precision.hybrid import HybridPrecision, as_hybrid_precision
from lightning_npu.ui.progress import use_resumable_progress_bar
from lightning_npu.ui.summary import use_whole_model_summary


class NPUHybridStrategy(DDPStrategy):
    """Hybrid tensor/pipeline/data parallelism on one device mesh, on NPU, CUDA or CPU.

    The processes form a ``("pp", "dp", "tp")`` mesh with ``tp * pp * dp == world size``. Arguments
    are validated here, and the layout against the world size as soon as the Trainer knows it, so a
    bad layout fails before any process group exists. An argument whose feature has not landed yet
    raises ``NotImplementedYetError`` rather than being ignored.

    Args:
        tensor_parallel_size: ranks that split each layer's weights (DTensor, ``tp`` mesh dim).
        pipeline_parallel_size: pipeline stages the blocks are split into (``pp`` mesh dim); the last
            stage's loss is ``pipeline_loss(output, target)``, or the cross-entropy of the logits.
        data_parallel_size: model replicas, each reading its own batches; ``"auto"`` is
            world size // (tp * pp).
        context_parallel_size: ranks that split each sequence between them (a ``cp`` mesh dim between dp and tp):
            rank i keeps the load-balanced chunks i and 2cp-1-i, attention is ring attention over cp, the loss is
            averaged over every token and gradients over dp x cp (`lightning_npu.parallel.context_parallel`). With
            dp, tp, pp, ZeRO 0-3 and full activation checkpointing; the sequence length must be divisible by 2cp.
        context_parallel_attention: ``"ring"`` (K/V blocks passed point-to-point around the cp ring: 1/cp of the
            attention activations per rank) or ``"allgather"`` (K/V all-gathered over cp: one collective per
            layer, whole-sequence K/V on every rank).
        branch_layouts: ``{module glob: {"tensor_parallel_size": N, "gradient_compression": ..., "zero_stage": 0}}``:
            a submodule (a CLIP tower) with its own (branch dp x branch tp) inside each top-level tp group: sharded
            at tp N, its input batch split over the tp / N branch-dp ranks and its output all-gathered, its gradients
            summed over them (compressed as its ``gradient_compression`` says). N must divide tensor_parallel_size.
            The branch's ``zero_stage`` 2/3 shards it with FSDP2 over its dp x branch-dp ranks (any top-level
            zero_stage; under 2/3 a branch that sets none takes the top level's); its ``zero_stage`` 1 shards its
            optimizer state over those ranks, and it and a branch ZeRO 0 take top-level zero_stage 0 or 1. Without
            pp, ep, cp or sequence_parallel (docs/layouts.md).
        expert_parallel_size: ranks of each dp group that split a mixture-of-experts model's experts between them
            (an ``ep`` group carved from dp; tokens dispatched by all-to-all); it must divide the dp size and the
            number of experts. With every ``zero_stage`` (ZeRO-1/3 shard the experts' states over the dp / ep ranks
            that hold them), tp and pp.
        zero_stage: what is sharded over the dp ranks: 0 nothing (replicate), 1 optimizer state,
            2 also gradients, 3 also parameters (FSDP2).
        micro_batches: pipeline micro-batches per optimizer step (pp > 1); ``None`` means one per
            stage (``pipeline_parallel_size``). At pp = 1 it is ignored, with a warning.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"`` (pp > 1; warned about and ignored
            at pp = 1).
        tp_plan: how layers are split under tp > 1: ``"auto"`` (known GPT-2 / Llama /
            ``transformers`` shapes), a dict of module-name glob to a style (``"colwise"``,
            ``"rowwise"``, ``"vocab"``, ``"replicate"``, ...) or a DTensor ``ParallelStyle``, or ``None`` for
            no split. The style ``"auto"`` is the automatic plan's choice, so ``{"*": "auto",
            "model.lm_head": "replicate"}`` overrides one module (later entries win). A vocab-split head
            returns logits that work in any code (torchmetrics, ``argmax``, ``generate``) while
            ``F.cross_entropy`` on them stays vocab-parallel. A dict at tp = 1 is ignored, with a warning.
        sequence_parallel: also shard norm and dropout activations along the sequence over the tp
            ranks (saves activation memory; needs tp > 1, refused at tp = 1).
        activation_checkpointing: recompute block activations in backward instead of keeping them: ``None``
            off, an int N (the N-th, 2N-th, ... block), ``"full"`` (every block), ``"selective"`` (every
            block, keeping matmul and attention outputs) or ``"auto"`` (the fewest blocks that fit
            ``memory_budget_gb``, measured on the first step).
        memory_budget_gb: per-rank memory (GB, 10**9 bytes) that ``activation_checkpointing="auto"`` fits
            model state plus saved activations into; ``None``: 90% of what the device has free after step 1.
        fuse_ops: replace norms, softmax, GELU, SwiGLU and attention with fused kernels (``state_dict``
            keys unchanged). True: only the patterns measured faster on this device type
            (``lightning_npu.ops.verdicts``); ``"all"`` or a list of pattern names: those (to measure them).
        gradient_compression: compress gradients before the dp reduction: ``None``, a mode (``"bf16"``,
            ``"int8"``, ``"topk"``, ``"onebit"``, ``"powersgd"``), an options dict (``{"mode": "topk",
            "ratio": 0.1, "warmup_steps": 100}``) or ``{module glob: mode, options or None}`` (docs/communication.md).
        bucket_size_mb: size of the gradient buckets that are reduced together, in MiB.
        hierarchical_allreduce: reduce within a node, then across nodes: ``"auto"``, True or False.
        process_group_backend: ``None`` picks it from the device (hccl, nccl, gloo).
        timeout: collective timeout (``datetime.timedelta``); ``None`` is torch's default.
        start_method: how Lightning launches the local processes (as in ``DDPStrategy``).
        find_unused_parameters: as in ``DDPStrategy``, for models that skip parameters in forward.
        static_graph: as in ``DDPStrategy``.
        async_save: write sharded checkpoints in a background thread; each is committed as soon as
            every rank's shards are on disk (so the default checkpoint form becomes the sharded directory).
        save_distributed_checkpoint: the checkpoint's form (Lightning's name, as in
            ``ModelParallelStrategy``). ``None``/``"auto"``: one Lightning ``.ckpt`` file (full tensors,
            loadable by ``load_from_checkpoint``, ``torch.load`` and ``"ddp"``) where the layout allows it
            cheaply (pp = 1, tp = 1, ZeRO 0/1, no ``async_save``), else a sharded directory; ``True``:
            always a sharded directory (every rank writes its shards); ``False``: always one file (rank 0
            writes the gathered full state, so it must fit in its CPU memory).
    """

    strategy_name = "npu_hybrid"
    # `trainer.save_checkpoint(path, storage_options=CommitRequest(...))`: the commit (and marker) is ours
    accepts_commit_request = True

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        zero_stage: int = 1,
        micro_batches: Optional[int] = None,
        pipeline_schedule: str = "1f1b",
        tp_plan: Any = "auto",
        sequence_parallel: bool = False,
        activation_checkpointing: Union[None, int, str] = None,
        memory_budget_gb: Optional[float] = None,
        fuse_ops: Union[bool, str, list[str]] = False,
        gradient_compression: Union[None, str, dict] = None,
        bucket_size_mb: float = 25.0,
        hierarchical_allreduce: Union[str, bool] = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        async_save: bool = False,
        save_distributed_checkpoint: Union[None, bool, Literal["auto"]] = None,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        context_parallel_attention: str = "ring",
        branch_layouts: Optional[dict] = None,
    ) -> None:
        ParallelConfig.check_strategy_options(start_method, find_unused_parameters, static_graph, async_save,
                                              save_distributed_checkpoint)
        self.parallel_config = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            expert_parallel_size=expert_parallel_size,
            context_parallel_size=context_parallel_size,
            context_parallel_attention=context_parallel_attention,
            zero_stage=zero_stage,
            micro_batches=micro_batches,
            pipeline_schedule=pipeline_schedule,
            tp_plan=tp_plan,
            sequence_parallel=sequence_parallel,
            activation_checkpointing=activation_checkpointing,
            memory_budget_gb=memory_budget_gb,
            fuse_ops=fuse_ops,
            gradient_compression=gradient_compression,
            bucket_size_mb=bucket_size_mb,
            hierarchical_allreduce=hierarchical_allreduce,
            process_group_backend=process_group_backend,
            timeout=timeout,
            branch_layouts=branch_layouts,
        )
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout if timeout is not None else default_pg_timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
        )
        self._device_mesh: Optional[DeviceMesh] = None
        self.hierarchy: Any = None  # parallel.hierarchical.HierarchicalAllReduce of this rank's dp group, if any
        self.fusion_report: Any = None
        self.recompute_report: Any = None  # lightning_npu.parallel.recompute.RecomputeReport (activation_checkpointing)
        self._auto_recompute: Any = None  # recompute.AutoRecompute under activation_checkpointing="auto"
        # checkpoints: write DCP shards in a background thread; rank 0 commits each as soon as every rank wrote it
        self.async_save = async_save
        # one Lightning file or a sharded directory (lightning_npu.parallel.checkpoint.formats)
        self.save_distributed_checkpoint = save_distributed_checkpoint
        # lightning_npu.parallel.tensor_parallel.plan.TensorParallelPlan once the model is known (tp > 1); str() reports it
        self.tp_report: Any = None
        self.branch_plans: Any = None  # (module name, BranchLayout, tp plan) per branch (`_plan_branches`)
        # lightning_npu.parallel.pipeline_parallel.plan.PipelinePlan / PipelineRunner once the model is known (pp > 1)
        self.pipeline_plan: Any = None
        self._pipeline: Any = None
        # the layout's gradient synchronisation (lightning_npu.parallel.data_parallel.sync), made by `parallelize`
        self._grad_sync: GradientSync = GradientSync()
        # dp-rank 0's buffers before each step where no DDP wrapper broadcasts them (lightning_npu.parallel.data_parallel.buffers)
        self._buffer_sync: Any = None
        self._ckpt_writer: Optional[ckpt.ShardedCheckpointWriter] = None
        self._restored_from_file = False
        self._owner = uuid.uuid4().hex  # marks the modules this strategy splits (`check_not_split_elsewhere`)
        self._bound_metrics: list[Any] = []  # the torchmetrics `Metric`s `setup` gave the dp group
        self._context_parallel: Any = None  # lightning_npu.parallel.context_parallel.runtime.ContextParallel (cp > 1)
        self._params_before: Optional[dict[int, Any]] = None  # the model's parameters before `parallelize`

    # ---- layout -------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have initialised (Trainer.fit).")
        return self._device_mesh

    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if not getattr(self, "_npu_line_logged", False) and not isinstance(self.accelerator, NPUAccelerator):
            self._npu_line_logged = True  # first called by the accelerator connector, before Lightning's GPU line
            log_availability(used=False)
        # The Trainer calls this as soon as it knows the devices: a bad layout fails at `Trainer(...)`.
        if self.cluster_environment is not None and self.parallel_devices:
            self.parallel_config.resolve(self.world_size)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":  # spawn/fork: the main process gets full tensors (`launch`)
            self._launcher = FullStateMultiProcessingLauncher(self, start_method=self._start_method)

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or dev.comm_backend(self.root_device.type)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        _destroy_process_groups_at_exit()
        cfg = self.parallel_config.resolve(self.world_size)
        # fit -> validate -> test reuse one mesh: building it again would create new process groups.
        if self._device_mesh is None or tuple(self._device_mesh.mesh.shape) != cfg.mesh_shape:
            self._device_mesh = build_mesh(self.root_device.type, cfg.pipeline_parallel_size, cfg.dp,
                                           cfg.tensor_parallel_size, cfg.context_parallel_size)
            # the intra/inter-node sub-groups of dp, before any model exists (every rank, same order)
            self.hierarchy = None if cfg.context_parallel_size > 1 else setup_hierarchy(
                self._device_mesh, cfg.hierarchical_allreduce, cfg.zero_stage, self.num_nodes,
                self.cluster_environment.node_rank(), self.root_device.type, cfg.bucket_size_mb)

    def setup_environment(self) -> None:
        dev.configure_allocator(self.root_device.type)  # before the process's first device allocation
        check_not_split_elsewhere(self.lightning_module, self._owner)
        self._plan_branches()  # so do branch globs that match nothing, or a branch tp that does not fit its heads
        self._plan_tensor_parallel()  # a tp plan that does not fit the model fails before any process group
        self._plan_pipeline()  # so does a pipeline split (pp larger than the blocks, no pipeline_loss, ...)
        super().setup_environment()
        assert self.lightning_module is not None
        # Lightning's LightningModule.device_mesh reads this attribute (also in configure_model).
        self.lightning_module._device_mesh = self._device_mesh

    # ---- collectives for logging and metrics (lightning_npu.parallel.data_parallel.reduction) -------------------
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """``self.log(..., sync_dist=True)``: a DTensor's full value, reduced over the dp ranks (tp and pp peers hold
        replicas of the same batch); an explicit `group` is honoured."""
        return reduction.reduce(tensor, self._device_mesh, group, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """``LightningModule.all_gather``: DTensors as their full values, stacked over the world (Lightning's contract;
        tp/pp peers' rows are copies: pass ``group=self.device_mesh["dp"].get_group()`` for distinct batches)."""
        return reduction.all_gather(tensor, group, sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """A decision (stop, save) every rank shares: summed over the whole world, not the dp group."""
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device),
                            group=torch.distributed.group.WORLD, reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The sampler splits over ``dp`` only (tp/pp/cp peers read the same batch); before the mesh exists (Lightning's
        data connector asked outside ``fit``) the layout gives the same answer."""
        if self._device_mesh is None:
            cfg = self.parallel_config.resolve(self.world_size)
            return {"num_replicas": cfg.dp, "rank": dp_rank_of(cfg.mesh_shape, self.global_rank)}
        dp_mesh = self._device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ---- precision ----------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning's plugins for "32-true", "bf16-mixed", "16-mixed", "bf16-true" and "16-true" become
        # HybridPrecision on the accelerator's device type (Lightning builds a CUDA-device MixedPrecision
        # for every non-CPU accelerator); any other plugin is refused with a clear error.
        device = type(self.accelerator).name() if self.accelerator is not None else None
        self._precision_plugin = as_hybrid_precision(plugin, device)

    # ---- model and optimizers -----------------------------------------------------------
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        cfg = self.parallel_config
        self._params_before = parameters_by_id(model)  # an optimizer made before this is rebound in setup_optimizers
        result = parallelize(
            model, self.device_mesh, cfg,
            tp_plan=self._plan_tensor_parallel() if cfg.tensor_parallel_size > 1 else None,
            pipeline_plan=self._plan_pipeline(),
            precision=self.precision_plugin,
            device=self.root_device,
            device_ids=self.determine_ddp_device_ids(),
            ddp_kwargs=self._ddp_kwargs,
            pipeline=self._pipeline if self._pipeline is not None and self._pipeline.module is model else None,
            hierarchy=self.hierarchy,
            branches=self._plan_branches(),
        )
        mark_split(model, self._owner, split_layout(cfg, bool(self.branch_plans)))
        self.fusion_report = result.fusion_report
        self.recompute_report = result.recompute_report
        self._auto_recompute = result.auto_recompute
        self._pipeline = result.pipeline
        self._grad_sync = result.grad_sync
        self._buffer_sync = result.buffer_sync
        return result.model

    def _register_ddp_hooks(self) -> None:
        """Lightning's DDP comm hooks (CUDA only) go on a DDP wrapper; most layouts have none (one replica, ZeRO 1-3,
        pp), where Lightning's own assertion would fail."""
        if isinstance(self.model, DistributedDataParallel):
            super()._register_ddp_hooks()

    # ---- tensor parallelism (lightning_npu.parallel.tensor_parallel) ------------------------------
    def _plan_tensor_parallel(self) -> Any:
        cfg = self.parallel_config
        if cfg.tensor_parallel_size == 1 or cfg.tp_plan is None:
            return None
        if self.tp_report is None:
            module = self.lightning_module
            if module is None or not any(True for _ in module.parameters()):
                return None  # the model is built in configure_model: planned in _setup_model
            names = [name for name, _, _ in self._plan_branches() or ()]
            self.tp_report = plan_tensor_parallel(
                module, cfg.tensor_parallel_size, without_branches(cfg.tp_plan, module, names),
                sequence_parallel=cfg.sequence_parallel
            )
            self.tp_report.replicated = [f for f in self.tp_report.replicated if not in_branch(f, names)]
        return self.tp_report

    def _plan_branches(self) -> Optional[list[tuple[str, Any, Any]]]:
        """``(module name, BranchLayout, its tp plan)`` of each `branch_layouts` match (`parallel.branch`), once the
        model has parameters; None before."""
        branches = self.parallel_config.branches
        if not branches:
            return None
        if self.branch_plans is None:
            module = self.lightning_module
            if module is None or not any(True for _ in module.parameters()):
                return None  # the model is built in configure_model: planned in _setup_model
            self.branch_plans = [(name, layout, plan_branch(module.get_submodule(name), name, layout))
                                 for name, layout in match_branches(module, branches)]
        return self.branch_plans

    def _distributed_optimizers(self) -> list[Any]:
        return [o for o in (unwrap_optimizer(o) for o in self.optimizers) if isinstance(o, DistributedOptimizer)]

    def _tp_active(self) -> bool:
        return self.tp_report is not None and self.tp_report.applied

    def _loss_context(self) -> Any:
        if self._tp_active() and self.tp_report.vocab_parallel_head:
            return vocab_parallel_cross_entropy()
        return nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        auto = self._auto_recompute
        if auto is not None:  # activation_checkpointing="auto": step 1 is measured, step 2 decides
            auto.before_step(self.lightning_module, self.optimizers, self.root_device,
                             dev.free_memory_bytes(self.root_device) / max(1, self.num_processes))
        out = self._step("train", "training_step", self.precision_plugin.train_step_context, *args, **kwargs)
        if auto is not None:
            auto.after_forward()
            self.recompute_report = auto.report or self.recompute_report
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validate", "validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test", "test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict", "predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    def _step(self, kind: str, method: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """One Lightning step: dp-rank 0's buffers first where no DDP wrapper broadcasts them
        (`lightning_npu.parallel.data_parallel.buffers`)."""
        if self._buffer_sync is not None:
            self._buffer_sync.before_step()
        if self._context_parallel is not None:  # this rank's chunks of each sequence (then of each micro-batch)
            if kind == "predict":
                raise ValueError("`context_parallel_size>1` splits sequences for training and evaluation; predict "
                                 "with a strategy at context_parallel_size=1 (the checkpoint loads under any cp).")
            args = self._context_parallel.split_args(args)
            with self._context_parallel.step(self.root_device):
                if self._pipeline is not None:
                    out = self._pipeline_step(kind, *args, **kwargs)
                else:
                    out = self._module_step(method, context, *args, **kwargs)
        elif self._pipeline is not None:
            out = self._pipeline_step(kind, *args, **kwargs)
        else:
            out = self._module_step(method, context, *args, **kwargs)
        if self._buffer_sync is not None:
            self._buffer_sync.after_step(self._grad_sync.enabled)
        return out

    @contextmanager
    def block_backward_sync(self) -> Any:
        """Accumulating micro-steps: no gradient communication (`GradientSync.no_sync`)."""
        with self._grad_sync.no_sync():
            yield None

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Lightning's `Strategy.backward` runs the backward (not overridden, so that it is Lightning's entry point, as
        under DDP): a published (reduced, unscaled) `.grad` is not what this backward adds to."""
        for opt in self.optimizers:
            unwrap_optimizer(opt).hide_model_grads()
        if self._pipeline is None:
            super().pre_backward(closure_loss)

    def _layout_backward(self, module_backward: Any) -> None:
        """`HybridPrecision.backward`'s part of Lightning's `Strategy.backward`: the LightningModule's `backward` hook,
        or under pp the gradients the schedule already computed inside `training_step` (with the loss scale and
        1/accumulate in each micro-batch's loss); then the layout's gradient sync, so that `on_after_backward` sees
        reduced gradients."""
        if self._pipeline is None:
            with self._loss_context():
                module_backward()
        else:
            self._pipeline.apply_gradients()
        if self._grad_sync.enabled:  # not on accumulating micro-steps
            self._grad_sync.finish()

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self._params_before is not None:
            rebind([unwrap_optimizer(o) for o in self.optimizers], self._params_before, self.lightning_module)
            self._params_before = None
        self._wrap_optimizers()
        self._grad_sync.bind(self._distributed_optimizers(), self._pipeline)

    def _wrap_optimizers(self) -> None:
        """Each optimizer steps through a `MixedPrecisionOptimizer` (ZeRO-1: its `DistributedOptimizer` subclass over
        the dp slices, same class and groups), sharing the precision plugin's loss scaler and given the pp group its
        gradient statistics sum over; step-interval LR schedulers skip after a skipped step."""
        plugin, cfg = self.precision_plugin, self.parallel_config
        scaler, pp_group = getattr(plugin, "scaler", None), gn.pipeline_group(self.device_mesh)
        master_weights = bool(getattr(plugin, "master_weights", False))
        user = [o for o in map(unwrap_optimizer, self.optimizers) if not isinstance(o, MixedPrecisionOptimizer)]
        if cfg.uses_distributed_optimizer:
            refuse_shared_parameters(user, half_only=False, layout="zero_stage=1")
        elif master_weights:
            refuse_shared_parameters(user, half_only=True, layout=f"precision={plugin.precision!r} (master weights)")
        wrappers: dict[int, MixedPrecisionOptimizer] = {}
        for optimizer in map(unwrap_optimizer, self.optimizers):
            if isinstance(optimizer, MixedPrecisionOptimizer):
                wrappers[id(optimizer)] = optimizer
            elif isinstance(optimizer, _MockOptimizer):  # `configure_optimizers` returned None: nothing to shard
                wrappers[id(optimizer)] = MixedPrecisionOptimizer(optimizer, scaler, pp_group)
            elif cfg.uses_distributed_optimizer:
                wrappers[id(optimizer)] = DistributedOptimizer(
                    optimizer, self.lightning_module, self.device_mesh, cfg.bucket_size_mb,
                    overlap=cfg.overlaps_gradient_reduction, scaler=scaler, pp_group=pp_group,
                    compressor=self._grad_sync.dp_compressor,  # (a branch's own compressor is not the top's)
                    replicate=cfg.zero_stage == 0,  # only a branch's own ZeRO-1 shards (the rest as under DDP)
                )
            else:
                if needs_closure(optimizer):  # LBFGS on FSDP2 shards or tp DTensors: refused before its first step
                    names = {id(p): n for n, p in self.lightning_module.named_parameters()}
                    refuse_unflattenable(type(optimizer).__name__, [
                        (names.get(id(p), "?"), p) for g in optimizer.param_groups for p in g["params"]],
                        f"zero_stage={cfg.zero_stage}, tensor_parallel_size={cfg.tensor_parallel_size}")
                wrappers[id(optimizer)] = MixedPrecisionOptimizer(optimizer, scaler, pp_group, master_weights=master_weights)
        self.optimizers = list(wrappers.values())
        wrap_lr_schedulers(self.lr_scheduler_configs, wrappers)
        if self._grad_sync.compressor is not None:  # frozen_variance (1-bit Adam) steps Adam through the compressor
            self._grad_sync.compressor.bind_optimizers(self.optimizers)

    # ---- pipeline parallelism (lightning_npu.parallel.pipeline_parallel) ------------------------------
    def _plan_pipeline(self) -> Any:
        cfg = self.parallel_config
        if cfg.pipeline_parallel_size == 1:
            return None
        module = self.lightning_module
        if self.pipeline_plan is None or (self._pipeline is not None and self._pipeline.module is not module):
            if module is None or not any(True for _ in module.parameters()):
                return None  # the model is built in configure_model: planned in _setup_model
            self._pipeline = None
            self.pipeline_plan = plan_pipeline(module, cfg.pipeline_parallel_size, cfg.pipeline_schedule)
        return self.pipeline_plan

    def setup(self, trainer: Any) -> None:
        self._buffer_sync = None  # fit makes it again (`_setup_model`); evaluation runs without, as under DDP
        if not getattr(self, "_dtensor_equal", False):  # BaseFinetuning's torch.equal over branches' DTensors
            dtensor_equal.install()
            self._dtensor_equal = True
        if isinstance(self.precision_plugin, HybridPrecision):
            self.precision_plugin.layout_backward = self._layout_backward
        super().setup(trainer)
        use_whole_model_summary(trainer)  # the summary counts every stage and shard, not rank 0's
        use_resumable_progress_bar(trainer)  # a mid-epoch resume's bar counts from the resumed batch
        cfg = self.parallel_config
        module = self.lightning_module
        if cfg.pipeline_parallel_size > 1 and (self._pipeline is None or self._pipeline.module is not module):
            # validate/test/predict without fit: split here (no gradients to synchronise)
            self._pipeline = apply_pp(module, self.device_mesh, cfg, self._plan_pipeline(), self.root_device)
        self._bound_metrics = reduction.bind_metrics(module, self.device_mesh)  # torchmetrics sync over dp, like `reduce`
        if cfg.context_parallel_size > 1 and getattr(self._context_parallel, "module", None) is not module:
            self._context_parallel = ContextParallel(module, self.device_mesh, cfg.context_parallel_attention)

    def _module_step(self, method: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """A LightningModule that is itself an FSDP2 unit (ZeRO 2/3, parameters held directly) runs the step
        through its forward hooks, as Lightning runs steps through a wrapper."""
        module = self.lightning_module
        with self._loss_context():
            if is_sharded_root(module):
                with context():
                    return self._forward_redirection(module, module, method, *args, **kwargs)
            return getattr(DDPStrategy, method)(self, *args, **kwargs)

    def _pipeline_step(self, kind: str, batch: Any, batch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
        runner, module, plugin = self._pipeline, self.lightning_module, self.precision_plugin
        batch = plugin.convert_input(batch)
        context = {
            "train": plugin.train_step_context,
            "validate": plugin.val_step_context,
            "test": plugin.test_step_context,
            "predict": plugin.predict_step_context,
        }[kind]
        with context(), self._loss_context():
            if kind == "predict":
                return runner.predict_step(batch)
            if kind == "validate" or kind == "test":
                loss = runner.eval_step(batch)
            else:
                trainer = module.trainer
                # the loss scale (HybridPrecision) and Lightning's 1/accumulate_grad_batches go into each
                # micro-batch's loss, so the gradients come out as a non-pipelined backward would leave them
                factor = float(getattr(plugin, "loss_scale", 1.0)) / max(1, trainer.accumulate_grad_batches)
                # overlap: with accumulate_grad_batches=1, zero_grad drops the held-aside gradients before backward
                # applies this step's, so what the schedule produces is exactly what gets reduced
                loss = runner.train_step(batch, factor, sync_grads=self._grad_sync.enabled,
                                         overlap=self._grad_sync.enabled and trainer.accumulate_grad_batches == 1)
        hook = getattr(module, "on_pipeline_loss", None)
        if callable(hook):
            hook(kind, loss, batch, batch_idx)
        else:
            name = runner.layout.log_names.get(kind)
            if name:
                module.log(name, loss, prog_bar=True, sync_dist=True)
        return {"loss": loss} if kind == "train" else loss

    # ---- checkpoints (mechanics in lightning_npu.parallel.checkpoint) ----------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # sharded state loads into the wrapped/sharded model and the already created (ZeRO) optimizers
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        # DCP checkpoints restore optimizers in `load_checkpoint`; single files through Lightning
        return self._restored_from_file

    def _masters_as_parameters(self) -> Any:
        """bf16/16-true: the fp32 master weights stand in for the 16-bit parameters, so that DCP's FQN-keyed state
        dicts see the tensors the optimizer steps (`lightning_npu.parallel.optim.mixed_precision.masters_as_parameters`)."""
        return masters_as_parameters(self.lightning_module, self.optimizers)

    def _writer(self) -> ckpt.ShardedCheckpointWriter:
        if self._ckpt_writer is None:
            self._ckpt_writer = ckpt.ShardedCheckpointWriter(async_save=self.async_save)
        return self._ckpt_writer

    @property
    def saves_single_file(self) -> bool:
        """Whether checkpoints are one Lightning file (else a sharded directory): `save_distributed_checkpoint`."""
        return ckpt_format.writes_single_file(self.parallel_config, self.save_distributed_checkpoint, self.async_save)

    def wait_parameters(self) -> None:
        """ZeRO-1 overlaps its parameter all-gather with the next forward: finish it (checkpoints, fit's end)."""
        for opt in self._distributed_optimizers():
            opt.wait_parameters()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_parameters()
        if self.saves_single_file:  # full tensors in the original layout (a collective)
            return ckpt_format.full_model_state(self.lightning_module, self._distributed_optimizers())
        with self._masters_as_parameters():
            return ckpt.model_state_dict(self.lightning_module, [unwrap_optimizer(o) for o in self.optimizers])

    @property
    def _without_optimizer(self) -> bool:
        """`configure_optimizers` returned None (Lightning's `_MockOptimizer`): no optimizer state to save or load."""
        return bool(self.optimizers) and all(
            isinstance(getattr(unwrap_optimizer(o), "optimizer", None), _MockOptimizer) for o in self.optimizers)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._without_optimizer:
            return {}  # Lightning's empty state for its mock optimizer (no parameters to key by name)
        if self.saves_single_file:  # torch's format with full tensors (a collective)
            return full_optimizer_state_dict(self.lightning_module, optimizer)
        with self._masters_as_parameters():
            return ckpt.optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Every checkpoint is committed with a marker recording its files' sizes and CRC32s (a callback's
        `CommitRequest`, or the default one); one saved after fit keeps the epoch it stopped in open."""
        request = ckpt.commit_request(storage_options, type(self).__name__, self.saves_single_file)
        io_options = storage_options if request is None else None  # the CheckpointIO plugin's (single files)
        if request is None:  # ModelCheckpoint, trainer.save_checkpoint
            request = CommitRequest(marker=ckpt_format.default_marker(checkpoint, self.world_size))
        path = Path(self.broadcast(str(filepath)))
        token = self.broadcast(new_token())
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            checkpoint = ckpt_format.continue_epoch_after_fit(checkpoint, trainer.num_training_batches)
        checkpoint = self._with_compression_state(checkpoint)  # collective
        info = ckpt_format.checkpoint_metadata(self.parallel_config, self.world_size, self.lightning_module,
                                               self.optimizers, checkpoint, self.saves_single_file)  # collective
        if self.saves_single_file:
            checkpoint = ckpt_format.set_loader_state_aside({**checkpoint, "lightning_npu": info})
            ckpt_format.save_file(checkpoint, path, token, self.is_global_zero, self.checkpoint_io, self.broadcast,
                                  request, io_options)
            return
        tensors, meta = ckpt.split_checkpoint(checkpoint)
        meta["lightning_npu"] = info
        self._writer().save(tensors, meta, path, token, self.is_global_zero, self.broadcast, request)

    def finalize_checkpoints(self) -> None:
        """Wait for an async save in flight (rank 0 commits it as soon as written); raise its error on every rank.
        Collective."""
        if self._ckpt_writer is not None:
            self._ckpt_writer.finalize(self.broadcast)

    def on_train_end(self) -> None:
        """A failed async save is raised as fit ends, on every rank alike (not at teardown, where only the rank
        that knows it could raise). Collective."""
        for opt in self._distributed_optimizers():
            opt.remove_wait_hooks()  # waits for the last step's all-gathers first
        self.finalize_checkpoints()

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's pruning: the marker goes first (`commit.delete`), so a crash half way leaves an
        unmarked checkpoint, never a trusted broken one."""
        if self.is_global_zero:
            ckpt_commit.delete(filepath)

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory saved under any layout loads here in full; a single Lightning file is read here and
        its full tensors are sharded by `load_model_state_dict`. Every file is first checked against its marker
        (sizes, CRC32s), then read with ``weights_only=True``."""
        self.finalize_checkpoints()
        path = ckpt.resolve_checkpoint_path(self.broadcast(str(checkpoint_path)))
        # sizes and CRC32s against the marker, the ranks sharing the reading; all raise the same error
        ckpt_commit.verify_for_load(path, self.global_rank, self.world_size, self._all_gather_object)
        self._restored_from_file = path.is_file()
        module = self.lightning_module
        if self._restored_from_file:
            with safe_load.refusing_unsafe(path):
                loaded = ckpt_format.restore_loader_state(super().load_checkpoint(path, weights_only=True))
            self._load_compression_state(loaded)
            return loaded
        optimizers = [] if self._without_optimizer else [unwrap_optimizer(o) for o in self.optimizers]
        if optimizers and ckpt.is_sharded_checkpoint(path):  # the saved optimizer state covers the groups BaseFinetuning had added: put them back first
            self._restore_finetuning_groups(ckpt.read_meta(path))
        with self._masters_as_parameters():  # bf16/16-true: restores the fp32 masters, then the 16-bit params
            loaded = ckpt.load_directory(path, module, optimizers, module.strict_loading,
                                       pipelined=self._pipeline is not None)
        self._load_compression_state(loaded)
        return loaded

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.wait_parameters()
        if self._restored_from_file:  # (a directory was loaded whole by `load_checkpoint`)
            load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def _with_compression_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Every rank's compressor state (error-feedback residuals, PowerSGD factors differ per rank), gathered so
        that the checkpoint holds the same entry on every rank (replicated, like the rest of its metadata)."""
        compressor = self._grad_sync.compressor
        if compressor is None or not dist.is_initialized():
            return checkpoint
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, compressor.state_dict())
        return {**checkpoint, "gradient_compression": {"world_size": dist.get_world_size(), "ranks": states}}

    def _load_compression_state(self, checkpoint: Mapping[str, Any]) -> None:
        compressor, saved = self._grad_sync.compressor, checkpoint.get("gradient_compression")
        if compressor is None or not saved:
            return
        same_world = saved.get("world_size") == self.world_size
        state = saved["ranks"][self.global_rank] if same_world else {**saved["ranks"][0], "world": None}
        if not compressor.load_state_dict(state, world=compressor.world or self.parallel_config.resolved_dp):
            rank_zero_warn("Gradient compression state (error-feedback residuals, PowerSGD factors) was saved under "
                           f"another world size ({saved.get('world_size')} vs {self.world_size}); it is reset, "
                           "the warm-up step counts carry over.")

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._restored_from_file or self._without_optimizer:
            return
        self._restore_finetuning_groups()
        checkpoint = ckpt_format.own_optimizer_states(self.lightning_module, self.optimizers, dict(checkpoint))
        # full tensors -> this rank's FSDP2 (ZeRO 2/3) shards; ZeRO-1's optimizer slices its own (and a branch's FSDP2
        # shards, `DistributedOptimizer.load_state_dict`)
        if is_fully_sharded(self.lightning_module) and not self._distributed_optimizers():
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
                load_full_optimizer_state_dict(self.lightning_module, optimizer, state)
            return
        def params(opt: Any) -> list[Any]:  # what the full state is indexed by: the model's parameters
            opt = unwrap_optimizer(opt)
            model_of = {id(m): p for p, m in getattr(opt, "master_pairs", ())}  # fp32 masters of 16-bit params
            return [model_of.get(id(p), p) for p in getattr(opt, "model_params", None)
                    or [p for g in opt.param_groups for p in g["params"]]]

        checkpoint = {**checkpoint, "optimizer_states": [  # full tensors -> this rank's tp shards
            shard_optimizer_state(self.lightning_module, params(opt), s)
            for opt, s in zip(self.optimizers, checkpoint["optimizer_states"])]}
        super().load_optimizer_state_dict(checkpoint)

    def _restore_finetuning_groups(self, checkpoint: Optional[Mapping[str, Any]] = None) -> None:
        """Lightning's `BaseFinetuning` puts back the param groups it had added in `on_fit_start`, which under
        Lightning's own strategies runs after the checkpoint's callback states load and before its optimizer states do.
        Here the checkpoint is restored after setup (`restore_checkpoint_after_setup`), so after `on_fit_start`: the
        groups are put back here, before the optimizer state (saved with them) loads. `checkpoint`: a sharded
        directory's metadata, whose callback states Lightning loads only after the directory (optimizers included)."""
        trainer = self.lightning_module.trainer
        saved = (checkpoint or {}).get("callbacks") or {}
        for callback in trainer.callbacks:
            if not isinstance(callback, BaseFinetuning):
                continue
            if checkpoint is not None and saved.get(callback.state_key):
                callback.load_state_dict(copy.deepcopy(saved[callback.state_key]))
            if callback._restarting:
                callback.on_fit_start(trainer, self.lightning_module)

    def teardown(self) -> None:
        if getattr(self, "_dtensor_equal", False):
            dtensor_equal.uninstall()
            self._dtensor_equal = False
        if self._ckpt_writer is not None:
            ckpt.finalize_at_teardown(self._ckpt_writer)
        super().teardown()
        self._release_process_groups()

    def _release_process_groups(self) -> None:
        """Drop what holds process groups that the next fit makes again, as DDPStrategy drops its DDP wrapper, so
        that the module and the trainer pickle after fit (``torch.save(trainer)``) and a later fit of the same module
        reduces its gradients once: ZeRO-1's bucket hooks, the gradient sync (DDP's comm hook state) and the buffer
        broadcast. The module's metrics keep their dp group (under tp or pp), since a
        metric computed after fit must still count each sample once; the gradient compressor's state stays (a
        checkpoint saved after fit holds it)."""
        for opt in self._distributed_optimizers():
            opt.grad_buckets.remove_hooks()
        self._grad_sync.release()
        compressor = self._grad_sync.compressor
        self._grad_sync = GradientSync()
        self._grad_sync.compressor = compressor
        self._buffer_sync = None

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="lightning-npu hybrid tensor/pipeline/data parallelism (npu, cuda, cpu)",
            override=True,
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader's sampler becomes resumable (`lightning_npu.parallel.data_parallel.sampler`): a mid-epoch resume
        continues at the consumed global sample instead of replaying the epoch from batch 0."""
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        if module is None or module._trainer is None or not module.trainer.training:
            return dataloader  # evaluation loaders: Lightning checkpoints no position for them
        return resumable_dataloader(dataloader)


@functools.cache
def _destroy_process_groups_at_exit() -> None:
    """Leave together, then shut the process groups down before the interpreter tears down C++ statics.

    Lightning never destroys the groups it creates (fit, validate and test share them). A rank that exits while
    its peers still hold gloo connections to it, or with gloo's worker threads still joinable, aborts with
    "terminate called without an active exception" after training has finished (seen ~1 in 8 runs here).
    """

    def leave() -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=60))
            dist.destroy_process_group()
        except Exception:  # a peer already died: nothing left to leave cleanly
            pass

    atexit.register(leave)
