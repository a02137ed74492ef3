"""Verifiable tasks: prompts whose responses a program scores, so PPO and GRPO can be shown to
learn on CPU in minutes with no data and no download.

Each task also gives a correct response (a demonstration, for the SFT warm-up) and a wrong one
(for reward-model pairs); `task_records` turns them into records for data.datasets, and
`save_task_tokenizer` writes the character-level tokenizer the tiny models use.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import string
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

# Ids 0..3 in this order; `<unk>` stands for a character outside CHARACTERS.
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Printable ASCII and the newline: every task string, with room for tasks added later.
CHARACTERS = "".join(chr(code) for code in range(32, 127)) + "\n"


def build_task_tokenizer() -> Tokenizer:
    """One token per character (a WordLevel vocabulary over single characters).

    The pre-tokenizer isolates every character, whitespace included, and the Fuse decoder joins
    tokens without the spaces a WordLevel decode would insert, so decode(encode(s)) == s.
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # so decode(skip_special_tokens=True) drops them
    return tokenizer


def save_task_tokenizer(directory: str | os.PathLike) -> Path:
    """Write the task tokenizer as a Hugging Face tokenizer directory that data.tokenizer.load_tokenizer
    reads (pad 0, bos 1, eos 2); returns `directory`.

    Atomic (written to a temporary sibling, then renamed) and idempotent: a directory that
    already holds a tokenizer.json is left as it is, so concurrent ranks may all call this.
    """
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        build_task_tokenizer().save(str(tmp / "tokenizer.json"))
        names = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "clean_up_tokenization_spaces": False}
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp's 0o700 would hide it from other users of a shared run directory
        try:
            os.rename(tmp, directory)
        except OSError:  # another rank renamed first, or a non-empty directory is in the way
            if not (directory / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


class VerifiableTask(ABC):
    """A prompt generator with a programmatic reward in [0, 1] (1.0 for a correct response).

    Responses are the generated text up to EOS; what follows a complete answer is not scored.
    """

    name: str

    @abstractmethod
    def prompt(self, rng: random.Random) -> str: ...

    @abstractmethod
    def reward(self, prompt: str, response: str) -> float: ...

    @abstractmethod
    def demonstration(self, prompt: str) -> str:
        """A correct response (reward 1.0)."""

    @abstractmethod
    def corrupt(self, prompt: str, rng: random.Random) -> str:
        """A wrong response (reward below 1.0), the rejected side of a reward-model pair."""


def _parse(pattern: re.Pattern, prompt: str, task: str) -> tuple[str, ...]:
    match = pattern.fullmatch(prompt)
    if match is None:
        raise ValueError(f"{prompt!r} is not a prompt of the {task!r} task (expected {pattern.pattern!r})")
    return match.groups()


class ArithmeticTask(VerifiableTask):
    """Addition: "12+7=" -> "19", operands in 0..max_operand (20 by default: 441 prompts, few enough
    for a tiny model to master on CPU in minutes).

    The answer is the response's leading digits, which must spell the sum in canonical decimal
    (no leading zero) for 1.0. Any other number earns `format_reward` and no number 0.0: a
    small format reward, as DeepSeek-R1's rule-based rewards pair accuracy with format, gives a
    tiny model a first step to climb without ever competing with a correct answer.
    """

    name = "arithmetic"
    PROMPT = re.compile(r"(\d+)\+(\d+)=")

    def __init__(self, max_operand: int = 20, format_reward: float = 0.1):
        if max_operand < 0 or not 0 <= format_reward < 1:
            raise ValueError(f"max_operand={max_operand}, format_reward={format_reward}; "
                             "expected max_operand >= 0 and 0 <= format_reward < 1")
        self.max_operand = max_operand
        self.format_reward = format_reward

    def prompt(self, rng: random.Random) -> str:
        return f"{rng.randint(0, self.max_operand)}+{rng.randint(0, self.max_operand)}="

    def _sum(self, prompt: str) -> int:
        a, b = _parse(self.PROMPT, prompt, self.name)
        return int(a) + int(b)

    def reward(self, prompt: str, response: str) -> float:
        total = self._sum(prompt)
        answer = re.match(r"\d*", response).group()
        if not answer:
            return 0.0
        return 1.0 if answer == str(total) else self.format_reward

    def demonstration(self, prompt: str) -> str:
        return str(self._sum(prompt))

    def corrupt(self, prompt: str, rng: random.Random) -> str:
        """Mostly a near miss (the sum off by 1..3, the hard negatives), sometimes letters instead of a number."""
        if rng.random() < 0.25:
            return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 3)))
        total, offset = self._sum(prompt), rng.randint(1, 3)
        return str(total + offset if rng.random() < 0.5 or total < offset else total - offset)


