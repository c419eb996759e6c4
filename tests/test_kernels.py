"""
Tests of the CUDA kernels (dflash_kernels/, DESIGN.md sec. 7): every kernel against its PyTorch
reference (draft_diffusion.kv_inject_ref, speculate.accept_scan_ref) on random and awkward
shapes (B = 1, 3, 7; K = 1, 15; V = 97, 4099 and Qwen3's 151,936; rows with no new tokens;
greedy and sampling; float32 and bfloat16), the reference kv_inject_ref against a per-element
loop over model.apply_rope, the loader (path selection, the announce line, the env switch)
and the self-check.

Without a GPU the kernels' own code runs on the CPU under dev/emu.h (dev/emu.py builds it with
g++, about half a minute the first time, cached in out/cuda_build/); the GPU tests skip.

    python -m pytest -q tests/test_kernels.py
"""

import os
import re
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import dflash_kernels as kernels
from dev import emu as dev_emu
from draft_diffusion import kv_inject_ref
from dev.kernels_check import VERSIONS, make_accept_case, make_kv_case, mismatches
from model import apply_rope
from speculate import accept_scan_ref

MODES = ("greedy", "sample_q", "sample_argmax")
ACCEPT_SHAPES = [(1, 1, 97), (1, 15, 4099), (3, 15, 97), (3, 1, 4099), (7, 15, 4099),
                 (7, 1, 97)]  # (B, K, V)
QWEN_SHAPES = [(2, 15, 151936)]  # Qwen3's vocabulary (the paper's targets): ~1.3 s emulated
KV_SHAPES = [(2, 1, 2, 64, 64, 16), (3, 3, 1, 16, 40, 7), (2, 7, 2, 64, 96, 5),
             (1, 2, 1, 4, 8, 3)]  # (L, B, H, D, T_max, T_new); the last: less than one block
has_gpu = torch.cuda.is_available()


@pytest.fixture(scope="module")
def emu():
    """The extension with the CUDA kernels emulated on the CPU (dev/emu.py)."""
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no ninja or C++ compiler to build the emulation")
    try:
        return dev_emu.load()
    except Exception as e:  # on Linux (CI) a failed build is a failure; elsewhere ucontext may lack
        if sys.platform.startswith("linux"):
            raise
        pytest.skip(f"the emulation did not build on {sys.platform}: {e}")


@pytest.fixture(scope="module")
def ext():
    """The real extension, built for the GPU."""
    if not has_gpu:
        pytest.skip("no CUDA device")
    assert kernels.available("cuda"), "the extension did not build (its line above says why)"
    return kernels._ext["cuda"]


@pytest.fixture
def fresh(monkeypatch):
    """The loader as a new process finds it: nothing chosen, nothing announced."""
    monkeypatch.setattr(kernels, "_ext", {})
    monkeypatch.delenv(kernels.ENV, raising=False)


