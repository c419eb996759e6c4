"""
The benchmark (DESIGN.md sec. 8): ar (plain decoding, the baseline), ngram, draft, mtp, eagle,
dflash and dflash-tree on the same target, prompts, token budget, temperatures, seed and batch
size, in one table with DFlash's columns (arXiv 2602.06036). It trains nothing: a drafter that is
missing or another target's is skipped (named in --methods: ends the run) with how to train it.

    python bench.py [--device cuda]                 # the committed weights/cpu, T = 0 and T = 1
    python bench.py --methods ar,ngram,dflash --temperatures 0 --json out/bench.json
    python dev/plot.py out/bench.json docs/bench_cpu.svg       # that JSON as an SVG chart
    python bench.py --target out/cpu/target.pt      # your own target, its drafters beside it
    python bench.py --prompts my.jsonl --batch-size 4 --continuous  # your prompts, batched
    python bench.py --prompts weights/ood_prompts.jsonl --n-prompts 10  # packages no corpus has

One batch size per run: dev/sweep.py sweeps it (--option batch_size=1,4,16), or a drafter option.
"""

import argparse
import itertools
import json
import os
import platform
import sys
import time

import torch

import data
import dflash_kernels as kernels
from checkpoint import (METHODS, add_drafter_flags, drafter_options, get_device, load_drafter,
                        load_target, load_tokenizer)
from speculate import generate, headroom
from train import check_args as check_flags

REPEAT_WARN = 0.15  # a target repeating more of its 8-grams loops (real code: ~2 %, DESIGN sec. 2)
repeat8 = lambda outs: sum(data.repeated_ngram_fraction(o, 8) for o in outs) / len(outs)
params = lambda drafter: drafter.params() if hasattr(drafter, "params") else 0  # ar, ngram: 0


def die(msg):  # bad input ends in one line on stderr and exit code 2, never a traceback
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def checked(f, *a, flag="", **k):  # f(*a, **k), its ValueError or missing file one error line
    try:
        return f(*a, **k)
    except (ValueError, FileNotFoundError) as e:
        die(f"{flag}{e}")


def run(target, drafter, prompts, K, temperature, args, batch_size):
    """All prompts in batches of batch_size (--continuous: batch_size rows that take the next
    prompt as they finish), timed as a whole; seeds follow the batch. -> outputs, stats."""
    sync = torch.cuda.synchronize if target.head.weight.is_cuda else lambda: None
    outs, per_prompt = [], []  # per_prompt: (new tokens, row passes) of each prompt
    st = dict(verify_passes=0, draft_s=0.0, verify_s=0.0, rest_s=0.0, acc=[0] * K, att=[0] * K)
    chunk = len(prompts) if args.continuous else batch_size  # prompts per generate call
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), chunk):
        o, s = generate(target, prompts[i:i + chunk], drafter, max_new_tokens=args.max_new_tokens,
                        batch_size=batch_size, temperature=temperature, seed=args.seed + i,
                        K=max(K, 1), compile=args.compile)
        outs += o
        per_prompt += zip(map(len, o), s["row_passes"])
        for k in ("verify_passes", "draft_s", "verify_s", "rest_s"):
            st[k] += s[k]
        st["acc"] = [x + a for x, a in zip(st["acc"], s["accepted_per_position"])]
        st["att"] = [x + n for x, n in zip(st["att"], s["attempts_per_position"])]
    sync()
    tokens, passes = (sum(x) for x in zip(*per_prompt))
    st.update(wall_s=time.perf_counter() - t0, new_tokens=tokens, row_passes=passes,
              draft_row_passes=passes - len(per_prompt),  # all but the prefills
              tau=tokens / passes, tau_se=ratio_se(per_prompt),  # alpha: see print_table
              alpha=[a / n for a, n in zip(st["acc"], st["att"]) if n > 0])
    return outs, st


def ratio_se(pairs):
    """Standard error of tau = sum(tokens) / sum(passes) over prompts, by the delta method."""
    n, tokens, passes = len(pairs), sum(t for t, _ in pairs), sum(p for _, p in pairs)
    if n < 2:
        return 0.0
    tau = tokens / passes
    return (n / (n - 1) * sum((t - tau * p) ** 2 for t, p in pairs)) ** 0.5 / passes


