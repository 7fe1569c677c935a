"""Extra GPUs: free resources the cluster gained are offered to the side the advisor names. Pure (no Ray).

The topology's GPUs are split between targets and drafters; a re-split moves them between the roles
(`app/run/elastic/resplit.py`), a growth takes back bundles lost with a node (`app/run/elastic/grow.py`). When the
cluster has room for more than the topology asked for (a node added, another job finished), and
`topology.max_extra_gpus` allows it, `ExtraPlanner` decides whether the run takes one more bundle and
for which side, from the split advisor's estimate, a probe of the free resources and a clock:
- the side is the one the advisor names as short (`bound_now`): one more bundle of that side's shape
  (`gpus_per_target`/`cpus_per_target` or the drafters'), never of the other;
- its gain is the advisor's model for one more actor of that side, min(t x target rate, d x drafter
  rate) against the same for the current split; a target is cheap (it joins the pool, no checkpoint),
  so it is enough that the gain passes the advisor's MIN_GAIN; a drafter costs a checkpoint and a
  group rebuild, so its gain must pass `rebalance_min_gain`, like a re-split;
- the free resources must hold a whole bundle of that shape, and the choice must stay the same for
  `hold_s` (nodes often join one after another);
- the extra GPUs of the run stay within `max_extra_gpus` (a bundle without GPUs, a CPU topology's,
  counts as one, as the advisor counts actors there); one at a time: the next waits until `done` or
  `failed`, and after an extra the advisor measures the new split afresh before it advises again.
The Ray shell (`app/run/elastic/extra_shell.py`) creates a placement group of the one bundle and puts a target
slot or a drafter rank in it (the drafter group rebuilt from a checkpoint by the growth's path).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from app.run.elastic.advisor import MIN_GAIN

SIDES = ("targets", "drafters")


def bundle_shape(topo, side: str, use_gpu: bool) -> dict[str, float]:
    """The placement-group bundle of one actor of `side`, as `actor_bundles` makes the topology's."""
    cpus, gpus = ((topo.cpus_per_target, topo.gpus_per_target) if side == "targets"
                  else (topo.cpus_per_drafter, topo.gpus_per_drafter))
    return {"CPU": cpus, "GPU": gpus} if use_gpu and gpus > 0 else {"CPU": cpus}


def units(shape: dict[str, float]) -> float:
    """What one bundle counts against max_extra_gpus: its GPUs, or 1 for a bundle without any."""
    return shape.get("GPU", 0) or 1.0


def fits(free: dict[str, float], shape: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in shape.items())


@dataclass(frozen=True)
class Extra:
    """Take one more bundle of `shape` for `side`: the split goes from `old` to `new`."""

    number: int  # 1 for the run's first extra bundle
    side: str  # targets | drafters
    old: tuple[int, int]
    new: tuple[int, int]
    shape: dict[str, float] = field(hash=False)
    gpus: float  # counted against max_extra_gpus
    target_tok_s: float
    drafter_tok_s: float
    gain_estimated: float
    why: str

    def to_dict(self) -> dict:
        return {**asdict(self), "old": list(self.old), "new": list(self.new)}


def side_gain(split: tuple[int, int], side: str, target_tok_s: float, drafter_tok_s: float) -> float:
    """The advisor's model: predicted tokens/s with one more actor of `side`, over the current, minus 1."""
    t, d = split
    current = min(t * target_tok_s, d * drafter_tok_s)
    t, d = (t + 1, d) if side == "targets" else (t, d + 1)
    return min(t * target_tok_s, d * drafter_tok_s) / current - 1 if current > 0 else 0.0


