"""
interop.py against the libraries that define the formats (DESIGN.md sec. 10): transformers'
Qwen3ForCausalLM and tokenizers' byte-level BPE, on tiny random models made here (no hub).

- a Qwen3 folder saved by transformers (tied and untied, fp32 and bf16, sharded) loads with
  transformers' logits and greedy continuation; our export loads back into transformers
- tokenizer.json <-> tiktoken: the same ids on every committed held-out prompt, both ways
- a DFlash drafter in z-lab's layout drafts what it drafted before, and decoding on a loaded
  Qwen3 target stays lossless for every method; bad folders are refused in one line

    python -m pytest -q tests/test_interop.py
"""

import json
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import data
import interop
import speculate
from dev import hf_export
from checkpoint import load_drafter, load_target, save_checkpoint, weights_hash
from draft_diffusion import DFlash, DFlashDrafter
from draft_simple import ModelDrafter, NgramDrafter
from model import generate as naive_generate

V = 97
# Qwen2's split regex (Qwen3 keeps it): a GPT-4-like pre-tokenizer with single digits
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def hf_qwen3(tmp_path, name="qwen", tied=False, dtype=torch.float32, shard=None, seed=0):
    """A random tiny Qwen3ForCausalLM saved by transformers; head_dim 32 is not C / n_head (16)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6,
                                   tie_word_embeddings=tied)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that a norm loaded into the wrong place shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    folder = str(tmp_path / name)
    model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder, model.float()


@pytest.mark.parametrize("tied, dtype, shard", [(False, torch.float32, None), (True, torch.float32, None),
                                                (False, torch.bfloat16, None), (False, torch.float32, "40KB")])
def test_a_transformers_qwen3_loads_with_its_logits(tmp_path, tied, dtype, shard):
    folder, _ = hf_qwen3(tmp_path, tied=tied, dtype=dtype, shard=shard)
    # transformers' own reading of the folder, in fp32 (a model cast to bf16 and back in place
    # would also have rounded its RoPE frequencies)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if shard:
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    ours = load_target(folder)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids)[0] - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    out = hf.generate(ids[:1], max_new_tokens=12, do_sample=False)[0, 20:].tolist()
    assert naive_generate(ours, ids[0].tolist(), 12) == out
    # and back: our export loads into transformers with the same logits (bf16 on disk)
    hf_export.save_hf_target(ours, str(tmp_path / "back"), dtype=torch.float32)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        assert (again(ids).logits - ours(ids)[0]).abs().max().item() <= 1e-5


def logits_gap(folder, T):
    """The largest difference between our logits and transformers' for a folder (both fp32)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (load_target(folder)(ids)[0] - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("change", [
    {"rope_parameters": None},                       # no RoPE field at all: theta 10,000
    {"rope_theta": 1e6},                             # both: transformers 5 reads rope_parameters
    {"tie_word_embeddings": None},                   # absent: untied, lm_head in the file
])
def test_config_fields_left_out_or_doubled_read_as_transformers_reads_them(tmp_path, change):
    """A config.json written by hand or by another version may leave out rope_theta or
    tie_word_embeddings, or carry both rope_theta and rope_parameters: each is read as
    transformers reads it, the same logits. (A default theta of 1e6, the top-level theta
    preferred, or a missing tie read as tied loaded a model with other logits, silently;
    transformers' own configs always write both fields, so the test above saw none of it.)"""
    folder, _ = hf_qwen3(tmp_path)
    path = os.path.join(folder, "config.json")
    c = json.load(open(path))
    for k, v in change.items():
        if v is None:
            c.pop(k)
        else:
            c[k] = v
    json.dump(c, open(path, "w"))
    assert logits_gap(folder, 40) <= 1e-5


def test_a_tied_checkpoint_that_stores_lm_head_anyway_loads(tmp_path):
    """Some tied checkpoints also store lm_head.weight (a copy of the embedding): it is dropped,
    not refused as an unexpected tensor, and the model has transformers' logits."""
    from safetensors.torch import load_file, save_file
    folder, _ = hf_qwen3(tmp_path, tied=True)
    weights = os.path.join(folder, "model.safetensors")
    sd = load_file(weights)
    assert "lm_head.weight" not in sd
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, weights,
              metadata={"format": "pt"})
    assert logits_gap(folder, 20) <= 1e-5


