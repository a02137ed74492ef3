"""A decoder-only Transformer that is GPT-2, OPT, LLaMA, Qwen2/3, Mistral, Granite, OLMo 2, SmolLM3, Gemma 2
or Gemma 3 depending on its ModelConfig.

Top-level units are `embed`, `blocks[i]`, `norm`, `project_out` and `head`, so
that a sharding runtime can wrap them from outside by name.
"""

import dataclasses
import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import ModelConfig

INIT_STD = 0.02


class KVCache:
    """Keys and values of every token seen so far, one (k, v) pair per layer.

    Grows by concatenation: simple, and fast enough for sampling during training.
    """

    def __init__(self, n_layer: int):
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer

    @property
    def seq_len(self) -> int:
        return 0 if self.layers[0] is None else self.layers[0][0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layers[layer] is not None:
            past_k, past_v = self.layers[layer]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.layers[layer] = (k, v)
        return k, v


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, exactly like HF LLaMA. With unit_offset
    (Gemma) the scale is 1 + weight, applied in fp32 before the cast, and the weight starts at 0."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim or config.d_model, config.norm_eps, config.norm_unit_offset)
    return nn.LayerNorm(dim or config.d_model, eps=config.norm_eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None,
                  seq_len: torch.Tensor | None = None, max_seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [head_dim / 2] and the factor on cos/sin, as transformers computes them
    for rope_type default, linear, llama3, yarn and dynamic (modeling_rope_utils). Dynamic NTK also needs
    the length of the running sequence (`seq_len`, the largest position + 1) and the model's
    `max_seq_len` (transformers' max_position_embeddings); without them it is plain RoPE."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    inv_freq = 1.0 / pos_freqs
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "dynamic":
        return _dynamic_ntk_inv_freq(inv_freq, head_dim, theta, scaling["factor"], seq_len, max_seq_len), 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":  # long wavelengths divided by factor, short ones kept, a smooth ramp between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(pos_freqs, head_dim, theta, scaling)
    return inv_freq, 1.0


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071): interpolate the low frequencies, keep the high ones, scale cos/sin."""
    factor = scaling["factor"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return (head_dim * math.log(scaling["original_max_position_embeddings"] / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)
    extrapolation = (1 - ramp.clamp(0, 1)).to(pos_freqs.device)
    return (1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation,
            float(attention_factor))


def _dynamic_ntk_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, factor: float,
                          seq_len: torch.Tensor | None, max_seq_len: int | None) -> torch.Tensor:
    """Dynamic NTK scaling (transformers' _compute_dynamic_ntk_parameters): up to max_seq_len tokens plain
    RoPE; beyond, the base grows to theta * (factor * seq_len / max_seq_len - (factor - 1)) ** (d / (d - 2)).
    Computed with transformers' tensor dtypes (an int64 length, fp32 base), so the frequencies are its bits."""
    if seq_len is None or max_seq_len is None or int(seq_len) <= max_seq_len:
        return inv_freq
    seq_len = torch.as_tensor(seq_len, dtype=torch.int64, device=inv_freq.device)
    base = theta * ((factor * seq_len / max_seq_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=inv_freq.device).float() / head_dim))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, scaling: dict | None = None,
                 max_seq_len: int | None = None):
    """fp32 cos/sin tables [B, T, head_dim] in the HF LLaMA (rotate_half) layout.

    Recomputed each forward instead of cached in a buffer: it is tiny, and the
    model then has no buffers to worry about when built on the meta device.
    Dynamic NTK scaling takes the running length from this call's largest position (the
    positions of a decoding step continue the cached ones) and needs `max_seq_len`.
    """
    seq_len = None
    if scaling and scaling["rope_type"] == "dynamic" and position_ids.numel():
        seq_len = position_ids.max() + 1
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, position_ids.device, seq_len, max_seq_len)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    if attention_factor != 1.0:
        return emb.cos() * attention_factor, emb.sin() * attention_factor
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, H, T, head_dim]; cos/sin: [B, T, head_dim], cast to x's dtype like HF."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Multi-head / grouped-query attention. forward takes its head counts from the instance
    attributes n_head, n_kv_head and head_dim, so a tensor-parallel wrapper can set local ones."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # which KVCache slot this layer owns
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        d, q_dim, kv_dim = config.d_model, config.n_head * config.head_dim, config.n_kv_head * config.head_dim
        qkv_bias = config.has_bias("qkv")
        self.q_proj = nn.Linear(d, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, d, bias=config.has_bias("o"))
        self.scale = config.attention_multiplier  # None: SDPA's 1 / sqrt(head_dim)
        # RMSNorm on queries and keys before RoPE: over each head's head_dim (Qwen3), or over the whole
        # projection, all heads together (OLMo 2).
        self.qk_norm_per_head = config.qk_norm_per_head
        q_width, k_width = (config.head_dim, config.head_dim) if config.qk_norm_per_head else (q_dim, kv_dim)
        self.q_norm = make_norm(config, q_width) if config.qk_norm else None
        self.k_norm = make_norm(config, k_width) if config.qk_norm else None
        self.softcap = config.attn_logit_softcapping  # Gemma 2

    def forward(self, x, rope=None, mask=None, kv_cache=None):
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, T, self.n_head, self.head_dim), k.view(B, T, self.n_kv_head, self.head_dim)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        # No mask means plain causal attention over this chunk (training, or a cache-less prefill).
        if self.softcap is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               enable_gqa=self.n_kv_head != self.n_head)
        else:
            y = softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def softcapped_attention(q, k, v, mask, scale: float | None, cap: float) -> torch.Tensor:
    """Attention whose scores are squashed by cap * tanh(score / cap) before the softmax (Gemma 2). SDPA cannot
    do that, so it is spelled out as transformers' eager attention: fp32 softmax, cast back to q's dtype."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / cap) * cap
    if mask is None:  # causal over this chunk, no cache
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.activation, self.gate_activation = config.activation, config.gate_activation
        bias = config.has_bias("mlp")
        if config.activation == "swiglu":
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=bias)

    def forward(self, x):
        if self.activation == "swiglu":
            gate = self.gate_proj(x)
            if self.gate_activation == "silu":
                gate = F.silu(gate)
            else:  # GeGLU
                gate = F.gelu(gate, approximate="tanh" if self.gate_activation == "gelu_tanh" else "none")
            return self.down_proj(gate * self.up_proj(x))
        if self.activation == "relu":
            return self.down_proj(F.relu(self.up_proj(x)))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    """attn_norm / mlp_norm normalise each sublayer's input (pre-LN), or with config.post_ln the sum after
    each residual add (OPT-350m); attn_out_norm / mlp_out_norm, with config.output_norm, each sublayer's
    output before the add (OLMo 2). A norm a family does not have is an nn.Identity."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.post_ln = config.post_ln
        self.residual_multiplier = config.residual_multiplier  # Granite

        def norm(present: bool) -> nn.Module:
            return make_norm(config) if present else nn.Identity()

        self.attn_norm = norm(config.pre_norm or config.post_ln)
        self.attn = Attention(config, layer_idx)
        self.attn_out_norm = norm(config.output_norm)
        self.mlp_norm = norm(config.pre_norm or config.post_ln)
        self.mlp = MLP(config)
        self.mlp_out_norm = norm(config.output_norm)

    def forward(self, x, rope=None, mask=None, kv_cache=None):
        if self.post_ln:
            x = self.attn_norm(x + self.attn(x, rope, mask, kv_cache))
            return self.mlp_norm(x + self.mlp(x))
        x = x + self._scaled(self.attn_out_norm(self.attn(self.attn_norm(x), rope, mask, kv_cache)))
        return x + self._scaled(self.mlp_out_norm(self.mlp(self.mlp_norm(x))))

    def _scaled(self, y):
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier


