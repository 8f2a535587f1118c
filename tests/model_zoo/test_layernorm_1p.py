"""--apply-layernorm-1p (GPTConfig.apply_layernorm_1p, Megatron's zero-centred gamma): every norm stores its weight
as gamma - 1, drawn as zeros, and scales by 1 + weight.

The reference is the plain model whose norm weights are the 1 + w the 1p model computes: the same float64
arithmetic on the same values, so the loss and every gradient must agree bit for bit (1 + w is formed once, as
the reference's weight is; the gradient through the add is the identity).
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid.tensor_parallel.norms import LayerNorm, RMSNorm
from hybrid.topology import Topology
from model_zoo import GPTConfig, GPTModel
from tests.numerics import U64, layer_norm_bound, max_ratio


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, seq_length=8, init_std=0.2)
    base.update(kw)
    return GPTConfig(**base)


@pytest.mark.parametrize("kw", [dict(norm="layernorm"), dict(norm="rmsnorm", qk_norm=True, bias=False)],
                         ids=["layernorm", "rmsnorm+qk_norm"])
def test_1p_model_equals_the_plain_model_with_weight_plus_one(kw):
    one_p = GPTModel(_cfg(apply_layernorm_1p=True, **kw), Topology.local(), seed=3, dtype=torch.float64)
    norms = {n for n, m in one_p.named_modules() if isinstance(m, (LayerNorm, RMSNorm))}
    assert len(norms) == 2 * 2 + 1 + (4 if kw.get("qk_norm") else 0)  # every norm of the model is zero-centred
    for n in norms:
        assert torch.count_nonzero(one_p.get_submodule(n).weight) == 0  # drawn as zeros: the scale starts at 1
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the weights off zero, so that "1 +" and "as stored" differ
        for n in norms:
            one_p.get_submodule(n).weight.uniform_(-0.5, 0.5, generator=g)
    plain = GPTModel(_cfg(**kw), Topology.local(), seed=3, dtype=torch.float64)
    state = {k: (v + 1 if k.rsplit(".", 1)[0] in norms and k.endswith(".weight") else v)
             for k, v in one_p.state_dict().items()}
    plain.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    labels = torch.randint(0, 64, (2, 8), generator=g)
    loss_1p, loss_plain = one_p(ids, labels), plain(ids, labels)
    loss_1p.backward()
    loss_plain.backward()
    assert torch.equal(loss_1p, loss_plain)
    wrong = GPTModel(_cfg(**kw), Topology.local(), seed=3, dtype=torch.float64)
    wrong.load_state_dict(one_p.state_dict())  # the weights as stored, without the 1: another loss
    assert not torch.allclose(wrong(ids, labels), loss_plain)
    grads = dict(plain.named_parameters())
    for name, p in one_p.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name


def test_1p_norm_is_the_textbook_formula():
    """LayerNorm with zero-centred weight: (x - mean) / sqrt(var + eps) * (1 + w) + b (torch's layer_norm)."""
    g = torch.Generator().manual_seed(1)
    norm = LayerNorm(16, Topology.local(), zero_centered=True, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5, generator=g)
        norm.bias.uniform_(-0.5, 0.5, generator=g)
    x = torch.randn(4, 2, 16, dtype=torch.float64, generator=g)
    gain = 1 + norm.weight.detach()
    ref = F.layer_norm(x, (16,), gain, norm.bias.detach(), norm.eps)
    # both float64 layer norms, each within layer_norm_bound of the exact formula: of each other within twice it
    bound = layer_norm_bound(x, gain, norm.bias.detach(), norm.eps, out_dtype=torch.float64, u=U64)
    assert max_ratio(norm(x), ref, 2 * bound) <= 1


@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
def test_hf_export_adds_one_and_the_import_gives_the_same_logits(tmp_path, kind):
    """A zero-centred model exports its norm weights as 1 + w (Hugging Face's norms store gamma), so transformers
    computes its logits; importing back gives a plain model (apply_layernorm_1p false) with the same logits."""
    transformers = pytest.importorskip("transformers")
    from hybrid.convert.hf import export_to_hf, import_from_hf
    from tests.convert.common import GPT2_CFG, QWEN3_CFG, randomized_state, write_weights_checkpoint
    from tests.convert.test_hf import _checkpoint_state, _hybrid_logits, _rel, _tokens, TOL

    cfg = (GPT2_CFG if kind == "gpt2" else QWEN3_CFG).replace(apply_layernorm_1p=True)
    state = randomized_state(cfg, seed=4)  # norm weights near 1: as gamma - 1 they scale by about 2
    write_weights_checkpoint(tmp_path / "ck", cfg, state, 1)
    res = export_to_hf(tmp_path / "ck", tmp_path / "hf")
    hf = getattr(transformers, res.architecture).from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ref = hf(input_ids=_tokens()).logits
    ours = _hybrid_logits(cfg, state)
    assert _rel(ours, ref) < TOL
    assert _rel(_hybrid_logits(cfg.replace(apply_layernorm_1p=False), state), ref) > 100 * TOL  # the 1 matters
    back = import_from_hf(tmp_path / "hf", tmp_path / "back")
    plain = cfg.replace(apply_layernorm_1p=False)
    back_state = _checkpoint_state(back)
    assert _rel(_hybrid_logits(plain, back_state), ours) < TOL