def test_our_tokenizer_exports_to_a_tokenizer_json_with_the_same_ids(tmp_path):
    enc = data.get_encoding()
    hf_export.save_hf_tokenizer(enc, str(tmp_path), data.PAT_STR)
    tk = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    prompts = data.reference_prompts(data.N_REFERENCE_PROMPTS)
    assert all(tk.encode(p).ids == enc.encode_ordinary(p) for p in prompts)
    back = interop.load_hf_tokenizer(str(tmp_path))
    assert all(back.encode_ordinary(p) == enc.encode_ordinary(p) for p in prompts)
    assert back.encode(data.MASK, allowed_special="all") == [enc.n_vocab - 1]


def trained_bpe(pre, normalizer=None):
    """A byte-level BPE of 700 tokens that tokenizers trains on half the committed prompts, with
    pre-tokenizer pre (and a normalizer, if any); the caller saves it where it wants."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre, decoders.ByteLevel()
    if normalizer is not None:
        tk.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(data.reference_prompts(data.N_REFERENCE_PROMPTS)[::2], trainer)
    return tk


def test_a_qwen_style_tokenizer_json_converts_to_tiktoken(tmp_path):
    """A byte-level BPE trained here with tokenizers, Qwen's split regex, NFC and specials: the
    tiktoken built from its tokenizer.json gives its ids on every committed prompt."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    tk = trained_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC())
    prompts = data.reference_prompts(data.N_REFERENCE_PROMPTS)
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tk.add_tokens(["<think>"])  # an added token that is not special, as Qwen3's
    tk.save(str(tmp_path / "tokenizer.json"))
    enc = interop.load_hf_tokenizer(str(tmp_path))
    text = prompts + ["cafe\u0301 = 'naïve'  # é, NFC\n",  # a combining accent: NFC changes it
                      "<|im_start|>user\n<think>x = 1</think><|im_end|>"]  # added tokens: matched
    assert all(enc.encode_ordinary(t) == tk.encode(t).ids for t in text)
    assert enc.encode("<|im_start|>x<|im_end|>", allowed_special="all") == \
        tk.encode("<|im_start|>x<|im_end|>").ids


def random_dflash(target, **kw):
    torch.manual_seed(3)
    df = DFlash(target.cfg, n_layer=2, n_features=2, block_size=6, mask_id=V - 1, **kw)
    with torch.no_grad():
        for n, p in df.named_parameters():
            p.normal_(1.0 if "norm" in n else 0.0, 0.3 if "norm" in n else 0.1)
    return df.eval()


def test_a_dflash_drafter_round_trips_through_the_zlab_layout(tmp_path):
    folder, _ = hf_qwen3(tmp_path)
    target = load_target(folder)
    df = random_dflash(target)
    hf_export.save_zlab_dflash(df, str(tmp_path / "dflash"), dtype=torch.float32)
    c = json.load(open(tmp_path / "dflash" / "config.json"))
    assert c["architectures"] == ["DFlashDraftModel"] and c["block_size"] == 6
    assert c["dflash_config"] == {"target_layer_ids": [l - 1 for l in df.hidden_layers], "mask_token_id": V - 1}
    back = load_drafter("dflash", target, str(tmp_path / "dflash"))
    prompt = [[5, 9, 2, 7, 7, 1, 30], [4, 4]]
    blocks = []
    for dr in (DFlashDrafter(target, df), back):
        tokens = torch.zeros(2, 40, dtype=torch.long)
        tokens[0, :7], tokens[1, :2] = torch.tensor(prompt[0]), torch.tensor(prompt[1])
        n = torch.tensor([7, 2])
        _, hidden = target(tokens[:, :7], hidden_layers=dr.hidden_layers)
        dr.prefill(tokens, n, torch.cat(hidden, -1))
        blocks.append(dr.block_logits(tokens, n, 6))
    assert torch.allclose(blocks[0], blocks[1], atol=1e-5)


def test_a_dflash_pt_beside_a_zlab_folder_wins(tmp_path):
    """train_drafter.py --out-dir a z-lab folder (bench's hint for a folder that fails) saves a
    dflash.pt there: that one, trained for this target and hash-checked, is the drafter."""
    folder, _ = hf_qwen3(tmp_path)
    target = load_target(folder)
    hf_export.save_zlab_dflash(random_dflash(target), str(tmp_path / "dflash"))
    ours = random_dflash(target)
    with torch.no_grad():
        ours.fc.weight.mul_(-1.0)  # other weights than the z-lab folder's
    save_checkpoint(str(tmp_path / "dflash" / "dflash.pt"), dict(
        kind="dflash", config=ours.config_dict(), state_dict=ours.state_dict(),
        target_hash=weights_hash(target.cfg, target.state_dict())))
    got = load_drafter("dflash", target, str(tmp_path / "dflash")).dflash
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), ours.state_dict().values()))


