"""The trainer's entry points for settings: :func:`parse_args` and :func:`validate`.

    config = parse_args(["--model", "tiny", "--zero-stage", "1", ...])   # a HybridConfig
    validate(config, world_size=4)                                      # before any process group
    Trainer(config).train()

The flags are derived from :class:`~hybrid.config.HybridConfig` (see
:mod:`hybrid.config.cli`); ``python -m hybrid.train --help`` lists them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from hybrid.config import HybridConfig, config_from_command_line, validate_for_training
from hybrid.config.flags import key_error
from hybrid.training.load_target import file_instead_of_folder, same_folder

# Errors about keys of the tree name their flags too.
_error = functools.partial(key_error, HybridConfig)

DESCRIPTION = "Pretrain a GPT with TP x DP x ZeRO. Every flag sets one key of the config tree (shown in brackets)."


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> HybridConfig:
    """Flags over ``--config FILE`` over defaults, typed and validated.

    ``world_size`` (default: torchrun's ``WORLD_SIZE``, when set): the rules of :func:`validate` for that many
    processes are checked too, so that one error lists every problem of the launch, before any process group.
    Raises :class:`~hybrid.config.ConfigError`; an unknown flag exits as argparse does, naming the rest too.
    Megatron-LM flags and DeepSpeed keys that change nothing here are named in one note on stderr, by rank 0
    alone (torchrun's ``RANK``; every rank parses the same flags).
    """
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    notes: List[str] = []
    config = config_from_command_line(argv, prog="hybrid-train", description=DESCRIPTION, notes=notes,
                                      underlay=checkpoint_model_settings,
                                      check=None if world_size is None else functools.partial(validate,
                                                                                              world_size=world_size))
    if notes and os.environ.get("RANK", "0") == "0":
        # a DeepSpeed config's notes each name their own kind of key; the flags' share one line
        flags = [n for n in notes if not n.startswith("DeepSpeed ")]
        if flags:
            print(f"hybrid-train: note: Megatron-LM flags with no effect here: {'; '.join(flags)}", file=sys.stderr)
        for note in notes:
            if note.startswith("DeepSpeed "):
                print(f"hybrid-train: note: {note}", file=sys.stderr)
    return config


def checkpoint_model_settings(config: HybridConfig) -> Dict[str, Any]:
    """With ``checkpoint.use_checkpoint_args``: the model settings (dotted keys) that ``checkpoint.load``'s
    checkpoint stored, as it was trained, less :attr:`~hybrid.config.ModelConfig.TRAINING_KEYS`; else none.

    Megatron-LM's ``--use-checkpoint-args``: an evaluation or a continued run gives the data and the layout,
    and the checkpoint gives the model. Settings the checkpoint does not know (unset, or keys of a later
    release) keep their defaults. Raises :class:`~hybrid.config.ConfigError` when there is no checkpoint to
    read, or it stores no trainer settings.
    """
    from hybrid.checkpoint import CheckpointError, CheckpointReader, find_resume_point
    from hybrid.config import ModelConfig, saved_tree

    ckpt = config.checkpoint
    if not ckpt.use_checkpoint_args or ckpt.load is None:  # validate names a missing checkpoint.load
        return {}
    keys = ("checkpoint.use_checkpoint_args", "checkpoint.load")
    try:
        path = find_resume_point(ckpt.load)
        if path is None:
            raise _error(f"'checkpoint.use_checkpoint_args': 'checkpoint.load' {ckpt.load} holds no checkpoint to "
                         f"read the model settings from", *keys)
        saved = CheckpointReader(path).trainer_state.get("client", {}).get("args")
    except CheckpointError as e:
        raise _error(f"'checkpoint.use_checkpoint_args': {e}", *keys) from None
    model = saved_tree(saved).get("model")
    if not model:
        raise _error(f"'checkpoint.use_checkpoint_args': {path} stores no trainer settings (it was not saved by "
                     f"hybrid-train): give the model's settings as flags instead", *keys)
    known = {f.name for f in dataclasses.fields(ModelConfig)} - set(ModelConfig.TRAINING_KEYS)
    return {f"model.{name}": value for name, value in model.items() if name in known}


def validate(config: HybridConfig, world_size: int) -> None:
    """Everything a trainer run needs, checked before any process group work.

    The config's own rules for this world (:func:`hybrid.config.validate_for_training`),
    then what only model_zoo and the filesystem can answer: the preset exists,
    the model shape works at this TP size, the data, tokenizer and load paths exist.
    """
    validate_for_training(config, world_size)
    _check_preset(config)
    _check_paths(config)
    _check_model(config)


def _check_preset(config: HybridConfig) -> None:
    from model_zoo.presets import list_presets

    preset = config.model.preset
    if preset is not None and preset not in list_presets():
        close = difflib.get_close_matches(preset, list_presets(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise _error(f"'model.preset' {preset!r} is not a model_zoo preset{hint}; choose one of "
                     f"{', '.join(list_presets())}", "model.preset")


def _check_paths(config: HybridConfig) -> None:
    data = config.data
    if not data.mock:
        from hybrid.data import parse_data_path, parse_split
        from hybrid.data.errors import DataError

        if data.path:  # the split divides data.path: a bad one is found here, not after the process group starts
            try:
                parse_split(data.split)
            except DataError as e:
                raise _error(f"'data.split': {e}", "data.split") from None

        for key in data.PATH_KEYS:
            if not getattr(data, key):
                continue
            try:
                pairs = parse_data_path(getattr(data, key))
            except ValueError as e:
                raise _error(f"'data.{key}': {e}", f"data.{key}") from None
            for _, prefix in pairs:
                for ext in (".bin", ".idx"):
                    if not os.path.isfile(prefix + ext):
                        raise _error(f"'data.{key}': {prefix + ext} does not exist; run tools/preprocess_data.py "
                                     f"to create it", f"data.{key}")
    if data.tokenizer.given:
        _check_tokenizer(config)
    board = config.logging.tensorboard_dir
    if board and os.path.exists(board) and not os.path.isdir(board):
        raise _error(f"'logging.tensorboard_dir' {board} is a file; give a directory for the event files",
                     "logging.tensorboard_dir")
    # A --load folder that does not exist yet is the first launch of a job that saves and resumes in one
    # place (--save DIR --load DIR); anywhere else it is a typo, refused rather than silently starting over.
    load, save = config.checkpoint.load, config.checkpoint.save
    misnamed = file_instead_of_folder(load) if load is not None else None
    if misnamed is not None:
        raise _error(f"'checkpoint.load' {misnamed}", "checkpoint.load")
    if load is not None and not os.path.exists(load) and not same_folder(load, save):
        raise _error(f"'checkpoint.load' {load}: no such directory (a folder that does not exist yet is only "
                     f"accepted when --save names the same folder, to start a run that will resume there)",
                     "checkpoint.load")
    if load is not None and not os.path.exists(load) and config.checkpoint.finetune:
        raise _error(f"'checkpoint.load' {load}: no such directory, so --finetune has no checkpoint to start from; "
                     f"give a checkpoint's folder (a Hugging Face model is imported with "
                     f"tools/convert_checkpoint.py from-hf first)", "checkpoint.load", "checkpoint.finetune")


def _check_tokenizer(config: HybridConfig) -> None:
    """The tokenizer's files exist and load, and every id it makes fits the model's vocabulary."""
    from hybrid.data.errors import DataError
    from hybrid.data.tokenizer_choice import load_tokenizer

    spec = config.data.tokenizer
    keys = [f"data.{setting}" for setting in spec.files]
    for setting, key in zip(spec.files, keys):
        path = getattr(spec, setting)
        if not os.path.exists(path):
            raise _error(f"'{key}' {path}: no such file", key)
    try:  # a directory or another file is the tokenizer's to name
        pieces = load_tokenizer(spec).vocab_size
    except DataError as e:
        raise _error(f"{spec.name}: {e}", *keys) from None
    vocab = config.model.vocab_size
    if vocab is not None and vocab < pieces:
        raise _error(f"'model.vocab_size' {vocab} is smaller than the {pieces} tokens of the {spec.name} tokenizer "
                     f"({', '.join(getattr(spec, s) for s in spec.files)}): its ids would fall outside the "
                     f"embedding; set it to at least {pieces}, or leave it unset to take the tokenizer's",
                     "model.vocab_size", *keys)


def _check_model(config: HybridConfig) -> None:
    from hybrid.training.model import keys_named_in, model_config

    try:
        model_config(config, vocab_size=config.model.vocab_size or 1).validate(
            config.tensor_parallel_size or 1, config.expert_parallel_size or 1, config.context_parallel_size or 1)
    except ValueError as e:
        raise _error(f"model settings: {e}", *keys_named_in(str(e))) from None
