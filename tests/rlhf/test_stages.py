"""The rlhf.py stages: PPO and GRPO updates split over ranks equal one process's, a resumed PPO
run continues bit-exactly, a NaN reward is skipped, a non-finite step is handled as pretraining
handles it, DPO raises the held-out margin, GRPO runs, and the whole pipeline runs on 2 x 2 ranks."""

import json
import re
import runpy
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.config import ModelConfig
from models.transformer import Transformer, score_model_from
from rlhf.common import ModelRuntime
from rlhf.config import RLHFConfig
from rlhf.grpo import grpo_update
from rlhf.losses import grpo_advantages
from rlhf.ppo import make_experience, ppo_update
from rlhf.rollout import layout, logprobs, values_of
from rlhf.tasks import TASKS, WordTask
from trainer.distributed import DistEnv
from trainer.spawn import run_ranks

ROOT = Path(__file__).parents[2]
DETERMINISTIC = ("reward", "reward std", "kl", "kl coef", "policy loss", "value loss", "clip fraction",
                 "approx kl", "entropy", "response length", "logprob gap")


def _rollouts(seed: int, n: int):
    """Prompts and responses of different lengths, their sampling log-probs and scores."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(3, 64, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    logps = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    scores = torch.randn(n, generator=g)
    return prompts, responses, logps, scores


def _my_rollouts(seed: int, mine: list[int]):
    """This rank's rows of 8 hand-made rollouts, laid out as one batch, and their scores."""
    prompts, responses, logps, scores = _rollouts(seed, 8)
    batch = layout([prompts[i] for i in mine], [responses[i] for i in mine], [logps[i] for i in mine],
                   [""] * len(mine), 0, torch.device("cpu"))
    return batch, scores[mine]


def _setup(rank: int, world: int, stage: int):
    """A tiny LM (the same on every rank), an fp32 config for `stage` (ZeRO-3: fp32 wire), this rank's env."""
    torch.manual_seed(0)
    lm = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=64))
    cfg = RLHFConfig()
    cfg.zero_optimization.stage = stage
    if stage == 3:
        cfg.zero_optimization.communication_data_type = "fp32"
    cfg.train.precision = "fp32"
    return lm, cfg, DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))


def ppo_inputs(lm, cfg, env, rows: list[int]) -> dict:
    """The actor, critic and reference of `lm`, one rollout of these rows, and its PPO experience
    (2 epochs x 2 mini-batches)."""
    critic_start = score_model_from(lm)  # before the actor's runtime shards lm
    actor = ModelRuntime("actor", (lm, None), cfg, env, lr=1e-3, steps=4)
    critic = ModelRuntime("critic", (critic_start, None), cfg, env, lr=1e-3, steps=4)
    reference = ModelRuntime("reference", (Transformer(lm.config), None), cfg, env, lr=None)
    batch, scores = _my_rollouts(1, rows)
    old_logp, ref_logp = logprobs(actor, batch), logprobs(reference, batch)
    with torch.no_grad():
        old_values = values_of(critic, batch)
    cfg.ppo.epochs, cfg.ppo.mini_batches = 2, 2
    exp, _ = make_experience(batch, scores, old_logp, ref_logp, old_values, 0.1, cfg.ppo)
    return dict(actor=actor, critic=critic, reference=reference, batch=batch, scores=scores, old_logp=old_logp,
                ref_logp=ref_logp, old_values=old_values, exp=exp)


