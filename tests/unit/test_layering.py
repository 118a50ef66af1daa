"""The engine's layering, pinned: what each part of ``checkpoint/`` may import.

``checkpoint/`` is four layers under the phase modules (``docs/design.md`` draws them):
``format`` (what the bytes mean) < ``storage`` (bytes in and out of a directory) <
``plan`` (what a save writes, what a load reads) < ``io`` (carrying out a plan) < the
phases (``saving``, ``loading``, ``background``, ``manager``, ...). A module may import
its own layer and those below, never one above, and only the few modules outside
``checkpoint/`` its layer needs.

The imports are read from the source (every ``import`` statement, inside functions
too, except those only for type checkers), which is stricter than looking at
``sys.modules`` after an import: ``import shardsafe`` loads the whole public API on
purpose, so what a module needs at run time cannot be told apart that way.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardsafe

SRC = Path(shardsafe.__file__).parent
CHECKPOINT = "shardsafe.checkpoint"
LAYERS = ("format", "storage", "plan", "io")
PHASES = len(LAYERS)
BASE = {"shardsafe.dtypes", "shardsafe.errors", "shardsafe.protocol", "shardsafe._warnings"}
ALLOWED_OUTSIDE = {
    "format": BASE,
    "storage": {"shardsafe.errors", "shardsafe._warnings"},
    "plan": BASE | {"shardsafe._names", "shardsafe.adapters"},
    "io": BASE | {"shardsafe.distributed", "shardsafe.adapters"},
}
CONCRETE_STORAGES = ("LocalStorage", "FsspecStorage")


def _module_of(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _modules() -> dict[str, Path]:
    return {_module_of(p)[0]: p for p in SRC.rglob("*.py")}


MODULES = _modules()


def _type_checking_only(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(inner) for inner in ast.walk(node))
    return ids


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """Every shardsafe module ``module`` imports (a name imported from a package counts as
    that package's submodule when there is one), with its line."""
    path = MODULES[module]
    _, is_package = _module_of(path)
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardsafe"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("shardsafe"):
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield (submodule if submodule in MODULES else target), node.lineno


def _layer(module: str) -> int | None:
    """0..3 for format, storage, plan, io; 4 for the phase modules; None outside."""
    if module != CHECKPOINT and not module.startswith(CHECKPOINT + "."):
        return None
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return PHASES


def _engine_modules() -> list[str]:
    return sorted(m for m in MODULES if _layer(m) is not None)


def test_every_checkpoint_module_lives_in_a_layer_or_is_a_phase() -> None:
    """The flat folder is gone: only the phase modules sit directly in ``checkpoint/``."""
    top = sorted(m.rsplit(".", 1)[1] for m in MODULES if m.count(".") == 2 and _layer(m) == 4)
    assert top == [
        "api",
        "background",
        "finding",
        "inspecting",
        "loading",
        "manager",
        "options",
        "references",
        "refusals",
        "replacing",
        "saving",
        "streaming",
        "verifying",
    ]


@pytest.mark.parametrize("module", _engine_modules())
def test_no_module_imports_a_layer_above_its_own(module: str) -> None:
    own = _layer(module)
    assert own is not None
    for target, line in imports_of(module):
        layer = _layer(target)
        if layer is None or target == CHECKPOINT:
            continue
        assert layer <= own, (
            f"{module}:{line} imports {target}, a layer above "
            f"({(*LAYERS, 'phases')[own]} may not import {(*LAYERS, 'phases')[layer]})"
        )


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_only_what_it_needs_from_outside_the_engine(layer: str) -> None:
    allowed = ALLOWED_OUTSIDE[layer]
    for module in _engine_modules():
        if _layer(module) != LAYERS.index(layer):
            continue
        for target, line in imports_of(module):
            if _layer(target) is not None or target == "shardsafe":
                continue
            assert any(target == a or target.startswith(a + ".") for a in allowed), (
                f"{module}:{line} imports {target}; the {layer} layer may import only "
                f"{sorted(allowed)} from outside checkpoint/"
            )


def test_the_modules_below_the_format_import_nothing_of_the_engine() -> None:
    """What the format relies on (dtypes, errors, the adapters' records) stands alone."""
    for module in sorted(BASE | {"shardsafe._names"}):
        engine = [t for t, _ in imports_of(module) if _layer(t) is not None]
        assert engine == [], f"{module} imports {engine}"


def _cycle_from(start: str, graph: dict[str, set[str]], done: set[str]) -> list[str] | None:
    """An import cycle reachable from ``start`` (depth first, without recursion)."""
    path, stack = [start], [iter(sorted(graph[start]))]
    while stack:
        child = next(stack[-1], None)
        if child is None:
            done.add(path.pop())
            stack.pop()
        elif child in path:
            return [*path[path.index(child) :], child]
        elif child not in done:
            path.append(child)
            stack.append(iter(sorted(graph[child])))
    return None


def test_there_is_no_import_cycle_in_the_package() -> None:
    graph = {m: {t for t, _ in imports_of(m) if t in MODULES and t != m} for m in MODULES}
    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            cycle = _cycle_from(start, graph, done)
            assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _names_used(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    return names


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nothing_outside_storage_checks_or_names_an_object_store(module: str) -> None:
    """What differs between stores is a capability of ``Storage``; no caller asks which
    store it holds. Local-only code outside the engine (the node-local tier, Lightning's
    local cleanup) may open a ``LocalStorage``, but nothing in the engine may."""
    if module.startswith(CHECKPOINT + ".storage"):
        return
    used = _names_used(module)
    assert "FsspecStorage" not in used, f"{module} names FsspecStorage"
    if _layer(module) is not None:
        assert "LocalStorage" not in used, f"{module} names LocalStorage"
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            checked = ast.unparse(node.args[1]) if len(node.args) == 2 else ""
            for concrete in CONCRETE_STORAGES:
                assert concrete not in checked, f"{module}:{node.lineno} checks {concrete}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nothing_outside_the_command_line_imports_it(module: str) -> None:
    """``commands/`` prints what the library returns; nothing else may need it."""
    if module.startswith("shardsafe.commands") or module in {"shardsafe.cli", "shardsafe.__main__"}:
        return
    for target, line in imports_of(module):
        assert not target.startswith("shardsafe.commands"), f"{module}:{line} imports {target}"
