"""rlhf.tasks: the character tokenizer as the data pipeline loads it, rewards, records."""

import json
import random
import re

import pytest

from data.datasets import IGNORE_INDEX, PreferenceDataset, SFTDataset
from data.tokenizer import HFTokenizer, load_tokenizer
from rlhf.tasks import TASKS, final_answer, get_task, save_task_tokenizer, task_records, write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_task_tokenizer(tmp_path_factory.mktemp("tok") / "task_tokenizer"))


def test_tokenizer_loads_with_special_ids_and_round_trips_task_strings(tokenizer):
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 4 + 95 + 1  # specials, printable ASCII, newline
    texts = [r[k] for name in TASKS for r in task_records(name, 50, seed=0, kind="pairs") for k in r]
    texts += ["  two  spaces\nand a newline ", "12+7=19", "say cat:cat"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert len(ids) == len(text)  # one token per character
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id, tokenizer.pad_id]) == text
    assert tokenizer.encode("ab") + tokenizer.encode("c") == tokenizer.encode("abc")


def test_save_task_tokenizer_is_idempotent(tmp_path):
    directory = save_task_tokenizer(tmp_path / "tok")
    assert sorted(p.name for p in directory.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    before = (directory / "tokenizer.json").stat().st_mtime_ns
    assert save_task_tokenizer(tmp_path / "tok") == directory
    assert (directory / "tokenizer.json").stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temporary directory left behind


@pytest.mark.parametrize("prompt,response,expected", [
    ("12+7=", "19", 1.0), ("12+7=", "19 and more", 1.0), ("0+0=", "0", 1.0),
    ("12+7=", "20", 0.1), ("12+7=", "019", 0.1), ("12+7=", " 19", 0.0), ("12+7=", "", 0.0), ("12+7=", "x", 0.0),
])
def test_arithmetic_reward(prompt, response, expected):
    assert get_task("arithmetic").reward(prompt, response) == expected


@pytest.mark.parametrize("response,expected", [
    ("cat", 1.0), ("cats", 1.0), ("ca", 2 / 3), ("cow", 1 / 3), ("dog", 0.0), ("", 0.0), (" cat", 0.0),
])
def test_word_reward_counts_leading_matched_characters(response, expected):
    assert get_task("word").reward("say cat:", response) == pytest.approx(expected)


@pytest.mark.parametrize("name", list(TASKS))
def test_demonstrations_score_the_maximum_and_corruptions_less(name):
    task, rng = get_task(name), random.Random(0)
    for _ in range(300):
        prompt = task.prompt(rng)
        assert task.reward(prompt, task.demonstration(prompt)) == 1.0
        assert task.reward(prompt, task.corrupt(prompt, rng)) < 1.0


def test_prompts_follow_the_documented_forms():
    rng = random.Random(0)
    def operands(task):
        return {int(a) for _ in range(500) for a in task.prompt(rng).removesuffix("=").split("+")}

    assert operands(get_task("arithmetic")) == set(range(21))
    assert operands(get_task("arithmetic", max_operand=3)) == set(range(4))
    assert get_task("word").prompt(rng).startswith("say ")
    with pytest.raises(ValueError, match="arithmetic"):
        get_task("arithmetic").reward("say cat:", "cat")


def test_get_task_lists_the_names_of_unknown_tasks():
    with pytest.raises(ValueError, match=r"'sorting'.*'arithmetic', 'word'"):
        get_task("sorting")


def test_task_records_are_deterministic_for_a_seed():
    for kind, keys in [("sft", {"prompt", "completion"}), ("pairs", {"prompt", "chosen", "rejected"}),
                       ("prompts", {"prompt"})]:
        records = task_records("arithmetic", 20, seed=3, kind=kind)
        assert len(records) == 20 and all(set(r) == keys for r in records)
        assert records == task_records("arithmetic", 20, seed=3, kind=kind)
        assert records != task_records("arithmetic", 20, seed=4, kind=kind)
    with pytest.raises(ValueError, match="'rl'"):
        task_records("word", 2, seed=0, kind="rl")


def check_example(tokenizer, tokens, labels, prompt, response):
    """[BOS] prompt response EOS, the prompt verbatim and masked, the response (and EOS) the targets."""
    tokens, labels = tokens.tolist(), labels.tolist()
    n_prompt = labels.count(IGNORE_INDEX)
    assert tokens[0] == tokenizer.bos_id and tokens[-1] == tokenizer.eos_id
    assert tokenizer.decode(tokens[1:n_prompt]) == prompt
    assert tokenizer.decode(labels[n_prompt:]) == response


def test_sft_records_load_as_completion_records_with_the_prompt_verbatim(tokenizer):
    records = task_records(get_task("arithmetic"), 8, seed=0, kind="sft")
    dataset = SFTDataset(records, tokenizer, max_len=64)
    assert dataset.format == "completion" and len(dataset) == 8
    for record, example in zip(records, dataset):
        check_example(tokenizer, example["tokens"], example["labels"], record["prompt"], record["completion"])


def test_pairs_load_as_preference_records_with_the_prompt_verbatim(tokenizer):
    records = task_records(get_task("word"), 8, seed=0, kind="pairs")
    dataset = PreferenceDataset(records, tokenizer, max_len=64)
    assert dataset.format == "pairs" and len(dataset) == 8
    for record, example in zip(records, dataset):
        for side in ("chosen", "rejected"):
            check_example(tokenizer, example[f"{side}_tokens"], example[f"{side}_labels"], record["prompt"],
                          record[side])


def test_write_jsonl_round_trips_and_leaves_no_temporary_file(tmp_path):
    records = task_records("word", 5, seed=1, kind="sft")
    path = write_jsonl(records, tmp_path / "sub" / "sft.jsonl")
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == records
    assert [p.name for p in path.parent.iterdir()] == ["sft.jsonl"]


def test_final_answer_reads_the_marker_else_the_last_number():
    assert final_answer("3+4=7. 7*3=21. Answer: 21") == 21
    assert final_answer("so #### 12") == 12  # GSM8K's marker
    assert final_answer("answer: 5, no, Answer: 6 (then 7)") == 6  # the last marker wins over later numbers
    assert final_answer("7 apples, then 9") == 9
    assert final_answer("Answer: -2") == -2
    assert final_answer("no idea") is None


def test_math_task_solves_its_word_problems_as_written_by_hand():
    task = get_task("math", steps=3)
    prompt = "Ben has 3 cards. He gets 4 more. He triples them. He gives away 5. How many cards does Ben have?\n"
    assert task.demonstration(prompt) == "3+4=7. 7*3=21. 21-5=16. Answer: 16"  # (3 + 4) * 3 - 5
    assert task.reward(prompt, "3+4=7. 7*3=21. 21-5=16. Answer: 16") == 1.0
    assert task.reward(prompt, "16") == 1.0  # the steps are not graded
    assert task.reward(prompt, "3+4=7. Answer: 15") == 0.1
    assert task.reward(prompt, "Answer: 16. Answer: 17") == 0.1
    assert task.reward(prompt, "many") == 0.0
    with pytest.raises(ValueError, match="'math' task"):
        task.reward("12+7=", "19")
    with pytest.raises(ValueError, match="'He eats 2.' is not an operation of the 'math' task"):
        task.reward("Ben has 3 cards. He eats 2. How many cards does Ben have?\n", "1")


def test_math_task_prompts_never_go_below_zero_and_corruptions_are_wrong():
    task, rng = get_task("math", steps=3, max_number=5), random.Random(0)
    for _ in range(300):
        prompt = task.prompt(rng)
        assert len(re.findall(r"(?:She|He) ", prompt)) == 3
        equations = task.demonstration(prompt).split(". ")[:-1]
        for equation in equations:  # each step recomputed from its own text
            left, right = equation.split("=")
            a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", left).groups()
            assert int(right) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] >= 0
        assert task.reward(prompt, task.corrupt(prompt, rng)) < 1.0


def test_task_options_reach_the_task_and_name_what_is_wrong(tmp_path):
    from rlhf.config import RLHFConfig
    from rlhf.data import task
    from trainer.config import ConfigError
    cfg = RLHFConfig()
    cfg.data.task, cfg.data.task_options = "math", ["steps=1", "max_number=3", "format_reward=0.2"]
    math = task(cfg)
    assert (math.steps, math.max_number, math.format_reward) == (1, 3, 0.2)
    rng = random.Random(0)
    assert all(len(re.findall(r"(?:She|He) ", math.prompt(rng))) == 1 for _ in range(50))
    for options, match in ((["stepz=1"], r"the 'math' task has no option 'stepz'; its options are \['steps', "),
                           (["steps"], r"'steps' is not name=number"), (["steps=0"], r"data.task: steps=0")):
        cfg.data.task_options = options
        with pytest.raises(ConfigError, match=match):
            task(cfg)
