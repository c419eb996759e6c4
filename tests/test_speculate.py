"""
The verification loop of speculate.py (DESIGN.md sec. 5): speculative decoding must be lossless.

- greedy: output equals plain greedy decoding token for token (fp32), for every drafter here,
  K in {1, 4, 15}, batches of 1, 3 and 8 ragged rows, on text where acceptance is long
  (a target that loops, so prompt lookup accepts a lot) and short (random prompts)
- sampling: the joint distribution of the first 3 new tokens equals the target's exact one
  (enumerated), within a total-variation bound; a deliberately broken acceptance rule fails it
- accept_scan_ref on hand-built cases, rollback invariants, stop token, bad input

    python -m pytest -q tests/test_speculate.py
"""

import copy
import math
import os
import random
import re
import runpy
import subprocess
import sys
from collections import Counter
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import checkpoint
import dflash_kernels as kernels
import model
import speculate
from data import ROOT
from draft_simple import ModelDrafter, NgramDrafter
from model import Config, PRESETS, Transformer, generate as naive_generate, logits_to_probs
from speculate import NO_DRAFT, accept_scan_ref
from test_model import save_tiny, tiny_model

F64 = torch.float64  # the dtype of the acceptance rule's uniforms (accept_scan refuses others)

V = 97  # tiny_model's vocabulary


# -----------------------------------------------------------------------------
# targets and prompts

@lru_cache(maxsize=None)
def random_target():
    return tiny_model(0)


@lru_cache(maxsize=None)
def loopy_target():
    """A target whose greedy output falls into a short cycle: with attention damped (but not
    off) it is nearly a bigram model, so prompt lookup accepts long runs on its own text."""
    m = tiny_model(5)
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.wo.weight.mul_(0.02)
    return m


@lru_cache(maxsize=None)
def other_model():
    """The `draft` drafter: an unrelated random model of the same family, one layer deep."""
    torch.manual_seed(1)
    m = Transformer(Config(vocab_size=V, **{**PRESETS["tiny"], "n_layer": 1})).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return m


def near_model_for(target, noise=0.05, seed=3):
    """A draft model close to `target`: its weights plus noise."""
    m = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.add_(noise * torch.randn(p.shape, generator=g))
    return m


LENS = (9, 1, 14, 4, 20, 2, 7, 12)  # 8 rows of different prompt lengths (batches take a prefix)


@lru_cache(maxsize=None)
def prompts(kind):
    if kind == "random":
        g = torch.Generator().manual_seed(123)
        return tuple(tuple(torch.randint(0, V, (L,), generator=g).tolist()) for L in LENS)
    # repetitive: slices of the loopy target's own greedy text (its cycle, from index 11 on),
    # each at least one period long, so that prompt lookup finds the continuation at once
    text = naive_generate(loopy_target(), [5, 6], 60)
    return tuple(tuple(text[11 + i:11 + i + 17 + L]) for i, L in enumerate(LENS))


@lru_cache(maxsize=None)
def reference(kind, prompt, max_new_tokens):
    """Plain greedy decoding by the naive, cache-free model.generate."""
    target = loopy_target() if kind == "repetitive" else random_target()
    return naive_generate(target, list(prompt), max_new_tokens)


def make_drafter(name, target):
    if name == "ngram":
        return NgramDrafter()
    if name == "draft":
        return ModelDrafter(other_model())
    return ModelDrafter(target)  # "self": the target drafts for itself


# -----------------------------------------------------------------------------
# greedy: speculative == plain, token for token

MAX_NEW = 16


@pytest.mark.parametrize("kind", ["repetitive", "random"])
@pytest.mark.parametrize("K", [1, 4, 15])
@pytest.mark.parametrize("name", ["ngram", "draft", "self"])
def test_greedy_equals_plain(name, K, kind):
    target = loopy_target() if kind == "repetitive" else random_target()
    for B in (1, 3, 8):
        batch = [list(p) for p in prompts(kind)[:B]]
        outs, st = speculate.generate(target, batch, make_drafter(name, target), max_new_tokens=MAX_NEW, K=K)
        for b in range(B):
            assert outs[b] == reference(kind, tuple(batch[b]), MAX_NEW), f"row {b} of {B}"
        assert st["tokens_per_row"] == [MAX_NEW] * B
        if name == "self":  # the target's own drafts are always accepted: K + 1 tokens a pass
            assert st["acceptance_per_position"] == [1.0] * K
            assert st["row_passes"] == [1 + math.ceil((MAX_NEW - 1) / (K + 1))] * B  # 1 = prefill
        if name == "ngram" and kind == "repetitive" and K > 1:
            # the point of this prompt set: long acceptance runs
            assert st["tau"] > 2.0, st["tau"]
        if name == "ngram" and kind == "random":
            assert st["tau"] < 2.0  # and the short-acceptance regime really is short
    # plain decoding through the same loop (drafter=None) also equals the naive reference
    if K == 4 and name == "ngram":
        batch = [list(p) for p in prompts(kind)]
        outs, st = speculate.generate(target, batch, None, max_new_tokens=MAX_NEW)
        assert outs == [reference(kind, tuple(p), MAX_NEW) for p in batch]
        assert st["tau"] == 1.0


@pytest.mark.parametrize("name", ["ngram", "draft", "self"])
def test_batch_rows_equal_rows_alone(name):
    """Each row of a ragged batch of 8 decodes exactly as it does alone, with the same number
    of verify passes (the drafts of one row do not depend on its neighbours; a row that drafts
    less than they do leaves its other slots empty)."""
    target = loopy_target()
    batch = [list(p) for p in prompts("repetitive")]
    outs, st = speculate.generate(target, batch, make_drafter(name, target), max_new_tokens=MAX_NEW, K=4)
    for b, pr in enumerate(batch):
        alone, st1 = speculate.generate(target, [pr], make_drafter(name, target), max_new_tokens=MAX_NEW, K=4)
        assert outs[b] == alone[0]
        assert st["row_passes"][b] == st1["row_passes"][0]
    if name == "ngram":
        assert len(set(st["row_passes"])) > 1  # the rows really were ragged


def test_decoding_runs_without_cudnn_attention(monkeypatch):
    """cuDNN's attention plans every new shape (~70 ms each on an H200 in bfloat16) and decoding
    attends to a new number of keys at every pass: both decoders switch that backend off (a
    torch flag, so it shows on a CPU too), only while they run; a training forward keeps it."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or real(*a, **kw))
    target = random_target()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    speculate.generate(target, [[1, 2, 3]], max_new_tokens=3)
    naive_generate(target, [1, 2, 3], 2)
    assert len(seen) >= 3 * target.cfg.n_layer and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each
    target(torch.tensor([[1, 2, 3]]))
    assert all(seen[-target.cfg.n_layer:])


# -----------------------------------------------------------------------------
# continuous batching: a row that finishes takes the next prompt

def feature_drafter(name, target):
    """mtp / eagle / dflash with random weights on `target`, from their own test files (their
    state is what a refill must replace: caches, features, context K/V), on the target's device."""
    dev = target.head.weight.device
    if name == "mtp":
        from mtp import MTPDrafter
        from test_mtp import random_mtp
        return MTPDrafter(target, random_mtp(target).to(dev))
    if name == "eagle":
        from draft_eagle import EagleDrafter
        from test_eagle import random_eagle
        return EagleDrafter(target, random_eagle(target).to(dev))
    from draft_diffusion import DFlashDrafter
    from test_dflash import random_dflash
    return DFlashDrafter(target, random_dflash(target.cfg).to(dev))


