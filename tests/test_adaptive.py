"""
Draft lengths that adapt (--confidence C, issue 50): draft, mtp, eagle and dflash stop drafting
where they are unsure (draft_simple.cut_unsure), and stay lossless.

- greedy: token-identical to plain decoding for each of the four, batch 1, 3 ragged rows and
  6 prompts through 2 rows, with rows that really stopped at different slots in one pass
- drafts get shorter: C near 1 drafts one slot per step in one drafter pass, C = 0 drafts K
- sampling: the exact-distribution test of test_speculate.py with C > 0 (draft, mtp, dflash), and
  the broken rule (a slot dropped on its own confidence) failing it
- flags: --confidence reaches the drafters, is refused for a method that does not use it and
  out of 0..1 in one line; dev/sweep.py at tiny scale

    python -m pytest -q tests/test_adaptive.py
"""

import copy
import json
import os

import pytest
import torch

import bench
import checkpoint
import draft_simple
import sample
import speculate
from data import REF_WEIGHTS as W
from dev import plot, sweep
from draft_diffusion import DFlashDrafter
from draft_eagle import EagleDrafter
from draft_simple import ModelDrafter, cut_unsure
from mtp import MTPDrafter
from speculate import NO_DRAFT
from test_dflash import random_dflash
from test_eagle import random_eagle
from test_mtp import echo_mtp, random_mtp
from test_speculate import (SAMPLE_PROMPT, loopy_target, near_model_for, prompts, random_target,
                            Wrapped, reference, sampled_tv, sampling_target)

K, MAX_NEW = 6, 16
# thresholds with rows stopping at different slots on these tiny models (V = 97, so a draft's
# probability is ~0.1; dflash's is a running product along the block, so lower)
C = {"draft": 0.12, "mtp": 0.12, "eagle": 0.12, "dflash": 0.03}


def make(method, target, confidence):
    if method == "draft":  # the target drafts for itself (a copy): every draft is accepted
        return ModelDrafter(copy.deepcopy(target), confidence=confidence)
    if method == "mtp":  # K modules: one per draft
        return MTPDrafter(target, random_mtp(target, depth=K), confidence=confidence)
    if method == "eagle":
        return EagleDrafter(target, random_eagle(target), confidence=confidence)
    return DFlashDrafter(target, random_dflash(target.cfg), confidence=confidence)


class Lengths(Wrapped):
    """Records how many slots each row drafted at each propose."""

    def __init__(self, inner):
        super().__init__(inner)
        self.lengths = []

    def propose(self, tokens, n, K, **kw):
        drafts, q = self.inner.propose(tokens, n, K, **kw)
        self.lengths.append((drafts >= 0).sum(1).tolist())
        return drafts, q


def test_cut_unsure_keeps_the_unsure_slot_and_drops_the_rest():
    drafts = torch.arange(12).view(3, 4)
    conf = torch.tensor([[.9, .1, .9, .9], [.9, .9, .9, .9], [.1, .1, .9, .9]])
    q = torch.rand(3, 4, 5)
    d, q2 = cut_unsure(drafts, q, conf, 0.5)
    X = NO_DRAFT
    assert d.tolist() == [[0, 1, X, X], [4, 5, 6, 7], [8, X, X, X]] and torch.equal(q2, q)
    d, q2 = cut_unsure(drafts[[0, 2]], None, conf[[0, 2]], 0.5)  # only as wide as the longest row
    assert d.tolist() == [[0, 1], [8, NO_DRAFT]] and q2 is None


