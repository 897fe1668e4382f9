"""Host stash, offloaded attention, and no attention recompute under ActivationOffload (docs/design.md §4, §6)."""

import copy

import pytest
import torch
import torch.utils.checkpoint

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.integrations import SequenceParallelContext, install_reference_llama
from lightning_fpdt.memory import find_blocks
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.offload.host_stash import HostBufferPool, HostStash, StashFactory
from lightning_fpdt.sequence import FPDTAttention, fpdt_attention


def test_host_stash_life_cycle_and_misuse():
    """put/prefetch/get/release/free on the host stash; misuse raises RuntimeError naming the key and the verb."""
    stash = HostStash(torch.device("cpu"), HostBufferPool(pin_memory=False), streams=None)
    t = torch.randn(2, 3)
    original = t.clone()
    stash.put("a", t)
    t.add_(1.0)  # the stash holds its own copy
    stash.prefetch("a")
    got = stash.get("a")
    assert torch.equal(got, original) and stash.resident_bytes == 24 and stash.nbytes == 24
    stash.release("a")
    assert stash.resident_bytes == 0
    with pytest.raises(RuntimeError, match="put of 'a', which is already stashed"):
        stash.put("a", t)
    stash.free("a")
    for verb in ("get", "prefetch", "release", "free"):
        with pytest.raises(RuntimeError, match=f"{verb} of 'a', which was never put or was already freed"):
            getattr(stash, verb)("a")


def test_pool_buffers_are_reused_across_calls():
    """Host buffers are allocated once: a second attention call of the same shape allocates nothing more."""
    stashes = StashFactory(offload=True, offload_dq=True)
    q = torch.randn(1, 16, 2, 4, requires_grad=True)
    for _ in range(2):
        fpdt_attention(q, q, q, num_chunks=4, stashes=stashes).sum().backward()
        if _ == 0:
            allocated = stashes.host_bytes
    assert allocated > 0 and stashes.host_bytes == allocated


@pytest.mark.parametrize("offload_dq", [False, True])
def test_offloaded_attention_equals_in_place(offload_dq):
    """Offloading chunks (and partial dQ) to host memory changes no output or gradient bit."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 24, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    g = torch.randn(2, 24, 4, 8, generator=gen)
    results = []
    for stashes in (StashFactory(), StashFactory(offload=True, offload_dq=offload_dq)):
        out = fpdt_attention(q, k, v, num_chunks=3, stashes=stashes)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _models(num_layers: int = 3):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny", num_layers=num_layers)).double()
    return model, copy.deepcopy(model)


def _train_steps(model, steps: int = 2):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    for _ in range(steps):
        model(input_ids=ids, labels=targets).backward()


@pytest.mark.parametrize("offload", [False, True])
def test_activation_offload_runs_attention_once_per_layer(offload):
    """Checkpointed blocks recompute everything but attention: kernel calls per step = layers; gradients exact."""
    plain, checkpointed = _models()
    attentions = []
    for model, wrap in ((plain, False), (checkpointed, True)):
        attention = FPDTAttention(num_chunks=2, backend="math", offload=offload)
        install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
        if wrap:
            callback = ActivationOffload(offload=offload)
            callback.fpdt_transform(model, find_blocks(model))
            callback.fpdt_transform(model, find_blocks(model))  # idempotent: wraps once
        _train_steps(model)
        attentions.append(attention)
    assert attentions[0].kernel_calls == attentions[1].kernel_calls == 3 * 2  # 3 layers, 2 steps
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)  # fp64, same arithmetic
    assert (callback.host_bytes > 0) == offload


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("head_chunks, recompute", [(1, False), (1, True), (2, True)])
def test_reload_input_gives_the_same_gradients(prefetch, head_chunks, recompute):
    """reload_input: a block's input leaves the GPU after the recompute (what was saved from it points at the host
    copy) and comes back for its first norm's backward; the gradients of every parameter and of the embedding are
    those of the uncheckpointed model, with and without the one-ahead prefetch, head groups and attention recompute.
    The input's host buffers all go back to the pool by the end of each step."""
    plain, model = _models()
    for m in (plain, model):
        attention = FPDTAttention(num_chunks=2, backend="math", offload=True, head_chunks=head_chunks)
        install_reference_llama(m, SequenceParallelContext(group=None, attention=attention))
    callback = ActivationOffload(prefetch=prefetch, recompute_attention=recompute, reload_input=True)
    callback.fpdt_transform(model, find_blocks(model))
    _train_steps(plain)
    _train_steps(model)
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)  # fp64, the same arithmetic
    assert len(callback._owner._stash) == 0  # every block input freed by its backward


