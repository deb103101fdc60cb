"""Decode attention on CPU as a C++ custom call that reads K/V pages in place (`paged_decode_attention_cpu.cc`).

The XLA CPU path's decode rows otherwise gather their pages into a fresh operand every layer of every
step (an element-by-element gather fused with the transpose its batched dot wants): on the 30m model
at concurrency 16 that gather was most of a decode step's attention (docs/benchmarks.md, "Decode
attention on CPU"). The kernel reads each row's K and V once where they lie, as vLLM's CPU attention does.

It is built once per machine with the host's C++ compiler against the XLA FFI headers jaxlib ships
(`jax.ffi.include_dir()`), into a cache folder keyed by the source, the jaxlib version and the CPU's
feature flags (it is compiled for this CPU: `-march=native`), and registered as an XLA FFI target for
the CPU platform. Where no compiler is found or the build fails, `available()` says so once in the log
and the XLA path's own decode attention runs instead: same contract, same results to float32 rounding.
`JAXCPP_CPU_DECODE_KERNEL=0` chooses that path on purpose (an A/B, or a kernel to rule out).
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_attention_cpu.cc")
TARGET = "jaxcpp_paged_decode_attention"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]
CACHE_ENV = "JAXCPP_KERNEL_CACHE_DIR"  # where built kernels go (default $XDG_CACHE_HOME/jaxcpp/kernels)
SWITCH_ENV = "JAXCPP_CPU_DECODE_KERNEL"  # "0": never use the kernel (the XLA ops serve decodes)


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
    return folder / f"paged_decode_attention_{key.hexdigest()[:16]}.so"


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


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the kernel; False, logged once, where that cannot be done
    or `JAXCPP_CPU_DECODE_KERNEL=0` turns it off."""
    if os.environ.get(SWITCH_ENV) == "0":
        log.warning("%s=0: CPU decode attention runs as XLA ops (page gathers)", SWITCH_ENV)
        return False
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        log.warning("no C++ compiler found: CPU decode attention runs as XLA ops (page gathers)")
        return False
    library = _library_path(compiler)
    try:
        if not library.exists():
            _build(compiler, library)
        handler = ctypes.cdll.LoadLibrary(str(library)).JaxcppPagedDecodeAttention
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", "") or str(e))[-2000:]
        log.warning("building %s failed, CPU decode attention runs as XLA ops: %s", SOURCE.name, detail)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return True


def paged_decode_attention(qg: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_indices: jax.Array,
                           kv_visible: jax.Array) -> jax.Array:
    """qg [rows, kv_heads, group, head_dim] fp32, already scaled; pages [num_pages, page_size, kv_heads,
    head_dim] fp32; page_indices [rows, P] int32; kv_visible [rows] int32 (0: the row comes out 0).
    Returns [rows, kv_heads, group, head_dim] fp32. Call only where `available()` is True, on CPU."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(qg.shape, jnp.float32))
    return call(qg, k_pages, v_pages, page_indices.astype(jnp.int32), kv_visible.astype(jnp.int32))
