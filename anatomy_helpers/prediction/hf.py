"""Hugging Face causal language models for dry runs: their configurations, tiny twins, and the models themselves.

The configurations people fine-tune ship with the package (``hf_configs/*.json``, the public ``config.json`` of
each model on the Hugging Face Hub, source named in docs/references.md), so nothing is downloaded: a model is built
from its configuration alone, on the meta device for a dry run (no weights, no memory) or on the CPU with real
random weights for a tiny twin (:func:`tiny_config`) whose real run is compared with its dry run byte for byte.

``transformers`` (and ``peft`` for LoRA) is an optional extra: ``pip install "anatomy_helpers[hf]"``. This module
imports it only when called, so the rest of the package works without it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import math
from importlib import resources
from pathlib import Path

import torch
import torch.nn as nn

from ..core.checks import one_of

#: Shipped configurations: name -> the Hub repository whose config.json it copies (docs/references.md).
SHIPPED = {
    "gpt2": "openai-community/gpt2",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b-v0.3": "mistralai/Mistral-7B-v0.3",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "gemma-2-2b": "google/gemma-2-2b",
    "phi-3-mini-4k": "microsoft/Phi-3-mini-4k-instruct",
    "phi-3.5-mini": "microsoft/Phi-3.5-mini-instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
}

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
DTYPES = ("float32", "bfloat16", "float16")
INSTALL_HINT = 'Hugging Face models need transformers (and peft for LoRA): pip install "anatomy_helpers[hf]"'


def require_transformers():
    """The ``transformers`` module, or an ImportError saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return transformers


#: The sizes a dry run reads from a configuration, by transformers' common names (a class may keep one under its
#: own name: its ``attribute_map``, e.g. GPT-2's ``n_embd``). A config.json must give each one the architecture's
#: class has a number for: left out, the class's default would be predicted silently (``{"model_type": "llama"}``
#: is a 6.7B-parameter Llama). One whose class default is None is derived from the others (Llama's
#: ``num_key_value_heads``: as many as the query heads; GPT-2's ``n_inner``: 4 x hidden) and may be left out.
SIZE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts_per_tok",
)

#: Where a class without ``max_position_embeddings`` (or an ``attribute_map`` entry for it) keeps its longest
#: sequence: MPT's ``max_seq_len``. BLOOM has none (ALiBi: no position table).
OTHER_POSITION_FIELDS = ("max_seq_len",)


def max_positions(cfg) -> int | None:
    """The longest sequence ``cfg``'s model takes (tokens), or None where the configuration names no limit."""
    for name in ("max_position_embeddings", *OTHER_POSITION_FIELDS):
        limit = getattr(cfg, name, None)
        if isinstance(limit, int):
            return limit
    return None


def _declared_defaults(cls) -> dict:
    """The defaults a configuration class declares for its fields (before it derives any from the others)."""
    if dataclasses.is_dataclass(cls):  # transformers 5.x configurations are dataclasses
        return {f.name: f.default for f in dataclasses.fields(cls)}
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def check_complete(fields: dict, where: str) -> None:
    """ValueError naming the size fields (:data:`SIZE_FIELDS`, and :data:`OTHER_POSITION_FIELDS`) ``fields`` (a
    config.json's) leaves to its class's declared defaults, where the class declares a number for them: the
    prediction would be the defaults' model, not this one. ``where``: what ``fields`` came from, for the message."""
    transformers = require_transformers()
    try:
        cls = type(transformers.AutoConfig.for_model(fields["model_type"]))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    declared, names = _declared_defaults(cls), getattr(cls, "attribute_map", {})
    missing = []
    for name in (*SIZE_FIELDS, *OTHER_POSITION_FIELDS):
        own = names.get(name, name)
        default = declared.get(own, declared.get(name))
        if isinstance(default, int) and not isinstance(default, bool) and name not in fields and own not in fields:
            missing.append(name if own == name else f"{name} ({own})")
    if missing:
        raise ValueError(
            f"{where} leaves out {', '.join(missing)}: {cls.__name__} ({fields['model_type']}) would take its "
            "class's defaults, a model of another size; use the model's complete config.json"
        )


def _not_the_longrope_length_note(record: logging.LogRecord) -> bool:
    return "rope_parameters['original_max_position_embeddings']` field" not in record.getMessage()


