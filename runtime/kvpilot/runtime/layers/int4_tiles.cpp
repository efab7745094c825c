// A GPTQ, AWQ or compressed-tensors int4 matrix, as the checkpoint packs it, written into the
// tiles of torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) in one pass at load
// (`store_words` in packed_int4.py). The same bytes as packed_int4.words_cpu_tiles's tensor ops,
// which take a dozen passes over the matrix and a temporary for most of them: in a fresh
// process, as a pod's start is, every temporary's pages are faulted in anew, and writing tiles
// was two thirds of a 245 M GPTQ or AWQ checkpoint's start.
//
// The tiles: [tiles, padded_in, half] bytes, tile_rows = 2 * half output rows each; byte j of a
// tile's line k holds input feature k of the tile's row j in its low nibble and of row j + half
// in its high one; lines past the matrix's input features hold kPadding (zero weights).
//
// Registered as torch.ops.kvpilot.int4_tiles beside paged_decode_attention (one library, built
// by paged_kernel.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr uint8_t kPadding = 0x88;  // two values of 8: (8 - 8) * scale + zero, a zero weight

struct Shape {
  int64_t tile_rows, half, padded_in, in_features;
};

void pad_lines(uint8_t* tile, const Shape& s) {
  std::memset(tile + s.in_features * s.half, kPadding, (s.padded_in - s.in_features) * s.half);
}

// Input-packed words (GPTQ's qweight [in / 8, out], compressed-tensors' weight_packed
// transposed): feature 8w + k of column c in nibble k of words[w, c], at w * s0 + c * s1.
struct InputPacked {
  const int32_t* words;
  int64_t word_rows, s0, s1;
  const int64_t* columns;  // the stored order of the outputs, or null: as they stand
  const int64_t* order;    // input feature of each line (act-order), or null: line k is k
};

// The tile's words gathered input-major and contiguous, scratch[w * tile_rows + j], whatever
// the memory order and column order: the line loop then reads rows of the cache's words.
void gather_tile_words(const InputPacked& m, int64_t first_row, int64_t tile_rows,
                       int32_t* scratch) {
  if (m.columns == nullptr && m.s1 == 1) {
    for (int64_t w = 0; w < m.word_rows; ++w)
      std::memcpy(scratch + w * tile_rows, m.words + w * m.s0 + first_row, tile_rows * 4);
  } else if (m.columns == nullptr && m.s0 == 1) {  // output-major memory: a transpose
    for (int64_t j = 0; j < tile_rows; ++j) {
      const int32_t* column = m.words + (first_row + j) * m.s1;
      for (int64_t w = 0; w < m.word_rows; ++w) scratch[w * tile_rows + j] = column[w];
    }
  } else {
    for (int64_t w = 0; w < m.word_rows; ++w)
      for (int64_t j = 0; j < tile_rows; ++j) {
        const int64_t c = m.columns ? m.columns[first_row + j] : first_row + j;
        scratch[w * tile_rows + j] = m.words[w * m.s0 + c * m.s1];
      }
  }
}

void write_input_packed(const InputPacked& m, const Shape& s, uint8_t* tiles,
                        int64_t num_tiles) {
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> scratch(m.word_rows * s.tile_rows);
    for (int64_t t = begin; t < end; ++t) {
      gather_tile_words(m, t * s.tile_rows, s.tile_rows, scratch.data());
      uint8_t* tile = tiles + t * s.padded_in * s.half;
      for (int64_t k = 0; k < s.in_features; ++k) {
        const int64_t feature = m.order ? m.order[k] : k;
        const uint32_t* low =
            reinterpret_cast<const uint32_t*>(scratch.data()) + (feature >> 3) * s.tile_rows;
        const uint32_t* high = low + s.half;
        const int shift = static_cast<int>(feature & 7) * 4;
        uint8_t* line = tile + k * s.half;
#pragma omp simd
        for (int64_t j = 0; j < s.half; ++j)
          line[j] = static_cast<uint8_t>(((low[j] >> shift) & 0xF) |
                                         (((high[j] >> shift) & 0xF) << 4));
      }
      pad_lines(tile, s);
    }
  });
}

// x with the bits under `mask` and those `distance` bits above them traded.
inline uint64_t swap_bits(uint64_t x, int distance, uint64_t mask) {
  const uint64_t moved = ((x >> distance) ^ x) & mask;
  return x ^ moved ^ (moved << distance);
}

// Two AWQ words -> the eight line bytes of their outputs: byte m holds output m of `low` in its
// low nibble and of `high` in its high one. Pairing the words' nibbles byte by byte (the even
// nibbles, then the odd ones) gives the bytes of nibbles 0 2 4 6 1 3 5 7, which AWQ (output
// 8b + AWQ_ORDER[k] in nibble k, AWQ_ORDER = 0 2 4 6 1 3 5 7)
// fills with outputs 0 4 1 5 2 6 3 7; two byte swaps put them in output order: byte index
// (p, b1, b0) goes to (b0, p, b1): a dozen word operations for eight bytes.
inline uint64_t awq_line_bytes(uint32_t low, uint32_t high) {
  constexpr uint32_t kNibbles = 0x0F0F0F0F;
  const uint32_t even = (low & kNibbles) | ((high & kNibbles) << 4);
  const uint32_t odd = ((low >> 4) & kNibbles) | (high & ~kNibbles);
  uint64_t bytes = even | (static_cast<uint64_t>(odd) << 32);
  bytes = swap_bits(bytes, 8, 0x0000FF000000FF00ULL);   // (p, b1, b0) -> (p, b0, b1)
  return swap_bits(bytes, 16, 0x00000000FFFF0000ULL);  // -> (b0, p, b1)
}

