"""A plan's sequence-parallel layout in words, and why it is that one: the data-parallel groups, the Ulysses and ring
sizes, the query heads each rank attends for, and for a group spanning hosts the step-time estimate of the layouts the
search compared (``lightning-fpdt plan`` prints it; docs/multi_node.md)."""

from __future__ import annotations

from typing import Optional

from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.sequence.sizes import ring_sizes


def heads_a_rank(num_heads: int, num_kv_heads: int, ranks: int) -> str:
    """``"4"`` or, split unevenly, ``"4 or 3"``: the query heads one of ``ranks`` Ulysses ranks attends for."""
    split = HeadSplit(num_heads=num_heads, num_kv_heads=num_kv_heads, sp_size=ranks)
    counts = sorted({stop - start for start, stop in split.q_ranges}, reverse=True)
    return " or ".join(str(count) for count in counts)


def layout_name(sequence_parallel_size: int, ring_size: int) -> str:
    """``"Ulysses 16"`` or ``"ring 2 x Ulysses 8"``."""
    ulysses = sequence_parallel_size // ring_size
    return f"Ulysses {ulysses}" if ring_size == 1 else f"ring {ring_size} x Ulysses {ulysses}"


def describe_layout(plan: MemoryPlan) -> str:
    """``layout: data parallel 1, Ulysses 8, ring 1, 4 or 3 query heads a rank (...why...)``."""
    o, g = plan.options, plan.geometry
    P, R, G = o.sequence_parallel_size, o.ring_size, o.head_chunks
    U = P // R
    heads = heads_a_rank(g.num_heads // G, g.num_kv_heads // G, U)
    per_rank = (f"{heads} query head{'' if heads == '1' else 's'} a rank"
                + (f" in each of {G} head groups" if G > 1 else ""))
    return (f"layout: data parallel {o.data_parallel_size}, Ulysses {U}, ring {R}, {per_rank} "
            f"({_why(plan, heads)})")


def _why(plan: MemoryPlan, heads: str) -> str:
    o, g = plan.options, plan.geometry
    P, R = o.sequence_parallel_size, o.ring_size
    U, hosts, inside = P // R, plan.num_gpus // plan.gpus_per_node, plan.gpus_per_node
    split = f"{g.num_heads} query heads over {U} GPUs: {heads} a rank"
    if P <= inside:
        where = "one host" if hosts == 1 else "each sequence inside one host"
        if R == 1:
            return f"{split}; {where}, so no ring"
        more = f"{P} GPUs for {g.num_heads} query heads, so a ring of {R}; " if P > g.num_heads else ""
        return f"{split}; {more}the ring's K/V passes stay inside the host"
    seconds = dict(plan.layouts)
    mine: Optional[float] = seconds.get(R)
    if mine is None:
        allowed = ring_sizes(P, (g.num_heads, g.num_kv_heads))
        if allowed == [R]:
            return f"{split}; the only layout the heads allow on {P} GPUs"
        return (f"{split}; layouts not compared (ring_size given: --ring-size auto compares "
                f"{', '.join(layout_name(P, r) for r in allowed)})")
    if R == 1:
        how = f"its all-to-alls cross the network ({U - inside} of a rank's {U - 1} peers on other hosts)"
    elif U <= inside and inside % U == 0:
        how = "the Ulysses all-to-alls stay inside a host, only the ring's K/V crosses the network"
    else:
        how = "a share of the Ulysses all-to-alls and the ring's K/V cross the network"
    others = [(ring, s) for ring, s in seconds.items() if ring != R]
    versus = next((item for item in others if item[0] == 1), None) if R > 1 else None
    if versus is None or versus[1] is None:
        fitting = [(ring, s) for ring, s in others if s is not None]
        versus = min(fitting, key=lambda item: item[1]) if fitting else versus
    unfit = [layout_name(P, ring) for ring, s in others if s is None]
    if versus is None or versus[1] is None:
        against = "; no other layout fits"
    else:
        against = (f" against {versus[1]:,.1f} s for {layout_name(P, versus[0])}"
                   + (f" ({', '.join(unfit)} does not fit)" if unfit else ""))
    return f"{layout_name(P, R)} over {hosts} hosts: {how}; estimated {mine:,.1f} s/step{against}"
