// Decode attention that reads the paged KV cache in place, on CPU (`--attention-backend paged`).
//
// One query token per row: each row (a sequence's decode, or one of its speculative proposals)
// walks its block table; each block's keys and values, all heads, are read once, in memory
// order, straight from the pool (never copied into a padded batch), and folded into a running
// softmax per query head (the online softmax of FlashAttention), in float. With AVX-512 the 16
// scores of a block are summed as one register (`lane_sums`) and exponentiated inline
// (`exp_16`); with AVX512-BF16 a bf16 cache's keys are multiplied without conversion, for all
// the query heads sharing a KV head at once where their sums fit in registers
// (`group_scores_bf16`, else per head: `block_scores_bf16`), and where the sums of those heads'
// weighted values fit too, each value row is read from the pool and converted once for all of
// them (`accumulate_group`); other CPUs and head sizes take plain loops the compiler
// vectorises. Rows run in parallel on torch's threads; the output is in the query's dtype.
//
// Built at first use by paged_kernel.py (torch.utils.cpp_extension: -O3 -march=native, and
// -ffast-math so plain loops vectorise) and registered as
// torch.ops.kvpilot.paged_decode_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "float_convert.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using kvpilot_kernels::to_float;

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

constexpr int64_t kBlockSize = 16;  // memory.BLOCK_SIZE: a block's scores fill one AVX-512 register
// The score of a slot past the context and the running maximum before the first block: finite,
// because the kernel is built with -ffast-math and fast math may assume no infinities.
constexpr float kNoScore = -1e30f;
// Where exp's argument is clamped. exp(-80) is a normal float (1.8e-35), so no exp call takes
// libm's underflow path: glibc's expf falls back to scalar code per lane there (`xflowf`), which
// perf found in a sixth of the kernel's time at tiny-llama's shapes, because every first block's
// correction and every slot past the context underflowed. Weights below e^-80 of the largest are
// below float's resolution of the sum either way.
constexpr float kMinExponent = -80.f;

// One sequence's running state for all its query heads, reused across the sequences a thread
// runs, and the block being read, keys and values of all heads, converted to float.
struct Scratch {
  std::vector<float> query, acc, max_score, denominator, keys, values;
  std::vector<uint16_t> query_bf16;  // the scaled query rounded to bf16, for the bf16 dot product
  Scratch(int64_t num_heads, int64_t block_elements, int64_t head_dim)
      : query(num_heads * head_dim), acc(num_heads * head_dim), max_score(num_heads),
        denominator(num_heads), keys(block_elements), values(block_elements),
        query_bf16(num_heads * head_dim) {}
};

struct Shapes {
  int64_t num_heads, head_dim, num_kv_heads, group, table_width;
  int64_t q_seq_stride, q_head_stride, token_stride, block_stride;
};

// The block's scores for one query head: scores[t] = query . key t for t < n, kNoScore past the
// context. With AVX-512 and a head size that is a multiple of 16, each key's products stay in a
// register and the 16 registers are summed together by a transpose-and-add tree (`lane_sums`):
// 45 shuffles and adds for 16 dot products instead of a horizontal sum each.
#if defined(__AVX512F__)
inline __m512 lane_sums(__m512 v[kBlockSize]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of 4 vectors, in order
    const __m512d ab = _mm512_castps_pd(pairs[2 * i]), cd = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  }
  for (int i = 0; i < 2; ++i) {  // add 128-bit lanes 0+1 and 2+3 of two quads
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}
#endif

template <int64_t D>
inline void block_scores(const float* query, const float* keys, int64_t token_stride, int64_t n,
                         int64_t d, float* scores) {
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 16 == 0) {
    constexpr int kVectors = D / 16;
    __m512 q[kVectors];
    for (int v = 0; v < kVectors; ++v) q[v] = _mm512_loadu_ps(query + 16 * v);
    __m512 products[kBlockSize];
    for (int64_t t = 0; t < kBlockSize; ++t) {
      products[t] = _mm512_setzero_ps();
      if (t < n) {
        for (int v = 0; v < kVectors; ++v) {
          const __m512 key = _mm512_loadu_ps(keys + t * token_stride + 16 * v);
          products[t] = _mm512_fmadd_ps(q[v], key, products[t]);
        }
      }
    }
    const __mmask16 inside = static_cast<__mmask16>((1u << n) - 1);
    _mm512_storeu_ps(scores, _mm512_mask_blend_ps(inside, _mm512_set1_ps(kNoScore),
                                                  lane_sums(products)));
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) scores[t] = dot(query, keys + t * token_stride, d);
  for (int64_t t = n; t < kBlockSize; ++t) scores[t] = kNoScore;  // past the context
}

