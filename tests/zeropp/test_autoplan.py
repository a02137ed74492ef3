"""plan.auto (zeropp.autoplan): choices from fake probes, the cost model's bytes and memory against
built runtimes, collective-safe probes, the stored plan on resume."""

import contextlib
import dataclasses
import io
import json
import math
import re
import time
import types

import pytest
import torch

from models.config import ModelConfig
from models.transformer import Transformer, lm_loss
from tests.trainer.test_train import corpus, tiny_args  # noqa: F401  (the module-scoped corpus fixture)
from tests.zeropp.test_engine import batches, deeper_model
from trainer.config import parse_args
from trainer.loop import train
from trainer.spawn import run_ranks
from zeropp import autoplan, build_runtime
from zeropp.autoplan import (PlanError, Probes, StepTimeCheck, candidates, ComputeProbe, choose, plan_state, price,
                             probe, reuse)
from zeropp.config import ZeroConfig, ZeroConfigError
from zeropp.topology import build_mesh

BASE = ZeroConfig(stage=3, ranks_per_node=2, zero_quantization_block_size=64)
MBIT = 1e6 / 8  # bytes per second


def _model() -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelConfig.from_preset("llama-tiny", n_layer=4))


def _probes(inter_bandwidth: float, memory: int = 2**40, world: int = 4, device: str = "cpu") -> Probes:
    """2 nodes x 2 ranks, a 10 Gbit/s node inside, `inter_bandwidth` across; 2 ms a block, 1 ms the rest;
    communication fully hidden behind compute where it is shorter."""
    return Probes(world, 2, device, "gloo", {"intra_node": 10_000 * MBIT, "inter_node": inter_bandwidth},
                  {"intra_node": 20e-6, "inter_node": 100e-6}, 2e-3, 1e-3, 2e-9, 1e-5, 2e-9, 1.0, memory)


def _plan(inter_bandwidth, min_weight_bits=8, **constraints):
    """The plan under plan.min_weight_bits' default floor unless told."""
    return choose(price(_model(), _probes(inter_bandwidth), base=BASE), min_weight_bits, **constraints)


def test_candidates_are_valid_and_keep_the_users_keys():
    found = candidates(dataclasses.replace(BASE, communication_data_type="fp16"))
    assert len(found) >= 8
    for name, cfg in found.items():
        if cfg.stage == 3:
            assert cfg.communication_data_type == "fp16" and cfg.zero_quantization_block_size == 64, name
    assert found["DDP"] == ZeroConfig(stage=0, ranks_per_node=2)


@pytest.mark.parametrize("key,value,expected", [("min_weight_bits", "40", "an integer in [0, 32]"),
                                                ("memory_cap_gb", "-1", "a finite number >= 0"),
                                                ("check_after_steps", "-2", "an integer >= 0")])
def test_bad_plan_values_name_key_value_and_expected(key, value, expected):
    cfg = parse_args([f"--plan.{key}", value])
    with pytest.raises(ZeroConfigError, match=rf"plan.{key}: value {value}.*expected {re.escape(expected)}"):
        cfg.plan.validate()


def test_a_fast_link_keeps_the_weights_and_gradients_unquantized():
    """Communication hides behind compute: quantizing only adds codec work."""
    plan = _plan(100_000 * MBIT, min_weight_bits=0)
    cfg = plan.chosen.config
    assert not cfg.zero_quantized_weights and not cfg.zero_quantized_gradients
    assert plan.chosen.terms["codec"] == 0


def test_a_slow_link_picks_int4_deltas():
    """100 Mbit/s across nodes: the fewest cross-node bytes at 8-bit fidelity or better."""
    plan = _plan(100 * MBIT)
    assert plan.chosen.name == "ZeRO++ with int4 deltas"
    assert plan.runner_up is not None and "inter_node" in plan.reason
    cross = {c.name: sum(v["cross_node_sent"] for v in c.step_bytes.values()) for c in plan.costs}
    assert cross["ZeRO++ with int4 deltas"] == min(v for k, v in cross.items() if k != "ZeRO++ int4 weights")


