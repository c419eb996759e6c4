"""
One lossless verification loop for every drafter: greedy and sampling, batch > 1 with
ragged acceptance (DESIGN.md sec. 5). Notation follows Leviathan et al. 2023
(arXiv 2211.17192): p = target, q = draft.

One step, per row:
  1. the drafter proposes d_1..d_K and, when sampling, the distributions q_1..q_K
  2. the target runs once over [x_last, d_1..d_K] (K+1 positions) -> p_1..p_{K+1}
  3. accept d_i while u_i < min(1, p_i(d_i) / q_i(d_i))      (greedy: while d_i == argmax p_i)
  4. at the first rejection i emit a token from norm(max(0, p_i - q_i)); if all K were
     accepted emit the "bonus" token from p_{K+1}. So every step commits accepted + 1 tokens.
  5. roll the target's KV cache back to the committed length - 1 (O(1), per row): the emitted
     token is not fed yet
This is lossless for any q: greedy output equals plain greedy decoding token for token, and
sampled output has exactly the target's distribution.

State invariant used by the loop and every drafter: a row has N committed tokens x_0..x_{N-1};
the target has *fed* (cached) x_0..x_{N-2}; x_{N-1} (the last bonus/residual token) is pending
and is the first token of the next verify pass.

The drafter interface (the one seam of this repo; draft_simple.py holds ngram and draft, mtp.py,
draft_eagle.py and draft_diffusion.py the others):
    hidden_layers                 target layers whose hidden states the drafter needs, increasing,
                                  each once; feats below are those states concatenated in that
                                  order (F = len(hidden_layers) * C)
    prefill(tokens, n, feats)     after the prompt pass; feats (B, T, F) for the padded prompts
                                  (a shorter row's positions n[b]-1.. are padding)
    propose(tokens, n, K, temperature, top_k, generator) -> drafts (B, K'), q (B, K', V) | None
                                  K' <= K; q None means q one-hot at each draft (argmax picks;
                                  lossless for sampled drafts too); else, when sampling, q must
                                  be the probabilities each draft was drawn from (checked);
                                  NO_DRAFT (-1) in a row's last slots marks its drafts as
                                  ending early (a suffix): that slot is rejected and its token
                                  drawn from p alone, so a row with fewer drafts decodes as it
                                  would alone
    update(tokens, n, feats, n_new)  feats (B, K'+1, F) of the verify pass; its first n_new (B,)
                                  positions are now fed for good (the old pending token and the
                                  accepted drafts; the emitted token has no features yet);
                                  tokens/n already updated
    refill(b, tokens, n, feats)   row b holds a new prompt (continuous batching): tokens[b, :n[b]]
                                  committed, the first n[b]-1 fed, feats (1, n[b]-1, F) theirs;
                                  forget the old prompt and catch up on this one, on row b alone
tokens is the (B, T_max) buffer of committed tokens and n (B,) their counts, the loop's: a
drafter reads them (and n_new), and generate refuses a call that wrote into one. Whatever a
drafter computed tentatively inside propose it rolls back itself. generate checks what propose
returns (README: "Write a drafter of your own" is a short example and lists the checks).

    python speculate.py --method dflash --prompt "def parse(" --check   # the committed weights

About 520 lines against DESIGN's ~350: the loop (generate) is ~200 of them (with continuous
batching), and the checks of its inputs and of what a drafter returns ~115 more; the reference
acceptance scan and the one-prompt CLI share the file. The drafters that read no target
features are draft_simple.py; which drafter a method name means, with which options, is
methods.py.
"""

import operator
import time

import torch
from torch.nn.attention import sdpa_kernel

from model import DECODING_ATTENTION, draw, logits_to_probs


# -----------------------------------------------------------------------------
# the acceptance rule

NO_DRAFT = -1  # a draft slot a row leaves empty (any negative token): never accepted, q = 0 there

