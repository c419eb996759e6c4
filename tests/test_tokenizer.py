"""
Tests of dev/tokenizer.py, which makes the committed tokenizer.tiktoken and
weights/heldout_prompts.jsonl: the BPE trainer against a textbook one, the ranks it writes, its
command line's checks, and the committed prompts redrawn byte for byte (reference versions only).

    python -m pytest -q tests/test_tokenizer.py
"""
import os
import re
import runpy
import sys
from collections import Counter

import numpy as np
import pytest
import regex
import torch

import data
from dev import tokenizer

SCRIPT = os.path.join(data.ROOT, "dev", "tokenizer.py")
REFERENCE_ENV = (sys.version.split()[0], torch.__version__.split("+")[0], np.__version__)


def naive_bpe(text, vocab_size):
    """Textbook BPE, slow and obviously right: same tie-break (largest count, then smallest ids)."""
    words = [list(c.encode()) for c in regex.findall(data.PAT_STR, text)]
    vocab = [bytes([i]) for i in range(256)]
    while len(vocab) < vocab_size:
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        a, b = min(pairs, key=lambda p: (-pairs[p], p))
        merged = vocab[a] + vocab[b]
        if merged not in vocab:
            vocab.append(merged)
        t, new_words = vocab.index(merged), []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if w[i:i + 2] == [a, b]:
                    out.append(t); i += 2
                else:
                    out.append(w[i]); i += 1
            new_words.append(out)
        words = new_words
    return vocab


def test_bpe_trainer(tmp_path):
    # the 8-space indent makes "  " the clear winner (6 pairs per line), as in real code
    text = "def forward(self, x):\n        return self.proj(x)\n\n" * 40 + "lorem ipsum dolor sit amet\n" * 7
    vocab = tokenizer.train_bpe([text], 300, verbose=False)
    assert len(vocab) == 300 and len(set(vocab)) == 300
    assert vocab[:256] == [bytes([i]) for i in range(256)]
    # the first merge is the most frequent byte pair within the pre-split chunks
    pairs = Counter()
    for chunk in regex.findall(data.PAT_STR, text):
        b = chunk.encode()
        pairs.update(zip(b, b[1:]))
    (a, b), top = pairs.most_common(1)[0]
    assert pairs.most_common(2)[1][1] < top  # no tie, so the expectation is unambiguous
    assert vocab[256] == bytes([a, b])
    # every merge agrees with a naive trainer that recounts all pairs of all chunk occurrences
    assert vocab == naive_bpe(text, 300)
    path = tmp_path / "toy.tiktoken"
    tokenizer.write_ranks(vocab, path)
    toy = data.get_encoding(str(path))
    assert toy.n_vocab == 302 and toy.eot_token == 300
    for s in (text, "return self.proj(x) 🐍 unseen words"):
        assert toy.decode(toy.encode_ordinary(s)) == s
    assert len(toy.encode_ordinary(text)) < len(text.encode()) / 3  # it learned something
    assert toy.encode_ordinary(" self") == [vocab.index(b" self")]


def test_bpe_stops_when_no_pair_is_left():
    # chunks "ab" and " ab": after the merges "ab" and " ab" every pair count is 0, and a pair
    # whose count fell to 0 must not be merged (the vocabulary asked for is far larger)
    assert tokenizer.train_bpe(["ab ab"], 1000, verbose=False)[256:] == [b"ab", b" ab"]


def test_train_tokenizer_reports_each_size_and_writes_the_ranks(tmp_path, capsys):
    for s in ("a", "b"):
        (tmp_path / f"{s}.py").write_text(f"def {s}():\n    return 1\n")
    files = {"train": [("a", str(tmp_path / "a.py"))], "val": [("b", str(tmp_path / "b.py"))]}
    path = str(tmp_path / "t.tiktoken")
    tokenizer.train_tokenizer(files, 260, [258, 270], every=1, path=path)
    out = capsys.readouterr().out
    assert re.findall(r"vocab +(\d+):", out) == ["258", "260", "270"]
    ranks = data.read_ranks(path)  # the vocab asked for, not the largest measured
    assert sorted(ranks.values()) == list(range(260))