def test_the_fidelity_floor_rules_out_fewer_weight_bits():
    free = _plan(100 * MBIT, min_weight_bits=0)
    assert free.chosen.config.zero_quantized_weights_bits == 4  # int4 weights or deltas: fewest bytes
    floor8 = _plan(100 * MBIT, min_weight_bits=8)
    for c in floor8.costs:
        quantized = c.config.zero_quantized_weights and not c.config.zero_quantized_weights_delta
        assert bool(c.excluded) == (quantized and c.config.zero_quantized_weights_bits < 8), c.name
    floor16 = _plan(100 * MBIT, min_weight_bits=16)
    assert not floor16.chosen.config.zero_quantized_weights


def test_a_tight_memory_cap_picks_what_fits_or_names_the_cap():
    unconstrained = _plan(100 * MBIT)
    cap = unconstrained.chosen.memory_bytes - 1
    capped = _plan(100 * MBIT, memory_cap_bytes=cap)
    assert capped.chosen.memory_bytes <= cap and capped.chosen.name != unconstrained.chosen.name
    leanest = min(c.memory_bytes for c in capped.costs if c.weight_bits >= 8)
    with pytest.raises(PlanError, match="plan.memory_cap_gb") as e:
        _plan(100 * MBIT, memory_cap_bytes=leanest - 1)
    assert f"{leanest / 2**20:.1f} MB" in str(e.value)


def test_a_resume_keeps_its_stage():
    plan = _plan(100_000 * MBIT, min_weight_bits=0, stage=0)
    assert plan.chosen.name == "DDP"


def _model_for(frozen: bool) -> Transformer:
    """5 gpt2-tiny blocks; `frozen`: their MLPs frozen (a fine-tuning's base weights)."""
    model = deeper_model(5)
    for block in model.blocks if frozen else ():
        block.mlp.requires_grad_(False)
    return model


def _built(rank, world, base, frozen, names, micro_batches):
    """Each named candidate's runtime, really built on this rank: its predicted bytes and memory,
    and (DDP, which predicts none) the ledger of a step."""
    out = {}
    for name in names:
        cfg = candidates(base)[name]
        runtime = build_runtime(_model_for(frozen), cfg, torch.device("cpu"))
        trainable = [p for p in runtime.module.parameters() if p.requires_grad]
        states = {**runtime.model_state_bytes(), "optimizer states": 8 * sum(p.numel() for p in trainable)}
        if cfg.stage == 0:
            mine = batches(1)[0][rank * 2:(rank + 1) * 2]
            lm_loss(runtime(mine[:, :-1]), mine[:, 1:]).backward()
            step = {tag: {k: e[k] for k in ("sent", "cross_node_sent")} for tag, e in runtime.ledger.totals().items()}
        else:
            step = runtime.predicted_step_bytes(micro_batches)
        out[name] = step, sum(states.values()) + runtime.buffer_bytes()
        runtime.close()
    return out


@pytest.mark.parametrize("frozen,names", [
    (False, ["ZeRO-3 + keep-gathered", "ZeRO++ with int4 deltas", "ZeRO-3 + qwZ int8", "ZeRO++ int4 weights", "DDP"]),
    (True, ["ZeRO-3", "ZeRO++ with int4 deltas", "DDP"]),  # frozen units stored as int8 codes
])
def test_cost_model_bytes_and_memory_equal_built_runtimes(frozen, names):
    # bf16 weights: buffers that may decode in place
    base = dataclasses.replace(BASE, param_dtype="bf16", zero_quantized_nontrainable_weights=frozen)
    built = run_ranks(_built, 4, args=(base, frozen, names, 2), ranks_per_node=2)[0]  # rank 0's: what is priced
    priced = {c.name: c for c in price(_model_for(frozen), _probes(100 * MBIT), micro_batches=2, base=base)}
    for name in names:
        step, memory = built[name]
        assert priced[name].step_bytes == step, name
        assert priced[name].memory_bytes == memory, name


