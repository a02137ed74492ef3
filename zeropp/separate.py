"""SEPARATE (seed 002): gradients travel as shared random projections, with moving-average
error feedback (docs/separate.md).

One round, for one unit's (or DDP bucket's) gradient on one rank (paper Algorithm 1):

    h = g + e                        the error-compensated local gradient
    p = P_k h                        m = b / CR projections per block of b elements
    p̄ = sum over ranks of p          the only communication (a reduce-scatter under ZeRO)
    ĥ = P_k^T p̄                      unbiased: E[P_k^T P_k] = I
    e <- (1 - beta) e + beta (h - P_k^T P_k h),  or e <- 0 every reset_interval rounds

P_k is fresh every round k and common to all ranks: it is drawn from (seed, key, k, chunk), never
sent. The gradient is viewed as `chunks` rows (the ZeRO shards; one row under DDP) and each row
is cut into blocks of b elements, the last one zero-padded, so a block never straddles two
shards: the reduce-scatter of the projections hands each rank the summed projections of its own
shard's blocks, and it reconstructs only its shard (`ProjectedReduce`, the ZeRO reducer; DDP's
comm hook all-reduces the projections of a bucket). The error term needs this rank's own
P^T P h over the whole unit, computed in the same pass as the projection.

Two projections (`projection`):
  gaussian  the paper's: m directions ~ N(0, I_b) per block, p = Xi x, ĥ = Xi^T p̄ / m; the
            draws are d·m numbers per round, generated chunk by chunk and never stored whole.
  hadamard  a subsampled randomized Hadamard transform: random signs D per block, the
            orthonormal Walsh-Hadamard H_b (as two Kronecker-factor matmuls), a random subset
            S of m of its b rows per round: p = sqrt(b/m) S H D x, ĥ = sqrt(b/m) D H S^T p̄.
            O(b log b)-like work and d random signs per round; with ratio 1 it is orthogonal,
            so the reconstruction is exact.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from zeropp.comm import CallbackWork, Comm
from zeropp.config import DTYPES, GradientCompression
from zeropp.reducers import TAG, ErrorFeedback, GradientReducer
from zeropp.runtime import Timings

_DRAW_NUMEL = 1 << 22  # Gaussian directions generated per draw (16 MB of fp32)


def _seed(*parts) -> int:
    """A 63-bit generator seed from (seed, key, round, chunk): the same on every rank."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The orthonormal n x n Sylvester-Hadamard matrix (n a power of two)."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@dataclass
class Round:
    """What one compression round needs to be undone: which directions, on what layout."""

    key: str
    index: int  # the round k: the directions are drawn from (seed, key, k, chunk)
    ratio: int
    block: int  # b: elements per block
    directions: int  # m: projections per block
    blocks: int  # blocks per chunk
    numel: int  # elements per chunk (before padding)
    projections: torch.Tensor  # (chunks, blocks * m) fp32, this rank's p


