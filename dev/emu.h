// emu.h: run the kernels of dflash_kernels/kv_inject.cu and dflash_kernels/accept_scan.cu on the CPU, so that
// their logic is tested on machines without a GPU (CI; most of this project's machines). Used
// by dev/emu.py (`python dev/emu.py`, its --run) and tests/test_kernels.py; never by the engine.
//
// dev/emu.py compiles each .cu with g++ as C++ after two textual edits: `#include
// <c10/cuda/...>` lines are dropped (this file stands in for them) and every launch
// `kernel<<<grid, block, shmem, stream>>>(args)` becomes `emu::Launch(grid, block, shmem,
// stream).run(kernel, args)`. The kernel bodies compile unchanged.
//
// The execution model, emulated, deterministically, on the calling thread:
//   - a launch runs its blocks one after another (blockIdx.x fastest); the blockDim.x threads
//     of a block are fibers (ucontext) that a scheduler resumes in turn until each returns or
//     waits at a barrier: __syncthreads waits for every live thread of the block, a warp
//     shuffle for every live lane of its warp (a value buffer between two warp barriers);
//   - __shared__ variables become function-level statics: one copy, shared by the threads of
//     the one block that is running;
//   - a thread that returns from the kernel stops counting at the barriers (as on Volta and
//     later GPUs), so a block whose threads leave together, as accept_greedy_kernel1's do,
//     runs as on the GPU;
//   - CUDA_KERNEL_ASSERT records the failure and the launch raises it afterwards, like a
//     device-side assert (the kernel itself carries on, as its own guards expect).
// A barrier in divergent code hangs a GPU or races; here the launch stops at once with an error
// where live threads wait at two different barriers (some at __syncthreads, the rest at a
// shuffle; or at two different __syncthreads lines), at a full-mask shuffle after some of the
// warp's lanes returned (undefined on a GPU) and at a launch with no blocks (a GPU's launch
// error). Not caught: a __syncthreads that the threads skipping it pass by to return (exited
// threads do not count, as on the GPU), and threads at one line from two call sites of a helper
// or two loop iterations; only a wrong result can show those.
// DFLASH_EMU_SCHEDULE=eager or eager_forward changes the order (see schedule below): a warp runs
// on as soon as its lanes meet. The tests run accept_scan's kernels (the ones with barriers,
// shuffles and a ticket) under all three orders.
//
// What it checks: index arithmetic, reductions and scans, barrier placement, early exits, the
// grid-stride and ticket patterns, and the float results: __fmul_rn and friends round to
// nearest like plain float arithmetic under -ffp-contract=off, and the scans add in the order
// the GPU does, so the bits are the GPU's unless nvcc contracts an expression into an FMA (the
// kernels leave none on a compared path). What it cannot: the memory model across concurrent
// blocks, schedules other than its three orders, timing. Not reentrant (one launch at a time),
// and slow: one fiber switch per thread per barrier. Fine for test shapes, meaningless for
// timing.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

using std::isnan;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = void*;

namespace emu {

inline dim3 thread_idx, block_idx, block_dim, grid_dim;

enum State { RUNNING, AT_SYNCTHREADS, AT_WARP_SYNC, EXITED };
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  State state;
  int line;  // the source line of the __syncthreads it waits at
};
inline std::vector<Fiber> fibers;
inline ucontext_t scheduler;
inline int current = -1;
inline std::function<void()> block_body;     // the kernel call for the block that is running
inline uint64_t shuffle_buffer[32][32];      // [warp][lane], one value of at most 8 bytes
inline std::string assert_message;           // the first failed CUDA_KERNEL_ASSERT of the launch

inline void wait(State s, int line = 0) {  // from a fiber: park at a barrier until released
  fibers[current].state = s, fibers[current].line = line;
  swapcontext(&fibers[current].ctx, &scheduler);
}

inline void fiber_main() {
  block_body();
  fibers[current].state = EXITED;  // then uc_link returns to the scheduler
}

inline void device_assert(const char* cond, const char* file, int line) {
  if (assert_message.empty())
    assert_message = std::string(file) + ":" + std::to_string(line) +
                     ": device-side assert failed: " + cond;
}

