"""Which global step ("round") each pull belongs to, inferred from the drafters' pull pattern.

A drafter pulls exactly grad_accum items per optimizer step, one outstanding pull at a time, unless
a pull returns `Drained`, after which it steps with what it holds. So the pool can number each
drafter's steps by counting: after `accum` items, or a Drained, its next pull opens the next round.
The ranks run in lockstep, so round r of every rank is the same global step. A payload lost in
transit is pulled again for the same slot; a rebuilt group starts every rank at a fresh round.
"""
from __future__ import annotations


class RoundTracker:
    def __init__(self, accum: int = 1, ranks: int | None = None) -> None:
        assert accum >= 1, accum
        self.accum = accum
        self.ranks = ranks  # None: as many as have pulled since the last reset
        self._round: dict[int, int] = {}
        self._taken: dict[int, int] = {}  # items in the drafter's current round
        self._base = 0

    def round(self, drafter_id: int) -> int:
        return self._round.setdefault(drafter_id, self._base)

    @property
    def step_items(self) -> int:
        """Items of one global step: ranks x grad_accum."""
        return max(1, self.ranks or len(self._round)) * self.accum

    def open_slots(self) -> dict[int, int]:
        """round -> items its ranks may still pull in it."""
        out: dict[int, int] = {}
        for d, r in self._round.items():
            out[r] = out.get(r, 0) + self.accum - self._taken.get(d, 0)
        return out

    def slots_in(self, rnd: int) -> dict[int, int]:
        """rank -> items it will still pull in round `rnd` (ranks not seen yet count as -1, -2, ...)."""
        out = {}
        for d, r in self._round.items():
            out[d] = self.accum - self._taken.get(d, 0) if r == rnd else (self.accum if r < rnd else 0)
        for k in range(max(0, (self.ranks or 0) - len(out))):
            out[-1 - k] = self.accum
        return out

    def took(self, drafter_id: int) -> None:
        r = self.round(drafter_id)
        n = self._taken.get(drafter_id, 0) + 1
        if n >= self.accum:
            self._round[drafter_id], n = r + 1, 0
        self._taken[drafter_id] = n

    def step_ended(self, drafter_id: int) -> None:
        """The drafter got Drained: it steps now, whatever it holds."""
        self._round[drafter_id] = self.round(drafter_id) + 1
        self._taken[drafter_id] = 0

    def untake(self, drafter_id: int) -> None:
        """The drafter's last item is lost and it pulls again for the same slot."""
        n = self._taken.get(drafter_id, 0)
        if n > 0:
            self._taken[drafter_id] = n - 1
        elif self.round(drafter_id) > self._base:
            self._round[drafter_id] -= 1
            self._taken[drafter_id] = self.accum - 1

    def restart(self, drafter_id: int) -> None:
        """One drafter restarted on its own: it joins the others' current round."""
        others = [r for d, r in self._round.items() if d != drafter_id]
        self._round[drafter_id] = max(others, default=self._base)
        self._taken[drafter_id] = 0

    def reset(self) -> None:
        """A rebuilt group: every rank starts a fresh round, past every round seen."""
        self._base = max(self._round.values(), default=self._base) + 2
        self._round.clear()
        self._taken.clear()
