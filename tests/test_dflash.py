"""DFlash drafter: training/inference parity, the training path against a plain reference of
DESIGN's formula, the three known traps, the loss weights, cached context K/V, ragged rows, lossless
greedy decoding at several block sizes, checkpoints, and a short run that learns."""
import torch
import pytest

from test_model import tiny_model
from model import generate as naive_generate
from draft_diffusion import DFlash, DFlashDrafter, feature_layers
from model import apply_rope, draw, logits_to_probs
import speculate


def random_dflash(cfg, seed=0, block_size=8, n_layer=2):
    torch.manual_seed(seed)
    df = DFlash(cfg, n_layer=n_layer, n_features=3, block_size=block_size, anchors=6).eval()
    with torch.no_grad():  # big random weights so that every input matters
        for p in df.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return df


def setup(seed=0, block_size=8, n_layer=2):
    target = tiny_model(seed)
    for p in target.parameters():
        p.requires_grad_(False)
    return target, random_dflash(target.cfg, seed + 100, block_size, n_layer)


def feats_of(target, df, tokens):
    with torch.no_grad():
        return torch.cat(target(tokens, hidden_layers=df.hidden_layers)[1], -1)


def test_feature_layers_spread():
    """Layer i of n is round(1 + i (top - 1) / (n - 1)), top = n_layer - 1 (never the last
    block: z-lab's and SGLang's layer ids stop below it), rounded to the nearest (not down)."""
    assert feature_layers(6, 5) == (1, 2, 3, 4, 5)
    assert feature_layers(36, 5) == (1, 10, 18, 26, 35)  # 1, 9.5, 18, 26.5 (ties to even), 35
    assert feature_layers(6, 2) == (1, 5)
    assert feature_layers(6, 1) == (5,)                  # a single feature: the block below the last
    assert feature_layers(3, 5) == (1, 2)                # no more features than layers below the last
    assert feature_layers(1, 5) == (1,)                  # a one-block target: its only block


@torch.no_grad()
def test_training_path_equals_inference_path():
    target, df = setup()
    S = df.block_size
    tokens = torch.randint(0, 97, (1, 30))
    feats = feats_of(target, df, tokens)
    anchors = torch.tensor([[5, 1, 17, 28]])
    train, _ = df.train_logits(target, tokens, feats, anchors)  # (1, A, S, V)
    for i, a in enumerate(anchors[0].tolist()):
        dr = DFlashDrafter(target, df, block_size=S)
        n = torch.tensor([a + 1])  # committed x_0..x_a; the target has fed 0..a-1
        buf = torch.zeros(1, 64, dtype=torch.long)
        buf[0, :a + 1] = tokens[0, :a + 1]
        dr.prefill(buf, n, feats[:, :a])
        inf = dr.block_logits(buf, n, S)[0]
        assert (inf - train[0, i]).abs().max() < 1e-4, a
        # and propose drafts slot k's argmax for position a+k: slot 0 (the known x_a) dropped
        drafts, q = dr.propose(buf, n, S - 1)
        assert q is None and drafts[0].tolist() == train[0, i, 1:].argmax(-1).tolist(), a


@torch.no_grad()
def test_loss_with_given_anchors_counts_only_real_labels():
    """Fixed anchors (as an evaluation would pass them): slot k of anchor a has a label only
    while a + k < T, so a block at the end of a sequence counts just its real labels."""
    target, df = setup()
    S = df.block_size  # 8
    tokens = torch.randint(0, 97, (2, 20))
    anchors = torch.tensor([[1, 18], [5, 10]])  # 18: only slot 1 (position 19) has a label
    loss, st = df.loss(target, tokens, feats_of(target, df, tokens), anchors)
    assert torch.isfinite(loss)
    assert st["count"].tolist() == [4] + [3] * (S - 2)


