"""
Train a drafter on a frozen target: `mtp` (post-hoc heads, mtp.py), `eagle` (draft_eagle.py)
or `dflash` (draft_diffusion.py).

1. Self-distillation data: the target's own continuations of training prompts, generated in
   batches through the KV cache (speculate.generate, plain decoding) and cached in
   --out-dir as distill_<target hash>_<settings>.pt (the sequences made so far wait in
   .train.part.pt / .val.part.pt until then, so that a killed run's next try continues them).
   A drafter should learn what *this* target says, not what the corpus says: that is what its
   drafts are verified against (DFlash sec. 4, EAGLE).
   By default half the continuations are greedy (T = 0) and half sampled (T = 1), because
   the benchmark runs at both temperatures and a weak target's greedy text loops.
2. Training: the target stays frozen (embedding and head included); its hidden states on the
   distillation data are computed once and kept in memory. Every drafter model exposes the
   same three things: `hidden_layers` (which target layers it reads), `loss(target, tokens,
   feats, label_from)` -> (loss, stats) with per-position top-1 agreement counts, and
   `config_dict()` (what its checkpoint needs to rebuild it). By default the corpus prompt's
   next tokens are scored too (label_from = 0), although no draft is ever checked against
   them; --continuation-only scores the target's text alone, as the papers do (label_from =
   --prompt-len), which helped DFlash at T = 0 (at a cost at T = 1) and hurt EAGLE here
   (docs/experiments.md; hence not in RECIPE, though the committed DFlash used it). AdamW,
   cosine schedule, 4 % warm-up, clip 1.0 (the DFlash paper's recipe) for every method, on
   the same data and budget; batch size and peak rate per method (RECIPE below: what the
   reference weights used).
3. The checkpoint, <method>.pt in --out-dir (beside the target; out/<preset>/weights/ for the
   committed weights/<preset>/target.pt), records the hash of the target it was trained for;
   loading it against another target is an error. Until a run finishes, it keeps its state
   (optimizer, step, clock, random streams) in <method>.run.pt every --save-minutes minutes and
   every --save-every steps, and --resume continues a killed run from there.

    python train_drafter.py --method dflash --minutes 10     # for the committed weights/cpu target
    python bench.py --target weights/cpu/target.pt --weights out/cpu/weights --methods dflash   # measure it

~455 lines instead of ~300: resuming a killed run (~95 lines, its distillation included) lives
here, since a drafter at the committed budget trains for 60-175 minutes after ~8 minutes of
distillation (README, "The reference weights"): a killed one should not start over.
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

import data
from checkpoint import get_device, load_checkpoint, load_target, save_checkpoint, weights_hash
from data import DefaultsHelp, check_writable
from train import SAVE_MINUTES, check_args, check_run_flags, claim_run_file, eta_s, interrupted, run_path, save_due


# -----------------------------------------------------------------------------
# self-distillation data

class DistillInterrupted(KeyboardInterrupt):
    """Ctrl-C while distilling: the run has no state to --resume yet, but its data so far is kept."""


@torch.no_grad()
def build_distill_data(target, n_seqs, prompt_len, gen_len, temperatures, seed=0, split="train", batch=32,
                       part=None, save_minutes=0.0):
    """(n_seqs, prompt_len + gen_len) int64: random corpus windows continued by the target.
    With part (a file), the sequences made so far are saved there every save_minutes and on
    Ctrl-C, and a later call with the same arguments continues from them: it redraws the prompt
    windows of the batches already made without continuing them, so the rest is what the
    uninterrupted call would have made (on the same device and threads)."""
    from speculate import generate
    tokens = data.load_tokens(split)
    g = torch.Generator().manual_seed(seed)
    out = kept_rows(part, n_seqs, prompt_len + gen_len) if part else []
    if out:
        print(f"distill ({split}): continuing from the {len(out)} sequences kept in {part}")
    made_before, t0, t_saved = len(out), time.time(), time.time()
    keep = lambda: save_checkpoint(part, {"rows": torch.tensor(out)})  # what a later call continues from
    try:
        for i in range(0, n_seqs, batch):
            nb = min(batch, n_seqs - i)
            ix = torch.randint(len(tokens) - prompt_len, (nb,), generator=g).tolist()
            if i < made_before:
                continue  # made before: only its draw from g is repeated
            prompts = [tokens[j:j + prompt_len].astype(np.int64).tolist() for j in ix]
            temp = temperatures[(i // batch) % len(temperatures)]
            cont, _ = generate(target, prompts, None, max_new_tokens=gen_len, temperature=temp, seed=seed + i)
            out += [p + c for p, c in zip(prompts, cont)]
            eta = (time.time() - t0) / (len(out) - made_before) * (n_seqs - len(out))
            data.progress(f"distill ({split}): {len(out)}/{n_seqs} sequences | ETA {eta:.0f} s",
                          last=len(out) == n_seqs)
            if part and save_minutes and time.time() - t_saved >= save_minutes * 60:
                keep()
                t_saved = time.time()
    except KeyboardInterrupt:
        if not part:
            raise
        if len(out) > made_before:
            keep()
        kept = (f"the {len(out)} {split} sequences made so far are kept in {part}" if out
                else f"no {split} sequence was made yet")
        raise DistillInterrupted(f"{kept}; the same command continues from there") from None
    if part and len(out) > made_before:  # a finished split is kept too: Ctrl-C in the next loses only that
        keep()
    return torch.tensor(out)


def kept_rows(part, n_seqs, width):
    """The rows an interrupted distillation kept in part, as lists; [] when there is no such file
    or it does not fit (its name holds the settings, so a misfit is a damaged file)."""
    if not os.path.exists(part):
        return []
    try:
        rows = torch.load(part, weights_only=True)["rows"]
    except Exception:
        rows = None
    if not (isinstance(rows, torch.Tensor) and rows.ndim == 2 and rows.shape[1] == width and len(rows) <= n_seqs):
        print(f"distill: {part} is not usable; starting over")
        return []
    return rows.tolist()


def temperature_list(text):
    """--distill-temperatures in one spelling ("0.0,1" -> "0,1"), so that --resume compares values."""
    try:
        return ",".join(f"{float(t):.15g}" for t in text.split(","))  # 15 digits: no value changes
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of numbers, got {text!r}") from None


def get_distill_data(target, args, target_hash):
    """The cached data when every setting that shapes it matches (all are in the file name),
    else built and saved."""
    temps = [float(t) for t in args.distill_temperatures.split(",")]
    name = (f"distill_{target_hash}_{args.n_seqs}+{args.n_val_seqs}_{args.prompt_len}+{args.gen_len}"
            f"_T{'-'.join(f'{t:g}' for t in temps)}_seed{args.seed}.pt")
    path = os.path.join(args.out_dir, name)
    if os.path.exists(path):
        try:
            d = torch.load(path, weights_only=True)
            train, val = d["train"], d["val"]
            print(f"distill: reusing {path}")
            return train, val
        except Exception as e:  # a torn file (a copy cut short, a full disk); its name holds the settings
            print(f"distill: {path} is not usable ({(str(e).strip().splitlines() or [type(e).__name__])[0]}); "
                  "building it again")
    part = lambda split: f"{path[:-3]}.{split}.part.pt"  # the sequences so far of an interrupted build
    train = build_distill_data(target, args.n_seqs, args.prompt_len, args.gen_len, temps, seed=args.seed,
                               part=part("train"), save_minutes=args.save_minutes)
    val = build_distill_data(target, args.n_val_seqs, args.prompt_len, args.gen_len, temps, seed=args.seed + 1,
                             split="val", part=part("val"), save_minutes=args.save_minutes)
    save_checkpoint(path, {"train": train, "val": val})
    for split in ("train", "val"):
        if os.path.exists(part(split)):
            os.remove(part(split))
    return train, val


# -----------------------------------------------------------------------------
# the drafter models, by method

# Per-method defaults of --batch-size, --lr and --loss-decay: the recipe of the reference weights
# (docs/experiments.md, "Two tuning tries per drafter"). EAGLE and MTP gained from small batches
# at a high rate; DFlash kept the paper's rate and batch, and gained from a faster loss decay
# than its 7.
RECIPE = {"mtp": dict(batch_size=2, lr=2e-3), "eagle": dict(batch_size=2, lr=2e-3),
          "dflash": dict(batch_size=8, lr=6e-4, loss_decay=4.0)}


def dflash_features(args, n_layer):
    """How many target layers DFlash taps: --dflash-features, or 5 (every layer of a target with
    fewer). More than the target has is refused: feature_layers would cut it without a word."""
    n = min(5, n_layer) if args.dflash_features is None else args.dflash_features
    if not 1 <= n <= n_layer:
        raise ValueError(f"--dflash-features must be in 1..{n_layer} (the target's layers), got {n}")
    return n


def check_block_args(args):
    """DFlash's --block-size and --loss-decay. A block anchored at a labels a+1..a+S-1, and the
    first anchor is 1, or the prompt's last token with --continuation-only: a longer block has
    slots no sequence ever labels."""
    longest = args.prompt_len + args.gen_len - (max(1, args.prompt_len - 1) if args.continuation_only else 1)
    if not 2 <= args.block_size <= longest:
        raise ValueError(f"--block-size must be in 2..{longest} (a block labels the S-1 positions after its anchor, "
                         f"and a sequence's first anchor has {longest - 1} after it), got {args.block_size}")
    if args.loss_decay is not None and not args.loss_decay > 0:  # 0 fell back to the default
        raise ValueError(f"--loss-decay must be > 0, got {args.loss_decay}")


def make_drafter_model(method, target, args):
    if method == "mtp":
        import mtp
        return mtp.PostHocMTP(target.cfg, depth=args.mtp_depth)
    if method == "eagle":
        import draft_eagle
        return draft_eagle.Eagle(target.cfg, ttt_steps=args.ttt_steps)
    if method == "dflash":
        import draft_diffusion
        return draft_diffusion.DFlash(target.cfg, n_layer=args.dflash_layers,
                                      n_features=dflash_features(args, target.cfg.n_layer), block_size=args.block_size,
                                      anchors=args.anchors, gamma=args.loss_decay)
    raise ValueError(f"unknown method {method!r}; choose mtp, eagle or dflash")


@torch.no_grad()
def cached_features(target, tokens, layers, batch=32):
    """Concatenated hidden states (N, T, len(layers) * C) of the frozen target on every
    sequence, computed once: the target is frozen and the data fixed, so recomputing them each
    step would be waste (a target forward: on 2 CPU cores at the recipes' batch sizes, 12 % of
    a step that recomputed it for eagle, 27 % for mtp, half for dflash)."""
    t0 = time.time()
    feats = torch.cat([torch.cat(target(tokens[i:i + batch], hidden_layers=layers)[1], -1)
                       for i in range(0, len(tokens), batch)])
    gib = feats.numel() * feats.element_size() / 2**30
    print(f"target features of layers {layers}: {tuple(feats.shape)}, {gib:.2f} GiB in {time.time() - t0:.0f} s")
    return feats


@torch.no_grad()
def evaluate(model, target, val, val_feats, batch_size, label_from):
    """Mean held-out loss and per-position agreement. Whatever the loss draws at random (DFlash's
    anchors) is drawn the same at every evaluation, so the logged curve shows the model, not the
    draw, and training's own random stream does not depend on how often it evaluates."""
    model.eval()
    agree, count, losses = 0, 0, []
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for i in range(0, len(val), batch_size):
            loss, st = model.loss(target, val[i:i + batch_size], val_feats[i:i + batch_size], label_from=label_from)
            losses.append(loss.item())
            agree, count = agree + st["agree"], count + st["count"]
    model.train()
    return float(np.mean(losses)), (agree / count.clamp(min=1)).tolist()


