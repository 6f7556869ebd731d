"""Ordinary model shapes under every ZeRO stage (real processes, gloo): one 2-process launch, one 1-process reference.

- parameters the LightningModule holds itself (a GPT's ``self.pos``, ViT's ``pos_embed``) under zero 0-3, with
  tp=2, and held by a pipeline stage's embedding module under pp=2: losses and full state equal one process's;
  DCP save/resume, the same checkpoint as one Lightning file, and the full-state API;
- BatchNorm buffers under zero 0-3 equal Lightning's ``"ddp"`` (which broadcasts rank 0's before each forward).
"""

import pytest
import torch

from lightning_npu.launch import spawn
from tests._zero_shapes_workers import BatchNormNet, PosGPT, run_all, run_reference

RTOL, ATOL = 1e-5, 1e-6
ROOT_LAYOUTS = ["dp-zero0", "dp-zero1", "dp-zero2", "dp-zero3", "tp2-zero3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = spawn(run_all, 2, str(tmp_path_factory.mktemp("zero_shapes")))
    return ranks, spawn(run_reference, 1)[0]


def assert_same_state(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("name", ROOT_LAYOUTS + ["pp2-zero3-embed"])
def test_parameters_held_directly_match_one_process(runs, name):
    ranks, refs = runs
    ref = refs["embed" if name.endswith("embed") else "root"]
    assert ref["logged"][-1] < ref["logged"][0]
    for rank in range(2):
        got = ranks[rank][name]
        torch.testing.assert_close(torch.tensor(got["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
        assert_same_state(got["state"], ref["state"])
        if "val_loss" in got:  # evaluation after fit runs through the root unit's hooks too
            assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL)


def test_root_unit_shards_what_the_lightning_module_holds(runs):
    ranks, _ = runs
    for name in ("dp-zero2", "dp-zero3"):
        got = ranks[0][name]
        assert got["root_unit"] and got["pos_local_rows"] == 16  # 32 rows of `pos` over dp=2
        assert got["round_trip_error"] < 1e-6  # load_full_state_dict / full_state_dict
    assert ranks[0]["tp2-zero3"]["root_unit"] and ranks[0]["tp2-zero3"]["pos_local_rows"] == 32  # dp=1
    assert not ranks[0]["dp-zero1"]["root_unit"] and not ranks[0]["dp-zero0"]["root_unit"]


def test_every_stage_reduces_gradients_through_reduce_bucket(runs):
    # FSDP2's per-unit reduce-scatter too (FSDPModule.set_custom_reduce_scatter): 6 units x 4 steps
    # (wte, h.0, h.1, ln_f, lm_head, and the root unit holding `pos`)
    ranks, _ = runs
    counts = {z: ranks[0][f"dp-zero{z}"]["bucket_reductions"] for z in (0, 1, 2, 3)}
    assert counts[2] == counts[3] == 6 * 4, counts
    assert counts[0] > 0 and counts[1] > 0, counts


def test_checkpoint_resume_with_a_root_unit(runs):
    ranks, _ = runs
    for rank in range(2):
        full = ranks[rank]["zero3-6"]
        for name in ("zero3-resumed", "zero1-from-dir"):
            got = ranks[rank][name]
            # steps 4-6 after restoring step 3 (model and AdamW state) equal the uninterrupted run's
            torch.testing.assert_close(torch.tensor(got["logged"]), torch.tensor(full["logged"][3:]), rtol=RTOL,
                                       atol=0, msg=lambda m: f"{name}: {m}")
            assert_same_state(got["state"], full["state"])
        # Lightning "ddp"'s single file resumed under zero 1 continues as "ddp" itself continues it
        assert ranks[rank]["single_file"]
        got, ref = ranks[rank]["zero1-from-file"], ranks[rank]["ddp-from-file"]
        torch.testing.assert_close(torch.tensor(got["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
        assert_same_state(got["state"], ref["state"])


@pytest.mark.parametrize("name", ["bn-zero0", "bn-zero1", "bn-zero2", "bn-zero3", "bn-zero3-accumulate"])
def test_buffers_match_lightning_ddp(runs, name):
    ranks, _ = runs
    ddp_name = "bn-ddp-accumulate" if name.endswith("accumulate") else "bn-ddp"
    for rank in range(2):
        got, ddp = ranks[rank][name], ranks[rank][ddp_name]
        assert_same_state(got["buffers"], ddp["buffers"])
        assert_same_state(got["params"], ddp["params"])
    # after the last training step, validation's first forward broadcast rank 0's: the ranks agree
    assert_same_state(ranks[1][name]["buffers"], ranks[0][name]["buffers"])
    # the ranks' data differ: without the broadcast rank 1's statistics would not be rank 0's
    fresh = BatchNormNet().bn.running_mean
    assert (ranks[0][name]["buffers"]["bn.running_mean"] - fresh).abs().max() > 0.1


@pytest.mark.parametrize("stage", [1, 3])
def test_scalar_parameters_stay_whole_and_reshard(runs, stage):
    """A 0-dim parameter under zero 1 and 3: replicated and all-reduced as under DDP, so training equals one
    process's; its DCP checkpoint resumes under the other stage as the uninterrupted run continues."""
    ranks, refs = runs
    ref = refs["scalar-6"]
    assert abs(ref["state"]["temperature"].item() - 1.0) > 1e-3  # it trained
    for rank in range(2):
        got = ranks[rank][f"scalar-zero{stage}-6"]
        torch.testing.assert_close(torch.tensor(got["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
        assert_same_state(got["state"], ref["state"])
        other = 3 if stage == 1 else 1
        resumed = ranks[rank][f"scalar-zero{other}-from-zero{stage}"]
        torch.testing.assert_close(torch.tensor(resumed["logged"]), torch.tensor(got["logged"][3:]), rtol=RTOL, atol=0)
        assert_same_state(resumed["state"], got["state"])


def test_pipeline_zero23_refuses_scalar_parameters_naming_them():
    from lightning_npu.parallel.data_parallel.wrap import check_no_scalar_parameters

    model = PosGPT(scalar=True)
    with pytest.raises(ValueError, match=r"zero_stage=3 with pipeline parallelism .* temperature is a 0-dim "
                                         r"parameter; use zero_stage=0 or 1"):
        check_no_scalar_parameters(model, 3)