class Embedding(nn.Module):
    """Token embedding, plus OPT's project_in and learned positions when the config has them."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.position_offset = config.position_offset
        self.multiplier = config.embedding_multiplier  # Granite
        self.tokens = nn.Embedding(config.vocab_size, config.embed_dim)
        self.project_in = None
        if config.word_embed_proj_dim:
            self.project_in = nn.Linear(config.embed_dim, config.d_model, bias=False)
        self.positions = None
        if config.positions == "learned":
            self.positions = nn.Embedding(config.max_seq_len + config.position_offset, config.d_model)

    def forward(self, tokens, position_ids):
        x = self.tokens(tokens)
        if self.multiplier != 1.0:
            x = x * self.multiplier
        if self.project_in is not None:
            x = self.project_in(x)
        if self.positions is not None:
            x = x + self.positions(position_ids + self.position_offset)
        return x


def default_position_ids(attention_mask, batch: int, seq_len: int, past_len: int, device) -> torch.Tensor:
    """Positions of the current chunk, counting only real (mask == 1) tokens.

    Same convention as HF generate: left padding does not shift the positions
    of the real tokens, and padding slots get position 0.
    """
    if attention_mask is None:
        return torch.arange(past_len, past_len + seq_len, device=device).expand(batch, seq_len)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    return position_ids[:, past_len:]


def packed_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 where each packed document starts (a new id from the slot before),
    so every document is placed as if it were alone in its row; padding (id < 0) gets 0, so that
    no position exceeds the longest document's (dynamic RoPE scales by the largest)."""
    T = document_ids.shape[-1]
    slots = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    positions = slots - torch.where(starts, slots, 0).cummax(-1).values
    return positions.masked_fill(document_ids < 0, 0)


