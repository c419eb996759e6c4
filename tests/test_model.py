"""Target model and KV cache: cached decoding must equal the naive full recompute."""
import math

import torch
import pytest

from model import Config, PRESETS, Transformer, apply_rope, generate, rope_table
from checkpoint import save_checkpoint


def tiny_model(seed=0, vocab=97):
    torch.manual_seed(seed)
    cfg = Config(vocab_size=vocab, **PRESETS["tiny"])
    m = Transformer(cfg).eval()
    # larger random weights than the init so that logits differ a lot between positions
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return m


def save_tiny(path, seed=0, tokenizer=None, **overrides):
    """A random model of the tiny preset at the real vocabulary, in train.py's checkpoint format."""
    import data
    torch.manual_seed(seed)
    cfg = Config(**{"vocab_size": data.get_encoding().n_vocab, **PRESETS["tiny"], **overrides})
    save_checkpoint(str(path), dict(kind="target", config=cfg.__dict__, state_dict=Transformer(cfg).state_dict(),
                                    mtp_state_dict=None, tokenizer=tokenizer or data.tokenizer_hash(), args={"preset": "tiny"}))


def naive_logits(m, ids):
    return m(torch.tensor([ids]))[0][0]  # (T, V)


@torch.no_grad()
def test_cache_prefill_single_chunks_rollback_batch():
    m = tiny_model()
    g = torch.Generator().manual_seed(1)
    lens = [5, 11, 1]
    rows = [torch.randint(0, 97, (40,), generator=g).tolist() for _ in lens]
    B = len(rows)
    cache = m.new_cache(B)
    # prefill right-padded, then roll each row back to its true length
    T0 = max(lens)
    idx = torch.tensor([r[:T0] for r in rows])
    m(idx, cache)
    cache.rollback(torch.tensor(lens))
    committed = list(lens)
    steps = [1, 1, 4, 3, 1, 6]
    for step, K in enumerate(steps):
        idx = torch.tensor([r[c:c + K] for r, c in zip(rows, committed)])
        logits, _ = m(idx, cache)
        for b in range(B):
            ref = naive_logits(m, rows[b][:committed[b] + K])[committed[b]:]
            assert (logits[b] - ref).abs().max() < 1e-4
            assert torch.equal(logits[b].argmax(-1), ref.argmax(-1))
        # random ragged rollback: keep between 0 and K of the new positions per row
        keep = torch.randint(0, K + 1, (B,), generator=g)
        committed = [c + int(k) for c, k in zip(committed, keep)]
        cache.rollback(torch.tensor(committed))
        assert cache.lengths.tolist() == committed
    # rollback keeps a copy: the caller's tensor may change afterwards (refills write lengths[b])
    n = torch.tensor(committed)
    cache.rollback(n)
    n[0] = 99
    assert cache.lengths.tolist() == committed


@torch.no_grad()
def test_cached_greedy_equals_naive_generate():
    m = tiny_model(3)
    prompt = [3, 14, 15, 92, 65]
    ref = generate(m, prompt, 20)
    cache = m.new_cache(1)
    logits, _ = m(torch.tensor([prompt]), cache, last_only=True)
    out = []
    for _ in range(20):
        out.append(int(logits[0, -1].argmax()))
        logits, _ = m(torch.tensor([[out[-1]]]), cache)
    assert out == ref


@torch.no_grad()
def test_hidden_taps_match_manual_forward():
    m = tiny_model(5)
    ids = torch.randint(0, 97, (2, 9))
    logits, hidden = m(ids, hidden_layers=(0, 1, 2))
    T = ids.shape[1]
    pos = torch.arange(T).expand(2, T)
    cos, sin = m.rope(pos)
    x = m.embed(ids)
    manual = [x]
    for blk in m.blocks:
        x = blk(x, cos, sin)
        manual.append(x)
    assert len(hidden) == 3
    for h, r in zip(hidden, manual):
        assert torch.allclose(h, r)
    assert torch.allclose(logits, m.head(m.norm(manual[-1])))
    # a subset comes back in layer order, whatever order it was asked in
    _, h2 = m(ids, hidden_layers=(2, 0))
    assert len(h2) == 2 and torch.allclose(h2[0], manual[0]) and torch.allclose(h2[1], manual[2])


def test_cache_overflow_and_long_prompt_errors():
    m = tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, m.cfg.max_seq_len + 1, dtype=torch.long))
    cache = m.new_cache(1, max_len=8)
    with pytest.raises(ValueError, match="overflow"):
        m(torch.zeros(1, 9, dtype=torch.long), cache)
    m(torch.zeros(1, 8, dtype=torch.long), cache)  # exactly full is fine
    assert cache.lengths.tolist() == [8]
    cache.rollback(torch.tensor([6]))  # 6 cached + 3 new: past the end, named on a CPU
    with pytest.raises(ValueError, match="overflow"):
        m(torch.zeros(1, 3, dtype=torch.long), cache)
    for b in (1, -1):  # a row that does not exist is an error, not an empty view
        with pytest.raises(IndexError, match="of a cache of 1 rows"):
            cache.row(b)


