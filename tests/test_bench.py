"""
bench.py end to end on tiny random checkpoints (seconds on 2 cores): the JSON schema, ar's
tau, the greedy lossless check; which weights it loads and what it says of a drafter it cannot
run; and the one-line errors for bad input. At the end, dev/sweep.py's batch sweep (--option
batch_size), which was bench's. The SVG chart of its JSON: tests/test_plot.py.

    python -m pytest -q tests/test_bench.py
"""

import argparse
import os
import json
import re
from types import SimpleNamespace

import pytest
import torch

import bench
import data
import speculate
from checkpoint import load_target, save_checkpoint, weights_hash
from dev import hf_export, sweep
from test_model import save_tiny, tiny_model

RESULT_KEYS = {"method": str, "temperature": float, "tau": float, "tau_se": float, "tokens_per_s": float,
               "speedup": float, "predicted_speedup": float, "acceptance_per_position": list, "lossless": (bool, type(None)),
               "mismatches": int, "new_tokens": int, "verify_passes": int, "wall_s": float, "wall_s_runs": list,
               "drafter_params": int, "step_ms": dict}
EXTRA_KEYS = {"repeat8", "K", "first_difference_gaps"}  # the issue allows extra keys


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    save_tiny(d / "target.pt", seed=0)
    save_tiny(d / "draft.pt", seed=1, n_layer=1)
    return d


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    p.write_text('{"prompt": "def parse(line):\\n    "}\n{"prompt": "class Cache:\\n    def __init__(self"}\n')
    return p


def test_smoke_json(weights, prompts_file, tmp_path, capsys):
    js = tmp_path / "bench.json"
    bench.main(["--target", str(weights / "target.pt"), "--methods", "ar,ngram,draft", "--temperatures", "0,1",
                "--prompts", str(prompts_file), "--max-new-tokens", "12", "--K", "3", "--json", str(js)])
    out = capsys.readouterr().out
    assert "machine" in out and "acceptance per draft position" in out
    report = json.loads(js.read_text())
    assert set(report) == {"config", "machine", "target", "results"}
    assert report["target"]["path"] == str(weights / "target.pt") and report["target"]["params"] > 0
    assert report["config"]["methods"] == "ar,ngram,draft" and report["config"]["max_new_tokens"] == 12
    assert set(report["machine"]) == {"device", "torch", "cuda_ext"}
    assert isinstance(report["machine"]["device"], str) and isinstance(report["machine"]["cuda_ext"], bool)
    rows = report["results"]
    assert [(r["method"], r["temperature"]) for r in rows] == [(m, t) for m in ("ar", "ngram", "draft") for t in (0.0, 1.0)]
    for r in rows:
        assert set(RESULT_KEYS) <= set(r) <= set(RESULT_KEYS) | EXTRA_KEYS
        for k, typ in RESULT_KEYS.items():
            assert isinstance(r[k], typ), (k, r[k])
        assert all(isinstance(a, float) and 0 <= a <= 1 for a in r["acceptance_per_position"])
        assert r["new_tokens"] == 2 * 12
        assert r["wall_s_runs"] == [r["wall_s"]]  # --repeats 1: the one run is the median
        if r["temperature"] == 0:
            assert r["lossless"] is True and r["mismatches"] == 0  # speculative == plain greedy, fp32
        else:
            assert r["lossless"] is None
        if r["method"] == "ar":
            assert r["tau"] == 1.0 and r["speedup"] == 1.0 and r["acceptance_per_position"] == []
            assert r["tau_se"] == 0.0  # every prompt has tau exactly 1
        else:  # ngram drafts nothing where it finds no match, and may find none on a random target
            assert len(r["acceptance_per_position"]) in ((0, 3) if r["method"] == "ngram" else (3,))
        # speedup is ar's wall time over this row's, at the same temperature; tok/s agrees with it
        ar = next(a for a in rows if a["method"] == "ar" and a["temperature"] == r["temperature"])
        assert r["speedup"] == pytest.approx(ar["wall_s"] / r["wall_s"])
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"])
        # where the time went: the loop's parts cover the run, bench's own calls between them aside
        ms = r["step_ms"]
        assert set(ms) == {"draft", "verify", "rest"} and min(ms.values()) >= 0
        assert 0.5 < sum(ms.values()) * r["verify_passes"] / 1e3 / r["wall_s"] <= 1.0
        assert (ms["draft"] == 0) == (r["method"] == "ar") and ms["verify"] > 0


def test_n_prompts_takes_the_first_of_a_prompts_file(weights, prompts_file, capsys):
    """--n-prompts 1 runs the file's first prompt only (a file's default is all of it)."""
    args = ["--target", str(weights / "target.pt"), "--methods", "ar", "--temperatures", "0",
            "--prompts", str(prompts_file), "--max-new-tokens", "3"]
    for extra, n in (([], 2), (["--n-prompts", "1"], 1)):
        rows = bench.main(args + extra)
        assert rows[0]["new_tokens"] == 3 * n
        assert f"prompts   {n} from {prompts_file}" in capsys.readouterr().out


