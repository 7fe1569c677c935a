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


class FaultyFront:
    """An HTTP front to a moto server that answers the next `count` requests of a method with an S3 error
    (`fail`), forwarding everything else; `tries` counts the requests of each method it saw, independently
    of the client under test."""

    def __init__(self, upstream: S3Server) -> None:
        import threading
        from collections import Counter
        from http.server import ThreadingHTTPServer

        self.upstream, self.lock, self.faults, self.tries = upstream, threading.Lock(), {}, Counter()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _front_handler(self))
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def uri(self, prefix: str) -> str:
        """An s3:// URI into the upstream's bucket, through this front."""
        return f"s3://{self.upstream.bucket}/{prefix}?endpoint_override={self.endpoint}&scheme=http&region=us-east-1"

    def fail(self, method: str, count: int, status: int = 503, code: str = "SlowDown") -> None:
        with self.lock:
            self.faults[method] = (count, status, code)
        self.tries.clear()

    def take_fault(self, method: str) -> tuple[int, str] | None:
        with self.lock:
            self.tries[method] += 1
            count, status, code = self.faults.get(method, (0, 0, ""))
            if count <= 0:
                return None
            self.faults[method] = (count - 1, status, code)
            return status, code

    def stop(self) -> None:
        self.server.shutdown()


def _front_handler(front: FaultyFront):
    import http.client
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes, length: int) -> None:
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _body(self) -> bytes:
            """The request body as sent: the S3 client streams uploads chunked (aws-chunked, with a trailer)."""
            if "chunked" not in self.headers.get("Transfer-Encoding", ""):
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))
            raw = b""
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (trailer := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                        raw += trailer
                    return raw + b"\r\n"
                raw += self.rfile.read(size + 2)

        def _any(self) -> None:
            body = self._body()
            fault = front.take_fault(self.command)
            if fault is not None:
                xml = f"<?xml version='1.0'?><Error><Code>{fault[1]}</Code><Message>injected</Message></Error>".encode()
                return self._answer(fault[0], [("Content-Type", "application/xml")], xml, len(xml))
            host, port = front.upstream.endpoint.split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
            got = conn.getresponse()
            data = got.read()
            keep = [(k, v) for k, v in got.getheaders()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date")]
            length = int(got.getheader("Content-Length") or 0) if self.command == "HEAD" else len(data)
            conn.close()
            self._answer(got.status, keep, data, length)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

    return Handler