def test_rope_angles_are_position_times_theta_to_the_minus_2i_over_d():
    """RoPE's frequencies, checked against values worked out by hand (attention only sees
    relative positions, so a wrong frequency would pass every equality test of this file)."""
    cfg = Config(vocab_size=8, n_layer=1, n_head=1, n_kv_head=1, n_embd=4, mlp_hidden=8, max_seq_len=3, rope_theta=100.0)
    cos, sin = rope_table(cfg)  # head_dim 4: frequencies 100^0 = 1 and 100^(-2/4) = 0.1
    angles = torch.tensor([[0.0, 0.0], [1.0, 0.1], [2.0, 0.2]])
    assert torch.allclose(cos, angles.cos()) and torch.allclose(sin, angles.sin())


def test_rope_rotates_so_that_scores_depend_on_the_offset_alone():
    """apply_rope turns each pair (i, i + D/2) by its angle: lengths are kept and q(s) . k(t)
    depends on t - s only. The cached and naive forwards share apply_rope, so their equality
    cannot see a wrong sign here (that only changes which model it is)."""
    cfg = Config(vocab_size=8, n_layer=1, n_head=1, n_kv_head=1, n_embd=8, mlp_hidden=8, max_seq_len=12)
    cos, sin = (t[None, None] for t in rope_table(cfg))  # (1, 1, T, D/2)
    g = torch.Generator().manual_seed(0)
    q, k = (apply_rope(torch.randn(8, generator=g).expand(1, 1, 12, 8), cos, sin)[0, 0] for _ in range(2))
    assert torch.allclose(q.norm(dim=-1), q[0].norm().expand(12), atol=1e-5)  # position 0 is unrotated
    scores = q @ k.T  # (T, T): scores[s, t] = q(s) . k(t)
    assert torch.allclose(scores[1:, 1:], scores[:-1, :-1], atol=1e-5)


def test_temperature_and_top_k_warp():
    """Sampling tests compare against distributions built with the same warp, so the warp itself
    is checked here: logits / T, then only the k largest keep mass."""
    from model import logits_to_probs
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(logits_to_probs(logits, 0.5), torch.softmax(2 * logits, -1), atol=1e-6)
    p = logits_to_probs(logits, 1.0, top_k=3)
    assert ((p > 0).sum(-1) == 3).all()
    top = logits.topk(3, -1)
    assert torch.allclose(p.gather(-1, top.indices), torch.softmax(top.values, -1), atol=1e-6)


def test_draw_takes_each_token_at_its_probability_and_never_a_zero_one(monkeypatch):
    """model.draw (inverse CDF) stands in for torch.multinomial everywhere decoding samples."""
    from model import draw
    probs = torch.tensor([0.0, 0.1, 0.0, 0.5, 0.4, 0.0])  # zeros first, inside and last
    N = 200_000
    draws = draw(probs.expand(N, 6), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).double() / N
    assert freq[[0, 2, 5]].sum() == 0
    assert (freq - probs).abs().max() < 0.006  # ~5 standard errors at p = 0.5
    # batch dims pass through: (2, 3, V) -> (2, 3), one-hot rows give their token
    rows = torch.tensor([[1, 4, 5], [0, 2, 3]])
    assert draw(torch.eye(6)[rows]).tolist() == rows.tolist()
    # the ends of u: 0 gives the first token with mass, and even u = 1 (which torch.rand never
    # returns, but u * total may round up to total) gives the last one, not the zero after it
    for u, token in ((0.0, 1), (1.0, 4)):
        monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, u, dtype=torch.float64))
        assert draw(probs[None]).tolist() == [token]
    # the running sum is float64: a token of probability 2^-40 keeps its own sliver of u (in
    # float32 0.5 + 2^-40 == 0.5, and it could never be drawn)
    tiny = torch.tensor([0.5, 2.0 ** -40, 0.5 - 2.0 ** -40], dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, 0.5 + 2.0 ** -41, dtype=torch.float64))
    assert draw(tiny[None]).tolist() == [1]


def test_rope_tables_stay_float32_in_bfloat16():
    """model.to(bfloat16) must not round the RoPE tables (cuda.kv_inject takes them in float32);
    a bf16 forward still runs and rotates in float32."""
    m = tiny_model().to(torch.bfloat16)
    cos, sin = rope_table(m.cfg)
    assert torch.equal(m.rope_cos, cos) and torch.equal(m.rope_sin, sin)  # not rounded, not just widened
    assert m.head.weight.dtype == torch.bfloat16
    logits = m(torch.tensor([[1, 2, 3]]))[0]
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert torch.equal(m.float().rope_cos, cos)  # and back


