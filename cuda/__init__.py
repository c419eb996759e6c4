"""
The hand-written CUDA extension of the DFlash engine (DESIGN.md sec. 7): two fused ops, each
beside a plain-PyTorch reference with the same signature.

    kv_inject(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin)   in place, -> None
    accept_scan(p, drafts, q=None, uniforms=None) -> (n_accepted, next_token)

kv_inject_ref lives here; accept_scan_ref is speculate.accept_scan_ref (imported where it is
used). The math, shapes and kernel versions are in the
headers of kv_inject.cu and accept_scan.cu; ext.cpp holds the checks, the host (CPU) loops
and the bindings.

The extension is built on first use with torch.utils.cpp_extension.load into out/cuda_build/
(git-ignored): with a CUDA device, ext.cpp + both .cu files (nvcc); without one, ext.cpp
alone, without -DWITH_CUDA (g++ only), which serves CPU tensors with plain loops, so CI builds
and tests the same binding. Which path runs, by tensor device and DFLASH_CUDA_EXT:

    DFLASH_CUDA_EXT   CUDA tensors            CPU tensors
    unset / 1         extension (else ref)    reference (no build: cheap)
    host              extension (else ref)    extension's host loops (else ref)
    emu               reference               the CUDA kernels emulated on the CPU (cuda/emu.h)
    0                 reference               reference
    anything else     reference               reference (the first line names the value)

The first use of each path prints one line saying which path is active and why.

    python -m cuda            # build, validate every op and kernel version, time them
    python -m cuda --emu      # the same validation of the CUDA kernels' code on a CPU (load_emu)

Size: about 1,550 lines (the .cu, .cpp, emu.h, this module and __main__.py) against DESIGN's
~400, because every op exists three times on purpose (kernel, bit-exact host loop for CI,
reference), the self-check is llm.c-style, and emu.h (~290 lines) lets machines without a GPU
run the kernels' own code: no session of this project has had a GPU so far.
"""

import os
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# NOTE: NVIDIA's cuda-python (cuda.bindings, cuda.pathfinder), which CUDA builds of torch import
# for some ops, is a namespace package of the same name. Run from the repository root, this
# folder wins the name; extending __path__ keeps `import cuda.bindings` working beside it.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

ENV = "DFLASH_CUDA_EXT"
HERE = Path(__file__).resolve().parent
BUILD_ROOT = HERE.parent / "out" / "cuda_build"  # out/ is git-ignored
CU_SOURCES = [HERE / "kv_inject.cu", HERE / "accept_scan.cu"]
VERSIONS = {"kv_inject": (1,), "accept_scan": (1, 2)}  # kernel versions; see the .cu headers
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the caches kv_inject's kernel takes
DEFAULT_VERSION = 2  # accept_scan's promoted kernel: the faster at K = 15 on an H200 (accept_scan.cu)
STALE_LOCK_S = 600   # a build lock older than this is left over from a killed build


# -----------------------------------------------------------------------------
# references (same signatures as the fused ops)

