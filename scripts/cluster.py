"""An emulated multi-node cluster on one machine: network namespaces joined by rate-limited links.

    with EmulatedCluster(nodes=2, rate="100mbit") as cluster:
        result = cluster.run(["python", "train.py", "--config", "c.yaml"], nproc_per_node=2)
        result.returncode, result.wall_s, result.node_outputs[k], result.link_bytes[k]  # {"tx", "rx"}
        cluster.measure_throughput(0, 1)                        # achieved TCP Mbit/s, node 0 -> 1

    python scripts/cluster.py --nodes 2 --nproc-per-node 2 --rate 100mbit -- python train.py ...
    python scripts/cluster.py --cleanup          # remove leftovers of crashed runs

Each node is a namespace whose veth to a bridge (in a hub namespace) is shaped with tbf in both
directions; ranks of one node talk over its loopback, unshaped. Nothing is created in the root
namespace, so deleting the namespaces removes everything. Topology, shaping parameters,
requirements and limits: docs/cluster.md.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
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
_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class ClusterRequirementError(RuntimeError):
    """Root, iproute2 (`ip`, `tc`) or the kernel's tbf qdisc / netns support is missing."""


class ClusterError(RuntimeError):
    """Setting up the emulated network failed for another reason."""


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


def list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespace(ns: str) -> None:
    """SIGKILL what still runs inside `ns` (a namespace outlives `ip netns del` while processes are
    in it), then delete it."""
    for _ in range(3):
        pids = [int(p) for p in _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
                if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            break
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.1)
    _sh(["ip", "netns", "del", ns], check=False)


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def cleanup_leftovers(prefix: str = PREFIX, force: bool = False) -> list[str]:
    """Delete namespaces (and so their veths) and kill processes left by earlier runs.

    Only names of this module's form (zpp-<pid>-<seq>-...) starting with `prefix` are touched;
    a run whose creating process is still alive is skipped unless `force`.
    """
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if not m or not ns.startswith(prefix) or any(ns.startswith(c.prefix + "-") for c in _LIVE):
            continue  # not ours, or a cluster of this very process that is up
        owner = int(m.group(1))
        if not force and owner != os.getpid() and Path(f"/proc/{owner}").exists():
            continue
        _delete_namespace(ns)
        removed.append(ns)
    return removed


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
        return {"returncode": self.returncode, "timed_out": self.timed_out, "wall_s": round(self.wall_s, 3),
                "rate_mbit": self.rate_bits / 1e6, "run_dir": str(self.run_dir),
                "nodes": [{"node": k, "returncode": rc, "tx_bytes": lb["tx"], "rx_bytes": lb["rx"]}
                          for k, (rc, lb) in enumerate(zip(self.returncodes, self.link_bytes))]}


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
        seq, pid = next(_SEQ), os.getpid()
        self.prefix = f"{PREFIX}{pid}-{seq}"
        # Interface names are limited to 15 characters: z<pid hex><seq hex>n<k> / ...h<k>.
        self.if_tag = f"z{pid:x}{seq:x}"
        self.hub_ns = f"{self.prefix}-hub"
        octet = (pid * 7 + seq) % 250 + 1    # a run-specific /24, only ever used inside our namespaces
        self.nodes = [_Node(k, f"{self.prefix}-n{k}", f"{self.if_tag}n{k}", f"{self.if_tag}h{k}",
                            f"10.77.{octet}.{k + 1}") for k in range(nodes)]
        self._run_dir_arg = Path(run_dir) if run_dir else None
        self.run_dir: Path | None = None
        self._procs: list[subprocess.Popen] = []    # what run() and measure_throughput() launched
        self._anchors: list[subprocess.Popen] = []  # a `sleep` per node: its /proc/<pid>/net/dev is the node's
        self._lock = threading.RLock()
        self._up = False
        self._runs = 0
        self._old_handlers: dict = {}

    def __enter__(self) -> "EmulatedCluster":
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> "EmulatedCluster":
        check_requirements()
        self._install_signal_handlers()
        _LIVE.append(self)
        self._up = True
        try:
            self._remove_namespaces()  # a crashed run of an earlier process with our pid would collide
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
            self._start_anchors()
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
        # No IPv6: its neighbour discovery / MLD chatter would show up in the link counters.
        _sh(["ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
             "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"], check=False)

    def _ip(self, ns: str, *args: str) -> None:
        _sh(["ip", "-n", ns, *args])

    def _shape(self, ns: str, dev: str) -> None:
        proc = _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_bits}bit",
                    "burst", str(self.burst), "latency", self.latency], check=False)
        if proc.returncode != 0:
            raise ClusterRequirementError(
                f"tc could not add a tbf qdisc ({proc.stderr.strip()}). The kernel needs the token bucket "
                "filter: CONFIG_NET_SCH_TBF (load it with `modprobe sch_tbf`; in a container the host must "
                "provide it).")

    def _start_anchors(self) -> None:
        """One idle process per node, so that reading a node's counters (20 times a second while a job
        runs) is reading a file, not spawning `ip netns exec`."""
        self._anchors = [subprocess.Popen(["ip", "netns", "exec", node.ns, "sleep", "1000000"],
                                          start_new_session=True, preexec_fn=_set_parent_death_signal)
                         for node in self.nodes]
        deadline = time.monotonic() + 10
        # `ip netns exec` enters the namespace, then execs sleep: until then /proc/<pid>/net is the root's
        while any(Path(f"/proc/{p.pid}/comm").read_text().strip() != "sleep" for p in self._anchors):
            if time.monotonic() > deadline:
                raise ClusterError("`ip netns exec ... sleep` did not enter the node namespaces in 10 s")
            time.sleep(0.01)

    def _remove_namespaces(self) -> None:
        for ns in list_namespaces():
            if ns.startswith(self.prefix + "-"):
                _delete_namespace(ns)

    def teardown(self) -> None:
        """Kill everything launched, delete the namespaces. Idempotent; signals are blocked
        meanwhile so a second Ctrl-C cannot interrupt it half-way."""
        with self._lock:
            if not self._up:
                return
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
            try:
                self._kill_procs()
                for anchor in self._anchors:
                    anchor.kill()
                    anchor.wait()
                self._remove_namespaces()
                if self._run_dir_arg is None and self.run_dir is not None:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                self._up = False
                if self in _LIVE:
                    _LIVE.remove(self)
                self._restore_signal_handlers()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            # Raise in the main thread; run()'s and the with-block's finally clauses tear down.
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in _SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, old in self._old_handlers.items():
                signal.signal(sig, old)
            self._old_handlers.clear()

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
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for p in live:
                _signal(p.pid, sig, group=True)
            deadline = time.monotonic() + wait
            for p in live:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            live = [p for p in live if p.poll() is None]
            if not live:
                break
        for p in self._procs:  # stragglers in the same groups (children whose parent already exited)
            _signal(p.pid, signal.SIGKILL, group=True)
        self._procs = [p for p in self._procs if p.poll() is None]

    def link_counters(self) -> list[dict]:
        """Per node: bytes its veth has sent ("tx") and received ("rx") so far."""
        out = []
        for node, anchor in zip(self.nodes, self._anchors):
            lines = Path(f"/proc/{anchor.pid}/net/dev").read_text().splitlines()
            fields = next(ln for ln in lines if ln.strip().startswith(node.ifname + ":")).split(":", 1)[1].split()
            out.append({"tx": int(fields[8]), "rx": int(fields[0])})
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
        nbytes, secs = int(out.split()[0]), float(out.split()[1])
        link_tx = self.link_counters()[src]["tx"] - before[src]["tx"]
        return {"mbit_s": nbytes * 8 / secs / 1e6, "bytes": nbytes, "seconds": secs,
                "link_mbit_s": link_tx * 8 / secs / 1e6, "rate_mbit": self.rate_bits / 1e6}

    def torchrun_argv(self, node: _Node, cmd: list[str], nproc_per_node: int) -> list[str]:
        """`python -m torch.distributed.run ...` for one node. `cmd` is `python script.py args`,
        `python -m module args`, `script.py args`, or any other executable (run --no-python)."""
        cmd, mode = list(cmd), []
        if cmd and Path(cmd[0]).name.startswith("python"):
            cmd = cmd[1:]
            if cmd[:1] == ["-m"]:
                mode, cmd = ["--module"], cmd[1:]
        elif cmd and not cmd[0].endswith(".py"):
            mode = ["--no-python"]
        if not cmd:
            raise ValueError("empty command")
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(self.num_nodes), "--node-rank", str(node.index),
            "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.nodes[0].addr}:{self.rdzv_port}",
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
        logs, procs, timed_out = [], [], False
        before = self.link_counters()
        start = time.monotonic()
        try:
            for node in self.nodes:
                node_env = {**os.environ, "GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1",
                            "PYTHONUNBUFFERED": "1", "ZPP_NODE_INDEX": str(node.index), "ZPP_NODE_ADDR": node.addr,
                            **{k: str(v) for k, v in (env or {}).items()}}
                argv = self.torchrun_argv(node, cmd, nproc_per_node) if torchrun else cmd
                tag = f"node{node.index}" + (f".run{run_id}" if run_id else "")
                logs.append((self.run_dir / f"{tag}.out", self.run_dir / f"{tag}.err"))
                with open(logs[-1][0], "w") as out, open(logs[-1][1], "w") as err:
                    procs.append(self._popen(node, argv, stdout=out, stderr=err, env=node_env,
                                             cwd=str(cwd) if cwd else None, stdin=subprocess.DEVNULL))
            first_fail = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if timeout and now > start + timeout:
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
        rcs = [p.returncode for p in procs]
        # nodes that failed on their own come before those we killed after a peer failed
        failing = [rc for rc, k in zip(rcs, killed) if rc and not k] + [rc for rc, k in zip(rcs, killed) if rc and k]
        first = failing[0] if failing else 0
        rc = 124 if timed_out else (128 - first if first < 0 else first)
        return RunResult(
            command=cmd, returncode=rc, returncodes=rcs, wall_s=wall, timed_out=timed_out,
            link_bytes=[{"tx": a["tx"] - b["tx"], "rx": a["rx"] - b["rx"]} for a, b in zip(after, before)],
            node_stdout=[o.read_text() for o, _ in logs], node_stderr=[e.read_text() for _, e in logs],
            run_dir=self.run_dir, rate_bits=self.rate_bits)


