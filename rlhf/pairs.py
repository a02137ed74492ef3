"""The two stages that learn from preference pairs: the reward model and DPO.

Both put a batch's chosen and rejected sequences through one forward (2 x batch rows, one
padding length), both normalize the loss over the global batch of pairs (so the gradient
does not depend on how pairs are split over ranks), and both report accuracy and margin on
the held-out pairs before training and at every eval interval.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from data.datasets import IGNORE_INDEX, ResumableBatchSampler, collate_preference
from models.transformer import Transformer, score_model_from
from rlhf.common import (ModelRuntime, comm_scalars, global_sum, load_model, optimizer_step, prepare_trained,
                         reference_of, score_model, sequence_logprobs, tokenizer_of)
from rlhf.config import RLHFConfig
from rlhf.data import Preferences, load_preferences
from rlhf.losses import diverging_reward_loss, dpo_loss, last_token_scores, pairwise_reward_loss
from rlhf.stage import RLHFStage
from trainer.distributed import DistEnv, all_reduce_sum
from trainer.metrics import MetricsLogger
from trainer.nonfinite import NonFiniteSteps
from trainer.skeleton import run_stage
from zeropp.checkpoint import read_safetensors


def _pair_batch(prefs: Preferences, indices: list[int], pad_id: int, device) -> dict[str, torch.Tensor]:
    """chosen rows then rejected rows: tokens, attention_mask, labels [2B, T]."""
    batch = collate_preference([prefs.dataset[i] for i in indices], pad_id=pad_id)
    return {k: torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]).to(device)
            for k in ("tokens", "attention_mask", "labels")}


class _ScoreObjective:
    """The reward model: a scalar head; loss -logsigmoid(r_chosen - r_rejected)."""

    name = "reward"

    def __init__(self, cfg: RLHFConfig, env: DistEnv):
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        model = score_model(load_model(cfg.sft_path(), "models.sft"))
        self.model = ModelRuntime("reward", model, cfg, env, lr=cfg.reward.lr, steps=cfg.reward.steps)
        self.models = [self.model]

    def prepare(self, *args) -> None:
        pass

    def losses(self, batch: dict[str, torch.Tensor], indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair losses, chosen scores, rejected scores)."""
        values = self.model(batch["tokens"], batch["attention_mask"])[..., 0]
        chosen, rejected = last_token_scores(values, batch["attention_mask"]).chunk(2)
        if self.cfg.reward.loss == "diverging":
            vc, vr = values.chunk(2)
            mc, mr = batch["attention_mask"].chunk(2)
            tc, tr = batch["tokens"].chunk(2)
            return diverging_reward_loss(vc, vr, mc, mr, tc, tr), chosen.detach(), rejected.detach()
        return pairwise_reward_loss(chosen, rejected), chosen.detach(), rejected.detach()


