"""ZeRO 1/2/3 over dp=2 (real processes, gloo): parity with ZeRO 0 under accumulation, no gradient communication on
accumulating micro-steps, per-rank tensor bytes. (Other optimizers under ZeRO: the layout table, tests/test_layouts.py.)"""

import pytest
import torch

from lightning_npu.launch import spawn
from lightning_npu.parallel.config import ParallelConfig
from tests._zero_workers import run_many

RTOL, ATOL = 1e-5, 1e-6  # as in test_foundation_parity: a missing/wrong reduction moves params by ~lr = 3e-3

PARITY = [dict(zero_stage=z, steps=5, accumulate=2) for z in (0, 1, 2, 3)]
# every dim 0 of this model is even: each rank's ZeRO slices are exactly half of every parameter
MEMORY = [dict(zero_stage=z, steps=1, model_kwargs={"n_layer": 4}) for z in (0, 1, 2, 3)]
REFIT = [dict(zero_stage=1, steps=2, refit_steps=2)]


@pytest.fixture(scope="module")
def runs():
    ranks = spawn(run_many, 2, PARITY + MEMORY + REFIT)
    n, m = len(PARITY), len(PARITY) + len(MEMORY)
    return {"parity": [r[:n] for r in ranks], "memory": [r[n:m] for r in ranks], "refit": [r[m:] for r in ranks]}


def test_a_second_fit_of_the_same_model_reduces_each_bucket_once(runs):
    """A new Trainer fitting the same module (fine-tuning stages, notebooks): the first fit's ZeRO-1 bucket hooks
    are removed at its end, so the second fit reduces each bucket once (they doubled every fit before)."""
    for rank in range(2):
        (got,) = runs["refit"][rank]
        assert got["grad_hooks"] == [1, 1]  # per parameter, during the second fit
        assert got["refit_reductions"] == got["reduce_scatters"][:2], got


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda msg: f"{k}: {msg}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_zero0_with_accumulation_and_scheduler(runs, stage):
    ref = runs["parity"][0][0]
    for rank in range(2):
        got = runs["parity"][rank][stage]
        assert len(got["logged"]) == 10  # 5 optimizer steps x 2 accumulated micro-batches
        torch.testing.assert_close(torch.tensor(got["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
        assert got["lr"] == ref["lr"]  # the warmup scheduler drove the sharded optimizer
        assert_same_params(got["params"], ref["params"])
    assert ref["logged"][-1] < ref["logged"][0]
    assert runs["parity"][0][stage]["optimizer"] == ("DistributedOptimizer" if stage == 1 else "MixedPrecisionOptimizer")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_gradient_communication_on_accumulating_micro_steps(runs, stage):
    counts = runs["parity"][0][stage]["reduce_scatters"]
    assert counts[0::2] == [0] * 5, counts  # accumulating micro-steps: nothing reduced
    assert all(c > 0 for c in counts[1::2]), counts  # the stepping micro-step reduce-scatters


def test_per_rank_bytes_halve_by_stage(runs):
    for rank in range(2):
        z0, z1, z2, z3 = runs["memory"][rank]
        full_params = z0["param_bytes_rest"][-1]
        full_grads = z0["grad_bytes"][-1]
        full_optim = z0["optim_bytes"][-1]
        assert full_optim > 1.9 * full_params  # Adam: two fp32 moments per parameter
        # ZeRO 1: optimizer state halves; parameters stay whole; the optimizer steps with the reduce-scattered
        # half of the gradients, and the full local gradients were freed bucket by bucket during backward
        assert z1["optim_bytes"][-1] == pytest.approx(full_optim / 2, rel=0.02)
        assert z1["param_bytes_rest"][-1] == full_params and z1["param_bytes_fwd"][-1] == full_params
        assert z1["step_grad_bytes"][-1] == pytest.approx(full_grads / 2, rel=0.02)
        # the model's `.grad` shows that half as DTensor views of the same storage (counted here, not allocated):
        # tests/test_lightning_native.py checks that they share it
        assert z1["grad_bytes"][-1] == pytest.approx(full_grads / 2, rel=0.02)
        assert z0["step_grad_bytes"][-1] == full_grads
        # ZeRO 2: + gradients halve; forward keeps the gathered parameters for backward
        assert z2["optim_bytes"][-1] == pytest.approx(full_optim / 2, rel=0.02)
        assert z2["grad_bytes"][-1] == pytest.approx(full_grads / 2, rel=0.02)
        assert z2["param_bytes_fwd"][-1] == full_params
        # ZeRO 3: + parameters halve, also between forward and backward
        assert z3["optim_bytes"][-1] == pytest.approx(full_optim / 2, rel=0.02)
        assert z3["grad_bytes"][-1] == pytest.approx(full_grads / 2, rel=0.02)
        assert z3["param_bytes_rest"][-1] == pytest.approx(full_params / 2, rel=0.02)
        assert z3["param_bytes_fwd"][-1] == pytest.approx(full_params / 2, rel=0.02)


def test_zero23_with_pp_is_accepted():
    # zero 2/3 with tp > 1 works (tests/test_zero_tp.py), with pp > 1 too (tests/test_pipeline_zero.py)
    assert ParallelConfig(zero_stage=3, pipeline_parallel_size=2).pipeline_parallel_size == 2


def test_zero1_refuses_non_elementwise_optimizers():
    from lightning_npu.parallel.optim.distributed import DistributedOptimizer

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"element-wise optimizers .* Adafactor is not one of them. Use zero_stage=0"):
        DistributedOptimizer(torch.optim.Adafactor(model.parameters()), model, mesh=None)
