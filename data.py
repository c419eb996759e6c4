"""
Data for dflash-mini: a corpus of Python source, a byte-level BPE tokenizer trained on it, the
token bins train.py reads and the held-out prompts of the benchmark. Nothing is downloaded.

The corpus is what this machine has, test folders left out: "small" (the default; the committed
weights were trained on it) is the standard library plus the installed sources of torch and
numpy, 57 MB and 16M tokens; "all" adds the files of every other installed package
(site-packages) whose content is new, 213 MB and 66M tokens on the CPU machine. A hash of each
file's key ("torch/nn/functional.py") holds it out: the same files on any machine, in both.

    python data.py                    # reuse tokenizer.tiktoken, build out/data/{train,val}.bin
    python data.py --corpus all       # the broad corpus, into out/data-all/
    python data.py --train-tokenizer  # retrain tokenizer.tiktoken first (~1 min)
    python data.py --write-prompts    # redraw weights/heldout_prompts.jsonl (bench's prompts)

The tokenizer splits with the GPT-4 (cl100k) regex and is committed in tiktoken's format (base64
token, space, rank), so every machine tokenizes alike. Special tokens: <|endoftext|> ends each
document, <|mask|> is DFlash's mask (arXiv 2602.06036). Bins: flat np.uint16 streams (nanoGPT).
"""
import argparse, base64, functools, hashlib, heapq, importlib.util, itertools, json, os, random
import sys, sysconfig, time
from collections import Counter, defaultdict

import numpy as np
import regex  # tiktoken depends on it; unlike `re` it knows \p{L} and \p{N}
import tiktoken

ROOT = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_PATH = os.path.join(ROOT, "tokenizer.tiktoken")
WEIGHTS_DIR = os.path.join(ROOT, "weights")  # the committed checkpoints, weights/<preset>/
PROMPTS_PATH = os.path.join(WEIGHTS_DIR, "heldout_prompts.jsonl")  # bench's default prompts
N_REFERENCE_PROMPTS = 256
REFERENCE_VERSIONS = ("3.11.7", "2.13.0", "2.4.6")  # Python, torch, numpy of the committed draw
DATA_OUT = os.path.join(ROOT, "out")  # the bins: a cache all runs share, in the ignored out/
# cl100k_base's split pattern as tiktoken ships it, so its Rust regex accepts it: words with one
# leading space or punctuation (" self", "_attn", ".append"), numbers of <= 3 digits,
# punctuation runs, newlines, and runs of indentation kept apart from the next word
PAT_STR = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"
           r"[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s")
EOT, MASK = "<|endoftext|>", "<|mask|>"
CORPORA = ("small", "all")
VAL_PER_MILLE = 20  # ~2 % of files held out, chosen by a hash of the key
MAX_FILE_BYTES = 1_000_000  # bigger .py files are generated tables, not code anyone writes
# NOTE: the stdlib folder holds site-packages: it is walked on its own, for "all" only
SKIP_DIRS = {"test", "tests", "testing", "idle_test", "__pycache__", "site-packages",
             "dist-packages"}

# -----------------------------------------------------------------------------
# corpus

def site_dirs():
    """The folders of installed packages (venv, conda, dist-packages, user), in import order."""
    paths = sysconfig.get_paths()
    dirs = [os.path.realpath(d) for d in sys.path + [paths["purelib"], paths["platlib"]]
            if os.path.basename(d) in ("site-packages", "dist-packages") and os.path.isdir(d)]
    return list(dict.fromkeys(dirs))

