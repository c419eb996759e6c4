"""
dev/plot.py, the SVG chart of bench.py's --json output: a bench run on tiny random checkpoints
charted end to end (well-formed, a point per row), points on their axis ticks, and one-line
errors for a file that is not bench's JSON.

    python -m pytest -q tests/test_plot.py
"""

import json
import re
import xml.etree.ElementTree as ET

import pytest

import bench
from dev import plot
from test_model import save_tiny

NS = "{http://www.w3.org/2000/svg}"


def test_a_bench_json_charts_as_well_formed_svg(tmp_path, capsys):
    save_tiny(tmp_path / "target.pt", seed=0)
    save_tiny(tmp_path / "draft.pt", seed=1, n_layer=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def parse(line):\\n    "}\n{"prompt": "class Cache:\\n    def __init__(self"}\n')
    js, svg = tmp_path / "bench.json", tmp_path / "out" / "bench.svg"
    rows = bench.main(["--target", str(tmp_path / "target.pt"), "--methods", "ar,ngram,draft", "--temperatures",
                       "0,1", "--prompts", str(prompts), "--max-new-tokens", "12", "--K", "3", "--json", str(js)])
    plot.main([str(js), str(svg)])
    assert capsys.readouterr().out.endswith(f"wrote {svg}\n")
    root = ET.parse(svg).getroot()  # well-formed XML
    assert root.tag.endswith("svg") and len(root.findall(f".//{NS}circle")) == len(rows) == 6
    # one acceptance line per row that drafted (ngram may find no match on a random target)
    assert len(root.findall(f".//{NS}polyline")) == sum(bool(r["acceptance_per_position"]) for r in rows)


def _ticks(root, panel):
    """{label: x} of the x-axis ticks and {label: y of the value} of the y-axis ticks of one
    panel (0 left, 1 right): numeric texts, centred below the axis or right-aligned beside it."""
    xt, yt = {}, {}
    for t in root.iter(NS + "text"):
        x, y, s = float(t.get("x")), float(t.get("y")), t.text
        if (x >= plot.W) != bool(panel) or not re.fullmatch(r"[\d.]+", s or ""):
            continue
        if t.get("text-anchor") == "middle":
            xt[s] = x
        elif t.get("text-anchor") == "end":
            yt[s] = y - 4  # the label sits 4 px below its value's height
    return xt, yt


def test_svg_points_sit_on_their_axis_ticks(tmp_path):
    """Each acceptance point is drawn above the tick of its draft position, at the height of its
    alpha's tick; each method's point in the right panel above its tau's tick, at its measured
    speedup's tick. The end-to-end test checks only that the SVG parses."""
    results = [dict(method="draft", temperature=0.0, acceptance_per_position=[1.0, 0.5, 0.25], tau=2.0, speedup=1.5,
                    predicted_speedup=3.0),
               dict(method="ar", temperature=0.0, acceptance_per_position=[], tau=1.0, speedup=1.0,
                    predicted_speedup=1.0)]
    path = tmp_path / "b.svg"
    plot.svg(results, path)
    root = ET.parse(path).getroot()
    xt, yt = _ticks(root, 0)
    (line,) = root.iter(NS + "polyline")
    pts = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert len(pts) == 3
    for i, (a, (x, y)) in enumerate(zip([1.0, 0.5, 0.25], pts), 1):
        assert x == pytest.approx(xt[str(i)], abs=0.1), i
        assert y == pytest.approx(yt[f"{a:g}"], abs=0.1), i
    xt, yt = _ticks(root, 1)
    circles = [(float(c.get("cx")), float(c.get("cy"))) for c in root.iter(NS + "circle")]
    assert len(circles) == 2
    for r, (cx, cy) in zip(results, circles):
        assert cx == pytest.approx(xt[f"{r['tau']:g}"], abs=0.1), r["method"]
        assert cy == pytest.approx(yt[f"{r['speedup']:g}"], abs=0.1), r["method"]


def test_a_file_that_is_not_benchs_json_is_one_line(tmp_path, capsys):
    (tmp_path / "junk.json").write_text("not json")
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "empty.json").write_text(json.dumps({"results": []}))
    for src, dst, expect in [(tmp_path / "missing.json", tmp_path / "a.svg", "not a bench.py --json output"),
                             (tmp_path / "junk.json", tmp_path / "a.svg", "not a bench.py --json output"),
                             (tmp_path / "other.json", tmp_path / "a.svg", "KeyError"),
                             (tmp_path / "empty.json", tmp_path / "a.svg", "holds no results"),
                             (tmp_path / "empty.json", tmp_path / "empty.json", "is the JSON to chart")]:
        with pytest.raises(SystemExit) as e:
            plot.main([str(src), str(dst)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and expect in err and err.count("\n") == 1, err
    assert not (tmp_path / "a.svg").exists() and json.loads((tmp_path / "empty.json").read_text()) == {"results": []}


def test_only_sampled_rows_are_dashed(tmp_path):
    """Dashed lines mean T > 0 (sampling); the greedy row's line is solid."""
    results = [dict(method=m, temperature=T, acceptance_per_position=[0.5], tau=1.5, speedup=1.2)
               for m, T in (("draft", 0.0), ("draft", 1.0))]
    plot.svg(results, tmp_path / "b.svg")
    lines = ET.parse(tmp_path / "b.svg").getroot().findall(f".//{NS}polyline")
    assert [line.get("stroke-dasharray") for line in lines] == [None, "5 3"]
