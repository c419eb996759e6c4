"""
Train a drafter on a frozen target: `mtp` (post-hoc heads, mtp.py), `eagle` (draft_eagle.py)
or `dflash` (draft_diffusion.py, arXiv 2602.06036).

1. Self-distillation (DFlash sec. 4, EAGLE): the drafts are verified against *this* target, so
   the data is its own continuations of training prompts, half greedy, half at T = 1, cached
   as <out-dir>/distill_<target hash>_<settings>.pt.
2. The target stays frozen; its hidden states are computed once (or per batch: --features
   step). A drafter model has `hidden_layers`, `loss(target, tokens, feats, label_from)` ->
   (loss, per-position top-1 agreement counts) and `config_dict()`. The DFlash paper's recipe
   (AdamW, 4 % warm-up, cosine, clip 1.0) for every method; batch and lr per method (RECIPE).
3. <out-dir>/<method>.pt records its target's hash. The loop, with its --resume, is train.py's.

    python train_drafter.py --method dflash --minutes 10     # for the committed weights/cpu target
    python bench.py --target weights/cpu/target.pt --weights out/cpu/weights --methods dflash
"""

import argparse
import math
import os
import time

import numpy as np
import torch

import data
import speculate
from checkpoint import (FEATURE_DRAFTERS as MODELS, get_device, load_target, load_tokenizer,
                        save_checkpoint, weights_hash)
from data import DefaultsHelp, check_writable, one_line_errors
from train import check_args, load_run, train_loop