def test_every_method_is_lossless_on_a_loaded_qwen3_target(tmp_path):
    from test_eagle import random_eagle
    from test_mtp import random_mtp
    from draft_eagle import EagleDrafter
    from mtp import MTPDrafter
    folder, _ = hf_qwen3(tmp_path, tied=True)
    target = load_target(folder)
    draft_folder, _ = hf_qwen3(tmp_path, name="small", seed=1)
    drafters = dict(ar=None, ngram=NgramDrafter(), draft=ModelDrafter(load_target(draft_folder)),
                    mtp=MTPDrafter(target, random_mtp(target)),
                    eagle=EagleDrafter(target, random_eagle(target)),
                    dflash=DFlashDrafter(target, random_dflash(target)))
    prompts = [[5, 9, 2, 7, 7, 1, 30], [4, 4], [1, 2, 3, 1, 2, 3, 1, 2]]
    for name, dr in drafters.items():
        outs, _ = speculate.generate(target, prompts, dr, max_new_tokens=16, K=4)
        assert outs == [naive_generate(target, p, 16) for p in prompts], name


def test_bad_folders_are_refused_in_one_line(tmp_path):
    folder, _ = hf_qwen3(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(str(tmp_path))
    cfg_path = os.path.join(folder, "config.json")
    good = json.load(open(cfg_path))
    for change, message in [({"architectures": ["LlamaForCausalLM"]}, "this loads Qwen3ForCausalLM"),
                            ({"num_hidden_layers": 2}, r"1 tensors unexpected|tensors unexpected"),
                            ({"num_hidden_layers": 4}, "tensors missing"),
                            ({"intermediate_size": 80}, "of the wrong shape or dtype, e.g. model.layers.0.mlp"),
                            ({"use_sliding_window": True}, "sliding windows"),
                            ({"layer_types": ["sliding_attention"] * 3}, "sliding windows"),
                            ({"partial_rotary_factor": 0.5}, "partial RoPE"),
                            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5}}, "partial RoPE")]:
        json.dump({**good, **change}, open(cfg_path, "w"))
        with pytest.raises(ValueError, match=message):
            load_target(folder)
    json.dump(good, open(cfg_path, "w"))
    from safetensors.torch import load_file, save_file
    weights = os.path.join(folder, "model.safetensors")
    sd = load_file(weights)
    save_file({**sd, "model.norm.weight": sd["model.norm.weight"].to(torch.int8)}, weights + ".q")
    os.replace(weights, weights + ".good")
    os.replace(weights + ".q", weights)
    with pytest.raises(ValueError, match=r"wrong shape or dtype, e.g. model.norm.weight \(64,\) torch.int8"):
        load_target(folder)  # was cast to float silently
    os.replace(weights + ".good", weights)
    target = load_target(folder)
    hf_export.save_zlab_dflash(random_dflash(target), str(tmp_path / "dflash"))
    dpath = tmp_path / "dflash" / "config.json"
    dgood = json.load(open(dpath))
    dc = dgood["dflash_config"]
    for change, message in [
            ({"dflash_config": {**dc, "target_layer_ids": [1, 3]}}, r"\[1, 3\] of 3 do not fit"),
            ({"dflash_config": {**dc, "target_layer_ids": [1, 0]}}, r"\[1, 0\] of 3 do not fit"),
            ({"num_target_layers": 36}, r"of 36 do not fit a target of 3"),  # ids fit, not its
            # the drafter rotates with the target's RoPE tables: another theta is refused, not
            # run silently at the target's
            ({"rope_theta": 1e6}, "RoPE theta"),
            ({"dflash_config": {**dc, "mask_token_id": float(V - 1)}}, "mask_token_id 96.0")]:
        json.dump({**dgood, **change}, open(dpath, "w"))
        with pytest.raises(ValueError, match=message):
            load_drafter("dflash", target, str(tmp_path / "dflash"))
    # no target_layer_ids: z-lab's rule (1 to L - 3 over the drafter's layers; one: L // 2)
    without = {k: v for k, v in dc.items() if k != "target_layer_ids"}
    json.dump({**dgood, "dflash_config": without}, open(dpath, "w"))  # 2 layers of 3: [1, 0]
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 0\] of 3 do not fit"):
        load_drafter("dflash", target, str(tmp_path / "dflash"))
    one = str(tmp_path / "one")
    hf_export.save_zlab_dflash(DFlash(target.cfg, n_layer=1, block_size=6, mask_id=V - 1,
                                      hidden_layers=[2]), one)
    c1 = json.load(open(os.path.join(one, "config.json")))
    c1["dflash_config"].pop("target_layer_ids")
    json.dump(c1, open(os.path.join(one, "config.json"), "w"))
    assert load_drafter("dflash", target, one).hidden_layers == (2,)  # id 3 // 2 = 1: our 2
    # SGLang reads dflash_config's block_size first; z-lab's newer drafters keep it only there
    json.dump({**dgood, "block_size": 16, "dflash_config": {**dc, "block_size": 6}}, open(dpath, "w"))
    assert load_drafter("dflash", target, str(tmp_path / "dflash")).dflash.block_size == 6


