"""
generate(compile=True): every verify pass the same shape, run by a compiled forward over one
reused cache (speculate.static_step), and each drafter's propose compiled too (ngram's runs on
the host). Greedy tokens must equal the eager loop's, and sampled ones keep the target's
distribution. On a CPU this is inductor (a C++ compiler, ~10-30 s a
shape for these tiny models); the CUDA-graph path runs in the GPU test at the end.
"""

import copy
import os

import pytest
import torch

import data
import speculate
from checkpoint import load_drafter, load_target
from data import REF_WEIGHTS as W
from draft_simple import ModelDrafter, NgramDrafter
from kv_cache import KVCache
from model import generate as naive_generate
from test_speculate import (SAMPLE_PROMPT, feature_drafter, loopy_target, make_drafter,
                            Wrapped, other_model, prompts, sampled_tv, sampling_drafters,
                            sampling_target)

has_gpu = torch.cuda.is_available()


def strict(monkeypatch):
    """Drafters' propose compiled with fullgraph=True: torch.compile then refuses any graph
    break, which a host read (int(), .tolist(), a branch on a tensor) would be, so a drafter
    that compiles reads nothing back and has one shape."""
    def compiled(fn, owner, device):
        if isinstance(owner, torch.nn.Module):  # the target: as generate does
            return real(fn, owner, device)
        return owner.__dict__.setdefault("_strict", torch.compile(fn, fullgraph=True,
                                                                  dynamic=False))
    real = speculate.compiled
    monkeypatch.setattr(speculate, "compiled", compiled)


@pytest.mark.parametrize("name,conf", [("plain", 0), ("ngram", 0), ("draft", 0), ("mtp", 0),
                                       ("eagle", 0), ("dflash", 0), ("eagle", 0.3),
                                       ("mtp", 0.3)])
def test_compiled_steps_give_the_greedy_tokens_of_eager_ones(name, conf, monkeypatch):
    """5 prompts through 2 rows (continuous batching: rows finish while others run, and a
    stop token ends some early), K = 4 (mtp: its 3 modules): the same outputs as eager decoding
    and as the naive reference, and the same number of passes (padding the drafts to K changes
    no decision). Each drafter's propose compiles as one graph (strict); with --confidence the
    compiled one drafts all K and cuts by empty slots instead of stopping early."""
    strict(monkeypatch)
    target = loopy_target()
    drafter = {"plain": lambda: None, "ngram": NgramDrafter,
               "draft": lambda: make_drafter("draft", target)}.get(
        name, lambda: feature_drafter(name, target))()
    if conf:
        drafter.confidence = conf
    batch = [list(p) for p in prompts("repetitive")[:5]]
    stop = naive_generate(target, batch[1], 12)[9]  # prompt 1 stops at its 10th token
    kw = dict(max_new_tokens=12, K=3 if name == "mtp" else 4, batch_size=2, stop_token=stop)
    eager, st_e = speculate.generate(target, batch, drafter, **kw)
    compiled, st_c = speculate.generate(target, batch, drafter, compile=True, **kw)
    assert compiled == eager and st_c["row_passes"] == st_e["row_passes"]
    for p, out in zip(batch, eager):  # and both equal the naive reference, cut at the stop
        ref = naive_generate(target, p, 12)
        assert out == (ref[:ref.index(stop) + 1] if stop in ref else ref)
    assert len(eager[1]) == 10
    # a second call reuses the compiled forward and its cache, emptied first
    forward, cache = speculate.static_step(target, 2)
    again, _ = speculate.generate(target, batch, drafter, compile=True, **kw)
    assert again == eager and speculate.static_step(target, 2) == (forward, cache)
    assert cache.max_len == target.cfg.max_seq_len  # one shape, whatever the prompts


@pytest.mark.parametrize("name", ["draft", "mtp", "eagle", "dflash"])
def test_a_compiled_run_reuses_its_buffers_at_their_addresses(name):
    """A GPU's CUDA graphs replay in-place writes only into tensors whose addresses never change
    (torch runs the step without its graph otherwise): a second compiled run must find the
    target's cache and each drafter buffer over the context (caches, features, context K/V)
    where the first left them. Eager runs of other lengths keep one set, not one each."""
    target = loopy_target()
    drafter = make_drafter("draft", target) if name == "draft" else feature_drafter(name, target)
    T = target.cfg.max_seq_len

    def addresses():
        held = [b for v in vars(drafter).values() for b in (v if isinstance(v, list) else [v])]
        held += [speculate.static_step(target, 2)[1]]
        return [t.data_ptr() for b in held
                for t in ([b.k, b.v, b.lengths] if isinstance(b, KVCache) else [b])
                if isinstance(b, KVCache) or torch.is_tensor(b) and T in b.shape]
    batch, kw = prompts("repetitive")[:3], dict(max_new_tokens=6, K=3, batch_size=2)
    run = lambda **more: speculate.generate(target, batch, drafter, **kw, **more)
    first = run(compile=True)
    before = addresses()
    again = run(compile=True)
    assert again[0] == first[0] and addresses() == before and len(before) >= 4
    assert all(again[1][k] == first[1][k] for k in ("row_passes", "accepted_per_position"))
    for n in (4, 9):  # eager: buffers sized to each run
        speculate.generate(target, batch, drafter, max_new_tokens=n, K=3)
    assert len(drafter._kept) == 1