def test_a_step_of_several_trained_models_adds_their_costs():
    """PPO's step: the actor and a critic of another shape, 2 optimizer steps each: every candidate's
    seconds, bytes and states are the sum of each model's alone, times its steps; memory is priced once
    over their states together (one baseline and activations, as the trainer's predicted peak has them)."""
    actor = _model()
    with torch.device("meta"):
        critic = Transformer(ModelConfig.from_preset("llama-tiny", n_layer=2, num_labels=1))
    probes = _probes(100 * MBIT)
    seen = []

    def memory(config, states, buffers):
        seen.append(sum(states.values()) + buffers)
        return 1000 + seen[-1]
    both = {c.name: c for c in autoplan.price_step([(actor, 1, 2), (critic, 1, 2)], probes, memory, BASE)}
    alone = [{c.name: c for c in price(m, probes, base=BASE)} for m in (actor, critic)]
    assert set(both) == set(alone[0]) and len(both) >= 8
    for name, c in both.items():
        a, b = alone[0][name], alone[1][name]
        assert c.step_seconds == pytest.approx(2 * (a.step_seconds + b.step_seconds))
        assert c.terms == pytest.approx({k: 2 * (a.terms[k] + b.terms[k]) for k in a.terms})
        tags = set(a.step_bytes) | set(b.step_bytes)
        assert c.step_bytes == {t: {k: 2 * (a.step_bytes.get(t, {}).get(k, 0) + b.step_bytes.get(t, {}).get(k, 0))
                                    for k in ("sent", "cross_node_sent")} for t in tags}
        assert c.collectives == {level: 2 * (a.collectives[level] + b.collectives[level]) for level in a.collectives}
        states = sum(a.states.values()) + sum(b.states.values()) + a.buffers + b.buffers
        assert c.memory_bytes == 1000 + states  # once, over both models' states
        assert c.weight_bits == min(a.weight_bits, b.weight_bits)


def _probe_on_ranks(rank, world):
    torch.manual_seed(rank)  # the ranks time different work: only the reduction makes them agree
    mesh = build_mesh(ranks_per_node=2, thread_groups=False)
    model = Transformer(ModelConfig.from_preset("llama-tiny"))
    probes = probe(mesh, torch.device("cpu"), ComputeProbe(model, 1, 16, torch.device("cpu"), torch.float32))
    plan = choose(price(model, probes, base=BASE), memory_cap_bytes=probes.memory_bytes)
    return dataclasses.asdict(probes), plan.chosen.name


def test_probes_are_the_same_on_every_rank():
    """Every rank takes part in the timed collectives and the MAX reduction, so every rank holds
    the same numbers and chooses the same plan."""
    results = run_ranks(_probe_on_ranks, 4, ranks_per_node=2)
    assert all(r == results[0] for r in results)
    probes = results[0][0]
    for level in ("intra_node", "inter_node"):
        assert 0 < probes["bandwidth"][level] < math.inf and probes["latency"][level] >= 0
    for measured in ("block_seconds", "head_seconds", "optimizer_seconds", "codec_seconds", "memory_bytes"):
        assert probes[measured] > 0, measured
    assert 0 <= probes["overlap"] <= 1 and probes["jitter"] >= 0
    assert (probes["world_size"], probes["ranks_per_node"], probes["device"]) == (4, 2, "cpu")


DRIFT = 0.02  # seconds: rank r works BASE_WORK + r x DRIFT
BASE_WORK = 0.02