def accept_scan_ref(p, drafts, q=None, uniforms=None):
    """Acceptance scan of DESIGN sec. 5, batched over rows, no per-row Python loop.

    p        (B, K+1, V)  target: raw logits when greedy (uniforms is None), else the warped
                          probabilities (the warp plain decoding samples from)
    drafts   (B, K)       draft tokens d_1..d_K; a negative one (NO_DRAFT) is an empty slot:
                          rejected, and the emitted token there comes from p alone
    q        (B, K, V)    the distributions the drafts were drawn from, or None when they were
                          argmax picks
    uniforms (B, K+1)     u[:, i] for the ratio test of draft i+1, u[:, K] to sample the
                          emitted token by inverse CDF; None means greedy
    returns  n_accepted (B,) int64 in [0, K], next_token (B,) int64
    """
    B, K1, V = p.shape
    K = K1 - 1
    if uniforms is None:  # greedy: p is one-hot at its argmax, so accept while d_i == argmax p_i
        best = p.argmax(-1)                                      # (B, K+1)
        ok = drafts == best[:, :K]                               # (B, K); never at NO_DRAFT
        n_acc = torch.cumprod(ok.long(), dim=1).sum(1)           # length of the accepted prefix
        # first mismatch i: the target's own token argmax p_i; all accepted: bonus argmax p_{K+1}
        return n_acc, best.gather(1, n_acc[:, None])[:, 0]
    p = p.float()
    has = drafts >= 0                                            # (B, K): not an empty slot
    d = drafts.clamp(min=0)                                      # in range for the gathers
    p_d = p[:, :K].gather(2, d[:, :, None])[..., 0]              # p_i(d_i)       (B, K)
    q_d = torch.ones_like(p_d) if q is None else q.float().gather(2, d[:, :, None])[..., 0]
    # u < min(1, p/q)  <=>  u * q < p   (no division; u < 1 so the min is implied)
    ok = (uniforms[:, :K] * q_d < p_d) & has                     # (B, K)
    n_acc = torch.cumprod(ok.long(), dim=1).sum(1)               # (B,)
    # the distribution the emitted token comes from, per row (0-based: p[:, n_acc] is the
    # target's distribution at the first rejected draft, or at the bonus position if n_acc = K):
    #   rejected (n_acc < K): residual norm(max(0, p - q)) there; with argmax drafts q is
    #   one-hot at the draft, so the residual is p with the draft removed; an empty slot has
    #   q = 0 there, so the token comes from p itself, as in plain decoding
    #   all accepted (n_acc = K): the bonus, straight from p_{K+1}
    p_n = p.gather(1, n_acc[:, None, None].expand(B, 1, V))[:, 0]   # (B, V)
    q_n = torch.zeros_like(p_n)                                  # no q beyond the drafts
    if K > 0:
        i = n_acc.clamp(max=K - 1)  # keeps the gather in range; the where below zeroes n_acc = K
        if q is None:
            q_n.scatter_(1, d.gather(1, i[:, None]), 1.0)
        else:
            q_n = q.float().gather(1, i[:, None, None].expand(B, 1, V))[:, 0]
        q_n = torch.where(((n_acc < K) & has.gather(1, i[:, None])[:, 0])[:, None], q_n, torch.zeros_like(q_n))
    r = (p_n - q_n).clamp(min=0)
    # NOTE: rejecting a real draft implies p_i(d_i) < q_i(d_i), and an empty slot leaves r = p,
    # so sum(r) > 0 in exact arithmetic; guard against rounding anyway by falling back to p.
    total = r.sum(-1, keepdim=True)
    r = torch.where(total > 0, r, p_n)
    # inverse CDF: the first index whose running sum exceeds u * total (zero-mass tokens can
    # never be that index, because their running sum equals the previous one)
    cdf = r.cumsum(-1)
    u = uniforms[:, K:K1] * cdf[:, -1:]
    nxt = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=V - 1)
    return n_acc, nxt


