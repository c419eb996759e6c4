"""
Data for dflash-mini: a corpus of Python source, the BPE tokenizer trained on it, the token bins
train.py reads and the benchmark's held-out prompts. Nothing is downloaded.

The corpus is this machine's Python files, tests left out: "small" (the default, the committed
weights' corpus) is the standard library, torch and numpy, 16M tokens; "all" adds every other
installed package's new files. A hash of each file's key ("torch/nn/functional.py") holds it
out: the same files on any machine, in both corpora. The tokenizer (byte-level, GPT-4's split
regex, tiktoken's format) and bench's prompts are made by dev/tokenizer.py and committed, so
every machine tokenizes and benches alike. Bins: flat np.uint16 streams, as in nanoGPT.

    python data.py                # build out/data/{train,val}.bin with tokenizer.tiktoken
    python data.py --corpus all   # the broad corpus, into out/data-all/
"""
import argparse, base64, contextlib, functools, hashlib, importlib.util, itertools, json, os
import sys, sysconfig, tempfile, textwrap, time

import numpy as np
import tiktoken

ROOT = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_PATH = os.path.join(ROOT, "tokenizer.tiktoken")
WEIGHTS_DIR = os.path.join(ROOT, "weights")  # the committed checkpoints, weights/<preset>/
REF_WEIGHTS = os.path.join(WEIGHTS_DIR, "cpu")  # the reference target.pt and its drafters
PROMPTS_PATH = os.path.join(WEIGHTS_DIR, "heldout_prompts.jsonl")  # bench's default prompts
# whole packages never trained on (corpus_files' "ood" split), where the out-of-domain prompts
# come from: bench.py --prompts weights/ood_prompts.jsonl
OOD_PACKAGES = ("networkx", "rich", "werkzeug")
OOD_PROMPTS_PATH = os.path.join(WEIGHTS_DIR, "ood_prompts.jsonl")
N_REFERENCE_PROMPTS = 256
REFERENCE_VERSIONS = ("3.11.7", "2.13.0", "2.4.6")  # Python, torch, numpy of the committed draw
DATA_OUT = os.path.join(ROOT, "out")  # the bins: a cache all runs share, in the ignored out/
# cl100k_base's split pattern as tiktoken ships it: words with one leading space or punctuation
# (" self", ".append"), numbers of <= 3 digits, punctuation runs, newlines, indentation runs
PAT_STR = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"
           r"[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s")
EOT, MASK = "<|endoftext|>", "<|mask|>"  # a document's end; DFlash's mask (arXiv 2602.06036)
CORPORA = ("small", "all")
VAL_PER_MILLE = 20  # ~2 % of files held out, chosen by a hash of the key
MAX_FILE_BYTES = 1_000_000  # bigger .py files are generated tables, not code anyone writes
# NOTE: the stdlib folder holds site-packages: it is walked on its own, for "all" only
SKIP_DIRS = {"test", "tests", "testing", "idle_test", "__pycache__", "site-packages",
             "dist-packages"}

# --- corpus ---------------------------------------------------------------------------------------
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
    """{"train": [...], "val": [...], "ood": [...]} of (key, path) in a fixed order: the stdlib,
    torch and numpy, each sorted by key; for "all" then the other installed files, sorted by key,
    those of OOD_PACKAGES in "ood" (never trained on, never in "val"; vendored copies: in none)."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}: one of {', '.join(CORPORA)}")
    roots = [("stdlib", sysconfig.get_paths()["stdlib"])] + [  # find_spec does not import
        (name, importlib.util.find_spec(name).submodule_search_locations[0])
        for name in ("torch", "numpy")]
    files = [kp for name, root in roots for kp in walk(root, name + "/")]
    if corpus == "all":
        # then each other installed file of new content (no vendored copies or empty __init__.py;
        # small stays as it is, a prefix of each split); of a key installed twice, Python's copy
        rest = dict(kp for d in reversed(site_dirs()) for kp in walk(d, ""))
        known, seen = {k for k, _ in files}, {sha1_of(p) for _, p in files}
        for key, path in sorted(rest.items()):
            if key not in known and (h := sha1_of(path)) not in seen:
                seen.add(h)
                files.append((key, path))
    split = {"train": [], "val": [], "ood": []}
    for key, path in files:  # sha1, not Python's hash(): the split must not change between runs
        h, parts = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16), key.split("/")
        ood = parts[0] in OOD_PACKAGES
        if not ood and set(parts[1:-1]) & set(OOD_PACKAGES):
            continue  # one vendored by another package (pip/_vendor/rich/): in no split
        split["ood" if ood else "val" if h % 1000 < VAL_PER_MILLE else "train"].append((key, path))
    return split

def read_texts(files):
    """Yield (key, text) for each file that decodes as utf-8 (a few might not: skipped)."""
    for key, path in files:
        try:  # text mode turns the odd \r\n file into \n like the rest
            with open(path, encoding="utf-8") as f:
                yield key, f.read()
        except (UnicodeDecodeError, OSError):
            continue

# --- tokenizer ------------------------------------------------------------------------------------
def read_ranks(path):
    # NOTE: not tiktoken.load.load_tiktoken_bpe: it caches files by *path* in /tmp and would
    # keep serving the old ranks after a retrain; the format is the same (tests check that)
    with open(path, "rb") as f:
        return {base64.b64decode(tok): int(rank)
                for tok, rank in (line.split() for line in f if line.strip())}

def make_encoding(mergeable_ranks):
    n = len(mergeable_ranks)
    return tiktoken.Encoding(name=f"pysrc-{n}", pat_str=PAT_STR, mergeable_ranks=mergeable_ranks,
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

# --- token bins -----------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_open(path, mode="w"):
    """A temp file beside path, renamed over it at the end: Ctrl-C never leaves half a file, and
    two runs building one cache side by side (bins, distilled data) never share a temp file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}-{time.monotonic_ns()}.tmp"
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # interrupted: no temp file left behind
            os.remove(tmp)

