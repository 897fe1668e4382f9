"""Consolidate a training checkpoint into one file a plain model loads, and export it as a Hugging Face model folder.

    python -m lightning_fpdt.export CHECKPOINT OUT.pt [--hf-dir DIR] [--model NAME_OR_PATH --set FIELD=VALUE]

``CHECKPOINT`` is what the fpdt strategy saved: a distributed-checkpoint folder (one shard per rank, any data ×
sequence split) or a single file. ``OUT.pt`` holds ``{"state_dict": {name: tensor}, "hyper_parameters": ...}`` with
the names of the network inside the LightningModule (its attribute prefix, e.g. ``model.``, removed), so
``LlamaForCausalLM(config).load_state_dict(torch.load(OUT.pt)["state_dict"])`` works on one process.

``--hf-dir`` writes a folder ``from_pretrained`` loads: for an ``HFCausalLM`` checkpoint, the model it was trained
from (its ``model_name_or_path`` and ``config_overrides`` hyperparameters) with the trained weights, and that
model's tokenizer and generation config when it has them; for a ``LlamaLM`` checkpoint, the reference Llama as a
``LlamaForCausalLM``.

A model trained with adapters (a ``peft`` ``PeftModel``) is saved from the live model after ``fit`` by
:func:`save_adapters`: on every rank, the adapters as a folder ``PeftModel.from_pretrained`` loads, or with
``merged=True`` the base model with the adapters merged into its weights, a folder ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import ast
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_fpdt.integrations.adapters import whole_on_cpu
from lightning_fpdt.lightning_private import _METADATA_FILENAME
from lightning_fpdt.models.llama import NAMED_CONFIGS, LlamaConfig
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


def consolidate(
    checkpoint: Union[str, Path], out: Union[str, Path], *, prefix: Optional[str] = None
) -> dict[str, Tensor]:
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
        raise ValueError(
            "the checkpoint names no model: pass --model, either a named size of the reference Llama (e.g. llama3-8b, "
            "with --set overrides) or the Hugging Face model it was trained from (its folder or Hub name)"
        )
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


def hf_source(hyper_parameters: dict[str, Any], model: Optional[str] = None) -> Optional[str]:
    """The Hugging Face model (Hub name or folder) an ``HFCausalLM`` checkpoint was trained from: ``model`` when given
    and not a named size of the reference Llama, else the checkpoint's ``model_name_or_path``; ``None`` for a
    reference Llama checkpoint."""
    if model is not None:
        return None if model in NAMED_CONFIGS else model
    source = hyper_parameters.get("model_name_or_path")
    return str(source) if source else None


def export_hf_model(weights: dict[str, Tensor], out_dir: Union[str, Path], *, source: str,
                    config_overrides: Optional[dict[str, Any]] = None, trust_remote_code: bool = False) -> list[str]:
    """Write ``weights`` (an ``HFCausalLM``'s network) as a Hugging Face model folder of the model ``source`` (with
    ``config_overrides``), with ``source``'s tokenizer and generation config when it has them. Returns what was
    written besides the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **(config_overrides or {}))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"the checkpoint was trained from the Hugging Face model {source!r}, whose config cannot be read now "
            f"({str(error).splitlines()[0]}): pass --model with the folder (or Hub name) of that model"
        ) from error
    with torch.device("meta"):  # no random init of a model whose every weight is replaced
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    tied = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}
    missing = [name for name in missing if name not in tied]
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's weights do not match {type(model).__name__} of {source}: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}; pass --model with the model the checkpoint was trained from"
        )
    model.save_pretrained(out_dir)  # RoPE's buffers stay on the meta device: not saved, from_pretrained computes them
    written = [f"{type(model).__name__} of {source}"]
    try:
        AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(out_dir)
        written.append("its tokenizer")
    except (OSError, ValueError, TypeError):
        written.append("no tokenizer (the source has none)")
    try:
        GenerationConfig.from_pretrained(source).save_pretrained(out_dir)
        written.append("its generation config")
    except (OSError, ValueError):
        pass  # a model without one generates with the defaults
    return written