def accept_scan(p, drafts, q=None, uniforms=None):
    """cuda.accept_scan: the fused op on a GPU when the extension builds, else this file's
    reference (on CPU tensors by default, without building anything; DFLASH_CUDA_EXT=host or
    emu sends them through the extension's host loop or the emulated kernel, for the tests)."""
    import cuda
    return cuda.accept_scan(p, drafts, q, uniforms)


# -----------------------------------------------------------------------------
# the loop

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def q_sum_tol(dtype):
    """How far from 1 a row of q in this dtype may sum. A float32 softmax over V up to ~150k sums
    to 1 within 1.2e-5 (measured on CPU; ~1e-4 bounds other reduction orders), and 1e-3 leaves
    10x room over that while a q off by it moves the output by about as little. A q in a
    narrower dtype (the scan reads it as float32) adds its own rounding, at most eps/2 of the
    mass if all entries round one way (bf16: up to 1.9e-3 measured), hence + eps."""
    return 1e-3 + torch.finfo(dtype).eps


def proposal_ok(drafts, q, V):
    """When sampling, one boolean tensor (no sync of its own): every real draft (>= 0) is a
    token id below V and, with a q, its row of q is a distribution over the vocabulary that gives
    the draft mass. The scan trusts all of that: with log-probs every draft was accepted (the
    output 0.85 in TV from the target's distribution), 2q or negative entries bent the ratio
    test and the residual, NaN off the draft hid behind the residual's fallback to p, q(d) = 0
    accepted d always, d >= V indexed past p. Rows of empty slots (NO_DRAFT) are never read, so
    they may hold anything."""
    ok = drafts < V
    if q is not None:
        # NaN and inf fail min >= 0 or the sum, so "finite" needs no pass of its own
        q_d = q.gather(2, drafts.clamp(0, V - 1)[..., None])[..., 0]
        dist = (q.amin(-1) >= 0) & ((q.sum(-1, dtype=torch.float32) - 1).abs() <= q_sum_tol(q.dtype)) & (q_d > 0)
        ok &= dist | (drafts < 0)
    return ok.all()


def proposal_mistake(drafts, q, V):
    """What proposal_ok refused, in the drafter author's words (run only after it failed)."""
    if bool((drafts >= V).any()):
        return f"the drafter drafted token {int(drafts.max())}, past the vocabulary (ids 0..{V - 1}, NO_DRAFT = -1 " \
               f"for an empty slot)"
    has = drafts >= 0
    rows, q_d = q[has].float(), q.gather(2, drafts.clamp(min=0)[..., None])[..., 0][has]
    mass = rows.sum(-1)
    if not bool(torch.isfinite(rows).all()):
        why = "q holds NaN or inf"
    elif bool((rows < 0).any()):
        why = f"q holds negative entries (down to {float(rows.min()):.3g}): log-probabilities? softmax the logits"
    elif not bool((q_d > 0).all()):
        why = "q is 0 at a token the drafter drafted: drafts must be drawn from q"
    else:
        why = f"a row of q sums to {float(mass[(mass - 1).abs().argmax()]):.6g}, not 1 within " \
              f"{q_sum_tol(q.dtype):.1e} (the tolerance for {q.dtype})"
    return "drafter q must be probabilities over the vocabulary (finite, >= 0, each row summing to 1, > 0 at " \
           f"every real draft): {why}"


def versions(tensors):
    """Autograd's count of in-place writes to each tensor (its views' included): reading it
    costs nothing, no copy and no sync. Tensors made under torch.inference_mode keep none."""
    return [None if t.is_inference() else t._version for t in tensors]


def integer(name, v, low=None, what="an integer"):
    """v as an int (a numpy or 0-d tensor integer too): 2.0 or "4" would fail deep in torch or
    slice silently, and a list given as a stop token would never equal one."""
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be {what}, got {v!r}") from None
    if low is not None and v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")
    return v


