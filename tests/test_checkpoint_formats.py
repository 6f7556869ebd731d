"""Checkpoint formats a Lightning user can load: `save_distributed_checkpoint`, `lightning_npu.load_checkpoint`,
resuming an npu_hybrid file under "ddp", and `convert-checkpoint --to hf`.

One launch of 2 processes runs Lightning's BoringModel flow (fit, checkpoint at step 3 = the end of epoch 0) under
every ZeRO stage and both forms, the resumes, and the example's transformers Llama under tp=2; the tests then load
what was written in this plain process, as a user would, and compare with the trained model's own numbers.
"""

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_npu
from lightning_npu import NPUHybridStrategy, ParallelConfigError
from lightning_npu.launch import spawn
from tests._ckpt_format_workers import INPUT, Boring, run_all

RTOL, ATOL = 1e-5, 1e-6
STEP3, STEP6 = "epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"
CONFIGS = [
    ("z0", dict(zero_stage=0)),
    ("z1", dict(zero_stage=1)),
    ("z2", dict(zero_stage=2)),
    ("z3", dict(zero_stage=3)),
    ("z1_dir", dict(zero_stage=1, save_distributed_checkpoint=True)),
    ("z3_file", dict(zero_stage=3, save_distributed_checkpoint=False)),
    # bf16-true: the file holds ZeRO-1's fp32 master weights (gathered), as the directory does
    ("z1_bf16", dict(zero_stage=1, precision="bf16-true")),
    ("z1_bf16_dir", dict(zero_stage=1, precision="bf16-true", save_distributed_checkpoint=True)),
    ("z1_full6", dict(zero_stage=1, steps=6)),
    # the step-3 file of "z1" resumed: under npu_hybrid zero 1, zero 3 (full tensors re-sharded) and Lightning's ddp
    ("z1_resumed", dict(zero_stage=1, steps=6, ckpt_in=f"z1/{STEP3}")),
    ("z3_resumed_file", dict(zero_stage=3, steps=6, ckpt_in=f"z1/{STEP3}")),
    ("ddp_resumed", dict(ddp=True, steps=6, ckpt_in=f"z1/{STEP3}")),
    ("llama", {}),  # tp=2: a sharded directory by default
    ("llama_file", dict(save_distributed_checkpoint=False)),
]
DEFAULT_FILE = {"z0": True, "z1": True, "z2": False, "z3": False, "z1_dir": False, "z3_file": True, "llama": False,
                "llama_file": True, "z1_bf16": True, "z1_bf16_dir": False}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    ranks = spawn(run_all, 2, str(root), CONFIGS)
    return root, ranks[0]


def _ckpt(root: Path, name: str) -> Path:
    return root / name / ("epoch=0-step=2.ckpt" if name.startswith("llama") else STEP3)


def assert_close_dicts(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:10]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def assert_same_optimizer_states(a: list, b: list) -> None:
    assert len(a) == len(b) == 1
    assert a[0]["param_groups"] == b[0]["param_groups"]
    assert a[0]["state"].keys() == b[0]["state"].keys() and a[0]["state"]
    for i in a[0]["state"]:
        assert_close_dicts(a[0]["state"][i], b[0]["state"][i])


def test_default_format_per_layout_and_overrides(runs):
    root, out = runs
    for name, single in DEFAULT_FILE.items():
        path = _ckpt(root, name)
        assert (path.is_file() if single else (path / "meta.pt").is_file()), (name, path)
    assert not [p for p in root.rglob(".*tmp-*")] and not [p for p in root.rglob(".old-*")]  # committed, no leftovers
    ckpt = torch.load(_ckpt(root, "z1"), weights_only=True)  # a plain Lightning file
    assert ckpt["global_step"] == 3 and ckpt["lightning_npu"]["zero_stage"] == 1
    # the resumable sampler's position is npu_hybrid's own entry (Lightning's "ddp" would refuse it in the loops)
    assert "combined_loader" not in ckpt["loops"]["fit_loop"]["state_dict"]
    assert ckpt["lightning_npu"]["combined_loader"][0]["consumed_samples"] > 0


