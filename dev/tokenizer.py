"""
The two files a developer makes once and commits, which the engine only reads (data.py): the
BPE ranks tokenizer.tiktoken and bench's prompts weights/heldout_prompts.jsonl (and
ood_prompts.jsonl, from whole packages no corpus holds: data.OOD_PACKAGES).

The tokenizer is a byte-level BPE (Sennrich et al., arXiv 1508.07909; GPT-2 style: ranks 0..255
are the bytes, merges follow in order), trained on data.py's corpus pre-split by its regex and
written in tiktoken's format (base64 token, space, rank). The prompts are the first held-out
def/class cuts that heldout_prompts below draws.

    python dev/tokenizer.py --train-tokenizer      # retrain tokenizer.tiktoken (~1 min)
    python dev/tokenizer.py --train-tokenizer --vocab-size 512 --bpe-every 20 --out /tmp/t.tiktoken
    python dev/tokenizer.py --write-prompts        # redraw weights/*_prompts.jsonl

Both read this machine's Python, torch and numpy sources: with data.REFERENCE_VERSIONS and the
default flags they write the committed bytes again; other versions write other files, and a
new tokenizer no longer matches the committed weights (`git checkout` the file to go back).
"""
import argparse, base64, heapq, importlib.metadata, itertools, json, os, random, sys, time
from collections import Counter, defaultdict

import numpy as np
import regex  # tiktoken depends on it; unlike `re` it knows \p{L} and \p{N}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a file (python dev/tokenizer.py)
    sys.path.insert(0, ROOT)
import data

# -----------------------------------------------------------------------------
# BPE trainer (byte level, GPT-2 style: ranks 0..255 are the bytes, merges follow in order)

def train_bpe(texts, vocab_size, pat_str=data.PAT_STR, verbose=True):
    """Returns the list of token bytes in rank order. Merges are counted over the unique
    pre-split chunks (a Counter of chunk -> count) and the pair counts are updated only for
    the chunks a merge touches, so training is minutes instead of hours in pure Python."""
    t0, pat, chunks = time.time(), regex.compile(pat_str), Counter()
    for text in texts:
        chunks.update(pat.findall(text))
    words = [list(c.encode("utf-8")) for c in chunks]  # each unique chunk as token ids
    counts = list(chunks.values())
    vocab = [bytes([i]) for i in range(256)]
    rank_of = {b: i for i, b in enumerate(vocab)}
    pairs, where = Counter(), defaultdict(set)  # pair -> count; pair -> ids of words holding it
    for i, (w, c) in enumerate(zip(words, counts)):
        for p in zip(w, w[1:]):
            pairs[p] += c
            where[p].add(i)
    # max-heap with lazy deletion: an entry is stale when its count no longer matches;
    # ties break towards the smallest pair of ids, so training is deterministic
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        negc, (a, b) = heapq.heappop(heap)
        if pairs.get((a, b), 0) != -negc:
            continue
        merged = vocab[a] + vocab[b]
        # NOTE: two different merges can spell the same bytes ("ab"+"c", "a"+"bc"); tiktoken
        # ranks are keyed by bytes, so the second one reuses the existing id, not a new rank
        t = rank_of.get(merged)
        if t is None:
            t = rank_of[merged] = len(vocab)
            vocab.append(merged)
        changed = set()
        for i in where.pop((a, b)):
            w, c, new, j = words[i], counts[i], [], 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    new.append(t); j += 2
                else:
                    new.append(w[j]); j += 1
            if len(new) == len(w):
                continue  # stale entry of `where`: this word lost the pair in an earlier merge
            for p in zip(w, w[1:]):
                pairs[p] -= c; changed.add(p)
            for p in zip(new, new[1:]):
                pairs[p] += c; changed.add(p); where[p].add(i)
            words[i] = new
        for p in changed:
            if pairs[p] > 0:
                heapq.heappush(heap, (-pairs[p], p))
            else:
                del pairs[p]
        if verbose and len(vocab) % 512 == 0:
            print(f"bpe: {len(vocab)}/{vocab_size} tokens from {len(words):,} unique chunks, "
                  f"last merge {merged!r} x{-negc:,}, {time.time() - t0:.0f}s")
    return vocab

