"""Hugging Face checkpoint I/O: config.json <-> ModelConfig, HF tensor names <-> ours.

Only safetensors files are read or written (no pickle). The state-dict mappings
are plain functions so that a sharded runtime can reuse them shard by shard.
"""

import json
import os
from collections.abc import Mapping
from contextlib import contextmanager
import re
import shutil
import uuid
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.config import ROPE_SCALINGS, ModelConfig
from models.streaming import LazyTensors, save_tensors
from models.transformer import Transformer
from models.weights import materialize

SUPPORTED_MODEL_TYPES = ("gpt2", "opt", "llama", "qwen2", "qwen3", "mistral", "granite", "olmo2", "smollm3", "gemma2",
                         "gemma3_text")
# Families with LLaMA's layout and tensor names, and transformers' class-name stem of each.
LLAMA_LIKE = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "granite": "Granite",
              "olmo2": "Olmo2", "smollm3": "SmolLM3", "gemma2": "Gemma2", "gemma3_text": "Gemma3"}
# Score models (ModelConfig.num_labels > 0) are saved and loaded as these classes, with the head
# as `score.weight` [num_labels, hidden] on the same base model (transformer. / model.decoder. / model.).
# transformers has no GraniteForSequenceClassification; Gemma 3's text-only one is Gemma3TextForSequenceClassification.
SCORE_CLASSES = {"gpt2": "GPT2ForSequenceClassification", "opt": "OPTForSequenceClassification",
                 **{arch: f"{stem}ForSequenceClassification" for arch, stem in LLAMA_LIKE.items()
                    if arch != "granite"}, "gemma3_text": "Gemma3TextForSequenceClassification"}
# A tokenizer directory as transformers' save_pretrained writes it (the chat template in chat_template.jinja,
# older ones in tokenizer_config.json or chat_template.json, named extras in additional_chat_templates/),
# and generation_config.json (its EOS ids and sampling defaults): data/tokenizer.py saves them together.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _get(hf: dict, source: str, key: str):
    if key not in hf:
        raise ValueError(f"{source}: required key {key!r} is missing")
    return hf[key]


def _require(hf: dict, source: str, key: str, default, supported: tuple):
    """Value of an HF switch we only implement for some settings."""
    value = hf.get(key, default)
    if value not in supported:
        raise ValueError(f"{source}: {key}={value!r} is not supported; supported: {supported}")
    return value


def _flag(hf: dict, source: str, key: str, default: bool) -> bool:
    return _require(hf, source, key, default, (True, False))


_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# hidden_act of the LLaMA-like families -> ModelConfig.gate_activation (gelu_new: GELU's tanh form, computed
# differently, within 1e-6).
_GATE_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Granite's config keys, which are ModelConfig's field names.
GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _gpt2_from_hf(hf: dict, source: str) -> dict:
    _require(hf, source, "scale_attn_weights", True, (True,))
    _require(hf, source, "scale_attn_by_inverse_layer_idx", False, (False,))
    _require(hf, source, "add_cross_attention", False, (False,))
    act = _require(hf, source, "activation_function", "gelu_new", tuple(_ACTIVATIONS))
    d_model = _get(hf, source, "n_embd")
    return dict(n_layer=_get(hf, source, "n_layer"), n_head=_get(hf, source, "n_head"), d_model=d_model,
                d_ff=hf.get("n_inner") or 4 * d_model, max_seq_len=_get(hf, source, "n_positions"),
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=_ACTIVATIONS[act],
                positions="learned", tie_embeddings=_flag(hf, source, "tie_word_embeddings", True), bias=True)


def _opt_from_hf(hf: dict, source: str) -> dict:
    _require(hf, source, "layer_norm_elementwise_affine", True, (True,))
    _require(hf, source, "_remove_final_layer_norm", False, (False,))
    act = _require(hf, source, "activation_function", "relu", tuple(_ACTIVATIONS))
    return dict(n_layer=_get(hf, source, "num_hidden_layers"), n_head=_get(hf, source, "num_attention_heads"),
                d_model=_get(hf, source, "hidden_size"), d_ff=_get(hf, source, "ffn_dim"),
                max_seq_len=_get(hf, source, "max_position_embeddings"), norm="layernorm", norm_eps=1e-5,
                activation=_ACTIVATIONS[act], positions="learned", position_offset=2,
                tie_embeddings=_flag(hf, source, "tie_word_embeddings", True),
                bias=_flag(hf, source, "enable_bias", True), word_embed_proj_dim=hf.get("word_embed_proj_dim"),
                pre_norm=_flag(hf, source, "do_layer_norm_before", True))


def _rope_from_hf(hf: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from transformers 5's rope_parameters or the older rope_theta + rope_scaling."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = dict(hf.get(key) or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor is not supported (RoPE on the whole head only)")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{source}: {key} with rope_type={kind!r} is not supported; supported rope_type values: "
                         f"{('default', *ROPE_SCALINGS)}")
    if kind in ("llama3", "yarn"):  # transformers' default, made explicit
        rope.setdefault("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings", _get(hf, source, "max_position_embeddings")))
    required, optional = ROPE_SCALINGS[kind]
    unknown = [k for k, v in rope.items() if k not in (*required, *optional) and v is not None]
    missing = [k for k in required if rope.get(k) is None]
    if missing or unknown:
        raise ValueError(f"{source}: {key} with rope_type={kind!r}: keys {unknown} are not supported and {missing} "
                         f"are missing; it takes {list(required)} and optionally {list(optional)}")
    return theta, {"rope_type": kind, **{k: v for k, v in rope.items() if v is not None}}