def _drifting_ranks(rank, world):
    mesh = build_mesh(ranks_per_node=2, thread_groups=False)
    comm = autoplan.Comm(mesh)
    waits = []
    run = autoplan._timed(lambda: time.sleep(BASE_WORK + rank * DRIFT), 3, comm.barrier, waits=waits)
    jitter = autoplan._jitter(comm, waits, run, comm.barrier)
    comm.close()
    mesh.close()
    return jitter


def test_the_jitter_probe_measures_how_long_ranks_wait_for_the_slowest():
    """Rank r works r x DRIFT longer than rank 0: at the collective after it, rank r waits (3 - r) x DRIFT for
    rank 3; the jitter is the ranks' mean of wait / sqrt(work), the same on every rank."""
    jitters = run_ranks(_drifting_ranks, 4, ranks_per_node=2)
    assert all(j == jitters[0] for j in jitters)
    expected = sum((3 - r) * DRIFT / math.sqrt(BASE_WORK + r * DRIFT) for r in range(4)) / 4
    assert jitters[0] == pytest.approx(expected, rel=0.3)


@pytest.mark.parametrize("inter_bandwidth,like_inside", [(10_000 * MBIT, 1.0), (100 * MBIT, 0.01)])
def test_waiting_for_the_slowest_rank_hides_in_the_wires_wait_not_in_the_processors_work(inter_bandwidth,
                                                                                         like_inside):
    """With jitter j a step of work w and k collectives waits k x j x sqrt(w / k): DDP's k is its one
    gradient bucket (a 25 MB bucket holds this model's gradients) and the step's own two all-reduces (token
    counts, loss); a sharded runtime's has more (its gathers and reductions, and the gradient norm's). The
    skew adds to the communication that starts only when the last rank arrives (the latency, all of it inside
    a node, and across nodes as much as that link is as fast as the node's own: here 10 Gbit/s inside) and
    hides in the wire's wait."""
    still = _probes(inter_bandwidth)
    before = {c.name: c for c in price(_model(), still, base=BASE)}
    for c in price(_model(), dataclasses.replace(still, jitter=0.01), base=BASE):
        t = c.terms
        work = t["compute"] + t["codec"] + t["optimizer"]
        waits = (t["skew"] / 0.01) ** 2 / work
        visible = before[c.name].step_seconds - work
        comm = t["intra_node"] + t["inter_node"] + t["latency"]
        share = (t["intra_node"] + t["latency"] + like_inside * t["inter_node"]) / comm
        assert t["processor_bound"] == pytest.approx(visible * share), c.name
        assert c.step_seconds == pytest.approx(work + max(visible, t["skew"]) + min(visible * share, t["skew"]))
        if like_inside == 1:  # all of it waits for the last rank: the sum
            assert share == pytest.approx(1) and c.step_seconds == pytest.approx(work + visible + t["skew"])
        if c.name == "DDP":
            assert waits == pytest.approx(1 + autoplan.STEP_ALL_REDUCES)
        else:
            assert waits > 2 * len(_model().blocks) + autoplan.STEP_ALL_REDUCES + 1, c.name  # a gather, a reduce a block


class _SimulatedLink:
    """A comm over a link of `latency` seconds and `bandwidth` bytes/s sent, on a clock of its own: each
    all-gather moves the clock on by what the link takes (the probe reads that clock), those in flight together
    by one latency, each chunk seen kept (those in flight together as one)."""

    def __init__(self, latency, bandwidth, n=2, slowdowns=(1.0,)):
        self.latency, self.bandwidth, self.now, self.chunks, self.in_flight = latency, bandwidth, 0.0, [], 0
        self.mesh = types.SimpleNamespace(size=lambda level: n)
        self.n = n
        self.slowdowns, self.large_runs = slowdowns, 0  # the large chunk's k-th run takes slowdowns[k % len] times

    def all_gather(self, out, shard, group, tag, async_op):
        large = shard.numel() > autoplan.PROBE_BYTES[0]
        if large and not self.in_flight:
            self.large_runs += 1
        slowdown = self.slowdowns[(self.large_runs - 1) % len(self.slowdowns)] if large else 1.0
        wire = (self.n - 1) * shard.numel() / self.bandwidth
        self.now += slowdown * ((self.latency if not self.in_flight else 0) + wire)
        if self.in_flight:
            self.chunks[-1] += shard.numel()
        else:
            self.chunks.append(shard.numel())
        self.in_flight += 1
        return types.SimpleNamespace(wait=self._done)

    def _done(self):
        self.in_flight -= 1

    def all_reduce(self, tensor, group, tag, op):
        pass  # one rank: the MAX is its own


