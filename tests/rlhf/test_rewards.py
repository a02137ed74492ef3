"""rlhf.rewards: a user's reward functions loaded by name or file, weighted and summed as TRL's
reward_funcs / reward_weights (None adds nothing), and every way they can fail named in one line."""

import time

import pytest

from rlhf.rewards import RewardFunctionError, RewardFunctions
from trainer.config import ConfigError

MODULE = '''
import time

def length(prompts, completions, **kwargs):
    return [len(c) for c in completions]

def shouts(prompts, completions):
    return [1.0 if c.isupper() else None for c in completions]

def echoes(prompts, completions, **kwargs):
    return [float(c.startswith(p)) for p, c in zip(prompts, completions)]

def raises(prompts, completions):
    raise KeyError("answer")

def hangs(prompts, completions):
    time.sleep(30)

def short(prompts, completions):
    return [0.0]

def text(prompts, completions):
    return ["high"] * len(completions)

def one_argument(completions):
    return [0.0] * len(completions)

not_callable = 3
'''

PROMPTS = ["say", "go", "hi", "no"]
COMPLETIONS = ["say HI", "STOP", "hi there", "x"]


@pytest.fixture
def module(tmp_path, monkeypatch):
    path = tmp_path / "user_rewards.py"
    path.write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def test_the_weighted_sum_of_the_functions_none_adding_nothing(module):
    fns = RewardFunctions.from_config(["user_rewards:length", f"{module}:shouts", "user_rewards:echoes"],
                                      [0.5, 2.0, -1.0], timeout=10)
    total, applied_to = fns.score(PROMPTS, COMPLETIONS)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):  # written out per completion
        expected = 0.5 * len(c) + (2.0 if c.isupper() else 0.0) - 1.0 * float(c.startswith(p))
        assert total[i].item() == pytest.approx(expected)
    assert applied_to["user_rewards:length"] == (sum(map(len, COMPLETIONS)), 4)
    assert applied_to[f"{module}:shouts"] == (1.0, 1)  # the one completion it applied to ("STOP")
    unweighted, _ = RewardFunctions.from_config(["user_rewards:length"], [], timeout=10).score(PROMPTS, COMPLETIONS)
    assert unweighted.tolist() == [float(len(c)) for c in COMPLETIONS]


@pytest.mark.parametrize("spec, match", [
    ("user_rewards", r"expected 'module:callable' or 'path/to/file.py:callable'"),
    ("no_such_module:f", r"importing 'no_such_module' failed: ModuleNotFoundError"),
    ("missing.py:f", r"no such file 'missing.py'"),
    ("user_rewards:nothing", r"'user_rewards' has no callable 'nothing'"),
    ("user_rewards:not_callable", r"'user_rewards' has no callable 'not_callable'"),
    ("user_rewards:one_argument", r"cannot be called as fn\(prompts=..., completions=...\)"),
])
def test_a_bad_entry_is_a_config_error_naming_it(module, spec, match):
    with pytest.raises(ConfigError, match=r"reward.functions.*" + match):
        RewardFunctions.from_config([spec], [], timeout=10)


def test_bad_weights_and_timeouts_name_the_key(module):
    with pytest.raises(ConfigError, match=r"reward.function_weights: 1 weights for 2 reward.functions"):
        RewardFunctions.from_config(["user_rewards:length", "user_rewards:echoes"], [1.0], timeout=10)
    with pytest.raises(ConfigError, match=r"reward.function_timeout: value 0 must be > 0"):
        RewardFunctions.from_config(["user_rewards:length"], [], timeout=0)


@pytest.mark.parametrize("name, match", [
    ("raises", r"reward function user_rewards:raises raised KeyError: 'answer'"),
    ("short", r"reward function user_rewards:short returned 1 values for 4 completions"),
    ("text", r"reward function user_rewards:text returned 'high' for completion 0; expected a number or None"),
])
def test_a_failing_call_names_the_function(module, name, match):
    fns = RewardFunctions.from_config([f"user_rewards:{name}"], [], timeout=10)
    with pytest.raises(RewardFunctionError, match=match):
        fns.score(PROMPTS, COMPLETIONS)


def test_a_hanging_function_is_named_after_its_timeout(module):
    fns = RewardFunctions.from_config(["user_rewards:hangs"], [], timeout=0.5)
    start = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=r"user_rewards:hangs did not return within 0.5 s "
                                                  r"\(reward.function_timeout\)"):
        fns.score(PROMPTS, COMPLETIONS)
    assert time.perf_counter() - start < 5
