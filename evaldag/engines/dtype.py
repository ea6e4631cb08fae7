"""The dtype a model runs in when its config names none, and a hint when a named one is slow on this host.

bfloat16 is the right default on GPUs and on CPUs with bf16 instructions (AVX512-BF16, AMX). A CPU without them
emulates every bf16 matrix product through float32 conversions: on this project's 2-core Xeon (AVX-512 but no
AVX512-BF16) vLLM generated 104 tok/s in bfloat16 and 266 tok/s in float32 (32 MATH-500 prompts x 256 tokens,
SmolLM2-135M). So a host with neither an accelerator nor bf16 instructions defaults to float32.

The default is resolved where the plan is made (the parent flow) and written into the plan, so it is part of
the generation key like any other setting; a cluster whose parents run on a CPU-only head while its gpu pool
has GPUs sets EVALDAG_DEFAULT_DTYPE=bfloat16 on the head (docs/production.md).
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from evaldag.errors import ConfigError

DEFAULT_DTYPE_ENV = "EVALDAG_DEFAULT_DTYPE"
DTYPES = ("bfloat16", "float16", "float32")
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively. Only x86 Linux is inspected (/proc/cpuinfo flags); elsewhere
    (ARM, macOS) the answer is yes: those CPUs' bf16 support is not read here, so the usual default stays."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    try:
        return cpuinfo_has_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return True


def cpuinfo_has_bf16(cpuinfo: str) -> bool:
    """Whether the first `flags` line of a /proc/cpuinfo text names a bf16 instruction set (True if none)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return bool(_BF16_FLAGS & set(line.split(":", 1)[-1].split()))
    return True


@functools.lru_cache(maxsize=1)
def has_accelerator() -> bool:
    """An NVIDIA or AMD GPU on this host, read from the drivers' files (importing torch here would cost the
    parent flow seconds)."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (nvidia.is_dir() and any(nvidia.iterdir())) or Path("/dev/kfd").exists()


def default_dtype() -> str:
    """$EVALDAG_DEFAULT_DTYPE, else bfloat16 on a host with a GPU or bf16 instructions, else float32."""
    name = os.environ.get(DEFAULT_DTYPE_ENV, "").strip()
    if name:
        if name not in DTYPES:
            raise ConfigError(f"{DEFAULT_DTYPE_ENV}={name!r} is not a dtype; use one of {', '.join(DTYPES)}")
        return name
    return "bfloat16" if has_accelerator() or cpu_has_bf16() else "float32"


def slow_dtype_hint(dtype: str, on_cpu: bool) -> str | None:
    """A one-line hint when `dtype` is known to be slow on this host's CPU, else None."""
    if on_cpu and dtype == "bfloat16" and not cpu_has_bf16():
        return ("dtype bfloat16 on a CPU without bf16 instructions (avx512_bf16/amx_bf16): every matrix product "
                "is emulated, about 2.5x slower than float32 here; set `dtype: float32` in the model config, or "
                "leave dtype unset for this host's default")
    return None
