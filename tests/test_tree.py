"""
tree.py, tree verification for DFlash (DESIGN.md sec. 5b): still lossless.

- greedy: token-identical to plain decoding (random and committed targets, batches of ragged
  rows, continuous batching, stop tokens, budgets that end inside a tree)
- sampling: the exact joint distribution of the first tokens, within the chain's TV bound; a
  broken rule fails the same test
- a tree of one chain is the chain verifier, pass for pass; compaction leaves the cache as if
  the accepted path had been fed in order; best-first growth keeps the N likeliest paths

    python -m pytest -q tests/test_tree.py
"""

import itertools
import math

import pytest
import torch

import speculate
import tree
from draft_diffusion import DFlashDrafter
from draft_simple import NgramDrafter
from model import generate as naive_generate
from test_dflash import random_dflash
from test_model import tiny_model
from test_speculate import SAMPLE_PROMPT, sampled_tv, sampling_target

PROMPTS = [[5, 9, 2, 7, 7, 1, 30, 4, 4], [3], [8, 1, 8, 1, 8, 1],
           [60, 61, 62, 63, 2, 2, 2, 2, 9, 9]]


def random_drafter(target, block_size=6, seed=100, **kw):
    return DFlashDrafter(target, random_dflash(target.cfg, seed, block_size), **kw)


def test_build_tree_keeps_the_n_likeliest_paths():
    """Best-first growth on a product of per-depth distributions is the top N of all paths
    by probability (a prefix of a path is always likelier, so the set is a tree)."""
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(3, 5, generator=g) * 2, -1)
    for N in (1, 4, 9, 20):
        tokens, parents, depths = tree.build_tree(q, N)
        paths = []  # each node's path of tokens, from its parents
        for t, p in zip(tokens, parents):
            paths.append((paths[p - 1] if p else ()) + (t,))
        assert [len(p) for p in paths] == depths and all(p < i + 1 for i, p in enumerate(parents))
        prob = lambda path: math.prod(float(q[d, t]) for d, t in enumerate(path))
        every = [pa for d in range(1, 4) for pa in itertools.product(range(5), repeat=d)]
        best = sorted(every, key=prob, reverse=True)[:N]
        assert sorted(map(prob, paths)) == pytest.approx(sorted(map(prob, best)))
    chain = tree.build_tree(q, 3, max_children=1)  # one child each: the argmax chain
    assert chain == (q.argmax(-1).tolist(), [0, 1, 2], [1, 2, 3])


@pytest.mark.parametrize("N", [1, 5, 16])
def test_greedy_tree_equals_plain_decoding(N):
    target = tiny_model(0)
    for batch, kw in [(PROMPTS[:1], {}), (PROMPTS, {}), (PROMPTS, dict(batch_size=2)),
                      (PROMPTS, dict(max_new_tokens=3))]:  # a budget that ends inside a tree
        new = kw.pop("max_new_tokens", 14)
        outs, st = speculate.generate(target, batch, random_drafter(target), max_new_tokens=new,
                                      tree=tree.DraftTree(N), **kw)
        assert outs == [naive_generate(target, p, new) for p in batch], (N, kw)
    ref = naive_generate(target, PROMPTS[0], 14)
    stop = ref[4]
    outs, _ = speculate.generate(target, PROMPTS[:2], random_drafter(target), max_new_tokens=14,
                                 stop_token=stop, tree=tree.DraftTree(N))
    assert outs[0] == ref[:ref.index(stop) + 1]


def test_a_tree_of_one_chain_is_the_chain_pass_for_pass():
    target = tiny_model(3)
    chain = speculate.generate(target, PROMPTS, random_drafter(target), max_new_tokens=20)
    one = speculate.generate(target, PROMPTS, random_drafter(target), max_new_tokens=20,
                             tree=tree.DraftTree(5, max_children=1))
    assert chain[0] == one[0]
    for key in ("row_passes", "accepted_per_position", "attempts_per_position"):
        assert chain[1][key] == one[1][key], key


