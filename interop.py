"""
Real formats in (DESIGN.md sec. 1): a Hugging Face Qwen3 checkpoint and its tokenizer load into
model.py's Transformer and a tiktoken encoding, and a DFlash drafter in z-lab's folder layout,
the one vLLM (`"method": "dflash"`) and SGLang (`DFLASH`) load, into our DFlash. Our target is a
Qwen3 already, so this file is names, shapes and files, no math. checkpoint.load_target takes a
Qwen3 folder wherever it takes a .pt file, and load_drafter("dflash", ...) a z-lab folder.

    python dev/hf_export.py out/hf       # the way out: the committed target, tokenizer, DFlash
    python sample.py --target out/hf/target --weights out/hf/dflash --method dflash --check
"""

import json
import os
import unicodedata

import tiktoken
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draft_diffusion import DFlash
from model import Config, Transformer

# the names of one layer's weights: ours -> Qwen3's (the DFlash drafter's layers use them too)
LAYER_KEYS = {f"{ours}.weight": f"{theirs}.weight" for ours, theirs in [
    ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
    ("attn.wq", "self_attn.q_proj"), ("attn.wk", "self_attn.k_proj"),
    ("attn.wv", "self_attn.v_proj"), ("attn.wo", "self_attn.o_proj"),
    ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"),
    ("mlp.w_gate", "mlp.gate_proj"), ("mlp.w_up", "mlp.up_proj"), ("mlp.w_down", "mlp.down_proj")]}
# GPT-2's map of the 256 bytes to the characters that byte-level BPE vocabularies spell tokens
# with (a space is 'Ġ'): printable bytes (! to ~, ¡ to ¬, ® to ÿ) stay, the rest from chr(256)
PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
OTHERS = [b for b in range(256) if b not in PRINTABLE]
BYTE_CHARS = {**{b: chr(b) for b in PRINTABLE}, **{b: chr(256 + i) for i, b in enumerate(OTHERS)}}
# Config's fields -> their names in a Qwen3 config.json (dev/hf_export.py writes them in order)
QWEN3_NAMES = dict(n_embd="hidden_size", n_layer="num_hidden_layers", n_head="num_attention_heads",
                   n_kv_head="num_key_value_heads", head_dim="head_dim", vocab_size="vocab_size",
                   mlp_hidden="intermediate_size", max_seq_len="max_position_embeddings",
                   norm_eps="rms_norm_eps", rope_theta="rope_theta")


# folders: config.json and safetensors
def readable(load, folder, *args):
    """load(folder, *args), with a damaged folder's error (a field missing or of the wrong type,
    a truncated or unparsable file) as one line that names the folder."""
    try:
        return load(folder, *args)
    except FileNotFoundError:  # already one line that names the file
        raise
    except (KeyError, TypeError, AttributeError, OSError, SafetensorError, UnicodeError,
            json.JSONDecodeError) as e:
        raise ValueError(f"{folder}: damaged ({type(e).__name__}: {e})") from None


