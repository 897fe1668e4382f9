"""The speed of light of a training step: how long its kernels would take at the rates the card reached on them alone
(bench/attention.py's attention op, bench/gemm.py's matmuls), beside the step time.

What counts is the work the step must do on each GPU, recomputation left out:

- attention: each layer's causal attention over each sequence, forward and backward, in FPDT's blocks: ``u`` chunks
  of ``C = S / u`` tokens, query chunk ``i`` against key/value chunks ``j <= i``, in full off the diagonal
  (``4·C²·d_attn`` forward: QKᵀ and the weighted sum) and causal on it (half that); the backward 2.5 × the forward,
  as bench/attention.py counts the rates it records (3.5 × the forward in all). The blocks add up to the causal
  ``2·S²·d_attn`` whatever ``u``; systems without chunks are one block of S. Its rate: the attention record of the
  same card whose chunk length is the nearest (then the same GPU count, then the same offload, then the nearest S).
- matmuls: 6 × the non-embedding parameters of the layers run × the tokens, the dense term of
  ``lightning_fpdt.flops.flops_per_token`` (the MFU's count); the lm head's ``6·hidden·vocab`` × tokens of it at
  bench/gemm.py's lm-head rate, the rest at its block rate, from the gemm record of the same card (the same GPU
  count first, then the nearest local token count).

Each is per GPU: the step's FLOPs over the GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Optional

from bench.report.markdown import NONE, Record, length, number, percent
from bench.report.records import of_kind

if TYPE_CHECKING:
    from lightning_fpdt.flops import ModelGeometry

ATTENTION_PASSES = 3.5
"""Forward + backward attention FLOPs over the forward's: the backward 2.5 × the forward (bench/attention.py's count,
which its records' TFLOP/s use; ``lightning_fpdt.flops`` counts 3 × for the MFU)."""


def causal_block_flops(seq_len: float, num_chunks: int, attention_width: int) -> float:
    """Forward FLOPs of one layer's causal attention over one sequence, as FPDT's blocks: ``num_chunks`` ``u`` chunks
    of ``C = S / u`` tokens; ``u (u - 1) / 2`` blocks below the diagonal of ``4·C²·d_attn`` each and ``u`` causal
    ones on it of half that."""
    chunk = seq_len / num_chunks
    full = 4 * chunk * chunk * attention_width  # QKᵀ and the weighted sum, 2·C·C·d_attn each
    return num_chunks * (num_chunks - 1) / 2 * full + num_chunks * full / 2


def run_geometry(record: Record) -> Optional[ModelGeometry]:
    """The geometry of the layers a run ran: its record's, or a named size's (the records of the example configs
    carry only the model's name); ``None`` where neither is known."""
    from lightning_fpdt.flops import ModelGeometry  # imported when a page is made: lightning_fpdt imports Lightning
    from lightning_fpdt.planner import resolve_geometry

    layers, geometry = record.get("layers"), record.get("geometry")
    if not layers:
        return None
    if geometry:
        fields = {field.name for field in dataclasses.fields(ModelGeometry)}
        return ModelGeometry(**{**{k: v for k, v in geometry.items() if k in fields}, "num_layers": layers})
    try:
        return resolve_geometry(record.get("model") or "", num_layers=layers)
    except ValueError:
        return None


def num_chunks(record: Record) -> Optional[int]:
    """``u``, the chunks of a sequence's attention: the fpdt systems' record says; the others are one block;
    ``None`` for a fpdt run whose record does not say."""
    if record.get("system") in ("fpdt", "fpdt-hf"):
        return record.get("chunks")
    return 1


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """The FLOPs one GPU's kernels must run in a step."""

    attention: float
    """Causal attention of the layers run, forward and backward (:data:`ATTENTION_PASSES`), in the run's blocks."""
    layers: float
    """The layers' matmuls: 6 × their non-embedding parameters (and norms) × the tokens."""
    head: float
    """The lm head: 6·hidden·vocab × the tokens."""
    chunk_tokens: float
    """C = S / u, the block size the attention rate is chosen for."""
    local_tokens: float
    """The tokens each GPU's matmuls see, the count the GEMM rate is chosen for."""


