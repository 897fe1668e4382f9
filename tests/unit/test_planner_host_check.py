"""`lightning-fpdt plan` and the host it runs on: a plan for this machine checks this host's memory by default; a plan
for another machine (another GPU count or card) says, in its recommendation, that the host was not checked and how
much host memory per host it needs."""

from __future__ import annotations

import pytest

from lightning_fpdt.planner import commands, plan_memory
from lightning_fpdt.planner.components import GIB
from lightning_fpdt.planner.request import Machine

# Llama-3-8B at 1M tokens on 4 GPUs: fits 80 GB GPUs, needs about 928 GiB of host memory per host (916 pinned)
ARGV = ["--model", "llama3-8b", "--seq-len", "1048576", "--gpus", "4"]


def _machine(monkeypatch, *, gpus: int, card: str = "NVIDIA H200", host_gib: float = 500.0) -> list[dict]:
    """This machine as the command sees it: ``gpus`` CUDA devices of ``card``, ``host_gib`` of host memory a plan may
    fill (what ``machine_limits`` reads); returns the calls of ``machine_limits``."""
    calls: list[dict] = []
    monkeypatch.setattr(commands.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(commands.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(commands.torch.cuda, "get_device_name", lambda device=None: card)
    monkeypatch.setattr(commands, "cached_rates", lambda card, group_size: None)  # the built-in table

    def limits(**keywords):
        calls.append(keywords)
        return Machine(num_gpus=keywords["num_gpus"], gpus_per_node=keywords["gpus_per_node"], host_memory_gib=host_gib)

    monkeypatch.setattr(commands, "machine_limits", limits)
    return calls


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def test_a_plan_for_this_machine_checks_its_host_by_default(monkeypatch, capsys):
    """Without --host-memory-gib, a plan of this machine's GPUs is made against this host's memory (as machine_limits
    reads it): "auto" then fits a 500 GiB host instead of taking 928 GiB of it; a 50 GiB host nothing fits, and the
    command says the host binds (exit 1)."""
    calls = _machine(monkeypatch, gpus=4)
    assert commands.main(ARGV) == 0
    out = capsys.readouterr().out
    assert calls == [dict(num_gpus=4, gpus_per_node=4)]
    resident = _line(out, "  host memory per host, all resident").split()
    assert resident[-3:] == ["of", "500.0", "GiB"] and float(resident[-4]) <= 500
    assert "not checked" not in _line(out, "recommendation:")
    _machine(monkeypatch, gpus=8, host_gib=50)
    assert commands.main(ARGV) == 1
    assert "binding limit: host memory" in capsys.readouterr().out


@pytest.mark.parametrize("gpus, argv, why", [
    (0, ARGV, "it has no CUDA device"),
    (2, ARGV, "4 GPUs per host planned, it has 2"),
    (4, ARGV + ["--card", "NVIDIA H100 80GB HBM3"], "NVIDIA H100 80GB HBM3 named, it has NVIDIA H200"),
])
def test_a_plan_for_another_machine_says_the_host_was_not_checked(monkeypatch, capsys, gpus, argv, why):
    """A plan that is not for this machine (no GPU here, fewer GPUs, another card named) is not checked against this
    host; its recommendation says so, why, and the host memory per host it needs."""
    calls = _machine(monkeypatch, gpus=gpus)
    assert commands.main(argv) == 0
    recommendation = _line(capsys.readouterr().out, "recommendation:")
    plan = plan_memory(geometry="llama3-8b", seq_len=1048576, num_gpus=4, activation_offload=True, tiled_mlp=True,
                       tiled_loss=True)
    assert calls == []
    assert recommendation.startswith("recommendation: the options as given fit the GPU memory")
    assert (f"the host's memory was not checked: it needs {plan.host_resident_bytes_per_node / GIB:.2f} GiB per host, "
            f"{plan.host_bytes_per_node / GIB:.2f} GiB of it pinned") in recommendation
    assert f"the plan is not for this machine: {why}; pass --host-memory-gib N" in recommendation


def test_plan_memory_without_a_host_says_what_the_host_needs():
    """plan_memory given no host memory says in its recommendation that the host was not checked and what it needs;
    given one, it says nothing of the kind."""
    keywords = dict(geometry="llama3-8b", seq_len=1048576, num_gpus=4, activation_offload=True, tiled_mlp=True,
                    tiled_loss=True)
    unchecked = plan_memory(**keywords)
    assert unchecked.fits and "the host's memory was not checked: it needs 928.00 GiB per host" in \
        unchecked.recommendation
    assert "not checked" not in plan_memory(**keywords, host_memory_gib=2000).recommendation
