"""One pipeline stage: its slice of the params, its own KV pages and its programs, all on its sub-mesh.

    first stage:  token ids -> embed -> layers[start:end] -> activations
    middle stage: activations -> layers[start:end] -> activations
    last stage:   activations -> layers[start:end] -> final norm -> logits at logits_indices
                  -> (a second program) sample
    (with P = 1 the one stage is both first and last)

The last stage's bucket program ends at the logits, padded with the sampling parameters to
max_num_seqs rows, whatever the bucket; one sampler program then draws the tokens. The sampler
(sorts for top-k / top-p, a threefry draw per row) is about a third of a bucket program's XLA compile
time on CPU, so compiling it once instead of into every bucket cuts the cold start. The fixed shape
also serves async scheduling's token feedback: the first stage takes a [max_num_seqs] token array
(`fed_back`: an earlier step's tokens, or zeros) and reads the input of every token with
`feedback_rows >= 0` from it, so feeding back adds no programs either.

Each stage jits its own program (one per token bucket, by shape); params are arguments (the stage's
own slice, loaded by `jaxcpp.models.checkpoint.load_stage_params`), the step's arrays arrive packed in
one buffer (`jaxcpp.step_input.pack`; every stage gets the same one), the KV
pages are donated and stay sharded as they came in, activations leave replicated over the stage's "tp"
axis so the next stage can take them with one `device_put`. The model code is the plain functional API
(`embed`, `run_layers`, `compute_logits`); the stage only slices and places what it is given.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxcpp.kernels.metadata import AttentionFn, AttentionMetadata
from jaxcpp.models import llama
from jaxcpp.models.config import LlamaConfig
from jaxcpp.runtime.packing import unpack
from jaxcpp.runtime.sampler import sample
from jaxcpp.runtime.sharding import REPLICATED, kv_spec, named, param_specs, shard_attention
from jaxcpp.step_input import Layout, StepShape, pack, padding_step


class StepOutput(NamedTuple):
    tokens: jax.Array  # [max_num_seqs] int32: each sequence's token (rows past the batch: garbage)
    logits: jax.Array  # [max_num_seqs, V] float32: fetched only when the step asked for them


class SamplerInput(NamedTuple):
    """What the last stage's bucket program hands the sampler program: max_num_seqs rows each."""

    logits: jax.Array       # [W, V] float32
    temperature: jax.Array  # [W]
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    steps: jax.Array


SAMPLING_FIELDS = SamplerInput._fields[1:]


def attention_metadata(batch: dict[str, jax.Array]) -> AttentionMetadata:
    return AttentionMetadata(*(batch[name] for name in AttentionMetadata._fields))


def last_logits(params: llama.Params, hidden: jax.Array, batch: dict[str, jax.Array], config: LlamaConfig,
                rows: int) -> SamplerInput:
    """Each sequence's last hidden state ([T, D] -> [S, D]) -> logits, and its sampling parameters, padded
    from S to `rows` rows (padding rows: zeros, so greedy)."""
    logits = llama.compute_logits(params, hidden[batch["logits_indices"]], config)
    fields = [logits, *(batch[name] for name in SAMPLING_FIELDS)]
    return SamplerInput(*(jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)) for x in fields))


def sample_tokens(inputs: SamplerInput) -> jax.Array:
    """Tokens only: passing the logits through a jit output would copy them every step."""
    return sample(*inputs)


class StageInput(NamedTuple):
    packed: jax.Array  # [n] int32 on the stage's devices: the step's fields, packed
    layout: Layout     # how to cut it apart (static: one per bucket)


def zero_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata) -> jax.Array:
    """Attention skipped: the attention-free forwards of the calibration sweep time everything else."""
    return q * 0


