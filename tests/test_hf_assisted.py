"""
dev/hf_assisted.py on one prompt and 8 new tokens: every row, transformers' and ours, decodes the
same greedy tokens as our plain decoding, makes the whole budget, and the script exits 0. A smoke
test of the comparison, not a benchmark (skipped without transformers).

    python -m pytest -q tests/test_hf_assisted.py
"""

import json

import pytest

pytest.importorskip("transformers")


def test_every_row_decodes_our_plain_tokens(tmp_path, run_script):
    out = tmp_path / "hf_assisted.json"
    rc, stdout, err = run_script("dev/hf_assisted.py", "--n-prompts", "1", "--max-new-tokens", "8",
                                 "--json", str(out))
    assert rc == 0, stdout + err
    rows = json.loads(out.read_text())["results"]
    assert {(r["engine"], r["method"]) for r in rows} >= {
        ("transformers", "greedy"), ("transformers", "assisted"), ("ours", "ar"), ("ours", "draft")}
    for r in rows:
        assert r["same_tokens"] and r["new_tokens"] == 8, r
        assert r["tau"] >= 1 and r["tokens_per_s"] > 0, r
