"""`NPUHybridStrategy`: the Lightning glue for hybrid parallel training.

The strategy keeps to Lightning's hooks and delegates every parallel decision to
`lightning_npu.parallel`: layout validation (`config`), the ``("pp", "dp", "tp")`` device
mesh (`mesh`), data parallelism and optimizer sharding (`data`). It subclasses Lightning's
DDPStrategy so that launchers (popen/spawn/fork, torchrun, SLURM), collectives, gradient
accumulation's `no_sync` and checkpoint IO are Lightning's own.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_npu import device as dev
from lightning_npu.parallel import data as data_parallel
from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.mesh import build_mesh


class NPUHybridStrategy(DDPStrategy):
    """Hybrid tensor/pipeline/data parallelism on one device mesh, on NPU, CUDA or CPU.

    See ARCHITECTURE.md for the meaning of each argument. Arguments are validated here, and the
    layout against the world size as soon as the Trainer knows it, before any process group exists.
    """

    strategy_name = "npu_hybrid"

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
        fuse_ops: bool = False,
        gradient_compression: Optional[str] = None,
        bucket_size_mb: float = 25.0,
        hierarchical_allreduce: Union[str, bool] = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
    ) -> None:
        self.parallel_config = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            zero_stage=zero_stage,
            micro_batches=micro_batches,
            pipeline_schedule=pipeline_schedule,
            tp_plan=tp_plan,
            sequence_parallel=sequence_parallel,
            activation_checkpointing=activation_checkpointing,
            fuse_ops=fuse_ops,
            gradient_compression=gradient_compression,
            bucket_size_mb=bucket_size_mb,
            hierarchical_allreduce=hierarchical_allreduce,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout if timeout is not None else default_pg_timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
        )
        self._device_mesh: Optional[DeviceMesh] = None
        self.fusion_report: Any = None

    # ---- layout -------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have initialised (Trainer.fit).")
        return self._device_mesh

    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # The Trainer calls this as soon as it knows the devices: a bad layout fails at `Trainer(...)`.
        if self.cluster_environment is not None and self.parallel_devices:
            self.parallel_config.resolve(self.world_size)

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or dev.comm_backend(self.root_device.type)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        cfg = self.parallel_config.resolve(self.world_size)
        # fit -> validate -> test reuse one mesh: building it again would create new process groups.
        if self._device_mesh is None or tuple(self._device_mesh.mesh.shape) != cfg.mesh_shape:
            self._device_mesh = build_mesh(self.root_device.type, *cfg.mesh_shape)

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.lightning_module is not None
        # Lightning's LightningModule.device_mesh reads this attribute (also in configure_model).
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self.device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ---- precision ----------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # Lightning builds MixedPrecision(device="cuda") for every non-CPU accelerator; re-target it.
        if type(plugin) is MixedPrecision and self.accelerator is not None:
            from lightning_npu.precision import HybridPrecision

            plugin = HybridPrecision(plugin.precision, device=type(self.accelerator).name())
        self._precision_plugin = plugin

    # ---- model and optimizers -----------------------------------------------------------
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        if self.parallel_config.fuse_ops:
            from lightning_npu.ops import rewrite_modules

            self.fusion_report = rewrite_modules(model, device=self.root_device)
        return data_parallel.wrap_data_parallel(
            model,
            self.device_mesh,
            device_ids=self.determine_ddp_device_ids(),
            bucket_size_mb=self.parallel_config.bucket_size_mb,
            ddp_kwargs=self._ddp_kwargs,
        )

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.parallel_config.zero_stage == 1 and self.device_mesh["dp"].size() > 1:
            self._shard_optimizer_states()

    def _shard_optimizer_states(self) -> None:
        sharded = []
        for optimizer in self.optimizers:
            inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            zero = data_parallel.shard_optimizer_state(inner, self.device_mesh)
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is inner:
                    config.scheduler.optimizer = zero
                    # the scheduler's "optimizer.step() before lr_scheduler.step()" check reads this flag,
                    # which only the optimizer it was built on sets.
                    zero._opt_called = True
            sharded.append(zero)
        self.optimizers = sharded

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
