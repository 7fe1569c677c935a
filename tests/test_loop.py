"""The drafter rank's step protocol (app/training/loop.py), without Ray: several ranks' loops in lockstep
over a fake pool and a fake reduce, each rank's effects logged and compared with the exact sequence."""
from __future__ import annotations

from collections import deque

from app.messages import Drained, EndOfStream, ItemMeta, PulledItem
from app.training.effects import LoopConfig, LoopOutcome, Reduce, StepTotals, sum_votes
from app.training.loop import LATER, QuietHooks, RankLoop, Runner, drive


def item(job_id: int) -> PulledItem:
    return PulledItem(ItemMeta(job_id, 0, 1, 8, 4, 64, 0, 0.0), None)


class FifoPool:
    """The real pool's answers in FIFO order: an item while any is buffered, Drained while leases are
    out, EndOfStream once every job is acked; at most `capacity` leases (a full budget holds a pull)."""

    def __init__(self, jobs, capacity: int = 10**9) -> None:
        self.buffer, self.leased, self.acked, self.capacity = deque(jobs), {}, [], capacity

    def ack(self, rank: int, job_ids) -> None:
        for j in job_ids:
            assert self.leased.pop(j) == rank, f"job {j} acked by rank {rank}, which does not hold it"
            self.acked.append(j)

    def answer(self, rank: int):
        if not self.buffer and not self.leased:
            return EndOfStream()
        if not self.buffer:
            return Drained()
        if len(self.leased) >= self.capacity:
            return None  # the pull waits at the pool
        j = self.buffer.popleft()
        self.leased[j] = rank
        return item(j)


class ScriptedPool:
    """Each rank's pulls answered in the order its script gives (ints are items)."""

    def __init__(self, scripts: dict[int, list]) -> None:
        self.scripts, self.acked = {r: deque(s) for r, s in scripts.items()}, []

    def ack(self, rank: int, job_ids) -> None:
        self.acked += job_ids

    def answer(self, rank: int):
        got = self.scripts[rank].popleft()
        return item(got) if isinstance(got, int) else got


def label(got) -> object:
    return {Drained: "drained", EndOfStream: "eos"}.get(type(got), getattr(getattr(got, "meta", None), "job_id", None))


class RankOps(QuietHooks):
    """One rank's operations: logs every effect; the collectives park the rank (LATER) in its group."""

    def __init__(self, group: "Group", rank: int, cfg: LoopConfig) -> None:
        self.g, self.rank, self.log = group, rank, []
        self.runner = Runner(RankLoop(cfg), self)
        self.answer = None

    def _poll(self) -> None:
        if self.answer is None:  # a waiting pull is answered as soon as the pool can
            self.answer = self.g.pool.answer(self.rank)

    def start_pull(self, eff) -> None:
        self.log.append(("pull", eff.acks))
        self.g.pool.ack(self.rank, eff.acks)  # acks land with their pull, before its answer
        self.answer = None
        self._poll()

    def pull_answered(self, eff) -> bool:
        self._poll()
        self.log.append(("answered?", self.answer is not None))
        return self.answer is not None

    def await_pull(self, eff):
        from app.training.effects import Fetched

        self._poll()
        assert self.answer is not None, f"rank {self.rank} blocks in a pull nothing can answer: deadlock"
        got, self.answer = self.answer, None
        self.log.append(("got", label(got)))
        return Fetched(got)

    def compute(self, eff) -> None:
        self.log.append(("compute", eff.item.meta.job_id))

    def send_acks(self, eff) -> None:
        self.log.append(("ack", eff.job_ids))
        self.g.pool.ack(self.rank, eff.job_ids)

    def read_stop(self, eff) -> bool:
        self.log.append(("read_stop",))
        self.g.reads += 1
        return self.g.stop_on_read is not None and self.g.reads >= self.g.stop_on_read

    def reduce(self, eff):
        self.log.append(("reduce", eff.items, eff.eos, eff.stop))
        return self.g.arrive("reduce", self.rank, eff)

    def sleep(self, eff) -> None:
        self.log.append(("sleep", eff.seconds))

    def updated(self, eff) -> None:
        self.log.append(("updated", eff.step))

    def gather(self, eff):
        self.log.append(("gather", eff.job_ids))
        return self.g.arrive("gather", self.rank, list(eff.job_ids))

    def step_done(self, eff) -> None:
        self.log.append(("done", eff.step, [list(ids) for ids in eff.gathered]))

    def checkpoint(self, eff) -> None:
        self.log.append(("checkpoint", eff.step, eff.final))

    def offer_eval(self, eff) -> None:
        self.log.append(("eval", eff.step))


