"""
Tests of the CUDA extension (cuda/, DESIGN.md sec. 7): every path against its PyTorch reference
on random and awkward shapes (B = 1, 3, 7; K = 1, 15; V = 97, 4099), and the reference
kv_inject_ref against a per-element loop over model.apply_rope.

On a machine without a GPU the extension builds its host (CPU) variant with g++ (about a
minute the first time, cached in out/cuda_build/) and the host loops are checked bit for bit;
the .cu files are compile-checked when nvcc exists; GPU tests skip without a GPU.

    python -m pytest -q tests/test_cuda.py
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import cuda
from cuda.__main__ import make_accept_case, make_kv_case, mismatches
from model import apply_rope

MODES = ("greedy", "sample_q", "sample_argmax")
ACCEPT_SHAPES = [(1, 1, 97), (1, 15, 4099), (3, 15, 97), (3, 1, 4099), (7, 15, 4099), (7, 1, 97)]  # (B, K, V)
QWEN_SHAPES = [(2, 15, 151936)]  # Qwen3's vocabulary (the paper's targets): many tiles per row, ~1.3 s emulated
KV_SHAPES = [(2, 1, 2, 64, 64, 16), (3, 3, 1, 16, 40, 7), (2, 7, 2, 64, 96, 5),  # (L, B, H, D, T_max, T_new)
             (1, 2, 1, 4, 8, 3)]  # 12 rotation pairs, less than one block: a grid rounded down launches none
has_gpu = torch.cuda.is_available()


@pytest.fixture(scope="module")
def ext():
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no ninja or C++ compiler to build the extension")
    e = cuda.load()
    assert e is not None, f"the extension did not build, with ninja and a compiler present: {cuda.build_error()}"
    return e


def kv_inject_loop(cache_k, cache_v, new_k, new_v, offsets, counts, cos, sin):
    """The definition, one (l, b, t, h) vector at a time, through model.apply_rope."""
    L, B, H, T_max, D = cache_k.shape
    for l in range(L):
        for b in range(B):
            for t in range(int(counts[b])):
                pos = int(offsets[b]) + t
                c, s = cos[pos].view(1, 1, 1, -1), sin[pos].view(1, 1, 1, -1)        # (1, 1, 1, D/2)
                for h in range(H):
                    x = new_k[l, b, t, h].float().view(1, 1, 1, D)                   # (B, H, T, D) = 1, 1, 1, D
                    cache_k[l, b, h, pos] = apply_rope(x, c, s).view(D).to(cache_k.dtype)
                    cache_v[l, b, h, pos] = new_v[l, b, t, h]


# -----------------------------------------------------------------------------
# the references

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", KV_SHAPES[1:])
def test_kv_inject_ref_matches_loop(shape, dtype):
    args = make_kv_case(*shape, dtype=dtype, seed=1)
    k_loop, v_loop = args[0].clone(), args[1].clone()
    kv_inject_loop(k_loop, v_loop, *args[2:])
    cuda.kv_inject_ref(*args)
    assert args[5][0] == 0  # row 0 has no new tokens: its cache stays all NaN
    assert args[4][-1] + args[5][-1] == shape[4]  # the last row writes up to the end of the cache
    assert args[0][:, 0].isnan().all() and args[1][:, 0].isnan().all()
    assert mismatches(args[0], k_loop)[0] == 0 and mismatches(args[1], v_loop)[0] == 0
    assert (~args[0].isnan()).sum() == args[0].shape[0] * shape[2] * shape[3] * int(args[5].sum())


def replaced(args, i, *values):
    """A copy of the argument list with args[i], args[i + 1], ... = values."""
    args = list(args)
    args[i:i + len(values)] = values
    return args


def test_kv_inject_ref_checks_bounds():
    args = make_kv_case(1, 2, 2, 8, 10, 4)  # the last row writes slots 6..9
    for bad in (replaced(args, 4, torch.tensor([0, 7])),          # row 1 would write slots 7..10 with T_max = 10
                replaced(args, 5, torch.tensor([0, -1])),         # a negative count
                replaced(args, 6, args[6][:9], args[7][:9])):     # RoPE tables one row short of slot 9
        with pytest.raises(ValueError):
            cuda.kv_inject_ref(*bad)


# -----------------------------------------------------------------------------
# the extension's host path (built with g++, no GPU needed)

@pytest.fixture(scope="module", params=["host", "emu"])
def built(request):
    """The extension's host loops, or the CUDA kernels emulated on the CPU (section below)."""
    return request.getfixturevalue("ext" if request.param == "host" else "emu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", KV_SHAPES + [(4, 7, 2, 64, 256, 16)])
def test_kv_inject_built(built, shape, dtype):
    args = make_kv_case(*shape, dtype=dtype, seed=2)
    ref_k, ref_v = args[0].clone(), args[1].clone()
    cuda.kv_inject_ref(ref_k, ref_v, *args[2:])
    assert built.kv_inject(*args) is None  # emulated: kv_inject_kernel1, grid-stride over (l, b, t, h, i)
    assert mismatches(args[0], ref_k) == (0, 0.0)  # bit for bit, NaN where nothing was written
    assert mismatches(args[1], ref_v) == (0, 0.0)


def test_kv_inject_host_checks(ext):
    good = make_kv_case(1, 2, 2, 8, 10, 4)  # the last row writes slots 6..9

    def call(i, *values):  # good arguments with args[i], args[i + 1], ... = values
        ext.kv_inject(*replaced(good, i, *values))

    with pytest.raises(RuntimeError, match="outside the cache"):
        call(4, torch.tensor([0, 7]))                      # offsets: row 1 runs past T_max
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(4, torch.tensor([0, 2 ** 63 - 2]))            # offset + count wraps to a negative int64
    with pytest.raises(RuntimeError, match="counts"):
        call(5, torch.tensor([0, 5]))                      # counts > T_new
    with pytest.raises(RuntimeError, match="counts"):
        call(5, torch.tensor([0, -1]))                     # a negative count (dropped, it writes nothing, silently)
    with pytest.raises(RuntimeError, match="RoPE"):
        call(6, good[6][:5], good[7][:5])                  # tables too short (P = 5)
    with pytest.raises(RuntimeError, match="RoPE"):
        call(6, good[6][:9], good[7][:9])                  # one row short (off + count = P + 1 would read cos[P])
    with pytest.raises(RuntimeError, match="dtype"):
        call(2, good[2].double())
    with pytest.raises(RuntimeError, match="contiguous"):
        call(2, good[2].transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(RuntimeError, match="even"):
        ext.kv_inject(torch.zeros(1, 1, 1, 4, 3), torch.zeros(1, 1, 1, 4, 3), torch.zeros(1, 1, 1, 1, 3),
                      torch.zeros(1, 1, 1, 1, 3), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                      torch.zeros(4, 1), torch.zeros(4, 1))
    assert good[0].isnan().all() and good[1].isnan().all()  # nothing written by any of them


def test_kv_inject_refuses_a_negative_offset(ext):
    """Row 1 at offset -1 would write slot -1, i.e. the end of the slice before it: the reference
    and the host path refuse it, as they refuse a row past the end."""
    args = list(make_kv_case(1, 2, 2, 8, 10, 4))
    args[4], args[5] = torch.tensor([0, -1]), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="offsets"):
        cuda.kv_inject_ref(*args)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.kv_inject(*args)
    assert args[0].isnan().all() and args[1].isnan().all()


def test_kv_inject_short_row_at_the_end_of_the_rope_tables(built):
    """A row with fewer new tokens than T_new in the last slot (as the other rows of a refill
    are, with count 0 at their own offsets): its padding lies past the RoPE tables, and only
    its real token is rotated and written, by every path."""
    args = list(make_kv_case(2, 2, 1, 8, 10, 4, seed=5))  # P = T_max = 10
    args[4], args[5] = torch.tensor([9, 0]), torch.tensor([1, 4])  # row 0's padding at positions 10..12
    k_loop, v_loop = args[0].clone(), args[1].clone()
    kv_inject_loop(k_loop, v_loop, *args[2:])
    ref_k, ref_v = args[0].clone(), args[1].clone()
    cuda.kv_inject_ref(ref_k, ref_v, *args[2:])
    assert mismatches(ref_k, k_loop) == (0, 0.0) and mismatches(ref_v, v_loop) == (0, 0.0)
    built.kv_inject(*args)
    assert mismatches(args[0], ref_k) == (0, 0.0) and mismatches(args[1], ref_v) == (0, 0.0)


