"""Benches of compute and memory: FLOPs, peak memory per bucket, loss kernels, drafter jobs, and the GPU
acceptance bench."""
