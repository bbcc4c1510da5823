"""A real S3 endpoint for the object storage tests: moto's standalone server on the loopback address, with fake
credentials and the endpoint in the environment, so that s3fs (and anything reading ``AWS_*``) talks to it."""

from __future__ import annotations

import pytest
import s3fs
from moto.server import ThreadedMotoServer

__all__ = ["BUCKET", "s3_server"]

BUCKET = "hp-data-test"


@pytest.fixture(scope="module")
def s3_server():
    """An S3 file system over a fresh server holding the empty bucket ``BUCKET``; stopped after the module."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
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