def _for_model(fields: dict):
    """``AutoConfig.for_model(**fields)``. Phi-3.5's config.json gives LongRoPE's original length as published, which
    transformers reads with a note (once per process, to stderr) that it prefers a ``factor`` field: that note
    alone is dropped; every other message of that logger passes."""
    transformers = require_transformers()
    log = logging.getLogger("transformers.modeling_rope_utils")
    log.addFilter(_not_the_longrope_length_note)
    try:
        return transformers.AutoConfig.for_model(**fields)
    finally:
        log.removeFilter(_not_the_longrope_length_note)


def _shipped_dict(name: str) -> dict:
    text = resources.files(__package__).joinpath("hf_configs", f"{name}.json").read_text()
    return json.loads(text)


def how_to_get_config(repo: str = "OWNER/NAME") -> str:
    """How to get the config.json of the Hub repository ``repo`` (a model that is not shipped), said once: the
    refusal of :func:`hf_config` (so the CLI's) ends with it."""
    folder = repo.rsplit("/", 1)[-1].lower()
    return (
        f"download its config.json: the 'Files and versions' tab of https://huggingface.co/{repo}, or "
        f"`hf download {repo} config.json --local-dir {folder}` (huggingface_hub's CLI; `huggingface-cli download` "
        "before 0.34), or `AutoConfig.from_pretrained(...).to_json_file('config.json')` on a machine with Hub "
        "access; a gated model (Llama, Gemma) needs its licence accepted on its Hub page first, then a token "
        f"(`hf auth login`, or `--token`); then pass the file or its folder ({folder})"
    )


def shipped_name(model) -> str | None:
    """The shipped configuration ``model`` names (:data:`SHIPPED`): its shipped name or the Hub repository it
    copies (``"Qwen/Qwen2.5-3B"``), either in any case; None for anything else."""
    if not isinstance(model, (str, Path)):
        return None
    key = str(model).lower()
    hub = {repo.lower(): name for name, repo in SHIPPED.items()}
    return key if key in SHIPPED else hub.get(key)


def _hub_name(model) -> tuple[str, ...]:
    """``(model,)`` when it reads as a Hub repository (``owner/name``), else ``()``."""
    parts = str(model).split("/")
    looks = len(parts) == 2 and all(parts) and not str(model).startswith((".", "~")) and parts[1] != "config.json"
    return (model,) if isinstance(model, str) and looks else ()


def hf_config(model):
    """A ``transformers.PretrainedConfig`` from a shipped configuration (:func:`shipped_name`: its name or its Hub
    repository's), a local ``config.json`` (its path, or the folder holding it) or a configuration object (returned
    as it is). Never reads the Hub."""
    transformers = require_transformers()
    if isinstance(model, transformers.PretrainedConfig):
        return model
    name = shipped_name(model)
    if name is not None:
        fields = _shipped_dict(name)
        check_complete(fields, f"the shipped {name}.json")
        return _for_model(fields)
    if isinstance(model, (str, Path)):
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            try:
                fields = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
            if not isinstance(fields, dict) or "model_type" not in fields:
                raise ValueError(f"{path} has no 'model_type': not a transformers config.json")
            check_complete(fields, str(path))
            try:
                return _for_model(fields)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from e
    raise ValueError(
        f"model must be one of the shipped configurations ({', '.join(SHIPPED)}; or the Hub name each copies, "
        f"e.g. {SHIPPED['qwen2.5-3b']}), the path of a local config.json, or a transformers PretrainedConfig; got "
        f"{model!r} (no such file or folder here, and the Hub is never read): {how_to_get_config(*_hub_name(model))}"
    )


def _is_moe(cfg) -> bool:
    return getattr(cfg, "num_local_experts", None) is not None or getattr(cfg, "num_experts", None) is not None


