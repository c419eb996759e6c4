"""
The committed reference weights (weights/cpu) still draft well.

Every other test checks that speculative decoding is lossless, which a drafter that drafts
badly still is: a DFlash that kept the wrong block slots stayed token-identical while its tau
here fell from 4.36 to 1.02 at T = 0. Each drafter runs on the first 4 committed held-out
prompts (data.reference_prompts, the same on every machine), 48 tokens each, at T = 0 and
T = 1, and its tau must stay above a floor well below what it measured
(2026-12-02, a 2-core CI-class CPU; T = 0 is deterministic, and over 12 seeds at T = 1 each
floor sat at least 3.5 standard deviations below the mean, in case another machine's rounding
changes a sampled token).

    python -m pytest -q tests/test_weights.py
"""

import os

import pytest

import speculate
from draft_diffusion import DFlash
from data import MASK, WEIGHTS_DIR, get_encoding, reference_prompts
from model import load_target

W = os.path.join(WEIGHTS_DIR, "cpu")
CASES = [  # (method, T, tau measured, floor asserted); ngram at T = 1 accepts ~nothing by nature
    ("ngram", 0.0, 1.88, 1.4),
    ("draft", 0.0, 1.28, 1.1), ("draft", 1.0, 1.47, 1.1),
    ("mtp", 0.0, 3.20, 2.4), ("mtp", 1.0, 2.34, 1.8),
    ("eagle", 0.0, 4.68, 3.3), ("eagle", 1.0, 2.87, 2.0),
    ("dflash", 0.0, 4.36, 3.0), ("dflash", 1.0, 2.02, 1.5),
]


@pytest.fixture(scope="module")
def setup():
    if not os.path.exists(os.path.join(W, "target.pt")):
        pytest.skip("no committed weights/cpu")
    target = load_target(os.path.join(W, "target.pt"))
    enc = get_encoding()
    return target, [enc.encode_ordinary(p) for p in reference_prompts(4)]


@pytest.mark.parametrize("method, T, measured, floor", CASES)
def test_each_committed_drafter_keeps_its_acceptance(setup, method, T, measured, floor):
    target, prompts = setup
    drafter = speculate.load_drafter(method, target, W)
    K = getattr(drafter, "default_K", 7)
    _, st = speculate.generate(target, prompts, drafter, max_new_tokens=48, K=K, temperature=T, seed=0,
                               batch_size=1)
    assert st["tau"] >= floor, f"{method} T={T}: tau {st['tau']:.2f} (measured {measured})"


def test_committed_dflash_fills_its_block_with_the_tokenizers_mask(setup):
    """The masked slots must hold <|mask|> (DFlash's default is the last id, which data.py makes
    it): a block of any other token drafts in another input distribution than it trained on."""
    mask = get_encoding().encode_single_token(MASK)
    assert speculate.load_drafter("dflash", setup[0], W).dflash.mask_id == mask  # the committed one
    assert DFlash(setup[0].cfg).mask_id == mask                                   # what train_drafter makes