def packed_mask(document_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, T, T] block-diagonal causal mask: a token sees the earlier tokens of its own
    document only (and with `window`, those less than `window` slots back)."""
    causal = attention_mask_4d(None, document_ids.shape[-1], 0, document_ids.device, window)
    return causal & (document_ids[:, :, None] == document_ids[:, None, :])[:, None]


def attention_mask_4d(attention_mask, seq_len: int, past_len: int, device, window: int | None = None) -> torch.Tensor:
    """Boolean [B or 1, 1, T, past+T] mask: causal, hiding padded keys, and with `window` the keys
    `window` or more slots back (transformers' sliding window: key > query - window).

    A query always sees itself, so rows of padding tokens are never fully
    masked (that would give NaNs that leak through the cache).
    """
    q_pos = torch.arange(past_len, past_len + seq_len, device=device)[:, None]
    k_pos = torch.arange(past_len + seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    mask = mask[None, None]
    if attention_mask is not None:
        mask = mask & (attention_mask.bool()[:, None, None, :] | (k_pos == q_pos))
    return mask


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # One number drawn from the global RNG, first (building nn.Linear layers off the meta device
        # draws more): every parameter's initial values follow from it and the parameter's name alone.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        # OPT post-LN models have no final norm: every block already ends with one.
        self.norm = nn.Identity() if config.post_ln else make_norm(config)
        self.project_out = None
        if config.word_embed_proj_dim:
            self.project_out = nn.Linear(config.d_model, config.embed_dim, bias=False)
        # LM head over the vocabulary, or a score head of num_labels outputs (never tied).
        self.head = nn.Linear(config.embed_dim, config.head_outputs, bias=False)
        if config.tied_head:
            self.head.weight = self.embed.tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Initialise every parameter (init_parameter); parameters on the meta device are left for a
        runtime that initialises them shard by shard, or for models.weights.materialize."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` with the initial values of parameter `name`: GPT-2's init, N(0, 0.02), the residual
        output projections N(0, 0.02 / sqrt(2 n_layer)), norms one (Gemma's, which scale by 1 + weight, zero),
        biases zero; LoRA's A like nn.Linear (kaiming uniform), B zero.

        The values come from a generator seeded by (init_seed, name) and are drawn on the CPU, so a
        model gets the same weights on any device, any number of ranks and any sharding: a sharded
        runtime draws a parameter whole and keeps its slice. A LoRA-wrapped layer's base weight
        (`...q_proj.base.weight`) draws what the plain layer's weight would.
        """
        name = name.replace(".base.", ".")
        module_name, leaf = name.rsplit(".", 1)
        module = self.get_submodule(module_name) if not leaf.startswith("lora_") else None
        if isinstance(module, (nn.LayerNorm, RMSNorm)) or leaf == "bias":
            out.fill_(1.0 if leaf == "weight" and not getattr(module, "unit_offset", False) else 0.0)
            return
        if leaf == "lora_B":
            out.zero_()
            return
        digest = hashlib.blake2b(f"{self.init_seed}:{name}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        values = torch.empty(out.shape, dtype=torch.float32)
        if leaf == "lora_A":
            bound = 1.0 / math.sqrt(out.shape[1])  # nn.Linear's kaiming_uniform_(a=sqrt(5)), as PEFT does
            values.uniform_(-bound, bound, generator=generator)
        else:
            residual_out = module_name.endswith(("attn.o_proj", "mlp.down_proj"))
            std = INIT_STD / math.sqrt(2 * self.config.n_layer) if residual_out else INIT_STD
            values.normal_(0.0, std, generator=generator)
        out.copy_(values)

    def forward(self, tokens, position_ids=None, attention_mask=None, kv_cache=None,
                document_ids=None) -> torch.Tensor:
        """tokens [B, T] -> float32 logits [B, T, V] (score model: values [B, T, num_labels]).

        attention_mask: optional [B, past+T] 1/0 padding mask (left padding for
        batched generation). kv_cache: a KVCache that is read and extended.
        document_ids: optional [B, T] ids of packed documents (data.packing): each token attends
        to its own document only and positions restart at 0 with each (unless position_ids).
        """
        B, T = tokens.shape
        past_len = kv_cache.seq_len if kv_cache is not None else 0
        if document_ids is not None and (attention_mask is not None or kv_cache is not None):
            raise ValueError("document_ids (packed rows) take no attention_mask or kv_cache: the documents' "
                             "extents are the mask, and packing is for full forwards, not decoding")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past_len + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected "
                             f"{(B, past_len + T)} (batch, cached + new tokens)")
        if self.config.positions == "learned" and past_len + T > self.config.max_seq_len:
            raise ValueError(f"sequence length {past_len + T} exceeds max_seq_len={self.config.max_seq_len}")
        if position_ids is None and document_ids is not None:
            position_ids = packed_position_ids(document_ids)
        elif position_ids is None:
            position_ids = default_position_ids(attention_mask, B, T, past_len, tokens.device)

        x = self.embed(tokens, position_ids)
        rope = None
        if self.config.positions == "rope":
            rope = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling,
                                self.config.max_seq_len)
        local_rope = rope  # the windowed layers' (Gemma 3: another base)
        if self.config.sliding_rope_theta is not None:
            local_rope = rope_cos_sin(position_ids, self.config.head_dim, self.config.sliding_rope_theta)
        windows = [self.config.layer_window(i) for i in range(len(self.blocks))]
        if document_ids is not None:
            masks = {window: packed_mask(document_ids, window) for window in set(windows)}
        else:
            masks = {window: self._mask(attention_mask, T, past_len, tokens.device, window)
                     for window in set(windows)}
        for i, block in enumerate(self.blocks):
            layer_rope = None if not self.config.layer_has_rope(i) else rope if windows[i] is None else local_rope
            x = block(x, layer_rope, masks[windows[i]], kv_cache)
        x = self.norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        logits = self.head(x)
        if not self.config.num_labels:  # an LM head's
            if self.config.logits_scaling != 1.0:  # Granite
                logits = logits / self.config.logits_scaling
            if self.config.final_logit_softcapping is not None:  # Gemma 2
                cap = self.config.final_logit_softcapping
                logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @staticmethod
    def _mask(attention_mask, seq_len: int, past_len: int, device, window: int | None) -> torch.Tensor | None:
        """The boolean mask of the layers with sliding window `window` (None: full attention), or None
        where plain causal attention over this chunk is the same."""
        if window is not None and past_len + seq_len <= window:
            window = None  # every key is inside the window
        if attention_mask is None and past_len == 0 and window is None:
            return None
        return attention_mask_4d(attention_mask, seq_len, past_len, device, window)


