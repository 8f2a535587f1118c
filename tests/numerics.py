"""Rounding-error bounds: where the tests' floating-point tolerances come from.

The same fp32 computation gives different bits on different x86-64 CPUs: MKL picks its GEMM
kernel (and with it the summation order) by CPU, ATen's vectorized kernels follow the CPU
capability (default / AVX2 / AVX-512), and tensor parallelism splits reductions over ranks and
adds the partial sums in yet another order. A tolerance that merely passed on one machine fails
on the next (issue 13). So the tests compare an fp32 result against a float64 evaluation of the
same computation and require ``|got - ref| <= bound``, the bound derived from the arithmetic:

* Sums. A sum of k terms evaluated in floating point in *any* order (any blocking, with or
  without FMA, partly on other ranks and then all-reduced) satisfies
  ``|fl(sum) - sum| <= gamma(k) * sum_i |term_i|``, ``gamma(k) = k u / (1 - k u)``, a rounded
  product counting as one more rounding of its term (Higham, *Accuracy and Stability of
  Numerical Algorithms*, 2nd ed., Lemma 3.1 and eq. (3.5)). A length-k dot product, a matmul
  entry or a k-way all-reduce is therefore within ``gamma(k) * sum_i |a_i b_i|`` of exact.
* Elementary functions (exp, log, erf, rsqrt, tanh, sigmoid) in ATen are accurate to a few ulp
  under every CPU capability (the vectorized ones are Sleef's 1-ulp variants or ATen's own
  polynomials). Measured over 6e6 points in [-12, 12] with the default and AVX2 kernels:
  exp, log, erf, rsqrt and SiLU under 2 u, GELU under 3 u, GELU's backward under 4.6 u.
  ``ELEMENTARY`` allows 8 u per function call.
* The float64 reference rounds too, 2^-29 as much as fp32; ``U = u32 + u64`` folds its error
  into the same bounds.
* Chains of ops propagate the bounds to first order (the ``*_err`` arguments); the neglected
  second-order terms are O((k u)^2), below 1e-9 relative at these sizes.

Worst-case bounds sit far above typical errors (which grow like sqrt(k) u, not k u), so they
fail only on a real mistake; yet they stay orders of magnitude below one: a wrong sign, a
missing all-reduce term or a misplaced scale gives relative errors of order 0.1.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding to nearest in ``dtype``."""
    return torch.finfo(dtype).eps / 2


U32 = unit_roundoff(torch.float32)
U64 = unit_roundoff(torch.float64)
U = U32 + U64  # one fp32 rounding plus the float64 reference's own
ELEMENTARY = 8  # roundings' worth of error allowed for one exp/log/erf/rsqrt/tanh call


def gamma(k: int, u: float = U) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of k successive roundings."""
    assert k * u < 1
    return k * u / (1 - k * u)


def _abs64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().double().abs()


def matmul_bound(a: torch.Tensor, b: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                 a_err: Optional[torch.Tensor] = None, b_err: Optional[torch.Tensor] = None,
                 u: float = U) -> torch.Tensor:
    """Elementwise bound on ``|fl(a @ b + bias) - (a @ b + bias)|`` (float64 tensor).

    ``a`` ``[..., m, k]``, ``b`` ``[..., k, n]``; the bias is one more term of each sum. Any
    summation order, any split of ``k`` over ranks. ``a_err`` / ``b_err`` bound errors the
    operands already carry from earlier ops (first-order propagation: ``a_err @ |b|``).
    """
    aa, bb = _abs64(a), _abs64(b)
    terms = aa @ bb
    if bias is not None:
        terms = terms + _abs64(bias)
    bound = gamma(a.shape[-1] + (bias is not None), u) * terms
    if a_err is not None:
        bound = bound + a_err.double() @ bb
    if b_err is not None:
        bound = bound + aa @ b_err.double()
    return bound


def sum_bound(x: torch.Tensor, dim, x_err: Optional[torch.Tensor] = None, u: float = U) -> torch.Tensor:
    """Elementwise bound on ``|fl(x.sum(dim)) - x.sum(dim)|``, in any order (an all-reduce too)."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    k = math.prod(x.shape[d] for d in dims)
    bound = gamma(max(k - 1, 0), u) * _abs64(x).sum(dims)  # k terms: k - 1 additions, no products
    if x_err is not None:
        bound = bound + x_err.double().sum(dims)
    return bound


