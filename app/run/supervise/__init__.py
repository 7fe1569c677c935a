"""Supervising the actors: what happened (events; what a pool snapshot says, pool_watch), what to do about
it (the pure policy), and the Ray handles it acts through (the target fleet, the drafter group, the retried
pool client, and a run's view of the stream's pool and bundles, run_scoped). The loop that ties them
together is one floor up: `app/run/supervisor.py` (the stream) over `app/run/run_supervisor.py` (each run)."""
