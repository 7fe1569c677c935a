"""Issue 49, items 1, 2 and 6: the fence holds through the whole publish, the counter fails closed, and a
stale driver's own files are fenced. Local folders and the moto S3 of tests/s3_server.py; a faked clock;
each process's token table (`fence._mine`) swapped in turn, as tests/test_trust_lease.py does. No Ray.

A "pause" is a hook on the stale run's own storage calls: when it fires, the stale run is stopped right
there while run B takes the lease over, resumes and checkpoints; then the stale run goes on. Checked
against the code before this change (2f4199a): every test here failed there (the one check before the
upload let the paused run commit after the takeover and its prune deleted B's checkpoint; a deleted
counter read as 0 and let a stale holder publish, and gave B token 1; summary.json was written unfenced).
"""
from __future__ import annotations

import json
import pathlib
from pathlib import Path

import pytest
import torch

from app.run.lease import RunLease
from app.storage import fence
from app.storage.conditional import ConditionalStore
from app.storage.roots import open_storage
from app.storage.uri_storage import UriStorage
from app.training.checkpoint import TrainState, latest_checkpoint, list_checkpoints, save_checkpoint
from tests.helpers import storage_root


def _save(root: str, step: int, keep: int = 1) -> None:
    save_checkpoint(root, TrainState(step=step, epoch=0, ledger=[], drafter={"w": torch.full((4,), float(step))}), keep)


def _names(root: str) -> list[str]:
    return sorted(e.name for e in open_storage(root).entries("ckpt-"))


class Pause:
    """Stops the stale run once, at `where` ("after_check": right after its first fence check passed;
    "before_commit": right before the rename or the marker write of checkpoint `name`, after every
    check), and runs `meanwhile` (run B's takeover) there."""

    def __init__(self, monkeypatch, where: str, name: str, meanwhile) -> None:
        self.fired, self.armed, self.meanwhile = False, False, meanwhile
        real_check, real_rename = fence.check, pathlib.Path.rename
        real_write, real_put = UriStorage.write_file, ConditionalStore._put

        def fire() -> None:
            if self.armed and not self.fired:
                self.fired, self.armed = True, False
                self.meanwhile()
                self.armed = False

        def check(store):
            token = real_check(store)
            if where == "after_check":
                fire()
            return token

        def rename(path, target):
            if where == "before_commit" and Path(target).name == name:
                fire()
            return real_rename(path, target)

        def write_file(store, rel, data):
            if where == "before_commit" and rel == f"{name}/COMMITTED":
                fire()
            return real_write(store, rel, data)

        def put(store, rel, data, **condition):
            if where == "before_commit" and rel == f"{name}/COMMITTED":
                fire()
            return real_put(store, rel, data, **condition)

        monkeypatch.setattr(fence, "check", check)
        monkeypatch.setattr(pathlib.Path, "rename", rename)
        monkeypatch.setattr(UriStorage, "write_file", write_file)
        monkeypatch.setattr(ConditionalStore, "_put", put)