def _gemma3_rope_from_hf(hf: dict, source: str) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling) of Gemma 3's full-attention layers and the RoPE base of its windowed ones, from
    rope_parameters per layer type (transformers 5) or rope_theta, rope_scaling and rope_local_base_freq, with
    Gemma3TextConfig's defaults (1e6 and 1e4). The windowed layers' RoPE must be unscaled."""
    params = hf.get("rope_parameters") or {}
    full = {"rope_type": "default", **(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
    local = {"rope_type": "default", **(params.get("sliding_attention") or {})}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 1e4))
    theta, scaling = _rope_from_hf({**hf, "rope_parameters": full, "rope_scaling": None}, source)
    local_theta, local_scaling = _rope_from_hf({**hf, "rope_parameters": local, "rope_scaling": None}, source)
    if local_scaling is not None:
        raise ValueError(f"{source}: rope_parameters['sliding_attention']={local!r} is not supported; the windowed "
                         f"layers' RoPE must be unscaled (rope_type 'default')")
    return theta, scaling, local_theta


def _layer_types(hf: dict, source: str, sliding: bool) -> None:
    """Every layer must be of one kind (LLaMA, Mistral): they do not mix sliding-window and full-attention layers."""
    want = "sliding_attention" if sliding else "full_attention"
    types = hf.get("layer_types") or []
    if any(t != want for t in types):
        raise ValueError(f"{source}: layer_types={types!r} is not supported; every layer must be {want!r} "
                         f"(transformers' {hf['model_type']} gives every layer the same attention span)")


def _window(hf: dict, source: str) -> int | None:
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ValueError(f"{source}: sliding_window={window!r} must be a positive int or null")
    return window


def _rope_layers(hf: dict, source: str, n_layer: int) -> list[int]:
    """SmolLM3's no_rope_layers (1: the layer has RoPE, 0: it has none), or transformers' default from
    no_rope_layer_interval (every interval-th layer without RoPE)."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"{source}: no_rope_layer_interval={interval!r} must be a positive int")
        flags = [int((i + 1) % interval != 0) for i in range(n_layer)]
    if not isinstance(flags, list) or len(flags) != n_layer or any(f not in (0, 1) for f in flags):
        raise ValueError(f"{source}: no_rope_layers={flags!r} must be a list of {n_layer} flags, 1 for a layer "
                         f"with RoPE and 0 for one without")
    return flags


def _sliding_layers(hf: dict, source: str, n_layer: int, rope_layers: list[int]) -> tuple[int | None, list[int]]:
    """(window, the layers it applies to) of Qwen2, Qwen3, SmolLM3 and Gemma 2 / 3, as transformers 5 builds them:
    layer_types when given, else Gemma 2 slides on every other layer (0, 2, ...), Gemma 3 on all but every
    sliding_window_pattern-th (6), Qwen2 / Qwen3 from layer
    max_window_layers on, SmolLM3 on its layers without RoPE, these two only with use_sliding_window
    (Qwen2 / Qwen3 also drop sliding_window without it)."""
    use = _flag(hf, source, "use_sliding_window", False)
    window = _window(hf, source)
    qwen = hf["model_type"] in ("qwen2", "qwen3")
    if qwen and not use:
        window = None
    types = hf.get("layer_types")
    if types is None:
        start = hf.get("max_window_layers", 28)
        if hf["model_type"] in ("gemma2", "gemma3_text"):
            pattern = hf.get("sliding_window_pattern", 6) if hf["model_type"] == "gemma3_text" else 2
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layer)]
        else:
            types = ["sliding_attention" if window is not None and use and (i >= start if qwen else not rope_layers[i])
                     else "full_attention" for i in range(n_layer)]
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != n_layer or any(t not in kinds for t in types):
        raise ValueError(f"{source}: layer_types={types!r} is not supported; expected a list of {n_layer} of {kinds}")
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if layers and window is None:
        raise ValueError(f"{source}: layer_types={types!r} has sliding_attention layers but no window "
                         f"(sliding_window={hf.get('sliding_window')!r}, use_sliding_window={use!r})")
    return (window, layers) if layers else (None, None)


