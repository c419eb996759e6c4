"""
The hand-written CUDA extension (DESIGN.md sec. 7): two fused ops, each with a plain-PyTorch
reference of the same signature beside the code that uses it. Math, shapes and kernel versions
are in the headers of the .cu files; ext.cpp checks the arguments and binds them.

    kv_inject(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin)   in place
        reference: draft_diffusion.kv_inject_ref
    accept_scan(p, drafts, q=None, uniforms=None) -> (n_accepted, next_token)
        reference: speculate.accept_scan_ref

Callers ask available(device) first and take the reference where it says no. It says yes only
for CUDA tensors, once the extension is built: on first use, with torch.utils.cpp_extension
and nvcc, into out/cuda_build/ (git-ignored; later processes reuse it). CPU tensors always take
the reference and build nothing; DFLASH_CUDA_EXT=0 forces the reference everywhere. The first
question for each device type prints which path is active and why. Kernels know tensors, not
models or the loop: nothing here imports the engine.

    python -m dflash_kernels          # on a GPU: validate every kernel version, then time them
    python dev/emu.py          # without one: the same validation, the kernels emulated on a CPU
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
DEFAULT_VERSION = 2  # accept_scan's promoted kernel: the faster at K = 15 on an H200 (its header)
STALE_LOCK_S = 600   # a build lock older than this was left behind by a killed build
VERBOSE = False      # show the compiler's output (python -m dflash_kernels --verbose)

# device type -> the built extension module that serves its tensors, or None (the reference);
# filled by available(). dev/emu.py puts its emulated build under "cpu".
_ext = {}


def available(device):
    """True when the built extension serves tensors on `device` (a CUDA device only). Builds on
    the first call for a device type and prints which path is active and why."""
    kind = torch.device(device).type
    if kind not in _ext:
        _ext[kind], why = _choose(kind)
        path = "the CUDA extension" if _ext[kind] is not None else "the PyTorch reference"
        print(f"kernels: {kind} tensors use {path} ({why})", flush=True)
    return _ext[kind] is not None


def accept_scan(p, drafts, q=None, uniforms=None):
    """Fused acceptance scan (header of accept_scan.cu); speculate.accept_scan_ref's signature.
    p (B, K+1, V), drafts (B, K) int64, q (B, K, V) | None, uniforms (B, K+1) float32 | None.
    Returns n_accepted (B,) int64, next_token (B,) int64."""
    c = lambda t: None if t is None else t.contiguous()  # the reference takes any strides
    return _ext[p.device.type].accept_scan(c(p), c(drafts), c(q), c(uniforms), DEFAULT_VERSION)


def kv_inject(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """Fused kv_inject (header of kv_inject.cu), in place; draft_diffusion.kv_inject_ref's
    signature. The caches must be contiguous (they are written in place) and of KV_DTYPES."""
    c = torch.Tensor.contiguous
    _ext[cache_k.device.type].kv_inject(cache_k, cache_v, c(new_k), c(new_v), c(offsets),
                                        c(counts), c(cos), c(sin))


# -----------------------------------------------------------------------------
# building

def _choose(kind):
    """(the extension module or None, why) for tensors of device type `kind`."""
    mode = os.environ.get(ENV, "").strip() or "1"
    if mode == "0":
        return None, f"forced by {ENV}=0"
    if mode != "1":  # a typo must not pass for a choice
        return None, f"unknown {ENV}={mode!r}: choose 1 or 0"
    if kind != "cuda":
        return None, "the kernels serve CUDA tensors; no build"
    t0 = time.time()
    try:
        return _build(), f"built in {time.time() - t0:.1f} s"
    except Exception as e:  # a compiler error, no ninja ...; Ctrl-C is no Exception: it stops
        return None, f"build failed: {_failure(e)}"


def _build():
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("a CUDA device but no CUDA toolkit (nvcc) found; set CUDA_HOME")
    name = "dflash_kernels"
    return cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                              extra_cflags=["-O3"], extra_cuda_cflags=["-O3"],
                              extra_ldflags=_cudart_flags(cpp_extension.CUDA_HOME),
                              build_directory=str(_build_dir(name)), verbose=VERBOSE)


def _build_dir(name):
    """out/cuda_build/<name>, free of a stale lock; says so before a first build, which is
    silent for seconds (g++) to minutes (nvcc)."""
    build_dir = BUILD_ROOT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: torch's load waits FOREVER on build_dir/lock, and a killed build leaves it behind:
    # wait while it is fresh (another build is running), remove it once it is stale
    lock, hinted = build_dir / "lock", False
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            break
        if age > STALE_LOCK_S:
            print(f"kernels: removing stale build lock {lock} ({age / 60:.0f} min old)")
            lock.unlink(missing_ok=True)
            break
        if not hinted:
            print(f"kernels: waiting for another build (lock {lock}, {age:.0f} s old); "
                  f"if none is running, delete that file")
            hinted = True
        time.sleep(1.0)
    if not (build_dir / f"{name}.so").exists():
        print(f"kernels: building {name} into {build_dir} (later runs reuse it)", flush=True)
    return build_dir


def _failure(e):
    """A build error in one line: its type and the last non-empty line of its message (the
    compiler's output above it is what --verbose shows)."""
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def _cudart_flags(cuda_home):
    """-L for the folder that holds libcudart. torch guesses CUDA_HOME from `which nvcc`; where
    that is a wrapper script (/usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc), the
    guess has no libcudart and the link fails ('cannot find -lcudart'). nvcc -dryrun names the
    folder it really runs from (_HERE_), whose parent is the toolkit."""
    def cudart_dir(root):
        return next((Path(root, d) for d in ("lib64", "lib")
                     if Path(root, d, "libcudart.so").exists()), None)
    lib = cudart_dir(cuda_home)
    if lib is None:
        try:
            r = subprocess.run([str(Path(cuda_home, "bin", "nvcc")), "-dryrun", "-E", "-x", "cu",
                                os.devnull], capture_output=True, text=True, timeout=60)
            here = re.search(r"^#\$ _HERE_=(.*)$", r.stdout + r.stderr, flags=re.M)
            lib = here and cudart_dir(Path(here.group(1).strip()).parent)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return [f"-L{lib}"] if lib else []  # else the link error says what is missing