@pytest.mark.parametrize("latency, bandwidth, grown", [(1e-3, 10_000 * MBIT, True), (1e-3, 10 * MBIT, False)])
def test_the_link_probe_recovers_bandwidth_and_latency_and_grows_its_chunk_on_a_fast_link(
        monkeypatch, latency, bandwidth, grown):
    link = _SimulatedLink(latency, bandwidth)
    monkeypatch.setattr("zeropp.autoplan.time.perf_counter", lambda: link.now)
    measured_bandwidth, measured_latency = autoplan._link(link, "inter_node", torch.device("cpu"), reps=3)
    assert measured_bandwidth == pytest.approx(bandwidth) and measured_latency == pytest.approx(latency)
    large = max(link.chunks)
    assert (large > autoplan.PROBE_BYTES[1]) == grown and large <= autoplan.PROBE_BYTES_MAX
    if grown:  # grown until the wire, not the latency, is most of the large chunk's time, and past a time slice
        assert latency + large / bandwidth >= autoplan.LINK_SIGNAL * (latency + autoplan.PROBE_BYTES[0] / bandwidth)
        assert latency + large / bandwidth >= autoplan.LINK_SECONDS


@pytest.mark.parametrize("level, slowdowns", [("intra_node", (3.0, 3.0, 1.0)), ("inter_node", (1.0, 0.5, 1.0))])
def test_the_link_probe_reads_the_large_chunk_as_each_level_disturbs_it(monkeypatch, level, slowdowns):
    """Inside a node a slower run is a descheduled rank's: two of three (the median's pick) are left out for the
    fastest after the first. Across nodes a faster run rides a shaped link's token bucket: the median leaves it
    out. Either way the link's own bandwidth and latency come back."""
    link = _SimulatedLink(1e-3, 10 * MBIT, slowdowns=slowdowns)
    monkeypatch.setattr("zeropp.autoplan.time.perf_counter", lambda: link.now)
    bandwidth, latency = autoplan._link(link, level, torch.device("cpu"), reps=3)
    assert bandwidth == pytest.approx(10 * MBIT) and latency == pytest.approx(1e-3)


LATE = 0.02  # seconds rank 0 reaches each timed run after the others


def _one_late_rank(rank, world):
    """The link probe where rank 0 starts every timed run LATE seconds after the others (as a descheduled rank):
    its clock is read that much later at each run's start."""
    mesh = build_mesh(ranks_per_node=2, thread_groups=False)
    comm = autoplan.Comm(mesh)
    clock, starts = time.perf_counter, iter(range(10**6))

    def late_clock():
        if next(starts) % 2 == 0:  # _timed reads the clock at each run's start and end
            time.sleep(LATE)
        return clock()
    if rank == 0:
        autoplan.time.perf_counter = late_clock
    try:
        return autoplan._link(comm, "inter_node", torch.device("cpu"), reps=3)
    finally:
        autoplan.time.perf_counter = clock
        comm.close()
        mesh.close()


def test_the_link_probe_times_the_collective_not_the_wait_for_a_late_rank():
    """Every rank but a late one waits LATE for it in each all-gather; the link's time is the collective's own,
    as its last rank measures it (the waiting is the skew's): the latency stays far below LATE, on every rank."""
    links = run_ranks(_one_late_rank, 4, ranks_per_node=2)
    assert all(link == links[0] for link in links)
    bandwidth, latency = links[0]
    assert latency < LATE / 4 and bandwidth > 4 * autoplan.PROBE_BYTES[1] / LATE


