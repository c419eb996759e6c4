"""train_drafter.py end to end on a tiny random target (seconds): the distillation data is built
once and then reused, each method trains, saves a checkpoint that its drafter loads and that
decodes losslessly, and another target refuses that checkpoint."""
import argparse
import sys
import numpy as np
import pytest
import torch

import data
import checkpoint
import speculate
import train_drafter
from model import PRESETS, Config
from checkpoint import load_target, save_checkpoint
from test_model import save_tiny  # a random tiny target in train.py's checkpoint format

ARGS = ["--n-seqs", "8", "--n-val-seqs", "4", "--prompt-len", "16", "--gen-len", "24", "--max-steps", "3",
        "--minutes", "5", "--batch-size", "4", "--eval-every", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    data.prepare()  # token bins into out/data (about 10 s the first time, cached after)
    d = tmp_path_factory.mktemp("drafters")
    save_tiny(d / "target.pt", seed=0)
    save_tiny(d / "other.pt", seed=1)
    return d


def run(target_dir, method, *extra):
    train_drafter.main(train_drafter.get_parser().parse_args(
        ["--method", method, "--target", str(target_dir / "target.pt"), *ARGS, *extra]))


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_each_method_trains_saves_and_loads(target_dir, method, capsys):
    run(target_dir, method)
    out = capsys.readouterr().out
    # 8 sequences in batches of 4: steps 0-1 are epoch 0, step 2 starts epoch 1
    assert "done: 3 steps, 2 epochs" in out and "top-1 agreement per position" in out
    target = load_target(str(target_dir / "target.pt"))
    drafter = checkpoint.load_drafter(method, target, str(target_dir))
    prompts = [[5, 6, 7, 8], [9, 10]]
    plain, _ = speculate.generate(target, prompts, None, max_new_tokens=12)
    spec, _ = speculate.generate(target, prompts, drafter, max_new_tokens=12, K=3)
    assert spec == plain
    other = load_target(str(target_dir / "other.pt"))
    with pytest.raises(ValueError, match="retrain"):
        checkpoint.load_drafter(method, other, str(target_dir))


def drafter_class(target_dir, method):
    """The class of method's drafter model, whose loss the tests spy on."""
    return type(train_drafter.make_drafter_model(method, load_target(str(target_dir / "target.pt")),
                                                 train_drafter.get_parser().parse_args(["--method", method])))


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_continuation_only_scores_from_the_prompt_length(target_dir, method, monkeypatch):
    """By default every label is scored; with --continuation-only every training and evaluation
    loss is told that labels start at --prompt-len."""
    cls = drafter_class(target_dir, method)
    seen, real = [], cls.loss
    monkeypatch.setattr(cls, "loss", lambda self, *a, **k: seen.append(k.get("label_from")) or real(self, *a, **k))
    run(target_dir, method)
    assert seen and set(seen) == {0}
    seen.clear()
    run(target_dir, method, "--continuation-only")
    assert seen and set(seen) == {16}  # ARGS' --prompt-len


class Interrupted(Exception):
    pass


def killed_after(step):
    """A save_checkpoint that dies right after writing the run's state at `step`, as a process
    killed there would."""
    real = train_drafter.save_checkpoint

    def save(path, obj):
        real(path, obj)
        if obj.get("step") == step:  # (the distillation data is saved this way too)
            raise Interrupted
    return save


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_a_resumed_run_continues_the_interrupted_one(target_dir, tmp_path, method, monkeypatch, capsys):
    """A 10-step run killed right after its save at step 5 (mid-epoch: an epoch is 4 steps of 2
    sequences), then resumed, ends with the weights of the same run left alone: optimizer, data
    order and DFlash's anchors all continue. Close, not equal: the first step's rate (~1e-8, in
    warm-up) comes from the clock. The clock continues too: a run saved past --minutes ends at once."""
    import weights

    def train(out, *extra):
        run(target_dir, method, "--out-dir", str(tmp_path / out), "--max-steps", "10", "--batch-size", "2",
            "--save-every", "5", *extra)
        return torch.load(tmp_path / out / f"{method}.pt", weights_only=True)

    whole = train("whole")
    assert not (tmp_path / "whole" / f"{method}.run.pt").exists()  # a finished run leaves only the drafter
    with monkeypatch.context() as m, pytest.raises(Interrupted):
        m.setattr(train_drafter, "save_checkpoint", killed_after(5))
        train("cut")
    state = tmp_path / "cut" / f"{method}.run.pt"
    assert weights.usable(method, [str(tmp_path / "cut")], whole["target_hash"]) is None  # no drafter yet

    late = torch.load(state, weights_only=True)
    late["elapsed"] = 1e6
    torch.save(late, tmp_path / "late.pt")
    ended = train("late", "--resume", str(tmp_path / "late.pt"))
    assert ended["train_minutes"] > 1e6 / 60
    assert all(torch.equal(v, late["state_dict"][k]) for k, v in ended["state_dict"].items())  # no step taken

    capsys.readouterr()
    resumed = train("cut", "--resume", str(state))
    assert f"resuming {state} at step 5" in capsys.readouterr().out and not state.exists()
    for k, v in whole["state_dict"].items():
        assert torch.allclose(resumed["state_dict"][k], v, atol=1e-6), k


def test_a_run_saves_by_the_clock_between_step_saves(target_dir, tmp_path, monkeypatch):
    """--save-every 0 still saves once --save-minutes have passed (1e-9: after every step), so a
    drafter run on a CPU, where 500 steps can take an hour, has something to resume."""
    with monkeypatch.context() as m, pytest.raises(Interrupted):
        m.setattr(train_drafter, "save_checkpoint", killed_after(2))
        run(target_dir, "mtp", "--out-dir", str(tmp_path), "--save-every", "0", "--save-minutes", "1e-9")
    assert torch.load(tmp_path / "mtp.run.pt", weights_only=True)["step"] == 2


def test_resume_refuses_another_run_before_any_work(target_dir, tmp_path, monkeypatch):
    """Other flags, another target or method, or a finished drafter: refused before the
    distillation data is built (minutes, at real sizes)."""
    with monkeypatch.context() as m, pytest.raises(Interrupted):
        m.setattr(train_drafter, "save_checkpoint", killed_after(2))
        run(target_dir, "dflash", "--out-dir", str(tmp_path / "a"), "--save-every", "2")
    state = str(tmp_path / "a" / "dflash.run.pt")
    run(target_dir, "dflash", "--out-dir", str(tmp_path / "b"))
    for extra, why in [(("--lr", "1e-2"), r"another run.*--lr"), (("--dflash-layers", "1"), "--dflash-layers"),
                       (("--target", str(target_dir / "other.pt")), "trained for target"),
                       (("--method", "eagle"), "'dflash' checkpoint"),
                       (("--resume", str(tmp_path / "b" / "dflash.pt")), "not a run in progress")]:
        with pytest.raises(ValueError, match=why):
            run(target_dir, "dflash", "--out-dir", str(tmp_path / "c"), "--resume", state, *extra)
    assert not (tmp_path / "c").exists()


def test_a_new_run_replaces_an_unfinished_one_unless_it_saves_nothing(target_dir, tmp_path, capsys):
    (tmp_path / "mtp.run.pt").write_bytes(b"someone's run")
    run(target_dir, "mtp", "--out-dir", str(tmp_path), "--save-every", "0", "--save-minutes", "0")
    assert (tmp_path / "mtp.run.pt").exists() and "NOTE" not in capsys.readouterr().out
    run(target_dir, "mtp", "--out-dir", str(tmp_path))  # 3 steps, no save of its own: still its file to remove
    assert not (tmp_path / "mtp.run.pt").exists() and "which this new run replaces" in capsys.readouterr().out


def test_distillation_data_is_built_once_then_reused(target_dir, capsys):
    run(target_dir, "dflash", "--max-steps", "1")
    run(target_dir, "dflash", "--max-steps", "1")
    assert "distill: reusing" in capsys.readouterr().out.split("done: 1 steps")[1]
    files = list(target_dir.glob("distill_*.pt"))
    assert len(files) == 1
    d = torch.load(files[0], weights_only=True)
    assert d["train"].shape == (8, 16 + 24) and d["val"].shape == (4, 16 + 24)


def test_two_targets_sharing_an_out_dir_get_their_own_distillation_data(target_dir, tmp_path, capsys):
    """The cached data is the target's own text, so its file is named by the target's hash."""
    for name in ("target.pt", "other.pt"):
        train_drafter.main(train_drafter.get_parser().parse_args(
            ["--method", "mtp", "--target", str(target_dir / name), "--out-dir", str(tmp_path), *ARGS,
             "--max-steps", "1"]))
    assert "distill: reusing" not in capsys.readouterr().out
    assert len(list(tmp_path.glob("distill_*.pt"))) == 2


def test_default_out_dir_never_overwrites_the_committed_weights(tmp_path):
    import os
    committed = os.path.join(data.WEIGHTS_DIR, "cpu", "target.pt")
    assert train_drafter.default_out_dir(committed) == os.path.join(data.DATA_OUT, "cpu", "weights")
    assert train_drafter.default_out_dir(str(tmp_path / "target.pt")) == str(tmp_path)


def test_the_printed_bench_command_measures_the_new_drafter(target_dir, tmp_path, capsys):
    """A drafter trained into a folder without its target: train_drafter prints the bench command
    that measures it (--target names the target), and that command runs it losslessly."""
    import os
    import shlex
    import bench
    assert train_drafter.get_parser().parse_args(["--method", "mtp"]).target == \
        os.path.join(data.WEIGHTS_DIR, "cpu", "target.pt")  # the committed target, which a fresh clone has
    run(target_dir, "mtp", "--out-dir", str(tmp_path))
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    assert hint.startswith("measure it: python bench.py --target ") and "../" not in hint  # tmp_path is absolute
    argv = shlex.split(hint.split("bench.py", 1)[1])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def parse(line):\n")
    rows = bench.main(argv + ["--preset", "tiny", "--temperatures", "0", "--prompts", str(prompts),
                              "--max-new-tokens", "8"])
    assert [r["method"] for r in rows] == ["ar", "mtp"] and rows[1]["lossless"] is True
    with pytest.raises(SystemExit) as e:  # --target alone: bench finds its own target and drafters
        bench.main(["--target", str(target_dir / "target.pt")])
    assert e.value.code == 2 and "--weights" in capsys.readouterr().err


@pytest.fixture
def fake_distill(monkeypatch):
    """No target: generate returns zeros and records its temperature, load_tokens returns a
    counting stream and records its split."""
    seen = {"temperatures": [], "splits": []}

    def gen(target, prompts, drafter, *, max_new_tokens, temperature=0.0, seed=None, **kw):
        seen["temperatures"].append(temperature)
        return [[0] * max_new_tokens for _ in prompts], {}

    monkeypatch.setattr(speculate, "generate", gen)
    monkeypatch.setattr(data, "load_tokens", lambda split: seen["splits"].append(split) or np.arange(1000, dtype=np.uint16))
    return seen


DISTILL = dict(n_seqs=4, n_val_seqs=2, prompt_len=4, gen_len=3, distill_temperatures="0", seed=0, save_minutes=0.0)


def test_distill_temperatures_cycle_per_batch(fake_distill):
    out = train_drafter.build_distill_data(None, 6, 4, 3, [0.0, 1.0], batch=2)
    assert out.shape == (6, 7) and fake_distill["temperatures"] == [0.0, 1.0, 0.0]


def test_distillation_progress_is_a_line_per_batch_in_a_log_and_one_line_on_a_terminal(fake_distill, capsys,
                                                                                       monkeypatch):
    """Rewritten in place with \\r, the progress ran together into one long line in a log file
    (a redirected run of bench that trains its drafters). Not a terminal: a line per batch."""
    train_drafter.build_distill_data(None, 6, 4, 3, [0.0], batch=2)
    lines = capsys.readouterr().out.splitlines(keepends=True)
    assert [l.split(" | ")[0] for l in lines] == [f"distill (train): {k}/6 sequences" for k in (2, 4, 6)], lines
    assert all(l.endswith(" s\n") and "\r" not in l for l in lines)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    train_drafter.build_distill_data(None, 6, 4, 3, [0.0], batch=2)
    out = capsys.readouterr().out
    assert out.count("\rdistill (train): ") == 3 and out.count("\n") == 1 and out.endswith(" s\n"), repr(out)


def test_each_distillation_batch_samples_with_its_own_seed(fake_distill, monkeypatch):
    """Batches continue different prompts, but one seed for all would give every sampled
    (T = 1) batch the same random stream: correlated continuations across the data set."""
    seeds = []

    def gen(target, prompts, drafter, *, max_new_tokens, temperature=0.0, seed=None, **kw):
        seeds.append(seed)
        return [[0] * max_new_tokens for _ in prompts], {}
    monkeypatch.setattr(speculate, "generate", gen)
    train_drafter.build_distill_data(None, 6, 4, 3, [1.0], seed=5, batch=2)
    assert len(seeds) == 3 and len(set(seeds)) == 3


@pytest.fixture
def stoppable_distill(fake_distill, monkeypatch):
    """generate continues each prompt with tokens that depend on it and on the batch's seed, and
    raises KeyboardInterrupt at call number calls["stop"]; calls["n"] counts the calls."""
    calls = {"n": 0, "stop": None}

    def gen(target, prompts, drafter, *, max_new_tokens, temperature=0.0, seed=None, **kw):
        calls["n"] += 1
        if calls["n"] == calls["stop"]:
            raise KeyboardInterrupt
        return [[(sum(p) + seed + k) % 50 for k in range(max_new_tokens)] for p in prompts], {}
    monkeypatch.setattr(speculate, "generate", gen)
    return calls


def test_an_interrupted_distillation_continues_where_it_stopped(stoppable_distill, tmp_path, capsys):
    """Ctrl-C in the second of three batches keeps the first in the part file; the next call
    makes only the other two, and the data are what one uninterrupted call makes."""
    build = lambda **kw: train_drafter.build_distill_data(None, 10, 4, 3, [0.0, 1.0], seed=3, batch=4, **kw)
    whole = build()
    part = str(tmp_path / "d.train.part.pt")
    stoppable_distill.update(n=0, stop=2)
    with pytest.raises(train_drafter.DistillInterrupted, match=f"the 4 train sequences made so far are kept in {part}"):
        build(part=part)
    assert torch.equal(torch.load(part, weights_only=True)["rows"], whole[:4])
    stoppable_distill.update(n=0, stop=None)
    assert torch.equal(build(part=part), whole) and stoppable_distill["n"] == 2
    assert "continuing from the 4 sequences kept in" in capsys.readouterr().out
    save_checkpoint(part, {"rows": whole[:4, :5]})  # a damaged file is not used: the data are still the same
    assert torch.equal(build(part=part), whole) and "is not usable; starting over" in capsys.readouterr().out
    with open(part, "wb") as f:
        f.write(b"not a torch file")
    assert torch.equal(build(part=part), whole) and "is not usable; starting over" in capsys.readouterr().out


def test_distillation_saves_its_progress_every_save_minutes(stoppable_distill, tmp_path, monkeypatch):
    """Not only on Ctrl-C: a killed process (no KeyboardInterrupt) keeps what the last timed
    save wrote. With --save-minutes 0 only Ctrl-C saves."""
    part, real, seen = tmp_path / "d.train.part.pt", train_drafter.save_checkpoint, []
    monkeypatch.setattr(train_drafter, "save_checkpoint", lambda path, obj: seen.append(len(obj["rows"])) or real(path, obj))
    for minutes, timed in [(1e-9, [4, 8]), (0.0, [])]:
        stoppable_distill.update(n=0, stop=3)
        part.unlink(missing_ok=True)
        seen.clear()
        with pytest.raises(train_drafter.DistillInterrupted):
            train_drafter.build_distill_data(None, 12, 4, 3, [0.0], batch=4, part=str(part), save_minutes=minutes)
        assert seen == timed + [8]  # the timed saves, then the one on Ctrl-C
    stoppable_distill.update(n=0, stop=None)  # a finished split is saved too (the next one may be cut short)
    rows = train_drafter.build_distill_data(None, 12, 4, 3, [0.0], batch=4, part=str(part))
    assert torch.equal(torch.load(part, weights_only=True)["rows"], rows) and len(rows) == 12


def test_the_part_files_go_once_the_distillation_data_is_saved(stoppable_distill, tmp_path):
    args = argparse.Namespace(**{**DISTILL, "out_dir": str(tmp_path), "n_seqs": 64, "n_val_seqs": 40})
    stoppable_distill.update(n=0, stop=4)  # the val split's second batch of 32
    with pytest.raises(train_drafter.DistillInterrupted, match="the 32 val sequences"):
        train_drafter.get_distill_data(None, args, "abc")
    assert sorted(p.name.split(".")[-3] for p in tmp_path.glob("*.part.pt")) == ["train", "val"]
    stoppable_distill.update(n=0, stop=None)
    train, val = train_drafter.get_distill_data(None, args, "abc")
    assert stoppable_distill["n"] == 1 and train.shape == (64, 7) and val.shape == (40, 7)
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("distill_*_seed0.pt")]