def test_boring_model_flow_load_from_checkpoint(runs):
    """fit under npu_hybrid -> load in a plain process -> validate/test/predict give the trained model's numbers."""
    root, out = runs
    for name in ("z0", "z1", "z2", "z3", "z1_dir", "z3_file"):
        path, trained = _ckpt(root, name), out[name]
        if path.is_file():
            model = Boring.load_from_checkpoint(path)  # Lightning's own loader
        else:  # a sharded directory: Lightning's loader cannot read it; lightning_npu.load_checkpoint can
            ckpt = lightning_npu.load_checkpoint(path)
            model = Boring(**ckpt["hyper_parameters"])
            model.load_state_dict(ckpt["state_dict"])
        assert_close_dicts(model.state_dict(), trained["state"])
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=4, limit_test_batches=8)
        # the trained run read 2 val batches of 4 per rank on 2 ranks: the same 16 samples in 4 batches here
        val = trainer.validate(model, verbose=False)[0]["val_loss"]
        assert val == pytest.approx(trained["val_loss"], rel=RTOL), name
        test = trainer.test(model, verbose=False)[0]["test_loss"]
        assert test == pytest.approx(trained["test_loss"], rel=RTOL), name
        predicted = torch.cat(trainer.predict(model, DataLoader(INPUT, batch_size=2)))
        torch.testing.assert_close(predicted, trained["outputs"], rtol=RTOL, atol=ATOL)


def test_resume_npu_hybrid_file_under_ddp_and_other_zero_stages(runs):
    """The step-3 file, resumed to step 6, ends where the uninterrupted run did: weights, Adam moments (else the
    steps after the resume would differ), loops and schedulers restored, under Lightning's ddp too."""
    _, out = runs
    full = out["z1_full6"]
    for name in ("z1_resumed", "z3_resumed_file", "ddp_resumed"):
        # npu_hybrid marks every checkpoint it commits (sizes, CRC32s); Lightning's ddp does not
        marked = [STEP6 + ".complete"] if name != "ddp_resumed" else []
        assert out[name]["global_step"] == 6 and out[name]["ckpts"] == [STEP6, *marked], name
        assert_close_dicts(out[name]["state"], full["state"])
        assert out[name]["val_loss"] == pytest.approx(full["val_loss"], rel=RTOL)
    assert not torch.allclose(full["state"]["layer.weight"], out["z1"]["state"]["layer.weight"])  # steps 4-6 moved


def test_load_checkpoint_of_a_directory_equals_the_file(runs):
    root, _ = runs
    for directory, single in (("z1_dir", "z1"), ("z3", "z3_file"), ("llama", "llama_file"), ("z1_bf16_dir", "z1_bf16")):
        a, b = lightning_npu.load_checkpoint(_ckpt(root, directory)), lightning_npu.load_checkpoint(_ckpt(root, single))
        assert_close_dicts(a["state_dict"], b["state_dict"])
        assert_same_optimizer_states(a["optimizer_states"], b["optimizer_states"])
        for key in ("global_step", "epoch", "hyper_parameters", "lr_schedulers"):
            assert a[key] == b[key], key
    assert lightning_npu.load_checkpoint(_ckpt(root, "z1_bf16"))["state_dict"]["layer.weight"].dtype == torch.float32
    # the file's optimizer state is torch's own format: the user's optimizer class loads it
    model = Boring()
    torch.optim.AdamW(model.parameters()).load_state_dict(lightning_npu.load_checkpoint(_ckpt(root, "z1"))
                                                          ["optimizer_states"][0])
    with pytest.raises(FileNotFoundError, match="neither a checkpoint file nor"):
        lightning_npu.load_checkpoint(root)