def write_atomic(path, text):  # meta.json, bench's JSON
    with atomic_open(path) as f:
        f.write(text)

def progress(msg, last=False):
    """A progress line, rewritten in place on a terminal (the last one ends the line); a line
    each in a log file, where \r would run them into one long line."""
    tty = sys.stdout.isatty()
    print("\r" + msg if tty else msg, end="\n" if last or not tty else "", flush=True)

_prepared = {}  # (out_dir, corpus) -> meta, checked once per process (a check lists the corpus)

def prepare(out_dir=DATA_OUT, rebuild=False, corpus="small"):
    """Encode a corpus into out_dir/data/{train,val}.bin (data-all/ for "all"): np.uint16, each
    document followed by <|endoftext|>; reused while tokenizer and file listing are the same."""
    if (out_dir, corpus) not in _prepared or rebuild:
        _prepared[out_dir, corpus] = _prepare(out_dir, rebuild, corpus)
    return _prepared[out_dir, corpus]

def bins_dir(out_dir, corpus):
    return os.path.join(out_dir, "data" if corpus == "small" else f"data-{corpus}")

def _prepare(out_dir, rebuild, corpus="small"):
    data_dir = bins_dir(out_dir, corpus)
    meta_path, files = os.path.join(data_dir, "meta.json"), corpus_files(corpus)
    listing = json.dumps({s: [k for k, _ in files[s]] for s in ("train", "val")}).encode()
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
    enc = get_encoding()
    assert enc.n_vocab < 2**16, "token ids must fit in uint16"
    meta = {"corpus": corpus, "tokenizer_hash": tok_hash, "corpus_fingerprint": fingerprint,
            "paths": paths, "files": {}, "bytes": {}, "tokens": {}}
    t0 = time.time()
    for split in ("train", "val"):
        texts, n_files, n_bytes, n_tokens = read_texts(files[split]), 0, 0, 0
        # no half bin if interrupted (atomic_open); 256 files at a time (flat memory)
        with atomic_open(paths[split], "wb") as f:
            while batch := [text for _, text in itertools.islice(texts, 256)]:
                n_files += len(batch)
                n_bytes += sum(len(t.encode()) for t in batch)
                for ids in enc.encode_ordinary_batch(batch, num_threads=os.cpu_count() or 1):
                    np.array(ids + [enc.eot_token], dtype=np.uint16).tofile(f)
                    n_tokens += len(ids) + 1
                progress(f"data: {split} {n_files}/{len(files[split])} files, "
                         f"{time.time() - t0:.1f}s")
        for key, n in (("files", n_files), ("bytes", n_bytes), ("tokens", n_tokens)):
            meta[key][split] = n
        progress(f"data: {split}: {n_files:,} files, {n_bytes:,} bytes, {n_tokens:,} tokens "
                 f"({n_bytes / max(n_tokens, 1):.2f} bytes/token)    ", last=True)  # spaces erase
    meta["build_seconds"] = round(time.time() - t0, 1)
    write_atomic(meta_path, json.dumps(meta, indent=1))
    return meta

