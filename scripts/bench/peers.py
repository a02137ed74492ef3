"""Our ZeRO-3 / ZeRO++ against DDP, PyTorch FSDP2 and DeepSpeed ZeRO-3 on the same emulated cluster.

    python scripts/bench/peers.py                 # 100mbit (2 nodes x 2) and unshaped loopback
    python scripts/bench/peers.py --quick         # 100mbit only: ZeRO++, DDP, FSDP2, DeepSpeed (fp32)
    python scripts/bench/peers.py --runtimes zero3-fp32 deepspeed-fp32 --settings loopback

Every runtime trains the same model, data, AdamW, schedule and clipping through the same training
loop (trainer.loop.Trainer): ours and DDP as `train.py`, FSDP2 and DeepSpeed as this script's
`--worker`, which hands the Trainer a builder of the Runtime subclasses below. What the rows compare
(wire and compute dtypes, DeepSpeed's defaults) is said in markdown() below, i.e. in the docs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from scripts.bench import report, runner
from scripts.bench.ablation import CONFIGS
from scripts.bench.runner import RANKS_PER_NODE, SEQ, Job
from scripts.bench.suite import Quick, main_one, options
from zeropp.comm import CommLedger
from zeropp.config import DTYPES
from zeropp.runtime import Runtime, Timings

TITLE = "## 2. Peers: DDP, PyTorch FSDP2, DeepSpeed ZeRO-3"
_HPZ = {"zero_hpz_partition_size": RANKS_PER_NODE}
_REGATHER = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}
RUNTIMES = {  # key -> (label, family, train.py arguments | the peer runtime's options)
    "zeropp": ("ZeRO++ (ours: qwZ int8, hpZ, qgZ int4)", "ours", runner.zero_args(**CONFIGS["zeropp"][1])),
    "zero3-bf16": ("ZeRO-3 (ours, bf16 wire, fp32 compute)", "ours", runner.zero_args(stage=3)),
    "zero3-fp32": ("ZeRO-3 (ours, fp32 wire)", "ours", runner.zero_args(stage=3, communication_data_type="fp32")),
    "ddp": ("DDP (train.py stage 0, fp32 all-reduce)", "ddp", runner.zero_args(stage=0)),
    "fsdp2-fp32": ("FSDP2 fully_shard (fp32)", "fsdp2", {}),
    "fsdp2-bf16": ("FSDP2 fully_shard (bf16 gather + reduce, bf16 compute)", "fsdp2", {"dtype": "bf16"}),
    "deepspeed-fp32": ("DeepSpeed ZeRO-3 (fp32)", "deepspeed", {}),
    "deepspeed-bf16": ("DeepSpeed ZeRO-3 (bf16, bf16 compute)", "deepspeed", {"dtype": "bf16"}),
    "deepspeed-regather-fp32": ("DeepSpeed ZeRO-3 (fp32, re-gather for backward)", "deepspeed",
                                {"zero": _REGATHER}),
    "deepspeed-hpz-regather-fp32": ("DeepSpeed ZeRO-3 + hpZ (fp32, re-gather for backward)", "deepspeed",
                                    {"zero": {**_HPZ, **_REGATHER}}),
    "deepspeed-zeropp": ("DeepSpeed ZeRO++ (qwZ + qgZ + hpZ)", "deepspeed",
                         {"zero": {**_HPZ, "zero_quantized_weights": True, "zero_quantized_gradients": True}}),
}
FULL = {"100mbit": ["zeropp", "zero3-bf16", "zero3-fp32", "ddp", "fsdp2-fp32", "fsdp2-bf16", "deepspeed-fp32",
                    "deepspeed-bf16", "deepspeed-hpz-regather-fp32"],
        "loopback": ["zeropp", "zero3-bf16", "zero3-fp32", "deepspeed-fp32", "deepspeed-bf16", "deepspeed-zeropp"]}
QUICK = {"100mbit": ["zeropp", "ddp", "fsdp2-fp32", "deepspeed-fp32"]}


# ---------------------------------------------------------------- the peer runtimes


class _Peer(Runtime):
    """FSDP2 and DeepSpeed average the gradients over the ranks themselves, so a gradient divide
    factor f scales the loss by world / f (FSDP2's own set_gradient_divide_factor needs a PREMUL_SUM
    reduction, which gloo does not have)."""

    loss_scale = 1.0

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.loss_scale = torch.distributed.get_world_size() / factor


class FSDP2(_Peer):
    """PyTorch FSDP2: `fully_shard` on every block, then on the root (embeddings, final norm, tied head).
    bf16 = MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16): bf16 gathers, reduces AND compute."""

    checkpoint_format = "fsdp2"

    def __init__(self, model: torch.nn.Module, cfg, dtype: str = "fp32"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = {} if dtype == "fp32" else {
            "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])}
        for block in model.blocks:
            fully_shard(block, **policy)
        self.module = fully_shard(model, **policy)
        self.dtype, self.ledger, self.timings = dtype, CommLedger(), Timings()

    @contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale).backward()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def save(self, directory, optimizer) -> None:  # torch.distributed.checkpoint: each rank its shards
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        save(dict(zip(("model", "optimizer"), get_state_dict(self.module, optimizer))), checkpoint_id=directory)

    def load(self, directory, optimizer) -> None:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        state = dict(zip(("model", "optimizer"), get_state_dict(self.module, optimizer)))
        load(state, checkpoint_id=directory)
        set_state_dict(self.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def describe(self) -> str:
        return f"FSDP2 fully_shard ({self.dtype}), torch {torch.__version__}"


class DeepSpeed(_Peer):
    """DeepSpeed ZeRO-3 (`deepspeed.initialize` with our AdamW as the client optimizer); `dtype` bf16 is
    DeepSpeed's bf16 mode (bf16 weights, gathers and compute, fp32 master weights). DeepSpeed clips
    (gradient_clipping = optim.clip_grad) and zeroes the gradients inside engine.step()."""

    checkpoint_format = "deepspeed"

    def __init__(self, model: torch.nn.Module, cfg, dtype: str = "fp32", zero: dict | None = None):
        self.module, self.ledger, self.timings, self.engine = model, CommLedger(), Timings(), None
        self.config, self.norm = deepspeed_config(cfg, dtype, zero), torch.zeros(())

    def attach_optimizer(self, optimizer):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        self.engine, ds_optimizer, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer,
                                                               config=self.config, dist_init_required=False)
        return _EngineStep(self, ds_optimizer)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def no_sync(self):
        raise NotImplementedError("DeepSpeed ZeRO-3 always reduces the gradients (no no_sync): use train.grad_accum 1")

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.loss_scale)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.norm  # DeepSpeed clips in engine.step(), which fills in the norm before clipping

    def save(self, directory, optimizer) -> None:
        # no "latest" file: it would make the step directory look like a checkpoint root (resolve_checkpoint)
        self.engine.save_checkpoint(directory, tag="deepspeed", save_latest=False)

    def load(self, directory, optimizer) -> None:
        self.engine.load_checkpoint(directory, tag="deepspeed")

    def describe(self) -> str:
        import deepspeed

        return f"DeepSpeed {deepspeed.__version__} ZeRO-3, config {self.config}"


class _EngineStep:
    """The optimizer the trainer steps under DeepSpeed: engine.step() clips, steps and zeroes the gradients."""

    def __init__(self, runtime: DeepSpeed, ds_optimizer):
        self.runtime, self.param_groups = runtime, ds_optimizer.param_groups
        self.state: dict = {}  # DeepSpeed keeps its states in its own flat partitions, not per parameter

    def step(self) -> None:
        self.runtime.engine.step()
        self.runtime.norm.fill_(self.runtime.engine.get_global_grad_norm() or 0.0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def deepspeed_config(cfg, dtype: str = "fp32", zero: dict | None = None) -> dict:
    config = {"train_micro_batch_size_per_gpu": cfg.train.micro_batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": cfg.optim.clip_grad, "zero_allow_untested_optimizer": True,  # our AdamW
              "steps_per_print": 10**9, "wall_clock_breakdown": False,
              # DeepSpeed's bucket and prefetch defaults (5e8, 5e7 numel) are fine for a 10M model
              "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                    "stage3_param_persistence_threshold": 0, **(zero or {})}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def worker(argv: list[str]) -> int:
    """`--worker KEY [train.py config arguments]`: one rank of a peer runtime's run, under torchrun."""
    from trainer.config import parse_args
    from trainer.loop import Trainer

    key, cfg = argv[0], parse_args(argv[1:])
    _, family, peer_options = RUNTIMES[key]
    peer = {"fsdp2": FSDP2, "deepspeed": DeepSpeed}[family]
    trainer = Trainer(cfg, build_runtime=lambda model, zero_cfg, device, tp: peer(model, cfg, **peer_options))
    try:
        trainer.run()
    finally:
        trainer.close()
    return 0


