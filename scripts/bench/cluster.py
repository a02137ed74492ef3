"""An emulated multi-node cluster on one machine: network namespaces joined by rate-limited links.

    with EmulatedCluster(nodes=2, rate="100mbit") as cluster:
        result = cluster.run(["python", "train.py", "--config", "c.yaml"], nproc_per_node=2)
        result.returncode, result.wall_s, result.node_outputs[k], result.link_bytes[k]  # {"tx", "rx"}
        cluster.measure_throughput(0, 1)                        # achieved TCP Mbit/s, node 0 -> 1

    python scripts/bench/cluster.py --nodes 2 --nproc-per-node 2 --rate 100mbit -- python train.py ...
    python scripts/bench/cluster.py --cleanup          # remove leftovers of crashed runs

Each node is a namespace whose veth to a bridge (in a hub namespace) is shaped with tbf in both
directions; ranks of one node talk over its loopback, unshaped. Nothing is created in the root
namespace, so deleting the namespaces removes everything. Topology, shaping parameters,
requirements and limits: docs/cluster.md.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "zpp-"
THROUGHPUT_PORT = 5201      # measure_throughput's TCP port, inside the namespaces
RDZV_PORT = 29400           # every cluster has its own network stack, so a fixed port never collides
_NS_RE = re.compile(r"^zpp-(\d+)-(\d+)-(hub|n\d+)$")
_SEQ = itertools.count()
_LIVE: list["EmulatedCluster"] = []   # clusters not yet torn down, for the atexit fallback


class ClusterRequirementError(RuntimeError):
    """Root, iproute2 (`ip`, `tc`) or the kernel's tbf qdisc / netns support is missing."""


class ClusterError(RuntimeError):
    """Setting up the emulated network failed for another reason."""


# ---------------------------------------------------------------- rates and shaping parameters


_UNITS = {  # tc's units: "bit" is bits per second, "bps" is BYTES per second
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}


def parse_rate(rate: str | int | float) -> int:
    """tc-style rate ("100mbit", "1gbit", "1.5gbit", "12mbps") -> bits per second."""
    if isinstance(rate, (int, float)):
        return int(rate)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in _UNITS):
        raise ValueError(f"cannot parse rate {rate!r}; use e.g. 20mbit, 100mbit, 1gbit (tc units)")
    bits = float(m.group(1)) * _UNITS[unit or "bit"]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s")
    return int(bits)


def tbf_params(rate_bits: int) -> tuple[int, str]:
    """(burst bytes, latency) for tbf at this rate. The bucket holds 5 ms of traffic (tbf refills it from a
    timer: tokens beyond it are lost when the watchdog wakes late, and the link runs below `rate`), at
    least one 64 KiB GSO super-packet; the 100 ms queue absorbs TCP's bursts without drops. Measured
    effects of both: docs/cluster.md.
    """
    burst = max(64 * 1024, int(rate_bits / 8 * 0.005))
    return burst, "100ms"


# ---------------------------------------------------------------- shell helpers and requirements


