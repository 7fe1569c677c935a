"""Benches of the payload path: the object store (`object_store.py`, its producer and consumer in
`path_ends.py`), nixl beside it (`nixl.py`), and the CUDA staging copy (`gpu_staging.py`)."""
