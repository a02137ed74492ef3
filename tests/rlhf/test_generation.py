"""Rollouts on the runtimes (rlhf.generation): the weights are gathered once per rollout, generation
under ZeRO-3 / ZeRO++ equals one process generating with the same weights, ranks of very different
lengths finish together without hanging, and training after a rollout is bit-exact."""

import weakref

import pytest
import torch

from kernels import dequantize, quantize_weights
from models.config import ModelConfig
from models.generate import generate
from models.transformer import Transformer, lm_loss
from rlhf.generation import generate_rollouts
from tests.zeropp.test_engine import OPTIM
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from zeropp.config import ZeroConfig
from zeropp.ddp import DDPRuntime
from zeropp.engine import Zero3Engine

CFG = ModelConfig.from_preset("llama-tiny", vocab_size=64, n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=64)
PAD, EOS = 0, 21
# Each rank's prompts (2 nodes x 2 ranks). Greedy with EOS 21: rank 0's rows sample EOS first, rank
# 1's after 6 and 40 tokens, rank 2's after 8 and 26, rank 3's after 28 and 46 (asserted on the reference).
PROMPTS = [
    [[43, 14, 6, 32, 22], [44, 45, 33, 37]],
    [[56, 45, 16, 3, 23], [45, 54, 60, 63, 17]],
    [[45, 46, 52, 61, 34, 42], [15, 6, 44, 7, 31]],
    [[14, 16, 54, 3], [18, 55, 34]],
]
ZERO3 = ZeroConfig(stage=3, communication_data_type="fp32", ranks_per_node=2)
BLOCK = 32
ZEROPP = ZeroConfig(stage=3, ranks_per_node=2, zero_quantized_weights=True, zero_quantization_block_size=BLOCK,
                    zero_hpz_partition_size=2, zero_quantized_gradients=True)
TIMEOUT = 120


def make_model() -> Transformer:
    """A small LLaMA-style model with weights scaled up (std 0.2), so greedy decoding varies."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


NAMES = list(make_model().state_dict())


def plain_model(weights: dict[str, torch.Tensor]) -> Transformer:
    model = make_model()
    model.load_state_dict(weights)
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 13), generator=torch.Generator().manual_seed(10 + step))


def train_step(engine, rank: int, step: int) -> tuple[float, list[torch.Tensor]]:
    """Forward + backward on this rank's rows; the loss and every registered piece's gradient."""
    tokens = batch(step) + rank
    tokens %= CFG.vocab_size
    loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
    engine.backward(loss)
    return loss.item(), [p.grad.clone() for p in engine.module.parameters()]


def bound_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """What the modules' attributes are now (inside inference_weights: the full gathered weights)."""
    out = {}
    for name in NAMES:
        obj = model
        for part in name.split("."):
            obj = getattr(obj, part)
        out[name] = obj.detach().clone()
    return out


def as_dict(r) -> dict:
    return {"responses": r.responses, "logprobs": r.logprobs, "steps": r.steps, "bytes": r.inference_bytes,
            "new_tokens": r.new_tokens}


def block_bytes(engine: Zero3Engine) -> int:
    return sum(u.padded_numel for u in engine.block_groups[0]) * 4  # fp32 compute


def reference(weights: dict[str, torch.Tensor], max_new_tokens: int, **kw) -> list[dict]:
    """One process, the plain model on the default runtime: each rank's prompts as one batch."""
    runtime = DDPRuntime(plain_model(weights))
    out = []
    for rank, prompts in enumerate(PROMPTS):
        gen = torch.Generator().manual_seed(100 + rank) if kw.get("temperature", 0.0) > 0 else None
        out.append(as_dict(generate_rollouts(runtime, prompts, max_new_tokens, eos_token_id=EOS, pad_token_id=PAD,
                                             generator=gen, **kw)))
    return out


def assert_same(got: dict, ref: dict):
    assert got["responses"] == ref["responses"]
    for a, b in zip(got["logprobs"], ref["logprobs"]):
        assert len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)


# ---------------------------------------------------------------------------- ZeRO-3 (fp32 wire)

