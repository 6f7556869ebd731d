"""Sharded DCP checkpoints: resume under another layout, async save, atomicity, clear mismatch errors,
consolidation with `lightning-npu convert-checkpoint`."""


import pytest
import torch

from lightning_npu.launch import spawn
from tests._layouts import launch_calls
from tests._zero_workers import crash_and_mismatch, run_many

RTOL, ATOL = 1e-5, 1e-6
STEP3 = "epoch=0-step=3.ckpt"  # ModelCheckpoint's name; with 3 batches per epoch it is an epoch boundary


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    a, c, e = root / "zero1", root / "zero3_async", root / "zero1_async"
    configs = [
        dict(zero_stage=1, steps=3, ckpt_dir=str(a), limit_train_batches=3, with_optimizer_state=True),
        dict(zero_stage=1, steps=6, limit_train_batches=3),
        # layout B: zero 1 -> zero 3
        dict(zero_stage=3, steps=6, ckpt_in=str(a / STEP3), limit_train_batches=3),
        # async save under zero 3 (the step-3 shards are written while steps 4-6 run), resumed under zero 0
        dict(zero_stage=3, steps=6, ckpt_dir=str(c), limit_train_batches=3, async_save=True),
        dict(zero_stage=0, steps=6, ckpt_in=str(c / STEP3), limit_train_batches=3),
        # ZeRO-1 (DistributedOptimizer) async: its fp32 master slices and DTensor state staged, resumed under zero 2
        dict(zero_stage=1, steps=6, ckpt_dir=str(e), limit_train_batches=3, async_save=True),
        dict(zero_stage=2, steps=6, ckpt_in=str(e / STEP3), limit_train_batches=3),
    ]
    # and in the same launch (start-up and imports paid once), the crash mid-save and the mismatch errors
    crash = tmp_path_factory.mktemp("crash")
    ranks, crashed = launch_calls(2, [(run_many, dict(configs=configs)), (crash_and_mismatch, dict(tmp=str(crash)))])
    return {"root": root, "zero1_dir": a, "zero3_dir": c, "zero1_async_dir": e, "ranks": ranks, "crash": crashed[0]}


def assert_close_dicts(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)))[:10]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def check_resumed(saved3: dict, full6: dict, resumed: dict) -> None:
    assert resumed["restored"]["step"] == 3 and resumed["global_step"] == 6
    # every parameter and every optimizer state tensor, gathered, equals what was saved
    assert_close_dicts(resumed["restored"]["params"], saved3["params"])
    assert_close_dicts(resumed["restored"]["optim"], saved3["optim"])
    assert any(k.endswith(".exp_avg_sq") for k in saved3["optim"])
    # and the steps after the resume are the uninterrupted run's
    torch.testing.assert_close(torch.tensor(resumed["logged"]), torch.tensor(full6["logged"][3:]), rtol=RTOL, atol=0)
    assert resumed["lr"] == full6["lr"][3:]
    assert_close_dicts(resumed["params"], full6["params"])


def test_checkpoint_is_a_dcp_directory_with_metadata(dp2):
    path = dp2["zero1_dir"] / STEP3
    assert path.is_dir()
    names = {p.name for p in path.iterdir()}
    assert {"meta.pt", ".metadata"} <= names and sum(n.endswith(".distcp") for n in names) == 2, names
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["global_step"] == 3 and "state_dict" not in meta and "optimizer_states" not in meta
    assert meta["lightning_npu"]["zero_stage"] == 1 and meta["lightning_npu"]["data_parallel_size"] == 2
    assert meta["lr_schedulers"] and meta["loops"]
    assert not [p for p in dp2["root"].rglob(".*tmp-*")]  # nothing left behind


def test_resume_zero1_under_zero3(dp2):
    for rank in range(2):
        saved3, full6 = dp2["ranks"][rank][:2]
        check_resumed(saved3, full6, dp2["ranks"][rank][2])


