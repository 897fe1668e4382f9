"""Data for long-context training: a synthetic retrieval task (the demo's) and packed token files."""

from lightning_fpdt.data.base import LongContextDataModule
from lightning_fpdt.data.needle import KeyValueNeedle, PasskeyNeedle
from lightning_fpdt.data.retrieval import RetrievalDataModule, RetrievalDataset, RetrievalTask
from lightning_fpdt.data.token_file import PackedTokenDataset, TokenFile, TokenFileDataModule, write_token_file

__all__ = [
    "KeyValueNeedle",
    "LongContextDataModule",
    "PackedTokenDataset",
    "PasskeyNeedle",
    "RetrievalDataModule",
    "RetrievalDataset",
    "RetrievalTask",
    "TokenFile",
    "TokenFileDataModule",
    "write_token_file",
]
