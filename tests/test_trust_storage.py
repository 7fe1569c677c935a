"""Issue 22, storage trust: a bucket writer cannot write the node (item 11), two runs cannot share one
checkpoint.dir (item 2), exports are never torn (item 5), a URI run keeps its timeline (item 7), the
driver and rank 0 see one folder (item 3), per-user caches (item 15).

The traversal tests use the real pyarrow S3 client against moto's server on loopback; the second-run
test runs two real driver processes (marked ray, slow).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from pyarrow.fs import FileSelector

from app.storage.fetch import fetch_dir, safe_destination
from app.storage.publish import MARKER
from app.storage.roots import open_storage


# ---- item 11: path traversal from the bucket ------------------------------------------------------

def _put(fs, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as out:
        out.write(data)


def _put_raw(s3, key: str, data: bytes) -> None:
    """An object under exactly `key`: boto3 sends it unnormalized (pyarrow and curl collapse `..`),
    as a hostile bucket writer would."""
    import boto3

    boto3.client("s3", endpoint_url=f"http://{s3.endpoint}", region_name="us-east-1").put_object(
        Bucket=s3.bucket, Key=key, Body=data)


@pytest.mark.parametrize("evil", ["../../{name}", "../../../{name}", "a/../../../{name}", "a//{name}", "./{name}"])
def test_fetch_refuses_a_bucket_key_that_leaves_the_download(s3, tmp_path: Path, monkeypatch, evil: str) -> None:
    """Item 11: an object key with `..` (or an empty / `.` part) written straight into the bucket is
    refused and nothing lands outside the download folder. Before: `../../x` (with `x` also in the
    bucket, where the HTTP client's normalized GET reads it) was written two folders above the download."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))  # every download folder under tmp_path
    (tmp_path / "tmp").mkdir()
    name = f"pwned-{abs(hash(evil)) % 10**8}.txt"
    prefix = f"trav-{abs(hash(evil)) % 10**8}/ckpt-00000001/v-0123456789ab"
    _put_raw(s3, f"{prefix}/state.json", b"{}")
    _put_raw(s3, f"{prefix}/{evil.format(name=name)}", b"owned")
    _put_raw(s3, __import__("posixpath").normpath(f"{prefix}/{evil.format(name=name)}"), b"owned")
    keys = [i.path for i in s3.filesystem().get_file_info(FileSelector(f"{s3.bucket}/{prefix}", recursive=True))]
    assert f"{s3.bucket}/{prefix}/{evil.format(name=name)}" in keys  # pyarrow lists the key as written
    with pytest.raises(ValueError, match="refusing to download"):
        fetch_dir(s3.uri(prefix), cache=False)
    assert list(tmp_path.rglob(name)) == []


def test_fetch_still_downloads_an_honest_version(s3) -> None:
    fs = s3.filesystem()
    prefix = f"{s3.bucket}/honest/ckpt-00000001/v-0123456789ab"
    _put(fs, f"{prefix}/state.json", b"{}")
    _put(fs, f"{prefix}/sub/w.bin", b"12")
    local = fetch_dir(s3.uri(prefix[len(s3.bucket) + 1:]), cache=False)
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == ["state.json", "sub/w.bin"]


def test_a_marker_naming_no_version_publishes_nothing(s3) -> None:
    """Item 11: COMMITTED must name a version (`v-` + 12 hex); `../../elsewhere` is not one."""
    fs = s3.filesystem()
    _put(fs, f"{s3.bucket}/marker/ckpt-00000002/v-0123456789ab/state.json", b"{}")
    _put(fs, f"{s3.bucket}/marker/ckpt-00000002/{MARKER}", b"../../other-run/ckpt-9/v-0123456789ab")
    _put(fs, f"{s3.bucket}/marker/ckpt-00000003/v-0123456789ab/state.json", b"{}")
    _put(fs, f"{s3.bucket}/marker/ckpt-00000003/{MARKER}", b"v-0123456789ab\n")
    assert [e.name for e in open_storage(s3.uri("marker")).entries("ckpt-")] == ["ckpt-00000003"]


def test_a_local_dir_through_a_file_uri_is_checked_too(tmp_path: Path) -> None:
    """Item 11 on a local dir (`file://`): a marker with a path in it is refused, keys are checked."""
    root = tmp_path / "run"
    (root / "ckpt-00000001" / "v-0123456789ab").mkdir(parents=True)
    (root / "ckpt-00000001" / MARKER).write_text("../../../etc")
    assert open_storage(f"file://{root}").entries("ckpt-") == []
    (root / "ckpt-00000001" / MARKER).write_text("v-0123456789ab")
    assert [e.name for e in open_storage(f"file://{root}").entries("ckpt-")] == ["ckpt-00000001"]
    folder = tmp_path / "dl"
    folder.mkdir()
    (folder / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    for key in ["base/../x", "base//x", "base/./x", "other/x", "base/link/x"]:
        with pytest.raises(ValueError, match="refusing to download"):
            safe_destination(folder, key, "base")
    assert safe_destination(folder, "base/a/b.txt", "base") == folder / "a" / "b.txt"


# ---- item 2: one run per checkpoint.dir -----------------------------------------------------------

def test_a_second_lease_on_one_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    """Item 2: the second run is refused, naming the holder; before there was no lease at all."""
    from app.run.lease import LEASE_FILE, LeaseHeld, RunLease

    first = RunLease(tmp_path, 60).acquire()
    with pytest.raises(LeaseHeld) as err:
        RunLease(tmp_path, 60).acquire()
    assert "another run holds" in str(err.value) and f"pid {__import__('os').getpid()}" in str(err.value)
    assert "\n" not in str(err.value) and err.value.kind == "checkpoint"
    first.release()
    assert not (tmp_path / LEASE_FILE).exists()
    RunLease(tmp_path, 60).acquire().release()  # free again once released


def test_a_stale_lease_is_taken_over_and_its_holder_learns_it(tmp_path: Path) -> None:
    """Item 2: no heartbeat for lease_timeout_s (virtual clock) = stale: a new run takes over, and the
    old holder's next heartbeat finds the lease gone instead of writing over it."""
    from app.run.lease import RunLease

    now = [1000.0]
    old = RunLease(tmp_path, 60, clock=lambda: now[0]).acquire()
    now[0] += 59
    from app.run.lease import LeaseHeld

    with pytest.raises(LeaseHeld):
        RunLease(tmp_path, 60, clock=lambda: now[0]).acquire()
    now[0] += 2  # 61 s without a heartbeat
    new = RunLease(tmp_path, 60, clock=lambda: now[0]).acquire()
    assert new.taken_over["run_id"] == old.me["run_id"]
    assert old.beat() is False and new.held() and not old.held()
    old.release()  # not its lease any more: left alone
    assert new.held()


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    """Item 2: a driver killed with SIGKILL leaves its lease behind; a resubmit on the same host need
    not wait for the timeout (its pid is gone)."""
    import json
    import socket
    import subprocess
    import sys

    from app.run.lease import LEASE_FILE, RunLease

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    from app.run.lease_record import namespace

    dead = {"host": socket.gethostname(), "pid": int(proc.stdout), "run_id": "x", "heartbeat": __import__("time").time(),
            **namespace()}  # this boot and pid namespace: the pid's absence means it is dead (issue 49)
    (tmp_path / LEASE_FILE).write_text(json.dumps(dead))
    lease = RunLease(tmp_path, 3600).acquire()
    assert lease.taken_over["pid"] == dead["pid"] and lease.held()


def test_a_uri_lease_refuses_a_second_run(tmp_path: Path) -> None:
    """Item 2 on a URI root (file://, the same code path as s3://): read, write, read back."""
    from app.run.lease import LeaseHeld, RunLease

    root = f"file://{tmp_path}/run"
    first = RunLease(root, 60).acquire()
    with pytest.raises(LeaseHeld):
        RunLease(root, 60).acquire()
    first.release()
    RunLease(root, 60).acquire().release()


def test_two_writers_of_one_step_stage_apart(tmp_path: Path) -> None:
    """Item 2: staging folders are unique (both writers used `.tmp-ckpt-<step>` and mixed files)."""
    store = open_storage(tmp_path)
    a, b = store.stage("ckpt-00000004"), store.stage("ckpt-00000004")
    (a / "w").write_text("a")
    assert a != b and not (b / "w").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_a_second_driver_on_a_running_dir_exits_2_in_one_line(ray_cluster, tmp_path: Path) -> None:
    """Item 2 with two real driver processes: the second one exits 2 with one line while the first runs,
    and the first one finishes its training untouched. The first is held (SIGSTOP) while the second
    starts, so it is certainly running then, however fast this machine trains."""
    import signal

    from tests.e2e_helpers import SMALL, start_driver, summary, wait_for

    run_dir = tmp_path / "run"
    first = start_driver(run_dir, *SMALL, "checkpoint.lease_timeout_s=3600")
    try:
        wait_for(lambda: (run_dir / ".run-lease").exists(), 900, "the first driver's lease")
        first.send_signal(signal.SIGSTOP)
        second = start_driver(run_dir)
        out, _ = second.communicate(timeout=900)
        first.send_signal(signal.SIGCONT)
        assert second.returncode == 2, out
        errors = [line for line in out.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith("checkpoint error: another run holds"), out
        out1, _ = first.communicate(timeout=900)
        assert first.returncode == 0, out1[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert summary(run_dir)["jobs_acked_twice"] == 0 and not (run_dir / ".run-lease").exists()


# ---- item 3: the driver and rank 0 see one folder ---------------------------------------------------

def test_a_probe_the_driver_cannot_read_back_stops_the_run(tmp_path: Path) -> None:
    """Item 3: rank 0 wrote its probe into another folder (its own copy of a relative path, a volume
    only its pod mounts): one line, the run stops. Before, a rebuild found no checkpoint and silently
    started from scratch."""
    from app.run.supervise.drafters import PROBE_PREFIX, check_probe
    from app.run.supervise.events import RunFailed

    driver_dir, rank0_dir = tmp_path / "driver-view", tmp_path / "rank0-view"
    name = f"{PROBE_PREFIX}abc"
    open_storage(rank0_dir).write_file(name, b"tok")
    with pytest.raises(RunFailed, match="a folder this driver does not see") as err:
        check_probe(str(driver_dir), name, "tok", f"{rank0_dir} on node 10.0.0.7")
    assert "\n" not in str(err.value) and "10.0.0.7" in str(err.value)
    open_storage(driver_dir).write_file(name, b"tok")  # the same folder: passes, probe removed
    check_probe(str(driver_dir), name, "tok", str(driver_dir))
    assert not (driver_dir / name).exists()


def test_a_relative_checkpoint_dir_is_refused_when_joining_a_cluster(monkeypatch, capsys, tmp_path: Path) -> None:
    """Item 3: `ray job submit` sets RAY_ADDRESS; a relative checkpoint.dir resolves in each node's own
    working-dir copy. One line, exit 2, before connecting or touching any folder."""
    from app.config.load import load_config
    from app.run.driver import run

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens: the check must come first
    cfg = load_config(root / "conf/tiny.yaml", ["checkpoint.dir=runs/rel"])
    assert run(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: checkpoint.dir='runs/rel' is relative") and "\n" not in err
    assert not (tmp_path / "runs").exists()


# ---- item 5: exports are published whole, readable, and never replace a better best -----------------

def _toy():
    from tests.toy import toy_drafter_parts

    drafter, _, _, arch = toy_drafter_parts()
    return drafter, arch


def test_a_failed_export_leaves_the_previous_one_whole(tmp_path: Path) -> None:
    """Item 5: drafter/ used to be rewritten in place (weights first, the old config.json beside them);
    now a failure mid-export leaves the old folder exactly as it was, and no temp folder."""
    from app.model.export import export_drafter, load_drafter, publish_export

    drafter, arch = _toy()
    out = tmp_path / "drafter"
    publish_export(out, lambda tmp: export_drafter(drafter, arch, tmp))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def torn(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_export(out, torn)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
    load_drafter(out)  # still loads


def test_exports_are_readable_by_other_users(tmp_path: Path) -> None:
    """Item 5: safetensors writes 0600 and temp folders are 0700; an engine running as another user
    must read the export: files 0644, folders 0755."""
    import stat

    from app.model.export import export_drafter, publish_export

    drafter, arch = _toy()
    out = publish_export(tmp_path / "drafter", lambda tmp: export_drafter(drafter, arch, tmp))
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == \
        {"config.json": 0o644, "model.safetensors": 0o644}


def test_an_overdue_evaluation_never_replaces_a_better_best(tmp_path: Path) -> None:
    """Item 5: the best tau is read again at swap time: an evaluation dispatched before a better one
    landed no longer overwrites it (export_best returns None, nothing written)."""
    from app.model.drafter_tau import export_best, read_best_meta

    drafter, arch = _toy()
    out = tmp_path / "drafter-best"
    assert export_best(drafter, arch, out, step=60, tau=3.0) == out
    assert export_best(drafter, arch, out, step=40, tau=2.0) is None
    assert read_best_meta(out) == {"step": 60, "tau": 3.0}
    assert export_best(drafter, arch, out, step=80, tau=3.5) == out
    assert read_best_meta(out) == {"step": 80, "tau": 3.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter-best"]


def test_export_leftovers_are_cleaned_on_start(tmp_path: Path) -> None:
    """Item 5: staging folders of exports (and the older `drafter-best.tmp-<pid>`/`.old-<pid>` copies)
    are removed on start; a `.old-drafter` whose replacement never landed is put back."""
    from app.training.checkpoint import clean_orphans

    for name in (".tmp-drafter-1a2b3c4d", "drafter-best.tmp-123", "drafter-best.old-123", ".old-drafter", "drafter-best"):
        (tmp_path / name).mkdir()
    (tmp_path / ".probe-0123456789ab").write_text("x")  # an older version's probe name
    done = clean_orphans(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "drafter-best"]
    assert "restored drafter" in done and len(done) == 5


# ---- item 7: a URI run resumed on a new machine keeps its timeline -------------------------------

def test_a_uri_run_on_a_new_machine_continues_the_remote_timeline(tmp_path: Path, monkeypatch) -> None:
    """Item 7: the local cache of a new machine is empty; the remote timeline (with the evaluations of
    the earlier start) is fetched first, the tau history goes on from it, and what is uploaded at the
    end holds the old rows and the new ones. Before, the new machine's cache was uploaded over it."""
    import json

    from app.config.load import load_config
    from app.run.outputs.monitor import RunMonitor
    from app.run.outputs.run_outputs import RunOutputs

    root = Path(__file__).resolve().parents[1]
    remote = tmp_path / "bucket" / "run"
    remote.mkdir(parents=True)
    earlier = [{"k": "run", "t": 1.0, "resumed_step": 0}, {"k": "eval", "t": 2.0, "step": 40, "tau": 2.5,
                                                          "per_pos_accept": [0.9]}]
    (remote / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "new-machine-tmp"))  # an empty local cache
    (tmp_path / "new-machine-tmp").mkdir()
    cfg = load_config(root / "conf/tiny.yaml", [f"checkpoint.dir=file://{remote}"])
    outputs = RunOutputs(cfg, "run", RunMonitor(), resumed_step=40, log=lambda _: None)
    assert [(r["step"], r["tau"]) for r in outputs.earlier_evals] == [(40, 2.5)]
    outputs.timeline.note("new start's event")
    outputs.close()
    rows = [json.loads(line) for line in (remote / "timeline.jsonl").read_text().splitlines()]
    assert rows[:2] == earlier and [r["k"] for r in rows[2:]] == ["run", "event"]


def test_a_torn_last_line_does_not_swallow_the_next_start_s_first_row(tmp_path: Path) -> None:
    """Item 7 (the same file): a killed driver's half line is closed before a new start appends."""
    from app.run.outputs.timeline import Timeline, read_timeline

    (tmp_path / "timeline.jsonl").write_text('{"k": "event", "t": 1, "text": "a"}\n{"k": "ev')
    timeline = Timeline(tmp_path)
    timeline.note("b")
    timeline.close()
    assert [r["text"] for r in read_timeline(tmp_path)] == ["a", "b"]


# ---- item 15: per-user private caches, the rendezvous on the node's address --------------------------

def test_uri_caches_live_in_a_private_per_user_root(tmp_path: Path, monkeypatch) -> None:
    """Item 15: caches and staging of URI runs were predictable names shared in /tmp; now they sit in
    `<tmp>/dflash-<uid>/` (0700), and a planted symlink or another user's folder there is refused."""
    import os
    import stat

    from app.storage.local_cache import cache_root
    from app.storage.roots import local_cache_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = local_cache_dir("s3://b/runs/x")
    root = tmp_path / f"dflash-{os.getuid()}"
    assert folder.parent == root and stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert open_storage("s3://b/runs/x?endpoint_override=127.0.0.1:1&scheme=http").stage("ckpt-1").parent == root
    root.chmod(0o777)  # opened up: closed again
    assert stat.S_IMODE(cache_root().stat().st_mode) == 0o700

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "shared"))
    (tmp_path / "shared").mkdir()
    (tmp_path / "attacker").mkdir()
    (tmp_path / "shared" / f"dflash-{os.getuid()}").symlink_to(tmp_path / "attacker")
    with pytest.raises(RuntimeError, match="not a folder of this user"):
        local_cache_dir("s3://b/runs/x")
    assert list((tmp_path / "attacker").iterdir()) == []


def test_the_rendezvous_listens_on_the_node_address_only() -> None:
    """Item 15: rank 0's rendezvous socket is bound to the node's address, not every interface, and is
    the very socket the TCPStore serves on (a one-rank gloo group joins through it)."""
    import torch
    import torch.distributed as dist

    from app.training.rendezvous import Rendezvous

    rdv = Rendezvous()
    ip, port = rdv.listen("127.0.0.1")
    assert rdv.listener.getsockname() == ("127.0.0.1", port) and ip == "127.0.0.1"
    dist.init_process_group("gloo", store=rdv.store(ip, port, 1, True), rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_a_driver_that_crashes_before_the_run_gives_its_lease_back(tmp_path: Path, monkeypatch) -> None:
    """Item 2: an exception between the lease and the run (here: planning) releases the lease, so a
    caller in the same process (a test, a notebook) can start on the same dir again."""
    import app.run.driver as driver
    from app.config.load import load_config

    root = Path(__file__).resolve().parents[1]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(driver, "make_plan", lambda cfg: (_ for _ in ()).throw(RuntimeError("boom")))
    cfg = load_config(root / "conf/tiny.yaml", [f"checkpoint.dir={tmp_path / 'run'}"])
    with pytest.raises(RuntimeError, match="boom"):
        driver.run(cfg)
    assert not (tmp_path / "run" / ".run-lease").exists()


def test_the_lease_names_the_ray_job_that_holds_it(tmp_path: Path, monkeypatch) -> None:
    """Item 2: the refusal names host, pid and the `ray job submit` id (from the job config Ray passes)."""
    import json

    from app.run.lease import LeaseHeld, RunLease

    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_X1"}}))
    RunLease(tmp_path, 60).acquire()
    with pytest.raises(LeaseHeld, match="job raysubmit_X1"):
        RunLease(tmp_path, 60).acquire()
