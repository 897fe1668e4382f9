"""The tables of the component benchmarks: the FPDT attention op, the matmul rates, the memory tiles, head-group
chunking, packed documents and the short training steps of bench/smoke_train.py."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from bench.report.markdown import (
    HOST_COLUMNS,
    NONE,
    Record,
    Section,
    gib,
    host_cells,
    length,
    number,
    percent,
    plan_ratio,
)
from bench.report.records import of_kind

Row = tuple[Record, list[str]]


def _heads(record: Record) -> str:
    """The attention geometry: query heads / kv heads × head dim."""
    if record.get("heads") is None:
        return NONE
    return f"{record['heads']}/{record['kv_heads']} heads × {record['head_dim']}"


def _on_off(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value))


def _gib(value: Optional[float]) -> str:
    """GiB as the scripts record them, two decimals."""
    return number(value, 2)


def _attention_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "attention"):
        yield r, [r.get("system", "fpdt"), r["card"], str(r["gpus"]), _heads(r), length(r["seq_len"]),
                  str(r.get("chunks")), _on_off(r["offload"]),
                  "out of memory" if r.get("oom") else number(r.get("step_s"), 3),
                  number(r.get("tflops_per_gpu")), _gib(r.get("peak_extra_gib")), percent(r.get("a2a_share")),
                  number(r.get("host_gib"))]


ATTENTION = Section(
    title="## The FPDT attention op",
    intro="bench/attention.py (system fpdt) and bench/peers/deepspeed_fpdt.py (system deepspeed-fpdt, DeepSpeed's "
          "FPDT layer, whose timed step also runs the QKV projection): forward + backward of the attention op alone, "
          "bf16, causal, batch 1; S is the global length, each GPU holds S / GPUs tokens. TFLOP/s per GPU: causal "
          "forward 2·H·S²·D, forward + backward 3.5 × forward. \"extra GiB\": the peak GPU memory of one forward + "
          "backward minus what the op must hold whatever it does (fpdt: q, k, v, dout in; out, dq, dk, dv out; "
          "deepspeed-fpdt: the layer input, QKV weight, dout in; out and their gradients out). \"a2a\": the share "
          "of the step in the all-to-alls (synchronised around each). \"host GiB\": pinned host memory of the "
          "offloaded chunks.",
    columns=("system", "card", "GPUs", "geometry", "S", "chunks", "offload", "step s", "TFLOP/s per GPU",
             "extra GiB", "a2a", "host GiB"),
    rows=_attention_rows, empty="No attention-op records.",
)


def _slowest_product(record: Record) -> str:
    """The product of the lowest rate: its layer, which product, its TFLOP/s."""
    products = record.get("products") or []
    if not products:
        return NONE
    slowest = min(products, key=lambda p: p["tflops"])
    return f"{slowest['layer']} {slowest['product']} {number(slowest['tflops'])}"


def _gemm_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "gemm"):
        yield r, [r["card"], str(r["gpus"]), r.get("model", NONE), length(r.get("tokens")),
                  length(r.get("head_tokens")), number(r.get("block_tflops")), number(r.get("head_tflops")),
                  _slowest_product(r)]


GEMM = Section(
    title="## Matmul rates",
    intro="bench/gemm.py: bf16 `torch.matmul` of one decoder block's linear layers (q, k, v, o, gate, up, down) at the "
          "local token count and of the lm head (hidden × vocab) at its rows, each as its three products in a step "
          "(forward, input gradient, weight gradient), timed with CUDA events, the median of repeats (with several "
          "GPUs all measure at once, the median over them). \"block\": the block's products together, their FLOPs "
          "over their summed time; the rates the throughput table's \"kernels s\" times the matmuls at.",
    columns=("card", "GPUs", "model", "tokens", "lm head tokens", "block TFLOP/s", "lm head TFLOP/s",
             "slowest product TFLOP/s"),
    rows=_gemm_rows, empty="No matmul-rate records yet: `bench/gemm.py` writes them (kind `gemm`) on a GPU.",
)


def _elementwise_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "elementwise"):
        yield r, [r["card"], str(r["gpus"]), r["op"], length(r["tokens"]), r["dtype"].replace("torch.", ""),
                  *(number(r.get(f"{form}_ms"), 3) for form in ("package_eager", "package_fused", "plain", "compiled",
                                                                 "floor"))]


ELEMENTWISE = Section(
    title="## Elementwise ops of a block",
    intro="bench/elementwise.py: RMSNorm (hidden 4096), RoPE (q and k: 32 and 8 heads of 128) and the SwiGLU product "
          "(intermediate 14336) of one rank's tokens, forward + backward, in milliseconds: the package's ops "
          "(`lightning_fpdt.fused.ops`) with `fused_ops` off (token tiles, fp32 inside) and on (one kernel per pass, "
          "compiled by `torch.compile` from the same formulas), the plain forms Hugging Face writes, and those "
          "compiled whole; \"floor\": the bytes the op must move (inputs read and outputs written once per pass) at "
          "the card's measured copy rate. SwiGLU has no tiled form.",
    columns=("card", "GPUs", "op", "tokens", "dtype", "package ms", "package fused ms", "plain ms", "compiled ms",
             "floor ms"),
    rows=_elementwise_rows, empty="No records of the elementwise ops.",
)


def _memory_tile_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "memory_tiles"):
        geometry = f"hidden {r['hidden']}, MLP {r['intermediate']}, vocab {r['vocab']:,}"
        work = r.get("note") if r.get("peak_gib") is None else _gib(r.get("work_gib"))
        yield r, [r["card"], str(r["gpus"]), geometry, r["case"], length(r["tokens"]), str(r["tiles"]),
                  _gib(r.get("peak_gib")), _gib(r.get("grads_gib")), work or NONE, number(r.get("ms"))]


MEMORY_TILES = Section(
    title="## Memory tiles (TiledLoss, TiledMLP)",
    intro="bench/memory_tiles.py: one loss or MLP forward + backward, bf16. \"grads\": the gradients any loss or MLP "
          "backward leaves (hidden-state and weight gradients); \"work\": the rest of the peak. \"auto=n\": the tile "
          "count the callback chose.",
    columns=("card", "GPUs", "geometry", "case", "tokens", "tiles", "peak GiB", "grads GiB", "work GiB", "ms"),
    rows=_memory_tile_rows, empty="No memory-tile records.",
)


def _versus(row: Record, base: Optional[Record], field: str) -> str:
    if base is None or not row.get(field) or not base.get(field):
        return NONE
    return f"{row[field] / base[field]:.2f}"


def _planned(row: Record) -> str:
    planned = row.get("planner_gib") or {}
    if not planned:
        return NONE
    return f"{planned['attention forward']:.2f} / {planned['attention backward']:.2f}"


def _head_chunk_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "head_chunks"):
        base = {row["case"]: row for row in r["rows"] if row["head_chunks"] == 1 and row["status"] == "ok"}
        for row in r["rows"]:
            peak = _gib(row.get("peak_gib")) if row["status"] == "ok" else "out of memory"
            yield r, [r["card"], str(r["gpus"]), r["geometry"], length(row["seq_len"]), str(r["chunks"]),
                      str(r["offload"]), row["case"], str(row["head_chunks"]), peak,
                      _versus(row, base.get(row["case"]), "peak_gib"), number(row.get("step_s"), 3),
                      _versus(row, base.get(row["case"]), "step_s"), _planned(row)]


HEAD_CHUNKS = Section(
    title="## Head-group chunking",
    intro="bench/head_chunks.py: one decoder layer on one GPU, forward + backward from inputs already on the GPU, its "
          "attention in G head groups. \"attention\": the attention block alone; \"layer\": the whole layer "
          "(TiledMLP, checkpointed as ActivationOffload does). Peak: allocated during the case beyond what was "
          "allocated before it; \"vs G = 1\" within the same run. \"planner\": lightning_fpdt.planner's attention "
          "forward / backward phases for the case.",
    columns=("card", "GPUs", "geometry", "S", "chunks", "offload", "case", "G", "peak GiB", "vs G = 1", "step s",
             "vs G = 1", "planner GiB"),
    rows=_head_chunk_rows, empty="No head-chunking records.",
)


def _packed_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "packed"):
        yield r, [r["card"], str(r["gpus"]), _heads(r), length(r["seq_len"]), str(r["chunks"]),
                  length(r["doc_len"] or None), str(r["documents"]), "yes" if r.get("varlen") else "no",
                  number(r.get("step_s"), 3), str(r.get("kernel_calls")), number(r.get("useful_tflops_per_gpu"))]


PACKED = Section(
    title="## Packed documents",
    intro="bench/packed.py: the attention op alone, forward + backward, on one sequence of S tokens: one document "
          "(mean document –) or documents of random lengths, uniform in [1, 2 × mean). \"useful\" TFLOP/s counts the "
          "attention the documents need, 3.5 × the causal forward of each. \"kernel calls\": block kernel calls of "
          "one forward + backward.",
    columns=("card", "GPUs", "geometry", "S", "chunks", "mean document", "documents", "varlen", "step s",
             "kernel calls", "useful TFLOP/s per GPU"),
    rows=_packed_rows, empty="No packed-document records.",
)


def _smoke_train_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "smoke_train"):
        yield r, [r["card"], str(r["gpus"]), f"{r['model']} ({r['layers']} layers)", length(r["seq_len"]),
                  str(r.get("sequence_parallel_size")), str(r.get("chunks")),
                  ", ".join(r.get("callbacks") or []) or NONE, number(r.get("step_time_s"), 3),
                  number(r.get("tflops_per_gpu")), percent(r.get("mfu")), number(r.get("peak_gib")),
                  number(r.get("states_gib")), number(r.get("peak_minus_states_gib"))]


SMOKE_TRAIN = Section(
    title="## Training steps with the memory callbacks",
    intro="bench/smoke_train.py: a few steps of the reference Llama under FPDTStrategy, bf16-mixed, AdamW; step time "
          "the median after the first step (MFUMonitor), MFU in the causal convention. \"states\": this rank's share "
          "of the fp32 parameters, gradients and AdamW moments (16 bytes per parameter). Callbacks: \"mlp\" TiledMLP, "
          "\"loss\" TiledLoss, \"offload\" ActivationOffload, \"checkpoint\" ActivationOffload without offload.",
    columns=("card", "GPUs", "model", "S", "sp", "chunks", "callbacks", "step s", "TFLOP/s per GPU", "MFU",
             "peak GiB", "states GiB", "peak − states GiB"),
    rows=_smoke_train_rows, empty="No training-step records.",
)

PLANNED_FIELDS = ("chunks", "offload", "offload_dq", "head_chunks", "recompute_attention", "cpu_offload_params")
"""What the page's own plan of a traced run needs from its record (resolved values; ``None`` where a run left an
option at "auto" and its record could not say what it became)."""


def _page_plan(r: Record) -> Any:
    """``plan_memory`` of a traced run with the options it resolved, or ``None`` where one is unknown."""
    from lightning_fpdt.planner import plan_memory, resolve_geometry

    if any(r.get(name) is None for name in PLANNED_FIELDS):
        return None
    return plan_memory(
        geometry=resolve_geometry(r["geometry"], num_layers=r["layers"]), seq_len=r["seq_len"],
        num_gpus=r["gpus"], chunks=r["chunks"], offload=r["offload"], offload_dq=r["offload_dq"],
        head_chunks=r["head_chunks"], recompute_attention=r["recompute_attention"],
        cpu_offload_params=r["cpu_offload_params"], activation_offload=True, tiled_mlp=True, tiled_loss=True,
        precision=r.get("precision", "bf16-mixed"), reload_input=bool(r.get("reload_input")),
        prefetch=1 if r.get("prefetch") is None else r["prefetch"],
        accumulate_grad_batches=r.get("accumulate_grad_batches", 1),
        sync_every_batch=bool(r.get("sync_every_batch")),  # records from before the option: the window's end only
    )


def _trace_options(r: Record) -> str:
    unknown = [name for name in PLANNED_FIELDS if r.get(name) is None]
    options = [f"chunks {r['chunks']}", f"offload {_on_off(r['offload'])}"]
    options += ["offload_dq"] if r["offload_dq"] else []
    options += [f"head_chunks {r['head_chunks']}"] if (r["head_chunks"] or 1) > 1 else []
    options += ["recompute_attention"] if r["recompute_attention"] else []
    options += ["states on the host"] if r["cpu_offload_params"] else []
    options += [f"accumulate_grad_batches {r['accumulate_grad_batches']}"
                + (", synced every batch" if r.get("sync_every_batch") else "")] \
        if r.get("accumulate_grad_batches", 1) > 1 else []
    options += [f"{', '.join(unknown)} unknown"] if unknown else []
    return ", ".join(options)


def _memory_trace_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "memory_trace"):
        plan = _page_plan(r)
        measured = max((p for p in r["peak_gpu_bytes_per_step"] if p is not None), default=None)  # none on CPU
        planned = None if plan is None else plan.peak_gpu_bytes
        yield r, [r["card"], str(r["gpus"]), f"{r['geometry']} ({r['layers']} layers, {r['model']})",
                  length(r["seq_len"]), _trace_options(r), gib(measured, 2), gib(planned, 2),
                  plan_ratio(planned, measured), NONE if plan is None else plan.peak_phase, *host_cells(r, 2),
                  plan_ratio(r.get("planned_peak_gpu_bytes"), measured),
                  plan_ratio(r.get("planned_resident_host_bytes"), r.get("peak_host_rss_bytes"))]


MEMORY_TRACE = Section(
    title="## The memory planner against traced steps",
    intro="python3 -m bench.memory_trace train: training steps under FPDTStrategy with ActivationOffload, TiledMLP "
          "and TiledLoss, bf16-mixed, AdamW (moments primed), the CUDA allocator's history traced. \"measured\": "
          "`torch.cuda.max_memory_allocated` of the last step, rank 0; \"planned\": `plan_memory` with the options "
          "the run resolved, computed by this page's code; its phase is where the plan puts the peak. \"host peak\" "
          "and \"pinned\": rank 0's process in the traced steps. \"run's plan / measured\": the plan the strategy "
          "accepted the run on, as the record carries it, over the measured GPU peak and over the host peak (the "
          "plan's resident bytes per GPU: pinned, pageable and the process baseline).",
    columns=("card", "GPUs", "model", "S", "options", "measured GiB", "planned GiB", "planned / measured",
             "phase", *HOST_COLUMNS, "run's plan / measured GPU", "run's plan / measured host"),
    rows=_memory_trace_rows, empty="No traced steps.",
)

SECTIONS = (ATTENTION, GEMM, ELEMENTWISE, MEMORY_TILES, HEAD_CHUNKS, PACKED, SMOKE_TRAIN, MEMORY_TRACE)
