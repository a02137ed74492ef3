import itertools
import math
import random

import pytest
import torch

from trainer.spawn import run_ranks
from zeropp.acctfm import (
    METHODS,
    all_reduce_compressed,
    all_reduce_compressed_blocks,
    comm_time,
    decode,
    encode,
    error_bound,
    fit_alpha_beta,
    keep_count,
    levels,
    measure_alpha_beta,
    payload_bytes,
    plan_partitions,
    simulate,
    token_scores,
    topk_token_mask,
    wire_bytes,
)
from zeropp.comm import Comm
from zeropp.topology import build_mesh

# ---------------------------------------------------------------- piecewise quantization


def reference_bound(x: torch.Tensor, bits: int, group_rows) -> torch.Tensor:
    """Paper eq. 9 and 12 in float64, straight from the definitions: U0 * 2^k / 2 for x's cluster k."""
    n = bits - 1
    x = x.double().reshape(-1, x.shape[-1])
    g = group_rows or x.shape[0]
    bound = torch.empty_like(x)
    for start in range(0, x.shape[0], g):
        part = x[start:start + g].abs()
        m = part.max()
        k = torch.floor(part * n / m).clamp(max=n - 1) if m > 0 else torch.zeros_like(part)
        bound[start:start + g] = m / (n * 2 ** (n - 1)) * 2**k / 2
    return bound