class Wrapped:
    """A drafter around another: a subclass overrides propose (to record or change what it
    returns), and the rest (hidden_layers, prefill, update, refill, reset) is the inner one's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Recorder(Wrapped):
    """Records, per row, the drafts proposed after each committed context:
    {context tuple: drafts tuple}."""

    def __init__(self, inner):
        super().__init__(inner)
        self.seen = {}

    def propose(self, tokens, n, K, **kw):
        drafts, q = self.inner.propose(tokens, n, K, **kw)
        for b in range(tokens.shape[0]):
            self.seen[tuple(tokens[b, :int(n[b])].tolist())] = tuple(drafts[b].tolist())
        return drafts, q


@pytest.mark.parametrize("name", ["ngram", "draft", "self", "mtp", "eagle", "dflash"])
def test_continuous_batching_decodes_each_prompt_as_alone(name):
    """8 prompts through 3 rows: each output, its number of passes and every draft proposed for
    it equal those of the prompt decoded alone, so a refilled row keeps nothing of the prompt
    before it (a stale drafter cache would change the drafts, not the lossless output). ngram
    without a match drafts nothing alone, and leaves its slots empty (NO_DRAFT) in a batch
    where a neighbour matched: the same drafts once the empty slots are dropped."""
    target = loopy_target()
    make = (lambda: make_drafter(name, target)) if name in ("ngram", "draft", "self") else \
        (lambda: feature_drafter(name, target))
    batch = [list(p) for p in prompts("repetitive")]
    rec = Recorder(make())
    outs, st = speculate.generate(target, batch, rec, max_new_tokens=MAX_NEW, K=4, batch_size=3)
    assert st["verify_passes"] < sum(st["row_passes"])  # rows were shared: it was batched
    empty = 0
    for i, pr in enumerate(batch):
        alone_rec = Recorder(make())
        alone, st1 = speculate.generate(target, [pr], alone_rec, max_new_tokens=MAX_NEW, K=4)
        assert outs[i] == alone[0] == reference("repetitive", tuple(pr), MAX_NEW), f"prompt {i}"
        assert st["row_passes"][i] == st1["row_passes"][0], f"prompt {i}"
        for ctx, drafts in alone_rec.seen.items():
            seen = rec.seen.get(ctx, ())
            empty += NO_DRAFT in seen
            assert tuple(t for t in seen if t != NO_DRAFT) == drafts, f"prompt {i}: other drafts after {len(ctx)} tokens"
    assert empty > 0 if name == "ngram" else empty == 0  # empty slots beside a match were exercised
    plain, _ = speculate.generate(target, batch, None, max_new_tokens=MAX_NEW, batch_size=3)
    assert plain == outs


class RowZeroRight(ModelDrafter):
    """The target drafts for itself: row 0 keeps its drafts (all accepted), the other rows
    draft the token after (all rejected), so row 0 races past its budget mid-pass."""
    def propose(self, tokens, n, K, **kw):
        d, q = super().propose(tokens, n, K, **kw)
        d[1:] = (d[1:] + 1) % V
        return d, q


def test_a_row_reaching_its_budget_mid_pass_commits_no_further():
    """Without the commit's cap at the budget, the finished row kept accepting past it while
    its neighbour still drafted, and its cache ran past the K+1 positions of headroom."""
    target = loopy_target()
    long, short = list(prompts("repetitive")[4]), list(prompts("repetitive")[1])
    assert len(long) > len(short)
    outs, _ = speculate.generate(target, [long, short], RowZeroRight(copy.deepcopy(target)), max_new_tokens=3, K=4)
    assert outs == [reference("repetitive", tuple(p), 3) for p in (long, short)]


def test_random_mixes_of_every_option_stay_lossless():
    """The options one at a time are tested above; here they come together, as a user mixes
    them: a random drafter, K up to past its cap, fixed or continuous batches, a stop token
    that occurs (or none), budgets from 1 token, prompts cut to any length. Every row equals
    the cache-free reference cut at its first stop token."""
    rng, target = random.Random(0), loopy_target()
    text = naive_generate(target, [5, 6], 60)
    pool = [list(p) for p in prompts("repetitive") + prompts("random")]
    makers = {"ngram": NgramDrafter, "near": lambda: ModelDrafter(near_model_for(target)),
              **{m: (lambda m=m: feature_drafter(m, target)) for m in ("mtp", "eagle", "dflash")}}
    accepted = 0
    for case in range(30):
        name = rng.choice(sorted(makers))
        K, new, bs = rng.randint(1, 16), rng.randint(1, 24), rng.choice([None, 1, 2, 3])
        stop = rng.choice([None, text[13], text[20], rng.randrange(V)])
        batch = [p[:rng.randint(1, len(p))] for p in rng.sample(pool, rng.randint(1, 5))]
        outs, st = speculate.generate(target, batch, makers[name](), max_new_tokens=new, K=K, stop_token=stop,
                                      batch_size=bs)
        for p, o in zip(batch, outs):
            ref = naive_generate(target, p, new)
            assert o == (ref[:ref.index(stop) + 1] if stop in ref else ref), (case, name, K, new, bs, stop, len(p))
        accepted += sum(st["accepted_per_position"])
    assert accepted > 30  # drafts were accepted, so the commit and rollback paths ran


# -----------------------------------------------------------------------------
# sampling is lossless: a statistical test against the exact joint distribution

@torch.no_grad()
def exact_joint(target, prompt, n_tokens, temperature, top_k):
    """Exact distribution {(t_1, .., t_n): prob} of the first n new tokens of plain sampling,
    by enumerating every prefix with non-zero mass (top_k keeps this small)."""
    dist = {(): 1.0}
    for _ in range(n_tokens):
        seqs = list(dist)
        logits, _ = target(torch.tensor([list(prompt) + list(s) for s in seqs]))
        probs = logits_to_probs(logits[:, -1], temperature, top_k).double()  # (S, V)
        dist = {s + (t,): dist[s] * float(pr[t]) for s, pr in zip(seqs, probs) for t in pr.nonzero()[:, 0].tolist()}
    return dist


def total_variation(counts, exact):
    N = sum(counts.values())
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / N - exact.get(k, 0.0)) for k in keys)


def tv_bound(exact, N, delta=1e-6):
    """With N samples, E[TV(empirical, exact)] <= 0.5 sum_x sqrt(p(x)(1 - p(x)) / N), and TV
    moves by at most 1/N when one sample changes, so by McDiarmid it exceeds that mean by
    sqrt(ln(1/delta) / 2N) with probability < delta (here 1e-6: about 0.06 for N = 2000)."""
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / N) for p in exact.values())
    return mean + math.sqrt(math.log(1 / delta) / (2 * N))


SAMPLE_ROWS, SAMPLE_TOKENS, TEMPERATURE, TOP_K = 2000, 3, 1.0, 4


def sampled_tv(target, prompt, drafter, K=2, seed=0, temperature=TEMPERATURE, **kw):
    """TV between the first SAMPLE_TOKENS tokens of SAMPLE_ROWS sampled rows (one call, all rows
    at once or through batch_size refilled rows; kw: generate's batch_size, tree, compile) and
    the exact distribution, and the bound it must stay under."""
    exact = exact_joint(target, prompt, SAMPLE_TOKENS, temperature, TOP_K)
    outs, st = speculate.generate(target, [list(prompt)] * SAMPLE_ROWS, drafter, max_new_tokens=SAMPLE_TOKENS,
                                  K=K, temperature=temperature, top_k=TOP_K, seed=seed, **kw)
    counts = Counter(tuple(o) for o in outs)
    return total_variation(counts, exact), tv_bound(exact, SAMPLE_ROWS), st


@lru_cache(maxsize=None)
def sampling_target():
    return tiny_model(7, vocab=16)  # small vocabulary, top_k = 4: at most 64 outcomes


@lru_cache(maxsize=None)
def near_model():
    """A draft model close to the sampling target (its weights plus noise), so that q overlaps
    p and a fair share of drafts is accepted: every branch of the rule gets traffic."""
    return near_model_for(sampling_target(), noise=0.05, seed=8)


SAMPLE_PROMPT = (3, 1, 4, 1, 5)


def sampling_drafters():
    from draft_diffusion import DFlashDrafter
    from test_dflash import random_dflash
    t = sampling_target()
    return {"plain": None,
            "draft-q": ModelDrafter(near_model(), sample=True),     # real q
            "draft-argmax": ModelDrafter(near_model(), sample=False),  # argmax q (one-hot)
            "ngram": NgramDrafter(n=2),                            # argmax q from prompt lookup
            # each block slot drawn from its own q, as bench runs DFlash at T > 0
            "dflash-q": DFlashDrafter(t, random_dflash(t.cfg, block_size=4), sample=True)}


@pytest.mark.parametrize("name", ["plain", "draft-q", "draft-argmax", "ngram", "dflash-q"])
def test_sampling_is_lossless(name):
    tv, bound, st = sampled_tv(sampling_target(), SAMPLE_PROMPT, sampling_drafters()[name])
    assert tv < bound, f"{name}: TV {tv:.3f} >= bound {bound:.3f}"
    if name.startswith("draft"):  # both the accept and the reject branches were exercised
        assert 0.1 < st["acceptance_per_position"][0] < 0.9, st["acceptance_per_position"]
    if name == "dflash-q":  # a random drafter: rarely right, but not never
        assert 0.05 < st["acceptance_per_position"][0] < 0.9, st["acceptance_per_position"]


def test_sampling_is_lossless_with_continuous_batching():
    """2000 samples through 64 rows: all but the first 64 start in a refilled row."""
    tv, bound, st = sampled_tv(sampling_target(), SAMPLE_PROMPT, sampling_drafters()["draft-q"], batch_size=64)
    assert tv < bound, f"TV {tv:.3f} >= bound {bound:.3f}"
    assert st["verify_passes"] < SAMPLE_ROWS  # rows shared the passes


def test_both_loops_draw_float64_uniforms(monkeypatch):
    """float32's grid of 2^-24 put the emitted token off p (a total variation of 0.0015 at
    Qwen's 151,936 tokens, too small for the tests above to see): the loops must hand
    accept_scan float64 uniforms (tests/test_kernels.py checks what it does with them)."""
    seen, real = [], speculate.accept_scan
    monkeypatch.setattr(speculate, "accept_scan",
                        lambda p, d, q=None, u=None: seen.append(u.dtype) or real(p, d, q, u))
    drafter = ModelDrafter(near_model(), sample=True)
    speculate.generate_one(sampling_target(), list(SAMPLE_PROMPT), drafter, max_new_tokens=4,
                           temperature=1.0, seed=0)
    speculate.generate(sampling_target(), [list(SAMPLE_PROMPT)], drafter, max_new_tokens=4,
                       temperature=1.0, seed=0)
    assert len(seen) >= 2 and set(seen) == {torch.float64}, seen


@pytest.mark.parametrize("name", ["plain", "draft-q"])
def test_sampling_is_lossless_at_a_low_temperature(name):
    """T = 0.25, through 64 refilled rows: the first token of each row (pick(), also after a
    refill) and the verifier's p must both be warped at T. At T = 1 a warp at 1 instead of T
    cannot show; here it is ~0.25 TV away, against a bound of ~0.11."""
    tv, bound, _ = sampled_tv(sampling_target(), SAMPLE_PROMPT, sampling_drafters()[name], batch_size=64,
                              temperature=0.25)
    assert tv < bound, f"{name}: TV {tv:.3f} >= bound {bound:.3f}"


def broken_always_accept(p, drafts, q=None, uniforms=None):
    """Accepts every draft the target gives any mass (u = 0 in the ratio test)."""
    if uniforms is not None:
        uniforms = uniforms.clone()
        uniforms[:, :drafts.shape[1]] = 0.0
    return accept_scan_ref(p, drafts, q, uniforms)


def broken_residual_from_p(p, drafts, q=None, uniforms=None):
    """The right ratio test, but on rejection samples from p_i instead of norm(max(0, p_i - q_i))."""
    n, nxt = accept_scan_ref(p, drafts, q, uniforms)
    if uniforms is None:
        return n, nxt
    B, K = drafts.shape
    p_n = p[torch.arange(B), n][:, None]                         # (B, 1, V)
    _, from_p = accept_scan_ref(p_n, drafts[:, :0], None, uniforms[:, K:])  # K = 0: sample p_n
    return n, torch.where(n < K, from_p, nxt)


@pytest.mark.parametrize("name, broken", [("draft-q", broken_always_accept), ("draft-q", broken_residual_from_p),
                                          ("draft-argmax", broken_residual_from_p)])
def test_broken_acceptance_rule_fails(monkeypatch, name, broken):
    """The statistical test has teeth: a wrong rule lands at TV ~0.2 against the bound of ~0.14,
    while the right rule stays at the noise floor, TV ~0.06."""
    monkeypatch.setattr(speculate, "accept_scan", broken)
    tv, bound, _ = sampled_tv(sampling_target(), SAMPLE_PROMPT, sampling_drafters()[name])
    assert tv > bound, f"{broken.__name__} with {name}: TV {tv:.3f}, bound {bound:.3f}"


def broken_bonus_from_the_last_draft(p, drafts, q=None, uniforms=None):
    """The right rule, but with every draft accepted the bonus comes from p_K, not p_{K+1}."""
    n, nxt = accept_scan_ref(p, drafts, q, uniforms)
    K = drafts.shape[1]
    if uniforms is None or K == 0:
        return n, nxt
    shifted = p.clone()
    shifted[:, K] = p[:, K - 1]
    return n, torch.where(n == K, accept_scan_ref(shifted, drafts, q, uniforms)[1], nxt)


@pytest.mark.parametrize("broken", [None, broken_bonus_from_the_last_draft])
def test_sampling_is_lossless_through_the_bonus_token(monkeypatch, broken):
    """The tests above draft K = 2, so the bonus is the 4th new token, past the 3 they read (a
    bonus from the wrong position passed them at TV 0.07). At K = 1 it is the 3rd: the right
    rule stays under the bound, that broken one lands at TV ~0.35."""
    if broken:
        monkeypatch.setattr(speculate, "accept_scan", broken)
    tv, bound, _ = sampled_tv(sampling_target(), SAMPLE_PROMPT, sampling_drafters()["draft-q"], K=1)
    assert (tv > bound) if broken else (tv < bound), (tv, bound)


# -----------------------------------------------------------------------------
# accept_scan_ref on hand-built cases

def one_hot(i, V=4):
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


def test_accept_all_then_bonus_from_last_p():
    p = torch.tensor([[[0.1, 0.6, 0.2, 0.1], [0.3, 0.3, 0.3, 0.1], [0.0, 0.0, 0.0, 1.0]]])  # (1, K+1=3, 4)
    drafts = torch.tensor([[1, 2]])
    n, nxt = accept_scan_ref(p, drafts, p[:, :2].clone(), torch.tensor([[0.99, 0.99, 0.5]], dtype=F64))
    assert n.tolist() == [2] and nxt.tolist() == [3]  # q = p: ratio 1 > u; bonus from p_3
    # greedy: drafts equal the argmax of each p_i -> all accepted, bonus = argmax p_{K+1}
    n, nxt = accept_scan_ref(torch.tensor([[[0., 5., 1., 0.], [0., 0., 9., 1.], [2., 0., 0., 1.]]]),
                             torch.tensor([[1, 2]]))
    assert n.tolist() == [2] and nxt.tolist() == [0]


def test_bonus_ignores_q_when_every_draft_is_accepted():
    """All K drafts accepted (u = 0): the bonus comes from p_{K+1} alone. There is no q_{K+1},
    so nothing may be subtracted from it; q_K != p_{K+1} makes a wrong subtraction show."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])  # (1, 3, 4)
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]])
    drafts = torch.tensor([[1, 2]])
    picks = Counter()
    for i in range(64):  # inverse CDF over a grid of u: each token of a uniform p_3 gets 16
        n, nxt = accept_scan_ref(p, drafts, q, torch.tensor([[0.0, 0.0, (i + 0.5) / 64]], dtype=F64))
        assert n.tolist() == [2]
        picks[int(nxt)] += 1
    assert picks == {0: 16, 1: 16, 2: 16, 3: 16}


