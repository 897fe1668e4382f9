""""auto" that fits both memories: the planner's search, the strategy's choice and refusal, the memory callbacks'
"auto" options, and the plan printed as the arguments a user writes."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from lightning_fpdt import ActivationOffload, FPDTStrategy, TiledLoss, TiledMLP
from lightning_fpdt.planner import format_plan, plan_memory, step_seconds
from lightning_fpdt.planner.arguments import arguments
from lightning_fpdt.planner.search import Run
from lightning_fpdt.strategy import budget, plan_messages

GIB = 2**30
AUTO = dict(chunks="auto", offload="auto", offload_dq="auto", head_chunks="auto", recompute_attention="auto",
            reload_input="auto", prefetch="auto", keep_inputs="auto")
CALLBACKS = dict(activation_offload=True, tiled_mlp=True, tiled_loss=True)


def test_auto_recomputes_the_attention_only_where_nothing_else_fits():
    """Llama-3-8B at 1M tokens on 4 GPUs: with a 500 GiB host only recomputing the attention fits (every layer's
    stash is 4 x 82 GiB), and "auto" resolves so; with a 2 TB host the faster run without the recompute fits and
    "auto" takes it."""
    run = dict(geometry="llama3-8b", seq_len=1 << 20, num_gpus=4, gpu_memory_gib=79, **CALLBACKS, **AUTO)
    tight = plan_memory(**run, host_memory_gib=500)
    assert tight.fits and tight.options.recompute_attention
    assert tight.host_resident_bytes_per_node <= 500 * GIB and tight.peak_gpu_bytes <= 79 * GIB
    roomy = plan_memory(**run, host_memory_gib=2000)
    assert roomy.fits and not roomy.options.recompute_attention
    sizes = Run(roomy.geometry, roomy.model, roomy.seq_len, 1, 4, 4, 79 * GIB, 2000 * GIB)
    assert step_seconds(sizes.sizes(roomy.options)) < step_seconds(sizes.sizes(tight.options))


def test_one_gpu_8b_at_1m_fits_with_states_on_the_host():
    """Llama-3-8B at 1,048,576 tokens on one 80 GB GPU and a 500 GiB host: the options as given (states on the GPU)
    fit nothing; the recommendation moves the states to the host, and "auto" finds the rest (attention recomputed,
    the block inputs left on the host): a plan within both memories, printed as arguments."""
    plan = plan_memory(geometry="llama3-8b", seq_len=1 << 20, num_gpus=1, gpu_memory_gib=80, host_memory_gib=500,
                       **CALLBACKS, **AUTO)
    assert not plan.fits and plan.recommendation.startswith("set cpu_offload_params=True")
    chosen = plan.recommended
    assert chosen.fits and chosen.options.cpu_offload_params and chosen.options.recompute_attention
    assert chosen.peak_gpu_bytes <= 80 * GIB and chosen.host_resident_bytes_per_node <= 500 * GIB
    assert "reload_input=True" in plan.recommendation


def test_nothing_fits_is_refused_naming_host_memory():
    """A host that holds not even the block inputs of every layer (32 x 8 GiB at 1M tokens on one GPU): nothing
    fits, the plan says so naming the host, and the strategy's refusal names the host, the plan and the way out."""
    plan = plan_memory(geometry="llama3-8b", seq_len=1 << 20, num_gpus=1, gpu_memory_gib=80, host_memory_gib=120,
                       cpu_offload_params=True, **CALLBACKS, **AUTO)
    assert not plan.fits and plan.binding_limit == "host memory" and plan.recommended is None
    assert plan.recommendation.startswith("nothing fits the host")
    refusal = plan_messages.refusal(plan)
    assert isinstance(refusal, ValueError)
    assert "does not fit the host memory" in str(refusal) and "nothing fits the host" in str(refusal)


