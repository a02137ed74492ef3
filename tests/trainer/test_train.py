"""End-to-end training: determinism, bit-exact resume, DDP against one process, clear errors."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from data.tokenizer import load_tokenizer
from trainer.spawn import free_port, run_ranks
from trainer.checkpoint import CheckpointError, consolidated_model
from trainer.config import ConfigError, parse_args
from trainer.loop import Trainer, train
from trainer.pretrain_data import DataError

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = (ROOT / ".." / "shared" / "data" / "tinyshakespeare.txt").resolve()
needs_shakespeare = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not present")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """200 KB of Shakespeare, or the embedded corpus's first 200 KB where ../shared is absent."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    if SHAKESPEARE.is_file():
        text = SHAKESPEARE.read_text()[:200_000]
    else:
        from data.corpus import default_corpus

        text = default_corpus(tmp_path_factory.mktemp("cache")).read_text()[:200_000]
    path.write_text(text)
    return path


def tiny_args(corpus, out_dir, cache_dir, *extra):
    """A short run computing in fp32 (the tests compare against fp32 references; `precision: auto`
    would pick bf16 on a CPU with native bf16)."""
    return [
        "--model.preset", "gpt2-tiny", "--data.path", str(corpus), "--data.vocab_size", "512",
        "--data.seq_len", "32", "--data.cache_dir", str(cache_dir), "--data.workers", "1",
        "--train.micro_batch_size", "4", "--train.steps", "8", "--train.log_interval", "2",
        "--train.eval_interval", "4", "--train.eval_batches", "2", "--train.out_dir", str(out_dir),
        "--train.tensorboard", "false", "--train.progress_bar", "false", "--optim.warmup_steps", "2",
        "--train.precision", "fp32", *extra,
    ]


def test_same_seed_same_losses_and_resume_is_bit_identical(corpus, tmp_path):
    cache = tmp_path / "cache"
    full = train(parse_args(tiny_args(corpus, tmp_path / "a", cache, "--train.checkpoint_interval", "4")))
    again = train(parse_args(tiny_args(corpus, tmp_path / "b", cache)))
    assert full.losses == again.losses  # same seed, same batches, same numbers
    assert len(full.losses) == 8 and full.losses[8] < full.losses[1]

    # Resume the first run from its step-4 checkpoint into a fresh output dir.
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000004"
    resumed = train(parse_args(tiny_args(corpus, tmp_path / "c", cache, "--resume", str(ckpt))))
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert resumed.losses[step] == full.losses[step], f"step {step} differs after resume"
    assert resumed.val_loss == full.val_loss

    final_a = load_file(str(tmp_path / "a" / "checkpoints" / "step_00000008" / "model.safetensors"))
    final_c = load_file(str(tmp_path / "c" / "checkpoints" / "step_00000008" / "model.safetensors"))
    assert final_a.keys() == final_c.keys()
    assert all((final_a[k] == final_c[k]).all() for k in final_a)

    # The `latest` pointer names the newest complete checkpoint; no temporary dirs remain.
    root = tmp_path / "a" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000008"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000008"]
    metrics = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {"lm loss", "grad norm", "tokens/s", "MFU %", "validation loss"} <= set().union(*metrics)


def test_gradient_accumulation_matches_the_big_batch(corpus, tmp_path):
    cache = tmp_path / "cache"
    big = train(parse_args(tiny_args(corpus, tmp_path / "big", cache, "--train.steps", "3")))
    accum = train(parse_args(tiny_args(corpus, tmp_path / "acc", cache, "--train.steps", "3",
                                       "--train.micro_batch_size", "2", "--train.grad_accum", "2")))
    for step in big.losses:
        assert abs(big.losses[step] - accum.losses[step]) < 1e-5


def test_bad_inputs_give_clear_errors_and_destroy_nothing(corpus, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="no-such.txt"):
        Trainer(parse_args(tiny_args(tmp_path / "no-such.txt", tmp_path / "x", cache)))
    with pytest.raises(ConfigError, match="train.stepz"):
        parse_args(tiny_args(corpus, tmp_path / "x", cache, "--train.stepz", "3"))
    with pytest.raises(ConfigError, match="'many'"):
        parse_args(tiny_args(corpus, tmp_path / "x", cache, "--train.steps", "many"))

    train(parse_args(tiny_args(corpus, tmp_path / "run", cache, "--train.steps", "2")))
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    weights = ckpt / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "run", cache, "--resume", "latest")))
    weights.write_bytes(original)
    with pytest.raises(CheckpointError, match="no checkpoint pointer"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "empty", cache, "--resume", "latest")))
    with pytest.raises(ConfigError, match="another model"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "run", cache, "--resume", "latest", "--model.n_layer", "3")))


