"""Supervising the actors: what happened (events; what a pool snapshot says, pool_watch), what to do about
it (the pure policy), and the Ray handles it acts through (the target fleet, the drafter group, the retried
pool client). The loop that ties them together is `app/run/supervisor.py`, one floor up."""
