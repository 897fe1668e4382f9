"""Sizes the code keeps (docs/design.md §2, §5): no library file past 480 lines, and the two Lightning adapters thin
and apart, each hook a line or two into the run both drive (strategy/run.py) rather than a copy of the other's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fpdt"
TRAINER, FABRIC = PACKAGE / "strategy" / "trainer.py", PACKAGE / "strategy" / "fabric.py"
MAX_LINES = 480
TRIVIAL = re.compile(
    r"(@override|@property|@classmethod|@staticmethod|@contextmanager|@\w+\.setter|return|pass|else:|try:|finally:"
    r"|yield|[)\]}],?|\) -> None:|self,|\*,|import \w+|from __future__ import annotations)"
)
"""Lines that say nothing of their own: any two classes share them."""


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else ():
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and \
                    isinstance(statement.value.value, str):
                lines.update(range(statement.lineno, statement.end_lineno + 1))
    return lines


def _signature_lines(tree: ast.AST) -> set[int]:
    """The lines of a constructor's keyword parameters (its flat signature, which LightningCLI reads)."""
    return {arg.lineno for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "__init__"
            for arg in [*node.args.args, *node.args.kwonlyargs, *filter(None, [node.args.kwarg])]}


def code_lines(path: Path, *, without_signatures: bool = False) -> list[str]:
    """The file's code lines, stripped: not blank, not a comment, not in a docstring."""
    text = path.read_text()
    tree = ast.parse(text)
    skipped = _docstring_lines(tree) | (_signature_lines(tree) if without_signatures else set())
    stripped = ((number, line.strip()) for number, line in enumerate(text.splitlines(), 1))
    return [line for number, line in stripped if line and not line.startswith("#") and number not in skipped]


def shared_lines(first: Path, second: Path) -> set[str]:
    """The non-trivial code lines both files hold, the constructors' flat signatures not counted."""
    def lines(path: Path) -> set[str]:
        return {line for line in code_lines(path, without_signatures=True) if not TRIVIAL.fullmatch(line)}

    return lines(first) & lines(second)


def test_no_library_file_is_longer_than_480_lines():
    """Every module of the package fits in 480 lines; one that outgrows them splits by what its parts do."""
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_adapters_stay_thin():
    """The Trainer's adapter is at most 420 lines and 270 code lines, Fabric's at most 300 lines: what both front
    doors do is the run's."""
    assert len(TRAINER.read_text().splitlines()) <= 420
    assert len(code_lines(TRAINER)) <= 270
    assert len(FABRIC.read_text().splitlines()) <= 300


def test_the_adapters_hold_no_copy_of_each_other():
    """At most 25 non-trivial code lines are the same in both adapters (imports and hook names, mostly): a step both
    take is written once, in the run."""
    shared = shared_lines(TRAINER, FABRIC)
    assert len(shared) <= 25, sorted(shared)