def record(ratio: float) -> float:
    """Returns ``ratio``; with ``$NUMERICS_LOG`` set, also appends it there with the running test's id.

    The log is how the margins get compared across CPUs and ``ATEN_CPU_CAPABILITY`` settings
    (spawned ranks inherit the variable and report under the test that started them).
    """
    path = os.environ.get("NUMERICS_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{test}\t{ratio!r}\n")
    return ratio


def max_ratio(got: torch.Tensor, ref: torch.Tensor, bound) -> float:
    """``max |got - ref| / bound`` over the elements; the test passes while this is <= 1.

    A zero bound demands exact equality (0/0 counts 0, x/0 infinity). A shape mismatch or a
    NaN anywhere counts as infinitely wrong.
    """
    if tuple(got.shape) != tuple(ref.shape):
        return record(math.inf)
    err = (got.detach().double() - ref.detach().double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(err)
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    return record(torch.nan_to_num(ratio, nan=math.inf).max().item() if ratio.numel() else 0.0)


# A zero bound: data movement (scatter, gather, lookups, adding exact zeros) must not round.
EXACT = 0.0


# ---- cross entropy -----------------------------------------------------------------------------
def cross_entropy_bounds(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                         label_smoothing: float = 0.0,
                         grad_weight: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Bounds on the per-token loss ``[...]`` and its logits gradient ``[..., vocab_size]``.

    For :func:`hybrid.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy` in fp32 (any
    TP split) against the float64 ``F.cross_entropy`` of the same logits. ``logits`` are the
    exact inputs (fp32, or low precision widened); columns past ``vocab_size`` are padding.
    ``grad_weight`` ``[...]`` is the upstream gradient of each token's loss (e.g. mask/mask.sum()).

    Per token, with ``x_j = z_j - max z`` (one rounding each), ``M = max_j |x_j|`` and
    ``L = M + log V``, which bounds ``|x_t|``, ``log S`` and the loss itself:

    * ``exp(x_j)``: the function's own ELEMENTARY plus ``u M`` from its rounded argument;
      ``S = sum_j exp`` has positive terms, so its relative error is ``gamma(V) + ELEM + u M``,
      which is also ``log S``'s absolute error, plus ELEM relative to ``log S <= log V``.
    * ``loss = log S - x_t`` and the smoothing term ``log S - sum_j x_j / V`` (a V-term sum of
      magnitude <= V M) add ``gamma(V) eps M`` and a few roundings of size <= L.
      Altogether: ``(gamma(V) + ELEM) (1 + L) + 8 u L``.
    * Gradient ``(p_j - y_j) w``: ``p_j = exp / S`` has relative error
      ``gamma(V) + 2 (ELEM + u M) + u``; forming ``p - y``, subtracting ``eps / V`` (itself
      rounded), scaling by ``w`` and ``w``'s own error (two roundings) add ``6 u (p_j + y_j)``.
    """
    z = logits.detach().double()[..., :vocab_size]
    x = z - z.max(-1, keepdim=True).values
    big_m = x.abs().max(-1).values
    big_l = big_m + math.log(vocab_size)
    g_v, elem = gamma(vocab_size), ELEMENTARY * U
    loss_bound = (g_v + elem) * (1 + big_l) + 8 * U * big_l
    if grad_weight is None:
        return loss_bound, None
    p = x.softmax(-1)
    y = F.one_hot(target.long(), vocab_size).double() * (1 - label_smoothing) + label_smoothing / vocab_size
    rel_p = g_v + 2 * (elem + U * big_m) + U
    grad_bound = grad_weight.double().abs().unsqueeze(-1) * ((rel_p + 6 * U).unsqueeze(-1) * (p + y))
    return loss_bound, grad_bound


def masked_mean_bound(values: torch.Tensor, value_bounds: torch.Tensor, mask: Optional[torch.Tensor] = None
                      ) -> float:
    """Bound on ``fl(sum(v * m) / sum(m))`` for per-token ``values`` known to ``value_bounds``.

    The mask is 0/1 (its products and its sum are exact); the T-term sum adds
    ``gamma(T) sum|v m|`` and the division one rounding.
    """
    v, b = values.detach().double().flatten(), value_bounds.double().flatten()
    m = torch.ones_like(v) if mask is None else mask.double().flatten()
    count = m.sum()
    mean = (v * m).sum() / count
    return (((b * m).sum() + gamma(v.numel()) * (v * m).abs().sum()) / count + U * mean.abs()).item()


# ---- norms -------------------------------------------------------------------------------------
def layer_norm_bound(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                     out_dtype: torch.dtype = torch.float32, u: float = U) -> torch.Tensor:
    """Elementwise bound on torch's layer norm (fp32 statistics) against the float64 formula.

    ``x``, ``weight``, ``bias`` are the exact inputs (low precision widened exactly); the result
    is rounded to ``out_dtype``. With ``s = mean((|x| + |mean|)^2)`` per row of length h:

    * mean: ``gamma(3h) max|x|`` (a Welford or pairwise mean: at most ~3 roundings per element);
    * variance: ``gamma(4h) s``, covering the updating (Welford) algorithms, whose error is of
      order ``h u sqrt(var (var + mean^2))`` (Chan, Golub & LeVeque, Am. Stat. 37, 1983), and the
      textbook one-pass formula (``h u mean(x^2)``) alike;
    * rstd: half the variance's relative error plus ELEMENTARY for the rsqrt;
    * ``x * rstd - mean * rstd``: three roundings of size ``rstd (|x| + |mean|)``; then the
      weight and bias: two roundings of size ``|xhat w| + |b|``; then the cast to ``out_dtype``.
    """
    xd = x.detach().double()
    h = xd.shape[-1]
    mu = xd.mean(-1, keepdim=True)
    var = xd.var(-1, unbiased=False, keepdim=True)
    rstd = (var + eps).rsqrt()
    xhat = (xd - mu) * rstd
    e_mu = gamma(3 * h, u) * xd.abs().amax(-1, keepdim=True)
    e_var = gamma(4 * h, u) * (xd.abs() + mu.abs()).pow(2).mean(-1, keepdim=True)
    rel_rstd = e_var / (2 * (var + eps)) + ELEMENTARY * u
    e_xhat = rstd * (e_mu + 3 * u * (xd.abs() + mu.abs())) + xhat.abs() * rel_rstd
    w = torch.ones(h, dtype=torch.float64) if weight is None else weight.detach().double()
    b = torch.zeros(h, dtype=torch.float64) if bias is None else bias.detach().double()
    y = xhat * w + b
    e_y = w.abs() * e_xhat + 2 * u * ((xhat * w).abs() + b.abs())
    return e_y + unit_roundoff(out_dtype) * (y.abs() + e_y)


def rms_normed_bound(x: torch.Tensor, eps: float, u: float = U) -> torch.Tensor:
    """Elementwise bound on ``x.float() * rsqrt(mean(x.float()^2) + eps)`` in fp32 (before any cast).

    The mean of h squares has positive terms: ``gamma(h + 1)`` relative (squares, sum, divide);
    the rsqrt halves that and adds ELEMENTARY; the product adds one rounding.
    """
    xd = x.detach().double()
    h = xd.shape[-1]
    ms = xd.pow(2).mean(-1, keepdim=True)
    normed = xd * (ms + eps).rsqrt()
    rel = gamma(h + 1, u) / 2 + (ELEMENTARY + 1) * u
    return rel * normed.abs()


# ---- a whole model -------------------------------------------------------------------------------
def transformer_bound(cfg, tokens: int, *, part: str, dtype: torch.dtype = torch.float32) -> float:
    """Normwise bound on ``max|fl(t) - t| / max|t|`` for a GPTModel's ``part``.

    ``part``: ``"logits"``, ``"loss"`` or ``"grads"`` (each parameter's gradient after one
    backward of the loss over ``tokens`` tokens). ``dtype``: the model's dtype; RMSNorm and the
    cross entropy compute in fp32 whatever it is, and are costed at fp32.

    First-order error analysis: the computed result is the exact one with every op's output
    perturbed by that op's own rounding error, at most ``gamma(k)`` times the magnitude of its
    terms for a k-term reduction, ELEMENTARY for a function. In a pre-LN transformer every
    sub-layer reads a normalised (unit-scale) input and writes into the residual stream, and
    softmax, the norms and the residual adds do not amplify max-norm relative errors by more
    than O(1), so the perturbations add up: along the forward pass (and then the backward) the
    bound is u times the sum of the reduction lengths K. This is an estimate, not a proof: it
    assumes those O(1) gains are <= 1. The measured errors are at most 5e-3 of it
    (test_tp_parity, test_hf_parity, under the default and AVX2 kernels), which leaves room for
    the gains, while ``u K`` stays ~1e-4, far below the ~1e-1 of a bug.
    """
    if part not in ("logits", "loss", "grads"):
        raise ValueError(f"part must be logits, loss or grads, got {part!r}")
    u = unit_roundoff(dtype) + U64
    u_norm = U if cfg.norm == "rmsnorm" else u  # RMSNorm normalises in fp32 (Llama semantics)
    h, d, s, v, e = cfg.hidden_size, cfg.head_dim, cfg.seq_length, cfg.vocab_size, ELEMENTARY
    w = cfg.attention_width  # the output projection's input: h unless kv_channels sets the head dim
    f_out = cfg.ffn_size
    f_in = 2 * f_out if cfg.mlp == "swiglu" else f_out
    norm_fwd = 2 * h + e  # mean and variance (or the mean square), then rsqrt
    rope = 3 if cfg.position == "rope" else 0
    layer_fwd = (h + 1 + rope + (d + 1) + (s + 2 * e) + s + (w + 1) + 1  # qkv, rope, scores, softmax, context, out
                 + (h + 1) + (e + 1) + (f_out + 1) + 1)  # mlp in, activation, mlp out, residual
    qk_norm = 2 * d + e if cfg.qk_norm else 0  # the query/key norms over the head dim
    # their weight gradients sum over every token of every head
    qk_norm_bwd = qk_norm + tokens * cfg.num_heads if cfg.qk_norm else 0
    fwd = (cfg.num_layers * (layer_fwd * u + (2 * norm_fwd + qk_norm) * u_norm) + norm_fwd * u_norm
           + h * u)  # + final norm, head
    loss = (v + 2 * e + 8) * U  # cross entropy, always fp32
    # Backward: each matmul's input gradient sums over its output features, each weight
    # gradient over the tokens; the norms' backward has two h-term reductions.
    layer_bwd = (h + tokens + e + f_in + tokens  # mlp out, activation, mlp in
                 + h + tokens + d + s + s + s + s  # out proj; context (d, s); softmax; scores (s, s)
                 + 3 * max(h, w) + tokens + 2)  # qkv (at most 3 w output features), residuals
    bwd = (cfg.num_layers * (layer_bwd * u + (2 * norm_fwd + qk_norm_bwd) * u_norm) + (v + 2 * tokens) * u
           + norm_fwd * u_norm)
    if part == "logits":
        return fwd
    if part == "loss":
        return fwd + loss
    return fwd + loss + bwd


def linear_bounds(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], grad_y: torch.Tensor, *,
                  x_err: Optional[torch.Tensor] = None, grad_y_err: Optional[torch.Tensor] = None) -> dict:
    """Bounds for ``y = x @ weight.T + bias`` and, given the upstream ``grad_y``, its gradients.

    ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``grad_y`` ``[..., out]``; ``x_err`` and
    ``grad_y_err`` bound errors those already carry. Keys: ``y``, ``grad_x`` (sums over ``out``),
    ``grad_weight`` and ``grad_bias`` (sums over the tokens).
    """
    w = weight.detach().double()
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
    xe2 = None if x_err is None else x_err.reshape(x2.shape)
    ge2 = None if grad_y_err is None else grad_y_err.reshape(g2.shape)
    return {
        "y": matmul_bound(x, w.t(), bias=bias, a_err=x_err),
        "grad_x": matmul_bound(grad_y, w, a_err=grad_y_err),
        "grad_weight": matmul_bound(g2.t(), x2, a_err=None if ge2 is None else ge2.t(), b_err=xe2),
        "grad_bias": None if bias is None else sum_bound(g2, 0, ge2),
    }


# ---- optimizers ----------------------------------------------------------------------------------
class AdamBound:
    """Elementwise first-order bound on an fp32 Adam trajectory's distance from the float64 one.

    Attributes ``p``, ``m``, ``v``: the current bounds for the weights and the two moments.

    Each step, every state inherits its previous error (scaled as the update scales it) and adds
    its own roundings. No term of an update sees more than 4: e.g. ``(1 - beta2) * g * g`` is
    the square, the product, the fp32 rounding of the Python-double coefficient and the final
    add; a lerp's ``m + w * (g - m)`` is three plus the coefficient. ``c = 8 u`` of the magnitudes
    involved allows twice that, for kernels that order or fuse them differently. The gradient
    arrives exact (fp32 or widened bf16/fp16) but for one rounding when ``grad_scale`` multiplies
    it; L2 decay adds ``wd * p`` (and its error). The division by ``sqrt(v) + eps`` passes on m's
    error and half of v's relative error.
    """

    def __init__(self, n: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 adamw: bool = True):
        self.lr, self.beta1, self.beta2, self.eps, self.wd, self.adamw = lr, beta1, beta2, eps, weight_decay, adamw
        self.p, self.m, self.v = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
        self.m_prev, self.v_prev = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)

    def step(self, t: int, p_prev: torch.Tensor, grad: torch.Tensor, state: dict, scaled: bool) -> None:
        """Advance by step ``t`` of a float64 torch Adam/AdamW run: ``p_prev`` its weights before the
        step, ``grad`` the gradient it used, ``state`` its state after (``exp_avg``, ``exp_avg_sq``);
        ``scaled``: the fp32 run multiplied its gradient by a scale (one more rounding)."""
        c, lr, b1, b2, eps = 8 * U, self.lr, self.beta1, self.beta2, self.eps
        g, p_abs = grad.abs(), p_prev.abs()
        e_g = U * g if scaled else torch.zeros_like(g)
        if not self.adamw and self.wd:
            e_g = e_g + self.wd * self.p + U * (g + self.wd * p_abs)
            g = (grad + self.wd * p_prev).abs()
        m_new, v_new = state["exp_avg"], state["exp_avg_sq"]
        self.m = b1 * self.m + (1 - b1) * e_g + c * (self.m_prev.abs() + (1 - b1) * g)
        self.v = b2 * self.v + (1 - b2) * 2 * g * e_g + c * (self.v_prev + (1 - b2) * g * g)
        step_size, bc2 = lr / (1 - b1 ** t), 1 - b2 ** t
        denom = (v_new / bc2).sqrt() + eps
        update = step_size * m_new.abs() / denom
        e_denom = torch.where(v_new > 0, self.v / (2 * (v_new * bc2).sqrt()), torch.zeros_like(v_new)) + c * denom
        e_update = step_size * (self.m / denom + m_new.abs() * e_denom / denom ** 2) + c * update
        decay = 1 - lr * self.wd if self.adamw else 1.0
        self.p = decay * self.p + e_update + c * (p_abs + update)
        self.m_prev, self.v_prev = m_new.clone(), v_new.clone()


ADAM_NOISE_FRACTION = 1e-2


def adam_trajectory_tolerance(steps: int, lr: float, fraction: float = ADAM_NOISE_FRACTION) -> float:
    """Absolute bound on how far two Adam runs that differ only in summation order can drift apart.

    The bounds above carry rounding through arithmetic that is stable; Adam is not: it divides
    each gradient element by that element's own running RMS, so an element whose gradient nearly
    cancels (its terms sum to far less than their absolute values) turns a rounding difference of
    ``gamma(k) * sum|terms|`` into a visible fraction of its step. Its step is at most about
    ``lr`` (``|m_hat / sqrt(v_hat)| <= 1`` at the first step and of order one after it), so over
    ``steps`` steps no element can move more than about ``steps * lr`` in all. The tolerance is
    ``fraction`` of that distance: it scales with what the optimizer can do, not with one CPU's
    rounding (the largest seen, under ATen's default and AVX2 kernels, was 8.5e-4 of it), and it
    stays two orders below what a real mistake does (a dropped micro-batch or a wrong scale
    changes every element's update by a fraction of ``lr`` at every step).
    """
    return fraction * steps * lr
