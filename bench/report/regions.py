"""Figures of other pages generated from the records, as docs/benchmarks.md is: each marked region
``<!-- results:NAME -->`` … ``<!-- /results -->`` of :data:`PAGES` is rewritten from the records by :data:`REGIONS`
(``python3 -m bench.report`` fills them beside the page; ``tests/unit/test_results_regions.py`` checks that the
checked-in pages equal what it would write, so their figures cannot drift from the records). Prose that states a
figure cites docs/benchmarks.md instead."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from bench.report.markdown import NONE, gib, length, number, percent, percent_change, ratio, table
from bench.report.records import by_commit_age, card_name, model_name, of_kind

PAGES = ("README.md", "docs/planner.md", "docs/head_chunks.md")
"""The pages, relative to the repository root, whose figures come from the records."""

REGION = re.compile(r"(<!-- results:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)


def head_chunks(records: list[dict[str, Any]]) -> list[str]:
    """The head-group table of docs/head_chunks.md: peak and step time of each case at ``G = 1`` and the largest
    ``G`` measured, from the latest head-chunking record."""
    runs = of_kind(records, "head_chunks")
    if not runs:
        return ["No head-chunking records."]
    r = runs[-1]
    ok = [row for row in r["rows"] if row["status"] == "ok"]
    groups = max(row["head_chunks"] for row in ok)
    rows = []
    for case in dict.fromkeys(row["case"] for row in ok):
        base = next(row for row in ok if row["case"] == case and row["head_chunks"] == 1)
        top = next(row for row in ok if row["case"] == case and row["head_chunks"] == groups)
        rows.append([case, number(base["peak_gib"], 2),
                     f"{number(top['peak_gib'], 2)} ({percent_change(top['peak_gib'], base['peak_gib'])})",
                     percent_change(top["step_s"], base["step_s"])])
    intro = (f"Measured on one {r['card']} ({r['gpus']} GPU), {r['geometry']}, {length(r['seq_len'])} tokens, chunks "
             f"{r['chunks']}, attention offload {r['offload']}, forward + backward (`bench/head_chunks.py`, commit "
             f"`{r['commit']}`; every G in [benchmarks.md](benchmarks.md#head-group-chunking)):")
    header = ["case", "peak GiB, `G = 1`", f"peak GiB, `G = {groups}`", f"time at `G = {groups}`"]
    return [intro, "", *table(header, rows, "No head-chunking records.")]


@dataclass(frozen=True)
class Headline:
    """One row of the README's measured table: the latest successful run whose fields equal ``match`` (``options.x``
    names a field of the record's options), and where ``against`` is given the run it is compared with."""

    what: str
    match: dict[str, Any]
    against: Optional[dict[str, Any]] = None


def _field(record: dict[str, Any], name: str) -> Any:
    if name.startswith("options."):
        return (record.get("options") or {}).get(name.split(".", 1)[1])
    if name == "card":
        return card_name(record)
    return record.get(name)