def heavy_tailed(shape, seed):
    """Student-t with 3 degrees of freedom, plus a few outlier rows 20x larger (as activations have)."""
    g = torch.Generator().manual_seed(seed)
    chi2 = torch.randn(shape[:-1] + (1, 3), generator=g).pow(2).sum(-1)  # one t-scale per row
    x = torch.randn(shape, generator=g) / torch.sqrt(chi2 / 3)
    x[:: max(1, shape[0] // 3)] *= 20
    return x


def test_levels_follow_the_paper():
    assert levels(4).tolist() == [0, 1, 2, 3, 4, 6, 8, 12]  # N = 3: p = 4, 2, 1 intervals of 1, 2, 4 U0
    for bits in range(2, 9):
        n, v = bits - 1, levels(bits).tolist()
        p = 2 ** (n - 1)
        assert len(v) == 2**n and v[-1] == n * p  # 2^N - 1 intervals (eq. 11), U0 = M / (N 2^(N-1)) (eq. 12)
        steps = [b - a for a, b in zip(v, v[1:])]
        assert steps == [2**k for k in range(n) for _ in range(p >> k)]  # cluster k: p / 2^k intervals of U0 2^k
        assert all(k * p in v for k in range(n + 1))  # cluster boundaries C_k = k M / N are levels (eq. 7)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("group_rows", [1, 3, None])
def test_error_within_analytic_bound(bits, group_rows):
    x = heavy_tailed((10, 37), seed=bits)
    codes, scales = encode(x, bits, group_rows)
    y = decode(codes, scales, x.shape, bits, group_rows)
    err = (y.double() - x.double()).abs()
    bound = reference_bound(x, bits, group_rows)
    slack = 1e-6 * x.abs().max().item()
    assert (err <= bound + slack).all(), (err - bound).max()
    assert torch.allclose(error_bound(x, bits, group_rows).double(), bound, rtol=1e-6, atol=0)
    # nearest-level rounding, not truncation: the bound is reached but not exceeded
    assert (err / bound.clamp_min(1e-30)).max() > 0.9


def test_levels_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    for bits in (4, 3, 8):
        n = bits - 1
        rows, cols = 6, 19
        index = torch.randint(0, 2**n, (rows, cols), generator=g)
        index[:, 0] = 2**n - 1  # each row holds its max level, so the encoder recovers U0 exactly
        sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
        unit = torch.exp2(torch.randint(-20, 10, (rows, 1), generator=g).float())
        x = sign * levels(bits)[index] * unit
        codes, scales = encode(x, bits)
        assert torch.equal(scales, unit.view(-1))
        assert torch.equal(decode(codes, scales, x.shape, bits), x)


def test_edge_cases_zeros_constants_odd_sizes_and_dtypes():
    zeros = torch.zeros(3, 5)
    codes, scales = encode(zeros)
    assert not codes.any() and not scales.any()
    assert torch.equal(decode(codes, scales, zeros.shape), zeros) and not decode(codes, scales, (3, 5)).signbit().any()
    for value in (2.5, -0.75):  # all-equal: the value is the group's max, a level
        x = torch.full((4, 3), value)
        assert torch.equal(decode(*encode(x, group_rows=None), x.shape, group_rows=None), x)
    for shape, rows in [((1,), 1), ((7,), 1), ((3, 3), 3), ((2, 3, 5), 6), ((), 1)]:  # codes padded to 8
        x = torch.randn(shape)
        codes, scales = encode(x, 4, group_rows=2)
        assert codes.dtype == torch.uint8 and codes.numel() == math.ceil(x.numel() / 8) * 4
        assert scales.numel() == math.ceil(rows / 2)
        assert codes.numel() + 4 * scales.numel() == payload_bytes(rows, x.numel() // rows, 4, 2)
        y = decode(codes, scales, shape, 4, group_rows=2)
        assert y.shape == x.shape and ((y - x).abs() <= error_bound(x, 4, 2) * (1 + 1e-6)).all()
    empty = torch.zeros(0, 8)
    assert decode(*encode(empty), empty.shape).shape == (0, 8)
    bf = heavy_tailed((6, 16), seed=1).bfloat16()
    codes, scales = encode(bf)
    assert decode(codes, scales, bf.shape, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert ((decode(codes, scales, bf.shape) - bf.float()).abs() <= error_bound(bf) * (1 + 1e-6)).all()


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="got 9"):
        encode(torch.ones(2, 2), bits=9)
    with pytest.raises(ValueError, match="got 0"):
        encode(torch.ones(2, 2), group_rows=0)
    with pytest.raises(ValueError, match="do not fit shape"):
        decode(torch.zeros(4, dtype=torch.uint8), torch.ones(2), (3, 5))
    with pytest.raises(ValueError, match="'ring'"):
        all_reduce_compressed(torch.ones(2), method="ring")


def reference_sign(x: torch.Tensor, group_rows=1) -> torch.Tensor:
    """The 1-bit code by its definition, in float64: sign(x) (+ for 0) times the group's mean |x|."""
    x = x.double().reshape(-1, x.shape[-1])
    g = group_rows or x.shape[0]
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], g):
        part = x[start:start + g]
        out[start:start + g] = torch.where(part < 0, -1.0, 1.0) * part.abs().mean()
    return out


@pytest.mark.parametrize("group_rows", [1, 3, None])
def test_one_bit_is_the_sign_times_the_mean_magnitude(group_rows):
    x = heavy_tailed((10, 37), seed=7)
    x[2, :5] = 0.0  # zeros decode to +s
    x[4] = 0.0  # an all-zero row (group_rows 1): scale 0, decodes to zeros
    codes, scales = encode(x, 1, group_rows)
    assert codes.numel() == math.ceil(x.numel() / 8) and codes.numel() + 4 * scales.numel() == \
        payload_bytes(10, 37, 1, group_rows)  # one bit a value, an fp32 scale per group
    y = decode(codes, scales, x.shape, 1, group_rows)
    torch.testing.assert_close(y.double(), reference_sign(x, group_rows), rtol=1e-6, atol=0)
    assert torch.allclose(error_bound(x, 1, group_rows).double(), (y.double() - x.double()).abs(), rtol=1e-5, atol=1e-7)
    if group_rows == 1:
        assert not y[4].any()
    assert levels(1).tolist() == [1.0]
    g = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))  # Gaussian rows: 1 - 2/pi
    rel = ((decode(*encode(g, 1), g.shape, 1) - g) ** 2).sum() / (g**2).sum()
    assert abs(rel - (1 - 2 / math.pi)) < 0.01


def linear_round_trip(x, bits):
    """Paper eq. 4-5: one step max|R| / (2^(bits-1) - 1) for the whole tensor."""
    step = x.abs().max() / (2 ** (bits - 1) - 1)
    return torch.round(x / step) * step


def test_piecewise_beats_linear_on_gaussian_activations():
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    rel = lambda y: ((y - x) ** 2).sum() / (x**2).sum()  # noqa: E731
    piecewise = rel(decode(*encode(x, 4, None), x.shape, 4, None))
    assert piecewise < 0.6 * rel(linear_round_trip(x, 4))  # measured 0.47x


