"""The all-to-all's layout copies moved as 16-byte elements (``sequence/all_to_all.py``, ``copy_wide``): the same bytes
as ``copy_``, where the strides allow the wide view and where they do not."""

import pytest
import torch

from lightning_fpdt.sequence.all_to_all import copy_wide, place_heads, place_tokens, widens


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern of ``dtype`` equally likely (NaNs, infinities and subnormals included)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    info = torch.iinfo(bits)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=generator).view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_permuted_block_copies_to_the_same_bytes_wide(dtype):
    """(B, s, P, h', D) -permute-> (P, B, h', s, D), the all-to-all's send block: wide, bit for bit."""
    x = random_bits((2, 24, 4, 3, 16), dtype, seed=1)
    block = x.permute(2, 0, 3, 1, 4)
    out = torch.empty(block.shape, dtype=dtype)
    assert widens(block) and widens(out)
    copy_wide(out, block)
    assert same_bytes(out, block)


def test_strides_the_wide_view_cannot_take_copy_plainly():
    """A last dim shorter than 16 bytes, an odd offset, a strided last dim: copied as copy_ would, bit for bit."""
    x = random_bits((4, 6, 12), torch.bfloat16, seed=2)
    cases = [x[:, :, :5], x[:, :, 1:9], x[:, :, ::2]]
    for src in cases:
        assert not widens(src)
        out = torch.empty(src.shape, dtype=src.dtype)
        copy_wide(out, src)
        assert same_bytes(out, src)


def test_placing_heads_and_tokens_keeps_every_bit():
    """place_heads and place_tokens (the received pieces into their layouts) against the permutes they stand for."""
    p, b, hp, s, d = 4, 1, 2, 8, 16
    received = random_bits((p, b, hp, s, d), torch.bfloat16, seed=3)
    heads = place_heads(received)
    assert same_bytes(heads, received.permute(1, 2, 0, 3, 4).reshape(b, hp, p * s, d))
    tokens = torch.zeros((b, s, p * 2 * hp, d), dtype=torch.bfloat16)
    for piece in range(2):
        part = random_bits((p, b, s, hp, d), torch.bfloat16, seed=4 + piece)
        place_tokens(part, tokens, piece, 2)
        view = tokens.view(b, s, p, 2, hp, d)[:, :, :, piece]
        assert same_bytes(view, part.permute(1, 2, 0, 3, 4))
