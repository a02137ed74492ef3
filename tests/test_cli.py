"""The entry points as a user runs them: train.py, finetune.py and rlhf.py (--help, one-line user
errors, --debug), finetune.lora.init_from, and the end-of-run cross-node report.

Each entry point runs once in a real interpreter (a bad key: exit status, stderr, no traceback);
the other cases call its main() here, with what the interpreter does at the end of a run
(call_entry), which spares an interpreter start and a torch import per case."""

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import zeropp.checkpoint
from data.indexed import IndexedDatasetBuilder
from rlhf.config import RLHFConfig
from tests.trainer.test_finetune import LORA, LORA_TARGETS, ft_args, ft_config, hf_dirs, synthetic, tokenizer_dir  # noqa: F401
from trainer.checkpoint import verify_checkpoint
from trainer.config import Config, ConfigError, all_fields, field_docs
from trainer.loop import Trainer, cross_node_report, train

ROOT = Path(__file__).resolve().parents[1]


def run_entry(script: str, *args: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "ZEROPP_DEBUG"}
    environ.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=300)


@functools.cache
def entry_module(script: str):
    """The entry point's module, loaded from its file (`import rlhf` is the rlhf package)."""
    spec = importlib.util.spec_from_file_location(f"entry_{Path(script).stem}", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_entry(capfd, script: str, *args: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    """run_entry in this process: `script`'s main(argv) in `cwd` with `env` (ZEROPP_DEBUG unset
    otherwise), then what the interpreter does when a script ends: SystemExit's code is the exit
    status (a message is printed to stderr, status 1), an uncaught exception prints its traceback
    (status 1); warnings go to stderr under the interpreter's default filters. stdout and stderr
    are captured at the file descriptors, so C++ and library output counts too."""
    main = entry_module(script).main
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.chdir(cwd)
        mp.delenv("ZEROPP_DEBUG", raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except Exception:  # noqa: BLE001  (the interpreter's last resort)
            traceback.print_exc()
            code = 1
    out = capfd.readouterr()
    return subprocess.CompletedProcess([script, *args], code, out.out, out.err)


# --- --help -------------------------------------------------------------------------------

@pytest.mark.parametrize("script,cfg,shown,hidden", [
    ("train.py", Config(), ("model", "optim", "zero_optimization"), ("finetune",)),
    ("finetune.py", Config(), ("finetune", "finetune.lora", "optim"), ("model", "data.vocab_size", "data.json_key")),
    ("rlhf.py", RLHFConfig(), ("models", "ppo", "grpo", "generation"), ("finetune", "tensor_parallel")),
], ids=["train", "finetune", "rlhf"])
def test_help_shows_usage_and_every_key_with_type_default_and_description(script, cfg, shown, hidden, tmp_path,
                                                                          capfd):
    for flag in ("-h", "--help"):
        result = call_entry(capfd, script, flag, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: python {script}")
        out = result.stdout
    for section in shown:
        assert f"\n{section}:" in out, section
    for key, cls, doc in all_fields(cfg):
        if any(key == h or key.startswith(h + ".") for h in hidden):
            assert f"  --{key} " not in out, key
            continue
        line = next((line for line in out.splitlines() if line.startswith(f"  --{key} ")), None)
        assert line is not None and "(default: " in line, key
        first_words = " ".join(doc.split()[:4])
        assert first_words in " ".join(out.split()), (key, first_words)  # the description
    if script == "rlhf.py":  # after a stage too
        assert call_entry(capfd, script, "ppo", "--help", cwd=tmp_path).stdout == out


def test_every_config_class_documents_every_field():
    """What --help draws on, for every dataclass of every entry point's config."""
    classes = {cls for cfg in (Config(), RLHFConfig()) for _, cls, _ in all_fields(cfg)}
    assert len(classes) >= 15
    for cls in classes:
        assert all(doc.strip() for doc in field_docs(cls).values()), cls


def test_check_cuda_help_from_another_directory_without_pythonpath(tmp_path):
    """As run on a GPU machine: `python scripts/check_cuda.py -h`, from anywhere, no PYTHONPATH."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda.py"), "-h"], cwd=tmp_path,
                            env={**environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: check_cuda.py") and "Checks that need a CUDA GPU" in result.stdout


# --- user errors: one line; --debug: the traceback -----------------------------------------

def one_line_error(result, *expected: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


@pytest.mark.parametrize("script,args,key", [
    ("train.py", ["--optim.learning_rate", "1e-3"], "optim.learning_rate"),
    ("finetune.py", ["--finetune.lora.rank", "4"], "finetune.lora.rank"),
    ("rlhf.py", ["ppo", "--ppo.epochz", "2"], "ppo.epochz"),
], ids=["train", "finetune", "rlhf"])
def test_a_bad_key_is_one_line_and_debug_shows_the_traceback(script, args, key, tmp_path, capfd):
    """In a real interpreter (the script's `__main__`, its exit status and all it writes to stderr),
    and in this process with --debug or ZEROPP_DEBUG=1."""
    one_line_error(run_entry(script, *args, cwd=tmp_path), f"{script}: config error: unknown config key {key!r}")
    for result in (call_entry(capfd, script, *args, "--debug", cwd=tmp_path),
                   call_entry(capfd, script, *args, cwd=tmp_path, ZEROPP_DEBUG="1")):
        assert result.returncode != 0
        assert "Traceback (most recent call last)" in result.stderr and key in result.stderr


def test_run_errors_are_one_line_naming_file_key_and_value(hf_dirs, synthetic, tmp_path, capfd):  # noqa: F811 (fixtures)
    """Data, LoRA target, model type and checkpoint errors raised inside the run: one line, exit 1."""
    one_line_error(call_entry(capfd, "train.py", "--data.path", str(tmp_path / "absent.txt"), cwd=tmp_path),
                   "train.py: error: data.path", "absent.txt", "no such file")
    base = ft_args(hf_dirs["llama"], synthetic, tmp_path / "out")
    one_line_error(call_entry(capfd, "finetune.py", *base, "--finetune.lora.r", "4", "--finetune.lora.targets",
                              "q_proj,qkv", cwd=tmp_path),
                   "finetune.py: error: finetune.lora:", "['qkv'] match no nn.Linear")
    bert = tmp_path / "bert"
    shutil.copytree(hf_dirs["llama"], bert)
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 640}))
    one_line_error(call_entry(capfd, "finetune.py", *ft_args(bert, synthetic, tmp_path / "out"), cwd=tmp_path),
                   "finetune.hf_checkpoint", "config.json: model_type='bert' is not supported")
    one_line_error(call_entry(capfd, "finetune.py", *base, "--resume", str(tmp_path / "nowhere"), cwd=tmp_path),
                   "resume:", "nowhere is not a checkpoint directory")
    result = call_entry(capfd, "finetune.py", *base, "--resume", str(tmp_path / "nowhere"), "--debug", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr


TINY_RUN = ("--model.preset", "gpt2-tiny", "--data.vocab_size", "512", "--data.seq_len", "32", "--train.steps", "2",
            "--train.micro_batch_size", "2", "--train.eval_batches", "1", "--train.progress_bar", "false",
            "--train.tensorboard", "false")


@pytest.fixture(scope="module")
def token_store(tokenizer_dir, tmp_path_factory) -> Path:  # noqa: F811
    """A preprocessed data set (.bin/.idx prefix) of tokenizer_dir's ids: 200 documents of 64 tokens."""
    prefix = tmp_path_factory.mktemp("store") / "tokens"
    ids = torch.randint(0, 600, (200, 64), generator=torch.Generator().manual_seed(0)).numpy()
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for row in ids:
            builder.add_document(row)
    return prefix


def store_copy(token_store: Path, tmp_path: Path, suffix: str = "", keep: int = 0) -> Path:
    """A copy of token_store whose `suffix` file (.bin or .idx) keeps only its first `keep` bytes."""
    prefix = tmp_path / "store" / "tokens"
    prefix.parent.mkdir()
    for ext in (".bin", ".idx"):
        data = Path(f"{token_store}{ext}").read_bytes()
        Path(f"{prefix}{ext}").write_bytes(data[:keep] if ext == suffix else data)
    return prefix


@pytest.mark.parametrize("args,expected", [
    (["--model.n_layer", "0"], ["model.n_layer: value 0 is out of range; expected an integer >= 1"]),
    (["--model.n_head", "3"], ["model.n_head: value 3 does not divide model.d_model 64", "expected a divisor of 64"]),
    (["--model.d_model", "66"], ["model.d_model: value 66 is not a multiple of model.n_head 4"]),
    (["--model.preset", "llama-tiny", "--model.n_kv_head", "3"], ["model.n_kv_head: value 3 does not divide "
                                                                   "model.n_head 4 (from preset 'llama-tiny')"]),
    (["--model.preset", "llama-tiny", "--model.n_head", "64"], ["model.n_head: value 64", "odd head width",
                                                                 "RoPE"]),
    (["--model.d_ff", "-1"], ["model.d_ff: value -1 is out of range"]),
    (["--model.make_vocab_size_divisible_by", "0"], ["model.make_vocab_size_divisible_by: value 0"]),
    (["--model.preset", "gpt3"], ["model.preset: value 'gpt3' is not a preset; expected one of gpt2,", "llama-tiny"]),
    (["--data.vocab_size", "0"], ["data.vocab_size: value 0 is out of range; expected an integer above 260"]),
], ids=["n_layer", "n_head", "d_model", "n_kv_head", "rope_head_dim", "d_ff", "vocab_multiple", "preset",
        "vocab_size"])
def test_a_model_or_vocabulary_no_run_can_use_is_one_line(args, expected, tmp_path, capfd):
    """Refused with the config, before any data is read: the key, the value and what was expected
    (not ModelConfig's ValueError, a ZeroDivisionError or SentencePiece's internal error)."""
    result = call_entry(capfd, "train.py", *TINY_RUN, "--train.out_dir", str(tmp_path / "out"), *args, cwd=tmp_path)
    assert result.returncode == 1
    one_line_error(result, "train.py: error: ", *expected)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("suffix,keep,expected", [
    (".bin", 20000, ["tokens.bin: 20000 bytes, but ", "tokens.idx lists 12800 tokens of uint16 = 25600 bytes"]),
    (".idx", 2000, ["tokens.idx: 2000 bytes, expected 4042 for 200 sequences"]),
    (".idx", 20, ["tokens.idx: 20 bytes, shorter than the 34-byte header"]),
], ids=["bin", "idx", "idx_header"])
def test_a_truncated_token_store_is_one_line(suffix, keep, expected, token_store, tokenizer_dir,  # noqa: F811
                                             tmp_path, capfd):
    """A preprocessed data set's .bin or .idx cut short: the file, its size and the size expected."""
    prefix = store_copy(token_store, tmp_path, suffix, keep)
    result = call_entry(capfd, "train.py", *TINY_RUN, "--train.out_dir", str(tmp_path / "out"), "--data.path",
                        str(prefix), "--data.tokenizer", str(tokenizer_dir), cwd=tmp_path)
    assert result.returncode == 1
    one_line_error(result, f"train.py: error: {prefix}", *expected)


@pytest.mark.parametrize("message", [
    "Error while serializing: I/O error: No space left on device (os error 28)",  # 0.8, on a full tmpfs
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
], ids=["safetensors-0.8", "older"])
def test_a_full_disk_during_a_save_is_one_line_and_leaves_nothing(message, token_store, tokenizer_dir,  # noqa: F811
                                                                   tmp_path, capfd, monkeypatch):
    """safetensors raises its own SafetensorError when the disk fills: the run ends in one line
    naming the checkpoint, the partial save is gone, and `latest` and the previous checkpoint are
    as they were."""
    real_save_file = zeropp.checkpoint.save_file

    def save_file(tensors, filename, metadata=None):
        if ".tmp-step_00000002" not in filename:
            return real_save_file(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"x" * 1000)  # what fitted
        raise SafetensorError(message)

    monkeypatch.setattr(zeropp.checkpoint, "save_file", save_file)
    out = tmp_path / "out"
    result = call_entry(capfd, "train.py", *TINY_RUN, "--train.out_dir", str(out), "--train.checkpoint_interval", "1",
                        "--data.path", str(store_copy(token_store, tmp_path)), "--data.tokenizer", str(tokenizer_dir),
                        cwd=tmp_path)
    assert result.returncode == 1
    root = out / "checkpoints"
    one_line_error(result, f"train.py: error: the disk is full: checkpoint {root / 'step_00000002'} not saved",
                   "No space left on device", "model.safetensors", f"{root / 'latest'} still names step_00000001")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert (root / "latest").read_text().strip() == "step_00000001"
    verify_checkpoint(root / "step_00000001")


def test_rlhf_run_errors_are_one_line(tmp_path, capfd):
    one_line_error(call_entry(capfd, "rlhf.py", "rl", cwd=tmp_path), "unknown stage 'rl'")
    one_line_error(call_entry(capfd, "rlhf.py", "dpo", "--data.preferences", str(tmp_path / "pairs.jsonl"),
                              "--models.sft", str(tmp_path / "no_sft"), cwd=tmp_path),
                   "models.sft", "no_sft: no Hugging Face model there")


# --- finetune.lora.init_from --------------------------------------------------------------

def test_lora_init_from_continues_a_peft_adapter(hf_dirs, synthetic, tmp_path):  # noqa: F811 (fixtures)
    """A LoRA run's adapters, saved as a PEFT adapter, start a new fine-tune: its adapters equal the
    saved ones and its loss on the validation batches equals the first run's final one; the
    checkpoints do not record init_from; an adapter that is not the configured LoRA is refused,
    naming the file, key, value and what was expected."""
    from export.peft import export_peft_adapter

    hf_dir = hf_dirs["llama"]
    first = train(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "a", *LORA, "--train.steps", "4",
                                     "--train.export_hf", "false")))
    adapter = export_peft_adapter(first.checkpoint, tmp_path / "adapter")
    saved = load_file(first.checkpoint / "model.safetensors")

    args = ft_args(hf_dir, synthetic, tmp_path / "b", *LORA, "--finetune.lora.init_from", str(adapter),
                   "--train.steps", "1", "--train.export_hf", "false")
    trainer = Trainer(ft_config(*args))
    try:
        loaded = {name: p.detach() for name, p in trainer.runtime.module.named_parameters() if ".lora_" in name}
        assert len(loaded) == 2 * 2 * len(LORA_TARGETS)
        for name, tensor in loaded.items():
            assert torch.equal(tensor, saved[name]), name
        assert trainer.evaluate() == pytest.approx(first.val_loss, rel=0, abs=1e-6)
        second = trainer.run()
    finally:
        trainer.close()
    assert second.losses[1] < first.losses[1]  # it starts where the first run ended, not from B = 0
    state = json.loads((second.checkpoint / "state.json").read_text())
    assert set(state["lora"]) == {"r", "alpha", "dropout", "targets"}
    # Resuming that run without init_from is the same LoRA.
    resumed = ft_config(*ft_args(hf_dir, synthetic, tmp_path / "b", *LORA, "--train.steps", "2",
                                 "--train.export_hf", "false", "--resume", "latest"))
    assert train(resumed).losses.keys() == {2}

    with pytest.raises(ConfigError, match=r"finetune.lora.init_from .*adapter.*r=4, lora_alpha=8.0.*r=8.*"
                                          r"finetune.lora.r / alpha"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "c", *LORA, "--finetune.lora.r", "8",
                                   "--finetune.lora.init_from", str(adapter))))
    with pytest.raises(ConfigError, match=r"finetune.lora.init_from .*adapts .*up_proj.*set finetune.lora.targets"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "c", *LORA, "--finetune.lora.targets",
                                   "q_proj,k_proj,v_proj,o_proj", "--finetune.lora.init_from", str(adapter))))
    with pytest.raises(ConfigError, match=r"finetune.lora.init_from .*absent.*adapter_config.json not found"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "c", *LORA,
                                   "--finetune.lora.init_from", str(tmp_path / "absent"))))
    with pytest.raises(ConfigError, match="finetune.lora.init_from applies to LoRA, but finetune.lora.r is 0"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "c", "--finetune.lora.init_from", str(adapter))))


# --- the cross-node report ------------------------------------------------------------------

def test_cross_node_report_on_one_node_says_so_instead_of_a_table_of_zeros():
    zero3 = {"forward gather": 0, "backward gather": 0, "gradient reduce": 0}
    step = {"forward gather": {"cross_node_sent": 0, "sent": 4096}}
    line = cross_node_report(step, zero3, "ZeRO-3 + qwZ int8")
    assert line == "cross-node bytes (ZeRO-3 + qwZ int8): single node: no cross-node traffic"
    table = cross_node_report({"forward gather": {"cross_node_sent": 2**20}}, {**zero3, "forward gather": 2**21}, "x")
    assert "nan" not in table.split("\n", 1)[1].split("forward gather")[1].split("\n")[0]
    assert "0.50" in table and "total" in table
    assert "nan" not in table and table.split("backward gather")[1].split("\n")[0].split()[-1] == "-"  # 0 / 0
