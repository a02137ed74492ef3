"""Checks that need a CUDA GPU (not in the test suite: CI has none), printed as JSON:

    python scripts/check_cuda.py

- the Triton kernels on CUDA against the torch path on CPU, bit for bit: every bit width,
  fp32/bf16/fp16 input, fp32/fp16 scales, at the test suite's adversarial small sample and at
  1M elements (the interpreter tests in tests/kernels reach neither those sizes nor the GPU's
  own arithmetic);
- their time against a device-to-device copy of 64M fp32 elements;
- the ZeRO-3 engine on CUDA in one process (an NCCL group of one), plain and as ZeRO++ with qwZ
  int4 deltas, against the plain model's losses.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.distributed as dist

import kernels as K
from kernels.samples import received, sample, stage_view

if not hasattr(dist, "all_gather_single"):  # torch < 2.13 (e.g. a GPU image's 2.11): its older name
    dist.all_gather_single = dist.all_gather_into_tensor

N = 1_000_003  # odd: a ragged last block


def _impl(device: str) -> str:
    return "triton" if device == "cuda" else "torch"


def _quantize_case(x, bits, scale_dtype):
    def run(device):
        q = K.quantize(x.to(device), bits, 64, scale_dtype=scale_dtype, impl=_impl(device))
        return [q.codes, q.scales]
    return run


def _dequantize_case(bits):
    q = K.quantize(torch.randn(N), bits, 256, scale_dtype=torch.float16)

    def run(device):
        codes, scales = q.codes.to(device), q.scales.to(device)
        out = [K.dequantize(codes, scales, N, bits, 256, dtype=d, impl=_impl(device))
               for d in (torch.float32, torch.bfloat16, torch.float16)]
        acc = torch.linspace(-1, 1, N, device=device)
        K.dequantize(codes, scales, N, bits, 256, out=acc, accumulate=True, impl=_impl(device))
        return out + [acc]
    return run


def _transposed_case(dtype):
    x3d = stage_view(3, 2, 3, 256 * 64, dtype)

    def run(device):
        q = K.quantize_transposed(x3d.to(device), 4, 128, impl=_impl(device))
        return [q.codes, q.scales]
    return run


def _reduce_case(bits, out_bits):
    n = 2 * 128 * 100 + 5
    _, codes, scales = received(3, n, bits, 128)

    def run(device):
        c, s, impl = codes.to(device), scales.to(device), _impl(device)
        q = K.dequant_reduce_quant(c, s, 3, n, bits, 128, out_bits=out_bits, scale_dtype=torch.float16, impl=impl)
        return [K.dequant_reduce(c, s, 3, n, bits, 128, impl=impl),
                K.dequant_reduce(c, s, 3, n, bits, 128, out=torch.linspace(-1, 1, n, device=device),
                                 accumulate=True, impl=impl), q.codes, q.scales]
    return run


def kernel_cases() -> dict:
    cases = {}
    for bits in K.BITS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            large = (torch.randn(N, generator=torch.Generator().manual_seed(bits)) * 0.02).to(dtype)
            for scale_dtype in (torch.float32, torch.float16):
                for name, x in (("sample", sample(4 * 64 + 13, dtype, seed=bits)), ("1M", large)):
                    cases[f"quantize-{bits}-{dtype}-{scale_dtype}-{name}"] = _quantize_case(x, bits, scale_dtype)
        cases[f"dequantize-{bits}"] = _dequantize_case(bits)
    for dtype in (torch.float32, torch.bfloat16):
        cases[f"quantize_transposed-{dtype}"] = _transposed_case(dtype)
    for bits, out_bits in ((4, 4), (8, 4), (3, 8), (8, 8)):
        cases[f"dequant_reduce(_quant)-{bits}-{out_bits}"] = _reduce_case(bits, out_bits)
    return cases


def differences(want, got) -> list:
    """Per output tensor: the first differing byte offsets ([] where identical)."""
    out = []
    for w, g in zip(want, got):
        w, g = w.cpu().contiguous().view(torch.uint8), g.cpu().contiguous().view(torch.uint8)
        out.append("shape" if w.shape != g.shape else (w != g).nonzero().flatten()[:6].tolist())
    return out


def bandwidth(numel: int = 64 << 20) -> dict:
    """Milliseconds per call (CUDA events, mean of 20) and the time / copy's."""
    x, y = torch.randn(numel, device="cuda"), torch.empty(numel, device="cuda")

    def timed(f, reps=20):
        f()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            f()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    out = {"copy_ms": timed(lambda: y.copy_(x))}
    for bits in (8, 4):
        q = K.quantize(x, bits, 256, scale_dtype=torch.float16)
        out[f"quantize{bits}_ms"] = timed(lambda: K.quantize(x, bits, 256, scale_dtype=torch.float16))
        out[f"dequantize{bits}_ms"] = timed(lambda: K.dequantize(q.codes, q.scales, numel, bits, 256, out=y))
    for key in [k for k in out if k != "copy_ms"]:
        out[key.replace("_ms", "_time_x_copy")] = out[key] / out["copy_ms"]
    return out


def engine_on_cuda() -> dict:
    from models.config import ModelConfig
    from models.transformer import Transformer, lm_loss
    from trainer.config import OptimSection
    from trainer.optim import build_optimizer
    from zeropp.config import ZeroConfig
    from zeropp.engine import Zero3Engine

    device = torch.device("cuda")
    optim = OptimSection(lr=1e-3, weight_decay=0.1, warmup_steps=0, decay="constant", eps=1e-6)
    data = torch.randint(0, 96, (6, 4, 17), generator=torch.Generator().manual_seed(1)).to(device)

    def model():
        torch.manual_seed(0)
        return Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=96)).to(device)

    plain = model()
    plain_opt = build_optimizer(plain, optim)
    reference = []
    for b in data:
        loss = lm_loss(plain(b[:, :-1]), b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        plain_opt.zero_grad()
        reference.append(loss.item())
    out = {}
    for name, zero in (("zero3-fp32", dict(communication_data_type="fp32")),
                       ("zeropp-int4-deltas", dict(zero_quantized_weights=True, zero_quantized_weights_bits=4,
                                                   zero_quantized_weights_delta=True, zero_hpz_partition_size=0,
                                                   zero_quantized_gradients=True, zero_quantization_block_size=64))):
        try:
            engine = Zero3Engine(model(), ZeroConfig(stage=3, **zero), device=device)
            opt = engine.attach_optimizer(build_optimizer(engine.module, optim))

            losses = []
            for b in data:
                loss = lm_loss(engine(b[:, :-1]), b[:, 1:])
                engine.backward(loss)
                engine.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[name] = {"max_abs_loss_diff_vs_plain": max(abs(a - b) for a, b in zip(losses, reference)),
                         "runtime": engine.describe()}
            engine.close()
        except Exception:  # reported, the other checks still run
            out[name] = traceback.format_exc()[-1500:]
    return out


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("check_cuda.py needs a CUDA GPU: torch.cuda.is_available() is False")
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    failures = {}
    for name, run in kernel_cases().items():
        try:
            diff = differences(run("cpu"), run("cuda"))
            if any(diff):
                failures[name] = diff
        except Exception as e:  # reported per case
            failures[name] = repr(e)[:300]
    result.update(kernel_cases=len(kernel_cases()), kernel_failures=failures, bandwidth_64M=bandwidth(),
                  engine=engine_on_cuda())
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
