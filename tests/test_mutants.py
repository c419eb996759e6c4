"""Tests written for the survivors of a mutation sweep (session 6): each one-line bug planted
in cuda/, data, train, the DFlash loss, EAGLE's layer choice, train_drafter's data and bench's
plumbing passed the rest of the suite, and fails the test here named after it. They belong in
their modules' own test files; they are kept together until they are moved there.

    python -m pytest -q tests/test_mutants.py
"""
import argparse
import os
import sys

import numpy as np
import pytest
import torch

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- bench.py

@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from test_model import save_tiny
    d = tmp_path_factory.mktemp("weights")
    save_tiny(d / "target.pt", seed=0)
    return d


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    p.write_text('{"prompt": "def parse(line):\\n    "}\n{"prompt": "class Cache:\\n    def __init__(self"}\n')
    return p


def test_B6_card_warns_when_the_target_loops(capsys):
    import bench
    from test_model import tiny_model
    args = bench.get_parser().parse_args(["--preset", "tiny"])
    for r, warn in ((0.5, True), (0.05, False)):
        bench.print_card(args, torch.device("cpu"), torch.float32, tiny_model(), "t.pt", {}, "src", 2, {0.0: r})
        assert ("WARNING" in capsys.readouterr().out) == warn, r


def test_B8_measure_reports_the_median_run(monkeypatch):
    import bench
    walls = iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(bench, "run", lambda *a: ([], {"wall_s": next(walls)}))
    args = argparse.Namespace(repeats=3)
    assert bench.measure(None, None, [], 0, 0.0, args, 1)[1]["wall_s"] == 2.0


def test_B9_json_verify_passes_are_batch_passes_not_row_passes(weights, prompts_file):
    import bench
    rows = bench.main(["--weights", str(weights), "--preset", "tiny", "--methods", "ar", "--temperatures", "0",
                       "--prompts", str(prompts_file), "--max-new-tokens", "12", "--batch-size", "2"])
    ar = rows[0]
    assert ar["new_tokens"] == 24 and ar["verify_passes"] == 12  # one pass commits a token for both rows


def test_B10_continuous_hands_all_prompts_to_one_generate_call(monkeypatch):
    import bench
    from test_model import tiny_model
    calls = []
    real = bench.generate
    monkeypatch.setattr(bench, "generate", lambda t, p, *a, **k: calls.append((len(p), k["batch_size"])) or real(t, p, *a, **k))
    args = argparse.Namespace(continuous=True, max_new_tokens=3, top_k=None, seed=0)
    outs, _ = bench.run(tiny_model(), None, [[1, 2], [3], [4, 5, 6]], 0, 0.0, args, 1)
    assert calls == [(3, 1)] and len(outs) == 3
    calls.clear()
    args.continuous = False
    bench.run(tiny_model(), None, [[1, 2], [3], [4, 5, 6]], 0, 0.0, args, 1)
    assert calls == [(1, 1)] * 3


def test_B12_committed_drafters_win_over_out_weights(tmp_path, monkeypatch):
    import bench, data
    from model import load_target, save_checkpoint, weights_hash
    from test_model import save_tiny
    ref = tmp_path / "weights" / "tiny"
    outw = tmp_path / "out" / "tiny" / "weights"
    save_tiny(ref / "target.pt", seed=0)
    th = weights_hash(*(lambda t: (t.cfg, t.state_dict()))(load_target(str(ref / "target.pt"))))
    for d in (ref, outw):
        save_checkpoint(str(d / "eagle.pt"), dict(kind="eagle", config={}, state_dict={}, target_hash=th))
    monkeypatch.setattr(data, "WEIGHTS_DIR", str(tmp_path / "weights"))
    args = argparse.Namespace(weights=None, target=None, retrain=False, preset="tiny", out=str(tmp_path / "out"))
    _, path, found, skipped = bench.find_or_train(args, ["ar", "eagle"], torch.device("cpu"), torch.float32)
    assert path == str(ref / "target.pt") and found == {"eagle": str(ref)} and not skipped


def test_B15_eagle_drafts_the_K_it_was_given(weights, prompts_file):
    import bench
    from draft_eagle import Eagle
    from model import load_target, save_checkpoint, weights_hash
    target = load_target(str(weights / "target.pt"))
    torch.manual_seed(0)
    e = Eagle(target.cfg, ttt_steps=2)
    save_checkpoint(str(weights / "eagle.pt"), dict(kind="eagle", config=e.config_dict(), state_dict=e.state_dict(),
                                                    target_hash=weights_hash(target.cfg, target.state_dict())))
    try:
        rows = bench.main(["--weights", str(weights), "--preset", "tiny", "--methods", "ar,eagle", "--temperatures", "0",
                           "--prompts", str(prompts_file), "--max-new-tokens", "6", "--K", "3"])
    finally:
        os.remove(weights / "eagle.pt")
    eagle = rows[1]
    assert eagle["method"] == "eagle" and eagle["K"] == 3 and len(eagle["acceptance_per_position"]) == 3


