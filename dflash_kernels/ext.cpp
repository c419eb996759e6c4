// The C++ side of the extension: the argument checks at the boundary and the Python bindings
// (DESIGN.md sec. 7). The math is in kv_inject.cu and accept_scan.cu, whose headers describe
// the two ops; they take raw pointers, so every tensor is checked here before they see it.
//
// Built by dflash_kernels/__init__.py (torch.utils.cpp_extension, nvcc) when a CUDA device exists.
// dev/emu.py builds this same file with -DDFLASH_EMU, linked with the .cu files compiled by g++
// under dev/emu.h: CPU tensors then run the kernels' own code, so CI tests it without a GPU.

// Narrow includes instead of <torch/extension.h> (all of libtorch): half the compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 + the at::Tensor / optional casters

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>

// defined in kv_inject.cu / accept_scan.cu, which see raw pointers only (fast to compile)
void kv_inject_cuda(void* cache_k, void* cache_v, const void* new_k, const void* new_v,
                    const int64_t* offsets, const int64_t* counts, const float* cos,
                    const float* sin, int64_t L, int64_t B, int64_t H, int64_t T_max, int64_t D,
                    int64_t T_new, int64_t P, c10::ScalarType dtype, int device);
void accept_scan_cuda(const void* p, c10::ScalarType p_dtype, const int64_t* drafts,
                      const float* q, const float* u, int64_t* n, int64_t* next, int64_t* best,
                      int* tickets, int64_t B, int64_t K, int64_t V, int version, int device);

#ifdef DFLASH_EMU  // the kernels run on the CPU under dev/emu.h (tests only)
static bool on_kernel_device(const at::Tensor& t) { return t.is_cpu(); }
#else
static bool on_kernel_device(const at::Tensor& t) { return t.is_cuda(); }
#endif

void kv_inject(at::Tensor cache_k, at::Tensor cache_v, const at::Tensor& new_k,
               const at::Tensor& new_v, const at::Tensor& offsets, const at::Tensor& counts,
               const at::Tensor& cos, const at::Tensor& sin) {
  // cache (L, B, H, T_max, D), new (L, B, T_new, H, D), offsets/counts (B,), cos/sin (P, D/2)
  TORCH_CHECK(cache_k.dim() == 5, "kv_inject: cache_k must be (L, B, H, T_max, D), got ",
              cache_k.sizes());
  TORCH_CHECK(cache_v.sizes() == cache_k.sizes(), "kv_inject: cache_v ", cache_v.sizes(),
              " != cache_k ", cache_k.sizes());
  const int64_t L = cache_k.size(0), B = cache_k.size(1), H = cache_k.size(2);
  const int64_t T_max = cache_k.size(3), D = cache_k.size(4);
  TORCH_CHECK(D % 2 == 0, "kv_inject: head dim D must be even for RoPE, got ", D);
  TORCH_CHECK(new_k.dim() == 5 && new_k.size(0) == L && new_k.size(1) == B &&
                  new_k.size(3) == H && new_k.size(4) == D,
              "kv_inject: new_k must be (L, B, T_new, H, D) = (", L, ", ", B, ", T_new, ", H,
              ", ", D, "), got ", new_k.sizes());
  TORCH_CHECK(new_v.sizes() == new_k.sizes(), "kv_inject: new_v ", new_v.sizes(), " != new_k ",
              new_k.sizes());
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == B && counts.dim() == 1 &&
                  counts.size(0) == B,
              "kv_inject: offsets and counts must be (B,) with B = ", B);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && counts.scalar_type() == at::kLong,
              "kv_inject: offsets and counts must be int64");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "kv_inject: cos, sin must be (P, D/2) with D/2 = ", D / 2, ", got ", cos.sizes(),
              " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "kv_inject: cos, sin must be float32");
  const auto dtype = cache_k.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "kv_inject: cache dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(cache_v.scalar_type() == dtype && new_k.scalar_type() == dtype &&
                  new_v.scalar_type() == dtype,
              "kv_inject: cache_k, cache_v, new_k, new_v must share one dtype");
  TORCH_CHECK(on_kernel_device(cache_k), "kv_inject: no kernels for tensors on ",
              cache_k.device());
  const std::initializer_list<const at::Tensor*> all = {&cache_k, &cache_v, &new_k, &new_v,
                                                        &offsets, &counts, &cos, &sin};
  for (const at::Tensor* t : all) {
    TORCH_CHECK(t->device() == cache_k.device(), "kv_inject: all tensors must be on ",
                cache_k.device(), ", one is on ", t->device());
    TORCH_CHECK(t->is_contiguous(), "kv_inject: all tensors must be contiguous");
  }
  // NOTE: offsets/counts live on the GPU; checking them here would cost a host sync per call.
  // The kernel checks them instead: a bad row is skipped (never an out-of-bounds write) and
  // raises a device-side assert, like torch's own index kernels.
  kv_inject_cuda(cache_k.data_ptr(), cache_v.data_ptr(), new_k.data_ptr(), new_v.data_ptr(),
                 offsets.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), L, B, H, T_max, D, new_k.size(2), cos.size(0), dtype,
                 cache_k.get_device());
}

