"""Model configuration: one dataclass describes GPT-2, OPT, LLaMA (1-3), Qwen2/2.5, Qwen3, Mistral, Granite,
OLMo 2, SmolLM3, Gemma 2 and Gemma 3 (text).

The families differ only in a handful of switches (norm type and placement, activation, position scheme,
RoPE scaling and the layers without RoPE, biases, q/k norms, sliding window and its layers, Granite's
multipliers, Gemma's soft-capping, tying), so a single decoder implementation driven by `ModelConfig` covers
all of them.
"""

import dataclasses
from dataclasses import dataclass

ARCHS = ("gpt2", "opt", "llama", "qwen2", "qwen3", "mistral", "granite", "olmo2", "smollm3", "gemma2", "gemma3_text")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu_tanh", "relu", "swiglu")
GATE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # on gate_proj of the gated MLP: SwiGLU, GeGLU (erf or tanh GELU)
POSITIONS = ("learned", "rope")
# RoPE scalings (transformers' rope_type) -> (required parameters, optional parameters). "dynamic" NTK scales
# the base with the running sequence's length beyond max_seq_len (transformers' max_position_embeddings).
ROPE_SCALINGS = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
}


@dataclass(kw_only=True)
class ModelConfig:
    arch: str  # "gpt2" | "opt" | "llama": selects the Hugging Face name mapping
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int | None = None  # None -> n_head; fewer means grouped-query attention
    # Per-head width when it is not d_model / n_head (Qwen3, Gemma, Mistral-Nemo); None (kept None when equal)
    # -> d_model // n_head. Read it as `head_dim`.
    explicit_head_dim: int | None = None
    d_model: int
    d_ff: int
    max_seq_len: int
    norm: str  # "layernorm" | "rmsnorm"
    norm_eps: float
    norm_unit_offset: bool = False  # the RMSNorms scale by 1 + weight, in fp32, their weights starting at 0 (Gemma)
    activation: str  # "gelu_tanh" | "relu" | "swiglu" (the gated MLP: gate_proj, up_proj, down_proj)
    gate_activation: str = "silu"  # the gated MLP's activation (GATE_ACTIVATIONS); "silu" where it has none
    positions: str  # "learned" | "rope"
    position_offset: int = 0  # OPT reserves 2 rows at the start of its position table
    rope_theta: float = 10000.0
    # None: plain RoPE. Else {"rope_type": one of ROPE_SCALINGS, and its parameters}, as transformers' rope_parameters.
    rope_scaling: dict | None = None
    tie_embeddings: bool
    bias: bool  # biases on the linear layers (GPT-2/OPT yes, LLaMA no), except where one of the three below differs
    # None follows `bias`. Kept canonical (`bias` is what most of the three have, only the odd one is set), so that
    # equal models compare equal, configs saved before these fields existed included. Read them with has_bias().
    qkv_bias: bool | None = None  # q/k/v projections (Qwen2: True while o_proj and the MLP have none)
    o_bias: bool | None = None  # attention output projection
    mlp_bias: bool | None = None  # MLP projections
    qk_norm: bool = False  # RMSNorm on the queries and keys before RoPE (Qwen3, OLMo 2)
    # True: over each head's head_dim (Qwen3). False: over the whole q (and k) projection, all heads together
    # (OLMo 2). Kept True without qk_norm.
    qk_norm_per_head: bool = True
    # Each query attends to the last `sliding_window` positions only (itself included); None: the whole prefix.
    sliding_window: int | None = None
    # The layers (indices) the window applies to; None: every layer (Mistral). Kept None when it is all of them.
    sliding_window_layers: list[int] | None = None
    layers_without_rope: list[int] | None = None  # layers whose attention has no RoPE (SmolLM3); None: none
    # The windowed layers' RoPE base, unscaled, where it is not rope_theta / rope_scaling's (Gemma 3's local layers);
    # None: every layer has the same RoPE. Kept None where no layer has a window or it is the same.
    sliding_rope_theta: float | None = None
    word_embed_proj_dim: int | None = None  # OPT: token embedding width when != d_model
    pre_norm: bool = True  # a norm on each sublayer's input. False with output_norm False: post-LN blocks (OPT-350m)
    output_norm: bool = False  # a norm on each sublayer's output, before the residual add (OLMo 2, without pre_norm)
    # Granite's scalings; these defaults leave every other family as it is.
    embedding_multiplier: float = 1.0  # the token embeddings are multiplied by it
    residual_multiplier: float = 1.0  # each sublayer's output is multiplied by it before the residual add
    attention_multiplier: float | None = None  # the attention scores' scale; None: 1 / sqrt(head_dim)
    logits_scaling: float = 1.0  # the LM head's logits are divided by it
    # Gemma 2: scores and the LM head's logits squashed into (-cap, cap) by cap * tanh(x / cap); None: not capped.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # 0: LM head over the vocabulary. n > 0: a scoring head (reward / value model) of n outputs
    # per token, never tied to the token embedding, whatever tie_embeddings says.
    num_labels: int = 0

    def __post_init__(self):
        # Normalise the "same as" defaults so that equal models compare equal.
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.word_embed_proj_dim == self.d_model:
            self.word_embed_proj_dim = None
        if self.explicit_head_dim is not None and self.n_head and self.explicit_head_dim * self.n_head == self.d_model:
            self.explicit_head_dim = None
        self._canonical_biases()
        if not self.qk_norm:
            self.qk_norm_per_head = True
        if self.attention_multiplier == (self.head_dim if self.n_head else 1) ** -0.5:
            self.attention_multiplier = None
        for name, allowed in (("arch", ARCHS), ("norm", NORMS), ("activation", ACTIVATIONS),
                              ("gate_activation", GATE_ACTIVATIONS), ("positions", POSITIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"ModelConfig.{name}={value!r} is not supported; expected one of {allowed}")
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
        for name in ("tie_embeddings", "bias", "pre_norm", "output_norm", "qk_norm", "qk_norm_per_head",
                     "norm_unit_offset"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} must be a bool")
        for name in ("qkv_bias", "o_bias", "mlp_bias"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} must be a bool or None (follow `bias`)")
        for name in ("explicit_head_dim", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int or None")
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                     "attn_logit_softcapping", "final_logit_softcapping", "sliding_rope_theta"):
            value = getattr(self, name)
            if not (value is None and name in ("attention_multiplier", "attn_logit_softcapping",
                                               "final_logit_softcapping", "sliding_rope_theta")) and (
                    not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf")):
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive number")
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ValueError(f"ModelConfig.norm_unit_offset=True needs norm='rmsnorm', not {self.norm!r}")
        if self.gate_activation != "silu" and self.activation != "swiglu":
            raise ValueError(f"ModelConfig.gate_activation={self.gate_activation!r} needs the gated MLP "
                             f"(activation='swiglu'), not activation={self.activation!r}")
        self._canonical_layers()
        if self.sliding_window is None or (self.sliding_rope_theta == self.rope_theta and self.rope_scaling is None):
            self.sliding_rope_theta = None
        if self.explicit_head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"ModelConfig.d_model={self.d_model} must be divisible by n_head={self.n_head} "
                             f"(or set explicit_head_dim)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"ModelConfig.n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_scaling is not None:
            self._check_rope_scaling()
        if self.position_offset < 0:
            raise ValueError(f"ModelConfig.position_offset={self.position_offset} must be >= 0")
        if not isinstance(self.num_labels, int) or isinstance(self.num_labels, bool) or self.num_labels < 0:
            raise ValueError(f"ModelConfig.num_labels={self.num_labels!r} must be an int >= 0 (0: LM head over the "
                             f"vocabulary, n > 0: a scoring head with n outputs)")

    def _canonical_biases(self):
        """One spelling per model: `bias` is what most of qkv / o / mlp have, the overrides name the rest."""
        parts = ("qkv_bias", "o_bias", "mlp_bias")
        values = [self.bias if getattr(self, p) is None else getattr(self, p) for p in parts]
        if not all(isinstance(v, bool) for v in values):
            return  # rejected below, with the field named
        self.bias = sum(values) >= 2
        for part, value in zip(parts, values):
            setattr(self, part, None if value == self.bias else value)

    def _canonical_layers(self):
        """Sorted layer lists; None where they name no layer (without RoPE) or every layer (the window);
        a window on no layer is no window."""
        if self.sliding_window_layers is not None and len(self.sliding_window_layers) == 0:
            self.sliding_window, self.sliding_window_layers = None, None
        for name in ("sliding_window_layers", "layers_without_rope"):
            layers = getattr(self, name)
            if layers is None:
                continue
            if not isinstance(layers, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layer for i in layers):
                raise ValueError(f"ModelConfig.{name}={layers!r} must be a list of layer indices in "
                                 f"[0, n_layer={self.n_layer}) or None")
            setattr(self, name, sorted(set(layers)) or None)
        if self.sliding_window_layers is not None and self.sliding_window is None:
            raise ValueError(f"ModelConfig.sliding_window_layers={self.sliding_window_layers!r} needs a sliding_window")
        if self.sliding_window_layers == list(range(self.n_layer)):
            self.sliding_window_layers = None
        if self.layers_without_rope is not None and self.positions != "rope":
            raise ValueError(f"ModelConfig.layers_without_rope={self.layers_without_rope!r} needs positions='rope'")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None where it attends to the whole prefix."""
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    def layer_has_rope(self, layer: int) -> bool:
        return self.positions == "rope" and layer not in (self.layers_without_rope or ())

    @property
    def post_ln(self) -> bool:
        """OPT-350m's blocks: the norm after each residual add, and no final norm."""
        return not self.pre_norm and not self.output_norm

    def _check_rope_scaling(self):
        scaling = self.rope_scaling
        kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
        if self.positions != "rope" or kind not in ROPE_SCALINGS:
            raise ValueError(f"ModelConfig.rope_scaling={scaling!r} is not supported; expected None or a dict with "
                             f"rope_type one of {tuple(ROPE_SCALINGS)} (with positions='rope')")
        required, optional = ROPE_SCALINGS[kind]
        missing = [k for k in required if k not in scaling]
        unknown = [k for k in scaling if k not in ("rope_type", *required, *optional)]
        if missing or unknown:
            raise ValueError(f"ModelConfig.rope_scaling={scaling!r}: rope_type {kind!r} needs {list(required)} and "
                             f"accepts {list(optional)}; missing {missing}, unknown {unknown}")
        if not scaling["factor"] > 0:
            raise ValueError(f"ModelConfig.rope_scaling factor={scaling['factor']!r} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_head

    def has_bias(self, part: str) -> bool:
        """Whether the `part` ("qkv", "o" or "mlp") linear layers have biases."""
        value = getattr(self, f"{part}_bias")
        return self.bias if value is None else value

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (and of the LM head input)."""
        return self.word_embed_proj_dim or self.d_model

    @property
    def head_outputs(self) -> int:
        """Output width of `head`: the vocabulary for an LM, num_labels for a score model."""
        return self.num_labels or self.vocab_size

    @property
    def tied_head(self) -> bool:
        """The head shares the token embedding's weight (an LM with tie_embeddings; never a score head)."""
        return self.tie_embeddings and not self.num_labels

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A copy of PRESETS[name] with some fields replaced, e.g. max_seq_len=512."""
        return cls(**cls.preset_fields(name, **overrides))

    @classmethod
    def preset_fields(cls, name: str, **overrides) -> dict:
        """The fields from_preset builds its config of, not yet checked: a run's config names the
        key it set where one of these makes no model (trainer.config.check_model_section)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in overrides if key not in fields]
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown} for preset {name!r}; "
                             f"valid fields: {', '.join(fields)}")
        preset = PRESETS[name]
        if "d_model" in overrides and "d_ff" not in overrides:  # a wider model gets a wider MLP
            overrides["d_ff"] = default_d_ff(preset.activation, overrides["d_model"])
        if "n_kv_head" not in overrides and preset.n_kv_head == preset.n_head:
            overrides["n_kv_head"] = None  # a multi-head preset stays multi-head when n_head changes
        return {**{key: getattr(preset, key) for key in fields}, **overrides}