@torch.no_grad()
def test_loss_decay_gamma_weights_the_block_positions():
    """gamma -> 0 leaves only block position 1 in the loss, gamma -> inf weights all equally."""
    import torch.nn.functional as F
    target, df = setup()
    tokens = torch.randint(0, 97, (2, 20))
    feats = feats_of(target, df, tokens)
    anchors = torch.tensor([[1, 18], [5, 10]])  # 18: only position 1 has a label
    logits, pos = df.train_logits(target, tokens, feats, anchors)
    labels = tokens.gather(1, pos[:, :, 1:].clamp(max=19).flatten(1)).view(2, 2, -1)
    ce = F.cross_entropy(logits[:, :, 1:].flatten(0, 2), labels.flatten(), reduction="none").view(2, 2, -1)
    valid = pos[:, :, 1:] < 20
    for gamma, want in ((1e-3, ce[:, :, 0].mean()), (1e9, ce[valid].mean())):
        df.gamma = gamma
        assert torch.allclose(df.loss(target, tokens, feats, anchors)[0], want, atol=1e-5), gamma
    assert DFlash(target.cfg, block_size=16).gamma == 7.0 and DFlash(target.cfg, gamma=3.0).config_dict()["gamma"] == 3.0
    # the paper's decay per block size (DESIGN sec. 6), not 7 for every size
    assert [DFlash(target.cfg, block_size=S).gamma for S in (8, 10)] == [4.0, 5.0]


@torch.no_grad()
def test_context_strictly_before_anchor_and_block_bidirectional():
    target, df = setup(1)
    S = df.block_size
    tokens = torch.randint(0, 97, (1, 24))
    feats = feats_of(target, df, tokens)
    a = 10
    anchors = torch.tensor([[a]])
    base, _ = df.train_logits(target, tokens, feats, anchors)
    f2 = feats.clone(); f2[:, a] += 3.0           # the anchor's own feature: must be invisible
    same, _ = df.train_logits(target, tokens, f2, anchors)
    assert torch.allclose(base, same, atol=1e-5)
    f3 = feats.clone(); f3[:, a - 1] += 3.0       # the one just before it: must be visible
    diff, _ = df.train_logits(target, tokens, f3, anchors)
    assert (base - diff).abs().max() > 1e-3
    # bidirectional block: slot 1 must see the last slot (a causal mask would hide it)
    def bump_last_slot(module, inputs, out):  # embeddings of the blocks: (B, A, S, C)
        out = out.clone()
        out[..., S - 1, :] += 1.0
        return out
    h = target.embed.register_forward_hook(bump_last_slot)
    try:
        pert, _ = df.train_logits(target, tokens, feats, anchors)
    finally:
        h.remove()
    assert (pert[0, 0, 1] - base[0, 0, 1]).abs().max() > 1e-3


def test_labels_are_same_position():
    """A perfect same-position predictor must get loss ~0 and agreement 1; with labels
    shifted by one it would score ~0 agreement."""
    target, df = setup(2)
    tokens = torch.randint(0, 97, (2, 40))
    feats = feats_of(target, df, tokens)

    def oracle(target_, tok, f, anchors):
        B, A = anchors.shape
        pos = anchors[:, :, None] + torch.arange(df.block_size)
        lab = tok.gather(1, pos.clamp(max=tok.shape[1] - 1).flatten(1)).view(B, A, -1)
        return torch.nn.functional.one_hot(lab, 97).float() * 50, pos
    df.train_logits = oracle
    loss, st = df.loss(target, tokens, feats)
    assert loss.item() < 1e-3
    assert torch.equal(st["agree"], st["count"])


