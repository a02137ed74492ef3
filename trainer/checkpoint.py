"""Training checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of ``<out_dir>/checkpoints``::

    step_00000100/
        state.json              step, data position, config, optimizer hyper-parameters,
                                "format": "full" or "zero3-sharded"
        rng_rank00000.json      each rank's RNG state
        model.safetensors, optimizer.safetensors  full (DDP) \  the runtime's tensors (Runtime.save):
        manifest.json, shards_rank*.safetensors  zero3-sharded /  see zeropp/checkpoint.py
    latest                      the name of the newest complete checkpoint

A checkpoint is assembled in a hidden temporary directory and renamed into place only
when every rank has written its part, and ``latest`` is replaced atomically afterwards, so
an interrupted save never leaves a half-written checkpoint under a real name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from data.tokenizer import load_tokenizer
from models.config import ModelConfig
from models.hf import save_hf_checkpoint
from models.lora import apply_lora, merge_lora
from models.transformer import Transformer
from trainer.distributed import barrier
from zeropp.checkpoint import FULL, SHARDED, CheckpointError, consolidated_state_dict, read_safetensors

LATEST = "latest"


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save_checkpoint(ckpt_root: str | Path, step: int, state: dict, optimizer: torch.optim.Optimizer,
                    write_tensors, rank: int = 0) -> Path:
    """Write checkpoint `step` collectively (every rank calls this); returns its directory.

    `write_tensors(directory)` runs on every rank and writes that rank's tensor files.
    """
    root = Path(ckpt_root)
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted save
        tmp.mkdir()
    barrier()
    _write_json(tmp / f"rng_rank{rank:05d}.json", _rng_state())
    write_tensors(tmp)
    if rank == 0:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        _write_json(tmp / "state.json", {**state, "step": step, "optimizer_param_groups": hyper})
    barrier()
    if rank == 0:
        old = root / f".old-{name}"
        if final.exists():  # saving the same step again (e.g. after a resume): swap, then drop
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _replace_file(root / LATEST, name + "\n")
    barrier()
    return final


def resolve_checkpoint(resume: str, out_dir: str | Path) -> Path | None:
    """`resume` is a checkpoint directory, "latest" for the newest one under out_dir, or
    "auto": the newest one if there is one, else None (start fresh; for requeued jobs)."""
    if resume in (LATEST, "auto"):
        pointer = Path(out_dir) / "checkpoints" / LATEST
        if not pointer.is_file():
            if resume == "auto":
                return None
            raise CheckpointError(f"resume=latest: no checkpoint pointer at {pointer}")
        path = pointer.parent / pointer.read_text().strip()
    else:
        path = Path(resume)
        if (path / LATEST).is_file():  # the checkpoints root itself
            path = path / (path / LATEST).read_text().strip()
    if not (path / "state.json").is_file():
        raise CheckpointError(f"resume: {path} is not a checkpoint directory (no state.json)")
    return path


def read_state(path: Path) -> dict:
    """The checkpoint's state.json: check it against the run before loading any tensor."""
    try:
        return json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: state.json cannot be read: {e}") from None


def load_checkpoint(path: Path, optimizer: torch.optim.Optimizer, read_tensors, rank: int = 0) -> dict:
    """Restore tensors (`read_tensors(path)`), optimizer hyper-parameters and this rank's RNG
    from `path`; returns the state.json dict."""
    state = read_state(path)
    read_tensors(path)
    for group, saved in zip(optimizer.param_groups, state["optimizer_param_groups"]):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    rng_file = path / f"rng_rank{rank:05d}.json"
    if not rng_file.is_file():  # resumed on more ranks than were saved
        rng_file = path / "rng_rank00000.json"
    _set_rng_state(json.loads(rng_file.read_text()))
    return state


def consolidated_model(path: Path) -> Transformer:
    """The checkpoint's model, built from its config, with the unsharded fp32 weights; LoRA
    adapters, when the run had them, merged into the base weights (a plain model)."""
    state = read_state(path)
    model = Transformer(ModelConfig(**state["model_config"]))
    lora = state.get("lora")
    if lora:
        apply_lora(model, lora["targets"], lora["r"], lora["alpha"])
    if state.get("format", FULL) == SHARDED:
        weights = consolidated_state_dict(path)
    else:
        weights = read_safetensors(path / "model.safetensors")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in weights:
                raise CheckpointError(f"checkpoint {path} has no tensor {name} for the model it describes")
            param.copy_(weights[name])
    return merge_lora(model) if lora else model


def export_hf(path: Path, out_dir: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Consolidate checkpoint `path` (either format) into a Hugging Face directory, atomically.

    The tokenizer (a SentencePiece .model or an HF tokenizer dir) defaults to the one the
    run recorded in state.json.
    """
    state = read_state(path)
    tokenizer = tokenizer or state.get("tokenizer")
    model = consolidated_model(path)
    with tempfile.TemporaryDirectory() as tok_dir:
        token_ids = None
        if tokenizer:
            tok = load_tokenizer(tokenizer)
            tok.save(tok_dir)
            token_ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        save_hf_checkpoint(model, out_dir, tokenizer_dir=tok_dir if tokenizer else None, token_ids=token_ids)
    return Path(out_dir)
