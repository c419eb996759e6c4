"""
The benchmark: every method on the same target, prompts, token budget, temperature, seed and
batch size, in one process (DESIGN.md sec. 8; DFlash, arXiv 2602.06036, reports the same
columns). Methods: ar (plain decoding, the baseline), ngram (prompt lookup), draft (a small
model of the target's family), mtp, eagle, dflash.

    python bench.py                                   # CPU: committed weights/cpu, else train into out/cpu
    python bench.py --device cuda                     # the gpu preset
    python bench.py --methods ar,ngram,dflash --temperatures 0 --json out/bench.json --plot out/bench.svg
    python bench.py --prompts my_prompts.jsonl --max-new-tokens 64
    python bench.py --weights DIR                     # use the checkpoints in DIR, train nothing
    python bench.py --batch-sizes 1,4,16              # plus a throughput sweep over batch sizes

Weights (weights.py): the committed reference checkpoints in weights/<preset>/ when they load;
otherwise, or with --retrain, whatever is missing is trained into out/<preset>/ first (printing
the plan, its minutes and progress), which later runs reuse.

Output: a card (machine, device, dtype, sizes, prompts, budget, how much the target loops),
one row per method and temperature (tau and its standard error over the prompts, tokens/s,
speedup vs ar, predicted speedup, lossless check, and where a greedy row differs, how close the
target's two candidate tokens were there), a chart of per-position acceptance; --json / --plot
write the same data.
Timing: one short untimed warm-up per method and temperature, torch.cuda.synchronize around
CUDA timings, medians over --repeats rounds (default 1, so a CPU run with reused weights takes 1-4 minutes).

~550 lines instead of ~300: the hand-written SVG (~50 lines), the batch-size sweep and
the checks of every flag live here too, so that the report needs no plotting dependency and bad
input ends in one line, not a traceback.
"""

import argparse
import importlib.util
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
import weights
from checkpoint import METHODS, add_drafter_flags, drafter_options, get_device, load_drafter
from data import check_writable
from model import PRESETS
from speculate import generate

# a target repeating more of its 8-grams loops: the reference weights' quality bar (README);
# real code repeats ~2 % of its 8-grams in 128 tokens (DESIGN sec. 2)
REPEAT_WARN = 0.15