def test_accept_scan_host_sampling_keeps_nan_like_the_reference(ext):
    """The host loop's residual lets NaN through (torch's clamp) and clamps the token to V - 1,
    like the reference: a NaN in each row's emitted distribution gives token 96 of V = 97."""
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q", seed=8)
    n = cuda.accept_scan_ref(p, drafts, q, u)[0]
    for b in range(3):  # at a token no draft of the row is
        p[b, n[b], next(j for j in range(97) if j not in drafts[b])] = float("nan")
    for qq in (q, None):  # drafts from q, and argmax drafts (q one-hot)
        n_ref, nxt_ref = cuda.accept_scan_ref(p, drafts, qq, u)
        assert nxt_ref.tolist() == [96] * 3 or qq is None
        assert all(torch.equal(a, b) for a, b in zip(ext.accept_scan(p, drafts, qq, u, 1), (n_ref, nxt_ref)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ACCEPT_SHAPES + QWEN_SHAPES)
def test_accept_scan_host(ext, shape, mode):
    for seed, exact in ((0, True), (1, False)):  # the host path is exact even on unquantized input
        p, drafts, q, u = make_accept_case(*shape, mode, seed=seed, exact=exact)
        n_ref, nxt_ref = cuda.accept_scan_ref(p, drafts, q, u)
        n, nxt = ext.accept_scan(p, drafts, q, u, 1)
        assert torch.equal(n, n_ref) and torch.equal(nxt, nxt_ref)
        assert n.dtype == nxt.dtype == torch.int64


@pytest.mark.parametrize("version", cuda.VERSIONS["accept_scan"])
@pytest.mark.parametrize("mode", MODES)
def test_accept_scan_with_no_drafts_is_plain_decoding(built, mode, version):
    """K = 0, what `ar` sends through the loop at every step: nothing accepted, and the token is
    p's argmax or its inverse-CDF draw, exactly the reference's."""
    p, drafts, q, u = make_accept_case(3, 0, 4099, mode, seed=5)  # sample_q: q of shape (3, 0, V)
    n, nxt = built.accept_scan(p, drafts, q, u, version)
    n_ref, nxt_ref = cuda.accept_scan_ref(p, drafts, q, u)
    assert torch.equal(n, n_ref) and torch.equal(nxt, nxt_ref) and not n.any()


def test_accept_scan_host_covers_cases():
    """The inputs really exercise partial acceptance, full acceptance and the zero-residual row."""
    ns = torch.cat([cuda.accept_scan_ref(*make_accept_case(7, 15, 97, m, seed=s))[0] for m in MODES for s in range(4)])
    assert (ns == 0).any() and ((ns > 0) & (ns < 15)).any()
    ns = torch.cat([cuda.accept_scan_ref(*make_accept_case(7, 1, 97, m, seed=s))[0] for m in MODES for s in range(4)])
    assert (ns == 1).any()  # all K accepted: the bonus token
    p, drafts, q, u = make_accept_case(7, 15, 97, "sample_q")
    n = cuda.accept_scan_ref(p, drafts, q, u)[0]
    zero_residual = [b for b in range(7) if n[b] < 15 and (p[b, n[b]] - q[b, n[b]]).clamp(min=0).sum() == 0]
    assert zero_residual == [0]  # the row built for the fallback to p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accept_scan_host_greedy_low_precision_and_nan(ext, dtype):
    p, drafts, _, _ = make_accept_case(3, 15, 4099, "greedy", dtype=dtype, seed=3)
    p[1, 2, [5, 9]] = float("nan")  # torch.argmax: NaN is the maximum, first NaN wins
    p[0] = float("-inf")            # all -inf rows: token 0, so draft 0 is accepted and the next row answers 0
    drafts[0, 0] = 0
    assert all(torch.equal(a, b) for a, b in zip(ext.accept_scan(p, drafts, None, None, 1),
                                                 cuda.accept_scan_ref(p, drafts)))


def float64_near_tie():
    """Draft 7 accepted, then a bonus row whose maximum 1.0 (token 600) and 1 - 2^-40 (token 40,
    another warp) round to one float32: compared in float32 the tie goes to token 40."""
    p = torch.zeros(1, 2, 4099, dtype=torch.float64)
    p[0, 0, 7], p[0, 1, 40], p[0, 1, 600] = 1.0, 1 - 2.0 ** -40, 1.0
    return p, torch.tensor([[7]])


@pytest.mark.parametrize("version", cuda.VERSIONS["accept_scan"])
def test_accept_scan_greedy_compares_float64_in_float64(built, version):
    """Catches float64 logits compared in float32 (float64_near_tie); the random case's
    whole-number logits are exact in float32 and only check the float64 path's indexing."""
    p, drafts, _, _ = make_accept_case(3, 15, 4099, "greedy", dtype=torch.float64, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(built.accept_scan(p, drafts, None, None, version),
                                                 cuda.accept_scan_ref(p, drafts)))
    p, drafts = float64_near_tie()
    assert [t.tolist() for t in built.accept_scan(p, drafts, None, None, version)] == [[1], [600]]
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts)] == [[1], [600]]


# -----------------------------------------------------------------------------
# switching paths

def test_env_zero_forces_reference(monkeypatch):
    monkeypatch.setenv(cuda.ENV, "0")
    monkeypatch.setattr(cuda, "load", lambda *a, **k: pytest.fail("DFLASH_CUDA_EXT=0 must not build"))
    assert cuda.active_path("cpu") == ("reference", f"forced by {cuda.ENV}=0")
    assert cuda.active_path("cuda")[0] == "reference"
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    assert all(torch.equal(a, b) for a, b in zip(cuda.accept_scan(p, drafts, q, u), cuda.accept_scan_ref(p, drafts, q, u)))


def test_an_unknown_env_value_is_named_not_taken_for_a_choice(monkeypatch):
    """DFLASH_CUDA_EXT=emulate (for emu) used to pass silently for the default; an empty value
    is the default."""
    monkeypatch.setattr(cuda, "load", lambda *a, **k: pytest.fail("an unknown value must not build"))
    monkeypatch.setenv(cuda.ENV, "emulate")
    assert cuda.active_path("cpu") == ("reference", f"unknown {cuda.ENV}='emulate': choose 1, host, emu or 0")
    monkeypatch.setenv(cuda.ENV, " ")
    assert cuda.active_path("cpu")[1].startswith("CPU tensors, no build")


def test_cpu_default_uses_reference_without_building(monkeypatch):
    """Both ops, CPU tensors, no DFLASH_CUDA_EXT: the references run and nothing is built."""
    monkeypatch.delenv(cuda.ENV, raising=False)
    for name in ("load", "load_emu"):
        monkeypatch.setattr(cuda, name, lambda *a, **k: pytest.fail("CPU tensors must not trigger a build"))
    calls = []
    for name in ("kv_inject_ref", "accept_scan_ref"):  # count the calls that reach each reference
        ref = getattr(cuda, name)
        monkeypatch.setattr(cuda, name, lambda *a, _ref=ref, _name=name: calls.append(_name) or _ref(*a))
    args = make_kv_case(2, 3, 1, 16, 20, 4)
    ref_k = args[0].clone()
    cuda.kv_inject_ref(ref_k, args[1].clone(), *args[2:])
    calls.clear()
    cuda.kv_inject(*args)
    assert mismatches(args[0], ref_k)[0] == 0
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    cuda.accept_scan(p, drafts, q, u)
    assert calls == ["kv_inject_ref", "accept_scan_ref"]


def test_env_host_uses_extension(ext, monkeypatch):
    monkeypatch.setenv(cuda.ENV, "host")
    assert cuda.active_path("cpu")[0] == "extension"
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_argmax")
    p = p.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous input is fine through the wrapper
    assert all(torch.equal(a, b) for a, b in zip(cuda.accept_scan(p, drafts, q, u), cuda.accept_scan_ref(p, drafts, q, u)))


