"""The plumbing under :mod:`tools.emulated_cluster`: ip/tc commands with timeouts, and the processes a cluster starts.

Nothing here knows the cluster's layout (names, addresses, shaping): it runs ``ip``/``tc``,
reads interface counters, finds and ends processes, and defers signals during teardown.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Dict, List, Sequence

MARKER_ENV = "HYBRID_EMULATED_CLUSTER"  # inherited by every process a run starts: finds leftovers
IP_TIMEOUT_S = 30.0  # one ip/tc command; they return in milliseconds unless the kernel is stuck
KILL_GRACE_S = 10.0  # SIGTERM to SIGKILL


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (no root, no iproute2, no namespaces); one line why."""


class LinkDelayUnavailable(ClusterUnavailable):
    """A link delay was asked for and ``netem`` is not in this kernel."""


class ClusterError(RuntimeError):
    """An ip/tc command failed, the cluster is in use elsewhere, or a run was misconfigured."""


# ---- ip and tc ---------------------------------------------------------------------------------------
def find_ip() -> str:
    found = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)
    if found is None:
        raise ClusterUnavailable("iproute2's `ip` is not installed: install it with `apt-get install -y iproute2`")
    return found


def run_cmd(argv: Sequence[str], timeout_s: float = IP_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(argv)}` did not return within {timeout_s:.0f} s") from None
    if check and done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[-1]
        raise ClusterError(f"`{' '.join(argv)}` failed: {why}")
    return done


class Net:
    """The ip/tc commands the cluster needs, each bounded by a timeout."""

    def __init__(self):
        self.ip = find_ip()
        tc = shutil.which("tc") or os.path.join(os.path.dirname(self.ip), "tc")
        if not os.access(tc, os.X_OK):
            raise ClusterUnavailable("iproute2's `tc` is not installed: install it with `apt-get install -y iproute2`")
        self.tc = tc

    def ip_cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_cmd([self.ip, *args], check=check)

    def tc_cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_cmd([self.tc, *args], check=check)

    def netns_list(self) -> List[str]:
        out = self.ip_cmd("netns", "list").stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def netns_pids(self, netns: str) -> List[int]:
        done = self.ip_cmd("netns", "pids", netns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    def counters(self, netns: str, ifname: str) -> Dict[str, int]:
        stats = f"/sys/class/net/{ifname}/statistics"
        out = self.ip_cmd("netns", "exec", netns, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes").stdout.split()
        return {"tx_bytes": int(out[0]), "rx_bytes": int(out[1])}


# ---- processes ---------------------------------------------------------------------------------------
def kill_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: Sequence[int], timeout_s: float) -> List[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


def marked_processes(marker: str) -> List[int]:
    """Pids of live processes whose environment carries ``MARKER_ENV=marker`` (started by one cluster)."""
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read() + b"\0"
        except OSError:
            continue
        if (b"\0" + needle) in (b"\0" + environ) and alive(int(entry)):
            found.append(int(entry))
    return found


class signals_blocked:
    """Defer SIGINT/SIGTERM/SIGHUP while tearing down, so a second Ctrl-C cannot leave half a cluster."""

    _SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.pthread_sigmask(signal.SIG_BLOCK, self._SIGNALS)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old)


def kill_netns_processes(net: Net, namespaces: Sequence[str]) -> int:
    """SIGTERM, then SIGKILL, every process in ``namespaces``; returns how many there were."""
    first = [pid for name in namespaces for pid in net.netns_pids(name)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for name in namespaces for pid in net.netns_pids(name)]
        if not pids:
            break
        kill_pids(pids, sig)
        if not wait_gone(pids, KILL_GRACE_S):
            break
    return len(first)
