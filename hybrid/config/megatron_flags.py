"""Megatron-LM flags that set no key of hybrid's config tree, so that a Megatron launch script runs as it is.

Every flag here is one of two kinds, and says why:

* **accepted**: what it asks for is what hybrid does anyway, or it is a knob of Megatron's own implementation
  that hybrid's has no counterpart of. It changes nothing; the trainer names it, with its reason, in one note
  on rank 0 before training starts.
* **refused**: it asks for something hybrid does not do. The run stops before training with one line that
  names the flag and what to use instead.

Megatron flags that do map onto a key are spellings of that key instead (:class:`hybrid.config.fields.Alias`:
``--use-distributed-optimizer`` is ZeRO stage 1, ``--overlap-grad-reduce`` is ``zero.overlap_comm``,
``--use-rotary-position-embeddings`` is ``model.position_embedding_type rope``), and ``--normalization
RMSNorm``, ``--position-embedding-type learned_absolute`` are read as model_zoo's ``rmsnorm``, ``learned``.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class MegatronFlag:
    flag: str
    accepted: bool  # True: no effect here; False: refused
    reason: str  # accepted: why it changes nothing; refused: what to use instead
    takes_value: bool = False
    # accepted only with one of these values (None: any); another value is refused with ``refusal``
    values: Optional[Tuple[str, ...]] = None
    refusal: str = ""


def _accepted(flag: str, reason: str, takes_value: bool = False, values: Optional[Tuple[str, ...]] = None,
              refusal: str = "") -> MegatronFlag:
    return MegatronFlag(flag, True, reason, takes_value or values is not None, values, refusal)


def _refused(flag: str, reason: str, takes_value: bool = False) -> MegatronFlag:
    return MegatronFlag(flag, False, reason, takes_value)


_NO_PHASE_TIMERS = "hybrid has no per-phase timers; train/iteration_time_s is always written"
_SDPA = "attention runs through torch's scaled_dot_product_attention, which picks its fastest kernel, flash where " \
        "it can"
_FP32_SOFTMAX = ("the attention core (torch's scaled_dot_product_attention) computes the softmax in fp32 for bf16 and "
                 "fp16 inputs, as flash kernels do (tests/model_zoo/test_attention_precision.py)")
_ONE_MODEL = "hybrid has one transformer implementation (model_zoo)"
_FUSED_SWITCH = "its own are switched by --fused-kernels / --no-fused-kernels"
_NO_FUSION = "hybrid has no such fused kernel to turn off; " + _FUSED_SWITCH
_FUSION_ON = "hybrid has no such fused kernel to turn on; " + _FUSED_SWITCH
_MMAP = "hybrid always memory-maps the .bin and .idx files (numpy memmap)"
_CKPT = ("hybrid writes its own checkpoints, metadata.json and safetensors, every rank its own files "
         "(docs/checkpoints.md), which tools/convert_checkpoint.py exports")
_ALWAYS_WRITTEN = "is always written to TensorBoard (--tensorboard-dir)"
_ROPE = "hybrid scales RoPE frequencies with --rope-scaling and --rope-scaling-factor: give "
_ALL_STATE = ("every checkpoint holds the optimizer and RNG states, so that it resumes exactly; "
              "tools/convert_checkpoint.py exports the weights alone (to-fp32, to-hf)")
_RETAIN = "--keep-last K keeps the newest K checkpoints, each complete and resumable"
_PER_LAYER = "--recompute-granularity full recomputes every layer, each its own checkpoint"
_FP8 = ("hybrid trains in bf16, fp16 or fp32 (--bf16, --fp16): fp8 and fp4 training (Transformer Engine's scaling "
        "recipes) are not implemented")
# ---- Mixture of Experts: Megatron-Core's MoE flags that set no key (the keys: docs/moe.md, model.num_experts...)
MOE = "hybrid's MoE settings are Megatron-Core's that docs/moe.md lists"
_NO_EP_OVERLAP = ("hybrid does not overlap the expert-parallel all-to-alls with compute; the values trained are the "
                  "same")
_TOPK_LIMITED_DEVICES = ("Megatron's deprecated spelling of device-limited routing: use --moe-router-num-groups "
                         "(the expert-parallel size) and --moe-router-group-topk")
_UPCYCLING = ("upcycling a dense checkpoint into an MoE model is not implemented: train the MoE model from its own "
              "initialisation")
_DEEPEP = ("DeepEP and Megatron's flex dispatcher are not used: hybrid dispatches tokens with its own all-to-all "
           "(--moe-token-dispatcher-type alltoall)")
_MDS_MOE = "a Megatron-DeepSpeed MoE flag; hybrid reads Megatron-Core's: "
_GPT_OSS = ("gpt-oss's variants (learnable softmax sinks, sliding-window attention, the clamped quick-GeGLU MLP) "
            "are not in model_zoo")
_FSDP = ("Megatron-FSDP's own buffers and groups: hybrid's sharded data parallelism is ZeRO (--use-megatron-fsdp "
         "--data-parallel-sharding-strategy optim_grads_params is ZeRO stage 3: parameters, gradients and optimizer "
         "state partitioned over the data-parallel ranks)")
_FSDP_KNOB = ("a buffer or NCCL-registration knob of Megatron-FSDP's communication; hybrid's flat ZeRO buffers are its "
              "own, and the values trained are the same")
_MEMORY_HISTORY = ("hybrid records no CUDA allocator history: --profile writes a torch.profiler trace, and the "
                   "'run profile' line at the end gives every rank's peak memory")
_RECOMPUTE = ("hybrid recomputes every layer, each its own checkpoint (--recompute-granularity full: Megatron's "
              "--recompute-method uniform --recompute-num-layers 1), or the attention core (selective)")

MEGATRON_FLAGS: Tuple[MegatronFlag, ...] = (
    _accepted("--use-flash-attn", _SDPA),
    _accepted("--attention-backend", _SDPA, takes_value=True),
    _accepted("--attention-softmax-in-fp32", _FP32_SOFTMAX),
    _accepted("--apply-query-key-layer-scaling", "it guards a half-precision softmax against fp16 overflow and leaves "
                                                 "the result unchanged; " + _FP32_SOFTMAX),
    _accepted("--use-mcore-models", _ONE_MODEL),
    _accepted("--transformer-impl", _ONE_MODEL + "; Transformer Engine is not used", takes_value=True),
    _accepted("--exit-signal-handler", "SIGTERM and SIGINT always save a checkpoint and stop; docs/training.md"),
    _accepted("--log-throughput", "every log line has tokens/s, TFLOP/s per device and MFU"),
    _accepted("--log-validation-ppl-to-tensorboard", "valid/ppl is always written"),
    _accepted("--log-memory-to-tensorboard", "memory/allocated_bytes and memory/peak_bytes are always written"),
    _accepted("--log-timers-to-tensorboard", _NO_PHASE_TIMERS),
    _accepted("--timing-log-level", _NO_PHASE_TIMERS, takes_value=True),
    _accepted("--no-masked-softmax-fusion", _NO_FUSION),
    _accepted("--no-bias-gelu-fusion", _NO_FUSION),
    _accepted("--no-bias-swiglu-fusion", _NO_FUSION),
    _accepted("--no-bias-dropout-fusion", _NO_FUSION),
    _accepted("--masked-softmax-fusion", _FUSION_ON),
    _accepted("--bias-gelu-fusion", _FUSION_ON),
    _accepted("--bias-swiglu-fusion", _FUSION_ON),
    _accepted("--bias-dropout-fusion", _FUSION_ON),
    _accepted("--mmap-bin-files", _MMAP),
    _accepted("--no-mmap-bin-files", _MMAP + "; reading them whole would change the memory, not the samples"),
    _accepted("--openai-gelu", "model_zoo's gelu MLP is already the tanh approximation (GPT-2's)"),
    _refused("--squared-relu", "model_zoo's MLPs are gelu (the tanh approximation) and --swiglu"),
    _refused("--apply-residual-connection-post-layernorm", "model_zoo's layers are pre-norm, the residual taken "
                                                           "from the layer's input"),
    _accepted("--no-gradient-accumulation-fusion", "gradients accumulate by autograd straight into ZeRO's flat "
                                                   "buffers; there is no separate fused path"),
    _accepted("--group-query-attention", "--num-query-groups alone sets the key/value groups"),
    _accepted("--no-position-embedding", "a rope model has no learned position table; the table exists only with "
                                         "--position-embedding-type learned_absolute"),
    _accepted("--distributed-backend", "hybrid picks NCCL on CUDA devices and gloo on the CPU", takes_value=True),
    _accepted("--num-workers", "samples are read in the training process from memory-mapped files",
              takes_value=True),
    _accepted("--ckpt-format", _CKPT, takes_value=True),
    _accepted("--use-dist-ckpt", _CKPT),
    _accepted("--ckpt-fully-parallel-save", _CKPT),
    _accepted("--auto-detect-ckpt-format", "hybrid reads its own checkpoints, those of earlier releases included"),
    _accepted("--log-batch-size-to-tensorboard", f"train/batch_size {_ALWAYS_WRITTEN}"),
    _accepted("--log-learning-rate-to-tensorboard", f"train/lr {_ALWAYS_WRITTEN}"),
    _accepted("--log-loss-scale-to-tensorboard", f"train/loss_scale {_ALWAYS_WRITTEN}"),
    _accepted("--tensorboard-queue-size", "a buffer size of the event writer; what is logged is the same",
              takes_value=True),
    _accepted("--timing-log-option", _NO_PHASE_TIMERS, takes_value=True),
    _accepted("--make-vocab-size-divisible-by", "hybrid pads the vocabulary to a multiple of 128 x TP, Megatron's "
                                                "default; padded rows are never trained nor scored, so the model is "
                                                "the same at any padding", takes_value=True),
    _accepted("--no-create-attention-mask-in-dataloader", "hybrid's samples carry no attention mask: the kernel "
                                                          "applies the causal mask"),
    _accepted("--no-async-tensor-model-parallel-allreduce", "hybrid's tensor-parallel all-reduces are synchronous: "
                                                            "none overlaps the weight-gradient computation"),
    _accepted("--no-rope-fusion", _NO_FUSION),
    _accepted("--no-persist-layer-norm", _NO_FUSION),
    _accepted("--cross-entropy-loss-fusion", "hybrid's vocab-parallel cross entropy has one implementation; the "
                                             "loss is the same"),
    _accepted("--manual-gc", "when Python collects garbage is a setting of Megatron's runtime; the training is the "
                             "same"),
    _accepted("--rotary-percent", "rotary embeddings cover the whole head dimension", values=("1.0", "1"),
              refusal="hybrid rotates the whole head dimension"),
    _accepted("--empty-unused-memory-level", "emptying the CUDA allocator's cache between steps changes the memory "
                                             "reserved, not the training; hybrid leaves the cache alone",
              takes_value=True),
    _accepted("--vocab-extra-ids", "no extra token ids", values=("0",),
              refusal="hybrid's tokenizers add no extra (T5 sentinel) ids"),
    # Megatron's full recompute of every layer, one checkpoint each, is hybrid's --recompute-granularity full
    _accepted("--recompute-method", _PER_LAYER, values=("uniform",), refusal=_RECOMPUTE),
    _accepted("--recompute-num-layers", _PER_LAYER, values=("1",), refusal=_RECOMPUTE),
    _accepted("--grad-reduce-in-bf16", "with --bf16 hybrid accumulates the gradients in bf16 and reduces them over "
                                       "the data-parallel ranks in bf16 already, which is what the flag asks of "
                                       "Megatron's bf16 parameters (its gradient buffers in the parameters' dtype); "
                                       "fp32 parameters keep fp32 gradients there too (tests/zero/"
                                       "test_grad_reduce_bf16.py)"),
    _refused("--accumulate-allreduce-grads-in-fp32", "hybrid accumulates and reduces gradients in the parameters' "
                                                     "dtype; for fp32 gradients keep fp32 parameters with "
                                                     "--autocast"),
    # Mixture of Experts (--num-experts, --expert-model-parallel-size and the moe_* keys are keys of their own)
    _accepted("--moe-permute-fusion", "hybrid orders the tokens by expert with torch ops; there is no fused "
                                      "permutation kernel, and the tokens each expert receives are the same"),
    _accepted("--moe-router-fusion", _FUSION_ON),
    _accepted("--moe-router-dtype", "the router computes its logits, scores and weights in fp32 always (docs/moe.md)",
              values=("fp32",), refusal="hybrid's router computes in fp32; fp64 routing is not implemented"),
    _accepted("--moe-use-legacy-grouped-gemm", "--moe-grouped-gemm runs hybrid's one grouped implementation "
                                               "(torch._grouped_mm)"),
    _accepted("--moe-shared-expert-overlap", "hybrid runs the shared expert beside the routed ones without "
                                             "overlapping the dispatch; the values are the same"),
    _accepted("--overlap-moe-expert-parallel-comm", _NO_EP_OVERLAP),
    _accepted("--delay-wgrad-compute", "it schedules weight gradients for Megatron's expert-parallel overlap; "
                                       + _NO_EP_OVERLAP),
    _accepted("--moe-pad-expert-input-to-capacity", "padding each expert's tokens to its capacity with zeros "
                                                    "changes the shapes of the expert matmuls, not their results"),
    _accepted("--moe-router-padding-for-fp8", "it pads each expert's tokens to a multiple of 16 for FP8 matmuls "
                                              "with zero-weight tokens; hybrid has no FP8 matmuls, and the padding "
                                              "changes no value"),
    _accepted("--moe-deepep-num-sms", "a knob of DeepEP, which hybrid does not use", takes_value=True),
    _accepted("--moe-pad-experts-for-cuda-graph-inference", "an inference setting (CUDA graphs at decode); "
                                                             "training is the same"),
    _accepted("--moe-upcycling-granularity", "no upcycling", values=("1",), refusal=_UPCYCLING),
    _refused("--moe-router-topk-limited-devices", _TOPK_LIMITED_DEVICES, takes_value=True),
    _refused("--moe-input-jitter-eps", "router input jitter is not implemented: the router sees the hidden states "
                                       "as they are; remove it (--moe-z-loss-coeff regularises the router)",
             takes_value=True),
    _refused("--moe-use-upcycling", _UPCYCLING),
    _refused("--moe-layer-recompute", "hybrid recomputes whole layers, each MoE layer with its experts: "
                                      "--recompute-granularity full"),
    _refused("--moe-extended-tp", "Megatron's deprecated extended tensor parallelism: --expert-tensor-parallel-size "
                                  "splits each expert over the TP ranks (the default) or keeps it whole (1)"),
    _refused("--moe-router-force-load-balancing", "routing by random logits (Megatron's benchmark mode) is not "
                                                  "implemented; the router's own choices are trained"),
    _refused("--moe-enable-deepep", _DEEPEP),
    _refused("--moe-flex-dispatcher-backend", _DEEPEP, takes_value=True),
    _refused("--moe-apply-probs-on-input", "hybrid weights each expert's output by its routing probability; "
                                           "weighting its input instead (Llama 4) is not implemented"),
    _refused("--fp8-format", _FP8, takes_value=True),
    # Megatron-DeepSpeed's spellings (examples_deepspeed/); --deepspeed-config FILE is read by hybrid.config.cli
    _accepted("--deepspeed", "hybrid is the engine; the DeepSpeed settings are read from --deepspeed_config"),
    _accepted("--deepspeed-activation-checkpointing", "recomputation is --checkpoint-activations or "
                                                      "--recompute-granularity; hybrid has one checkpointing "
                                                      "implementation"),
    _accepted("--data-impl", _MMAP, values=("mmap",), refusal="hybrid reads Megatron's memory-mapped .bin/.idx "
                                                              "files only"),
    _accepted("--no-query-key-layer-scaling", "hybrid applies no query-key layer scaling; " + _FP32_SOFTMAX),
    _accepted("--ds-sequence-parallel-size", "one DeepSpeed-Ulysses rank: the sequence is not split",
              values=("1",), refusal="hybrid has no DeepSpeed-Ulysses sequence parallelism; --sequence-parallel "
                                     "splits the activations over the tensor-parallel group"),
    _accepted("--DDP-impl", "hybrid's data parallelism is its own (flat gradient buffers, ZeRO); there is no torch "
                            "DDP to choose", takes_value=True),
    _accepted("--rope-type", "model_zoo's rotary embedding is the standard one", values=("rope",),
              refusal="YaRN is --rope-scaling yarn (with --rope-scaling-factor, --yarn-beta-fast, --yarn-beta-slow, "
                      "--mscale, --mscale-all-dim), not a rotary type of its own"),
    _accepted("--logging-level", "the verbosity of Megatron's own Python loggers", takes_value=True),
    # Megatron-FSDP (examples/megatron_fsdp/): its sharding strategy is a ZeRO stage (RESPELLINGS)
    _accepted("--use-megatron-fsdp", "hybrid's sharded data parallelism is ZeRO; --data-parallel-sharding-strategy "
                                     "picks its stage"),
    _accepted("--init-model-with-meta-device", "model_zoo initialises each weight from (seed, name), so where the "
                                               "model is first built changes the memory at start-up, not the "
                                               "weights"),
    _accepted("--use-nccl-ub", _FSDP_KNOB),
    _accepted("--fsdp-double-buffer", _FSDP_KNOB),
    _accepted("--fsdp-manual-registration", _FSDP_KNOB),
    _refused("--use-torch-fsdp2", "ZeRO stage 3 (--zero-stage 3) partitions the parameters"),
    _refused("--tp-comm-overlap", "hybrid does not overlap tensor-parallel communication with compute; keep the "
                                  "tensor-parallel group within a node"),
    _refused("--no-save-optim", _ALL_STATE),
    _refused("--no-save-rng", _ALL_STATE),
    _refused("--save-retain-interval", _RETAIN, takes_value=True),
    _refused("--non-persistent-save-interval", _RETAIN, takes_value=True),
    _refused("--use-rope-scaling", _ROPE + "--rope-scaling llama3 --rope-scaling-factor 8 (Megatron's default "
                                           "factor)"),
    _refused("--rotary-seq-len-interpolation-factor", _ROPE + "--rope-scaling linear --rope-scaling-factor F",
             takes_value=True),
    _refused("--adlr-autoresume", "SIGTERM and SIGINT (a scheduler's preemption) save a checkpoint and stop; "
                                  "--load resumes from it"),
    _accepted("--use-pytorch-profiler", "--profile writes a torch.profiler trace (hybrid has no nsys mode)"),
)


@dataclasses.dataclass(frozen=True)
class MegatronFamily:
    """Megatron-LM flags hybrid has no spelling of, refused with one reason: ``flags`` exactly, or any flag that
    starts with one of ``prefixes``. Their values are whatever follows them up to the next flag, so that a flag
    with several values (``--data-path2 0.5 A 0.5 B``) is refused whole."""

    reason: str
    flags: Tuple[str, ...] = ()
    prefixes: Tuple[str, ...] = ()

    def matches(self, flag: str) -> bool:
        return flag in self.flags or flag.startswith(self.prefixes)


# MoE flags hybrid has no entry for: Megatron-DeepSpeed's (each naming Megatron-Core's counterpart), and any other
# --moe-* flag (a newer Megatron-Core's). On a dense model (--num-experts unset or 1) they are noted, not refused.
MDS_MOE_FAMILIES: Tuple[MegatronFamily, ...] = (
    MegatronFamily(_MDS_MOE + "--expert-model-parallel-size", flags=("--moe-expert-parallel-size",)),
    MegatronFamily(_MDS_MOE + "--moe-aux-loss-coeff", flags=("--moe-loss-coeff",)),
    MegatronFamily(_MDS_MOE + "--moe-expert-capacity-factor (counted per sequence; no minimum capacity, and "
                   "evaluation drops as training does); leave it unset for dropless routing",
                   flags=("--moe-train-capacity-factor", "--moe-eval-capacity-factor", "--moe-min-capacity",
                          "--disable-moe-token-dropping")),
    MegatronFamily(_MDS_MOE + "--moe-layer-freq", flags=("--expert-interval",)),
    MegatronFamily(_MDS_MOE + "--moe-router-topk", flags=("--topk",)),
    MegatronFamily(_MDS_MOE + "--expert-tensor-parallel-size", flags=("--enable-expert-tensor-parallelism",)),
    MegatronFamily("a Megatron-DeepSpeed MoE flag: pyramid and residual MoE (PR-MoE) are not implemented; "
                   "hybrid's experts are --num-experts per MoE layer, with an optional shared expert "
                   "(--moe-shared-expert-intermediate-size)", flags=("--mlp-type",)),
    MegatronFamily(_MDS_MOE + "ZeRO partitions the expert parameters over their expert-data-parallel ranks by "
                   "itself, and hybrid's dispatch is its own all-to-all",
                   flags=("--create-moe-param-group", "--use-tutel")),
)
MOE_FAMILY = MegatronFamily("a Megatron-Core MoE flag hybrid has no counterpart of; " + MOE, prefixes=("--moe-",))
MOE_FAMILIES = MDS_MOE_FAMILIES + (MOE_FAMILY,)
MEGATRON_FAMILIES: Tuple[MegatronFamily, ...] = (
    MegatronFamily(_FP8, prefixes=("--fp8", "--fp4")),
    *MOE_FAMILIES,
    MegatronFamily(_GPT_OSS, flags=("--softmax-type", "--window-size", "--window-attn-skip-freq", "--enable-gpt-oss",
                                    "--quick-geglu", "--glu-linear-offset", "--activation-func-clamp-value",
                                    "--export-force-local-attention")),
    MegatronFamily(_FSDP, flags=("--outer-dp-sharding-strategy", "--num-distributed-optimizer-instances"),
                   prefixes=("--fsdp-", "--megatron-fsdp-")),
    MegatronFamily(_MEMORY_HISTORY, flags=("--record-memory-history", "--memory-snapshot-path")),
    MegatronFamily("hybrid leaves torch's default for bf16 matmul reductions (reduced precision allowed)",
                   flags=("--disable-bf16-reduced-precision-matmul",)),
    MegatronFamily("hybrid writes no optimizer-state statistics; --log-params-norm and --log-num-zeros-in-grad are "
                   "its optional scalars", flags=("--log-optimizer-states-to-tensorboard",)),
    MegatronFamily("a second dataset of Megatron's detoxification example script (finetune_gpt.py), not a flag of "
                   "pretrain_gpt.py; give one blend with --data-path", flags=("--data-path2",)),
)
@dataclasses.dataclass(frozen=True)
class Respelling:
    """A Megatron-DeepSpeed flag that is another spelling of one of hybrid's: read as ``flag`` (with the value
    given, or ``value`` for a switch), unless ``yields_to`` is given too."""

    flag: str
    value: Optional[str] = None
    yields_to: Optional[str] = None
    values: Optional[Mapping[str, str]] = None  # the given value -> hybrid's (others are refused)


RESPELLINGS = {
    "--num-key-value-heads": Respelling("--num-query-groups"),
    # Megatron-DeepSpeed's (and earlier Megatron-LM's) full recompute of every layer
    "--checkpoint-activations": Respelling("--recompute-granularity", "full", yields_to="--recompute-granularity"),
    # Megatron-FSDP's sharding strategies are ZeRO's stages: nothing, the optimizer state, and the gradients,
    # and the parameters too
    "--data-parallel-sharding-strategy": Respelling("--zero-stage", values=MappingProxyType({
        "no_shard": "0", "optim": "1", "optim_grads": "2", "optim_grads_params": "3"})),
}
FSDP_PREFETCH_NOTE = ("--overlap-param-gather (under Megatron-FSDP it prefetches the next module's parameters, which "
                      "ZeRO stage 3 does anyway: zero.prefetch_bucket_size)")
TOKENIZER_SPELLINGS = {  # Megatron's tokenizer types that are one of hybrid's: lower-case name -> (hybrid's, why)
    "llama2tokenizer": ("SentencePieceTokenizer", "Llama 2's tokenizer is a SentencePiece model"),
    "gptsentencepiecetokenizer": ("SentencePieceTokenizer", "a SentencePiece model"),
    "nulltokenizer": (None, "no tokenizer is read: the vocabulary is --vocab-size"),
}
TOKENIZER_NOT_YET: Mapping[str, str] = {}  # Megatron tokenizer types still to come: lower-case name -> why
DENSE_MOE_NOTE = "no effect on a dense model (--num-experts unset or 1)"
ONE_EXPERT_NOTE = "one expert is the dense MLP: the model is dense, as Megatron-DeepSpeed reads it"
# Values of MoE keys that Megatron-Core takes and hybrid does not: flag -> value -> what to use instead
MOE_VALUES_NOT_HERE: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "--moe-router-load-balancing-type": MappingProxyType({
        "sinkhorn": "S-BASE's Sinkhorn balancing is not implemented: give aux_loss, seq_aux_loss, or none with "
                    "--moe-router-enable-expert-bias (aux-loss-free balancing)",
        "global_aux_loss": "the balancing loss over the global batch is not implemented: give aux_loss (over each "
                           "micro-batch) or seq_aux_loss (over each sequence)"}),
    "--moe-token-dispatcher-type": MappingProxyType({"flex": _DEEPEP + "; alltoall or allgather"}),
})


def family_of(flag: str) -> Optional[MegatronFamily]:
    """The refused family ``flag`` belongs to, or None."""
    return next((f for f in MEGATRON_FAMILIES if f.matches(flag)), None)


def megatron_verdicts(given: Sequence[Tuple[str, Optional[str]]]) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """For the Megatron flags ``given`` as ``(flag, value)`` (each flag one of :data:`MEGATRON_FLAGS`; value None
    for a switch): ``(notes, refusals)``, a note per accepted one (``--flag (reason)``) and a line per refused one
    naming what to use instead."""
    by_flag = {f.flag: f for f in MEGATRON_FLAGS}
    notes, refusals = [], []
    for flag, value in given:
        entry = by_flag[flag]
        shown = flag if value is None else f"{flag} {value}"
        if not entry.accepted:
            refusals.append(f"{shown} is a Megatron-LM flag hybrid does not take: {entry.reason}")
        elif entry.values is not None and str(value).lower() not in entry.values:
            refusals.append(f"{shown} is a Megatron-LM setting hybrid does not take: {entry.refusal}; accepted: "
                            f"{flag} {' or '.join(entry.values)}")
        else:
            notes.append(f"{shown} ({entry.reason})")
    return tuple(notes), tuple(refusals)


def check_megatron_flags(given: Sequence[Tuple[str, Optional[str]]]) -> Tuple[str, ...]:
    """:func:`megatron_verdicts`'s notes; raises ValueError naming every refused flag (one per line of
    :func:`megatron_verdicts`, joined) when any is."""
    notes, refusals = megatron_verdicts(given)
    if refusals:
        raise ValueError("; ".join(refusals))
    return notes