def test_env_host_kv_inject_takes_what_the_reference_takes(ext, monkeypatch, capsys):
    """Through the wrapper: non-contiguous inputs reach the extension made contiguous, and a
    float64 cache (no kernel: the extension refuses it) takes the reference and says so."""
    monkeypatch.setenv(cuda.ENV, "host")
    monkeypatch.setattr(cuda, "_announced", set())
    strided = lambda t: torch.stack([t, t], -1)[..., 0]  # the same values, not contiguous
    for dtype in (torch.float32, torch.float64):
        args = list(make_kv_case(2, 3, 2, 16, 20, 4, dtype=dtype, seed=7))
        ref_k, ref_v = args[0].clone(), args[1].clone()
        cuda.kv_inject_ref(ref_k, ref_v, *args[2:])
        args[2:] = [strided(t) for t in args[2:]]  # new K/V, offsets, counts, RoPE tables
        assert not any(t.is_contiguous() for t in args[2:])
        cuda.kv_inject(*args)
        assert mismatches(args[0], ref_k) == (0, 0.0) and mismatches(args[1], ref_v) == (0, 0.0)
    out = capsys.readouterr().out
    assert "kv_inject with a float64 cache uses the reference path" in out
    assert out.count("uses the extension path") == 1  # the float32 call; the float64 one builds nothing
    with pytest.raises(RuntimeError, match="dtype"):  # what the wrapper steers the float64 cache around
        ext.kv_inject(*make_kv_case(2, 3, 2, 16, 20, 4, dtype=torch.float64))


def test_each_path_is_announced_once_per_op(monkeypatch, capsys):
    monkeypatch.setattr(cuda, "_announced", set())
    monkeypatch.setenv(cuda.ENV, "0")
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    for _ in range(3):
        cuda.accept_scan(p, drafts, q, u)
    assert capsys.readouterr().out.count("accept_scan on cpu uses the reference path") == 1


def test_each_op_is_announced_under_its_own_name(monkeypatch, capsys):
    monkeypatch.setattr(cuda, "_announced", set())
    monkeypatch.setenv(cuda.ENV, "0")
    kv, (p, drafts, q, u) = make_kv_case(1, 2, 1, 8, 10, 4), make_accept_case(3, 4, 97, "sample_q")
    for _ in range(2):
        cuda.kv_inject(*kv)
        cuda.accept_scan(p, drafts, q, u)
    out = capsys.readouterr().out
    assert out.count("cuda: kv_inject on cpu uses the reference path") == 1
    assert out.count("cuda: accept_scan on cpu uses the reference path") == 1 and out.count("\n") == 2


def test_other_devices_and_a_build_without_cuda_take_the_reference(monkeypatch):
    """No kernels for meta (or mps) tensors: nothing is built for them. CUDA tensors with a
    host-only build (no CUDA device when it was built) take the reference, not the host loops."""
    monkeypatch.setenv(cuda.ENV, "host")
    monkeypatch.setattr(cuda, "load", lambda *a, **k: pytest.fail("no kernels for meta tensors: nothing to build"))
    assert cuda.active_path("meta") == ("reference", "no kernels for meta tensors")
    host_only = type("HostOnly", (), {"with_cuda": False})()
    monkeypatch.setattr(cuda, "_ext", host_only)
    monkeypatch.setattr(cuda, "load", lambda *a, **k: host_only)
    assert cuda.active_path("cuda") == ("reference", "extension was built without CUDA")
    assert cuda.active_path("cpu")[0] == "extension"  # while it serves CPU tensors


def test_a_failed_build_is_tried_once_reported_and_ctrl_c_still_stops(monkeypatch):
    calls = []

    def bad(verbose=False):
        calls.append(1)
        raise RuntimeError("g++ ...\nerror: boom\n")
    monkeypatch.setattr(cuda, "_ext", None)
    monkeypatch.setattr(cuda, "_ext_error", None)
    monkeypatch.setattr(cuda, "_build", bad)
    assert cuda.load() is None and cuda.load() is None and len(calls) == 1  # not again at every op call
    monkeypatch.setenv(cuda.ENV, "host")
    assert cuda.active_path("cpu") == ("reference", "build failed: RuntimeError: error: boom")
    monkeypatch.setattr(cuda, "_ext_error", None)

    def ctrl_c(verbose=False):
        raise KeyboardInterrupt
    monkeypatch.setattr(cuda, "_build", ctrl_c)
    with pytest.raises(KeyboardInterrupt):  # an interrupted build stops the program, it is no build failure
        cuda.load()
    assert cuda.build_error() is None


def test_env_values_are_read_loosely_and_emulation_is_for_cpu_tensors_only(monkeypatch):
    monkeypatch.setenv(cuda.ENV, " 0\n")
    assert cuda.active_path("cpu") == ("reference", f"forced by {cuda.ENV}=0")
    monkeypatch.setenv(cuda.ENV, "EMU")
    monkeypatch.setattr(cuda, "load_emu", lambda *a, **k: None)
    assert cuda.active_path("cpu")[0] == "emulation"
    monkeypatch.setattr(cuda, "load_emu", lambda *a, **k: pytest.fail("no emulation for CUDA tensors"))
    assert cuda.active_path("cuda") == ("reference", f"{cuda.ENV}=emu emulates the kernels for CPU tensors only")

    def boom(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(cuda, "load_emu", boom)
    assert cuda.active_path("cpu") == ("reference", "emulation build failed: RuntimeError: boom")


def dflash_outputs(device, dtype, mode, monkeypatch, check_plain=False):
    """Greedy DFlash decoding of a ragged batch (a tiny random target and drafter) with the
    given DFLASH_CUDA_EXT mode, checking that both ops reached the extension unless the mode is
    0; optionally asserts that the output equals plain decoding."""
    import speculate
    from draft_diffusion import DFlashDrafter
    from test_dflash import setup
    target, df = setup(block_size=8)
    target, df = target.to(device, dtype), df.to(device, dtype)
    monkeypatch.setenv(cuda.ENV, mode)
    calls = []
    if mode != "0":  # count the calls that reach the built module: both ops must be in the loop
        module = cuda.load_emu() if mode == "emu" else cuda.load()
        for op in ("kv_inject", "accept_scan"):
            fn = getattr(module, op)
            monkeypatch.setattr(module, op, lambda *a, fn=fn, op=op: calls.append(op) or fn(*a))
    outs, _ = speculate.generate(target, E2E_PROMPTS, DFlashDrafter(target, df), max_new_tokens=24, K=7)
    if mode != "0":
        assert "kv_inject" in calls and "accept_scan" in calls, calls
    if check_plain:
        assert outs == speculate.generate(target, E2E_PROMPTS, None, max_new_tokens=24)[0]
    return outs


E2E_PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def test_the_end_to_end_case_has_no_near_tie():
    """On a GPU, test_dflash_end_to_end_cuda compares float32 DFlash with plain decoding. A
    verify pass rounds differently from one-token steps (logits ~1e-5 apart in float32, README
    Troubleshooting), so a token that wins by less could flip without a bug. Here each greedy
    token wins by far more (the smallest margin measured: 0.007), so a mismatch there is a bug."""
    import speculate
    from test_dflash import setup
    target, _ = setup(block_size=8)
    outs = speculate.generate(target, E2E_PROMPTS, None, max_new_tokens=24)[0]
    for p, o in zip(E2E_PROMPTS, outs):
        with torch.no_grad():
            logits = target(torch.tensor([p + o]))[0][0, len(p) - 1:-1]  # the logits each token was chosen from
        top = logits.topk(2, dim=-1).values
        assert len(o) == 24 and (top[:, 0] - top[:, 1]).min() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_end_to_end_host_equals_reference(ext, dtype, monkeypatch):
    # bfloat16 once crashed here: model.to(bfloat16) rounded the RoPE tables, which kv_inject
    # takes in float32 only (the same path a GPU run with --dtype bfloat16 takes)
    host = dflash_outputs("cpu", dtype, "host", monkeypatch, check_plain=dtype == torch.float32)
    assert host == dflash_outputs("cpu", dtype, "0", monkeypatch)


def test_nvidia_cuda_namespace_still_imports(tmp_path):
    """CUDA builds of torch import NVIDIA's cuda.bindings, a namespace package named like this
    one; both import orders must leave cuda.bindings and cuda.kv_inject reachable."""
    (tmp_path / "cuda" / "bindings").mkdir(parents=True)
    (tmp_path / "cuda" / "bindings" / "__init__.py").write_text("VERSION = 'fake'\n")
    root = cuda.HERE.parent
    for order in ("import cuda, cuda.bindings", "import cuda.bindings, cuda"):
        code = f"{order}; assert cuda.bindings.VERSION == 'fake' and callable(cuda.kv_inject)"
        r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]


