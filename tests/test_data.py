"""Corpus, tokenizer, token bins, held-out prompts, prompt files and data.py's command line (the
BPE trainer that made the tokenizer is dev/tokenizer.py's, tested in test_tokenizer.py)."""
import argparse
import hashlib
import json
import os
import re
import sys
import types

import numpy as np
import pytest
import regex
import tiktoken
import tiktoken.load
import torch

import data
from data import EOT, MASK
from dev import tokenizer  # draws the committed prompts

REFERENCE_ENV = (sys.version.split()[0], torch.__version__.split("+")[0], np.__version__)


@pytest.fixture(scope="module")
def enc():
    return data.get_encoding()


def test_corpus_split():
    files = data.corpus_files()
    train, val = [k for k, _ in files["train"]], [k for k, _ in files["val"]]
    for root in ("stdlib", "torch", "numpy"):  # each split lists a root's files sorted by path
        assert [k for k in train + val if k.startswith(root + "/")]
        for keys in (train, val):
            ks = [k for k in keys if k.startswith(root + "/")]
            assert ks == sorted(ks), root
    assert not set(train) & set(val)
    assert 0.01 < len(val) / (len(train) + len(val)) < 0.04
    for key in train + val:
        root, *dirs, name = key.split("/")
        assert root in ("stdlib", "torch", "numpy") and name.endswith(".py")
        assert not set(dirs) & {"test", "tests", "testing", "idle_test", "site-packages"}, key


def test_roundtrip_heldout_files(enc):
    texts = [t for _, t in data.read_texts(data.corpus_files()["val"])]
    assert len(texts) > 20
    for text, ids in zip(texts, enc.encode_ordinary_batch(texts)):
        assert enc.decode(ids) == text


@pytest.mark.parametrize("text", ["", "héllo wörld 你好 🐍", "\tx = 1\r\n\ty = 2\r\n", "a  \n\n\n   b \n",
                                  "\x00\x7f\u200b", EOT, MASK, f"s = '{EOT}' + \"{MASK}\"\n"])
def test_roundtrip_odd_inputs(enc, text):
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    assert enc.encode(text, disallowed_special=()) == ids


def test_special_tokens(enc):
    n = len(data.read_ranks(data.TOKENIZER_PATH))
    assert enc.eot_token == n and enc.encode_single_token(MASK) == n + 1 and enc.n_vocab == n + 2
    # special-token text inside ordinary text stays ordinary ...
    for special in (EOT, MASK):
        ids = enc.encode_ordinary(f"x = '{special}'")
        assert n not in ids and n + 1 not in ids
        with pytest.raises(ValueError):  # ... and plain encode refuses to guess
            enc.encode(special)
    # ... unless it is explicitly allowed
    assert enc.encode(EOT + MASK, allowed_special={EOT, MASK}) == [n, n + 1]


