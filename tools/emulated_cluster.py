#!/usr/bin/env python3
"""Emulate a multi-node cluster on one machine: network namespaces joined by shaped veth links.

Each emulated *node* is a Linux network namespace (``<prefix>-node<K>``) with one veth interface
(``<prefix>-n<K>``, address ``10.77.0.<K+1>/24``). Two nodes are joined point to point; more go
through a bridge in its own namespace (``<prefix>-br``). Every veth end is shaped with ``tc tbf``
(egress on both ends, so both directions are limited). Ranks inside one node talk over that
node's local path, unshaped and uncounted; ranks on different nodes cross the shaped veth, whose
``tx_bytes``/``rx_bytes`` counters say how much crossed.

A job runs as one torchrun agent per node inside its namespace, with gloo bound to the node's
veth (``GLOO_SOCKET_IFNAME``). Rendezvous is static by default (``--master-addr`` node 0's
address, ``--node-rank K``): the node ranks are fixed by construction, and every namespace shares
one host name that resolves to 127.0.0.1, which c10d's host detection cannot tell apart.
``rendezvous="c10d"`` exercises the other path (``--rdzv-conf is_host=1|0`` and
``--local-addr``), the one the multi-node launch scripts use.

Command line::

    tools/emulated_cluster.py up   --nodes 2 --rate 200mbit
    tools/emulated_cluster.py run  --ranks-per-node 2 -- -m hybrid.train --train-iters 3 ...
    tools/emulated_cluster.py down

``run`` uses the cluster ``up`` made, or brings up a temporary one (from its own shaping flags)
and tears it down afterwards. Python::

    with EmulatedCluster(nodes=2, ranks_per_node=2, rate="200mbit") as cluster:
        result = cluster.run(["-m", "hybrid.train", ...], timeout_s=120)
        result.ok, result.nodes[0].output, cluster.link_bytes()

Needs root (CAP_NET_ADMIN) and iproute2. Nothing leaves the machine: every address lives in a
namespace this tool made. The kernel here has no ``netem``, so link delay cannot be emulated;
asking for one raises :class:`LinkDelayUnavailable` (the CLI prints why and exits 3).
See docs/emulated_cluster.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository's `tools` package importable
    _REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)

from hybrid.argument_parser import ArgumentParser  # noqa: E402
from tools.netns import (KILL_GRACE_S, MARKER_ENV, ClusterError, ClusterUnavailable,  # noqa: E402
                         LinkDelayUnavailable, Net, kill_netns_processes, kill_pids, marked_processes, signals_blocked, wait_gone)

SUBNET = "10.77.0"  # a /24 that exists only inside this tool's namespaces
DEFAULT_PREFIX = "hyb"
DEFAULT_PORT = 29500
MIN_NODES, MAX_NODES = 2, 64  # one namespace each, with an address on SUBNET
FAILED_NODE_GRACE_S = 30.0  # how long the other nodes may run on after one node failed

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # interface names must stay under 16 bytes
_RATE_RE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$")
_SIZE_RE = re.compile(r"^\d+([kmg]?b|[kmg]bit|[kmg])?$")
_TIME_RE = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")


# ---- names and addresses ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, its veth interface in that namespace and its address."""

    index: int
    netns: str
    ifname: str
    address: str


def node_layout(prefix: str, nodes: int) -> List[Node]:
    return [Node(k, f"{prefix}-node{k}", f"{prefix}-n{k}", f"{SUBNET}.{k + 1}") for k in range(nodes)]


def bridge_netns(prefix: str) -> str:
    return f"{prefix}-br"


def _own_netns_re(prefix: str) -> "re.Pattern[str]":
    # Exactly the names this tool makes, so that cleaning up never touches anyone else's namespace.
    return re.compile(rf"^{re.escape(prefix)}-(node\d+|br|probe\d+)$")


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise ClusterError(f"prefix {prefix!r}: use 1-8 lower-case letters or digits, starting with a letter "
                           f"(interface names like {prefix}-n0 must fit in 15 bytes)")


def _check_shape(rate: Optional[str], burst: str, queue_latency: str, delay: Optional[str]) -> None:
    if rate is not None and not _RATE_RE.match(rate):
        raise ClusterError(f"rate {rate!r}: give a tc rate such as 200mbit or 1gbit")
    if not _SIZE_RE.match(burst):
        raise ClusterError(f"burst {burst!r}: give a tc size such as 256kb")
    for name, value in (("queue latency", queue_latency), ("delay", delay)):
        if value is not None and not _TIME_RE.match(value):
            raise ClusterError(f"{name} {value!r}: give a tc time such as 50ms")


