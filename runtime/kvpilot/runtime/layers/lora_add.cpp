// Multi-LoRA's delta for a decode-like step's rows, on CPU: each row through its own adapter
// slot's A and B, added into the base projection's output in place (layers/lora.py,
// `LoraStack.add_delta`; Punica's BGMV, two rows of a slot at a time).
//
// The tensor-op form of the same step (gather the rows, pad the groups, two batched matmuls, a
// gather of each piece's sub-module, drop the padding, index_add) is about twenty aten ops per
// projection, and at tiny-llama's sizes their dispatch, not their arithmetic, was what LoRA added
// to a decode step (bench/lora_step_ops.py: 596 more ops, 3.2 ms on a 3.2 ms step). Here a
// projection is one op (24 more ops, 1.2 ms, docs/benchmarks.md); the products are summed in
// float and rounded once, into the output.
//
// Shapes (layers/lora.py): x [T, in], out [T, out] (rows contiguous); a [S, in, k*R], the k
// sub-modules' A side by side; b [S, P, R, w], the output cut in P pieces of width w, piece p
// read from sub-module piece_modules[p]'s R columns of u = x @ a; rows [M] the rows that run an
// adapter, grouped by slot: group g is rows[starts[g]:starts[g + 1]], of slot slots[g].
//
// Registered as torch.ops.kvpilot.lora_add_ beside paged_decode_attention (one library, built
// by paged_kernel.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "float_convert.h"
#include "float_lanes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using kvpilot_kernels::Floats;
using kvpilot_kernels::from_float;
using kvpilot_kernels::kLanes;
using kvpilot_kernels::load_first;
using kvpilot_kernels::load_lanes;
using kvpilot_kernels::to_float;

struct Dims {
  int64_t in, width_a, rank, pieces, piece_width;  // width_a = k * R
};

// Two rows of one slot at a time: each line of A or B read once for both, and each row's sum
// split in two interleaved sums (odd and even i), four independent chains of multiply-adds
// (one chain waited on each product's latency). Named: an array indexed in a loop the
// compiler does not unroll stays in memory (shrink_blocks' and expand_blocks' are unrolled).
struct Sums {
  Floats first, second;
};

// start + sum over i < count of scale[i] * lines[i * stride : + n], for two rows' scales.
template <typename S, typename T>
inline Sums dot_lanes(const S* scale_a, const S* scale_b, const T* lines, int64_t stride,
                      int64_t count, int64_t n, Sums start) {
  Floats a0 = start.first, a1 = {}, b0 = start.second, b1 = {};
  int64_t i = 0;
  for (; i + 2 <= count; i += 2) {
    const Floats even = load_first(lines + i * stride, n);
    const Floats odd = load_first(lines + (i + 1) * stride, n);
    a0 += to_float(scale_a[i]) * even;
    b0 += to_float(scale_b[i]) * even;
    a1 += to_float(scale_a[i + 1]) * odd;
    b1 += to_float(scale_b[i + 1]) * odd;
  }
  if (i < count) {
    const Floats last = load_first(lines + i * stride, n);
    a0 += to_float(scale_a[i]) * last;
    b0 += to_float(scale_b[i]) * last;
  }
  return {a0 + a1, b0 + b1};
}

// shrink for a row of A of `Blocks` whole blocks (q/k/v's 48 columns, gate/up's 32 at rank 16):
// the input read once for all of them, each line of A once, 2 x Blocks sums in registers.
template <int Blocks, typename T>
void shrink_blocks(const T* x_a, const T* x_b, const T* a_slot, int64_t in, float* u_a,
                   float* u_b) {
  Floats sums_a[Blocks] = {}, sums_b[Blocks] = {};
  for (int64_t i = 0; i < in; ++i) {
    const float scale_a = to_float(x_a[i]), scale_b = to_float(x_b[i]);
    const T* line = a_slot + i * Blocks * kLanes;
#pragma GCC unroll 4
    for (int k = 0; k < Blocks; ++k) {
      const Floats values = load_lanes(line + k * kLanes);
      sums_a[k] += scale_a * values;
      sums_b[k] += scale_b * values;
    }
  }
  std::memcpy(u_a, sums_a, sizeof(sums_a));
  std::memcpy(u_b, sums_b, sizeof(sums_b));
}