def kv_inject_ref(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """Plain PyTorch kv_inject, in place (header of kv_inject.cu).
    cache_k, cache_v (L, B, H, T_max, D); new_k, new_v (L, B, T_new, H, D), k not yet rotated;
    offsets, counts (B,) int64; cos, sin (P, D/2) float32. RoPE in float32 (model.apply_rope's
    math), rounded once to the cache dtype.
    NOTE: checks offsets/counts on the host, which syncs when they live on a GPU; the fused op
    checks them in the kernel instead."""
    from model import apply_rope
    L, B, H, T_max, D = cache_k.shape
    T_new = new_k.shape[2]
    room = min(T_max, cos.shape[0]) - counts  # not offsets + counts: a garbage offset must not wrap
    if not (bool(((counts >= 0) & (counts <= T_new)).all()) and bool(((offsets >= 0) & (offsets <= room)).all())):
        raise ValueError(f"kv_inject_ref: offsets + counts must lie within T_max = {T_max} and "
                         f"the RoPE tables (P = {cos.shape[0]}), counts within [0, {T_new}]")
    t = torch.arange(T_new, device=offsets.device)
    valid = t[None, :] < counts[:, None]                              # (B, T_new) which t are real
    pos = (offsets[:, None] + t[None, :]).clamp(max=cos.shape[0] - 1)  # (B, T_new) absolute positions
    cs, sn = cos[pos][:, None], sin[pos][:, None]                     # (B, 1, T_new, D/2)
    k = apply_rope(new_k.transpose(2, 3), cs, sn)                     # (L, B, H, T_new, D), over L
    v = new_v.transpose(2, 3)                                         # (L, B, H, T_new, D)
    b_idx, t_idx = valid.nonzero(as_tuple=True)                       # the (b, t) pairs to write
    p_idx = pos[b_idx, t_idx]
    cache_k[:, b_idx, :, p_idx] = k[:, b_idx, :, t_idx]               # (n, L, H, D) both sides
    cache_v[:, b_idx, :, p_idx] = v[:, b_idx, :, t_idx]


def accept_scan_ref(p, drafts, q=None, uniforms=None):
    """speculate.accept_scan_ref (the reference of accept_scan)."""
    from speculate import accept_scan_ref as ref
    return ref(p, drafts, q, uniforms)


# -----------------------------------------------------------------------------
# building the extension

_ext = None         # the loaded module, once built
_ext_error = None   # why it could not be built, once tried
_announced = set()  # the "path active" lines already printed


def _announce(line):
    if line not in _announced:
        _announced.add(line)
        print(f"cuda: {line}", flush=True)


def _wait_for_stale_lock(build_dir):
    """torch's load waits FOREVER on build_dir/lock, and a killed build leaves it behind. Wait
    for a live build (the lock is fresh), remove a lock older than STALE_LOCK_S."""
    lock = build_dir / "lock"
    hinted = False
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            break
        if age > STALE_LOCK_S:
            print(f"cuda: removing stale build lock {lock} ({age / 60:.0f} min old; a killed build left it)")
            lock.unlink(missing_ok=True)
            break
        if not hinted:
            print(f"cuda: waiting for another build of the extension (lock {lock}, {age:.0f} s old); "
                  f"if no build is running, delete that file")
            hinted = True
        time.sleep(1.0)


def _build_dir(name):
    """out/cuda_build/<name>, once the tools a build needs are known to exist."""
    if shutil.which("ninja") is None:
        raise RuntimeError("ninja not found (pip install ninja)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    build_dir = BUILD_ROOT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    _wait_for_stale_lock(build_dir)
    if not (build_dir / f"{name}.so").exists():  # a first build is silent for seconds to minutes
        print(f"cuda: building {name} into {build_dir} (seconds on a CPU, minutes with nvcc; "
              f"later runs reuse it)", flush=True)
    return build_dir


def failure(e):
    """A build error in one line: its type and the last non-empty line of its message (the
    compiler's output above it is what --verbose shows)."""
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def cudart_flags(cuda_home):
    """-L for the folder that holds libcudart (torch adds -lcudart). torch guesses CUDA_HOME
    from `which nvcc`; where that nvcc is a wrapper script elsewhere (this project's CPU
    machines have /usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc), the guess has
    no libcudart and the link fails with 'cannot find -lcudart'. nvcc -dryrun then names the
    folder it really runs from (_HERE_), whose parent is the toolkit. Where CUDA_HOME is right
    this repeats torch's own -L, which is harmless."""
    def cudart_dir(root):
        return next((Path(root, d) for d in ("lib64", "lib") if Path(root, d, "libcudart.so").exists()), None)
    lib = cudart_dir(cuda_home)
    if lib is None:
        try:
            r = subprocess.run([str(Path(cuda_home, "bin", "nvcc")), "-dryrun", "-E", "-x", "cu", os.devnull],
                               capture_output=True, text=True, timeout=60)
            here = re.search(r"^#\$ _HERE_=(.*)$", r.stdout + r.stderr, flags=re.M)
            lib = here and cudart_dir(Path(here.group(1).strip()).parent)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return [f"-L{lib}"] if lib else []  # else the link error says what is missing


def _build(verbose=False):
    """Compile and import the extension; raises with a readable reason."""
    from torch.utils import cpp_extension
    with_cuda = torch.cuda.is_available()
    if with_cuda and cpp_extension.CUDA_HOME is None:
        raise RuntimeError("a CUDA device but no CUDA toolkit (nvcc) found; set CUDA_HOME")
    build_dir = _build_dir(name := "dflash_ext_cuda" if with_cuda else "dflash_ext_host")
    # -ffp-contract=off: no FMA contraction, so the host loops round like PyTorch does
    cflags = ["-O3", "-ffp-contract=off"] + (["-DWITH_CUDA"] if with_cuda else [])
    sources = [str(HERE / "ext.cpp")] + ([str(s) for s in CU_SOURCES] if with_cuda else [])
    return cpp_extension.load(name=name, sources=sources, extra_cflags=cflags,
                              extra_cuda_cflags=["-O3", "-DWITH_CUDA"],
                              extra_ldflags=cudart_flags(cpp_extension.CUDA_HOME) if with_cuda else [],
                              build_directory=str(build_dir), verbose=verbose)


def load(verbose=False):
    """The built extension module, or None (the reason is in cuda.build_error()). Builds once
    per process (seconds on a CPU, minutes with nvcc; later processes reuse out/cuda_build/)."""
    global _ext, _ext_error
    if _ext is None and _ext_error is None:
        t0 = time.time()
        try:
            _ext = _build(verbose)
        except BaseException as e:  # a compiler error, no ninja, Ctrl-C during the build ...
            if isinstance(e, KeyboardInterrupt):
                raise
            _ext_error = failure(e)
        else:
            variant = "CUDA + host" if _ext.with_cuda else "host only, no CUDA device"
            _announce(f"extension built ({variant}) in {time.time() - t0:.1f} s")
    return _ext


def build_error():
    return _ext_error


_emu = None  # the emulated build, once loaded


def load_emu(verbose=False):
    """The extension with the CUDA kernels compiled by g++ and emulated on the CPU (header of
    cuda/emu.h): CPU tensors go through the kernels' own code. For the tests and `python -m
    cuda --emu` on machines without a GPU; the engine uses it only where DFLASH_CUDA_EXT=emu
    forces it (tests). Raises if it cannot build.
    Each .cu is copied into the build folder with two textual edits (its c10/cuda includes
    dropped, launches rewritten to emu::Launch) and compiled with emu.h included first."""
    global _emu
    if _emu is None:
        from torch.utils import cpp_extension
        build_dir = _build_dir("dflash_ext_emu")
        sources = [str(HERE / "ext.cpp")]
        for src in CU_SOURCES:
            text = re.sub(r"^#include <c10/cuda/.*$", "", src.read_text(), flags=re.M)  # lines kept: same numbers
            text = re.sub(r"(\w+(?:<\w+>)?)<<<(.*?)>>>\(", r"emu::Launch(\2).run(\1, ", text)
            text = f'#include "{HERE / "emu.h"}"\n#line 1 "{src}"\n' + text  # errors point into the .cu
            dst = build_dir / f"{src.stem}_emu.cpp"
            if not dst.exists() or dst.read_text() != text:  # an unchanged file keeps ninja's cache
                dst.write_text(text)
            sources.append(str(dst))
        flags = ["-O2", "-ffp-contract=off", "-DWITH_CUDA", "-DDFLASH_EMU"]
        _emu = cpp_extension.load(name="dflash_ext_emu", sources=sources, extra_cflags=flags,
                                  build_directory=str(build_dir), verbose=verbose)
    return _emu


def active_path(device):
    """('extension' | 'emulation' | 'reference', reason) for tensors on `device`; may build."""
    device = torch.device(device)
    mode = os.environ.get(ENV, "").strip().lower() or "1"
    if mode not in ("1", "host", "emu", "0"):  # a typo must not pass for a choice
        return "reference", f"unknown {ENV}={mode!r}: choose 1, host, emu or 0"
    if mode == "0":
        return "reference", f"forced by {ENV}=0"
    if mode == "emu":  # the kernels' own code, emulated on the CPU: for tests, slow
        if device.type != "cpu":
            return "reference", f"{ENV}=emu emulates the kernels for CPU tensors only"
        try:
            load_emu()
        except Exception as e:
            return "reference", f"emulation build failed: {failure(e)}"
        return "emulation", "the CUDA kernels' code, emulated on the CPU (cuda/emu.h)"
    if device.type == "cpu" and mode != "host":
        return "reference", f"CPU tensors, no build; {ENV}=host runs the extension's host loops"
    if device.type not in ("cpu", "cuda"):
        return "reference", f"no kernels for {device.type} tensors"
    if load() is None:
        return "reference", f"build failed: {_ext_error}"
    if device.type == "cuda" and not _ext.with_cuda:
        return "reference", "extension was built without CUDA"
    return "extension", "built" + (" (host path, forced by env)" if device.type == "cpu" else " (CUDA kernels)")


def _pick(device, op):
    path, why = active_path(device)
    _announce(f"{op} on {torch.device(device).type} uses the {path} path ({why})")
    return {"extension": _ext, "emulation": _emu}.get(path)


# -----------------------------------------------------------------------------
# the public ops

def kv_inject(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """Fused kv_inject (header of kv_inject.cu) when available, else kv_inject_ref. In place.
    A cache of a dtype the kernel lacks (float64: its RoPE is float32 math) takes the reference."""
    if cache_k.dtype not in KV_DTYPES:  # decided before _pick: nothing to build or announce for it
        _announce(f"kv_inject with a {str(cache_k.dtype)[6:]} cache uses the reference path (no kernel for it)")
        return kv_inject_ref(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin)
    ext = _pick(cache_k.device, "kv_inject")
    if ext is None:
        return kv_inject_ref(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin)
    c = torch.Tensor.contiguous  # the reference takes any strides; the caches are written in place
    ext.kv_inject(cache_k, cache_v, c(new_k), c(new_v), c(offsets), c(counts), c(cos), c(sin))


def accept_scan(p, drafts, q=None, uniforms=None):
    """Fused acceptance scan (header of accept_scan.cu) when available, else the reference.
    p (B, K+1, V), drafts (B, K) int64, q (B, K, V) | None, uniforms (B, K+1) float32 | None.
    Returns n_accepted (B,) int64, next_token (B,) int64."""
    ext = _pick(p.device, "accept_scan")
    if ext is None:
        return accept_scan_ref(p, drafts, q, uniforms)
    c = lambda t: None if t is None else t.contiguous()  # the reference takes any strides
    return ext.accept_scan(c(p), c(drafts), c(q), c(uniforms), DEFAULT_VERSION)


# -----------------------------------------------------------------------------
# compile check of the .cu files, for machines with nvcc but no GPU

def nvcc_check(sources=None, arch="sm_90", out_dir=None, timeout=300):
    """Compile each .cu with `nvcc -arch=<arch> -c` (no link, no GPU needed), in parallel.
    Returns {source name: (ok, log)}; raises FileNotFoundError without nvcc.
    NOTE: CPU-only torch wheels ship the CUDA headers but not the generated
    c10/cuda/impl/cuda_cmake_macros.h; an empty stand-in is supplied for the compile check."""
    from torch.utils import cpp_extension
    nvcc = shutil.which("nvcc") or (cpp_extension.CUDA_HOME and os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    if not nvcc or not os.path.exists(nvcc):
        raise FileNotFoundError("nvcc not found")
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="dflash_nvcc_"))
    shim = out_dir / "shim"
    includes = cpp_extension.include_paths()
    if not os.path.exists(os.path.join(includes[0], "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        (shim / "c10" / "cuda" / "impl").mkdir(parents=True, exist_ok=True)
        (shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
        includes = includes + [str(shim)]
    flags = [f"-arch={arch}", "-std=c++20", "-O3", "-DWITH_CUDA", *cpp_extension.COMMON_NVCC_FLAGS,
             *[f"-I{p}" for p in includes]]

    def one(src):
        cmd = [nvcc, *flags, "-c", str(src), "-o", str(out_dir / (Path(src).stem + ".o"))]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout} s: {' '.join(cmd)}"
        return r.returncode == 0, r.stdout + r.stderr

    sources = sources or CU_SOURCES
    with ThreadPoolExecutor(len(sources)) as pool:
        return dict(zip([Path(s).name for s in sources], pool.map(one, sources)))
