"""
Data for the project: a Python-source corpus, a BPE tokenizer trained on it, token bins and
held-out prompts. Nothing is downloaded: the corpus is the standard library of the running
Python plus the installed sources of torch and numpy (test folders and every other package
left out): 57 MB, 16M tokens with the default 4096 ranks (DESIGN sec. 2 guessed ~20M; what
these three packages hold is what there is).

    python data.py                                          # reuse tokenizer.tiktoken, build out/data/*.bin
    python data.py --train-tokenizer --vocab-size 4096      # retrain the tokenizer first (~1 min)
    python data.py --write-prompts                          # redraw bench's committed prompts (reference_prompts)

The tokenizer is a byte-level BPE with the GPT-4 (cl100k) split regex, trained here and
committed as `tokenizer.tiktoken` (standard format: base64 token, space, rank) so that every
machine tokenizes identically; tiktoken does the encoding. Special tokens: <|endoftext|>
(document separator) and <|mask|> (the DFlash mask, arXiv 2602.06036). The bins are flat
np.uint16 token streams, nanoGPT style. Budget: ~400 lines instead of ~200, because the BPE
trainer with incremental pair counts (~75 lines) and the prompts-file parser live here too.
"""
import argparse, base64, functools, hashlib, heapq, importlib.util, json, os, random, sys, sysconfig, time
from collections import Counter, defaultdict

import numpy as np
import regex  # tiktoken depends on it; unlike `re` it knows \p{L} and \p{N}
import tiktoken

ROOT = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_PATH = os.path.join(ROOT, "tokenizer.tiktoken")
WEIGHTS_DIR = os.path.join(ROOT, "weights")  # the committed reference checkpoints, weights/<preset>/
PROMPTS_PATH = os.path.join(WEIGHTS_DIR, "heldout_prompts.jsonl")  # bench's default prompts (reference_prompts)
N_REFERENCE_PROMPTS = 256
REFERENCE_VERSIONS = ("3.11.7", "2.13.0", "2.4.6")  # Python, torch, numpy of the committed draw
# the cl100k_base split pattern exactly as tiktoken ships it, so its Rust regex accepts it:
# words with one leading space/punctuation (" self", "_attn", ".append"), numbers of <= 3
# digits, punctuation runs, newlines, and runs of indentation kept apart from the next word
PAT_STR = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
EOT, MASK = "<|endoftext|>", "<|mask|>"
VAL_PER_MILLE = 20  # ~2 % of files held out, chosen by a hash of the path
MAX_FILE_BYTES = 1_000_000  # bigger .py files are generated tables, not code anyone writes
SKIP_DIRS = {"test", "tests", "testing", "idle_test", "site-packages", "__pycache__"}

# -----------------------------------------------------------------------------
# corpus

@functools.lru_cache()
def corpus_files():
    """{"train": [...], "val": [...]} of (key, path); key = root name + path inside the root."""
    roots = [("stdlib", sysconfig.get_paths()["stdlib"])]
    for name in ("torch", "numpy"):  # find_spec locates a package without importing it
        spec = importlib.util.find_spec(name)
        if spec is None:
            print(f"corpus: {name} is not installed, leaving it out")
        else:
            roots.append((name, spec.submodule_search_locations[0]))
    split = {"train": [], "val": []}
    for name, root in roots:
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            # NOTE: the stdlib folder contains site-packages; SKIP_DIRS keeps it (and tests) out
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for f in filenames:
                path = os.path.join(dirpath, f)
                if f.endswith(".py") and os.path.getsize(path) <= MAX_FILE_BYTES:
                    found.append((name + "/" + os.path.relpath(path, root).replace(os.sep, "/"), path))
        for key, path in sorted(found):
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
    t0 = time.time()
    pat = regex.compile(pat_str)
    chunks = Counter()
    for text in texts:
        chunks.update(pat.findall(text))
    words = [list(c.encode("utf-8")) for c in chunks]  # each unique chunk as token ids
    counts = list(chunks.values())
    if verbose:
        print(f"bpe: {sum(counts):,} chunks, {len(words):,} unique, split in {time.time() - t0:.1f}s")
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
        # ranks are keyed by bytes, so the second one reuses the existing id instead of a new rank
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
            print(f"bpe: {len(vocab)}/{vocab_size} tokens, last merge {merged!r} x{-negc:,}, {time.time() - t0:.0f}s")
    return vocab

