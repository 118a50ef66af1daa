"""An object store that refuses every request (HTTP 403, as Google Cloud Storage answers
credentials without access) is reported as the store's refusal, naming the URL.

Found in review: gcsfs's ``isdir`` answers ``False`` for any error, so ``load``,
``inspect`` and ``verify`` said the checkpoint "does not exist" (sending the user looking
for a checkpoint that may be there), and a manager's ``latest``/``load_latest`` raised
gcsfs's raw ``OSError``, which a loop's ``except CheckpointError`` missed.

The store is a plain HTTP server on 127.0.0.1 answering 403 to everything; the calls run
in a fresh interpreter, since gcsfs reads its settings when it is imported (see
``tests/gcsserver.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("gcsfs")
pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import http.server, json, os, threading
os.environ.update(GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", NO_GCE_CHECK="true")

class Refuse(http.server.BaseHTTPRequestHandler):
    def refuse(self):
        body = json.dumps({"error": {"code": 403, "message": "caller lacks access"}}).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = refuse
    def log_message(self, *args): pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
threading.Thread(target=server.serve_forever, daemon=True).start()
import torch, shardsafe
options = {"endpoint_url": f"http://127.0.0.1:{server.server_port}", "token": "anon",
           "project": "p"}
step = "gs://bkt/run/step-1"
calls = {
    "load": lambda: shardsafe.load(step, {"w": torch.zeros(2)}, storage_options=options),
    "inspect": lambda: shardsafe.inspect(step, storage_options=options),
    "verify": lambda: shardsafe.verify(step, storage_options=options),
    "latest": lambda: shardsafe.CheckpointManager("gs://bkt/run", storage_options=options).latest(),
    "load_latest": lambda: shardsafe.CheckpointManager(
        "gs://bkt/run", storage_options=options
    ).load_latest({"w": torch.zeros(2)}),
}
said = {}
for name, call in calls.items():
    try:
        call()
        said[name] = "no error"
    except Exception as e:
        said[name] = [type(e).__name__, isinstance(e, shardsafe.CheckpointError), str(e)]
print(json.dumps(said))
"""


def test_a_refused_request_is_the_stores_refusal_not_a_missing_checkpoint() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    refused = "OSError: Forbidden: b/bkt/o caller lacks access"
    for name in ("load", "inspect", "verify"):
        assert said[name] == [
            "CheckpointError",
            True,
            f"the object store failed at gs://bkt/run/step-1: {refused}",
        ], (name, said[name])
    for name in ("latest", "load_latest"):
        assert said[name] == [
            "CheckpointError",
            True,
            f"the object store failed at gs://bkt/run: {refused}",
        ], (name, said[name])
