"""AssembledTensor (``state_dict(lazy=True)``): the same values as the eager assembly, copied once, live views."""

import torch

from hybrid.zero.assembled import AssembledTensor, assembled_or_copy


def test_an_assembled_tensor_equals_the_concatenation_and_reads_the_live_chunks():
    base = torch.arange(10, dtype=torch.float32)
    chunks = [base[0:3], base[5:9], base[9:10]]
    lazy = AssembledTensor.concat(chunks)
    assert lazy.shape == (8,) and lazy.dtype == torch.float32
    assert torch.equal(lazy.materialize(), torch.cat(chunks))
    eager = assembled_or_copy(lazy, lazy=False)
    base.mul_(-1)  # the lazy one reads the chunks when copied; the eager one was copied before
    out = torch.full((8,), 7.0, dtype=torch.float64)  # copy_into converts into any buffer
    lazy.copy_into(out)
    assert torch.equal(out, torch.cat(chunks).double()) and torch.equal(eager, -torch.cat(chunks))
    assert assembled_or_copy(lazy, lazy=True) is lazy
