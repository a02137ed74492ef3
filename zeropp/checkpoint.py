"""The tensors of a runtime's checkpoint: ZeRO-3's shards, or DDP's full tensors.

Inside a checkpoint directory (the trainer makes it atomic: temp dir + rename), format
"zero3-sharded", each rank writes only what it owns::

    manifest.json                 world size, and every unit's layout: its parameters
                                  (name, shape, offset in the flat buffer, trainable)
    shards_rank00003.safetensors  rank 3's part of each unit: "<unit>.master" (fp32 shard),
                                  "<unit>.<state>" for each optimizer state (exp_avg, ...),
                                  shard-long, zero where the shard holds no trainable element;
                                  "references.<unit>" (qwZ deltas): this rank's copy of its node's
                                  weights, and "references.<unit>.current" whether it held the
                                  saved weights; restored on the same world size

Format "full" (DDP): rank 0 writes model.safetensors (parameters and persistent buffers by
module name) and optimizer.safetensors ("<param>.<state>").

Both formats: reducer_rank00003.safetensors, rank 3's gradient reducer state ("<unit or
bucket>.<key>": SEPARATE's error, round, ratio, beta; qgZ's error feedback), with the world size
in its metadata; restored on the same world size, else it starts from zero with a warning.

Loading maps every parameter from the layout it was saved in (its offset in the manifest)
to the loading run's layout, reading just the ranges of the old shard files that overlap
this rank's new shard (`safe_open(...).get_slice`). So a checkpoint loads on another world
size (resharding) and with another alignment (ZeRO-3 <-> qwZ). Consolidation
(`sharded_weights`, `unsharded_tensors`) reads one parameter at a time, each from the ranges
of the rank files that hold it, with plain reads (no memory map): its peak is one parameter.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from models.streaming import LazyTensors, SafetensorsFile, lazy_file
from zeropp.unit import Secondary, Unit

MANIFEST = "manifest.json"
FORMAT = "zeropp-zero3-v1"
FULL, SHARDED = "full", "zero3-sharded"  # state.json "format": DDP's unsharded form, or ZeRO-3's shards
LEGACY_REDUCER = "reducer."  # before reducer_rank files: ZeRO kept this state in its shard file
REFERENCES = "references."


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, or was written for another model; the message says why."""


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """save_file, whose failure to write is an OSError naming the file: safetensors raises its own
    SafetensorError for every I/O error (a full disk: "... No space left on device (os error 28)")."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)|code: (\d+)", str(e))  # or, older: "IoError(Os { code: 28, ..."
        if code is None:
            raise
        number = int(code[1] or code[2])
        raise OSError(number, os.strerror(number), str(path)) from e


def shard_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"shards_rank{rank:05d}.safetensors"


def reducer_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"reducer_rank{rank:05d}.safetensors"


def save_reducer_state(reducer, directory: str | Path, rank: int, world_size: int) -> None:
    """This rank's gradient reducer state (ZeRO's and DDP's alike), when it keeps any."""
    state = {k: v.detach().cpu().contiguous() for k, v in reducer.state_dict().items()}
    if state:
        write_safetensors(state, reducer_file(directory, rank), metadata={"world_size": str(world_size)})


def load_reducer_state(reducer, directory: str | Path, rank: int, world_size: int, device: torch.device) -> None:
    """Restore what save_reducer_state wrote, if it was saved on this world size (the state is per
    rank and cannot be split); otherwise the reducer starts from zero, with a warning."""
    state, saved_world, path = _saved_reducer_state(Path(directory), rank)
    if state is None:
        if reducer.stateful:
            warnings.warn(f"{directory}: no gradient reducer state for rank {rank}; its error feedback and "
                          f"round counters start from zero")
        return
    if saved_world != world_size:
        warnings.warn(f"{path}: the gradient reducer's state was saved on {saved_world} ranks and cannot "
                      f"continue on {world_size}; it starts from zero")
        return
    try:
        reducer.load_state_dict({k: v.to(device) for k, v in state.items()})
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _saved_reducer_state(directory: Path, rank: int):
    """(state, world size it was saved on, file), or (None, None, None). Checkpoints written before
    reducer_rank files kept it in DDP's compressor.rankNNNNN.safetensors or in ZeRO's shard file."""
    for path in (reducer_file(directory, rank), directory / f"compressor.rank{rank:05d}.safetensors"):
        if path.is_file():
            state = read_safetensors(path)  # a clear error for a truncated or corrupt file
            with safe_open(str(path), "pt") as f:
                saved_world = (f.metadata() or {}).get("world_size")
            return state, int(saved_world) if saved_world else None, path
    path = shard_file(directory, rank)
    if (directory / MANIFEST).is_file() and path.is_file():
        with safe_open(str(path), "pt") as f:
            state = {k[len(LEGACY_REDUCER):]: f.get_tensor(k) for k in f.keys() if k.startswith(LEGACY_REDUCER)}
        if state:
            return state, read_manifest(directory)["world_size"], path
    return None, None, None


