"""The consolidated ``model.safetensors`` is a plain weights file: a program that has never
heard of shardsafe loads it with ``safetensors.torch.load_file`` + ``load_state_dict``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe

MODEL_SOURCE = """
import torch
from torch import nn

def make_model():
    return nn.Sequential(
        nn.Linear(5, 7),
        nn.BatchNorm1d(7),
        nn.GELU(),
        nn.Linear(7, 3, bias=False),
    ).to(torch.bfloat16)
"""

CHILD = """
import sys
sys.modules["shardsafe"] = None  # any `import shardsafe` now raises ImportError
try:
    import shardsafe
except ImportError:
    pass
else:
    raise SystemExit("shardsafe is importable in the child")
import torch
from safetensors.torch import load_file
{model_source}
model = make_model()
state = load_file(sys.argv[1])
model.load_state_dict(state)  # strict: exactly the model's keys
expected = torch.load(sys.argv[2], weights_only=True)
assert list(state) != [] and sorted(state) == sorted(expected), (sorted(state), sorted(expected))
for name, tensor in model.state_dict().items():
    assert tensor.dtype == expected[name].dtype, name
    assert torch.equal(tensor, expected[name]), name
assert "shardsafe" not in {{m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}}
print("OK", len(state))
"""


def make_model() -> nn.Module:
    namespace: dict[str, object] = {}
    exec(MODEL_SOURCE, namespace)
    return namespace["make_model"]()  # type: ignore[operator,no-any-return]


@pytest.mark.timeout(120)
def test_consolidated_model_loads_without_shardsafe(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = make_model()
    model(torch.randn(4, 5, dtype=torch.bfloat16)).float().sum().backward()  # BN stats move
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    opt.step()
    ckpt = tmp_path / "ckpt"
    shardsafe.save(ckpt, {"model": model, "optimizer": opt}, layout="consolidated")
    expected = tmp_path / "expected.pt"
    torch.save(model.state_dict(), expected)

    script = tmp_path / "child.py"
    script.write_text(CHILD.format(model_source=textwrap.dedent(MODEL_SOURCE)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, str(script), str(ckpt / "model.safetensors"), str(expected)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["OK", str(len(model.state_dict()))]
