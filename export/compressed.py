"""compressed-tensors export: a Hugging Face directory whose linear layers are weight-only int quantized with
group scales (format `pack-quantized`), the format transformers (with the `compressed-tensors` package) and
vLLM load. Built from our codes, as the GGUF export is, so a qwZ checkpoint serves unchanged.

Per quantized layer (every Linear of the blocks) model.safetensors holds `<module>.weight_packed` (int32
[out, ceil(in * bits / 32)]: the unsigned codes q + 2**(bits-1) of each row packed densely, element i at bit
i * bits, as compressed-tensors' pack_to_int32 writes them), `<module>.weight_scale` (fp32 [out, in / g]) and
`<module>.weight_shape` ([out, in]); the scheme is symmetric (no zero point), strategy `group`.

Our blocks run along W.reshape(-1) (row-major [out, in]), so a block may end inside a row or span several
rows; compressed-tensors' groups run along each row. With g = gcd(in, block_size) every group of g lies inside
one of our blocks, and takes that block's scale: exact for any block size (g = block_size when rows are a
multiple of it; g = in when a block spans whole rows). Scales are stored as fp32 (the fp16 values exactly):
compressed-tensors dequantizes in the scale's dtype, and q * s in fp16 would round.

Dense in the export, with their values on the grid (what a qwZ forward computes with): the embeddings, the
LM head and OPT's project_in / project_out (listed in `ignore`); vectors in fp32 (on the grid with
`vectors_on_grid`). GPT-2 is refused: HF stores its layers as Conv1D ([in, out]), which the format's schemes
(nn.Linear along the input dim) do not describe. A SmolLM3 is refused without its tokenizer: config.json would name
no pad_token_id, and transformers' default (128004) lies outside a smaller vocabulary.

Written tensor by tensor (the layout from the shapes first, then each weight read, packed and written before
the next one): the peak is one weight and its codes, not the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from export.quantized import _check_bits, _check_vocab, _fp32_weights, _tokenizer, is_quantized
from kernels import on_grid, pack_codes, quantize_weights, unpack_codes
from models.config import ModelConfig
from models.hf import add_fast_tokenizer, config_to_hf, staged_directory, to_hf_state_dict
from models.streaming import SafetensorsWriter

FORMAT = "pack-quantized"
SMOLLM3_DEFAULT_PAD = 128004  # SmolLM3Config's pad_token_id where config.json names none
_EMBEDDINGS = ("embed.tokens.weight", "embed.positions.weight")  # nn.Embedding in transformers: no "Linear" match
PACK = 32  # compressed-tensors packs each row in runs of 32 elements (`bits` int32 words each)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, ceil(cols * bits / 32)] of unsigned codes [rows, cols]: our dense little-endian packing of
    each row padded with zeros to a multiple of 32, read as int32 words (compressed-tensors' layout)."""
    rows, cols = codes.shape
    padded = torch.nn.functional.pad(codes, (0, -cols % PACK))
    out = torch.empty(padded.numel() * bits // 8, dtype=torch.uint8)
    words = pack_codes(padded.reshape(-1).contiguous(), bits, out).view(torch.int32).view(rows, -1)
    return words[:, :math.ceil(cols * bits / 32)].contiguous()


def _layer(weight: torch.Tensor, bits: int, block_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """(the serialized tensors of one Linear weight [out, in], its group size)."""
    rows, cols = weight.shape
    q = quantize_weights(weight.reshape(-1), bits, block_size)
    codes = unpack_codes(q.codes, bits)[:weight.numel()].view(rows, cols)
    group = math.gcd(cols, block_size)
    start = torch.arange(rows).unsqueeze(1) * cols + torch.arange(cols // group).unsqueeze(0) * group
    return {"weight_packed": pack_rows(codes, bits), "weight_scale": q.scales[start // block_size].float(),
            "weight_shape": torch.tensor([rows, cols])}, group


def _scheme(targets: list[str], bits: int, group: int) -> dict:
    return {"targets": targets, "format": FORMAT, "input_activations": None, "output_activations": None,
            "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group, "dynamic": False, "actorder": None, "block_structure": None,
                        "observer": "minmax", "observer_kwargs": {}}}


def export_compressed_tensors(weights, config: ModelConfig, out_dir, bits: int, block_size: int = 256,
                              tokenizer_dir=None, *, vectors_on_grid: bool = False) -> Path:
    """Write a compressed-tensors (pack-quantized, int `bits`, group scales) Hugging Face directory, atomically.

    `weights`: a Transformer or its state dict. `tokenizer_dir`: a SentencePiece .model file or a tokenizer
    directory, saved beside the weights (its special ids go to config.json); None writes no tokenizer.
    """
    out_dir = Path(out_dir)
    _check_bits(bits, block_size)
    if config.arch == "gpt2":
        raise ValueError("compressed-tensors export: transformers stores GPT-2's layers as Conv1D ([in, out] "
                         "weights), which compressed-tensors' schemes (nn.Linear, groups along the input dim) do not "
                         "describe; use the GGUF or low-bit export for GPT-2")
    state = _fp32_weights(weights, config)
    tokenizer = None
    if tokenizer_dir is not None:
        tokenizer = _tokenizer(tokenizer_dir)
        _check_vocab(tokenizer, config)
    elif config.arch == "smollm3" and config.vocab_size <= SMOLLM3_DEFAULT_PAD:
        raise ValueError(f"compressed-tensors export of a SmolLM3 with vocab_size={config.vocab_size} needs its "
                         f"tokenizer (tokenizer_dir): without one config.json names no pad_token_id, and transformers' "
                         f"SmolLM3Config defaults it to {SMOLLM3_DEFAULT_PAD}, outside the vocabulary, so transformers "
                         f"cannot build the embedding")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")

    # The plan, from the shapes alone: every tensor of the file, the group size of each layer.
    specs, groups, ignore = {}, {}, {"score" if config.num_labels else "lm_head"}
    layers = {}  # our name -> its HF module, for the Linear layers of the blocks
    for name, spec in state.specs.items():
        hf = to_hf_state_dict({name: spec}, config)  # one tensor; none for a tied head (transformers ties it)
        for hf_name, value in hf.items():
            module = hf_name.removesuffix(".weight")
            if is_quantized(spec) and name.startswith("blocks."):  # a Linear of the blocks
                rows, cols = value.shape
                group = math.gcd(cols, block_size)
                specs[f"{module}.weight_packed"] = torch.empty(rows, math.ceil(cols * bits / 32), dtype=torch.int32,
                                                               device="meta")
                specs[f"{module}.weight_scale"] = torch.empty(rows, cols // group, device="meta")
                specs[f"{module}.weight_shape"] = torch.empty(2, dtype=torch.int64, device="meta")
                groups.setdefault(group, []).append(module)
                layers[name] = module
                continue
            if is_quantized(spec) and name not in _EMBEDDINGS:  # the head, OPT's project_in / project_out
                ignore.add(module)
            specs[hf_name] = value
    schemes = {f"group_{i}": _scheme(["Linear"] if len(groups) == 1 else sorted(modules), bits, group)
               for i, (group, modules) in enumerate(sorted(groups.items()))}
    token_ids = None if tokenizer is None else {
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    hf_config = config_to_hf(config, torch.float32, token_ids)
    hf_config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
        "config_groups": schemes, "ignore": sorted(ignore), "kv_cache_scheme": None,
        "global_compression_ratio": None}
    hf_config["zeropp_quantization_block_size"] = block_size  # provenance; transformers keeps it as an attribute

    with staged_directory(out_dir) as tmp:
        with SafetensorsWriter(tmp / "model.safetensors", specs, metadata={"format": "pt"}) as writer:
            for name in state:  # one weight at a time
                t = state[name]
                if name in layers:
                    (value,) = to_hf_state_dict({name: t}, config).values()
                    layer, _ = _layer(value, bits, block_size)
                    for key, v in layer.items():
                        writer.write(f"{layers[name]}.{key}", v)
                    continue
                for hf_name, value in to_hf_state_dict({name: t}, config).items():
                    writer.write(hf_name, on_grid(value, bits, block_size) if is_quantized(t) or vectors_on_grid
                                 else value.contiguous())
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
            add_fast_tokenizer(tmp)  # a SentencePiece model: also the files transformers' AutoTokenizer reads
    return out_dir
