"""
Tree verification for DFlash (DDTree, arXiv 2604.12989; DESIGN.md sec. 5): a step up from the
chain of speculate.py, which keeps one token per slot of DFlash's block and throws the rest of
each slot's distribution away.

One DFlash pass gives a distribution q_d over the token at every depth d = 1..S-1 of the block.
build_tree grows a tree of N nodes (the node budget) from them, best-first by the product of q
along the path (sampling: of Gumbel-perturbed q); the target verifies the root and all N nodes
in ONE pass of N + 1 positions, node t at position base + depth(t) (base: the row's cache
length) attending to the committed cache and to its own ancestors only.
Then, per row, from the root (the pending token, the last committed one) down:
  greedy    follow the child whose token is the target's argmax; emit the argmax where none is
  sampling  each node's children c_1..c_m were drawn from their slot's q without replacement, a
            draw of its own; recursive rejection sampling (SpecTr, SpecInfer; Jeon et al. 2024):
            r = p, then accept c_i with probability min(1, r(c_i) / q(c_i)), else r <- norm(max(0,
            r - q)) and q <- q without c_i, renormalized; if all are rejected, draw from r
Lossless: each step is the chain's rule for one draft, its residual the distribution of the
target's token given that this draft was rejected, and q without c_i that of the next draw. So
each node's token is a draw from p, as plain decoding's, and the walk goes on into the child
equal to it, whose p the same pass computed (greedy: the case p one-hot, q anything). The
accepted path's K/V then move right after the committed ones (compaction), so the cache reads
as if the path had been fed in order; the drafter gets the path's hidden states.

    python bench.py --methods ar,dflash,dflash-tree --tree 32
"""

import functools
import heapq

import torch

from model import draw, logits_to_probs


def build_tree(q, N, max_children=None, g=None):
    """q (D, V): one row's q_1..q_D -> (tokens, parents, depths) of N nodes in the order they were
    added, a parent first (parents index [root] + nodes). A path scores the sum of its nodes':
    greedy (g None) log q, alike at a depth; sampling log q + Gumbel noise of each node's own
    (shared noise biased the output), so a node's children are a draw from q without replacement
    and which nodes get in says nothing of their tokens (by log q alone the tree is biased).
    The heap holds each node's next sibling and first child: each pop adds the best node left."""
    D, V = q.shape
    k = min(max_children or N, V)
    logq = q.float().clamp_min(1e-30).log()

    def rank(d):  # slot d's k best tokens: (scores, tokens), lists
        s = logq[d]
        if g is not None:  # float64 uniforms: float32's under-draw q's tail at 150k tokens
            u = torch.rand(V, dtype=torch.float64, device=q.device, generator=g).clamp_min(1e-300)
            s = torch.where(q[d] > 0, s - (-u.log()).log(), float("-inf"))
        return [x.tolist() for x in s.topk(k)]
    rank = functools.cache(rank) if g is None else rank  # greedy: each slot ranked once
    tokens, parents, depths, ranks = [], [], [], {0: rank(0)}  # ranks[node]: its children's
    heap = [(-ranks[0][0][0], 0, 0, 0)]  # (-log P(path), parent, depth - 1, rank among siblings)
    while heap and len(tokens) < N:
        neg, parent, d, r = heapq.heappop(heap)
        logp, top_t = ranks[parent]
        tokens.append(top_t[r]); parents.append(parent); depths.append(d + 1)
        if r + 1 < k:    # the next sibling: the same path but this slot's next token
            heapq.heappush(heap, (neg + logp[r] - logp[r + 1], parent, d, r + 1))
        if d + 1 < D:    # the first child: one slot deeper, its best token
            ranks[len(tokens)] = rank(d + 1)
            heapq.heappush(heap, (neg - ranks[len(tokens)][0][0], len(tokens), d + 1, 0))
    return tokens, parents, depths


def sample_node(p, q, kids, g):
    """The sampling rule at one node: p (V,) the target's warped distribution there, q (V,) the
    slot its children were drawn from (without replacement, in the order of kids: [(token,
    node)]) -> (the accepted child's node, None) or (None, the emitted token)."""
    r, q = p.clone(), q.float().clone()
    for c, i in [(c, i) for c, i in kids if q[c] > 0]:  # q = 0: a tree past q's top-k pads, no draw
        u = torch.rand((), dtype=torch.float64, device=p.device, generator=g)
        if u * q[c] < r[c]:  # u < r(c) / q(c)
            return i, None
        s = (r - q).clamp(min=0)                   # rejected: r <- norm(max(0, r - q))
        r = s / s.sum() if s.sum() > 0 else r      # (no mass left only by rounding)
        q[c] = 0.0                                 # q <- q without c, renormalized
        q = q / q.sum().clamp_min(1e-30)
    return None, int(draw(r, g))


