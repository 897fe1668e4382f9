"""Write a token file from plain text files with any Hugging Face tokenizer available locally.

    python -m lightning_fpdt.data.tokenize_files --tokenizer PATH_OR_NAME --out corpus.bin a.txt b.txt ...

Each input file is one document (``--split lines``: each non-empty line; ``--split paragraphs``: each block
separated by blank lines). The tokenizer's special tokens are added as it adds them (BOS for Llama), and its EOS is
appended to every document unless ``--no-eos``. Writes ``corpus.bin``, ``corpus.idx.npy`` and ``corpus.json`` (see
:mod:`lightning_fpdt.data.token_file`), which :class:`~lightning_fpdt.data.TokenFileDataModule` reads.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_fpdt.data.token_file import TokenFile, write_token_file

SPLITS = ("file", "lines", "paragraphs")


def read_documents(paths: Sequence[str], split: str = "file") -> Iterator[str]:
    """The documents of ``paths`` in order: whole files, non-empty lines, or blank-line separated paragraphs."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for path in paths:
        text = Path(path).read_text(encoding="utf-8")
        if split == "file":
            pieces = [text]
        elif split == "lines":
            pieces = text.splitlines()
        else:
            pieces = re.split(r"\n\s*\n", text)
        yield from (piece for piece in pieces if piece.strip())


def tokenize_files(
    paths: Sequence[str],
    out: str,
    tokenizer: Any,
    *,
    split: str = "file",
    add_special_tokens: bool = True,
    append_eos: bool = True,
    tokenizer_name: Optional[str] = None,
) -> TokenFile:
    """Tokenize the documents of ``paths`` with ``tokenizer`` (a name/path for ``AutoTokenizer.from_pretrained`` or a
    tokenizer object) and write them to the token file ``out``."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer_name = tokenizer_name or str(tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    eos = tokenizer.eos_token_id if append_eos else None
    if append_eos and eos is None:
        raise ValueError(
            f"tokenizer {tokenizer_name or type(tokenizer).__name__} has no EOS token to end documents with; pass "
            "--no-eos (documents are then only told apart by the index file)"
        )

    def documents() -> Iterator[list[int]]:
        for text in read_documents(paths, split):
            ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            yield ids

    return write_token_file(
        out, documents(), vocab_size=len(tokenizer), eos_token_id=eos,
        tokenizer=tokenizer_name or getattr(tokenizer, "name_or_path", None),
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fpdt.data.tokenize_files", description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("files", nargs="+", help="plain text files (UTF-8)")
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory or a Hugging Face model name")
    parser.add_argument("--out", required=True, help="the token file to write (.bin; .idx.npy and .json beside it)")
    parser.add_argument("--split", choices=SPLITS, default="file", help="what one document is (default: a file)")
    parser.add_argument("--no-special-tokens", action="store_true", help="do not let the tokenizer add BOS etc.")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to each document")
    args = parser.parse_args(argv)
    token_file = tokenize_files(
        args.files, args.out, args.tokenizer, split=args.split, add_special_tokens=not args.no_special_tokens,
        append_eos=not args.no_eos,
    )
    print(
        f"wrote {token_file.path}: {token_file.num_tokens:,} tokens in {token_file.num_documents:,} documents "
        f"({token_file.meta['dtype']}, vocabulary {token_file.vocab_size:,})"
    )


if __name__ == "__main__":
    main()
