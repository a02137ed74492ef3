"""Batched rollout generation on a data-parallel runtime (PPO / GRPO).

    out = generate_rollouts(runtime, prompts, max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    out.responses[i], out.logprobs[i]     # per prompt of this rank

The weights are gathered once per rollout (`Runtime.inference_weights`), then the decode
loop of models.generate (left padding, KV cache, sampling) runs on this rank's prompts.

Ranks generate different lengths. When the forwards inside the rollout hold no collective
(the usual case: the whole model fits the inference copy) a rank stops as soon as its own
rows are done and nothing is exchanged while decoding. When some blocks are streamed (they
did not fit `max_bytes`), every forward all-gathers, so all ranks must run the same number
of forwards: each decode step then all-reduces one "still running" flag over the
data-parallel group (through a zeropp.comm.Comm on the runtime's mesh, recorded in the
runtime's ledger as "rollout stop flag"), and every rank keeps stepping (its finished rows'
outputs discarded) until no rank is running. So no collective is left unmatched, and nobody
decodes to max_new_tokens needlessly (DeepSpeed-Chat's `synced_gpus` decodes every rank to the maximum
and can still hang: DeepSpeed issues #3550, #8262).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from models.generate import decode
from zeropp.comm import Comm
from zeropp.runtime import Runtime

STOP_FLAG_TAG = "rollout stop flag"


@dataclass
class Rollouts:
    """One rank's rollout: per prompt the response tokens and their log-probs, plus stats."""

    # New tokens per prompt, the EOS included as the last token when one was sampled: the reward
    # model scores the sequence at its EOS, and the PPO loss must train the policy to emit it (a
    # response without its EOS would never teach the policy when to stop).
    responses: list[list[int]]
    # log p(token) under the untempered policy at generation time (log_softmax of the raw fp32
    # logits, whatever the sampling temperature / top-k / top-p): what the trainer compares with
    # the log-probs it recomputes.
    logprobs: list[list[float]]
    new_tokens: int  # this rank's response tokens, EOS included
    seconds: float  # wall time of the rollout, the weight gather included
    inference_bytes: int  # memory the inference copy added (InferenceWeights.bytes)
    steps: int  # decode steps run (one sampled token per row each)


def generate_rollouts(runtime: Runtime, prompts: list[list[int]], max_new_tokens: int, *,
                      temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                      eos_token_id: int, pad_token_id: int, generator: torch.Generator | None = None,
                      max_bytes: int | None = None, min_new_tokens: int = 0) -> Rollouts:
    """Sample a response to each of this rank's prompts from `runtime.module`.

    Every rank of the runtime's data-parallel group calls it together, with the same
    max_new_tokens and max_bytes (the prompts, and how many, may differ). A response ends at
    eos_token_id (kept, see Rollouts.responses; never among its first min_new_tokens) or after
    max_new_tokens tokens. temperature 0 is greedy; `generator` makes sampling reproducible.
    `max_bytes` bounds the memory of the gathered inference copy (None: the whole model).
    """
    start = time.perf_counter()
    with runtime.inference_weights(max_bytes) as info:
        keep_going = _step_together(runtime) if info.collectives_per_forward else None
        out = decode(runtime.module, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                     eos_token_id=eos_token_id, pad_token_id=pad_token_id, generator=generator, logprobs=True,
                     keep_going=keep_going, min_new_tokens=min_new_tokens)
    return Rollouts(out.tokens, out.logprobs, sum(len(r) for r in out.tokens), time.perf_counter() - start,
                    info.bytes, out.steps)


def _step_together(runtime: Runtime):
    """keep_going for ranks whose forwards hold collectives: one all-reduce of a "still running"
    flag per decode step over the data-parallel group; everyone stops when no rank runs."""
    comm = Comm(runtime.mesh, runtime.ledger, node_aware=False)

    def keep_going(all_done: bool) -> bool:
        running = torch.tensor([0 if all_done else 1], dtype=torch.int32, device=comm.device)
        comm.all_reduce(running, "dp", STOP_FLAG_TAG)
        return running.item() > 0

    return keep_going
