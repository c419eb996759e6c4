"""train_drafter.py end to end on a tiny random target (seconds): each method trains, saves a
checkpoint that its drafter loads and that decodes losslessly, and another target refuses; a
killed run resumes; the distillation data is built once and then reused; the recipe's pieces
do what they say, and bad flags are refused before any work."""
import argparse
import os
import re
import shlex
import sys

import numpy as np
import pytest
import torch

import checkpoint
import data
import speculate
import train
import train_drafter
from checkpoint import load_target
from model import PRESETS, Config, Transformer
from test_model import save_tiny  # a random tiny target in train.py's checkpoint format

ARGS = ["--n-seqs", "8", "--n-val-seqs", "4", "--prompt-len", "16", "--gen-len", "24",
        "--max-steps", "3", "--minutes", "5", "--batch-size", "4", "--eval-every", "2",
        "--threads", "1"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    data.prepare()  # token bins into out/data (about 10 s the first time, cached after)
    d = tmp_path_factory.mktemp("drafters")
    save_tiny(d / "target.pt", seed=0)
    save_tiny(d / "other.pt", seed=1)
    return d


def run(target_dir, method, *extra, target="target.pt"):
    train_drafter.main(train_drafter.get_parser().parse_args(
        ["--method", method, "--target", str(target_dir / target), *ARGS, *extra]))


def parse(method, *flags):
    """Parsed flags with the method's recipe applied, as main sees them."""
    args = train_drafter.get_parser().parse_args(["--method", method, *flags])
    return train_drafter.apply_recipe(args)


def spy_loss(monkeypatch, method, record):
    """record(model, target, tokens, feats, **kw) is called before every loss of method's drafter
    (training's and evaluate's; model.training tells them apart)."""
    cls, real = train_drafter.MODELS[method], train_drafter.MODELS[method].loss

    def loss(self, *a, **k):
        record(self, *a, **k)
        return real(self, *a, **k)
    monkeypatch.setattr(cls, "loss", loss)


# -----------------------------------------------------------------------------
# end to end


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_each_method_trains_saves_and_loads(target_dir, method, capsys):
    run(target_dir, method)
    out = capsys.readouterr().out
    # 8 sequences in batches of 4: steps 0-1 are epoch 0, step 2 starts epoch 1
    assert "done: 3 steps in " in out and "| epoch 1 | train " in out
    assert "top-1 agreement per position" in out
    target = load_target(str(target_dir / "target.pt"))
    drafter = checkpoint.load_drafter(method, target, str(target_dir))
    prompts = [[5, 6, 7, 8], [9, 10]]
    plain, _ = speculate.generate(target, prompts, None, max_new_tokens=12)
    spec, _ = speculate.generate(target, prompts, drafter, max_new_tokens=12, K=3)
    assert spec == plain
    other = load_target(str(target_dir / "other.pt"))
    with pytest.raises(ValueError, match="retrain"):
        checkpoint.load_drafter(method, other, str(target_dir))


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_features_computed_per_step_train_the_same_drafter(target_dir, tmp_path, method):
    """--features step computes each batch's target features as it trains instead of keeping
    them all: the same batches, anchors and updates, so the same weights up to rounding."""
    sd = {}
    for mode in ("once", "step"):
        run(target_dir, method, "--out-dir", str(tmp_path / mode), "--features", mode)
        sd[mode] = torch.load(tmp_path / mode / f"{method}.pt", weights_only=True)["state_dict"]
    for k, v in sd["once"].items():
        torch.testing.assert_close(sd["step"][k], v, rtol=1e-4, atol=1e-5)


def test_features_that_do_not_fit_in_memory_name_the_flag_that_helps(target_dir, tmp_path,
                                                                     monkeypatch):
    """--features once allocates every sequence's features up front. Where that fails (the CPU
    allocator's RuntimeError; CUDA's OutOfMemoryError is one too) the error names --features
    step, and --features step, which allocates only a batch's, still trains."""
    run(target_dir, "dflash", "--out-dir", str(tmp_path))  # the distillation data, cached
    real = torch.Tensor.new_empty

    def new_empty(self, *size, **kw):  # all 8 training sequences' features at once: too many
        if len(size) == 3 and size[0] == 8:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator:"
                               " can't allocate memory: you tried to allocate 56371445760 bytes.")
        return real(self, *size, **kw)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    with pytest.raises(ValueError, match=r"features of 8 sequences do not fit in memory .*"
                                         r"can't allocate.*: try --features step"):
        run(target_dir, "dflash", "--out-dir", str(tmp_path))
    run(target_dir, "dflash", "--out-dir", str(tmp_path), "--features", "step", "--batch-size", "4")


