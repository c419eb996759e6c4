"""
The target: a small Qwen3-style decoder-only transformer (DESIGN.md sec. 3).

Token embedding; N blocks of pre-RMSNorm attention (RoPE, grouped-query heads, q/k RMSNorm)
and SwiGLU MLP; final RMSNorm; LM head. `forward` can also return the hidden states of chosen
layers, which every feature-based drafter (MTP, EAGLE, DFlash) conditions on.

The naive, cache-free `generate` at the end is the reference every fast path is tested against:
speculative decoding must reproduce it token for token (greedy).

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
class Config:  # defaults only: sizes come from PRESETS below, a checkpoint or a Qwen3 config
    vocab_size: int = 4098     # tokenizer ranks + <|endoftext|> + <|mask|>
    n_layer: int = 6           # transformer blocks
    n_head: int = 6            # query heads
    n_kv_head: int = 2         # key/value heads (grouped-query attention)
    n_embd: int = 384          # residual width C
    mlp_hidden: int = 1024     # SwiGLU inner width
    max_seq_len: int = 512     # longest context (RoPE table, KV cache size)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # for real Qwen3 checkpoints (interop.py): Qwen3-0.6B has head_dim 128 != 1024 / 16 heads
    head_dim: int = 0          # 0: n_embd // n_head
    tie_embeddings: bool = False  # the head shares the embedding's weights

    def __post_init__(self):  # a damaged or hand-edited config fails here, not in a forward pass
        number = lambda k, v: not isinstance(v, bool) and isinstance(
            v, (int, float) if k in ("rope_theta", "norm_eps") else int) and 0 < v < math.inf
        if bad := [f"{k}={v!r}" for k, v in vars(self).items() if k != "tie_embeddings"
                   and not number(k, v) and not (k == "head_dim" and v == 0)]:
            raise TypeError(f"model config: {', '.join(bad)} (sizes are positive integers, "
                            "rope_theta and norm_eps positive numbers)")
        self.rope_theta, self.norm_eps = float(self.rope_theta), float(self.norm_eps)
        self.head_dim = self.head_dim or self.n_embd // self.n_head


# `tiny` for tests (seconds), `cpu` for a target a CPU trains (the committed weights/cpu), `ref`
# for the one dev/h200_train.sh trains on a GPU to replace it: compute-optimal for ~250M tokens,
# and still under 5 minutes of CPU bench (docs/experiments.md, "The GPU target's size").
# vocab_size is filled from the tokenizer at build time.
PRESETS = {
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, mlp_hidden=128, max_seq_len=256),
    "cpu": dict(n_layer=6, n_head=4, n_kv_head=2, n_embd=256, mlp_hidden=768, max_seq_len=384),
    "ref": dict(n_layer=6, n_head=6, n_kv_head=2, n_embd=384, mlp_hidden=1024, max_seq_len=384),
    # the small model of the `draft` method (draft_simple.py): same family, same context
    "cpu-draft": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384,
                      max_seq_len=384),
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # weight in x's dtype: under bf16 autocast a float32 weight would miss the fused kernel
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rope_table(cfg):
    """cos, sin of shape (max_seq_len, D/2) for rotary embeddings."""
    i = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32)
    inv_freq = 1.0 / (cfg.rope_theta ** (i / cfg.head_dim))
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T_max, D/2)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    """Rotate x (B, H, T, D) by angles given per position: cos, sin (B, 1, T, D/2).
    Rotate-half convention (as in Qwen/LLaMA): pairs are (i, i + D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # in float32 whatever x is, rounded once (as kv_inject)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# Both decoders (`generate` below, speculate.generate) run without cuDNN's attention, which torch
# picks for bf16 GQA on a GPU: it plans each new shape (~70 ms), and decoding's shapes change
# with the number of new tokens and the cache size (docs/experiments.md, "bfloat16 and cuDNN").
# Training keeps it.
DECODING_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    """Grouped-query self-attention with per-head q/k RMSNorm and RoPE. project_q, project_kv
    are separate because the drafters reuse them: DFlash for its block's own queries, keys and
    values (beside the injected context), EAGLE for its training-time-test attention."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        C, D = cfg.n_embd, cfg.head_dim
        self.wq = nn.Linear(C, cfg.n_head * D, bias=False)
        self.wk = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.wv = nn.Linear(C, cfg.n_kv_head * D, bias=False)
        self.wo = nn.Linear(cfg.n_head * D, C, bias=False)
        self.q_norm, self.k_norm = RMSNorm(D, cfg.norm_eps), RMSNorm(D, cfg.norm_eps)

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

    def forward(self, x, cos, sin, cache=None, layer=0, slots=None, mask=None):
        B, T, _ = x.shape
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        if cache is None:  # training / naive path: plain causal attention over x itself
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # kv_cache.py (file 2): write k, v at each row's own offset, then attend to all
            cache.write(layer, k, v, slots)  # T_max slots of the row; the mask hides the rest
            k, v, mask = cache.k[layer], cache.v[layer], cache.mask if mask is None else mask
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

    def forward(self, x, cos, sin, cache=None, layer=0, slots=None, mask=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, slots, mask)
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
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():  # scaled init of residual outputs (GPT-2)
            if name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def _apply(self, fn, *args, **kwargs):
        # NOTE: model.to(bfloat16) would round the RoPE tables too (bf16 cannot tell nearby
        # positions' angles apart, and kv_inject needs float32): keep them float32, only move them
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
        """idx (B, T) token ids. With a cache, they are appended after each row's current length
        and the cache advances by T; without one, positions start at 0. tree = (pos (B, T), mask
        (B, 1, T, T_max)): a draft tree's positions and ancestor mask (tree.py) instead.
        Returns logits (B, T, V) (or (B, 1, V) with last_only) and the hidden states (B, T, C)
        at the requested layers (0 = embedding, i = block i), each once, in depth order."""
        B, T = idx.shape
        if cache is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"{T} tokens exceed max_seq_len {self.cfg.max_seq_len}")
            slots = torch.arange(T, device=idx.device).expand(B, T)
        else:
            slots = cache.positions(T)  # (B, T) per-row cache slots k, v go to: also RoPE's
        pos, mask = (slots, None) if tree is None else tree  # a tree's RoPE: base + depth
        cos, sin = self.rope(pos)
        x = self.embed(idx)  # (B, T, C)
        hidden = [x] if 0 in hidden_layers else []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, i, slots, mask)
            if i + 1 in hidden_layers:
                hidden.append(x)
        if cache is not None:
            cache.advance(T)
        return self.head(self.norm(x[:, -1:] if last_only else x)), hidden

    def new_cache(self, batch_size, max_len=None):
        cfg = self.cfg
        return KVCache(cfg.n_layer, batch_size, cfg.n_kv_head, max_len or cfg.max_seq_len,
                       cfg.head_dim, self.head.weight.device, self.head.weight.dtype)


# --- sampling and the naive reference generate ----------------------------------------------------

def logits_to_probs(logits, temperature=1.0, top_k=None):
    """Warp logits (..., V) into the distribution decoding samples from: divide by the
    temperature, keep the top_k largest, softmax. Speculative decoding must warp the target's p
    exactly like this to stay lossless; the drafters warp their q alike, so more gets accepted."""
    logits = logits.float() / max(temperature, 1e-8)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def draw(probs, generator=None, u=None):
    """One draw per row of probs (..., V) -> (...), by inverse CDF in float64 (float32's steps of
    u are ~1e-3 off at V = 151,936): the first token whose running sum exceeds u * total, u
    uniform (or given: float64 (..., 1), the acceptance scan's). Never a zero-probability token;
    a row with no mass gives V, which the next embedding lookup rejects. torch.multinomial draws
    alike, slower (1.5-1.9 ms more a DFlash pass on a CPU: docs/experiments.md)."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    if u is None:  # generator a tensor: the uniforms, drawn before a compiled propose
        u = generator if torch.is_tensor(generator) else torch.rand(
            total.shape, dtype=torch.float64, generator=generator, device=probs.device)
    x = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))  # u * total may round up
    return torch.searchsorted(cdf, x, right=True)[..., 0]


@torch.no_grad()
@sdpa_kernel(DECODING_ATTENTION)
def generate(model, prompt, max_new_tokens, temperature=0.0, top_k=None, generator=None):
    """The reference: recompute the whole sequence for every new token, no cache.
    prompt: list of token ids. Returns the new tokens (a list). Past the context it reads the
    last max_seq_len tokens (nanoGPT's crop), where speculate.generate refuses the run."""
    if not temperature >= 0:  # NaN too (a negative one would decode greedily, silently)
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    ids = torch.tensor([prompt], dtype=torch.long, device=model.head.weight.device)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len:], last_only=True)[0][:, -1]  # (1, V)
        nxt = (logits.argmax(-1) if temperature == 0
               else draw(logits_to_probs(logits, temperature, top_k), generator))
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids[0, len(prompt):].tolist()