def drafter_path(args):
    """The finished drafter's path: <out-dir>/<method>.pt (out-dir defaulting as below)."""
    return os.path.join(args.out_dir or default_out_dir(args.target), f"{args.method}.pt")


def default_out_dir(target_path):
    """Beside the target, except for the committed reference weights, which a default never
    overwrites: drafters for weights/<preset>/target.pt go to out/<preset>/weights/ (where
    bench.py puts the drafters it trains for the committed target)."""
    folder = os.path.dirname(os.path.abspath(target_path))
    if os.path.dirname(folder) == os.path.abspath(data.WEIGHTS_DIR):
        return os.path.join(data.DATA_OUT, os.path.basename(folder), "weights")
    return folder


def apply_recipe(args):
    """Flags left unset take the method's RECIPE; flags given win."""
    for k, v in RECIPE[args.method].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def recipe_of(key):
    """RECIPE's value of one flag, per method, for --help (so the help cannot go stale)."""
    return ", ".join(f"{v[key]:g} for {m}" for m, v in RECIPE.items() if key in v)


# the flags that shape a run (the model's included): resuming under others would not continue
# the same run. --minutes and --max-steps may change: the cosine schedule then stretches to the
# new budget from where the run is, which is not the run a longer budget would have made. Of
# the model flags only the method's own count: another method's never shaped this run
RUN_FLAGS = ("n_seqs", "n_val_seqs", "prompt_len", "gen_len", "distill_temperatures", "seed", "batch_size", "lr",
             "continuation_only")
