// GGUF Q4_1, Q4_1F, Q8_0 and Q8F records (the quantized kernel's layout, documented in quantized_linear.cpp, with each pair of
// steps' codes interleaved: pack_records(step_pairs=True)) dequantized into AMX weight tiles (amx_linear.cpp's
// layout): one record, 32 k values of a 16-column panel, becomes one 1 KiB tile whose row r holds, for each column
// n, the pair W[n][2r], W[n][2r + 1]. With the steps interleaved at load, row r's codes are in that order already
// (one shuffle a row less: 72 -> 66 cycles a Q4_1 tile here).
//
// Why: a decode step reads every weight once, and from memory bfloat16 costs 16 bits a weight where Q4_1 costs 5 and
// Q8_0 8.5. The bits are those of the bfloat16 weights Loom otherwise packs: gguf dequantizes to float32 as d q + m
// (d q exact, one rounding), fma(q, d, m) rounds the same exact value once, and VCVTNE2PS2BF16 rounds to nearest even
// as torch's .to(bfloat16) does (they differ only on float32 denormals and NaN, which d q + m with float16 d and m
// cannot produce: its exact value is a multiple of float16's smallest step, 2^-24).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gguf_records.h"

#if !defined(__AVX512BF16__)
#error "dequantizing into AMX tiles needs AVX512-BF16, which every AMX-BF16 CPU has"
#endif

namespace loom::amx {

// Sixteen float16 values at p as float32.
inline __m512 load_half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Per-column values v[0..15] spread to tile-row order: columns 0-7 each twice (the first 16 lanes of a tile row),
// and columns 8-15 each twice (the last 16).
inline __m512 pairs_of_low_columns(__m512 v) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), v);
}
inline __m512 pairs_of_high_columns(__m512 v) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), v);
}

// Two float32 halves of a tile row (columns 0-7's pairs, then 8-15's) rounded to bfloat16 and stored as its 64 bytes.
inline void store_tile_row(void* row, __m512 low_columns, __m512 high_columns) {
  _mm512_store_si512(row, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high_columns, low_columns)));
}

// One tile from 4-bit records: 16 scales d and offsets m (float32, one per column) and the codes, row r's 16 bytes
// being steps 2r and 2r + 1 byte by byte: byte c of a step holds column c's code (low nibble) and column c + 8's
// (high), so byte j's low nibble is the j-th weight of the tile row's first half and its high nibble the j-th of the
// second.
inline void nibble_tile(const uint8_t* codes, __m512 d, __m512 m, void* tile) {
  const __m512 d_low = pairs_of_low_columns(d), d_high = pairs_of_high_columns(d);
  const __m512 m_low = pairs_of_low_columns(m), m_high = pairs_of_high_columns(m);
  const __m512i nibble = _mm512_set1_epi32(15);
  auto* out = static_cast<uint8_t*>(tile);
  for (int r = 0; r < 16; ++r) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
    const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble)), d_low, m_low);
    const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d_high, m_high);
    store_tile_row(out + 64 * r, low, high);
  }
}

struct Q4_1Tiles {
  static constexpr int64_t kRecordBytes = gguf::kQ4_1RecordBytes;
  static void tile(const uint8_t* record, void* tile) {
    nibble_tile(record + 64, load_half16(record), load_half16(record + 32), tile);
  }
};

// Q4_K's records: Q4_1's with float32 scales and offsets.
struct Q4_1FTiles {
  static constexpr int64_t kRecordBytes = gguf::kQ4_1FRecordBytes;
  static void tile(const uint8_t* record, void* tile) {
    nibble_tile(record + 128, _mm512_loadu_ps(record), _mm512_loadu_ps(record + 64), tile);
  }
};

struct Q8_0Tiles {
  static constexpr int64_t kRecordBytes = gguf::kQ8_0RecordBytes;
  // Row r's 32 bytes are steps 2r and 2r + 1 column by column: the tile row's codes in order.
  static void tile(const uint8_t* record, void* tile) {
    const __m512 d = load_half16(record);
    const __m512 d_low = pairs_of_low_columns(d), d_high = pairs_of_high_columns(d);
    auto* out = static_cast<uint8_t*>(tile);
    for (int r = 0; r < 16; ++r) {
      const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 32 + 32 * r));
      const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 48 + 32 * r));
      // d q is exact in float32 (gguf's d * q): a plain product, so q = 0 gives d's signed zero as gguf does.
      const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)), d_low);
      const __m512 high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)), d_high);
      store_tile_row(out + 64 * r, low, high);
    }
  }
};

// Q5_1, Q5_K and Q6_K's records: Q8_0's codes with float32 scales for steps 0-15 (tile rows 0-7) and 16-31 (rows
// 8-15), and float32 offsets.
struct Q8FTiles {
  static constexpr int64_t kRecordBytes = gguf::kQ8FRecordBytes;
  static void tile(const uint8_t* record, void* tile) {
    const __m512 m = _mm512_loadu_ps(record + 128);
    const __m512 m_low = pairs_of_low_columns(m), m_high = pairs_of_high_columns(m);
    auto* out = static_cast<uint8_t*>(tile);
    for (int half = 0; half < 2; ++half) {
      const __m512 d = _mm512_loadu_ps(record + 64 * half);
      const __m512 d_low = pairs_of_low_columns(d), d_high = pairs_of_high_columns(d);
      for (int r = 8 * half; r < 8 * half + 8; ++r) {
        const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 192 + 32 * r));
        const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 208 + 32 * r));
        const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)), d_low, m_low);
        const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)), d_high, m_high);
        store_tile_row(out + 64 * r, low, high);
      }
    }
  }
};

}  // namespace loom::amx
