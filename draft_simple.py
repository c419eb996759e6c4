"""
The two drafters that read no target features, the helpers the drafters with a cache of their
own share (mtp.py, draft_eagle.py), and the --confidence cut of draft, mtp, eagle and dflash.
Their interface is in speculate.py's docstring.

  ngram  prompt lookup (Saxena 2023): the tokens that followed the latest earlier occurrence
         of the last n committed tokens. No training, no model, no q.
  draft  a smaller model of the target's family with its own KV cache drafts K tokens one at
         a time (Leviathan et al. 2023); when sampling it returns its real q. Trained like any
         LM: `python train.py --preset cpu-draft --out-path out/cpu/draft.pt`. --confidence C:
         a row stops after a draft it is less sure of than C (draft_chain).

    python sample.py --method ngram --prompt "def parse("
"""

import torch
import torch.nn.functional as F

from kv_cache import kept
from model import draw, logits_to_probs
from speculate import NO_DRAFT


class NgramDrafter:
    """Prompt lookup, falling back from `n`-grams to shorter ones. Without a match it proposes
    nothing (a step of plain decoding); in a batch such a row leaves its slots empty (NO_DRAFT)
    beside rows that drafted, so every row decodes as it would alone."""
    hidden_layers = ()

    def __init__(self, n=3, min_n=1):
        if not 1 <= min_n <= n:  # else no key length is tried and it never drafts
            raise ValueError(f"ngram keys need 1 <= min_n <= n, got n={n}, min_n={min_n}")
        self.max_n, self.min_n = n, min_n

    def prefill(self, *args):  # no state: propose reads the committed tokens afresh
        pass
    update = refill = prefill

    def _lookup(self, seq, K):
        for m in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            key = seq[-m:]
            for start in range(len(seq) - m - 1, -1, -1):  # latest occurrence first
                if seq[start:start + m] == key:
                    # copy what followed, cyclically, so a short loop fills all K drafts
                    follow = seq[start + m:]
                    return [follow[i % len(follow)] for i in range(K)]
        return []

    def propose(self, tokens, n, K, temperature=0.0, top_k=None, generator=None):
        rows = [self._lookup(tokens[b, :int(n[b])].tolist(), K) for b in range(tokens.shape[0])]
        width = max(map(len, rows))  # K, or 0 when no row matched: (B, 0), a plain step
        rows = [r or [NO_DRAFT] * width for r in rows]
        return torch.tensor(rows, dtype=torch.long, device=tokens.device), None  # q one-hot


class ModelDrafter:
    """A smaller model of the target's family drafts K tokens one at a time (module docstring)."""
    static_shapes = True  # generate(compile=True) compiles propose
    hidden_layers = ()

    def __init__(self, model, sample=True, confidence=0.0):
        self.model, self.sample, self.confidence = model, sample, confidence
        self.vocab_size = model.cfg.vocab_size  # generate refuses a target of another vocabulary

    def params(self):
        return self.model.n_params()

    @torch.no_grad()
    def prefill(self, tokens, n, feats):
        T, ctx = tokens.shape[1], self.model.cfg.max_seq_len
        if T > ctx:  # its positions run as far as the target's
            raise ValueError(f"this run needs {T} positions (prompt + new tokens + draft "
                             f"headroom), past the draft model's context of {ctx}")
        self.cache, = kept(self, (*tokens.shape, self.model.head.weight.dtype, tokens.device),
                           lambda: [self.model.new_cache(tokens.shape[0], max_len=T)])
        feed_ragged(self.model, self.cache, tokens, n - 1)  # the prompts but the pending token

    def update(self, *args):  # propose catches up on the committed tokens itself
        pass

    @torch.no_grad()
    def refill(self, b, tokens, n, feats):
        fed = int(n[b]) - 1  # all but the pending token, through row b's slice of the cache
        self.model(tokens[b:b + 1, :fed], self.cache.row(b))
        self.cache.lengths[b] = fed

    @torch.no_grad()
    def propose(self, tokens, n, K, temperature=0.0, top_k=None, generator=None):
        # catch up on the committed tokens: the last step's accepted ones and the pending one
        logits = feed_ragged(self.model, self.cache, tokens, n, bound=K + 1)
        step = lambda h, d: (h, self.model(d[:, None], self.cache)[0][:, -1])
        out = draft_chain(step, None, logits, K, temperature, top_k, generator, self.sample,
                          self.confidence)
        self.cache.rollback(n)  # tentative drafts leave the draft cache
        return out


