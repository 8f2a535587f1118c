"""``GPTConfig``: the shape and switches of a decoder-only transformer.

One dataclass covers the GPT-2 family (learned positions, LayerNorm, GELU,
biases, tied embeddings) and the Llama family (RoPE, RMSNorm, SwiGLU, no
biases, untied head), with grouped-query attention (``num_query_groups``
key/value heads shared by the query heads; 1 is multi-query), a head dim
other than ``hidden_size / num_heads`` (``kv_channels``), RoPE scaling
(linear, or Llama 3's frequency-dependent rule) and a QKV bias of its own
(``qkv_bias``: Qwen2 has it with no other bias), and query/key norms
(``qk_norm``: Qwen3; Megatron's ``--qk-layernorm``). :meth:`GPTConfig.validate`
checks it against a tensor-parallel size and names the offending keys.

The one home of the model description, plain data (no torch): each field is
declared with :func:`setting`, whose metadata says what kind of setting it is
(:data:`KINDS`: a shape, what the weights compute, initialisation, runtime or
training) and gives the trainer's flag and help, from which
``hybrid.config.trainer_sections`` derives the trainer's ``model`` section.
The checkpoint check (:func:`load_conflicts`) and the resharding hints
(:data:`SHAPE_FIELDS`) read the kinds; the recompute choices
(:data:`RECOMPUTE`) and the MLP widths (:data:`MLP_INPUT_BLOCKS`,
:func:`swiglu_ffn_size`) are defined here for the configuration, the model
and the planner. A new field is one :func:`setting` line with its help.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

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
ROPE_SCALINGS = ("none", "linear", "llama3")

# What a setting is, in its field's metadata "kind":
SHAPE = "shape"  # decides tensor shapes: a checkpoint loads only into the same value
FUNCTION = "function"  # what the weights compute, no shape depends on it (RoPE base, norm epsilon): the same
INIT = "init"  # how fresh weights are drawn: any value loads (the checkpoint's weights replace them)
RUNTIME = "runtime"  # how the model runs (sequence length, recomputation, vocabulary padding): any value loads
TRAINING = "training"  # how it is trained (dropout, sequence parallelism): any value loads, and the trainer's
#                        --use-checkpoint-args leaves it to the run
KINDS = (SHAPE, FUNCTION, INIT, RUNTIME, TRAINING)


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
    ``trainer=False``: no trainer key. ``rules``: ``ge``/``gt``/``lt`` bounds the trainer checks its value against.
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
    rope_theta: float = setting(10000.0, kind=FUNCTION, gt=0.0, flag="--rotary-base",
                                help="base (theta) of rotary position embeddings")
    # RoPE scaling: "linear" divides every frequency by rope_scaling_factor; "llama3" divides only the low
    # frequencies (wavelength > rope_original_max_positions / rope_low_freq_factor), keeps the high ones
    # (wavelength < rope_original_max_positions / rope_high_freq_factor) and blends in between.
    rope_scaling: str = setting("none", kind=FUNCTION,
                                help="RoPE frequency scaling: none, linear or llama3 (Llama 3.1's rule)")
    rope_scaling_factor: float = setting(1.0, kind=FUNCTION, gt=0.0, help="divisor of the scaled RoPE frequencies")
    rope_low_freq_factor: float = setting(1.0, kind=FUNCTION, gt=0.0,
                                          help="llama3 scaling: wavelengths past original/this are scaled")
    rope_high_freq_factor: float = setting(4.0, kind=FUNCTION, gt=0.0,
                                           help="llama3 scaling: wavelengths below original/this are kept")
    rope_original_max_positions: int = setting(8192, kind=FUNCTION, ge=1,
                                               help="llama3 scaling: the original context length")
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

    # ---- derived sizes ---------------------------------------------------------------
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
    def validate(self, tp_size: int = 1) -> "GPTConfig":
        """Raise ``ValueError`` naming the key and the rule when the config cannot run at ``tp_size``."""
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


# ---- the kinds, and what they mean for a checkpoint ------------------------------------------------------------
def fields_of_kind(*kinds: str) -> Tuple[str, ...]:
    """The names of :class:`GPTConfig`'s fields of ``kinds``, in field order."""
    return tuple(f.name for f in dataclasses.fields(GPTConfig) if f.metadata["kind"] in kinds)


SHAPE_FIELDS = fields_of_kind(SHAPE)
ANY_VALUE_ON_LOAD = fields_of_kind(INIT, RUNTIME, TRAINING)  # a checkpoint loads whatever the model says of these
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
    [] when they load. Settings of :data:`ANY_VALUE_ON_LOAD` may differ; a learned position table must keep
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


def _table_conflict(saved_rows: int, rows: int, seq_length: int) -> str:
    if saved_rows < seq_length:
        return (f"its learned position table has {saved_rows} rows, fewer than the seq_length {seq_length} being "
                f"trained: learned positions cannot run past their table (train at seq_length {saved_rows} or "
                f"less)")
    return (f"its learned position table has {saved_rows} rows, the current model's {rows} "
            f"(max_position_embeddings, unset: seq_length): set max_position_embeddings to {saved_rows} to train "
            f"at seq_length {seq_length}")