def check_inputs(target, prompts, drafter, max_new_tokens, temperature, top_k, K, stop_token, batch_size):
    """generate's arguments, checked at its boundary and normalised: prompts as 1-D tensors,
    counts as ints, K the drafter's default_K when None, capped at its max_K, 0 without one."""
    V = target.cfg.vocab_size
    if isinstance(prompts, str) or any(isinstance(pr, str) for pr in prompts):
        raise ValueError("prompts are token ids, not text: encode it first, data.get_encoding().encode_ordinary(text)")
    if any(isinstance(pr, int) or getattr(pr, "ndim", None) == 0 for pr in prompts):  # a flat list of ids
        raise ValueError("prompts is a list of prompts, each a list of token ids: for one prompt, pass [ids]")
    if len(prompts) == 0 or any(len(pr) == 0 for pr in prompts):  # len: a (B, T) tensor is B prompts too
        raise ValueError("empty prompt list or empty prompt")
    prompts = [torch.as_tensor(pr) for pr in prompts]
    for i, pr in enumerate(prompts):  # else an IndexError deep in the embedding, or 1.5 read as 1
        if pr.ndim != 1 or pr.dtype.is_floating_point or pr.dtype.is_complex or pr.dtype == torch.bool \
                or not bool(((pr >= 0) & (pr < V)).all()):
            raise ValueError(f"prompt {i}: token ids must be integers in 0..{V - 1} (the target's vocabulary), "
                             f"one list per prompt")
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    max_new_tokens = integer("max_new_tokens", max_new_tokens, 1)
    top_k = None if top_k is None else integer("top_k", top_k, 1)
    batch_size = None if batch_size is None else integer("batch_size", batch_size, 1)
    if stop_token is not None:
        stop_token = integer("stop_token", stop_token, what="one token id (an integer)")
        if not 0 <= stop_token < V:
            raise ValueError(f"stop_token must be a token id in 0..{V - 1}, got {stop_token}")
    if drafter is None:
        return prompts, max_new_tokens, top_k, 0, stop_token, batch_size
    K = integer("draft length K", getattr(drafter, "default_K", 4) if K is None else K, 1)
    built_for = getattr(drafter, "target", target).cfg  # mtp, eagle, dflash use their target's embedding and head
    if built_for != target.cfg:  # else a shape error deep in torch
        raise ValueError(f"the drafter was built for a target of another shape ({built_for}), not this one "
                         f"({target.cfg}); load it for this target: load_drafter(method, target, folder)")
    if getattr(drafter, "vocab_size", V) != V:  # else an IndexError in one model's embedding
        raise ValueError(f"the drafter's vocabulary has {drafter.vocab_size} tokens, the target's {V}: "
                         f"both must use one tokenizer")
    if not all(0 <= l <= target.cfg.n_layer for l in drafter.hidden_layers):  # else no features, or a shape error
        raise ValueError(f"the drafter reads target layers {tuple(drafter.hidden_layers)}, but this target's are "
                         f"0..{target.cfg.n_layer} (0 the embeddings): was the drafter built for another target?")
    layers = list(drafter.hidden_layers)
    if layers != sorted(set(layers)):  # the target returns each layer once, in depth order (model.forward)
        raise ValueError(f"the drafter's hidden_layers {tuple(layers)} must increase, each layer once: the target "
                         f"returns them in depth order, once each, so a repeat or another order gets other features")
    return prompts, max_new_tokens, top_k, min(K, getattr(drafter, "max_K", K)), stop_token, batch_size