def die(msg):
    """Bad input ends in one line on stderr and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# -----------------------------------------------------------------------------
# the methods

def get_drafter(method, target, folder, args):
    # drafters follow the target's device and dtype
    return load_drafter(method, target, folder, **drafter_options(args, get_parser(), METHODS))


# -----------------------------------------------------------------------------
# measurement

def run(target, drafter, prompts, K, temperature, args, batch_size):
    """Decode all prompts in fixed batches of batch_size (or, with --continuous, through
    batch_size rows that take the next prompt as they finish), timed as a whole. Seeds depend
    on the batch only, so every method sees the same ones. Returns outputs, summed stats and
    wall time."""
    device = target.head.weight.device
    outs = []
    st = dict(verify_passes=0, draft_s=0.0, verify_s=0.0, acc=[0] * K, att=[0] * K)
    per_prompt = []  # (new tokens, row passes) of each prompt: tau and its standard error
    chunk = len(prompts) if args.continuous else batch_size  # prompts per generate call
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), chunk):
        o, s = generate(target, prompts[i:i + chunk], drafter, max_new_tokens=args.max_new_tokens, batch_size=batch_size,
                        temperature=temperature, top_k=args.top_k, seed=args.seed + i, K=max(K, 1))
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
    # alpha_i: of the passes that drafted position i, the share in which the first i drafts were
    # all accepted (cumulative; MTP's gate and ngram without a match draft fewer than K in some passes)
    st["alpha"] = [a / n for a, n in zip(st["acc"], st["att"]) if n > 0]
    return outs, st


def ratio_se(pairs):
    """Standard error of tau = sum(tokens) / sum(passes) over prompts, (tokens, passes) per
    prompt (the delta method for a ratio of sums): how far tau would move with another draw of
    as many prompts. With 10 prompts it is often a few tenths, more than many gaps between
    drafters in the table."""
    n, tokens, passes = len(pairs), sum(t for t, _ in pairs), sum(p for _, p in pairs)
    if n < 2:
        return 0.0
    tau = tokens / passes
    return math.sqrt(n / (n - 1) * sum((t - tau * p) ** 2 for t, p in pairs)) / passes


def measure(jobs, repeats, label):
    """Run every job (a callable returning run()'s outputs and stats) `repeats` times, in rounds
    of one run per job, and keep each job's run with the median wall time; its stats list all
    its wall times in wall_s_runs. Rounds rather than back-to-back repeats, so that a slow drift
    in the machine's speed (a job starting elsewhere, throttling) reaches every method alike.
    Bursts of outside load that come and go within seconds still move the medians (README,
    Troubleshooting)."""
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
    """DESIGN sec. 5's formula with measured instead of modelled costs. A draft-verify pass
    commits E = 1 + (accepted drafts) / (draft-verify passes) tokens per row on average (the
    bonus plus each accepted draft; a row pass that drafted nothing, as ngram's without a
    match, counts with its 1) and costs t_draft + t_verify (this method's measured draft and
    verify seconds per pass), while plain decoding commits 1 token per pass at t_ar (ar's wall
    seconds per pass). So
        predicted = E * t_ar / (t_draft + t_verify).
    E can exceed the measured tau, and so predicted the measured speedup: it leaves out the
    prefill passes, and counts the drafts a row's last pass accepts past its token budget, which
    are thrown away. At batch > 1 it also leaves out the passes in which finished rows ride
    along (E is per active row). The loop's own bookkeeping is small: outside draft and
    verify, 0.6-1.7 % of the wall time on a 2-core CPU (every method, T = 0 and 1).
    (The chart's 1 + sum alpha_i is E over the passes that drafted, higher where some did not.)"""
    E = 1 + sum(st["acc"]) / max(st["draft_row_passes"], 1)
    t_ar = ar["wall_s"] / ar["verify_passes"]
    return E * t_ar / ((st["draft_s"] + st["verify_s"]) / st["verify_passes"])


def params(drafter):
    return drafter.params() if hasattr(drafter, "params") else 0  # ar and ngram have none


def repeat8(outs):
    return statistics.mean(data.repeated_ngram_fraction(o, 8) for o in outs)


def lossless(outs, ar_outs, T):
    """{lossless, mismatches}: at T = 0 the outputs must equal plain decoding's token for token;
    sampled outputs differ by design (None: their losslessness is a distribution, see the tests)."""
    mism = sum(o != r for o, r in zip(outs, ar_outs)) if T == 0 else 0
    return dict(lossless=(mism == 0) if T == 0 else None, mismatches=mism)


def first_difference_gaps(target, prompts, outs, ar_outs):
    """For each greedy row that differs from plain decoding's, where it first differs: the gap
    between the target's logits for the two tokens, recomputed in one pass. A verify pass over
    several positions rounds differently from a one-token step, so a gap at the scale of that
    rounding is a near-tie either token could win; a wrong token shows a gap far above it
    (README, Troubleshooting: "lossless says NO")."""
    gaps = []
    for p, o, r in zip(prompts, outs, ar_outs):
        if o == r:
            continue
        t = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None)
        if t is None:  # one row stops before the other: no rounding does that, only a bug
            gaps.append(None)
            continue
        with torch.no_grad():
            logits = target(torch.tensor([p + r[:t]], device=target.head.weight.device))[0][0, -1].float()
        gaps.append(abs(logits[r[t]] - logits[o[t]]).item())
    return gaps


# -----------------------------------------------------------------------------
# report

def compare(outs, st, ar_outs, ar_st, T):
    """What a table row and a sweep entry both report of one run against ar's run."""
    return dict(tau=st["tau"], tau_se=st["tau_se"], tokens_per_s=st["new_tokens"] / st["wall_s"],
                speedup=ar_st["wall_s"] / st["wall_s"], wall_s=st["wall_s"], wall_s_runs=st["wall_s_runs"],
                **lossless(outs, ar_outs, T))


def cuda_ext_active(device):
    """Whether the hand-written CUDA extension serves this run (only ever on a GPU)."""
    import cuda
    return device.type == "cuda" and cuda.active_path(device)[0] == "extension"


def bars(alpha):
    """One column per draft position, eighth blocks: ' ' = 0 ... '█' = 1."""
    return "".join(" ▁▂▃▄▅▆▇█"[round(a * 8)] * 2 for a in alpha)


def svg(results, path):
    """Per-position acceptance (left) and tau vs measured speedup (right), as hand-written SVG."""
    colors = dict(ar="#777", ngram="#d62728", draft="#9467bd", mtp="#2ca02c", eagle="#ff7f0e", dflash="#1f77b4")
    W, H, P = 440, 320, 50  # panel size, padding
    kmax = max([len(r["acceptance_per_position"]) for r in results] + [2])
    tmax = math.ceil(max(r["tau"] for r in results) * 1.15)
    smax = math.ceil(max(max(r["speedup"] for r in results) * 1.15, 1.5) * 2) / 2
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H}" font-family="sans-serif" '
           'font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>']
    sx = lambda x0, v, vmax: x0 + P + v / vmax * (W - P - 20)    # data -> pixels
    sy = lambda v, vmax: H - P + 10 - v / vmax * (H - P - 40)

    def axes(x0, title, xlabel, ylabel, xmax, ymax, xticks, yticks):
        out.append(f'<text x="{x0 + W / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>')
        out.append(f'<path d="M{x0 + P},{sy(ymax, ymax):.1f} V{sy(0, ymax):.1f} H{x0 + W - 20}" stroke="black" '
                   'fill="none"/>')
        for v in xticks:
            out.append(f'<text x="{sx(x0, v, xmax):.1f}" y="{sy(0, ymax) + 14:.1f}" text-anchor="middle">{v:g}</text>')
        for v in yticks:
            out.append(f'<text x="{x0 + P - 5}" y="{sy(v, ymax) + 4:.1f}" text-anchor="end">{v:g}</text>')
        out.append(f'<text x="{x0 + W / 2}" y="{H - 6}" text-anchor="middle">{escape(xlabel)}</text>')
        out.append(f'<text x="{x0 + 12}" y="{H / 2}" transform="rotate(-90 {x0 + 12} {H / 2})" '
                   f'text-anchor="middle">{escape(ylabel)}</text>')

    axes(0, "acceptance per draft position", "draft position i", "alpha_i (first i drafts accepted)", kmax, 1,
         range(1, kmax + 1, max(1, kmax // 8)), [0, 0.25, 0.5, 0.75, 1])
    axes(W, "tau vs measured speedup", "tau (tokens per verify pass)", "speedup vs ar", tmax, smax,
         range(0, tmax + 1, max(1, tmax // 8)), [v / 2 for v in range(int(2 * smax) + 1)])
    out.append(f'<path d="M{W + P},{sy(1, smax):.1f} H{2 * W - 20}" stroke="#aaa" stroke-dasharray="4"/>')  # 1x
    for i, r in enumerate(results):
        c, label = colors.get(r["method"], "black"), f'{r["method"]} T={r["temperature"]:g}'
        dash = ' stroke-dasharray="5 3"' if r["temperature"] > 0 else ""  # dashed: sampling
        pts = " ".join(f"{sx(0, k + 1, kmax):.1f},{sy(a, 1):.1f}" for k, a in enumerate(r["acceptance_per_position"]))
        if pts:
            y = 34 + 13 * sum(bool(q["acceptance_per_position"]) for q in results[:i])
            out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.5"{dash}/>')
            out.append(f'<path d="M{W - 130},{y - 4} h20" stroke="{c}" stroke-width="1.5"{dash}/>'
                       f'<text x="{W - 105}" y="{y}" fill="{c}">{escape(label)}</text>')
        x, y = sx(W, r["tau"], tmax), sy(r["speedup"], smax)
        right = x > 2 * W - 90  # a label near the right edge goes to the left of its point
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{c}"/><text x="{x - 6 if right else x + 6:.1f}" '
                   f'y="{y - 5:.1f}" text-anchor="{"end" if right else "start"}" fill="{c}">{escape(label)}</text>')
    data.write_atomic(path, "\n".join(out + ["</svg>\n"]))


def trained_preset(target):
    """The preset the target was trained as (its checkpoint's args), which --preset need not be."""
    return (getattr(target, "ckpt", {}).get("args") or {}).get("preset", "unknown")


def print_card(args, device, dtype, target, target_path, drafters, Ks, source, n_prompts, repeats):
    print("\n" + "=" * 100)
    u = platform.uname()
    print(f"machine   {platform.processor() or u.machine} | {u.system} {u.release} | {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} torch threads")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device    {device} ({name}) | dtype {str(dtype).replace('torch.', '')} | torch {torch.__version__} | "
          f"CUDA extension active: {cuda_ext_active(device)}")
    print(f"target    preset {trained_preset(target)} | {target.n_params() / 1e6:.2f}M params | {target_path}")
    print("drafters  " + (" | ".join(f"{m} {params(d) / 1e6:.2f}M" for m, d in drafters.items() if d) or "none"))
    print(f"prompts   {n_prompts} from {source} | {args.max_new_tokens} new tokens each | temperatures "
          f"{args.temperatures} | top-k {args.top_k} | batch {args.batch_size}"
          f"{' (continuous)' if args.continuous else ''} | seed {args.seed}")
    # only what runs: mtp its depth or --mtp-draft, dflash its block - 1
    runs = ", ".join(f"{m} {Ks[m]}" + (f" (block {d.block_size})" if m == "dflash" else "")
                     for m, d in drafters.items() if d)
    print(f"drafts    {f'K per step: {runs}' if runs else 'none (ar only)'} | timing: median of {args.repeats} "
          "run(s) after a warm-up")
    for T, r in repeats.items():
        print(f"target    repeats {r:.1%} of its 8-grams at T={T:g} (plain decoding; real code ~2%)")
        if r > REPEAT_WARN:
            trust = "the T=1 rows" if any(t > 0 for t in repeats) else "sampled rows (--temperatures 0,1)"
            print(f"WARNING   the target loops at T={T:g} ({r:.0%} > {REPEAT_WARN:.0%}): tau will flatter every "
                  f"drafter there; trust {trust}")


def print_table(results, sweep, sizes, T0, n_prompts):
    """The table, the acceptance chart and the batch sweep (after the card)."""
    print(f"\n{'method':8s}{'T':>5s}{'K':>4s}{'tau':>7s}{'s.e.':>6s}{'tok/s':>9s}{'speedup':>9s}{'predicted':>11s}  "
          f"{'lossless':18s}{'params':>9s}")
    for r in results:
        ok = ("n/a" if r["lossless"] is None else "yes" if r["lossless"]
              else f"NO ({r['mismatches']}/{n_prompts} differ)")
        print(f"{r['method']:8s}{r['temperature']:5g}{r['K']:4d}{r['tau']:7.2f}{r['tau_se']:6.2f}"
              f"{r['tokens_per_s']:9.1f}{r['speedup']:8.2f}x{r['predicted_speedup']:10.2f}x  {ok:18s}"
              f"{r['drafter_params'] / 1e6:8.2f}M")
    for r in results:
        if r["first_difference_gaps"]:
            gaps = ", ".join("(ends early)" if g is None else f"{g:.2g}" for g in r["first_difference_gaps"])
            print(f"NOTE      {r['method']} T=0: where each differing row first differs, the target's logits for "
                  f"the two tokens are {gaps} apart (near-tie or wrong token: README, Troubleshooting)")
    print("\nacceptance per draft position (alpha_i: of the passes that drafted position i, the share whose "
          "first i drafts were all accepted; one column per position, full block = 1)")
    for r in results:
        a = r["acceptance_per_position"]
        if a:
            print(f"  {r['method']:7s} T={r['temperature']:<4g} |{bars(a)}| alpha_1 {a[0]:.2f} ... alpha_{len(a)} "
                  f"{a[-1]:.2f}, E = 1 + sum = {1 + sum(a):.2f}")
    if sweep:
        print(f"\nbatch sweep at T={T0:g} (tokens/s, speedup vs ar at the same batch size"
              + (", * = output differs from ar's)" if T0 == 0 else ")"))
        for bs in sizes:
            print(f"  batch {bs:3d}: " + " | ".join(f"{s['method']} {s['tokens_per_s']:.0f} tok/s {s['speedup']:.2f}x"
                                                 + ("*" if s["lossless"] is False else "")
                                                 for s in sweep if s["batch_size"] == bs))


# -----------------------------------------------------------------------------
# command line

def get_parser():
    p = argparse.ArgumentParser(description="Benchmark every speculative-decoding method on one target.")
    g = p.add_argument_group("what to run")
    g.add_argument("--methods", default=None, help=f"comma list of {','.join(METHODS)} (default: all that load or "
                   "train; ar always runs as the baseline)")
    g.add_argument("--temperatures", default="0,1", help="comma list; each method runs at each (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=1, help="rows decoded at once (default: %(default)s)")
    g.add_argument("--continuous", action="store_true", help="continuous batching: a row whose prompt is done takes "
                   "the next waiting prompt, instead of fixed batches that wait for their slowest row")
    g.add_argument("--batch-sizes", default=None, help="extra sweep of throughput over these batch sizes, e.g. 1,4,16 "
                   "(first temperature only)")
    g.add_argument("--K", type=int, default=7, help="draft length for ngram/draft/eagle (EAGLE-3's 7; 15 gives the "
                   "DFlash-16 budget); mtp drafts its depth or --mtp-draft (default: %(default)s)")
    add_drafter_flags(g)  # --block-size, --dflash-argmax, --mtp-draft, --mtp-margin (methods.py)
    g.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every method (default: %(default)s)")
    g.add_argument("--repeats", type=int, default=1,
                   help="timed runs per row, made in rounds over all rows; the median is reported (default: %(default)s)")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", default=None, help="file of prompts: JSON lines with a \"prompt\" string, or plain "
                   "text blocks separated by blank lines (default: the committed held-out prompts, "
                   "weights/heldout_prompts.jsonl, the same on every machine)")
    g.add_argument("--n-prompts", type=int, default=10, help="how many of the committed held-out prompts, at most "
                   f"{data.N_REFERENCE_PROMPTS} (ignored with --prompts); 10 keeps six "
                   "methods x two temperatures within 1-4 min on 2 cores with the committed weights (default: %(default)s)")
    g = p.add_argument_group("model and weights")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: 0 = torch's choice, "
                   "one per core); on a busy machine 1 runs several times faster (README, Troubleshooting)")
    g.add_argument("--preset", default=None, choices=list(PRESETS), help="model preset (default: gpu on cuda, else cpu); "
                   "a preset without committed weights (only cpu has them) trains its models first")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype (default: float32; "
                   "bfloat16 on cuda only); greedy output equals plain decoding's up to near-ties of the rounding's "
                   "size (~1e-5 in float32, ~0.1 in bfloat16; README, Troubleshooting)")
    g.add_argument("--weights", default=None, help="use the checkpoints in this folder (target.pt, draft.pt, mtp.pt, "
                   "eagle.pt, dflash.pt) and train nothing")
    g.add_argument("--target", default=None, help="with --weights: the target checkpoint, when it is not DIR/target.pt "
                   "(e.g. drafters trained by train_drafter.py for the committed weights/cpu/target.pt)")
    g.add_argument("--retrain", action="store_true", help="ignore the committed weights/<preset>; use OUT/<preset> "
                   "and train what is missing there (delete it to start over)")
    g.add_argument("--out", default="out", help="folder for trained checkpoints (default: %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the results as JSON here")
    g.add_argument("--plot", default=None, help="write an SVG chart here")
    return p


def check_args(args):
    """The flags that need no file or model, checked before any work (bad input ends in one
    line) -> temperatures, the sweep's batch sizes, the methods (ar first), and whether
    --methods named them (then each must run)."""
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
        sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else []
    except ValueError as e:
        die(f"--temperatures / --batch-sizes must be comma lists of numbers ({e})")
    temps, sizes = list(dict.fromkeys(temps)), list(dict.fromkeys(sizes))  # a repeat would print its rows twice
    if not all(t >= 0 for t in temps):  # NaN too
        die(f"--temperatures must be >= 0, got {args.temperatures}")
    lows = {"--batch-size": (args.batch_size, 1), "--repeats": (args.repeats, 1), "--K": (args.K, 1),
            "--block-size": (2 if args.block_size is None else args.block_size, 2),
            "--max-new-tokens": (args.max_new_tokens, 1),
            "--n-prompts": (args.n_prompts, 1), "--batch-sizes": (min(sizes, default=1), 1),
            "--top-k": (1 if args.top_k is None else args.top_k, 1),
            "--mtp-draft": (1 if args.mtp_draft is None else args.mtp_draft, 1), "--mtp-margin": (args.mtp_margin, 0),
            "--threads": (args.threads, 0)}
    for flag, (value, low) in lows.items():
        if not value >= low:  # NaN too
            die(f"{flag} must be >= {low}, got {value}")
    if args.top_k is not None and not any(t > 0 for t in temps):
        die("--top-k restricts sampling; every one of --temperatures decodes greedily")
    if args.weights and args.retrain:
        die("--weights DIR trains nothing; --retrain trains into --out: choose one")
    if args.target and not args.weights:
        die("--target names the target for the drafters in --weights DIR; without --weights, bench finds its own")
    if args.weights and os.path.isfile(args.weights):
        die(f"--weights names a folder of checkpoints, not a file ({args.weights}; --target FILE names the target)")
    named = args.methods is not None
    methods = [m.strip() for m in (",".join(METHODS) if args.methods is None else args.methods).split(",") if m.strip()]
    if named and not methods:
        die(f"--methods names no method; choose from {', '.join(METHODS)}")
    for m in methods:
        if m not in METHODS:
            die(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    try:
        drafter_options(args, get_parser(), methods)
    except ValueError as e:
        die(str(e))
    return temps, sizes, ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"], named


def load_methods(args, methods, named, device, dtype):
    """The target and each method's drafter, found or trained first (weights.py). A method
    that cannot run is skipped with its reason, unless --methods named it: then the run ends.
    -> target, its path, {method: drafter (None for ar)}, {method: draft length K}."""
    def skip(m, why):
        if named:
            die(f"{m} was asked for in --methods, but {why}")
        print(f"skipping {m}: {why}")

    try:
        target, target_path, found, skipped = weights.find_or_train(args, methods, device, dtype)
    except weights.Unusable as e:
        die(str(e))
    drafters = {}
    for m in methods:
        if m in weights.CKPT and m not in found:
            continue  # reason already in skipped
        try:
            drafters[m] = get_drafter(m, target, found.get(m), args)
        except (ValueError, ImportError, FileNotFoundError, AttributeError) as e:
            flag = {"dflash": ("--block-size", args.block_size), "mtp": ("--mtp-draft", args.mtp_draft)}.get(m)
            if isinstance(e, ValueError) and flag and flag[1] is not None:  # a block above dflash's training,
                die(f"{m}: {e} (see {flag[0]})")                           # more drafts than mtp's depth
            skipped.append((m, f"cannot load it ({type(e).__name__}: {e})"))  # e.g. a damaged draft.pt
    for m, why in skipped:
        skip(m, why)
    Ks = {m: 0 if d is None else (args.K if m in ("ngram", "draft", "eagle") else getattr(d, "default_K", args.K))
          for m, d in drafters.items()}
    return target, target_path, drafters, Ks


def main(argv=None):
    args = get_parser().parse_args(argv)
    temps, sizes, methods, named = check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.prompts:
            texts, source = data.read_prompts_file(args.prompts), args.prompts
        else:
            texts, source = data.reference_prompts(args.n_prompts), "held-out prompts (weights/heldout_prompts.jsonl)"
    except ValueError as e:
        die(str(e))
    rows = max([args.batch_size, *sizes])
    if rows > len(texts):  # the card and the sweep would name a batch that never ran
        die(f"a batch of {rows} rows needs at least {rows} prompts, and there are {len(texts)}"
            + (f" in {args.prompts}" if args.prompts else " (see --n-prompts)"))
    try:
        device = get_device(args.device)
    except ValueError as e:
        die(str(e))
    dtype = getattr(torch, args.dtype)
    if dtype != torch.float32 and device.type != "cuda":
        die("--dtype bfloat16 needs --device cuda")
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        die(f"--json and --plot name the same file {args.json}: the chart would replace the JSON")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):  # writable before the run, not after it
        try:
            if path:
                check_writable(path)
        except ValueError as e:
            die(f"{flag} {e}")
    follows = "gpu" if device.type == "cuda" else "cpu"  # the preset when --preset is not given
    if args.weights:  # --preset only says where to find or train a target; the card names this one's
        preset = "of the target given" + (f" (--preset {args.preset} unused with --weights)" if args.preset else "")
    else:
        preset = args.preset or follows + " (follows the device)"
    print(f"bench: device {device} ({'given' if args.device else 'auto-detected'}), preset {preset}, dtype {args.dtype}")
    args.preset = args.preset or follows

    enc = data.get_encoding()
    target, target_path, drafters, Ks = load_methods(args, methods, named, device, dtype)

    prompts = [enc.encode_ordinary(t) for t in texts]
    for i, (t, ids) in enumerate(zip(texts, prompts), 1):
        if len(ids) + args.max_new_tokens + max(Ks.values()) + 1 > target.cfg.max_seq_len:
            die(f"prompt {i} of {source} ({t[:40]!r}...) has {len(ids)} tokens; with {args.max_new_tokens} new "
                f"tokens and {max(Ks.values()) + 1} verify positions it exceeds the target's context of "
                f"{target.cfg.max_seq_len}")

    results = []
    try:
        for m, d in drafters.items():
            for T in temps:  # warm-up, untimed: first-call allocations, lazy CUDA init
                generate(target, prompts[:args.batch_size], d, max_new_tokens=4, temperature=T, top_k=args.top_k,
                         seed=0, K=max(Ks[m], 1))
        table = measure({(m, T): partial(run, target, d, prompts, Ks[m], T, args, args.batch_size)
                         for m, d in drafters.items() for T in temps}, args.repeats, lambda k: f"{k[0]:7s} T={k[1]:g}")
        sweep = []
        for bs in sizes:
            timed = measure({m: partial(run, target, d, prompts, Ks[m], temps[0], args, bs) for m, d in drafters.items()},
                            args.repeats, lambda m: f"sweep batch {bs:3d} {m:7s}")
            ar_out, ar_st = timed["ar"]  # the baseline for speed and, at T = 0, for the tokens
            for m, (o, st) in timed.items():
                sweep.append(dict(method=m, batch_size=bs, temperature=temps[0],
                                  **compare(o, st, ar_out, ar_st, temps[0])))
    except ValueError as e:  # generate's own checks (e.g. context length)
        die(str(e))

    for m, d in drafters.items():
        for T in temps:
            (o, st), (ar_o, ar) = table[m, T], table["ar", T]
            results.append(dict(method=m, temperature=T, **compare(o, st, ar_o, ar, T),
                                predicted_speedup=predicted_speedup(st, ar), acceptance_per_position=st["alpha"],
                                new_tokens=st["new_tokens"], verify_passes=st["verify_passes"],
                                drafter_params=params(d), repeat8=repeat8(o), K=Ks[m],
                                first_difference_gaps=first_difference_gaps(target, prompts, o, ar_o) if T == 0 else []))

    print_card(args, device, dtype, target, target_path, drafters, Ks, source, len(prompts),
               {T: repeat8(table["ar", T][0]) for T in temps})
    print_table(results, sweep, sizes, temps[0], len(prompts))
    if args.json:
        report = dict(config=vars(args), machine=dict(device=str(device), torch=torch.__version__,
                                                      cuda_ext=cuda_ext_active(device)),
                      target=dict(path=target_path, preset=trained_preset(target), params=target.n_params()),
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
    except KeyboardInterrupt:  # checkpoints, JSON and SVG are all written temp-then-rename
        print("\ninterrupted: nothing half-written was left behind, and the same command continues any "
              "training it was doing (target, distillation, drafters) from its last save, if it made one "
              "(every few minutes: train.py --save-minutes)", file=sys.stderr)
        sys.exit(130)