def score_model_from(model: Transformer, num_labels: int = 1) -> Transformer:
    """A score (reward / value) model with `model`'s config and weights but a fresh scoring head.

    Every weight except the head is copied (the result shares no storage with `model`, which
    is left unchanged; one on the meta device gives a meta model with just the head materialized,
    whose other weights the caller reads from the same source); the head `[num_labels, embed_dim]` is drawn from N(0, 1/sqrt(embed_dim + 1))
    under the current torch (CPU) RNG, as TRL's reward-modeling scripts do
    (`layer_init(model.score, std=1 / np.sqrt(hidden_size + 1))`, after Stiennon et al. 2020,
    arXiv:2009.01325, p. 11), then cast to the model's dtype and device.
    """
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
        raise ValueError(f"score_model_from: num_labels={num_labels!r} must be an int >= 1")
    config = dataclasses.replace(model.config, num_labels=num_labels)
    with torch.device("meta"), torch.random.fork_rng(devices=[]):  # shapes only: no draw
        score = Transformer(config)
    ref = model.head.weight
    head = torch.empty(num_labels, config.embed_dim).normal_(0.0, 1.0 / math.sqrt(config.embed_dim + 1))
    if ref.is_meta:  # a model on the meta device: the rest keeps coming from its weight source
        score.head.weight = nn.Parameter(head.to(ref.dtype))
        return score.train(model.training)
    weights = {n: t.detach().clone() for n, t in model.state_dict().items() if n != "head.weight"}
    weights["head.weight"] = head.to(ref.device, ref.dtype)
    expected = set(score.state_dict())
    if set(weights) != expected:
        raise ValueError(f"score_model_from: the model's weights {sorted(set(weights) - expected)[:5]} are not those "
                         f"of a plain Transformer of its config (LoRA adapters? merge them first with merge_lora)")
    score.load_state_dict(weights, assign=True)
    return score.train(model.training)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 over labels != -100.

    The caller shifts: tokens = sample[:, :-1], labels = sample[:, 1:].
    """
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)