def test_validation_distill_data_comes_from_the_val_split(fake_distill, tmp_path):
    train, val = train_drafter.get_distill_data(None, argparse.Namespace(out_dir=str(tmp_path), **DISTILL), "abc")
    assert fake_distill["splits"] == ["train", "val"] and train.shape == (4, 7) and val.shape == (2, 7)


def test_a_torn_distillation_file_is_built_again(fake_distill, tmp_path, capsys):
    """A cached file cut short (a copy, a full disk) ended the run in torch's zip-reader traceback."""
    args = argparse.Namespace(out_dir=str(tmp_path), **DISTILL)
    train, val = train_drafter.get_distill_data(None, args, "abc")
    path = next(tmp_path.glob("distill_*.pt"))
    path.write_bytes(path.read_bytes()[:100])
    again, _ = train_drafter.get_distill_data(None, args, "abc")
    assert f"distill: {path} is not usable" in capsys.readouterr().out and torch.equal(again, train)
    assert torch.equal(train_drafter.get_distill_data(None, args, "abc")[0], train)  # and saved whole


def test_distillation_data_is_rebuilt_when_a_setting_that_shapes_it_changes(fake_distill, tmp_path, capsys):
    """Other temperatures, seed or val size make other data: reusing the cached file would
    train on the wrong text without a word."""
    base = dict(DISTILL, out_dir=str(tmp_path), distill_temperatures="0,1")
    for change in [{}, {"distill_temperatures": "0"}, {"seed": 1}, {"n_val_seqs": 3}, {}]:
        train_drafter.get_distill_data(None, argparse.Namespace(**{**base, **change}), "abc")
    assert capsys.readouterr().out.count("distill: reusing") == 1  # only the last, a repeat of the first
    assert len(list(tmp_path.glob("distill_*.pt"))) == 4
    parse = lambda t: train_drafter.get_parser().parse_args(["--method", "eagle", "--distill-temperatures", t])
    assert parse("0.0,1").distill_temperatures == "0,1"  # one spelling: --resume compares the values
    assert parse("0.3333333").distill_temperatures == "0.3333333"  # and the value kept whole
    with pytest.raises(SystemExit):
        parse("0,hot")


