"""
EAGLE-3-style drafter (draft_eagle.py): speculative decoding with it is lossless (greedy token
for token, sampling in distribution), the training-time-test unroll computes exactly what the
inference path computes, a short training run raises agreement, and checkpoints are checked.

    python -m pytest -q tests/test_eagle.py
"""
from collections import Counter

import pytest
import torch

import speculate
from draft_eagle import Eagle, EagleDrafter, default_layers
from checkpoint import load_drafter
from model import logits_to_probs
from checkpoint import save_checkpoint, weights_hash
from test_model import tiny_model


def frozen(m):
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def random_eagle(target, seed=0, ttt_steps=3, std=0.15):
    """Untrained drafter with large random weights, so that attention and feedback matter."""
    torch.manual_seed(seed)
    e = Eagle(target.cfg, ttt_steps=ttt_steps)
    with torch.no_grad():
        for p in e.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return e.eval()


def features(target, tokens, layers):
    with torch.no_grad():
        return torch.cat(target(tokens, hidden_layers=layers)[1], -1)  # (B, T, 3C)


def continuations(target, seed, n_rows, temperature=0.0, prompt_len=8, gen_len=24):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.cfg.vocab_size, (n_rows, prompt_len), generator=g).tolist()
    out, _ = speculate.generate(target, prompts, None, max_new_tokens=gen_len, temperature=temperature, seed=seed)
    return torch.tensor([p + o for p, o in zip(prompts, out)])  # (n_rows, prompt_len + gen_len)