def test_a_damaged_distillation_cache_is_named_not_a_traceback(target_dir, tmp_path):
    run(target_dir, "mtp", "--out-dir", str(tmp_path))
    cache = next(tmp_path.glob("distill_*.pt"))
    cache.write_bytes(cache.read_bytes()[:100])  # cut short
    with pytest.raises(ValueError, match=re.escape(cache.name) + r" is damaged .*delete it to rebuild"):
        run(target_dir, "mtp", "--out-dir", str(tmp_path))


def test_the_printed_bench_command_measures_the_new_drafter(target_dir, tmp_path, capsys):
    """A drafter trained into a folder without its target: train_drafter prints the bench
    command that measures it (--target names the target), and that command runs it
    losslessly."""
    import bench
    committed = os.path.join(data.REF_WEIGHTS, "target.pt")  # which a fresh clone has
    assert train_drafter.get_parser().parse_args(["--method", "mtp"]).target == committed
    run(target_dir, "mtp", "--out-dir", str(tmp_path))
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    assert hint.startswith("measure it: python bench.py --target ")
    assert "../" not in hint  # tmp_path is absolute
    argv = shlex.split(hint.split("bench.py", 1)[1])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def parse(line):\n")
    rows = bench.main(argv + ["--temperatures", "0", "--prompts", str(prompts),
                              "--max-new-tokens", "8"])
    assert [r["method"] for r in rows] == ["ar", "mtp"] and rows[1]["lossless"] is True


def test_training_leaves_the_target_alone(target_dir, tmp_path, monkeypatch):
    """The target is frozen, its embedding (whose <|mask|> row DFlash feeds) and head included:
    after a run the target's weights in memory are still its checkpoint's. (The saved hash is
    taken before training, so no load check would notice a target that moved.)"""
    loaded, real = [], train_drafter.load_target

    def load(*a, **k):
        loaded.append(real(*a, **k))
        return loaded[-1]
    monkeypatch.setattr(train_drafter, "load_target", load)
    run(target_dir, "dflash", "--out-dir", str(tmp_path))
    ref = load_target(str(target_dir / "target.pt")).state_dict()
    assert len(loaded) == 1
    assert all(torch.equal(v, ref[k]) for k, v in loaded[0].state_dict().items())
    # and no gradient flows into it: gradients of the frozen head and embedding, which no
    # optimizer uses, made a dflash step of the cpu preset's size ~1.9x slower (measured)
    assert all(p.grad is None for p in loaded[0].parameters())


def test_default_out_dir_never_overwrites_the_committed_weights(tmp_path):
    committed = data.REF_WEIGHTS  # the folder of weights/cpu/target.pt
    assert data.out_dir_for(committed) == os.path.join(data.DATA_OUT, "cpu", "weights")
    assert data.out_dir_for(str(tmp_path)) == str(tmp_path)


# -----------------------------------------------------------------------------
# resume


class Interrupted(Exception):
    pass


