"""Token ids outside the model's vocabulary, float ids and mismatched token files are refused by name before any
forward (lightning_fpdt/strategy/tokens.py)."""

import json

import pytest
import torch

from lightning_fpdt.data import TokenFileDataModule, write_token_file
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.strategy.tokens import (
    Vocabulary,
    check_data_vocabulary,
    check_pad_token,
    check_token_ids,
    model_vocabulary,
)
from tests.dist.training import PlainLM

VOCAB = Vocabulary(64, "the rows of TestLM's input embedding")


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB.size, (3, 16), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_an_id_outside_the_vocabulary_is_named_with_its_place(bad):
    """An id >= the vocabulary (or negative) raises a ValueError with the id, its batch row and token, the
    vocabulary's size and where that size came from."""
    batch = _batch(seed=bad % 7)
    check_token_ids(batch, VOCAB)  # in range: nothing to say
    batch["input_ids"][2, 9] = bad
    with pytest.raises(ValueError, match=rf"batch\['input_ids'\] holds token id {bad} at batch row 2, token 9 of "
                                         rf"16 .*vocabulary has 64 ids \(0 … 63\), from the rows of TestLM's input "
                                         rf"embedding.*tokenize with the model's own tokenizer"):
        check_token_ids(batch, VOCAB)


def test_labels_outside_the_vocabulary_are_refused_but_not_the_ignore_index():
    """Labels of -100 are no target; any other label outside the vocabulary is named like an input id."""
    batch = _batch(seed=3)
    batch["labels"][0, :] = -100
    check_token_ids(batch, VOCAB)
    batch["labels"][1, 12] = 77
    with pytest.raises(ValueError, match=r"batch\['labels'\] holds label 77 at batch row 1, token 12 of 16.*or -100 "
                                         r"for no target"):
        check_token_ids(batch, VOCAB)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_ids_that_are_not_integers_are_refused(dtype):
    """Float (or bool) input_ids raise a ValueError naming the dtype, whatever the vocabulary."""
    batch = {"input_ids": torch.randint(0, 64, (2, 8)).to(dtype)}
    with pytest.raises(ValueError, match=rf"input_ids must be integer token ids, got dtype {dtype}"):
        check_token_ids(batch, None)


def test_the_vocabulary_is_read_from_the_embedding_or_the_config():
    """Hugging Face models: the input embedding's rows; the reference Llama: config.vocab_size; a plain module
    without either: nothing to check against."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama(HFConfig(vocab_size=80, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1))
    hf.resize_token_embeddings(96)  # the embedding, not a stale number, decides
    assert model_vocabulary(hf) == Vocabulary(96, "the rows of LlamaForCausalLM's input embedding")
    llama = LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=72))
    assert model_vocabulary(llama) == Vocabulary(72, "LlamaForCausalLM's config.vocab_size")
    assert model_vocabulary(PlainLM()) is None
    check_pad_token(0, VOCAB)
    with pytest.raises(ValueError, match=r"pad_token_id=64\) is outside the model's vocabulary of 64 ids"):
        check_pad_token(64, VOCAB)


def test_token_files_are_compared_with_the_model_vocabulary(tmp_path):
    """A token file holding ids the model lacks is refused at setup, naming the file, its tokenizer and both sizes;
    one written for a larger vocabulary but holding only ids the model has passes; an older file that records only
    its vocabulary is refused when that exceeds the model's."""
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 60, (int(n),), generator=gen).tolist() for n in torch.randint(5, 30, (8,), generator=gen)]
    write_token_file(tmp_path / "fits.bin", docs, vocab_size=100, tokenizer="org/big-tokenizer")
    check_data_vocabulary(TokenFileDataModule(str(tmp_path / "fits.bin"), seq_len=8), VOCAB)

    write_token_file(tmp_path / "big.bin", [*docs, [3, 99]], vocab_size=100, tokenizer="org/big-tokenizer")
    with pytest.raises(ValueError, match=r"big.bin \(written with the tokenizer 'org/big-tokenizer', vocabulary "
                                         r"100\) holds token ids up to 99, and the model's vocabulary has 64 ids"):
        check_data_vocabulary(TokenFileDataModule(str(tmp_path / "fits.bin"), seq_len=8,
                                                  val_path=str(tmp_path / "big.bin")), VOCAB)

    meta = json.loads((tmp_path / "fits.json").read_text())
    del meta["max_token_id"]  # as files written before the largest id was recorded
    (tmp_path / "fits.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"fits.bin was written with the tokenizer 'org/big-tokenizer', a vocabulary "
                                         r"of 100 ids, and the model's has 64"):
        check_data_vocabulary(TokenFileDataModule(str(tmp_path / "fits.bin"), seq_len=8), VOCAB)
