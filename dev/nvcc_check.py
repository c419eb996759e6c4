"""
Compile check of the CUDA kernels for machines with nvcc but no GPU: `nvcc -arch=sm_90 -c` on
dflash_kernels/kv_inject.cu and dflash_kernels/accept_scan.cu (no link, no device needed), in parallel.

    python dev/nvcc_check.py                # both .cu files for sm_90 (an H100/H200)
    python dev/nvcc_check.py --arch sm_80

NOTE: CPU-only torch wheels ship the CUDA headers but not the generated
c10/cuda/impl/cuda_cmake_macros.h; an empty stand-in is supplied for the check.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file (python dev/nvcc_check.py)
    sys.path.insert(0, str(ROOT))
import dflash_kernels as kernels


def check(sources=None, arch="sm_90", out_dir=None, timeout=300):
    """{source name: (ok, log)} for each .cu; raises FileNotFoundError without nvcc."""
    from torch.utils import cpp_extension
    nvcc = shutil.which("nvcc") or (cpp_extension.CUDA_HOME
                                    and os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    if not nvcc or not os.path.exists(nvcc):
        raise FileNotFoundError("nvcc not found")
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="dflash_nvcc_"))
    includes = cpp_extension.include_paths()
    macros = Path("c10", "cuda", "impl", "cuda_cmake_macros.h")
    if not Path(includes[0], macros).exists():
        (out_dir / "shim" / macros).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "shim" / macros).write_text("#pragma once\n")
        includes = includes + [str(out_dir / "shim")]
    flags = [f"-arch={arch}", "-std=c++20", "-O3", *cpp_extension.COMMON_NVCC_FLAGS,
             *[f"-I{p}" for p in includes]]

    def one(src):
        cmd = [nvcc, *flags, "-c", str(src), "-o", str(out_dir / (Path(src).stem + ".o"))]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout} s: {' '.join(cmd)}"
        return r.returncode == 0, r.stdout + r.stderr

    sources = sources or [s for s in kernels.SOURCES if s.suffix == ".cu"]
    with ThreadPoolExecutor(len(sources)) as pool:
        return dict(zip([Path(s).name for s in sources], pool.map(one, sources)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90", help="the GPU architecture (default: sm_90)")
    args = ap.parse_args(argv)
    try:
        results = check(arch=args.arch)
    except FileNotFoundError as e:
        print(f"nvcc_check: {e}")
        return 1
    for name, (ok, log) in results.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}" + ("" if ok else "\n" + log[-3000:]))
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
