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

Until it finishes, a run saves every --save-minutes minutes (2) and every --save-every steps
(500) to the checkpoint's path with .run.pt (out/cpu/target.run.pt), never to the checkpoint
itself, so a killed run cannot pass for a finished target; --resume out/cpu/target.run.pt
continues it. The finished checkpoint keeps its optimizer, so --resume can also extend it with
a larger --minutes (or a larger --max-steps, for a run that --max-steps ended).

About 355 lines against DESIGN's ~250: the quality report (~40 lines) and resuming a killed
run (~40, whose flag check and run-file claim train_drafter.py shares) live here too.

    python train.py --preset cpu                # ~8 minutes on 2 cores -> out/cpu/target.pt
    python train.py --preset cpu-draft --out-path out/cpu/draft.pt   # the `draft` method's model
    python train.py --preset tiny --minutes 1   # smoke test
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

import data
from checkpoint import get_device, load_checkpoint, save_checkpoint
from data import DefaultsHelp, check_writable
from model import PRESETS, Config, Transformer

DEFAULT_MINUTES = {"tiny": 1.0, "cpu": 8.0, "cpu-draft": 3.0, "gpu": 5.0, "gpu-draft": 2.0}
# a run in progress saves at least this often, in both trainers (on a 2-core CPU, a save of the
# cpu target's run file, 82 MB, took ~0.15 s; of the gpu target's, 1.1 GB, 2-5 s)
SAVE_MINUTES = 2.0


def get_batch(tokens, batch_size, seq_len, gen, device):
    """Random windows of seq_len+1 tokens from a token memmap -> (B, T+1) int64."""
    ix = torch.randint(len(tokens) - seq_len, (batch_size,), generator=gen).tolist()  # starts 0..len-T-1
    x = np.stack([tokens[i:i + seq_len + 1].astype(np.int64) for i in ix])
    return torch.from_numpy(x).to(device)


