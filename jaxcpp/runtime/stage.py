"""One pipeline stage: its slice of the params, its own KV pages and its programs, all on its sub-mesh.

    first stage:  token ids -> embed -> layers[start:end] -> activations
    middle stage: activations -> layers[start:end] -> activations
    last stage:   activations -> layers[start:end] -> final norm -> logits at logits_indices
                  -> (a second program) sample
    (with P = 1 the one stage is both first and last)

The last stage's bucket program ends at the logits, padded with the sampling parameters to max_num_seqs
rows, whatever the bucket; one sampler program then draws the tokens, their logprobs and keeps the
penalties' per-request history (`jaxcpp.runtime.sampler`; the history is donated device state, like the KV
pages). The host picks its variant from the step's data: the penalty history, a grammar mask, both, or the
plain one, which draws the step's rows alone (`jaxcpp.core.buckets.sampler_rows`). The sampler (sorts for
top-k / top-p, a threefry draw per row) is about a third of a bucket program's XLA compile time on CPU, so
compiling it once instead of into every bucket cuts the cold start. Prompt log-probabilities (`echo`) need
the logits of every prompt token, not only each sequence's last: the bucket program also returns its final
hidden states, and a second program per bucket, run only for steps that ask, turns them into each token's
log-probability and top MAX_LOGPROBS, 64 rows at a time (the [T, V] logits are never whole, and never
leave the device). The fixed shape also serves async scheduling's token feedback: the first stage takes a
[max_num_seqs] token array (`fed_back`: an earlier step's tokens, or zeros) and reads the input of every
token with `feedback_rows >= 0` from it, so feeding back adds no programs either.

Each stage jits its own program (one per token bucket, by shape); params are arguments (the stage's own
slice, loaded by `jaxcpp.models.checkpoint.load_stage_params`), the step's arrays arrive packed in one
buffer (`jaxcpp.core.step_input.pack`; every stage gets the same one), the KV pages are donated and stay
sharded as they came in, activations leave replicated over the stage's "tp" axis so the next stage can
take them with one `device_put`. The model code is the plain functional API (`embed`, `run_layers`,
`compute_logits`); the stage only slices and places what it is given.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcpp.core.buckets import sampler_programs, sampler_rows
from jaxcpp.core.step_input import Layout, StepShape, pack, padding_step
from jaxcpp.kernels.metadata import AttentionFn, AttentionMetadata
from jaxcpp.models import llama, runs
from jaxcpp.models.config import LlamaConfig
from jaxcpp.models.moe import grouped_experts
from jaxcpp.runtime.packing import unpack
from jaxcpp.runtime.sampler import History, SampledTokens, SamplingInput, empty_history, logprobs_of, sample_step
from jaxcpp.runtime.sharding import REPLICATED, kv_spec, named, param_specs, shard_attention, shard_experts
from jaxcpp.structured.constraint import bitmask_words


class KVCacheSettings(NamedTuple):
    """What a stage's pages hold: the same for every stage, whether built in-process or in its own process."""

    dtype: str                              # "float32", "bfloat16", ..., "float8_e4m3fn", "float8_e5m2"
    k_scale: np.ndarray | None = None       # [stage layers] float32: fp8 pages' K scales (None: 1.0)
    v_scale: np.ndarray | None = None       # [stage layers] float32
    calculate_scales: bool = False          # --calculate-kv-scales: set them from the first prefill

    def layer_scales(self, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """The initial [num_layers] K and V scales: 0 ("not yet known") when they are to be calculated."""
        if self.calculate_scales:
            return np.zeros(num_layers, np.float32), np.zeros(num_layers, np.float32)
        ones = np.ones(num_layers, np.float32)
        return (ones if self.k_scale is None else np.asarray(self.k_scale, np.float32),
                ones if self.v_scale is None else np.asarray(self.v_scale, np.float32))


class StageInput(NamedTuple):
    packed: jax.Array  # [n] int32 on the stage's devices: the step's fields, packed
    layout: Layout     # how to cut it apart (static: one per bucket)
    needs_full_sampler: bool = False  # a row has a penalty history or a ban: the last stage's full sampler
    bitmask: np.ndarray | None = None  # [max_num_seqs, words] int32 on the host, for the last stage: constrained
                                       # rows' allowed tokens (jaxcpp.structured); None: the maskless sampler
    defer_sampling: bool = False      # the last stage stops at the logits: `Stage.sample` draws later, once
                                      # the host has the mask (a constrained decode's token was still pending)
    num_seqs: int | None = None       # the step's sequences: the plain sampler draws their rows alone (None: all)


class StepOutput(NamedTuple):
    sampled: SampledTokens | None  # [max_num_seqs] rows: each sequence's token (rows past the batch: garbage);
                                   # None until `Stage.sample` for a step with deferred sampling
    logits: jax.Array       # [max_num_seqs, V] float32: fetched only when the step asked for them
    hidden: jax.Array       # [T, D]: the last layer's output, for prompt logprobs when a step asks
    batch: StageInput       # the step, for the prompt logprobs' targets
    sampling: SamplingInput | None = None  # what a deferred draw samples from

    @property
    def tokens(self) -> jax.Array:
        assert self.sampled is not None, "a step with deferred sampling was not sampled (Stage.sample)"
        return self.sampled.tokens


class PromptLogprobs(NamedTuple):
    logprobs: jax.Array      # [T] float32: each token's log-probability of the next prompt token
    top_ids: jax.Array       # [T, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_LOGPROBS] float32


ROW_FIELDS = ("temperature", "top_k", "top_p", "seeds", "num_generated", "min_p", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "history_slot", "clear_slot", "banned_ids",
              "wants_logprobs")
TOKEN_FIELDS = ("token_ids", "prompt_slot")
PROMPT_LOGPROB_BLOCK = 64  # rows of logits at once: every token bucket is a multiple of it


def attention_metadata(batch: dict[str, jax.Array]) -> AttentionMetadata:
    return AttentionMetadata(*(batch[name] for name in AttentionMetadata._fields))


def last_logits(params: llama.Params, hidden: jax.Array, batch: dict[str, jax.Array], config: LlamaConfig,
                rows: int, tokens: int) -> SamplingInput:
    """Each sequence's last hidden state ([T, D] -> [S, D]) -> logits, and its sampling parameters, padded
    from S to `rows` rows (padding rows: zeros, so greedy, no history), the step's tokens from T to
    `tokens` (padding: no slot), so that one sampler program serves every bucket."""
    logits = llama.compute_logits(params, hidden[batch["logits_indices"]], config)
    pad_rows = [_pad(x, rows, -1 if name.endswith(("slot", "_ids")) else 0)
                for name, x in zip(ROW_FIELDS, (batch[name] for name in ROW_FIELDS), strict=True)]
    pad_tokens = [_pad(batch[name], tokens, -1 if name.endswith("slot") else 0) for name in TOKEN_FIELDS]
    return SamplingInput(_pad(logits, rows, 0), *pad_rows, *pad_tokens)


def _pad(x: jax.Array, size: int, value: int) -> jax.Array:
    return jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def prompt_logprobs(params: llama.Params, hidden: jax.Array, packed: jax.Array, *, layout: Layout,
                    config: LlamaConfig) -> PromptLogprobs:
    """Every token's log-probability of its `prompt_targets` entry, and its top MAX_LOGPROBS, computed
    PROMPT_LOGPROB_BLOCK rows at a time (a [T, V] array of logits would not fit for long prompts)."""
    targets = unpack(packed, layout)["prompt_targets"]
    blocks = hidden.shape[0] // PROMPT_LOGPROB_BLOCK

    def block(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        h, t = args
        return logprobs_of(llama.compute_logits(params, h, config), t)

    lp, ids, top = jax.lax.map(block, (hidden.reshape(blocks, PROMPT_LOGPROB_BLOCK, -1),
                                       targets.reshape(blocks, PROMPT_LOGPROB_BLOCK)))
    return PromptLogprobs(lp.reshape(-1), ids.reshape(-1, ids.shape[-1]), top.reshape(-1, top.shape[-1]))


def page_arrays(kv: llama.KVCache) -> tuple[jax.Array, ...]:
    """The arrays of `kv` that hold pages: K and V, or for a latent (MLA) cache its latent rows alone (its V
    has no values: `llama.make_kv_cache`). What a transfer moves, each with its own shape and dtype."""
    return (kv.k,) if kv.v.shape[-1] == 0 else (kv.k, kv.v)


def gather_pages(arrays: tuple[jax.Array, ...], pages: jax.Array) -> list[list[jax.Array]]:
    """`page_arrays`' [layers, num_pages, ...] arrays -> for each, one [len(pages), ...] array per layer."""
    return [[a[i, pages] for i in range(a.shape[0])] for a in arrays]


def scatter_pages(kv: llama.KVCache, layers: list[list[jax.Array]], pages: jax.Array) -> llama.KVCache:
    """`gather_pages`'s arrays written into `pages` of `kv` (padding entries all write page 0)."""
    written = [a.at[:, pages].set(jnp.stack(per_layer)) for a, per_layer in zip(page_arrays(kv), layers, strict=True)]
    return kv._replace(k=written[0], v=written[1] if len(written) > 1 else kv.v)


def zero_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
                   kv_scales: jax.Array | None = None) -> jax.Array:
    """Attention skipped: the attention-free forwards of the calibration sweep time everything else."""
    return q * 0


def zero_mla_attention(q_nope: jax.Array, q_pe: jax.Array, latent_pages: jax.Array, w_uk: jax.Array,
                       w_uv: jax.Array, md: AttentionMetadata, latent_scale: jax.Array | None = None) -> jax.Array:
    """`zero_attention` for an MLA model's signature: zeros of the value head dim."""
    return jnp.zeros((*q_nope.shape[:-1], w_uv.shape[-1]), q_nope.dtype)


def per_layer(params: llama.Params, specs: Any) -> tuple[llama.Params, Any]:
    """A stage's params and their PartitionSpecs with each run of stacked layers as one entry per layer
    (`runs.unstack_layers`); each layer's specs lose the leading layer axis."""
    layers = runs.unstack_layers(params["layers"])
    drop_axis = lambda spec: P(*tuple(spec)[1:])  # noqa: E731
    one = [jax.tree_util.tree_map(drop_axis, run, is_leaf=lambda x: isinstance(x, P))
           for run in runs.runs_of(specs["layers"])]
    layer_specs = [[spec] * len(run) for spec, run in zip(one, layers, strict=True)]
    return {**params, "layers": layers}, {**specs, "layers": layer_specs}


# --layer-weights auto: a CPU stage holds its layers apart from this many bytes of decoder-layer weights. The
# copy out of the stack costs ~0.2 ms a MiB a step (24.4 ms for 112 MiB in a 30M Llama's decode step,
# docs/benchmarks.md), compile time doubles whatever the size: below this, in the test suite's and the
# bundled model's sizes (<= 3 MiB), compile time is what matters.
PER_LAYER_MIN_BYTES = 16 << 20


def holds_layers_apart(layer_weights: str, platform: str, layer_bytes: int) -> bool:
    """--layer-weights: "per-layer" and "stacked" as named; "auto" holds them apart on CPU from
    PER_LAYER_MIN_BYTES of decoder-layer weights."""
    if layer_weights == "auto":
        return platform == "cpu" and layer_bytes >= PER_LAYER_MIN_BYTES
    return layer_weights == "per-layer"


class Stage:
    def __init__(self, index: int, num_stages: int, mesh: Mesh, config: LlamaConfig, params: llama.Params,
                 layers: tuple[int, int], num_pages: int, page_size: int, attention_fn: AttentionFn,
                 max_num_seqs: int, max_num_tokens: int, kv_cache: KVCacheSettings | None = None,
                 layer_weights: str = "auto", mla_rebuild_weight: float = 1.0) -> None:
        """`params`: this stage's host (numpy) params, its layers only (`load_stage_params`);
        `max_num_tokens`: the largest token bucket; `kv_cache`: the pages' dtype and scales (default:
        the model's dtype); `layer_weights`: "per-layer" holds each decoder layer's weights apart and
        runs the layers one after the other (`per_layer`), "stacked" scans them, "auto" picks
        (`holds_layers_apart`)."""
        self.index = index
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.mesh = mesh
        self.config = config
        self.layers = layers
        tp = mesh.shape["tp"]
        specs = param_specs(params, config, tp)
        layer_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(params["layers"]))
        self.per_layer_weights = holds_layers_apart(layer_weights, self.devices[0].platform, layer_bytes)
        if self.per_layer_weights:
            params, specs = per_layer(params, specs)
        self.params = jax.device_put(params, named(mesh, specs))
        self.replicated = NamedSharding(mesh, REPLICATED)
        kv_sharding = NamedSharding(mesh, kv_spec(config, tp))
        self._kv_shardings = llama.KVCache(kv_sharding, kv_sharding, self.replicated, self.replicated)
        self.dtype = jnp.dtype(config.dtype)  # fp8 weights keep the model dtype for activations
        num_layers = layers[1] - layers[0]
        kv_cache = kv_cache or KVCacheSettings(config.dtype)
        self.kv_cache_dtype = jnp.dtype(kv_cache.dtype)
        self._calculate_kv_scales = kv_cache.calculate_scales
        k_scale, v_scale = kv_cache.layer_scales(num_layers)
        make = functools.partial(llama.make_kv_cache, config, num_layers, num_pages, page_size, self.kv_cache_dtype,
                                 k_scale, v_scale)
        self.kv: llama.KVCache = jax.jit(make, out_shardings=self._kv_shardings)()  # zeros, born sharded
        self._no_feedback = jax.device_put(np.zeros(max_num_seqs, np.int32), self.replicated) if self.is_first else None
        self._experts_fn = shard_experts(grouped_experts, mesh, config)  # expert-parallel over "tp"
        # an MLA model's op (stage_ops.model_attention) attends over latent pages, replicated over "tp"
        self.mla_rebuild_weight = mla_rebuild_weight if config.is_mla else None  # --mla-prefill (mla_prefill.py)
        self._program = self._jit(attention_fn if config.is_mla else shard_attention(attention_fn, mesh, config))
        rep = self.replicated  # one sharding for every output array
        # in_shardings: a grammar mask comes from the host with the call (a device_put of its own cost the
        # late draw ~0.07 ms of host time a step: docs/benchmarks.md, structured outputs)
        self._sampler = jax.jit(sample_step, donate_argnums=1, static_argnums=3, in_shardings=rep,
                                out_shardings=rep)
        self._no_mask = np.zeros((max_num_seqs, bitmask_words(config.vocab_size)), np.int32)  # to compile with
        self.history: History | None = jax.jit(functools.partial(empty_history, max_num_seqs, config.vocab_size),
                                                out_shardings=rep)() if self.is_last else None
        self._prompt_logprobs = jax.jit(functools.partial(prompt_logprobs, config=config),
                                        static_argnames=("layout",), out_shardings=rep)
        self._sampler_lock, self._sampler_compiled = threading.Lock(), False  # compile() runs in threads
        # put(host array): a step's packed inputs onto the stage's devices, replicated. A jitted identity,
        # whose call costs a third to a quarter of `jax.device_put`'s made once among the engine's other work
        # (docs/benchmarks.md, "The host beside a 64-row decode step"); one small program per bucket's
        # buffer size, compiled by warm-up
        self.put = jax.jit(lambda host: host, in_shardings=rep, out_shardings=rep)
        self._attention_free_program: Any = None  # built on first use (the calibration sweep only)
        # disaggregation: a producer gathers a request's pages, a consumer scatters them into its own
        self._one_device = jax.sharding.SingleDeviceSharding(self.devices[0])
        self._gather = jax.jit(gather_pages, out_shardings=self._one_device)
        self._scatter = jax.jit(scatter_pages, donate_argnums=(0,), out_shardings=self._kv_shardings)

    @property
    def devices(self) -> list[Any]:
        return list(self.mesh.devices.flat)

    def _jit(self, attention_fn: AttentionFn, calculate_kv_scales: bool | None = None) -> Any:
        calculate = self._calculate_kv_scales if calculate_kv_scales is None else calculate_kv_scales
        fn = functools.partial(self._forward, attention_fn=attention_fn, calculate_kv_scales=calculate)
        return jax.jit(fn, donate_argnums=(1,), static_argnames=("layout",),
                       out_shardings=(self.replicated, self._kv_shardings))

    def _forward(self, params: llama.Params, kv: llama.KVCache, hidden: jax.Array | None,
                 packed: jax.Array, fed_back: jax.Array | None, *, layout: Layout, attention_fn: AttentionFn,
                 calculate_kv_scales: bool) -> tuple[Any, llama.KVCache]:
        batch = unpack(packed, layout)
        if self.is_first:
            assert fed_back is not None
            rows = batch["feedback_rows"]
            token_ids = jnp.where(rows >= 0, fed_back[jnp.maximum(rows, 0)], batch["token_ids"])
            hidden = llama.embed(params, token_ids)  # [T, D]
        hidden, kv = llama.run_layers(params["layers"], hidden, kv, attention_metadata(batch), self.config,
                                      attention_fn, calculate_kv_scales=calculate_kv_scales,
                                      experts_fn=self._experts_fn)
        if self.is_last:
            sampling = last_logits(params, hidden, batch, self.config, self.max_num_seqs, self.max_num_tokens)
            return (sampling, hidden), kv
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
        if not self.is_last:
            return
        sampling, hidden = lowered.out_info[0]
        if shape.scores_prompt_tokens(num_tokens):  # no prompt-logprob program for a rung
            self._prompt_logprobs.lower(self.params, hidden, self._aval(buf.shape, buf.dtype),
                                        layout=layout).compile()
        with self._sampler_lock:  # the sampler takes what every bucket program gives it: compile it once
            if not self._sampler_compiled:
                for with_history, with_mask, rows in sampler_programs(self.max_num_seqs):  # a mask: a host array
                    self._sampler.lower(sampling, self.history if with_history else None,
                                        self._no_mask if with_mask else None, rows).compile()
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
        """An earlier step's sampled tokens (the last stage's), moved here for the first stage to read (a
        pipeline of one stage: already here, and `jax.device_put` of them cost ~0.2 ms of host time a step)."""
        return tokens if tokens.sharding == self.replicated else jax.device_put(tokens, self.replicated)

    def run(self, batch: StageInput, hidden: jax.Array | None, fed_back: jax.Array | None = None) -> Any:
        """Dispatch the stage's program; returns activations (or StepOutput on the last stage) at once.
        `fed_back` (first stage): the tokens placeholder decodes read their input from."""
        out, self.kv = self._program(self.params, self.kv, hidden, batch.packed, self._feedback(fed_back),
                                     layout=batch.layout)
        return self._output(out, batch)

    # ---- KV pages in and out (disaggregation) ----------------------------------------------------
    def gather_pages(self, pages: np.ndarray) -> list[list[jax.Array]]:
        """This stage's pages `pages` (padded to a page bucket with page 0): for each of its page arrays (K
        and V, or the latent rows), one array per layer, on the stage's first device: what a producer
        offers. A copy: the pages may be reused."""
        return self._gather(page_arrays(self.kv), jax.device_put(pages, self.replicated))

    def pages_avals(self, num_pages: int) -> list[jax.ShapeDtypeStruct]:
        """One layer's `gather_pages` array of `num_pages` pages for each page array (K and V, or the latent
        rows), each with its own shape and dtype, as a consumer pulls them."""
        return [jax.ShapeDtypeStruct((num_pages, *a.shape[2:]), a.dtype, sharding=self._one_device)
                for a in page_arrays(self.kv)]

    def import_pages(self, layers: list[list[jax.Array]], pages: np.ndarray) -> None:
        """Write pulled pages (`gather_pages`' arrays, for this stage's layers) into its own `pages`."""
        self.kv = self._scatter(self.kv, jax.device_put(layers, self.replicated),
                                jax.device_put(pages, self.replicated))

    def compile_page_transfers(self, buckets: list[int], gather: bool, scatter: bool) -> None:
        """The gather and/or scatter program of every page bucket, at warm-up (no compile later)."""
        num_layers = self.layers[1] - self.layers[0]
        for n in buckets:
            pages = self._aval((n,), np.int32)
            if gather:
                self._gather.lower(page_arrays(self.kv), pages).compile()
            if scatter:
                layers = [[self._aval(one.shape, one.dtype)] * num_layers for one in self.pages_avals(n)]
                self._scatter.lower(self.kv, layers, pages).compile()

    def run_prompt_logprobs(self, out: StepOutput) -> PromptLogprobs:
        """The last stage's step output -> every token's prompt log-probabilities (dispatched, not awaited)."""
        return self._prompt_logprobs(self.params, out.hidden, out.batch.packed, layout=out.batch.layout)

    def run_attention_free(self, batch: StageInput, hidden: jax.Array | None) -> Any:
        """The same program with attention replaced by zeros (its K/V writes go to the reserved page)."""
        if self._attention_free_program is None:
            # the calibration sweep's K/V are no prompt's: they must not set calculated fp8 scales
            zero = zero_mla_attention if self.config.is_mla else zero_attention
            self._attention_free_program = self._jit(zero, calculate_kv_scales=False)
        out, self.kv = self._attention_free_program(self.params, self.kv, hidden, batch.packed,
                                                    self._feedback(None), layout=batch.layout)
        return self._output(out, batch)

    def _output(self, out: Any, batch: StageInput) -> Any:
        """Activations, or on the last stage the sampled tokens beside the bucket program's logits."""
        if not self.is_last:
            return out
        sampling, hidden = out
        step = StepOutput(None, sampling.logits, hidden, batch, sampling)
        return step if batch.defer_sampling else self.sample(step, batch.bitmask)

    def sample(self, step: StepOutput, bitmask: np.ndarray | None) -> StepOutput:
        """Draw the step's tokens (dispatched, not awaited). Penalties or min_tokens in the step: the
        program that has them; a constrained row: the one with a mask (data: no program per grammar or
        per mix of rows); otherwise the plain one, on the step's rows alone (`sampler_rows`). Steps are
        sampled in submission order (the history is donated state)."""
        assert step.sampling is not None
        history = self.history if step.batch.needs_full_sampler else None
        rows = sampler_rows(step.batch.num_seqs if history is None and bitmask is None else None, self.max_num_seqs)
        sampled, history = self._sampler(step.sampling, history, bitmask, rows)
        self.history = self.history if history is None else history
        return step._replace(sampled=sampled, sampling=None)

    def _feedback(self, fed_back: jax.Array | None) -> jax.Array | None:
        """Only the first stage reads fed-back tokens; without any it reads zeros (no wait, same program)."""
        return (self._no_feedback if fed_back is None else fed_back) if self.is_first else None