def test_ranks_file_is_standard_tiktoken(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no /tmp cache: read the file itself
    with open(data.TOKENIZER_PATH, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    ranks = tiktoken.load.load_tiktoken_bpe(data.TOKENIZER_PATH, expected_hash=sha)
    assert ranks == data.read_ranks(data.TOKENIZER_PATH)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(ranks[bytes([i])] == i for i in range(256))
    assert len(data.tokenizer_hash()) == 12


def test_repeated_ngram_fraction():
    assert data.repeated_ngram_fraction(list(range(50))) == 0.0
    assert data.repeated_ngram_fraction([1] * 8) == 0.0  # shorter than n + 1
    seq = list(range(100))
    assert data.repeated_ngram_fraction(seq + seq) == pytest.approx(93 / 193)  # ~0.5
    assert data.repeated_ngram_fraction([7] * 20) == pytest.approx(12 / 13)
    assert data.repeated_ngram_fraction([1, 2, 1, 2, 1], n=2) == pytest.approx(2 / 4)


def test_read_prompts_file(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "def f(x):\\n"}\n\n{"prompt": "class A:", "id": 2}\n')
    assert data.read_prompts_file(p) == ["def f(x):\n", "class A:"]
    p = tmp_path / "p.txt"
    p.write_text("\ndef f(x):\n    return x\n\n\n\nimport os\n  \nclass A:\n")
    assert data.read_prompts_file(p) == ["def f(x):\n    return x", "import os", "class A:"]
    cases = {'{"prompt": "a"}\n\n{"prompt": "b"\n': ":3: malformed JSON",
             '{"prompt": "a"}\n{"text": "b"}\n': ':2: expected an object with a non-empty "prompt"',
             '{"prompt": "a"}\n[1, 2]\n': ":2:", '{"prompt": 3}\n': ":1:",
             '{"prompt": "a"}\n{"prompt": ""}\n': ':2: expected an object with a non-empty "prompt"'}
    for i, (content, message) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(content)
        with pytest.raises(ValueError, match=regex.escape(f"{bad}{message}")):
            data.read_prompts_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    with pytest.raises(ValueError, match="empty"):
        data.read_prompts_file(empty)
    with pytest.raises(ValueError, match="missing.txt"):
        data.read_prompts_file(tmp_path / "missing.txt")
    p = tmp_path / "indented.jsonl"  # JSON lines may be indented and separated by whitespace-only lines
    p.write_text('  {"prompt": "a"}\n   \n\t{"prompt": "b"}\n')
    assert data.read_prompts_file(p) == ["a", "b"]
    p = tmp_path / "bom.jsonl"  # a BOM (Windows editors) is no part of the first line; U+2028 no line end
    p.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "a\u2028b"}\r\n{"prompt": "c"}\r\n'.encode())
    assert data.read_prompts_file(p) == ["a\u2028b", "c"]
    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbf" + "x = 1\x85y\r\n\r\nz\r\n".encode())
    assert data.read_prompts_file(p) == ["x = 1\x85y", "z"]
    latin = tmp_path / "latin1.txt"  # not UTF-8: a ValueError that names the file, not a bare UnicodeDecodeError
    latin.write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt: cannot read"):
        data.read_prompts_file(latin)


def test_heldout_samples(enc):
    samples = tokenizer.heldout_samples(24)
    assert len(samples) == 24 and tokenizer.heldout_samples(24) == samples  # deterministic
    assert tokenizer.heldout_samples(24, seed=1) != samples
    assert tokenizer.heldout_prompts(5) == [p for p, _ in samples[:5]]
    val_texts = [t for _, t in data.read_texts(data.corpus_files()["val"])]
    sources = set()
    for prompt, continuation in samples:
        assert prompt.strip() and len(enc.encode_ordinary(prompt)) <= 96
        assert prompt.lstrip().startswith(("def ", "class ")) and len(prompt.splitlines()) <= 4
        assert 200 <= len(continuation) <= 1500
        # the pair is a verbatim cut of one held-out file: the prompt followed by what follows it
        sources.add(next(i for i, t in enumerate(val_texts) if prompt + continuation in t))
    assert len(sources) >= 20  # spread across files, not 24 cuts of one file
    short = tokenizer.heldout_samples(10, max_prompt_tokens=24)
    assert all(len(enc.encode_ordinary(p)) <= 24 for p, _ in short)


def test_reference_prompts_are_the_committed_file(enc):
    prompts = data.reference_prompts(data.N_REFERENCE_PROMPTS)
    assert len(prompts) == len(set(prompts)) == data.N_REFERENCE_PROMPTS and data.reference_prompts(3) == prompts[:3]
    assert all(p.lstrip().startswith(("def ", "class ")) and len(enc.encode_ordinary(p)) <= 96 for p in prompts)
    for n in (data.N_REFERENCE_PROMPTS + 1, -1):
        with pytest.raises(ValueError, match=f"holds {data.N_REFERENCE_PROMPTS} prompts, {n} "):
            data.reference_prompts(n)


# versions alone: another build of the same versions could ship other files (not seen)
@pytest.mark.skipif(REFERENCE_ENV != data.REFERENCE_VERSIONS,
                    reason=f"the committed prompts were drawn with Python, torch, numpy {data.REFERENCE_VERSIONS}")
def test_reference_prompts_are_what_the_reference_environment_draws():
    assert data.reference_prompts(data.N_REFERENCE_PROMPTS) == tokenizer.heldout_prompts(data.N_REFERENCE_PROMPTS)


def test_a_prompt_of_exactly_max_prompt_tokens_is_kept(monkeypatch):
    enc = data.get_encoding()
    prompt = "def f(x):\n    y = x + 1\n    z = y * 2\n    return z\n"
    cont = "".join(f"value_{i} = compute({i})\n" for i in range(20))
    monkeypatch.setattr(data, "read_texts", lambda files: iter([("k", prompt + cont)]))
    n = len(enc.encode_ordinary(prompt))
    assert tokenizer.heldout_samples(1, max_prompt_tokens=n) == [(prompt, cont[:1500])]
    assert tokenizer.heldout_samples(1, max_prompt_tokens=n - 1) == []


def test_a_prompt_met_in_another_file_is_taken_once(monkeypatch):
    prompt = "def __init__(self):\n    self.a = 1\n    self.b = 2\n    self.c = 3\n"
    files = [(f"k{i}", prompt + "".join(f"value_{i}_{j} = compute({j})\n" for j in range(20))) for i in range(2)]
    monkeypatch.setattr(data, "read_texts", lambda _: iter(files))
    assert [p for p, _ in tokenizer.heldout_samples(2)] == [prompt]  # the same prompt twice would weigh double in tau


def test_tokenizer_hash_covers_the_split_pattern(monkeypatch):
    h = data.tokenizer_hash()
    monkeypatch.setattr(data, "PAT_STR", data.PAT_STR + r"|\s")
    assert data.tokenizer_hash() != h


def tiny_corpus(tmp_path, monkeypatch):
    """data.corpus_files -> one train file (a.py) and one val file (b.py); c.py waits beside
    them. Returns the dict, which a test may change."""
    for s in ("a", "b", "c"):
        (tmp_path / f"{s}.py").write_text(f"def {s}():\n    return 1\n")
    files = {"train": [("a", str(tmp_path / "a.py"))], "val": [("b", str(tmp_path / "b.py"))]}
    monkeypatch.setattr(data, "corpus_files", lambda corpus="small": files)
    return files


def test_bins_are_rebuilt_for_another_tokenizer(tmp_path, monkeypatch, capsys):
    tiny_corpus(tmp_path, monkeypatch)
    out = str(tmp_path / "out")
    assert data._prepare(out, False)["tokenizer_hash"] == data.tokenizer_hash()
    monkeypatch.setattr(data, "tokenizer_hash", lambda path=None: "another")
    meta = data._prepare(out, False)
    assert meta["tokenizer_hash"] == "another" and "rebuilding" in capsys.readouterr().out


def test_bins_are_rebuilt_when_one_is_missing_or_the_corpus_changes(tmp_path, monkeypatch, capsys):
    files = tiny_corpus(tmp_path, monkeypatch)
    out = str(tmp_path / "out")
    data._prepare(out, False)
    os.remove(os.path.join(out, "data", "val.bin"))
    data._prepare(out, False)
    assert "rebuilding" in capsys.readouterr().out and os.path.exists(os.path.join(out, "data", "val.bin"))  # a missing bin
    files["train"].append(("c", str(tmp_path / "c.py")))
    assert data._prepare(out, False)["files"]["train"] == 2  # another corpus
    monkeypatch.setattr(data, "_prepared", {})
    files["train"].pop()
    assert data.prepare(out, rebuild=True)["files"]["train"] == 1
    files["train"].append(("c", str(tmp_path / "c.py")))
    assert data.prepare(out, rebuild=True)["files"]["train"] == 2  # rebuild=True bypasses the in-process cache


def test_bins_are_rebuilt_when_only_the_held_out_files_change(tmp_path, monkeypatch):
    """The corpus fingerprint covers the val listing too: a file added to the held-out split
    alone (another Python version's stdlib, one more held-out file) rebuilds val.bin. A
    fingerprint of the train listing only kept serving the old val.bin, so the validation loss
    and the distilled val data silently came from other files than the split says."""
    files = tiny_corpus(tmp_path, monkeypatch)
    out = str(tmp_path / "out")
    assert data._prepare(out, False)["files"]["val"] == 1
    files["val"].append(("c", str(tmp_path / "c.py")))
    assert data._prepare(out, False)["files"]["val"] == 2


def test_two_builds_of_the_same_bins_side_by_side_do_not_collide(tmp_path, monkeypatch):
    """Two runs started on the same missing cache (two drafters trained side by side) each build
    it. They shared one train.bin.tmp, and the later rename found it gone; here a second build
    runs whole while the first writes its train bin. An interrupted build leaves no temp file."""
    tiny_corpus(tmp_path, monkeypatch)
    out, progress, calls, inner = str(tmp_path / "out"), data.progress, [], []

    def progress_with_a_second_build(msg, last=False):
        calls.append(msg)
        if len(calls) == 1:  # inside the first build's `with` of train.bin
            inner.append(data._prepare(out, True))
        progress(msg, last)
    monkeypatch.setattr(data, "progress", progress_with_a_second_build)
    meta = data._prepare(out, True)
    assert meta["tokens"] == inner[0]["tokens"] and meta["tokens"]["train"] > 1
    assert len(np.fromfile(meta["paths"]["train"], dtype=np.uint16)) == meta["tokens"]["train"]
    assert sorted(os.listdir(os.path.join(out, "data"))) == ["meta.json", "train.bin", "val.bin"]

    def interrupt(msg, last=False):
        raise KeyboardInterrupt
    monkeypatch.setattr(data, "progress", interrupt)
    with pytest.raises(KeyboardInterrupt):
        data._prepare(str(tmp_path / "out2"), True)
    assert os.listdir(os.path.join(tmp_path, "out2", "data")) == []


def test_bin_progress_is_lines_in_a_log_and_one_line_per_split_on_a_terminal(tmp_path, monkeypatch, capsys):
    """Its \\r rewrites ran together with the next line in a log file; not on a terminal
    each progress line ends with a newline of its own. On a terminal each split's count is
    rewritten in place and its summary ends the line."""
    tiny_corpus(tmp_path, monkeypatch)
    data._prepare(str(tmp_path / "out"), False)
    out = capsys.readouterr().out
    assert "\r" not in out and "data: train 1/1 files, " in out and "data: val 1/1 files, " in out, repr(out)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    data._prepare(str(tmp_path / "out2"), False)
    lines = capsys.readouterr().out.split("\n")
    assert [re.sub(r", [^\r]*", "", l) for l in lines] == ["\rdata: train 1/1 files\rdata: train: 1 files",
                                                          "\rdata: val 1/1 files\rdata: val: 1 files", ""], lines


def test_bins_hold_each_document_followed_by_endoftext(tmp_path, monkeypatch, enc):
    tiny_corpus(tmp_path, monkeypatch)
    meta = data._prepare(str(tmp_path / "out"), False)
    for split, name in (("train", "a"), ("val", "b")):
        tokens = np.fromfile(meta["paths"][split], dtype=np.uint16).tolist()
        assert tokens == enc.encode_ordinary(f"def {name}():\n    return 1\n") + [enc.eot_token]
        assert meta["tokens"][split] == len(tokens)


def test_the_split_is_the_hash_of_the_key_on_any_machine(tmp_path, monkeypatch):
    """A file is held out iff (the first 8 hex digits of sha1(key)) % 1000 < VAL_PER_MILLE,
    whatever else is installed: files whose keys hash to just under and exactly at the
    threshold fall on either side of it."""
    names = {}
    for i in range(100_000):  # the first names whose keys hash to 19 and 20 per mille
        h = int(hashlib.sha1(f"stdlib/m{i}.py".encode()).hexdigest()[:8], 16) % 1000
        if h in (data.VAL_PER_MILLE - 1, data.VAL_PER_MILLE):
            names.setdefault(h, f"m{i}.py")
        if len(names) == 2:
            break
    for name in names.values():
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    no_files = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "absent")])
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: no_files)  # no torch, no numpy
    files = data.corpus_files.__wrapped__()
    assert [k for k, _ in files["val"]] == ["stdlib/" + names[data.VAL_PER_MILLE - 1]]
    assert [k for k, _ in files["train"]] == ["stdlib/" + names[data.VAL_PER_MILLE]]


