"""Where the weights of a model built on the meta device come from.

A model too big for one rank is built on the meta device (shapes only, no storage); a
sharded runtime then asks a weight source for just the slices this rank keeps
(`read(name, start, end)`: elements [start, end) of the flattened parameter), and a
replicated one materializes the model from it, one parameter at a time. Three sources:
`InitWeights` (a fresh model: `Transformer.init_parameter`), `StateDictWeights` (tensors in
memory, e.g. a runtime's gathered weights) and `models.hf.HFCheckpointWeights` (a Hugging Face
checkpoint read slice by slice). Parameters that are not on the meta device
(e.g. LoRA adapters made in memory) are their own source.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn as nn


class WeightSource(Protocol):
    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of parameter `name` flattened, 1-D, in the source's dtype."""


class InitWeights:
    """A fresh model's initial weights, by `model.init_parameter(name, out)`: each parameter is drawn
    whole on the CPU (its values depend on the seed and its name only) and sliced."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.shapes = {name: p.shape for name, p in model.named_parameters()}

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        values = torch.empty(self.shapes[name], dtype=torch.float32)
        self.model.init_parameter(name, values)
        return values.reshape(-1)[start:end]


class StateDictWeights:
    """Weights already in memory by parameter name (a state dict; a tied weight under any of its names):
    a copy of a model built from them pays no initialization it then overwrites."""

    def __init__(self, state: dict[str, torch.Tensor], what: str):
        self.state, self.what = state, what

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"{self.what} has no weight {name!r} (it has {len(self.state)}, e.g. "
                           f"{sorted(self.state)[:4]})")
        return self.state[name].reshape(-1)[start:end]


def parameter_aliases(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(parameter) -> every (module, attribute, qualified name) holding it, the first name first."""
    aliases: dict[int, list] = {}
    for module_name, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is not None:
                aliases.setdefault(id(p), []).append((module, attr, f"{module_name}.{attr}" if module_name else attr))
    return aliases


@torch.no_grad()
def materialize(model: nn.Module, source: WeightSource, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, only: Callable[[str], bool] | None = None) -> nn.Module:
    """Give every meta parameter of `model` (whose name `only` accepts, by default all) real storage
    on `device`, filled from `source` one parameter at a time (peak: the model plus one parameter in
    the source's dtype); shared parameters (a tied LM head) stay shared. Returns `model`."""
    for entries in parameter_aliases(model).values():
        module, attr, name = entries[0]
        p = module._parameters[attr]
        if not p.is_meta or (only is not None and not only(name)):
            continue
        values = source.read(name, 0, p.numel())
        new = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=p.requires_grad)
        new.copy_(values.view(p.shape))
        for module, attr, _ in entries:
            module._parameters[attr] = new
    meta = [name for name, b in model.named_buffers() if b.is_meta and (only is None or only(name))]
    if meta:
        raise ValueError(f"materialize: buffers {meta[:5]} are on the meta device and no source gives buffers")
    return model
