"""Tensors one at a time: a lazy name -> tensor mapping, and safetensors files read and written
tensor by tensor, so that saving, consolidating or exporting a model never holds all of it.

`LazyTensors` knows every tensor's shape and dtype up front (as a meta tensor) and reads or
computes a tensor only when it is looked up; nothing is cached, so a consumer that takes one
tensor at a time holds one at a time.

`SafetensorsWriter` writes the file `safetensors.torch.save_file` would write for the same
tensors, byte for byte, without having them all: the header (8-byte little-endian length, the
JSON of every tensor's dtype, shape and data offsets, padded with spaces to a multiple of 8) is
computed from the shapes first, then each tensor's bytes go to its offset as it is produced, in
any order. save_file lays the tensors out by dtype (widest first, in safetensors' own order of
dtypes) and then by name; `tests/export/test_streaming.py` checks the bytes against save_file.

`SafetensorsFile` reads a tensor, or a range of a flattened tensor, with plain reads at its
offset: no memory map, whose pages would count in the process' resident memory until closed.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

# safetensors' dtype names, in the order save_file lays tensors out (its Dtype enum, descending).
_DTYPES = [("U64", torch.uint64), ("I64", torch.int64), ("F64", torch.float64), ("F32", torch.float32),
           ("U32", torch.uint32), ("I32", torch.int32), ("BF16", torch.bfloat16), ("F16", torch.float16),
           ("U16", torch.uint16), ("I16", torch.int16), ("F8_E4M3", torch.float8_e4m3fn),
           ("F8_E5M2", torch.float8_e5m2), ("I8", torch.int8), ("U8", torch.uint8), ("BOOL", torch.bool)]
_NAME = {dtype: name for name, dtype in _DTYPES}
_DTYPE = dict(_DTYPES)
_RANK = {dtype: i for i, (_, dtype) in enumerate(_DTYPES)}


def return_freed_memory_to_the_os(threshold: int = 1 << 20) -> bool:
    """Have glibc serve every allocation of `threshold` bytes or more with its own mmap, so that
    freeing it returns it to the OS. By default glibc raises that threshold as large blocks are
    freed (up to 32 MB), and blocks below it stay in the allocating thread's arena once freed: a
    ZeRO-3 rank frees and reallocates block-sized tensors (tens of MB) on the compute and the
    communication threads every step (measured on 4 ranks of a 361.6M model: a resident peak
    1.45x what it holds live; with a fixed 1 MB threshold, 1.1x), and a streamed export frees a
    tensor of another size after each write (its peak crept to several times its largest
    tensor). Called by the trainer and the streamed writers; returns whether it took (False off glibc)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `tensor`'s shape and dtype (no data)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def nbytes(spec: torch.Tensor) -> int:
    return spec.numel() * spec.element_size()


class LazyTensors(Mapping):
    """name -> tensor, each produced by `load(name)` when looked up (never cached); `specs` gives
    every name's shape and dtype up front as a meta tensor, in the mapping's order."""

    def __init__(self, specs: Mapping[str, torch.Tensor], load: Callable[[str], torch.Tensor]):
        self.specs = dict(specs)
        self._load = load

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> LazyTensors:
        """`tensors` as a LazyTensors (itself when it is one already)."""
        if isinstance(tensors, LazyTensors):
            return tensors
        return cls({name: meta_like(t) for name, t in tensors.items()}, tensors.__getitem__)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        return self._load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name) -> bool:
        return name in self.specs

    def spec(self, name: str) -> torch.Tensor:
        return self.specs[name]


# ---------------------------------------------------------------------------------------------- writing


def _dtype_name(dtype: torch.dtype, name: str) -> str:
    if dtype not in _NAME:
        raise ValueError(f"tensor {name!r}: dtype {dtype} is not written by the streamed safetensors writer; "
                         f"supported: {sorted(_NAME.values())}")
    return _NAME[dtype]