def test_a_full_context_forward_without_a_cache():
    """train.py's default --seq-len is the model's max_seq_len."""
    m = tiny_model()
    logits, _ = m(torch.zeros(1, m.cfg.max_seq_len, dtype=torch.long))
    assert logits.shape[1] == m.cfg.max_seq_len


def test_naive_generate_slides_past_the_context():
    m = tiny_model()
    T = m.cfg.max_seq_len
    prompt = [1, 2, 3] * ((T - 4) // 3)  # 8 new tokens run 4 past the context
    out = generate(m, prompt, 8)
    ids = prompt + out[:-1]
    assert len(out) == 8 and out[-1] == int(m(torch.tensor([ids[-T:]]))[0][0, -1].argmax())
    # every token from exactly the last T tokens: the last token of the repeating prompt above
    # came out the same from a window one token short; every token of a random prompt does not
    prompt = torch.randint(0, 97, (T - 2,), generator=torch.Generator().manual_seed(0)).tolist()
    out = generate(m, prompt, 8)
    ids = prompt + out
    assert out == [int(m(torch.tensor([ids[:i][-T:]]))[0][0, -1].argmax()) for i in range(T - 2, T + 6)]


def test_naive_generate_refuses_a_negative_temperature():
    """It took T < 0 (and NaN) as greedy without a word; speculate.generate refuses them."""
    m = tiny_model()
    for T in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            generate(m, [1, 2], 4, temperature=T)


def test_draft_preset_shares_its_targets_context():
    assert PRESETS["cpu-draft"]["max_seq_len"] == PRESETS["cpu"]["max_seq_len"]


def test_residual_output_projections_start_scaled_down_by_depth():
    """GPT-2's init: the projections that write into the residual stream (attention's wo, the
    MLP's w_down) start at std 0.02 / sqrt(2 n_layer), so the stream's variance at init does not
    grow with depth; every other matrix at 0.02. Dropping the scaling passed every other test."""
    cfg = Config(vocab_size=97, **PRESETS["cpu"])
    torch.manual_seed(0)
    m = Transformer(cfg)
    for name, p in m.named_parameters():
        if p.dim() == 2:
            want = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("wo.weight", "w_down.weight")) else 0.02
            assert abs(p.std().item() / want - 1) < 0.05, (name, p.std().item(), want)


@torch.no_grad()
def test_every_parameter_of_the_target_shapes_its_logits():
    """Each weight must reach the output. Cached == naive and the hidden-tap test compare the
    model with itself, so a layer that reads the wrong weight keeps them equal: keys normed by
    q_norm instead of k_norm, or an MLP fed without mlp_norm, leave that norm's weight unused
    (the committed weights then run as a model they were never trained as)."""
    m = tiny_model()
    ids = torch.arange(1, 13)[None] % 97
    base = m(ids)[0]
    g = torch.Generator().manual_seed(0)
    for name, p in m.named_parameters():
        saved = p.clone()
        p.add_(torch.randn(p.shape, generator=g) * 0.5)
        changed = not torch.allclose(m(ids)[0], base)
        p.copy_(saved)
        assert changed, f"{name} does not affect the logits"


def test_naive_generate_keeps_only_the_top_k_when_sampling():
    """The reference decoder must sample from the same warped distribution as speculate.generate:
    with top_k=1 sampling is greedy decoding, at any temperature. Dropping top_k on its way to
    logits_to_probs sampled from the whole vocabulary without a word (only greedy output was
    compared with it)."""
    m = tiny_model()
    greedy = generate(m, [1, 2, 3], 12)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        assert generate(m, [1, 2, 3], 12, temperature=5.0, top_k=1, generator=g) == greedy


@torch.no_grad()
def test_the_models_rope_lookup_rotates_q_and_k_by_their_offset():
    """model.rope(pos) reads cos AND sin of the tables at each position: scores of the model's own
    q and k projections depend on the offset alone. The RoPE tests above check rope_table and
    apply_rope; a lookup that read sin from the cos table (or the rows at other positions) kept
    cached == naive and every other test of this file green."""
    m = tiny_model()
    attn = m.blocks[0].attn
    x = torch.randn(1, 2, m.cfg.n_embd, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_table(m.cfg)

    def score(s, t):  # query at position s (token 0), key at position t (token 1), head 0
        c, sn = m.rope(torch.tensor([[s, t]]))
        assert torch.equal(c[0, 0], cos[[s, t]]) and torch.equal(sn[0, 0], sin[[s, t]])
        q, (k, _) = attn.project_q(x, c, sn), attn.project_kv(x, c, sn)
        return float(q[0, 0, 0] @ k[0, 0, 1])

    assert score(3, 1) == pytest.approx(score(40, 38), abs=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-4)  # and the offset does matter
