"""Issue 35, round two: every writer of a run is fenced, not only its driver. The driver hands its lease's
fencing token to each drafter rank in the rank's setup message (`DrafterSetup.fence_token`); a rank
writes under that token from its first write on, so a rank whose run lost the folder while its driver
was stopped (SIGSTOP) is refused at its next checkpoint or export, in one line, and its process ends.
Pure logic: no Ray (the group's setup message is built from a stand-in plan)."""
from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.config.load import load_config
from app.run.lease import RunLease
from app.storage import fence
from app.storage.roots import open_storage


def _publish(root: str, tmp_path: Path, name: str) -> None:
    store = open_storage(root)
    staged = store.stage(name)
    (staged / "state.json").write_text("{}")
    store.publish(staged, name)


def _setup_message(root: str):
    """The DrafterSetup the driver's group sends its ranks (app/run/supervise/drafters.py `_setup`)."""
    from app.run.supervise.drafters import DrafterGroup

    group = DrafterGroup.__new__(DrafterGroup)
    cfg = load_config("conf/tiny.yaml", [f"checkpoint.dir={root}"])
    group.plan = SimpleNamespace(cfg=cfg, model_dir="m", layer_ids=[0], mask_token_id=1, total_steps=4,
                                 data_fingerprint="f")
    group.plan.jobs = type("Jobs", (list,), {"max_payload_bytes": lambda self: 1024})([0, 1])
    group.cfg, group.topo = cfg, SimpleNamespace(plan=SimpleNamespace(use_gpu=False))
    group.step_log, group.generation = None, 1
    return group._setup(None, None)


def test_the_driver_s_setup_message_carries_its_lease_token(tmp_path: Path, monkeypatch) -> None:
    root = str(tmp_path / "run")
    monkeypatch.setattr(fence, "_mine", {})
    first = RunLease(root, 60).acquire()
    first.release()
    lease = RunLease(root, 60).acquire()  # the folder's second holder: token 2
    try:
        assert lease.token == 2 and fence.held(root) == 2
        assert _setup_message(root).fence_token == 2
    finally:
        lease.release()


def test_a_rank_that_first_writes_after_its_run_lost_the_folder_is_refused(tmp_path: Path, monkeypatch) -> None:
    """Run A's driver takes the lease (token 1) and starts its ranks; it is stopped; run B takes the
    folder over (token 2). A rank of A that had not written yet (or was restarted) then checkpoints:
    refused. Before: a process took the counter at its first write as its token, 2, and A's rank
    published into B's folder."""
    root, now = str(tmp_path / "run"), [1000.0]
    monkeypatch.setattr(fence, "_mine", {})  # driver A's process
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    token = _setup_message(root).fence_token
    assert token == 1
    now[0] += 61  # A's driver stopped: no heartbeat
    monkeypatch.setattr(fence, "_mine", {})  # driver B's process
    assert RunLease(root, 60, clock=lambda: now[0]).acquire().token == 2

    monkeypatch.setattr(fence, "_mine", {})  # A's rank 0: a fresh process that is given its setup message
    fence.join(root, token)
    with pytest.raises(fence.FencedOut, match="fencing token 2, this run's is 1"):
        _publish(root, tmp_path, "ckpt-00000008")
    with pytest.raises(fence.FencedOut):
        open_storage(root).upload_dir(_export(tmp_path / "export"), "drafter", last="config.json")
    assert not (Path(root) / "ckpt-00000008").exists() and not (Path(root) / "drafter").exists()

    monkeypatch.setattr(fence, "_mine", {})  # B's rank 0, given B's token: publishes
    fence.join(root, 2)
    _publish(root, tmp_path, "ckpt-00000008")
    assert (Path(root) / "ckpt-00000008" / "state.json").is_file()


def test_a_root_no_lease_touched_gives_token_0_and_nothing_is_fenced(tmp_path: Path, monkeypatch) -> None:
    root = str(tmp_path / "plain")
    monkeypatch.setattr(fence, "_mine", {})
    assert _setup_message(root).fence_token == 0
    fence.join(root, 0)
    _publish(root, tmp_path, "ckpt-00000001")
    assert fence.held(root) == 0 and not (Path(root) / fence.FENCE_FILE).exists()


def test_a_fenced_rank_says_it_in_one_line_and_ends(tmp_path: Path, monkeypatch) -> None:
    root = str(tmp_path / "run")
    monkeypatch.setattr(fence, "_mine", {})
    open_storage(root).write_file(fence.FENCE_FILE, b"3")
    fence.join(root, 2)
    err, codes = io.StringIO(), []
    with pytest.raises(fence.FencedOut):
        with fence.stop_when_fenced(exit=codes.append, err=err):
            _publish(root, tmp_path, "ckpt-00000002")
    assert codes == [2]
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("run stopped: another run took the lease")
    assert "fencing token 3, this run's is 2" in err.getvalue()


def _export(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def test_a_sweep_run_s_folder_below_the_leased_root_is_fenced_too(tmp_path: Path, monkeypatch) -> None:
    """A sweep writes each run under `<root>/runs/<name>`, its own root for checkpoints and the export,
    while the lease and its counter are on `<root>`. Run A's driver hands its run folder's ranks token 1
    and raises the folder's counter to it; sweep B takes the root over and does the same for the same
    run name (token 2): A's rank is refused there. Before: the folder had no counter and the ranks were
    handed token 0, so nothing below the root was ever fenced."""
    root, now = str(tmp_path / "sweep"), [1000.0]
    run_a = str(Path(root) / "runs" / "a")
    monkeypatch.setattr(fence, "_mine", {})  # sweep A's driver
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    assert _setup_message(run_a).fence_token == 1 and fence.current(open_storage(run_a)) == 1
    monkeypatch.setattr(fence, "_mine", {})  # A's rank 0 of run a
    fence.join(run_a, 1)
    _publish(run_a, tmp_path, "ckpt-00000002")

    now[0] += 61  # A's driver stopped
    monkeypatch.setattr(fence, "_mine", {})  # sweep B's driver, the same run names
    RunLease(root, 60, clock=lambda: now[0]).acquire()
    assert _setup_message(run_a).fence_token == 2 and fence.current(open_storage(run_a)) == 2

    monkeypatch.setattr(fence, "_mine", {})
    fence.join(run_a, 1)  # A's rank again
    with pytest.raises(fence.FencedOut, match="fencing token 2, this run's is 1"):
        _publish(run_a, tmp_path, "ckpt-00000004")
    assert sorted(p.name for p in Path(run_a).iterdir() if p.name.startswith("ckpt-")) == ["ckpt-00000002"]


def test_a_uri_run_folder_keeps_its_query_and_finds_its_leased_root(monkeypatch) -> None:
    monkeypatch.setattr(fence, "_mine", {})
    fence.adopt("s3://b/sweep?endpoint_override=h:1&scheme=http", 3)
    assert fence.held("s3://b/sweep/runs/a?endpoint_override=h:1&scheme=http") == 3
    assert fence.held("s3://b/sweeping/runs/a?endpoint_override=h:1&scheme=http") == 0  # a name that starts alike
