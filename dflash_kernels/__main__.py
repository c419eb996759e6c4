"""
Self-check of the CUDA kernels, in the manner of llm.c's dev/cuda: build the extension,
validate every op and every kernel version against its PyTorch reference on fresh random
inputs with awkward shapes (B = 1, 3, 7; K = 1, 15; V not a multiple of 32; rows with no new
tokens), then time the fused op against the reference (median of many synchronised runs).
Outputs start poisoned (caches full of NaN), so a missing or a stray write shows. Exits
non-zero on any mismatch.

    python -m dflash_kernels                              # every op and version, on the GPU
    python -m dflash_kernels --op accept_scan --repeat 50

Without a GPU there is nothing to run here: `python dev/emu.py` runs this same validation on
the kernels' own code, emulated on the CPU. The case builders are shared with the tests.
"""

import argparse
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

if not __package__:  # run as a file (python dflash_kernels/__main__.py): put the repository on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dflash_kernels as kernels
from draft_diffusion import kv_inject_ref
from model import rope_table
from speculate import accept_scan_ref

VERSIONS = {"kv_inject": (1,), "accept_scan": (1, 2)}  # the kernel versions; see the .cu headers

# -----------------------------------------------------------------------------
# inputs


def make_kv_case(L, B, H, D, T_max, T_new, dtype=torch.float32, device="cpu", seed=0):
    """Random kv_inject arguments; NaN-poisoned caches; row 0 gets no new tokens when B > 1 and
    the last row runs right up to the end of the cache."""
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.full((L, B, H, T_max, D), float("nan"), dtype=dtype)  # (L, B, H, T_max, D)
    cache_v = torch.full_like(cache_k, float("nan"))
    new_k = torch.randn(L, B, T_new, H, D, generator=g).to(dtype)          # (L, B, T_new, H, D)
    new_v = torch.randn(L, B, T_new, H, D, generator=g).to(dtype)
    counts = torch.randint(0, T_new + 1, (B,), generator=g)                # (B,)
    offsets = torch.randint(0, T_max - T_new + 1, (B,), generator=g)       # (B,)
    if B > 1:
        counts[0] = 0
    counts[-1], offsets[-1] = T_new, T_max - T_new
    cfg = SimpleNamespace(head_dim=D, rope_theta=10000.0, max_seq_len=T_max)
    cos, sin = rope_table(cfg)                                             # (T_max, D/2) each
    args = (cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin)
    return tuple(a.to(device) for a in args)


def quantize(probs, bits=16):
    """Round probabilities down to multiples of 2^-bits: with rows summing to <= ~1 every
    partial sum is then exact in float32, so any summation order gives the same CDF (header of
    accept_scan.cu)."""
    return torch.floor(probs * 2.0 ** bits) / 2.0 ** bits


def make_accept_case(B, K, V, mode, dtype=torch.float32, device="cpu", seed=0, exact=True):
    """Random accept_scan arguments (p, drafts, q, uniforms) for mode 'greedy', 'sample_q'
    (real q) or 'sample_argmax' (q = None). Drafts are made plausible so that rows accept
    anywhere from 0 to K; greedy logits have ties; exact=True quantizes the probabilities.
    With B >= 3 the last row leaves its slots from K // 2 on empty (-1, speculate.NO_DRAFT), as
    a prompt-lookup row without a match does beside rows that drafted."""
    g = torch.Generator().manual_seed(seed)
    if mode == "greedy":
        logits = (torch.randn(B, K + 1, V, generator=g) * 2).round()    # (B, K+1, V) many ties
        drafts = logits[:, :K].argmax(-1)                                # (B, K) the target's ...
        wrong = torch.rand(B, K, generator=g) < 1.5 / (K + 1)            # ... with some mistakes
        drafts = torch.where(wrong, torch.randint(0, V, (B, K), generator=g), drafts)
        return logits.to(dtype).to(device), empty_tail(drafts).to(device), None, None
    drafts = torch.randint(0, V, (B, K), generator=g)                    # (B, K)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    bump = torch.rand(B, K, generator=g) * 14                            # p(d_i) large, sometimes
    logits[:, :K].scatter_add_(2, drafts[:, :, None], bump[:, :, None])
    p = logits.softmax(-1)                                               # (B, K+1, V)
    q = None
    if mode == "sample_q":
        q = (logits[:, :K] + torch.randn(B, K, V, generator=g)).softmax(-1)  # (B, K, V)
    if exact:
        p = quantize(p)
        q = None if q is None else quantize(q)
    if q is not None:
        q_d = q.gather(2, drafts[:, :, None]).clamp(min=2.0 ** -16)
        q.scatter_(2, drafts[:, :, None], q_d)                           # q(d) > 0
        if B > 1 and K > 0:  # row 0: q = p, p(d_1) = 0 -> rejected, all-zero residual (p instead)
            p[0, 0, drafts[0, 0]] = 0.0
            q[0] = p[0, :K]
    uniforms = torch.rand(B, K + 1, generator=g)                         # (B, K+1) float32
    q = None if q is None else q.to(device)
    return p.to(dtype).to(device), empty_tail(drafts).to(device), q, uniforms.to(device)


