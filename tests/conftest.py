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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


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
from tests.s3server import s3_bucket, s3_server  # noqa: E402, F401 - fixtures