// With AVX512-BF16 the keys of a bf16 cache need no conversion: vdpbf16ps multiplies pairs of
// bf16 and adds them in float, so a 64-wide head is 2 instructions a key. The query is rounded to
// bf16 once per sequence (after scaling), as torch's bf16 matmuls take their inputs. Measured in
// the engine at 64 sequences: the compute-bound model's attention 20.1 -> 18.2 ms a step (heads
// of 64); tiny-llama's (heads of 32) unchanged within the noise.
template <typename T, int64_t D>
constexpr bool kUsesBf16Dot =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16> && D > 0 && D % 32 == 0;
#else
    false;
#endif

#if defined(__AVX512BF16__)
template <int64_t D>
inline void block_scores_bf16(const uint16_t* query, const c10::BFloat16* keys,
                              int64_t token_stride, int64_t n, float* scores) {
  constexpr int kVectors = D / 32;
  __m512bh q[kVectors];
  for (int v = 0; v < kVectors; ++v) q[v] = (__m512bh)_mm512_loadu_si512(query + 32 * v);
  __m512 products[kBlockSize];
  for (int64_t t = 0; t < kBlockSize; ++t) {
    products[t] = _mm512_setzero_ps();
    if (t < n) {
      for (int v = 0; v < kVectors; ++v) {
        const __m512bh key = (__m512bh)_mm512_loadu_si512(keys + t * token_stride + 32 * v);
        products[t] = _mm512_dpbf16_ps(products[t], key, q[v]);
      }
    }
  }
  const __mmask16 inside = static_cast<__mmask16>((1u << n) - 1);
  _mm512_storeu_ps(scores, _mm512_mask_blend_ps(inside, _mm512_set1_ps(kNoScore),
                                                lane_sums(products)));
}
#endif

#if defined(__AVX512F__)
// exp of 16 floats, inline: 2^k * e^r with k = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its
// Taylor series to r^6 (relative error ~1e-7, a float's), 2^k applied by vscalefps. libmvec's
// expf costs a call per block and head, and takes the scalar path for any lane below ~-87.
inline __m512 exp_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kMinExponent));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, k);
}
#endif

inline float block_max(const float* scores) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(_mm512_loadu_ps(scores));
#else
  float most = kNoScore;
#pragma omp simd reduction(max : most)
  for (int64_t t = 0; t < kBlockSize; ++t) most = std::max(most, scores[t]);
  return most;
#endif
}

// scores[t] = exp(scores[t] - max) for the n slots inside the context, 0 past it; returns their
// sum, the block's share of the softmax denominator.
inline float exponentiate(float* scores, float max, int64_t n) {
#if defined(__AVX512F__)
  const __mmask16 inside = static_cast<__mmask16>((1u << n) - 1);
  const __m512 shifted = _mm512_sub_ps(_mm512_loadu_ps(scores), _mm512_set1_ps(max));
  const __m512 weights = _mm512_maskz_mov_ps(inside, exp_16(shifted));
  _mm512_storeu_ps(scores, weights);
  return _mm512_reduce_add_ps(weights);
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < kBlockSize; ++t) {
    scores[t] = t < n ? std::exp(std::max(scores[t] - max, kMinExponent)) : 0.f;
    sum += scores[t];
  }
  return sum;
#endif
}

