"""
Shrink a checkpoint for weights/, the developer's step before committing reference weights:
drop the optimizer, store the weights in bf16 (the committed cpu/ files are ~4x smaller).
Loading casts them back to the compute dtype, and weights_hash is unchanged by design, so the
drafters trained for the fp32 target still match the exported one.

    python dev/export_weights.py out/cpu/target.pt weights/cpu/target.pt
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a file (python dev/export_weights.py)
    sys.path.insert(0, ROOT)
import data
from checkpoint import load_checkpoint, save_checkpoint


def export_checkpoint(src, dst, dtype=torch.bfloat16):
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise ValueError(f"{dst} is the checkpoint being exported; export to another path")
    ckpt = load_checkpoint(src)
    ckpt.pop("optimizer", None)
    for key in [k for k in ("state_dict", "mtp_state_dict") if ckpt.get(k)]:
        ckpt[key] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt[key].items()}
    save_checkpoint(dst, ckpt)
    return ckpt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=data.DefaultsHelp)
    p.add_argument("src", help="a checkpoint of train.py or train_drafter.py")
    p.add_argument("dst", help="where the bf16 copy goes, e.g. weights/cpu/target.pt")
    args = p.parse_args(argv)
    try:
        data.check_writable(args.dst)
        export_checkpoint(args.src, args.dst)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    print(f"exported {args.src} -> {args.dst} ({os.path.getsize(args.dst) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
