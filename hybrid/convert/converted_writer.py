"""Writing another framework's state as a hybrid checkpoint: the in-memory source the offline writer reads
(:class:`MemorySource`), the loading job's layout (:func:`target_layout`) and the write itself
(:func:`write_converted`). Shared by ``from-deepspeed`` and ``from-megatron``."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch

from hybrid.checkpoint import CheckpointWriter
from hybrid.config.parse import config_from_dict
from hybrid.convert.consolidate import MASTER, WEIGHT, ConversionError, SavedTensor, Target
from hybrid.convert.output import ProgressFactory, nbytes_of, new_checkpoint_in, open_bar
from hybrid.convert.reshard import RankPlan, _weights_index, plan_rank, write_shares
from hybrid.convert.stages import pipeline_shares
from hybrid.layout import LayoutError, ParallelLayout, zero_stage
from hybrid.optim.weight_decay import exclude_1d_params
from hybrid.param_meta import REPLICATED, shard
from hybrid.zero.flat_buffer import dtype_name

# Adam's two moments as torch.optim and hybrid's checkpoints name them: what converters carry beside the masters
MOMENTS = ("exp_avg", "exp_avg_sq")

class MemorySource:
    """Whole fp32 tensors under hybrid's names, with the parts of :class:`~hybrid.convert.CheckpointSource` the
    offline writer reads: ``tensors``, ``read``, ``has_state``, ``state_keys``, ``optimizer_header``."""

    def __init__(self, full: Dict[str, Dict[str, torch.Tensor]], layout: Dict[str, tuple], dtype: torch.dtype,
                 buffers: Dict[str, torch.Tensor], header: dict, model_config: dict, path: Path):
        self.full, self.buffers, self.header = full, buffers, header
        self.reader = type("Reader", (), {"model_config": model_config, "path": path})()
        self.tensors: Dict[str, SavedTensor] = {}
        for name, (shape, meta) in layout.items():
            decay = not exclude_1d_params(name, torch.empty(shape, device="meta"))  # the engine's default rule
            record = {"name": name, "dtype": dtype_name(dtype), "weight_decay": decay, "tp_meta": meta.to_json()}
            self.tensors[name] = SavedTensor(name, shape, dtype, meta, shape, record)
        for name, t in buffers.items():
            self.tensors[name] = SavedTensor(name, tuple(t.shape), t.dtype, REPLICATED, tuple(t.shape), None)

    def has_state(self, name: str) -> bool:
        return name in self.full[MASTER]

    def state_keys(self) -> List[str]:
        return [MASTER] + sorted(MOMENTS)

    def optimizer_header(self) -> dict:
        return dict(self.header)

    def read(self, name: str, what: str = WEIGHT, *, target: Optional[Target] = None,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if name in self.buffers:
            return self.buffers[name].clone()
        t = self.tensors[name]
        full = self.full[MASTER if what == WEIGHT else what][name]
        if what == WEIGHT:
            full = full.to(t.dtype)  # the model file holds the masters rounded to the run's precision
        piece = full.clone() if target is None else shard(full, target.meta, target.tp, target.rank)
        return piece if dtype is None else piece.to(dtype)


def target_layout(tp: int, dp: int, pp: int, target_zero_stage: int, bucket_size: int) -> ParallelLayout:
    """The loading job's layout (fp32; the caller sets the run's precision), its flags named in any refusal."""
    try:
        target = ParallelLayout(tp=tp, dp=dp, pp=pp, zero_stage=zero_stage(target_zero_stage, "--target-zero-stage"))
    except (ValueError, LayoutError) as e:
        raise ConversionError(f"cannot write --tp {tp} --dp {dp} --pipeline-model-parallel-size {pp} "
                              f"--target-zero-stage {target_zero_stage}: {e}") from None
    if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < 1:
        raise ConversionError(f"--zero-bucket-size must be an integer >= 1, got {bucket_size!r}")
    return target


def write_converted(src: MemorySource, save, target: ParallelLayout, *, iteration: int, consumed_samples: int,
                    trainer_state: dict, bucket_size: int, description: str, with_optimizer: bool = True,
                    progress: Optional[ProgressFactory] = None, force: bool = False) -> Path:
    """Write ``src`` (another framework's state under hybrid's names) into ``save`` as iteration ``iteration`` of
    a ``target`` job with ``bucket_size``: model files, and with ``with_optimizer`` the ZeRO partitions the
    optimizer's own rules plan (:func:`hybrid.convert.reshard.plan_rank`), each pipeline rank's share as its
    model builds it. ``description`` names the source on the progress bar. Returns the iteration directory."""
    model_config = src.reader.model_config
    _, shares = pipeline_shares(model_config, config_from_dict({"pipeline": {"size": target.pp}}).pipeline, target.pp)
    if with_optimizer:
        plans, keys = [plan_rank(src, target, bucket_size, share) for share in shares], src.state_keys()
    else:
        plans, keys = [RankPlan((_weights_index(src, target, share), [])) for share in shares], []
    # what the bar counts: every TP piece of the model files, every DP rank's file of every partition
    total = target.tp * sum(nbytes_of(src.tensors[n].target_shape(Target(src.tensors[n].meta, target.tp, 0)),
                                      src.tensors[n].dtype) for share in shares for n in share.entries)
    total += target.tp * target.dp * sum(g["partition_numel"] * 4 * len(keys) for plan in plans
                                         for _, groups in plan.halves() for g in groups)
    with new_checkpoint_in(save, iteration, force=force):
        bar = open_bar(progress, f"{description} to {target.describe()}", total)
        writer = CheckpointWriter(save, iteration, target)
        try:
            writer.prepare()
            records, param_index = write_shares(writer, src, target, shares, plans, keys, bar)
            writer.commit(records, consumed_samples=consumed_samples, model_config=model_config,
                          param_index=param_index, trainer_state=trainer_state)
        finally:
            bar.close()
    return writer.iter_dir
