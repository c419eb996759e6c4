"""
One lossless verification loop for every drafter (DESIGN.md sec. 5). Notation follows Leviathan
et al. 2023 (arXiv 2211.17192): p = target, q = draft.

The invariant of the loop and every drafter: a row has N committed tokens x_0..x_{N-1} (n (B,)
in the code); the target has fed (cached) x_0..x_{N-2}; x_{N-1} (the last emitted token) is
pending and is the first token of the next verify pass.

One step, per row:
  1. the drafter proposes d_1..d_K and, when sampling, the distributions q_1..q_K
  2. one target pass over [x_{N-1}, d_1..d_K] -> p_1..p_{K+1} (p_i: output at the token before d_i)
  3. accept d_i while u_i < min(1, p_i(d_i) / q_i(d_i))      (greedy: while d_i == argmax p_i)
  4. at the first rejection i emit a token from norm(max(0, p_i - q_i)); if all K were
     accepted emit the "bonus" token from p_{K+1}. So every step commits accepted + 1 tokens.
  5. roll the target's KV cache back to the committed length - 1 (O(1), per row): the kept
     entries saw only accepted tokens (causal mask), and the emitted one is not fed yet
This is lossless for any q: greedy output equals plain greedy decoding token for token, and
sampled output has exactly the target's distribution.

The drafter interface, the one seam of this repo (draft_simple.py, mtp.py, draft_eagle.py and
draft_diffusion.py implement it). tokens (B, T_buf) are the loop's committed tokens and n (B,)
their counts, to read only (T_buf: the longest row's need, or the context when compiled); feats
are the target's hidden states at the drafter's hidden_layers, concatenated (B, T, layers * C):
    hidden_layers                 target layers the drafter reads, increasing, each once
    prefill(tokens, n, feats)     after the prompt pass (a shorter row's tail is padding)
    propose(tokens, n, K, temperature, top_k, generator) -> drafts (B, K' <= K), q (B, K', V)
                                  or None (argmax picks: q one-hot). NO_DRAFT (-1) in a row's
                                  last slots ends its drafts early. Compiled, generator is
                                  float64 uniforms (B, K, 1), slot i's [:, i] (model.draw)
    update(tokens, n, feats, n_new)  feats of the verify pass; its first n_new (B,) positions
                                  are now fed for good. Whatever propose did tentatively, the
                                  drafter rolls back itself
    refill(b, tokens, n, feats)   row b holds a new prompt (continuous batching)
Optional: default_K and max_K (drafts per step), vocab_size, target (the target it was built
for), params(), static_shapes (True: compiled, propose has one shape for a batch size and K and
reads nothing back to the host, so generate(compile=True) compiles it).

    python sample.py --method dflash --prompt "def parse(" --check
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

import dflash_kernels as kernels
from checks import BAD_Q, check_inputs, check_proposal
from kv_cache import kept
from model import DECODING_ATTENTION, draw, logits_to_probs

NO_DRAFT = -1  # a draft slot a row leaves empty (any negative token): never accepted, q = 0 there


# --- the simplest version: one prompt, no checks, no statistics -----------------------------------

@torch.no_grad()
@sdpa_kernel(DECODING_ATTENTION)  # without cuDNN's attention: model.py says why
def generate_one(target, prompt, drafter=None, *, max_new_tokens, K=4, temperature=0.0, seed=None):
    """The whole loop for one prompt (list of ids) -> its new tokens. The tests hold it equal to
    generate below token for token, greedy and sampled (same seed, same random draws)."""
    device, layers = target.head.weight.device, tuple(getattr(drafter, "hidden_layers", ()))
    K = min(K, getattr(drafter, "max_K", K)) if drafter else 0
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    pick = (lambda lg: lg.argmax(-1)) if temperature == 0 else \
        (lambda lg: draw(logits_to_probs(lg, temperature), g))
    P = len(prompt)
    tokens = torch.zeros(1, P + max_new_tokens + K + 1, dtype=torch.long, device=device)
    tokens[0, :P] = torch.tensor(prompt)
    cache = target.new_cache(1, max_len=tokens.shape[1])
    logits, hidden = target(tokens[:, :P], cache, hidden_layers=layers)   # the prompt pass
    tokens[0, P] = pick(logits[:, -1])[0]                                 # x_{N-1}: pending
    n = torch.tensor([P + 1], device=device)
    if drafter:
        drafter.prefill(tokens, n, torch.cat(hidden, -1) if hidden else None)
    while int(n) - P < max_new_tokens:
        # 1. draft
        drafts, q = torch.zeros(1, 0, dtype=torch.long, device=device), None
        if drafter:
            drafts, q = drafter.propose(tokens, n, K, temperature=temperature, generator=g)
        # 2. verify: one target pass over [x_{N-1}, d_1..d_K] (NO_DRAFT fed as 0, never accepted)
        x = torch.cat([tokens[:, int(n) - 1:int(n)], drafts.clamp(min=0)], 1)
        logits, hidden = target(x, cache, hidden_layers=layers)          # (1, K+1, V)
        # 3-4. accept_scan (below): a prefix of the drafts, then one token of the target's own
        if temperature == 0:
            n_acc, nxt = accept_scan(logits, drafts)
        else:
            u = torch.rand(1, drafts.shape[1] + 1, dtype=torch.float64, device=device, generator=g)
            n_acc, nxt = accept_scan(logits_to_probs(logits, temperature), drafts, q, u)
        a = int(n_acc)
        tokens[0, int(n):int(n) + a + 1] = torch.cat([drafts[0, :a], nxt])
        n = n + a + 1
        # 5. roll back: the target has fed everything but the last committed token
        cache.rollback(n - 1)
        if drafter:
            drafter.update(tokens, n, torch.cat(hidden, -1) if hidden else None, n_acc + 1)
    return tokens[0, P:P + max_new_tokens].tolist()


# --- the acceptance rule --------------------------------------------------------------------------

def accept_scan_ref(p, drafts, q=None, uniforms=None):
    """Acceptance scan of DESIGN sec. 5, batched over rows, no per-row Python loop.

    p        (B, K+1, V)  target: raw logits when greedy (uniforms is None), else the warped
                          probabilities (the warp plain decoding samples from)
    drafts   (B, K)       draft tokens d_1..d_K; a negative one (NO_DRAFT) is an empty slot:
                          rejected, and the emitted token there comes from p alone
    q        (B, K, V)    the distributions the drafts were drawn from, or None when they were
                          argmax picks
    uniforms (B, K+1)     u[:, i] for the ratio test of draft i+1, u[:, K] to sample the
                          emitted token by inverse CDF; None means greedy. float64, as the
                          CDF: float32's grid of 2^-24 put the emitted token off p by a total
                          variation of 4e-5 at V = 4,098 and 0.0015 at Qwen's 151,936
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
    if uniforms.dtype != torch.float64:  # as the kernel: float32's grid is off p (above)
        raise ValueError(f"accept_scan: uniforms must be float64, got {uniforms.dtype}")
    p = p.float()
    has = drafts >= 0                                            # (B, K): not an empty slot
    d = drafts.clamp(min=0)                                      # in range for the gathers
    p_d = p[:, :K].gather(2, d[:, :, None])[..., 0]              # p_i(d_i)       (B, K)
    q_d = torch.ones_like(p_d) if q is None else q.float().gather(2, d[:, :, None])[..., 0]
    # u < min(1, p/q)  <=>  u * q < p   (no division; u < 1 so the min is implied)
    ok = (uniforms[:, :K] * q_d < p_d) & has                     # (B, K)
    n_acc = torch.cumprod(ok.long(), dim=1).sum(1)               # (B,)
    # the emitted token comes from norm(max(0, p - q)) at slot n_acc (0-based): the first
    # rejected draft (argmax drafts: q one-hot, so p without the draft; an empty slot: q = 0, so
    # p itself), or the bonus: drafts and q get one more slot, NO_DRAFT with q = 0, so at
    # n_acc = K the same gather gives p_{K+1}
    at_n = n_acc[:, None, None].expand(B, 1, V)
    p_n = p.gather(1, at_n)[:, 0]                                # (B, V)
    d_n = F.pad(drafts, (0, 1), value=NO_DRAFT).gather(1, n_acc[:, None])   # (B, 1)
    q_n = (torch.zeros_like(p_n).scatter_(1, d_n.clamp(min=0), 1.0) if q is None  # argmax: one-hot
           else F.pad(q.float(), (0, 0, 0, 1)).gather(1, at_n)[:, 0])             # (B, V)
    q_n = torch.where(d_n >= 0, q_n, 0.0)                        # no draft there: q = 0
    r = (p_n - q_n).clamp(min=0)
    # NOTE: rejecting a real draft implies p_i(d_i) < q_i(d_i), and an empty slot leaves r = p,
    # so sum(r) > 0 in exact arithmetic; guard against rounding anyway by falling back to p.
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, p_n)
    # inverse CDF in float64, as plain decoding draws (no mass at all: V - 1, as the kernel)
    return n_acc, draw(r, u=uniforms[:, K:K1]).clamp(max=V - 1)


