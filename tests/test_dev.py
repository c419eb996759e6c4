"""
Tests of the developer tools in dev/ (off the reading path): the CPU emulator of CUDA
(dev/emu.h) on programs of its own and on a kernel with its grid capped, `python dev/emu.py
--run`, the nvcc compile check of the .cu files (skipped without nvcc), the GPU script
dev/gpu_check.sh and dev/h200_train.sh and the attention probe dev/sdpa_probe.py.

    python -m pytest -q tests/test_dev.py
"""

import math
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import dflash_kernels as kernels
from dev import emu as dev_emu
from data import ROOT, get_encoding
from dev import nvcc_check, sdpa_probe

DEV = os.path.join(kernels.HERE.parent, "dev")


@pytest.fixture(scope="module")
def emu():
    if shutil.which("ninja") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no ninja or C++ compiler to build the emulation")
    try:
        return dev_emu.load()
    except Exception as e:  # on Linux (CI) a failed build is a failure; elsewhere ucontext may lack
        if sys.platform.startswith("linux"):
            raise
        pytest.skip(f"the emulation did not build on {sys.platform}: {e}")


def run_emulated_program(tmp_path, source, schedule="in_order"):
    """Compile a C++ program over emu.h (and c10's headers and library) and return its output."""
    from torch.utils.cpp_extension import include_paths, library_paths
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C++ compiler and Linux (ucontext)")
    (tmp_path / "t.cpp").write_text(source)
    lib = library_paths()[0]
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{include_paths()[0]}", "t.cpp", "-o", "t",
                    f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"], cwd=tmp_path, check=True)
    return subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DFLASH_EMU_SCHEDULE": schedule}).stdout