def check_available(prefix: str = DEFAULT_PREFIX) -> None:
    """Raise :class:`ClusterUnavailable` with one line if this machine cannot make namespaces."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        raise ClusterUnavailable(f"network namespaces need Linux; this is {sys.platform}")
    net = Net()
    if os.geteuid() != 0:
        raise ClusterUnavailable("creating network namespaces needs root (CAP_NET_ADMIN); run as root")
    probe = f"{prefix}-probe{os.getpid()}"  # named like the tool's own: a later cleanup finds it if we die here
    done = net.ip_cmd("netns", "add", probe, check=False)
    if done.returncode != 0:
        why = (done.stderr.strip() or f"exit code {done.returncode}").splitlines()[-1]
        raise ClusterUnavailable(f"`ip netns add` fails here ({why}); needs root with CAP_NET_ADMIN")
    net.ip_cmd("netns", "delete", probe, check=False)


# ---- results -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class NodeResult:
    node: Node
    returncode: Optional[int]  # None: it had to be killed
    output: str  # stdout and stderr of the node's torchrun agent and its ranks
    killed: Optional[str] = None  # why it was killed, when it was


@dataclasses.dataclass
class RunResult:
    nodes: List[NodeResult]
    link_bytes: Dict[str, Dict[str, int]]  # per node namespace: tx_bytes, rx_bytes crossed during the run
    wall_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return all(n.returncode == 0 for n in self.nodes)

    def describe(self) -> str:
        lines = []
        for n in self.nodes:
            status = f"exit {n.returncode}" if n.killed is None else f"killed ({n.killed})"
            b = self.link_bytes.get(n.node.netns, {})
            lines.append(f"{n.node.netns} {n.node.address}: {status}, "
                         f"tx {b.get('tx_bytes', 0):,} B, rx {b.get('rx_bytes', 0):,} B")
        return "\n".join(lines)


def _state_dir() -> str:
    return "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()


def _kept_marker(prefix: str) -> str:
    """Written by ``up``: a cluster left up on purpose. Namespaces without it are a killed run's leftovers."""
    return os.path.join(_state_dir(), f"hybrid-emulated-cluster-{prefix}.up")


def own_namespaces(prefix: str = DEFAULT_PREFIX) -> List[str]:
    """The namespaces of this prefix that exist now (``<prefix>-node<K>``, ``<prefix>-br``)."""
    _check_prefix(prefix)
    own = _own_netns_re(prefix)
    return [name for name in Net().netns_list() if own.match(name)]


def is_up(prefix: str = DEFAULT_PREFIX) -> bool:
    """Whether ``up`` left a cluster of this prefix running (and it still exists)."""
    return os.path.exists(_kept_marker(prefix)) and bool(own_namespaces(prefix))


class _PrefixLock:
    """An exclusive lock per prefix, held while a cluster is in use, so that a second cluster of the
    same prefix waits (up to a timeout) instead of deleting a live one as stale."""

    def __init__(self, prefix: str, timeout_s: float):
        self.path = os.path.join(_state_dir(), f"hybrid-emulated-cluster-{prefix}.lock")
        self.prefix, self.timeout_s = prefix, timeout_s
        self._file = None

    def acquire(self) -> None:
        if self._file is not None:
            return
        f = open(self.path, "a+")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    f.close()
                    raise ClusterError(f"emulated cluster {self.prefix!r} is in use by another process "
                                       f"(lock {self.path}, waited {self.timeout_s:.0f} s); "
                                       f"wait for it or pick another prefix") from None
                time.sleep(0.5)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