@pytest.mark.parametrize("S", [4, 8, 16])
@pytest.mark.parametrize("B", [1, 3])
def test_greedy_dflash_equals_plain_decoding(S, B):
    target, df = setup(3, block_size=16)
    g = torch.Generator().manual_seed(S * 10 + B)
    prompts = [torch.randint(0, 97, (L,), generator=g).tolist() for L in (7, 2, 13)[:B]]
    dr = DFlashDrafter(target, df, block_size=S)
    outs, st = speculate.generate(target, prompts, dr, max_new_tokens=25, K=S - 1)
    assert outs == [naive_generate(target, p, 25) for p in prompts]
    assert len(st["acceptance_per_position"]) == S - 1
    att = st["attempts_per_position"]
    assert att[-1] == att[0] > 0  # every pass drafted the whole block: K = S - 1 tokens
    # asked for fewer, it runs a block of K+1 slots and drafts exactly K at every pass
    outs, st = speculate.generate(target, prompts, DFlashDrafter(target, df, block_size=S), max_new_tokens=25, K=S // 2)
    assert outs == [naive_generate(target, p, 25) for p in prompts]
    att = st["attempts_per_position"]
    assert att[-1] == att[0] > 0


@torch.no_grad()
def test_cached_context_equals_recompute_after_ragged_steps():
    """After a ragged prefill and verify steps that commit a different number of tokens per row,
    each row's cached context K/V equals a recompute from the target's features of its fed tokens."""
    target, df = setup(4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4], [9, 8], [5, 5, 5, 5, 5]]
    dr = DFlashDrafter(target, df, block_size=8)
    propose, update, n_news = dr.propose, dr.update, []

    # random weights never get a draft accepted, so the drafts are replaced: the target's own
    # greedy continuation for m positions (accepted), then tokens it rejects, m different per
    # row and per step; the drafter's own propose and update (the cache under test) still run
    def ragged_propose(tokens, n, K, **kw):
        drafts, q = propose(tokens, n, K, **kw)
        for b in range(len(n)):
            greedy = naive_generate(target, tokens[b, :n[b]].tolist(), drafts.shape[1])
            m = (len(n_news) + 3 * b) % (drafts.shape[1] + 1)
            drafts[b] = torch.tensor(greedy[:m] + [(t + 1) % 97 for t in greedy[m:]])
        return drafts, q

    def spy_update(tokens, n, feats, n_new):
        n_news.append(n_new.tolist())
        update(tokens, n, feats, n_new)
    dr.propose, dr.update = ragged_propose, spy_update
    outs, _ = speculate.generate(target, prompts, dr, max_new_tokens=20, K=7)
    assert outs == [naive_generate(target, p, 20) for p in prompts]
    # n_news[0] is the prefill's (it calls update too); a verify step must be ragged as well
    assert any(len({c for c in counts if c > 0}) > 1 for counts in n_news[1:]), n_news
    for b, (p, o) in enumerate(zip(prompts, outs)):
        seq = torch.tensor([p + o])
        n_fed = len(p) + len(o) - 1
        assert int(dr.ctx_len[b]) == n_fed
        k, v = df.context_kv(df.context(feats_of(target, df, seq[:, :n_fed])))  # (L, 1, T, H, D)
        cos, sin = target.rope(torch.arange(n_fed)[None])
        k = apply_rope(k.transpose(2, 3), cos, sin)                            # (L, 1, H, T, D)
        assert (dr.ck[:, b:b + 1, :, :n_fed] - k).abs().max() < 1e-4
        assert (dr.cv[:, b:b + 1, :, :n_fed] - v.transpose(2, 3)).abs().max() < 1e-4


def test_block_size_outside_training_is_an_error():
    target, df = setup(5, block_size=8)
    for bs in (16, 1, 0):  # 0 is no "default" (it ran the trained block)
        with pytest.raises(ValueError, match=f"block size {bs} is outside what the drafter was trained for"):
            DFlashDrafter(target, df, block_size=bs)
    assert DFlashDrafter(target, df).block_size == 8


def test_short_training_run_learns():
    """On structured data (x_{t+1} = x_t + 1 mod V, random start) agreement at block position 1
    rises from chance (1/97) to well above it within a couple hundred steps."""
    torch.manual_seed(0)
    target = tiny_model(6)
    for p in target.parameters():
        p.requires_grad_(False)
    data = (torch.randint(0, 97, (64, 1)) + torch.arange(40)) % 97
    train, val = data[:48], data[48:]
    df = DFlash(target.cfg, n_layer=1, n_features=2, block_size=4, anchors=16)
    opt = torch.optim.AdamW(df.parameters(), lr=3e-3)

    def agreement():
        with torch.no_grad():
            _, st = df.loss(target, val, feats_of(target, df, val))
        return (st["agree"].float() / st["count"].clamp(min=1)).tolist()
    before = agreement()
    for step in range(150):
        tok = train[torch.randint(0, 48, (8,))]
        loss, _ = df.loss(target, tok, feats_of(target, df, tok))
        opt.zero_grad(); loss.backward(); opt.step()
    after = agreement()
    assert after[0] > max(0.5, before[0] + 0.3), (before, after)


def test_sampled_anchors_leave_a_label_and_a_context_position():
    """T = 4, two anchors: only a in {1, 2} has context and a label, so labels = 2 + 1 every time."""
    target, df = setup(block_size=4)
    df.n_anchors = 2
    tokens = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(0))
    feats = feats_of(target, df, tokens)
    torch.manual_seed(0)
    with torch.no_grad():
        for _ in range(20):
            assert int(df.loss(target, tokens, feats)[1]["count"].sum()) == 3