def test_reload_input_in_a_block_it_does_not_know():
    """reload_input in a block class outside the Llama families (its input may be read after the MLP starts): the
    input's device copy is kept to the end of the recompute, and the gradients are exact."""
    from lightning_fpdt.models.llama import LlamaDecoderLayer

    class PostNormLayer(LlamaDecoderLayer):
        pass

    plain, model = _models()
    for layer in model.model.layers:
        layer.__class__ = PostNormLayer
    for m in (plain, model):
        install_reference_llama(m, SequenceParallelContext(group=None, attention=FPDTAttention(num_chunks=2,
                                                                                               backend="math")))
    ActivationOffload(prefetch=0, reload_input=True).fpdt_transform(model, find_blocks(model))
    _train_steps(plain)
    _train_steps(model)
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)  # fp64, the same arithmetic


def test_plain_checkpointing_would_recompute_attention():
    """Contrast: torch's own checkpoint around each block runs the attention twice per layer and step."""
    model, _ = _models()
    attention = FPDTAttention(num_chunks=2, backend="math")
    install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
    for block in model.model.layers:
        forward = block.forward
        block.forward = lambda *a, __f=forward, **k: torch.utils.checkpoint.checkpoint(__f, *a, use_reentrant=False,
                                                                                      **k)
    _train_steps(model)
    assert attention.kernel_calls == 2 * 3 * 2


def test_recompute_attention_holds_one_layer_stash():
    """recompute_attention=True: the attention runs again in each recompute (2 calls per layer and step), gradients
    stay exact, and the pinned pool holds one layer's stash instead of every layer's."""
    pools, grads = {}, {}
    for recompute in (False, True):
        model, _ = _models()
        attention = FPDTAttention(num_chunks=2, backend="math", offload=True)
        install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
        ActivationOffload(recompute_attention=recompute).fpdt_transform(model, find_blocks(model))
        _train_steps(model)
        assert attention.kernel_calls == (2 if recompute else 1) * 3 * 2
        pools[recompute] = attention.stashes.host_bytes
        grads[recompute] = [p.grad for p in model.parameters()]
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)  # fp64, the same arithmetic run again
    # kept: 3 layers' q/k/v/lse chunks and outputs, then one layer's dout and out; recomputed: one layer's of each
    assert pools[True] < 0.5 * pools[False]


