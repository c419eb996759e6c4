"""
MTP modules and their drafter (mtp.py, DESIGN.md sec. 6; DeepSeek-V3, arXiv 2412.19437 sec. 2.2).

- greedy speculative decoding with mtp equals plain greedy decoding (ragged batches, K capped
  by the depth, with and without --confidence; its per-row stop)
- the drafter's incremental, lagged per-module caches give exactly what the modules compute
  non-incrementally over the whole committed sequence (+ the drafts so far)
- sampling with mtp's real q is lossless (the statistical test of test_speculate.py)
- MTP.losses trains; train.py --mtp-depth runs end to end; foreign post-hoc weights are refused

    python -m pytest -q tests/test_mtp.py
"""

import math
from functools import lru_cache

import pytest
import torch

import speculate
from speculate import NO_DRAFT
from model import generate as naive_generate, logits_to_probs
from checkpoint import save_checkpoint
from mtp import MTP, MTPDrafter
import mtp as mtp_lib
from checkpoint import load_drafter
from test_model import tiny_model
from test_speculate import SAMPLE_PROMPT, sampled_tv, sampling_target

V = 97
DEPTH = 3


@lru_cache(maxsize=None)
def random_target():
    return tiny_model(0)


@lru_cache(maxsize=None)
def loopy_target():
    """Nearly a bigram model (attention damped, not off): greedy text soon repeats a token
    or a short cycle, so a drafter that echoes the target's prediction gets long acceptance."""
    m = tiny_model(0)
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.wo.weight.mul_(0.02)
    return m


def random_mtp(target, depth=DEPTH, seed=0):
    torch.manual_seed(seed)
    return MTP(target.cfg, depth).eval()


def echo_mtp(target, depth=DEPTH, seed=0):
    """Random modules nudged to pass the previous hidden state through: proj = [I + noise, noise]
    and out_norm = the target's final norm, so module k roughly repeats the target's own next-
    token prediction. The blocks and the token embeddings still perturb the output, so the
    caches matter; on a target that loops this gives long, ragged acceptance."""
    m = random_mtp(target, depth, seed)
    C = target.cfg.n_embd
    with torch.no_grad():
        for mod in m.mods:
            mod.proj.weight[:, :C] += torch.eye(C)
            mod.out_norm.weight.copy_(target.norm.weight)
    return m


def ragged_prompts(B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (L,), generator=g).tolist() for L in (17, 6, 2)[:B]]


# -----------------------------------------------------------------------------
# greedy: speculative with mtp == plain

MAX_NEW = 16


# K=1: nothing to stop; K=2 < depth; K=4 > depth is capped at it (a K of 15 ran exactly the K=4
# case again: n_draft = min(K, DEPTH) and the loop's cap both make it 3). C = 0.1 stops some
# rows at some steps on both kinds
@pytest.mark.parametrize("K, confidence", [(1, 0.0), (2, 0.0), (2, 0.1), (4, 0.0), (4, 0.1)])
@pytest.mark.parametrize("kind", ["random", "echo"])
def test_greedy_equals_plain(kind, K, confidence):
    target = random_target() if kind == "random" else loopy_target()
    heads = random_mtp(target) if kind == "random" else echo_mtp(target)
    for B in (1, 3):
        prompts = ragged_prompts(B)
        drafter = MTPDrafter(target, heads, n_draft=min(K, DEPTH), confidence=confidence)
        outs, st = speculate.generate(target, prompts, drafter, max_new_tokens=MAX_NEW, K=K)
        assert outs == [naive_generate(target, p, MAX_NEW) for p in prompts]
        assert len(st["acceptance_per_position"]) == min(K, DEPTH)  # K is capped by the depth
        if kind == "echo" and confidence == 0 and K > 1 and B == 3:
            assert MAX_NEW / min(st["row_passes"]) > 2.0, st["row_passes"]  # long acceptance is exercised
        if kind == "echo" and confidence > 0 and K > 1 and B == 3:
            # --confidence drafted fewer tokens at some steps
            assert st["attempts_per_position"][min(K, DEPTH) - 1] < st["attempts_per_position"][0]