@needs_shakespeare
def test_torchrun_ddp_first_step_equals_single_process_and_learns(tmp_path):
    cache = tmp_path / "cache"
    args = [
        "--model.preset", "gpt2-tiny", "--data.path", str(SHAKESPEARE), "--data.vocab_size", "512",
        "--data.seq_len", "64", "--data.cache_dir", str(cache), "--train.steps", "30",
        "--train.log_interval", "1", "--train.eval_interval", "30", "--train.eval_batches", "4",
        "--train.tensorboard", "false", "--train.progress_bar", "false", "--optim.lr", "3e-3",
    ]
    # One process with micro-batch 8 sees exactly what 2 DDP ranks with micro-batch 4 see.
    single = train(parse_args(args + ["--train.micro_batch_size", "8", "--train.steps", "1",
                                      "--train.out_dir", str(tmp_path / "single")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(ROOT / "train.py"), *args, "--train.micro_batch_size", "4",
           "--train.out_dir", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    losses = {m["step"]: m["lm loss"] for m in metrics if "lm loss" in m}
    val = [m["validation loss"] for m in metrics if "validation loss" in m]
    assert abs(losses[1] - single.losses[1]) < 1e-5
    assert val[-1] < losses[1] - 1.0, f"DDP validation loss {val[-1]} did not fall from {losses[1]}"
    assert "checkpoint:" in proc.stdout


def test_jsonl_corpus_trains_tokenizer_on_its_documents(corpus, tmp_path):
    lines = [p for p in corpus.read_text().split("\n\n") if p.strip()][:400]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps({"body": p}) for p in lines))
    cfg = parse_args(tiny_args(source, tmp_path / "run", tmp_path / "cache", "--data.json_key", "body",
                               "--train.steps", "2"))
    trainer = Trainer(cfg)
    spm_text = next((tmp_path / "cache").glob("docs-*/documents.txt")).read_text()
    assert '"body"' not in spm_text and lines[0] in spm_text  # plain documents, not JSON lines
    assert trainer.data.tokenizer.decode(trainer.data.tokenizer.encode(lines[1])) == lines[1]
    with pytest.raises(Exception, match="text"):
        Trainer(parse_args(tiny_args(source, tmp_path / "run2", tmp_path / "cache2", "--train.steps", "2")))


def _train_on_ranks(rank, world, argv):
    result = train(parse_args(argv))
    return result.losses, result.val_loss


def _train_on_ranks_with_log(rank, world, argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = train(parse_args(argv))
    return result.losses, result.val_loss, out.getvalue()


ZERO3_FP32 = ("--zero_optimization.stage", "3", "--zero_optimization.communication_data_type", "fp32")


def test_zero3_training_matches_one_process_resumes_reshards_and_exports(corpus, tmp_path):
    cache = tmp_path / "cache"
    reference = train(parse_args(tiny_args(corpus, tmp_path / "ref", cache, "--train.micro_batch_size", "8")))
    argv = tiny_args(corpus, tmp_path / "zero", cache, *ZERO3_FP32, "--train.checkpoint_interval", "4",
                     "--train.export_hf", "true")
    losses, val = run_ranks(_train_on_ranks, 2, args=(argv,))[0]  # 2 ranks x micro-batch 4
    assert max(abs(losses[s] - reference.losses[s]) for s in reference.losses) < 1e-5
    assert abs(val - reference.val_loss) < 1e-5

    # Resume from the step-4 shards on the same 2 ranks: bit-identical.
    ckpt = tmp_path / "zero" / "checkpoints" / "step_00000004"
    assert (ckpt / "manifest.json").is_file() and (ckpt / "shards_rank00001.safetensors").is_file()
    resumed, _ = run_ranks(_train_on_ranks, 2, args=(tiny_args(
        corpus, tmp_path / "resumed", cache, *ZERO3_FP32, "--resume", str(ckpt)),))[0]
    assert {s: resumed[s] for s in range(5, 9)} == {s: losses[s] for s in range(5, 9)}

    # ... and on one process with the same global batch: resharded 2 -> 1, within 1e-5.
    one = train(parse_args(tiny_args(corpus, tmp_path / "one", cache, *ZERO3_FP32, "--resume", str(ckpt),
                                     "--train.micro_batch_size", "8")))
    assert max(abs(one.losses[s] - losses[s]) for s in range(5, 9)) < 1e-5
    # Resharded with this run's own micro-batch 4: the checkpoint's global batch 8 is kept
    # (grad_accum 1 -> 2), not silently halved; one that no grad_accum can give is refused.
    with contextlib.redirect_stdout(io.StringIO()) as log:
        kept = train(parse_args(tiny_args(corpus, tmp_path / "kept", cache, *ZERO3_FP32, "--resume", str(ckpt))))
    assert max(abs(kept.losses[s] - losses[s]) for s in range(5, 9)) < 1e-5
    assert f"resumed from checkpoint {ckpt} (step 4, 32 samples consumed; global batch 8 = micro-batch 4 x " \
           "grad_accum 2 x 1 data-parallel ranks, as the checkpoint's: every step draws the same samples" in \
           log.getvalue(), log.getvalue()
    with pytest.raises(ConfigError, match=r"global batch of 8 samples per step; this run's is 3 .* divides 8"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "x", cache, *ZERO3_FP32, "--resume", str(ckpt),
                                     "--train.micro_batch_size", "3")))

    # The consolidated Hugging Face export loads in transformers with our logits.
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "zero" / "hf").eval()
    ours = consolidated_model(tmp_path / "zero" / "checkpoints" / "step_00000008").eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-4)
    tokenizer = load_tokenizer(tmp_path / "zero" / "hf")  # with its special ids in config.json
    assert (hf.config.eos_token_id, hf.config.bos_token_id) == (tokenizer.eos_id, tokenizer.bos_id)

    # Misuse: an unsupported stage, a knob that contradicts stage 0, a checkpoint of the other format.
    with pytest.raises(ConfigError, match="stage=2"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "x", cache, "--zero_optimization.stage", "2")))
    with pytest.raises(ConfigError, match="communication_data_type.*stage is 0"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "x", cache,
                                     "--zero_optimization.communication_data_type", "fp32")))
    with pytest.raises(ConfigError, match="zero3-sharded"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "x", cache, "--resume", str(ckpt))))