def kv_inject_loop(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """The definition, one (l, b, t, h) vector at a time, through model.apply_rope."""
    L, B, H, T_max, D = cache_k.shape
    for l in range(L):
        for b in range(B):
            for t in range(int(counts[b])):
                pos = int(offsets[b]) + t
                c, s = cos[pos].view(1, 1, 1, -1), sin[pos].view(1, 1, 1, -1)  # (1, 1, 1, D/2)
                for h in range(H):
                    x = new_k[l, b, t, h].float().view(1, 1, 1, D)             # (B, H, T, D)
                    cache_k[l, b, h, pos] = apply_rope(x, c, s).view(D).to(cache_k.dtype)
                    cache_v[l, b, h, pos] = new_v[l, b, t, h]


def replaced(args, i, *values):
    """A copy of the argument list with args[i], args[i + 1], ... = values."""
    args = list(args)
    args[i:i + len(values)] = values
    return args


def same(a, b):
    """Two (n_accepted, next_token) pairs are equal."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -----------------------------------------------------------------------------
# the reference kv_inject_ref

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", KV_SHAPES[1:])
def test_kv_inject_ref_matches_loop(shape, dtype):
    args = make_kv_case(*shape, dtype=dtype, seed=1)
    k_loop, v_loop = args[0].clone(), args[1].clone()
    kv_inject_loop(k_loop, v_loop, *args[2:])
    kv_inject_ref(*args)
    assert args[5][0] == 0  # row 0 has no new tokens: its cache stays all NaN
    assert args[4][-1] + args[5][-1] == shape[4]  # the last row writes up to the end of the cache
    assert args[0][:, 0].isnan().all() and args[1][:, 0].isnan().all()
    assert mismatches(args[0], k_loop) == 0 and mismatches(args[1], v_loop) == 0
    assert (~args[0].isnan()).sum() == args[0].shape[0] * shape[2] * shape[3] * int(args[5].sum())


def test_kv_inject_ref_checks_bounds():
    args = make_kv_case(1, 2, 2, 8, 10, 4)  # the last row writes slots 6..9
    for bad in (replaced(args, 4, torch.tensor([0, 7])),       # row 1: slots 7..10, T_max = 10
                replaced(args, 5, torch.tensor([0, -1])),      # a negative count
                replaced(args, 6, args[6][:9], args[7][:9])):  # RoPE tables one row short
        with pytest.raises(ValueError):
            kv_inject_ref(*bad)


def test_kv_inject_ref_refuses_a_negative_offset():
    """Row 1 at offset -1 would write slot -1, i.e. the end of the slice before it."""
    args = replaced(make_kv_case(1, 2, 2, 8, 10, 4), 4, torch.tensor([0, -1]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="offsets"):
        kv_inject_ref(*args)
    assert args[0].isnan().all() and args[1].isnan().all()


def test_kv_inject_ref_refuses_an_offset_that_wraps():
    """offset + count past INT64_MAX wraps negative, and a negative slot indexes from the end."""
    args = replaced(make_kv_case(1, 2, 1, 8, 10, 4), 4, torch.tensor([0, 2 ** 63 - 2]))
    with pytest.raises(ValueError, match="offsets"):
        kv_inject_ref(*args)
    assert args[0].isnan().all() and args[1].isnan().all()


def test_kv_inject_ref_refuses_rope_tables_too_short():
    args = make_kv_case(1, 2, 1, 8, 10, 4)
    with pytest.raises(ValueError, match="RoPE"):  # the last row writes up to slot 9
        kv_inject_ref(*replaced(args, 6, args[6][:5], args[7][:5]))


# -----------------------------------------------------------------------------
# kv_inject's kernel, emulated on the CPU

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", KV_SHAPES + [(4, 7, 2, 64, 256, 16)])
def test_kv_inject_emulated(emu, shape, dtype):
    args = make_kv_case(*shape, dtype=dtype, seed=2)
    ref_k, ref_v = args[0].clone(), args[1].clone()
    kv_inject_ref(ref_k, ref_v, *args[2:])
    assert emu.kv_inject(*args) is None  # kv_inject_kernel1, grid-stride over (l, b, t, h, i)
    assert mismatches(args[0], ref_k) == 0  # bit for bit, NaN where nothing was written
    assert mismatches(args[1], ref_v) == 0


def test_kv_inject_emulated_short_row_at_the_end_of_the_rope_tables(emu):
    """A row with fewer new tokens than T_new in the last slot (as the other rows of a refill
    are, with count 0 at their own offsets): its padding lies past the RoPE tables, and only
    its real token is rotated and written, by the reference and the kernel."""
    args = list(make_kv_case(2, 2, 1, 8, 10, 4, seed=5))  # P = T_max = 10
    args[4], args[5] = torch.tensor([9, 0]), torch.tensor([1, 4])  # row 0 pads at 10..12
    k_loop, v_loop = args[0].clone(), args[1].clone()
    kv_inject_loop(k_loop, v_loop, *args[2:])
    ref_k, ref_v = args[0].clone(), args[1].clone()
    kv_inject_ref(ref_k, ref_v, *args[2:])
    assert mismatches(ref_k, k_loop) == 0 and mismatches(ref_v, v_loop) == 0
    emu.kv_inject(*args)
    assert mismatches(args[0], ref_k) == 0 and mismatches(args[1], ref_v) == 0


@pytest.mark.parametrize("shape", [(2, 3, 2, 16, 20, 0), (0, 3, 2, 16, 20, 4)])  # T_new, L = 0
def test_kv_inject_emulated_with_nothing_new_launches_nothing(emu, shape):
    """A launch of no blocks is an error on a GPU (and under emu.h): the launcher must skip it.
    With T_new = 0 the caches stay as they were; with L = 0 they are empty: no error is all."""
    args = make_kv_case(*shape)
    emu.kv_inject(*args)
    assert args[0].isnan().all() and args[1].isnan().all()


BAD_ROWS = {  # row b made to fall outside the cache or the RoPE tables: (b, offset, count, P)
    "past_the_cache": (1, 18, 4, 20),     # slots 18..21 with T_max = 20
    "negative_offset": (1, -1, 3, 20),
    "count_over_T_new": (1, 0, 5, 20),    # T_new = 4
    "negative_count": (1, 0, -1, 20),
    "nothing_new_at_a_negative_offset": (0, -5, 0, 20),  # checked although nothing is written
    "offset_that_wraps": (1, 2 ** 63 - 2, 4, 20),  # offset + count wraps to a negative int64
    "short_rope_tables": (2, 16, 4, 19),  # the last row needs positions up to 19
}


@pytest.mark.parametrize("bad", BAD_ROWS)
def test_kv_inject_emulated_kernel_skips_a_bad_row_and_asserts(emu, bad):
    """Bad offsets/counts (each of the kernel's bounds tests): row skipped, device-side assert."""
    b, offset, count, P = BAD_ROWS[bad]
    args = list(make_kv_case(2, 3, 2, 16, 20, 4, seed=7))  # offsets (16, 0, 16), counts (0, 3, 4)
    ref_k, ref_v = args[0].clone(), args[1].clone()
    counts_ok = args[5].clone()
    counts_ok[b] = 0
    kv_inject_ref(ref_k, ref_v, *args[2:5], counts_ok, *args[6:])  # the same call without row b
    args[4][b], args[5][b] = offset, count
    args[6], args[7] = args[6][:P], args[7][:P]
    with pytest.raises(RuntimeError, match="device-side assert"):
        emu.kv_inject(*args)
    assert args[0][:, b].isnan().all() and args[1][:, b].isnan().all()  # nothing of row b
    assert mismatches(args[0], ref_k) == 0 and mismatches(args[1], ref_v) == 0


def test_kv_inject_emulated_kernel_writes_nothing_past_the_tensors(emu):
    """Catches writes past the caches (a grid-stride bound idx <= N reaches l = L): NaN tails
    stay NaN."""
    args = list(make_kv_case(2, 1, 2, 16, 20, 4, seed=3))  # B = 1: the index past the end is row 0
    ref_k, ref_v = args[0].clone(), args[1].clone()
    kv_inject_ref(ref_k, ref_v, *args[2:])
    bufs = [torch.cat([a.flatten(), torch.full_like(a.flatten(), 0.0 if i >= 2 else float("nan"))])
            for i, a in enumerate(args[:4])]  # new_k, new_v tails 0: a read past them writes one
    args[:4] = [buf[:a.numel()].view(a.shape) for buf, a in zip(bufs, args[:4])]
    emu.kv_inject(*args)
    assert bufs[0][args[0].numel():].isnan().all() and bufs[1][args[1].numel():].isnan().all()
    assert mismatches(args[0], ref_k) == 0 and mismatches(args[1], ref_v) == 0


def test_kv_inject_emulated_refuses_malformed_arguments(emu):
    """ext.cpp's checks guard kernels that index raw pointers: each malformed argument must be
    refused, not read with the wrong strides. Tensors here are larger than expected (never
    smaller), so a dropped check shows as silence, not as a read past the end."""
    good = make_kv_case(1, 2, 2, 8, 10, 4)  # L, B, H, D, T_max, T_new

    def call(i, *values):
        emu.kv_inject(*replaced(good, i, *values))

    with pytest.raises(RuntimeError, match="new_k, new_v must be"):  # H + 1 heads
        call(2, torch.zeros(1, 2, 4, 3, 8), torch.zeros(1, 2, 4, 3, 8))
    with pytest.raises(RuntimeError, match="new_k, new_v must be"):  # new_v's alone
        call(3, torch.zeros(1, 2, 4, 3, 8))
    with pytest.raises(RuntimeError, match="cache_k, cache_v must be"):  # cache_v's: T_max + 1
        call(1, torch.full((1, 2, 2, 11, 8), float("nan")))
    with pytest.raises(RuntimeError, match="offsets and counts must be"):  # B + 1 counts
        call(5, torch.tensor([0, 4, 0]))
    with pytest.raises(RuntimeError, match="cos, sin must be"):  # sin with more rows than cos
        call(7, torch.cat([good[7], good[7][:2]]))
    strided = torch.stack([good[6], good[6]], -1)[..., 0]  # cos's values, not contiguous
    with pytest.raises(RuntimeError, match="contiguous"):
        call(6, strided, strided.clone())
    with pytest.raises(RuntimeError, match="dtype"):
        call(2, good[2].double())
    with pytest.raises(RuntimeError, match="contiguous"):
        call(2, good[2].transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(RuntimeError, match="dtype"):  # no kernel for float64 caches
        emu.kv_inject(*make_kv_case(2, 3, 2, 16, 20, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="even"):
        emu.kv_inject(torch.zeros(1, 1, 1, 4, 3), torch.zeros(1, 1, 1, 4, 3),
                      torch.zeros(1, 1, 1, 1, 3), torch.zeros(1, 1, 1, 1, 3),
                      torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                      torch.zeros(4, 1), torch.zeros(4, 1))
    assert good[0].isnan().all() and good[1].isnan().all()  # nothing written by any of them


# -----------------------------------------------------------------------------
# accept_scan's kernels, emulated on the CPU

@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
@pytest.mark.parametrize("mode", MODES)
# in order, eager and eager_forward (emu.h): a barrier missing after thread 0 writes a shared
# value, before block_inclusive_scan's s_warp or block_argmax's s_idx is reused, or kernel2's
# last block picked by index instead of by ticket, passes in order and fails an eager order
@pytest.mark.parametrize("shape, schedule", [(s, "in_order") for s in ACCEPT_SHAPES + QWEN_SHAPES]
                         + [(s, o) for s in ACCEPT_SHAPES for o in ("eager", "eager_forward")])
def test_accept_scan_emulated_kernels(emu, shape, schedule, mode, version, monkeypatch):
    monkeypatch.setenv("DFLASH_EMU_SCHEDULE", schedule)
    # quantized probabilities, as on the GPU: the kernels scan in tiles, and only on such inputs
    # is every summation order bit-identical (header of accept_scan.cu)
    p, drafts, q, u = make_accept_case(*shape, mode, seed=8)
    assert same(emu.accept_scan(p, drafts, q, u, version), accept_scan_ref(p, drafts, q, u))
    if mode == "greedy":  # bf16 logits with NaNs: NaN is the maximum, the first NaN wins, within
        p = p.bfloat16()  # a warp (threads 5 and 9) and across warps (thread 40)
        p[-1, 0, [5, 9, 40]] = float("nan")
        assert same(emu.accept_scan(p, drafts, None, None, version), accept_scan_ref(p, drafts))


@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
@pytest.mark.parametrize("mode", MODES)
def test_accept_scan_emulated_with_no_drafts_is_plain_decoding(emu, mode, version):
    """K = 0, what `ar` sends through the loop at every step: nothing accepted, and the token is
    p's argmax or its inverse-CDF draw, exactly the reference's."""
    p, drafts, q, u = make_accept_case(3, 0, 4099, mode, seed=5)  # sample_q: q of shape (3, 0, V)
    n, nxt = emu.accept_scan(p, drafts, q, u, version)
    assert same((n, nxt), accept_scan_ref(p, drafts, q, u)) and not n.any()


@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
@pytest.mark.parametrize("mode", MODES)
def test_accept_scan_emulated_with_no_rows_launches_nothing(emu, mode, version):
    """B = 0: empty outputs, as the reference's. A launch of no blocks is an error on a GPU (and
    under emu.h): the launcher must skip it."""
    p, drafts, q, u = (t if t is None else t[:0] for t in make_accept_case(3, 4, 97, mode))
    n, nxt = emu.accept_scan(p, drafts, q, u, version)
    assert n.shape == nxt.shape == (0,) and same((n, nxt), accept_scan_ref(p, drafts, q, u))


def test_accept_cases_cover_partial_full_and_zero_residual_rows():
    """The inputs really exercise partial acceptance, full acceptance and the zero-residual row."""
    ns = torch.cat([accept_scan_ref(*make_accept_case(7, 15, 97, m, seed=s))[0]
                    for m in MODES for s in range(4)])
    assert (ns == 0).any() and ((ns > 0) & (ns < 15)).any()
    ns = torch.cat([accept_scan_ref(*make_accept_case(7, 1, 97, m, seed=s))[0]
                    for m in MODES for s in range(4)])
    assert (ns == 1).any()  # all K accepted: the bonus token
    p, drafts, q, u = make_accept_case(7, 15, 97, "sample_q")
    n = accept_scan_ref(p, drafts, q, u)[0]
    zero_residual = [b for b in range(7)
                     if n[b] < 15 and (p[b, n[b]] - q[b, n[b]]).clamp(min=0).sum() == 0]
    assert zero_residual == [0]  # the row built for the fallback to p


def test_accept_cases_leave_the_last_rows_tail_empty():
    """Every kernel's random cases reach the empty-slot rule (NO_DRAFT = -1) only through this."""
    for mode in MODES:
        drafts = make_accept_case(3, 15, 97, mode)[1]
        assert (drafts[-1, 7:] == -1).all() and (drafts[:, :7] >= 0).all()
        assert (drafts[:2] >= 0).all()


@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accept_scan_emulated_greedy_low_precision_and_nan(emu, dtype, version):
    p, drafts, _, _ = make_accept_case(3, 15, 4099, "greedy", dtype=dtype, seed=3)
    p[1, 2, [5, 9]] = float("nan")  # torch.argmax: NaN is the maximum, the first NaN wins
    p[1, 2, 5] = -p[1, 2, 5]        # a NaN with its sign bit set (x86's 0 * inf) is one too:
    # float16 bits read as bfloat16 (a dtype mixed up) order numbers alike, but not this NaN
    p[0] = float("-inf")            # all -inf rows: token 0, so draft 0 is accepted, and so on
    drafts[0, 0] = 0
    assert same(emu.accept_scan(p, drafts, None, None, version), accept_scan_ref(p, drafts))


def float64_near_tie():
    """Draft 7 accepted, then a bonus row whose maximum 1.0 (token 600) and 1 - 2^-40 (token 40,
    another warp) round to one float32: compared in float32 the tie goes to token 40."""
    p = torch.zeros(1, 2, 4099, dtype=torch.float64)
    p[0, 0, 7], p[0, 1, 40], p[0, 1, 600] = 1.0, 1 - 2.0 ** -40, 1.0
    return p, torch.tensor([[7]])


@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
def test_accept_scan_emulated_greedy_compares_float64_in_float64(emu, version):
    """Catches float64 logits compared in float32 (float64_near_tie); the random case's
    whole-number logits are exact in float32 and only check the float64 path's indexing."""
    p, drafts, _, _ = make_accept_case(3, 15, 4099, "greedy", dtype=torch.float64, seed=6)
    assert same(emu.accept_scan(p, drafts, None, None, version), accept_scan_ref(p, drafts))
    p, drafts = float64_near_tie()
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, None, version)] == [[1], [600]]
    assert [t.tolist() for t in accept_scan_ref(p, drafts)] == [[1], [600]]


def test_accept_scan_emulated_refuses_malformed_arguments(emu):
    """drafts, uniforms and q with one column too many are refused (the kernels take K and V
    from p and would read them with the wrong row strides), as are drafts and uniforms of
    another dtype, a p of no vocabulary or not contiguous, and a kernel version that does not
    exist."""
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    with pytest.raises(RuntimeError, match="drafts must be"):
        emu.accept_scan(p, torch.cat([drafts, drafts[:, :1]], 1), q, u, 1)
    with pytest.raises(RuntimeError, match="uniforms must be"):
        emu.accept_scan(p, drafts, q, torch.cat([u, u[:, :1]], 1), 1)
    with pytest.raises(RuntimeError, match="q must be"):
        emu.accept_scan(p, drafts, torch.cat([q, q[:, :, :1]], 2), u, 1)
    with pytest.raises(RuntimeError, match="drafts must be"):  # int32, read as int64
        emu.accept_scan(p, drafts.int(), q, u, 1)
    with pytest.raises(RuntimeError, match="uniforms must be"):  # float32, read as float64
        emu.accept_scan(p, drafts, q, u.float(), 1)
    with pytest.raises(RuntimeError, match="p must be"):  # no vocabulary: no token to emit
        emu.accept_scan(p[:, :, :0], drafts, None, None, 1)
    with pytest.raises(RuntimeError, match="p must be .*contiguous"):  # the same values, strided
        emu.accept_scan(p.transpose(0, 1).contiguous().transpose(0, 1), drafts, None, None, 1)
    with pytest.raises(RuntimeError, match="version must be 1 or 2, got 3"):
        emu.accept_scan(p, drafts, None, None, 3)


@pytest.mark.parametrize("mode", ["sample_q", "sample_argmax"])
def test_accept_scan_emulated_sampling_takes_p_and_q_in_any_float_dtype(emu, mode):
    """The reference samples from p.float() and q.float(), and so must the kernel, which reads
    float32: a drafter run in bfloat16 hands the scan a bf16 q. (Multiples of 2^-16 stay such in
    bfloat16: every sum order still agrees.)"""
    p, drafts, q, u = make_accept_case(3, 4, 97, mode, seed=8)
    for dtype in (torch.bfloat16, torch.float64):
        args = (p.to(dtype), drafts, None if q is None else q.to(dtype), u)
        assert same(emu.accept_scan(*args, 1), accept_scan_ref(*args))


def test_accept_scan_emulated_kernel_asserts_on_a_draft_outside_the_vocabulary(emu):
    p, drafts, q, u = make_accept_case(2, 3, 97, "sample_q", seed=9)
    drafts[1, 0] = 97  # sampling indexes p and q with the drafts: checked in the kernel
    with pytest.raises(RuntimeError, match="device-side assert.*d < V"):
        emu.accept_scan(p, drafts, q, u, 1)
    drafts[1, 0] = -1  # a negative draft is an empty slot, not an error
    assert same(emu.accept_scan(p, drafts, q, u, 1), accept_scan_ref(p, drafts, q, u))


@pytest.mark.parametrize("use_q", [False, True])
def test_accept_scan_emulated_rejects_a_draft_whose_ratio_test_ties(emu, use_q):
    """u * q(d) == p(d) is a rejection (accept iff u * q(d) < p(d), the reference's strict <):
    random uniforms never tie, so this row makes one. Rejected, draft 0 leaves the residual
    (0, .5, 0, 0): token 1; a <= would accept it and sample the bonus row (token 2)."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]])
    drafts, u = torch.tensor([[0]]), torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]) if use_q else None  # one-hot: the same test
    assert [t.tolist() for t in accept_scan_ref(p, drafts, q, u)] == [[0], [1]]
    assert [t.tolist() for t in emu.accept_scan(p, drafts, q, u, 1)] == [[0], [1]]


def test_accept_scan_emulated_zero_uniform_never_samples_a_zero_probability_token(emu):
    """u = 0: the inverse CDF picks the first token whose cdf EXCEEDS 0 (searchsorted right),
    never a leading token of probability 0."""
    p = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]]])
    drafts, u = torch.tensor([[1]]), torch.zeros(1, 2, dtype=torch.float64)
    assert [t.tolist() for t in accept_scan_ref(p, drafts, None, u)] == [[0], [3]]
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[0], [3]]


def test_accept_scan_emulated_token_0_is_a_draft_not_an_empty_slot(emu):
    """Only a negative draft is an empty slot (NO_DRAFT = -1): a draft of token 0 is tested
    like any other. The random cases rarely draft token 0 where it decides anything."""
    p = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]])  # p_1(0) = 1: accepted
    drafts, u = torch.tensor([[0]]), torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    for q in (None, torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])):
        assert [t.tolist() for t in accept_scan_ref(p, drafts, q, u)] == [[1], [2]]  # the bonus
        assert [t.tolist() for t in emu.accept_scan(p, drafts, q, u, 1)] == [[1], [2]]


def test_accept_scan_emulated_greedy_nan_at_index_0_beats_a_later_nan(emu):
    """torch.argmax takes the FIRST NaN: one at index 0 must win over a later one, not only
    over numbers."""
    p = torch.zeros(2, 1, 8)
    p[:, 0, 5] = float("nan")
    p[0, 0, 0] = float("nan")
    drafts = torch.zeros(2, 0, dtype=torch.long)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert [t.tolist() for t in accept_scan_ref(p.to(dtype), drafts)] == [[0, 0], [0, 5]]
        for version in VERSIONS["accept_scan"]:
            out = emu.accept_scan(p.to(dtype), drafts, None, None, version)
            assert [t.tolist() for t in out] == [[0, 0], [0, 5]]


def test_accept_scan_emulated_a_nan_residual_total_falls_back_to_p(emu):
    """The reference samples from p_n where the residual's total is not > 0, NaN included
    (torch.where(total > 0, r, p_n)): a NaN in q at the rejected position, with p finite, gives
    a token drawn from p (cdf .25, .5, .75, 1; target .5 -> token 2), not the NaN CDF's V - 1."""
    p = torch.full((1, 2, 4), 0.25)
    drafts, u = torch.tensor([[0]]), torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[[1.0, float("nan"), 0.0, 0.0]]])  # u q(0) = .5 >= p(0): draft 0 rejected
    assert [t.tolist() for t in accept_scan_ref(p, drafts, q, u)] == [[0], [2]]
    assert [t.tolist() for t in emu.accept_scan(p, drafts, q, u, 1)] == [[0], [2]]