def test_a_cut_near_the_end_of_a_file_is_skipped(monkeypatch):
    text = "x = 1\n" * 50 + "def f(x):\n    y = x\n    z = y\n    w = z\n" + "return w\n" * 5
    monkeypatch.setattr(data, "read_texts", lambda files: iter([("k", text)]))
    assert tokenizer.heldout_samples(1) == []
    # blank lines at the end of the file are no continuation either (what is left is 44 characters)
    monkeypatch.setattr(data, "read_texts", lambda files: iter([("k", text + "\n" * 300)]))
    assert tokenizer.heldout_samples(1) == []


def test_heldout_samples_spread_over_the_three_roots():
    files = data.corpus_files()["val"]
    texts = {k: t for k, t in data.read_texts(files)}
    keys = [next(k for k, t in texts.items() if p + c in t) for p, c in tokenizer.heldout_samples(24)]
    assert {k.split("/")[0] for k in keys} == {"stdlib", "torch", "numpy"} and keys != sorted(keys)


def test_heldout_prompts_takes_the_seed():
    assert tokenizer.heldout_prompts(5, seed=1) == [p for p, _ in tokenizer.heldout_samples(5, seed=1)]


def test_data_cli_refuses_an_out_dir_it_cannot_write_before_reading_the_corpus(tmp_path, run_script):
    (tmp_path / "FILE").write_text("x")
    rc, out, err = run_script("data.py", "--out-dir", str(tmp_path / "FILE"), cwd=tmp_path)
    assert rc == 1 and "cannot write there" in err and "Not a directory" in err, err[-800:]
    assert "corpus:" not in out and "data:" not in out  # refused before any work