def test_tensor_parallel_training_matches_one_process_and_exports(corpus, tmp_path):
    """train.py with tensor_parallel.size 2 x ZeRO-3 DP 2: the ranks of a TP group read the same
    batches, so the losses, the validation loss and the exported model are one process's."""
    cache = tmp_path / "cache"
    reference = train(parse_args(tiny_args(corpus, tmp_path / "ref", cache, "--train.micro_batch_size", "8",
                                           "--train.export_hf", "true")))
    argv = tiny_args(corpus, tmp_path / "tp", cache, *ZERO3_FP32, "--tensor_parallel.size", "2",
                     "--tensor_parallel.partitions", "2", "--train.export_hf", "true")
    losses, val = run_ranks(_train_on_ranks, 4, args=(argv,))[0]  # DP 2 x micro-batch 4
    assert max(abs(losses[s] - reference.losses[s]) for s in reference.losses) < 1e-5
    assert abs(val - reference.val_loss) < 1e-5
    ours = load_file(str(tmp_path / "tp" / "hf" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "ref" / "hf" / "model.safetensors"))
    # Adam's default eps (1e-8) turns last-bit differences of the summation order into ~1e-5 on
    # weights whose gradient is near zero (tests/zeropp/test_tensor_parallel.py holds 1e-5 with eps 1e-6).
    assert ours.keys() == theirs.keys() and max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-4