# ---------------------------------------------------------------- token scores and top-k


def reference_scores(q, k, causal, scale=None):
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if causal:
        t = q.shape[2]
        logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1).sum((1, 2))


@pytest.mark.parametrize("heads,kv_heads,causal", [(4, 4, True), (6, 2, True), (3, 3, False)])
def test_token_scores_match_full_attention(heads, kv_heads, causal):
    g = torch.Generator().manual_seed(heads)
    q, k = torch.randn(2, heads, 13, 8, generator=g), torch.randn(2, kv_heads, 13, 8, generator=g)
    want = reference_scores(q, k, causal)
    for chunk in (1, 5, 64):
        got = token_scores(q, k, causal, chunk=chunk)
        assert got.shape == (2, 13) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(want.sum(1), torch.full((2,), heads * 13.0, dtype=torch.float64))
    if kv_heads % 2 == 0:  # two TP ranks, half the heads each: their scores sum to the all-heads score
        hq, hk = heads // 2, kv_heads // 2
        parts = token_scores(q[:, :hq], k[:, :hk], causal) + token_scores(q[:, hq:], k[:, hk:], causal)
        assert torch.allclose(parts.double(), want, rtol=1e-5, atol=1e-5)


def reference_topk(scores, kept):
    """Brute force: rank (score desc, token index asc)."""
    mask = torch.zeros(scores.shape, dtype=torch.bool)
    for b, row in enumerate(scores.tolist()):
        for t in sorted(range(len(row)), key=lambda t: (-row[t], t))[:kept]:
            mask[b, t] = True
    return mask


def test_keep_count_rounding_and_local_mask():
    assert [keep_count(7, 0.5), keep_count(10, 0.3), keep_count(10, 0.25), keep_count(10, 0.01), keep_count(10, 1.0)] \
        == [4, 3, 3, 1, 10]  # nearest, halves up, at least one
    with pytest.raises(ValueError, match="got 0"):
        keep_count(10, 0)
    scores = torch.randint(0, 4, (3, 11), generator=torch.Generator().manual_seed(0)).float()  # many ties
    for ratio in (0.2, 0.5, 1.0):
        mask = topk_token_mask(scores, ratio)
        assert torch.equal(mask, reference_topk(scores, keep_count(11, ratio)))
    assert topk_token_mask(scores, 1.0).all()


# ---------------------------------------------------------------- distributed: one spawn for everything


def _rank_input(rank, shape, dtype=torch.float32):
    return heavy_tailed(shape, seed=100 + rank).to(dtype)


def _distributed(rank, world, cases, shape):
    comm = Comm(build_mesh())
    results = {}
    for method, group_rows, dtype in cases:
        x = _rank_input(rank, shape, dtype)
        sync = all_reduce_compressed(x, comm, bits=4, group_rows=group_rows, method=method)
        work = all_reduce_compressed(x, comm, bits=4, group_rows=group_rows, method=method, async_op=True)
        results[(method, group_rows, dtype)] = (sync, work.wait())
    for method in METHODS:  # kept rows at 4 bits and pruned rows at 1 bit, in one message
        kept, pruned = _rank_input(rank, shape), _rank_input(rank + 10, (4, shape[1]))
        results[("blocks", method)] = all_reduce_compressed_blocks([(kept, 4), (pruned, 1), (kept[:0], 4)], comm,
                                                                   method=method)
    local = torch.randint(0, 3, (2, 9), generator=torch.Generator().manual_seed(rank)).float()  # differs per rank
    masks = [topk_token_mask(local, ratio, comm) for ratio in (0.4, 1.0)]
    alpha_beta = measure_alpha_beta(comm, sizes=(1 << 10, 1 << 14), repeats=2, op="all_gather")
    comm.close()
    return results, local, masks, alpha_beta


