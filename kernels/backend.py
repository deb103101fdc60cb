"""`--attention-backend {auto,pallas,xla}`: pick the attention function the model calls.

Every choice returns a function with the reference's signature `(q, k_pages, v_pages, md) -> out`, so the
model never learns which one it got, and each is safe to call inside `jax.jit`.

- "xla": `ragged_paged_attention_xla`, the CPU path: on CPU with float32 pages, decode rows and prefill
  chunks through C++ custom calls that read the pages in place (`cpu_attention`); else XLA ops, where
  decodes read only their real pages and prefill tokens gather each sequence's pages once per query block.
  `ragged_paged_attention_reference` (every token gathers its own pages) stays the simple correctness
  reference, selected by no flag.
- "pallas": the Pallas kernel. On a GPU it is compiled through the Triton lowering, selected explicitly
  with `pltriton.CompilerParams` on CUDA and ROCm alike: Mosaic GPU (the default Pallas GPU lowering)
  refuses ROCm, and the kernel is written for Triton (scalar metadata loads, gathered page loads).
  ROCm only changes the launch defaults (`ROCM_LAUNCH`: fewer warps, as a wavefront is 64 wide).
  Off a GPU it runs in interpret mode, so the engine's tests can exercise it on CPU.
- "auto": "pallas" when `jax.default_backend() == "gpu"`, else "xla".

An MLA model (DeepSeek) attends over latent pages: `select_mla_absorbed` picks its absorbed form the same
way (`mla_absorbed_attention`, the Pallas kernel, or `mla_absorbed_xla`), `select_mla_rebuilt` its
rebuilt prefill form (`mla_prefill_rebuilt_attention`: the rebuild an XLA GEMM, the attention a Pallas
kernel, `kernels/mla_rebuilt.py`; or `mla_prefill_rebuilt_xla`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jaxcpp.kernels.metadata import AttentionFn
from jaxcpp.kernels.mla_attention import (
    AbsorbedFn,
    RebuiltFn,
    mla_absorbed_attention,
    mla_absorbed_xla,
    mla_prefill_rebuilt_xla,
)
from jaxcpp.kernels.mla_rebuilt import mla_prefill_rebuilt_attention
from jaxcpp.kernels.ragged_paged_attention import (
    ROCM_LAUNCH,
    ragged_paged_attention,
    ragged_paged_attention_xla,
)

ATTENTION_BACKENDS = ("auto", "pallas", "xla")


def is_rocm() -> bool:
    """True when the default device is an AMD GPU (ROCm build of jaxlib)."""
    if jax.default_backend() != "gpu":
        return False
    device = jax.devices()[0]
    if device.platform == "rocm":
        return True
    version = getattr(device.client, "platform_version", "") or ""
    return "rocm" in version.lower() or "hip" in version.lower()


def resolve_backend(backend: str) -> str:
    """Map "auto" to the concrete backend for this process's default device."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def select_attention(backend: str, *, interpret: bool | None = None) -> AttentionFn:
    """The attention function for `--attention-backend`; `interpret=None` means "only off a GPU"."""
    if resolve_backend(backend) == "xla":
        return ragged_paged_attention_xla
    on_gpu = jax.default_backend() == "gpu"
    interpret = (not on_gpu) if interpret is None else interpret
    launch = ROCM_LAUNCH if on_gpu and not interpret and is_rocm() else {}
    return functools.partial(ragged_paged_attention, interpret=interpret, **launch)


def select_mla_absorbed(backend: str, *, interpret: bool | None = None) -> AbsorbedFn:
    """The absorbed MLA op for `--attention-backend` (`select_attention`'s rule; one launch for CUDA and
    ROCm: its defaults were sized for Triton's register budget, not tuned per vendor)."""
    return _select_mla(backend, mla_absorbed_xla, mla_absorbed_attention, interpret)


def select_mla_rebuilt(backend: str, *, interpret: bool | None = None) -> RebuiltFn:
    """The rebuilt MLA prefill op for `--attention-backend` (`select_attention`'s rule)."""
    return _select_mla(backend, mla_prefill_rebuilt_xla, mla_prefill_rebuilt_attention, interpret)


def _select_mla(backend: str, xla_op: Callable[..., jax.Array], pallas_op: Callable[..., jax.Array],
                interpret: bool | None) -> Callable[..., jax.Array]:
    if resolve_backend(backend) == "xla":
        return xla_op
    interpret = (jax.default_backend() != "gpu") if interpret is None else interpret
    return functools.partial(pallas_op, interpret=interpret)