def load_tokens(split, out_dir=DATA_OUT, corpus="small"):
    return np.memmap(prepare(out_dir, corpus=corpus)["paths"][split], dtype=np.uint16, mode="r")

# --- prompts --------------------------------------------------------------------------------------
def reference_prompts(n):
    """The first n committed held-out prompts, bench's default: what dev/tokenizer.py drew with
    REFERENCE_VERSIONS (another machine's corpus draws others, and other taus)."""
    prompts = read_prompts_file(PROMPTS_PATH)
    if not 0 <= n <= len(prompts):
        raise ValueError(f"{PROMPTS_PATH} holds {len(prompts)} prompts, {n} were asked for "
                         f"(--prompts FILE takes your own)")
    return prompts[:n]

def repeated_ngram_fraction(tokens, n=8):
    """Fraction of the n-grams of a list of tokens that already occurred earlier in it: how much
    a continuation loops (~2 % for real code, far more for a weak greedy target)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return (len(grams) - len(set(grams))) / max(len(grams), 1)  # all but a first one repeat

def read_prompts_file(path):
    """User prompts: JSON lines with a "prompt" string (when the first non-blank line starts
    with '{'), or plain-text blocks separated by blank lines (kept without their final newline)."""
    try:  # utf-8-sig drops a BOM; lines end at \n only (splitlines would also cut at U+2028,
        # which JSON strings may hold raw), and text mode reads \r\n as \n
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read prompts file ({e})") from None
    if not (first := next((l for l in lines if l.strip()), None)):
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
        if not (isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]):
            raise ValueError(f'{path}:{lineno}: expected an object with a non-empty "prompt"')
        prompts.append(obj["prompt"])
    return prompts

# --- every script's flags -------------------------------------------------------------------------
def out_dir_for(folder):
    """Where checkpoints made for folder's go: folder itself, but out/<name>/weights/ for a
    committed weights/<name>/, which no script writes into (train_drafter, bench's hints)."""
    full = os.path.abspath(folder)
    if os.path.dirname(full) != os.path.abspath(WEIGHTS_DIR):
        return folder
    return os.path.join(DATA_OUT, os.path.basename(full), "weights")

def check_writable(path):
    """Refuse an output path where no file can be made in the nearest existing folder, before
    the run, leaving nothing. Tried, not asked: as root os.access says yes even in /proc."""
    if os.path.isdir(path) or path.endswith(os.sep) or not path:
        raise ValueError(f"{path or repr(path)}: is a folder or empty; name a file")
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(d):
        d = os.path.dirname(d)
    try:
        tempfile.TemporaryFile(dir=d).close()
    except OSError as e:
        raise ValueError(f"{path}: cannot write there ({d}: {e.strerror})") from None

@contextlib.contextmanager
def one_line_errors():
    """Bad input (a flag, a path, a checkpoint) and Ctrl-C end a command in one line each."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt as e:  # a trainer's message says where it saved its steps
        print("\ninterrupted:", str(e) or "nothing half-written was left behind", file=sys.stderr)
        raise SystemExit(130) from None

class DefaultsHelp(argparse.RawDescriptionHelpFormatter):
    """--help shows each flag's default, unless its text already speaks of one or there is none
    to show: None, or the True/False of a store_true/store_false flag (its name says it)."""
    def _get_help_string(self, action):
        text, d = action.help or "", action.default
        if "default" in text or d is None or isinstance(d, bool) or d == argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"

    def _split_lines(self, text, width):  # "dflash-tree" or "--max-new-tokens" kept whole
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False,
                             break_long_words=False)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelp)
    parser.add_argument("--corpus", choices=CORPORA, default="small",
                        help="small: stdlib + torch + numpy; all: every installed package too")
    parser.add_argument("--out-dir", default=DATA_OUT, help="bins into OUT_DIR/data/ (data-all/)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild bins that are up to date")
    args = parser.parse_args()
    with one_line_errors():  # the check before minutes of encoding
        check_writable(os.path.join(bins_dir(args.out_dir, args.corpus), "train.bin"))
        meta = prepare(args.out_dir, rebuild=args.rebuild, corpus=args.corpus)
    print(f"corpus: {args.corpus}, {sum(meta['files'].values()):,} files (tests excluded; stdlib "
          f"of {sysconfig.get_paths()['stdlib']}): {meta['tokens']['train']:,} train tokens, "
          f"{meta['tokens']['val']:,} val, tokenizer {meta['tokenizer_hash']}")
