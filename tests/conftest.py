import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Read by ``import gcsfs`` (see tests/gcsserver.py): set before any test module imports
# it, as a test of another file may do before the ``gcs_server`` fixture sets it (then
# every request of a gs:// test waited out gcsfs's 60 s gRPC probe of the bucket).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


LAUNCHING_FIRST = ("e2e", "hf_accelerate", "hf_transformers", "lightning", "distributed")
"""The folders whose tests launch real processes, slowest first. The README runs the
suite on 2 workers (``-n 2 --dist loadfile``), each handed whole files in collection
order as it frees up: a long file collected last ran alone at the end (the benchmarks'
smoke run, 3 minutes of one busy core, made one run 25 minutes instead of about 22)."""

FIRST_OF_ALL = "tests/e2e/test_benchmarks_smoke.py"
"""The slowest file by far, so that the other worker takes everything else meanwhile."""


def _launch_order(item: pytest.Item) -> tuple[int, int]:
    path = item.nodeid.split("::", 1)[0]
    folder = path.split("/")[1] if path.count("/") >= 2 else ""
    rank = LAUNCHING_FIRST.index(folder) if folder in LAUNCHING_FIRST else len(LAUNCHING_FIRST)
    return (0 if path == FIRST_OF_ALL else 1, rank)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
    items.sort(key=_launch_order)  # stable: each file's own order is kept


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this host (a lock's owner that is alive), killed after the test."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


from tests.gcsserver import gcs_bucket, gcs_server  # noqa: E402, F401 - fixtures
from tests.s3proxy import s3_proxy  # noqa: E402, F401 - fixture
from tests.s3server import s3_bucket, s3_server  # noqa: E402, F401 - fixtures