def test_zeropp_on_two_nodes_of_two_tracks_the_reference(corpus, tmp_path):
    cache = tmp_path / "cache"
    reference = train(parse_args(tiny_args(corpus, tmp_path / "ref", cache, "--train.micro_batch_size", "8")))
    argv = tiny_args(corpus, tmp_path / "zpp", cache, "--train.micro_batch_size", "2",
                     "--zero_optimization.stage", "3", "--zero_optimization.ranks_per_node", "2",
                     "--zero_optimization.zero_quantized_weights", "true",
                     "--zero_optimization.zero_hpz_partition_size", "2",
                     "--zero_optimization.zero_quantized_gradients", "true",
                     "--zero_optimization.zero_quantization_block_size", "64")
    losses, val, log = run_ranks(_train_on_ranks_with_log, 4, args=(argv,), ranks_per_node=2)[0]
    assert losses[8] < losses[1] - 0.2  # it learns
    assert max(abs(losses[s] - reference.losses[s]) / reference.losses[s] for s in losses) < 0.02
    assert abs(val - reference.val_loss) / reference.val_loss < 0.02
    metrics = [json.loads(line) for line in (tmp_path / "zpp" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["cross-node sent (MB)"] > 0 for m in metrics if "lm loss" in m)
    # The log states the predicted traffic and model state first, and ends with the last step's
    # cross-node bytes next to the prediction: equal, collective by collective.
    assert "predicted traffic per step, this rank: forward gather" in log and "model state per rank:" in log
    report = log[log.index("cross-node bytes sent by this rank"):]
    rows = dict((tag, (a, b)) for tag, a, b in
                re.findall(r"^\s+(forward gather|backward gather|gradient reduce|total)\s+(\S+)\s+(\S+)", report, re.M))
    assert rows.keys() == {"forward gather", "backward gather", "gradient reduce", "total"}, report
    assert all(measured == predicted for measured, predicted in rows.values()), report
    assert rows["backward gather"][0] == "0.000" and float(rows["forward gather"][0]) > 0  # hpZ: inside the node


def test_diloco_sites_train_log_their_exchange_and_resume_mid_cycle_bit_identical(corpus, tmp_path):
    """2 sites of one ZeRO-3 rank (a node each), H 2, int8 exchange, each applied one step after it is
    sent: the log names DiLoCo, predicts the outer bytes and the outer state's memory, and ends with
    the exchange's measured cross-node bytes per step equal to the prediction; the export reads the
    checkpoint's site 0; resumed from step 4 (its exchange in flight) the losses are bit-identical;
    a run without DiLoCo is refused that checkpoint, naming both layouts."""
    cache = tmp_path / "cache"
    diloco = ("--diloco.enabled", "true", "--diloco.site_size", "1", "--diloco.inner_steps", "2",
              "--diloco.compression", "int8", "--diloco.delay", "1", "--zero_optimization.ranks_per_node", "1")
    argv = tiny_args(corpus, tmp_path / "a", cache, *ZERO3_FP32, *diloco, "--train.checkpoint_interval", "4",
                     "--train.export_hf", "true")
    losses, _, log = run_ranks(_train_on_ranks_with_log, 2, args=(argv,))[0]
    # The export reads site 0's files (at step 8 the sites differ: the exchange sent then is in flight).
    final = dict(consolidated_model(tmp_path / "a" / "checkpoints" / "step_00000008").named_parameters())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "hf")
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in final.values())
    assert "DiLoCo on: 2 sites x 1 ranks, H 2, each exchange overlapped with the next 1 inner step, outer SGD " \
           "lr 0.7, Nesterov momentum 0.5, pseudo-gradient as int8 blocks of 256 with error feedback" in log, log
    assert re.search(r"predicted traffic per step, this rank: .*diloco outer \d", log), log
    # a site per node: the end-of-run table has the exchange's cross-node bytes per step, the run's mean
    outer_row = re.search(r"^\s+diloco outer \(mean\)\s+(\S+)\s+(\S+)\s+0\.000", log, re.M)
    assert outer_row and outer_row[1] == outer_row[2] and float(outer_row[1]) > 0, log
    # a site of one rank holds the whole fp32 master; the outer state is its anchor, momentum and residual
    master = float(re.search(r"model state per rank: .*master ([0-9.]+) MB", log)[1])
    outer = float(re.search(r"model state per rank: .*diloco outer state ([0-9.]+) MB", log)[1])
    assert abs(outer - 3 * master) <= 0.02, (outer, master)
    # and the predicted peak counts them, with AdamW's two moments of the master to come
    states = float(re.search(r"model state per rank: ([0-9.]+) MB", log)[1])
    predicted = float(re.search(r"predicted peak memory per rank: .*model states ([0-9.]+)", log)[1])
    assert abs(predicted - (states + 2 * master)) <= 0.1, (predicted, states, master)
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "state.json").read_text())["diloco"] == {"sites": 2, "site_size": 1}
    resumed, _ = run_ranks(_train_on_ranks, 2, args=(tiny_args(
        corpus, tmp_path / "b", cache, *ZERO3_FP32, *diloco, "--resume", str(ckpt)),))[0]
    assert {s: resumed[s] for s in range(5, 9)} == {s: losses[s] for s in range(5, 9)}
    with pytest.raises(ConfigError, match=r"DiLoCo sites \{'sites': 2, 'site_size': 1\}, this run has None"):
        Trainer(parse_args(tiny_args(corpus, tmp_path / "c", cache, *ZERO3_FP32, "--resume", str(ckpt))))