class Stage:
    def __init__(self, index: int, num_stages: int, mesh: Mesh, config: LlamaConfig, params: llama.Params,
                 layers: tuple[int, int], num_pages: int, page_size: int, attention_fn: AttentionFn,
                 max_num_seqs: int) -> None:
        """`params`: this stage's host (numpy) params, its layers only (`load_stage_params`)."""
        self.index = index
        self.max_num_seqs = max_num_seqs
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.mesh = mesh
        self.config = config
        self.layers = layers
        tp = mesh.shape["tp"]
        self.params = jax.device_put(params, named(mesh, param_specs(params, config, tp)))
        self.replicated = NamedSharding(mesh, REPLICATED)
        kv_sharding = NamedSharding(mesh, kv_spec(config, tp))
        self._kv_shardings = llama.KVCache(kv_sharding, kv_sharding)
        dtype = self.dtype = jax.tree_util.tree_leaves(params)[0].dtype
        num_layers = layers[1] - layers[0]
        make = functools.partial(llama.make_kv_cache, config, num_layers, num_pages, page_size, dtype)
        self.kv: llama.KVCache = jax.jit(make, out_shardings=self._kv_shardings)()  # zeros, born sharded
        self._no_feedback = jax.device_put(np.zeros(max_num_seqs, np.int32), self.replicated) if self.is_first else None
        self._program = self._jit(shard_attention(attention_fn, mesh, config))
        self._sampler = jax.jit(sample_tokens, out_shardings=self.replicated)
        self._sampler_lock, self._sampler_compiled = threading.Lock(), False  # compile() runs in threads
        self._attention_free_program: Any = None  # built on first use (the calibration sweep only)

    @property
    def devices(self) -> list[Any]:
        return list(self.mesh.devices.flat)

    def _jit(self, attention_fn: AttentionFn) -> Any:
        out: Any = SamplerInput(*[self.replicated] * 6) if self.is_last else self.replicated  # type: ignore[arg-type]
        fn = functools.partial(self._forward, attention_fn=attention_fn)
        return jax.jit(fn, donate_argnums=(1,), static_argnames=("layout",),
                       out_shardings=(out, self._kv_shardings))

    def _forward(self, params: llama.Params, kv: llama.KVCache, hidden: jax.Array | None,
                 packed: jax.Array, fed_back: jax.Array | None, *, layout: Layout, attention_fn: AttentionFn
                 ) -> tuple[Any, llama.KVCache]:
        batch = unpack(packed, layout)
        if self.is_first:
            assert fed_back is not None
            rows = batch["feedback_rows"]
            token_ids = jnp.where(rows >= 0, fed_back[jnp.maximum(rows, 0)], batch["token_ids"])
            hidden = llama.embed(params, token_ids)  # [T, D]
        hidden, kv = llama.run_layers(params["layers"], hidden, kv, attention_metadata(batch), self.config,
                                      attention_fn)
        if self.is_last:
            return last_logits(params, hidden, batch, self.config, self.max_num_seqs), kv
        return hidden, kv

    # ---- per micro-batch (all asynchronous) ----------------------------------------------------
    def receive(self, hidden: jax.Array) -> jax.Array:
        """The previous stage's activations, moved onto this stage's devices."""
        return jax.device_put(hidden, self.replicated)

    def compile(self, shape: StepShape, num_tokens: int) -> None:
        """Lower and compile the program for the `num_tokens` bucket without running it. Safe in threads
        (XLA's compile releases the GIL) and it fills the jit's cache, so the first real call compiles
        nothing."""
        buf, layout = pack(padding_step(num_tokens, shape))
        hidden = None if self.is_first else self.hidden_aval(num_tokens)
        lowered = self._program.lower(self.params, self.kv, hidden, self._aval(buf.shape, buf.dtype),
                                      self._feedback(None), layout=layout)
        lowered.compile()
        if self.is_last:  # the sampler takes what every bucket program gives it: compile it once
            with self._sampler_lock:
                if not self._sampler_compiled:
                    self._sampler.lower(lowered.out_info[0]).compile()
                    self._sampler_compiled = True

    def hidden_aval(self, num_tokens: int) -> jax.ShapeDtypeStruct:
        """The activations this stage takes (or hands on) for a bucket of `num_tokens`."""
        return self._aval((num_tokens, self.config.hidden_size), self.dtype)

    def tokens_aval(self) -> jax.ShapeDtypeStruct:
        """The last stage's sampled tokens, which the first stage reads back (async scheduling)."""
        return self._aval((self.max_num_seqs,), np.int32)

    def _aval(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def receive_tokens(self, tokens: jax.Array) -> jax.Array:
        """An earlier step's sampled tokens (the last stage's), moved here for the first stage to read."""
        return jax.device_put(tokens, self.replicated)

    def run(self, batch: StageInput, hidden: jax.Array | None, fed_back: jax.Array | None = None) -> Any:
        """Dispatch the stage's program; returns activations (or StepOutput on the last stage) at once.
        `fed_back` (first stage): the tokens placeholder decodes read their input from."""
        out, self.kv = self._program(self.params, self.kv, hidden, batch.packed, self._feedback(fed_back),
                                     layout=batch.layout)
        return self._output(out)

    def run_attention_free(self, batch: StageInput, hidden: jax.Array | None) -> Any:
        """The same program with attention replaced by zeros (its K/V writes go to the reserved page)."""
        if self._attention_free_program is None:
            self._attention_free_program = self._jit(zero_attention)
        out, self.kv = self._attention_free_program(self.params, self.kv, hidden, batch.packed,
                                                    self._feedback(None), layout=batch.layout)
        return self._output(out)

    def _output(self, out: Any) -> Any:
        """Activations, or on the last stage the sampled tokens beside the bucket program's logits."""
        return StepOutput(self._sampler(out), out.logits) if self.is_last else out

    def _feedback(self, fed_back: jax.Array | None) -> jax.Array | None:
        """Only the first stage reads fed-back tokens; without any it reads zeros (no wait, same program)."""
        return (self._no_feedback if fed_back is None else fed_back) if self.is_first else None
