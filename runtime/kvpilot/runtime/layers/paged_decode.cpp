// Decode attention that reads the paged KV cache in place, on CPU (`--attention-backend paged`).
//
// One query token per row: each row (a sequence's decode, or one of its speculative proposals)
// walks its block table; each block's keys and values, all heads, are read once, in memory
// order, straight from the pool (never copied into a padded batch), and folded into a running
// softmax per query head (the online softmax of FlashAttention), in float. With AVX-512 the 16
// scores of a block are summed as one register (`lane_sums`), with AVX512-BF16 a bf16 cache's
// keys are multiplied without conversion (`block_scores_bf16`), and where the sums of all query
// heads sharing a KV head fit in registers each value row is read from the pool and converted
// once for all of them (`accumulate_group`); other CPUs and head sizes take plain loops the
// compiler vectorises. Rows run in parallel on torch's threads; the output is in
// the query's dtype.
//
// Built at first use by paged_kernel.py (torch.utils.cpp_extension: -O3 -march=native, and
// -ffast-math so exp vectorises) and registered as torch.ops.kvpilot.paged_decode_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
// bf16 is the top half of a float: a shift the compiler vectorises, unlike the c10 operator.
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

constexpr int64_t kBlockSize = 16;  // memory.BLOCK_SIZE: a block's scores fill one AVX-512 register
// The score of a slot past the context and the running maximum before the first block: finite,
// because the kernel is built with -ffast-math (which lets the compiler vectorise exp with
// glibc's libmvec) and fast math may assume no infinities. exp(kNoScore - x) is exactly 0.
constexpr float kNoScore = -1e30f;

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
  const bool listed = group == 1 || group == 2 || group == 4 || group == 8;
  return D > 0 && D % 16 == 0 && listed && group * D / 16 <= kMaxFusedRegisters;
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
  for (int64_t g = 0; g < s.group; ++g) {
    const int64_t head = kv_head * s.group + g;
    float* scores = fused ? probs[g] : probs[0];
    if constexpr (kUsesBf16Dot<T, D>) {
#if defined(__AVX512BF16__)
      block_scores_bf16<D>(&w.query_bf16[head * d], raw_keys, s.token_stride, n, scores);
#endif
    } else {
      block_scores<D>(&w.query[head * d], keys, s.token_stride, n, d, scores);
    }
    float block_max = kNoScore;
#pragma omp simd reduction(max : block_max)
    for (int64_t t = 0; t < kBlockSize; ++t) block_max = std::max(block_max, scores[t]);
    const float new_max = std::max(w.max_score[head], block_max);
    const float correction = std::exp(w.max_score[head] - new_max);  // 0 on the first block
    w.max_score[head] = new_max;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < kBlockSize; ++t) {
      scores[t] = std::exp(scores[t] - new_max);
      sum += scores[t];
    }
    w.denominator[head] = w.denominator[head] * correction + sum;
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