# ---- the cluster -------------------------------------------------------------------------------------
class EmulatedCluster:
    """N emulated nodes on this machine; a context manager that builds them and always tears them down.

    ``rate=None`` leaves the links unshaped. ``delay`` needs ``netem`` (absent on these machines).
    ``keep=True`` leaves the namespaces up on exit (the CLI's ``up``). The cluster holds a lock
    (per prefix) while it is in use, so a second cluster of the same prefix waits for it instead
    of deleting it as stale.
    """

    def __init__(self, nodes: int = 2, ranks_per_node: int = 1, rate: Optional[str] = "200mbit",
                 burst: str = "256kb", queue_latency: str = "50ms", delay: Optional[str] = None,
                 prefix: str = DEFAULT_PREFIX, rendezvous: str = "static", lock_timeout_s: float = 120.0,
                 keep: bool = False):
        _check_prefix(prefix)
        _check_shape(rate, burst, queue_latency, delay)
        _check_counts(nodes, ranks_per_node)
        if rendezvous not in ("static", "c10d"):
            raise ClusterError(f"rendezvous={rendezvous!r}: use 'static' or 'c10d'")
        self.prefix, self.ranks_per_node, self.rendezvous = prefix, ranks_per_node, rendezvous
        self.rate, self.burst, self.queue_latency, self.delay = rate, burst, queue_latency, delay
        self.nodes = node_layout(prefix, nodes)
        self.marker = f"{prefix}:{uuid.uuid4().hex[:12]}"
        self.keep = keep
        self._lock = _PrefixLock(prefix, lock_timeout_s)
        self._net: Optional[Net] = None
        self._runs = 0
        self._last_bytes: Dict[str, Dict[str, int]] = {}
        self._old_handlers: Dict[int, object] = {}

    # -- lifecycle --
    def __enter__(self) -> "EmulatedCluster":
        self._install_signal_handlers()
        try:
            if self._net is None:  # attach() found one already up
                self.up()
        except BaseException:
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if not self.keep:
                self.down()
            else:
                self._lock.release()
        finally:
            self._restore_signal_handlers()

    def up(self) -> None:
        """Remove a stale cluster of this prefix, then build the namespaces, links and shaping."""
        check_available(self.prefix)
        self._net = Net()
        self._lock.acquire()
        try:
            remove_stale(self.prefix, self._net)
            self._build()
            if self.keep:
                with open(_kept_marker(self.prefix), "w") as f:
                    f.write(f"{len(self.nodes)} nodes, rate {self.rate}\n")
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Kill every process in this cluster's namespaces and delete them; safe to call twice."""
        with signals_blocked():
            try:
                remove_stale(self.prefix, self._net or Net())
            finally:
                self._lock.release()

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX, lock_timeout_s: float = 120.0, **kwargs) -> "EmulatedCluster":
        """The cluster ``up`` left running (its node count read from the namespaces); exiting keeps it up."""
        net = Net()
        own = _own_netns_re(prefix)
        count = sum(1 for name in net.netns_list() if own.match(name) and "-node" in name)
        if not is_up(prefix) or count < 2:
            raise ClusterError(f"no emulated cluster {prefix!r} is up: run `tools/emulated_cluster.py up` first")
        cluster = cls(nodes=count, prefix=prefix, lock_timeout_s=lock_timeout_s, keep=True, **kwargs)
        cluster._net = net
        cluster._lock.acquire()
        return cluster

    def _build(self) -> None:
        net = self._net
        for node in self.nodes:
            net.ip_cmd("netns", "add", node.netns)
            net.ip_cmd("-n", node.netns, "link", "set", "lo", "up")
        shaped = []  # (netns, ifname): every veth end, so that both directions are limited
        if len(self.nodes) == 2:
            a, b = self.nodes
            net.ip_cmd("-n", a.netns, "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname,
                       "netns", b.netns)
            shaped += [(a.netns, a.ifname), (b.netns, b.ifname)]
        else:
            br = bridge_netns(self.prefix)
            net.ip_cmd("netns", "add", br)
            net.ip_cmd("-n", br, "link", "add", f"{self.prefix}-br0", "type", "bridge")
            net.ip_cmd("-n", br, "link", "set", f"{self.prefix}-br0", "up")
            for node in self.nodes:
                port = f"{self.prefix}-b{node.index}"
                net.ip_cmd("-n", node.netns, "link", "add", node.ifname, "type", "veth", "peer", "name", port,
                           "netns", br)
                net.ip_cmd("-n", br, "link", "set", port, "master", f"{self.prefix}-br0")
                net.ip_cmd("-n", br, "link", "set", port, "up")
                shaped += [(node.netns, node.ifname), (br, port)]
        for node in self.nodes:
            net.ip_cmd("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            net.ip_cmd("-n", node.netns, "link", "set", node.ifname, "up")
        for netns, ifname in shaped:
            self._shape(netns, ifname)

    def _shape(self, netns: str, ifname: str) -> None:
        net = self._net
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.queue_latency] if self.rate else None
        if self.delay is None:
            if tbf:
                net.tc_cmd("-n", netns, "qdisc", "replace", "dev", ifname, "root", *tbf)
            return
        # netem delays; tbf below it limits the rate (the documented netem-then-tbf recipe).
        done = net.tc_cmd("-n", netns, "qdisc", "add", "dev", ifname, "root", "handle", "1:", "netem",
                          "delay", self.delay, check=False)
        if done.returncode != 0:
            why = (done.stderr.strip() or f"exit code {done.returncode}").splitlines()[-1]
            raise LinkDelayUnavailable(f"link delay {self.delay} needs tc netem, which this kernel lacks ({why}); "
                                       f"latency cannot be emulated here")
        if tbf:
            net.tc_cmd("-n", netns, "qdisc", "add", "dev", ifname, "parent", "1:1", "handle", "10:", *tbf)

    # -- signals: SIGTERM and SIGHUP unwind like Ctrl-C, so the finally blocks tear the cluster down --
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def unwind(signum, _frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, unwind)
        # Ctrl-C too, even where the parent ignored SIGINT (a shell's background job does).
        self._old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- counters --
    def link_counters(self) -> Dict[str, Dict[str, int]]:
        """Absolute tx/rx byte counters of each node's veth."""
        return {n.netns: self._net.counters(n.netns, n.ifname) for n in self.nodes}

    def link_bytes(self) -> Dict[str, Dict[str, int]]:
        """Bytes each node's veth sent and received during the last :meth:`run`."""
        return dict(self._last_bytes)

    def qdisc(self, node: Node) -> str:
        """``tc qdisc show`` of the node's veth: what shapes its outgoing traffic."""
        return self._net.tc_cmd("-n", node.netns, "qdisc", "show", "dev", node.ifname).stdout

    def leftover_pids(self) -> List[int]:
        """Live processes any run of this cluster started (empty after a clean run)."""
        return marked_processes(self.marker)

    # -- running a job --
    def torchrun_argv(self, node: Node, argv: Sequence[str], ranks_per_node: int, port: int) -> List[str]:
        head = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)),
                "--nproc-per-node", str(ranks_per_node), "--max-restarts", "0"]
        first = self.nodes[0].address
        if self.rendezvous == "static":
            head += ["--node-rank", str(node.index), "--master-addr", first, "--master-port", str(port)]
        else:
            # c10d: node 0 hosts the store; the shared host name cannot tell the nodes apart, so say it.
            head += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first}:{port}", "--rdzv-id", self.marker,
                     "--rdzv-conf", f"is_host={1 if node.index == 0 else 0}", "--local-addr", node.address]
        return head + list(argv)

    def run(self, argv: Sequence[str], timeout_s: float, ranks_per_node: Optional[int] = None,
            env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
            log_dir: Optional[str] = None) -> RunResult:
        """Run ``torchrun <options> argv`` on every node at once (``argv`` as torchrun takes it after its
        options, e.g. ``["-m", "hybrid.train", ...]``); past ``timeout_s`` every node is killed."""
        if self._net is None:
            raise ClusterError("the cluster is not up: use it as a context manager or call up() first")
        if not timeout_s > 0:  # nan too
            raise ClusterError(f"timeout_s={timeout_s}: give a positive number of seconds")
        ranks = ranks_per_node or self.ranks_per_node
        port = DEFAULT_PORT + self._runs  # a fresh port per run: the last run's sockets may linger
        self._runs += 1
        own_logs = log_dir is None
        log_path = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-run-") if own_logs else log_dir)
        log_path.mkdir(parents=True, exist_ok=True)
        try:
            return self._run(argv, timeout_s, ranks, port, env, cwd, log_path)
        finally:
            if own_logs:
                shutil.rmtree(log_path, ignore_errors=True)

    def _run(self, argv, timeout_s, ranks, port, env, cwd, log_path: Path) -> RunResult:
        # We hold the lock, so whatever still runs in the namespaces is a killed earlier run's.
        left = kill_netns_processes(self._net, [n.netns for n in self.nodes])
        if left:
            print(f"emulated_cluster: killed {left} processes an earlier run left in {self.prefix}-node*",
                  file=sys.stderr, flush=True)
        before = self.link_counters()
        start = time.monotonic()
        procs, logs, killed = [], [], {}
        try:
            for node in self.nodes:
                node_env = dict(os.environ, **(env or {}))
                node_env.update(GLOO_SOCKET_IFNAME=node.ifname, PYTHONUNBUFFERED="1", **{MARKER_ENV: self.marker})
                log = open(log_path / f"{node.netns}.log", "w")
                logs.append(log)
                procs.append(subprocess.Popen(
                    [self._net.ip, "netns", "exec", node.netns, *self.torchrun_argv(node, argv, ranks, port)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=node_env, cwd=cwd,
                    start_new_session=True))  # its own process group, so that a kill reaches the agent's group
            killed = self._wait(procs, start + timeout_s)
        finally:
            # Ctrl-C or an error while waiting: nothing of this run may outlive it.
            for k, proc in enumerate(procs):
                if proc.poll() is None:
                    self._kill_node(self.nodes[k], proc)
                    killed.setdefault(k, "interrupted")
            for log in logs:
                log.close()
            # Every agent has exited; a rank that outlived its agent would linger in the namespace.
            stray = kill_netns_processes(self._net, [n.netns for n in self.nodes])
            if stray:
                print(f"emulated_cluster: killed {stray} processes that outlived their node's torchrun agent",
                      file=sys.stderr, flush=True)
        wall = time.monotonic() - start
        after = self.link_counters()
        self._last_bytes = {ns: {key: after[ns][key] - before[ns][key] for key in after[ns]} for ns in after}
        results = []
        for k, (node, proc) in enumerate(zip(self.nodes, procs)):
            output = (log_path / f"{node.netns}.log").read_text(errors="replace")
            results.append(NodeResult(node, None if k in killed else proc.returncode, output, killed.get(k)))
        timed_out = any(why.startswith("timed out") for why in killed.values())
        return RunResult(results, self.link_bytes(), wall, timed_out)

    def _wait(self, procs: List[subprocess.Popen], deadline: float) -> Dict[int, str]:
        """Wait for every node until ``deadline``; kill the rest on timeout or soon after a node failed."""
        killed: Dict[int, str] = {}
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return killed
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            reason = None
            if now >= deadline:
                reason = "timed out"
            elif failed_at is not None and now - failed_at > FAILED_NODE_GRACE_S:
                reason = f"still running {FAILED_NODE_GRACE_S:.0f} s after another node failed"
            if reason is not None:
                for k, p in enumerate(procs):
                    if p.poll() is None:
                        self._kill_node(self.nodes[k], p)
                        killed[k] = reason
                return killed
            time.sleep(0.2)

    def _kill_node(self, node: Node, proc: subprocess.Popen) -> None:
        """SIGTERM the agent's process group and everything in the node's namespace, then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            # torchrun starts each rank in a session of its own: only the namespace finds them all.
            kill_pids(self._net.netns_pids(node.netns), sig)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                continue
            if not wait_gone(self._net.netns_pids(node.netns), KILL_GRACE_S):
                return


def remove_stale(prefix: str, net: Optional[Net] = None) -> List[str]:
    """Kill the processes in, and delete, every namespace named like this tool's for ``prefix``.

    Only ``<prefix>-node<K>`` and ``<prefix>-br`` are touched; deleting a namespace deletes its veth
    ends and bridge. Returns the namespaces deleted.
    """
    _check_prefix(prefix)
    net = net or Net()
    own = _own_netns_re(prefix)
    mine = [name for name in net.netns_list() if own.match(name)]
    kill_netns_processes(net, mine)
    for name in mine:
        net.ip_cmd("netns", "delete", name)
    try:
        os.unlink(_kept_marker(prefix))
    except FileNotFoundError:
        pass
    return mine


# ---- command line ------------------------------------------------------------------------------------
def _shape_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=None,
                   help="emulated nodes, default 2 (2: point to point; more: through a bridge)")
    p.add_argument("--rate", default="200mbit", help="tc tbf rate of every link end; 'none' leaves links unshaped")
    p.add_argument("--burst", default="256kb", help="tc tbf burst")
    p.add_argument("--queue-latency", default="50ms", help="tc tbf latency: how long a packet may queue")
    p.add_argument("--delay", default=None, help="one-way link delay (needs netem, absent on these machines)")


def _check_counts(nodes: int, ranks_per_node: int, names: Tuple[str, str] = ("nodes=", "ranks_per_node=")) -> None:
    """The cluster's size (``names``: how the two are spelled in the error, arguments or flags)."""
    if not MIN_NODES <= nodes <= MAX_NODES:
        raise ClusterError(f"{names[0]}{nodes}: an emulated cluster has {MIN_NODES} to {MAX_NODES} nodes")
    if ranks_per_node < 1:
        raise ClusterError(f"{names[1]}{ranks_per_node}: give at least 1")


def _check_args(args) -> None:
    """Refuse bad numeric flags before anything is looked up or built (ClusterError naming the flag)."""
    if args.command not in ("up", "run"):
        return
    ranks_per_node = args.ranks_per_node if args.command == "run" else 1
    _check_counts(2 if args.nodes is None else args.nodes, ranks_per_node, ("--nodes ", "--ranks-per-node "))
    if args.command == "run" and not args.timeout > 0:
        raise ClusterError(f"--timeout {args.timeout:g}: give a positive number of seconds")


def _cluster_kwargs(args) -> dict:
    return dict(nodes=2 if args.nodes is None else args.nodes, rate=None if args.rate == "none" else args.rate,
                burst=args.burst, queue_latency=args.queue_latency, delay=args.delay, prefix=args.prefix)


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix of the namespaces and links")
    sub = parser.add_subparsers(dest="command", required=True)
    _shape_flags(sub.add_parser("up", help="build the namespaces and shaped links, and leave them up"))
    run = sub.add_parser("run", help="run a torchrun job on every node (on the cluster `up` made, "
                                     "or on a temporary one)")
    _shape_flags(run)
    run.add_argument("--ranks-per-node", type=int, default=1)
    run.add_argument("--timeout", type=float, default=600.0, help="seconds before every node is killed")
    run.add_argument("--rendezvous", choices=("static", "c10d"), default="static")
    run.add_argument("--log-dir", default=None, help="keep each node's output here (tail -f while it runs)")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="after --: what torchrun runs, e.g. -m hybrid.train ...")
    sub.add_parser("down", help="kill what runs in the namespaces and delete them")
    return parser