def _latest_run(records: list[dict[str, Any]], match: dict[str, Any]) -> Optional[dict[str, Any]]:
    found = [r for r in of_kind(records, "run") if r.get("status") == "ok"
             and all(_field(r, name) == value for name, value in match.items())]
    return max(found, key=by_commit_age) if found else None  # the newest code's last run


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
H100_79, H200_79 = f"{H100}, capped to 79 GiB", f"{H200}, capped to 79 GiB"
GPU_STATES = {"options.cpu_offload_params": False}
HOST_STATES = {"options.cpu_offload_params": True}
HEADLINES = (
    Headline("full depth, Llama-3-8B", dict(system="fpdt", card=H200, gpus=4, model="llama3-8b", layers=32,
                                           seq_len=524288)),
    Headline("longest sequence, 4 H100s, full-depth ballast (host and disk)",
             dict(system="fpdt", card=H100_79, gpus=4, seq_len=4194304, **{"options.ballast": "full"})),
    Headline("ALST, the same protocol and machine (its optimizer on the host)",
             dict(system="alst", card=H100_79, gpus=4, seq_len=1310720, **{"options.ballast": "full"})),
    Headline("the same protocol, 4 GPUs of 79 GiB, states on the GPU", dict(system="fpdt", card=H200_79, gpus=4,
                                                                           seq_len=3145728,
                                                                           **{"options.ballast": "full"})),
    Headline("longest sequence, one H100, Llama-3.2-3B, full-depth ballast",
             dict(system="fpdt-hf", card=H100, gpus=1, model="llama3-3b", seq_len=1703936,
                  **{"options.ballast": "full"})),
    Headline("ALST, the same protocol and card (its states on the host)",
             dict(system="alst", card=H100, gpus=1, model="llama3-3b", seq_len=393216,
                  **{"options.ballast": "full"})),
    Headline("full depth, Llama-3.2-3B, every option auto", dict(system="fpdt-hf", card=H100_79, model="llama3-3b",
                                                                layers=28, seq_len=131072, **GPU_STATES,
                                                                **{"options.keep_inputs": "all"})),
    Headline("the same, 7 of 28 block inputs kept", dict(system="fpdt-hf", card=H100_79, model="llama3-3b",
                                                         layers=28, seq_len=131072, **{"options.keep_inputs": "7"})),
    Headline("the same, states on the host", dict(system="fpdt-hf", card=H100_79, model="llama3-3b", layers=28,
                                                  seq_len=131072, **HOST_STATES)),
    Headline("full depth, Llama-3.2-3B, one H200", dict(system="fpdt-hf", card=H200, model="llama3-3b", layers=28,
                                                        seq_len=524288, held_host_bytes=0)),
    Headline("the same with 50 GiB of the host held: inputs spill to disk (host GiB counts the 50)",
             dict(system="fpdt-hf", card=H200, model="llama3-3b", layers=28, seq_len=524288,
                  held_host_bytes=50 * 2**30, **{"options.offload_dir": True}),
             against=dict(system="fpdt-hf", card=H200, model="llama3-3b", layers=28, seq_len=524288,
                          held_host_bytes=0)),
    Headline("Llama-3.2-3B, full-depth ballast (host and disk)", dict(system="fpdt-hf", card=H200, model="llama3-3b",
                                                                     seq_len=1048576, **{"options.ballast": "full"})),
    Headline("the same at 2M tokens", dict(system="fpdt-hf", card=H200, model="llama3-3b", seq_len=2097152,
                                           **{"options.ballast": "full"})),
    Headline("ALST, the same protocol and card", dict(system="alst", card=H200, gpus=1, model="llama3-3b",
                                                      seq_len=524288, **{"options.ballast": "full"})),
    Headline("Llama-3-8B, full-depth ballast", dict(system="fpdt", card=H200_79, gpus=4, seq_len=1048576,
                                                     **{"options.ballast": "full"})),
    Headline("ALST, the same protocol (its states on the host)", dict(system="alst", card=H200_79, gpus=4,
                                                                      seq_len=1048576, **{"options.ballast": "full"},
                                                                      **HOST_STATES)),
    Headline("against ALST, states on the GPU", dict(system="fpdt-hf", card=H100_79, gpus=4, seq_len=131072,
                                                     **GPU_STATES),
             against=dict(system="alst", card=H100_79, gpus=4, seq_len=131072, **GPU_STATES)),
    Headline("against ALST, states on the host", dict(system="fpdt", card=H100_79, gpus=4, seq_len=131072,
                                                      **HOST_STATES),
             against=dict(system="alst", card=H100_79, gpus=4, seq_len=131072, **HOST_STATES)),
    Headline("against ALST, states on the GPU", dict(system="fpdt-hf", card=H100_79, gpus=4, seq_len=524288,
                                                     **GPU_STATES),
             against=dict(system="alst", card=H100_79, gpus=4, seq_len=524288, **GPU_STATES)),
    Headline("against ALST, states on the host", dict(system="fpdt-hf", card=H100_79, gpus=4, seq_len=524288,
                                                      **HOST_STATES),
             against=dict(system="alst", card=H100_79, gpus=4, seq_len=524288, **HOST_STATES)),
    Headline("states on the host, stepping in the backward", dict(system="fpdt", card=H100, gpus=4, seq_len=131072,
                                                                  **{"options.host_step": "in backward"}),
             against=dict(system="fpdt", card=H100, gpus=4, seq_len=131072, layers=2, **GPU_STATES)),
    *(Headline(f"{seq_len:,} tokens, 8 of 32 layers, against torch's ring context parallelism",
               dict(system="fpdt", card=H100_79, gpus=4, layers=8, seq_len=seq_len, profile_step=None),
               against=dict(system="ring", card=H100_79, gpus=4, layers=8, seq_len=seq_len))
      for seq_len in (32768, 65536)),
    *(Headline(f"{seq_len:,} tokens, 8 of 32 layers + full-depth ballast, Ulysses 4",
               dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len, **{"options.ring_size": 1,
                                                                                      "options.ballast": "full"}))
      for seq_len in (131072, 524288)),
    *(Headline(f"{seq_len:,} tokens, 8 of 32 layers + full-depth ballast: all-to-alls in head pieces and the tiled "
               f"MLP's sums in the matmul, against the code before them in the same run",
               dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len, commit="50f4731",
                    profile_step=None),
               against=dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len, commit="e979d38",
                            profile_step=None))
      for seq_len in (32768, 65536)),
    Headline("131,072 tokens, the same: the tiled MLP's sums in the matmul, against head pieces alone in the same run",
             dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=131072, commit="dcf47f2", profile_step=None),
             against=dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=131072, commit="6661ef2",
                          profile_step=None)),
    *(Headline(f"{seq_len:,} tokens, 8 of 32 layers, against {name} on the same machine, one after the other",
               dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len, commit="6dd06da",
                    profile_step=None),
               against=dict(system=system, card=H200_79, gpus=4, layers=8, seq_len=seq_len, commit="6dd06da"))
      for system, name, lengths in (("ring", "torch's ring context parallelism", (32768, 65536)),
                                    ("alst", "DeepSpeed ALST", (32768, 65536, 131072)))
      for seq_len in lengths),
    *(Headline(f"{seq_len:,} tokens, the same: {what}, against the code before {it} in the same run",
               dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len, commit=new, profile_step=None,
                    **steps),
               against=dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len, commit=old,
                            profile_step=None, **steps))
      for what, it, new, old, lengths, steps in (
          ("the GPU's optimizer step in the backward and the first all-gathers started with the batch", "them",
           "f2ea3ae", "2ebad40", (32768,), dict(steps=12)),
          ("the all-to-all's layout copies 16 bytes wide", "it", "38d34bd", "f2ea3ae", (32768, 65536), {}))
      for seq_len in lengths),
    Headline("32,768 tokens, the same, against torch's ring context parallelism in the same run (fpdt's second step "
             "profiled)",
             dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=32768, commit="38d34bd"),
             against=dict(system="ring", card=H200_79, gpus=4, layers=8, seq_len=32768, commit="38d34bd")),
    *(Headline(f"the same at {seq_len:,}, ring 2 × Ulysses 2",
               dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len, **{"options.ring_size": 2}),
               against=dict(system="fpdt", card=H200_79, gpus=4, layers=8, seq_len=seq_len,
                            **{"options.ring_size": 1}))
      for seq_len in (131072, 524288)),
    Headline("14 query heads over 4 GPUs (4, 4, 3, 3 a rank): Qwen2.5-0.5B against a 16-head twin",
             dict(system="fpdt-hf", card=H200_79, gpus=4, model="qwen2.5-0.5b", seq_len=131072,
                  sequence_parallel_size=4),
             against=dict(system="fpdt-hf", card=H200_79, gpus=4, model="qwen2.5-0.5b-16h", seq_len=131072,
                          sequence_parallel_size=4)),
    Headline("a Hugging Face family beside Llama: Qwen3-4B", dict(system="fpdt-hf", card=H100, model="qwen3-4b",
                                                                  seq_len=131072),
             against=dict(system="fpdt-hf", card=H100, model="llama3-3b", layers=2, seq_len=131072)),
    Headline("a mixture of experts beside Llama: Mixtral-8x7B", dict(system="fpdt-hf", card=H200, model="mixtral-8x7b",
                                                                     seq_len=131072),
             against=dict(system="fpdt-hf", card=H200, model="llama3-3b", layers=2, seq_len=131072)),
)
"""The README's measured runs, each the latest record of its kind."""


