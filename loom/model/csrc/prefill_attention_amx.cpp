// bfloat16 prefill attention on AMX, flash-attention style, for caches of 16-token blocks and head sizes 32, 64 or
// 128; prefill_attention.cpp runs everything else. Bound into `loom_paged_attention` by paged_attention.cpp.
//
// A work item is (sequence, KV head, up to kItemTokens query tokens of its chunk), or, for chunks of under 16 tokens
// (a verification step's), a sequence with all its KV heads. It first lays the keys and values its queries can see
// out as AMX operand tiles, once for all the query heads of each GQA group:
//   keys:   per 16-key block and 32 dims, the keys' rows as they are (A tiles of S^T = K Q^T),
//   values: per 32-key step and 16 dims, row d = the step's 32 values of dim d (A tiles of O^T += V^T P^T).
// Then each tile of 16 query lanes (16 tokens of one query head, or a chunk's last few tokens of several heads of
// the group: for_each_tile) walks the keys 32 at a time, transposed: keys are tile rows and the 16 query lanes the
// lanes (Q^T and P^T are the B tiles), so the softmax's maxima and sums are taken lane by lane, not across lanes.
// TDPBF16PS gives the 32 x 16 scores in float32; an online softmax in AVX-512 turns them into probabilities (rounded
// to bfloat16 for the P V product, as flash-attention kernels round them); TDPBF16PS adds P V into the output sums,
// which stay in tile registers (head sizes up to 64; the rest of a 128 in memory).
// A lane's maximum is moved, and its sums rescaled, only when a step's scores exceed it by more than kLazyRescale (8,
// in units of log2): probabilities then reach up to 2^8 against the old maximum, which float32 sums and bfloat16 P
// hold with the same relative precision, and most steps store, rescale and reload nothing (the lazy rescaling of
// FlashAttention-4). A step takes its maxima only when its sums reach kRiseSums in some lane, which a lane whose
// maximum rises must: the usual step computes no maxima at all.
// The softmax's vector work is lean: each probability 2^(score * scale * log2(e) - maximum) by one FMA and a cubic
// (exp2_16), keys masked only in the steps that reach the tile's first position.
// Items go KV head by KV head, costliest first, and a thread keeps the keys and values it laid out while its next
// item needs no more of the same sequence and head (keys past an item's own are masked, their probabilities exactly
// 0): a 2048-token prompt is laid out about once a head and thread, not once a tile.
// A step's two 16-key blocks take their scores in two tiles (4 and 7), products interleaved, and the next step's
// products are issued before this step's softmax. On this core tile products and 512-bit vector work do not run side
// by side, so that is about all the overlap there is. The alternatives measured are in docs/kernels.md.
// Every query token's arithmetic is its own (its own lane and its own maximum; keys step in 32s from key 0), so a
// token gets the same bits whichever chunk, tile or lane it is prefilled in.
#include <torch/extension.h>

#include "bfloat16.h"
#include "paged_geometry.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AVX512F__)
#include "amx_tiles.h"

