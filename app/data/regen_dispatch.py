# Not ray.util.ActorPool: it hands a timed-out actor back as idle; here a wedged slot restarts, its chunks go elsewhere.
"""Which chunk of `python -m app.regenerate` goes to which generator actor, and when an actor is wedged.

No Ray here: the entry point (app/regenerate.py) asks for `assignments()`, submits them, tells `done`
or `failed`, and asks `overdue()` between waits (at most `wait_s()` apart). Before, it waited for a
result with no deadline, so one wedged generator (a hung device, a deadlocked kernel) hung the whole
run forever.

- Each actor slot holds at most `per_slot` chunks (one generating, one queued behind it). The chunk at
  the head of a slot must finish within `timeout_s` of the moment it started (its submission to an idle
  actor, or the finish of the chunk before it): the first chunk's time includes the model load.
- A slot past its deadline, or whose actor died, is restarted (`Restart`: the shell kills the actor and
  starts a fresh one) and its chunks go back to the front of the queue, each marked to avoid the slot
  it failed on while another slot is free to take it.
- A chunk that failed `max_attempts` times is given up (`given_up`): its records are not written, so
  the next run on the same OUT tries them again.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Assign:
    """Submit chunk `chunk` to the actor of slot `slot`."""

    slot: int
    chunk: int


@dataclass(frozen=True)
class Restart:
    """Kill the actor of slot `slot` and start a fresh one; `chunks` (it held them) are queued again,
    `given_up` those among them that failed too often to be tried again."""

    slot: int
    chunks: tuple[int, ...]
    given_up: tuple[int, ...] = ()
    reason: str = ""


@dataclass
class _Slot:
    chunks: list[int] = field(default_factory=list)  # submitted, in submission order
    since: float = 0.0  # when the head chunk started


class ChunkDispatcher:
    """The chunk queue and the per-chunk deadline over `num_slots` generator actors (module docstring)."""

    def __init__(self, num_chunks: int, num_slots: int, timeout_s: float, *, per_slot: int = 2,
                 max_attempts: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        assert num_slots >= 1 and timeout_s > 0 and per_slot >= 1 and max_attempts >= 1
        self.timeout_s, self.per_slot, self.max_attempts, self.clock = float(timeout_s), per_slot, max_attempts, clock
        self.queue: deque[int] = deque(range(num_chunks))
        self.slots = [_Slot() for _ in range(num_slots)]
        self.attempts = [0] * num_chunks
        self.avoid: dict[int, set[int]] = {}  # chunk -> slots it failed on
        self.given_up: list[int] = []
        self.restarts = 0

    @property
    def finished(self) -> bool:
        """Nothing queued and nothing running."""
        return not self.queue and not any(s.chunks for s in self.slots)

    def assignments(self) -> list[Assign]:
        """Fill every slot up to `per_slot` chunks; a re-queued chunk goes to a slot it has not failed on
        when one has room."""
        out: list[Assign] = []
        while self.queue:
            chunk = self.queue[0]
            free = [i for i, s in enumerate(self.slots) if len(s.chunks) < self.per_slot]
            if not free:
                break
            fresh = [i for i in free if i not in self.avoid.get(chunk, ())]
            if not fresh and len(self.avoid.get(chunk, ())) < len(self.slots):
                break  # a slot it has not failed on will have room soon: wait for it
            slot = (fresh or free)[0]
            self.queue.popleft()
            if not self.slots[slot].chunks:
                self.slots[slot].since = self.clock()
            self.slots[slot].chunks.append(chunk)
            self.attempts[chunk] += 1
            out.append(Assign(slot, chunk))
        return out

    def done(self, slot: int, chunk: int) -> None:
        """Chunk `chunk` finished on `slot`: the next chunk there starts its time now."""
        s = self.slots[slot]
        if chunk in s.chunks:
            s.chunks.remove(chunk)
            s.since = self.clock()

    def failed(self, slot: int, reason: str = "its actor died") -> Restart:
        """The actor of `slot` is gone or wedged: its chunks go back to the front of the queue."""
        s = self.slots[slot]
        held, s.chunks = s.chunks, []
        again = [c for c in held if self.attempts[c] < self.max_attempts]
        dropped = tuple(c for c in held if self.attempts[c] >= self.max_attempts)
        for c in again:
            self.avoid.setdefault(c, set()).add(slot)
        self.queue.extendleft(reversed(again))
        self.given_up.extend(dropped)
        self.restarts += 1
        return Restart(slot, tuple(held), dropped, reason)

    def overdue(self) -> list[Restart]:
        """Restart every slot whose head chunk has run past `timeout_s`."""
        now = self.clock()
        late = [i for i, s in enumerate(self.slots) if s.chunks and now - s.since > self.timeout_s]
        return [self.failed(i, f"no chunk finished for {now - self.slots[i].since:.0f} s "
                               f"(the deadline is {self.timeout_s:g} s)") for i in late]

    def wait_s(self) -> float:
        """Seconds until the earliest deadline of a busy slot (how long the shell may block waiting)."""
        now = self.clock()
        left = [s.since + self.timeout_s - now for s in self.slots if s.chunks]
        return max(0.0, min(left)) if left else self.timeout_s
