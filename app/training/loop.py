"""One drafter rank's step protocol, once, as pure code: no Ray, no torch.distributed, no clock.

`RankLoop.run()` is a generator: it yields typed effect requests (the dataclasses of
`app/training/effects.py`) and receives their results; whoever drives it maps each effect to an
operation (`Runner`, `drive`, below; `QuietHooks` answers the effects a driver ignores). Three drivers
share it: `actors/drafter.py` (Ray calls, the trainer, the real collective), `app/bench/feeding/sched.py`
(Ray actors that sleep instead of computing) and `app/bench/feeding/simulate.py` (a virtual clock around
the pure pool). The first two use `drive` (every operation returns its result); the simulation uses
`Runner`, whose operations may answer `LATER` and resume the rank from its event heap.

A step: up to `grad_accum` micro-batches, each a pull answered by an item, `Drained` (step with what
is held) or `EndOfStream` (this rank's stream is over: it joins every later step with zero items).
One pull stays in flight while the rank computes (prefetch). Rank 0 reads the stop flag; all ranks
join the step's reduce, whose totals say what comes next:
- every rank at end-of-stream: the loop ends (the pool ends a stream only once every job is acked);
- no rank trained anything and no stop: all ranks drained while leases elsewhere wait for acks, so
  sleep `drain_sleep_s` and pull again (blocking in a pull here would deadlock the group);
- else the optimizer step is applied (`Updated`, the fault hook's point), then the step's acks: they
  ride on the next pull, or go at once (`SendAcks`) when a pull is still waiting for its answer (the
  pool may need these very acks before it can answer); then the all-gather of job ids (`Gather`),
  `StepDone` (ledger, step log, report), a stop ends the loop, else rank 0's checkpoint and eval cadence.
A step whose all-reduced loss or grad norm is non-finite was not applied by the trainer (every rank
sees the same totals, so all agree): with `train.on_nonfinite=skip` it goes on as above, its jobs acked
as consumed and announced (`NonFinite`: counted as skipped_nonfinite, never learned); when the totals
say `halt` (on_nonfinite=stop, or the weights themselves are non-finite) the loop ends at once, with no
ack and no checkpoint: the run's last checkpoint stays its resume point.
Rank 0 checkpoints once more when the loop ends (after a stop, acks still held for a next pull are
not sent: that checkpoint's ledger holds their jobs).
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from app.messages import Drained, EndOfStream
from app.training.effects import (AwaitPull, Checkpoint, Compute, Gather, LoopConfig, LoopOutcome, NonFinite,
                                  OfferEval, PullAnswered, ReadStop, Reduce, SendAcks, Sleep, StartPull, StepDone,
                                  StepStart, Updated)


# ---- the protocol -----------------------------------------------------------------------------------

@dataclass
class RankLoop:
    """One rank's step protocol; `run()` is the generator a driver advances."""

    cfg: LoopConfig
    eos: bool = False  # this rank's stream is over
    in_flight: bool = False  # a pull is sent and its answer not yet taken
    held_acks: list[int] = field(default_factory=list)  # ride on the next pull

    def run(self) -> Generator[Any, Any, LoopOutcome]:
        cfg, step = self.cfg, self.cfg.start_step
        while True:
            yield StepStart()
            job_ids, wait_s = yield from self._accumulate()
            stop = bool((yield ReadStop())) if cfg.rank == 0 else False
            totals = yield Reduce(len(job_ids), self.eos, stop)
            step = totals.step
            if totals.eos_ranks == cfg.world_size:
                break  # every rank's stream is over
            if totals.active_ranks == 0 and not totals.stop:
                yield Sleep(cfg.drain_sleep_s)  # all drained while leases elsewhere await acks: pull again
                continue
            if totals.halt:  # no ack, no checkpoint: nothing of this step may be kept
                yield NonFinite(step, tuple(job_ids), totals.nonfinite, halt=True)
                return LoopOutcome(step, stopped=True, nonfinite=totals.nonfinite)
            yield Updated(step)
            if totals.nonfinite:  # skipped: the jobs are consumed (acked below) but were not learned
                yield NonFinite(step, tuple(job_ids), totals.nonfinite, halt=False)
            if job_ids:  # after the optimizer step: a crash before this re-issues the jobs
                yield from self._ack(job_ids)
            gathered = yield Gather(tuple(job_ids))
            yield StepDone(step, tuple(job_ids), gathered, totals, wait_s)  # before any checkpoint of it
            if totals.stop:
                return (yield from self._end(step, stopped=True))
            yield from self._cadence(step)
        return (yield from self._end(step, stopped=False))

    def _accumulate(self) -> Generator[Any, Any, tuple[list[int], float]]:
        """Up to grad_accum micro-batches: (job ids trained, seconds waited for data)."""
        job_ids: list[int] = []
        wait_s = 0.0
        for _ in range(self.cfg.grad_accum):
            if self.eos:
                break
            if not self.in_flight:  # first pull, or the last answer was Drained
                yield from self._start_pull()
            got = yield AwaitPull()
            self.in_flight = False
            wait_s += got.waited_s
            if isinstance(got.item, EndOfStream):
                self.eos = True
                break
            if isinstance(got.item, Drained):
                break  # nothing buffered, others hold the last leases: step with what we have
            yield from self._start_pull()  # prefetch the next while this one computes
            yield Compute(got.item, got.payload)
            job_ids.append(got.item.meta.job_id)
        return job_ids, wait_s

    def _start_pull(self) -> Generator[Any, Any, None]:
        acks, self.held_acks = tuple(self.held_acks), []
        self.in_flight = True
        yield StartPull(acks)

    def _ack(self, job_ids: list[int]) -> Generator[Any, Any, None]:
        """The ack routing: ride on the next pull, unless a pull waits now (then the pool may need them)."""
        if self.in_flight and not (yield PullAnswered()):
            acks, self.held_acks = tuple(self.held_acks + job_ids), []
            yield SendAcks(acks)
        else:
            self.held_acks += job_ids

    def _cadence(self, step: int) -> Generator[Any, Any, None]:
        cfg = self.cfg
        if cfg.rank != 0:
            return
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            yield Checkpoint(step)
        if cfg.eval_every and step % cfg.eval_every == 0:
            yield OfferEval(step)

    def _end(self, step: int, stopped: bool) -> Generator[Any, Any, LoopOutcome]:
        if self.cfg.rank == 0:
            yield Checkpoint(step, final=True)
        return LoopOutcome(step, stopped)


