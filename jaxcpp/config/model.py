"""What runs: the model (`ModelConfig`) and its KV cache (`CacheConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxcpp.config.fields import opt, require


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt("tiny", "model: 'tiny' (bundled), a Hugging Face folder (config.json + safetensors) "
                     "or an orbax checkpoint folder written by jaxcpp")
    dtype: str = opt("auto", "parameter/activation dtype: auto (the checkpoint's; float32 on the CPU backend, "
                     "where bfloat16 is emulated), float32, bfloat16, float16",
                     choices=("auto", "float32", "bfloat16", "float16"))
    max_model_len: int | None = opt(None, "longest prompt + output, in tokens (default: the model's)")
    seed: int = opt(0, "seed for parameter init of random models and for unseeded sampling")
    attention_backend: str = opt("auto", "attention implementation: auto (Pallas on GPU, XLA on CPU), "
                                 "pallas, xla", choices=("auto", "pallas", "xla"))
    quantization: str | None = opt(None, "fp8: quantize a float checkpoint's decoder-layer weights to float8_e4m3 "
                                   "at load, one scale per output channel (checkpoints stored in fp8 load as "
                                   "fp8 without it); matmuls dequantize on the fly", choices=("fp8",))
    layer_weights: str = opt("auto", "how a stage holds its decoder layers' weights: stacked ([L, ...] arrays, "
                             "one scanned layer body a program), per-layer (arrays of their own, the layers "
                             "one after the other: XLA:CPU then multiplies them where they lie instead of "
                             "copying them out of the stack every step, at about twice the compile time), "
                             "auto (per-layer on CPU for a stage with >= 16 MiB of layer weights)",
                             choices=("auto", "stacked", "per-layer"))
    mla_prefill: str = opt("auto", "MLA models (DeepSeek-V2/V3, Kimi-K2): how prefill chunks attend. absorbed "
                           "(SGLang's form for short chunks: queries into the latent space, never decompressing "
                           "the cache), rebuilt (vLLM's prefill: every chunk rebuilds its prefix's per-head K/V "
                           "from the latent), flops (per step, whichever costs fewer FLOPs), auto (per step by "
                           "FLOPs weighted by this device's speed of each form, timed at start-up)",
                           choices=("auto", "flops", "absorbed", "rebuilt"))

    def __post_init__(self) -> None:
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        require(self.quantization in (None, "fp8"), "quantization", f"must be fp8, got {self.quantization!r}")


# vLLM's --kv-cache-dtype names -> the dtype the pages hold ("fp8" is e4m3, as on CUDA). The "fn" e4m3 (no
# infinities, max 448) is the OCP format H100/H200 and MI355 store; MI300's "fnuz" variant is not offered.
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPES = ("auto", *FP8_KV_DTYPES)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = opt(16, "tokens per KV-cache page (--block-size is a deprecated alias)")
    num_pages: int | None = opt(None, "KV-cache pages per stage, the reserved page 0 included "
                                "(default: sized from --kv-cache-memory-gb)")
    kv_cache_memory_gb: float = opt(1.0, "memory for the KV cache when --num-pages is not given")
    enable_prefix_caching: bool = opt(True, "reuse the KV pages of prompt prefixes computed before "
                                      "(whole pages, hashed; evicted least-recently-used when pages run out)")
    kv_cache_dtype: str = opt("auto", "KV-cache page dtype: auto (the model's), fp8 (= fp8_e4m3), fp8_e4m3, "
                              "fp8_e5m2: 8-bit pages with a K and a V scale per layer (the checkpoint's "
                              "k_scale/v_scale, else 1.0), twice the pages of bfloat16 in the same memory",
                              choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = opt(False, "with an fp8 --kv-cache-dtype: set each layer's K and V scale from "
                                    "the first prefill step's largest |K| and |V| (instead of the "
                                    "checkpoint's or 1.0)")

    def __post_init__(self) -> None:
        require(self.page_size >= 1 and (self.page_size & (self.page_size - 1)) == 0, "page_size",
               f"must be a power of two, got {self.page_size}")
        require(self.num_pages is None or self.num_pages >= 2, "num_pages", "must be >= 2")
        require(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "must be > 0")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        require(not self.calculate_kv_scales or self.is_fp8, "calculate_kv_scales",
               f"needs an fp8 --kv-cache-dtype, got {self.kv_cache_dtype!r}")

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def resolved_kv_cache_dtype(self, model_dtype: str) -> str:
        """The dtype the pages hold, by its numpy/ml_dtypes name ("float8_e4m3fn", or the model's dtype)."""
        return FP8_KV_DTYPES.get(self.kv_cache_dtype, model_dtype)
