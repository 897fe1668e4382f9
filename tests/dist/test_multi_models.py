"""Every language model a LightningModule holds trains on the fpdt path, exactly as one process trains it: a model
beside a frozen probe or a trained value head, DPO's trained policy beside a frozen reference model, eager attention,
right-padding masks; an attention the strategy does not reach stops the run (docs/design.md §5, "Several models")."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_fpdt import ActivationOffload, FPDTStrategy, TiledLoss, TiledMLP
from tests.dist.multi_models import HIDDEN, MultiModelLM, dataset_of, hf_llama, one_process_training, worst_error
from tests.dist.training import VOCAB, TokenDataset, full_state, trainer_kwargs

# fp32, as the other whole-training parity tests: the parallel run sums the same products in another order (blockwise
# softmax, the sums over the group), ~1e-7 relative per op; over 3 SGD steps the parameters stay within ~1e-6 of one
# process. A rank attending to its own shard only, a loss that is a rank's share, or a sum that misses a rank's tokens
# move the loss by > 1e-2.
TOL = dict(rtol=1e-4, atol=2e-5)
UPDATE_TOL = 1e-2
"""A trained parameter's error against one process, as a fraction of its change there (fp32 leaves ~1e-4)."""


def memory_callbacks() -> list[L.Callback]:
    return [ActivationOffload(), TiledMLP(num_tiles=3), TiledLoss(num_tiles=3)]


def train_case(case: str, *, chunks: int = 2, seq_len: int = 16, callbacks: bool = False) -> dict:
    """``case`` (tests/dist/multi_models.py) under Trainer(strategy="fpdt") against one process: the loss the step
    returns on this rank, what it recorded, every parameter. Returns the figures of the comparison."""
    steps, batch_size = 3, 2
    dataset, collate = dataset_of(case, steps * batch_size, seq_len)
    module = MultiModelLM(case)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=dist.get_world_size(), chunks=chunks),
                        devices=dist.get_world_size(), max_steps=steps,
                        callbacks=memory_callbacks() if callbacks else [], **trainer_kwargs())
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate))
    reference = one_process_training(case, dataset, collate, steps=steps, batch_size=batch_size)
    name = f"{case} chunks={chunks} S={seq_len}{' +memory callbacks' if callbacks else ''}"
    # the loss training_step returned, on this rank: the sequence's (what self.log records)
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(reference.losses), **TOL,
                               msg=lambda m: f"{name}: returned losses {module.losses} vs {reference.losses}: {m}")
    for got, ref in zip(module.recorded, reference.recorded):
        torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"{name}: recorded sequence values: {m}")
    state = full_state(module)
    worst = worst_error(state, reference.state_dict(), start)
    assert worst < UPDATE_TOL, f"{name}: a parameter is off one process by {worst:.1e} of its update"
    if case == "dpo":
        reference_weights = {k: v for k, v in state.items() if k.startswith("reference.")}
        assert all(torch.equal(v, start[k]) for k, v in reference_weights.items()), "the frozen reference changed"
    recorded = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(module.recorded, reference.recorded)) \
        if module.recorded else None
    return dict(case=name, rank=dist.get_rank(), losses=module.losses, sequence_losses=reference.losses,
                worst_update_error=worst, recorded_error=recorded)


def run_matrix(cases: list[dict]) -> list[dict]:
    return [train_case(**case) for case in cases]


MATRIX = [
    dict(case="probe"),
    dict(case="value-head", seq_len=15),  # padded to 16: the padding never counts in the sequence mean
    dict(case="value-head", callbacks=True),
    dict(case="eager"),
    dict(case="dpo"),
    dict(case="dpo", callbacks=True, chunks=1),
    dict(case="right-padding"),
]


