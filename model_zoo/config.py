"""``GPTConfig``: the shape and switches of a decoder-only transformer.

One dataclass covers the GPT-2 family (learned positions, LayerNorm, GELU,
biases, tied embeddings) and the Llama family (RoPE, RMSNorm, SwiGLU, no
biases, untied head), with grouped-query attention (``num_query_groups``
key/value heads shared by the query heads; 1 is multi-query), a head dim
other than ``hidden_size / num_heads`` (``kv_channels``), RoPE scaling
(linear, Llama 3's frequency-dependent rule, or YaRN with its attention
factor: model_zoo.rope) and a QKV bias of its own
(``qkv_bias``: Qwen2 has it with no other bias), and query/key norms
(``qk_norm``: Qwen3; Megatron's ``--qk-layernorm``). :meth:`GPTConfig.validate`
checks it against a tensor-parallel size and names the offending keys.

The one home of the model description, plain data (no torch): each field is
declared with :func:`setting`, whose metadata says what kind of setting it is
(:data:`KINDS`: a shape, what the weights compute, the rotary context,
initialisation, runtime or training) and gives the trainer's flag and help, from which
``hybrid.config.trainer_sections`` derives the trainer's ``model`` section.
The checkpoint check (:func:`load_conflicts`) and the resharding hints
(:data:`SHAPE_FIELDS`) read the kinds; the recompute choices
(:data:`RECOMPUTE`) and the MLP widths (:data:`MLP_INPUT_BLOCKS`,
:func:`swiglu_ffn_size`) are defined here for the configuration, the model
and the planner. A new field is one :func:`setting` line with its help.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from hybrid.compression import Quantization
from hybrid.grid import a2a_heads_problem, cp_comm_type_problem, cp_dropout_problem, sequence_split_problem
from hybrid.tp_units import split_units

POSITIONS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
# The MLP kinds, each with the ffn_size-wide blocks its input projection computes: GELU one, SwiGLU two (the gate
# and the up projection, side by side). The one statement of the SwiGLU width (GPTConfig.mlp_input_size).
MLP_INPUT_BLOCKS = {"gelu": 1, "swiglu": 2}
MLPS = tuple(MLP_INPUT_BLOCKS)
# The activation recomputation choices, in the order the configuration lists them (--recompute-granularity), each
# with how much of a layer backward recomputes: 0 nothing, 1 the attention core (selective), 2 the whole layer (full).
RECOMPUTE_LEVELS = {"none": 0, "full": 2, "selective": 1}
RECOMPUTE = tuple(RECOMPUTE_LEVELS)
RECOMPUTE_LEAST_FIRST = tuple(sorted(RECOMPUTE, key=RECOMPUTE_LEVELS.__getitem__))  # the planner's order
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
# Mixture of Experts (model_zoo.moe): the router's score functions, the balancing losses (Megatron's
# --moe-router-load-balancing-type: the Switch/GShard loss over each micro-batch, the same over each sequence, or
# none), the policies that choose which tokens an expert over capacity drops, and the token dispatchers.
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_BALANCING = ("aux_loss", "seq_aux_loss", "none")
MOE_DROP_POLICIES = ("probs", "position")
MOE_DISPATCHERS = ("alltoall", "allgather")
# Values per fp32 scale in a quantized dispatch (GPTConfig.dispatch_quantization): 1 + 4/64 bytes per value,
# 0.27x of fp32 on the wire.
DISPATCH_BLOCK = 64

# What a setting is, in its field's metadata "kind":
SHAPE = "shape"  # decides tensor shapes: a checkpoint loads only into the same value
FUNCTION = "function"  # what the weights compute, no shape depends on it (norm epsilon): the same
# How positions become rotations (RoPE base and scaling): any value loads, and the load prints a note naming the
# checkpoint's value and the new one (load_notes). A long-context phase changes exactly these when it continues a
# pretrained checkpoint (Llama 3.1's llama3 scaling, Qwen's YaRN, a larger base), so it is no conflict; a change
# by mistake is still visible.
CONTEXT = "context"
INIT = "init"  # how fresh weights are drawn: any value loads (the checkpoint's weights replace them)
RUNTIME = "runtime"  # how the model runs (sequence length, recomputation, vocabulary padding): any value loads
TRAINING = "training"  # how it is trained (dropout, sequence parallelism): any value loads, and the trainer's
#                        --use-checkpoint-args leaves it to the run
KINDS = (SHAPE, FUNCTION, CONTEXT, INIT, RUNTIME, TRAINING)


def swiglu_ffn_size(hidden_size: int, multiple_of: int = 256) -> int:
    """The Llama rule for the SwiGLU width: 2/3 of 4h, rounded up to ``multiple_of``."""
    raw = int(2 * 4 * hidden_size / 3)
    return multiple_of * -(-raw // multiple_of)


def setting(default: Any = dataclasses.MISSING, *, kind: str, help: str, flag: Optional[str] = None,
            switch: Any = dataclasses.MISSING, trainer: bool = True, **rules: Any) -> Any:
    """A field of :class:`GPTConfig` and everything else that reads it: its ``kind`` (one of :data:`KINDS`), and
    the trainer's key of the same meaning (``hybrid.config.trainer_sections`` derives its model section from these).

    ``flag``: the trainer's flag, Megatron-LM's name (default ``--`` and the field's name, dashed); the key is the
    flag's name with underscores. ``switch``: the trainer key is a switch that sets the field to this value
    (``--swiglu`` sets ``mlp`` to ``"swiglu"``); else it takes a value, unset by default (the preset's).
    ``trainer=False``: no trainer key. ``rules``: ``ge``/``gt``/``lt`` bounds the trainer checks its value against,
    and ``convert``: a function from the key's given text (or value) to the field's value, raising ValueError.
    ``help``: the trainer flag's help, which also documents the field.
    """
    if kind not in KINDS:
        raise TypeError(f"kind {kind!r} is not one of {KINDS}")
    meta: Dict[str, Any] = {"kind": kind, "help": help, "trainer": trainer, **rules}
    if flag is not None:
        meta["flag"] = flag
    if switch is not dataclasses.MISSING:
        meta["switch"] = switch
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = setting(kind=SHAPE, ge=1, help="vocabulary size (unset: the tokenizer's)")
    hidden_size: int = setting(kind=SHAPE, ge=1, help="hidden size")
    num_layers: int = setting(kind=SHAPE, ge=1, help="transformer layers")
    num_heads: int = setting(kind=SHAPE, ge=1, flag="--num-attention-heads", help="attention heads")
    num_query_groups: Optional[int] = setting(  # 1: multi-query
        None, kind=SHAPE, ge=1, help="key/value heads shared by the query heads (grouped-query attention; 1: "
                                     "multi-query; unset: one per attention head)")
    kv_channels: Optional[int] = setting(None, kind=SHAPE, ge=1,
                                         help="channels per attention head (unset: hidden size / attention "
                                              "heads; Qwen3 and Mistral NeMo use 128 apart from it)")
    ffn_hidden_size: Optional[int] = setting(None, kind=SHAPE, ge=1,
                                             help="MLP hidden size (unset: 4h, or the SwiGLU rule)")
    # A runtime setting: the learned position table is max_position_embeddings (see position_table_rows).
    seq_length: int = setting(1024, kind=RUNTIME, ge=1, help="training sequence length")
    max_position_embeddings: Optional[int] = setting(None, kind=SHAPE, ge=1,  # unset: seq_length
                                                     help="learned position table size")
    position: str = setting("learned", kind=SHAPE, flag="--position-embedding-type",
                            help="learned or rope (Megatron's learned_absolute: learned)")
    norm: str = setting("layernorm", kind=SHAPE, flag="--normalization",
                        help="layernorm or rmsnorm (any case: Megatron's LayerNorm, RMSNorm)")
    norm_eps: float = setting(1e-5, kind=FUNCTION, gt=0.0, flag="--norm-epsilon", help="epsilon of LayerNorm/RMSNorm")
    # Megatron's zero-centred gamma (layernorm_zero_centered_gamma): every norm's weight w is stored as gamma - 1,
    # drawn as zeros, and the norm multiplies by 1 + w, so that weight decay pulls the scale towards 1, not 0.
    apply_layernorm_1p: bool = setting(False, kind=FUNCTION, switch=True,
                                       help="every norm (LayerNorm or RMSNorm) stores its weight as gamma - 1, "
                                            "initialised to 0, and scales by 1 + weight (Megatron's zero-centred "
                                            "gamma)")
    rope_theta: float = setting(10000.0, kind=CONTEXT, gt=0.0, flag="--rotary-base",
                                help="base (theta) of rotary position embeddings")
    # RoPE scaling (model_zoo.rope.rope_inv_freq): "linear" divides every frequency by rope_scaling_factor; "llama3"
    # divides only the low frequencies (wavelength > rope_original_max_positions / rope_low_freq_factor), keeps the
    # high ones (wavelength < rope_original_max_positions / rope_high_freq_factor) and blends in between; "yarn"
    # keeps the dims that turn more than rope_yarn_beta_fast times over rope_original_max_positions, divides those
    # that turn fewer than rope_yarn_beta_slow times, ramps linearly in between, and multiplies cos and sin by the
    # attention factor (rope_attention_factor).
    rope_scaling: str = setting("none", kind=CONTEXT,
                                help="RoPE frequency scaling: none, linear, llama3 (Llama 3.1's rule) or yarn")
    rope_scaling_factor: float = setting(1.0, kind=CONTEXT, gt=0.0,
                                         help="divisor of the scaled RoPE frequencies (yarn: new context / "
                                              "original context; Megatron's --rotary-scaling-factor)")
    rope_low_freq_factor: float = setting(1.0, kind=CONTEXT, gt=0.0,
                                          help="llama3 scaling: wavelengths past original/this are scaled")
    rope_high_freq_factor: float = setting(4.0, kind=CONTEXT, gt=0.0,
                                           help="llama3 scaling: wavelengths below original/this are kept")
    rope_original_max_positions: int = setting(8192, kind=CONTEXT, ge=1,
                                               help="llama3 and yarn scaling: the original context length "
                                                    "(Megatron's --yarn-original-max-position-embeddings)")
    rope_yarn_beta_fast: float = setting(32.0, kind=CONTEXT, gt=0.0, flag="--yarn-beta-fast",
                                         help="yarn scaling: dims turning more often than this over the original "
                                              "context keep their frequency")
    rope_yarn_beta_slow: float = setting(1.0, kind=CONTEXT, gt=0.0, flag="--yarn-beta-slow",
                                         help="yarn scaling: dims turning less often than this over the original "
                                              "context are divided by the factor")
    rope_yarn_truncate: bool = setting(True, kind=CONTEXT, flag="--no-yarn-correction-range-round-to-int",
                                       switch=False, help="yarn scaling: do not round the ramp's ends to whole "
                                                          "dims (Hugging Face's truncate: false)")
    # The attention factor (the YaRN paper's sqrt(1/t), on cos and sin, so on q.k twice): 0.1 m ln(s) + 1 for
    # m = rope_yarn_mscale, divided by the same for m = rope_yarn_mscale_all_dim (1 when that is 0), s the factor.
    rope_yarn_mscale: float = setting(1.0, kind=CONTEXT, gt=0.0, flag="--mscale",
                                      help="yarn scaling: m of the attention factor's numerator, 0.1 m ln(factor) "
                                           "+ 1")
    rope_yarn_mscale_all_dim: float = setting(0.0, kind=CONTEXT, ge=0.0, flag="--mscale-all-dim",
                                              help="yarn scaling: m of the attention factor's denominator (0: "
                                                   "none; DeepSeek's mscale_all_dim)")
    rope_attention_factor: Optional[float] = setting(None, kind=CONTEXT, gt=0.0, trainer=False,
                                                     help="yarn scaling: the factor on cos and sin itself (Hugging "
                                                          "Face's attention_factor; unset: from the mscales)")
    mlp: str = setting("gelu", kind=SHAPE, flag="--swiglu", switch="swiglu",  # gelu: the tanh approximation
                       help="SwiGLU MLP instead of GELU")
    qkv_bias: Optional[bool] = setting(None, kind=SHAPE, flag="--add-qkv-bias", switch=True,  # None: as bias
                                       help="a bias on the q/k/v projection even with --disable-bias-linear (Qwen2)")
    qk_norm: bool = setting(False, kind=SHAPE, flag="--qk-layernorm", switch=True,
                            help="normalise each query and key head over its head dim before RoPE, with the "
                                 "model's --normalization (Qwen3)")
    bias: bool = setting(True, kind=SHAPE, flag="--disable-bias-linear", switch=False,
                         help="no biases in linear layers")
    tie_embeddings: bool = setting(True, kind=SHAPE, flag="--untie-embeddings-and-output-weights", switch=False,
                                   help="separate output layer weights")
    hidden_dropout: float = setting(0.0, kind=TRAINING, ge=0.0, lt=1.0,
                                    help="dropout on embeddings and residual branches")
    attention_dropout: float = setting(0.0, kind=TRAINING, ge=0.0, lt=1.0, help="dropout on attention probabilities")
    init_std: float = setting(0.02, kind=INIT, gt=0.0, flag="--init-method-std",
                              help="standard deviation of the weight initialisation")
    scaled_output_init: bool = setting(True, kind=INIT, trainer=False,
                                       help="output projections use init_std / sqrt(2 * num_layers)")
    sequence_parallel: bool = setting(False, kind=TRAINING, switch=True,
                                      help="shard norm and dropout activations along the sequence over TP")
    recompute: str = setting("none", kind=RUNTIME, trainer=False,  # the trainer's top-level key recompute sets it
                             help="activation recomputation: none, full (every layer) or selective (attention "
                                  "core)")
    vocab_pad_multiple: int = setting(128, kind=RUNTIME, trainer=False,
                                      help="the vocabulary is padded to a multiple of this times the TP size")

    # ---- Mixture of Experts (model_zoo.moe; Megatron-Core's names) ------------------------------------
    num_experts: Optional[int] = setting(None, kind=SHAPE, ge=1,
                                         help="routed experts of each MoE layer (unset: a dense model)")
    moe_ffn_hidden_size: Optional[int] = setting(None, kind=SHAPE, ge=1,
                                                 help="hidden size of each routed expert's MLP (unset: "
                                                      "--ffn-hidden-size)")
    # N: layers 0, N, 2N, ... are MoE; or one 0/1 per layer (DeepSeek's first k dense: [0]*k + [1]*(L-k)).
    # The trainer's --moe-layer-freq reads Megatron's spelling of both (parse_moe_layer_freq).
    moe_layer_freq: Any = setting(1, kind=SHAPE, convert=lambda text: parse_moe_layer_freq(text),
                                  help="which layers are MoE: N (every N-th layer from layer 0) or a 0/1 per "
                                       "layer, as Megatron's '([0]*3+[1]*29)'")
    moe_router_topk: int = setting(2, kind=FUNCTION, ge=1, help="experts each token is routed to")
    moe_router_score_function: str = setting("softmax", kind=FUNCTION,
                                             help="router scores: softmax or sigmoid (DeepSeek-V3)")
    moe_router_pre_softmax: bool = setting(False, kind=FUNCTION, switch=True,
                                           help="softmax scores: weight each chosen expert by its softmax over all "
                                                "experts (Qwen2-MoE); default: renormalised over the chosen k "
                                                "(Mixtral, Qwen3-MoE). Sigmoid scores are always renormalised")
    moe_router_topk_scaling_factor: Optional[float] = setting(None, kind=FUNCTION, gt=0.0,
                                                              help="multiply the top-k weights by this (DeepSeek's "
                                                                   "routed_scaling_factor)")
    moe_router_num_groups: Optional[int] = setting(None, kind=FUNCTION, ge=1,
                                                   help="group-limited routing: the experts in this many equal "
                                                        "groups (DeepSeek-V3's n_group: e.g. the nodes or devices "
                                                        "of the expert-parallel group)")
    moe_router_group_topk: Optional[int] = setting(None, kind=FUNCTION, ge=1,
                                                   help="group-limited routing: each token's experts come from "
                                                        "this many groups, those whose top (topk / group_topk) "
                                                        "scores sum highest (DeepSeek-V3's topk_group); unset: "
                                                        "any experts")
    moe_router_enable_expert_bias: bool = setting(False, kind=TRAINING, switch=True,
                                                  help="aux-loss-free balancing: a per-expert bias, added to the "
                                                       "scores only to choose experts, moves each step toward the "
                                                       "mean load (DeepSeek-V3)")
    moe_router_bias_update_rate: float = setting(1e-3, kind=TRAINING, gt=0.0,
                                                 help="how far the expert bias moves per step")
    moe_router_load_balancing_type: str = setting("aux_loss", kind=TRAINING,
                                                  help="balancing loss: aux_loss (Switch/GShard, over each "
                                                       "micro-batch), seq_aux_loss (over each sequence) or none")
    moe_aux_loss_coeff: float = setting(0.0, kind=TRAINING, ge=0.0, help="coefficient of the balancing loss")
    moe_z_loss_coeff: Optional[float] = setting(None, kind=TRAINING, ge=0.0,
                                                help="coefficient of the router z-loss (unset: off)")
    moe_expert_capacity_factor: Optional[float] = setting(None, kind=TRAINING, gt=0.0,
                                                          help="unset: dropless; else each expert takes at most "
                                                               "ceil(factor * seq_length * topk / num_experts) "
                                                               "tokens of each sequence and drops the rest")
    moe_token_drop_policy: str = setting("probs", kind=TRAINING,
                                         help="which tokens an expert over capacity keeps: probs (the highest "
                                              "weights) or position (the earliest)")
    moe_shared_expert_intermediate_size: Optional[int] = setting(None, kind=SHAPE, ge=1,
                                                                 help="hidden size of the shared expert every "
                                                                      "token passes through (Qwen2-MoE, DeepSeek; "
                                                                      "unset: none)")
    moe_shared_expert_gate: bool = setting(False, kind=SHAPE, switch=True,
                                           help="a sigmoid gate [1, h] on the shared expert's output (Qwen2-MoE)")
    # a shape setting: it decides how checkpoints cut the experts (split like the dense MLP, or whole)
    expert_tensor_parallel_size: Optional[int] = setting(None, kind=SHAPE, ge=1,
                                                         help="split each expert's MLP over this many TP ranks: "
                                                              "the TP size (unset) or 1 (experts whole on every "
                                                              "TP rank)")
    moe_grouped_gemm: bool = setting(False, kind=RUNTIME, switch=True,
                                     help="run a rank's experts as one grouped matrix product (torch._grouped_mm) "
                                          "instead of a loop")
    moe_token_dispatcher_type: str = setting("alltoall", kind=RUNTIME,
                                             help="alltoall (allgather is accepted and runs as alltoall: the "
                                                  "same tokens reach the same experts)")
    cp_comm_type: str = setting("p2p", kind=RUNTIME,
                                help="context-parallel attention: p2p (key/value blocks around a ring) or a2a "
                                     "(all-to-all: heads scatter, the sequence gathers)")
    moe_quantized_dispatch: bool = setting(False, kind=RUNTIME, switch=True,
                                           help="send tokens to their experts and back as int8 blocks with one "
                                                "scale each (hybrid.compression); experts compute on the "
                                                "dequantized values")

    # ---- derived sizes ---------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_layer_pattern(self) -> Tuple[bool, ...]:
        """For each layer, whether its MLP is an MoE layer (all False for a dense model)."""
        if not self.is_moe:
            return (False,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return tuple(i % freq == 0 for i in range(self.num_layers))
        return tuple(bool(v) for v in freq)

    @property
    def expert_ffn_size(self) -> int:
        """Hidden size of each routed expert's MLP: ``moe_ffn_hidden_size``, or :attr:`ffn_size`."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    @property
    def dispatch_quantization(self) -> Optional[Quantization]:
        """How tokens cross the MoE all-to-alls with ``moe_quantized_dispatch``: int8 blocks of
        :data:`DISPATCH_BLOCK` values with one fp32 scale each; None: as they are."""
        return Quantization(8, DISPATCH_BLOCK) if self.moe_quantized_dispatch else None

    def expert_tp(self, tp_size: int) -> int:
        """The TP ranks each expert's MLP is split over: ``expert_tensor_parallel_size``, or ``tp_size``."""
        return self.expert_tensor_parallel_size if self.expert_tensor_parallel_size is not None else tp_size

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 4 * self.hidden_size if self.mlp == "gelu" else swiglu_ffn_size(self.hidden_size)

    @property
    def mlp_input_blocks(self) -> int:
        """The ``ffn_size``-wide blocks of the MLP's input projection (:data:`MLP_INPUT_BLOCKS`): its TP stride."""
        return MLP_INPUT_BLOCKS[self.mlp]

    @property
    def mlp_input_size(self) -> int:
        """Output features of the MLP's input projection: ``ffn_size``, or ``2 * ffn_size`` for SwiGLU."""
        return self.mlp_input_blocks * self.ffn_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``kv_channels``, or ``hidden_size / num_heads`` when unset."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_heads

    @property
    def attention_width(self) -> int:
        """``num_heads * head_dim``: the query rows of the q/k/v projection and the output projection's input.
        Equal to ``hidden_size`` unless ``kv_channels`` sets another head dim."""
        return self.num_heads * self.head_dim

    @property
    def query_groups(self) -> int:
        """Key/value heads (``num_query_groups``, or ``num_heads`` when unset)."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_heads

    @property
    def attention_bias(self) -> bool:
        """Whether the q/k/v projection has a bias."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def num_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        unit = self.vocab_pad_multiple * tp_size
        return -(-self.vocab_size // unit) * unit

    # ---- validation ---------------------------------------------------------------------
    def validate(self, tp_size: int = 1, ep_size: int = 1, cp_size: int = 1) -> "GPTConfig":
        """Raise ``ValueError`` naming the key and the rule when the config cannot run at ``tp_size`` tensor-,
        ``ep_size`` expert- and ``cp_size`` context-parallel ranks."""
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "seq_length", "vocab_pad_multiple"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{key} must be a positive integer, got {value!r}")
        for key, allowed in (("position", POSITIONS), ("norm", NORMS), ("mlp", MLPS), ("recompute", RECOMPUTE)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"GPTConfig.{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int)
                                                 or self.ffn_hidden_size < 1):
            raise ValueError(f"GPTConfig.ffn_hidden_size must be a positive integer or None, "
                             f"got {self.ffn_hidden_size!r}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"GPTConfig.{key} must be in [0, 1), got {getattr(self, key)}")
        if not self.norm_eps > 0 or not self.init_std > 0 or not self.rope_theta > 0:
            raise ValueError(f"GPTConfig.norm_eps ({self.norm_eps}), init_std ({self.init_std}) and rope_theta "
                             f"({self.rope_theta}) must be > 0")
        if self.num_query_groups is not None and (not isinstance(self.num_query_groups, int)
                                                  or isinstance(self.num_query_groups, bool)
                                                  or self.num_query_groups < 1
                                                  or self.num_heads % self.num_query_groups):
            raise ValueError(f"GPTConfig.num_query_groups={self.num_query_groups!r} must be a positive integer "
                             f"that divides num_heads={self.num_heads}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"GPTConfig.rope_scaling={self.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)}")
        problem = yarn_problem(self)
        if problem is not None:
            raise ValueError(problem)
        if not self.rope_scaling_factor > 0 or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor \
                or not (isinstance(self.rope_original_max_positions, int) and self.rope_original_max_positions > 0):
            raise ValueError(f"GPTConfig RoPE scaling needs rope_scaling_factor > 0 "
                             f"({self.rope_scaling_factor}), 0 < rope_low_freq_factor < rope_high_freq_factor "
                             f"({self.rope_low_freq_factor}, {self.rope_high_freq_factor}) and a positive integer "
                             f"rope_original_max_positions ({self.rope_original_max_positions!r})")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int)
                                             or isinstance(self.kv_channels, bool) or self.kv_channels < 1):
            raise ValueError(f"GPTConfig.kv_channels must be a positive integer or None, got {self.kv_channels!r}")
        if self.kv_channels is None and self.hidden_size % self.num_heads != 0:
            raise ValueError(f"GPTConfig.hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}, or kv_channels must give the head dim")
        if self.position == "rope" and self.head_dim % 2 != 0:
            source = (f"kv_channels = {self.kv_channels}" if self.kv_channels is not None else
                      f"hidden_size/num_heads = {self.hidden_size}/{self.num_heads} = {self.head_dim}")
            raise ValueError(f"rotary positions need an even head dim, but {source}")
        if self.position == "learned" and self.num_positions < self.seq_length:
            raise ValueError(f"GPTConfig.max_position_embeddings={self.num_positions} is smaller than "
                             f"seq_length={self.seq_length}; learned positions need one row per position")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {tp_size!r}")
        if self.num_heads % tp_size != 0:
            raise ValueError(f"GPTConfig.num_heads={self.num_heads} must be divisible by the tensor-parallel "
                             f"size tp={tp_size} (attention heads are split over TP ranks)")
        split_units(self.query_groups, tp_size, "GPTConfig.num_query_groups")
        if self.ffn_size % tp_size != 0:
            raise ValueError(f"GPTConfig.ffn_hidden_size={self.ffn_size} must be divisible by the "
                             f"tensor-parallel size tp={tp_size}")
        if self.sequence_parallel and self.seq_length % tp_size != 0:
            raise ValueError(f"GPTConfig.seq_length={self.seq_length} must be divisible by the tensor-parallel "
                             f"size tp={tp_size} when sequence_parallel=True")
        problem = moe_problem(self, tp_size, ep_size) or context_parallel_problem(self, tp_size, cp_size)
        if problem is not None:
            raise ValueError(problem)
        return self

    # ---- (de)serialisation ------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys {unknown}; valid keys are {sorted(known)}")
        return cls(**d)

    def replace(self, **changes) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig keys {unknown}; valid keys are {sorted(known)}")
        return dataclasses.replace(self, **changes)


# ---- Mixture of Experts: the rules, and Megatron's spelling of the layer pattern ------------------------------------
def moe_problem(config: GPTConfig, tp_size: int = 1, ep_size: int = 1) -> Optional[str]:
    """Why ``config``'s MoE settings cannot run at ``tp_size`` tensor- and ``ep_size`` expert-parallel ranks, in
    one line naming the flag and the fix; None when they can. The one statement of how the experts divide over
    ``ep`` (the trainer and the model read it; ``hybrid.grid.expert_parallel_problem`` says how ``ep`` divides the
    data-parallel ranks)."""
    c = config
    if not c.is_moe:
        if ep_size != 1:
            return (f"--expert-model-parallel-size {ep_size} shares out the experts of an MoE model, and this model "
                    f"is dense (--num-experts unset): set --num-experts, or leave --expert-model-parallel-size 1")
        return None
    e = c.num_experts
    if not isinstance(e, int) or isinstance(e, bool) or e < 1:
        return f"--num-experts must be a positive integer, got {e!r}"
    if e % ep_size:
        return (f"--num-experts {e} must be divisible by --expert-model-parallel-size {ep_size}: each "
                f"expert-parallel rank holds num_experts / ep whole experts; choose an ep that divides {e}")
    if not isinstance(c.moe_router_topk, int) or not 1 <= c.moe_router_topk <= e:
        return (f"--moe-router-topk {c.moe_router_topk!r} must lie in [1, --num-experts {e}]: a token cannot go to "
                f"more experts than there are")
    for key, allowed, flag in (("moe_router_score_function", MOE_SCORE_FUNCTIONS, "--moe-router-score-function"),
                               ("moe_router_load_balancing_type", MOE_BALANCING,
                                "--moe-router-load-balancing-type"),
                               ("moe_token_drop_policy", MOE_DROP_POLICIES, "--moe-token-drop-policy"),
                               ("moe_token_dispatcher_type", MOE_DISPATCHERS, "--moe-token-dispatcher-type")):
        if getattr(c, key) not in allowed:
            return f"{flag} {getattr(c, key)!r} is not one of {', '.join(allowed)}"
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    if group_topk is not None:
        if groups is None:
            return "--moe-router-group-topk needs --moe-router-num-groups: the groups it chooses among"
        if e % groups:
            return (f"--num-experts {e} must be divisible by --moe-router-num-groups {groups}: the groups are "
                    f"equal")
        per_group, k = e // groups, c.moe_router_topk
        # enough groups to hold k experts, at most every group, and at least one expert from each chosen group
        fewest, most = -(-k // per_group), min(k, groups)
        if not fewest <= group_topk <= most:
            return (f"--moe-router-group-topk {group_topk} cannot take --moe-router-topk {k} experts from "
                    f"--moe-router-num-groups {groups} groups of {per_group}: choose a group_topk in "
                    f"[{fewest}, {most}]")
    if c.moe_expert_capacity_factor is not None and not c.moe_expert_capacity_factor > 0:
        return (f"--moe-expert-capacity-factor {c.moe_expert_capacity_factor!r} must be > 0 (leave it unset for "
                f"dropless routing)")
    pattern = c.moe_layer_freq
    if isinstance(pattern, bool) or not (isinstance(pattern, int) and pattern >= 1 or isinstance(
            pattern, (list, tuple)) and len(pattern) == c.num_layers and all(v in (0, 1) for v in pattern)):
        return (f"--moe-layer-freq {pattern!r} must be a positive integer N (every N-th layer is MoE) or one 0/1 "
                f"per layer ({c.num_layers} of them)")
    etp = c.expert_tp(tp_size)
    if etp not in (1, tp_size):
        return (f"--expert-tensor-parallel-size {etp} must be 1 (each expert whole on every TP rank) or the "
                f"tensor-parallel size {tp_size}")
    if c.expert_ffn_size % etp:
        return (f"--moe-ffn-hidden-size {c.expert_ffn_size} must be divisible by the expert tensor-parallel size "
                f"{etp}")
    if tp_size > 1 and not c.sequence_parallel:
        return (f"an MoE model at --tensor-model-parallel-size {tp_size} needs --sequence-parallel: each TP rank "
                f"routes its own share of the tokens")
    if c.bias:
        return ("MoE experts have no biases (a bias added per expert would be summed over the TP ranks that share "
                "its partial outputs): add --disable-bias-linear")
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp_size:
        return (f"--moe-shared-expert-intermediate-size {shared} must be divisible by the tensor-parallel size "
                f"{tp_size}")
    if c.moe_shared_expert_gate and shared is None:
        return "--moe-shared-expert-gate needs a shared expert: set --moe-shared-expert-intermediate-size"
    return None


def context_parallel_problem(config: GPTConfig, tp_size: int = 1, cp_size: int = 1) -> Optional[str]:
    """Why ``config`` cannot split its sequences over ``cp_size`` context-parallel ranks (at ``tp_size``), in one
    line naming the flag and the fix; None when it can (or ``cp_size`` is 1). The rules of the split and the
    attentions are :mod:`hybrid.grid`'s (what hybrid.context_parallel checks too); this adds sequence
    parallelism's."""
    c, cp = config, cp_size
    problem = cp_comm_type_problem(c.cp_comm_type)
    if problem or cp == 1:
        return problem
    problem = sequence_split_problem(c.seq_length, cp) or cp_dropout_problem(cp, c.attention_dropout)
    if problem:
        return problem
    if c.sequence_parallel and (c.seq_length // cp) % tp_size:
        return (f"--seq-length {c.seq_length} / --context-parallel-size {cp} = {c.seq_length // cp} tokens per rank "
                f"must be divisible by --tensor-model-parallel-size {tp_size} under --sequence-parallel")
    if c.cp_comm_type == "a2a":
        return a2a_heads_problem(c.num_heads // tp_size, max(1, c.query_groups // tp_size), cp)
    return None


def yarn_problem(config: GPTConfig) -> Optional[str]:
    """Why ``config``'s YaRN settings are unusable, in one line naming the fields; None when they are fine.

    The attention factor's two conventions agree only where the denominator's m is 0 with the numerator's 1, or
    both are non-zero: Hugging Face ignores ``mscale`` unless ``mscale_all_dim`` is set, Megatron-Core does not.
    Other pairs are refused rather than read one way (an import writes what Hugging Face computes).
    """
    c = config
    if not 0 < c.rope_yarn_beta_slow <= c.rope_yarn_beta_fast:
        return (f"GPTConfig yarn scaling needs 0 < rope_yarn_beta_slow <= rope_yarn_beta_fast (--yarn-beta-slow "
                f"{c.rope_yarn_beta_slow}, --yarn-beta-fast {c.rope_yarn_beta_fast})")
    if not c.rope_yarn_mscale > 0 or not c.rope_yarn_mscale_all_dim >= 0:
        return (f"GPTConfig.rope_yarn_mscale ({c.rope_yarn_mscale}) must be > 0 and rope_yarn_mscale_all_dim "
                f"({c.rope_yarn_mscale_all_dim}) >= 0")
    if c.rope_yarn_mscale_all_dim == 0 and c.rope_yarn_mscale != 1:
        return (f"GPTConfig.rope_yarn_mscale={c.rope_yarn_mscale} with rope_yarn_mscale_all_dim=0: Hugging Face "
                f"ignores mscale without mscale_all_dim, Megatron-Core does not; set --mscale-all-dim, or set "
                f"rope_attention_factor to the factor meant")
    if c.rope_attention_factor is not None and not c.rope_attention_factor > 0:
        return f"GPTConfig.rope_attention_factor must be > 0 or unset, got {c.rope_attention_factor!r}"
    return None


def parse_moe_layer_freq(text: Any) -> Any:
    """Megatron's ``--moe-layer-freq``: an integer N, or a list expression of 0s and 1s built from ``[..]``,
    ``*`` by an integer and ``+`` (``"([0]*3+[1]*29)"``, ``"[1,0,1,0]"``), read without evaluating code.
    Returns the int or a tuple of 0/1; ValueError naming the text otherwise."""
    if isinstance(text, (int, list, tuple)) and not isinstance(text, bool):
        return tuple(text) if isinstance(text, list) else text
    source = str(text).strip().strip("'\"")
    if source.isdigit():
        return int(source)
    tokens = re.findall(r"\d+|[\[\]()*+,]|\S", source)
    pos = 0

    def peek() -> Optional[str]:
        return tokens[pos] if pos < len(tokens) else None

    def take(expected: Optional[str] = None) -> str:
        nonlocal pos
        tok = peek()
        if tok is None or (expected is not None and tok != expected):
            raise ValueError(f"--moe-layer-freq {text!r}: expected {expected or 'more'} at token {pos}")
        pos += 1
        return tok

    def term() -> List[int]:
        tok = peek()
        if tok == "(":
            take("(")
            items = expr()
            take(")")
        elif tok == "[":
            take("[")
            items = [int(take())]
            while peek() == ",":
                take(",")
                items.append(int(take()))
            take("]")
        else:
            raise ValueError(f"--moe-layer-freq {text!r}: expected '[' or '(' at token {pos}")
        while peek() == "*":
            take("*")
            count = take()
            if not count.isdigit():
                raise ValueError(f"--moe-layer-freq {text!r}: a list repeats by an integer, got {count!r}")
            items = items * int(count)
        return items

    def expr() -> List[int]:
        items = term()
        while peek() == "+":
            take("+")
            items = items + term()
        return items

    out = expr()
    if pos != len(tokens) or any(v not in (0, 1) for v in out):
        raise ValueError(f"--moe-layer-freq {text!r}: expected N or a list expression of 0s and 1s such as "
                         f"'([0]*3+[1]*29)'")
    return tuple(out)


# ---- the kinds, and what they mean for a checkpoint ------------------------------------------------------------
def fields_of_kind(*kinds: str) -> Tuple[str, ...]:
    """The names of :class:`GPTConfig`'s fields of ``kinds``, in field order."""
    return tuple(f.name for f in dataclasses.fields(GPTConfig) if f.metadata["kind"] in kinds)


SHAPE_FIELDS = fields_of_kind(SHAPE)
ANY_VALUE_ON_LOAD = fields_of_kind(CONTEXT, INIT, RUNTIME, TRAINING)  # a checkpoint loads whatever these say
NOTED_ON_LOAD = fields_of_kind(CONTEXT)  # ... and a change of these is printed (load_notes)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not dataclasses.MISSING}


def position_table_rows(settings: Mapping[str, Any]) -> Optional[int]:
    """Rows of the learned position table of a model with ``settings`` (a :meth:`GPTConfig.to_dict`):
    ``max_position_embeddings``, or ``seq_length`` when unset; None for RoPE, which has no table."""
    def get(key: str) -> Any:
        return settings.get(key, _DEFAULTS.get(key))

    if get("position") != "learned":
        return None
    return get("max_position_embeddings") if get("max_position_embeddings") is not None else get("seq_length")


def as_weights_see_it(settings: Mapping[str, Any]) -> Dict[str, Any]:
    """``settings`` with ``max_position_embeddings`` as the rows of the learned position table
    (:func:`position_table_rows`): what the weights depend on, the sequence length not."""
    out = dict(settings)
    out["max_position_embeddings"] = position_table_rows(settings)
    return out


def load_conflicts(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """Why the weights of a model with ``saved`` settings cannot load into one with ``current`` (each a
    :meth:`GPTConfig.to_dict`; a key of another release counts as a shape): one phrase per setting, by key;
    [] when they load. Settings of :data:`ANY_VALUE_ON_LOAD` may differ (the RoPE ones with a note:
    :func:`load_notes`); a learned position table must keep
    its rows, and one shorter than the new ``seq_length`` is refused naming both."""
    then, now = as_weights_see_it(saved), as_weights_see_it(current)
    out = []
    for key in sorted(set(then) | set(now)):
        if key in ANY_VALUE_ON_LOAD or then.get(key) == now.get(key):
            continue
        if key == "max_position_embeddings":
            if then[key] is not None and now[key] is not None:  # both learned (else ``position`` differs)
                out.append(_table_conflict(then[key], now[key], now.get("seq_length")))
        else:
            out.append(f"{key}: checkpoint {then.get(key)!r}, current model {now.get(key)!r}")
    return out


def load_notes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """What a load of a checkpoint with ``saved`` settings into a model with ``current`` ones changes of
    :data:`NOTED_ON_LOAD` (each a :meth:`GPTConfig.to_dict`; a key the checkpoint lacks has its default): one
    phrase per setting naming both values, [] when none changes or the current model has no rotary positions.
    The loader prints them; :func:`load_conflicts` does not refuse them."""
    def get(settings: Mapping[str, Any], key: str) -> Any:
        return settings.get(key, _DEFAULTS.get(key))

    if get(current, "position") != "rope":
        return []
    return [f"{key}: checkpoint {get(saved, key)!r}, now {get(current, key)!r}" for key in NOTED_ON_LOAD
            if get(saved, key) != get(current, key)]


def _table_conflict(saved_rows: int, rows: int, seq_length: int) -> str:
    if saved_rows < seq_length:
        return (f"its learned position table has {saved_rows} rows, fewer than the seq_length {seq_length} being "
                f"trained: learned positions cannot run past their table (train at seq_length {saved_rows} or "
                f"less)")
    return (f"its learned position table has {saved_rows} rows, the current model's {rows} "
            f"(max_position_embeddings, unset: seq_length): set max_position_embeddings to {saved_rows} to train "
            f"at seq_length {seq_length}")