def safetensors_layout(specs: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
                       ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(the file's first bytes: length + JSON header, name -> (start, end) of its data after them),
    as safetensors.torch.save_file lays out tensors of these shapes and dtypes."""
    order = sorted(specs, key=lambda name: (_RANK.get(specs[name].dtype, -1), name))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offsets, at = {}, 0
    for name in order:
        spec = specs[name]
        size = nbytes(spec)
        header[name] = {"dtype": _dtype_name(spec.dtype, name), "shape": list(spec.shape),
                        "data_offsets": [at, at + size]}
        offsets[name] = (at, at + size)
        at += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def _raw_bytes(tensor: torch.Tensor):
    """A buffer of the tensor's bytes (no copy for a contiguous CPU tensor)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor: `write(name, tensor)` in any order, then `close()`
    (or use it as a context manager), which fails if a tensor was never written. The result is
    byte-identical to `save_file` of the same tensors and metadata."""

    def __init__(self, path, specs: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None):
        return_freed_memory_to_the_os()  # each tensor's bytes go back to the OS once written
        self.path = Path(path)
        self.specs = dict(specs)
        head, self.offsets = safetensors_layout(self.specs, metadata)
        self.start = len(head)
        self.pending = set(self.specs)
        self.file = open(self.path, "wb")
        self.file.write(head)
        total = self.start + sum(end - start for start, end in self.offsets.values())
        self.file.truncate(total)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None or name not in self.pending:
            raise ValueError(f"{self.path}: tensor {name!r} is not expected here or was written already")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(f"{self.path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the header "
                             f"says {spec.dtype} {tuple(spec.shape)}")
        self.file.seek(self.start + self.offsets[name][0])
        self.file.write(_raw_bytes(tensor))
        self.pending.discard(name)
        del tensor

    def close(self) -> None:
        if self.file.closed:
            return
        self.file.close()
        if self.pending:
            raise ValueError(f"{self.path}: tensors {sorted(self.pending)[:5]} were never written")

    def abort(self) -> None:
        self.file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def save_tensors(tensors: Mapping[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> int:
    """`safetensors.torch.save_file(tensors, path, metadata)`, holding one tensor at a time when
    `tensors` is a LazyTensors (each is read in the file's order); returns the bytes of tensor data."""
    lazy = LazyTensors.of(tensors)
    with SafetensorsWriter(path, lazy.specs, metadata) as writer:
        for name in sorted(writer.offsets, key=lambda n: writer.offsets[n]):
            writer.write(name, lazy[name])
        return sum(end - start for start, end in writer.offsets.values())


# ---------------------------------------------------------------------------------------------- reading


class SafetensorsFile:
    """One safetensors file's header, and its tensors (or ranges of their flattened elements) read
    with plain file reads. Raises ValueError (naming the file) for a file that is not one."""

    def __init__(self, path):
        self.path = Path(path)
        self.handle = open(self.path, "rb")
        try:
            size = os.fstat(self.handle.fileno()).st_size
            head = self.handle.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(self.handle.read(length))
            self.metadata = header.pop("__metadata__", None)
            self.start = 8 + length
            self.entries = {}
            for name, info in header.items():
                if info["dtype"] not in _DTYPE:
                    raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, which is not read here")
                start, end = info["data_offsets"]
                dtype, shape = _DTYPE[info["dtype"]], torch.Size(info["shape"])
                if end - start != shape.numel() * dtype.itemsize or self.start + end > size:
                    raise ValueError(f"tensor {name!r}: data offsets {start}..{end} do not fit its shape "
                                     f"{list(shape)} or the file's {size} bytes")
                self.entries[name] = (dtype, shape, start)
        except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
            self.handle.close()
            raise ValueError(f"{self.path} is not a readable safetensors file (truncated or corrupt?): {e}") from None

    def keys(self) -> list[str]:
        return list(self.entries)

    def spec(self, name: str) -> torch.Tensor:
        dtype, shape, _ = self.entries[name]
        return torch.empty(shape, dtype=dtype, device="meta")

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The tensor, or elements [lo, hi) of it flattened (a 1-D tensor)."""
        dtype, shape, _ = self.entries[name]
        whole = hi is None and lo == 0
        hi = shape.numel() if hi is None else hi
        out = self.read_into(name, lo, torch.empty(hi - lo, dtype=dtype))
        return out.view(shape) if whole else out

    def read_into(self, name: str, lo: int, out: torch.Tensor) -> torch.Tensor:
        """Elements [lo, lo + out.numel()) of the flattened tensor, read straight into `out` (a contiguous
        CPU tensor of the tensor's dtype); returns `out`."""
        dtype, shape, start = self.entries[name]
        if out.dtype != dtype or not out.is_contiguous() or lo < 0 or lo + out.numel() > shape.numel():
            raise ValueError(f"{self.path}: cannot read elements {lo}..{lo + out.numel()} of tensor {name!r} "
                             f"({dtype}, {shape.numel()} elements) into a {out.dtype} tensor")
        if out.numel():
            buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            self.handle.seek(self.start + start + lo * dtype.itemsize)
            if self.handle.readinto(buffer) != len(buffer):
                raise ValueError(f"{self.path}: tensor {name!r} is cut short (truncated file?)")
        return out

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lazy_file(path) -> LazyTensors:
    """Every tensor of a safetensors file, read when looked up (the file stays open meanwhile)."""
    f = SafetensorsFile(path)
    return LazyTensors({name: f.spec(name) for name in f.keys()}, f.read)
