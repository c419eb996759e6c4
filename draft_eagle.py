"""
EAGLE-3-style autoregressive feature drafter (Li et al. 2025, arXiv 2503.01840): the baseline
DFlash is compared with (DESIGN.md sec. 6), drafting a chain of K tokens (no tree).

Positions. Drafter position p fuses the target's hidden states at p from a low, a middle and a
high layer (concat 3C -> C: f_p, which "knows" x_0..x_p) with embed(x_{p+1}), runs one decoder
layer of the target's kind and predicts x_{p+2} with the target's frozen head (own final norm):

    h_p = Layer([norm(embed(x_{p+1})); norm(f_p)])        (2C input, residual stream = f_p)
    logits_p = head(norm(h_p))                             predicts x_{p+2}

Drafting (N committed tokens): catch the drafter's KV cache up on every p <= N-2 with true
features; the output at p = N-2 drafts d_1 = x_N. Each further step feeds back the drafter's own
output h_p in place of the target's f_{p+1} (not there yet) with embed(last draft); these
tentative entries are rolled back, so the cache only ever holds exact positions 0..N-2.

Training ("training-time test"): unroll 7 steps on its own predicted features, step j weighted
0.8^j, so it learns to read the features it gets at inference. Each step feeds the data token,
not its own guess: a chain only matters while its drafts equal the target's tokens anyway.

    python train_drafter.py --method eagle                      # into out/cpu/weights/
    python bench.py --target weights/cpu/target.pt --weights out/cpu/weights --methods eagle
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from draft_simple import draft_chain, ragged_positions, run_layer
from kv_cache import KVCache, kept
from model import MLP, Attention, RMSNorm


def default_layers(L):
    """Low, middle, high taps (1, L//2, L-1): EAGLE-3's (2, L/2, L-3) of a 32-layer Llama, scaled
    down. The top block is left out, as there: it specialises in predicting x_{p+1}, which the
    drafter gets as its token input. Under 4 blocks: the top three taps (two when L = 1)."""
    return (1, L // 2, L - 1) if L >= 4 else tuple(range(max(L - 2, 0), L + 1))


def ttt_attention(attn, x, cos, sin, kvs):
    """Attention of unroll step j = len(kvs) over (B, T) positions, with the keys an inference
    chain sees: the query at p, in the chain anchored at a = p - j, sees step-0 keys at <= a (true
    context) and, for i = 1..j, the step-i key at a + i (its chain's drafts; i = j is itself).
    kvs holds the (k, v) of steps 0..j-1 and gets this step's appended. x (B, T, 2C) -> (B, T, C).
    Dense over all (j+1) T keys: wasteful, but plain, and fine at our sizes."""
    B, T, _ = x.shape
    q = attn.project_q(x, cos, sin)                                   # (B, H, T, D)
    kvs.append(attn.project_kv(x, cos, sin))                          # (B, H_kv, T, D) each
    j, dev = len(kvs) - 1, x.device
    k, v = (torch.cat(t, 2) for t in zip(*kvs))               # (B, H_kv, (j+1) T, D): step 0, 1, ..
    step = torch.arange(j + 1, device=dev).repeat_interleave(T)       # ((j+1) T,) step of each key
    kpos = torch.arange(T, device=dev).repeat(j + 1)          # ((j+1) T,) position of each key
    a = torch.arange(T, device=dev)[:, None] - j                      # (T, 1) anchor of each query
    mask = torch.where(step == 0, kpos <= a, kpos == a + step)        # (T, (j+1) T)
    # NOTE: the query's own key (step j at p) is always visible, so no row is fully masked;
    # queries at p < j have no true context and are never scored.
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, H, T, D)
    return attn.wo(y.transpose(1, 2).reshape(B, T, -1))               # (B, T, C)


class EagleLayer(nn.Module):
    """One decoder layer of the target's kind whose attention reads 2C: [norm(e); norm(h)]. As in
    EAGLE-3's code, q/k/v take 2C and the residual stream is the feature h itself, so feeding
    back its own output keeps it on the same stream (and saves a Linear(2C -> C))."""

    def __init__(self, cfg):
        super().__init__()
        C = cfg.n_embd
        self.e_norm, self.h_norm = RMSNorm(C, cfg.norm_eps), RMSNorm(C, cfg.norm_eps)
        self.attn = Attention(cfg)
        for name in ("wq", "wk", "wv"):  # the custom first projection: 2C in instead of C
            old = getattr(self.attn, name)
            setattr(self.attn, name, nn.Linear(2 * C, old.out_features, bias=False))
        self.mlp_norm = RMSNorm(C, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, e, h, cos, sin, cache=None, pos=None, ttt_kvs=None):
        """e, h (B, T, C): token embeddings and features -> output features (B, T, C)."""
        x = torch.cat([self.e_norm(e), self.h_norm(h)], -1)           # (B, T, 2C)
        h = h + (self.attn(x, cos, sin, cache, 0, pos) if ttt_kvs is None
                 else ttt_attention(self.attn, x, cos, sin, ttt_kvs))
        return h + self.mlp(self.mlp_norm(h))


class Eagle(nn.Module):
    """The drafter's own weights only: the target (embedding, head) is passed in, never held."""

    def __init__(self, cfg, hidden_layers=None, ttt_steps=7):
        super().__init__()
        self.cfg, self.ttt_steps = cfg, ttt_steps
        hl = self.hidden_layers = tuple(hidden_layers or default_layers(cfg.n_layer))
        # NOTE: model.forward returns each tapped layer once, in depth order: insist on that
        if list(hl) != sorted(set(hl)) or hl[0] < 0 or hl[-1] > cfg.n_layer:
            raise ValueError(f"hidden_layers {hl}: need increasing indices in 0..{cfg.n_layer}")
        self.fc = nn.Linear(len(hl) * cfg.n_embd, cfg.n_embd, bias=False)  # fuse 3C -> C
        self.layer = EagleLayer(cfg)
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def config_dict(self):
        return {"hidden_layers": list(self.hidden_layers), "ttt_steps": self.ttt_steps}

    def logits(self, target, h):
        return target.head(self.norm(h))                              # (B, T, V)

    def unroll(self, target, tokens, feats):
        """Training-time test. tokens (B, T), feats (B, T, 3C) of the target on tokens ->
        ttt_steps output features (B, T-2, C): entry [j][:, p] is step j of the chain anchored
        at a = p - j, which predicts x_{p+2} (valid for p >= j)."""
        B, T = tokens.shape
        pos = torch.arange(T - 2, device=tokens.device).expand(B, T - 2)  # (B, T-2)
        cos, sin = target.rope(pos)
        e = target.embed(tokens[:, 1:-1])                       # (B, T-2, C): x_{p+1}, the data
        h = self.fc(feats[:, :-2])                                    # (B, T-2, C): f_p
        kvs, outs = [], []
        for _ in range(self.ttt_steps):
            out = self.layer(e, h, cos, sin, ttt_kvs=kvs)            # (B, T-2, C)
            outs.append(out)
            # the next step at p reads this step's output at p - 1 (position 0 has none: zeros)
            h = F.pad(out[:, :-1], (0, 0, 1, 0))                     # (B, T-2, C)
        return outs

    def loss(self, target, tokens, feats, label_from=0):
        """tokens (B, T), feats (B, T, 3C) -> weighted CE over the unroll, agreement per step.
        Tokens before label_from (the corpus prompt) are read as context but never scored."""
        if tokens.shape[1] < max(self.ttt_steps, label_from) + 2:
            raise ValueError(f"sequences of {tokens.shape[1]} tokens are too short for "
                             f"{self.ttt_steps} unroll steps and labels from position {label_from}")
        total, wsum, agree, count = 0.0, 0.0, [], []
        for j, h in enumerate(self.unroll(target, tokens, feats)):
            p0 = max(j, label_from - 2)                               # step j is valid for p >= j
            logits = self.logits(target, h[:, p0:])                   # (B, T-2-p0, V)
            lab = tokens[:, 2 + p0:]                                  # (B, T-2-p0): x_{p+2}
            total = total + 0.8 ** j * F.cross_entropy(logits.flatten(0, 1).float(), lab.flatten())
            wsum += 0.8 ** j
            agree.append((logits.argmax(-1) == lab).sum())
            count.append(lab.numel())
        return total / wsum, {"agree": torch.stack(agree).cpu(), "count": torch.tensor(count)}


class EagleDrafter:
    """The drafter interface of speculate.py (see the module docstring for the positions)."""
    static_shapes = True  # generate(compile=True) compiles propose
    default_K = 7

    def __init__(self, target, eagle, sample=True, confidence=0.0):
        self.target, self.eagle, self.sample, self.confidence = target, eagle, sample, confidence
        self.hidden_layers = eagle.hidden_layers

    def params(self):
        return sum(p.numel() for p in self.eagle.parameters())

    @torch.no_grad()
    def prefill(self, tokens, n, feats):
        B, T_max = tokens.shape
        cfg, dt = self.target.cfg, self.target.head.weight.dtype
        self.feat, self.cache = kept(self, (B, T_max, dt, tokens.device), lambda: [
            torch.zeros(B, T_max, cfg.n_embd, device=tokens.device, dtype=dt),
            KVCache(1, B, cfg.n_kv_head, T_max, cfg.head_dim, tokens.device, dt)])
        self.feat[:, :feats.shape[1]] = self.eagle.fc(feats)  # (B, T_max, C): f_p per position
        self.catch_up(tokens, n)  # the prompts, so that a step's catch-up is at most K + 1 wide

    @torch.no_grad()
    def update(self, tokens, n, feats, n_new):
        # as MTPDrafter.update; rejected positions are overwritten later
        f = self.eagle.fc(feats)                                      # (B, T, C)
        pos = (n - n_new - 1)[:, None] + torch.arange(f.shape[1], device=n.device)  # (B, T)
        self.feat.scatter_(1, pos.clamp(max=tokens.shape[1] - 1)[..., None].expand_as(f), f)

    @torch.no_grad()
    def refill(self, b, tokens, n, feats):
        fed = int(n[b]) - 1                                     # positions 0..fed-1 have features
        self.feat[b, :fed] = self.eagle.fc(feats[0])
        if fed > 1:                                             # 0..fed-2 now; catch_up does fed-1
            e, h = self.target.embed(tokens[b:b + 1, 1:fed]), self.feat[b:b + 1, :fed - 1]
            run_layer(self.eagle.layer, self.target, self.cache.row(b), e, h)
        self.cache.lengths[b] = fed - 1

    @torch.no_grad()
    def catch_up(self, tokens, n, bound=None):
        """Feed positions up to P = n-2 with true features in one padded pass (at most bound
        a row: ragged_positions) -> output feature (B, C) and logits (B, V) at P, which draft
        d_1 = x_n. The cache ends at P + 1."""
        P, cache, C = n - 2, self.cache, self.feat.shape[2]
        cache.rollback(torch.minimum(cache.lengths, P))        # rerun P: a finished row's is past P
        start = cache.lengths.clone()
        p_idx = ragged_positions(start, P, bound)                     # (B, m), padded with P
        h = self.feat.gather(1, p_idx[..., None].expand(-1, -1, C))   # (B, m, C): f_p
        e = self.target.embed(tokens.gather(1, p_idx + 1))      # (B, m, C): x_{p+1}, committed
        out, _ = run_layer(self.eagle.layer, self.target, cache, e, h)  # junk past P ...
        cache.rollback(P + 1)                                         # ... which this drops
        h = out[torch.arange(len(n), device=n.device), P - start]     # (B, C)
        return h, self.eagle.logits(self.target, h)

    @torch.no_grad()
    def step(self, h, d):
        """One chain step: own feature h (B, C), previous draft d (B,) -> next h, logits (B, V)."""
        e = self.target.embed(d)[:, None]                             # (B, 1, C)
        h = run_layer(self.eagle.layer, self.target, self.cache, e, h[:, None])[0][:, 0]  # (B, C)
        return h, self.eagle.logits(self.target, h)

    @torch.no_grad()
    def propose(self, tokens, n, K, temperature=0.0, top_k=None, generator=None):
        # NOTE: drafting writes up to K positions past n: a row too close to the buffers' end (a
        # finished one, drafts unused) drafts from an earlier point; speculate.generate leaves room
        n = n.clamp(max=tokens.shape[1] - K - 1)
        h, logits = self.catch_up(tokens, n, bound=K + 1)  # the last step's commits: <= K + 1
        out = draft_chain(self.step, h, logits, K, temperature, top_k, generator, self.sample,
                          self.confidence)
        self.cache.rollback(n - 1)                              # keep only exact positions 0..n-2
        return out                                      # (B, K' <= K), q (B, K', V) or None
