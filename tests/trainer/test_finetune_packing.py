"""data.packing in finetune.py: packed micro-batches give the padded path's loss and gradients, on one
process and on 2 ZeRO-3 ranks; packing where it cannot apply is refused naming the key."""

import dataclasses

import pytest
import torch

from tests.trainer.test_finetune import ZERO3_FP32, ft_args, ft_config, hf_dirs, synthetic, tokenizer_dir  # noqa: F401
from trainer.config import ConfigError, parse_args, Config
from trainer.loop import Trainer, train
from trainer.spawn import run_ranks

# The synthetic examples are 64 to 75 tokens: rows of 192 hold two or three of them.
PACKED = ("--data.seq_len", "192", "--data.packing", "true")
PADDED = ("--data.seq_len", "192")


@pytest.mark.parametrize("kind", ["llama", "opt"])  # RoPE; learned positions (which must restart per example)
def test_packed_batch_gives_the_padded_loss_and_gradients(kind, hf_dirs, synthetic, tmp_path):  # noqa: F811
    trainer = Trainer(ft_config(*ft_args(hf_dirs[kind], synthetic, tmp_path, *PACKED)))
    try:
        indices = trainer.data.train_indices[:8].tolist()
        results = []
        for data in (trainer.data, dataclasses.replace(trainer.data, packing=False)):
            inputs, labels = data.batch(indices, torch.device("cpu"))
            trainer.model.zero_grad()
            loss = trainer.runtime.lm_loss(trainer.model(**inputs), labels)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
            results.append((inputs["tokens"].shape, (labels != -100).sum().item(), loss.item(), grads))
        (packed_shape, packed_targets, packed_loss, packed_grads), (padded_shape, targets, loss, grads) = results
        assert packed_shape[0] <= 4 and padded_shape[0] == 8 and packed_targets == targets
        assert abs(packed_loss - loss) < 1e-5
        for name, grad in grads.items():
            torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-5, msg=name)
    finally:
        trainer.close()


def _train_on_ranks(rank, world, *runs):
    return [(result.losses, result.val_losses) for result in (train(ft_config(*argv)) for argv in runs)]


def test_packed_sft_on_two_zero3_ranks_equals_padded(hf_dirs, synthetic, tmp_path):  # noqa: F811
    common = (*ZERO3_FP32, "--train.steps", "4", "--train.eval_interval", "4")
    (padded, padded_val), (packed, packed_val) = run_ranks(_train_on_ranks, 2, args=(
        ft_args(hf_dirs["llama"], synthetic, tmp_path / "padded", *PADDED, *common),
        ft_args(hf_dirs["llama"], synthetic, tmp_path / "packed", *PACKED, *common)))[0]
    assert len(padded) == 4 and max(abs(packed[s] - padded[s]) for s in padded) < 1e-5
    assert abs(packed_val[4] - padded_val[4]) < 1e-5


def test_packing_is_refused_where_it_cannot_apply(hf_dirs, synthetic, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="data.packing: value True applies to fine-tuning"):
        Trainer(parse_args(["--data.packing", "true", "--train.out_dir", str(tmp_path / "pretrain")], Config()))
    with pytest.raises(ConfigError, match="data.packing: value True cannot go with tensor_parallel.topk_keep_ratio"):
        Trainer(ft_config(*ft_args(hf_dirs["llama"], synthetic, tmp_path / "tp", *PACKED, "--tensor_parallel.size",
                                   "2", "--tensor_parallel.topk_keep_ratio", "0.5")))