# -----------------------------------------------------------------------------
# the emulator

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
  if (threadIdx.x == 32) flag = v, out[2] = out[2] * 10 + blockIdx.x;  // warp 1 past its shuffle
}
__global__ void no_barrier(int* out) {  // the bug: thread 0 writes, the others read, no barrier
  __shared__ int s;
  if (threadIdx.x == 0) s = 7;
  out[threadIdx.x] = s;
}
__global__ void reuse(int* out) {  // the bug: thread 0 rewrites s, no barrier after the reads
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
  for (int k = 0; k < 4; k++) try {  // each an error on a GPU (a hang, UB, a launch error)
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
    out = run_emulated_program(tmp_path, EMU_PROGRAM.replace("EMU_H", str(dev_emu.EMU_H)), schedule)
    # in order, warp 0 reads the flag before warp 1 is past its shuffle and block 0 runs first;
    # eager (last to first), warp 1 has run on and set it, and block 1 runs first; eager_forward
    # runs warp 0 and block 0 first, so it reads as in order here
    assert {"in_order": "order 0 0 1", "eager": "order 1 1 10",
            "eager_forward": "order 0 0 1"}[schedule] in out
    # eager, thread 63 reads the shared value before thread 0 writes it: the missing barrier shows
    assert {"in_order": "no_barrier 7 7", "eager": "no_barrier 7 0",
            "eager_forward": "no_barrier 7 7"}[schedule] in out
    # eager_forward, warp 0 is past its shuffle and rewrites s before warp 1 has read it
    assert {"in_order": "reuse 1 1", "eager": "reuse 1 1",
            "eager_forward": "reuse 1 2"}[schedule] in out
    assert "threads wait at two different __syncthreads" in out
    assert "sums 2016 6112 10208 set 32" in out  # sums of 0..63, 64..127, 128..191; 32 even threads
    assert "can never finish: 1 of 32 live threads wait at __syncthreads" in out
    assert "warp 0: a full-mask shuffle after 16 of its lanes returned" in out
    assert "a launch with no blocks" in out


KV_GRID_MAIN = r"""
#include <cstdio>
#include <vector>
int main() {  // 1,200 rotation pairs, more than the 2 blocks of 256 threads the lowered cap allows
  const int64_t L = 1, B = 2, H = 3, D = 8, T = 50, N = L * B * H * T * D;
  std::vector<float> ck(N, NAN), cv(N, NAN), nk(N), nv(N), cs(T * D / 2, 1.0f), sn(T * D / 2, 0.0f);
  for (int64_t x = 0; x < N; x++) nk[x] = nv[x] = (float)x;  // cos 1, sin 0: K copied unrotated
  std::vector<int64_t> off(B, 0), cnt(B, T);
  kv_inject_cuda(ck.data(), cv.data(), nk.data(), nv.data(), off.data(), cnt.data(), cs.data(),
                 sn.data(), L, B, H, T, D, T, T, c10::ScalarType::Float, 0);
  double sum_k = 0, sum_v = 0;
  int unwritten = 0;
  for (int64_t x = 0; x < N; x++)
    unwritten += std::isnan(ck[x]) + std::isnan(cv[x]), sum_k += ck[x], sum_v += cv[x];
  std::printf("unwritten %d sums %.0f %.0f\n", unwritten, sum_k, sum_v);
}
"""


def test_kv_inject_emulated_grid_stride_covers_pairs_beyond_the_grid(emu, tmp_path):
    """Catches a one-pass grid-stride loop: the grid cap (2^16 blocks) lowered to 2 in the
    emulated source."""
    src = (kernels.BUILD_ROOT / dev_emu.NAME / "kv_inject_emu.cpp").read_text()  # dev_emu.load's
    assert src.count("1 << 16") == 1
    out = run_emulated_program(tmp_path, src.replace("1 << 16", "2") + KV_GRID_MAIN)
    assert out.split() == ["unwritten", "0", "sums", "2878800", "2878800"]  # 0 + ... + 2399, twice


def test_emu_runs_a_script_with_the_emulated_kernels_in_the_loop(emu, tmp_path, monkeypatch,
                                                                  capsys):
    """python dev/emu.py --run SCRIPT ARGS: CPU tensors reach the emulated kernels there."""
    script = tmp_path / "probe.py"
    script.write_text("import sys, torch, dflash_kernels as kernels\n"
                      "print('served', kernels.available(torch.device('cpu')), sys.argv[1:])\n")
    monkeypatch.setitem(kernels._ext, "cpu", None)  # restored afterwards, whatever install sets
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # --run sets the script's
    assert dev_emu.main(["--run", str(script), "--flag", "x"]) == 0
    out = capsys.readouterr().out
    assert "cpu tensors use the CUDA kernels emulated" in out
    assert "served True ['--flag', 'x']" in out


# -----------------------------------------------------------------------------
# the compile check, the GPU script, the attention probe

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cu_files_compile_with_nvcc(tmp_path):
    for name, (ok, log) in nvcc_check.check(arch="sm_90", out_dir=tmp_path, timeout=600).items():
        assert ok, f"nvcc failed on {name}:\n{log[-3000:]}"
        assert (tmp_path / name.replace(".cu", ".o")).stat().st_size > 0


def dry_run(script, tmp_path, **env):
    """The steps dev/<script> would run, printed by DRY_RUN=1 and parsed: [(step, its limit in
    s, its command's argv)], the environment settings before the command left out."""
    r = subprocess.run(["bash", os.path.join(DEV, script), str(tmp_path / "log")],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, **env})
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "log").exists()  # a dry run writes nothing
    steps = []
    for m in re.finditer(r"^== (\S+) \(at most (\d+) s\): (.*)$", r.stdout, flags=re.M):
        argv = shlex.split(m[3].split(" && ")[0])  # the command, not what follows it
        while argv and (argv[0] == "env" or "=" in argv[0]):  # nor its environment
            argv = argv[1:]
        steps.append((m[1], int(m[2]), argv))
    return steps


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_fits_one_device_call_and_names_real_modules(tmp_path):
    """dev/gpu_check.sh is the one script a GPU session runs: its step limits must add up to
    less than one device call (600 s), every module and file it runs must exist here, and the
    files it names under $LOG must be no more than the call brings back."""
    script = open(os.path.join(DEV, "gpu_check.sh")).read()
    steps = dry_run("gpu_check.sh", tmp_path)
    limits = [limit for _, limit, _ in steps]
    assert len(limits) == 9 and sum(limits) <= 580, limits
    assert "$PY -m pytest" in script
    for path in ("dev/kernels_check.py", "dev/sdpa_probe.py", "tests/test_kernels.py",
                 "tests/test_static.py", "bench.py"):
        assert path in script and os.path.exists(os.path.join(kernels.HERE.parent, path))
    assert "$PY bench.py --device cuda" in script
    logs = set(re.findall(r'\$LOG/([^"\s]+)', script))  # the device tool brings back 8 at most
    assert 0 < len(logs) <= 8 and not any("$" in name for name in logs), logs
    # the training smoke's flags parse (a typo there would cost the step, found only on the GPU)
    import train
    import train_drafter
    smoke = {"train.py": train.get_parser(), "train_drafter.py": train_drafter.get_parser()}
    joined = script.replace("\\\n", " ")  # continuation lines
    runs = re.findall(r"\$PY (train(?:_drafter)?\.py) ([^&|\n]+)", joined)
    assert sorted({f for f, _ in runs}) == sorted(smoke), runs
    for f, flags in runs:
        flags = flags.replace("$W", "/w").replace("$m", "dflash").replace('"', "").split()
        args = smoke[f].parse_args(flags)
        assert args.device == "cuda" and args.max_steps > 0
    # the bench runs: eager, then compiled with ar and dflash at T = 0 first and alone (a run
    # cut off in its warm-up, compiling every method's graphs, would bring back no row)
    import bench
    benches = [bench.get_parser().parse_args(argv[2:]) for _, _, argv in steps
               if argv[:2] == [sys.executable, "bench.py"]]
    assert [(b.compile, b.methods, b.temperatures) for b in benches] == [
        (False, "ar,dflash,eagle,mtp,ngram", "0,1"), (True, "ar,dflash", "0"),
        (True, "ar,ngram,eagle,mtp", "0"), (True, "ar,dflash,eagle,mtp,ngram", "1")]
    assert all(b.device == "cuda" and b.json.startswith(str(tmp_path / "log")) for b in benches)


