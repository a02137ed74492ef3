"""GGUF K-quants (export/kquants.py) against gguf-py's dequantizer, a loop transcribed from ggml's
dequantize_row_q4_K / _q6_K, llama.cpp's Q4_K_M type rules, and the error of the 4- and 8-bit block formats.

With GGML_LIB set to a libggml-base.so (llama-cpp-python ships one), ggml itself decodes our bytes and encodes
the same input for comparison. The perplexity table of docs/export.md is `test_perplexity_table`, off by default
(it trains a tiny model for minutes, kept under cache/): KQUANTS_PERPLEXITY=1 pytest -s ... -k perplexity
"""

import dataclasses
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

import kernels
from export.kquants import (grid_rows, kquant_summary, kquant_tensor, kquant_type, quantize_q4_k, quantize_q6_k,
                            quantize_rows)
from models.config import PRESETS
from models.transformer import Transformer, lm_loss

ENCODERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}
BLOCK_BYTES = {T.Q4_K: 144, T.Q6_K: 210}


def awkward_blocks(rng) -> np.ndarray:
    """Super-blocks that take the encoders' special cases: all zero, a constant sub-block, all positive, all
    negative, one outlier, values near fp16's smallest normal, and plain Gaussian ones at three scales."""
    g = rng.standard_normal((9, 256)).astype(np.float32)
    g[0] = 0
    g[1, :32] = 0.5
    g[2] = np.abs(g[2]) + 1
    g[3] = -np.abs(g[3]) - 0.25
    g[4, 77] = 40.0
    g[5] *= 1e-4
    g[6] *= 1e3
    g[7, ::2] = 0
    return g


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_gguf_py_reads_our_bytes_as_our_values(qtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([awkward_blocks(rng).reshape(-1), rng.standard_normal(32 * 256).astype(np.float32) * 0.02])
    blocks, values = ENCODERS[qtype](x)
    assert blocks.dtype == np.uint8 and blocks.shape == (x.size // 256, BLOCK_BYTES[qtype])
    theirs = gguf_dequantize(blocks, qtype).reshape(-1)
    assert np.array_equal(theirs, values)
    assert np.array_equal(values[:256], np.zeros(256, np.float32))  # an all-zero block stays zero
    assert np.abs(values - x).max() <= np.abs(x).max() / 8  # and nothing is far off


def ggml_q4_k_row(block: bytes) -> list[float]:
    """ggml's dequantize_row_q4_K for one block, element by element (get_scale_min_k4 unpacks the scales)."""
    d, dmin = np.frombuffer(block[:4], np.float16).astype(np.float32)
    scales, qs = block[4:16], block[16:]

    def scale_min(j):
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out = []
    for j in range(0, 8, 2):  # 64 values per 32 bytes: low nibbles, then high nibbles
        sc1, m1 = scale_min(j)
        sc2, m2 = scale_min(j + 1)
        q = qs[16 * j:16 * j + 32]
        out += [np.float32(d * sc1) * np.float32(b & 0xF) - np.float32(dmin * m1) for b in q]
        out += [np.float32(d * sc2) * np.float32(b >> 4) - np.float32(dmin * m2) for b in q]
    return out


def ggml_q6_k_row(block: bytes) -> list[float]:
    """ggml's dequantize_row_q6_K for one block, element by element."""
    ql, qh, sc = block[:128], block[128:192], np.frombuffer(block[192:208], np.int8)
    d = np.frombuffer(block[208:210], np.float16).astype(np.float32)[0]
    out = [0.0] * 256
    for half in range(2):
        for lane in range(32):
            low, high, s = ql[64 * half:], qh[32 * half + lane], 8 * half + lane // 16
            quarters = ((low[lane] & 0xF) | (high & 3) << 4, (low[lane + 32] & 0xF) | ((high >> 2) & 3) << 4,
                        (low[lane] >> 4) | ((high >> 4) & 3) << 4, (low[lane + 32] >> 4) | ((high >> 6) & 3) << 4)
            for k, q in enumerate(quarters):
                out[128 * half + 32 * k + lane] = np.float32(d * np.float32(sc[s + 2 * k])) * np.float32(q - 32)
    return out


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_ggml_loop_reads_our_bytes_as_our_values(qtype):
    """An independent decoding of ggml's layout (the C loops, not gguf-py's vectorized unpacking)."""
    x = awkward_blocks(np.random.default_rng(1))[1:]
    blocks, values = ENCODERS[qtype](x.reshape(-1))
    decode = ggml_q4_k_row if qtype == T.Q4_K else ggml_q6_k_row
    ours = np.concatenate([np.array(decode(b.tobytes()), np.float32) for b in blocks])
    assert np.array_equal(ours, values)


def rms(a, b) -> float:
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2)))

