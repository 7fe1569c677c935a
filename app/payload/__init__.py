"""A job's features in transit, target to drafter: the pool-side description of a payload and nixl's
transport (`transport.py`), the drafter's staging copy out of the object store (`staging.py`), and the
nixl receive path (`nixl_receive.py`)."""
