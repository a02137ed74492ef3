"""A rollout's weights: the whole model gathered once for the no-grad forwards of generation.

`Zero3Engine.inference_weights(max_bytes)` (the Runtime interface; rlhf.generation runs its
decode loop inside it) makes a `Rollout` of the engine's units. On entry every unit is
all-gathered once from its primary shards, in the wire format the training forward sends (qwZ
codes + scales with qwZ; ledger tag "rollout gather"): the embeddings and norms into their own
buffers (skipped when they already hold the current weights), each block that fits `max_bytes`
(in model order) into an inference copy of its own (`Unit.inference`, the compute dtype; a
gather prefetched when the optimizer stepped is decoded and kept, not sent again), and
the modules' attributes become those full weights, so the forwards inside run no collective.
Blocks past `max_bytes` go through the rotating training buffers as in training instead
(gathered where a buffer no longer holds them; `InferenceWeights.collectives_per_forward`).
A forward inside whose weights were edited (an in-place change under no_grad) renews their
copies first. On exit the copies go; training goes on bit for bit as if no rollout happened.
"""

from __future__ import annotations

import math

import torch

from zeropp.runtime import InferenceWeights
from zeropp.unit import Phase, Unit, UnitState


class Rollout:
    """The blocks a rollout holds whole (`held`) and what it tells the caller (`info`)."""

    def __init__(self, engine, max_bytes: int | None):
        """Which blocks are held: in model order, while they fit `max_bytes` of the compute dtype
        (a block's units are held or streamed together); the rest are streamed."""
        self.engine = engine
        itemsize = torch.empty((), dtype=engine.param_dtype).element_size()
        budget = math.inf if max_bytes is None else max_bytes
        self.held: list[Unit] = []
        streamed, used = [], 0
        for group in engine.block_groups:
            cost = sum(u.padded_numel for u in group) * itemsize
            if not streamed and used + cost <= budget:
                self.held += group
                used += cost
            else:
                streamed += group
        self.info = InferenceWeights(bytes=used, resident_units=len(engine.resident) + len(self.held),
                                     streamed_units=len(streamed), collectives_per_forward=bool(streamed))

    def keep_prefetched(self) -> None:
        """Before the training buffers are let go: the gathers issued when the optimizer stepped (the
        next forward's embeddings, norms and first blocks) are decoded for the rollout, not dropped
        and sent again; a held block's weights are copied from its training buffer into its copy."""
        engine = self.engine
        for u in engine.resident + self.held:
            with engine.timings.timer("weight encode"):
                u.refresh()  # weights edited since: that gather is stale, and refresh drops it
            if u.state is UnitState.GATHERING:
                u.decode(engine.comm, Phase.ROLLOUT, engine.timings)
                if u in self.held:
                    u.keep_inference_copy(engine.pool.new(u.padded_numel, engine.param_dtype))

    def gather(self) -> InferenceWeights:
        """Re-encode what changed, gather the embeddings and norms and every held block (the
        training buffers were let go: a held block never takes one, so nothing releases its
        copy's binding while the rollout runs), and bind them."""
        engine = self.engine
        with engine.timings.timer("weight encode"):
            for u in engine.units.values():
                u.refresh()
        engine._ensure_gathered(engine.resident)
        for u in self.held:
            if u.inference is None:  # else kept from a prefetch (keep_prefetched)
                u.hold_inference_copy(None, engine.pool.new(u.padded_numel, engine.param_dtype))
        self._gather_copies([u for u in self.held if not u.holds_current()])
        for u in engine.resident + self.held:  # the modules' attributes are the full weights from now on
            u.bind(False, engine._reduce)
        return self.info

    def renew(self) -> None:
        """Before a forward inside: gather again the held blocks whose weights were edited."""
        self._gather_copies(self.engine._due(self.held))

    def _gather_copies(self, units: list[Unit]) -> None:
        """Gather units into their inference copies: one all-gather each, the next one issued
        before the previous is decoded; the gathered bytes go once decoded."""
        engine = self.engine

        def issue(u: Unit) -> None:
            _, compute = u.inference
            gather = compute if u.decodes_in_place(engine.comm, engine.param_dtype) else \
                engine.pool.new(u.gathered_numel, u.codec.dtype)
            u.hold_inference_copy(gather, compute)
            u.gather(engine.comm, Phase.ROLLOUT, async_op=True)

        for i, u in enumerate(units):
            if u.state is UnitState.SHARDED:
                issue(u)
            if i + 1 < len(units):
                issue(units[i + 1])
            u.decode(engine.comm, Phase.ROLLOUT, engine.timings)
            u.drop_gathered_bytes()

    def drop(self) -> None:
        """Free the copies: the held blocks go back to the shared buffers (gathered when next used)."""
        for u in self.held:
            u.drop_inference_copy()
