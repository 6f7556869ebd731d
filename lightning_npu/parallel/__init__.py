"""Parallel logic, independent of Lightning: layout validation, mesh, TP/PP/DP application."""

from lightning_npu.parallel.config import NotImplementedYetError, ParallelConfig, ParallelConfigError

__all__ = ["NotImplementedYetError", "ParallelConfig", "ParallelConfigError"]
