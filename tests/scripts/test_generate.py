"""scripts/generate.py from a training checkpoint, a Hugging Face dir and a low-bit export."""

import dataclasses

import pytest
import torch

from data.tokenizer import load_tokenizer
from export import export_lowbit
from models.generate import generate
from models.transformer import Transformer
from scripts.generate import TokenizerVocab, main
from tests.export.test_export import grid
from tests.scripts.test_export_cli import qwz_checkpoints
from trainer.checkpoint import consolidated_model, export_hf, read_state, resolve_checkpoint

PROMPT = "Return the"


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    return resolve_checkpoint(str(qwz_checkpoints(tmp_path_factory)), ".")


def run(capsys, *argv) -> str:
    main([str(a) for a in argv])
    return capsys.readouterr().out


def expected_text(model, tokenizer, n, **sampling) -> str:
    """The reference: the model cut to the tokenizer's vocabulary (train.py pads it further), so
    that no padded id can be generated."""
    config = dataclasses.replace(model.config, vocab_size=tokenizer.vocab_size)
    cut = Transformer(config)
    cut.load_state_dict({n: w[:tokenizer.vocab_size] if n in ("embed.tokens.weight", "head.weight") else w
                         for n, w in model.state_dict().items()})
    ids = tokenizer.encode(PROMPT)
    new = generate(cut, [ids], n, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, **sampling)[0]
    return tokenizer.decode(ids + new) + "\n"


def test_each_source_generates_with_its_weights_and_tokenizer(step, tmp_path, capsys):
    masters = consolidated_model(step)
    tokenizer = load_tokenizer(read_state(step)["tokenizer"])
    greedy = expected_text(masters, tokenizer, 12)
    assert run(capsys, step, "--prompt", PROMPT, "--max-new-tokens", 12) == greedy
    assert run(capsys, export_hf(step, tmp_path / "hf"), "--prompt", PROMPT, "--max-new-tokens", 12) == greedy

    # A low-bit export runs with its dequantized weights: the 2-bit grid of the masters.
    export_lowbit(masters, masters.config, tmp_path / "int2", 2, 64, tokenizer.path)
    on_grid = Transformer(masters.config)
    on_grid.load_state_dict({n: grid(w, 2, 64) if w.dim() == 2 else w for n, w in masters.state_dict().items()})
    assert run(capsys, tmp_path / "int2", "--prompt", PROMPT, "--max-new-tokens", 12) == expected_text(
        on_grid, tokenizer, 12)


def test_sampling_follows_the_seed(step, capsys):
    argv = (step, "--prompt", PROMPT, "--max-new-tokens", 10, "--temperature", 1.0, "--top-k", 50)
    first = run(capsys, *argv, "--seed", 1)
    assert run(capsys, *argv, "--seed", 1) == first
    tokenizer = load_tokenizer(read_state(step)["tokenizer"])
    ids = tokenizer.encode(PROMPT)
    model = TokenizerVocab(consolidated_model(step), tokenizer.vocab_size)
    new = generate(model, [ids], 10, temperature=1.0, top_k=50, eos_token_id=tokenizer.eos_id,
                   pad_token_id=tokenizer.pad_id, generator=torch.Generator().manual_seed(1))[0]
    assert first == tokenizer.decode(ids + new) + "\n"


def test_errors(step, tmp_path):
    with pytest.raises(SystemExit, match=f"generate.py: {tmp_path / 'absent'} is not a low-bit export"):
        main([str(tmp_path / "absent"), "--prompt", PROMPT])
    with pytest.raises(SystemExit, match="generate.py: no tokenizer at .*elsewhere.model"):
        main([str(step), "--prompt", PROMPT, "--tokenizer", str(tmp_path / "elsewhere.model")])