def write_ranks(vocab, path):
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(vocab))

def read_ranks(path):
    # NOTE: not tiktoken.load.load_tiktoken_bpe: it caches files by *path* in /tmp and would
    # keep serving the old ranks after a retrain; the format is the same (tests check that)
    with open(path, "rb") as f:
        return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f if line.strip())}

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

def bytes_per_token(enc, texts):
    return sum(len(t.encode("utf-8")) for t in texts) / sum(map(len, enc.encode_ordinary_batch(texts)))

# -----------------------------------------------------------------------------
# token bins

def write_atomic(path, text):
    """Temp file then rename (like model.save_checkpoint): Ctrl-C never leaves half a file (meta.json
    here, bench's JSON and chart)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


DATA_OUT = os.path.join(ROOT, "out")  # the token bins: a cache every run shares, in the git-ignored out/
_prepared = {}  # out_dir -> meta, once checked in this process (the check lists the whole corpus)


def prepare(out_dir=DATA_OUT, rebuild=False):
    """Encode the corpus into out_dir/data/{train,val}.bin (np.uint16, each document followed
    by <|endoftext|>); reused while the tokenizer hash and the corpus listing are unchanged."""
    if out_dir in _prepared and not rebuild:
        return _prepared[out_dir]
    _prepared[out_dir] = meta = _prepare(out_dir, rebuild)
    return meta


def _prepare(out_dir, rebuild):
    data_dir = os.path.join(out_dir, "data")
    meta_path = os.path.join(data_dir, "meta.json")
    files = corpus_files()
    fingerprint = hashlib.sha256(json.dumps({s: [k for k, _ in v] for s, v in files.items()}).encode()).hexdigest()[:12]
    tok_hash = tokenizer_hash()
    paths = {s: os.path.join(data_dir, f"{s}.bin") for s in ("train", "val")}
    if os.path.exists(meta_path) and not rebuild:
        with open(meta_path) as f:
            meta = json.load(f)
        if (meta["tokenizer_hash"], meta["corpus_fingerprint"]) == (tok_hash, fingerprint) and all(map(os.path.exists, paths.values())):
            print(f"data: reusing {data_dir} (tokenizer {tok_hash}, {meta['tokens']['train']:,} train tokens)")
            return {**meta, "paths": paths}  # paths as seen from here, not from where it was built
        print(f"data: rebuilding {data_dir}: tokenizer or corpus changed since it was built")
    os.makedirs(data_dir, exist_ok=True)
    enc = get_encoding()
    assert enc.n_vocab < 2**16, "token ids must fit in uint16"
    meta = {"tokenizer_hash": tok_hash, "corpus_fingerprint": fingerprint, "paths": paths,
            "files": {}, "bytes": {}, "tokens": {}}
    t0 = time.time()
    for split, split_files in files.items():
        docs = list(read_texts(split_files))
        parts, n_bytes = [], 0
        for i in range(0, len(docs), 256):  # batches keep the Python lists of ids small
            batch = [text for _, text in docs[i:i + 256]]
            n_bytes += sum(len(t.encode("utf-8")) for t in batch)
            for ids in enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1):
                parts.append(np.array(ids + [enc.eot_token], dtype=np.uint16))
            progress(f"data: {split} {min(i + 256, len(docs))}/{len(docs)} files, {time.time() - t0:.1f}s")
        tokens = np.concatenate(parts)
        # write a .tmp beside the bin and rename, so an interrupted run never leaves a half bin
        arr = np.memmap(paths[split] + ".tmp", dtype=np.uint16, mode="w+", shape=tokens.shape)
        arr[:] = tokens
        arr.flush(); del arr
        os.replace(paths[split] + ".tmp", paths[split])
        meta["files"][split], meta["bytes"][split], meta["tokens"][split] = len(docs), n_bytes, len(tokens)
        progress(f"data: {split}: {len(docs):,} files, {n_bytes:,} bytes, {len(tokens):,} tokens "
                 f"({n_bytes / len(tokens):.2f} bytes/token)    ", last=True)  # spaces erase a longer line
    meta["build_seconds"] = round(time.time() - t0, 1)
    write_atomic(meta_path, json.dumps(meta, indent=1))
    return meta

def progress(msg, last=False):
    """A progress line: rewritten in place on a terminal (the last one then ends the line),
    a line each when stdout is a log file, where \r would run them into one long line."""
    if sys.stdout.isatty():
        print("\r" + msg, end="\n" if last else "", flush=True)
    else:
        print(msg, flush=True)

def load_tokens(split, out_dir=DATA_OUT):
    meta = prepare(out_dir)
    return np.memmap(meta["paths"][split], dtype=np.uint16, mode="r")

# -----------------------------------------------------------------------------
# held-out prompts and the repetition metric

def heldout_samples(n, seed=0, prompt_lines=4, max_prompt_tokens=96, continuation_chars=1500):
    """n (prompt, real continuation) pairs cut from val files at a `def`/`class` line: the
    prompt is that line and the next few (prompt_lines in all), the continuation is the text
    that really follows. One sample per file per round, so they spread across files."""
    enc, rng = get_encoding(), random.Random(seed)
    per_file = []
    for _, text in read_texts(corpus_files()["val"]):
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

def heldout_prompts(n, seed=0):
    return [p for p, _ in heldout_samples(n, seed=seed)]

def reference_prompts(n):
    """The first n of the committed held-out prompts, bench's default and the README's: what
    heldout_prompts(N_REFERENCE_PROMPTS) drew with REFERENCE_VERSIONS (`python data.py
    --write-prompts`). The corpus is whatever is installed, so a draw elsewhere differs, and with
    it every tau; the committed file keeps bench's figures comparable across machines."""
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
    seen, repeats = set(), 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        repeats += g in seen
        seen.add(g)
    return repeats / (len(tokens) - n + 1)