def predicted_speedup(st, ar):
    """E x t_ar / t_pass, E = 1 + accepted drafts per drafting row pass (prefills left out)."""
    E = 1 + sum(st["acc"]) / max(st["draft_row_passes"], 1)
    t_ar = ar["wall_s"] / ar["verify_passes"]
    return E * t_ar / (sum(step_ms(st).values()) / 1e3)


def step_ms(st):
    """Milliseconds per pass (prefills included) of the drafter, the target, the rest."""
    return {k: 1e3 * st[k + "_s"] / st["verify_passes"] for k in ("draft", "verify", "rest")}


def lossless(target, prompts, outs, ar_outs, T):
    """At T = 0 the outputs must equal plain decoding's token for token; where a row first
    differs, the gap between the target's logits for the two tokens (a near-tie: rounding scale;
    None: it ended early). Sampled rows differ by design: None (tests check the distribution)."""
    if T != 0:
        return dict(lossless=None, mismatches=0, first_difference_gaps=[])
    gaps = []
    for p, o, r in zip(prompts, outs, ar_outs):
        t = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None)
        if t is not None:
            with torch.no_grad():
                ids = torch.tensor([p + r[:t]], device=target.head.weight.device)
                logits = target(ids)[0][0, -1].float()
            gaps.append(abs(logits[r[t]] - logits[o[t]]).item())
        elif o != r:
            gaps.append(None)
    return dict(lossless=not gaps, mismatches=len(gaps), first_difference_gaps=gaps)


