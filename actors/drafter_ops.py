"""The step protocol's operations for one drafter rank, and the prefetch thread's pull.

`RankOps` carries out each effect `RankLoop` (app/training/loop.py) yields, for the `DrafterActor` that
drives it (actors/drafter.py): Ray calls to the pool (one pull and its payload fetch in flight in a worker
thread while the rank computes), the trainer, the process group's all-gather, the step log, checkpoints,
evaluation offers, fault hooks and the phases the supervisor's watchdog reads. `fetch_next` is that
worker thread's pull, which the transport benches time as it is.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from app.messages import Drained, DrafterPhase, EndOfStream, split_job_id
from app.payload.layers import layer_columns, select_layers
from app.payload.nixl_receive import NixlReceiver
from app.training.drafter_io import step_record
from app.training.effects import (AwaitPull, Checkpoint, Compute, Fetched, Gather, NonFinite, OfferEval, PullAnswered,
                                  ReadStop, Reduce, SendAcks, Sleep, StartPull, StepDone, StepStart, Updated)


class RankOps:
    """The step protocol's operations (app/training/loop.py) for one DrafterActor: Ray calls to the
    pool (one pull and its payload fetch in flight in a worker thread while the rank computes), the
    trainer, the process group, the step log, checkpoints, and the watchdog's phases."""

    def __init__(self, actor: Any, generation: int) -> None:  # actor: the DrafterActor
        self.a, self.generation = actor, generation
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: Future | None = None
        self.t_step = time.perf_counter()
        self.last_ckpt: str | None = None
        self.skipped = 0  # jobs of skipped non-finite steps
        # pool.transport=nixl payloads into reused buffers (pinned on CUDA: staged from in place); others pass through
        cuda = actor.device.type == "cuda"
        self.receiver = NixlReceiver(pin=cuda)
        if cuda and actor.stager.store is None:
            actor.stager.store = self.receiver

    def close(self) -> None:
        """Free the stager's and the receiver's buffers once no pull is in flight (one still running uses them)."""
        if self.pending is None or self.pending.done():
            self.receiver.close()
            self.a.stager.close()

    def step_start(self, _: StepStart) -> None:
        self.t_step = time.perf_counter()

    def start_pull(self, eff: StartPull) -> None:
        self.pending = self.executor.submit(self._fetch, list(eff.acks))

    def pull_answered(self, _: PullAnswered) -> bool:
        return self.pending is None or self.pending.done()

    def await_pull(self, _: AwaitPull) -> Fetched:
        assert self.pending is not None, "the loop awaits a pull it never started"
        self.a._enter(DrafterPhase.WAIT_DATA)
        t0 = time.perf_counter()
        item, payload = self.pending.result()
        self.pending = None
        self.a._enter(DrafterPhase.COMPUTE)
        return Fetched(item, payload, time.perf_counter() - t0)

    def _fetch(self, acks: list[int]):
        return fetch_next(self.a.pool, self.a.rank, self.generation, acks, self._stage,
                          receive=self.receiver.receive)

    def _stage(self, batch):
        """A run of a sweep takes its own layers out of the union the targets captured, then stages."""
        captured = self.a.cfg.feature_layer_ids
        columns = layer_columns(captured, self.a.cfg.layer_ids) if captured else None
        if columns is not None:
            batch = select_layers(batch, columns, len(captured))
        return self.a.stager.stage(batch)

    def compute(self, eff: Compute) -> None:
        from app.model.loss import TrainBatch

        a, job_id = self.a, eff.item.meta.job_id
        a.epoch = max(a.epoch, split_job_id(job_id)[0])
        if isinstance(eff.payload, TrainBatch):  # staged on the GPU by the prefetch thread
            batch = a.stager.ready(eff.payload)
        else:
            batch = TrainBatch.from_hidden_batch(eff.payload, a.device, a.dtype)
        a.trainer.micro_step(batch, job_id)

    def send_acks(self, eff: SendAcks) -> None:
        import ray

        ray.get(self.a.pool.ack.remote(self.a.rank, list(eff.job_ids), self.generation))

    def read_stop(self, _: ReadStop) -> bool:
        import ray

        return bool(ray.get(self.a.pool.stop_requested.remote()))

    def reduce(self, eff: Reduce):
        self.a._maybe_stall(eff.eos)
        self.a._enter(DrafterPhase.COLLECTIVE)
        stats = self.a.trainer.finish_step(stop_requested=eff.stop, eos=eff.eos)
        self.a.step_now = self.a.trainer.step
        return stats

    def sleep(self, eff: Sleep) -> None:
        time.sleep(eff.seconds)

    def updated(self, eff: Updated) -> None:
        self.a._maybe_crash(eff.step)

    def nonfinite(self, eff: NonFinite) -> None:
        if eff.halt:  # the driver says it, in one line, from the result
            return
        self.skipped += len(eff.job_ids)
        if self.a.rank == 0:
            print(f"WARNING: step {eff.step} not applied ({eff.reason}); train.on_nonfinite=skip: its jobs are "
                  "counted as skipped_nonfinite, not learned", flush=True)

    def gather(self, eff: Gather) -> list[list[int]]:
        import torch.distributed as dist

        gathered: list[list[int]] = [[] for _ in range(self.a.cfg.world_size)]
        dist.all_gather_object(gathered, list(eff.job_ids))
        return gathered

    def step_done(self, eff: StepDone) -> None:
        a = self.a
        a.ledger.update(j for ids in eff.gathered for j in ids)
        if a.step_log:  # before any checkpoint of this step
            a.step_log.step(eff.step, eff.gathered)
        step_s = time.perf_counter() - self.t_step
        a.pool.report_step.remote(  # fire and forget: telemetry must not slow the step
            step_record(a.rank, eff.step, a.epoch, eff.totals, eff.job_ids, step_s, eff.wait_s))

    def checkpoint(self, _: Checkpoint) -> None:
        self.a._enter(DrafterPhase.COMPUTE)
        self.last_ckpt = self.a.save()

    def offer_eval(self, eff: OfferEval) -> None:
        """Rank 0: put the current weights in the object store for an evaluation on a target; the pool
        keeps the newest offer. Fire and forget: training goes on at once (app/run/evaluate/runner.py)."""
        import ray

        from app.model.live_eval import weights_to_numpy
        from app.training.retry import transient_object_errors, with_retries

        weights = weights_to_numpy(self.a.trainer.drafter)
        self.a.pool.offer_eval.remote(eff.step, [with_retries(lambda: ray.put(weights), transient_object_errors())])


