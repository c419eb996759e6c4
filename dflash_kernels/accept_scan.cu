// accept_scan: the acceptance scan of speculative decoding (Leviathan et al. 2023, arXiv
// 2211.17192; p = target, q = draft) in one launch; the semantics of speculate.accept_scan_ref.
// shapes: p        (B, K+1, V)  greedy: raw logits (float64/32/16, bfloat16); sampling: probs
//         drafts   (B, K) int64 d_1..d_K; negative = an empty slot (speculate.NO_DRAFT)
//         q        (B, K, V)    draft probabilities, or absent (argmax drafts: q one-hot)
//         uniforms (B, K+1) f64 absent = greedy; u[:, i] tests draft i+1, u[:, K] samples
//         returns  n_accepted (B,) int64 in [0, K], next_token (B,) int64
// Greedy:   accept d_i while d_i == argmax p_i (ties: the lowest index; NaN is the maximum); emit
//           the argmax at the first mismatch, or the bonus argmax p_{K+1}.
// Sampling: accept d_i while u_i * q_i(d_i) < p_i(d_i); at the first rejection n emit by inverse
//           CDF from r = max(0, p_n - q_n) (p_{K+1} if n = K; p_n if r has no mass or slot n is
//           empty): the first j with r_j > 0 and cdf_j > u_K * cdf_{V-1}, cdf in float64 (README).
// kernel1: a block per row, up to the first mismatch (sampling's only kernel); kernel2 (greedy's
// default): a block per (position, row); the row's last block scans. Check: dev/kernels_check.py

#include <c10/core/ScalarType.h>  // with c10::Half, c10::BFloat16, CUDA_KERNEL_ASSERT
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>
#include <type_traits>

constexpr int kThreads = 512;  // per block; must be a multiple of 32
constexpr int kWarps = kThreads / 32;