# ----------------------------------------------------------------------------- train_drafter.py

def fake_generate(calls):
    def gen(target, prompts, drafter, *, max_new_tokens, temperature=0.0, seed=None, **kw):
        calls.append(temperature)
        return [[0] * max_new_tokens for _ in prompts], {}
    return gen


def test_TD3_distill_temperatures_cycle_per_batch(monkeypatch):
    import data, speculate, train_drafter
    calls = []
    monkeypatch.setattr(speculate, "generate", fake_generate(calls))
    monkeypatch.setattr(data, "load_tokens", lambda split: np.arange(1000, dtype=np.uint16))
    out = train_drafter.build_distill_data(None, 6, 4, 3, [0.0, 1.0], batch=2)
    assert out.shape == (6, 7) and calls == [0.0, 1.0, 0.0]


def test_TD6_validation_distill_data_comes_from_the_val_split(monkeypatch, tmp_path):
    import data, speculate, train_drafter
    splits = []
    monkeypatch.setattr(speculate, "generate", fake_generate([]))
    monkeypatch.setattr(data, "load_tokens", lambda split: splits.append(split) or np.arange(1000, dtype=np.uint16))
    args = argparse.Namespace(out_dir=str(tmp_path), n_seqs=4, n_val_seqs=2, prompt_len=4, gen_len=3,
                              distill_temperatures="0", seed=0)
    train, val = train_drafter.get_distill_data(None, args, "abc")
    assert splits == ["train", "val"] and train.shape == (4, 7) and val.shape == (2, 7)


def test_TD7_evaluate_sums_agreement_over_all_batches():
    import train_drafter
    stats = iter([(1.0, [2, 1], [4, 4]), (3.0, [0, 1], [4, 2])])

    class Fake:
        def eval(self): pass
        def train(self): pass
        def loss(self, target, tok, feats):
            l, a, c = next(stats)
            return torch.tensor(l), {"agree": torch.tensor(a), "count": torch.tensor(c)}
    loss, acc = train_drafter.evaluate(Fake(), None, torch.zeros(4, 3), torch.zeros(4, 3, 1), 2)
    assert loss == 2.0 and acc == pytest.approx([2 / 8, 2 / 6])


# ----------------------------------------------------------------------------- draft_eagle.py

@torch.no_grad()
def test_E6_unroll_steps_are_weighted_0_8_to_the_j():
    import torch.nn.functional as F
    from test_eagle import features, frozen, random_eagle
    from test_model import tiny_model
    target = frozen(tiny_model(1))
    e = random_eagle(target, ttt_steps=3)
    tok = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    feats = features(target, tok, e.hidden_layers)
    labels = tok[:, 2:]
    ces = [F.cross_entropy(e.logits(target, h[:, j:]).flatten(0, 1), labels[:, j:].flatten())
           for j, h in enumerate(e.unroll(target, tok, feats))]
    want = sum(0.8 ** j * c for j, c in enumerate(ces)) / sum(0.8 ** j for j in range(3))
    assert torch.allclose(e.loss(target, tok, feats)[0], want, atol=1e-6)


def test_E7_four_layer_target_gets_low_middle_high_taps():
    from draft_eagle import default_layers
    assert default_layers(4) == (1, 2, 3) and default_layers(3) == (1, 2, 3)


# ----------------------------------------------------------------------------- draft_diffusion.py

def test_D8_sampled_anchors_leave_a_label_and_a_context_position():
    """T = 4, two anchors: only a in {1, 2} has context and a label, so labels = 2 + 1 every time."""
    from test_dflash import feats_of, setup
    target, df = setup(block_size=4)
    df.anchors = 2
    tokens = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(0))
    feats = feats_of(target, df, tokens)
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(20):
            assert int(df.loss(target, tokens, feats)[1]["count"].sum()) == 3


