"""hybrid.compile_marks: marks for torch.compile that leave torch._dynamo unimported until something compiles."""

import subprocess
import sys

import torch

from hybrid import compile_marks


def test_importing_hybrid_does_not_import_dynamo():
    # ~70 MB of resident memory per rank, for jobs that never compile
    code = ("import sys, hybrid, model_zoo, hybrid.zero.stage3, hybrid.context_parallel, model_zoo.moe, "
            "hybrid.kernels, hybrid.training.trainer; print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]


CALLS = []


@compile_marks.eager
def _untraceable(x, k):
    CALLS.append(k)  # a side effect a trace would not replay
    return x * k if x.sum().item() > -1e30 else x  # data-dependent: dynamo cannot trace it without a break


def _two_calls(x):
    x = _untraceable(torch.sin(x), 2)
    return _untraceable(torch.cos(x), 3).exp()


def test_an_eager_mark_runs_eagerly_as_one_break_under_compile_without_recompiles():
    from torch._dynamo.utils import counters

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    compile_marks.prepare()
    counters.clear()
    compiled = torch.compile(_two_calls, backend=backend)
    x = torch.randn(5)
    for _ in range(3):
        CALLS.clear()
        torch.testing.assert_close(compiled(x), (torch.cos(torch.sin(x) * 2) * 3).exp())
        assert CALLS == [2, 3]  # each call ran, eagerly, every time
    # the function up to each marked call, and after the last: 3 graphs, one break per marked call, no recompile
    assert len(graphs) == 3 and sum(counters["graph_break"].values()) == 2
    assert not counters["recompiles"], dict(counters["recompiles"])
