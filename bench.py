"""
The benchmark: every method on the same target, prompts, token budget, temperature, seed and
batch size, in one process, one table (DESIGN.md sec. 8; DFlash, arXiv 2602.06036, reports the
same columns). Methods: ar (plain decoding, the baseline), ngram (prompt lookup), draft (a small
model of the target's family), mtp, eagle, dflash.

    python bench.py                                 # the committed weights/cpu, T = 0 and T = 1
    python bench.py --device cuda                   # the same weights on a GPU
    python bench.py --methods ar,ngram,dflash --temperatures 0 --json out/b.json --plot out/b.svg
    python bench.py --weights out/cpu/weights       # drafters train_drafter.py trained for it
    python bench.py --target out/cpu/target.pt      # your own target, its drafters beside it
    python bench.py --prompts my.jsonl --batch-sizes 1,4,16   # your prompts, a batch sweep

It trains nothing: a drafter that is missing, or was trained for another target, is skipped
with the command that trains it. Output: a card (machine, device, dtype, sizes, prompts, how
much the target loops), one row per method and temperature (tau and its standard error over
the prompts, tokens/s, speedup vs ar, predicted speedup, lossless check with, where a greedy
row differs, how close the target's two candidate tokens were there), a chart of per-position
acceptance; --json / --plot write the same data. Timing: an untimed warm-up per row, CUDA
synchronised, medians over --repeats rounds.
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from functools import partial
from xml.sax.saxutils import escape

import torch

import data
import dflash_kernels as kernels
from checkpoint import (METHODS, add_drafter_flags, drafter_options, get_device, load_drafter,
                        load_target)
from data import check_writable
from speculate import generate

DEFAULT_TARGET = os.path.join(data.WEIGHTS_DIR, "cpu", "target.pt")
# a target repeating more of its 8-grams loops, and tau at T = 0 flatters every drafter;
# real code repeats ~2 % of its 8-grams in 128 tokens (DESIGN sec. 2)
REPEAT_WARN = 0.15


def die(msg):
    """Bad input ends in one line on stderr and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def checked(f, *a, flag="", **k):
    """f(*a, **k), with its ValueError or missing file ended as one error line."""
    try:
        return f(*a, **k)
    except (ValueError, FileNotFoundError) as e:
        die(f"{flag}{e}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# -----------------------------------------------------------------------------
# measurement

def run(target, drafter, prompts, K, temperature, args, batch_size):
    """Decode all prompts in fixed batches of batch_size (or, with --continuous, through
    batch_size rows that take the next prompt as they finish), timed as a whole. Seeds depend
    on the batch only, so every method sees the same ones. -> outputs, summed stats."""
    device = target.head.weight.device
    outs = []
    st = dict(verify_passes=0, draft_s=0.0, verify_s=0.0, acc=[0] * K, att=[0] * K)
    per_prompt = []  # (new tokens, row passes) of each prompt: tau and its standard error
    chunk = len(prompts) if args.continuous else batch_size  # prompts per generate call
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), chunk):
        o, s = generate(target, prompts[i:i + chunk], drafter, max_new_tokens=args.max_new_tokens,
                        batch_size=batch_size, temperature=temperature, top_k=args.top_k,
                        seed=args.seed + i, K=max(K, 1))
        outs += o
        for k in ("verify_passes", "draft_s", "verify_s"):
            st[k] += s[k]
        per_prompt += [(len(x), p) for x, p in zip(o, s["row_passes"])]
        for j, (a, n) in enumerate(zip(s["accepted_per_position"], s["attempts_per_position"])):
            st["acc"][j] += a
            st["att"][j] += n
    sync(device)
    st["wall_s"] = time.perf_counter() - t0
    st["new_tokens"] = sum(t for t, _ in per_prompt)
    st["row_passes"] = sum(p for _, p in per_prompt)
    st["draft_row_passes"] = st["row_passes"] - len(per_prompt)  # all but the prefills
    st["tau"] = st["new_tokens"] / st["row_passes"]
    st["tau_se"] = ratio_se(per_prompt)
    # alpha_i: of the passes that drafted position i, the share in which the first i drafts
    # were all accepted (MTP's gate and ngram without a match draft fewer than K in some)
    st["alpha"] = [a / n for a, n in zip(st["acc"], st["att"]) if n > 0]
    return outs, st


