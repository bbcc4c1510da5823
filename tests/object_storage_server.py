"""A real S3 endpoint for the object storage tests: moto's standalone server on the loopback address, with fake
credentials and the endpoint in the environment, so that s3fs (and anything reading ``AWS_*``) talks to it."""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import urllib.request

import pytest
import s3fs
from moto.server import ThreadedMotoServer

__all__ = ["BUCKET", "FaultyProxy", "s3_server"]

BUCKET = "hp-data-test"


@pytest.fixture(scope="module")
def s3_server():
    """An S3 file system over a fresh server holding the empty bucket ``BUCKET`` (and no other); stopped after the
    module."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets per process, not per server: empty them, or a second module would find the first's.
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        s3fs.S3FileSystem.clear_instance_cache()  # instances remember the endpoint they were made with
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        try:
            yield fs
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            server.stop()


class FaultyProxy:
    """An HTTP proxy on loopback in front of ``upstream`` that fails chosen ranged GETs: the ``n``-th one (counted
    from 1) when ``n`` is in ``failing``, or every one from ``always_from`` on, by a 503 answer or, with ``drop``,
    by closing the connection without one."""

    def __init__(
        self, upstream: str, failing: set[int] = frozenset(), always_from: int | None = None, drop: bool = False
    ) -> None:
        self.failing, self.always_from, self.drop = set(failing), always_from, drop
        self.ranged_gets = 0
        self._lock = threading.Lock()
        upstream_host = upstream.removeprefix("http://")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet, like the server's own logger
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                if self.command == "GET" and "Range" in self.headers and proxy._fails():
                    if proxy.drop:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                connection = http.client.HTTPConnection(upstream_host)
                connection.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = connection.getresponse()
                payload = answer.read()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    # A HEAD answer keeps the object's length; other answers carry exactly their payload.
                    if name.lower() not in ("transfer-encoding", "connection") and (
                        name.lower() != "content-length" or self.command == "HEAD"
                    ):
                        self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                connection.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _fails(self) -> bool:
        with self._lock:
            self.ranged_gets += 1
            n = self.ranged_gets
        return n in self.failing or (self.always_from is not None and n >= self.always_from)

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
