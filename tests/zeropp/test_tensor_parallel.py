"""Tensor parallelism (zeropp.tensor_parallel) against the single-process reference: same losses, same weights."""

import contextlib
import io
import re
import sys

import pytest
import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.transformer import Transformer, lm_loss
from tests.trainer.test_train import corpus  # noqa: F401  (the module-scoped corpus fixture)
from tests.zeropp.test_engine import BATCH, OPTIM, batches
from tests.zeropp.test_engine import reference as engine_reference
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from zeropp import build_runtime
from zeropp.checkpoint import consolidated_state_dict, read_safetensors
from zeropp.config import TensorParallelConfig, ZeroConfig
from zeropp.tensor_parallel.runtime import consolidated_tensors

VOCAB = 97  # an odd vocabulary: the slices differ in length (the batches use its first 96 ids)


def make_model(preset: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB))


def reference(preset: str, steps: int):
    """The single-process run to match (test_engine's, on this file's odd-vocabulary model)."""
    return engine_reference(make_model(preset), steps)


def _build(preset, stage, tp, partitions):
    runtime = build_runtime(make_model(preset), ZeroConfig(stage=stage, communication_data_type="fp32"),
                            torch.device("cpu"), TensorParallelConfig(size=tp, partitions=partitions))
    return runtime, build_optimizer(runtime.module, OPTIM)


def _tp_run(rank, world, preset, steps, tp, stage, partitions, save_to=None):
    runtime, optimizer = _build(preset, stage, tp, partitions)
    dp, dp_rank = runtime.mesh.world_size, runtime.mesh.rank
    per_rank = BATCH // dp
    losses = []
    for sample in batches(steps):
        mine = sample[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        loss = runtime.lm_loss(runtime(mine[:, :-1]), mine[:, 1:])
        runtime.backward(loss)
        runtime.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    state = runtime.full_state_dict()
    if save_to is not None:  # a saved and reloaded run holds exactly the same weights and optimizer state
        runtime.save(save_to, optimizer)
        dist.barrier()
        again, again_optimizer = _build(preset, stage, tp, partitions)
        again.load(save_to, again_optimizer)
        assert all(torch.equal(a, b) for a, b in zip(runtime.module.parameters(), again.module.parameters()))
        for a, b in zip(runtime.module.parameters(), again.module.parameters()):
            if a.numel():  # a rank's empty piece of a parameter has no state to restore
                mine, loaded = optimizer.state[a], again_optimizer.state[b]
                assert mine.keys() == loaded.keys() and all(torch.equal(mine[k], loaded[k]) for k in mine)
        again.close()
    runtime.close()
    return losses, (state if rank == 0 else None)


# TP 2 under DDP and TP 2 x DP 2 under ZeRO-3, K = 1 and pipelined (which only reorders work);
# GPT-2 (tied vocab-parallel head, learned positions, biases) and LLaMA with GQA (kv heads split).
@pytest.mark.parametrize("world,stage,partitions,preset", [(2, 0, 1, "gpt2-tiny"), (2, 0, 4, "llama-tiny"),
                                                           (4, 3, 1, "llama-tiny"), (4, 3, 2, "gpt2-tiny")])
def test_tensor_parallel_matches_single_process(world, stage, partitions, preset, tmp_path):
    steps = 20
    ref_losses, ref_state = reference(preset, steps)
    losses, state = run_ranks(_tp_run, world, args=(preset, steps, 2, stage, partitions, tmp_path),
                              ranks_per_node=world)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (preset, losses[:3], ref_losses[:3])
    assert state.keys() == ref_state.keys()
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in state)
    assert worst < 1e-5, f"{preset}: weights differ by {worst}"
    # The checkpoint's slices consolidate offline (no process group) to the same unsliced weights.
    read = consolidated_state_dict if stage == 3 else (lambda d: read_safetensors(d / "model.safetensors"))
    saved = consolidated_tensors(tmp_path, read)
    assert max((saved[k] - ref_state[k]).abs().max().item() for k in saved) < 1e-5
    if stage == 3 and preset == "gpt2-tiny":  # re-sliced for TP 4 x DP 1, it trains on like one process
        _, expected = reference(preset, steps + 1)
        state = run_ranks(_continue_resliced, 4, args=(preset, tmp_path, steps))[0]
        assert max((state[k] - expected[k]).abs().max().item() for k in state) < 1e-5


