"""A real Google Cloud Storage JSON API server on loopback for the ``gs://`` tests:
``gcp-storage-emulator``, in memory, on a free port of 127.0.0.1 (nothing else is
contacted).

gcsfs is told everything it would otherwise look up: the endpoint, anonymous
credentials (its default chain would ask the GCE metadata server, another address) and
a project. Its experimental zonal-bucket file system (on by default since 2026.x) first
asks each bucket's type over gRPC, which the emulator does not serve, and waits 60 s per
call before falling back, so ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` selects the
plain JSON API one: the environment is set here and handed to rank processes (see
:func:`tests.s3server.with_env`), and read by ``import gcsfs``.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

_BUCKETS = itertools.count()


@dataclass
class GcsServer:
    endpoint: str
    env: dict[str, str]

    @property
    def options(self) -> dict[str, Any]:
        """``storage_options`` for shardsafe (gcsfs's constructor arguments)."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "shardsafe-test"}

    def fs(self) -> Any:
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self.options)

    def new_bucket(self) -> str:
        name = f"bucket-{os.getpid()}-{next(_BUCKETS)}"
        self.fs().mkdir(name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        found = self.fs().find(f"{bucket}/{prefix}")
        return sorted(path.split("/", 1)[1] for path in found)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsServer]:
    env = {
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "NO_GCE_CHECK": "true",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    pytest.importorskip("gcsfs")
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = emulator.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        yield GcsServer(f"http://127.0.0.1:{port}", env)
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def gcs_bucket(gcs_server: GcsServer) -> str:
    return gcs_server.new_bucket()
