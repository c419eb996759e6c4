"""
The chart of a bench.py run, from its --json output: acceptance per draft position (left) and
tau against measured speedup (right), one colour per method, dashed lines for T > 0. Written
as SVG by hand, so that neither bench.py nor this needs a plotting library.

    python bench.py --json out/bench.json
    python dev/plot.py out/bench.json docs/bench_cpu.svg
"""

import argparse
import json
import math
import os
import sys
from xml.sax.saxutils import escape

COLORS = dict(ar="#777", ngram="#d62728", draft="#9467bd", mtp="#2ca02c", eagle="#ff7f0e",
              dflash="#1f77b4")
W, H, P = 440, 320, 50  # one panel's width and height, the padding around its axes


def svg(results, path):
    """bench's result rows (method, temperature, tau, speedup, acceptance_per_position) -> an
    SVG file at path, written temp-then-rename."""
    path = os.fspath(path)
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
        c, label = COLORS.get(r["method"], "black"), f'{r["method"]} T={r["temperature"]:g}'
        dash = ' stroke-dasharray="5 3"' if r["temperature"] > 0 else ""  # dashed: sampling
        pts = " ".join(f"{sx(0, k + 1, kmax):.1f},{sy(a, 1):.1f}"
                       for k, a in enumerate(r["acceptance_per_position"]))
        if pts:  # ar drafts nothing: a point on the right only
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(out + ["</svg>\n"]))
    os.replace(path + ".tmp", path)


def die(msg):  # bad input: one line on stderr, exit code 2, as bench.py's
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="bench.py's --json output")
    p.add_argument("svg", help="where to write the chart")
    args = p.parse_args(argv)
    if os.path.abspath(args.json) == os.path.abspath(args.svg):
        die(f"{args.svg} is the JSON to chart; name another file")
    try:
        with open(args.json) as f:
            results = json.load(f)["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"{args.json}: not a bench.py --json output ({type(e).__name__}: {e})")
    if not results:
        die(f"{args.json} holds no results")
    svg(results, args.svg)
    print(f"wrote {args.svg}")


if __name__ == "__main__":
    main()
