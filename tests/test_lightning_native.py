"""Lightning's DDP tests ported to ``npu_hybrid`` (CPU/gloo, real processes): gradients in the hooks, the grad_norm
recipe, unused parameters and gradient accumulation, in ZeRO 0-3 and tp=2 (tests/_lightning_native_workers.py)."""

from __future__ import annotations

import pytest
import torch

from tests._layouts import launch_calls
from tests._lightning_native_workers import STEPS, fit_lr_monitor, run_group

RTOL, ATOL = 1e-5, 1e-6
DP_LAYOUTS = [
    ("zero0", {"zero_stage": 0, "find_unused_parameters": True}, "32-true", True),
    ("zero1", {"zero_stage": 1}, "32-true", True),
    ("zero2", {"zero_stage": 2}, "32-true", True),
    ("zero3", {"zero_stage": 3}, "32-true", True),
    ("zero1-bf16-true", {"zero_stage": 1}, "bf16-true", True),
    ("zero0-bf16-true", {"zero_stage": 0, "find_unused_parameters": True}, "bf16-true", True),
]
TP_PLAN = {"layer.0": "colwise", "layer.2": "rowwise"}
# tp=2 on 2 processes is dp=1, where zero_stage=1 has nothing to shard and runs as zero 0 (DDP): the dp2 x tp2
# ZeRO-1 gradients are checked by tests/test_layouts.py (lightning_npu.grad_norm against the global norm)
TP_LAYOUTS = [
    ("tp2-zero0", {"tensor_parallel_size": 2, "zero_stage": 0, "tp_plan": TP_PLAN, "find_unused_parameters": True},
     "32-true", True),
    ("tp2-zero3", {"tensor_parallel_size": 2, "zero_stage": 3, "tp_plan": TP_PLAN}, "32-true", True),
]
USED = ["layer.0.weight", "layer.0.bias", "layer.2.weight", "layer.2.bias"]
# LearningRateMonitor + step-interval StepLR (issue 14), fitted in the same launch as DP_LAYOUTS
LR_LAYOUTS = [("ddp", "ddp", "32-true"), ("zero1", {"zero_stage": 1}, "32-true"), ("zero3", {"zero_stage": 3}, "32-true"),
              ("zero1-bf16-mixed", {"zero_stage": 1}, "bf16-mixed")]
LR_EXPECTED = {"lr-AdamW/pg1": [0.1, 0.05, 0.025, 0.0125], "lr-AdamW/pg2": [0.05, 0.025, 0.0125, 0.00625]}


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=msg)


def check_fp32(name: str, ranks: list[dict], synced_across_ranks: bool) -> None:
    ref = ranks[0][name]["ref"]
    for rank, got in enumerate(ranks):
        seen = got[name]["seen"]
        for hook in ("after_backward", "before_step", "after_step"):
            assert len(seen[hook]) == STEPS, (name, hook)
            for step, grads in enumerate(seen[hook]):
                # every used parameter shows its reduced gradient: the 1-process gradient of the global batch
                for n in USED:
                    assert n in grads, f"{name} rank {rank} {hook} step {step}: {n}.grad is None"
                    close(grads[n], ref["grads"][step][n], f"{name} rank {rank} {hook} step {step} {n}")
                if synced_across_ranks:  # test_ddp_gradients_synced: the same on every dp rank
                    for n, g in ranks[0][name]["seen"][hook][step].items():
                        assert torch.equal(g, grads[n]), f"{name} {hook} step {step} {n}"
        # the grad_norm recipe logs the global norm (what one process computes), unchanged by sync_dist
        close(torch.tensor(seen["logged"]), torch.tensor(ref["norms"]), f"{name} rank {rank} logged grad norm")
        for key, value in ref["state"].items():  # accumulation with p.grad visible: exact parity
            close(got[name]["state"][key], value, f"{name} rank {rank} {key}")


@pytest.fixture(scope="module")
def dp2() -> dict:
    """The module's 2-process runs in one launch (start-up and imports paid once): the dp layouts (with the
    unused-parameter check and the LR-monitor runs), then the tp layouts; per group, each rank's results."""
    dp, tp = launch_calls(2, [(run_group, dict(layouts=DP_LAYOUTS, unused_check=True, lr_layouts=LR_LAYOUTS)),
                              (run_group, dict(layouts=TP_LAYOUTS, unused_check=False))])
    return {"dp": dp, "tp": tp}


