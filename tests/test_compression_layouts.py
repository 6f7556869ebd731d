"""Gradient compression with tensor and pipeline parallelism (4 processes, gloo): the dp reduction alone is
compressed, a glob that compresses nothing changes nothing, and a glob's bytes are what its parameters cost."""

import fnmatch

import pytest

from lightning_npu.launch import spawn
from tests._compression_workers import run_many

STEPS = 3
NOTHING = {"*": None}  # a glob that matches every parameter and compresses none
MLP_BF16 = {"*.mlp.*": "bf16"}  # the blocks' MLPs in bf16, the rest (no glob) uncompressed
LAYOUTS = {
    # tp=2 x dp=2, ZeRO-1 (reduce-scatter buckets), accumulating: compression once per optimizer step
    "tp2_dp2_zero1_acc2": dict(tp=2, zero_stage=1, accumulate=2),
    # tp=2 x dp=2, ZeRO-0: DDP's buckets over the tp shards, cut into glob segments by the comm hook
    "tp2_dp2_zero0": dict(tp=2, zero_stage=0, accumulate=1),
    # pp=2 x dp=2, ZeRO-0 stage buckets, reduced inside the schedule after each stage's last backward
    "pp2_dp2_zero0": dict(pp=2, zero_stage=0, accumulate=1),
    # pp=2 x dp=2, ZeRO-1, accumulating: the stage slices reduce after the schedule, once per optimizer step
    "pp2_dp2_zero1_acc2": dict(pp=2, zero_stage=1, accumulate=2),
}


COMPRESSIONS = (None, NOTHING, MLP_BF16)


@pytest.fixture(scope="module")
def runs():
    """Every layout's three runs in one 4-process launch (start-up and imports paid once): name -> each rank's
    (plain, nothing, mlp) runs."""
    scenarios = [dict(compression=c, steps=STEPS, devices=4, **kw) for kw in LAYOUTS.values() for c in COMPRESSIONS]
    ranks = spawn(run_many, 4, scenarios)
    n = len(COMPRESSIONS)
    return {name: [rank[i * n:(i + 1) * n] for rank in ranks] for i, name in enumerate(LAYOUTS)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compression_under_tp_and_pp(runs, name):
    ranks = runs[name]
    print(name, [(r["bytes"], r["calls"] and sorted(r["calls"].items()), r["losses"][-1]) for r in ranks[0]])
    for rank in ranks:
        plain, nothing, mlp = rank
        # only the dp group carries gradient traffic: tp and pp peers never see a gradient bucket
        for run in rank:
            assert run["groups"] == {run["dp_ranks"]} and len(run["dp_ranks"]) == 2, (run["groups"], run["dp_ranks"])
        # a glob that compresses nothing is the uncompressed run, bit for bit and byte for byte
        assert nothing["losses"] == plain["losses"] and nothing["bytes"] == plain["bytes"]
        assert nothing["calls"] == {}
        # the MLP weights go as bf16: the saving is 2 bytes per local MLP value per optimizer step
        mlp_numel = sum(n for p, n in plain["numel"].items() if fnmatch.fnmatchcase(p.rpartition(".")[0], "*.mlp.*"))
        assert mlp_numel > 0
        assert plain["bytes"] - mlp["bytes"] == STEPS * 2 * mlp_numel, (plain["bytes"], mlp["bytes"], mlp_numel)
        # compressed once per optimizer step, whatever accumulate_grad_batches is
        assert mlp["calls"] and set(mlp["calls"].values()) == {STEPS}, mlp["calls"]
        assert mlp["losses"] == pytest.approx(plain["losses"], rel=1e-2)
        if LAYOUTS[name].get("pp") and LAYOUTS[name]["accumulate"] == 1:  # launched inside the schedule
            assert mlp["launched_early"] and all(n == total > 0 for n, total in mlp["launched_early"]), mlp["launched_early"]