def _llama_from_hf(hf: dict, source: str) -> dict:
    """LLaMA and its descendants, which share its tensor layout: Qwen2 (q/k/v bias), Qwen3 (q/k norms), Mistral,
    Granite (multipliers), OLMo 2 (norms on the sublayers' outputs, q/k norms over all heads), SmolLM3 (layers
    without RoPE), Gemma 2 (offset norms before and after each sublayer, soft-capping, scaled embeddings), Gemma 3
    (Gemma 2 with per-head q/k norms, its own RoPE on the windowed layers, no caps by default). Qwen2, Qwen3, SmolLM3
    and Gemma 2 / 3 may slide a window over some layers, Mistral over all."""
    model_type = hf["model_type"]
    gemma_types = ("gemma2", "gemma3_text")
    gemma = model_type in gemma_types
    act = _require(hf, source, "hidden_activation" if gemma else "hidden_act", "gelu_pytorch_tanh" if gemma else "silu",
                   tuple(_GATE_ACTIVATIONS))
    if model_type == "gemma3_text":
        theta, rope_scaling, local_theta = _gemma3_rope_from_hf(hf, source)
    else:
        (theta, rope_scaling), local_theta = _rope_from_hf(hf, source), None
    d_model, n_head = _get(hf, source, "hidden_size"), _get(hf, source, "num_attention_heads")
    head_dim = hf.get("head_dim") or {"qwen3": 128, "gemma2": 256, "gemma3_text": 256}.get(model_type)  # their defaults
    n_layer = _get(hf, source, "num_hidden_layers")
    fields = dict(qkv_bias=None, o_bias=None, mlp_bias=None, sliding_window=None)
    if model_type in ("llama", "qwen3", "granite", "olmo2", "smollm3", "gemma2", "gemma3_text"):
        fields["qkv_bias"] = fields["o_bias"] = _flag(hf, source, "attention_bias", False)
    if gemma:
        _require(hf, source, "use_bidirectional_attention", None, (None, False))
        caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)  # the config classes' defaults
        fields.update(output_norm=True, norm_unit_offset=True, embedding_multiplier=d_model ** 0.5,
                      attention_multiplier=hf.get("query_pre_attn_scalar", 256) ** -0.5,
                      attn_logit_softcapping=hf.get("attn_logit_softcapping", caps[0]),
                      final_logit_softcapping=hf.get("final_logit_softcapping", caps[1]),
                      sliding_rope_theta=local_theta)
    if model_type == "olmo2":  # no pre-norms; q_norm / k_norm over the whole projections
        fields.update(pre_norm=False, output_norm=True, qk_norm_per_head=False)
    if model_type in ("llama", "granite", "smollm3"):
        fields["mlp_bias"] = _flag(hf, source, "mlp_bias", False)
    if model_type == "granite":  # GraniteConfig's defaults are 1.0, attention_multiplier's too (not 1 / sqrt(d))
        fields.update({key: hf.get(key, 1.0) for key in GRANITE_MULTIPLIERS})
    if model_type == "qwen2":
        fields["qkv_bias"] = True  # transformers' Qwen2 hard-codes biases on q/k/v, none on o_proj or the MLP
    rope_layers = _rope_layers(hf, source, n_layer) if model_type == "smollm3" else [1] * n_layer
    fields["layers_without_rope"] = [i for i, flag in enumerate(rope_layers) if not flag]
    if model_type in ("qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text"):
        fields["sliding_window"], fields["sliding_window_layers"] = _sliding_layers(hf, source, n_layer, rope_layers)
    else:
        if model_type == "mistral":
            fields["sliding_window"] = _window(hf, source)
        _layer_types(hf, source, sliding=fields["sliding_window"] is not None)
    return dict(n_layer=n_layer, n_head=n_head,
                n_kv_head=hf.get("num_key_value_heads"), d_model=d_model, explicit_head_dim=head_dim,
                d_ff=_get(hf, source, "intermediate_size"), max_seq_len=_get(hf, source, "max_position_embeddings"),
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-5 if model_type == "olmo2" else 1e-6),
                activation="swiglu", gate_activation=_GATE_ACTIVATIONS[act], positions="rope", rope_theta=theta,
                rope_scaling=rope_scaling, qk_norm=model_type in ("qwen3", "olmo2", "gemma3_text"), bias=False,
                tie_embeddings=_flag(hf, source, "tie_word_embeddings", model_type in ("smollm3", *gemma_types)),
                **fields)


_FROM_HF = {"gpt2": _gpt2_from_hf, "opt": _opt_from_hf, **dict.fromkeys(LLAMA_LIKE, _llama_from_hf)}


def _num_labels_from_hf(hf: dict, source: str, model_type: str) -> int:
    """0 for a language model; the label count for a *ForSequenceClassification config.

    Like transformers, the count comes from id2label, else num_labels, else its default of 2
    (older configs left id2label out when it had the default 2 labels).
    """
    architectures = hf.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures):
        return 0
    if architectures != [SCORE_CLASSES.get(model_type)]:
        expected = f"[{SCORE_CLASSES[model_type]!r}]" if model_type in SCORE_CLASSES else "none (no such class)"
        raise ValueError(f"{source}: architectures={architectures!r} is not supported for model_type="
                         f"{model_type!r}; a sequence-classification model must be {expected}")
    id2label = hf.get("id2label")
    if id2label is not None:
        if not isinstance(id2label, dict) or not id2label:
            raise ValueError(f"{source}: id2label={id2label!r} must be a non-empty mapping of label ids to names")
        return len(id2label)
    num_labels = hf.get("num_labels", 2)
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
        raise ValueError(f"{source}: num_labels={num_labels!r} must be a positive int")
    return num_labels