def test_distributed_compressed_all_reduce_and_topk():
    world, shape = 3, (5, 7)  # 5 rows over 3 ranks: two_step pads a row
    cases = [("gather", 1, torch.float32), ("gather", None, torch.bfloat16), ("two_step", 1, torch.float32),
             ("two_step", 2, torch.float32)]
    outs = run_ranks(_distributed, world, args=(cases, shape))
    for case in cases:
        method, group_rows, dtype = case
        first = outs[0][0][case][0]
        for results, *_ in outs:
            sync, waited = results[case]
            assert torch.equal(sync, first) and torch.equal(waited, first)  # bit-identical on every rank
        assert first.dtype == dtype and first.shape == shape
        xs = [_rank_input(r, shape, dtype) for r in range(world)]
        exact = sum(x.double() for x in xs)
        bound = sum(error_bound(x, 4, group_rows).double() for x in xs)
        if method == "two_step":  # plus one re-quantization of each 2-row chunk of the sum
            sent = sum(decode(*encode(x, 4, group_rows), shape, 4, group_rows).double() for x in xs)
            padded = torch.cat([sent, sent.new_zeros(1, shape[1])])
            bound = bound + torch.cat([error_bound(c, 4, group_rows) for c in padded.split(2)])[:5].double()
        rounding = 0 if dtype == torch.float32 else first.double().abs() * 2**-8  # the bf16 result
        assert ((first.double() - exact).abs() <= bound * (1 + 1e-5) + rounding + 1e-5).all()
    # Blocks in one message: the 4-bit block is what all_reduce_compressed gives alone; the 1-bit
    # block (gather) is the sum over ranks, in rank order, of each rank's sign(x) * mean |x| per row.
    for method in METHODS:
        first = outs[0][0][("blocks", method)]
        for results, *_ in outs:
            assert all(torch.equal(a, b) for a, b in zip(results[("blocks", method)], first))
        assert first[2].shape == (0, shape[1])
        alone = outs[0][0][(method, 1, torch.float32)][0]
        assert torch.equal(first[0], alone)
        signs = [reference_sign(_rank_input(r + 10, (4, shape[1]))) for r in range(world)]
        if method == "gather":
            torch.testing.assert_close(first[1].double(), sum(signs), rtol=1e-6, atol=1e-6)
            in_order = torch.zeros(4, shape[1])
            for r in range(world):
                in_order += decode(*encode(_rank_input(r + 10, (4, shape[1])), 1), (4, shape[1]), 1)
            assert torch.equal(first[1], in_order)  # the decoded 1-bit payloads, added in rank order
        else:  # each rank's 2-row chunk of the sum is re-encoded at 1 bit
            want = torch.cat([reference_sign(c) for c in sum(signs).split(2)])
            torch.testing.assert_close(first[1].double(), want, rtol=1e-5, atol=1e-5)
    # top-k: one mask everywhere, the top tokens of the summed scores (small integers: sums exact)
    total = sum(local for _, local, _, _ in outs)
    for _, _, masks, _ in outs:
        assert torch.equal(masks[0], reference_topk(total, keep_count(9, 0.4))) and masks[1].all()
    assert len({ab for *_, ab in outs}) == 1  # every rank fits the same alpha, beta


def test_wire_bytes_by_hand():
    # [5, 7] fp32 rows, 4 bits, a scale per row: 35 codes -> 40 -> 20 bytes, + 5 scales * 4 = 40 bytes
    assert wire_bytes((5, 7), 3, 4, 1, "gather") == 2 * 40
    # two_step: chunks of 2 rows: 14 codes -> 16 -> 8 bytes + 2 * 4 = 16 bytes; all-to-all + all-gather
    assert wire_bytes((5, 7), 3, 4, 1, "two_step") == 2 * 2 * 16
    assert wire_bytes((5, 7), 1) == 0
    assert wire_bytes((4096, 1024), 2, 4, None) == 4096 * 1024 // 2 + 4  # 8x less than fp32
    assert wire_bytes((5, 7), 2, 1) == 5 + 5 * 4  # 1 bit: 35 codes -> 40 -> 5 bytes, + 5 scales


# ---------------------------------------------------------------- partition planner


def reference_completion(plan, t_cp, t_cm):
    """Event simulation on sample intervals: a partition computes after every all-reduce of the
    previous layer that overlaps its samples and the stream's previous compute; then all-reduces
    after its compute and the previous all-reduce."""
    compute_free, comm_free = 0.0, 0.0
    prev = [(0.0, 1.0, 0.0)]  # (first sample, last sample, all-reduce end) of the input
    for layer, k in enumerate(plan):
        i = (1, 2, 4).index(k)
        done = []
        for part in range(k):
            lo, hi = part / k, (part + 1) / k
            ready = max(end for a, b, end in prev if a < hi and lo < b)
            compute_free = max(compute_free, ready) + t_cp[layer][i]
            comm_free = max(comm_free, compute_free) + t_cm[layer][i]
            done.append((lo, hi, comm_free))
        prev = done
    return comm_free


