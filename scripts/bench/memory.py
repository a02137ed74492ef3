"""Per-rank model-state memory of the ZeRO-3 engine, measured against the formula.

    python scripts/bench/memory.py --preset gpt2-small-cpu --ranks 4 [--comm bf16]
    python scripts/bench/memory.py --activations        # issue 30's M4: activation checkpointing
    python scripts/bench/memory.py --exports     # M5: peak of consolidation / each export / the model's size
    python scripts/bench/memory.py --largest     # M2: the largest llama3-shaped model that trains, 4 ranks (hours)

Per parameter element of its 1/W shard a rank keeps the fp32 master (4 bytes), AdamW's two moments (8),
the copy in the communication dtype (c) and the fp32 gradient shard (4): (16 + c) * N / W bytes. Also:
the preallocated gather/gradient buffers, and whether they were allocated once (same storage after two
steps).
"""

import os
import re
import signal
import sys
import threading
from pathlib import Path

from scripts.bench.report import md_table
from scripts.bench.suite import main_one

TITLE = "## Per-rank model-state memory of ZeRO-3"


def buffers(engine) -> dict[int, int]:
    """Storage pointer -> bytes of every buffer the engine preallocates (gather, compute, gradient)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in engine.preallocated_buffers()}


def _measure(rank, world, preset, comm, seq, batch):
    import torch

    from models.config import ModelConfig
    from models.transformer import Transformer, lm_loss
    from trainer.config import OptimSection
    from trainer.optim import build_optimizer
    from zeropp import build_runtime
    from zeropp.config import DTYPES, ZeroConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(preset))
    n_params = sum(p.numel() for p in model.parameters())
    engine = build_runtime(model, ZeroConfig(stage=3, communication_data_type=comm), torch.device("cpu"))
    optimizer = engine.attach_optimizer(build_optimizer(engine.module, OptimSection()))
    before = buffers(engine)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1))
    for _ in range(2):
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
        engine.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
    after, state = buffers(engine), engine.model_state_bytes(optimizer)
    engine.close()
    formula = {"master": 4, "optimizer states": 8, "comm copy": DTYPES[comm].itemsize, "gradient shard": 4}
    return {"params": n_params, "measured": state, "formula": {k: v * n_params / world for k, v in formula.items()},
            "buffer_bytes": sum(after.values()), "buffers_allocated_once": before == after}


def add_args(p) -> None:
    p.add_argument("--preset", default="gpt2-small-cpu")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--comm", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--exports", action="store_true",
                   help="M5 (issue 30) instead: the peak memory of consolidation and of each export / the model's size")
    p.add_argument("--activations", action="store_true",
                   help="M4 (issue 30) instead: a step's peak memory and time with train.activation_checkpointing "
                        "none / full / every_k at 8 x 1024 tokens")
    add_largest_args(p)
    p.add_argument("--lora", action="store_true",
                   help="M3 (issue 30) instead: LoRA fine-tuning of a 1.2B llama3.2-1b-shaped checkpoint on --ranks "
                        "ranks, ZeRO++ with the frozen weights int8, then the HF and GGUF exports")


def run(args, progress=print) -> dict:
    if getattr(args, "exports", False):
        return export_peaks(progress=progress)
    if getattr(args, "activations", False):
        return activation_peaks(progress=progress)
    if getattr(args, "largest", False):
        return largest_models(args, progress=progress)
    if getattr(args, "lora", False):
        return lora_peaks(args, progress=progress)
    from trainer.spawn import run_ranks

    reports = run_ranks(_measure, args.ranks, args=(args.preset, args.comm, args.seq, args.batch), timeout=900)
    rows = []
    for rank, r in enumerate(reports):
        kinds = [(k, r["measured"].get(k, 0), f) for k, f in r["formula"].items()]
        for kind, measured, formula in kinds + [("total", sum(r["measured"].values()), sum(r["formula"].values()))]:
            rows.append({"rank": rank, "kind": kind, "measured_mb": measured / 2**20, "formula_mb": formula / 2**20,
                         "ratio": measured / formula})
    return {"preset": args.preset, "ranks": args.ranks, "comm": args.comm, "params": reports[0]["params"],
            "largest_deviation": max(abs(r["ratio"] - 1) for r in rows if r["kind"] != "total"),
            "buffer_mb": reports[0]["buffer_bytes"] / 2**20,
            "buffers_allocated_once": all(r["buffers_allocated_once"] for r in reports), "rows": rows}


def markdown(result: dict) -> str:
    if result.get("exports"):
        return exports_markdown(result)
    if result.get("activations"):
        return activations_markdown(result)
    if result.get("largest"):
        return largest_markdown(result)
    if result.get("lora"):
        return lora_markdown(result)
    return "\n".join([
        f"{result['preset']}: {result['params'] / 1e6:.2f}M parameters on {result['ranks']} ranks, {result['comm']} "
        f"communication. Largest deviation from the formula: {100 * result['largest_deviation']:.2f}%; "
        f"preallocated buffers per rank: {result['buffer_mb']:.3f} MB, allocated once: "
        f"{result['buffers_allocated_once']}.", "",
        *md_table(result["rows"], [("rank", "rank", "{}"), ("kind", "kind", "{}"), ("measured_mb", "measured MB",
                                   "{:.3f}"), ("formula_mb", "formula MB", "{:.3f}"), ("ratio", "ratio", "{:.4f}")])])


# ---------------------------------------------------------------- M5 (issue 30): streamed consolidation and export
# `--exports`: the peak resident memory of consolidating a ZeRO-3 checkpoint into a Hugging Face dir and of each
# export, each in a process of its own (VmHWM after the export minus VmHWM after the imports), / the model's fp32 size.

EXPORT_KINDS = {  # row -> what the probe process runs (scripts' main with these arguments after CKPT OUT)
    "consolidate (HF safetensors)": ("consolidate", []),
    "consolidate, HF shards": ("consolidate", ["--max-shard-size", "SHARD"]),
    "low-bit 8": ("export", ["--format", "safetensors", "--bits", "8"]),
    "low-bit 4": ("export", ["--format", "safetensors", "--bits", "4"]),
    "GGUF Q8_0": ("export", ["--format", "gguf", "--bits", "8"]),
    "compressed-tensors 4": ("export", ["--format", "compressed-tensors", "--bits", "4"]),
}
EXPORT_MODEL = dict(n_layer=8, d_model=1024, n_head=16, n_kv_head=4, d_ff=2816, vocab_size=4096, max_seq_len=256)
_EXPORT_PROBE = """
import json, sys
import gguf, sentencepiece, tokenizers  # everything the exports import, before the baseline
import export.compressed, scripts.consolidate, scripts.export_quantized
import torch
from models.config import ModelConfig
from models.transformer import Transformer

