"""train.py really trains (validation loss falls on the tiny preset), and checkpoints are
checked on load: wrong tokenizer, corrupt file, bad prompts each give a clear error."""
import argparse
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import data
import mtp
import train
from checkpoint import export_checkpoint, load_target, save_checkpoint, load_checkpoint
from test_model import save_tiny, tiny_model

ROOT = data.ROOT


def test_lookup_hit_rate_and_the_quality_report_run():
    # 3 follows 1 2 earlier: a hit; after 1 2 3 comes 1, not 5: a miss; 5 has no earlier match, and
    # the last-token guess (5) is right; after 5 5 the lookup says 5, not 9: a miss
    assert train.lookup_hit_rate([1, 2, 3, 1, 2], [3, 5, 5, 9]) == 0.5
    assert train.lookup_hit_rate([1, 2, 3], [4, 5]) == 0.0  # no match anywhere
    # the whole report (train.py and bench's training run it): a random target at the real vocabulary
    q = train.quality_report(tiny_model(0, vocab=data.get_encoding().n_vocab), n_prompts=2, n_tokens=8)
    assert all(0.0 <= q[k] <= 1.0 for k in ("repeat8_greedy", "repeat8_sampled", "lookup_greedy", "lookup_real"))


def test_a_few_hundred_steps_lower_the_validation_loss(tmp_path):
    data.prepare()  # token bins into out/data (about 10 s the first time, cached after)
    out = tmp_path / "t.pt"
    args = train.get_parser().parse_args(["--preset", "tiny", "--max-steps", "200", "--minutes", "30",
                                          "--seq-len", "64", "--batch-size", "8", "--eval-every", "100",
                                          "--quality-prompts", "0", "--out-path", str(out), "--threads", "1"])
    train.main(args)
    ck = load_checkpoint(str(out), kind="target")
    assert ck["step"] == 200
    # ln(4098) = 8.3 nats at initialisation; 200 steps must get far below that
    assert ck["val_loss"] < 6.5, ck["val_loss"]
    # resuming continues the step count and the clock
    args.resume, args.max_steps = str(out), 210
    train.main(args)
    assert load_checkpoint(str(out))["step"] == 210


@pytest.mark.parametrize("mtp", [[], ["--mtp-depth", "1"]], ids=["target", "target+mtp"])
def test_a_resumed_run_is_the_run_that_was_interrupted(tmp_path, monkeypatch, capsys, mtp):
    """12 steps straight, or killed right after the save at step 6 and resumed: the same weights,
    bit for bit (the warm-up is counted in steps, so no rate comes from the clock here), native
    MTP heads included."""
    data.prepare()
    flags = mtp + ["--preset", "tiny", "--max-steps", "12", "--minutes", "30", "--seq-len", "32", "--batch-size", "4",
             "--eval-every", "100", "--eval-batches", "1", "--warmup-steps", "4", "--save-every", "6",
             "--quality-prompts", "0", "--threads", "1"]
    train.main(train.get_parser().parse_args(flags + ["--out-path", str(tmp_path / "whole.pt")]))
    real = train.save_checkpoint

    class Killed(Exception):
        pass

    def killed_after_step_6(path, obj):
        real(path, obj)
        if obj["step"] == 6:
            raise Killed
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(train, "save_checkpoint", killed_after_step_6)
        train.main(train.get_parser().parse_args(flags + ["--out-path", str(tmp_path / "cut.pt")]))
    cut, run_file = str(tmp_path / "cut.pt"), str(tmp_path / "cut.run.pt")
    # the killed run left its state in the run file, and no half-trained cut.pt for bench.py to take
    assert load_checkpoint(run_file)["step"] == 6 and not os.path.exists(cut)
    train.main(train.get_parser().parse_args(flags + ["--out-path", cut, "--resume", run_file]))
    whole, resumed = load_checkpoint(str(tmp_path / "whole.pt")), load_checkpoint(cut)
    assert resumed["step"] == 12 and not os.path.exists(run_file)  # finished: nothing left to resume
    assert all(torch.equal(resumed["state_dict"][k], v) for k, v in whole["state_dict"].items())
    if mtp:
        assert whole["mtp_state_dict"] and all(torch.equal(resumed["mtp_state_dict"][k], v)
                                               for k, v in whole["mtp_state_dict"].items())

    # killed after its last save (step 12, to the run file) but before the final one: the resumed
    # run has no step left and still ends, writes the checkpoint and removes the run file
    os.remove(cut)

    def killed_at_the_final_save(path, obj):
        if path == cut:
            raise Killed
        real(path, obj)
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(train, "save_checkpoint", killed_at_the_final_save)
        train.main(train.get_parser().parse_args(flags + ["--out-path", cut]))
    with pytest.raises(ValueError, match=r"another run.*--lr 0.002 \(given 0.01\)"):  # not this run's flags
        train.main(train.get_parser().parse_args(flags + ["--out-path", cut, "--resume", run_file, "--lr", "1e-2"]))
    capsys.readouterr()
    train.main(train.get_parser().parse_args(flags + ["--out-path", cut, "--resume", run_file]))
    assert "final train none (no step was left)" in capsys.readouterr().out  # it said "nan"
    again = load_checkpoint(cut)
    assert again["step"] == 12 and not os.path.exists(run_file)
    assert all(torch.equal(again["state_dict"][k], v) for k, v in whole["state_dict"].items())