# ---------------------------------------------------------------- the benchmark


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def add_args(p) -> None:
    p.add_argument("--rate", default="100mbit", help="the slow link (default 100mbit)")
    p.add_argument("--settings", nargs="+", choices=["slow", "loopback"], default=Quick(["slow", "loopback"], ["slow"]),
                   help="slow: the emulated cluster at --rate; loopback: 4 local ranks, unshaped (default %(default)s)")
    p.add_argument("--runtimes", nargs="+", choices=list(RUNTIMES))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=Quick(5, 2), help="steps per run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=Quick(2, 1), help="steps not timed (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900)


def resolve(args) -> dict:
    """The plan: the runtimes to run in each setting (a link rate, or loopback)."""
    table, settings = QUICK if args.quick else FULL, {}
    for s in args.settings:  # slow: the cluster at --rate, whose runtimes the tables list under 100mbit
        settings[args.rate if s == "slow" else s] = args.runtimes or table.get("100mbit" if s == "slow" else s, [])
    return {**options(args), "settings": settings}


def _reusable(reuse: dict | None, key: str, setting: str, plan: dict) -> dict | None:
    """A row of the ablation run in the same suite with the very same job (our ZeRO-3 bf16 / ZeRO++),
    timed the same way (steps, warm-up)."""
    ab_key = {"zeropp": "zeropp", "zero3-bf16": "zero3"}.get(key)
    return next((r for r in (reuse or {}).get("rows", []) if ab_key and r["ok"] and r["key"] == ab_key
                 and (r["setting"], r["micro_batch"], r["steps"], r["warmup"])
                 == (setting, plan["micro_batch"], plan["steps"], plan["warmup"])), None)


