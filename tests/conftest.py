import os

# One BLAS thread per process keeps multi-process runs on a 2-core machine from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
