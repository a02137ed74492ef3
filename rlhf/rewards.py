"""Rewards a user brings: `reward.functions`, Python callables scored on decoded text, weighted
and summed (TRL's `reward_funcs` / `reward_weights`).

Each entry is `module:callable` (an importable module) or `path/to/file.py:callable`. The callable
is called once per rollout on every rank with keyword arguments, as TRL calls its reward functions:

    def my_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]

and returns one value per completion; None means "does not apply" and adds nothing (TRL's nansum).
A call that raises, returns the wrong number of values or something not a number, or does not return
within `reward.function_timeout` seconds ends the run with one line naming the function.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from trainer.config import ConfigError


class RewardFunctionError(ConfigError):
    """A user's reward function failed: raised, hung, or returned something unusable (a user error:
    rlhf.py ends with its one line, as for a bad config value)."""


def load_function(spec: str, key: str) -> Callable:
    """The callable `spec` names (`module:name` or `file.py:name`); `key` names the config entry."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"{key} {spec!r}: expected 'module:callable' or 'path/to/file.py:callable'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"{key} {spec!r}: no such file {str(path)!r}")
            loader_spec = importlib.util.spec_from_file_location(f"reward_functions.{path.stem}", path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import: say which and why, in one line
        raise ConfigError(f"{key} {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key} {spec!r}: {module_name!r} has no callable {name!r}")
    return fn


def _call_with_timeout(fn: Callable, kwargs: dict, timeout: float, name: str):
    """fn(**kwargs), or RewardFunctionError when it raises or has not returned after `timeout` s.
    It runs in a daemon thread: a hung function cannot be stopped, but it no longer holds up the run."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(**kwargs)
        except BaseException as e:  # reported below, in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, name=f"reward function {name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RewardFunctionError(f"reward function {name} did not return within {timeout:g} s "
                                  f"(reward.function_timeout)")
    if "error" in result:
        e = result["error"]
        raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e}") from e
    return result["value"]


@dataclass
class RewardFunctions:
    """The weighted sum of the user's reward functions."""

    specs: list[str]
    weights: list[float]
    timeout: float
    functions: list[Callable]

    @classmethod
    def from_config(cls, specs: list[str], weights: list[float], timeout: float) -> RewardFunctions:
        if weights and len(weights) != len(specs):
            raise ConfigError(f"reward.function_weights: {len(weights)} weights for {len(specs)} reward.functions; "
                              f"expected one per function, or none (each weighs 1)")
        if not all(math.isfinite(w) for w in weights):
            raise ConfigError(f"reward.function_weights: value {weights} must be finite numbers")
        if not timeout > 0:
            raise ConfigError(f"reward.function_timeout: value {timeout} must be > 0 seconds")
        functions = [load_function(spec, f"reward.functions[{i}]") for i, spec in enumerate(specs)]
        for spec, fn in zip(specs, functions):
            try:
                inspect.signature(fn).bind(prompts=[], completions=[])
            except TypeError as e:
                raise ConfigError(f"reward.functions {spec!r}: cannot be called as fn(prompts=..., "
                                  f"completions=...): {e}") from None
            except ValueError:  # a builtin without a signature: found out at the first call
                pass
        return cls(list(specs), list(weights) or [1.0] * len(specs), timeout, functions)

    def score(self, prompts: list[str], completions: list[str]) -> tuple[torch.Tensor, dict[str, tuple[float, int]]]:
        """The weighted sum per completion, and per function the sum and number of its values over the
        completions it applied to (for the log's mean over every rank)."""
        total = torch.zeros(len(completions), dtype=torch.float32)
        applied_to = {}
        for spec, weight, fn in zip(self.specs, self.weights, self.functions):
            values = _call_with_timeout(fn, {"prompts": prompts, "completions": completions}, self.timeout, spec)
            try:
                values = list(values)
            except TypeError:
                raise RewardFunctionError(f"reward function {spec} returned {type(values).__name__}; expected a "
                                          f"list of {len(completions)} numbers (or None)") from None
            if len(values) != len(completions):
                raise RewardFunctionError(f"reward function {spec} returned {len(values)} values for "
                                          f"{len(completions)} completions; expected one per completion")
            bad = next(((i, v) for i, v in enumerate(values) if v is not None and not isinstance(v, numbers.Real)),
                       None)
            if bad is not None:
                raise RewardFunctionError(f"reward function {spec} returned {bad[1]!r} for completion {bad[0]}; "
                                          f"expected a number or None")
            applied = [(i, float(v)) for i, v in enumerate(values) if v is not None]
            for i, v in applied:
                total[i] += weight * v
            applied_to[spec] = (sum(v for _, v in applied), len(applied))
        return total, applied_to
