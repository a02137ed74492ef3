"""The newer families under the ZeRO-3 runtime: the two with parameters of new kinds (Qwen2's q/k/v
biases without o_proj / MLP biases, Qwen3's per-head q/k norms); the rest are RoPE and mask changes
inside a forward the runtime does not see."""

import torch

from models.config import ModelConfig
from models.transformer import Transformer, lm_loss
from trainer.config import OptimSection
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from zeropp.config import ZeroConfig
from zeropp.engine import Zero3Engine
from zeropp.topology import build_mesh

PRESETS = ("qwen2-tiny", "qwen3-tiny")
OPTIM = OptimSection(lr=1e-3, weight_decay=0.1, warmup_steps=0, decay="constant", eps=1e-6)
STEPS, BATCH, SEQ, VOCAB = 3, 4, 12, 96


def _model(preset: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_preset(preset, vocab_size=VOCAB))


def _batches():
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _train(model, step_fn):
    losses = []
    for sample in _batches():
        losses.append(step_fn(sample))
    return losses


def _reference(preset: str):
    model = _model(preset)
    opt = build_optimizer(model, OPTIM)

    def step(sample):
        loss = lm_loss(model(sample[:, :-1]), sample[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return _train(model, step), model.state_dict()


def _zero3(rank, world):
    out = {}
    for preset in PRESETS:
        engine = Zero3Engine(_model(preset), ZeroConfig(stage=3, communication_data_type="fp32"),
                             mesh=build_mesh(ranks_per_node=world))
        opt = build_optimizer(engine.module, OPTIM)

        def step(sample):
            mine = sample[rank * BATCH // world:(rank + 1) * BATCH // world]
            loss = lm_loss(engine(mine[:, :-1]), mine[:, 1:])
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            return total.item() / world

        losses = _train(engine, step)
        out[preset] = (losses, engine.full_state_dict())
        engine.close()
    return out if rank == 0 else None


def test_zero3_trains_the_new_families_like_one_process():
    results = run_ranks(_zero3, 2)[0]
    for preset in PRESETS:
        ref_losses, ref_state = _reference(preset)
        losses, state = results[preset]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, preset
        assert state.keys() == ref_state.keys()
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in state)
        assert worst < 1e-5, (preset, worst)