@torch.no_grad()
def test_D9_block_at_the_context_edge_trains():
    """A sequence as long as the target's context, anchored near its end: the block's slots past
    the RoPE table take part (masked out of the loss) without indexing past the table."""
    from test_dflash import feats_of, setup
    target, df = setup(block_size=8)
    T = target.cfg.max_seq_len
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0))
    loss, st = df.loss(target, tokens, feats_of(target, df, tokens), torch.tensor([[T - 3]]))
    assert torch.isfinite(loss) and int(st["count"].sum()) == 2


@torch.no_grad()
def test_D10_context_feature_is_rms_normed():
    """c = RMSNorm(fc(feats)): scale-free in the target's features."""
    from test_dflash import setup
    _, df = setup()
    f = torch.randn(2, 5, df.fc.in_features)
    assert torch.allclose(df.context(3 * f), df.context(f), atol=1e-5)


@torch.no_grad()
def test_D11_context_keys_are_k_normed_like_the_block_keys():
    """context_kv's k is k_norm(W_k c) (what project_kv computes before RoPE): scale-free in c;
    v = W_v c is linear."""
    from test_dflash import setup
    _, df = setup()
    c = torch.randn(2, 5, df.cfg.n_embd)
    k1, v1 = df.context_kv(c)
    k3, v3 = df.context_kv(3 * c)
    assert torch.allclose(k1, k3, atol=1e-5) and torch.allclose(v3, 3 * v1, atol=1e-5)
    D2 = df.cfg.head_dim // 2
    ones, zeros = torch.ones(2, 1, 5, D2), torch.zeros(2, 1, 5, D2)  # RoPE at angle 0: no rotation
    k_ref, _ = df.layers[0].attn.project_kv(c, ones, zeros)
    assert torch.allclose(k1[0].transpose(1, 2), k_ref, atol=1e-6)


@torch.no_grad()
def test_D12_refill_writes_the_new_prompt_from_position_0():
    from draft_diffusion import DFlashDrafter
    from model import apply_rope
    from test_dflash import feats_of, setup
    target, df = setup()
    dr = DFlashDrafter(target, df)
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(2, 40, dtype=torch.long)
    tokens[:, :10] = torch.randint(0, 97, (2, 10), generator=g)
    n = torch.tensor([10, 6])
    dr.prefill(tokens, n, feats_of(target, df, tokens[:, :9]))
    new = torch.randint(0, 97, (1, 7), generator=g)
    tokens[0] = 0
    tokens[0, :7] = new[0]
    n = torch.tensor([7, 6])
    dr.refill(0, tokens, n, feats_of(target, df, new[:, :6]))
    assert dr.ctx_len.tolist() == [6, 5]
    k, v = df.context_kv(df.context(feats_of(target, df, new[:, :6])))
    cos, sin = target.rope(torch.arange(6)[None])
    assert torch.allclose(dr.ck[:, 0:1, :, :6], apply_rope(k.transpose(2, 3), cos, sin), atol=1e-5)
    assert torch.allclose(dr.cv[:, 0:1, :, :6], v.transpose(2, 3), atol=1e-5)


# ----------------------------------------------------------------------------- train.py

def test_TR1_TR2_lr_schedule_endpoints():
    import train
    args = argparse.Namespace(lr=1.0, warmup_steps=10, min_lr_frac=0.1)
    assert train.lr_at(0.0, 0, args) == pytest.approx(0.1)     # warm-up: step 0 already trains
    assert train.lr_at(0.0, 9, args) == pytest.approx(1.0)     # ... and reaches the peak
    assert train.lr_at(0.5, 10, args) == pytest.approx(0.55)   # cosine half-way
    assert train.lr_at(1.0, 10, args) == pytest.approx(0.1)    # fully decayed to lr * min_lr_frac


