"""
The target: a small Qwen3-style decoder-only transformer (DESIGN.md sec. 3).

Token embedding; N blocks of pre-RMSNorm attention (RoPE, grouped-query heads, RMSNorm on
q and k per head) and SwiGLU MLP; final RMSNorm; untied LM head. `forward` can return the
hidden states of chosen layers (index 0 = embedding output, i = output of block i), which is
what every feature-based drafter (MTP, EAGLE, DFlash) conditions on.

The naive, cache-free `generate` (last of the model code) is the reference every fast path in this
repo is tested against: speculative decoding must reproduce it token for token (greedy).

    python sample.py --method ar --prompt "def parse(" --check   # decode, compare with generate
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kv_cache import KVCache


@dataclass
class Config:  # placeholder sizes: every model is built from a PRESETS entry below
    vocab_size: int = 4098     # tokenizer ranks + <|endoftext|> + <|mask|>
    n_layer: int = 6           # transformer blocks
    n_head: int = 6            # query heads
    n_kv_head: int = 2         # key/value heads (grouped-query attention)
    n_embd: int = 384          # residual width C
    mlp_hidden: int = 1024     # SwiGLU inner width
    max_seq_len: int = 512     # longest context (RoPE table, KV cache size)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # two fields real Qwen3 checkpoints need (interop.py): a head size other than C / n_head
    # (Qwen3-0.6B: 1024 / 16 heads, head_dim 128), and a head that shares the embedding's weights
    head_dim: int = 0          # 0: n_embd // n_head
    tie_embeddings: bool = False

    def __post_init__(self):
        self.head_dim = self.head_dim or self.n_embd // self.n_head


# Presets: `tiny` for tests (seconds), `cpu` for the CPU benchmark (its size is a trade-off:
# bigger targets are more memory-bound, which favours speculation, but train slower on 2
# cores), `gpu` (~100M params) trains in minutes on one H200. vocab_size is filled from the
# tokenizer at build time.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128, max_seq_len=256),
    "cpu": dict(n_layer=6, n_head=4, n_kv_head=2, n_embd=256, mlp_hidden=768, max_seq_len=384),
    "gpu": dict(n_layer=14, n_head=12, n_kv_head=4, n_embd=768, mlp_hidden=2048, max_seq_len=1024),
    # the small models of the `draft` method (speculate.py): same family, same context
    "cpu-draft": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384,
                      max_seq_len=384),
    "gpu-draft": dict(n_layer=4, n_head=8, n_kv_head=4, n_embd=256, mlp_hidden=768,
                      max_seq_len=1024),
}


def rms_norm(x, weight, eps):
    # weight in x's dtype: under bf16 autocast x is bf16 and the weight float32, and a mixed
    # pair falls back from the fused kernel (with a warning); a no-op in float32
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_table(cfg, device=None):
    """cos, sin of shape (max_seq_len, D/2) for rotary embeddings."""
    D = cfg.head_dim
    i = torch.arange(0, D, 2, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (cfg.rope_theta ** (i / D))
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # (T_max, D/2)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    """Rotate x (B, H, T, D) by angles given per position: cos, sin (B, 1, T, D/2).
    Rotate-half convention (as in Qwen/LLaMA): pairs are (i, i + D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # in float32 whatever x is, rounded once (as kv_inject)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# Decoding runs without cuDNN's attention, the backend torch picks for grouped-query attention
# in bfloat16 on a GPU. It builds a plan for each new shape, and decoding attends to a new number
# of keys at every pass: ~70 ms per new length on an H200, against ~0.1 ms for a planned pass,
# which made bfloat16 decoding 9x slower than float32 there (measured). Training's fixed shapes
# keep it. Both decoders (`generate` below and speculate.generate) run under this.
DECODING_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    """Grouped-query self-attention with per-head q/k RMSNorm and RoPE.
    The projections are exposed (wq, wk, wv, wo, q_norm, k_norm; project_q, project_kv) because
    the drafters' own layers (this class, their own weights) reuse them: DFlash to project the
    target's context features into keys and values, EAGLE for its training-time-test attention."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        C, D = cfg.n_embd, cfg.head_dim
        self.wq = nn.Linear(C, cfg.n_head * D, bias=False)
        self.wk = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.wv = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.wo = nn.Linear(cfg.n_head * D, C, bias=False)
        self.q_norm = RMSNorm(D, cfg.norm_eps)
        self.k_norm = RMSNorm(D, cfg.norm_eps)

    def project_kv(self, x, cos, sin):
        """x (B, T, C) -> k, v (B, H_kv, T, D), k normed and rotated."""
        B, T, _ = x.shape
        k = self.k_norm(self.wk(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def project_q(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_norm(self.wq(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)  # (B, H, T, D)

    def forward(self, x, cos, sin, cache=None, layer=0, pos=None, mask=None):
        B, T, _ = x.shape
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        if cache is None:  # training / naive path: plain causal attention over x itself
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # write the new keys at each row's own offset, then attend to the whole row
            cache.write(layer, k, v, pos)
            k, v = cache.read(layer)
            mask = cache.mask() if mask is None else mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.w_up = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=False)
        self.w_down = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, layer=0, pos=None, mask=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, pos, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_table(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of residual outputs (GPT-2)
            if name.endswith("wo.weight") or name.endswith("w_down.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def _apply(self, fn, *args, **kwargs):
        # model.to(bfloat16) would round the RoPE tables too: keep the exact float32 ones and
        # only move them (kv_inject requires float32, and bf16's 8 bits cannot tell the
        # angles of nearby positions apart)
        cos, sin = self.rope_cos, self.rope_sin
        super()._apply(fn, *args, **kwargs)
        dev = self.rope_cos.device
        self.rope_cos, self.rope_sin = cos.to(dev, torch.float32), sin.to(dev, torch.float32)
        return self

    def n_params(self):
        return sum(p.numel() for p in self.parameters())

    def rope(self, pos):
        """cos, sin (B, 1, T, D/2) for absolute positions pos (B, T)."""
        return self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]

    def forward(self, idx, cache=None, hidden_layers=(), last_only=False, tree=None):
        """idx (B, T) token ids. With a cache, the tokens are appended after each row's
        current length and the cache advances by T; without one, positions start at 0.
        tree = (pos (B, T), mask (B, 1, T, T_keys)): a draft tree's RoPE positions and
        ancestor-only mask (tree.py) in place of the cache's causal ones.
        Returns logits (B, T, V) (or (B, 1, V) with last_only) and the list of hidden
        states (B, T, C) at the requested layer indices (0 = embedding, i = block i), in depth
        order, each layer once, whatever the order of hidden_layers."""
        B, T = idx.shape
        if cache is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds max_seq_len "
                                 f"{self.cfg.max_seq_len}")
            slots = torch.arange(T, device=idx.device).expand(B, T)
        else:
            slots = cache.positions(T)  # (B, T) per-row cache slots: also the positions
        pos, mask = (slots, None) if tree is None else tree
        cos, sin = self.rope(pos)
        x = self.embed(idx)  # (B, T, C)
        hidden = [x] if 0 in hidden_layers else []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, i, slots, mask)
            if i + 1 in hidden_layers:
                hidden.append(x)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        return self.head(self.norm(x)), hidden

    def new_cache(self, batch_size, max_len=None, dtype=None):
        cfg = self.cfg
        return KVCache(cfg.n_layer, batch_size, cfg.n_kv_head, max_len or cfg.max_seq_len,
                       cfg.head_dim,
                       device=self.head.weight.device, dtype=dtype or self.head.weight.dtype)


# -----------------------------------------------------------------------------
# sampling and the naive reference generate

def logits_to_probs(logits, temperature=1.0, top_k=None):
    """Warp logits (..., V) into the distribution that decoding samples from: divide by the
    temperature, keep the top_k largest, softmax. Speculative decoding must warp the target's p
    exactly like this, or its output would not be plain decoding's. The drafters warp their q
    the same way; losslessness holds for any q, but a q close to p gets more drafts accepted."""
    logits = logits.float() / max(temperature, 1e-8)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def draw(probs, generator=None):
    """One draw per row of probs (..., V) -> (...), by inverse CDF: the first token whose running
    sum exceeds u * total, with u uniform and the product kept below the total. In float64, so
    the drawn distribution is probs up to ~1e-16 per token even at V = 151,936 (float32's 2^-24
    steps of u would be off by ~1e-3 in total variation there). A token of zero probability
    leaves the running sum flat, so it is never drawn on a CPU, whose cumsum adds in order; a
    GPU's parallel scan may leave a step of one double rounding there (~1e-16). A row with no
    mass (all zero, NaN) gives V, out of range, which the next embedding lookup rejects.
    torch.multinomial(probs, 1) draws the same, but on a CPU it took 1.6-2.0 ms for DFlash's 15
    slots of 4,098 tokens, a tenth of a pass at T = 1, against 0.07 ms here."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device)
    # u * total may round up to total
    x = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[..., 0]


@torch.no_grad()
@sdpa_kernel(DECODING_ATTENTION)
def generate(model, prompt, max_new_tokens, temperature=0.0, top_k=None, generator=None):
    """The reference: recompute the whole sequence for every new token, no cache.
    prompt: list of token ids. Returns the new tokens (a list). Past the context it reads the
    last max_seq_len tokens (nanoGPT's crop), where speculate.generate refuses the run."""
    if not temperature >= 0:  # NaN too; a negative one decoded greedily without a word
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = model.head.weight.device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits, _ = model(ids[:, -model.cfg.max_seq_len:], last_only=True)
        if temperature == 0:
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        else:
            probs = logits_to_probs(logits[:, -1], temperature, top_k)
            nxt = draw(probs, generator)[:, None]
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt):].tolist()
