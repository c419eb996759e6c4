"""train.py really trains (validation loss falls on the tiny preset), a killed run resumes, the
recipe's pieces (schedule, decay, clip, MTP weight, batches, bits per byte) do what they say,
and bad flags, checkpoints and prompts each give a clear one-line error."""
import argparse
import math
import os
import types

import numpy as np
import pytest
import torch

import data
import mtp
import train
from checkpoint import load_checkpoint, load_target, save_checkpoint
from dev.export_weights import export_checkpoint
from test_model import save_tiny, tiny_model

SMALL = ["--seq-len", "16", "--batch-size", "2", "--eval-batches", "1", "--threads", "1",
         "--device", "cpu"]


def tiny_run(tmp_path, *flags):
    """Parsed train.py flags of a tiny run writing tmp_path/t.pt; later flags win."""
    data.prepare()  # token bins into out/data (about 10 s the first time, cached after)
    return train.get_parser().parse_args(["--preset", "tiny", "--minutes", "1",
                                          "--out-path", str(tmp_path / "t.pt"), *flags])


# -----------------------------------------------------------------------------
# training


def test_a_few_hundred_steps_lower_the_validation_loss(tmp_path):
    args = tiny_run(tmp_path, "--max-steps", "200", "--minutes", "30", "--seq-len", "64",
                    "--batch-size", "8", "--eval-every", "100", "--threads", "1")
    train.main(args)
    ck = load_checkpoint(str(tmp_path / "t.pt"), kind="target")
    assert ck["step"] == 200
    # ln(4098) = 8.3 nats at initialisation; 200 steps must get far below that
    assert ck["val_loss"] < 6.5, ck["val_loss"]
    # resuming a finished run extends it
    args.resume, args.max_steps = str(tmp_path / "t.pt"), 210
    train.main(args)
    assert load_checkpoint(str(tmp_path / "t.pt"))["step"] == 210


# -----------------------------------------------------------------------------
# resume


@pytest.mark.parametrize("mtp", [[], ["--mtp-depth", "1"]], ids=["target", "target+mtp"])
def test_a_killed_run_resumes_from_its_last_save(tmp_path, monkeypatch, capsys, mtp):
    """Killed right after its save at step 6, a run leaves its state in the run file (and no
    half-trained checkpoint for bench.py to take); the same command plus --resume continues it
    to step 12 with its optimizer (AdamW's step count goes on from 6), native MTP heads
    included, and removes the run file."""
    flags = mtp + ["--max-steps", "12", "--minutes", "30", "--seq-len", "32", "--batch-size", "4",
                   "--eval-every", "100", "--eval-batches", "1", "--warmup-steps", "4",
                   "--save-minutes", "1e-9", "--threads", "1"]
    real = train.save_checkpoint

    class Killed(Exception):
        pass

    def killed_after_step_6(path, obj):
        real(path, obj)
        if obj["step"] == 6:
            raise Killed
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(train, "save_checkpoint", killed_after_step_6)
        train.main(tiny_run(tmp_path, *flags))
    out, run_file = str(tmp_path / "t.pt"), str(tmp_path / "t.run.pt")
    assert load_checkpoint(run_file)["step"] == 6 and not os.path.exists(out)
    capsys.readouterr()
    train.main(tiny_run(tmp_path, *flags, "--resume"))
    assert f"resuming {run_file} at step 6" in capsys.readouterr().out
    ck = load_checkpoint(out)
    assert ck["step"] == 12 and not os.path.exists(run_file)  # finished: nothing left to resume
    assert all(s["step"] == 12 for s in ck["optimizer"]["state"].values())
    assert bool(ck["mtp_state_dict"]) == bool(mtp)

    # killed after its last save (step 12, to the run file) but before the final one: the
    # resumed run has no step left and still ends, writes the checkpoint and removes the run file
    os.remove(out)

    def killed_at_the_final_save(path, obj):
        if path == out:
            raise Killed
        real(path, obj)
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(train, "save_checkpoint", killed_at_the_final_save)
        train.main(tiny_run(tmp_path, *flags))
    capsys.readouterr()
    train.main(tiny_run(tmp_path, *flags, "--resume", run_file))
    assert "| no step left: raise --minutes or --max-steps to go on |" in capsys.readouterr().out
    assert load_checkpoint(out)["step"] == 12 and not os.path.exists(run_file)