def _ppo_step(rank, world, rows, stage):
    """One rollout's PPO update (2 epochs x 2 mini-batches) under DDP or ZeRO-3 (fp32 wire); the weights after."""
    lm, cfg, env = _setup(rank, world, stage)
    p = ppo_inputs(lm, cfg, env, rows[rank])
    actor, critic, reference = p["actor"], p["critic"], p["reference"]
    stats, skipped = ppo_update(actor, critic, p["exp"], cfg.ppo, 0)
    out = {"actor": actor.runtime.full_state_dict(), "critic": critic.runtime.full_state_dict(), "stats": stats}
    for m in (actor, critic, reference):
        m.close()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_ppo_update_on_two_ranks_equals_one_process(stage):
    # Rank r's mini-batch k holds rows r*4 + 2k, r*4 + 2k + 1: the one process gets them in the
    # order that makes its mini-batch k the union of the ranks' mini-batches k.
    two = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    one = {0: [0, 1, 4, 5, 2, 3, 6, 7]}
    sharded = run_ranks(_ppo_step, world_size=2, args=(two, stage))[0]
    single = run_ranks(_ppo_step, world_size=1, args=(one, stage))[0]
    for model in ("actor", "critic"):
        assert sharded[model].keys() == single[model].keys()
        for name, tensor in single[model].items():
            torch.testing.assert_close(sharded[model][name], tensor, rtol=0, atol=1e-5, msg=f"{model} {name}")
    start = Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=64))
    assert any(not torch.equal(single["actor"][n], p) for n, p in start.state_dict().items() if n in single["actor"])
    for key, value in single["stats"].items():
        assert sharded["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _main(rank, world, argv):
    """rlhf.py's main (the script shares its name with the rlhf package, so it is run by path)."""
    runpy.run_path(str(ROOT / "rlhf.py"), run_name="rlhf_script")["main"](argv)


def _tiny(out_dir, *extra) -> list[str]:
    """fp32 compute: the tests compare against exact references (the policy starts as the reference
    model), which bf16 autocast (`precision: auto` on a CPU with native bf16) would blur."""
    return ["--config", "configs/rlhf_tiny.yaml", "--train.out_dir", str(out_dir), "--data.task_samples", "200",
            "--sft.steps", "6", "--reward.steps", "4", "--ppo.steps", "4", "--train.micro_batch_size", "4",
            "--train.log_interval", "1", "--generation.max_new_tokens", "6", "--train.precision", "fp32", *extra]


def _metrics(path) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(path)]
    return {r["step"]: r for r in rows if "policy loss" in r}


