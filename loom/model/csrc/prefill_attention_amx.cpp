// bfloat16 prefill attention on AMX, flash-attention style, for caches of 16-token blocks and head sizes 32, 64 or
// 128; prefill_attention.cpp runs everything else. Bound into `loom_paged_attention` by paged_attention.cpp.
//
// A work item is (sequence, KV head, up to kItemTokens query tokens of its chunk). It first lays the keys and values
// its queries can see out as AMX operand tiles, once for all the query heads of the GQA group:
//   keys:   per 16-key block and 32 dims, row r = dim pair r, lane 2n + j = K[key n][2r + j]  (S = Q K^T),
//   values: per 32-key step and 16 dims, row r = key pair r, lane 2n + j = V[key 2r + j][dim n]  (O += P V).
// Then each 16-token tile of one query head walks the keys 32 at a time: TDPBF16PS gives the 16 x 32 scores in
// float32, an online softmax in AVX-512 (16 lanes) turns them into probabilities (rounded to bfloat16 for the P V
// product, as flash-attention kernels round them) and rescales the float32 output, and TDPBF16PS adds P V.
// Every query row's arithmetic is its own (AMX rows are independent; the softmax is per row; keys step in 32s from
// key 0), so a token gets the same bits whichever chunk or tile it is prefilled in.
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

constexpr int64_t kBlock = 16;        // keys per cache block (the only block size this kernel takes)
constexpr int64_t kStep = 32;         // keys per online-softmax step: one bfloat16 operand tile of P
constexpr int64_t kTileElems = 512;   // one 16 x 32 bfloat16 operand tile
constexpr int64_t kItemTokens = 128;  // query tokens per work item (8 tiles of 16)
constexpr float kMasked = loom::kMasked;

typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));

inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }
inline float max16(V16 v) { return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v)); }
inline float sum16(V16 v) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v)); }

struct Scratch {
  std::vector<bf16> keys, values;  // the item's operand tiles (see the top of the file)
  std::vector<bf16> q, p;          // a query tile [16][head_dim]; probabilities [16][32]
  std::vector<float> s, pv, o;     // scores [16][32]; one step's P V [16][head_dim]; output sums [16][head_dim]
  Scratch(const PagedGeometry& g, int64_t max_keys) {
    const int64_t steps = (max_keys + kStep - 1) / kStep;
    keys.resize(steps * 2 * (g.head_dim / 32) * kTileElems);
    values.resize(steps * (g.head_dim / 16) * kTileElems);
    q.resize(16 * g.head_dim), p.resize(16 * kStep);
    s.resize(16 * kStep), pv.resize(16 * g.head_dim), o.resize(16 * g.head_dim);
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

// The item's keys [0, num_keys) of KV head kvh as operand tiles, zero past num_keys up to a whole step. Keys: a
// block's 16 rows of 32-bit dim pairs, transposed 16 pairs at a time. Values: two keys' rows interleaved, 16 dims
// (one tile row) at a time.
void lay_out_keys_and_values(const bf16* k_cache, const bf16* v_cache, const int64_t* table, int64_t num_keys,
                             int64_t kvh, const PagedGeometry& g, Scratch& scratch) {
  const int64_t head_dim = g.head_dim, dim_tiles = head_dim / 32, value_tiles = head_dim / 16;
  const int64_t steps = (num_keys + kStep - 1) / kStep;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t block = 0; block < 2 * steps; ++block) {
    const int64_t count = std::clamp<int64_t>(num_keys - block * kBlock, 0, kBlock);
    const bf16* k = count ? k_cache + table[block] * kBlock * g.row_size + kvh * head_dim : nullptr;
    const bf16* v = count ? v_cache + table[block] * kBlock * g.row_size + kvh * head_dim : nullptr;
    for (int64_t tile = 0; tile < dim_tiles; ++tile) {  // keys: row r of the tile = dim pair 16 tile + r
      __m512i rows[16];
      for (int64_t n = 0; n < 16; ++n) rows[n] = n < count ? _mm512_loadu_si512(k + n * g.row_size + tile * 32) : zero;
      transpose16x16(rows);
      bf16* out = scratch.keys.data() + (block * dim_tiles + tile) * kTileElems;
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(out + r * 32, rows[r]);
    }
    // values: the block is half a step; its 8 key pairs are rows 8 (block % 2) .. of the step's tiles
    bf16* out = scratch.values.data() + (block / 2) * value_tiles * kTileElems + (block % 2) * 8 * 32;
    for (int64_t pair = 0; pair < 8; ++pair) {
      for (int64_t tile = 0; tile < value_tiles; ++tile) {
        const int64_t first = 2 * pair, second = 2 * pair + 1;
        const __m256i a = first < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                              v + first * g.row_size + tile * 16))
                                        : _mm256_setzero_si256();
        const __m256i b = second < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                               v + second * g.row_size + tile * 16))
                                         : _mm256_setzero_si256();
        const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
        bf16* row = out + tile * kTileElems + pair * 32;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
      }
    }
  }
}