with torch.device("meta"):  # building the first model imports modules (sympy, ...): ~145 MB, whatever the model
    Transformer(ModelConfig.from_preset("llama-tiny"))


def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024


script, ckpt, out, *rest = sys.argv[1:]
before = hwm()
main = scripts.consolidate.main if script == "consolidate" else scripts.export_quantized.main
main([ckpt, out, *rest])
print(json.dumps({"before": before, "after": hwm()}))
"""


def _save_export_checkpoint(rank, world, root, model_kwargs, tokenizer):
    """A ZeRO-3 checkpoint of a fresh llama-shaped model, written as train.py writes one (no optimizer step)."""
    import dataclasses

    import torch

    from models.config import ModelConfig
    from models.transformer import Transformer
    from trainer.checkpoint import save_checkpoint
    from trainer.config import parse_args, to_dict
    from trainer.optim import build_optimizer
    from zeropp import build_runtime

    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", **model_kwargs)
    cfg = parse_args(["--zero_optimization.stage", "3", "--zero_optimization.communication_data_type", "fp32"])
    runtime = build_runtime(Transformer(config), cfg.zero_optimization, torch.device("cpu"))
    optimizer = runtime.attach_optimizer(build_optimizer(runtime.module, cfg.optim))
    state = {"format": runtime.checkpoint_format, "config": to_dict(cfg), "model_config": dataclasses.asdict(config),
             "world_size": world, "tokenizer": str(tokenizer) if tokenizer else None, "lora": None}
    path = save_checkpoint(root, 1, state, optimizer, lambda d: runtime.save(d, optimizer), rank)
    runtime.close()
    return str(path)


def export_peaks(ranks: int = 2, model_kwargs: dict | None = None, progress=print) -> dict:
    """M5: a ZeRO-3 checkpoint (`ranks` shard files) of a llama-shaped model, then consolidation and each export
    of EXPORT_KINDS in a fresh process; per row the peak (VmHWM increase) / the model's fp32 bytes."""
    import json
    import os
    import shutil
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    from data.corpus import default_corpus
    from data.tokenizer import train_sentencepiece
    from models.config import ModelConfig
    from models.transformer import Transformer
    from trainer.spawn import run_ranks

    import torch

    model_kwargs = model_kwargs or EXPORT_MODEL
    config = ModelConfig.from_preset("llama-tiny", **model_kwargs)
    with torch.device("meta"):
        shapes = [p.numel() for p in Transformer(config).parameters()]
    model_bytes, largest = 4 * sum(shapes), 4 * max(shapes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="m5-") as tmp:
        tmp = Path(tmp)
        lines = default_corpus(tmp / "cache").read_text(encoding="utf-8").splitlines()[:2000]
        (tmp / "text.txt").write_text("\n".join(lines), encoding="utf-8")
        train_sentencepiece([tmp / "text.txt"], tmp / "sp" / "tokenizer", 1000)
        progress(f"  M5: writing the ZeRO-3 checkpoint ({model_bytes / 2**20:.0f} MB of fp32 weights, {ranks} ranks)")
        ckpt = run_ranks(_save_export_checkpoint, ranks, args=(tmp / "ckpt", model_kwargs, tmp / "sp"), timeout=1800)[0]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for row, (script, rest) in EXPORT_KINDS.items():
            out = tmp / ("out.gguf" if "gguf" in rest else "out")
            rest = [str(model_bytes // 4) if a == "SHARD" else a for a in rest]
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-c", _EXPORT_PROBE, script, ckpt, str(out), *rest],
                                  capture_output=True, text=True, env=env)
            seconds = time.monotonic() - start
            if done.returncode:
                raise RuntimeError(f"M5 {row}: the probe failed:\n{done.stderr[-3000:]}")
            peak = json.loads(done.stdout.strip().splitlines()[-1])
            size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir() else out.stat().st_size
            shutil.rmtree(out) if out.is_dir() else out.unlink()
            increase = peak["after"] - peak["before"]
            rows.append({"export": row, "peak_mb": increase / 2**20, "ratio": increase / model_bytes,
                         "output_mb": size / 2**20, "seconds": seconds, "target_met": increase / model_bytes <= 0.25})
            progress(f"  M5 {row}: peak +{increase / 2**20:.1f} MB = {increase / model_bytes:.3f} of the model")
    words = (f"llama-shaped, {config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads / "
             f"{config.n_kv_head} KV heads, d_ff {config.d_ff}, vocabulary {config.vocab_size}")
    return {"exports": True, "model": words, "params": sum(shapes), "model_mb": model_bytes / 2**20,
            "largest_tensor_mb": largest / 2**20, "ranks": ranks, "rows": rows}


def exports_markdown(result: dict) -> str:
    return "\n".join([
        f"{result['model']}: {result['params'] / 1e6:.1f}M parameters, {result['model_mb']:.0f} MB in fp32 (largest "
        f"tensor {result['largest_tensor_mb']:.1f} MB), a ZeRO-3 checkpoint of {result['ranks']} shard files. Each "
        f"row runs in a process of its own; peak = its VmHWM after the export minus after the imports. Target (M5): "
        f"peak / model <= 0.25.", "",
        *md_table(result["rows"], [("export", "export", "{}"), ("peak_mb", "peak MB", "{:.1f}"),
                                   ("ratio", "peak / model", "{:.3f}"), ("output_mb", "output MB", "{:.1f}"),
                                   ("seconds", "seconds", "{:.1f}"), ("target_met", "<= 0.25", "{}")])])


# ---------------------------------------------------------------- M4 (issue 30): activation checkpointing
# `--activations`: training steps of a llama-shaped model at 8 x 1024 tokens with train.activation_checkpointing
# none, full and every_k (k = 2), each in a process of its own (VmHWM only rises); per variant the step's time
# and its peak resident memory above what the process held before it (model, AdamW states, the batch).

ACTIVATION_TITLE = "## M4: activation checkpointing, memory and time of a step"
ACTIVATION_MODEL = dict(n_layer=8, d_model=256, n_head=4, n_kv_head=4, d_ff=688, vocab_size=4096, max_seq_len=1024)
ACTIVATION_MODES = ("none", "full", "every_k")


def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _activation_variant(mode, model_kwargs, batch, seq, steps, precision, part, results):
    """One variant, in a fresh process. A warm-up step first (AdamW's states and the gradients exist after it,
    and stay). part "time": `steps` timed steps as training runs them (the allocator keeps what it freed, nothing
    is faulted in anew), then a resident-memory step: VmHWM with glibc's default allocation, fragmentation
    included. part "memory" (started with MALLOC_MMAP_THRESHOLD_=65536: every allocation over 64 KB its own
    mapping, returned when freed): the peak of the live tensors, as CUDA's max_memory_allocated counts them. A
    memory step starts after glibc gave back what is free (malloc_trim) and the high-water mark was reset to
    the current VmRSS (/proc/self/clear_refs 5)."""
    import ctypes
    import gc
    import time

    import torch

    from models.config import ModelConfig
    from models.transformer import Transformer, lm_loss
    from trainer.activation_checkpointing import apply_activation_checkpointing
    from trainer.config import OptimSection
    from trainer.optim import build_optimizer
    from trainer.precision import autocast_for, compute_dtype

    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = Transformer(ModelConfig.from_preset("llama-tiny", **model_kwargs))
    chosen = apply_activation_checkpointing(model, mode, 2)
    optimizer = build_optimizer(model, OptimSection())
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))

    def step() -> tuple[float, int, int]:
        """(loss, VmRSS after the forward, VmHWM after the backward): the activations' memory, before the
        optimizer's own temporaries."""
        with autocast_for(precision, device):
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        held = _status_kb("VmRSS")  # the forward's activations (and logits) are all there now
        loss.backward()
        peak = _status_kb("VmHWM")
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss.item(), held, peak

    step()
    times = []
    for _ in range(steps if part == "time" else 0):
        wall, cpu = time.perf_counter(), time.process_time()
        loss, _, _ = step()
        times.append({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "loss": loss})
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    loss, held, peak = step()
    results.put({"mode": mode, "blocks": chosen, "dtype": str(compute_dtype(precision, device)).replace("torch.", ""),
                 "times": times, "peak": peak - base, "after_forward": held - base, "loss": loss})