@pytest.mark.parametrize("known_block", [True, False])
def test_recompute_skips_the_tiled_mlp_value_in_residual_blocks(known_block):
    """TiledMLP under ActivationOffload: in a Llama-family block (the MLP output only feeds the residual add) the
    recompute does not compute the MLP's value, so each token passes the MLP twice per step (first pass, tile
    recompute in backward), not three times; in a block class it does not know, three times. Gradients exact."""
    from lightning_fpdt.memory import apply_tiled_mlp
    from lightning_fpdt.models.llama import LlamaDecoderLayer

    class PostNormLayer(LlamaDecoderLayer):  # an unknown block class: its MLP value may be read after the MLP
        pass

    plain, model = _models()
    if not known_block:
        for layer in model.model.layers:
            layer.__class__ = PostNormLayer
    rows = []
    for layer in model.model.layers:
        layer.mlp.gate_proj.register_forward_hook(
            lambda m, args, out: rows.append(args[0].numel() // args[0].shape[-1]))
    for m in (plain, model):
        install_reference_llama(
            m, SequenceParallelContext(group=None, attention=FPDTAttention(num_chunks=2, backend="math")))
    apply_tiled_mlp(model, num_tiles=3)
    ActivationOffload(offload=False).fpdt_transform(model, find_blocks(model))
    _train_steps(plain, steps=1)
    _train_steps(model, steps=1)
    tokens = 2 * 16  # batch 2 x 16 tokens, 3 layers
    assert sum(rows) == (2 if known_block else 3) * 3 * tokens
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)  # fp64: the same products


def test_activation_offload_option_messages():
    """prefetch < 0 and a model without blocks are refused by name."""
    with pytest.raises(ValueError, match="prefetch must be >= 0 blocks, got -1"):
        ActivationOffload(prefetch=-1)
    with pytest.raises(ValueError, match="reload_input .* needs offload=True"):
        ActivationOffload(offload=False, reload_input=True)
    with pytest.raises(ValueError, match="found no transformer blocks in Linear"):
        ActivationOffload().fpdt_transform(torch.nn.Linear(2, 2), [])


# ---- partial residency: keep_inputs ------------------------------------------------------------------------------
def _residency_run(keep_inputs, *, head_chunks=1, prefetch=1, reload=False, recompute=False, packed=False,
                   num_layers=5, seed=0, observe=None):
    """Two steps of a 5-layer fp64 reference Llama under ActivationOffload(keep_inputs=...) on fresh random tokens;
    returns the parameters' gradients, the attention and the callback. ``observe(stash)`` wraps the stash's put."""
    from lightning_fpdt.sequence.documents import DocumentBoundaries

    model, _ = _models(num_layers)
    attention = FPDTAttention(num_chunks=2, backend="math", offload=True, head_chunks=head_chunks)
    install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
    callback = ActivationOffload(prefetch=prefetch, reload_input=reload, recompute_attention=recompute,
                                 keep_inputs=keep_inputs)
    callback.fpdt_transform(model, find_blocks(model))
    if observe is not None:
        observe(callback._owner.stash(torch.device("cpu")))
    gen = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    kwargs = {}
    if packed:  # documents of random lengths, one crossing the FPDT chunk edge; positions restart per document
        cut = int(torch.randint(3, 13, (1,), generator=gen))
        document_ids = torch.tensor([[0] * cut + [1] * (16 - cut), [0] * 16])
        positions = torch.cat([torch.arange(cut), torch.arange(16 - cut)]).expand(2, 16).clone()
        positions[1] = torch.arange(16)
        attention.documents = DocumentBoundaries.from_document_ids(document_ids)
        kwargs = dict(position_ids=positions, document_ids=document_ids)
    for _ in range(2):
        model(input_ids=ids, labels=targets, **kwargs).backward()
    return {n: p.grad for n, p in model.named_parameters()}, attention, callback


@pytest.mark.parametrize("head_chunks", [1, 2])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("prefetch, reload", [(0, False), (1, False), (0, True), (1, True)])
def test_regenerated_inputs_give_the_same_gradients(head_chunks, recompute, packed, prefetch, reload):
    """keep_inputs=2 of 5 blocks (kept 0 and 2; 1, 3 and 4 regenerated in the backward) gives every parameter the
    gradient of keeping every input, bit for bit, with head groups, attention recompute, packed documents, the
    prefetch and reload_input; where the first pass was recorded the attention runs no more than when every input is
    kept, under recompute_attention once more per regenerated block."""
    options = dict(head_chunks=head_chunks, prefetch=prefetch, reload=reload, recompute=recompute, packed=packed)
    kept, kept_attention, _ = _residency_run("all", **options)
    grads, attention, callback = _residency_run(2, **options)
    for name, expected in kept.items():
        # fp64, and the regenerating forward repeats the first forward's operations on the same values: bit-equal
        assert torch.equal(grads[name], expected), name
    regenerated = 3 * head_chunks * 2  # blocks 1, 3, 4 x groups x steps
    extra = regenerated if recompute else 0
    assert attention.kernel_calls == kept_attention.kernel_calls + extra
    assert len(callback._owner._stash) == 0  # every input, kept or regenerated, freed by its block's backward


@pytest.mark.parametrize("keep", [1, 2, 3, 5])
def test_stash_holds_kept_inputs_and_one_segment(keep):
    """The host stash never holds more than the kept inputs and one segment's regenerated ones, ``k + ⌈L/k⌉ - 1``
    (largest_segment), and is empty after each step; the gradients are those of keeping every input."""
    from lightning_fpdt.memory.block_schedule import kept_positions, largest_segment

    counts = []

    def observe(stash):
        put = stash.put

        def counting_put(key, tensor):
            put(key, tensor)
            counts.append(len(stash))
        stash.put = counting_put

    kept, _, _ = _residency_run("all", num_layers=7, seed=3)
    grads, _, callback = _residency_run(keep, num_layers=7, seed=3, observe=observe)
    assert len(kept_positions(7, keep)) == keep and 0 in kept_positions(7, keep)
    assert max(counts) == min(7, keep + largest_segment(7, keep))
    assert len(callback._owner._stash) == 0
    for name, expected in kept.items():
        assert torch.equal(grads[name], expected), name  # fp64, the same operations on the same values


def test_an_input_that_is_not_the_previous_output_is_kept():
    """A model that changes the hidden states between blocks (here a scale): those inputs cannot be regenerated from
    the block before, so they are kept whatever the schedule, and the gradients stay exact."""
    model, plain = _models(4)
    for m in (model, plain):
        install_reference_llama(m, SequenceParallelContext(group=None, attention=FPDTAttention(num_chunks=2,
                                                                                               backend="math")))
        layers = list(m.model.layers)
        for layer in layers[1:3]:  # blocks 1 and 2 get 0.5 x the previous output
            layer.register_forward_pre_hook(lambda module, args: (args[0] * 0.5, *args[1:]))
    callback = ActivationOffload(keep_inputs=1)
    callback.fpdt_transform(model, find_blocks(model))
    stored = []
    stash = callback._owner.stash(torch.device("cpu"))
    put = stash.put
    stash.put = lambda key, tensor: (stored.append(key), put(key, tensor))
    _train_steps(plain, steps=1)
    _train_steps(model, steps=1)
    assert stored[:3] == [0, 1, 2]  # the forward: the first input and the two scaled ones; then block 3 regenerated
    assert stored[3:] == [3]
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)  # fp64, the same arithmetic