@pytest.fixture(scope="module")
def trained():
    """A random-but-structured target (embedding scaled up, so the next token depends mostly on
    the current one) and an EAGLE drafter trained briefly on its greedy continuations."""
    target = frozen(tiny_model(7))
    with torch.no_grad():
        target.embed.weight.mul_(30)
        target.head.weight.mul_(3)
    train, val = continuations(target, 0, 256), continuations(target, 1, 64)
    torch.manual_seed(0)
    eagle = Eagle(target.cfg, ttt_steps=3)

    def agreement():
        with torch.no_grad():
            _, st = eagle.loss(target, val, features(target, val, eagle.hidden_layers))
        return (st["agree"] / st["count"]).tolist()

    before = agreement()
    opt = torch.optim.AdamW(eagle.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        tok = train[torch.randint(0, len(train), (16,), generator=g)]
        loss, _ = eagle.loss(target, tok, features(target, tok, eagle.hidden_layers))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    eagle.eval()
    return target, eagle, before, agreement()


# -----------------------------------------------------------------------------

def test_drafter_params_only_and_layer_choice():
    target = tiny_model()
    e = Eagle(target.cfg)
    assert all(k.startswith(("fc.", "layer.", "norm.")) for k in e.state_dict())  # no target weights
    assert e.fc.in_features == 3 * target.cfg.n_embd
    assert e.layer.attn.wq.in_features == 2 * target.cfg.n_embd
    assert default_layers(6) == (1, 3, 5) and default_layers(14) == (1, 7, 13) and default_layers(2) == (0, 1, 2)
    with pytest.raises(ValueError, match="hidden_layers"):
        Eagle(target.cfg, hidden_layers=(2, 1, 2))


def test_ttt_feeds_back_shifted_features():
    target = frozen(tiny_model(1))
    e = random_eagle(target, ttt_steps=4)
    tok = torch.randint(0, 97, (2, 20))
    feats = features(target, tok, e.hidden_layers)
    seen = []  # (e, h) inputs of every unroll step
    hook = e.layer.register_forward_pre_hook(lambda mod, args, kw: seen.append((args[0], args[1])), with_kwargs=True)
    outs = e.unroll(target, tok, feats)
    hook.remove()
    assert len(outs) == 4 and all(o.shape == (2, 18, 64) for o in outs)
    assert torch.allclose(seen[0][1], e.fc(feats[:, :-2]))                 # step 0: true features f_p
    for j in range(4):
        assert torch.equal(seen[j][0], target.embed(tok[:, 1:-1]))         # every step: data token x_{p+1}
    for j in range(1, 4):
        assert torch.equal(seen[j][1][:, 1:], outs[j - 1][:, :-1])         # step j at p: step j-1's output at p-1
    loss, st = e.loss(target, tok, feats)
    assert loss.isfinite() and st["agree"].dtype == st["count"].dtype == torch.long
    assert st["count"].tolist() == [2 * (18 - j) for j in range(4)] and st["agree"].device.type == "cpu"


@torch.no_grad()
def test_ttt_matches_inference_chain():
    """Step j of the unroll at position a + j == the inference path anchored at a (catch-up on
    true features up to a, then j chain steps with the true tokens as drafts). Two rows with
    different anchors in one batch, so the ragged catch-up is checked too."""
    target = frozen(tiny_model(2))
    e = random_eagle(target, seed=1, ttt_steps=4)
    tok = torch.randint(0, 97, (2, 24))
    feats = features(target, tok, e.hidden_layers)
    logits = [e.logits(target, h) for h in e.unroll(target, tok, feats)]  # (B, T-2, V) per step
    d = EagleDrafter(target, e)
    for anchors in ([0, 9], [13, 2], [5, 5]):
        a = torch.tensor(anchors)
        d.prefill(tok, a + 2, feats * (torch.arange(24)[None, :, None] <= a[:, None, None]))  # no f_p past a
        h, lg = d.catch_up(tok, a + 2)
        for j in range(4):
            ref = torch.stack([logits[j][b, anchors[b] + j] for b in range(2)])
            assert (lg - ref).abs().max() < 1e-4, (anchors, j)
            h, lg = d.step(h, tok[torch.arange(2), a + j + 2])   # the true token as the draft
        assert d.cache.lengths.tolist() == [x + 5 for x in anchors]


def prefilled_chain():
    """A random EAGLE drafter prefilled on two rows of different lengths: (drafter, tokens, n, feats)."""
    target = frozen(tiny_model(3))
    e = random_eagle(target, seed=2)
    tok = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    n = torch.tensor([9, 14])
    feats = features(target, tok, e.hidden_layers)
    d = EagleDrafter(target, e)
    d.prefill(tok, n, feats)
    return d, tok, n, feats


@torch.no_grad()
def test_propose_is_the_chain_that_feeds_back_its_own_feature():
    """propose == catch_up, then step(h, d) K-1 times, each step given the feature h the
    previous one returned and its argmax draft d. Dropping the feedback keeps decoding
    lossless (only the drafts change), so no equality-with-plain-decoding test can see it."""
    d, tok, n, feats = prefilled_chain()
    drafts, _ = d.propose(tok, n, K=4)
    d.prefill(tok, n, feats)
    h, lg = d.catch_up(tok, n)
    chain = []
    for _ in range(4):
        chain.append(lg.argmax(-1))
        h, lg = d.step(h, chain[-1])
    assert torch.equal(drafts, torch.stack(chain, 1))


@pytest.mark.parametrize("is_trained", [False, True])
def test_greedy_equals_plain_decoding(is_trained, trained):
    if is_trained:
        target, eagle = trained[0], trained[1]
    else:
        target = frozen(tiny_model(3))
        eagle = random_eagle(target, seed=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (L,), generator=g).tolist() for L in (6, 13, 1)]
    for batch in (prompts[:1], prompts):
        ref, _ = speculate.generate(target, batch, None, max_new_tokens=24)
        for K in (1, 4, 15):
            out, st = speculate.generate(target, batch, EagleDrafter(target, eagle), max_new_tokens=24, K=K)
            assert out == ref, (len(batch), K)
            if is_trained and K == 4:
                assert st["tau"] > 2  # drafts do get accepted, so acceptance and rollback are exercised


def test_training_raises_agreement(trained):
    _, _, before, after = trained
    assert max(before) < 0.05, before  # chance level (vocabulary 97)
    assert all(a > b + 0.3 for a, b in zip(after, before)), (before, after)


def _tv(a, b):
    ca, cb = Counter(map(tuple, a)), Counter(map(tuple, b))
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in set(ca) | set(cb))


class SharpenedQ(EagleDrafter):
    """A broken drafter for the negative control: samples from q but reports q^3 (renormalised)."""
    def propose(self, *args, **kw):
        d, q = super().propose(*args, **kw)
        return d, q ** 3 / (q ** 3).sum(-1, keepdim=True)