def activation_peaks(batch: int = 8, seq: int = 1024, steps: int = 2, precision: str = "auto",
                     model_kwargs: dict | None = None, progress=print) -> dict:
    """M4: each mode of ACTIVATION_MODES in two spawned processes, one after the other (_activation_variant:
    its time and resident peak, and its tensors' peak); the ratios full / none of the peaks and of the step's
    time (the fastest step's CPU time, 1 thread: steadier than wall time on a shared machine; both reported)."""
    import multiprocessing as mp
    import os

    from models.config import ModelConfig
    from scripts.bench.runner import model_facts, model_words

    model_kwargs = {**(model_kwargs or ACTIVATION_MODEL), "max_seq_len": max(seq, 1)}
    facts = model_facts(ModelConfig.from_preset("llama-tiny", **model_kwargs), "llama-style", seq)
    ctx = mp.get_context("spawn")

    def variant(mode: str, part: str) -> dict:
        results = ctx.Queue()
        proc = ctx.Process(target=_activation_variant,
                           args=(mode, model_kwargs, batch, seq, steps, precision, part, results))
        saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        if part == "memory":  # read by glibc when the process starts
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        try:
            proc.start()
        finally:
            if part == "memory":
                os.environ.pop("MALLOC_MMAP_THRESHOLD_") if saved is None else \
                    os.environ.__setitem__("MALLOC_MMAP_THRESHOLD_", saved)
        out = results.get(timeout=3600)
        proc.join()
        return out

    runs = {}
    for mode in ACTIVATION_MODES:
        runs[mode] = {"time": variant(mode, "time"), "memory": variant(mode, "memory")}
        t, m = runs[mode]["time"], runs[mode]["memory"]
        progress(f"  M4 {mode}: peak +{m['peak'] / 2**20:.0f} MB of tensors, +{t['peak'] / 2**20:.0f} MB resident; "
                 f"step {min(s['cpu'] for s in t['times']):.2f} s CPU")

    def fastest(mode, clock):
        return min(s[clock] for s in runs[mode]["time"]["times"])

    rows = []
    none = runs["none"]
    for mode, run in runs.items():
        t, m = run["time"], run["memory"]
        rows.append({"mode": mode if mode != "every_k" else "every_k (k = 2)", "blocks": len(t["blocks"]),
                     "tensors_mb": m["peak"] / 2**20, "tensors_ratio": m["peak"] / none["memory"]["peak"],
                     "forward_mb": m["after_forward"] / 2**20,
                     "rss_mb": t["peak"] / 2**20, "rss_ratio": t["peak"] / none["time"]["peak"],
                     "cpu_s": fastest(mode, "cpu"), "time_ratio": fastest(mode, "cpu") / fastest("none", "cpu"),
                     "wall_s": fastest(mode, "wall"), "wall_ratio": fastest(mode, "wall") / fastest("none", "wall"),
                     "losses": [s["loss"] for s in t["times"]] + [t["loss"], m["loss"]]})
    full = next(r for r in rows if r["mode"] == "full")
    return {"activations": True, "model": model_words(facts), "params": facts["params"], "batch": batch, "seq": seq,
            "dtype": none["time"]["dtype"], "steps": steps, "rows": rows, "memory_ratio": full["tensors_ratio"],
            "rss_ratio": full["rss_ratio"], "time_ratio": full["time_ratio"],
            "same_loss": len({tuple(r["losses"]) for r in rows}) == 1,
            "ok": full["tensors_ratio"] <= 0.3 and full["time_ratio"] <= 1.35}