def tiny_config(cfg, *, layers: int = 2, head_dim: int = 8, kv_heads: int = 2, vocab: int = 256, positions: int = 64):
    """The same configuration class with small sizes and the architecture's features kept.

    Kept: the ratio of query to key/value heads (grouped-query attention; 1 for multi-head), a hidden size that is
    not heads x head_dim where the original's is not (Gemma 2), the MLP's width relative to the hidden size, tied
    or untied embeddings, bias and activation choices, dropout, logit softcapping, a sliding window (shrunk to 8
    positions, so a 16-token sequence crosses it), mixture-of-experts top-k (experts cut to 4 at most), Llama 3's
    and LongRoPE's rope scaling (the original length halved; LongRoPE's per-pair factors sampled evenly). Each size
    comes from the original's where it can (head counts: ``kv_heads`` key/value heads, the original ratio of query
    heads to them). Sizes kept under a class's own names (its ``attribute_map``: GPT-2's ``n_head``, BLOOM's
    ``n_layer``, MPT's ``d_model``) are read and written under those; a model with no position limit (BLOOM's
    ALiBi) keeps none. ValueError naming the field where the architecture has no attention heads to keep (Mamba):
    its twin cannot be made, so no dry run of it is checked.
    """
    cfg = hf_config(cfg)
    require_causal_lm(cfg)
    fields = cfg.to_dict()
    heads, layers_orig = getattr(cfg, "num_attention_heads", None), cfg.num_hidden_layers
    if not isinstance(heads, int):
        raise ValueError(
            f"{type(cfg).__name__} ({cfg.model_type}) has no num_attention_heads (nor a field of its own mapped to "
            "it): not an attention model, whose tiny twin keeps its heads, so its dry run cannot be checked and is "
            "not made"
        )
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    ratio = heads // kv
    new_kv = kv if kv == heads else min(kv, kv_heads)  # multi-head attention stays multi-head
    new_kv = min(new_kv, 4)
    new_heads = new_kv * ratio
    orig_head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    extra = cfg.hidden_size - heads * orig_head_dim  # Gemma 2: 2304 = 8 x 256 + 256
    hidden = new_heads * head_dim + (head_dim if extra else 0)
    sizes = {
        "hidden_size": hidden,
        "num_attention_heads": new_heads,
        "num_hidden_layers": min(layers, layers_orig),
        "vocab_size": min(vocab, cfg.vocab_size),
    }
    limit = max_positions(cfg)
    position_field = next((n for n in ("max_position_embeddings", *OTHER_POSITION_FIELDS) if n in fields), None)
    if limit is not None:  # BLOOM (ALiBi) has no limit to shrink
        sizes[position_field or "max_position_embeddings"] = min(positions, limit)
    if "num_key_value_heads" in fields:
        sizes["num_key_value_heads"] = new_kv
    if "head_dim" in fields and fields["head_dim"] is not None:
        sizes["head_dim"] = head_dim
    inner = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
    if inner:  # GPT-2's n_inner=None means 4 x hidden already
        key = "intermediate_size" if "intermediate_size" in fields else "n_inner"
        sizes[key] = 8 * math.ceil(inner / cfg.hidden_size * hidden / 8)
    if getattr(cfg, "sliding_window", None) is not None:
        sizes["sliding_window"] = min(cfg.sliding_window, 8)
    if "max_window_layers" in fields:  # Qwen 2: the first max_window_layers layers use the window (if enabled)
        sizes["max_window_layers"] = sizes["num_hidden_layers"]
    if "query_pre_attn_scalar" in fields:  # Gemma 2 scales queries by its head width
        sizes["query_pre_attn_scalar"] = head_dim
    if "num_local_experts" in fields:
        sizes["num_local_experts"] = min(cfg.num_local_experts, 4)
        sizes["num_experts_per_tok"] = min(cfg.num_experts_per_tok, sizes["num_local_experts"])
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the tiny vocabulary would not embed
        token = fields.get(key)
        if isinstance(token, int) and token >= sizes["vocab_size"]:
            sizes[key] = sizes["vocab_size"] - 1
        elif isinstance(token, list):
            sizes[key] = [t if t < sizes["vocab_size"] else sizes["vocab_size"] - 1 for t in token]
    original = min(positions, limit) // 2 if limit is not None else None
    for key in ("rope_parameters", "rope_scaling"):  # Llama 3's rope scaling: its original length must be shorter
        rope = fields.get(key)
        if isinstance(rope, dict) and rope.get("original_max_position_embeddings") and original is not None:
            sizes[key] = rope = {**rope, "original_max_position_embeddings": original}
            if fields.get("original_max_position_embeddings"):  # Phi-3 keeps it beside rope_parameters too
                sizes["original_max_position_embeddings"] = original
        if isinstance(rope, dict) and isinstance(rope.get("short_factor"), list):  # Phi-3.5's LongRoPE: one factor
            pairs = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2  # per rotated pair, evenly sampled
            sizes[key] = {
                **rope,
                **{f: rope[f][:: len(rope[f]) // pairs][:pairs] for f in ("short_factor", "long_factor")},
            }
    fields.update(sizes)
    fields.pop("layer_types", None)  # derived from the number of layers by the config class itself
    # GPT-2 keeps its sizes under its own names (n_embd, n_layer, ...): the class maps the common ones onto them.
    for common, own in getattr(type(cfg), "attribute_map", {}).items():
        if common in fields and own in fields:
            fields[own] = fields.pop(common)
    if "n_ctx" in fields and limit is not None:
        fields["n_ctx"] = fields.get("n_positions", min(positions, limit))
    return type(cfg)(**fields)


def build_model(
    cfg,
    *,
    attn_implementation: str = "sdpa",
    dtype: str = "float32",
    experts_implementation: str | None = None,
) -> nn.Module:
    """The causal language model of ``cfg`` (anything :func:`hf_config` takes), in training mode.

    Built on torch's default device: under ``torch.device("meta")`` (as a dry run builds it) it holds no memory;
    on the CPU its weights are the architecture's own random initialization (seed torch first). ``dtype``: of
    the weights; ``attn_implementation``: "eager" (attention written out in torch ops) or "sdpa"
    (``scaled_dot_product_attention``); ``experts_implementation`` (mixture-of-experts models): transformers'
    choice when None ("grouped_mm"), or "eager" / "batched_mm".
    """
    transformers = require_transformers()
    cfg = copy.deepcopy(hf_config(cfg))  # from_config writes the implementations it picks into the config
    one_of("attn_implementation", attn_implementation, ATTN_IMPLEMENTATIONS)
    one_of("dtype", dtype, DTYPES)
    kwargs = {"attn_implementation": attn_implementation, "dtype": getattr(torch, dtype)}
    if experts_implementation is not None:
        if not _is_moe(cfg):
            raise ValueError(f"experts_implementation is for mixture-of-experts models; {cfg.model_type} has none")
        kwargs["experts_implementation"] = experts_implementation
    require_causal_lm(cfg)
    model = transformers.AutoModelForCausalLM.from_config(cfg, **kwargs)
    check_causal(model, cfg)
    if getattr(model, "loss_type", None) is None:
        # transformers picks the loss from the class name; GPT2LMHeadModel's names none, so every forward would
        # fall back to ForCausalLM and log that it did (modeling_utils.PreTrainedModel.loss_function): name it
        model.loss_type = "ForCausalLM"
    return model.train()


def require_causal_lm(cfg) -> None:
    """ValueError naming ``cfg``'s class where transformers' causal-LM mapping (AutoModelForCausalLM's) has no model
    class for it (ViT, an image encoder). One in it may still not be causal: :func:`check_causal`."""
    require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # optional extra [hf]

    if type(cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{type(cfg).__name__} ({cfg.model_type}) is not a causal language model transformers knows: "
            "AutoModelForCausalLM has no class for it"
        )


def check_causal(model: nn.Module, cfg) -> None:
    """ValueError naming the architecture where no attention module of ``model`` (built by transformers) is causal:
    transformers' attention modules say which they are (``is_causal``). BERT-like encoders are in transformers'
    causal-LM mapping too (``BertLMHeadModel``), but with ``is_decoder=False`` each token sees the whole sequence:
    a masked LM, whose step is not the causal LM step this course dry-runs. (A decoder's cross-attention is not
    causal either; its causal self-attention is what counts.)"""
    flags = [
        (type(m).__name__, m.is_causal) for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)
    ]
    if flags and not any(causal for _, causal in flags):
        decoder, names = getattr(cfg, "is_decoder", None), ", ".join(sorted({name for name, _ in flags}))
        raise ValueError(
            f"{type(cfg).__name__} ({cfg.model_type}) is not a causal language model: its {names} "
            "attention sees the whole sequence (is_causal=False"
            + (f"; the config has is_decoder={decoder}" if decoder is not None else "")
            + "), so a dry run, which follows a causal LM's fine-tuning step, refuses it"
        )


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model``, each shared (tied) tensor once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def meta_parameters(cfg) -> int:
    """The parameter count of ``cfg``'s model, built on the meta device (no memory)."""
    with torch.device("meta"):
        return count_parameters(build_model(cfg, dtype="bfloat16", attn_implementation="eager"))