def walk(root, prefix):
    """Sorted (key, path) of the .py files under root; key = prefix + path inside root."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for path in (os.path.join(dirpath, f) for f in filenames if f.endswith(".py")):
            if os.path.isfile(path) and os.path.getsize(path) <= MAX_FILE_BYTES:
                found.append((prefix + os.path.relpath(path, root).replace(os.sep, "/"), path))
    return sorted(found)

def sha1_of(path):
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).digest()

@functools.lru_cache()
def corpus_files(corpus="small"):
    """{"train": [...], "val": [...]} of (key, path) in a fixed order: the stdlib, torch and
    numpy, each sorted by key; for "all" then the other installed files, sorted by key."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}: one of {', '.join(CORPORA)}")
    roots = [("stdlib", sysconfig.get_paths()["stdlib"])]
    for name in ("torch", "numpy"):  # find_spec locates a package without importing it
        spec = importlib.util.find_spec(name)
        if spec is None:
            print(f"corpus: {name} is not installed, leaving it out")
        else:
            roots.append((name, spec.submodule_search_locations[0]))
    files = [kp for name, root in roots for kp in walk(root, name + "/")]
    if corpus == "all":
        # then every other installed file whose content is new: vendored copies and empty
        # __init__.py go, and small stays as it is, a prefix of each split (its few repeats too)
        rest = {}
        for d in site_dirs():  # a key there is the path inside ("torch/..." as above)
            for key, path in walk(d, ""):
                rest.setdefault(key, path)  # a key installed twice: the copy Python imports
        known, seen = {k for k, _ in files}, {sha1_of(p) for _, p in files}
        for key, path in sorted(rest.items()):
            if key not in known and (h := sha1_of(path)) not in seen:
                seen.add(h)
                files.append((key, path))
    split = {"train": [], "val": []}
    for key, path in files:
        # sha1 of the key, not Python's hash(): the split must not change between runs
        h = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
        split["val" if h % 1000 < VAL_PER_MILLE else "train"].append((key, path))
    return split

def read_texts(files):
    """Yield (key, text) for each file that decodes as utf-8 (a few might not: skipped)."""
    for key, path in files:
        try:  # text mode turns the odd \r\n file into \n like the rest
            with open(path, encoding="utf-8") as f:
                yield key, f.read()
        except (UnicodeDecodeError, OSError):
            continue

# -----------------------------------------------------------------------------
# BPE trainer (byte level, GPT-2 style: ranks 0..255 are the bytes, merges follow in order)

def train_bpe(texts, vocab_size, pat_str=PAT_STR, verbose=True):
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
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(vocab))

def read_ranks(path):
    # NOTE: not tiktoken.load.load_tiktoken_bpe: it caches files by *path* in /tmp and would
    # keep serving the old ranks after a retrain; the format is the same (tests check that)
    with open(path, "rb") as f:
        return {base64.b64decode(tok): int(rank)
                for tok, rank in (line.split() for line in f if line.strip())}

def make_encoding(mergeable_ranks, name="pysrc"):
    n = len(mergeable_ranks)
    return tiktoken.Encoding(name=f"{name}-{n}", pat_str=PAT_STR, mergeable_ranks=mergeable_ranks,
                             special_tokens={EOT: n, MASK: n + 1})

@functools.lru_cache()
def get_encoding(path=TOKENIZER_PATH):
    """The project's tokenizer; enc.n_vocab (= ranks + 2 specials) is the model's vocabulary.
    NOTE: encode text with enc.encode_ordinary so '<|endoftext|>' written in a source file stays
    ordinary text; enc.encode raises on it unless told otherwise."""
    return make_encoding(read_ranks(path))

