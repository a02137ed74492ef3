"""SEPARATE: the projection's statistics, its error feedback, and its reduce under ZeRO-3 and DDP
against one-process computations."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.zeropp.test_engine import OPTIM, batches, make_engine, make_model, reference, train_step
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from models.transformer import lm_loss
from zeropp.comm import Comm
from zeropp.config import GradientCompression, ZeroConfig, ZeroConfigError
from zeropp.ddp import DDPRuntime
from zeropp.qgz import QuantizedReduce
from zeropp.runtime import Timings
from zeropp.separate import ProjectedReduce, Separate
from zeropp.topology import build_mesh

CPU = torch.device("cpu")


def separate(**kw) -> GradientCompression:
    return GradientCompression(method="separate", **kw)


@pytest.mark.parametrize("projection", ["hadamard", "gaussian"])
@pytest.mark.parametrize("reconstruction", ["unbiased", "contractive"])
def test_reconstruction_is_unbiased(projection, reconstruction):
    """The mean of the reconstruction over many rounds k converges to h (the contractive one to
    h / CR): its distance stays within three standard errors of an estimator of variance
    (b/m + 1)|h|^2 per round; the contractive one never lengthens a vector by much."""
    h = torch.randn(1, 100, generator=torch.Generator().manual_seed(0))  # 100: pads to 2 blocks of 64
    cfg = separate(ratio=8, block_size=64, projection=projection, reset_interval=1, reconstruction=reconstruction)
    compressor = Separate(cfg, CPU)
    scale = 1 if reconstruction == "unbiased" else 1 / 8
    rounds, total = 1500, torch.zeros(100)
    for _ in range(rounds):
        rnd = compressor.compress("unit", h.clone())
        one = compressor.decompress(rnd, rnd.projections[0], 0)
        total += one
        if reconstruction == "contractive" and projection == "hadamard":  # an orthogonal projection
            assert one.norm() <= h.norm() * (1 + 1e-5)
    bound = 3 * math.sqrt((8 + 1) / rounds) * h.norm() * scale
    assert (total / rounds - h[0] * scale).norm() < bound
    assert (one - h[0] * scale).norm() > 0.5 * h.norm() * scale  # one round is far: the mean converges


@pytest.mark.parametrize("projection", ["hadamard", "gaussian"])
def test_variance_estimate_matches_the_reconstruction_error(projection):
    """variance_correction's estimate of Var[ĝ_i] from the reconstruction's own block norm, summed over
    a block and averaged over rounds, equals the measured squared error sum |ĝ - h|^2 of the same rounds
    (to the x_i^2 terms it leaves out, a factor b / (b -/+ 1), and Monte-Carlo noise)."""
    h = torch.randn(1, 200, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3, 200)
    compressor = Separate(separate(ratio=8, block_size=64, projection=projection), CPU)
    reducer = ProjectedReduce(None, compressor, torch.float32, Timings())
    error = estimate = 0.0
    for _ in range(400):
        rnd = compressor.compress("unit", h.clone())
        reconstruction = compressor.decompress(rnd, rnd.projections[0], 0)
        reducer.layouts["unit"] = (rnd.block, rnd.directions)
        error += float((reconstruction - h[0]).square().sum())
        estimate += float(reducer.variance("unit", reconstruction.square()).sum())
    assert estimate == pytest.approx(error, rel=0.06)


def test_second_moment_correction_is_adamw_on_the_corrected_square():
    """The step pre-hook shifts exp_avg_sq so that torch's AdamW, whatever its kernel, ends the step with
    v = max(β2 v + (1 - β2)(g^2 - Var), (1 - β1) / (1 + β1) Var): three steps against AdamW written out by
    hand, on a piece that starts inside a block (the variance follows the unit's blocks, not the piece's);
    the first step, without state yet, is plain AdamW."""
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(96, generator=gen) * (1 + t) for t in range(3)]
    master, grad_shard = torch.randn(96, generator=gen), torch.zeros(96)
    piece = torch.nn.Parameter(master[40:96].clone())
    unit = SimpleNamespace(name="unit", grad_shard=grad_shard, trainable=True, params=[(None, piece, grad_shard[40:])])
    compressor = Separate(separate(ratio=4, block_size=32), CPU)
    reducer = ProjectedReduce(None, compressor, torch.float32, Timings())
    reducer.layouts["unit"] = (32, 8)
    lr, (b1, b2), eps, decay = 0.01, (0.9, 0.95), 1e-8, 0.1
    optimizer = torch.optim.AdamW([piece], lr=lr, betas=(b1, b2), eps=eps, weight_decay=decay, foreach=False)
    optimizer.register_step_pre_hook(lambda *_: reducer.correct_second_moment(optimizer, [unit]))
    p, m, v = master[40:].clone(), torch.zeros(56), torch.zeros(56)
    for t, g in enumerate(grads, start=1):
        grad_shard.copy_(g)
        piece.grad = grad_shard[40:]
        optimizer.step()
        norms = g.view(3, 32).square().sum(1).repeat_interleave(32)[40:]  # blocks [32, 64) and [64, 96)
        var = norms * (32 - 8) / (32 * 31)
        square = g[40:].square()
        p.mul_(1 - lr * decay)
        m = b1 * m + (1 - b1) * g[40:]
        if t == 1:  # no state yet
            v = (1 - b2) * square
        else:
            v = torch.maximum(b2 * v + (1 - b2) * (square - var), (1 - b1) / (1 + b1) * var)
        p -= lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + eps)
        torch.testing.assert_close(optimizer.state[piece]["exp_avg_sq"], v, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(piece.detach(), p, rtol=1e-5, atol=1e-7)
        floored = v == (1 - b1) / (1 + b1) * var
        if t > 1:  # both sides of the max are exercised
            assert 0 < int(floored.sum()) < v.numel()


def test_ratio_one_hadamard_is_orthogonal_and_exact():
    h = torch.randn(3, 77)
    compressor = Separate(separate(ratio=1, block_size=32), CPU)
    rnd = compressor.compress("unit", h.clone())
    assert rnd.projections.shape == (3, 3 * 32)  # 77 pads to 3 blocks of 32 in each chunk
    for c in range(3):
        torch.testing.assert_close(compressor.decompress(rnd, rnd.projections[c], c), h[c], rtol=0, atol=1e-5)
    assert not compressor.feedback.errors  # without error feedback (the default) no buffer is kept


@pytest.mark.parametrize("projection", ["hadamard", "gaussian"])
def test_error_feedback_and_reset_follow_the_formulas(projection):
    """A plain-Python replay in fp64: h = g + e; e <- 0 on rounds k % T == 0, else
    (1 - beta) e + beta (h - P_k^T P_k h), with P_k probed from the compressor column by column."""
    beta, period, numel = 0.9, 3, 40
    cfg = separate(ratio=4, block_size=16, projection=projection, beta=beta, reset_interval=period,
                   reconstruction="contractive")
    compressor, probe = Separate(cfg, CPU), Separate(cfg, CPU)
    g = torch.Generator().manual_seed(3)
    e = torch.zeros(numel, dtype=torch.float64)
    for k in range(8):  # resets at k = 0, 3, 6
        grad = torch.randn(1, numel, generator=g)
        compressor.compress("unit", grad.clone())
        # P_k^T P_k as a matrix: reconstruct each basis vector's projections at round k
        columns = []
        for i in range(numel):
            basis = torch.zeros(1, numel)
            basis[0, i] = 1
            probe.feedback.rounds["unit"], probe.feedback.errors = k, {}  # round k's directions, on the basis alone
            rnd = probe.compress("unit", basis)
            columns.append(probe.decompress(rnd, rnd.projections[0], 0).double())
        roundtrip = torch.stack(columns, 1)
        h = grad[0].double() + e
        e = torch.zeros_like(e) if k % period == 0 else (1 - beta) * e + beta * (h - roundtrip @ h)
        kept = compressor.feedback.errors.get("unit", torch.zeros(numel))  # none before the first update
        torch.testing.assert_close(kept.double(), e, rtol=1e-4, atol=1e-5)
        assert compressor.feedback.round("unit") == k + 1
    assert e.abs().max() > 0


def test_g_separate_adapts_ratio_and_beta_within_bounds():
    cfg = GradientCompression(method="g-separate", ratio=16, beta=0.95, target_cosine=0.3, min_ratio=4,
                              max_ratio=32, reconstruction="contractive")
    compressor = Separate(cfg, CPU)
    compressor.adapt("u", 0.6)  # accurate: compress harder, trust the error more
    assert compressor.ratios["u"] == 32 and 0.95 < compressor.betas["u"] <= 0.99
    compressor.adapt("u", 0.9)
    assert compressor.ratios["u"] == 32 and compressor.betas["u"] <= 0.99  # clamped
    for _ in range(5):
        compressor.adapt("u", 0.01)  # poor: less compression, smaller beta
    assert compressor.ratios["u"] == 4 and compressor.betas["u"] == 0.90


@pytest.mark.parametrize("kw, match", [
    (dict(method="separate", ratio=12), "power-of-two"),
    (dict(method="separate", beta=1.5), "beta"),
    (dict(method="separate", block_size=8, ratio=16), "smaller than ratio"),
    (dict(method="g-separate", min_ratio=32, reconstruction="contractive"), "min_ratio"),
    (dict(method="g-separate"), "contractive"),
    (dict(method="separate", beta=0.95), "diverges"),  # the paper's beta with its unbiased reconstruction
    (dict(method="separate", warmup_rounds=-1), "warmup_rounds=-1"),
])
def test_invalid_settings_are_named(kw, match):
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(stage=3, gradient_compression=GradientCompression(**kw)).validate()


def test_invalid_combinations_are_named():
    with pytest.raises(ZeroConfigError, match="error_feedback"):
        ZeroConfig(stage=3, zero_quantized_gradients=True, zero_quantized_gradients_error_feedback=True,
                   gradient_compression=separate()).validate()
    with pytest.raises(ZeroConfigError, match="stage 0"):
        ZeroConfig(stage=3, gradient_compression=GradientCompression(method="powersgd")).validate()
    ZeroConfig(stage=0, gradient_compression=separate()).validate()  # SEPARATE under DDP is fine
    with pytest.raises(ZeroConfigError, match="variance_correction.*stage 0"):
        ZeroConfig(stage=0, gradient_compression=separate(variance_correction=True)).validate()
    with pytest.raises(ZeroConfigError, match="variance_correction.*method powersgd"):
        ZeroConfig(stage=0, gradient_compression=GradientCompression(method="powersgd",
                                                                     variance_correction=True)).validate()
    with pytest.raises(ZeroConfigError, match="variance_correction.*contractive"):
        ZeroConfig(stage=3, gradient_compression=separate(variance_correction=True, reconstruction="contractive",
                                                          beta=0.95)).validate()


# ---------------------------------------------------------------------- the reduce, multi-rank

def _gradient(rank, numel):
    return torch.randn(numel, generator=torch.Generator().manual_seed(10 + rank))


def _reduce(rank, world, numel, cfg, qgz_bits=None):
    comm = Comm(build_mesh(ranks_per_node=2 if world == 4 else world))
    qgz = QuantizedReduce(comm, qgz_bits, 64, 2 if world == 4 else 1, 1) if qgz_bits else None
    reducer = ProjectedReduce(comm, Separate(cfg, CPU), torch.float32, Timings(), qgz)
    shards = []
    for _ in range(2):  # two rounds: fresh directions, and the second carries the first's error
        shard = torch.zeros(numel // world)
        reducer.reduce("unit", shard, _gradient(rank, numel), async_op=True).wait()
        shards.append(shard)
    comm.close()
    return shards, comm.ledger.totals()["gradient reduce"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_of_projections_equals_one_process(world):
    """On 2, 3 and 2 x 2 ranks, each rank's shard is the reconstruction of the summed projections
    that one process computes from every rank's gradient (odd shard sizes pad: 3 x 333), up to the
    order in which the ring adds the fp32 projections."""
    numel = 333 * world
    cfg = separate(ratio=8, block_size=64, beta=0.9, reset_interval=0, reconstruction="contractive")
    results = run_ranks(_reduce, world, args=(numel, cfg), ranks_per_node=2 if world == 4 else None)
    replicas = [Separate(cfg, CPU) for _ in range(world)]  # every rank's compressor, in one process
    for round_ in range(2):
        rounds = [c.compress("unit", _gradient(r, numel).view(world, -1)) for r, c in enumerate(replicas)]
        summed = sum(rnd.projections.double() for rnd in rounds).float()
        for rank, (shards, _) in enumerate(results):
            expected = replicas[0].decompress(rounds[0], summed[rank], rank)
            torch.testing.assert_close(shards[round_], expected, rtol=1e-5, atol=1e-5)
    projections = rounds[0].projections.numel() * 4  # bytes of one round's projections, fp32
    for _, ledger in results:  # a reduce-scatter of the projections: (n - 1) / n of them, per round
        assert ledger["sent"] == 2 * (world - 1) * projections // world


def test_projections_through_qgz_two_hops():
    """With zero_quantized_gradients the projections take qgZ's 2-hop int8 all-to-all on 2 x 2
    ranks (padded to whole quantization blocks): each shard is the one-process reconstruction up to
    the int8 quantization of the projections."""
    world, numel = 4, 4 * 333
    cfg = separate(ratio=8, block_size=64, reset_interval=0)
    results = run_ranks(_reduce, world, args=(numel, cfg, 8), ranks_per_node=2)
    replicas = [Separate(cfg, CPU) for _ in range(world)]
    rounds = [c.compress("unit", _gradient(r, numel).view(world, -1)) for r, c in enumerate(replicas)]
    summed = sum(rnd.projections.double() for rnd in rounds).float()
    for rank, (shards, ledger) in enumerate(results):
        expected = replicas[0].decompress(rounds[0], summed[rank], rank)
        error = (shards[0] - expected).norm() / expected.norm()
        assert 1e-6 < error < 0.02  # quantized, but only a little
        assert ledger["dtypes"] == ["float32", "uint8"]  # codes and their scales


def _save(runtime, optimizer, directory, rank):
    """Every rank saves its part into one fresh directory."""
    if rank == 0:
        directory.mkdir()
    dist.barrier()
    runtime.save(directory, optimizer)
    dist.barrier()


def _train(rank, world, compression, steps, wire="fp32", directory=None):
    cfg = ZeroConfig(stage=3, communication_data_type=wire, gradient_compression=compression)
    engine, optimizer = make_engine(make_model("gpt2-tiny"), cfg, ranks_per_node=2)
    optimizer = engine.attach_optimizer(optimizer)  # as the trainer does: variance_correction's hook
    data = batches(steps)
    engine.ledger.reset()
    losses = [train_step(engine, optimizer, data[0], rank, world)]
    first_step = engine.ledger.totals()
    losses += [train_step(engine, optimizer, sample, rank, world) for sample in data[1:steps // 2]]
    again = None
    if directory is not None:
        _save(engine, optimizer, directory, rank)
    losses += [train_step(engine, optimizer, sample, rank, world) for sample in data[steps // 2:]]
    cosines = dict(getattr(engine.reducer, "cosines", {}))
    state = {k: v.clone() for k, v in engine.reducer.state_dict().items()}
    memory = engine.model_state_bytes()
    notes = engine.take_notes()
    engine.close()
    if directory is not None:
        resumed, resumed_optimizer = make_engine(make_model("gpt2-tiny"), cfg, ranks_per_node=2)
        resumed_optimizer = resumed.attach_optimizer(resumed_optimizer)
        resumed.load(directory, resumed_optimizer)
        again = [train_step(resumed, resumed_optimizer, sample, rank, world) for sample in data[steps // 2:]]
        resumed.close()
    return losses, again, first_step, cosines, state, memory, notes


def test_ratio_one_under_zero3_is_the_exact_mean():
    ref_losses, _ = reference("gpt2-tiny", 6)
    results = run_ranks(_train, 2, args=(separate(ratio=1), 6))
    for losses, *_, memory, _ in results:
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-5
        assert "gradient error feedback" not in memory  # no error feedback, no full-size buffer


def test_zero3_traffic_is_one_ratio_th_and_resume_is_bit_exact(tmp_path):
    """SEPARATE CR 8 on 2 x 2 ranks (bf16 wire): the gradient reduce moves 1/8 of plain ZeRO-3's
    (plus the padding of the last block of each shard); the error buffers and round counters
    are saved per rank, so a resumed run repeats the losses exactly; training stays near the
    fp32 reference."""
    ref_losses, _ = reference("gpt2-tiny", 8)
    plain = run_ranks(_train, 4, args=(GradientCompression(), 2, "bf16"), ranks_per_node=2)
    ef = separate(ratio=8, block_size=256, reconstruction="contractive", beta=0.95)
    results = run_ranks(_train, 4, args=(ef, 8, "bf16", tmp_path / "ckpt"), ranks_per_node=2)
    exact_bytes = plain[0][2]["gradient reduce"]["sent"]
    for losses, again, first_step, _, state, memory, _ in results:
        ratio = first_step["gradient reduce"]["sent"] / exact_bytes
        assert 1 / 8 <= ratio < 1.1 / 8
        assert first_step["forward gather"] == plain[0][2]["forward gather"]  # the weights are untouched
        assert again == losses[4:]
        assert any(v.abs().max() > 0 for k, v in state.items() if k.endswith(".error"))
        assert memory["gradient error feedback"] == sum(v.numel() * 4 for k, v in state.items()
                                                        if k.endswith(".error"))
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 0.02


def test_warmup_rounds_are_the_exact_reduce_then_compression_starts_and_resumes(tmp_path):
    """warmup_rounds 3 on 2 ranks (bf16 wire): the first three rounds are ZeRO-3's own reduce-scatter,
    so the losses up to step 4 (after three updates) are plain ZeRO-3's bit for bit and the first step moves
    its bytes; from round 4 the gradient is projected; a run resumed after step 3 (its round counters saved)
    starts compressing at the same round (with variance_correction's step pre-hook, which keeps no state of
    its own)."""
    plain = run_ranks(_train, 2, args=(GradientCompression(), 6, "bf16"))
    warm = separate(ratio=8, block_size=256, warmup_rounds=3, variance_correction=True)
    results = run_ranks(_train, 2, args=(warm, 6, "bf16", tmp_path / "ckpt"))
    uncorrected = run_ranks(_train, 2, args=(separate(ratio=8, block_size=256, warmup_rounds=3), 6, "bf16"))
    for (plain_losses, _, plain_first, *_), (losses, again, first_step, _, state, _, _), other in zip(
            plain, results, uncorrected):
        assert losses[:4] == plain_losses[:4] and losses[5] != plain_losses[5]
        assert losses[:4] == other[0][:4] and losses[4] != other[0][4]  # the hook acts from the 1st compressed step
        assert first_step["gradient reduce"] == plain_first["gradient reduce"]
        assert again == losses[3:]
        assert {int(v) for k, v in state.items() if k.endswith(".round")} == {6}


def test_g_separate_measures_the_cosine_and_adapts_per_unit():
    """adapt_interval 2: every second round each unit also reduces exactly; with ratio 1 the
    reconstruction is the exact mean (cosine 1), at 16 it is far from it, and the ratios move; every
    adaptation is logged with the unit's cosine, ratio and beta."""
    exact = GradientCompression(method="g-separate", ratio=1, min_ratio=1, max_ratio=1, adapt_interval=2,
                                block_size=256, reconstruction="contractive", beta=0.95)
    lossy = GradientCompression(method="g-separate", ratio=16, min_ratio=4, max_ratio=64, adapt_interval=2,
                                block_size=256, target_cosine=0.9, reconstruction="contractive", beta=0.95)
    for (*_, cosines, _, _, _), (*_, lossy_cosines, state, _, notes) in zip(run_ranks(_train, 2, args=(exact, 4)),
                                                                           run_ranks(_train, 2, args=(lossy, 4))):
        assert cosines and all(c > 0.9999 for c in cosines.values())
        assert lossy_cosines.keys() == cosines.keys() and all(c < 0.8 for c in lossy_cosines.values())
        assert {int(v) for k, v in state.items() if k.endswith(".ratio")} == {4}  # 16 -> 8 -> 4
        for unit, cosine in lossy_cosines.items():  # the last of its two adaptations (rounds 2 and 4)
            beta = float(state[f"{unit}.beta"])
            assert [n for n in notes if n.startswith(f"G-SEPARATE {unit}:")][-1] == \
                f"G-SEPARATE {unit}: cosine {cosine:.3f} -> ratio 4, beta {beta:.4f} (round 4)"
        assert len(notes) == 2 * len(lossy_cosines)


