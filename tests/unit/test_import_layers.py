"""The package's modules import one another without cycles, lazy imports counted, and every arrow points down the
floors of docs/design.md §2."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fpdt"
BENCH = PACKAGE.parent / "bench"

FLOORS = [
    {"flops", "fused", "offload", "lightning_private"},
    {"sequence"},
    {"data", "memory", "models"},
    {"integrations"},
    {"planner"},
    {"callbacks"},
    {"strategy"},
    {"top"},
]
"""Bottom to top: a room imports only from itself and the floors below it, never from a room beside it (``top`` is
the package's ``__init__``, ``cli`` and ``export``)."""
MAX_FLOORS = 9
ALLOWED_BELOW = {"flops": set(), "fused": set(), "offload": set(), "lightning_private": set(),
                 "sequence": {"flops", "offload"}}
"""Rooms that import less than every floor below them: the ground floor imports nothing of the package but itself,
``sequence`` only the leaf checks of ``flops`` and where its chunks wait (``offload``)."""


def floor_of(room: str) -> int:
    return next(index for index, rooms in enumerate(FLOORS) if room in rooms)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(*roots: Path) -> dict[str, Path]:
    return {module_name(path): path for root in roots or (PACKAGE,) for path in root.rglob("*.py")}


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports anywhere in its body (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import module` depends on that module; `from module import name` on the module
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [m for m in submodules if m in known] or [node.module]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def graph(*roots: Path) -> dict[str, set[str]]:
    known = modules(*roots)
    return {name: imported(path, known) - {name} for name, path in known.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("cli", "export"):
        return "top"
    return parts[1]


def test_no_import_cycle():
    """No module of the package or of bench/ reaches itself through imports, counting imports inside functions (no
    lazy import hides a cycle)."""
    edges = graph(PACKAGE, BENCH)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_imports_point_down_the_layers():
    """A subpackage imports only its own layer and the layers below it."""
    wrong = []
    for module, targets in graph().items():
        here = layer(module)
        below = ALLOWED_BELOW.get(here, set().union(*FLOORS[:floor_of(here)]))
        wrong += [f"{module} -> {t}" for t in targets if layer(t) != here and layer(t) not in below]
    assert not wrong, "imports that point up or sideways: " + ", ".join(sorted(wrong))


def test_every_room_has_a_floor():
    """Every subpackage and top-level module of the package stands on one floor, and the floors are at most
    ``MAX_FLOORS``: a new room finds its place among them rather than stacking another."""
    rooms = {layer(module) for module in modules()}
    assert rooms == set().union(*FLOORS), f"rooms without a floor: {sorted(rooms - set().union(*FLOORS))}"
    assert len(FLOORS) <= MAX_FLOORS


def test_sequence_imports_no_lightning():
    """``sequence/``, ``offload/`` and ``fused/`` are plain PyTorch: no Lightning anywhere in them, functions
    included."""
    offending = []
    for path in [path for room in ("sequence", "offload", "fused") for path in (PACKAGE / room).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offending += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert not offending, offending


def test_bench_runs_as_modules():
    """bench/ is a package like the library: its scripts run as ``python3 -m bench.<name>`` from the repository root,
    none edits ``sys.path`` to find the package."""
    edits = [path.name for path in BENCH.rglob("*.py") if "sys.path.insert" in path.read_text()]
    assert not edits, edits


def test_package_never_imports_bench():
    """bench/ sits above the package: it measures the library, the library never reaches into it."""
    known = modules(PACKAGE, BENCH)
    wrong = [f"{name} -> {target}" for name, path in modules(PACKAGE).items()
             for target in imported(path, known) if target.split(".")[0] == "bench"]
    assert not wrong, wrong
