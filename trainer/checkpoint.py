"""Training checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of ``<out_dir>/checkpoints``::

    step_00000100/
        state.json              step, data position, config, optimizer hyper-parameters,
                                "format": "full" or "zero3-sharded"
        rng_rank00000.json      each rank's RNG state
        model.safetensors, optimizer.safetensors  full (DDP) \  the runtime's tensors (Runtime.save):
        manifest.json, shards_rank*.safetensors  zero3-sharded /  see zeropp/checkpoint.py
        checksums.json          every other file's size and SHA-256, and the save's id (also in state.json)
    latest                      the name of the newest complete checkpoint

A checkpoint is assembled in a hidden temporary directory (`.tmp-step_N`), every file
fsynced, and renamed into place only when every rank has written its part; ``latest`` is
replaced atomically afterwards, and each rename is made durable by fsyncing the directory.
So an interrupted save never leaves a half-written checkpoint under a real name, and a
power loss never leaves ``latest`` durable before its data. Loading verifies every file
against checksums.json (safetensors has no checksum of its own): a flipped bit, a truncated
file, or a manifest or shard from another checkpoint is an error naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from data.tokenizer import load_tokenizer
from kernels import on_grid
from models.config import ModelConfig
from models.hf import save_hf_checkpoint
from models.lora import LoRALinear, apply_lora
from models.streaming import LazyTensors, meta_like
from models.transformer import Transformer
from trainer.distributed import all_gather_objects, barrier
from zeropp.checkpoint import FULL, SHARDED, CheckpointError, full_weights, sharded_weights
from zeropp.diloco import site_dir
from zeropp.tensor_parallel.runtime import PLAN_FILE

LATEST = "latest"
CHECKSUMS = "checksums.json"
_RANK_TAG = re.compile(r"_rank(\d{5})\.")


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written pointer behind
        raise


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a file's fsync does not cover its name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(path: Path) -> dict:
    """fsync a file written in this process and return its size and SHA-256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _owner(name: str) -> int:
    """The rank that writes a checkpoint file: the one in its name (shards_rank00003...), else rank 0."""
    m = _RANK_TAG.search(name)
    return int(m.group(1)) if m else 0


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def is_complete(path: Path) -> bool:
    """Whether `path` is a checkpoint whose save finished (state.json and checksums.json exist)."""
    return (path / "state.json").is_file() and (path / CHECKSUMS).is_file()


def recover(root: str | Path) -> list[str]:
    """Undo what an interrupted save left in a checkpoints root (rank 0, before resolving or saving).

    `.old-step_N` is the complete copy a save of an existing step moved aside: put back where
    step_N is missing, else dropped. `.tmp-step_N` directories are partial saves: removed, so
    they stop holding disk space. Returns what was done, one line each.
    """
    root = Path(root)
    done = []
    if not root.is_dir():
        return done
    for old in sorted(root.glob(".old-step_*")):
        final = root / old.name[len(".old-"):]
        if not final.exists():
            os.replace(old, final)
            _fsync_dir(root)
            done.append(f"restored {final.name} from {old.name} (a save replacing it was interrupted)")
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in sorted(root.glob(".tmp-step_*")):
        shutil.rmtree(tmp, ignore_errors=True)
        done.append(f"removed {tmp.name}, left by an interrupted save")
    return done