def test_an_unknown_emulator_schedule_is_refused(emu, monkeypatch):
    """A misspelt order used to run in order, so a test meant for eager checked nothing new."""
    monkeypatch.setenv("DFLASH_EMU_SCHEDULE", "eagre")
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    with pytest.raises(RuntimeError, match="unknown DFLASH_EMU_SCHEDULE=eagre"):
        emu.accept_scan(p, drafts, q, u, 1)


@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
def test_accept_scan_emulated_greedy_takes_no_uniforms_whatever_q_is(emu, version):
    """uniforms None means greedy, as in the reference: a q beside it is not read."""
    p, drafts, q, _ = make_accept_case(3, 4, 97, "sample_q", seed=8)
    out = emu.accept_scan(p, drafts, q, None, version)
    assert same(out, accept_scan_ref(p, drafts, q)) and same(out, accept_scan_ref(p, drafts))


@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
def test_accept_scan_emulated_greedy_bonus_ignores_the_next_rows_draft(emu, version):
    """Catches a bonus position compared with drafts[b, K], which is the next row's first draft."""
    p = torch.zeros(2, 2, 97)
    p[0, 0, 3] = p[0, 1, 7] = p[1, 0, 5] = p[1, 1, 2] = 1.0  # argmaxes: row 0 (3, 7), row 1 (5, 2)
    drafts = torch.tensor([[3], [7]])  # row 0 accepts its draft, then its bonus 7 = row 1's draft
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, None, version)] == [[1, 0], [7, 5]]
    assert [t.tolist() for t in accept_scan_ref(p, drafts)] == [[1, 0], [7, 5]]