#if defined(__AVX512BF16__)
// Transposes 16 rows of 16 32-bit elements in registers: afterwards r[e] lane t holds what was
// element e of row t. Three rounds of unpacks and lane shuffles, 64 instructions.
inline void transpose_16x16(__m512i r[16]) {
  __m512i pairs[16];
  // per 128-bit lane L: elements 4L, 4L+1 (lo) and 4L+2, 4L+3 (hi) of two rows, interleaved
  for (int i = 0; i < 8; ++i) {
    pairs[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i columns[16];  // columns[4i + k] lane L: element 4L + k of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    for (int half = 0; half < 2; ++half) {
      const __m512i a = pairs[4 * i + half], b = pairs[4 * i + 2 + half];
      columns[4 * i + 2 * half] = _mm512_unpacklo_epi64(a, b);
      columns[4 * i + 2 * half + 1] = _mm512_unpackhi_epi64(a, b);
    }
  }
  for (int k = 0; k < 4; ++k) {  // element 4L + k gathers lane L of columns k, 4 + k, 8 + k, 12 + k
    const __m512i ab_lo = _mm512_shuffle_i32x4(columns[k], columns[4 + k], 0x44);
    const __m512i ab_hi = _mm512_shuffle_i32x4(columns[k], columns[4 + k], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(columns[8 + k], columns[12 + k], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(columns[8 + k], columns[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
}

// The block's scores for all G query heads sharing a KV head at once: the keys, 32 bf16 a token
// per register, are transposed so that a register holds one pair of dimensions for the 16
// tokens; each head then adds pair by pair (vdpbf16ps with its two query values broadcast) into
// one register that ends as its 16 scores. The transpose is paid once for the G heads, where
// block_scores_bf16 reduces 16 registers across lanes (lane_sums) for every head: at tiny-llama's
// shapes (G = 4, heads of 32) 128 instructions per block and KV head instead of 244.
template <int64_t D, int G>
inline void group_scores_bf16(const uint16_t* queries, const c10::BFloat16* keys,
                              int64_t token_stride, int64_t n, float (*scores)[kBlockSize]) {
  __m512 sums[G];
  for (int g = 0; g < G; ++g) sums[g] = _mm512_setzero_ps();
  for (int64_t chunk = 0; chunk < D; chunk += 32) {
    __m512i rows[kBlockSize];
    for (int64_t t = 0; t < kBlockSize; ++t) {  // slots past the context read as zeros
      rows[t] = t < n ? _mm512_loadu_si512(keys + t * token_stride + chunk)
                      : _mm512_setzero_si512();
    }
    transpose_16x16(rows);
    for (int pair = 0; pair < 16; ++pair) {
      for (int g = 0; g < G; ++g) {
        uint32_t both;
        std::memcpy(&both, queries + g * D + chunk + 2 * pair, sizeof(both));
        sums[g] = _mm512_dpbf16_ps(sums[g], (__m512bh)rows[pair],
                                   (__m512bh)_mm512_set1_epi32(static_cast<int>(both)));
      }
    }
  }
  const __mmask16 inside = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < G; ++g) {
    _mm512_storeu_ps(scores[g], _mm512_mask_blend_ps(inside, _mm512_set1_ps(kNoScore), sums[g]));
  }
}
#endif

// The query heads per KV head that the grouped paths take as a template argument (the cases of
// all_scores_bf16 and accumulate_fused), so that their sums stay in registers.
inline bool is_templated_group(int64_t group) {
  return group == 1 || group == 2 || group == 4 || group == 8;
}

// Whether all_scores_bf16 computes a group's scores together (else block_scores_bf16, per head).
template <typename T, int64_t D>
inline bool scores_by_group(int64_t group) {
  return kUsesBf16Dot<T, D> && is_templated_group(group);
}

template <int64_t D>
inline void all_scores_bf16(int64_t group, const uint16_t* queries, const c10::BFloat16* keys,
                            int64_t token_stride, int64_t n, float (*scores)[kBlockSize]) {
#if defined(__AVX512BF16__)
  switch (group) {  // the group size a template argument: the sums stay in registers
    case 1: return group_scores_bf16<D, 1>(queries, keys, token_stride, n, scores);
    case 2: return group_scores_bf16<D, 2>(queries, keys, token_stride, n, scores);
    case 4: return group_scores_bf16<D, 4>(queries, keys, token_stride, n, scores);
    case 8: return group_scores_bf16<D, 8>(queries, keys, token_stride, n, scores);
    default: break;
  }
#endif
  TORCH_CHECK(false, "paged attention: no grouped scores for group ", group, " and head size ", D);
}

// The most query heads per KV head whose block probabilities fold_head keeps at once (the fused
// path's limit; unfused, one head's at a time).
constexpr int64_t kMaxGroupProbs = 8;

#if defined(__AVX512F__)
// acc = acc * correction + sum over t < n of scores[t] * values row t, with the accumulator held
// in registers: written as a plain loop over a float[D], the compiler stored it to the stack
// after every token's multiply-add (the kernel's hottest instructions, by perf).
template <int64_t D>
inline void accumulate_values(const float* scores, const float* values, int64_t token_stride,
                              int64_t n, float correction, float* acc) {
  constexpr int kVectors = D / 16;
  __m512 sum[kVectors];
  const __m512 scale = _mm512_set1_ps(correction);
  for (int v = 0; v < kVectors; ++v) sum[v] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * v), scale);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 p = _mm512_set1_ps(scores[t]);
    const float* row = values + t * token_stride;
    for (int v = 0; v < kVectors; ++v) {
      sum[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(row + 16 * v), sum[v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(acc + 16 * v, sum[v]);
}
#endif

// One query head's weighted values from the float scratch: acc = acc * correction + sum over
// t < n of scores[t] * values row t.
template <int64_t D>
inline void accumulate_head(const float* scores, const float* values, int64_t token_stride,
                            int64_t n, int64_t d, float correction, float* acc) {
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 16 == 0) {
    accumulate_values<D>(scores, values, token_stride, n, correction, acc);
    return;
  }
#endif
  if constexpr (D > 0) {
    float local[D];
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) local[i] = acc[i] * correction;
    for (int64_t t = 0; t < n; ++t) {
      const float p = scores[t];
      const float* row = values + t * token_stride;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) local[i] += p * row[i];
    }
    std::memcpy(acc, local, sizeof(local));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
    for (int64_t t = 0; t < n; ++t) {
      const float p = scores[t];
      const float* row = values + t * token_stride;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] += p * row[i];
    }
  }
}

// The query heads of a group share their KV head's values: with the accumulators of all of them
// in registers (group x D / 16 of them, at most kMaxFusedRegisters), each value row is read
// straight from the pool and converted once, then multiplied into every head's sum. Unfused, the
// block's values were converted into a float scratch first and read back once per head.
constexpr int64_t kMaxFusedGroup = 8;
constexpr int64_t kMaxFusedRegisters = 16;

#if defined(__AVX512F__)
template <typename T>
inline __m512 load_16(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // bf16: the top half of a float
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
}

template <typename T, int64_t D, int64_t G>
inline void accumulate_group(const float (*probs)[kBlockSize], const float* corrections,
                             const T* values, int64_t token_stride, int64_t n, float* acc) {
  constexpr int kVectors = D / 16;
  __m512 sum[G][kVectors];
  for (int g = 0; g < G; ++g) {
    const __m512 scale = _mm512_set1_ps(corrections[g]);
    for (int v = 0; v < kVectors; ++v) {
      sum[g][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * v), scale);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* row = values + t * token_stride;
    __m512 value[kVectors];
    for (int v = 0; v < kVectors; ++v) value[v] = load_16(row + 16 * v);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g][t]);
      for (int v = 0; v < kVectors; ++v) sum[g][v] = _mm512_fmadd_ps(p, value[v], sum[g][v]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(acc + g * D + 16 * v, sum[g][v]);
  }
}

