"""Benchmarks: `python -m app.bench NAME`; each ends with one RESULT line."""