METHOD_FLAGS = {"mtp": ("mtp_depth",), "eagle": ("ttt_steps",),
                "dflash": ("dflash_layers", "dflash_features", "block_size", "loss_decay", "anchors")}


def load_run(path, args, target_hash):
    """An interrupted run's state, checked before any work: same method, target and flags."""
    ck = load_checkpoint(path, kind=args.method)
    if "optimizer" not in ck:
        raise ValueError(f"{path}: not a run in progress (no optimizer state); --resume takes the "
                         f"{args.method}.run.pt that a run keeps until it finishes")
    if ck["target_hash"] != target_hash:
        raise ValueError(f"{path}: trained for target {ck['target_hash']}, not this one ({target_hash})")
    check_run_flags(path, ck["args"], args, RUN_FLAGS + METHOD_FLAGS[args.method])
    return ck


def main(args):
    apply_recipe(args)
    check_args(args, ["n_seqs", "n_val_seqs", "prompt_len", "gen_len", "batch_size", "eval_every", "mtp_depth",
                      "ttt_steps", "dflash_layers", "anchors"])
    if args.method == "dflash":
        check_block_args(args)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = get_device(args.device)
    target = load_target(args.target, device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    if args.prompt_len + args.gen_len >= target.cfg.max_seq_len:  # generate keeps one position free
        raise ValueError(f"--prompt-len + --gen-len must be below the target's context of {target.cfg.max_seq_len}, "
                         f"got {args.prompt_len} + {args.gen_len}")
    args.out_dir = args.out_dir or default_out_dir(args.target)
    if args.method == "dflash":
        args.dflash_features = dflash_features(args, target.cfg.n_layer)  # before the run flags are compared
    th = weights_hash(target.cfg, target.state_dict())
    print(f"target: {args.target} ({target.n_params() / 1e6:.2f}M params, hash {th}), device {device}")
    if args.method == "mtp" and target.ckpt.get("mtp_state_dict"):  # mtp.load_drafter prefers them
        print("NOTE: this target has native MTP heads, which bench.py and speculate.py use for mtp instead of "
              "the post-hoc heads trained here")
    path = drafter_path(args)
    run_file = run_path(path)  # <method>.run.pt until it finishes
    resumed = load_run(args.resume, args, th) if args.resume else None
    check_writable(path)  # before the distillation, not at the save after the training
    owns_run = claim_run_file(run_file, args)
    train, val = get_distill_data(target, args, th)
    train, val = train.to(device), val.to(device)
    label_from = args.prompt_len if args.continuation_only else 0  # first position scored as a label
    print(f"distill data: {tuple(train.shape)} train, {tuple(val.shape)} val sequences")

    model = make_drafter_model(args.method, target, args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.method}: {n_params / 1e6:.2f}M trainable params, target layers {model.hidden_layers}")
    train_feats = cached_features(target, train, model.hidden_layers)
    val_feats = cached_features(target, val, model.hidden_layers)
    # betas as train.py's; the light weight decay (train.py's default is 0.1) was not swept
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    budget, warm = args.minutes * 60, 0.04
    order = torch.Generator().manual_seed(args.seed)  # the data order
    step, epoch, elapsed = 0, 0, 0.0
    perm = torch.randperm(len(train), generator=order)
    per_epoch = max(1, len(train) // args.batch_size)  # full batches; the remainder sits out that epoch's order
    if resumed:  # weights, optimizer, step, clock and every random stream: the rest of the same run
        model.load_state_dict(resumed["state_dict"])
        opt.load_state_dict(resumed["optimizer"])
        step, epoch, perm, elapsed = resumed["step"], resumed["epoch"], resumed["perm"], resumed["elapsed"]
        order.set_state(resumed["rng"]["order"])
        torch.set_rng_state(resumed["rng"]["torch"])  # DFlash's anchors
        if device.type == "cuda" and "cuda" in resumed["rng"]:
            torch.cuda.set_rng_state_all(resumed["rng"]["cuda"])
        print(f"resuming {args.resume} at step {step} ({elapsed / 60:.1f} min in)")
    t0 = time.time() - elapsed
    t_saved = time.time()

    def save(path, **extra):
        save_checkpoint(path, dict(kind=args.method, config=model.config_dict(), state_dict=model.state_dict(),
                                   target_hash=th, tokenizer=data.tokenizer_hash(), args=vars(args), **extra))
    while True:
        frac = (time.time() - t0) / budget
        if args.max_steps:
            frac = max(frac, step / args.max_steps)
        if frac >= 1:
            break
        # warm-up over the first 4 % of the budget, then cosine to zero
        lr = args.lr * (frac / warm if frac < warm else 0.5 * (1 + math.cos(math.pi * (frac - warm) / (1 - warm))))
        for group in opt.param_groups:
            group["lr"] = lr
        if step // per_epoch > epoch:  # new epoch: new order (DFlash redraws its anchors every step anyway)
            epoch += 1
            perm = torch.randperm(len(train), generator=order)
        j = (step % per_epoch) * args.batch_size
        idx = perm[j:j + args.batch_size].to(device)
        loss, st = model.loss(target, train[idx], train_feats[idx], label_from=label_from)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == 1:
            vl, acc = evaluate(model, target, val, val_feats, args.batch_size, label_from)
            eta = eta_s(budget, time.time() - t0, step, args.max_steps)
            print(f"step {step:5d} | epoch {epoch} | train {loss.item():.3f} | val {vl:.3f} | lr {lr:.1e} | "
                  f"top-1 agreement per position {' '.join(f'{a:.2f}' for a in acc[:16])} | "
                  f"ETA {eta / 60:.1f} min", flush=True)
        if save_due(args, step, time.time() - t_saved):  # what --resume needs to continue the run
            rng = dict(order=order.get_state(), torch=torch.get_rng_state())
            if device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state_all()
            save(run_file, optimizer=opt.state_dict(), rng=rng, perm=perm, step=step, epoch=epoch,
                 elapsed=time.time() - t0)
            t_saved = time.time()
    vl, acc = evaluate(model, target, val, val_feats, args.batch_size, label_from)
    minutes = (time.time() - t0) / 60
    print(f"done: {step} steps, {epoch + 1} epochs in {minutes:.1f} min | val {vl:.3f} | "
          f"agreement {' '.join(f'{a:.2f}' for a in acc[:16])}")
    save(path, train_minutes=minutes, val_agreement=acc)
    if owns_run and os.path.exists(run_file):
        os.remove(run_file)  # finished: nothing left to resume
    print(f"saved {path}")
    def short(path):  # relative, unless that climbs out of here (no ../../tmp/...)
        rel = os.path.relpath(path)
        return os.path.abspath(path) if rel.split(os.sep)[0] == os.pardir else rel
    print(f"measure it: python bench.py --target {short(args.target)} --weights {short(args.out_dir)} --methods {args.method}")


def get_parser():
    p = argparse.ArgumentParser(description="Train a drafter (mtp / eagle / dflash) on a frozen target.",
                                formatter_class=DefaultsHelp)
    p.add_argument("--method", required=True, choices=["mtp", "eagle", "dflash"], help="which drafter")
    p.add_argument("--target", default=os.path.join(data.WEIGHTS_DIR, "cpu", "target.pt"),
                   help="target checkpoint (default: the committed weights/cpu/target.pt; train.py writes out/cpu/target.pt)")
    p.add_argument("--out-dir", default=None, help="where the drafter and distill data go (default: beside the target; "
                   "out/<preset>/weights for the committed weights/<preset>/target.pt)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the distilled prompts and samples, the initial "
                   "weights, the data order and the anchors (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default; 1 is faster on a busy machine)")
    g = p.add_argument_group("self-distillation data")
    g.add_argument("--n-seqs", type=int, default=1024, help="training sequences the target continues")
    g.add_argument("--n-val-seqs", type=int, default=64, help="held-out sequences (from the val split)")
    g.add_argument("--prompt-len", type=int, default=64, help="corpus tokens per prompt")
    g.add_argument("--gen-len", type=int, default=192, help="tokens the target generates per prompt")
    g.add_argument("--distill-temperatures", default="0,1", type=temperature_list,
                   help="temperatures of the continuations, cycled over the generation batches of 32 "
                   "continuations")
    g = p.add_argument_group("training")
    g.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = time only)")
    g.add_argument("--batch-size", type=int, default=None, help=f"sequences per step (default: {recipe_of('batch_size')})")
    g.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: {recipe_of('lr')}; for "
                   "dflash the paper's, which 2e-3 did not beat)")
    g.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    g.add_argument("--save-every", type=int, default=500, help="steps between saves of the run in progress to "
                   "out-dir/<method>.run.pt, removed when the run finishes (0 = by --save-minutes only)")
    g.add_argument("--save-minutes", type=float, default=SAVE_MINUTES, help="also save the run in progress once "
                   "this many minutes have passed since its last save, so that a kill loses at most that plus "
                   "one step (0 = by --save-every only; both 0 = never); the distillation data made so far too")
    g.add_argument("--resume", default=None, metavar="RUN", help="continue a killed run from its <method>.run.pt, "
                   "with the same flags; exact with --max-steps (and a --minutes it never reaches) on the same device "
                   "and threads. --minutes and "
                   "--max-steps may change (the schedule then stretches from where the run is)")
    g.add_argument("--continuation-only", action="store_true",
                   help="score only the target's continuation, not the next tokens of the corpus prompt (dflash: "
                        "anchors from the prompt's last token on). The committed dflash was trained with it; on the cpu "
                        "preset it raised dflash's tau at T = 0, lowered it at T = 1 and lowered eagle's "
                        "(docs/experiments.md)")
    g = p.add_argument_group("per method")
    g.add_argument("--mtp-depth", type=int, default=3, help="mtp: number of modules")
    g.add_argument("--ttt-steps", type=int, default=7, help="eagle: training-time-test unroll steps")
    g.add_argument("--dflash-layers", type=int, default=2, help="dflash: drafter layers")
    g.add_argument("--dflash-features", type=int, default=None, help="dflash: target layers tapped "
                   "(default: 5, or every layer of a target with fewer)")
    g.add_argument("--block-size", type=int, default=16, help="dflash: block size S (drafts S-1 tokens)")
    g.add_argument("--loss-decay", type=float, default=None, help="dflash: block position k's loss weight is "
                   f"exp(-(k-1)/GAMMA) (default: {recipe_of('loss_decay')}; it beat the paper's 7 for S = 16, "
                   "whose values are 5 for S = 10 and 4 for S = 8)")
    g.add_argument("--anchors", type=int, default=8,
                   help="dflash: anchors (blocks) per sequence per step. Few anchors, many steps: on the cpu "
                        "preset 8 reached agreement 0.23 in 6 min where 32 reached 0.13 (the paper's many "
                        "anchors amortise a target forward that we compute only once)")
    return p


if __name__ == "__main__":
    args = get_parser().parse_args()
    try:
        main(args)
    except (ValueError, FileNotFoundError) as e:  # bad input (device, target checkpoint): one line, no traceback
        raise SystemExit(f"error: {e}")
    except DistillInterrupted as e:  # no run state saved yet: --resume would find nothing
        print(f"\ninterrupted while distilling; {e}", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        interrupted(run_path(drafter_path(args)))
