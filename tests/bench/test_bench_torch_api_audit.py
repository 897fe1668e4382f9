"""bench.peers.torch_api_audit: the torch names a source refers to, which of them this torch lacks, and where."""

from __future__ import annotations

import textwrap

from bench.peers import torch_api_audit as api

SOURCE = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard, NoSuchMeshDims
    from torch.nn import functional

    LAYER = torch.nn.Linear


    def lower_timeouts(group):
        dist.no_such_set_timeout(1, group)
        return torch.distributed.get_rank(group), functional.no_such_kernel


    lazy = lambda: torch.no_such_namespace.thing
""")


def test_references_scope_and_aliases():
    refs = {(r.name, r.line, r.scope) for r in api.torch_references(SOURCE, "peer.py")}
    assert ("torch.distributed.fsdp.NoSuchMeshDims", 4, "import") in refs
    assert ("torch.nn.Linear", 7, "import") in refs
    assert ("torch.distributed.no_such_set_timeout", 11, "call") in refs  # through `import ... as dist`
    assert ("torch.nn.functional.no_such_kernel", 12, "call") in refs  # through `from torch.nn import functional`
    assert ("torch.no_such_namespace.thing", 15, "call") in refs  # a lambda's body runs when called
    assert ("torch.distributed", 3, "import") in refs  # the import statement itself
    names = [r.name for r in api.torch_references(SOURCE)]
    assert "torch.no_such_namespace" not in names and "torch.distributed.get_rank" in names  # the longest chain only


def test_resolves():
    assert api.resolves("torch.nn.Linear")
    assert api.resolves("torch.distributed.fsdp.fully_shard")  # a submodule not imported by `import torch`
    assert not api.resolves("torch.distributed.no_such_set_timeout")
    assert not api.resolves("torch.no_such_namespace.thing")


def test_audit_and_main(tmp_path, capsys):
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "train.py").write_text(SOURCE)
    (peer / "experiments").mkdir()
    (peer / "experiments" / "other.py").write_text("import torch\nX = torch.no_such_in_experiments\n")
    missing = api.audit([str(peer)], exclude=("experiments",))
    assert {r.name for r in missing} == {
        "torch.distributed.fsdp.NoSuchMeshDims", "torch.distributed.no_such_set_timeout",
        "torch.nn.functional.no_such_kernel", "torch.no_such_namespace.thing",
    }
    assert api.main([str(peer), "--exclude", "experiments", "--relative-to", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISSING torch.distributed.fsdp.NoSuchMeshDims peer/train.py:4 (import)" in out
    assert "4 name(s) missing, 1 at import: torch.distributed.fsdp.NoSuchMeshDims" in out
    (peer / "train.py").write_text("import torch\nLAYER = torch.nn.Linear\n")
    assert api.main([str(peer), "--exclude", "experiments"]) == 0