// Whether accumulate_group takes a KV head's values (else accumulate_values, per head).
template <int64_t D>
inline bool fuses_group(int64_t group) {
  return D > 0 && D % 16 == 0 && is_templated_group(group) && group * D / 16 <= kMaxFusedRegisters;
}

template <typename T, int64_t D>
inline void accumulate_fused(int64_t group, const float (*probs)[kBlockSize],
                             const float* corrections, const T* values, int64_t token_stride,
                             int64_t n, float* acc) {
  if constexpr (D > 0 && D % 16 == 0) {
    switch (group) {  // the group size a template argument: the sums stay in registers
      case 1: return accumulate_group<T, D, 1>(probs, corrections, values, token_stride, n, acc);
      case 2: return accumulate_group<T, D, 2>(probs, corrections, values, token_stride, n, acc);
      case 4:
        if constexpr (4 * D / 16 <= kMaxFusedRegisters) {
          return accumulate_group<T, D, 4>(probs, corrections, values, token_stride, n, acc);
        }
        break;
      case 8:
        if constexpr (8 * D / 16 <= kMaxFusedRegisters) {
          return accumulate_group<T, D, 8>(probs, corrections, values, token_stride, n, acc);
        }
        break;
      default:
        break;
    }
  }
  TORCH_CHECK(false, "paged attention: no fused path for group ", group, " and head size ", D);
}
#endif

// One query head's scores for the block, where its group's are not computed together.
template <typename T, int64_t D>
inline void head_scores(const T* raw_keys, const float* keys, int64_t head, int64_t n,
                        const Shapes& s, const Scratch& w, float* scores) {
  const int64_t d = D > 0 ? D : s.head_dim;
  if constexpr (kUsesBf16Dot<T, D>) {
#if defined(__AVX512BF16__)
    block_scores_bf16<D>(&w.query_bf16[head * d], raw_keys, s.token_stride, n, scores);
#endif
  } else {
    block_scores<D>(&w.query[head * d], keys, s.token_stride, n, d, scores);
  }
}

