"""Multi-turn chat records rendered with the tokenizer's own chat template, the loss on the
assistant turns only (what TRL's `assistant_only_loss` and torchtune's message masking train).

A record is {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]},
TRL's conversational format. The template is the tokenizer directory's (tokenizer_config.json's
`chat_template` or chat_template.jinja), rendered by transformers exactly as
`apply_chat_template` renders it for serving, so training and inference see the same text.
Each assistant turn's span is found by rendering the conversation up to it with the generation
prompt (what inference feeds the model) and then with the turn: the text between the two is
trained, everything else masked. A template that does not render a conversation as the
continuation of its earlier turns (one that rewrites earlier turns) cannot be masked this way
and is refused, naming the turn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """The chat template of a Hugging Face tokenizer directory."""

    def __init__(self, tokenizer_dir: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(tokenizer_dir)
        self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        if not self._tokenizer.chat_template:
            raise ValueError(f"{self.path}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                             f"or chat_template.jinja), which records with 'messages' are rendered with")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)


def check_messages(messages, where: str) -> list[dict]:
    """`messages` as a list of {"role", "content"} dicts with at least one assistant turn, or an
    error naming the record and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' is {messages!r:.80}, expected a non-empty list of "
                         f"{{'role', 'content'}} objects")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {k} is {m!r:.80}, expected {{'role': one of {', '.join(ROLES)}, "
                             f"'content': a string}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message: nothing to train on")
    return messages


def chat_segments(template: ChatTemplate, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces in order: each assistant turn trained
    (its content and the template's end-of-turn text), the rest (system, user, the generation
    prompts) masked."""
    segments, done = [], ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:k], add_generation_prompt=True)
        turn = template.render(messages[:k + 1])
        if not (prompt.startswith(done) and turn.startswith(prompt)):
            raise ValueError(f"{where}: the chat template of {template.path} does not render message {k} (an "
                             f"assistant turn) as a continuation of the messages before it, so the assistant "
                             f"tokens cannot be told apart; use a template that renders turns append-only")
        segments += [(prompt[len(done):], False), (turn[len(prompt):], True)]
        done = turn
    whole = template.render(messages)
    if not whole.startswith(done):
        raise ValueError(f"{where}: the chat template of {template.path} renders the whole conversation "
                         f"differently from its turns")
    if len(whole) > len(done):
        segments.append((whole[len(done):], False))
    return [(text, trained) for text, trained in segments if text]


def chat_example(template: ChatTemplate, encode, messages: list[dict], ignore_index: int,
                 where: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels) of one conversation, untruncated: labels are the tokens on assistant turns,
    `ignore_index` elsewhere. The template writes any BOS itself, so none is added."""
    tokens, labels = [], []
    for text, trained in chat_segments(template, check_messages(messages, where), where):
        ids = encode(text)
        tokens += ids
        labels += ids if trained else [ignore_index] * len(ids)
    return np.asarray(tokens, dtype=np.int64), np.asarray(labels, dtype=np.int64)
