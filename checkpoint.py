"""
Checkpoints: save, load and hash them; load the target, and a drafter by method name.

A checkpoint is a torch.save'd dict: kind ("target", "mtp", "eagle", "dflash"), config,
state_dict, args (the trainer's flags); a target's also the tokenizer's hash, a drafter's the
target_hash (weights_hash) of the target it was trained for, so that a drafter never runs
against another target. A Hugging Face Qwen3 folder or a z-lab DFlash folder loads wherever a
checkpoint does (interop.py).
"""

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
    cfg = asdict(cfg)
    # fields added after the reference weights were trained count only where they are not
    # their default, so that the committed drafters still match their target
    late = {"head_dim": cfg["n_embd"] // cfg["n_head"], "tie_embeddings": False}
    cfg = {k: v for k, v in cfg.items() if k not in late or v != late[k]}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for name in sorted(state_dict):  # bf16's bits as int16: numpy has no bf16
        t = state_dict[name].detach().to("cpu", torch.bfloat16).view(torch.int16)
        h.update(name.encode() + t.numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(path, obj):
    """Write atomically (data.atomic_open) so Ctrl-C never leaves a torn checkpoint."""
    with data.atomic_open(path, "wb") as f:
        torch.save(obj, f)


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
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):  # mps, meta, xpu...: torch fails later, obscurely
        raise ValueError(f"device {name!r}: this code runs on cpu or cuda (cuda:N)")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= n:
        raise ValueError(f"device {name!r}: {f'only {n}' if n else 'no'} CUDA device visible "
                         f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})")
    return device


def finite(model, where, params=None):
    """NaN/inf weights (a damaged file, a diverged run): NaN logits, refused at load and save."""
    if not bool(torch.stack([p.isfinite().all() for p in params or model.parameters()]).all()):
        raise ValueError(f"{where}: the weights are not all finite (NaN or inf)")
    return model


def load_target(path, device="cpu", dtype=torch.float32):
    """A target checkpoint trained with our tokenizer, or a Hugging Face Qwen3 folder."""
    if os.path.isdir(path):
        return finite(interop.readable(interop.load_hf_target, path, device, dtype), path)
    ckpt = load_checkpoint(path, kind="target")
    if ckpt.get("tokenizer") != data.tokenizer_hash():
        raise ValueError(f"{path}: trained with tokenizer {ckpt.get('tokenizer')}, "
                         f"but tokenizer.tiktoken is {data.tokenizer_hash()}; retrain the target")
    cfg = interop.readable(lambda _: Config(**ckpt["config"]), path)
    model = fitted(Transformer(cfg), ckpt["state_dict"], path)
    model.to(device=device, dtype=dtype).eval()
    model.ckpt = ckpt  # keep args, native mtp heads, etc. for whoever needs them
    return finite(model, path)


def fitted(model, sd, where):
    """model with sd's tensors; missing, unexpected or misshapen ones (a hand-edited config,
    another model's weights) are refused in one line that names where, before any is copied."""
    interop.load_renamed(model, sd, {k: k for k in model.state_dict()}, where)
    return model


def load_tokenizer(target_path):
    """The target's tokenizer: a Hugging Face folder's tokenizer.json, else ours."""
    if os.path.isdir(target_path):
        return interop.readable(interop.load_hf_tokenizer, target_path)
    return data.get_encoding()