class DraftTree:
    """The tree step for speculate.generate(..., tree=DraftTree(N)) with a DFlash drafter:
    draft() replaces the chain's propose, verify() its verify pass and acceptance scan."""

    def __init__(self, N, max_children=None):
        if not N >= 1 or not (max_children or 1) >= 1:
            raise ValueError(f"a draft tree needs N >= 1 nodes (--tree) and max_children >= 1 "
                             f"(None: any), got N={N}, max_children={max_children}")
        self.N, self.max_children = N, max_children

    @torch.no_grad()
    def draft(self, drafter, tokens, n, K, temperature, top_k, g):
        """One DFlash pass over a block of K+1 -> node tokens, parents and depths (B, N) each
        (depth <= K; build_tree: sampling draws children in the order verify needs), q (B, K, V)."""
        logits = drafter.block_logits(tokens, n, K + 1)[:, 1:]              # (B, K, V)
        q = logits_to_probs(logits, temperature or 1.0, top_k)  # greedy ranks by q at T = 1
        # a size every row's tree reaches, so that all rows stack to (B, N)
        N = min(self.N, q.shape[1] * min(self.max_children or self.N, q.shape[2]))
        trees = [build_tree(q[b], N, self.max_children, g if temperature > 0 else None)
                 for b in range(q.shape[0])]
        return [torch.tensor(x, device=tokens.device) for x in zip(*trees)] + [q]

    @torch.no_grad()
    def verify(self, target, cache, tokens, n, nodes, layers, temperature, top_k, g):
        """One target pass over [root, nodes] per row -> drafts (B, D) as the loop commits them
        (the accepted path first), n_accepted (B,), the emitted token (B,), and the hidden
        states of [root, path] (one (B, D+1, C) per layer), with the cache compacted."""
        tok, par, dep, q = nodes                                        # (B, N) each, q
        B, N = tok.shape
        dev, rows = tokens.device, torch.arange(tokens.shape[0], device=tokens.device)
        par = torch.cat([par.new_zeros(B, 1), par], 1)                  # (B, N+1), root first
        dep = torch.cat([dep.new_zeros(B, 1), dep], 1)
        anc = torch.eye(N + 1, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # ancestor-or-self
        for t in range(1, N + 1):  # a parent comes before its children
            anc[:, t] |= anc[rows, par[:, t]]
        base = cache.lengths.clone()                                    # (B,) = n - 1
        j = torch.arange(cache.max_len, device=dev)                      # every key slot read
        node = j[None] - base[:, None]             # (B, keys): a key slot's node (< 0: committed)
        see = anc.gather(2, node.clamp(0, N)[:, None].expand(B, N + 1, -1))  # (B, N+1, keys)
        # NOTE: slots past a row's tree (node > N) hold stale entries: nobody sees them
        mask = ((see & (node <= N)[:, None]) | (node < 0)[:, None])[:, None]  # (B, 1, N+1, keys)
        x = torch.cat([tokens[rows, n - 1][:, None], tok], 1)           # (B, N+1)
        logits, hidden = target(x, cache, hidden_layers=layers, tree=(base[:, None] + dep, mask))
        sampling = temperature > 0
        p = logits_to_probs(logits, temperature, top_k) if sampling else logits.argmax(-1)
        tok_l, par_l = tok.tolist(), par.tolist()
        paths, nxt = [], []       # per row: [root, the accepted nodes...], the emitted token
        for b in range(B):
            path, cur = [], 0     # cur: the node the walk stands at, from the root (0) down
            while cur is not None:
                path.append(cur)
                kids = [(tok_l[b][i - 1], i) for i in range(1, N + 1) if par_l[b][i] == cur]
                if sampling:
                    d = min(int(dep[b, cur]), q.shape[1] - 1)  # a leaf: no kids, q unread
                    cur, t = sample_node(p[b, cur], q[b, d], kids, g)
                else:              # the child equal to the target's argmax, if any
                    t = int(p[b, cur])
                    cur = next((i for c, i in kids if c == t), None)
            paths.append(path)
            nxt.append(t)
        n_acc = torch.tensor([len(pa) - 1 for pa in paths], device=dev)
        depth = dep.max(1).values                                       # (B,) each tree's depth
        D = int(depth.max())
        idx = torch.zeros(B, D + 1, dtype=torch.long, device=dev)       # [root, path], padded
        for b, path in enumerate(paths):
            idx[b, :len(path)] = torch.tensor(path, device=dev)
            # compaction: the path's entries (at slots base + node) move to base + 1, base + 2, ...
            pos = torch.arange(1, len(path), device=dev)                # depths 1, 2, ...
            src, dst = base[b] + idx[b, pos], base[b] + pos
            cache.k[:, b, :, dst] = cache.k[:, b, :, src]
            cache.v[:, b, :, dst] = cache.v[:, b, :, src]
        # as the chain loop takes them: the path's tokens, then 0 where the tree had a node it
        # did not accept (counted as drafted), NO_DRAFT (-1) past the tree's depth
        i = torch.arange(D, device=dev)
        path_tok = tok.gather(1, (idx[:, 1:] - 1).clamp(min=0))
        drafts = torch.where(i < n_acc[:, None], path_tok, torch.where(i < depth[:, None], 0, -1))
        hidden = [h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1])) for h in hidden]
        return drafts, n_acc, torch.tensor(nxt, device=dev), hidden
