// The C++ side of the extension: argument checks, the host (CPU) implementations, and the
// Python bindings. DESIGN.md sec. 7; the math is in kv_inject.cu and accept_scan.cu, whose
// headers describe the two ops.
//
// The same file builds three variants (cuda/__init__.py picks one):
//   - without WITH_CUDA (g++ only, no nvcc): CPU tensors run the plain loops below, so CI
//     builds and tests the binding, the checks and the semantics on any machine;
//   - with -DWITH_CUDA, linked with the two .cu files: CUDA tensors go to the kernels;
//   - with -DWITH_CUDA -DDFLASH_EMU, linked with the .cu files compiled by g++ under cuda/emu.h:
//     CPU tensors go to the kernels, emulated on the CPU (cuda.load_emu; tests only).
// The host loops are written to be BIT-EXACT with the PyTorch references on CPU: same float
// operations in the same order, no FMA contraction (the build passes -ffp-contract=off),
// and the inverse-CDF running sum accumulated in double like torch.cumsum on CPU.

// Narrow includes instead of <torch/extension.h> (all of libtorch): half the compile time.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 + the at::Tensor / optional casters

#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#ifdef WITH_CUDA
// defined in kv_inject.cu / accept_scan.cu, which see raw pointers only (fast to compile);
// arguments are checked here
void kv_inject_cuda(void* cache_k, void* cache_v, const void* new_k, const void* new_v, const int64_t* offsets,
                    const int64_t* counts, const float* cos, const float* sin, int64_t L, int64_t B, int64_t H,
                    int64_t T_max, int64_t D, int64_t T_new, int64_t P, c10::ScalarType dtype, int device);
void accept_scan_cuda(const void* p, c10::ScalarType p_dtype, const int64_t* drafts, const float* q, const float* u,
                      int64_t* n, int64_t* next, int64_t* best, int* tickets, int64_t B, int64_t K, int64_t V,
                      int version, int device);
#ifdef DFLASH_EMU  // the kernels run on the CPU under cuda/emu.h (tests only): CPU tensors take them
static bool on_kernels(const at::Tensor&) { return true; }
#else
static bool on_kernels(const at::Tensor& t) { return t.is_cuda(); }
#endif
#endif

// -----------------------------------------------------------------------------
// kv_inject

template <typename scalar_t>
static void kv_inject_host(at::Tensor& cache_k, at::Tensor& cache_v, const at::Tensor& new_k,
                           const at::Tensor& new_v, const int64_t* offsets, const int64_t* counts,
                           const float* cos, const float* sin) {
  const int64_t L = cache_k.size(0), B = cache_k.size(1), H = cache_k.size(2);
  const int64_t T_max = cache_k.size(3), D = cache_k.size(4), T_new = new_k.size(2), D2 = D / 2;
  scalar_t* ck = cache_k.data_ptr<scalar_t>();
  scalar_t* cv = cache_v.data_ptr<scalar_t>();
  const scalar_t* nk = new_k.data_ptr<scalar_t>();
  const scalar_t* nv = new_v.data_ptr<scalar_t>();
  for (int64_t l = 0; l < L; l++)
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t < counts[b]; t++) {  // rows with counts[b] = 0 write nothing
        const int64_t pos = offsets[b] + t;         // absolute position = cache slot
        const float* c = cos + pos * D2;
        const float* s = sin + pos * D2;
        for (int64_t h = 0; h < H; h++) {
          const int64_t src = (((l * B + b) * T_new + t) * H + h) * D;      // new_k[l, b, t, h, :]
          const int64_t dst = (((l * B + b) * H + h) * T_max + pos) * D;    // cache[l, b, h, pos, :]
          for (int64_t i = 0; i < D2; i++) {  // rotate-half: pairs (i, i + D/2), as model.apply_rope
            const float x1 = static_cast<float>(nk[src + i]);
            const float x2 = static_cast<float>(nk[src + i + D2]);
            ck[dst + i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
            ck[dst + i + D2] = static_cast<scalar_t>(x2 * c[i] + x1 * s[i]);
          }
          for (int64_t i = 0; i < D; i++) cv[dst + i] = nv[src + i];
        }
      }
}