def test_ppo_resumes_bit_exactly(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(ROOT)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["--reward.source", "task", "--train.checkpoint_interval", "2", "--ppo.ema", "0.9"]
    run_ranks(_main, world_size=1, args=(["ppo", *_tiny(straight, *args)],))
    (resumed / "ppo" / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "ppo" / "checkpoints" / "step_00000002",
                    resumed / "ppo" / "checkpoints" / "step_00000002")
    run_ranks(_main, world_size=1, args=(["ppo", *_tiny(resumed, *args), "--models.sft", str(straight / "sft" / "hf"),
                                          "--resume", str(resumed / "ppo" / "checkpoints" / "step_00000002")],))
    # The resume says so (it used to be silent).
    assert f"ppo: resumed from checkpoint {resumed / 'ppo' / 'checkpoints' / 'step_00000002'} (step 2)" in \
        capfd.readouterr().out
    # Another number of prompts per step is refused, naming the micro-batch that keeps the checkpoint's.
    with pytest.raises(AssertionError, match=r"trained with 4 samples per step; this run's is 2 \(train.micro_batch_size "
                                             r"2 x 1 ranks\): resume with --train.micro_batch_size 4"):
        run_ranks(_main, world_size=1, args=(["ppo", *_tiny(tmp_path / "other", *args, "--train.micro_batch_size", "2"),
                                              "--models.sft", str(straight / "sft" / "hf"), "--resume",
                                              str(resumed / "ppo" / "checkpoints" / "step_00000002")],))
    a, b = _metrics(straight / "ppo" / "metrics.jsonl"), _metrics(resumed / "ppo" / "metrics.jsonl")
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in DETERMINISTIC:
            assert a[step][key] == b[step][key], (step, key)
    for name in ("hf", "hf-ema"):
        wa = load_file(straight / "ppo" / name / "model.safetensors")
        wb = load_file(resumed / "ppo" / name / "model.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name


def test_a_fresh_stage_refuses_an_earlier_runs_directory_unless_overwritten(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(ROOT)
    argv = ["reward", *_tiny(tmp_path, "--sft.steps", "2", "--reward.steps", "2", "--train.eval_interval", "100")]
    run_ranks(_main, world_size=1, args=(argv,))
    metrics = tmp_path / "reward" / "metrics.jsonl"
    first = metrics.read_text()
    capfd.readouterr()
    # Run again without resume: refused before anything is written (its metrics used to be appended,
    # its checkpoints overwritten), and the sft model it would reuse is named, not silently taken.
    with pytest.raises(AssertionError, match=r"the reward stage's directory '.*reward' holds another run \(.*\); "
                                             r"continue it with --resume auto.*--train.overwrite true"):
        run_ranks(_main, world_size=1, args=(argv,))
    assert f"rlhf.py reward: using the sft model {tmp_path / 'sft' / 'hf'} an earlier run left" in capfd.readouterr().out
    assert metrics.read_text() == first
    run_ranks(_main, world_size=1, args=(argv + ["--train.overwrite", "true"],))
    assert "train.overwrite: the previous run is in" in capfd.readouterr().out
    # One run's rows, not two; the replaced run went once this one had its checkpoint.
    assert len(metrics.read_text().splitlines()) == len(first.splitlines())
    assert not (tmp_path / "reward" / ".overwritten").exists()
    assert (tmp_path / "reward" / "hf" / "config.json").is_file()


def test_dpo_raises_the_held_out_margin(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run_ranks(_main, world_size=1, args=(["dpo", *_tiny(tmp_path, "--sft.steps", "20", "--dpo.steps", "20",
                                                        "--dpo.lr", "1e-3", "--train.eval_interval", "100")],))
    rows = [json.loads(line) for line in open(tmp_path / "dpo" / "metrics.jsonl")]
    held_out = [r for r in rows if "held-out margin" in r]
    start, end = held_out[0], held_out[-1]
    assert start["step"] == 0 and end["step"] == 20
    assert abs(start["held-out margin"]) < 1e-5  # the policy starts as the reference
    assert end["held-out margin"] > 0.1 and end["held-out accuracy"] > 0.6


def test_pipeline_on_two_nodes_of_two_with_zeropp(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run_ranks(_main, world_size=4, ranks_per_node=2, timeout=600,
              args=(["ppo", *_tiny(tmp_path, "--ppo.steps", "2", "--zero_optimization.ranks_per_node", "2")],))
    for stage in ("sft", "reward", "ppo"):
        assert (tmp_path / stage / "hf" / "config.json").is_file(), stage
    rows = _metrics(tmp_path / "ppo" / "metrics.jsonl")
    assert sorted(rows) == [1, 2]
    assert rows[2]["cross-node generation (MB)"] > 0 and rows[2]["cross-node training (MB)"] > 0


class _NaNOnce(WordTask):
    """The word task, except that its 9th reward is NaN (step 3 of 4 rollouts per step)."""

    calls = 0

    def reward(self, prompt, response):
        _NaNOnce.calls += 1
        return float("nan") if _NaNOnce.calls == 9 else super().reward(prompt, response)


def _main_with_nan_reward(rank, world, argv):
    from rlhf.online import OnlineAlgorithm
    TASKS["word"] = _NaNOnce
    OnlineAlgorithm.evaluate = lambda self: None  # the held-out rewards would count as calls too
    _main(rank, world, argv)


def test_non_finite_reward_is_reported_and_not_trained_on(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(ROOT)
    run_ranks(_main_with_nan_reward, world_size=1,
              args=(["ppo", *_tiny(tmp_path, "--reward.source", "task", "--ppo.epochs", "1")],))
    rows = _metrics(tmp_path / "ppo" / "metrics.jsonl")
    assert [rows[s]["skipped steps"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert "step 3: non-finite reward or loss" in capfd.readouterr().out
    weights = load_file(tmp_path / "ppo" / "hf" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def _grpo_step(rank, world, rows):
    """Two GRPO updates (μ = 2, k3 KL to the reference) under ZeRO-3 (fp32 wire); the weights after."""
    lm, cfg, env = _setup(rank, world, 3)
    cfg.grpo.group_size, cfg.grpo.iterations, cfg.grpo.beta = 2, 2, 0.04
    actor = ModelRuntime("actor", (lm, None), cfg, env, lr=1e-3, steps=2)
    reference = ModelRuntime("reference", (Transformer(lm.config), None), cfg, env, lr=None)
    batch, scores = _my_rollouts(2, rows[rank])
    advantages = grpo_advantages(scores, cfg.grpo.group_size)
    stats, _ = grpo_update(actor, batch, advantages, logprobs(reference, batch), cfg.grpo, 0)
    out = {"actor": actor.runtime.full_state_dict(), "stats": stats}
    actor.close()
    reference.close()
    return out


def test_grpo_update_on_two_ranks_equals_one_process():
    sharded = run_ranks(_grpo_step, world_size=2, args=({0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},))[0]
    single = run_ranks(_grpo_step, world_size=1, args=({0: list(range(8))},))[0]
    for name, tensor in single["actor"].items():
        torch.testing.assert_close(sharded["actor"][name], tensor, rtol=0, atol=1e-5, msg=name)
    for key, value in single["stats"].items():
        assert sharded["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_grpo_runs_on_a_task_and_logs_its_statistics(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run_ranks(_main, world_size=2, args=(["grpo", *_tiny(tmp_path, "--reward.source", "task", "--grpo.steps", "2",
                                                         "--grpo.group_size", "4", "--grpo.beta", "0.04",
                                                         "--train.micro_batch_size", "2")],))
    rows = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    last = [r for r in rows if "zero-advantage groups" in r][-1]
    assert last["step"] == 2 and 0 <= last["zero-advantage groups"] <= 1 and last["kl"] >= 0
    assert (tmp_path / "grpo" / "hf" / "config.json").is_file()


REWARD_FUNCTIONS = """
def vowels(prompts, completions, **kwargs):
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]

def long(prompts, completions):
    return [len(text) / 10 if len(text) > 3 else None for text in completions]

def broken(prompts, completions):
    raise ValueError("no answer found")
"""


def test_grpo_trains_on_the_users_reward_functions_and_names_one_that_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    module = tmp_path / "my_rewards.py"
    module.write_text(REWARD_FUNCTIONS)
    namespace = {}
    exec(REWARD_FUNCTIONS, namespace)
    common = ["--reward.source", "functions", "--grpo.steps", "2", "--grpo.group_size", "2"]
    run_ranks(_main, world_size=1, args=(["grpo", *_tiny(tmp_path / "run", *common, "--reward.functions",
                                                         f"{module}:vowels,{module}:long",
                                                         "--reward.function_weights", "1,0.5")],))
    samples = [json.loads(line) for line in open(tmp_path / "run" / "grpo" / "samples.jsonl")]
    assert samples
    for s in samples:  # each logged reward recomputed from the decoded response, as TRL sums reward_funcs
        [vowels], [long] = namespace["vowels"]([s["prompt"]], [s["response"]]), namespace["long"]([s["prompt"]],
                                                                                                   [s["response"]])
        assert s["reward"] == pytest.approx(vowels + 0.5 * (long or 0.0), rel=1e-6)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "grpo" / "metrics.jsonl")]
    steps = [r for r in rows if "reward" in r and "loss" in r]
    assert len(steps) == 2 and all(f"reward {module}:vowels" in r and "task reward" in r for r in steps)
    with pytest.raises(AssertionError, match=rf"reward function {module}:broken raised ValueError: no answer found"):
        run_ranks(_main, world_size=1, args=(["grpo", *_tiny(tmp_path / "broken", *common, "--reward.functions",
                                                             f"{module}:broken", "--models.sft",
                                                             str(tmp_path / "run" / "sft" / "hf"))],))


def test_grpo_evaluates_the_held_out_prompts_without_changing_training(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    common = ["--reward.source", "task", "--grpo.steps", "2", "--grpo.group_size", "2", "--sft.steps", "20"]
    argv = ["grpo", *_tiny(tmp_path / "a", *common, "--train.eval_interval", "1")]
    run_ranks(_main, world_size=1, args=(argv,))
    sft = tmp_path / "a" / "sft" / "hf"
    run_ranks(_main, world_size=1, args=(["grpo", *_tiny(tmp_path / "b", *common, "--train.eval_interval", "100",
                                                         "--models.sft", str(sft))],))
    rows = {d: [json.loads(line) for line in open(tmp_path / d / "grpo" / "metrics.jsonl")] for d in "ab"}
    evals = {d: {r["step"]: r for r in rows[d] if "held-out reward (greedy)" in r} for d in "ab"}
    assert sorted(evals["a"]) == [0, 1, 2] and sorted(evals["b"]) == [0, 2]
    # An evaluation in between changes nothing the training does: its draws have their own generator.
    steps = {d: {r["step"]: r for r in rows[d] if "loss" in r} for d in "ab"}
    for step in (1, 2):
        for key in ("loss", "reward", "kl", "entropy", "clip fraction"):
            assert steps["a"][step][key] == steps["b"][step][key], (step, key)
    for step in (0, 2):
        for key in ("held-out reward (greedy)", "held-out reward (sampled)"):
            assert evals["a"][step][key] == evals["b"][step][key], (step, key)
    # Step 0's greedy reward, recomputed from the SFT model alone: each held-out prompt decoded by itself
    # (no batch, no padding) and scored by the task.
    from models.generate import generate
    from models.hf import load_hf_checkpoint
    from rlhf.config import check
    from rlhf.data import load_prompts
    from rlhf.tasks import get_task
    from data.datasets import ResumableBatchSampler
    from data.tokenizer import load_tokenizer
    from trainer.config import parse_args
    cfg = parse_args(argv[1:], RLHFConfig())
    check(cfg, "grpo")
    tokenizer, model, task = load_tokenizer(sft), load_hf_checkpoint(sft), get_task("word")
    prompts = load_prompts(cfg, tokenizer, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    batches = iter(ResumableBatchSampler(prompts.valid_indices, 4, 0, 1, cfg.train.seed, shuffle=False))
    n = min(cfg.train.eval_batches, len(prompts.valid_indices) // 4)  # whole batches of micro-batch 4
    chosen = [i for _ in range(n) for i in next(batches)]
    rewards = [task.reward(prompts.texts[i], tokenizer.decode(generate(
        model, [prompts.tokens[i]], 6, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)[0]))
        for i in chosen]
    assert evals["a"][0]["held-out prompts"] == len(chosen) >= 8
    assert sum(rewards) > 0  # some prompts answered: the comparison is not of zeros
    assert evals["a"][0]["held-out reward (greedy)"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)


def _nan_grad_norm_at(steps):
    """A build_runtime whose runtimes' clip_grad_norm_ (the global gradient norm) is NaN at the
    optimizer steps (counted from 1, over every runtime it built) in `steps`: the hook
    tests/trainer/test_reliability.py injects a non-finite step with."""
    from zeropp import build_runtime

    calls = [0]

    def build(*args, **kwargs):
        runtime = build_runtime(*args, **kwargs)
        clip = runtime.clip_grad_norm_

        def clip_grad_norm_(max_norm):
            norm = clip(max_norm)
            calls[0] += 1
            return torch.tensor(float("nan")) if calls[0] in steps else norm

        runtime.clip_grad_norm_ = clip_grad_norm_
        return runtime

    return build


def _rlhf_with_nan_grad_norm(rank, world, argv, steps):
    import rlhf.common

    rlhf.common.build_runtime = _nan_grad_norm_at(steps)  # the stages' models (sft runs through trainer.loop)
    _main(rank, world, argv)


def _pretrain_with_nan_grad_norm(rank, world, argv, steps):
    from trainer.config import parse_args
    from trainer.loop import Trainer

    trainer = Trainer(parse_args(argv), build_runtime=_nan_grad_norm_at(steps))
    try:
        return trainer.run().skipped_steps
    finally:
        trainer.close()


SKIP_LINE = re.compile(r"step (\d+): loss (\S+) / grad norm nan is not finite: update skipped "
                       r"\((\d+) in a row; at (\d+) the run stops\)")


def test_a_non_finite_step_is_handled_as_in_pretraining(tmp_path, monkeypatch, capfd):
    """trainer.nonfinite's one policy: a NaN gradient norm at step 3 skips that update in the reward
    stage exactly as in pretraining (same line, same "skipped steps", weights kept), and
    train.max_nonfinite_steps in a row stop an rlhf.py stage as they stop train.py."""
    monkeypatch.chdir(ROOT)
    common = ["--train.log_interval", "1", "--train.checkpoint_interval", "1"]
    run_ranks(_rlhf_with_nan_grad_norm, world_size=1, args=(["reward", *_tiny(tmp_path / "rlhf", *common)], {3}))
    rlhf_out = capfd.readouterr().out
    text = tmp_path / "text.txt"
    text.write_text("say cat:cat say dog:dog say fish:fish\n" * 400)
    pretrain = ["--data.path", str(text), "--data.tokenizer", str(tmp_path / "rlhf" / "sft" / "hf"),
                "--data.seq_len", "16", "--data.cache_dir", str(tmp_path / "cache"), "--data.workers", "1",
                "--train.micro_batch_size", "4", "--train.steps", "4", "--train.eval_interval", "4",
                "--train.eval_batches", "1", "--train.out_dir", str(tmp_path / "pretrain"), "--train.progress_bar",
                "false", "--train.tensorboard", "false", "--train.precision", "fp32", *common]
    assert run_ranks(_pretrain_with_nan_grad_norm, world_size=1, args=(pretrain, {3}))[0] == [3]
    pretrain_out = capfd.readouterr().out

    for out_dir, log in ((tmp_path / "pretrain", pretrain_out), (tmp_path / "rlhf" / "reward", rlhf_out)):
        rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
        assert [r["skipped steps"] for r in rows if "skipped steps" in r] == [0, 0, 1, 1], out_dir
        lines = SKIP_LINE.findall(log)
        assert [(step, streak, limit) for step, _, streak, limit in lines] == [("3", "1", "5")], (out_dir, log)
        # the skipped update left the weights and optimizer state as they were; the next one did not
        ckpts = out_dir / "checkpoints"
        shards = {s: {p.relative_to(ckpts / f"step_0000000{s}"): load_file(p)
                      for p in sorted((ckpts / f"step_0000000{s}").rglob("*.safetensors"))} for s in (2, 3, 4)}
        assert shards[2] and shards[2].keys() == shards[3].keys()
        for name, tensors in shards[2].items():
            assert all(torch.equal(t, shards[3][name][k]) for k, t in tensors.items()), (out_dir, name)
        assert any(not torch.equal(t, shards[4][name][k]) for name, tensors in shards[3].items()
                   for k, t in tensors.items())
        assert json.loads((ckpts / "step_00000004" / "state.json").read_text())["skipped"] == 1

    # Every step non-finite: both stop with NonFiniteError at train.max_nonfinite_steps in a row.
    with pytest.raises(AssertionError, match=r"2 steps in a row \(up to step 2\) had a non-finite loss or gradient"):
        run_ranks(_rlhf_with_nan_grad_norm, world_size=1,
                  args=(["reward", *_tiny(tmp_path / "diverged", "--models.sft", str(tmp_path / "rlhf" / "sft" / "hf"),
                                          "--train.max_nonfinite_steps", "2")], set(range(1, 100))))
    with pytest.raises(AssertionError, match=r"2 steps in a row \(up to step 2\) had a non-finite loss or gradient"):
        run_ranks(_pretrain_with_nan_grad_norm, world_size=1,
                  args=([*pretrain, "--train.out_dir", str(tmp_path / "diverged_pretrain"),
                         "--train.max_nonfinite_steps", "2"], set(range(1, 100))))


@pytest.mark.slow
def test_stages_plan_their_runtime_store_the_plan_and_reuse_it_on_resume(tmp_path, monkeypatch, capfd):
    """plan.auto on 2 nodes x 1 rank: the sft stage (train.py's trainer) and PPO each log a plan before their
    first step; PPO's checkpoint stores it and the models were built with it; a resume on the same layout
    reuses it and repeats the run's steps exactly."""
    monkeypatch.chdir(ROOT)
    args = ["--reward.source", "task", "--train.checkpoint_interval", "2", "--plan.auto", "true",
            "--plan.check_after_steps", "2", "--zero_optimization.ranks_per_node", "1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_ranks(_main, world_size=2, ranks_per_node=1, args=(["ppo", *_tiny(straight, *args)],))
    log = capfd.readouterr().out
    assert log.index("plan: ") < log.index("iteration") and "plan: probed and planned" in log  # the sft stage
    assert log.index("ppo: plan: ") < log.index("ppo: actor")
    assert "ppo: plan check: measured" in log and "(the learning from a rollout, timed alone)" in log
    step2 = straight / "ppo" / "checkpoints" / "step_00000002"
    state = json.loads((step2 / "state.json").read_text())
    assert state["plan"]["machine"] == {"world_size": 2, "ranks_per_node": 1, "device": "cpu"}
    assert state["config"]["zero_optimization"] == state["plan"]["config"]  # what the models were built with
    assert ("runtime: DDP" in log.split("ppo: actor")[1]) == (state["plan"]["config"]["stage"] == 0)

    (resumed / "ppo" / "checkpoints").mkdir(parents=True)
    shutil.copytree(step2, resumed / "ppo" / "checkpoints" / "step_00000002")
    run_ranks(_main, world_size=2, ranks_per_node=1,
              args=(["ppo", *_tiny(resumed, *args), "--models.sft", str(straight / "sft" / "hf"),
                     "--resume", str(resumed / "ppo" / "checkpoints" / "step_00000002")],))
    assert f"ppo: plan: {state['plan']['chosen']} reused from the checkpoint" in capfd.readouterr().out
    a, b = _metrics(straight / "ppo" / "metrics.jsonl"), _metrics(resumed / "ppo" / "metrics.jsonl")
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in DETERMINISTIC:
            assert a[step][key] == b[step][key], (step, key)


def test_rollouts_sampled_ahead_learn_as_inline_sampling_and_resume_exactly(tmp_path, monkeypatch, capfd):
    """generation.staleness 1 on 2 ranks under ZeRO++ (rlhf_tiny's qwZ, qgZ): the next rollout sampled on a
    thread while the update runs gives the same run as sampling it on the training thread first
    (generation.overlap false: no race between them); each update after the first learns from samples one
    update old (importance weights near 1, the log-prob gap above numerical noise); a resume from step 2
    repeats steps 3-4 exactly, the rollout sampled ahead restored."""
    monkeypatch.chdir(ROOT)
    args = ["--reward.source", "task", "--grpo.steps", "4", "--grpo.group_size", "4", "--train.micro_batch_size", "2",
            "--grpo.lr", "1e-3", "--generation.staleness", "1", "--train.checkpoint_interval", "2",
            "--zero_optimization.stage", "3", "--zero_optimization.communication_data_type", "fp32"]
    threaded, inline, resumed = tmp_path / "threaded", tmp_path / "inline", tmp_path / "resumed"
    run_ranks(_main, world_size=2, args=(["grpo", *_tiny(threaded, *args)],))
    sft = ["--models.sft", str(threaded / "sft" / "hf")]
    run_ranks(_main, world_size=2, args=(["grpo", *_tiny(inline, *args, *sft, "--generation.overlap", "false")],))
    step2 = threaded / "grpo" / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in step2.glob("rollout_ahead_rank*")) == ["rollout_ahead_rank0.safetensors",
                                                                          "rollout_ahead_rank1.safetensors"]
    (resumed / "grpo" / "checkpoints").mkdir(parents=True)
    shutil.copytree(step2, resumed / "grpo" / "checkpoints" / "step_00000002")
    run_ranks(_main, world_size=2, args=(["grpo", *_tiny(resumed, *args, *sft, "--resume",
                                                        str(resumed / "grpo" / "checkpoints" / "step_00000002"))],))
    capfd.readouterr()
    keys = ("reward", "loss", "kl", "entropy", "grad norm", "logprob gap", "is weight", "is truncated fraction")
    runs = [{r["step"]: r for r in map(json.loads, open(d / "grpo" / "metrics.jsonl")) if "loss" in r}
            for d in (threaded, inline, resumed)]
    a, b, c = runs
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and sorted(c) == [3, 4]
    for step in a:
        assert all(a[step][k] == b[step][k] for k in keys), step
    for step in c:
        assert all(a[step][k] == c[step][k] for k in keys), step
    assert [a[s]["rollout staleness"] for s in a] == [0.0, 1.0, 1.0, 1.0]
    # the first rollout is on-policy; a later one is one update old wherever that update moved the policy
    moved = [s for s in (2, 3, 4) if a[s - 1]["grad norm"] > 0 and a[s - 1]["zero-advantage groups"] < 1]
    assert a[1]["logprob gap"] < 1e-5 and moved and all(a[s]["logprob gap"] > 1e-5 for s in moved)
    assert all(0.5 < a[s]["is weight"] < 1.5 for s in a)


def test_ppo_learns_from_a_rollout_sampled_ahead(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run_ranks(_main, world_size=1, args=(["ppo", *_tiny(tmp_path, "--reward.source", "task", "--ppo.steps", "3",
                                                        "--generation.staleness", "1")],))
    rows = _metrics(tmp_path / "ppo" / "metrics.jsonl")
    assert [rows[s]["rollout staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert rows[1]["is weight"] == pytest.approx(1.0, abs=1e-5) and all(0.5 < rows[s]["is weight"] < 1.5 for s in (2, 3))
