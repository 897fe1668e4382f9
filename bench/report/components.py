"""The tables of the component benchmarks: the FPDT attention op, the memory tiles, head-group chunking, packed
documents and the short training steps of bench/smoke_train.py."""

from __future__ import annotations

from typing import Any, Optional

from bench.report.markdown import NONE, Commands, length, number, percent, table
from bench.report.records import of_kind


def _heads(record: dict[str, Any]) -> str:
    """The attention geometry: query heads / kv heads × head dim."""
    if record.get("heads") is None:
        return NONE
    return f"{record['heads']}/{record['kv_heads']} heads × {record['head_dim']}"


def _on_off(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value))


def _gib(value: Optional[float], digits: int = 2) -> str:
    return number(value, digits)


def attention_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["## The FPDT attention op", "",
             "bench/attention.py: forward + backward of the attention op alone, bf16, causal, batch 1; S is the global "
             "length, each GPU holds S / GPUs tokens. TFLOP/s per GPU: causal forward 2·H·S²·D, forward + backward "
             "3.5 × forward. \"extra GiB\": the peak GPU memory of one forward + backward minus what the op must hold "
             "whatever it does (q, k, v, dout in; out, dq, dk, dv out). \"a2a\": the share of the step in the "
             "all-to-alls (synchronised around each). \"host GiB\": pinned host memory of the offloaded chunks.", ""]
    rows = [[r["card"], str(r["gpus"]), _heads(r), length(r["seq_len"]), str(r.get("chunks")), _on_off(r["offload"]),
             "out of memory" if r.get("oom") else number(r.get("step_s"), 3), number(r.get("tflops_per_gpu")),
             _gib(r.get("peak_extra_gib")), percent(r.get("a2a_share")), number(r.get("host_gib")), *commands.cells(r)]
            for r in of_kind(records, "attention")]
    header = ["card", "GPUs", "geometry", "S", "chunks", "offload", "step s", "TFLOP/s per GPU", "extra GiB", "a2a",
              "host GiB", "cmd", "commit"]
    return lines + table(header, rows, "No attention-op records.")


def _tile_geometry(record: dict[str, Any]) -> str:
    return f"hidden {record['hidden']}, MLP {record['intermediate']}, vocab {record['vocab']:,}"


def memory_tiles_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["## Memory tiles (TiledLoss, TiledMLP)", "",
             "bench/memory_tiles.py: one loss or MLP forward + backward, bf16. \"grads\": the gradients any loss or "
             "MLP backward leaves (hidden-state and weight gradients); \"work\": the rest of the peak. \"auto=n\": the "
             "tile count the callback chose.", ""]
    rows = []
    for r in of_kind(records, "memory_tiles"):
        work = r.get("note") if r.get("peak_gib") is None else _gib(r.get("work_gib"))
        rows.append([r["card"], str(r["gpus"]), _tile_geometry(r), r["case"], length(r["tokens"]), str(r["tiles"]),
                     _gib(r.get("peak_gib")), _gib(r.get("grads_gib")), work or NONE, number(r.get("ms")),
                     *commands.cells(r)])
    header = ["card", "GPUs", "geometry", "case", "tokens", "tiles", "peak GiB", "grads GiB", "work GiB", "ms", "cmd",
              "commit"]
    return lines + table(header, rows, "No memory-tile records.")


def _versus(row: dict[str, Any], base: Optional[dict[str, Any]], field: str) -> str:
    if base is None or not row.get(field) or not base.get(field):
        return NONE
    return f"{row[field] / base[field]:.2f}"


def _planned(row: dict[str, Any]) -> str:
    planned = row.get("planner_gib") or {}
    if not planned:
        return NONE
    return f"{planned['attention forward']:.2f} / {planned['attention backward']:.2f}"