def h200_dry_run(tmp_path, **env):
    """The commands dev/h200_train.sh would run, printed by DRY_RUN=1 and parsed: [(step, its
    limit in s, the script it runs, its parsed flags)] for train.py, train_drafter.py, bench.py."""
    import bench
    import train
    import train_drafter
    parsers = {"train.py": train.get_parser(), "train_drafter.py": train_drafter.get_parser(),
               "bench.py": bench.get_parser()}
    runs, limits = [], {}
    for name, limit, argv in dry_run("h200_train.sh", tmp_path, **env):
        limits[name.split("/")[0]] = limit  # a par's runs share its limit
        if len(argv) > 1 and argv[0] == sys.executable and argv[1] in parsers:
            runs.append((name, limit, argv[1], parsers[argv[1]].parse_args(argv[2:])))
            args = runs[-1][3]
            if argv[1] != "bench.py" and not args.max_steps:  # + start-up and the final save
                assert args.minutes * 60 + 15 <= limit, name
    assert len(limits) == 7  # a first session exports its target early, a second runs bench
    first, second = ["target", "target-out", "distill"], ["target", "distill", "drafters"]
    assert list(limits)[2:5] == (second if env.get("FROM_WEIGHTS") else first)
    assert sum(limits.values()) <= 580, limits  # one device call: 600 s
    return runs


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_h200_train_fits_one_device_call_and_every_command_parses(tmp_path):
    """dev/h200_train.sh (issue 52) is one device call: its step limits add up to less than 600 s,
    every training budget fits its step, every drafter run reuses the one distilled data set,
    the files it brings back are at most 8 (the bf16 weights in parts of 15 MiB, the target's
    as soon as it is trained: a call the tool cuts short still brings it back), the weights
    it trains fit weights/ (60 MB) beside the prompts, and every command parses, at full size
    and with TINY=1 (a typo would cost the GPU lease)."""
    from draft_diffusion import DFlash
    from draft_eagle import Eagle
    from model import PRESETS, Config, Transformer
    from mtp import MTP
    script = open(os.path.join(DEV, "h200_train.sh")).read()
    assert "from dev.export_weights import export_checkpoint" in script
    # the `ref` target and its drafters in bf16 (2 bytes a parameter), in 15 MiB parts
    V = get_encoding().n_vocab  # the tokenizer's, as train.py gives every model
    cfg = Config(vocab_size=V, **PRESETS["ref"])
    models = [Transformer(cfg), Transformer(Config(vocab_size=V, **PRESETS["cpu-draft"])),
              MTP(cfg, depth=3), Eagle(cfg), DFlash(cfg)]
    sizes = [2 * sum(p.numel() for p in m.parameters()) for m in models]
    size = sum(sizes)
    prompts = sum(os.path.getsize(os.path.join(ROOT, "weights", f))
                  for f in ("heldout_prompts.jsonl", "ood_prompts.jsonl"))
    assert size + prompts <= 60e6 - 1e6, size  # 1 MB for the checkpoints' other entries
    names = set(re.findall(r'\$LOG/([\w.-]+)', script))  # and the tars' parts of 15 MiB:
    assert names == {"h200_train.txt", "corpus_meta.json", "bench_h200.json"}, names
    assert '"$LOG/$tar.tar.part-"' in script and "15m" in script
    parts = lambda n: math.ceil(n / 15 / 2**20)
    assert len(names) + parts(sizes[0]) + parts(size - sizes[0]) <= 8  # a first session
    assert len(names) + parts(size) <= 8  # a second: the target among the weights

    runs = h200_dry_run(tmp_path)
    by_step = {}
    for name, limit, script_name, args in runs:
        by_step.setdefault(name.split("/")[0], []).append((name, limit, script_name, args))
        assert args.device == "cuda", name
        if script_name != "bench.py":
            assert args.corpus == "all", name
    (_, _, _, target), = by_step["target"]
    # the 200M tokens at the low end of the script's guess, 0.8M tokens/s
    assert target.preset == "ref" and target.minutes * 60 * 0.8e6 >= 200e6
    assert {a.preset for _, _, f, a in by_step["distill"] if f == "train.py"} == {"cpu-draft"}
    drafters = [a for _, _, f, a in runs if f == "train_drafter.py"]
    assert sorted(a.method for a in drafters) == ["dflash", "eagle", "mtp", "mtp"]
    distill = lambda a: (a.target, a.out_dir, a.corpus, a.n_seqs, a.n_val_seqs, a.prompt_len,
                         a.gen_len, tuple(a.distill_temperatures), a.distill_batch, a.seed)
    assert len({distill(a) for a in drafters}) == 1  # built once, by the distill step
    assert all(a.target == target.out_path for a in drafters)
    assert "bench" not in by_step  # the first session's time goes to the target

    # a second session: the drafters alone, longer, against a committed target and draft model
    second = h200_dry_run(tmp_path, FROM_WEIGHTS="weights/cpu", DRAFTER_MINUTES="4.3")
    assert not [a for _, _, f, a in second if f == "train.py"]
    longer = [a for name, _, _, a in second if name.startswith("drafters/")]
    assert len(longer) == 3 and all(a.minutes == 4.3 for a in longer)  # fits: h200_dry_run
    # every sequence's features at once would not fit an H100 beside the other runs
    assert all(a.features == "step" and a.n_seqs == 16384 for a in drafters + longer)
    (b,) = [a for _, _, f, a in second if f == "bench.py"]
    assert b.target.endswith("weights/target.pt") and b.json.startswith(str(tmp_path / "log"))
    assert b.compile is False  # compiling every shape would not fit the step's limit
    # more distinct data: fits, with a distill step of 160 s
    more = h200_dry_run(tmp_path, FROM_WEIGHTS="weights/cpu", N_SEQS="65536",
                        DRAFTER_MINUTES="2.8")
    more = [a for _, _, f, a in more if f == "train_drafter.py"]
    assert len(more) == 4 and all(a.n_seqs == 65536 and a.features == "step" for a in more)

    tiny = h200_dry_run(tmp_path, TINY="1", DEVICE="cpu")
    assert len(tiny) == len(runs) and all(a.device == "cpu" for *_, a in tiny)
    assert all(a.max_steps > 0 for _, _, f, a in tiny if f != "bench.py")