def empty_tail(drafts):
    if drafts.shape[0] >= 3:
        drafts[-1, drafts.shape[1] // 2:] = -1
    return drafts


# -----------------------------------------------------------------------------
# comparing and timing


def mismatches(a, b):
    """(number of differing elements, max abs difference); NaN equals NaN, NaN vs number
    differs."""
    a, b = a.float(), b.float()
    both_nan = a.isnan() & b.isnan()
    differ = ((a != b) & ~both_nan).sum().item()
    diff = (a - b).abs().masked_fill(both_nan, 0).nan_to_num(nan=math.inf)
    return differ, (diff.max().item() if diff.numel() else 0.0)


def median_ms(fn, device, repeat):
    if repeat == 0:  # not timed
        return math.nan
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# -----------------------------------------------------------------------------
# the checks: ext is the built module (ext.accept_scan takes the kernel version)


def check_kv_inject(ext, shape, dtype, device, repeat):
    L, B, H, D, T_max, T_new = shape
    args = make_kv_case(L, B, H, D, T_max, T_new, dtype, device, seed=sum(shape))
    ref_k, ref_v = args[0].clone(), args[1].clone()
    kv_inject_ref(ref_k, ref_v, *args[2:])
    ext.kv_inject(*args)  # in place on the poisoned caches
    nk, ek = mismatches(args[0], ref_k)
    nv, ev = mismatches(args[1], ref_v)
    t_ref = median_ms(lambda: kv_inject_ref(*args), device, repeat)
    t_ext = median_ms(lambda: ext.kv_inject(*args), device, repeat)
    return nk + nv, max(ek, ev), t_ref, t_ext


def check_accept_scan(ext, shape, mode, version, dtype, device, repeat):
    B, K, V = shape
    p, drafts, q, u = make_accept_case(B, K, V, mode, dtype, device, seed=B * 1000 + K * 10 + V)
    n_ref, nxt_ref = accept_scan_ref(p, drafts, q, u)
    n_ext, nxt_ext = ext.accept_scan(p, drafts, q, u, version)
    bad = (n_ref != n_ext).sum().item() + (nxt_ref != nxt_ext).sum().item()
    t_ref = median_ms(lambda: accept_scan_ref(p, drafts, q, u), device, repeat)
    t_ext = median_ms(lambda: ext.accept_scan(p, drafts, q, u, version), device, repeat)
    return bad, 0.0, t_ref, t_ext


KV_SHAPES = [  # (L, B, H, D, T_max, T_new)
    (2, 1, 2, 64, 64, 16),
    (3, 3, 1, 16, 40, 7),
    (4, 7, 2, 64, 256, 16),
    (1, 2, 1, 4, 8, 3),  # 12 rotation pairs, less than one block: a grid rounded down launches none
]
ACCEPT_SHAPES = [  # (B, K, V): V not a multiple of 32
    (1, 1, 97), (1, 15, 4099), (3, 15, 97), (3, 1, 4099), (7, 15, 4099), (7, 1, 97),
]
# timed on the GPU at B = 1 (launch-bound) and B = 32: about the cpu preset's drafter (V 4099
# against its 4098) and a Qwen3-8B-sized one
BIG_SHAPES = {
    "kv_inject": [(2, 1, 2, 64, 384, 16), (2, 32, 2, 64, 384, 16), (5, 1, 8, 128, 2048, 16),
                  (5, 32, 8, 128, 2048, 16)],
    "accept_scan": [(32, 15, 4099), (1, 15, 151936), (32, 15, 151936)],
}
# greedy also on bfloat16 logits, what bench --dtype bfloat16 feeds it (sampling takes float32
# probabilities whatever the model's dtype)
ACCEPT_CASES = [("greedy", torch.float32), ("greedy", torch.bfloat16),
                ("sample_q", torch.float32), ("sample_argmax", torch.float32)]


def run(ext, device, repeat, op="all", tag="", big=False):
    """Validate (and time, unless repeat = 0) every kernel version of `ext` on `device`; print
    one row per case. tag prefixes the version column ('emu' for dev/emu.py). Exit status."""
    rows = []
    if op in ("all", "kv_inject"):
        for shape in KV_SHAPES + (BIG_SHAPES["kv_inject"] if big else []):
            for dtype in (torch.float32, torch.bfloat16):
                r = check_kv_inject(ext, shape, dtype, device, repeat)
                rows.append(("kv_inject", f"{tag}1", "LBHDTt=" + "x".join(map(str, shape)),
                             str(dtype)[6:], *r))
    if op in ("all", "accept_scan"):
        for shape in ACCEPT_SHAPES + (BIG_SHAPES["accept_scan"] if big else []):
            for mode, dtype in ACCEPT_CASES:
                for version in VERSIONS["accept_scan"] if mode == "greedy" else (1,):
                    r = check_accept_scan(ext, shape, mode, version, dtype, device, repeat)
                    case = mode + ("_bf16" if dtype == torch.bfloat16 else "")
                    rows.append(("accept_scan", f"{tag}{version}",
                                 "BKV=" + "x".join(map(str, shape)), case, *r))
    head = (f"{'op':<12} {'ver':>5} {'shape':<24} {'case':<14} {'dev':<5} {'mismatch':>8} "
            f"{'max err':>8} {'ref ms':>8} {'fused ms':>9} {'speedup':>8}")
    print(head)
    print("-" * len(head))
    failed = 0
    for op_, ver, shape, case, bad, err, t_ref, t_ext in rows:
        failed += bad > 0
        timing = (f"{'-':>8} {'-':>9} {'-':>8}" if math.isnan(t_ext)
                  else f"{t_ref:>8.3f} {t_ext:>9.3f} {t_ref / t_ext:>7.1f}x")
        print(f"{op_:<12} {ver:>5} {shape:<24} {case:<14} {torch.device(device).type:<5} "
              f"{bad:>8} {err:>8.1e} {timing}" + ("  MISMATCH" if bad else ""))
    print(f"{len(rows)} rows, {failed} with mismatches" if failed
          else f"all {len(rows)} rows match the reference")
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dflash_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=["all", "kv_inject", "accept_scan"], default="all",
                    help="which op to check (default: all)")
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N (default: cuda)")
    ap.add_argument("--repeat", type=int, default=100, help="timed runs per row (default: 100)")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    device = torch.device(args.device)
    if device.type != "cuda":
        ap.error(f"--device must be a CUDA device, got {args.device!r}")
    if not torch.cuda.is_available():
        print(f"kernels self-check: no CUDA device here (torch {torch.__version__}), nothing "
              f"to run: CPU tensors use the PyTorch references.\n"
              f"To check the kernels' own code on this CPU: python dev/emu.py")
        return 0
    print(f"kernels self-check on {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    kernels.VERBOSE = args.verbose
    if not kernels.available(device):  # its line above says why
        return 1
    return run(kernels._ext["cuda"], device, args.repeat, args.op, big=True)


if __name__ == "__main__":
    sys.exit(main())