def test_a_one_token_prompt_leaves_the_deeper_modules_nothing_to_cache():
    """With n = 2 committed tokens module k >= 2 has no exact position yet (n - k <= 0): its
    cache length must clamp at 0, not go negative (the next propose indexed position -1)."""
    target = loopy_target()
    for prompts, batch_size in [([[5]], None), ([[5], [1, 2, 3, 4, 5, 6]], None), ([[1, 2, 3, 4, 5, 6], [5]], 1)]:
        drafter = MTPDrafter(target, echo_mtp(target))
        outs, _ = speculate.generate(target, prompts, drafter, max_new_tokens=MAX_NEW, K=DEPTH, batch_size=batch_size)
        assert outs == [naive_generate(target, p, MAX_NEW) for p in prompts]


def test_modules_deeper_than_the_buffer_has_room_for_stay_in_it():
    """Module k reads x_{p+k} at each position p up to n-2: with more modules than K + 1 plus the
    budget (--mtp-draft or K below the depth, a short budget), its prefill read past the token
    buffer: an IndexError (a device assert on a GPU). Those positions are rolled back anyway."""
    target = random_target()
    for n_draft, K, max_new in [(1, None, 1), (None, 1, 1), (2, None, 2), (None, 1, 3)]:
        drafter = MTPDrafter(target, random_mtp(target, depth=6), n_draft=n_draft)
        outs, _ = speculate.generate(target, [[1, 2, 3, 4, 5]], drafter, max_new_tokens=max_new, K=K)
        assert outs == [naive_generate(target, [1, 2, 3, 4, 5], max_new)]


# -----------------------------------------------------------------------------
# the lagged per-module caches are exact

@torch.no_grad()
def mtp_reference(target, heads, committed, drafts):
    """Each module run non-incrementally (no cache) over a row's whole committed sequence
    x_0..x_{N-1}, on the target's true last-layer hidden states h^0 of x_0..x_{N-2}. Module k
    at position t sees x_{t+k}, where tokens past x_{N-1} are the drafts d_1, d_2, ...
    Returns per module: hidden (N-1, C) and the logits (V,) at the last position N-2."""
    N = len(committed)
    ext = torch.tensor(committed + drafts)
    _, hid = target(ext[None, :N - 1], hidden_layers=(target.cfg.n_layer,))
    h = hid[0]                                                          # (1, N-1, C)
    cos, sin = target.rope(torch.arange(N - 1)[None])
    out = []
    for k, mod in enumerate(heads.mods[:len(drafts)], 1):
        h = mod(h, target.embed(ext[None, k:k + N - 1]), cos, sin)      # (1, N-1, C)
        out.append((h[0], target.head(mod.out_norm(h[0, -1]))))
    return out