# ---------------------------------------------------------------------- DDP

def _ddp(rank, world, compression, steps, directory=None):
    runtime = DDPRuntime(make_model("gpt2-tiny"), ZeroConfig(gradient_compression=compression))
    runtime.set_gradient_divide_factor(1.0)  # the loss below is the global mean: sum over ranks
    optimizer = build_optimizer(runtime.module, OPTIM)
    per_rank = len(batches(1)[0]) // world

    def step(sample):
        mine = sample[rank * per_rank:(rank + 1) * per_rank]
        loss = lm_loss(runtime(mine[:, :-1]), mine[:, 1:]) / world
        runtime.backward(loss)
        runtime.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        return t.item()

    data = batches(steps)
    losses = [step(s) for s in data[:steps // 2]]
    if directory is not None:
        _save(runtime, optimizer, directory, rank)
    losses += [step(s) for s in data[steps // 2:]]
    again = None
    if directory is not None:
        runtime.close()
        runtime = DDPRuntime(make_model("gpt2-tiny"), ZeroConfig(gradient_compression=compression))
        runtime.set_gradient_divide_factor(1.0)
        optimizer = build_optimizer(runtime.module, OPTIM)
        runtime.load(directory, optimizer)
        again = [step(s) for s in data[steps // 2:]]
    cosines = dict(runtime.reducer.cosines) if runtime.reducer is not None else {}
    state = runtime.reducer.state_dict() if runtime.reducer is not None else {}
    runtime.close()
    return losses, again, cosines, state


def test_ddp_hook_ratio_one_is_exact_and_resume_is_bit_exact(tmp_path):
    ref_losses, _ = reference("gpt2-tiny", 4)
    for losses, *_ in run_ranks(_ddp, 2, args=(separate(ratio=1), 4)):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-5
    ef = separate(ratio=8, block_size=256, reconstruction="contractive", beta=0.95)
    for rank, (losses, again, *_) in enumerate(run_ranks(_ddp, 2, args=(ef, 6, tmp_path / "ckpt"))):
        assert again == losses[3:]
        assert (tmp_path / "ckpt" / f"reducer_rank{rank:05d}.safetensors").is_file()  # ZeRO's file, too
        assert max(abs(a - b) / b for a, b in zip(losses, reference("gpt2-tiny", 6)[0])) < 0.02


def test_ddp_warmup_rounds_all_reduce_exactly_then_compress():
    """Under DDP the warm-up rounds are the bucket's plain all-reduce: the first two updates are plain DDP's
    (losses 1-3 equal to its), the third is projected."""
    plain = run_ranks(_ddp, 2, args=(GradientCompression(), 4))
    warm = run_ranks(_ddp, 2, args=(separate(ratio=8, block_size=256, warmup_rounds=2), 4))
    for (plain_losses, *_), (losses, _, _, state) in zip(plain, warm):
        assert max(abs(a - b) / b for a, b in zip(losses[:3], plain_losses[:3])) < 1e-6
        assert abs(losses[3] - plain_losses[3]) / plain_losses[3] > 1e-5
        assert {int(v) for k, v in state.items() if k.endswith(".round")} == {4}


def test_ddp_g_separate_measures_the_cosine_and_adapts_per_bucket():
    """The same reducer as ZeRO's: every second round a bucket is also all-reduced exactly; at
    ratio 1 the reconstruction is the exact mean (cosine 1), at 16 far from it, and the ratio moves."""
    exact = GradientCompression(method="g-separate", ratio=1, min_ratio=1, max_ratio=1, adapt_interval=2,
                                block_size=256, reconstruction="contractive", beta=0.95)
    lossy = GradientCompression(method="g-separate", ratio=16, min_ratio=4, max_ratio=64, adapt_interval=2,
                                block_size=256, target_cosine=0.9, reconstruction="contractive", beta=0.95)
    for (*_, cosines, _), (*_, lossy_cosines, state) in zip(run_ranks(_ddp, 2, args=(exact, 4)),
                                                           run_ranks(_ddp, 2, args=(lossy, 4))):
        assert cosines and all(c > 0.9999 for c in cosines.values())
        assert lossy_cosines.keys() == cosines.keys() and all(c < 0.8 for c in lossy_cosines.values())
        assert {int(v) for k, v in state.items() if k.endswith(".ratio")} == {4}  # 16 -> 8 -> 4


def test_ddp_powersgd_baseline_starts_exact():
    """torch's PowerSGD hook all-reduces exactly for its first iteration (start_powerSGD_iter 2), so
    step 1 matches the reference; our pre-scaling keeps the loss's global-mean convention."""
    ref_losses, _ = reference("gpt2-tiny", 4)
    for losses, *_ in run_ranks(_ddp, 2, args=(GradientCompression(method="powersgd"), 4)):
        assert abs(losses[0] - ref_losses[0]) < 1e-6 and abs(losses[1] - ref_losses[1]) / ref_losses[1] < 1e-5
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 0.02


def _powersgd_ledger(rank, world, steps):
    runtime = DDPRuntime(make_model("gpt2-tiny"), ZeroConfig(ranks_per_node=1, gradient_compression=GradientCompression(
        method="powersgd", powersgd_rank=4)))
    optimizer = build_optimizer(runtime.module, OPTIM)
    per_rank, sent = len(batches(1)[0]) // world, []
    for sample in batches(steps):
        mine = sample[rank * per_rank:(rank + 1) * per_rank]
        runtime.ledger.reset()
        runtime.backward(lm_loss(runtime(mine[:, :-1]), mine[:, 1:]))
        optimizer.step()
        optimizer.zero_grad()
        sent.append(runtime.ledger.totals()["gradient reduce"])
    shapes = [tuple(p.shape) for p in runtime.module.parameters()]
    runtime.close()
    return sent, shapes


def test_ddp_powersgd_traffic_is_in_the_ledger():
    """torch's PowerSGD hook issues its own all-reduces; the ledger still holds them: the whole
    bucket in fp32 for its first (plain) iterations, then per weight matrix n x m either its rank-r
    factors P (n x r) and Q (m x r), where that is less than half the matrix (torch's
    min_compression_rate 2), or the matrix itself; vectors whole. On 2 nodes of 1 rank a ring
    all-reduce sends each rank's bytes across once."""
    for sent, shapes in run_ranks(_powersgd_ledger, 2, args=(4,)):
        full = sum(math.prod(s) for s in shapes)
        compressed = 0
        for s in shapes:
            n, m = s[0], math.prod(s[1:])
            r = min(n, m, 4)
            compressed += (n + m) * r if 2 * (n + m) * r < n * m else n * m
        assert compressed < full / 4
        per_step = [e["cross_node_sent"] for e in sent]
        assert per_step[:2] == [4 * full] * 2 and per_step[2:] == [4 * compressed] * 2, (per_step, full, compressed)
        assert all(e["sent"] == e["cross_node_sent"] for e in sent)
