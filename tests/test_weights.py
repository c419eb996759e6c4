"""
The weights: where bench.py finds its checkpoints or trains them (weights.py, on tiny random
checkpoints in seconds), and that the committed reference weights (weights/cpu) still draft well.

The second part: every other test checks that speculative decoding is lossless, which a
drafter that drafts badly still is: a DFlash that kept the wrong block slots stayed
token-identical while its tau here fell from 4.36 to 1.02 at T = 0. Each drafter runs on the
first 4 committed held-out prompts (data.reference_prompts, the same on every machine), 48
tokens each, at T = 0 and T = 1, and its tau must stay above a floor well below what it
measured (2026-12-02, a 2-core CI-class CPU; T = 0 is deterministic, and over 12 seeds at T = 1
each floor sat at least 3.5 standard deviations below the mean, in case another machine's
rounding changes a sampled token).

    python -m pytest -q tests/test_weights.py
"""

import argparse
import os

import pytest
import torch

import data
import checkpoint
import speculate
import train
import weights
from draft_diffusion import DFlash
from data import MASK, WEIGHTS_DIR, get_encoding, reference_prompts
from model import Config
from checkpoint import load_checkpoint, load_target, save_checkpoint, weights_hash
from test_model import save_tiny

# -----------------------------------------------------------------------------
# find_or_train: which checkpoints are used, and what is trained

def args_for(tmp_path, retrain=False):
    return argparse.Namespace(weights=None, target=None, retrain=retrain, preset="tiny", out=str(tmp_path / "out"))


