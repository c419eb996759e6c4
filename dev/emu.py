"""
The CUDA kernels of dflash_kernels/, compiled by g++ and run on the CPU under dev/emu.h, so that a
machine without a GPU (CI, most of this project's machines) tests the kernels' own code, bit
for bit against the PyTorch references.

Each .cu is copied into out/cuda_build/dflash_kernels_emu/ with two textual edits (its c10/cuda
includes dropped, every `kernel<<<grid, block, shmem, stream>>>(args)` rewritten to
`emu::Launch(grid, block, shmem, stream).run(kernel, args)`) and compiled with emu.h included
first, next to dflash_kernels/ext.cpp built with -DDFLASH_EMU (CPU tensors go to the kernels).

    python dev/emu.py                       # build, then the self-check of every kernel version
    python dev/emu.py --run bench.py --methods ar,dflash --n-prompts 4
                                            # a script with the emulated kernels in the loop
"""

import argparse
import re
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file (python dev/emu.py)
    sys.path.insert(0, str(ROOT))
import dflash_kernels as kernels

EMU_H = Path(__file__).resolve().parent / "emu.h"
NAME = "dflash_kernels_emu"

_emu = None  # the emulated build, once loaded


def load(verbose=False):
    """The extension with the kernels emulated on the CPU (slow: for tests). Raises if it
    cannot build (needs ninja, a C++ compiler and ucontext, i.e. Linux or macOS)."""
    global _emu
    if _emu is None:
        from torch.utils import cpp_extension
        build_dir = kernels.BUILD_ROOT / NAME
        build_dir.mkdir(parents=True, exist_ok=True)
        if not (build_dir / f"{NAME}.so").exists():  # g++ is silent for half a minute
            print(f"emu: building {NAME} into {build_dir} (later runs reuse it)", flush=True)
        sources = [str(kernels.HERE / "ext.cpp")]
        for src in kernels.SOURCES[1:]:  # the .cu files
            # the dropped include lines stay empty, so that line numbers stay those of the .cu
            text = re.sub(r"^#include <c10/cuda/.*$", "", src.read_text(), flags=re.M)
            text = re.sub(r"(\w+(?:<\w+>)?)<<<(.*?)>>>\(", r"emu::Launch(\2).run(\1, ", text)
            text = f'#include "{EMU_H}"\n#line 1 "{src}"\n' + text  # errors point into the .cu
            dst = build_dir / f"{src.stem}_emu.cpp"
            if not dst.exists() or dst.read_text() != text:  # unchanged: ninja's cache holds
                dst.write_text(text)
            sources.append(str(dst))
        # -ffp-contract=off: g++ must not fuse a * b + c into an FMA where nvcc, told by the
        # kernels' __fmul_rn and friends, does not either
        flags = ["-O2", "-ffp-contract=off", "-DDFLASH_EMU"]
        _emu = cpp_extension.load(name=NAME, sources=sources, extra_cflags=flags,
                                  build_directory=str(build_dir), verbose=verbose)
    return _emu


def install(ext=None):
    """Route CPU tensors through the emulated kernels (kernels.available('cpu') is True from
    here on), for the rest of this process."""
    kernels._ext["cpu"] = ext or load()
    print("kernels: cpu tensors use the CUDA kernels emulated on the CPU (dev/emu.h)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS",
                    help="run a script (bench.py, sample.py ...) with the emulated kernels")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = ap.parse_args(argv)
    from dev.kernels_check import run
    try:
        ext = load(verbose=args.verbose)
    except Exception as e:
        last = (str(e).strip().splitlines() or [""])[-1]  # the compiler's output: --verbose
        print(f"emu: the emulated build failed: {type(e).__name__}: {last}")
        return 1
    if args.run:
        install(ext)
        sys.argv = args.run
        runpy.run_path(str(Path(args.run[0])), run_name="__main__")
        return 0
    print(f"kernels self-check, CUDA kernels emulated on the CPU (dev/emu.h), torch "
          f"{torch.__version__}; untimed")
    return run(ext, "cpu", repeat=0, tag="emu")


if __name__ == "__main__":
    sys.exit(main())
