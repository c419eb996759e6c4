"""
Where the benchmark's checkpoints come from: bench.py's first step, so that `python bench.py`
works on a fresh machine in one command.

    target, target_path, found, skipped = find_or_train(args, methods, device, dtype)

Looks in --weights DIR only (training nothing), else in the committed reference weights
weights/<preset>/ (the tokenizer's hash must match), else in out/<preset>/. Whatever is still
missing is trained there first: the plan is printed with its minutes, each step shows its
progress, and a killed step resumes on the next run from its run file, which the trainers save
every 2 minutes (--save-minutes), so a kill loses at most about that. Drafters trained for the
committed target go to out/<preset>/weights/, so that they never mix with drafters of a target
trained here: each mtp, eagle and dflash checkpoint records its target's weights_hash, and one
trained for another target is never used (the draft model, a small target of its own, fits any).

Not in DESIGN.md's file list: it was ~120 lines of bench.py, a second idea in that file.
NOTE: this module and the weights/ folder sit side by side on purpose; weights/ has no
__init__.py, so `import weights` finds this file (with one, the folder would win).
"""

import os
import time

import data
import train  # the target's and draft model's trainer; its run_path names every run file
from checkpoint import FEATURE_DRAFTERS as MODULES, load_checkpoint, load_target, weights_hash
from data import check_writable

CKPT = {"draft": "draft.pt", "mtp": "mtp.pt", "eagle": "eagle.pt", "dflash": "dflash.pt"}
# Budgets of a run from scratch, in minutes (the whole run must fit in ~20 min on 2 cores;
# trained this briefly the target loops, which bench's card then says: the committed weights
# are the real benchmark). Distillation data is built once and shared by the three drafters.
MINUTES = {"data": 0.5, "target": 6.0, "draft": 1.5, "distill": 1.5, "mtp": 1.5, "eagle": 1.5, "dflash": 2.0}
DISTILL_ARGS = ["--n-seqs", "256", "--n-val-seqs", "32", "--gen-len", "128"]


class Unusable(Exception):
    """--weights DIR (or its --target FILE) holds no target that loads: bad input, one line."""


def try_load_target(path, device, dtype):
    """(model, None) or (None, reason): a missing file or another tokenizer is not fatal here."""
    try:
        return load_target(path, device=device, dtype=dtype), None
    except (FileNotFoundError, ValueError) as e:
        return None, str(e)


def usable(method, folders, th):
    """The first folder with a usable checkpoint for `method`, or None (missing, unreadable, of
    another kind, or stale: trained for another target, th being this target's hash)."""
    for d in folders:
        path = os.path.join(d, CKPT[method])
        if not os.path.exists(path):
            continue
        if method == "draft":  # a small target: only the tokenizer must match (its loader checks)
            return d
        try:
            if load_checkpoint(path, kind=method).get("target_hash") == th:
                return d
            print(f"{method}: {path} was trained for another target, not using it")
        except ValueError as e:
            print(f"{method}: {e}")
    return None


def train_resuming(trainer, what, run_file, argv):
    """trainer.main(argv), continuing the run an earlier plan left in run_file when it was killed."""
    resume = ["--resume", run_file] if os.path.exists(run_file) else []
    try:
        trainer.main(trainer.get_parser().parse_args(argv + resume))
    except ValueError as e:  # not a run of this plan (other flags or target, a torn file): start over
        if not resume or not os.path.exists(run_file):  # not resuming, or it resumed and finished: a real error
            raise
        print(f"{what}: not resuming ({e}); training from scratch")
        trainer.main(trainer.get_parser().parse_args(argv))


def find_or_train(args, methods, device, dtype):
    """-> target, target_path, {method: folder of its checkpoint}, [(method, why) skipped].
    args: bench's weights, target, retrain, preset and out. Raises Unusable when --weights DIR
    has no target that loads, or when what is missing cannot be saved under --out."""
    target, target_path, found, train_dir = find(args, [m for m in methods if m in CKPT], device, dtype)
    if train_dir is None:  # --weights DIR: nothing is trained
        skipped = [(m, f"no usable {CKPT[m]} in {args.weights}") for m, d in found.items() if not d]
    else:
        target, skipped = train_missing(args, target, target_path, found, train_dir, device, dtype)
    return target, target_path, {m: d for m, d in found.items() if d}, skipped