def test_save_due_counts_steps_and_minutes():
    a = lambda every, minutes: argparse.Namespace(save_every=every, save_minutes=minutes)
    assert train.save_due(a(500, 2.0), 500, 0.0) and not train.save_due(a(500, 2.0), 499, 119.9)
    assert train.save_due(a(500, 2.0), 499, 120.0)  # the clock, between step saves
    assert train.save_due(a(0, 2.0), 7, 120.0) and not train.save_due(a(0, 2.0), 500, 0.0)
    assert train.save_due(a(500, 0.0), 1000, 0.0) and not train.save_due(a(500, 0.0), 999, 1e9)
    assert not train.save_due(a(0, 0.0), 500, 1e9)  # both off: no run file


def test_a_run_saves_by_the_clock_counted_from_its_last_save(tmp_path, monkeypatch):
    """On a CPU 500 steps can take half an hour: with steps of 25 s on a fake clock, --save-minutes 1
    saves after steps 3, 6 and 9 (each 75 s after the last save), not only every --save-every
    steps, and the finished checkpoint comes at step 10."""
    data.prepare()
    clock = types.SimpleNamespace(now=1e6)
    clock.time = lambda: clock.now
    real_batch, real_save, saved = train.get_batch, train.save_checkpoint, []

    def batch_after_25_s(*a):
        clock.now += 25.0
        return real_batch(*a)
    monkeypatch.setattr(train, "time", clock)
    monkeypatch.setattr(train, "get_batch", batch_after_25_s)
    monkeypatch.setattr(train, "save_checkpoint", lambda path, obj: saved.append((os.path.basename(path), obj["step"]))
                        or real_save(path, obj))
    train.main(train.get_parser().parse_args(
        ["--preset", "tiny", "--max-steps", "10", "--minutes", "30", "--seq-len", "16", "--batch-size", "2",
         "--eval-every", "100", "--eval-batches", "1", "--quality-prompts", "0", "--threads", "1",
         "--save-every", "500", "--save-minutes", "1", "--out-path", str(tmp_path / "t.pt")]))
    assert saved == [("t.run.pt", 3), ("t.run.pt", 6), ("t.run.pt", 9), ("t.pt", 10)]


def test_a_new_run_replaces_an_unfinished_one_unless_it_saves_nothing(tmp_path, capsys):
    data.prepare()
    out, run_file = tmp_path / "t.pt", tmp_path / "t.run.pt"
    run_file.write_bytes(b"someone's run")
    flags = ["--preset", "tiny", "--max-steps", "2", "--minutes", "30", "--seq-len", "16", "--batch-size", "2",
             "--eval-every", "100", "--eval-batches", "1", "--quality-prompts", "0", "--threads", "1",
             "--out-path", str(out)]
    train.main(train.get_parser().parse_args(flags + ["--save-every", "0", "--save-minutes", "0"]))
    assert run_file.read_bytes() == b"someone's run" and "NOTE" not in capsys.readouterr().out
    train.main(train.get_parser().parse_args(flags))  # 2 steps, no save of its own: still its file to remove
    assert not run_file.exists() and "which this new run replaces" in capsys.readouterr().out
    assert load_checkpoint(str(out))["step"] == 2