def test_keep_inputs_option_messages():
    """keep_inputs must be 'auto', 'all' or 1..L: a wrong one is refused with the choices and the number of blocks;
    a chosen count of at least the blocks keeps them all."""
    for wrong in (0, -1, True, "some", 2.0):
        with pytest.raises(ValueError, match="keep_inputs must be 'auto', 'all' or a number of block inputs"):
            ActivationOffload(keep_inputs=wrong)
    model, _ = _models(3)
    with pytest.raises(ValueError, match="from 1 to the model's 3 blocks, got 4"):
        ActivationOffload(keep_inputs=4).fpdt_transform(model, find_blocks(model))
    # the strategy's choice for a config deeper than the blocks found keeps them all, rather than failing a step
    callback = ActivationOffload()
    callback.fpdt_transform(model, find_blocks(model))
    callback.apply_memory_choice(recompute_attention=False, reload_input=False, prefetch=1, keep_inputs=14)
    assert callback._owner._kept == {0, 1, 2}


# ---- blocks not checkpointed: checkpoint_blocks ------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint_blocks", [0, 1, 2, "all"])
@pytest.mark.parametrize("offload, tiled", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("frozen, head_chunks", [(False, 1), (True, 1), (False, 2)])
def test_plain_blocks_give_the_same_gradients(checkpoint_blocks, offload, tiled, frozen, head_chunks):
    """checkpoint_blocks=n of 3 blocks: the first n are checkpointed, the others run plain: every parameter (and,
    with frozen embeddings, every trainable one) gets the gradient of the model without checkpointing, on fresh
    random tokens, with one or two head groups; a plain block's MLP runs whole and once (its tokens pass the MLP once
    a step, a checkpointed block's twice: the recompute, or the tiled MLP's tiles in the backward), the attention
    runs once per layer and head group, and each step frees every stashed input."""
    from lightning_fpdt.memory import apply_tiled_mlp

    plain, model = _models()
    if frozen:
        for m in (plain, model):
            m.model.embed_tokens.weight.requires_grad_(False)
    rows = []
    for layer in model.model.layers:
        layer.mlp.gate_proj.register_forward_hook(
            lambda m, args, out: rows.append(args[0].numel() // args[0].shape[-1]))
    attentions = []
    for m in (plain, model):
        attentions.append(FPDTAttention(num_chunks=2, backend="math", offload=offload, head_chunks=head_chunks))
        install_reference_llama(m, SequenceParallelContext(group=None, attention=attentions[-1]))
    if tiled:
        apply_tiled_mlp(model, num_tiles=2)
    callback = ActivationOffload(offload=offload, checkpoint_blocks=checkpoint_blocks)
    callback.fpdt_transform(model, find_blocks(model))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    for m in (plain, model):
        m(input_ids=ids, labels=targets).backward()
    checkpointed = 3 if checkpoint_blocks == "all" else checkpoint_blocks
    tokens = 2 * 16
    assert sum(rows) == 2 * checkpointed * tokens + (3 - checkpointed) * tokens
    assert attentions[1].kernel_calls == attentions[0].kernel_calls == 3 * head_chunks
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)  # fp64, same arithmetic
        else:
            assert b.grad is None, name
    assert len(callback._owner._stash or ()) == 0  # (no stash at all when no block is checkpointed)


def test_checkpoint_blocks_from_the_strategy_choice():
    """checkpoint_blocks="auto" takes the strategy's choice between steps (and "all" before any); a count of at least
    the blocks checkpoints them all; plain blocks with keep_inputs or recompute_attention are refused by name, as is a
    count outside 0..L."""
    model, _ = _models()
    install_reference_llama(model, SequenceParallelContext(group=None, attention=FPDTAttention(backend="math")))
    callback = ActivationOffload()
    callback.fpdt_transform(model, find_blocks(model))
    assert callback._owner.checkpointed == 3
    callback.apply_memory_choice(recompute_attention=False, reload_input=False, prefetch=1, checkpoint_blocks=1)
    assert callback._owner.checkpointed == 1
    callback.apply_memory_choice(recompute_attention=False, reload_input=False, prefetch=1, checkpoint_blocks=32)
    assert callback._owner.checkpointed == 3  # a plan made for a deeper config
    with pytest.raises(ValueError, match="checkpoint_blocks=1 leaves blocks plain .* while keep_inputs=2"):
        callback.apply_memory_choice(recompute_attention=False, reload_input=False, prefetch=1, keep_inputs=2,
                                     checkpoint_blocks=1)
    with pytest.raises(ValueError, match="while recompute_attention=True .* use checkpoint_blocks='all'"):
        ActivationOffload(checkpoint_blocks=2, recompute_attention=True).fpdt_transform(*_models_and_blocks())
    for wrong in (-1, True, "some", 1.5):
        with pytest.raises(ValueError, match="checkpoint_blocks must be 'auto', 'all' or a number of blocks "
                                             "checkpointed from 0"):
            ActivationOffload(checkpoint_blocks=wrong)
    with pytest.raises(ValueError, match="from 0 to the model's 3 blocks, got 4"):
        ActivationOffload(checkpoint_blocks=4).fpdt_transform(*_models_and_blocks())


def _models_and_blocks():
    model, _ = _models()
    return model, find_blocks(model)


def test_activation_offload_logs_its_host_memory_without_a_device_copy():
    """The host memory ActivationOffload logs each batch is a host tensor: Lightning keeps a logged tensor where it
    is, where a Python float becomes a copy to the GPU from pageable memory that waits for the step's last kernel."""
    from types import SimpleNamespace

    logged = {}
    module = SimpleNamespace(log=lambda name, value, **kwargs: logged.update({name: value}))
    callback = ActivationOffload()
    callback.on_train_batch_end(None, module, None, None, 0)
    value = logged["memory/activation_offload_host_gib"]
    assert isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1