def killed_after(step):
    """A save_checkpoint for train.py's train_loop that dies right after writing the run's state
    at `step`, as a process killed there would."""
    real = train.save_checkpoint

    def save(path, obj):
        real(path, obj)
        if obj["step"] == step:
            raise Interrupted
    return save


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_a_killed_run_resumes_from_its_last_save(target_dir, tmp_path, method, monkeypatch,
                                                 capsys):
    """A 10-step run killed right after its save at step 5 leaves its state in <method>.run.pt
    and no drafter; the same command plus --resume continues it to step 10 with its optimizer
    and removes the run file. The clock continues too: a run saved past --minutes ends at
    once. The resumed steps draw their own random stream (DFlash's anchors), seeded by --seed +
    the step, not step 0's again."""
    def run_10_steps(*extra):
        run(target_dir, method, "--out-dir", str(tmp_path), "--max-steps", "10",
            "--batch-size", "2", "--save-minutes", "1e-9", *extra)
        return torch.load(tmp_path / f"{method}.pt", weights_only=True)

    streams = [[]]  # the global generator at each training step (evaluate's has its own seed)
    spy_loss(monkeypatch, method,
             lambda m, *a, **k: m.training and streams[-1].append(torch.get_rng_state()))
    with monkeypatch.context() as m, pytest.raises(Interrupted):
        m.setattr(train, "save_checkpoint", killed_after(5))
        run_10_steps()
    state = tmp_path / f"{method}.run.pt"
    late = torch.load(state, weights_only=True)
    assert late["step"] == 5 and not (tmp_path / f"{method}.pt").exists()  # no half a drafter
    capsys.readouterr()
    streams.append([])
    resumed = run_10_steps("--resume")
    assert f"resuming {state} at step 5" in capsys.readouterr().out and not state.exists()
    assert len(streams[1]) == 5
    assert not any(torch.equal(a, b) for a in streams[0] for b in streams[1])
    torch.manual_seed(0 + 5)  # --seed (0) + the step it resumes at, not some other re-seed
    assert torch.equal(streams[1][0], torch.get_rng_state())
    assert resumed["step"] == 10
    assert all(s["step"] == 10 for s in resumed["optimizer"]["state"].values())

    late["elapsed"] = 1e6
    torch.save(late, tmp_path / "late.pt")
    ended = run_10_steps("--resume", str(tmp_path / "late.pt"))
    assert ended["elapsed"] > 1e6 and ended["step"] == 5  # no step taken
    assert all(torch.equal(v, late["state_dict"][k]) for k, v in ended["state_dict"].items())


def test_resume_refuses_another_target_or_method_before_any_work(target_dir, tmp_path):
    """A run for another target or of another method: refused in one line before the
    distillation data is built (minutes, at real sizes)."""
    run(target_dir, "dflash", "--out-dir", str(tmp_path / "a"))
    done = str(tmp_path / "a" / "dflash.pt")
    for method, target, why in [("dflash", "other.pt", "trained for target"),
                                ("eagle", "target.pt", "'dflash' checkpoint")]:
        with pytest.raises(ValueError, match=why):
            run(target_dir, method, "--out-dir", str(tmp_path / "c"), "--resume", done,
                target=target)
    assert not (tmp_path / "c").exists()


def test_a_resumed_run_takes_the_model_shape_from_its_file(target_dir, tmp_path):
    """--resume rebuilds the drafter the file holds (here a finished run, extended with more
    steps); a model flag given against it is refused before the distillation (it was ignored)."""
    run(target_dir, "dflash", "--out-dir", str(tmp_path), "--dflash-layers", "1")
    with pytest.raises(ValueError, match="keeps its own n_layer 1 .*leave those flags out"):
        run(target_dir, "dflash", "--out-dir", str(tmp_path), "--resume", "--dflash-layers", "3")
    run(target_dir, "dflash", "--out-dir", str(tmp_path), "--resume", "--max-steps", "4")
    ck = torch.load(tmp_path / "dflash.pt", weights_only=True)
    assert ck["step"] == 4 and ck["config"]["n_layer"] == 1


# -----------------------------------------------------------------------------
# the distillation data


def test_distillation_data_is_built_once_then_reused(target_dir, capsys):
    run(target_dir, "dflash", "--max-steps", "1")
    run(target_dir, "dflash", "--max-steps", "1")
    assert "distill: reusing" in capsys.readouterr().out.split("done: 1 steps")[1]
    files = list(target_dir.glob("distill_*.pt"))
    assert len(files) == 1
    d = torch.load(files[0], weights_only=True)
    assert d["train"].shape == (8, 16 + 24) and d["val"].shape == (4, 16 + 24)


def test_two_targets_sharing_an_out_dir_get_their_own_distillation_data(target_dir, tmp_path,
                                                                        capsys):
    """The cached data is the target's own text, so its file is named by the target's hash."""
    for name in ("target.pt", "other.pt"):
        run(target_dir, "mtp", "--out-dir", str(tmp_path), "--max-steps", "1", target=name)
    assert "distill: reusing" not in capsys.readouterr().out
    assert len(list(tmp_path.glob("distill_*.pt"))) == 2