def _response_logprob_sums(model: ModelRuntime, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed log-probs of each row's response tokens (labels != -100), one forward."""
    logp, _ = sequence_logprobs(model, batch["tokens"], batch["attention_mask"], 1)
    targets = batch["labels"][:, 1:]
    return (logp * (targets != IGNORE_INDEX)).sum(-1)


class _DPOObjective:
    """Sigmoid DPO against a reference: precomputed once, or a frozen model held beside the policy."""

    name = "dpo"

    def __init__(self, cfg: RLHFConfig, env: DistEnv):
        self.cfg = cfg
        self.model = ModelRuntime("policy", load_model(cfg.sft_path(), "models.sft"), cfg, env, lr=cfg.dpo.lr,
                                  steps=cfg.dpo.steps, lora=cfg.lora)
        self.reference = None
        if not cfg.dpo.precompute_ref:
            self.reference = reference_of(self.model, lambda: load_model(cfg.sft_path(), "models.sft"), cfg, env)
        self.models = [m for m in (self.model, self.reference) if isinstance(m, ModelRuntime)]
        self.ref_table: torch.Tensor | None = None  # pair index -> (chosen, rejected) reference log-probs

    @torch.no_grad()
    def prepare(self, prefs: Preferences, pad_id: int, env: DistEnv, batch_size: int, stage_dir: Path) -> None:
        """The initial policy is the reference: its log-probs of every pair, once, before the first
        step (TRL's precompute_ref_log_probs), kept in <stage dir>/reference_logps.safetensors so
        that a resumed run reads them instead of asking the trained policy."""
        if self.reference is not None:
            return
        path = stage_dir / "reference_logps.safetensors"
        if path.is_file():
            self.ref_table = read_safetensors(path)["logps"]
            return
        n = len(prefs.dataset)
        table = torch.zeros(n, 2, dtype=torch.float64)
        mine = list(range(env.rank, n, env.world_size))
        per_rank = -(-n // env.world_size)
        mine += mine[-1:] * (per_rank - len(mine))  # every rank runs as many forwards (ZeRO gathers)
        for start in range(0, per_rank, batch_size):
            chunk = mine[start:start + batch_size]
            sums = _response_logprob_sums(self.model, _pair_batch(prefs, chunk, pad_id, env.device))
            table[chunk] = torch.stack(sums.chunk(2), dim=1).double().cpu()
        self.ref_table = all_reduce_sum(table).float()  # each pair is written by one rank
        if env.is_main:
            stage_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            save_file({"logps": self.ref_table.contiguous()}, tmp)
            tmp.replace(path)

    def reference_logps(self, indices: list[int], batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reference is not None:
            with torch.no_grad():
                return _response_logprob_sums(self.reference, batch).chunk(2)
        both = self.ref_table[torch.as_tensor(indices)].to(batch["tokens"].device)
        return both[:, 0], both[:, 1]

    def losses(self, batch, indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-pair losses, chosen implicit rewards, rejected implicit rewards)."""
        chosen, rejected = _response_logprob_sums(self.model, batch).chunk(2)
        ref_chosen, ref_rejected = self.reference_logps(indices, batch)
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.cfg.dpo.beta, self.cfg.dpo.label_smoothing)


class PairStage(RLHFStage):
    """The reward or DPO stage: `objective` turns a batch of pairs into per-pair losses and scores;
    this class makes the step's update and metrics of them and the held-out evaluation."""

    def __init__(self, stage: str, cfg: RLHFConfig, env: DistEnv):
        self.name = stage
        if stage == "dpo" and not cfg.dpo.precompute_ref:
            self.unpriced = "the reference's forwards"
        super().__init__(cfg, env)
        cfg = self.cfg  # with plan.auto's zero_optimization
        self.tokenizer = tokenizer_of(cfg.sft_path())
        self.prefs = load_preferences(cfg, self.tokenizer, env)
        self.train_indices = self.prefs.train_indices
        self.objective = _ScoreObjective(cfg, env) if stage == "reward" else _DPOObjective(cfg, env)
        self.model = self.objective.model
        self.models = self.objective.models
        self.steps = cfg.reward.steps if stage == "reward" else cfg.dpo.steps

    def trained(self) -> tuple[list[tuple[Transformer, int, int]], int, list[int]]:
        """The reward model or the DPO policy, one optimizer step on the chosen and rejected sides of
        train.micro_batch_size pairs."""
        cfg = self.cfg
        model, _ = load_model(cfg.sft_path(), "models.sft")
        model = score_model_from(model) if self.name == "reward" else model
        _, checkpointed = prepare_trained(model, cfg, True, cfg.lora if self.name == "dpo" else None)
        return [(model, 1, 1)], 2 * cfg.train.micro_batch_size, checkpointed

    def _batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return _pair_batch(self.prefs, indices, self.tokenizer.pad_id, self.env.device)

    def start(self, log: MetricsLogger, step: int) -> None:
        cfg, env, micro = self.cfg, self.env, self.cfg.train.micro_batch_size
        self.objective.prepare(self.prefs, self.tokenizer.pad_id, env, micro, self.stage_dir)
        log.info(f"{self.name}: {self.model.config.arch} from {cfg.sft_path()} | data {self.prefs.source}: "
                 f"{len(self.prefs.train_indices)} train / {len(self.prefs.valid_indices)} held-out pairs | world "
                 f"size {env.world_size} | {micro * env.world_size} pairs per step | runtime: "
                 f"{self.model.runtime.describe()}")

    def update(self, step: int, batches, nonfinite: NonFiniteSteps, stop_requested: bool) -> dict[str, float]:
        start = time.perf_counter()
        indices = next(batches)
        batch = self._batch(indices)
        losses, chosen, rejected = self.objective.losses(batch, indices)
        pairs = self.samples_per_step
        loss = losses.sum() / pairs  # the mean over the global batch of pairs
        self.model.runtime.backward(loss)
        loss_sum, correct, margin, chosen_sum, rejected_sum, tokens = global_sum(
            loss.item(), (chosen > rejected).sum().item(), (chosen - rejected).sum().item(), chosen.sum().item(),
            rejected.sum().item(), batch["attention_mask"].sum().item())
        _, (norm,) = optimizer_step([self.model], step, {"loss": loss_sum}, nonfinite, step + 1)
        seconds = time.perf_counter() - start
        self.priced_work_took(seconds)
        return {"loss": loss_sum, "accuracy": correct / pairs, "margin": margin / pairs, "chosen": chosen_sum / pairs,
                "rejected": rejected_sum / pairs, "grad norm": norm,
                "learning rate": self.model.optimizer.param_groups[0]["lr"], "tokens/s": tokens / seconds,
                "elapsed time per iteration (ms)": seconds * 1e3, **comm_scalars(self.models)}

    def evaluate(self) -> dict[str, float]:
        """Loss, accuracy and margin on (at most train.eval_batches global batches of) the held-out pairs."""
        cfg, env, prefs = self.cfg, self.env, self.prefs
        per_rank = min(cfg.train.micro_batch_size, max(1, len(prefs.valid_indices) // env.world_size))
        sampler = ResumableBatchSampler(prefs.valid_indices, per_rank, env.rank, env.world_size, cfg.train.seed,
                                        shuffle=False)
        batches = iter(sampler)
        n = min(cfg.train.eval_batches, max(1, len(prefs.valid_indices) // (per_rank * env.world_size)))
        totals = torch.zeros(4, dtype=torch.float64)  # loss, correct, margin, pairs
        with torch.no_grad():
            for _ in range(n):
                indices = next(batches)
                losses, chosen, rejected = self.objective.losses(self._batch(indices), indices)
                totals += torch.tensor([losses.sum().item(), (chosen > rejected).sum().item(),
                                        (chosen - rejected).sum().item(), len(indices)], dtype=torch.float64)
        loss, correct, margin, pairs = global_sum(*totals)
        return {"held-out loss": loss / pairs, "held-out accuracy": correct / pairs, "held-out margin": margin / pairs,
                "held-out pairs": pairs}

    def export(self) -> None:
        self.model.export(self.stage_dir / "hf", self.cfg.sft_path(), self.tokenizer)


def run_pairs(stage: str, cfg: RLHFConfig, env: DistEnv) -> dict:
    """Train the reward model (stage "reward") or the DPO policy (stage "dpo"); export it to
    <out_dir>/<stage>/hf; returns the held-out accuracy and margin before and after."""
    result = run_stage(PairStage(stage, cfg, env), cfg.train)
    if result.preempted:
        return {"preempted": True}
    out = {"end": result.evaluations[result.step]}
    if 0 in result.evaluations:
        out["start"] = result.evaluations[0]
    return out