def test_sampling_is_lossless(trained):
    """Speculative sampling with eagle's real q has the target's distribution: the empirical
    distribution of the first 3 tokens is as close to plain sampling as two plain runs are,
    while a drafter that misreports its q is caught by the same bound."""
    target, eagle = trained[0], trained[1]
    prompts = [[5, 17, 42]] * 2000
    kw = dict(max_new_tokens=3, temperature=1.0, top_k=4)
    plain_a, _ = speculate.generate(target, prompts, None, seed=1, **kw)
    plain_b, _ = speculate.generate(target, prompts, None, seed=2, **kw)
    spec, st = speculate.generate(target, prompts, EagleDrafter(target, eagle), K=3, seed=3, **kw)
    bad, _ = speculate.generate(target, prompts, SharpenedQ(target, eagle), K=3, seed=3, **kw)
    # q and p overlap but differ: both accepted drafts and residual samples take part
    assert 0.15 < st["acceptance_per_position"][0] < 0.95, st["acceptance_per_position"]
    bound = {}
    for n in (1, 2, 3):  # joint distribution of the first n tokens
        noise = _tv([o[:n] for o in plain_a], [o[:n] for o in plain_b])
        bound[n] = 1.5 * noise + 0.02
        assert _tv([o[:n] for o in spec], [o[:n] for o in plain_a]) < bound[n], n
    assert _tv([o[:3] for o in bad], [o[:3] for o in plain_a]) > bound[3]  # the check has teeth


@torch.no_grad()
def test_finished_row_near_buffer_end():
    """A row at the very end of the buffers (a finished row riding along with a caller that left
    no headroom) must not overflow them when drafting, nor change the other rows' drafts."""
    target = frozen(tiny_model(4))
    e = random_eagle(target, seed=3)
    tok = torch.randint(0, 97, (2, 30))
    feats = features(target, tok, e.hidden_layers)
    d = EagleDrafter(target, e)
    d.prefill(tok, torch.tensor([10, 29]), feats)
    drafts, _ = d.propose(tok, torch.tensor([10, 29]), K=7)
    d.prefill(tok[:1], torch.tensor([10]), feats[:1])
    alone, _ = d.propose(tok[:1], torch.tensor([10]), K=7)
    assert drafts.shape == (2, 7) and torch.equal(drafts[:1], alone)


def test_checkpoint_roundtrip_and_wrong_target(tmp_path):
    target = frozen(tiny_model(5))
    e = random_eagle(target, seed=4)
    save_checkpoint(str(tmp_path / "eagle.pt"), dict(kind="eagle", config=e.config_dict(), state_dict=e.state_dict(),
                                                     target_hash=weights_hash(target.cfg, target.state_dict())))
    d = load_drafter("eagle", target, str(tmp_path))
    assert d.eagle.config_dict() == e.config_dict() and d.hidden_layers == e.hidden_layers
    assert all(torch.equal(v, e.state_dict()[k]) for k, v in d.eagle.state_dict().items())
    other = tiny_model(6)
    with pytest.raises(ValueError, match="eagle.pt"):
        load_drafter("eagle", other, str(tmp_path))


@torch.no_grad()
@pytest.mark.parametrize("label_from", [0, 3, 7])
def test_unroll_steps_are_weighted_0_8_to_the_j(label_from):
    """Step j's cross-entropy over the labels x_{p+2} with p >= j (the chain exists) and
    p + 2 >= label_from (the continuation, not the prompt), weighted 0.8^j."""
    import torch.nn.functional as F
    target = frozen(tiny_model(1))
    e = random_eagle(target, ttt_steps=3)
    tok = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    feats = features(target, tok, e.hidden_layers)
    p = torch.arange(10)                                          # p = 0..T-3, label at p + 2
    ces, counts = [], []
    for j, h in enumerate(e.unroll(target, tok, feats)):
        scored = (p >= j) & (p + 2 >= label_from)
        ces.append(F.cross_entropy(e.logits(target, h[:, scored]).flatten(0, 1), tok[:, 2:][:, scored].flatten()))
        counts.append(2 * int(scored.sum()))
    want = sum(0.8 ** j * c for j, c in enumerate(ces)) / sum(0.8 ** j for j in range(3))
    loss, st = e.loss(target, tok, feats, label_from=label_from)
    assert torch.allclose(loss, want, atol=1e-6)
    assert st["count"].tolist() == counts


def test_four_layer_target_gets_low_middle_high_taps():
    assert default_layers(4) == (1, 2, 3) and default_layers(3) == (1, 2, 3)


