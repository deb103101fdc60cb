"""Tensor parallelism inside one pipeline stage: NamedShardings over the stage's 1-D ("tp",) mesh.

The model code is untouched; sharding is applied from outside, Megatron-style, and jit/GSPMD inserts
the collectives:

    q/k/v, gate/up projections   column-sharded (their output features: heads, MLP columns)
    o/down projections           row-sharded (their input features), so one all-reduce per block
    LM head                      vocab-sharded; logits are gathered for the sampler
    embedding, norms             replicated
    KV pages                     sharded on the KV-head axis
    MoE experts                  split over "tp" by expert (E/tp whole experts a device), router replicated

A dimension is sharded only when T divides its natural unit (heads for attention, columns for the MLP,
the vocabulary for the LM head); otherwise that tensor is replicated, which is always correct, only
slower. When the KV heads are sharded, the attention op itself runs under `shard_map`, one group of
heads per device: attention is independent per head, so this is exact, and it lets a Pallas kernel
(which GSPMD cannot partition) run on its local heads.

Expert parallelism is the rule, not a flag (vLLM's `--enable-expert-parallel` is opt-in): when T
divides the number of experts, each device holds E/T whole experts and runs the grouped matmul
(`jaxcpp.models.moe.grouped_experts`) over the rows routed to them, under `shard_map`; the per-device sums
are combined with one psum, the same single all-reduce a Megatron-split MLP costs. Splitting every
expert's width instead would cut each expert's matmul T ways for no fewer collectives, and GSPMD cannot
partition a grouped matmul (data-dependent groups) by itself. When T does not divide E
the experts are replicated (exact, only slower).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcpp.kernels.metadata import AttentionMetadata
from jaxcpp.models import llama
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.moe import ExpertsFn

REPLICATED = P()


def _divides(tp: int, n: int) -> bool:
    return tp > 1 and n % tp == 0


def kv_heads_sharded(config: LlamaConfig, tp: int) -> bool:
    # MLA's latent pages have one shared row a token: replicated, the heads' work split by GSPMD
    return not config.is_mla and _divides(tp, config.num_key_value_heads)


def experts_sharded(config: LlamaConfig, tp: int) -> bool:
    return config.num_experts > 0 and _divides(tp, config.num_experts)


def layer_spec(path: tuple[str, ...], config: LlamaConfig, tp: int) -> P:
    """The PartitionSpec of one stacked decoder-layer leaf ([L, ...]), from its path in the params tree."""
    *modules, leaf = path
    if "experts" in modules:  # kernel [L, E, in, out], kernel_scale [L, E, out]: split by expert
        return P(None, "tp") if experts_sharded(config, tp) else REPLICATED
    name = modules[-1] if modules else ""
    width = config.intermediate_size
    if {"shared_experts", "shared_expert"} & set(modules):  # DeepSeek's, Qwen2-MoE's (whose [D, 1] gate
        width = config.shared_expert_width                   # stays replicated): their own width
    column = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads,
              "v_proj": config.num_key_value_heads, "gate_proj": width, "up_proj": width}
    row = {"o_proj": config.num_attention_heads, "down_proj": width}
    if name in column and _divides(tp, column[name]):
        # kernel [L, in, out], bias [L, out]
        return P(None, None, "tp") if leaf == "kernel" else P(None, "tp")
    if name in row and _divides(tp, row[name]) and leaf == "kernel":
        return P(None, "tp", None)  # kernel [L, in, out]; a row-parallel bias is added after the reduce
    return REPLICATED


def param_specs(stage_params: llama.Params, config: LlamaConfig, tp: int) -> Any:
    """A PartitionSpec tree matching `stage_params` (a stage's slice of the params tree)."""

    def spec(keypath: tuple[Any, ...], _: Any) -> P:
        path = tuple(k.key for k in keypath if hasattr(k, "key"))  # a run's list index is no module
        if path[0] == "layers":
            return layer_spec(path[1:], config, tp)
        if path == ("lm_head",) and _divides(tp, config.vocab_size):
            return P(None, "tp")  # [D, V]
        return REPLICATED

    return jax.tree_util.tree_map_with_path(spec, stage_params)


def kv_spec(config: LlamaConfig, tp: int) -> P:
    # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    return P(None, None, None, "tp", None) if kv_heads_sharded(config, tp) else REPLICATED


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def shard_attention(attention_fn: llama.AttentionFn, mesh: Mesh, config: LlamaConfig) -> llama.AttentionFn:
    """Run `attention_fn` on each device's own heads when the KV heads are split over "tp"."""
    if not kv_heads_sharded(config, mesh.shape["tp"]):
        return attention_fn
    heads = P(None, "tp", None)            # q, out: [T, H, Dh]
    pages = P(None, None, "tp", None)      # [num_pages, page_size, Hkv, Dh]
    md_specs = AttentionMetadata(*([REPLICATED] * len(AttentionMetadata._fields)))
    plain = jax.shard_map(attention_fn, mesh=mesh, in_specs=(heads, pages, pages, md_specs),
                          out_specs=heads, check_vma=False)
    # fp8 pages: the layer's [2] scales go to every device whole
    scaled = jax.shard_map(attention_fn, mesh=mesh, in_specs=(heads, pages, pages, md_specs, REPLICATED),
                           out_specs=heads, check_vma=False)

    def sharded(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
                kv_scales: jax.Array | None = None) -> jax.Array:
        return plain(q, k_pages, v_pages, md) if kv_scales is None else scaled(q, k_pages, v_pages, md, kv_scales)

    return sharded


def shard_experts(experts_fn: ExpertsFn, mesh: Mesh, config: LlamaConfig) -> ExpertsFn:
    """Expert parallelism: each device runs `experts_fn` on its E/T experts for every token (the rows
    routed elsewhere contribute 0) and a psum over "tp" adds the devices' parts (in float32)."""
    if not experts_sharded(config, mesh.shape["tp"]):
        return experts_fn
    per_device = config.num_experts // mesh.shape["tp"]

    def local(x: jax.Array, ids: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
              down: jax.Array) -> jax.Array:
        first = jax.lax.axis_index("tp") * per_device
        return jax.lax.psum(experts_fn(x, ids, weights, gate, up, down, first), "tp")

    experts = P("tp", None, None)  # [E, in, out]
    return jax.shard_map(local, mesh=mesh, in_specs=(REPLICATED, REPLICATED, REPLICATED, experts, experts, experts),
                         out_specs=REPLICATED, check_vma=False)
