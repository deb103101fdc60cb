"""The mixture-of-experts block (Mixtral, Qwen3-MoE): a float32 router, then every expert at once as a
grouped matmul over the tokens sorted by expert.

    weights, ids = route(x, router_kernel, top_k, normalize)    # [N, k] float32, [N, k] int32
    out = grouped_experts(x, ids, weights, gate, up, down)       # sum_j weights[:, j] * expert_ids[:, j](x)

The router is transformers': softmax over every expert's logit in float32, the top k (a tie across the
k-th place goes to the lower expert index), renormalised to sum to 1 when the config says so (Mixtral always,
Qwen3-MoE with `norm_topk_prob`). The experts: each (token, choice) pair becomes a row, the rows are
sorted by expert and each expert's run of rows is multiplied by its own weights (`tiled_grouped_mlp`:
tiles of rows, one expert each, under a scan), so the work follows the *active* parameters (N·k rows
through one expert each), not E dense MLPs, and the group sizes are data: a new routing compiles
nothing. `jax.lax.ragged_dot` computes the same, but XLA:CPU lowers it densely over every expert.

Expert parallelism: `first_expert` says which experts the given weights are (a device's E/tp slice);
a row routed to an expert outside the slice gets no group and contributes zero, so the per-device sums
add up (psum over "tp", `jaxcpp.runtime.sharding.shard_experts`) to the one-device result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxcpp.models.config import ModelConfig
from jaxcpp.models.layers import INIT_STD, MLP

# experts_fn(x [N, D], ids [N, k], weights [N, k], gate [E, D, I], up [E, D, I], down [E, I, D]) -> [N, D]
ExpertsFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def route(
    x: jax.Array,  # [N, D]
    router_kernel: jax.Array,  # [D, E]
    top_k: int,
    normalize: bool,
) -> tuple[jax.Array, jax.Array]:  # (weights [N, k] float32, expert ids [N, k] int32)
    logits = x.astype(jnp.float32) @ router_kernel.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def grouped_experts(
    x: jax.Array,  # [N, D]
    ids: jax.Array,  # [N, k] int32: each token's chosen experts (global ids)
    weights: jax.Array,  # [N, k] float32
    gate: jax.Array,  # [E_local, D, I]
    up: jax.Array,  # [E_local, D, I]
    down: jax.Array,  # [E_local, I, D]
    first_expert: jax.Array | int = 0,  # the global id of gate[0]
    matmul: str = "tiled",  # "tiled" (tiled_grouped_mlp) or "ragged_dot" (for the benchmark)
) -> jax.Array:  # [N, D] float32: the weighted sum of this slice's experts' outputs
    num_tokens, top_k = ids.shape
    num_local = gate.shape[0]
    local = ids.reshape(-1) - first_expert  # [N*k]
    mine = (local >= 0) & (local < num_local)
    key = jnp.where(mine, local, num_local)  # rows for other devices' experts sort last, in no group
    order = jnp.argsort(key, stable=True)  # [N*k]: rows grouped by expert
    rows = x[order // top_k]  # [N*k, D]
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # [E_local]
    mlp = tiled_grouped_mlp if matmul == "tiled" else ragged_dot_mlp
    out = mlp(rows, sizes, gate, up, down).astype(jnp.float32)  # [N*k, D]
    row_weight = jnp.where(mine, weights.reshape(-1), 0.0)[order]
    out = jnp.where(mine[order][:, None], out * row_weight[:, None], 0.0)  # rows in no group: exactly 0
    unsorted = jnp.zeros_like(out).at[order].set(out)  # back to (token, choice) order
    return jnp.sum(unsorted.reshape(num_tokens, top_k, -1), axis=1)


def ragged_dot_mlp(rows: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
                   ) -> jax.Array:  # [R, D]
    """SwiGLU of rows sorted by expert through `jax.lax.ragged_dot`. Exact, but XLA:CPU lowers it to a
    dense product over every group (measured: its cost grows with E, benchmarks/moe.py), so the engine
    uses `tiled_grouped_mlp`; kept as the reference and for the benchmark."""
    hidden = nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    return jax.lax.ragged_dot(hidden, down, sizes)


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile: about the rows an expert gets on average (a power of two in [8, 128]), so a decode
    step wastes little on half-empty tiles and a long prefill chunk runs few, large matmuls."""
    per_expert = max(1, num_rows // num_experts)
    return min(128, max(8, 1 << (per_expert - 1).bit_length()))


def tiled_grouped_mlp(rows: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
                      ) -> jax.Array:  # [R, D]
    """SwiGLU of rows sorted by expert (the first sizes[0] rows expert 0's, ...; rows past sum(sizes) in
    no group give 0), as a grouped matmul whose cost follows the rows, not the experts: each group is
    padded to whole tiles of B rows, a scan runs one tile at a time through its expert's weights, and
    the tiles past the last group are skipped (`lax.cond`). The tile count is static (R/B + E bounds
    it); which tiles are used is data, so a new routing compiles nothing."""
    num_rows, width = rows.shape
    num_experts = gate.shape[0]
    b = tile_rows(num_rows, num_experts)
    num_tiles = -(-num_rows // b) + num_experts  # each group wastes less than one tile
    padded = (sizes + b - 1) // b * b
    group_end, padded_end = jnp.cumsum(sizes), jnp.cumsum(padded)
    index = jnp.arange(num_rows)
    group = jnp.searchsorted(group_end, index, side="right")  # [R]: num_experts for rows in no group
    safe = jnp.minimum(group, num_experts - 1)
    position = jnp.where(group < num_experts, padded_end[safe] - padded[safe] + index - (group_end[safe] - sizes[safe]),
                         num_tiles * b)  # where each row sits in the padded layout (out of range: none)
    tiles = jnp.zeros((num_tiles * b, width), rows.dtype).at[position].set(rows, mode="drop")
    tile_group = jnp.searchsorted(padded_end, jnp.arange(num_tiles) * b, side="right")  # [tiles]

    def tile(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        x, e = xs

        def swiglu(x: jax.Array, e: jax.Array) -> jax.Array:
            return (nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]

        unused = lambda x, e: jnp.zeros((b, down.shape[-1]), rows.dtype)  # noqa: E731
        return None, jax.lax.cond(e < num_experts, swiglu, unused, x, jnp.minimum(e, num_experts - 1))

    _, out = jax.lax.scan(tile, None, (tiles.reshape(num_tiles, b, width), tile_group))
    return jnp.take(out.reshape(num_tiles * b, -1), position, axis=0, mode="fill", fill_value=0)


def dense_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:  # [N, D] float32
    """Every expert on every token, weighted by the router (zero for experts not chosen): the naive
    path the benchmark compares `grouped_experts` with. Costs the total, not the active, parameters."""
    hidden = nn.silu(jnp.einsum("nd,edi->eni", x, gate)) * jnp.einsum("nd,edi->eni", x, up)
    out = jnp.einsum("eni,eid->end", hidden, down).astype(jnp.float32)  # [E, N, D]
    dense_weights = jnp.zeros((x.shape[0], gate.shape[0]), jnp.float32)
    dense_weights = dense_weights.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)  # [N, E]
    return jnp.einsum("ne,end->nd", dense_weights, out)


class Kernel(nn.Module):
    """One weight tensor, as a linen param named `kernel` (for the router and the stacked experts)."""

    shape: tuple[int, ...]
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", nn.initializers.normal(INIT_STD), self.shape, self.param_dtype)


class Experts(nn.Module):
    """E SwiGLU experts, each projection stacked over the experts: [E, D, I], [E, D, I], [E, I, D]."""

    config: ModelConfig
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        c, dt = self.config, self.param_dtype
        e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        return (Kernel((e, d, i), dt, name="gate_proj")(), Kernel((e, d, i), dt, name="up_proj")(),
                Kernel((e, i, d), dt, name="down_proj")())


class MoEBlock(nn.Module):
    """Router ("gate", [D, E]) + experts (+ Qwen2-MoE's gated shared expert); params named as transformers'
    Qwen3-MoE / Qwen2-MoE blocks."""

    config: ModelConfig
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, experts_fn: ExpertsFn = grouped_experts) -> jax.Array:  # [..., D]
        c = self.config
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        router = Kernel((c.hidden_size, c.num_experts), self.param_dtype, name="gate")()
        weights, ids = route(flat, router, c.num_experts_per_tok, c.norm_topk_prob)
        out = experts_fn(flat, ids, weights, *Experts(c, self.param_dtype, name="experts")())
        if c.shared_expert_intermediate_size:  # every token also runs the shared expert, scaled by its gate
            shared = MLP(c, self.param_dtype, c.shared_expert_width, name="shared_expert")(flat)
            gate = Kernel((c.hidden_size, 1), self.param_dtype, name="shared_expert_gate")()
            out = out + (jax.nn.sigmoid(flat @ gate) * shared).astype(out.dtype)
        return out.astype(x.dtype).reshape(x.shape)