def _continue_resliced(rank, world, preset, directory, steps):
    runtime, optimizer = _build(preset, 3, world, 1)
    runtime.load(directory, optimizer)
    sample = batches(steps + 1)[steps]
    runtime.backward(runtime.lm_loss(runtime(sample[:, :-1]), sample[:, 1:]))
    runtime.clip_grad_norm_(1.0)
    optimizer.step()
    state = runtime.full_state_dict()
    runtime.close()
    return state if rank == 0 else None


def _cross_entropy(rank, world, logits, labels):
    from zeropp.tensor_parallel.collectives import TPComm
    from zeropp.tensor_parallel.loss import vocab_parallel_cross_entropy
    from zeropp.tensor_parallel.parallelize import split_bounds
    from zeropp.topology import build_mesh
    tp = TPComm(build_mesh(tp=world, thread_groups=False), TensorParallelConfig(size=world))
    start, end = split_bounds(logits.shape[-1], world, tp.rank)
    mine = logits[..., start:end].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, labels, start, tp)
    loss.backward()
    return loss.item(), mine.grad, (start, end)


def test_vocab_parallel_cross_entropy_equals_the_full_one():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, VOCAB, generator=g) * 4
    labels = torch.randint(0, VOCAB, (3, 5), generator=g)
    labels[0, :2] = -100  # ignored targets
    full = logits.clone().requires_grad_()
    expected = lm_loss(full, labels)
    expected.backward()
    results = run_ranks(_cross_entropy, 3, args=(logits, labels))  # 97 = 33 + 32 + 32 entries
    for loss, grad, (start, end) in results:
        assert abs(loss - expected.item()) < 1e-6
        torch.testing.assert_close(grad, full.grad[..., start:end], rtol=0, atol=1e-7)


def _accftm_run(rank, world, tp_config, steps):
    runtime = build_runtime(make_model("llama-tiny"), ZeroConfig(stage=0), torch.device("cpu"), tp_config)
    optimizer = build_optimizer(runtime.module, OPTIM)
    losses, sent = [], []
    for sample in batches(steps):
        runtime.ledger.reset()
        loss = runtime.lm_loss(runtime(sample[:, :-1]), sample[:, 1:])
        runtime.backward(loss)
        runtime.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        totals = runtime.ledger.totals()  # the sublayers' all-reduces (not the embedding's and head's)
        sent.append(sum(totals[tag]["sent"] for tag in ("tp forward all-reduce", "tp backward all-reduce")))
    replicated = {n: p.detach().clone() for n, p in runtime.module.named_parameters() if n not in runtime.plan}
    return losses, sent, replicated, runtime.partition_plan, runtime.take_notes()


