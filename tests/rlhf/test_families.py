"""rlhf.py's DPO stage on the newer families: a tiny random Qwen2 (q/k/v biases, tied head) and Qwen3
(per-head q/k norms, explicit head_dim) policy made with transformers, over the word task's tokenizer.
The reference log-probs the stage computes (our model, right-padded batches of pairs, ZeRO-3) equal
transformers' on each sequence alone; DPO raises the held-out margin; the exported policy is the trained
one, and transformers loads it with our logits."""

import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data.datasets import IGNORE_INDEX, PreferenceDataset
from data.tokenizer import load_tokenizer
from models.config import ModelConfig
from models.transformer import Transformer
from rlhf.tasks import save_task_tokenizer
from trainer.spawn import run_ranks
from zeropp.checkpoint import consolidated_state_dict

ROOT = Path(__file__).parents[2]
STEPS = 8
VOCAB = 128  # the word task's tokenizer has 100 tokens


def _main(rank, world, argv):
    """rlhf.py's main (the script shares its name with the rlhf package, so it is run by path)."""
    runpy.run_path(str(ROOT / "rlhf.py"), run_name="rlhf_script")["main"](argv)


def hf_config(family: str):
    from transformers import Qwen2Config, Qwen3Config

    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**small)
    return Qwen3Config(head_dim=32, **small)


@torch.no_grad()
def make_policy(family: str, directory: Path):
    """transformers' random init (matrices at std 0.1, biases and norm gains moved off 0 / 1, so that a
    lost bias or q/k norm shows), saved with the word task's tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0.0, 0.1)
        else:
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    save_task_tokenizer(directory / "tokenizer")
    for file in (directory / "tokenizer").iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return model


def response_logprob_sum(model, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """transformers' summed log-probs of one sequence's response tokens (labels != -100), unpadded."""
    logits = model(tokens[None]).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[1:, None])[:, 0]
    return (logp * (labels[1:] != IGNORE_INDEX)).sum().item()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_dpo_on_the_family_matches_transformers_and_exports_the_trained_policy(family, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(ROOT)
    policy_dir, out = tmp_path / "policy", tmp_path / "run"
    hf = make_policy(family, policy_dir)
    argv = ["dpo", "--config", "configs/rlhf_tiny.yaml", "--models.sft", str(policy_dir), "--train.out_dir", str(out),
            "--data.task_samples", "200", "--dpo.steps", str(STEPS), "--dpo.lr", "3e-3",
            "--train.micro_batch_size", "4", "--train.eval_interval", "100", "--train.log_interval", "1",
            "--train.precision", "fp32",  # exact references
            # ZeRO-3 with an fp32 wire: qwZ would round the weights the references see
            "--zero_optimization.zero_quantized_weights", "false",
            "--zero_optimization.zero_quantized_gradients", "false",
            "--zero_optimization.zero_quantized_nontrainable_weights", "false",
            "--zero_optimization.communication_data_type", "fp32"]
    run_ranks(_main, world_size=1, args=(argv,))

    # The reference log-probs of every pair, from our model in padded batches, are transformers' on each alone.
    pairs = PreferenceDataset(out / "data" / "word_pairs_200.jsonl", load_tokenizer(policy_dir), max_len=48)
    table = load_file(out / "dpo" / "reference_logps.safetensors")["logps"]
    assert table.shape == (len(pairs), 2)
    worst = 0.0
    with torch.no_grad():
        for i in range(0, len(pairs), 10):
            item = pairs[i]
            for side, column in (("chosen", 0), ("rejected", 1)):
                theirs = response_logprob_sum(hf, item[f"{side}_tokens"], item[f"{side}_labels"])
                worst = max(worst, abs(theirs - table[i, column].item()))
    assert worst < 1e-4, worst  # sums of ~10 fp32 log-probs

    # DPO learns: the policy starts as the reference (margin 0) and ends preferring the chosen answers.
    rows = [json.loads(line) for line in open(out / "dpo" / "metrics.jsonl")]
    held_out = [r for r in rows if "held-out margin" in r]
    assert held_out[0]["step"] == 0 and abs(held_out[0]["held-out margin"]) < 1e-5
    assert held_out[-1]["step"] == STEPS and held_out[-1]["held-out margin"] > 0.1, held_out[-1]

    # The export is the trained policy (the last checkpoint's weights), and transformers computes our logits.
    export = out / "dpo" / "hf"
    trained = consolidated_state_dict(out / "dpo" / "checkpoints" / f"step_{STEPS:08d}" / "policy")
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == family and config["tie_word_embeddings"] is True
    ours = Transformer(ModelConfig(**json.loads((out / "dpo" / "checkpoints" / f"step_{STEPS:08d}" / "state.json")
                                               .read_text())["models"]["policy"]))
    ours.load_state_dict(trained)
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(theirs) is type(hf)
    x = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(x)
        diff = (theirs(x).logits - expected).abs().max().item()
        moved = (hf(x).logits - expected).abs().max().item()
    assert diff < 1e-5, diff
    assert moved > 1e-2, moved  # DPO changed the policy
    print(f"{family}: reference log-probs vs transformers {worst:.2e}, held-out margin "
          f"{held_out[-1]['held-out margin']:.3f}, export logits vs ours {diff:.2e}, moved {moved:.3f}")
