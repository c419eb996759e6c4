"""
Checkpoints: save, load, hash and export them; load the target, and a drafter by method name.

A checkpoint is a torch.save'd dict: kind ("target", "mtp", "eagle", "dflash"), config,
state_dict, args (the trainer's flags), and for a drafter the weights_hash of the target it was
trained for, so that a drafter is never run against another target. The committed reference
weights in weights/cpu/ are such checkpoints exported to bf16 without optimizer state.

    python checkpoint.py export out/cpu/target.pt weights/cpu/target.pt   # bf16, for weights/
    python checkpoint.py hf out/hf        # Hugging Face Qwen3 + z-lab DFlash folders (interop.py)

The methods bench.py and sample.py know, and what each one loads:
    ar      plain decoding, no drafter
    ngram   prompt lookup (draft_simple.py), no weights
    draft   a small target-family model, folder/draft.pt (train.py --preset cpu-draft)
    mtp     MTP modules (mtp.py): native heads in the target checkpoint, else folder/mtp.pt
    eagle   EAGLE-3-style drafter (draft_eagle.py), folder/eagle.pt
    dflash  the DFlash drafter (draft_diffusion.py), folder/dflash.pt
"""

import argparse
import hashlib
import json
import os
import zipfile
from dataclasses import asdict

import torch

import data
import interop
from draft_diffusion import DFlash, DFlashDrafter
from draft_eagle import Eagle, EagleDrafter
from draft_simple import ModelDrafter, NgramDrafter
from model import Config, Transformer
from mtp import MTP, MTPDrafter
from tree import DraftTree

METHODS = ("ar", "ngram", "draft", "mtp", "eagle", "dflash", "dflash-tree")
# the drafters that read target features (train_drafter.py trains them): their nn.Module
FEATURE_DRAFTERS = {"mtp": MTP, "eagle": Eagle, "dflash": DFlash}


def weights_hash(cfg, state_dict):
    """Identity of a set of weights: sha256 of the config and every tensor rounded to bf16,
    so a fp32 model and its bf16 copy in weights/ have the same hash."""
    cfg = dict(cfg if isinstance(cfg, dict) else asdict(cfg))
    # fields added after the reference weights were trained count only where they are not
    # their default, so that the committed drafters still match their target
    if cfg.get("head_dim") == cfg["n_embd"] // cfg["n_head"]:
        del cfg["head_dim"]
    if not cfg.get("tie_embeddings", True):
        del cfg["tie_embeddings"]
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for name in sorted(state_dict):
        h.update(name.encode())
        t = state_dict[name].detach().to("cpu", torch.bfloat16)
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(path, obj):
    """Write atomically (temp file, then rename) so Ctrl-C never leaves a torn checkpoint."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, kind=None):
    """torch.load with weights_only=True and one-line errors that name the file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an empty file's error has no message at all
        why = (str(e).strip().splitlines() or ["no message"])[0][:120]
        if os.path.isfile(path) and not zipfile.is_zipfile(path):  # torch's advice would mislead
            why = "not a torch.save archive: empty, truncated, or a git-lfs pointer?"
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__}: {why})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "config" not in ckpt:
        raise ValueError(f"{path}: not a checkpoint of this project (no config/state_dict)")
    if kind is not None and ckpt.get("kind") != kind:
        raise ValueError(f"{path}: is a {ckpt.get('kind')!r} checkpoint, expected {kind!r}")
    return ckpt