class WordTask(VerifiableTask):
    """Repetition: "say cat:" -> "cat", the word drawn from a fixed list.

    The reward is the fraction of the word's characters the response matches in order from its
    start (1.0 when it starts with the word), dense enough for a tiny model to climb letter by letter.
    """

    name = "word"
    PROMPT = re.compile(r"say ([a-z]+):")
    WORDS = ("cat", "dog", "sun", "tree", "bird", "fish", "moon", "star", "frog", "apple", "river", "house")

    def __init__(self, words: Iterable[str] = WORDS):
        self.words = tuple(words)
        bad = [w for w in self.words if not re.fullmatch(r"[a-z]+", w)]
        if not self.words or bad:
            raise ValueError(f"words must be non-empty lowercase ASCII words; got {list(self.words)}")

    def prompt(self, rng: random.Random) -> str:
        return f"say {rng.choice(self.words)}:"

    def reward(self, prompt: str, response: str) -> float:
        (word,) = _parse(self.PROMPT, prompt, self.name)
        matched = 0
        while matched < min(len(word), len(response)) and response[matched] == word[matched]:
            matched += 1
        return matched / len(word)

    def demonstration(self, prompt: str) -> str:
        return _parse(self.PROMPT, prompt, self.name)[0]

    def corrupt(self, prompt: str, rng: random.Random) -> str:
        """The word's first k < len(word) letters, then a wrong letter and random ones, to the word's length."""
        word = self.demonstration(prompt)
        keep = rng.randrange(len(word))
        wrong = rng.choice([c for c in string.ascii_lowercase if c != word[keep]])
        tail = rng.choices(string.ascii_lowercase, k=len(word) - keep - 1)
        return word[:keep] + wrong + "".join(tail)


def final_answer(response: str) -> int | None:
    """The integer a response gives as its final answer, as GSM8K-style graders read it: the number
    after the last "Answer:" or "####" marker, else the last number in the text (None: no number)."""
    marked = re.findall(r"(?:answer\s*:|####)\s*(-?\d+)", response, flags=re.IGNORECASE)
    if marked:
        return int(marked[-1])
    numbers = re.findall(r"-?\d+", response)
    return int(numbers[-1]) if numbers else None