@pytest.mark.parametrize("where", ["after_check", "before_commit"])
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_run_paused_mid_publish_never_outlives_the_new_holder_s_checkpoint(kind, where, tmp_path, request,
                                                                             monkeypatch) -> None:
    """Run A (token 1) has ckpt-8 and is saving ckpt-12 (keep 1) when it pauses; meanwhile run B takes
    the lease over (token 2), resumes from ckpt-8 and saves ckpt-10. Then A goes on. Paused after its
    first check, A is refused at the next one (before its commit); paused after its last check, its
    commit lands but it is refused at its prune, and its ckpt-12 (token 1, beyond B's ckpt-10) is not a
    resume point. Either way B's ckpt-10 survives and is the latest; B's next save removes what A left.
    Before: one check before the upload; A committed ckpt-12 and its prune deleted ckpt-8 and B's
    ckpt-10, leaving A's the folder's only checkpoint."""
    root, now, a_tables, b_tables = storage_root(kind, tmp_path, request, "pause"), [1000.0], {}, {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    _save(root, 8)
    resumed = []

    def run_b() -> None:
        now[0] += 61  # A's driver paused past its lease timeout
        monkeypatch.setattr(fence, "_mine", b_tables)
        assert RunLease(root, 60, clock=lambda: now[0]).acquire().token == 2
        resumed.append(latest_checkpoint(root).name)
        _save(root, 10)
        monkeypatch.setattr(fence, "_mine", a_tables)

    pause = Pause(monkeypatch, where, "ckpt-00000012", run_b)
    pause.armed = True
    with pytest.raises(fence.FencedOut):
        _save(root, 12)
    assert pause.fired and resumed == ["ckpt-00000008"]
    assert latest_checkpoint(root).name == "ckpt-00000010"
    assert [p.name for p in list_checkpoints(root)] == ["ckpt-00000010"]
    assert _names(root) == (["ckpt-00000010"] if where == "after_check" else ["ckpt-00000010", "ckpt-00000012"])

    monkeypatch.setattr(fence, "_mine", b_tables)  # B's next save prunes the stale entry
    _save(root, 14)
    assert _names(root) == ["ckpt-00000014"]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_stale_run_never_deletes_an_entry_of_a_newer_token(kind, tmp_path, request, monkeypatch) -> None:
    """The last window of a prune: A's fence check passed, then B (token 2) published ckpt-6 before A's
    delete ran. The entry carries B's token: A's delete leaves it."""
    root = storage_root(kind, tmp_path, request, "prune")
    monkeypatch.setattr(fence, "_mine", {})
    RunLease(root, 60).acquire().release()
    b = RunLease(root, 60).acquire()
    assert b.token == 2
    _save(root, 6, keep=3)
    monkeypatch.setattr(fence, "_mine", {})
    fence.adopt(root, 1)  # A, whose check passed a moment ago: the counter as it saw it
    monkeypatch.setattr(fence, "check", lambda store: 1)
    open_storage(root).delete("ckpt-00000006")
    assert _names(root) == ["ckpt-00000006"]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_deleted_counter_refuses_the_holder_until_its_heartbeat_writes_it_back(kind, tmp_path, request,
                                                                                   monkeypatch) -> None:
    """Before: a missing `.run-fence` read as 0, below every token, and any holder published."""
    root = storage_root(kind, tmp_path, request, "deleted")
    monkeypatch.setattr(fence, "_mine", {})
    lease = RunLease(root, 60).acquire()
    _save(root, 2, keep=3)
    open_storage(root).remove_file(fence.FENCE_FILE)  # a dot-file cleanup, `sync --delete`, a lifecycle rule
    with pytest.raises(fence.FencedOut, match="reads 0, not this run's token 1"):
        _save(root, 4, keep=3)
    open_storage(root).write_file(fence.FENCE_FILE, b"0")  # or rewritten lower
    with pytest.raises(fence.FencedOut, match="reads 0"):
        open_storage(root).write_file("summary.json", b"{}")
    assert lease.beat() and fence.current(open_storage(root)) == 1  # the live holder writes it back
    _save(root, 4, keep=3)
    assert _names(root) == ["ckpt-00000002", "ckpt-00000004"]
    lease.release()


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_counter_deleted_before_a_takeover_never_hands_out_a_token_twice(kind, tmp_path, request,
                                                                          monkeypatch) -> None:
    """A (token 1) is stopped; its counter is deleted; B takes the stale lease over. B's token is one
    above the one A's lease record holds (2), and A is refused. Before: B took 0 + 1 = 1, A's token,
    and both published."""
    root, now, a_tables = storage_root(kind, tmp_path, request, "retoken"), [1000.0], {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    assert RunLease(root, 60, clock=lambda: now[0]).acquire().token == 1
    open_storage(root).remove_file(fence.FENCE_FILE)
    now[0] += 61
    monkeypatch.setattr(fence, "_mine", {})
    b = RunLease(root, 60, clock=lambda: now[0]).acquire()
    assert b.token == 2 and fence.current(open_storage(root)) == 2
    monkeypatch.setattr(fence, "_mine", a_tables)
    with pytest.raises(fence.FencedOut, match="fencing token 2, this run's is 1"):
        _save(root, 2)
    assert _names(root) == []


def test_a_released_folder_whose_counter_went_keeps_counting_from_its_checkpoints(tmp_path, monkeypatch) -> None:
    """Released lease (no record left on a local folder) and a deleted counter: the next token is still
    above every token a published checkpoint carries."""
    root = str(tmp_path / "run")
    monkeypatch.setattr(fence, "_mine", {})
    for _ in range(3):
        RunLease(root, 60).acquire().release()
    monkeypatch.setattr(fence, "_mine", {})
    lease = RunLease(root, 60).acquire()
    _save(root, 2)
    lease.release()
    (Path(root) / fence.FENCE_FILE).unlink()
    monkeypatch.setattr(fence, "_mine", {})
    assert RunLease(root, 60).acquire().token == 5


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_stale_driver_writes_no_summary_report_or_timeline(kind, tmp_path, request, monkeypatch) -> None:
    """Item 6: in the heartbeat after a takeover, before the stale driver learns it, its summary.json,
    report.html and (URI roots) uploaded timeline are refused; B's stay. Before: written unfenced."""
    root, now, a_tables = storage_root(kind, tmp_path, request, "files"), [1000.0], {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    open_storage(root).write_file("summary.json", b'{"run": "a"}')
    now[0] += 61
    monkeypatch.setattr(fence, "_mine", {})
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    open_storage(root).write_file("summary.json", b'{"run": "b"}')
    page = tmp_path / "report.html"
    page.write_text("a's report")
    monkeypatch.setattr(fence, "_mine", a_tables)
    for write in (lambda s: s.write_file("summary.json", b'{"run": "a"}'), lambda s: s.upload_file("report.html", page),
                  lambda s: s.upload_file("timeline.jsonl", page)):
        with pytest.raises(fence.FencedOut, match="fencing token 2, this run's is 1"):
            write(open_storage(root))
    assert open_storage(root).read_file("summary.json") == b'{"run": "b"}'
    assert open_storage(root).read_file("report.html") is None and open_storage(root).read_file("timeline.jsonl") is None


def test_a_stale_driver_s_local_timeline_rows_are_dropped(tmp_path, monkeypatch) -> None:
    """Item 6 on a local folder, where the driver appends timeline.jsonl in place: once run B holds the
    folder, A's rows are dropped within a second of its timeline's clock (the counter is read at most
    once a second), and B's land. Before: A appended to B's timeline until its next heartbeat."""
    from app.run.outputs.timeline import FILE_NAME, Timeline

    root, now, a_tables = str(tmp_path / "run"), [1000.0], {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    a_rows = Timeline(root, clock=lambda: now[0])
    a_rows.note("a-before")
    now[0] += 61
    monkeypatch.setattr(fence, "_mine", {})
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    b_rows = Timeline(root, clock=lambda: now[0])
    b_rows.note("b")
    monkeypatch.setattr(fence, "_mine", a_tables)
    now[0] += 1.0
    a_rows.note("a-after")
    lines = (Path(root) / FILE_NAME).read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == ["a-before", "b"]


def test_a_sweep_run_s_timeline_keeps_its_rows_before_its_folder_s_counter_is_raised(tmp_path, monkeypatch) -> None:
    """A sweep run's timeline (`<root>/runs/<name>`) may start before the driver raises that folder's
    counter: its rows are judged by the leased root's counter then, and kept."""
    from app.run.outputs.timeline import FILE_NAME, Timeline

    root = tmp_path / "sweep"
    monkeypatch.setattr(fence, "_mine", {})
    RunLease(str(root), 60).acquire()
    rows = Timeline(root / "runs" / "a")
    rows.note("kept")
    assert [json.loads(line)["text"] for line in (root / "runs" / "a" / FILE_NAME).read_text().splitlines()] == ["kept"]