def test_TR3_bits_per_byte():
    """Token ids < 256 are single bytes: bits per byte = nats per token / ln 2."""
    import math
    import data, train
    from test_model import tiny_model
    xy = torch.randint(32, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    loss, bpb = train.evaluate(tiny_model(), [xy], data.get_encoding())
    assert bpb == pytest.approx(loss / math.log(2))


def test_TR6_native_mtp_loss_weight_is_lambda_over_depth(tmp_path, monkeypatch):
    import mtp, train
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


# ----------------------------------------------------------------------------- data.py

def test_DA4_a_prompt_of_exactly_max_prompt_tokens_is_kept(monkeypatch):
    import data
    enc = data.get_encoding()
    prompt = "def f(x):\n    y = x + 1\n    z = y * 2\n    return z\n"
    cont = "".join(f"value_{i} = compute({i})\n" for i in range(20))
    monkeypatch.setattr(data, "read_texts", lambda files: iter([("k", prompt + cont)]))
    n = len(enc.encode_ordinary(prompt))
    assert data.heldout_samples(1, max_prompt_tokens=n) == [(prompt, cont[:1500])]
    assert data.heldout_samples(1, max_prompt_tokens=n - 1) == []


def test_DA6_tokenizer_hash_covers_the_split_pattern(monkeypatch):
    import data
    h = data.tokenizer_hash()
    monkeypatch.setattr(data, "PAT_STR", data.PAT_STR + r"|\s")
    assert data.tokenizer_hash() != h


def test_DA8_bins_are_rebuilt_for_another_tokenizer(tmp_path, monkeypatch, capsys):
    import data
    for s in ("a", "b"):
        (tmp_path / f"{s}.py").write_text(f"def {s}():\n    return 1\n")
    monkeypatch.setattr(data, "corpus_files", lambda: {"train": [("a", str(tmp_path / "a.py"))],
                                                       "val": [("b", str(tmp_path / "b.py"))]})
    out = str(tmp_path / "out")
    assert data._prepare(out, False)["tokenizer_hash"] == data.tokenizer_hash()
    monkeypatch.setattr(data, "tokenizer_hash", lambda path=None: "another")
    meta = data._prepare(out, False)
    assert meta["tokenizer_hash"] == "another" and "rebuilding" in capsys.readouterr().out


# ----------------------------------------------------------------------------- model.py

def test_MO6_weights_hash_covers_the_config():
    from dataclasses import replace
    from model import weights_hash
    from test_model import tiny_model
    m = tiny_model()
    assert weights_hash(m.cfg, m.state_dict()) != weights_hash(replace(m.cfg, rope_theta=500.0), m.state_dict())


def test_MO7_export_drops_the_optimizer_and_stores_bf16(tmp_path):
    from model import export_checkpoint, load_checkpoint, save_checkpoint
    save_checkpoint(str(tmp_path / "a.pt"), dict(kind="target", config={}, state_dict={"w": torch.ones(2)},
                                                 optimizer={"state": {0: torch.ones(3)}}))
    export_checkpoint(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    ck = load_checkpoint(str(tmp_path / "b.pt"))
    assert "optimizer" not in ck and ck["state_dict"]["w"].dtype == torch.bfloat16


def test_MO8_get_device_refuses_an_index_past_the_last_gpu(monkeypatch):
    from model import get_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert get_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        get_device("cuda:1")


# ----------------------------------------------------------------------------- cuda/__init__.py

def test_C2_kv_inject_ref_refuses_rope_tables_too_short():
    import cuda
    from cuda.__main__ import make_kv_case
    args = list(make_kv_case(1, 2, 1, 8, 10, 4))
    args[6], args[7] = args[6][:5], args[7][:5]  # the last row writes up to slot 9, the tables have 5 rows
    with pytest.raises(ValueError, match="RoPE"):
        cuda.kv_inject_ref(*args)


def test_C6_a_fresh_build_lock_is_waited_for_not_removed(tmp_path, capsys):
    import threading, time
    import cuda
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(1.5, lock.unlink).start()  # the live build finishes
    t0 = time.time()
    cuda._wait_for_stale_lock(tmp_path)
    assert time.time() - t0 > 1.0 and "waiting for another build" in capsys.readouterr().out


def test_C7_failure_keeps_the_last_line():
    import cuda
    e = RuntimeError("ninja: build stopped\n  g++ -O3 ...\nerror: ext.cpp:12: expected ';'\n\n")
    assert cuda.failure(e) == "RuntimeError: error: ext.cpp:12: expected ';'"


# ----------------------------------------------------------------------------- cuda/ext.cpp host loops

@pytest.fixture(scope="module")
def ext():
    import cuda
    e = cuda.load()
    if e is None:
        pytest.skip(cuda.build_error())
    return e


def test_X2_host_sampling_refuses_a_draft_equal_to_V(ext):
    p = torch.full((1, 2, 4), 0.25)
    with pytest.raises(RuntimeError, match="outside"):
        ext.accept_scan(p, torch.tensor([[4]]), None, torch.full((1, 2), 0.5), 1)


def test_X3_a_zero_uniform_never_samples_a_zero_probability_token(ext):
    """u = 0: the inverse CDF picks the first token whose cdf EXCEEDS 0 (searchsorted right),
    never a leading token of probability 0."""
    import cuda
    p = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]]])
    drafts, u = torch.tensor([[1]]), torch.zeros(1, 2)
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, None, u)] == [[0], [3]]
    assert [t.tolist() for t in ext.accept_scan(p, drafts, None, u, 1)] == [[0], [3]]