def tokenizer_hash(path=TOKENIZER_PATH):
    """Short tag of the tokenizer (ranks file + split pattern) for checkpoints and bins."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read() + PAT_STR.encode()).hexdigest()[:12]

# -----------------------------------------------------------------------------
# token bins

def write_atomic(path, text):
    """Temp file then rename: Ctrl-C never leaves half a file (meta.json, bench's JSON)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)

def progress(msg, last=False):
    """A progress line, rewritten in place on a terminal (the last one ends the line); a line
    each in a log file, where \r would run them into one long line."""
    if sys.stdout.isatty():
        print("\r" + msg, end="\n" if last else "", flush=True)
    else:
        print(msg, flush=True)

_prepared = {}  # (out_dir, corpus) -> meta, checked once per process (a check lists the corpus)

def prepare(out_dir=DATA_OUT, rebuild=False, corpus="small"):
    """Encode a corpus into out_dir/data/{train,val}.bin (data-all/ for "all"): np.uint16, each
    document followed by <|endoftext|>; reused while tokenizer and file listing are the same."""
    if (out_dir, corpus) not in _prepared or rebuild:
        _prepared[out_dir, corpus] = _prepare(out_dir, rebuild, corpus)
    return _prepared[out_dir, corpus]

def _prepare(out_dir, rebuild, corpus="small"):
    data_dir = os.path.join(out_dir, "data" if corpus == "small" else f"data-{corpus}")
    meta_path, files = os.path.join(data_dir, "meta.json"), corpus_files(corpus)
    listing = json.dumps({s: [k for k, _ in v] for s, v in files.items()}).encode()
    fingerprint, tok_hash = hashlib.sha256(listing).hexdigest()[:12], tokenizer_hash()
    paths = {s: os.path.join(data_dir, f"{s}.bin") for s in ("train", "val")}
    if os.path.exists(meta_path) and not rebuild:
        with open(meta_path) as f:
            meta = json.load(f)
        if ((meta["tokenizer_hash"], meta["corpus_fingerprint"]) == (tok_hash, fingerprint)
                and all(map(os.path.exists, paths.values()))):
            print(f"data: reusing {data_dir} (tokenizer {tok_hash}, "
                  f"{meta['tokens']['train']:,} train tokens)")
            return {**meta, "paths": paths}  # paths as seen from here, not where it was built
        print(f"data: rebuilding {data_dir}: tokenizer or corpus changed since it was built")
    os.makedirs(data_dir, exist_ok=True)
    enc = get_encoding()
    assert enc.n_vocab < 2**16, "token ids must fit in uint16"
    meta = {"corpus": corpus, "tokenizer_hash": tok_hash, "corpus_fingerprint": fingerprint,
            "paths": paths, "files": {}, "bytes": {}, "tokens": {}}
    t0 = time.time()
    for split, split_files in files.items():
        texts, n_files, n_bytes, n_tokens = read_texts(split_files), 0, 0, 0
        # into a .tmp renamed at the end, so an interrupted run leaves no half bin; 256 files
        # at a time, so memory stays flat whatever the size of the corpus
        with open(paths[split] + ".tmp", "wb") as f:
            while batch := [text for _, text in itertools.islice(texts, 256)]:
                n_files += len(batch)
                n_bytes += sum(len(t.encode()) for t in batch)
                for ids in enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1):
                    np.array(ids + [enc.eot_token], dtype=np.uint16).tofile(f)
                    n_tokens += len(ids) + 1
                progress(f"data: {split} {n_files}/{len(split_files)} files, "
                         f"{time.time() - t0:.1f}s")
        os.replace(paths[split] + ".tmp", paths[split])
        for key, n in (("files", n_files), ("bytes", n_bytes), ("tokens", n_tokens)):
            meta[key][split] = n
        progress(f"data: {split}: {n_files:,} files, {n_bytes:,} bytes, {n_tokens:,} tokens "
                 f"({n_bytes / max(n_tokens, 1):.2f} bytes/token)    ", last=True)  # spaces erase
    meta["build_seconds"] = round(time.time() - t0, 1)
    write_atomic(meta_path, json.dumps(meta, indent=1))
    return meta

def load_tokens(split, out_dir=DATA_OUT, corpus="small"):
    return np.memmap(prepare(out_dir, corpus=corpus)["paths"][split], dtype=np.uint16, mode="r")

# -----------------------------------------------------------------------------
# held-out prompts and the repetition metric