class CheckedMTPDrafter(MTPDrafter):
    """Checks every proposal of every row against mtp_reference, up to the row's last draft
    (--confidence: modules past it may not have run in this proposal)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checks, self.max_catch_up = 0, 0

    def propose(self, tokens, n, K, **kw):
        lengths = [c.lengths.clone() for c in self.caches]
        drafts, q = super().propose(tokens, n, K, **kw)
        for k, L in enumerate(lengths):  # how many positions module k had to catch up on
            self.max_catch_up = max(self.max_catch_up, int((n - 2 - L).max()) + 1)
        for b in range(tokens.shape[0]):
            N = int(n[b])
            mine = [t for t in drafts[b].tolist() if t != NO_DRAFT]
            ref = mtp_reference(self.target, self.mtp, tokens[b, :N].tolist(), mine)
            for k, (hidden, logits) in enumerate(ref, 1):
                # d_k is the argmax of module k run from scratch, d_1.. d_{k-1} as its inputs
                assert int(drafts[b, k - 1]) == int(logits.argmax()), (b, k)
                # and every cached hidden state up to the last fed position is the exact one
                assert torch.allclose(self.H[k, b, :N - 1], hidden, atol=1e-4), (b, k)
            self.checks += 1
        return drafts, q


@pytest.mark.parametrize("kind, batch_size, confidence",
                         [("random", None, 0.0), ("echo", None, 0.0), ("random", 1, 0.0),
                          ("echo", None, 0.1)])
def test_module_caches_match_non_incremental(kind, batch_size, confidence):
    """batch_size 1 runs the three prompts through one row, so the caches restart by refill.
    With --confidence a deeper module skipped at some steps catches up on more positions later."""
    target = random_target() if kind == "random" else loopy_target()
    heads = random_mtp(target, seed=1) if kind == "random" else echo_mtp(target, seed=1)
    drafter = CheckedMTPDrafter(target, heads, n_draft=DEPTH, confidence=confidence)
    prompts = ragged_prompts(3, seed=2)
    outs, st = speculate.generate(target, prompts, drafter, max_new_tokens=20, K=DEPTH, batch_size=batch_size)
    assert outs == [naive_generate(target, p, 20) for p in prompts]
    assert drafter.checks >= 3 * 5
    if kind == "echo":  # rows accepted different numbers of drafts, so the caches caught up by several
        assert len(set(st["row_passes"])) > 1 and drafter.max_catch_up > DEPTH
    if confidence:  # the chain really stopped early at some steps
        assert st["attempts_per_position"][-1] < st["attempts_per_position"][0]


def test_mtp_draft_sets_the_default_K_and_more_than_the_depth_is_refused():
    target = random_target()
    heads = random_mtp(target)
    assert [MTPDrafter(target, heads, n_draft=n).default_K for n in (None, 2, DEPTH)] == [DEPTH, 2, DEPTH]
    for n in (-1, DEPTH + 1):  # bench's --mtp-draft: an error, not a silent cap
        with pytest.raises(ValueError, match=f"drafts 1..{DEPTH} tokens, not {n}"):
            MTPDrafter(target, heads, n_draft=n)


@torch.no_grad()
def test_confidence_stops_each_row_on_its_own():
    """--confidence stops a row after its first unsure module: that row leaves its later slots
    empty (NO_DRAFT) while a sure row drafts on, so each row drafts what it drafts alone; the
    chain ends early only when every row is unsure."""
    target = random_target()
    heads = random_mtp(target)
    g = torch.Generator().manual_seed(5)
    tokens = torch.zeros(2, 24, dtype=torch.long)
    tokens[:, :10] = torch.randint(0, V, (2, 10), generator=g)
    n = torch.tensor([10, 10])
    feats = target(tokens[:, :9], hidden_layers=(target.cfg.n_layer,))[1][0]
    # module 1's logits for each row, computed from scratch: the confidence of its greedy draft
    # is their top probability at T = 1
    logits = [mtp_reference(target, heads, tokens[b, :10].tolist(), [0])[0][1] for b in range(2)]
    confs = [float(row.softmax(-1).max()) for row in logits]
    assert abs(confs[0] - confs[1]) > 1e-3, confs
    unsure = confs.index(min(confs))
    for C, fewest, most in [(sum(confs) / 2, 2, DEPTH), ((max(confs) + 1) / 2, 1, 1)]:  # 1 sure / 0
        drafter = MTPDrafter(target, heads, n_draft=DEPTH, confidence=C)
        drafter.prefill(tokens, n, feats)
        drafts, _ = drafter.propose(tokens, n, K=DEPTH)
        assert fewest <= drafts.shape[1] <= most, (C, confs, drafts.shape)
        assert drafts[unsure, 0] >= 0 and (drafts[unsure, 1:] == NO_DRAFT).all()
        for b in range(2):
            alone = MTPDrafter(target, heads, n_draft=DEPTH, confidence=C)
            alone.prefill(tokens[b:b + 1], n[b:b + 1], feats[b:b + 1])
            mine = [t for t in drafts[b].tolist() if t != NO_DRAFT]
            assert alone.propose(tokens[b:b + 1], n[b:b + 1], K=DEPTH)[0][0].tolist() == mine, b


@torch.no_grad()
@pytest.mark.parametrize("label_from", [0, 6])
def test_training_losses_are_the_inference_modules_cross_entropies(label_from):
    """MTP.losses (training) against mtp_reference (inference, run from scratch): module k's loss
    is the cross-entropy of its logits at position t against x_{t+k+1}, over the labels at
    positions >= label_from. A shifted label or input would still be learnable, so only this
    comparison can see it."""
    target = random_target()
    heads = random_mtp(target)
    seq = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    N = len(seq)
    _, hid = target(torch.tensor([seq[:N - 1]]), hidden_layers=(target.cfg.n_layer,))
    losses, _, counts = heads.losses(target, torch.tensor([seq]), hid[0], label_from)
    ref = mtp_reference(target, heads, seq, [0] * DEPTH)  # positions t <= N-2-k see committed tokens only
    for k, (hidden, _) in enumerate(ref, 1):
        scored = torch.arange(k + 1, N) >= label_from                 # label positions k+1..N-1
        logits = target.head(heads.mods[k - 1].out_norm(hidden[:N - 1 - k]))
        want = torch.nn.functional.cross_entropy(logits[scored], torch.tensor(seq[k + 1:N])[scored])
        assert torch.allclose(losses[k - 1], want, atol=1e-5), k
        assert int(counts[k - 1]) == int(scored.sum())
    # train_drafter's post-hoc modules (same weights) train on the mean over depths, as the recipe
    # was tuned with: a sum scales every gradient by the depth against the fixed grad clip
    post = MTP(target.cfg, DEPTH)
    post.load_state_dict(heads.state_dict())
    _, feats = target(torch.tensor([seq]), hidden_layers=post.hidden_layers)
    loss, _ = post.loss(target, torch.tensor([seq]), feats[0], label_from)
    assert torch.allclose(loss, torch.stack(losses).mean(), atol=1e-6)


@torch.no_grad()
def test_losses_refuse_a_window_with_no_label():
    """The last label (position N-1) still trains every depth; past it, or with a window no
    longer than the depth, there is nothing to score and the loss would be NaN: an error."""
    target = random_target()
    heads = random_mtp(target)
    seq = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    _, hid = target(seq[:, :-1], hidden_layers=(target.cfg.n_layer,))
    losses, _, counts = heads.losses(target, seq, hid[0], label_from=11)
    assert counts.tolist() == [1] * DEPTH and all(torch.isfinite(l) for l in losses)
    with pytest.raises(ValueError, match="no label"):
        heads.losses(target, seq, hid[0], label_from=12)
    with pytest.raises(ValueError, match="no label"):
        heads.losses(target, seq[:, :DEPTH + 1], hid[0][:, :DEPTH])
    heads.losses(target, seq[:, :DEPTH + 2], hid[0][:, :DEPTH + 1])  # one label per depth: fine


# -----------------------------------------------------------------------------
# sampling with mtp's real q is lossless

@pytest.mark.parametrize("K", [1, 2])
def test_sampling_is_lossless(K):
    target = sampling_target()
    drafter = MTPDrafter(target, echo_mtp(target, depth=2), sample=True)
    tv, bound, st = sampled_tv(target, SAMPLE_PROMPT, drafter, K=K)
    assert tv < bound, f"TV {tv:.3f} >= bound {bound:.3f}"
    assert 0.1 < st["acceptance_per_position"][0] < 0.95, st["acceptance_per_position"]


# -----------------------------------------------------------------------------
# training and loading

def test_losses_decrease_and_gradients_flow():
    """40 AdamW steps on one fixed batch, target frozen (as post-hoc training does)."""
    target = tiny_model(0)  # a private copy: its parameters get frozen here
    target.requires_grad_(False)
    heads = random_mtp(target, depth=2).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (2, 25), generator=g)               # (B, T+1)
    with torch.no_grad():
        _, hid = target(tokens[:, :-1], hidden_layers=(target.cfg.n_layer,))
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    for step in range(40):
        losses = heads.losses(target, tokens, hid[0])[0]
        opt.zero_grad()
        sum(losses).backward()
        if step == 0:
            first = [l.item() for l in losses]
            for name, p in heads.named_parameters():  # every module parameter gets a gradient
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
    last = [l.item() for l in heads.losses(target, tokens, hid[0])[0]]
    assert all(math.isfinite(x) for x in first + last)
    assert all(b < 0.5 * a for a, b in zip(first, last)), (first, last)  # ln 97 = 4.6 -> memorised


def test_train_py_with_native_mtp_runs(tmp_path, capsys):
    """train.py --preset tiny --mtp-depth 2 for 3 small steps, then its native heads draft. They
    win over post-hoc heads trained for it, and both train_drafter.py and the loader say so."""
    import data
    import train
    data.prepare()  # token bins into <repo>/out/data (about 10 s the first time, cached after)
    path = str(tmp_path / "target.pt")
    args = train.get_parser().parse_args(
        ["--preset", "tiny", "--mtp-depth", "2", "--max-steps", "3", "--minutes", "5", "--batch-size", "2",
         "--seq-len", "32", "--eval-batches", "1", "--device", "cpu",
         "--out-path", path, "--save-minutes", "0"])
    train.main(args)
    from checkpoint import load_target
    target = load_target(path)
    drafter = load_drafter("mtp", target, str(tmp_path))
    assert drafter.mtp.depth == 2
    prompt = [[1, 2, 3, 4], [5, 6]]
    outs, _ = speculate.generate(target, prompt, drafter, max_new_tokens=8, K=2)
    assert outs == [naive_generate(target, p, 8) for p in prompt]
    import train_drafter
    capsys.readouterr()
    train_drafter.main(train_drafter.get_parser().parse_args(
        ["--method", "mtp", "--target", path, "--mtp-depth", "3", "--n-seqs", "2", "--n-val-seqs", "1", "--prompt-len",
         "4", "--gen-len", "4", "--max-steps", "1", "--batch-size", "2", "--device", "cpu"]))
    assert "NOTE: this target has native MTP heads" in capsys.readouterr().out
    assert load_drafter("mtp", target, str(tmp_path)).mtp.depth == 2  # not the post-hoc 3
    assert "(the target's own heads)" in capsys.readouterr().out


def test_posthoc_weights_for_another_target_are_refused(tmp_path):
    target = random_target()
    heads = MTP(target.cfg, 2)
    save_checkpoint(str(tmp_path / "mtp.pt"), dict(kind="mtp", config={"depth": 2}, state_dict=heads.state_dict(),
                                                   target_hash="deadbeefdeadbeef"))
    with pytest.raises(ValueError, match=r"mtp\.pt.*deadbeefdeadbeef"):
        load_drafter("mtp", target, str(tmp_path))
    # the same file with the right hash loads
    from checkpoint import weights_hash
    save_checkpoint(str(tmp_path / "mtp.pt"), dict(kind="mtp", config={"depth": 2}, state_dict=heads.state_dict(),
                                                   target_hash=weights_hash(target.cfg, target.state_dict())))
    drafter = load_drafter("mtp", target, str(tmp_path), mtp_draft=1, confidence=0.5)  # bench's flags
    assert (drafter.mtp.depth, drafter.max_K, drafter.confidence) == (2, 1, 0.5)
    with pytest.raises(ValueError, match="mtp has 2 modules"):  # bench dies with it (see --mtp-draft)
        load_drafter("mtp", target, str(tmp_path), mtp_draft=3)


def test_a_deeper_loss_trains_the_shallower_modules_and_the_trunk():
    """Module k reads module k-1's output, undetached, as in DeepSeek-V3: depth 2's loss must
    send gradient into module 1 and into the target's hidden states (the native MTP run trains
    the trunk with it). A .detach() between depths would still train each module, so only
    gradients show it."""
    target = random_target()
    heads = random_mtp(target)
    seq = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    h0 = target(seq[:, :-1], hidden_layers=(target.cfg.n_layer,))[1][0].detach().requires_grad_()
    losses, _, _ = heads.losses(target, seq, h0)
    losses[1].backward()
    assert h0.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.mods[0].parameters() if p.dim() == 2)


@torch.no_grad()
def test_mtp_draft_caps_the_drafts_when_more_are_asked_for():
    """--mtp-draft N (n_draft) is a cap on every step, also when the caller asks for K > N:
    N drafts, the first N of the whole chain's."""
    target = random_target()
    heads = random_mtp(target)
    tokens = torch.zeros(2, 24, dtype=torch.long)
    tokens[:, :10] = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(5))
    n = torch.tensor([10, 7])
    feats = target(tokens[:, :9], hidden_layers=(target.cfg.n_layer,))[1][0]
    full = MTPDrafter(target, heads)
    full.prefill(tokens, n, feats)
    chain, _ = full.propose(tokens, n, K=DEPTH)
    capped = MTPDrafter(target, heads, n_draft=2)
    capped.prefill(tokens, n, feats)
    drafts, _ = capped.propose(tokens, n, K=DEPTH)
    assert chain.shape == (2, DEPTH) and torch.equal(drafts, chain[:, :2])


