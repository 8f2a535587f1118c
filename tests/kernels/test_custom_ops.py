"""hybrid's kernels as torch.library custom ops (hybrid.kernels.library): opcheck on every
registered op's CPU path, and torch.compile(fullgraph=True) holding each op as one graph node
with the eager result.

The ops' CUDA path (the cuda_norm and cuda_quantize kernels behind the same ops) is compiled,
not run, on a machine without a GPU: tests/kernels/test_check_cuda.py compiles csrc/cuda;
test_opcheck_cuda runs the same opchecks on CUDA tensors where a GPU is present, and
benchmarks/gpu/check_kernels.py runs the kernels there.

The quantize ops run the compiled cpu_quantize kernel when it builds (the default test
environment builds it), the torch path otherwise; the norm ops run the torch formulas of the
kernels' contract on CPU tensors.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func

import hybrid.kernels as hk
from hybrid.kernels import library, ops
from hybrid.kernels import quantize as Q

# hybrid.kernels.layer_norm the module (the package exports a function of the same name).
LN = importlib.import_module("hybrid.kernels.layer_norm")
hybrid_ops = torch.ops.hybrid


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _norm_inputs(dtype=torch.float32, wdtype=None, seed=0):
    gen = _gen(seed)
    x = torch.randn(3, 4, 40, generator=gen).to(dtype)
    w = torch.randn(40, generator=gen).to(wdtype or dtype)
    b = torch.randn(40, generator=gen).to(wdtype or dtype)
    return x, w, b


def _forward_stats(x, w, b):
    _, mean, rstd = hybrid_ops.layer_norm_forward(x, w, b, 1e-5)
    return mean, rstd


def _wire(bits=4, block=64, rows=3, k=300):
    return Q.pack(torch.randn(rows, k, generator=_gen(1)), bits, block)


def _sample_inputs():
    """name -> list of argument tuples covering each op's cases (dtypes, optional bias, partial blocks)."""
    x, w, b = _norm_inputs()
    xb, wb32, _ = _norm_inputs(torch.bfloat16, torch.float32, seed=2)
    xbt = xb.transpose(0, 1)  # non-contiguous input: the outputs are contiguous, as the fakes say
    mean, rstd = _forward_stats(x, w, b)
    dy = torch.randn(x.shape, generator=_gen(3))
    _, rstd_b = hybrid_ops.rms_norm_forward(xb, wb32, 1e-6)
    grad = lambda *ts: tuple(t.clone().requires_grad_() for t in ts)  # noqa: E731
    return {
        "layer_norm_forward": [(*grad(x, w), None, 1e-5), (*grad(xbt, wb32, wb32), 1e-5)],
        "layer_norm_backward": [(dy, x, w, mean, rstd, True), (dy, x, w, mean, rstd, False)],
        "rms_norm_forward": [(*grad(x, w), 1e-6), (*grad(xb, wb32), 1e-6)],
        "rms_norm_backward": [(dy.to(torch.float32), xb, wb32, rstd_b)],
        "quantize_pack": [(torch.randn(3, 300, generator=_gen(4)), bits, block, True)
                          for bits, block in ((8, 64), (4, 64), (1, 24))]
                         + [(torch.randn(2, 100, generator=_gen(5)).bfloat16(), 8, 256, True),
                            (torch.randn(2, 100, generator=_gen(5)), 8, 64, False)],
        "quantize_unpack": [(_wire(bits, block), 300, bits, block, True) for bits, block in ((8, 64), (4, 64), (1, 24))]
                           + [(_wire(), 300, 4, 64, False)],
        "quantize_unpack_sum": [(_wire(bits, block), 300, bits, block, dtype, True)
                                for bits, block, dtype in ((8, 64, torch.float32), (4, 64, torch.bfloat16),
                                                           (1, 24, torch.float16))]
                               + [(_wire(), 300, 4, 64, torch.float32, False)],
    }