@pytest.mark.parametrize("flags,message", [
    (["--train-tokenizer", "--measure", "abc"], "--measure takes vocab sizes"),
    (["--train-tokenizer", "--vocab-size", "100"], "must be >= 256 .* got 100"),
    (["--train-tokenizer", "--measure", "0"], "must be >= 256 .* got 0"),
    (["--train-tokenizer", "--bpe-every", "0"], "--bpe-every must be >= 1"),
    (["--train-tokenizer", "--vocab-size", "65534"], "must be <= 65533 .* got 65534"),
    (["--train-tokenizer", "--out", "FILE/t.tiktoken"], "Not a directory"),
    (["--vocab-size", "8192"], "--vocab-size only shape a new tokenizer"),
    (["--measure", "512", "--bpe-every", "3"],
     "--measure, --bpe-every only shape a new tokenizer; add --train-tokenizer"),
    ([], "nothing to do: give --train-tokenizer or --write-prompts")])
def test_cli_refuses_bad_flags_before_reading_the_corpus(tmp_path, flags, message, run_script):
    """Each of these ended in a traceback (a PanicException from the BPE for --vocab-size 100)."""
    (tmp_path / "FILE").write_text("x")
    flags = [f.replace("FILE", str(tmp_path / "FILE")) for f in flags]
    if "--train-tokenizer" in flags and "--out" not in flags:
        # a check that failed to refuse trains into tmp_path, not over the committed tokenizer
        flags += ["--out", str(tmp_path / "t.tiktoken")]
    rc, out, err = run_script("dev/tokenizer.py", *flags, cwd=tmp_path)
    assert rc == 1 and re.search(message, err), err[-800:]
    assert "corpus:" not in out  # refused before any work


def run_cli(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    runpy.run_path(SCRIPT, run_name="__main__")


def test_a_small_training_run_writes_a_tokenizer_that_round_trips(tmp_path, monkeypatch, capsys):
    out = tmp_path / "new" / "t.tiktoken"  # a missing folder is made
    run_cli(monkeypatch, "--train-tokenizer", "--vocab-size", "300", "--measure", "280",
            "--bpe-every", "100", "--out", str(out))
    assert f"wrote 300 ranks to {out}" in capsys.readouterr().out
    toy = data.get_encoding(str(out))
    assert toy.n_vocab == 302 and toy.decode(toy.encode_ordinary("def f(x): 🐍")) == "def f(x): 🐍"


# versions alone: another build of the same versions could ship other files (not seen)
@pytest.mark.skipif(REFERENCE_ENV != data.REFERENCE_VERSIONS,
                    reason=f"the committed prompts were drawn with {data.REFERENCE_VERSIONS}")
def test_write_prompts_redraws_the_committed_file(tmp_path, monkeypatch):
    """Into temp files, both: the OOD one went to weights/ and was redrawn in a virtual
    environment without the OOD packages' versions of this machine. The held-out prompts come
    from the small corpus (the standard library, torch, numpy: the versions above)."""
    paths = data.PROMPTS_PATH, data.OOD_PROMPTS_PATH
    committed = [open(p, "rb").read() for p in paths]
    monkeypatch.setattr(data, "PROMPTS_PATH", str(tmp_path / "p.jsonl"))
    monkeypatch.setattr(data, "OOD_PROMPTS_PATH", str(tmp_path / "ood.jsonl"))
    run_cli(monkeypatch, "--write-prompts")
    assert (tmp_path / "p.jsonl").read_bytes() == committed[0]
    assert (tmp_path / "ood.jsonl").exists()
    assert [open(p, "rb").read() for p in paths] == committed