def test_checkpoint_of_another_tokenizer_is_refused(tmp_path):
    save_tiny(tmp_path / "t.pt", tokenizer="0123456789ab")
    with pytest.raises(ValueError, match="tokenizer"):
        load_target(str(tmp_path / "t.pt"))
    ck = load_checkpoint(str(tmp_path / "t.pt"))
    del ck["tokenizer"]  # no record of the tokenizer is no proof it is this one
    save_checkpoint(str(tmp_path / "u.pt"), ck)
    with pytest.raises(ValueError, match="trained with tokenizer None"):
        load_target(str(tmp_path / "u.pt"))


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    (tmp_path / "c.pt").write_bytes(b"\x80\x02garbage")
    with pytest.raises(ValueError, match="c.pt"):
        load_target(str(tmp_path / "c.pt"))
    save_checkpoint(str(tmp_path / "d.pt"), dict(kind="dflash", config={}, state_dict={}))
    with pytest.raises(ValueError, match="expected 'target'"):
        load_target(str(tmp_path / "d.pt"))


@pytest.mark.parametrize("prompt,max_new,message", [("", 8, "empty prompt"), ("x = 1\n" * 200, 8, "exceeds the context"),
                                                    ("def f(", 0, "--max-new-tokens must be >= 1")])
def test_model_cli_rejects_bad_prompts(tmp_path, prompt, max_new, message, run_script):
    save_tiny(tmp_path / "t.pt")
    rc, _, err = run_script("model.py", "--ckpt", str(tmp_path / "t.pt"), "--prompt", prompt,
                            "--max-new-tokens", str(max_new))
    assert rc != 0 and message in err, err[-500:]


@pytest.mark.parametrize("cmd,message", [(["train_drafter.py", "--method", "dflash", "--target", "missing.pt"], "no such checkpoint"),
                                         (["train_drafter.py", "--method", "dflash", "--block-size", "1"], "--block-size must be in 2..255"),
                                         (["train.py", "--preset", "tiny", "--batch-size", "0"], "--batch-size must be >= 1"),
                                         (["train.py", "--preset", "tiny", "--max-steps", "-1"], "--max-steps must be >= 0"),
                                         (["train.py", "--preset", "tiny", "--mtp-depth", "-1"], "--mtp-depth must be >= 0"),
                                         (["train.py", "--preset", "tiny", "--quality-prompts", "-1"], "--quality-prompts must be >= 0"),
                                         (["train_drafter.py", "--method", "mtp", "--max-steps", "-2"], "--max-steps must be >= 0"),
                                         (["train_drafter.py", "--method", "mtp", "--gen-len", "320"],
                                          "--prompt-len + --gen-len must be below the target's context of 384, got 64 + 320"),
                                         (["train.py", "--preset", "tiny", "--seq-len", "5000"], "outside the model's context"),
                                         (["train.py", "--preset", "tiny", "--device", "cuda:99"], "cuda:99")])
def test_training_clis_give_one_line_errors(tmp_path, cmd, message, run_script):
    rc, _, err = run_script(*cmd, cwd=tmp_path)
    assert rc == 1 and message in err, err[-800:]


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, run_script):
    """A folder named as the output file used to fail at the save, after the training."""
    (tmp_path / "a_file").write_text("x")
    for cmd in (["train.py", "--preset", "tiny", "--max-steps", "1", "--out-path", str(tmp_path)],
                ["train_drafter.py", "--method", "mtp", "--max-steps", "1", "--out-dir", str(tmp_path / "a_file")],
                ["model.py", "--export", str(tmp_path)]):
        rc, out, err = run_script(*cmd, cwd=tmp_path)
        assert rc == 1 and str(tmp_path) in err, err[-800:]
        assert "step" not in out and "distill" not in out, out[-800:]  # nothing ran first


TINY_RUN = ["train.py", "--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-every", "1",
            "--eval-batches", "1", "--quality-prompts", "0", "--out-path", "OUT/t.pt"]
SMALL_DISTILL = ["--n-seqs", "8", "--n-val-seqs", "2", "--gen-len", "16", "--eval-every", "1"]