# ---- drivers ----------------------------------------------------------------------------------------

class _Later:
    """The answer of an operation that resumes the loop itself later (`Runner.resume`)."""

    def __repr__(self) -> str:
        return "LATER"


LATER = _Later()


class Runner:
    """Advances one rank's loop: each effect goes to `ops.<effect.op>(effect)`, whose result is sent
    back; an operation that answers `LATER` parks the loop until someone calls `resume(result)`."""

    def __init__(self, loop: RankLoop, ops: Any) -> None:
        self.gen, self.ops = loop.run(), ops
        self.outcome: LoopOutcome | None = None
        self.started = False

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def resume(self, value: Any = None) -> None:
        """Run the loop until an operation answers LATER or the loop ends."""
        if not self.started:  # a new generator takes None first
            self.started, value = True, None
        while True:
            try:
                effect = self.gen.send(value)
            except StopIteration as end:
                self.outcome = end.value
                return
            value = getattr(self.ops, effect.op)(effect)
            if value is LATER:
                return


def drive(loop: RankLoop, ops: Any) -> LoopOutcome:
    """Run the loop to its end with operations that all return their results (the actor, the Ray bench)."""
    runner = Runner(loop, ops)
    runner.resume()
    assert runner.outcome is not None, "a synchronous driver's operation answered LATER"
    return runner.outcome


class QuietHooks:
    """No-op defaults for the effects a bench or a test does not act on."""

    def step_start(self, effect: StepStart) -> None:
        return None

    def read_stop(self, effect: ReadStop) -> bool:
        return False

    def updated(self, effect: Updated) -> None:
        return None

    def nonfinite(self, effect: NonFinite) -> None:
        return None

    def step_done(self, effect: StepDone) -> None:
        return None

    def checkpoint(self, effect: Checkpoint) -> None:
        return None

    def offer_eval(self, effect: OfferEval) -> None:
        return None
