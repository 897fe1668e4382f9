import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

from lightning_fpdt.callbacks.mfu import MFUMonitor, StepRecord, _count_global_tokens
from lightning_fpdt.flops import ModelGeometry, flops_per_token
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.sequence.heads import HeadSplit

TINY = LlamaConfig.from_name("tiny")


class TinyLlamaModule(L.LightningModule):
    """A minimal causal-LM LightningModule; the model is built in configure_model, as FSDP2 strategies want."""

    def configure_model(self) -> None:
        self.model = LlamaForCausalLM(TINY)

    def training_step(self, batch, batch_idx):
        return self.model(batch["input_ids"], labels=batch["input_ids"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class NoConfigModule(L.LightningModule):
    """A module with no `.config` anywhere: its geometry has to be given to the monitor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(TINY.vocab_size, 8)

    def training_step(self, batch, batch_idx):
        return self.embed(batch["input_ids"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def token_batches(*seq_lens: int, batch_size: int = 2) -> DataLoader:
    """Pre-built random token batches, one per entry of seq_lens, in that order."""
    batches = [{"input_ids": torch.randint(0, TINY.vocab_size, (batch_size, s))} for s in seq_lens]
    return DataLoader(batches, batch_size=None)


def fit(module: L.LightningModule, monitor: MFUMonitor, loader: DataLoader, tmp_path: Path, **trainer_kwargs):
    # Trainer(log_every_n_steps) stays at its default (50): the monitor writes to the loggers on its own schedule.
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=TensorBoardLogger(tmp_path), callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )
    trainer.fit(module, loader)
    return trainer


def read_scalars(trainer: L.Trainer) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the TensorBoard event file holds: tag -> [(step, value)]."""
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_metrics_reach_tensorboard_and_are_consistent(tmp_path, caplog):
    """Every optimizer step logs finite positive perf metrics whose ratios match the FLOP count and the peak."""
    peak = 1e12
    monitor = MFUMonitor(peak_flops=peak)
    trainer = fit(TinyLlamaModule(), monitor, token_batches(32, 32, 32), tmp_path, max_steps=3)
    # The end-of-fit summary leaves out the first (warm-up) step.
    assert "MFUMonitor: median of 2 steps" in caplog.text

    scalars = read_scalars(trainer)
    names = ["perf/step_time_s", "perf/tokens_per_sec", "perf/tokens_per_sec_per_device",
             "perf/tflops_per_device", "perf/mfu_causal", "perf/host_mem_gib"]
    for name in names:
        assert [step for step, _ in scalars[name]] == [0, 1, 2], name
        assert all(math.isfinite(value) and value > 0 for _, value in scalars[name]), name
    assert "perf/peak_gpu_mem_gib" not in scalars  # CPU run

    tokens_per_step = 2 * 32
    assert [record.tokens for record in monitor.step_records] == [tokens_per_step] * 3
    flops_per_tok = flops_per_token(ModelGeometry.from_config(TINY), 32)
    # TensorBoard stores float32 scalars (~7 significant digits): compare to 1e-5 relative.
    for i in range(3):
        step_time = scalars["perf/step_time_s"][i][1]
        tokens_per_sec = scalars["perf/tokens_per_sec"][i][1]
        tflops = scalars["perf/tflops_per_device"][i][1]
        assert scalars["perf/tokens_per_sec_per_device"][i][1] == pytest.approx(tokens_per_sec, rel=1e-5)
        assert tokens_per_sec * step_time == pytest.approx(tokens_per_step, rel=1e-5)
        assert tokens_per_sec * flops_per_tok / 1e12 == pytest.approx(tflops, rel=1e-5)
        assert tflops * 1e12 / peak == pytest.approx(scalars["perf/mfu_causal"][i][1], rel=1e-5)
    # tokens/s and MFU go to the progress bar, the rest only to callback_metrics.
    assert {"perf/tokens_per_sec", "perf/mfu_causal"} <= set(trainer.progress_bar_metrics)
    assert "perf/step_time_s" not in trainer.progress_bar_metrics
    assert "perf/step_time_s" in trainer.callback_metrics


def test_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    """With 2 micro-batches per step: one record and one log per step, tokens and per-length FLOPs summed."""
    monitor = MFUMonitor(peak_flops=1e12, convention="megatron")
    loader = token_batches(16, 32, 24, 8)  # micro-batches of different lengths: attention FLOPs/token differ
    trainer = fit(TinyLlamaModule(), monitor, loader, tmp_path, max_steps=2, accumulate_grad_batches=2)

    geometry = ModelGeometry.from_config(TINY)

    def flops(seq_len: int) -> int:
        return 2 * seq_len * flops_per_token(geometry, seq_len, convention="megatron")

    assert [record.tokens for record in monitor.step_records] == [2 * 16 + 2 * 32, 2 * 24 + 2 * 8]
    assert monitor.last_step_tokens == 2 * 24 + 2 * 8
    assert [record.flops for record in monitor.step_records] == [flops(16) + flops(32), flops(24) + flops(8)]
    scalars = read_scalars(trainer)
    assert [step for step, _ in scalars["perf/mfu_megatron"]] == [0, 1]
    assert "perf/mfu_causal" not in scalars


def test_explicit_geometry_unknown_peak_and_log_interval(tmp_path):
    """geometry= serves a module without config; no peak warns once and drops MFU; log_every_n_steps thins logs."""
    monitor = MFUMonitor(geometry=ModelGeometry.from_config(TINY), log_every_n_steps=2)
    with pytest.warns(UserWarning, match=r"no peak FLOP/s known for cpu.*MFUMonitor\(peak_flops=\.\.\.\)"):
        trainer = fit(NoConfigModule(), monitor, token_batches(8, 8, 8, 8), tmp_path, max_steps=4)

    assert len(monitor.step_records) == 4
    scalars = read_scalars(trainer)
    assert [step for step, _ in scalars["perf/tokens_per_sec"]] == [1, 3]  # after optimizer steps 2 and 4
    assert "perf/tflops_per_device" in scalars
    assert not any(name.startswith("perf/mfu") for name in scalars)


def test_missing_geometry_raises(tmp_path):
    """A module without a model config and no geometry= fails at fit start, naming the fix."""
    with pytest.raises(ValueError, match=r"Could not read the model geometry.*geometry=ModelGeometry"):
        fit(NoConfigModule(), MFUMonitor(peak_flops=1e12), token_batches(8), tmp_path, max_steps=1)


def test_tokens_counted_once_per_sequence_parallel_group():
    """Under sequence parallelism the global tokens are batch · seq_len · dp, from the strategy, not the shard."""
    strategy = SimpleNamespace(last_batch_geometry=(2, 1000, 1024), data_parallel_size=3, sequence_parallel_size=4)
    local_shard = {"input_ids": torch.zeros(2, 256, dtype=torch.long)}  # 1024 padded tokens / 4 ranks
    assert _count_global_tokens(strategy, 12, local_shard) == (2 * 1000 * 3, 1000)
    # Any other strategy: every rank's batch counts, token ids found by key or as the first tensor.
    other = SimpleNamespace()
    assert _count_global_tokens(other, 4, local_shard) == (2 * 256 * 4, 256)
    assert _count_global_tokens(other, 2, (torch.zeros(3, 7), torch.zeros(3))) == (3 * 7 * 2, 7)
    with pytest.raises(ValueError, match="could not find the token ids"):
        _count_global_tokens(other, 1, {"text": ["no tensors"]})


def test_packed_batch_counts_attention_within_documents():
    """A batch the strategy found packed (last_batch_attention_length) is counted with Σ L_d² / S, not S."""
    geometry = ModelGeometry.from_config(LlamaConfig.from_name("tiny"))
    flops = {}
    for attention_len in (None, 300.0):
        monitor = MFUMonitor(geometry=geometry)
        monitor._geometry = geometry
        strategy = SimpleNamespace(last_batch_geometry=(1, 1000, 1024), data_parallel_size=1,
                                   last_batch_attention_length=attention_len, root_device=torch.device("cpu"))
        trainer = SimpleNamespace(strategy=strategy, world_size=2, global_step=0)
        monitor.on_train_batch_start(trainer, None, {"input_ids": torch.zeros(1, 512)}, 0)
        flops[attention_len] = monitor._open_step.flops
    assert flops[None] == 1000 * flops_per_token(geometry, 1000)
    assert flops[300.0] == 1000 * flops_per_token(geometry, 1000, attention_len=300.0) < flops[None]


def _rank_metrics(geometry: ModelGeometry, seq_len: int, world_size: int, peak: float) -> tuple[dict, StepRecord]:
    """One rank's monitor through one step of a batch of one ``seq_len`` sequence shared by ``world_size``
    sequence-parallel ranks: the metrics it logs and its record."""
    logged = []
    strategy = SimpleNamespace(last_batch_geometry=(1, seq_len, seq_len), data_parallel_size=1,
                               sequence_parallel_size=world_size, last_batch_attention_length=None,
                               root_device=torch.device("cpu"))
    trainer = SimpleNamespace(strategy=strategy, world_size=world_size, global_step=0, precision="bf16-mixed",
                              loggers=[SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics))],
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=1)))
    module = SimpleNamespace(log_dict=lambda *args, **kwargs: None)
    monitor = MFUMonitor(geometry=geometry, peak_flops=peak)
    monitor.on_fit_start(trainer, module)
    shard = {"input_ids": torch.zeros(1, seq_len // world_size, dtype=torch.long)}
    monitor.on_train_batch_start(trainer, module, shard, 0)
    trainer.global_step = 1  # the optimizer stepped
    monitor.on_train_batch_end(trainer, module, None, shard, 0)
    (metrics,) = logged
    return metrics, monitor.step_records[-1]


def test_uneven_head_split_counts_the_model_flops_once():
    """14 query heads on 4 ranks (4, 4, 3, 3 heads' attention): the ranks' per-device FLOPs sum to the model's."""
    # Qwen2.5-0.5B's geometry
    geometry = ModelGeometry(num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, head_dim=64,
                             intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
    world_size, seq_len, peak = 4, 32768, 989e12
    split = HeadSplit(num_heads=14, num_kv_heads=2, sp_size=world_size)
    heads = [stop - start for start, stop in split.q_ranges]
    assert heads == [4, 4, 3, 3]

    def work(attention_heads: int) -> int:
        """Causal FLOPs of a rank with S/P tokens' dense layers and these heads' attention over all S tokens."""
        dense = 6 * geometry.nonembedding_parameters * seq_len // world_size
        return dense + 6 * geometry.num_layers * seq_len * seq_len * attention_heads * geometry.head_dim

    model_flops = sum(work(h) for h in heads)
    assert model_flops == flops_per_token(geometry, seq_len) * seq_len
    # a count per rank of H/P rounded down (3 heads), or up, which is the busiest rank's (4), sums to P times it
    for wrong_heads in (14 // world_size, split.max_heads):
        assert abs(world_size * work(wrong_heads) - model_flops) > 1e-2 * model_flops
    summed, mfu = 0.0, []
    for _ in range(world_size):  # every rank's monitor, with its own step time
        metrics, record = _rank_metrics(geometry, seq_len, world_size, peak)
        assert record.flops == model_flops and record.tokens == seq_len
        summed += metrics["perf/tflops_per_device"] * 1e12 * record.step_time_s
        mfu.append(metrics["perf/mfu_causal"] * record.step_time_s * world_size * peak)
    # float products of exact integers: equal to ~1e-15 relative
    assert summed == pytest.approx(model_flops, rel=1e-12)
    assert mfu == pytest.approx([model_flops] * world_size, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(convention="full"), r"convention='full'\): choose one of \['causal', 'megatron'\]"),
        (dict(peak_flops=0.0), r"peak_flops=0.0\) must be positive"),
        (dict(log_every_n_steps=0), r"log_every_n_steps=0\) must be at least 1"),
    ],
)
def test_monitor_argument_validation(kwargs, message):
    """Invalid MFUMonitor arguments raise ValueError naming the value."""
    with pytest.raises(ValueError, match=message):
        MFUMonitor(**kwargs)


@pytest.mark.gpu
def test_cuda_step_reports_gpu_memory_and_table_peak(tmp_path):
    """On a GPU: peak GPU memory is logged and the peak comes from the table for bf16-mixed."""
    monitor = MFUMonitor()
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, logger=TensorBoardLogger(tmp_path),
        callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TinyLlamaModule(), token_batches(64, 64, 64))
    scalars = read_scalars(trainer)
    assert all(value > 0 for _, value in scalars["perf/peak_gpu_mem_gib"])
    device_name = torch.cuda.get_device_name()
    if any(part in device_name for part in ("H100", "H200", "A100")):
        assert "perf/mfu_causal" in scalars