def config_from_hf(hf_config: dict, source: str) -> ModelConfig:
    """ModelConfig from a parsed HF config.json; `source` (the file) is named in every error."""
    model_type = hf_config.get("model_type")
    if model_type not in _FROM_HF:
        raise ValueError(f"{source}: model_type={model_type!r} is not supported; "
                         f"supported model_type values: {SUPPORTED_MODEL_TYPES}")
    fields = _FROM_HF[model_type](hf_config, source)
    fields["num_labels"] = _num_labels_from_hf(hf_config, source, model_type)
    try:
        return ModelConfig(arch=model_type, vocab_size=_get(hf_config, source, "vocab_size"), **fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32, token_ids: dict | None = None) -> dict:
    """config.json contents that transformers.AutoModelForCausalLM loads as the same model
    (AutoModelForSequenceClassification for a score model, config.num_labels > 0).

    token_ids: {"bos_token_id": .., "eos_token_id": .., "pad_token_id": ..} of the tokenizer;
    without them transformers falls back to its class defaults (GPT-2's 50256, whatever the vocab).
    A score model needs pad_token_id: transformers reads the score at the last token that is
    not pad_token_id, and refuses batches of more than one sequence without it.

    Raises ValueError when the config mixes features the HF class cannot express
    (e.g. arch="gpt2" with RMSNorm): it is checked by converting back.
    """
    c = config
    if c.arch == "gpt2":
        hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
              "n_positions": c.max_seq_len, "n_embd": c.d_model, "n_layer": c.n_layer, "n_head": c.n_head,
              "n_inner": c.d_ff, "activation_function": {"gelu_tanh": "gelu_new"}.get(c.activation, c.activation),
              "layer_norm_epsilon": c.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    elif c.arch == "opt":
        hf = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": c.vocab_size,
              "hidden_size": c.d_model, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
              "ffn_dim": c.d_ff, "max_position_embeddings": c.max_seq_len, "word_embed_proj_dim": c.embed_dim,
              "do_layer_norm_before": c.pre_norm, "enable_bias": c.bias, "dropout": 0.0,
              "attention_dropout": 0.0,
              "activation_function": {"gelu_tanh": "gelu_new"}.get(c.activation, c.activation)}
    else:
        hf = {"architectures": [f"{LLAMA_LIKE[c.arch]}ForCausalLM"], "model_type": c.arch, "vocab_size": c.vocab_size,
              "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layer,
              "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim,
              "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
              "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(c.gate_activation, c.gate_activation),
              "rope_theta": c.rope_theta,
              "rope_parameters": {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}}
        if c.arch in ("llama", "qwen3", "granite", "olmo2", "smollm3", "gemma2", "gemma3_text"):
            hf["attention_bias"] = c.has_bias("qkv")
        if c.arch == "gemma3_text":  # RoPE per layer type
            hf.pop("rope_theta")
            hf["rope_parameters"] = {"full_attention": hf["rope_parameters"], "sliding_attention": {
                "rope_type": "default", "rope_theta": c.sliding_rope_theta or c.rope_theta}}
        if c.arch in ("gemma2", "gemma3_text"):
            scalar = round(c.attention_multiplier ** -2, 6) if c.attention_multiplier else c.head_dim
            hf.update(hidden_activation=hf.pop("hidden_act"), query_pre_attn_scalar=int(scalar) if scalar % 1 == 0
                      else scalar, attn_logit_softcapping=c.attn_logit_softcapping,
                      final_logit_softcapping=c.final_logit_softcapping)
        if c.arch in ("llama", "granite", "smollm3"):
            hf["mlp_bias"] = c.has_bias("mlp")
        if c.arch == "granite":
            hf.update({key: getattr(c, key) for key in GRANITE_MULTIPLIERS},
                      attention_multiplier=c.attention_multiplier or c.head_dim ** -0.5)
        if c.arch in ("qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text"):  # layer_types: which layers slide
            hf.update(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                      layer_types=["full_attention" if c.layer_window(i) is None else "sliding_attention"
                                   for i in range(c.n_layer)])
        sliding = [i for i in range(c.n_layer) if c.layer_window(i) is not None]
        if c.arch in ("qwen2", "qwen3") and sliding and sliding == list(range(sliding[0], c.n_layer)):
            hf["max_window_layers"] = sliding[0]  # the same layers for a reader without layer_types
        if c.arch == "smollm3":
            hf["no_rope_layers"] = [int(c.layer_has_rope(i)) for i in range(c.n_layer)]
        if c.arch == "mistral":
            hf["sliding_window"] = c.sliding_window
    hf.update(token_ids or {})
    if c.num_labels:
        if c.arch not in SCORE_CLASSES:
            raise ValueError(f"a score model (num_labels={c.num_labels}) of arch={c.arch!r} cannot be written as a "
                             f"Hugging Face config: transformers has no sequence-classification class for it")
        if hf.get("pad_token_id") is None:
            raise ValueError(f"a score model (num_labels={c.num_labels}) needs token_ids['pad_token_id'] for its "
                             f"Hugging Face config.json: {SCORE_CLASSES[c.arch]} reads the score at the last token "
                             f"that is not pad_token_id; got token_ids={token_ids!r}")
        hf["architectures"] = [SCORE_CLASSES[c.arch]]
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
        hf["label2id"] = {f"LABEL_{i}": i for i in range(c.num_labels)}
    hf["tie_word_embeddings"] = c.tie_embeddings
    hf["dtype"] = str(dtype).removeprefix("torch.")
    hf["torch_dtype"] = hf["dtype"]  # the key's name before transformers 4.56, still read by older tools
    try:
        back = config_from_hf(hf, "config_to_hf")
    except ValueError as e:
        raise ValueError(f"ModelConfig(arch={c.arch!r}) cannot be written as a Hugging Face config: {e}") from e
    if back != c:
        diff = {k: v for k, v in vars(c).items() if getattr(back, k) != v}
        raise ValueError(f"ModelConfig(arch={c.arch!r}) cannot be written as a Hugging Face {c.arch} config: "
                         f"fields {diff} are fixed differently for {c.arch} "
                         f"(an HF {c.arch} model would have {({k: getattr(back, k) for k in diff})})")
    return hf


# ---------------------------------------------------------------------------------------------
# Tensor names: ours <-> HF