def run(args, progress=print) -> dict:
    plan = resolve(args)
    result = {"plan": plan, "model": runner.model_summary(), "nodes": runner.NODES,
              "ranks_per_node": RANKS_PER_NODE, "rows": [], "notes": []}
    if not deepspeed_installed():
        result["notes"].append("DeepSpeed: not installed (pip install -r requirements-bench.txt)")
    why, rows, jobs = runner.cluster_unavailable(), [], []
    for setting, keys in plan["settings"].items():
        if setting != "loopback" and why:
            result["notes"].append(f"{setting}: skipped, emulated cluster unavailable: {why}")
            continue
        for key in keys:
            label, family, runtime_args = RUNTIMES[key]
            row = {"key": key, "label": label, "family": family, "setting": setting, "micro_batch": plan["micro_batch"]}
            prior = _reusable(getattr(args, "reuse", None), key, setting, plan)
            if prior:
                row = {**prior, **row, "reused_from": "ablation"}
            elif family == "deepspeed" and not deepspeed_installed():
                row.update(ok=False, error="not installed (pip install -r requirements-bench.txt)")
            elif family in ("ours", "ddp"):  # measured below, as train.py
                jobs.append(Job(key, label, runtime_args, plan["micro_batch"], setting))
            else:  # measured below, through this script's --worker
                jobs.append(Job(key, label, [], plan["micro_batch"], setting, script=[__file__, "--worker", key]))
            rows.append(row)
            if "ok" in row:
                progress(f"  peers: {label} @ {setting}: " + ("from the ablation run" if prior else row["error"]))
    measured = iter(runner.run_jobs("peers", jobs, plan["steps"], plan["warmup"], plan["timeout"], progress))
    result["rows"] = [row if "ok" in row else {**next(measured), **row} for row in rows]
    for setting in plan["settings"]:
        same = {r["key"]: r for r in result["rows"] if r["setting"] == setting and r["ok"]}
        for r in same.values():
            if "zeropp" in same:
                r["zeropp_speedup"] = same["zeropp"]["tokens_per_s"] / r["tokens_per_s"]
        for dtype in ("fp32", "bf16"):
            ours, ds = same.get(f"zero3-{dtype}"), same.get(f"deepspeed-{dtype}")
            if ours and ds:
                ours["vs_deepspeed_same_dtype"] = ours["tokens_per_s"] / ds["tokens_per_s"]
    return result