def test_help_shows_no_default_for_a_store_false_flag():
    """A store_false flag's default True said "(default: True)", which reads as if the flag
    were on; a store_true one's False was already left out."""
    p = argparse.ArgumentParser(formatter_class=data.DefaultsHelp)
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the check")
    p.add_argument("--fast", action="store_true", help="go fast")
    p.add_argument("--steps", type=int, default=16, help="how many")
    text = " ".join(p.format_help().split())
    assert "skip the check " in text and "go fast " in text and "how many (default: 16)" in text
    assert text.count("default") == 1


# ----------------------------------------------------------------------------- the broad corpus

def fake_install(tmp_path, monkeypatch):
    """A stdlib and two site-packages folders in tmp_path, no torch or numpy: a.py in the
    stdlib; in site1 pkg/ with a copy of a.py, a unique file, a file whose bytes repeat another
    of site1's, and a test folder; site2 installs pkg/unique.py again (shadowed by site1's)."""
    files = {"stdlib/a.py": "x = 1\n", "site1/pkg/copy_of_a.py": "x = 1\n",
             "site1/pkg/unique.py": "y = 2\n", "site1/pkg/z_same.py": "y = 2\n",
             "site1/pkg/tests/test_pkg.py": "z = 3\n", "site1/top.py": "t = 4\n",
             "site2/pkg/unique.py": "shadowed = True\n", "site2/other.py": "o = 5\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "stdlib")})
    no_files = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "absent")])
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: no_files)  # no torch, no numpy
    monkeypatch.setattr(data, "site_dirs", lambda: [str(tmp_path / s) for s in ("site1", "site2")])
    monkeypatch.setattr(data, "VAL_PER_MILLE", 0)  # everything in train: one list to compare