void kv_inject(at::Tensor cache_k, at::Tensor cache_v, const at::Tensor& new_k,
               const at::Tensor& new_v, const at::Tensor& offsets, const at::Tensor& counts,
               const at::Tensor& cos, const at::Tensor& sin) {
  // shapes: cache (L, B, H, T_max, D), new (L, B, T_new, H, D), offsets/counts (B,), cos/sin (P, D/2)
  TORCH_CHECK(cache_k.dim() == 5, "kv_inject: cache_k must be (L, B, H, T_max, D), got ", cache_k.sizes());
  TORCH_CHECK(cache_v.sizes() == cache_k.sizes(), "kv_inject: cache_v ", cache_v.sizes(), " != cache_k ", cache_k.sizes());
  const int64_t L = cache_k.size(0), B = cache_k.size(1), H = cache_k.size(2);
  const int64_t T_max = cache_k.size(3), D = cache_k.size(4);
  TORCH_CHECK(D % 2 == 0, "kv_inject: head dim D must be even for RoPE, got ", D);
  TORCH_CHECK(new_k.dim() == 5 && new_k.size(0) == L && new_k.size(1) == B && new_k.size(3) == H &&
                  new_k.size(4) == D,
              "kv_inject: new_k must be (L, B, T_new, H, D) = (", L, ", ", B, ", T_new, ", H, ", ", D, "), got ", new_k.sizes());
  TORCH_CHECK(new_v.sizes() == new_k.sizes(), "kv_inject: new_v ", new_v.sizes(), " != new_k ", new_k.sizes());
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == B && counts.dim() == 1 && counts.size(0) == B,
              "kv_inject: offsets and counts must be (B,) with B = ", B);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && counts.scalar_type() == at::kLong,
              "kv_inject: offsets and counts must be int64");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "kv_inject: cos, sin must be (P, D/2) with D/2 = ", D / 2, ", got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "kv_inject: cos, sin must be float32");
  const auto dtype = cache_k.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "kv_inject: cache dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(cache_v.scalar_type() == dtype && new_k.scalar_type() == dtype && new_v.scalar_type() == dtype,
              "kv_inject: cache_k, cache_v, new_k, new_v must share one dtype");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&cache_v, &new_k, &new_v, &offsets, &counts, &cos, &sin})
    TORCH_CHECK(t->device() == cache_k.device(), "kv_inject: all tensors must be on ", cache_k.device(), ", one is on ", t->device());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&cache_k, &cache_v, &new_k, &new_v, &offsets, &counts, &cos, &sin})
    TORCH_CHECK(t->is_contiguous(), "kv_inject: all tensors must be contiguous");
#ifdef WITH_CUDA
  if (on_kernels(cache_k)) {
    // NOTE: offsets/counts live on the GPU; checking them here would cost a host sync per
    // call. The kernel checks them instead: a bad row is skipped (never an out-of-bounds
    // write) and raises a device-side assert, like torch's own index kernels.
    kv_inject_cuda(cache_k.data_ptr(), cache_v.data_ptr(), new_k.data_ptr(), new_v.data_ptr(),
                   offsets.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                   L, B, H, T_max, D, new_k.size(2), cos.size(0), dtype, cache_k.get_device());
    return;
  }
