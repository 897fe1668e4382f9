"""Which ``torch`` names a peer's Python sources refer to that the installed torch lacks: a check, before launching a
peer's own trainer, that it can run on this torch at all.

    python3 -m bench.peers.torch_api_audit /tmp/site/torchtitan/trainer.py /tmp/site/torchtitan/distributed ...

Reads the sources (it imports none of them), collects every ``from torch... import name``, ``import torch...`` and
attribute chain rooted at ``torch`` or at a name bound to a torch module or object (``import torch.distributed as
dist``: ``dist.set_timeout``), and resolves each against the torch installed here. A missing name at module scope
fails the import; one inside a function or method fails when that code runs (a branch a run never takes never
fails). Keyword arguments are not checked (a new keyword of an existing function is not found here).
Prints one ``MISSING`` line per name and exits 1 when any is missing.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import os
import sys
from typing import Iterator, Optional


@dataclasses.dataclass(frozen=True)
class Reference:
    name: str
    """Dotted, from ``torch``: ``torch.distributed.set_timeout``."""
    path: str
    line: int
    scope: str
    """``"import"`` (module scope: the module fails to import without it) or ``"call"`` (inside a function)."""


def _chain(node: ast.AST) -> Optional[list[str]]:
    """``a.b.c`` as ``["a", "b", "c"]``; ``None`` where the root is not a plain name (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _bindings(tree: ast.Module) -> dict[str, str]:
    """Names the module binds to torch modules or objects: ``import torch.nn as nn`` -> ``{"nn": "torch.nn"}``,
    ``from torch.distributed import fsdp`` -> ``{"fsdp": "torch.distributed.fsdp"}``; ``torch`` itself always."""
    bound = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch" \
                and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _walk(node: ast.AST, scope: str) -> Iterator[tuple[ast.AST, str]]:
    """Every node under ``node`` with its scope: ``"call"`` from the first function or lambda down."""
    for child in ast.iter_child_nodes(node):
        inner = "call" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else scope
        yield child, inner
        yield from _walk(child, inner)


def torch_references(source: str, path: str = "<source>") -> list[Reference]:
    """The torch names ``source`` refers to, each once per line, longest chain only (``torch.a.b`` covers
    ``torch.a``)."""
    tree = ast.parse(source, filename=path)
    bound = _bindings(tree)
    found: dict[tuple[str, int], str] = {}
    inner: set[int] = set()  # attribute nodes that are the value of a longer chain already taken
    for node, scope in _walk(tree, "import"):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch" \
                and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.Attribute) and id(node) not in inner and isinstance(node.ctx, ast.Load):
            parts = _chain(node)
            value = node.value
            while isinstance(value, ast.Attribute):
                inner.add(id(value))
                value = value.value
            if parts and parts[0] in bound:
                names = [".".join([bound[parts[0]], *parts[1:]])]
        for name in names:
            key = (name, getattr(node, "lineno", 0))
            if key not in found or scope == "import":
                found[key] = scope
    return [Reference(name, path, line, scope) for (name, line), scope in sorted(found.items(), key=lambda i: i[0][1])]


def resolves(name: str) -> bool:
    """Whether the dotted ``name`` exists in the torch installed here: the longest importable module prefix, then
    attributes (a submodule not yet imported is imported)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
            break
        except Exception:  # noqa: BLE001 - a prefix that is not a module (or fails to import) is tried shorter
            continue
    else:
        return False
    for index in range(end, len(parts)):
        if hasattr(obj, parts[index]):
            obj = getattr(obj, parts[index])
            continue
        try:
            obj = importlib.import_module(".".join(parts[:index + 1]))
        except Exception:  # noqa: BLE001 - neither an attribute nor a submodule
            return False
    return True


def python_files(paths: list[str], exclude: tuple[str, ...] = ()) -> Iterator[str]:
    """The ``.py`` files of ``paths`` (files, or folders searched), but those whose path contains an ``exclude``
    string."""
    for path in paths:
        if os.path.isdir(path):
            found = (os.path.join(folder, f) for folder, _dirs, files in sorted(os.walk(path))
                     for f in sorted(files) if f.endswith(".py"))
        else:
            found = iter([path])
        yield from (f for f in found if not any(part in f for part in exclude))


def audit(paths: list[str], exclude: tuple[str, ...] = ()) -> list[Reference]:
    """The references of every ``.py`` file under ``paths`` (:func:`python_files`) that the installed torch lacks."""
    missing = []
    known: dict[str, bool] = {}
    for path in python_files(paths, exclude):
        with open(path, encoding="utf-8") as f:
            references = torch_references(f.read(), path)
        for ref in references:
            if ref.name not in known:
                known[ref.name] = resolves(ref.name)
            if not known[ref.name]:
                missing.append(ref)
    return missing


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.peers.torch_api_audit", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="Python files or folders (searched for .py files)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="leave out files whose path contains this (repeatable): code a run does not reach")
    parser.add_argument("--relative-to", default=None, help="print paths relative to this folder")
    args = parser.parse_args(argv)
    import torch

    missing = audit(args.paths, tuple(args.exclude))
    for ref in missing:
        where = os.path.relpath(ref.path, args.relative_to) if args.relative_to else ref.path
        print(f"MISSING {ref.name} {where}:{ref.line} ({ref.scope})")
    at_import = sorted({ref.name for ref in missing if ref.scope == "import"})
    print(f"torch {torch.__version__}: {len({ref.name for ref in missing})} name(s) missing, "
          f"{len(at_import)} at import{': ' + ', '.join(at_import) if at_import else ''}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