def test_stale_build_lock_is_removed(tmp_path, monkeypatch):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - cuda.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    # the loop sleeps only while it waits for a live build: waiting on this lock would hang
    # the test for as long as the lock exists, so the first sleep fails it instead
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("waited on a stale lock instead of removing it"))
    cuda._wait_for_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_first_build_says_so_before_it_starts(tmp_path, monkeypatch, capsys):
    """A build is silent for seconds (minutes with nvcc); only a reused one may stay quiet."""
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no ninja or C++ compiler")
    monkeypatch.setattr(cuda, "BUILD_ROOT", tmp_path)
    cuda._build_dir("ext_x")
    assert "cuda: building ext_x into" in capsys.readouterr().out
    (tmp_path / "ext_x" / "ext_x.so").touch()
    cuda._build_dir("ext_x")
    assert "building" not in capsys.readouterr().out


# -----------------------------------------------------------------------------
# the CUDA kernels' own code, emulated on the CPU (cuda/emu.h): runs wherever g++ does

@pytest.fixture(scope="module")
def emu():
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no ninja or C++ compiler to build the emulation")
    try:
        return cuda.load_emu()
    except Exception as e:  # on Linux (CI) a failed build is a failure; elsewhere ucontext may be missing
        if sys.platform.startswith("linux"):
            raise
        pytest.skip(f"the emulation did not build on {sys.platform}: {e}")


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
    cuda.kv_inject_ref(ref_k, ref_v, *args[2:5], counts_ok, *args[6:])  # the same call without row b
    args[4][b], args[5][b] = offset, count
    args[6], args[7] = args[6][:P], args[7][:P]
    with pytest.raises(RuntimeError, match="device-side assert"):
        emu.kv_inject(*args)
    assert args[0][:, b].isnan().all() and args[1][:, b].isnan().all()  # nothing of row b written
    assert mismatches(args[0], ref_k) == (0, 0.0) and mismatches(args[1], ref_v) == (0, 0.0)


def test_kv_inject_emulated_kernel_writes_nothing_past_the_tensors(emu):
    """Catches writes past the caches (a grid-stride bound idx <= N reaches l = L): NaN tails stay NaN."""
    args = list(make_kv_case(2, 1, 2, 16, 20, 4, seed=3))  # B = 1: row 0 has tokens, the index past the end maps to it
    ref_k, ref_v = args[0].clone(), args[1].clone()
    cuda.kv_inject_ref(ref_k, ref_v, *args[2:])
    bufs = [torch.cat([a.flatten(), torch.full_like(a.flatten(), 0.0 if i >= 2 else float("nan"))])
            for i, a in enumerate(args[:4])]  # new_k, new_v tails 0: a read past them writes a number
    args[:4] = [buf[:a.numel()].view(a.shape) for buf, a in zip(bufs, args[:4])]
    emu.kv_inject(*args)
    assert bufs[0][args[0].numel():].isnan().all() and bufs[1][args[1].numel():].isnan().all()
    assert mismatches(args[0], ref_k) == (0, 0.0) and mismatches(args[1], ref_v) == (0, 0.0)


KV_GRID_MAIN = r"""
#include <cstdio>
#include <vector>
int main() {  // 1,200 rotation pairs, more than the 2 blocks of 256 threads the lowered cap allows
  const int64_t L = 1, B = 2, H = 3, D = 8, T = 50, N = L * B * H * T * D;
  std::vector<float> ck(N, NAN), cv(N, NAN), nk(N), nv(N), cs(T * D / 2, 1.0f), sn(T * D / 2, 0.0f);
  for (int64_t x = 0; x < N; x++) nk[x] = nv[x] = (float)x;  // cos 1, sin 0: K is copied unrotated
  std::vector<int64_t> off(B, 0), cnt(B, T);
  kv_inject_cuda(ck.data(), cv.data(), nk.data(), nv.data(), off.data(), cnt.data(), cs.data(), sn.data(),
                 L, B, H, T, D, T, T, c10::ScalarType::Float, 0);
  double sum_k = 0, sum_v = 0;
  int unwritten = 0;
  for (int64_t x = 0; x < N; x++) unwritten += std::isnan(ck[x]) + std::isnan(cv[x]), sum_k += ck[x], sum_v += cv[x];
  std::printf("unwritten %d sums %.0f %.0f\n", unwritten, sum_k, sum_v);
}
"""


def run_emulated_program(tmp_path, source, schedule="in_order"):
    """Compile a C++ program over emu.h (and c10's headers and library) and return its output."""
    from torch.utils.cpp_extension import include_paths, library_paths
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C++ compiler and Linux (ucontext)")
    (tmp_path / "t.cpp").write_text(source)
    lib = library_paths()[0]
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{include_paths()[0]}", "t.cpp", "-o", "t", f"-L{lib}", "-lc10",
                    f"-Wl,-rpath,{lib}"], cwd=tmp_path, check=True)
    return subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DFLASH_EMU_SCHEDULE": schedule}).stdout


def test_kv_inject_emulated_grid_stride_covers_pairs_beyond_the_grid(emu, tmp_path):
    """Catches a one-pass grid-stride loop: the grid cap (2^16 blocks) lowered to 2 in the emulated source."""
    src = (cuda.BUILD_ROOT / "dflash_ext_emu" / "kv_inject_emu.cpp").read_text()  # written by cuda.load_emu
    assert src.count("1 << 16") == 1
    out = run_emulated_program(tmp_path, src.replace("1 << 16", "2") + KV_GRID_MAIN)
    assert out.split() == ["unwritten", "0", "sums", "2878800", "2878800"]  # 0 + 1 + ... + 2399, twice


def test_accept_scan_emulated_kernel_asserts_on_a_draft_outside_the_vocabulary(emu):
    p, drafts, q, u = make_accept_case(2, 3, 97, "sample_q", seed=9)
    drafts[1, 0] = 97  # sampling indexes p and q with the drafts: checked in the kernel, not on the host
    with pytest.raises(RuntimeError, match="device-side assert.*d < V"):
        emu.accept_scan(p, drafts, q, u, 1)
    drafts[1, 0] = -1  # a negative draft is an empty slot, not an error
    assert all(torch.equal(a, b) for a, b in zip(emu.accept_scan(p, drafts, q, u, 1), cuda.accept_scan_ref(p, drafts, q, u)))


@pytest.mark.parametrize("version", cuda.VERSIONS["accept_scan"])
@pytest.mark.parametrize("mode", MODES)
# in order, eager and eager_forward (emu.h): a barrier missing after thread 0 writes a shared
# value, before block_inclusive_scan's s_warp or block_argmax's s_idx is reused, or kernel2's last
# block picked by index instead of by ticket, passes in order and fails one of the eager orders
@pytest.mark.parametrize("shape, schedule", [(s, "in_order") for s in ACCEPT_SHAPES + QWEN_SHAPES] +
                         [(s, o) for s in ACCEPT_SHAPES for o in ("eager", "eager_forward")])
def test_accept_scan_emulated_kernels(emu, shape, schedule, mode, version, monkeypatch):
    monkeypatch.setenv("DFLASH_EMU_SCHEDULE", schedule)
    # quantized probabilities (exact=True), as on the GPU: the kernels scan in tiles, and only
    # on such inputs is every summation order bit-identical (header of accept_scan.cu)
    p, drafts, q, u = make_accept_case(*shape, mode, seed=8, exact=True)
    n_ref, nxt_ref = cuda.accept_scan_ref(p, drafts, q, u)
    n, nxt = emu.accept_scan(p, drafts, q, u, version)  # version 2 exists for greedy only
    assert torch.equal(n, n_ref) and torch.equal(nxt, nxt_ref)
    if mode == "greedy":  # bf16 logits with NaNs: NaN is the maximum, the first NaN wins, within
        p = p.bfloat16()  # a warp (threads 5 and 9) and across warps (thread 40)
        p[-1, 0, [5, 9, 40]] = float("nan")
        assert all(torch.equal(a, b) for a, b in zip(emu.accept_scan(p, drafts, None, None, version),
                                                     cuda.accept_scan_ref(p, drafts)))


