"""Pipeline-parallel checkpoints: per-stage DCP directories that a resumed run continues exactly (fp32). (Pipeline
schedules, clipping, accumulation, predictions and 3D layouts against one process: the layout table,
tests/test_layouts.py.)"""

from functools import partial

import torch

from lightning_npu.launch import spawn
from tests._layouts import PP, PP2, Layout, run_layout

# as tests/test_foundation_parity.py: fp32 rtol 1e-5, atol 1e-6 on parameters (~0.02); a wrong gradient moves
# parameters by ~lr = 3e-3, three orders above this bound
RTOL, ATOL = 1e-5, 1e-6


def test_pp2_resume_matches_uninterrupted(tmp_path):
    """Per-stage DCP checkpoints every 3 steps; resuming from step 3 repeats steps 4-6 exactly."""
    pp = Layout("pp2", 2, {**PP2, "micro_batches": 2}, checks=(), model=PP, clip=None)
    full = spawn(partial(run_layout, steps=6, ckpt_dir=str(tmp_path), limit_train_batches=3), 2, pp)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.is_dir(), sorted(p.name for p in tmp_path.iterdir())
    resumed = spawn(partial(run_layout, steps=6, ckpt_in=str(ckpt), limit_train_batches=3), 2, pp)
    assert resumed[0]["global_step"] == 6
    for r_full, r_res in zip(full, resumed):
        torch.testing.assert_close(torch.tensor(r_res["logged"]), torch.tensor(r_full["logged"][3:]), rtol=RTOL, atol=0)
        assert r_res["state"].keys() == r_full["state"].keys()
        for k in r_full["state"]:
            torch.testing.assert_close(r_res["state"][k], r_full["state"][k], rtol=RTOL, atol=ATOL)
