"""Streamed saving, consolidation and export (models/streaming.py): the files equal what
safetensors' own save_file writes for the same tensors, and a consolidation or export holds one
tensor at a time, not the model (a subprocess' peak resident memory against the model's size)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.hf import hf_weights, save_hf_checkpoint, to_hf_state_dict
from models.streaming import LazyTensors, SafetensorsFile, SafetensorsWriter, save_tensors
from models.transformer import Transformer
from tests.export.test_export import tokenizer_dir  # noqa: F401 (a fixture)
from trainer.spawn import run_ranks

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
          torch.float8_e5m2]


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Every dtype save_file writes, names that sort differently from their insertion order, a scalar,
    an empty tensor and a non-ASCII name."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        values = torch.randn(3, 2 + i, generator=g) * 50
        out[f"{'zyxw'[i % 4]}.{i}"] = values.to(dtype) if dtype != torch.bool else values > 0
    out.update({"a.scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "é.weight": torch.ones(5, dtype=torch.int16)})
    return out


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_streamed_writer_writes_save_files_bytes(metadata, tmp_path):
    tensors = mixed_tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    save_tensors(tensors, tmp_path / "a.safetensors", metadata=metadata)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()

    # Lazily, each tensor produced when asked for, written in an order of the producer's choosing.
    asked = []
    lazy = LazyTensors({n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()},
                       lambda n: asked.append(n) or tensors[n])
    with SafetensorsWriter(tmp_path / "b.safetensors", lazy.specs, metadata) as writer:
        for name in reversed(list(tensors)):
            writer.write(name, lazy[name])
    assert sorted(asked) == sorted(tensors)
    assert (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()

    save_file({}, str(tmp_path / "ref0.safetensors"), metadata=metadata)
    save_tensors({}, tmp_path / "c.safetensors", metadata=metadata)
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "ref0.safetensors").read_bytes()


def test_writer_refuses_a_wrong_tensor_and_a_missing_one(tmp_path):
    specs = {"a": torch.empty(2, 3, device="meta"), "b": torch.empty(4, dtype=torch.int8, device="meta")}
    with pytest.raises(ValueError, match=r"tensor 'a' is torch.float32 \(3, 2\), the header says torch.float32 \(2, 3\)"):
        with SafetensorsWriter(tmp_path / "x.safetensors", specs) as writer:
            writer.write("a", torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"tensors \['b'\] were never written"):
        with SafetensorsWriter(tmp_path / "x.safetensors", specs) as writer:
            writer.write("a", torch.zeros(2, 3))


def test_reader_reads_tensors_and_ranges_and_names_a_truncated_file(tmp_path):
    tensors = mixed_tensors()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, want in load_file(str(tmp_path / "m.safetensors")).items():
            got = f.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                               want.view(torch.uint8) if want.element_size() == 1 else want), name
        assert torch.equal(f.read("y.1", 2, 7), tensors["y.1"].reshape(-1)[2:7])
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:len(data) - 10])
    with pytest.raises(ValueError, match="cut.safetensors is not a readable safetensors file"):
        SafetensorsFile(tmp_path / "cut.safetensors")


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])  # GPT-2: Conv1D transposes and the fused c_attn
def test_hf_save_is_save_file_of_the_hf_state_dict(preset, tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(preset, vocab_size=96))
    reference = {n: t.contiguous() for n, t in to_hf_state_dict(model.state_dict(), model.config).items()}
    lazy = hf_weights(dict(model.named_parameters()), model.config)
    assert list(lazy) == list(reference)
    assert all(torch.equal(lazy[n], t) for n, t in reference.items())

    save_hf_checkpoint(model, tmp_path / "one")
    save_file(reference, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()

    # Sharded, from the weights as a lazy mapping: every shard is save_file of its tensors, the split greedy.
    weights = LazyTensors.of(dict(model.named_parameters()))
    save_hf_checkpoint(weights, tmp_path / "shards", max_shard_size=20000, config=model.config)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == list(reference)
    files = list(dict.fromkeys(index["weight_map"].values()))
    assert len(files) > 2 and index["metadata"]["total_size"] == sum(t.nbytes for t in reference.values())
    for file in files:
        names = [n for n, f in index["weight_map"].items() if f == file]
        assert sum(reference[n].nbytes for n in names) <= 20000 or len(names) == 1
        save_file({n: reference[n] for n in names}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert (tmp_path / "shards" / file).read_bytes() == (tmp_path / "ref.safetensors").read_bytes(), file
    assert json.loads((tmp_path / "shards" / "config.json").read_text()) == \
        json.loads((tmp_path / "one" / "config.json").read_text())


# ------------------------------------------------------------------------------ peak memory

# ~138 MB of fp32 weights in 48 tensors, the largest 6.3 MB: holding the model would be a peak of 1.0.
BIG = dict(n_layer=5, d_model=768, n_head=12, n_kv_head=4, d_ff=2048, vocab_size=2048, max_seq_len=128)
_PROBE = """
import json, shutil, sys
import torch
from models.config import ModelConfig
from models.transformer import Transformer
from export.quantized import export_gguf, export_lowbit
from models.streaming import return_freed_memory_to_the_os
from trainer.checkpoint import checkpoint_weights, export_hf

with torch.device("meta"):  # the first model built imports modules (sympy, ...): not the export's memory
    Transformer(ModelConfig.from_preset("llama-tiny"))


def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024


return_freed_memory_to_the_os()  # as the trainer and the writers do


def peak(run):
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := the resident memory now
        f.write("5")
    before = hwm()
    run()
    return hwm() - before


ckpt, out, tokenizer = sys.argv[1:]
peaks = {"consolidate": peak(lambda: export_hf(ckpt, out + "/hf"))}
shutil.rmtree(out + "/hf")
config, weights = checkpoint_weights(ckpt)
peaks["low-bit 4"] = peak(lambda: export_lowbit(weights, config, out + "/int4", 4, 64, tokenizer))
peaks["GGUF Q8_0"] = peak(lambda: export_gguf(weights, config, out + "/m.gguf", "Q8_0", tokenizer, 64))
print(json.dumps(peaks))
"""


def _save_big(rank, world, root):
    from scripts.bench.memory import _save_export_checkpoint

    return _save_export_checkpoint(rank, world, root, BIG, None)


def test_consolidation_and_export_hold_one_tensor_not_the_model(tokenizer_dir, tmp_path):  # noqa: F811
    ckpt = run_ranks(_save_big, 2, args=(tmp_path / "ckpt",))[0]
    with torch.device("meta"):
        sizes = [4 * p.numel() for p in Transformer(ModelConfig.from_preset("llama-tiny", **BIG)).parameters()]
    model_bytes = sum(sizes)
    assert len(sizes) > 40 and max(sizes) < 0.05 * model_bytes
    done = subprocess.run([sys.executable, "-c", _PROBE, ckpt, str(tmp_path), str(tokenizer_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    ratios = {kind: round(p / model_bytes, 3) for kind, p in peaks.items()}
    assert all(r < 0.25 for r in ratios.values()), ratios  # the model itself would be 1.0