@pytest.mark.parametrize("flags,message", [(["--loss-decay", "0"], "--loss-decay must be > 0"),
                                           (["--block-size", "40"], r"--block-size must be in 2\.\.39"),
                                           (["--block-size", "26", "--continuation-only"], r"must be in 2\.\.25"),
                                           (["--dflash-features", "3"], r"--dflash-features must be in 1\.\.2"),
                                           (["--save-every", "-1"], "--save-every must be >= 0"),
                                           (["--save-minutes", "-1"], "--save-minutes must be >= 0"),
                                           (["--lr", "-1"], "--lr must be > 0")])
def test_drafter_flags_that_would_be_ignored_or_cut_are_refused(target_dir, tmp_path, flags, message):
    """--loss-decay 0 fell back to the default, a block past the sequence had no labels, more
    features than target layers were cut to the layers, and --save-every -1 saved every step."""
    with pytest.raises(ValueError, match=message):
        run(target_dir, "dflash", "--out-dir", str(tmp_path), *flags)
    assert not list(tmp_path.iterdir())  # refused before the distillation


def test_another_methods_flags_neither_refuse_a_run_nor_its_resume(target_dir, tmp_path, monkeypatch, capsys):
    """eagle ignores DFlash's flags: values DFlash would refuse pass, and a run saved under other
    values of them continues."""
    with monkeypatch.context() as m, pytest.raises(Interrupted):
        m.setattr(train_drafter, "save_checkpoint", killed_after(1))
        run(target_dir, "eagle", "--out-dir", str(tmp_path), "--block-size", "40", "--dflash-features", "3",
            "--save-every", "1")
    run(target_dir, "eagle", "--out-dir", str(tmp_path), "--resume", str(tmp_path / "eagle.run.pt"))
    assert "resuming" in capsys.readouterr().out and (tmp_path / "eagle.pt").exists()