def read_prompts_file(path):
    """User prompts: JSON lines with a "prompt" string (when the first non-blank line starts
    with '{'), or plain-text blocks separated by blank lines (kept without their final newline)."""
    try:  # utf-8-sig drops a BOM; lines end at \n only (splitlines would also cut at U+2028, which
        # JSON strings may hold raw), and text mode reads \r\n as \n
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read prompts file ({e})") from None
    first = next((l for l in lines if l.strip()), None)
    if first is None:
        raise ValueError(f"{path}: empty prompts file")
    prompts = []
    if first.lstrip().startswith("{"):
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{path}:{lineno}: expected an object with a "prompt" string')
            if not obj["prompt"]:
                raise ValueError(f"{path}:{lineno}: empty prompt")
            prompts.append(obj["prompt"])
    else:
        block = []
        for line in lines + [""]:
            if line.strip():
                block.append(line)
            elif block:
                prompts.append("\n".join(block)); block = []
    return prompts

# -----------------------------------------------------------------------------
# files and flags

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
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


def check_cli(args, parser):
    """data.py's flags, checked before the corpus is read: a bad one ended in a traceback."""
    try:
        sizes = [args.vocab_size, *map(int, args.measure.split(","))]
    except ValueError:
        raise ValueError(f"--measure takes vocab sizes separated by commas, got {args.measure!r}") from None
    if min(sizes) < 256:  # the 256 single bytes come first
        raise ValueError(f"--vocab-size and --measure must be >= 256 (the single bytes), got {min(sizes)}")
    if args.bpe_every < 1:
        raise ValueError(f"--bpe-every must be >= 1 (1 = every train file), got {args.bpe_every}")
    if args.vocab_size + 2 >= 2**16:  # the bins hold uint16 ids, and the 2 specials come on top (prepare)
        raise ValueError(f"--vocab-size must be <= {2**16 - 3} (token ids are stored as uint16), got {args.vocab_size}")
    if not args.train_tokenizer and os.path.exists(TOKENIZER_PATH):
        given = [f"--{k.replace('_', '-')}" for k in ("vocab_size", "measure", "bpe_every")
                 if getattr(args, k) != parser.get_default(k)]
        if given:
            raise ValueError(f"{', '.join(given)} only shape a new tokenizer; add --train-tokenizer "
                             f"(without it the committed {os.path.basename(TOKENIZER_PATH)} is used)")
    check_writable(os.path.join(args.out_dir, "data", "train.bin"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelp)
    parser.add_argument("--train-tokenizer", action="store_true", help="retrain tokenizer.tiktoken instead of reusing it")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE ranks to keep (256 bytes + merges; specials come on top)")
    parser.add_argument("--measure", default="2048,4096,8192", help="when training: vocab sizes whose held-out bytes/token to report")
    parser.add_argument("--bpe-every", type=int, default=1, help="train the BPE on every k-th train file (1: all 57 MB, ~50 s; 3: ~20 s, 0.5%% worse)")
    parser.add_argument("--out-dir", default=DATA_OUT, help="where data/{train,val}.bin and meta.json go "
                        "(default: out/ in the repository, where train.py looks)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the bins even if they look up to date")
    parser.add_argument("--write-prompts", action="store_true", help="only rewrite weights/heldout_prompts.jsonl (bench's "
                        f"default prompts) with the first {N_REFERENCE_PROMPTS} held-out prompts of this machine's corpus")
    args = parser.parse_args()
    try:
        check_cli(args, parser)
    except ValueError as e:
        raise SystemExit(f"error: {e}")

    if args.write_prompts:
        prompts = heldout_prompts(N_REFERENCE_PROMPTS)
        with open(PROMPTS_PATH, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
        print(f"wrote {len(prompts)} prompts to {PROMPTS_PATH}")
        raise SystemExit(0)

    files = corpus_files()
    print(f"corpus: {len(files['train'])} train / {len(files['val'])} val files "
          f"(stdlib of {sysconfig.get_paths()['stdlib']} + torch + numpy, tests excluded)")
    if args.train_tokenizer or not os.path.exists(TOKENIZER_PATH):
        print("tokenizer: training" + ("" if args.train_tokenizer else f" because {TOKENIZER_PATH} is missing"))
        sizes = sorted({args.vocab_size, *map(int, args.measure.split(","))})
        texts = [t for _, t in read_texts(files["train"][::args.bpe_every])]
        print(f"tokenizer: BPE on {len(texts)} files, {sum(map(len, texts)):,} chars, up to {sizes[-1]} ranks")
        t0 = time.time()
        vocab = train_bpe(texts, sizes[-1])  # BPE merges are a sequence: smaller vocabs are prefixes
        print(f"tokenizer: trained in {time.time() - t0:.1f}s")
        val_texts = [t for _, t in read_texts(files["val"])]
        for size in sizes:
            enc = make_encoding({tok: r for r, tok in enumerate(vocab[:size])})
            print(f"tokenizer: vocab {size:5d}: {bytes_per_token(enc, val_texts):.3f} held-out bytes/token")
        write_ranks(vocab[:args.vocab_size], TOKENIZER_PATH)
        get_encoding.cache_clear()
    else:
        print("tokenizer: reusing the committed file (--train-tokenizer retrains it)")
    enc = get_encoding()
    print(f"tokenizer: {TOKENIZER_PATH} (hash {tokenizer_hash()}), n_vocab {enc.n_vocab}")
    meta = prepare(args.out_dir, rebuild=args.rebuild)
    samples = heldout_samples(64)
    rep = np.mean([repeated_ngram_fraction(enc.encode_ordinary(c)[:128]) for _, c in samples])
    print(f"held-out: {len(samples)} prompts; real continuations repeat {100 * rep:.1f}% of their 8-grams in 128 tokens")
    print(f"first prompt: {samples[0][0]!r}")
