"""zeropp.plan's prediction of a step's bytes for a LoRA model, whose frozen units stay gathered
across steps (issue 37, item 8a: the LoRA run's table showed the forward gather predicted above
what it sent)."""

from pathlib import Path

from models.lora import apply_lora
from models.transformer import lm_loss
from tests.zeropp.test_engine import BATCH, batches, deeper_model, make_engine, train_step
from trainer.config import load_yaml
from trainer.spawn import run_ranks
from zeropp.config import ZeroConfig

PRESET = Path(__file__).resolve().parents[2] / "configs" / "finetune_alpaca_lora_zeropp.yaml"


def _lora_step(rank, world, accum):
    """Per runtime (the LoRA ZeRO++ preset's, plain ZeRO-3): the bytes of a step that follows a
    step, predicted and measured, and plain ZeRO-3's cross-node baseline."""
    out = {}
    for name, cfg in (("zeropp", ZeroConfig(**load_yaml(PRESET)["zero_optimization"])), ("zero3", ZeroConfig(stage=3))):
        model = deeper_model(4)  # more blocks than the rotating buffers hold
        apply_lora(model, r=4)
        engine, optimizer = make_engine(model, cfg, ranks_per_node=2)
        train_step(engine, optimizer, batches(1)[0], rank, world)
        engine.ledger.reset()
        per_rank = BATCH // world
        for micro in batches(2)[1][rank * per_rank:(rank + 1) * per_rank].chunk(accum):
            engine.backward(lm_loss(engine(micro[:, :-1]), micro[:, 1:]))
        optimizer.step()
        measured = {tag: {k: e[k] for k in ("sent", "cross_node_sent")} for tag, e in engine.ledger.totals().items()}
        out[name] = measured, engine.predicted_step_bytes(accum), engine.zero3_cross_node_bytes(accum)
        engine.close()
    return out


def test_a_lora_step_sends_what_is_predicted():
    for ranks in run_ranks(_lora_step, 4, args=(2,), ranks_per_node=2):
        for name, (measured, predicted, zero3) in ranks.items():
            assert predicted == measured, name
            assert measured["forward gather"]["cross_node_sent"] > 0
        measured, _, zero3 = ranks["zero3"]
        assert zero3 == {tag: e["cross_node_sent"] for tag, e in measured.items()}
