"""Benches of compute and memory: FLOPs, peak memory per bucket, loss kernels, drafter jobs, the GPU bench
and its acceptance checks, and one drafter rank stepping alone through the step loop (`alone.py`)."""