@pytest.mark.skipif(not os.environ.get("GGML_LIB"), reason="set GGML_LIB to a libggml-base.so (llama-cpp-python's)")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_ggml_itself_reads_our_bytes_and_mostly_writes_the_same(qtype):
    """ggml's own dequantize_row_* gives our values bit for bit; its quantize_row_*_ref gives the same bytes in
    most blocks (the rest a rounding step apart: our sums are fp64) and the same error."""
    import ctypes

    lib = ctypes.CDLL(os.environ["GGML_LIB"])
    kind = f"q{qtype.name[1]}_K"
    decode, encode = getattr(lib, f"dequantize_row_{kind}"), getattr(lib, f"quantize_row_{kind}_ref")
    for fn in (decode, encode):
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    rng = np.random.default_rng(7)
    x = np.concatenate([awkward_blocks(rng), rng.standard_normal((400, 256)).astype(np.float32)]).reshape(-1)
    blocks, values = ENCODERS[qtype](x)
    theirs, ref_blocks, ref_values = np.empty_like(values), np.empty_like(blocks), np.empty_like(values)
    decode(np.ascontiguousarray(blocks).ctypes.data, theirs.ctypes.data, x.size)
    encode(x.ctypes.data, ref_blocks.ctypes.data, x.size)
    decode(ref_blocks.ctypes.data, ref_values.ctypes.data, x.size)
    assert np.array_equal(theirs, values)
    assert (ref_blocks == blocks).all(1).mean() > 0.95
    assert abs(rms(values, x) / rms(ref_values, x) - 1) < 1e-3


