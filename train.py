"""
Train the target (or the small `draft` model) on the Python-source corpus of data.py.

AdamW, linear warm-up then cosine decay to a tenth of the peak lr, gradient clipping at norm 1.0,
bf16 autocast on CUDA, fp32 on CPU. The budget is wall-clock minutes (or --max-steps) and the
schedule follows the fraction used, so a run of any length ends fully decayed. --mtp-depth D also
trains D native multi-token prediction modules (mtp.py), loss weight lambda / D. A run saves to
a .run.pt beside its checkpoint (out/cpu/target.run.pt) every --save-minutes and on Ctrl-C; the
same command plus --resume continues it, --resume FILE continues FILE's model (preset, depth).

    python train.py --preset cpu                # ~8 minutes on 2 cores -> out/cpu/target.pt
    python train.py --preset cpu-draft --out-path out/cpu/draft.pt   # the `draft` method's model
    python train.py --preset ref --corpus all --batch-size 256 --lr 3e-3   # a GPU's (h200_train.sh)
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
from checkpoint import finite, get_device, load_checkpoint, save_checkpoint
from data import DefaultsHelp, check_writable, one_line_errors
from model import PRESETS, Config, Transformer
from mtp import MTP

DEFAULT_MINUTES = {"tiny": 1.0, "cpu": 8.0, "ref": 4.2, "cpu-draft": 3.0}
WEIGHT_DECAY, MTP_LAMBDA = 0.1, 0.3  # AdamW's on matrices only; native MTP's loss weight (/ D)


def get_batch(tokens, batch_size, seq_len, gen, device):
    """Random windows of seq_len+1 tokens from a token memmap -> (B, T+1) int64."""
    ix = torch.randint(len(tokens) - seq_len, (batch_size,), generator=gen).tolist()
    x = torch.from_numpy(np.stack([tokens[i:i + seq_len + 1].astype(np.int64) for i in ix]))
    # pinned, the copy to a GPU need not wait for the steps queued before it (a pageable one does)
    return (x.pin_memory() if torch.cuda.is_available() else x).to(device, non_blocking=True)


def lr_at(frac, step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return args.lr * (0.1 + 0.9 * cos)


@torch.no_grad()
def evaluate(model, batches, enc):
    """Mean validation loss (nats/token) and bits per byte over fixed (B, T+1) batches."""
    model.eval()
    loss = float(np.mean([F.cross_entropy(model(xy[:, :-1])[0].flatten(0, 1).float(),
                                          xy[:, 1:].flatten()).item() for xy in batches]))
    model.train()
    n_tok = sum(xy[:, 1:].numel() for xy in batches)
    n_bytes = sum(len(enc.decode_bytes(row)) for xy in batches for row in xy[:, 1:].tolist())
    return loss, loss / math.log(2) * n_tok / max(n_bytes, 1)


def check_args(args, names, zero_ok=(), positive=()):
    """names >= 1, zero_ok >= 0, positive > 0 and finite, the flags both scripts share, and
    --threads at most the cores (more only slows a run; far more crashed torch); NaN refused."""
    names, positive = ("batch_size", "eval_every", *names), ("minutes", "lr", *positive)
    zero_ok, cores = ("threads", "max_steps", "save_minutes", *zero_ok), os.cpu_count() or 1
    for name, rule, ok in ([(n, ">= 1", lambda v: v >= 1) for n in names]
                           + [(n, ">= 0", lambda v: v >= 0) for n in zero_ok]
                           + [(n, "> 0 and finite", lambda v: 0 < v < math.inf) for n in positive]
                           + [("threads", f"<= the {cores} cores", lambda v: v <= cores)]):
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value}")


# --- the loop and its resume, shared with train_drafter.py ----------------------------------------

def load_run(resume, out_path, kind):
    """--resume FILE: FILE; --resume alone: this run's .run.pt, or its finished checkpoint when
    there is none (to extend it with a larger --minutes) -> (checkpoint, its path)."""
    run = os.path.splitext(out_path)[0] + ".run.pt"  # out_path is written when the run ends
    path = resume or (out_path if os.path.exists(out_path) and not os.path.exists(run) else run)
    return load_checkpoint(path, kind=kind), path


def train_loop(args, model, opt, params, lr_fn, train_step, report, fields, out_path, ck, ck_path):
    """Continue checkpoint ck (from ck_path) if any; until --minutes or --max-steps runs out, set
    the lr to lr_fn(fraction done, step) and step on train_step(step) -> (loss, its log text as a
    callable: only printed steps sync), clipped at norm 1.0 (both recipes'). Print report() every
    --eval-every steps. Save fields() and what a resume restores (weights, optimizer, step, clock)
    to out_path's .run.pt every --save-minutes and on Ctrl-C, and at the end to out_path."""
    step, elapsed = (ck.get("step", 0), ck.get("elapsed", 0.0)) if ck else (0, 0.0)
    if ck:
        model.load_state_dict(ck["state_dict"])
        if "optimizer" in ck:
            opt.load_state_dict(ck["optimizer"])
        else:  # dev/export_weights.py drops it
            print(f"NOTE: {ck_path} holds no optimizer state (an exported checkpoint): AdamW "
                  "starts afresh, so this continues its weights, not its run")
        print(f"resuming {ck_path} at step {step}")
        torch.manual_seed(args.seed + step)  # train_drafter's global draws (DFlash's anchors)
    budget, run_file = args.minutes * 60, os.path.splitext(out_path)[0] + ".run.pt"
    t_start, t_saved = time.time() - elapsed, time.time()
    text = lambda: "no step left: raise --minutes or --max-steps to go on"  # a finished run

    def save(path):  # never a diverged model (an --lr too high): the last save stays as it was
        finite(model, f"step {step} (--lr too high?), {path} not written", params)
        save_checkpoint(path, dict(fields(), args=vars(args), tokenizer=data.tokenizer_hash(),
                                   state_dict=model.state_dict(), optimizer=opt.state_dict(),
                                   step=step, elapsed=time.time() - t_start))
    try:
        while (frac := max((time.time() - t_start) / budget,
                           step / args.max_steps if args.max_steps else 0.0)) < 1.0:
            lr = lr_fn(frac, step)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, text = train_step(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % args.eval_every == 0 or step == 1:
                used = time.time() - t_start  # the run ends at its budget or at --max-steps, first
                by_steps = (args.max_steps - step) * used / step if args.max_steps else math.inf
                eta = max(min(budget - used, by_steps), 0)  # 0: the last step ran past the budget
                print(f"step {step:5d} | {text()} | {report()} | lr {lr:.2e} | "
                      f"ETA {eta / 60:.1f} min", flush=True)
            if args.save_minutes and time.time() - t_saved >= args.save_minutes * 60:
                save(run_file)
                t_saved = time.time()
        print(f"done: {step} steps in {(time.time() - t_start) / 60:.1f} min | {text()} | "
              f"{report()}")
        save(out_path)  # with the optimizer: --resume can extend it
    except KeyboardInterrupt:  # Ctrl-C keeps the steps so far (cut inside opt.step(), one
        save(run_file)         # update more than the step count says: harmless)
        raise KeyboardInterrupt(f"step {step} saved; go on with --resume {run_file}") from None
    if os.path.exists(run_file):
        os.remove(run_file)
    print(f"saved {out_path}")


def main(args):
    check_args(args, ["eval_batches"], zero_ok=["mtp_depth", "warmup_steps"])
    out = lambda: args.out_path or os.path.join("out", args.preset, "target.pt")
    ck = path = None
    if args.resume is not None:  # the model is the file's, as in nanoGPT; so is out/<preset>/
        ck, path = load_run(args.resume, out(), "target")
        for k in ("preset", "mtp_depth"):  # a flag given against the file's is refused
            saved = ck.get("args", {}).get(k, getattr(args, k))
            if getattr(args, k) not in (saved, get_parser().get_default(k)):
                raise ValueError(f"--{k.replace('_', '-')} {getattr(args, k)}: {path} is "
                                 f"{saved} (a resumed run keeps its model)")
            setattr(args, k, saved)
    out_path = out()
    check_writable(out_path)  # a folder or an unwritable path fails here, not after the training
    args.minutes = DEFAULT_MINUTES.get(args.preset, 8.0) if args.minutes is None else args.minutes
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads or torch.get_num_threads())  # 0: torch's choice
    device, enc = get_device(args.device), data.get_encoding()
    print(f"device: {device} ({'bf16 autocast' if device.type == 'cuda' else 'fp32'}), "
          f"{torch.get_num_threads()} threads")
    cfg = Config(**ck["config"]) if ck else Config(vocab_size=enc.n_vocab, **PRESETS[args.preset])
    seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(f"--seq-len must be in 1..{cfg.max_seq_len} (the context), got {seq_len}")
    train_tok, val_tok = (data.load_tokens(s, corpus=args.corpus) for s in ("train", "val"))
    model = Transformer(cfg).to(device)
    mtp_mod = MTP(cfg, args.mtp_depth).to(device) if args.mtp_depth else None
    params = list(model.parameters()) + (list(mtp_mod.parameters()) if mtp_mod else [])
    matrices = [p for p in params if p.dim() >= 2]  # weight decay on these, not the RMSNorm gains
    opt = torch.optim.AdamW([dict(params=matrices, weight_decay=WEIGHT_DECAY),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)],
                            lr=args.lr, betas=(0.9, 0.95))
    if mtp_mod is not None and ck and ck.get("mtp_state_dict"):
        mtp_mod.load_state_dict(ck["mtp_state_dict"])
    n_mtp = sum(p.numel() for p in mtp_mod.parameters()) if mtp_mod else 0
    mtp_s = f" + {n_mtp / 1e6:.2f}M in {args.mtp_depth} MTP modules" if mtp_mod else ""
    print(f"model: preset {args.preset}, {model.n_params() / 1e6:.2f}M params{mtp_s}, "
          f"seq_len {seq_len}, batch {args.batch_size}, budget {args.minutes:.1f} min")

    # a resumed run draws other batches than the uninterrupted one would have: no replay
    gen = torch.Generator().manual_seed(args.seed + (ck.get("step", 0) if ck else 0))
    val_gen = torch.Generator().manual_seed(1234)
    val_batches = [get_batch(val_tok, args.batch_size, seq_len, val_gen, device)
                   for _ in range(args.eval_batches)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    scores = dict(val_loss=float("nan"), bpb=float("nan"))  # the last report's, for the checkpoint

    def train_step(step):
        xy = get_batch(train_tok, args.batch_size, seq_len, gen, device)  # (B, T+1)
        with autocast:
            logits, hidden = model(xy[:, :-1], hidden_layers=(cfg.n_layer,) if mtp_mod else ())
            loss = F.cross_entropy(logits.flatten(0, 1).float(), xy[:, 1:].flatten())
            mtps = mtp_mod.losses(model, xy, hidden[0])[0] if mtp_mod else []
        total = loss + MTP_LAMBDA / args.mtp_depth * sum(mtps) if mtps else loss
        mtp_s = lambda: " | mtp " + " ".join(f"{l.item():.2f}" for l in mtps) if mtps else ""
        return total, lambda: f"train {loss.item():.3f}{mtp_s()}"

    def report():
        scores["val_loss"], scores["bpb"] = evaluate(model, val_batches, enc)
        return "val {val_loss:.3f} ({bpb:.3f} bpb)".format(**scores)

    fields = lambda: dict(kind="target", config=cfg.__dict__, **scores,
                          mtp_state_dict=mtp_mod.state_dict() if mtp_mod else None)
    train_loop(args, model, opt, params, lambda frac, step: lr_at(frac, step, args), train_step,
               report, fields, out_path, ck, path)


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelp)
    g = p.add_argument_group("model and output")
    g.add_argument("--preset", default="cpu", choices=list(PRESETS), help="model.py's PRESETS")
    g.add_argument("--out-path", default=None, help="the checkpoint (default: "
                   "out/<preset>/target.pt; e.g. out/cpu/draft.pt for the draft model)")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="FILE",
                   help="continue this command's run from its .run.pt (or finished "
                   "checkpoint), or FILE (whose preset then names out/<preset>/)")
    g.add_argument("--mtp-depth", type=int, default=0, help="native MTP modules (D, mtp.py)")
    g.add_argument("--corpus", default="small", choices=data.CORPORA, help="data.py's corpus")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batches")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's choice)")
    g = p.add_argument_group("budget and optimisation")
    g.add_argument("--minutes", type=float, default=None, help="wall-clock budget (default: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MINUTES.items()) + ")")
    g.add_argument("--max-steps", type=int, default=0, help="step limit (0: the clock only)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    g.add_argument("--seq-len", type=int, default=None, help="default: the preset's context")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=int, default=50, help="linear warm-up to the peak lr")
    g = p.add_argument_group("logging, evaluation and saving")
    g.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    g.add_argument("--eval-batches", type=int, default=4, help="fixed validation batches")
    g.add_argument("--save-minutes", type=float, default=2.0,
                   help="minutes between saves to its .run.pt (0: only at the end and on Ctrl-C)")
    return p


if __name__ == "__main__":
    with one_line_errors():
        main(get_parser().parse_args())