@torch.no_grad()
def test_loss_samples_n_anchors_distinct_anchors_per_row():
    """Sampled anchors: n_anchors of them per row, distinct within a row, in [lo, T - 2] with
    lo = max(1, label_from - 1), drawn for each row on its own, and over many draws every
    position of that range comes up."""
    target, df = setup(block_size=4)
    T = 20
    tokens = torch.randint(0, 97, (3, T), generator=torch.Generator().manual_seed(0))
    feats = feats_of(target, df, tokens)
    seen, train_logits = [], df.train_logits
    def spy(target_, tok, f, anchors):  # record the anchors loss() sampled, then train as usual
        seen.append(anchors)
        return train_logits(target_, tok, f, anchors)
    df.train_logits = spy
    torch.manual_seed(0)
    for n_anchors in (2, 3):
        for label_from, lo in ((0, 1), (6, 5)):
            df.n_anchors, seen[:] = n_anchors, []
            for _ in range(20):
                df.loss(target, tokens, feats, label_from=label_from)
            for anchors in seen:
                assert anchors.shape == (3, n_anchors)
                for row in anchors.tolist():
                    assert len(set(row)) == n_anchors and all(lo <= a <= T - 2 for a in row), row
            assert set(torch.cat(seen).flatten().tolist()) == set(range(lo, T - 1))
            # drawn per row: rows of one batch do not all share the same anchors
            assert any(len({tuple(r) for r in anchors.tolist()}) > 1 for anchors in seen)


@torch.no_grad()
def test_labels_from_skip_the_prompt():
    """With label_from = L every sampled anchor is at L-1 or later, so no label falls in the
    prompt: the tokens before L-1 (with the target's features held fixed) cannot move the loss.
    Without label_from they do."""
    target, df = setup(block_size=4)
    L, T = 9, 14
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(0))
    feats = feats_of(target, df, tokens)
    other = tokens.clone()
    other[:, :L - 1] = (other[:, :L - 1] + 1) % 97

    def loss(tok, label_from):
        torch.manual_seed(0)
        return [df.loss(target, tok, feats, label_from=label_from)[0] for _ in range(5)]

    assert all(torch.equal(a, b) for a, b in zip(loss(tokens, L), loss(other, L)))
    assert not all(torch.equal(a, b) for a, b in zip(loss(tokens, 0), loss(other, 0)))
    with pytest.raises(ValueError, match="no anchor"):
        df.loss(target, tokens, feats, label_from=T)


@torch.no_grad()
def test_block_at_the_context_edge_trains():
    """A sequence as long as the target's context, anchored near its end: the block's slots past
    the RoPE table take part (masked out of the loss) without indexing past the table."""
    target, df = setup(block_size=8)
    T = target.cfg.max_seq_len
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0))
    loss, st = df.loss(target, tokens, feats_of(target, df, tokens), torch.tensor([[T - 3]]))
    assert torch.isfinite(loss) and int(st["count"].sum()) == 2


@torch.no_grad()
def test_context_feature_is_rms_normed():
    """c = RMSNorm(fc(feats)): scale-free in the target's features."""
    _, df = setup()
    f = torch.randn(2, 5, df.fc.in_features)
    assert torch.allclose(df.context(3 * f), df.context(f), atol=1e-5)


@torch.no_grad()
def test_context_keys_are_k_normed_like_the_block_keys():
    """context_kv's k is k_norm(W_k c) (what project_kv computes before RoPE): scale-free in c;
    v = W_v c is linear."""
    _, df = setup()
    c = torch.randn(2, 5, df.cfg.n_embd)
    k1, v1 = df.context_kv(c)
    k3, v3 = df.context_kv(3 * c)
    assert torch.allclose(k1, k3, atol=1e-5) and torch.allclose(v3, 3 * v1, atol=1e-5)
    D2 = df.cfg.head_dim // 2
    ones, zeros = torch.ones(2, 1, 5, D2), torch.zeros(2, 1, 5, D2)  # RoPE at angle 0: no rotation
    k_ref, _ = df.layers[0].attn.project_kv(c, ones, zeros)
    assert torch.allclose(k1[0].transpose(1, 2), k_ref, atol=1e-6)