def rtn(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Our RTN: symmetric absmax per block, fp16 scale (what export_gguf's Q4_0 / Q8_0 hold at block 32)."""
    return kernels.on_grid(torch.from_numpy(x), bits, block).numpy()


def test_error_is_below_the_32_blocks_at_the_same_bits():
    """Gaussian rows. Measured RMS (std 1): Q4_K 0.0712, ggml's Q4_0 0.0859 = our RTN int4 block 32 (the same
    rule: full levels), block 256 0.111; Q6_K 0.0178, Q8_0 0.0054 (x 3.3)."""
    x = np.random.default_rng(2).standard_normal((64, 1024)).astype(np.float32)
    q4k = rms(quantize_rows(x, T.Q4_K)[1], x)
    q6k = rms(quantize_rows(x, T.Q6_K)[1], x)
    q4_0 = rms(gguf_dequantize(gguf_quantize(x, T.Q4_0), T.Q4_0), x)
    q8_0 = rms(gguf_dequantize(gguf_quantize(x, T.Q8_0), T.Q8_0), x)
    assert q4k < 0.9 * q4_0 and q4k < 0.7 * rms(rtn(x, 4, 256), x)
    assert abs(rms(rtn(x, 4, 32), x) / q4_0 - 1) < 1e-3
    assert q6k < 4 * q8_0 and q6k < 0.3 * q4k


def test_q4_k_m_picks_llama_cpp_types():
    # use_more_bits over 8 layers: 0, 3, 6, 7 (first and last eighth, then every third)
    assert [kquant_type(f"blk.{i}.attn_v.weight", 256, "Q4_K_M", 8, False) for i in range(8)] == \
        [T.Q6_K, T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]
    assert [i for i in range(8) if kquant_type(f"blk.{i}.ffn_down.weight", 512, "Q4_K_M", 8, False) == T.Q6_K] \
        == [0, 3, 6, 7]
    assert kquant_type("blk.3.attn_qkv.weight", 256, "Q4_K_M", 8, False) == T.Q6_K  # GPT-2's fused qkv
    for name in ("blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_output.weight", "blk.3.ffn_up.weight",
                 "blk.3.ffn_gate.weight", "token_embd.weight"):
        assert kquant_type(name, 256, "Q4_K_M", 8, False) == T.Q4_K, name
    assert kquant_type("output.weight", 256, "Q4_K_M", 8, False) == T.Q6_K
    assert kquant_type("token_embd.weight", 256, "Q4_K_M", 8, True) == T.Q6_K  # a tied head
    assert kquant_type("output.weight", 96, "Q4_K_M", 8, False) == T.Q8_0
    # rows that are not whole super-blocks fall back as llama.cpp does
    assert kquant_type("blk.1.attn_q.weight", 96, "Q4_K_M", 8, False) == T.Q5_0
    assert kquant_type("blk.0.attn_v.weight", 96, "Q4_K_M", 8, False) == T.Q8_0
    assert kquant_type("blk.1.attn_q.weight", 100, "Q4_K_M", 8, False) == T.F16
    assert kquant_type("blk.0.ffn_down.weight", 256, "Q4_K", 8, False) == T.Q4_K  # pure: no mix
    assert {kquant_type(n, 256, "Q6_K", 8, False) for n in ("output.weight", "blk.1.attn_q.weight")} == {T.Q6_K}
    with pytest.raises(ValueError, match="Q4_K_S"):
        kquant_type("output.weight", 256, "Q4_K_S", 8, False)


# Our parameter names -> GGUF's, for a LLaMA-layout model (export_gguf gets them from gguf-py's tables).
GGUF_NAMES = {"embed.tokens": "token_embd", "head": "output", "attn.q_proj": "attn_q", "attn.k_proj": "attn_k",
              "attn.v_proj": "attn_v", "attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(ours: str) -> str:
    module = ours.removesuffix(".weight")
    if module.startswith("blocks."):
        _, layer, rest = module.split(".", 2)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.weight"
    return f"{GGUF_NAMES[module]}.weight"


def tiny_llama(d_model: int, d_ff: int, n_layer: int = 2, vocab: int = 320, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    config = dataclasses.replace(PRESETS["llama-tiny"], vocab_size=vocab, n_layer=n_layer, d_model=d_model, d_ff=d_ff)
    model = Transformer(config).eval()
    with torch.no_grad():  # wider than the init, so that 4-bit grids change the logits visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    return model


def requantized(model: Transformer, fmt: str) -> Transformer:
    """A copy of `model` whose matrices hold the values of `fmt`: a K-quant mix (via kquant_tensor, read back
    by gguf-py), Q4_0 as export_gguf writes it (our RTN int4, block 32), or RTN int4 at block 256."""
    copy = Transformer(model.config).eval()
    copy.load_state_dict(model.state_dict())
    n_layer, tied = model.config.n_layer, model.config.tie_embeddings
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if p.dim() != 2:
                continue
            if fmt.startswith("RTN"):
                values = rtn(p.detach().numpy(), 4, 32 if fmt == "RTN int4 B32 (= Q4_0)" else 256)
            else:
                data, qtype, _ = kquant_tensor(gguf_name(name), p, fmt, n_layer, tied)
                values = gguf_dequantize(data, qtype).reshape(p.shape)
            p.copy_(torch.from_numpy(np.asarray(values, np.float32)))
    return copy


def test_a_tiny_model_reads_back_exactly_and_falls_back_where_rows_are_short():
    model = tiny_llama(256, 256, vocab=64)
    types = {}
    for name, p in model.named_parameters():
        if p.dim() == 2:
            data, qtype, exact = kquant_tensor(gguf_name(name), p, "Q4_K_M", 2, False)
            types[gguf_name(name)] = qtype
            assert not exact
            ours = quantize_rows(p.detach().numpy(), qtype)[1]
            assert np.array_equal(gguf_dequantize(data, qtype).reshape(p.shape), ours), name
    # use_more_bits over 2 layers: layer 1 only
    assert types["output.weight"] == types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == T.Q6_K
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == types["token_embd.weight"] == T.Q4_K
    narrow = tiny_llama(96, 256, vocab=64)  # rows of 96: the attention and up/gate matrices fall back, down_proj does not
    fell = {gguf_name(n): kquant_tensor(gguf_name(n), p, "Q4_K_M", 2, False)[1]
            for n, p in narrow.named_parameters() if p.dim() == 2}
    assert fell["blk.0.attn_q.weight"] == fell["blk.0.ffn_up.weight"] == T.Q5_0
    assert fell["blk.1.attn_v.weight"] == fell["output.weight"] == T.Q8_0 and fell["blk.0.attn_v.weight"] == T.Q5_0
    assert fell["blk.1.ffn_down.weight"] == T.Q6_K and fell["blk.0.ffn_down.weight"] == T.Q4_K


@pytest.mark.parametrize("bits", [4, 3])
def test_a_qwz_grid_at_block_256_is_held_exactly_by_every_q4_k_m_type(bits):
    """Q4_K, Q6_K and the fallbacks Q5_0 / Q8_0 hold our codes and fp16 scales as they are (the bytes read back
    bit for bit as kernels' dequant(quant(W))), also with blocks spanning rows and rows permuted afterwards."""
    g = torch.Generator().manual_seed(3)
    for name, shape, qtype in (("blk.0.attn_q.weight", (6, 512), T.Q4_K), ("blk.1.ffn_down.weight", (4, 256), T.Q6_K),
                               ("blk.0.attn_q.weight", (8, 96), T.Q5_0), ("output.weight", (8, 96), T.Q8_0)):
        w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0]).unsqueeze(1)
        w[1] = 0  # an all-zero row: scale 0
        order = torch.randperm(shape[0], generator=g)
        data, got, exact = kquant_tensor(name, w, "Q4_K_M", 2, False, grid=(bits, 512), row_order=order)
        assert got == qtype and exact, name
        on_grid = kernels.on_grid(w, bits, 512)[order]
        assert torch.equal(torch.from_numpy(gguf_dequantize(data, qtype)).view(shape), on_grid), qtype
    w = torch.randn(4, 256, generator=g)
    assert grid_rows(w, T.Q4_K, 4, 64) is None and grid_rows(w, T.Q4_K, 6, 256) is None  # 4 scales / 6 bits
    assert grid_rows(w, T.Q5_0, 4, 64) is not None and grid_rows(w, T.Q6_K, 6, 256) is not None
    data, qtype, exact = kquant_tensor("blk.0.attn_q.weight", w, "Q4_K_M", 2, False, grid=(4, 64))
    assert qtype == T.Q4_K and not exact  # quantized again from the weights given
    assert np.array_equal(data, quantize_rows(w.numpy(), T.Q4_K)[0])


def write_gguf(model: Transformer, path, mix: str, grid=None) -> dict:
    """The model's matrices through kquant_tensor into a GGUF file by gguf-py's writer, as export_gguf adds
    them (raw bytes with their GGML type; F16 as fp16 values); returns the values each should read back as."""
    writer = gguf.GGUFWriter(path, "llama")
    want = {}
    for name, p in model.named_parameters():
        if p.dim() == 2:
            data, qtype, exact = kquant_tensor(gguf_name(name), p, mix, model.config.n_layer, False, grid=grid)
            writer.add_tensor(gguf_name(name), data, raw_dtype=None if qtype == T.F16 else qtype)
            want[gguf_name(name)] = (qtype, kernels.on_grid(p.detach(), *grid).numpy() if exact else
                                     np.float16(p.detach().numpy()).astype(np.float32) if qtype == T.F16 else
                                     quantize_rows(p.detach().numpy(), qtype)[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return want


@pytest.mark.parametrize("grid", [None, (4, 256)])
def test_a_gguf_file_of_kquant_tensors_reads_back(grid, tmp_path):
    model = tiny_llama(96, 256, vocab=64, seed=2)  # rows of 96 (fall back) and of 256 (down_proj)
    want = write_gguf(model, tmp_path / "m.gguf", "Q4_K_M", grid)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert set(tensors) == set(want)
    for name, (qtype, values) in want.items():
        t = tensors[name]
        assert t.tensor_type == qtype, name
        assert np.array_equal(gguf_dequantize(t.data, qtype).reshape(values.shape), values), name
    summary = kquant_summary(tmp_path / "m.gguf", grid)
    # down_proj: Q4_K (layer 0), Q6_K (layer 1); rows of 96: Q5_0, and Q8_0 for the head and layer 1's attn_v
    assert summary.startswith("1 Q4_K, 12 Q5_0, 1 Q6_K, 2 Q8_0 (5.66 bits per weight);"), summary
    assert "fell back as llama.cpp does: token_embd.weight (Q5_0), blk.0.attn_q.weight (Q5_0)" in summary
    assert ("exact: every matrix holds the 4-bit qwZ grid" in summary) == (grid is not None)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    return float((p.exp() * (p - torch.log_softmax(q_logits.double(), -1))).sum(-1).mean())


def test_q4_k_m_is_closer_to_fp32_than_q4_0():
    model = tiny_llama(256, 256, vocab=128)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        gaps = {fmt: kl(ref, requantized(model, fmt)(tokens)) for fmt in ("Q4_K_M", "Q4_K", "RTN int4 B32 (= Q4_0)")}
    assert gaps["Q4_K_M"] < gaps["Q4_K"] < gaps["RTN int4 B32 (= Q4_0)"], gaps


def trained_tiny_llama(steps: int) -> tuple[Transformer, torch.Tensor]:
    """A 4-layer LLaMA (d_model 256, d_ff 768, 3.4M parameters) trained `steps` steps of 12 x 128 tokens on the
    first 90% of the stdlib-docstring corpus (512-piece SentencePiece), and the held-out 10% as token ids.
    Both are kept under the repository's cache/ (ignored by git): training takes minutes on 2 busy cores."""
    from data.corpus import default_corpus
    from data.tokenizer import load_tokenizer, train_sentencepiece

    cache = Path(__file__).resolve().parents[2] / "cache"
    work = cache / "kquants-perplexity"
    lines = default_corpus(cache).read_text(encoding="utf-8").splitlines()
    if not (work / "sp" / "tokenizer.model").is_file():
        work.mkdir(parents=True, exist_ok=True)
        (work / "train.txt").write_text("\n".join(lines[:20000]), encoding="utf-8")
        train_sentencepiece([work / "train.txt"], work / "sp" / "tokenizer", 512)
    tok = load_tokenizer(work / "sp")
    split = int(len(lines) * 0.9)
    train_ids, held_out = (torch.tensor(tok.encode("\n".join(part)), dtype=torch.long)
                           for part in (lines[:split], lines[split:]))
    model = tiny_llama(256, 768, n_layer=4, vocab=512)
    weights = work / f"model-{steps}.pt"
    if weights.is_file():
        model.load_state_dict(torch.load(weights))
        return model.eval(), held_out
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.train()
    seq, batch = 128, 12
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, train_ids.numel() - seq - 1, (batch,), generator=g)
        sample = torch.stack([train_ids[s:s + seq + 1] for s in starts.tolist()])
        loss = lm_loss(model(sample[:, :-1]), sample[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    torch.save(model.state_dict(), weights)
    return model.eval(), held_out


@pytest.mark.skipif(not os.environ.get("KQUANTS_PERPLEXITY"), reason="set KQUANTS_PERPLEXITY=1 (trains for minutes)")
def test_perplexity_table():
    """Held-out perplexity and KL(fp32 || quantized) per token of the trained tiny LLaMA, fp32 and quantized."""
    model, held_out = trained_tiny_llama(int(os.environ.get("KQUANTS_STEPS", 300)))
    seq = 128
    windows = held_out[:(held_out.numel() - 1) // seq * seq + 1]
    x, y = windows[:-1].view(-1, seq)[:128], windows[1:].view(-1, seq)[:128]
    with torch.no_grad():
        ref = model(x)
        rows = {"fp32": (math.exp(float(lm_loss(ref, y))), 0.0)}
        for fmt in ("Q6_K", "Q4_K_M", "Q4_K", "RTN int4 B32 (= Q4_0)", "RTN int4 B256"):
            logits = requantized(model, fmt)(x)
            rows[fmt] = (math.exp(float(lm_loss(logits, y))), kl(ref, logits))
    print(f"\nheld-out tokens {x.numel()}")
    for fmt, (ppl, gap) in rows.items():
        print(f"{fmt:24s} {ppl:8.3f}  {100 * (ppl / rows['fp32'][0] - 1):+6.2f}%  KL {gap:.5f}")
    assert rows["Q6_K"][1] < rows["Q4_K_M"][1] < rows["RTN int4 B32 (= Q4_0)"][1] < rows["RTN int4 B256"][1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A 400-piece SentencePiece BPE on a few stdlib modules' docstrings (quicker than the whole corpus)."""
    import collections
    import functools
    import inspect
    import json
    import pathlib
    import re

    from data.tokenizer import train_sentencepiece

    work = tmp_path_factory.mktemp("tokenizer")
    docs = [inspect.getdoc(obj) or "" for module in (collections, functools, json, pathlib, re)
            for obj in (module, *vars(module).values()) if callable(obj) or obj is module]
    lines = (line for d in docs for line in d.splitlines() if line.strip() and line.isascii())
    (work / "text.txt").write_text("\n".join(lines))
    train_sentencepiece([work / "text.txt"], work / "sp" / "tokenizer", 400)
    return work / "sp"


@pytest.mark.parametrize("grid_bits", [None, 4])
def test_export_gguf_q4_k_m_reads_back_as_ours(grid_bits, tokenizer_dir, tmp_path):
    """export_gguf's Q4_K_M: llama.cpp's types per tensor, q/k rows in llama.cpp's order, every matrix read back
    by gguf-py as our encoders' values (grid_bits=None) or as the 4-bit block-256 qwZ grid, bit for bit."""
    from export import export_gguf
    from export.quantized import _llama_row_order

    model = tiny_llama(256, 256, vocab=416, seed=4)
    path = export_gguf(model, model.config, tmp_path / "m.gguf", "Q4_K_M", tokenizer_dir, 256, grid_bits=grid_bits)
    reader = gguf.GGUFReader(path)
    assert int(reader.fields["general.file_type"].parts[-1][0]) == gguf.LlamaFileType.MOSTLY_Q4_K_M
    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": model.config.n_head, "attn_k": model.config.n_kv_head}
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        t, w = tensors[gguf_name(name)], p.detach()
        qtype = kquant_type(t.name, w.shape[1], "Q4_K_M", 2, False)
        values = kernels.on_grid(w, 4, 256).numpy() if grid_bits else quantize_rows(w.numpy(), qtype)[1]
        head = next((n for key, n in heads.items() if f".{key}." in t.name), None)
        if head:
            values = values[_llama_row_order(w.shape[0], head).numpy()]
        assert t.tensor_type == qtype, t.name
        assert np.array_equal(gguf_dequantize(t.data, qtype).reshape(w.shape), values), t.name
    assert tensors["blk.1.attn_v.weight"].tensor_type == tensors["output.weight"].tensor_type == T.Q6_K
    assert ("exact: every matrix holds the 4-bit qwZ grid" in kquant_summary(path, grid_bits and (4, 256))) \
        == bool(grid_bits)


def test_export_script_puts_a_4_bit_export_on_q4_k_m_exactly(tokenizer_dir, tmp_path, capsys):
    """A low-bit export at 4 bits, block 256 (a qwZ run's grid) through the script: every matrix holds it."""
    from export import export_lowbit
    from scripts.export_quantized import main

    model = tiny_llama(256, 256, vocab=416, seed=5)
    export_lowbit(model, model.config, tmp_path / "int4", 4, 256, tokenizer_dir)
    main([str(tmp_path / "int4"), str(tmp_path / "m.gguf"), "--format", "gguf", "--gguf-type", "Q4_K_M"])
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{tmp_path / 'm.gguf'}: gguf Q4_K_M; 13 Q4_K, 3 Q6_K (4.92 bits per weight); exact: every matrix holds the "
        "4-bit qwZ grid (block size 256)")
    for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors:
        if t.name == "blk.1.ffn_down.weight":
            w = model.blocks[1].mlp.down_proj.weight.detach()
            assert np.array_equal(gguf_dequantize(t.data, t.tensor_type).reshape(w.shape), kernels.on_grid(w, 4, 256))
    with pytest.raises(SystemExit, match="--gguf-type is for --format gguf, not safetensors"):
        main([str(tmp_path / "int4"), str(tmp_path / "o"), "--format", "safetensors", "--gguf-type", "Q4_K_M"])


def test_export_script_puts_a_6_bit_export_on_q6_k_exactly(tokenizer_dir, tmp_path, capsys):
    """The all-Q6_K mix through the script: a 6-bit block-256 grid is held by every matrix (d = s, sc = 1);
    an 8-bit one does not fit its 6-bit codes and is quantized again, the summary says so."""
    from export import export_lowbit
    from scripts.export_quantized import main

    model = tiny_llama(256, 256, vocab=416, seed=6)
    for bits in (6, 8):
        export_lowbit(model, model.config, tmp_path / f"int{bits}", bits, 256, tokenizer_dir)
        main([str(tmp_path / f"int{bits}"), str(tmp_path / "m.gguf"), "--format", "gguf", "--gguf-type", "Q6_K"])
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith(f"{tmp_path / 'm.gguf'}: gguf Q6_K; 16 Q6_K (6.56 bits per weight); "), line
        tensors = gguf.GGUFReader(tmp_path / "m.gguf").tensors
        assert int(gguf.GGUFReader(tmp_path / "m.gguf").fields["general.file_type"].parts[-1][0]) == \
            gguf.LlamaFileType.MOSTLY_Q6_K
        if bits == 6:
            assert line.endswith("exact: every matrix holds the 6-bit qwZ grid (block size 256)"), line
            w = model.blocks[1].mlp.down_proj.weight.detach()
            t = next(t for t in tensors if t.name == "blk.1.ffn_down.weight")
            assert np.array_equal(gguf_dequantize(t.data, t.tensor_type).reshape(w.shape), kernels.on_grid(w, 6, 256))
        else:
            assert "0 of 16 matrices hold the 8-bit qwZ grid exactly, quantized again from the weights (Q4_K holds " \
                   "it at <= 4 bits, Q6_K at <= 6, blocks a multiple of 256)" in line, line