def test_first_rejected_samples_the_residual():
    # draft 1 has p = 0.1 < q = 0.6: with u = 0.5 the ratio test 0.5 < 1/6 fails at once
    p = torch.tensor([[[0.1, 0.4, 0.5], [1.0, 0.0, 0.0]]])   # (1, 2, 3)
    q = torch.tensor([[[0.6, 0.3, 0.1]]])                    # (1, 1, 3)
    drafts = torch.tensor([[0]])
    # residual max(0, p - q) = [0, 0.1, 0.4] -> [0, 0.2, 0.8]: inverse CDF over a grid of u
    M = 1000
    u = torch.stack([torch.full((M,), 0.5), (torch.arange(M) + 0.5) / M], 1).double()  # (M, 2)
    n, nxt = accept_scan_ref(p.expand(M, -1, -1), drafts.expand(M, -1), q.expand(M, -1, -1), u)
    assert (n == 0).all()
    assert torch.bincount(nxt, minlength=3).tolist() == [0, 200, 800]
    # greedy: the first mismatch emits the target's own argmax there
    n, nxt = accept_scan_ref(torch.tensor([[[0., 1., 3.], [5., 0., 0.], [0., 7., 0.]]]), torch.tensor([[1, 0]]))
    assert n.tolist() == [0] and nxt.tolist() == [2]


def test_the_residual_uses_the_rejected_position_after_an_accepted_draft():
    """d_1 accepted, d_2 rejected: the emitted token comes from max(0, p_2 - q_2), with q_2
    (not q_1) and, for argmax drafts, d_2 (not d_1) removed."""
    M = 1000
    u = torch.stack([torch.zeros(M), torch.full((M,), 0.99), (torch.arange(M) + 0.5) / M], 1).double()
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.1, 0.4, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    q = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.6, 0.3, 0.1, 0.0]]])  # q_1 != q_2
    n, nxt = accept_scan_ref(p.expand(M, -1, -1), torch.zeros(M, 2, dtype=torch.long), q.expand(M, -1, -1), u)
    assert (n == 1).all()  # 0 * 0.1 < 0.5 accepts d_1; 0.99 * 0.6 < 0.1 rejects d_2
    assert torch.bincount(nxt, minlength=4).tolist() == [0, 200, 800, 0]  # [0, .1, .4, 0] normalised
    # argmax drafts d = (0, 1): p_2 = [.5, .2, .3, 0] loses d_2 = 1, so 1 is never emitted
    p[0, 1] = torch.tensor([0.5, 0.2, 0.3, 0.0])
    n, nxt = accept_scan_ref(p.expand(M, -1, -1), torch.tensor([[0, 1]]).expand(M, -1), None, u)
    assert (n == 1).all()
    assert torch.bincount(nxt, minlength=4).tolist() == [625, 0, 375, 0]


def test_a_draft_the_target_never_samples_is_rejected_even_at_u_zero():
    """torch.rand can return exactly 0: the test u * q(d) < p(d) must then still reject a
    draft with p(d) = 0 (a `<=` would accept a token the target can never produce)."""
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    n, nxt = accept_scan_ref(p, torch.tensor([[0]]), q, torch.zeros(1, 2, dtype=F64))
    assert n.tolist() == [0] and nxt.tolist() == [2]  # the residual max(0, p - q) = [0, 0, .5]


