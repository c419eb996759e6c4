"""
A static KV cache with per-row lengths and O(1) rollback (DESIGN.md sec. 4).

Speculative decoding appends K+1 positions per verify pass and then keeps only the
accepted prefix of each row. Rows of a batch accept different numbers of tokens, so the
cache holds one length per row instead of one shared position:

    k, v     : (L, B, H, T_max, D)   allocated once, never resized
    lengths  : (B,) int64            positions [0, lengths[b]) of row b are valid

Appending T positions to row b writes at lengths[b] .. lengths[b]+T-1. Rollback is just
new lengths (copied in place): nothing else is copied or cleared. Stale entries past a row's
length are hidden by the mask and later overwritten, which is why the mask is derived from the
lengths and never from what the buffer happens to contain.

The same class serves the target, the small draft model, the MTP modules and the EAGLE drafter.
(DFlash keeps only its context K/V, in plain buffers of this layout: kv_inject writes all
its layers at once, and its block is recomputed every pass.) Typical use inside a model's
forward:

    pos = cache.positions(T)                 # (B, T) absolute positions of the new tokens
    for layer: cache.write(layer, k, v, pos) # k, v (B, H, T, D)
               attend to cache.k[layer], cache.v[layer] (all T_max slots) under cache.mask
    cache.advance(T)                         # after the last layer
"""

import copy

import torch


class KVCache:

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, device, dtype):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)  # (L, B, H, T_max, D)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.max_len = max_len
        self.mask = None  # (B, 1, T, T_max), True = may attend: this forward's, set by positions()

    def positions(self, T):
        """Absolute positions (B, T) of T new tokens appended to every row; also builds this
        forward's mask (the same for every layer, so built once here). No host sync: a forward
        reads all max_len key slots and the mask hides those past each row's end, so its shapes
        depend on T alone and a CUDA graph can replay it (at this size the keys are cheap)."""
        # past max_len a forward fails deep in torch (a device assert on a GPU); the full check
        # reads the lengths back, so it runs only where that is free: a CPU, not compiling
        free = not (self.lengths.is_cuda or torch.compiler.is_compiling())
        if T > self.max_len or (free and int(self.lengths.max()) + T > self.max_len):
            raise ValueError(f"KV cache overflow: {T} new positions exceed max_len {self.max_len}")
        pos = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)  # (B, T)
        # query t of row b sees key j iff j <= lengths[b] + t: keys after the query's own
        # position are hidden, the row's later new tokens (causal) and, past lengths[b] + T,
        # stale entries or the unused slots up to max_len
        j = torch.arange(self.max_len, device=self.lengths.device)            # (T_max,)
        self.mask = (j[None, None, :] <= pos[:, :, None])[:, None]           # (B, 1, T, T_max)
        return pos

    def write(self, layer, k, v, pos):
        """Scatter k, v (B, H, T, D) of one layer at per-row positions pos (B, T)."""
        B, H, T, D = k.shape
        idx = pos[:, None, :, None].expand(B, H, T, D)
        self.k[layer].scatter_(2, idx, k.to(self.k.dtype))
        self.v[layer].scatter_(2, idx, v.to(self.v.dtype))

    # lengths change in place (advance, rollback): a CUDA graph reads this very tensor at every
    # replay. So whoever keeps an old value of cache.lengths must .clone() it
    def advance(self, T):
        """Count T new positions (int or (B,) tensor) as cached once every layer has written
        them; a verify pass's drafts included (rollback() drops the rejected ones)."""
        self.lengths += T

    def rollback(self, new_lengths):
        self.lengths.copy_(new_lengths)

    def row(self, b):
        """Row b alone as an empty batch-1 cache over the same buffers (a view: what a forward
        writes into it lands in row b here). For prefilling one row of a running batch with a
        new sequence; then set this cache's lengths[b] from the view's."""
        if not 0 <= b < self.k.shape[1]:  # a slice past the end would be an empty view, silently
            raise IndexError(f"row {b} of a cache of {self.k.shape[1]} rows")
        view = copy.copy(self)
        view.k, view.v = self.k[:, b:b + 1], self.v[:, b:b + 1]
        view.lengths = torch.zeros(1, dtype=torch.long, device=self.lengths.device)
        return view


def kept(owner, key, make):
    """make() -> buffers (tensors, KVCaches), made once per key (rows, length, dtype, device) on
    owner, handed out again, emptied, at later calls: a GPU's CUDA graphs replay in-place writes
    only into tensors whose addresses never change, marked static (else torch skips the graph).
    Several row counts' sets coexist; a new length (compiled: the context) drops them all."""
    store = owner.__dict__.setdefault("_kept", {})
    if any(k[1:] != key[1:] for k in store):  # another length, dtype or device: all sets go
        store.clear()
    if key in store:  # a KVCache restarts by its lengths (stale slots are masked), the rest zeroed
        for b in store[key]:
            (b.lengths if isinstance(b, KVCache) else b).zero_()
        return store[key]
    bufs = store[key] = make()
    for b in bufs:
        for t in [b.k, b.v, b.lengths] if isinstance(b, KVCache) else [b]:
            if t.is_cuda:
                torch._dynamo.mark_static_address(t)
    return bufs