COLUMNS = [("label", "runtime", "{}"), ("setting", "link", "{}"), ("step_ms", "step ms", "{:.0f}"),
           ("tokens_per_s", "tokens/s", "{:.0f}"), ("tflops_per_rank", "TFLOP/s per rank", "{:.4f}"),
           ("zeropp_speedup", "ZeRO++ speedup over it", "{:.2f}x"),
           ("vs_deepspeed_same_dtype", "ours / DeepSpeed, same wire dtype", "{:.2f}x"),
           ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.2f}"), ("wire_ms", "wire time ms", "{:.0f}"),
           ("final_loss", "loss at last step", "{:.4f}")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    rows = [r for r in result["rows"] if r["ok"]]
    settings = [s for s in result["plan"]["settings"] if any(r["setting"] == s for r in rows)]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = report.pyplot().subplots(figsize=(9, 0.5 * len(labels) + 1.5))
    report.bars(ax, labels, {("unshaped loopback" if s == "loopback" else f"{s} links, 2 nodes x 2 ranks"):
                             [next((r["tokens_per_s"] for r in rows if (r["label"], r["setting"]) == (label, s)),
                                   None) for label in labels] for s in settings}, horizontal=True)
    ax.set_xlabel("tokens/s (4 ranks)")
    ax.set_title(f"{result['model']['params'] / 1e6:.1f}M-parameter GPT-2, the same training loop")
    return [report.save(fig, out_dir, "peers_throughput")]


def markdown(result: dict) -> str:
    m, plan = result["model"], result["plan"]
    rows = [dict(r, label=r["label"] + (" (ablation)" if r.get("reused_from") else "")) for r in result["rows"]]
    return "\n".join([
        f"Same model ({m['params'] / 1e6:.2f}M-parameter GPT-2), data, AdamW and {plan['micro_batch']}x{SEQ} tokens "
        f"per rank on {result['nodes']} nodes x {result['ranks_per_node']} ranks; {plan['steps']} steps per run, the "
        f"first {plan['warmup']} not timed. Every runtime trains through the same training loop "
        "(`trainer.loop.Trainer`): ours and DDP as `train.py`, FSDP2 and DeepSpeed as runtimes that "
        "`scripts/bench/peers.py` hands it (our model wrapped with `fully_shard` / `deepspeed.initialize`); their "
        "loss at the last step equals train.py's, i.e. they train the same thing. FSDP2 and DeepSpeed gather in "
        "the dtype they compute in, so their bf16 rows also compute in bf16 (slow on CPU); the fair same-wire-dtype "
        "comparison is fp32 vs fp32. Rows marked (ablation) are the ablation's runs of the same job in this suite "
        "run.", "",
        "Bytes: at the same wire dtype our ZeRO-3 (forward gather, backward gather, ring reduce-scatter) and "
        "DeepSpeed ZeRO-3 with its defaults (see below) move about the same bytes; FSDP2 moves more on gloo because "
        "gloo's reduce-scatter costs about an all-reduce (see [zero3.md](zero3.md); our runtime uses a send/recv "
        "ring instead); DDP all-reduces fp32 gradients once (1.5x the model's fp32 bytes per node through gloo's "
        "ring). DeepSpeed with its defaults (stage3_max_live_parameters = stage3_max_reuse_distance = 1e9) keeps a "
        "model this small gathered from the forward to the backward, so it gathers once per step where ZeRO-3 "
        "proper gathers twice, but its gradient reduce on gloo costs about an all-reduce. hpZ only acts on a "
        "backward re-gather, so the hpZ row sets both limits to 0 (re-gather, as ZeRO-3 proper). DeepSpeed's "
        "ZeRO++ quantization (zero_quantized_weights / zero_quantized_gradients) needs its CUDA quantizer kernels "
        "and fails on CPU (the row shows its error).", "",
        *report.md_table(rows, COLUMNS)])


if __name__ == "__main__":
    sys.exit(main_one("peers"))