def default_d_ff(activation: str, d_model: int) -> int:
    """The MLP width that goes with d_model: 4x (GPT-2, OPT); for SwiGLU LLaMA's rule, 2/3 of 4x
    (the same parameters in three matrices) rounded up to a multiple of 256."""
    if activation != "swiglu":
        return 4 * d_model
    return 256 * -(-(8 * d_model // 3) // 256)


def num_params(config: ModelConfig, include_embeddings: bool = True) -> int:
    """Parameter count computed from the config alone (no need to build a 7B model).

    include_embeddings=False drops the tables that are only looked up, never
    multiplied: learned positions, and the token embedding when it is not tied
    to the LM head. The head itself (LM or score head) always counts, because it
    is a matmul; this is the N of the 6N FLOPs estimate.
    """
    d, e, ff = config.d_model, config.embed_dim, config.d_ff
    q_dim, kv_dim = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    norm = 2 * d if config.norm == "layernorm" else d

    attn = d * q_dim + 2 * d * kv_dim + q_dim * d
    attn += (q_dim + 2 * kv_dim) * config.has_bias("qkv") + d * config.has_bias("o")
    attn += (2 * config.head_dim if config.qk_norm_per_head else q_dim + kv_dim) * config.qk_norm
    mlp = (3 if config.activation == "swiglu" else 2) * d * ff
    mlp += ((2 if config.activation == "swiglu" else 1) * ff + d) * config.has_bias("mlp")
    block_norms = 2 * norm * ((config.pre_norm or config.post_ln) + config.output_norm)
    total = config.n_layer * (attn + mlp + block_norms)

    total += 0 if config.post_ln else norm  # final norm
    total += 2 * e * d if config.word_embed_proj_dim else 0  # OPT project_in / project_out
    total += config.head_outputs * e  # LM head (== token embedding when tied) or score head
    if include_embeddings:
        if not config.tied_head:
            total += config.vocab_size * e
        if config.positions == "learned":
            total += (config.max_seq_len + config.position_offset) * d
    return total


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6N + 12 * n_layer * d_model * seq_len.

    The standard Megatron / PaLM (appendix B) estimate: 6N for the weight
    matmuls (2 forward + 4 backward per parameter) plus the attention score and
    value matmuls, which grow with the context length. N is
    num_params(include_embeddings=False). Causal masking is not discounted, so
    this matches how MFU is usually reported.
    """
    return 6 * num_params(config, include_embeddings=False) + 12 * config.n_layer * config.d_model * seq_len


def _gpt2(n_layer, n_head, d_model, **kw) -> ModelConfig:
    base = dict(arch="gpt2", vocab_size=50257, n_layer=n_layer, n_head=n_head, d_model=d_model,
                d_ff=4 * d_model, max_seq_len=1024, norm="layernorm", norm_eps=1e-5,
                activation="gelu_tanh", positions="learned", tie_embeddings=True, bias=True)
    return ModelConfig(**{**base, **kw})


def _opt(n_layer, n_head, d_model, **kw) -> ModelConfig:
    base = dict(arch="opt", vocab_size=50272, n_layer=n_layer, n_head=n_head, d_model=d_model,
                d_ff=4 * d_model, max_seq_len=2048, norm="layernorm", norm_eps=1e-5, activation="relu",
                positions="learned", position_offset=2, tie_embeddings=True, bias=True)
    return ModelConfig(**{**base, **kw})


def _llama(n_layer, n_head, d_model, d_ff, **kw) -> ModelConfig:
    base = dict(arch="llama", vocab_size=32000, n_layer=n_layer, n_head=n_head, d_model=d_model,
                d_ff=d_ff, max_seq_len=2048, norm="rmsnorm", norm_eps=1e-6, activation="swiglu",
                positions="rope", tie_embeddings=False, bias=False)
    return ModelConfig(**{**base, **kw})


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _llama3(n_layer, n_head, d_model, d_ff, **kw) -> ModelConfig:
    base = dict(vocab_size=128256, n_kv_head=8, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling=_llama3_rope(8.0))
    return _llama(n_layer, n_head, d_model, d_ff, **{**base, **kw})


def _qwen2(n_layer, n_head, n_kv_head, d_model, d_ff, **kw) -> ModelConfig:
    base = dict(arch="qwen2", vocab_size=151936, n_kv_head=n_kv_head, max_seq_len=32768, rope_theta=1000000.0,
                tie_embeddings=True, qkv_bias=True)
    return _llama(n_layer, n_head, d_model, d_ff, **{**base, **kw})


def _qwen3(n_layer, n_head, n_kv_head, d_model, d_ff, **kw) -> ModelConfig:
    base = dict(arch="qwen3", vocab_size=151936, n_kv_head=n_kv_head, explicit_head_dim=128, max_seq_len=40960,
                rope_theta=1000000.0, qk_norm=True, tie_embeddings=True)
    return _llama(n_layer, n_head, d_model, d_ff, **{**base, **kw})


def _mistral(n_layer, n_head, d_model, d_ff, **kw) -> ModelConfig:
    base = dict(arch="mistral", n_kv_head=8, max_seq_len=32768, norm_eps=1e-5, sliding_window=4096)
    return _llama(n_layer, n_head, d_model, d_ff, **{**base, **kw})


PRESETS: dict[str, ModelConfig] = {
    "gpt2": _gpt2(12, 12, 768),
    "gpt2-medium": _gpt2(24, 16, 1024),
    "gpt2-large": _gpt2(36, 20, 1280),
    "gpt2-xl": _gpt2(48, 25, 1600),
    "opt-125m": _opt(12, 12, 768),
    "opt-350m": _opt(24, 16, 1024, word_embed_proj_dim=512, pre_norm=False),
    "opt-1.3b": _opt(24, 32, 2048),
    "opt-6.7b": _opt(32, 32, 4096),
    "llama-7b": _llama(32, 32, 4096, 11008),
    "llama-13b": _llama(40, 40, 5120, 13824),
    "llama2-7b": _llama(32, 32, 4096, 11008, max_seq_len=4096, norm_eps=1e-5),
    "llama3-8b": _llama3(32, 32, 4096, 14336, max_seq_len=8192, rope_scaling=None),
    "llama3.1-8b": _llama3(32, 32, 4096, 14336),
    "llama3.1-70b": _llama3(80, 64, 8192, 28672),
    "llama3.2-1b": _llama3(16, 32, 2048, 8192, tie_embeddings=True, rope_scaling=_llama3_rope(32.0)),
    "llama3.2-3b": _llama3(28, 24, 3072, 8192, tie_embeddings=True, rope_scaling=_llama3_rope(32.0)),
    "qwen2.5-0.5b": _qwen2(24, 14, 2, 896, 4864),
    "qwen2.5-1.5b": _qwen2(28, 12, 2, 1536, 8960, max_seq_len=131072),
    "qwen2.5-7b": _qwen2(28, 28, 4, 3584, 18944, vocab_size=152064, max_seq_len=131072, tie_embeddings=False),
    "qwen3-0.6b": _qwen3(28, 16, 8, 1024, 3072),
    "qwen3-1.7b": _qwen3(28, 16, 8, 2048, 6144),
    "qwen3-8b": _qwen3(36, 32, 8, 4096, 12288, tie_embeddings=False),
    "mistral-7b": _mistral(32, 32, 4096, 14336),  # v0.1: 4096-token sliding window
    "mistral-7b-v0.3": _mistral(32, 32, 4096, 14336, vocab_size=32768, rope_theta=1000000.0, sliding_window=None),
    "mistral-nemo-12b": _mistral(40, 32, 5120, 14336, vocab_size=131072, explicit_head_dim=128, max_seq_len=1024000,
                                 rope_theta=1000000.0, sliding_window=None),
    # Small models for tests and CPU quick starts; vocabularies match the real tokenizers. The newer families'
    # rows are multiples of 32 long, so that they export to GGUF.
    "gpt2-tiny": _gpt2(2, 4, 64, max_seq_len=128),
    "opt-tiny": _opt(2, 4, 64, max_seq_len=128),
    "llama-tiny": _llama(2, 4, 64, 176, n_kv_head=2, max_seq_len=128),
    "llama3-tiny": _llama3(2, 4, 64, 128, n_kv_head=2, max_seq_len=128, explicit_head_dim=32,
                           rope_scaling={**_llama3_rope(8.0), "original_max_position_embeddings": 32}),
    "qwen2-tiny": _qwen2(2, 4, 2, 64, 128, max_seq_len=128),
    "qwen3-tiny": _qwen3(2, 4, 2, 64, 128, max_seq_len=128, explicit_head_dim=32),
    "mistral-tiny": _mistral(2, 4, 64, 128, n_kv_head=2, max_seq_len=128, sliding_window=32),
    "gpt2-small-cpu": _gpt2(6, 8, 256, max_seq_len=256),
}