@pytest.mark.parametrize("cmd,started,said", [
    (TINY_RUN + ["--save-every", "1"], "OUT/t.run.pt", "--resume OUT/t.run.pt"),
    (TINY_RUN, "step ", "interrupted before this run's first save to OUT/t.run.pt"),
    (TINY_RUN + ["--max-steps", "1", "--quality-prompts", "256", "--quality-tokens", "150"], "saved ",
     "interrupted: OUT/t.pt is saved; only its quality report was cut short"),
    (["train_drafter.py", "--method", "mtp", "--target", "OUT/t.pt", "--out-dir", "OUT", *SMALL_DISTILL, "--save-every", "1"],
     "OUT/mtp.run.pt", "--resume OUT/mtp.run.pt"),
    (["train_drafter.py", "--method", "mtp", "--target", "OUT/t.pt", "--out-dir", "OUT", "--gen-len", "64"],
     "distill (train): 32/", "sequences made so far are kept in OUT/distill_")])
def test_ctrl_c_says_how_to_continue(tmp_path, cmd, started, said):
    """A real SIGINT once the run is under way (started: a line it printed, or a file it saved):
    one line on how to continue, exit 130, no KeyboardInterrupt traceback. Training names the
    file --resume continues from once it has saved there, and says there is nothing to resume
    before (or, in the quality report after the final save, that the target is saved);
    distilling, which has no run state yet, names the file its sequences so far are kept in."""
    save_tiny(tmp_path / "t.pt")
    argv = [a.replace("OUT", str(tmp_path)) for a in cmd]
    log = tmp_path / "log"
    # a suite started by a script's `cmd &` inherits SIGINT ignored, and so would the child (its
    # Ctrl-C then does nothing); a handler here is reset to the default in the child by exec
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(log, "w") as f:  # a file, not a pipe: nothing blocks on a full pipe, and the wait has a deadline
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:], "--minutes", "5", "--threads", "1"],
                             cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    signal.signal(signal.SIGINT, before)
    try:
        deadline = time.time() + 120
        started = started.replace("OUT", str(tmp_path))
        under_way = lambda: os.path.exists(started) if started.endswith(".pt") else \
            any(l.startswith(started) for l in log.read_text().splitlines())
        while not under_way():
            assert p.poll() is None and time.time() < deadline, log.read_text()[-800:]
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        p.kill()
    out, want = log.read_text(), said.replace("OUT", str(tmp_path))
    assert p.returncode == 130 and want in out and "Traceback" not in out, out[-800:]


def test_check_args_and_eta():
    ok = argparse.Namespace(batch_size=1, minutes=None, max_steps=0, save_every=0, save_minutes=0.0, warmup_steps=0, lr=1e-3)
    train.check_args(ok, ["batch_size"], zero_ok=["warmup_steps"])
    for bad, message in [({"batch_size": 0}, "--batch-size must be >= 1, got 0"), ({"minutes": 0}, "--minutes must be > 0"),
                         ({"max_steps": -1}, "--max-steps must be >= 0"), ({"minutes": float("nan")}, "--minutes must be > 0"),
                         ({"threads": -1}, "--threads must be >= 0"), ({"save_every": -1}, "--save-every must be >= 0"),
                         ({"warmup_steps": -5}, "--warmup-steps must be >= 0"), ({"lr": -1.0}, "--lr must be > 0"),
                         ({"lr": 0.0}, "--lr must be > 0"), ({"save_minutes": -1.0}, "--save-minutes must be >= 0"),
                         ({"save_minutes": float("nan")}, "--save-minutes must be >= 0"),
                         ({"grad_clip": 0.0}, "--grad-clip must be > 0"), ({"grad_clip": float("nan")}, "--grad-clip must be > 0"),
                         ({"min_lr_frac": 1.5}, r"--min-lr-frac must be in 0..1, got 1.5"),
                         ({"min_lr_frac": float("nan")}, "--min-lr-frac must be in 0..1"),
                         ({"weight_decay": -5.0}, "--weight-decay must be >= 0, got -5.0"),
                         ({"mtp_lambda": float("nan")}, "--mtp-lambda must be >= 0")]:  # each nan trained a nan model
        with pytest.raises(ValueError, match=message):
            train.check_args(argparse.Namespace(**{**vars(ok), **bad}), ["batch_size"], zero_ok=["warmup_steps"])
    assert train.eta_s(600, 100, 10, None) == 500  # no step limit: what is left of the budget
    assert train.eta_s(600, 100, 10, 20) == 100    # 10 more steps at 10 s each end the run first
    assert train.eta_s(600, 700, 10, None) == 0    # past the budget (the last step ran over): 0, not negative


