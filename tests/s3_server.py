"""A real S3-compatible server on loopback (moto's server mode) for storage tests, and URIs into it."""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class S3Server:
    """A running moto server and one bucket in it."""

    endpoint: str  # host:port
    bucket: str

    def uri(self, prefix: str) -> str:
        """An s3:// URI the real pyarrow S3 client opens: the endpoint travels in the URI, the credentials
        come from the environment (`use_test_credentials`), as on a real cluster: the config refuses
        credentials inside a URI."""
        return (f"s3://{self.bucket}/{prefix}"
                f"?endpoint_override={self.endpoint}&scheme=http&region=us-east-1")

    def filesystem(self):
        from pyarrow.fs import S3FileSystem

        return S3FileSystem(access_key="testing", secret_key="testing", endpoint_override=self.endpoint,
                            scheme="http", region="us-east-1", allow_bucket_creation=True)


TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_EC2_METADATA_DISABLED": "true"}  # moto accepts any key; never ask an instance role


def use_test_credentials() -> None:
    """Moto's credentials into this process's environment. Call it before `ray.init`: Ray workers
    inherit the environment the local cluster was started with, and the run's driver subprocess this one."""
    for key, value in TEST_CREDENTIALS.items():
        os.environ.setdefault(key, value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3_server():
    """(server, S3Server): moto on a free loopback port with a fresh bucket; call server.stop() after."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = S3Server(endpoint=f"127.0.0.1:{port}", bucket=f"dflash-{uuid.uuid4().hex[:8]}")
    s3.filesystem().create_dir(s3.bucket)
    return server, s3