@torch.no_grad()
def test_refill_writes_the_new_prompt_from_position_0():
    target, df = setup()
    dr = DFlashDrafter(target, df)
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(2, 40, dtype=torch.long)
    tokens[:, :10] = torch.randint(0, 97, (2, 10), generator=g)
    n = torch.tensor([10, 6])
    dr.prefill(tokens, n, feats_of(target, df, tokens[:, :9]))
    new = torch.randint(0, 97, (1, 7), generator=g)
    tokens[0] = 0
    tokens[0, :7] = new[0]
    n = torch.tensor([7, 6])
    dr.refill(0, tokens, n, feats_of(target, df, new[:, :6]))
    assert dr.ctx_len.tolist() == [6, 5]
    k, v = df.context_kv(df.context(feats_of(target, df, new[:, :6])))
    cos, sin = target.rope(torch.arange(6)[None])
    assert torch.allclose(dr.ck[:, 0:1, :, :6], apply_rope(k.transpose(2, 3), cos, sin), atol=1e-5)
    assert torch.allclose(dr.cv[:, 0:1, :, :6], v.transpose(2, 3), atol=1e-5)


@torch.no_grad()
def reference_block_logits(target, df, tokens, feats, a):
    """DESIGN sec. 6 written out for one anchor a, densely and without the cache or the masks:
    context c_0..c_{a-1} at positions 0..a-1 gives keys (k-normed, rotated) and values through
    each layer's own W_k, W_v; the block [x_a, mask...] at a..a+S-1 attends to all of it and
    all of itself (a plain softmax, no mask). Returns (S, V)."""
    S = df.block_size
    c = df.ctx_norm(df.fc(feats[:, :a]))                                         # (1, a, C)
    x = target.embed(torch.tensor([[int(tokens[0, a])] + [df.mask_id] * (S - 1)]))
    cos_c, sin_c = target.rope(torch.arange(a)[None])
    cos_b, sin_b = target.rope(torch.arange(a, a + S)[None])
    for layer in df.layers:
        attn, h = layer.attn, layer.attn_norm(x)
        q = attn.project_q(h, cos_b, sin_b)                                      # (1, H, S, D)
        kc, vc = attn.project_kv(c, cos_c, sin_c)                                # (1, H_kv, a, D)
        kb, vb = attn.project_kv(h, cos_b, sin_b)                                # (1, H_kv, S, D)
        rep = attn.n_head // attn.n_kv_head
        k = torch.cat([kc, kb], 2).repeat_interleave(rep, 1)
        v = torch.cat([vc, vb], 2).repeat_interleave(rep, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / attn.head_dim ** 0.5, -1)
        x = x + attn.wo((att @ v).transpose(1, 2).reshape(1, S, -1))
        x = x + layer.mlp(layer.mlp_norm(x))
    return target.head(df.norm(x))[0]


@torch.no_grad()
def test_training_logits_equal_a_plain_reference_of_the_design():
    """The parity test above compares two paths of this file with each other, so an error both
    share (RoPE positions of block or context, k-norm, the mask) passes it; this one compares
    the training path with DESIGN's formula written out. Anchors at the start, middle and end."""
    target, df = setup(7)
    tokens = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(0))
    feats = feats_of(target, df, tokens)
    anchors = torch.tensor([[1, 12, 27]])
    train, _ = df.train_logits(target, tokens, feats, anchors)
    for i, a in enumerate(anchors[0].tolist()):
        assert (train[0, i] - reference_block_logits(target, df, tokens, feats, a)).abs().max() < 1e-4, a


@torch.no_grad()
def test_loss_weights_at_a_finite_gamma():
    """At train_drafter's gamma = 4, block position k's cross-entropy is weighted exp(-(k-1)/4),
    normalised by the weights of the real labels. The gamma limits above cannot tell this from
    another decay with the same limits, e.g. exp(-(k-1)/(2 gamma))."""
    import torch.nn.functional as F
    target, df = setup()
    S = df.block_size
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    feats = feats_of(target, df, tokens)
    anchors = torch.tensor([[1, 15], [5, 10]])  # 15: positions 1..4 have labels
    logits, pos = df.train_logits(target, tokens, feats, anchors)
    labels = tokens.gather(1, pos[:, :, 1:].clamp(max=19).flatten(1)).view(2, 2, -1)
    ce = F.cross_entropy(logits[:, :, 1:].flatten(0, 2), labels.flatten(), reduction="none").view(2, 2, -1)
    w = torch.exp(-torch.arange(S - 1) / 4.0) * (pos[:, :, 1:] < 20)
    df.gamma = 4.0
    assert torch.allclose(df.loss(target, tokens, feats, anchors)[0], (ce * w).sum() / w.sum(), atol=1e-5)


