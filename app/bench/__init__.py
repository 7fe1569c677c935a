"""Benchmarks: `python -m app.bench NAME`; each ends with one RESULT line. Their shared plumbing (the RESULT
line, configs with overrides, worker processes, the bench's own Ray cluster) is `common.py`."""