def unit_layout(unit: Unit) -> dict:
    return {
        "numel": unit.numel,
        "shard_numel": unit.shard_numel,
        "params": [{"name": s.name, "shape": list(s.shape), "offset": s.offset, "trainable": s.trainable,
                    "aliases": s.alias_names} for s in unit.slots],
    }


def _piece_states(unit: Unit, optimizer):
    """(start offset in the shard, piece, optimizer state dict) for each of the unit's pieces."""
    for _, piece, _ in unit.params:
        if piece.numel():
            offset = (piece.data_ptr() - unit.master.data_ptr()) // unit.master.element_size()
            yield offset, piece, optimizer.state.get(piece, {})


def save_shards(engine, directory: str | Path, optimizer) -> None:
    """Write this rank's shards (every rank calls it); rank 0 also writes the manifest.

    Every trainable unit gets every optimizer state in every file, zero where this rank's
    shard has no trainable element, so any range of any unit can be read back.
    """
    directory = Path(directory)
    scalars = {}  # e.g. AdamW's step count: the same for every piece
    shaped = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            (scalars if value.dim() == 0 else shaped).setdefault(key, value)
    tensors = {}
    for name, unit in engine.units.items():
        if unit.delta_codec is not None and unit.secondary_state is not Secondary.EMPTY:
            tensors[REFERENCES + name] = unit.secondary.detach().cpu().clone()
            tensors[f"{REFERENCES}{name}.current"] = torch.tensor(unit.references_current())
        tensors[f"{name}.master"] = unit.master_shard().detach().cpu()
        if not unit.trainable:
            continue
        for key, value in scalars.items():
            tensors[f"{name}.{key}"] = value.detach().cpu().clone()
        for key, value in shaped.items():
            tensors[f"{name}.{key}"] = torch.zeros(unit.shard_numel, dtype=value.dtype)
        for start, piece, state in _piece_states(unit, optimizer):
            for key, value in state.items():
                if value.dim() == 0:
                    tensors[f"{name}.{key}"] = value.detach().cpu().clone()
                else:
                    tensors[f"{name}.{key}"][start:start + piece.numel()] = value.detach().cpu()
    write_safetensors(tensors, shard_file(directory, engine.mesh.rank))
    save_reducer_state(engine.reducer, directory, engine.mesh.rank, engine.mesh.world_size)
    if engine.mesh.rank == 0:
        manifest = {"format": FORMAT, "world_size": engine.mesh.world_size,
                    "units": {name: unit_layout(u) for name, u in engine.units.items()}}
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def check_manifest(manifest: dict, units: dict[str, Unit], where: Path) -> None:
    """Raise if the checkpoint's units or their parameters differ from the model's."""
    saved, ours = set(manifest["units"]), set(units)
    if saved != ours:
        raise CheckpointError(
            f"{where}: the checkpoint's units {sorted(saved - ours)[:4]} are not in the model and the model's "
            f"{sorted(ours - saved)[:4]} are not in the checkpoint: it was written for another model")
    for name, unit in units.items():
        # Offsets may differ (alignment, or the order of checkpoints written before units were laid
        # out in model order): everything else about a parameter must match.
        key = lambda p: {k: v for k, v in p.items() if k not in ("offset", "decay")}  # noqa: E731
        want = sorted((key(p) for p in unit_layout(unit)["params"]), key=lambda p: p["name"])
        have = sorted((key(p) for p in manifest["units"][name]["params"]), key=lambda p: p["name"])
        for a, b in zip(want, have):
            if a != b:
                diff = ", ".join(f"{k}: checkpoint {b.get(k)!r}, model {a[k]!r}" for k in a if a[k] != b.get(k))
                raise CheckpointError(
                    f"{where} was written for another model: unit {name}, parameter {a['name']}: {diff}")
        if len(want) != len(have):
            raise CheckpointError(
                f"{where} was written for another model: unit {name} has {len(have)} parameters in the "
                f"checkpoint, {len(want)} in the model")