def activations_markdown(result: dict) -> str:
    return "\n".join([
        f"{result['model']}, micro-batch {result['batch']} x {result['seq']} tokens, {result['dtype']} compute, 1 "
        f"thread, two processes per variant (time and resident peak; tensors' peak). Memory: the peak of a step's "
        f"forward and backward above what the process held before it (model, gradients, AdamW states, batch), of "
        f"the live tensors (every allocation over 64 KB mapped and unmapped on its own, as CUDA's "
        f"max_memory_allocated counts) and resident (VmHWM with glibc's default allocation, "
        f"fragmentation included); after forward: the tensors held when the loss is computed. Time: the fastest of "
        f"{result['steps']} steady steps. Target (M4): full / none <= 0.3 in memory, <= 1.35 in time: "
        f"{result['memory_ratio']:.3f} (resident {result['rss_ratio']:.3f}) and {result['time_ratio']:.3f} "
        f"({'met' if result['ok'] else 'not met'}); the same losses in every variant: {result['same_loss']}.", "",
        *md_table(result["rows"], [("mode", "train.activation_checkpointing", "{}"), ("blocks", "blocks", "{}"),
                                   ("tensors_mb", "peak MB", "{:.0f}"), ("tensors_ratio", "/ none", "{:.3f}"),
                                   ("forward_mb", "after forward MB", "{:.0f}"),
                                   ("rss_mb", "resident peak MB", "{:.0f}"), ("rss_ratio", "/ none", "{:.3f}"),
                                   ("cpu_s", "step CPU s", "{:.2f}"), ("time_ratio", "/ none", "{:.3f}"),
                                   ("wall_s", "step wall s", "{:.2f}"), ("wall_ratio", "/ none", "{:.3f}")])])


# ---------------------------------------------------------------- M2 (issue 30): the largest model that trains
# `--largest`: for each runtime, the most llama3-shaped layers at a fixed width (--width; llama3.2-1b's by default,
# the embedded corpus' 4096-token vocabulary, tied head) that train LARGEST_STEPS steps of micro-batch 1 x --seq
# tokens in fp32 on --ranks ranks. n_layer doubles from --start-layers until a trial does not fit, then bisects.
# Each trial is one torchrun of this script's --worker (the Trainer, as train.py runs it, with the runtime's own
# initialization), watched from here: every 0.2 s the VmRSS of its whole process tree is summed, and the tree is
# killed ("does not fit") when the sum passes --budget-gb (or the machine's MemAvailable falls under
# --min-available-gb), before the machine would swap or kill anyone.

LARGEST_TITLE = "## M2: the largest model that trains, 4 ranks"
LARGEST_STEPS, LARGEST_MICRO_BATCH = 3, 1
LARGEST_RUNTIMES = {  # key -> label (all fp32 weights, gathers, reduces and compute)
    "today": "ours before issue 30 (train.py of --today-ref): the full fp32 model built on every rank, then sharded",
    "ours": "ours: ZeRO-3 (fp32 wire), meta model, each rank reads only its shards",
    "ours-sync": "ours, overlap_comm false: one gradient buffer (reduces not overlapped), nothing prefetched",
    "ours-sync-ac": "ours, overlap_comm false and train.activation_checkpointing full",
    "fsdp2": "FSDP2 fully_shard, meta model, to_empty + shards filled",
    "deepspeed": "DeepSpeed ZeRO-3, zero.Init + GatheredParameters",
}
LARGEST_ZERO = ["--zero_optimization.stage", "3", "--zero_optimization.communication_data_type", "fp32"]
LARGEST_EXTRA = {"ours-sync": ["--zero_optimization.overlap_comm", "false"],  # key -> its own config arguments
                 "ours-sync-ac": ["--zero_optimization.overlap_comm", "false", "--train.activation_checkpointing", "full"]}
TODAY_REF = "fff09d2"  # the last commit before issue 30's sharded initialization


def add_largest_args(p) -> None:
    p.add_argument("--largest", action="store_true",
                   help="M2 (issue 30) instead: per runtime, the most layers at a fixed llama3 width that train "
                        f"{LARGEST_STEPS} steps on --ranks ranks within --budget-gb (each trial killed past it)")
    p.add_argument("--largest-runtimes", nargs="+", choices=list(LARGEST_RUNTIMES), default=list(LARGEST_RUNTIMES))
    p.add_argument("--width", default="2048,8192,32,8",
                   help="d_model,d_ff,n_head,n_kv_head of the llama3.2-1b-shaped model (default %(default)s)")
    p.add_argument("--budget-gb", type=float, default=20.0,
                   help="GiB of summed VmRSS of a trial's processes past which it does not fit (default %(default)s)")
    p.add_argument("--min-available-gb", type=float, default=1.0,
                   help="a trial also does not fit when the machine's MemAvailable falls under this (default "
                        "%(default)s GiB)")
    p.add_argument("--start-layers", type=int, default=2, help="the first trial's n_layer (default %(default)s)")
    p.add_argument("--max-layers", type=int, default=1024, help="stop doubling here (default %(default)s)")
    p.add_argument("--trial-timeout", type=float, default=3600, help="seconds per trial (default %(default)s)")
    p.add_argument("--today-ref", default=TODAY_REF,
                   help="the commit whose train.py the 'today' runtime runs, from a git worktree (default %(default)s)")


