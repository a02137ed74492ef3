"""Cross-site bytes per inner step of DiLoCo over ZeRO++ vs DDP's cross-node bytes per step, side by
side in one run, from the communication ledger (issue 33's D1, on loopback ranks: bytes, not time).

    OMP_NUM_THREADS=1 python scripts/bench/diloco_bytes.py --sites 2 --site-size 2 --inner-steps 50

Every runtime trains the same model on the same batches on sites x site_size ranks, nodes of
site_size ranks (a site is a node). DDP all-reduces every step over the whole world; DiLoCo's inner
ZeRO++ (int8 weights, hpZ inside the node, int4 gradients) never leaves the site, and its outer
exchange crosses once per H steps (fp32, or int8 / int4 with error feedback); with Streaming
DiLoCo's fragments (diloco.fragments F) a 1/F fragment crosses every H/F steps: the same bytes per
cycle, the largest single sync (the peak bandwidth) F x smaller.
"""

import argparse

import torch

from models.config import ModelConfig
from models.transformer import Transformer, lm_loss
from trainer.spawn import run_ranks
from zeropp import build_runtime
from zeropp.config import DilocoConfig, ZeroConfig
from zeropp.diloco import OUTER_TAG, DiLoCo

ZEROPP = dict(stage=3, zero_quantized_weights=True, zero_hpz_partition_size=0, zero_quantized_gradients=True)
CASES = [  # (name, zero_optimization, diloco.compression or None for no DiLoCo, diloco.fragments)
    ("DDP (fp32 gradients) over the world", ZeroConfig(stage=0), None, 1),
    ("DiLoCo over ZeRO++, fp32 exchange", ZeroConfig(**ZEROPP), "none", 1),
    ("DiLoCo over ZeRO++, fp32 exchange, 4 fragments", ZeroConfig(**ZEROPP), "none", 4),
    ("DiLoCo over ZeRO++, int8 exchange", ZeroConfig(**ZEROPP), "int8", 1),
    ("DiLoCo over ZeRO++, int4 exchange", ZeroConfig(**ZEROPP), "int4", 1),
    ("DiLoCo over ZeRO++, int4 exchange, 4 fragments", ZeroConfig(**ZEROPP), "int4", 4),
]


def _measure(rank, world, site_size, inner_steps, preset):
    """Per case: (cross-node bytes this rank sent per step, of which the outer exchange's, the outer
    exchange's largest single sync)."""
    results = []
    for _, zero, compression, fragments in CASES:
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_preset(preset, vocab_size=256))
        diloco = None if compression is None else DilocoConfig(enabled=True, inner_steps=inner_steps,
                                                               compression=compression, fragments=fragments)
        runtime = build_runtime(model, zero, torch.device("cpu"), site_size=site_size if diloco else None)
        optimizer = torch.optim.AdamW(runtime.module.parameters(), lr=1e-3)
        outer = DiLoCo(runtime, diloco) if diloco else None
        steps = inner_steps if diloco else 2
        g = torch.Generator().manual_seed(rank)
        runtime.ledger.reset()
        outer_cross = largest = 0
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 256, (2, 33), generator=g)
            runtime.backward(lm_loss(runtime(tokens[:, :-1]), tokens[:, 1:]))
            optimizer.step()
            optimizer.zero_grad()
            if outer:
                outer.after_inner_step(step)
            synced = runtime.ledger.totals().get(OUTER_TAG, {}).get("cross_node_sent", 0) - outer_cross
            largest, outer_cross = max(largest, synced), outer_cross + synced
        cross = sum(t["cross_node_sent"] for t in runtime.ledger.totals().values())
        results.append((cross / steps, outer_cross / steps, largest))
        runtime.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--site-size", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--preset", default="gpt2-tiny")
    a = parser.parse_args()
    world = a.sites * a.site_size
    results = run_ranks(_measure, world, args=(a.site_size, a.inner_steps, a.preset), ranks_per_node=a.site_size)
    rows = [[sum(r[i][k] for r in results) / world for k in range(3)] for i in range(len(CASES))]
    ddp = rows[0][0]
    print(f"{a.sites} sites x {a.site_size} ranks (a site per node), {a.preset}, H {a.inner_steps}; "
          f"cross-node bytes sent per rank per (inner) step, mean over ranks, from the ledger:")
    print("| runtime | cross-node KB / step | of which outer exchange | largest sync, KB | ÷ DDP fp32 "
          "| ÷ DDP bf16 (half its bytes) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ratio = lambda r: f"1/{1 / r:.0f}" if 0 < r < 1 else f"{r:g}"  # noqa: E731
    for (name, *_), (cross, outer, largest) in zip(CASES, rows):
        peak = f"{largest / 1e3:.2f}" if largest else "(every step)"
        print(f"| {name} | {cross / 1e3:.2f} | {outer / 1e3:.2f} | {peak} | {ratio(cross / ddp)} "
              f"| {ratio(cross / (ddp / 2))} |")


if __name__ == "__main__":
    main()