@pytest.mark.parametrize("n_prompts, batch", [(1, None), (3, None), (6, 2)])  # 6: continuous
@pytest.mark.parametrize("kind", ["repetitive", "random"])
@pytest.mark.parametrize("method", ["draft", "mtp", "eagle", "dflash"])
def test_greedy_with_confidence_equals_plain(method, kind, n_prompts, batch):
    target = loopy_target() if kind == "repetitive" else random_target()
    rows = [list(p) for p in prompts(kind)[:n_prompts]]
    drafter = Lengths(make(method, target, C[method]))
    outs, st = speculate.generate(target, rows, drafter, max_new_tokens=MAX_NEW, K=K,
                                  batch_size=batch)
    assert outs == [reference(kind, tuple(p), MAX_NEW) for p in rows]
    assert any(max(ls) < K for ls in drafter.lengths)           # drafts were cut short
    if n_prompts > 1:                                           # rows stopped at other slots
        assert any(len(set(ls)) > 1 for ls in drafter.lengths), drafter.lengths
    if method == "draft":                                       # accepted up to each cut
        assert sum(st["accepted_per_position"]) > len(drafter.lengths)


def drafter_passes(drafter):
    """A counter of the forward passes of the drafter's own network (a module run once each;
    mtp: each of its modules)."""
    nets = {ModelDrafter: lambda d: [d.model], MTPDrafter: lambda d: d.mtp.mods,
            EagleDrafter: lambda d: [d.eagle.layer],
            DFlashDrafter: lambda d: [d.dflash.norm]}[type(drafter)](drafter)
    count = [0]
    for net in nets:
        net.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.parametrize("method", ["draft", "mtp", "eagle", "dflash"])
def test_confidence_near_one_drafts_one_slot_and_zero_drafts_K(method):
    """C = 0.999: every row stops after its first draft, and the drafter runs one pass per step
    (its catch-up, mtp's first module, or dflash's block) instead of K; C = 0 is fixed K. The
    prefill catches the drafter's own cache up on the prompts: one more pass (mtp: a module's)."""
    target = random_target()
    rows = [list(p) for p in prompts("random")[:3]]
    for conf, width, passes in [(0.999, 1, 1), (0.0, K, 1 if method == "dflash" else K)]:
        drafter = make(method, target, conf)
        count, rec = drafter_passes(drafter), Lengths(drafter)
        outs, st = speculate.generate(target, rows, rec, max_new_tokens=MAX_NEW, K=K)
        assert outs == [reference("random", tuple(p), MAX_NEW) for p in rows]
        assert {max(ls) for ls in rec.lengths} == {width}, (conf, rec.lengths)
        prefill = drafter.mtp.depth if method == "mtp" else int(method != "dflash")
        assert count[0] == prefill + passes * len(rec.lengths), (conf, count[0], rec.lengths)


# -----------------------------------------------------------------------------
# sampling: the output keeps the target's distribution

SAMPLE_C = 0.2  # about half the first drafts fall below it on the sampling target


def sampling_drafter(method):
    t = sampling_target()
    if method == "draft":  # close to the target: both branches of the ratio test get traffic
        return ModelDrafter(near_model_for(t, noise=0.01, seed=8), confidence=SAMPLE_C)
    if method == "mtp":
        return MTPDrafter(t, echo_mtp(t, depth=2), confidence=SAMPLE_C)
    return DFlashDrafter(t, random_dflash(t.cfg, block_size=4), confidence=SAMPLE_C)


@pytest.mark.parametrize("method", ["draft", "mtp", "dflash"])
def test_sampling_with_confidence_is_lossless(method):
    tv, bound, st = sampled_tv(sampling_target(), SAMPLE_PROMPT, sampling_drafter(method), K=2)
    assert tv < bound, f"{method}: TV {tv:.3f} >= bound {bound:.3f}"
    att = st["attempts_per_position"]
    assert 0 < att[1] < att[0], att  # some rows drafted the second slot, others stopped


def cut_on_its_own_confidence(drafts, q, conf, C):
    """THE BROKEN RULE: slot i is dropped when its own draft is unsure (not only after it)."""
    keep = (conf >= C).long().cumprod(1).bool()
    width = int(keep.sum(1).max())
    return torch.where(keep, drafts, NO_DRAFT)[:, :width], (None if q is None else q[:, :width])


