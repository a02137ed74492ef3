"""DiLoCo's outer loop (zeropp.diloco) over ZeRO-3 and DDP inside sites, against one-process replays."""

import pytest
import torch
from safetensors.torch import load_file

from kernels import dequantize, quantize
from models.transformer import lm_loss
from tests.zeropp.test_engine import BATCH, batches, make_model
from trainer.spawn import run_ranks
from zeropp import build_runtime
from zeropp.config import DilocoConfig, ZeroConfig
from zeropp.diloco import OUTER_TAG, DiLoCo, fragment_schedule, fragment_size, outer_file
from zeropp.topology import TopologyError, build_mesh

ZERO3 = ZeroConfig(stage=3, communication_data_type="fp32")
DDP = ZeroConfig(stage=0)
INNER_LR, INNER_MOMENTUM = 0.05, 0.9


def _inner_optimizer(params, momentum: float):
    return torch.optim.SGD(params, lr=INNER_LR, momentum=momentum, foreach=False)


def _site_rows(sample, site: int, sites: int):
    rows = BATCH // sites
    return sample[site * rows:(site + 1) * rows]


def _run(rank, world, site_size, zero, diloco, steps, momentum, save_at=None, directory=None, load=False):
    """`steps` inner steps of DiLoCo on global batches; each rank reads its share of its site's rows.
    save_at: save after that step (then go on); load: start from `directory` at step save_at.
    Returns (the full weights, the ledger's outer bytes, the outer state, this rank's layout: the
    (name, offset in the parameter, numel) of each piece of its share in order, the predicted
    outer bytes per step)."""
    runtime = build_runtime(make_model("gpt2-tiny"), zero, torch.device("cpu"), site_size=site_size)
    optimizer = _inner_optimizer(runtime.module.parameters(), momentum)
    outer = DiLoCo(runtime, diloco)
    mesh, first = runtime.mesh, 0
    if load:
        outer.load(directory, optimizer)
        first = save_at
    per_rank = BATCH // (mesh.sites * mesh.world_size)
    for step, sample in enumerate(batches(steps)[first:], start=first + 1):
        rows = _site_rows(sample, mesh.site, mesh.sites)[mesh.rank * per_rank:(mesh.rank + 1) * per_rank]
        runtime.backward(lm_loss(runtime(rows[:, :-1]), rows[:, 1:]))
        optimizer.step()
        optimizer.zero_grad()
        outer.after_inner_step(step)
        if step == save_at and not load:
            if rank == 0:
                directory.mkdir()
            torch.distributed.barrier()
            outer.save(directory, optimizer)
            torch.distributed.barrier()
    state = {k: v.clone() for k, v in outer.state_dict().items()}
    layout = [(name, getattr(p, "unsharded_offset", 0), p.numel()) for name, p in runtime.module.named_parameters()]
    weights = runtime.full_state_dict()
    ledger = runtime.ledger.totals().get(OUTER_TAG)
    predicted = outer.predicted_step_bytes()[OUTER_TAG]
    runtime.close()
    return weights, ledger, state, layout, predicted