class CheckingDrafter(DFlashDrafter):
    """Checks in every update that the target's cache holds, at positions 0..n-2 of each row,
    exactly the K/V a fresh prefill of the committed tokens gives: compaction moved the
    accepted path's entries (written at the slots of their tree nodes) into order. And that the
    features it gets for the newly fed positions are the target's hidden states there: handed
    the first nodes' instead of the accepted path's, decoding stayed lossless but DFlash drafted
    from tokens never committed."""
    checks = 0

    def update(self, tokens, n, feats, n_new):
        cache = self.cache
        assert torch.equal(cache.lengths, n - 1)
        for b in range(tokens.shape[0]):
            L, k = int(n[b]) - 1, int(n_new[b])
            fresh = self.fresh_cache(1, max_len=cache.max_len)
            _, hidden = self.target(tokens[b:b + 1, :L], fresh, hidden_layers=self.hidden_layers)
            assert torch.allclose(cache.k[:, b, :, :L], fresh.k[:, 0, :, :L], atol=1e-5)
            assert torch.allclose(cache.v[:, b, :, :L], fresh.v[:, 0, :, :L], atol=1e-5)
            assert torch.allclose(feats[b, :k], torch.cat(hidden, -1)[0, L - k:L], atol=1e-5)
        CheckingDrafter.checks += int((n_new > 2).any())  # a path of two drafts or more
        super().update(tokens, n, feats, n_new)


def test_compaction_leaves_the_cache_as_if_the_path_was_fed(monkeypatch):
    target = tiny_model(4)
    with torch.no_grad():  # damp attention: a near-bigram target its drafter often agrees with
        for blk in target.blocks:
            blk.attn.wo.weight.mul_(0.02)
    drafter = CheckingDrafter(target, random_dflash(target.cfg, 101, 6))
    real = drafter.fresh_cache = target.new_cache
    keep = lambda *a, **k: setattr(drafter, "cache", real(*a, **k)) or drafter.cache
    monkeypatch.setattr(target, "new_cache", keep)  # the loop's cache, for the checks
    text = naive_generate(target, [5, 6], 40)
    batch = [text[:12], text[3:20], [1, 2]]
    outs, _ = speculate.generate(target, batch, drafter, max_new_tokens=16, tree=tree.DraftTree(12))
    assert outs == [naive_generate(target, p, 16) for p in batch]
    assert CheckingDrafter.checks > 0


def test_each_node_sees_the_cache_and_its_ancestors_only(monkeypatch):
    """The mask of a tree pass over ragged rows, against its definition: node i of row b sees
    key slot j iff j < L_b (the row's cache) or j = L_b + a for a node a on i's path. Slots past
    a shorter row's tree hold stale entries (a shorter row's last node once saw them)."""
    target, masks = tiny_model(0), []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: masks.append(k.get("tree")) or
                        forward(*a, **k))
    speculate.generate(target, PROMPTS, random_drafter(target), max_new_tokens=12,
                       tree=tree.DraftTree(5))
    passes = [t for t in masks if t is not None]
    assert passes
    for pos, mask in passes:                       # pos (B, N+1), mask (B, 1, N+1, keys)
        for b in range(pos.shape[0]):
            L, dep = int(pos[b, 0]), pos[b] - pos[b, 0]
            for i in range(pos.shape[1]):
                seen = mask[b, 0, i].nonzero()[:, 0].tolist()
                path = [j - L for j in seen if j >= L]
                assert seen[:L] == list(range(L)) and path[0] == 0 and i in path
                assert max(path) < pos.shape[1]              # nothing past its tree
                # a node on i's path (the root first) stands at each depth once, i deepest
                assert sorted(int(dep[a]) for a in path) == list(range(int(dep[i]) + 1))


def tree_tv(drafter_tree, seed=0, block_size=4):
    target = sampling_target()
    dr = random_drafter(target, block_size=block_size, seed=7)
    return sampled_tv(target, SAMPLE_PROMPT, dr, K=None, seed=seed, temperature=1.0,
                      tree=drafter_tree)


def test_sampling_with_a_tree_is_lossless():
    tv, bound, st = tree_tv(tree.DraftTree(6))
    assert tv < bound, (tv, bound)
    assert 0.05 < st["acceptance_per_position"][0] < 0.95, st["acceptance_per_position"]