def ragged_positions(start, last, bound=None):
    """Positions start[b]..last[b] of every row, padded by repeating last[b]: (B, m). The drafters
    with a cache of their own catch it up on ragged rows in one pass this way; the padding writes
    junk past a row's end, which the caller's rollback hides. Compiled (generate(compile=True)),
    m is bound, a static upper bound on every row's count, so the pass has one shape and no host
    read; eager, m is the longest row's count (a host read, and a smaller pass), checked against
    the bound, so that the eager tests hold every bound the compiled path relies on."""
    if torch.compiler.is_compiling():
        m = bound
    else:
        m = int((last - start).max()) + 1
        if bound is not None and m > bound:
            raise RuntimeError(f"a drafter's catch-up needs {m} positions, past its bound {bound}"
                               " (a generate's K must stay the same from step to step)")
    return torch.minimum(start[:, None] + torch.arange(m, device=start.device), last[:, None])


def feed_ragged(model, cache, tokens, n, bound=None):
    """Feed each row's not-yet-cached committed tokens tokens[b, cache.lengths[b]:n[b]] in one
    padded pass (at most bound a row: ragged_positions); return the logits (B, V) at each row's
    last real token (junk for a row with nothing to feed)."""
    start = cache.lengths.clone()
    idx = ragged_positions(start, n - 1, bound)                             # (B, m)
    logits, _ = model(tokens.gather(1, idx), cache)
    cache.rollback(n)
    # a finished row (n == start) feeds nothing real: clamp its index to the (junk) first slot
    last = (n - 1 - start).clamp(min=0)[:, None, None]
    return logits.gather(1, last.expand(-1, 1, logits.shape[-1]))[:, 0]


def run_layer(layer, target, cache, *inputs):
    """Run a drafter's layer (an MTP module, EAGLE's) on inputs (B, T, C) at the positions after
    each row's cache length, appending them to cache -> output (B, T, C), positions (B, T)."""
    pos = cache.positions(inputs[0].shape[1])
    out = layer(*inputs, *target.rope(pos), cache, pos)
    cache.advance(pos.shape[1])
    return out, pos


def draft_token(logits, temperature=0.0, top_k=None, generator=None, sample=True):
    """One draft per row from (B, V) logits (or (B, K, V): one per slot): drawn from the warped
    q, returned too for the ratio test, when sampling; else the argmax (q one-hot: None)."""
    if temperature > 0 and sample:
        q = logits_to_probs(logits, temperature, top_k)                 # (B, [K,] V)
        return draw(q, generator), q
    return logits.argmax(-1), None


def confidence(logits, d):
    """--confidence's measure: the drafter's probability of its drafts d (B, [K]) at T = 1 under
    its logits (B, [K,] V), whatever the run's temperature and top-k (argmax: the top one)."""
    return logits.float().softmax(-1).gather(-1, d[..., None])[..., 0]


def cut_unsure(drafts, q, conf, C):
    """drafts (B, K) and q (B, K, V) or None cut after each row's first slot whose conf (B, K) is
    below C: later slots NO_DRAFT, columns past the longest row dropped. conf: each draft's
    confidence (draft, mtp, eagle), or their running product along the block (dflash).
    NOTE: LOSSLESS ONLY SO: whether slot i is drafted may depend on the drafts before it, never
    on its own; dropping a draft for its own low q(d) leaves kept drafts drawn from q restricted
    to sure tokens, not from q, and biases the ratio test (tests/test_adaptive.py catches it)."""
    keep = F.pad((conf < C).long().cumsum(1)[:, :-1], (1, 0)) == 0  # none unsure before it
    drafts = torch.where(keep, drafts, NO_DRAFT)
    if torch.compiler.is_compiling():  # one shape, no host read: the empty slots stay
        return drafts, q
    width = int(keep.sum(1).max())                                  # a host sync
    return drafts[:, :width], (None if q is None else q[:, :width])


def draft_chain(step, h, logits, K, temperature, top_k, generator, sample, C):
    """Up to K drafts one at a time (draft, mtp, eagle): logits (B, V) give the first, step(h, d)
    -> (h, logits) the next in one pass (h: eagle's feature, mtp's depth). C > 0: once every row
    drafted one it is unsure of, no more passes (cut_unsure). -> drafts (B, K'), q or None."""
    drafts, qs, conf = [], [], []
    for i in range(K):  # generator: or uniforms (B, K, 1), slot i's [:, i] (speculate.py)
        g = generator[:, i] if torch.is_tensor(generator) else generator
        d, q = draft_token(logits, temperature, top_k, g, sample)
        drafts.append(d)
        qs += [q] if q is not None else []
        if C > 0:  # decided after slot i is drafted: only later slots may go
            conf.append(confidence(logits, d))
            # every row stopped: no more passes (a host read, so eager only; compiled, all K run)
            if not torch.compiler.is_compiling() and bool((torch.stack(conf, 1) < C).any(1).all()):
                break
        if i < K - 1:
            h, logits = step(h, d)
    drafts, q = torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)
    return cut_unsure(drafts, q, torch.stack(conf, 1), C) if conf else (drafts, q)
