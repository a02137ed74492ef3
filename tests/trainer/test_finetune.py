"""finetune.py end to end: tiny Hugging Face LLaMA / OPT checkpoints made with transformers,
SFT data (Alpaca from ../shared/data, and a synthetic set made here), DDP / ZeRO-3 / ZeRO++,
LoRA, prompt masking against a hand-computed loss, exact resume, merged HF export."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import finetune
from data.corpus import default_corpus
from data.datasets import ResumableBatchSampler
from data.tokenizer import load_tokenizer
from models.hf import load_hf_checkpoint
from models.lora import apply_lora
from trainer.spawn import free_port, run_ranks
from trainer.config import ConfigError, from_dict, parse_args
from trainer.loop import Trainer, train
from trainer.pretrain_data import DataError
from zeropp.checkpoint import consolidated_state_dict

ROOT = Path(__file__).resolve().parents[2]
ALPACA = (ROOT / ".." / "shared" / "data" / "alpaca_en_demo.json").resolve()
needs_alpaca = pytest.mark.skipif(not ALPACA.is_file(), reason=f"{ALPACA} not present (see ../shared/data/README.md)")
EOS, BOS, PAD = 0, 1, 2  # the tokenizer's special tokens, in training order
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]
LORA = ("--finetune.lora.r", "4", "--finetune.lora.alpha", "8", "--finetune.lora.targets", ",".join(LORA_TARGETS))
ZERO3_FP32 = ("--zero_optimization.stage", "3", "--zero_optimization.communication_data_type", "fp32")
ZEROPP_2X2 = ("--zero_optimization.stage", "3", "--zero_optimization.ranks_per_node", "2",
              "--zero_optimization.zero_quantized_weights", "true", "--zero_optimization.zero_hpz_partition_size", "2",
              "--zero_optimization.zero_quantized_gradients", "true",
              "--zero_optimization.zero_quantization_block_size", "64")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A 600-token byte-level BPE tokenizer.json, trained on the embedded corpus (no shared data needed)."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(default_corpus(tmp_path_factory.mktemp("cache")))], trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": "<s>", "pad_token": "<pad>"}))
    return directory


def auto_model():
    """transformers' AutoModelForCausalLM, imported where used: the ranks that run_ranks spawns
    import this module, and transformers would add seconds to each one's start."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def hf_config(kind: str):
    from transformers import LlamaConfig, OPTConfig

    common = dict(vocab_size=640, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if kind == "llama":  # grouped-query attention, untied head
        return LlamaConfig(intermediate_size=128, num_key_value_heads=2, **common)
    return OPTConfig(ffn_dim=128, **common)  # tied head


@pytest.fixture(scope="module")
def hf_dirs(tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """kind -> a Hugging Face directory with a randomly initialized model and the tokenizer beside it."""
    dirs = {}
    for kind in ("llama", "opt"):
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(kind)
        auto_model().from_config(hf_config(kind)).save_pretrained(directory)
        for file in tokenizer_dir.iterdir():
            shutil.copy(file, directory)
        dirs[kind] = directory
    return dirs


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """240 short Alpaca records (repeat / reverse four words), 64 to 75 tokens each."""
    words = "apple river stone cloud green quick seven music paper light north table".split()
    gen = torch.Generator().manual_seed(0)
    records = []
    for i in range(240):
        chosen = [words[j] for j in torch.randperm(len(words), generator=gen)[:4]]
        reverse = i % 2 == 0
        records.append({"instruction": "Reverse the words." if reverse else "Repeat the words.",
                        "input": " ".join(chosen), "output": " ".join(chosen[::-1] if reverse else chosen)})
    path = tmp_path_factory.mktemp("sft") / "synthetic.json"
    path.write_text(json.dumps(records))
    return path


def ft_args(hf_dir, data, out_dir, *extra) -> list[str]:
    return ["--finetune.hf_checkpoint", str(hf_dir), "--data.path", str(data), "--data.seq_len", "96",
            "--train.micro_batch_size", "4", "--train.steps", "8", "--train.log_interval", "2",
            "--train.eval_interval", "4", "--train.eval_batches", "2", "--train.out_dir", str(out_dir),
            "--train.tensorboard", "false", "--train.progress_bar", "false", "--optim.warmup_steps", "2",
            "--optim.lr", "3e-3", "--train.precision", "fp32",  # fp32 references, as tiny_args
            "--data.cache_dir", str(Path(out_dir).parent / "sft_cache"), *extra]


def ft_config(*args):
    return parse_args(list(args), finetune.defaults())


def run(cfg):
    """Train; also return the Trainer to look inside."""
    trainer = Trainer(cfg)
    try:
        return trainer, trainer.run()
    finally:
        trainer.close()


def test_first_loss_is_transformers_cross_entropy_over_response_tokens_only(hf_dirs, synthetic, tmp_path):
    hf_dir = hf_dirs["llama"]
    trainer, result = run(ft_config(*ft_args(hf_dir, synthetic, tmp_path, "--train.steps", "1",
                                             "--train.export_hf", "false")))
    assert trainer.data.dataset.num_skipped == 0  # dataset index = record index
    first = next(iter(ResumableBatchSampler(trainer.data.train_indices, 4, 0, 1, trainer.cfg.train.seed)))

    # Reference: transformers' model on each example alone, the Alpaca prompt written out here,
    # tokenized with the tokenizers library, cross-entropy summed over response + EOS tokens.
    records = json.loads(synthetic.read_text())
    rust = RustTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    hf = auto_model().from_pretrained(hf_dir).eval()
    masked, unmasked, n_masked, n_all = 0.0, 0.0, 0, 0
    for i in first:
        r = records[i]
        prompt = f"### Instruction:\n{r['instruction']}\n\n### Input:\n{r['input']}\n\n### Response:\n"
        prompt_ids = [BOS] + rust.encode(prompt, add_special_tokens=False).ids
        response_ids = rust.encode(r["output"], add_special_tokens=False).ids + [EOS]
        ids = torch.tensor(prompt_ids + response_ids)
        assert len(ids) <= 96 + 1  # not truncated
        with torch.no_grad():
            ce = F.cross_entropy(hf(ids[None, :-1]).logits[0], ids[1:], reduction="none")
        masked += ce[len(prompt_ids) - 1:].sum().item()
        n_masked += len(response_ids)
        unmasked += ce.sum().item()
        n_all += len(ids) - 1
    assert abs(result.losses[1] - masked / n_masked) < 1e-5
    assert abs(unmasked / n_all - masked / n_masked) > 1e-3  # masking the prompt does change the loss


def test_lora_trains_only_adapters_resumes_exactly_and_exports_merged(hf_dirs, synthetic, tmp_path):
    hf_dir = hf_dirs["llama"]
    lora = (*LORA, "--finetune.lora.dropout", "0.1")  # dropout: resume must restore the RNG too
    full = train(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "a", *lora, "--train.checkpoint_interval", "4",
                                    "--train.eval_at_start", "true")))
    assert full.val_losses[8] < full.val_losses[0] - 0.05, full.val_losses  # validation perplexity drops

    # Only the adapters moved: the base weights are bit-identical to the HF checkpoint's.
    final = load_file(str(tmp_path / "a" / "checkpoints" / "step_00000008" / "model.safetensors"))
    base = load_hf_checkpoint(hf_dir).state_dict()
    adapters = {name for name in final if ".lora_" in name}
    assert len(adapters) == 2 * 5 * 2  # layers x targets x (A, B)
    assert {name.replace(".base.", ".") for name in final.keys() - adapters} == base.keys()
    for name in final.keys() - adapters:
        assert torch.equal(final[name], base[name.replace(".base.", ".")]), name
    assert all(final[name].abs().max() > 0 for name in adapters if name.endswith("lora_B"))
    optimizer = load_file(str(tmp_path / "a" / "checkpoints" / "step_00000008" / "optimizer.safetensors"))
    assert {key.rsplit(".", 1)[0] for key in optimizer} == adapters  # only trainable parameters are optimized

    # Resume from step 4: the same losses, validation loss and weights, bit for bit.
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000004"
    resumed = train(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "b", *lora, "--resume", str(ckpt))))
    assert {s: resumed.losses[s] for s in range(5, 9)} == {s: full.losses[s] for s in range(5, 9)}
    assert resumed.val_loss == full.val_loss
    again = load_file(str(tmp_path / "b" / "checkpoints" / "step_00000008" / "model.safetensors"))
    assert all(torch.equal(again[name], final[name]) for name in final)
    with pytest.raises(ConfigError, match="LoRA adapters"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "c", *LORA, "--finetune.lora.r", "2",
                                   "--resume", str(ckpt))))

    # <out_dir>/hf is a plain HF model (adapters merged) with the unmerged model's logits.
    model = load_hf_checkpoint(hf_dir)
    apply_lora(model, LORA_TARGETS, r=4, alpha=8.0)
    model.load_state_dict(final)
    merged = auto_model().from_pretrained(tmp_path / "a" / "hf").eval()
    tokens = torch.randint(0, 600, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, model.eval()(tokens), atol=1e-5, rtol=0)
    assert (merged.config.eos_token_id, merged.config.bos_token_id) == (EOS, BOS)
    assert load_tokenizer(tmp_path / "a" / "hf").encode("apple river") == load_tokenizer(hf_dir).encode("apple river")


