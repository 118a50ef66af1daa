"""A store that misbehaves through a proxy on 127.0.0.1 (``tests/s3proxy.py``) in front
of moto's server: an upload acknowledged and dropped, bytes damaged on the way back.

* The manifest is committed last, but the store's word is all a save has that the
  objects before it are there. When it lied, the new step was unloadable, ``keep_last=1``
  deleted step 1, and a restart found nothing to load (found in review). Retention now
  checks that the new step's data objects are listed at their recorded sizes before it
  deletes an older checkpoint.
* A store that closes the connection on an upload: botocore's ``ConnectionClosedError``
  escaped raw, naming the endpoint's HTTP address and a line inside aiobotocore (found
  in review); now a ``CheckpointError`` naming the object's URL.
* A response whose body does not match the checksum the store sent with it raised
  botocore's ``FlexibleChecksumError`` raw, naming no object, and was not fetched again
  (found in review): now it is, and then it is the store's failure, naming the object.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import shardsafe
from shardsafe import CheckpointManager
from shardsafe.checkpoint.storage.store_failures import StoreFailedError
from tests.s3proxy import HANG_UP, S3Proxy
from tests.s3server import S3Server

pytest.importorskip("s3fs")
pytestmark = pytest.mark.timeout(120)


def test_retention_keeps_the_last_loadable_step_when_the_store_dropped_a_new_object(
    s3_server: S3Server, s3_bucket: str, s3_proxy: S3Proxy
) -> None:
    def dropped(method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes] | None:
        if method == "PUT" and "/step-000000002/shard-" in path:
            return 200, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'}, b""
        return None

    s3_proxy.answer = dropped
    root = f"s3://{s3_bucket}/run"
    manager = CheckpointManager(root, keep_last=1, storage_options=s3_proxy.options())
    manager.save(1, {"w": torch.full((4,), 1.0)})
    with pytest.warns(UserWarning) as warned:
        manager.save(2, {"w": torch.full((4,), 2.0)})
    manager.close()
    said = [str(w.message) for w in warned if "retention" in str(w.message)]
    assert said == [
        f"shardsafe: retention deleted no checkpoint: the new one, {root}/step-000000002, is "
        "not whole in the store (data file shard-00000-of-00001.safetensors is missing), "
        "which said it had stored it; the older ones are what a restart can load"
    ]
    assert s3_server.keys(s3_bucket, "run/step-000000001/") == [
        "run/step-000000001/manifest.json",
        "run/step-000000001/shard-00000-of-00001.safetensors",
    ]
    state = {"w": torch.zeros(4)}
    with pytest.warns(UserWarning, match="passing over .*step-000000002: data"):
        CheckpointManager(root).load_latest(state)  # straight to the store
    assert torch.equal(state["w"], torch.full((4,), 1.0))


@pytest.mark.parametrize("times", [1, 100])
def test_a_manifest_damaged_on_the_way_is_fetched_again_then_named(
    s3_bucket: str, s3_proxy: S3Proxy, times: int
) -> None:
    """Once: fetched again, loaded whole. Always: the store's failure, naming the object."""
    url = f"s3://{s3_bucket}/ckpt"
    shardsafe.save(url, {"w": torch.full((4,), 3.0)})
    left = [times]

    def flipped(method: str, path: str, body: bytes) -> bytes:
        if method == "GET" and path.split("?")[0].endswith("/manifest.json") and left[0]:
            left[0] -= 1
            return bytes([body[0] ^ 1]) + body[1:]
        return body

    s3_proxy.alter = flipped
    state = {"w": torch.zeros(4)}
    if times == 1:
        shardsafe.load(url, state, storage_options=s3_proxy.options())
        assert torch.equal(state["w"], torch.full((4,), 3.0))
        return
    with pytest.raises(StoreFailedError) as raised:
        shardsafe.load(url, state, storage_options=s3_proxy.options())
    assert str(raised.value).startswith(
        f"reading {url}/manifest.json failed: the object store's response did not match the "
        "checksum it sent with it, 5 times (FlexibleChecksumError: "
    ), str(raised.value)
    assert torch.equal(state["w"], torch.zeros(4))


def test_an_upload_the_store_hangs_up_on_is_an_error_naming_the_object(
    s3_server: S3Server, s3_bucket: str, s3_proxy: S3Proxy
) -> None:
    s3_proxy.answer = lambda method, path, body: (
        HANG_UP if method == "PUT" and "/step-000000002/shard-" in path else None
    )
    root = f"s3://{s3_bucket}/run"
    manager = CheckpointManager(root, storage_options=s3_proxy.options())
    manager.save(1, {"w": torch.full((4,), 1.0)})
    with pytest.raises(shardsafe.CheckpointError) as raised:
        manager.save(2, {"w": torch.full((4,), 2.0)})
    manager.close()
    assert str(raised.value).startswith(
        f"the object store failed at {root}/step-000000002/shard-00000-of-00001.safetensors: "
        "ConnectionClosedError: Connection was closed before we received a valid response "
        "from endpoint URL: "
    ), str(raised.value)
    assert [k for k in s3_server.keys(s3_bucket, "run/step-000000002/") if "manifest" in k] == []
    state = {"w": torch.zeros(4)}
    CheckpointManager(root).load_latest(state)
    assert torch.equal(state["w"], torch.full((4,), 1.0))
