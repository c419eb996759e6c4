"""
DFlash: a block-diffusion drafter with target-feature KV injection
(Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036).

An autoregressive drafter pays one forward pass per draft token. DFlash fills a whole block
in ONE pass: the block is [x_s, <|mask|> x (S-1)] at positions s..s+S-1 (s = N-1), it attends to
itself bidirectionally (no mask), and the output at slot k is the draft for position s+k
(same position, not shifted), so one pass yields S-1 drafts and one verify covers S tokens
(S is the block size, the paper's B = 16; B is the batch here, as everywhere in this repo).

What makes a few small layers good enough is the conditioning. The target's hidden states
at n layers spread over its depth are concatenated and projected (Linear n*C -> C, RMSNorm)
into a context feature c_t per position t the target has fed, and in EVERY drafter layer they are
injected as keys and values through that layer's own projections:

    q = W_q x_block      k = [k_norm(W_k c_{0..s-1}) ; k_norm(W_k x_block)]      (RoPE at
                         v = [       W_v c_{0..s-1}  ;        W_v x_block ]       absolute pos)

(x_block is the layer's attn_norm of the block's stream and q is q_normed, as in the target's
layers; c was RMS-normed once, by ctx_norm, and enters every layer as it is.)

The context gets no queries, MLP or residual: it only supplies keys and values, so its
per-layer K/V can be cached and extended by the newly fed positions (the old pending token and
the accepted drafts) after every verify (the KV-injection op, kv_inject below: one launch for
all layers with the CUDA extension). The drafter has no embedding or head of its own: it uses
the target's, frozen (the <|mask|> row stays untrained).

Training (paper sec. 4; the authors never released theirs, this is ours): on the target's own
continuations, many anchors a per sequence, each block [x_a, mask...] seeing the context strictly
before a (c_0..c_{a-1}) and its own block, never other blocks, all in one pass (train_logits).
Loss = cross-entropy at slots 1..S-1 against x_{a+k}, weighted by exp(-(k-1)/gamma) (early slots
matter most: a rejection ends the block).
Three traps that gave near-zero acceptance elsewhere, each pinned by a test here: labels
shifted by one, context visible at <= a instead of < a, a causal mask inside the block.

    python train_drafter.py --method dflash            # trains one for the committed target
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import dflash_kernels as kernels
from draft_simple import confidence, cut_unsure, draft_token
from kv_cache import kept
from model import Block, RMSNorm, apply_rope

# the paper's loss decay per block size S; train_drafter's recipe passes 4 (at S = 16 it beat 7)
GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def feature_layers(n_layer, n_features):
    """n target layers spread evenly over depth, from the first block to the one below the last
    (z-lab and SGLang never read the last: transformers gives it after the final norm, SGLang not
    at all; leaving it out cost nothing here: docs/experiments.md, "The last block's features").
    weights/cpu/dflash.pt predates the rule: it names its own, (1, 2, 4, 5, 6)."""
    top = max(n_layer - 1, 1)
    n_features = min(n_features, top)
    if n_features == 1:
        return (top,)
    step = (top - 1) / (n_features - 1)
    return tuple(sorted({round(1 + i * step) for i in range(n_features)}))


class DFlash(nn.Module):

    def __init__(self, cfg, n_layer=2, n_features=5, block_size=16, anchors=8, gamma=None,
                 mask_id=None, hidden_layers=None, layer_cfg=None):
        """cfg is the target's; the drafter's own layers are of the target's shape unless
        layer_cfg says otherwise (a z-lab drafter's may have another MLP width, interop.py)."""
        super().__init__()
        self.cfg, self.block_size, self.n_anchors = cfg, block_size, anchors  # anchors per sequence
        self.gamma = gamma or GAMMA.get(block_size, 7.0)  # loss decay along the block
        self.n_layer = n_layer  # the drafter's own layers (cfg.n_layer: the target's)
        self.hidden_layers = tuple(hidden_layers or feature_layers(cfg.n_layer, n_features))
        self.n_features = len(self.hidden_layers)
        self.mask_id = cfg.vocab_size - 1 if mask_id is None else mask_id  # <|mask|>: the last id
        self.layer_cfg = lc = layer_cfg or cfg
        self.fc = nn.Linear(len(self.hidden_layers) * cfg.n_embd, cfg.n_embd, bias=False)
        self.ctx_norm = RMSNorm(cfg.n_embd, lc.norm_eps)
        self.layers = nn.ModuleList([Block(lc) for _ in range(n_layer)])
        self.norm = RMSNorm(cfg.n_embd, lc.norm_eps)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith(("wo.weight", "w_down.weight"))  # residual outputs (GPT-2)
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer) if scaled else 0.02)

    def config_dict(self):
        return dict(n_layer=self.n_layer, n_features=self.n_features, block_size=self.block_size,
                    anchors=self.n_anchors, gamma=self.gamma, mask_id=self.mask_id,
                    hidden_layers=list(self.hidden_layers))

    def context(self, feats):
        """Target features (B, T, n*C) -> context features c (B, T, C)."""
        return self.ctx_norm(self.fc(feats))

    def context_kv(self, c):
        """Per-layer context keys/values, k normed but NOT rotated: (L, B, T, H, D) each.
        This is what kv_inject writes (rotating k at the absolute positions)."""
        B, T, _ = c.shape
        attns = [layer.attn for layer in self.layers]
        k = [a.k_norm(a.wk(c).view(B, T, a.n_kv_head, a.head_dim)) for a in attns]
        v = [a.wv(c).view(B, T, a.n_kv_head, a.head_dim) for a in attns]
        return torch.stack(k), torch.stack(v)

    def blocks_forward(self, target, x, pos, ctx_k, ctx_v, mask):
        """The drafter proper (Block.forward rebuilt: context K/V first, then the block's own).
        x (B, S, C) block embeddings at positions pos (B, S); ctx_k/v (L, B, H, T_ctx, D) rotated
        context keys/values per layer (or a sequence of L such); mask (B, 1, 1, T_ctx + S), the
        same for every query of a block (inference hides each row's unused context slots, training
        the context at and after each anchor). In training, B is batch x anchors.
        Returns logits (B, S, V) through the target's frozen head."""
        cos, sin = target.rope(pos)
        for i, layer in enumerate(self.layers):
            attn, h = layer.attn, layer.attn_norm(x)
            q = attn.project_q(h, cos, sin)                 # (B, H, S, D)
            k, v = attn.project_kv(h, cos, sin)             # (B, H_kv, S, D)
            k = torch.cat([ctx_k[i], k], 2)                 # injected context first
            v = torch.cat([ctx_v[i], v], 2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = x + attn.wo(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
            x = x + layer.mlp(layer.mlp_norm(x))
        return target.head(self.norm(x))

    # -- training ---------------------------------------------------------------

    def train_logits(self, target, tokens, feats, anchors):
        """All blocks of all anchors in one pass, each its own row of a (B*A)-row batch as at
        inference, keys = its context (j < a) then its S slots: A*S*(T+S) scores in all, not a dense
        mask's A*S*(T+A*S). tokens (B, T), feats (B, T, n*C), anchors (B, A) -> logits (B, A, S,
        V), positions (B, A, S)."""
        B, T = tokens.shape
        S, dev = self.block_size, tokens.device
        A = anchors.shape[1]
        pos = anchors[:, :, None] + torch.arange(S, device=dev)             # (B, A, S)
        blk = torch.full((B, A, S), self.mask_id, device=dev)
        blk[:, :, 0] = tokens.gather(1, anchors)  # block inputs: x_a at slot 0, <|mask|> elsewhere
        x = target.embed(blk).flatten(0, 1)                                  # (B*A, S, C)
        # context K/V of all T positions, rotated at their own, shared by a sequence's A blocks
        ck, cv = self.context_kv(self.context(feats))                       # (L, B, T, H, D)
        ccos, csin = target.rope(torch.arange(T, device=dev).expand(B, T))
        ck = apply_rope(ck.transpose(2, 3), ccos, csin)                     # (L, B, H, T, D)
        cv = cv.transpose(2, 3)
        L, _, H, _, D = ck.shape
        # unbind (not ck[i] later): indexing a stack backpropagates through L zero-filled copies
        ck = ck[:, :, None].expand(L, B, A, H, T, D).reshape(L, B * A, H, T, D).unbind(0)
        cv = cv[:, :, None].expand(L, B, A, H, T, D).reshape(L, B * A, H, T, D).unbind(0)
        # a block anchored at a sees context j < a (strictly!) and all of its own block: at
        # inference x_a is the pending token, not yet fed to the target, so c_a does not exist
        see_ctx = torch.arange(T, device=dev) < anchors.reshape(B * A, 1)  # (B*A, T)
        mask = torch.cat([see_ctx, see_ctx.new_ones(B * A, S)], 1)[:, None, None]  # (BA,1,1,T+S)
        # NOTE: slots past the end of a sequence (no label) still take part, as at inference;
        # clamp only their RoPE lookup so a window at the context edge cannot index past the table
        rpos = pos.flatten(0, 1).clamp(max=self.cfg.max_seq_len - 1)
        return self.blocks_forward(target, x, rpos, ck, cv, mask).view(B, A, S, -1), pos

    def loss(self, target, tokens, feats, anchors=None, label_from=0):
        """Weighted block loss and per-slot top-1 agreement counts. Anchors are sampled afresh
        on every call (self.n_anchors of them per sequence, so each epoch sees new ones) unless
        given as positions (B, A). Tokens before label_from (the corpus prompt) are context
        only: anchors start at label_from - 1, the prompt's last token, so that every continuation
        token, x_{label_from} included, is some block's label (at inference the first block is
        anchored one later, at the first generated token, which generate's prompt pass picks)."""
        B, T = tokens.shape
        S, dev = self.block_size, tokens.device
        lo = max(1, label_from - 1)  # a in [lo, T-2]: at least one context position and one label
        if lo > T - 2:
            raise ValueError(f"sequences of {T} tokens leave no anchor with labels from position "
                             f"{label_from}")
        if anchors is None:
            anchors = torch.stack([torch.randperm(T - 1 - lo, device=dev)[:self.n_anchors] + lo
                                   for _ in range(B)])
        A = anchors.shape[1]                                                # (B, A)
        logits, pos = self.train_logits(target, tokens, feats, anchors)
        # slot k predicts the token AT position a+k (same position, no shift); slot 0 is dropped
        lab_pos = pos[:, :, 1:]                                             # (B, A, S-1)
        valid = lab_pos < T
        labels = tokens.gather(1, lab_pos.clamp(max=T - 1).flatten(1)).view(B, A, S - 1)
        logits = logits[:, :, 1:]
        w = torch.exp(-torch.arange(S - 1, device=dev) / self.gamma) * valid  # exp(-(k-1)/gamma)
        ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none")
        loss = (ce * w.flatten()).sum() / w.sum()
        hit = (logits.argmax(-1) == labels) & valid
        return loss, {"agree": hit.sum((0, 1)).cpu(), "count": valid.sum((0, 1)).cpu()}


# --- inference ------------------------------------------------------------------------------------

def kv_inject_ref(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """Write each row's new context K/V into the cache at its own offset, RoPE on K at the
    absolute positions, for all layers at once, in place (dflash_kernels/kv_inject.cu fuses it).
    cache_k, cache_v (L, B, H, T_max, D); new_k, new_v (L, B, T_new, H, D), k not yet rotated;
    offsets, counts (B,) int64: row b writes its first counts[b] tokens from slot offsets[b];
    cos, sin (P, D/2) float32. RoPE in float32, rounded once to the cache dtype, as the kernel."""
    T_new, room = new_k.shape[2], min(cache_k.shape[3], cos.shape[0]) - counts
    if not bool(((counts >= 0) & (counts <= T_new) & (offsets >= 0) & (offsets <= room)).all()):
        raise ValueError("kv_inject_ref: offsets + counts must lie within T_max and the RoPE "
                         f"tables, counts within [0, {T_new}]")  # one sync, on a GPU
    t = torch.arange(T_new, device=offsets.device)
    valid = t[None, :] < counts[:, None]                              # (B, T_new) real tokens
    pos = (offsets[:, None] + t[None, :]).clamp(max=cos.shape[0] - 1)  # (B, T_new) absolute
    cs, sn = cos[pos][:, None], sin[pos][:, None]                     # (B, 1, T_new, D/2)
    k = apply_rope(new_k.transpose(2, 3), cs, sn)                     # (L, B, H, T_new, D)
    v = new_v.transpose(2, 3)                                         # (L, B, H, T_new, D)
    b_idx, t_idx = valid.nonzero(as_tuple=True)                       # the (b, t) to write
    p_idx = pos[b_idx, t_idx]
    cache_k[:, b_idx, :, p_idx] = k[:, b_idx, :, t_idx]               # (n, L, H, D) both sides
    cache_v[:, b_idx, :, p_idx] = v[:, b_idx, :, t_idx]


def kv_inject(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """kv_inject_ref, or its fused kernel where the extension takes the cache (GPU, KV_DTYPES)."""
    if kernels.available(cache_k.device) and cache_k.dtype in kernels.KV_DTYPES:
        kernels.kv_inject(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin)
    else:
        kv_inject_ref(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin)


class DFlashDrafter:
    """The drafter interface of speculate.py. Its state is the per-layer cache of context K/V
    for the target-fed positions 0..N-2 of every row (ragged lengths, like the target's).
    When sampling, each slot's draft is drawn from its own q (sample=False: argmax drafts)."""
    static_shapes = True  # generate(compile=True) compiles propose

    def __init__(self, target, dflash, block_size=None, sample=True, confidence=0.0):
        bs = dflash.block_size if block_size is None else block_size  # 0 is refused, not default
        if not 2 <= bs <= dflash.block_size:
            raise ValueError(f"block size {bs} is outside what the drafter was trained for "
                             f"(2..{dflash.block_size})")
        self.target, self.dflash, self.block_size, self.sample = target, dflash, bs, sample
        self.confidence = confidence  # --confidence: drafts only as far as the block is sure
        self.hidden_layers = dflash.hidden_layers
        self.default_K = self.max_K = bs - 1  # a block drafts its bs - 1 masked slots, no more

    def params(self):
        return sum(p.numel() for p in self.dflash.parameters())

    def prefill(self, tokens, n, feats):
        B, T_max = tokens.shape
        cfg, L = self.dflash.layer_cfg, self.dflash.n_layer  # its own heads (z-lab's may differ)
        shape = (L, B, cfg.n_kv_head, T_max, cfg.head_dim)  # (L, B, H, T_max, D)
        w = self.target.head.weight
        self.ck, self.cv = kept(self, (B, T_max, w.dtype, w.device),
                                lambda: [w.new_zeros(shape), w.new_zeros(shape)])
        self.ctx_len = torch.zeros(B, dtype=torch.long, device=w.device)
        self.update(tokens, n, feats, n - 1)  # the prompt pass fed positions 0..n-2

    @torch.no_grad()
    def update(self, tokens, n, feats, n_new):
        k, v = self.dflash.context_kv(self.dflash.context(feats))  # (L, B, T_new, H, D)
        kv_inject(self.ck, self.cv, k, v, self.ctx_len, n_new, self.target.rope_cos,
                  self.target.rope_sin)
        self.ctx_len = self.ctx_len + n_new

    @torch.no_grad()
    def refill(self, b, tokens, n, feats):
        """Row b's context cache restarts with the new prompt's features (1, fed, n*C): an update
        that writes row b only (every row is handed them, the others with a count of 0; the
        projection of B copies, once a prompt, keeps update, run every step, free of this case)."""
        counts = torch.zeros_like(self.ctx_len)
        counts[b], self.ctx_len[b] = feats.shape[1], 0
        self.update(tokens, n, feats.expand(len(n), -1, -1), counts)

    @torch.no_grad()
    def block_logits(self, tokens, n, S):
        """One drafter pass over the block [x_{N-1}, mask x (S-1)] -> logits (B, S, V)."""
        B, dev = tokens.shape[0], tokens.device
        blk = torch.full((B, S), self.dflash.mask_id, device=dev)
        blk[:, 0] = tokens.gather(1, n[:, None] - 1)[:, 0]    # slot 0: the pending token x_{N-1}
        pos = (n - 1)[:, None] + torch.arange(S, device=dev)  # (B, S) absolute positions
        # the block sees all of itself and its row's context: every slot of the context cache
        # is read (no host sync, one shape, as the target's cache) and the mask hides each row's
        # slots past its ctx_len (stale, or what an earlier prompt left after a refill)
        see = torch.arange(self.ck.shape[3], device=dev)[None] < self.ctx_len[:, None]  # (B, T)
        mask = torch.cat([see, see.new_ones(B, S)], 1)[:, None, None]   # (B, 1, 1, T_max + S)
        return self.dflash.blocks_forward(self.target, self.target.embed(blk), pos, self.ck,
                                          self.cv, mask)

    @torch.no_grad()
    def propose(self, tokens, n, K, temperature=0.0, top_k=None, generator=None):
        # K+1 slots, though training fills the whole block (16 here): running it all and keeping K
        # drafts accepts up to ~5 % more but costs more than that on a CPU (docs/experiments.md)
        S = min(K, self.max_K) + 1
        logits = self.block_logits(tokens, n, S)[:, 1:]    # slot 0 holds x_s, already known
        d, q = draft_token(logits, temperature, top_k, generator, self.sample)
        if self.confidence > 0:  # keep slot i while the confidences before it multiply to >= C
            d, q = cut_unsure(d, q, confidence(logits, d).cumprod(1), self.confidence)
        return d, q