def _train_on_ranks(rank, world, *runs):
    """train() on every rank for each of `runs` (lists of arguments), one after the other on the same ranks:
    each run's (losses, validation losses)."""
    out = []
    for argv in runs:
        result = train(ft_config(*argv))
        out.append((result.losses, result.val_losses))
    return out


def test_lora_zero3_matches_one_process_resumes_and_keeps_base_weights(hf_dirs, synthetic, tmp_path):
    hf_dir = hf_dirs["opt"]  # tied embeddings, learned positions
    reference = train(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "ref", *LORA, "--train.micro_batch_size", "8")))
    # 2 ranks x 4 examples: the loss is the mean over the global batch's response tokens either way.
    # Then, on the same 2 ranks, a new run resumed from the first one's step-4 shards.
    ckpt = tmp_path / "zero" / "checkpoints" / "step_00000004"
    (losses, val_losses), (resumed, _) = run_ranks(_train_on_ranks, 2, args=(
        ft_args(hf_dir, synthetic, tmp_path / "zero", *LORA, *ZERO3_FP32, "--train.checkpoint_interval", "4"),
        ft_args(hf_dir, synthetic, tmp_path / "resumed", *LORA, *ZERO3_FP32, "--resume", str(ckpt))))[0]
    assert max(abs(losses[s] - reference.losses[s]) for s in reference.losses) < 1e-5
    assert abs(val_losses[8] - reference.val_loss) < 1e-5

    # The resumed run: bit-identical.
    assert {s: resumed[s] for s in range(5, 9)} == {s: losses[s] for s in range(5, 9)}

    shards = consolidated_state_dict(tmp_path / "zero" / "checkpoints" / "step_00000008")
    base = load_hf_checkpoint(hf_dir).state_dict()
    for name, tensor in shards.items():
        if ".lora_" not in name:
            assert torch.equal(tensor, base[name.replace(".base.", ".")]), name
    # The merged export (rebuilt from the shards, tied head) has the unmerged model's logits.
    model = load_hf_checkpoint(hf_dir)
    apply_lora(model, LORA_TARGETS, r=4, alpha=8.0)
    model.load_state_dict(shards)
    tokens = torch.randint(0, 600, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = auto_model().from_pretrained(tmp_path / "zero" / "hf")(tokens).logits
        torch.testing.assert_close(merged, model.eval()(tokens), atol=1e-5, rtol=0)


def _validation(metrics_file: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return {m["step"]: m["validation loss"] for m in lines if "validation loss" in m}


def _perplexity_drops(val: dict[int, float], factor: float) -> None:
    first, last = math.exp(val[min(val)]), math.exp(val[max(val)])
    assert min(val) == 0 and last < factor * first, f"validation perplexity {first:.1f} -> {last:.1f}"


ACCEPTANCE = ("--data.seq_len", "128", "--train.micro_batch_size", "2", "--train.steps", "16",
              "--train.eval_interval", "16", "--train.eval_batches", "4", "--train.eval_at_start", "true")


@needs_alpaca
def test_llama_alpaca_zeropp_two_nodes_of_two_with_torchrun(hf_dirs, tmp_path):
    """The CLI as documented: torchrun, 4 ranks as 2 nodes x 2, qwZ + hpZ + qgZ, full fine-tuning."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           str(ROOT / "finetune.py"), *ft_args(hf_dirs["llama"], ALPACA, tmp_path, *ACCEPTANCE, *ZEROPP_2X2)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO-3 + qwZ int8 + hpZ + qgZ int4" in proc.stdout and "2 node(s) x 2 rank(s)" in proc.stdout
    _perplexity_drops(_validation(tmp_path / "metrics.jsonl"), 0.5)
    assert auto_model().from_pretrained(tmp_path / "hf").config.model_type == "llama"


OPT_ZEROPP = [("alpaca", False), ("synthetic", True)]


@pytest.fixture(scope="module")
def opt_zeropp_runs(hf_dirs, synthetic, tmp_path_factory):
    """(data, lora) -> (validation losses, out_dir) of each OPT_ZEROPP run (Alpaca's where present), all on
    the same spawn of 4 ranks as 2 nodes x 2, one run after the other."""
    runs = {}
    for data, lora in OPT_ZEROPP:
        if data == "alpaca" and not ALPACA.is_file():
            continue
        path = ALPACA if data == "alpaca" else synthetic
        extra = (*LORA, "--optim.lr", "1e-2") if lora else ()
        out = tmp_path_factory.mktemp(f"opt-{data}")
        runs[data, lora] = ft_args(hf_dirs["opt"], path, out, *ACCEPTANCE, *ZEROPP_2X2, *extra), out
    results = run_ranks(_train_on_ranks, 4, args=tuple(argv for argv, _ in runs.values()), ranks_per_node=2)[0]
    return {key: (val_losses, out) for (key, (_, out)), (_, val_losses) in zip(runs.items(), results)}


@pytest.mark.parametrize("data,lora", OPT_ZEROPP)
def test_opt_zeropp_two_nodes_of_two(data, lora, opt_zeropp_runs):
    """Full fine-tuning on Alpaca; LoRA on the synthetic set, which runs without ../shared/data."""
    if data == "alpaca" and not ALPACA.is_file():
        pytest.skip(f"{ALPACA} not present (see ../shared/data/README.md)")
    val_losses, out = opt_zeropp_runs[data, lora]
    # A LoRA of a random base cannot go far: its frozen head and final norm bound the logits.
    _perplexity_drops(val_losses, 0.95 if lora else 0.5)
    assert auto_model().from_pretrained(out / "hf").config.model_type == "opt"


@pytest.mark.parametrize("preset", ["finetune_alpaca", "finetune_alpaca_lora"])
def test_presets_run(preset, hf_dirs, synthetic, tmp_path):
    """The YAML presets are valid configs that train (one step, on the synthetic set, one process)."""
    cfg = ft_config("--config", str(ROOT / "configs" / f"{preset}.yaml"),
                    *ft_args(hf_dirs["llama"], synthetic, tmp_path, "--train.steps", "1", "--train.grad_accum", "1",
                             "--train.export_hf", "false"))
    if preset.endswith("lora"):  # a YAML list
        assert (cfg.finetune.lora.r, cfg.finetune.lora.targets) == (16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    result = train(cfg)
    assert math.isfinite(result.losses[1]) and math.isfinite(result.val_losses[1])


def test_bad_inputs_name_the_file_key_or_value(hf_dirs, synthetic, tmp_path):
    hf_dir = hf_dirs["llama"]
    # Not a supported Hugging Face model: the file and the value are named.
    bert = tmp_path / "bert"
    shutil.copytree(hf_dir, bert)
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 640}))
    with pytest.raises(ConfigError, match=r"finetune.hf_checkpoint: .*bert/config.json: model_type='bert'"):
        Trainer(ft_config(*ft_args(bert, synthetic, tmp_path / "x")))
    (bert / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"bert/config.json not found"):
        Trainer(ft_config(*ft_args(bert, synthetic, tmp_path / "x")))

    with pytest.raises(ConfigError, match="finetune.hf_checkpoint .*absent'?: no such directory"):
        Trainer(ft_config(*ft_args(tmp_path / "absent", synthetic, tmp_path / "x")))

    # SFT records with a missing key: file, record index and key.
    records = json.loads(synthetic.read_text())[:10]
    del records[3]["output"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(records))
    with pytest.raises(DataError, match=r"broken.json: record 3: key 'output'"):
        Trainer(ft_config(*ft_args(hf_dir, broken, tmp_path / "x")))
    broken.write_text(json.dumps([{"prompt": "a", "answer": "b"}] * 4))
    with pytest.raises(DataError, match=r"broken.json: format 'alpaca' needs key 'instruction'"):
        Trainer(ft_config(*ft_args(hf_dir, broken, tmp_path / "x", "--finetune.data_format", "alpaca")))
    with pytest.raises(DataError, match="not a JSON file"):
        Trainer(ft_config(*ft_args(hf_dir, hf_dir / "model.safetensors", tmp_path / "x")))

    # LoRA targets that match nothing: the targets and the layers there are.
    with pytest.raises(ConfigError, match=r"\['qkv'\] match no nn.Linear.*'attn.q_proj'"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "x", *LORA, "--finetune.lora.targets", "q_proj,qkv")))

    # Config keys: unknown ones, and ones that mean nothing for this kind of run.
    with pytest.raises(ConfigError, match=r"finetune.lora.rank.*valid keys: alpha, dropout, init_from, r, targets"):
        ft_config("--finetune.lora.rank", "4")
    with pytest.raises(ConfigError, match=r"finetune.lora.targets: value 5 is not a list"):
        from_dict({"finetune": {"lora": {"targets": 5}}})
    with pytest.raises(ConfigError, match="model.n_layer applies to pretraining"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "x", "--model.n_layer", "4")))
    with pytest.raises(ConfigError, match="finetune.lora.alpha applies to LoRA, but finetune.lora.r is 0"):
        Trainer(ft_config(*ft_args(hf_dir, synthetic, tmp_path / "x", "--finetune.lora.alpha", "4")))
    with pytest.raises(ConfigError, match="finetune.lora applies to fine-tuning, but finetune.hf_checkpoint is not"):
        Trainer(parse_args(["--finetune.lora.r", "4"]))
    with pytest.raises(SystemExit, match="needs --finetune.hf_checkpoint"):
        finetune.main(["--data.path", str(synthetic)])


def test_weighted_mixture_of_sft_sets_is_seeded_and_resumes_exactly(hf_dirs, synthetic, tmp_path):
    """Issue 37, item 6: several SFT sets, each in its own format, mixed by weight: an epoch draws
    each set's share (the small set repeated, the large one subsampled), the same on every run, and
    a run resumed mid-way continues the uninterrupted one's losses exactly."""
    from trainer.finetune_data import prepare_finetuning

    small = tmp_path / "small.jsonl"  # 20 prompt / completion records: a different format
    small.write_text("".join(json.dumps({"prompt": f"Count to {i}:", "completion": " ".join(map(str, range(i)))}) + "\n"
                             for i in range(2, 22)))
    mixed = ("--finetune.mix", str(small), "--finetune.mix_weights", "1,1")
    data = prepare_finetuning(ft_config(*ft_args(hf_dirs["llama"], synthetic, tmp_path / "a", *mixed)))
    assert "alpaca" in data.source and "completion" in data.source and "x 50%" in data.source
    sizes = [len(d) for d in data.dataset.datasets]
    order = data.train_indices
    from_small = int((order >= sizes[0]).sum())
    assert abs(from_small - len(order) / 2) <= 1  # half the epoch from a set of 20, so each repeated
    assert len(set(order[order >= sizes[0]].tolist())) < from_small
    again = prepare_finetuning(ft_config(*ft_args(hf_dirs["llama"], synthetic, tmp_path / "b", *mixed)))
    assert again.train_indices.tolist() == order.tolist()
    # Without weights the sets are concatenated, every example once.
    plain = prepare_finetuning(ft_config(*ft_args(hf_dirs["llama"], synthetic, tmp_path / "c", "--finetune.mix",
                                                  str(small))))
    assert sorted(plain.train_indices.tolist()) == sorted(set(plain.train_indices.tolist()))
    # A resume in the middle continues the mixed stream exactly.
    steps = ("--train.steps", "6", "--train.checkpoint_interval", "3")
    full = train(ft_config(*ft_args(hf_dirs["llama"], synthetic, tmp_path / "full", *mixed, *steps)))
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", out)
    resumed = train(ft_config(*ft_args(hf_dirs["llama"], synthetic, out, *mixed, *steps, "--resume",
                                       str(out / "checkpoints" / "step_00000003"))))
    assert {s: resumed.losses[s] for s in (4, 5, 6)} == {s: full.losses[s] for s in (4, 5, 6)}
    with pytest.raises(ConfigError, match=r"finetune.mix_weights: value \[1.0\] does not fit; expected 2"):
        prepare_finetuning(ft_config(*ft_args(hf_dirs["llama"], synthetic, tmp_path / "d", "--finetune.mix",
                                              str(small), "--finetune.mix_weights", "1")))
