"""A CheckpointManager's save asks the object store the same number of questions however
many steps its root keeps.

Every save classified every kept step twice (before writing, to refuse going back in
time, and after the commit, for retention) and looked for a stale marker in each: about
11 requests per kept step, 1,704 requests and 25 s per save at 150 steps on the S3
server (found in review). A manager now remembers what its own saves found (a step
directory stays one, a committed step stays committed): the first save of a manager
looks at each step once (3 requests: the root's listing says which names are step
directories), the next ones at the new names only. Counted here as the server counts
them: the requests moto's server logs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from shardsafe import CheckpointManager
from tests.s3server import S3Server

STATE = {"w": torch.ones(2)}


class _Requests(logging.Handler):
    """Counts the requests the loopback S3 server logs (werkzeug logs one per request)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


@pytest.fixture
def requests() -> Iterator[_Requests]:
    logger = logging.getLogger("werkzeug")
    handler, level = _Requests(), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _later_saves(root: str, requests: _Requests) -> list[int]:
    """The requests of a fresh manager's second and third saves (its first looks at
    every step once)."""
    manager = CheckpointManager(root, warn_if_not_empty=False)
    try:
        manager.latest()
        manager.save(1001, STATE)
        counts = []
        for step in (1002, 1003):
            before = requests.count
            manager.save(step, STATE)
            counts.append(requests.count - before)
        return counts
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_a_saves_requests_do_not_grow_with_the_steps_the_root_keeps(
    s3_server: S3Server, s3_bucket: str, requests: _Requests
) -> None:
    few, many = f"s3://{s3_bucket}/few", f"s3://{s3_bucket}/many"
    for root in (few, many):
        first = CheckpointManager(root)
        first.save(1000, STATE)
        first.close()
    client = s3_server.client()
    saved = s3_server.keys(s3_bucket, "many/step-000001000/")
    for step in range(1, 41):  # 40 older committed steps, copied on the server
        for key in saved:
            copy = key.replace("step-000001000", f"step-{step:09d}")
            client.copy_object(
                Bucket=s3_bucket, Key=copy, CopySource={"Bucket": s3_bucket, "Key": key}
            )

    with_few, with_many = _later_saves(few, requests), _later_saves(many, requests)
    assert with_few[0] == with_few[1] == with_many[0] == with_many[1], (with_few, with_many)
    assert with_many[0] < 40  # not one per kept step
    kept = [*range(1, 41), 1000, 1001, 1002, 1003]
    assert CheckpointManager(many, warn_if_not_empty=False).complete_steps() == kept

    # A fresh manager's first save looks at every kept step: 3 requests each (is its
    # manifest there, is a stale marker), not 6 (each step directory's kind asked again
    # after the listing that named it, its manifest asked twice).
    firsts = []
    for root in (few, many):
        manager = CheckpointManager(root)
        before = requests.count
        with pytest.warns(UserWarning, match="already holds checkpoints up to step 1003"):
            manager.save(2000, STATE)
        firsts.append(requests.count - before)
        manager.close()
    assert firsts[1] - firsts[0] <= 3 * 40, firsts