class _ShardReader:
    """Reads ranges of a unit's flat tensors across the old ranks' shard files."""

    def __init__(self, directory: Path, manifest: dict):
        self.directory, self.manifest = directory, manifest
        self.files = {}

    def _open(self, path: Path):
        return safe_open(str(path), framework="pt")

    def file(self, rank: int):
        if rank not in self.files:
            path = shard_file(self.directory, rank)
            if not path.is_file():
                raise CheckpointError(f"checkpoint shard missing: {path}")
            try:
                self.files[rank] = self._open(path)
            except (SafetensorError, ValueError, OSError) as e:
                raise CheckpointError(f"checkpoint shard {path} cannot be read (truncated?): {e}") from None
        return self.files[rank]

    def states(self, unit: str) -> dict[str, bool]:
        """The unit's optimizer-state keys (rank 0's file names them all) -> is it a scalar."""
        f = self.file(0)
        keys = [k for k in f.keys() if k.startswith(unit + ".")]
        # state names have no dots: "blocks.1.exp_avg" is unit blocks.1's, "blocks.1.frozen.master" is not
        return {k[len(unit) + 1:]: len(f.get_slice(k).get_shape()) == 0
                for k in keys if "." not in k[len(unit) + 1:] and k != f"{unit}.master"}

    def scalar(self, unit: str, key: str) -> torch.Tensor:
        # A fresh tensor per call: safetensors may hand out views of one memory map, and the
        # optimizer updates each piece's step count in place.
        return self.file(0).get_tensor(f"{unit}.{key}").clone()

    def read(self, unit: str, key: str, lo: int, hi: int, dtype=torch.float32) -> torch.Tensor:
        """Elements [lo, hi) of the unit's flat `key` tensor; beyond the saved padding: zeros."""
        old = self.manifest["units"][unit]["shard_numel"]
        out = torch.zeros(hi - lo, dtype=dtype)
        first, last = lo // old, min((hi - 1) // old, self.manifest["world_size"] - 1)
        for rank in range(first, last + 1):
            a, b = max(lo, rank * old), min(hi, (rank + 1) * old)
            if b > a:
                self._read_range(rank, f"{unit}.{key}", a - rank * old, out[a - lo:b - lo])
        return out

    def _read_range(self, rank: int, name: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + len(out)) of rank's tensor `name` into `out`."""
        out[:] = self.file(rank).get_slice(name)[start:start + out.numel()]


def load_shards(engine, directory: str | Path, optimizer) -> None:
    """Restore master weights, optimizer states and (on the same world size) the reducer's state,
    resharding weights and optimizer states when the world size differs."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_manifest(manifest, engine.units, directory)
    reader = _ShardReader(directory, manifest)
    for name, unit in engine.units.items():
        saved_offset = {p["name"]: p["offset"] for p in manifest["units"][name]["params"]}
        unit.load_master_shard(_read_shard(reader, unit, saved_offset, "master", unit.slots))
        states = reader.states(name)
        trainable = [s for s in unit.slots if s.trainable]
        full = {key: _read_shard(reader, unit, saved_offset, key, trainable)
                for key, scalar in states.items() if not scalar}
        for start, piece, _ in _piece_states(unit, optimizer):
            state = {key: reader.scalar(name, key) if scalar else full[key][start:start + piece.numel()].clone()
                     for key, scalar in sorted(states.items())}
            if state:
                optimizer.state[piece] = {k: v.to(piece.device) for k, v in state.items()}
    same_layout = manifest["world_size"] == engine.mesh.world_size
    mine = reader.file(engine.mesh.rank) if same_layout else None
    for name, unit in engine.units.items():
        if unit.delta_codec is not None:  # without saved references the weights go out whole once
            key = REFERENCES + name
            saved = same_layout and key in mine.keys()
            unit.load_references(mine.get_tensor(key).to(engine.device) if saved else None,
                                 saved and bool(mine.get_tensor(key + ".current")))
    load_reducer_state(engine.reducer, directory, engine.mesh.rank, engine.mesh.world_size, engine.device)


def _read_shard(reader: _ShardReader, unit: Unit, saved_offset: dict[str, int], key: str, slots) -> torch.Tensor:
    """The unit's `key` over this rank's shard in this run's layout, each parameter read from
    where the checkpoint's layout put it."""
    lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
    out = torch.zeros(unit.shard_numel)
    for slot in slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if b > a:
            shift = saved_offset[slot.name] - slot.offset
            out[a - lo:b - lo] = reader.read(unit.name, key, shift + a, shift + b)
    return out