def ratio_se(pairs):
    """Standard error of tau = sum(tokens) / sum(passes) over (tokens, passes) per prompt, by
    the delta method. With 10 prompts it is often a few tenths: more than many gaps between
    drafters in the table."""
    n, tokens, passes = len(pairs), sum(t for t, _ in pairs), sum(p for _, p in pairs)
    if n < 2:
        return 0.0
    tau = tokens / passes
    return math.sqrt(n / (n - 1) * sum((t - tau * p) ** 2 for t, p in pairs)) / passes


def measure(jobs, repeats, label):
    """Run every job (a callable returning run()'s outputs and stats) `repeats` times and keep
    each job's run with the median wall time (all its times in wall_s_runs). In rounds of one
    run per job rather than back to back, so that a drift in the machine's speed reaches every
    method alike."""
    runs = {k: [] for k in jobs}
    for r in range(repeats):
        for k, job in jobs.items():
            runs[k].append(job())
            st = runs[k][-1][1]
            print(f"{label(k)}: {st['wall_s']:.2f} s, tau {st['tau']:.2f}"
                  + (f" (round {r + 1}/{repeats})" if repeats > 1 else ""), flush=True)
    best = {}
    for k, rs in runs.items():
        o, st = sorted(rs, key=lambda x: x[1]["wall_s"])[len(rs) // 2]
        best[k] = o, dict(st, wall_s_runs=[x[1]["wall_s"] for x in rs])
    return best


def predicted_speedup(st, ar):
    """DESIGN sec. 5's formula with measured costs: predicted = E * t_ar / (t_draft + t_verify).
    E = 1 + accepted drafts per draft-verify row pass (a pass that drafted nothing counts with
    its 1); t_draft + t_verify: this method's seconds per verify pass; t_ar: ar's. It leaves out
    the prefills and counts drafts accepted past the token budget, so it can exceed the
    measured speedup; at batch > 1 E is per active row."""
    E = 1 + sum(st["acc"]) / max(st["draft_row_passes"], 1)
    t_ar = ar["wall_s"] / ar["verify_passes"]
    return E * t_ar / ((st["draft_s"] + st["verify_s"]) / st["verify_passes"])


def params(drafter):
    return drafter.params() if hasattr(drafter, "params") else 0  # ar and ngram have none


def repeat8(outs):
    return statistics.mean(data.repeated_ngram_fraction(o, 8) for o in outs)


def lossless(outs, ar_outs, T):
    """At T = 0 the outputs must equal plain decoding's token for token; sampled outputs differ
    by design (None: their losslessness is a distribution, which the tests check)."""
    mism = sum(o != r for o, r in zip(outs, ar_outs)) if T == 0 else 0
    return dict(lossless=(mism == 0) if T == 0 else None, mismatches=mism)


def first_difference_gaps(target, prompts, outs, ar_outs):
    """Where each greedy row that differs from plain decoding's first differs: the gap between
    the target's logits for the two tokens, recomputed in one pass. A verify pass rounds
    differently from a one-token step, so a gap at that rounding's scale is a near-tie; a wrong
    token shows a gap far above it. None: one row stops early, which only a bug does."""
    gaps = []
    for p, o, r in zip(prompts, outs, ar_outs):
        if o == r:
            continue
        t = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None)
        if t is None:
            gaps.append(None)
            continue
        with torch.no_grad():
            ids = torch.tensor([p + r[:t]], device=target.head.weight.device)
            logits = target(ids)[0][0, -1].float()
        gaps.append(abs(logits[r[t]] - logits[o[t]]).item())
    return gaps


# -----------------------------------------------------------------------------
# report