class Separate:
    """The compressor: per key (a unit, a DDP bucket), the error feedback (round counter and error
    buffer: zeropp.reducers.ErrorFeedback with memory 1 - beta), and under G-SEPARATE the adapted
    ratio and beta; `state_dict` makes a resumed run bit-exact."""

    def __init__(self, cfg: GradientCompression, device: torch.device):
        cfg.validate(stage=3)  # the stage only matters to powersgd, which is not this
        self.cfg, self.device = cfg, device
        self.contractive = cfg.reconstruction == "contractive"
        self.feedback = ErrorFeedback(1 - cfg.beta, cfg.reset_interval, DTYPES[cfg.error_dtype])
        self.ratios: dict[str, int] = {}
        self.betas: dict[str, float] = {}
        self._hadamards: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last_subset: dict[str, tuple] = {}  # key -> ((round, b, m), rows): reused by decompress

    # ------------------------------------------------------------------ one round

    def compress(self, key: str, grad: torch.Tensor) -> Round:
        """Project this rank's gradient `grad` (chunks x numel) and update the error; the returned
        round holds the projections (chunks x blocks·m, fp32) to be summed over ranks."""
        k = self.feedback.round(key)
        chunks, numel = grad.shape
        ratio = self.ratios.get(key, self.cfg.ratio)
        block = self._block(numel)
        m = max(1, block // ratio)
        blocks = -(-numel // block)
        memory = 1 - self.betas.get(key, self.cfg.beta)
        # h is changed in place only with error feedback: copied then (G-SEPARATE's exact reduce may still read grad)
        h = grad.float() if memory >= 1 else grad.to(torch.float32, copy=True)
        feedback = self.feedback.begin(key, h, memory)  # h = g + e
        projections = torch.empty(chunks, blocks * m, device=grad.device)
        for c in range(chunks):
            x = h[c]
            if blocks * block != numel:  # the last block of the chunk is zero-padded
                x = torch.zeros(blocks * block, device=grad.device)
                x[:numel] = h[c]
            p, back = self._project(x.view(blocks, block), key, k, c, m, roundtrip=feedback)
            projections[c] = p.reshape(-1)
            if feedback:  # h - C(h), in place: h is not needed after its chunk is projected
                h[c].sub_(back.reshape(-1)[:numel].mul_(m / block) if self.contractive else back.reshape(-1)[:numel])
        if feedback:
            self.feedback.end(key, h)
        return Round(key, k, ratio, block, m, blocks, numel, projections)

    def decompress(self, rnd: Round, summed: torch.Tensor, chunk: int) -> torch.Tensor:
        """The reconstruction (numel, fp32) of chunk `chunk` from its summed projections."""
        p = summed.float().view(rnd.blocks, rnd.directions)
        out = self._reconstruct(p, rnd.key, rnd.index, chunk, rnd.block).reshape(-1)[:rnd.numel]
        return out.mul_(rnd.directions / rnd.block) if self.contractive else out

    def variance_per_norm(self, block: int, m: int) -> float:
        """Var[ĝ_i] / |ĝ_B|² for the unbiased reconstruction ĝ of a block B of b elements from m projections.
        hadamard: Var[ĝ_i] = (b - m) / (m (b - 1)) (|x|² - x_i²) and E|ĝ_B|² = (b / m) |x|²;
        gaussian: Var[ĝ_i] = (|x|² + x_i²) / m and E|ĝ_B|² = (1 + (b + 1) / m) |x|²; x_i² is left out."""
        if self.cfg.projection == "hadamard":
            return (block - m) / (block * (block - 1)) if block > 1 else 0.0
        return 1 / (block + m + 1)

    def _block(self, numel: int) -> int:
        """Elements per block: the configured size, smaller for a chunk that is smaller."""
        if self.cfg.projection == "hadamard":
            return min(self.cfg.block_size, 1 << max(0, (numel - 1).bit_length()))
        return min(self.cfg.block_size, numel)

    # ------------------------------------------------------------------ projections

    def _subset(self, key: str, k: int, block: int, m: int, device) -> torch.Tensor:
        """The round's m of the b Hadamard rows, shared by every block (the signs differ per block)."""
        cached = self._last_subset.get(key)
        if cached is None or cached[0] != (k, block, m):
            subset = torch.randperm(block, generator=_generator(device, _seed(self.cfg.seed, key, k)), device=device)
            cached = self._last_subset[key] = ((k, block, m), subset[:m].sort().values)
        return cached[1]

    def _factors(self, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """H_b = H_b1 (x) H_b2 with b1·b2 = b: a (rows, b) @ H_b is two small matmuls."""
        if block not in self._hadamards:
            n = block.bit_length() - 1
            self._hadamards[block] = (_hadamard(1 << (n - n // 2), device), _hadamard(1 << (n // 2), device))
        return self._hadamards[block]

    def _transform(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """x (rows, b) -> x H_b (orthonormal, symmetric, its own inverse)."""
        h1, h2 = self._factors(block, x.device)
        y = (x.reshape(-1, h2.shape[0]) @ h2).view(-1, h1.shape[0], h2.shape[0])  # one GEMM, then per block
        return torch.matmul(h1, y).reshape(-1, block)

    def _signs(self, key: str, k: int, chunk: int, shape, device) -> torch.Tensor:
        g = _generator(device, _seed(self.cfg.seed, key, k, chunk))
        return torch.randint(0, 2, shape, generator=g, device=device).mul_(-2).add_(1).float()

    def _gaussian_draws(self, key: str, k: int, chunk: int, blocks: int, block: int, m: int, device):
        """(first block, directions (n, m, b)) for consecutive draws covering the chunk's blocks."""
        g = _generator(device, _seed(self.cfg.seed, key, k, chunk))
        per_draw = max(1, _DRAW_NUMEL // (m * block))
        for start in range(0, blocks, per_draw):
            n = min(per_draw, blocks - start)
            yield start, torch.randn(n, m, block, generator=g, device=device)

    def _project(self, x: torch.Tensor, key: str, k: int, chunk: int, m: int, roundtrip: bool):
        """x (blocks, b) -> (p (blocks, m), P^T p or None)."""
        blocks, block = x.shape
        if self.cfg.projection == "hadamard":
            signs = self._signs(key, k, chunk, x.shape, x.device)
            subset = self._subset(key, k, block, m, x.device)
            p = self._transform(x * signs, block)[:, subset] * math.sqrt(block / m)
            return p, (self._hadamard_back(p, signs, subset, block) if roundtrip else None)
        p = torch.empty(blocks, m, device=x.device)
        back = torch.empty_like(x) if roundtrip else None
        for start, xi in self._gaussian_draws(key, k, chunk, blocks, block, m, x.device):
            rows = slice(start, start + xi.shape[0])
            p[rows] = torch.bmm(xi, x[rows].unsqueeze(2)).squeeze(2)
            if roundtrip:
                back[rows] = torch.bmm(p[rows].unsqueeze(1), xi).squeeze(1) / m
        return p, back

    def _hadamard_back(self, p: torch.Tensor, signs: torch.Tensor, subset: torch.Tensor, block: int):
        """sqrt(b/m) D H S^T p: the transpose of the Hadamard projection, (blocks, m) -> (blocks, b)."""
        z = torch.zeros(p.shape[0], block, device=p.device)
        z[:, subset] = p * math.sqrt(block / p.shape[1])
        return self._transform(z, block) * signs

    def _reconstruct(self, p: torch.Tensor, key: str, k: int, chunk: int, block: int) -> torch.Tensor:
        """P^T p for one chunk: p (blocks, m) -> (blocks, b)."""
        blocks, m = p.shape
        if self.cfg.projection == "hadamard":
            return self._hadamard_back(p, self._signs(key, k, chunk, (blocks, block), p.device),
                                       self._subset(key, k, block, m, p.device), block)
        out = torch.empty(blocks, block, device=p.device)
        for start, xi in self._gaussian_draws(key, k, chunk, blocks, block, m, p.device):
            rows = slice(start, start + xi.shape[0])
            out[rows] = torch.bmm(p[rows].unsqueeze(1), xi).squeeze(1) / m
        return out

    # ------------------------------------------------------------------ G-SEPARATE

    def adapt(self, key: str, cosine: float) -> None:
        """G-SEPARATE's step 6 (our reading of the garbled formula, docs/separate.md): an accurate
        estimate (cosine above the target) earns a doubled ratio and a larger beta, a poor one a
        halved ratio and a smaller beta; ratio in [min_ratio, max_ratio], beta in [0.90, 0.99]."""
        cfg = self.cfg
        ratio, beta = self.ratios.get(key, cfg.ratio), self.betas.get(key, cfg.beta)
        gap = (cosine - cfg.target_cosine) / cfg.target_cosine
        if gap >= 0:
            ratio = min(ratio * 2, cfg.max_ratio)
        else:
            ratio = max(ratio // 2, cfg.min_ratio)
        self.ratios[key] = ratio
        self.betas[key] = min(max(beta * (1 + 0.05 * max(-1.0, min(1.0, gap))), 0.90), 0.99)

    def adapt_round(self, key: str) -> bool:
        """Whether the round about to run for `key` is one where G-SEPARATE measures the cosine."""
        return self.cfg.method == "g-separate" and (self.feedback.round(key) + 1) % self.cfg.adapt_interval == 0

    def exact_round(self, key: str) -> bool:
        """Whether the round about to run for `key` is one of its first `warmup_rounds`, reduced exactly:
        if so it is counted here (compress() is not called for it), and nothing is lost, so the error
        stays zero."""
        if self.feedback.round(key) >= self.cfg.warmup_rounds:
            return False
        self.feedback.count_exact(key)
        return True

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """By "<key>.<name>": error, round, and under G-SEPARATE ratio and beta."""
        out = self.feedback.state_dict()
        for key in self.ratios:
            out[f"{key}.ratio"] = torch.tensor(self.ratios[key], dtype=torch.int64)
            out[f"{key}.beta"] = torch.tensor(self.betas[key], dtype=torch.float64)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        names = {"round", "error", "ratio", "beta"}
        bad = [k for k in state if k.rpartition(".")[2] not in names]
        if bad:
            raise ValueError(f"SEPARATE cannot load compressor state {bad[:4]}: expected <key>.{sorted(names)}")
        self.feedback.load_state_dict(state, self.device)
        self.ratios, self.betas = {}, {}
        for name, value in state.items():
            key, _, what = name.rpartition(".")
            if what == "ratio":
                self.ratios[key] = int(value)
            elif what == "beta":
                self.betas[key] = float(value)

    def error_bytes(self) -> int:
        return self.feedback.error_bytes()


class ProjectedReduce(GradientReducer):
    """SEPARATE's reduce, for ZeRO and DDP alike: the gradient is projected blockwise, the
    projections are summed over the DP ranks and each rank reconstructs what it keeps.

    reduce()      ZeRO: the unit's gradient as `world` shard rows; the projections are
                  reduce-scattered (in the communication dtype, or by qgZ) and each rank adds
                  the reconstruction of its own shard.
    all_reduce()  DDP's comm hook: a bucket is one row; its projections are all-reduced (in the
                  bucket's dtype) and every rank reconstructs the whole bucket.
    G-SEPARATE's measuring rounds also reduce the exact gradient and measure the cosine between
    it and the reconstruction, which adapts the unit's ratio and beta. The first `warmup_rounds`
    of each unit (bucket) are the runtime's own exact reduce instead: `warmup_reduce` under ZeRO,
    DDP's plain all-reduce hook (its hook asks `compressor.exact_round` before calling all_reduce)."""

    stateful = True

    def __init__(self, comm: Comm, compressor: Separate, wire_dtype: torch.dtype, timings: Timings,
                 qgz: GradientReducer | None = None, warmup_reduce: GradientReducer | None = None):
        self.comm, self.compressor, self.wire_dtype, self.timings = comm, compressor, wire_dtype, timings
        self.qgz = qgz  # zeropp.qgz.QuantizedReduce: when set, the projections go through it instead
        self.warmup_reduce = warmup_reduce  # ZeRO: the runtime's own reducer, for reduce()'s warm-up rounds
        self.cosines: dict[str, float] = {}  # G-SEPARATE: each unit's (bucket's) last measured cosine
        self.layouts: dict[str, tuple[int, int] | None] = {}  # unit -> its last round's (b, m); None: exact
        self.notes: list[str] = []  # G-SEPARATE's adaptations, for the log (take_notes)

    def reduce(self, unit, shard, grad, async_op):
        if self.compressor.exact_round(unit):  # warm-up: the runtime's own reduce (qgZ's, or the reduce-scatter)
            self.layouts[unit] = None
            return self.warmup_reduce.reduce(unit, shard, grad, async_op)
        world, rank = self.comm.mesh.size("dp"), self.comm.mesh.group_rank("dp")
        exact = exact_work = None
        if self.compressor.adapt_round(unit):  # the raw gradient's exact mean, before e is added
            exact = torch.zeros_like(shard)
            exact_work = self.comm.reduce_scatter(exact, grad.to(self.wire_dtype), tag=TAG + " (exact, G-SEPARATE)",
                                                  async_op=True, accumulate=True)
        with self.timings.timer("gradient compression"):
            rnd = self.compressor.compress(unit, grad.view(world, -1))
        per_chunk = rnd.projections.shape[1]
        self.layouts[unit] = (rnd.block, rnd.directions)
        if self.qgz is None:
            summed = torch.zeros(per_chunk, device=shard.device)
            work = self.comm.reduce_scatter(summed, rnd.projections.to(self.wire_dtype).reshape(-1), tag=TAG,
                                            async_op=True, accumulate=True)
        else:  # qgZ needs whole quantization blocks (per stage) in every chunk: pad the projections
            align = self.qgz.block_size * self.qgz.stages
            padded = torch.zeros(world, -(-per_chunk // align) * align, device=shard.device)
            padded[:, :per_chunk] = rnd.projections
            summed_padded = torch.zeros(padded.shape[1], device=shard.device)
            work = self.qgz.reduce(unit, summed_padded, padded.reshape(-1), async_op=True)
            summed = summed_padded[:per_chunk]

        def finish():
            work.wait()
            with self.timings.timer("gradient compression"):
                estimate = self.compressor.decompress(rnd, summed, rank)
            shard.add_(estimate)
            if exact is not None:
                exact_work.wait()
                self._adapt(unit, estimate, exact, sharded=True)

        if async_op:
            return CallbackWork(finish)
        finish()
        return None

    def all_reduce(self, key: str, buffer: torch.Tensor) -> torch.futures.Future:
        """DDP: replace `buffer` (a whole bucket, already divided) by the reconstruction of its sum
        over the ranks; returns the future DDP's comm hook hands back."""
        exact = exact_work = None
        if self.compressor.adapt_round(key):
            exact = buffer.clone()
            exact_work = self.comm.all_reduce(exact, tag=TAG + " (exact, G-SEPARATE)", async_op=True)
        with self.timings.timer("gradient compression"):
            rnd = self.compressor.compress(key, buffer.view(1, -1))
        summed = rnd.projections.to(buffer.dtype).reshape(-1)
        works = [self.comm.all_reduce(summed, tag=TAG, async_op=True)]
        works += [exact_work] if exact_work is not None else []

        def finish(_):  # runs on the backend's thread: not timed (Timings is per calling thread)
            estimate = self.compressor.decompress(rnd, summed, 0)
            if exact is not None:
                self._adapt(key, estimate, exact, sharded=False)
            return buffer.copy_(estimate)
        return torch.futures.collect_all([w.get_future() for w in works]).then(finish)

    def _adapt(self, key: str, estimate: torch.Tensor, exact: torch.Tensor, sharded: bool) -> None:
        """G-SEPARATE: the cosine between the reconstruction and the exact sum; over the shards
        (one all-reduce of three sums) when each rank holds one shard of them."""
        sums = torch.stack([(estimate * exact).sum(), estimate.square().sum(), exact.square().sum()]).double()
        if sharded:
            self.comm.all_reduce(sums, tag="G-SEPARATE cosine")
        cosine = float(sums[0] / (sums[1].sqrt() * sums[2].sqrt()).clamp_min(1e-30))
        self.cosines[key] = cosine
        self.compressor.adapt(key, cosine)
        self.notes.append(f"G-SEPARATE {key}: cosine {cosine:.3f} -> ratio {self.compressor.ratios[key]}, "
                          f"beta {self.compressor.betas[key]:.4f} (round {self.compressor.feedback.round(key)})")

    def variance(self, unit: str, squares: torch.Tensor) -> torch.Tensor:
        """Per element of this rank's reduced (and clipped) gradient shard of `unit`, given its squares, the
        variance its reconstruction added, estimated from the norm of the element's block (`unit`'s last
        round was projected: it has a layout)."""
        block, m = self.layouts[unit]
        padded = torch.nn.functional.pad(squares, (0, -squares.numel() % block))
        per_block = padded.view(-1, block).sum(1).mul_(self.compressor.variance_per_norm(block, m))
        return per_block.repeat_interleave(block)[:squares.numel()]

    def correct_second_moment(self, optimizer: torch.optim.Optimizer, units) -> None:
        """variance_correction, as an optimizer step pre-hook. Adam's second moment averages g², which
        here holds the projection's variance Var[g] too (about CR times the signal's), so every step
        shrinks; instead it is made
            v <- max(β2 v + (1 - β2) (g² - Var[g]),  (1 - β1) / (1 + β1) Var[g])
        an average of the variance-free square, never below the share of Var[g] that Adam's first
        moment still carries (its stationary variance). v is shifted beforehand so that torch's own
        update v <- β2 v + (1 - β2) g² lands there: its kernels (for-loop, fused, on the host when
        offloaded) run unchanged. An element without state yet (its first step) keeps g²."""
        betas = {id(p): group["betas"] for group in optimizer.param_groups for p in group["params"]}
        for u in units:
            if not u.trainable or self.layouts.get(u.name) is None:
                continue  # frozen, or its last round was exact
            squares = u.grad_shard.square()
            variance = self.variance(u.name, squares)
            base = u.grad_shard.storage_offset()
            for _, piece, view in u.params:
                state = optimizer.state.get(piece)
                if not state or piece.grad is None:
                    continue
                if "exp_avg_sq" not in state:
                    raise TypeError(f"gradient_compression.variance_correction corrects Adam's second moment, but "
                                    f"{type(optimizer).__name__} keeps no exp_avg_sq: use torch's Adam/AdamW or set "
                                    f"zero_optimization.gradient_compression.variance_correction false")
                start = view.storage_offset() - base
                window = slice(start, start + view.numel())
                b1, b2 = betas[id(piece)]
                v, var = state["exp_avg_sq"], variance[window]
                plain = squares[window].mul_(1 - b2)  # what torch's update adds to β2 v
                wanted = torch.maximum(v * b2 + plain - var * (1 - b2), var * ((1 - b1) / (1 + b1)))
                v.copy_(wanted.sub_(plain).div_(b2))

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.compressor.load_state_dict(state)

    def describe(self) -> str:
        if self.qgz is not None:
            return f"projections over {self.qgz.describe()}"
        return f"a reduce-scatter of projections ({str(self.wire_dtype).replace('torch.', '')})"