def test_lr_schedule_endpoints():
    args = argparse.Namespace(lr=1.0, warmup_steps=10, min_lr_frac=0.1)
    assert train.lr_at(0.0, 0, args) == pytest.approx(0.1)     # warm-up: step 0 already trains
    assert train.lr_at(0.0, 9, args) == pytest.approx(1.0)     # ... and reaches the peak
    assert train.lr_at(0.5, 10, args) == pytest.approx(0.55)   # cosine half-way
    assert train.lr_at(1.0, 10, args) == pytest.approx(0.1)    # fully decayed to lr * min_lr_frac


def test_every_parameter_group_follows_the_schedule(tmp_path):
    """The norm gains (no-decay group) warm up and decay with the matrices, not stay at the peak
    lr AdamW was built with: after 2 of 4 warm-up steps both groups are at lr * 2/4."""
    train.main(train.get_parser().parse_args(
        ["--preset", "tiny", "--max-steps", "2", "--minutes", "5", "--seq-len", "16", "--batch-size", "2",
         "--eval-batches", "1", "--quality-prompts", "0", "--lr", "0.01", "--warmup-steps", "4",
         "--out-path", str(tmp_path / "t.pt"), "--threads", "1", "--device", "cpu"]))
    groups = load_checkpoint(str(tmp_path / "t.pt"))["optimizer"]["param_groups"]
    assert len(groups) == 2 and [g["lr"] for g in groups] == [pytest.approx(0.005)] * 2


def test_bits_per_byte():
    """bits per byte = nats per token / ln 2 x tokens / bytes: token ids < 256 are single bytes,
    merged tokens are several."""
    import math
    enc = data.get_encoding()
    model = tiny_model(vocab=enc.n_vocab)
    xy = torch.randint(32, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    loss, bpb = train.evaluate(model, [xy], enc)
    assert bpb == pytest.approx(loss / math.log(2))
    xy = torch.randint(256, 4000, (2, 9), generator=torch.Generator().manual_seed(0))
    n_bytes = sum(len(enc.decode_bytes(row)) for row in xy[:, 1:].tolist())
    assert n_bytes > 2 * 8 * 2  # merged tokens: more than two bytes each on average
    loss, bpb = train.evaluate(model, [xy], enc)
    assert bpb == pytest.approx(loss / math.log(2) * 2 * 8 / n_bytes)


def test_native_mtp_loss_weight_is_lambda_over_depth(tmp_path, monkeypatch):
    totals, mtps = [], []
    real_backward, real_losses = torch.Tensor.backward, mtp.MTP.losses
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: totals.append(self.item()) or real_backward(self, *a, **k))
    monkeypatch.setattr(mtp.MTP, "losses", lambda *a, **k: (lambda r: mtps.append(sum(l.item() for l in r[0])) or r)(real_losses(*a, **k)))
    for lam in ("0", "0.6"):
        train.main(train.get_parser().parse_args(
            ["--preset", "tiny", "--max-steps", "1", "--minutes", "5", "--seq-len", "16", "--batch-size", "2",
             "--eval-batches", "1", "--quality-prompts", "0", "--mtp-depth", "2", "--mtp-lambda", lam,
             "--out-path", str(tmp_path / f"t{lam}.pt"), "--threads", "1", "--device", "cpu"]))
    assert mtps[0] == pytest.approx(mtps[1])  # same seed, same first batch
    assert totals[1] - totals[0] == pytest.approx(0.6 / 2 * mtps[1], rel=1e-4)


