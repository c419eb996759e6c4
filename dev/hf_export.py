"""
The export half of interop.py: a target of ours as a Hugging Face Qwen3 folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) and a DFlash drafter in z-lab's folder
layout, the one vLLM (`"method": "dflash"`) and SGLang (`DFLASH`) load. The engine reads these
folders back (checkpoint.load_target, load_drafter("dflash", ...)); writing them is a tool.

    python dev/hf_export.py out/hf          # the committed target, tokenizer and DFlash drafter
    python dev/hf_export.py OUT --target QWEN3_FOLDER   # its dflash.pt alone, as OUT/dflash
    python sample.py --target out/hf/target --weights out/hf/dflash --method dflash --check

NOTE: a drafter that reads the target's last block (the committed one does) exports with a
warning: our feature there is the block's output before the final norm, as vLLM's DFlash reads
it, but transformers' hidden_states (z-lab's reference code) give it after the norm and SGLang
does not capture that layer at all, so there it would accept less or fail to load. Drafters
trained now leave that block out (draft_diffusion.feature_layers).
"""

import argparse
import json
import os
import re
import sys

import torch
from safetensors.torch import save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a file (python dev/hf_export.py)
    sys.path.insert(0, ROOT)
import data
from checkpoint import load_drafter, load_target
from interop import BYTE_CHARS, QWEN3_NAMES, dflash_names, target_names
from model import Config


def save_folder(module, names, cfg, folder, dtype, **extra):
    """config.json (cfg as a Qwen3's, and extra) and model.safetensors under the file's names."""
    c = {theirs: getattr(cfg, ours) for ours, theirs in QWEN3_NAMES.items()}
    c.update(hidden_act="silu", attention_bias=False, tie_word_embeddings=cfg.tie_embeddings,
             model_type="qwen3")
    sd = module.state_dict()  # each file temp-then-rename, and readable by all (save_file: 0600)
    blob = save({theirs: sd[k].to(dtype).contiguous() for k, theirs in names.items()},
                metadata={"format": "pt"})
    with data.atomic_open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(blob)
    data.write_atomic(os.path.join(folder, "config.json"),
                      json.dumps({**c, **extra, "torch_dtype": str(dtype)[6:]}, indent=1))


def save_hf_target(model, folder, dtype=torch.bfloat16, **extra):
    save_folder(model, target_names(model.cfg), model.cfg, folder, dtype,
                architectures=["Qwen3ForCausalLM"], **extra)


def bpe_parts(token, ranks):
    """The two tokens whose merge made `token` (bytes): byte-pair encode it with the ranks below
    its own, as tiktoken would, until two parts remain."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        i = min(range(len(parts) - 1), key=lambda j: ranks.get(parts[j] + parts[j + 1], 1 << 60))
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def save_hf_tokenizer(enc, folder, pattern, eos=None):
    """tokenizer.json of a tiktoken encoding (vocab, merges, split regex, special tokens), and a
    tokenizer_config.json naming the plain fast tokenizer: without one, transformers'
    AutoTokenizer (vLLM's and SGLang's way in) picks Qwen2Tokenizer for a qwen3 config, which
    replaces the file's split regex with Qwen's (single digits) and tokenizes other text."""
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab)
             if i not in enc._special_tokens.values()}
    spell = lambda b: "".join(BYTE_CHARS[x] for x in b)
    merges = [[spell(a), spell(b)] for tok in sorted(ranks, key=ranks.get) if len(tok) > 1
              for a, b in [bpe_parts(tok, ranks)]]
    level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=False, use_regex=False)
    specials = sorted(enc._special_tokens.items(), key=lambda x: x[1])
    # NOTE: tokenizers' regex engine (Oniguruma) reads a possessive count, \p{N}{1,3}+, as a
    # repeat of the count: any number of digits ("2024" one piece, tiktoken's "202", "4"). Ours
    # is last in its alternative, where a plain count matches as tiktoken's possessive one.
    pattern = re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)
    split = dict(type="Split", pattern=dict(Regex=pattern), behavior="Isolated", invert=False)
    tj = dict(version="1.0", truncation=None, padding=None, normalizer=None,
              added_tokens=[dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False,
                                 normalized=False, special=True) for s, i in specials],
              pre_tokenizer=dict(type="Sequence", pretokenizers=[split, level]),
              post_processor=None, decoder=level,
              model=dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None,
                         end_of_word_suffix=None, fuse_unk=False, byte_fallback=False,
                         ignore_merges=False, vocab={spell(t): i for t, i in ranks.items()},
                         merges=merges))
    with data.atomic_open(os.path.join(folder, "tokenizer.json"), "wb") as f:
        f.write(json.dumps(tj, ensure_ascii=False).encode())
    config = dict(tokenizer_class="PreTrainedTokenizerFast", **({"eos_token": eos} if eos else {}))
    data.write_atomic(os.path.join(folder, "tokenizer_config.json"), json.dumps(config, indent=1))


def last_layer_warning(dflash):
    """The NOTE of this file's docstring, for a drafter it applies to; else None."""
    if dflash.cfg.n_layer in dflash.hidden_layers:
        return (f"warning: this drafter reads the target's last block ({dflash.cfg.n_layer}) "
                "before the final norm: vLLM gives it so, transformers' hidden_states (z-lab's "
                "code) after the norm, SGLang not at all (dev/hf_export.py)")
    return None


def save_zlab_dflash(dflash, folder, dtype=torch.bfloat16):
    """z-lab's DFlashDraftModel folder: our layer i (the output of block i) is their id i - 1."""
    ids = [l - 1 for l in dflash.hidden_layers]
    cfg = Config(**{**vars(dflash.layer_cfg), "n_layer": dflash.n_layer})
    save_folder(dflash, dflash_names(dflash.n_layer), cfg, folder, dtype,
                architectures=["DFlashDraftModel"], block_size=dflash.block_size,
                num_target_layers=dflash.cfg.n_layer,
                dflash_config=dict(target_layer_ids=ids, mask_token_id=dflash.mask_id))


def main(argv=None):
    p = argparse.ArgumentParser(description="OUT/dflash: the z-lab DFlash folder of a dflash.pt; "
                                "OUT/target: for a target of ours, its Qwen3 folder and tokenizer")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--target", default=os.path.join(data.REF_WEIGHTS, "target.pt"),
                   help="target checkpoint or Qwen3 folder (default: the committed one)")
    p.add_argument("--weights", help="folder of its dflash.pt (default: the target's)")
    args = p.parse_args(argv)
    try:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise ValueError(f"{args.out} is a file; name a folder to write")
        target = load_target(args.target)
        dflash = load_drafter("dflash", target, args.weights or os.path.dirname(args.target)).dflash
        hf, zlab = os.path.join(args.out, "target"), os.path.join(args.out, "dflash")
        save_zlab_dflash(dflash, zlab)
        print(f"wrote {zlab} (DFlashDraftModel)")
        if warning := last_layer_warning(dflash):
            print(warning)
        if not os.path.isdir(args.target):  # a Hugging Face target is one already
            enc = data.get_encoding()
            save_hf_target(target, hf, eos_token_id=enc.eot_token)
            save_hf_tokenizer(enc, hf, data.PAT_STR, eos=data.EOT)
            print(f"wrote {hf} (Qwen3ForCausalLM, tokenizer.json, tokenizer_config.json)")
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