namespace {

using bf16 = c10::BFloat16;
using loom::PagedGeometry;
using loom::V16;
using loom::load16;
using loom::store16;

constexpr int64_t kBlock = 16;        // keys per cache block (the only block size this kernel takes)
constexpr int64_t kStep = 32;         // keys per online-softmax step: one bfloat16 operand tile of P
constexpr int64_t kTileElems = 512;   // one 16 x 32 bfloat16 operand tile
constexpr int64_t kItemTokens = 128;  // query tokens per work item (8 tiles of 16)
constexpr float kMasked = loom::kMasked;

// 2^x (x up to kLazyRescale), sixteen lanes: r = x - floor(x) in [0, 1) by one VREDUCEPS, 2^r by a cubic (relative
// error 8.6e-5, under a tenth of a bfloat16 ulp; 2^0 = 1 exactly), times 2^floor(x) by VSCALEFPS, which floors its
// exponent itself. A masked score gives an integer x so large that r = 0 and 2^x is exactly 0. One micro-op fewer than
// rounding to the nearest n with a cubic on [-1/2, 1/2], with the same error against float64.
inline V16 exp2_16(V16 x) {
  const __m512 v = reinterpret_cast<__m512>(x);
  const __m512 r = _mm512_reduce_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x), in [0, 1)
  __m512 p = _mm512_set1_ps(7.70652e-2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.27647e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9511634e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return reinterpret_cast<V16>(_mm512_scalef_ps(p, v));  // times 2^floor(x)
}

constexpr int64_t kHeldTiles = 4;      // output tiles kept in tile registers (0-3)
constexpr float kLazyRescale = 8.f;   // how far a lane's maximum may rise before its sums are rescaled
// A step's sums in a lane whose maximum rises by more than kLazyRescale reach 2^8 (one probability does); half that
// leaves room for the FMA's rounding of score * scale - maximum against the rounded maxima that decide the rise.
constexpr float kRiseSums = 128.f;

enum class TileOp { kZero, kLoad, kStore, kAddProduct };

// `op` on output tile u (< kHeldTiles): the _tile_ intrinsics take literal tile numbers. kAddProduct adds tile 5
// (values) times tile 6 (P^T).
inline void tile_op(int64_t u, TileOp op, float* sums) {
#define LOOM_TILE_OP(T)                                        \
  switch (op) {                                               \
    case TileOp::kZero: _tile_zero(T); break;                 \
    case TileOp::kLoad: _tile_loadd(T, sums, 64); break;      \
    case TileOp::kStore: _tile_stored(T, sums, 64); break;    \
    case TileOp::kAddProduct: _tile_dpbf16ps(T, 5, 6); break; \
  }
  switch (u) {
    case 0: LOOM_TILE_OP(0) break;
    case 1: LOOM_TILE_OP(1) break;
    case 2: LOOM_TILE_OP(2) break;
    default: LOOM_TILE_OP(3) break;
  }
#undef LOOM_TILE_OP
}

// Two vectors rounded to bfloat16 (nearest even) and interleaved, 32-bit lane n = (low[n], high[n]): one
// VCVTNE2PS2BF16 and one word permute.
inline __m512i bf16_pairs(V16 low, V16 high) {
  const __m512i both = reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(high), reinterpret_cast<__m512>(low)));  // low's, then high's
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, both);
}

// On cache lines (TileBuffer): malloc's 16-byte offset made tile loads split lines, a layer about 1.5x slower.
struct Scratch {
  loom::amx::TileBuffer<bf16> keys, values;  // the item's operand tiles (see the top of the file), KV head by head
  loom::amx::TileBuffer<bf16> q, p;          // Q^T as B tiles [head_dim / 32][16][32]; P^T as a B tile [16][32]
  loom::amx::TileBuffer<float> s, pv, o;     // scores [32 keys][16]; a step's P V of a tile [16][16]; sums [dim][16]
  int64_t head_keys, head_values;            // elements of one KV head's key tiles and value tiles
  int64_t laid_seq = -1, laid_kvh = -1, laid_keys = 0;  // whose keys and values `keys` and `values` hold, how many
  // (laid_kvh: the item's KV head, or -1 where it laid out every KV head of the sequence)
  Scratch(const PagedGeometry& g, int64_t max_keys, int64_t heads) {
    const int64_t steps = (max_keys + kStep - 1) / kStep;
    head_keys = steps * 2 * (g.head_dim / 32) * kTileElems;
    head_values = steps * (g.head_dim / 16) * kTileElems;
    keys.resize(heads * head_keys);
    values.resize(heads * head_values);
    q.resize(16 * g.head_dim), p.resize(16 * kStep);
    s.resize(2 * kStep * 16), pv.resize(16 * 16), o.resize(16 * g.head_dim);
  }
};

// 16 rows of 16 32-bit lanes, transposed in registers (AVX-512: 4 stages of 16 unpacks or shuffles).
inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each group of four rows is now transposed within its 128-bit lanes; two rounds of 128-bit shuffles move the
  // lanes across the groups.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// 32 values of a cache row as bfloat16: read as they are, or int8 codes times their scale, rounded (int8_kv.h).