def test_convert_checkpoint_to_hf_and_lightning(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from lightning_npu.cli import main

    root, out = runs
    trained = out["llama"]
    for name in ("llama", "llama_file"):
        main(["convert-checkpoint", str(_ckpt(root, name)), str(tmp_path / name), "--to", "hf"])
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        with torch.no_grad():
            logits = hf(input_ids=out[name]["idx"]).logits
        torch.testing.assert_close(logits, out[name]["logits"], rtol=RTOL, atol=1e-5)
    torch.testing.assert_close(out["llama_file"]["logits"], trained["logits"], rtol=RTOL, atol=1e-5)
    # a directory -> one Lightning file that Lightning's own loader reads
    main(["convert-checkpoint", str(_ckpt(root, "z3")), str(tmp_path / "z3.ckpt"), "--to", "lightning"])
    model = Boring.load_from_checkpoint(tmp_path / "z3.ckpt")
    assert_close_dicts(model.state_dict(), out["z3"]["state"])
    # a checkpoint without a transformers model: the error names the way out
    with pytest.raises(SystemExit):
        main(["convert-checkpoint", str(_ckpt(root, "z1")), str(tmp_path / "nope"), "--to", "hf"])
    err = capsys.readouterr().err
    assert "holds no transformers model" in err and "leave out `--to hf`" in err


@pytest.mark.parametrize("value", ["yes", 1, 0.0, "sharded"])
def test_save_distributed_checkpoint_is_validated(value):
    with pytest.raises(ParallelConfigError, match="save_distributed_checkpoint="):
        NPUHybridStrategy(save_distributed_checkpoint=value)


def test_dynamic_checkpoint_commits_and_resumes_single_files(tmp_path):
    """The callbacks' commit path (marker, discovery) with npu_hybrid's default file, also when the callback asks
    for async IO (a file is written synchronously: the commit follows the write)."""
    from lightning_npu.callbacks import DynamicCheckpoint
    from tests._callbacks_helpers import StepSeeded, flat_params, trainer_kwargs

    d = tmp_path / "ck"

    def fit(steps, ckpt_path=None):
        model = StepSeeded()
        dyn = DynamicCheckpoint(dirpath=str(d), phase_fractions=(), intervals=(2,), async_save=True, keep_last_k=None)
        L.Trainer(callbacks=[dyn], strategy=NPUHybridStrategy(), **trainer_kwargs(tmp_path, steps)).fit(
            model, ckpt_path=ckpt_path)
        return model

    fit(4)
    latest = DynamicCheckpoint.find_latest(d)
    assert latest == str(d / "step=00000004.ckpt") and Path(latest).is_file()
    assert (d / "step=00000004.ckpt.complete").is_file() and not [p for p in d.iterdir() if p.name.startswith(".")]
    resumed = fit(6, latest)
    assert sorted(resumed.losses) == [4, 5]
    reference = StepSeeded()
    L.Trainer(strategy=NPUHybridStrategy(), **trainer_kwargs(tmp_path / "ref", 6)).fit(reference)
    torch.testing.assert_close(flat_params(resumed), flat_params(reference), rtol=0, atol=0)


def test_optimizer_state_converts_between_positions_and_names_one_way():
    """The one converter (`parallel.checkpoint.optim_state`): torch's position-indexed format <-> the FQN-keyed flat
    form, and a re-indexing for another set of groups (a pipeline stage's part), on a real AdamW state."""
    from lightning_npu.parallel.checkpoint.optim_state import by_name, by_position, reindexed, split_state_key

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    names = [n for n, _ in net.named_parameters()]  # 0.weight 0.bias 1.weight 1.bias
    params = dict(net.named_parameters())
    opt = torch.optim.AdamW([{"params": [params[n] for n in names[:2]], "lr": 0.1},
                             {"params": [params[n] for n in names[2:]], "lr": 0.2}])
    net(torch.randn(5, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    flat, groups = by_name(sd, names)
    assert sorted(flat)[0] == "state.0.bias.exp_avg" and split_state_key("state.0.bias.exp_avg") == ("0.bias", "exp_avg")
    assert groups[1]["params"] == ["1.weight", "1.bias"] and groups[1]["lr"] == 0.2
    back = by_position(groups, flat)
    assert back["param_groups"] == sd["param_groups"] and back["state"].keys() == sd["state"].keys()
    for i, entry in sd["state"].items():
        assert all(back["state"][i][k] is v for k, v in entry.items())
    # the second stage's part: its own positions 0, 1 hold the saved positions 2, 3, with the saved hyper-parameters
    part = reindexed(sd, names, [[], ["1.weight", "1.bias"]])
    assert part["param_groups"][1]["params"] == [0, 1] and part["param_groups"][1]["lr"] == 0.2
    assert part["state"][0]["exp_avg"] is sd["state"][2]["exp_avg"] and sorted(part["state"]) == [0, 1]
