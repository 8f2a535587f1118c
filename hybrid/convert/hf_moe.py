"""The mixtures of experts: ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` <->
hybrid GPT with ``num_experts`` set (model_zoo.moe; docs/moe.md).

Attention, norms, embeddings and the head are the Llama family's
(:mod:`hybrid.convert.hf_llama`: Mixtral as Mistral, Qwen2-MoE as Qwen2
with its q/k/v bias, Qwen3-MoE as Qwen3 with its query/key norms); each MoE
layer's MLP is a softmax router and SwiGLU experts, Qwen2-MoE's plus a shared
expert under a sigmoid gate. Name map of an MoE layer ``i``, expert ``e``
(hybrid ``layers.i.mlp.`` on the left)::

                                 Mixtral (block_sparse_moe.)   Qwen2-MoE / Qwen3-MoE (mlp.)
    router.weight         [E, h]   gate.weight                   gate.weight
    experts.e.in_proj     [2f, h]  experts.e.{w1; w3}            experts.e.{gate_proj; up_proj}
    experts.e.out_proj    [h, f]   experts.e.w2                  experts.e.down_proj
    shared_expert.in_proj [2fs, h] -                             shared_expert.{gate_proj; up_proj} (Qwen2)
    shared_expert.out_proj         -                             shared_expert.down_proj            (Qwen2)
    shared_expert_gate    [1, h]   -                             shared_expert_gate                 (Qwen2)

(all ``.weight``, under ``model.layers.i.``). Those are the names of the Hub
checkpoints and of what ``save_pretrained`` writes (transformers 5 converts
them to its fused in-memory parameters on load and back on save), and the
names export writes. Import also reads transformers 5's fused state dict
(``mlp.experts.gate_up_proj`` ``[E, 2f, h]`` = each expert's ``[gate; up]``,
``mlp.experts.down_proj`` ``[E, h, f]``) and Mixtral under ``mlp.`` instead
of ``block_sparse_moe.``, each expert read from its rows of the fused tensor
(:meth:`hybrid.convert.hf_io.HFDirectory.alias`).

Routing (hybrid's ``moe_router_*``; HF's ``*TopKRouter.forward``): scores
are the softmax of the router logits over all experts, in fp32; the top
``num_experts_per_tok`` (``moe_router_topk``) are chosen; their weights are
renormalised to sum to one (Mixtral always; the Qwens when ``norm_topk_prob``:
hybrid's ``moe_router_pre_softmax`` False) or kept as they are (Qwen
``norm_topk_prob`` false: ``moe_router_pre_softmax`` True). Which Qwen layers
are MoE: HF's layer ``l`` is when ``(l + 1) % decoder_sparse_step == 0`` and
``l`` is not in ``mlp_only_layers``, the others a dense MLP of
``intermediate_size`` (``ffn_hidden_size``); hybrid's ``moe_layer_freq``
holds the same pattern (an int N means layers 0, N, 2N, ..., so a Qwen step
of 2 becomes the 0/1 list). The experts' width is Qwen's
``moe_intermediate_size`` (``moe_ffn_hidden_size``) and Mixtral's
``intermediate_size`` (``ffn_hidden_size``, every layer being MoE).
``router_aux_loss_coef`` is ``moe_aux_loss_coeff``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch

from hybrid.convert.consolidate import ConversionError
from hybrid.convert.hf_common import Link, refuse, setting
from hybrid.convert.hf_llama import LlamaFamily, swiglu_links
from model_zoo.config import GPTConfig


@dataclasses.dataclass(frozen=True)
class MoEFamily(LlamaFamily):
    # config.json's names of the routed experts' count (the first is written; transformers 5 reads either for
    # Mixtral and Qwen3-MoE, and writes Qwen3-MoE's as num_local_experts), and of their width (Mixtral's:
    # intermediate_size)
    experts_keys: Tuple[str, ...] = ("num_experts",)
    expert_ffn_key: str = "moe_intermediate_size"
    # The module of an MoE layer as the HF checkpoints name it, then the other names HF reads for it
    moe_prefixes: Tuple[str, ...] = ("mlp",)
    expert_names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # (gate, up, down)
    shared_expert: bool = False  # Qwen2-MoE: a shared expert under a sigmoid gate in every MoE layer
    sparse_step: bool = True  # the Qwens: decoder_sparse_step and mlp_only_layers choose the MoE layers
    renormalise: Any = None  # True: always renormalises the top-k weights (Mixtral); None: norm_topk_prob says

    # ---- export ----------------------------------------------------------------------------------------
    def mlp_mismatches(self, cfg: GPTConfig) -> List[str]:
        a = self.ARCHITECTURE
        if not cfg.is_moe:
            return [f"num_experts=None ({a} is a mixture of experts)"]
        out = []
        if cfg.moe_router_score_function != "softmax":
            out.append(f"moe_router_score_function={cfg.moe_router_score_function!r} ({a}'s router is a softmax)")
        if cfg.moe_router_topk_scaling_factor not in (None, 1.0):
            out.append(f"moe_router_topk_scaling_factor={cfg.moe_router_topk_scaling_factor} ({a} does not "
                       f"scale the expert weights)")
        if cfg.moe_router_enable_expert_bias:
            out.append(f"moe_router_enable_expert_bias=True ({a}'s router has no expert bias: it would choose "
                       f"other experts)")
        if cfg.moe_router_group_topk is not None:
            out.append(f"moe_router_group_topk={cfg.moe_router_group_topk} ({a}'s router chooses among all experts, "
                       f"not within groups)")
        if self.renormalise and cfg.moe_router_pre_softmax:
            out.append(f"moe_router_pre_softmax=True ({a} renormalises the top-k weights)")
        if not self.sparse_step and not all(cfg.moe_layer_pattern()):
            out.append(f"moe_layer_freq={cfg.moe_layer_freq!r} ({a} has experts in every layer)")
        shared = cfg.moe_shared_expert_intermediate_size
        if self.shared_expert and (shared is None or not cfg.moe_shared_expert_gate):
            out.append(f"moe_shared_expert_intermediate_size={shared!r}, moe_shared_expert_gate="
                       f"{cfg.moe_shared_expert_gate} ({a} has a shared expert under a sigmoid gate)")
        if not self.shared_expert and shared is not None:
            out.append(f"moe_shared_expert_intermediate_size={shared} ({a} has no shared expert)")
        return out

    def hf_config(self, cfg: GPTConfig, dtype_name: str) -> Dict[str, Any]:
        out = super().hf_config(cfg, dtype_name)
        out.update({self.experts_keys[0]: cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
                    self.expert_ffn_key: cfg.expert_ffn_size, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
                    "output_router_logits": False})
        if self.renormalise is None:
            out["norm_topk_prob"] = not cfg.moe_router_pre_softmax
        if self.sparse_step:
            out["decoder_sparse_step"] = 1
            out["mlp_only_layers"] = [i for i, moe in enumerate(cfg.moe_layer_pattern()) if not moe]
        else:
            out["router_jitter_noise"] = 0.0
        if self.shared_expert:
            out["shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
            out["qkv_bias"] = True
        return out

    # ---- import ----------------------------------------------------------------------------------------
    def config_from_hf(self, hf: Dict[str, Any], where: str) -> GPTConfig:
        dense = super().config_from_hf(hf, where)
        key, experts = self._experts(hf, where)
        topk = setting(hf, "num_experts_per_tok", where, "an integer")
        if experts < 1:
            raise refuse(where, key, experts, "a mixture of experts has at least one expert")
        if not 1 <= topk <= experts:
            raise refuse(where, "num_experts_per_tok", topk, f"a token goes to 1 to {key}={experts} experts")
        expert_ffn = setting(hf, self.expert_ffn_key, where, "an integer")
        if self.renormalise:
            pre_softmax = False
        else:
            pre_softmax = not setting(hf, "norm_topk_prob", where, "true or false", False)
        jitter = setting(hf, "router_jitter_noise", where, "a number", 0.0)
        if jitter:
            raise refuse(where, "router_jitter_noise", jitter, "hybrid's router adds no noise; set it to 0.0")
        shared = None
        if self.shared_expert:
            if not setting(hf, "qkv_bias", where, "true or false", True):
                raise refuse(where, "qkv_bias", False, f"hybrid's {self.ARCHITECTURE} has the q/k/v bias")
            shared = setting(hf, "shared_expert_intermediate_size", where, "an integer")
            if shared < 1:
                raise refuse(where, "shared_expert_intermediate_size", shared, "it must be positive")
        layers = dense.num_layers
        freq = self._layer_pattern(hf, layers, where) if self.sparse_step else 1
        ffn = dense.ffn_size
        return dense.replace(
            num_experts=experts, moe_router_topk=topk,
            # Mixtral's experts are its intermediate_size (ffn_hidden_size); a Qwen expert width other than
            # the dense one is recorded as moe_ffn_hidden_size
            moe_ffn_hidden_size=None if expert_ffn == ffn else expert_ffn, moe_layer_freq=freq,
            moe_router_score_function="softmax", moe_router_pre_softmax=pre_softmax,
            moe_aux_loss_coeff=setting(hf, "router_aux_loss_coef", where, "a number", 0.001),
            moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=shared is not None)

    def _experts(self, hf: Dict[str, Any], where: str) -> Tuple[str, int]:
        """The key config.json gives the routed experts' count under, and the count."""
        given = {k: setting(hf, k, where, "an integer") for k in self.experts_keys if hf.get(k) is not None}
        if not given:
            setting(hf, self.experts_keys[0], where, "an integer")  # raises: the key is required
        if len(set(given.values())) > 1:
            raise ConversionError(f"{where}: {' and '.join(f'{k}={v}' for k, v in given.items())} disagree; they "
                                  f"name the same count: fix the file")
        return next(iter(given.items()))

    def _layer_pattern(self, hf: Dict[str, Any], layers: int, where: str):
        step = setting(hf, "decoder_sparse_step", where, "an integer", 1)
        if step < 1:
            raise refuse(where, "decoder_sparse_step", step, "it must be a positive integer")
        dense = hf.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in dense):
            raise ConversionError(f"{where}: mlp_only_layers is {dense!r}, expected a list of layer indices; fix "
                                  f"that key of the file")
        pattern = tuple(int((i + 1) % step == 0 and i not in dense) for i in range(layers))
        return 1 if all(pattern) else pattern  # every layer MoE: Megatron's default spelling

    def adapt(self, hf, cfg: GPTConfig) -> None:
        """Present the other namings HF reads (transformers 5's fused experts, Mixtral's ``mlp.``) under the names
        :meth:`links` uses, reading the same bytes (:meth:`HFDirectory.alias`)."""
        e_count, f, h = cfg.num_experts, cfg.expert_ffn_size, cfg.hidden_size
        gate, up, down = self.expert_names
        names = set(hf.names())
        for i, moe in enumerate(cfg.moe_layer_pattern()):
            if not moe:
                continue
            want = f"model.layers.{i}.{self.moe_prefixes[0]}."
            for prefix in self.moe_prefixes:
                base = f"model.layers.{i}.{prefix}."
                fused = {base + "experts.gate_up_proj": (e_count, 2 * f, h),
                         base + "experts.down_proj": (e_count, h, f)}
                if base != want:  # another prefix for the same module (Mixtral's mlp.): the same names under it
                    for n in sorted(n for n in names if n.startswith(base) and n not in fused):
                        hf.alias(want + n[len(base):], n)
                if any(n in names for n in fused):
                    for n, shape in fused.items():
                        if n not in names:
                            raise ConversionError(f"{hf.path} holds {' and '.join(sorted(set(fused) & names))} but "
                                                  f"not {n}: fused experts come as both")
                        if hf.shape(n) != shape:
                            raise ConversionError(f"{hf.path}: tensor {n} has shape {list(hf.shape(n))}, but "
                                                  f"config.json implies {list(shape)}")
                    up_name, down_name = fused
                    for e in range(e_count):  # expert e's [gate; up] rows, then its down projection's rows
                        hf.alias(f"{want}experts.{e}.{gate}.weight", up_name, e * 2 * f, (f, h))
                        hf.alias(f"{want}experts.{e}.{up}.weight", up_name, e * 2 * f + f, (f, h))
                        hf.alias(f"{want}experts.{e}.{down}.weight", down_name, e * h, (h, f))

    def buffers(self, cfg: GPTConfig) -> Dict[str, torch.Tensor]:
        """What import writes for the model's buffers: each MoE layer's router ``expert_bias`` ``[E]`` fp32, zero
        (a fresh model's: HF routes without one)."""
        return {f"layers.{i}.mlp.router.expert_bias": torch.zeros(cfg.num_experts, dtype=torch.float32)
                for i, moe in enumerate(cfg.moe_layer_pattern()) if moe}

    def unexported(self, name: str, cfg: GPTConfig) -> bool:
        """The router's ``expert_bias`` buffer, which checkpoints save: export refuses a model that routes with
        it (:meth:`mlp_mismatches`), so it is unused, and HF has no place for it."""
        return name.endswith(".mlp.router.expert_bias") and not cfg.moe_router_enable_expert_bias

    def mlp_links(self, cfg: GPTConfig, i: int) -> List[Link]:
        if not cfg.moe_layer_pattern()[i]:
            return super().mlp_links(cfg, i)  # a Qwen mlp_only layer: the dense SwiGLU MLP
        src, dst = f"model.layers.{i}.{self.moe_prefixes[0]}.", f"layers.{i}.mlp."
        out = [Link(f"{dst}router.weight", (f"{src}gate.weight",))]
        for e in range(cfg.num_experts):
            out += swiglu_links(f"{src}experts.{e}.", f"{dst}experts.{e}.", self.expert_names)
        if cfg.moe_shared_expert_intermediate_size is not None:
            out += swiglu_links(f"{src}shared_expert.", f"{dst}shared_expert.", ("gate_proj", "up_proj", "down_proj"))
        if cfg.moe_shared_expert_gate:
            out.append(Link(f"{dst}shared_expert_gate.weight", (f"{src}shared_expert_gate.weight",)))
        return out


MIXTRAL = MoEFamily("MixtralForCausalLM", "mixtral", qkv_bias=False, fixed=(("sliding_window", None),),
                    experts_keys=("num_local_experts", "num_experts"), expert_ffn_key="intermediate_size",
                    moe_prefixes=("block_sparse_moe", "mlp"), expert_names=("w1", "w3", "w2"), sparse_step=False,
                    renormalise=True)
QWEN2_MOE = MoEFamily("Qwen2MoeForCausalLM", "qwen2_moe", qkv_bias=True,
                      fixed=(("sliding_window", None), ("use_sliding_window", False)),
                      window_switch="use_sliding_window", shared_expert=True)
QWEN3_MOE = MoEFamily("Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=False,
                      fixed=(("attention_bias", False), ("sliding_window", None), ("use_sliding_window", False)),
                      window_switch="use_sliding_window", qk_norm=True,
                      experts_keys=("num_experts", "num_local_experts"))
FAMILIES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
