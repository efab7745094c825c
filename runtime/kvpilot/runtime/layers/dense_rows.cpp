// A dense projection of a decode step's few rows on CPU: out [T, N] = x [T, K] @ w [N, K]^T
// (+ bias), summed in float and rounded once into x's dtype (layers/quant.py,
// DenseWeight.linear, where T is at most DENSE_ROWS_MAX).
//
// At a few rows a projection is a matrix-vector product, bound by reading w once. What F.linear
// runs there (oneDNN's bf16 matmul) took 17.5 us for tiny-llama's 256 x 256 o_proj, 6 GMAC/s
// on this CPU, and a decode step at one sequence spent 60% of its CPU in such calls
// (docs/benchmarks.md, engine_dense_rows). Here each line of w is read once for every row of
// the block (up to kRowBlock), kFeatures output features at a time, each feature's sum one
// vector of 16 floats; the tasks split the features.
//
// Registered as torch.ops.kvpilot.dense_rows beside paged_decode_attention (one library, built
// by paged_kernel.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "float_convert.h"
#include "float_lanes.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using kvpilot_kernels::Floats;
using kvpilot_kernels::from_float;
using kvpilot_kernels::kLanes;
using kvpilot_kernels::load_first;
using kvpilot_kernels::load_lanes;
using kvpilot_kernels::to_float;

constexpr int64_t kRowBlock = 4;  // activation rows multiplied per read of w
constexpr int64_t kFeatures = 4;  // output features summed side by side: 4 x 4 sums in registers
constexpr int64_t kTaskMacs = 1 << 15;  // a task's least work: small matrices run on one thread

inline float lane_sum(const Floats& lanes) {
  float sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

struct Rows {
  const float* values;  // [rows, padded]: x in float, each row zero-padded to a whole block
  int64_t padded;
  const float* bias;  // [N] or nullptr
};

// Features [n, n + F) of the block's R rows: out[r][n + f] = x[r] . w[n + f] (+ bias).
template <int R, int F, typename W, typename O>
inline void sum_features(const Rows& rows, const W* w, int64_t k, int64_t n, O* out,
                         int64_t out_stride) {
  Floats sums[R][F] = {};
  const int64_t whole = k / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    Floats lines[F];
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) lines[f] = load_lanes(w + (n + f) * k + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Floats x = load_lanes(rows.values + r * rows.padded + i);
#pragma GCC unroll 4
      for (int f = 0; f < F; ++f) sums[r][f] += x * lines[f];
    }
  }
  if (whole < k) {  // the rows are zero past k: w's last block is read through a padded copy
    for (int f = 0; f < F; ++f) {
      const Floats line = load_first(w + (n + f) * k + whole, k - whole);
      for (int r = 0; r < R; ++r)
        sums[r][f] += load_lanes(rows.values + r * rows.padded + whole) * line;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) {
      const float bias = rows.bias == nullptr ? 0.0f : rows.bias[n + f];
      out[r * out_stride + n + f] = from_float<O>(lane_sum(sums[r][f]) + bias);
    }
}

// Features [first, last) of R rows, kFeatures at a time, then one at a time.
template <int R, typename W, typename O>
void block_features(const Rows& rows, const W* w, int64_t k, int64_t first, int64_t last,
                    O* out, int64_t out_stride) {
  int64_t n = first;
  for (; n + kFeatures <= last; n += kFeatures)
    sum_features<R, kFeatures>(rows, w, k, n, out, out_stride);
  for (; n < last; ++n) sum_features<R, 1>(rows, w, k, n, out, out_stride);
}

template <typename W, typename O>
void features_of_rows(const Rows& rows, int64_t num_rows, const W* w, int64_t k, int64_t first,
                      int64_t last, O* out, int64_t out_stride) {
  for (int64_t r0 = 0; r0 < num_rows; r0 += kRowBlock) {
    const Rows block{rows.values + r0 * rows.padded, rows.padded, rows.bias};
    O* block_out = out + r0 * out_stride;
    switch (std::min(kRowBlock, num_rows - r0)) {
      case 1: block_features<1>(block, w, k, first, last, block_out, out_stride); break;
      case 2: block_features<2>(block, w, k, first, last, block_out, out_stride); break;
      case 3: block_features<3>(block, w, k, first, last, block_out, out_stride); break;
      default: block_features<4>(block, w, k, first, last, block_out, out_stride); break;
    }
  }
}

// x [T, K] in float, each row zero-padded to whole blocks of kLanes.
template <typename X>
std::vector<float> rows_in_float(const at::Tensor& x, int64_t padded) {
  const int64_t num_rows = x.size(0), k = x.size(1);
  std::vector<float> values(num_rows * padded, 0.0f);
  const X* data = x.data_ptr<X>();
  for (int64_t r = 0; r < num_rows; ++r)
    for (int64_t i = 0; i < k; ++i) values[r * padded + i] = to_float(data[r * x.stride(0) + i]);
  return values;
}

#if defined(__AVX512BF16__)
// bf16 rows by a bf16 w where the CPU has AVX512-BF16: vdpbf16ps multiplies 32 pairs of bf16
// and adds them into 16 float sums, one instruction where the float path widens both sides
// first (the bf16 matmul oneDNN runs does the same). Tails are masked loads (zeros past k).
namespace bf16_dot {

constexpr int64_t kPairs = 32;
constexpr int64_t kPairRows = 2;  // rows per read of w: at 4, the step slowed by half

inline __m512bh load(const c10::BFloat16* values, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, values);
}

