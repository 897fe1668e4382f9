"""Sequence-parallel groups and hosts: a group that spans hosts is detected and the warning names a faster layout."""

import pytest

from lightning_fpdt.strategy.topology import (
    hosts_per_sequence_group,
    sequence_group_layout_warning,
    warn_if_sequence_groups_span_hosts,
)


@pytest.mark.parametrize(("sp", "devices_per_node", "hosts"), [
    (8, 8, 1), (4, 8, 1), (1, 8, 1),  # sp divides the host: every group inside one host
    (16, 8, 2), (32, 8, 4),           # larger than a host
    (3, 8, 2), (6, 4, 2), (4, 6, 2),  # not dividing it: some group straddles a host boundary
    (2, 1, 2),                        # one device per host (the simulated two-host test)
])
def test_hosts_per_group(sp, devices_per_node, hosts):
    """Groups are consecutive ranks and hosts hold consecutive ranks: a group stays inside one host iff sp | d."""
    assert hosts_per_sequence_group(sp, devices_per_node) == hosts
    if devices_per_node % sp == 0:  # cross-check against the rank lists themselves
        groups = [range(g * sp, g * sp + sp) for g in range(4 * devices_per_node // sp)]
        assert all(len({rank // devices_per_node for rank in group}) == 1 for group in groups)


def test_warning_names_the_faster_layout():
    """sp 16 on 8-GPU hosts: warn, proposing sp 8 × dp 2; sp 8 on the same hosts: no warning."""
    message = sequence_group_layout_warning(sequence_parallel_size=16, devices_per_node=8, world_size=16)
    assert message is not None
    assert "sequence_parallel_size (16) with 8 devices per node puts a sequence-parallel group on 2 hosts" in message
    assert "Faster: sequence_parallel_size=8, data_parallel_size=2" in message
    assert sequence_group_layout_warning(sequence_parallel_size=8, devices_per_node=8, world_size=16) is None
    odd = sequence_group_layout_warning(sequence_parallel_size=6, devices_per_node=4, world_size=24)
    assert "Faster: sequence_parallel_size=4, data_parallel_size=6" in odd


def test_warning_is_emitted():
    """The strategy-facing helper warns (a UserWarning through Lightning's rank_zero_warn) and returns the text."""
    with pytest.warns(UserWarning, match="puts a sequence-parallel group on 2 hosts"):
        assert warn_if_sequence_groups_span_hosts(sequence_parallel_size=2, devices_per_node=1, world_size=2)
    assert warn_if_sequence_groups_span_hosts(sequence_parallel_size=2, devices_per_node=2, world_size=4) is None
    with pytest.raises(ValueError, match=r"sequence_parallel_size \(0\) and devices_per_node \(8\) must be >= 1"):
        hosts_per_sequence_group(0, 8)