def test_accept_scan_emulated_kernel_samples_right_of_a_cdf_tie(emu):
    """Catches >= for > in the inverse CDF: u * total equal to a running sum picks the next."""
    p = torch.tensor([[[0.5, 0.25, 0.125, 0.125], [0.25] * 4]])
    u = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    drafts = torch.tensor([[0]])  # rejected: cdf 0, .25, .375, .5
    # target .25 = cdf[1]: token 2
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[0], [2]]
    assert [t.tolist() for t in accept_scan_ref(p, drafts, None, u)] == [[0], [2]]


@pytest.mark.parametrize("schedule", ["in_order", "eager"])
@pytest.mark.parametrize("start", [0, 1])
def test_accept_scan_emulated_kernel_never_samples_a_token_without_mass(emu, start, schedule,
                                                                       monkeypatch):
    """Catches the fallback to V - 1 (here a zero-mass token) when no running sum crosses the
    target. Pass 1's total (per thread, then a tree) keeps the 2^-63 masses that pass 2's tile
    scans absorb one by one into ~0.5 (under half a float64 step), so pass 1's total is two
    steps above pass 2's last running sum, and u = 1 - 2^-53 puts the target above every one.
    The kernel then takes the last token with mass. The reference's sequential sum agrees with
    itself and picks the 2^-25: contrived inputs part the two (accept_scan.cu's header). With
    start = 1 thread 0 holds no mass (tokens 0, 512, ... are zero), which catches a fallback
    barrier only threads with mass reach: thread 0 would then write the token before the others
    have named theirs (the in-order schedule shows it; eager runs thread 0 last)."""
    monkeypatch.setenv("DFLASH_EMU_SCHEDULE", schedule)
    source = (kernels.HERE / "accept_scan.cu").read_text()
    threads = int(re.search(r"kThreads = (\d+);", source).group(1))
    assert threads == 512, "built for 512-thread blocks (512 x 2^-63 is half an ulp of 0.5)"
    V, s = 4099, start
    p = torch.zeros(1, 2, V)
    p[0, 0, 3] = 1.0                                  # draft 3 accepted: the bonus row is sampled
    p[0, 1, s], p[0, 1, s + 1], p[0, 1, s + 2:s + 2050] = 0.5, 2.0 ** -25, 2.0 ** -63  # none after
    if start == 1:
        p[0, 1, ::threads] = 0.0                      # thread 0's tokens (0, 512, ...) have none
    drafts, u = torch.tensor([[3]]), torch.tensor([[0.5, 1 - 2.0 ** -53]], dtype=torch.float64)
    n, nxt = emu.accept_scan(p, drafts, None, u, 1)
    assert p[0, 1, nxt] > 0 and (n.tolist(), nxt.tolist()) == ([1], [s + 2049])
    assert [t.tolist() for t in accept_scan_ref(p, drafts, None, u)] == [[1], [s + 1]]


