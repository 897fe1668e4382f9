"""Checksums of distributed checkpoint files, without processes (docs/checkpoints.md)."""

from __future__ import annotations

import os

from lightning_fpdt.strategy import checkpoint


def test_checksums_record_each_file_and_catch_one_flipped_byte(tmp_path):
    """The checksums cover every file of the folder, chunk by chunk; one changed byte in one chunk is found, and a
    folder without a checksums file reports nothing to verify."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "a.distcp").write_bytes(os.urandom(3 * 1000 + 7))
    (folder / ".metadata").write_bytes(b"index")
    assert checkpoint.damaged_files(folder, 0, 1) is None
    checkpoint.write_checksums(folder, checkpoint.record_checksums(folder, 0, 1))
    assert checkpoint.damaged_files(folder, 0, 1) == []
    data = bytearray((folder / "a.distcp").read_bytes())
    data[1234] ^= 1
    (folder / "a.distcp").write_bytes(bytes(data))
    (folder / "b.distcp").write_bytes(b"stray")
    problems = checkpoint.damaged_files(folder, 0, 1)
    assert problems == ["b.distcp (extra file, not written by the save)",
                        "a.distcp (its contents changed since the save: the checksum differs)"], problems