def save_checkpoint(ckpt_root: str | Path, step: int, state: dict, optimizer: torch.optim.Optimizer,
                    write_tensors, rank: int = 0) -> Path:
    """Write checkpoint `step` collectively (every rank calls this); returns its directory.

    `write_tensors(directory)` runs on every rank and writes that rank's tensor files (a file
    whose name holds `_rankNNNNN.` is that rank's, any other rank 0's). Each rank fsyncs and
    hashes its files; rank 0 records every file's SHA-256 in checksums.json, then renames the
    directory into place and moves `latest`, each step fsynced, so `latest` never names a
    checkpoint that is missing, partial, or not yet durable.
    """
    root = Path(ckpt_root)
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        recover(root)
        tmp.mkdir()
    barrier()
    ident = uuid.uuid4().hex  # rank 0's ties state.json and checksums.json together
    try:
        _write_json(tmp / f"rng_rank{rank:05d}.json", _rng_state())
        write_tensors(tmp)
        if rank == 0:
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            full = {**state, "step": step, "checkpoint_id": ident, "optimizer_param_groups": hyper}
            _write_json(tmp / "state.json", full)
        barrier()
        mine = {f: _seal(tmp / f) for f in _files(tmp) if _owner(Path(f).name) == rank and f != "state.json"}
        sums = {f: v for part in all_gather_objects(mine) for f, v in part.items()}
        if rank == 0:
            _write_json(tmp / CHECKSUMS, {"checkpoint_id": ident, "step": step, "files": sums,
                                          "state_sha256": state_digest(json.loads((tmp / "state.json").read_text()))})
            for directory in {(tmp / f).parent for f in sums} | {tmp}:
                _fsync_dir(directory)
            _install(root, tmp, final)
            _replace_file(root / LATEST, name + "\n")
            _fsync_dir(root)
    except BaseException as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save must not keep holding the disk
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            latest = root / LATEST
            kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no checkpoint yet"
            raise DiskFullError(f"the disk is full: checkpoint {final} not saved ({e.strerror} writing "
                                f"{e.filename or tmp}); its partial files were removed, {kept}") from e
        raise
    barrier()
    return final


class DiskFullError(OSError):
    """A save that ran out of disk (ENOSPC), said in one line naming the checkpoint it did not write."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def _install(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`. Where `final` exists (a step saved again) it is moved
    to .old-<name> first: a kill in between leaves it there, and recover() puts it back."""
    old = root / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def newest_complete(root: Path) -> Path | None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))
    return steps[-1] if steps else None


def _from_root(root: Path, resume: str, say) -> Path | None:
    """The checkpoint `latest` names under `root`, or, where it names none that is complete, the
    newest complete one (and `say` why); None when there is none and `resume` is "auto"."""
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named and (root / named / "state.json").is_file():
        return root / named
    fallback = newest_complete(root) if root.is_dir() else None
    if fallback is None:
        if named:
            raise CheckpointError(f"resume={resume}: {pointer} names {named!r}, which is missing or incomplete, "
                                  f"and {root} holds no other complete checkpoint")
        if resume == "auto":
            return None
        raise CheckpointError(f"resume={resume}: no checkpoint pointer at {pointer} and no complete checkpoint in {root}")
    why = f"{pointer} names {named!r}, which is missing or incomplete" if named else f"{pointer} is missing"
    say(f"resume: {why}; resuming from the newest complete checkpoint, {fallback}")
    return fallback


def resolve_checkpoint(resume: str, out_dir: str | Path, say=None) -> Path | None:
    """`resume` is a checkpoint directory, a checkpoints root, "latest" for the newest one under
    out_dir, or "auto": the newest one if there is one, else None (start fresh; for requeued
    jobs). Where `latest` names no complete checkpoint (a save was cut short), the newest
    complete one is used and `say` (default: a warning) tells which."""
    say = say or (lambda message: warnings.warn(message, stacklevel=3))
    if resume in (LATEST, "auto"):
        path = _from_root(Path(out_dir) / "checkpoints", resume, say)
        if path is None:
            return None
    else:
        path = Path(resume)
        if (path / LATEST).is_file():  # the checkpoints root itself
            path = _from_root(path, resume, say)
    if not (path / "state.json").is_file():
        raise CheckpointError(f"resume: {path} is not a checkpoint directory (no state.json)")
    return path


# state.json's keys people may edit (a tokenizer moved to another path): left out of its digest.
EDITABLE_STATE_KEYS = ("tokenizer",)