def _set_parent_death_signal() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except Exception:
        pass


@atexit.register
def _teardown_all() -> None:
    for cluster in list(_LIVE):
        try:
            cluster.teardown()
        except Exception:
            pass


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
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
            print(json.dumps({"removed": cleanup_leftovers(args.cleanup, force=args.force)}))
            return 0
        if not cmd:
            parser.error("no command: put it after `--`")
        cluster = EmulatedCluster(nodes=args.nodes, rate=args.rate, run_dir=args.run_dir)
        if args.run_dir is None:
            cluster._run_dir_arg = Path(__file__).resolve().parents[1] / "runs" / "cluster" / cluster.prefix
        with cluster:
            measured = cluster.measure_throughput(0, 1) if args.measure and args.nodes >= 2 else None
            if measured:
                print(f"[cluster] node0 -> node1: {measured['mbit_s']:.1f} Mbit/s achieved "
                      f"(rate {measured['rate_mbit']:g} Mbit/s)", file=sys.stderr)
            result = cluster.run(cmd, nproc_per_node=args.nproc_per_node, env=dict(kv.split("=", 1) for kv in args.env),
                                 timeout=args.timeout, torchrun=not args.no_torchrun)
        for k, (out, err) in enumerate(zip(result.node_stdout, result.node_stderr)):
            print(f"===== node {k} (exit {result.returncodes[k]}) =====")
            sys.stdout.write(out)
            if err:
                print(f"----- node {k} stderr -----")
                sys.stdout.write(err if err.endswith("\n") else err + "\n")
        print(json.dumps({**result.summary(), **({"throughput": measured} if measured else {})}), flush=True)
        return result.returncode
    except ClusterRequirementError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