def test_accept_scan_emulated_kernel_sampling_keeps_nan_like_the_reference(emu):
    """Catches a residual clamp that zeroes NaN or a token not clamped to V - 1 (a NaN CDF
    gives V - 1)."""
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q", seed=8)
    n = accept_scan_ref(p, drafts, q, u)[0]
    for b in range(3):  # a NaN in each row's emitted distribution, at a token not drafted there
        p[b, n[b], next(j for j in range(97) if j not in drafts[b])] = float("nan")
        p[b, n[b], 96] = 0.0  # V - 1 without mass: the no-crossing fallback must not take a NaN
    n_ref, nxt_ref = accept_scan_ref(p, drafts, q, u)
    assert torch.equal(n_ref, n) and nxt_ref.tolist() == [96] * 3
    assert same(emu.accept_scan(p, drafts, q, u, 1), (n_ref, nxt_ref))


def test_accept_scan_emulated_kernel_draws_tokens_lighter_than_float32s_grid(emu):
    """Catches a float32 uniform or running sum (both once were): near 0.5 float32 steps by
    2^-24, 64 of these tokens, so it could only pick every 64th of them, each 64 times too often
    (545 here); in float64 the first running sum above the target is token 511's."""
    # not quantized, but every partial sum here is exact in double, so all summation orders agree
    p = torch.zeros(1, 2, 1024)
    p[0, 0, 3] = 1.0                             # draft 3 accepted: the bonus row is sampled
    p[0, 1] = 2.0 ** -30
    p[0, 1, 0] = 0.5                             # cdf_j = 0.5 + j 2^-30, total 0.5 + 1023 2^-30
    u = torch.tensor([[0.5, 1 - 2.0 ** -20]], dtype=torch.float64)  # -> 0.5 + 511 2^-30 - 1e-12
    drafts = torch.tensor([[3]])
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[1], [511]]
    assert [t.tolist() for t in accept_scan_ref(p, drafts, None, u)] == [[1], [511]]


def test_accept_scan_emulated_kernel_keeps_every_bit_of_the_uniforms(emu):
    """Catches a uniform rounded to float32 on its way (in the kernel's inverse CDF or ratio
    test, or the reference's): u between two float32 values picks token 512 of the 2^-30 ones
    above (float32's u lands 30-odd tokens away), and u a hair under p(d) = 0.5 + 2^-24 accepts
    the draft (float32's u rounds up to p(d), a tie: rejected)."""
    p = torch.zeros(1, 2, 1024)
    p[0, 0, 3], p[0, 1], p[0, 1, 0] = 1.0, 2.0 ** -30, 0.5    # as in the test above
    total = 0.5 + 1023 * 2.0 ** -30
    u = torch.tensor([[0.5, (0.5 + 511.5 * 2.0 ** -30) / total]], dtype=torch.float64)
    drafts = torch.tensor([[3]])
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[1], [512]]
    assert [t.tolist() for t in accept_scan_ref(p, drafts, None, u)] == [[1], [512]]
    p = torch.zeros(1, 2, 4)
    p[0, 0, 0], p[0, 0, 1], p[0, 1, 2] = 0.5 - 2.0 ** -24, 0.5 + 2.0 ** -24, 1.0
    u = torch.tensor([[0.5 + 2.0 ** -24 - 2.0 ** -40, 0.5]], dtype=torch.float64)
    drafts = torch.tensor([[1]])                  # argmax drafts: q(d) = 1, so u < p(d) accepts
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[1], [2]]
    assert [t.tolist() for t in accept_scan_ref(p, drafts, None, u)] == [[1], [2]]
    with pytest.raises(ValueError, match="uniforms must be float64"):  # as the kernel refuses
        accept_scan_ref(p, drafts, None, u.float())


def test_accept_scan_emulated_kernel_sums_the_total_in_double(emu):
    """Catches pass 1 (the total) accumulated per thread in float32: thread 0 holds token 0
    (0.5) and tokens 512, 1024, ... 3584 (2^-26 each), which a float32 partial of 0.5 drops. In
    double the total is 1 + 7 2^-26, the target u * total 1 + 3 2^-26 - 7 2^-50, and the first
    running sum above it is token 1536's (1 + 3 2^-26); a total of 1.0 would give token 1."""
    V = 4099
    p = torch.zeros(1, 2, V)
    p[0, 0, 3] = 1.0                                # draft 3 accepted: the bonus row is sampled
    p[0, 1, 0] = p[0, 1, 1] = 0.5
    p[0, 1, 512:4096:512] = 2.0 ** -26
    drafts, u = torch.tensor([[3]]), torch.tensor([[0.5, 1 - 2.0 ** -24]], dtype=torch.float64)
    assert [t.tolist() for t in accept_scan_ref(p, drafts, None, u)] == [[1], [1536]]
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[1], [1536]]


