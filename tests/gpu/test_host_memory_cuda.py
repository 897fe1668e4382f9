"""Host memory that costs what it holds, on a CUDA machine (marker gpu; run on the device): registered buffers are
page-locked at their exact size, copy asynchronously and correctly, and the strategy page-locks FSDP2's host-resident
shards exactly."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import ActivationOffload, FPDTStrategy, TiledLoss, TiledMLP
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.offload.host_memory import HostAllocator, resident_bytes

pytestmark = pytest.mark.gpu
GIB = 2**30


def test_registered_buffers_are_pinned_exactly_and_copy_back():
    """Four 0.75 GiB buffers page-locked through cudaHostRegister raise the process's resident memory by 3 GiB (the
    caching host allocator would take 4), are pinned as far as CUDA is concerned, and a non-blocking round trip
    through them returns the same values."""
    allocator = HostAllocator(pin=True)
    torch.empty(1, device="cuda")  # the CUDA context first: its own host memory is not the buffers'
    before = resident_bytes()
    buffers = [allocator.empty(3 * GIB // 8, torch.bfloat16) for _ in range(4)]
    grown = resident_bytes() - before
    assert allocator.allocated_bytes == 3 * GIB
    # the pages themselves, and the driver's own record of the registration (a few percent): never the 4 GiB that
    # power-of-two blocks would take
    assert 3 * GIB <= grown < 3.25 * GIB, grown / GIB
    assert all(b.is_pinned() for b in buffers)
    x = torch.randn(3 * GIB // 8, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    # the copies wait for x on the stream that made it: inside the `with`, current_stream() is the copy stream itself
    # (waiting on it orders nothing, and the first copy would read x while randn still writes it)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        buffers[0].copy_(x, non_blocking=True)
        back = buffers[0].to("cuda", non_blocking=True)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(back, x)
    allocator.close()


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                                                  num_layers=4, num_heads=8, num_kv_heads=4))

    def training_step(self, batch, batch_idx):
        return self.model(**batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_strategy_pins_host_states_exactly_and_plans_the_run():
    """With states on the host the strategy page-locks each FSDP2 shard at its size (all parameters' fp32 bytes,
    nothing rounded), plans the run ("auto" resolved, a plan that fits) and counts its pinned bytes."""
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 4096, (2, 8192), generator=gen)]
    module = LM()
    parameter_bytes = sum(p.numel() * 4 for p in module.parameters())
    strategy = FPDTStrategy(cpu_offload_params=True)
    pinned = []

    class Pinned(L.Callback):
        def on_train_batch_end(self, *args) -> None:
            pinned.append(strategy.pinned_host_bytes)

    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=2, logger=False,
                        strategy=strategy, callbacks=[ActivationOffload(), TiledMLP(), TiledLoss(), Pinned()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=1, collate_fn=lambda b: {k: v[None] for k, v in b[0].items()}))
    assert strategy.memory_plan is not None and strategy.memory_plan.fits
    assert strategy.memory_plan.component("parameters").host_bytes == parameter_bytes
    assert min(pinned) >= parameter_bytes and pinned[0] == pinned[-1]  # allocated once, in the first step


def _host_used_bytes() -> int:
    """The host's memory in use (MemTotal - MemAvailable)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def test_a_forked_child_does_not_copy_the_pinned_buffers():
    """Linux copies page-locked pages of a private mapping at fork(): the buffers, made and registered, are not
    inherited (MADV_DONTFORK), so a child process started while 4 GiB are pinned adds nothing like 4 GiB."""
    import os
    import time

    torch.empty(1, device="cuda")
    allocator = HostAllocator(pin=True)
    held = allocator.empty(4 * GIB, torch.uint8)
    shard = torch.empty(GIB, dtype=torch.uint8)
    allocator.register(shard)  # a tensor another allocator made, page-locked the same way
    before = _host_used_bytes()
    pid = os.fork()
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    time.sleep(2)
    grown = _host_used_bytes() - before
    os.waitpid(pid, 0)
    assert grown < GIB // 2, grown / GIB
    assert held.is_pinned()
    allocator.close()