def test_planned_partitions_stay_exact():
    """tensor_parallel.partitions 0: the planner picks K per sublayer on the first batch; training
    then equals one process (pipelining only reorders work)."""
    ref_losses, _ = reference("llama-tiny", 3)
    losses, _, _, plan, notes = run_ranks(_accftm_run, 2, args=(TensorParallelConfig(size=2, partitions=0), 3))[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert len(plan) == 2 * 2 and set(plan) <= {1, 2, 4}  # attention and MLP of 2 blocks
    assert "partition plan" in notes[0]


@pytest.mark.parametrize("pruned,ratio", [("reduce", 7.5), ("drop", 12)])
def test_compressed_all_reduces_keep_the_ranks_identical(pruned, ratio):
    """Top-k rows and piecewise int4: every rank of the group sees the same reduced activations and
    gradients, so the replicated weights (norms, positions) stay bit-identical; fewer bytes travel."""
    exact = run_ranks(_accftm_run, 2, args=(TensorParallelConfig(size=2), 4))
    full = run_ranks(_accftm_run, 2, args=(TensorParallelConfig(size=2, partitions=2, topk_keep_ratio=0.5,
                                                                 quantize_bits=4, topk_pruned=pruned), 4))
    (losses, sent, rep0, _, _), (_, _, rep1, _, _) = full
    for name in rep0:
        assert torch.equal(rep0[name], rep1[name]), name
    # Half the rows at 4 bits + a scale per row instead of 32 bits (drop: 12.8x fewer bytes); reduce
    # adds the other half at 3 bits + a scale (d = 64: 4 bits a value on average, 8x fewer).
    assert sent[-1] < exact[0][1][-1] / ratio
    assert all(abs(a - b) < 0.1 for a, b in zip(losses, exact[0][0])), (losses, exact[0][0])


def _pruned_rows(rank, world, x, mask, pruned, bits, pruned_bits):
    from zeropp.tensor_parallel.collectives import TPComm
    from zeropp.topology import build_mesh
    cfg = TensorParallelConfig(size=world, topk_keep_ratio=0.5, quantize_bits=bits, topk_pruned=pruned,
                               topk_pruned_bits=pruned_bits)
    tp = TPComm(build_mesh(tp=world, thread_groups=False), cfg)
    out = tp.wait(tp.all_reduce(x[rank], "test", mask, compress=bits > 0))
    return out, tp.comm.ledger.totals()["test"]["sent"]


@pytest.mark.parametrize("pruned,bits,pruned_bits", [("reduce", 4, 1), ("reduce", 0, 1), ("reduce", 4, 3),
                                                     ("drop", 4, 3), ("local", 4, 3)])
def test_pruned_rows_against_a_reference(pruned, bits, pruned_bits):
    """TPComm.all_reduce with a top-k mask over 3 ranks: kept rows are the (int4 or exact) sum;
    pruned rows, under reduce, the sum over ranks of their dequantized low-bit codes (1 bit: sign(x)
    * mean |x| of the row, built here from its definition; 3 bits: piecewise), identical on every
    rank, in the same message; under drop zero; under local this rank's own row times 3."""
    from zeropp.acctfm import decode, encode, wire_bytes
    world = 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world, 2, 5, 16, generator=g) * torch.rand(world, 2, 5, 1, generator=g) * 4
    mask = torch.rand(2, 5, generator=g) < 0.5
    mask[0, 0], mask[0, 1] = True, False
    outs = run_ranks(_pruned_rows, world, args=(x, mask, pruned, bits, pruned_bits))
    for out, _ in outs[1:]:
        if pruned != "local":
            assert torch.equal(out, outs[0][0])
    if bits:  # the kept rows: what the compressed all-reduce gives for them alone
        kept = run_ranks(_kept_alone, world, args=(x[:, mask],))[0]
    else:
        kept = x[:, mask].sum(0)
    rows = x[:, ~mask]
    if pruned_bits == 1:
        codes = torch.where(rows < 0, -1.0, 1.0).double() * rows.double().abs().mean(-1, keepdim=True)
    else:
        codes = torch.stack([decode(*encode(r, pruned_bits), r.shape, pruned_bits) for r in rows]).double()
    for rank, (out, sent) in enumerate(outs):
        torch.testing.assert_close(out[mask], kept, rtol=1e-6, atol=1e-6)
        if pruned == "reduce":
            torch.testing.assert_close(out[~mask].double(), codes.sum(0), rtol=1e-6, atol=1e-6)
        elif pruned == "drop":
            assert not out[~mask].any()
        else:
            assert torch.equal(out[~mask], 3 * x[rank][~mask])
        kept_bytes = wire_bytes((int(mask.sum()), 16), world, bits) if bits else \
            2 * (world - 1) * int(mask.sum()) * 16 * 4 // world
        pruned_bytes = wire_bytes((int((~mask).sum()), 16), world, pruned_bits) if pruned == "reduce" else 0
        assert sent == kept_bytes + pruned_bytes


def _kept_alone(rank, world, kept):
    from zeropp.acctfm import all_reduce_compressed
    from zeropp.comm import Comm
    from zeropp.topology import build_mesh
    return all_reduce_compressed(kept[rank], Comm(build_mesh()), bits=4)