def bench_rows(target, drafters, Ks, prompts, temps, batch_size, args):
    """An untimed warm-up, then every method at every temperature, --repeats times in rounds (a
    drift in speed hits all alike), its median run against ar's there -> the table's rows."""
    runs = {(m, T): [] for m in drafters for T in temps}
    # warm-up: first-call allocations, lazy CUDA init; compiled, each batch shape a run will
    # take (a shorter last batch too) compiles and records its graph here, over a few passes
    last = batch_size if args.continuous else len(prompts) % batch_size or batch_size
    for (m, T), b in itertools.product(runs, dict.fromkeys([batch_size, last])):
        t0 = time.perf_counter()
        generate(target, prompts[:b], drafters[m], max_new_tokens=32 if args.compile else 4,
                 temperature=T, seed=0, K=max(Ks[m], 1), compile=args.compile)
        if args.compile:  # progress through minutes of compiling, and what each shape cost
            print(f"{m:11s} T={T:<4g} batch {b:3d}: compiled in {time.perf_counter() - t0:.1f} s")
    for r in range(args.repeats):
        for (m, T), rs in runs.items():
            rs.append(run(target, drafters[m], prompts, Ks[m], T, args, batch_size))
            wall_s, tau = rs[-1][1]["wall_s"], rs[-1][1]["tau"]
            print(f"{m:11s} T={T:<4g} batch {batch_size:3d}: {wall_s:.2f} s, tau {tau:.2f}"
                  + (f" (round {r + 1}/{args.repeats})" if args.repeats > 1 else ""), flush=True)
    median = {k: sorted(rs, key=lambda x: x[1]["wall_s"])[len(rs) // 2] for k, rs in runs.items()}
    rows = []
    for (m, T), (o, st) in median.items():
        ar_o, ar = median["ar", T]  # the baseline for speed and, at T = 0, for the tokens
        rows.append(dict(method=m, temperature=T, K=Ks[m], tau=st["tau"], tau_se=st["tau_se"],
                         tokens_per_s=st["new_tokens"] / st["wall_s"], wall_s=st["wall_s"],
                         speedup=ar["wall_s"] / st["wall_s"],
                         wall_s_runs=[x[1]["wall_s"] for x in runs[m, T]],
                         predicted_speedup=predicted_speedup(st, ar), step_ms=step_ms(st),
                         acceptance_per_position=st["alpha"], new_tokens=st["new_tokens"],
                         verify_passes=st["verify_passes"], drafter_params=params(drafters[m]),
                         repeat8=repeat8(o), **lossless(target, prompts, o, ar_o, T)))
    return rows


def print_card(args, device, t, drafters, Ks, source, n_prompts, repeats):
    u = platform.uname()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print("\n" + "=" * 100 + f"\nmachine   {platform.processor() or u.machine} | {u.system} "
          f"{u.release} | {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0  # last minute's; alone ~2
    if device.type == "cpu" and load > 1.5 * (os.cpu_count() or 1):
        print(f"WARNING   load average {load:.1f} on {os.cpu_count()} cores: other jobs shared "
              "them, so the speeds and ratios below mean little (taus and lossless still hold)")
    print(f"device    {device} ({gpu}) | dtype {args.dtype} | torch {torch.__version__} | CUDA "
          f"extension active: {kernels.available(device)} | compiled steps: {args.compile}"
          + (f" (CUDA graphs; {torch._dynamo.utils.counters['inductor']['cudagraph_skips']} graphs "
             "skipped: TORCH_LOGS=perf_hints)" if args.compile and device.type == "cuda" else "")
          + (", dflash-tree runs eager" if args.compile and drafters.get("dflash-tree") else ""))
    print(f"target    preset {t['preset']} | {t['params'] / 1e6:.2f}M params | {t['path']}")
    print("drafters  " + (" | ".join(f"{m} {params(d) / 1e6:.2f}M" for m, d in drafters.items()
                                     if d) or "none") + f" | from {args.weights}")
    print(f"prompts   {n_prompts} from {source} | {args.max_new_tokens} new tokens each | "
          f"temperatures {args.temperatures} | batch {args.batch_size}"
          f"{' (continuous)' if args.continuous else ''} | seed {args.seed}")
    runs = ", ".join(f"{m} {Ks[m]}" + (f" (block {d.block_size}" if m.startswith("dflash") else "")
                     + (f", tree of {d.tree.N} nodes)" if m == "dflash-tree" else
                        ")" if m == "dflash" else "")
                     for m, d in drafters.items() if d)
    print(f"drafts    {f'K per step: {runs}' if runs else 'none (ar only)'} | timing: median of "
          f"{args.repeats} run(s) after a warm-up")
    hot = "/".join(f"{t:g}" for t, r in repeats.items() if t > 0 and r <= REPEAT_WARN)
    trust = f"the T={hot} rows" if hot else "sampled rows (T > 0) of a target that does not loop"
    for T, r in repeats.items():
        print(f"target    repeats {r:.1%} of its 8-grams at T={T:g} (plain decoding; code: ~2%)")
        if r > REPEAT_WARN:  # tau at T = 0 flatters every drafter on a target that loops
            print(f"WARNING   the target loops at T={T:g} ({r:.0%} > {REPEAT_WARN:.0%}): tau will "
                  f"flatter every drafter there; trust {trust}")


def print_table(results, n_prompts):
    print(f"\n{'method':12s}{'T':>5s}{'K':>4s}{'tau':>7s}{'s.e.':>6s}{'tok/s':>9s}{'speedup':>9s}"
          f"{'predicted':>11s}  {'lossless':18s}{'params':>9s}")
    for r in results:
        ok = ("n/a" if r["lossless"] is None else "yes" if r["lossless"]
              else f"NO ({r['mismatches']}/{n_prompts} differ)")
        print(f"{r['method']:12s}{r['temperature']:5g}{r['K']:4d}{r['tau']:7.2f}{r['tau_se']:6.2f}"
              f"{r['tokens_per_s']:9.1f}{r['speedup']:8.2f}x{r['predicted_speedup']:10.2f}x  "
              f"{ok:18s}{r['drafter_params'] / 1e6:8.2f}M")
    for r in results:
        if gaps := r["first_difference_gaps"]:
            gaps = ", ".join("(ends early)" if g is None else f"{g:.2g}" for g in gaps)
            print(f"NOTE      {r['method']} T=0: the target's two logits where each differing row "
                  f"first differs are {gaps} apart (near-tie or bug: docs/troubleshooting.md)")
    print("\nwhere a pass's time goes, in ms (draft: all the drafter does; verify: the target's "
          "pass, the scan)")
    for r in results:
        t = r["step_ms"]
        print(f"  {r['method']:11s} T={r['temperature']:<4g} | draft {t['draft']:6.2f}  verify "
              f"{t['verify']:6.2f}  rest {t['rest']:6.2f} | {sum(t.values()):6.2f} ms a pass")
    print("\nacceptance per draft position (alpha_i: of the passes that drafted position i, the "
          "share whose first i drafts were all accepted; full block = 1)")
    for r in results:
        if a := r["acceptance_per_position"]:  # a column per position, eighth blocks 0 ... 1
            bars = "".join(" ▁▂▃▄▅▆▇█"[round(x * 8)] * 2 for x in a)
            print(f"  {r['method']:11s} T={r['temperature']:<4g} |{bars}| alpha_1 {a[0]:.2f} ... "
                  f"alpha_{len(a)} {a[-1]:.2f}, 1 + sum = {1 + sum(a):.2f}")


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=data.DefaultsHelp)
    g = p.add_argument_group("what to run")
    g.add_argument("--methods", help=f"comma list of {','.join(METHODS)} (default: all that load)")
    g.add_argument("--temperatures", default="0,1", help="comma list; each method runs at each")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    g.add_argument("--batch-size", type=int, default=1, help="rows decoded at once")
    g.add_argument("--continuous", action="store_true", help="a finished row takes the next prompt")
    g.add_argument("-K", "--K", type=int, default=7,
                   help="drafts per step of ngram, draft and eagle")
    add_drafter_flags(g)  # --block-size, --dflash-argmax, --tree, --mtp-draft, --confidence
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, help="run every chain "
                   "verify pass and each learned drafter's propose at one shape, compiled (a "
                   "tree's and ngram's stay eager): CUDA graphs on a GPU, inductor on a CPU "
                   "(default: on a GPU only; ~30 s a shape to compile, untimed)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every method")
    g.add_argument("--repeats", type=int, default=1, help="timed runs per row; the median counts")
    g.add_argument("--prompts", help="a file: JSON lines with a \"prompt\", or blank-line blocks")
    g.add_argument("--n-prompts", type=int, help="the first N prompts (default: 10 of the "
                   "committed held-out ones, all of a --prompts file)")
    g = p.add_argument_group("model, device and output")
    g.add_argument("--target", default=os.path.join(data.REF_WEIGHTS, "target.pt"),
                   help="checkpoint or Hugging Face folder")
    g.add_argument("--weights", help="folder of the drafters' checkpoints (default: the target's)")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if any)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="of the weights and activations (bfloat16 on cuda only)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's choice)")
    g.add_argument("--json", help="write the results as JSON here (dev/plot.py charts it)")
    return p