// AWQ's qweight [in, out / 8], row k at k * row_stride (a tensor-parallel rank's columns are a
// slice of the rows): line k of every tile comes from row k's words alone, eight outputs to a
// word, so each row is read once, in memory order, and its lines written tile by tile (a tile
// at a time read each row's few words for it: twice as long on a 2816 x 1024 matrix).
void write_awq(const int32_t* words, int64_t row_stride, const Shape& s, uint8_t* tiles,
               int64_t num_tiles) {
  const int64_t words_per_half = s.half / 8, tile_bytes = s.padded_in * s.half;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = 0; k < s.in_features; ++k) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(words) + k * row_stride;
      for (int64_t t = begin; t < end; ++t) {
        const uint32_t* low = row + t * 2 * words_per_half;
        const uint32_t* high = low + words_per_half;
        uint8_t* line = tiles + t * tile_bytes + k * s.half;
        for (int64_t w = 0; w < words_per_half; ++w) {
          const uint64_t bytes = awq_line_bytes(low[w], high[w]);
          std::memcpy(line + 8 * w, &bytes, 8);
        }
      }
    }
    for (int64_t t = begin; t < end; ++t) pad_lines(tiles + t * tile_bytes, s);
  });
}

void check_index(const std::optional<at::Tensor>& index, int64_t size, int64_t bound,
                 const char* name) {
  if (!index) return;
  TORCH_CHECK(index->scalar_type() == at::kLong && index->dim() == 1 && index->is_contiguous() &&
                  index->numel() == size,
              name, " must be contiguous int64 [", size, "]");
  const int64_t* values = index->data_ptr<int64_t>();
  for (int64_t i = 0; i < size; ++i)
    TORCH_CHECK(values[i] >= 0 && values[i] < bound, name, "[", i, "] = ", values[i],
                " is outside 0..", bound - 1);
}

// words: int32, GPTQ's input-packed [in / 8, out] (any strides) or, with awq, AWQ's [in, out / 8]
// (each row contiguous); columns: int64 [out], the stored order of the outputs (input-packed only);
// order: int64 [in_features], the input feature of each line (act-order; input-packed only);
// tiles: uint8 [out / tile_rows, padded_in, tile_rows / 2], contiguous, written whole.
void int4_tiles(const at::Tensor& words, const std::optional<at::Tensor>& columns,
                const std::optional<at::Tensor>& order, int64_t in_features, bool awq,
                at::Tensor& tiles) {
  TORCH_CHECK(words.device().is_cpu() && words.scalar_type() == at::kInt && words.dim() == 2,
              "words must be int32 [rows, columns] on CPU");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.is_contiguous(),
              "tiles must be contiguous uint8 [tiles, padded_in, half]");
  const int64_t num_tiles = tiles.size(0), half = tiles.size(2);
  const Shape s{2 * half, half, tiles.size(1), in_features};
  const int64_t outputs = awq ? words.size(1) * 8 : words.size(1);
  TORCH_CHECK(half % 8 == 0 && num_tiles * s.tile_rows == outputs, "tiles of ", s.tile_rows,
              " rows cannot hold ", outputs, " outputs");
  const int64_t feature_bound = awq ? words.size(0) : words.size(0) * 8;
  TORCH_CHECK(in_features <= s.padded_in && in_features <= feature_bound, "in_features ",
              in_features, " exceeds the words' ", feature_bound, " or the tiles' ", s.padded_in);
  uint8_t* out = tiles.data_ptr<uint8_t>();
  if (awq) {
    TORCH_CHECK(!columns && !order, "AWQ's words take no column or input order");
    TORCH_CHECK(words.stride(1) == 1, "AWQ's words must be contiguous along a row");
    write_awq(words.data_ptr<int32_t>(), words.stride(0), s, out, num_tiles);
    return;
  }
  check_index(columns, outputs, outputs, "columns");
  check_index(order, in_features, feature_bound, "order");
  const InputPacked m{words.data_ptr<int32_t>(), words.size(0), words.stride(0), words.stride(1),
                      columns ? columns->data_ptr<int64_t>() : nullptr,
                      order ? order->data_ptr<int64_t>() : nullptr};
  write_input_packed(m, s, out, num_tiles);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpilot, m) {
  m.def(
      "int4_tiles(Tensor words, Tensor? columns, Tensor? order, int in_features, bool awq, "
      "Tensor(a!) tiles) -> ()");
}

TORCH_LIBRARY_IMPL(kvpilot, CPU, m) { m.impl("int4_tiles", &int4_tiles); }
