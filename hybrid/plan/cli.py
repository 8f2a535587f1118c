"""Command line of the planner: ``python -m hybrid.plan --model NAME | --config FILE ...``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Union

from hybrid.argument_parser import ArgumentParser
from hybrid.config.flags import own_flag
from hybrid.config.schema import PIPELINE_SCHEDULES
from hybrid.layout import OFFLOAD_DEVICES, PRECISIONS, ZERO_STAGES, LayoutError
from hybrid.plan.activations import PROFILES
from hybrid.plan.candidate import DEFAULT_PRECISION
from hybrid.plan.cluster import Cluster, ClusterError, parse_size
from hybrid.plan.layouts import RECOMPUTES, Choices, enumerate_layouts, plan, refused_placements, refused_stages
from hybrid.plan.model_memory import OPTIMIZER_STATES
from hybrid.plan.estimate import moe_stage_problem
from hybrid.plan.report import CP_LEGEND, LEGEND, MOE_LEGEND, format_table, summary, to_json
from hybrid.plan.setup import DEFAULT_SETUP, TrainingSetup, checkpoint_field, zero_field
from model_zoo.config import GPTConfig
from model_zoo.flops import active_parameters, count_parameters, expert_parameters, flops_per_token
from model_zoo.presets import get_preset, list_presets

EXAMPLE = ("python -m hybrid.plan --model turing-nlg-17b --gpus 256 --gpus-per-node 16 --gpu-memory 32GiB "
           "--seq-length 1024 --global-batch-size 512")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help once, and only where it says something: not when the help names its
    default already, nor for a default of None (unset) or a plain switch's False; ``--x/--no-x`` says on or off."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        if isinstance(action, argparse.BooleanOptionalAction):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return text if action.nargs == 0 else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m hybrid.plan", description=(
        "Predict per-GPU memory, communication (split by intra- and inter-node link) and step time of every "
        f"parallel layout of a model, and rank the layouts that fit by predicted tokens/s. Example: {EXAMPLE}"),
        formatter_class=_DefaultsFormatter)
    model = ap.add_argument_group("model")
    src = model.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"a model_zoo preset: {', '.join(list_presets())}")
    src.add_argument("--config", help="a GPTConfig as a YAML or JSON file (keys of model_zoo.GPTConfig)")
    _int_flag(model, "--seq-length", 1, help="training sequence length (default: the model's)")
    model.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    model.add_argument("--precision", choices=sorted(PRECISIONS), default=DEFAULT_PRECISION)
    model.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES), default=DEFAULT_SETUP.optimizer)
    model.add_argument("--no-weight-decay", action="store_true",
                       help="weight decay 0 (one flat group instead of two)")
    _int_flag(model, "--bucket-size", "zero.bucket_size", default=DEFAULT_SETUP.bucket_size,
              help="ZeRO bucket size, elements")
    model.add_argument("--zero-reduce-once", action="store_true",
                       help="zero.reduce_once: ZeRO-2 keeps whole gradients and reduces them once per step under "
                            "accumulation (stage 1's collectives and gradient memory); stage 3 cannot, and is "
                            "planned without it")
    for key, counted in (("quantized_gradients", "packs every stage's DP gradient reduction"),
                         ("quantized_weights", "packs the parameter all-gathers; skips stage 0"),
                         ("quantization_block", "a 4-byte scale per block of every packed chunk"),
                         ("two_level_reduce", "DP gradient reductions inside each node, then across nodes on the "
                                              "node's share; layouts whose dp groups are not split evenly over "
                                              "the nodes are skipped"),
                         ("hpz_partition_size", "stage 3's backward re-gathers over the node's dp ranks, plus "
                                                "their secondary weight shard; skips stages 0-2 and layouts "
                                                "whose nodes hold another number of a dp group's ranks"),
                         ("overlap_param_gather", "stages 1-2's weight all-gathers are hidden behind one "
                                                  "micro-batch's forward; other stages are planned without it")):
        _zero_flag(model, key, counted)
    _int_flag(model, "--stage3-live-parameters", "zero.max_live_parameters",
              default=DEFAULT_SETUP.stage3_live_parameters,
              help="ZeRO-3: most parameter elements gathered at once (zero.max_live_parameters)")
    _int_flag(model, "--stage3-prefetch", "zero.prefetch_bucket_size", default=DEFAULT_SETUP.stage3_prefetch,
              help="ZeRO-3: elements gathered ahead of use (zero.prefetch_bucket_size; 0: no prefetch, and "
                   "forward keeps nothing for reuse within the window)")
    _int_flag(model, "--stage3-reuse", "zero.max_reuse_distance", default=DEFAULT_SETUP.stage3_reuse,
              help="ZeRO-3: forward keeps units used again within this many elements gathered, into "
                   "backward too (zero.max_reuse_distance; 0: only the prefetch window decides)")
    _int_flag(model, "--stage3-persistence-threshold", "zero.persistence_threshold",
              default=DEFAULT_SETUP.stage3_persistence_threshold,
              help="ZeRO-3: parameters this small stay whole on every rank (zero.persistence_threshold; 0: "
                   "every parameter is partitioned)")
    cl = ap.add_argument_group("cluster")
    cl.add_argument("--gpus", type=int, required=True)
    cl.add_argument("--gpus-per-node", type=int, required=True)
    cl.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 32GiB or 80GB")
    cl.add_argument("--cpu-memory", help="host memory per node, e.g. 1.5TiB (checked for offload layouts)")
    cl.add_argument("--reserved-memory", default="1GiB", help="per GPU, unusable by training (context, NCCL)")
    tm = ap.add_argument_group("step-time assumptions")
    tm.add_argument("--peak-tflops", type=float, default=125.0,
                    help="peak dense TFLOP/s per GPU (not used when --achieved-tflops is given)")
    tm.add_argument("--mfu", type=float, default=0.35,
                    help="fraction of peak the model's matmuls reach (not used when --achieved-tflops is given: "
                         "it wins over --peak-tflops x --mfu)")
    tm.add_argument("--achieved-tflops", type=float,
                    help="model TFLOP/s one GPU achieves (measured or known); overrides --peak-tflops x --mfu. "
                         "Compute = the step's model FLOPs per GPU (TP splits each matmul, DP the tokens) / this")
    tm.add_argument("--intra-node-bandwidth", type=float, default=150.0,
                    help="GB/s each GPU sends to the next GPU of a ring on its own node (NVLink)")
    tm.add_argument("--inter-node-bandwidth", type=float, default=100.0,
                    help="GB/s per NODE between nodes: all GPUs of a node share its one link, so inter-node "
                         "time = the bytes the whole node sends off it / this (a ring's bytes cross where the "
                         "next rank is on another node)")
    tm.add_argument("--latency", type=float, default=0.0,
                    help="seconds per ring step (one message hop) of every collective call, on the critical "
                         "path: an all-reduce over n ranks takes 2(n-1) steps, a reduce-scatter or all-gather n-1")
    tm.add_argument("--pcie-bandwidth", type=float, default=12.0, help="GB/s per GPU to host memory")
    tm.add_argument("--cpu-adam-rate", type=float, default=1e9, help="CPU Adam parameters/s per node")
    tm.add_argument("--fragmentation", type=float, default=DEFAULT_SETUP.fragmentation,
                    help="allowance as a fraction of the transient (activation and workspace) bytes")
    tm.add_argument("--device", choices=sorted(PROFILES), default="cuda",
                    help="whose kernels and collectives to count: cuda (GPUs, NCCL) or cpu (what the tests "
                         "measure)")
    ly = ap.add_argument_group("layouts to consider (default: all valid ones)")
    _int_flag(ly, "--tp", 1, nargs="+", help="tensor-parallel sizes")
    _int_flag(ly, "--pp", 1, nargs="+", default=[1], help="pipeline sizes (default 1: no pipeline; e.g. --pp 1 2 4 8)")
    ly.add_argument("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
                    help="the schedule of layouts with a pipeline")
    _int_flag(ly, "--virtual-stages", 1, nargs="+", default=[1],
              help="model chunks per pipeline stage to consider (above 1: the interleaved schedule)")
    ly.add_argument("--zero-stage", type=int, nargs="+", choices=ZERO_STAGES, default=list(ZERO_STAGES))
    ly.add_argument("--offload", nargs="+", choices=OFFLOAD_DEVICES, default=list(OFFLOAD_DEVICES))
    ly.add_argument("--recompute", nargs="+", choices=RECOMPUTES, default=list(RECOMPUTES))
    _int_flag(ly, "--micro-batch", 1, nargs="+", help="micro batch sizes")
    _int_flag(ly, "--max-micro-batch", 1, default=16, help="largest micro batch tried when --micro-batch is not given")
    ly.add_argument("--sequence-parallel", action="store_true", help="use sequence parallelism when tp > 1 (an "
                    "MoE model always does at tp > 1)")
    _int_flag(ly, "--expert-model-parallel-size", 1, nargs="+", dest="ep",
              help="expert-parallel sizes to consider for an MoE model (default: every divisor of dp that "
                   "divides --num-experts)")
    _int_flag(ly, "--context-parallel-size", 1, nargs="+", dest="cp", default=[1],
              help="context-parallel sizes to consider: each sequence split over cp ranks (two of 2 x cp chunks "
                   "each), key/value blocks passed around a ring (--cp-comm-type p2p); sizes the model or the "
                   "GPUs cannot take are skipped (default 1: no context parallelism; e.g. "
                   "--context-parallel-size 1 2 4 8)")
    ck = ap.add_argument_group("checkpoints")
    for key in ("async_save", "async_save_chunk_mb"):
        field = checkpoint_field(key)
        text = f"checkpoint.{key}: {field.metadata['help']} (planner: counted in host memory)"
        if isinstance(field.default, bool):
            ck.add_argument(field.metadata["flag"], action="store_true", help=text)
        else:
            _int_flag(ck, field.metadata["flag"], f"checkpoint.{key}", metavar="MIB", default=None, help=text)
    out = ap.add_argument_group("output")
    _int_flag(out, "--top", 1, default=15, help="rows of the table")
    out.add_argument("--json", action="store_true", help="print every layout as JSON instead of the table")
    return ap


def _int_flag(group: argparse._ArgumentGroup, flag: str, minimum: Union[int, str], **kwargs) -> argparse.Action:
    """An integer flag whose values (each, with ``nargs``) must be at least ``minimum``: a number, or a key of
    the training configuration (``"zero.bucket_size"``) whose lower bound (its field's ``ge``/``gt``) the flag
    shares. :func:`check_int_flags` refuses the values below it, in one line naming the flag."""
    rule = ""
    if isinstance(minimum, str):
        section, name = minimum.split(".")
        meta = {"zero": zero_field, "checkpoint": checkpoint_field}[section](name).metadata
        minimum, rule = (meta["ge"] if "ge" in meta else meta["gt"] + 1), f" (as config key {minimum})"
    action = group.add_argument(flag, type=int, **kwargs)
    action.minimum, action.rule = minimum, rule
    return action


def check_int_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """ValueError naming the first integer flag of ``parser`` (:func:`_int_flag`) given a value below its
    minimum."""
    for action in parser._actions:
        minimum = getattr(action, "minimum", None)
        value = getattr(args, action.dest, None)
        if minimum is None or value is None:
            continue
        for number in value if isinstance(value, list) else [value]:
            if number < minimum:
                flag = action.option_strings[0]
                raise ValueError(f"{flag} {number}: must be an integer >= {minimum}{action.rule}; give {flag} "
                                 f"{minimum} or more")


def _zero_flag(group: argparse._ArgumentGroup, key: str, counted: str) -> None:
    """``--zero-<key>`` with the choices, default and help of ``zero.<key>`` in the training configuration
    (a boolean: ``--zero-<key>`` / ``--no-zero-<key>``, as the trainer's), or the key's own flag where it
    has one (``--overlap-param-gather``); ``counted``: what it changes in the planner's prediction."""
    field = zero_field(key)
    flag, default = own_flag(f"zero.{key}", field.metadata), getattr(DEFAULT_SETUP, key)
    text = f"zero.{key}: {field.metadata['help']} (planner: {counted})"
    if isinstance(field.default, bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        return
    choices = field.metadata.get("choices")
    if isinstance(field.default, int) and not choices:
        _int_flag(group, flag, f"zero.{key}", metavar="N", default=default, help=text)
        return
    group.add_argument(flag, type=type(field.default), choices=tuple(choices) if choices else None,
                       metavar=None if choices else "N", default=default, help=text)


def load_model_config(args: argparse.Namespace) -> GPTConfig:
    """The preset or the config file, with ``--seq-length`` applied."""
    if args.model:
        config = get_preset(args.model)
    else:
        config = _read_config_file(args.config)
    if args.seq_length is not None:
        changes = {"seq_length": args.seq_length}
        if config.position == "learned" and config.num_positions < args.seq_length:
            changes["max_position_embeddings"] = args.seq_length
        config = config.replace(**changes)
    return config.validate(1)


def _read_config_file(path: str) -> GPTConfig:
    from hybrid.config.errors import ConfigError
    from hybrid.config.load import read_config_file

    try:
        data = read_config_file(path)
    except ConfigError as e:
        raise SystemExit(f"--config: {e}")
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of GPTConfig keys, got {type(data).__name__}")
    try:
        return GPTConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--config {path}: {e}")


def _compression(setup: TrainingSetup) -> str:
    """The compression formats, the two-level reduction and hpZ for the assumptions line ('' when all are off)."""
    formats = [f"{what} {q.describe()}" for what, q in (("gradients", setup.gradient_quant),
                                                         ("weights", setup.weight_quant)) if q is not None]
    text = f"; ZeRO collectives quantized: {', '.join(formats)}" if formats else ""
    text += "; DP gradients reduced inside each node, then across nodes" if setup.two_level_reduce else ""
    if setup.hpz_partition_size > 1:
        text += (f"; hpZ: ZeRO-3 backward re-gathers inside each node from a secondary shard over "
                 f"{setup.hpz_partition_size} ranks")
    return text


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_int_flags(parser, args)
        config = load_model_config(args)
        cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                          gpu_memory=parse_size(args.gpu_memory, "--gpu-memory"),
                          cpu_memory=parse_size(args.cpu_memory, "--cpu-memory") if args.cpu_memory else None,
                          reserved_memory=parse_size(args.reserved_memory, "--reserved-memory"),
                          peak_tflops=args.peak_tflops, mfu=args.mfu, intra_node_gbps=args.intra_node_bandwidth,
                          inter_node_gbps=args.inter_node_bandwidth, pcie_gbps=args.pcie_bandwidth,
                          cpu_adam_rate=args.cpu_adam_rate, latency_s=args.latency,
                          achieved_tflops=args.achieved_tflops)
        if not 0 <= args.fragmentation < 1:
            raise ClusterError(f"--fragmentation must be in [0, 1), got {args.fragmentation}")
        setup = TrainingSetup(optimizer=args.optimizer,
                              weight_decay=not args.no_weight_decay, bucket_size=args.bucket_size,
                              reduce_once=args.zero_reduce_once, overlap_param_gather=args.overlap_param_gather,
                              quantized_gradients=args.zero_quantized_gradients,
                              quantized_weights=args.zero_quantized_weights,
                              quantization_block=args.zero_quantization_block,
                              two_level_reduce=args.zero_two_level_reduce,
                              hpz_partition_size=args.zero_hpz_partition_size,
                              stage3_live_parameters=args.stage3_live_parameters,
                              stage3_prefetch=args.stage3_prefetch, stage3_reuse=args.stage3_reuse,
                              stage3_persistence_threshold=args.stage3_persistence_threshold,
                              async_save=args.async_save, async_save_chunk_mb=args.async_save_chunk_mb,
                              fragmentation=args.fragmentation,
                              profile=PROFILES[args.device])
        choices = Choices(tp=args.tp, pp=args.pp, pipeline_schedule=args.pipeline_schedule,
                          virtual_stages=args.virtual_stages, stages=args.zero_stage, offloads=args.offload, recomputes=args.recompute,
                          micro_batches=args.micro_batch, max_micro_batch=args.max_micro_batch,
                          sequence_parallel=args.sequence_parallel, precision=args.precision, ep=args.ep,
                          cp=tuple(args.cp))
        evaluations = plan(config, cluster, args.global_batch_size, setup, choices)
        placed = refused_placements(enumerate_layouts(config, cluster, args.global_batch_size, choices), cluster,
                                    setup)
    except (ClusterError, LayoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    skipped = [f"skipped ZeRO stage {stage}: {why}" for stage, why in refused_stages(args.zero_stage, setup).items()]
    skipped += [f"skipped ZeRO stage {stage}: {moe_stage_problem(config, stage)}" for stage in args.zero_stage
                if moe_stage_problem(config, stage)]
    skipped += [f"skipped tp={tp} x dp={dp}: {why}" for (tp, dp), why in placed.items()]
    if args.json:
        for line in skipped:
            print(line, file=sys.stderr)
        print(to_json(evaluations))
        return 0
    name = args.model or args.config
    print(f"model {name}: {count_parameters(config) / 1e9:.2f}B parameters, h={config.hidden_size}, "
          f"L={config.num_layers}, heads={config.num_heads}"
          f"{'' if config.kv_channels is None else f' of {config.head_dim} channels'}, seq {config.seq_length}, "
          f"global batch {args.global_batch_size}, {args.precision}, {args.optimizer}")
    if config.is_moe:
        print(f"MoE: {config.num_experts} experts of {config.expert_ffn_size} channels, top-{config.moe_router_topk}, "
              f"{sum(config.moe_layer_pattern())} of {config.num_layers} layers; "
              f"{active_parameters(config) / 1e9:.2f}B active parameters per token "
              f"({expert_parameters(config) / 1e9:.2f}B in routed experts); "
              f"{flops_per_token(config) / 1e9:.1f} GFLOP per token")
    print(f"cluster: {cluster.describe()}")
    print(f"assumptions: {cluster.assumptions()}; fragmentation allowance {args.fragmentation:g} of transients; "
          f"{args.device} device profile{_compression(setup)}")
    for line in skipped:
        print(line)
    print()
    print(format_table(evaluations, args.top))
    print()
    print(summary(evaluations))
    print()
    print(LEGEND)
    if config.is_moe:
        print(MOE_LEGEND)
    if any(e.candidate.cp > 1 for e in evaluations):
        print(CP_LEGEND)
    return 0
