"""lightning-npu: hybrid-parallel training for PyTorch Lightning on Ascend NPU, CUDA and CPU.

``import lightning_npu`` registers the ``"npu"`` accelerator and the ``"npu_hybrid"``
strategy with Lightning's registries; re-importing is harmless.
"""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_npu.accelerator import NPUAccelerator
from lightning_npu.parallel.checkpoint.formats import load_checkpoint
from lightning_npu.parallel.checkpoint.full_state import full_state_dict, load_full_state_dict
from lightning_npu.parallel.errors import NotImplementedYetError, ParallelConfigError
from lightning_npu.parallel.optim.grad_norm import grad_norm
from lightning_npu.precision.hybrid import HybridPrecision
from lightning_npu.strategy import NPUHybridStrategy

__version__ = "0.1.0"


def register() -> None:
    NPUAccelerator.register_accelerators(AcceleratorRegistry)
    NPUHybridStrategy.register_strategies(StrategyRegistry)


register()

__all__ = [
    "HybridPrecision",
    "NPUAccelerator",
    "NPUHybridStrategy",
    "NotImplementedYetError",
    "ParallelConfigError",
    "full_state_dict",
    "load_checkpoint",
    "grad_norm",
    "load_full_state_dict",
    "register",
]
