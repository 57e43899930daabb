"""A real S3 API on loopback for the object-storage tests: moto's server mode, s3fs to it.

``s3`` fixture: a fresh bucket per test on one server per test module; yields ``S3`` with the
``url`` of a run prefix in that bucket and the ``options`` an engine, the CLI or
``FsspecReader`` needs to reach it. Skips cleanly when moto or s3fs are not installed.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass

import pytest

moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (the s3 extra)")
s3fs = pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")

CREDENTIALS = {"key": "testing", "secret": "testing"}


@dataclass
class S3:
    endpoint: str
    bucket: str
    url: str  # s3://bucket/run
    options: dict  # storage_options: endpoint and credentials

    def fs(self):
        return s3fs.S3FileSystem(**self.options, skip_instance_cache=True)

    def env(self) -> dict:
        """Environment of a process that reaches the server through fsspec's own config."""
        return {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


@pytest.fixture(scope="module")
def s3_endpoint():
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint):
    options = {"endpoint_url": s3_endpoint, **CREDENTIALS}
    bucket = f"b{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
    return S3(s3_endpoint, bucket, f"s3://{bucket}/run", options)