def accept_scan(p, drafts, q=None, uniforms=None):
    """accept_scan_ref, or its fused kernel where the extension serves p's device (a GPU)."""
    if kernels.available(p.device):
        return kernels.accept_scan(p, drafts, q, uniforms)
    return accept_scan_ref(p, drafts, q, uniforms)


# --- the loop: a batch of ragged rows, continuous batching, checks and statistics -----------------

class StepClock:
    """Where the loop's time goes, with no host sync: mark(part) charges the time since the last
    mark to part ("draft", "verify" or "rest"). On a GPU the marks are CUDA events, read once at
    the end, so the parts split the device's timeline (idle gaps, where Python is the bottleneck,
    fall to the part whose work came next); elsewhere, the CPU's clock."""

    def __init__(self, device):
        self.cuda, self.marks = device.type == "cuda", []
        self.mark("start")

    def mark(self, part):
        now = time.perf_counter() if not self.cuda else torch.cuda.Event(enable_timing=True)
        if self.cuda:
            now.record()
        self.marks.append((part, now))

    def seconds(self):
        if self.cuda:
            self.marks[-1][1].synchronize()
        out = dict(draft_s=0.0, verify_s=0.0, rest_s=0.0)
        for (_, a), (part, b) in zip(self.marks, self.marks[1:]):
            out[part + "_s"] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out


