"""Module-level workers for ZeRO 2/3 x tensor parallelism x sequence parallelism (run by `launch.spawn`).

Like `tests._zero_tp_workers`, one spawned process group runs several Trainers in sequence, so the
4-process start-up is paid once per test module. These workers also take the precision and model
options sequence parallelism interacts with, and record what the sequence-parallel norms saw.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning as L
import torch

import lightning_npu  # noqa: F401
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.data_parallel import wrap as data_parallel
from tests._gpt_workers import LossRecorder, full_state, parity_trainer
from tests._tp_workers import _make_model
from tests._zero_workers import _world


def _record_norm_weight_dtypes(model: torch.nn.Module) -> set[str]:
    """The dtype of every norm weight as its forward sees it (after FSDP2 gathered it; FSDP2's hook runs first)."""
    seen: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.register_forward_pre_hook(lambda m, args: seen.add(str(m.weight.dtype)))
    return seen


def train_zero_sp(
    strategy_kwargs: dict[str, Any],
    steps: int,
    global_batch: int = 8,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    limit_train_batches: Optional[int] = None,
    precision: str = "32-true",
    seed: int = 0,
) -> dict[str, Any]:
    devices = _world()
    L.seed_everything(seed, verbose=False)
    strategy = NPUHybridStrategy(**strategy_kwargs)
    model = _make_model("gpt", None)
    norm_dtypes = _record_norm_weight_dtypes(model)
    recorder = LossRecorder()
    trainer, data = parity_trainer(
        strategy, model, devices, global_batch, steps, [recorder], ckpt_dir, limit_train_batches, precision=precision
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    return {
        "logged": recorder.logged,
        "state": full_state(model),
        "global_step": trainer.global_step,
        "mesh": tuple(trainer.strategy.device_mesh.mesh.shape),
        "fsdp_units": sorted(type(m).__name__ for m in data_parallel.fsdp_modules(model)),
        "norm_weight_dtypes": sorted(norm_dtypes),
        "warnings": [str(w.message) for w in caught],
        "report": str(trainer.strategy.tp_report) if trainer.strategy.tp_report is not None else None,
    }


def run_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_zero_sp(**c) for c in configs]


def sp_norm_grad_check(stages: list[int], seed: int = 0) -> dict[int, dict[str, Any]]:
    """A sequence-parallel LayerNorm under FSDP2 with bf16 parameter gathering, on a (dp=2, tp=2) mesh.

    Each tp rank sees half of the sequence, so the weight gradient is a partial sum over tp that FSDP2
    all-reduces before its reduce-scatter. Returns the reduced gradient and output next to an fp32
    single-process reference: they agree to fp32 rounding only if that reduction (and the norm) is fp32.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {stage: _sp_norm_grad(mesh, stage, seed) for stage in stages}
    dist.barrier()
    dist.destroy_process_group()
    return results


def _sp_norm_grad(mesh: Any, zero_stage: int, seed: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_npu.parallel.tensor_parallel.styles import _sequence_parallel_style

    torch.manual_seed(seed)
    b, t, c = 2, 8, 16
    x = torch.randn(b, t, c) * 3 + 1
    upstream = torch.randn(b, t, c)
    model = torch.nn.Module()
    model.norm = torch.nn.LayerNorm(c, bias=False)
    with torch.no_grad():
        model.norm.weight.copy_(torch.rand(c) + 0.5)
    ref = torch.nn.LayerNorm(c, bias=False)
    ref.load_state_dict(model.norm.state_dict())
    ref_out = ref(x)
    (ref_out * upstream).sum().backward()

    parallelize_module(model, mesh["tp"], {"norm": _sequence_parallel_style("norm", model.norm)})
    data_parallel.fully_shard_data_parallel(model, mesh, zero_stage, param_dtype=torch.bfloat16)
    tp_rank, half = mesh["tp"].get_local_rank(), t // 2
    rows = slice(tp_rank * half, (tp_rank + 1) * half)
    out = model.norm(x[:, rows])  # the same batch on both dp ranks: the dp mean is this gradient
    (out.float() * upstream[:, rows]).sum().backward()
    grad = model.norm.weight.grad
    return {
        "out": out.detach().float(), "ref_out": ref_out[:, rows].detach(),
        "grad": grad.full_tensor(), "ref_grad": ref.weight.grad.detach(),
        "grad_dtype": str(grad.dtype), "grad_placements": str(grad.placements),
        "units": sorted(type(m).__name__ for m in data_parallel.fsdp_modules(model)),
    }