def test_each_node_draws_its_children_on_its_own_when_sampling():
    """Sampling: a node's children must be a draw without replacement from their slot's q,
    whatever the tree's shape. With one Gumbel noise per depth every node of a depth ranked the
    same children, so whether the second depth-1 node got a child hung on its sibling's
    children: that child was token 0 in 97 % of such trees, not q's 90 % (output TV ~0.01)."""
    q = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.9, 0.05, 0.03, 0.02]])
    g, first = torch.Generator().manual_seed(0), []
    for _ in range(4000):
        tokens, parents, _ = tree.build_tree(q, 4, g=g)
        second = [i + 1 for i, p in enumerate(parents) if p == 0][1:2]  # the 2nd depth-1 node
        first += [t for t, p in zip(tokens, parents) if p in second][:1]
    share = sum(t == 0 for t in first) / len(first)
    assert abs(share - 0.9) < 4 * (0.09 / len(first)) ** 0.5, (share, len(first))


def test_whether_a_sibling_gets_in_says_nothing_of_its_token():
    """Sampling: the growth may give a node a second child or not, but not by which token the
    child is, or the rule's residual no longer matches that child's draw. Paths scored by log q
    instead of the noisy scores let the root's second child in after token 0 only when it was
    token 1 (q .3 > .5 x .4 > .2): 73 % of such trees against q's 60 % (output TV ~0.03)."""
    q = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.3, 0.3]])
    g, second = torch.Generator().manual_seed(0), []
    for _ in range(16000):
        tokens, parents, _ = tree.build_tree(q, 2, g=g)
        kids = [t for t, p in zip(tokens, parents) if p == 0]
        second += kids[1:] if kids[0] == 0 else []
    share = sum(t == 1 for t in second) / len(second)
    assert len(second) > 400 and abs(share - 0.6) < 4 * (0.24 / len(second)) ** 0.5, share


def test_a_tree_larger_than_the_top_k_candidates_stays_lossless():
    """One slot (block 2) and top-k 4 give 4 candidates with q > 0; a tree of 8 is padded with
    tokens q never draws (score -inf). The rule must not take them for draws: before it skipped
    them, the first one was accepted whenever the residual gave it any mass (TV 0.52)."""
    q, g = torch.tensor([[0.25] * 4 + [0.0] * 4]), torch.Generator().manual_seed(0)
    assert len(tree.build_tree(q, 8, g=g)[0]) == 8
    tv, bound, _ = tree_tv(tree.DraftTree(8), block_size=2)
    assert tv < bound, (tv, bound)


def test_a_tree_without_nodes_or_without_dflash_is_refused():
    target = tiny_model(0)
    for n, kids in [(0, None), (-1, None), (4, -2)]:
        with pytest.raises(ValueError, match="a draft tree needs N >= 1"):
            tree.DraftTree(n, kids)
    for drafter in (None, NgramDrafter()):
        with pytest.raises(ValueError, match="needs a DFlash drafter"):
            speculate.generate(target, PROMPTS[:1], drafter, max_new_tokens=4,
                               tree=tree.DraftTree(4))


def test_a_broken_tree_rule_fails(monkeypatch):
    """The same test catches a rule that draws from p after a rejection instead of from the
    residual (it over-weights the rejected children)."""
    def broken(p, q, kids, g):
        for c, i in kids:
            if torch.rand((), generator=g) * q[c] < p[c]:
                return i, None
        return None, int(tree.draw(p, g))
    monkeypatch.setattr(tree, "sample_node", broken)
    tv, bound, _ = tree_tv(tree.DraftTree(6))
    assert tv > bound, (tv, bound)


def test_dflash_tree_is_a_method_of_bench_and_sample(capsys):
    """load_drafter("dflash-tree") is the committed DFlash drafter carrying a DraftTree, which
    generate picks up by itself: bench and sample.py run it by name, losslessly."""
    import bench
    import sample
    results = bench.main(["--methods", "dflash-tree", "--tree", "12", "--n-prompts", "2",
                          "--max-new-tokens", "16", "--temperatures", "0"])
    assert [(r["method"], r["lossless"]) for r in results] == [("ar", True), ("dflash-tree", True)]
    out = capsys.readouterr().out
    assert "dflash-tree 15 (block 16, tree of 12 nodes)" in out
    assert "\ndflash-tree: 1.90M params" in out and "\ndflash: " not in out  # its own line
    sample.main(["--method", "dflash-tree", "--tree", "8", "--max-new-tokens", "24", "--check"])
    assert "identical to model.generate: True" in capsys.readouterr().out


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_K_caps_the_trees_depth(T):
    """K drafts per step is the tree's depth bound (a block of K+1), as the chain's length."""
    target = tiny_model(0)
    outs, st = speculate.generate(target, PROMPTS, random_drafter(target), max_new_tokens=12, K=2,
                                  temperature=T, seed=0, tree=tree.DraftTree(8))
    assert len(st["attempts_per_position"]) == 2 and st["tau"] <= 3
    if T == 0:
        assert outs == [naive_generate(target, p, 12) for p in PROMPTS]


