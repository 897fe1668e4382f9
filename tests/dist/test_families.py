"""Every Hugging Face family of tests/families.py trained under Trainer(strategy="fpdt") on gloo processes against one
process: chunks 2, GQA, the memory callbacks, a router's load-balancing loss where the family has one."""

from __future__ import annotations

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.callbacks.tiled_loss import TiledLoss
from lightning_fpdt.callbacks.tiled_mlp import TiledMLP
from lightning_fpdt.memory.forwards import REPLACED_FORWARD, replaced_forwards
from tests.dist import test_strategy_parity as parity
from tests.families import MINI_MODELS, MOE_WITHOUT_ROUTER_LOSS

# Tolerance: test_strategy_parity.TOL (fp32, rtol 1e-4 / atol 2e-5), as the HF Llama end-to-end test with the memory
# callbacks uses: the parallel run sums the same products in another order (blockwise softmax, tiles, gradients split
# over ranks, the router statistics all-reduced), ~1e-7 relative per op, ~1e-6 on the parameters after 3 SGD steps;
# a wrong norm formula, a local router loss or a lost token moves the loss or a parameter by > 1e-3.


def _case(kind: str, sp: int, memory_callbacks: bool, seq_len: int = 16, dp: int = 1, **options) -> dict:
    return dict(kind=kind, dp=dp, sp=sp, chunks=2, accumulate=1, seq_len=seq_len, memory_callbacks=memory_callbacks,
                **options)


def family_cases(world: int) -> list[dict]:
    """Every family at P = 2; at 4 processes the subset marked ``four_processes`` at P = 4 (kv heads replicated)."""
    if world == 2:
        cases = [_case(f"family:{t}", 2, m.memory_callbacks, **m.extra) for t, m in MINI_MODELS.items()]
        cases += [_case(f"family:{t}:no-router-loss", 2, m.memory_callbacks) for t, m in MOE_WITHOUT_ROUTER_LOSS.items()]
        cases.append(_case("family:mixtral", 2, False, seq_len=15))  # padded: the router loss leaves the padding out
        return cases
    return [_case(f"family:{t}", 4, m.memory_callbacks) for t, m in MINI_MODELS.items() if m.four_processes]


def run_families(cases: list[dict]) -> None:
    for case in cases:
        memory = case.pop("memory_callbacks")
        callbacks = [ActivationOffload(), TiledMLP(num_tiles=3)] if memory else []
        if case["kind"] != "plain":  # a plain module computes its loss itself
            callbacks.append(TiledLoss(num_tiles=3))
        trainer = parity.train_and_compare(**case, callbacks=callbacks)
        check_replaced_forwards(trainer.lightning_module)


def check_replaced_forwards(module) -> None:
    """Every forward replaced on a module of the prepared model came through replace_forward and keeps __wrapped__."""
    replaced = replaced_forwards(module)
    assert replaced, "the prepared model has no replaced forward"
    for name, forward in replaced.items():
        assert getattr(forward, REPLACED_FORWARD, False), f"{name}.forward was not replaced by replace_forward"
        assert callable(getattr(forward, "__wrapped__", None)), f"{name}.forward keeps no __wrapped__"


def test_families_two_processes(dist_pool):
    """Each family at 1×2, chunks 2, equals one process (memory callbacks, head groups for Llama, router losses)."""
    dist_pool(2).run(run_families, cases=family_cases(2))


def test_families_four_processes(dist_pool):
    """Qwen3-MoE, Phi-3 and Gemma at 1×4 (kv heads replicated), chunks 2, equal one process."""
    dist_pool(4).run(run_families, cases=family_cases(4))


def test_every_replaced_forward_came_through_the_helper(dist_pool):
    """The SDPA interception, checkpointed blocks and tiled MLPs of a plain module come through replace_forward (the
    families' cases check the RMSNorms, head groups, tiled loss, output head and router loss forwards alike)."""
    dist_pool(2).run(run_families, cases=[_case("plain", 2, True)])
