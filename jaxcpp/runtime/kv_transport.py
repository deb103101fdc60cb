"""KV pages between instances (disaggregation), the device side: jax.experimental.transfer.

A producer's stage gathers a request's pages into one array per layer (`Stage.gather_pages`) and offers
them on its process's transfer server under the request's transfer id, for `timeout_s` (then they are
dropped). A consumer pulls each source's arrays straight onto the devices of its stages that hold those
layers (the pull returns at once), the engine asks each step whether they have arrived (never blocking),
and only then scatters them into its own pages, in order with its steps: no step waits for a transfer.
Every call comes from the engine's thread (`jaxcpp.core.disaggregation`).

Per source, the arrays are K of layers [first, end) then V of the same layers, or for a latent (MLA) cache
the latent rows of those layers alone (`KVOffer`, `Stage.pages_avals`).
"""

from __future__ import annotations

import datetime
from typing import Any

import jax
import numpy as np

from jaxcpp.core.kv_transfer import KVOffer, KVSource, padded_pages
from jaxcpp.runtime.stage import Stage


class KVTransport:
    """This process's transfer server for KV pages, and its connections to producers' servers."""

    def __init__(self, ip: str, server: Any = None) -> None:
        """`server`: the process's transfer server when it has one already (a stage process's)."""
        from jax.experimental import transfer

        self.server = server or transfer.start_transfer_server(jax.local_devices()[0].client, f"{ip}:0",
                                                               [f"{ip}:0"])
        self._connections: dict[str, Any] = {}  # used from the engine's thread only

    @property
    def address(self) -> str:
        return str(self.server.address())

    def offer(self, transfer_id: int, arrays: list[jax.Array], timeout_s: float) -> None:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self.server.await_pull(transfer_id, arrays, timeout=deadline)

    def pull(self, source: KVSource, transfer_id: int, avals: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
        if source.address not in self._connections:
            self._connections[source.address] = self.server.connect(source.address)
        return list(self._connections[source.address].pull(transfer_id, avals))


def gather_offer(stages: list[Stage], pages: list[int]) -> list[jax.Array]:
    """The stages' arrays of `pages` in offer order (each page array's layers in turn: K of every layer,
    then V; a latent cache's rows alone), dispatched, not awaited."""
    padded = np.asarray(padded_pages(pages), np.int32)
    per_stage = [stage.gather_pages(padded) for stage in stages]  # [stage][page array][layer]
    return [a for kind in zip(*per_stage, strict=True) for layers in kind for a in layers]


class PulledPages:
    """A consumer's pull of one offer: each layer's page arrays (K and V, or the latent rows), arriving on
    the stage that holds the layer."""

    def __init__(self, transport: KVTransport, stages: list[Stage], offer: KVOffer, transfer_id: int) -> None:
        self.stages = stages
        self.num_pages = offer.num_pages
        self.layers: dict[int, list[jax.Array]] = {}  # layer -> its arrays, one per page array
        for source in offer.sources:
            layers = range(source.first_layer, source.end_layer)
            per_layer = [_stage_of(stages, layer).pages_avals(offer.num_pages_padded) for layer in layers]
            avals = [one[kind] for kind in range(len(per_layer[0])) for one in per_layer]
            arrays = transport.pull(source, transfer_id, avals)
            for i, layer in enumerate(layers):
                self.layers[layer] = arrays[i::len(layers)]
        missing = [layer for s in stages for layer in range(*s.layers) if layer not in self.layers]
        if missing:
            raise ValueError(f"the offer's sources leave layers {missing[:4]} out")

    @property
    def _arrays(self) -> list[jax.Array]:
        return [a for arrays in self.layers.values() for a in arrays]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays)

    def arrived(self) -> bool:
        """Whether every array is here; never blocks. A failed transfer raises (its arrays are ready, with
        the error): in the engine's thread, which hands the request to another producer."""
        arrays = self._arrays
        if not all(a.is_ready() for a in arrays):  # type: ignore[attr-defined]  # jax.Array has it at runtime
            return False
        jax.block_until_ready(arrays)  # returns at once, or raises the transfer's error
        return True

    def write_into(self, pages: list[int]) -> None:
        """Scatter into each stage's `pages` (the consumer's own, as many as the offer's)."""
        assert len(pages) == self.num_pages, (len(pages), self.num_pages)
        padded = np.asarray(padded_pages(pages), np.int32)
        for stage in self.stages:
            layers = range(*stage.layers)
            kinds = len(self.layers[layers[0]])
            stage.import_pages([[self.layers[i][kind] for i in layers] for kind in range(kinds)], padded)


def _stage_of(stages: list[Stage], layer: int) -> Stage:
    return next(s for s in stages if s.layers[0] <= layer < s.layers[1])