_PREFIX = {"gpt2": "transformer.", "opt": "model.decoder.", **dict.fromkeys(LLAMA_LIKE, "model.")}
_LAYERS = {"gpt2": "h", "opt": "layers", **dict.fromkeys(LLAMA_LIKE, "layers")}
_TOP = {
    "gpt2": {"embed.tokens": "wte", "embed.positions": "wpe", "norm": "ln_f"},
    "opt": {"embed.tokens": "embed_tokens", "embed.positions": "embed_positions",
            "embed.project_in": "project_in", "norm": "final_layer_norm", "project_out": "project_out"},
    **dict.fromkeys(LLAMA_LIKE, {"embed.tokens": "embed_tokens", "norm": "norm"}),
}
_BLOCK = {
    "gpt2": {"attn_norm": "ln_1", "attn.o_proj": "attn.c_proj", "mlp_norm": "ln_2",
             "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"},  # q/k/v are fused into attn.c_attn
    "opt": {"attn_norm": "self_attn_layer_norm", "attn.q_proj": "self_attn.q_proj",
            "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
            "attn.o_proj": "self_attn.out_proj", "mlp_norm": "final_layer_norm",
            "mlp.up_proj": "fc1", "mlp.down_proj": "fc2"},
    **dict.fromkeys(LLAMA_LIKE, {
        "attn_norm": "input_layernorm", "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
        "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
        "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj",
        "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}),
}
# OLMo 2 normalises the sublayers' outputs; its post_attention_layernorm is the attention's output norm.
_BLOCK["olmo2"] = {**{k: v for k, v in _BLOCK["llama"].items() if k not in ("attn_norm", "mlp_norm")},
                   "attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
# Gemma 2 normalises both the sublayers' inputs and their outputs.
_BLOCK["gemma2"] = {**_BLOCK["olmo2"], "attn_norm": "input_layernorm", "mlp_norm": "pre_feedforward_layernorm"}
_BLOCK["gemma3_text"] = _BLOCK["gemma2"]
_OLD_BUFFERS = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"
                          r"|model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _head_name(config: ModelConfig) -> str:
    return "score" if config.num_labels else "lm_head"


def _to_hf_name(name: str, config: ModelConfig) -> str:
    arch = config.arch
    module, leaf = name.rsplit(".", 1)
    if module == "head":
        return f"{_head_name(config)}.{leaf}"
    block = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
    if block:
        return f"{_PREFIX[arch]}{_LAYERS[arch]}.{block[1]}.{_BLOCK[arch][block[2]]}.{leaf}"
    return f"{_PREFIX[arch]}{_TOP[arch][module]}.{leaf}"


def _from_hf_name(hf_name: str, config: ModelConfig) -> str | None:
    """Our name for an HF tensor name, or None when it is not part of the model."""
    arch = config.arch
    module, leaf = hf_name.rsplit(".", 1)
    if module == _head_name(config):
        return f"head.{leaf}"
    if not module.startswith(_PREFIX[arch]):
        return None
    module = module[len(_PREFIX[arch]):]
    block = re.fullmatch(rf"{_LAYERS[arch]}\.(\d+)\.(.+)", module)
    names = {hf: ours for ours, hf in (_BLOCK if block else _TOP)[arch].items()}
    ours = names.get(block[2] if block else module)
    if ours is None:
        return None
    return f"blocks.{block[1]}.{ours}.{leaf}" if block else f"{ours}.{leaf}"


def _is_conv1d(name: str, tensor: torch.Tensor, arch: str) -> bool:
    """GPT-2 stores its block matmul weights as Conv1D, i.e. transposed to [in, out]."""
    return arch == "gpt2" and name.startswith("blocks.") and tensor.dim() == 2


def to_hf_state_dict(model_state: dict, config: ModelConfig) -> dict:
    """Our state dict -> HF names and layouts. Transposes are views; call .contiguous() to save.

    Tied LM heads are left out, as HF stores them once (as the token embedding). A score
    model's head becomes `score.weight`, as in transformers' *ForSequenceClassification.
    """
    arch, out = config.arch, {}
    for name, tensor in model_state.items():
        if name == "head.weight" and config.tied_head:
            continue
        if arch == "gpt2" and re.fullmatch(r"blocks\.\d+\.attn\.[qkv]_proj\.(weight|bias)", name):
            continue  # fused below
        out[_to_hf_name(name, config)] = tensor.t() if _is_conv1d(name, tensor, arch) else tensor
    if arch == "gpt2":
        for i in range(config.n_layer):
            for leaf in ("weight", "bias"):
                parts = [model_state.get(f"blocks.{i}.attn.{p}_proj.{leaf}") for p in "qkv"]
                if parts[0] is not None:
                    fused = torch.cat(parts)
                    out[f"transformer.h.{i}.attn.c_attn.{leaf}"] = fused.t() if leaf == "weight" else fused
    return out


def _canonical_hf_name(name: str, config: ModelConfig) -> str | None:
    """Name as *ForCausalLM (or *ForSequenceClassification) saves it, or None for tensors HF
    itself ignores on load.

    Checkpoints saved from the base model (the original gpt2 / opt repos) lack
    the `transformer.` / `model.` prefix; old ones carry non-persistent buffers.
    """
    base = "transformer." if config.arch == "gpt2" else "model."
    if not name.startswith((base, "lm_head.", "score.")):
        name = base + name
    if name == "lm_head.weight" and config.tied_head:
        return None
    if _OLD_BUFFERS.fullmatch(name):
        return None
    return name


def _preview(names: list, limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{f', ... ({len(names) - limit} more)' if len(names) > limit else ''}]"


# ---------------------------------------------------------------------------------------------
# Loading


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from e


def _weight_files(path: Path) -> tuple[list[Path], dict | None]:
    """The safetensors files of a checkpoint dir, and the index weight_map when sharded."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single], None
    if index.is_file():
        weight_map = _get(_read_json(index), str(index), "weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists shard {file.name}, which does not exist in {path}")
        return files, weight_map
    hint = ""
    if any((path / name).exists() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        hint = " (found pytorch_model.bin: pickle checkpoints are not loaded, convert them to safetensors)"
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")


def _open_safetensors(file: Path):
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file}: cannot read safetensors file, it may be truncated or corrupt ({e})") from e


class HFCheckpointWeights:
    """A Hugging Face checkpoint's tensors by our parameter names, read slice by slice
    (models.weights.WeightSource): `read(name, start, end)` reads only the rows of the stored
    tensor that hold elements [start, end) of our flattened parameter, in the checkpoint's dtype.
    GPT-2's transposed Conv1D weights and fused q/k/v are read whole (one tensor at a time) and
    converted. `bytes_read` counts the tensor bytes read so far.

    Opening checks every tensor's name and shape (from the files' headers only) against the
    model `config` implies; nothing is read until `read`.
    """

    def __init__(self, path: Path, config: ModelConfig, config_file: Path):
        self.config, self.bytes_read = config, 0
        files, weight_map = _weight_files(path)
        self._handles = {file: _open_safetensors(file) for file in files}
        self._where: dict[str, tuple[Path, str]] = {}  # canonical HF name -> (file, name in the file)
        shapes = {}
        for file, f in self._handles.items():
            for raw_name in f.keys():
                name = _canonical_hf_name(raw_name, config)
                if name is None:
                    continue
                if name in self._where:
                    raise ValueError(f"tensor {raw_name!r} appears in both {self._where[name][0]} and {file}")
                if weight_map is not None and weight_map.get(raw_name) != file.name:
                    raise ValueError(f"{file}: holds tensor {raw_name!r}, but {path / 'model.safetensors.index.json'} "
                                     f"maps it to {weight_map.get(raw_name)!r}")
                self._where[name] = (file, raw_name)
                shapes[name] = tuple(f.get_slice(raw_name).get_shape())
        with torch.device("meta"), torch.random.fork_rng(devices=[]):  # shapes only: no draw
            expected = to_hf_state_dict(Transformer(config).state_dict(), config)
        missing = [n for n in expected if n not in shapes]
        if missing:
            raise ValueError(f"{path}: missing tensors {_preview(missing)} required by {config_file}")
        unexpected = [f"{n} (in {self._where[n][0].name})" for n in shapes if n not in expected]
        if unexpected:
            raise ValueError(f"{path}: unexpected tensors {_preview(unexpected)} for the model in {config_file}")
        for name, want in expected.items():
            if shapes[name] != tuple(want.shape):
                raise ValueError(f"{self._where[name][0]}: tensor {name!r} has shape {shapes[name]}, "
                                 f"expected {tuple(want.shape)} from {config_file}")

    def _slice(self, hf_name: str):
        file, raw_name = self._where[hf_name]
        return file, self._handles[file].get_slice(raw_name)

    def _read(self, hf_name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) of a stored tensor (all of it by default)."""
        file, piece = self._slice(hf_name)
        try:
            tensor = piece[lo:hi] if lo is not None else piece[:]
        except SafetensorError as e:
            raise ValueError(f"{file}: cannot read tensor {hf_name!r}, the file may be truncated ({e})") from e
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        config = self.config
        name = name.replace(".base.", ".")  # a LoRA-wrapped layer's base weight
        if name == "head.weight" and config.tied_head:
            name = "embed.tokens.weight"
        qkv = re.fullmatch(r"blocks\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)", name) if config.arch == "gpt2" else None
        if qkv:  # GPT-2's fused c_attn, [d, 3d] (Conv1D) or [3d]
            block, which, leaf = qkv.groups()
            fused = self._read(f"transformer.h.{block}.attn.c_attn.{leaf}")
            rows = fused.t() if leaf == "weight" else fused
            i = "qkv".index(which) * config.d_model
            return rows[i:i + config.d_model].reshape(-1)[start:end]
        hf_name = _to_hf_name(name, config)
        shape = self._slice(hf_name)[1].get_shape()
        if config.arch == "gpt2" and name.startswith("blocks.") and len(shape) == 2:  # Conv1D: [in, out]
            return self._read(hf_name).t().reshape(-1)[start:end]
        row = 1
        for n in shape[1:]:
            row *= n
        lo, hi = start // row, -(-end // row)
        if hi <= lo:
            return torch.empty(0, dtype=self._read(hf_name, 0, 0).dtype)
        return self._read(hf_name, lo, hi).reshape(-1)[start - lo * row:end - lo * row]


def hf_model_on_meta(path) -> tuple[Transformer, HFCheckpointWeights]:
    """The Transformer of a Hugging Face model dir (config.json + safetensors, sharded or not) on the
    meta device, and its weights as a source to read slices from (for a sharded runtime, or
    models.weights.materialize). A *ForSequenceClassification dir gives a score model
    (config.num_labels from id2label), its `score.weight` as the head; any other architecture is
    loaded as a language model."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found; expected a Hugging Face model directory")
    config = config_from_hf(_read_json(config_file), str(config_file))
    weights = HFCheckpointWeights(path, config, config_file)
    with torch.device("meta"), torch.random.fork_rng(devices=[]):  # shapes only: no draw
        model = Transformer(config)
    return model, weights


def load_hf_checkpoint(path, dtype: torch.dtype = torch.float32) -> Transformer:
    """A Transformer from a Hugging Face model dir (see hf_model_on_meta), its weights in `dtype`, read
    one tensor at a time (peak: the model plus its largest tensor in the checkpoint's dtype)."""
    model, weights = hf_model_on_meta(path)
    return materialize(model, weights, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Saving


_GPT2_QKV_OURS = re.compile(r"blocks\.(\d+)\.attn\.[qkv]_proj\.(weight|bias)")


def hf_weights(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> LazyTensors:
    """`to_hf_state_dict(weights, config)`, lazily: each HF tensor is converted (contiguous) from the
    parameters it is made of when it is looked up, so a writer that takes one at a time holds one
    (GPT-2's fused c_attn: its block's q, k and v). `weights`: our names -> tensors, a dict or a
    models.streaming.LazyTensors (then each parameter is read when needed)."""
    ours = LazyTensors.of(weights)
    specs = to_hf_state_dict(ours.specs, config)
    sources: dict[str, list[str]] = {}
    for name in ours:
        qkv = _GPT2_QKV_OURS.fullmatch(name) if config.arch == "gpt2" else None
        if qkv:
            sources.setdefault(f"transformer.h.{qkv[1]}.attn.c_attn.{qkv[2]}", []).append(name)
        elif not (name == "head.weight" and config.tied_head):
            sources[_to_hf_name(name, config)] = [name]

    def load(hf_name: str) -> torch.Tensor:
        return to_hf_state_dict({n: ours[n] for n in sources[hf_name]}, config)[hf_name].contiguous()
    return LazyTensors(specs, load)


def _plan_shards(hf_state: dict, max_shard_size: int | None) -> list[list[str]]:
    """Greedy split of tensor names into shards of at most max_shard_size bytes (a bigger tensor goes alone).
    `hf_state`'s values may be meta tensors: only their sizes are read."""
    if max_shard_size is None:
        return [list(hf_state)]
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size} must be a positive number of bytes")
    shards, size = [[]], 0
    for name, tensor in hf_state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_weights(hf_state: LazyTensors, directory: Path, max_shard_size: int | None):
    """The safetensors file(s), and the index when sharded, each file written tensor by tensor
    (models.streaming.save_tensors: the bytes save_file writes, holding one tensor at a time)."""
    shards = _plan_shards(hf_state.specs, max_shard_size)
    weight_map, total = {}, 0
    for i, names in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = LazyTensors({n: hf_state.spec(n) for n in names}, hf_state.__getitem__)
        total += save_tensors(part, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Tokenizer files

# Names looked for when a tokenizer does not say which token ends a document (as data/tokenizer.py).
_WELL_KNOWN_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED = 1, 2, 3, 4  # sentencepiece ModelProto piece types


def _sentencepiece_proto(model_file: Path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(model_file.read_bytes())
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"{model_file} is not a readable SentencePiece model: {e}") from e
    return proto


def sentencepiece_to_fast(model_file) -> tuple[str, dict]:
    """A SentencePiece BPE or unigram model as the files of a transformers fast tokenizer:
    (tokenizer.json text, tokenizer_config.json contents), which `AutoTokenizer` loads as a
    PreTrainedTokenizerFast that encodes text to the same ids as SentencePiece (no BOS/EOS added)
    and decodes them to the same text.

    The model's normalizer (precompiled charsmap, extra whitespace, dummy prefix, whitespace as
    "▁") becomes normalizers; BPE's split into words at whitespace (with
    allow_whitespace_only_pieces, a run of whitespace stays one word) a Split pre-tokenizer; its
    merges are every split of a vocabulary piece into two pieces, ranked by the piece's score, which
    is SentencePiece's merge order; byte fallback is kept. Control and unknown pieces are special
    tokens; SentencePiece never reads them from text, so split_special_tokens keeps transformers
    from doing so. Exact for BPE models (tests/models/test_hf.py); a unigram model's Viterbi ties
    (two segmentations of exactly the same score) may resolve differently. Raises ValueError for
    what does not convert (word or char models, whitespace as a suffix).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    model_file = Path(model_file)
    proto = _sentencepiece_proto(model_file)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    kind = type(trainer).ModelType.Name(trainer.model_type)
    if kind not in ("BPE", "UNIGRAM"):
        raise ValueError(f"{model_file}: model_type {kind} cannot be written as a fast tokenizer (BPE or UNIGRAM)")
    if trainer.treat_whitespace_as_suffix:
        raise ValueError(f"{model_file}: treat_whitespace_as_suffix cannot be written as a fast tokenizer")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = pieces[trainer.unk_id][0]
    if kind == "BPE":
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        parts = {piece for piece, _, t in pieces if t in (_SP_NORMAL, _SP_USER_DEFINED)}
        merges = [(piece[:cut], piece[cut:])
                  for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i][1], i)) if pieces[i][2] == _SP_NORMAL
                  for piece in [pieces[i][0]] for cut in range(1, len(piece))
                  if piece[:cut] in parts and piece[cut:] in parts]
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, byte_fallback=trainer.byte_fallback, fuse_unk=True))
    else:
        tok = Tokenizer(models.Unigram([(piece, score) for piece, score, _ in pieces], trainer.unk_id,
                                       trainer.byte_fallback))
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    if kind == "BPE" and trainer.split_by_whitespace:
        words = "\u2581*[^\u2581]+|\u2581+" if trainer.allow_whitespace_only_pieces else "\u2581[^\u2581]*|[^\u2581]+"
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(words), behavior="isolated")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens([AddedToken(piece, special=True, normalized=False)
                            for piece, _, t in pieces if t in (_SP_CONTROL, _SP_UNKNOWN)])
    tok.add_tokens([AddedToken(piece, normalized=True) for piece, _, t in pieces if t == _SP_USER_DEFINED])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "split_special_tokens": True,
              "clean_up_tokenization_spaces": False, "unk_token": unk}
    for name in ("bos", "eos", "pad"):
        index = getattr(trainer, f"{name}_id")
        if 0 <= index < len(pieces):
            config[f"{name}_token"] = pieces[index][0]
    return tok.to_str(pretty=True), config


def _special_token_ids(tokenizer_dir: Path) -> dict:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} of the tokenizer in `tokenizer_dir`, resolved
    as data/tokenizer.py's load_tokenizer does (tokenizer.json first; a missing pad is the EOS)."""
    ids: dict = {}
    if (tokenizer_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        except Exception:  # the Rust side raises plain Exception; the file is copied as it is, with no ids
            return {}
        configs = [_read_json(tokenizer_dir / name) for name in ("tokenizer_config.json", "special_tokens_map.json")
                   if (tokenizer_dir / name).is_file()]
        for name in ("bos", "eos", "pad"):
            for config in configs:
                token = config.get(f"{name}_token")
                token = token.get("content") if isinstance(token, dict) else token  # a serialized AddedToken
                if isinstance(token, str):
                    ids[name] = tok.token_to_id(token)
                    break
        if ids.get("eos") is None:
            ids["eos"] = next((tok.token_to_id(t) for t in _WELL_KNOWN_EOS if tok.token_to_id(t) is not None), None)
    elif (tokenizer_dir / "tokenizer.model").is_file():
        try:
            trainer = _sentencepiece_proto(tokenizer_dir / "tokenizer.model").trainer_spec
        except ValueError:  # copied as it is, with no ids
            return {}
        ids = {name: getattr(trainer, f"{name}_id") for name in ("bos", "eos", "pad")}
        ids = {name: index if index >= 0 else None for name, index in ids.items()}
    if ids.get("pad") is None:
        ids["pad"] = ids.get("eos")
    return {f"{name}_token_id": ids[name] for name in ("bos", "eos", "pad") if ids.get(name) is not None}


def add_fast_tokenizer(directory) -> None:
    """Where `directory` holds a SentencePiece tokenizer.model and no tokenizer.json, write the fast
    tokenizer files (sentencepiece_to_fast; an existing tokenizer_config.json keeps its other keys),
    so that transformers' AutoTokenizer reads it as we do. A model that does not convert is left
    as it is, with a warning."""
    directory = Path(directory)
    if not (directory / "tokenizer.model").is_file() or (directory / "tokenizer.json").is_file():
        return
    try:
        spec, config = sentencepiece_to_fast(directory / "tokenizer.model")
    except ValueError as e:
        warnings.warn(f"{e}; {directory} holds tokenizer.model only, which transformers may read differently")
        return
    if (directory / "tokenizer_config.json").is_file():
        config = {**_read_json(directory / "tokenizer_config.json"), **config}
    (directory / "tokenizer.json").write_text(spec + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _copy_tokenizer(tokenizer_dir: Path, directory: Path):
    found = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not found:
        raise FileNotFoundError(f"no tokenizer files in {tokenizer_dir}; looked for {TOKENIZER_FILES}")
    for file in found:
        shutil.copy2(file, directory / file.name)
    if (tokenizer_dir / CHAT_TEMPLATE_DIR).is_dir():
        shutil.copytree(tokenizer_dir / CHAT_TEMPLATE_DIR, directory / CHAT_TEMPLATE_DIR)
    add_fast_tokenizer(directory)


def replace_output(tmp: Path, target: Path) -> None:
    """Put the finished `tmp` in place of `target`. A file is swapped atomically; an existing
    directory is moved aside first, then deleted, so the target is never a mix of old and new."""
    if tmp.is_file() or not target.exists():
        os.replace(tmp, target)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old)


@contextmanager
def staged_directory(out_dir: Path):
    """A temporary directory beside `out_dir` to write into; on success it replaces `out_dir`
    (replace_output), on any error it is removed: the output is never half written."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        replace_output(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf_checkpoint(model: Transformer | Mapping[str, torch.Tensor], path, max_shard_size: int | None = None,
                       tokenizer_dir=None, token_ids: dict | None = None, *, config: ModelConfig | None = None):
    """Write `model` as a Hugging Face dir (config.json + safetensors) that transformers loads.

    `model`: a Transformer, or its weights by our names (a state dict, or a
    models.streaming.LazyTensors read one parameter at a time) with `config`. Either way the
    files are written tensor by tensor: the peak is one tensor (plus the model, if it is one).

    A score model (config.num_labels > 0) is written as *ForSequenceClassification and needs
    token_ids["pad_token_id"] (see config_to_hf).

    tokenizer_dir: tokenizer files to copy in (TOKENIZER_FILES: with the chat templates and
    generation_config.json; a SentencePiece tokenizer.model alone also gets a tokenizer.json and
    tokenizer_config.json: sentencepiece_to_fast); token_ids: its special ids for
    config.json, by default the tokenizer's own (its BOS, EOS and pad, the EOS where it has no pad).

    The dir is written beside `path` and renamed into place, so a reader (or a
    crash) never sees a half-written checkpoint; an existing `path` is replaced.
    max_shard_size (bytes) splits the weights into shards with an index file.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if isinstance(model, torch.nn.Module):
        config, weights, dtype = model.config, model.state_dict(), next(model.parameters()).dtype
    else:
        if config is None:
            raise ValueError("save_hf_checkpoint: weights given without their ModelConfig (config=...)")
        weights = LazyTensors.of(model)
        dtype = next(iter(weights.specs.values())).dtype
    if token_ids is None and tokenizer_dir is not None:
        token_ids = _special_token_ids(Path(tokenizer_dir))
    hf_config = config_to_hf(config, dtype, token_ids)  # fails before anything is written
    hf_state = hf_weights(weights, config)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _write_weights(hf_state, tmp, max_shard_size)
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp)
        replace_output(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