def _counted_step(rank, world, tp_config):
    """One TP x ZeRO-3 step with torch.distributed's collectives wrapped: the bytes each call sends,
    counted from its arguments (point-to-point: the tensors sent; all-reduce: a ring's 2 (n-1)/n;
    all-gather: (n-1) shards; all-to-all: (n-1)/n of the input), beside the ledger's total."""
    runtime = build_runtime(make_model("llama-tiny"), ZeroConfig(stage=3, communication_data_type="fp32"),
                            torch.device("cpu"), tp_config)
    optimizer = build_optimizer(runtime.module, OPTIM)
    sample = batches(1)[0][:BATCH // runtime.mesh.world_size]
    counted = {"sent": 0, "unexpected": []}
    size = lambda group: dist.get_world_size(group)  # noqa: E731
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    counts = {
        "all_reduce": lambda t, *a, group=None, **k: 2 * (size(group) - 1) * nbytes(t) // size(group),
        "all_gather_single": lambda out, t, *a, group=None, **k: (size(group) - 1) * nbytes(t),
        "all_to_all_single": lambda out, t, *a, group=None, **k: (size(group) - 1) * nbytes(t) // size(group),
        "batch_isend_irecv": lambda ops: sum(nbytes(op.tensor) for op in ops if op.op is dist.isend),
    }
    originals = {name: getattr(dist, name) for name in (*counts, "all_gather", "broadcast", "reduce_scatter_single",
                                                        "all_gather_into_tensor", "reduce_scatter_tensor",
                                                        "send", "all_gather_object")}

    def counting(name):
        def call(*args, **kwargs):
            if name in counts:
                counted["sent"] += counts[name](*args, **kwargs)
            else:
                counted["unexpected"].append(name)
            return originals[name](*args, **kwargs)
        return call

    runtime.ledger.reset()
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        loss = runtime.lm_loss(runtime(sample[:, :-1]), sample[:, 1:])
        runtime.backward(loss)
        runtime.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        runtime.inner._wait_gathers()  # the next forward's gathers, issued by the step
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    totals = runtime.ledger.totals()
    runtime.close()
    return counted, sum(t["sent"] for t in totals.values()), sorted(totals)


@pytest.mark.parametrize("tp_config", [TensorParallelConfig(size=2),
                                       TensorParallelConfig(size=2, partitions=2, topk_keep_ratio=0.5,
                                                            quantize_bits=4, topk_pruned="reduce")])
def test_the_ledger_counts_every_byte_of_a_tensor_parallel_step(tp_config):
    """TP 2 x ZeRO-3 DP 2: every collective of a step (the sublayers' exact or compressed all-reduces,
    the vocabulary-parallel loss' all-reduces, ZeRO's gathers and reduce-scatters, the norm's
    all-reduce) goes through the runtime's Comm, so the ledger's bytes equal what the calls sent."""
    for counted, ledgered, tags in run_ranks(_counted_step, 4, args=(tp_config,)):
        assert counted["unexpected"] == []
        assert counted["sent"] > 0 and ledgered == counted["sent"], (ledgered, counted["sent"], tags)
        assert "tp loss" in tags


# ------------------------------------------ AccTFM's plan (partitions 0): one decision for all ranks, kept on resume

RIG_BETA = 1e-8  # the link the rigged profiles report: no startup cost, 800 Mbit/s
RIG_COMPUTE = 1e-4  # a sublayer's rigged compute at K = 1, of the order of its all-reduce on that link
SUBLAYERS = 4  # attention and MLP of the tiny presets' 2 blocks
PLAN_LINE = re.compile(r"AccTFM partition plan \(K per sublayer, attention/MLP alternating\): (\[[\d, ]*\])(.*)")


class _RiggedClock:
    """Stands in for the `time` module of the sublayers' profiling (zeropp.tensor_parallel.layers):
    the two readings around a partition's compute differ by the rigged seconds of that partition,
    whatever the machine's load. A rank preferring K = 4 reports RIG_COMPUTE / K per partition
    (pipelining pays), one preferring K = 1 RIG_COMPUTE * K. A stall makes K = 4 100x slower in
    the first forward at K = 4 ("once": it passes) or in all of them ("always")."""

    def __init__(self, prefer: int, stall: str | None):
        self.prefer, self.stall = prefer, stall
        self.now, self.started, self.readings, self.k4_partitions = 0.0, False, 0, 0

    def perf_counter(self) -> float:
        self.readings += 1
        self.started = not self.started
        if self.started:
            return self.now
        k = sys._getframe(1).f_locals["k"]  # the partitions of the sublayer forward being timed
        seconds = RIG_COMPUTE / k if self.prefer == 4 else RIG_COMPUTE * k
        if k == 4:
            self.k4_partitions += 1
            if self.stall == "always" or (self.stall == "once" and self.k4_partitions <= 4 * SUBLAYERS):
                seconds *= 100
        self.now += seconds
        return self.now


def _rig_profile(rank: int, prefer: dict[int, int], stall_rank: int | None = None, stall: str = "once"):
    from zeropp import acctfm
    from zeropp.tensor_parallel import layers
    acctfm.measure_alpha_beta = lambda *args, **kwargs: (0.0, RIG_BETA)
    layers.time = _RiggedClock(prefer[rank], stall if rank == stall_rank else None)
    return layers.time


def _planned_run(rank, world, prefer, stall_rank=None, stall="once"):
    _rig_profile(rank, prefer, stall_rank, stall)
    return _accftm_run(rank, world, TensorParallelConfig(size=2, partitions=0), 2)[3]


def test_every_rank_ends_with_the_same_plan_whatever_its_own_profile():
    """TP 2 x DP 2: one tensor-parallel group's profile prefers K = 4, the other's K = 1. Each
    group deciding alone (the group's slowest rank) would train the two data-parallel halves on
    different partitions, i.e. different rounding; the world's slowest times decide instead. (Ranks
    that all prefer K = 4 do plan K = 4: test_the_plan_follows_a_stall_only_when_every_forward_sees_it.)"""
    plans = run_ranks(_planned_run, 4, args=({0: 4, 1: 4, 2: 1, 3: 1},))
    assert plans == [[1, 1, 1, 1]] * 4, plans  # K = 1 is what the slowest ranks' times favour


def test_the_plan_follows_a_stall_only_when_every_forward_sees_it():
    """A stall of K = 4 on rank 1 in every profiling forward changes the plan; one in a single
    forward (what a profile of one forward per K would take for the truth) does not."""
    steady, once, always = (run_ranks(_planned_run, 2, args=({0: 4, 1: 4}, 1, stall))[0]
                            for stall in (None, "once", "always"))
    assert 4 in steady and once == steady != always, (steady, once, always)


def _trained(rank, world, argv, prefer, stall_rank=None):
    """train.py's run on this rank, its profile rigged: the losses, how many profiling clock
    readings it took, and (rank 0, which logs) the plan lines it logged."""
    from trainer.config import parse_args
    from trainer.loop import train
    clock = _rig_profile(rank, prefer, stall_rank)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        losses = train(parse_args(argv)).losses
    return losses, clock.readings, PLAN_LINE.findall(out.getvalue())


def _trainer_args(text, out_dir, *extra):
    from tests.trainer.test_train import tiny_args
    # int4 all-reduces: there K changes the rounding, so a different plan gives different losses
    return tiny_args(text, out_dir, out_dir.parent / "cache", "--tensor_parallel.size", "2",
                     "--tensor_parallel.partitions", "0", "--tensor_parallel.quantize_bits", "4",
                     "--train.steps", "4", *extra)


@pytest.fixture(scope="module")
def planned_run(corpus, tmp_path_factory):  # noqa: F811
    """A partitions-0 run of the trainer on 2 ranks (TP 2), its profile rigged to favour K = 4,
    checkpointed at step 2."""
    out = tmp_path_factory.mktemp("planned") / "a"
    argv = _trainer_args(corpus, out, "--train.checkpoint_interval", "2")
    losses, _, lines = run_ranks(_trained, 2, args=(argv, {0: 4, 1: 4}))[0]
    (plan, _), = lines
    assert "4" in plan
    return out, losses, plan, lines[0][1]


def test_two_identical_planned_runs_are_bit_identical_despite_a_stall_in_the_profile(corpus, planned_run, tmp_path):  # noqa: F811
    """The second run's profile sees a passing stall on rank 1 (its first K = 4 forward): the plan
    stays the first run's, and the profile's own forwards leave nothing behind, so the losses are
    the first run's bit for bit."""
    _, losses, plan, how = planned_run
    again, _, lines = run_ranks(_trained, 2, args=(_trainer_args(corpus, tmp_path / "b"), {0: 4, 1: 4}, 1))[0]
    assert [p for p, _ in lines] == [plan]
    assert again == losses  # exact
    assert "profiled" in how


def test_a_resume_reuses_the_checkpoints_plan_and_continues_exactly(corpus, planned_run, tmp_path):  # noqa: F811
    """Resumed at step 2 with a profile that would now favour K = 1 everywhere: the plan comes from
    the checkpoint (no profiling forward runs), and steps 3-4 equal the uninterrupted run's."""
    out, losses, plan, _ = planned_run
    checkpoint = out / "checkpoints" / "step_00000002"
    argv = _trainer_args(corpus, tmp_path / "c", "--resume", str(checkpoint))
    resumed, readings, lines = run_ranks(_trained, 2, args=(argv, {0: 1, 1: 1}))[0]
    assert readings == 0 and [p for p, _ in lines] == [plan] and "from checkpoint" in lines[0][1], lines
    assert sorted(resumed) == [3, 4] and all(resumed[s] == losses[s] for s in resumed), (resumed, losses)


def test_models_tensor_parallelism_cannot_slice_are_refused_naming_why():
    from zeropp.tensor_parallel.parallelize import check_sliceable
    from zeropp.topology import TopologyError

    with torch.device("meta"):
        olmo2_like = Transformer(ModelConfig.from_preset("llama-tiny", qk_norm=True, qk_norm_per_head=False))
        qwen3_like = Transformer(ModelConfig.from_preset("llama-tiny", qk_norm=True))
    with pytest.raises(TopologyError, match="q/k RMSNorm .OLMo 2's. normalizes over all heads together"):
        check_sliceable(olmo2_like, 2)
    check_sliceable(qwen3_like, 2)  # per-head norms split with their heads
    with pytest.raises(TopologyError, match="tensor_parallel.size=3 must divide the model's n_head=4"):
        check_sliceable(qwen3_like, 3)