def get_device(name=None):
    """--device NAME -> torch.device; None picks cuda when there is one."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"device {name!r}: no CUDA device visible (torch {torch.__version__}, "
                         f"{build})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def load_target(path, device="cpu", dtype=torch.float32):
    """Load a target checkpoint, or a Hugging Face Qwen3 folder (interop.py); refuse a
    checkpoint trained with another tokenizer."""
    if os.path.isdir(path):
        return interop.load_hf_target(path, device, dtype)
    ckpt = load_checkpoint(path, kind="target")
    if ckpt.get("tokenizer") != data.tokenizer_hash():
        raise ValueError(f"{path}: trained with tokenizer {ckpt.get('tokenizer')}, "
                         f"but tokenizer.tiktoken is {data.tokenizer_hash()}; retrain the target")
    model = Transformer(Config(**ckpt["config"]))
    model.load_state_dict({k: v.float() for k, v in ckpt["state_dict"].items()})
    model.to(device=device, dtype=dtype).eval()
    model.ckpt = ckpt  # keep args, native mtp heads, etc. for whoever needs them
    return model


def load_feature_drafter(method, target, folder):
    """The nn.Module of mtp, eagle or dflash from folder/<method>.pt, checked against the target
    (MTP heads trained with the target come from its own checkpoint)."""
    native = getattr(target, "ckpt", {}).get("mtp_state_dict")
    if method == "mtp" and native:
        model, sd = MTP(target.cfg, target.ckpt["args"]["mtp_depth"]), native
        src = "the target's own heads"
    elif method == "dflash" and os.path.isfile(os.path.join(folder, "config.json")):
        model, src = interop.load_zlab_dflash(folder, target), f"z-lab folder {folder}"
        sd = model.state_dict()
    else:
        path = os.path.join(folder, f"{method}.pt")
        ck = load_checkpoint(path, kind=method)
        th = weights_hash(target.cfg, target.state_dict())
        if ck.get("target_hash") != th:
            raise ValueError(f"{path}: trained for target {ck.get('target_hash')}, not this one "
                             f"({th}); retrain it with train_drafter.py --method {method}")
        cls = FEATURE_DRAFTERS[method]
        model, sd, src = cls(target.cfg, **ck["config"]), ck["state_dict"], path
    model.load_state_dict({k: v.float() for k, v in sd.items()})
    model.to(target.head.weight).eval()  # the target's device and dtype
    n = sum(p.numel() for p in model.parameters())
    layers = getattr(model, "hidden_layers", (target.cfg.n_layer,))
    print(f"{method}: {n / 1e6:.2f}M params, target layers {layers} ({src})")
    return model


def load_drafter(method, target, folder, block_size=None, dflash_sample=True, mtp_draft=None,
                 mtp_margin=0.0, tree_nodes=32):
    """The drafter for a method name, from its checkpoint in folder; None for ar. dflash-tree
    is the dflash drafter carrying a tree.DraftTree, which speculate.generate then verifies."""
    if method == "ar":
        return None
    if method == "ngram":
        return NgramDrafter()
    if method == "draft":  # follows the target's device and dtype
        w = target.head.weight
        return ModelDrafter(load_target(os.path.join(folder, "draft.pt"), w.device, w.dtype))
    if method == "dflash-tree":
        drafter = load_drafter("dflash", target, folder, block_size)
        drafter.tree = DraftTree(tree_nodes)
        return drafter
    if method not in FEATURE_DRAFTERS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    model = load_feature_drafter(method, target, folder)
    if method == "mtp":
        return MTPDrafter(target, model, n_draft=mtp_draft, margin=mtp_margin)
    if method == "eagle":
        return EagleDrafter(target, model)
    return DFlashDrafter(target, model, block_size=block_size, sample=dflash_sample)


# load_drafter's options as command-line flags, the same in bench.py and sample.py:
# flag -> (the method it belongs to, argparse settings; dest is load_drafter's keyword)
DRAFTER_FLAGS = {
    "--block-size": ("dflash", dict(dest="block_size", type=int, default=None, help="dflash "
                     "block size S (drafts S-1), at most the trained one (default: it, 16)")),
    "--dflash-argmax": ("dflash", dict(dest="dflash_sample", action="store_false", help="dflash at "
                        "T > 0: draft each slot's argmax (default: draw it from its q)")),
    "--tree": ("dflash-tree", dict(dest="tree_nodes", type=int, default=32, help="dflash-tree: "
               "the node budget N of its draft tree (nodes verified per pass)")),
    "--mtp-draft": ("mtp", dict(dest="mtp_draft", type=int, default=None, help="mtp: draft N "
                    "tokens per step, 1..its depth (default: all its modules)")),
    "--mtp-margin": ("mtp", dict(dest="mtp_margin", type=float, default=0.0, help="mtp: stop "
                     "drafting once the top-1 vs top-2 logit margin falls below M (0: never)")),
}


def add_drafter_flags(parser):
    for flag, (_, kw) in DRAFTER_FLAGS.items():
        parser.add_argument(flag, **kw)


def drafter_options(args, parser, methods):
    """load_drafter's keywords from the flags; a flag for a method not run is refused."""
    for flag, (m, kw) in DRAFTER_FLAGS.items():
        used = any(x.startswith(m) or m.startswith(x) for x in methods)  # dflash, dflash-tree
        if not used and getattr(args, kw["dest"]) != parser.get_default(kw["dest"]):
            raise ValueError(f"{flag} sets an option of {m}, which is not being run")
    return {kw["dest"]: getattr(args, kw["dest"]) for _, kw in DRAFTER_FLAGS.values()}


def export_checkpoint(src, dst, dtype=torch.bfloat16):
    """Shrink a checkpoint for weights/: drop the optimizer, store weights in bf16. Loading casts
    them back to the compute dtype; weights_hash is unchanged by design."""
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise ValueError(f"{dst} is the checkpoint being exported; export to another path")
    ckpt = load_checkpoint(src)
    ckpt.pop("optimizer", None)
    for key in ("state_dict", "mtp_state_dict"):
        if ckpt.get(key):
            ckpt[key] = {k: v.to(dtype) if v.is_floating_point() else v
                         for k, v in ckpt[key].items()}
    save_checkpoint(dst, ckpt)
    return ckpt


def main(argv=None):
    p = argparse.ArgumentParser(description="Export checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="a checkpoint (any kind) in bf16 without its optimizer "
                       "state, as the committed weights/ are")
    e.add_argument("src", help="checkpoint to export")
    e.add_argument("dst", help="where to write it")
    h = sub.add_parser("hf", help="a target, its tokenizer and its DFlash drafter as Hugging "
                       "Face Qwen3 (OUT/target) and z-lab DFlash (OUT/dflash) folders")
    h.add_argument("out", help="the folder to write")
    h.add_argument("--target", default=os.path.join(data.WEIGHTS_DIR, "cpu", "target.pt"),
                   help="target checkpoint (default: the committed one)")
    h.add_argument("--weights", default=None, help="folder of its dflash.pt (default: the "
                   "target's)")
    args = p.parse_args(argv)
    try:
        if args.command == "export":
            data.check_writable(args.dst)
            export_checkpoint(args.src, args.dst)
            print(f"exported {args.src} -> {args.dst} ({os.path.getsize(args.dst) / 1e6:.1f} MB)")
            return
        target = load_target(args.target)
        folder = args.weights or os.path.dirname(args.target)
        dflash = load_feature_drafter("dflash", target, folder)
        hf = os.path.join(args.out, "target")
        interop.save_hf_target(target, hf)
        interop.save_hf_tokenizer(data.get_encoding(), hf, data.PAT_STR)
        interop.save_zlab_dflash(dflash, os.path.join(args.out, "dflash"))
        print(f"wrote {args.out}/target (Qwen3ForCausalLM, tokenizer.json) and {args.out}/dflash "
              "(DFlashDraftModel)")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
