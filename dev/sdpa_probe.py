"""
Which attention kernel PyTorch picks for the target's cached pass, and what that costs.

The verify pass attends with a boolean mask (per-row cache lengths) over grouped-query K/V
(`enable_gqa=True`, 4 query heads on 2 K/V heads in the cpu preset). PyTorch only takes a fused
kernel that supports every argument, and masked GQA is reported to fall back to the math
kernel on CUDA (several launches and a materialised score matrix per layer). This probe tries
each backend alone on the target's shapes, then times the default choice against expanding the
K/V heads by hand (no enable_gqa), which the fused kernels take with a mask:

    python dev/sdpa_probe.py                # cuda if present, else cpu; part of dev/gpu_check.sh
    python dev/sdpa_probe.py --device cpu --repeat 20

Nothing in the project depends on it. On an H200 (docs/experiments.md) float32
went to math as reported, and expanding by hand was faster (0.14 against 0.21 ms a call); in
bfloat16 cuDNN took it, fast once planned, but it plans every new shape (~70 ms), so decoding
runs without it (model.DECODING_ATTENTION) and gets math there too. Times here exclude planning.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a file (python dev/sdpa_probe.py)
    sys.path.insert(0, ROOT)
from checkpoint import get_device
from dev.kernels_check import median_ms
from model import PRESETS

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def inputs(cfg, B, T_q, T_kv, dtype, device):
    """q (B, H, T_q, D), k/v (B, H_kv, T_kv, D) and a ragged boolean mask (B, 1, T_q, T_kv)."""
    g = torch.Generator().manual_seed(0)
    D, H, H_kv = cfg["n_embd"] // cfg["n_head"], cfg["n_head"], cfg["n_kv_head"]
    q = torch.randn(B, H, T_q, D, generator=g)
    k, v = torch.randn(2, B, H_kv, T_kv, D, generator=g)
    lengths = T_kv - T_q - torch.arange(B) % 5                       # rows of different lengths
    key = torch.arange(T_kv)[None, None, :]                          # (1, 1, T_kv)
    mask = key <= (lengths[:, None, None] + torch.arange(T_q)[None, :, None])  # (B, T_q, T_kv)
    return [t.to(device, dtype) for t in (q, k, v)] + [mask[:, None].to(device)]


def expand_kv(q, k):
    return k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None,
                   help="device to probe (default: cuda if available, else cpu)")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                   help="the target shape to probe (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=200,
                   help="timed calls per case (median; default: %(default)s)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    try:
        device = get_device(args.device)
    except ValueError as e:  # cuda without a GPU, an unknown device: one line
        p.error(str(e))
    cfg = PRESETS[args.preset]
    T_kv = cfg["max_seq_len"]
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    print(f"sdpa probe on {device} | preset {args.preset}: {cfg['n_head']} query heads on "
          f"{cfg['n_kv_head']} K/V heads, {T_kv} keys | torch {torch.__version__}")
    print(f"{'dtype':9s} {'B':>3s} {'T_q':>4s}  backends that take mask + enable_gqa"
          f"{'':14s} gqa ms  expand ms")
    for dtype in dtypes:
        for B, T_q in [(1, 1), (1, 16), (16, 16)]:
            q, k, v, mask = inputs(cfg, B, T_q, T_kv, dtype, device)
            sdpa = F.scaled_dot_product_attention
            gqa = lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
            expanded = lambda: sdpa(q, expand_kv(q, k), expand_kv(q, v), attn_mask=mask)
            takes = []
            for be in BACKENDS:
                try:
                    with sdpa_kernel(be):
                        gqa()
                    takes.append(be.name.split("_")[0].lower())
                except (RuntimeError, NotImplementedError):  # "No available kernel": refused
                    pass
            atol = 2e-2 if dtype != torch.float32 else 1e-5
            if not torch.allclose(gqa().float(), expanded().float(), atol=atol):
                print(f"MISMATCH between enable_gqa and expanded K/V at B={B} T_q={T_q} {dtype}")
                return 1
            t_gqa = median_ms(gqa, device, args.repeat)
            t_expanded = median_ms(expanded, device, args.repeat)
            print(f"{str(dtype).split('.')[1]:9s} {B:3d} {T_q:4d}  {', '.join(takes):50s} "
                  f"{t_gqa:6.3f}  {t_expanded:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