def read_config(folder, architecture):
    """config.json -> its dict and Config's fields (RoPE: rope_theta, or transformers 5's
    rope_parameters)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json (not a Hugging Face model folder)")
    with open(path) as f:
        c = json.load(f)
    if architecture not in (c.get("architectures") or []):
        raise ValueError(f"{path}: this loads {architecture}, not {c.get('architectures')}")
    rope = c.get("rope_parameters") or {}  # transformers 5's home of RoPE's settings
    swa = c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or [])
    if (c.get("attention_bias") or c.get("hidden_act", "silu") != "silu" or swa
            or rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1)) != 1):
        raise ValueError(f"{path}: attention biases, sliding windows, partial RoPE or an "
                         f"activation other than silu are not supported")
    if rope.get("rope_type", rope.get("type", "default")) != "default" or c.get("rope_scaling"):
        raise ValueError(f"{path}: RoPE scaling {c.get('rope_scaling') or rope} is not supported")
    fields = {**c, "rope_theta": rope.get("rope_theta", c.get("rope_theta", 10000.0)),
              "head_dim": c.get("head_dim") or 0}  # model.Config checks each field's type
    return c, {ours: fields[theirs] for ours, theirs in QWEN3_NAMES.items()}


def read_weights(folder):
    """All tensors of model.safetensors, or of the shards model.safetensors.index.json names."""
    index, shards = os.path.join(folder, "model.safetensors.index.json"), ["model.safetensors"]
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    return {k: v for s in shards for k, v in load_file(os.path.join(folder, s)).items()}


def load_renamed(module, sd, names, where):
    """module's weights from sd, where names maps our parameter names to the file's. Missing,
    unexpected and misshapen tensors are refused in one line, before anything is copied."""
    missing = [t for t in names.values() if t not in sd]
    extra = sorted(set(sd) - set(names.values()))
    bad = [f"{t} {tuple(sd[t].shape)} {sd[t].dtype} (config: {tuple(v.shape)})" for k, v in
           module.state_dict().items() if (t := names.get(k)) in sd
           and (sd[t].shape != v.shape or not sd[t].is_floating_point())]  # int8: quantized
    for what, items in (("missing", missing), ("unexpected", extra),
                        ("of the wrong shape or dtype", bad)):
        if items:
            raise ValueError(f"{where}: {len(items)} tensors {what}, e.g. {', '.join(items[:3])}")
    # copied into the module's own (fp32) tensors one by one: no float copy of them all at once
    module.load_state_dict({k: sd[theirs] for k, theirs in names.items()}, strict=False)


# the target: Qwen3ForCausalLM
def target_names(cfg):
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:  # tied: lm_head is absent from the file
        names["head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layer):
        names.update({f"blocks.{i}.{k}": f"model.layers.{i}.{v}" for k, v in LAYER_KEYS.items()})
    return names


def load_hf_target(folder, device="cpu", dtype=torch.float32):
    c, fields = read_config(folder, "Qwen3ForCausalLM")
    cfg = Config(**fields, tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    model, sd = Transformer(cfg), read_weights(folder)
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    load_renamed(model, sd, target_names(cfg), folder)
    model.ckpt = {"kind": "target", "hf_folder": folder}
    return model.to(device=device, dtype=dtype).eval()


# the tokenizer: tokenizer.json (byte-level BPE) <-> tiktoken
class HFEncoding(tiktoken.Encoding):
    """tiktoken as transformers reads a tokenizer.json: NFC first where it says so (Qwen's), and
    its added tokens ("<|im_start|>", "<think>") matched in any text, encode_ordinary's too (our
    own tokenizer keeps "<|endoftext|>" in a source file as text)."""
    nfc = False

    def encode_ordinary(self, text):
        return self.encode(text, allowed_special="all")

    def encode(self, text, **kw):
        return super().encode(unicodedata.normalize("NFC", text) if self.nfc else text, **kw)


def split_pattern(pre, path):
    """The split regex of a tokenizer.json pre_tokenizer. tiktoken splits once, by one regex's
    matches, so only two are taken: a Split by a regex, then a ByteLevel that maps bytes (Qwen's,
    Llama 3's), or a ByteLevel that splits by GPT-2's regex too. Others loaded with other ids."""
    steps = pre.get("pretokenizers", [pre]) if pre else []
    kinds, split = [p["type"] for p in steps], steps[0] if steps else {}
    if kinds == ["ByteLevel"] and split.get("use_regex", True):
        return r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    if (kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) and "Regex" in
            split["pattern"] and split.get("behavior") == "Isolated" and not split.get("invert")):
        return split["pattern"]["Regex"]
    raise ValueError(f"{path}: pre_tokenizer {' + '.join(kinds) or 'none'} is not supported: only "
                     "an Isolated Split by a Regex then a ByteLevel with use_regex false (Qwen's), "
                     "or a ByteLevel alone (GPT-2's)")


def load_hf_tokenizer(folder):
    """tiktoken for a byte-level BPE tokenizer.json: a token's rank is its id (merges were
    added in order, so the lowest id is the first merge, which is tiktoken's rule)."""
    path = os.path.join(folder, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    if tj["model"]["type"] != "BPE":
        raise ValueError(f"{path}: a {tj['model']['type']} model; only byte-level BPE is supported")
    pre, added = tj.get("pre_tokenizer") or {}, tj.get("added_tokens") or []
    norm = tj.get("normalizer") or {}
    norms = norm.get("normalizers", [norm] if norm else [])  # NFC alone or in a sequence, or none
    if (any(n["type"] != "NFC" for n in norms)
            or any(p.get("add_prefix_space") for p in pre.get("pretokenizers", [pre]))
            or any(t.get(k) for t in added for k in ("lstrip", "rstrip", "single_word"))):
        raise ValueError(f"{path}: a normalizer other than NFC, a prefix space or added tokens "
                         "that strip or match whole words are not supported")
    byte_of = {c: b for b, c in BYTE_CHARS.items()}
    try:
        ranks = {bytes(byte_of[c] for c in tok): i for tok, i in tj["model"]["vocab"].items()}
    except KeyError:
        raise ValueError(f"{path}: not a byte-level vocabulary") from None
    if any(bytes([b]) not in ranks for b in range(256)):  # text with one made tiktoken panic
        raise ValueError(f"{path}: a byte-level vocabulary without all 256 bytes")
    specials = {t["content"]: t["id"] for t in added}  # matched first (also those in the vocab)
    enc = HFEncoding(name=os.path.basename(os.path.abspath(folder)), mergeable_ranks=ranks,
                     pat_str=split_pattern(pre, path), special_tokens=specials)  # as transformers
    enc.nfc = bool(norms)
    return enc


# the DFlash drafter: z-lab's layout
def dflash_names(n_layer):
    names = {"fc.weight": "fc.weight", "ctx_norm.weight": "hidden_norm.weight",
             "norm.weight": "norm.weight"}
    for i in range(n_layer):
        names.update({f"layers.{i}.{k}": f"layers.{i}.{v}" for k, v in LAYER_KEYS.items()})
    return names


def load_zlab_dflash(folder, target):
    """A z-lab DFlash folder as our DFlash module for this target. z-lab's target_layer_ids
    index transformers' hidden_states[id + 1], the output of 0-based layer id: our layer id + 1."""
    c, fields = read_config(folder, "DFlashDraftModel")
    tc, dc, L = target.cfg, c.get("dflash_config") or {}, target.cfg.n_layer
    layer_cfg = Config(**{**fields, "vocab_size": tc.vocab_size})
    n, d = c.get("num_target_layers", L), c.get("num_hidden_layers")  # without ids: z-lab's rule
    ids = dc.get("target_layer_ids") or ([n // 2] if d == 1 else  # (ours must come in order)
                                         [round(1 + i * (n - 4) / (d - 1)) for i in range(d)])
    if n != L or not ids or ids != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < L:
        raise ValueError(f"{folder}: target_layer_ids {ids} of {n} do not fit a target of {L}")
    shape, mask = lambda c: (c.n_embd, c.head_dim, c.rope_theta), dc.get("mask_token_id")
    block = dc.get("block_size", c.get("block_size", 16))  # SGLang reads dflash_config's first
    # it reads the target's embeddings and RoPE tables, and masks with a token of its vocabulary
    if (shape(layer_cfg) != shape(tc) or type(mask) is not int or mask not in range(tc.vocab_size)
            or type(block) is not int):
        raise ValueError(f"{folder}: hidden size, head size, RoPE theta, mask_token_id {mask} or "
                         f"block_size {block!r} do not fit the target")
    model = DFlash(tc, n_layer=c["num_hidden_layers"], block_size=block,
                   mask_id=mask, hidden_layers=[i + 1 for i in ids], layer_cfg=layer_cfg)
    load_renamed(model, read_weights(folder), dflash_names(model.n_layer), folder)
    return model.to(target.head.weight).eval()