def test_decay_only_on_matrices_and_the_clip_covers_the_mtp_heads(tmp_path, monkeypatch):
    """The optimisation settings the resume test cannot see (two runs that share a wrong setting
    still agree): AdamW decays the matrices only (not the RMSNorm gains), and one clip at
    --grad-clip per step spans every trained parameter, the native MTP heads included."""
    groups, clipped = [], []
    real_init, real_clip = torch.optim.AdamW.__init__, torch.nn.utils.clip_grad_norm_

    def init(self, params, *a, **k):
        params = list(params)
        groups.extend(params)
        real_init(self, params, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "__init__", init)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda p, max_norm, *a, **k: clipped.append((list(p), max_norm)) or real_clip(p, max_norm, *a, **k))
    heads = []
    real_mtp_init = mtp.MTP.__init__
    monkeypatch.setattr(mtp.MTP, "__init__", lambda self, *a, **k: heads.append(self) or real_mtp_init(self, *a, **k))
    train.main(train.get_parser().parse_args(
        ["--preset", "tiny", "--max-steps", "2", "--minutes", "5", "--seq-len", "16", "--batch-size", "2",
         "--eval-batches", "1", "--quality-prompts", "0", "--mtp-depth", "1", "--weight-decay", "0.3",
         "--grad-clip", "0.7", "--out-path", str(tmp_path / "t.pt"), "--threads", "1", "--device", "cpu"]))
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.3 for p in g["params"]}
    kept = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    trained = list(heads[0].parameters())
    assert decayed and kept and all(p.dim() >= 2 for g in groups for p in g["params"] if id(p) in decayed)
    assert all(p.dim() < 2 for g in groups for p in g["params"] if id(p) in kept)
    assert len(clipped) == 2 and all(m == 0.7 for _, m in clipped)
    clip_ids = {id(p) for p in clipped[0][0]}
    assert {id(p) for p in trained} <= clip_ids and clip_ids == decayed | kept  # every trained parameter


def test_check_run_flags_names_every_flag_that_differs():
    """The first flag of the list counts as much as the last: each that differs is named."""
    saved, flags = {"preset": "tiny", "seed": 0, "lr": 1e-3}, ("preset", "seed", "lr")
    train.check_run_flags("r.pt", saved, argparse.Namespace(**saved), flags)  # the same run
    with pytest.raises(ValueError, match=r"--preset tiny \(given cpu\), --lr 0.001 \(given 0.01\)$"):
        train.check_run_flags("r.pt", saved, argparse.Namespace(preset="cpu", seed=0, lr=1e-2), flags)


def test_claim_run_file_owns_the_file_it_resumed_from_and_only_that(tmp_path, capsys):
    """A run resumed from <out>.run.pt owns it (removes it when done) even when it saves nothing,
    however the path is spelled, and says nothing of replacing it; a run resumed from another
    file that saves nothing leaves it alone; a fresh run that saves, by steps or by the clock,
    says it replaces it."""
    run_file = str(tmp_path / "t.run.pt")
    open(run_file, "wb").close()
    claim = lambda resume, save_every, save_minutes=0.0: train.claim_run_file(
        run_file, argparse.Namespace(resume=resume, save_every=save_every, save_minutes=save_minutes))
    assert claim(run_file, 0) and claim(os.path.relpath(run_file), 0)
    assert not claim(str(tmp_path / "t.pt"), 0)  # extending a finished checkpoint
    assert claim(run_file, 500) and capsys.readouterr().out == ""
    assert claim(None, 500) and "which this new run replaces" in capsys.readouterr().out
    assert claim(None, 0, 2.0) and "which this new run replaces" in capsys.readouterr().out


def test_get_batch_draws_windows_of_seq_len_plus_one_consecutive_tokens():
    """Each row is seq_len + 1 consecutive tokens of the stream: inputs xy[:, :-1] and their
    next tokens xy[:, 1:]. One token short, every step would silently train on seq_len - 1
    positions, and the model's last position (max_seq_len - 1) never."""
    import numpy as np
    xy = train.get_batch(np.arange(1000, dtype=np.uint16), 8, 16, torch.Generator().manual_seed(0), "cpu")
    assert xy.shape == (8, 17) and xy.dtype == torch.int64
    assert torch.equal(xy - xy[:, :1], torch.arange(17).expand(8, 17))
    # every window can come up, the last one too (its last token is the stream's last)
    xy = train.get_batch(np.arange(12, dtype=np.uint16), 64, 10, torch.Generator().manual_seed(0), "cpu")
    assert set(xy[:, 0].tolist()) == {0, 1}


