"""Shared fixtures. One local Ray cluster per test session, started only by tests that ask for it."""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser) -> None:
    parser.addoption("--engines-required", action="store_true",
                     help="an engines test whose engine or browser is missing fails instead of skipping (make test-engines)")


@pytest.fixture
def engine(request):
    """`engine("vllm.engine.arg_utils")`: the module, or a skip (a failure under --engines-required, where
    `make test-engines` has installed every engine)."""
    import importlib

    def load(name: str):
        if request.config.getoption("--engines-required"):
            return importlib.import_module(name)
        return pytest.importorskip(name)

    return load


def pytest_configure(config) -> None:
    """One torch thread in the test process: on 2 shared cores, more threads run tiny ops 20x slower."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local CPU Ray cluster that fakes eight GPUs; shared by every Ray test of the session."""
    import ray

    from tests.s3_server import use_test_credentials

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    use_test_credentials()  # the S3 run test's actors read the loopback server's keys from the environment
    if not ray.is_initialized():
        ray.init(
            num_cpus=16,
            num_gpus=8,
            include_dashboard=False,
            _metrics_export_port=_free_port(),
            configure_logging=False,
            log_to_driver=False,
            # Metrics reach Prometheus every 2 s instead of 10 s, so scraping tests see a short run.
            _system_config={"metrics_report_interval_ms": 2000},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def reference_run(ray_cluster, tmp_path_factory):
    """The session's one 6-epoch tiny run (tests/e2e_helpers.py REFERENCE), scraped while it trains;
    the end-to-end, run-outputs and metrics tests each assert on it (its exit code first)."""
    from tests.e2e_helpers import reference_run

    return reference_run(tmp_path_factory.mktemp("reference") / "reference-run")


@pytest.fixture(scope="module")
def s3():
    """A loopback S3 server (moto) per test module, with test credentials in the environment: its client."""
    pytest.importorskip("moto", reason="moto[server] is a dev dependency (pip install -e .[dev])")
    from tests.s3_server import start_s3_server, use_test_credentials

    use_test_credentials()
    server, client = start_s3_server()
    yield client
    server.stop()


@pytest.fixture
def atomic_puts(monkeypatch):
    """moto checks `If-None-Match` / `If-Match` and then stores the object in two steps of a threaded server; S3
    does both at once. This gives moto that atomicity, so the lease tests race the lease, not moto."""
    import threading

    from moto.s3.responses import S3Response

    lock, real = threading.Lock(), S3Response.put_object

    def put_object(self, *args, **kwargs):
        with lock:
            return real(self, *args, **kwargs)

    monkeypatch.setattr(S3Response, "put_object", put_object)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """The seed-0 tiny Qwen3 target of tests/toy.py, saved with save_pretrained: (model, folder)."""
    from tests.toy import save_tiny_target

    path = tmp_path_factory.mktemp("tiny-target")
    return save_tiny_target(path, seed=0), path


@pytest.fixture(scope="session")
def vocab64_target(tmp_path_factory):
    """A 64-token, 4-layer tiny target for trainer tests (fast steps): (model config, folder)."""
    from tests.toy import save_tiny_target

    path = tmp_path_factory.mktemp("vocab64-target")
    return save_tiny_target(path, vocab=64, hidden=32, layers=4).config, path