# -----------------------------------------------------------------------------
# the loader: which path, the announce line, the env switch, the build

def test_cpu_tensors_take_the_reference_without_building(fresh, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "_build", lambda: pytest.fail("CPU tensors must not build"))
    assert not kernels.available("cpu") and not kernels.available(torch.device("cpu"))
    assert capsys.readouterr().out == ("kernels: cpu tensors use the PyTorch reference (the "
                                       "kernels serve CUDA tensors; no build)\n")
    assert not kernels.available("meta")  # nor for any other device type


def test_env_zero_forces_the_reference(fresh, monkeypatch, capsys):
    monkeypatch.setenv(kernels.ENV, " 0\n")  # read loosely
    monkeypatch.setattr(kernels, "_build", lambda: pytest.fail("DFLASH_CUDA_EXT=0 must not build"))
    assert not kernels.available("cuda") and not kernels.available("cpu")
    assert f"kernels: cuda tensors use the PyTorch reference (forced by {kernels.ENV}=0)" \
        in capsys.readouterr().out


def test_an_unknown_env_value_is_named_not_taken_for_a_choice(fresh, monkeypatch, capsys):
    """DFLASH_CUDA_EXT=host (a mode that no longer exists) or a typo must not pass for the
    default; an empty value is the default."""
    monkeypatch.setattr(kernels, "_build", lambda: pytest.fail("an unknown value must not build"))
    for value in ("host", "true"):  # nor a spelling of 1 that the README does not name
        monkeypatch.setattr(kernels, "_ext", {})
        monkeypatch.setenv(kernels.ENV, value)
        assert not kernels.available("cuda")
        assert f"unknown {kernels.ENV}={value!r}, not 1 or 0" in capsys.readouterr().out
    monkeypatch.setattr(kernels, "_ext", {})
    monkeypatch.setenv(kernels.ENV, " ")
    monkeypatch.setattr(kernels, "_build", lambda: SimpleNamespace())
    assert kernels.available("cuda")
    assert "kernels: cuda tensors use the CUDA extension (built in" in capsys.readouterr().out


def test_the_path_is_announced_once_per_device_type(fresh, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "_build", lambda: SimpleNamespace())  # a CUDA build, faked
    for _ in range(3):
        kernels.available("cpu"), kernels.available("cuda:0"), kernels.available("cuda")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("kernels: cpu tensors use the PyTorch reference")
    assert out[1].startswith("kernels: cuda tensors use the CUDA extension (built in ")


def test_a_failed_build_is_tried_once_reported_and_ctrl_c_still_stops(fresh, monkeypatch, capsys):
    calls = []

    def bad():
        calls.append(1)
        raise RuntimeError("g++ ...\nerror: boom\n")
    monkeypatch.setattr(kernels, "_build", bad)
    assert not kernels.available("cuda") and not kernels.available("cuda")
    assert len(calls) == 1  # not again at every op call
    assert capsys.readouterr().out == ("kernels: cuda tensors use the PyTorch reference (build "
                                       "failed: RuntimeError: error: boom)\n")

    def ctrl_c():
        raise KeyboardInterrupt
    monkeypatch.setattr(kernels, "_ext", {})
    monkeypatch.setattr(kernels, "_build", ctrl_c)
    with pytest.raises(KeyboardInterrupt):  # an interrupted build stops the program
        kernels.available("cuda")
    assert "cuda" not in kernels._ext


def test_a_failed_build_is_reported_by_its_last_line(fresh, monkeypatch, capsys):
    def bad():
        raise RuntimeError("ninja: build stopped\n  g++ -O3 ...\nerror: ext.cpp:12: expected ';'\n\n")
    monkeypatch.setattr(kernels, "_build", bad)
    assert not kernels.available("cuda")
    assert "(build failed: RuntimeError: error: ext.cpp:12: expected ';')" in capsys.readouterr().out

    def too_long():  # a linker's last line can name every object and library: one line, cut short
        raise RuntimeError("collect2: error: " + "x" * 5000)
    monkeypatch.setattr(kernels, "_ext", {})
    monkeypatch.setattr(kernels, "_build", too_long)
    assert not kernels.available("cuda")
    assert len(capsys.readouterr().out) < 400


def test_the_ops_take_any_strides_and_ask_for_the_promoted_kernel_version(emu, monkeypatch):
    """The ops hand the built module contiguous inputs (the references take any strides) and
    ask for DEFAULT_VERSION, the promoted kernel: every version gives the same tokens (the
    suite checks that), so only the argument shows which kernel a GPU run takes."""
    seen = []
    spy = SimpleNamespace(kv_inject=emu.kv_inject, accept_scan=lambda *a: seen.append(a[-1])
                          or emu.accept_scan(*a))
    monkeypatch.setitem(kernels._ext, "cpu", spy)
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_argmax")
    p = p.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, not contiguous
    assert same(kernels.accept_scan(p, drafts, q, u), accept_scan_ref(p, drafts, q, u))
    assert seen == [kernels.DEFAULT_VERSION]
    strided = lambda t: torch.stack([t, t], -1)[..., 0]  # the same values, not contiguous
    args = list(make_kv_case(2, 3, 2, 16, 20, 4, seed=7))
    ref_k, ref_v = args[0].clone(), args[1].clone()
    kv_inject_ref(ref_k, ref_v, *args[2:])
    args[2:] = [strided(t) for t in args[2:]]  # new K/V, offsets, counts, RoPE tables
    kernels.kv_inject(*args)
    assert mismatches(args[0], ref_k) == 0 and mismatches(args[1], ref_v) == 0


def test_draft_diffusion_kv_inject_dispatches(emu, fresh, monkeypatch):
    """draft_diffusion.kv_inject: the reference for CPU tensors (nothing built), the kernel
    where the extension serves the device, and the reference again for a float64 cache, which
    the kernel refuses."""
    import draft_diffusion
    calls = []
    spy = SimpleNamespace(kv_inject=lambda *a: calls.append(a[0].dtype) or emu.kv_inject(*a))
    for serve in (False, True):
        if serve:
            monkeypatch.setitem(kernels._ext, "cpu", spy)
        for dtype in (torch.float32, torch.float64):
            args = make_kv_case(2, 3, 2, 16, 20, 4, dtype=dtype, seed=7)
            ref_k, ref_v = args[0].clone(), args[1].clone()
            kv_inject_ref(ref_k, ref_v, *args[2:])
            draft_diffusion.kv_inject(*args)
            assert mismatches(args[0], ref_k) == 0 and mismatches(args[1], ref_v) == 0
    assert calls == [torch.float32]