def test_a_resumed_run_continues_the_clock(tmp_path):
    """--resume continues the time budget, not only the step count: a run saved with its
    --minutes used up takes no further step (the clock restarting would hand it a whole new
    budget). --max-steps 4 would allow two more steps; only the clock ends it at 2."""
    data.prepare()
    flags = ["--preset", "tiny", "--minutes", "1", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1",
             "--quality-prompts", "0", "--threads", "1", "--device", "cpu", "--out-path", str(tmp_path / "t.pt")]
    train.main(train.get_parser().parse_args(flags + ["--max-steps", "2"]))
    ck = load_checkpoint(str(tmp_path / "t.pt"))
    ck["elapsed"] = 61.0  # past the 1-minute budget
    save_checkpoint(str(tmp_path / "late.pt"), ck)
    train.main(train.get_parser().parse_args(flags + ["--max-steps", "4", "--resume", str(tmp_path / "late.pt")]))
    assert load_checkpoint(str(tmp_path / "t.pt"))["step"] == 2


def tiny_run(tmp_path, *flags):
    """Parsed train.py flags of a tiny run writing tmp_path/t.pt (for tests that stop it early)."""
    data.prepare()
    return train.get_parser().parse_args(["--preset", "tiny", "--minutes", "1", "--quality-prompts", "0",
                                          "--out-path", str(tmp_path / "t.pt"), *flags])


@pytest.mark.parametrize("flag, value", [("preset", "cpu"), ("seed", 9), ("batch_size", 9), ("seq_len", 9), ("lr", 0.1),
                                         ("min_lr_frac", 0.5), ("warmup_steps", 9), ("weight_decay", 0.5),
                                         ("grad_clip", 0.5), ("mtp_depth", 1), ("mtp_lambda", 0.5)])
def test_resume_refuses_each_flag_that_shapes_a_target_run(tmp_path, flag, value):
    """Every flag that shapes the run is compared on --resume, refused before any work (written
    out here, not read from RUN_FLAGS, so that a flag dropped there is caught: another --seq-len
    or --mtp-depth went on training the saved run under the new value without a word)."""
    run_file = str(tmp_path / "t.run.pt")
    save_checkpoint(run_file, dict(kind="target", config={}, state_dict={}, args=vars(tiny_run(tmp_path)), step=0,
                                   elapsed=0.0))
    args = tiny_run(tmp_path, "--resume", run_file)
    setattr(args, flag, value)
    with pytest.raises(ValueError, match="another run.*--" + flag.replace("_", "-")):
        train.main(args)


def test_a_seq_len_past_the_context_is_refused_before_the_model_is_built(tmp_path):
    """One token past the context (the default --seq-len is all of it) is refused up front, not
    by the first training step's forward after the model and data are set up."""
    with pytest.raises(ValueError, match=r"--seq-len 257 is outside the model's context \(1..256\)"):
        train.main(tiny_run(tmp_path, "--seq-len", "257"))
    with pytest.raises(ValueError, match=r"--seq-len 0 is outside"):  # 0 trained at the whole context
        train.main(tiny_run(tmp_path, "--seq-len", "0"))


def test_resuming_an_exported_checkpoint_says_its_optimizer_starts_afresh(tmp_path, capsys):
    """model.py --export drops the optimizer and the batch stream's state: --resume of such a
    file goes on from its weights, and says that this is not the run continued."""
    flags = ["--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--threads", "1", "--device", "cpu"]
    train.main(tiny_run(tmp_path, *flags, "--max-steps", "1"))
    export_checkpoint(str(tmp_path / "t.pt"), str(tmp_path / "e.pt"))
    capsys.readouterr()
    train.main(tiny_run(tmp_path, *flags, "--max-steps", "2", "--resume", str(tmp_path / "e.pt")))
    assert f"NOTE: {tmp_path / 'e.pt'} holds no optimizer state" in capsys.readouterr().out
    train.main(tiny_run(tmp_path, *flags, "--max-steps", "3", "--resume", str(tmp_path / "t.pt")))
    assert "NOTE" not in capsys.readouterr().out  # a finished run keeps its optimizer


def test_resume_takes_only_a_target_checkpoint(tmp_path):
    """A drafter's run file passed to train.py --resume is refused by its kind, in one line, not
    by a TypeError from building a target out of the drafter's config."""
    args = tiny_run(tmp_path, "--resume", str(tmp_path / "d.pt"))
    save_checkpoint(str(tmp_path / "d.pt"), dict(kind="dflash", config=dict(n_layer=2, block_size=16), state_dict={},
                                                 args=vars(args), step=0, elapsed=0.0))
    with pytest.raises(ValueError, match="is a 'dflash' checkpoint, expected 'target'"):
        train.main(args)