@torch.no_grad()
def build_distill_data(target, n_seqs, prompt_len, gen_len, temperatures, seed=0, split="train",
                       batch=32, enc=None, corpus="small"):
    """(N, prompt_len + gen_len) int64: windows of data.py's corpus continued by the target, the
    batches cycling through the temperatures, with progress and ETA. enc: the target's own
    tokenizer when it is not ours (a Hugging Face folder): windows are re-encoded with it."""
    tokens = data.load_tokens(split, corpus=corpus)
    batch = min(batch, -(-n_seqs // len(temperatures)))  # a batch per temperature at least
    span = 4 * prompt_len if enc is not None else prompt_len  # windows whole, re-encoded too
    g, out, t0 = torch.Generator().manual_seed(seed), [], time.time()
    for i in range(0, n_seqs, batch):
        ix = torch.randint(len(tokens) - span, (min(batch, n_seqs - i),), generator=g)
        prompts = [tokens[j:j + prompt_len].astype(np.int64).tolist() for j in ix.tolist()]
        if enc is not None:  # the same text in its tokens: 4x ours is plenty for prompt_len
            texts = [data.get_encoding().decode(tokens[j:j + span].tolist()) for j in ix]
            prompts = [enc.encode_ordinary(t)[:prompt_len] for t in texts]
            if min(map(len, prompts)) < prompt_len:  # refused at the first batch, not the end
                raise ValueError(f"the target's tokenizer is over 4x coarser than ours: {span} of "
                                 f"our tokens re-encode to fewer than --prompt-len {prompt_len}")
        temp = temperatures[(i // batch) % len(temperatures)]
        # a seed per batch: one for all would give every sampled batch the same random stream
        cont, _ = speculate.generate(target, prompts, None, max_new_tokens=gen_len,
                                     temperature=temp, seed=seed + i)
        out += [p + c for p, c in zip(prompts, cont)]
        eta = (time.time() - t0) / len(out) * (n_seqs - len(out))
        data.progress(f"distill ({split}): {len(out)}/{n_seqs} sequences | ETA {eta:.0f} s",
                      last=len(out) == n_seqs)
    return torch.tensor(out)


def get_distill_data(target, args, target_hash, enc=None):
    """The cached data if every setting that shapes it (in the file name) matches, else built."""
    a, temps = args, args.distill_temperatures
    name = (f"distill_{target_hash}_{a.corpus}_{a.n_seqs}+{a.n_val_seqs}_{a.prompt_len}+{a.gen_len}"
            f"_T{'-'.join(f'{t:g}' for t in temps)}_b{a.distill_batch}_seed{a.seed}.pt")
    path = os.path.join(args.out_dir, name)
    if os.path.exists(path):  # whole: save_checkpoint writes a temp file, then renames it
        print(f"distill: reusing {path}")
        try:
            d = torch.load(path, weights_only=True)
            return d["train"], d["val"]
        except Exception as e:  # cut short or overwritten by hand: say which file, and the cure
            raise ValueError(f"{path} is damaged ({type(e).__name__}): delete it to rebuild")
    d = {split: build_distill_data(target, n, a.prompt_len, a.gen_len, temps, seed=a.seed + k,
                                   split=split, batch=a.distill_batch, enc=enc, corpus=a.corpus)
         for k, (split, n) in enumerate([("train", a.n_seqs), ("val", a.n_val_seqs)])}
    save_checkpoint(path, d)
    return d["train"], d["val"]


# Per-method defaults of --batch-size, --lr, --loss-decay: the reference weights' recipe
# (docs/experiments.md). EAGLE and MTP gained from small batches at a high lr; DFlash kept the
# paper's, with a faster loss decay than its 7.
RECIPE = {"mtp": dict(batch_size=2, lr=2e-3), "eagle": dict(batch_size=2, lr=2e-3),
          "dflash": dict(batch_size=8, lr=6e-4, loss_decay=4.0)}
recipe_of = lambda key: ", ".join(f"{v[key]:g} for {m}" for m, v in RECIPE.items() if key in v)


def check_block_size(args):
    """DFlash's --block-size. A block anchored at a labels a+1..a+S-1 and the first anchor is 1
    (with --continuation-only the prompt's last): no slot may go unlabelled."""
    first = max(1, args.prompt_len - 1) if args.continuation_only else 1
    longest = args.prompt_len + args.gen_len - first
    if not 2 <= args.block_size <= longest:
        raise ValueError(f"--block-size must be in 2..{longest} (a block labels the S-1 "
                         f"positions after its anchor), got {args.block_size}")


# each method's constructor arguments and the flags that set them ("per method" in --help)
MODEL_FLAGS = {"mtp": dict(depth="mtp_depth"), "eagle": dict(ttt_steps="ttt_steps"), "dflash": dict(
    n_layer="dflash_layers", block_size="block_size", anchors="anchors", gamma="loss_decay")}


def model_config(args):
    """A fresh drafter's constructor arguments, from the flags (a resumed one takes its file's)."""
    return {k: getattr(args, flag) for k, flag in MODEL_FLAGS[args.method].items()}


@torch.no_grad()
def evaluate(model, target, val, val_feats, batch_size, label_from):
    """Mean held-out loss and per-position agreement. The loss's random draws (DFlash's anchors)
    are the same at every call (the curve shows the model), and training's stream is untouched."""
    model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = [model.loss(target, val[i:i + batch_size], val_feats[i:i + batch_size],
                          label_from=label_from) for i in range(0, len(val), batch_size)]
    model.train()
    agree, count = sum(st["agree"] for _, st in out), sum(st["count"] for _, st in out)
    return float(np.mean([loss.item() for loss, _ in out])), (agree / count.clamp(min=1)).tolist()


def apply_recipe(args):
    for k, v in RECIPE[args.method].items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    return args


def main(args):
    apply_recipe(args)
    check_args(args, ["n_seqs", "n_val_seqs", "prompt_len", "gen_len", "distill_batch", "mtp_depth",
                      "ttt_steps", "dflash_layers", "anchors"], positive=["loss_decay"])
    if not all(0 <= t < math.inf for t in args.distill_temperatures):  # NaN too
        raise ValueError("--distill-temperatures must each be >= 0 and finite")
    unset = apply_recipe(get_parser().parse_args(["--method", args.method]))  # flags not given
    for m, flag in ((m, f) for m, fs in MODEL_FLAGS.items() for f in fs.values()):
        if m != args.method and getattr(args, flag) != getattr(unset, flag):
            raise ValueError(f"--{flag.replace('_', '-')} sets an option of {m}, not {args.method}")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads or torch.get_num_threads())  # 0: torch's choice
    device = get_device(args.device)
    target = load_target(args.target, device=device).requires_grad_(False)
    if args.prompt_len + args.gen_len >= target.cfg.max_seq_len:  # generate keeps one free
        raise ValueError(f"--prompt-len + --gen-len must be below the target's context of "
                         f"{target.cfg.max_seq_len}, got {args.prompt_len} + {args.gen_len}")
    if args.method == "dflash":  # refused here, before the distillation
        check_block_size(args)
    args.out_dir = args.out_dir or data.out_dir_for(os.path.dirname(os.path.abspath(args.target)))
    th = weights_hash(target.cfg, target.state_dict())
    hf_enc = load_tokenizer(args.target) if os.path.isdir(args.target) else None  # its own
    print(f"target: {args.target} ({target.n_params() / 1e6:.2f}M params, hash {th}), "
          f"device {device}")
    if args.method == "mtp" and target.ckpt.get("mtp_state_dict"):  # load_drafter prefers them
        print("NOTE: this target has native MTP heads, which bench.py and sample.py use instead")
    path, ck, resume = os.path.join(args.out_dir, f"{args.method}.pt"), None, None
    if args.resume is not None:  # checked before the distillation, which takes minutes
        ck, resume = load_run(args.resume, path, args.method)
        if ck.get("target_hash") != th:
            raise ValueError(f"{resume}: trained for target {ck.get('target_hash')}, not {th}")
        saved, default = ck["config"], model_config(unset)  # a flag given against the file's
        if bad := [k for k, v in model_config(args).items() if v not in (default[k], saved[k])]:
            raise ValueError(f"{resume} keeps its own " + ", ".join(f"{k} {saved[k]}" for k
                             in bad) + " (a resumed run keeps its model): leave those flags out")
    check_writable(path)
    train, val = (x.to(device) for x in get_distill_data(target, args, th, hf_enc))  # (N, T) ids
    label_from = args.prompt_len if args.continuation_only else 0  # first position scored

    config = ck["config"] if ck else model_config(args)
    model = MODELS[args.method](target.cfg, **config).to(device)
    params = list(model.parameters())
    print(f"{args.method}: {sum(p.numel() for p in params) / 1e6:.2f}M trainable params, "
          f"target layers {model.hidden_layers}")
    t0, layers, C = time.time(), model.hidden_layers, target.cfg.n_embd
    @torch.no_grad()
    def feats(x):  # the frozen target's hidden states (N, T, L * C), filled in place (a cat of
        try:       # chunks: 2x); those of every sequence at once (--features once) may not fit
            out = x.new_empty(*x.shape, len(layers) * C, dtype=target.head.weight.dtype)
        except RuntimeError as e:  # the CPU allocator's, or CUDA's OutOfMemoryError
            raise ValueError(f"the target's features of {len(x)} sequences do not fit in memory "
                             f"({str(e).splitlines()[0]}): try --features step") from e
        for i in range(0, len(x), 32):
            out[i:i + 32] = torch.cat(target(x[i:i + 32], hidden_layers=layers)[1], -1)
        return out
    train_feats, val_feats = feats(train) if args.features == "once" else None, feats(val)
    print(f"target features of layers {layers} ({args.features}; {len(train)} + {len(val)} "
          f"sequences of {train.shape[1]}), in {time.time() - t0:.0f} s")
    # betas as train.py's; the light weight decay (train.py's WEIGHT_DECAY is 0.1) was not swept
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    per_epoch, acc = max(1, len(train) // args.batch_size), None  # the rest sits out an epoch

    def train_step(step):
        epoch, j = divmod(step, per_epoch)  # the order is (seed, epoch)'s: a resume needs no state
        order = torch.Generator().manual_seed(args.seed + epoch)
        perm = torch.randperm(len(train), generator=order)
        idx = perm[j * args.batch_size:(j + 1) * args.batch_size].to(device)
        f = feats(train[idx]) if train_feats is None else train_feats[idx]
        loss, _ = model.loss(target, train[idx], f, label_from=label_from)
        return loss, lambda: f"epoch {epoch} | train {loss.item():.3f}"

    def report():
        nonlocal acc
        vl, acc = evaluate(model, target, val, val_feats, args.batch_size, label_from)
        agree = " ".join(f"{a:.2f}" for a in acc[:16])
        return f"val {vl:.3f} | top-1 agreement per position {agree}"

    fields = lambda: dict(kind=args.method, config=model.config_dict(), target_hash=th,
                          val_agreement=acc)

    def lr_at(frac, step):  # the DFlash paper's: linear warm-up over 4 % of the run, cosine to 0
        cos = 0.5 * (1 + math.cos(math.pi * (frac - 0.04) / (1 - 0.04)))
        return args.lr * (frac / 0.04 if frac < 0.04 else cos)
    train_loop(args, model, opt, params, lr_at, train_step, report, fields, path, ck, resume)
    print(f"measure it: python bench.py --target {args.target} --weights {args.out_dir} "
          f"--methods {args.method}")  # the paths as given


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelp)
    p.add_argument("--method", required=True, choices=list(MODELS), help="which drafter")
    p.add_argument("--target", default=os.path.join(data.REF_WEIGHTS, "target.pt"),
                   help="target checkpoint or Hugging Face Qwen3 folder (default: the committed "
                   "weights/cpu/target.pt)")
    p.add_argument("--out-dir", default=None, help="for the drafter and the distillation data "
                   "(default: beside the target; out/<preset>/weights for weights/<preset>/)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, weights and anchors")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's choice)")
    g = p.add_argument_group("self-distillation data")
    g.add_argument("--corpus", default="small", choices=data.CORPORA, help="of the prompts")
    g.add_argument("--n-seqs", type=int, default=1024, help="training prompts to continue")
    g.add_argument("--n-val-seqs", type=int, default=64, help="held-out ones (the val split)")
    g.add_argument("--prompt-len", type=int, default=64, help="corpus tokens per prompt")
    g.add_argument("--gen-len", type=int, default=192, help="tokens generated per prompt")
    g.add_argument("--distill-temperatures", default="0,1",  # argparse parses the default too
                   type=lambda text: [float(t) for t in text.split(",")],
                   help="comma list of temperatures, cycled per --distill-batch batch")
    g.add_argument("--distill-batch", type=int, default=32, help="continuations generated at once")
    g = p.add_argument_group("training")
    g.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the "
                   "training steps (the distillation and the target's features come first)")
    g.add_argument("--max-steps", type=int, default=0, help="step limit (0: the clock only)")
    g.add_argument("--batch-size", type=int, help=f"sequences per step ({recipe_of('batch_size')})")
    g.add_argument("--lr", type=float, default=None, help=f"peak lr (default: {recipe_of('lr')})")
    g.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    g.add_argument("--save-minutes", type=float, default=2.0,
                   help="minutes between saves to <method>.run.pt (0: at the end and on Ctrl-C)")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="FILE",
                   help="continue the run from its .run.pt (or finished <method>.pt), or FILE")
    g.add_argument("--continuation-only", action="store_true", help="score the target's text only")
    g.add_argument("--features", choices=["once", "step"], default="once",
                   help="the target's hidden states: once, kept in memory (14 GB for 12,288 "
                   "DFlash sequences of 224), or per batch every step (val's kept; ~2x a step)")
    g = p.add_argument_group("per method")
    g.add_argument("--mtp-depth", type=int, default=3, help="mtp: number of modules")
    g.add_argument("--ttt-steps", type=int, default=7, help="eagle: training-time-test steps")
    g.add_argument("--dflash-layers", type=int, default=2, help="dflash: drafter layers")
    g.add_argument("--block-size", type=int, default=16, help="dflash: block size S (S-1 drafts)")
    g.add_argument("--loss-decay", type=float, default=None, help="dflash: position k's loss "
                   f"weight is exp(-(k-1)/GAMMA) (default: {recipe_of('loss_decay')})")
    g.add_argument("--anchors", type=int, default=8, help="dflash: blocks per sequence per step")
    return p


if __name__ == "__main__":
    with one_line_errors():
        main(get_parser().parse_args())
