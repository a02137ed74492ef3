"""DiLoCo's outer loop (arXiv 2311.08105) over any of our runtimes: the runtime inside a site, an
outer optimizer across sites.

The runtime is built on its site's ranks only (`build_runtime(..., site_size=...)`: every group of
its mesh lives inside the site), so each site trains its own replica and crosses no slow link.
Every `inner_steps` (H) steps the outer step runs on this rank's share of the fp32 weights
(ZeRO-3: its master shard; DDP, which replicates them: chunk `rank` of the site's ranks):

    delta    = anchor - weights             this site's pseudo-gradient (anchor: the last sync)
    delta    = mean over sites (delta)      all-reduce over the `cross_site` group: the ranks at
                                            this rank's place in every site: each rank sends
                                            only its share
    momentum = mu * momentum + delta        outer SGD, Nesterov as torch.optim.SGD
    anchor  -= lr * (delta + mu * momentum) (nesterov; else lr * momentum)
    weights  = anchor                       (DDP: the chunks all-gathered inside the site)

The outer state (anchor, momentum, and the error feedback's residual) is flat fp32 over the same
elements, so it is sharded like ZeRO-3's inner state; the inner optimizer's state is kept.
Writing the weights in place bumps their version counter: the runtime's derived copies (ZeRO's
wire, hpZ's secondary, qwZ's delta references) are re-encoded by the same refresh an optimizer
step or a checkpoint load triggers. With `compression` the pseudo-gradient plus the residual is
quantized blockwise (kernels), the residual keeps what the codes lost, and the sites all-gather
the codes and scales; every site decodes them in the same order, so all end with equal weights.

Streaming DiLoCo (arXiv 2501.18512, `fragments` F > 1): the outer state is cut into F contiguous
equal ranges, and fragment f takes the step above alone (its slice of the anchor, momentum and
residual; the other weights stay as the inner steps left them) after the steps where
(step - f * H // F) % H == 0. Each element still syncs once per H steps; a sync sends 1/F of it.
With `mixing` alpha > 0 (the same paper) the synced weights keep alpha of their local values.
With `delay` tau > 0 (the paper's overlap) a fragment's exchange is sent after its sync step and
waited for only after step + tau: the collectives run while the next tau inner steps compute, and
the outer result is mixed into the weights as those steps left them. A sync reads and writes only
its fragment's range of the parameters (no flat copy of the model).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from kernels import dequantize, num_blocks, packed_bytes, quantize
from zeropp.checkpoint import FULL, CheckpointError, write_safetensors
from zeropp.config import DilocoConfig
from zeropp.runtime import Runtime

OUTER_TAG = "diloco outer"  # the ledger's tag of the outer exchange


def site_dir(directory: str | Path, site: int) -> Path:
    """Where a site's runtime writes its checkpoint files (sites hold different weights mid-cycle)."""
    return Path(directory) / f"site{site:03d}"


def outer_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"diloco_rank{rank:05d}.safetensors"