class ExtraPlanner:
    """Decides extra bundles from advisor estimates and free resources; `observe` returns the actions."""

    def __init__(self, max_extra_gpus: float, min_gain: float, hold_s: float, mode: str = "auto") -> None:
        self.max_extra_gpus, self.min_gain, self.hold_s = max_extra_gpus, min_gain, hold_s
        self.enabled = mode == "auto" and max_extra_gpus > 0
        self.used = 0.0  # extra GPUs (units) the run holds
        self.pending: Extra | None = None
        self.done_count = 0
        self.why_not = ""  # for the status line
        self.history: list[dict] = []
        self._candidate: tuple | None = None
        self._since = 0.0

    @classmethod
    def for_topology(cls, topo) -> "ExtraPlanner":
        return cls(topo.max_extra_gpus, topo.rebalance_min_gain, topo.rebalance_hold_s, topo.rebalance)

    def observe(self, now: float, est, split: tuple[int, int], free: dict[str, float] | None,
                shapes: dict[str, dict[str, float]], blocked: bool = False) -> list[Extra]:
        """`est`: the advisor's SplitAdvice (None before it has its samples); `split`: (targets, drafters)
        running now; `free`: the cluster's free resources (None: not probed yet); `shapes`: side -> bundle."""
        if not self.enabled or self.pending is not None:
            return []
        want, why = self._want(est, split, free, shapes) if not blocked else (None, "")
        if why:
            self.why_not = why
        side = want[0] if want else None  # the side must hold; its gain moves with every estimate
        if side != self._candidate:
            self._candidate, self._since = side, now
            return []
        if want is None or now - self._since < self.hold_s:
            return []
        gain = want[1]
        shape = shapes[side]
        new = (split[0] + 1, split[1]) if side == "targets" else (split[0], split[1] + 1)
        self.pending = Extra(self.done_count + 1, side, tuple(split), new, dict(shape), units(shape),
                             est.target_tok_s, est.drafter_tok_s, gain,
                             f"the cluster has room for one more {side[:-1]} bundle {shape} and the {side} "
                             f"are the short side (estimated {100 * gain:+.0f}% tokens/s)")
        self.why_not = ""
        self.history.append({"k": "extra", **self.pending.to_dict()})
        return [self.pending]

    def done(self) -> None:
        """The pending extra bundle is in the run."""
        extra, self.pending = self.pending, None
        self._candidate = None
        if extra is not None:
            self.used += extra.gpus
            self.done_count += 1
            self.history[-1]["done"] = True

    def failed(self, reason: str) -> None:
        """The pending extra bundle could not be had (its placement group was not placed in time, the
        rebuild failed): said on the status line; asked for again once the choice holds anew."""
        extra, self.pending = self.pending, None
        self._candidate, self.why_not = None, reason
        if extra is not None:
            self.history[-1]["failed"] = reason

    def status(self) -> str:
        """The status line's word on extra GPUs: '' when there is nothing to say."""
        if not self.enabled:
            return ""
        if self.pending is not None:
            return f"taking an extra {self.pending.side[:-1]} bundle"
        return f"no extra GPUs: {self.why_not}" if self.why_not else ""

    def summary(self) -> dict:
        """For summary.json: the extra GPUs taken, and each extra bundle asked for."""
        return {"extra_gpus": self.used, "extra_bundles": self.done_count, "extra_history": list(self.history)}

    # ---- internals ------------------------------------------------------------------------

    def _want(self, est, split, free, shapes) -> tuple[tuple[str, float] | None, str]:
        if est is None:
            return None, ""
        side = est.bound_now  # the short side limits the current split
        shape = shapes[side]
        if self.used + units(shape) > self.max_extra_gpus + 1e-9:
            return None, (f"topology.max_extra_gpus={self.max_extra_gpus:g} reached "
                          f"({self.used:g} taken, a {side[:-1]} bundle needs {units(shape):g})")
        gain = side_gain(split, side, est.target_tok_s, est.drafter_tok_s)
        threshold = MIN_GAIN if side == "targets" else self.min_gain
        if gain <= threshold:
            return None, (f"one more {side[:-1]} would gain {100 * gain:+.0f}% tokens/s, not above "
                          f"{100 * threshold:.0f}%")
        if free is None or not fits(free, shape):
            return None, f"the cluster has no room for a {side[:-1]} bundle {shape} beyond the run's"
        return (side, gain), ""