std::tuple<at::Tensor, at::Tensor> accept_scan(const at::Tensor& p_in, const at::Tensor& drafts,
                                               const std::optional<at::Tensor>& q_in,
                                               const std::optional<at::Tensor>& uniforms,
                                               int64_t version) {
  // p (B, K+1, V), drafts (B, K), q (B, K, V) or None, uniforms (B, K+1) or None (greedy)
  TORCH_CHECK(p_in.dim() == 3 && p_in.size(1) >= 1 && p_in.size(2) >= 1,
              "accept_scan: p must be (B, K+1, V), got ", p_in.sizes());
  const int64_t B = p_in.size(0), K = p_in.size(1) - 1, V = p_in.size(2);
  TORCH_CHECK(version == 1 || version == 2, "accept_scan: version must be 1 or 2, got ", version);
  TORCH_CHECK(on_kernel_device(p_in), "accept_scan: no kernels for tensors on ", p_in.device());
  TORCH_CHECK(p_in.is_contiguous(), "accept_scan: p must be contiguous");
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == B && drafts.size(1) == K,
              "accept_scan: drafts must be (B, K) = (", B, ", ", K, "), got ", drafts.sizes());
  TORCH_CHECK(drafts.scalar_type() == at::kLong, "accept_scan: drafts must be int64");
  TORCH_CHECK(drafts.device() == p_in.device() && drafts.is_contiguous(),
              "accept_scan: drafts must be contiguous on ", p_in.device());
  const bool greedy = !uniforms.has_value();
  std::optional<at::Tensor> q;
  at::Tensor p = p_in;
  if (!greedy) {
    const at::Tensor& u = *uniforms;
    TORCH_CHECK(u.dim() == 2 && u.size(0) == B && u.size(1) == K + 1,
                "accept_scan: uniforms must be (B, K+1), got ", u.sizes());
    TORCH_CHECK(u.scalar_type() == at::kFloat && u.device() == p.device() && u.is_contiguous(),
                "accept_scan: uniforms must be contiguous float32 on ", p.device());
    p = p.to(at::kFloat);  // the reference computes in float32 (p.float(), q.float())
    if (q_in.has_value()) {
      TORCH_CHECK(q_in->dim() == 3 && q_in->size(0) == B && q_in->size(1) == K &&
                      q_in->size(2) == V,
                  "accept_scan: q must be (B, K, V), got ", q_in->sizes());
      TORCH_CHECK(q_in->device() == p.device() && q_in->is_contiguous(),
                  "accept_scan: q must be contiguous on ", p.device());
      q = q_in->to(at::kFloat);
    }
  }
  // NOTE: sampling indexes p and q with the drafts; the kernel checks d < V (on the host it
  // would cost a sync), a negative draft being an empty slot (speculate.NO_DRAFT)
  at::Tensor n = at::empty({B}, drafts.options());
  at::Tensor next = at::empty({B}, drafts.options());
  at::Tensor best, tickets;  // kernel2's workspaces: per-(row, position) argmax, per-row counter
  if (greedy && version == 2) {
    TORCH_CHECK(B <= 65535, "accept_scan version 2: B = ", B, " exceeds gridDim.y; use version 1");
    best = at::empty({B, K + 1}, drafts.options());
    tickets = at::zeros({B}, drafts.options().dtype(at::kInt));  // a memset on the current stream
  }
  accept_scan_cuda(p.data_ptr(), p.scalar_type(), drafts.data_ptr<int64_t>(),
                   q ? q->data_ptr<float>() : nullptr,
                   greedy ? nullptr : uniforms->data_ptr<float>(), n.data_ptr<int64_t>(),
                   next.data_ptr<int64_t>(), best.defined() ? best.data_ptr<int64_t>() : nullptr,
                   tickets.defined() ? tickets.data_ptr<int>() : nullptr, B, K, V, (int)version,
                   p.get_device());
  return {n, next};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "DFlash kernels: kv_inject and accept_scan (the math is in dflash_kernels/*.cu)";
  m.def("kv_inject", &kv_inject,
        "RoPE + scatter of new context K/V into the cache for all layers, in place",
        py::arg("cache_k"), py::arg("cache_v"), py::arg("new_k"), py::arg("new_v"),
        py::arg("offsets"), py::arg("counts"), py::arg("cos"), py::arg("sin"));
  m.def("accept_scan", &accept_scan, "speculative acceptance scan -> (n_accepted, next_token)",
        py::arg("p"), py::arg("drafts"), py::arg("q") = py::none(),
        py::arg("uniforms") = py::none(), py::arg("version") = 1);
}
