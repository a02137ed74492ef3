"""Per-rank model-state memory of the ZeRO-3 engine, measured against the formula.

    python scripts/bench/memory.py --preset gpt2-small-cpu --ranks 4 [--comm bf16]

Per parameter element of its 1/W shard a rank keeps the fp32 master (4 bytes), AdamW's two moments (8),
the copy in the communication dtype (c) and the fp32 gradient shard (4): (16 + c) * N / W bytes. Also:
the preallocated gather/gradient buffers, and whether they were allocated once (same storage after two
steps).
"""

import sys

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


def run(args, progress=print) -> dict:
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
    return "\n".join([
        f"{result['preset']}: {result['params'] / 1e6:.2f}M parameters on {result['ranks']} ranks, {result['comm']} "
        f"communication. Largest deviation from the formula: {100 * result['largest_deviation']:.2f}%; "
        f"preallocated buffers per rank: {result['buffer_mb']:.3f} MB, allocated once: "
        f"{result['buffers_allocated_once']}.", "",
        *md_table(result["rows"], [("rank", "rank", "{}"), ("kind", "kind", "{}"), ("measured_mb", "measured MB",
                                   "{:.3f}"), ("formula_mb", "formula MB", "{:.3f}"), ("ratio", "ratio", "{:.4f}")])])


if __name__ == "__main__":
    sys.exit(main_one("memory"))
