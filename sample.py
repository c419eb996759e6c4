"""
Continue one prompt with one method and print the text, tau and the acceptance per position.
With --check (greedy), also decode with model.generate, the cache-free reference, and compare.

    python sample.py --method dflash --prompt "def parse(" --check     # the committed weights
    python sample.py --method eagle --temperature 1 --seed 3
"""

import argparse
import os
import time

import data
from checkpoint import (METHODS, add_drafter_flags, drafter_options, get_device, load_drafter,
                        load_target, load_tokenizer)
from model import generate as naive_generate
from speculate import generate


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=data.DefaultsHelp)
    p.add_argument("--method", default="dflash", choices=METHODS, help="how to decode")
    p.add_argument("--prompt", default="def parse(", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p.add_argument("-K", "--draft-len", type=int, help="drafts per step (default: its own, or 4)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_drafter_flags(p)
    p.add_argument("--check", action="store_true", help="greedy: compare with model.generate")
    p.add_argument("--target", default=os.path.join(data.REF_WEIGHTS, "target.pt"),
                   help="target checkpoint or Qwen3 folder (default: the committed one)")
    p.add_argument("--weights", metavar="DIR", help="drafter's folder (default: the target's)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if any)")
    args = p.parse_args(argv)
    with data.one_line_errors():
        if args.top_k is not None and args.temperature == 0:
            raise ValueError("--top-k restricts sampling; --temperature 0 decodes greedily")
        if args.draft_len is not None and args.method == "ar":
            raise ValueError("-K sets the drafts per step; --method ar drafts none")
        options = drafter_options(args, p, [args.method])
        target = load_target(args.target, device=get_device(args.device))  # its error first
        enc = load_tokenizer(args.target)  # a Hugging Face folder brings its own
        if not (prompt := enc.encode_ordinary(args.prompt)):
            raise ValueError("empty prompt: --prompt gives no text to continue")
        drafter = load_drafter(args.method, target, args.weights or os.path.dirname(args.target),
                               **options)
        t0 = time.perf_counter()
        outs, st = generate(target, [prompt], drafter, max_new_tokens=args.max_new_tokens,
                            K=args.draft_len, temperature=args.temperature, top_k=args.top_k,
                            seed=args.seed)
        dt = time.perf_counter() - t0
    print(args.prompt + enc.decode(outs[0]))
    acc = " ".join(f"{a:.2f}" for a in st["acceptance_per_position"])
    print(f"\n[{args.method}] tau {st['tau']:.2f} | {st['new_tokens'] / dt:.1f} tok/s | "
          f"{st['verify_passes']} target passes | acceptance per position: {acc or '-'}")
    if args.check and args.temperature == 0:  # no cache, no loop, no acceptance scan shared
        same = naive_generate(target, prompt, args.max_new_tokens) == outs[0]
        print(f"[check] greedy output identical to model.generate: {same}")
    elif args.check:
        print("[check] sampled outputs differ by design; the tests check their distribution")
    return outs[0], st


if __name__ == "__main__":
    main()