def state_digest(state: dict) -> str:
    """SHA-256 of state.json's values but the editable ones, in a canonical form: a flipped bit
    or an edit of anything else shows, a moved tokenizer does not."""
    kept = {k: v for k, v in state.items() if k not in EDITABLE_STATE_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def _checkpoint_id(path: Path) -> str | None:
    """state.json's checkpoint_id: None for a checkpoint of the format before checksums (a readable
    state.json without one), "" when state.json is missing or unreadable."""
    try:
        return json.loads((path / "state.json").read_text()).get("checkpoint_id")
    except (OSError, ValueError, AttributeError):
        return ""


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> None:
    """Check every file of checkpoint `path` against checksums.json (with world_size > 1 every rank
    calls it, each hashing its share): a modified, truncated, swapped-in or bit-flipped file is an error naming
    it. state.json, the one file meant to be read (and edited: a moved tokenizer) by people, is
    tied to the rest by its checkpoint_id instead. Only a checkpoint written before checksums
    existed (its state.json has no checkpoint_id) loads unverified, with a warning: deleting
    checksums.json does not switch verification off."""
    record_path = path / CHECKSUMS
    errors = []
    if not record_path.is_file():
        ident = _checkpoint_id(path)
        if ident is None:
            if rank == 0:
                warnings.warn(f"checkpoint {path} has no {CHECKSUMS} (written by an older version): its files "
                              f"are not verified")
            return
        errors.append(f"{CHECKSUMS} is missing" + (f" (state.json's checkpoint_id {ident} says it was saved with one)"
                                                   if ident != "" else ""))
        record = {"files": {}}
    else:
        try:
            record = json.loads(record_path.read_text())
            record["files"].items()
        except (OSError, ValueError, KeyError, TypeError) as e:
            errors.append(f"{CHECKSUMS} cannot be read: {e}")
            record = {"files": {}}
    files = record["files"]
    if rank == 0 and not errors:
        ident = _checkpoint_id(path)
        if ident != record.get("checkpoint_id"):
            errors.append(f"state.json has checkpoint_id {ident!r}, {CHECKSUMS} {record.get('checkpoint_id')!r}: "
                          f"the files come from different saves")
        try:
            changed = _state_changed(json.loads((path / "state.json").read_text()), record)
        except (OSError, ValueError) as e:
            changed = f"state.json cannot be read: {e}"
        if changed:
            errors.append(changed)
        strays = [f for f in _files(path) if f not in files and f not in (CHECKSUMS, "state.json")]
        if strays:
            errors.append(f"{strays[:4]} are not part of this checkpoint (not in {CHECKSUMS})")
    for i, (name, want) in enumerate(sorted(files.items())):
        if i % world_size != rank:
            continue
        file = path / name
        if not file.is_file():
            errors.append(f"{name} is missing")
        elif file.stat().st_size != want["bytes"]:
            errors.append(f"{name} has {file.stat().st_size} bytes, {want['bytes']} when saved (truncated or replaced)")
        elif (got := _sha256(file)) != want["sha256"]:
            errors.append(f"{name} has SHA-256 {got[:12]}..., {want['sha256'][:12]}... when saved "
                          f"(modified, corrupted, or from another checkpoint)")
    if world_size > 1:  # called collectively: every rank raises the same error
        errors = list(dict.fromkeys(e for part in all_gather_objects(errors) for e in part))
    if errors:
        raise CheckpointError(f"checkpoint {path} fails verification against its {CHECKSUMS}: " + "; ".join(errors[:6]))


def samples_per_step(state: dict) -> int | None:
    """The samples one step of the checkpoint's run consumed, all ranks together: its recorded
    global batch, else (older checkpoints, rlhf.py's stages) consumed samples / steps."""
    if state.get("global_batch"):
        return state["global_batch"]
    step = state.get("step")
    return state["consumed_samples"] // step if step and state["consumed_samples"] % step == 0 else None


def _state_changed(state: dict, record: dict) -> str | None:
    """What is wrong with state.json against checksums.json's record of it (None: nothing; a
    record without its digest, from before it existed: the checkpoint_id alone ties them)."""
    if "state_sha256" in record and state_digest(state) != record["state_sha256"]:
        return (f"state.json differs from what was saved (corrupted, or edited beyond "
                f"{', '.join(EDITABLE_STATE_KEYS)}, the one key that may be)")
    return None


def read_state(path: Path) -> dict:
    """The checkpoint's state.json, checked against checksums.json's digest of it: the run is
    checked against it before any tensor is loaded (and verified)."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:  # (a flipped bit can make it invalid UTF-8 as well as invalid JSON)
        raise CheckpointError(f"checkpoint {path}: state.json cannot be read: {e}") from None
    try:
        record = json.loads((path / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return state  # verify_checkpoint, before any tensor is read, says what is wrong with it
    changed = _state_changed(state, record) if isinstance(record, dict) else None
    if changed:
        raise CheckpointError(f"checkpoint {path} fails verification against its {CHECKSUMS}: {changed}")
    return state


def load_checkpoint(path: Path, optimizer: torch.optim.Optimizer, read_tensors, rank: int = 0) -> dict:
    """Restore tensors (`read_tensors(path)`), optimizer hyper-parameters and this rank's RNG
    from `path` after verifying its files; returns the state.json dict."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    verify_checkpoint(path, rank, world)
    state = read_state(path)
    read_tensors(path)
    for group, saved in zip(optimizer.param_groups, state["optimizer_param_groups"]):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    rng_file = path / f"rng_rank{rank:05d}.json"
    if not rng_file.is_file():  # resumed on more ranks than were saved
        rng_file = path / "rng_rank00000.json"
    _set_rng_state(json.loads(rng_file.read_text()))
    return state


def trained_grid(state: dict) -> tuple[int, int] | None:
    """(bits, block size) of the qwZ grid a run's forward computed with, from its state.json;
    None for a run without qwZ, or with qwZ deltas (its forward used the bf16 references, no grid)."""
    zero = (state.get("config") or {}).get("zero_optimization") or {}
    if not zero.get("zero_quantized_weights") or zero.get("zero_quantized_weights_delta"):
        return None
    return zero["zero_quantized_weights_bits"], zero["zero_quantization_block_size"]


def _tensor_parallel_tensors(directory: Path, read_slice) -> LazyTensors:
    """The unsliced tensors of a tensor-parallel checkpoint, each read when looked up: its slices
    (`read_slice(subdirectory)`, lazy too) concatenated along the dims the run recorded."""
    plan_path = directory / PLAN_FILE
    if not plan_path.is_file():
        raise FileNotFoundError(f"{directory}: no {PLAN_FILE}; not a tensor-parallel checkpoint")
    meta = json.loads(plan_path.read_text())
    slices = [read_slice(directory / f"tp{t:02d}") for t in range(meta["size"])]
    specs, dims = {}, {}
    for name, spec in slices[0].specs.items():
        dim = meta["dims"].get(name, meta["dims"].get(name.rsplit(".", 1)[0]))
        if dim is not None and spec.dim():
            dims[name] = dim
            shape = list(spec.shape)
            shape[dim] = sum(s.spec(name).shape[dim] for s in slices)
            spec = torch.empty(shape, dtype=spec.dtype, device="meta")
        specs[name] = spec

    def load(name: str) -> torch.Tensor:
        if name in dims:
            return torch.cat([s[name] for s in slices], dim=dims[name])
        return slices[0][name]
    return LazyTensors(specs, load)


def checkpoint_tensors(path: Path, state: dict | None = None) -> LazyTensors:
    """A checkpoint's weights as saved (either format, tensor-parallel or not), by the names of the
    run's model (LoRA: `<layer>.base.weight`, `<layer>.lora_A`, ...), each read when looked up.
    DiLoCo's: site 0's replica (every site's at a sync step without fragments; zeropp.diloco)."""
    state = read_state(path) if state is None else state
    if state.get("diloco"):
        path = site_dir(path, 0)
    dp_format, tensor_parallel, _ = state.get("format", FULL).partition("+tp")
    read = sharded_weights if dp_format == SHARDED else full_weights
    return _tensor_parallel_tensors(path, read) if tensor_parallel else read(path)


def checkpoint_weights(path: str | Path, as_trained: bool = False) -> tuple[ModelConfig, LazyTensors]:
    """The checkpoint's model config, and its unsharded fp32 weights by the plain model's parameter
    names (`Transformer(config).named_parameters()`, a tied head once), each read from the
    checkpoint when looked up: one parameter at a time (a LoRA layer's merged weight reads its base
    weight and its two adapters). Every file is verified first, and every name and shape checked.

    LoRA adapters, when the run had them, are merged into the base weights (W + B @ A * alpha / r in
    fp32, as models.lora.merge_lora computes it). as_trained: for a qwZ run, each weight on the grid
    its forward computed with (dequant(quant(W)), what its losses were measured on) instead of the fp32
    master copy; frozen weights stored quantized (zero_quantized_nontrainable_weights) are on it already.
    """
    path = Path(path)
    verify_checkpoint(path)
    state = read_state(path)
    config = ModelConfig(**state["model_config"])
    lora = state.get("lora")
    with torch.device("meta"), torch.random.fork_rng(devices=[]):  # shapes only: no draw
        model = Transformer(config)
    if lora:
        apply_lora(model, lora["targets"], lora["r"], lora["alpha"])
    raw = checkpoint_tensors(path, state)
    for name, param in model.named_parameters():
        if name not in raw:
            raise CheckpointError(f"checkpoint {path} has no tensor {name} for the model it describes")
        if raw.spec(name).shape != param.shape:
            raise CheckpointError(f"checkpoint {path}: tensor {name} has shape {tuple(raw.spec(name).shape)}, the "
                                  f"model it describes {tuple(param.shape)}")
    grid = trained_grid(state) if as_trained else None
    frozen = set()
    if grid is not None:
        if state["config"]["zero_optimization"].get("zero_quantized_nontrainable_weights"):
            frozen = {name for name, p in model.named_parameters() if not p.requires_grad}

    def fetch(name: str) -> torch.Tensor:
        tensor = raw[name].to(torch.float32)
        return tensor if grid is None or name in frozen else on_grid(tensor, *grid)

    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}

    def load(name: str) -> torch.Tensor:
        layer, _, leaf = name.rpartition(".")
        adapter = adapters.get(layer)
        if adapter is None:
            return fetch(name)
        base = fetch(f"{layer}.base.{leaf}")
        if leaf != "weight":
            return base
        delta = (fetch(f"{layer}.lora_B").float() @ fetch(f"{layer}.lora_A").float()) * adapter.scaling
        return base.float() + delta  # merge_lora's W + delta_weight()
    specs = {}  # the merged model's parameters, in its order: a LoRA layer's base weight in the layer's place
    for name, param in model.named_parameters():
        layer, _, leaf = name.rpartition(".")
        if layer in adapters:
            continue  # lora_A / lora_B
        if layer.endswith(".base") and layer[:-len(".base")] in adapters:
            name = f"{layer[:-len('.base')]}.{leaf}"
        specs[name] = meta_like(param)
    return config, LazyTensors(specs, load)


