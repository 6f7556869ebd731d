"""Data parallelism over the mesh's ``dp`` dimension: DDP/FSDP2 wrapping, gradient buckets and their one reduction,
compression, hierarchical all-reduce, buffers, the resumable sampler."""