def lr_at(frac, step, args):
    """Linear warm-up over --warmup-steps, then cosine from lr down to lr * min_lr_frac."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


@torch.no_grad()
def evaluate(model, batches, enc):
    """Mean validation loss (nats/token) and bits per byte over fixed batches."""
    model.eval()
    losses, n_bytes, n_tok = [], 0, 0
    for xy in batches:
        logits, _ = model(xy[:, :-1])
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), xy[:, 1:].flatten()).item())
        for row in xy[:, 1:].tolist():
            n_bytes += len(enc.decode_bytes(row))
            n_tok += len(row)
    model.train()
    loss = float(np.mean(losses))
    return loss, loss / math.log(2) * n_tok / max(n_bytes, 1)


def lookup_hit_rate(prompt, cont):
    """How often prompt lookup (1-token draft) guesses the next token of a continuation. Without
    a match it guesses the last token again, as `ngram` drafted until it learned to draft
    nothing there (commit 279b253), so the rates stay comparable with the older ones recorded."""
    from draft_simple import NgramDrafter
    look, hits = NgramDrafter(n=3), 0
    for t in range(len(cont)):
        seq = prompt + cont[:t]
        hits += (look._lookup(seq, 1) or seq[-1:])[0] == cont[t]
    return hits / max(len(cont), 1)


@torch.no_grad()
def quality_report(model, n_prompts=32, n_tokens=128, verbose=True):
    """Does the target write code, or loop? Fraction of repeated 8-grams in its greedy (T=0)
    and sampled (T=1) continuations of held-out prompts, against the real continuations."""
    from speculate import generate
    enc = data.get_encoding()
    samples = data.heldout_samples(n_prompts)
    prompts = [enc.encode_ordinary(p) for p, _ in samples]
    real = [enc.encode_ordinary(c)[:n_tokens] for _, c in samples]
    greedy, _ = generate(model, prompts, None, max_new_tokens=n_tokens)
    sampled, _ = generate(model, prompts, None, max_new_tokens=n_tokens, temperature=1.0, seed=0)
    rep = lambda outs: float(np.mean([data.repeated_ngram_fraction(o, 8) for o in outs]))
    look = lambda outs: float(np.mean([lookup_hit_rate(p, o) for p, o in zip(prompts, outs)]))
    q = dict(repeat8_greedy=rep(greedy), repeat8_sampled=rep(sampled), repeat8_real=rep(real),
             lookup_greedy=look(greedy), lookup_real=look(real))
    if verbose:
        print(f"quality report ({n_prompts} held-out prompts, {n_tokens} tokens):")
        print(f"  repeated 8-grams: greedy {q['repeat8_greedy']:.1%} | T=1 {q['repeat8_sampled']:.1%} | "
              f"real code {q['repeat8_real']:.1%}")
        print(f"  prompt lookup guesses: greedy {q['lookup_greedy']:.1%} | real code {q['lookup_real']:.1%}")
        print("  sample (greedy):\n" + "\n".join("    | " + l for l in (samples[0][0] + enc.decode(greedy[0])).splitlines()[:16]))
    return q


def check_args(args, names, zero_ok=()):
    """Counts in names must be >= 1 and those in zero_ok >= 0; the budget, the learning rate
    and the gradient clip > 0, the other optimisation settings in their range. A bad one ends
    in one line before any work."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("threads", "max_steps", "save_every", "save_minutes", *zero_ok):  # 0: "off" or "torch's choice"
        if not (getattr(args, name, 0) or 0) >= 0:  # a negative one was taken as 0 or as every step; nan never saved
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("minutes", "lr", "grad_clip"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:  # NaN too: a nan budget never ran out
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    for name, high in (("min_lr_frac", 1), ("weight_decay", math.inf), ("mtp_lambda", math.inf)):
        value = getattr(args, name, None)
        if value is not None and not 0 <= value <= high:  # a nan one trained a nan model
            raise ValueError(f"--{name.replace('_', '-')} must be " + (f"in 0..{high}" if high < math.inf else ">= 0")
                             + f", got {value}")


def eta_s(budget, elapsed, step, max_steps):
    """Seconds left: the run ends at its time budget or at --max-steps, whichever comes first."""
    left = max(budget - elapsed, 0)
    return min(left, (max_steps - step) * elapsed / step) if max_steps else left


def save_due(args, step, since_save):
    """Whether a run in progress saves now, since_save seconds after its last save (or its start):
    every --save-every steps, and once --save-minutes have passed, since on a CPU 500 steps can
    take half an hour: a killed run loses at most that much."""
    by_steps = args.save_every and step % args.save_every == 0
    return bool(by_steps or (args.save_minutes and since_save >= args.save_minutes * 60))


# the flags that shape a run: resuming under others would not continue the same run
RUN_FLAGS = ("preset", "seed", "batch_size", "seq_len", "lr", "min_lr_frac", "warmup_steps", "weight_decay",
             "grad_clip", "mtp_depth", "mtp_lambda")


def run_path(out_path):
    """Where a run in progress saves. out_path is written only when the run finishes, so a killed
    run never leaves a half-trained model (target, draft model or drafter) where bench.py would
    take it for a finished one."""
    return os.path.splitext(out_path)[0] + ".run.pt"


def out_path_of(args):
    """The finished checkpoint's path: --out-path, else <out>/<preset>/target.pt."""
    return args.out_path or os.path.join(args.out, args.preset, "target.pt")


class ReportInterrupted(KeyboardInterrupt):
    """Ctrl-C in the quality report, after the finished target was saved."""


def interrupted(run_file):
    """Ctrl-C: one line on how the run can continue instead of a traceback; exit 130. Whether
    the run file there is this run's is not known here (an older run's may sit there until
    this one's first save; --resume refuses it under other flags), so the line says what the
    run saves, not what it did; with no file there, --resume would find nothing."""
    if os.path.exists(run_file):
        print(f"\ninterrupted; this run saves to {run_file} (see --save-minutes), and --resume "
              f"{run_file} continues from the last save there", file=sys.stderr)
    else:
        print(f"\ninterrupted before this run's first save to {run_file} (see --save-minutes), so there is "
              f"nothing to --resume: the same command starts it again", file=sys.stderr)
    sys.exit(130)


def check_run_flags(path, saved_args, args, flags):
    """Refuse to resume the run saved in path under other values of the flags that shape it."""
    diff = [f"--{k.replace('_', '-')} {saved_args.get(k)} (given {getattr(args, k)})"
            for k in flags if saved_args.get(k) != getattr(args, k)]
    if diff:
        raise ValueError(f"{path} is another run; resume it with its own flags, or delete it to start over: "
                         + ", ".join(diff))


def claim_run_file(run_file, args):
    """Whether run_file is this run's, to write and to remove when done: it is if the run saves
    one or resumed from it. A fresh run about to replace an unfinished one says so."""
    resumed_here = args.resume is not None and os.path.abspath(args.resume) == os.path.abspath(run_file)
    owns_run = args.save_every > 0 or args.save_minutes > 0 or resumed_here
    if not args.resume and owns_run and os.path.exists(run_file):
        print(f"NOTE: {run_file} holds an unfinished run, which this new run replaces (--resume {run_file} "
              f"would continue it instead; --save-every 0 --save-minutes 0 leaves it alone)")
    return owns_run


def main(args):
    check_args(args, ["batch_size", "eval_every", "eval_batches"] + ["quality_tokens"] * (args.quality_prompts > 0),
               zero_ok=["mtp_depth", "warmup_steps", "quality_prompts"])
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = get_device(args.device)
    out_path = out_path_of(args)
    check_writable(out_path)  # a folder or an unwritable path fails here, not after the training
    print(f"device: {device} ({'bf16 autocast' if device.type == 'cuda' else 'fp32'}), {torch.get_num_threads()} threads")
    enc = data.get_encoding()
    train_tok, val_tok = data.load_tokens("train"), data.load_tokens("val")
    run_file = run_path(out_path)
    owns_run = claim_run_file(run_file, args)

    if args.resume:
        ck = load_checkpoint(args.resume, kind="target")
        if ck.get("args"):  # every checkpoint train.py writes has them; a hand-made one cannot be checked
            check_run_flags(args.resume, ck["args"], args, RUN_FLAGS)
        cfg = Config(**ck["config"])
        print(f"resuming from {args.resume} at step {ck['step']}")
    else:
        cfg = Config(vocab_size=enc.n_vocab, **PRESETS[args.preset])
    seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len  # 0 is refused, not the default
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} is outside the model's context (1..{cfg.max_seq_len})")
    model = Transformer(cfg).to(device)
    mtp_mod = None
    if args.mtp_depth:
        from mtp import MTP
        mtp_mod = MTP(cfg, args.mtp_depth).to(device)
    params = list(model.parameters()) + (list(mtp_mod.parameters()) if mtp_mod else [])
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    step, elapsed = 0, 0.0
    if args.resume:
        model.load_state_dict(ck["state_dict"])
        if mtp_mod is not None and ck.get("mtp_state_dict"):
            mtp_mod.load_state_dict(ck["mtp_state_dict"])
        if "optimizer" in ck:
            opt.load_state_dict(ck["optimizer"])
        else:  # model.py --export drops it (and the batch stream's state)
            print(f"NOTE: {args.resume} holds no optimizer state (an exported checkpoint): AdamW and the batch "
                  "stream start afresh, so this continues its weights, not its run")
        step, elapsed = ck["step"], ck["elapsed"]
    print(f"model: preset {args.preset}, {model.n_params() / 1e6:.2f}M params"
          + (f" + {mtp_mod.n_params() / 1e6:.2f}M in {args.mtp_depth} MTP modules" if mtp_mod else "")
          + f", seq_len {seq_len}, batch {args.batch_size}, budget {args.minutes:.1f} min")

    gen = torch.Generator().manual_seed(args.seed + step)  # the training batches
    if args.resume and "batch_rng" in ck:  # the batches the uninterrupted run would have drawn next
        gen.set_state(ck["batch_rng"])
    val_gen = torch.Generator().manual_seed(1234)
    val_batches = [get_batch(val_tok, args.batch_size, seq_len, val_gen, device) for _ in range(args.eval_batches)]
    budget = args.minutes * 60
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    t_start, tokens_seen, val_loss, bpb = time.time() - elapsed, 0, float("nan"), float("nan")
    t_log = t_saved = time.time()

    def save(path):
        save_checkpoint(path, dict(kind="target", config=cfg.__dict__, state_dict=model.state_dict(),
                                   mtp_state_dict=mtp_mod.state_dict() if mtp_mod else None,
                                   optimizer=opt.state_dict(), batch_rng=gen.get_state(),
                                   tokenizer=data.tokenizer_hash(), args=vars(args), step=step,
                                   elapsed=time.time() - t_start, val_loss=val_loss, bpb=bpb))
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
        xy = get_batch(train_tok, args.batch_size, seq_len, gen, device)
        with amp:
            logits, hidden = model(xy[:, :-1], hidden_layers=(cfg.n_layer,) if mtp_mod else ())
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), xy[:, 1:].flatten())
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
            print(f"step {step:5d} | train {loss.item():.3f} | val {val_loss:.3f} ({bpb:.3f} bpb){mtp_s} | "
                  f"lr {lr:.2e} | {tokens_seen / (time.time() - t_log):,.0f} tok/s | ETA {eta / 60:.1f} min", flush=True)
            tokens_seen, t_log = 0, time.time()
        if save_due(args, step, time.time() - t_saved):
            save(run_file)
            t_saved = time.time()
    val_loss, bpb = evaluate(model, val_batches, enc)
    last = "none (no step was left)" if loss is None else f"{loss.item():.3f}"  # a resumed run that had ended
    print(f"done: {step} steps in {(time.time() - t_start) / 60:.1f} min | final train {last} | "
          f"val {val_loss:.3f} nats/token, {bpb:.3f} bits/byte")
    save(out_path)  # with the optimizer: --resume can extend a finished run too
    if owns_run and os.path.exists(run_file):
        os.remove(run_file)  # finished: nothing left to resume
    print(f"saved {out_path}")
    if args.quality_prompts:
        model.eval()
        try:
            q = quality_report(model, args.quality_prompts, args.quality_tokens)
        except KeyboardInterrupt:  # after the save: "nothing to --resume" would send the user back to the start
            raise ReportInterrupted(f"{out_path} is saved; only its quality report was cut short") from None
        ck = load_checkpoint(out_path)
        ck["quality"] = q
        save_checkpoint(out_path, ck)
    return model


