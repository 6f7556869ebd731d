"""The layout table (tests/_layouts.py): each row trained in real processes against one process."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_npu.launch import spawn
from tests._layouts import LAYOUTS, REFERENCE, run_layout

RTOL, ATOL = 1e-5, 1e-6  # fp32 parity, as everywhere (see tests/_gpt_workers.py for atol on parameters)
NORM_RTOL = 1e-4  # the bound for the guard's norm against the one-process norm


@functools.cache
def reference(precision: str) -> dict:
    return spawn(run_layout, 1, REFERENCE[precision])[0]


@pytest.mark.parametrize("layout", [pytest.param(x, id=x.name, marks=[pytest.mark.slow] if x.devices > 2 else [])
                                    for x in LAYOUTS])
def test_layout(layout):
    ranks = spawn(run_layout, layout.devices, layout)
    ref = reference(layout.precision)
    for rank, got in enumerate(ranks):
        rows, ref_rows = got["rows"], ref["rows"]
        assert len(rows) == len(ref_rows) > 0
        if "guard" in layout.checks:
            guard = torch.tensor([r["health/grad_norm"] for r in rows])
            clipped = torch.tensor([r["grad_norm"] for r in rows])
            torch.testing.assert_close(guard, clipped, rtol=1e-6, atol=0)  # one statistics function
            # what the hooks see as p.grad (dp slices, tp shards, pipeline stages) gives the same global norm
            torch.testing.assert_close(torch.tensor([r["npu_grad_norm"] for r in rows]), guard, rtol=1e-5, atol=0)
            # the 1-process global norm: at step 1 exactly the same model; later steps follow the same trajectory
            # (fp32) or a close one (bf16: first step only)
            expected = torch.tensor([r["health/grad_norm"] for r in ref_rows])
            n = len(rows) if layout.precision == "32-true" else 1
            torch.testing.assert_close(guard[:n], expected[:n], rtol=NORM_RTOL if n > 1 else 2e-2, atol=0)
        if "guard_loss" in layout.checks:
            torch.testing.assert_close(torch.tensor([r["health/loss"] for r in rows]),
                                       torch.tensor([r["train_loss"] for r in rows]), rtol=1e-6, atol=1e-6)
        if "parity" in layout.checks:
            torch.testing.assert_close(torch.tensor([r["train_loss"] for r in rows]),
                                       torch.tensor([r["train_loss"] for r in ref_rows]), rtol=RTOL, atol=ATOL)
            assert got["state"].keys() == ref["state"].keys(), f"rank {rank}"
            for key, value in ref["state"].items():
                torch.testing.assert_close(got["state"][key], value, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: {key}")
            assert got["optimizer"].keys() == ref["optimizer"].keys(), f"rank {rank}"
            for index, entry in ref["optimizer"].items():  # AdamW's moments, fused projections un-fused
                for name, value in entry.items():
                    torch.testing.assert_close(got["optimizer"][index][name], value, rtol=RTOL, atol=ATOL,
                                               msg=f"rank {rank}: optimizer state {index}.{name}")
        if "full_state" in layout.checks:
            assert got["round_trip_error"] == 0.0, f"rank {rank}"