def heldout_samples(n, seed=0, prompt_lines=4, max_prompt_tokens=96, continuation_chars=1500,
                    corpus="small"):
    """n (prompt, real continuation) pairs cut from held-out files at a `def`/`class` line: the
    prompt is that line and the next few (prompt_lines in all), the continuation is the text
    that really follows. One sample per file per round, so they spread across files."""
    enc, rng, per_file = get_encoding(), random.Random(seed), []
    for _, text in read_texts(corpus_files(corpus)["val"]):
        lines = text.splitlines(keepends=True)
        offsets = np.cumsum([0] + [len(l) for l in lines])
        cands = []
        for i, line in enumerate(lines):
            if line.lstrip().startswith(("def ", "class ")):
                j = min(i + prompt_lines, len(lines))
                cont = text[offsets[j]:offsets[j] + continuation_chars]
                if len(cont.strip()) >= 200:  # skip cuts at the very end of a file
                    cands.append(("".join(lines[i:j]), cont))
        rng.shuffle(cands)
        per_file.append(cands)
    rng.shuffle(per_file)
    out, taken = [], set()  # a prompt met before (one more `def __init__(self, ...)`) is skipped
    for k in range(max(map(len, per_file), default=0)):
        for cands in per_file:
            if (k < len(cands) and cands[k][0].strip() and cands[k][0] not in taken
                    and len(enc.encode_ordinary(cands[k][0])) <= max_prompt_tokens):
                out.append(cands[k])
                taken.add(cands[k][0])
                if len(out) == n:
                    return out
    print(f"data: only {len(out)} held-out samples available (asked for {n})")
    return out

def heldout_prompts(n, seed=0, corpus="small"):
    return [p for p, _ in heldout_samples(n, seed=seed, corpus=corpus)]

def reference_prompts(n):
    """The first n committed held-out prompts, bench's default: what heldout_prompts drew with
    REFERENCE_VERSIONS. Another machine's corpus draws others, and with them other taus; the
    committed file keeps bench's figures comparable across machines."""
    prompts = read_prompts_file(PROMPTS_PATH)
    if not 0 <= n <= len(prompts):
        raise ValueError(f"{PROMPTS_PATH} holds {len(prompts)} prompts, {n} were asked for "
                         f"(--prompts FILE takes your own)")
    return prompts[:n]

def repeated_ngram_fraction(tokens, n=8):
    """Fraction of the n-grams of `tokens` that already occurred earlier in it: how much a
    continuation loops (~2 % for real code, far more for a weak greedy target)."""
    tokens = list(tokens)
    if len(tokens) < n + 1:
        return 0.0
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams)  # every gram but a first one repeats

def read_prompts_file(path):
    """User prompts: JSON lines with a "prompt" string (when the first non-blank line starts
    with '{'), or plain-text blocks separated by blank lines (kept without their final newline)."""
    try:  # utf-8-sig drops a BOM; lines end at \n only (splitlines would also cut at U+2028,
        # which JSON strings may hold raw), and text mode reads \r\n as \n
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read prompts file ({e})") from None
    first = next((l for l in lines if l.strip()), None)
    if first is None:
        raise ValueError(f"{path}: empty prompts file")
    if not first.lstrip().startswith("{"):  # a line of spaces ends a block too
        blocks = "\n".join(l if l.strip() else "" for l in lines).split("\n\n")
        return [b.strip("\n") for b in blocks if b.strip()]
    prompts = []
    for lineno, line in ((i, l) for i, l in enumerate(lines, 1) if l.strip()):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{lineno}: expected an object with a "prompt" string')
        if not obj["prompt"]:
            raise ValueError(f"{path}:{lineno}: empty prompt")
        prompts.append(obj["prompt"])
    return prompts

# -----------------------------------------------------------------------------
# files and flags (shared by every script)

def check_writable(path):
    """An output file must be writable before a run spends minutes on what it saves there.
    Checked without writing anything (a refused run leaves no folder behind): the nearest
    existing folder above it must be writable; save_checkpoint creates the rest."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"{path}: is a folder; name a file")
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise ValueError(f"{path}: cannot write there ({d} is a file, not a folder)")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: cannot write there ({d} is not writable)")

class DefaultsHelp(argparse.RawDescriptionHelpFormatter):
    """--help shows each flag's default, unless its text already speaks of one or it has none."""
    def _get_help_string(self, action):
        text, d = action.help or "", action.default
        if "default" in text or d is None or d is False or d == argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"

