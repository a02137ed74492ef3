"""scripts/export_quantized.py on a real qwZ-trained checkpoint, an HF dir, and bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file

from export import load_lowbit
from scripts.export_quantized import main
from tests.export.test_export import grid
from tests.trainer.test_finetune import (LORA, LORA_TARGETS, ft_args, ft_config, hf_dirs, synthetic,  # noqa: F401
                                         tokenizer_dir)
from trainer.checkpoint import checkpoint_weights, consolidated_model, export_hf, resolve_checkpoint
from trainer.config import parse_args
from trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
BITS, BLOCK = 4, 64


def qwz_checkpoints(tmp_path_factory) -> Path:
    """A run's checkpoints/ dir: 3 steps of a LLaMA trained by train.py with ZeRO-3 + qwZ (int4, block 64).

    Trained once per session (shared with tests/scripts/test_generate.py through the base temp dir).
    """
    root = tmp_path_factory.getbasetemp() / "qwz-run"
    if not (root / "checkpoints" / "latest").is_file():
        train(parse_args([
            "--model.preset", "llama-tiny", "--model.d_ff", "128", "--data.path", "default",
            "--data.vocab_size", "600", "--data.seq_len", "32", "--data.cache_dir", str(root.parent / "qwz-cache"),
            "--data.workers", "1", "--train.micro_batch_size", "4", "--train.steps", "3",
            "--train.eval_interval", "3", "--train.eval_batches", "1", "--train.out_dir", str(root),
            "--train.tensorboard", "false", "--train.progress_bar", "false",
            "--zero_optimization.stage", "3", "--zero_optimization.zero_quantized_weights", "true",
            "--zero_optimization.zero_quantized_weights_bits", str(BITS),
            "--zero_optimization.zero_quantization_block_size", str(BLOCK)]))
    return root / "checkpoints"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return qwz_checkpoints(tmp_path_factory)


def test_a_merged_lora_export_says_what_is_exact_and_measures_the_rest(hf_dirs, synthetic, tmp_path, capsys):  # noqa: F811
    """Issue 37, item 4: a qwZ LoRA run's export used to say "exact", but the weights the adapters are
    merged into are off the int8 grid the forward computed with and are quantized again. The label
    now says which are exact and gives the merged weights' re-quantization error."""
    out = tmp_path / "lora"
    train(ft_config(*ft_args(hf_dirs["llama"], synthetic, out, *LORA, "--train.steps", "2",
                             "--zero_optimization.stage", "3", "--zero_optimization.zero_quantized_weights", "true",
                             "--zero_optimization.zero_quantized_weights_bits", "8",
                             "--zero_optimization.zero_quantization_block_size", "64")))
    main([str(out / "checkpoints"), str(tmp_path / "int8"), "--format", "safetensors"])
    line = capsys.readouterr().out
    merged = [f"blocks.{i}.{part}.weight" for i in range(2) for part in
              ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj")]
    assert len(merged) == 2 * len(LORA_TARGETS)
    _, weights = checkpoint_weights(resolve_checkpoint(str(out / "checkpoints"), "."))
    worst = max(float((weights[n] - grid(weights[n], 8, 64)).norm() / weights[n].norm()) for n in merged)
    assert "exact: the weights" not in line and worst > 0
    assert (f"8 bits, block size 64; the base weights exact (the qwZ grid the training forward computed with); "
            f"the {len(merged)} weights a LoRA adapter is merged into are off that grid and quantized again "
            f"round-to-nearest (relative RMS error up to {worst:.2e})") in line, line


def test_defaults_to_the_trained_grid_and_is_exact(checkpoints, tmp_path, capsys):
    masters = consolidated_model(resolve_checkpoint(str(checkpoints), "."))
    main([str(checkpoints), str(tmp_path / "int4"), "--format", "safetensors"])
    assert capsys.readouterr().out == (f"{tmp_path / 'int4'}: safetensors, 4 bits, block size 64; "
                                       "exact: the weights the qwZ training forward computed with\n")
    loaded, meta = load_lowbit(tmp_path / "int4")
    assert meta["vectors_on_grid"] and loaded.config == masters.config
    for name, w in masters.named_parameters():  # every parameter, norms included, as qwZ computed with it
        assert torch.equal(dict(loaded.named_parameters())[name], grid(w, BITS, BLOCK)), name

    main([str(checkpoints), str(tmp_path / "m.gguf"), "--format", "gguf"])
    assert "gguf, 4 bits, block size 64; exact" in capsys.readouterr().out
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_other_bits_are_the_rtn_baseline(checkpoints, tmp_path, capsys):
    main([str(checkpoints), str(tmp_path / "int8"), "--format", "safetensors", "--bits", "8"])
    assert capsys.readouterr().out.endswith("8 bits, block size 64; round-to-nearest post-training "
                                            "quantization (RTN baseline)\n")
    meta = json.loads((tmp_path / "int8" / "quantization.json").read_text())
    assert (meta["bits"], meta["block_size"], meta["vectors_on_grid"]) == (8, 64, False)


def test_errors_name_the_problem(checkpoints, tmp_path):
    def error(*argv):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv])
        return str(e.value.code)

    assert "bits=6: GGUF holds our codes only at 8 bits (Q8_0) or 4 bits (Q4_0)" in error(
        checkpoints, tmp_path / "m.gguf", "--format", "gguf", "--bits", "6")
    assert "block_size=48: GGUF needs a multiple of 32" in error(
        checkpoints, tmp_path / "m.gguf", "--format", "gguf", "--block-size", "48")

    hf = export_hf(resolve_checkpoint(str(checkpoints), "."), tmp_path / "hf")  # an HF dir records no qwZ
    assert f"{hf} was not trained with qwZ, so there is no bit width to default to: pass --bits" in error(
        hf, tmp_path / "out", "--format", "safetensors")
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        (hf / name).unlink(missing_ok=True)
    assert f"{hf} names no tokenizer (hf); pass --tokenizer" in error(
        hf, tmp_path / "out", "--format", "safetensors", "--bits", "4")

    # A checkpoint whose recorded tokenizer is gone.
    step = tmp_path / "step"
    shutil.copytree(resolve_checkpoint(str(checkpoints), "."), step)
    state = json.loads((step / "state.json").read_text())
    state["tokenizer"] = str(tmp_path / "gone" / "tokenizer.model")
    (step / "state.json").write_text(json.dumps(state))
    assert f"no tokenizer at {tmp_path / 'gone' / 'tokenizer.model'} (missing path); expected" in error(
        step, tmp_path / "out", "--format", "safetensors")
    assert f"{tmp_path / 'nothing'} is not a low-bit export (quantization.json), a Hugging Face model dir" in error(
        tmp_path / "nothing", tmp_path / "o", "--format", "gguf")
    assert not (tmp_path / "out").exists() and not (tmp_path / "m.gguf").exists()