def _zero3(rank, world):
    engine = Zero3Engine(make_model(), ZERO3)
    fresh = Zero3Engine(make_model(), ZERO3)  # the same training, never generating
    opt, fresh_opt = (e.attach_optimizer(build_optimizer(e.module, OPTIM)) for e in (engine, fresh))
    prompts = PROMPTS[rank]
    out = {}
    engine.ledger.reset()
    out["greedy"] = as_dict(generate_rollouts(engine, prompts, 12, temperature=0.0, eos_token_id=EOS,
                                              pad_token_id=PAD))
    out["greedy_ledger"] = engine.ledger.totals()
    out["sampled"] = as_dict(generate_rollouts(engine, prompts, 12, temperature=1.0, top_k=20, eos_token_id=EOS,
                                               pad_token_id=PAD, generator=torch.Generator().manual_seed(100 + rank)))
    one_block = block_bytes(engine)
    engine.ledger.reset()
    out["streamed"] = as_dict(generate_rollouts(engine, prompts, 200, temperature=0.0, eos_token_id=EOS,
                                                pad_token_id=PAD, max_bytes=one_block))
    out["streamed_ledger"] = engine.ledger.totals()
    with engine.inference_weights(max_bytes=one_block) as info:
        out["streamed_info"] = vars(info).copy()
    with engine.inference_weights() as info:
        out["full_info"] = vars(info).copy()
        out["bound_full_weights"] = all(torch.equal(w, make_model().state_dict()[k])
                                        for k, w in bound_weights(engine.module).items())
        copy = weakref.ref(engine.units["blocks.0"].inference[1])
        with pytest.raises(RuntimeError, match="no_grad"):
            engine(batch(0)[:, :-1])
    out["copy_freed"] = copy() is None
    out["pieces_back"] = all(engine.module.blocks[i].attn.q_proj.weight.dim() == 1 for i in range(CFG.n_layer))

    # Training after rollouts: bit for bit the engine that never generated, step after step.
    out["losses"], out["grads"], out["fresh_losses"], out["fresh_grads"] = [], [], [], []
    for step in range(2):
        if step == 1:  # a rollout after an optimizer step: the copy is re-encoded and re-gathered
            out["after_step"] = as_dict(generate_rollouts(engine, prompts, 12, temperature=0.0, eos_token_id=EOS,
                                                          pad_token_id=PAD, max_bytes=one_block))
            state = engine.full_state_dict()  # every rank takes part
            out["state_after_step"] = state if rank == 0 else None
        for e, o, key in ((engine, opt, ""), (fresh, fresh_opt, "fresh_")):
            loss, grads = train_step(e, rank, step)
            out[key + "losses"].append(loss)
            out[key + "grads"].append(grads)
            o.step()
            o.zero_grad()
    engine.close()
    fresh.close()
    return out


@pytest.fixture(scope="module")
def initial_weights():
    return make_model().state_dict()


def test_zero3_greedy_and_sampled_rollouts_equal_one_process(zero3_results, initial_weights):
    """ZeRO-3 on 2 x 2 ranks, each rank its own prompts: greedy and seeded top-k sampling give the
    tokens one process gets with the plain model, the log-probs within 1e-5; the log-probs are the
    untempered policy's, as a trainer recomputes them from the full sequences; EOS ends a response
    and is its last token; without streamed blocks a rank stops on its own (rank 0 after 1 step)."""
    greedy = reference(initial_weights, 12, temperature=0.0)
    sampled = reference(initial_weights, 12, temperature=1.0, top_k=20)
    plain = plain_model(initial_weights)
    for rank, r in enumerate(zero3_results):
        assert_same(r["greedy"], greedy[rank])
        assert_same(r["sampled"], sampled[rank])
        expected = generate(plain, PROMPTS[rank], 12, eos_token_id=EOS)  # models.generate drops the EOS
        assert [row[:-1] if row[-1:] == [EOS] else row for row in r["greedy"]["responses"]] == expected
        assert r["greedy"]["steps"] == max(len(row) for row in r["greedy"]["responses"])
        assert r["greedy"]["new_tokens"] == sum(len(row) for row in r["greedy"]["responses"])
        for prompt, response, logps in zip(PROMPTS[rank], r["sampled"]["responses"], r["sampled"]["logprobs"]):
            tokens = torch.tensor([prompt + response])
            with torch.no_grad():
                recomputed = torch.log_softmax(plain(tokens)[0, len(prompt) - 1:-1], dim=-1)
            recomputed = recomputed.gather(-1, tokens[0, len(prompt):, None])[:, 0]
            assert torch.allclose(recomputed, torch.tensor(logps), atol=1e-5)
    assert zero3_results[0]["greedy"]["responses"] == [[EOS], [EOS]] and zero3_results[0]["greedy"]["steps"] == 1
    assert zero3_results[3]["greedy"]["steps"] == 12
    # The copy: gathered once (5 units: embeddings, norms, 3 blocks), nothing while decoding.
    for r in zero3_results:
        assert r["greedy_ledger"].keys() == {"rollout gather"} and r["greedy_ledger"]["rollout gather"]["calls"] == 5
        assert r["full_info"]["collectives_per_forward"] is False and r["full_info"]["streamed_units"] == 0
        assert r["full_info"]["resident_units"] == 5 and r["full_info"]["bytes"] == r["greedy"]["bytes"] > 0
        assert r["bound_full_weights"] and r["copy_freed"] and r["pieces_back"]