def step_flops(record: Record) -> Optional[StepFlops]:
    """The kernels' FLOPs per GPU of a run's step; ``None`` where its record lacks the geometry, the tokens or the
    chunks."""
    geometry, chunks = run_geometry(record), num_chunks(record)
    seq_len, tokens, gpus = record.get("seq_len"), record.get("tokens_per_step"), record.get("gpus")
    if geometry is None or not chunks or not seq_len or not tokens or not gpus:
        return None
    sequences = tokens / seq_len
    attention = (sequences * geometry.num_layers * ATTENTION_PASSES
                 * causal_block_flops(seq_len, chunks, geometry.attention_width))
    head = 6 * geometry.hidden_size * geometry.vocab_size * tokens
    dense = 6 * geometry.nonembedding_parameters * tokens  # flops_per_token's dense term, lm head included
    return StepFlops(attention=attention / gpus, layers=(dense - head) / gpus, head=head / gpus,
                     chunk_tokens=seq_len / chunks, local_tokens=tokens / gpus)


def _nearest(value: float, target: float) -> float:
    """How far two positive sizes are apart, as a ratio: 2× above and 2× below are equally near."""
    return abs(math.log(value / target))


def attention_rate(record: Record, flops: StepFlops, records: list[Record]) -> Optional[Record]:
    """The attention record whose rate the run's attention is timed at: this project's op (not the ring hybrid, not
    DeepSpeed's) on the same card, the chunk length nearest ``C``, then the run's GPU count, then its offload, then
    the nearest length; the latest of equals. ``None`` where the card has none."""
    offload = (record.get("options") or {}).get("offload")
    found = [r for r in of_kind(records, "attention")
             if r.get("card") == record.get("card") and r.get("system", "fpdt") == "fpdt" and (r.get("ring") or 1) == 1
             and not r.get("oom") and r.get("tflops_per_gpu") and r.get("seq_len") and r.get("chunks")]
    return min(reversed(found), default=None, key=lambda r: (
        _nearest(r["seq_len"] / r["chunks"], flops.chunk_tokens), r.get("gpus") != record.get("gpus"),
        r.get("offload") != offload, _nearest(r["seq_len"], record["seq_len"])))


def gemm_rate(record: Record, flops: StepFlops, records: list[Record]) -> Optional[Record]:
    """The gemm record whose rates the run's matmuls are timed at: the same card, then the run's GPU count, then the
    local token count nearest the run's; the latest of equals. ``None`` where the card has none."""
    found = [r for r in of_kind(records, "gemm") if r.get("card") == record.get("card") and r.get("block_tflops")
             and r.get("head_tflops") and r.get("tokens")]
    return min(reversed(found), default=None, key=lambda r: (
        r.get("gpus") != record.get("gpus"), _nearest(r["tokens"], flops.local_tokens)))


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """A step's kernels at the measured rates, per GPU, and the records the rates came from."""

    flops: StepFlops
    """What the kernels must compute."""
    attention_record: Optional[Record]
    """The attention record whose TFLOP/s times the attention (:func:`attention_rate`); ``None``: no rate."""
    gemm_record: Optional[Record]
    """The gemm record whose block and lm-head TFLOP/s time the matmuls (:func:`gemm_rate`); ``None``: no rate."""

    @property
    def attention_s(self) -> Optional[float]:
        if self.attention_record is None:
            return None
        return self.flops.attention / (self.attention_record["tflops_per_gpu"] * 1e12)

    @property
    def matmul_s(self) -> Optional[float]:
        if self.gemm_record is None:
            return None
        return (self.flops.layers / (self.gemm_record["block_tflops"] * 1e12)
                + self.flops.head / (self.gemm_record["head_tflops"] * 1e12))

    @property
    def total_s(self) -> Optional[float]:
        """Attention and matmuls; ``None`` unless both rates are known."""
        if self.attention_s is None or self.matmul_s is None:
            return None
        return self.attention_s + self.matmul_s


