"""File names mean one thing (docs/design.md §2): two modules of the package share a name only where they are the
same thing on different floors (a memory feature's mechanism, its callback and its planner feature; the Llama family
and the reference Llama; a folder's base classes)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fpdt"
SAME_THING = {
    "base.py": "the base classes of their own folder",
    "head_groups.py": "head groups: the integration's wiring and the planner's feature",
    "host_states.py": "optimizer states on the host: the strategy's mechanism and the planner's feature",
    "llama.py": "Llama: the reference model and its family integration",
    "tiled_loss.py": "the tiled loss: mechanism, callback, planner feature",
    "tiled_mlp.py": "the tiled MLP: mechanism, callback, planner feature",
}


def test_no_two_modules_share_a_name_for_different_things():
    folders = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            folders[path.name].append(str(path.relative_to(PACKAGE)))
    shared = {name: sorted(paths) for name, paths in folders.items() if len(paths) > 1 and name not in SAME_THING}
    assert not shared, f"modules sharing a name (rename one, or list the name in SAME_THING with why): {shared}"