def adapter_model(module: nn.Module) -> nn.Module:
    """The ``peft`` ``PeftModel`` in ``module`` (itself or one of its submodules); ``ValueError`` when there is none."""
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = None  # noqa: N806
    found = [m for m in module.modules() if PeftModel is not None and isinstance(m, PeftModel)]
    if len(found) != 1:
        raise ValueError(
            f"save_adapters saves one peft PeftModel's adapters; {type(module).__name__} holds {len(found)}: pass the "
            f"PeftModel itself (get_peft_model's result), or save the whole model with a checkpoint and "
            f"python -m lightning_fpdt.export"
        )
    return found[0]


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every entry of ``model``'s state dict whole, on the CPU: FSDP2's sharded parameters all-gathered. Collective
    when the model is sharded: every rank calls it."""
    return {name: whole_on_cpu(value) for name, value in model.state_dict().items()}


def save_adapters(module: nn.Module, directory: Union[str, Path], *, merged: bool = False,
                  is_main_process: Optional[bool] = None) -> Path:
    """Save the adapters of the ``peft`` ``PeftModel`` in ``module`` (trained under the fpdt strategy or not) as a
    folder ``PeftModel.from_pretrained(base_model, directory)`` loads; with ``merged=True`` the base model with the
    adapters merged into its weights, a folder ``AutoModelForCausalLM.from_pretrained(directory)`` loads (its config
    back on SDPA attention and the KV cache). Returns ``directory``.

    Call it on every rank after ``fit``: FSDP2's shards are all-gathered (a collective), and one process writes
    (``is_main_process``; ``None``: global rank 0). After ``fit`` the model's own ``save_pretrained`` writes the
    adapters the strategy gathered at its end (:mod:`lightning_fpdt.integrations.adapters`); this also covers what
    that keeps nothing of, and merged weights."""
    import torch.distributed as dist

    peft_model = adapter_model(module)
    if is_main_process is None:
        is_main_process = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    directory = Path(directory)
    state = full_state_dict(peft_model)
    if not is_main_process:
        return directory
    if not merged:
        peft_model.save_pretrained(str(directory), state_dict=state)
        return directory
    merged_model(peft_model, state).save_pretrained(str(directory))
    return directory


def merged_model(peft_model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """A plain copy of ``peft_model`` on the CPU holding ``state`` (its whole state dict), the adapters merged into
    the base weights (``merge_and_unload``)."""
    import copy

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = peft_model.get_base_model()
    config = copy.deepcopy(base.config)
    config._attn_implementation = "sdpa"  # the strategy switched the model to "fpdt", which needs its mesh
    config.use_cache = True  # the strategy turns the cache off for training; generation wants it
    with torch.device("meta"):  # no random init of a model whose every weight is replaced
        plain = AutoModelForCausalLM.from_config(config)
    name = peft_model.active_adapter
    copy_model = get_peft_model(plain, copy.deepcopy(peft_model.peft_config[name]), adapter_name=name)
    missing, unexpected = copy_model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"the adapters' model does not rebuild from its config: missing {missing[:8]}, unexpected "
                         f"{unexpected[:8]}")
    copy_model.get_base_model().tie_weights()
    return copy_model.merge_and_unload()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fpdt.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (distributed) or file saved by the fpdt strategy")
    parser.add_argument("out", help="the single file to write")
    parser.add_argument("--prefix", default=None, help="the LightningModule attribute of the network, e.g. 'model.'")
    parser.add_argument("--hf-dir", default=None, help="also write a Hugging Face model folder (from_pretrained) here")
    parser.add_argument("--model", default=None, help="the model when the checkpoint does not name it: a named size of "
                        "the reference Llama (llama3-8b) or the Hugging Face model trained (folder or Hub name)")
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
        source = hf_source(hyper_parameters, args.model)
        if source is not None:
            overrides = {**(hyper_parameters.get("config_overrides") or {}), **overrides}
            written = export_hf_model(weights, args.hf_dir, source=source, config_overrides=overrides,
                                      trust_remote_code=bool(hyper_parameters.get("trust_remote_code")))
            print(f"exported {', '.join(written)} to {args.hf_dir}")
        else:
            export_llama_to_hf(weights, llama_config_from(hyper_parameters, args.model, **overrides), args.hf_dir)
            print(f"exported a Hugging Face LlamaForCausalLM to {args.hf_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