def test_a_first_build_says_so_before_it_starts(tmp_path, monkeypatch, capsys):
    """A build is silent for a minute with nvcc; only a reused one may stay quiet. It compiles
    ext.cpp and both .cu files, linked with _cudart_flags' -L flags (a wrapper nvcc's toolkit
    has no libcudart); with no toolkit at all the build says so."""
    from torch.utils import cpp_extension
    monkeypatch.setattr(kernels, "BUILD_ROOT", tmp_path)
    monkeypatch.setattr(kernels, "_cudart_flags", lambda cuda_home: [f"-L{cuda_home}/lib64"])
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: kw)
    kw = kernels._build()
    assert kw["build_directory"] == str(tmp_path / "dflash_kernels")
    assert [os.path.basename(s) for s in kw["sources"]] == ["ext.cpp", "kv_inject.cu",
                                                            "accept_scan.cu"]
    assert kw["extra_ldflags"] == [f"-L{tmp_path}/lib64"]
    assert "kernels: building the extension into" in capsys.readouterr().out
    (tmp_path / "dflash_kernels" / "dflash_kernels.so").touch()
    kernels._build()
    assert "building" not in capsys.readouterr().out
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(RuntimeError, match="no CUDA toolkit"):
        kernels._build()


def test_cudart_flags_see_through_an_nvcc_wrapper(tmp_path):
    """torch guesses the toolkit from `which nvcc`; a wrapper script there (as
    /usr/local/bin/nvcc on this project's machines) has no libcudart beside it, so the CUDA
    build would not link without the -L flags for the toolkit nvcc -dryrun names. Fake toolkits."""
    def script(path, body):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n" + body + "\n")
        path.chmod(0o755)
    script(tmp_path / "probe", "exit 0")
    try:
        subprocess.run([tmp_path / "probe"], check=True)
    except OSError as e:  # e.g. a /tmp mounted noexec
        pytest.skip(f"cannot run scripts from {tmp_path}: {e}")
    real, wrap = tmp_path / "cuda-13.0", tmp_path / "local"
    script(real / "bin" / "nvcc", f'echo "#$ _HERE_={real}/bin" >&2')  # what nvcc -dryrun prints
    script(wrap / "bin" / "nvcc", f'exec {real / "bin" / "nvcc"} "$@"')
    flags = kernels._cudart_flags
    assert flags(wrap) == flags(real) == [f"-L{real}/lib64", f"-L{real}/lib"]
    script(wrap / "bin" / "nvcc", "exit 1")     # an nvcc that names no folder: torch's guess only
    assert flags(wrap) == []
    with pytest.raises(OSError):                # no nvcc at all: the build fails, and says why
        flags(tmp_path / "missing")


def test_no_package_of_ours_shadows_nvidias_or_hugging_faces(tmp_path):
    """CUDA builds of torch import NVIDIA's cuda.bindings (a namespace package named cuda), and
    transformers imports Hugging Face's `kernels` where it is installed: our package is
    dflash_kernels, so from the repository root all of them import, in either order."""
    (tmp_path / "cuda" / "bindings").mkdir(parents=True)
    (tmp_path / "cuda" / "bindings" / "__init__.py").write_text("VERSION = 'fake'\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("HF = True\n")
    for first, second in (("dflash_kernels", "cuda.bindings"), ("cuda.bindings", "dflash_kernels")):
        code = (f"import {first}, {second}, kernels; assert kernels.HF; "
                "assert cuda.bindings.VERSION == 'fake' and callable(dflash_kernels.available)")
        r = subprocess.run([sys.executable, "-c", code], cwd=kernels.HERE.parent,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert r.returncode == 0, r.stderr[-2000:]


# -----------------------------------------------------------------------------
# end to end: DFlash decoding with both kernels in the loop

E2E_PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def dflash_outputs(device, dtype, module, monkeypatch, check_plain=False):
    """Greedy DFlash decoding of a ragged batch (a tiny random target and drafter) with the
    given module serving `device`'s tensors (None: the references), checking that both ops
    reached it; optionally asserts that the output equals plain decoding."""
    import speculate
    from draft_diffusion import DFlashDrafter
    from test_dflash import setup
    target, df = setup(block_size=8)
    target, df = target.to(device, dtype), df.to(device, dtype)
    calls = []
    spy = None if module is None else SimpleNamespace(
        kv_inject=lambda *a: calls.append("kv_inject") or module.kv_inject(*a),
        accept_scan=lambda *a: calls.append("accept_scan") or module.accept_scan(*a))
    monkeypatch.setitem(kernels._ext, torch.device(device).type, spy)
    outs, _ = speculate.generate(target, E2E_PROMPTS, DFlashDrafter(target, df),
                                 max_new_tokens=24, K=7)
    if module is not None:
        assert "kv_inject" in calls and "accept_scan" in calls, calls
    if check_plain:
        assert outs == speculate.generate(target, E2E_PROMPTS, None, max_new_tokens=24)[0]
    return outs


def test_the_end_to_end_case_has_no_near_tie():
    """On a GPU, test_dflash_end_to_end_cuda compares float32 DFlash with plain decoding. A
    verify pass rounds differently from one-token steps (logits ~1e-5 apart in float32), so a
    token that wins by less could flip without a bug. Here each greedy token wins by far more
    (the smallest margin measured: 0.007), so a mismatch there is a bug."""
    import speculate
    from test_dflash import setup
    target, _ = setup(block_size=8)
    outs = speculate.generate(target, E2E_PROMPTS, None, max_new_tokens=24)[0]
    for p, o in zip(E2E_PROMPTS, outs):
        with torch.no_grad():
            logits = target(torch.tensor([p + o]))[0][0, len(p) - 1:-1]  # what each token beat
        top = logits.topk(2, dim=-1).values
        assert len(o) == 24 and (top[:, 0] - top[:, 1]).min() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_end_to_end_emulated_kernels(emu, dtype, monkeypatch):
    """Greedy DFlash on a ragged batch with both kernels' own code in the loop equals the
    reference path, and in float32 plain decoding too. (bfloat16 once crashed here:
    model.to(bfloat16) rounded the RoPE tables, which kv_inject takes in float32 only.)"""
    emulated = dflash_outputs("cpu", dtype, emu, monkeypatch, check_plain=dtype == torch.float32)
    assert emulated == dflash_outputs("cpu", dtype, None, monkeypatch)


# -----------------------------------------------------------------------------
# the self-check, python dev/kernels_check.py

def test_mismatches_counts_nan_against_a_number_both_ways():
    """The outputs start as NaN: a slot a kernel failed to write (NaN where the reference has a
    number) is a mismatch, as is a stray write (a number where the reference kept NaN)."""
    nan = float("nan")
    assert mismatches(torch.tensor([nan, 1.0]), torch.tensor([2.0, 1.0])) == 1
    assert mismatches(torch.tensor([2.0, 1.0]), torch.tensor([nan, 1.0])) == 1
    assert mismatches(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.5])) == 1
    assert mismatches(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0])) == 0
    assert mismatches(torch.tensor([3, 4]), torch.tensor([3, 5])) == 1  # tokens, counts


