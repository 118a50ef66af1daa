"""A real S3 API server on loopback for the object-storage tests: moto's server mode.

Started once per test session on a free port of 127.0.0.1 (nothing else is contacted);
each test gets a bucket of its own. Rank processes are forked from a forkserver that may
predate the fixture, so tests hand :attr:`S3Server.env` to them explicitly (see
:func:`with_env`) instead of relying on inherited environment variables.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

_BUCKETS = itertools.count()


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"bucket-{os.getpid()}-{next(_BUCKETS)}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, bucket: str, key: str) -> bytes:
        body: bytes = self.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        return body

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def restore_bucket(self, bucket: str, pristine: str) -> None:
        """Make ``bucket`` hold exactly a copy of ``pristine``'s objects again (a test that
        needs a run's own URL, as a local tier's copies record it, and its objects as a
        fixture left them)."""
        client = self.client()
        for key in self.keys(bucket):
            client.delete_object(Bucket=bucket, Key=key)
        for key in self.keys(pristine):
            client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": pristine, "Key": key})

    def copy_bucket(self, bucket: str) -> str:
        """A new bucket holding a copy of every object of ``bucket`` (server-side copies)."""
        copied, client = self.new_bucket(), self.client()
        for key in self.keys(bucket):
            client.copy_object(Bucket=copied, Key=key, CopySource={"Bucket": bucket, "Key": key})
        return copied


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield S3Server(endpoint, env)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


def with_env(rank: int, world: int, env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(rank, world, *args)`` in a rank process with ``env`` set (see module doc)."""
    os.environ.update(env)
    return fn(rank, world, *args)