def compare(outs, st, ar_outs, ar_st, T):
    """What a table row and a sweep entry both report of one run against ar's run."""
    return dict(tau=st["tau"], tau_se=st["tau_se"], tokens_per_s=st["new_tokens"] / st["wall_s"],
                speedup=ar_st["wall_s"] / st["wall_s"], wall_s=st["wall_s"],
                wall_s_runs=st["wall_s_runs"], **lossless(outs, ar_outs, T))


def bars(alpha):
    """One column per draft position, eighth blocks: ' ' = 0 ... '█' = 1."""
    return "".join(" ▁▂▃▄▅▆▇█"[round(a * 8)] * 2 for a in alpha)


def svg(results, path):
    """Per-position acceptance (left) and tau vs measured speedup (right), as hand-written SVG:
    the report needs no plotting library."""
    colors = dict(ar="#777", ngram="#d62728", draft="#9467bd", mtp="#2ca02c", eagle="#ff7f0e",
                  dflash="#1f77b4")
    W, H, P = 440, 320, 50  # panel size, padding
    kmax = max([len(r["acceptance_per_position"]) for r in results] + [2])
    tmax = math.ceil(max(r["tau"] for r in results) * 1.15)
    smax = math.ceil(max(max(r["speedup"] for r in results) * 1.15, 1.5) * 2) / 2
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H}" '
           'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>']
    sx = lambda x0, v, vmax: x0 + P + v / vmax * (W - P - 20)  # data -> pixels
    sy = lambda v, vmax: H - P + 10 - v / vmax * (H - P - 40)

    def axes(x0, title, xlabel, ylabel, xmax, ymax, xticks, yticks):
        out.append(f'<text x="{x0 + W / 2}" y="18" text-anchor="middle" font-size="13">'
                   f'{escape(title)}</text>')
        out.append(f'<path d="M{x0 + P},{sy(ymax, ymax):.1f} V{sy(0, ymax):.1f} H{x0 + W - 20}" '
                   'stroke="black" fill="none"/>')
        for v in xticks:
            out.append(f'<text x="{sx(x0, v, xmax):.1f}" y="{sy(0, ymax) + 14:.1f}" '
                       f'text-anchor="middle">{v:g}</text>')
        for v in yticks:
            out.append(f'<text x="{x0 + P - 5}" y="{sy(v, ymax) + 4:.1f}" text-anchor="end">'
                       f'{v:g}</text>')
        out.append(f'<text x="{x0 + W / 2}" y="{H - 6}" text-anchor="middle">'
                   f'{escape(xlabel)}</text>')
        out.append(f'<text x="{x0 + 12}" y="{H / 2}" transform="rotate(-90 {x0 + 12} {H / 2})" '
                   f'text-anchor="middle">{escape(ylabel)}</text>')

    axes(0, "acceptance per draft position", "draft position i",
         "alpha_i (first i drafts accepted)", kmax, 1, range(1, kmax + 1, max(1, kmax // 8)),
         [0, 0.25, 0.5, 0.75, 1])
    axes(W, "tau vs measured speedup", "tau (tokens per verify pass)", "speedup vs ar", tmax,
         smax, range(0, tmax + 1, max(1, tmax // 8)), [v / 2 for v in range(int(2 * smax) + 1)])
    out.append(f'<path d="M{W + P},{sy(1, smax):.1f} H{2 * W - 20}" stroke="#aaa" '
               'stroke-dasharray="4"/>')  # the 1x line
    for i, r in enumerate(results):
        c, label = colors.get(r["method"], "black"), f'{r["method"]} T={r["temperature"]:g}'
        dash = ' stroke-dasharray="5 3"' if r["temperature"] > 0 else ""  # dashed: sampling
        pts = " ".join(f"{sx(0, k + 1, kmax):.1f},{sy(a, 1):.1f}"
                       for k, a in enumerate(r["acceptance_per_position"]))
        if pts:
            y = 34 + 13 * sum(bool(q["acceptance_per_position"]) for q in results[:i])
            out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" '
                       f'stroke-width="1.5"{dash}/>')
            out.append(f'<path d="M{W - 130},{y - 4} h20" stroke="{c}" stroke-width="1.5"{dash}/>'
                       f'<text x="{W - 105}" y="{y}" fill="{c}">{escape(label)}</text>')
        x, y = sx(W, r["tau"], tmax), sy(r["speedup"], smax)
        right = x > 2 * W - 90  # a label near the right edge goes to the left of its point
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{c}"/><text '
                   f'x="{x - 6 if right else x + 6:.1f}" y="{y - 5:.1f}" '
                   f'text-anchor="{"end" if right else "start"}" fill="{c}">{escape(label)}</text>')
    data.write_atomic(path, "\n".join(out + ["</svg>\n"]))


def trained_preset(target):
    """The preset the target was trained as (its checkpoint's args)."""
    return (getattr(target, "ckpt", {}).get("args") or {}).get("preset", "unknown")


def print_card(args, device, dtype, target, drafters, Ks, source, n_prompts, repeats):
    print("\n" + "=" * 100)
    u = platform.uname()
    print(f"machine   {platform.processor() or u.machine} | {u.system} {u.release} | "
          f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device    {device} ({name}) | dtype {str(dtype).replace('torch.', '')} | torch "
          f"{torch.__version__} | CUDA extension active: {kernels.available(device)}")
    print(f"target    preset {trained_preset(target)} | {target.n_params() / 1e6:.2f}M params | "
          f"{args.target}")
    print("drafters  " + (" | ".join(f"{m} {params(d) / 1e6:.2f}M" for m, d in drafters.items()
                                     if d) or "none") + f" | from {args.weights}")
    print(f"prompts   {n_prompts} from {source} | {args.max_new_tokens} new tokens each | "
          f"temperatures {args.temperatures} | top-k {args.top_k} | batch {args.batch_size}"
          f"{' (continuous)' if args.continuous else ''} | seed {args.seed}")
    # only what runs: mtp its depth or --mtp-draft, dflash its block - 1
    runs = ", ".join(f"{m} {Ks[m]}" + (f" (block {d.block_size})" if m == "dflash" else "")
                     for m, d in drafters.items() if d)
    print(f"drafts    {f'K per step: {runs}' if runs else 'none (ar only)'} | timing: median of "
          f"{args.repeats} run(s) after a warm-up")
    for T, r in repeats.items():
        print(f"target    repeats {r:.1%} of its 8-grams at T={T:g} (plain decoding; real code "
              "~2%)")
        if r > REPEAT_WARN:
            trust = "the T=1 rows" if any(t > 0 for t in repeats) else \
                "sampled rows (--temperatures 0,1)"
            print(f"WARNING   the target loops at T={T:g} ({r:.0%} > {REPEAT_WARN:.0%}): tau will "
                  f"flatter every drafter there; trust {trust}")


def print_table(results, sweep, sizes, T0, n_prompts):
    """The table, the acceptance chart and the batch sweep (after the card)."""
    print(f"\n{'method':8s}{'T':>5s}{'K':>4s}{'tau':>7s}{'s.e.':>6s}{'tok/s':>9s}{'speedup':>9s}"
          f"{'predicted':>11s}  {'lossless':18s}{'params':>9s}")
    for r in results:
        ok = ("n/a" if r["lossless"] is None else "yes" if r["lossless"]
              else f"NO ({r['mismatches']}/{n_prompts} differ)")
        print(f"{r['method']:8s}{r['temperature']:5g}{r['K']:4d}{r['tau']:7.2f}{r['tau_se']:6.2f}"
              f"{r['tokens_per_s']:9.1f}{r['speedup']:8.2f}x{r['predicted_speedup']:10.2f}x  "
              f"{ok:18s}{r['drafter_params'] / 1e6:8.2f}M")
    for r in results:
        if r["first_difference_gaps"]:
            gaps = ", ".join("(ends early)" if g is None else f"{g:.2g}"
                             for g in r["first_difference_gaps"])
            print(f"NOTE      {r['method']} T=0: where each differing row first differs, the "
                  f"target's logits for the two tokens are {gaps} apart (near-tie or wrong token: "
                  "docs/troubleshooting.md)")
    print("\nacceptance per draft position (alpha_i: of the passes that drafted position i, the "
          "share whose first i drafts were all accepted; full block = 1)")
    for r in results:
        a = r["acceptance_per_position"]
        if a:
            print(f"  {r['method']:7s} T={r['temperature']:<4g} |{bars(a)}| alpha_1 {a[0]:.2f} ... "
                  f"alpha_{len(a)} {a[-1]:.2f}, E = 1 + sum = {1 + sum(a):.2f}")
    if sweep:
        print(f"\nbatch sweep at T={T0:g} (tokens/s, speedup vs ar at the same batch size"
              + (", * = output differs from ar's)" if T0 == 0 else ")"))
        for bs in sizes:
            print(f"  batch {bs:3d}: " + " | ".join(
                f"{s['method']} {s['tokens_per_s']:.0f} tok/s {s['speedup']:.2f}x"
                + ("*" if s["lossless"] is False else "") for s in sweep if s["batch_size"] == bs))


# -----------------------------------------------------------------------------
# command line

def get_parser():
    p = argparse.ArgumentParser(description="Benchmark every speculative-decoding method on one "
                                "target.", formatter_class=data.DefaultsHelp)
    g = p.add_argument_group("what to run")
    g.add_argument("--methods", default=None, help=f"comma list of {','.join(METHODS)} "
                   "(default: all that load; ar always runs as the baseline)")
    g.add_argument("--temperatures", default="0,1", help="comma list; each method runs at each")
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely only")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    g.add_argument("--batch-size", type=int, default=1, help="rows decoded at once")
    g.add_argument("--continuous", action="store_true", help="continuous batching: a finished "
                   "row takes the next waiting prompt, instead of batches that wait for their "
                   "slowest row")
    g.add_argument("--batch-sizes", default=None, help="extra throughput sweep over these batch "
                   "sizes, e.g. 1,4,16 (first temperature only)")
    g.add_argument("--K", type=int, default=7, help="draft length for ngram/draft/eagle (EAGLE-3's "
                   "7); mtp drafts its depth or --mtp-draft, dflash its block - 1")
    add_drafter_flags(g)  # --block-size, --dflash-argmax, --mtp-draft, --mtp-margin
    g.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every method")
    g.add_argument("--repeats", type=int, default=1, help="timed runs per row, in rounds over all "
                   "rows; the median is reported")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", default=None, help="file of prompts: JSON lines with a \"prompt\" "
                   "string, or text blocks separated by blank lines (default: the committed "
                   "held-out prompts, the same on every machine)")
    g.add_argument("--n-prompts", type=int, default=10, help="how many of the committed prompts, "
                   f"at most {data.N_REFERENCE_PROMPTS} (ignored with --prompts)")
    g = p.add_argument_group("model and weights")
    g.add_argument("--target", default=DEFAULT_TARGET, help="target checkpoint or Hugging Face "
                   "Qwen3 folder (default: the committed weights/cpu/target.pt)")
    g.add_argument("--weights", default=None, help="folder of the drafters' checkpoints "
                   "(draft.pt, mtp.pt, eagle.pt, dflash.pt; default: the target's folder)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model "
                   "dtype (bfloat16 on cuda only); greedy output equals plain decoding's up to "
                   "near-ties of the rounding's size (docs/troubleshooting.md)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's "
                   "choice); on a busy machine 1 can run several times faster")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the results as JSON here")
    g.add_argument("--plot", default=None, help="write an SVG chart here")
    return p


def check_args(args):
    """The flags that need no file or model, checked before any work -> temperatures, the
    sweep's batch sizes, the methods (ar first), and whether --methods named them."""
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
        sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else []
    except ValueError as e:
        die(f"--temperatures / --batch-sizes must be comma lists of numbers ({e})")
    temps, sizes = list(dict.fromkeys(temps)), list(dict.fromkeys(sizes))  # each row once
    if not all(t >= 0 for t in temps):  # NaN too
        die(f"--temperatures must be >= 0, got {args.temperatures}")
    opt = lambda v, default: default if v is None else v  # an unset optional flag passes
    lows = {"--batch-size": (args.batch_size, 1), "--repeats": (args.repeats, 1),
            "--K": (args.K, 1), "--block-size": (opt(args.block_size, 2), 2),
            "--max-new-tokens": (args.max_new_tokens, 1), "--n-prompts": (args.n_prompts, 1),
            "--batch-sizes": (min(sizes, default=1), 1), "--top-k": (opt(args.top_k, 1), 1),
            "--mtp-draft": (opt(args.mtp_draft, 1), 1), "--mtp-margin": (args.mtp_margin, 0),
            "--threads": (args.threads, 0)}
    for flag, (value, low) in lows.items():
        if not value >= low:  # NaN too
            die(f"{flag} must be >= {low}, got {value}")
    if args.top_k is not None and not any(t > 0 for t in temps):
        die("--top-k restricts sampling; every one of --temperatures decodes greedily")
    if args.weights and os.path.isfile(args.weights):
        die(f"--weights names a folder of checkpoints, not a file ({args.weights}; --target FILE "
            "names the target)")
    named = args.methods is not None
    listed = ",".join(METHODS) if args.methods is None else args.methods
    methods = [m.strip() for m in listed.split(",") if m.strip()]
    if named and not methods:
        die(f"--methods names no method; choose from {', '.join(METHODS)}")
    for m in methods:
        if m not in METHODS:
            die(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    checked(drafter_options, args, get_parser(), methods)
    return temps, sizes, ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"], named


def train_command(m, args):
    """The command that trains method m's drafter for this target into --weights."""
    if m == "draft":  # a small model of the target's family, trained on the corpus as it was
        return f"python train.py --preset cpu-draft --out-path {args.weights}/draft.pt"
    return f"python train_drafter.py --method {m} --target {args.target} --out-dir {args.weights}"


def load_methods(args, methods, named, device, dtype):
    """The target and each method's drafter. A drafter that is missing, damaged or trained for
    another target is skipped with its reason and the command that trains it; if --methods
    named it, the run ends there. -> target, {method: drafter (None for ar)}, {method: K}."""
    target = checked(load_target, args.target, device=device, dtype=dtype)
    opts = drafter_options(args, get_parser(), methods)
    drafters = {}
    for m in methods:
        try:
            drafters[m] = load_drafter(m, target, args.weights, **opts)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            why = str(e).splitlines()[0]
            if why.startswith(args.weights):  # the file's fault: missing, damaged, another target's
                why = why.split("; retrain it")[0] + f"; train it: {train_command(m, args)}"
            else:  # a block above dflash's training, more drafts than mtp's depth, or a bug
                flag = {"dflash": "--block-size", "mtp": "--mtp-draft"}.get(m)
                if flag and getattr(args, flag[2:].replace("-", "_")) is not None:
                    die(f"{m}: {why} (see {flag})")
                why = f"cannot load it ({type(e).__name__}: {why})"
            if named:
                die(f"{m} was asked for in --methods, but {why}")
            print(f"skipping {m}: {why}")
    Ks = {m: 0 if d is None else args.K if m in ("ngram", "draft", "eagle")
          else getattr(d, "default_K", args.K) for m, d in drafters.items()}
    return target, drafters, Ks


def main(argv=None):
    args = get_parser().parse_args(argv)
    args.weights = args.weights or os.path.dirname(args.target) or "."
    temps, sizes, methods, named = check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts:
        texts, source = checked(data.read_prompts_file, args.prompts), args.prompts
    else:
        texts = checked(data.reference_prompts, args.n_prompts)
        source = "held-out prompts (weights/heldout_prompts.jsonl)"
    rows = max([args.batch_size, *sizes])
    if rows > len(texts):  # the card and the sweep would name a batch that never ran
        die(f"a batch of {rows} rows needs at least {rows} prompts, and there are {len(texts)}"
            + (f" in {args.prompts}" if args.prompts else " (see --n-prompts)"))
    device = checked(get_device, args.device)
    dtype = getattr(torch, args.dtype)
    if dtype != torch.float32 and device.type != "cuda":
        die("--dtype bfloat16 needs --device cuda")
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        die(f"--json and --plot name the same file {args.json}: the chart would replace the JSON")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):  # before the run, not after
        if path:
            checked(check_writable, path, flag=f"{flag} ")
    print(f"bench: device {device} ({'given' if args.device else 'auto-detected'}), dtype "
          f"{args.dtype}, target {args.target}, drafters from {args.weights}")

    target, drafters, Ks = load_methods(args, methods, named, device, dtype)
    enc = data.get_encoding()
    prompts = [enc.encode_ordinary(t) for t in texts]
    for i, (t, ids) in enumerate(zip(texts, prompts), 1):
        if len(ids) + args.max_new_tokens + max(Ks.values()) + 1 > target.cfg.max_seq_len:
            die(f"prompt {i} of {source} ({t[:40]!r}...) has {len(ids)} tokens; with "
                f"{args.max_new_tokens} new tokens and {max(Ks.values()) + 1} verify positions it "
                f"exceeds the target's context of {target.cfg.max_seq_len}")

    try:
        for m, d in drafters.items():
            for T in temps:  # warm-up, untimed: first-call allocations, lazy CUDA init
                generate(target, prompts[:args.batch_size], d, max_new_tokens=4, temperature=T,
                         top_k=args.top_k, seed=0, K=max(Ks[m], 1))
        table = measure({(m, T): partial(run, target, d, prompts, Ks[m], T, args, args.batch_size)
                         for m, d in drafters.items() for T in temps}, args.repeats,
                        lambda k: f"{k[0]:7s} T={k[1]:g}")
        sweep = []
        for bs in sizes:
            timed = measure({m: partial(run, target, d, prompts, Ks[m], temps[0], args, bs)
                             for m, d in drafters.items()}, args.repeats,
                            lambda m: f"sweep batch {bs:3d} {m:7s}")
            ar_out, ar_st = timed["ar"]  # the baseline for speed and, at T = 0, for the tokens
            for m, (o, st) in timed.items():
                sweep.append(dict(method=m, batch_size=bs, temperature=temps[0],
                                  **compare(o, st, ar_out, ar_st, temps[0])))
    except ValueError as e:  # generate's own checks
        die(str(e))

    results = []
    for m, d in drafters.items():
        for T in temps:
            (o, st), (ar_o, ar) = table[m, T], table["ar", T]
            gaps = first_difference_gaps(target, prompts, o, ar_o) if T == 0 else []
            results.append(dict(method=m, temperature=T, **compare(o, st, ar_o, ar, T),
                                predicted_speedup=predicted_speedup(st, ar),
                                acceptance_per_position=st["alpha"], new_tokens=st["new_tokens"],
                                verify_passes=st["verify_passes"], drafter_params=params(d),
                                repeat8=repeat8(o), K=Ks[m], first_difference_gaps=gaps))

    print_card(args, device, dtype, target, drafters, Ks, source, len(prompts),
               {T: repeat8(table["ar", T][0]) for T in temps})
    print_table(results, sweep, sizes, temps[0], len(prompts))
    if args.json:
        report = dict(config=vars(args),
                      machine=dict(device=str(device), torch=torch.__version__,
                                   cuda_ext=kernels.available(device)),
                      target=dict(path=args.target, preset=trained_preset(target),
                                  params=target.n_params()),
                      results=results)
        if sizes:
            report["batch_sweep"] = sweep
        data.write_atomic(args.json, json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        svg(results, args.plot)
        print(f"wrote {args.plot}")
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the JSON and the SVG are written temp-then-rename
        print("\ninterrupted: nothing half-written was left behind", file=sys.stderr)
        sys.exit(130)