def _fragment_masks(layouts, fragments):
    """Which elements of the flat model (model order) each fragment holds, from the site's ranks'
    layouts: each rank's share, its pieces in order, cut into F equal ranges (the last padded)."""
    params = dict(make_model("gpt2-tiny").named_parameters())
    starts = dict(zip(params, [0] + list(torch.cumsum(torch.tensor([p.numel() for p in params.values()]), 0))))
    owner = torch.full((sum(p.numel() for p in params.values()),), -1)
    for layout in layouts:
        size, at = -(-sum(n for _, _, n in layout) // fragments), 0
        for name, offset, n in layout:
            lo = int(starts[name]) + offset
            owner[lo:lo + n] = torch.arange(at, at + n) // size
            at += n
    assert (owner >= 0).all()  # the site's shares cover the model
    return [owner == f for f in range(fragments)]


def _replay(sites, steps, diloco, momentum, masks=None):
    """One process: each site a plain model trained by SGD on its rows' mean loss, and every H steps
    the outer Nesterov SGD on the mean pseudo-gradient (with compression: each site's quantized
    pseudo-gradient plus its residual, the whole model flat, as a 1-rank site sends it). masks:
    Streaming DiLoCo's fragments, fragment f's pseudo-gradient taken after the steps where
    (step - f * H // F) % H == 0 (None: one fragment, the whole model), and the outer step on it
    applied `diloco.delay` steps later to the weights as they are then (mixing: alpha of them kept).
    Returns (the weights, each site's residual)."""
    models = [make_model("gpt2-tiny") for _ in range(sites)]
    optimizers = [_inner_optimizer(m.parameters(), momentum) for m in models]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    anchor = flat(models[0]).clone()
    buf = torch.zeros_like(anchor)
    residuals = [torch.zeros_like(anchor) for _ in range(sites)]
    masks = masks or [torch.ones_like(anchor, dtype=torch.bool)]
    h, fragments, in_flight = diloco.inner_steps, len(masks), []
    for step, sample in enumerate(batches(steps), start=1):
        for s, (model, opt) in enumerate(zip(models, optimizers)):
            rows = _site_rows(sample, s, sites)
            lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        for mask in [masks[f] for f in range(fragments) if (step - f * h // fragments) % h == 0]:
            deltas = [anchor - flat(m) for m in models]
            for s in range(sites) if diloco.bits else ():  # (one fragment: the blocks of the whole model)
                sent = deltas[s] + residuals[s]
                q = quantize(sent, diloco.bits, diloco.compression_block_size)
                deltas[s] = dequantize(q.codes, q.scales, sent.numel(), diloco.bits, diloco.compression_block_size)
                residuals[s] = sent - deltas[s]
            in_flight.append((step + diloco.delay, mask, torch.stack(deltas).mean(0)))
        while in_flight and in_flight[0][0] <= step:
            _, mask, g = in_flight.pop(0)
            buf[mask] = buf[mask] * diloco.outer_momentum + g[mask]
            update = g + diloco.outer_momentum * buf if diloco.nesterov else buf
            anchor[mask] = anchor[mask] - diloco.outer_lr * update[mask]
            with torch.no_grad():
                for m in models:
                    new, offset = torch.where(mask, anchor.lerp(flat(m), diloco.mixing), flat(m)), 0
                    for p in m.parameters():
                        p.copy_(new[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
    return dict(models[0].named_parameters()), residuals


def _plain_data_parallel(steps):
    """One process, the whole global batch: what data parallelism over every rank computes."""
    model = make_model("gpt2-tiny")
    opt = _inner_optimizer(model.parameters(), 0.0)
    for sample in batches(steps):
        lm_loss(model(sample[:, :-1]), sample[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def _max_diff(weights, reference) -> float:
    return max((weights[k].reshape(-1) - reference[k].detach().reshape(-1)).abs().max().item() for k in reference)


@pytest.mark.parametrize("world,site_size,zero", [(4, 2, ZERO3), (4, 2, DDP), (4, 1, DDP)])
def test_h1_outer_lr1_no_momentum_is_data_parallelism_across_sites(world, site_size, zero):
    """H = 1, outer lr 1, no momentum: the new weights are the mean of the sites' weights after one
    inner step. That equals one data-parallel step over every rank exactly when the inner update
    is linear in the gradient and has no state of its own: plain SGD (no momentum, no clipping, no
    weight decay), each site's gradient the mean over its equal share of the global batch."""
    diloco = DilocoConfig(enabled=True, inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    weights, ledger, state, *_ = run_ranks(_run, world, args=(site_size, zero, diloco, 3, 0.0))[0]
    assert _max_diff(weights, _plain_data_parallel(3)) <= 1e-6
    # Across sites: this rank's share only (ZeRO-3's shard, DDP's chunk of the replica), fp32, ring all-reduce.
    sites = world // site_size
    assert ledger["cross_node_sent"] == 3 * (2 * (sites - 1) * 4 * state["anchor"].numel() // sites)
    if zero is DDP:  # the replica's outer state and exchange are split over the site's ranks
        assert state["anchor"].numel() == -(-sum(p.numel() for p in make_model("gpt2-tiny").parameters()) // site_size)


@pytest.mark.parametrize("world,site_size,fragments", [(4, 2, 1), (6, 2, 1), (4, 2, 3)])
def test_outer_nesterov_over_zero3_sites_matches_the_replay(world, site_size, fragments):
    """H 3, two cycles, the default outer lr 0.7 / Nesterov 0.5, inner SGD with momentum (kept
    across the syncs): 2 x 2 and 3 x 2 ZeRO-3 sites against the one-process replay; every rank of
    every site ends with the same weights. With 3 fragments (Streaming DiLoCo) a fragment syncs
    after every step, each at its own steps, with 1/3 of the bytes: the sites agree on the
    fragment synced last and differ on the others. The predicted outer bytes per step are the
    ledger's, amortized."""
    diloco = DilocoConfig(enabled=True, inner_steps=3, fragments=fragments)
    outs = run_ranks(_run, world, args=(site_size, ZERO3, diloco, 6, INNER_MOMENTUM))
    masks = _fragment_masks([o[3] for o in outs[:site_size]], fragments) if fragments > 1 else None
    reference, _ = _replay(world // site_size, 6, diloco, INNER_MOMENTUM, masks)
    assert _max_diff(outs[0][0], reference) <= 1e-5
    flat = lambda weights: torch.cat([weights[k].reshape(-1) for k in reference])  # noqa: E731
    synced = masks[0] if masks else slice(None)  # fragment 0 synced after step 6; the others earlier
    assert all(torch.equal(flat(o[0])[synced], flat(outs[0][0])[synced]) for o in outs)
    assert (fragments > 1) != torch.equal(flat(outs[-1][0]), flat(outs[0][0]))  # since, local steps
    numel = outs[0][2]["anchor"].numel()  # this rank's shard: fp32, ring all-reduce over the sites
    sites, syncs = world // site_size, 6 * fragments // 3
    assert outs[0][1]["sent"] == syncs * (2 * (sites - 1) * 4 * (numel // fragments) // sites)
    # the prediction amortizes a cycle's F syncs over its H steps: the ledger's two cycles / 6
    assert all(o[4][k] == o[1][k] // 2 // 3 for o in outs for k in ("sent", "cross_node_sent"))


def _ddp_fragment_masks(numel, parts, fragments):
    """Fragment f of a DDP site: range f of each of its `parts` ranks' equal chunks of the flat replica."""
    size = fragment_size(numel, parts, fragments)
    position = torch.arange(numel) % (size * fragments)  # where each element sits in its rank's chunk
    return [position // size == f for f in range(fragments)]


@pytest.mark.parametrize("zero", [ZERO3, DDP])
def test_delayed_exchange_matches_the_replay(zero):
    """Streaming DiLoCo's overlap: 2 x 2 sites, H 4, 2 fragments, each exchange applied one inner step
    after it is sent (delay 1) and mixed half into the weights that moved on meanwhile, against the
    one-process replay; 10 steps leave the exchange sent after step 10 in flight (not applied). ZeRO-3
    (fragments: ranges of each rank's shard) and DDP (ranges of each rank's chunk of the replica)."""
    diloco = DilocoConfig(enabled=True, inner_steps=4, fragments=2, delay=1, mixing=0.5)
    outs = run_ranks(_run, 4, args=(2, zero, diloco, 10, INNER_MOMENTUM))
    numel = sum(p.numel() for p in make_model("gpt2-tiny").parameters())
    masks = _ddp_fragment_masks(numel, 2, 2) if zero is DDP else _fragment_masks([o[3] for o in outs[:2]], 2)
    reference, _ = _replay(2, 10, diloco, INNER_MOMENTUM, masks)
    assert all(_max_diff(o[0], reference) <= 1e-5 for o in outs[:2])
    # ledgered when sent: after steps 2, 4, 6, 8 and 10; DDP: + the site's gathers of the 4 applied ones' weights
    assert outs[0][1]["calls"] == 5 + 4 * (zero is DDP)


@pytest.mark.parametrize("numel,parts,fragments,h", [(1001, 2, 3, 5), (10, 1, 4, 4), (7, 3, 2, 50), (64, 2, 1, 3)])
def test_fragments_cover_every_element_once_per_cycle(numel, parts, fragments, h):
    """Every window of H consecutive steps syncs each element of the (padded) model exactly once,
    in each of `parts` ranks' shares, whatever the sizes; the syncs are spread evenly over H."""
    size, syncs = fragment_size(numel, parts, fragments), fragment_schedule(h, fragments)
    for first in range(1, 2 * h + 1):
        seen = torch.zeros(numel, dtype=torch.int64)
        for step in range(first, first + h):
            if (f := syncs.get(step % h)) is not None:
                for rank in range(parts):  # rank's share: chunk `rank`, fragment f a range of it
                    lo = (rank * fragments + f) * size
                    seen[lo:lo + size] += 1
        assert torch.equal(seen, torch.ones_like(seen)), first
    offsets = sorted(syncs)
    gaps = [b - a for a, b in zip(offsets, offsets[1:] + [offsets[0] + h])]
    assert len(offsets) == fragments and set(gaps) <= {h // fragments, -(-h // fragments)}


def _drift(rank: int, cycle: int, like: torch.Tensor) -> torch.Tensor:
    """What site `rank`'s inner steps moved its weights by in `cycle` (known, so a replay can redo it)."""
    g = torch.Generator().manual_seed(1000 * cycle + rank)
    return 0.01 * torch.randn(like.shape, generator=g) * (1 + rank)


def _exchange(rank, world, diloco, cycles):
    """Sites of one DDP rank whose weights drift by _drift between syncs; the outer state after each."""
    runtime = build_runtime(make_model("gpt2-tiny"), DDP, torch.device("cpu"), site_size=1)
    outer = DiLoCo(runtime, diloco)
    states = []
    for cycle in range(cycles):
        with torch.no_grad():
            for i, p in enumerate(outer.params):
                p.sub_(_drift(rank, cycle * 100 + i, p))
        outer.outer_step()
        states.append({k: v.clone() for k, v in outer.state_dict().items()})
    ledger = runtime.ledger.totals()[OUTER_TAG]
    runtime.close()
    return states, ledger


def _replay_exchange(sites, diloco, cycles):
    """The compressed exchange in one process: each site quantizes its pseudo-gradient plus its
    residual, keeps what the codes lost, and the sites' decoded codes are averaged in site order."""
    model = make_model("gpt2-tiny")
    params = list(model.parameters())
    anchor = torch.cat([p.detach().reshape(-1) for p in params])
    momentum, residuals, states = torch.zeros_like(anchor), [torch.zeros_like(anchor) for _ in range(sites)], []
    bits, block, mu = diloco.bits, diloco.compression_block_size, diloco.outer_momentum
    for cycle in range(cycles):
        total = torch.zeros_like(anchor)
        for s in range(sites):
            drift = torch.cat([_drift(s, cycle * 100 + i, p).reshape(-1) for i, p in enumerate(params)])
            sent = (anchor - (anchor - drift)) + residuals[s]
            q = quantize(sent, bits, block)
            decoded = dequantize(q.codes, q.scales, sent.numel(), bits, block)
            residuals[s] = sent - decoded
            total += decoded
        g = total / sites
        momentum = momentum.mul(mu).add(g)
        anchor = anchor.sub(g.add(momentum, alpha=mu), alpha=diloco.outer_lr)
        states.append([{"anchor": anchor, "momentum": momentum, "residual": r} for r in residuals])
    return states


@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_compressed_exchange_error_feedback_matches_the_replay(compression):
    """4 sites of one DDP rank, int8 / int4 blocks with error feedback, Nesterov outer SGD over three
    syncs: every rank's anchor, momentum and residual against the one-process replay, and the
    ledger's outer bytes (codes + an fp32 scale per block, to each other site)."""
    diloco = DilocoConfig(enabled=True, inner_steps=2, compression=compression, compression_block_size=64)
    outs = run_ranks(_exchange, 4, args=(diloco, 3))
    replay = _replay_exchange(4, diloco, 3)
    for rank, (states, _) in enumerate(outs):
        for cycle, state in enumerate(states):
            want = replay[cycle][rank]
            assert all((state[k] - want[k]).abs().max() <= 1e-6 for k in want), (rank, cycle)
        assert states[-1]["residual"].abs().max() > 0  # the codes lost something, and it was kept
    numel = outs[0][0][0]["anchor"].numel()
    chunk = -(-numel // 64) * (64 * diloco.bits // 8 + 4)
    assert outs[0][1]["sent"] == 3 * 3 * chunk  # 3 syncs x 3 other sites


def _mixed(rank, world, diloco):
    """2-rank DDP sites whose replicas drift by _drift(site) before one outer step: (the weights
    before it, after it, the anchor's chunk), flat."""
    runtime = build_runtime(make_model("gpt2-tiny"), DDP, torch.device("cpu"), site_size=2)
    outer = DiLoCo(runtime, diloco)
    flat = lambda: torch.cat([p.detach().reshape(-1).clone() for p in outer.params])  # noqa: E731
    with torch.no_grad():
        for i, p in enumerate(outer.params):
            p.sub_(_drift(runtime.mesh.site, i, p))
    local = flat()
    outer.outer_step()
    out = local, flat(), outer.anchor.clone()
    runtime.close()
    return out


def test_mixing_keeps_alpha_of_the_local_weights():
    """Streaming DiLoCo's mixing alpha 0.25 over 2 sites x 2 DDP ranks: the global weights are the
    outer Nesterov step on the mean pseudo-gradient (the anchor), each site's weights 0.25 of its
    own + 0.75 of them."""
    diloco = DilocoConfig(enabled=True, inner_steps=2, mixing=0.25)
    outs = run_ranks(_mixed, 4, args=(diloco,))
    start = torch.cat([p.detach().reshape(-1) for p in make_model("gpt2-tiny").parameters()])
    g = torch.stack([start - outs[0][0], start - outs[2][0]]).mean(0)  # site 0, site 1
    global_ = start - diloco.outer_lr * (g + diloco.outer_momentum * g)  # first step: momentum = g
    for rank, (local, weights, anchor) in enumerate(outs):
        assert (weights - (0.25 * local + 0.75 * global_)).abs().max() <= 1e-6, rank
        mine = global_[rank % 2 * anchor.numel():][:anchor.numel()]  # its chunk of the model (no padding)
        assert (anchor[:mine.numel()] - mine).abs().max() <= 1e-6, rank
    assert not torch.equal(outs[0][1], outs[2][1])  # the sites keep their own parts


@pytest.mark.parametrize("fragments,delay", [(1, 0), (2, 0), (2, 1)])
def test_resume_mid_cycle_is_bit_exact(tmp_path, fragments, delay):
    """2 x 2 ZeRO-3 sites with int8 exchange: saved at step 4 of cycles of 3 (the anchor, momentum and
    residual beside the inner state), resumed, and the weights and outer state at step 7 (after the
    sync at 6) are bit-identical to the uninterrupted run's; with 2 fragments (synced after steps
    1, 3, 4, 6, 7) too, and with delay 1 the exchange sent after step 4 is in flight at the save
    (its result saved, applied after step 5 of the resumed run)."""
    diloco = DilocoConfig(enabled=True, inner_steps=3, compression="int8", fragments=fragments, delay=delay)
    ckpt = tmp_path / "ckpt"
    full = run_ranks(_run, 4, args=(2, ZERO3, diloco, 7, INNER_MOMENTUM, 4, ckpt))
    resumed = run_ranks(_run, 4, args=(2, ZERO3, diloco, 7, INNER_MOMENTUM, 4, ckpt, True))
    for a, b in zip(full, resumed):
        assert all(torch.equal(a[0][k], b[0][k]) for k in a[0])
        assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    assert (ckpt / "site001" / "shards_rank00001.safetensors").is_file()
    in_flight = load_file(str(outer_file(ckpt, 3))).get("in_flight")
    assert (in_flight.tolist() == [[1, 5]]) if delay else in_flight is None  # fragment 1, due after step 5


def _mesh_of(rank, world, site_size):
    try:
        mesh = build_mesh(site_size=site_size)
    except TopologyError as e:
        return str(e)
    return mesh.site, mesh.rank, mesh.members("dp"), mesh.members("cross_site")


def test_sites_split_the_mesh_and_bad_values_are_named():
    outs = run_ranks(_mesh_of, 4, args=(2,))
    assert outs[3] == (1, 1, [0, 1], [1, 3])  # site 1, its rank 1; dp ranks of its site; cross-site: global
    assert "diloco.site_size=3 does not divide the world size 4" in run_ranks(_mesh_of, 4, args=(3,))[0]
    with pytest.raises(ValueError, match=r"diloco.outer_momentum: value 1.0 is out of range; expected a number"):
        DilocoConfig(outer_momentum=1.0).validate()
    with pytest.raises(ValueError, match=r"diloco.compression: value 'int2' .* one of none, int8, int4"):
        DilocoConfig(compression="int2").validate()
    for bad in (0, 4):
        with pytest.raises(ValueError, match=rf"diloco.fragments: value {bad} .* in \[1, inner_steps = 3\]"):
            DilocoConfig(inner_steps=3, fragments=bad).validate()
    with pytest.raises(ValueError, match=r"diloco.mixing: value 1.0 is out of range; expected a number in \[0, 1\)"):
        DilocoConfig(mixing=1.0).validate()
    with pytest.raises(ValueError, match=r"diloco.delay: value 3 .* in \[0, inner_steps = 3\)"):
        DilocoConfig(inner_steps=3, delay=3).validate()