def test_a_run_saves_by_the_clock_counted_from_its_last_save(tmp_path, monkeypatch, capsys):
    """With steps of 25 s on a fake clock, --save-minutes 1 saves the run file after steps 3, 6
    and 9 (each 75 s after the last save), and the finished checkpoint comes at step 10. The ETA
    is the nearer end: --max-steps', or the budget's (never below 0 when a step ran past it)."""
    clock = types.SimpleNamespace(now=1e6)
    clock.time = lambda: clock.now
    real_batch, real_save, saved = train.get_batch, train.save_checkpoint, []

    def batch_after_25_s(*a):
        clock.now += 25.0
        return real_batch(*a)

    def save(path, obj):
        saved.append((os.path.basename(path), obj["step"]))
        real_save(path, obj)
    args = tiny_run(tmp_path, *SMALL, "--max-steps", "10", "--minutes", "30",
                    "--eval-every", "100", "--save-minutes", "1")
    monkeypatch.setattr(train, "time", clock)
    monkeypatch.setattr(train, "get_batch", batch_after_25_s)
    monkeypatch.setattr(train, "save_checkpoint", save)
    train.main(args)
    assert saved == [("t.run.pt", 3), ("t.run.pt", 6), ("t.run.pt", 9), ("t.pt", 10)]
    eta = lambda: [l.split("ETA ")[1] for l in capsys.readouterr().out.splitlines() if "ETA" in l]
    assert eta() == ["3.8 min"]  # after step 1 of 10: 9 more steps of 25 s
    train.main(tiny_run(tmp_path, *SMALL, "--minutes", "1", "--eval-every", "3"))
    assert eta() == ["0.6 min", "0.0 min"]  # 60 - 25 s; then 75 s used of 60


def test_a_resumed_run_continues_the_clock(tmp_path):
    """--resume continues the time budget, not only the step count: a run saved with its
    --minutes used up takes no further step (the clock restarting would hand it a whole new
    budget). --max-steps 4 would allow two more steps; only the clock ends it at 2."""
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2"))
    ck = load_checkpoint(str(tmp_path / "t.pt"))
    ck["elapsed"] = 61.0  # past the 1-minute budget
    save_checkpoint(str(tmp_path / "late.pt"), ck)
    late = str(tmp_path / "late.pt")
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "4", "--resume", late))
    assert load_checkpoint(str(tmp_path / "t.pt"))["step"] == 2


def test_a_resumed_run_takes_the_model_shape_from_its_file(tmp_path, capsys):
    """--resume builds the model the file holds (preset, MTP depth); a flag given against it is
    refused (another --mtp-depth went on training the saved run, silently). Left at its default,
    a flag cannot be told from one not given: the file's value wins."""
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "1", "--mtp-depth", "1"))
    args = tiny_run(tmp_path, *SMALL, "--max-steps", "2", "--resume", str(tmp_path / "t.pt"))
    for k, v, msg in (("mtp_depth", 2, "--mtp-depth 2: .* is 1 "), ("preset", "ref", "is tiny ")):
        with pytest.raises(ValueError, match=msg + r"\(a resumed run keeps its model\)"):
            train.main(argparse.Namespace(**{**vars(args), k: v}))
    args.preset, args.mtp_depth = "cpu", 0  # the defaults
    train.main(args)
    ck = load_checkpoint(str(tmp_path / "t.pt"))
    assert ck["step"] == 2 and ck["args"]["preset"] == "tiny" and ck["mtp_state_dict"]
    assert "preset tiny" in capsys.readouterr().out


def test_a_resumed_run_goes_on_with_its_native_mtp_heads(tmp_path):
    """--resume restores the native MTP heads with the target: a finished run resumed with no
    step left saves the heads it was given back unchanged. (A resume that rebuilt them afresh,
    the load of mtp_state_dict dropped, went on training heads at their initial weights, and
    the run file test above, which checks only that some heads were saved, passed.)"""
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2", "--mtp-depth", "1",
                        "--lr", "0.01", "--warmup-steps", "0"))
    before = load_checkpoint(str(tmp_path / "t.pt"))["mtp_state_dict"]
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2", "--resume"))  # no step left
    after = load_checkpoint(str(tmp_path / "t.pt"))["mtp_state_dict"]
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_resumed_run_draws_other_batches_than_its_first_steps(tmp_path, monkeypatch):
    """The batch generator of a resumed run is seeded by the seed and the step it resumes at,
    so its batches are not the ones the run began with (seeded by --seed alone, a run resumed
    every few minutes trains on the same few batches over and over)."""
    drawn, real = [], train.get_batch
    monkeypatch.setattr(train, "get_batch", lambda *a: drawn.append(real(*a)) or drawn[-1])
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "1"))
    first = drawn[-1]  # --eval-batches 1: the validation batch, then step 0's
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2", "--resume"))
    assert len(drawn) == 4 and not torch.equal(drawn[-1], first)  # step 1's, after the resume