// One tile: query tokens [t0, t0 + rows) of the chunk (rows <= 16) for query head `head`; the chunk's token i sits
// at position first_pos + i. Output to out[token][head].
void attend_tile(const bf16* q, int64_t t0, int64_t rows, int64_t first_pos, int64_t head, bf16* out,
                 const PagedGeometry& g, Scratch& scratch) {
  const int64_t head_dim = g.head_dim, dim_tiles = head_dim / 32, value_tiles = head_dim / 16;
  bf16* qt = scratch.q.data();
  std::fill(qt, qt + 16 * head_dim, bf16{});
  for (int64_t r = 0; r < rows; ++r)
    std::copy(q + ((t0 + r) * g.num_heads + head) * head_dim, q + ((t0 + r) * g.num_heads + head + 1) * head_dim,
              qt + r * head_dim);
  float* s = scratch.s.data();
  float* pv = scratch.pv.data();
  float* o = scratch.o.data();
  bf16* p = scratch.p.data();
  std::fill(o, o + 16 * head_dim, 0.f);
  alignas(64) float m[16], l[16];
  std::fill(m, m + 16, kMasked);
  std::fill(l, l + 16, 0.f);
  const int64_t last_pos = first_pos + t0 + rows - 1;
  const V16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t k0 = 0; k0 <= last_pos; k0 += kStep) {
    // S = Q K^T for keys [k0, k0 + 32): two 16 x 16 float32 tiles side by side.
    for (int64_t b = 0; b < 2; ++b) {
      _tile_zero(0);
      const bf16* key_tiles = scratch.keys.data() + (k0 / kBlock + b) * dim_tiles * kTileElems;
      for (int64_t v = 0; v < dim_tiles; ++v) {
        _tile_loadd(4, qt + v * 32, head_dim * 2);
        _tile_loadd(6, key_tiles + v * kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, s + b * 16, kStep * 4);
    }
    alignas(64) float moved[16], row_sums[16];  // m's change, and the step's sum of exps, per row
    for (int64_t r = 0; r < 16; ++r) {
      const float pos = static_cast<float>(first_pos + t0 + std::min(r, rows - 1));
      V16 x[2];
      for (int h = 0; h < 2; ++h) {
        const V16 key = lane + static_cast<float>(k0 + 16 * h);
        x[h] = key > pos ? V16{} + kMasked : load16(s + r * kStep + 16 * h) * g.scale;  // causal
      }
      const float step_max = std::max(m[r], max16(x[0] > x[1] ? x[0] : x[1]));
      const V16 e0 = loom::exp_nonpositive_lanes<V16, I16>(x[0] - step_max);
      const V16 e1 = loom::exp_nonpositive_lanes<V16, I16>(x[1] - step_max);
      row_sums[r] = sum16(e0 + e1);
      const __m512bh pair = _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(e1), reinterpret_cast<__m512>(e0));
      _mm512_storeu_si512(p + r * kStep, reinterpret_cast<__m512i>(pair));
      moved[r] = m[r] - step_max;
      m[r] = step_max;
    }
    alignas(64) float alpha[16];
    store16(alpha, loom::exp_nonpositive_lanes<V16, I16>(load16(moved)));
    store16(l, load16(l) * load16(alpha) + load16(row_sums));
    // P V for the step, then o = o * alpha + P V row by row.
    _tile_loadd(4, p, kStep * 2);
    const bf16* value_tiles_at = scratch.values.data() + (k0 / kStep) * value_tiles * kTileElems;
    for (int64_t u = 0; u < value_tiles; ++u) {
      _tile_zero(0);
      _tile_loadd(6, value_tiles_at + u * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_stored(0, pv + u * 16, head_dim * 4);
    }
    for (int64_t r = 0; r < 16; ++r)
      for (int64_t d = 0; d < head_dim; d += 16)
        store16(o + r * head_dim + d, load16(o + r * head_dim + d) * alpha[r] + load16(pv + r * head_dim + d));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    bf16* row = out + ((t0 + r) * g.num_heads + head) * head_dim;
    for (int64_t d = 0; d < head_dim; d += loom::kLanes)
      loom::store(row + d, loom::load(o + r * head_dim + d) * inv);
  }
}

}  // namespace