def test_runs_as_a_script(checkpoints, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_quantized.py"), str(checkpoints),
                             str(tmp_path / "m.gguf"), "--format", "gguf", "--bits", "8"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{tmp_path / 'm.gguf'}: gguf, 8 bits, block size 64; round-to-nearest")


def test_streamed_exports_equal_save_file_and_the_in_memory_model(checkpoints, tmp_path, capsys):
    """The scripts read the checkpoint one tensor at a time; their files equal save_file of the tensors
    the in-memory model gives (consolidation, low-bit), and the exporters' output for that model."""
    import kernels
    import scripts.consolidate
    from export import export_gguf
    from export.compressed import export_compressed_tensors
    from models.hf import to_hf_state_dict
    from trainer.checkpoint import read_state

    ckpt = resolve_checkpoint(str(checkpoints), ".")
    tokenizer = read_state(ckpt)["tokenizer"]
    trained = consolidated_model(ckpt, as_trained=True)  # in memory, on the qwZ grid
    scripts.consolidate.main([str(checkpoints), str(tmp_path / "hf"), "--max-shard-size", "60000"])
    hf = {n: t.contiguous() for n, t in to_hf_state_dict(trained.state_dict(), trained.config).items()}
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == list(hf) and len(set(index["weight_map"].values())) > 2
    for file in set(index["weight_map"].values()):
        save_file({n: hf[n] for n, f in index["weight_map"].items() if f == file}, str(tmp_path / "ref.safetensors"),
                  metadata={"format": "pt"})
        assert (tmp_path / "hf" / file).read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), file

    masters = consolidated_model(ckpt)
    main([str(checkpoints), str(tmp_path / "int4"), "--format", "safetensors"])
    tensors = {}
    for name, w in masters.named_parameters():
        if w.dim() == 2:
            q = kernels.quantize_weights(w.detach().reshape(-1), BITS, BLOCK)
            tensors[f"{name}.codes"], tensors[f"{name}.scales"] = q.codes, q.scales
        else:
            tensors[name] = grid(w, BITS, BLOCK)  # vectors on the grid: the run was qwZ
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "int4" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()

    main([str(checkpoints), str(tmp_path / "m.gguf"), "--format", "gguf"])
    export_gguf(masters, masters.config, tmp_path / "ref" / "m.gguf", "Q4_0", tokenizer, BLOCK, vectors_on_grid=True)
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "ref" / "m.gguf").read_bytes()
    main([str(checkpoints), str(tmp_path / "ct"), "--format", "compressed-tensors"])
    export_compressed_tensors(masters, masters.config, tmp_path / "ref-ct", BITS, BLOCK, tokenizer, vectors_on_grid=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ct").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "ref-ct").iterdir()}
    capsys.readouterr()