def test_an_unknown_emulator_schedule_is_refused(emu, monkeypatch):
    """A misspelt order used to run in order, so a test meant for eager checked nothing new."""
    monkeypatch.setenv("DFLASH_EMU_SCHEDULE", "eagre")
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    with pytest.raises(RuntimeError, match="unknown DFLASH_EMU_SCHEDULE=eagre"):
        emu.accept_scan(p, drafts, q, u, 1)


@pytest.mark.parametrize("version", cuda.VERSIONS["accept_scan"])
def test_accept_scan_emulated_greedy_bonus_ignores_the_next_rows_draft(emu, version):
    """Catches a bonus position compared with drafts[b, K], which is the next row's first draft."""
    p = torch.zeros(2, 2, 97)
    p[0, 0, 3] = p[0, 1, 7] = p[1, 0, 5] = p[1, 1, 2] = 1.0  # argmaxes: row 0 (3, 7), row 1 (5, 2)
    drafts = torch.tensor([[3], [7]])  # row 0 accepts its draft, then emits its bonus 7 = row 1's draft
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, None, version)] == [[1, 0], [7, 5]]
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts)] == [[1, 0], [7, 5]]


def test_accept_scan_emulated_kernel_samples_right_of_a_cdf_tie(emu):
    """Catches >= for > in the inverse CDF: u * total equal to a running sum picks the next token."""
    p = torch.tensor([[[0.5, 0.25, 0.125, 0.125], [0.25] * 4]])
    drafts, u = torch.tensor([[0]]), torch.tensor([[0.5, 0.5]])  # draft 0 rejected: residual cdf 0, .25, .375, .5
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[0], [2]]  # target .25 = cdf[1]
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, None, u)] == [[0], [2]]


@pytest.mark.parametrize("schedule", ["in_order", "eager"])
@pytest.mark.parametrize("start", [0, 1])
def test_accept_scan_emulated_kernel_never_samples_a_token_without_mass(emu, start, schedule, monkeypatch):
    """Catches the fallback to V - 1 (here a zero-mass token) when no running sum crosses the
    target. Pass 1's total (per thread, then a tree) keeps the 2^-63 masses that pass 2's tile
    scans absorb one by one into ~0.5, so the two round to float32 values one step apart, and
    u = 1 - 2^-24 puts the target above every running sum of pass 2. The kernel then takes the
    last token with mass. The reference's sequential sum agrees with itself and picks the 0.5:
    contrived inputs part the two (accept_scan.cu's header). With start = 1 thread 0 holds no
    mass (tokens 0, 512, ... are zero), which catches a fallback barrier only threads with mass
    reach: thread 0 would then write the token before the others have named theirs (the
    in-order schedule shows it; eager runs thread 0 last)."""
    monkeypatch.setenv("DFLASH_EMU_SCHEDULE", schedule)
    threads = int(re.search(r"kThreads = (\d+);", (cuda.HERE / "accept_scan.cu").read_text()).group(1))
    assert threads == 512, "this row is built for 512-thread blocks (512 x 2^-63 is half an ulp of 0.5)"
    V, s = 4099, start
    p = torch.zeros(1, 2, V)
    p[0, 0, 3] = 1.0                                  # draft 3 accepted: the bonus row is sampled
    p[0, 1, s], p[0, 1, s + 1], p[0, 1, s + 2:s + 2050] = 0.5, 2.0 ** -25, 2.0 ** -63  # none after
    if start == 1:
        p[0, 1, ::threads] = 0.0                      # thread 0's tokens (0, 512, ...) have none
    drafts, u = torch.tensor([[3]]), torch.tensor([[0.5, 1 - 2.0 ** -24]])
    n, nxt = emu.accept_scan(p, drafts, None, u, 1)
    assert p[0, 1, nxt] > 0 and (n.tolist(), nxt.tolist()) == ([1], [s + 2049])
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, None, u)] == [[1], [s]]


def test_accept_scan_emulated_kernel_sampling_keeps_nan_like_the_reference(emu):
    """Catches a residual clamp that zeroes NaN or a token not clamped to V - 1 (a NaN CDF gives V - 1)."""
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q", seed=8)
    n = cuda.accept_scan_ref(p, drafts, q, u)[0]
    for b in range(3):  # a NaN in each row's emitted distribution, at a token no draft of the row is
        p[b, n[b], next(j for j in range(97) if j not in drafts[b])] = float("nan")
        p[b, n[b], 96] = 0.0  # V - 1 without mass: the no-crossing fallback must not take a NaN target
    n_ref, nxt_ref = cuda.accept_scan_ref(p, drafts, q, u)
    assert torch.equal(n_ref, n) and nxt_ref.tolist() == [96] * 3
    assert all(torch.equal(a, b) for a, b in zip(emu.accept_scan(p, drafts, q, u, 1), (n_ref, nxt_ref)))


def test_accept_scan_emulated_kernel_rounds_running_sums_once(emu):
    """Catches a tile scan that rounds the carry and the tile's prefix to float32 apart, not their sum once."""
    # not quantized, but every partial sum here is exact in double, so all summation orders agree
    p = torch.zeros(1, 2, 1024)
    p[0, 0, 3] = 1.0                             # draft 3 accepted: the bonus row is sampled
    p[0, 1] = 2.0 ** -30
    p[0, 1, 0] = 0.5                             # near 0.5, float32 steps by 2^-24: 64 tokens
    drafts, u = torch.tensor([[3]]), torch.tensor([[0.5, 1 - 2.0 ** -20]])  # target 0.5 + 2^-21
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[1], [545]]  # 544 if rounded twice
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, None, u)] == [[1], [545]]


def test_dflash_end_to_end_emulated_kernels(emu, monkeypatch):
    """Greedy dflash on a ragged batch with both kernels' code in the loop (DFLASH_CUDA_EXT=emu)
    equals the reference path and plain decoding."""
    emulated = dflash_outputs("cpu", torch.float32, "emu", monkeypatch, check_plain=True)
    assert cuda.active_path("cpu")[0] == "emulation"
    assert emulated == dflash_outputs("cpu", torch.float32, "0", monkeypatch)


EMU_PROGRAM = r"""
#include "EMU_H"
#include <cstdio>
__global__ void block_sum(const int* x, int* out) {  // a shuffle tree per warp, then shared memory
  __shared__ int partial[2];
  int v = x[blockIdx.x * 64 + threadIdx.x];
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffff, v, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0] + partial[1];
}
__global__ void early_exit(int* out) {  // odd threads leave: the barrier must not wait for them
  if (threadIdx.x % 2) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void divergent(int* out) {  // lane 0 at __syncthreads, lanes 1..31 at a shuffle
  int v = threadIdx.x;
  if (threadIdx.x == 0) __syncthreads();
  else v = __shfl_down_sync(0xffffffff, v, 1);
  out[threadIdx.x] = v;
}
__global__ void order(int* out) {  // the order the schedule runs things in
  __shared__ int flag;
  if (threadIdx.x == 0) flag = 0;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = flag;  // warp 0, before any shuffle of its own
  const int v = __shfl_down_sync(0xffffffff, 1, 1);
  if (threadIdx.x == 32) flag = v, out[2] = out[2] * 10 + blockIdx.x;  // warp 1 past its shuffle; block order
}
__global__ void no_barrier(int* out) {  // the bug: thread 0 writes, the others read, no barrier between
  __shared__ int s;
  if (threadIdx.x == 0) s = 7;
  out[threadIdx.x] = s;
}
__global__ void reuse(int* out) {  // the bug: thread 0 rewrites s, no barrier after the others read it
  __shared__ int s;
  if (threadIdx.x == 0) s = 1;
  __syncthreads();
  const int first = s;
  const int v = __shfl_down_sync(0xffffffff, first, 1);  // warp 0 done with s here
  if (threadIdx.x == 0) s = 2 + v - v;                    // the next round's value
  out[threadIdx.x] = first;
}
__global__ void two_barriers(int* out) {  // warp 0 at one __syncthreads, warp 1 at another
  if (threadIdx.x < 32) __syncthreads();
  __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void half_warp(int* out) {  // lanes 16..31 leave, the rest shuffle with the full mask
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffff, (int)threadIdx.x, 1);
}
int main() {
  int x[3 * 64], sums[3], flags[64] = {0}, tmp[32];
  for (int i = 0; i < 3 * 64; i++) x[i] = i;
  emu::Launch(dim3(3), dim3(64)).run(block_sum, x, sums);
  emu::Launch(dim3(1), dim3(64)).run(early_exit, flags);
  int set = 0;
  for (int i = 0; i < 64; i++) set += flags[i];
  std::printf("sums %d %d %d set %d\n", sums[0], sums[1], sums[2], set);
  int seen[3] = {0, 0, 0};
  emu::Launch(dim3(2), dim3(64)).run(order, seen);
  std::printf("order %d %d %d\n", seen[0], seen[1], seen[2]);
  emu::Launch(dim3(1), dim3(64)).run(no_barrier, flags);
  std::printf("no_barrier %d %d\n", flags[0], flags[63]);
  emu::Launch(dim3(1), dim3(64)).run(reuse, flags);
  std::printf("reuse %d %d\n", flags[0], flags[63]);
  for (int k = 0; k < 4; k++) try {  // each of these is an error on a GPU (a hang, UB, a launch error)
    if (k == 0) emu::Launch(dim3(1), dim3(32)).run(divergent, tmp);
    if (k == 1) emu::Launch(dim3(1), dim3(32)).run(half_warp, tmp);
    if (k == 2) emu::Launch(dim3(0), dim3(32)).run(half_warp, tmp);
    if (k == 3) emu::Launch(dim3(1), dim3(64)).run(two_barriers, flags);
  } catch (const std::exception& e) {
    std::printf("%s\n", e.what());
  }
}
"""


