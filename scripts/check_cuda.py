"""Checks that need a CUDA GPU (not in the test suite: CI has none), printed as JSON:

    python scripts/check_cuda.py

- the Triton kernels on CUDA against the torch path on CPU, bit for bit: every bit width,
  fp32/bf16/fp16 input, fp32/fp16 scales, at the test suite's adversarial small sample and at
  1M elements (the interpreter tests in tests/kernels reach neither those sizes nor the GPU's
  own arithmetic);
- their time against a device-to-device copy of 64M fp32 elements;
- the ZeRO-3 engine on CUDA in one process (an NCCL group of one), plain and as ZeRO++ with qwZ
  int4 deltas, against the plain model's losses.

With `--parts training lora8b` (issue 30's memory checks on a GPU; `--work` holds their runs):
- `training`: train.py on one GPU (an NCCL group of one), ZeRO-3, bf16 autocast, the 361.6M
  `qwen2.5-0.5b` at 8 x 1024 tokens: no activation checkpointing, full checkpointing, and full
  checkpointing with the optimizer offloaded to the CPU; each run's predicted and measured
  (`max_memory_allocated`) peak, its median step time and losses (offload must equal no offload);
- `lora8b`: the README's Llama 3.1 8B LoRA command, as written but on one GPU and 3 steps, on a
  random bf16 checkpoint of that shape written here with a BPE tokenizer trained on `--data`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import kernels as K
from kernels.samples import received, sample, stage_view

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


MEMORY_LINE = re.compile(r"peak memory per rank \(max_memory_allocated\): measured (\d+)-(\d+) MB, predicted (\d+)-(\d+) MB")
ROOT = Path(__file__).resolve().parents[1]


def _launch(script: str, args: list[str], log: Path, timeout: float) -> dict:
    """One process of `script` under torchrun (an NCCL group of one): what its log says of memory,
    step time and loss, or its log's tail when it failed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", script, *args]
    start = time.time()
    try:
        with open(log, "w") as out:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    text = log.read_text(errors="replace")
    peak = MEMORY_LINE.search(text)
    if rc != 0 or not peak:
        return {"failed": rc, "log": text[-2500:]}
    steps = [float(v) for v in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    return {"measured_mb": int(peak[2]), "predicted_mb": int(peak[4]),
            "measured_over_predicted": int(peak[2]) / int(peak[4]),
            "prediction": re.search(r"predicted peak memory per rank: (.*)", text)[1],
            "median_step_ms_after_the_first_two": statistics.median(steps[2:]) if len(steps) > 2 else None,
            "losses": [float(v) for v in re.findall(r"lm loss: ([0-9.]+)", text)], "wall_s": time.time() - start}


def training_memory(work: Path, preset: str = "qwen2.5-0.5b", batch: int = 8, seq: int = 1024, steps: int = 6,
                    timeout: float = 180) -> dict:
    """train.py's predicted vs measured peak with and without activation checkpointing and offload."""
    from scripts.bench.runner import TIMED

    out = {}
    for checkpointing, offload in (("none", "none"), ("full", "none"), ("full", "cpu")):
        name = f"checkpointing-{checkpointing}-offload-{offload}"
        args = ["--config", "configs/quickstart.yaml", "--model.preset", preset, "--model.max_seq_len", str(seq),
                "--data.seq_len", str(seq), "--data.cache_dir", str(work / "cache"),
                "--train.micro_batch_size", str(batch), "--train.steps", str(steps), *TIMED,
                "--train.activation_checkpointing", checkpointing, "--zero_optimization.stage", "3",
                "--zero_optimization.offload_optimizer", offload,
                "--train.out_dir", str(work / name), "--train.overwrite", "true"]
        out[name] = _launch("train.py", args, work / f"{name}.log", timeout)
        shutil.rmtree(work / name, ignore_errors=True)  # its checkpoint: GBs of the machine's disk
    return out


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                bos_token_id=0, eos_token_id=1, pad_token_id=2,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})


def write_random_checkpoint(out: Path, shape: dict, data: Path, device: torch.device,
                            shard_bytes: int = 4 << 30) -> int:
    """A Hugging Face Llama directory of `shape` with random bf16 weights (std 0.02, norms 1) drawn on
    `device` tensor by tensor, in safetensors shards with their index, and a BPE tokenizer trained on the
    instruction set `data`; returns the checkpoint's bytes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from scripts.bench.memory import write_bpe_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape)
    config.save_pretrained(out)
    write_bpe_tokenizer(out, data)
    with torch.device("meta"):
        names = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator(device).manual_seed(0)
    shards, shard, size, total = [], {}, 0, 0
    for name, tensor_shape in names.items():
        if name.endswith("norm.weight"):
            t = torch.ones(tensor_shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(tensor_shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            shards.append(shard)
            shard, total, size = {}, total + size, 0
    shards.append(shard)
    total += size
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return total


def lora_8b(work: Path, data: Path, steps: int = 3, timeout: float = 420) -> dict:
    """The README's 8B LoRA command (finetune_alpaca_lora_zeropp.yaml, full activation checkpointing) on
    one GPU, `steps` steps."""
    hf = work / "llama3.1-8b-random"
    start = time.time()
    checkpoint_bytes = write_random_checkpoint(hf, LLAMA_8B, data, torch.device("cuda"))
    made_s = time.time() - start
    args = ["--config", "configs/finetune_alpaca_lora_zeropp.yaml", "--finetune.hf_checkpoint", str(hf),
            "--train.activation_checkpointing", "full", "--data.path", str(data), "--train.steps", str(steps),
            "--train.log_interval", "1", "--train.eval_interval", str(steps), "--train.eval_batches", "1",
            "--train.eval_at_start", "false", "--train.checkpoint_interval", "0", "--train.export_hf", "false",
            "--train.progress_bar", "false", "--train.out_dir", str(work / "lora8b"), "--train.overwrite", "true"]
    return {"checkpoint_bytes": checkpoint_bytes, "checkpoint_written_s": made_s,
            **_launch("finetune.py", args, work / "lora8b.log", timeout)}


PARTS = ("kernels", "engine", "training", "lora8b")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=["kernels", "engine"])
    p.add_argument("--work", type=Path, default=Path("runs/check_cuda"), help="the memory checks' runs and logs")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/alpaca_en_demo.json",
                   help="lora8b's instruction set (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write the JSON here, after each part")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("check_cuda.py needs a CUDA GPU: torch.cuda.is_available() is False")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    for part in args.parts:
        start = time.time()
        try:
            if part == "kernels":
                failures = {}
                for name, run in kernel_cases().items():
                    try:
                        diff = differences(run("cpu"), run("cuda"))
                        if any(diff):
                            failures[name] = diff
                    except Exception as e:  # reported per case
                        failures[name] = repr(e)[:300]
                result.update(kernel_cases=len(kernel_cases()), kernel_failures=failures, bandwidth_64M=bandwidth())
            elif part == "engine":
                result["engine"] = engine_on_cuda()
            elif part == "training":
                result["training"] = training_memory(args.work)
            else:
                result["lora8b"] = lora_8b(args.work, args.data.resolve())
        except Exception:  # reported, the other parts still run
            result[part] = traceback.format_exc()[-2000:]
        result.setdefault("part_seconds", {})[part] = round(time.time() - start, 1)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
