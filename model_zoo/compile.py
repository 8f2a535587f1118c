"""Regional compilation: each transformer block of a :class:`~model_zoo.gpt.GPTModel` through ``torch.compile``.

``compile_blocks(model)`` compiles :meth:`TransformerLayer.forward <model_zoo.transformer.TransformerLayer.forward>`
once, as a function of the block (its parameters are graph inputs: dynamo's ``inline_inbuilt_nn_modules``), and
points every block's ``forward`` at that one compiled function. Every block of a model has the same structure and
shapes, so the first block's graph serves all of them: compile time does not grow with depth, and a block whose
guards fail (another shape, another structure) is a recompile that :class:`CompileReport` counts. ``dynamic=False``:
the shapes of a run are fixed (its micro-batch and sequence length), and static shapes give inductor the most room.

The tensor-parallel collectives inside a block (the all-reduces, sequence parallelism's all-gathers and
reduce-scatters) trace as functional collectives (:mod:`hybrid.tensor_parallel.traceable`), so a dense block under
ZeRO 0-2 is one graph with no break at any TP size; :class:`_Counted`, the eager wrapper each block's ``forward``
points at, has the communicator count them as an eager run does.

What stays outside the graphs, and why: the block's own module hooks run eagerly around the compiled ``forward``
(``nn.Module.__call__`` runs them, then calls ``forward``), and so does everything between blocks (the embedding,
the loss, the pipeline's transfers). Inside a block, what dynamo cannot trace is marked ``@eager``
(:mod:`hybrid.compile_marks`, ``torch.compiler.disable`` once :func:`compile_blocks` arms it) where it is defined,
so that each call is one graph break with nothing beneath it traced:

* ZeRO-3's gathers, from the hooks of the block's linear layers (:class:`hybrid.zero.param_gather.ParamGatherer`'s
  ``module_pre``, ``module_post`` and ``read``);
* selective recompute's checkpoint of the attention core (:func:`hybrid.tensor_parallel.random.checkpoint`: its
  RNG-replay context is a closure dynamo's checkpoint operator does not take): the core runs eagerly under the
  checkpoint, as without compilation. Full recompute checkpoints the whole compiled block from outside
  (``GPTModel.forward_part``) and adds no break.
* an MoE layer's routed experts (:meth:`model_zoo.moe.MoELayer._routed_experts`: the balancing losses, capacity,
  the data-dependent dispatch and its all-to-all over ``"ep"``, the routing statistics); the router before it and a
  shared expert after it stay compiled;
* context-parallel attention (:func:`hybrid.context_parallel.context_parallel_attention`, ring or all-to-all, with
  the document ids it is given).

A break inside a module the block calls (the MoE layer, the attention) is counted again in the module's own frame,
which dynamo compiles separately once the block's frame stops at the module's call.

The graph and break counts of each layout are measured and held by ``tests/compile/`` (docs/compile.md lists
them); none grows with depth.

The inductor cache (the FX graph cache: a warm start compiles nothing again) lives where
:func:`use_cache_dir` points it, before the first compile.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Dict, List, Optional

import torch
import torch.utils.checkpoint

from hybrid import compile_marks
from hybrid.tensor_parallel import traceable

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor reads its cache folder from here at each compile


def use_cache_dir(path: Optional[str]) -> Optional[str]:
    """Point inductor's caches (the FX graph cache among them) at ``path`` (created), before anything compiles;
    None leaves inductor's default (``$TORCHINDUCTOR_CACHE_DIR`` or a folder under the temporary directory).
    Returns the folder in use."""
    if path is not None:
        os.makedirs(path, exist_ok=True)
        os.environ[CACHE_ENV] = os.path.abspath(path)
    return os.environ.get(CACHE_ENV)


def default_cache_dir(cache_dir: Optional[str], save_dir: Optional[str]) -> Optional[str]:
    """The trainer's cache folder: ``model.compile_cache_dir`` when given, else ``compile-cache`` under the run's
    ``checkpoint.save`` (a resumed run finds it there), else None (inductor's default)."""
    if cache_dir is not None or save_dir is None:
        return cache_dir
    return os.path.join(save_dir, "compile-cache")


@dataclasses.dataclass
class CompileReport:
    """What :func:`compile_blocks` compiled, and what compiling cost so far (dynamo's process-wide counters, less
    their values when it was called)."""

    blocks: int
    backend: str
    cache_dir: Optional[str]
    _start: Dict[str, float]

    @staticmethod
    def _now() -> Dict[str, float]:
        from torch._dynamo.utils import calculate_time_spent, counters

        return {"graphs": counters["stats"]["unique_graphs"],
                "breaks": sum(counters["graph_break"].values()),
                "seconds": calculate_time_spent().get("total_wall_time", 0.0)}

    def figures(self) -> Dict[str, float]:
        """``graphs`` (distinct graphs compiled), ``breaks`` (graph breaks met while compiling), ``seconds`` (dynamo's
        and inductor's compile time, forward and backward) since :func:`compile_blocks`."""
        now = self._now()
        return {k: now[k] - self._start[k] for k in ("graphs", "breaks", "seconds")}

    def line(self) -> str:
        f = self.figures()
        cache = f", cache {self.cache_dir}" if self.cache_dir else ""
        return (f"torch.compile: {self.blocks} transformer blocks as one compiled function ({self.backend}): "
                f"{int(f['graphs'])} graph(s), {int(f['breaks'])} graph break(s), "
                f"{f['seconds']:.1f} s compiling{cache}")


def compile_blocks(model, *, backend: str = "inductor", cache_dir: Optional[str] = None) -> CompileReport:
    """Compile ``model``'s transformer blocks (a :class:`~model_zoo.gpt.GPTModel`, this pipeline stage's blocks)
    in place: one ``torch.compile`` of ``TransformerLayer.forward``, bound to each block. Call it before the first
    forward."""
    from model_zoo.transformer import TransformerLayer

    topo = model.topology
    cache = use_cache_dir(cache_dir)
    compile_marks.prepare()  # hybrid's eager-only functions, marked without importing dynamo: armed now
    # The tensor-parallel mappings trace as one autograd function (hybrid.tensor_parallel.traceable), which
    # AOTAutograd's cache refuses by default: without this a warm start traces every block's forward and backward
    # again. Its forward and backward are graphs dynamo traced, so the cache key holds them.
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    compiled = torch.compile(TransformerLayer.forward, backend=backend, dynamic=False)
    forward = _Counted(compiled, topo)
    blocks = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for block in blocks:
        block.forward = types.MethodType(forward, block)
    return CompileReport(len(blocks), backend, cache, CompileReport._now())


# Raised by torch.utils.checkpoint (non-reentrant, early stop: the default) inside a replay once it has the tensors
# it needs back; in a compiled block that is after the whole graph ran.
_STOP_RECOMPUTATION = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


class _Counted:
    """A compiled ``TransformerLayer.forward`` whose collectives ``topo``'s communicator counts as it counts its
    own (:mod:`hybrid.tensor_parallel.traceable`): the forward ones after each call, the backward ones when the
    gradient of the block's output arrives (once per backward, whatever replays the block)."""

    def __init__(self, compiled, topo):
        self.compiled, self.topo = compiled, topo
        self.forward: List[traceable.Note] = []  # the last complete call's forward collectives

    def __call__(self, block, *args, **kwargs):
        try:
            out = self.compiled(block, *args, **kwargs)
        except _STOP_RECOMPUTATION:
            # A full-recompute replay that checkpoint stopped early ran every forward collective of the graph, but
            # dynamo's replayed notes come after the graph returns: count the block's forward ones as last noted.
            traceable.count(self.topo.comm, self.forward)
            raise
        forward, backward = traceable.drain()
        traceable.count(self.topo.comm, forward)
        self.forward = forward
        if backward and out.requires_grad:
            out.register_hook(lambda grad: traceable.count(self.topo.comm, backward))
        return out