inline __m512i row_values(const bf16* p, float) { return _mm512_loadu_si512(p); }
inline __m512i row_values(const int8_t* p, float scale) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes))), s);
  const __m512 high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1))), s);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));  // low's 16, then high's
}

// The item's keys [0, num_keys) of KV heads [kvh0, kvh1) as A tiles (per 16-key block and 32 dims: the keys' rows as
// they are) and its values as A tiles of V transposed (per 32-key step and 16 dims: row d = the step's 32 values of
// dim d), zero past num_keys up to a whole step; head kvh's at (kvh - kvh0) * head_keys and * head_values. Block by
// block, every head of the range from the block's rows before the next block. Caches of C: bfloat16, or int8 codes
// with their scales (g.k_scales, g.v_scales).
template <typename C>
void lay_out_keys_and_values(const C* k_cache, const C* v_cache, const int64_t* table, int64_t num_keys,
                             int64_t kvh0, int64_t kvh1, const PagedGeometry& g, Scratch& scratch) {
  const int64_t head_dim = g.head_dim, dim_tiles = head_dim / 32, value_tiles = head_dim / 16;
  const int64_t steps = (num_keys + kStep - 1) / kStep;
  const __m512i zero = _mm512_setzero_si512();
  const int64_t row_lines = ((kvh1 - kvh0) * head_dim * static_cast<int64_t>(sizeof(C)) + 63) / 64;
  for (int64_t block = 0; block < 2 * steps; ++block) {
    const int64_t count = std::clamp<int64_t>(num_keys - block * kBlock, 0, kBlock);
    // The next block's rows of these heads asked for now: blocks lie wherever the table puts them, beyond the
    // hardware prefetchers' reach, and each row is read once.
    if (num_keys - (block + 1) * kBlock > 0) {
      for (int64_t n = 0; n < kBlock; ++n) {
        const int64_t row = g.row_offset(table[block + 1], n) + kvh0 * head_dim;
        for (int64_t line = 0; line < row_lines; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(k_cache + row) + line * 64, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v_cache + row) + line * 64, _MM_HINT_T0);
        }
      }
    }
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
      const C* k = count ? k_cache + g.row_offset(table[block], 0) + kvh * head_dim : nullptr;
      const C* v = count ? v_cache + g.row_offset(table[block], 0) + kvh * head_dim : nullptr;
      // Row n's scales (1 where the cache holds the values themselves).
      const int64_t scale_at = table[block] * kBlock * g.num_kv_heads + kvh;
      const auto k_scale = [&](int64_t n) { return g.k_scales ? g.k_scales[scale_at + n * g.num_kv_heads] : 1.f; };
      const auto v_scale = [&](int64_t n) { return g.v_scales ? g.v_scales[scale_at + n * g.num_kv_heads] : 1.f; };
      bf16* head_keys = scratch.keys.data() + (kvh - kvh0) * scratch.head_keys;
      for (int64_t tile = 0; tile < dim_tiles; ++tile) {
        bf16* out = head_keys + (block * dim_tiles + tile) * kTileElems;
        for (int64_t n = 0; n < 16; ++n)
          _mm512_storeu_si512(out + n * 32, n < count ? row_values(k + n * g.row_size + tile * 32, k_scale(n)) : zero);
      }
      // values: 32 dims of the block's 16 keys at a time, as 16 x 16 pairs of dims transposed; the low and the high
      // halves of row i are then dims 2i and 2i + 1 over the 16 keys: row d of a step's tile, its keys 16 (block % 2)
      // on.
      bf16* step_tiles = scratch.values.data() + (kvh - kvh0) * scratch.head_values +
                         (block / 2) * value_tiles * kTileElems + (block % 2) * 16;
      for (int64_t tile = 0; tile < dim_tiles; ++tile) {
        __m512i rows[16];
        for (int64_t n = 0; n < 16; ++n)
          rows[n] = n < count ? row_values(v + n * g.row_size + tile * 32, v_scale(n)) : zero;
        transpose16x16(rows);
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t d = tile * 32 + 2 * i;  // rows d and d + 1 of the same 16-dim tile
          bf16* row = step_tiles + (d / 16) * kTileElems + (d % 16) * 32;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm512_cvtepi32_epi16(rows[i]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 32),
                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(rows[i], 16)));
        }
      }
    }
  }
}