def load_drafter(method, target, folder, block_size=None, dflash_sample=True, mtp_draft=None,
                 tree_nodes=32, confidence=0.0):
    """The drafter for a method name (ar: None) from folder/<method>.pt, checked against the target
    (or the target's own MTP heads, or a z-lab DFlash folder); dflash-tree carries a DraftTree.
    confidence (draft, mtp, eagle, dflash): stop drafting where unsure (draft_simple.cut_unsure)."""
    if method == "ar":
        return None
    if method == "ngram":
        return NgramDrafter()
    if method == "draft":  # follows the target's device and dtype
        w = target.head.weight
        return ModelDrafter(load_target(os.path.join(folder, "draft.pt"), w.device, w.dtype),
                            confidence=confidence)
    kind = "dflash" if method == "dflash-tree" else method  # the tree drafts with dflash.pt
    if kind not in FEATURE_DRAFTERS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    native = getattr(target, "ckpt", {}).get("mtp_state_dict")
    src = os.path.join(folder, f"{kind}.pt")
    if kind == "mtp" and native:
        src = "the target's own heads"
        model = fitted(MTP(target.cfg, target.ckpt["args"]["mtp_depth"]), native, src)
    elif (kind == "dflash" and os.path.isfile(os.path.join(folder, "config.json"))
          and not os.path.isfile(src)):  # a dflash.pt beside it is ours, and checked: it wins
        model = interop.readable(interop.load_zlab_dflash, folder, target)
        src = f"z-lab folder {folder}"
    else:
        ck = load_checkpoint(src, kind=kind)
        th = weights_hash(target.cfg, target.state_dict())
        if ck.get("target_hash") != th:
            raise ValueError(f"{src}: trained for target {ck.get('target_hash')}, not this one "
                             f"({th}); retrain it with train_drafter.py --method {kind}")
        try:  # a hand-edited config: a field the model does not take, a value of the wrong type
            model = FEATURE_DRAFTERS[kind](target.cfg, **ck["config"])
        except (TypeError, ValueError) as e:  # only these: a bug of ours (AttributeError) is loud
            raise ValueError(f"{src}: its config does not build a {kind} ({e})") from None
        model = fitted(model, ck["state_dict"], src)
    finite(model, src).to(target.head.weight).eval()  # the target's device and dtype
    n = sum(p.numel() for p in model.parameters())
    print(f"{method}: {n / 1e6:.2f}M params, target layers {model.hidden_layers} ({src})")
    if kind == "mtp":
        return MTPDrafter(target, model, n_draft=mtp_draft, confidence=confidence)
    if kind == "eagle":
        return EagleDrafter(target, model, confidence=confidence)
    if method == "dflash-tree":  # the tree is drafted from block_logits: no sample or confidence
        drafter = DFlashDrafter(target, model, block_size=block_size)
        drafter.tree = DraftTree(tree_nodes)
        return drafter
    return DFlashDrafter(target, model, block_size=block_size, sample=dflash_sample,
                         confidence=confidence)


# load_drafter's options as flags (bench.py, sample.py): flag -> (its methods, argparse settings)
DRAFTER_FLAGS = {
    "--block-size": ("dflash dflash-tree", dict(dest="block_size", type=int, default=None,
                     help="dflash block size S, drafts S-1 (default: trained, 16)")),
    "--dflash-argmax": ("dflash", dict(dest="dflash_sample", action="store_false",
                                       help="dflash at T > 0: draft argmax, not a draw from q")),
    "--tree": ("dflash-tree", dict(dest="tree_nodes", type=int, default=32,
                                   help="dflash-tree: nodes of the draft tree verified per pass")),
    "--mtp-draft": ("mtp", dict(dest="mtp_draft", type=int, default=None,
                                help="mtp: draft N tokens per step (default: its depth)")),
    "--confidence": ("draft mtp eagle dflash", dict(dest="confidence", type=float, default=0.0,
                     help="stop past a draft of probability < C (dflash: their product; a "
                     "dflash-tree verifies its whole tree); 0: off")),
}


def add_drafter_flags(parser):
    for flag, (_, kw) in DRAFTER_FLAGS.items():
        parser.add_argument(flag, **kw)


def drafter_options(args, parser, methods):
    """load_drafter's keywords from the flags; a flag for a method not run is refused."""
    if args.weights and os.path.isfile(args.weights):  # bench.py's and sample.py's --weights
        raise ValueError(f"--weights names a folder of checkpoints, not a file ({args.weights})")
    for flag, (ms, kw) in DRAFTER_FLAGS.items():  # dflash-tree ignores argmax and confidence
        used = any(m in methods for m in ms.split())
        if not used and getattr(args, kw["dest"]) != parser.get_default(kw["dest"]):
            raise ValueError(f"{flag} sets an option of {ms.replace(' ', '/')}, which is not "
                             "being run")
    if not 0 <= args.confidence <= 1:  # NaN too
        raise ValueError(f"--confidence must be within 0..1 (0: off), got {args.confidence}")
    return {kw["dest"]: getattr(args, kw["dest"]) for _, kw in DRAFTER_FLAGS.values()}