def committed(tmp_path, monkeypatch):
    """A committed tiny target under tmp_path/weights, for plans that need no token bins
    -> (its folder, its hash)."""
    ref = tmp_path / "weights" / "tiny"
    save_tiny(ref / "target.pt", seed=0)
    monkeypatch.setattr(data, "WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setattr(data, "DATA_OUT", str(tmp_path / "nodata"))  # nothing to train, so no token bins either
    monkeypatch.setattr(data, "prepare", lambda *a, **k: pytest.fail("nothing to train: no bins needed"))
    t = load_target(str(ref / "target.pt"))
    return ref, weights_hash(t.cfg, t.state_dict())


def test_a_drafter_trained_for_another_target_is_not_used(tmp_path, capsys):
    save_checkpoint(str(tmp_path / "eagle.pt"), dict(kind="eagle", config={}, state_dict={}, target_hash="abc"))
    assert weights.usable("eagle", [str(tmp_path)], "def") is None
    assert "trained for another target" in capsys.readouterr().out
    assert weights.usable("eagle", [str(tmp_path / "missing"), str(tmp_path)], "abc") == str(tmp_path)


def test_committed_drafters_win_over_out_weights(tmp_path, monkeypatch):
    ref, th = committed(tmp_path, monkeypatch)
    outw = tmp_path / "out" / "tiny" / "weights"
    for d in (ref, outw):
        save_checkpoint(str(d / "eagle.pt"), dict(kind="eagle", config={}, state_dict={}, target_hash=th))
    _, path, found, skipped = weights.find_or_train(args_for(tmp_path), ["ar", "eagle"], torch.device("cpu"), torch.float32)
    assert path == str(ref / "target.pt") and found == {"eagle": str(ref)} and not skipped


def test_a_gpu_preset_plan_on_a_cpu_warns_before_training(tmp_path, monkeypatch, capsys):
    """bench --preset gpu on a CPU trained a 14-layer target for minutes without a word."""
    import train_drafter
    monkeypatch.setattr(data, "WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setattr(data, "prepare", lambda: None)
    monkeypatch.setattr(train, "main", lambda a: save_tiny(a.out_path))  # what it trains does not matter
    monkeypatch.setattr(train_drafter, "main", lambda a: None)
    # the second gpu plan reuses the target trained by the first: drafters only, no warning
    for preset, warned in [("tiny", False), ("gpu", True), ("gpu", False)]:
        args = argparse.Namespace(**{**vars(args_for(tmp_path / preset)), "preset": preset})
        weights.find_or_train(args, ["ar", "eagle"], torch.device("cpu"), torch.float32)
        out = capsys.readouterr().out
        assert ("NOTE: the gpu preset is sized for a GPU" in out) == warned and "=== [1/" in out
        assert not warned or out.index("NOTE") < out.index("=== [1/")  # before the training, not after


def test_a_drafter_run_killed_in_an_earlier_plan_is_resumed(tmp_path, monkeypatch):
    """bench trains a missing drafter with --resume when its killed run left a <method>.run.pt,
    from scratch otherwise, and from scratch when that run file is not one it can continue."""
    import train_drafter
    ref, outw = tmp_path / "weights" / "tiny", tmp_path / "out" / "tiny" / "weights"
    save_tiny(ref / "target.pt", seed=0)
    monkeypatch.setattr(data, "WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setattr(data, "prepare", lambda: None)
    argvs, refuse = [], False

    def main(a):  # records what bench asked for; refuses to resume when told to, as load_run would
        argvs.append(a.resume)
        if a.resume and refuse:
            raise ValueError("another target")
    monkeypatch.setattr(train_drafter, "main", main)
    args = args_for(tmp_path)
    weights.find_or_train(args, ["eagle"], torch.device("cpu"), torch.float32)
    outw.mkdir(parents=True, exist_ok=True)
    (outw / "eagle.run.pt").write_bytes(b"")
    weights.find_or_train(args, ["eagle"], torch.device("cpu"), torch.float32)
    assert argvs == [None, str(outw / "eagle.run.pt")]
    refuse = True  # a run file this plan cannot continue: train from scratch instead
    _, _, found, skipped = weights.find_or_train(args, ["eagle"], torch.device("cpu"), torch.float32)
    assert argvs[2:] == [str(outw / "eagle.run.pt"), None] and found == {"eagle": str(outw)} and not skipped
    # an error after the resumed run finished (its run file gone) is an error, not a cue to start over
    def finishes_then_fails(a):
        argvs.append(a.resume)
        os.remove(a.resume)
        raise ValueError("after the end")
    monkeypatch.setattr(train_drafter, "main", finishes_then_fails)
    _, _, found, skipped = weights.find_or_train(args, ["eagle"], torch.device("cpu"), torch.float32)
    assert argvs[4:] == [str(outw / "eagle.run.pt")] and not found and "after the end" in skipped[0][1]


def test_a_cpu_plan_saves_runs_often_enough_to_resume_them(tmp_path, monkeypatch):
    """The trainers save every 500 steps, more than any cpu budget makes (the target ~40-80), so
    a killed step had nothing to resume: they also save by the clock, every --save-minutes, which
    the plan leaves at its default, shorter than the target's budget."""
    import train_drafter
    monkeypatch.setattr(data, "WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setattr(data, "prepare", lambda: None)
    seen = []
    monkeypatch.setattr(train, "main", lambda a: seen.append((a.preset, a.save_minutes)) or save_tiny(a.out_path))
    monkeypatch.setattr(train_drafter, "main", lambda a: seen.append((a.method, a.save_minutes)))
    weights.find_or_train(args_for(tmp_path), ["ar", "draft", "eagle"], torch.device("cpu"), torch.float32)
    assert 0 < train.SAVE_MINUTES < weights.MINUTES["target"] / 2
    assert seen == [("tiny", train.SAVE_MINUTES), ("tiny", train.SAVE_MINUTES), ("eagle", train.SAVE_MINUTES)]


def test_a_target_run_killed_in_an_earlier_plan_is_resumed(tmp_path, monkeypatch):
    """--retrain trains the target with --resume when a killed run left target.run.pt, and from
    scratch when that file is not a run it can continue."""
    out = tmp_path / "out" / "tiny"
    monkeypatch.setattr(data, "prepare", lambda: None)
    resumed, refuse = [], False

    def main(a):  # records what bench asked for and leaves a finished target where it asked
        resumed.append(a.resume)
        if a.resume and refuse:
            raise ValueError("torn file")
        save_tiny(a.out_path, seed=0)
    monkeypatch.setattr(train, "main", main)
    args = args_for(tmp_path, retrain=True)
    out.mkdir(parents=True)
    (out / "target.run.pt").write_bytes(b"")
    weights.find_or_train(args, ["ar"], torch.device("cpu"), torch.float32)
    assert resumed == [str(out / "target.run.pt")]
    (out / "target.pt").unlink()
    refuse = True
    target, path, _, _ = weights.find_or_train(args, ["ar"], torch.device("cpu"), torch.float32)
    assert resumed[1:] == [str(out / "target.run.pt"), None] and path == str(out / "target.pt") and target


def test_an_out_that_cannot_be_written_is_refused_before_any_training(tmp_path, monkeypatch):
    """bench --retrain --out FILE ended in the trainer's traceback (after the bins were built);
    now one Unusable line, which bench prints as its error, before anything is trained."""
    monkeypatch.setattr(data, "prepare", lambda: pytest.fail("must not build the bins"))
    monkeypatch.setattr(train, "main", lambda a: pytest.fail("must not train"))
    (tmp_path / "out").write_text("a file")
    with pytest.raises(weights.Unusable, match=r"out/tiny/target.pt: cannot write there \(.*out is a file, not a "
                                               r"folder\) \(bench trains what is missing into --out\)"):
        weights.find_or_train(args_for(tmp_path, retrain=True), ["ar"], torch.device("cpu"), torch.float32)


def test_a_committed_target_of_another_tokenizer_falls_back_to_out(tmp_path, monkeypatch, capsys):
    save_tiny(tmp_path / "weights" / "tiny" / "target.pt", tokenizer="0123456789ab")
    save_tiny(tmp_path / "out" / "tiny" / "target.pt", seed=1)
    monkeypatch.setattr(data, "WEIGHTS_DIR", str(tmp_path / "weights"))
    _, path, _, _ = weights.find_or_train(args_for(tmp_path), ["ar"], torch.device("cpu"), torch.float32)
    assert path == str(tmp_path / "out" / "tiny" / "target.pt")
    assert "not using the committed" in capsys.readouterr().out


def test_a_corrupt_checkpoint_does_not_hide_a_good_one(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "eagle.pt").write_bytes(b"junk")
    save_checkpoint(str(tmp_path / "b" / "eagle.pt"), dict(kind="eagle", config={}, state_dict={}, target_hash="abc"))
    assert weights.usable("eagle", [str(tmp_path / "a"), str(tmp_path / "b")], "abc") == str(tmp_path / "b")


def test_a_checkpoint_of_another_kind_is_not_used(tmp_path, capsys):
    """An eagle checkpoint saved as dflash.pt is refused when found, like a corrupt file, not when
    loaded later, where bench would add an unrelated hint to the error."""
    save_checkpoint(str(tmp_path / "dflash.pt"), dict(kind="eagle", config={}, state_dict={}, target_hash="abc"))
    assert weights.usable("dflash", [str(tmp_path)], "abc") is None
    assert "is a 'eagle' checkpoint, expected 'dflash'" in capsys.readouterr().out


def test_mtp_in_out_weights_is_found_when_the_target_has_no_heads(tmp_path, monkeypatch):
    ref, th = committed(tmp_path, monkeypatch)
    outw = tmp_path / "out" / "tiny" / "weights"
    save_checkpoint(str(outw / "mtp.pt"), dict(kind="mtp", config={}, state_dict={}, target_hash=th))
    _, _, found, _ = weights.find_or_train(args_for(tmp_path), ["ar", "mtp"], torch.device("cpu"), torch.float32)
    assert found == {"mtp": str(outw)}


def test_a_draft_model_in_out_is_reused_and_nothing_is_prepared(tmp_path, monkeypatch):
    committed(tmp_path, monkeypatch)
    monkeypatch.setattr(train, "main", lambda a: pytest.fail("must not train a draft model"))
    save_tiny(tmp_path / "out" / "tiny" / "draft.pt", seed=1, n_layer=1)
    _, _, found, _ = weights.find_or_train(args_for(tmp_path), ["ar", "draft"], torch.device("cpu"), torch.float32)
    assert found == {"draft": str(tmp_path / "out" / "tiny")}


def test_retrain_ignores_the_committed_target(tmp_path, monkeypatch):
    """--retrain: out/<preset> is looked in and trained into, as if no weights/<preset> were committed."""
    committed(tmp_path, monkeypatch)
    out = tmp_path / "out" / "tiny"
    target, path, found, train_dir = weights.find(args_for(tmp_path, retrain=True), ["eagle"], torch.device("cpu"),
                                                  torch.float32)
    assert target is None and path == str(out / "target.pt") and train_dir == str(out) and found == {"eagle": None}


def test_native_mtp_heads_in_the_target_need_no_mtp_checkpoint(tmp_path, monkeypatch):
    """A target trained with --mtp-depth carries its MTP heads: mtp is found beside it, and
    nothing is trained (committed() fails the test if the plan prepares data)."""
    from mtp import MTP
    ref, _ = committed(tmp_path, monkeypatch)
    ck = load_checkpoint(str(ref / "target.pt"))
    ck["mtp_state_dict"], ck["args"] = MTP(Config(**ck["config"]), 1).state_dict(), {"preset": "tiny", "mtp_depth": 1}
    save_checkpoint(str(ref / "target.pt"), ck)
    _, _, found, skipped = weights.find_or_train(args_for(tmp_path), ["ar", "mtp"], torch.device("cpu"), torch.float32)
    assert found == {"mtp": str(ref)} and not skipped


def test_a_missing_draft_model_is_trained_at_the_draft_preset_then_used(tmp_path, monkeypatch):
    """bench --preset cpu trains the `draft` method's model as cpu-draft (not a second model of
    the target's size) into out/cpu/weights, and runs it: found names that folder."""
    save_tiny(tmp_path / "weights" / "cpu" / "target.pt", seed=0)
    monkeypatch.setattr(data, "WEIGHTS_DIR", str(tmp_path / "weights"))
    monkeypatch.setattr(data, "DATA_OUT", str(tmp_path / "nodata"))
    monkeypatch.setattr(data, "prepare", lambda: None)
    presets = []
    monkeypatch.setattr(train, "main", lambda a: presets.append(a.preset) or save_tiny(a.out_path, seed=1, n_layer=1))
    args = argparse.Namespace(**{**vars(args_for(tmp_path)), "preset": "cpu"})
    _, _, found, skipped = weights.find_or_train(args, ["ar", "draft"], torch.device("cpu"), torch.float32)
    assert presets == ["cpu-draft"] and found == {"draft": str(tmp_path / "out" / "cpu" / "weights")} and not skipped


def test_the_plan_counts_the_shared_distillation_data_once(tmp_path, monkeypatch, capsys):
    """The first drafter of the plan builds the distillation data the others reuse: its minutes
    include it, the others' do not."""
    import train_drafter
    committed(tmp_path, monkeypatch)
    monkeypatch.setattr(data, "prepare", lambda: None)
    monkeypatch.setattr(train_drafter, "main", lambda a: None)
    weights.find_or_train(args_for(tmp_path), ["ar", "eagle", "dflash"], torch.device("cpu"), torch.float32)
    out, M = capsys.readouterr().out, weights.MINUTES
    eagle, dflash = M["eagle"] + M["distill"], M["dflash"]
    assert f"data (~{M['data']:g} min), eagle (~{eagle:g} min), dflash (~{dflash:g} min)" in out
    assert f"~{M['data'] + eagle + dflash:g} min in all" in out


# -----------------------------------------------------------------------------
# the committed reference weights

W = os.path.join(WEIGHTS_DIR, "cpu")
CASES = [  # (method, T, tau measured, floor asserted); ngram at T = 1 accepts ~nothing by nature
    ("ngram", 0.0, 1.88, 1.4),
    ("draft", 0.0, 1.28, 1.1), ("draft", 1.0, 1.47, 1.1),
    ("mtp", 0.0, 3.20, 2.4), ("mtp", 1.0, 2.34, 1.8),
    ("eagle", 0.0, 4.68, 3.3), ("eagle", 1.0, 2.87, 2.0),
    ("dflash", 0.0, 4.36, 3.0), ("dflash", 1.0, 2.02, 1.5),
]


@pytest.fixture(scope="module")
def setup():
    if not os.path.exists(os.path.join(W, "target.pt")):
        pytest.skip("no committed weights/cpu")
    target = load_target(os.path.join(W, "target.pt"))
    enc = get_encoding()
    return target, [enc.encode_ordinary(p) for p in reference_prompts(4)]


@pytest.mark.parametrize("method, T, measured, floor", CASES)
def test_each_committed_drafter_keeps_its_acceptance(setup, method, T, measured, floor):
    target, prompts = setup
    drafter = checkpoint.load_drafter(method, target, W)
    K = getattr(drafter, "default_K", 7)
    _, st = speculate.generate(target, prompts, drafter, max_new_tokens=48, K=K, temperature=T, seed=0,
                               batch_size=1)
    assert st["tau"] >= floor, f"{method} T={T}: tau {st['tau']:.2f} (measured {measured})"


@pytest.mark.parametrize("method", ["draft", "mtp", "eagle", "dflash"])
def test_each_drafter_follows_a_bfloat16_target(method):
    """load_drafter moves a drafter to the target's device and dtype: a float32 drafter beside a
    bfloat16 (or CUDA) target failed at its first matmul (bench --dtype bfloat16, any GPU run).
    Dropping that move passed every other test, all of them float32 on the CPU."""
    if not os.path.exists(os.path.join(W, "target.pt")):
        pytest.skip("no committed weights/cpu")
    target = load_target(os.path.join(W, "target.pt"), dtype=torch.bfloat16)
    drafter = checkpoint.load_drafter(method, target, W)
    modules = [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)]  # its own and the target
    assert {p.dtype for m in modules for p in m.parameters()} == {torch.bfloat16}
    out, _ = speculate.generate(target, [[1, 2, 3, 4, 5]], drafter, max_new_tokens=6)
    assert len(out[0]) == 6


def test_committed_dflash_fills_its_block_with_the_tokenizers_mask(setup):
    """The masked slots must hold <|mask|> (DFlash's default is the last id, which data.py makes
    it): a block of any other token drafts in another input distribution than it trained on."""
    mask = get_encoding().encode_single_token(MASK)
    assert checkpoint.load_drafter("dflash", setup[0], W).dflash.mask_id == mask  # the committed one
    assert DFlash(setup[0].cfg).mask_id == mask                                   # what train_drafter makes