class _StreamedShardReader(_ShardReader):
    """A _ShardReader whose files are read with plain reads (models.streaming.SafetensorsFile): no
    memory map, so what consolidation has read does not stay in the process' resident memory."""

    def _open(self, path: Path):
        return _SliceableFile(path)

    def _read_range(self, rank: int, name: str, start: int, out: torch.Tensor) -> None:
        """Straight into `out` when the dtypes agree (no second copy)."""
        f = self.file(rank)
        if name not in f.entries:
            raise CheckpointError(f"{f.path}: no tensor {name}")
        if f.entries[name][0] == out.dtype:
            f.read_into(name, start, out)
        else:
            out[:] = f.read(name, start, start + out.numel())


class _SliceableFile(SafetensorsFile):
    """The part of safe_open's interface that _ShardReader uses: keys, get_slice(key)[a:b], get_tensor."""

    def get_slice(self, name: str):
        file = self

        class _Slice:
            def get_shape(self):
                return list(file.entries[name][1])

            def __getitem__(self, index: slice):
                start, stop, _ = index.indices(file.entries[name][1].numel())
                return file.read(name, start, stop)
        return _Slice()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.read(name)


def _param_numel(p: dict) -> int:
    return int(torch.Size(p["shape"]).numel())


def sharded_weights(directory: str | Path) -> LazyTensors:
    """Every parameter of a sharded checkpoint, unsharded in fp32, under all its names, read when
    looked up: only the ranges of each rank's file that hold that parameter; needs no process group.
    Looking up one parameter holds one parameter."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    reader = _StreamedShardReader(directory, manifest)
    specs, where = {}, {}
    for name, layout in manifest["units"].items():
        for p in layout["params"]:
            for alias in p["aliases"]:
                specs[alias] = torch.empty(p["shape"], device="meta")
                where[alias] = (name, p["offset"], _param_numel(p), p["shape"])

    def load(alias: str) -> torch.Tensor:
        unit, offset, numel, shape = where[alias]
        return reader.read(unit, "master", offset, offset + numel).view(shape)
    return LazyTensors(specs, load)


def consolidated_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded in fp32, under all its names (one tensor per parameter), all in
    memory; needs no process group. `sharded_weights` gives the same one parameter at a time."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    reader = _StreamedShardReader(directory, manifest)
    out = {}
    for name, layout in manifest["units"].items():
        for p in layout["params"]:
            tensor = reader.read(name, "master", p["offset"], p["offset"] + _param_numel(p)).view(p["shape"])
            for alias in p["aliases"]:
                out[alias] = tensor
    return out


def unsharded_tensors(directory: str | Path) -> LazyTensors:
    """Every parameter (under its first name) and its optimizer states ("<param>.<state>"),
    unsharded, as the full format names them, each read when looked up (one at a time: a caller
    that iterates holds one tensor at a time); needs no process group."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    reader = _StreamedShardReader(directory, manifest)
    specs, where = {}, {}
    for name, layout in manifest["units"].items():
        states = reader.states(name)
        for p in layout["params"]:
            for key in [None] + [key for key, scalar in states.items() if not scalar]:
                if key is not None and not p["trainable"]:
                    continue
                full = p["name"] if key is None else f"{p['name']}.{key}"
                specs[full] = torch.empty(p["shape"], device="meta")
                where[full] = (name, key or "master", p["offset"], _param_numel(p), p["shape"])
            if p["trainable"]:
                for key, scalar in states.items():
                    if scalar:
                        full = f"{p['name']}.{key}"
                        specs[full] = torch.empty((), dtype=reader.file(0).entries[f"{name}.{key}"][0],
                                                  device="meta")
                        where[full] = (name, key, None, None, None)

    def load(full: str) -> torch.Tensor:
        unit, key, offset, numel, shape = where[full]
        if offset is None:
            return reader.scalar(unit, key)
        return reader.read(unit, key, offset, offset + numel).view(shape)
    return LazyTensors(specs, load)


def load_unsharded(engine, tensors: dict[str, torch.Tensor], optimizer) -> None:
    """Set the engine's shards and their optimizer states from unsharded tensors named as
    `unsharded_tensors` names them (e.g. re-sliced for another tensor-parallel layout)."""
    for unit in engine.units.values():
        lo, hi = unit.shard_start, unit.shard_start + unit.shard_numel
        flats: dict[str, torch.Tensor] = {}
        scalars: dict[str, torch.Tensor] = {}
        for slot in unit.slots:
            for key, tensor in tensors.items():
                if key != slot.name and not key.startswith(slot.name + "."):
                    continue
                suffix = key[len(slot.name):]
                if "." in suffix[1:]:  # another parameter whose name starts with this one's
                    continue
                if suffix and tensor.dim() == 0:
                    scalars[suffix[1:]] = tensor
                    continue
                flat = flats.setdefault(suffix, torch.zeros(unit.padded_numel))
                flat[slot.offset:slot.offset + slot.numel] = tensor.reshape(-1)
        if "" not in flats:
            raise CheckpointError(f"unit {unit.name}: no weights among the tensors to load")
        unit.load_master_shard(flats[""][lo:hi])
        if unit.delta_codec is not None:
            unit.load_references(None, False)
        for start, piece, _ in _piece_states(unit, optimizer):
            state = {k[1:]: flat[lo:hi][start:start + piece.numel()].clone() for k, flat in flats.items() if k}
            state.update({k: v.clone() for k, v in scalars.items()})
            if state:
                optimizer.state[piece] = {k: v.to(piece.device) for k, v in state.items()}


