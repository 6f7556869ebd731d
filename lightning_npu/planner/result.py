"""What a search returns: one `Estimate` per layout that fits (its memory, step time and, for a multi-branch model,
its towers' costs) and the `Plan` that ranks them, with the count of the rest by reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_npu.planner.memory import StageMemory
from lightning_npu.planner.spec import ClusterSpec, Layout
from lightning_npu.planner.timing import StepTime


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: StageMemory  # the stage that needs the most
    time: StepTime
    tokens_per_s: float
    branches: tuple = ()  # a multi-branch layout's per-tower `branches.cost.BranchCost`s

    def to_dict(self, devices: int, peak_tflops: float) -> dict[str, Any]:
        lay = self.layout
        out = {
            "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero_stage": lay.zero_stage,
                       "micro_batches": lay.micro_batches, "micro_batch_size": lay.micro_batch_size,
                       "activation_checkpointing": lay.recompute, "sequence_parallel": lay.sequence_parallel,
                       "pipeline_schedule": lay.schedule, "virtual_stages": lay.v,
                       "expert_parallel_size": lay.ep, "context_parallel_size": lay.cp},
            "memory_gb": self.memory.as_gb(),
            "memory_stage": self.memory.stage,
            "step_time_s": self.time.step_s,
            "step_time_breakdown_s": {"compute": self.time.compute_s, "tensor_parallel": self.time.tp_comm_s,
                                      "pipeline_bubble_p2p": self.time.pipeline_s,
                                      "data_parallel_exposed": self.time.dp_comm_s},
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.time.tflops_per_device(devices),  # hardware FLOPs (recomputation included)
            "model_tflops_per_device": self.time.model_tflops_per_device(devices),
            "mfu": self.time.mfu(devices, peak_tflops),
            "hfu": self.time.hfu(devices, peak_tflops),
            "strategy": lay.strategy_init_args(),
        }
        if self.branches:
            out["step_time_breakdown_s"]["branches"] = self.time.branch_comm_s
            out["branches"] = [c.to_dict() for c in self.branches]
        return out


@dataclass
class Plan:
    model: Any  # a ModelSpec, or a planner.branches.model.BranchedModel
    cluster: ClusterSpec
    precision: str
    optimizer: str
    ranked: list[Estimate]
    accounting: str = "lightning-npu"
    rejected: Counter = field(default_factory=Counter)  # reason -> number of layouts
    considered: int = 0

    @property
    def best(self) -> Optional[Estimate]:
        return self.ranked[0] if self.ranked else None