def test_every_registered_op_has_samples_and_lives_in_the_namespace():
    samples = _sample_inputs()
    # A new op without samples here would escape opcheck: the two sets must agree.
    assert set(library.REGISTERED) == set(samples)
    for name, op in library.REGISTERED.items():
        assert getattr(hybrid_ops, name).default is op._opoverload
        assert str(op._opoverload.namespace) == library.NAMESPACE


def _on(device, args):
    """The sample arguments moved to ``device`` (leaves that required grad still do)."""
    return tuple(a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the CUDA paths are compiled, not run, here")
@pytest.mark.parametrize("name", sorted(library.REGISTERED))  # every op; one without samples fails
def test_opcheck_cuda(name):
    """The same checks on CUDA tensors: the cuda_norm / cuda_quantize kernels behind the ops."""
    for args in _sample_inputs()[name]:
        result = torch.library.opcheck(library.REGISTERED[name], _on("cuda", args))
        assert all(v == "SUCCESS" for v in result.values()), (name, args, result)


@pytest.mark.parametrize("name", sorted(library.REGISTERED))  # every op; one without samples fails
def test_opcheck_cpu(name):
    """Schema, fake tensor (shapes, dtypes, strides), autograd registration and AOT dispatch
    with dynamic shapes, against the real CPU implementation."""
    op = library.REGISTERED[name]
    for args in _sample_inputs()[name]:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (name, args, result)
    if name.startswith("quantize") and ops.requirement_problem(ops.CPU_QUANTIZE) is None:
        assert "cpu_quantize" in hk.loaded_ops()  # the compiled kernel is what was checked


def test_opcheck_catches_a_wrong_fake():
    """The check the fakes pass is a real one: a fake with the wrong dtype fails it."""

    @torch.library.custom_op("hybrid_test::wrong_fake", mutates_args=())
    def wrong(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @wrong.register_fake
    def _(x):
        return x.new_empty(x.shape, dtype=torch.float64)

    with pytest.raises(Exception):
        torch.library.opcheck(wrong, (torch.randn(3),))


class GraphRecorder:
    """A torch.compile backend that records each graph's call targets and runs it as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def boxed(self, gm, example_inputs):  # AOTAutograd's calling convention
        return make_boxed_func(self(gm, example_inputs))

    def calls(self, target):
        return sum(g.count(target) for g in self.graphs)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.view(-1).view(torch.uint8))


def _codec_roundtrip(x, bits, block, out):
    wire = Q.pack(x, bits, block)
    back = Q.unpack(wire, x.shape[-1], bits, block)
    Q.unpack_sum(wire, x.shape[-1], bits, block, out=out)
    return wire, back * 2, out


@pytest.mark.parametrize("bits,block", [(8, 64), (4, 64), (1, 24)], ids=["int8", "int4", "1bit"])
def test_compiled_codec_is_one_graph_holding_the_ops_and_bit_identical(bits, block):
    torch._dynamo.reset()
    x = torch.randn(3, 300, generator=_gen(6)) * 1e3
    recorder = GraphRecorder()
    compiled = torch.compile(_codec_roundtrip, backend=recorder, fullgraph=True)
    got = compiled(x, bits, block, torch.empty(300, dtype=torch.bfloat16))
    want = _codec_roundtrip(x, bits, block, torch.empty(300, dtype=torch.bfloat16))
    assert len(recorder.graphs) == 1  # fullgraph: any break would have raised
    for op in (hybrid_ops.quantize_pack, hybrid_ops.quantize_unpack, hybrid_ops.quantize_unpack_sum):
        assert recorder.calls(op.default) == 1
    for g, w in zip(got, want):  # the same kernel runs in both: equal to the bit
        assert _same_bits(g, w)


def test_codec_and_norm_ops_trace_with_dynamic_shapes():
    """Under dynamic=True the row length, the block and the row count are symbols: the fakes
    compute the wire and output shapes from them, one graph serves every size."""
    torch._dynamo.reset()

    def fn(x, w, block):
        wire = Q.pack(x, 8, block)
        y = hybrid_ops.layer_norm_forward(x, w, None, 1e-5)[0]
        return wire, Q.unpack(wire, x.shape[-1], 8, block), Q.unpack_sum(wire, x.shape[-1], 8, block), y

    recorder = GraphRecorder()
    compiled = torch.compile(fn, backend=recorder, dynamic=True, fullgraph=True)
    for rows, k, block in ((3, 300, 64), (5, 513, 64), (2, 77, 32)):
        x, w = torch.randn(rows, k, generator=_gen(k)), torch.randn(k, generator=_gen(rows))
        got, want = compiled(x, w, block), fn(x, w, block)
        assert got[0].shape == (rows, Q.wire_bytes(k, 8, block))
        assert all(_same_bits(g, r) for g, r in zip(got, want))
    assert len(recorder.graphs) == 1


@pytest.mark.slow  # inductor's C++ compile: ~9 s on two cores
def test_codec_compiles_with_inductor_bit_identical():
    """Inductor calls the opaque op as an extern kernel: the same bits as eager."""
    torch._dynamo.reset()
    x = torch.randn(4, 520, generator=_gen(7))

    def fn(x):
        wire = Q.pack(x * 3, 8, 128)
        return wire, Q.unpack_sum(wire, x.shape[-1], 8, 128)

    got = torch.compile(fn, fullgraph=True)(x)
    want = fn(x)
    assert all(_same_bits(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_compiled_norm_ops_forward_and_backward_match_eager(rms):
    """Forward and the registered backward through AOTAutograd in one graph, equal to the bit."""
    torch._dynamo.reset()

    def fn(x, w, b):
        if rms:
            y = hybrid_ops.rms_norm_forward(x, w, 1e-6)[0]
        else:
            y = hybrid_ops.layer_norm_forward(x, w, b, 1e-5)[0]
        return (y * y).sum()

    x, w, b = _norm_inputs(seed=8)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    eager_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    recorder = GraphRecorder()
    compiled = torch.compile(fn, backend=torch._dynamo.backends.common.aot_autograd(
        fw_compiler=recorder.boxed, bw_compiler=recorder.boxed), fullgraph=True)
    loss = compiled(*leaves)
    loss.backward()
    want = fn(*eager_leaves)
    want.backward()
    forward_op = hybrid_ops.rms_norm_forward if rms else hybrid_ops.layer_norm_forward
    backward_op = hybrid_ops.rms_norm_backward if rms else hybrid_ops.layer_norm_backward
    assert recorder.calls(forward_op.default) == 1 and recorder.calls(backward_op.default) == 1
    assert torch.equal(loss, want)
    for got, ref in zip(leaves, eager_leaves):
        if ref.grad is None:  # rmsnorm takes no bias
            assert rms and got.grad is None
        else:
            assert torch.equal(got.grad, ref.grad)


def test_public_norms_compile_without_graph_breaks_on_cpu():
    """layer_norm()/rms_norm() decide the kernel without a registry call inside the graph
    (on CPU they are F.layer_norm and the reference formula)."""
    torch._dynamo.reset()
    x, w, b = _norm_inputs(seed=9)

    def fn(x, w, b):
        return hk.layer_norm(x, w, b, 1e-5) + hk.rms_norm(x, w, 1e-6)

    recorder = GraphRecorder()
    got = torch.compile(fn, backend=recorder, fullgraph=True)(x, w, b)
    assert len(recorder.graphs) == 1 and torch.equal(got, fn(x, w, b))


def test_fused_max_hidden_is_a_constant_to_dynamo(monkeypatch):
    """The kernel choice runs once, while tracing, not as a graph break per call."""
    torch._dynamo.reset()
    calls = []

    def fake_get(self, name):
        calls.append(name)
        return None

    monkeypatch.setattr(LN.default_registry().__class__, "get", fake_get)

    def fn(x):
        return x * LN._fused_max_hidden(0, False, True)

    recorder = GraphRecorder()
    compiled = torch.compile(fn, backend=recorder, fullgraph=True)
    for _ in range(3):
        assert torch.equal(compiled(torch.ones(2)), torch.zeros(2))
    assert calls == ["cuda_norm"] and len(recorder.graphs) == 1
