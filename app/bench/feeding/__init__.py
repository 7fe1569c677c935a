"""Benches of feeding the drafters: the pool against a queue, pull policies, schedules, the discrete-event
simulation of the pool and the re-split."""