def _cmd_run(args) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print("run: nothing to run; give the job after --, e.g. `run -- -m hybrid.train ...`", file=sys.stderr)
        return 2
    if is_up(args.prefix):
        cluster = EmulatedCluster.attach(args.prefix, ranks_per_node=args.ranks_per_node, rendezvous=args.rendezvous)
        if args.nodes is not None and args.nodes != len(cluster.nodes):
            cluster._lock.release()
            print(f"run: --nodes {args.nodes}, but the cluster that is up has {len(cluster.nodes)} nodes; "
                  f"drop --nodes or run `down` first", file=sys.stderr)
            return 2
        print(f"using the {len(cluster.nodes)}-node cluster {args.prefix!r} that is up", flush=True)
    else:
        cluster = EmulatedCluster(ranks_per_node=args.ranks_per_node, rendezvous=args.rendezvous,
                                  **_cluster_kwargs(args))
        print(f"bringing up a temporary {len(cluster.nodes)}-node cluster {args.prefix!r} for this run", flush=True)
    with cluster:
        if args.log_dir:
            print(f"node logs: {args.log_dir}/<namespace>.log", flush=True)
        result = cluster.run(argv, timeout_s=args.timeout, log_dir=args.log_dir)
    for n in result.nodes:
        for line in n.output.splitlines():
            print(f"[node{n.node.index}] {line}")
    print(result.describe())
    if result.timed_out:
        return 124
    return next((n.returncode or 1 for n in result.nodes if n.returncode != 0), 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _check_args(args)
        if args.command == "up":
            with EmulatedCluster(keep=True, **_cluster_kwargs(args)) as cluster:
                for node in cluster.nodes:
                    print(f"{node.netns}: {node.ifname} {node.address}/24")
                shaping = f"tbf rate {cluster.rate} burst {cluster.burst}" if cluster.rate else "unshaped"
                print(f"links: {shaping}; `down` removes them")
            return 0
        if args.command == "down":
            lock = _PrefixLock(args.prefix, timeout_s=120.0)
            lock.acquire()  # never pull a cluster from under a run that is using it
            try:
                with signals_blocked():
                    gone = remove_stale(args.prefix)
            finally:
                lock.release()
            print(f"removed {', '.join(gone)}" if gone else f"no emulated cluster {args.prefix!r} was up")
            return 0
        return _cmd_run(args)
    except LinkDelayUnavailable as e:
        print(f"emulated_cluster: {e}", file=sys.stderr)
        return 3
    except (ClusterUnavailable, ClusterError) as e:
        print(f"emulated_cluster: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("emulated_cluster: interrupted; the run's processes were killed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