@pytest.mark.parametrize("name", ["draft", "mtp", "eagle", "dflash"])
def test_a_reused_drafter_decodes_as_a_fresh_one(name):
    """kept hands a drafter's buffers to its next run of that shape, emptied: a reused MTP whose
    caches kept their lengths decoded the same tokens with other acceptance (tau 2.96 against
    3.08). On the committed weights, where drafts are accepted (random drafters' are not)."""
    target = load_target(os.path.join(W, "target.pt"))
    batch = [data.get_encoding().encode_ordinary(t) for t in data.reference_prompts(3)]
    reused = load_drafter(name, target, W)
    runs = [speculate.generate(target, batch, d, max_new_tokens=24, batch_size=2)
            for d in (reused, reused, load_drafter(name, target, W))]
    assert len(reused._kept) == 1 and runs[2][1]["tau"] > 1.2
    for outs, st in runs[:2]:
        assert outs == runs[2][0]
        assert all(st[k] == runs[2][1][k] for k in ("row_passes", "accepted_per_position"))


@pytest.mark.parametrize("name", ["ngram", "draft-q", "dflash-q"])
def test_compiled_sampling_keeps_the_target_distribution(name, monkeypatch):
    """Padded drafts take other uniforms than the eager loop's, so the rows differ; their
    distribution must not (the bound of tests/test_speculate.py). draft-q and dflash-q draw
    their drafts inside a compiled propose from uniforms drawn before it, in one graph (strict:
    a generator there broke it in pieces, each a CUDA graph of its own, eager draws between)."""
    strict(monkeypatch)
    target, drafter = sampling_target(), sampling_drafters()[name]
    tv, bound, st = sampled_tv(target, SAMPLE_PROMPT, drafter, K=2, temperature=1.0, compile=True)
    assert tv < bound
    assert 0.05 < st["acceptance_per_position"][0] < 0.95  # the rule's branches both ran


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("name", ["plain", "draft", "mtp", "eagle", "dflash"])
def test_cuda_graphs_give_the_greedy_tokens_of_eager_decoding(name):
    """On a GPU the compiled forward is replayed as CUDA graphs (mode "reduce-overhead"), over a
    cache at fixed addresses: greedy rows equal the eager loop's on the same GPU. And replayed
    they are: torch runs a compiled step that writes a buffer of changing address without its
    graph (cudagraph_skips), as the draft model's, MTP's and EAGLE's propose did before
    kv_cache.kept."""
    target = copy.deepcopy(loopy_target()).cuda()  # a copy: .cuda() moves a module in place
    drafter = {"plain": lambda: None,
               "draft": lambda: ModelDrafter(copy.deepcopy(other_model()).cuda())}.get(
        name, lambda: feature_drafter(name, target))()
    batch = [list(p) for p in prompts("repetitive")[:5]]
    kw = dict(max_new_tokens=12, K=3 if name == "mtp" else 4, batch_size=2)
    eager, _ = speculate.generate(target, batch, drafter, **kw)
    torch._dynamo.utils.counters.clear()
    for _ in range(2):  # the first call records the graphs, the second replays them
        assert speculate.generate(target, batch, drafter, compile=True, **kw)[0] == eager
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


class OneShort(Wrapped):
    """A sampling drafter that returns one draft fewer than asked, with its q: the interface
    allows K' < K, and compile=True pads the missing slots to one shape."""
    static_shapes = False

    def propose(self, tokens, n, K, **kw):
        drafts, q = self.inner.propose(tokens, n, K, **kw)
        return drafts[:, :-1], q[:, :-1]


def test_compile_pads_missing_drafts_as_empty_slots(monkeypatch):
    """compile=True pads a short proposal with empty slots (NO_DRAFT, q = 0): never accepted,
    never counted as drafted. Padded with token 0 instead, the ratio test u * q < p with q = 0
    took token 0 wherever p gave it mass (TV 0.19, bound 0.14) and counted it as drafted. The
    compiler is replaced by the identity here: the padding is under test, not inductor (fast)."""
    monkeypatch.setattr(speculate, "compiled", lambda fn, owner, device: fn)
    target, drafter = sampling_target(), OneShort(sampling_drafters()["draft-q"])
    tv, bound, st = sampled_tv(target, SAMPLE_PROMPT, drafter, K=2, temperature=1.0, compile=True)
    assert st["attempts_per_position"][1] == 0, st["attempts_per_position"]
    assert tv < bound, tv