def test_explicit_options_that_cannot_fit_name_the_change(monkeypatch):
    """The strategy refuses, at a new length, explicit options whose plan does not fit, naming the change that fits
    as arguments; with check_memory=False it warns and runs on that plan."""
    plan = plan_memory(geometry="llama3-8b", seq_len=1 << 20, num_gpus=4, gpu_memory_gib=79, host_memory_gib=500,
                       chunks=16, offload=True, offload_dq=False, head_chunks=1, recompute_attention=False,
                       **CALLBACKS)
    assert not plan.fits and plan.recommended is not None
    monkeypatch.setattr(budget, "plan_for", lambda strategy, seq_len, batch_size: plan)
    strategy = FPDTStrategy()
    with pytest.raises(ValueError, match=r"(?s)does not fit the host memory: S = 1,048,576 tokens needs .* Fix: set "
                                         r"recompute_attention=True.*callbacks=\[ActivationOffload\("):
        strategy.check_memory_plan(1 << 20, 1)
    lenient = FPDTStrategy(check_memory=False)
    with pytest.warns(UserWarning, match="does not fit as planned"):
        lenient.check_memory_plan(1 << 20, 1)
    assert lenient.memory_plan is plan


def test_the_choice_reads_as_arguments_and_yaml():
    """The chosen plan prints as FPDTStrategy(...) and the callbacks, and as YAML that a LightningCLI config takes:
    the same options, read back."""
    plan = plan_memory(geometry="llama3-8b", seq_len=1 << 20, num_gpus=4, gpu_memory_gib=79, host_memory_gib=500,
                       **CALLBACKS, **AUTO)
    text = format_plan(plan)
    assert "as arguments:" in text and "as YAML:" in text
    chosen = arguments(plan)
    o = plan.options
    assert chosen["FPDTStrategy"] == {"sequence_parallel_size": 4, "offload": o.offload, "offload_dq": o.offload_dq,
                                      "chunks": o.chunks, "head_chunks": o.head_chunks}
    assert chosen["ActivationOffload"] == {"reload_input": o.reload_input, "prefetch": o.prefetch,
                                           "keep_inputs": o.keep_inputs,
                                           "checkpoint_blocks": o.checkpoint_blocks,
                                           "recompute_attention": o.recompute_attention}
    config = yaml.safe_load(textwrap.dedent(text.split("as YAML:\n", 1)[1].rsplit("\n(a model", 1)[0]))
    assert config["trainer"]["strategy"]["init_args"] == chosen["FPDTStrategy"]
    callbacks = {c["class_path"]: c.get("init_args", {}) for c in config["trainer"]["callbacks"]}
    assert callbacks == {"ActivationOffload": chosen["ActivationOffload"], "TiledMLP": {}, "TiledLoss": {}}
    # the same arguments build the run
    FPDTStrategy(**{k: v for k, v in chosen["FPDTStrategy"].items()})
    ActivationOffload(**chosen["ActivationOffload"]), TiledMLP(), TiledLoss()


def test_activation_offload_takes_the_strategys_choice_for_auto_only():
    """ActivationOffload's "auto" options take what the strategy chose for the length; an explicit value stays; with
    no choice (another strategy, no GPU) "auto" is what costs nothing."""
    auto = ActivationOffload()
    assert [auto.resolved(n) for n in ("recompute_attention", "reload_input", "prefetch")] == [False, False, 1]
    auto.apply_memory_choice(recompute_attention=True, reload_input=True, prefetch=0)
    assert [auto.resolved(n) for n in ("recompute_attention", "reload_input", "prefetch")] == [True, True, 0]
    fixed = ActivationOffload(recompute_attention=False, prefetch=2)
    fixed.apply_memory_choice(recompute_attention=True, reload_input=True, prefetch=0)
    assert [fixed.resolved(n) for n in ("recompute_attention", "reload_input", "prefetch")] == [False, True, 2]
    # keep_inputs: every input where nothing chose, the choice for "auto", an explicit count stays
    assert ActivationOffload().resolved("keep_inputs") == "all"
    auto.apply_memory_choice(recompute_attention=False, reload_input=False, prefetch=1, keep_inputs=7)
    assert auto.resolved("keep_inputs") == 7
    pinned = ActivationOffload(keep_inputs=3)
    pinned.apply_memory_choice(recompute_attention=False, reload_input=False, prefetch=1, keep_inputs=7)
    assert pinned.resolved("keep_inputs") == 3


def test_host_states_are_pinned_exactly_and_the_rest_pageable():
    """With the states on the host the fp32 master weights are page-locked (exactly), the gradients and AdamW's
    moments pageable; the process baseline is pageable too; the host total is all of it."""
    plan = plan_memory(geometry="llama3-3b", seq_len=131072, num_gpus=1, chunks=2, offload=True, offload_dq=False,
                       cpu_offload_params=True, host_baseline_gib=2.5, **CALLBACKS)
    params = 3_212_749_824
    assert plan.component("parameters").host_bytes == 4 * params
    assert plan.component("gradients").pageable_bytes == 4 * params
    assert plan.component("optimizer states").pageable_bytes == 8 * params
    assert plan.component("process baseline").pageable_bytes == int(2.5 * GIB)
    assert plan.host_resident_bytes_per_node == sum(c.host_bytes + c.pageable_bytes for c in plan.components)
    assert plan.host_bytes_per_node == sum(c.host_bytes for c in plan.components)


