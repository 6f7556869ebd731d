"""All four callbacks together under Lightning's "ddp" and under "npu_hybrid" (2 real processes, gloo):
a NaN on one rank is skipped by every rank, and SIGTERM to one rank saves on every rank and stops them all."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_npu  # noqa: F401  (registers "npu_hybrid")
from lightning_npu.callbacks import DynamicCheckpoint, GradientHealthGuard, PreemptionCheckpoint, TrainingGuard
from lightning_npu.launch import spawn
from tests._callbacks_helpers import StepSeeded, flat_params, trainer_kwargs


def _run(root: str, strategy: str) -> dict:
    model = StepSeeded(nan_at=(2,), nan_ranks=(0,), signal_at=6, signal_rank=0)
    dyn = DynamicCheckpoint(dirpath=str(Path(root) / "ck"), phase_fractions=(), intervals=(4,), keep_last_k=2)
    health, guard, pre = GradientHealthGuard(), TrainingGuard(health_check_interval=2), PreemptionCheckpoint()
    trainer = L.Trainer(callbacks=[dyn, health, guard, pre],
                        **trainer_kwargs(root, 20, devices=2, strategy=strategy, log_every_n_steps=1))
    guard.fit(trainer, model)
    return {
        "rank": trainer.global_rank,
        "step": trainer.global_step,
        "before2": model.param_log[2],
        "before3": model.param_log[3],
        "final": flat_params(model),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "actions": [e["action"] for e in health.events if e["action"] != "warn"],
        "saved": str(pre.saved_path),
        "metrics": sorted(k for k in trainer.callback_metrics if k.startswith("health/")),
    }


@pytest.mark.parametrize("strategy", ["ddp", "npu_hybrid"])
def test_callbacks_under_two_processes(tmp_path, strategy):
    r0, r1 = spawn(_run, 2, str(tmp_path), strategy)
    for r in (r0, r1):
        # the NaN was only on rank 0, yet both ranks skipped step 2 (decision all-reduced)
        torch.testing.assert_close(r["before3"], r["before2"], rtol=0, atol=0)
        assert r["actions"] == ["skip"]
        # SIGTERM reached rank 0 only; both stopped after step 6 with one checkpoint
        assert r["step"] == 7 and r["saved"].endswith("step=00000007.ckpt")
        assert "health/grad_norm" in r["metrics"] and any(m.startswith("health/rss") for m in r["metrics"])
    torch.testing.assert_close(r0["final"], r1["final"], rtol=0, atol=0)
    assert torch.isfinite(r0["final"]).all()
    assert DynamicCheckpoint.find_latest(tmp_path / "ck") == r0["saved"]
    if Path(r0["saved"]).is_dir():  # npu_hybrid writes sharded DCP directories
        from lightning_npu.parallel.checkpoint import consolidate_model_state

        state = consolidate_model_state(r0["saved"])[0]
    else:
        state = torch.load(r0["saved"], weights_only=False)["state_dict"]
    assert sorted(state) == sorted(r0["state"])
    for k, v in r0["state"].items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
