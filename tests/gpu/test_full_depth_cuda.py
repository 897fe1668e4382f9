"""Full depth past host RAM on a CUDA machine (marker gpu; run on the device): the disk tier round-trips multi-GiB
bf16 chunks bitwise through its registered staging pieces and the copy streams, and a step whose block inputs spill
to disk gives the same gradients as one that keeps them in host memory."""

import pytest
import torch

from lightning_fpdt.memory import apply_block_offload, find_blocks
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.offload.disk import STAGING_PIECE_BYTES, DiskTier, SpillDirectory, staging_bytes
from lightning_fpdt.offload.host_stash import StashFactory

pytestmark = pytest.mark.gpu
GIB = 2**30


@pytest.mark.parametrize("piece_bytes", [None, 100 * 2**20 + 12345])
def test_disk_stash_round_trips_gib_chunks_on_cuda(tmp_path, piece_bytes):
    """Six 0.5 GiB bf16 chunks put from the GPU, all but one on disk, prefetched two ahead and read back: bitwise the
    chunks that went in (streamed through 256 MiB staging pieces, or through pieces of an odd size that leave every
    copy at an unaligned offset), and no file left once freed."""
    kwargs = {} if piece_bytes is None else {"piece_bytes": piece_bytes}
    files = SpillDirectory(str(tmp_path), rank=0, pin_memory=True, **kwargs)
    factory = StashFactory(offload=True)
    factory.disk = DiskTier(files, host_budget_bytes=GIB // 2)
    stash = factory.chunks(torch.device("cuda"))
    chunks = [torch.randn(GIB // 4, device="cuda").to(torch.bfloat16) for _ in range(6)]
    for i, chunk in enumerate(chunks):
        stash.put(i, chunk)
    for i in range(6):
        for ahead in (i + 1, i + 2):
            if ahead < 6:
                stash.prefetch(ahead)
        assert torch.equal(stash.get(i), chunks[i])
        stash.release(i)
        stash.free(i)
    torch.cuda.synchronize()
    assert files.bytes_on_disk == 0 and files.peak_bytes_on_disk >= 4 * GIB // 2
    assert files.staging.allocated_bytes == staging_bytes(GIB // 2, piece_bytes or STAGING_PIECE_BYTES)
    files.close()


def _grads(disk_dir=None, keep_inputs=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
                                         num_heads=4, num_kv_heads=2)).cuda()
    stashes = StashFactory(offload=True)
    if disk_dir is not None:  # one block input in host memory, the other three on disk
        stashes.disk = DiskTier(SpillDirectory(disk_dir, rank=0, pin_memory=True), host_budget_bytes=4096 * 256 * 4)
    apply_block_offload(find_blocks(model), stashes=stashes, keep_inputs=keep_inputs)
    ids = torch.randint(0, 512, (1, 4096), generator=torch.Generator().manual_seed(1)).cuda()
    model(input_ids=ids, labels=ids).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_block_inputs_on_disk_give_the_same_gradients_on_cuda(tmp_path):
    """fp32 on a GPU, 4 checkpointed blocks: with three of the block inputs spilled to disk the gradients are bitwise
    those of keeping them all in host memory (the same kernels on the same values)."""
    in_memory, on_disk = _grads(), _grads(str(tmp_path))
    for name, grad in in_memory.items():
        assert torch.equal(grad, on_disk[name]), name


def test_regenerated_block_inputs_give_the_same_gradients_on_cuda():
    """fp32 on a GPU, 4 checkpointed blocks, one input kept and three regenerated in the backward by a forward from
    it: the gradients of keeping every input, to fp32 rounding (the regenerating forward runs the same kernels on the
    same values; the attention's backward may sum in another order from run to run)."""
    every, one = _grads(), _grads(keep_inputs=1)
    for name, grad in every.items():
        torch.testing.assert_close(one[name], grad, rtol=1e-5, atol=1e-6, msg=name)