@pytest.mark.parametrize("schedule", ["in_order", "eager", "eager_forward"])
def test_emulator_runs_blocks_like_a_gpu_and_stops_where_a_gpu_would_fail(tmp_path, schedule):
    out = run_emulated_program(tmp_path, EMU_PROGRAM.replace("EMU_H", str(cuda.HERE / "emu.h")), schedule)
    # in order, warp 0 reads the flag before warp 1 is past its shuffle and block 0 runs first;
    # eager (last to first), warp 1 has run on and set it, and block 1 runs first; eager_forward
    # runs warp 0 and block 0 first, so it reads as in order here
    assert {"in_order": "order 0 0 1", "eager": "order 1 1 10", "eager_forward": "order 0 0 1"}[schedule] in out
    # eager, thread 63 reads the shared value before thread 0 writes it: the missing barrier shows
    assert {"in_order": "no_barrier 7 7", "eager": "no_barrier 7 0", "eager_forward": "no_barrier 7 7"}[schedule] in out
    # eager_forward, warp 0 is past its shuffle and rewrites s before warp 1 has read it
    assert {"in_order": "reuse 1 1", "eager": "reuse 1 1", "eager_forward": "reuse 1 2"}[schedule] in out
    assert "threads wait at two different __syncthreads" in out
    assert "sums 2016 6112 10208 set 32" in out  # sum of 0..63, 64..127, 128..191; the 32 even threads
    assert "can never finish: 1 of 32 live threads wait at __syncthreads" in out
    assert "warp 0: a full-mask shuffle after 16 of its lanes returned" in out
    assert "a launch with no blocks" in out


# -----------------------------------------------------------------------------
# the self-check, python -m cuda

def test_mismatches_counts_nan_against_a_number_both_ways():
    """The outputs start as NaN: a slot a path failed to write (NaN where the reference has a
    number) is a mismatch, as is a stray write (a number where the reference kept NaN)."""
    nan = float("nan")
    assert mismatches(torch.tensor([nan, 1.0]), torch.tensor([2.0, 1.0])) == (1, float("inf"))
    assert mismatches(torch.tensor([2.0, 1.0]), torch.tensor([nan, 1.0])) == (1, float("inf"))
    assert mismatches(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.5])) == (1, 0.5)


def test_self_check_covers_every_op_version_and_shape(emu, monkeypatch, capsys):
    """python -m cuda --emu: each kernel version on the shapes the README promises (B = 1, 3, 7;
    K = 1, 15; V = 97, 4099, not multiples of 32), both cache dtypes, all three accept modes,
    greedy on float32 and on bfloat16 logits."""
    import cuda.__main__ as selfcheck
    monkeypatch.setattr(sys, "argv", ["cuda", "--emu"])
    assert selfcheck.main() == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:4]) for line in out.splitlines() if line.startswith(("kv_inject ", "accept_scan "))}
    kv = {("kv_inject", "emu1", "LBHDTt=" + "x".join(map(str, s)), dtype) for s in selfcheck.KV_SHAPES
          for dtype in ("float32", "bfloat16")}
    accept = {("accept_scan", f"emu{v}", "BKV=" + "x".join(map(str, shape)), mode) for shape in ACCEPT_SHAPES
              for mode in MODES + ("greedy_bf16",) for v in (cuda.VERSIONS["accept_scan"] if "greedy" in mode else (1,))}
    assert rows == kv | accept and "all 44 rows match the reference" in out


