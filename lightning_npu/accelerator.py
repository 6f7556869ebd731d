"""Lightning `Accelerator` for Ascend NPUs.

Lightning resolves ``Trainer(accelerator="npu")`` through its registry; constructing the
accelerator is the first moment we know the user wants an NPU, so that is where a missing
`torch_npu` turns into an error that says what to install (instead of Lightning's generic
"not available on your system").

It is also the first object Lightning hands the trainer to on any strategy, so it is where the
mixed-precision plugin Lightning built for ``precision="bf16-mixed"``/``"16-mixed"`` (which
autocasts on "cuda" for every accelerator but CPU/MPS, i.e. silently fp32 on an NPU) is rebuilt
for the ``npu`` device.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_npu import device as dev


def log_availability(used: bool) -> None:
    """``NPU available: ...`` beside the Trainer's "GPU available" and "TPU available" lines, which Lightning
    prints for its own devices only and has no hook for others: the accelerator (used) or npu_hybrid (on
    another device) says it while Lightning's accelerator connector builds them, just before those lines."""
    rank_zero_info(f"NPU available: {dev.npu_available()} (torch_npu), used: {used}")


class NPUAccelerator(Accelerator):
    """Runs on Huawei Ascend NPUs through `torch_npu`."""

    def __init__(self) -> None:
        super().__init__()
        dev.import_torch_npu()
        if not dev.npu_available():
            raise dev.NPUUnavailableError(
                "`torch_npu` is installed but reports no usable NPU (torch.npu.is_available() is False). "
                "Check `npu-smi info` and that the CANN environment (`set_env.sh`) is sourced."
            )
        log_availability(used=True)

    def setup(self, trainer: Any) -> None:
        """Strategies call this before they use the precision plugin: retarget AMP to the NPU."""
        strategy = trainer.strategy
        plugin = strategy.precision_plugin
        if type(plugin) is MixedPrecision and plugin.device != dev.NPU:
            strategy.precision_plugin = MixedPrecision(plugin.precision, device=dev.NPU)
        elif isinstance(plugin, MixedPrecision) and plugin.device != dev.NPU:
            raise ValueError(
                f"{type(plugin).__name__} autocasts on {plugin.device!r} but the accelerator is 'npu'; pass "
                "`plugins=[MixedPrecision(precision, device='npu')]` or use `strategy='npu_hybrid'`."
            )

    def setup_device(self, device: torch.device) -> None:
        if device.type != dev.NPU:
            raise ValueError(f"NPUAccelerator got device {device}; expected an `npu` device.")
        dev.set_device(device)

    def get_device_stats(self, device: Union[str, torch.device]) -> dict[str, Any]:
        return dev.memory_stats(device)

    def teardown(self) -> None:
        if dev.npu_available():
            dev.empty_cache(dev.NPU)

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> list[int]:
        """Accepts the same forms as CUDA: a count, "auto"/-1 for all, "0,2" or a list of indices."""
        total = NPUAccelerator.auto_device_count()
        if isinstance(devices, str):
            devices = devices.strip()
            if devices in ("auto", "-1"):
                devices = -1
            elif "," in devices:
                devices = [int(x) for x in devices.split(",") if x.strip()]
            else:
                devices = int(devices)
        if isinstance(devices, int):
            indices = list(range(total)) if devices == -1 else list(range(devices))
        else:
            indices = [int(i) for i in devices]
        missing = [i for i in indices if i >= total or i < 0]
        if not indices or missing:
            raise ValueError(
                f"`devices={devices!r}` asks for NPU indices {indices} but {total} NPU(s) are visible; "
                "pass a count <= the visible NPUs or set ASCEND_RT_VISIBLE_DEVICES."
            )
        return indices

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device(dev.NPU, i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        return dev.npu_device_count()

    @staticmethod
    def is_available() -> bool:
        return dev.npu_available()

    @staticmethod
    def name() -> str:
        return dev.NPU

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(
            "npu", cls, description="Huawei Ascend NPU through torch_npu (lightning-npu)", override=True
        )
