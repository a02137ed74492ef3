"""Our ZeRO-3 / ZeRO++ against DDP, PyTorch FSDP2 and DeepSpeed ZeRO-3 on the same emulated cluster, every
runtime training through the same loop (trainer.loop.Trainer): ours and DDP as `train.py`, FSDP2 and
DeepSpeed as this script's `--worker`, which hands the Trainer the Runtime subclasses below.

    python scripts/bench/peers.py                 # 100mbit (2 nodes x 2) and unshaped loopback, issue 17's model
    python scripts/bench/peers.py --plan targets  # only the rows of issue 17's T1-T4 and T6 (suite.py's summary)
    python scripts/bench/peers.py --runtimes zero3-fp32 deepspeed-fp32 --settings loopback
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
_ZPP, _FLAT = CONFIGS["zeropp"][1], {"node_aware_collectives": False}
_KEEP = {"stage3_max_reuse_distance": 10**9}  # DeepSpeed's default: a model this small stays gathered
AUTOCAST = "autocast, fp32 master weights"
NOT_INSTALLED = "not installed (pip install -r requirements-bench.txt)"


def _ours(label: str, compute: str, family: str = "ours", **zero) -> tuple:
    """A train.py row: these zero_optimization keys, computing in `compute` (--train.precision)."""
    return (label, family, runner.zero_args(**zero) + ["--train.precision", compute], compute,
            AUTOCAST if compute == "bf16" else None)


# key -> (label, family, train.py arguments | the peer runtime's options, compute dtype, how it computes in it).
# The peer workers pass --train.precision fp32 (no autocast from the Trainer): their bf16 rows compute in bf16
# through their own mixed precision (bf16 weights), as they are normally used.
RUNTIMES = {
    "zeropp": _ours("ZeRO++ (ours: qwZ int8, hpZ, qgZ int4)", "bf16", **_ZPP),
    "zeropp-c32": _ours("ZeRO++ (ours: qwZ int8, hpZ, qgZ int4), fp32 compute", "fp32", **_ZPP),
    "zeropp-flat": _ours("ZeRO++ (ours), node-aware collectives off", "bf16", **_ZPP, **_FLAT),
    "zero3-bf16": _ours("ZeRO-3 (ours, bf16 wire)", "bf16", stage=3),
    "zero3-bf16-c32": _ours("ZeRO-3 (ours, bf16 wire), fp32 compute", "fp32", stage=3),
    "zero3-flat": _ours("ZeRO-3 (ours, bf16 wire), node-aware collectives off", "bf16", stage=3, **_FLAT),
    "zero3-keep": _ours("ZeRO-3 (ours, bf16 wire), kept gathered for the backward (DeepSpeed's reuse defaults)",
                        "bf16", stage=3, **_KEEP),
    "zeropp-keep": _ours("ZeRO++ (ours), kept gathered for the backward", "bf16", **_ZPP, **_KEEP),
    "zeropp-nostep": _ours("ZeRO++ (ours), first gathers at the forward, not the optimizer step", "bf16", **_ZPP,
                           prefetch_across_steps=False),
    "zeropp-depth2": _ours("ZeRO++ (ours), prefetch_depth 2", "bf16", **_ZPP, prefetch_depth=2),
    "zeropp-delta": _ours("ZeRO++ (ours) with qwZ int4 deltas", "bf16",
                          **{**_ZPP, "zero_quantized_weights_bits": 4}, zero_quantized_weights_delta=True),
    "zero3-fp32": _ours("ZeRO-3 (ours, fp32 wire)", "fp32", stage=3, communication_data_type="fp32"),
    "ddp": _ours("DDP (train.py stage 0, fp32 all-reduce)", "fp32", "ddp", stage=0),
    "ddp-bf16": _ours("DDP (train.py stage 0, fp32 all-reduce), bf16 autocast", "bf16", "ddp", stage=0),
    "fsdp2-fp32": ("FSDP2 fully_shard (fp32)", "fsdp2", {}, "fp32", None),
    "fsdp2-bf16": ("FSDP2 fully_shard (bf16 gather + reduce)", "fsdp2", {"dtype": "bf16"}, "bf16",
                   "MixedPrecisionPolicy: bf16 weights"),
    "deepspeed-fp32": ("DeepSpeed ZeRO-3 (fp32)", "deepspeed", {}, "fp32", None),
    "deepspeed-bf16": ("DeepSpeed ZeRO-3 (bf16)", "deepspeed", {"dtype": "bf16"}, "bf16",
                       "DeepSpeed bf16: bf16 weights, fp32 master"),
    "deepspeed-hpz-regather-fp32": ("DeepSpeed ZeRO-3 + hpZ (fp32, re-gather for backward)", "deepspeed",
                                    {"zero": {**_HPZ, **_REGATHER}}, "fp32", None),
    "deepspeed-zeropp": ("DeepSpeed ZeRO++ (qwZ + qgZ + hpZ)", "deepspeed",
                         {"zero": {**_HPZ, "zero_quantized_weights": True, "zero_quantized_gradients": True}}, "fp32",
                         None),
}
# The plans: setting -> runtimes ("100mbit" stands for the slow link, --rate). "targets" is exactly the rows of
# issue 17's T1-T4 and T6 (suite.py's summary) plus the fp32-compute pairs and the node-aware-off pair.
PLANS = {
    "full": {"100mbit": ["zeropp", "zero3-bf16", "ddp-bf16", "fsdp2-bf16", "deepspeed-bf16",
                         "zeropp-c32", "zero3-bf16-c32", "zero3-fp32", "ddp", "fsdp2-fp32", "deepspeed-fp32",
                         "deepspeed-hpz-regather-fp32", "zero3-flat", "zeropp-flat", "zero3-keep", "zeropp-keep",
                         "zeropp-nostep", "zeropp-delta"],
             "loopback": ["zeropp", "zero3-bf16", "deepspeed-bf16", "zero3-fp32", "deepspeed-fp32",
                          "deepspeed-zeropp", "zero3-keep", "zeropp-keep", "zeropp-delta"]},
    "targets": {"100mbit": ["zeropp", "zero3-bf16", "ddp-bf16", "fsdp2-bf16", "deepspeed-bf16", "zeropp-c32",
                            "zero3-bf16-c32", "ddp", "zero3-flat", "zeropp-flat", "zero3-keep", "zeropp-keep",
                            "zeropp-nostep", "zeropp-delta"],
                "loopback": ["zeropp", "zero3-bf16", "deepspeed-bf16", "zero3-keep", "zeropp-keep", "zeropp-delta"]},
    "quick": {"100mbit": ["zeropp", "zero3-bf16", "ddp-bf16", "fsdp2-bf16", "deepspeed-bf16"],
              "loopback": ["zeropp"]},
}


# ---------------------------------------------------------------- the peer runtimes


class _Peer(Runtime):
    """FSDP2 and DeepSpeed average the gradients over the ranks themselves, so a gradient divide
    factor f scales the loss by world / f (FSDP2's own set_gradient_divide_factor needs a PREMUL_SUM
    reduction, which gloo does not have)."""

    loss_scale = 1.0

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.loss_scale = torch.distributed.get_world_size() / factor


def _on_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


class FSDP2(_Peer):
    """PyTorch FSDP2: `fully_shard` on every block, then on the root (embeddings, final norm, tied head).
    bf16 = MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16): bf16 gathers, reduces AND compute.

    A model on the meta device (the Trainer's) is initialized as FSDP2's users do (torchtitan): sharded on
    the meta device, `to_empty` allocates this rank's shards only, then each parameter's local shard is filled
    from `weights` (models.weights.WeightSource: the very values our runtime reads), one parameter at a time:
    the peak is the shards plus one full parameter. The tied head stays tied (one parameter of the root)."""

    checkpoint_format = "fsdp2"

    def __init__(self, model: torch.nn.Module, cfg, dtype: str = "fp32", weights=None,
                 device: torch.device | None = None):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = {} if dtype == "fp32" else {
            "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])}
        meta = _on_meta(model)
        if meta and weights is None:
            raise ValueError("FSDP2: a model on the meta device needs its weight source (weights=...)")
        # parameters made in memory next to the meta ones (LoRA adapters) are their own source
        made = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta} if meta else {}
        for block in model.blocks:
            fully_shard(block, **policy)
        self.module = fully_shard(model, **policy)
        if meta:
            self.module.to_empty(device=device or torch.device("cpu"))
            init_fsdp2_shards(self.module, weights, made)
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

    def __init__(self, model: torch.nn.Module, cfg, dtype: str = "fp32", zero: dict | None = None, weights=None,
                 device: torch.device | None = None):
        self.module, self.ledger, self.timings, self.engine = model, CommLedger(), Timings(), None
        self.config, self.norm = deepspeed_config(cfg, dtype, zero), torch.zeros(())
        if _on_meta(model):
            if weights is None:
                raise ValueError("DeepSpeed: a model on the meta device needs its weight source (weights=...)")
            zero_init(model, weights, self.config)

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


@torch.no_grad()
def init_fsdp2_shards(module: torch.nn.Module, weights, made: dict | None = None) -> None:
    """Fill every (DTensor) parameter's local shard of a `fully_shard`-ed module (after `to_empty`) from
    `weights`, one parameter at a time: each rank draws the parameter whole and keeps its shard, sliced as
    DTensor shards it (`distribute_tensor(..., src_data_rank=None)`: every rank slices locally, no
    collective). `made`: name -> values of the parameters that were not on the meta device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    made = made or {}
    for name, p in module.named_parameters():  # a tied parameter once, by its first name (as materialize)
        full = made[name] if name in made else weights.read(name, 0, p.numel()).view(p.shape)
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements,
                                                 src_data_rank=None).to_local())
        else:
            p.copy_(full)