def compiled(fn, owner, device):
    """torch.compile(fn) for generate(compile=True), kept on owner (the target, a drafter) per
    device. A GPU replays it as CUDA graphs (mode "reduce-overhead": one launch instead of
    hundreds), a CPU runs inductor's fused kernels; one compile per shape (~30 s on a CPU), and
    per drafter and temperature: past torch's limit of 8 it runs eager (a log line only), so 64."""
    fns = owner.__dict__.setdefault("_compiled", {})
    if device not in fns:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        mode = "reduce-overhead" if device.type == "cuda" else None
        fns[device] = torch.compile(fn, mode=mode, dynamic=False)
    return fns[device]


def static_step(target, B):
    """The target's compiled forward and one cache of B rows over its whole context, kept on the
    target and reused by every call (kept), so that a step's shapes, and on a GPU the cache's
    addresses, never change. One generate at a time per target: they would share the cache."""
    w = target.head.weight
    cache, = kept(target, (B, target.cfg.max_seq_len, w.dtype, w.device),
                  lambda: [target.new_cache(B)])
    return compiled(target.forward, target, w.device), cache


def headroom(K, tree=None):
    """Positions a row needs past prompt and budget: done or not, it rides along in a verify pass
    over K+1 positions from n-1 (a tree's N+1, if more); the commit writes up to column n+K."""
    return max(K, tree.N if tree is not None else 0) + 1