def test_sdpa_probe_runs_and_checks_enable_gqa_against_expanded_heads(capsys, monkeypatch):
    assert sdpa_probe.main(["--device", "cpu", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("float32")]
    assert len(rows) == 3 and all("math" in r for r in rows)  # the math backend takes anything
    real = torch.nn.functional.scaled_dot_product_attention  # a GQA broadcast gone wrong must show
    monkeypatch.setattr(sdpa_probe.F, "scaled_dot_product_attention",
                        lambda q, k, v, enable_gqa=False, **kw:
                        real(q, k.flip(1), v.flip(1), enable_gqa=enable_gqa, **kw)
                        if enable_gqa else real(q, k, v, **kw))
    assert sdpa_probe.main(["--device", "cpu", "--repeat", "1"]) == 1


@pytest.mark.parametrize("argv,message", [(["--device", "tpu"], "unknown device 'tpu'"),
                                          (["--repeat", "0"], "--repeat must be >= 1")])
def test_sdpa_probe_refuses_bad_flags_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        sdpa_probe.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("script", ["sdpa_probe.py", "emu.py", "nvcc_check.py", "target_quality.py",
                                    "hf_export.py"])
def test_the_dev_tools_run_as_files(script, tmp_path):
    """`python dev/sdpa_probe.py` and its neighbours, from any folder."""
    r = subprocess.run([sys.executable, os.path.join(DEV, script), "--help"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-800:]


def test_no_engine_file_imports_dev():
    """dev/ may import the engine; the engine never imports dev/ (tests/test_layout.py's
    import graph covers the engine's files only)."""
    from test_layout import engine_files
    for path in engine_files():
        text = open(path, encoding="utf-8").read()
        assert not re.search(r"^\s*(from|import) dev\b", text, flags=re.M), path


def test_target_quality_scores_the_same_windows_for_every_target(tmp_path, monkeypatch, capsys):
    """dev/target_quality.py on two tiny targets over made-up held-out sets: a line per set and
    per prompt set and temperature; the same target scores the same twice (fixed windows). The
    flags reach the work: --batches batches a set, --n-prompts of each file continued by
    --new-tokens at T = 0 and 1, and 8-grams counted where the line says 8-grams."""
    import numpy as np
    import data
    from dev import target_quality
    from test_model import save_tiny
    save_tiny(tmp_path / "a.pt", seed=0)
    rng = np.random.default_rng(0)
    fake = {name: rng.integers(0, 90, 4000).astype(np.uint16) for name in ("val", "ood")}
    monkeypatch.setattr(target_quality, "held_out_tokens", lambda: fake)
    seen = []  # ("eval", batches) and ("gen", prompts, new tokens, T) per call; ("ngram", n)
    spy = lambda f, tag: lambda *a, **kw: seen.append(tag(*a, **kw)) or f(*a, **kw)
    for module, name, tag in [
            (target_quality, "evaluate", lambda t, batches, enc: ("eval", len(batches))),
            (target_quality, "generate", lambda t, ids, **kw: (
                "gen", len(ids), kw["max_new_tokens"], kw["temperature"])),
            (data, "repeated_ngram_fraction", lambda tokens, n: ("ngram", n))]:
        monkeypatch.setattr(module, name, spy(getattr(module, name), tag))
    target_quality.main([str(tmp_path / "a.pt"), str(tmp_path / "a.pt"), "--batches", "2",
                         "--n-prompts", "2", "--new-tokens", "9", "--threads", "1"])
    out = capsys.readouterr().out
    scores = re.findall(r"(val|ood) +loss ([0-9.]+) nats/token, ([0-9.]+) bits/byte", out)
    assert len(scores) == 4 and scores[:2] == scores[2:]
    assert out.count("of 8-grams repeated") == 2 * 2 * 2  # two targets, two prompt sets, T = 0, 1
    assert sorted(set(seen)) == [("eval", 2), ("gen", 2, 9, 0.0), ("gen", 2, 9, 1.0), ("ngram", 8)]
    assert seen.count(("gen", 2, 9, 1.0)) == 2 * 2


def test_target_quality_refuses_a_target_it_cannot_score_before_scoring(tmp_path, monkeypatch,
                                                                         capsys):
    """Another vocabulary than the tokenizer's, and --new-tokens that fill the context after the
    longest prompt of EITHER file (the ood one's, here), are refused before the minutes of
    scoring; one token fewer fits."""
    import data
    from dev import target_quality
    from model import PRESETS
    from test_model import save_tiny
    save_tiny(tmp_path / "a.pt")  # the tiny preset: a context of 256
    monkeypatch.setattr(target_quality, "report", lambda *a: print("scored"))
    enc = get_encoding()
    held_out = [len(enc.encode_ordinary(t)) for t in data.reference_prompts(10)]
    ood = [len(enc.encode_ordinary(t)) for t in data.read_prompts_file(data.OOD_PROMPTS_PATH)[:10]]
    assert max(ood) > max(held_out)
    room = PRESETS["tiny"]["max_seq_len"] - max(ood)
    with pytest.raises(SystemExit, match=rf"--new-tokens {room} after a prompt of {max(ood)}"):
        target_quality.main([str(tmp_path / "a.pt"), "--new-tokens", str(room)])
    assert "scored" not in capsys.readouterr().out
    target_quality.main([str(tmp_path / "a.pt"), "--new-tokens", str(room - 1)])  # it fits
    assert "scored" in capsys.readouterr().out
    save_tiny(tmp_path / "b.pt", vocab_size=300)
    with pytest.raises(SystemExit, match=r"b.pt: a vocabulary of 300, not tokenizer.tiktoken's"):
        target_quality.main([str(tmp_path / "b.pt")])


@pytest.mark.parametrize("args, expect", [
    (["weights/cpu/target.pt", "--batches", "0"], "--batches must be >= 1, got 0"),
    (["weights/cpu/target.pt", "--threads", "-1"], "--threads must be >= 0, got -1"),
    (["no/such.pt"], "no/such.pt: no such checkpoint"),
    (["weights/cpu/dflash.pt"], "a 'dflash' checkpoint, expected 'target'"),
    (["weights/cpu/target.pt", "--new-tokens", "400"], "target.pt's context of 384")])
def test_target_quality_refuses_bad_input_in_one_line(args, expect):
    """Each was a traceback (or, --batches 0, a nan loss with exit status 0; --new-tokens past
    the context, after minutes of scoring)."""
    from dev import target_quality
    with pytest.raises(SystemExit, match=re.escape(expect)):
        target_quality.main([os.path.join(ROOT, a) if a.endswith(".pt") else a for a in args])