def test_streamed_blocks_and_uneven_ranks_finish_together(zero3_results, initial_weights):
    """max_bytes = one block: the other two go through the training buffers (gathered where a
    buffer no longer holds them), so the ranks step together.
    Rank 0's rows end at once, rank 3's last (46 tokens), max_new_tokens is 200: every rank finishes
    (no hang) after exactly the longest rank's steps, with the same outputs as one process."""
    ref = reference(initial_weights, 200, temperature=0.0)
    lengths = [max(len(row) for row in r["responses"]) for r in ref]
    assert lengths[0] == 1 and lengths[3] == max(lengths) < 200, lengths
    for rank, r in enumerate(zero3_results):
        assert_same(r["streamed"], ref[rank])
        assert r["streamed"]["steps"] == lengths[3]
        info = r["streamed_info"]
        assert info["collectives_per_forward"] and info["streamed_units"] == 2 and info["resident_units"] == 3
        assert info["bytes"] == r["streamed"]["bytes"] == r["full_info"]["bytes"] // 3
        # the held block once (the embeddings and norms still hold these weights), the 2 streamed
        # blocks once each: they sit in different ones of the 2 rotating training buffers, which
        # still hold them at every later forward (same weights), so nothing is gathered again
        assert r["streamed_ledger"]["rollout gather"]["calls"] == 1 + 2
        assert "forward gather" not in r["streamed_ledger"]
        # the ranks step together on one int32 flag a decode step, all-reduced over the 4 dp ranks
        # through the runtime's Comm (a ring all-reduce: 2 x 3/4 of its 4 bytes)
        flags = r["streamed_ledger"]["rollout stop flag"]
        assert flags["calls"] == lengths[3] and flags["dtypes"] == ["int32"]
        assert flags["sent"] == lengths[3] * (2 * 3 * 4 // 4)


def test_training_after_rollouts_is_bit_exact(zero3_results):
    """Rollouts (whole copy, streamed, after an optimizer step) leave training as it was: the
    losses and every gradient piece equal, bit for bit, those of an engine that never generated."""
    for r in zero3_results:
        assert r["losses"] == r["fresh_losses"]
        for grads, fresh in zip(r["grads"], r["fresh_grads"]):
            assert all(torch.equal(a, b) for a, b in zip(grads, fresh))
            assert any(g.numel() and g.abs().max() > 0 for g in grads)
    ref = reference(zero3_results[0]["state_after_step"], 12, temperature=0.0)
    for rank, r in enumerate(zero3_results):
        assert_same(r["after_step"], ref[rank])


# ---------------------------------------------------------------------------- ZeRO++ (qwZ + hpZ + qgZ)

def quantized_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What any qwZ engine computes with: each parameter quantized in blocks of BLOCK counted from
    its start, fp16 scales, dequantized (the engine aligns parameters and shards to whole blocks,
    so the blocks and hence the weights do not depend on the world size)."""
    out = {}
    for name, w in weights.items():
        n = w.numel()
        flat = torch.zeros(-(-n // BLOCK) * BLOCK)
        flat[:n] = w.reshape(-1).float()
        q = quantize_weights(flat, 8, BLOCK)
        out[name] = dequantize(q.codes, q.scales, flat.numel(), 8, BLOCK)[:n].view_as(w)
    return out


def _zeropp(rank, world):
    engine = Zero3Engine(make_model(), ZEROPP)
    fresh = Zero3Engine(make_model(), ZEROPP)
    opt, fresh_opt = (e.attach_optimizer(build_optimizer(e.module, OPTIM)) for e in (engine, fresh))
    prompts = PROMPTS[rank]
    out = {"wire": sum((world - 1) * u.wire.numel() for u in engine.units.values()),
           "bf16": sum((world - 1) * -(-u.numel // world) * 2 for u in engine.units.values())}
    engine.ledger.reset()
    out["short"] = as_dict(generate_rollouts(engine, prompts, 2, temperature=0.0, eos_token_id=EOS, pad_token_id=PAD))
    out["short_ledger"] = engine.ledger.totals()
    out["grads"], out["fresh_grads"] = [], []
    for step in range(2):
        for e, o, key in ((engine, opt, ""), (fresh, fresh_opt, "fresh_")):
            e.ledger.reset()
            out[key + "grads"].append(train_step(e, rank, step)[1])
            out[key + "step_ledger"] = e.ledger.totals()  # step 1's: after the rollout of new weights
            e.ledger.reset()
            o.step()  # issues the next forward's first gathers (prefetch across steps)
            o.zero_grad()
        if step == 0:  # new weights: the prefetch and the rollout gather every unit once
            out["long"] = as_dict(generate_rollouts(engine, prompts, 20, temperature=0.0, eos_token_id=EOS,
                                                    pad_token_id=PAD))
            out["long_ledger"] = engine.ledger.totals()
            with engine.inference_weights():
                out["gathered"] = bound_weights(engine.module) if rank == 0 else None
            snapshot = engine.rollout_weights()  # (rollouts sampled ahead; training after it checked below)
            out["snapshot"] = {name: snapshot[name] for name in NAMES} if rank == 0 else None
            state = engine.full_state_dict()
            out["state"] = state if rank == 0 else None
    engine.close()
    fresh.close()
    return out


def _both(rank, world):
    return {"zero3": _zero3(rank, world), "zeropp": _zeropp(rank, world)}


@pytest.fixture(scope="module")
def results():
    """Both runs in one set of 2 x 2 ranks (starting the ranks costs more than the runs)."""
    return run_ranks(_both, 4, ranks_per_node=2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def zero3_results(results):
    return [r["zero3"] for r in results]


def test_zeropp_rollout_gathers_qwz_codes_once_and_matches_one_process(results, initial_weights):
    """qwZ int8 + hpZ + qgZ on 2 x 2 ranks. The exact one-process reference is the plain model whose
    weights are quantized and dequantized as qwZ does: the engine's gathered weights equal that bit
    for bit (the blocks do not depend on the world size), and generation equals the plain model's
    on them. The rollout's gather moves qwZ's bytes (int8 codes + fp16 scales, about half of bf16)
    once per rollout: the same for 2 and for 20 new tokens, and no collective while decoding.
    Training around the rollouts stays bit-exact, and its forward gathers from the hpZ secondary
    that the rollout kept: nothing across nodes."""
    results = [r["zeropp"] for r in results]
    gathered, state = results[0]["gathered"], results[0]["state"]
    assert all(torch.equal(gathered[k], v) for k, v in quantized_weights(state).items())
    short = reference(quantized_weights(initial_weights), 2, temperature=0.0)
    long = reference(gathered, 20, temperature=0.0)
    for rank, r in enumerate(results):
        assert_same(r["short"], short[rank])
        assert_same(r["long"], long[rank])
        first, stepped = r["short_ledger"], r["long_ledger"]
        assert first.keys() == {"rollout gather"}
        assert first["rollout gather"]["calls"] == 5 and first["rollout gather"]["sent"] == r["wire"]
        # after an optimizer step the rollout keeps what the step prefetched (the embeddings and norms,
        # the first block): every unit's codes still travel exactly once
        assert stepped.keys() == {"forward gather", "rollout gather"}
        assert stepped["forward gather"]["calls"] >= 2 and stepped["rollout gather"]["calls"] >= 1
        assert sum(v["calls"] for v in stepped.values()) == 5 and sum(v["sent"] for v in stepped.values()) == r["wire"]
        assert all(v["dtypes"] == ["uint8"] for v in (*first.values(), *stepped.values()))
        assert 0.45 < r["wire"] / r["bf16"] < 0.6, (r["wire"], r["bf16"])
        for grads, fresh in zip(r["grads"], r["fresh_grads"]):
            assert all(torch.equal(a, b) for a, b in zip(grads, fresh))
        # the rollout kept the hpZ secondary: the training forward after it stays inside the node
        assert r["step_ledger"]["forward gather"]["cross_node_sent"] == 0
        assert r["fresh_step_ledger"]["forward gather"]["cross_node_sent"] > 0


def test_rollout_weights_copy_out_what_the_rollout_computes_with(results):
    """Engine.rollout_weights, the weights a rollout sampled ahead samples with (rlhf.online), are the qwZ
    rollout's own gathered weights, bit for bit, under every name; training after it stays bit-exact
    (test_zeropp_rollout_gathers_qwz_codes_once_and_matches_one_process compares the gradients)."""
    r = results[0]["zeropp"]
    assert all(torch.equal(r["snapshot"][name], r["gathered"][name]) for name in NAMES)
