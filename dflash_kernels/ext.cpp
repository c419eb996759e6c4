// The argument checks at the boundary (the kernels take raw pointers) and the Python bindings.
// Built by __init__.py with nvcc; by dev/emu.py with -DDFLASH_EMU, the .cu files on the CPU.

#include <ATen/core/Tensor.h>  // narrow includes, not <torch/extension.h>: half the compile time
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 + the at::Tensor / optional casters

void kv_inject_cuda(  // the launchers, defined in kv_inject.cu and accept_scan.cu
    void* cache_k, void* cache_v, const void* new_k, const void* new_v, const int64_t* offsets,
    const int64_t* counts, const float* cos, const float* sin, int64_t L, int64_t B, int64_t H,
    int64_t T_max, int64_t D, int64_t T_new, int64_t P, c10::ScalarType dtype, int device);
void accept_scan_cuda(const void* p, c10::ScalarType p_dtype, const int64_t* drafts,
                      const float* q, const double* u, int64_t* n, int64_t* next, int64_t* best,
                      int* tickets, int64_t B, int64_t K, int64_t V, int version, int device);

#ifdef DFLASH_EMU  // the kernels run on the CPU under dev/emu.h (tests only)
static bool on_kernel_device(const at::Tensor& t) { return t.is_cpu(); }
#else
static bool on_kernel_device(const at::Tensor& t) { return t.is_cuda(); }
#endif

// the kernels index raw pointers: each t exactly `sizes`, of `dtype`, contiguous on `device`
static void expect(std::initializer_list<at::Tensor> ts, const char* what, at::IntArrayRef sizes,
                   at::ScalarType dtype, at::Device device) {
  for (const at::Tensor& t : ts)
    TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == dtype && t.is_contiguous() &&
                    t.device() == device, what, " must be ", sizes, ", dtype ", dtype,
                ", contiguous on ", device, "; got ", t.sizes(), ", ", t.scalar_type(), ", ",
                t.is_contiguous() ? "" : "not ", "contiguous on ", t.device());
}

void kv_inject(const at::Tensor& cache_k, const at::Tensor& cache_v, const at::Tensor& new_k,
               const at::Tensor& new_v, const at::Tensor& offsets, const at::Tensor& counts,
               const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cache_k.dim() == 5 && cache_k.size(4) % 2 == 0,
              "kv_inject: cache_k must be (L, B, H, T_max, D), D even (RoPE), got ",
              cache_k.sizes());
  TORCH_CHECK(on_kernel_device(cache_k), "kv_inject: no kernels for tensors on ", cache_k.device());
  const auto dtype = cache_k.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "kv_inject: the caches' dtype must be float32, float16 or bfloat16, got ", dtype);
  const int64_t L = cache_k.size(0), B = cache_k.size(1), H = cache_k.size(2);
  const int64_t T_max = cache_k.size(3), D = cache_k.size(4);
  const int64_t T_new = new_k.dim() == 5 ? new_k.size(2) : -1;  // -1: refused below
  const int64_t P = cos.dim() == 2 ? cos.size(0) : -1;
  const at::Device dev = cache_k.device();
  expect({cache_k, cache_v}, "kv_inject: cache_k, cache_v", {L, B, H, T_max, D}, dtype, dev);
  expect({new_k, new_v}, "kv_inject: new_k, new_v", {L, B, T_new, H, D}, dtype, dev);
  expect({offsets, counts}, "kv_inject: offsets and counts", {B}, at::kLong, dev);
  expect({cos, sin}, "kv_inject: cos, sin", {P, D / 2}, at::kFloat, dev);
  // NOTE: offsets/counts are checked by the kernel (here it would cost a host sync per call)
  kv_inject_cuda(cache_k.data_ptr(), cache_v.data_ptr(), new_k.data_ptr(), new_v.data_ptr(),
                 offsets.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), L, B, H, T_max, D, T_new, P, dtype, cache_k.get_device());
}

std::tuple<at::Tensor, at::Tensor> accept_scan(
    const at::Tensor& p_in, const at::Tensor& drafts, const std::optional<at::Tensor>& q_in,
    const std::optional<at::Tensor>& uniforms, int64_t version) {
  TORCH_CHECK(p_in.dim() == 3 && p_in.size(1) >= 1 && p_in.size(2) >= 1 && p_in.is_contiguous(),
              "accept_scan: p must be (B, K+1, V), contiguous, got ", p_in.sizes());
  const int64_t B = p_in.size(0), K = p_in.size(1) - 1, V = p_in.size(2);
  TORCH_CHECK(version == 1 || version == 2, "accept_scan: version must be 1 or 2, got ", version);
  TORCH_CHECK(on_kernel_device(p_in), "accept_scan: no kernels for tensors on ", p_in.device());
  expect({drafts}, "accept_scan: drafts", {B, K}, at::kLong, p_in.device());
  const bool greedy = !uniforms.has_value();
  std::optional<at::Tensor> q;
  at::Tensor p = p_in;
  if (!greedy) {
    expect({*uniforms}, "accept_scan: uniforms", {B, K + 1}, at::kDouble, p.device());
    p = p.to(at::kFloat);  // the reference computes in float32 (p.float(), q.float())
    if (q_in.has_value()) {
      expect({*q_in}, "accept_scan: q", {B, K, V}, q_in->scalar_type(), p.device());
      q = q_in->to(at::kFloat);
    }
  }
  // NOTE: sampling indexes p and q with the drafts: the kernel checks d < V (no host sync)
  at::Tensor n = at::empty({B}, drafts.options()), next = at::empty({B}, drafts.options());
  at::Tensor best, tickets;  // kernel2's workspaces: per-(row, position) argmax, per-row counter
  if (greedy && version == 2) {
    TORCH_CHECK(B <= 65535, "accept_scan version 2: B = ", B, " exceeds gridDim.y; use version 1");
    best = at::empty({B, K + 1}, drafts.options());
    tickets = at::zeros({B}, drafts.options().dtype(at::kInt));  // a memset on the current stream
  }
  accept_scan_cuda(p.data_ptr(), p.scalar_type(), drafts.data_ptr<int64_t>(),
                   q ? q->data_ptr<float>() : nullptr,
                   greedy ? nullptr : uniforms->data_ptr<double>(), n.data_ptr<int64_t>(),
                   next.data_ptr<int64_t>(), best.defined() ? best.data_ptr<int64_t>() : nullptr,
                   tickets.defined() ? tickets.data_ptr<int>() : nullptr, B, K, V, (int)version,
                   p.get_device());
  return {n, next};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // the engine calls it from __init__.py, positionally
  m.def("kv_inject", &kv_inject, "RoPE + scatter of new K/V into the cache, all layers, in place");
  m.def("accept_scan", &accept_scan, "(p, drafts, q, uniforms, version) -> (n_accepted, token)");
}