@pytest.fixture
def fake_distill(monkeypatch):
    """No target: generate returns zeros and records its temperature, seed and batch, load_tokens
    returns a counting stream and records its split and corpus."""
    seen = {"temperatures": [], "seeds": [], "splits": [], "corpora": [], "batches": []}

    def gen(target, prompts, drafter, *, max_new_tokens, temperature=0.0, seed=None, **kw):
        seen["temperatures"].append(temperature)
        seen["seeds"].append(seed)
        seen["batches"].append(len(prompts))
        return [[0] * max_new_tokens for _ in prompts], {}

    def load_tokens(split, corpus="small"):
        seen["splits"].append(split)
        seen["corpora"].append(corpus)
        return np.arange(1000, dtype=np.uint16)
    monkeypatch.setattr(speculate, "generate", gen)
    monkeypatch.setattr(data, "load_tokens", load_tokens)
    return seen


DISTILL = dict(n_seqs=4, n_val_seqs=2, prompt_len=4, gen_len=3, distill_temperatures=[0.0],
               seed=0, corpus="small", distill_batch=32)


def distill(tmp_path, **change):
    """get_distill_data with DISTILL's settings, changed by change, into tmp_path."""
    args = argparse.Namespace(**{**DISTILL, "out_dir": str(tmp_path), **change})
    return train_drafter.get_distill_data(None, args, "abc")


def test_distill_temperatures_cycle_per_batch(fake_distill):
    out = train_drafter.build_distill_data(None, 6, 4, 3, [0.0, 1.0], batch=2)
    assert out.shape == (6, 7) and fake_distill["temperatures"] == [0.0, 1.0, 0.0]


def test_a_batch_larger_than_the_data_still_gives_every_temperature_its_batch(fake_distill):
    """--distill-batch 2048 (a GPU's) over 6 held-out sequences: one batch would be all greedy."""
    train_drafter.build_distill_data(None, 6, 4, 3, [0.0, 1.0], batch=2048)
    assert fake_distill["temperatures"] == [0.0, 1.0] and fake_distill["batches"] == [3, 3]


def test_each_distillation_batch_samples_with_its_own_seed(fake_distill):
    """Batches continue different prompts, but one seed for all would give every sampled
    (T = 1) batch the same random stream: correlated continuations across the data set."""
    train_drafter.build_distill_data(None, 6, 4, 3, [1.0], seed=5, batch=2)
    assert len(fake_distill["seeds"]) == 3 and len(set(fake_distill["seeds"])) == 3


def test_distillation_progress_is_a_line_per_batch_in_a_log_and_one_line_on_a_terminal(
        fake_distill, capsys, monkeypatch):
    """Rewritten in place with \\r, the progress ran together into one long line in a log file
    (a redirected run of bench that trains its drafters). Not a terminal: a line per batch."""
    train_drafter.build_distill_data(None, 6, 4, 3, [0.0], batch=2)
    lines = capsys.readouterr().out.splitlines(keepends=True)
    want = [f"distill (train): {k}/6 sequences" for k in (2, 4, 6)]
    assert [line.split(" | ")[0] for line in lines] == want, lines
    assert all(line.endswith(" s\n") and "\r" not in line for line in lines)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    train_drafter.build_distill_data(None, 6, 4, 3, [0.0], batch=2)
    out = capsys.readouterr().out
    assert out.count("\rdistill (train): ") == 3, repr(out)
    assert out.count("\n") == 1 and out.endswith(" s\n"), repr(out)


def test_validation_distill_data_comes_from_the_val_split(fake_distill, tmp_path):
    train, val = distill(tmp_path)
    assert fake_distill["splits"] == ["train", "val"]
    assert train.shape == (4, 7) and val.shape == (2, 7)


def test_the_prompts_come_from_the_corpus_named(fake_distill, tmp_path):
    distill(tmp_path, corpus="all")
    assert fake_distill["corpora"] == ["all", "all"]
    assert parse("dflash").corpus == "small" and parse("dflash", "--corpus", "all").corpus == "all"


def test_distillation_data_is_rebuilt_when_a_setting_that_shapes_it_changes(fake_distill,
                                                                            tmp_path, capsys):
    """Other temperatures, seed, counts, lengths, corpus or generation batch make other data:
    reusing the cached file would train on the wrong text without a word."""
    changes = [{}, {"distill_temperatures": [0.0, 1.0]}, {"seed": 1}, {"n_val_seqs": 3},
               {"n_seqs": 6}, {"prompt_len": 5}, {"gen_len": 2}, {"corpus": "all"},
               {"distill_batch": 2}, {}]
    for change in changes:
        train, _ = distill(tmp_path, **change)
        a = {**DISTILL, **change}
        assert train.shape == (a["n_seqs"], a["prompt_len"] + a["gen_len"]), change
    assert capsys.readouterr().out.count("distill: reusing") == 1  # the last, a repeat
    assert len(list(tmp_path.glob("distill_*.pt"))) == len(changes) - 1


