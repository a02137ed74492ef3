"""Quantized export: a low-bit safetensors directory, and GGUF for llama.cpp (Q8_0 / Q4_0 of our codes, or
llama.cpp's K-quant mixes Q4_K_M / Q4_K / Q6_K from export/kquants.py).

Both formats carry the codes of OUR block quantization, `kernels.quantize_weights(W.reshape(-1),
bits, block_size)` of the fp32 weights (full levels, fp16 scales: llama.cpp's Q8_0 / Q4_0 rule): the
very function, grid and scale dtype qwZ trains with (zeropp/quantized.py; every parameter starts a block of its own
and padding is zero, so qwZ's blocks are the blocks of W.reshape(-1)). Exporting a qwZ-trained
checkpoint at its bits and block size therefore reproduces bit for bit the weights its training
forward computed with; any other export is plain round-to-nearest post-training quantization
(the RTN baseline), by the same code path. See docs/export.md.

Which tensors are quantized: the matrices (2-D: linear and embedding weights). Vectors (norm
gains, biases) are stored in fp32; qwZ quantizes them too, so with `vectors_on_grid=True` they
are stored as their fp32 values dequant(quant(v)), which is what a qwZ forward used.

Outputs are written next to the target and renamed into place, so a crash never leaves a
half-written export under the real name; an existing output is replaced (the old one is moved
aside first and deleted only once the new one is in place).

Both are written tensor by tensor: the weights may be a models.streaming.LazyTensors (a training
checkpoint read one parameter at a time, trainer.checkpoint.checkpoint_weights), the file layout
is computed from the shapes first, and each weight is read, quantized and written before the next
one, so the peak is one tensor and its codes, not the model.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import uuid
from pathlib import Path

import gguf
import numpy as np
import torch
from data.tokenizer import SentencePieceTokenizer, Tokenizer, load_tokenizer
from export.kquants import KQUANT_MIXES, kquant_tensor, kquant_type
from kernels import BITS, WEIGHT_SCALE_DTYPE, dequantize, num_blocks, on_grid, packed_bytes, quantize_weights, unpack_codes
from models.config import ModelConfig
from models.hf import hf_weights, replace_output, staged_directory
from models.streaming import LazyTensors, SafetensorsFile, SafetensorsWriter, return_freed_memory_to_the_os
from models.transformer import Transformer, rope_inv_freq

LOWBIT_FORMAT, LOWBIT_VERSION = "zeropp-lowbit", 1
LOWBIT_META, LOWBIT_WEIGHTS = "quantization.json", "model.safetensors"
GGUF_QTYPES = {"Q8_0": 8, "Q4_0": 4}  # GGUF types that hold our codes as they are (one fp16 scale per 32)
GGUF_BLOCK = 32  # elements per GGUF Q8_0 / Q4_0 block
GGUF_MIXES = ("Q4_K_M", "Q4_K", "Q6_K")  # llama.cpp's K-quant mixes (export/kquants.py), quantized again


# ---------------------------------------------------------------------------------------------
# The quantization grid


def _fp32_weights(weights, config: ModelConfig) -> LazyTensors:
    """Every parameter of the model `config` describes, in fp32 on the CPU, by our names, each
    converted when it is looked up.

    `weights` is a Transformer, its state dict, or a models.streaming.LazyTensors of either (then
    nothing is read here); a tied LM head appears once (as the token embedding). Names and shapes
    are checked against the config.
    """
    if isinstance(weights, torch.nn.Module):
        weights = dict(weights.named_parameters())
    weights = LazyTensors.of(weights)
    with torch.device("meta"):
        expected = dict(Transformer(config).named_parameters())  # shared parameters once
    extra = {"head.weight"} if config.tie_embeddings else set()  # a state_dict() lists the tied head too
    missing = [n for n in expected if n not in weights]
    unexpected = [n for n in weights if n not in expected and n not in extra]
    if missing or unexpected:
        raise ValueError(f"weights do not match the {config.arch} model of the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, want in expected.items():
        if tuple(weights.spec(name).shape) != tuple(want.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(weights.spec(name).shape)}, expected "
                             f"{tuple(want.shape)} from the config")
    specs = {name: torch.empty(want.shape, device="meta") for name, want in expected.items()}
    return LazyTensors(specs, lambda name: weights[name].detach().to("cpu", torch.float32))


def is_quantized(tensor: torch.Tensor) -> bool:
    """Matrices (linear and embedding weights) are exported as codes; vectors stay fp32."""
    return tensor.dim() == 2


def dequantized_state_dict(weights, config: ModelConfig, bits: int, block_size: int,
                           vectors_on_grid: bool = False) -> dict[str, torch.Tensor]:
    """The fp32 weights an export at (bits, block_size) represents, by our parameter names (all in memory)."""
    return {name: on_grid(t, bits, block_size) if is_quantized(t) or vectors_on_grid else t
            for name, t in _fp32_weights(weights, config).items()}


def _check_bits(bits: int, block_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits!r}: expected one of {BITS}")
    if not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
        raise ValueError(f"block_size={block_size!r}: expected a positive multiple of 8")


# ---------------------------------------------------------------------------------------------
# Atomic outputs and the tokenizer


def _tokenizer(path) -> Tokenizer:
    """The tokenizer an export ships with; a missing one is an error naming what was expected."""
    if path is None:
        raise ValueError("an export needs the model's tokenizer: pass a SentencePiece .model file, or a directory "
                         "containing tokenizer.json (Hugging Face) or tokenizer.model (SentencePiece)")
    return load_tokenizer(path)  # FileNotFoundError naming the path and the expected files


def _check_vocab(tokenizer, config: ModelConfig) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the model's "
                         f"vocab_size={config.vocab_size}: it is not this model's tokenizer")


# ---------------------------------------------------------------------------------------------
# Low-bit safetensors directory


def export_lowbit(weights, config: ModelConfig, out_dir, bits: int, block_size: int = 256, tokenizer_dir=None, *,
                  vectors_on_grid: bool = False) -> Path:
    """Write a low-bit directory: quantization.json, model.safetensors, the tokenizer files.

    model.safetensors holds, per matrix W, `<name>.codes` (uint8, kernels' dense packing of
    W.reshape(-1)) and `<name>.scales` (fp16, one per block); vectors as fp32 `<name>`.
    `tokenizer_dir`: a SentencePiece .model file or a tokenizer directory (required).
    """
    out_dir = Path(out_dir)
    _check_bits(bits, block_size)
    state = _fp32_weights(weights, config)
    tokenizer = _tokenizer(tokenizer_dir)
    _check_vocab(tokenizer, config)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")

    specs, quantized, plain = {}, {}, {}
    for name, spec in state.specs.items():
        if is_quantized(spec):
            specs[f"{name}.codes"] = torch.empty(packed_bytes(spec.numel(), bits, block_size), dtype=torch.uint8,
                                                 device="meta")
            specs[f"{name}.scales"] = torch.empty(num_blocks(spec.numel(), block_size), dtype=WEIGHT_SCALE_DTYPE,
                                                  device="meta")
            quantized[name] = list(spec.shape)
        else:
            specs[name] = spec
            plain[name] = list(spec.shape)
    meta = {"format": LOWBIT_FORMAT, "version": LOWBIT_VERSION, "bits": bits, "block_size": block_size,
            "scale_dtype": "float16", "vectors_on_grid": vectors_on_grid,
            "model_config": dataclasses.asdict(config), "quantized": quantized, "fp32": plain}

    with staged_directory(out_dir) as tmp:
        with SafetensorsWriter(tmp / LOWBIT_WEIGHTS, specs, metadata={"format": "pt"}) as writer:
            for name in state:  # one weight at a time
                t = state[name]
                if name in quantized:
                    q = quantize_weights(t.reshape(-1), bits, block_size)
                    writer.write(f"{name}.codes", q.codes)
                    writer.write(f"{name}.scales", q.scales)
                else:
                    writer.write(name, on_grid(t, bits, block_size) if vectors_on_grid else t.contiguous())
        (tmp / LOWBIT_META).write_text(json.dumps(meta, indent=1) + "\n")
        tokenizer.save(tmp)
    return out_dir


def is_lowbit_dir(path) -> bool:
    return (Path(path) / LOWBIT_META).is_file()


def lowbit_weights(path) -> tuple[ModelConfig, dict, LazyTensors]:
    """(the model config, the export's quantization.json contents, its fp32 weights by our names, each
    read and dequantized when looked up). Every tensor's presence, dtype and size is checked against
    the JSON from the file's header first."""
    path = Path(path)
    meta_file, weights_file = path / LOWBIT_META, path / LOWBIT_WEIGHTS
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} not found; expected a low-bit export directory")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_file}: invalid JSON ({e})") from e
    if meta.get("format") != LOWBIT_FORMAT or meta.get("version") != LOWBIT_VERSION:
        raise ValueError(f"{meta_file}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                         f"expected {LOWBIT_FORMAT!r} version {LOWBIT_VERSION}")
    try:
        bits, block_size = meta["bits"], meta["block_size"]
        _check_bits(bits, block_size)
        config = ModelConfig(**meta["model_config"])
        quantized, plain = meta["quantized"], meta["fp32"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_file}: {type(e).__name__}: {e}") from e
    if not weights_file.is_file():
        raise FileNotFoundError(f"{weights_file} not found (listed by {meta_file})")
    try:
        f = SafetensorsFile(weights_file)
    except ValueError as e:
        raise ValueError(f"{weights_file}: cannot read safetensors file, it may be truncated or corrupt ({e})") from e

    def check(key, dtype, numel):
        if key not in f.entries:
            raise ValueError(f"{weights_file}: tensor {key!r} is missing")
        spec = f.spec(key)
        if spec.dtype != dtype or spec.numel() != numel:
            raise ValueError(f"{weights_file}: tensor {key!r} is {spec.dtype} with {spec.numel()} elements, expected "
                             f"{dtype} with {numel}")

    for name, shape in quantized.items():
        numel = int(np.prod(shape))
        check(f"{name}.codes", torch.uint8, packed_bytes(numel, bits, block_size))
        check(f"{name}.scales", WEIGHT_SCALE_DTYPE, num_blocks(numel, block_size))
    for name, shape in plain.items():
        check(name, torch.float32, int(np.prod(shape)))

    def load(name: str) -> torch.Tensor:
        try:
            if name in quantized:
                shape = quantized[name]
                numel = int(np.prod(shape))
                return dequantize(f.read(f"{name}.codes"), f.read(f"{name}.scales"), numel, bits, block_size).view(shape)
            return f.read(name).view(plain[name])
        except ValueError as e:
            raise ValueError(f"{weights_file}: cannot read safetensors file, it may be truncated or corrupt ({e})") \
                from e

    specs = {name: torch.empty(shape, device="meta") for name, shape in {**quantized, **plain}.items()}
    return config, meta, _fp32_weights(LazyTensors(specs, load), config)  # every parameter present, shapes right


def load_lowbit(path) -> tuple[Transformer, dict]:
    """(fp32 Transformer with the dequantized weights, the export's quantization.json contents)."""
    config, meta, weights = lowbit_weights(path)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head once, as the token embedding
            param.copy_(weights[name])
    return model, meta


# ---------------------------------------------------------------------------------------------
# GGUF


def gguf_qtype(bits: int) -> str:
    """The GGUF type that holds `bits`-bit codes as they are: Q8_0 or Q4_0."""
    for name, b in GGUF_QTYPES.items():
        if b == bits:
            return name
    raise ValueError(f"bits={bits}: GGUF holds our codes only at 8 bits (Q8_0) or 4 bits (Q4_0) - its other types "
                     f"are not one fp16 scale per block of codes; use the low-bit safetensors format for {bits} bits")


def _llama_row_order(rows: int, n_head: int) -> torch.Tensor:
    """Row index of the HF q/k weight that llama.cpp's convert_hf_to_gguf `permute` puts at each row.

    HF stores each head's rotary halves [first half | second half]; llama.cpp wants them
    interleaved (pairs). Whole rows move, so every 32-element GGUF block keeps its scale.
    """
    return torch.arange(rows).view(n_head, 2, rows // n_head // 2).transpose(1, 2).reshape(-1)


def _gguf_blocks(weight: torch.Tensor, bits: int, block_size: int, row_order=None) -> np.ndarray:
    """Q8_0 / Q4_0 bytes [rows, cols / 32 * type size] built from our codes and fp16 scales.

    Each 32-element GGUF block lies inside one of our blocks (block_size % 32 == 0) and inside
    one row (cols % 32 == 0): its scale d is our block's scale, its values our codes.
    Q8_0: d, then 32 int8 codes q. Q4_0: d, then 16 bytes, byte j = nibble j | nibble j+16 << 4,
    nibble = q + 8 - exactly our stored 4-bit code, and ggml's x = (nibble - 8) * d. Full levels put q in
    [-8, 7] with d = m / -8, which is how llama.cpp's own Q4_0 quantizer fills the type.
    """
    rows, cols = weight.shape
    q = quantize_weights(weight.reshape(-1), bits, block_size)
    n = rows * cols // GGUF_BLOCK
    codes = unpack_codes(q.codes, bits)[:rows * cols].view(rows, cols // GGUF_BLOCK, GGUF_BLOCK)
    scales = q.scales.repeat_interleave(block_size // GGUF_BLOCK)[:n].view(rows, cols // GGUF_BLOCK)
    if row_order is not None:
        codes, scales = codes[row_order], scales[row_order]
    d = scales.contiguous().numpy().view(np.uint8).reshape(rows, cols // GGUF_BLOCK, 2)
    if bits == 8:
        qs = (codes.to(torch.int16) - 128).to(torch.int8).numpy().view(np.uint8)
    else:
        qs = (codes[..., :GGUF_BLOCK // 2] | (codes[..., GGUF_BLOCK // 2:] << 4)).numpy()
    return np.concatenate([d, qs], axis=-1).reshape(rows, -1)


# The byte-level BPE pre-tokenizers of published tokenizers, by llama.cpp's name for them (src/llama-vocab.cpp
# has each one's regex). llama.cpp's convert_hf_to_gguf.py tells them apart by hashing a tokenization with the
# downloaded vocabulary; here the tokenizer.json's own layout is recognized. GPT-2 ('gpt-2') is a ByteLevel
# pre-tokenizer with its built-in regex; Llama 3 ('llama-bpe') and Qwen2 / Qwen3 ('qwen2') are
# Sequence[Split(regex), ByteLevel(use_regex=False)], whose Split regex is the key here. llama.cpp's
# llama-bpe also skips the merges of a word in the vocabulary, as Llama 3's tokenizer.json says (ignore_merges).
GGUF_BPE_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}
_GGUF_IGNORE_MERGES = {"gpt-2": False, "llama-bpe": True, "qwen2": False}


def _describe_pre_tokenizer(pre: dict | None) -> str:
    """A tokenizer.json pre_tokenizer in one line: its type, and a Split's pattern (what tells layouts apart)."""
    if not pre:
        return "None"
    if pre.get("type") == "Sequence":
        return f"Sequence[{', '.join(_describe_pre_tokenizer(p) for p in pre.get('pretokenizers', []))}]"
    if pre.get("type") == "Split":
        return f"Split({pre.get('pattern')!r})"
    if pre.get("type") == "ByteLevel":
        return f"ByteLevel(use_regex={pre.get('use_regex', True)})"
    return repr(pre.get("type"))


def _gguf_bpe_pre(spec: dict, file: Path) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json, or a ValueError naming the file and
    what it has: one llama.cpp does not name would split text differently there."""
    bpe, pre, decoder = (spec.get(k) or {} for k in ("model", "pre_tokenizer", "decoder"))

    def byte_level(p: dict, use_regex: bool) -> bool:
        return (p.get("type"), p.get("use_regex", True), p.get("add_prefix_space", False)) == (
            "ByteLevel", use_regex, False)

    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    split = parts[0] if len(parts) == 2 and byte_level(parts[1], False) else {}
    name = None
    if byte_level(pre, True):
        name = "gpt-2"
    elif (split.get("type"), split.get("behavior"), split.get("invert", False)) == ("Split", "Isolated", False):
        name = GGUF_BPE_SPLITS.get((split.get("pattern") or {}).get("Regex"))
    if (bpe.get("type"), bpe.get("byte_fallback", False), decoder.get("type")) != ("BPE", False, "ByteLevel") \
            or name is None:
        raise ValueError(
            f"{file}: GGUF export supports SentencePiece models and GPT-2-style byte-level BPE tokenizer.json files "
            f"with a pre-tokenizer llama.cpp names (GPT-2's ByteLevel 'gpt-2'; Sequence[Split(regex), "
            f"ByteLevel(use_regex=False)] with the Split regex of Llama 3 'llama-bpe' or Qwen2 / Qwen3 'qwen2'); "
            f"this one has model {bpe.get('type')!r}, pre_tokenizer "
            f"{_describe_pre_tokenizer(spec.get('pre_tokenizer'))}, decoder {decoder.get('type')!r}")
    if bpe.get("ignore_merges", False) != _GGUF_IGNORE_MERGES[name]:
        raise ValueError(f"{file}: model.ignore_merges is {bpe.get('ignore_merges', False)}; llama.cpp's {name!r} "
                         f"pre-tokenizer runs with ignore_merges {_GGUF_IGNORE_MERGES[name]}, as the published "
                         f"tokenizers of that layout have it")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        raise ValueError(f"{file}: normalizer {normalizer!r}: llama.cpp's {name!r} pre-tokenizer normalizes nothing "
                         f"(NFC, which Qwen2's tokenizer has, passes: text already in NFC tokenizes alike)")
    return name


def _add_gguf_tokenizer(writer: gguf.GGUFWriter, tokenizer_path, vocab_size: int) -> None:
    """tokenizer.ggml.*: a SentencePiece model as llama.cpp's "llama" vocabulary, a byte-level BPE
    tokenizer.json as "gpt2" with its pre-tokenizer's llama.cpp name (_gguf_bpe_pre), read with gguf-py's
    vocab classes; padded with unused tokens up to the model's (padded) vocabulary, as convert_hf_to_gguf.py
    pads it. The tokenizer's files as data/tokenizer.py saves them also give, through gguf-py's SpecialVocab
    (as convert_hf_to_gguf.py reads them), the chat template and whether BOS / EOS are added."""
    tokenizer = _tokenizer(tokenizer_path)
    path = Path(tokenizer_path)
    sp_file = path if path.is_file() else path / "tokenizer.model"
    control = set()  # ids to mark CONTROL beyond what the vocab class says
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer.save(tmp)  # with the chat template and tokenizer_config.json of an HF tokenizer
        special = gguf.SpecialVocab(tmp, load_merges=not sp_file.is_file(), special_token_types=("bos", "eos"))
        if sp_file.is_file():  # preferred where both exist, as convert_hf_to_gguf.py does for llama
            tokenizer = SentencePieceTokenizer(sp_file)
            tokenizer.save(tmp)
            vocab = gguf.SentencePieceVocab(tmp)
            sp = vocab.sentencepiece_tokenizer
            writer.add_tokenizer_model("llama")
            writer.add_unk_token_id(sp.unk_id())
            # Our SentencePiece models add no dummy prefix (data/tokenizer.py); llama.cpp adds one unless told.
            writer.add_add_space_prefix(sp.encode("a", out_type=str)[0].startswith("\u2581"))
        else:
            spec = json.loads((tmp / "tokenizer.json").read_text())
            pre = _gguf_bpe_pre(spec, path / "tokenizer.json")
            vocab = gguf.BpeVocab(tmp)
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(pre)
            writer.add_token_merges(special.merges)
            control = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        if vocab.vocab_size > vocab_size:
            raise ValueError(f"tokenizer {path} has {vocab.vocab_size} tokens, more than the model's "
                             f"vocab_size={vocab_size}: it is not this model's tokenizer")
        tokens, scores, types = [], [], []
        for i, (text, score, kind) in enumerate(vocab.all_tokens()):
            tokens.append(text)
            scores.append(score)
            types.append(gguf.TokenType.CONTROL if i in control else kind)
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_token_list(tokens)
    if vocab.tokenizer_model == "llama":
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    if tokenizer.bos_id is not None:
        writer.add_bos_token_id(tokenizer.bos_id)
    # As the tokenizer says (tokenizer_config.json's add_bos_token, else its post-processor); where it says
    # nothing, none: our pretraining documents start without BOS and end with EOS (data/indexed.py).
    writer.add_add_bos_token(special.add_special_token.get("bos", False))
    writer.add_add_eos_token(special.add_special_token.get("eos", False))
    if special.chat_template is not None:
        writer.add_chat_template(special.chat_template)


# Our arch -> llama.cpp's (as convert_hf_to_gguf.py maps the HF classes). Mistral is llama.cpp's llama; OPT has none.
GGUF_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
              "qwen3": gguf.MODEL_ARCH.QWEN3, "gpt2": gguf.MODEL_ARCH.GPT2, "granite": gguf.MODEL_ARCH.GRANITE,
              "olmo2": gguf.MODEL_ARCH.OLMO2, "smollm3": gguf.MODEL_ARCH.SMOLLM3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
              "gemma3_text": gguf.MODEL_ARCH.GEMMA3}
# The biases each llama.cpp architecture has tensors for: (qkv, o, mlp); None: optional (its loader takes them
# if present: granite all of them, olmo2 / smollm3 / gemma2 / gemma3 those of q/k/v only).
_GGUF_BIASES = {"llama": (False, False, False), "mistral": (False, False, False), "qwen2": (True, False, False),
                "qwen3": (False, False, False), "gpt2": (True, True, True), "granite": (None, None, None),
                **dict.fromkeys(("olmo2", "smollm3", "gemma2", "gemma3_text"), (None, False, False))}
# llama.cpp's RoPE is NORM (adjacent pairs) for these: convert_hf_to_gguf.py permutes their q/k rows (LlamaModel).
_GGUF_PERMUTED = ("llama", "mistral", "granite", "smollm3")
_GGUF_ROPE_FREQS = ("llama", "mistral", "granite")  # the architectures whose loader takes a rope_freqs tensor
_GGUF_SWA = ("gemma2", "gemma3_text")  # the architectures with a window per layer (sliding_window_pattern)
_GGUF_SMOLLM3_NOPE = 4  # llama.cpp's smollm3 leaves RoPE out of every 4th layer, hard-coded (n_no_rope_layer_step)


def _gguf_gemma_scale(config: ModelConfig) -> float | None:
    """The attention scale llama.cpp's gemma2 / gemma3 compute with, as our attention_multiplier (None: 1 /
    sqrt(head_dim)): 1 / sqrt(head_dim), except for the 27B layer counts, 1 / sqrt(d_model / n_head)."""
    if (config.arch, config.n_layer) in (("gemma2", 46), ("gemma3_text", 62)):
        scale = (config.d_model / config.n_head) ** -0.5
        return None if scale == config.head_dim ** -0.5 else scale
    return None


def _gguf_switches(config: ModelConfig) -> list[tuple[str, bool, str]]:
    """(ModelConfig field, whether llama.cpp's architecture for config.arch computes what it says, what that
    architecture computes) for each switch of the newer families: a model written under an architecture that
    computes something else would load in llama.cpp and give other logits."""
    arch, c = config.arch, config
    gemma = arch in _GGUF_SWA
    qk_norm = arch in ("qwen3", "olmo2", "gemma3_text")
    nope = ([i for i in range(c.n_layer) if (i + 1) % _GGUF_SMOLLM3_NOPE == 0] or None) if arch == "smollm3" else None
    windowed = any(c.layer_window(i) is not None for i in range(c.n_layer))
    swa_scaled = windowed and c.sliding_rope_theta is None and c.rope_scaling is not None  # ours on windowed layers
    return [
        ("gate_activation", c.gate_activation == ("gelu_tanh" if gemma else "silu"),
         "GeGLU with GELU's tanh form" if gemma else "SwiGLU (SiLU gate)"),
        ("qk_norm", c.qk_norm == qk_norm, "q/k norms" if qk_norm else "no q/k norms"),
        ("qk_norm_per_head", c.qk_norm_per_head == (arch != "olmo2"),
         "q/k norms over the whole projections" if arch == "olmo2" else "q/k norms per head, where it has them"),
        ("pre_norm", c.pre_norm == (arch != "olmo2"),
         "no norms before the sublayers" if arch == "olmo2" else "a norm before each sublayer"),
        ("output_norm", c.output_norm == (arch == "olmo2" or gemma),
         "a norm after each sublayer" if arch == "olmo2" or gemma else "no norms after the sublayers"),
        ("norm_unit_offset", c.norm_unit_offset == gemma,
         "its norm weights as stored (the converter stores Gemma's 1 + weight)" if gemma else "no 1 + weight norms"),
        ("layers_without_rope", c.layers_without_rope == nope,
         f"RoPE on every layer but {nope} (every {_GGUF_SMOLLM3_NOPE}th, hard-coded)" if arch == "smollm3"
         else "RoPE on every layer"),
        ("sliding_window_layers", gemma or c.sliding_window_layers is None,
         "one attention span for every layer (no window per layer)"),
        ("sliding_rope_theta", arch == "gemma3_text" or c.sliding_rope_theta is None, "one RoPE for every layer"),
        ("rope_scaling", not swa_scaled or arch == "gemma2",
         "its windowed layers' RoPE unscaled (rope.freq_base_swa); give them their own base, as Gemma 3 does"),
        ("rope_scaling", (c.rope_scaling or {}).get("rope_type") != "llama3" or arch in _GGUF_ROPE_FREQS,
         "no rope_freqs tensor (the llama3 scaling; only llama and granite load one)"),
        ("explicit_head_dim", arch != "olmo2" or c.explicit_head_dim is None,
         "head_dim = d_model / n_head (q/k/v/o are d_model wide)"),
        ("tie_embeddings", c.tie_embeddings if arch == "gemma2" else arch != "olmo2" or not c.tie_embeddings,
         "the head as token_embd (no output tensor)" if arch == "gemma2" else "an output tensor (no tied head)"),
        ("embedding_multiplier", arch == "granite" or c.embedding_multiplier == (c.d_model ** 0.5 if gemma else 1.0),
         "token embeddings times sqrt(d_model)" if gemma else "token embeddings unscaled"),
        ("residual_multiplier", arch == "granite" or c.residual_multiplier == 1.0, "residuals unscaled"),
        ("attention_multiplier",
         arch == "granite" or c.attention_multiplier == (_gguf_gemma_scale(c) if gemma else None),
         "the attention scale 1 / sqrt(head_dim)" + (" (1 / sqrt(d_model / n_head) at the 27B layer count; "
                                                    "query_pre_attn_scalar must match)" if gemma else "")),
        ("logits_scaling", arch == "granite" or c.logits_scaling == 1.0, "logits unscaled"),
        ("attn_logit_softcapping", (c.attn_logit_softcapping is not None) == (arch == "gemma2"),
         "attention scores soft-capped (50 unless the file says)" if arch == "gemma2" else "no attention soft-capping"),
        ("final_logit_softcapping", arch == "gemma3_text" or (c.final_logit_softcapping is not None) == (
            arch == "gemma2"), "logits soft-capped (30 unless the file says)" if arch == "gemma2"
         else "no logit soft-capping"),
    ]


def _check_gguf_config(config: ModelConfig) -> None:
    if config.arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF export supports arch {tuple(GGUF_ARCHS)}; this model is arch={config.arch!r}"
                         + (" (OPT has no llama.cpp architecture)" if config.arch == "opt" else ""))
    name = GGUF_ARCHS[config.arch].name.lower()
    biases = tuple(config.has_bias(part) for part in ("qkv", "o", "mlp"))
    if any(want is not None and have != want for have, want in zip(biases, _GGUF_BIASES[config.arch])):
        has = ", ".join("optional" if want is None else str(want) for want in _GGUF_BIASES[config.arch])
        raise ValueError(f"GGUF export: this {config.arch} model has linear biases (qkv, o, mlp) = {biases}; "
                         f"llama.cpp's {name} architecture has ({has})")
    if config.rope_scaling is not None and config.rope_scaling["rope_type"] not in ("llama3", "linear"):
        raise ValueError(f"GGUF export: rope_scaling={config.rope_scaling!r} is not written to GGUF yet; plain RoPE "
                         f"(any rope_theta) and the 'llama3' and 'linear' scalings are")
    if config.num_labels:
        raise ValueError(f"GGUF export: a score model (num_labels={config.num_labels}) has no llama.cpp head")
    for field, ok, computes in _gguf_switches(config):
        if not ok:
            raise ValueError(f"GGUF export: ModelConfig.{field}={getattr(config, field)!r} cannot be written as "
                             f"llama.cpp's {name}, which computes with {computes}")


def _gguf_parts(hf_name: str, t: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """The row parts of one HF tensor, every part in nn.Linear layout and one of our parameters (on
    meta tensors too: the plan of the file, before anything is read).

    GPT-2's Conv1D weights are transposed back, and its fused c_attn is split into q/k/v again:
    llama.cpp's attn_qkv is their rows stacked, each part quantized as the parameter it is.
    """
    if config.arch == "gpt2":
        if t.dim() == 2 and hf_name.startswith("transformer.h."):
            t = t.t()
        if ".attn.c_attn." in hf_name:
            return list(t.split(config.d_model))
    return [t]


def _add_gguf_hparams(writer: gguf.GGUFWriter, config: ModelConfig) -> None:
    c = config
    if c.arch in _GGUF_SWA:  # a window per layer, the windowed layers' RoPE base (Gemma 3's local one)
        writer.add_context_length(c.max_seq_len)
        if c.sliding_window is not None:
            writer.add_sliding_window(c.sliding_window)
            writer.add_rope_freq_base_swa(c.sliding_rope_theta or c.rope_theta)
        # llama.cpp's default patterns (gemma2 every other layer, gemma3 5 of 6) written out per layer, so that
        # any other pattern (and a model without windows) is what llama.cpp computes too
        writer.add_sliding_window_pattern([c.layer_window(i) is not None for i in range(c.n_layer)])
    else:  # no window (Mistral, a Qwen2 windowed everywhere): declare the span where full attention equals ours
        writer.add_context_length(min(c.max_seq_len, c.sliding_window or c.max_seq_len))
    if c.arch == "granite":  # convert_hf_to_gguf.py's names for Granite's multipliers (logit_scale is required)
        if c.attention_multiplier is not None:
            writer.add_attention_scale(c.attention_multiplier)
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    if c.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if c.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_head)
    if config.arch == "gpt2":
        writer.add_layer_norm_eps(config.norm_eps)
    else:
        writer.add_head_count_kv(config.n_kv_head)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        if config.explicit_head_dim is not None:
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        if config.rope_scaling and config.rope_scaling["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(config.rope_scaling["factor"])
    writer.add_vocab_size(config.vocab_size)


def _rope_freqs(config: ModelConfig) -> np.ndarray | None:
    """Llama 3.1's RoPE scaling as llama.cpp takes it (convert_hf_to_gguf.py's rope_freqs tensor): per frequency,
    the factor it divides the plain RoPE frequency by, i.e. plain / scaled."""
    if not config.rope_scaling or config.rope_scaling["rope_type"] != "llama3":
        return None
    plain, _ = rope_inv_freq(config.head_dim, config.rope_theta)
    scaled, _ = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return (plain / scaled).numpy()


def export_gguf(weights, config: ModelConfig, out_path, qtype: str, tokenizer_dir, block_size: int = 256, *,
                vectors_on_grid: bool = False, grid_bits: int | None = None) -> Path:
    """Write a llama.cpp GGUF file (the architecture of GGUF_ARCHS for config.arch) whose matrices are Q8_0 /
    Q4_0 blocks of our codes, or a K-quant mix (Q4_K_M, Q4_K, Q6_K: export/kquants.py, the weights quantized
    again as llama-quantize does, except where `grid_bits` with `block_size`, a qwZ run's grid, is held exactly).

    Norm gains and biases are F32 (on the grid with `vectors_on_grid`; Gemma's norms stored as 1 + weight),
    and so is GPT-2's position table (its values on the grid, as convert_hf_to_gguf.py keeps it F32). The q/k
    rows (and biases) of the NORM-RoPE architectures (LLaMA, Mistral, Granite, SmolLM3) are permuted as
    convert_hf_to_gguf.py does; a tied LM head is left out (llama.cpp then uses token_embd). A model whose
    switches the architecture cannot compute is refused, naming the switch (_gguf_switches).
    """
    out_path = Path(out_path)
    kquant = qtype in GGUF_MIXES
    if not kquant and qtype not in GGUF_QTYPES:
        raise ValueError(f"qtype={qtype!r}: expected one of {list(GGUF_QTYPES)} (our codes) or a K-quant mix "
                         f"{list(GGUF_MIXES)}")
    bits = grid_bits if kquant else GGUF_QTYPES[qtype]  # K-quants: the grid to hold, if any
    _check_gguf_config(config)
    if bits is not None:
        _check_bits(bits, block_size)
    if not kquant and block_size % GGUF_BLOCK:
        raise ValueError(f"block_size={block_size}: GGUF needs a multiple of {GGUF_BLOCK} so that each {qtype} block "
                         f"has one of our scales (train with zero_quantization_block_size a multiple of 32)")
    hf = hf_weights(_fp32_weights(weights, config), config)  # HF names, which gguf-py maps to GGUF's; read lazily
    plan = {hf_name: _gguf_parts(hf_name, spec, config) for hf_name, spec in hf.specs.items()}  # shapes only
    for name, parts in plan.items():
        if not kquant and is_quantized(parts[0]) and parts[0].shape[1] % GGUF_BLOCK:
            raise ValueError(f"GGUF export: tensor {name!r} has rows of {parts[0].shape[1]} elements, not a multiple "
                             f"of {GGUF_BLOCK} ({qtype} blocks run along a row)")
    if out_path.is_dir():
        raise IsADirectoryError(f"{out_path} is a directory; expected the path of the .gguf file to write")

    arch = GGUF_ARCHS[config.arch]
    names = gguf.get_tensor_name_map(arch, config.n_layer)
    # llama.cpp's NORM-RoPE architectures want each q/k head's rotary halves interleaved (weights and biases);
    # the NEOX ones (qwen2, qwen3, olmo2, gemma2, gemma3) take HF's layout.
    heads = {"self_attn.q_proj": config.n_head, "self_attn.k_proj": config.n_kv_head} \
        if config.arch in _GGUF_PERMUTED else {}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.parent / f".{out_path.name}.tmp-{uuid.uuid4().hex[:8]}"
    return_freed_memory_to_the_os()  # each tensor's blocks go back to the OS once written
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
    try:
        writer.add_name(out_path.stem)
        _add_gguf_hparams(writer, config)
        writer.add_file_type(KQUANT_MIXES[qtype] if kquant else
                             gguf.LlamaFileType.MOSTLY_Q8_0 if bits == 8 else gguf.LlamaFileType.MOSTLY_Q4_0)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if bits is not None:
            writer.add_uint32("zeropp.quantization_block_size", block_size)  # provenance; llama.cpp ignores it
        _add_gguf_tokenizer(writer, tokenizer_dir, config.vocab_size)
        # The tensor infos first (shapes, types, sizes: what add_tensor would record), then the data
        # one tensor at a time, as write_tensors_to_file would lay it out.
        rope_freqs = _rope_freqs(config)
        if rope_freqs is not None:
            writer.add_tensor_info(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_freqs.shape,
                                   rope_freqs.dtype, rope_freqs.nbytes)
        gguf_names = {hf_name: names.get_name(hf_name, try_suffixes=(".weight", ".bias")) for hf_name in plan}
        tied = "output.weight" not in gguf_names.values()
        as_blocks, row_heads = {}, {}  # per HF tensor: quantized (its matrix as blocks), its q/k heads to permute
        for hf_name, parts in plan.items():
            name = gguf_names[hf_name]
            if name is None:
                raise ValueError(f"GGUF export: gguf-py has no {arch.name.lower()} tensor name for {hf_name!r}")
            rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[-1]
            row_heads[hf_name] = next((h for key, h in heads.items() if f".{key}." in hf_name), 0)
            as_blocks[hf_name] = is_quantized(parts[0]) and not name.startswith("position_embd.")
            if as_blocks[hf_name]:
                raw_dtype = kquant_type(name, cols, qtype, config.n_layer, tied) if kquant \
                    else gguf.GGMLQuantizationType[qtype]
                if raw_dtype == gguf.GGMLQuantizationType.F16:  # a K-quant's fallback for rows not a multiple of 32
                    writer.add_tensor_info(name, (rows, cols), np.dtype(np.float16), rows * cols * 2)
                else:
                    per_block, block_bytes = gguf.GGML_QUANT_SIZES[raw_dtype]
                    shape = (rows, cols // per_block * block_bytes)
                    writer.add_tensor_info(name, shape, np.dtype(np.uint8), shape[0] * shape[1], raw_dtype=raw_dtype)
            else:
                shape = (rows, *parts[0].shape[1:])
                writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if rope_freqs is not None:
            writer.write_tensor_data(rope_freqs)
        for hf_name, quantized in as_blocks.items():
            parts = _gguf_parts(hf_name, hf[hf_name], config)  # read and converted now
            n_head = row_heads[hf_name]
            orders = [_llama_row_order(p.shape[0], n_head) if n_head else None for p in parts]
            if quantized:
                if kquant:
                    blocks = [kquant_tensor(gguf_names[hf_name], p, qtype, config.n_layer, tied, row_order=order,
                                            grid=None if bits is None else (bits, block_size))[0]
                              for p, order in zip(parts, orders)]
                else:
                    blocks = [_gguf_blocks(p, bits, block_size, order) for p, order in zip(parts, orders)]
                writer.write_tensor_data(np.concatenate(blocks))
            else:
                grid = bits is not None and (is_quantized(parts[0]) or vectors_on_grid)
                values = [on_grid(p, bits, block_size) if grid else p for p in parts]
                values = torch.cat([v if order is None else v[order] for v, order in zip(values, orders)])
                if config.norm_unit_offset and hf_name.endswith("norm.weight"):
                    values = values + 1  # Gemma's norms scale by 1 + weight: stored so, as convert_hf_to_gguf.py does
                writer.write_tensor_data(values.contiguous().numpy())
            del parts
        writer.close()
        replace_output(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path