def test_the_strategy_hands_activation_offload_its_kept_inputs(monkeypatch):
    """The plan of a length hands ActivationOffload the block inputs to keep ("auto" takes them; 0 is "all")."""
    from types import SimpleNamespace

    callback = ActivationOffload()
    module = SimpleNamespace(trainer=SimpleNamespace(callbacks=[callback]))
    monkeypatch.setattr(FPDTStrategy, "lightning_module", property(lambda self: module))
    for keep, expected in ((7, 7), ("all", "all")):
        plan = plan_memory(geometry="llama3-3b", seq_len=131072, num_gpus=1, chunks=2, offload=True,
                           offload_dq=False, gpu_memory_gib=139, keep_inputs=keep, **CALLBACKS)
        monkeypatch.setattr(budget, "plan_for", lambda strategy, seq_len, batch_size, plan=plan: plan)
        FPDTStrategy().check_memory_plan(131072, 1)
        assert callback.resolved("keep_inputs") == expected


def test_the_strategy_syncs_accumulation_batches_as_the_plan_of_the_length_says(monkeypatch):
    """sync_every_batch="auto" follows the plan of the batch's length (the shards where the unsharded gradients do not
    fit, one reduce-scatter a window where they do), and is off where nothing planned the length; True and False hold
    whatever the plan says."""
    from types import SimpleNamespace

    module = SimpleNamespace(trainer=SimpleNamespace(callbacks=[], accumulate_grad_batches=4))
    monkeypatch.setattr(FPDTStrategy, "lightning_module", property(lambda self: module))
    run = dict(geometry="llama3-8b", seq_len=262144, num_gpus=8, gpu_memory_gib=40, accumulate_grad_batches=4,
               **CALLBACKS)
    tight, roomy = plan_memory(**run), plan_memory(**{**run, "gpu_memory_gib": 139})
    assert tight.options.sync_every_batch and not roomy.options.sync_every_batch
    for option, plan, expected in (("auto", tight, True), ("auto", roomy, False), (False, tight, False),
                                   (True, roomy, True)):
        monkeypatch.setattr(budget, "plan_for", lambda strategy, seq_len, batch_size, plan=plan: plan)
        strategy = FPDTStrategy(sync_every_batch=option)
        strategy.batch_plan = SimpleNamespace(seq_len=262144, batch_size=1)
        strategy.check_memory_plan(262144, 1)
        assert strategy.syncs_every_batch() is expected, (option, plan.options.describe())
    strategy = FPDTStrategy()
    strategy.batch_plan = SimpleNamespace(seq_len=4096, batch_size=1)  # a length nothing planned
    assert strategy.syncs_every_batch() is False


def test_a_length_planned_before_runs_on_its_own_plan_again(monkeypatch):
    """Back at a length planned before (after an evaluation at another length), ActivationOffload takes that
    length's choice again, not the last planned length's."""
    from types import SimpleNamespace

    callback = ActivationOffload()
    module = SimpleNamespace(trainer=SimpleNamespace(callbacks=[callback]))
    monkeypatch.setattr(FPDTStrategy, "lightning_module", property(lambda self: module))
    plans = {seq_len: plan_memory(geometry="llama3-3b", seq_len=seq_len, num_gpus=1, chunks=2, offload=True,
                                  offload_dq=False, gpu_memory_gib=139, keep_inputs=keep, **CALLBACKS)
             for seq_len, keep in ((131072, 7), (32768, "all"))}
    monkeypatch.setattr(budget, "plan_for", lambda strategy, seq_len, batch_size: plans[seq_len])
    strategy = FPDTStrategy()
    for seq_len, expected in ((131072, 7), (32768, "all"), (131072, 7), (131072, 7), (32768, "all")):
        if strategy.memory.planned(seq_len, 1):
            strategy.memory.return_to(seq_len, 1)
        else:
            strategy.check_memory_plan(seq_len, 1)
        assert callback.resolved("keep_inputs") == expected and strategy.memory_plan is plans[seq_len]