# -----------------------------------------------------------------------------
# at T > 0 each draft's q is the heads' distribution given the drafts drawn before it

T_SAMPLE, TOP_K = 0.7, 5


def _buffers(target, lengths, seed=5, width=32):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, L in enumerate(lengths):
        tokens[b, :L] = torch.randint(0, V, (L,), generator=g)
    return tokens, torch.tensor(lengths)


@torch.no_grad()
def test_mtp_sampled_chain_feeds_its_draws_and_returns_their_warped_q():
    """Module k's q is softmax(logits / T) over the top_k, of module k run from scratch with the
    DRAWN d_1..d_{k-1} as its inputs. Feeding the argmax instead (or a q without top_k) stays
    lossless, so the sampling test cannot see it, but the chain then drafts for a
    continuation the verifier never sees, and acceptance at T > 0 drops."""
    target = random_target()
    heads = random_mtp(target)
    tokens, n = _buffers(target, [10, 7])
    feats = target(tokens[:, :9], hidden_layers=(target.cfg.n_layer,))[1][0]
    drafter = MTPDrafter(target, heads)
    drafter.prefill(tokens, n, feats)
    g = torch.Generator().manual_seed(0)
    drafts, q = drafter.propose(tokens, n, K=DEPTH, temperature=T_SAMPLE, top_k=TOP_K, generator=g)
    assert drafts.shape == (2, DEPTH) and q.shape == (2, DEPTH, V)
    off_argmax = 0
    for b in range(2):
        ref = mtp_reference(target, heads, tokens[b, :int(n[b])].tolist(), drafts[b].tolist())
        for k, (_, logits) in enumerate(ref):
            assert torch.allclose(q[b, k], logits_to_probs(logits, T_SAMPLE, TOP_K), atol=1e-5), (b, k)
            assert q[b, k, drafts[b, k]] > 0                      # drawn from that q
            off_argmax += int(drafts[b, k] != logits.argmax())
    assert off_argmax > 0  # some draw was not the argmax, so the chain's inputs were tested


def test_mtp_drafter_refuses_zero_drafts():
    """n_draft = 0 must be refused where it is given, not end in torch.stack([]) at the first propose."""
    target = random_target()
    with pytest.raises(ValueError, match=f"drafts 1..{DEPTH} tokens, not 0"):
        MTPDrafter(target, random_mtp(target), n_draft=0)

