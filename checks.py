"""
What speculate.generate checks at its boundary: its arguments, and what a drafter's propose
returns (a q of log-probabilities, or one that gives its draft no mass, breaks losslessness).
"""

import operator

import torch


def check_proposal(drafts, q, B, K, V, sampling):
    """What the loop trusts of propose: int64 drafts (B, K' <= K) and, when sampling, q (B, K', V)
    the probability rows each real draft was drawn from. Shapes are checked here; the values,
    when sampling, by the returned 0-dim bool tensor, which the loop reads back with the rest of
    its step (no host sync of its own) and refuses with BAD_Q. Greedy: a True one."""
    q_ok = q is None or (tuple(q.shape) == (*drafts.shape, V) and q.dtype.is_floating_point)
    if not (drafts.dim() == 2 and drafts.shape[0] == B and drafts.shape[1] <= K and
            drafts.dtype == torch.long and q_ok):
        raise ValueError(f"the drafter returned drafts {tuple(drafts.shape)} {drafts.dtype} and q "
                         f"{None if q is None else (tuple(q.shape), q.dtype)}; the loop takes "
                         f"int64 ({B}, K' <= {K}) and q None or floating (B, K', {V})")
    if not sampling:
        return torch.ones((), dtype=torch.bool, device=drafts.device)
    ok = drafts < V
    if q is not None:  # NaN and inf fail min >= 0 or the sum
        q_d = q.gather(2, drafts.clamp(0, V - 1)[..., None])[..., 0]
        tol = 1e-3 + torch.finfo(q.dtype).eps  # fp32 softmax over 150k: ~1e-4 off; bf16 more
        dist = (q.amin(-1) >= 0) & (q_d > 0) & ((q.sum(-1, dtype=torch.float32) - 1).abs() <= tol)
        ok &= dist | (drafts < 0)  # rows of q at empty slots are never read
    return ok.all()


BAD_Q = ("the drafter's q must be probabilities over the {V} tokens (finite, >= 0, rows summing "
         "to 1) that give each draft (< {V}) mass")


def check_inputs(target, prompts, drafter, max_new_tokens, temperature, top_k, K, stop_token,
                 batch_size):
    """generate's arguments -> prompts as 1-D tensors and K (when None the drafter's default_K,
    else 4; capped at its max_K; 0 without a drafter)."""
    V = target.cfg.vocab_size
    if isinstance(prompts, str) or any(isinstance(pr, (str, int)) for pr in prompts):
        raise ValueError("prompts is a list of prompts, each a list of token ids")
    prompts = [torch.as_tensor(pr) for pr in prompts]
    if not prompts or any(pr.ndim != 1 or len(pr) == 0 or pr.is_floating_point() or
                          pr.dtype == torch.bool or not bool(((pr >= 0) & (pr < V)).all())
                          for pr in prompts):
        raise ValueError(f"empty prompt list or prompt, or token ids not integers in 0..{V - 1}")
    for name, v in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("K", K),
                    ("batch_size", batch_size)):
        if v is not None and operator.index(v) < 1:  # operator.index: 2.0 or "4" is refused
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not 0 <= temperature < float("inf"):  # NaN too
        raise ValueError(f"temperature must be >= 0 and finite, got {temperature}")
    if stop_token is not None and not 0 <= operator.index(stop_token) < V:
        raise ValueError(f"stop_token must be a token id in 0..{V - 1}, got {stop_token}")
    if drafter is None:
        return prompts, 0
    built_for = getattr(drafter, "target", target).cfg  # feature drafters use its embed and head
    if built_for != target.cfg or getattr(drafter, "vocab_size", V) != V:
        raise ValueError("the drafter was built for another target's shape or vocabulary")
    layers = list(drafter.hidden_layers)
    if layers != sorted(set(layers)) or not all(0 <= l <= target.cfg.n_layer for l in layers):
        raise ValueError(f"the drafter's hidden_layers {tuple(layers)} must increase, each once, "
                         f"within this target's 0..{target.cfg.n_layer}")
    K = getattr(drafter, "default_K", 4) if K is None else K
    return prompts, min(K, getattr(drafter, "max_K", K))
