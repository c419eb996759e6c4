"""
How good a target is, the figures issue 52 compares targets by: held-out loss and bits per byte
on each held-out set, and how much its own text loops (the share of repeated 8-grams in its
continuations of the committed prompts, greedy and sampled; real code repeats ~2 %).

    python dev/target_quality.py weights/cpu/target.pt out/interim/target.pt
    python dev/target_quality.py weights/cpu/target.pt --batches 8 --new-tokens 64   # quicker

Held-out sets: "val" (the small corpus's held-out files, the split the committed weights were
scored on), "val-all" (the broad corpus's) and "ood" (data.OOD_PACKAGES, which no corpus
trains on); the same windows for every target (fixed seed). Prompts: the first --n-prompts of
weights/heldout_prompts.jsonl and of weights/ood_prompts.jsonl.
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
from checkpoint import load_target  # noqa: E402
from speculate import generate  # noqa: E402
from train import evaluate, get_batch  # noqa: E402


def held_out_tokens():
    """{name: 1-D uint16 token array} of the three held-out sets."""
    enc = data.get_encoding()
    ood = [t for _, t in data.read_texts(data.corpus_files("all")["ood"])]
    ood_ids = [i for ids in enc.encode_ordinary_batch(ood) for i in ids + [enc.eot_token]]
    return {"val": data.load_tokens("val"), "val-all": data.load_tokens("val", corpus="all"),
            "ood": np.array(ood_ids, dtype=np.uint16)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=data.DefaultsHelp)
    p.add_argument("targets", nargs="+",
                   help="target checkpoints (or Hugging Face folders of ours: dev/hf_export.py)")
    p.add_argument("--batches", type=int, default=32, help="held-out batches of 8 x 384 a set")
    p.add_argument("--n-prompts", type=int, default=10, help="prompts of each committed file")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per continuation")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's choice)")
    args = p.parse_args(argv)
    for flag, value, low in (("--batches", args.batches, 1), ("--n-prompts", args.n_prompts, 1),
                             ("--new-tokens", args.new_tokens, 1), ("--threads", args.threads, 0)):
        if value < low:  # a traceback, or a nan loss, before
            raise SystemExit(f"error: {flag} must be >= {low}, got {value}")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    try:  # every target loads before the minutes of work; a bad one ends in one line
        targets = [(path, load_target(path)) for path in args.targets]  # a path twice: twice
        enc = data.get_encoding()
        prompt_sets = {name: [enc.encode_ordinary(t) for t in texts] for name, texts in (
            ("held-out", data.reference_prompts(args.n_prompts)),
            ("ood", data.read_prompts_file(data.OOD_PROMPTS_PATH)[:args.n_prompts]))}
        longest = max(len(ids) for ids in sum(prompt_sets.values(), []))
        for path, target in targets:  # refused before the minutes of scoring, not after
            if target.cfg.vocab_size != enc.n_vocab:
                raise ValueError(f"{path}: a vocabulary of {target.cfg.vocab_size}, not "
                                 f"tokenizer.tiktoken's {enc.n_vocab}, which every set here uses")
            if longest + args.new_tokens >= target.cfg.max_seq_len:  # generate keeps one free
                raise ValueError(f"--new-tokens {args.new_tokens} after a prompt of {longest} "
                                 f"tokens passes {path}'s context of {target.cfg.max_seq_len}")
        report(targets, prompt_sets, args)
    except (ValueError, FileNotFoundError) as e:  # generate's too: --new-tokens past the context
        raise SystemExit(f"error: {e}")


def report(targets, prompt_sets, args):
    enc, sets = data.get_encoding(), held_out_tokens()
    for path, target in targets:
        T = target.cfg.max_seq_len
        print(f"== {path}: {target.n_params() / 1e6:.2f}M params")
        for name, tokens in sets.items():
            g = torch.Generator().manual_seed(1234)  # the same windows for every target
            batches = [get_batch(tokens, 8, T, g, "cpu") for _ in range(args.batches)]
            loss, bpb = evaluate(target, batches, enc)
            print(f"  {name:8s} loss {loss:.3f} nats/token, {bpb:.3f} bits/byte "
                  f"({len(tokens) / 1e6:.1f}M tokens)")
        for name, ids in prompt_sets.items():  # token ids
            for temp in (0.0, 1.0):
                outs, _ = generate(target, ids, max_new_tokens=args.new_tokens,
                                   temperature=temp, seed=0)
                rep = np.mean([data.repeated_ngram_fraction(o, 8) for o in outs])
                print(f"  {name:8s} prompts, T = {temp:g}: {rep:.1%} of 8-grams repeated")


if __name__ == "__main__":
    main()