def get_parser():
    p = argparse.ArgumentParser(description="Train the target model (optionally with native MTP heads).",
                                formatter_class=DefaultsHelp)
    g = p.add_argument_group("model and output")
    g.add_argument("--preset", default="cpu", choices=list(PRESETS), help="model size (model.py PRESETS)")
    g.add_argument("--out", default="out", help="output root; the checkpoint goes to OUT/<preset>/target.pt")
    g.add_argument("--out-path", default=None, help="explicit checkpoint path (e.g. out/cpu/draft.pt)")
    g.add_argument("--resume", default=None, help="checkpoint to continue, with the flags it was started with: a "
                   "killed run's OUT/<preset>/target.run.pt (see --save-minutes), or a finished one to extend with a "
                   "larger --minutes (a larger --max-steps extends only a run that --max-steps ended; the schedule "
                   "then stretches from where the run is, which is not the run the larger budget would have made); "
                   "it continues the clock, schedule and batch stream, so with --max-steps (and a --minutes it never "
                   "reaches) on a CPU a killed run ends bit for bit as it would have")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order (default: %(default)s)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default; 1 is faster on a busy machine)")
    g = p.add_argument_group("budget and optimisation")
    g.add_argument("--minutes", type=float, default=None, help="wall-clock budget (default: per preset, "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MINUTES.items()) + ")")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = time budget only)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's context)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr-frac", type=float, default=0.1, help="final lr as a fraction of the peak")
    g.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up to the peak lr (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices (default: %(default)s)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient's global norm to this (default: %(default)s)")
    g = p.add_argument_group("multi-token prediction (mtp.py)")
    g.add_argument("--mtp-depth", type=int, default=0, help="train D native MTP modules with the target")
    g.add_argument("--mtp-lambda", type=float, default=0.3, help="MTP loss weight (divided by D)")
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--eval-every", type=int, default=50, help="steps between validation evaluations")
    g.add_argument("--eval-batches", type=int, default=4, help="fixed validation batches per evaluation")
    g.add_argument("--save-every", type=int, default=500, help="steps between saves of the run in "
                   "progress to the checkpoint's path with .run.pt, e.g. OUT/<preset>/target.run.pt (0 = by "
                   "--save-minutes only)")
    g.add_argument("--save-minutes", type=float, default=SAVE_MINUTES, help="also save the run in progress once "
                   "this many minutes have passed since its last save, so that a kill loses at most that plus one "
                   "step (0 = by --save-every only; both 0 = no run file: the finished checkpoint is written at the end)")
    g.add_argument("--quality-prompts", type=int, default=32, help="held-out prompts for the quality report (0 = skip)")
    g.add_argument("--quality-tokens", type=int, default=128, help="tokens per continuation in the quality report")
    return p


if __name__ == "__main__":
    args = get_parser().parse_args()
    if args.minutes is None:
        args.minutes = DEFAULT_MINUTES.get(args.preset, 8.0)
    try:
        main(args)
    except (ValueError, FileNotFoundError) as e:  # bad input (device, checkpoint): one line, no traceback
        raise SystemExit(f"error: {e}")
    except ReportInterrupted as e:
        print(f"\ninterrupted: {e}", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        interrupted(run_path(out_path_of(args)))