def test_self_check_covers_every_op_version_and_shape(emu, capsys):
    """python dev/emu.py: each kernel version on the shapes the README promises (B = 1, 3, 7;
    K = 1, 15; V = 97, 4099, not multiples of 32), both cache dtypes, all three accept modes,
    greedy on float32 and on bfloat16 logits."""
    import dev.kernels_check as selfcheck
    assert dev_emu.main([]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:4]) for line in out.splitlines()
            if line.startswith(("kv_inject ", "accept_scan "))}
    kv = {("kv_inject", "emu1", "LBHDTt=" + "x".join(map(str, s)), dtype)
          for s in selfcheck.KV_SHAPES for dtype in ("float32", "bfloat16")}
    accept = {("accept_scan", f"emu{v}", "BKV=" + "x".join(map(str, shape)), mode)
              for shape in ACCEPT_SHAPES for mode in MODES + ("greedy_bf16",)
              for v in (VERSIONS["accept_scan"] if "greedy" in mode else (1,))}
    assert rows == kv | accept and "all 44 rows match the reference" in out


class Broken:
    """The emulated build with the last row's token and its n_accepted wrong, and stray writes
    into the last slot of row 0 of both caches (row 0 has no new tokens in every case with
    B > 1, so those show only against the NaN the outputs start as)."""

    def __init__(self, ext, what):
        self.ext, self.what, self.dtypes = ext, what, set()

    def accept_scan(self, *args):
        self.dtypes.add((args[2] is None and args[3] is None, args[0].dtype))  # (greedy, dtype)
        n, nxt = self.ext.accept_scan(*args)
        if self.what == "token":
            nxt[-1] += 1
        else:
            n[0] += 1
        return n, nxt

    def kv_inject(self, cache_k, cache_v, *args):
        self.ext.kv_inject(cache_k, cache_v, *args)
        (cache_k if self.what == "token" else cache_v)[:, 0, :, -1] = 0.0


def test_self_check_fails_every_row_of_a_broken_module(emu, capsys):
    """A module that gets a token wrong and writes where it should not fails every row and the
    exit status; the rows test the dtypes they name."""
    import dev.kernels_check as selfcheck
    broken = Broken(emu, "token")
    assert selfcheck.run(broken, "cpu", 0, tag="emu") == 1
    out = capsys.readouterr().out
    assert "44 rows, 44 with mismatches" in out and out.count("MISMATCH") == 44
    assert broken.dtypes == {(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)}


def test_self_check_counts_a_wrong_n_accepted_and_a_stray_value_write(emu, capsys):
    """The rows must count every output: n_accepted as well as the token, and the V cache as
    well as the K cache."""
    import dev.kernels_check as selfcheck
    assert selfcheck.run(Broken(emu, "n_and_v"), "cpu", 0, tag="emu") == 1
    out = capsys.readouterr().out
    assert "44 rows, 44 with mismatches" in out
    L, B, H, D, T_max, T_new = (3, 3, 1, 16, 40, 7)  # one stray slot per (layer, head) of row 0
    assert re.search(rf"LBHDTt=3x3x1x16x40x7 +float32 +{L * H * D} untimed  MISMATCH", out)


def test_self_check_without_a_gpu_says_so(monkeypatch, capsys):
    import dev.kernels_check as selfcheck
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels, "available", lambda d: pytest.fail("nothing to build here"))
    assert selfcheck.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device here" in out and "python dev/emu.py" in out


@pytest.mark.parametrize("argv,message", [(["--repeat", "-1"], "--repeat must be >= 1"),
                                          (["--op", "kv"], "invalid choice: 'kv'")])
def test_self_check_refuses_bad_flags_in_one_line(argv, message):
    r = subprocess.run([sys.executable, "dev/kernels_check.py", *argv], cwd=kernels.HERE.parent,
                       capture_output=True, text=True)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


# -----------------------------------------------------------------------------
# on the GPU (skipped without one)

@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", KV_SHAPES + [(5, 8, 8, 128, 300, 16), (2, 3, 2, 16, 20, 0)])
def test_kv_inject_cuda(ext, shape, dtype):  # the last: nothing new, so nothing launched
    args = make_kv_case(*shape, dtype=dtype, seed=4, device="cuda")
    ref_k, ref_v = args[0].clone(), args[1].clone()
    kv_inject_ref(ref_k, ref_v, *args[2:])
    ext.kv_inject(*args)
    assert mismatches(args[0], ref_k) == 0 and mismatches(args[1], ref_v) == 0


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("version", VERSIONS["accept_scan"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ACCEPT_SHAPES + QWEN_SHAPES + [(3, 0, 4099)])  # K = 0: ar
def test_accept_scan_cuda(ext, shape, mode, version):
    # quantized probabilities: every summation order gives the same CDF, so the GPU's tile scan
    # must agree bit for bit with the CPU reference's sequential one
    p, drafts, q, u = make_accept_case(*shape, mode, seed=5)
    n_ref, nxt_ref = accept_scan_ref(p, drafts, q, u)
    c = lambda t: None if t is None else t.cuda()
    n, nxt = ext.accept_scan(c(p), c(drafts), c(q), c(u), version)
    assert torch.equal(n.cpu(), n_ref) and torch.equal(nxt.cpu(), nxt_ref)
    for dtype in (torch.bfloat16, torch.float64):  # other logits; a drafter's bf16 q
        args = (p.to(dtype), drafts, None if q is None else q.to(dtype), u)
        n, nxt = ext.accept_scan(*map(c, args), version)
        n_ref, nxt_ref = accept_scan_ref(*args)
        assert torch.equal(n.cpu(), n_ref) and torch.equal(nxt.cpu(), nxt_ref)
    empty = (c(None if t is None else t[:0]) for t in (p, drafts, q, u))
    n, nxt = ext.accept_scan(*empty, version)
    assert n.shape == nxt.shape == (0,)  # B = 0: nothing launched (an empty launch is an error)
    if mode == "greedy":  # whole-number logits above are exact in float32: this row is not
        p, drafts = float64_near_tie()
        out = ext.accept_scan(p.cuda(), drafts.cuda(), None, None, version)
        assert [t.tolist() for t in out] == [[1], [600]]


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
def test_speculate_uses_the_extension_on_cuda(ext):
    import speculate
    p, drafts, q, u = (t if t is None else t.cuda() for t in make_accept_case(3, 4, 97, "sample_q"))
    assert kernels.available("cuda")
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in
               zip(speculate.accept_scan(p, drafts, q, u), accept_scan_ref(p, drafts, q, u)))


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_end_to_end_cuda(ext, dtype, monkeypatch):
    """Greedy DFlash with both kernels on equals the reference path (bit-exact ops, so the
    same tokens), and in float32 equals plain decoding too."""
    fused = dflash_outputs("cuda", dtype, ext, monkeypatch, check_plain=dtype == torch.float32)
    assert fused == dflash_outputs("cuda", dtype, None, monkeypatch)
