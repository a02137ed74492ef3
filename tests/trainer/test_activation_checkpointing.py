"""Activation checkpointing (trainer/activation_checkpointing.py) changes nothing but memory: the
same losses, gradients and weights as without it under DDP, ZeRO-3, ZeRO++ (qwZ + hpZ + qgZ on
2 nodes x 2), tensor parallelism and LoRA, and under ZeRO-3 not one more byte gathered or reduced."""

import pytest
import torch

from models.config import ModelConfig
from models.lora import apply_lora
from models.transformer import Transformer
from tests.conftest import SHARED_DATA
from tests.zeropp.test_engine import BATCH, OPTIM, batches
import trainer.activation_checkpointing as ac
from trainer.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from trainer.config import ConfigError, parse_args
from trainer.loop import _check, train
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from zeropp import build_runtime
from zeropp.config import TensorParallelConfig, ZeroConfig

MODES = ("none", "full", "every_k")  # every_k with k = 2 on 3 blocks: block 1 only
STEPS = 2
ZERO_TAGS = ("forward gather", "backward gather", "gradient reduce")


def make_model(lora: bool = False) -> Transformer:
    """LLaMA-style (RMSNorm, RoPE, GQA, SwiGLU), 3 blocks: every_k checkpoints some and not others."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("llama-tiny", vocab_size=96, n_layer=3))
    if lora:
        apply_lora(model, r=4, dropout=0.1)  # dropout: the recompute must draw the forward's masks
    return model


def _train(mode: str, zero: dict, tp: dict | None, lora: bool):
    """Two steps of the runtime `zero` / `tp` asks for with `mode`; what each step gave."""
    model = make_model(lora)
    chosen = apply_activation_checkpointing(model, mode, 2)
    runtime = build_runtime(model, ZeroConfig(communication_data_type="fp32", **zero), torch.device("cpu"),
                            TensorParallelConfig(**tp) if tp else None)
    optimizer = build_optimizer(runtime.module, OPTIM)
    dp_rank, dp = runtime.data_parallel
    per_rank = BATCH // dp
    torch.manual_seed(1)  # LoRA's dropout
    losses, grads, sent = [], [], []
    for sample in batches(STEPS):
        runtime.ledger.reset()
        mine = sample[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        loss = runtime.lm_loss(runtime(mine[:, :-1]), mine[:, 1:])
        runtime.backward(loss)
        grads.append({n: p.grad.clone() for n, p in runtime.module.named_parameters() if p.grad is not None})
        sent.append({tag: v["sent"] for tag, v in runtime.ledger.totals().items()})
        runtime.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # evaluation runs the plain forward
        runtime.module.eval()
        eval_loss = runtime.lm_loss(runtime(batches(1)[0][:per_rank, :-1]), batches(1)[0][:per_rank, 1:]).item()
    weights = {n: p.detach().clone() for n, p in runtime.module.named_parameters()}
    runtime.close()
    return chosen, losses, grads, weights, sent, eval_loss


def _cases(rank, world, cases):
    """Every case, each mode: one spawn of the ranks for all of them."""
    return {name: {mode: _train(mode, *case) for mode in MODES} for name, case in cases.items()}


# Every case on 4 ranks as 2 nodes x 2, in one spawn of the ranks (their start, not the runs,
# is what takes time). ZeRO-3 keeps 2 of the 3 blocks gathered from the forward to the backward:
# block 0 is gathered again (ZeRO++: from the hpZ secondary inside the node) and recomputed
# from those weights.
CASES = {
    "ddp": ({"stage": 0}, None, False),
    "zero3": ({"stage": 3}, None, False),
    # frozen base weights (units of their own) + adapters with dropout: the recompute must draw
    # the forward's masks
    "lora zero3": ({"stage": 3}, None, True),
    # qwZ int8 weights, hpZ, qgZ int4 gradients over 2 hops
    "zero++": ({"stage": 3, "ranks_per_node": 2, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                "zero_quantization_block_size": 64, "zero_quantized_gradients": True}, None, False),
    # tensor parallelism 2 inside each node; the recompute re-runs the group's all-reduces
    "tp": ({"stage": 0}, {"size": 2}, False),
    "tp over zero3": ({"stage": 3, "ranks_per_node": 2}, {"size": 2}, False),
    # pipelined partitions, top-k tokens (the recompute recomputes the token mask, a collective
    # too) and int4 all-reduces
    "tp topk int4": ({"stage": 0}, {"size": 2, "partitions": 2, "topk_keep_ratio": 0.5, "quantize_bits": 4}, False),
}
ZERO_CASES = {"zero3", "lora zero3", "zero++", "tp over zero3"}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, 4, args=(CASES,), ranks_per_node=2)


@pytest.mark.parametrize("name", list(CASES))
def test_same_training_with_and_without(results, name):
    """Losses, every step's gradients, the weights after 2 steps and an evaluation loss: equal
    (<= 1e-6; in fact bit-identical: the recompute repeats the forward's arithmetic) for full
    and every_k; under ZeRO-3 the same bytes gathered (forward and backward) and reduced."""
    for rank, per_case in enumerate(results):
        runs = per_case[name]
        _, losses, grads, weights, sent, eval_loss = runs["none"]
        assert [runs[m][0] for m in MODES] == [[], [0, 1, 2], [1]]
        for mode in MODES[1:]:
            _, m_losses, m_grads, m_weights, m_sent, m_eval = runs[mode]
            where = f"{name}, {mode}, rank {rank}"
            assert max(abs(a - b) for a, b in zip(losses, m_losses)) <= 1e-6, (where, losses, m_losses)
            assert abs(eval_loss - m_eval) <= 1e-6, where
            for step, (g, m_g) in enumerate(zip(grads, m_grads)):
                assert g.keys() == m_g.keys() and len(g) > 0, where
                worst = max((g[k] - m_g[k]).abs().max().item() if g[k].numel() else 0.0 for k in g)
                assert worst <= 1e-6, f"{where}: step {step} gradients differ by {worst}"
            assert weights.keys() == m_weights.keys()
            worst = max((weights[k] - m_weights[k]).abs().max().item() if weights[k].numel() else 0.0
                        for k in weights)
            assert worst <= 1e-6, f"{where}: weights differ by {worst}"
            if name in ZERO_CASES:  # the recompute gathers nothing; each unit is reduced once
                for step in range(STEPS):
                    assert {t: m_sent[step][t] for t in ZERO_TAGS} == {t: sent[step][t] for t in ZERO_TAGS}, \
                        (where, step, m_sent[step], sent[step])
                    assert sent[step]["backward gather"] > 0, where  # block 0 is gathered again


def test_blocks_chosen_and_plain_forward_without_grad(monkeypatch):
    assert checkpointed_blocks(5, "every_k", 2) == [1, 3]
    assert checkpointed_blocks(5, "every_k", 1) == checkpointed_blocks(5, "full") == [0, 1, 2, 3, 4]
    assert checkpointed_blocks(5, "every_k", 9) == [] and checkpointed_blocks(5, "none") == []
    model = make_model()
    names = list(model.state_dict())
    assert apply_activation_checkpointing(model, "full") == [0, 1, 2]
    assert list(model.state_dict()) == names  # nothing renamed
    calls = []
    monkeypatch.setattr(ac, "checkpoint", lambda *a, **k: calls.append(k) or torch.utils.checkpoint.checkpoint(*a, **k))
    tokens = batches(1)[0][:2, :-1]
    with torch.no_grad():  # evaluation, generation: the plain forward
        model(tokens)
    assert not calls
    model(tokens).sum().backward()
    assert len(calls) == 3 and all(k["use_reentrant"] is False for k in calls)


@pytest.mark.parametrize("every", ["0", "-1"])
def test_every_must_be_positive(every):
    cfg = parse_args(["--train.activation_checkpointing", "every_k", "--train.activation_checkpointing_every", every])
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing_every: value .* expected an integer >= 1"):
        _check(cfg)


def test_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing: value 'selective' is not one of"):
        parse_args(["--train.activation_checkpointing", "selective"])


def test_rlhf_checkpoints_the_models_it_trains(monkeypatch):
    import rlhf.sft
    from rlhf.common import ModelRuntime, setup_distributed
    from rlhf.config import RLHFConfig, check

    bad = parse_args(["--data.task", "word", "--train.activation_checkpointing_every", "0"], RLHFConfig())
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing_every must be at least 1"):
        check(bad, "ppo")
    cfg = parse_args(["--data.task", "word", "--train.activation_checkpointing", "every_k",
                      "--train.activation_checkpointing_every", "3"], RLHFConfig())
    check(cfg, "ppo")
    env, own = setup_distributed(60.0)
    try:
        actor, reference = make_model(), make_model()
        runtimes = [ModelRuntime("actor", (actor, None), cfg, env, lr=1e-3),
                    ModelRuntime("reference", (reference, None), cfg, env, lr=None)]
        assert [getattr(b, "_activation_checkpointed", False) for b in actor.blocks] == [False, False, True]
        assert not any(getattr(b, "_activation_checkpointed", False) for b in reference.blocks)
        for r in runtimes:
            r.close()
    finally:
        if own:
            torch.distributed.destroy_process_group()
    # the sft stage trains through trainer.loop with the same keys
    monkeypatch.setattr(rlhf.sft, "base_model_dir", lambda cfg, env: "base")
    monkeypatch.setattr(rlhf.sft, "sft_file", lambda cfg, env: ("sft.jsonl", "auto"))
    sft = rlhf.sft.sft_config(cfg, env).train
    assert (sft.activation_checkpointing, sft.activation_checkpointing_every) == ("every_k", 3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 KB of Shakespeare, or of the embedded corpus where ../shared is absent."""
    path, source = tmp_path_factory.mktemp("corpus") / "text.txt", SHARED_DATA / "tinyshakespeare.txt"
    if not source.is_file():
        from data.corpus import default_corpus

        source = default_corpus(tmp_path_factory.mktemp("cache"))
    path.write_text(source.read_text()[:60_000])
    return path


def test_trainer_applies_it_and_logs_the_blocks(corpus, tmp_path, capsys):
    """train.py's loop: the key reaches the model, the first log lines name the blocks, and the
    run is the same."""
    runs = {}
    for mode in ("none", "every_k"):
        argv = ["--model.preset", "gpt2-tiny", "--model.n_layer", "3", "--data.path", str(corpus),
                "--data.vocab_size", "512", "--data.seq_len", "32", "--data.cache_dir", str(tmp_path / "cache"),
                "--data.workers", "1", "--train.micro_batch_size", "4", "--train.steps", "2",
                "--train.eval_batches", "1", "--train.out_dir", str(tmp_path / mode), "--train.tensorboard", "false",
                "--train.progress_bar", "false", "--train.precision", "fp32",
                "--train.activation_checkpointing", mode]
        runs[mode] = train(parse_args(argv))
        out = capsys.readouterr().out
        assert ("activation checkpointing: every_k (every 2), 1 of 3 blocks [1]" in out) == (mode == "every_k")
    assert runs["none"].losses == runs["every_k"].losses and runs["none"].val_loss == runs["every_k"].val_loss
