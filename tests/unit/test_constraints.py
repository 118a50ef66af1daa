"""``constraints/test.txt`` pins every package of the test and benchmark extras, within
the ranges ``pyproject.toml`` declares: an extra added without refreshing the lock would
send a fresh install back to resolving (the 39-minute install this file exists to stop)."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCKED_EXTRAS = ("test", "test-gcs", "bench")


def pins() -> dict[str, Version]:
    pinned: dict[str, Version] = {}
    for line in (ROOT / "constraints" / "test.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = Version(version)
    return pinned


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        wanted += extras[extra]
    return [Requirement(r) for r in wanted]


def test_every_locked_extra_is_pinned_within_its_declared_range() -> None:
    pinned = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not in constraints/test.txt: run constraints/refresh.sh"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints/test.txt pins {name}=={pinned[name]}, outside {requirement}: "
            "run constraints/refresh.sh"
        )


def test_every_pin_is_exact_and_listed_once() -> None:
    lines = [
        ln
        for ln in (ROOT / "constraints" / "test.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    names = [canonicalize_name(ln.split("==")[0]) for ln in lines]
    assert all(ln.count("==") == 1 and " " not in ln for ln in lines)
    assert len(names) == len(set(names))
    assert "shardsafe" not in names  # the package under test is never pinned
