"""
Train the target (or the small `draft` model) on the Python-source corpus of data.py.

AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA and fp32 on
CPU. Training is budgeted in wall-clock minutes: the learning-rate schedule follows the
fraction of the budget used (or of --max-steps, whichever is further along), so a run of
any length ends on a fully decayed schedule. With --mtp-depth D it also trains D native
multi-token-prediction modules (mtp.py) with the target, loss weight lambda / D.

At the end it prints a quality report: greedy continuations of held-out prompts and how
often they repeat their own 8-grams, against the real code. A target that loops makes every
drafter look brilliant, so this number decides whether a benchmark on it means anything.

Resume: every --save-minutes (2) a run saves its weights, optimizer, step and clock to the
checkpoint's path with .run.pt (out/cpu/target.run.pt), never to the checkpoint itself, so a
killed run cannot pass for a finished target. The same command plus --resume continues it;
--resume FILE continues FILE, e.g. a finished checkpoint given a larger --minutes. The model's
shape (preset, MTP depth) comes from the file; give the other flags as before.

    python train.py --preset cpu                # ~8 minutes on 2 cores -> out/cpu/target.pt
    python train.py --preset cpu-draft --out-path out/cpu/draft.pt   # the `draft` method's model
    python train.py --preset tiny --minutes 1   # smoke test
"""

import argparse
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import data
import speculate
from checkpoint import get_device, load_checkpoint, save_checkpoint
from data import DefaultsHelp, check_writable
from draft_simple import NgramDrafter
from model import PRESETS, Config, Transformer
from mtp import MTP

DEFAULT_MINUTES = {"tiny": 1.0, "cpu": 8.0, "cpu-draft": 3.0, "gpu": 5.0, "gpu-draft": 2.0}


def get_batch(tokens, batch_size, seq_len, gen, device):
    """Random windows of seq_len+1 tokens from a token memmap -> (B, T+1) int64."""
    ix = torch.randint(len(tokens) - seq_len, (batch_size,), generator=gen).tolist()
    x = np.stack([tokens[i:i + seq_len + 1].astype(np.int64) for i in ix])
    return torch.from_numpy(x).to(device)