def test_distill_temperatures_are_numbers():
    assert parse("eagle").distill_temperatures == [0.0, 1.0]  # the default, parsed too
    assert parse("eagle", "--distill-temperatures", "0.0,1").distill_temperatures == [0.0, 1.0]
    with pytest.raises(SystemExit):
        parse("eagle", "--distill-temperatures", "0,hot")


# -----------------------------------------------------------------------------
# flags and the recipe


@pytest.mark.parametrize("flags,message", [
    (["--loss-decay", "0"], "--loss-decay must be > 0"),
    (["--block-size", "40"], r"--block-size must be in 2\.\.39"),
    (["--block-size", "26", "--continuation-only"], r"must be in 2\.\.25"),
    (["--save-minutes", "-1"], "--save-minutes must be >= 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--distill-temperatures", "0,-1"], "--distill-temperatures must each be >= 0 and finite"),
    (["--distill-temperatures", "nan"], "--distill-temperatures must each be >= 0 and finite"),
    # 16 + 240 = the tiny target's 256: generate keeps a position free, so this is one too many
    (["--gen-len", "240"], "--prompt-len \\+ --gen-len must be below the target's context of 256")])
def test_drafter_flags_that_would_be_ignored_or_cut_are_refused(target_dir, tmp_path, flags,
                                                                message):
    """--loss-decay 0 fell back to the default, and a block past the sequence had no labels."""
    with pytest.raises(ValueError, match=message):
        run(target_dir, "dflash", "--out-dir", str(tmp_path), *flags)
    assert not list(tmp_path.iterdir())  # refused before the distillation


@pytest.mark.parametrize("method,flag,owner", [("eagle", "--block-size", "dflash"),
                                               ("mtp", "--loss-decay", "dflash"),
                                               ("dflash", "--ttt-steps", "eagle")])
def test_another_methods_flags_are_refused(target_dir, tmp_path, method, flag, owner):
    """They were ignored: --method eagle --block-size 8 trained the EAGLE it trains without."""
    with pytest.raises(ValueError, match=f"{flag} sets an option of {owner}, not {method}"):
        run(target_dir, method, "--out-dir", str(tmp_path), flag, "3")
    assert not list(tmp_path.iterdir())


def test_unset_flags_take_the_method_recipe_and_given_flags_win():
    eagle, dflash = parse("eagle"), parse("dflash")
    assert (eagle.batch_size, eagle.lr, eagle.loss_decay) == (2, 2e-3, None)
    assert (dflash.batch_size, dflash.lr, dflash.loss_decay) == (8, 6e-4, 4.0)
    given = parse("dflash", "--batch-size", "3", "--lr", "1e-3", "--loss-decay", "7")
    assert (given.batch_size, given.lr, given.loss_decay) == (3, 1e-3, 7.0)
    assert train_drafter.model_config(dflash)["gamma"] == 4.0


def test_model_flags_reach_each_drafter_model():
    """--block-size, --dflash-layers, --anchors, --loss-decay, --ttt-steps and --mtp-depth shape
    the models (every other test leaves them at their defaults). DFlash reads 5 target layers,
    every layer below the last of a shallower target."""
    def make(method, *flags, n_layer=6):
        cfg = Config(vocab_size=64, **{**PRESETS["tiny"], "n_layer": n_layer})
        args = parse(method, *flags)
        return train_drafter.MODELS[method](cfg, **train_drafter.model_config(args))
    df = make("dflash", "--block-size", "8", "--dflash-layers", "1", "--anchors", "5",
              "--loss-decay", "2")
    want = dict(n_layer=1, n_features=5, block_size=8, anchors=5, gamma=2.0, mask_id=63)
    assert {k: df.config_dict()[k] for k in want} == want
    assert len(df.hidden_layers) == 5 and len(df.layers) == 1
    assert make("dflash", n_layer=3).hidden_layers == (1, 2)
    assert make("eagle", "--ttt-steps", "3").ttt_steps == 3
    assert make("mtp", "--mtp-depth", "2").config_dict() == {"depth": 2}


