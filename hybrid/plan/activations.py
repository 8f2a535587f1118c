"""Activation memory of the model_zoo GPT: the bytes autograd keeps for backward.

Every term below is a tensor that this implementation saves (measured with
``hybrid.plan.measure.SavedActivations``; ``tests/plan`` checks the formula
against the measurement for every switch). Symbols, per micro-batch on one
rank: ``N = s * b`` tokens, hidden ``h``, MLP width ``f``, heads ``a``,
head dim ``d``, TP size ``t``, ``r = 1/t`` under sequence parallelism else 1,
``p`` bytes per activation element (the parameter dtype), ``V'`` the padded
vocabulary per TP rank, ``m`` bytes per dropout-mask element.

Per layer, no recomputation::

    norm block (x2)   LayerNorm: p*N*h*r (input) + 2*q*N*r (mean, rstd) + p*N*h (the next
                      linear's input: the norm output, or under SP the gathered [s, b, h])
                      RMSNorm, fused: p*N*h*r + 4*N*r + p*N*h
                      RMSNorm, reference (fp32 maths): 4*N*h*r + 4*N*r + p*N*h*r + p*N*h
    attention         with ``g`` key/value heads per rank (``a/t`` without grouped-query attention;
                      model_zoo.qkv_layout) and ``k = N*d*g`` their elements (here ``h`` stands
                      for the attention width ``a*d``, the hidden size unless kv_channels sets d):
                      flash kernel: qkv p(Nh/t + 2k) [+ rotated q, k p(Nh/t + k) with RoPE] + out pNh/t
                      + log-sum-exp 4*N*a/t
                      math kernel (CPU with attention dropout; computes in fp32): fp32 copies of
                      q, k, v 12Nh/t, k and v expanded to every query head under grouped-query
                      attention (with b = 1, fp32 and no grouping, v stays a view of qkv: 20Nh/t),
                      output pNh/t, and 12 * b * (a/t) * s^2 (fp32 probabilities, dropout
                      mask, dropped probabilities)
    query/key norms   (qk_norm) over R = N(a/t + g) heads of d: fused pRd (a contiguous copy) + 4R rstd
                      (8R with LayerNorm's mean); RMSNorm reference 4Rd fp32 copy (none in fp32: the qkv view)
                      + 4R + pRd; torch's LayerNorm 2qR (its input is the qkv view). Without RoPE the flash
                      kernel keeps the normalised heads too, pRd; under the math kernel a norm keeping the qkv
                      view keeps the qkv output, unless the attention terms count it already
    MLP               GELU 2pNf/t (pre- and post-activation); SwiGLU 4pNf/t; on an MoE layer the
                      router, the routed tokens at their experts, the combine and the shared expert
                      instead (hybrid.plan.moe.moe_layer_activation_bytes: balanced loads, or the
                      dropless worst case; ``per_layer`` is then the larger of a dense and an MoE layer)
    hidden dropout    2 * m*N*h*r (two masks) when hidden_dropout > 0

Selective recomputation keeps the attention core's inputs and output (the
flash terms without the log-sum-exp; no s^2 terms). Full recomputation keeps
only each layer's input, ``p*N*h*r``, and rebuilds one layer at a time in
backward. Outside the layers: token ids (``8N``; at ``t > 1`` the local ids
``8N`` and the out-of-shard mask ``N``), learned position ids ``8s`` or RoPE
``cos``/``sin`` ``2*p*b*s*d``, an embedding dropout mask ``m*N*h*r``, the final
norm block, and the loss: fp32 softmax ``4*N*V'``, local targets ``8N``,
in-shard flags ``N``.

``q`` (norm statistics) and ``m`` (dropout masks) depend on the kernels:
:data:`CUDA` is the GPU path (fused norms with fp32 statistics, bool dropout
masks, flash/memory-efficient attention whatever the dropout), :data:`CPU`
the path the tests measure (statistics and masks in the activation dtype,
and the math attention kernel when attention dropout is on).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from hybrid.dtypes import DTYPE_BYTES
from hybrid.pipeline.executor import RECEIVES_AHEAD
from model_zoo.config import RECOMPUTE_LEAST_FIRST, GPTConfig
from model_zoo.qkv_layout import qkv_layout

RECOMPUTE = RECOMPUTE_LEAST_FIRST  # model_zoo's choices, least recomputed first


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """How the device's kernels and collectives behave, as far as memory goes.

    ``dropout_mask_bytes``: bytes per mask element (None: the activation dtype).
    ``norm_stat_bytes``: bytes per LayerNorm mean/rstd entry (None: the activation dtype).
    ``math_attention_with_dropout``: attention dropout falls back to the math kernel.
    ``fused_norms``: the norms run hybrid's fused kernel, which keeps its input
    (a contiguous copy when the input is a strided view, as the query/key heads
    are) and fp32 statistics; else RMSNorm runs the fp32 reference, and
    LayerNorm torch's own, which keeps its input as it is.
    ``gather_copies_output``: an all-gather lands in a temporary of the bucket's
    size before it is copied into place (gloo's own, which hybrid runs only
    across nodes), rather than in place (NCCL, and hybrid's direct messages
    inside a node on gloo: the ``cpu`` profile plans the ranks of one node).
    ``host_is_device``: the model lives in host memory, so optimizer offload
    copies nothing (a CPU run).
    ``reduce_scatter_copies_input``: an asynchronous reduce-scatter keeps a
    private copy of its input inside the communication library until it is
    waited on (gloo). Those bytes are not tensors: the planner reports them
    apart, as ``MemoryEstimate.untracked``.
    ``p2p_reduce_scatter``: reduce-scatters run as hybrid's point-to-point
    messages (:mod:`hybrid.p2p_collectives`, gloo), each holding
    :func:`hybrid.p2p_collectives.scratch_chunks` tensors of its output's size
    until it is waited on -- the direct shape's, as the ranks of one node run
    it (across nodes the ring holds fewer, so the count is an upper bound there
    but at dp 2) -- and sending from its input: no library copy, at any stage
    (``reduce_scatter_copies_input`` then counts nothing).
    ``receives_ahead``: a pipeline rank posts this many receives ahead of their
    use (:data:`hybrid.pipeline.executor.RECEIVES_AHEAD` on gloo, 0 on NCCL),
    each an activation-sized buffer from its posting on.
    """

    name: str
    dropout_mask_bytes: Optional[int]
    norm_stat_bytes: Optional[int]
    math_attention_with_dropout: bool
    fused_norms: bool
    gather_copies_output: bool = False
    host_is_device: bool = False
    reduce_scatter_copies_input: bool = False
    p2p_reduce_scatter: bool = False
    receives_ahead: int = 0


CUDA = DeviceProfile("cuda", dropout_mask_bytes=1, norm_stat_bytes=4, math_attention_with_dropout=False,
                     fused_norms=True)
CPU = DeviceProfile("cpu", dropout_mask_bytes=None, norm_stat_bytes=None, math_attention_with_dropout=True,
                    fused_norms=False, host_is_device=True,
                    reduce_scatter_copies_input=True, p2p_reduce_scatter=True, receives_ahead=RECEIVES_AHEAD)
PROFILES = {"cuda": CUDA, "cpu": CPU}


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    """Bytes saved for backward on one rank for one micro-batch, by where they live.

    ``per_layer``: one transformer layer under the chosen recomputation;
    ``layer_full``: one layer without recomputation (what a fully recomputed
    layer rebuilds during backward); ``embedding``, ``head`` (final norm and
    loss); ``total`` = embedding + layers * per_layer + head.
    ``loss_workspace``: the most the loss needs at once beyond what it saves
    (logits plus two fp32 [N, V'] temporaries), a transient at the end of forward.
    ``by_reference``: the part of ``embedding`` that recomputation regions keep
    by plain reference rather than through autograd's saved tensors (the RoPE
    tables under full recomputation): in memory all the same, but invisible to
    ``saved_tensors_hooks``. ``rope_tables``: the part of ``embedding`` that is
    the RoPE ``cos``/``sin`` tables, which every pipeline part with layers
    computes for itself.
    """

    per_layer: int
    layer_full: int
    embedding: int
    head: int
    layers: int
    loss_workspace: int
    by_reference: int = 0
    rope_tables: int = 0
    # An MoE layer's extra bytes when its routing is the dropless worst case rather than balanced
    # (hybrid.plan.moe.received_rows): saved under no or selective recomputation, rebuilt under full.
    routed_worst_extra: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.layers * self.per_layer + self.head


@dataclasses.dataclass(frozen=True)
class _Dims:
    N: int  # tokens per micro-batch
    s: int
    b: int
    h: int
    f: int
    a: int
    d: int
    g: int  # key/value heads per TP rank
    t: int
    r: float  # residual-stream fraction held by one TP rank
    p: int
    m: int  # dropout mask bytes per element
    q: int  # LayerNorm statistic bytes
    vocab_local: int


def _dims(config: GPTConfig, micro_batch: int, tp: int, sequence_parallel: bool, act_bytes: int,
          profile: DeviceProfile) -> _Dims:
    s, b = config.seq_length, micro_batch
    return _Dims(N=s * b, s=s, b=b, h=config.hidden_size, f=config.ffn_size, a=config.num_heads,
                 d=config.head_dim, g=qkv_layout(config).local_heads(tp)[1], t=tp,
                 r=1.0 / tp if sequence_parallel and tp > 1 else 1.0, p=act_bytes,
                 m=profile.dropout_mask_bytes or act_bytes, q=profile.norm_stat_bytes or act_bytes,
                 vocab_local=config.padded_vocab_size(tp) // tp)


def _norm_block(config: GPTConfig, x: _Dims, profile: DeviceProfile) -> float:
    """A norm plus the input the following (column-parallel) linear keeps."""
    n_h, linear_input = x.N * x.h, x.p * x.N * x.h
    if config.norm == "layernorm":
        return x.p * n_h * x.r + 2 * x.q * x.N * x.r + linear_input
    if profile.fused_norms:
        return x.p * n_h * x.r + 4 * x.N * x.r + linear_input
    return 4 * n_h * x.r + 4 * x.N * x.r + x.p * n_h * x.r + linear_input


def _attention(config: GPTConfig, x: _Dims, recompute: str, training: bool, profile: DeviceProfile) -> float:
    n_h_t = x.N * x.a * x.d / x.t  # q, or the attention output, on this rank (a d = h unless kv_channels is set)
    n_kv = x.N * x.d * x.g  # one of k, v on this rank
    rope = config.position == "rope"
    # qkv storage [+ rotated q, k] + output
    core_io = x.p * (n_h_t + 2 * n_kv + (n_h_t + n_kv if rope else 0) + n_h_t)
    if recompute == "selective":
        return core_io + _qk_norms(config, x, False, True, profile)
    math = profile.math_attention_with_dropout and training and config.attention_dropout > 0
    if math:
        scores = x.b * (x.a / x.t) * x.s * x.s
        # a view of qkv needs no fp32 copy; grouped k and v are expanded to every query head (fresh copies)
        v_storage = 3 if x.p == 4 and x.b == 1 and x.g * x.t == x.a else 1
        return (4 * n_h_t * (2 + v_storage) + x.p * n_h_t + 12 * scores
                + _qk_norms(config, x, True, v_storage == 3, profile))
    return core_io + 4 * x.N * x.a / x.t + _qk_norms(config, x, False, True, profile)


def _qk_norms(config: GPTConfig, x: _Dims, math: bool, qkv_counted: bool, profile: DeviceProfile) -> float:
    """The query/key norms (``qk_norm``) over this rank's ``a/t + g`` heads: outside the attention core, so
    kept under selective recomputation too. ``math``: the math attention kernel runs; ``qkv_counted``: the
    attention terms already hold the qkv projection's output."""
    if not config.qk_norm:
        return 0.0
    rows = x.N * (x.a / x.t + x.g)  # one normalised vector of d per token and head
    elements = rows * x.d
    rms = config.norm == "rmsnorm"
    if profile.fused_norms:  # a contiguous copy of the strided heads, fp32 rstd (and mean)
        saved, keeps_qkv_view = x.p * elements + (4 if rms else 8) * rows, False
    elif rms:  # the fp32 reference: the fp32 input (a new copy unless fp32 already), rstd, the normalised heads
        saved, keeps_qkv_view = (0 if x.p == 4 else 4 * elements) + 4 * rows + x.p * elements, x.p == 4
    else:  # torch's LayerNorm keeps its input, a view of the qkv output, and mean and rstd
        saved, keeps_qkv_view = 2 * x.q * rows, True
    if keeps_qkv_view and not qkv_counted:
        saved += x.p * (x.a / x.t + 2 * x.g) * x.N * x.d
    if config.position != "rope" and not math:  # the fused kernels keep the normalised heads; RoPE copies them
        saved += x.p * elements
    return saved


def _mlp(config: GPTConfig, x: _Dims) -> float:
    # the input projection's output, and as much again: GELU's output, or SwiGLU's silu(gate) and product
    return 2 * config.mlp_input_blocks * x.p * x.N * x.f / x.t


def _hidden_dropout(config: GPTConfig, x: _Dims, training: bool) -> float:
    return x.m * x.N * x.h * x.r if training and config.hidden_dropout > 0 else 0.0


def layer_bytes(config: GPTConfig, x: _Dims, recompute: str, training: bool, profile: DeviceProfile,
                mlp: Optional[float] = None) -> float:
    """Bytes one transformer layer saves for backward; ``mlp``: its MLP's (default the dense MLP's)."""
    if recompute == "full":
        return x.p * x.N * x.h * x.r
    return (2 * _norm_block(config, x, profile) + _attention(config, x, recompute, training, profile)
            + (_mlp(config, x) if mlp is None else mlp) + 2 * _hidden_dropout(config, x, training))


def _embedding(config: GPTConfig, x: _Dims, training: bool) -> float:
    ids = 8 * x.N if x.t == 1 else 9 * x.N  # ids; at t > 1 the local ids and the out-of-shard mask
    if config.position == "learned":
        positions = 8 * x.s
    else:
        positions = 2 * x.p * x.b * x.s * x.d  # RoPE cos and sin, shared by every layer
    return ids + positions + _hidden_dropout(config, x, training)


def _head(config: GPTConfig, x: _Dims, profile: DeviceProfile) -> float:
    loss = 4 * x.N * x.vocab_local + 8 * x.N + x.N  # fp32 softmax, local targets, in-shard flags
    return _norm_block(config, x, profile) + loss


def activation_bytes(config: GPTConfig, micro_batch: int, *, tp: int = 1, sequence_parallel: Optional[bool] = None,
                     recompute: Optional[str] = None, precision: str = "bf16", training: bool = True,
                     profile: DeviceProfile = CUDA, ep: int = 1, routing: str = "typical") -> ActivationBytes:
    """Activation bytes of one micro-batch of ``micro_batch`` sequences of ``config.seq_length`` on one TP rank.

    ``sequence_parallel`` and ``recompute`` default to the config's own;
    ``precision`` is the dtype activations (and parameters) run in. An MoE
    model's layers route over ``ep`` expert-parallel ranks, ``routing``
    ``typical`` (balanced) or ``worst`` (:func:`hybrid.plan.moe.received_rows`).
    """
    if precision not in DTYPE_BYTES:
        raise ValueError(f"precision must be one of {', '.join(DTYPE_BYTES)}, got {precision!r}")
    recompute = config.recompute if recompute is None else recompute
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro batch size must be a positive integer, got {micro_batch!r}")
    sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
    (config.replace(sequence_parallel=sp) if config.is_moe else config).validate(tp)
    x = _dims(config, micro_batch, tp, sp, DTYPE_BYTES[precision], profile)
    logits = x.p * x.N * x.vocab_local
    rope_tables = 2 * x.p * x.b * x.s * x.d if config.position == "rope" else 0
    per_layer = layer_bytes(config, x, recompute, training, profile)
    layer_full = layer_bytes(config, x, "none", training, profile)
    worst_extra = 0
    if config.is_moe:
        from hybrid.plan.moe import moe_layer_activation_bytes

        def moe(case: str) -> int:
            return moe_layer_activation_bytes(config, micro_batch, tp, sp, x.p, ep, case)

        typical = moe(routing)
        worst_extra = moe("worst") - typical
        kinds = set(config.moe_layer_pattern())  # the larger of a dense and an MoE layer when both occur
        per_layer = max(layer_bytes(config, x, recompute, training, profile, typical if k else None) for k in kinds)
        layer_full = max(layer_bytes(config, x, "none", training, profile, typical if k else None) for k in kinds)
    return ActivationBytes(
        per_layer=int(per_layer),
        layer_full=int(layer_full),
        embedding=int(_embedding(config, x, training)),
        head=int(_head(config, x, profile)),
        layers=config.num_layers,
        loss_workspace=int(logits + 8 * x.N * x.vocab_local),
        by_reference=rope_tables if recompute == "full" else 0,
        rope_tables=int(rope_tables),
        routed_worst_extra=int(worst_extra))
