"""Registration, device layer, accelerator errors and configuration validation (one process)."""

import logging
from datetime import timedelta

import lightning as L
import pytest
import torch

import lightning_npu
from lightning_npu import NPUAccelerator, NPUHybridStrategy, device
from lightning_npu.parallel.data_parallel.compression import Compressor
from lightning_npu.parallel.data_parallel.compression_spec import parse_compression
from lightning_npu.parallel.errors import ParallelConfigError


def test_import_registers_strategy_and_accelerator_idempotently():
    lightning_npu.register()  # a second registration must not raise
    trainer = L.Trainer(strategy="npu_hybrid", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is NPUHybridStrategy
    from lightning.pytorch.accelerators import AcceleratorRegistry

    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator


def test_device_layer_on_cpu():
    assert device.comm_backend("cpu") == "gloo"
    assert device.comm_backend("cuda") == "nccl"
    assert device.accelerator_type() == "cpu"
    assert device.device_count("cpu") == 1
    stats = device.memory_stats("cpu")
    assert stats["rss_bytes"] > 0 and stats["peak_rss_bytes"] >= stats["rss_bytes"] * 0.5


@pytest.mark.skipif(device.torch_npu_installed(), reason="torch_npu is installed here")
def test_npu_accelerator_without_torch_npu_says_what_to_install():
    with pytest.raises(device.NPUUnavailableError, match="pip install torch-npu"):
        L.Trainer(accelerator="npu", devices=1, strategy="npu_hybrid")
    with pytest.raises(device.NPUUnavailableError, match="torch_npu"):
        device.comm_backend("npu")
    assert not NPUAccelerator.is_available() and NPUAccelerator.auto_device_count() == 0


def test_npu_availability_is_logged_beside_lightnings_device_lines(caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        L.Trainer(accelerator="cpu", devices=1, strategy="npu_hybrid", logger=False)
    lines = [r.getMessage() for r in caplog.records]
    first = next(i for i, line in enumerate(lines) if line.startswith("NPU available:"))
    assert lines[first] == f"NPU available: {NPUAccelerator.is_available()} (torch_npu), used: False"
    assert lines[first + 1].startswith("GPU available:") and lines[first + 2].startswith("TPU available:")
    assert sum(line.startswith("NPU available:") for line in lines) == 1


def test_mixed_precision_autocasts_on_the_accelerator_device():
    trainer = L.Trainer(strategy="npu_hybrid", accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert type(plugin).__name__ == "HybridPrecision" and plugin.device == "cpu"
    with plugin.forward_context():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"zero_stage": 5}, r"`zero_stage=5` is not a ZeRO stage"),
        ({"pipeline_schedule": "zigzag"}, r"`pipeline_schedule='zigzag'` is unknown"),
        ({"tensor_parallel_size": 0}, r"`tensor_parallel_size=0` must be a positive integer"),
        ({"data_parallel_size": "many"}, r"`data_parallel_size='many'` must be a positive integer"),
        ({"gradient_compression": "zip"}, r"`gradient_compression='zip'` is unknown"),
        ({"bucket_size_mb": -1}, r"`bucket_size_mb=-1` must be a positive"),
        ({"activation_checkpointing": "all"}, r"`activation_checkpointing='all'`"),
        ({"tp_plan": "magic"}, r"`tp_plan='magic'` must be 'auto'"),
        ({"tp_plan": {"*.q_proj": "diagonal"}}, r"`tp_plan\['\*.q_proj'\]='diagonal'` is not a known style"),
        ({"hierarchical_allreduce": "yes"}, r"`hierarchical_allreduce='yes'`"),
        ({"timeout": 30}, r"`timeout=30` must be a datetime.timedelta"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ParallelConfigError, match=match):
        NPUHybridStrategy(**kwargs)


def test_layout_that_does_not_fit_the_world_fails_at_trainer_construction():
    with pytest.raises(ParallelConfigError, match=r"`data_parallel_size=3` = 3, but the world size is 2"):
        L.Trainer(accelerator="cpu", devices=2, strategy=NPUHybridStrategy(data_parallel_size=3))


def _compressor(strategy):
    """The `Compressor` the layout builds from the validated setting (as `parallelize` does)."""
    return Compressor(parse_compression(strategy.parallel_config.gradient_compression))


def test_gradient_compression_globs_are_validated_at_construction():
    compressor = _compressor(NPUHybridStrategy(gradient_compression={"*.mlp.*": "topk", "*": None}))
    assert compressor.per_module and compressor.spec["*.mlp.*"].mode == "topk" and compressor.spec["*"] is None
    with pytest.raises(ParallelConfigError, match=r"`gradient_compression\['text.\*'\]`: .*mode 'zip' is unknown"):
        NPUHybridStrategy(gradient_compression={"text.*": "zip"})
    with pytest.raises(ParallelConfigError, match=r"`gradient_compression\['text.\*'\]`: .*ratio=2 must be in"):
        NPUHybridStrategy(gradient_compression={"text.*": {"mode": "topk", "ratio": 2}})
    with pytest.raises(ParallelConfigError, match=r"`gradient_compression\['text.\*'\]=3` must be None"):
        NPUHybridStrategy(gradient_compression={"text.*": 3})
    with pytest.raises(ParallelConfigError, match=r"`zero_stage=2`"):
        NPUHybridStrategy(gradient_compression={"text.*": "int8"}, zero_stage=2)


@pytest.mark.parametrize(
    "value, zero, match",
    [
        ({"mode": "zip"}, 0, r"mode 'zip' is unknown"),
        ({"mode": "topk", "ratio": 0}, 0, r"ratio=0 must be in \(0, 1\]"),
        ({"mode": "topk", "ratio": 1.5}, 0, r"ratio=1.5 must be in \(0, 1\]"),
        ({"mode": "int8", "warmup_steps": -1}, 0, r"warmup_steps=-1 must be an int >= 0"),
        ({"mode": "powersgd", "rank": 0}, 0, r"rank=0 must be a positive int"),
        ("topk", 2, r"`zero_stage=2`.*use zero_stage=0 or 1"),
        ("bf16", 3, r"`zero_stage=3`.*use zero_stage=0 or 1"),
    ],
)
def test_bad_gradient_compression_fails_at_construction(value, zero, match):
    with pytest.raises(ParallelConfigError, match=match):
        NPUHybridStrategy(gradient_compression=value, zero_stage=zero)


def test_gradient_compression_is_accepted():
    for value in ("powersgd", {"mode": "topk", "ratio": 0.1, "warmup_steps": 100}):
        assert _compressor(NPUHybridStrategy(gradient_compression=value, zero_stage=1)) is not None


def test_valid_arguments_are_accepted():
    s = NPUHybridStrategy(zero_stage=0, bucket_size_mb=4, timeout=timedelta(minutes=5), process_group_backend="gloo")
    assert s.parallel_config.resolve(4).mesh_shape == (1, 4, 1)
