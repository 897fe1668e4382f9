"""The plain-PyTorch layers import where Lightning is not installed; the strategy registers where Lightning is
imported (HOUSE.md, "The Lightning boundary")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HIDE_LIGHTNING = textwrap.dedent("""
    import sys

    class NoLightning:
        # a meta-path finder consulted first: Lightning looks uninstalled to every import in this process
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("lightning", "pytorch_lightning"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoLightning())
""")


def run_without_lightning(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_LIGHTNING + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_plain_layers_import_without_lightning():
    """``lightning_fpdt.sequence``, ``.memory`` and ``.planner`` import, and plan, with Lightning hidden."""
    result = run_without_lightning("""
        import lightning_fpdt.memory
        import lightning_fpdt.planner
        import lightning_fpdt.sequence
        from lightning_fpdt.sequence import SequenceLayout

        assert not lightning_fpdt.LIGHTNING_AVAILABLE
        assert SequenceLayout(2, 0, 1).local_length(8) == 4
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
        assert not loaded, loaded
        print("imported")
    """)
    assert result.returncode == 0, result.stderr
    assert "imported" in result.stdout


def test_lightning_names_say_what_is_missing_without_lightning():
    """Without Lightning, a name that needs it raises ``ModuleNotFoundError`` naming Lightning, not a bare
    ``AttributeError``."""
    result = run_without_lightning("""
        import lightning_fpdt
        try:
            lightning_fpdt.FPDTStrategy
        except ModuleNotFoundError as error:
            assert error.name == "lightning" and "pip install lightning" in str(error), error
            print("named")
    """)
    assert result.returncode == 0, result.stderr
    assert "named" in result.stdout


def test_import_registers_the_strategy():
    """With Lightning installed, ``import lightning_fpdt`` registers ``"fpdt"`` in Lightning's strategy registry."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from lightning.pytorch.strategies import StrategyRegistry
        assert "fpdt" not in StrategyRegistry
        import lightning_fpdt
        from lightning_fpdt.strategy import FPDTStrategy
        assert StrategyRegistry["fpdt"]["strategy"] is FPDTStrategy
        print("registered")
    """)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "registered" in result.stdout