@pytest.mark.timeout(420)  # the module's one launch runs inside the first test that asks for it: 240 s + 180 s
def test_dp_zero_stages(dp2):
    ranks = dp2["dp"]
    for name in ("zero0", "zero1", "zero2", "zero3"):
        check_fp32(name, ranks, synced_across_ranks=True)
    for rank in ranks:
        # Lightning's own grad_norm works where gradients are plain tensors (zero 0) and agrees
        close(torch.tensor(rank["zero0"]["seen"]["lightning_total"]), torch.tensor(rank["zero0"]["ref"]["norms"]))
        assert rank["zero1"]["seen"]["views_bucket"] == [True] * STEPS  # 1/dp gradient memory: views, no copies
        kinds = rank["zero1"]["seen"]["kinds"][0]
        assert kinds["layer.0.weight"] == ("DTensor", "torch.float32")
        # unused parameters: ZeRO-1 reduces a zero gradient, FSDP2 (2/3) and DDP with the flag leave it None
        assert "unused.weight" in rank["zero1"]["seen"]["before_step"][0]
        torch.testing.assert_close(rank["zero1"]["seen"]["before_step"][0]["unused.weight"],
                                   torch.zeros(4, 32))
        for name in ("zero0", "zero2", "zero3"):
            assert "unused.weight" not in rank[name]["seen"]["before_step"][0], name
        # *-true: a 16-bit copy of the (unscaled) fp32 main gradient, in every hook
        for name, kind in (("zero1-bf16-true", "DTensor"), ("zero0-bf16-true", "Tensor")):
            seen = rank[name]["seen"]
            assert seen["kinds"][0]["layer.0.weight"] == (kind, "torch.bfloat16"), name
            for hook in ("after_backward", "before_step", "after_step"):
                assert len(seen[hook]) == STEPS and all(set(USED) <= set(g) for g in seen[hook]), (name, hook)
            assert seen["logged"][0] > 0
        # zero 0 is DDP: without the flag, Lightning's message names it
        assert "find_unused_parameters" in rank["unused_without_flag"]
        check_lr_monitor(rank)


def check_lr_monitor(rank: dict) -> None:
    """Exactly Lightning's keys and values (one ``lr-AdamW`` per param group, decayed as scheduled); the schedule is
    the one stepped (parameters equal "ddp"'s); no scheduler-order warning; the scheduler holds the user's AdamW,
    whose param_groups are the Trainer's optimizer's, which show the model's parameters."""
    ddp = rank["lr-ddp"]
    assert ddp["lrs"] == LR_EXPECTED
    for name, *_ in LR_LAYOUTS[1:]:
        got = rank[f"lr-{name}"]
        assert got["lrs"] == ddp["lrs"], name
        assert got["order_warnings"] == [] and got["scheduler_on_user_optimizer"] and got["groups_shared"], name
        assert got["shows_model_params"], name  # as under DDP (BaseFinetuning finds its groups by them)
        if "bf16" not in name:
            for key, value in ddp["state"].items():
                close(got["state"][key], value, f"{name} {key}")
    assert rank["lr-zero1"]["wrapper"] == "DistributedOptimizer"


def test_lr_monitor_one_process_matches_auto(tmp_path):
    """One device: the same LearningRateMonitor keys and values as Lightning's "auto", in the CSV log too (parameter
    parity is checked against "ddp" in test_dp_zero_stages: "auto" reads the data in another order)."""
    got = {s: fit_lr_monitor(s, devices=1, root=str(tmp_path / s)) for s in ("auto", "npu_hybrid")}
    assert got["auto"]["lrs"] == got["npu_hybrid"]["lrs"] == LR_EXPECTED
    hybrid = got["npu_hybrid"]
    assert hybrid["order_warnings"] == [] and hybrid["scheduler_on_user_optimizer"] and hybrid["groups_shared"]
    header = {s: (tmp_path / s).joinpath(got[s]["log_dir"], "metrics.csv").read_text().splitlines()[0].split(",")
              for s in got}
    assert header["npu_hybrid"] == header["auto"] and {"lr-AdamW/pg1", "lr-AdamW/pg2"} <= set(header["auto"])


@pytest.mark.timeout(420)
def test_tp2(dp2):
    ranks = dp2["tp"]
    for name, *_ in TP_LAYOUTS:
        # tp=2, dp=1: p.grad is this rank's tp shard (a plain local shard under zero 0/1, a DTensor under zero 3);
        # the gathered gradient and lightning_npu.grad_norm are the global ones
        check_fp32(name, ranks, synced_across_ranks=False)
    # Lightning's own grad_norm on a local tp shard is that shard's norm, not the parameter's
    local = ranks[0]["tp2-zero0"]["seen"]["lightning_total"][0]
    assert local < ranks[0]["tp2-zero0"]["ref"]["norms"][0] * (1 - 1e-3)