def test_unset_flags_take_the_method_recipe_and_given_flags_win():
    parse = lambda *a: train_drafter.apply_recipe(train_drafter.get_parser().parse_args(list(a)))
    eagle, dflash = parse("--method", "eagle"), parse("--method", "dflash")
    assert (eagle.batch_size, eagle.lr, eagle.loss_decay) == (2, 2e-3, None)
    assert (dflash.batch_size, dflash.lr, dflash.loss_decay) == (8, 6e-4, 4.0)
    given = parse("--method", "dflash", "--batch-size", "3", "--lr", "1e-3", "--loss-decay", "7")
    assert (given.batch_size, given.lr, given.loss_decay) == (3, 1e-3, 7.0)
    assert train_drafter.make_drafter_model("dflash", argparse.Namespace(cfg=Config(vocab_size=64, **PRESETS["tiny"])), dflash).gamma == 4.0


def test_evaluate_sums_agreement_over_all_batches():
    stats = iter([(1.0, [2, 1], [4, 4]), (3.0, [0, 1], [4, 2])])

    class Fake:
        def eval(self): pass
        def train(self): pass
        def loss(self, target, tok, feats, label_from):
            l, a, c = next(stats)
            return torch.tensor(l), {"agree": torch.tensor(a), "count": torch.tensor(c)}
    loss, acc = train_drafter.evaluate(Fake(), None, torch.zeros(4, 3), torch.zeros(4, 3, 1), 2, 0)
    assert loss == 2.0 and acc == pytest.approx([2 / 8, 2 / 6])