def test_self_check_exits_non_zero_on_a_wrong_token_or_a_stray_write(ext, monkeypatch, capsys):
    """A module that gets the last row's token wrong, and writes into the last slot of row 0 of
    the cache, must fail every row of `python -m cuda` and exit 1. In every case with B > 1 row 0
    has no new tokens, so that write shows only against the NaN the outputs start as."""
    import runpy
    dtypes = set()

    class Broken:
        with_cuda = False

        def accept_scan(self, *args):
            dtypes.add((args[2] is None and args[3] is None, args[0].dtype))  # (greedy, the logits' dtype)
            n, nxt = ext.accept_scan(*args)
            nxt[-1] += 1
            return n, nxt

        def kv_inject(self, cache_k, *args):
            ext.kv_inject(cache_k, *args)
            cache_k[:, 0, :, -1] = 0.0

    monkeypatch.setattr(cuda, "load", lambda verbose=False: Broken())
    monkeypatch.setattr(sys, "argv", ["cuda", "--device", "cpu", "--repeat", "1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(cuda.HERE / "__main__.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert e.value.code == 1 and "32 rows, 32 with mismatches" in out and out.count("MISMATCH") == 32
    assert dtypes == {(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)}  # the rows test what they name


# -----------------------------------------------------------------------------
# the .cu files and the GPU

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cu_files_compile_with_nvcc(tmp_path):
    for name, (ok, log) in cuda.nvcc_check(arch="sm_90", out_dir=tmp_path, timeout=600).items():
        assert ok, f"nvcc failed on {name}:\n{log[-3000:]}"
        assert (tmp_path / name.replace(".cu", ".o")).stat().st_size > 0


def test_cudart_flags_see_through_an_nvcc_wrapper(tmp_path):
    """torch guesses the toolkit from `which nvcc`; a wrapper script there (as /usr/local/bin/nvcc
    on this project's CPU machines) has no libcudart beside it, so the CUDA build would not link
    without the -L that cudart_flags finds. Fake toolkits, no nvcc needed."""
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
    (real / "lib64").mkdir()
    (real / "lib64" / "libcudart.so").touch()
    script(wrap / "bin" / "nvcc", f'exec {real / "bin" / "nvcc"} "$@"')
    assert cuda.cudart_flags(wrap) == [f"-L{real}/lib64"]
    assert cuda.cudart_flags(real) == [f"-L{real}/lib64"]   # the right CUDA_HOME: torch's own folder
    (real / "lib64" / "libcudart.so").unlink()                # a toolkit with its runtime in lib/
    (real / "lib").mkdir()
    (real / "lib" / "libcudart.so").touch()
    assert cuda.cudart_flags(wrap) == cuda.cudart_flags(real) == [f"-L{real}/lib"]
    assert cuda.cudart_flags(tmp_path / "missing") == []      # no nvcc: the link error will say so
    script(wrap / "bin" / "nvcc", "exit 1")                   # an nvcc that names no folder
    assert cuda.cudart_flags(wrap) == []


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", KV_SHAPES + [(5, 8, 8, 128, 300, 16)])
def test_kv_inject_cuda(ext, shape, dtype):
    args = make_kv_case(*shape, dtype=dtype, seed=4, device="cuda")
    ref_k, ref_v = args[0].clone(), args[1].clone()
    cuda.kv_inject_ref(ref_k, ref_v, *args[2:])
    ext.kv_inject(*args)
    assert mismatches(args[0], ref_k) == (0, 0.0) and mismatches(args[1], ref_v) == (0, 0.0)


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("version", cuda.VERSIONS["accept_scan"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ACCEPT_SHAPES + QWEN_SHAPES + [(3, 0, 4099)])  # K = 0: ar's steps
def test_accept_scan_cuda(ext, shape, mode, version):
    # quantized probabilities (exact=True): every summation order gives the same CDF, so the
    # GPU's tile scan must agree bit for bit with the CPU reference's sequential one
    p, drafts, q, u = make_accept_case(*shape, mode, seed=5, exact=True)
    n_ref, nxt_ref = cuda.accept_scan_ref(p, drafts, q, u)
    c = lambda t: None if t is None else t.cuda()
    n, nxt = ext.accept_scan(c(p), c(drafts), c(q), c(u), version)
    assert torch.equal(n.cpu(), n_ref) and torch.equal(nxt.cpu(), nxt_ref)
    for dtype in (torch.bfloat16, torch.float64) if mode == "greedy" else ():  # other logit dtypes
        n, nxt = ext.accept_scan(p.cuda().to(dtype), drafts.cuda(), None, None, version)
        n_ref, nxt_ref = cuda.accept_scan_ref(p.to(dtype), drafts)
        assert torch.equal(n.cpu(), n_ref) and torch.equal(nxt.cpu(), nxt_ref)
    if mode == "greedy":  # whole-number logits above are exact in float32: this row is not
        p, drafts = float64_near_tie()
        assert [t.tolist() for t in ext.accept_scan(p.cuda(), drafts.cuda(), None, None, version)] == [[1], [600]]


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
def test_speculate_uses_extension_on_cuda(ext):
    import speculate
    p, drafts, q, u = (t if t is None else t.cuda() for t in make_accept_case(3, 4, 97, "sample_q"))
    assert cuda.active_path("cuda")[0] == "extension"
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in
               zip(speculate.accept_scan(p, drafts, q, u), speculate.accept_scan_ref(p, drafts, q, u)))


@pytest.mark.skipif(not has_gpu, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_end_to_end_cuda(ext, dtype, monkeypatch):
    """Greedy dflash with both kernels on equals the reference path (bit-exact ops, so the
    same tokens), and in float32 equals plain decoding too."""
    fused = dflash_outputs("cuda", dtype, "1", monkeypatch, check_plain=dtype == torch.float32)
    assert cuda.active_path("cuda")[0] == "extension"
    assert fused == dflash_outputs("cuda", dtype, "0", monkeypatch)


def test_kv_inject_ref_refuses_an_offset_that_wraps():
    """offset + count past INT64_MAX wraps negative, and a negative slot indexes from the end."""
    args = list(make_kv_case(1, 2, 1, 8, 10, 4))
    args[4], args[5] = torch.tensor([0, 2 ** 63 - 2]), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="offsets"):
        cuda.kv_inject_ref(*args)
    assert args[0].isnan().all() and args[1].isnan().all()


def test_kv_inject_ref_refuses_rope_tables_too_short():
    args = list(make_kv_case(1, 2, 1, 8, 10, 4))
    args[6], args[7] = args[6][:5], args[7][:5]  # the last row writes up to slot 9, the tables have 5 rows
    with pytest.raises(ValueError, match="RoPE"):
        cuda.kv_inject_ref(*args)


def test_a_fresh_build_lock_is_waited_for_not_removed(tmp_path, capsys):
    import threading
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(1.5, lock.unlink).start()  # the live build finishes
    t0 = time.time()
    cuda._wait_for_stale_lock(tmp_path)
    assert time.time() - t0 > 1.0 and "waiting for another build" in capsys.readouterr().out


def test_failure_keeps_the_last_line():
    e = RuntimeError("ninja: build stopped\n  g++ -O3 ...\nerror: ext.cpp:12: expected ';'\n\n")
    assert cuda.failure(e) == "RuntimeError: error: ext.cpp:12: expected ';'"


def test_host_sampling_refuses_a_draft_equal_to_V(ext):
    p = torch.full((1, 2, 4), 0.25)
    with pytest.raises(RuntimeError, match="outside"):
        ext.accept_scan(p, torch.tensor([[4]]), None, torch.full((1, 2), 0.5), 1)


def test_a_zero_uniform_never_samples_a_zero_probability_token(ext):
    """u = 0: the inverse CDF picks the first token whose cdf EXCEEDS 0 (searchsorted right),
    never a leading token of probability 0."""
    p = torch.tensor([[[0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]]])
    drafts, u = torch.tensor([[1]]), torch.zeros(1, 2)
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, None, u)] == [[0], [3]]
    assert [t.tolist() for t in ext.accept_scan(p, drafts, None, u, 1)] == [[0], [3]]


def test_gpu_check_fits_one_device_call_and_names_real_modules():
    """cuda/gpu_check.sh is the one script a GPU session runs: its step limits must add up to
    less than one device call (600 s), every module it runs must exist here, and the files it
    names under $LOG must be no more than the call brings back."""
    script = open(os.path.join(os.path.dirname(cuda.__file__), "gpu_check.sh")).read()
    limits = [int(line.split()[2]) for line in script.splitlines() if line.startswith("step ")]
    assert len(limits) == 8 and sum(limits) <= 580, limits
    for mod in ("cuda", "cuda.sdpa_probe", "pytest"):
        assert f"$PY -m {mod}" in script
        __import__(mod)
    assert "$PY bench.py --device cuda" in script
    logs = set(re.findall(r'\$LOG/([^"\s]+)', script))  # the device tool brings back 8 files at most
    assert 0 < len(logs) <= 8 and not any("$" in name for name in logs), logs
    # the training smoke's flags parse (a typo there would cost the step, found only on the GPU)
    import train
    import train_drafter
    smoke = {"train.py": train.get_parser(), "train_drafter.py": train_drafter.get_parser()}
    runs = re.findall(r"\$PY (train(?:_drafter)?\.py) ([^&|\n]+)", script)
    assert sorted({f for f, _ in runs}) == sorted(smoke), runs
    for f, flags in runs:
        args = smoke[f].parse_args(flags.replace("$W", "/w").replace("$m", "dflash").replace('"', "").split())
        assert args.device == "cuda" and args.max_steps > 0