def test_the_broad_corpus_adds_new_contents_once_in_a_fixed_order(tmp_path, monkeypatch):
    fake_install(tmp_path, monkeypatch)
    assert [k for k, _ in data.corpus_files.__wrapped__("small")["train"]] == ["stdlib/a.py"]
    files = data.corpus_files.__wrapped__("all")["train"]
    # small first; then by key: pkg/copy_of_a.py (a.py's bytes) and pkg/z_same.py (unique.py's)
    # go, tests stay out, and pkg/unique.py is site1's, the copy Python would import
    assert [k for k, _ in files] == ["stdlib/a.py", "other.py", "pkg/unique.py", "top.py"]
    assert dict(files)["pkg/unique.py"] == str(tmp_path / "site1" / "pkg" / "unique.py")
    with pytest.raises(ValueError, match="unknown corpus 'everything'"):
        data.corpus_files.__wrapped__("everything")


def test_ood_packages_are_in_no_split_of_any_corpus(tmp_path, monkeypatch):
    """A package of OOD_PACKAGES goes to "ood" whole, never to train or val, and another
    package's vendored copy of it (pip/_vendor/rich/) to no split at all."""
    fake_install(tmp_path, monkeypatch)
    (tmp_path / "site2" / "other" / "_vendor" / "pkg").mkdir(parents=True)
    (tmp_path / "site2" / "other" / "_vendor" / "pkg" / "old.py").write_text("y = 1\n")
    monkeypatch.setattr(data, "OOD_PACKAGES", ("pkg",))
    files = data.corpus_files.__wrapped__("all")
    assert [k for k, _ in files["train"]] == ["stdlib/a.py", "other.py", "top.py"]
    assert [k for k, _ in files["ood"]] == ["pkg/unique.py"] and files["val"] == []


def test_committed_ood_prompts_come_from_packages_no_corpus_trains_on():
    """weights/ood_prompts.jsonl: cuts of this machine's OOD_PACKAGES files, none of which (nor a
    copy another package vendors: pip holds rich) is in a train split; the first ten (bench's
    --n-prompts 10) come from more than one package."""
    prompts = data.read_prompts_file(data.OOD_PROMPTS_PATH)
    assert len(prompts) == data.N_REFERENCE_PROMPTS
    files = data.corpus_files("all")
    folders = {d for s in ("train", "val") for k, _ in files[s] for d in k.split("/")[:-1]}
    assert not folders & set(data.OOD_PACKAGES)  # nor a copy vendored by another package
    texts = {k.split("/")[0]: "" for k, _ in files["ood"]}
    for k, t in data.read_texts(files["ood"]):
        texts[k.split("/")[0]] += t
    if len(texts) == len(data.OOD_PACKAGES):  # all three installed here: where each prompt is
        homes = [next(pk for pk, t in texts.items() if p in t) for p in prompts]
        assert len(set(homes[:10])) > 1


