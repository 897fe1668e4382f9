"""Consolidate a training checkpoint into one file a plain model loads, and export the reference Llama to Hugging
Face format.

    python -m lightning_fpdt.export CHECKPOINT OUT.pt [--hf-dir DIR] [--model llama3-8b --set num_layers=8]

``CHECKPOINT`` is what the fpdt strategy saved: a distributed-checkpoint folder (one shard per rank, any data ×
sequence split) or a single file. ``OUT.pt`` holds ``{"state_dict": {name: tensor}, "hyper_parameters": ...}`` with
the names of the network inside the LightningModule (its attribute prefix, e.g. ``model.``, removed), so
``LlamaForCausalLM(config).load_state_dict(torch.load(OUT.pt)["state_dict"])`` works on one process.
"""

from __future__ import annotations

import argparse
import ast
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import Tensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_fpdt.models.llama import LlamaConfig
from lightning_fpdt.strategy.checkpoint import check_checkpoint_complete, verify_checksums


def load_checkpoint_file(path: Union[str, Path]) -> dict[str, Any]:
    """The whole checkpoint as one dict, gathered from a distributed-checkpoint folder if needed."""
    path = Path(path)
    if not path.is_dir():
        return torch.load(path, map_location="cpu", weights_only=False)
    check_checkpoint_complete(path)
    verify_checksums(path, rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "full.pt")
        checkpoint = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)
    checkpoint.update(torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=False))
    return checkpoint


def consolidate(checkpoint: Union[str, Path], out: Union[str, Path], *, prefix: Optional[str] = None) -> dict[str, Tensor]:
    """Write the network's weights of ``checkpoint`` to the single file ``out`` and return them.

    ``prefix``: the LightningModule attribute holding the network (``"model."``); found by itself when ``None``.
    """
    loaded = load_checkpoint_file(checkpoint)
    state = loaded["state_dict"]
    if prefix is None:
        heads = {name.split(".", 1)[0] for name in state}
        prefix = f"{heads.pop()}." if len(heads) == 1 else ""
    weights = {name[len(prefix):]: tensor.detach().clone() for name, tensor in state.items() if name.startswith(prefix)}
    torch.save({"state_dict": weights, "hyper_parameters": loaded.get("hyper_parameters", {})}, out)
    return weights


def llama_config_from(hyper_parameters: dict[str, Any], name: Optional[str] = None, **overrides: Any) -> LlamaConfig:
    """The reference Llama's config from a LlamaLM checkpoint's hyperparameters (or a named size and overrides)."""
    fields = set(LlamaConfig.__dataclass_fields__)
    name = name or hyper_parameters.get("name")
    if name is None:
        raise ValueError("the checkpoint names no model size: pass --model (e.g. llama3-8b) and --set overrides")
    saved = dict(hyper_parameters.get("config_overrides") or {})
    saved.update({k: v for k, v in hyper_parameters.items() if k in fields})
    return LlamaConfig.from_name(name, **{**saved, **overrides})


def export_llama_to_hf(weights: dict[str, Tensor], config: LlamaConfig, out_dir: Union[str, Path]) -> None:
    """Save the reference Llama's weights as a Hugging Face ``LlamaForCausalLM`` (same names, same RoPE)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    hf_config = HFConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings, hidden_act="silu",
        attention_bias=False, mlp_bias=False,
    )
    model = HFLlama(hf_config)
    state = dict(weights)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not match a Hugging Face Llama: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fpdt.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (distributed) or file saved by the fpdt strategy")
    parser.add_argument("out", help="the single file to write")
    parser.add_argument("--prefix", default=None, help="the LightningModule attribute of the network, e.g. 'model.'")
    parser.add_argument("--hf-dir", default=None, help="also export the reference Llama in Hugging Face format here")
    parser.add_argument("--model", default=None, help="named size when the checkpoint has no hyperparameters")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="config override")
    args = parser.parse_args(argv)
    weights = consolidate(args.checkpoint, args.out, prefix=args.prefix)
    print(f"wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} values) to {args.out}")
    if args.hf_dir:
        overrides = {}
        for item in args.set:
            key, _, value = item.partition("=")
            overrides[key] = ast.literal_eval(value)
        hyper_parameters = torch.load(args.out, weights_only=False)["hyper_parameters"]
        export_llama_to_hf(weights, llama_config_from(hyper_parameters, args.model, **overrides), args.hf_dir)
        print(f"exported a Hugging Face LlamaForCausalLM to {args.hf_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
