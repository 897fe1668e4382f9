"""What the Ulysses × ring hybrid does not compose with (yet), each rule stated once (docs/ring.md, "Limits").

A rule names an option, the one value it takes with a ring (``R > 1``), and the message that refuses any other.
Everything that checks or explains a rule imports it from here: the options (``FPDTOptions``, the planner's
``PlanOptions``), the layout (``SequenceLayout``), the sizes (head groups), the attention's dispatch (packed
documents), the head-grouped attention, the planner's search (it offers only the value a ring takes) and the
strategy's ``"auto"`` resolution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class RingRule:
    option: str
    """The option (or call argument) the rule is about."""
    with_ring: Any
    """The only value it takes with a ring; ``"auto"`` resolves to it."""
    message: str
    """The refusal: ``{value}`` is the value given, ``{ring_size}`` the ring's size; it names the fix."""

    def refuses(self, value: Any) -> bool:
        return not (isinstance(value, str) and value == "auto") and value != self.with_ring


RING_RULES: dict[str, RingRule] = {rule.option: rule for rule in (
    RingRule("chunks", 1,
             "chunks={value} with ring_size={ring_size}: FPDT chunks are not composed with the ring yet (a ring rank "
             "attends its whole share at once); use chunks=1 (or 'auto') with a ring, that is: use chunks=1 with "
             "ring_size > 1, or ring_size=1"),
    RingRule("offload_dq", False,
             "offload_dq={value} with ring_size={ring_size}: the ring has no partial dQ sums across chunks to offload "
             "(its dQ is one share, on the device); use offload_dq='auto' or False with a ring"),
    RingRule("head_chunks", 1,
             "head_chunks ({value}) is not composed with a ring (ring_size {ring_size}) yet: set head_chunks=1, or a "
             "sequence_parallel_size the head groups allow without a ring"),
    RingRule("documents", None,
             "packed documents are not supported with ring_size > 1 yet (ring_size={ring_size}): use ring_size=1"),
)}
"""The rules, by option."""


def ring_refusal(ring_size: int, **values: Any) -> Optional[str]:
    """The message of the first rule ``values`` (option -> value) break with a ring of ``ring_size``; ``None``: they
    compose (always, without a ring)."""
    if ring_size <= 1:
        return None
    for option, value in values.items():
        rule = RING_RULES[option]
        if rule.refuses(value):
            return rule.message.format(value=value, ring_size=ring_size)
    return None


def check_ring(ring_size: int, **values: Any) -> None:
    """``ValueError`` with the rule's message when ``values`` do not compose with a ring of ``ring_size``."""
    refusal = ring_refusal(ring_size, **values)
    if refusal is not None:
        raise ValueError(refusal)


def ring_choices(option: str, ring_size: int, choices: tuple[Any, ...]) -> tuple[Any, ...]:
    """The values of ``option`` a search may try: ``choices`` without a ring, the one value a ring takes with one."""
    return (RING_RULES[option].with_ring,) if ring_size > 1 else choices