def zero_init(model: torch.nn.Module, weights, config: dict) -> None:
    """DeepSpeed's way to a model bigger than a rank: the modules are built inside `deepspeed.zero.Init`
    (each parameter partitioned over the ranks as soon as its module is made), then each parameter's values
    are loaded as DeepSpeed's docs load a checkpoint into such a model (GatheredParameters' docstring,
    transformers' `_load_state_dict_into_zero3_model`): gathered, set on rank 0 (from `weights`, the very
    values our runtime reads), and partitioned again (broadcast from rank 0), one parameter at a time.

    The modules are built from `model.config` and moved into `model` (the Trainer's object: its evaluation
    and logs use it), which keeps the blocks' activation checkpointing. Only plain Transformers (no LoRA
    adapters)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from trainer.activation_checkpointing import checkpoint_module

    if any(not p.is_meta for p in model.parameters()):
        raise NotImplementedError("DeepSpeed zero.Init here builds a plain Transformer: no parameters made in "
                                  "memory (LoRA adapters)")
    checkpointed = [i for i, block in enumerate(model.blocks) if getattr(block, "_activation_checkpointed", False)]
    with torch.random.fork_rng(devices=[]), deepspeed.zero.Init(config_dict_or_path=config):
        built = type(model)(model.config)  # its own init draws (nn.Linear's): kept off the run's random stream
    names = [n for n, _ in model.named_parameters()]
    if [n for n, _ in built.named_parameters()] != names:
        raise NotImplementedError(f"DeepSpeed zero.Init: {type(model).__name__}(config) does not rebuild the "
                                  f"model's parameters {names[:3]}...")
    built.init_seed = model.init_seed
    for name, child in built.named_children():
        setattr(model, name, child)
    for i in checkpointed:
        checkpoint_module(model.blocks[i])
    rank = torch.distributed.get_rank()
    for name, p in model.named_parameters():  # the tied head once
        with deepspeed.zero.GatheredParameters(p, modifier_rank=0):
            if rank == 0:
                p.data.copy_(weights.read(name, 0, p.numel()).view(p.shape))


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
    _, family, peer_options, _, _ = RUNTIMES[key]
    peer = {"fsdp2": FSDP2, "deepspeed": DeepSpeed}[family]
    trainer = Trainer(cfg, build_runtime=lambda model, zero_cfg, device, tp, weights=None: peer(
        model, cfg, weights=weights, device=device, **peer_options))
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
    p.add_argument("--plan", choices=list(PLANS), default=Quick("full", "quick"),
                   help="the runtimes of each setting (default %(default)s; targets: issue 17's T1-T4 and T6 rows)")
    p.add_argument("--settings", nargs="+", choices=["slow", "loopback"], default=["slow", "loopback"],
                   help="slow: the emulated cluster at --rate; loopback: 4 local ranks, unshaped (default both)")
    p.add_argument("--runtimes", nargs="+", choices=list(RUNTIMES), help="these in every setting, not the plan's")
    p.add_argument("--shape", choices=list(runner.SHAPES), default=Quick("issue", "suite"),
                   help="the model, runner.SHAPES (default %(default)s: the ablation's, whose runs the suite reuses)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=Quick(8, 4), help="steps per run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900)


def resolve(args) -> dict:
    """The plan: the runtimes to run in each setting (a link rate, or loopback)."""
    table = PLANS[args.plan]  # its "100mbit" stands for the slow link, --rate
    keys = {s: args.runtimes or table["100mbit" if s == "slow" else s] for s in args.settings}
    return {**options(args), "settings": {args.rate if s == "slow" else s: k for s, k in keys.items()}}


# an ablation row's (configuration, compute dtype) -> the peers runtime of the very same job
_FROM_ABLATION = {("zeropp", "bf16"): "zeropp", ("zero3", "bf16"): "zero3-bf16", ("zeropp", "fp32"): "zeropp-c32",
                  ("zero3", "fp32"): "zero3-bf16-c32"}


def _reusable(reuse: dict | None, key: str, setting: str, plan: dict) -> dict | None:
    """A row of the ablation run in the same suite with the very same job (our ZeRO-3 bf16 wire / ZeRO++, the
    same model and compute dtype), timed the same way (steps, warm-up)."""
    return next((r for r in (reuse or {}).get("rows", []) if r["ok"]
                 and _FROM_ABLATION.get((r["key"], r["compute"])) == key
                 and (r["setting"], r["shape"], r["micro_batch"], r["steps"], r["warmup"])
                 == (setting, plan["shape"], plan["micro_batch"], plan["steps"], plan["warmup"])), None)


def run(args, progress=print) -> dict:
    plan = resolve(args)
    mb, shape = plan["micro_batch"], plan["shape"]
    result = {"plan": plan, "model": runner.model_summary(shape=shape), "nodes": runner.NODES,
              "ranks_per_node": RANKS_PER_NODE, "rows": [], "notes": [],
              "common_args": runner.shown(runner.train_args(mb, plan["steps"], shape))}
    if not deepspeed_installed():
        result["notes"].append(f"DeepSpeed: {NOT_INSTALLED}")
    why, rows, jobs = runner.cluster_unavailable(), [], []
    for setting, keys in plan["settings"].items():
        if setting != "loopback" and why:
            result["notes"].append(f"{setting}: skipped, emulated cluster unavailable: {why}")
            continue
        for key in keys:
            label, family, runtime_args, compute, how = RUNTIMES[key]
            row = {"key": key, "label": label, "family": family, "setting": setting, "micro_batch": mb,
                   "compute": compute, "compute_how": how, "shape": shape}
            if prior := _reusable(getattr(args, "reuse", None), key, setting, plan):
                row = {**prior, **row, "reused_from": "ablation"}
                progress(f"  peers: {label} @ {setting}: from the ablation run")
            elif family == "deepspeed" and not deepspeed_installed():
                row.update(ok=False, error=NOT_INSTALLED)
            elif family in ("ours", "ddp"):  # measured below, as train.py
                jobs.append(Job(key, label, runtime_args, mb, setting, shape=shape, compute=compute))
            else:  # measured below, through this script's --worker (no autocast from the Trainer: see RUNTIMES)
                jobs.append(Job(key, label, ["--train.precision", "fp32"], mb, setting,
                                script=[__file__, "--worker", key], shape=shape, compute=compute))
            rows.append(row)
    measured = iter(runner.run_jobs("peers", jobs, plan["steps"], plan["warmup"], plan["timeout"], progress))
    result["rows"] = [row if "ok" in row else {**next(measured), **row} for row in rows]
    bf16_mb = result["model"]["params"] * 2 / 1e6  # the model in bf16
    for setting in plan["settings"]:
        same = {r["key"]: r for r in result["rows"] if r["setting"] == setting and r["ok"]}
        for r in same.values():
            if zpp := same.get("zeropp" if r["compute"] == "bf16" else "zeropp-c32"):  # ZeRO++, same compute dtype
                r["zeropp_speedup"] = r["step_ms"] / zpp["step_ms"]
            if r.get("phys_tx_mb_node"):
                r["phys_per_model_bf16"] = r["phys_tx_mb_node"] / bf16_mb
        for dtype in ("fp32", "bf16"):  # the same wire AND compute dtype
            if (ours := same.get(f"zero3-{dtype}")) and (ds := same.get(f"deepspeed-{dtype}")):
                ours["vs_deepspeed_same_dtype"] = ds["step_ms"] / ours["step_ms"]
    return result


COLUMNS = [("label", "runtime", "{}"), ("compute_cell", "compute", "{}"), ("setting", "link", "{}"),
           ("step_ms", "step ms", "{:.0f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
           ("tflops_per_rank", "TFLOP/s per rank", "{:.4f}"),
           ("zeropp_speedup", "its step / ZeRO++'s (same compute dtype)", "{:.2f}x"),
           ("vs_deepspeed_same_dtype", "DeepSpeed's step / ours, same wire + compute dtype", "{:.2f}x"),
           ("phys_tx_mb_node", "physical MB/node/step (tx)", "{:.2f}"),
           ("phys_per_model_bf16", "physical / model bf16 bytes", "{:.3f}"), ("wire_ms", "wire time ms", "{:.0f}"),
           ("final_loss", "loss at last step", "{:.4f}")]
SCRIPT_COLUMNS = [("label", "runtime", "{}"), ("compute", "compute", "{}"), ("script", "script", "`{}`"),
                  ("args", "its arguments", "`{}`")]


def plots(result: dict, out_dir: Path) -> list[Path]:
    tokens = {}  # (label [compute], setting) -> tokens/s of its first row
    for r in (r for r in result["rows"] if r["ok"]):
        tokens.setdefault((f"{r['label']} [{r['compute']}]", r["setting"]), r["tokens_per_s"])
    labels = list(dict.fromkeys(label for label, _ in tokens))
    settings = list(dict.fromkeys(setting for _, setting in tokens))
    return [report.bar_chart(
        out_dir, "peers_throughput", labels,
        {("unshaped loopback" if s == "loopback" else f"{s} links, 2 nodes x 2 ranks"):
         [tokens.get((label, s)) for label in labels] for s in settings},
        f"{result['model']['params'] / 1e6:.1f}M-parameter GPT-2, the same training loop",
        xlabel="tokens/s (4 ranks)", figsize=(9, 0.5 * len(labels) + 1.5), horizontal=True)]


def markdown(result: dict) -> str:
    plan = result["plan"]
    rows = [dict(r, label=r["label"] + " (ablation)" * ("reused_from" in r),
                 compute_cell=f"{r['compute']} ({r['compute_how']})" if r["compute_how"] else r["compute"])
            for r in result["rows"]]
    scripts = {}  # each runtime once, as it first appears
    for r in (r for r in result["rows"] if "script" in r):
        scripts.setdefault(r["key"], dict(r, args=" ".join(r["args"]) or "–"))
    return "\n".join([
        f"Setup: {runner.model_words(result['model'])} (`--shape {plan['shape']}`); {plan['micro_batch']}x{SEQ} "
        f"tokens per rank on {result['nodes']} nodes x {result['ranks_per_node']} ranks; {plan['steps']} steps per "
        f"run, the first {plan['warmup']} not timed.", "", *report.md_table(rows, COLUMNS), "",
        f"Common arguments: `{result['common_args']}`. Each runtime's script and arguments:", "",
        *report.md_table(scripts.values(), SCRIPT_COLUMNS, "llll")])


if __name__ == "__main__":
    sys.exit(main_one("peers"))
