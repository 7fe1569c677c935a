"""What issue 49 left open: a run that lost its lease, paused at its worst moment, still changes nothing the
new holder wrote or reads. Local folders and the moto S3 of tests/s3_server.py; a faked clock; each run's
token table (`fence._mine`) swapped in turn, as tests/test_trust_fence_publish.py does. No Ray.

Each test was run against the code before its change and failed there (the docstrings say how).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from app.run.lease import RunLease
from app.storage import fence
from app.storage.roots import open_storage
from app.training.checkpoint import load_checkpoint, latest_checkpoint
from tests.helpers import storage_root
from tests.test_trust_fence_publish import _names, _save


class Observed:
    """Pauses the stale run once, at the first `fence.entry_token` read (an entry's or a marker's token)
    after one of its fence checks passed: it has seen everything it acts on; then `meanwhile` (run B)
    runs, and the stale run goes on."""

    def __init__(self, monkeypatch, meanwhile) -> None:
        self.armed, self.fired, self.checked = False, False, False
        real_check, real_token = fence.check, fence.entry_token

        def check(store):
            token = real_check(store)
            self.checked = self.armed
            return token

        def entry_token(text):
            out = real_token(text)
            if self.armed and self.checked and not self.fired:
                self.fired, self.armed = True, False
                meanwhile()
            return out

        monkeypatch.setattr(fence, "check", check)
        monkeypatch.setattr(fence, "entry_token", entry_token)


def _take_over(root: str, now: list[float], monkeypatch, tables: dict) -> RunLease:
    now[0] += 61  # the stale run's driver paused past its lease timeout
    monkeypatch.setattr(fence, "_mine", tables)
    return RunLease(root, 60, clock=lambda: now[0]).acquire()


# ---- item 3: deletes and the export in place -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_paused_prune_never_deletes_the_entry_the_new_holder_published_under_that_name(
        kind, tmp_path, request, monkeypatch) -> None:
    """A (token 1) prunes its ckpt-6 and pauses after its check and its read of the entry's token; B takes
    the lease over (token 2) and publishes its own ckpt-6. A's delete then leaves B's ckpt-6 whole (S3: the
    marker goes only if it is still the version A read, then only the versions A listed; local: moved aside,
    judged, put back). Before: A deleted B's marker and all of ckpt-6 (S3) or B's folder (local)."""
    root, now, a_tables, b_tables = storage_root(kind, tmp_path, request, "prune"), [1000.0], {}, {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    _save(root, 6, keep=3)

    def run_b() -> None:
        assert _take_over(root, now, monkeypatch, b_tables).token == 2
        _save(root, 6, keep=3)  # B's own ckpt-6 (its weights are 6.0 too; its token tells them apart)
        monkeypatch.setattr(fence, "_mine", a_tables)

    pause = Observed(monkeypatch, run_b)
    pause.armed = True
    open_storage(root).delete("ckpt-00000006")
    assert pause.fired
    assert _names(root) == ["ckpt-00000006"]
    (entry,) = open_storage(root).entries("ckpt-")
    assert entry.token == 2
    assert load_checkpoint(latest_checkpoint(root)).step == 6  # whole: its files are there, not just a marker


def test_a_paused_export_lands_no_file_over_the_new_holder_s_export(s3, atomic_puts, tmp_path, monkeypatch) -> None:
    """A (token 1) rewrites the export folder on S3 in place and pauses right after the fence check of its
    weights file; B takes over and exports. A's weights file then does not land (`FencedOut`), and the
    folder is B's, file for file. Before: A's weights landed over B's export."""
    root, now, a_tables = s3.uri("export"), [1000.0], {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    folders = {}
    for run in ("a", "b"):
        folders[run] = tmp_path / run
        folders[run].mkdir()
        (folders[run] / "model.safetensors").write_bytes(run.encode() * 1000)
        (folders[run] / "config.json").write_text(f'{{"run": "{run}"}}')
    real_guard, fired = fence.guard, []

    def guard(store, rel):
        real_guard(store, rel)
        if rel == "drafter/model.safetensors" and not fired:
            fired.append(rel)
            _take_over(root, now, monkeypatch, {})
            open_storage(root).upload_dir(folders["b"], "drafter", last="config.json")
            monkeypatch.setattr(fence, "_mine", a_tables)

    monkeypatch.setattr(fence, "guard", guard)
    with pytest.raises(fence.FencedOut):
        open_storage(root).upload_dir(folders["a"], "drafter", last="config.json")
    store = open_storage(root)
    assert fired and store.files("drafter") == ["config.json", "model.safetensors"]
    assert store.read_file("drafter/model.safetensors") == b"b" * 1000
    assert store.read_file("drafter/config.json") == b'{"run": "b"}'


def test_a_conditional_write_whose_answer_was_lost_is_no_takeover(s3, atomic_puts, tmp_path, monkeypatch) -> None:
    """The SDK retries a PUT or DELETE whose answer was lost; the retry then fails its condition against the
    request's own first landing. With the fence still this run's, that is no takeover: the export reads the
    version again and finishes (a false `FencedOut` would stop a healthy run's rank at its export)."""
    from app.storage.conditional import ConditionalStore

    root = s3.uri("echo")
    monkeypatch.setattr(fence, "_mine", {})
    RunLease(root, 60).acquire()
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w" * 100)
    (folder / "config.json").write_text("{}")
    open_storage(root).upload_dir(folder, "drafter", last="config.json")
    real_put, real_remove, echoed = ConditionalStore.put_file, ConditionalStore.remove, {}

    def put_file(store, rel, local, etag):
        got = real_put(store, rel, local, etag)
        if "put" in echoed:
            return got
        echoed["put"] = rel
        return None  # it landed; its answer was lost

    def remove(store, rel, etag):
        gone = real_remove(store, rel, etag)
        if "remove" in echoed:
            return gone
        echoed["remove"] = rel
        return False  # it went; its answer was lost

    monkeypatch.setattr(ConditionalStore, "put_file", put_file)
    monkeypatch.setattr(ConditionalStore, "remove", remove)
    (folder / "model.safetensors").write_bytes(b"v" * 100)
    open_storage(root).upload_dir(folder, "drafter", last="config.json")
    assert echoed["put"] == "drafter/model.safetensors" and echoed["remove"] == "drafter/config.json"
    store = open_storage(root)
    assert store.read_file("drafter/model.safetensors") == b"v" * 100 and store.read_file("drafter/config.json") == b"{}"


# ---- item 4: a stale commit before the new holder's first checkpoint -------------------------------------

def _save_stamped(root: str, step: int, generation: int) -> None:
    import torch

    from app.training.checkpoint import GENERATION_KEY, TrainState, save_checkpoint

    save_checkpoint(root, TrainState(step=step, epoch=0, ledger=[], drafter={"w": torch.full((4,), float(step))},
                                     extra={GENERATION_KEY: generation}), keep=3)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_stale_commit_before_the_new_holder_s_first_checkpoint_is_no_rebuild_point(kind, tmp_path, request,
                                                                                   monkeypatch) -> None:
    """A (token 1) has ckpt-8 (its group 1) and its rebuilt group 2 is saving ckpt-12 when A's driver pauses
    right before the commit; B takes the lease over (token 2), resumes from ckpt-8 and starts its own group,
    which counts generation 2 too (A's group 2 had stamped nothing yet). A's commit of ckpt-12 lands. Until
    B's first checkpoint, B's rebuild point and any resume point stay ckpt-8, and a later holder does not
    adopt ckpt-12 either. Before: ckpt-12 was the latest checkpoint and B's group rebuild resumed from A's
    weights."""
    from app.run.supervise.drafters import next_generation, rebuild_checkpoint
    from tests.test_trust_fence_publish import Pause

    root, now, a_tables, b_tables = storage_root(kind, tmp_path, request, "claim"), [1000.0], {}, {}
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    _save_stamped(root, 8, generation=1)
    b = {}

    def run_b() -> None:
        b["lease"] = _take_over(root, now, monkeypatch, b_tables)
        b["resumed"] = latest_checkpoint(root).name
        b["generation"] = next_generation(root, 0)
        monkeypatch.setattr(fence, "_mine", a_tables)

    pause = Pause(monkeypatch, "before_commit", "ckpt-00000012", run_b)
    pause.armed = True
    try:
        _save_stamped(root, 12, generation=2)  # A's commit lands (its prune of it, if any, is refused)
    except fence.FencedOut:
        pass
    assert pause.fired and b["resumed"] == "ckpt-00000008" and b["generation"] == 2
    assert _names(root) == ["ckpt-00000008", "ckpt-00000012"]  # the stale commit is there

    monkeypatch.setattr(fence, "_mine", b_tables)
    assert latest_checkpoint(root).name == "ckpt-00000008"
    assert rebuild_checkpoint(root, generation=2, resumed_step=8).name == "ckpt-00000008"
    assert load_checkpoint(rebuild_checkpoint(root, 2, 8)).drafter["w"][0].item() == 8.0
    b["lease"].release()
    monkeypatch.setattr(fence, "_mine", {})
    assert RunLease(root, 60, clock=lambda: now[0]).acquire().token == 3  # C, after B ended
    assert latest_checkpoint(root).name == "ckpt-00000008"


@pytest.mark.parametrize("planted", [b"\xff", b"[]", b'{"token": true, "entries": []}', b'{"token": 9}',
                                     b'{"token": 9, "entries": [["ckpt-00000001", 1]]}',
                                     b'{"token": 9, "entries": [["ckpt-00000001", "1", "ckpt-00000001"]]}'])
def test_a_claim_that_does_not_parse_is_no_claim(planted: bytes, tmp_path) -> None:
    """`.run-claim` is read from storage: anything but the shape the lease writes counts as no claim (the
    folder is judged by tokens alone), never as a reason to raise or to drop a checkpoint."""
    from app.storage import claim

    root = str(tmp_path / "run")
    _save(root, 1)
    (Path(root) / claim.CLAIM_FILE).write_bytes(planted)
    assert claim.read(open_storage(root)) is None
    assert latest_checkpoint(root).name == "ckpt-00000001"


def test_a_sweep_run_s_resume_point_is_claimed_before_it_is_read(tmp_path, monkeypatch) -> None:
    """A sweep run's folder (`<root>/runs/a`) has its own counter, raised by the driver. B reads that run's
    resume point (ckpt-8) right after taking the root over; A's paused commit of ckpt-12 there lands after
    that read, before B's drafter group starts. B's rebuild point stays ckpt-8: reading the resume point
    records the folder's entries first. Before: no claim (ckpt-12 the latest); with the claim written only
    at the group's start, ckpt-12 was among the entries B 'found'."""
    from types import SimpleNamespace

    from app.run.plan import read_resume_point
    from app.run.supervise.drafters import rebuild_checkpoint
    from tests.test_trust_fence_publish import Pause

    root, now, a_tables, b_tables = str(tmp_path / "sweep"), [1000.0], {}, {}
    run_a = f"{root}/runs/a"
    monkeypatch.setattr(fence, "_mine", a_tables)
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    assert fence.extend(open_storage(run_a)) == 1
    _save_stamped(run_a, 8, generation=1)
    cfg, jobs, b = SimpleNamespace(checkpoint=SimpleNamespace(dir=run_a)), SimpleNamespace(scheduled_only=list), {}

    def run_b() -> None:
        _take_over(root, now, monkeypatch, b_tables)
        b["resume"] = read_resume_point(cfg, jobs, "")
        monkeypatch.setattr(fence, "_mine", a_tables)

    pause = Pause(monkeypatch, "before_commit", "ckpt-00000012", run_b)
    pause.armed = True
    try:
        _save_stamped(run_a, 12, generation=2)
    except fence.FencedOut:
        pass
    assert pause.fired and Path(b["resume"].path).name == "ckpt-00000008"
    assert _names(run_a) == ["ckpt-00000008", "ckpt-00000012"]
    monkeypatch.setattr(fence, "_mine", b_tables)
    assert fence.extend(open_storage(run_a)) == 2  # B's drafter group starts
    assert rebuild_checkpoint(run_a, generation=2, resumed_step=8).name == "ckpt-00000008"
