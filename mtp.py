"""
Multi-token prediction (MTP) modules, DeepSeek-V3 style (arXiv 2412.19437, sec. 2.2).

D sequential modules sit on top of the target. Module k at position t fuses the previous depth's
hidden state (depth 0: the target's last block) with the embedding of the next known token,
runs one block of the target's kind and predicts x_{t+k+1} with the target's embedding and head:

    h^k_t = Block(W [norm(h^{k-1}_t); norm(embed(x_{t+k}))]),   logits = head(norm(h^k_t))

Two ways to get them: native, trained with the target (`python train.py --mtp-depth 3`,
loss weight lambda / D), or post-hoc on a frozen target (`python train_drafter.py --method mtp`).

As a drafter, module k's output at the last fed position t = N-2 predicts token N-1+k: D modules
draft D tokens. Each module keeps a KV cache of its own, whose entry at p is exact only once its
input x_{p+k} is committed (p <= N-1-k): propose() runs the chain, catching each module up on
the positions that became exact; each module's pass rolls its tentative entries back at once.
`--mtp-draft M`: draft at most M tokens; `--confidence C`: a row stops after a draft it is less
sure of than C, as the other chain drafters do (draft_simple.draft_chain).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from draft_simple import draft_chain, ragged_positions, run_layer
from kv_cache import KVCache, kept
from model import Block, RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.e_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)
        self.block = Block(cfg)
        self.out_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)

    def forward(self, h, e, cos, sin, cache=None, pos=None):
        """h, e (B, T, C): previous-depth hidden states and next-token embeddings."""
        x = self.proj(torch.cat([self.h_norm(h), self.e_norm(e)], -1))  # (B, T, C)
        return self.block(x, cos, sin, cache, 0, pos)


class MTP(nn.Module):
    def __init__(self, cfg, depth):
        super().__init__()
        self.depth, self.hidden_layers = depth, (cfg.n_layer,)  # h^0: the target's last block
        self.mods = nn.ModuleList([MTPModule(cfg) for _ in range(depth)])
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def losses(self, target, tokens, h0, label_from=0):
        """Per-depth cross-entropies and top-1 hits. tokens (B, T+1): the whole window; h0
        (B, T, C): the target's last hidden states on tokens[:, :T]. Module k at t sees x_{t+k}
        and predicts x_{t+k+1}. Tokens before label_from are context only, never labels."""
        B, T, _ = h0.shape
        # module k scores labels max(k+1, label_from)..T: none (a NaN loss) past these bounds
        if T <= self.depth or label_from > T:
            raise ValueError(f"a window of {T + 1} tokens leaves no label for depth {self.depth} "
                             f"from position {label_from}")
        h, losses, hits, counts = h0, [], [], []
        for k, mod in enumerate(self.mods, 1):
            Tk = T - k
            pos = torch.arange(Tk, device=tokens.device).expand(B, Tk)
            cos, sin = target.rope(pos)
            # all t (module k+1 reads them), then only from the first t with a label to score
            h = mod(h[:, :Tk], target.embed(tokens[:, k:k + Tk]), cos, sin)
            t0 = max(label_from - k - 1, 0)
            logits = target.head(mod.out_norm(h[:, t0:]))                  # (B, Tk - t0, V)
            labels = tokens[:, k + 1 + t0:k + 1 + Tk]
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
            hits.append((logits.argmax(-1) == labels).sum())
            counts.append(labels.numel())
        return losses, torch.stack(hits).cpu(), torch.tensor(counts)

    def loss(self, target, tokens, feats, label_from=0):
        """train_drafter.py's: tokens (B, T), feats (B, T, C) -> mean loss, agreement per depth."""
        losses, hits, counts = self.losses(target, tokens, feats[:, :-1], label_from)
        return sum(losses) / len(losses), {"agree": hits, "count": counts}

    def config_dict(self):
        return {"depth": self.depth}


