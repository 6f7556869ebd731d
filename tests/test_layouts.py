"""The layout table (tests/_layouts.py): each row trained in real processes against one process.

Rows with the same number of processes train in one spawn, and every reference in another: a spawn costs
seconds, a row's training less.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_npu.launch import spawn
from tests._layouts import LAYOUTS, STEPS, Layout, references, run_layouts

# fp32 parity: rtol 1e-5, plus atol 1e-6 on parameters (~0.02 in size) so Adam's first steps, which turn 1e-7
# gradient rounding differences into near-lr-sized updates on tiny gradients, do not flake. A missing or wrong
# reduction, shard or q/k/v slice moves parameters by ~lr = 3e-3, three orders above this bound.
RTOL, ATOL = 1e-5, 1e-6


@functools.cache
def _references() -> dict[tuple, dict]:
    refs = references(LAYOUTS)
    return {ref.reference_key(): got for ref, got in zip(refs, spawn(run_layouts, 1, refs)[0])}


def reference(layout: Layout) -> dict:
    return _references()[layout.reference_key()]


@functools.cache
def _group(devices: int) -> dict[str, list[dict]]:
    rows = [x for x in LAYOUTS if x.devices == devices]
    ranks = spawn(run_layouts, devices, rows)
    return {row.name: [rank[i] for rank in ranks] for i, row in enumerate(rows)}


def _params(rows):
    return [pytest.param(x, id=x.name, marks=[pytest.mark.slow] if x.devices > 2 else []) for x in rows]


@pytest.mark.parametrize("ref", _params(references(LAYOUTS)))
def test_reference(ref):
    """What the rows are compared with: it trained, and clipping was active on every step with torch's norm."""
    got = reference(ref)
    assert got["global_step"] == STEPS and len(got["rows"]) == STEPS
    assert got["logged"][-1] < got["logged"][0]
    if ref.clip is not None:
        clipped = torch.tensor([r["grad_norm"] for r in got["rows"]])
        assert (clipped > ref.clip).all(), clipped
        torch.testing.assert_close(clipped, torch.tensor([r["torch_grad_norm"] for r in got["rows"]]), rtol=RTOL, atol=0)


def _check_expect(layout: Layout, ranks: list[dict], ref: dict) -> None:
    expect = layout.expect
    if "mesh" in expect:
        assert [r["mesh"] for r in ranks] == [expect["mesh"]] * len(ranks)
    if "optimizer" in expect:
        assert {r["optimizer"] for r in ranks} == {expect["optimizer"]}
    if "stages" in expect:
        assert [r["stages"] for r in ranks] == expect["stages"]
    if expect.get("sharded"):
        assert all(r["sharded"] for r in ranks)
    if expect.get("fully_sharded"):
        assert all(r["fully_sharded"] for r in ranks)
    for unit in expect.get("no_fsdp_units", ()):
        assert all(unit not in r["fsdp_units"] for r in ranks)
    for name, placement in expect.get("placements", {}).items():  # on every rank that holds the parameter
        held = [r["placements"][name] for r in ranks if name in r["placements"]]
        assert held and set(held) == {placement}, (name, held)
    for line in expect.get("report", ()):
        assert line in ranks[0]["report"], ranks[0]["report"]
    if "local_numel_below" in expect:
        assert all(r["local_numel"] < expect["local_numel_below"] * ref["local_numel"] for r in ranks)
    if expect.get("local_differs"):
        assert ranks[0]["local"] != ranks[1]["local"]
    if expect.get("disjoint_stages"):
        assert all(a["local_keys"] and set(a["local_keys"]).isdisjoint(b["local_keys"])
                   for i, a in enumerate(ranks) for b in ranks[i + 1:])
        assert set().union(*(r["local_keys"] for r in ranks)) == set(ref["local_keys"])
        assert sum(r["local_numel"] for r in ranks) == ref["local_numel"]
        assert "model.transformer.wte.weight" in ranks[0]["local_keys"]
        assert "model.lm_head.weight" in ranks[-1]["local_keys"]


@pytest.mark.parametrize("layout", _params(LAYOUTS))
def test_layout(layout):
    ranks, ref = _group(layout.devices)[layout.name], reference(layout)
    _check_expect(layout, ranks, ref)
    for rank, got in enumerate(ranks):
        rows, ref_rows = got["rows"], ref["rows"]
        assert got["global_step"] == STEPS and len(rows) == len(ref_rows) == STEPS
        assert len(got["logged"]) == STEPS * layout.accumulate
        if "guard" in layout.checks:
            guard = torch.tensor([r["health/grad_norm"] for r in rows])
            clipped = torch.tensor([r["grad_norm"] for r in rows])
            torch.testing.assert_close(guard, clipped, rtol=1e-6, atol=0)  # one statistics function
            # what the hooks see as p.grad (dp slices, tp shards, pipeline stages) gives the same global norm
            torch.testing.assert_close(torch.tensor([r["npu_grad_norm"] for r in rows]), guard, rtol=1e-5, atol=0)
            # torch's norm of the full gradients in one process: every step (fp32: the same trajectory); bf16: the
            # first step (same model)
            expected = torch.tensor([r["torch_grad_norm"] for r in ref_rows])
            n, rtol = (STEPS, RTOL) if layout.precision == "32-true" else (1, 2e-2)
            torch.testing.assert_close(clipped[:n], expected[:n], rtol=rtol, atol=0)
            torch.testing.assert_close(guard[:n], expected[:n], rtol=rtol, atol=0)
        if "guard_loss" in layout.checks:
            torch.testing.assert_close(torch.tensor([r["health/loss"] for r in rows]),
                                       torch.tensor([r["train_loss"] for r in rows]), rtol=1e-6, atol=1e-6)
        if "parity" in layout.checks:
            # the logged (dp-synced; pipeline: the last stage's) loss; accumulated micro-batches average to the step's
            logged = torch.tensor(got["logged"]).view(STEPS, layout.accumulate).mean(1)
            torch.testing.assert_close(logged, torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
            assert got["lr"][layout.accumulate - 1 :: layout.accumulate] == ref["lr"]  # the scheduler drove it
            assert got["state"].keys() == ref["state"].keys(), f"rank {rank}"
            for key, value in ref["state"].items():
                assert got["state"][key].shape == value.shape, key
                torch.testing.assert_close(got["state"][key], value, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: {key}")
            assert got["optimizer_state"].keys() == ref["optimizer_state"].keys(), f"rank {rank}"
            for index, entry in ref["optimizer_state"].items():  # AdamW's moments, fused projections un-fused
                for name, value in entry.items():
                    torch.testing.assert_close(got["optimizer_state"][index][name], value, rtol=RTOL, atol=ATOL,
                                               msg=f"rank {rank}: optimizer state {index}.{name}")
            if layout.accumulate == 1:  # (else the two validation batches are smaller: other samples)
                assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL)
        if "full_state" in layout.checks:
            assert got["round_trip_error"] == 0.0, f"rank {rank}"
    if "predict" in layout.checks:
        preds = [r for r in ranks if r["logits"] is not None]
        assert preds, "no rank returned predictions"
        dp = ranks[0]["mesh"][1]
        for r in preds:  # the predict loader's DistributedSampler gives dp rank d the samples d, d+dp, ...
            torch.testing.assert_close(r["logits"], ref["logits"][r["dp_rank"]::dp], rtol=1e-4, atol=1e-5)