@torch.no_grad()
def test_every_proposal_equals_a_fresh_drafters_after_ragged_acceptance():
    """After verify steps that accept a different number of drafts per row, every proposal
    equals the one a new drafter makes from the committed tokens alone (prefilled with their
    true features): update stores each verify pass's features at their own positions, and
    propose rolls back its tentative chain entries. Lossless decoding sees neither (only the
    drafts would change). Random weights never get a draft accepted, so the drafts are
    replaced after the check: the target's greedy tokens for m of them, m per row and step."""
    from model import generate as naive_generate
    target = frozen(tiny_model(3))
    e = random_eagle(target, seed=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (L,), generator=g).tolist() for L in (9, 3, 14)]
    d = EagleDrafter(target, e)
    propose, steps = d.propose, []

    def checked(tokens, n, K, **kw):
        drafts, q = propose(tokens, n, K, **kw)
        for b in range(len(n)):
            N = int(n[b])
            buf = torch.zeros(1, N + K + 1, dtype=torch.long)
            buf[0, :N] = tokens[b, :N]
            fresh = EagleDrafter(target, e)
            fresh.prefill(buf, n[b:b + 1], features(target, buf[:, :N - 1], e.hidden_layers))
            assert torch.equal(drafts[b], fresh.propose(buf, n[b:b + 1], K)[0][0]), (len(steps), b)
            greedy = naive_generate(target, tokens[b, :N].tolist(), K)
            m = (len(steps) + 2 * b) % (K + 1)
            drafts[b] = torch.tensor(greedy[:m] + [(t + 1) % 97 for t in greedy[m:]])
        steps.append(n.tolist())
        return drafts, q
    d.propose = checked
    outs, st = speculate.generate(target, prompts, d, max_new_tokens=20, K=4)
    assert outs == [naive_generate(target, p, 20) for p in prompts]
    assert len(steps) > 5 and max(st["acceptance_per_position"]) > 0


# -----------------------------------------------------------------------------
# at T > 0 each draft's q is the chain's distribution given the drafts drawn before it; seeds

T_SAMPLE, TOP_K = 0.7, 5


@torch.no_grad()
def test_eagle_sampled_chain_feeds_its_draws_and_returns_their_warped_q():
    """The same for EAGLE: q_i = warp(logits of the chain that was given d_1..d_{i-1})."""
    d, tok, n, feats = prefilled_chain()
    drafts, q = d.propose(tok, n, K=4, temperature=T_SAMPLE, top_k=TOP_K, generator=torch.Generator().manual_seed(0))
    assert drafts.shape == (2, 4) and q.shape == (2, 4, 97)
    d.prefill(tok, n, feats)
    h, lg = d.catch_up(tok, n)
    off_argmax = 0
    for i in range(4):
        assert torch.allclose(q[:, i], logits_to_probs(lg, T_SAMPLE, TOP_K), atol=1e-5), i
        assert (q[:, i].gather(1, drafts[:, i:i + 1]) > 0).all()
        off_argmax += int((drafts[:, i] != lg.argmax(-1)).sum())
        h, lg = d.step(h, drafts[:, i])
    assert off_argmax > 0


@torch.no_grad()
def test_eagle_loss_refuses_a_window_whose_last_step_has_no_label():
    """ttt_steps = 3 needs T >= 5 tokens: step j scores p >= j over p = 0..T-3, so at T = 4 the
    last step has no label and its cross-entropy (and the loss) is NaN, which training would
    take silently."""
    target = frozen(tiny_model(1))
    e = random_eagle(target, ttt_steps=3)
    tok = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    feats = features(target, tok, e.hidden_layers)
    loss, st = e.loss(target, tok, feats)
    assert loss.isfinite() and st["count"].tolist()[-1] == 2
    with pytest.raises(ValueError, match="too short"):
        e.loss(target, tok[:, :4], feats[:, :4])


def _drafter(name):
    from mtp import MTPDrafter
    from test_mtp import echo_mtp, loopy_target
    if name == "mtp":
        target = loopy_target()
        return target, MTPDrafter(target, echo_mtp(target))
    target = frozen(tiny_model(3))
    return target, EagleDrafter(target, random_eagle(target, seed=2))


@pytest.mark.parametrize("name", ["mtp", "eagle"])
def test_sampled_decoding_is_reproduced_by_its_seed(name):
    """generate(seed=...) at T > 0 draws every random number from its generator, drafts too:
    the same seed gives the same tokens and passes whatever the global RNG state (bench runs
    every method with one --seed). A drafter drawing from the global RNG passes every
    distribution test but gives other samples on every run."""
    target, drafter = _drafter(name)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        outs, st = speculate.generate(target, prompts, drafter, max_new_tokens=16, K=3, temperature=1.0, seed=3)
        runs.append((outs, st["row_passes"], st["accepted_per_position"]))
    assert runs[0] == runs[1]