class MTPDrafter:
    """Chains the MTP modules as a drafter for speculate.generate (see the module docstring)."""
    static_shapes = True  # generate(compile=True) compiles propose

    def __init__(self, target, mtp, n_draft=None, sample=True, confidence=0.0):
        self.target, self.mtp, self.sample, self.confidence = target, mtp, sample, confidence
        n_draft = mtp.depth if n_draft is None else n_draft
        if not 1 <= n_draft <= mtp.depth:
            raise ValueError(f"mtp has {mtp.depth} modules, so it drafts 1..{mtp.depth} tokens, "
                             f"not {n_draft}")
        self.hidden_layers = mtp.hidden_layers
        self.default_K = self.max_K = n_draft       # one draft per module, no more

    def params(self):
        return sum(p.numel() for p in self.mtp.parameters())

    @torch.no_grad()
    def prefill(self, tokens, n, feats):
        B, T_max = tokens.shape
        cfg, dev, dt = self.target.cfg, tokens.device, self.target.head.weight.dtype
        # H[k] (B, T_max, C): module k's output per position (H[0] = target features)
        self.H, *self.caches = kept(self, (B, T_max, dt, dev), lambda: [
            torch.zeros(self.mtp.depth + 1, B, T_max, cfg.n_embd, device=dev, dtype=dt),
            *(KVCache(1, B, cfg.n_kv_head, T_max, cfg.head_dim, dev, dt) for _ in self.mtp.mods)])
        self.H[0, :, :feats.shape[1]] = feats
        # the prompts (a step's catch-up is short): module k reads to x_{N-2+k}, padded, rolled back
        ext = F.pad(tokens, (0, self.mtp.depth))
        for k in range(1, self.mtp.depth + 1):
            self.run_module(k, ext, n)

    def update(self, tokens, n, feats, n_new):
        # the verify pass fed positions n - n_new - 1 onward: store its features there
        pos = (n - n_new - 1)[:, None] + torch.arange(feats.shape[1], device=n.device)  # (B, T)
        self.H[0].scatter_(1, pos.clamp(max=tokens.shape[1] - 1)[..., None].expand_as(feats), feats)

    @torch.no_grad()
    def refill(self, b, tokens, n, feats):
        N = int(n[b])
        self.H[0, b, :N - 1] = feats[0]
        for k, (mod, cache) in enumerate(zip(self.mtp.mods, self.caches), 1):
            m = max(N - k, 0)  # module k's exact positions 0..N-1-k: inputs x_{p+k} committed
            if m:
                e = self.target.embed(tokens[b:b + 1, k:k + m])
                out, _ = run_layer(mod, self.target, cache.row(b), self.H[k - 1, b:b + 1, :m], e)
                self.H[k, b, :m] = out[0]
            cache.lengths[b] = m

    def run_module(self, k, ext, n, bound=None):
        """Catch module k up to the last fed position P = n-2 (ext: committed tokens, then the
        drafts so far; at most bound a row) -> its logits (B, V) at P, predicting x_{n-1+k}."""
        target, mod, cache, P = self.target, self.mtp.mods[k - 1], self.caches[k - 1], n - 2
        cache.rollback(torch.minimum(cache.lengths, P))  # (re)run P: a finished row's is past P
        p_idx = ragged_positions(cache.lengths, P, bound)   # (B, m)
        h = self.H[k - 1].gather(1, p_idx[..., None].expand(-1, -1, self.H.shape[-1]))
        out, pos = run_layer(mod, target, cache, h, target.embed(ext.gather(1, p_idx + k)))
        # NOTE: write at pos (distinct slots: the padding's junk lands past P), not at p_idx,
        # which repeats P in the padding, where scatter_ would keep an arbitrary one
        self.H[k].scatter_(1, pos[..., None].expand_as(out), out)  # out, pos: (B, m, C), (B, m)
        cache.rollback(torch.minimum(n - k, P + 1).clamp(min=0))  # exact up to N-1-k
        return target.head(mod.out_norm(self.H[k, torch.arange(len(n), device=n.device), P]))

    @torch.no_grad()
    def propose(self, tokens, n, K, temperature=0.0, top_k=None, generator=None):
        ext, rows = tokens.clone(), torch.arange(len(n), device=n.device)

        # module k catches up on <= max_K + k (last step's commits + k - 1; every module ran,
        # unless --confidence stopped an eager step early: no bound then)
        exact = torch.compiler.is_compiling() or not self.confidence
        run = lambda k: self.run_module(k, ext, n, self.max_K + k if exact else None)

        def step(k, d):  # module k's draft d is module k+1's input x_{n-1+k}
            ext[rows, n - 1 + k] = d  # a row that stopped (--confidence) runs on, unused
            return k + 1, run(k + 1)
        return draft_chain(step, 1, run(1), min(K, self.max_K), temperature,
                           top_k, generator, self.sample, self.confidence)