def head_chunks_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["## Head-group chunking", "",
             "bench/head_chunks.py: one decoder layer on one GPU, forward + backward from inputs already on the GPU, "
             "its attention in G head groups. \"attention\": the attention block alone; \"layer\": the whole layer "
             "(TiledMLP, checkpointed as ActivationOffload does). Peak: allocated during the case beyond what was "
             "allocated before it; \"vs G = 1\" within the same run. \"planner\": lightning_fpdt.planner's attention "
             "forward / backward phases for the case.", ""]
    rows = []
    for r in of_kind(records, "head_chunks"):
        base = {row["case"]: row for row in r["rows"] if row["head_chunks"] == 1 and row["status"] == "ok"}
        for row in r["rows"]:
            ok = row["status"] == "ok"
            rows.append([r["card"], str(r["gpus"]), r["geometry"], length(row["seq_len"]), str(r["chunks"]),
                         str(r["offload"]), row["case"], str(row["head_chunks"]),
                         _gib(row.get("peak_gib")) if ok else "out of memory",
                         _versus(row, base.get(row["case"]), "peak_gib"), number(row.get("step_s"), 3),
                         _versus(row, base.get(row["case"]), "step_s"), _planned(row), *commands.cells(r)])
    header = ["card", "GPUs", "geometry", "S", "chunks", "offload", "case", "G", "peak GiB", "vs G = 1", "step s",
              "vs G = 1", "planner GiB", "cmd", "commit"]
    return lines + table(header, rows, "No head-chunking records.")


def packed_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["## Packed documents", "",
             "bench/packed.py: the attention op alone, forward + backward, on one sequence of S tokens: one document "
             "(mean document –) or documents of random lengths, uniform in [1, 2 × mean). \"useful\" TFLOP/s "
             "counts the attention the documents need, 3.5 × the causal forward of each. \"kernel calls\": block "
             "kernel calls of one forward + backward.", ""]
    rows = [[r["card"], str(r["gpus"]), _heads(r), length(r["seq_len"]), str(r["chunks"]),
             length(r["doc_len"] or None), str(r["documents"]), "yes" if r.get("varlen") else "no",
             number(r.get("step_s"), 3), str(r.get("kernel_calls")), number(r.get("useful_tflops_per_gpu")),
             *commands.cells(r)]
            for r in of_kind(records, "packed")]
    header = ["card", "GPUs", "geometry", "S", "chunks", "mean document", "documents", "varlen", "step s",
              "kernel calls", "useful TFLOP/s per GPU", "cmd", "commit"]
    return lines + table(header, rows, "No packed-document records.")


def smoke_train_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["## Training steps with the memory callbacks", "",
             "bench/smoke_train.py: a few steps of the reference Llama under FPDTStrategy, bf16-mixed, AdamW; step "
             "time the median after the first step (MFUMonitor), MFU in the causal convention. \"states\": this rank's "
             "share of the fp32 parameters, gradients and AdamW moments (16 bytes per parameter). Callbacks: \"mlp\" "
             "TiledMLP, \"loss\" TiledLoss, \"offload\" ActivationOffload, \"checkpoint\" ActivationOffload without "
             "offload.", ""]
    rows = [[r["card"], str(r["gpus"]), f"{r['model']} ({r['layers']} layers)", length(r["seq_len"]),
             str(r.get("sequence_parallel_size")), str(r.get("chunks")), ", ".join(r.get("callbacks") or []) or NONE,
             number(r.get("step_time_s"), 3), number(r.get("tflops_per_gpu")), percent(r.get("mfu")),
             number(r.get("peak_gib")), number(r.get("states_gib")), number(r.get("peak_minus_states_gib")),
             *commands.cells(r)]
            for r in of_kind(records, "smoke_train")]
    header = ["card", "GPUs", "model", "S", "sp", "chunks", "callbacks", "step s", "TFLOP/s per GPU", "MFU", "peak GiB",
              "states GiB", "peak − states GiB", "cmd", "commit"]
    return lines + table(header, rows, "No training-step records.")
