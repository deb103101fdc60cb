"""Paged attention on CPU as C++ custom calls that read K/V pages in place (`paged_attention_cpu.cc`):
one for a step's decode rows, one for its prefill chunks.

The XLA CPU path otherwise gathers pages into a fresh operand every layer of every step (an
element-by-element gather fused with the transpose its batched dot wants): on the 30m model at
concurrency 16 that gather was most of a decode step's attention, and a prefill chunk's attention ran
its small per-block ops at ~40-50 GFLOP/s (docs/benchmarks.md, "Decode attention on CPU", "Prefill
attention on CPU"). The kernels read each K and V position where it lies, as vLLM's CPU attention does.

The library is built once per machine with the host's C++ compiler against the XLA FFI headers jaxlib ships
(`jax.ffi.include_dir()`), into a cache folder keyed by the source, the jaxlib version and the CPU's
feature flags (it is compiled for this CPU: `-march=native`), and registered as an XLA FFI target for
the CPU platform. Where no compiler is found or the build fails, `available()` says so once in the log
and the XLA path's own attention runs instead: same contract, same results to float32 rounding.
`JAXCPP_CPU_ATTENTION_KERNEL=0` chooses that path on purpose (an A/B, or a kernel to rule out);
`=decode` or `=prefill` keeps only that kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from jaxcpp.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.cc")
DECODE_TARGET = "jaxcpp_paged_decode_attention"
PREFILL_TARGET = "jaxcpp_paged_prefill_attention"
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
CACHE_ENV = "JAXCPP_KERNEL_CACHE_DIR"  # where built kernels go (default $XDG_CACHE_HOME/jaxcpp/kernels)
SWITCH_ENV = "JAXCPP_CPU_ATTENTION_KERNEL"  # "0": XLA ops serve every token; "decode" / "prefill": that kernel only
PARTS = ("decode", "prefill")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), compiler.encode(), " ".join(FLAGS).encode(),
                 _cpu_flags().encode()):
        key.update(part)
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = Path(os.environ.get(CACHE_ENV) or cache_home / "jaxcpp" / "kernels")
    return folder / f"paged_attention_{key.hexdigest()[:16]}.so"


def _build(compiler: str, library: Path) -> None:
    """Compile into a temporary file beside `library`, then rename: concurrent builders never see half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", partial],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def enabled(part: str) -> bool:
    """Whether `JAXCPP_CPU_ATTENTION_KERNEL` lets `part` ("decode" or "prefill") take its kernel."""
    switch = os.environ.get(SWITCH_ENV)
    return switch is None or switch == part or (switch != "0" and switch not in PARTS)


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the kernels; False, logged once, where that cannot be done
    or `JAXCPP_CPU_ATTENTION_KERNEL=0` turns them off."""
    if os.environ.get(SWITCH_ENV) == "0":
        log.warning("%s=0: CPU attention runs as XLA ops (page gathers)", SWITCH_ENV)
        return False
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        log.warning("no C++ compiler found: CPU attention runs as XLA ops (page gathers)")
        return False
    library = _library_path(compiler)
    try:
        if not library.exists():
            _build(compiler, library)
        built = ctypes.cdll.LoadLibrary(str(library))
        handlers = {DECODE_TARGET: built.JaxcppPagedDecodeAttention, PREFILL_TARGET: built.JaxcppPagedPrefillAttention}
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", "") or str(e))[-2000:]
        log.warning("building %s failed, CPU attention runs as XLA ops: %s", SOURCE.name, detail)
        return False
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return True


def paged_decode_attention(qg: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_indices: jax.Array,
                           kv_visible: jax.Array) -> jax.Array:
    """qg [rows, kv_heads, group, head_dim] fp32, already scaled; pages [num_pages, page_size, kv_heads,
    head_dim] fp32; page_indices [rows, P] int32; kv_visible [rows] int32 (0: the row comes out 0).
    Returns [rows, kv_heads, group, head_dim] fp32. Call only where `available()` is True, on CPU."""
    call = jax.ffi.ffi_call(DECODE_TARGET, jax.ShapeDtypeStruct(qg.shape, jnp.float32))
    return call(qg, k_pages, v_pages, page_indices.astype(jnp.int32), kv_visible.astype(jnp.int32))


def paged_prefill_attention(qg: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata) -> jax.Array:
    """The prefill chunks of a step: sequences [md.num_decodes, md.num_seqs), each token attending causally
    to its own sequence's pages. qg [T, kv_heads, group, head_dim] fp32, already scaled; pages as above.
    Returns [T, kv_heads, group, head_dim] fp32, decode and padding tokens 0. Call only where
    `available()` is True, on CPU."""
    call = jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct(qg.shape, jnp.float32))
    seq_range = jnp.stack([md.num_decodes, md.num_seqs]).astype(jnp.int32)
    return call(qg, k_pages, v_pages, md.cu_q_lens.astype(jnp.int32), md.kv_lens.astype(jnp.int32),
                md.page_indices.astype(jnp.int32), seq_range)
