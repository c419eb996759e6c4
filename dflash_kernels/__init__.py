"""
The CUDA extension (DESIGN.md sec. 7, README.md): two fused ops, each with a PyTorch reference of
the same signature beside its caller (draft_diffusion.kv_inject_ref, speculate.accept_scan_ref).
Callers ask available(device) first: CUDA tensors only, by the extension built on first use into
out/cuda_build/; DFLASH_CUDA_EXT=0 forces the references. Self-check: python dev/kernels_check.py
"""

import os
import re
import subprocess
import time
from pathlib import Path

import torch

ENV = "DFLASH_CUDA_EXT"  # 0: the PyTorch references everywhere; unset or 1: the extension
HERE = Path(__file__).resolve().parent
BUILD_ROOT = HERE.parent / "out" / "cuda_build"  # out/ is git-ignored
SOURCES = [HERE / "ext.cpp", HERE / "kv_inject.cu", HERE / "accept_scan.cu"]
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the caches kv_inject's kernel takes
DEFAULT_VERSION = 2  # accept_scan's promoted greedy kernel (README.md's measurements say why)
VERBOSE = False      # show the compiler's output (python dev/kernels_check.py --verbose)
_ext = {}  # device type -> the built module serving its tensors, or None (dev/emu.py sets cpu)


def available(device):
    """True when the built extension serves tensors on `device`. The first call for a device
    type chooses (building for CUDA) and prints which path is active and why."""
    kind = torch.device(device).type
    if kind not in _ext:
        _ext[kind], why = _choose(kind)
        path = "the CUDA extension" if _ext[kind] is not None else "the PyTorch reference"
        print(f"kernels: {kind} tensors use {path} ({why})", flush=True)
    return _ext[kind] is not None


def accept_scan(p, drafts, q=None, uniforms=None):
    """speculate.accept_scan_ref by the kernel: p (B, K+1, V), drafts (B, K), q (B, K, V) | None,
    uniforms (B, K+1) float64 | None, any strides -> n_accepted (B,), next_token (B,) int64."""
    c = lambda t: None if t is None else t.contiguous()
    return _ext[p.device.type].accept_scan(c(p), c(drafts), c(q), c(uniforms), DEFAULT_VERSION)


def kv_inject(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """In place: the caches must be contiguous and of KV_DTYPES."""
    args = [t.contiguous() for t in (new_k, new_v, offsets, counts, cos, sin)]
    _ext[cache_k.device.type].kv_inject(cache_k, cache_v, *args)


def _choose(kind):
    mode = os.environ.get(ENV, "").strip() or "1"
    if mode != "1":  # a typo must not pass for a choice
        return None, f"forced by {ENV}=0" if mode == "0" else f"unknown {ENV}={mode!r}, not 1 or 0"
    if kind != "cuda":
        return None, "the kernels serve CUDA tensors; no build"
    t0 = time.time()
    try:
        return _build(), f"built in {time.time() - t0:.1f} s"
    except Exception as e:  # a compiler error, no ninja ...; Ctrl-C is no Exception: it stops
        last = (str(e).strip().splitlines() or [""])[-1]  # the compiler's output: --verbose
        return None, f"build failed: {type(e).__name__}: {last}"[:300]


def _build():
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("a CUDA device but no CUDA toolkit (nvcc) found; set CUDA_HOME")
    build_dir = BUILD_ROOT / "dflash_kernels"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / "dflash_kernels.so").exists():  # nvcc is silent for a minute
        print(f"kernels: building the extension into {build_dir} (later runs reuse it)", flush=True)
    return cpp_extension.load(name="dflash_kernels", sources=[str(s) for s in SOURCES],
                              extra_cflags=["-O3"], extra_cuda_cflags=["-O3"],
                              extra_ldflags=_cudart_flags(cpp_extension.CUDA_HOME),
                              build_directory=str(build_dir), verbose=VERBOSE)


def _cudart_flags(cuda_home):
    """NOTE: torch guesses CUDA_HOME from `which nvcc`, and where that is a wrapper script it has
    no libcudart ('cannot find -lcudart'): link from the toolkit nvcc -dryrun names, too."""
    r = subprocess.run([f"{cuda_home}/bin/nvcc", "-dryrun", "-E", "-x", "cu", os.devnull],
                       capture_output=True, text=True, timeout=60)
    here = re.findall(r"^#\$ _HERE_=(.*)/bin$", r.stderr, flags=re.M)  # <toolkit>/bin
    return [f"-L{h}/{lib}" for h in here for lib in ("lib64", "lib")]