# ---------------------------------------------------------------------------- the full format (DDP)

def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (each shared one once, under its first name) and persistent buffers."""
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    persistent = {name for name, _ in model.state_dict(keep_vars=True).items()}
    tensors.update({name: b.detach() for name, b in model.named_buffers() if name in persistent})
    return {name: t.contiguous().cpu() for name, t in tensors.items()}


def save_full(directory: Path, model: torch.nn.Module, optimizer, rank: int) -> None:
    """Rank 0 writes the model and the optimizer state, unsharded."""
    if rank != 0:
        return
    names = {p: name for name, p in model.named_parameters()}
    states = {f"{names[p]}.{key}": value.detach().contiguous().cpu()
              for p, state in optimizer.state.items() for key, value in state.items()}
    write_safetensors(model_tensors(model), Path(directory) / "model.safetensors")
    write_safetensors(states, Path(directory) / "optimizer.safetensors")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupt?): {e}") from None


def full_weights(directory: str | Path, name: str = "model.safetensors") -> LazyTensors:
    """The full format's weights (or another of its files), each tensor read when looked up."""
    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        tensors = lazy_file(path)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupt?): {e}") from None

    def load(key: str) -> torch.Tensor:
        try:
            return tensors[key]
        except (ValueError, OSError) as e:
            raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupt?): {e}") from None
    return LazyTensors(tensors.specs, load)


def load_full(directory: Path, model: torch.nn.Module, optimizer) -> None:
    """Load the unsharded form into the model and its optimizer."""
    path = Path(directory)
    weights = read_safetensors(path / "model.safetensors")
    states = read_safetensors(path / "optimizer.safetensors")
    load_full_tensors(model, optimizer, weights, states, where=path)


def load_full_tensors(model: torch.nn.Module, optimizer, weights: dict[str, torch.Tensor],
                      states: dict[str, torch.Tensor], where: Path | str = "tensors") -> None:
    """Parameters and buffers by name, optimizer states as "<param>.<state>", into the model."""
    expected = model_tensors(model)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the weights do not match the model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, tensor in weights.items():
            target = params.get(name, buffers.get(name))
            if target.shape != tensor.shape:
                raise CheckpointError(
                    f"{where}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)

    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in states.items():
        name, state_key = key.rsplit(".", 1)
        if name not in params:
            raise CheckpointError(f"{where}: optimizer state {key} names no parameter of the model")
        by_param.setdefault(name, {})[state_key] = tensor
    for name, entries in by_param.items():
        optimizer.state[params[name]] = {k: v.to(params[name].device) for k, v in entries.items()}


def unshard(engine, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors from per-parameter local pieces shaped like the registered parameters (the
    parameters themselves, an EMA of them, ...), by their names in `model.named_parameters()`;
    every rank calls it with the same names and gets them all."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {}
    for u in engine.units.values():
        mine = {names[id(p)]: slot for slot, p, _ in u.params if names[id(p)] in tensors}
        if not mine:
            continue
        shard = torch.zeros(u.shard_numel, dtype=torch.float32, device=engine.device)
        lo = u.shard_start
        for name, slot in mine.items():
            a = max(lo, slot.offset)
            piece = tensors[name].reshape(-1)
            shard[a - lo:a - lo + piece.numel()] = piece
        full = torch.empty(u.padded_numel, dtype=torch.float32, device=engine.device)
        engine.comm.all_gather(full, shard, tag="consolidate")
        for name, slot in mine.items():
            out[name] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
    return out


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Every parameter of the model, full, on every rank (one unit gathered at a time)."""
    out = {}
    for u in engine.units.values():
        full = torch.empty(u.padded_numel, dtype=torch.float32, device=engine.device)
        engine.comm.all_gather(full, u.master_shard(), tag="consolidate")
        for slot in u.slots:
            tensor = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            for name in slot.alias_names:
                out[name] = tensor
    return out