def write_ranks(vocab, path):
    """tiktoken's format, one "base64-token rank" a line; its folder made (as check_writable
    promised) and written whole or not at all (an interrupted write would break every script)."""
    data.write_atomic(os.fspath(path), "".join(f"{base64.b64encode(tok).decode()} {rank}\n"
                                              for rank, tok in enumerate(vocab)))

def train_tokenizer(files, vocab_size, measure, every, path):
    """Train the BPE on every `every`-th train file, report held-out bytes/token per vocab size
    in `measure`, and write the first vocab_size ranks to path."""
    sizes = sorted({vocab_size, *measure})
    texts = [t for _, t in data.read_texts(files["train"][::every])]
    print(f"tokenizer: BPE on {len(texts)} files, {sum(map(len, texts)):,} chars")
    vocab = train_bpe(texts, sizes[-1])  # merges are a sequence: smaller vocabs are prefixes
    val_texts = [t for _, t in data.read_texts(files["val"])]
    n_bytes = sum(len(t.encode()) for t in val_texts)
    for size in sizes:
        enc = data.make_encoding({tok: r for r, tok in enumerate(vocab[:size])})
        n_tokens = sum(map(len, enc.encode_ordinary_batch(val_texts)))
        print(f"tokenizer: vocab {size:5d}: {n_bytes / n_tokens:.3f} held-out bytes/token")
    write_ranks(vocab[:vocab_size], path)
    data.get_encoding.cache_clear()  # a retrained tokenizer.tiktoken is read afresh

# -----------------------------------------------------------------------------
# bench's committed prompts (data.reference_prompts reads them)

def heldout_samples(n, seed=0, max_prompt_tokens=96, corpus="small", split="val"):
    """n (prompt, real continuation) pairs cut from held-out files (split "val", or "ood": the
    OOD_PACKAGES, found by corpus "all") at a `def`/`class` line: the prompt is that line and the
    next three, the continuation the 1,500 characters that really follow. One sample per file per
    round, so they spread across files."""
    enc, rng, per_file = data.get_encoding(), random.Random(seed), []
    for _, text in data.read_texts(data.corpus_files(corpus)[split]):
        lines = text.splitlines(keepends=True)
        offsets = np.cumsum([0] + [len(l) for l in lines])
        cands = []
        for i, line in enumerate(lines):
            if line.lstrip().startswith(("def ", "class ")):
                j = min(i + 4, len(lines))
                cont = text[offsets[j]:offsets[j] + 1500]
                if len(cont.strip()) >= 200:  # skip cuts at the very end of a file
                    cands.append(("".join(lines[i:j]), cont))
        rng.shuffle(cands)
        per_file.append(cands)
    rng.shuffle(per_file)
    out, taken = [], set()  # a prompt met before (one more `def __init__(self, ...)`) is skipped
    for round_k in itertools.zip_longest(*per_file):  # each file's k-th cut (None: it has none)
        for prompt, cont in filter(None, round_k):
            if prompt not in taken and len(enc.encode_ordinary(prompt)) <= max_prompt_tokens:
                out.append((prompt, cont))
                taken.add(prompt)
                if len(out) == n:
                    return out
    print(f"data: only {len(out)} held-out samples available (asked for {n})")
    return out


def heldout_prompts(n, seed=0, corpus="small", split="val"):
    return [p for p, _ in heldout_samples(n, seed=seed, corpus=corpus, split=split)]


# -----------------------------------------------------------------------------
# command line