def kernel_time(record: Record, records: list[Record]) -> Optional[KernelTime]:
    """The run's :class:`KernelTime`, its rates from ``records``; ``None`` where its FLOPs cannot be counted."""
    flops = step_flops(record)
    if flops is None:
        return None
    return KernelTime(flops, attention_rate(record, flops, records), gemm_rate(record, flops, records))


def _gpus(count: int) -> str:
    return f"{count} GPU" + ("s" if count != 1 else "")


def rates_cell(time: Optional[KernelTime]) -> str:
    """Each part's seconds, its rate in TFLOP/s and the record it came from (the tables of the attention op and of
    the matmul rates list them)."""
    if time is None:
        return NONE
    attention, gemm = time.attention_record, time.gemm_record
    parts = [f"attention {NONE}" if attention is None else
             f"attention {number(time.attention_s, 3)} s at {number(attention['tflops_per_gpu'])} (S "
             f"{length(attention['seq_len'])}, {attention['chunks']} chunks, {_gpus(attention['gpus'])}, offload "
             f"{'on' if attention.get('offload') else 'off'})",
             f"matmuls {NONE}" if gemm is None else
             f"matmuls {number(time.matmul_s, 3)} s at {number(gemm['block_tflops'])}, lm head "
             f"{number(gemm['head_tflops'])} ({length(gemm['tokens'])} tokens, {_gpus(gemm['gpus'])})"]
    return "; ".join(parts)


def light_cells(record: Record, records: list[Record]) -> list[str]:
    """The throughput table's cells: the kernels' seconds, that over the step time, and the rates."""
    time = kernel_time(record, records)
    total = None if time is None else time.total_s
    step = record.get("step_time_s")
    return [number(total, 3), percent(total / step) if total is not None and step else NONE, rates_cell(time)]


LIGHT_COLUMNS = ("kernels s", "of light", "kernel rates TFLOP/s")
"""The columns of :func:`light_cells`."""
LIGHT_NOTE = (
    "\"kernels s\": how long the step's kernels would take on one GPU at the rates the card reached on them alone; "
    "\"of light\": that over the step time. It counts what the step must compute per GPU, recomputation left out. "
    "Attention: the causal attention of the layers run, forward and backward, in the run's blocks (u chunks of "
    "C = S / u tokens: a query chunk against each earlier chunk in full, 4·C²·H·D forward, against itself causal, "
    "half that; the backward 2.5 × the forward, as the attention op's table counts; ring, alst and modelparallel one "
    "block of S), at the TFLOP/s of the attention op's record of the same card with the nearest chunk length (then "
    "the same GPU count, offload and the nearest S): a rate of the whole op, its merges, copies and all-to-alls "
    "included. Matmuls: 6 × the non-embedding parameters of the layers run × the tokens (`lightning_fpdt.flops`, the "
    "MFU's dense term), the lm head's 6·hidden·vocab × tokens at the lm head's rate and the rest at the block's, from "
    "the `bench/gemm.py` record of the same card (under Matmul rates; the same GPU count, then the nearest local "
    "token count; Llama-3-8B's shapes stand for every model). \"kernel rates\": each part's seconds, the TFLOP/s it "
    "was timed at and the record that rate came from; – where the card has no such record, as for the GEMM rates "
    "until `bench/gemm.py` has run on the card."
)
"""What the page says of :data:`LIGHT_COLUMNS`."""


def profile_cells(record: Record, records: list[Record]) -> list[str]:
    """The profile table's cells: the attention's and the matmuls' seconds at the measured rates, beside the
    profiled ones."""
    time = kernel_time(record, records)
    return [NONE, NONE] if time is None else [number(time.attention_s, 3), number(time.matmul_s, 3)]


PROFILE_COLUMNS = ("attention at rate s", "matmul at rate s")
"""The columns of :func:`profile_cells`."""
PROFILE_NOTE = ("\"at rate\": the step's attention and matmuls at the card's measured rates, as \"kernels s\" of the "
                "throughput table counts them (no recomputation; – without a record of the rate), beside the "
                "profiled seconds of those kernels.")
"""What the page says of :data:`PROFILE_COLUMNS`."""
