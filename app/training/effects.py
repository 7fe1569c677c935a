"""The vocabulary of a drafter rank's step protocol (`RankLoop` in app/training/loop.py), no logic of it.

What the loop is told (`LoopConfig`), the typed effects it yields to its driver (each one's `op` names
the driver's method that carries it out, and the docstring says what that method returns), the answer
to a pull (`Fetched`), the step's all-rank totals it reads back (`Totals`; `StepTotals` and `sum_votes`
for drivers without a trainer) and how the loop ended (`LoopOutcome`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

@dataclass(frozen=True)
class LoopConfig:
    """What the protocol needs to know about its rank and cadences."""

    rank: int
    world_size: int
    grad_accum: int
    checkpoint_every: int = 0  # rank 0 checkpoints every N optimizer steps (0: only when the loop ends)
    eval_every: int = 0  # rank 0 offers its weights for an evaluation every N steps (0: never)
    drain_sleep_s: float = 0.05  # every rank drained: wait this long before pulling again
    start_step: int = 0  # optimizer steps already done (a resume)


class Totals(Protocol):
    """The step's all-rank totals the protocol reads (app.training.trainer.StepStats has them)."""

    step: int  # optimizer steps done, this one included
    active_ranks: int  # ranks that trained on something this step
    eos_ranks: int  # ranks whose stream has ended
    stop: bool  # rank 0 asked to stop
    nonfinite: str  # why the step's update was not applied (nan/inf loss or grad norm); "" = applied
    halt: bool  # a non-finite step the run stops at


@dataclass(frozen=True)
class StepTotals:
    """Totals for drivers without a trainer (benches, tests): see `sum_votes`."""

    step: int
    active_ranks: int
    eos_ranks: int
    stop: bool
    nonfinite: str = ""
    halt: bool = False


# ---- effects: what the loop asks its driver to do (`op` names the driver's method) ------------------

@dataclass(frozen=True)
class StepStart:
    """A step (or a retry after a drain) begins; drivers time their steps from here."""

    op: ClassVar[str] = "step_start"


@dataclass(frozen=True)
class StartPull:
    """Send a pull carrying `acks` (the last step's job ids) and do not wait for its answer."""

    acks: tuple[int, ...]
    op: ClassVar[str] = "start_pull"


@dataclass(frozen=True)
class PullAnswered:
    """Has the pull in flight got its answer yet? Result: bool."""

    op: ClassVar[str] = "pull_answered"


@dataclass(frozen=True)
class AwaitPull:
    """Wait for the pull in flight. Result: `Fetched`."""

    op: ClassVar[str] = "await_pull"


@dataclass(frozen=True)
class Fetched:
    """A pull's answer: a PulledItem (with its payload, staged or not), Drained or EndOfStream."""

    item: Any
    payload: Any = None
    waited_s: float = 0.0  # how long the rank waited for it (0 when it had arrived)


@dataclass(frozen=True)
class Compute:
    """Forward and backward of one micro-batch."""

    item: Any  # PulledItem
    payload: Any
    op: ClassVar[str] = "compute"


@dataclass(frozen=True)
class SendAcks:
    """Ack these jobs now, in their own call (a pull is still waiting: they must not wait behind it)."""

    job_ids: tuple[int, ...]
    op: ClassVar[str] = "send_acks"


@dataclass(frozen=True)
class ReadStop:
    """Rank 0 only: has a stop been requested? Result: bool."""

    op: ClassVar[str] = "read_stop"


@dataclass(frozen=True)
class Reduce:
    """The step's collective, this rank's vote in it. Result: the all-rank `Totals`."""

    items: int  # micro-batches this rank trained this step
    eos: bool
    stop: bool
    op: ClassVar[str] = "reduce"


@dataclass(frozen=True)
class Sleep:
    """Every rank drained: wait before pulling again."""

    seconds: float
    op: ClassVar[str] = "sleep"


@dataclass(frozen=True)
class Updated:
    """The optimizer step `step` is applied and nothing of it is acked yet (the fault hook's point)."""

    step: int
    op: ClassVar[str] = "updated"


@dataclass(frozen=True)
class NonFinite:
    """The step's update was not applied (`reason`); `halt`: the loop ends now, else it was skipped and
    `job_ids` (this rank's) are acked as consumed, not learned."""

    step: int
    job_ids: tuple[int, ...]
    reason: str
    halt: bool
    op: ClassVar[str] = "nonfinite"


@dataclass(frozen=True)
class Gather:
    """All-gather of the step's job ids. Result: one list of job ids per rank."""

    job_ids: tuple[int, ...]
    op: ClassVar[str] = "gather"


@dataclass(frozen=True)
class StepDone:
    """The step is acked (or its acks are held for the next pull) and gathered: ledger, step log, report."""

    step: int
    job_ids: tuple[int, ...]
    gathered: Sequence[Sequence[int]]
    totals: Any  # what the reduce returned (a Totals)
    wait_s: float  # seconds this rank waited for data during the step
    op: ClassVar[str] = "step_done"


@dataclass(frozen=True)
class Checkpoint:
    """Rank 0: save a checkpoint of `step` (`final`: the loop has ended)."""

    step: int
    final: bool = False
    op: ClassVar[str] = "checkpoint"


@dataclass(frozen=True)
class OfferEval:
    """Rank 0: offer the weights of `step` for an evaluation."""

    step: int
    op: ClassVar[str] = "offer_eval"


@dataclass(frozen=True)
class LoopOutcome:
    """How the rank's loop ended."""

    steps: int  # optimizer steps done (the last totals' step)
    stopped: bool  # a stop was requested (else every stream ended)
    nonfinite: str = ""  # the loop halted at a non-finite step (why); then `stopped` is True too


def sum_votes(votes: Sequence[Reduce], step_before: int) -> StepTotals:
    """The reduce of drivers without a trainer: a step with any item counts as an optimizer step."""
    active = sum(1 for v in votes if v.items > 0)
    return StepTotals(step_before + (1 if active else 0), active, sum(1 for v in votes if v.eos),
                      any(v.stop for v in votes))