def check_cli(args, parser):
    """The flags, checked before the corpus is read (a bad one ended in a traceback)."""
    try:
        sizes = [args.vocab_size, *map(int, args.measure.split(","))]
    except ValueError:
        raise ValueError(f"--measure takes vocab sizes separated by commas, got {args.measure!r}") \
            from None
    if min(sizes) < 256:  # the 256 single bytes come first
        raise ValueError(f"--vocab-size and --measure must be >= 256 (the bytes), got {min(sizes)}")
    if args.bpe_every < 1:
        raise ValueError(f"--bpe-every must be >= 1 (1 = every train file), got {args.bpe_every}")
    if args.vocab_size + 2 >= 2**16:  # the bins hold uint16 ids, and the 2 specials come on top
        raise ValueError(f"--vocab-size must be <= {2**16 - 3} (ids are uint16), "
                         f"got {args.vocab_size}")
    given = [f"--{k.replace('_', '-')}" for k in ("vocab_size", "measure", "bpe_every", "out")
             if getattr(args, k) != parser.get_default(k)]
    if given and not args.train_tokenizer:
        raise ValueError(f"{', '.join(given)} only shape a new tokenizer; add --train-tokenizer")
    if not (args.train_tokenizer or args.write_prompts):
        raise ValueError("nothing to do: give --train-tokenizer or --write-prompts")
    data.check_writable(args.out)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=data.DefaultsHelp)
    g = parser.add_argument_group("what to make").add_mutually_exclusive_group()
    g.add_argument("--train-tokenizer", action="store_true", help="retrain the BPE ranks")
    g.add_argument("--write-prompts", action="store_true", help="only redraw weights/"
                   f"heldout_prompts.jsonl and ood_prompts.jsonl (data.OOD_PACKAGES): this "
                   f"machine's first {data.N_REFERENCE_PROMPTS}")
    parser.add_argument("--corpus", choices=data.CORPORA, default="small",
                        help="the corpus to train on and draw from (see data.py)")
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--out", default=data.TOKENIZER_PATH, help="where the ranks go "
                   "(default: tokenizer.tiktoken, which every script reads)")
    g.add_argument("--vocab-size", type=int, default=4096,
                   help="BPE ranks to keep (256 bytes + merges; specials come on top)")
    g.add_argument("--measure", default="2048,4096,8192",
                   help="vocab sizes whose held-out bytes/token to report")
    g.add_argument("--bpe-every", type=int, default=1, help="train the BPE on every k-th train "
                   "file (1: all of small's 57 MB, ~50 s; 3: ~20 s, 0.5%% worse)")
    args = parser.parse_args()
    try:
        check_cli(args, parser)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    here = (sys.version.split()[0], *(importlib.metadata.version(p).split("+")[0]
                                      for p in ("torch", "numpy")))
    if here != data.REFERENCE_VERSIONS:  # the corpus is these packages' sources
        print(f"NOTE: Python, torch, numpy {here} are not the committed files' "
              f"{data.REFERENCE_VERSIONS}: expect other ranks and prompts")
    if args.write_prompts:  # the held-out files of args.corpus, and the OOD_PACKAGES
        for path, corpus, split in ((data.PROMPTS_PATH, args.corpus, "val"),
                                    (data.OOD_PROMPTS_PATH, "all", "ood")):
            prompts = heldout_prompts(data.N_REFERENCE_PROMPTS, corpus=corpus, split=split)
            data.write_atomic(path, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
            print(f"wrote {len(prompts)} prompts to {path}")
    else:
        files = data.corpus_files(args.corpus)
        print(f"corpus: {args.corpus}, {len(files['train'])} train / {len(files['val'])} val "
              "files")
        train_tokenizer(files, args.vocab_size, map(int, args.measure.split(",")),
                        args.bpe_every, args.out)
        print(f"tokenizer: wrote {len(data.read_ranks(args.out))} ranks to {args.out} "
              f"(hash {data.tokenizer_hash(args.out)})")
        if os.path.abspath(args.out) == data.TOKENIZER_PATH:  # the bins are keyed by its hash
            print("tokenizer: `python data.py` (or a training run) rebuilds the bins with it")