class Group:
    """Ranks in lockstep: a collective releases once every rank arrived, then the ranks resume in `order`."""

    def __init__(self, pool, ranks: int, accum: int, order=None, stop_on_read=None, **cfg) -> None:
        self.pool, self.order, self.stop_on_read, self.reads = pool, order or range(ranks), stop_on_read, 0
        self.ranks = [RankOps(self, r, LoopConfig(r, ranks, accum, **cfg)) for r in range(ranks)]
        self.came: dict[str, dict[int, object]] = {}
        self.released, self.steps = None, cfg.get("start_step", 0)

    def arrive(self, kind: str, rank: int, value):
        came = self.came.setdefault(kind, {})
        came[rank] = value
        if len(came) == len(self.ranks):
            values = [came[r] for r in range(len(self.ranks))]
            del self.came[kind]
            self.released = values
            if kind == "reduce":
                self.released = sum_votes(values, self.steps)
                self.steps = self.released.step
        return LATER

    def run(self) -> list[LoopOutcome]:
        for r in self.ranks:
            r.runner.resume()
        while self.released is not None:
            result, self.released = self.released, None
            for r in self.order:
                self.ranks[r].runner.resume(result)
        assert all(r.runner.done for r in self.ranks), "a rank waits in a collective the others never joined"
        return [r.runner.outcome for r in self.ranks]

    def log(self, rank: int) -> list:
        return self.ranks[rank].log


def test_all_ranks_drained_while_a_lease_awaits_its_ack_sleep_then_pull_again():
    """Rank 0 holds job 0's ack for its next pull; rank 1 pulls first and gets Drained with nothing: the
    group steps with zero items, sleeps 50 ms and pulls again, instead of blocking in a pull (deadlock)."""
    g = Group(FifoPool([0]), ranks=2, accum=2, order=[1, 0])
    assert g.run() == [LoopOutcome(1, False), LoopOutcome(1, False)]
    assert g.log(0) == [
        ("pull", ()), ("got", 0), ("pull", ()), ("compute", 0), ("got", "drained"), ("read_stop",),
        ("reduce", 1, False, False), ("updated", 1), ("gather", (0,)), ("done", 1, [[0], []]),
        ("pull", (0,)), ("got", "eos"), ("read_stop",), ("reduce", 0, True, False),
        ("sleep", 0.05),
        ("read_stop",), ("reduce", 0, True, False),
        ("checkpoint", 1, True)]
    assert g.log(1) == [
        ("pull", ()), ("got", "drained"), ("reduce", 0, False, False),
        ("updated", 1), ("gather", ()), ("done", 1, [[0], []]),
        ("pull", ()), ("got", "drained"), ("reduce", 0, False, False),
        ("sleep", 0.05),
        ("pull", ()), ("got", "eos"), ("reduce", 0, True, False)]
    assert g.pool.acked == [0]


def test_acks_go_after_the_reduce_and_ride_on_the_next_pull():
    g = Group(FifoPool(range(4)), ranks=1, accum=2)
    assert g.run() == [LoopOutcome(2, False)]
    assert g.log(0) == [
        ("pull", ()), ("got", 0), ("pull", ()), ("compute", 0), ("got", 1), ("pull", ()), ("compute", 1),
        ("read_stop",), ("reduce", 2, False, False), ("updated", 1), ("answered?", True),
        ("gather", (0, 1)), ("done", 1, [[0, 1]]),
        ("got", 2), ("pull", (0, 1)), ("compute", 2), ("got", 3), ("pull", ()), ("compute", 3),
        ("read_stop",), ("reduce", 2, False, False), ("updated", 2), ("answered?", True),
        ("gather", (2, 3)), ("done", 2, [[2, 3]]),
        ("got", "drained"), ("read_stop",), ("reduce", 0, False, False), ("sleep", 0.05),
        ("pull", (2, 3)), ("got", "eos"), ("read_stop",), ("reduce", 0, True, False),
        ("checkpoint", 2, True)]
    assert g.pool.acked == [0, 1, 2, 3]


