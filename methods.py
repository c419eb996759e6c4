"""
Which drafter, by name: the registry that bench.py, speculate.py's command line and weights.py
share. A method is a name in METHODS and a loader, loader(target, out_dir, **options) ->
drafter (None for plain decoding), that builds the drafter from its checkpoint beside the
target; the loader's keyword arguments with defaults are the method's options. DRAFTER_FLAGS
turns some of them into command-line flags, the same in bench.py and speculate.py. README,
"Write a drafter of your own", adds a method here.

    import methods
    drafter = methods.load_drafter("dflash", target, "weights/cpu", block_size=8)
"""

import importlib
import inspect
import os

import model
from draft_simple import ModelDrafter, NgramDrafter

METHODS = ("ar", "ngram", "draft", "mtp", "eagle", "dflash")
# the drafters that read target features (train_drafter.py trains them) -> the file that holds each
MODULES = {"mtp": "mtp", "eagle": "draft_eagle", "dflash": "draft_diffusion"}


def drafter_loader(method):
    """The function that builds a method's drafter: loader(target, out_dir, **its options).
    A method of your own adds a branch here; its options are its loader's keyword arguments."""
    if method == "ar":
        return lambda target, out_dir: None
    if method == "ngram":
        return lambda target, out_dir, ngram_n=3: NgramDrafter(n=ngram_n)
    if method == "draft":
        def load_draft_model(target, out_dir):  # follows the target's device and dtype
            w = target.head.weight
            return ModelDrafter(model.load_target(os.path.join(out_dir, "draft.pt"), device=w.device, dtype=w.dtype))
        return load_draft_model
    module = MODULES.get(method)  # imported on demand: a run of one method loads no other drafter's code
    if module is None:
        raise ValueError(f"{method} is in METHODS, but drafter_loader has no branch for it")
    return importlib.import_module(module).load_drafter


def load_drafter(method, target, out_dir, **kw):
    """Build the drafter for a method name from its checkpoint next to the target; kw are the
    options of its loader (DRAFTER_FLAGS set some from the command line)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    loader = drafter_loader(method)
    params = inspect.signature(loader).parameters.values()
    options = [p.name for p in params if p.default is not p.empty]  # target and out_dir have no default
    if set(kw) - set(options) and not any(p.kind is p.VAR_KEYWORD for p in params):
        # a misspelt option is named along with what the method takes (Python's own line names a <lambda>)
        raise TypeError(f"{method} takes no option {', '.join(sorted(set(kw) - set(options)))}; "
                        f"its options: {', '.join(options) or 'none'}")
    return loader(target, out_dir, **kw)


# the committed drafters' options as flags, the same in bench.py and speculate.py:
# flag -> (method, its loader's option, which is also the flag's dest; argparse settings)
DRAFTER_FLAGS = {
    "--block-size": ("dflash", "block_size", dict(type=int, default=None, help="dflash block size S (drafts "
                     "S-1); at most what it was trained for (default: the block it was trained with, 16 for the "
                     "committed one)")),
    "--dflash-argmax": ("dflash", "dflash_sample", dict(action="store_false", help="dflash at T > 0: take each "
                        "slot's argmax instead of drawing from its q (both are lossless; on the cpu weights "
                        "sampling accepted more: tau ~2.1 vs ~1.2 at T = 1 on the 10 default prompts)")),
    "--mtp-draft": ("mtp", "mtp_draft", dict(type=int, default=None, help="mtp: draft N tokens per step, one per "
                    "module, so 1..its depth (default: all its modules)")),
    "--mtp-margin": ("mtp", "mtp_margin", dict(type=float, default=0.0, help="mtp: stop drafting once the top-1 "
                     "vs top-2 logit margin falls below M (default: %(default)s = never)")),
}


def add_drafter_flags(parser):
    for flag, (_, option, kw) in DRAFTER_FLAGS.items():
        parser.add_argument(flag, dest=option, **kw)


def idle_drafter_flags(args, parser, methods):
    """(flag, its method) for each DRAFTER_FLAGS flag given for a method not in methods: it would change nothing."""
    return [(flag, m) for flag, (m, option, _) in DRAFTER_FLAGS.items()
            if m not in methods and getattr(args, option) != parser.get_default(option)]


def drafter_options(method, args):
    """The loader options DRAFTER_FLAGS give a method (dflash's block size, ...)."""
    return {option: getattr(args, option) for m, option, _ in DRAFTER_FLAGS.values() if m == method}