def test_an_empty_residual_falls_back_to_p():
    """q = p with p(d) = 0: the draft is rejected (u * 0 < 0 fails) and max(0, p - q) is all
    zero; the emitted token must then come from p itself, never from the empty residual's
    inverse CDF (which would land on the last token, of probability 0)."""
    p = torch.tensor([[[0.0, 0.3, 0.7, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    M = 1000
    u = torch.stack([torch.full((M,), 0.5), (torch.arange(M) + 0.5) / M], 1).double()
    n, nxt = accept_scan_ref(p.expand(M, -1, -1), torch.zeros(M, 1, dtype=torch.long), p[:, :1].expand(M, -1, -1), u)
    assert (n == 0).all()
    assert torch.bincount(nxt, minlength=4).tolist() == [0, 300, 700, 0]


def test_residual_excludes_the_rejected_argmax_draft():
    # q one-hot at d (argmax drafts, q=None) while p has mass elsewhere: on rejection the
    # residual is p with d removed, so d can never be emitted
    p = torch.tensor([[[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    M = 1000
    u = torch.stack([torch.full((M,), 0.9), (torch.arange(M) + 0.5) / M], 1).double()
    n, nxt = accept_scan_ref(p.expand(M, -1, -1), torch.zeros(M, 1, dtype=torch.long), None, u)
    assert (n == 0).all()  # 0.9 * 1 < 0.5 fails
    assert torch.bincount(nxt, minlength=4).tolist() == [0, 600, 400, 0]
    # the same with an explicit one-hot q
    n2, nxt2 = accept_scan_ref(p.expand(M, -1, -1), torch.zeros(M, 1, dtype=torch.long),
                               one_hot(0)[None, None].expand(M, 1, 4), u)
    assert torch.equal(n, n2) and torch.equal(nxt, nxt2)


def test_p_equal_q_accepts_every_draft():
    g = torch.Generator().manual_seed(0)
    B, K, V = 64, 6, 10
    p = torch.softmax(3 * torch.randn(B, K + 1, V, generator=g), -1)
    q = p[:, :K].clone()
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    n, _ = accept_scan_ref(p, drafts, q, torch.rand(B, K + 1, generator=g, dtype=F64))
    assert (n == K).all()


def test_one_step_output_distribution_is_p():
    """The rule's whole point, for one step: a token drawn from q, then accepted or replaced
    by the residual, has exactly the distribution p (checked with 200k rows)."""
    g = torch.Generator().manual_seed(1)
    V, N = 6, 200_000
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])
    q = torch.tensor([0.05, 0.4, 0.1, 0.05, 0.2, 0.2])
    drafts = torch.multinomial(q, N, replacement=True, generator=g)[:, None]  # (N, 1)
    P = torch.stack([p, p])[None].expand(N, 2, V)
    n, nxt = accept_scan_ref(P, drafts, q[None, None].expand(N, 1, V), torch.rand(N, 2, generator=g, dtype=F64))
    emitted = torch.where(n == 1, drafts[:, 0], nxt)  # the first new token of the row
    freq = torch.bincount(emitted, minlength=V).double() / N
    assert (freq - p.double()).abs().max() < 0.005  # 4 sigma at N = 200k is ~0.004


def test_greedy_ties_pick_the_first_index():
    logits = torch.tensor([[[0., 3., 3., 1.], [2., 2., 0., 0.]]])  # argmax ties: index 1, then 0
    n, nxt = accept_scan_ref(logits, torch.tensor([[2]]))
    assert n.tolist() == [0] and nxt.tolist() == [1]
    n, nxt = accept_scan_ref(logits, torch.tensor([[1]]))
    assert n.tolist() == [1] and nxt.tolist() == [0]


def test_k_zero_is_plain_decoding():
    logits = torch.tensor([[[0., 3., 1.]], [[4., 0., 0.]]])  # (B=2, K+1=1, V=3)
    n, nxt = accept_scan_ref(logits, torch.zeros(2, 0, dtype=torch.long))
    assert n.tolist() == [0, 0] and nxt.tolist() == [1, 0]
    # sampling: inverse CDF of p over a grid of u reproduces p exactly
    p = torch.tensor([0.2, 0.0, 0.5, 0.3])
    M = 1000
    u = ((torch.arange(M, dtype=F64) + 0.5) / M)[:, None]
    n, nxt = accept_scan_ref(p[None, None].expand(M, 1, 4), torch.zeros(M, 0, dtype=torch.long), None, u)
    assert (n == 0).all()
    assert torch.bincount(nxt, minlength=4).tolist() == [200, 0, 500, 300]


@pytest.mark.parametrize("mode", ["greedy", "sample_q", "sample_argmax"])
def test_an_empty_slot_scans_like_a_row_that_drafted_less(mode):
    """A row whose drafts end at slot j (NO_DRAFT from there on) gets what the scan of its
    first j drafts alone gives, with the same uniforms: the same count and the same token. So a
    row leaving slots empty beside rows that draft decodes as it would alone; at j = 0, as
    plain decoding. (make_accept_case also empties the last row's second half.)"""
    from dev.kernels_check import make_accept_case
    K, reached = 6, 0
    for seed in range(6):
        p, drafts, q, u = make_accept_case(4, K, 97, mode, seed=seed)
        for j in range(K):
            d = drafts.clone()
            d[:, j:] = NO_DRAFT
            n, nxt = accept_scan_ref(p, d, q, u)
            short = (p[:, :j + 1], drafts[:, :j], None if q is None else q[:, :j],
                     None if u is None else torch.cat([u[:, :j], u[:, K:]], 1))
            n_short, nxt_short = accept_scan_ref(*short)
            assert torch.equal(n, n_short) and torch.equal(nxt, nxt_short), (seed, j)
            assert (n <= j).all()
            reached += int((n == j).sum())  # rows that accepted every draft, up to the empty slot
    assert reached > 10


def test_accept_scan_dispatches_to_the_reference_on_cpu(monkeypatch):
    """CPU tensors take the reference and build nothing; where the extension serves the device,
    speculate.accept_scan hands it the same arguments."""
    monkeypatch.setattr(kernels, "accept_scan", lambda *a: pytest.fail("CPU tensors use the reference"))
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(3, 5, 11, generator=g), -1)
    q = torch.softmax(torch.randn(3, 4, 11, generator=g), -1)
    d = torch.randint(0, 11, (3, 4), generator=g)
    u = torch.rand(3, 5, generator=g, dtype=F64)
    for args in [(p, d, q, u), (p, d, None, u), (p, d)]:
        a, b = speculate.accept_scan(*args), accept_scan_ref(*args)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels, "accept_scan", lambda *a: ("fused", a))
    assert speculate.accept_scan(p, d, q, u) == ("fused", (p, d, q, u))


# -----------------------------------------------------------------------------
# rollback, stop token, bad input

class CheckingDrafter:
    """Wraps a drafter; its update() checks the loop's state invariant after every verify step:
    the target has fed every committed token but the last (cache length n - 1 per row), and the
    cached keys and values there are those of a fresh prefill of exactly those tokens."""

    hidden_layers = ()

    def __init__(self, inner, target):
        self.inner, self.target, self.new_cache = inner, target, target.new_cache
        self.steps, self.ragged = 0, False

    def prefill(self, tokens, n, feats):
        self.inner.prefill(tokens, n, feats)

    def propose(self, *args, **kw):
        return self.inner.propose(*args, **kw)

    def update(self, tokens, n, feats, n_new):
        cache = self.target_cache
        assert torch.equal(cache.lengths, n - 1)
        for b in range(tokens.shape[0]):
            L = int(n[b]) - 1
            fresh = self.new_cache(1, max_len=cache.max_len)
            self.target(tokens[b:b + 1, :L], fresh)
            assert torch.allclose(cache.k[:, b, :, :L], fresh.k[:, 0, :, :L], atol=1e-5)
            assert torch.allclose(cache.v[:, b, :, :L], fresh.v[:, 0, :, :L], atol=1e-5)
        self.steps += 1
        self.ragged |= len(set(n_new[n_new > 0].tolist())) > 1
        self.inner.update(tokens, n, feats, n_new)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollback_keeps_cache_at_committed_length(monkeypatch, temperature):
    target = loopy_target()
    # ragged acceptance: prompt lookup on repetitive text (greedy), a near model's q (sampling)
    inner = NgramDrafter() if temperature == 0 else ModelDrafter(near_model_for(target))
    drafter = CheckingDrafter(inner, target)

    def spy(*a, **kw):  # keep the loop's cache where the drafter can see it
        drafter.target_cache = drafter.new_cache(*a, **kw)
        return drafter.target_cache
    monkeypatch.setattr(target, "new_cache", spy)
    batch = [list(p) for p in prompts("repetitive")[:3]] + [list(prompts("random")[0])]
    outs, _ = speculate.generate(target, batch, drafter, max_new_tokens=20, K=4, temperature=temperature, seed=0)
    assert drafter.steps > 3 and drafter.ragged
    if temperature == 0:
        assert outs == [naive_generate(target, p, 20) for p in batch]


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_stop_token_stops_its_row_only(name):
    target = random_target()
    batch = [list(p) for p in prompts("random")[:3]]
    refs = [reference("random", tuple(p), MAX_NEW) for p in batch]
    # a token that row 0 emits early and row 1 never does
    stop = next(t for t in refs[0][2:10] if t not in refs[1])
    outs, st = speculate.generate(target, batch, make_drafter(name, target), max_new_tokens=MAX_NEW, K=4,
                                  stop_token=stop)
    cut = [r[:r.index(stop) + 1] if stop in r else r for r in refs]
    assert outs == cut
    assert outs[0][-1] == stop and len(outs[0]) < MAX_NEW
    assert len(outs[1]) == MAX_NEW
    plain, _ = speculate.generate(target, batch, None, max_new_tokens=MAX_NEW, stop_token=stop)
    assert plain == cut
    # through one row: the stopped prompt hands its row to the next one early
    refilled, _ = speculate.generate(target, batch, make_drafter(name, target), max_new_tokens=MAX_NEW, K=4,
                                     stop_token=stop, batch_size=1)
    assert refilled == cut


def test_an_accepted_draft_of_the_stop_token_stops_the_row_in_that_pass():
    """The stop token committed among a pass's accepted drafts, not as its emitted token, ends
    the row there: no further passes (the output alone would not show it: take() cuts at the
    stop token anyway). The target drafting for itself accepts every draft of the first pass."""
    target, prompt = loopy_target(), list(prompts("repetitive")[0])
    ref = reference("repetitive", tuple(prompt), MAX_NEW)
    # the prefill emits ref[0]; the first draft-verify pass commits ref[1..4] as accepted drafts
    i = next(i for i in (1, 2, 3) if ref[i] not in ref[:i])
    for batch_size in (None, 1):  # fixed, and through one row with the second prompt waiting
        outs, st = speculate.generate(target, [prompt, prompt], make_drafter("self", target), max_new_tokens=MAX_NEW,
                                      K=4, stop_token=ref[i], batch_size=batch_size)
        assert outs == [ref[:i + 1]] * 2
        assert st["row_passes"] == [2, 2]  # the prefill and one draft-verify pass each
        assert st["verify_passes"] == (2 if batch_size is None else 4)


class StopProposer(NgramDrafter):
    """Always drafts the stop token: every draft is rejected by a target that never says it."""

    def __init__(self, stop):
        super().__init__()
        self.stop = stop

    def propose(self, tokens, n, K, **kw):
        return torch.full((tokens.shape[0], K), self.stop), None


def test_a_rejected_draft_of_the_stop_token_does_not_stop():
    """Only committed tokens can stop a row, never the rejected drafts after them."""
    target, prompt = random_target(), list(prompts("random")[0])
    ref = reference("random", tuple(prompt), MAX_NEW)
    stop = next(t for t in range(V) if t not in ref)
    outs, _ = speculate.generate(target, [prompt], StopProposer(stop), max_new_tokens=MAX_NEW, K=4, stop_token=stop)
    assert outs[0] == ref


def test_acceptance_counts_only_rows_still_decoding():
    """The target drafting for itself has every draft accepted, also after some rows are done:
    a finished row riding along in a pass is no draft attempt."""
    target = loopy_target()
    batch = [list(p) for p in prompts("repetitive")[:4]]
    _, st = speculate.generate(target, batch, ModelDrafter(target), max_new_tokens=MAX_NEW, K=4, batch_size=3)
    assert st["acceptance_per_position"] == [1.0] * 4


class FirstRowOnly(ModelDrafter):
    """The target drafts for row 0 (always accepted); every other row leaves its slots empty."""

    def propose(self, tokens, n, K, **kw):
        drafts, q = super().propose(tokens, n, K, **kw)
        drafts[1:] = NO_DRAFT
        return drafts, q


def test_a_pass_is_as_wide_as_the_rows_that_still_draft():
    """Row 0 drafts 4 tokens a pass and is done after 3 passes; row 1 drafts nothing and needs
    15. Once row 0 is done its drafts are dropped, and the passes shrink to the 1 position of
    plain decoding (a finished row riding along must not cost verify positions)."""
    target = loopy_target()
    batch = [list(p) for p in prompts("repetitive")[:2]]
    drafter = FirstRowOnly(copy.deepcopy(target))  # a copy: the hook below counts the target's passes only
    widths = []
    hook = target.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    try:
        outs, st = speculate.generate(target, batch, drafter, max_new_tokens=MAX_NEW, K=4)
    finally:
        hook.remove()
    assert outs == [reference("repetitive", tuple(p), MAX_NEW) for p in batch]
    assert st["row_passes"] == [1 + 3, MAX_NEW]  # 1 + 5 + 5 + 5 tokens; 1 token a pass
    assert widths[1:] == [5] * 3 + [1] * (MAX_NEW - 4), widths  # widths[0]: the prefill


def test_a_one_token_budget_needs_no_verify_pass_after_a_refill():
    """The prompt pass already yields the first token: a prompt with max_new_tokens = 1 is done
    after its prefill, whether it starts a batch or takes over a row."""
    batch = [list(p) for p in prompts("random")[:3]]
    outs, st = speculate.generate(random_target(), batch, NgramDrafter(), max_new_tokens=1, K=4, batch_size=1)
    assert outs == [list(reference("random", tuple(p), 1)) for p in batch]
    assert st["row_passes"] == [1, 1, 1] and st["verify_passes"] == 3 and st["tau"] == 1.0


def test_ngram_copies_what_followed_the_latest_occurrence():
    # the key (1, 2) occurs at 0 and 3; what followed its latest occurrence (7) is the better bet
    assert NgramDrafter(n=2)._lookup([1, 2, 9, 1, 2, 7, 1, 2], 1) == [7]


def test_ngram_tries_the_longest_key_first_and_every_earlier_start():
    """The longest suffix with an earlier occurrence decides: (1, 2) was followed by 3, though the
    latest 2 alone was followed by 1. An occurrence may overlap the key: in 4 9 9 the 9 at index
    1 is the latest earlier 9 (a scan that skipped it would find no match at all)."""
    assert NgramDrafter(n=2)._lookup([1, 2, 3, 9, 2, 1, 2], 1) == [3]
    assert NgramDrafter(n=2)._lookup([4, 9, 9], 2) == [9, 9]


def test_ngram_drafts_nothing_without_a_match_and_leaves_empty_slots_beside_a_match():
    ng, K = NgramDrafter(), 3
    assert ng._lookup([4, 5, 6], K) == []
    tokens = torch.tensor([[4, 5, 6, 0], [1, 2, 1, 0], [7, 8, 9, 0]])
    drafts, q = ng.propose(tokens, torch.tensor([3, 3, 3]), K)
    # row 1 matched (1 -> 2 -> 1 -> 2 ...): K slots for all; rows 0 and 2 leave theirs empty
    assert q is None and drafts.tolist() == [[-1, -1, -1], [2, 1, 2], [-1, -1, -1]]
    drafts, _ = ng.propose(tokens[[0, 2]], torch.tensor([3, 3]), K)
    assert drafts.shape == (2, 0) and drafts.dtype == torch.long


def test_an_argmax_model_drafter_drafts_argmax_picks_when_sampling():
    """ModelDrafter(sample=False) at T > 0 drafts its model's greedy continuation and returns
    q = None (one-hot q for the verifier); sample=True returns the warped q it drew from. The
    sampling test cannot tell them apart: the rule is lossless for either q."""
    target, prompt = random_target(), list(prompts("random")[0])
    tokens = torch.zeros(1, 32, dtype=torch.long)
    tokens[0, :len(prompt)] = torch.tensor(prompt)
    n, K, g = torch.tensor([len(prompt)]), 3, torch.Generator().manual_seed(0)
    argmax = ModelDrafter(target, sample=False)
    argmax.prefill(tokens, n, None)
    drafts, q = argmax.propose(tokens, n, K, temperature=1.0, top_k=None, generator=g)
    assert q is None and drafts[0].tolist() == naive_generate(target, prompt, K)
    sampler = ModelDrafter(target, sample=True)
    sampler.prefill(tokens, n, None)
    drafts, q = sampler.propose(tokens, n, K, temperature=1.0, top_k=None, generator=g)
    assert q.shape == (1, K, V)
    assert torch.allclose(q[0, 0], logits_to_probs(target(torch.tensor([prompt]))[0][0, -1], 1.0), atol=1e-5)


class NeverMatches(NgramDrafter):
    def _lookup(self, seq, K):
        return []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_without_drafts_is_a_step_of_plain_decoding(temperature):
    """A drafter may propose (B, 0): that pass must be the plain decoding step, down to the random
    numbers it draws, so the output, the passes and the seeded samples are plain decoding's."""
    batch = [list(p) for p in prompts("random")[:3]]
    kw = dict(max_new_tokens=MAX_NEW, temperature=temperature, seed=7, K=4)
    outs, st = speculate.generate(random_target(), batch, NeverMatches(), **kw)
    plain, st0 = speculate.generate(random_target(), batch, None, **kw)
    assert outs == plain and st["verify_passes"] == st0["verify_passes"] == MAX_NEW
    assert st["attempts_per_position"] == [0] * 4 and st["tau"] == 1.0


@torch.no_grad()
@pytest.mark.parametrize("batch_size", [None, 2])
@pytest.mark.parametrize("method", ["ngram", "draft", "mtp", "eagle", "dflash"])
def test_a_budget_that_fills_the_whole_context(method, batch_size):
    """Longest prompt + max_new_tokens + K + 1 = the target's context, the least generate
    accepts: rows finish at different passes and ride along to the end, and no drafter writes
    past its buffers or the RoPE table; greedy output is still plain decoding's."""
    target, K = random_target(), 4
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (200, 187, 196)]
    max_new = target.cfg.max_seq_len - 200 - K - 1
    plain, _ = speculate.generate(target, prompts, None, max_new_tokens=max_new)
    drafter = make_drafter(method, target) if method in ("ngram", "draft") else feature_drafter(method, target)
    spec, _ = speculate.generate(target, prompts, drafter, max_new_tokens=max_new, K=K, batch_size=batch_size)
    assert spec == plain


def test_bad_input_raises_clear_errors():
    target = random_target()
    gen = lambda prompts, **kw: speculate.generate(target, prompts, NgramDrafter(),
                                                   **{"max_new_tokens": 8, **kw})
    for bad in ([], [[1, 2], []], [[1, V]], [[-1, 2]], [[1.5, 2]], [[True, False]], [[[1, 2]]]):
        with pytest.raises(ValueError, match=rf"empty prompt .*not integers in 0\.\.{V - 1}"):
            gen(bad)
    for bad in ("def f(", ["def f(", "x ="], [1, 2, 3]):  # text, or one prompt not in a list
        with pytest.raises(ValueError, match="prompts is a list of prompts, each a list of token ids"):
            gen(bad)
    with pytest.raises(ValueError, match="exceeds the target's context"):
        gen([[1] * 200], max_new_tokens=60)
    with pytest.raises(ValueError, match="exceeds the target's context"):
        gen([[1] * 244])  # one position more than fits
    assert len(gen([[1] * 243])[0][0]) == 8  # 243 + 8 new + K + 1 = 256, the whole context
    for kw, message in [(dict(K=0), "K must be >= 1"), (dict(max_new_tokens=0), "max_new_tokens"),
                        (dict(temperature=-0.5), "temperature must be >= 0"),
                        (dict(temperature=float("nan")), "temperature must be >= 0 and finite, got nan"),
                        (dict(temperature=float("inf")), "must be >= 0 and finite, got inf"),
                        (dict(temperature=1.0, top_k=0), "top_k must be >= 1"),
                        (dict(batch_size=0), "batch_size must be >= 1"),
                        (dict(stop_token=V), rf"stop_token must be a token id in 0\.\.{V - 1}")]:
        with pytest.raises(ValueError, match=message):
            gen([[1, 2]], **kw)
    for kw in (dict(max_new_tokens=2.0), dict(K=2.5), dict(batch_size="1"), dict(stop_token="\n")):
        with pytest.raises(TypeError):  # 2.0 or "1" would fail deep in torch, or slice silently
            gen([[1, 2]], **kw)
    # tensors, arrays and numpy ints are ids too, and a (B, T) tensor is B prompts
    assert gen([torch.tensor([1, 2]), np.array([3, 4])])[0] == gen([[1, 2], [3, 4]])[0]
    assert gen(torch.tensor([[1, 2], [3, 4]]))[0] == gen([[1, 2], [3, 4]])[0]
    plain = gen([[1, 2]])[0][0]
    assert gen([[1, 2]], stop_token=np.int64(plain[2]))[0][0] == plain[:plain.index(plain[2]) + 1]
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        checkpoint.load_drafter("medusa", target, "out")
    assert checkpoint.load_drafter("ar", target, "out") is None
    assert isinstance(checkpoint.load_drafter("ngram", target, "out"), NgramDrafter)
    for n, min_n in ((0, 1), (2, 3), (3, 0)):
        with pytest.raises(ValueError, match=f"1 <= min_n <= n, got n={n}, min_n={min_n}"):
            NgramDrafter(n=n, min_n=min_n)


class Capped(NgramDrafter):
    """An ngram drafter with a default and a cap, as dflash (its block) and mtp (its depth)
    have; it records the K the loop asks for."""
    default_K, max_K = 2, 3

    def propose(self, tokens, n, K, **kw):
        self.asked = K
        return super().propose(tokens, n, K, **kw)


def test_k_defaults_to_the_drafters_own_and_is_capped_at_its_max():
    """generate(K=...) left at its default drafted 4 even for a drafter whose default is 15,
    and a K past the drafter's cap reserved headroom and reported acceptance for positions
    it could never draft (as 0.0)."""
    target, prompt = loopy_target(), list(prompts("repetitive")[0])
    ref = reference("repetitive", prompts("repetitive")[0], MAX_NEW)
    for K, used in ((None, 2), (1, 1), (3, 3), (9, 3)):
        dr = Capped()
        outs, st = speculate.generate(target, [prompt], dr, max_new_tokens=MAX_NEW, K=K)
        assert outs == [ref] and dr.asked == used and len(st["acceptance_per_position"]) == used, (K, st)
    # the cap also sets the headroom: a budget that fills the context with K = max_K still fits
    fill = target.cfg.max_seq_len - len(prompt) - Capped.max_K - 1
    assert len(speculate.generate(target, [prompt], Capped(), max_new_tokens=fill, K=50)[0][0]) == fill
    _, st = speculate.generate(target, [prompt], NgramDrafter(), max_new_tokens=8)
    assert len(st["acceptance_per_position"]) == 4  # no default_K: 4


class Misplaced(NgramDrafter):
    """A drafter that asks for target layers this target does not have."""
    def __init__(self, layers):
        super().__init__()
        self.hidden_layers = layers


def test_a_drafter_reading_layers_the_target_lacks_is_refused():
    """A drafter built for a deeper target asked for features of layers this one lacks: the
    target returned fewer states than asked, and the drafter failed on a torch shape error
    (or, with every layer missing, ran on no features at all)."""
    target = random_target()
    L = target.cfg.n_layer
    for layers in ((L + 1,), (0, L + 3), (-1,)):
        with pytest.raises(ValueError, match=rf"hidden_layers .* within this target's 0\.\.{L}"):
            speculate.generate(target, [[1, 2]], Misplaced(layers), max_new_tokens=4)
    assert speculate.generate(target, [[1, 2]], Misplaced((0, L)), max_new_tokens=4)[0] == \
        [naive_generate(target, [1, 2], 4)]


def test_a_drafter_built_for_a_target_of_another_shape_is_refused():
    """EAGLE, MTP and DFlash drafters embed and decode through the target they were built with;
    used with a target of another shape they failed on a torch shape error. One of the same
    shape (another set of weights) still runs, and stays lossless."""
    from draft_diffusion import DFlashDrafter
    from test_dflash import random_dflash
    target = random_target()
    other = Transformer(Config(vocab_size=V, **{**PRESETS["tiny"], "n_embd": 32})).eval()
    dr = DFlashDrafter(other, random_dflash(other.cfg), block_size=4)
    with pytest.raises(ValueError, match=r"the drafter was built for another target"):
        speculate.generate(target, [[1, 2]], dr, max_new_tokens=4)
    same_shape = tiny_model(2)
    dr = DFlashDrafter(same_shape, random_dflash(same_shape.cfg), block_size=4)
    assert speculate.generate(target, [[1, 2]], dr, max_new_tokens=6)[0] == [naive_generate(target, [1, 2], 6)]


def test_a_draft_model_of_another_vocabulary_is_refused():
    """A draft model (ModelDrafter) of a smaller vocabulary met the target's ids in its own
    embedding, one of a larger drafted ids the target lacks: an IndexError either way."""
    target = random_target()
    for vocab in (V - 1, V + 1):
        with pytest.raises(ValueError, match="the drafter was built for another target"):
            speculate.generate(target, [[1, 2]], ModelDrafter(tiny_model(1, vocab)), max_new_tokens=4)


class ShapeBreaker(NgramDrafter):
    """Returns drafts (and q) of the shape it is told: a drafter written against the interface
    wrongly."""

    def __init__(self, width, q_width=None, q_vocab=V, dtype=torch.long, fill=0):
        super().__init__()
        self.width, self.q_width, self.q_vocab, self.dtype, self.fill = width, q_width, q_vocab, dtype, fill

    def propose(self, tokens, n, K, **kw):
        q = None if self.q_width is None else torch.full((tokens.shape[0], self.q_width, self.q_vocab), 1.0 / self.q_vocab)
        return torch.full((tokens.shape[0], self.width), self.fill, dtype=self.dtype), q


def test_a_drafter_of_the_wrong_shape_is_named_not_an_index_error():
    """More than K drafts, or a q that does not match them, ended in an IndexError deep in the
    loop; the README invites drafters of your own, so the loop says what it takes."""
    target = random_target()
    # q one token narrower failed in the scan, one wider ran on its first V columns; int32 drafts
    # ran on the CPU reference but not through the extension (GPU)
    # drafts for one row of two, and an int64 q (one-hot, a distribution but for its dtype) too
    one_hot = lambda d, q: (d, torch.nn.functional.one_hot(d, V))
    for drafter, T in [(ShapeBreaker(5), 0.0), (ShapeBreaker(3, q_width=2), 1.0), (ShapeBreaker(3, 3, V - 1), 1.0),
                       (ShapeBreaker(3, 3, V + 1), 1.0), (ShapeBreaker(3, dtype=torch.int32), 0.0),
                       (QBreaker(lambda d, q: (d[:1], q[:1])), 1.0), (QBreaker(one_hot), 1.0)]:
        with pytest.raises(ValueError, match=r"the drafter returned drafts .*the loop takes int64 \(2, K' <= 4\)"):
            speculate.generate(target, [[1, 2], [3]], drafter, max_new_tokens=4, K=4, temperature=T)
    outs, _ = speculate.generate(target, [[1, 2]], ShapeBreaker(3, q_width=3), max_new_tokens=4, K=4, temperature=1.0)
    assert len(outs[0]) == 4  # K' < K with a matching q is within the contract


class QBreaker(ModelDrafter):
    """A draft model whose drafts and q pass through `bend(drafts, q)` before the loop sees
    them: the mistakes a drafter of one's own can make with q."""

    def __init__(self, bend):
        super().__init__(near_model_for(random_target()))
        self.bend = bend

    def propose(self, tokens, n, K, **kw):
        return self.bend(*super().propose(tokens, n, K, **kw))


def nan_off_the_draft(d, q):
    q = q.clone()
    q.scatter_(2, (d[..., None] + 1) % V, float("nan"))  # a token beside the draft: the residual's fallback hid it
    return d, q


def zero_at_the_draft(d, q):
    q = q.scatter(2, d[..., None], 0.0)
    return d, q / q.sum(-1, keepdim=True)  # a distribution, but one the draft was not drawn from


NOT_Q = r"the drafter's q must be probabilities over the"


@pytest.mark.parametrize("bend", [
    lambda d, q: (d, q.log()),  # log-probabilities: every draft accepted, TV 0.85 from p
    lambda d, q: (d, 2 * q),
    # 1 % too much mass: past the 1e-3 room a float32 softmax needs (a room of 0.1 let it through)
    lambda d, q: (d, 1.01 * q),
    lambda d, q: (d, 1.5 * q - 0.5 / V),  # negative entries, rows still summing to 1
    nan_off_the_draft, zero_at_the_draft,
    lambda d, q: (d + V, q),  # past the vocabulary: an IndexError deep in torch
    lambda d, q: (torch.full_like(d, V), q),  # one past the last id
    lambda d, q: (d, q / 2),  # half the mass: too little is as wrong as too much
    lambda d, q: (d * 0, q.log()),  # token 0 is a draft like any other, not an empty slot
    lambda d, q: (d, (1.03 * q).bfloat16()),  # bf16's room is its eps (2^-7), not 3 %
])
def test_a_q_that_is_not_the_drafts_distribution_is_refused(bend):
    """When sampling, the scan takes q as the distribution each draft was drawn from; one that
    is not (log-probs, 2q, negative or NaN entries, no mass at the draft) ran silently and
    changed the output's distribution. It is refused in one line."""
    with pytest.raises(ValueError, match=NOT_Q):
        speculate.generate(random_target(), [[1, 2], [3]], QBreaker(bend), max_new_tokens=8, K=3,
                           temperature=1.0, seed=0)


def test_greedy_reads_no_q_and_checks_none():
    """The checks of q cost greedy decoding nothing: it never reads q, so any q runs there."""
    target = random_target()
    junk = QBreaker(lambda d, q: (d, torch.full((*d.shape, V), -1.0)))
    assert speculate.generate(target, [[1, 2]], junk, max_new_tokens=8, K=3)[0] == [naive_generate(target, [1, 2], 8)]


def test_a_draft_past_the_vocabulary_is_named_when_greedy_too():
    """Greedy reads no q, but a draft id >= V was an IndexError in the target's embedding (a
    device-side assert on a GPU); it is now fed as V - 1 (never accepted) and named after the
    pass, in the transfer of counts the pass makes anyway."""
    with pytest.raises(ValueError, match=r"the drafter drafted a token past the vocabulary"):
        speculate.generate(random_target(), [[1, 2]], ShapeBreaker(3, fill=V + 2), max_new_tokens=8, K=3)


def test_q_in_a_narrower_dtype_and_junk_at_empty_slots_are_accepted():
    """The scan reads q as float32 (the reference and the extension), so a bf16 or fp16 q costs
    only its own rounding (~1e-3 in TV per step in bf16, measured); the row sums are checked
    with that much room. Rows of empty slots (NO_DRAFT) are never read: they may hold anything."""
    target = random_target()
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        outs, _ = speculate.generate(target, [[1, 2], [3]], QBreaker(lambda d, q: (d, q.to(dtype))),
                                     max_new_tokens=8, K=3, temperature=1.0, seed=0)
        assert [len(o) for o in outs] == [8, 8]

    def empty_last_slot(d, q):
        d, q = d.clone(), q.clone()
        d[0, -1], q[0, -1] = NO_DRAFT, float("nan")
        return d, q
    outs, _ = speculate.generate(target, [[1, 2], [3]], QBreaker(empty_last_slot), max_new_tokens=8, K=3,
                                 temperature=1.0, seed=0)
    assert [len(o) for o in outs] == [8, 8]


def test_hidden_layers_must_increase_each_once():
    """The target returns the layers a drafter asks for once each, in depth order: (2, 2) got
    one layer's features where the drafter expected two (a shape error in its own layers), (2, 1)
    got them swapped (silently other features)."""
    for layers in ((1, 1), (2, 1), (0, 2, 2)):
        with pytest.raises(ValueError, match=r"hidden_layers \(.*\) must increase, each once"):
            speculate.generate(random_target(), [[1, 2]], Misplaced(layers), max_new_tokens=4)


def test_a_draft_model_with_a_shorter_context_is_refused_before_it_runs_out():
    """A draft model of a smaller preset (context 16 here, the target's 256) would index past
    its RoPE table mid-run (an IndexError after minutes of bench); the run says so up front,
    and a run that fits its context goes ahead."""
    target = random_target()
    short = Transformer(Config(vocab_size=V, **{**PRESETS["tiny"], "n_layer": 1, "max_seq_len": 16})).eval()
    with pytest.raises(ValueError, match="this run needs 17 positions .* past the draft model's context of 16"):
        speculate.generate(target, [[1, 2, 3]], ModelDrafter(short), max_new_tokens=9, K=4)
    outs, _ = speculate.generate(target, [[1, 2, 3]], ModelDrafter(short), max_new_tokens=8, K=4)
    assert outs == [naive_generate(target, [1, 2, 3], 8)]


def test_a_batch_larger_than_the_prompt_list():
    """A caller's batch of 4 over 2 prompts (generate takes any list): the batch is the prompts
    there are."""
    batch = [list(p) for p in prompts("random")[:2]]
    outs, _ = speculate.generate(random_target(), batch, NgramDrafter(), max_new_tokens=8, K=4, batch_size=4)
    assert outs == [reference("random", tuple(p), 8) for p in batch]


@pytest.mark.parametrize("batch_size", [None, 1])  # fixed batch, and continuous (the stop seen at refill)
def test_a_row_whose_first_token_is_the_stop_token_ends_at_its_prefill(batch_size):
    batch = [list(p) for p in prompts("random")[:3]]
    refs = [reference("random", tuple(p), MAX_NEW) for p in batch]
    stop = refs[1][0]
    outs, st = speculate.generate(random_target(), batch, NgramDrafter(), max_new_tokens=MAX_NEW, K=4,
                                  stop_token=stop, batch_size=batch_size)
    assert outs == [r[:r.index(stop) + 1] if stop in r else r for r in refs]
    assert outs[1] == [stop] and st["row_passes"][1] == 1  # no pass spent on a finished row


# -----------------------------------------------------------------------------
# the simplest loop, and the one-prompt command line (sample.py)

@pytest.mark.parametrize("name", ["none", "ngram", "draft", "mtp", "eagle", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_one_equals_generate(name, temperature):
    """speculate.generate_one, the ~40-line batch-1 loop a reader meets first, and generate,
    the ragged batched one, give the same tokens: greedy, and sampled from the same seed (the
    two draw the same random numbers in the same order)."""
    target = random_target()
    make = dict(none=lambda: None, ngram=NgramDrafter, draft=lambda: ModelDrafter(near_model_for(target)))
    for pr in [list(p) for p in prompts("random")[:3]]:
        dr = make[name]() if name in make else feature_drafter(name, target)
        one = speculate.generate_one(target, pr, dr, max_new_tokens=MAX_NEW, K=4,
                                     temperature=temperature, seed=7)
        dr = make[name]() if name in make else feature_drafter(name, target)
        outs, _ = speculate.generate(target, [pr], dr, max_new_tokens=MAX_NEW, K=4,
                                     temperature=temperature, seed=7)
        assert one == outs[0]
        if temperature == 0:
            assert one == reference("random", tuple(pr), MAX_NEW)


def run_cli(tmp_path, monkeypatch, capsys, *argv):
    """sample.py's command line in this process (so monkeypatches reach it), ngram on the tiny
    target in tmp_path/t.pt -> what it printed."""
    import sample
    sample.main(["--target", str(tmp_path / "t.pt"), "--method", "ngram", "--device", "cpu", *argv])
    return capsys.readouterr().out


def test_cli_check_sees_a_broken_verifier(tmp_path, monkeypatch, capsys):
    """--check must compare with the naive model.generate: with an acceptance rule that takes
    every draft it prints False (a check that decoded speculatively twice would print True)."""
    save_tiny(tmp_path / "t.pt")
    save_tiny(tmp_path / "draft.pt", seed=1, n_layer=1)  # it drafts every step
    real = speculate.accept_scan

    def take_every_draft(p, drafts, q=None, uniforms=None):
        n, nxt = real(p, drafts, q, uniforms)
        return torch.full_like(n, drafts.shape[1]), nxt

    monkeypatch.setattr(speculate, "accept_scan", take_every_draft)
    out = run_cli(tmp_path, monkeypatch, capsys, "--method", "draft", "--prompt", "x = 1\nx = 1\n",
                  "--max-new-tokens", "8", "--check", "-K", "4")
    assert "[check] greedy output identical to model.generate: False" in out
    assert "acceptance per position: 1.00 1.00 1.00 1.00" in out  # what the broken rule reported
    monkeypatch.setattr(speculate, "accept_scan", real)
    out = run_cli(tmp_path, monkeypatch, capsys, "--method", "draft", "--prompt", "x = 1\nx = 1\n",
                  "--max-new-tokens", "8", "--check")
    assert "[check] greedy output identical to model.generate: True" in out


def test_cli_weights_names_the_drafters_folder(tmp_path, monkeypatch, capsys):
    """A drafter kept apart from its target is used with --weights DIR, not the one beside it."""
    save_tiny(tmp_path / "t.pt")
    save_tiny(tmp_path / "draft.pt", seed=1, n_layer=1)
    (tmp_path / "mine").mkdir()
    save_tiny(tmp_path / "mine" / "draft.pt", seed=2, n_layer=2)
    args = ("--method", "draft", "--prompt", "x = 1", "--max-new-tokens", "2")
    loaded, real = [], checkpoint.load_target
    monkeypatch.setattr(checkpoint, "load_target", lambda path, *a, **kw: loaded.append(path) or real(path, *a, **kw))
    import sample
    monkeypatch.setattr(sample, "load_target", checkpoint.load_target)
    run_cli(tmp_path, monkeypatch, capsys, *args)
    run_cli(tmp_path, monkeypatch, capsys, *args, "--weights", str(tmp_path / "mine"))
    assert loaded == [str(tmp_path / f) for f in ("t.pt", "draft.pt", "t.pt", "mine/draft.pt")]


def test_cli_runs_dflash_on_the_committed_weights_from_any_directory(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "sample.py"), "--device", "cpu", "--method", "dflash",
           "--prompt", "def parse(line):", "--max-new-tokens", "24", "--check"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-800:]
    assert "def parse(line):" in r.stdout and "[dflash] tau" in r.stdout
    assert "greedy output identical to model.generate: True" in r.stdout


def test_cli_bad_input_is_one_line(tmp_path, run_script):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "empty.pt").touch()
    for extra, message in [
            (["--target", str(tmp_path / "bad.pt")], "not a readable checkpoint"),
            (["--target", str(tmp_path / "empty.pt")], "not a readable checkpoint"),
            (["--target", str(tmp_path / "missing.pt")], "no such checkpoint"),
            (["--temperature", "nan"], "temperature must be >= 0 and finite, got nan"),
            (["--temperature", "inf"], "temperature must be >= 0 and finite, got inf"),
            (["--prompt", ""], "empty prompt"),
            (["--method", "ngram", "-K", "0"], "K must be >= 1"),
            (["--top-k", "5"], "--temperature 0 decodes greedily"),
            (["--method", "mtp", "--block-size", "8"], "--block-size sets an option of dflash"),
            (["--method", "eagle", "--dflash-argmax"], "--dflash-argmax sets an option of dflash"),
            (["--method", "dflash", "--mtp-draft", "2"], "--mtp-draft sets an option of mtp"),
            (["--method", "dflash", "--block-size", "17"], "block size 17 is outside what the "
                                                          "drafter was trained for (2..16)"),
            (["--method", "mtp", "--mtp-draft", "4"], "mtp has 3 modules"),
            (["--method", "eagle", "--weights", str(tmp_path)], f"{tmp_path / 'eagle.pt'}: no such checkpoint")]:
        rc, _, err = run_script("sample.py", "--device", "cpu", *extra)  # the committed weights
        assert rc == 1 and message in err, (extra, err[-800:])
    rc, _, err = run_script("sample.py", "--method", "medusa")
    assert rc == 2 and "invalid choice: 'medusa'" in err


def test_cli_drafter_flags_reach_the_loader(tmp_path, monkeypatch, capsys):
    """bench.py's --block-size, --dflash-argmax, --mtp-draft and --confidence
    (checkpoint.DRAFTER_FLAGS) set the same options here, on the committed weights."""
    import sample
    args = ["--prompt", "def parse(", "--max-new-tokens", "16", "--device", "cpu"]
    _, st = sample.main(args + ["--method", "dflash", "--block-size", "8", "--dflash-argmax",
                                "--temperature", "1"])
    assert len(st["acceptance_per_position"]) == 7
    _, st = sample.main(args + ["--method", "mtp", "--mtp-draft", "2"])
    assert len(st["acceptance_per_position"]) == 2
    _, st = sample.main(args + ["--method", "mtp", "--confidence", "1"])
    assert st["attempts_per_position"][1:] == [0, 0]  # no draft is that sure: one per step


def test_cli_passes_top_k_and_check_at_T1_says_samples_differ(tmp_path, monkeypatch, capsys):
    save_tiny(tmp_path / "t.pt")
    args = ("--prompt", "def f(x):", "--max-new-tokens", "12")
    greedy = run_cli(tmp_path, monkeypatch, capsys, *args).split("\n[")[0]
    top1 = run_cli(tmp_path, monkeypatch, capsys, *args, "--temperature", "1", "--top-k", "1", "--check")
    assert top1.split("\n[")[0] == greedy  # sampling from the top 1 is greedy
    assert "sampled outputs differ by design" in top1


def test_cli_samples_with_its_seed_and_decodes_with_the_targets_tokenizer(tmp_path, monkeypatch,
                                                                        capsys):
    """--seed reaches the sampler (seeds 0 and 3 continue differently, 3 twice alike), and the
    text is the target's own tokenizer's (a Hugging Face folder brings one: load_tokenizer)."""
    import data
    import sample
    save_tiny(tmp_path / "t.pt")
    args = ("--prompt", "def f(x):", "--max-new-tokens", "12", "--temperature", "1")
    texts = [run_cli(tmp_path, monkeypatch, capsys, *args, "--seed", s).split("\n[")[0]
             for s in ("0", "3", "3")]
    assert texts[0] != texts[1] == texts[2]
    enc, paths = data.get_encoding(), []
    tokenizer = lambda path: paths.append(path) or SimpleNamespace(
        encode_ordinary=enc.encode_ordinary, decode=lambda ids: f"<{len(ids)} tokens of its own>")
    monkeypatch.setattr(sample, "load_tokenizer", tokenizer)
    out = run_cli(tmp_path, monkeypatch, capsys, *args)
    assert out.startswith("def f(x):<12 tokens of its own>") and paths == [str(tmp_path / "t.pt")]


def test_cli_reports_the_decodings_tokens_per_second(tmp_path, monkeypatch, capsys):
    import sample
    save_tiny(tmp_path / "t.pt")
    monkeypatch.setattr(sample, "time", SimpleNamespace(perf_counter=iter([10.0, 14.0]).__next__))
    out = run_cli(tmp_path, monkeypatch, capsys, "--prompt", "def f(x):", "--max-new-tokens", "12")
    assert "| 3.0 tok/s |" in out  # 12 new tokens in 4 s


def test_the_readme_drafter_of_your_own_runs_and_is_lossless():
    """README's "Write a drafter of your own" block, run as a user would from the repository
    root: its own assert is the greedy equality, and it prints the greedy tau the README quotes."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("## Write a drafter of your own")[1].split("\n## ")[0]
    blocks = [b.split("```")[0] for b in section.split("```python\n")[1:]]
    assert len(blocks) == 1, len(blocks)
    r = subprocess.run([sys.executable, "-c", blocks[0]], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})  # steady beside a busy suite
    assert r.returncode == 0, r.stderr[-800:]
    assert r.stdout.splitlines()[-1].startswith("greedy tau"), r.stdout
    assert f"ends with `{r.stdout.splitlines()[-1]}`" in section, r.stdout