def test_a_node_judges_each_later_child_against_q_without_the_rejected_ones():
    """Sampling, one node: its children are a draw from q without replacement, so after a
    rejection the next child is judged against q without the rejected ones, renormalized; the
    emitted token must follow p. Here q puts .93 on a token p gives .10: keeping the rejected
    child's mass in q (forgetting q[c] = 0) skewed the output by a TV of 0.43."""
    p = torch.tensor([0.12, 0.10, 0.11, 0.67])
    q = torch.tensor([0.04, 0.93, 0.01, 0.02])
    g, out = torch.Generator().manual_seed(0), []
    for _ in range(2000):
        toks, _, _ = tree.build_tree(q[None], 2, g=g)  # two root children, drawn as verify's
        node, t = tree.sample_node(p, q, [(c, i + 1) for i, c in enumerate(toks)], g)
        out.append(toks[node - 1] if node is not None else t)
    freq = torch.bincount(torch.tensor(out), minlength=4) / len(out)
    assert 0.5 * float((freq - p).abs().sum()) < 0.05, freq.tolist()  # ~0.01 by chance


class PeakedSlots:
    """A stand-in for DFlash whose depths draft very differently (all a tree step reads is
    block_logits): depth 1 puts ~.995 of q on the target's second choice c, depth 2 leaves c
    ~1e-4, the rest on three other tokens (in the top-k, so that c keeps some mass there)."""
    hidden_layers = ()

    def __init__(self, target):
        self.target = target

    def prefill(self, *args):
        pass
    update = refill = prefill

    def block_logits(self, tokens, n, S):
        B, V = len(n), self.target.cfg.vocab_size
        logits = self.target(tokens[:, :int(n.max())])[0]          # causal: padding unread
        c = logits[torch.arange(B), n - 1].topk(2).indices[:, 1]    # (B,) the second choice
        others = (c[:, None] + torch.arange(1, 4)) % V              # (B, 3)
        out = torch.zeros(B, S, V)
        out[:, 1].scatter_(1, c[:, None], 8.0)
        out[:, 2:] = -20.0
        out[:, 2:].scatter_(2, others[:, None].expand(-1, S - 2, -1), 8.0)
        out[:, 2:].scatter_(2, c[:, None, None].expand(-1, S - 2, 1), 0.0)
        return out


def test_each_node_judges_its_children_by_the_q_of_their_own_depth():
    """Sampling: a node at depth d drew its children from the q of depth d + 1 (q[:, d]), and
    must judge them by it. Read at the next depth (q[:, d + 1]), c, drawn with q ~.995 but
    judged with q ~1e-4, was accepted whenever p gave it any mass (output TV 0.71); the
    random DFlash of the other tests drafts alike at every depth, so they did not see it."""
    target = sampling_target()
    tv, bound, st = sampled_tv(target, SAMPLE_PROMPT, PeakedSlots(target), K=2, temperature=1.0,
                               tree=tree.DraftTree(3))
    assert tv < bound, tv
    assert 0.05 < st["acceptance_per_position"][0] < 0.95, st["acceptance_per_position"]


def test_compile_leaves_a_tree_eager_on_a_cache_of_its_own_need(monkeypatch):
    """A tree's passes are not compiled, so compile=True leaves them on a cache of their own
    need: static_step's of the whole context gives eager attention only more slots to read.
    The same tokens (and draws) as without, nothing compiled."""
    monkeypatch.setattr(speculate, "compiled", lambda *a: pytest.fail("a tree compiled"))
    target = tiny_model(0)
    kw = dict(max_new_tokens=8, tree=tree.DraftTree(5), temperature=1.0, seed=0)
    eager = speculate.generate(target, PROMPTS, random_drafter(target), **kw)[0]
    compiled = speculate.generate(target, PROMPTS, random_drafter(target), compile=True, **kw)[0]
    assert compiled == eager
    assert "_kept" not in target.__dict__  # no static_step cache of the whole context
