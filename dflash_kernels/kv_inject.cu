// kv_inject: write the new context K/V of ALL drafter layers into the DFlash drafter's cache at
// per-row offsets, K rotated by RoPE, in one launch (DESIGN.md sec. 7; the reference is
// draft_diffusion.kv_inject_ref). For every l, b, h and t < counts[b], with pos = offsets[b] + t:
//   cache_k[l, b, h, pos, :] = rope(new_k[l, b, t, h, :], pos)   (rotate-half, model.apply_rope)
//   cache_v[l, b, h, pos, :] = new_v[l, b, t, h, :]              and nothing else changes
// shapes: cache_k, cache_v (L, B, H, T_max, D)   float32 / float16 / bfloat16, contiguous
//         new_k, new_v     (L, B, T_new, H, D)   same dtype; k already k-normed, not rotated
//         offsets, counts  (B,) int64            counts[b] in [0, T_new]
//         cos, sin         (P, D/2) float32      RoPE tables (model.rope_table)
// kernel1: a thread per (l, b, t, h, i < D/2) rotation pair, grid-stride; no FMA: bit-exact with
// the reference; a row out of bounds is skipped (device assert). Run: python dev/kernels_check.py

#include <c10/core/ScalarType.h>  // with c10::Half, c10::BFloat16, CUDA_KERNEL_ASSERT
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <algorithm>
#include <cstdint>

template <typename scalar_t>
__global__ void kv_inject_kernel1(
    scalar_t* __restrict__ cache_k, scalar_t* __restrict__ cache_v,
    const scalar_t* __restrict__ new_k, const scalar_t* __restrict__ new_v,
    const int64_t* __restrict__ offsets, const int64_t* __restrict__ counts,
    const float* __restrict__ cos, const float* __restrict__ sin, int64_t L, int64_t B, int64_t H,
    int64_t T_max, int64_t D, int64_t T_new, int64_t P) {
  const int64_t D2 = D / 2;
  const int64_t N = L * B * T_new * H * D2;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N; idx += stride) {
    const int64_t i = idx % D2;  // idx -> (l, b, t, h, i), i fastest: new_k's layout, in halves
    int64_t r = idx / D2;
    const int64_t h = r % H;
    r /= H;
    const int64_t t = r % T_new;
    r /= T_new;
    const int64_t b = r % B, l = r / B;
    const int64_t count = counts[b], off = offsets[b];
    const bool ok = count >= 0 && count <= T_new && off >= 0 && off <= T_max - count &&
                    off <= P - count;  // the reference's checks; off + count could wrap
    CUDA_KERNEL_ASSERT(ok && "kv_inject: offsets[b] + counts[b] exceeds the cache or RoPE tables");
    if (!ok) continue;         // never write out of bounds, even with device asserts compiled out
    if (t >= count) continue;  // padding of a short row: untouched
    const int64_t pos = off + t;
    const int64_t src = (((l * B + b) * T_new + t) * H + h) * D;    // new_k[l, b, t, h, :]
    const int64_t dst = (((l * B + b) * H + h) * T_max + pos) * D;  // cache[l, b, h, pos, :]
    const float x1 = static_cast<float>(new_k[src + i]);
    const float x2 = static_cast<float>(new_k[src + i + D2]);
    const float c = cos[pos * D2 + i], s = sin[pos * D2 + i];
    // rotate-half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), each product rounded like PyTorch's
    cache_k[dst + i] = static_cast<scalar_t>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    cache_k[dst + i + D2] = static_cast<scalar_t>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    cache_v[dst + i] = new_v[src + i];
    cache_v[dst + i + D2] = new_v[src + i + D2];
  }
}

void kv_inject_cuda(void* cache_k, void* cache_v, const void* new_k, const void* new_v,
                    const int64_t* offsets, const int64_t* counts, const float* cos,
                    const float* sin, int64_t L, int64_t B, int64_t H, int64_t T_max, int64_t D,
                    int64_t T_new, int64_t P, c10::ScalarType dtype, int device) {
  const int64_t N = L * B * T_new * H * (D / 2);
  if (N == 0) return;  // a launch with zero blocks is an error
  const int threads = 256;  // a grid-stride loop covers what the capped grid does not
  const int64_t blocks = std::min<int64_t>((N + threads - 1) / threads, 1 << 16);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // the tensors' GPU
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);  // torch's current stream
  auto launch1 = [&](auto value) {  // a value of the caches' dtype names scalar_t
    using scalar_t = decltype(value);
    kv_inject_kernel1<scalar_t><<<blocks, threads, 0, stream>>>(
        (scalar_t*)cache_k, (scalar_t*)cache_v, (const scalar_t*)new_k, (const scalar_t*)new_v,
        offsets, counts, cos, sin, L, B, H, T_max, D, T_new, P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (dtype) {
    case c10::ScalarType::Float: return launch1(float());
    case c10::ScalarType::Half: return launch1(c10::Half());
    case c10::ScalarType::BFloat16: return launch1(c10::BFloat16());
    default: TORCH_CHECK(false, "kv_inject_cuda: unsupported dtype ", dtype);
  }
}