def find(args, wanted, device, dtype):
    """-> target (None when none loads), its path, {method: folder or None}, and the folder that
    what is missing trains into (None for --weights DIR, which trains nothing)."""
    ref_dir, out_dir = os.path.join(data.WEIGHTS_DIR, args.preset), os.path.join(args.out, args.preset)
    target = None
    if args.weights:
        target_path, folders, train_dir = args.target or os.path.join(args.weights, "target.pt"), [args.weights], None
        target, why = try_load_target(target_path, device, dtype)
        if target is None:
            hint = "" if args.target else " (--target FILE names a target kept elsewhere, e.g. weights/cpu/target.pt)"
            raise Unusable(why + hint)
    elif not args.retrain and os.path.exists(os.path.join(ref_dir, "target.pt")):
        target_path = os.path.join(ref_dir, "target.pt")
        target, why = try_load_target(target_path, device, dtype)
        if target is None:
            print(f"weights: not using the committed {ref_dir}: {why}; falling back to {out_dir}")
        else:  # drafters missing from weights/ are trained for *this* target, apart from out_dir's
            folders, train_dir = [ref_dir, os.path.join(out_dir, "weights")], os.path.join(out_dir, "weights")
            print(f"weights: the committed reference target {target_path}")
    if target is None:
        target_path, folders, train_dir = os.path.join(out_dir, "target.pt"), [out_dir], out_dir
        target, why = try_load_target(target_path, device, dtype)
        print(f"weights: reusing {target_path}" if target else f"weights: no usable target ({why})")
    th = weights_hash(target.cfg, target.state_dict()) if target else None
    draft_folders = folders if args.weights else folders + [out_dir]  # the small model fits any target
    found = {m: usable(m, draft_folders if m == "draft" else folders, th) for m in wanted}
    if "mtp" in found and target is not None and target.ckpt.get("mtp_state_dict"):
        found["mtp"] = folders[0]  # native MTP heads live in the target checkpoint
    return target, target_path, found, train_dir


def train_missing(args, target, target_path, found, train_dir, device, dtype):
    """Trains into train_dir what find did not find (the target when it is None, each method
    whose found[m] is None), after printing the plan with its minutes; fills found[m] for each
    drafter it trains. -> the target (trained here if it was missing), [(method, why) skipped]."""
    todo = ["target"] * (target is None) + [m for m, d in found.items() if not d]
    if todo and not os.path.exists(os.path.join(data.DATA_OUT, "data", "meta.json")):
        todo.insert(0, "data")
    first = next((m for m in todo if m in MODULES), None)  # it builds the distillation data they share
    cost = lambda m: MINUTES[m] + (MINUTES["distill"] if m == first else 0)
    if "target" in todo and device.type == "cpu" and args.preset == "gpu":
        print("NOTE: the gpu preset is sized for a GPU: on a CPU these minutes train it for few "
              "steps, and the benchmark then measures an under-trained target (--preset cpu has committed weights)")
    if todo:
        try:  # before any minutes are spent: --out a file or an unwritable folder
            check_writable(os.path.join(train_dir, CKPT.get(next(m for m in todo if m != "data"), "target.pt")))
        except ValueError as e:
            raise Unusable(f"{e} (bench trains what is missing into --out)") from None
        print(f"train: {', '.join(f'{m} (~{cost(m):g} min)' for m in todo)} into {train_dir}, "
              f"~{sum(map(cost, todo)):g} min in all, then the benchmark"
              + (f" ({first}'s minutes include the distillation data all drafters share)" if first else ""))
    skipped, t_start = [], time.time()
    for i, what in enumerate(todo, 1):
        print(f"\n=== [{i}/{len(todo)}] {what} (~{cost(what):g} min; ~{sum(map(cost, todo[i - 1:])):g} min left "
              f"in the plan) ===", flush=True)
        common = ["--device", str(device)]
        if what == "data":
            data.prepare()  # the token bins live in <repo>/out/data whatever --out says: a shared cache
        elif what == "target":
            argv = ["--preset", args.preset, "--out-path", target_path, "--minutes", str(MINUTES["target"]),
                    "--quality-prompts", "8", *common]
            train_resuming(train, what, train.run_path(target_path), argv)
            target = load_target(target_path, device=device, dtype=dtype)
        elif what == "draft":
            preset = {"cpu": "cpu-draft", "gpu": "gpu-draft"}.get(args.preset, args.preset)
            draft_path = os.path.join(train_dir, CKPT["draft"])
            argv = ["--preset", preset, "--out-path", draft_path, "--minutes", str(MINUTES["draft"]),
                    "--quality-prompts", "0", *common]
            train_resuming(train, what, train.run_path(draft_path), argv)
            found["draft"] = train_dir
        else:
            try:
                import train_drafter
                argv = ["--method", what, "--target", target_path, "--out-dir", train_dir, "--minutes",
                        str(MINUTES[what]), "--eval-every", "50", *DISTILL_ARGS, *common]
                train_resuming(train_drafter, what, train.run_path(os.path.join(train_dir, CKPT[what])), argv)
                found[what] = train_dir
            except Exception as e:  # a drafter module still being written must not stop the others
                skipped.append((what, f"training failed ({type(e).__name__}: {e})"))
        print(f"=== {what} done; {(time.time() - t_start) / 60:.1f} min since the plan started", flush=True)
    return target, skipped
