"""
Self-check of the CUDA kernels, as llm.c's dev/cuda does it: every op and kernel version against
its PyTorch reference on random inputs of awkward shapes (B = 1, 3, 7; K = 1, 15; V not a
multiple of 32; rows with nothing new or empty slots; caches full of NaN show missing or stray
writes), then timed on the current GPU; exits non-zero on a mismatch. No GPU: python dev/emu.py.

    python dev/kernels_check.py [--op accept_scan] [--repeat 50]
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a file (python dev/kernels_check.py)
    sys.path.insert(0, ROOT)
import dflash_kernels as kernels
from draft_diffusion import kv_inject_ref
from model import Config, rope_table
from speculate import accept_scan_ref

VERSIONS = {"kv_inject": (1,), "accept_scan": (1, 2)}  # the kernel versions; see the .cu headers
KV_SHAPES = [(2, 1, 2, 64, 64, 16), (3, 3, 1, 16, 40, 7), (4, 7, 2, 64, 256, 16),
             (1, 2, 1, 4, 8, 3)]  # (L, B, H, D, T_max, T_new); the last: less than one block
ACCEPT_SHAPES = [(1, 1, 97), (1, 15, 4099), (3, 15, 97), (3, 1, 4099), (7, 15, 4099), (7, 1, 97)]
BIG_SHAPES = {  # on a GPU, at B = 1 and 32: the cpu preset's drafter and target, Qwen3-8B's
    "kv_inject": [(2, 1, 2, 64, 384, 16), (2, 32, 2, 64, 384, 16), (5, 1, 8, 128, 2048, 16),
                  (5, 32, 8, 128, 2048, 16)],
    "accept_scan": [(32, 15, 4099), (1, 15, 151936), (32, 15, 151936)]}
ACCEPT_CASES = {"greedy": torch.float32, "greedy_bf16": torch.bfloat16,  # bench --dtype bfloat16
                "sample_q": torch.float32, "sample_argmax": torch.float32}  # probabilities: f32


def make_kv_case(L, B, H, D, T_max, T_new, dtype=torch.float32, device="cpu", seed=0):
    """kv_inject's arguments: caches (L, B, H, T_max, D) full of NaN, new K/V (L, B, T_new, H, D);
    row 0 gets no new tokens when B > 1, the last row writes up to the end of the cache."""
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.full((L, B, H, T_max, D), float("nan"), dtype=dtype)
    new_k, new_v = (torch.randn(L, B, T_new, H, D, generator=g).to(dtype) for _ in "kv")
    counts = torch.randint(0, T_new + 1, (B,), generator=g)                # (B,)
    offsets = torch.randint(0, T_max - T_new + 1, (B,), generator=g)       # (B,)
    counts[0], counts[-1], offsets[-1] = 0, T_new, T_max - T_new  # B = 1: count T_new
    cos, sin = rope_table(Config(head_dim=D, max_seq_len=T_max))           # (T_max, D/2)
    args = (cache_k, cache_k.clone(), new_k, new_v, offsets, counts, cos, sin)
    return tuple(a.to(device) for a in args)


def make_accept_case(B, K, V, mode, dtype=torch.float32, device="cpu", seed=0):
    """Random accept_scan arguments (p, drafts, q, uniforms) for mode 'greedy', 'sample_q' or
    'sample_argmax' (q None). Drafts are the target's argmax, some replaced: rows accept 0 to K;
    with B >= 3 the last row's slots from K // 2 on are empty (-1). Logits have ties, sample_q's
    row 0 an all-zero residual; probabilities are multiples of 2^-16 (every sum order is exact)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K + 1, V, generator=g) * 2).round()                 # (B, K+1, V)
    wrong = torch.rand(B, K, generator=g) < 1.5 / (K + 1)
    drafts = torch.where(wrong, torch.randint(0, V, (B, K), generator=g), logits[:, :K].argmax(-1))
    if B >= 3:
        drafts[-1, K // 2:] = -1                                                 # (B, K)
    exact = lambda x: torch.floor(x.softmax(-1) * 2.0 ** 16) / 2.0 ** 16
    p = logits if mode == "greedy" else exact(logits)                            # (B, K+1, V)
    q = exact(logits[:, :K] + torch.randn(B, K, V, generator=g)) if mode == "sample_q" else None
    if q is not None and B > 1 and K > 0:  # row 0: q = p, p(d_1) = 0: an all-zero residual
        p[0, 0, drafts[0, 0]] = 0.0
        q[0] = p[0, :K]                                                          # (B, K, V)
    uniforms = (None if mode == "greedy" else                                   # (B, K+1)
                torch.rand(B, K + 1, dtype=torch.float64, generator=g))
    return tuple(t if t is None else t.to(device) for t in (p.to(dtype), drafts, q, uniforms))


def mismatches(a, b):
    """How many elements differ; NaN equals NaN (a cache slot left alone), not a number."""
    return ((a != b) & ~(a.isnan() & b.isnan())).sum().item()


def median_ms(fn, device, repeat):
    """Median of `repeat` synchronised runs, after 3 warm-up runs."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeat + 3):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def run(ext, device, repeat, op="all", tag="", big=False):
    """Validate (and time, unless repeat = 0) every kernel version of the built module `ext`,
    a row per case; tag prefixes the version ('emu' for dev/emu.py). Returns the exit status."""
    print(f"{'op':<12} {'ver':>5} {'shape':<24} {'case':<14} {'mismatch':>8} {'ref ms':>8} "
          f"{'fused ms':>9} {'speedup':>8}")
    failed = []
    def row(name, version, shape, case, fused, ref, args):
        # each on its own copy; the outputs and all tensor arguments (kv_inject writes the caches)
        a, b = ([t.clone() if torch.is_tensor(t) else t for t in args] for _ in "ab")
        out_a, out_b = [*(fused(*a) or ()), *a], [*(ref(*b) or ()), *b]
        bad = sum(mismatches(x, y) for x, y in zip(out_a, out_b) if torch.is_tensor(x))
        failed.append(bad > 0)
        t_ref, t_ext = (median_ms(lambda: f(*x), device, repeat) if repeat else 0.0
                        for f, x in ((ref, b), (fused, a)))
        timing = f"{t_ref:8.3f} {t_ext:9.3f} {t_ref / t_ext:7.1f}x" if repeat else "untimed"
        print(f"{name:<12} {tag + str(version):>5} {shape:<24} {case:<14} {bad:>8} {timing}"
              + ("  MISMATCH" if bad else ""), flush=True)
    if op in ("all", "kv_inject"):
        for shape in KV_SHAPES + (BIG_SHAPES["kv_inject"] if big else []):
            for dtype in (torch.float32, torch.bfloat16):
                row("kv_inject", 1, "LBHDTt=" + "x".join(map(str, shape)), str(dtype)[6:],
                    ext.kv_inject, kv_inject_ref, make_kv_case(*shape, dtype, device, sum(shape)))
    if op in ("all", "accept_scan"):
        for B, K, V in ACCEPT_SHAPES + (BIG_SHAPES["accept_scan"] if big else []):
            for case, dtype in ACCEPT_CASES.items():
                mode = case.removesuffix("_bf16")
                args = make_accept_case(B, K, V, mode, dtype, device, B * 1000 + K * 10 + V)
                for v in VERSIONS["accept_scan"] if mode == "greedy" else (1,):
                    row("accept_scan", v, f"BKV={B}x{K}x{V}", case,
                        lambda *a, v=v: ext.accept_scan(*a, v), accept_scan_ref, args)
    print(f"{len(failed)} rows, {sum(failed)} with mismatches" if any(failed)
          else f"all {len(failed)} rows match the reference")
    return int(any(failed))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python dev/kernels_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=["all", "kv_inject", "accept_scan"], default="all")
    ap.add_argument("--repeat", type=int, default=100, help="timed runs per row (default: 100)")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if not torch.cuda.is_available():
        print("kernels self-check: no CUDA device here, nothing to run (CPU tensors use the "
              "PyTorch references). The kernels' own code on this CPU: python dev/emu.py")
        return 0
    print(f"kernels self-check on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    kernels.VERBOSE = args.verbose
    if not kernels.available("cuda"):  # its line above says why
        return 1
    return run(kernels._ext["cuda"], "cuda", args.repeat, args.op, big=True)


if __name__ == "__main__":
    sys.exit(main())