#endif
  TORCH_CHECK(cache_k.is_cpu(), "kv_inject: this build has no CUDA support (tensors on ", cache_k.device(), ")");
  const int64_t T_new = new_k.size(2), P = cos.size(0);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {  // on the host the exact check is free
    TORCH_CHECK(cnt[b] >= 0 && cnt[b] <= T_new, "kv_inject: counts[", b, "] = ", cnt[b], " not in [0, T_new = ", T_new, "]");
    // off <= T_max - cnt, not off + cnt <= T_max: a garbage offset near INT64_MAX must not wrap
    TORCH_CHECK(off[b] >= 0 && off[b] <= T_max - cnt[b], "kv_inject: row ", b, " writes ", cnt[b],
                " slots from offset ", off[b], ", outside the cache (T_max = ", T_max, ")");
    TORCH_CHECK(off[b] <= P - cnt[b], "kv_inject: row ", b, " writes ", cnt[b], " positions from ", off[b],
                ", past the RoPE tables (P = ", P, " rows)");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "kv_inject_host", [&] {
    kv_inject_host<scalar_t>(cache_k, cache_v, new_k, new_v, off, cnt, cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

// -----------------------------------------------------------------------------
// accept_scan

// torch.argmax's order: NaN beats everything, then larger values, ties -> lower index. In one
// pass that is: the first NaN, else the first maximum. Compared in float32 (exact for half and
// bfloat16), in double for double (float32 would tie distinct float64 values).
template <typename scalar_t>
static int64_t argmax_host(const scalar_t* x, int64_t V) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  acc_t bv = static_cast<acc_t>(x[0]);
  int64_t bi = 0;
  for (int64_t j = 0; j < V; j++) {
    const acc_t v = static_cast<acc_t>(x[j]);
    if (v != v) return j;  // NaN
    if (v > bv) bv = v, bi = j;  // strictly larger: a tie keeps the lower index
  }
  return bi;
}

template <typename scalar_t>
static void accept_greedy_host(const scalar_t* p, const int64_t* drafts, int64_t* n_out, int64_t* next_out,
                               int64_t B, int64_t K, int64_t V) {
  for (int64_t b = 0; b < B; b++) {
    // accept d_i while d_i == argmax p_i; the first mismatch (or the bonus position K) emits its argmax
    for (int64_t i = 0; i <= K; i++) {
      const int64_t best = argmax_host(p + (b * (K + 1) + i) * V, V);
      if (i < K && drafts[b * K + i] == best) continue;
      n_out[b] = i, next_out[b] = best;
      break;
    }
  }
}

static void accept_sample_host(const float* p, const int64_t* drafts, const float* q, const float* u,
                               int64_t* n_out, int64_t* next_out, int64_t B, int64_t K, int64_t V) {
  const int64_t K1 = K + 1;
  for (int64_t b = 0; b < B; b++) {
    // ratio test: accept d_i while u_i * q_i(d_i) < p_i(d_i)   (q one-hot when q is null);
    // an empty slot (d < 0, NO_DRAFT) is rejected
    int64_t n = K;
    for (int64_t i = 0; i < K; i++) {
      const int64_t d = drafts[b * K + i];
      if (d < 0) { n = i; break; }
      const float q_d = q ? q[(b * K + i) * V + d] : 1.0f;
      if (!(u[b * K1 + i] * q_d < p[(b * K1 + i) * V + d])) { n = i; break; }
    }
    // the emitted token's distribution: residual max(0, p_n - q_n) (no q after the last draft,
    // none at an empty slot: there it is p_n itself)
    const bool drafted = n < K && drafts[b * K + n] >= 0;
    const float* p_n = p + (b * K1 + n) * V;
    const float* q_n = (q && drafted) ? q + (b * K + n) * V : nullptr;
    const int64_t d_n = (!q && drafted) ? drafts[b * K + n] : -1;  // argmax drafts: q_n one-hot at d_n
    auto residual = [&](int64_t j) {
      const float d = p_n[j] - (q_n ? q_n[j] : (j == d_n ? 1.0f : 0.0f));
      return d < 0.0f ? 0.0f : d;  // clamp(min=0), NaN passes like torch's
    };
    double total = 0.0;
    for (int64_t j = 0; j < V; j++) total += residual(j);
    const bool use_p = !(total > 0.0);  // rounding left no residual mass: sample from p_n
    auto val = [&](int64_t j) { return use_p ? p_n[j] : residual(j); };
    // inverse CDF exactly as torch.cumsum on CPU: a double running sum, rounded to float per
    // element; searchsorted(right=True) = the first index whose cdf exceeds u * cdf[-1]
    double acc = 0.0;
    for (int64_t j = 0; j < V; j++) acc += val(j);
    const float target = u[b * K1 + K] * static_cast<float>(acc);
    int64_t idx = V;
    acc = 0.0;
    for (int64_t j = 0; j < V; j++) {
      acc += val(j);
      if (static_cast<float>(acc) > target) { idx = j; break; }
    }
    n_out[b] = n, next_out[b] = idx < V - 1 ? idx : V - 1;
  }
}

std::tuple<at::Tensor, at::Tensor> accept_scan(const at::Tensor& p_in, const at::Tensor& drafts,
                                               const std::optional<at::Tensor>& q_in,
                                               const std::optional<at::Tensor>& uniforms,
                                               int64_t version) {
  // shapes: p (B, K+1, V), drafts (B, K), q (B, K, V) or None, uniforms (B, K+1) or None (greedy)
  TORCH_CHECK(p_in.dim() == 3 && p_in.size(1) >= 1 && p_in.size(2) >= 1, "accept_scan: p must be (B, K+1, V), got ", p_in.sizes());
  const int64_t B = p_in.size(0), K = p_in.size(1) - 1, V = p_in.size(2);
  TORCH_CHECK(version == 1 || version == 2, "accept_scan: version must be 1 or 2, got ", version);
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == B && drafts.size(1) == K,
              "accept_scan: drafts must be (B, K) = (", B, ", ", K, "), got ", drafts.sizes());
  TORCH_CHECK(drafts.scalar_type() == at::kLong, "accept_scan: drafts must be int64");
  TORCH_CHECK(drafts.device() == p_in.device() && drafts.is_contiguous(), "accept_scan: drafts must be contiguous on ", p_in.device());
  const bool greedy = !uniforms.has_value();
  TORCH_CHECK(p_in.is_contiguous(), "accept_scan: p must be contiguous");
  std::optional<at::Tensor> q;
  at::Tensor p = p_in;
  if (!greedy) {
    const at::Tensor& u = *uniforms;
    TORCH_CHECK(u.dim() == 2 && u.size(0) == B && u.size(1) == K + 1, "accept_scan: uniforms must be (B, K+1), got ", u.sizes());
    TORCH_CHECK(u.scalar_type() == at::kFloat && u.device() == p.device() && u.is_contiguous(),
                "accept_scan: uniforms must be contiguous float32 on ", p.device());
    p = p.to(at::kFloat);  // the reference computes in float32 (p.float(), q.float())
    if (q_in.has_value()) {
      TORCH_CHECK(q_in->dim() == 3 && q_in->size(0) == B && q_in->size(1) == K && q_in->size(2) == V,
                  "accept_scan: q must be (B, K, V), got ", q_in->sizes());
      TORCH_CHECK(q_in->device() == p.device() && q_in->is_contiguous(), "accept_scan: q must be contiguous on ", p.device());
      q = q_in->to(at::kFloat);
    }
  }
  at::Tensor n = at::empty({B}, drafts.options());
  at::Tensor next = at::empty({B}, drafts.options());
#ifdef WITH_CUDA
  if (on_kernels(p)) {
    at::Tensor best, tickets;  // kernel2's workspaces: per-(row, position) argmax, per-row counter
    if (greedy && version == 2) {
      TORCH_CHECK(B <= 65535, "accept_scan version 2: B = ", B, " exceeds gridDim.y; use version 1");
      best = at::empty({B, K + 1}, drafts.options());
      tickets = at::zeros({B}, drafts.options().dtype(at::kInt));  // a memset on the current stream
    }
    accept_scan_cuda(p.data_ptr(), p.scalar_type(), drafts.data_ptr<int64_t>(), q ? q->data_ptr<float>() : nullptr,
                     greedy ? nullptr : uniforms->data_ptr<float>(), n.data_ptr<int64_t>(), next.data_ptr<int64_t>(),
                     best.defined() ? best.data_ptr<int64_t>() : nullptr,
                     tickets.defined() ? tickets.data_ptr<int>() : nullptr, B, K, V, (int)version, p.get_device());
    return {n, next};
  }
#endif
  TORCH_CHECK(p.is_cpu(), "accept_scan: this build has no CUDA support (tensors on ", p.device(), ")");
  const int64_t* d = drafts.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * K && !greedy; i++)  // sampling indexes p and q with the drafts (< 0: empty)
    TORCH_CHECK(d[i] < V, "accept_scan: draft token ", d[i], " outside [0, V = ", V, ") (negative: no draft)");
  // the host path has one version: `version` selects GPU kernels only
  if (greedy) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "accept_greedy_host", [&] {
      accept_greedy_host<scalar_t>(p.data_ptr<scalar_t>(), d, n.data_ptr<int64_t>(), next.data_ptr<int64_t>(), B, K, V);
    });
  } else {
    accept_sample_host(p.data_ptr<float>(), d, q ? q->data_ptr<float>() : nullptr, uniforms->data_ptr<float>(),
                       n.data_ptr<int64_t>(), next.data_ptr<int64_t>(), B, K, V);
  }
  return {n, next};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "DFlash kernels: kv_inject and accept_scan (see cuda/*.cu for the math)";
  m.def("kv_inject", &kv_inject, "RoPE + scatter of new context K/V into the cache for all layers, in place",
        py::arg("cache_k"), py::arg("cache_v"), py::arg("new_k"), py::arg("new_v"), py::arg("offsets"),
        py::arg("counts"), py::arg("cos"), py::arg("sin"));
  m.def("accept_scan", &accept_scan, "speculative acceptance scan -> (n_accepted, next_token)", py::arg("p"),
        py::arg("drafts"), py::arg("q") = py::none(), py::arg("uniforms") = py::none(), py::arg("version") = 1);
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