def test_the_longest_block_a_sequence_labels_is_accepted():
    """The upper bound is inclusive: 16 + 24 tokens label a block of 39 from anchor 1, and of 25
    from the prompt's last token with --continuation-only (one more is refused above)."""
    a = argparse.Namespace(prompt_len=16, gen_len=24, continuation_only=False, block_size=39)
    train_drafter.check_block_size(a)
    a.continuation_only, a.block_size = True, 25
    train_drafter.check_block_size(a)


# -----------------------------------------------------------------------------
# the training loop's pieces


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_continuation_only_scores_from_the_prompt_length(target_dir, method, monkeypatch):
    """By default every label is scored; with --continuation-only every training and evaluation
    loss is told that labels start at --prompt-len."""
    seen = []
    spy_loss(monkeypatch, method, lambda m, *a, **k: seen.append(k.get("label_from")))
    run(target_dir, method)
    assert seen and set(seen) == {0}
    seen.clear()
    run(target_dir, method, "--continuation-only")
    assert seen and set(seen) == {16}  # ARGS' --prompt-len


def test_evaluate_sums_agreement_over_all_batches():
    stats = iter([(1.0, [2, 1], [4, 4]), (3.0, [0, 1], [4, 2])])

    class Fake:
        def eval(self): pass
        def train(self): pass

        def loss(self, target, tok, feats, label_from):
            loss, a, c = next(stats)
            return torch.tensor(loss), {"agree": torch.tensor(a), "count": torch.tensor(c)}
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
    """Warm-up over the first 4 % of the run, cosine to zero, and one gradient clip at norm 1.0
    before every step. 50 steps, so 4 % is 2 of them."""
    lrs, clips = [], []
    real_step, real_clip = torch.optim.AdamW.step, torch.nn.utils.clip_grad_norm_

    def step(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    def clip(p, max_norm, *a, **k):
        clips.append(max_norm)
        return real_clip(p, max_norm, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    run(target_dir, "mtp", "--max-steps", "50", "--minutes", "1000", "--eval-every", "1000",
        "--lr", "1e-3")
    assert len(lrs) == 50 and clips == [1.0] * 50
    assert lrs[0] < lrs[1] < lrs[2] == pytest.approx(1e-3) == max(lrs)  # warm-up ends at step 2
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))                 # then only down ...
    assert lrs[26] == pytest.approx(0.5e-3) and lrs[-1] < 1e-5           # ... a cosine to ~0


def test_every_batch_is_full_and_no_sequence_repeats_within_an_epoch(target_dir, monkeypatch):
    """10 sequences in batches of 4: each epoch is 2 full batches of 8 different sequences (the
    2 left over sit out that epoch), never a short batch across the epoch boundary, and each
    epoch in another order: a permutation seeded by the seed alone, not (seed, epoch), passed
    the rest while replaying epoch 0's batches every epoch."""
    batches = []
    spy_loss(monkeypatch, "mtp", lambda m, target, tok, *a, **k:
             m.training and batches.append([tuple(r) for r in tok.tolist()]))
    run(target_dir, "mtp", "--n-seqs", "10", "--max-steps", "7", "--eval-every", "1000")
    assert [len(b) for b in batches] == [4] * 7
    for e in range(3):  # epochs 0, 1, 2 (steps 0-1, 2-3, 4-5)
        rows = sum(batches[2 * e:2 * e + 2], [])
        assert len(set(rows)) == 8, e
    assert batches[0:2] != batches[2:4] != batches[4:6]


def test_the_drafter_trains_on_the_features_it_drafts_with(target_dir, monkeypatch):
    """Training hands the loss the target's hidden states at the drafter's hidden_layers,
    concatenated in that order, as speculate.generate hands them to the drafter at inference.
    EAGLE on the 2-block tiny target reads layers (0, 1, 2): concatenated in another order
    (reversed, say) every run still trained, saved and decoded losslessly, on features the
    drafter never sees when it drafts."""
    seen = []
    spy_loss(monkeypatch, "eagle", lambda m, target, tok, feats, *a, **k:
             seen.append((m.hidden_layers, tok, feats)))
    run(target_dir, "eagle", "--max-steps", "1", "--eval-every", "1000")
    target = load_target(str(target_dir / "target.pt"))
    assert seen and len(seen[0][0]) == 3
    for layers, tok, feats in seen:  # the training step's and the evaluations'
        with torch.no_grad():
            want = torch.cat(target(tok, hidden_layers=layers)[1], -1)
        assert torch.allclose(feats, want, atol=1e-5)