// u_a, u_b [k*R] = x_a, x_b [in] @ a_slot [in, k*R], in float.
template <typename T>
void shrink(const T* x_a, const T* x_b, const T* a_slot, const Dims& d, float* u_a, float* u_b) {
  switch (d.width_a) {
    case 2 * kLanes: return shrink_blocks<2>(x_a, x_b, a_slot, d.in, u_a, u_b);
    case 3 * kLanes: return shrink_blocks<3>(x_a, x_b, a_slot, d.in, u_a, u_b);
    case 4 * kLanes: return shrink_blocks<4>(x_a, x_b, a_slot, d.in, u_a, u_b);
    default: break;  // one block (o, down) keeps four chains below; other widths by block
  }
  for (int64_t first = 0; first < d.width_a; first += kLanes) {
    const int64_t n = std::min(kLanes, d.width_a - first);
    const Sums sums = dot_lanes(x_a, x_b, a_slot + first, d.width_a, d.in, n, Sums{});
    for (int64_t l = 0; l < n; ++l) {
      u_a[first + l] = sums.first[l];
      u_b[first + l] = sums.second[l];
    }
  }
}

// Stores the sums into `n` values of each row, each value rounded once.
template <typename T>
inline void store_sums(const Sums& sums, int64_t n, T* out_a, T* out_b) {
#pragma omp simd
  for (int64_t l = 0; l < n; ++l) {
    out_a[l] = from_float<T>(sums.first[l]);
    out_b[l] = from_float<T>(sums.second[l]);
  }
}

// expand_add over kExpandBlocks whole blocks of a piece at once: each u read once for all of
// them, 2 x kExpandBlocks sums in registers over the rank.
constexpr int64_t kExpandBlocks = 4;
template <typename T>
void expand_blocks(const float* u_a, const float* u_b, const T* b_lines, int64_t stride,
                   int64_t rank, T* out_a, T* out_b) {
  Floats sums_a[kExpandBlocks], sums_b[kExpandBlocks];
#pragma GCC unroll 4
  for (int k = 0; k < kExpandBlocks; ++k) {
    sums_a[k] = load_lanes(out_a + k * kLanes);
    sums_b[k] = load_lanes(out_b + k * kLanes);
  }
  for (int64_t r = 0; r < rank; ++r) {
    const T* line = b_lines + r * stride;
#pragma GCC unroll 4
    for (int k = 0; k < kExpandBlocks; ++k) {
      const Floats values = load_lanes(line + k * kLanes);
      sums_a[k] += u_a[r] * values;
      sums_b[k] += u_b[r] * values;
    }
  }
#pragma GCC unroll 4
  for (int k = 0; k < kExpandBlocks; ++k)
    store_sums(Sums{sums_a[k], sums_b[k]}, kLanes, out_a + k * kLanes, out_b + k * kLanes);
}

// out_a, out_b [P * w] += u_a, u_b through b_slot [P, R, w], piece by piece, each value
// rounded once.
template <typename T>
void expand_add(const float* u_a, const float* u_b, const T* b_slot,
                const int64_t* piece_modules, const Dims& d, T* out_a, T* out_b) {
  constexpr int64_t span = kExpandBlocks * kLanes;
  for (int64_t p = 0; p < d.pieces; ++p) {
    const int64_t module = piece_modules[p] * d.rank, column = p * d.piece_width;
    const T* b_piece = b_slot + p * d.rank * d.piece_width;
    int64_t first = column;
    for (; first + span <= column + d.piece_width; first += span)
      expand_blocks(u_a + module, u_b + module, b_piece + first - column, d.piece_width,
                    d.rank, out_a + first, out_b + first);
    for (; first < column + d.piece_width; first += kLanes) {
      const int64_t n = std::min(kLanes, column + d.piece_width - first);
      const Sums start{load_first(out_a + first, n), load_first(out_b + first, n)};
      const Sums sums = dot_lanes(u_a + module, u_b + module, b_piece + first - column,
                                  d.piece_width, d.rank, n, start);
      store_sums(sums, n, out_a + first, out_b + first);
    }
  }
}

// Each group's rows two at a time (a group of odd size pairs its last row with a copy of
// itself, whose output goes to a spare row); groups in parallel on torch's threads.
template <typename T>
void add_rows(at::Tensor& out, const at::Tensor& x, const int64_t* rows, const int64_t* starts,
              const int64_t* slots, int64_t num_groups, const at::Tensor& a, const at::Tensor& b,
              const int64_t* piece_modules, const Dims& d) {
  T* out_data = out.data_ptr<T>();
  const T* x_data = x.data_ptr<T>();
  const T* a_data = a.data_ptr<T>();
  const T* b_data = b.data_ptr<T>();
  const int64_t out_stride = out.stride(0), x_stride = x.stride(0);
  const int64_t a_slot_size = d.in * d.width_a, b_slot_size = d.pieces * d.rank * d.piece_width;
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u_a(d.width_a), u_b(d.width_a);
    std::vector<T> spare(out.size(1));
    for (int64_t group = begin; group < end; ++group) {
      const T* a_slot = a_data + slots[group] * a_slot_size;
      const T* b_slot = b_data + slots[group] * b_slot_size;
      for (int64_t m = starts[group]; m < starts[group + 1]; m += 2) {
        const bool paired = m + 1 < starts[group + 1];
        const int64_t row_a = rows[m], row_b = paired ? rows[m + 1] : row_a;
        T* out_a = out_data + row_a * out_stride;
        T* out_b = paired ? out_data + row_b * out_stride : spare.data();
        if (!paired) std::copy(out_a, out_a + out.size(1), spare.data());
        shrink(x_data + row_a * x_stride, x_data + row_b * x_stride, a_slot, d, u_a.data(),
               u_b.data());
        expand_add(u_a.data(), u_b.data(), b_slot, piece_modules, d, out_a, out_b);
      }
    }
  });
}