// "emu: block (x, y)", the start of every error about the running block
inline std::string in_block() {
  return "emu: block (" + std::to_string(block_idx.x) + ", " + std::to_string(block_idx.y) + ")";
}

inline void resume(int t) {
  current = t, thread_idx = dim3(t);
  swapcontext(&scheduler, &fibers[t].ctx);
}

// warp w's lanes go on if every live one waits at a shuffle; true if they did
inline bool release_warp(int w) {
  int lanes = 0, at_warp = 0;
  for (int t = 32 * w; t < 32 * w + 32; t++)
    lanes += fibers[t].state != EXITED, at_warp += fibers[t].state == AT_WARP_SYNC;
  if (at_warp == 0 || at_warp != lanes) return false;
  if (lanes < 32)  // the kernels shuffle with the full mask: every lane must take part
    throw std::runtime_error(in_block() + ", warp " + std::to_string(w) +
                             ": a full-mask shuffle after " + std::to_string(32 - lanes) +
                             " of its lanes returned (undefined on a GPU)");
  for (int t = 32 * w; t < 32 * w + 32; t++)
    if (fibers[t].state == AT_WARP_SYNC) fibers[t].state = RUNNING;
  return true;
}

// DFLASH_EMU_SCHEDULE picks the order. in_order (the default) runs every thread, first to last,
// up to its next barrier, so one warp never overtakes another, and the blocks first to last.
// eager: a warp whose lanes have all reached a shuffle runs on at once, up to the next
// __syncthreads, before the threads after it in the order have run at all; threads and blocks
// run last to first. eager_forward: the same with threads and blocks first to last. A kernel
// right under all three relies on none of these orders:
//   - eager breaks a missing barrier after thread 0 writes a shared value (the others read it
//     first), one before shared memory is reused where a later warp overwrites what warp 0 has
//     yet to read (block_inclusive_scan's s_warp), and a "last block" picked by index instead of
//     by ticket;
//   - eager_forward breaks a missing barrier before shared memory is reused where warp 0
//     overwrites what later warps have yet to read (block_argmax's s_idx[0]).
enum Order { IN_ORDER, EAGER, EAGER_FORWARD };
inline Order schedule() {
  const char* s = std::getenv("DFLASH_EMU_SCHEDULE");
  const std::string v = s ? s : "";
  if (v.empty() || v == "in_order") return IN_ORDER;
  if (v == "eager") return EAGER;
  if (v == "eager_forward") return EAGER_FORWARD;
  throw std::runtime_error("emu: unknown DFLASH_EMU_SCHEDULE=" + v +
                           " (in_order, eager or eager_forward)");
}

// one block: resume the runnable fibers in turn; once none is, release a barrier that all its
// live threads have reached; if there is none, the block can never finish
inline void run_block(int n, Order order) {
  for (int t = 0; t < n; t++) {
    Fiber& f = fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, fiber_main, 0);
    f.state = RUNNING;
  }
  for (;;) {
    for (int i = 0; i < n; i++) {
      const int t = order == EAGER ? n - 1 - i : i;
      if (fibers[t].state != RUNNING) continue;
      resume(t);
      const int w = t / 32;
      // all its live lanes wait at a shuffle: run them on now
      while (order != IN_ORDER && release_warp(w))
        for (int l = 32 * w; l < 32 * w + 32; l++)
          if (fibers[l].state == RUNNING) resume(l);
    }
    int live = 0, at_sync = 0;
    bool released = false;
    for (int w = 0; w < n / 32; w++) released |= release_warp(w);
    for (int t = 0; t < n; t++)
      live += fibers[t].state != EXITED, at_sync += fibers[t].state == AT_SYNCTHREADS;
    if (live == 0) return;
    if (released) continue;
    if (at_sync != live)
      throw std::runtime_error(in_block() + " can never finish: " + std::to_string(at_sync) +
                               " of " + std::to_string(live) + " live threads wait at " +
                               "__syncthreads, the rest at a warp shuffle (divergent barrier)");
    int line = -1;  // every live thread waits at a __syncthreads: at one and the same?
    for (int t = 0; t < n; t++)
      if (fibers[t].state == AT_SYNCTHREADS && line != fibers[t].line) {
        if (line >= 0)
          throw std::runtime_error(in_block() + ": threads wait at two different __syncthreads, " +
                                   "lines " + std::to_string(line) + " and " +
                                   std::to_string(fibers[t].line) +
                                   " (a barrier in divergent code)");
        line = fibers[t].line;
      }
    for (int t = 0; t < n; t++)
      if (fibers[t].state == AT_SYNCTHREADS) fibers[t].state = RUNNING;
  }
}