@torch.no_grad()
@sdpa_kernel(DECODING_ATTENTION)  # without cuDNN's attention: model.py says why
def generate(target, prompts, drafter=None, *, max_new_tokens, temperature=0.0, top_k=None,
             seed=None, K=None, stop_token=None, batch_size=None, tree=None, compile=False):
    """Speculative decoding of a list of prompts (token ids, any lengths). drafter=None is
    plain decoding through the same cache: the baseline. batch_size rows decode at once
    (default: all prompts); with fewer rows than prompts, a row whose prompt is done takes the
    next waiting one (continuous batching). K: drafts per step (default: the drafter's own).
    tree: a tree.DraftTree to verify a tree of DFlash's candidates instead of a chain (default:
    the drafter's .tree, which load_drafter("dflash-tree") sets, else none). compile: chain
    verify passes (static_step) and propose (where static_shapes) at one shape, compiled; greedy
    tokens as without, sampled ones other draws of p (padding takes more uniforms). -> (each
    prompt's new tokens, in order, cut after stop_token; stats): stats["tau"] is new tokens per
    pass of a row (the prompt pass included); draft_s, verify_s, rest_s: StepClock's split."""
    prompts, K = check_inputs(target, prompts, drafter, max_new_tokens, temperature, top_k, K,
                              stop_token, batch_size)
    layers = tuple(drafter.hidden_layers) if drafter is not None else ()
    tree = tree or getattr(drafter, "tree", None)
    if tree is not None and not hasattr(drafter, "block_logits"):  # DFlash's one-pass block
        raise ValueError("tree= verifies a tree of DFlash's candidates: it needs a DFlash drafter")
    compile = compile and tree is None  # a tree's pass stays eager: a full-context cache only costs
    device, V = target.head.weight.device, target.cfg.vocab_size
    B = min(batch_size or len(prompts), len(prompts))
    longest = max(len(pr) for pr in prompts)
    room = headroom(K, tree)
    T_max = longest + max_new_tokens + room
    if T_max > target.cfg.max_seq_len:
        raise ValueError(f"longest prompt ({longest} tokens) + {max_new_tokens} new tokens + "
                         f"{room} positions of draft headroom exceeds the target's context of "
                         f"{target.cfg.max_seq_len}")
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    sampling = temperature > 0
    stop = -1 if stop_token is None else stop_token  # -1: no committed token ever equals it
    feats = lambda hidden: torch.cat(hidden, -1) if hidden else None

    def pick(lg):  # one token per row from (B, V) logits, as plain decoding would
        return draw(logits_to_probs(lg, temperature, top_k), g) if sampling else lg.argmax(-1)

    T_buf = target.cfg.max_seq_len if compile else T_max  # compiled: one shape for any prompts
    tokens = torch.zeros(B, T_buf, dtype=torch.long, device=device)  # committed tokens per row
    for b, pr in enumerate(prompts[:B]):
        tokens[b, :len(pr)] = pr
    lens = torch.tensor([len(pr) for pr in prompts[:B]], device=device)  # (B,) prompt lengths
    n, rows, valid = lens.clone(), torch.arange(B, device=device), lens.new_ones((), dtype=bool)
    verify, cache = static_step(target, B) if compile else (target, target.new_cache(B, T_max))
    propose = getattr(drafter, "propose", None)
    if static := compile and getattr(drafter, "static_shapes", False):
        propose = compiled(drafter.propose, drafter, device)
    # the prompt pass counts as a pass that yields one token (so plain decoding's tau is 1);
    # accepted_per_position[i] counts passes whose first i+1 drafts were ALL accepted
    stats = dict(verify_passes=1, row_passes=[1] * len(prompts),
                 accepted_per_position=[0] * K, attempts_per_position=[0] * K)
    # time: the target's passes and the acceptance scan are "verify", all the drafter does
    # (prefill, propose, update) "draft", the commit and the bookkeeping "rest"
    clock = StepClock(device)

    # prefill: the whole (right-padded) prompt, then each row rolls back to its own length
    logits, hidden = target(tokens[:, :int(lens.max())], cache, hidden_layers=layers)
    cache.rollback(n)
    first = pick(logits[rows, n - 1])
    clock.mark("verify")
    tokens[rows, n] = first
    n = n + 1
    done = (n - lens >= max_new_tokens) | (first == stop)
    if drafter is not None:
        drafter.prefill(tokens, n, feats(hidden))
        clock.mark("draft")

    # continuous batching: a finished row hands its tokens over and takes the next prompt
    outputs, prompt_of, taken, next_prompt = [None] * len(prompts), list(range(B)), [False] * B, B

    def start(b, i):  # prompt i into row b: a batch-1 prefill through row b's slice of the cache
        pr = prompts[i]
        clock.mark("rest")
        tokens[b, :len(pr)] = pr
        logits, hidden = target(tokens[b:b + 1, :len(pr)], cache.row(b), hidden_layers=layers)
        cache.lengths[b] = len(pr)
        nxt = pick(logits[:, -1])
        clock.mark("verify")
        tokens[b, len(pr)] = nxt[0]
        lens[b], n[b], prompt_of[b], taken[b] = len(pr), len(pr) + 1, i, False
        done[b] = max_new_tokens == 1 or bool(nxt[0] == stop)
        if drafter is not None:
            drafter.refill(b, tokens, n, feats(hidden))
            clock.mark("draft")
        stats["verify_passes"] += 1
        return bool(done[b])

    def retire(finished):  # keep each finished row's new tokens (cut after the stop), refill it
        nonlocal next_prompt
        for b, d in enumerate(finished):
            while d and not taken[b]:  # while: a new prompt can be done at its first token
                out = tokens[b, len(prompts[prompt_of[b]]):int(n[b])].tolist()[:max_new_tokens]
                outputs[prompt_of[b]] = out[:out.index(stop) + 1] if stop in out else out
                taken[b] = True
                if next_prompt < len(prompts):
                    d = start(b, next_prompt)
                    next_prompt += 1

    retire(done.tolist())
    while not all(taken):
        # 1. draft
        clock.mark("rest")
        drafts, q = torch.zeros(B, 0, dtype=torch.long, device=device), None
        if tree is not None:  # the step up: a tree of drafts instead of a chain (tree.py)
            nodes = tree.draft(drafter, tokens, n, K, temperature, top_k, g)
        elif drafter is not None:
            # compiled, the drafts' uniforms come drawn: a generator in it would break its graph
            gen = (torch.rand(B, K, 1, dtype=torch.float64, device=device, generator=g)
                   if static and sampling else g)
            drafts, q = propose(tokens, n, K, temperature=temperature, top_k=top_k, generator=gen)
            valid = check_proposal(drafts, q, B, K, V, sampling)   # read back below
            if compile:  # one shape for every pass: K drafts, the missing ones empty
                drafts = F.pad(drafts, (0, K - drafts.shape[1]), value=NO_DRAFT)
                q = None if q is None else F.pad(q, (0, 0, 0, K - q.shape[1]))
            elif any(taken):  # finished rows ride along (done == taken here, after retire())
                # they draft nothing, and the pass is only as wide as the longest row that
                # drafts (ngram's matches and --confidence's cuts differ by row). Only here, as
                # reading the width back waits for the drafter (a sync on a GPU)
                drafts = torch.where(done[:, None], NO_DRAFT, drafts)
                width = int((drafts >= 0).any(0).sum())
                drafts, q = drafts[:, :width], (None if q is None else q[:, :width])
        clock.mark("draft" if drafter is not None else "rest")
        past_vocab = (drafts >= V).any(1)  # (B,) read back below; a tree drafts within V
        if tree is not None:  # 2-4 for a tree; its accepted path is committed as a chain's is
            drafts, n_acc, nxt, hidden = tree.verify(target, cache, tokens, n, nodes, layers,
                                                     temperature, top_k, g)
        else:
            # 2. verify: one target pass over [x_{N-1}, d_1..d_K'] per row (an empty slot
            # feeds token 0; a draft past the vocabulary, refused after the pass, is an empty
            # slot meanwhile: never accepted)
            drafts = torch.where(drafts < V, drafts, NO_DRAFT)
            x = torch.cat([tokens[rows, n - 1][:, None], drafts.clamp(min=0)], 1)
            logits, hidden = verify(x, cache, hidden_layers=layers)           # (B, K'+1, V)
            # 3-4. accept a prefix of the drafts, then one token of the target's own
            if sampling:
                p = logits_to_probs(logits, temperature, top_k)  # warped exactly as by pick()
                u = torch.rand(B, drafts.shape[1] + 1, dtype=torch.float64, device=device,
                               generator=g)
                n_acc, nxt = accept_scan(p, drafts, q, u)
            else:
                n_acc, nxt = accept_scan(logits, drafts)
        clock.mark("verify")
        Kd = drafts.shape[1]  # K' <= K
        # finished rows commit nothing; no row commits past its budget (a finished row keeps
        # riding along, so its n must stay within the T_max buffers)
        n_new = torch.minimum(torch.where(done, 0, n_acc + 1), max_new_tokens - (n - lens))
        # commit d_1..d_{n_acc} and then the emitted token, per row: new is [d_1..d_{n_acc},
        # emitted, ...], keep admits its first n_new slots, other columns keep their value
        cols = n[:, None] + torch.arange(Kd + 1, device=device)    # (B, K'+1)
        new = torch.cat([drafts, nxt[:, None]], 1)                  # K'+1 columns (the last: pad)
        new.scatter_(1, n_acc[:, None], nxt[:, None])               # slot n_acc: the emitted token
        keep = torch.arange(Kd + 1, device=device)[None] < n_new[:, None]
        tokens.scatter_(1, cols, torch.where(keep, new, tokens.gather(1, cols)))
        # 5. roll back: the target has now fed everything but the last committed token
        n = n + n_new
        cache.rollback(n - 1)
        if drafter is not None:
            clock.mark("rest")
            drafter.update(tokens, n, feats(hidden), n_new)
            clock.mark("draft")
        stats["verify_passes"] += 1
        # per-position acceptance over the active rows that drafted there, which rows are done,
        # whether a draft was past the vocabulary or q no distribution: one transfer to the
        # host (the loop's one per-step read, but for the width above when rows finished)
        active = ~done
        drafted = (drafts >= 0) & active[:, None]                   # (B, K')
        accepted = ((n_acc[:, None] > torch.arange(Kd, device=device)) & drafted).sum(0)
        # rows finish on their token budget or on the stop token (among what they committed)
        done |= (n - lens >= max_new_tokens) | (keep & (new == stop)).any(1)
        parts = [active, drafted.sum(0), accepted, done, past_vocab, valid[None]]
        host = torch.cat([x.long() for x in parts]).cpu().split([len(x) for x in parts])
        act, att, acc, fin, past_v, ok = (x.tolist() for x in host)
        if not ok[0]:
            raise ValueError(BAD_Q.format(V=V))
        if any(past_v):
            raise ValueError(f"the drafter drafted a token past the vocabulary (ids 0..{V - 1})")
        for b, a in enumerate(act):
            stats["row_passes"][prompt_of[b]] += a
        for i in range(Kd):
            stats["attempts_per_position"][i] += att[i]
            stats["accepted_per_position"][i] += acc[i]
        retire(fin)

    clock.mark("rest")
    stats.update(clock.seconds())
    stats["tokens_per_row"] = [len(o) for o in outputs]
    stats["new_tokens"] = sum(stats["tokens_per_row"])
    stats["tau"] = stats["new_tokens"] / sum(stats["row_passes"])
    stats["acceptance_per_position"] = [a / max(t, 1) for a, t in zip(
        stats["accepted_per_position"], stats["attempts_per_position"])]
    return outputs, stats
