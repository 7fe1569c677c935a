"""Growth: when bundles lost with a node can be placed again, the run takes them back. Pure (no Ray).

A node loss leaves some of the placement group's bundles without a node. The drafter group is then
rebuilt on the ranks that still have one (`DrafterGroup.rebuild`), and a target whose bundle found no
node spends its restart budget and is given up. Ray re-places a placement group's bundles by itself
once a node with room joins (a node added, or the lost one back); `GrowthPlanner` decides what the
run does about it, from which lost bundles a probe found placed and a clock:
- drafters (`Grow`): once the set of lost drafter bundles that are placed again has stayed the same
  for `settle_s` (nodes often join one after another: one growth for all of them, not one each),
  the group grows back to every drafter bundle that is placed. The Ray shell (`app/run/elastic/grow_shell.py`)
  carries it out at a checkpoint boundary, by the re-split's own stop and rebuild path
  (`app/run/elastic/resplit_shell.py`): the same guarantees, every job trained once and the loss continuous.
- targets (`ReturnTarget`): a given-up target slot whose bundle is placed again starts anew, with a
  fresh restart budget. No checkpoint is needed: a target joining the pool changes no trained job.
No decision is taken while `blocked` (a re-split or a stop under way, the group not running).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

GROW_SETTLE_S = 10.0  # the placed-again set must hold this long before the group grows


@dataclass(frozen=True)
class Grow:
    """Rebuild the drafter group from `old` ranks to `new`, on `bundles` (every drafter bundle placed)."""

    number: int  # 1 for the run's first growth
    old: int
    new: int
    configured: int  # the topology's drafter count: a growth back to it is complete
    bundles: tuple[int, ...]
    why: str

    def to_dict(self) -> dict:
        return {**asdict(self), "bundles": list(self.bundles)}


@dataclass(frozen=True)
class ReturnTarget:
    """Start target slot `target_id` again: its bundle is placed on a live node again."""

    target_id: int
    bundle: int
    why: str


class GrowthPlanner:
    """Decides growths from probes of the lost bundles; `observe` and `targets` return the actions."""

    def __init__(self, settle_s: float = GROW_SETTLE_S) -> None:
        self.settle_s = settle_s
        self.pending: Grow | None = None
        self.history: list[dict] = []  # every growth asked for, then done, for summary.json
        self.done_count = 0
        self._candidate: tuple[int, ...] = ()
        self._since = 0.0
        self._targets_lost: set[int] = set()  # given-up target slots seen without a node

    def observe(self, now: float, group: list[int], drafter_bundles: list[int], placed: set[int],
                blocked: bool = False) -> list[Grow]:
        """`group`: the bundles the running group's ranks sit in; `drafter_bundles`: every bundle the
        drafters own; `placed`: bundles a probe found on a live node."""
        if self.pending is not None:
            return []
        back = tuple(sorted(b for b in drafter_bundles if b not in group and b in placed))
        if blocked or back != self._candidate:  # a change (or a pause) starts the settle time afresh
            self._candidate, self._since = (() if blocked else back), now
            return []
        if not back or now - self._since < self.settle_s:
            return []
        bundles = tuple(b for b in drafter_bundles if b in group or b in back)
        lost = len(drafter_bundles) - len(bundles)
        why = (f"bundles {list(back)} lost with a node are placed again"
               + (f" ({lost} still without a node)" if lost else ""))
        self.pending = Grow(self.done_count + 1, len(group), len(bundles), len(drafter_bundles), bundles, why)
        self.history.append({"k": "grow", **self.pending.to_dict()})
        return [self.pending]

    def done(self, size: int) -> None:
        """The pending growth was carried out: the group runs with `size` ranks."""
        grow, self.pending = self.pending, None
        self.done_count += 1
        self._candidate = ()
        if grow is not None and self.history:
            self.history[-1]["done_size"] = size

    def failed(self, reason: str) -> None:
        """The pending growth could not be carried out (the run stopped, the rebuild failed)."""
        grow, self.pending = self.pending, None
        self._candidate = ()
        if grow is not None and self.history:
            self.history[-1]["failed"] = reason

    def targets(self, given_up: dict[int, int], placed: set[int], unplaced: set[int]) -> list[ReturnTarget]:
        """`given_up`: target slot -> its bundle, for the slots given up (not those a re-split retired);
        `unplaced`: bundles a probe has waited on long enough to call them without a node. Only a slot
        seen without a node comes back: one given up on a placed bundle (a target that kept crashing)
        would only crash again."""
        self._targets_lost = {t for t in self._targets_lost if t in given_up}
        self._targets_lost |= {t for t, b in given_up.items() if b in unplaced}
        back = [ReturnTarget(tid, b, f"target {tid}'s bundle {b} is placed on a live node again")
                for tid, b in sorted(given_up.items()) if tid in self._targets_lost and b in placed]
        self._targets_lost -= {r.target_id for r in back}
        return back

    def summary(self) -> dict:
        """For summary.json: how many growths, and each (old size, new size, why)."""
        return {"growths": self.done_count, "growth_history": list(self.history)}
