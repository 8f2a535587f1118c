"""Sample text from a trained checkpoint: ``python -m hybrid.training.generate --load DIR --prompt "..."``.

The checkpoint's TP shards (and pipeline stages) are merged into one TP=1
model in this process, one parameter at a time through
:class:`~hybrid.convert.CheckpointSource`, so generation needs no process
group whatever layout trained the model. Decoding is greedy,
or sampling with temperature, top-k and top-p.
"""

from __future__ import annotations

import math
import sys
from typing import List, Optional

import torch

from hybrid import param_meta
from hybrid.argument_parser import ArgumentParser
from hybrid.checkpoint import CheckpointError, CheckpointReader
from hybrid.convert.consolidate import CheckpointSource, Target
from hybrid.data.errors import DataError
from hybrid.data.tokenizer_choice import add_tokenizer_arguments, load_tokenizer, spec_from_arguments
from hybrid.topology import Topology


def load_model(load_dir) -> "torch.nn.Module":
    """A TP=1 :class:`model_zoo.GPTModel` holding the weights of the checkpoint at ``load_dir``."""
    from model_zoo import GPTConfig, GPTModel

    reader = CheckpointReader(load_dir)
    config = GPTConfig.from_dict(reader.model_config).replace(sequence_parallel=False, recompute="none")
    model = GPTModel(config, Topology.local(), device="meta")
    state = {}
    # the parameters in fp32, and the persistent buffers (an MoE router's fp32 expert bias) as the model keeps them
    persistent = set(model.state_dict(keep_vars=True))
    tensors = [(name, p, torch.float32) for name, p in model.named_parameters()]
    tensors += [(name, b, b.dtype) for name, b in model.named_buffers() if name in persistent]
    with CheckpointSource(reader) as src:
        for name, t, dtype in tensors:
            # the piece of a one-rank layout: at TP=1 the padded vocabulary keeps its own padding
            state[name] = src.read_weight(name, Target(param_meta.get_tp_meta(t), 1, 0), dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the ``top_k`` largest and the smallest set of tokens whose probability reaches ``top_p``."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens before it already reach top_p.
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(model, prompt_ids: List[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, greedy: bool = False, eod_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None, vocab_size: Optional[int] = None) -> List[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens (stops early at ``eod_id``).

    ``model`` is a TP=1 GPTModel; the context is cut to its last ``seq_length`` tokens.
    ``vocab_size`` (the tokenizer's) keeps ids the tokenizer cannot decode out of the choice.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if temperature <= 0 and not greedy:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}; use greedy decoding instead")
    ids = list(prompt_ids)
    window = model.config.seq_length
    vocab = min(model.config.vocab_size, vocab_size or model.config.vocab_size)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.int64)
        logits = model(context)[0, -1, :vocab].float()
        if greedy:
            nxt = int(torch.argmax(logits))
        else:
            probs = torch.softmax(_filter_logits(logits / temperature, top_k, top_p), dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        ids.append(nxt)
        if eod_id is not None and nxt == eod_id:
            break
    return ids[len(prompt_ids):]


def _check_args(args) -> None:
    """Refuse out-of-range sampling flags before anything is loaded (ValueError naming the flag)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.greedy and not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise ValueError(f"--temperature must be > 0 for sampling, got {args.temperature:g}; "
                         f"pass --greedy to always take the most likely token")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 disables it), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1 disables it), got {args.top_p:g}")


def main(argv=None) -> int:
    parser = ArgumentParser(prog="generate", description="Generate text from a hybrid checkpoint.")
    parser.add_argument("--load", required=True, help="checkpoint directory (its 'latest') or DIR/iter_N")
    add_tokenizer_arguments(parser, "the tokenizer the model was trained with")
    parser.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens (>= 1)")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, default=0.8, help="> 0; ignored with --greedy")
    parser.add_argument("--top-k", type=int, default=40, help="0 disables")
    parser.add_argument("--top-p", type=float, default=0.95, help="in (0, 1]; 1 disables")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        out = _run(args)
    except CheckpointError as e:
        print(f"generate: error: {e} (--load)", file=sys.stderr)
        return 1
    except (DataError, ValueError, OSError) as e:  # the tokenizer's errors name its flags
        print(f"generate: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _run(args) -> str:
    tokenizer = load_tokenizer(spec_from_arguments(args))
    model = load_model(args.load)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer ({tokenizer!r}) has {tokenizer.vocab_size} tokens but the checkpoint's "
                         f"model has {model.config.vocab_size}; use the tokenizer the model was trained with")
    prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eod_id]
    if not prompt:
        raise ValueError(f"--prompt {args.prompt!r} holds no token; give some text, or leave --prompt out to "
                         f"start a document")
    generator = torch.Generator().manual_seed(args.seed)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, greedy=args.greedy, eod_id=tokenizer.eod_id, generator=generator,
                   vocab_size=tokenizer.vocab_size)
    # Decode prompt and continuation together so that word boundaries between them survive.
    ids = (prompt if args.prompt else []) + out
    return tokenizer.decode([t for t in ids if t != tokenizer.eod_id])


if __name__ == "__main__":
    raise SystemExit(main())
