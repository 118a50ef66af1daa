import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


from tests.gcsserver import gcs_bucket, gcs_server  # noqa: E402, F401 - fixtures
from tests.s3server import s3_bucket, s3_server  # noqa: E402, F401 - fixtures
