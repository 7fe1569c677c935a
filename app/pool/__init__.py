"""The hidden-state pool (pure, no Ray), seven modules: `HSPool` (hs_pool.py), one run's pool, over its book
(book.py: every job's records and places) and its two sides (sides.py: producing, drafters'), with the
holdings, pull policy and telemetry beside them; the stream of every run's pool and the actor's control
state above it (stream.py)."""