def test_each_step_applies_its_own_gradient_only(tmp_path):
    """train_loop zeroes the gradients before every backward: with plain SGD at lr 1 and a loss
    whose gradient is the constant g (norm 0.5, under the clip), n steps move the weight by
    n g. Without the zeroing the gradients pile up (g, 2g, 3g: 6 g after 3 steps), which no
    end-to-end test saw: training still lowers the loss, only worse."""
    w = torch.nn.Parameter(torch.zeros(4))
    g = torch.tensor([0.3, -0.4, 0.0, 0.0])
    opt = torch.optim.SGD([w], lr=1.0)
    args = argparse.Namespace(minutes=60.0, max_steps=3, eval_every=100, save_minutes=0)
    model = torch.nn.Module()
    model.w = w
    train.train_loop(args, model, opt, [w], lambda frac, step: 1.0,
                     lambda step: ((w * g).sum(), lambda: ""), lambda: "", dict,
                     str(tmp_path / "toy.pt"), None, None)
    assert torch.allclose(w.detach(), -3 * g)


def test_resume_takes_the_run_file_over_an_older_finished_checkpoint(tmp_path):
    """A finished run extended with --resume and a larger budget, then killed, leaves both its
    old checkpoint and the newer run file: --resume alone goes on from the run file. (Taking
    the finished checkpoint whenever it exists threw the extension's steps away.)"""
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "1"))
    out, run = str(tmp_path / "t.pt"), str(tmp_path / "t.run.pt")
    ck = load_checkpoint(out)
    save_checkpoint(run, {**ck, "step": 5})  # the extension, killed at step 5
    got, path = train.load_run("", out, "target")
    assert path == run and got["step"] == 5
    os.remove(run)  # no run file: the finished checkpoint, to extend it
    got, path = train.load_run("", out, "target")
    assert path == out and got["step"] == 1


def test_ctrl_c_saves_the_steps_so_far_to_the_run_file(tmp_path, monkeypatch):
    """Ctrl-C in the loop lost up to --save-minutes of work with a traceback; now the run file
    gets the steps done, the interrupt names it for --resume (the same command may name another
    FILE), and --resume goes on from there. So at the final evaluation, after the last step."""
    real_batch, real_eval, calls = train.get_batch, train.evaluate, []

    def interrupted_at_the_4th_step(*a):
        calls.append(1)
        if len(calls) == 1 + 4:  # the validation batch, then a batch per step
            raise KeyboardInterrupt
        return real_batch(*a)

    def interrupted_at_the_final_evaluation(*a):
        calls.append(1)
        if len(calls) == 2:  # after step 1, then at the end
            raise KeyboardInterrupt
        return real_eval(*a)
    args = tiny_run(tmp_path, *SMALL, "--max-steps", "6", "--save-minutes", "0")
    run_file = str(tmp_path / "t.run.pt")
    for name, fake, step in (("get_batch", interrupted_at_the_4th_step, 3),
                             ("evaluate", interrupted_at_the_final_evaluation, 6)):
        calls.clear()
        with monkeypatch.context() as m, pytest.raises(
                KeyboardInterrupt, match=f"step {step} saved; go on with --resume .*t.run.pt"):
            m.setattr(train, name, fake)
            train.main(args)
        assert load_checkpoint(run_file)["step"] == step and not (tmp_path / "t.pt").exists()
        train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "6", "--resume", run_file))
        assert load_checkpoint(str(tmp_path / "t.pt"))["step"] == 6
        os.remove(tmp_path / "t.pt")


