"""``GPTModel``: a pre-LN decoder-only transformer over tensor-parallel layers.

Parameter names (a converter maps them to other formats)::

    embedding.word_embeddings.weight          [V_p/tp, h]  vocab-parallel, padded rows zero
    embedding.position_embeddings.weight      [P, h]       learned positions only, replicated
    layers.{i}.input_norm.{weight,bias}       [h]          replicated
    layers.{i}.attention.qkv_proj.{weight,bias}  [(nh/tp + 2 ng') d, h]  column-parallel [q; k; v]
                                              (model_zoo.qkv_layout; ng' = max(1, ng/tp) key/value heads)
    layers.{i}.attention.{q,k}_norm.{weight,bias}  [d]     qk_norm only, replicated
    layers.{i}.attention.out_proj.weight      [h, nh d/tp] row-parallel (bias [h] replicated; nh d = h unless
                                              kv_channels sets d)
    layers.{i}.post_attention_norm.{weight,bias}
    layers.{i}.mlp.in_proj.{weight,bias}      [f/tp, h] (GELU) or [2f/tp, h] ([gate; up], stride 2)
    layers.{i}.mlp.out_proj.weight            [h, f/tp]    row-parallel (bias [h] replicated)
    layers.{i}.mlp.router.weight, .experts.{e}.*, .shared_expert.*   an MoE layer's (model_zoo.moe,
                                              docs/moe.md): experts named by global index, this ep rank's only
    final_norm.{weight,bias}
    lm_head.weight                            [V_p/tp, h]  untied models only

Biases and the LayerNorm bias exist only when ``config.bias``; the qkv bias
when ``config.attention_bias`` (``qkv_bias``, else ``bias``).

Under pipeline parallelism (``topology.pp_size > 1``) each rank builds only
its stage's share (:mod:`hybrid.pipeline.split`): the embedding on the first
stage, its layers (named by their global index, so names match the whole
model's), and the final norm and head on the last. With tied embeddings the
last stage holds a copy of ``embedding.word_embeddings.weight`` under the same
name, initialised identically; the engine sums the two copies' gradients over
the ``"embed"`` axis, so they stay equal. :meth:`GPTModel.forward_part` runs
one part; ``forward`` is the whole model at pp=1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import param_meta
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, column_parallel_linear
from hybrid.tensor_parallel.mappings import copy_to_tp_region, gather_from_tp_region
from hybrid.context_parallel.loss import context_parallel_mean
from hybrid.context_parallel.split import split_for_rank
from hybrid.pipeline.split import StageSplit, split_layers
from hybrid.tensor_parallel.random import RNGTracker, checkpoint
from model_zoo.config import GPTConfig, context_parallel_problem
from model_zoo.moe import AuxLossScale, update_expert_biases
from model_zoo.qkv_layout import qkv_layout
from model_zoo.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from model_zoo.transformer import TransformerLayer, dropout, make_norm

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


class PositionTable(nn.Module):
    """Learned position embeddings ``weight`` ``[P, h]``, replicated over ``"tp"``."""

    def __init__(self, num_positions: int, hidden_size: int, init: tp_init.Initializer, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_positions, hidden_size, device=device, dtype=dtype))
        param_meta.set_tp_meta(self.weight)
        tp_init.set_initializer(self.weight, init)


class LayerStack(nn.Module):
    """Transformer layers named by their global index (``layers.{i}``), iterated in order.

    The whole model at pp=1; one pipeline stage's layers otherwise, whose names
    are those of the same layers in the whole model. Indexing is by position.
    """

    def __init__(self, layers: Dict[int, nn.Module]):
        super().__init__()
        for i in sorted(layers):
            self.add_module(str(i), layers[i])

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, position: int) -> nn.Module:
        return list(self._modules.values())[position]

    def by_index(self, index: int) -> nn.Module:
        """The layer whose global index is ``index``."""
        return self._modules[str(index)]


class GPTEmbedding(nn.Module):
    """Token (+ learned position) embeddings: ids ``[s, b]`` -> ``[s, b, h]`` (``[s/tp, b, h]`` under SP).

    ``positions=False`` leaves out the position table: the last pipeline stage's copy of tied word
    embeddings, used only as the output head.
    """

    def __init__(self, config: GPTConfig, topology: "Topology", device=None, dtype=None, positions: bool = True):
        super().__init__()
        self.topology = topology
        self.sequence_parallel = config.sequence_parallel
        init = tp_init.normal(config.init_std)
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, topology,
                                                      pad_multiple=config.vocab_pad_multiple,
                                                      sequence_parallel=config.sequence_parallel, init=init,
                                                      device=device, dtype=dtype)
        self.position_embeddings = (PositionTable(config.num_positions, config.hidden_size, init, device, dtype)
                                    if config.position == "learned" and positions else None)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            topo, weight = self.topology, self.position_embeddings.weight
            if self.sequence_parallel:
                # Each rank embeds only its sequence shard, so the table's gradient is partial.
                position_ids = position_ids.chunk(topo.tp_size, dim=0)[topo.tp_rank]
                weight = copy_to_tp_region(weight, topo)
            x = x + F.embedding(position_ids, weight)
        return x


class GPTModel(nn.Module):
    """Decoder-only transformer; see the module docstring for parameters and layouts.

    ``GPTModel(config, topology, device=None, dtype=None, seed=1234)``
    validates ``config`` against the topology's TP, expert- and context-parallel sizes and initialises every
    parameter from ``(seed, name)`` (identical full model at any TP size),
    unless ``device="meta"``: then :meth:`materialize` does it later.
    ``seed`` also seeds the dropout streams (:class:`RNGTracker`).

    ``split``: which layers each pipeline stage builds (default: the balanced
    split of :func:`hybrid.pipeline.split.split_layers`, one part per stage).
    """

    def __init__(self, config: GPTConfig, topology: "Topology", device=None, dtype=None, seed: int = 1234,
                 split: Optional[StageSplit] = None):
        super().__init__()
        config.validate(topology.tp_size, topology.ep_size, topology.cp_size)
        self.config, self.topology, self.seed = config, topology, int(seed)
        self.split = split if split is not None else split_layers(config.num_layers, topology.pp_size)
        if self.split.pp != topology.pp_size or sum(self.split.counts()) != config.num_layers:
            raise ValueError(f"the stage split {self.split.counts()} is for pp={self.split.pp}, not for this "
                             f"topology's pp={topology.pp_size} and num_layers={config.num_layers}")
        stage = topology.pp_rank
        self.is_first_stage, self.is_last_stage = self.split.holds_embedding(stage), self.split.holds_head(stage)
        self.rng_tracker = RNGTracker(self.seed, topology)
        device = torch.device(device) if device is not None else topology.device
        self.embedding = None
        if self.is_first_stage or (self.is_last_stage and config.tie_embeddings):
            self.embedding = GPTEmbedding(config, topology, device, dtype, positions=self.is_first_stage)
            if config.tie_embeddings and topology.pp_size > 1:
                param_meta.set_pipeline_tied(self.embedding.word_embeddings.weight)
        # Process groups are made collectively over the world: every stage makes the ones the attention layers
        # need (key/value heads replicated over tp/k ranks), whether or not it builds any layer.
        layout = qkv_layout(config)
        for _, _, k in param_meta.replicated_runs(layout.tp_meta(), layout.out_features, topology.tp_size):
            topology.enable_tp_subgroups(k)
        # MoE layers (config.moe_layer_pattern) share one balancing-loss gradient scale (model_zoo.moe)
        self.moe_aux_scale = AuxLossScale() if config.is_moe else None
        pattern = config.moe_layer_pattern()
        self.layers = LayerStack({i: TransformerLayer(config, topology, self.rng_tracker, device, dtype,
                                                      moe_aux_scale=self.moe_aux_scale if pattern[i] else None)
                                  for i in self.split.layers_of_rank(stage)})
        self.final_norm = make_norm(config, topology, device, dtype) if self.is_last_stage else None
        self.lm_head = None
        if not config.tie_embeddings and self.is_last_stage:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, topology, bias=False,
                                                sequence_parallel=config.sequence_parallel,
                                                pad_multiple=config.vocab_pad_multiple,
                                                weight_init=tp_init.normal(config.init_std), device=device,
                                                dtype=dtype)
        self.check_inputs = True  # one host sync per step; switch off once the data is trusted
        if device.type != "meta":
            self.materialize()

    # ---- initialisation ---------------------------------------------------------------------
    def materialize(self, device=None, dtype=None, only=None) -> "GPTModel":
        """(Re)initialise parameters from ``(self.seed, name)``; meta parameters become real on ``device``."""
        tp_init.materialize(self, self.seed, self.topology, device=device, dtype=dtype, only=only)
        for module in self.modules():  # buffers made on the meta device (the MoE router's expert bias) start at 0
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[key] = torch.zeros(buf.shape, dtype=buf.dtype,
                                                       device=device if device is not None else self.topology.device)
        return self

    def after_optimizer_step(self) -> None:
        """What the engine calls after every optimizer step, on every rank: the MoE layers' expert-bias update
        (collective over ``dp``, and ``tp`` at TP > 1; nothing for a dense model)."""
        if self.moe_aux_scale is not None:
            update_expert_biases(self)

    # ---- shapes -----------------------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        return self.config.padded_vocab_size(self.topology.tp_size)

    def head_weight(self) -> torch.Tensor:
        """The ``[V_p/tp, h]`` output projection (the word embeddings when tied); last stage only."""
        return self.embedding.word_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def parameters_of_part(self, part: int) -> Iterator[nn.Parameter]:
        """The parameters pipeline part ``part`` (one of this stage's) computes with, which its backward gives
        gradients to: the embedding on the first part, the part's layers, the final norm and head on the last
        (the tied word embeddings there). The ZeRO optimizer reduces a part's gradients alone after its pass."""
        first, end = self.split.ranges[part]
        if part == 0:
            yield from self.embedding.parameters()
        for i in range(first, end):
            yield from self.layers.by_index(i).parameters()
        if part == self.split.num_parts - 1:
            yield from self.final_norm.parameters()
            yield self.head_weight()

    def activation_shape(self, batch: int, seq: int) -> torch.Size:
        """The ``[s/cp, b, h]`` (``[s/(cp tp), b, h]`` under sequence parallelism) tensor passed between pipeline
        parts (``cp``: the context-parallel ranks, each holding its share of every sequence)."""
        cfg, topo = self.config, self.topology
        local = seq // topo.cp_size
        return torch.Size((local // topo.tp_size if cfg.sequence_parallel else local, batch, cfg.hidden_size))

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the residual stream: that of the weights (autocast computes in lower precision but
        adds into it)."""
        return next(self.parameters()).dtype

    # ---- forward ----------------------------------------------------------------------------------
    def _check(self, input_ids, labels, loss_mask, position_ids, document_ids=None) -> None:
        cfg, tp = self.config, self.topology.tp_size
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if cfg.position == "learned" and s > cfg.num_positions:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings={cfg.num_positions}")
        problem = context_parallel_problem(cfg.replace(seq_length=s), tp, self.topology.cp_size)
        if problem:
            raise ValueError(f"this batch's sequence length {s}: {problem}")
        if cfg.sequence_parallel and s % tp != 0:
            raise ValueError(f"sequence length {s} must be divisible by the tensor-parallel size tp={tp} "
                             f"when sequence_parallel=True")
        for name, t in (("labels", labels), ("loss_mask", loss_mask), ("position_ids", position_ids),
                        ("document_ids", document_ids)):
            if t is not None and tuple(t.shape) != (b, s):
                raise ValueError(f"{name} must have the shape of input_ids {(b, s)}, got {tuple(t.shape)}")
        if loss_mask is not None and labels is None:
            raise ValueError("loss_mask was given without labels")
        if self.check_inputs and input_ids.numel() and bool(
                ((input_ids < 0) | (input_ids >= cfg.vocab_size)).any()):
            raise ValueError(f"input_ids must lie in [0, vocab_size={cfg.vocab_size}); got min "
                             f"{int(input_ids.min())}, max {int(input_ids.max())}")

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the model on ``input_ids`` ``[b, s]``.

        With ``labels`` ``[b, s]`` returns the scalar loss
        ``sum(token_loss * loss_mask) / sum(loss_mask)`` (the mean over all
        tokens without a mask), identical on every TP rank. Without labels
        returns this rank's vocab-parallel logits ``[b, s, V_p/tp]`` (columns
        ``[r*V_p/tp, (r+1)*V_p/tp)`` of the padded vocabulary; padded columns
        are ``-inf``). :meth:`gather_logits` assembles ``[b, s, vocab_size]``.
        ``document_ids`` ``[b, s]``: attention stays inside each packed document
        (:mod:`model_zoo.document_attention`); ``position_ids`` then usually
        restart with each document (``--reset-position-ids``).
        """
        if self.split.num_parts != 1:
            raise RuntimeError(f"this model is one stage of a {self.split.num_parts}-part pipeline: run it "
                               f"through the pipeline executor (Engine.train_batch), which calls forward_part")
        return self.forward_part(0, None, input_ids, labels, loss_mask, position_ids, document_ids)

    def forward_part(self, part: int, hidden: Optional[torch.Tensor], input_ids: torch.Tensor,
                     labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None,
                     document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run pipeline part ``part`` (one of this stage's, :attr:`split`) on one micro-batch.

        The first part starts from ``input_ids`` ``[b, s]`` (``hidden`` is None); every other part from the
        previous part's ``hidden`` (:meth:`activation_shape`). The last part returns what :meth:`forward`
        returns; the others their output activation.

        Under context parallelism (``topology.cp_size > 1``) every rank of a ``"cp"`` group is given the same
        whole sequences and keeps its two chunks of each (:mod:`hybrid.context_parallel.split`): token, position,
        document, label and mask alike; the loss is the whole sequences' (:mod:`hybrid.context_parallel.loss`) and
        the logits are this rank's positions' (in its local order).
        """
        cfg, topo = self.config, self.topology
        first, end = self.split.ranges[part]
        if part == 0:
            self._check(input_ids, labels, loss_mask, position_ids, document_ids)
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        if topo.cp_size > 1:  # this rank's share of every sequence
            input_ids, labels, loss_mask, position_ids, document_ids = (
                None if t is None else split_for_rank(t, topo, seq_dim=1)
                for t in (input_ids, labels, loss_mask, position_ids, document_ids))
        rope = None
        if cfg.position == "rope" and end > first:
            rope = rope_cos_sin(position_ids, rope_inv_freq(cfg), self.activation_dtype, rope_attention_factor(cfg))

        x = hidden
        if part == 0:
            x = self.embedding(input_ids.t(), position_ids.t())  # [s(/tp), b, h]
            x = dropout(x, cfg.hidden_dropout, self.training, self.rng_tracker,
                        "tp" if cfg.sequence_parallel else "shared")
        for layer in (self.layers.by_index(i) for i in range(first, end)):
            if cfg.recompute == "full":
                x = checkpoint(layer, x, rope, document_ids, tracker=self.rng_tracker)
            else:
                x = layer(x, rope, document_ids)
        if part != self.split.num_parts - 1:
            return x
        x = self.final_norm(x)
        logits = column_parallel_linear(x, self.head_weight(), None, topo, cfg.sequence_parallel)  # [s, b, V_p/tp]

        if labels is None:
            return self._mask_padding(logits).transpose(0, 1).contiguous()
        mask = None if loss_mask is None else loss_mask.t()
        # The logits are this forward's own (nothing saved them for backward): the loss may overwrite them.
        if topo.cp_size > 1:
            token_loss = vocab_parallel_cross_entropy(logits, labels.t(), topo, vocab_size=cfg.vocab_size,
                                                      overwrite_logits=True)
            return context_parallel_mean(token_loss, mask, topo)
        return vocab_parallel_cross_entropy(logits, labels.t(), topo, vocab_size=cfg.vocab_size, loss_mask=mask,
                                            reduction="mean", overwrite_logits=True)

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        local_v = logits.shape[-1]
        n_valid = self.config.vocab_size - self.topology.tp_rank * local_v
        if n_valid >= local_v:
            return logits
        padded = torch.arange(local_v, device=logits.device) >= n_valid
        return logits.masked_fill(padded, float("-inf"))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel ``[..., V_p/tp]`` -> full ``[..., vocab_size]`` (all-gather over ``"tp"``, differentiable)."""
        return gather_from_tp_region(logits, self.topology)[..., :self.config.vocab_size]
