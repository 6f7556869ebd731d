"""Pipeline parallelism on `torch.distributed.pipelining`: the stage split and the runner."""
