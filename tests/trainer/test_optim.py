import math

import torch

from trainer.config import OptimSection
from trainer.optim import build_optimizer, lr_at


def test_schedule_warmup_then_cosine_to_min():
    cfg = OptimSection(lr=1.0, min_lr=0.1, warmup_steps=10, decay="cosine")
    assert lr_at(0, 110, cfg) == 0.1  # (0 + 1) / 10
    assert lr_at(9, 110, cfg) == 1.0
    assert math.isclose(lr_at(60, 110, cfg), 0.1 + 0.9 * 0.5)  # halfway through the decay
    assert math.isclose(lr_at(110, 110, cfg), 0.1)
    assert math.isclose(lr_at(500, 110, cfg), 0.1)  # clamps past the end


def test_schedule_linear_and_constant():
    lin = OptimSection(lr=1.0, min_lr=0.0, warmup_steps=0, decay="linear")
    assert [lr_at(s, 4, lin) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    const = OptimSection(lr=0.3, warmup_steps=0, decay="constant")
    assert lr_at(1000, 10, const) == 0.3


def test_weight_decay_only_on_matrices_and_tied_params_once():
    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.Sequential(emb, torch.nn.LayerNorm(4), torch.nn.Linear(4, 10))
    model[2].weight = emb.weight  # tie
    opt = build_optimizer(model, OptimSection(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(emb.weight)}
    assert len(plain["params"]) == 3  # LayerNorm weight, bias; Linear bias