def test_compile_runs_every_row_lossless_and_the_card_says_so(weights, prompts_file, capsys):
    """--compile (off by default on a CPU): the verify passes run compiled (inductor here), the
    T = 0 rows still equal plain decoding's, and the card names the path that ran. Each
    method's warm-up, which compiles, prints its time as it ends (eager, nothing)."""
    rows = bench.main(["--target", str(weights / "target.pt"), "--methods", "ar,ngram",
                       "--temperatures", "0", "--prompts", str(prompts_file), "--max-new-tokens",
                       "8", "--compile"])
    assert all(r["lossless"] for r in rows)
    out = capsys.readouterr().out
    assert "compiled steps: True" in out
    assert re.search(r"^ar +T=0 +batch +1: compiled in \d+\.\d s$", out, flags=re.M), out
    assert re.search(r"^ngram +T=0 +batch +1: compiled in", out, flags=re.M), out
    bench.main(["--target", str(weights / "target.pt"), "--methods", "ar", "--temperatures", "0",
                "--prompts", str(prompts_file), "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert "compiled steps: False" in out and "compiled in" not in out


def test_continuous_batching_gives_the_same_greedy_rows(weights, prompts_file, capsys):
    """One row taking the two prompts in turn decodes each as the fixed batches of one do: the
    same tokens (lossless against ar), tau and target passes (a refill is a prefill)."""
    argv = ["--target", str(weights / "target.pt"), "--methods", "ar,ngram,draft", "--temperatures", "0",
            "--prompts", str(prompts_file), "--max-new-tokens", "12", "--K", "3"]
    fixed = bench.main(argv)
    cont = bench.main(argv + ["--continuous"])
    assert "batch 1 (continuous)" in capsys.readouterr().out
    for a, b in zip(fixed, cont):
        assert b["lossless"] is True and b["new_tokens"] == 2 * 12
        assert (a["method"], a["tau"], a["verify_passes"]) == (b["method"], b["tau"], b["verify_passes"])


def test_default_prompts_are_the_committed_ones_not_this_machines_corpus(weights, monkeypatch, capsys):
    monkeypatch.setattr(data, "read_texts", lambda *a, **k: pytest.fail("read this machine's corpus"))
    bench.main(["--target", str(weights / "target.pt"), "--methods", "ar", "--temperatures", "0",
                "--n-prompts", "2", "--max-new-tokens", "4"])
    assert "prompts   2 from held-out prompts (weights/heldout_prompts.jsonl)" in capsys.readouterr().out


def test_threads_sets_torchs_thread_count(weights, capsys):
    try:  # the suite runs on one thread (conftest.py); 2 shows that the flag took effect
        bench.main(["--target", str(weights / "target.pt"), "--methods", "ar", "--temperatures", "0",
                    "--n-prompts", "1", "--max-new-tokens", "2", "--threads", "2"])
        assert torch.get_num_threads() == 2 and ", 2 torch threads" in capsys.readouterr().out
    finally:
        torch.set_num_threads(1)


def test_the_card_and_json_name_the_preset_the_target_was_trained_as(weights, tmp_path, capsys):
    bench.main(["--target", str(weights / "target.pt"), "--methods", "ar", "--temperatures", "0",
                "--n-prompts", "1", "--max-new-tokens", "2", "--json", str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert "target    preset tiny | " in out
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["target"]["preset"] == "tiny" and "preset" not in report["config"]


def test_bad_prompts_file_names_the_line(weights, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "def f():"}\n{"prompt": 3}\n')
    for path, expect in [(bad, f"{bad}:2:"), (tmp_path / "missing.jsonl", "cannot read"), (tmp_path / "empty.txt", "empty")]:
        if path.name == "empty.txt":
            path.write_text("\n\n")
        with pytest.raises(SystemExit) as e:
            bench.main(["--target", str(weights / "target.pt"), "--prompts", str(path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert expect in err and err.count("\n") == 1 and "Traceback" not in err


def test_unknown_method_missing_drafter_too_long_prompt(weights, prompts_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--weights", str(weights), "--methods", "ar,medusa"])
    assert e.value.code == 2 and "unknown method 'medusa'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.main(["--weights", str(weights), "--device", "cuda:99"])
    assert e.value.code == 2 and "cuda:99" in capsys.readouterr().err
    # a method asked for by name whose checkpoint is missing is an error, not a silent skip
    with pytest.raises(SystemExit) as e:
        bench.main(["--target", str(weights / "target.pt"), "--methods", "ar,eagle", "--prompts", str(prompts_file)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: eagle was asked for in --methods, but ")
    assert err.endswith(f"; train it: python train_drafter.py --method eagle --target {weights / 'target.pt'} "
                        f"--out-dir {weights}\n") and err.count("\n") == 1, err
    # another target against the committed drafters: the hint never writes into weights/
    with pytest.raises(SystemExit) as e:
        bench.main(["--target", str(weights / "target.pt"), "--weights", data.REF_WEIGHTS,
                    "--methods", "ar,eagle", "--prompts", str(prompts_file)])
    assert f"--out-dir {os.path.join(data.DATA_OUT, 'cpu', 'weights')}\n" in capsys.readouterr().err
    long = tmp_path / "long.txt"
    long.write_text("def f():\n    pass\n\n" + "x = 1\n" * 300)
    with pytest.raises(SystemExit) as e:
        bench.main(["--target", str(weights / "target.pt"), "--methods", "ar", "--prompts", str(long)])
    assert e.value.code == 2 and "prompt 2" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expect", [
    (["--n-prompts", "0"], "--n-prompts must be >= 1, got 0"),
    (["--n-prompts", str(data.N_REFERENCE_PROMPTS + 1)], f"holds {data.N_REFERENCE_PROMPTS} prompts"),
    (["--prompts", "no/such/file.jsonl"], "cannot read"),
    (["--block-size", "1"], "--block-size must be >= 2, got 1"),
    (["--block-size", "0"], "--block-size must be >= 2, got 0"),
    (["--mtp-draft", "0"], "--mtp-draft must be >= 1, got 0"),
    (["--tree", "0"], "--tree must be >= 1, got 0"),
    (["--methods", ""], "--methods names no method"),
    (["--K", "0"], "--K must be >= 1, got 0"),
    (["--threads", "-1"], "--threads must be >= 0, got -1"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--temperatures", "0,-1"], "--temperatures must be >= 0 and finite, got 0,-1"),
    (["--temperatures", "nan"], "--temperatures must be >= 0 and finite, got nan"),
    (["--temperatures", "0,inf"], "--temperatures must be >= 0 and finite, got 0,inf"),
    (["--threads", "100000"], "--threads must be <= the "),
    (["--temperatures", "0,hot"], "--temperatures must be a comma list of numbers"),
    (["--methods", "ar,eagle", "--block-size", "8"], "--block-size sets an option of dflash/dflash-tree, which"),
    (["--methods", "dflash-tree", "--dflash-argmax"], "--dflash-argmax sets an option of dflash, which"),
    (["--methods", "dflash-tree", "--confidence", "0.5"], "--confidence sets an option of draft/mtp/eagle/dflash,"),
    (["--methods", "dflash", "--mtp-draft", "1"], "--mtp-draft sets an option of mtp, which is not being run"),
    (["--methods", "dflash", "--tree", "8"], "--tree sets an option of dflash-tree, which is not being run"),
    (["--weights", os.path.join(data.REF_WEIGHTS, "target.pt")],
     "--weights names a folder of checkpoints, not a file"),
    (["--batch-size", "11"], "a batch of 11 rows needs at least 11 prompts, and there are 10 (see --n-prompts)"),
    (["--n-prompts", "3", "--batch-size", "4"], "a batch of 4 rows needs at least 4 prompts, and there are 3")])
def test_a_bad_flag_is_refused_before_any_work(flags, expect, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    out = capsys.readouterr()
    assert e.value.code == 2 and expect in out.err and out.out == ""  # nothing loaded before the check


def test_a_repeated_temperature_runs_once():
    """--temperatures 0,0 printed each row twice (methods were already taken once each)."""
    args = bench.get_parser().parse_args(["--temperatures", "0,1,0.0", "--methods", "ngram,ar,ngram"])
    assert bench.check_args(args)[:2] == ([0.0, 1.0], ["ar", "ngram"])


def test_K_is_spelled_as_sample_py_spells_it():
    """sample.py takes -K; bench.py took only --K, so the README's -K failed here."""
    parse = bench.get_parser().parse_args
    assert parse(["-K", "3"]).K == parse(["--K", "3"]).K == 3


def test_an_unwritable_json_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "file").touch()
    for path, expect in [(tmp_path / "file" / "bench.json", "cannot write there"),
                         (tmp_path / "file" / "sub" / "bench.json", "cannot write there"),
                         (tmp_path, "is a folder")]:
        with pytest.raises(SystemExit) as e:
            bench.main(["--json", str(path)])
        out = capsys.readouterr()
        assert e.value.code == 2 and f"--json {path}: {expect}" in out.err and out.out == ""
    # a run refused for its device or dtype creates no output folder
    for flags, expect in [(["--device", "cuda:99"], "cuda:99"), (["--dtype", "bfloat16", "--device", "cpu"], "needs")]:
        with pytest.raises(SystemExit) as e:
            bench.main(flags + ["--json", str(tmp_path / "new" / "bench.json")])
        out = capsys.readouterr()
        assert e.value.code == 2 and expect in out.err and out.out == "" and not (tmp_path / "new").exists()


def test_lossless_column_catches_a_broken_verifier(weights, prompts_file, tmp_path, monkeypatch, capsys):
    # a verifier that accepts every draft is fast and wrong: the table must say so (the batch sweep: below)
    def accept_all(p, drafts, q=None, uniforms=None):
        n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        return n, p[:, -1].argmax(-1)
    monkeypatch.setattr(speculate, "accept_scan", accept_all)
    js = tmp_path / "bench.json"
    bench.main(["--target", str(weights / "target.pt"), "--methods", "ar,draft", "--temperatures", "0",
                "--prompts", str(prompts_file), "--max-new-tokens", "12", "--K", "3", "--json", str(js)])
    out = capsys.readouterr().out
    report = json.loads(js.read_text())
    draft = report["results"][1]
    assert draft["method"] == "draft"
    assert draft["lossless"] is False and draft["mismatches"] > 0 and "NO (" in out
    assert len(draft["first_difference_gaps"]) == draft["mismatches"] and "NOTE      draft T=0" in out
    assert report["results"][0]["first_difference_gaps"] == []  # ar against itself


def test_first_difference_gap_is_the_targets_margin_where_the_rows_part():
    target = tiny_model()
    prompts = [[5, 6, 7], [8, 9]]
    ar_outs, _ = speculate.generate(target, prompts, None, max_new_tokens=6)
    with torch.no_grad():
        logits = target(torch.tensor([prompts[1] + ar_outs[1][:3]]))[0][0, -1]
    top2 = logits.topk(2)
    outs = [ar_outs[0], ar_outs[1][:3] + [int(top2.indices[1])] + ar_outs[1][4:]]  # row 1 takes the runner-up at 3
    gaps = lambda outs, ar_outs: bench.lossless(target, prompts, outs, ar_outs, 0)["first_difference_gaps"]
    assert gaps(outs, ar_outs) == [pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-5)]
    # a distance, whichever row holds the larger logit (a verify pass can round a near-tie either way)
    assert gaps(ar_outs, outs) == gaps(outs, ar_outs)
    assert gaps([ar_outs[0], ar_outs[1][:2]], ar_outs) == [None]  # ends early


def test_predicted_speedup_and_lossless_arithmetic():
    """Made-up stats at batch 2 (row passes != verify passes): 6 accepted drafts over 4 row
    passes after the prefills, E = 1 + 6 / 4 = 2.5 tokens per pass; t_ar = 4 s / 4 passes, one
    pass of the method = (1 s + 0.75 s + 0.25 s) / 2 passes -> 2.5x. Costs are per verify pass, E per row
    pass. A row pass that drafted nothing (MTP's gate, ngram without a match) counts in E."""
    st = dict(acc=[4, 2], att=[4, 4], draft_s=1.0, verify_s=0.75, rest_s=0.25, verify_passes=2,
              draft_row_passes=4)
    ar = dict(wall_s=4.0, verify_passes=4, row_passes=8)
    assert bench.predicted_speedup(st, ar) == pytest.approx(2.5)
    # the same accepted drafts in 8 row passes, 4 of which drafted nothing: alpha stays [1, 0.5]
    assert bench.predicted_speedup(dict(st, draft_row_passes=8), ar) == pytest.approx(1.75)
    greedy = bench.lossless(tiny_model(), [[5], [6]], [[1, 2, 3], [4]], [[1, 2, 4], [4]], 0)  # last token
    assert (greedy["lossless"], greedy["mismatches"], len(greedy["first_difference_gaps"])) == (False, 1, 1)
    sampled = dict(lossless=None, mismatches=0, first_difference_gaps=[])  # sampled: differs by design
    assert bench.lossless(None, [[5]], [[1, 2, 3]], [[1, 2, 4]], 1.0) == sampled


def test_predicted_speedup_with_no_drafting_pass_and_lossless_only_at_T0():
    """--max-new-tokens 1: every row ends with its prefill, so no pass drafted: E = 1, not a
    division by zero. Any T > 0, not only 1, samples: no token-for-token check there."""
    st = dict(acc=[0, 0], att=[0, 0], draft_s=0.0, verify_s=2.0, rest_s=0.0, verify_passes=1,
              draft_row_passes=0)
    assert bench.predicted_speedup(st, dict(wall_s=1.0, verify_passes=1, row_passes=2)) == pytest.approx(0.5)
    assert bench.lossless(None, [[5]], [[1, 2, 3]], [[1, 2, 4]], 0.5)["lossless"] is None
    assert bench.lossless(None, [[5]], [[1, 2, 3]], [[1, 2, 3]], 0.0) == dict(lossless=True, mismatches=0,
                                                                              first_difference_gaps=[])


def test_repeat8_is_the_mean_over_rows_of_repeated_8_grams():
    """A row of 20 equal tokens repeats 12 of its 13 8-grams (4-grams would be 16 of 17); a row
    of distinct tokens none: the card's figure is the mean over rows."""
    assert bench.repeat8([[7] * 20, list(range(20))]) == pytest.approx(12 / 13 / 2)


def test_run_sums_the_stats_of_its_batches(monkeypatch):
    """run() over two generate calls (batch 2, three prompts): tokens and passes add up, tau is
    per row pass, the drafting passes leave out one prefill per prompt, and alpha leaves out a
    position no pass drafted (no share of nothing)."""
    fake = [([[1, 2, 3], [4, 5]], dict(verify_passes=3, draft_s=0.5, verify_s=1.0, rest_s=0.5, row_passes=[2, 2],
                                       accepted_per_position=[2, 1, 0], attempts_per_position=[2, 2, 0])),
            ([[6, 7, 8, 9]], dict(verify_passes=2, draft_s=0.25, verify_s=0.5, rest_s=0.0, row_passes=[2],
                                  accepted_per_position=[1, 1, 0], attempts_per_position=[1, 1, 0]))]
    seeds = []  # each batch its own seed, --seed + its first prompt's index: the same for every method
    monkeypatch.setattr(bench, "generate", lambda *a, **k: seeds.append(k["seed"]) or fake.pop(0))
    args = argparse.Namespace(continuous=False, max_new_tokens=4, top_k=None, seed=5, compile=False)
    outs, st = bench.run(tiny_model(), None, [[1], [2], [3]], 3, 0.0, args, 2)
    assert outs == [[1, 2, 3], [4, 5], [6, 7, 8, 9]] and not fake and seeds == [5, 7]
    assert (st["new_tokens"], st["row_passes"], st["draft_row_passes"], st["verify_passes"]) == (9, 6, 3, 5)
    assert st["tau"] == 1.5 and st["tau_se"] == pytest.approx(bench.ratio_se([(3, 2), (2, 2), (4, 2)]))
    assert (st["draft_s"], st["verify_s"], st["rest_s"]) == (0.75, 1.5, 0.5)
    assert st["alpha"] == [1.0, pytest.approx(2 / 3)]


def test_tau_standard_error():
    """tau = 16 / 11 over two prompts; residuals t - tau p = +-30/11, so
    se = sqrt(2 * 2 * (30/11)^2) / 11 = 60/121. Prompts with one ratio have none."""
    assert bench.ratio_se([(10, 5), (6, 6)]) == pytest.approx(60 / 121)
    assert bench.ratio_se([(8, 4), (4, 2), (12, 6)]) == 0.0
    assert bench.ratio_se([(3, 1)]) == 0.0  # one prompt: no spread to estimate


def card(capsys, repeats, flags=(), drafters=None, Ks=None):
    """What bench.print_card prints for a tiny target's run: ar alone unless drafters are given."""
    target = dict(path="t.pt", preset="tiny", params=tiny_model().n_params())
    bench.print_card(bench.get_parser().parse_args(["--weights", "w", *flags]), torch.device("cpu"),
                     target, drafters or {"ar": None}, Ks or {"ar": 0}, "src", 2, repeats)
    return capsys.readouterr().out


def test_card_warns_when_the_target_loops(capsys, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    for r, warn in ((0.5, True), (bench.REPEAT_WARN + 0.01, True), (bench.REPEAT_WARN, False), (0.05, False)):
        out = card(capsys, {0.0: r})
        assert ("WARNING" in out) == warn, r
        assert "drafts    none (ar only) | timing" in out  # no K for drafters that do not run
        # there are no T=1 rows to trust
        assert ("trust sampled rows (T > 0) of a target that does not loop" in out) == warn
    for r, warn in ((0.149, False), (0.151, True)):  # at 15 % as a number, not only REPEAT_WARN
        out = card(capsys, {0.0: r})
        assert ("WARNING   the target loops at T=0 (15% > 15%)" in out) == warn, r
    assert "drafter there; trust the T=1 rows\n" in card(capsys, {0.0: 0.5, 1.0: 0.0})
    # no T=1 rows ran: the T=0.7 ones are the sampled rows to trust
    assert "drafter there; trust the T=0.7 rows\n" in card(capsys, {0.0: 0.5, 0.7: 0.0})


def test_card_says_a_tree_runs_eager_when_compiled(capsys):
    """--compile leaves dflash-tree's passes eager (speculate.generate): the card says so."""
    tree = SimpleNamespace(block_size=16, tree=SimpleNamespace(N=32), params=lambda: 0)
    Ks, note = {"ar": 0, "dflash-tree": 15}, "compiled steps: True, dflash-tree runs eager\n"
    assert note in card(capsys, {0.0: 0.0}, ["--compile"], {"ar": None, "dflash-tree": tree}, Ks)
    assert "runs eager" not in card(capsys, {0.0: 0.0}, [], {"ar": None, "dflash-tree": tree}, Ks)
    assert "runs eager" not in card(capsys, {0.0: 0.0}, ["--compile"])  # no tree ran


@pytest.mark.parametrize("load,warn", [(0.5, False), (2.0, False), (3.0, False), (3.01, True),
                                       (3.5, True)])
def test_card_warns_when_other_jobs_shared_the_cores(capsys, monkeypatch, load, warn):
    """A newcomer's bench beside a test run printed DFlash at 45x plain decoding, unwarned."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # bench's own 2 threads: a load of ~2
    assert ("WARNING   load average" in card(capsys, {0.0: 0.0})) == warn


def test_repeats_run_in_rounds_and_the_median_counts(monkeypatch, capsys):
    order, walls = [], {"ar": iter([3.0, 1.0, 2.0]), "ngram": iter([5.0, 4.0, 6.0])}

    def run(target, drafter, prompts, K, T, args, batch_size):
        order.append(drafter)
        return [[1, 2]], dict(wall_s=next(walls[drafter]), tau=1.0, tau_se=0.0, new_tokens=2, acc=[],
                              alpha=[], draft_row_passes=0, draft_s=0.0, verify_s=1.0, rest_s=0.0,
                              verify_passes=2)

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "generate", lambda *a, **k: None)  # the untimed warm-up
    args = argparse.Namespace(repeats=3, compile=False, continuous=False)
    ar, ngram = bench.bench_rows(None, {"ar": "ar", "ngram": "ngram"}, {"ar": 0, "ngram": 7}, [[1]], [1.0], 1, args)
    assert order == ["ar", "ngram"] * 3  # one run of every method per round, not three of one in a row
    assert ar["wall_s"] == 2.0 and ar["wall_s_runs"] == [3.0, 1.0, 2.0]
    assert ngram["wall_s"] == 5.0 and ngram["wall_s_runs"] == [5.0, 4.0, 6.0] and ngram["speedup"] == 2.0 / 5.0
    assert "(round 3/3)" in capsys.readouterr().out


def test_json_verify_passes_are_batch_passes_not_row_passes(weights, prompts_file, tmp_path):
    js = tmp_path / "bench.json"
    rows = bench.main(["--target", str(weights / "target.pt"), "--methods", "ar", "--temperatures", "0",
                       "--prompts", str(prompts_file), "--max-new-tokens", "12", "--batch-size", "2", "--json", str(js)])
    ar = rows[0]
    assert ar["new_tokens"] == 24 and ar["verify_passes"] == 12  # one pass commits a token for both rows
    report = json.loads(js.read_text())
    assert report["results"] == rows and set(report) == {"config", "machine", "target", "results"}


def test_continuous_hands_all_prompts_to_one_generate_call(monkeypatch):
    calls = []
    real = bench.generate
    monkeypatch.setattr(bench, "generate", lambda t, p, *a, **k: calls.append((len(p), k["batch_size"])) or real(t, p, *a, **k))
    args = argparse.Namespace(continuous=True, max_new_tokens=3, top_k=None, seed=0, compile=False)
    outs, _ = bench.run(tiny_model(), None, [[1, 2], [3], [4, 5, 6]], 0, 0.0, args, 1)
    assert calls == [(3, 1)] and len(outs) == 3
    calls.clear()
    args.continuous = False
    bench.run(tiny_model(), None, [[1, 2], [3], [4, 5, 6]], 0, 0.0, args, 1)
    assert calls == [(1, 1)] * 3


def test_eagle_drafts_the_K_it_was_given(weights, prompts_file):
    from draft_eagle import Eagle
    target = load_target(str(weights / "target.pt"))
    torch.manual_seed(0)
    e = Eagle(target.cfg, ttt_steps=2)
    save_checkpoint(str(weights / "eagle.pt"), dict(kind="eagle", config=e.config_dict(), state_dict=e.state_dict(),
                                                    target_hash=weights_hash(target.cfg, target.state_dict())))
    try:
        rows = bench.main(["--target", str(weights / "target.pt"), "--methods", "ar,eagle", "--temperatures", "0",
                           "--prompts", str(prompts_file), "--max-new-tokens", "6", "--K", "3"])
    finally:
        os.remove(weights / "eagle.pt")
    eagle = rows[1]
    assert eagle["method"] == "eagle" and eagle["K"] == 3 and len(eagle["acceptance_per_position"]) == 3


def test_the_default_is_the_committed_target_and_its_drafters(tmp_path, capsys):
    """No flags: the committed weights/cpu/target.pt, its drafters from its own folder, on
    whatever device there is (the same weights on either), and nothing trained."""
    js = tmp_path / "b.json"
    bench.main(["--methods", "ar,eagle", "--n-prompts", "1", "--max-new-tokens", "2", "--temperatures", "0",
                "--json", str(js)])
    report = json.loads(js.read_text())
    committed = data.REF_WEIGHTS
    assert report["target"]["path"] == os.path.join(committed, "target.pt") and report["target"]["preset"] == "cpu"
    assert report["config"]["weights"] == committed and [r["method"] for r in report["results"]] == ["ar", "eagle"]
    assert report["machine"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_target_that_does_not_load_is_one_line(tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(b"junk")
    for target, expect in ((tmp_path / "t.pt", "no such checkpoint"), (tmp_path / "junk.pt", "not a readable")):
        with pytest.raises(SystemExit) as e:
            bench.main(["--target", str(target), "--methods", "ar"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and expect in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_drafter_that_cannot_run_is_skipped_with_the_command_that_trains_it(weights, tmp_path, capsys):
    """Missing (draft, mtp, dflash) or trained for another target (eagle): each is skipped in one
    line that ends in the command training it for this target into --weights; the rest runs."""
    w = tmp_path / "w"
    save_checkpoint(str(w / "eagle.pt"), dict(kind="eagle", config={}, state_dict={}, target_hash="0123abcd"))
    t = str(weights / "target.pt")
    rows = bench.main(["--target", t, "--weights", str(w), "--n-prompts", "1", "--max-new-tokens", "2",
                       "--temperatures", "0"])
    assert [r["method"] for r in rows] == ["ar", "ngram"]
    out = capsys.readouterr().out
    assert f"skipping draft: {w / 'draft.pt'}: no such checkpoint; train it: python train.py --preset cpu-draft " \
           f"--out-path {w}/draft.pt\n" in out, out
    for m in ("mtp", "dflash"):
        assert f"skipping {m}: {w / (m + '.pt')}: no such checkpoint; train it: python train_drafter.py --method {m} " \
               f"--target {t} --out-dir {w}\n" in out
    eagle = next(l for l in out.splitlines() if l.startswith("skipping eagle: "))
    assert "trained for target 0123abcd, not this one" in eagle and "retrain it" not in eagle
    assert eagle.endswith(f"; train it: python train_drafter.py --method eagle --target {t} --out-dir {w}")


def test_bfloat16_needs_cuda(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--dtype", "bfloat16", "--device", "cpu"])
    assert e.value.code == 2 and "--dtype bfloat16 needs --device cuda" in capsys.readouterr().err


def test_a_prompt_one_token_over_the_context_is_named(tmp_path, capsys):
    w = tmp_path / "w"
    save_tiny(w / "target.pt")
    text = "x = 1\n" * 20
    (tmp_path / "p.txt").write_text(text)
    n = len(data.get_encoding().encode_ordinary(data.read_prompts_file(tmp_path / "p.txt")[0]))
    with pytest.raises(SystemExit):  # n + max_new + 0 drafts + 1 = 257 > 256
        bench.main(["--target", str(w / "target.pt"), "--methods", "ar", "--prompts", str(tmp_path / "p.txt"),
                    "--max-new-tokens", str(256 - n)])
    assert "prompt 1 of" in capsys.readouterr().err
    # one token fewer fits exactly: ar drafts nothing (K = 0), so it needs no headroom beyond its 1
    rows = bench.main(["--target", str(w / "target.pt"), "--methods", "ar", "--temperatures", "0", "--prompts",
                       str(tmp_path / "p.txt"), "--max-new-tokens", str(255 - n)])
    assert rows[0]["K"] == 0 and rows[0]["new_tokens"] == 255 - n


def test_table_content_a_tie_and_one_draft_position(capsys):
    """A gap of exactly 0 is a tie, not "(ends early)"; a row with one draft position (mtp of
    depth 1, --K 1) still gets its acceptance line."""
    row = dict(method="mtp", temperature=0.0, K=1, tau=1.5, tau_se=0.1, tokens_per_s=10.0, speedup=1.2, step_ms=dict(draft=1.0, verify=2.0, rest=0.5),
               predicted_speedup=1.3, lossless=False, mismatches=2, drafter_params=0, acceptance_per_position=[0.5],
               first_difference_gaps=[0.0, None])
    bench.print_table([row], 2)
    out = capsys.readouterr().out
    assert "are 0, (ends early) apart" in out and "NO (2/2 differ)" in out
    assert "alpha_1 0.50 ... alpha_1 0.50" in out


# -----------------------------------------------------------------------------
# the acceptance line and the greedy-only gaps show what they say

def test_acceptance_line_bars_and_E(capsys):
    """The text chart: eighth blocks rounded to the nearest (0.99 is a full block, 0.1 one
    eighth), two columns per position, and E = 1 + the sum of the alphas as its label says."""
    row = dict(method="mtp", temperature=0.0, K=5, tau=1.5, tau_se=0.1, tokens_per_s=10.0, speedup=1.2, step_ms=dict(draft=1.0, verify=2.0, rest=0.5),
               predicted_speedup=1.3, lossless=True, mismatches=0, drafter_params=0,
               acceptance_per_position=[1.0, 0.99, 0.5, 0.1, 0.0], first_difference_gaps=[])
    bench.print_table([row], 2)
    out = capsys.readouterr().out
    assert "|████▄▄▁▁  | alpha_1 1.00 ... alpha_5 0.00, 1 + sum = 3.59" in out


def test_first_difference_gaps_only_for_greedy_rows(weights, prompts_file, capsys):
    """Sampled rows differ from ar's by design: no gaps for them and no "T=0 ... differs" NOTE,
    which would send the reader after a bug that is not there."""
    rows = bench.main(["--target", str(weights / "target.pt"), "--methods", "ar,draft", "--temperatures", "1",
                       "--prompts", str(prompts_file), "--max-new-tokens", "12", "--K", "3"])
    out = capsys.readouterr().out
    assert all(r["first_difference_gaps"] == [] for r in rows) and "NOTE" not in out


def test_ctrl_c_is_one_line_on_what_was_kept(monkeypatch, run_script):
    """Ctrl-C anywhere in bench (here while it loads the target): exit 130 and one line, no
    KeyboardInterrupt traceback."""
    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr("checkpoint.load_target", interrupt)
    try:
        rc, out, err = run_script("bench.py", "--methods", "ar", "--n-prompts", "1")
    except KeyboardInterrupt:  # escaping, it would stop the whole test run
        pytest.fail("Ctrl-C escaped bench.py's __main__: a traceback")
    assert rc == 130 and err == "\ninterrupted: nothing half-written was left behind\n", err


def test_dflash_drafts_its_trained_block_unless_told(tmp_path, capsys, monkeypatch):
    """bench's block follows the drafter's checkpoint, as speculate.py's does: the command
    train_drafter.py prints after `--block-size 8` must measure a block of 8 (a default of 16
    refused it; one of 24 would measure 16 without a word). --block-size still picks a smaller one."""
    import draft_diffusion
    save_tiny(tmp_path / "target.pt")
    target = load_target(str(tmp_path / "target.pt"))
    df = draft_diffusion.DFlash(target.cfg, n_layer=1, n_features=2, block_size=8)
    save_checkpoint(str(tmp_path / "dflash.pt"), dict(kind="dflash", config=df.config_dict(), state_dict=df.state_dict(),
                                                      target_hash=weights_hash(target.cfg, target.state_dict())))
    run = lambda *flags: bench.main(["--target", str(tmp_path / "target.pt"), "--weights", str(tmp_path), "--methods",
                                     "dflash", "--n-prompts", "1", "--max-new-tokens", "8", "--temperatures", "0",
                                     "--json", str(tmp_path / "b.json"), *flags])
    for flags, S in [((), 8), (("--block-size", "4"), 4)]:
        run(*flags)
        assert f"drafts    K per step: dflash {S - 1} (block {S}) | timing" in capsys.readouterr().out
        assert [r["K"] for r in json.loads((tmp_path / "b.json").read_text())["results"]] == [0, S - 1]  # ar, dflash
    with pytest.raises(SystemExit) as e:
        run("--block-size", "9")
    assert e.value.code == 2 and "outside what the drafter was trained for (2..8) (see --block-size)" in capsys.readouterr().err
    # any other fault of the drafter is not the flag's: no hint to a flag that was not given
    def broken(*a, **k):
        raise ValueError("a fault of its own")
    monkeypatch.setattr("checkpoint.DFlashDrafter", broken)
    with pytest.raises(SystemExit) as e:
        run()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "error: dflash was asked for in --methods, but cannot load it (ValueError: " \
                                       "a fault of its own)\n", err
    # a damaged checkpoint of a method nobody named is skipped with its reason; the others run
    (tmp_path / "draft.pt").write_bytes(b"not a checkpoint")
    results = bench.main(["--target", str(tmp_path / "target.pt"), "--weights", str(tmp_path), "--n-prompts", "1",
                          "--max-new-tokens", "8", "--temperatures", "0"])
    out = capsys.readouterr().out
    assert f"skipping draft: {tmp_path / 'draft.pt'}: not a readable checkpoint" in out, out
    assert "; train it: python train.py --preset cpu-draft" in out
    assert "skipping dflash: cannot load it (ValueError: a fault of its own)" in out
    assert [r["method"] for r in results] == ["ar", "ngram"]


# -----------------------------------------------------------------------------
# dev/sweep.py --option batch_size: the batch sweep, which was bench.py's --batch-sizes

def test_batch_sweep_rows_per_batch_size_against_ar_there(weights, prompts_file, tmp_path, capsys):
    """Every method at every batch size, each row's speedup and lossless against ar at its own
    batch size; tau is tokens per pass *per row*, so plain decoding's is exactly 1 at any size."""
    js = tmp_path / "sweep.json"
    rows = sweep.main(["--target", str(weights / "target.pt"), "--method", "draft", "--also", "ngram",
                       "--option", "batch_size=1,2,1", "--temperatures", "0", "--prompts", str(prompts_file),
                       "--max-new-tokens", "12", "--K", "3", "--json", str(js)])
    out = capsys.readouterr().out
    assert [(r["method"], r["option"]) for r in rows] == [
        (f"{m} batch_size={b}", {"batch_size": b}) for b in (1, 2) for m in ("ar", "draft", "ngram")]  # 1 once
    assert json.loads(js.read_text())["results"] == rows
    assert all(r["lossless"] is True and r["mismatches"] == 0 and r["new_tokens"] == 2 * 12 for r in rows)
    assert all(r["wall_s_runs"] == [r["wall_s"]] for r in rows)  # --repeats 1: the one run is the median
    for b in (1, 2):
        ar = next(r for r in rows if r["method"] == f"ar batch_size={b}")
        assert ar["tau"] == 1.0 and ar["tau_se"] == 0.0 and ar["speedup"] == 1.0
        assert ar["verify_passes"] == 2 * 12 // b  # one pass commits a token for every row of the batch
        for r in rows:
            if r["option"] == {"batch_size": b}:
                assert r["speedup"] == pytest.approx(ar["wall_s"] / r["wall_s"])
    assert "batch 1,2 | temperatures 0" in out and "against ar at the same batch size" in out
    assert next(l for l in out.splitlines() if l.startswith("ar batch_size=2 ")).split()[2:5] == ["0", "0", "1.00"]


def test_batch_sweep_continuous_and_sampled(weights, prompts_file, capsys):
    """--continuous reaches the sweep's runs (one row taking both prompts in turn decodes them
    as two batches of one: the same tau and passes); sampled rows are n/a, never NO."""
    argv = ["--target", str(weights / "target.pt"), "--method", "ngram", "--option", "batch_size=1",
            "--temperatures", "0,1", "--prompts", str(prompts_file), "--max-new-tokens", "12", "--K", "3"]
    fixed, cont = sweep.main(argv), sweep.main(argv + ["--continuous"])
    out = capsys.readouterr().out
    assert "batch 1 (continuous)" in out and " NO" not in out
    for a, b in zip(fixed, cont):
        assert (a["method"], a["tau"], a["verify_passes"]) == (b["method"], b["tau"], b["verify_passes"])
        assert b["lossless"] is (True if b["temperature"] == 0 else None)


def test_batch_sweep_lossless_catches_a_broken_verifier(weights, prompts_file, monkeypatch, capsys):
    def accept_all(p, drafts, q=None, uniforms=None):  # fast and wrong, at every batch size
        n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        return n, p[:, -1].argmax(-1)
    monkeypatch.setattr(speculate, "accept_scan", accept_all)
    rows = sweep.main(["--target", str(weights / "target.pt"), "--method", "draft", "--option", "batch_size=2",
                       "--temperatures", "0", "--prompts", str(prompts_file), "--max-new-tokens", "12", "--K", "3"])
    draft = rows[1]
    assert draft["method"] == "draft batch_size=2" and draft["lossless"] is False and draft["mismatches"] > 0
    assert capsys.readouterr().out.rstrip().endswith("NO")


@pytest.mark.parametrize("flags, expect", [
    (["--option", "batch_size=4,0"], "--option batch_size: rows decoded at once are >= 1"),
    (["--option", "batch_size=2", "--batch-size", "2"], "it replaces --batch-size"),
    (["--option", "batch_size=1,4", "--n-prompts", "3"], "a batch of 4 rows needs at least as many prompts (3)"),
    (["--option", "batch_size=1", "--methods", "ar"], "not --methods")])
def test_batch_sweep_bad_flags_are_one_line(flags, expect, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--method", "ngram", *flags])
    out = capsys.readouterr()
    assert e.value.code == 2 and expect in out.err and out.err.count("\n") == 1 and out.out == ""


def test_a_hugging_face_folder_without_its_tokenizer_is_one_error_line(weights, tmp_path, capsys):
    hf_export.save_hf_target(load_target(str(weights / "target.pt")), str(tmp_path / "hf"))
    with pytest.raises(SystemExit) as e:  # was a FileNotFoundError traceback
        bench.main(["--target", str(tmp_path / "hf"), "--methods", "ar", "--temperatures", "0",
                    "--n-prompts", "1", "--max-new-tokens", "2"])
    assert e.value.code == 2 and "tokenizer.json" in capsys.readouterr().err


def test_a_prompt_too_long_for_the_trees_headroom_is_refused_before_any_work(capsys):
    """dflash-tree verifies N + 1 = 33 positions, more than its chain's K + 1 = 16: the early
    context check counted 16, and the run went on until generate refused the prompt."""
    import checkpoint
    text = data.reference_prompts(1)[0]
    n = len(data.get_encoding().encode_ordinary(text))
    ctx = checkpoint.load_target(os.path.join(data.REF_WEIGHTS, "target.pt")).cfg.max_seq_len
    flags = ["--methods", "dflash-tree", "--n-prompts", "1", "--temperatures", "0",
             "--max-new-tokens", str(ctx - n - 16)]
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    assert e.value.code == 2 and "+ 33 verify positions exceed the context" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# mutation audit (bench.py, dev/sweep.py, dev/plot.py): pure checks of what the table trusts

def table_row(**kw):
    """A result row as bench_rows returns it, for the printing code: kw over neutral figures."""
    return dict(dict(method="draft", temperature=0.0, K=3, tau=1.0, tau_se=0.0, tokens_per_s=1.0,
                     speedup=1.0, predicted_speedup=1.0, lossless=True, mismatches=0,
                     drafter_params=0, acceptance_per_position=[], first_difference_gaps=[],
                     repeat8=0.0, step_ms=dict(draft=0.0, verify=1.0, rest=0.0)), **kw)


def test_a_row_that_ends_early_or_ties_is_not_lossless():
    """A row that stops short of plain decoding's, or runs past it, has gap None and still
    differs: lossless is False ("no gaps", not "no truthy gap": None and a tie's 0.0 are falsy)."""
    target = tiny_model()
    early = bench.lossless(target, [[5], [6]], [[1, 2], [4]], [[1, 2, 3], [4]], 0)
    assert early == dict(lossless=False, mismatches=1, first_difference_gaps=[None])
    assert bench.lossless(target, [[5]], [[1, 2, 3]], [[1, 2]], 0.0)["lossless"] is False  # ran longer


def test_run_keeps_a_position_drafted_but_never_accepted_as_alpha_0(monkeypatch):
    """alpha leaves out only positions no pass drafted; one drafted and never accepted is 0, so
    the acceptance line shows where the drafter stops being right."""
    monkeypatch.setattr(bench, "generate", lambda *a, **k: ([[1, 2, 3]], dict(
        verify_passes=2, draft_s=0.0, verify_s=1.0, rest_s=0.0, row_passes=[2],
        accepted_per_position=[1, 0, 0], attempts_per_position=[2, 2, 0])))
    args = argparse.Namespace(continuous=False, max_new_tokens=3, top_k=None, seed=0, compile=False)
    assert bench.run(tiny_model(), None, [[1]], 3, 0.0, args, 1)[1]["alpha"] == [0.5, 0.0]


@pytest.mark.parametrize("continuous, shapes", [(False, [2, 1]), (True, [2])])
def test_warm_up_runs_every_row_at_every_batch_shape_before_any_timed_run(monkeypatch, continuous, shapes):
    """Three prompts at batch 2: the timed runs take a batch of 2 and a last one of 1, so the
    untimed warm-up (compiled: where graphs are recorded) runs both for every method and T,
    before the first timed run; --continuous keeps 2 rows throughout: one shape."""
    events = []

    def run(target, drafter, prompts, K, T, args, batch_size):
        events.append(("run", drafter, T))
        return [[1, 2]], dict(wall_s=1.0, tau=1.0, tau_se=0.0, new_tokens=2, acc=[], alpha=[],
                              draft_row_passes=0, draft_s=0.0, verify_s=1.0, rest_s=0.0, verify_passes=2)

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "generate", lambda t, p, d, **k: events.append(("warm", d, k["temperature"], len(p))))
    args = argparse.Namespace(repeats=1, compile=False, continuous=continuous)
    bench.bench_rows(None, {"ar": "ar", "ngram": "ngram"}, {"ar": 0, "ngram": 3}, [[1], [2], [3]], [0.0, 1.0], 2, args)
    warm = [e for e in events if e[0] == "warm"]
    assert events[:len(warm)] == warm and len(events) == len(warm) + 4  # all warm-ups first, then 4 runs
    assert sorted(warm) == sorted(("warm", m, T, b) for m in ("ar", "ngram") for T in (0.0, 1.0) for b in shapes)


def test_the_cards_repetition_figure_is_plain_decodings(weights, prompts_file, monkeypatch, capsys):
    """The warning reads ar's repeat8 at each T, not whichever method's row came last (a drafter
    that loops must not flag the target, nor one that does not hide a looping target)."""
    row = lambda m, T, rep: table_row(method=m, temperature=T, K=0, repeat8=rep)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(bench, "bench_rows", lambda *a: [row("ar", 0.0, 0.05), row("ngram", 0.0, 0.5),
                                                         row("ar", 1.0, 0.5), row("ngram", 1.0, 0.0)])
    bench.main(["--target", str(weights / "target.pt"), "--methods", "ar,ngram", "--temperatures", "0,1",
                "--prompts", str(prompts_file), "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert "repeats 5.0% of its 8-grams at T=0 " in out and "repeats 50.0% of its 8-grams at T=1 " in out
    assert "WARNING   the target loops at T=1 " in out and "loops at T=0 " not in out
    assert "trust the T=1 rows" not in out  # the advice named the very rows it flagged


def test_sweep_K_and_option_reach_the_drafter_and_rows_group_by_temperature(weights, prompts_file, monkeypatch, capsys):
    """--option K=1,2: each row drafts its own K (the K column and alpha's length), a drafter
    option is loaded at each value, and the rows come grouped by temperature, ar first."""
    rows = sweep.main(["--target", str(weights / "target.pt"), "--method", "draft", "--option", "K=1,2",
                       "--temperatures", "0,1", "--prompts", str(prompts_file), "--max-new-tokens", "6"])
    assert [(r["method"], r["temperature"], r["K"]) for r in rows] == [
        (m, T, K) for T in (0.0, 1.0) for m, K in (("ar", 0), ("draft K=1", 1), ("draft K=2", 2))]
    assert [len(r["acceptance_per_position"]) for r in rows] == [0, 1, 2] * 2
    loads, real = [], sweep.load_drafter
    monkeypatch.setattr(sweep, "load_drafter", lambda m, *a, **k: loads.append((m, k.get("confidence"))) or real(m, *a, **k))
    sweep.main(["--target", str(weights / "target.pt"), "--method", "draft", "--option", "confidence=0,0.5",
                "--temperatures", "0", "--prompts", str(prompts_file), "--max-new-tokens", "2"])
    assert [c for m, c in loads if m == "draft"] == [0.0, 0.5]


def test_table_counts_the_differing_rows_out_of_all_prompts(capsys):
    """"NO (1/3 differ)": the mismatches over the prompts run, not over themselves."""
    bench.print_table([table_row(lossless=False, mismatches=1, first_difference_gaps=[0.25])], 3)
    out = capsys.readouterr().out
    assert "NO (1/3 differ)" in out and "first differs are 0.25 apart" in out


def test_first_difference_gap_at_the_first_new_token():
    """Rows that part at their first new token get the target's margin at the prompt's end, not
    "(ends early)": the search for the first difference starts at position 0."""
    target = tiny_model()
    prompts = [[5, 6, 7]]
    ar_outs, _ = speculate.generate(target, prompts, None, max_new_tokens=4)
    with torch.no_grad():
        top2 = target(torch.tensor(prompts))[0][0, -1].topk(2)
    outs = [[int(top2.indices[1])] + ar_outs[0][1:]]
    res = bench.lossless(target, prompts, outs, ar_outs, 0)
    assert res["first_difference_gaps"] == [pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-5)]


def test_bench_rows_take_each_figure_from_their_own_run_and_ar_only_as_the_baseline(monkeypatch):
    """ngram's row: its own tau_se, passes, step times and repetition; ar's median run only as
    the baseline of speedup and predicted speedup (t_ar = 2 s / 4 passes; E = 1 + 1/1; a pass
    of ngram = (0.1 + 0.6 + 0.1) s / 2 -> 2 x 0.5 / 0.4 = 2.5x)."""
    stats = dict(ar=([[7] * 20], dict(wall_s=2.0, verify_passes=4, tau=1.0, tau_se=0.0, new_tokens=20, acc=[],
                                      alpha=[], draft_row_passes=3, draft_s=0.0, verify_s=2.0, rest_s=0.0)),
                 ngram=([list(range(20))], dict(wall_s=1.25, verify_passes=2, tau=2.0, tau_se=0.25, new_tokens=20,
                                                acc=[1], alpha=[1.0], draft_row_passes=1, draft_s=0.1,
                                                verify_s=0.6, rest_s=0.1)))
    class Drafter(str):  # the run's key into stats, with a size
        params = lambda self: 1234

    monkeypatch.setattr(bench, "run", lambda target, drafter, *a: stats[drafter or "ar"])
    monkeypatch.setattr(bench, "generate", lambda *a, **k: None)
    args = argparse.Namespace(repeats=1, compile=False, continuous=False)
    ar, ngram = bench.bench_rows(None, {"ar": None, "ngram": Drafter("ngram")}, {"ar": 0, "ngram": 1}, [[1]], [1.0], 1,
                                 args)
    assert (ar["drafter_params"], ngram["drafter_params"]) == (0, 1234)
    assert ngram["predicted_speedup"] == pytest.approx(2.5) and ngram["speedup"] == pytest.approx(1.6)
    assert (ngram["tau"], ngram["tau_se"], ngram["verify_passes"], ngram["repeat8"]) == (2.0, 0.25, 2, 0.0)
    assert ngram["step_ms"] == pytest.approx(dict(draft=50.0, verify=300.0, rest=50.0))
    assert ar["repeat8"] == pytest.approx(12 / 13) and ar["predicted_speedup"] == pytest.approx(1.0)


def test_table_columns_sit_under_their_headers(capsys):
    """Each figure of a row under its own header (speedup measured, then predicted; tau, then its
    s.e.), and the step line's three parts with their sum."""
    bench.print_table([table_row(tau=2.5, tau_se=0.25, tokens_per_s=40.0, speedup=1.75,
                                 step_ms=dict(draft=1.0, verify=2.0, rest=0.5), predicted_speedup=3.25,
                                 drafter_params=2_500_000, acceptance_per_position=[0.5])], 3)
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("method"))
    assert dict(zip(lines[head].split(), lines[head + 1].split())) == {
        "method": "draft", "T": "0", "K": "3", "tau": "2.50", "s.e.": "0.25", "tok/s": "40.0", "speedup": "1.75x",
        "predicted": "3.25x", "lossless": "yes", "params": "2.50M"}
    assert "| draft   1.00  verify   2.00  rest   0.50 |   3.50 ms a pass" in next(l for l in lines if "ms a pass" in l)


def test_sweep_table_prints_the_measured_speedup(weights, prompts_file, monkeypatch, capsys):
    """The sweep's speedup column is the measured one (ar's wall time over the row's), not the
    predicted one: bench_rows faked with distinct figures."""
    row = table_row(method="ar", K=0, tokens_per_s=40.0, speedup=1.75, predicted_speedup=3.25)
    monkeypatch.setattr(bench, "bench_rows", lambda *a: [dict(row)])
    sweep.main(["--target", str(weights / "target.pt"), "--method", "ngram", "--option", "K=2",
                "--temperatures", "0", "--prompts", str(prompts_file), "--max-new-tokens", "2"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("ar "))
    assert line.split()[1:] == ["0", "0", "1.00", "40.0", "1.75x", "yes"]