def test_the_compute_probe_times_the_block_apart_from_the_rest():
    """One run of the one-block model gives the block's share of its work (hooks at the block's edges) and
    so the rest's: work put into the block's forward and backward counts to the block, work put into the
    head's forward and backward does not. Processor time: the shares hold however busy the machine is."""
    pause = 0.03

    def work_for_a_while(*_):
        start = time.process_time()
        while time.process_time() - start < pause:
            pass
    probe_work = ComputeProbe(Transformer(ModelConfig.from_preset("gpt2-tiny")), 1, 16, torch.device("cpu"),
                              torch.float32)
    block, head = probe_work.model.blocks[0], probe_work.model.head
    block.mlp.register_forward_hook(work_for_a_while)
    block.mlp.register_full_backward_hook(work_for_a_while)

    def head_busy(module, args, out):
        work_for_a_while()
        out.register_hook(work_for_a_while)
    head.register_forward_hook(head_busy)
    start = time.process_time()
    share = probe_work()
    run = time.process_time() - start
    assert share * run >= 2 * pause and (1 - share) * run >= 2 * pause


def test_the_probed_overlap_hides_the_shorter_of_compute_and_communication():
    """Fully overlapped, a step costs the longer of compute (+ codec) and the communication that can hide
    (all but the exposed part), plus the exposed part; with no overlap their sum; the optimizer is added either
    way; a config without overlap_comm hides nothing whatever the probe says. At 100 Mbit/s some candidates are
    wire-bound, some not."""
    for overlap in (0.0, 0.5, 1.0):
        probes = dataclasses.replace(_probes(100 * MBIT), overlap=overlap)
        for base in (BASE, dataclasses.replace(BASE, overlap_comm=False)):
            for c in price(_model(), probes, base=base):
                work = c.terms["compute"] + c.terms["codec"]
                comm = c.terms["intra_node"] + c.terms["inter_node"] + c.terms["latency"]
                assert 0 < c.terms["exposed"] < comm or c.name == "DDP", c.name
                hidden = overlap * min(work, comm - c.terms["exposed"]) if c.config.overlap_comm else 0.0
                assert c.terms["hidden"] == pytest.approx(hidden), c.name
                assert c.step_seconds == pytest.approx(work + comm - hidden + c.terms["optimizer"]), c.name
                assert c.terms["optimizer"] > 0 and c.terms["compute"] == pytest.approx(4 * 2e-3 + 1e-3)


def test_only_the_edges_of_a_step_are_exposed():
    """What no compute hides is the resident units' and the first block's gathers and reductions (and the
    step's own all-reduces): the same for a model of 4 blocks and of 8, whose communication doubles in the
    blocks. DDP's one bucket is reduced after the whole backward: all of it is exposed."""
    probes = _probes(100 * MBIT)
    deeper = _model()
    with torch.device("meta"):
        deeper = Transformer(ModelConfig.from_preset("llama-tiny", n_layer=8))
    four, eight = ({c.name: c for c in price(m, probes, base=BASE)} for m in (_model(), deeper))

    def comm(c):
        return c.terms["intra_node"] + c.terms["inter_node"] + c.terms["latency"]
    for name, c in four.items():
        if name == "DDP":
            assert c.terms["exposed"] == pytest.approx(comm(c))
        else:
            assert eight[name].terms["exposed"] == pytest.approx(c.terms["exposed"], rel=1e-3), name  # (padding)
            assert comm(eight[name]) - eight[name].terms["exposed"] > 2 * (comm(c) - c.terms["exposed"]), name


