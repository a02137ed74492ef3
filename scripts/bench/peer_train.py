"""Train OUR model with a peer runtime — PyTorch FSDP2, DeepSpeed ZeRO-3 or plain DDP — for benchmarks.

    torchrun --nproc-per-node 4 scripts/bench/peer_train.py --runtime fsdp2 --dtype bf16 --out runs/peer \
        --config configs/quickstart.yaml --model.preset gpt2-small-cpu --train.steps 8
    torchrun --nproc-per-node 4 scripts/bench/peer_train.py --runtime deepspeed --hpz 2 --out runs/peer ...

Everything but the runtime is train.py's: the config system (the same `--config` and
`--section.key value` overrides), the model (`models.transformer.Transformer`, built by
`trainer.loop.build_model_config`, same seed, so the same initial weights), the data
(`prepare_pretraining` + `ResumableBatchSampler`: each rank sees the very samples it would see
in train.py), AdamW with the same decay split, betas, eps and `foreach=False`
(`trainer.optim.build_optimizer`), the same learning-rate schedule, gradient clipping, and
the same per-step loss all-reduce. A step is timed like train.py's "elapsed time per
iteration": from the start of the step to the end of its loss all-reduce, so step times of
the two are comparable. Rank 0 writes `<out>/metrics.jsonl` (one line per step, the same keys
as train.py's) and `<out>/result.json`.

Runtimes (`--dtype` is what goes over the wire):
  ddp        torch DDP, fp32 gradients all-reduced in buckets (what train.py stage 0 does).
  fsdp2      `torch.distributed.fsdp.fully_shard` on every block, then on the root (embeddings,
             final norm, tied head). fp32, or `--dtype bf16`: MixedPrecisionPolicy(param_dtype=bf16,
             reduce_dtype=--reduce-dtype), i.e. bf16 all-gathers AND bf16 compute (FSDP2 computes
             in the dtype it gathers in; on a CPU bf16 matmuls are several times slower than fp32).
  deepspeed  `deepspeed.initialize` with ZeRO stage 3 and our AdamW as the client optimizer.
             fp32, or `--dtype bf16` (DeepSpeed's bf16 mode: bf16 weights, gathers and compute,
             fp32 master weights). `--hpz N`: zero_hpz_partition_size (ZeRO++'s hpZ, runs on CPU);
             `--ds-quantized`: zero_quantized_weights + zero_quantized_gradients (ZeRO++'s qwZ/qgZ;
             they need DeepSpeed's CUDA quantizer ops and fail on CPU — the error is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from data.datasets import ResumableBatchSampler  # noqa: E402
from models.config import flops_per_token, num_params  # noqa: E402
from models.transformer import Transformer, lm_loss  # noqa: E402
from trainer.config import parse_args  # noqa: E402
from trainer.distributed import all_reduce_mean, init_distributed  # noqa: E402
from trainer.loop import build_model_config  # noqa: E402
from trainer.optim import build_optimizer, lr_at  # noqa: E402
from trainer.pretrain_data import prepare_pretraining  # noqa: E402

RUNTIMES = ("ddp", "fsdp2", "deepspeed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def peer_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False, usage="%(prog)s --runtime R [options] [train.py config args]")
    p.add_argument("--runtime", choices=RUNTIMES, required=True)
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="wire (and, for fsdp2/deepspeed, compute) dtype")
    p.add_argument("--reduce-dtype", choices=DTYPES, help="fsdp2: gradient reduce dtype (default: --dtype)")
    p.add_argument("--hpz", type=int, default=1, help="deepspeed: zero_hpz_partition_size (1 = off)")
    p.add_argument("--ds-quantized", action="store_true", help="deepspeed: qwZ + qgZ flags (fail on CPU)")
    p.add_argument("--ds-regather", action="store_true",
                   help="deepspeed: stage3_max_live_parameters = stage3_max_reuse_distance = 0, so weights are "
                        "released after the forward and gathered again for the backward (ZeRO-3 proper; with "
                        "DeepSpeed's defaults a small model stays gathered from forward to backward)")
    p.add_argument("--out", type=Path, required=True, help="metrics.jsonl and result.json go here (rank 0)")
    return p


def describe(args) -> str:
    if args.runtime == "ddp":
        return "DDP (fp32 all-reduce)"
    if args.runtime == "fsdp2":
        red = args.reduce_dtype or args.dtype
        return f"FSDP2 ({args.dtype} gather, {red} reduce)"
    extra = (" + hpZ" if args.hpz > 1 else "") + (" + qwZ/qgZ" if args.ds_quantized else "") + \
        (", re-gather" if args.ds_regather else "")
    return f"DeepSpeed ZeRO-3{extra} ({args.dtype})"


def deepspeed_config(args, cfg) -> dict:
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            # DeepSpeed's defaults (reduce_bucket_size 5e8, prefetch 5e7 numel) are fine for a 10M model
            "stage3_param_persistence_threshold": 0}
    if args.hpz > 1:
        zero["zero_hpz_partition_size"] = args.hpz
    if args.ds_regather:
        zero["stage3_max_live_parameters"] = 0
        zero["stage3_max_reuse_distance"] = 0
    if args.ds_quantized:
        zero["zero_quantized_weights"] = True
        zero["zero_quantized_gradients"] = True
    config = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.optim.clip_grad,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,   # our torch AdamW, so the optimizer is the same
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def wrap(args, cfg, model, env):
    """-> (forward callable, backward(loss), step(lr) -> None, describe the wrapping)."""
    clip = cfg.optim.clip_grad if cfg.optim.clip_grad > 0 else float("inf")
    if args.runtime == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        optimizer = build_optimizer(model, cfg.optim)
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    config=deepspeed_config(args, cfg), dist_init_required=False)

        def step(lr):
            for group in ds_opt.param_groups:
                group["lr"] = lr
            engine.step()   # clips (gradient_clipping), steps and zeroes the gradients

        return engine, engine.backward, step, f"deepspeed {deepspeed.__version__}"

    if args.runtime == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = {}
        if args.dtype != "fp32" or args.reduce_dtype:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[args.dtype],
                                                       reduce_dtype=DTYPES[args.reduce_dtype or args.dtype])
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        # as in trainer/loop.py (find_unused_parameters keeps DDP from rebuilding its buckets)
        wrapped = DistributedDataParallel(model, find_unused_parameters=True) if env.world_size > 1 else model
    optimizer = build_optimizer(model, cfg.optim)

    def backward(loss):
        loss.backward()

    def step(lr):
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return wrapped, backward, step, f"torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    args, rest = peer_parser().parse_known_args(argv)
    cfg = parse_args(rest)
    if cfg.train.grad_accum != 1:
        sys.exit("peer_train.py: only train.grad_accum 1 is supported")
    env = init_distributed()
    out = args.out
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    result = {"runtime": describe(args), "args": {k: str(v) for k, v in vars(args).items()}, "ok": False}
    try:
        torch.manual_seed(cfg.train.seed)
        data = prepare_pretraining(cfg.data, cfg.data.seq_len, cfg.train.seed, env.rank)
        model_cfg = build_model_config(cfg, data.tokenizer.vocab_size)
        torch.manual_seed(cfg.train.seed)   # the same initial weights as train.py
        model = Transformer(model_cfg)
        n_params = sum(p.numel() for p in model.parameters())
        forward, backward, step, version = wrap(args, cfg, model, env)
        sampler = ResumableBatchSampler(data.train_indices, cfg.train.micro_batch_size, env.rank, env.world_size,
                                        cfg.train.seed)
        batches = iter(sampler)
        seq = cfg.data.seq_len
        tokens_per_step = cfg.train.micro_batch_size * env.world_size * seq
        flops_per_step = flops_per_token(model_cfg, seq) * tokens_per_step
        result.update(version=version, params=n_params, params_non_embedding=num_params(model_cfg, False),
                      world_size=env.world_size, tokens_per_step=tokens_per_step)
        if env.is_main:
            print(f"peer_train: {describe(args)} ({version}) | {n_params / 1e6:.2f}M parameters | "
                  f"world {env.world_size} | {tokens_per_step} tokens/step", flush=True)
        metrics = open(out / "metrics.jsonl", "w") if env.is_main else None
        for i in range(cfg.train.steps):
            start = time.perf_counter()
            lr = lr_at(i, cfg.train.steps, cfg.optim)
            tokens, labels = data.batch(next(batches), torch.device("cpu"))
            # train.py all-reduces [stop flag, token count, target count] at the start of every step
            all_reduce_mean(torch.zeros(3, dtype=torch.float64))
            loss = lm_loss(forward(tokens), labels)
            backward(loss)
            step(lr)
            loss = all_reduce_mean(loss.detach().float()).item()
            elapsed = time.perf_counter() - start
            if metrics:
                metrics.write(json.dumps({
                    "step": i + 1, "lm loss": loss, "learning rate": lr,
                    "elapsed time per iteration (ms)": elapsed * 1e3, "tokens/s": tokens_per_step / elapsed,
                    "TFLOP/s per rank": flops_per_step / elapsed / 1e12 / env.world_size}) + "\n")
                metrics.flush()
                print(f" iteration {i + 1}/{cfg.train.steps} | lm loss: {loss:.4f} | "
                      f"elapsed time per iteration (ms): {elapsed * 1e3:.1f}", flush=True)
        if metrics:
            metrics.close()
        result["ok"] = True
        result["final_loss"] = loss
    except Exception as e:   # recorded for the benchmark table (e.g. DeepSpeed's quantizer on CPU)
        result["error"] = f"{type(e).__name__}: {e}"
        if env.is_main:
            traceback.print_exc()
    if env.is_main:
        (out / "result.json").write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        if result["ok"]:
            dist.barrier()
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
