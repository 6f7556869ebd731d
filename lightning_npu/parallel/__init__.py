"""Parallel logic, independent of Lightning: layout validation, mesh, TP/PP/DP application."""

from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.errors import NotImplementedYetError, ParallelConfigError

__all__ = ["NotImplementedYetError", "ParallelConfig", "ParallelConfigError"]