// One KV head's share of a block of `n` tokens for the `group` query heads sharing it: scores,
// rescale of what was accumulated so far, then the weighted values. The keys are in float in
// w.keys unless the bf16 dot product reads them from the pool (`raw_keys`); the values are read
// from the pool (`raw_values`) where the group's sums fit in registers (`fused`), else from
// w.values in float. D is the head size where it is one of the common ones (the accumulator
// then stays in registers), 0 for any other (read from `s`).
template <typename T, int64_t D>
void fold_head(const T* raw_keys, const T* raw_values, bool fused, int64_t n, int64_t kv_head,
               const Shapes& s, Scratch& w) {
  const int64_t d = D > 0 ? D : s.head_dim;
  const float* keys = &w.keys[kv_head * d];
  const float* values = &w.values[kv_head * d];
  float probs[kMaxGroupProbs][kBlockSize];
  float corrections[kMaxGroupProbs];
  const bool grouped = scores_by_group<T, D>(s.group);
  if constexpr (kUsesBf16Dot<T, D>) {
    if (grouped) all_scores_bf16<D>(s.group, &w.query_bf16[kv_head * s.group * d], raw_keys,
                                    s.token_stride, n, probs);
  }
  for (int64_t g = 0; g < s.group; ++g) {
    const int64_t head = kv_head * s.group + g;
    float* scores = fused || grouped ? probs[g] : probs[0];
    if (!grouped) head_scores<T, D>(raw_keys, keys, head, n, s, w, scores);
    const float new_max = std::max(w.max_score[head], block_max(scores));
    // ~0 on the first block, where it scales an accumulator and a denominator of 0
    const float correction = std::exp(std::max(w.max_score[head] - new_max, kMinExponent));
    w.max_score[head] = new_max;
    w.denominator[head] = w.denominator[head] * correction + exponentiate(scores, new_max, n);
    if (fused) {
      corrections[g] = correction;
      continue;
    }
    accumulate_head<D>(scores, values, s.token_stride, n, d, correction, &w.acc[head * d]);
  }
#if defined(__AVX512F__)
  if (fused) {
    accumulate_fused<T, D>(s.group, probs, corrections, raw_values, s.token_stride, n,
                           &w.acc[kv_head * s.group * d]);
  }
#endif
}

// Asks for `n` elements from `start` on, a cache line at a time: the next block's keys where the
// bf16 dot product reads them from the pool unconverted.
template <typename T>
inline void prefetch_lines(const T* start, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(start);
  const int64_t num_bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t at = 0; at < num_bytes; at += 64) __builtin_prefetch(bytes + at);
}

// `n` elements of a block into float, one cache line at a time, asking for the same line of the
// next block (`next`, or null) as it goes, so it arrives while this block is computed: blocks lie
// anywhere in the pool, where the hardware prefetcher, which stops at page boundaries, starts cold.
template <typename T>
inline void load_block(const T* src, const T* next, float* dst, int64_t n) {
  constexpr int64_t kPerLine = 64 / sizeof(T);
  int64_t at = 0;
  for (; at + kPerLine <= n; at += kPerLine) {  // whole lines: a fixed trip count, unrolled
    if (next != nullptr) __builtin_prefetch(next + at);
#pragma omp simd
    for (int64_t i = at; i < at + kPerLine; ++i) dst[i] = to_float(src[i]);
  }
  for (; at < n; ++at) dst[at] = to_float(src[at]);
}