// A tile's query lanes: lane n < rows is query token token[n] of the chunk for query head head[n].
struct TileLanes {
  int64_t rows = 0;
  int64_t token[16], head[16];
};

// An item's tiles for query heads [h0, h1) and the chunk's tokens [t0, t1), each passed to fn: each head's whole
// 16-token runs, then the rest (fewer than 16 tokens, at the same positions for every head) of all the heads packed
// together, 16 lanes a tile. A verification step's chunks of 2-6 tokens (a request's last token and its drafts)
// take one or two tiles a KV head of SmolLM2's groups of 3 instead of three.
template <typename Fn>
void for_each_tile(int64_t t0, int64_t t1, int64_t h0, int64_t h1, Fn fn) {
  const int64_t whole_end = t0 + (t1 - t0) / 16 * 16;
  TileLanes lanes;
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t t = t0; t < whole_end; t += 16) {
      lanes.rows = 16;
      for (int n = 0; n < 16; ++n) lanes.token[n] = t + n, lanes.head[n] = h;
      fn(lanes);
    }
  lanes.rows = 0;
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t t = whole_end; t < t1; ++t) {
      lanes.token[lanes.rows] = t, lanes.head[lanes.rows] = h;
      if (++lanes.rows == 16) fn(lanes), lanes.rows = 0;
    }
  if (lanes.rows) fn(lanes);
}