// prefill_attention's work on AMX, or false (nothing done) where this kernel does not apply: not bfloat16, blocks
// other than 16 tokens, a head size other than 32 / 64 / 128, or no AMX granted to this process.
bool prefill_attention_amx(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const int64_t* tables, const int64_t* context_lens, const int64_t* query_starts,
                           int64_t first_seq, int64_t num_seqs, torch::Tensor& out, const PagedGeometry& g) {
  if (q.scalar_type() != at::kBFloat16 || g.block_size != kBlock || !(g.head_dim == 32 || g.head_dim == 64 ||
      g.head_dim == 128) || !loom::amx::request_amx())
    return false;
  struct Item { int64_t seq, kvh, t0, t1; };
  std::vector<Item> items;
  int64_t max_keys = 0;
  for (int64_t seq = first_seq; seq < num_seqs; ++seq) {
    const int64_t n = query_starts[seq + 1] - query_starts[seq];
    max_keys = std::max(max_keys, context_lens[seq]);
    for (int64_t t0 = (n - 1) / kItemTokens * kItemTokens; t0 >= 0; t0 -= kItemTokens)  // costliest first
      for (int64_t kvh = 0; kvh < g.num_kv_heads; ++kvh) items.push_back({seq, kvh, t0, std::min(n, t0 + kItemTokens)});
  }
  const bf16* q_data = q.data_ptr<bf16>();
  const bf16* k_data = k_cache.data_ptr<bf16>();
  const bf16* v_data = v_cache.data_ptr<bf16>();
  bf16* out_data = out.data_ptr<bf16>();
  loom::for_each_item(
      static_cast<int64_t>(items.size()), [&] { return Scratch(g, max_keys); },
      [&](int64_t i, Scratch& scratch) {
        const Item& it = items[i];
        const int64_t start = query_starts[it.seq], n = query_starts[it.seq + 1] - start;
        const int64_t first_pos = context_lens[it.seq] - n;
        loom::amx::configure_tiles();
        lay_out_keys_and_values(k_data, v_data, tables + it.seq * g.max_blocks, first_pos + it.t1, it.kvh, g,
                                scratch);
        const bf16* q_chunk = q_data + start * g.num_heads * g.head_dim;
        bf16* out_chunk = out_data + start * g.num_heads * g.head_dim;
        for (int64_t h = it.kvh * g.group(); h < (it.kvh + 1) * g.group(); ++h)
          for (int64_t t0 = it.t0; t0 < it.t1; t0 += 16)
            attend_tile(q_chunk, t0, std::min<int64_t>(16, it.t1 - t0), first_pos, h, out_chunk, g, scratch);
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
