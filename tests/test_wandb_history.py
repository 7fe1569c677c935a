"""wandb history (issue 25, item 5; issue 36): one row per optimizer step with the listed keys, tau in the row of
the step evaluated, the pool per bucket, events for faults and re-splits.

The logger is fed a recorded step stream through the real RunMonitor (two ranks reporting in separate
batches, as the pool relays them), not a Ray run: a tiny run takes minutes on CPU, and what reaches
wandb is the monitor's listener stream either way. The offline run file is read back from disk.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.config.run_sections import CheckpointConfig, LoggingConfig
from app.config.schema import Config, ModelConfig
from app.messages import StepRecord
from app.pool.telemetry import PoolStats, WaitSnapshot
from app.run.outputs.monitor import RunMonitor
from app.run.outputs.wandb_log import STEP_KEYS, StepRows, WandbLogger, read_history

STEPS, BLOCK = 6, 4


def _record(rank: int, step: int) -> StepRecord:
    return StepRecord(rank=rank, step=step, epoch=0, loss=3.0 - 0.1 * step, weight_sum=1.0, correct=0.1 * step,
                      tokens=100 + rank, accept_len=1.5, per_pos_acc=[0.5, 0.3, 0.1] if rank == 0 else [],
                      compute_s=0.9, data_wait_s=0.1 * (rank + 1), lr=1e-3 * step, grad_norm=2.0 + step)


def _stream():
    """Batches as the pool relays them: rank 1's record of a step often lands in the next batch."""
    batches, carry = [], []
    for step in range(1, STEPS + 1):
        batches.append(carry + [_record(0, step)])
        carry = [_record(1, step)]
    batches.append(carry)
    return batches


def test_step_rows_fold_ranks_into_one_row_per_step():
    rows = StepRows()
    out = [r for batch in _stream() for r in rows.add(batch)] + rows.flush()
    assert [r["step"] for r in out] == list(range(1, STEPS + 1))
    first = out[0]
    assert first["tokens"] == 201 and first["ranks"] == 2  # both ranks' tokens
    assert first["data_wait"] == pytest.approx(0.3 / (0.3 + 1.8))  # wait over wait + compute, both ranks
    assert (first["loss"], first["lr"], first["grad_norm"], first["acc_pos3"]) == (pytest.approx(2.9), 1e-3, 3.0, 0.1)
    # A rollback repeats step numbers: each attempt is its own row.
    again = StepRows()
    redo = again.add([_record(0, 3), _record(0, 4), _record(0, 3)]) + again.flush()
    assert [r["step"] for r in redo] == [3, 4, 3]


def _pool(i: int) -> PoolStats:
    """The pool snapshot of loop turn i: bucket 0 holds i items, bucket 1 twice that."""
    return PoolStats(q_hsb=[i, 2 * i], pool_bytes=0, capacity_bytes=0, capacity_items=64, pending=0, in_flight=0,
                     buffered=3 * i, leased=0, acked=0, total_jobs=0, pull_waits=WaitSnapshot(i, 0.0, 0.01, 0.05),
                     served_per_bucket=[10 * i, i], produced_per_bucket=[11 * i, 3 * i], in_flight_by_target={},
                     oldest_in_flight_age_s={}, done_by_target={}, tokens_by_target={0: 100 * i},
                     forward_s_by_target={}, leased_by_drafter={}, acked_twice=0, stale_results=0, stale_acks=0,
                     lost_payloads=0, bytes_overshoot=0, producing_finished=False, done=False)