class MathTask(VerifiableTask):
    """Multi-step word problems: "Ann has 4 pens. She gets 3 more. She gives away 2. How many pens
    does Ann have?" -> "4+3=7. 7-2=5. Answer: 5": a start and `steps` operations (gets / gives away
    / doubles / triples, the count never below 0), each written out as one equation, then the
    final answer.

    The reward reads the final answer (`final_answer`: the number after "Answer:", else the last
    number) and gives 1.0 when it is right, `format_reward` for another number, 0.0 for none. The
    intermediate equations are not graded, as GSM8K's graders do not grade them: the steps help a
    model reach the answer, and a reward on them would reward the format, not the result.
    """

    name = "math"
    NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Ivy")
    THINGS = ("pens", "apples", "cards", "coins", "books", "shells", "stamps", "marbles")
    START = re.compile(r"([A-Z][a-z]+) has (\d+) ([a-z]+)\.")
    # The operations (the sentence after "She " / "He "): its operator, the operand from the sentence.
    OPERATION = re.compile(r"(?:gets (\d+) more|gives away (\d+)|(doubles|triples) them)\.")
    FACTORS = {"doubles": 2, "triples": 3}
    QUESTION = re.compile(r"How many ([a-z]+) does ([A-Z][a-z]+) have\?")

    def __init__(self, steps: int = 2, max_number: int = 9, format_reward: float = 0.1):
        if steps < 1 or max_number < 1 or not 0 <= format_reward < 1:
            raise ValueError(f"steps={steps}, max_number={max_number}, format_reward={format_reward}; expected "
                             f"steps >= 1, max_number >= 1 and 0 <= format_reward < 1")
        self.steps, self.max_number, self.format_reward = steps, max_number, format_reward

    def prompt(self, rng: random.Random) -> str:
        name, thing = rng.choice(self.NAMES), rng.choice(self.THINGS)
        pronoun = "She" if name in ("Ann", "Cara", "Fay", "Ivy") else "He"
        count = rng.randint(2, max(2, self.max_number))
        sentences = [f"{name} has {count} {thing}."]
        for _ in range(self.steps):
            choices = ["gets", "doubles", "triples"] + (["gives"] if count > 0 else [])
            op = rng.choice(choices)
            if op == "gets":
                k = rng.randint(1, self.max_number)
                sentences.append(f"{pronoun} gets {k} more.")
                count += k
            elif op == "gives":
                k = rng.randint(1, min(count, self.max_number))
                sentences.append(f"{pronoun} gives away {k}.")
                count -= k
            else:
                sentences.append(f"{pronoun} {op} them.")
                count *= 2 if op == "doubles" else 3
        sentences.append(f"How many {thing} does {name} have?")
        return " ".join(sentences) + "\n"

    def _equations(self, prompt: str) -> tuple[list[str], int]:
        """The prompt's equations, one per operation ("7*3=21"), and the answer."""
        text = prompt.rstrip("\n")
        start, question = self.START.match(text), self.QUESTION.search(text)
        if start is None or question is None:
            raise ValueError(f"{prompt!r} is not a prompt of the {self.name!r} task (expected "
                             f"'<Name> has <n> <things>. ... How many <things> does <Name> have?')")
        count, equations = int(start.group(2)), []
        for sentence in re.findall(r"(?:She|He) [^.]*\.", text[start.end():question.start()]):
            match = self.OPERATION.fullmatch(sentence.split(" ", 1)[1])
            if match is None:
                raise ValueError(f"{prompt!r}: {sentence!r} is not an operation of the {self.name!r} task")
            gets, gives, times = match.groups()
            op, k = ("+", int(gets)) if gets else ("-", int(gives)) if gives else ("*", self.FACTORS[times])
            new = count + k if op == "+" else count - k if op == "-" else count * k
            equations.append(f"{count}{op}{k}={new}")
            count = new
        return equations, count

    def reward(self, prompt: str, response: str) -> float:
        _, answer = self._equations(prompt)
        given = final_answer(response)
        if given is None:
            return 0.0
        return 1.0 if given == answer else self.format_reward

    def demonstration(self, prompt: str) -> str:
        equations, answer = self._equations(prompt)
        return ". ".join(equations) + f". Answer: {answer}"

    def corrupt(self, prompt: str, rng: random.Random) -> str:
        """The right equations with a final answer off by 1..3 (a hard negative), or a slip in the
        last equation carried into the answer."""
        equations, answer = self._equations(prompt)
        wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
        if wrong < 0:
            wrong = answer + rng.randint(1, 3)
        if rng.random() < 0.5:
            equations[-1] = equations[-1].rsplit("=", 1)[0] + f"={wrong}"
        return ". ".join(equations) + f". Answer: {wrong}"


TASKS = {"arithmetic": ArithmeticTask, "word": WordTask, "math": MathTask}
RECORD_KINDS = ("sft", "pairs", "prompts")


def get_task(name: str, **options) -> VerifiableTask:
    """The built-in task `name`, built with `options` (e.g. max_operand=10)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {list(TASKS)}")
    return TASKS[name](**options)


def task_records(task: VerifiableTask | str, n: int, seed: int, kind: str) -> list[dict]:
    """`n` records of `task` (an instance or a name in TASKS), the same for the same seed.

    kind "sft": {"prompt", "completion"}, SFTDataset's "completion" format (TRL's
    prompt-completion records), which keeps the prompt verbatim where alpaca would wrap it in
    its template. kind "pairs": {"prompt", "chosen", "rejected"}, PreferenceDataset's "pairs"
    format (the demonstration against a corrupted response). kind "prompts": {"prompt"}, for rollouts.
    """
    if kind not in RECORD_KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {list(RECORD_KINDS)}")
    if isinstance(task, str):
        task = get_task(task)
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt = task.prompt(rng)
        if kind == "prompts":
            records.append({"prompt": prompt})
        elif kind == "sft":
            records.append({"prompt": prompt, "completion": task.demonstration(prompt)})
        else:
            records.append({"prompt": prompt, "chosen": task.demonstration(prompt),
                            "rejected": task.corrupt(prompt, rng)})
    return records


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write `records` one JSON object a line, atomically (a temporary sibling, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