def _largest_train_args(width: str, seq: int) -> list[str]:
    """The config arguments of every trial but n_layer: the width, the embedded corpus, 3 steps, fp32."""
    from scripts.bench.runner import train_args

    d_model, d_ff, n_head, n_kv_head = (int(v) for v in width.split(","))
    model = ["--model.preset", "llama3.2-1b", "--model.d_model", str(d_model), "--model.d_ff", str(d_ff),
             "--model.n_head", str(n_head), "--model.n_kv_head", str(n_kv_head), "--model.max_seq_len", str(seq)]
    return [*train_args(LARGEST_MICRO_BATCH, LARGEST_STEPS, model=model, seq=seq), "--train.precision", "fp32",
            *LARGEST_ZERO]


def _deepspeed_memory_config(d_model: int) -> dict:
    """DeepSpeed ZeRO-3 set for the largest model, as its docs advise: transformers' "auto" buckets for this
    width (reduce d^2, prefetch 0.9 d^2 numel: the defaults, 5e8 / 5e7, would hold GBs), and parameters
    released after each use and re-gathered for the backward (stage3_max_live_parameters and
    stage3_max_reuse_distance 0; the defaults, 1e9, keep up to 1e9 gathered elements), as ours does."""
    return {"reduce_bucket_size": d_model * d_model, "stage3_prefetch_bucket_size": int(0.9 * d_model * d_model),
            "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}


def _largest_build_runtime(key: str, cfg):
    """The Trainer's build_runtime for an M2 runtime (but "today", which is another commit's train.py)."""
    from zeropp import build_runtime

    if key.startswith("ours"):
        return build_runtime

    from scripts.bench import peers

    if key == "fsdp2":
        return lambda model, zero_cfg, device, tp, weights=None: peers.FSDP2(model, cfg, weights=weights,
                                                                             device=device)
    zero = _deepspeed_memory_config(cfg.model.d_model or 2048)
    return lambda model, zero_cfg, device, tp, weights=None: peers.DeepSpeed(model, cfg, zero=zero, weights=weights)


def worker(argv: list[str]) -> int:
    """`--worker KEY OUT [train.py config arguments]`: one rank of an M2 trial, under torchrun; writes
    OUT/rank<r>.json (its peak memory, measured and predicted, and the losses)."""
    import json
    from pathlib import Path

    from trainer.config import parse_args
    from trainer.loop import Trainer

    key, out, cfg = argv[0], Path(argv[1]), parse_args(argv[2:])
    trainer = Trainer(cfg, build_runtime=_largest_build_runtime(key, cfg))
    trainer.save = lambda: None  # no end-of-run checkpoint: M2 measures training (a save's peak is M5's)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    measured, predicted = result.peak_memory
    (out / f"rank{trainer.env.rank}.json").write_text(json.dumps(
        {"measured": measured, "predicted": predicted, "losses": result.losses, "params": trainer.n_params}))
    return 0


def _proc_tree(root: int) -> dict[int, int]:
    """pid -> start time (clock ticks since boot) of `root` and every live process below it (zombies, which
    hold no memory, left out)."""
    children: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: ppid (the stat's 4th field)
        if fields[0] not in "ZX":  # the state
            start[pid] = int(fields[19])  # the 22nd field: starttime
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            if pid in start:
                tree[pid] = start[pid]
            todo.extend(children.get(pid, []))  # (a zombie's children are alive)
    return tree


def _vm_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


class _TreeWatch(threading.Thread):
    """Sums the VmRSS of a trial's process tree every `interval` s; past `budget` bytes (or with the machine's
    MemAvailable under `min_available`) it kills every process of the tree, by pid. Remembers every process it
    saw (pid + start time, so a reused pid is never hit), so that `kill_all` also reaches ranks whose launcher
    died (torchrun starts each rank in a session of its own)."""

    def __init__(self, root: int, budget: int, min_available: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.root, self.budget, self.min_available, self.interval = root, budget, min_available, interval
        self.seen: dict[int, int] = {}
        self.peak, self.killed = 0, None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            tree = _proc_tree(self.root)
            self.seen.update(tree)
            total = sum(_vm_rss(pid) for pid in tree)
            self.peak = max(self.peak, total)
            available = _mem_available()
            if total > self.budget or available < self.min_available:
                self.killed = (f"its processes' VmRSS reached {total / 2**30:.2f} GiB > the budget "
                               f"{self.budget / 2**30:.2f} GiB" if total > self.budget else
                               f"the machine's MemAvailable fell to {available / 2**30:.2f} GiB (its processes: "
                               f"{total / 2**30:.2f} GiB)")
                self.kill_all()
                return
            self._halt.wait(self.interval)

    def kill_all(self) -> None:
        for pid, start in self.seen.items():
            if _proc_tree(pid).get(pid) == start:  # still that process
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def _today_checkout(root: Path, ref: str) -> Path:
    """A git worktree of `ref` under `root` (made once; largest_models removes it)."""
    import subprocess

    from scripts.bench.runner import ROOT

    checkout = root / "today-checkout"
    if not checkout.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(checkout), ref], cwd=ROOT, check=True,
                       capture_output=True)
    return checkout


def _today_result(text: str, ranks: int) -> dict:
    """The peak and losses an earlier train.py logs: rank 0's largest "memory (MB)" (its VmHWM) and "lm loss"."""
    peak = max(float(m) for m in re.findall(r"memory \(MB\): ([\d.]+)", text)) * 2**20
    losses = {m[0]: float(m[1]) for m in re.findall(r"iteration (\d+)/\d+ \| lm loss: ([\d.]+)", text)}
    return {"measured": [int(peak)] * ranks, "predicted": None, "losses": losses}


def _largest_trial(key: str, n_layer: int, base: list[str], args, root: Path) -> dict:
    """One trial: KEY at n_layer, in a torchrun of its own under the watch -> {fit, why, ...}. "today" runs the
    train.py of --today-ref (its own configs), the others this checkout's --worker."""
    import json
    import subprocess
    import time

    from scripts.bench.runner import ROOT, error_tail

    out = root / f"{key}-{n_layer:04d}"
    out.mkdir(parents=True, exist_ok=True)
    cwd, script, config = ROOT, [str(Path(__file__).resolve()), "--worker", key, str(out)], base
    if key == "today":
        cwd = _today_checkout(root, args.today_ref)
        script = [str(cwd / "train.py")]
        config = [a.replace(str(ROOT / "configs"), str(cwd / "configs")) for a in base]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           *script, *config, *LARGEST_EXTRA.get(key, []), "--model.n_layer", str(n_layer),
           "--train.out_dir", str(out / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    begin = time.monotonic()
    with open(out / "output.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
        watch = _TreeWatch(proc.pid, int(args.budget_gb * 2**30), int(args.min_available_gb * 2**30))
        watch.start()
        try:
            rc = proc.wait(timeout=args.trial_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        watch.stop()
        watch.kill_all()  # whatever is left of it (a timed-out trial, ranks orphaned by their launcher)
        proc.wait()
    trial = {"n_layer": n_layer, "seconds": time.monotonic() - begin, "tree_peak": watch.peak, "log": str(out)}
    text = (out / "output.log").read_text(errors="replace")
    if watch.killed and key == "today" and f"iteration {LARGEST_STEPS}/{LARGEST_STEPS} | lm loss" in text:
        # its train.py always saves a checkpoint at the end; the steps M2 measures were done
        return {**trial, "fit": True, "why": f"trained; killed in the end-of-run save ({watch.killed})",
                **_today_result(text, args.ranks), "params": None}
    if watch.killed:
        return {**trial, "fit": False, "why": watch.killed}
    if rc is None:
        return {**trial, "fit": None, "why": f"timed out after {args.trial_timeout:.0f} s"}
    if rc != 0:
        oom = re.search(r"SIGKILL|exitcode\s*:\s*-9|can't allocate memory|MemoryError|std::bad_alloc", text)
        return {**trial, "fit": False if oom else None,
                "why": ("out of memory: " if oom else "failed: ") + error_tail(text)}
    if key == "today":
        return {**trial, "fit": True, "why": "", **_today_result(text, args.ranks), "params": None}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    return {**trial, "fit": True, "why": "", "measured": [r["measured"] for r in ranks],
            "predicted": [r["predicted"] for r in ranks], "losses": ranks[0]["losses"], "params": ranks[0]["params"]}


def largest_search(fits, start: int, max_layers: int) -> tuple[int, int | None, int | None]:
    """The largest n for which `fits(n)` (True / False, or None for an error) is True, assuming it holds up to
    some n and not past it: doubling from `start` (the last step capped at `max_layers`) to the first n that does
    not fit, then bisecting. -> (largest that fits or 0, smallest seen not to fit or None, the n that erred or
    None)."""
    fit, no_fit, n = 0, None, start
    while n <= max_layers:  # doubling
        ok = fits(n)
        if ok is None:
            return fit, no_fit, n
        if not ok:
            no_fit = n
            break
        fit, n = n, 2 * n if n == max_layers or 2 * n <= max_layers else max_layers
    while no_fit is not None and no_fit - fit > 1:  # bisection
        mid = (fit + no_fit) // 2
        ok = fits(mid)
        if ok is None:
            return fit, no_fit, mid
        fit, no_fit = (mid, no_fit) if ok else (fit, mid)
    return fit, no_fit, None


def _compare_losses(rows: list[dict]) -> None:
    """Each row's "loss_vs_ours": the largest difference of its losses from ours at the largest n_layer both
    trained (the same initial weights and data: ~0 in fp32), None without such an n_layer."""
    ours = {t["n_layer"]: t["losses"] for r in rows if r["key"] == "ours" for t in r["trials"] if t["fit"]}
    for r in rows:
        common = [t for t in r["trials"] if t["fit"] and t["n_layer"] in ours]
        if r["key"] not in ("ours", "today") and common:  # today starts from other weights
            t = max(common, key=lambda t: t["n_layer"])
            r["loss_vs_ours"] = max(abs(v - ours[t["n_layer"]][k]) for k, v in t["losses"].items())
            r["loss_vs_ours_at"] = t["n_layer"]


def largest_models(args, progress=print) -> dict:
    """M2: per runtime of --largest-runtimes, the largest n_layer whose trial fits (_largest_trial), by doubling
    from --start-layers, then bisecting between the last that fit and the first that did not."""
    import subprocess
    import tempfile

    from scripts.bench.runner import ROOT, model_summary

    base = _largest_train_args(args.width, args.seq)
    root = Path(getattr(args, "out", None) or tempfile.mkdtemp(prefix="m2-")).resolve() / "m2-trials"  # (today: another cwd)
    # the tokenizer and token store, made once here, not inside the first trial (its rank 0 would count them)
    subprocess.run([sys.executable, "-c", "import sys\nfrom trainer.config import parse_args\nfrom "
                    "trainer.pretrain_data import prepare_pretraining\ncfg = parse_args(sys.argv[1:])\n"
                    "prepare_pretraining(cfg.data, cfg.data.seq_len, cfg.train.seed, 0)", *base],
                   cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    params = {}

    def params_of(n: int) -> int:
        if n not in params:
            params[n] = model_summary(base + ["--model.n_layer", str(n)])["params"]
        return params[n]

    rows = []
    for key in args.largest_runtimes:
        trials: dict[int, dict] = {}

        def fits(n: int) -> bool | None:
            t = trials[n] = _largest_trial(key, n, base, args, root)
            verdict = {True: "fits", False: "does not fit", None: "ERROR"}[t["fit"]]
            peak = f", per rank {max(t['measured']) / 2**30:.2f} GiB" if t["fit"] else ""
            why = f": {t['why']}" if t["why"] else ""
            progress(f"  M2 {key} n_layer {n} ({params_of(n) / 1e6:.0f}M): {verdict} (tree peak "
                     f"{t['tree_peak'] / 2**30:.2f} GiB{peak}, {t['seconds']:.0f} s){why}")
            return t["fit"]

        fit, no_fit, failed = largest_search(fits, args.start_layers, args.max_layers)
        error = trials[failed]["why"] if failed else None if fit else "not even 1 layer fits"
        best = trials.get(fit, {})
        ours = "predicted" if key.startswith("ours") else None  # the Trainer predicts our runtime's peak only
        rows.append({"key": key, "label": LARGEST_RUNTIMES[key], "n_layer": fit, "params": params_of(fit) if fit else 0,
                     "first_not_fitting": no_fit, "measured_gb": max(best["measured"]) / 2**30 if fit else None,
                     "predicted_gb": max(best[ours]) / 2**30 if fit and ours else None,
                     "tree_peak_gb": best["tree_peak"] / 2**30 if fit else None,
                     "first_loss": best["losses"].get("1") if fit else None, "error": error,
                     "ok": error is None and fit > 0, "trials": [trials[k] for k in sorted(trials)]})
    if (root / "today-checkout").exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(root / "today-checkout")], cwd=ROOT, check=True)
    _compare_losses(rows)
    by_key = {r["key"]: r for r in rows if r["ok"]}
    peers_best = max((r["params"] for k, r in by_key.items() if k in ("fsdp2", "deepspeed")), default=None)
    # against the peers our best setting that they run too (no activation checkpointing); against today any
    like_peers = max((r["params"] for k, r in by_key.items() if k in ("ours", "ours-sync")), default=None)
    ours = max((r["params"] for k, r in by_key.items() if k.startswith("ours")), default=None)
    today = by_key.get("today")
    summary = {"vs_best_peer": like_peers / peers_best if like_peers and peers_best else None,
               "vs_today": ours / today["params"] if ours and today else None}
    summary["target_met"] = (None if None in summary.values() else
                             summary["vs_best_peer"] >= 1 and summary["vs_today"] >= 2)
    d_model, d_ff, n_head, n_kv_head = (int(v) for v in args.width.split(","))
    return {"largest": True, "ranks": args.ranks, "budget_gb": args.budget_gb, "seq": args.seq,
            "micro_batch": LARGEST_MICRO_BATCH, "steps": LARGEST_STEPS, "d_model": d_model, "d_ff": d_ff,
            "n_head": n_head, "n_kv_head": n_kv_head, "per_layer": params_of(2) - params_of(1),
            "deepspeed_zero": _deepspeed_memory_config(d_model), "args": base, "rows": rows, **summary}


def largest_markdown(result: dict) -> str:
    def ratio(v):
        return "–" if v is None else f"{v:.2f}x"

    rows = [dict(r, trials_cell=", ".join(f"{t['n_layer']}{'' if t['fit'] else ' no' if t['fit'] is False else ' err'}"
                                          for t in r["trials"]),
                 params_m=r["params"] / 1e6)
            for r in result["rows"]]
    return "\n".join([
        f"llama3.2-1b-shaped: d_model {result['d_model']}, d_ff {result['d_ff']}, {result['n_head']} heads / "
        f"{result['n_kv_head']} KV heads, the embedded corpus' vocabulary (tied head), "
        f"{result['per_layer'] / 1e6:.1f}M parameters per layer; {result['steps']} steps of micro-batch "
        f"{result['micro_batch']} x {result['seq']} tokens on {result['ranks']} ranks, fp32 everywhere. A trial "
        f"fits when it finishes with its processes' summed VmRSS never over {result['budget_gb']:.1f} GiB "
        f"(sampled every 0.2 s; killed past it); n_layer doubled, then bisected. DeepSpeed's zero_optimization: "
        f"`{result['deepspeed_zero']}`. Ours (the best row the peers also run as configured: without activation "
        f"checkpointing) / the best peer: {ratio(result['vs_best_peer'])}; ours (any row) / today's: "
        f"{ratio(result['vs_today'])} (target M2: >= 1 and >= 2: "
        f"{ {True: 'met', False: 'not met', None: 'incomplete'}[result['target_met']] }).", "",
        *md_table(rows, [("label", "runtime", "{}"), ("n_layer", "largest n_layer", "{}"),
                         ("params_m", "parameters (M)", "{:.0f}"), ("first_not_fitting", "first n_layer over", "{}"),
                         ("measured_gb", "peak per rank GiB (VmHWM)", "{:.2f}"),
                         ("predicted_gb", "predicted GiB", "{:.2f}"), ("tree_peak_gb", "all processes GiB", "{:.2f}"),
                         ("first_loss", "loss at step 1", "{:.4f}"),
                         ("loss_vs_ours", "largest loss difference from ours (same n_layer)", "{:.1e}"),
                         ("trials_cell", "trials", "{}")])])


if __name__ == "__main__":
    sys.exit(main_one("memory"))


# ---------------------------------------------------------------- M3 (issue 30): LoRA of a 1.2B checkpoint
# `--lora`: a llama3.2-1b-shaped Hugging Face checkpoint (random bf16 weights from transformers, 128256-token
# vocabulary, tied, Llama 3 RoPE scaling) with a byte-level BPE tokenizer trained here on the Alpaca records,
# LoRA-fine-tuned for 3 steps on --ranks ranks (2 per node) under ZeRO++ with the frozen weights held as int8
# codes (configs/finetune_alpaca_lora_zeropp.yaml), then consolidated to an HF directory and exported to GGUF Q8_0.
# The training peak per rank is the run's own line (VmHWM, with its prediction); each export's peak is its
# process' maximum resident set (/usr/bin/time).

LORA_HF = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
               rope_theta=500000.0, bos_token_id=0, eos_token_id=1, pad_token_id=2,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
def write_bpe_tokenizer(out: Path, data: Path, vocab_size: int = 8192) -> None:
    """A byte-level BPE tokenizer trained on the instruction set `data`, with Llama 3's special tokens (ids 0-2)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    records = json.loads(Path(data).read_text())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((" ".join(r[k] for k in ("instruction", "input", "output")) for r in records),
                            trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin_of_text|>",
                                                "<|end_of_text|>", "<|pad|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tok.save(str(Path(out) / "tokenizer.json"))
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}))


_MAKE_LORA_CHECKPOINT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from scripts.bench.memory import write_bpe_tokenizer

out, data, shape = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
write_bpe_tokenizer(out, data)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16).save_pretrained(out)
"""


def _max_rss(cmd: list[str], log: Path) -> tuple[int, int]:
    """Run `cmd` under /usr/bin/time -v: (exit code, its maximum resident set in bytes)."""
    import subprocess

    from scripts.bench.runner import ROOT

    with open(log, "w") as out:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text())
    return rc, int(found.group(1)) * 1024 if found else 0


def lora_peaks(args, progress=print) -> dict:
    import json
    import tempfile

    from scripts.bench.runner import ROOT

    root = Path(getattr(args, "out", None) or tempfile.mkdtemp(prefix="m3-")) / "m3"
    hf, run_dir = root / "hf", root / "run"
    hf.mkdir(parents=True, exist_ok=True)
    data = (ROOT / "../shared/data/alpaca_en_demo.json").resolve()
    progress("M3: making the 1.2B checkpoint and its tokenizer")
    if not (hf / "config.json").is_file():
        rc, _ = _max_rss([sys.executable, "-c", _MAKE_LORA_CHECKPOINT, str(hf), str(data), json.dumps(LORA_HF)],
                         root / "make.log")
        if rc:
            raise RuntimeError(f"making the checkpoint failed: {(root / 'make.log').read_text()[-2000:]}")
    checkpoint_bytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    progress(f"M3: LoRA fine-tuning on {args.ranks} ranks")
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
             "finetune.py", "--config", "configs/finetune_alpaca_lora_zeropp.yaml", "--finetune.hf_checkpoint", str(hf),
             "--data.path", str(data), "--zero_optimization.ranks_per_node", "2", "--data.seq_len", str(args.seq),
             "--train.steps", "3", "--train.micro_batch_size", "1", "--train.grad_accum", "1",
             "--train.eval_interval", "3", "--train.eval_batches", "1", "--train.eval_at_start", "false",
             "--train.checkpoint_interval", "0", "--train.log_interval", "1", "--train.export_hf", "false",
             "--train.out_dir", str(run_dir), "--train.overwrite", "true", "--train.progress_bar", "false"]
    rc, _ = _max_rss(train, root / "train.log")
    text = (root / "train.log").read_text(errors="replace")
    peak = re.search(r"peak memory per rank \(VmHWM\): measured (\d+)-(\d+) MB, predicted (\d+)-(\d+) MB", text)
    if rc or not peak:
        raise RuntimeError(f"the fine-tuning run failed: {text[-3000:]}")
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.]+)", text)]
    rows = [{"what": f"LoRA training, {args.ranks} ranks, per rank", "peak_mb": f"{peak[1]}-{peak[2]}",
             "predicted_mb": f"{peak[3]}-{peak[4]}"}]
    for what, cmd in (("HF export (consolidate.py)", ["scripts/consolidate.py", str(run_dir / "checkpoints"),
                                                      str(root / "out-hf")]),
                      ("GGUF Q8_0 export", ["scripts/export_quantized.py", str(run_dir / "checkpoints"),
                                            str(root / "out.gguf"), "--format", "gguf", "--bits", "8"])):
        progress(f"M3: {what}")
        rc, rss = _max_rss([sys.executable, *cmd], root / f"{what.split()[0]}.log")
        if rc:
            raise RuntimeError(f"{what} failed: {(root / (what.split()[0] + '.log')).read_text()[-2000:]}")
        rows.append({"what": what, "peak_mb": f"{rss / 2**20:.0f}", "predicted_mb": "-"})
    return {"lora": True, "checkpoint_bytes": checkpoint_bytes,
            "seq": args.seq, "ranks": args.ranks, "losses": losses, "rows": rows}


def lora_markdown(result: dict) -> str:
    return "\n".join([
        f"llama3.2-1b-shaped checkpoint ({result['checkpoint_bytes'] / 2**30:.2f} GiB of bf16 safetensors), LoRA r 16 "
        f"on q/k/v/o, ZeRO++ (qwZ int8, hpZ, qgZ) with the frozen weights held as int8 codes, {result['ranks']} ranks "
        f"as 2 per node, micro-batch 1 x {result['seq']} tokens, 3 steps (losses {result['losses']}).", "",
        *md_table(result["rows"], [("what", "what", "{}"), ("peak_mb", "peak MB", "{}"),
                                   ("predicted_mb", "predicted MB", "{}")])])
