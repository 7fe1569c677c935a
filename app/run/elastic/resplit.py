"""The split trigger: when to move GPUs between targets and drafters during a run. Pure (no Ray).

The split advisor (`app/run/elastic/advisor.py`) says which split of the same GPUs would train fastest;
`Rebalancer` decides whether the run acts on it. Fed the advisor's estimates, the run's cumulative
training tokens and a clock; it answers with typed actions the run's shell carries out
(`app/run/elastic/resplit_shell.py`: stop at a step boundary, checkpoint, move bundles, rebuild the group).

Rules (`topology.rebalance`):
- `off`: no advice on the status line, no action; `advise` (default): the advice is shown, nothing
  moves; `auto`: the rules below.
- A re-split is asked for (`Resplit`) once the advised split has stayed the same for `hold_s` seconds
  of estimates and its estimated gain exceeds `min_gain` (a re-split costs a checkpoint and a group
  rebuild, so a small gain is not worth it).
- At most `max_rebalances` per run; one at a time (the next waits until `done` or `refused`).
- Hysteresis: after a re-split (or a refusal) the rates it was decided on are kept; no further
  re-split until a side's measured rate moved by more than `min_gain` from them. With unchanged rates
  the best split is unchanged, so any new advice is noise: this is what keeps the split from
  oscillating, and why a split left once is never revisited on the same rates.
- Measured gain: the training tokens/s over `window_s` before the re-split against the first `window_s`
  after the new group trained again (`ResplitMeasured`), so a re-split that did not pay shows as a loss.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

MODES = ("off", "advise", "auto")
MIN_WINDOW_S = 10.0  # the measured-gain windows are at least this long


@dataclass(frozen=True)
class Resplit:
    """Move GPUs: from `old` (targets, drafters) to `new`, on the rates and estimated gain given."""

    number: int  # 1 for the run's first re-split
    old: tuple[int, int]
    new: tuple[int, int]
    target_tok_s: float  # per target, while computing (the advisor's rate)
    drafter_tok_s: float  # per drafter rank, while computing
    gain_estimated: float  # predicted tokens/s of `new` over `old`, minus 1

    def to_dict(self) -> dict:
        return {**asdict(self), "old": list(self.old), "new": list(self.new)}


@dataclass(frozen=True)
class ResplitMeasured:
    """The training tokens/s before a re-split and over the window after it."""

    number: int
    old: tuple[int, int]
    new: tuple[int, int]
    before_tok_s: float
    after_tok_s: float
    gain_estimated: float
    gain_measured: float  # after / before - 1: negative when the re-split did not pay

    def to_dict(self) -> dict:
        return {**asdict(self), "old": list(self.old), "new": list(self.new)}


class Rebalancer:
    """Decides re-splits from advisor estimates; `observe` and `tokens` return the actions to carry out."""

    def __init__(self, mode: str, hold_s: float, min_gain: float, max_rebalances: int, targets: int,
                 drafters: int, window_s: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"topology.rebalance={mode!r}: choose one of {', '.join(MODES)}")
        self.mode, self.hold_s, self.min_gain, self.max_rebalances = mode, hold_s, min_gain, max_rebalances
        self.split = (targets, drafters)
        self.window_s = max(MIN_WINDOW_S, hold_s) if window_s is None else window_s
        self.done_count = 0
        self.pending: Resplit | None = None
        self.anchor: tuple[float, float] | None = None  # rates of the last decision (hysteresis)
        self.why_not = ""  # the last refusal, for the status line
        self.history: list[dict] = []  # every re-split, then its measured gain, for summary.json
        self._candidate: tuple[int, int] | None = None
        self._since = 0.0
        self._tokens: deque[tuple[float, float]] = deque()  # (time, cumulative training tokens)
        self._after: tuple[Resplit, float, float, float] | None = None  # (re-split, before rate, t0, tokens0)

    @classmethod
    def for_topology(cls, topo, **kw) -> "Rebalancer":
        """From a `TopologyConfig`."""
        return cls(topo.rebalance, topo.rebalance_hold_s, topo.rebalance_min_gain, topo.max_rebalances,
                   topo.num_targets, topo.num_drafters, **kw)

    @property
    def shows_advice(self) -> bool:
        return self.mode != "off"

    # ---- inputs ---------------------------------------------------------------------------

    def observe(self, est, now: float) -> list[Resplit]:
        """An advisor estimate (a SplitAdvice with enough samples behind it, or None before that)."""
        if self.mode != "auto" or self.pending is not None:
            return []
        want = None
        if est is not None and (est.targets, est.drafters) != self.split and est.gain > self.min_gain \
                and (est.current_targets, est.current_drafters) == self.split:
            want = (est.targets, est.drafters)
        if want != self._candidate:
            self._candidate, self._since = want, now
            return []
        if want is None or now - self._since < self.hold_s or self.done_count >= self.max_rebalances:
            return []
        if not self._moved(est.target_tok_s, est.drafter_tok_s):
            return []
        self.pending = Resplit(self.done_count + 1, self.split, want, est.target_tok_s, est.drafter_tok_s, est.gain)
        self.anchor = (est.target_tok_s, est.drafter_tok_s)
        self.history.append({"k": "resplit", **self.pending.to_dict(), "before_tok_s": self._rate(now)})
        return [self.pending]

    def tokens(self, total: float, now: float) -> list[ResplitMeasured]:
        """The run's cumulative training tokens at `now`; the measured gain once its window is over."""
        self._tokens.append((now, total))
        while len(self._tokens) > 2 and now - self._tokens[0][0] > self.window_s:
            self._tokens.popleft()
        if self._after is None:
            return []
        rs, before, t0, tok0 = self._after
        if now - t0 < self.window_s:
            return []
        self._after = None
        after = (total - tok0) / (now - t0)
        measured = ResplitMeasured(rs.number, rs.old, rs.new, before, after, rs.gain_estimated,
                                   after / before - 1 if before > 0 else 0.0)
        self.history.append({"k": "resplit_measured", **measured.to_dict()})
        return [measured]

    def done(self, targets: int, drafters: int, now: float, tokens: float) -> None:
        """The pending re-split was carried out; the group trains again from `now` (with `tokens` trained)."""
        rs, self.pending = self.pending, None
        self.split, self.done_count, self.why_not = (targets, drafters), self.done_count + 1, ""
        self._candidate = None
        if rs is not None:
            self._after = (rs, self.history[-1]["before_tok_s"] if self.history else 0.0, now, tokens)

    def refused(self, reason: str) -> None:
        """The pending re-split cannot be carried out (why, for the status line); the rates it was
        decided on stay the anchor, so it is not asked for again until they move."""
        self.pending, self.why_not, self._candidate = None, reason, None
        if self.history and self.history[-1]["k"] == "resplit":
            self.history[-1]["refused"] = reason

    # ---- outputs --------------------------------------------------------------------------

    def status(self) -> str:
        """The status line's word on re-splits: '' when there is nothing to say."""
        if self.pending is not None:
            return f"re-split to {self.pending.new[0]}/{self.pending.new[1]} at the next step boundary"
        if self.why_not:
            return f"no re-split: {self.why_not}"
        return ""

    def summary(self) -> dict:
        """For summary.json: how many re-splits, and each with its measured gain."""
        return {"rebalances": self.done_count, "rebalance_mode": self.mode, "rebalance_history": list(self.history)}

    # ---- internals ------------------------------------------------------------------------

    def _moved(self, rt: float, rd: float) -> bool:
        if self.anchor is None:
            return True
        at, ad = self.anchor
        return max(abs(rt / at - 1) if at > 0 else 1.0, abs(rd / ad - 1) if ad > 0 else 1.0) > self.min_gain

    def _rate(self, now: float) -> float:
        if len(self._tokens) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self._tokens[0], self._tokens[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0