@pytest.mark.slow
def test_offline_file_has_one_row_per_step_with_tau_and_the_pool(tmp_path: Path, monkeypatch) -> None:
    """Issue 36: tau and the best tau in the row of the step evaluated (no event rows), the pool per bucket
    at the status cadence; an evaluation given up on leaves its row without tau."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = replace(Config(model=ModelConfig(target="tiny")), checkpoint=CheckpointConfig(dir=str(tmp_path)),
                  logging=LoggingConfig(wandb_mode="offline"))
    monitor = RunMonitor(eval_every=2)  # what a run's monitor is built with: rank 0 offers steps 2, 4, 6
    logger = WandbLogger(cfg.logging, "history-run", cfg, monitor)
    for i, batch in enumerate(_stream()):
        monitor.add_records(batch)
        monitor.add_pool(_pool(i))
        logger.log(monitor.values())  # the status line: its numbers and the pool's ride on the next step row
        if i == 2:  # step 2's row is complete (step 3's first record came): its evaluation reports
            monitor.add_tau(2, 2.25)
            monitor.note("target 1 died -> job re-queued")
            monitor.resplit_event("resplit", old=[5, 3], new=[2, 6], gain=0.4)  # as the re-split shell sends it
        if i == 4:
            monitor.give_up_tau(4)  # timed out: step 4's row goes out without tau
    monitor.add_tau(STEPS, 2.0)  # the end-of-run evaluation, before the driver's finish()
    logger.finish({"tau_trained": 2.0})
    import wandb

    wandb.teardown()  # the service writes the run file after finish() returns: wait for it to end
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = read_history(run_file)
    steps = [r for r in history if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # one row per optimizer step, tau rows none
    for row in steps:
        assert set(STEP_KEYS) | {"acc_pos1", "acc_pos2", "acc_pos3"} <= set(row), row
        assert row["tokens"] == 201 and row["ranks"] == 2
        # The snapshot of the status line before the row was complete (the last row: at finish, after the last one).
        i = row["step"] - 1 if row["step"] < STEPS else STEPS
        assert (row["pool/bucket0/queued"], row["pool/bucket1/queued"], row["pool/bucket0/pulls"],
                row["pool/bucket1/produced"], row["pool/pull_waits"]) == (i, 2 * i, 10 * i, 3 * i, i)
    assert steps[-1]["lr"] == pytest.approx(6e-3) and steps[-1]["grad_norm"] == pytest.approx(8.0)
    assert "status/train_tok_s" in steps[-1] and "status/loss" not in steps[-1]  # run-level numbers only
    assert {r["step"]: (r["tau"], r["tau_best"]) for r in steps if "tau" in r} == {2: (2.25, 2.25), 6: (2.0, 2.25)}
    events = {r["event"]: r for r in history if "event" in r}
    assert set(events) == {"fault", "resplit"}
    assert events["fault"]["event_text"] == "target 1 died -> job re-queued" and events["fault"]["faults_total"] == 1
    assert events["resplit"]["resplit/gain"] == 0.4


@pytest.mark.slow
def test_each_run_of_a_sweep_gets_its_own_rows_while_both_are_live(tmp_path: Path, monkeypatch) -> None:
    """Issue 47: a sweep's runs log at once from one driver process, each into its own wandb run (before: a
    sweep logged nothing). Run a gets steps 1..6, run b steps 1..3, interleaved; each file holds its own."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers, monitors = {}, {}
    for name in ("a", "b"):
        cfg = replace(Config(model=ModelConfig(target="tiny")), logging=LoggingConfig(wandb_mode="offline"),
                      checkpoint=CheckpointConfig(dir=str(tmp_path / name)))
        monitors[name] = RunMonitor()
        loggers[name] = WandbLogger(cfg.logging, f"sweep-{name}", cfg, monitors[name], several=True)
    for i, batch in enumerate(_stream()):
        monitors["a"].add_records(batch)
        if i < 3:
            monitors["b"].add_records([_record(0, i + 1)])
    for logger in loggers.values():
        logger.finish({"tau_trained": 2.0})
    import wandb

    wandb.teardown()
    for name, steps in (("a", STEPS), ("b", 3)):
        (run_file,) = (tmp_path / name / "wandb").glob(f"offline-run-*-sweep-{name}/run-*.wandb")
        rows = [r for r in read_history(run_file) if "event" not in r]
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
        assert {r["ranks"] for r in rows} == ({2} if name == "a" else {1})
