"""A moto S3 server on loopback for the benchmarks whose storage is an object store."""

from __future__ import annotations

import logging
from typing import Any


def start_moto() -> tuple[Any, dict[str, str]]:
    """A started ``ThreadedMotoServer`` on 127.0.0.1 (a free port; its per-request log
    silenced) and the environment that points boto3 and s3fs at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return server, env
