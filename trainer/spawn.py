"""The one helper that runs a function on several gloo ranks in fresh processes (tests and benchmarks).

    results = run_ranks(fn, world_size=4, ranks_per_node=2, args=(...))

`fn(rank, world_size, *args)` must be a module-level function (it is pickled by name into
the rank processes). Each rank gets one thread, the launcher variables torchrun would set
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), and an initialized gloo process group.
The return values come back in rank order; an exception in any rank fails the test with
that rank's traceback, and a hung rank fails it after `timeout` seconds.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp
from multiprocessing import reduction


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ranks are forked from one server process that has imported these once (multiprocessing's
# forkserver), instead of each importing torch afresh (~2.5 s of CPU per rank, most of the test
# suite's time on 2 cores). torch._dynamo is among them: torch imports it lazily the first time
# a rank makes an optimizer or an embedding on the meta device (~1.4 s of CPU more per rank; a
# module of ZeRO tests runs in half the time with it preloaded). The server runs no torch op and
# these imports start no thread, so a fork of it is as clean as a fresh interpreter.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "transformers"]


def preload_in_ranks(modules) -> None:
    """Import `modules` in that server too (call it before the first run_ranks; later calls do
    nothing): a test suite's own modules are then imported once, not again in every rank
    (~0.3 s of CPU each). Only modules that do nothing but define things on import belong here."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


class _CallerFd:
    """One of the caller's file descriptors, handed to the forked rank: its stdout and stderr go
    where the caller's go now (e.g. a test's capture), not where the server's went."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while the Process starts: multiprocessing sends the fd along
        return _adopt_fd, (reduction.DupFd(self.fd),)


def _adopt_fd(dup) -> int:
    return dup.detach()


def _worker(rank, world_size, ranks_per_node, port, fn, args, results, environ, stdout, stderr):
    os.environ.clear()  # the caller's environment, not the server's (started by an earlier call)
    os.environ.update(environ)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Every rank past init first: one that returned at once (fn with no collective) and exited would
        # close its connections under a slower rank still connecting (seen under load: "connectFullMesh failed").
        dist.barrier()
        out = fn(rank, world_size, *args)
        # Serialized by value: tensors sent through a multiprocessing queue are shared by file
        # descriptor, which breaks when the rank exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report every failure to the parent, including assertion errors
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, args: tuple = (), ranks_per_node: int | None = None, timeout: float = 300):
    ranks_per_node = ranks_per_node or world_size
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, ranks_per_node, port, fn, args, results, environ,
                                          _CallerFd(1), _CallerFd(2)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(outputs))} did not finish in {timeout}s")
            if ok:
                outputs[rank] = torch.load(io.BytesIO(out), weights_only=True)
            else:
                failures.append(f"rank {rank} failed:\n{out}")
                break  # the other ranks are likely blocked in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.terminate()
    if failures:
        raise AssertionError("\n".join(failures))
    return [outputs[r] for r in range(world_size)]