def measured(records: list[dict[str, Any]]) -> list[str]:
    """The README's table of headline runs, from the records (each figure with its card, geometry and commit; every
    run's command in docs/benchmarks.md). Against another run: that run's step time over this one's."""
    rows = []
    for headline in HEADLINES:
        r = _latest_run(records, headline.match)
        if r is None:
            continue
        peer = _latest_run(records, headline.against) if headline.against else None
        versus = NONE if peer is None else (f"{ratio(peer.get('step_time_s'), r.get('step_time_s'))} "
                                            f"({peer['system']}, {number(peer.get('step_time_s'), 3)} s)")
        step = number(r.get("step_time_s"), 3) + ("" if r.get("timed_steps", 1) else " (first step)")
        full = r.get("full_depth") or {}
        if full.get("step_time_s"):
            step += f"; full depth about {number(full['step_time_s'], 0)} (estimate)"
        rows.append([headline.what, r["system"], card_name(r), str(r.get("gpus")), model_name(r),
                     length(r.get("seq_len")), step, number(r.get("tokens_per_s"), 0), percent(r.get("mfu")),
                     gib(r.get("peak_gpu_bytes")), gib(r.get("peak_host_rss_bytes")), versus, f"`{r['commit']}`"])
    header = ["run", "system", "card", "GPUs", "model (layers run)", "S", "step s", "tokens/s", "MFU", "GPU GiB",
              "host GiB", "against", "commit"]
    return table(header, rows, "No runs recorded.")


REGIONS: dict[str, Callable[[list[dict[str, Any]]], list[str]]] = {"head_chunks": head_chunks, "measured": measured}
"""Each region's renderer: the records in, the region's lines out."""


def fill(text: str, records: list[dict[str, Any]]) -> str:
    """``text`` with every marked region rewritten from ``records``; ``ValueError`` for a region no renderer knows."""
    def rendered(match: re.Match) -> str:
        name = match["name"]
        if name not in REGIONS:
            raise ValueError(f"unknown results region {name!r}: bench/report/regions.py renders {sorted(REGIONS)}")
        return match.group(1) + "\n".join(REGIONS[name](records)) + "\n" + match.group(4)
    return REGION.sub(rendered, text)


def fill_pages(root: Path, records: list[dict[str, Any]]) -> list[str]:
    """Rewrite the regions of :data:`PAGES` under ``root``; the pages that changed."""
    changed = []
    for page in PAGES:
        path = root / page
        text = path.read_text()
        filled = fill(text, records)
        if filled != text:
            path.write_text(filled)
            changed.append(page)
    return changed