def fetch_next(pool, rank: int, generation: int, acks: list[int], stage, on_pulled=None, receive=None):
    """The prefetch thread's work: pull one item (acks riding along) and fetch and `stage` its payload.
    Returns (pulled, staged payload), or (EndOfStream | Drained, None). `python -m app.bench transport`
    times this same function (`on_pulled()` marks the pull's answer). `receive` (a `NixlReceiver`'s) reads
    a `pool.transport=nixl` payload out of its target (a blocking get: NIXL refs cannot be awaited); a
    target that died before the read raises OwnerDiedError, an ObjectLostError: re-queued as below."""
    import ray
    from ray.exceptions import ObjectLostError

    from app.training.retry import transient_object_errors, with_retries

    transient = transient_object_errors()  # a full store, a timed-out fetch: tried again before giving up the job
    while True:
        pulled = ray.get(pool.pull.remote(rank, generation, acks))
        acks = []
        if isinstance(pulled, (EndOfStream, Drained)):
            return pulled, None
        if on_pulled is not None:
            on_pulled()
        try:  # CUDA: the stager copies it to the GPU (pinned, side stream), in this thread
            get = (lambda: receive(ray.get(pulled.payload_ref))) if receive else (lambda: ray.get(pulled.payload_ref))
            return pulled, stage(with_retries(get, transient))
        except ObjectLostError:  # the node holding it died: recompute that job, pull another
            ray.get(pool.payload_lost.remote(rank, pulled.meta.job_id, generation))