def test_evaluate_draws_the_same_at_every_call_and_leaves_the_training_rng_alone():
    class Random:  # a loss as random as DFlash's anchors
        def eval(self): pass
        def train(self): pass
        def loss(self, target, tok, feats, label_from):
            return torch.rand(()), {"agree": torch.rand(2), "count": torch.ones(2)}
    val, feats = torch.zeros(4, 3), torch.zeros(4, 3, 1)
    torch.manual_seed(1)
    first = train_drafter.evaluate(Random(), None, val, feats, 2, 0)
    after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(3), after)  # evaluate consumed nothing from the caller's stream
    torch.manual_seed(2)
    assert train_drafter.evaluate(Random(), None, val, feats, 2, 0) == first


def test_the_lr_warms_up_then_decays_to_zero_and_every_step_is_clipped(target_dir, monkeypatch):
    """The optimisation settings the resume tests cannot see (two runs that share a wrong
    schedule still agree): warm-up over the first 4 % of the run, cosine to zero, and one
    gradient clip at norm 1.0 before every step. 50 steps, so 4 % is 2 of them."""
    lrs, clips = [], []
    real_step, real_clip = torch.optim.AdamW.step, torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.optim.AdamW, "step",
                        lambda self, *a, **k: lrs.append(self.param_groups[0]["lr"]) or real_step(self, *a, **k))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda p, max_norm, *a, **k: clips.append(max_norm)
                        or real_clip(p, max_norm, *a, **k))
    run(target_dir, "mtp", "--max-steps", "50", "--minutes", "1000", "--eval-every", "1000", "--lr", "1e-3")
    assert len(lrs) == 50 and clips == [1.0] * 50
    assert lrs[0] < lrs[1] < lrs[2] == pytest.approx(1e-3) == max(lrs)  # warm-up ends at step 2 of 50
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))                 # then only down ...
    assert lrs[26] == pytest.approx(0.5e-3) and lrs[-1] < 1e-5           # ... a cosine from there to ~0