def test_models_beside_others_train_as_one_process(dist_pool):
    """A HF model beside a frozen probe or a trained value head, DPO's policy beside a frozen reference (its
    log-probability sums under no_grad), eager attention with frozen embeddings and a right-padding mask: on 2
    processes the loss each rank returns is the sequence's, the recorded per-sequence values and every parameter one
    process's, the frozen reference unchanged (memory callbacks with and without)."""
    results = dist_pool(2).run(run_matrix, cases=MATRIX)
    for rank_results in results:
        for r in rank_results:
            print(f"rank {r['rank']} {r['case']}: returned losses {[f'{x:.6f}' for x in r['losses']]} "
                  f"(sequence {[f'{x:.6f}' for x in r['sequence_losses']]}), worst update error "
                  f"{r['worst_update_error']:.1e}, recorded {r['recorded_error']}")


# ---- what stops a run ------------------------------------------------------------------------------------------------
class Beside(L.LightningModule):
    """A Hugging Face model and one other module, by ``kind``: ``"gemma2"`` (a family the strategy refuses) beside a
    linear head; ``"mha"``: a head attending over the hidden states with ``nn.MultiheadAttention`` (this rank's tokens
    only); ``"allowed-mha"``: the same head marked ``allow_local_attention``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "gemma2":
            from transformers import Gemma2Config, Gemma2ForCausalLM

            self.model = Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2, head_dim=8))
            self.head = nn.Linear(HIDDEN, 1)
        else:
            self.model = hf_llama(0)
            self.head = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)
            if kind == "allowed-mha":
                import lightning_fpdt

                lightning_fpdt.allow_local_attention(self.head)

    def training_step(self, batch, batch_idx):
        out = self.model(**batch, output_hidden_states=True)
        if self.kind == "gemma2":
            return out.loss
        hidden = out.hidden_states[-1]
        pooled, _ = self.head(hidden, hidden, hidden, need_weights=False)
        return out.loss + pooled.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EagerBlock(nn.Module):
    """A block writing its attention out as matmul and softmax (no F.scaled_dot_product_attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / HIDDEN ** 0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return x + self.proj(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v)


class EagerGPT(L.LightningModule):
    """A plain model whose blocks attend by hand: the strategy intercepts nothing in them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(EagerBlock() for _ in range(2))
        self.out = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch, batch_idx):
        x = self.embed(batch["input_ids"])
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_errors() -> dict[str, str]:
    """The error each module's fit stops with (``""``: it trained)."""
    errors = {}
    for name, module in [("gemma2", Beside("gemma2")), ("mha", Beside("mha")), ("allowed-mha", Beside("allowed-mha")),
                         ("eager-gpt", EagerGPT())]:
        trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=1,
                            **trainer_kwargs())
        try:
            trainer.fit(module, DataLoader(TokenDataset(2, 16, seed=0), batch_size=2))
            errors[name] = ""
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_unreached_attentions_and_refused_families_stop_the_run(dist_pool):
    """A refused family beside a head is refused at setup; a head's nn.MultiheadAttention and a plain block's
    hand-written attention, which would attend to one rank's tokens, stop the first step with a ValueError naming the
    module and the fix; allow_local_attention lets a head attend locally on purpose."""
    errors = dist_pool(2).run(fit_errors)[0]
    print({name: message[:160] for name, message in errors.items()})
    assert "Gemma2ForCausalLM (gemma2)" in errors["gemma2"]
    assert "head (MultiheadAttention) ran its forward without the sequence-parallel attention" in errors["mha"]
    assert "allow_local_attention" in errors["mha"] and "split over 2 ranks" in errors["mha"]
    assert errors["allowed-mha"] == ""
    assert "blocks.0 (EagerBlock) ran its forward without the sequence-parallel attention" in errors["eager-gpt"]


def test_sequence_classifiers_are_refused():
    """A Hugging Face head that pools over the sequence (a classifier's last token) is refused before anything
    changes, naming the base model and sequence_sum as the way."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from lightning_fpdt.integrations.install import check_family

    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=4,
                                                       num_key_value_heads=2))
    with pytest.raises(ValueError, match="sequence_sum"):
        check_family(model)