def random_times(rng, layers):
    """Per-partition times shaped like a real profile: compute c/K plus overhead, comm alpha + beta m / K."""
    t_cp, t_cm = [], []
    for _ in range(layers):
        c, m, alpha = rng.uniform(1, 10), rng.uniform(1, 10), rng.uniform(0, 2)
        t_cp.append([c / k + rng.uniform(0, 0.5) for k in (1, 2, 4)])
        t_cm.append([alpha + m / k for k in (1, 2, 4)])
    return t_cp, t_cm


def test_simulate_matches_event_simulation_and_hand_values():
    assert simulate([1], [[3, 0, 0]], [[2, 0, 0]]) == 5
    # K = 2: compute 1.5, 1.5; all-reduce 1 after each: 1.5 -> 2.5, 3 -> 4
    assert simulate([2], [[0, 1.5, 0]], [[0, 1, 0]]) == 4
    rng = random.Random(0)
    for _ in range(50):
        t_cp, t_cm = random_times(rng, 5)
        plan = [rng.choice((1, 2, 4)) for _ in range(5)]
        assert simulate(plan, t_cp, t_cm) == pytest.approx(reference_completion(plan, t_cp, t_cm), rel=1e-12)


def test_planner_finds_the_brute_force_optimum():
    rng = random.Random(1)
    for trial in range(60):
        layers = 1 + trial % 6
        t_cp, t_cm = random_times(rng, layers)
        times = {p: simulate(p, t_cp, t_cm) for p in itertools.product((1, 2, 4), repeat=layers)}
        best = min(times.values())
        exact = plan_partitions(t_cp, t_cm)
        assert exact.time == pytest.approx(best, rel=1e-12) and times[tuple(exact.partitions)] == exact.time
        paper = plan_partitions(t_cp, t_cm, exact=False)
        assert times[tuple(paper.partitions)] == paper.time >= best - 1e-9  # a real plan, truly predicted
        if layers <= 2:  # one state per K loses nothing until a third layer
            assert paper.time == pytest.approx(best, rel=1e-12)
    assert plan_partitions([], []).partitions == []
    with pytest.raises(ValueError, match="layers"):
        simulate([1, 2], [[1, 1, 1]], [[1, 1, 1]])


def test_paper_dp_misses_the_optimum_here():
    # compute c/K with c = 4, 16, 16; all-reduce 1 + m/K with m = 12, 12, 4. The paper keeps, for
    # layer 2 at K = 4, the schedule whose last all-reduce ends first (layer 1 at K = 2); the one
    # from layer 1 at K = 4 ends later but frees the early partitions sooner, which layer 3 needs.
    t_cp = [[c / k for k in (1, 2, 4)] for c in (4, 16, 16)]
    t_cm = [[1 + m / k for k in (1, 2, 4)] for m in (12, 12, 4)]
    paper, exact = plan_partitions(t_cp, t_cm, exact=False), plan_partitions(t_cp, t_cm)
    assert (paper.partitions, paper.time) == ([2, 2, 4], 43.0)
    assert (exact.partitions, exact.time) == ([4, 4, 4], 41.0)
    assert reference_completion([4, 4, 4], t_cp, t_cm) == 41.0


def test_alpha_beta_fit():
    sizes = [1e3, 1e4, 1e5, 1e6]
    alpha, beta = fit_alpha_beta(sizes, [comm_time(m, 2e-4, 8e-9) for m in sizes])
    assert alpha == pytest.approx(2e-4) and beta == pytest.approx(8e-9)
    alpha, beta = fit_alpha_beta([1.0, 2.0, 3.0], [0.9, 2.1, 2.9])  # intercept -0.03 < 0: through the origin
    assert alpha == 0 and beta == pytest.approx((0.9 + 4.2 + 8.7) / 14)
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_alpha_beta([5, 5], [1, 2])