def test_site_dirs_hold_the_installed_packages():
    dirs = data.site_dirs()
    assert dirs and all(os.path.isdir(d) for d in dirs) and len(dirs) == len(set(dirs))
    assert os.path.realpath(os.path.dirname(os.path.dirname(tiktoken.__file__))) in dirs


def test_the_broad_corpus_holds_other_packages_and_keeps_small_as_its_prefix():
    small, broad = data.corpus_files("small"), data.corpus_files("all")
    for split in ("train", "val"):  # small's files, keys and split unchanged, in front
        assert broad[split][:len(small[split])] == small[split]
        keys = [k for k, _ in broad[split][len(small[split]):]]
        assert keys == sorted(keys) and not {k.split("/")[0] for k in keys} & {"stdlib"}
        for key in keys:
            assert key.endswith(".py") and not set(key.split("/")[:-1]) & data.SKIP_DIRS, key
    keys = {k for split in broad.values() for k, _ in split}
    assert "tiktoken/core.py" in keys  # a dependency of ours, so installed wherever this runs
    assert not {k for split in small.values() for k, _ in split} & {"tiktoken/core.py"}
    assert len(keys) > 2 * len(small["train"])
    # the split is the hash of the key here too, so a file is held out in both corpora or neither
    for split in ("train", "val"):  # ("ood" is whole packages: test_ood_packages_...)
        for key, _ in broad[split]:
            h = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 1000
            assert (h < data.VAL_PER_MILLE) == (split == "val"), key
    # no content twice among the files the broad corpus adds, nor one that small already has
    added = [p for s in ("train", "val") for _, p in broad[s][len(small[s]):]]
    digests = [data.sha1_of(p) for p in added]
    small_digests = {data.sha1_of(p) for split in small.values() for _, p in split}
    assert len(set(digests)) == len(digests) and not set(digests) & small_digests


@pytest.mark.skipif(REFERENCE_ENV != data.REFERENCE_VERSIONS,  # other torch: other files
                    reason=f"the committed prompts were drawn with {data.REFERENCE_VERSIONS}")
def test_the_committed_prompts_stay_held_out_in_the_broad_corpus():
    val_texts = [t for _, t in data.read_texts(data.corpus_files("all")["val"])]
    for prompt in data.reference_prompts(data.N_REFERENCE_PROMPTS):
        assert any(prompt in t for t in val_texts), prompt


@pytest.mark.skipif(REFERENCE_ENV != data.REFERENCE_VERSIONS,
                    reason=f"the committed bins were built with {data.REFERENCE_VERSIONS}")
def test_the_default_corpus_is_the_one_the_committed_weights_were_trained_on():
    files = data.corpus_files()
    assert files == data.corpus_files("small")
    assert (len(files["train"]), len(files["val"])) == (3074, 59)
    listing = json.dumps({s: [k for k, _ in files[s]] for s in ("train", "val")}).encode()
    assert hashlib.sha256(listing).hexdigest()[:12] == "132cd53d68a3"  # meta.json's fingerprint


def test_each_corpus_has_bins_of_its_own(tmp_path, monkeypatch):
    files = tiny_corpus(tmp_path, monkeypatch)
    both = {"small": files, "all": {"train": files["train"] * 2, "val": files["val"]}}
    monkeypatch.setattr(data, "corpus_files", lambda corpus="small": both[corpus])
    monkeypatch.setattr(data, "_prepared", {})
    out = str(tmp_path / "out")
    small, broad = data.prepare(out), data.prepare(out, corpus="all")
    assert (small["corpus"], broad["corpus"]) == ("small", "all")
    assert small["paths"]["train"] == os.path.join(out, "data", "train.bin")
    assert broad["paths"]["train"] == os.path.join(out, "data-all", "train.bin")
    assert (small["files"]["train"], broad["files"]["train"]) == (1, 2)
    tokens = data.load_tokens("train", out, corpus="all")
    assert len(tokens) == broad["tokens"]["train"] == 2 * small["tokens"]["train"]