def test_a_hugging_face_target_gets_a_drafter_that_exports_to_zlab(target_dir, tmp_path):
    """Issue 51's path for a real model: train_drafter.py on a Qwen3 folder (its prompts in the
    folder's tokenizer), dev/hf_export.py exports the drafter alone in z-lab's layout (the target
    is a Qwen3 folder already), and bench.py decodes with both, losslessly."""
    import bench
    from dev import hf_export
    hf, out = str(tmp_path / "qwen3"), str(tmp_path / "export")
    hf_export.save_hf_target(load_target(str(target_dir / "target.pt")), hf, dtype=torch.float32)
    hf_export.save_hf_tokenizer(data.get_encoding(), hf, data.PAT_STR)
    run(tmp_path, "dflash", "--dflash-layers", "1", target="qwen3")
    assert os.path.exists(tmp_path / "dflash.pt")  # beside the folder, as beside a .pt
    hf_export.main([out, "--target", hf, "--weights", str(tmp_path)])
    assert os.listdir(out) == ["dflash"]          # no second copy of the target
    rows = bench.main(["--target", hf, "--weights", os.path.join(out, "dflash"), "--methods",
                       "ar,dflash", "--temperatures", "0", "--n-prompts", "1",
                       "--max-new-tokens", "8", "--threads", "1"])
    assert [r["lossless"] for r in rows] == [True, True]


def test_a_coarser_tokenizer_gets_whole_prompts_from_windows_near_the_end(target_dir, monkeypatch):
    """A target with its own tokenizer (a Hugging Face folder) gets each window re-encoded. A
    window drawn near the end of the stream held as few as prompt_len of our tokens, which a
    coarser tokenizer turned into fewer: torch.tensor failed after the whole distillation."""
    class Coarser:  # 3/4 as many tokens for the same text
        def encode_ordinary(self, t):
            ids = data.get_encoding().encode_ordinary(t)
            return ids[::2] + ids[1::2][:len(ids) // 4]
    text = "def f(x):\n    return x + 1\n" * 40
    stream = np.array(data.get_encoding().encode_ordinary(text), dtype=np.uint16)
    monkeypatch.setattr(data, "load_tokens", lambda split, corpus="small": stream)
    target = load_target(str(target_dir / "target.pt"))
    out = train_drafter.build_distill_data(target, 64, 16, 4, [0.0], enc=Coarser(), batch=64)
    assert out.shape == (64, 20)

    class FiveTimesCoarser:  # past the 4x margin: refused at the first batch, before generating
        def encode_ordinary(self, t):
            return data.get_encoding().encode_ordinary(t)[::5]
    monkeypatch.setattr(speculate, "generate", None)
    with pytest.raises(ValueError, match="over 4x coarser than ours: 64 of our tokens re-encode"):
        train_drafter.build_distill_data(target, 64, 16, 4, [0.0], enc=FiveTimesCoarser())


@pytest.mark.parametrize("method", ["mtp", "eagle", "dflash"])
def test_a_drafters_loss_makes_no_tensor_on_another_device(method):
    """No test trains on a GPU. On the meta device (shapes, no data) a tensor made on the CPU by
    mistake inside a loss (an arange, a mask, an index without device=) meets the model's in an
    op and raises, as it would beside CUDA tensors; a clean loss runs up to its first copy to
    the host, which meta cannot make."""
    cfg = Config(vocab_size=97, **PRESETS["tiny"])
    with torch.device("meta"):
        target = Transformer(cfg)
        kw = {"depth": 2} if method == "mtp" else {}
        drafter = checkpoint.FEATURE_DRAFTERS[method](cfg, **kw)
        tokens = torch.randint(0, cfg.vocab_size, (2, 40))
        feats = torch.cat(target(tokens, hidden_layers=drafter.hidden_layers)[1], -1)
    assert tokens.is_meta and feats.is_meta
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        drafter.loss(target, tokens, feats, label_from=8)