def _sh(args: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{shlex.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_requirements() -> None:
    """Raise ClusterRequirementError naming what is missing (root, `ip`, `tc`)."""
    missing = []
    if not sys.platform.startswith("linux"):
        missing.append("Linux (network namespaces are a Linux feature)")
    if os.geteuid() != 0:
        missing.append("root (run as root, e.g. `sudo -E python ...`: creating network "
                       "namespaces and qdiscs needs CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` from iproute2 (apt-get install iproute2 / dnf install iproute "
                           f"/ apk add iproute2; it lives in /sbin or /usr/sbin, which must be on PATH)")
    if missing:
        raise ClusterRequirementError("the emulated cluster needs: " + "; ".join(missing))


def _tbf_hint(stderr: str) -> str:
    return (f"tc could not add a tbf qdisc ({stderr.strip()}). The kernel needs the token bucket "
            "filter: CONFIG_NET_SCH_TBF (load it with `modprobe sch_tbf`; in a container the host "
            "must provide it).")


# ---------------------------------------------------------------- leftovers


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_pids(ns: str) -> None:
    """SIGKILL every process still inside a namespace (a namespace outlives `ip netns del`
    while processes are in it)."""
    for _ in range(3):
        pids = [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_pids(ns)
    _sh(["ip", "netns", "del", ns], check=False)


def cleanup_leftovers(prefix: str = PREFIX, force: bool = False) -> list[str]:
    """Delete namespaces (and so their veths) and kill processes left by earlier runs.

    Only names of this module's form (zpp-<pid>-<seq>-...) starting with `prefix` are touched;
    a run whose creating process is still alive is skipped unless `force`.
    """
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if not m or not ns.startswith(prefix):
            continue
        owner = int(m.group(1))
        if any(ns.startswith(c.prefix + "-") for c in _LIVE):
            continue                      # a cluster of this very process that is up
        if not force and owner != os.getpid() and _pid_alive(owner):
            continue
        _delete_namespace(ns)
        removed.append(ns)
    return removed


# ---------------------------------------------------------------- results


@dataclass
class RunResult:
    command: list[str]
    returncode: int                       # 0, else the first failing node's code (124: timeout)
    returncodes: list[int]                # per node; negative: killed by that signal
    wall_s: float
    timed_out: bool
    link_bytes: list[dict]                # per node {"tx": bytes sent, "rx": bytes received}
    node_stdout: list[str]
    node_stderr: list[str]
    run_dir: Path
    rate_bits: int

    @property
    def node_outputs(self) -> list[str]:
        """Per node: stdout followed by stderr."""
        return [o + e for o, e in zip(self.node_stdout, self.node_stderr)]

    def summary(self) -> dict:
        return {
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "wall_s": round(self.wall_s, 3),
            "rate_mbit": self.rate_bits / 1e6,
            "run_dir": str(self.run_dir),
            "nodes": [{"node": k, "returncode": rc, "tx_bytes": lb["tx"], "rx_bytes": lb["rx"]}
                      for k, (rc, lb) in enumerate(zip(self.returncodes, self.link_bytes))],
        }


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


# ---------------------------------------------------------------- the cluster


@dataclass
class _Node:
    index: int
    ns: str
    ifname: str           # node-side veth (inside ns)
    hub_ifname: str       # hub-side veth (inside the hub ns)
    addr: str


class EmulatedCluster:
    """N nodes as network namespaces on a bridge in a hub namespace; every link shaped by tbf.

    Use as a context manager (or call setup()/teardown()). Teardown kills launched process
    groups and deletes the namespaces on normal exit, on exceptions, on SIGINT/SIGTERM (handlers
    installed while the cluster is up, when created in the main thread) and at interpreter exit.
    """

    def __init__(self, nodes: int = 2, rate: str | int = "100mbit", run_dir: str | Path | None = None,
                 rdzv_port: int = RDZV_PORT):
        if not 1 <= nodes <= 250:
            raise ValueError("nodes must be in 1..250")
        self.num_nodes = nodes
        self.rate_bits = parse_rate(rate)
        self.rdzv_port = rdzv_port
        self.burst, self.latency = tbf_params(self.rate_bits)
        seq = next(_SEQ)
        pid = os.getpid()
        self.prefix = f"{PREFIX}{pid}-{seq}"
        # Interface names are limited to 15 characters: z<pid hex><seq hex>n<k> / ...h<k>.
        self.if_tag = f"z{pid:x}{seq:x}"
        self.hub_ns = f"{self.prefix}-hub"
        octet = (pid * 7 + seq) % 250 + 1    # run-specific; only ever used inside our namespaces
        self.subnet = f"10.77.{octet}.0/24"
        self.nodes = [_Node(k, f"{self.prefix}-n{k}", f"{self.if_tag}n{k}", f"{self.if_tag}h{k}",
                            f"10.77.{octet}.{k + 1}") for k in range(nodes)]
        self._run_dir_arg = Path(run_dir) if run_dir else None
        self.run_dir: Path | None = None
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._created: list[str] = []
        self._up = False
        self._runs = 0
        self._old_handlers: dict = {}

    # -- lifecycle

    def __enter__(self) -> "EmulatedCluster":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> "EmulatedCluster":
        check_requirements()
        self._install_signal_handlers()
        _LIVE.append(self)
        self._up = True
        try:
            # a crashed run of an earlier process with our pid would collide with our names
            for ns in list_namespaces():
                if ns.startswith(self.prefix + "-"):
                    _delete_namespace(ns)
            # without a run_dir, outputs live in a temp dir removed at teardown (they are in the result)
            self.run_dir = self._run_dir_arg or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._add_ns(self.hub_ns)
            self._ip(self.hub_ns, "link", "add", "br0", "type", "bridge")
            self._ip(self.hub_ns, "link", "set", "br0", "up")
            for node in self.nodes:
                self._add_ns(node.ns)
                self._ip(node.ns, "link", "set", "lo", "up")
                # created inside the namespaces: nothing ever appears in the root namespace
                self._ip(node.ns, "link", "add", node.ifname, "type", "veth",
                         "peer", "name", node.hub_ifname, "netns", self.hub_ns)
                self._ip(self.hub_ns, "link", "set", node.hub_ifname, "master", "br0")
                self._ip(self.hub_ns, "link", "set", node.hub_ifname, "up")
                self._ip(node.ns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
                self._ip(node.ns, "link", "set", node.ifname, "up")
                self._shape(node.ns, node.ifname)          # node -> hub: what the node sends
                self._shape(self.hub_ns, node.hub_ifname)  # hub -> node: what the node receives
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        proc = _sh(["ip", "netns", "add", ns], check=False)
        if proc.returncode != 0:
            raise ClusterRequirementError(
                f"`ip netns add {ns}` failed: {proc.stderr.strip()} (needs root with CAP_SYS_ADMIN "
                "and a kernel with network namespaces, CONFIG_NET_NS)")
        self._created.append(ns)
        # No IPv6: its neighbour discovery / MLD chatter would show up in the link counters.
        subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                        "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                        "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"],
                       capture_output=True)

    def _ip(self, ns: str, *args: str) -> None:
        _sh(["ip", "-n", ns, *args])

    def _shape(self, ns: str, dev: str) -> None:
        proc = _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{self.rate_bits}bit", "burst", str(self.burst), "latency", self.latency],
                   check=False)
        if proc.returncode != 0:
            raise ClusterRequirementError(_tbf_hint(proc.stderr))

    def teardown(self) -> None:
        """Kill everything launched, delete the namespaces. Idempotent; signals are blocked
        meanwhile so a second Ctrl-C cannot interrupt it half-way."""
        with self._lock:
            if not self._up:
                return
            blocked = _block_signals()
            try:
                self._kill_procs()
                for ns in reversed(self._created):
                    _delete_namespace(ns)
                # also anything of ours a crash between `netns add` and bookkeeping left behind
                for ns in list_namespaces():
                    if ns.startswith(self.prefix + "-"):
                        _delete_namespace(ns)
                self._created.clear()
                if self._run_dir_arg is None and self.run_dir is not None:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                self._up = False
                if self in _LIVE:
                    _LIVE.remove(self)
                self._restore_signal_handlers()
            finally:
                _unblock_signals(blocked)

    # -- signals

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            # Raise in the main thread; run()'s and the with-block's finally clauses tear down.
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # -- processes

    def _popen(self, node: _Node, argv: list[str], **kw) -> subprocess.Popen:
        # Own session = own process group, killable as a whole (torchrun and its workers).
        # `ip netns exec` execs the command, so the parent-death signal lands on it: if this
        # process is SIGKILLed, torchrun still gets SIGTERM and stops its workers (the
        # namespaces then remain until `--cleanup` or a run that reuses the pid).
        proc = subprocess.Popen(["ip", "netns", "exec", node.ns, *argv], start_new_session=True,
                                preexec_fn=_set_parent_death_signal, **kw)
        self._procs.append(proc)
        return proc

    def _kill_procs(self, grace: float = 3.0) -> None:
        live = [p for p in self._procs if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
            for p in live:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            live = [p for p in live if p.poll() is None]
            if not live:
                break
        # stragglers in the same groups (children whose parent already exited)
        for p in self._procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._procs = [p for p in self._procs if p.poll() is None]

    # -- measurements

    def link_counters(self) -> list[dict]:
        """Per node: bytes its veth has sent ("tx") and received ("rx") so far."""
        out = []
        for node in self.nodes:
            stats = f"/sys/class/net/{node.ifname}/statistics"
            text = _sh(["ip", "netns", "exec", node.ns, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]).stdout
            tx, rx = (int(v) for v in text.split())
            out.append({"tx": tx, "rx": rx})
        return out

    def measure_throughput(self, src: int = 0, dst: int = 1, seconds: float = 2.0) -> dict:
        """Achieved TCP goodput from node `src` to node `dst` (an iperf-like bulk transfer).

        The sender writes for `seconds`; the receiver times first byte to EOF (so the queue drains
        into the measurement). Returns {"mbit_s": goodput, "bytes", "seconds", "link_mbit_s": rate
        of the physical bytes the sender's veth sent (headers and retransmits included),
        "rate_mbit": the configured rate}.
        """
        a, b = self.nodes[src], self.nodes[dst]
        before = self.link_counters()
        recv = self._popen(b, [sys.executable, "-c", _RECEIVER, b.addr, str(THROUGHPUT_PORT)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if recv.stdout.readline().strip() != "READY":
                raise ClusterError(f"throughput receiver failed: {recv.stderr.read()}")
            send = self._popen(a, [sys.executable, "-c", _SENDER, b.addr, str(THROUGHPUT_PORT), str(seconds)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            out, err = recv.communicate(timeout=seconds * 20 + 30)
            send.wait(timeout=30)
            if recv.returncode != 0 or send.returncode != 0:
                raise ClusterError(f"throughput measurement failed: {err} {send.stderr.read()}")
        finally:
            self._kill_procs()
        nbytes, secs = out.split()
        nbytes, secs = int(nbytes), float(secs)
        after = self.link_counters()
        link_tx = after[src]["tx"] - before[src]["tx"]
        return {"mbit_s": nbytes * 8 / secs / 1e6, "bytes": nbytes, "seconds": secs,
                "link_mbit_s": link_tx * 8 / secs / 1e6, "rate_mbit": self.rate_bits / 1e6}

    # -- running

    def torchrun_argv(self, node: _Node, cmd: list[str], nproc_per_node: int) -> list[str]:
        """`python -m torch.distributed.run ...` for one node. `cmd` is `python script.py args`,
        `python -m module args`, `script.py args`, or any other executable (run --no-python)."""
        cmd = list(cmd)
        mode: list[str] = []
        if cmd and Path(cmd[0]).name.startswith("python"):
            cmd = cmd[1:]
            if cmd[:1] == ["-m"]:
                mode, cmd = ["--module"], cmd[1:]
        elif cmd and not cmd[0].endswith(".py"):
            mode = ["--no-python"]
        if not cmd:
            raise ValueError("empty command")
        node0 = self.nodes[0]
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(self.num_nodes), "--node-rank", str(node.index),
            "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{node0.addr}:{self.rdzv_port}",
            "--rdzv-id", self.prefix,
            # torchrun decides who hosts the rendezvous store by matching the endpoint against the
            # machine's hostname/IPs, which knows nothing of our namespace addresses: say it.
            "--rdzv-conf", f"is_host={1 if node.index == 0 else 0}",
            # address advertised as MASTER_ADDR if this node becomes rendezvous rank 0
            # (default: the machine's FQDN, unreachable from inside the namespaces)
            "--local-addr", node.addr,
            "--max-restarts", "0",
            *mode, *cmd,
        ]

    def run(self, cmd: list[str], nproc_per_node: int = 1, env: dict | None = None,
            timeout: float | None = None, cwd: str | Path | None = None, torchrun: bool = True,
            fail_grace: float = 15.0) -> RunResult:
        """Run `cmd` on every node (via torchrun unless torchrun=False) and wait.

        A node failing gives the others `fail_grace` seconds to finish before they are killed
        (a peer of a dead rank often hangs). On `timeout` every process group is killed and the
        result has timed_out=True, returncode 124. Outputs go to run_dir/node<k>.{out,err}
        (node<k>.run<i>.* for the i-th later run on the same cluster).
        """
        if not self._up:
            raise ClusterError("cluster is not set up (use `with EmulatedCluster(...)` or setup())")
        cmd = [str(c) for c in cmd]
        run_id, self._runs = self._runs, self._runs + 1
        files, procs = [], []
        before = self.link_counters()
        start = time.monotonic()
        timed_out = False
        try:
            for node in self.nodes:
                node_env = dict(os.environ)
                node_env.update(GLOO_SOCKET_IFNAME=node.ifname, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                ZPP_NODE_INDEX=str(node.index), ZPP_NODE_ADDR=node.addr)
                node_env.update({k: str(v) for k, v in (env or {}).items()})
                argv = self.torchrun_argv(node, cmd, nproc_per_node) if torchrun else cmd
                tag = f"node{node.index}" + (f".run{run_id}" if run_id else "")
                out = open(self.run_dir / f"{tag}.out", "w+")
                err = open(self.run_dir / f"{tag}.err", "w+")
                files.append((out, err))
                procs.append(self._popen(node, argv, stdout=out, stderr=err, env=node_env,
                                         cwd=str(cwd) if cwd else None, stdin=subprocess.DEVNULL))
            deadline = start + timeout if timeout else None
            first_fail = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if deadline and now > deadline:
                    timed_out = True
                    break
                if first_fail is None and any(p.poll() not in (None, 0) for p in procs):
                    first_fail = now
                if first_fail is not None and now - first_fail > fail_grace:
                    break
                time.sleep(0.05)
        finally:
            killed = [p.poll() is None for p in procs]
            self._kill_procs()   # a no-op when all exited; else the timeout / Ctrl-C / failure path
        wall = time.monotonic() - start
        after = self.link_counters()
        stdouts, stderrs = [], []
        for out, err in files:
            for f, dst in ((out, stdouts), (err, stderrs)):
                f.flush()
                f.seek(0)
                dst.append(f.read())
                f.close()
        rcs = [p.returncode for p in procs]
        # nodes that failed on their own come before those we killed after a peer failed
        failing = [rc for rc, k in zip(rcs, killed) if rc != 0 and not k] + \
                  [rc for rc, k in zip(rcs, killed) if rc != 0 and k]
        rc = 124 if timed_out else (_exit_code(failing[0]) if failing else 0)
        return RunResult(
            command=cmd, returncode=rc, returncodes=rcs, wall_s=wall, timed_out=timed_out,
            link_bytes=[{"tx": a["tx"] - b["tx"], "rx": a["rx"] - b["rx"]} for a, b in zip(after, before)],
            node_stdout=stdouts, node_stderr=stderrs, run_dir=self.run_dir, rate_bits=self.rate_bits)


def _set_parent_death_signal() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except Exception:
        pass


def _block_signals():
    if hasattr(signal, "pthread_sigmask"):
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    return None


def _unblock_signals(old) -> None:
    if old is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@atexit.register
def _teardown_all() -> None:
    for cluster in list(_LIVE):
        try:
            cluster.teardown()
        except Exception:
            pass


# ---------------------------------------------------------------- throughput


_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("READY", flush=True)
c, _ = s.accept()
buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.perf_counter()
    n += k
print(n, time.perf_counter() - t0, flush=True)
"""

_SENDER = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = bytes(256 * 1024); end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end: c.sendall(chunk)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(
        description="Run a command on N emulated nodes (network namespaces, tbf-shaped links) via torchrun.",
        usage="%(prog)s [options] -- python train.py ARGS...   |   %(prog)s --cleanup [--force]")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--rate", default="100mbit", help="per-node link rate each way, tc units (default 100mbit)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds; then everything is killed (exit 124)")
    parser.add_argument("--run-dir", default=None,
                        help="where node<k>.out/.err go (default: runs/cluster/<run prefix> in the repo)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment")
    parser.add_argument("--no-torchrun", action="store_true", help="run the command as is on every node")
    parser.add_argument("--measure", action="store_true", help="first measure node0 -> node1 TCP throughput")
    parser.add_argument("--cleanup", nargs="?", const=PREFIX, default=None, metavar="PREFIX",
                        help="remove leftovers of earlier crashed runs (namespaces named PREFIX..., default zpp-)")
    parser.add_argument("--force", action="store_true", help="with --cleanup: also runs whose process is alive")
    args = parser.parse_args(argv)
    try:
        check_requirements()
        if args.cleanup is not None:
            removed = cleanup_leftovers(args.cleanup, force=args.force)
            print(json.dumps({"removed": removed}))
            return 0
        if not cmd:
            parser.error("no command: put it after `--`")
        env = dict(kv.split("=", 1) for kv in args.env)
        cluster = EmulatedCluster(nodes=args.nodes, rate=args.rate, run_dir=args.run_dir)
        if args.run_dir is None:
            cluster._run_dir_arg = Path(__file__).resolve().parents[2] / "runs" / "cluster" / cluster.prefix
        with cluster:
            measured = None
            if args.measure and args.nodes >= 2:
                measured = cluster.measure_throughput(0, 1)
                print(f"[cluster] node0 -> node1: {measured['mbit_s']:.1f} Mbit/s achieved "
                      f"(rate {measured['rate_mbit']:g} Mbit/s)", file=sys.stderr)
            result = cluster.run(cmd, nproc_per_node=args.nproc_per_node, env=env, timeout=args.timeout,
                                 torchrun=not args.no_torchrun)
        for k, (out, err) in enumerate(zip(result.node_stdout, result.node_stderr)):
            print(f"===== node {k} (exit {result.returncodes[k]}) =====")
            sys.stdout.write(out)
            if err:
                print(f"----- node {k} stderr -----")
                sys.stdout.write(err if err.endswith("\n") else err + "\n")
        summary = result.summary()
        if measured:
            summary["throughput"] = measured
        print(json.dumps(summary), flush=True)
        return result.returncode
    except ClusterRequirementError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