void check_index(const at::Tensor& index, const char* name) {
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.dim() == 1 &&
                  index.is_contiguous(),
              name, " must be a contiguous int64 vector on CPU");
}

// Each output row is written by one task: a row listed twice would be a race.
void check_distinct(const at::Tensor& rows, int64_t num_rows) {
  std::vector<bool> seen(num_rows, false);
  const int64_t* values = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(!seen[values[i]], "rows lists row ", values[i], " twice");
    seen[values[i]] = true;
  }
}

void check_within(const at::Tensor& index, int64_t bound, const char* name) {
  const int64_t* values = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(values[i] >= 0 && values[i] < bound, name, "[", i, "] = ", values[i],
                " is outside 0..", bound - 1);
}

// out [T, out] += for each row of `rows`, x[row] @ a[slot] through b[slot] (the header says how).
void lora_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& rows,
               const at::Tensor& starts, const at::Tensor& slots, const at::Tensor& a,
               const at::Tensor& b, const at::Tensor& piece_modules) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0),
              "out [T, out] and x [T, in] must be CPU matrices of the same rows");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1, "out's and x's rows must be contiguous");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 4 && a.is_contiguous() && b.is_contiguous() &&
                  a.size(0) == b.size(0) && a.size(1) == x.size(1),
              "a must be contiguous [S, in, k*R] and b [S, P, R, w], for x's input");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && a.scalar_type() == out.scalar_type() &&
                  b.scalar_type() == out.scalar_type(),
              "out, x, a and b must be of one dtype");
  for (const auto& [index, name] : {std::pair{&rows, "rows"}, std::pair{&starts, "starts"},
                                    std::pair{&slots, "slots"},
                                    std::pair{&piece_modules, "piece_modules"}})
    check_index(*index, name);
  const Dims d{a.size(1), a.size(2), b.size(2), b.size(1), b.size(3)};
  TORCH_CHECK(d.pieces * d.piece_width == out.size(1), "b's ", d.pieces, " pieces of ",
              d.piece_width, " must make out's ", out.size(1), " columns");
  TORCH_CHECK(piece_modules.numel() == d.pieces && d.width_a % d.rank == 0,
              "piece_modules must name each piece's sub-module");
  const int64_t num_groups = slots.numel();
  TORCH_CHECK(starts.numel() == num_groups + 1, "starts must be [G + 1] for G slots");
  const int64_t* start = starts.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[num_groups] == rows.numel(),
              "starts must run from 0 to the number of rows");
  for (int64_t g = 0; g < num_groups; ++g)
    TORCH_CHECK(start[g] <= start[g + 1], "starts must not decrease");
  check_within(rows, x.size(0), "rows");
  check_distinct(rows, x.size(0));
  check_within(slots, a.size(0), "slots");
  check_within(piece_modules, d.width_a / d.rank, "piece_modules");
  const auto run = [&](auto zero) {
    add_rows<decltype(zero)>(out, x, rows.data_ptr<int64_t>(), start, slots.data_ptr<int64_t>(),
                             num_groups, a, b, piece_modules.data_ptr<int64_t>(), d);
  };
  switch (out.scalar_type()) {
    case at::kFloat: run(float(0)); break;
    case at::kBFloat16: run(c10::BFloat16(0)); break;
    case at::kHalf: run(c10::Half(0)); break;
    default: TORCH_CHECK(false, "lora_add_ runs float32, bfloat16 and float16, not ", out.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpilot, m) {
  m.def(
      "lora_add_(Tensor(a!) out, Tensor x, Tensor rows, Tensor starts, Tensor slots, Tensor a, "
      "Tensor b, Tensor piece_modules) -> ()");
}

TORCH_LIBRARY_IMPL(kvpilot, CPU, m) { m.impl("lora_add_", &lora_add_); }
