#!/usr/bin/env python
"""Convert hybrid checkpoints: to another layout, to one fp32 file, to and from Hugging Face.

    python tools/convert_checkpoint.py reshard --load ckpt --save ckpt_tp4 --target-tp 4 [--target-dp 2]
                                              [--pipeline-model-parallel-size 2 [--pipeline-layers-per-stage 1 3]]
    python tools/convert_checkpoint.py to-fp32 --load ckpt/iter_0001000 --output model_fp32.safetensors
    python tools/convert_checkpoint.py to-hf   --load ckpt --output hf_model [--tokenizer-model spm.model]
    python tools/convert_checkpoint.py from-hf --input hf_model --save ckpt_hf --tp 2
    python tools/convert_checkpoint.py from-deepspeed --input ds_ckpt --hf-config hf_model/config.json --save ckpt \
                                              --tp 2 --dp 2 [--target-zero-stage 1]
    python tools/convert_checkpoint.py from-megatron --load megatron_ckpt --save ckpt --tp 2 --dp 2 [--no-load-optim]
    python tools/convert_checkpoint.py to-dcp  --load ckpt --output ckpt_dcp
    python tools/convert_checkpoint.py from-dcp --input ckpt_dcp --save ckpt_back [--model-config model.json]

``--load`` takes a save directory (its ``latest``) or one ``DIR/iter_N``.
Every subcommand streams one tensor at a time, shows a tqdm progress bar
(``--no-progress`` hides it), needs no process group, and exits with status 1
and a one-line error for bad input (a missing or corrupted shard, a model the
target cannot hold, an unknown architecture). ``--load`` with a different
layout also works directly in the trainer; ``reshard`` is for when the loading
job should not pay for it. ``reshard`` and ``from-hf`` take ``--save``'s lock,
as a training job does, and refuse a folder that already holds checkpoints
(their ``latest`` would move) unless ``--force``. See docs/convert.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing

if __package__ in (None, ""):
    _REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)

from hybrid.argument_parser import ArgumentParser  # noqa: E402
from hybrid.checkpoint import CheckpointError  # noqa: E402
from hybrid.data.tokenizer_choice import add_tokenizer_arguments  # noqa: E402
from hybrid.layout import PRECISIONS  # noqa: E402
from hybrid.tokenizer_files import TokenizerSpec  # noqa: E402


def _size(text: str) -> int:
    """'5GB', '500MB', '10KB' (powers of 1000, like save_pretrained) or a byte count."""
    units = {"TB": 10 ** 12, "GB": 10 ** 9, "MB": 10 ** 6, "KB": 10 ** 3, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * factor)
    return int(t)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("reshard", help="rewrite a checkpoint in another TP / DP / PP / ZeRO-stage layout")
    r.add_argument("--load", required=True, help="save directory or DIR/iter_N")
    r.add_argument("--save", required=True, help="new save directory")
    r.add_argument("--target-tp", type=int, required=True, help="tensor-parallel size of the loading job")
    r.add_argument("--target-dp", type=int, help="data-parallel size (default: the saved one)")
    # Which stages an offline reshard can write is hybrid.convert.reshard's rule; it explains a refusal.
    r.add_argument("--target-zero-stage", type=int, help="ZeRO stage (default: the saved one)")
    r.add_argument("--target-ep", type=int,
                   help="expert-parallel size, the loading job's --expert-model-parallel-size (default: the saved one)")
    r.add_argument("--zero-bucket-size", type=int,
                   help="the loading job's --zero-bucket-size (default: the saved run's)")
    # The loading job's pipeline settings, spelled as its own flags (hybrid.convert.reshard.SPLIT_KEYS).
    for key, leaf in _pipeline_leaves():
        many = typing.get_origin(leaf.kind) is list
        default = "the saved pipeline size" if key == "size" else \
            "the saved run's split if the size stays and no split flag is given"
        r.add_argument(leaf.flag, dest=f"pipeline_{key}", type=int, nargs="+" if many else None, metavar="N",
                       help=f"the loading job's {leaf.flag} (default: {default})")

    f = sub.add_parser("to-fp32", help="one consolidated fp32 safetensors file of the full model")
    f.add_argument("--load", required=True, help="save directory or DIR/iter_N")
    f.add_argument("--output", required=True, help="FILE.safetensors")

    h = sub.add_parser("to-hf", help="a Hugging Face transformers directory (GPT2LMHeadModel, LlamaForCausalLM, "
                                     "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
                                     "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)")
    h.add_argument("--load", required=True, help="save directory or DIR/iter_N")
    h.add_argument("--output", required=True, help="directory to write config.json and model*.safetensors into")
    h.add_argument("--dtype", choices=PRECISIONS, help="tensor dtype (default: the run's precision)")
    h.add_argument("--max-shard-size", type=_size, default="5GB", help="split model.safetensors past this (5GB)")
    add_tokenizer_arguments(h, "the run's tokenizer, checked and exported beside the weights (tokenizer.model; "
                               "vocab.json and merges.txt; tokenizer.json; default: none, and the path recorded "
                               "in the checkpoint is never used)")
    h.add_argument("--architecture", help="the HF class to write when several fit the model's switches (e.g. "
                                          "MistralForCausalLM; default: the one it was imported from, else the "
                                          "first that fits)")

    i = sub.add_parser("from-hf", help="import a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, "
                                       "Qwen2-MoE or Qwen3-MoE directory (for --load --finetune)")
    i.add_argument("--input", required=True, help="directory with config.json and safetensors or pytorch_model.bin")
    i.add_argument("--save", required=True, help="save directory for the hybrid checkpoint")
    i.add_argument("--tp", type=int, default=1, help="tensor-parallel size to shard for (default 1)")
    i.add_argument("--dtype", choices=PRECISIONS, help="dtype (default: the HF weights' dtype)")

    d = sub.add_parser("to-dcp", help="a torch.distributed.checkpoint folder, torchtitan's layout: the weights and, "
                                      "for Adam, the moments and step (hybrid.convert.dcp)")
    d.add_argument("--load", required=True, help="save directory or DIR/iter_N")
    d.add_argument("--output", required=True, help="a new (or empty) folder for the DCP files")
    d.add_argument("--dtype", choices=PRECISIONS, help="weight dtype (default: the fp32 masters of a bf16/fp16 run "
                                                       "with optimizer state, else as saved)")
    d.add_argument("--no-optimizer", action="store_true", help="write the weights alone")
    e = sub.add_parser("from-dcp", help="import a torch.distributed.checkpoint folder (TP=1, DP=1; the Adam state "
                                        "too where it holds one); nothing in it is unpickled but plain data")
    e.add_argument("--input", required=True, help="the DCP folder (with its .metadata)")
    e.add_argument("--save", required=True, help="save directory for the hybrid checkpoint")
    e.add_argument("--model-config", help="JSON of the model's settings (a hybrid metadata.json's model_config; "
                                          "default: the folder's hybrid_model_config.json, which to-dcp writes)")
    e.add_argument("--dtype", choices=PRECISIONS, help="the run's precision (default: the weights' dtype)")

    ds = sub.add_parser("from-deepspeed", help="a DeepSpeed ZeRO-1/2/3 checkpoint of a Hugging Face GPT-2 or Llama "
                                               "(deepspeed.initialize) with its Adam state and step, to continue "
                                               "training (hybrid.convert.from_deepspeed)")
    ds.add_argument("--input", required=True, help="the folder DeepSpeed saved into (its latest) or a global_stepN")
    ds.add_argument("--tag", help="the global_stepN folder to read (default: the one latest names)")
    ds.add_argument("--hf-config", help="a Hugging Face model's config.json (or the folder with it)")
    ds.add_argument("--model-config", help="Megatron-DeepSpeed GPT saved without its args: a JSON of them "
                                           "(num_layers, hidden_size, num_attention_heads, seq_length, ...)")
    ds.add_argument("--save", required=True, help="save directory for the hybrid checkpoint")

    mg = sub.add_parser("from-megatron", help="a Megatron-LM (Megatron-Core GPT) checkpoint, --ckpt-format torch or "
                                              "torch_dist, with its Adam state and step, to continue training "
                                              "(hybrid.convert.from_megatron)")
    mg.add_argument("--load", required=True, help="the Megatron-LM save folder (its latest_checkpointed_iteration.txt) "
                                                  "or one iter_XXXXXXX")
    mg.add_argument("--ckpt-step", type=int, help="the iteration to read (default: the one the tracker file names)")
    mg.add_argument("--save", required=True, help="save directory for the hybrid checkpoint")
    mg.add_argument("--no-load-optim", action="store_true",
                    help="the weights alone (train from them with --finetune); default: with the Adam state")
    for s in (ds, mg):  # the loading job's layout, spelled as its own flags
        s.add_argument("--tp", type=int, default=1, help="its --tensor-model-parallel-size (default 1)")
        s.add_argument("--dp", type=int, default=1, help="its data-parallel size (default 1)")
        s.add_argument("--pipeline-model-parallel-size", dest="pp", type=int, default=1, help="its pipeline size (1)")
        s.add_argument("--target-zero-stage", type=int, default=1, help="its --zero-stage (default 1)")
        s.add_argument("--zero-bucket-size", type=int, help="its --zero-bucket-size (default: the trainer's)")

    for s in (r, i, ds, mg, e):  # the subcommands that write a hybrid checkpoint, moving --save's latest
        s.add_argument("--force", action="store_true",
                       help="write into a --save folder that already holds checkpoints (its latest then names the "
                            "new one; default: refuse)")
    for s in (r, f, h, i, ds, mg, d, e):
        s.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _pipeline_leaves():
    from hybrid.config.flags import leaves
    from hybrid.config.schema import HybridConfig
    from hybrid.convert.reshard import SPLIT_KEYS

    every = leaves(HybridConfig)
    return [(key, every[f"pipeline.{key}"]) for key in SPLIT_KEYS]


def _progress(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return lambda desc, total: tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                    dynamic_ncols=True)


def run(args) -> str:
    progress = _progress(not args.no_progress)
    if args.command == "reshard":
        from hybrid.convert.reshard import reshard_checkpoint

        pipeline = {key: getattr(args, f"pipeline_{key}") for key, _ in _pipeline_leaves()}
        out = reshard_checkpoint(args.load, args.save, target_tp=args.target_tp, target_dp=args.target_dp,
                                 target_zero_stage=args.target_zero_stage, bucket_size=args.zero_bucket_size,
                                 target_ep=args.target_ep, pipeline={k: v for k, v in pipeline.items() if v is not None},
                                 progress=progress, force=args.force)
        return f"wrote {out}"
    if args.command == "to-fp32":
        from hybrid.convert.fp32 import export_fp32

        return f"wrote {export_fp32(args.load, args.output, progress=progress)}"
    if args.command == "to-hf":
        from hybrid.convert.hf import export_to_hf

        tokenizer = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
        res = export_to_hf(args.load, args.output, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                           tokenizer=tokenizer if tokenizer.given else None, architecture=args.architecture,
                           progress=progress)
        lines = [f"wrote {res.architecture} to {res.directory} ({len(res.files)} weight file(s))"]
        if res.tokenizer_files:
            lines.append(f"copied the tokenizer ({tokenizer.name}) to {', '.join(map(str, res.tokenizer_files))}")
        if res.note:
            lines.append(f"note: {res.note}")
        return "\n".join(lines)
    if args.command == "to-dcp":
        from hybrid.convert.dcp import export_to_dcp

        res = export_to_dcp(args.load, args.output, dtype=args.dtype, optimizer=not args.no_optimizer,
                            progress=progress)
        what = "weights and Adam state" if res["optimizer"] else "weights"
        return f"wrote the {what} of {res['tensors']} tensors to {res['folder']}" + \
            (f"\nnote: {res['note']}" if res["note"] else "")
    if args.command == "from-dcp":
        from hybrid.convert.dcp import import_from_dcp

        out = import_from_dcp(args.input, args.save, model_config=args.model_config, dtype=args.dtype,
                              force=args.force, progress=progress)
        return f"wrote {out}; train from it with --load {args.save} (add --finetune for the weights alone)"
    if args.command == "from-deepspeed":
        from hybrid.convert.from_deepspeed import convert_from_deepspeed
        from hybrid.convert.reshard import DEFAULT_BUCKET_SIZE

        out = convert_from_deepspeed(args.input, args.save, hf_config=args.hf_config,
                                     model_config=args.model_config, tp=args.tp, dp=args.dp,
                                     pp=args.pp, target_zero_stage=args.target_zero_stage, tag=args.tag,
                                     bucket_size=DEFAULT_BUCKET_SIZE if args.zero_bucket_size is None
                                     else args.zero_bucket_size, progress=progress,
                                     force=args.force)
        return (f"wrote {out}; continue training from it with --load {args.save} --no-load-rng (DeepSpeed saves no "
                f"random state) and the run's model, optimizer and learning-rate settings")
    if args.command == "from-megatron":
        from hybrid.convert.from_megatron import convert_from_megatron
        from hybrid.convert.reshard import DEFAULT_BUCKET_SIZE

        out = convert_from_megatron(args.load, args.save, tp=args.tp, dp=args.dp, pp=args.pp,
                                    target_zero_stage=args.target_zero_stage, iteration=args.ckpt_step,
                                    bucket_size=DEFAULT_BUCKET_SIZE if args.zero_bucket_size is None
                                    else args.zero_bucket_size, load_optimizer=not args.no_load_optim,
                                    progress=progress, force=args.force)
        how = "--finetune" if args.no_load_optim else "--no-load-rng (Megatron's random state is CUDA's)"
        return f"wrote {out}; continue training from it with --load {args.save} {how} and the run's model settings"
    from hybrid.convert.hf import import_from_hf

    out = import_from_hf(args.input, args.save, tp=args.tp, dtype=args.dtype, progress=progress, force=args.force)
    return f"wrote {out}; train from it with --load {args.save} --finetune"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(run(args))
    except (CheckpointError, ValueError, OSError) as e:
        print(f"convert_checkpoint {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
