"""Per-rank model-state memory of the ZeRO-3 engine, measured against the formula.

    python scripts/bench/memory.py --preset gpt2-small-cpu --ranks 4 [--comm bf16] [--json out.json]

ZeRO-3 keeps, per rank and parameter element of its 1/W shard: the fp32 master (4 bytes),
AdamW's two fp32 moments (8), the copy in the communication dtype (2 for bf16) and the
fp32 gradient shard (4): (4 + 8 + c + 4) * N / W bytes. The script builds the engine on W
gloo ranks, runs two steps, and prints each kind's measured bytes next to the formula, the
bytes of the preallocated gather/gradient buffers, and whether those buffers were allocated
once (same storage before and after the steps).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from models.transformer import Transformer, lm_loss  # noqa: E402
from tests.spawn import run_ranks  # noqa: E402
from trainer.config import OptimSection  # noqa: E402
from trainer.optim import build_shard_optimizer  # noqa: E402
from zeropp.config import DTYPES, ZeroConfig  # noqa: E402
from zeropp.engine import Zero3Engine  # noqa: E402
from zeropp.topology import build_topology  # noqa: E402


def buffers(engine) -> dict[str, tuple[int, int]]:
    """Name -> (storage pointer, bytes) of every buffer the engine preallocates."""
    out = {}
    for kind, pair in (("gather", engine._gather_pair), ("compute", engine._compute_pair),
                       ("grad", engine._grad_pair)):  # no compute pair when it is the gather pair
        for i, t in enumerate(pair):
            out[f"block {kind} buffer {i}"] = (t.untyped_storage().data_ptr(), t.numel() * t.element_size())
    for u in engine.resident:
        for kind, t in (("gather", u.gather_buf), ("compute", u.compute_buf), ("grad", u.grad_buf)):
            if t is not None and (kind != "compute" or t is not u.gather_buf):
                out[f"{u.name} {kind} buffer"] = (t.untyped_storage().data_ptr(), t.numel() * t.element_size())
    return out


def measure(rank, world, preset, comm, seq, batch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(preset))
    n_params = sum(p.numel() for p in model.parameters())
    engine = Zero3Engine(model, lambda pieces: build_shard_optimizer(pieces, OptimSection()),
                         ZeroConfig(stage=3, communication_data_type=comm), topo=build_topology())
    before = buffers(engine)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1))
    for _ in range(2):
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
        engine.clip_grad_norm(1.0)
        engine.step()
        engine.zero_grad()
    after = buffers(engine)
    state = engine.model_state_bytes()
    engine.close()
    c = DTYPES[comm].itemsize
    formula = {"master": 4 * n_params / world, "optimizer states": 8 * n_params / world,
               "comm copy": c * n_params / world, "gradient shard": 4 * n_params / world}
    return {"rank": rank, "params": n_params, "measured": state, "formula": formula,
            "buffers": {k: v[1] for k, v in after.items()},
            "buffers_allocated_once": all(before[k][0] == after[k][0] for k in before)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-small-cpu")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--comm", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    reports = run_ranks(measure, args.ranks, args=(args.preset, args.comm, args.seq, args.batch), timeout=900)
    print(f"{args.preset}: {reports[0]['params'] / 1e6:.2f}M parameters on {args.ranks} ranks, "
          f"{args.comm} communication")
    print(f"{'rank':>4} {'kind':<18} {'measured MB':>12} {'formula MB':>11} {'ratio':>7}")
    worst = 0.0
    for r in reports:
        for kind, formula in r["formula"].items():
            measured = r["measured"].get(kind, 0)
            worst = max(worst, abs(measured / formula - 1))
            print(f"{r['rank']:>4} {kind:<18} {measured / 2**20:>12.3f} {formula / 2**20:>11.3f} "
                  f"{measured / formula:>7.4f}")
        total_m, total_f = sum(r["measured"].values()), sum(r["formula"].values())
        print(f"{r['rank']:>4} {'total':<18} {total_m / 2**20:>12.3f} {total_f / 2**20:>11.3f} "
              f"{total_m / total_f:>7.4f}")
    print(f"largest deviation from the formula: {100 * worst:.2f}%")
    print(f"preallocated buffers per rank: {sum(reports[0]['buffers'].values()) / 2**20:.3f} MB; "
          f"allocated once: {all(r['buffers_allocated_once'] for r in reports)}")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
