"""
One setting swept in one process, one table: plain decoding (ar), then one method at each
value of one of its options (load_drafter's keywords, or K, the drafts per step), and any
--also methods at their flags' settings. Or the batch size (batch_size, the rows decoded at
once): then ar, the method and the --also methods all run at each batch size, and each speedup
is over ar at the same batch size. Rows are timed as bench.py times its own (its run and
bench_rows: warm-up, median of --repeats, the same prompts and seeds); every bench.py flag
applies, --continuous too. Per row: tau, tok/s, speedup over ar at that temperature, lossless.

    python dev/sweep.py --method draft --option confidence=0,0.2,0.4,0.6
    python dev/sweep.py --method dflash-tree --option tree_nodes=8,16,32,64,128 --also dflash
    python dev/sweep.py --method eagle --option K=1,3,5,7 --json out/sweep.json
    python dev/sweep.py --method dflash --also ngram,mtp,eagle --option batch_size=1,4,16
    python dev/plot.py out/sweep.json out/sweep.svg     # the JSON is bench's, so it charts
"""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a file (python dev/sweep.py)
    sys.path.insert(0, ROOT)
import bench
import data
from bench import checked, die
from checkpoint import (DRAFTER_FLAGS, drafter_options, get_device, load_drafter, load_target,
                        load_tokenizer)

# the options a sweep can take: load_drafter's keywords that have a type, K and the batch size
OPTIONS = {**{kw["dest"]: kw["type"] for _, kw in DRAFTER_FLAGS.values() if "type" in kw},
           "K": int, "batch_size": int}


def get_parser():
    p = bench.get_parser()  # every flag of bench.py; --methods is --method and --also here
    p.description = __doc__
    g = p.add_argument_group("the sweep")
    g.add_argument("--method", required=True, help="the method whose option is swept")
    g.add_argument("--option", required=True,
                   help=f"NAME=V1,V2,...: NAME one of {', '.join(OPTIONS)}")
    g.add_argument("--also", default="", help="comma list of methods run beside, unswept")
    return p


def parse_option(args, parser):
    """--option NAME=V1,V2 -> NAME, [values] (each once), each checked as its flag would be."""
    name, _, text = args.option.partition("=")
    if name not in OPTIONS or not text:
        die(f"--option takes NAME=V1,V2,... with NAME one of {', '.join(OPTIONS)}")
    values = checked(lambda: [*dict.fromkeys(OPTIONS[name](v) for v in text.split(","))],
                     flag="--option ")
    if name == "K":
        if args.method == "ar" or min(values) < 1:
            die("--option K: drafts per step are >= 1, and ar drafts none")
        return name, values
    if name == "batch_size":
        if min(values) < 1 or args.batch_size != 1:
            die("--option batch_size: rows decoded at once are >= 1, and it replaces --batch-size")
        return name, values
    # each value alone on the swept method, the other drafter flags at their defaults: the
    # flag's own checks (its range; refused where the method does not use it)
    base = {kw["dest"]: parser.get_default(kw["dest"]) for _, kw in DRAFTER_FLAGS.values()}
    for v in values:
        probe = type(args)(**{**vars(args), **base, name: v})
        checked(drafter_options, probe, parser, [args.method], flag="--option ")
    return name, values


def default_K(m, d, args):  # as bench.py: its --K for ngram, draft and eagle, else the drafter's
    return 0 if d is None else args.K if m in ("ngram", "draft", "eagle") else \
        getattr(d, "default_K", args.K)


def main(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.methods:
        die("a sweep takes --method and --also, not --methods")
    also = [m.strip() for m in args.also.split(",") if m.strip()]
    args.methods = ",".join([args.method] + also)
    args.weights = args.weights or os.path.dirname(args.target) or "."
    temps, methods, _ = bench.check_args(args)  # bench's checks of every flag
    name, values = parse_option(args, parser)
    batch = name == "batch_size"  # every method at each batch size, against ar at that size
    sizes = values if batch else [args.batch_size]
    torch.set_num_threads(args.threads or torch.get_num_threads())
    texts = (checked(data.read_prompts_file, args.prompts)[:args.n_prompts] if args.prompts
             else checked(data.reference_prompts, args.n_prompts or 10))  # as bench.py
    if max(sizes) > len(texts):  # else a batch that never ran
        die(f"a batch of {max(sizes)} rows needs at least as many prompts ({len(texts)})")
    device, dtype = checked(get_device, args.device), getattr(torch, args.dtype)
    args.compile = device.type == "cuda" if args.compile is None else args.compile  # as bench
    if args.json:
        checked(data.check_writable, args.json, flag="--json ")
    target = checked(load_target, args.target, device=device, dtype=dtype)
    opts = drafter_options(args, parser, methods)
    plain = dict.fromkeys(["ar"] + ([args.method] if batch else []) + also)  # run unswept
    drafters = {m: checked(load_drafter, m, target, args.weights, **opts, flag=f"{m}: ")
                for m in plain}
    Ks = {m: default_K(m, d, args) for m, d in drafters.items()}
    labels = {}  # row label -> the swept value (a batch size labels the rows as they run)
    for v in [] if batch else values:
        label = f"{args.method} {name}={v:g}"
        kw = {**opts, **({} if name == "K" else {name: v})}
        drafters[label] = d = checked(load_drafter, args.method, target, args.weights, **kw,
                                      flag=f"{args.method}: ")
        Ks[label], labels[label] = v if name == "K" else default_K(args.method, d, args), v
    enc = checked(load_tokenizer, args.target)  # as bench: once
    prompts = [enc.encode_ordinary(t) for t in texts]
    print(f"sweep: {args.method} {name} over {values} beside {', '.join(['ar'] + also)} | device "
          f"{device} {args.dtype} | {len(prompts)} prompts x {args.max_new_tokens} new tokens | "
          f"batch {','.join(map(str, sizes))}{' (continuous)' if args.continuous else ''} | "
          f"temperatures {args.temperatures} | seed {args.seed} | median of {args.repeats}")
    rows = []
    try:
        for bs in sizes:  # bench_rows warms up at each batch size first
            for r in bench.bench_rows(target, drafters, Ks, prompts, temps, bs, args):
                if batch:  # ar's row at this size too: speedup and lossless are against it
                    r.update(method=f"{r['method']} batch_size={bs}", option={name: bs})
                elif r["method"] in labels:
                    r["option"] = {name: labels[r["method"]]}
                rows.append(r)
    except ValueError as e:  # generate's own checks
        die(str(e))
    rows.sort(key=lambda r: r["temperature"])  # each temperature's rows together, ar first
    width = max(len(r["method"]) for r in rows) + 2
    note = "\nspeedup and lossless: each row against ar at the same batch size" if batch else ""
    print(f"{note}\n{'row':{width}s}{'T':>5s}{'K':>4s}{'tau':>7s}{'tok/s':>9s}{'speedup':>9s}"
          "  lossless")
    for r in rows:
        ok = "n/a" if r["lossless"] is None else "yes" if r["lossless"] else "NO"
        print(f"{r['method']:{width}s}{r['temperature']:5g}{r['K']:4d}{r['tau']:7.2f}"
              f"{r['tokens_per_s']:9.1f}{r['speedup']:8.2f}x  {ok}")
    if args.json:  # bench's format, so that dev/plot.py charts it
        report = dict(config=vars(args), machine=dict(device=str(device), torch=torch.__version__),
                      results=rows)
        data.write_atomic(args.json, json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