template <typename acc_t>  // torch.argmax's order (NaN, larger, lower index): any tree agrees
__device__ __forceinline__ bool better(acc_t a, int64_t ia, acc_t b, int64_t ib) {
  const bool na = isnan(a), nb = isnan(b);
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

template <typename scalar_t>  // argmax over x[0..V) by the block, for every thread; f32 or f64
__device__ int64_t block_argmax(const scalar_t* __restrict__ x, int64_t V) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  __shared__ acc_t s_val[kWarps];
  __shared__ int64_t s_idx[kWarps];
  acc_t bv = -INFINITY;
  int64_t bi = INT64_MAX;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {  // coalesced, j increasing per thread
    const acc_t v = static_cast<acc_t>(x[j]);
    if (better(v, j, bv, bi)) bv = v, bi = j;
  }
  for (int off = 16; off > 0; off /= 2) {  // warp tree
    const acc_t ov = __shfl_down_sync(0xffffffff, bv, off);
    const int64_t oi = __shfl_down_sync(0xffffffff, bi, off);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) s_val[warp] = bv, s_idx[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    bv = lane < kWarps ? s_val[lane] : -INFINITY;
    bi = lane < kWarps ? s_idx[lane] : INT64_MAX;
    for (int off = 16; off > 0; off /= 2) {
      const acc_t ov = __shfl_down_sync(0xffffffff, bv, off);
      const int64_t oi = __shfl_down_sync(0xffffffff, bi, off);
      if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (lane == 0) s_idx[0] = bi;
  }
  __syncthreads();
  const int64_t best = s_idx[0];
  __syncthreads();  // s_idx is reused by the next call
  return best;
}

// inclusive prefix sum of one double per thread, in thread order; *total gets the block's sum
__device__ double block_inclusive_scan(double x, double* total) {
  __shared__ double s_warp[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int off = 1; off < 32; off *= 2) {
    const double y = __shfl_up_sync(0xffffffff, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    double w = lane < kWarps ? s_warp[lane] : 0.0;
    for (int off = 1; off < 32; off *= 2) {
      const double y = __shfl_up_sync(0xffffffff, w, off);
      if (lane >= off) w += y;
    }
    if (lane < kWarps) s_warp[lane] = w;  // now inclusive over warps
  }
  __syncthreads();
  if (warp > 0) x += s_warp[warp - 1];
  *total = s_warp[kWarps - 1];
  __syncthreads();  // s_warp is reused by the next call
  return x;
}

template <typename scalar_t>  // greedy, a block per row, early exit at the first mismatch
__global__ void accept_greedy_kernel1(
    const scalar_t* __restrict__ p, const int64_t* __restrict__ drafts,
    int64_t* __restrict__ n_out, int64_t* __restrict__ next_out, int K, int64_t V) {
  const int64_t b = blockIdx.x;
  for (int i = 0; i <= K; i++) {
    const int64_t best = block_argmax(p + (b * (K + 1) + i) * V, V);  // the same in every thread
    if (i < K && drafts[b * K + i] == best) continue;        // accepted: look at the next draft
    if (threadIdx.x == 0) n_out[b] = i, next_out[b] = best;  // first mismatch, or the bonus
    return;
  }
}

template <typename scalar_t>  // greedy, a block per (i, b); the row's last block scans argmaxes
__global__ void accept_greedy_kernel2(
    const scalar_t* __restrict__ p, const int64_t* __restrict__ drafts, int64_t* best,
    int* tickets, int64_t* __restrict__ n_out, int64_t* __restrict__ next_out, int K, int64_t V) {
  const int64_t i = blockIdx.x, b = blockIdx.y;
  const int64_t arg = block_argmax(p + (b * (K + 1) + i) * V, V);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    best[b * (K + 1) + i] = arg;
    __threadfence();  // publish best[] before taking a ticket
    last = atomicAdd(&tickets[b], 1) == K;  // K + 1 blocks per row: the last one sees K
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    const volatile int64_t* row = best + b * (K + 1);  // volatile: not a stale L1 copy
    int n = K;
    for (int j = 0; j < K; j++)
      if (row[j] != drafts[b * K + j]) { n = j; break; }
    n_out[b] = n, next_out[b] = row[n];
  }
}

__global__ void accept_sample_kernel1(  // sampling, a block per row: ratio test, residual, CDF
    const float* __restrict__ p, const int64_t* __restrict__ drafts, const float* __restrict__ q,
    const double* __restrict__ u, int64_t* __restrict__ n_out, int64_t* __restrict__ next_out,
    int K, int64_t V) {
  const int64_t b = blockIdx.x, K1 = K + 1;
  __shared__ int s_n;
  if (threadIdx.x == 0) {  // K is small (15): one thread tests u_i * q_i(d_i) < p_i(d_i) in order
    int n = K;
    for (int i = 0; i < K; i++) {
      const int64_t d = drafts[b * K + i];
      CUDA_KERNEL_ASSERT(d < V && "accept_scan: draft token outside [0, V)");
      const bool in_range = d >= 0 && d < V;  // d < 0: an empty slot, rejected
      const float q_d = !in_range ? 1.0f : (q ? q[(b * K + i) * V + d] : 1.0f);
      const float p_d = !in_range ? 0.0f : p[(b * K1 + i) * V + d];
      if (!(u[b * K1 + i] * q_d < p_d)) { n = i; break; }
    }
    s_n = n;
  }
  __syncthreads();
  const int n = s_n;
  const bool drafted = n < K && drafts[b * K + n] >= 0;
  const float* p_n = p + (b * K1 + n) * V;
  const float* q_n = (q && drafted) ? q + (b * K + n) * V : nullptr;
  const int64_t d_n = (!q && drafted) ? drafts[b * K + n] : -1;  // argmax drafts: q_n one-hot
  auto residual = [&](int64_t j) {
    const float d = p_n[j] - (q_n ? q_n[j] : (j == d_n ? 1.0f : 0.0f));
    return d < 0.0f ? 0.0f : d;  // clamp(min=0); NaN passes, like torch's clamp
  };
  // pass 1: the residual's total (rejection implies mass > 0; rounding may leave none -> p_n)
  double total, part = 0.0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) part += residual(j);
  block_inclusive_scan(part, &total);
  const bool use_p = !(total > 0.0);
  if (use_p) {
    part = 0.0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) part += p_n[j];
    block_inclusive_scan(part, &total);
  }
  const double target = u[b * K1 + K] * total;  // float64: float32's 2^-24 grid is off p
  // pass 2: tiles in order; the first j whose running sum exceeds the target
  __shared__ int64_t s_first;
  __shared__ unsigned long long s_last;  // 1 + the last token with mass (0: none), see below
  if (threadIdx.x == 0) s_first = V, s_last = 0;
  __syncthreads();
  double carry = 0.0;
  int64_t last = -1;  // this thread's last token with mass so far
  for (int64_t start = 0; start < V; start += blockDim.x) {
    const int64_t j = start + threadIdx.x;
    const double x = j < V ? (use_p ? p_n[j] : residual(j)) : 0.0;
    double tile;
    const double cdf = carry + block_inclusive_scan(x, &tile);
    if (j < V && x > 0.0) {  // never a zero-mass token, even if cdf rounded a flat sum up
      last = j;
      if (cdf > target)
        atomicMin((unsigned long long*)&s_first, (unsigned long long)j);
    }
    carry += tile;
    __syncthreads();
    if (s_first < V) break;  // block-uniform: cdf is non-decreasing, later tiles cannot be first
  }
  // none crossed (pass 1 rounded above pass 2; README): the last token with mass, NaN: V - 1
  if (s_first == V && target == target) {  // block-uniform: s_first was read after a barrier
    if (last >= 0) atomicMax(&s_last, (unsigned long long)(last + 1));
    __syncthreads();
  }
  if (threadIdx.x == 0)
    n_out[b] = n, next_out[b] = s_first < V ? s_first : s_last > 0 ? (int64_t)s_last - 1 : V - 1;
}

void accept_scan_cuda(const void* p, c10::ScalarType p_dtype, const int64_t* drafts,
                      const float* q, const double* u, int64_t* n, int64_t* next, int64_t* best,
                      int* tickets, int64_t B, int64_t K, int64_t V, int version, int device) {
  if (B == 0) return;  // a launch with zero blocks is an error
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // the tensors' GPU
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);  // torch's current stream
  if (u != nullptr) {  // sampling: ext.cpp made p and q float32
    accept_sample_kernel1<<<B, kThreads, 0, stream>>>(
        (const float*)p, drafts, q, u, n, next, (int)K, V);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  auto greedy = [&](auto value) {  // a value of p's dtype names scalar_t
    using scalar_t = decltype(value);
    if (version == 1) {
      accept_greedy_kernel1<scalar_t><<<B, kThreads, 0, stream>>>(
          (const scalar_t*)p, drafts, n, next, (int)K, V);
    } else {  // ext.cpp made best and tickets (zeros), kernel2's workspaces
      accept_greedy_kernel2<scalar_t><<<dim3(K + 1, B), kThreads, 0, stream>>>(
          (const scalar_t*)p, drafts, best, tickets, n, next, (int)K, V);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (p_dtype) {
    case c10::ScalarType::Double: return greedy(double());
    case c10::ScalarType::Float: return greedy(float());
    case c10::ScalarType::Half: return greedy(c10::Half());
    case c10::ScalarType::BFloat16: return greedy(c10::BFloat16());
    default: TORCH_CHECK(false, "accept_scan_cuda: unsupported dtype ", p_dtype);
  }
}
