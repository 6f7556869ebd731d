"""The examples: the GPT config shows the features a newcomer should see first; the `transformers` Llama
config trains under tp=2 on 2 CPU processes (shortened to a couple of steps)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_npu.parallel.checkpoint.safe_load import checkpoint_tensor_metadata, read_meta
from tests._callbacks_helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]


def test_gpt_config_uses_bf16_clipping_stability_callbacks_and_more_than_dp():
    config = yaml.safe_load((ROOT / "examples/gpt/config.yaml").read_text())
    trainer = config["trainer"]
    assert trainer["precision"] == "bf16-mixed" and trainer["gradient_clip_val"] == 1.0
    assert trainer["devices"] == 2
    layout = trainer["strategy"]["init_args"]
    assert layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1) == 2
    callbacks = {c["class_path"]: c.get("init_args") for c in trainer["callbacks"]}
    # with their defaults: no init_args
    assert callbacks == {"lightning_npu.callbacks.DynamicCheckpoint": None,
                         "lightning_npu.callbacks.GradientHealthGuard": None}


def test_llama_config_trains_a_transformers_llama_with_pp2_tp2(tmp_path):
    cli = Path(sys.executable).with_name("lightning-npu")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "lightning_npu.cli"]
    cmd += [
        "fit",
        "--config", "examples/llama/config.yaml",
        "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path),
        "--data.init_args.block_size", "32",
    ]
    env = clean_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Starting with 4 processes" in out and "`Trainer.fit` stopped: `max_steps=2` reached." in out
    path = tmp_path / "checkpoints" / "step=00000002.ckpt"  # DynamicCheckpoint's save at train end
    meta = read_meta(path)
    layout = meta["lightning_npu"]
    assert layout["tensor_parallel_size"] == 2 and layout["pipeline_parallel_size"] == 2 and meta["global_step"] == 2
    # the weights really are split over the two tp ranks of each stage: one chunk each, full shapes in the checkpoint
    tensors = checkpoint_tensor_metadata(path)
    for name, shape in [("model.model.layers.0.self_attn.q_proj.weight", (64, 64)),
                        ("model.model.layers.0.mlp.down_proj.weight", (64, 176)),
                        ("model.lm_head.weight", (256, 64))]:
        entry = tensors[f"state_dict.{name}"]
        assert tuple(entry.size) == shape and len(entry.chunks) == 2, (name, entry)
    # the loss the guard saw is a real next-byte loss, near ln(256) at initialisation
    guard = next(v for k, v in meta["callbacks"].items() if "GradientHealthGuard" in k)
    assert math.isfinite(guard["loss_ema"]) and 3.0 < guard["loss_ema"] < 7.0, guard


def test_gpu_mfu_benchmark_runs_tiny_on_cpu(tmp_path):
    """The GPU benchmark's CPU smoke run: every arm trains the same model on the same batches."""
    from benchmarks import gpu_mfu
    from lightning_npu.device import fast_bf16

    result = gpu_mfu.main(["--tiny", "--repeats", "1", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)])
    arms = result["arms"]
    assert set(arms) >= {"torch", "ddp", "npu_hybrid", "npu_hybrid_fuse_ops"}
    assert all("error" not in e for e in arms.values()), {k: e.get("error") for k, e in arms.items()}
    # bf16: equal to 1e-5 where both run the same kernels; on a CPU without bf16 instructions npu_hybrid emulates
    # the bf16 GEMMs in fp32 (another summation order: measured 2e-5 apart) while ddp and the loop do not
    emulated = {"npu_hybrid", "npu_hybrid_no_loss_scale", "npu_hybrid_no_fp32_functions"}
    emulated = emulated if not fast_bf16("cpu") else set()
    for name in ("torch", "npu_hybrid", "npu_hybrid_no_loss_scale", "npu_hybrid_no_fp32_functions"):
        rel = 1e-4 if name in emulated else 1e-5
        assert arms[name]["losses"] == pytest.approx(arms["ddp"]["losses"], rel=rel), name
    assert arms["npu_hybrid_fuse_ops"]["losses"] == pytest.approx(arms["ddp"]["losses"], rel=1e-3)
    assert result["n_params"] > 0 and result["flops_per_token"] > 6 * result["n_matmul_params"]
    assert (tmp_path / "gpu_mfu_cpu.json").is_file()


def test_clip_config_trains_with_branch_layouts(tmp_path):
    """examples/clip: the vision tower at tp=2, the text tower at tp=1 over 2 branch-dp ranks, 1-bit compressed."""
    config = yaml.safe_load((ROOT / "examples/clip/config.yaml").read_text())
    layout = config["trainer"]["strategy"]["init_args"]
    assert layout["tensor_parallel_size"] == 2 and config["trainer"]["devices"] == 2
    assert layout["branch_layouts"] == {"model.text_model": {"tensor_parallel_size": 1,
                                                             "gradient_compression": "onebit"}}
    cli = Path(sys.executable).with_name("lightning-npu")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "lightning_npu.cli"]
    cmd += ["fit", "--config", "examples/clip/config.yaml", "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(tmp_path),
            "--data.init_args.num_workers", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Starting with 2 processes" in out and "`Trainer.fit` stopped: `max_steps=2` reached." in out
    tensors = checkpoint_tensor_metadata(tmp_path / "checkpoints" / "step=00000002.ckpt")
    # the vision tower is split over the 2 ranks, the text tower (tp=1 in its branch) is whole on each
    assert len(tensors["state_dict.model.vision_model.encoder.layers.0.mlp.fc1.weight"].chunks) == 2
    assert len(tensors["state_dict.model.text_model.encoder.layers.0.mlp.fc1.weight"].chunks) == 1
