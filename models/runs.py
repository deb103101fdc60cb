"""Runs of alike decoder layers: how a stage's `params["layers"]` is laid out.

A model whose layers are all alike keeps them as one stacked tree ({...: [L, ...]}, run under one
`lax.scan`); dense and MoE layers mixed (Qwen3-MoE's `mlp_only_layers`, DeepSeek's
`first_k_dense_replace`) make a list of such runs. A CPU stage may hold each run as a list of one params
tree per layer instead (`unstack_layers`), which `llama.run_layers` runs one after the other.
"""

from __future__ import annotations

from typing import Any

import jax

Params = dict[str, Any]

# A run of alike layers is a stacked tree ({...: [L, ...]}, run under one `lax.scan`) or, as a CPU stage
# holds it (`unstack_layers`), a list of one params tree per layer (run one after the other).
Run = Params | list[Params]
# A stage's `params["layers"]`: one stacked run, or a list of runs (a list of dicts is never one bare
# per-layer run: `unstack_layers` makes a list of runs, each a list).
Layers = Params | list[Run]


def is_moe_run(run: Run) -> bool:
    """A run of layers is an MoE run when its "mlp" holds the experts."""
    return "experts" in (run[0] if isinstance(run, list) else run)["mlp"]


def runs_of(layer_params: Layers) -> list[Run]:
    """The runs of alike layers: a stacked tree is one run; a list holds runs."""
    return layer_params if isinstance(layer_params, list) else [layer_params]


def unstack_layers(layer_params: Layers) -> list[list[Params]]:
    """Stacked runs -> each run a list of one params tree per layer, each leaf an array of its own.

    XLA:CPU copies a layer's weights out of the stacked arrays before it multiplies (the scan's dynamic
    slice does not fuse into its dots); with the layers apart `run_layers` runs them one after the
    other in the program and each dot reads its weights where they lie (measured: the copy was ~20% of
    a 30M Llama's decode step at batch 16, docs/benchmarks.md#per-layer-weights-on-cpu), at the price
    of a program that holds every layer's body (compile time grows with depth)."""
    return [run if isinstance(run, list) else [jax.tree_util.tree_map(lambda x, i=i: x[i], run)
                                               for i in range(run_length(run))]
            for run in runs_of(layer_params)]


def num_layers_of(layer_params: Layers) -> int:
    return sum(run_length(run) for run in runs_of(layer_params))


def run_length(run: Run) -> int:
    """The layers in one run (stacked: its leaves' leading axis; per layer: its entries)."""
    return len(run) if isinstance(run, list) else int(jax.tree_util.tree_leaves(run)[0].shape[0])