// One sequence, all heads: block by block, every KV head of a block in turn, so the pool is read
// one whole block (all heads, contiguous) at a time.
template <typename T, int64_t D>
void attend(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t length,
            float scale, const Shapes& s, Scratch& w, T* out) {
  const int64_t d = D > 0 ? D : s.head_dim;
  for (int64_t head = 0; head < s.num_heads; ++head) {
    const T* row = q + head * s.q_head_stride;
    for (int64_t i = 0; i < d; ++i) w.query[head * d + i] = to_float(row[i]) * scale;
    if constexpr (kUsesBf16Dot<T, D>) {
      for (int64_t i = 0; i < d; ++i) {
        w.query_bf16[head * d + i] = c10::BFloat16(w.query[head * d + i]).x;
      }
    }
  }
#if defined(__AVX512F__)
  const bool fused = fuses_group<D>(s.group);
#else
  const bool fused = false;
#endif
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.max_score.begin(), w.max_score.end(), kNoScore);
  std::fill(w.denominator.begin(), w.denominator.end(), 0.f);
  for (int64_t start = 0, block = 0; start < length; start += kBlockSize, ++block) {
    const int64_t offset = static_cast<int64_t>(table[block]) * s.block_stride;
    const int64_t n = std::min(kBlockSize, length - start);
    const bool has_next = start + kBlockSize < length;
    const int64_t next = has_next ? static_cast<int64_t>(table[block + 1]) * s.block_stride : 0;
    // The block's first n tokens, all heads, are one contiguous run in the pool: read in order.
    if constexpr (kUsesBf16Dot<T, D>) {
      if (has_next) prefetch_lines(k_cache + next, s.block_stride);
    } else {
      load_block(k_cache + offset, has_next ? k_cache + next : nullptr, w.keys.data(),
                 n * s.token_stride);
    }
    if (fused) {
      if (has_next) prefetch_lines(v_cache + next, s.block_stride);
    } else {
      load_block(v_cache + offset, has_next ? v_cache + next : nullptr, w.values.data(),
                 n * s.token_stride);
    }
    for (int64_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head) {
      fold_head<T, D>(k_cache + offset + kv_head * d, v_cache + offset + kv_head * d, fused, n,
                      kv_head, s, w);
    }
  }
  for (int64_t head = 0; head < s.num_heads; ++head) {
    const float inverse = 1.f / w.denominator[head];
    for (int64_t i = 0; i < d; ++i) {
      out[head * d + i] = static_cast<T>(w.acc[head * d + i] * inverse);
    }
  }
}

template <typename T, int64_t D>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const int32_t* tables, const int32_t* lengths, float scale, const Shapes& s,
                at::Tensor& out) {
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, q.size(0), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(s.num_heads, s.block_stride, s.head_dim);
    for (int64_t seq = begin; seq < end; ++seq) {
      attend<T, D>(q_data + seq * s.q_seq_stride, k_data, v_data, tables + seq * s.table_width,
                   lengths[seq], scale, s, scratch, out_data + seq * s.num_heads * s.head_dim);
    }
  });
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
         at::Tensor& out) {
  const int64_t num_kv_heads = k_cache.size(2), head_dim = q.size(2);
  const Shapes s{q.size(1),    head_dim,    num_kv_heads, q.size(1) / num_kv_heads,
                 block_tables.size(1),      q.stride(0),  q.stride(1),
                 num_kv_heads * head_dim,   kBlockSize * num_kv_heads * head_dim};
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lengths = context_lens.data_ptr<int32_t>();
  const float scale_f = static_cast<float>(scale);
  switch (head_dim) {
    case 32: attend_all<T, 32>(q, k_cache, v_cache, tables, lengths, scale_f, s, out); break;
    case 64: attend_all<T, 64>(q, k_cache, v_cache, tables, lengths, scale_f, s, out); break;
    case 128: attend_all<T, 128>(q, k_cache, v_cache, tables, lengths, scale_f, s, out); break;
    default: attend_all<T, 0>(q, k_cache, v_cache, tables, lengths, scale_f, s, out);
  }
}

// q: [B, H, D] (rows may be strided; D contiguous); k_cache, v_cache: [num_blocks, BS, H_kv, D]
// contiguous, q's dtype; block_tables: [B, W] int32, a sequence's blocks first; context_lens:
// [B] int32, 1 <= length <= W * BS. Returns [B, H, D], contiguous.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with D contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, BS, H_kv, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "the KV cache must be stored in the query's dtype");
  TORCH_CHECK(k_cache.size(1) == kBlockSize, "blocks must hold ", kBlockSize, " tokens");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and H must be a multiple of H_kv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && block_tables.size(0) == q.size(0),
              "block_tables must be contiguous int32 [B, W]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens must be contiguous int32 [B]");
  // Every block a sequence reads is checked once here, so no task reads outside the pool.
  const int64_t block_size = k_cache.size(1), width = block_tables.size(1);
  const int32_t* lengths = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < context_lens.numel(); ++seq) {
    TORCH_CHECK(lengths[seq] >= 1 && lengths[seq] <= width * block_size, "context length ",
                lengths[seq], " outside 1..", width * block_size, " (the block table's width)");
    for (int64_t block = 0; block * block_size < lengths[seq]; ++block) {
      const int32_t id = tables[seq * width + block];
      TORCH_CHECK(id >= 0 && id < k_cache.size(0), "block id ", id, " outside the pool of ",
                  k_cache.size(0), " blocks");
    }
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvpilot, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpilot, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