def test_async_save_zero3_resumed_under_zero0(dp2):
    for rank in range(2):
        saved3, full6, _, async_run, resumed = dp2["ranks"][rank][:5]
        # zero 3 trained exactly like zero 1; its step-3 checkpoint holds step 3, not a later step
        assert_close_dicts(async_run["params"], full6["params"])
        assert (dp2["zero3_dir"] / "epoch=1-step=6.ckpt" / "meta.pt").is_file()  # committed at teardown
        check_resumed(saved3, full6, resumed)


def test_async_save_zero1_resumed_under_zero2(dp2):
    for rank in range(2):
        saved3, full6 = dp2["ranks"][rank][:2]
        async_run, resumed = dp2["ranks"][rank][5:7]
        assert_close_dicts(async_run["params"], full6["params"])
        assert (dp2["zero1_async_dir"] / "epoch=1-step=6.ckpt" / "meta.pt").is_file()  # committed at teardown
        check_resumed(saved3, full6, resumed)


def test_resume_dp2_zero3_checkpoint_in_one_process(dp2):
    """dp=2 x zero 3 -> dp=1 x zero 0: a different world size."""
    saved3, full6 = dp2["ranks"][0][0], dp2["ranks"][0][1]
    (resumed,) = spawn(run_many, 1, [dict(zero_stage=0, steps=6, ckpt_in=str(dp2["zero3_dir"] / STEP3),
                                          limit_train_batches=3, global_batch=8)])[0]
    check_resumed(saved3, full6, resumed)


def test_convert_checkpoint_to_single_file(dp2, tmp_path):
    from examples.gpt.model import GPT, GPTConfig
    from lightning_npu.cli import main
    from tests._gpt_workers import SMALL_GPT

    src = dp2["zero3_dir"] / "epoch=1-step=6.ckpt"
    expected = dp2["ranks"][0][3]["params"]
    # a ZeRO-1 checkpoint (fp32 master slices as the model tensors) consolidates to the same weights
    main(["convert-checkpoint", str(dp2["zero1_async_dir"] / "epoch=1-step=6.ckpt"), str(tmp_path / "z1.pt")])
    assert_close_dicts(torch.load(tmp_path / "z1.pt", weights_only=True), expected)
    # torch file, LightningModule keys, loadable with weights_only=True
    main(["convert-checkpoint", str(src), str(tmp_path / "full.pt")])
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_close_dicts(full, expected)
    # safetensors with the example GPT's own keys: a plain nn.Module loads it
    main(["convert-checkpoint", str(src), str(tmp_path / "gpt.safetensors"), "--strip-prefix", "model."])
    from safetensors.torch import load_file

    cfg = {k: SMALL_GPT[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias")}
    gpt = GPT(GPTConfig(**cfg))
    gpt.load_state_dict(load_file(tmp_path / "gpt.safetensors"), strict=True)
    torch.testing.assert_close(gpt.lm_head.weight, expected["model.lm_head.weight"])


def test_convert_checkpoint_errors(tmp_path, capsys):
    from lightning_npu.cli import main

    with pytest.raises(SystemExit) as err:
        main(["convert-checkpoint", str(tmp_path / "nope"), str(tmp_path / "out.pt")])
    assert err.value.code != 0
    assert "does not exist" in capsys.readouterr().err


def test_crash_mid_save_keeps_previous_and_mismatch_errors_name_keys(dp2):
    out = dp2["crash"]
    assert out["error"].startswith("CheckpointSaveError") and "injected failure" in out["error"], out["error"]
    # the overwrite never happened: the old checkpoint is intact (with its marker), the partial temp dir is gone
    assert out["leftovers"] == ["last.ckpt", "last.ckpt.complete"], out["leftovers"]
    assert_close_dicts(out["loaded"], out["saved"])
    errors = out["errors"]
    assert "CheckpointMismatchError" in errors["fewer_layers"]
    assert "unexpected keys" in errors["fewer_layers"] and "model.transformer.h.1.attn.c_attn.weight" in errors[
        "fewer_layers"]
    assert "missing keys" in errors["more_layers"] and "model.transformer.h.2.mlp.c_fc.weight" in errors["more_layers"]
    assert "shape mismatches" in errors["wider"] and "model.lm_head.weight" in errors["wider"]