def damage_config(key, value):
    def damage(folder):
        path = os.path.join(folder, "config.json")
        c = json.load(open(path))
        if value is None:
            c.pop(key)
        else:
            c[key] = value
        json.dump(c, open(path, "w"))
    return damage


def replace_file(name, text=None):  # text None: a directory where the file was
    def damage(folder):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)
        if text is None:
            os.mkdir(path)
        else:
            open(path, "w").write(text)
    return damage


def truncate(name):
    def damage(folder):
        path = os.path.join(folder, name)
        data_ = open(path, "rb").read()
        open(path, "wb").write(data_[:len(data_) // 2])
    return damage


@pytest.mark.parametrize("damage", [
    replace_file("config.json", "[]"), replace_file("config.json", '{"hidden_size": 6'),
    damage_config("hidden_size", None), damage_config("rms_norm_eps", None),
    damage_config("hidden_size", "64"), damage_config("rms_norm_eps", "1e-6"),
    damage_config("rms_norm_eps", float("nan")),
    damage_config("rope_parameters", {"rope_type": "default", "rope_theta": "abc"}),
    damage_config("rope_parameters", {"type": "linear", "factor": 4.0, "rope_theta": 1e4}),
    damage_config("max_position_embeddings", 1e9), damage_config("num_attention_heads", 0),
    truncate("model.safetensors"),
    replace_file("model.safetensors", ""), replace_file("model.safetensors"),
    replace_file("model.safetensors.index.json", "{}")])
def test_a_damaged_qwen3_folder_is_one_error_line_that_names_it(tmp_path, damage):
    """Each was a KeyError, TypeError, AttributeError, OSError or SafetensorError traceback, a
    crash at the first forward pass (a string eps), an allocation of 128 GB (a float context),
    garbage tokens (a NaN eps), or logits off transformers' (RoPE scaling under the older key)."""
    folder, _ = hf_qwen3(tmp_path)
    damage(folder)
    with pytest.raises(ValueError, match=f"^{folder}(/config.json)?: "):
        load_target(folder)


@pytest.mark.parametrize("damage", [
    replace_file("tokenizer.json"), replace_file("tokenizer.json", '{"version": "1.0"}'),
    replace_file("tokenizer.json", '{"model": []}')])
def test_a_damaged_tokenizer_json_is_one_error_line_that_names_its_folder(tmp_path, damage):
    from checkpoint import load_tokenizer
    hf_export.save_hf_tokenizer(data.get_encoding(), str(tmp_path), data.PAT_STR)
    damage(str(tmp_path))
    with pytest.raises(ValueError, match=f"^{tmp_path}: "):
        load_tokenizer(str(tmp_path))


def test_tokenizer_json_features_we_cannot_reproduce_are_refused(tmp_path):
    """Each loaded and gave other ids than transformers (a normalizer other than NFC, a prefix
    space, added tokens that strip), or a Rust panic on the first text with a byte the
    vocabulary lacks. An added token that is also in the vocabulary (BpeTrainer's special tokens,
    GPT-2's <|endoftext|>) was BPE-split; it is matched whole, as transformers does."""
    from checkpoint import load_tokenizer
    hf_export.save_hf_tokenizer(data.get_encoding(), str(tmp_path), data.PAT_STR)
    good = json.load(open(tmp_path / "tokenizer.json"))

    def load(edit):
        tj = json.loads(json.dumps(good))
        edit(tj)
        json.dump(tj, open(tmp_path / "tokenizer.json", "w"))
        return load_tokenizer(str(tmp_path))
    for edit, why in [(lambda tj: tj.update(normalizer={"type": "NFKC"}), "other than NFC"),
                      (lambda tj: tj["pre_tokenizer"]["pretokenizers"][1].update(
                          add_prefix_space=True), "a prefix space"),
                      (lambda tj: tj["added_tokens"][0].update(lstrip=True), "that strip"),
                      (lambda tj: tj["model"]["vocab"].pop(interop.BYTE_CHARS[7]), "256 bytes"),
                      (lambda tj: tj["model"].update(type="WordPiece"), "a WordPiece model"),
                      (lambda tj: tj["model"]["vocab"].update({"\u4e2d": 5000}), "not a byte-level")]:
        with pytest.raises(ValueError, match=f"^{tmp_path}/tokenizer.json: .*{why}"):
            load(edit)
    assert load(lambda tj: tj.update(normalizer={"type": "Sequence",
                                                 "normalizers": [{"type": "NFC"}]})).nfc
    def in_vocab(tj):  # as GPT-2's file holds <|endoftext|>: in the vocab and added
        tj["model"]["vocab"]["<|im_start|>"] = 4098
        tj["added_tokens"].append(dict(good["added_tokens"][0], id=4098, content="<|im_start|>"))
    enc = load(in_vocab)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "<|im_start|>user\nx = 1"
    assert enc.encode_ordinary(text) == tok.encode(text, add_special_tokens=False)
    assert enc.encode_ordinary(text)[0] == 4098


@pytest.mark.parametrize("damage", [
    damage_config("dflash_config", [0, 1]), damage_config("block_size", "6"),
    damage_config("num_hidden_layers", None), truncate("model.safetensors")])
def test_a_damaged_zlab_folder_is_one_error_line_that_names_it(tmp_path, damage):
    folder, _ = hf_qwen3(tmp_path)
    target = load_target(folder)
    zlab = str(tmp_path / "dflash")
    hf_export.save_zlab_dflash(random_dflash(target), zlab)
    damage(zlab)
    with pytest.raises(ValueError, match=f"^{zlab}: "):
        load_drafter("dflash", target, zlab)


def test_a_split_the_tokenizer_cannot_follow_is_refused(tmp_path):
    """tiktoken splits text by the regex's matches; a Split by a String or an inverted or
    removing one used to be taken as that regex (text it does not match was dropped)."""
    hf_export.save_hf_tokenizer(data.get_encoding(), str(tmp_path), data.PAT_STR)
    tj = json.load(open(tmp_path / "tokenizer.json"))
    for change in [dict(pattern={"String": " "}), dict(behavior="Removed"), dict(invert=True)]:
        split = {**tj["pre_tokenizer"]["pretokenizers"][0], **change}
        bad = {**tj, "pre_tokenizer": {**tj["pre_tokenizer"], "pretokenizers": [
            split, tj["pre_tokenizer"]["pretokenizers"][1]]}}
        json.dump(bad, open(tmp_path / "tokenizer.json", "w"))
        with pytest.raises(ValueError, match="Split \\+ ByteLevel is not supported"):
            interop.load_hf_tokenizer(str(tmp_path))


def test_gpt2s_byte_level_pre_tokenizer_gives_its_ids(tmp_path):
    """A ByteLevel alone splits by GPT-2's regex before it maps bytes: the tiktoken built from the
    file splits by that regex too, and gives tokenizers' ids on every committed prompt."""
    from tokenizers import pre_tokenizers
    tk = trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tk.save(str(tmp_path / "tokenizer.json"))
    enc = interop.load_hf_tokenizer(str(tmp_path))
    text = data.reference_prompts(data.N_REFERENCE_PROMPTS) + ["x  =  1\n\n\ty's 12345 ''"]
    assert all(enc.encode_ordinary(t) == tk.encode(t).ids for t in text)


def test_a_pre_tokenizer_that_one_regex_cannot_follow_is_refused(tmp_path):
    """Each loaded. Two Splits (DeepSeek-V3's shape: taken as the first), a ByteLevel that splits
    nothing or a WhitespaceSplit (taken as Qwen's regex) gave other ids than tokenizers on every
    committed prompt; a ByteLevel that splits after a Split or Digits splits twice, which one
    regex reproduces only by chance (on these prompts the ids agreed)."""
    from tokenizers import Regex, pre_tokenizers as P
    level = lambda split: P.ByteLevel(add_prefix_space=False, use_regex=split)
    for pre, kinds in [
            (P.Sequence([P.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
                         P.Split(Regex(data.PAT_STR), behavior="isolated"), level(False)]),
             "Split + Split + ByteLevel"),
            (level(False), "ByteLevel"),
            (P.Sequence([P.WhitespaceSplit(), level(False)]), "WhitespaceSplit + ByteLevel"),
            (P.Sequence([P.Split(Regex(data.PAT_STR), behavior="isolated"), level(True)]),
             "Split + ByteLevel"),
            (P.Sequence([P.Digits(individual_digits=True), level(True)]), "Digits + ByteLevel")]:
        trained_bpe(pre).save(str(tmp_path / "tokenizer.json"))
        with pytest.raises(ValueError, match=re.escape(f"tokenizer.json: pre_tokenizer {kinds} is not")):
            interop.load_hf_tokenizer(str(tmp_path))
    tj = json.load(open(tmp_path / "tokenizer.json"))
    json.dump({**tj, "pre_tokenizer": None}, open(tmp_path / "tokenizer.json", "w"))
    with pytest.raises(ValueError, match="pre_tokenizer none is not supported"):
        interop.load_hf_tokenizer(str(tmp_path))


def test_a_zlab_drafter_with_fewer_kv_heads_than_its_target_is_lossless(tmp_path):
    """z-lab's layers are their own config's: 1 KV head against the target's 2 (it used to size
    its context cache by the target's heads and fail)."""
    folder, _ = hf_qwen3(tmp_path)
    target = load_target(folder)
    from model import Config
    lc = Config(**{**vars(target.cfg), "n_kv_head": 1})
    hf_export.save_zlab_dflash(random_dflash(target, layer_cfg=lc), str(tmp_path / "dflash"))
    dr = load_drafter("dflash", target, str(tmp_path / "dflash"))
    assert dr.dflash.layer_cfg.n_kv_head == 1
    prompts = [[5, 9, 2, 7, 7, 1, 30], [4, 4]]
    outs, _ = speculate.generate(target, prompts, dr, max_new_tokens=16)
    assert outs == [naive_generate(target, p, 16) for p in prompts]


def test_autotokenizer_reads_our_export_as_we_tokenize(tmp_path):
    r"""vLLM and SGLang load the tokenizer with AutoTokenizer: without tokenizer_config.json it
    picked Qwen2Tokenizer for a qwen3 config, whose own split regex (single digits) gave other
    ids on 15 of the 256 held-out prompts. And tokenizers' regex engine read our \p{N}{1,3}+ as
    any number of digits: "2024" one piece, ours "202" "4" (2,310 of 5,000 random numbers)."""
    enc = data.get_encoding()
    hf_export.save_hf_target(load_target(os.path.join(data.REF_WEIGHTS, "target.pt")),
                             str(tmp_path), eos_token_id=enc.eot_token)
    hf_export.save_hf_tokenizer(enc, str(tmp_path), data.PAT_STR, eos=data.EOT)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompts = data.reference_prompts(data.N_REFERENCE_PROMPTS) + ["x = 12345678", "year = 2024",
                                                                   "n = 1000000 + 31415926535"]
    assert all(tok.encode(p, add_special_tokens=False) == enc.encode_ordinary(p) for p in prompts)
    assert tok.eos_token_id == enc.eot_token
    assert json.load(open(tmp_path / "config.json"))["eos_token_id"] == enc.eot_token
    # readable by all, as the other files (safetensors' save_file made it 0600: a vLLM server
    # under another user could not read it); written temp-then-rename, nothing else left
    assert all(os.stat(tmp_path / f).st_mode & 0o044 == 0o044 for f in os.listdir(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "tokenizer.json",
                                            "tokenizer_config.json"]


def test_the_export_warns_of_a_last_layer_feature_and_refuses_a_file(tmp_path, capsys):
    folder, _ = hf_qwen3(tmp_path)
    target = load_target(folder)
    df = random_dflash(target, hidden_layers=(1, 3))  # as the committed drafter, the last block
    save_checkpoint(str(tmp_path / "dflash.pt"), dict(
        kind="dflash", config=df.config_dict(), state_dict=df.state_dict(),
        target_hash=weights_hash(target.cfg, target.state_dict())))
    hf_export.main([str(tmp_path / "out"), "--target", folder, "--weights", str(tmp_path)])
    assert "warning: this drafter reads the target's last block (3)" in capsys.readouterr().out
    assert hf_export.last_layer_warning(random_dflash(target)) is None  # (1, 2): drafters now
    open(tmp_path / "file", "w").close()
    with pytest.raises(SystemExit, match="file is a file; name a folder"):
        hf_export.main([str(tmp_path / "file"), "--target", folder, "--weights", str(tmp_path)])