def test_every_batch_is_full_and_no_sequence_repeats_within_an_epoch(target_dir, monkeypatch):
    """10 sequences in batches of 4: each epoch is 2 full batches of 8 different sequences (the
    2 left over sit out that epoch), never a short batch across the epoch boundary."""
    cls = drafter_class(target_dir, "mtp")
    batches, real = [], cls.loss
    monkeypatch.setattr(cls, "loss", lambda self, target, tok, *a, **k: (
        self.training and batches.append([tuple(r) for r in tok.tolist()])) or real(self, target, tok, *a, **k))
    run(target_dir, "mtp", "--n-seqs", "10", "--max-steps", "7", "--eval-every", "1000")
    assert [len(b) for b in batches] == [4] * 7
    for e in range(3):  # epochs 0, 1, 2 (steps 0-1, 2-3, 4-5)
        rows = sum(batches[2 * e:2 * e + 2], [])
        assert len(set(rows)) == 8, e


def test_training_leaves_the_target_alone(target_dir, tmp_path, monkeypatch):
    """The target is frozen, its embedding (whose <|mask|> row DFlash feeds) and head included:
    after a run the target's weights in memory are still its checkpoint's. (The saved hash is
    taken before training, so no load check would notice a target that moved.)"""
    loaded, real = [], train_drafter.load_target
    monkeypatch.setattr(train_drafter, "load_target", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    run(target_dir, "dflash", "--out-dir", str(tmp_path))
    ref = load_target(str(target_dir / "target.pt")).state_dict()
    assert len(loaded) == 1 and all(torch.equal(v, ref[k]) for k, v in loaded[0].state_dict().items())
    # and no gradient flows into it: gradients of the frozen head and embedding, which no
    # optimizer uses, made a dflash step of the cpu preset's size ~1.9x slower (measured)
    assert all(p.grad is None for p in loaded[0].parameters())


def test_model_flags_reach_each_drafter_model():
    """--block-size, --dflash-layers, --dflash-features, --anchors, --loss-decay, --ttt-steps and
    --mtp-depth shape the models (every other test leaves them at their defaults)."""
    cfg = Config(vocab_size=64, **{**PRESETS["tiny"], "n_layer": 6})
    make = lambda m, *a: train_drafter.make_drafter_model(m, argparse.Namespace(cfg=cfg), train_drafter.apply_recipe(
        train_drafter.get_parser().parse_args(["--method", m, *a])))
    df = make("dflash", "--block-size", "8", "--dflash-layers", "1", "--dflash-features", "3", "--anchors", "5",
              "--loss-decay", "2")
    assert df.config_dict() == dict(n_layer=1, n_features=3, block_size=8, anchors=5, gamma=2.0, mask_id=63)
    assert df.hidden_layers == (1, 4, 6) and len(df.layers) == 1
    assert make("eagle", "--ttt-steps", "3").ttt_steps == 3
    assert make("mtp", "--mtp-depth", "2").config_dict() == {"depth": 2}


def test_distillation_data_is_rebuilt_for_other_counts_or_lengths(fake_distill, tmp_path, capsys):
    """Other --n-seqs, --prompt-len or --gen-len make data of another shape: a cached file of
    the old one must not be reused."""
    base = dict(DISTILL, out_dir=str(tmp_path))  # 4 sequences of 4 + 3 tokens
    for change in [{}, {"n_seqs": 6}, {"prompt_len": 5}, {"gen_len": 2}, {}]:
        a = {**base, **change}
        train, _ = train_drafter.get_distill_data(None, argparse.Namespace(**a), "abc")
        assert train.shape == (a["n_seqs"], a["prompt_len"] + a["gen_len"]), change
    assert capsys.readouterr().out.count("distill: reusing") == 1


@pytest.mark.parametrize("flag, value", [("n_seqs", 9), ("n_val_seqs", 9), ("prompt_len", 9), ("gen_len", 9),
                                         ("distill_temperatures", "0"), ("seed", 9), ("batch_size", 9), ("lr", 0.1),
                                         ("continuation_only", True), ("dflash_layers", 9), ("dflash_features", 3),
                                         ("block_size", 9), ("loss_decay", 9.0), ("anchors", 9)])
def test_resume_refuses_each_flag_that_shapes_a_dflash_run(tmp_path, flag, value):
    """Every data, optimisation and model flag of the run is compared (written out here, not
    read from RUN_FLAGS, so that a flag dropped there is caught); --minutes and --max-steps may change."""
    args = train_drafter.apply_recipe(train_drafter.get_parser().parse_args(["--method", "dflash"]))
    args.dflash_features = 5  # as main sets it before the comparison
    path = str(tmp_path / "dflash.run.pt")
    save_checkpoint(path, dict(kind="dflash", config={}, state_dict={}, optimizer={}, target_hash="h", args=dict(vars(args))))
    args.minutes, args.max_steps = 99.0, 7
    train_drafter.load_run(path, args, "h")
    setattr(args, flag, value)
    with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
        train_drafter.load_run(path, args, "h")


def test_dflash_features_default_and_range():
    """5 target layers by default, every layer of a shallower target; 0 and more than the target has are refused."""
    n = lambda given, n_layer: train_drafter.dflash_features(argparse.Namespace(dflash_features=given), n_layer)
    assert (n(None, 6), n(None, 3), n(1, 6), n(6, 6)) == (5, 3, 1, 6)
    for bad in (0, 7):
        with pytest.raises(ValueError, match=r"1\.\.6"):
            n(bad, 6)


def test_the_longest_block_a_sequence_labels_is_accepted():
    """The upper bound is inclusive: 16 + 24 tokens label a block of 39 from anchor 1, and of 25
    from the prompt's last token with --continuation-only (one more is refused above)."""
    a = argparse.Namespace(prompt_len=16, gen_len=24, continuation_only=False, block_size=39, loss_decay=None)
    train_drafter.check_block_args(a)
    train_drafter.check_block_args(argparse.Namespace(**{**vars(a), "continuation_only": True, "block_size": 25}))