// Launch(grid, block, shmem, stream).run(kernel, args...): every block, one after another
struct Launch {
  dim3 grid, block;
  Launch(dim3 g, dim3 b, size_t = 0, cudaStream_t = nullptr) : grid(g), block(b) {}

  template <typename Kernel, typename... Args>
  void run(Kernel kernel, Args... args) {
    if (block.y != 1 || block.z != 1 || block.x % 32 != 0 || block.x > 1024 || grid.z != 1)
      throw std::runtime_error("emu: only 1-D blocks of a multiple of 32 threads and 2-D grids "
                               "are emulated");
    if (grid.x == 0 || grid.y == 0)  // the launchers must skip an empty launch themselves
      throw std::runtime_error("emu: a launch with no blocks (a GPU refuses it: invalid "
                               "configuration argument)");
    const int n = block.x;
    block_dim = block, grid_dim = grid;
    assert_message.clear();
    fibers.resize(n);
    for (Fiber& f : fibers) f.stack.resize(64 * 1024);
    block_body = [&] { kernel(args...); };
    const Order order = schedule();
    for (unsigned y = 0; y < grid.y; y++)
      for (unsigned x = 0; x < grid.x; x++) {
        block_idx = order == EAGER ? dim3(grid.x - 1 - x, grid.y - 1 - y) : dim3(x, y);
        run_block(n, order);
      }
    if (!assert_message.empty()) throw std::runtime_error(assert_message);
  }
};

}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim

// a macro, so that each barrier knows its line: threads at two different ones are an error
#define __syncthreads() emu::wait(emu::AT_SYNCTHREADS, __LINE__)

// value of `lane`'s v within the calling thread's warp (all 32 lanes take part)
template <typename T>
T emu_shuffle(T v, int lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "emu: shuffles of at most 8 bytes");
  const int w = threadIdx.x / 32;
  std::memcpy(&emu::shuffle_buffer[w][threadIdx.x % 32], &v, sizeof(T));
  emu::wait(emu::AT_WARP_SYNC);
  T r = v;
  if (lane >= 0 && lane < 32) std::memcpy(&r, &emu::shuffle_buffer[w][lane], sizeof(T));
  emu::wait(emu::AT_WARP_SYNC);  // nobody overwrites the buffer before all have read
  return r;
}
template <typename T>
T __shfl_down_sync(unsigned, T v, int off) {  // lanes past the warp's end keep their own value
  const int lane = threadIdx.x % 32 + off;
  return emu_shuffle(v, lane < 32 ? lane : -1);
}
template <typename T>
T __shfl_up_sync(unsigned, T v, int off) {
  return emu_shuffle(v, (int)(threadIdx.x % 32) - off);
}

// one OS thread and fibers that switch only at barriers: a plain read-modify-write is atomic
inline int atomicAdd(int* a, int v) {
  const int old = *a;
  *a = old + v;
  return old;
}
inline unsigned long long atomicMin(unsigned long long* a, unsigned long long v) {
  const unsigned long long old = *a;
  if (v < old) *a = v;
  return old;
}
inline unsigned long long atomicMax(unsigned long long* a, unsigned long long v) {
  const unsigned long long old = *a;
  if (v > old) *a = v;
  return old;
}
inline void __threadfence() {}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

#undef CUDA_KERNEL_ASSERT
#define CUDA_KERNEL_ASSERT(cond) \
  if (!(cond)) emu::device_assert(#cond, __FILE__, __LINE__)

// stand-ins for the dropped c10/cuda headers
namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::DeviceIndex) {}
};
inline cudaStream_t getCurrentCUDAStream(int = -1) { return nullptr; }
}  // namespace c10::cuda
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)  // Launch::run raises device asserts itself