def test_resuming_an_exported_checkpoint_says_its_optimizer_starts_afresh(tmp_path, capsys):
    """checkpoint.py's export drops the optimizer: --resume of such a file goes on from its
    weights, and says that this is not the run continued."""
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "1"))
    export_checkpoint(str(tmp_path / "t.pt"), str(tmp_path / "e.pt"))
    capsys.readouterr()
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2", "--resume", str(tmp_path / "e.pt")))
    assert f"NOTE: {tmp_path / 'e.pt'} holds no optimizer state" in capsys.readouterr().out
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "3", "--resume", str(tmp_path / "t.pt")))
    assert "NOTE" not in capsys.readouterr().out  # a finished run keeps its optimizer


def test_resume_takes_only_a_target_checkpoint(tmp_path):
    """A drafter's run file passed to train.py --resume is refused by its kind, in one line, not
    by a TypeError from building a target out of the drafter's config."""
    args = tiny_run(tmp_path, "--resume", str(tmp_path / "d.pt"))
    save_checkpoint(str(tmp_path / "d.pt"), dict(kind="dflash", state_dict={}, args=vars(args),
                                                 config=dict(n_layer=2, block_size=16)))
    with pytest.raises(ValueError, match="is a 'dflash' checkpoint, expected 'target'"):
        train.main(args)


# -----------------------------------------------------------------------------
# the recipe's pieces


def test_lr_schedule_endpoints():
    args = argparse.Namespace(lr=1.0, warmup_steps=10)
    assert train.lr_at(0.0, 0, args) == pytest.approx(0.1)     # warm-up: step 0 already trains
    assert train.lr_at(0.0, 9, args) == pytest.approx(1.0)     # ... and reaches the peak
    assert train.lr_at(0.5, 10, args) == pytest.approx(0.55)   # cosine half-way
    assert train.lr_at(1.0, 10, args) == pytest.approx(0.1)    # fully decayed: lr / 10


def test_every_parameter_group_follows_the_schedule(tmp_path):
    """The norm gains (no-decay group) warm up and decay with the matrices, not stay at the peak
    lr AdamW was built with: after 2 of 4 warm-up steps both groups are at lr * 2/4."""
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2", "--lr", "0.01",
                        "--warmup-steps", "4"))
    groups = load_checkpoint(str(tmp_path / "t.pt"))["optimizer"]["param_groups"]
    assert len(groups) == 2 and [g["lr"] for g in groups] == [pytest.approx(0.005)] * 2


def test_bits_per_byte():
    """bits per byte = nats per token / ln 2 x tokens / bytes: token ids < 256 are single bytes,
    merged tokens are several."""
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

    def backward(self, *a, **k):
        totals.append(self.item())
        return real_backward(self, *a, **k)

    def losses(*a, **k):
        r = real_losses(*a, **k)
        mtps.append(sum(x.item() for x in r[0]))
        return r
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    monkeypatch.setattr(mtp.MTP, "losses", losses)
    for lam in (0.0, 0.6):
        monkeypatch.setattr(train, "MTP_LAMBDA", lam)
        train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "1", "--mtp-depth", "2",
                            "--out-path", str(tmp_path / f"t{lam}.pt")))
    assert mtps[0] == pytest.approx(mtps[1])  # same seed, same first batch
    assert totals[1] - totals[0] == pytest.approx(0.6 / 2 * mtps[1], rel=1e-4)


def test_decay_only_on_matrices_and_the_clip_covers_the_mtp_heads(tmp_path, monkeypatch):
    """AdamW decays the matrices only (not the RMSNorm gains), and one clip at norm 1.0 per step
    spans every trained parameter, the native MTP heads included."""
    groups, clipped, heads = [], [], []
    real_init, real_clip = torch.optim.AdamW.__init__, torch.nn.utils.clip_grad_norm_
    real_mtp_init = mtp.MTP.__init__

    def init(self, params, *a, **k):
        params = list(params)
        groups.extend(params)
        real_init(self, params, *a, **k)

    def clip(p, max_norm, *a, **k):
        clipped.append((list(p), max_norm))
        return real_clip(p, max_norm, *a, **k)

    def mtp_init(self, *a, **k):
        heads.append(self)
        real_mtp_init(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "__init__", init)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    monkeypatch.setattr(mtp.MTP, "__init__", mtp_init)
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2", "--mtp-depth", "1"))
    decayed = {id(p) for g in groups if g["weight_decay"] == train.WEIGHT_DECAY > 0
               for p in g["params"]}
    kept = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    params = [p for g in groups for p in g["params"]]
    assert decayed and kept
    assert all(p.dim() >= 2 for p in params if id(p) in decayed)
    assert all(p.dim() < 2 for p in params if id(p) in kept)
    assert len(clipped) == 2 and all(m == 1.0 for _, m in clipped)
    clip_ids = {id(p) for p in clipped[0][0]}
    assert {id(p) for p in heads[0].parameters()} <= clip_ids  # the heads are clipped
    assert clip_ids == decayed | kept  # every trained parameter