def check_args(args):
    """Before any work -> temperatures, methods (ar first), drafter options."""
    try:
        temps = [*dict.fromkeys(float(t) + 0.0 for t in args.temperatures.split(","))]  # -0: 0
    except ValueError as e:
        die(f"--temperatures must be a comma list of numbers ({e})")
    if not all(0 <= t < float("inf") for t in temps):  # NaN too
        die(f"--temperatures must be >= 0 and finite, got {args.temperatures}")
    # --batch-size and --threads (0..cores) as the trainers check them; None: the drafter's own
    checked(check_flags, args, ["repeats", "K", "max_new_tokens", "n_prompts", "mtp_draft"])
    for flag, value, low in [("--block-size", args.block_size, 2), ("--tree", args.tree_nodes, 1)]:
        if value is not None and value < low:
            die(f"{flag} must be >= {low}, got {value}")
    listed = ",".join(METHODS) if args.methods is None else args.methods  # default: all
    methods = [m.strip() for m in listed.split(",") if m.strip()]
    if not methods:
        die(f"--methods names no method; choose from {', '.join(METHODS)}")
    if unknown := [m for m in methods if m not in METHODS]:
        die(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    opts = checked(drafter_options, args, get_parser(), methods)
    return temps, ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"], opts


def main(argv=None):
    args = get_parser().parse_args(argv)
    args.weights = args.weights or os.path.dirname(args.target) or "."
    temps, methods, opts = check_args(args)
    torch.set_num_threads(args.threads or torch.get_num_threads())  # 0: torch's choice
    source = args.prompts or "held-out prompts (weights/heldout_prompts.jsonl)"
    texts = (checked(data.read_prompts_file, args.prompts)[:args.n_prompts] if args.prompts
             else checked(data.reference_prompts, args.n_prompts or 10))
    if (rows := args.batch_size) > len(texts):  # else a batch that never ran
        die(f"a batch of {rows} rows needs at least {rows} prompts, and there are {len(texts)}"
            + (f" in {args.prompts}" if args.prompts else " (see --n-prompts)"))
    device, dtype = checked(get_device, args.device), getattr(torch, args.dtype)
    args.compile = device.type == "cuda" if args.compile is None else args.compile
    if dtype != torch.float32 and device.type != "cuda":
        die("--dtype bfloat16 needs --device cuda")
    if args.json is not None:  # before the run, not after ("" too)
        checked(data.check_writable, args.json, flag="--json ")
    print(f"bench: device {device} ({'given' if args.device else 'auto-detected'}), dtype "
          f"{args.dtype}, target {args.target}, drafters from {args.weights}")
    target = checked(load_target, args.target, device=device, dtype=dtype)
    drafters = {}
    flags = {"dflash": ("--block-size", args.block_size), "mtp": ("--mtp-draft", args.mtp_draft)}
    for m in methods:
        try:
            drafters[m] = load_drafter(m, target, args.weights, **opts)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            why = str(e).splitlines()[0]
            if why.startswith(args.weights):  # the file's fault: missing, damaged, another target's
                out = data.out_dir_for(args.weights)  # never into the committed weights/
                train = (f"python train.py --preset cpu-draft --out-path {out}/draft.pt"
                         if m == "draft" else f"python train_drafter.py --method {m.split('-')[0]}"
                         f" --target {args.target} --out-dir {out}")
                why = why.split("; retrain it")[0] + f"; train it: {train}"
            elif (f := flags.get(m.split("-")[0])) and f[1] is not None:  # a block or depth too big
                die(f"{m}: {why} (see {f[0]})")
            else:  # a bug
                why = f"cannot load it ({type(e).__name__}: {why})"
            if args.methods:  # named in --methods
                die(f"{m} was asked for in --methods, but {why}")
            print(f"skipping {m}: {why}")
    Ks = {m: 0 if d is None else args.K if m in ("ngram", "draft", "eagle")
          else getattr(d, "default_K", args.K) for m, d in drafters.items()}
    enc = checked(load_tokenizer, args.target)  # once: a Hugging Face one is parsed from JSON
    prompts = [enc.encode_ordinary(t) for t in texts]
    n_verify = max(headroom(Ks[m], getattr(d, "tree", None)) for m, d in drafters.items())
    for i, (t, ids) in enumerate(zip(texts, prompts), 1):
        if len(ids) + args.max_new_tokens + n_verify > target.cfg.max_seq_len:
            die(f"prompt {i} of {source} ({t[:40]!r}...): {len(ids)} tokens + {args.max_new_tokens}"
                f" new + {n_verify} verify positions exceed the context ({target.cfg.max_seq_len})")
    results = checked(bench_rows, target, drafters, Ks, prompts, temps, args.batch_size, args)
    preset = (getattr(target, "ckpt", {}).get("args") or {}).get("preset", "unknown")  # trained as
    tinfo = dict(path=args.target, preset=preset, params=target.n_params())
    print_card(args, device, tinfo, drafters, Ks, source, len(prompts),
               {r["temperature"]: r["repeat8"] for r in results if r["method"] == "ar"})
    print_table(results, len(prompts))
    if args.json:
        report = dict(config=vars(args), machine=dict(device=str(device), torch=torch.__version__,
                                                      cuda_ext=kernels.available(device)),
                      target=tinfo, results=results)
        data.write_atomic(args.json, json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    with data.one_line_errors():  # bad input has ended in die() already: this is for Ctrl-C
        main()