template <int R, int F>
inline void sum_features(const c10::BFloat16* x, int64_t x_stride, const float* bias,
                         const c10::BFloat16* w, int64_t k, int64_t n, c10::BFloat16* out,
                         int64_t out_stride) {
  __m512 sums[R][F];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) sums[r][f] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kPairs) {
    const __mmask32 mask = k - i >= kPairs ? ~__mmask32(0) : (__mmask32(1) << (k - i)) - 1;
    __m512bh lines[F];
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) lines[f] = load(w + (n + f) * k + i, mask);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh row = load(x + r * x_stride + i, mask);
#pragma GCC unroll 4
      for (int f = 0; f < F; ++f) sums[r][f] = _mm512_dpbf16_ps(sums[r][f], row, lines[f]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) {
      const float extra = bias == nullptr ? 0.0f : bias[n + f];
      out[r * out_stride + n + f] =
          from_float<c10::BFloat16>(_mm512_reduce_add_ps(sums[r][f]) + extra);
    }
}

template <int R>
void block_features(const c10::BFloat16* x, int64_t x_stride, const float* bias,
                    const c10::BFloat16* w, int64_t k, int64_t first, int64_t last,
                    c10::BFloat16* out, int64_t out_stride) {
  int64_t n = first;
  for (; n + kFeatures <= last; n += kFeatures)
    sum_features<R, kFeatures>(x, x_stride, bias, w, k, n, out, out_stride);
  for (; n < last; ++n) sum_features<R, 1>(x, x_stride, bias, w, k, n, out, out_stride);
}

void features_of_rows(const c10::BFloat16* x, int64_t x_stride, int64_t num_rows,
                      const float* bias, const c10::BFloat16* w, int64_t k, int64_t first,
                      int64_t last, c10::BFloat16* out, int64_t out_stride) {
  for (int64_t r0 = 0; r0 < num_rows; r0 += kPairRows) {
    const c10::BFloat16* block = x + r0 * x_stride;
    c10::BFloat16* block_out = out + r0 * out_stride;
    if (num_rows - r0 == 1)
      block_features<1>(block, x_stride, bias, w, k, first, last, block_out, out_stride);
    else
      block_features<2>(block, x_stride, bias, w, k, first, last, block_out, out_stride);
  }
}

}  // namespace bf16_dot
#endif

std::vector<float> bias_in_float(const std::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return {};
  const at::Tensor values = bias->to(at::kFloat).contiguous();
  return {values.data_ptr<float>(), values.data_ptr<float>() + values.numel()};
}

template <typename W, typename O>
void run(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
         at::Tensor& out) {
  const int64_t num_rows = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t padded = (k + kLanes - 1) / kLanes * kLanes;
  const std::vector<float> bias_values = bias_in_float(bias);
  const float* bias_data = bias.has_value() ? bias_values.data() : nullptr;
  const W* weights = w.data_ptr<W>();
  O* output = out.data_ptr<O>();
  const int64_t blocks = (n + kFeatures - 1) / kFeatures;
  const int64_t grain = std::max<int64_t>(1, kTaskMacs / (kFeatures * k * num_rows));
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, c10::BFloat16> && std::is_same_v<O, c10::BFloat16>) {
    const c10::BFloat16* rows = x.data_ptr<c10::BFloat16>();
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      bf16_dot::features_of_rows(rows, x.stride(0), num_rows, bias_data, weights, k,
                                 begin * kFeatures, std::min(n, end * kFeatures), output, n);
    });
    return;
  }
#endif
  const std::vector<float> values = rows_in_float<O>(x, padded);
  const Rows rows{values.data(), padded, bias_data};
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    features_of_rows(rows, num_rows, weights, k, begin * kFeatures,
                     std::min(n, end * kFeatures), output, n);
  });
}

template <typename O>
void run_for_weight(const at::Tensor& x, const at::Tensor& w,
                    const std::optional<at::Tensor>& bias, at::Tensor& out) {
  switch (w.scalar_type()) {
    case at::kFloat: return run<float, O>(x, w, bias, out);
    case at::kBFloat16: return run<c10::BFloat16, O>(x, w, bias, out);
    case at::kHalf: return run<c10::Half, O>(x, w, bias, out);
    default: TORCH_CHECK(false, "dense_rows takes a float32, bfloat16 or float16 w, not ",
                         w.scalar_type());
  }
}

at::Tensor dense_rows(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "dense_rows runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "x must be [T, K] and w [N, K], for the same K");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "x's rows and w must be contiguous");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == w.size(0)),
              "bias must be [N]");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: run_for_weight<float>(x, w, bias, out); break;
    case at::kBFloat16: run_for_weight<c10::BFloat16>(x, w, bias, out); break;
    case at::kHalf: run_for_weight<c10::Half>(x, w, bias, out); break;
    default: TORCH_CHECK(false, "dense_rows takes a float32, bfloat16 or float16 x, not ",
                         x.scalar_type());
  }
  return out;
}

// Whether bf16 rows by a bf16 w run through vdpbf16ps (built for a CPU with AVX512-BF16); the
// float path, which widens both, lost to oneDNN on matrices past L2 (layers/quant.py asks).
bool dense_rows_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpilot, m) {
  m.def("dense_rows(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("dense_rows_bf16_dot() -> bool", &dense_rows_bf16_dot);
}

TORCH_LIBRARY_IMPL(kvpilot, CPU, m) { m.impl("dense_rows", &dense_rows); }