def test_the_corpus_flag_picks_the_token_bins(tmp_path, monkeypatch, capsys):
    """--corpus all trains and validates on data.py's broad corpus (out/data-all/), the default
    on the small one, and the checkpoint's args record which."""
    seen = []

    def load_tokens(split, corpus="small"):
        seen.append((split, corpus))
        return np.arange(5000, dtype=np.uint16) % 4000
    monkeypatch.setattr(data, "load_tokens", load_tokens)
    for corpus in ([], ["--corpus", "all"]):
        train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "1", *corpus))
    assert seen == [("train", "small"), ("val", "small"), ("train", "all"), ("val", "all")]
    assert load_checkpoint(str(tmp_path / "t.pt"))["args"]["corpus"] == "all"
    with pytest.raises(SystemExit):
        train.get_parser().parse_args(["--corpus", "big"])
    assert "invalid choice: 'big'" in capsys.readouterr().err


def test_get_batch_draws_windows_of_seq_len_plus_one_consecutive_tokens():
    """Each row is seq_len + 1 consecutive tokens of the stream: inputs xy[:, :-1] and their
    next tokens xy[:, 1:]. One token short, every step would silently train on seq_len - 1
    positions, and the model's last position (max_seq_len - 1) never."""
    gen = torch.Generator().manual_seed(0)
    xy = train.get_batch(np.arange(1000, dtype=np.uint16), 8, 16, gen, "cpu")
    assert xy.shape == (8, 17) and xy.dtype == torch.int64
    assert torch.equal(xy - xy[:, :1], torch.arange(17).expand(8, 17))
    # every window can come up, the last one too (its last token is the stream's last)
    gen = torch.Generator().manual_seed(0)
    xy = train.get_batch(np.arange(12, dtype=np.uint16), 64, 10, gen, "cpu")
    assert set(xy[:, 0].tolist()) == {0, 1}


# -----------------------------------------------------------------------------
# bad input: one line


def test_check_args():
    ok = argparse.Namespace(batch_size=1, minutes=None, max_steps=0, save_minutes=0.0,
                            warmup_steps=0, lr=1e-3)
    train.check_args(ok, ["batch_size"], zero_ok=["warmup_steps"])
    nan = float("nan")  # each nan trained a nan model, or never ran out
    for bad, message in [({"batch_size": 0}, "--batch-size must be >= 1, got 0"),
                         ({"minutes": 0}, "--minutes must be > 0"),
                         ({"minutes": nan}, "--minutes must be > 0"),
                         ({"max_steps": -1}, "--max-steps must be >= 0"),
                         ({"threads": -1}, "--threads must be >= 0"),
                         ({"warmup_steps": -5}, "--warmup-steps must be >= 0"),
                         ({"lr": -1.0}, "--lr must be > 0"), ({"lr": 0.0}, "--lr must be > 0"),
                         ({"lr": float("inf")}, "--lr must be > 0 and finite, got inf"),
                         ({"threads": 100000}, "--threads must be <= the "),
                         ({"save_minutes": -1.0}, "--save-minutes must be >= 0"),
                         ({"save_minutes": nan}, "--save-minutes must be >= 0")]:
        with pytest.raises(ValueError, match=message):
            train.check_args(argparse.Namespace(**{**vars(ok), **bad}), ["batch_size"],
                             zero_ok=["warmup_steps"])


def test_a_diverged_run_saves_nothing(tmp_path, capsys):
    """An lr that blows the weights up to inf or NaN ended "saved", rc 0, and the checkpoint
    crashed every tool that read it; now the save refuses and the last good one stays."""
    with pytest.raises(ValueError, match=r"step 2 .*t.pt not written: the weights are not all finite"):
        train.main(tiny_run(tmp_path, "--max-steps", "2", "--lr", "1e30", "--threads", "1",
                            "--eval-batches", "1"))
    assert not (tmp_path / "t.pt").exists()


