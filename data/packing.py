"""Sequence packing (data.packing): several whole documents per row, instead of one padded row each.

A packed row holds documents side by side; `document_ids` tells the model where each starts and
ends, and it restarts the positions and confines attention to each document
(models.transformer.packed_mask), so every document's logits are those it has alone in a padded
row. Rows are filled first-fit in the documents' order and padded to the fullest row (padding
slots get document id -1 and are never targets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    places: list[tuple[int, int]]  # (row, first slot) of each document
    lengths: list[int]
    shape: tuple[int, int]  # rows, slots

    def scatter(self, values: list[torch.Tensor], fill) -> torch.Tensor:
        """The documents' per-token `values` laid out in the rows, `fill` elsewhere."""
        out = torch.full(self.shape, fill, dtype=values[0].dtype)
        for (row, start), value in zip(self.places, values):
            out[row, start:start + len(value)] = value
        return out

    def document_ids(self) -> torch.Tensor:
        """[rows, slots]: document i's slots hold i, padding -1."""
        return self.scatter([torch.full((n,), i) for i, n in enumerate(self.lengths)], -1)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of every document token, document after document: `x[rows.slots()]` takes
        them out of a per-slot tensor `x` [rows, slots, ...] in that order."""
        row = torch.cat([torch.full((n,), r) for (r, _), n in zip(self.places, self.lengths)])
        column = torch.cat([torch.arange(start, start + n) for (_, start), n in zip(self.places, self.lengths)])
        return row, column


def pack(lengths: list[int], capacity: int) -> PackedRows:
    """Place documents of `lengths` (each <= capacity: the caller truncates as its padded path does)
    into rows of `capacity` slots, each in the first row with room left."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"pack: a document of {max(lengths)} tokens does not fit a row of {capacity}")
    used: list[int] = []
    places = []
    for n in lengths:
        row = next((r for r, u in enumerate(used) if u + n <= capacity), len(used))
        if row == len(used):
            used.append(0)
        places.append((row, used[row]))
        used[row] += n
    return PackedRows(places, list(lengths), (len(used), max(used, default=0)))