def check_cli(args, parser):
    """data.py's flags, checked before the corpus is read (a bad one ended in a traceback)."""
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
    given = [f"--{k.replace('_', '-')}" for k in ("vocab_size", "measure", "bpe_every")
             if getattr(args, k) != parser.get_default(k)]
    if given and not args.train_tokenizer and os.path.exists(TOKENIZER_PATH):
        raise ValueError(f"{', '.join(given)} only shape a new tokenizer; add --train-tokenizer "
                         "(without it the committed tokenizer.tiktoken is used)")
    check_writable(os.path.join(args.out_dir, "data", "train.bin"))

def train_tokenizer(files, vocab_size, measure, every):
    """Train the BPE on every `every`-th train file, report held-out bytes/token per vocab size
    in `measure`, and write the first vocab_size ranks to tokenizer.tiktoken."""
    sizes = sorted({vocab_size, *measure})
    texts = [t for _, t in read_texts(files["train"][::every])]
    print(f"tokenizer: BPE on {len(texts)} files, {sum(map(len, texts)):,} chars")
    vocab = train_bpe(texts, sizes[-1])  # merges are a sequence: smaller vocabs are prefixes
    val_texts = [t for _, t in read_texts(files["val"])]
    n_bytes = sum(len(t.encode()) for t in val_texts)
    for size in sizes:
        enc = make_encoding({tok: r for r, tok in enumerate(vocab[:size])})
        n_tokens = sum(map(len, enc.encode_ordinary_batch(val_texts)))
        print(f"tokenizer: vocab {size:5d}: {n_bytes / n_tokens:.3f} held-out bytes/token")
    write_ranks(vocab[:vocab_size], TOKENIZER_PATH)
    get_encoding.cache_clear()

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelp)
    g = parser.add_argument_group("corpus and bins")
    g.add_argument("--corpus", choices=CORPORA, default="small",
                   help="small: stdlib + torch + numpy; all: every installed package too")
    g.add_argument("--out-dir", default=DATA_OUT, help="where data/ (data-all/) with the bins "
                   "goes (default: out/ in the repository, where train.py looks)")
    g.add_argument("--rebuild", action="store_true", help="rebuild the bins even if up to date")
    g.add_argument("--write-prompts", action="store_true", help="only rewrite weights/"
                   f"heldout_prompts.jsonl with this machine's first {N_REFERENCE_PROMPTS}")
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--train-tokenizer", action="store_true", help="retrain tokenizer.tiktoken")
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
    if args.write_prompts:
        prompts = heldout_prompts(N_REFERENCE_PROMPTS, corpus=args.corpus)
        write_atomic(PROMPTS_PATH, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"wrote {len(prompts)} prompts to {PROMPTS_PATH}")
        raise SystemExit(0)
    files = corpus_files(args.corpus)
    print(f"corpus: {args.corpus}, {len(files['train'])} train / {len(files['val'])} val files "
          f"(stdlib of {sysconfig.get_paths()['stdlib']}, tests excluded)")
    if args.train_tokenizer or not os.path.exists(TOKENIZER_PATH):
        print("tokenizer: training" + ("" if args.train_tokenizer else " (the file is missing)"))
        train_tokenizer(files, args.vocab_size, map(int, args.measure.split(",")), args.bpe_every)
    enc = get_encoding()
    print(f"tokenizer: {TOKENIZER_PATH} (hash {tokenizer_hash()}), n_vocab {enc.n_vocab}")
    prepare(args.out_dir, rebuild=args.rebuild, corpus=args.corpus)
    samples = heldout_samples(64, corpus=args.corpus)
    rep = np.mean([repeated_ngram_fraction(enc.encode_ordinary(c)[:128]) for _, c in samples])
    print(f"held-out: {len(samples)} prompts; real continuations repeat {100 * rep:.1f}% "
          f"of their 8-grams in 128 tokens\nfirst prompt: {samples[0][0]!r}")