TINY = ["train.py", "--preset", "tiny"]
MTP = ["train_drafter.py", "--method", "mtp"]
DFLASH = ["train_drafter.py", "--method", "dflash"]


@pytest.mark.parametrize("cmd,message", [
    (DFLASH + ["--target", "missing.pt"], "no such checkpoint"),
    (DFLASH + ["--block-size", "1"], "--block-size must be in 2..255"),
    (TINY + ["--batch-size", "0"], "--batch-size must be >= 1"),
    (TINY + ["--max-steps", "-1"], "--max-steps must be >= 0"),
    (TINY + ["--mtp-depth", "-1"], "--mtp-depth must be >= 0"),
    (MTP + ["--max-steps", "-2"], "--max-steps must be >= 0"),
    (MTP + ["--gen-len", "320"], "--prompt-len + --gen-len must be below the target's context of "
                                 "384, got 64 + 320"),
    (TINY + ["--seq-len", "5000"], "--seq-len must be in 1..256 (the context), got 5000"),
    (TINY + ["--device", "cuda:99"], "cuda:99")])
def test_training_clis_give_one_line_errors(tmp_path, cmd, message, run_script):
    rc, _, err = run_script(*cmd, cwd=tmp_path)
    assert rc == 1 and message in err, err[-800:]


def test_a_seq_len_past_the_context_is_refused_before_the_model_is_built(tmp_path):
    """One token past the context (the default --seq-len is all of it) is refused up front, not
    by the first training step's forward after the model and data are set up."""
    with pytest.raises(ValueError, match=r"--seq-len must be in 1\.\.256 \(the context\), got 257"):
        train.main(tiny_run(tmp_path, "--seq-len", "257"))
    with pytest.raises(ValueError, match=r"--seq-len must be in .*got 0"):  # 0 trained at full context
        train.main(tiny_run(tmp_path, "--seq-len", "0"))


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, run_script):
    """A folder named as the output file used to fail at the save, after the training."""
    (tmp_path / "a_file").write_text("x")
    committed = os.path.join(data.REF_WEIGHTS, "target.pt")
    for cmd in (TINY + ["--max-steps", "1", "--out-path", str(tmp_path)],
                MTP + ["--max-steps", "1", "--out-dir", str(tmp_path / "a_file")],
                ["dev/export_weights.py", committed, str(tmp_path)]):
        rc, out, err = run_script(*cmd, cwd=tmp_path)
        assert rc == 1 and str(tmp_path) in err, err[-800:]
        assert "step" not in out and "distill" not in out, out[-800:]  # nothing ran first


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


@pytest.mark.parametrize("prompt,max_new,message", [
    ("", 8, "empty prompt"), ("x = 1\n" * 200, 8, "exceeds the target's context"),
    ("def f(", 0, "max_new_tokens must be >= 1")], ids=["empty", "too-long", "no-new-tokens"])
def test_sample_cli_rejects_bad_prompts(tmp_path, prompt, max_new, message, run_script):
    save_tiny(tmp_path / "t.pt")
    rc, _, err = run_script("sample.py", "--method", "ar", "--target", str(tmp_path / "t.pt"),
                            "--device", "cpu", "--prompt", prompt, "--max-new-tokens", str(max_new))
    assert rc != 0 and message in err, err[-500:]


def test_resume_FILE_writes_to_its_own_presets_folder(tmp_path, monkeypatch):
    """--resume FILE with no --preset or --out-path continues FILE's model into
    out/<its preset>/target.pt with that preset's default minutes; the default out path came
    from the default preset, so a `tiny` run went over out/cpu/target.pt."""
    train.main(tiny_run(tmp_path, *SMALL, "--max-steps", "2"))
    monkeypatch.chdir(tmp_path)  # out/ relative to here
    args = train.get_parser().parse_args([*SMALL, "--max-steps", "3", "--eval-every", "100",
                                          "--resume", str(tmp_path / "t.pt")])
    train.main(args)
    assert load_checkpoint(str(tmp_path / "out" / "tiny" / "target.pt"))["step"] == 3
    assert args.minutes == train.DEFAULT_MINUTES["tiny"] and not (tmp_path / "out" / "cpu").exists()