def test_a_resume_on_the_same_machine_keeps_its_plan():
    """The stored plan survives state.json's JSON round trip; on the same machine it is reused even
    where new probes would choose otherwise; on another one the run re-plans and says so."""
    slow = _probes(100 * MBIT)
    plan = choose(price(_model(), slow, base=BASE), min_weight_bits=8)
    saved = json.loads(json.dumps(plan_state(plan, slow)))
    fast = _probes(100_000 * MBIT)
    assert choose(price(_model(), fast, base=BASE), min_weight_bits=8).chosen.name != plan.chosen.name
    kept, note = reuse(saved, fast.fingerprint())
    assert kept == plan.chosen.config and "reused" in note
    replanned, note = reuse(saved, _probes(100 * MBIT, world=8).fingerprint())
    assert replanned is None and "machine changed" in note and "'world_size': 8" in note
    assert reuse(None, fast.fingerprint()) == (None, "")


def test_step_time_check_warns_on_a_large_miss():
    check = StepTimeCheck(predicted_seconds=0.5, after=2)
    lines = [check.add(seconds) for seconds in (9.0, 0.8, 1.2, 1.0)]
    assert lines[:2] == [None, None] and lines[3] is None  # the warm-up step, one step, then once only
    assert "measured 1000.0 ms/step over 2 steps" in lines[2] and "WARNING" in lines[2]  # the warm-up not counted
    near = StepTimeCheck(predicted_seconds=1.1, after=1, scope="the update alone")
    line = [near.add(5.0), near.add(1.0)][1]
    assert "WARNING" not in line and "ms/step (the update alone)" in line


def _train_with_log(rank, world, argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = train(parse_args(argv))
    return result.losses, out.getvalue()


@pytest.mark.slow
def test_the_trainer_plans_logs_stores_and_reuses_its_plan(corpus, tmp_path):  # noqa: F811
    """2 nodes x 1 rank: the plan is logged before the first step and stored; a resume on the same
    layout reuses it without probing and repeats the run; on one process the run re-plans, keeping the
    checkpoint's stage (its format)."""
    cache, auto = tmp_path / "cache", ("--plan.auto", "true", "--plan.check_after_steps", "2",
                                       "--zero_optimization.ranks_per_node", "1", "--train.micro_batch_size", "2",
                                       "--train.steps", "4", "--train.eval_interval", "4", "--train.eval_batches", "1")
    argv = tiny_args(corpus, tmp_path / "a", cache, *auto, "--train.checkpoint_interval", "2")
    losses, log = run_ranks(_train_with_log, 2, args=(argv,), ranks_per_node=1)[0]
    assert log.index("plan: ") < log.index("iteration") and "runner-up" in log and "plan check: measured" in log
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    state = json.loads((step2 / "state.json").read_text())
    assert state["plan"]["machine"] == {"world_size": 2, "ranks_per_node": 1, "device": "cpu"}
    assert state["config"]["zero_optimization"] == state["plan"]["config"]  # what the run was built with
    assert ("runtime: DDP" in log) == (state["plan"]["config"]["stage"] == 0)

    argv = tiny_args(corpus, tmp_path / "b", cache, *auto, "--resume", str(step2))
    resumed, log = run_ranks(_train_with_log, 2, args=(argv,), ranks_per_node=1)[0]
    assert f"plan: {state['plan']['chosen']} reused from the checkpoint" in log
    assert "nothing probed" in log and "probed and planned" not in log  # the fingerprint needs no probe
    assert {s: resumed[s] for s in (3, 4)} == {s: losses[s] for s in (3, 4)}

    with contextlib.redirect_stdout(io.StringIO()) as out:
        train(parse_args(tiny_args(corpus, tmp_path / "c", cache, *auto, "--train.micro_batch_size", "4",
                                   "--resume", str(step2))))
    log = out.getvalue()
    assert "plan: the machine changed" in log and "re-planned" in log
    assert "excluded: the checkpoint to resume is stage" in log
