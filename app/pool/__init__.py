"""The hidden-state pool (pure, no Ray): `HSPool` (hs_pool.py) over its book, its producing and drafters' sides,
the records, holdings, pull policy and telemetry beneath them; the pool actor's control state and the shared
stream of several runs above it."""
