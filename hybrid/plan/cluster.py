"""The machine a plan is made for, and the assumptions of the step-time model.

Everything here comes from command-line flags (see ``python -m hybrid.plan
--help``); the defaults describe a DGX-2-like node of 16 × V100 32 GB, the
hardware of the Turing-NLG 17B run:

* compute: ``peak_tflops`` 125 (V100 fp16 tensor cores) at ``mfu`` 0.35 of
  it, or ``achieved_tflops`` per GPU when given (measured or known; it
  overrides peak × MFU);
* ``intra_node_gbps`` 150 GB/s per GPU (NVLink/NVSwitch): each GPU's link to
  the others of its node, used by rings (TP, DP, world) where the next rank
  is on the same node;
* ``inter_node_gbps`` 100 GB/s per *node* (8 × 100 Gb/s InfiniBand): the
  node's link to the other nodes, shared by all of its GPUs, so the time of
  inter-node traffic is what the whole node sends off it over this bandwidth
  (:mod:`hybrid.plan.links`);
* ``latency_s`` 0: seconds per ring step of every collective call
  (:class:`hybrid.plan.links.LinkSpec`);
* ``pcie_gbps`` 12 GB/s per GPU host link (offload traffic);
* ``cpu_adam_rate`` 1e9 parameters per second per node for the CPU Adam step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from hybrid.plan.links import HostLink, LinkSpec, Placement

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ClusterError(ValueError):
    """A cluster flag that cannot describe a machine."""


def parse_size(text: str, flag: str = "size") -> int:
    """``"32GiB"``, ``"32 GB"``, ``"512MiB"`` or a plain byte count -> bytes.

    GB/MB are powers of ten and GiB/MiB powers of two, as usual; a GPU sold as
    "32 GB" has 32 GiB of memory, so write ``32GiB`` for it.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ClusterError(f"{flag}: cannot read {text!r} as a memory size; write a number with an optional "
                           f"unit such as 32GiB, 80GB or 512MiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ClusterError(f"{flag}: memory size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB)."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``gpus`` devices, ``gpus_per_node`` to a node, ``gpu_memory`` bytes each, and the speed assumptions.

    ``cpu_memory``: host memory per node in bytes (None: not checked).
    ``reserved_memory``: bytes per device that training cannot use (CUDA
    context, communication library buffers).
    """

    gpus: int
    gpus_per_node: int
    gpu_memory: int
    cpu_memory: Optional[int] = None
    reserved_memory: int = 2**30
    peak_tflops: float = 125.0
    mfu: float = 0.35
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 100.0
    pcie_gbps: float = 12.0
    cpu_adam_rate: float = 1e9
    latency_s: float = 0.0
    achieved_tflops: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ClusterError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node != 0:
            raise ClusterError(f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node "
                               f"{self.gpus_per_node}; use a multiple of {self.gpus_per_node}")
        if self.gpu_memory <= self.reserved_memory:
            raise ClusterError(f"--gpu-memory ({format_bytes(self.gpu_memory)}) must exceed --reserved-memory "
                               f"({format_bytes(self.reserved_memory)})")
        for name in ("peak_tflops", "intra_node_gbps", "inter_node_gbps", "pcie_gbps", "cpu_adam_rate"):
            if not getattr(self, name) > 0:
                raise ClusterError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.mfu <= 1:
            raise ClusterError(f"--mfu must be in (0, 1], got {self.mfu!r}")
        if self.achieved_tflops is not None and not self.achieved_tflops > 0:
            raise ClusterError(f"--achieved-tflops must be > 0, got {self.achieved_tflops!r}")
        if not 0 <= self.latency_s < float("inf"):
            raise ClusterError(f"--latency must be a finite number of seconds >= 0, got {self.latency_s!r}")

    @property
    def node_size(self) -> int:
        """GPUs that share a node's fast links (all of them when the cluster is smaller than a node)."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def usable_memory(self) -> int:
        return self.gpu_memory - self.reserved_memory

    @property
    def flops_per_s(self) -> float:
        """FLOP/s one GPU achieves: ``achieved_tflops`` when given, else ``peak_tflops × mfu``."""
        tflops = self.achieved_tflops if self.achieved_tflops is not None else self.peak_tflops * self.mfu
        return tflops * 1e12

    @property
    def link(self) -> LinkSpec:
        return LinkSpec(intra_bytes_per_s=self.intra_node_gbps * 1e9,
                        inter_bytes_per_s_per_node=self.inter_node_gbps * 1e9, latency_s=self.latency_s)

    @property
    def host(self) -> HostLink:
        return HostLink(bytes_per_s=self.pcie_gbps * 1e9, cpu_adam_params_per_s=self.cpu_adam_rate / self.node_size)

    def placement(self, tp: int, dp: int, pp: int = 1, ep: int = 1) -> Placement:
        """The ``tp × dp`` ranks of one pipeline stage (every GPU when ``pp`` is 1) on this cluster's nodes. The
        rank order puts the pipeline outermost: a stage fills whole nodes, or several stages share one node
        (:func:`stage_fits_nodes`)."""
        if pp == 1:
            return Placement(tp=tp, dp=dp, nodes=self.nodes, ranks_per_node=self.node_size, ep=ep)
        stage = tp * dp
        problem = stage_fits_nodes(stage, self.node_size)
        if problem:
            raise ClusterError(problem)
        if stage % self.node_size == 0:
            return Placement(tp=tp, dp=dp, nodes=stage // self.node_size, ranks_per_node=self.node_size, ep=ep)
        return Placement(tp=tp, dp=dp, nodes=1, ranks_per_node=stage, ep=ep)

    def describe(self) -> str:
        host = f", {format_bytes(self.cpu_memory)} host memory per node" if self.cpu_memory else ""
        return (f"{self.gpus} GPUs ({self.nodes} node(s) of {self.node_size}), "
                f"{format_bytes(self.gpu_memory)} each ({format_bytes(self.reserved_memory)} reserved){host}")

    def assumptions(self) -> str:
        if self.achieved_tflops is not None:
            compute = f"compute {self.achieved_tflops:g} TFLOP/s achieved per GPU"
        else:
            compute = f"compute {self.peak_tflops:g} TFLOP/s peak at MFU {self.mfu:g}"
        latency = f", {self.latency_s:g} s per ring step" if self.latency_s else ""
        return (f"{compute}; links {self.intra_node_gbps:g} GB/s per GPU inside a node, "
                f"{self.inter_node_gbps:g} GB/s per node between nodes{latency}; host link "
                f"{self.pcie_gbps:g} GB/s; CPU Adam {self.cpu_adam_rate:.3g} parameters/s per node")


def stage_fits_nodes(stage_ranks: int, node_size: int) -> Optional[str]:
    """Why a pipeline stage of ``stage_ranks`` ranks cannot be placed on nodes of ``node_size`` (None when it
    can): it must fill whole nodes or divide one."""
    if stage_ranks % node_size and node_size % stage_ranks:
        return (f"a pipeline stage of {stage_ranks} ranks (tp x dp) neither fills whole nodes of {node_size} GPUs "
                f"nor divides one; choose pipeline sizes that keep tp x dp a multiple or a divisor of the node")
    return None