def lr_at(frac, step, args):
    """Linear warm-up over --warmup-steps, then cosine from lr down to lr * min_lr_frac."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * cos)


@torch.no_grad()
def evaluate(model, batches, enc):
    """Mean validation loss (nats/token) and bits per byte over fixed (B, T+1) batches."""
    model.eval()
    losses, n_bytes, n_tok = [], 0, 0
    for xy in batches:
        logits, _ = model(xy[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), xy[:, 1:].flatten()).item())
        for row in xy[:, 1:].tolist():
            n_bytes += len(enc.decode_bytes(row))
            n_tok += len(row)
    model.train()
    loss = float(np.mean(losses))
    return loss, loss / math.log(2) * n_tok / max(n_bytes, 1)


def lookup_hit_rate(prompt, cont):
    """How often prompt lookup (1-token draft) guesses the next token of a continuation. Without
    a match it guesses the last token again, so that the rates stay comparable with the older
    ones recorded in docs/experiments.md."""
    look, hits = NgramDrafter(n=3), 0
    for t in range(len(cont)):
        seq = prompt + cont[:t]
        hits += (look._lookup(seq, 1) or seq[-1:])[0] == cont[t]
    return hits / max(len(cont), 1)


@torch.no_grad()
def quality_report(model, n_prompts=32, n_tokens=128, verbose=True):
    """Does the target write code, or loop? Fraction of repeated 8-grams in its greedy (T=0)
    and sampled (T=1) continuations of held-out prompts, against the real continuations."""
    enc = data.get_encoding()
    samples = data.heldout_samples(n_prompts)
    prompts = [enc.encode_ordinary(p) for p, _ in samples]
    real = [enc.encode_ordinary(c)[:n_tokens] for _, c in samples]
    greedy, _ = speculate.generate(model, prompts, None, max_new_tokens=n_tokens)
    sampled, _ = speculate.generate(model, prompts, None, max_new_tokens=n_tokens,
                                    temperature=1.0, seed=0)
    rep = lambda outs: float(np.mean([data.repeated_ngram_fraction(o, 8) for o in outs]))
    look = lambda outs: float(np.mean([lookup_hit_rate(p, o) for p, o in zip(prompts, outs)]))
    q = dict(repeat8_greedy=rep(greedy), repeat8_sampled=rep(sampled), repeat8_real=rep(real),
             lookup_greedy=look(greedy), lookup_real=look(real))
    if verbose:
        print(f"quality report ({n_prompts} held-out prompts, {n_tokens} tokens):")
        print(f"  repeated 8-grams: greedy {q['repeat8_greedy']:.1%} | "
              f"T=1 {q['repeat8_sampled']:.1%} | real code {q['repeat8_real']:.1%}")
        print(f"  prompt lookup guesses: greedy {q['lookup_greedy']:.1%} | "
              f"real code {q['lookup_real']:.1%}")
        text = (samples[0][0] + enc.decode(greedy[0])).splitlines()[:16]
        print("  sample (greedy):\n" + "\n".join("    | " + line for line in text))
    return q


def check_args(args, names, zero_ok=()):
    """Counts in names must be >= 1 and those in zero_ok >= 0; the budget, the learning rate
    and the gradient clip > 0, the other optimisation settings in their range. Written as
    `not x >= 0` so that NaN is refused too (a nan budget never ran out, a nan rate trained a
    nan model)."""
    flag = lambda name: "--" + name.replace("_", "-")
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    for name in ("threads", "max_steps", "save_minutes", *zero_ok):  # 0: "off" or "torch's"
        if not (getattr(args, name, 0) or 0) >= 0:
            raise ValueError(f"{flag(name)} must be >= 0, got {getattr(args, name)}")
    for name in ("minutes", "lr", "grad_clip"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            raise ValueError(f"{flag(name)} must be > 0, got {value}")
    for name, high in (("min_lr_frac", 1), ("weight_decay", math.inf), ("mtp_lambda", math.inf)):
        value = getattr(args, name, None)
        if value is not None and not 0 <= value <= high:
            span = f"in 0..{high}" if high < math.inf else ">= 0"
            raise ValueError(f"{flag(name)} must be {span}, got {value}")


def eta_s(budget, elapsed, step, max_steps):
    """Seconds left: the run ends at its time budget or at --max-steps, whichever comes first."""
    left = max(budget - elapsed, 0)
    return min(left, (max_steps - step) * elapsed / step) if max_steps else left


def run_path(out_path):
    """Where a run in progress saves: out_path is written only when the run finishes."""
    return os.path.splitext(out_path)[0] + ".run.pt"


def resume_path(resume, out_path):
    """--resume FILE is FILE; --resume alone is this run's .run.pt, or its finished checkpoint
    when there is none (to extend it with a larger --minutes)."""
    if resume:
        return resume
    run = run_path(out_path)
    return out_path if os.path.exists(out_path) and not os.path.exists(run) else run


def main(args):
    check_args(args, ["batch_size", "eval_every", "eval_batches"]
               + ["quality_tokens"] * (args.quality_prompts > 0),
               zero_ok=["mtp_depth", "warmup_steps", "quality_prompts"])
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = get_device(args.device)
    out_path = args.out_path or os.path.join(args.out, args.preset, "target.pt")
    check_writable(out_path)  # a folder or an unwritable path fails here, not after the training
    print(f"device: {device} ({'bf16 autocast' if device.type == 'cuda' else 'fp32'}), "
          f"{torch.get_num_threads()} threads")
    enc = data.get_encoding()

    ck = None
    if args.resume is not None:
        path = resume_path(args.resume, out_path)
        ck = load_checkpoint(path, kind="target")
        # the model's shape is the checkpoint's (as nanoGPT forces its model args on resume)
        for k in ("preset", "mtp_depth"):
            setattr(args, k, ck.get("args", {}).get(k, getattr(args, k)))
        cfg = Config(**ck["config"])
        print(f"resuming {path} at step {ck.get('step', 0)}")
    else:
        cfg = Config(vocab_size=enc.n_vocab, **PRESETS[args.preset])
    seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} is outside the model's context "
                         f"(1..{cfg.max_seq_len})")
    train_tok, val_tok = data.load_tokens("train"), data.load_tokens("val")
    model = Transformer(cfg).to(device)
    mtp_mod = MTP(cfg, args.mtp_depth).to(device) if args.mtp_depth else None
    params = list(model.parameters()) + (list(mtp_mod.parameters()) if mtp_mod else [])
    # weight decay on the matrices only, not on the RMSNorm gains
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": args.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    step, elapsed = 0, 0.0
    if ck is not None:
        model.load_state_dict(ck["state_dict"])
        if mtp_mod is not None and ck.get("mtp_state_dict"):
            mtp_mod.load_state_dict(ck["mtp_state_dict"])
        if "optimizer" in ck:
            opt.load_state_dict(ck["optimizer"])
        else:  # checkpoint.py's export drops it
            print(f"NOTE: {path} holds no optimizer state (an exported checkpoint): AdamW starts "
                  "afresh, so this continues its weights, not its run")
        step, elapsed = ck.get("step", 0), ck.get("elapsed", 0.0)
    mtp_s = f" + {mtp_mod.n_params() / 1e6:.2f}M in {args.mtp_depth} MTP modules" if mtp_mod else ""
    print(f"model: preset {args.preset}, {model.n_params() / 1e6:.2f}M params{mtp_s}, "
          f"seq_len {seq_len}, batch {args.batch_size}, budget {args.minutes:.1f} min")

    # a resumed run draws other batches than the uninterrupted one would have: no replay
    gen = torch.Generator().manual_seed(args.seed + step)
    val_gen = torch.Generator().manual_seed(1234)
    val_batches = [get_batch(val_tok, args.batch_size, seq_len, val_gen, device)
                   for _ in range(args.eval_batches)]
    budget, run_file = args.minutes * 60, run_path(out_path)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    t_start, tokens_seen, val_loss, bpb = time.time() - elapsed, 0, float("nan"), float("nan")
    t_log = t_saved = time.time()

    def save(path):
        save_checkpoint(path, dict(kind="target", config=cfg.__dict__,
                                   state_dict=model.state_dict(),
                                   mtp_state_dict=mtp_mod.state_dict() if mtp_mod else None,
                                   optimizer=opt.state_dict(), tokenizer=data.tokenizer_hash(),
                                   args=vars(args), step=step, elapsed=time.time() - t_start,
                                   val_loss=val_loss, bpb=bpb))
    loss = None  # a resumed run with no step left still ends, saves and reports
    model.train()
    while True:
        elapsed = time.time() - t_start
        frac = max(elapsed / budget, step / args.max_steps if args.max_steps else 0.0)
        if frac >= 1.0:
            break
        lr = lr_at(frac, step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        xy = get_batch(train_tok, args.batch_size, seq_len, gen, device)  # (B, T+1)
        with autocast:
            logits, hidden = model(xy[:, :-1], hidden_layers=(cfg.n_layer,) if mtp_mod else ())
            loss = F.cross_entropy(logits.flatten(0, 1).float(), xy[:, 1:].flatten())
            total = loss
            if mtp_mod is not None:
                mtp_losses = mtp_mod.losses(model, xy, hidden[0])[0]
                total = loss + args.mtp_lambda / args.mtp_depth * sum(mtp_losses)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += xy.shape[0] * seq_len
        if step % args.eval_every == 0 or step == 1:
            val_loss, bpb = evaluate(model, val_batches, enc)
            eta = eta_s(budget, time.time() - t_start, step, args.max_steps)
            mtp_s = f" | mtp {' '.join(f'{l.item():.2f}' for l in mtp_losses)}" if mtp_mod else ""
            print(f"step {step:5d} | train {loss.item():.3f} | val {val_loss:.3f} ({bpb:.3f} bpb)"
                  f"{mtp_s} | lr {lr:.2e} | {tokens_seen / (time.time() - t_log):,.0f} tok/s | "
                  f"ETA {eta / 60:.1f} min", flush=True)
            tokens_seen, t_log = 0, time.time()
        if args.save_minutes and time.time() - t_saved >= args.save_minutes * 60:
            save(run_file)
            t_saved = time.time()
    val_loss, bpb = evaluate(model, val_batches, enc)
    last = "none (no step was left)" if loss is None else f"{loss.item():.3f}"
    print(f"done: {step} steps in {(time.time() - t_start) / 60:.1f} min | final train {last} | "
          f"val {val_loss:.3f} nats/token, {bpb:.3f} bits/byte")
    save(out_path)  # with the optimizer: --resume can extend a finished run too
    if os.path.exists(run_file):
        os.remove(run_file)  # finished: nothing left to resume
    print(f"saved {out_path}")
    if args.quality_prompts:  # after the save: a Ctrl-C here loses only the report
        model.eval()
        q = quality_report(model, args.quality_prompts, args.quality_tokens)
        ck = load_checkpoint(out_path)
        ck["quality"] = q
        save_checkpoint(out_path, ck)
    return model


def get_parser():
    p = argparse.ArgumentParser(description="Train the target model (optionally with native "
                                "MTP heads).", formatter_class=DefaultsHelp)
    g = p.add_argument_group("model and output")
    g.add_argument("--preset", default="cpu", choices=list(PRESETS), help="model.py's PRESETS")
    g.add_argument("--out", default="out", help="the checkpoint goes to OUT/<preset>/target.pt")
    g.add_argument("--out-path", default=None, help="or here (e.g. out/cpu/draft.pt)")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="FILE",
                   help="continue a run: alone, from its .run.pt (or its finished checkpoint, "
                   "to extend with a larger --minutes); with FILE, from FILE. Weights, "
                   "optimizer, step and clock continue; the model's shape is the file's")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batches")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    g = p.add_argument_group("budget and optimisation")
    g.add_argument("--minutes", type=float, default=None, help="wall-clock budget (default: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MINUTES.items()) + ")")
    g.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many steps (0: by the clock only)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    g.add_argument("--seq-len", type=int, default=None, help="default: the preset's context")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr-frac", type=float, default=0.1, help="final lr / peak lr")
    g.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up to the peak lr")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices only")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    g = p.add_argument_group("multi-token prediction (mtp.py)")
    g.add_argument("--mtp-depth", type=int, default=0, help="native MTP modules (D) to train")
    g.add_argument("--mtp-lambda", type=float, default=0.3, help="MTP loss weight (over D)")
    g = p.add_argument_group("logging, evaluation and saving")
    g.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    g.add_argument("--eval-batches", type=int, default=4, help="fixed validation batches")
    g.add_argument("--save-minutes", type=float, default=2.0, help="minutes between saves of "
                   "the run in progress to <checkpoint>.run.pt (0: only the finished one)")
    g.add_argument("--quality-prompts", type=int, default=32,
                   help="held-out prompts for the quality report (0: none)")
    g.add_argument("--quality-tokens", type=int, default=128, help="tokens per continuation")
    return p


if __name__ == "__main__":
    args = get_parser().parse_args()
    if args.minutes is None:
        args.minutes = DEFAULT_MINUTES.get(args.preset, 8.0)
    try:
        main(args)
    except (ValueError, FileNotFoundError) as e:  # bad input (flag, device, checkpoint): one line
        raise SystemExit(f"error: {e}")