def test_dropping_a_draft_on_its_own_confidence_fails(monkeypatch):
    """The kept drafts then come from q restricted to sure tokens: TV ~0.24 against a bound of
    ~0.14, where the right rule stays at ~0.06."""
    monkeypatch.setattr(draft_simple, "cut_unsure", cut_on_its_own_confidence)
    tv, bound, _ = sampled_tv(sampling_target(), SAMPLE_PROMPT, sampling_drafter("draft"), K=2)
    assert tv > bound, f"TV {tv:.3f}, bound {bound:.3f}"


# -----------------------------------------------------------------------------
# the flag


@pytest.mark.parametrize("flags, expect", [
    (["--methods", "ar,ngram", "--confidence", "0.5"],
     "--confidence sets an option of draft/mtp/eagle/dflash, which is not being run"),
    (["--methods", "draft", "--confidence", "1.5"], "--confidence must be within 0..1"),
    (["--methods", "draft", "--confidence", "-0.1"], "--confidence must be within 0..1"),
    (["--methods", "draft", "--confidence", "nan"], "--confidence must be within 0..1")])
def test_bad_confidence_flags_are_refused_in_one_line(flags, expect, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and expect in err and err.count("\n") == 1, err


def test_sample_refuses_confidence_for_ngram_in_one_line(run_script):
    rc, _, err = run_script("sample.py", "--method", "ngram", "--confidence", "0.5")
    assert rc == 1 and "--confidence sets an option of draft/mtp/eagle/dflash" in err, err


@pytest.mark.parametrize("flags,message", [
    (["--method", "ar", "-K", "3"], "-K sets the drafts per step; --method ar drafts none"),
    (["--prompt", ""], "empty prompt: --prompt gives no text"),  # was: "... prompt list or prompt"
    (["--weights", os.path.join(W, "dflash.pt")], "--weights names a folder of checkpoints")])
def test_sample_refuses_what_it_would_ignore_or_misread_in_one_line(run_script, flags, message):
    rc, _, err = run_script("sample.py", *flags)
    assert rc == 1 and message in err, err


def test_confidence_reaches_the_drafters_and_shortens_drafts(capsys):
    """On the committed weights: load_drafter hands it to all four; sample.py's flag cuts
    draft's drafts (fixed K drafts 7 every step)."""
    target = checkpoint.load_target(os.path.join(W, "target.pt"))
    for m in ("draft", "mtp", "eagle", "dflash"):
        assert checkpoint.load_drafter(m, target, W, confidence=0.3).confidence == 0.3
    assert checkpoint.load_drafter("dflash-tree", target, W, confidence=0.3).confidence == 0.0
    args = ["--method", "draft", "--prompt", "def parse(", "--max-new-tokens", "24",
            "--device", "cpu", "-K", "7"]
    _, fixed = sample.main(args)
    _, adaptive = sample.main(args + ["--confidence", "0.5"])
    assert set(fixed["attempts_per_position"]) == {fixed["attempts_per_position"][0]}
    assert adaptive["attempts_per_position"][-1] < adaptive["attempts_per_position"][0]


def test_sweep_runs_a_tiny_table_that_plot_charts(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rows = sweep.main(["--method", "draft", "--option", "confidence=0,0.5", "--n-prompts", "1",
                       "--max-new-tokens", "8", "--temperatures", "0", "--device", "cpu",
                       "--json", str(out)])
    assert [r["method"] for r in rows] == ["ar", "draft confidence=0", "draft confidence=0.5"]
    assert all(r["lossless"] for r in rows) and rows[2]["option"] == {"confidence": 0.5}
    assert json.loads(out.read_text())["results"][2]["method"] == "draft confidence=0.5"
    plot.main([str(out), str(tmp_path / "sweep.svg")])
    text = capsys.readouterr().out
    assert "draft confidence=0.5" in text.split("lossless")[-1]
    with pytest.raises(SystemExit):  # an option the method does not take: one line
        sweep.main(["--method", "draft", "--option", "tree_nodes=8"])
    assert "--tree sets an option of dflash-tree" in capsys.readouterr().err