@torch.no_grad()
@sdpa_kernel(DECODING_ATTENTION)  # without cuDNN's attention: model.py says why
def generate(target, prompts, drafter=None, *, max_new_tokens, temperature=0.0, top_k=None, seed=None,
             K=None, stop_token=None, batch_size=None):
    """Speculative decoding of a list of prompts (token ids: lists, arrays or 1-D tensors, any lengths).
    drafter=None is plain autoregressive decoding through the same cache: the baseline.
    batch_size rows are decoded at once (default: all prompts). With fewer rows than prompts,
    a row whose prompt is done starts the next waiting one (continuous batching), so rows do
    not idle while the slowest of a fixed batch finishes.
    Returns (outputs, stats): outputs is a list of new-token lists (prompt excluded), one per
    prompt in order; stats["tau"] is new tokens per pass of a row, the prompt pass included.
    K (drafts per step) defaults to the drafter's default_K (else 4) and is capped at its max_K
    (dflash: its block - 1; mtp: its n_draft, by default its modules), as the drafter would cap it."""
    prompts, max_new_tokens, top_k, K, stop_token, batch_size = check_inputs(
        target, prompts, drafter, max_new_tokens, temperature, top_k, K, stop_token, batch_size)
    layers = tuple(drafter.hidden_layers) if drafter is not None else ()
    device, V = target.head.weight.device, target.cfg.vocab_size
    B = min(batch_size or len(prompts), len(prompts))
    longest = max(len(pr) for pr in prompts)
    # NOTE: the commit step never takes a row past its budget (n - lens <= max_new_tokens), but a
    # row at its budget, finished or not, still rides along in a verify pass over K+1 positions
    # from n-1, and the commit writes up to column n+K: hence K+1 positions of headroom.
    T_max = longest + max_new_tokens + K + 1
    if T_max > target.cfg.max_seq_len:
        raise ValueError(f"longest prompt ({longest} tokens) + {max_new_tokens} new tokens + {K + 1} "
                         f"positions of draft headroom exceeds the target's context of {target.cfg.max_seq_len}")
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    sampling = temperature > 0

    def call(name, *args, state, **kw):
        """drafter.<name>(*args, **kw). The tensors in state (tokens, n, n_new) are the loop's,
        the drafter's to read: a write into a committed token or a count changed the output or
        kept generate from returning. Counted, not prevented by a copy per pass (free, and loud)."""
        before = versions(state)
        out = getattr(drafter, name)(*args, **kw)
        if versions(state) != before:
            raise ValueError(f"the drafter's {name} wrote into the tokens, n or n_new it was given: they are the "
                             f"loop's committed tokens and counts, to read only (copy them to change them)")
        return out

    def pick(logits):  # one token per row from (B, V) logits, as plain decoding would
        if not sampling:
            return logits.argmax(-1)
        return draw(logits_to_probs(logits, temperature, top_k), g)

    tokens = torch.zeros(B, T_max, dtype=torch.long, device=device)  # committed tokens per row
    for b, pr in enumerate(prompts[:B]):
        tokens[b, :len(pr)] = pr
    lens = torch.tensor([len(pr) for pr in prompts[:B]], device=device)  # (B,) each row's prompt length
    n = lens.clone()
    cache = target.new_cache(B, max_len=T_max)
    # the prompt pass counts as a pass that yields one token (so plain decoding's tau is exactly
    # 1); verify_s also holds the drafter's prefill/update work, draft_s only its proposing;
    # accepted_per_position[i] counts passes whose first i+1 drafts were ALL accepted
    stats = dict(verify_passes=1, draft_s=0.0, verify_s=0.0, row_passes=[1] * B + [0] * (len(prompts) - B),
                 accepted_per_position=[0] * K, attempts_per_position=[0] * K)

    # prefill: the whole (right-padded) prompt, then each row rolls back to its own length
    _sync(device); t0 = time.perf_counter()
    logits, hidden = target(tokens[:, :max(len(pr) for pr in prompts[:B])], cache, hidden_layers=layers)
    cache.rollback(n)
    first = pick(logits[torch.arange(B), n - 1])
    tokens[torch.arange(B), n] = first
    n = n + 1
    done = torch.zeros(B, dtype=torch.bool, device=device)
    if stop_token is not None:
        done |= first == stop_token
    done |= n - lens >= max_new_tokens
    if drafter is not None:
        call("prefill", tokens, n, torch.cat(hidden, -1) if hidden else None, state=(tokens, n))
    _sync(device); stats["verify_s"] += time.perf_counter() - t0
    rows = torch.arange(B, device=device)

    # continuous batching: a finished row hands its tokens over and takes the next prompt
    outputs, slot, taken, next_prompt = [None] * len(prompts), list(range(B)), [False] * B, B

    def take(b):  # row b's prompt is done: keep its new tokens (cut at the stop token)
        out = tokens[b, len(prompts[slot[b]]):int(n[b])].tolist()[:max_new_tokens]
        if stop_token is not None and stop_token in out:
            out = out[:out.index(stop_token) + 1]
        outputs[slot[b]] = out
        taken[b] = True

    def start(b, i):  # prompt i into row b: a batch-1 prefill through row b's slice of the cache
        t0, pr = time.perf_counter(), prompts[i]
        tokens[b, :len(pr)] = pr
        logits, hidden = target(tokens[b:b + 1, :len(pr)], cache.row(b), hidden_layers=layers)
        cache.lengths[b] = len(pr)
        nxt = pick(logits[:, -1])
        tokens[b, len(pr)] = nxt[0]
        lens[b], n[b], slot[b], taken[b] = len(pr), len(pr) + 1, i, False
        done[b] = max_new_tokens == 1 or (stop_token is not None and bool(nxt[0] == stop_token))
        if drafter is not None:
            call("refill", b, tokens, n, torch.cat(hidden, -1) if hidden else None, state=(tokens, n))
        _sync(device); stats["verify_s"] += time.perf_counter() - t0  # a prefill, timed like the first
        stats["verify_passes"] += 1
        stats["row_passes"][i] = 1
        return bool(done[b])

    def retire():
        nonlocal next_prompt
        for b, d in enumerate(done.tolist()):
            while d and not taken[b]:
                take(b)
                if next_prompt < len(prompts):
                    d = start(b, next_prompt)
                    next_prompt += 1

    retire()
    while not all(taken):
        # 1. draft
        t0 = time.perf_counter()
        if drafter is None:
            drafts, q = torch.zeros(B, 0, dtype=torch.long, device=device), None
        else:
            drafts, q = call("propose", tokens, n, K, temperature=temperature, top_k=top_k, generator=g,
                             state=(tokens, n))
            if drafts.dim() != 2 or drafts.shape[0] != B or drafts.shape[1] > K or drafts.dtype != torch.long or \
                    (q is not None and (tuple(q.shape) != (*drafts.shape, V) or not q.dtype.is_floating_point)):
                raise ValueError(f"the drafter returned drafts {tuple(drafts.shape)} {drafts.dtype} and q "  # no sync
                                 f"{None if q is None else (tuple(q.shape), q.dtype)}; the loop takes int64 "
                                 f"({B}, K' <= {K}) and q None or floating (B, K', {V})")
            if any(taken):  # finished rows ride along (done == taken here, after retire())
                # they draft nothing (they commit nothing), and the pass is only as wide as the
                # longest row that drafts: ngram's matches and MTP's gate differ by row. Only
                # here, since reading the width back waits for the drafter (a sync on a GPU)
                drafts = torch.where(done[:, None], NO_DRAFT, drafts)
                width = int((drafts >= 0).any(0).sum())
                drafts, q = drafts[:, :width], (None if q is None else q[:, :width])
            # when sampling, the scan trusts q to be what the drafts were drawn from: check it in one
            # host sync, where the loop waits for the drafter anyway (_sync below); greedy reads
            # no q, and its drafts are checked in the pass's one transfer of counts
            if sampling and not bool(proposal_ok(drafts, q, V)):
                raise ValueError(proposal_mistake(drafts, q, V))
        Kd = drafts.shape[1]  # K' <= K
        _sync(device); t1 = time.perf_counter()
        # 2. verify: one target pass over [x_{N-1}, d_1..d_K'] per row (K' = Kd)
        # (an empty slot feeds token 0, a draft past the vocabulary V - 1, refused below: nothing
        # from it on is accepted, and the cache rolls back)
        x = torch.cat([tokens[rows, n - 1][:, None], drafts.clamp(0, V - 1)], 1)  # (B, K'+1)
        logits, hidden = target(x, cache, hidden_layers=layers)    # (B, K'+1, V)
        # 3-4. accept a prefix of the drafts, then one token of the target's own
        if sampling:
            p = logits_to_probs(logits, temperature, top_k)       # warp p exactly as pick() does
            u = torch.rand(B, Kd + 1, device=device, generator=g)
            n_acc, nxt = accept_scan(p, drafts, q, u)
        else:
            n_acc, nxt = accept_scan(logits, drafts)
        # finished rows commit nothing and stay where they are
        n_acc = torch.where(done, torch.zeros_like(n_acc), n_acc)
        n_new = torch.where(done, torch.zeros_like(n_acc), n_acc + 1)
        # never commit past a row's budget: the excess would be cut anyway, and a finished row
        # keeps riding along in the batch, so its n must stay within the T_max buffers
        n_new = torch.minimum(n_new, max_new_tokens - (n - lens))
        # commit d_1..d_{n_acc} and then the emitted token, per row: new is [d_1..d_{n_acc},
        # emitted, ...], keep admits its first n_new slots, other columns keep their old value
        cols = n[:, None] + torch.arange(Kd + 1, device=device)    # (B, K'+1)
        new = torch.cat([drafts, nxt[:, None]], 1)
        new.scatter_(1, n_acc[:, None], nxt[:, None])               # slot n_acc holds the emitted token
        keep = torch.arange(Kd + 1, device=device)[None] < n_new[:, None]
        tokens.scatter_(1, cols, torch.where(keep, new, tokens.gather(1, cols)))
        # 5. rollback: the target has now fed everything but the last committed token
        n = n + n_new
        cache.rollback(n - 1)
        if drafter is not None:
            call("update", tokens, n, torch.cat(hidden, -1) if hidden else None, n_new, state=(tokens, n, n_new))
        _sync(device); t2 = time.perf_counter()
        stats["draft_s"] += t1 - t0
        stats["verify_s"] += t2 - t1
        stats["verify_passes"] += 1
        # per-position acceptance over the active rows that drafted there, and whether a draft
        # was past the vocabulary (greedy never accepts one), moved to the host in one transfer
        active = ~done
        drafted = (drafts >= 0) & active[:, None]                   # (B, K')
        accepted = ((n_acc[:, None] > torch.arange(Kd, device=device)) & drafted).sum(0)
        host = torch.cat([active.long(), drafted.sum(0), accepted, drafts.amax(0)]).tolist()
        active, attempts, accepted, top = host[:B], host[B:B + Kd], host[B + Kd:B + 2 * Kd], host[B + 2 * Kd:]
        if max(top, default=0) >= V:
            raise ValueError(proposal_mistake(drafts, q, V))
        for b, a in enumerate(active):
            stats["row_passes"][slot[b]] += a
        for i in range(Kd):
            stats["attempts_per_position"][i] += attempts[i]
            stats["accepted_per_position"][i] += accepted[i]
        # rows finish on their token budget or on the stop token (among what they just committed)
        if stop_token is not None:
            done |= (keep & (new == stop_token)).any(1)
        done |= n - lens >= max_new_tokens
        retire()

    stats["tokens_per_row"] = [len(o) for o in outputs]
    stats["new_tokens"] = sum(stats["tokens_per_row"])
    stats["tau"] = stats["new_tokens"] / sum(stats["row_passes"])
    stats["acceptance_per_position"] = [a / max(t, 1) for a, t in
                                        zip(stats["accepted_per_position"], stats["attempts_per_position"])]
    return outputs, stats