def test_acks_go_at_once_while_a_pull_waits_for_them():
    """The rank's own two leases fill the pool's budget, so its prefetch waits until they are acked:
    holding the acks for the next pull would block the rank in that pull forever."""
    g = Group(FifoPool(range(4), capacity=2), ranks=1, accum=2)
    assert g.run() == [LoopOutcome(2, False)]
    assert g.log(0)[6:16] == [
        ("compute", 1), ("read_stop",), ("reduce", 2, False, False), ("updated", 1), ("answered?", False),
        ("ack", (0, 1)), ("gather", (0, 1)), ("done", 1, [[0, 1]]), ("got", 2), ("pull", ())]
    assert [e for e in g.log(0) if e[0] in ("pull", "ack")] == [
        ("pull", ()), ("pull", ()), ("pull", ()), ("ack", (0, 1)), ("pull", ()), ("pull", ()), ("pull", (2, 3))]
    assert g.pool.acked == [0, 1, 2, 3]


def test_a_stop_rank_0_reads_ends_every_rank_after_that_step():
    g = Group(FifoPool(range(100)), ranks=2, accum=1, stop_on_read=2, checkpoint_every=2)
    assert g.run() == [LoopOutcome(2, True), LoopOutcome(2, True)]
    assert g.log(0)[-8:] == [
        ("compute", 1), ("read_stop",), ("reduce", 1, False, True), ("updated", 2), ("answered?", True),
        ("gather", (1,)), ("done", 2, [[1], [3]]), ("checkpoint", 2, True)]  # no cadence checkpoint, no pull
    assert g.log(1)[-7:] == [
        ("pull", (2,)), ("compute", 3), ("reduce", 1, False, False), ("updated", 2), ("answered?", True),
        ("gather", (3,)), ("done", 2, [[1], [3]])]
    assert ("read_stop",) not in g.log(1)


def test_a_rank_at_end_of_stream_joins_every_later_reduce_with_zero_items():
    """Rank 0's stream ends in step 2, rank 1's in step 4: rank 0 votes (0 items, eos) in steps 2-4
    without pulling, and the loops end together once both are at end-of-stream."""
    g = Group(ScriptedPool({0: [0, Drained(), EndOfStream()],
                            1: [1, 2, 3, 4, 5, Drained(), EndOfStream()]}), ranks=2, accum=2)
    assert g.run() == [LoopOutcome(3, False), LoopOutcome(3, False)]
    votes = [[e[1:3] for e in g.log(r) if e[0] == "reduce"] for r in range(2)]
    assert votes == [[(1, False), (0, True), (0, True), (0, True)], [(2, False), (2, False), (1, False), (0, True)]]
    assert [e for e in g.log(0) if e[0] == "pull"] == [("pull", ()), ("pull", ()), ("pull", (0,))]
    assert [e for e in g.log(1) if e[0] == "pull"] == [
        ("pull", ()), ("pull", ()), ("pull", ()), ("pull", (1, 2)), ("pull", ()), ("pull", (3, 4)), ("pull", (5,))]
    assert [e for e in g.log(0) if e[0] == "done"] == [
        ("done", 1, [[0], [1, 2]]), ("done", 2, [[], [3, 4]]), ("done", 3, [[], [5]])]
    assert sorted(g.pool.acked) == list(range(6))


def test_a_rank_that_never_gets_data_joins_every_step_with_nothing():
    g = Group(FifoPool([0, 1]), ranks=2, accum=2)
    assert g.run() == [LoopOutcome(1, False), LoopOutcome(1, False)]
    assert g.log(1) == [
        ("pull", ()), ("got", "drained"), ("reduce", 0, False, False),
        ("updated", 1), ("gather", ()), ("done", 1, [[0, 1], []]),
        ("pull", ()), ("got", "drained"), ("reduce", 0, False, False), ("sleep", 0.05),
        ("pull", ()), ("got", "eos"), ("reduce", 0, True, False)]
    assert [e for e in g.log(0) if e[0] in ("compute", "pull")] == [
        ("pull", ()), ("pull", ()), ("compute", 0), ("pull", ()), ("compute", 1), ("pull", (0, 1))]
    assert g.pool.acked == [0, 1]


def test_nothing_left_to_train_ends_at_the_first_reduce_with_a_final_checkpoint():
    g = Group(FifoPool([]), ranks=2, accum=4, start_step=7)
    assert g.run() == [LoopOutcome(7, False), LoopOutcome(7, False)]
    assert g.log(0) == [("pull", ()), ("got", "eos"), ("read_stop",), ("reduce", 0, True, False),
                        ("checkpoint", 7, True)]
    assert g.log(1) == [("pull", ()), ("got", "eos"), ("reduce", 0, True, False)]