def test_sdpa_probe_runs_and_checks_enable_gqa_against_expanded_heads(capsys, monkeypatch):
    from cuda import sdpa_probe
    assert sdpa_probe.main(["--device", "cpu", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("float32")]
    assert len(rows) == 3 and all("math" in r for r in rows)  # the math backend takes anything
    real = torch.nn.functional.scaled_dot_product_attention  # a GQA broadcast gone wrong must show
    monkeypatch.setattr(sdpa_probe.F, "scaled_dot_product_attention",
                        lambda q, k, v, enable_gqa=False, **kw: real(q, k.flip(1), v.flip(1), enable_gqa=enable_gqa, **kw)
                        if enable_gqa else real(q, k, v, **kw))
    assert sdpa_probe.main(["--device", "cpu", "--repeat", "1"]) == 1


@pytest.mark.parametrize("argv,message", [(["--device", "tpu"], "unknown device 'tpu'"),
                                          (["--repeat", "0"], "--repeat must be >= 1")])
def test_sdpa_probe_refuses_bad_flags_in_one_line(argv, message, capsys):
    from cuda import sdpa_probe
    with pytest.raises(SystemExit) as e:
        sdpa_probe.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_self_check_refuses_a_negative_repeat():
    r = subprocess.run([sys.executable, "-m", "cuda", "--repeat", "-1"], cwd=cuda.HERE.parent,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--repeat must be >= 1" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("script", ["sdpa_probe.py", "__main__.py"])
def test_the_cuda_tools_also_run_as_files(script, tmp_path):
    """`python cuda/sdpa_probe.py` (the README names the file) could not import `cuda`."""
    r = subprocess.run([sys.executable, str(cuda.HERE / script), "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "--repeat" in r.stdout, r.stderr[-800:]


def test_accept_scan_wrapper_asks_for_the_promoted_kernel_version(monkeypatch):
    """Every version gives the same tokens (the suite checks that), so only the argument shows
    which kernel a GPU run takes: the promoted DEFAULT_VERSION, not the unmeasured candidate."""
    seen = []
    fake = type("Ext", (), {"accept_scan": staticmethod(
        lambda p, d, q, u, version: seen.append(version) or cuda.accept_scan_ref(p, d, q, u))})
    monkeypatch.setattr(cuda, "_pick", lambda device, op: fake)
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    cuda.accept_scan(p, drafts, q, u)
    assert seen == [cuda.DEFAULT_VERSION]


# -----------------------------------------------------------------------------
# argument checks and self-check accounting (found by a mutation audit: each test below fails
# when the check or the count it names is dropped or weakened)

def test_kv_inject_refuses_malformed_arguments(built):
    """ext.cpp's shape/layout checks guard loops and kernels that index raw pointers: each
    malformed argument must be refused, not read with the wrong strides. Tensors here are
    larger than expected (never smaller), so a dropped check shows as silence, not as a read
    past the end."""
    good = make_kv_case(1, 2, 2, 8, 10, 4)  # L, B, H, D, T_max, T_new

    def call(i, *values):
        built.kv_inject(*replaced(good, i, *values))

    with pytest.raises(RuntimeError, match="new_k must be"):  # H + 1 heads
        call(2, torch.zeros(1, 2, 4, 3, 8), torch.zeros(1, 2, 4, 3, 8))
    with pytest.raises(RuntimeError, match="offsets and counts must be"):  # B + 1 counts
        call(5, torch.tensor([0, 4, 0]))
    with pytest.raises(RuntimeError, match="cos, sin must be"):  # sin with more rows than cos
        call(7, torch.cat([good[7], good[7][:2]]))
    strided = torch.stack([good[6], good[6]], -1)[..., 0]  # cos's values, not contiguous
    with pytest.raises(RuntimeError, match="contiguous"):
        call(6, strided, strided.clone())
    assert good[0].isnan().all() and good[1].isnan().all()  # nothing written by any of them


def test_accept_scan_refuses_malformed_arguments(built):
    """drafts, uniforms and q with one column too many are refused (the loops and kernels take
    K and V from p and would read them with the wrong row strides)."""
    p, drafts, q, u = make_accept_case(3, 4, 97, "sample_q")
    with pytest.raises(RuntimeError, match="drafts must be"):
        built.accept_scan(p, torch.cat([drafts, drafts[:, :1]], 1), q, u, 1)
    with pytest.raises(RuntimeError, match="uniforms must be"):
        built.accept_scan(p, drafts, q, torch.cat([u, u[:, :1]], 1), 1)
    with pytest.raises(RuntimeError, match="q must be"):
        built.accept_scan(p, drafts, torch.cat([q, q[:, :, :1]], 2), u, 1)


@pytest.mark.parametrize("use_q", [False, True])
def test_accept_scan_rejects_a_draft_whose_ratio_test_ties(built, use_q):
    """u * q(d) == p(d) is a rejection (accept iff u * q(d) < p(d), the reference's strict <):
    random uniforms never tie, so this row makes one. Rejected, draft 0 leaves the residual
    (0, .5, 0, 0): token 1; a <= would accept it and sample the bonus row (token 2)."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]])
    drafts, u = torch.tensor([[0]]), torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]) if use_q else None  # q one-hot at the draft: the same test
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, q, u)] == [[0], [1]]
    assert [t.tolist() for t in built.accept_scan(p, drafts, q, u, 1)] == [[0], [1]]


def test_self_check_counts_a_wrong_n_accepted_and_a_stray_value_write(ext):
    """The self-check's rows must count every output: n_accepted as well as the token, and the
    V cache as well as the K cache (test_self_check_exits_non_zero_... breaks only the token
    and the K cache)."""
    import cuda.__main__ as selfcheck

    class Broken:
        def accept_scan(self, *args):
            n, nxt = ext.accept_scan(*args)
            n[0] += 1
            return n, nxt

        def kv_inject(self, cache_k, cache_v, *args):
            ext.kv_inject(cache_k, cache_v, *args)
            cache_v[:, 0, :, -1] = 0.0  # row 0 has no new tokens: the reference leaves it NaN

    for mode in MODES:
        assert selfcheck.check_accept_scan(Broken(), (3, 15, 97), mode, 1, torch.float32, "cpu", 0)[0] == 1
    L, B, H, D, T_max, T_new = shape = (3, 3, 1, 16, 40, 7)
    assert selfcheck.check_kv_inject(Broken(), shape, torch.float32, "cpu", 0)[:2] == (L * H * D, float("inf"))


def test_accept_cases_leave_the_last_rows_tail_empty():
    """Every path's random cases reach the empty-slot rule (NO_DRAFT = -1) only through this."""
    for mode in MODES:
        drafts = make_accept_case(3, 15, 97, mode)[1]
        assert (drafts[-1, 7:] == -1).all() and (drafts[:, :7] >= 0).all() and (drafts[:2] >= 0).all()


def test_accept_scan_emulated_kernel_sums_the_total_in_double(emu):
    """Catches pass 1 (the total) accumulated per thread in float32: thread 0 holds token 0
    (0.5) and tokens 512, 1024, ... 3584 (2^-26 each), which a float32 partial of 0.5 drops. In
    double the total rounds to 1 + 2^-23, the target u * total to 1.0, and the first running
    sum above 1.0 is token 2560 (1 + 5 * 2^-26); a total of 1.0 would give token 1."""
    V = 4099
    p = torch.zeros(1, 2, V)
    p[0, 0, 3] = 1.0                                # draft 3 accepted: the bonus row is sampled
    p[0, 1, 0] = p[0, 1, 1] = 0.5
    p[0, 1, 512:4096:512] = 2.0 ** -26
    drafts, u = torch.tensor([[3]]), torch.tensor([[0.5, 1 - 2.0 ** -24]])
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, None, u)] == [[1], [2560]]
    assert [t.tolist() for t in emu.accept_scan(p, drafts, None, u, 1)] == [[1], [2560]]


def test_accept_scan_token_0_is_a_draft_not_an_empty_slot(built):
    """Only a negative draft is an empty slot (NO_DRAFT = -1): a draft of token 0 is tested
    like any other. The random cases rarely draft token 0 where it decides anything."""
    p = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]])  # p_1(0) = 1: draft 0 accepted
    drafts, u = torch.tensor([[0]]), torch.tensor([[0.5, 0.5]])
    for q in (None, torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])):
        assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, q, u)] == [[1], [2]]  # the bonus token
        assert [t.tolist() for t in built.accept_scan(p, drafts, q, u, 1)] == [[1], [2]]


def test_accept_scan_greedy_nan_at_index_0_beats_a_later_nan(built):
    """torch.argmax takes the FIRST NaN: one at index 0 (where the host's one-pass scan starts
    from) must win over a later one, not only over numbers."""
    p = torch.zeros(2, 1, 8)
    p[:, 0, 5] = float("nan")
    p[0, 0, 0] = float("nan")
    drafts = torch.zeros(2, 0, dtype=torch.long)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert [t.tolist() for t in cuda.accept_scan_ref(p.to(dtype), drafts)] == [[0, 0], [0, 5]]
        assert [t.tolist() for t in built.accept_scan(p.to(dtype), drafts, None, None, 1)] == [[0, 0], [0, 5]]


def test_accept_scan_a_nan_residual_total_falls_back_to_p(built):
    """The reference samples from p_n where the residual's total is not > 0, NaN included
    (torch.where(total > 0, r, p_n)): a NaN in q at the rejected position, with p finite, gives
    a token drawn from p (cdf .25, .5, .75, 1; target .5 -> token 2), not the NaN CDF's V - 1."""
    p = torch.full((1, 2, 4), 0.25)
    drafts, u = torch.tensor([[0]]), torch.tensor([[0.5, 0.5]])
    q = torch.tensor([[[1.0, float("nan"), 0.0, 0.0]]])  # u q(0) = .5 >= p(0): draft 0 rejected
    assert [t.tolist() for t in cuda.accept_scan_ref(p, drafts, q, u)] == [[0], [2]]
    assert [t.tolist() for t in built.accept_scan(p, drafts, q, u, 1)] == [[0], [2]]