@torch.no_grad()
def test_rows_of_different_context_lengths_draft_as_if_alone():
    """In a batch each row's block sees its own context only, not the slots that pad it to
    the longest row: its block logits equal those of the row decoded alone."""
    target, df = setup()
    S = df.block_size
    tokens = torch.zeros(3, 40, dtype=torch.long)
    tokens[:, :12] = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    n = torch.tensor([12, 5, 9])
    dr = DFlashDrafter(target, df)
    dr.prefill(tokens, n, feats_of(target, df, tokens[:, :11]))
    batch = dr.block_logits(tokens, n, S)
    for b in range(3):
        alone = DFlashDrafter(target, df)
        alone.prefill(tokens[b:b + 1], n[b:b + 1], feats_of(target, df, tokens[b:b + 1, :int(n[b]) - 1]))
        assert (batch[b] - alone.block_logits(tokens[b:b + 1], n[b:b + 1], S)[0]).abs().max() < 1e-4, b


def prefilled_drafter(sample):
    """Two rows of different lengths, prefilled: (drafter, tokens, n)."""
    target, df = setup()
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    n = torch.tensor([12, 7])
    dr = DFlashDrafter(target, df, sample=sample)
    dr.prefill(tokens, n, feats_of(target, df, tokens[:, :11]))
    return dr, tokens, n


@torch.no_grad()
@pytest.mark.parametrize("T, top_k", [(0.5, None), (1.0, 5), (2.0, 3)])
def test_sampled_drafts_are_drawn_from_the_q_returned(T, top_k):
    """q is each slot's logits warped at (T, top_k), and the drafts are draws from exactly that
    q: the ratio test is lossless only for the q the drafts came from (a q without the top_k was
    0.017 TV off in one step), and acceptance falls with a q warped at another T."""
    dr, tokens, n = prefilled_drafter(sample=True)
    drafts, q = dr.propose(tokens, n, 4, temperature=T, top_k=top_k, generator=torch.Generator().manual_seed(1))
    expect = logits_to_probs(dr.block_logits(tokens, n, 5)[:, 1:], T, top_k)
    assert torch.allclose(q, expect, atol=1e-6)
    assert torch.equal(drafts, draw(expect, torch.Generator().manual_seed(1)))


@torch.no_grad()
def test_an_argmax_dflash_drafts_argmax_picks_when_sampling():
    """sample=False (bench --dflash-argmax) drafts each slot's argmax, q None, even at T = 1."""
    dr, tokens, n = prefilled_drafter(sample=False)
    drafts, q = dr.propose(tokens, n, 4, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert q is None and torch.equal(drafts, dr.block_logits(tokens, n, 5)[:, 1:].argmax(-1))


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_checkpoint_roundtrip_and_wrong_target(tmp_path, capsys):
    """load_drafter rebuilds the drafter from the checkpoint's own config (none of it the
    defaults: 1 layer, 3 features, block 8) and refuses a checkpoint of another target."""
    from checkpoint import load_drafter
    from checkpoint import save_checkpoint, weights_hash
    target, df = setup(block_size=8, n_layer=1)
    save_checkpoint(str(tmp_path / "dflash.pt"), dict(kind="dflash", config=df.config_dict(), state_dict=df.state_dict(),
                                                      target_hash=weights_hash(target.cfg, target.state_dict())))
    dr = load_drafter("dflash", target, str(tmp_path))
    assert dr.dflash.config_dict() == df.config_dict() and dr.block_size == 8 and dr.hidden_layers == df.hidden_layers
    assert capsys.readouterr().out.startswith(f"dflash: {n_params(df) / 1e6:.2f}M params, target layers {df.hidden_layers}")
    assert all(torch.equal(v, df.state_dict()[k]) for k, v in dr.dflash.state_dict().items())
    with pytest.raises(ValueError, match="retrain"):
        load_drafter("dflash", tiny_model(1), str(tmp_path))
