"""Plan a layout before launching: memory per rank and step time of every tp x pp x dp x ZeRO layout of a
decoder-only transformer on a cluster (or of each tower of a multi-branch model such as CLIP at its own tp:
`branches`), ranked by estimated tokens/s (`plan`), and the model-state bytes of one ZeRO stage
(`model_state_bytes`). Pure arithmetic on the sizes; see docs/planning.md for the models' assumptions and their
validation against published runs and our own."""

from lightning_npu.planner.branches.model import BranchedModel, Tower, clip_model
from lightning_npu.planner.memory import GB, PRECISION_BYTES, memory_by_stage, model_state_bytes, round_gb
from lightning_npu.planner.read import model_from_config
from lightning_npu.planner.result import Estimate, Plan
from lightning_npu.planner.search import plan
from lightning_npu.planner.spec import BranchChoice, ClusterSpec, Layout, ModelSpec, PlannerError
from lightning_npu.planner.timing import flops_per_token, step_time

__all__ = [
    "GB", "PRECISION_BYTES", "BranchChoice", "BranchedModel", "ClusterSpec", "Estimate", "Layout", "ModelSpec",
    "Plan", "PlannerError", "flops_per_token", "memory_by_stage", "model_from_config", "model_state_bytes", "plan",
    "round_gb",
    "step_time", "Tower", "clip_model",
]