// One tile of query lanes (`lanes`; the chunk's token i sits at position first_pos + i) against a KV head's laid-out
// keys and values (key_tiles, value_tiles: that head's in scratch). Output to out[token][head]. Scores are computed
// transposed (keys as rows, the 16 lanes as lanes), so the softmax's maxima and sums over keys are lane-wise.
void attend_tile(const bf16* q, const TileLanes& lanes, int64_t first_pos, const bf16* key_tiles,
                 const bf16* value_tiles, bf16* out, const PagedGeometry& g, Scratch& scratch) {
  const int64_t head_dim = g.head_dim, dim_tiles = head_dim / 32, value_tiles_per_step = head_dim / 16;
  const int64_t rows = lanes.rows;
  // Q^T as B tiles: per 32 dims, row r = dim pair r, lane n = query n's pair.
  bf16* qt = scratch.q.data();
  for (int64_t v = 0; v < dim_tiles; ++v) {
    __m512i r[16];
    for (int64_t n = 0; n < 16; ++n)
      r[n] = n < rows ? _mm512_loadu_si512(q + lanes.token[n] * g.q_row_stride + lanes.head[n] * head_dim + v * 32)
                      : _mm512_setzero_si512();
    transpose16x16(r);
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(qt + v * kTileElems + i * 32, r[i]);
  }
  float* pv = scratch.pv.data();
  float* o = scratch.o.data();
  bf16* p = scratch.p.data();
  // The output sums O^T: its first kHeldTiles 16-dim tiles stay in tiles 0-3 (P V added by TDPBF16PS in place), the
  // rest (head size 128) in `o`, each step's P V added from `pv`. Tiles 4 and 7: scores (4 then also P V for
  // `o`); 5: key or value A tiles; 6: Q^T, then P^T.
  const int64_t held = std::min(value_tiles_per_step, kHeldTiles);
  std::fill(o, o + 16 * head_dim, 0.f);
  for (int64_t u = 0; u < held; ++u) tile_op(u, TileOp::kZero, nullptr);
  const float log2_scale = g.scale * 1.44269504f;
  V16 m = V16{} + kMasked, l = V16{};
  // Each lane's position (unused lanes take the last lane's), the lowest and the highest.
  V16 pos;
  int64_t first_lane_pos = first_pos + lanes.token[0], last_pos = first_lane_pos;
  for (int n = 0; n < 16; ++n) {
    const int64_t at = first_pos + lanes.token[std::min<int64_t>(n, rows - 1)];
    pos[n] = static_cast<float>(at);
    first_lane_pos = std::min(first_lane_pos, at), last_pos = std::max(last_pos, at);
  }
  // A step's 32 x 16 scores into `scores`: its two 16-key blocks in tiles 4 and 7, their products interleaved so
  // that the two chains of TDPBF16PS overlap.
  auto compute_scores = [&](int64_t k0, float* scores) {
    _tile_zero(4);
    _tile_zero(7);
    const bf16* step_keys = key_tiles + (k0 / kBlock) * dim_tiles * kTileElems;
    for (int64_t v = 0; v < dim_tiles; ++v) {
      _tile_loadd(6, qt + v * kTileElems, 64);
      _tile_loadd(5, step_keys + v * kTileElems, 64);
      _tile_dpbf16ps(4, 5, 6);
      _tile_loadd(5, step_keys + (dim_tiles + v) * kTileElems, 64);
      _tile_dpbf16ps(7, 5, 6);
    }
    _tile_stored(4, scores, 64);
    _tile_stored(7, scores + 16 * 16, 64);
  };
  compute_scores(0, scratch.s.data());
  for (int64_t k0 = 0, i = 0; k0 <= last_pos; k0 += kStep, ++i) {
    // The next step's products are issued before this step's softmax, whose vector work then runs while they are in
    // flight; the two steps' scores alternate between the halves of scratch.s.
    float* s = scratch.s.data() + (i % 2) * kStep * 16;
    if (k0 + kStep <= last_pos) compute_scores(k0 + kStep, scratch.s.data() + ((i + 1) % 2) * kStep * 16);
    // Scores stay raw: each probability is 2^(score * log2_scale - maximum), one FMA, and maxima are taken of the raw
    // scores (scaling is monotonic). Keys past a lane's position exist only in the steps that reach the tile's
    // lowest lane position. `probabilities` stores P^T against the given maxima and sums them into row_sums;
    // `step_maxima` is a pass of maxima alone (scaled).
    const bool reaches_first = k0 + kStep - 1 > first_lane_pos;
    const __m512 scale_v = _mm512_set1_ps(log2_scale);
    V16 row_sums;
    auto score = [&](int64_t j) {  // key k0 + j's raw scores, masked past each lane's position
      const V16 x = load16(s + j * 16);
      return reaches_first && static_cast<float>(k0 + j) > pos ? V16{} + kMasked : x;
    };
    auto probabilities = [&](V16 maxima) {
      const __m512 neg_m = reinterpret_cast<__m512>(-maxima);
      V16 sums = V16{};
      for (int64_t j = 0; j < kStep; j += 2) {
        const __m512 x0 = reinterpret_cast<__m512>(score(j)), x1 = reinterpret_cast<__m512>(score(j + 1));
        const V16 e0 = exp2_16(reinterpret_cast<V16>(_mm512_fmadd_ps(x0, scale_v, neg_m)));
        const V16 e1 = exp2_16(reinterpret_cast<V16>(_mm512_fmadd_ps(x1, scale_v, neg_m)));
        sums += e0;
        sums += e1;
        // Row j / 2 of P^T's B tile: lane n holds query n's probabilities of keys j and j + 1.
        _mm512_storeu_si512(p + j * 16, bf16_pairs(e0, e1));
      }
      row_sums = sums;
    };
    auto step_maxima = [&] {
      V16 highest[2] = {V16{} + kMasked, V16{} + kMasked};
      for (int64_t j = 0; j < kStep; j += 2) {
        const V16 x0 = score(j), x1 = score(j + 1);
        highest[0] = highest[0] > x0 ? highest[0] : x0;
        highest[1] = highest[1] > x1 ? highest[1] : x1;
      }
      return (highest[0] > highest[1] ? highest[0] : highest[1]) * log2_scale;
    };
    if (k0 == 0) {
      // The tile's first step sets its lanes' maxima (nothing summed yet to rescale).
      m = step_maxima();
      probabilities(m);
    } else {
      // Later steps take their probabilities against the maxima so far. A lane's maximum moves (its sums rescaled,
      // the step's probabilities taken again) only when the step's scores exceed it by more than kLazyRescale (see
      // the top of the file: under 1% of these steps). Such a lane has a probability of 2^kLazyRescale or more, so
      // the step's maxima are looked for only in steps whose sums reach kRiseSums in some lane.
      probabilities(m);
      const bool may_rise =
          _mm512_cmp_ps_mask(reinterpret_cast<__m512>(row_sums), _mm512_set1_ps(kRiseSums), _CMP_GT_OQ) != 0;
      const V16 step_max = may_rise ? step_maxima() : m;
      const __mmask16 rising = _mm512_cmp_ps_mask(reinterpret_cast<__m512>(step_max - m),
                                                  _mm512_set1_ps(kLazyRescale), _CMP_GT_OQ);
      if (rising) {
        const V16 new_m = reinterpret_cast<V16>(_mm512_mask_blend_ps(rising, reinterpret_cast<__m512>(m),
                                                                     reinterpret_cast<__m512>(step_max)));
        const V16 alpha = exp2_16(m - new_m);  // exactly 1 in the other lanes
        for (int64_t u = 0; u < held; ++u) tile_op(u, TileOp::kStore, o + u * 256);
        for (int64_t d = 0; d < head_dim; ++d) store16(o + d * 16, load16(o + d * 16) * alpha);
        for (int64_t u = 0; u < held; ++u) tile_op(u, TileOp::kLoad, o + u * 256);
        l *= alpha;
        m = new_m;
        probabilities(m);
      }
    }
    l += row_sums;
    _tile_loadd(6, p, 64);
    const bf16* value_tiles_at = value_tiles + (k0 / kStep) * value_tiles_per_step * kTileElems;
    for (int64_t u = 0; u < held; ++u) {
      _tile_loadd(5, value_tiles_at + u * kTileElems, 64);
      tile_op(u, TileOp::kAddProduct, nullptr);
    }
    for (int64_t u = held; u < value_tiles_per_step; ++u) {
      _tile_zero(4);
      _tile_loadd(5, value_tiles_at + u * kTileElems, 64);
      _tile_dpbf16ps(4, 5, 6);
      _tile_stored(4, pv, 64);
      float* sums = o + u * 256;
      for (int64_t i = 0; i < 16; ++i) store16(sums + i * 16, load16(sums + i * 16) + load16(pv + i * 16));
    }
  }
  for (int64_t u = 0; u < held; ++u) tile_op(u, TileOp::kStore, o + u * 256);
  const V16 inv = 1.f / l;
  for (int64_t u = 0; u < value_tiles_per_step; ++u) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i) r[i] = reinterpret_cast<__m512i>(load16(o + (u * 16 + i) * 16) * inv);
    transpose16x16(r);  // row n = lane n's dims 16 u ..
    for (int64_t n = 0; n < rows; ++n)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (lanes.token[n] * g.num_heads + lanes.head[n]) * head_dim +
                                                     u * 16),
                          loom::round_to_bf16(_mm512_castsi512_ps(r[n])));
  }
}

}  // namespace

