"""Token files: writing, packing documents into fixed-length samples, per-document positions, the tokenize tool."""

import json

import numpy as np
import pytest
import torch

from lightning_fpdt.data import PackedTokenDataset, TokenFile, TokenFileDataModule, write_token_file
from lightning_fpdt.data.token_file import token_dtype
from lightning_fpdt.data.tokenize_files import main as tokenize_main

DOCS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18, 19, 20, 21]]  # 17 tokens


@pytest.fixture
def token_file(tmp_path):
    return write_token_file(tmp_path / "corpus.bin", DOCS, vocab_size=32, eos_token_id=None)


def test_write_and_read(token_file, tmp_path):
    """The file holds the documents back to back (uint16 for small vocabularies) with their offsets."""
    assert token_file.num_tokens == 17 and token_file.num_documents == 4
    assert token_file.tokens.dtype == np.uint16 and isinstance(token_file.tokens, np.memmap)
    assert token_file.offsets.tolist() == [0, 3, 8, 10, 17]
    assert token_file.document(1).tolist() == DOCS[1]
    assert json.loads((tmp_path / "corpus.json").read_text())["num_documents"] == 4
    assert (token_dtype(65536), token_dtype(65537)) == (np.uint16, np.uint32)
    with pytest.raises(ValueError, match=r"document 0 has token ids outside \[0, 8\)"):
        write_token_file(tmp_path / "bad.bin", [[1, 9]], vocab_size=8)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        TokenFile(tmp_path / "missing.bin")


@pytest.mark.parametrize("cut", [1, 7])
def test_truncated_token_file_is_named(token_file, tmp_path, cut):
    """A token file cut short (mid-record or by whole tokens) is refused with its name and both sizes, not numpy's
    bare mmap error."""
    path = tmp_path / "corpus.bin"
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(ValueError, match=rf"{path} holds {34 - cut} bytes, but its index .* say 17 uint16 tokens "
                                         rf"\(34 bytes\): the file is truncated"):
        TokenFile(path)


def test_packing_into_fixed_length_samples(token_file):
    """Samples are consecutive windows of the token stream, crossing document boundaries; the rest is dropped."""
    data = PackedTokenDataset(token_file, seq_len=4)
    assert len(data) == 4  # 17 // 4
    stream = [t for doc in DOCS for t in doc]
    for i in range(4):
        assert data[i]["input_ids"].tolist() == stream[4 * i: 4 * i + 4]
        assert torch.equal(data[i]["labels"], data[i]["input_ids"]) and set(data[i]) == {"input_ids", "labels"}
    with pytest.raises(ValueError, match=r"has 17 tokens = 4 samples of 4; samples 3 … 4 were asked for"):
        PackedTokenDataset(token_file, seq_len=4, first_sample=3, num_samples=2)


def test_position_reset_and_document_ids(token_file):
    """Positions restart at each document (continuing one begun earlier), documents are numbered per sample, and
    the first token of a document is not a target."""
    data = PackedTokenDataset(token_file, seq_len=6, reset_position_ids=True, document_ids=True)
    first, second = data[0], data[1]
    # window 0: tokens 0..5 = doc0 (3 tokens) + doc1[:3]; window 1: tokens 6..11 = doc1[3:] + doc2 + doc3[:2]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    assert second["position_ids"].tolist() == [3, 4, 0, 1, 0, 1]
    assert first["document_ids"].tolist() == [0, 0, 0, 1, 1, 1]
    assert second["document_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert first["labels"].tolist() == [-100, 6, 7, -100, 9, 10]
    assert second["labels"].tolist() == [11, 12, -100, 14, -100, 16]
    only_positions = PackedTokenDataset(token_file, seq_len=6, reset_position_ids=True)[1]
    assert "document_ids" not in only_positions and only_positions["position_ids"].tolist() == [3, 4, 0, 1, 0, 1]


def test_data_module_holds_out_validation(token_file):
    """Without val_path the last val_samples windows validate; the rest train."""
    dm = TokenFileDataModule(str(token_file.path), seq_len=4, batch_size=2, val_samples=1, reset_position_ids=True)
    dm.setup("fit")
    assert len(dm.train_set) == 3 and len(dm.val_set) == 1
    assert dm.val_set[0]["input_ids"].tolist() == [t for doc in DOCS for t in doc][12:16]
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["position_ids"].shape == (2, 4)
    with pytest.raises(ValueError, match="holding out 4 for validation leaves none"):
        TokenFileDataModule(str(token_file.path), seq_len=4, val_samples=4).setup("fit")


def _local_tokenizer(tmp_path):
    """A WordLevel tokenizer trained here on a few words and saved for AutoTokenizer (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the cat sat on the mat", "a dog ate the bone"],
                                  trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(tmp_path / "tok")
    return fast, str(tmp_path / "tok")


def test_tokenize_files_tool(tmp_path, capsys):
    """The tool tokenizes each file as a document with a local HF tokenizer and appends EOS."""
    tokenizer, path = _local_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text("the cat sat on the mat")
    (tmp_path / "b.txt").write_text("a dog ate the bone\n\nthe cat ate")
    tokenize_main(["--tokenizer", path, "--out", str(tmp_path / "out.bin"), str(tmp_path / "a.txt"),
                   str(tmp_path / "b.txt")])
    assert "wrote" in capsys.readouterr().out
    written = TokenFile(tmp_path / "out.bin")
    eos = tokenizer.eos_token_id
    assert written.num_documents == 2 and written.meta["eos_token_id"] == eos
    assert written.document(0).tolist() == tokenizer("the cat sat on the mat")["input_ids"] + [eos]
    assert written.meta["tokenizer"] == path

    tokenize_main(["--tokenizer", path, "--out", str(tmp_path / "para.bin"), "--split", "paragraphs", "--no-eos",
                   str(tmp_path / "b.txt")])
    paragraphs = TokenFile(tmp_path / "para.bin")
    assert paragraphs.num_documents == 2
    assert paragraphs.document(1).tolist() == tokenizer("the cat ate")["input_ids"]


def test_training_on_token_files(token_file, tmp_path):
    """A model trains on packed token files with per-document positions and document ids, without validation."""
    import lightning as L

    from lightning_fpdt.models.module import LlamaLM

    corpus = write_token_file(tmp_path / "train.bin", [list(range(5, 5 + n)) for n in (7, 12, 5, 9) * 3],
                              vocab_size=64)
    dm = TokenFileDataModule(str(corpus.path), seq_len=16, batch_size=2, reset_position_ids=True, document_ids=True)
    module = LlamaLM("tiny", config_overrides={"vocab_size": 64, "num_layers": 1})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, dm)
    assert len(module.losses) == 2 and all(loss > 0 for loss in module.losses)