def consolidated_model(path: str | Path, as_trained: bool = False) -> Transformer:
    """The checkpoint's model, built from its config, with the unsharded fp32 weights (read one
    parameter at a time: `checkpoint_weights`); LoRA adapters, when the run had them, merged into
    the base weights (a plain model, its parameters frozen as the fine-tune left them).

    as_trained: for a qwZ run, each weight is put on the grid its forward computed with
    (dequant(quant(W)), what its losses were measured on) instead of the fp32 master copy.
    """
    path = Path(path)
    config, weights = checkpoint_weights(path, as_trained=as_trained)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    if read_state(path).get("lora"):
        model.requires_grad_(False)
    return model


def export_hf(path: str | Path, out_dir: str | Path, tokenizer: str | Path | None = None,
              as_trained: bool = False, max_shard_size: int | None = None) -> Path:
    """Consolidate checkpoint `path` (either format) into a Hugging Face directory, atomically,
    tensor by tensor: each weight is read from the checkpoint (its ranges of every rank's shard
    file), converted and written before the next one, so the peak is one tensor, not the model.

    as_trained: a qwZ run's weights on the grid it computed with (what train.py's export and
    scripts/consolidate.py write, see `export_note`), not the fp32 master copy. The tokenizer (a
    SentencePiece .model or an HF tokenizer dir) defaults to the one the run recorded in state.json.
    max_shard_size (bytes): split the weights into shards with an index file.
    """
    path = Path(path)
    state = read_state(path)
    tokenizer = tokenizer or state.get("tokenizer")
    config, weights = checkpoint_weights(path, as_trained=as_trained)
    with tempfile.TemporaryDirectory() as tok_dir:
        token_ids = None
        if tokenizer:
            tok = load_tokenizer(tokenizer)
            tok.save(tok_dir)
            token_ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        save_hf_checkpoint(weights, out_dir, max_shard_size, tokenizer_dir=tok_dir if tokenizer else None,
                           token_ids=token_ids, config=config)
    return Path(out_dir)


def export_note(path: Path, master_weights: bool = False) -> str | None:
    """What an export of a qwZ run holds, said loudly: the two choices give different models."""
    grid = trained_grid(read_state(path))
    if grid is None:
        return None
    if master_weights:
        return (f"note: exported the fp32 master weights; this run trained and evaluated with qwZ int{grid[0]} "
                f"weights (block size {grid[1]}), so the export's losses differ from the run's")
    return (f"note: exported the weights this run computed with: its qwZ int{grid[0]} grid (block size {grid[1]}), "
            f"dequantized to fp32, so the export reproduces the run's losses; the fp32 master weights it "
            f"optimized differ (scripts/consolidate.py --master-weights exports those)")