// prefill_attention's work on AMX, or false (nothing done) where this kernel does not apply: not bfloat16, blocks
// other than 16 tokens, a head size other than 32 / 64 / 128, or no AMX granted to this process. Caches of bfloat16
// or int8 codes (with g's scales).
bool prefill_attention_amx(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const int64_t* tables, const int64_t* context_lens, const int64_t* query_starts,
                           int64_t first_seq, int64_t num_seqs, torch::Tensor& out, const PagedGeometry& g) {
  if (q.scalar_type() != at::kBFloat16 || g.block_size != kBlock || !(g.head_dim == 32 || g.head_dim == 64 ||
      g.head_dim == 128) || !loom::amx::request_amx())
    return false;
  // A work item: query tokens [t0, t1) of a sequence's chunk against KV heads [kvh0, kvh1). A long chunk goes a KV
  // head and up to kItemTokens tokens an item. Short chunks (under 16 tokens: a verification step's last tokens and
  // drafts, a prompt's last token after cached blocks), where there are at least as many as threads, go a sequence
  // an item, every KV head laid out from the same pass over its blocks: items of one head each read the same cache
  // rows again, a part of each row at a time.
  struct Item { int64_t seq, kvh0, kvh1, t0, t1; };
  std::vector<Item> items;
  int64_t max_keys = 0, short_chunks = 0;
  for (int64_t seq = first_seq; seq < num_seqs; ++seq) short_chunks += query_starts[seq + 1] - query_starts[seq] < 16;
  const bool whole_rows = short_chunks >= at::get_num_threads();
  for (int64_t seq = first_seq; seq < num_seqs; ++seq) {
    const int64_t n = query_starts[seq + 1] - query_starts[seq];
    max_keys = std::max(max_keys, context_lens[seq]);
    if (n < 16 && whole_rows) {
      items.push_back({seq, 0, g.num_kv_heads, 0, n});
      continue;
    }
    for (int64_t kvh = 0; kvh < g.num_kv_heads; ++kvh)
      for (int64_t t0 = (n - 1) / kItemTokens * kItemTokens; t0 >= 0; t0 -= kItemTokens)  // costliest first
        items.push_back({seq, kvh, kvh + 1, t0, std::min(n, t0 + kItemTokens)});
  }
  const bf16* q_data = q.data_ptr<bf16>();
  const bool int8 = g.k_scales != nullptr;
  bf16* out_data = out.data_ptr<bf16>();
  const int64_t scratch_heads = whole_rows ? g.num_kv_heads : 1;
  loom::for_each_item(
      static_cast<int64_t>(items.size()), [&] { return Scratch(g, max_keys, scratch_heads); },
      [&](int64_t i, Scratch& scratch) {
        const Item& it = items[i];
        const int64_t start = query_starts[it.seq], n = query_starts[it.seq + 1] - start;
        const int64_t first_pos = context_lens[it.seq] - n;
        loom::amx::configure_tiles();
        const int64_t num_keys = first_pos + it.t1;
        const int64_t laid_kvh = it.kvh1 - it.kvh0 == 1 ? it.kvh0 : -1;
        if (scratch.laid_seq != it.seq || scratch.laid_kvh != laid_kvh || scratch.laid_keys < num_keys) {
          const int64_t* table = tables + it.seq * g.max_blocks;
          if (int8)
            lay_out_keys_and_values(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), table, num_keys, it.kvh0,
                                    it.kvh1, g, scratch);
          else
            lay_out_keys_and_values(k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), table, num_keys, it.kvh0,
                                    it.kvh1, g, scratch);
          scratch.laid_seq = it.seq, scratch.laid_kvh = laid_kvh, scratch.laid_keys = num_keys;
        }
        const bf16* q_chunk = q_data + start * g.q_row_stride;
        bf16* out_chunk = out_data + start * g.num_heads * g.head_dim;
        for (int64_t kvh = it.kvh0; kvh < it.kvh1; ++kvh) {
          const bf16* key_tiles = scratch.keys.data() + (kvh - it.kvh0) * scratch.head_keys;
          const bf16* value_tiles = scratch.values.data() + (kvh - it.kvh0) * scratch.head_values;
          for_each_tile(it.t0, it.t1, kvh * g.group(), (kvh + 1) * g.group(), [&](const TileLanes& lanes) {
            attend_tile(q_chunk, lanes, first_pos, key_tiles, value_tiles, out_chunk, g, scratch);
          });
        }
        _tile_release();
      });
  return true;
}

#else

bool prefill_attention_amx(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const int64_t*,
                           const int64_t*, const int64_t*, int64_t, int64_t, torch::Tensor&,
                           const loom::PagedGeometry&) {
  return false;
}

#endif