class Solo(RankOps):
    """A world of one with operations that answer at once: what `drive` needs."""

    def reduce(self, eff):
        self.log.append(("reduce", eff.items, eff.eos, eff.stop))
        self.g.steps = sum_votes([eff], self.g.steps).step
        return StepTotals(self.g.steps, int(eff.items > 0), int(eff.eos), eff.stop)

    def gather(self, eff):
        return [list(eff.job_ids)]


def test_drive_runs_rank_0s_checkpoint_and_eval_cadence():
    g = Group(FifoPool(range(5)), ranks=1, accum=1)
    ops = Solo(g, 0, LoopConfig(0, 1, 1))
    cfg = LoopConfig(0, 1, 1, checkpoint_every=2, eval_every=3)
    assert drive(RankLoop(cfg), ops) == LoopOutcome(5, False)
    assert [e for e in ops.log if e[0] in ("checkpoint", "eval")] == [
        ("checkpoint", 2, False), ("eval", 3), ("checkpoint", 4, False), ("checkpoint", 5, True)]
    assert g.pool.acked == [0, 1, 2, 3, 4]


def test_only_rank_0_checkpoints_and_offers_evals():
    g = Group(FifoPool(range(8)), ranks=2, accum=1, checkpoint_every=1, eval_every=1)
    g.run()
    assert [e[0] for e in g.log(0)].count("checkpoint") == 5 and [e[0] for e in g.log(0)].count("eval") == 4
    assert not [e for e in g.log(1) if e[0] in ("checkpoint", "eval", "read_stop")]


def test_sum_votes_counts_an_optimizer_step_only_when_a_rank_trained():
    votes = [Reduce(2, False, False), Reduce(0, True, True), Reduce(1, False, False)]
    assert sum_votes(votes, 4) == StepTotals(5, 2, 1, True)
    assert sum_votes([Reduce(0, False, False), Reduce(0, True, False)], 4) == StepTotals(4, 0, 1, False)


class NanAt(Solo):
    """A world of one whose reduce reports step `bad` non-finite (what the trainer's verdict says)."""

    def __init__(self, group, rank, cfg, bad: int, halt: bool) -> None:
        super().__init__(group, rank, cfg)
        self.bad, self.halt = bad, halt

    def reduce(self, eff):
        t = super().reduce(eff)
        if t.step != self.bad:
            return t
        return StepTotals(t.step, t.active_ranks, t.eos_ranks, t.stop, "loss=nan grad_norm=nan", self.halt)

    def nonfinite(self, eff):
        self.log.append(("nonfinite", eff.step, eff.job_ids, eff.halt))


def test_a_halting_nonfinite_step_ends_the_loop_with_no_ack_and_no_checkpoint():
    """Issue 22 item 4, stop: the step's jobs are not acked and no checkpoint follows (not even the final
    one), so nothing of the non-finite step is kept; the outcome says why."""
    g = Group(FifoPool(range(5)), ranks=1, accum=1)
    ops = NanAt(g, 0, LoopConfig(0, 1, 1), bad=3, halt=True)
    cfg = LoopConfig(0, 1, 1, checkpoint_every=1)
    assert drive(RankLoop(cfg), ops) == LoopOutcome(3, True, "loss=nan grad_norm=nan")
    assert [e for e in ops.log if e[0] in ("checkpoint", "nonfinite", "updated")] == [
        ("updated", 1), ("checkpoint", 1, False), ("updated", 2), ("checkpoint", 2, False),
        ("nonfinite", 3, (2,), True)]
    assert g.pool.acked == [0, 1]  # job 2 (the nan step's) never acked: the pool still holds its lease


def test_a_skipped_nonfinite_step_acks_its_jobs_and_goes_on():
    """Item 4, skip: the jobs are consumed (acked, announced as skipped) and training goes on."""
    g = Group(FifoPool(range(4)), ranks=1, accum=1)
    ops = NanAt(g, 0, LoopConfig(0, 1, 1), bad=2, halt=False)
    assert drive(RankLoop(LoopConfig(0, 1, 1)), ops) == LoopOutcome(4, False)
    assert [e for e in ops.log if e[0] == "nonfinite"] == [("nonfinite", 2, (1,), False)]
    assert g.pool.acked == [0, 1, 2, 3]