def fragment_schedule(inner_steps: int, fragments: int) -> dict[int, int]:
    """step % H -> the fragment synced after that step: Streaming DiLoCo's offsets f * H // F, spread
    evenly over the cycle (F = 1: every H steps, DiLoCo's)."""
    return {f * inner_steps // fragments: f for f in range(fragments)}


def fragment_size(numel: int, parts: int, fragments: int) -> int:
    """Elements of one fragment of one rank's share: the `numel` weights padded to parts x fragments
    equal pieces (an awkward size pads; it is never refused)."""
    return -(-numel // (parts * fragments))


class _Exchange:
    """One fragment's exchange in flight: its collectives' handles, and how their result becomes the
    pseudo-gradient averaged over the sites."""

    def __init__(self, fragment: int, due: int, works: list, finish):
        self.fragment, self.due = fragment, due
        self._works, self._finish, self._mean = works, finish, None

    def result(self) -> torch.Tensor:
        """The averaged pseudo-gradient (waits for the collectives the first time)."""
        if self._mean is None:
            for work in self._works:
                work.wait()
            self._mean = self._finish()
        return self._mean


class DiLoCo:
    """The outer optimizer across sites, over the weights `runtime`'s inner optimizer steps."""

    def __init__(self, runtime: Runtime, config: DilocoConfig):
        self.runtime, self.config, self.comm = runtime, config, runtime.comm
        self.mesh = runtime.mesh
        self.params = [p for p in runtime.module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        # A replicated runtime (DDP) holds the whole model on every rank of the site: the outer step
        # is sharded over them anyway (the weights padded to equal chunks, chunk `rank` here), so the
        # site sends each element across once and gathers the new weights inside the site.
        self.parts = self.mesh.world_size if runtime.checkpoint_format == FULL else 1
        # Streaming DiLoCo's fragments: contiguous equal ranges of this rank's share (padded to F of
        # them), so every sync sends exactly 1/F of it (docs/diloco.md, "Streaming DiLoCo").
        self.fragment = fragment_size(numel, self.parts, config.fragments)
        self.chunk = self.fragment * config.fragments
        self.syncs = fragment_schedule(config.inner_steps, config.fragments)
        self.starts = [0, *itertools.accumulate(p.numel() for p in self.params)][:-1]
        self.device = self.params[0].device
        self.anchor = self._read(self._range(0), self._range(0) + self.chunk)  # the weights at the last sync
        self.momentum = torch.zeros_like(self.anchor)
        self.residual = torch.zeros_like(self.anchor) if config.bits else None  # what the codes lost
        self.in_flight: list[_Exchange] = []  # sent, in order, applied when due

    def _pieces(self, lo: int, hi: int):
        """(parameter, first, last, position) for each parameter overlapping the flat range [lo, hi):
        its elements [first, last) are the range's [position, position + last - first)."""
        for p, start in zip(self.params, self.starts):
            first, last = max(lo, start), min(hi, start + p.numel())
            if first < last:
                yield p, first - start, last - start, first - lo

    def _read(self, lo: int, hi: int) -> torch.Tensor:
        """The flat fp32 weights [lo, hi) (past the last parameter: the padding, zeros), only the
        parameters the range touches."""
        out = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
        for p, first, last, at in self._pieces(lo, hi):
            out[at:at + last - first] = p.detach().reshape(-1)[first:last]
        return out

    def _write(self, lo: int, values: torch.Tensor) -> None:
        """Set the flat weights from `lo` on, in place (their version bumps: the runtime re-encodes
        what it derives from them)."""
        for p, first, last, at in self._pieces(lo, lo + values.numel()):
            p.detach().view(-1)[first:last].copy_(values[at:at + last - first])

    def _range(self, fragment: int, chunk: int | None = None) -> int:
        """Where a fragment of chunk `chunk` (default: this rank's share) starts in the flat weights."""
        chunk = (self.mesh.rank if self.parts > 1 else 0) if chunk is None else chunk
        return chunk * self.chunk + fragment * self.fragment

    def after_inner_step(self, step: int) -> None:
        """Called after inner step `step` (1-based, the trainer's count): sends the exchange of the
        fragment whose turn it is, if any, then applies every exchange due now (`delay` steps after
        it was sent: at once when 0)."""
        fragment = self.syncs.get(step % self.config.inner_steps)
        if fragment is not None:
            self.in_flight.append(self._send(fragment, due=step + self.config.delay))
        while self.in_flight and self.in_flight[0].due <= step:  # sent in order, due in order
            self._apply(self.in_flight.pop(0))

    @torch.no_grad()
    def outer_step(self, fragment: int = 0) -> None:
        """The outer step on one fragment's slice of the outer state, at once; the other weights stay local."""
        self._apply(self._send(fragment, due=0))

    @torch.no_grad()
    def _send(self, fragment: int, due: int) -> _Exchange:
        """Start averaging this fragment's pseudo-gradient (anchor - weights) over the sites: an
        all-reduce in fp32, or the codes' all-gather (error feedback: the residual keeps what the
        codes lost)."""
        part = slice(fragment * self.fragment, (fragment + 1) * self.fragment)
        lo = self._range(fragment)
        delta = self.anchor[part] - self._read(lo, lo + self.fragment)
        n, bits, block = self.mesh.sites, self.config.bits, self.config.compression_block_size
        if bits is None:
            work = self.comm.all_reduce(delta, group="cross_site", tag=OUTER_TAG, async_op=True)
            return _Exchange(fragment, due, [work], lambda: delta.div_(n))
        residual = self.residual[part]
        sent = delta.add_(residual)
        codes = quantize(sent, bits, block)
        residual.copy_(sent).sub_(codes.dequantize())
        all_codes = torch.empty(n * codes.codes.numel(), dtype=torch.uint8, device=delta.device)
        all_scales = torch.empty(n * codes.scales.numel(), dtype=codes.scales.dtype, device=delta.device)
        works = [self.comm.all_gather(all_codes, codes.codes, group="cross_site", tag=OUTER_TAG, async_op=True),
                 self.comm.all_gather(all_scales, codes.scales, group="cross_site", tag=OUTER_TAG, async_op=True)]

        def mean() -> torch.Tensor:
            total = torch.zeros_like(delta)
            for c, s in zip(all_codes.view(n, -1), all_scales.view(n, -1)):  # site order: every site sums alike
                dequantize(c, s, delta.numel(), bits, block, out=total, accumulate=True)
            return total.div_(n)
        return _Exchange(fragment, due, works, mean)

    @torch.no_grad()
    def _apply(self, exchange: _Exchange) -> None:
        """The outer Nesterov step on the averaged pseudo-gradient, and the fragment's weights set to
        the new anchor (mixing: keeping alpha of the local ones, which may have moved on since the send)."""
        cfg, fragment = self.config, exchange.fragment
        part = slice(fragment * self.fragment, (fragment + 1) * self.fragment)
        delta, anchor, momentum = exchange.result(), self.anchor[part], self.momentum[part]
        if cfg.outer_momentum:
            momentum.mul_(cfg.outer_momentum).add_(delta)
            delta = delta.add_(momentum, alpha=cfg.outer_momentum) if cfg.nesterov else momentum
        anchor.sub_(delta, alpha=cfg.outer_lr)
        new = anchor.view(1, -1)
        if self.parts > 1:  # every rank of the site gets every chunk's slice
            new = torch.empty(self.parts, self.fragment, dtype=anchor.dtype, device=anchor.device)
            self.comm.all_gather(new.view(-1), anchor, tag=OUTER_TAG)
        for chunk, values in enumerate(new):
            lo = self._range(fragment, chunk)
            if cfg.mixing:  # alpha local + (1 - alpha) new
                values = values.lerp(self._read(lo, lo + self.fragment), cfg.mixing)
            self._write(lo, values)

    def settle(self) -> None:
        """Wait for the exchanges in flight; their results stay pending until they are due."""
        for exchange in self.in_flight:
            exchange.result()

    def predicted_step_bytes(self) -> dict[str, dict[str, int]]:
        """The outer exchange's bytes this rank sends, amortized over the H inner steps of a cycle (F
        syncs of a fragment each)."""
        numel, bits = self.fragment, self.config.bits
        if bits is None:  # a ring all-reduce
            sent, cross_sent = self.comm.all_reduce_volume(4 * numel, "cross_site")
        else:  # the codes and scales all-gathered
            block = self.config.compression_block_size
            sent, cross_sent = self.comm.volume(packed_bytes(numel, bits, block) + 4 * num_blocks(numel, block),
                                                "cross_site")
        if self.parts > 1:  # the new weights gathered inside the site
            inside, inside_cross = self.comm.volume(4 * numel)
            sent, cross_sent = sent + inside, cross_sent + inside_cross
        f, h = self.config.fragments, self.config.inner_steps
        return {OUTER_TAG: {"sent": f * sent // h, "cross_node_sent": f * cross_sent // h}}

    def describe(self) -> str:
        m = self.mesh
        return f"DiLoCo on: {m.sites} sites x {m.world_size * m.tp_size} ranks, {self.config.describe()}"

    def state_bytes(self) -> int:
        """This rank's outer state: the anchor, the momentum and the residual of its share (fp32)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"anchor": self.anchor, "momentum": self.momentum}
        return state if self.residual is None else {**state, "residual": self.residual}

    def save(self, directory: str | Path, optimizer: torch.optim.Optimizer) -> None:
        """The site's runtime into its own subdirectory, and this rank's outer state beside it."""
        inner = site_dir(directory, self.mesh.site)
        inner.mkdir(exist_ok=True)
        self.runtime.save(inner, optimizer)
        state = dict(self.state_dict())
        if self.in_flight:  # their results (the collectives are waited for), applied when due after a resume
            self.settle()
            state["in_flight"] = torch.tensor([[e.fragment, e.due] for e in self.in_flight])
            state["in_flight_mean"] = torch.stack([e.result() for e in self.in_flight])
        write_safetensors({k: v.detach().cpu().contiguous() for k, v in state.items()},
                          outer_file(directory, dist.get_rank()))

    def load(self, directory: str | Path, optimizer: torch.optim.Optimizer) -> None:
        self.runtime.load(site_dir(directory, self.mesh.site), optimizer)
        path = outer_file(directory, dist.get_rank())
        saved = load_file(str(path)) if path.is_file() else {}
        for key, tensor in self.state_dict().items():
            if key == "residual" and key not in saved:  # saved without compression: none yet
                tensor.zero_()
                continue
            if key not in saved or saved[key].shape != tensor.shape:
                raise CheckpointError(f"{path}: no DiLoCo {key} of {tensor.numel()} elements for this rank; "
                                      f"resume with the sites, site_size, fragments and runtime it was saved with")
            tensor.copy_(saved[key])
        if "in_flight" in saved and saved["in_flight_mean"].shape[1:] != (self.fragment,):
            raise CheckpointError(f"{path}: its exchanges in flight hold {saved['in_flight_mean'].shape[1]} elements "
                                  f"each, this run's fragments {self.fragment}; resume with the fragments it was saved with")
        self.in_flight = [_Exchange(int(fragment), int(due), [], lambda mean=mean.to(self.device): mean)
                          for (fragment, due), mean in zip(saved.get("in_flight", []), saved.get("in_flight_mean", []))]
