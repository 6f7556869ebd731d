"""Mixture of experts: router statistics for any layout (`router_monitor`). Expert tensor parallelism is a
tensor-parallel style (`tensor_parallel.styles.ExpertsTensorParallel`); expert parallelism (all-to-all dispatch
over ep) will live here."""
