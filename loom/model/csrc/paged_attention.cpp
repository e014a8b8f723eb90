// Decode attention straight from the paged KV cache: one query token per sequence, every sequence of the step in
// one call. A work item is a sequence, all its KV heads (a long context goes in chunks of kChunkTokens, merged at
// the end): its keys and values are read once each, through the block table, row after row in token order, for all
// query heads. Each KV head's part of a row is loaded into registers once for the query heads of its GQA group,
// bfloat16 widened as it is loaded; nothing is gathered into a temporary. Scores: each head's dot products of eight
// tokens are summed across lanes together (one transpose, vec.h) instead of one horizontal sum per token and head;
// bfloat16 scores on AMX where the CPU has it (bf16_scores_by_tiles), and a
// bfloat16 path of its own on CPUs with AVX2 alone (attend_decode_bf16_avx2). Math in float32. With AVX-512 BF16, a
// step whose items share out unevenly among the threads (a lone sequence) runs each item's halves on two threads
// (attend_in_halves), with the same bits.
//
// Tried and slower here: computing eight rows at a time straight from the cache (the interleaved reads lost the
// hardware prefetchers: 1.5-2.5x slower from memory), and widening a sequence's rows into a buffer first (its reads
// then had no compute to hide behind).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include "bfloat16.h"
#include "entry_points.h"
#include "int8_kv.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#endif
#include "paged_geometry.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using loom::exp_nonpositive;
using loom::kLanes;
using loom::kMasked;
using loom::load;
using loom::PagedGeometry;
using loom::splat;
using loom::Vec;
using loom::vmax;
using loom::widen;

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

constexpr int64_t kAhead = 2;  // blocks a RowWalker prefetches ahead

// Asks for one cache line at the start of [p, p + bytes) and at each 4 KiB page boundary inside it: enough for the
// hardware prefetchers to stream the rest, which they begin only after a page's first misses (asking for every line
// was slower; docs/kernels.md).
inline void start_streams(const void* p, int64_t bytes) {
  const char* begin = static_cast<const char*>(p);
  __builtin_prefetch(begin);
  const uintptr_t first_page = (reinterpret_cast<uintptr_t>(begin) + 4095) & ~uintptr_t{4095};
  for (const char* page = reinterpret_cast<const char*>(first_page); page < begin + bytes; page += 4096)
    __builtin_prefetch(page);
}

// Walks one sequence's K or V rows (each token's whole row, all KV heads) in token order, the order they lie in
// within a block, which the hardware prefetchers follow. The next blocks lie anywhere in the cache, so while row j of
// a block is read, row j of the block kAhead on is prefetched (2 blocks ahead beat 1). R == C: rows are read in place
// (heads head_dim apart); R == float for a head size of part vectors or an int8 cache: rows are copied, widened (int8
// codes times their scales), into the caller's buffer, each head's part zero-padded to padded_dim().
template <typename C, typename R>
class RowWalker {
 public:
  // Rows [begin, end) of a sequence, of a cache of C (its scales: an int8 cache's, else null). Blocks ahead are
  // prefetched only within them: rows past `end` belong to another item (the next chunk), which another thread may
  // read.
  RowWalker(const C* cache, const float* scales, const int64_t* table, int64_t begin, int64_t end,
            const PagedGeometry& g)
      : cache_(cache), scales_(scales), table_(table), end_(end), heads_(g.num_kv_heads), g_(g),
        block_(begin / g.block_size), offset_(begin % g.block_size) {}

  const R* next(float* buffer) {
    const int64_t slot = table_[block_] * g_.block_size + offset_;
    const C* row = cache_ + g_.row_offset(table_[block_], offset_);
    if ((block_ + kAhead) * g_.block_size < end_) {
      const int64_t ahead_slot = table_[block_ + kAhead] * g_.block_size + offset_;
      const char* ahead = reinterpret_cast<const char*>(cache_ + g_.row_offset(table_[block_ + kAhead], offset_));
      const int64_t bytes = heads_ * g_.head_dim * static_cast<int64_t>(sizeof(C));
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
      if (scales_) __builtin_prefetch(scales_ + ahead_slot * heads_);
    }
    if (++offset_ == g_.block_size) offset_ = 0, ++block_;
    if constexpr (std::is_same_v<R, C>) {
      return row;
    } else {
      for (int64_t h = 0; h < heads_; ++h) {
        const float scale = scales_ ? scales_[slot * heads_ + h] : 1.f;
        for (int64_t d = 0; d < g_.head_dim; ++d)
          buffer[h * g_.padded_dim() + d] = loom::dequantized(row[h * g_.head_dim + d], scale);
        std::fill(buffer + h * g_.padded_dim() + g_.head_dim, buffer + (h + 1) * g_.padded_dim(), 0.f);
      }
      return buffer;
    }
  }

 private:
  const C* cache_;
  const float* scales_;
  const int64_t* table_;
  int64_t end_, heads_;
  const PagedGeometry& g_;
  int64_t block_, offset_;
};

constexpr int64_t kMaxHeadVecs = 32;  // head sizes up to 256
// Contexts longer than this are attended in chunks of it (see decode_attention_impl), for every batch alike. Short
// chunks let one long sequence use every thread; each chunk costs a merge and a cold start of its streams. 512 where
// the build has AVX-512 (int8 caches too: 256 helped a lone sequence but cost more at 64), 256 with AVX2 alone
// (docs/kernels.md).
#if defined(__AVX512F__)
constexpr int64_t kChunkTokens = 512;
#else
constexpr int64_t kChunkTokens = 256;
#endif

// A chunk's results before the merge, for each query head of its item: the value sums, unnormalized
// ([head][head_dim]), the chunk's maximum score and its sum of exp(score - maximum).
struct Partial {
  float* acc;
  float* max;
  float* sum;
};

// Per-thread scratch, sized for the step's longest context or chunk.
struct DecodeScratch {
  std::vector<Vec> q, acc, dots;  // [head][vectors], [head][vectors], [head][kLanes tokens]
  std::vector<float> scores;      // [head][len rounded up to kLanes]
  std::vector<float> inv_sum;     // [head]: 1 / the head's softmax denominator
  std::vector<float> head_max;    // [head]: the head's largest score
  std::vector<float> row;         // a copied row (head sizes of part vectors)
  std::vector<c10::BFloat16> query_tiles;  // bf16_scores_by_tiles: the query heads as B tiles
  std::vector<float> tile_sums;            // bf16_scores_by_tiles: [tile][head][token]
  std::vector<float> half_acc, half_sums;  // attend_decode_bf16: each half's value, exp sums [2][head][dim], [2][head]
  std::vector<float> q_scales;             // attend_decode_int8: [head], q's int16 scale times the softmax scale
  std::vector<float> unit_scores;          // attend_in_halves: this thread's units' scores [unit][head][item length]
  DecodeScratch(const PagedGeometry& g, int64_t max_len) {
    const int64_t vecs = g.padded_dim() / kLanes;
    q.resize(g.num_heads * vecs), acc.resize(g.num_heads * vecs), dots.resize(g.num_heads * kLanes);
    scores.resize(g.num_heads * round_up(max_len, kLanes));
    inv_sum.resize(g.num_heads), head_max.resize(g.num_heads);
    row.resize(g.num_kv_heads * g.padded_dim());
    query_tiles.resize(g.num_heads * g.padded_dim());
    tile_sums.resize(g.num_heads * round_up(max_len, 16));
    half_acc.resize(2 * g.num_heads * g.padded_dim()), half_sums.resize(2 * g.num_heads);
    q_scales.resize(g.num_heads);
  }
};

// The calling thread's DecodeScratch, kept from call to call: made and first written by the thread that uses it, and
// remade only for other head counts or sizes or a longer context. Made afresh in each call (tens of KiB zeroed), a
// worker thread took twice the main thread's time to make its scratch, and the main thread then waited for it at
// attend_in_halves' barrier.
DecodeScratch& kept_decode_scratch(const PagedGeometry& g, int64_t max_len) {
  struct Kept {
    std::optional<DecodeScratch> scratch;
    int64_t num_heads = 0, num_kv_heads = 0, padded_dim = 0, max_len = -1;
  };
  static thread_local Kept kept;
  if (!kept.scratch || kept.num_heads != g.num_heads || kept.num_kv_heads != g.num_kv_heads ||
      kept.padded_dim != g.padded_dim() || kept.max_len < max_len) {
    kept.scratch.emplace(g, max_len);
    kept.num_heads = g.num_heads, kept.num_kv_heads = g.num_kv_heads, kept.padded_dim = g.padded_dim();
    kept.max_len = max_len;
  }
  return *kept.scratch;
}

// Which of the kLanes positions from t0 lie inside a context of len tokens.
inline auto in_context(int64_t t0, int64_t len) {
  return Vec{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<float>(t0) < static_cast<float>(len);
}

// A head's largest score among its first len (the rest of the padded_len are masked).
inline float max_score(const float* s, int64_t len, int64_t padded_len) {
  Vec m = splat(kMasked);
  for (int64_t t0 = 0; t0 < padded_len; t0 += kLanes) m = vmax(m, in_context(t0, len) ? load(s + t0) : splat(kMasked));
  return loom::max_lanes(m);
}

// A head's scores [t0, t0 + kLanes) in place -> exp(score - max), 0 past len; returned too, for the sum.
inline Vec exp_scores(float* s, int64_t t0, int64_t len, float max) {
  const Vec p = in_context(t0, len) ? exp_nonpositive(load(s + t0) - max) : Vec{};
  std::memcpy(s + t0, &p, sizeof p);
  return p;
}

// A head's softmax is done: its maximum and sum of exps go to `partial` (a chunk), or 1 / the sum to inv_sum[h] (a
// whole context).
inline void finish_softmax(int64_t h, float max, Vec sum, const Partial* partial, float* inv_sum) {
  if (partial) {
    partial->max[h] = max;
    partial->sum[h] = loom::sum_lanes(sum);
  } else {
    inv_sum[h] = 1.f / loom::sum_lanes(sum);
  }
}

// Each query head's scores [h * padded_len, + len) in place -> exp(score - the head's maximum), then finish_softmax.
inline void softmax_scores(float* scores, int64_t num_q, int64_t len, int64_t padded_len, const Partial* partial,
                           float* inv_sum) {
  for (int64_t h = 0; h < num_q; ++h) {
    float* s = scores + h * padded_len;
    const float max = max_score(s, len, padded_len);
    Vec sum = Vec{};
    for (int64_t t0 = 0; t0 < padded_len; t0 += kLanes) sum += exp_scores(s, t0, len, max);
    finish_softmax(h, max, sum, partial, inv_sum);
  }
}

// Attention of the query heads of one sequence whose KV heads are in `heads`, caches of C, rows of type R (see
// RowWalker); q and out of T.
// Scores token by token: a KV head's part of the row is loaded into registers once (bfloat16 widened as loaded)
// for the query heads of its group, and each head's dot products of eight tokens are summed across lanes together
// (one transpose instead of eight horizontal sums). Then the softmax, then values token by token, again loaded
// once per group. VECS > 0 fixes the vectors per head at compile time, so their loops unroll into registers.
// Tokens [begin, end) of the sequence: its whole context goes to `out`, a chunk to `partial`.
template <typename T, typename C, typename R, int64_t VECS>
void attend_decode(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t begin,
                   int64_t end, T* out, const Partial* partial,
                   const PagedGeometry& g, DecodeScratch& scratch) {
  const int64_t group = g.group(), num_q = g.num_kv_heads * group;
  const int64_t len = end - begin;
  const int64_t vecs = VECS > 0 ? VECS : g.padded_dim() / kLanes;
  const int64_t padded_len = round_up(len, kLanes);
  const int64_t head_stride = std::is_same_v<R, C> ? g.head_dim : g.padded_dim();  // between KV heads in a row
  Vec* qv = scratch.q.data();
  Vec* acc = scratch.acc.data();
  Vec* dots = scratch.dots.data();
  float* scores = scratch.scores.data();  // local query head h's scores at scores[h * padded_len ...]
  float* inv_sum = scratch.inv_sum.data();
  for (int64_t h = 0; h < num_q; ++h) {
    float* qf = reinterpret_cast<float*>(qv + h * vecs);
    for (int64_t d = 0; d < g.padded_dim(); ++d)
      qf[d] = d < g.head_dim ? widen(q[h * g.head_dim + d]) * g.scale : 0.f;
  }

  RowWalker<C, R> keys(k_cache, g.k_scales, table, begin, end, g);
  Vec part[kMaxHeadVecs];
  for (int64_t t0 = 0; t0 < padded_len; t0 += kLanes) {
    for (int t = 0; t < kLanes; ++t) {
      if (t0 + t >= len) {  // past the context (masked below)
        for (int64_t h = 0; h < num_q; ++h) dots[h * kLanes + t] = Vec{};
        continue;
      }
      const R* row = keys.next(scratch.row.data());
      for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
#pragma GCC unroll 16
        for (int64_t v = 0; v < vecs; ++v) part[v] = load(row + kv * head_stride + v * kLanes);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          const Vec* qh = qv + h * vecs;
          Vec even = Vec{}, odd = Vec{};
#pragma GCC unroll 16
          for (int64_t v = 0; v < vecs; ++v) (v % 2 ? odd : even) += qh[v] * part[v];
          dots[h * kLanes + t] = even + odd;
        }
      }
    }
    for (int64_t h = 0; h < num_q; ++h) {
      const Vec s = loom::sum_lanes_of_eight(dots + h * kLanes);
      std::memcpy(scores + h * padded_len + t0, &s, sizeof s);
    }
  }

  softmax_scores(scores, num_q, len, padded_len, partial, inv_sum);

  RowWalker<C, R> values(v_cache, g.v_scales, table, begin, end, g);
  std::fill(acc, acc + num_q * vecs, Vec{});
  for (int64_t t = 0; t < len; ++t) {
    const R* row = values.next(scratch.row.data());
    for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
#pragma GCC unroll 16
      for (int64_t v = 0; v < vecs; ++v) part[v] = load(row + kv * head_stride + v * kLanes);
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        const Vec p = splat(scores[h * padded_len + t]);
        Vec* ah = acc + h * vecs;
#pragma GCC unroll 16
        for (int64_t v = 0; v < vecs; ++v) ah[v] += p * part[v];
      }
    }
  }
  for (int64_t h = 0; h < num_q; ++h) {
    const float* a = reinterpret_cast<const float*>(acc + h * vecs);
    if (partial) {
      std::copy(a, a + g.head_dim, partial->acc + h * g.head_dim);
    } else {
      for (int64_t d = 0; d < g.head_dim; ++d) out[h * g.head_dim + d] = T(a[d] * inv_sum[h]);
    }
  }
}

#if defined(__AVX512BF16__)
// The scores of one work item, bfloat16 keys (KD vectors of 32 values a head, GROUP query heads a KV head) by
// AVX-512 BF16: VDPBF16PS multiplies query and key exactly and sums pairs in float32, 32 products an instruction,
// with no widening of the keys; the scale is applied to the sum. Each query head's scores of eight tokens are summed
// across lanes together (vec.h). Tokens [lo, hi) of the item: scores[h * padded_len + t] for local query head h and
// token lo + t (padded_len: the item's, a head's stride in scores).
template <int KD, int GROUP>
void bf16_scores_by_vectors(const c10::BFloat16* q, const c10::BFloat16* k_cache, const int64_t* table,
                            int64_t lo, int64_t hi, const PagedGeometry& g,
                            DecodeScratch& scratch, float* scores, int64_t padded_len) {
  using bf16 = c10::BFloat16;
  constexpr int64_t kDim = 32 * KD;
  const int64_t num_q = g.num_kv_heads * GROUP, len = hi - lo;
  Vec* dots = scratch.dots.data();
  RowWalker<bf16, bf16> keys(k_cache, nullptr, table, lo, hi, g);
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    for (int t = 0; t < kLanes; ++t) {
      if (t0 + t >= len) {  // past the context (masked by softmax_scores)
        for (int64_t h = 0; h < num_q; ++h) dots[h * kLanes + t] = Vec{};
        continue;
      }
      const bf16* row = keys.next(nullptr);
      for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
        __m512bh k[KD];
        for (int v = 0; v < KD; ++v) k[v] = (__m512bh)_mm512_loadu_si512(row + kv * kDim + v * 32);
        for (int h = 0; h < GROUP; ++h) {
          const bf16* qh = q + (kv * GROUP + h) * kDim;
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qh), k[0]);
          for (int v = 1; v < KD; ++v) dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qh + v * 32), k[v]);
          const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(dot), _mm512_extractf32x8_ps(dot, 1));
          dots[(kv * GROUP + h) * kLanes + t] = reinterpret_cast<Vec>(half);
        }
      }
    }
    for (int64_t h = 0; h < num_q; ++h) {
      const Vec sums = loom::sum_lanes_of_eight(dots + h * kLanes) * g.scale;
      std::memcpy(scores + h * padded_len + t0, &sums, sizeof sums);
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kTileTokens = 16;  // keys in one AMX tile: its 16 rows

// The same scores on AMX, for caches whose blocks hold whole 16-token tiles: each KV head's keys of 16 tokens are one A
// tile per 32 values, straight from the cache (rows a cache row apart), and its GROUP query heads one B tile (pairs of
// values, AMX's layout), so TDPBF16PS gives the 16 x GROUP sums. All tiles of the work item first, to scratch, then
// each head's column, scaled. AMX loads wait for memory, so the hardware prefetchers are started on the keys 2 tiles
// ahead (start_streams), and on the same tile's value rows, so the values arrive in L2 while AMX works on the keys
// (an item's values, 192 KiB at 512 tokens of SmolLM2, stay there until the value pass; docs/kernels.md).
template <int KD, int GROUP>
void bf16_scores_by_tiles(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                          const int64_t* table, int64_t lo, int64_t hi, const PagedGeometry& g,
                          DecodeScratch& scratch, float* scores, int64_t padded_len) {
  using bf16 = c10::BFloat16;
  constexpr int64_t kDim = 32 * KD, kAheadTiles = 2;
  const int64_t num_kv = g.num_kv_heads, len = hi - lo;
  loom::amx::TileConfig config;
  // Tile 0: the 16 x GROUP sums; 1: 16 keys' 32 values; 2: the query heads' 16 pairs (the _tile_ intrinsics take
  // literal tile numbers).
  config.rows[0] = config.rows[1] = config.rows[2] = 16;
  config.colsb[0] = config.colsb[2] = GROUP * 4;
  config.colsb[1] = 64;
  _tile_loadconfig(&config);
  // B tiles, [KV head][32-value chunk c][pair i][query head n][2]: the query heads' values 32c + 2i, 32c + 2i + 1.
  bf16* query_tiles = scratch.query_tiles.data();
  for (int64_t kv = 0; kv < num_kv; ++kv)
    for (int c = 0; c < KD; ++c)
      for (int i = 0; i < 16; ++i)
        for (int n = 0; n < GROUP; ++n)
          for (int j = 0; j < 2; ++j)
            query_tiles[(((kv * KD + c) * 16 + i) * GROUP + n) * 2 + j] =
                q[(kv * GROUP + n) * kDim + c * 32 + 2 * i + j];
  const int64_t stride_bytes = g.row_size * 2;
  const int64_t fetch_bytes = num_kv * kDim * 2;
  auto row_at = [&](const bf16* cache, int64_t token) {  // the cache row of `token`
    return cache + g.row_offset(table[token / g.block_size], token % g.block_size);
  };
  auto keys_at = [&](int64_t token) { return row_at(k_cache, token); };
  // Bytes from the first row of the tile at t0 to the end of its last (the item may end inside the tile).
  auto tile_bytes = [&](int64_t t0) { return (std::min(kTileTokens, hi - t0) - 1) * stride_bytes + fetch_bytes; };
  float* sums = scratch.tile_sums.data();  // [tile][KV head][token][GROUP]
  for (int64_t t0 = lo; t0 < std::min(hi, lo + kAheadTiles * kTileTokens); t0 += kTileTokens)
    start_streams(keys_at(t0), tile_bytes(t0));
  for (int64_t t0 = lo; t0 < hi; t0 += kTileTokens) {
    const bf16* keys = keys_at(t0);
    if (t0 + kAheadTiles * kTileTokens < hi)
      start_streams(keys_at(t0 + kAheadTiles * kTileTokens), tile_bytes(t0 + kAheadTiles * kTileTokens));
    start_streams(row_at(v_cache, t0), tile_bytes(t0));
    float* tile_sums = sums + (t0 - lo) / kTileTokens * num_kv * kTileTokens * GROUP;
    for (int64_t kv = 0; kv < num_kv; ++kv) {
      _tile_zero(0);
      for (int c = 0; c < KD; ++c) {
        _tile_loadd(1, keys + kv * kDim + c * 32, stride_bytes);
        _tile_loadd(2, query_tiles + (kv * KD + c) * 16 * GROUP * 2, GROUP * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, tile_sums + kv * kTileTokens * GROUP, GROUP * 4);
    }
  }
  _tile_release();
  // Rows past the item (the rest of its last tile) hold whatever the cache held there: never stored.
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(GROUP));
  const __m512 scale = _mm512_set1_ps(g.scale);
  for (int64_t t0 = 0; t0 < len; t0 += kTileTokens) {
    const int64_t n = std::min(kTileTokens, len - t0);
    const __mmask16 in_context = static_cast<__mmask16>((1u << n) - 1);
    const float* tile_sums = sums + t0 / kTileTokens * num_kv * kTileTokens * GROUP;
    for (int64_t kv = 0; kv < num_kv; ++kv)
      for (int h = 0; h < GROUP; ++h) {
        const __m512 s = _mm512_i32gather_ps(column, tile_sums + kv * kTileTokens * GROUP + h, 4);
        _mm512_mask_storeu_ps(scores + (kv * GROUP + h) * padded_len + t0, in_context, _mm512_mul_ps(s, scale));
      }
  }
}
#endif

// Where an item's second half begins: its tokens [begin, end) split near the middle on a 16-token boundary (whole
// AMX tiles of keys, whole 8-token groups of exps). attend_decode_bf16 takes each half's softmax and value sums
// apart and adds them at the end (add_halves), so that in a step whose items share out unevenly the two halves of
// an item can go to two threads (attend_in_halves) and give the same bits as one thread doing both: each thread then
// reads half the keys and values, into its own L2.
inline int64_t second_half(int64_t begin, int64_t end) {
  return std::min(end, begin + round_up((end - begin + 1) / 2, 16));
}

// An item's scores for its tokens [lo, hi) at scores[h * padded_len + t - lo] (scores: the column of token lo),
// on AMX where the CPU has it. The values' first kAhead blocks of [lo, hi), which the value walk does not prefetch,
// are asked for first, to L2, so they arrive while the scores are computed.
template <int KD, int GROUP>
void bf16_scores(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                 const int64_t* table, int64_t lo, int64_t hi, const PagedGeometry& g, DecodeScratch& scratch,
                 float* scores, int64_t padded_len) {
  constexpr int64_t kDim = 32 * KD;
  for (int64_t b = lo / g.block_size; b < std::min(lo / g.block_size + kAhead, (hi - 1) / g.block_size + 1); ++b) {
    const char* rows = reinterpret_cast<const char*>(v_cache + table[b] * g.block_stride);
    for (int64_t r = 0; r < g.block_size; ++r)
      for (int64_t x = 0; x < g.num_kv_heads * kDim * 2; x += 64)
        _mm_prefetch(rows + r * g.row_size * 2 + x, _MM_HINT_T2);
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (g.block_size % kTileTokens == 0 && loom::amx::request_amx())
    bf16_scores_by_tiles<KD, GROUP>(q, k_cache, v_cache, table, lo, hi, g, scratch, scores, padded_len);
  else
#endif
    bf16_scores_by_vectors<KD, GROUP>(q, k_cache, table, lo, hi, g, scratch, scores, padded_len);
}

// The value walk of an item's tokens [lo, hi) (the item: [begin, end), its scores at scores[h * padded_len + t -
// begin]): exp(score - head_max[h]) in place, and for each local query head the sum of those exps and of the values
// weighted by them, in order: tokens [lo, split) to sums[h] and acc_out[h * head_dim + d], tokens [split, hi) apart
// to split_sums and split_acc (null when split == hi). An empty range's sums are zeros. Both ranges in one walk: its
// prefetches run on across the split.
// One KV head at a time, a cache block at a time; each 32-value vector of a row split into its even and odd values
// as float32 (a shift and a mask: no widening shuffle), GROUP x 2 KD accumulators in registers, put back in order at
// the end (the same sums, in the same order, as widening in order).
// The exps are taken here, a block's just before its rows, so that they overlap with the values' reads; as a pass of
// their own they read no memory and took 6.6% of an item's time.
template <int KD, int GROUP>
void bf16_values(const c10::BFloat16* v_cache, const int64_t* table, int64_t begin, int64_t end, int64_t lo,
                 int64_t split, int64_t hi, const PagedGeometry& g, float* scores, const float* head_max,
                 float* acc_out, float* sums, float* split_acc, float* split_sums) {
  using bf16 = c10::BFloat16;
  constexpr int64_t kDim = 32 * KD;
  const int64_t len = end - begin, padded_len = round_up(len, kLanes);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i first_half = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second_half = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const int64_t segment_end[2] = {split, hi};
  float* const segment_acc[2] = {acc_out, split_acc};
  float* const segment_sums[2] = {sums, split_sums};
  for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
    const bf16* head_cache = v_cache + kv * kDim;
    float* p_first = scores + kv * GROUP * padded_len;
    int64_t t0 = lo, exps_to = lo - begin;  // the group's exps are taken for positions [lo - begin, exps_to)
    for (int segment = 0; segment < (split_acc ? 2 : 1); ++segment) {
      __m512 acc[GROUP][2 * KD];  // [h][2u]: the even values of vector u, [h][2u + 1] the odd ones
      for (int h = 0; h < GROUP; ++h)
        for (int u = 0; u < 2 * KD; ++u) acc[h][u] = _mm512_setzero_ps();
      Vec sum[GROUP] = {};
      while (t0 < segment_end[segment]) {
        const int64_t block = t0 / g.block_size, offset = t0 % g.block_size;
        const int64_t rows = std::min(g.block_size - offset, segment_end[segment] - t0);
        for (; exps_to < t0 - begin + rows; exps_to += kLanes)
          for (int h = 0; h < GROUP; ++h)
            sum[h] += exp_scores(p_first + h * padded_len, exps_to, len, head_max[kv * GROUP + h]);
        const bf16* rows_at = head_cache + table[block] * g.block_stride;
        // While row r of this block is read, row r of the block kAhead on is prefetched (see RowWalker), across the
        // split too.
        const char* ahead = (block + kAhead) * g.block_size < hi
                                ? reinterpret_cast<const char*>(head_cache + table[block + kAhead] * g.block_stride)
                                : nullptr;
        for (int64_t r = offset; r < offset + rows; ++r) {
          const bf16* row = rows_at + r * g.row_size;
          if (ahead)
            for (int64_t b = 0; b < kDim * 2; b += 64) __builtin_prefetch(ahead + r * g.row_size * 2 + b);
          __m512 v[2 * KD];
          for (int u = 0; u < KD; ++u) {
            const __m512i bits = _mm512_loadu_si512(row + u * 32);
            v[2 * u] = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
            v[2 * u + 1] = _mm512_castsi512_ps(_mm512_and_si512(bits, high_half));
          }
          const int64_t t = t0 - begin + r - offset;
          for (int h = 0; h < GROUP; ++h) {
            const __m512 p = _mm512_set1_ps(p_first[h * padded_len + t]);
            for (int u = 0; u < 2 * KD; ++u) acc[h][u] = _mm512_fmadd_ps(p, v[u], acc[h][u]);
          }
        }
        t0 += rows;
      }
      for (int h = 0; h < GROUP; ++h) {
        const int64_t local = kv * GROUP + h;
        segment_sums[segment][local] = loom::sum_lanes(sum[h]);
        float* a = segment_acc[segment] + local * kDim;
        for (int u = 0; u < KD; ++u) {
          _mm512_storeu_ps(a + u * 32, _mm512_permutex2var_ps(acc[h][2 * u], first_half, acc[h][2 * u + 1]));
          _mm512_storeu_ps(a + u * 32 + 16, _mm512_permutex2var_ps(acc[h][2 * u], second_half, acc[h][2 * u + 1]));
        }
      }
    }
  }
}

// An item's result from its two halves' sums (acc, sums: the first half's [num_q][head_dim] and [num_q], then the
// second's): its whole context to `out`, normalized; a chunk's to `partial`, with head_max, for merge_chunks.
inline void add_halves(const float* acc, const float* sums, const float* head_max, int64_t num_q, int64_t head_dim,
                       c10::BFloat16* out, const Partial* partial) {
  for (int64_t h = 0; h < num_q; ++h) {
    const float* first = acc + h * head_dim;
    const float* second = acc + (num_q + h) * head_dim;
    const float total = sums[h] + sums[num_q + h];
    if (partial) {
      partial->max[h] = head_max[h];
      partial->sum[h] = total;
      for (int64_t d = 0; d < head_dim; d += kLanes)
        loom::store(partial->acc + h * head_dim + d, load(first + d) + load(second + d));
    } else {
      const Vec inv = splat(1.f / total);
      for (int64_t d = 0; d < head_dim; d += kLanes)
        loom::store(out + h * head_dim + d, (load(first + d) + load(second + d)) * inv);
    }
  }
}

// bfloat16 attention with AVX-512 BF16 (and AMX for the scores where the CPU has it), for head sizes of whole
// 32-value vectors (KD of them) and GQA groups of up to 8 (GROUP): the same work item as attend_decode, by one
// thread: all its scores, each head's maximum, then each half's value walk (see second_half). It runs within
// 1.2-1.4x of a plain read of the same blocks; the alternatives tried are in docs/kernels.md.
template <int KD, int GROUP>
void attend_decode_bf16(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                        const int64_t* table, int64_t begin, int64_t end,
                        c10::BFloat16* out, const Partial* partial, const PagedGeometry& g, DecodeScratch& scratch) {
  constexpr int64_t kDim = 32 * KD;
  const int64_t num_q = g.num_kv_heads * GROUP, len = end - begin, padded_len = round_up(len, kLanes);
  float* scores = scratch.scores.data();
  bf16_scores<KD, GROUP>(q, k_cache, v_cache, table, begin, end, g, scratch, scores, padded_len);
  float* head_max = scratch.head_max.data();
  for (int64_t h = 0; h < num_q; ++h) head_max[h] = max_score(scores + h * padded_len, len, padded_len);
  const int64_t mid = second_half(begin, end);
  float* acc = scratch.half_acc.data();
  float* sums = scratch.half_sums.data();
  bf16_values<KD, GROUP>(v_cache, table, begin, end, begin, mid, end, g, scores, head_max, acc, sums,
                         acc + num_q * kDim, sums + num_q);
  add_halves(acc, sums, head_max, num_q, kDim, out, partial);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512BF16__)
// 16 bfloat16s as two float32 vectors, exactly: the even-indexed values (a shift) and the odd-indexed ones (a mask),
// from one 32-byte load, with no widening shuffle.
inline void load_bf16_pairs(const c10::BFloat16* p, Vec& even, Vec& odd) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = reinterpret_cast<Vec>(_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)));
  odd = reinterpret_cast<Vec>(_mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0xffff0000u))));
}

// bfloat16 attention with AVX2 alone (no AVX-512 BF16), for head sizes of whole 16-value units (KD of them) and GQA
// groups of up to 8 (GROUP): the same work item as attend_decode. Each unit of a row is split into its even and odd
// values (load_bf16_pairs), and the query heads are kept in that order, so the dot products need no shuffles.
// Values: one KV head at a time and a slice of its units at a time, so that the slice's GROUP x 2 kSlice
// accumulators stay in registers (the 8-lane path keeps all of a group's in memory: 24 at SmolLM2's shape); the
// item's value rows are prefetched while its keys are read, so the passes find them in L2. The sums are put back in
// order at the end. From memory it runs at the rate torch's index_select reads the same blocks.
template <int KD, int GROUP>
void attend_decode_bf16_avx2(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                             const int64_t* table, int64_t begin, int64_t end,
                             c10::BFloat16* out, const Partial* partial, const PagedGeometry& g,
                             DecodeScratch& scratch) {
  using bf16 = c10::BFloat16;
  constexpr int64_t kDim = 16 * KD;
  // Units a values pass: accumulators, values, a probability and the mask in 16 registers up to GROUP 6 (two units
  // at GROUP 3 spilled an accumulator to the stack, a store and reload each token).
  constexpr int kSlice = GROUP <= 2 ? std::min(KD, 2) : 1;
  const int64_t num_kv = g.num_kv_heads, num_q = num_kv * GROUP, len = end - begin, padded_len = round_up(len, kLanes);
  float* scores = scratch.scores.data();
  float* inv_sum = scratch.inv_sum.data();
  Vec* dots = scratch.dots.data();
  Vec* qs = scratch.q.data();  // [local head][2 KD]: each unit's even values, then its odd ones, scaled
  for (int64_t h = 0; h < num_q; ++h)
    for (int u = 0; u < KD; ++u) {
      load_bf16_pairs(q + h * kDim + 16 * u, qs[h * 2 * KD + 2 * u], qs[h * 2 * KD + 2 * u + 1]);
      qs[h * 2 * KD + 2 * u] *= g.scale;
      qs[h * 2 * KD + 2 * u + 1] *= g.scale;
    }

  RowWalker<bf16, bf16> keys(k_cache, nullptr, table, begin, end, g);
  for (int64_t t0 = 0; t0 < padded_len; t0 += kLanes) {
    for (int t = 0; t < kLanes; ++t) {
      if (t0 + t >= len) {  // past the context (masked by softmax_scores)
        for (int64_t h = 0; h < num_q; ++h) dots[h * kLanes + t] = Vec{};
        continue;
      }
      const bf16* row = keys.next(nullptr);
      const int64_t token = begin + t0 + t;
      const char* values_row =
          reinterpret_cast<const char*>(v_cache + g.row_offset(table[token / g.block_size], token % g.block_size));
      for (int64_t b = 0; b < num_kv * kDim * 2; b += 64) __builtin_prefetch(values_row + b);
      for (int64_t kv = 0; kv < num_kv; ++kv) {
        Vec k[2 * KD];
        for (int u = 0; u < KD; ++u) load_bf16_pairs(row + kv * kDim + 16 * u, k[2 * u], k[2 * u + 1]);
        for (int h = 0; h < GROUP; ++h) {
          const Vec* qh = qs + (kv * GROUP + h) * 2 * KD;
          Vec even = qh[0] * k[0], odd = qh[1] * k[1];
          for (int v = 2; v < 2 * KD; v += 2) even += qh[v] * k[v], odd += qh[v + 1] * k[v + 1];
          dots[(kv * GROUP + h) * kLanes + t] = even + odd;
        }
      }
    }
    for (int64_t h = 0; h < num_q; ++h) {
      const Vec s = loom::sum_lanes_of_eight(dots + h * kLanes);
      std::memcpy(scores + h * padded_len + t0, &s, sizeof s);
    }
  }

  softmax_scores(scores, num_q, len, padded_len, partial, inv_sum);

  for (int64_t kv = 0; kv < num_kv; ++kv) {
    const bf16* head_cache = v_cache + kv * kDim;
    const float* p_first = scores + kv * GROUP * padded_len;
    for (int u0 = 0; u0 < KD; u0 += kSlice) {
      Vec acc[GROUP][2 * kSlice] = {};
      for (int64_t t0 = begin; t0 < end;) {
        const int64_t block = t0 / g.block_size, offset = t0 % g.block_size;
        const int64_t rows = std::min(g.block_size - offset, end - t0);
        const bf16* rows_at = head_cache + table[block] * g.block_stride + 16 * u0;
        for (int64_t r = offset; r < offset + rows; ++r) {
          Vec v[2 * kSlice];
          const bf16* row = rows_at + r * g.row_size;
          for (int u = 0; u < kSlice; ++u) load_bf16_pairs(row + 16 * u, v[2 * u], v[2 * u + 1]);
          const int64_t t = t0 - begin + r - offset;
          for (int h = 0; h < GROUP; ++h) {
            const Vec p = splat(p_first[h * padded_len + t]);
            for (int j = 0; j < 2 * kSlice; ++j) acc[h][j] += p * v[j];
          }
        }
        t0 += rows;
      }
      for (int h = 0; h < GROUP; ++h) {
        const int64_t local = kv * GROUP + h;
        for (int u = 0; u < kSlice; ++u) {
          // Even and odd values back in order: dims 0-7 of the unit, then 8-15.
          const __m256 even = reinterpret_cast<__m256>(acc[h][2 * u]);
          const __m256 odd = reinterpret_cast<__m256>(acc[h][2 * u + 1]);
          const __m256 low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd);
          const Vec first = reinterpret_cast<Vec>(_mm256_permute2f128_ps(low, high, 0x20));
          const Vec second = reinterpret_cast<Vec>(_mm256_permute2f128_ps(low, high, 0x31));
          const int64_t d = local * kDim + 16 * (u0 + u);
          if (partial) {
            loom::store(partial->acc + d, first);
            loom::store(partial->acc + d + kLanes, second);
          } else {
            loom::store(out + d, first * inv_sum[local]);
            loom::store(out + d + kLanes, second * inv_sum[local]);
          }
        }
      }
    }
  }
}
#endif

// The bfloat16 decode kernel of this build, for head sizes of whole units of kBf16Unit values (KD of them) and GQA
// groups of up to 8: attend_decode_bf16 where the CPU has AVX-512 BF16, attend_decode_bf16_avx2 where it has AVX2
// alone.
#if defined(__AVX512BF16__) || defined(__AVX2__)
using Bf16Decode = void (*)(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t,
                           int64_t, c10::BFloat16*, const Partial*, const PagedGeometry&, DecodeScratch&);
#if defined(__AVX512BF16__)
constexpr int64_t kBf16Unit = 32;
template <int KD, int GROUP>
constexpr Bf16Decode bf16_decode = &attend_decode_bf16<KD, GROUP>;
#else
constexpr int64_t kBf16Unit = 16;
template <int KD, int GROUP>
constexpr Bf16Decode bf16_decode = &attend_decode_bf16_avx2<KD, GROUP>;
#endif

// bf16_decode for this geometry, or null where it does not apply.
template <int KD, int GROUP = 1>
Bf16Decode bf16_decode_for(int64_t group) {
  if constexpr (GROUP > 8) {
    return nullptr;
  } else {
    return group == GROUP ? bf16_decode<KD, GROUP> : bf16_decode_for<KD, GROUP + 1>(group);
  }
}
#endif

#if defined(__AVX512BF16__)
// attend_decode_bf16's two phases for one geometry, for attend_in_halves.
struct Bf16Phases {
  void (*scores)(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t, int64_t,
                 const PagedGeometry&, DecodeScratch&, float*, int64_t);
  void (*values)(const c10::BFloat16*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                 const PagedGeometry&, float*, const float*, float*, float*, float*, float*);
};

// Bf16Phases for GQA groups of `group` query heads (up to 8) and KD vectors of 32 values a head; nulls otherwise.
template <int KD, int GROUP = 1>
Bf16Phases bf16_phases_for(int64_t group) {
  if constexpr (GROUP > 8) {
    return {nullptr, nullptr};
  } else {
    return group == GROUP ? Bf16Phases{&bf16_scores<KD, GROUP>, &bf16_values<KD, GROUP>}
                          : bf16_phases_for<KD, GROUP + 1>(group);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// 16 int8 codes as float32, exactly (one sign-extending load, one conversion).
inline __m512 codes16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Decode attention over an int8 cache with AVX-512 (VNNI), for head sizes of NV 16-value vectors (NV even) and GQA
// groups of GROUP: the same work item as attend_decode, with no copy of a row. Keys token by token: q is rounded to
// int16 once (quantize_head: an error of at most 2^-16 of the head's largest value, far below bfloat16's own),
// key codes are widened to int16 (one instruction a 32), and VPDPWSSD sums their products exactly in int32; the sum
// times the key's scale and q's is the score. Each head's dot products of eight tokens are summed across lanes
// together (vec.h). Then the softmax (softmax_scores); then values one KV head at a time, codes widened to float32,
// GROUP x NV accumulators in registers, a value's scale folded into its probability.
// Waits for memory were most of its time, so while a key row is read, the key row kAhead blocks on is asked for (as
// RowWalker does) and the same token's value row is asked for to L2 line by line, so the value walk finds its rows
// there. AMX int8 tiles and VPDPWSSD values were no faster (docs/kernels.md).
template <typename T, int NV, int GROUP>
void attend_decode_int8(const T* q, const int8_t* k_cache, const int8_t* v_cache, const int64_t* table,
                        int64_t begin, int64_t end, T* out, const Partial* partial, const PagedGeometry& g,
                        DecodeScratch& scratch) {
  constexpr int64_t kDim = 16 * NV;
  const int64_t num_kv = g.num_kv_heads, num_q = num_kv * GROUP, len = end - begin, padded_len = round_up(len, kLanes);
  const int64_t bs = g.block_size;
  float* scores = scratch.scores.data();
  float* inv_sum = scratch.inv_sum.data();
  Vec* dots = scratch.dots.data();
  int16_t* q16 = reinterpret_cast<int16_t*>(scratch.q.data());  // [local head][kDim]
  float* q_scales = scratch.q_scales.data();                     // [local head]: times g.scale
  for (int64_t h = 0; h < num_q; ++h) q_scales[h] = loom::quantize_head(q + h * kDim, kDim, q16 + h * kDim) * g.scale;

  // Each run of rows [t, t + rows) within one block, in token order: visit(slot of row t, where row t starts in a
  // cache, its item index, rows, the block's index in the table).
  const auto for_each_run = [&](auto visit) {
    for (int64_t t = begin; t < end;) {
      const int64_t block = t / bs, offset = t % bs, rows = std::min(bs - offset, end - t);
      visit(table[block] * bs + offset, g.row_offset(table[block], offset), t - begin, rows, block);
      t += rows;
    }
  };
  const int64_t row_bytes = num_kv * kDim;
  for_each_run([&](int64_t slot0, int64_t row0, int64_t i0, int64_t rows, int64_t block) {
    const bool ahead = (block + kAhead) * bs < end;
    const int64_t ahead_slot0 = ahead ? table[block + kAhead] * bs + slot0 % bs : 0;
    const int64_t ahead_row0 = ahead ? g.row_offset(table[block + kAhead], slot0 % bs) : 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t slot = slot0 + r, i = i0 + r, lane = i % kLanes;
      if (ahead) {
        const char* next = reinterpret_cast<const char*>(k_cache + ahead_row0 + r * g.row_size);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
        __builtin_prefetch(g.k_scales + (ahead_slot0 + r) * num_kv);
      }
      const char* values_row = reinterpret_cast<const char*>(v_cache + row0 + r * g.row_size);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(values_row + b, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(g.v_scales + slot * num_kv), _MM_HINT_T1);
      const int8_t* keys = k_cache + row0 + r * g.row_size;
      for (int64_t kv = 0; kv < num_kv; ++kv) {
        __m512i k[NV / 2];
        for (int u = 0; u < NV / 2; ++u)
          k[u] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + kv * kDim + 32 * u)));
        const __m256 key_scale = _mm256_set1_ps(g.k_scales[slot * num_kv + kv]);
        for (int h = 0; h < GROUP; ++h) {
          const int16_t* qh = q16 + (kv * GROUP + h) * kDim;
          __m512i dot = _mm512_setzero_si512();
          for (int u = 0; u < NV / 2; ++u) dot = _mm512_dpwssd_epi32(dot, _mm512_loadu_si512(qh + 32 * u), k[u]);
          const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(dot), _mm512_extracti32x8_epi32(dot, 1));
          dots[(kv * GROUP + h) * kLanes + lane] =
              reinterpret_cast<Vec>(_mm256_mul_ps(_mm256_cvtepi32_ps(half), key_scale));
        }
      }
      if (lane == kLanes - 1 || i == len - 1) {  // eight tokens' dot products (the last group zero-padded)
        for (int64_t h = 0; h < num_q; ++h) {
          for (int64_t pad = lane + 1; pad < kLanes; ++pad) dots[h * kLanes + pad] = Vec{};
          const Vec s = loom::sum_lanes_of_eight(dots + h * kLanes) * q_scales[h];
          std::memcpy(scores + h * padded_len + i - lane, &s, sizeof s);
        }
      }
    }
  });

  softmax_scores(scores, num_q, len, padded_len, partial, inv_sum);

  for (int64_t kv = 0; kv < num_kv; ++kv) {
    __m512 acc[GROUP][NV];
    for (int h = 0; h < GROUP; ++h)
      for (int u = 0; u < NV; ++u) acc[h][u] = _mm512_setzero_ps();
    const float* p_first = scores + kv * GROUP * padded_len;
    for_each_run([&](int64_t slot0, int64_t row0, int64_t i0, int64_t rows, int64_t) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slot0 + r, i = i0 + r;
        const int8_t* values = v_cache + row0 + r * g.row_size + kv * kDim;
        __m512 v[NV];
        for (int u = 0; u < NV; ++u) v[u] = codes16(values + 16 * u);
        const float value_scale = g.v_scales[slot * num_kv + kv];
        for (int h = 0; h < GROUP; ++h) {
          const __m512 p = _mm512_set1_ps(p_first[h * padded_len + i] * value_scale);
          for (int u = 0; u < NV; ++u) acc[h][u] = _mm512_fmadd_ps(p, v[u], acc[h][u]);
        }
      }
    });
    for (int h = 0; h < GROUP; ++h) {
      const int64_t local = kv * GROUP + h;
      if (partial) {
        for (int u = 0; u < NV; ++u) _mm512_storeu_ps(partial->acc + local * kDim + 16 * u, acc[h][u]);
      } else {
        float a[kDim];
        for (int u = 0; u < NV; ++u)
          _mm512_storeu_ps(a + 16 * u, _mm512_mul_ps(acc[h][u], _mm512_set1_ps(inv_sum[local])));
        for (int64_t d = 0; d < kDim; ++d) out[local * kDim + d] = T(a[d]);
      }
    }
  }
}

// attend_decode_int8 for this geometry (head sizes 32, 64, 128; GQA groups up to 8 whose value accumulators fit in
// registers), or null.
template <typename T, int NV, int GROUP = 1>
auto int8_decode_for(int64_t group) -> decltype(&attend_decode_int8<T, NV, 1>) {
  if constexpr (GROUP > 8 || GROUP * NV > 24) {
    return nullptr;
  } else {
    return group == GROUP ? &attend_decode_int8<T, NV, GROUP> : int8_decode_for<T, NV, GROUP + 1>(group);
  }
}
#endif

// One sequence's output from its chunks' partials (`chunks` of them, for all heads), merged in chunk order:
// each chunk's sums rescaled by exp(its maximum - the overall maximum).
template <typename T>
void merge_chunks(const float* acc, const float* max, const float* sum, int64_t chunks, T* out,
                  const PagedGeometry& g) {
  float merged[kMaxHeadVecs * kLanes];
  for (int64_t h = 0; h < g.num_heads; ++h) {
    float overall = max[h];
    for (int64_t c = 1; c < chunks; ++c) overall = std::max(overall, max[c * g.num_heads + h]);
    float total = 0.f;
    std::fill(merged, merged + g.head_dim, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float scale = std::exp(max[c * g.num_heads + h] - overall);
      total += sum[c * g.num_heads + h] * scale;
      const float* a = acc + (c * g.num_heads + h) * g.head_dim;
      for (int64_t d = 0; d < g.head_dim; ++d) merged[d] += a[d] * scale;
    }
    const float inv_total = 1.f / total;
    for (int64_t d = 0; d < g.head_dim; ++d) out[h * g.head_dim + d] = T(merged[d] * inv_total);
  }
}

// A work item of decode_attention_impl: tokens [begin, end) of sequence seq's context.
struct DecodeItem {
  int64_t seq, begin, end, chunk;  // chunk: its index among all chunks of chunked sequences, or -1
};

#if defined(__AVX512BF16__)
// Work units handed out longest first, each to the thread with the fewest tokens so far: each thread's units, and the
// most tokens any thread gets.
struct Shares {
  std::vector<std::vector<int64_t>> units;
  int64_t most = 0;
};
// Tokens the busiest thread must be spared for attend_in_halves to pay: two more waits for all threads, and each
// thread's parallel-region start, cost about 4 us.
constexpr int64_t kHalvesGain = 128;

inline Shares share_out(const std::vector<int64_t>& tokens, int64_t threads) {
  std::vector<int64_t> order(tokens.size()), load(threads, 0);
  for (size_t u = 0; u < order.size(); ++u) order[u] = static_cast<int64_t>(u);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tokens[a] > tokens[b]; });
  Shares shares{std::vector<std::vector<int64_t>>(threads)};
  for (const int64_t u : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    shares.units[t].push_back(u);
    load[t] += tokens[u];
  }
  shares.most = *std::max_element(load.begin(), load.end());
  return shares;
}

// A step of few work items, unevenly shared by threads (a lone sequence of up to kChunkTokens tokens; one a little
// longer, whose second chunk is short; a few sequences of unequal lengths): each item's two halves (second_half) are
// work units of their own, shared out by share_out, so that each thread reads about as many keys and values, into its
// own L2. First each half's scores and their maxima; then, once every thread's are done, each half's value walk
// under its item's maximum, on the thread that read its keys (whose L2 has its values: bf16_scores streams them);
// then each item's add_halves. The same sums in the same order as attend_decode_bf16 on one thread: the same bits.
// partial_of(item): where a chunk's result goes (none: `out`).
template <typename PartialOf>
void attend_in_halves(const Bf16Phases& phases, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                      const c10::BFloat16* v_cache, const int64_t* block_tables, const std::vector<DecodeItem>& items,
                      const Shares& shares, c10::BFloat16* out, const PagedGeometry& g, PartialOf partial_of) {
  const int64_t n = static_cast<int64_t>(items.size()), num_q = g.num_heads, dim = g.head_dim, units = 2 * n;
  int64_t longest = 0;
  for (const DecodeItem& it : items) longest = std::max(longest, round_up(it.end - it.begin, kLanes));
  // Unit u's maxima at [u][head], value sums [u][head][dim], exp sums [u][head] (unit u: item u / 2's half u % 2).
  std::vector<float> maxima(units * num_q), acc(units * num_q * dim), sums(units * num_q);
  struct Half {
    const DecodeItem& item;
    int64_t lo, hi, padded_len;
    float* scores;  // [head][padded_len], indexed by the item's tokens: the half's own columns are [lo, hi)
  };
  // Unit u's half, its scores in the thread's own scratch (only the thread that reads a half's keys uses its scores).
  const auto half = [&](int64_t u, float* scores) {
    const DecodeItem& it = items[u / 2];
    const int64_t mid = second_half(it.begin, it.end);
    return Half{it, u % 2 ? mid : it.begin, u % 2 ? it.end : mid, round_up(it.end - it.begin, kLanes), scores};
  };
  // The item's maximum of each head, from its halves'.
  const auto item_max = [&](int64_t i, float* head_max) {
    const float* m = maxima.data() + 2 * i * num_q;
    for (int64_t h = 0; h < num_q; ++h) head_max[h] = std::max(m[h], m[num_q + h]);
  };
#pragma omp parallel num_threads(static_cast<int>(shares.units.size()))
  {
    DecodeScratch& scratch = kept_decode_scratch(g, longest);
    // This thread's units: its own share, and those of any thread the runtime did not start.
    std::vector<int64_t> mine;
    for (size_t t = omp_get_thread_num(); t < shares.units.size(); t += omp_get_num_threads())
      mine.insert(mine.end(), shares.units[t].begin(), shares.units[t].end());
    const int64_t unit_floats = num_q * longest;
    if (scratch.unit_scores.size() < mine.size() * unit_floats) scratch.unit_scores.resize(mine.size() * unit_floats);
    const auto my_half = [&](size_t k) { return half(mine[k], scratch.unit_scores.data() + k * unit_floats); };
    for (size_t k = 0; k < mine.size(); ++k) {
      const int64_t u = mine[k];
      const Half x = my_half(k);
      const int64_t seq = x.item.seq, len = x.hi - x.lo;
      float* first = x.scores + (x.lo - x.item.begin);  // the column of the half's first token
      if (len > 0)
        phases.scores(q + seq * g.q_row_stride, k_cache, v_cache, block_tables + seq * g.max_blocks, x.lo, x.hi, g,
                      scratch, first, x.padded_len);
      for (int64_t h = 0; h < num_q; ++h)
        maxima[u * num_q + h] = len > 0 ? max_score(first + h * x.padded_len, len, round_up(len, kLanes)) : kMasked;
    }
#pragma omp barrier
    for (size_t k = 0; k < mine.size(); ++k) {
      const int64_t u = mine[k];
      const Half x = my_half(k);
      item_max(u / 2, scratch.head_max.data());
      phases.values(v_cache, block_tables + x.item.seq * g.max_blocks, x.item.begin, x.item.end, x.lo, x.hi, x.hi,
                    g, x.scores, scratch.head_max.data(), acc.data() + u * num_q * dim, sums.data() + u * num_q,
                    nullptr, nullptr);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      item_max(i, scratch.head_max.data());
      const std::optional<Partial> partial = partial_of(items[i]);
      add_halves(acc.data() + 2 * i * num_q * dim, sums.data() + 2 * i * num_q, scratch.head_max.data(), num_q, dim,
                 out + items[i].seq * num_q * dim, partial ? &*partial : nullptr);
    }
  }
}
#endif

// Items [first, end) of decode_attention_impl's list, attended one after another by one thread; their tokens.
struct ItemRun {
  int64_t first, end, tokens;
};

// Items that begin at the same cache block (sequences whose prompts share a cached prefix: the prefix cache hands
// them the same blocks) are put side by side, in order of their block tables, and attended in runs by one thread, so
// that the blocks they share are read from memory by the first and from that core's L2 by the others (where the
// items are spread over the step instead, the shared blocks of a 64-sequence step, ~10 MB a layer, have left the
// cache before the next sharer reads them). A run holds at most a quarter of a thread's share of the step's tokens,
// so a step whose sequences all share one system prompt still uses every thread. Runs go longest first. Each item's
// sums are its own, so the order changes no bit.
inline std::vector<ItemRun> runs_sharing_blocks(std::vector<DecodeItem>& items, const int64_t* block_tables,
                                                const PagedGeometry& g) {
  const auto table_from = [&](const DecodeItem& it) {
    return block_tables + it.seq * g.max_blocks + it.begin / g.block_size;
  };
  const auto blocks_of = [&](const DecodeItem& it) { return (it.end - it.begin + g.block_size - 1) / g.block_size; };
  std::stable_sort(items.begin(), items.end(), [&](const DecodeItem& a, const DecodeItem& b) {
    return std::lexicographical_compare(table_from(a), table_from(a) + blocks_of(a), table_from(b),
                                        table_from(b) + blocks_of(b));
  });
  int64_t total = 0;
  for (const DecodeItem& it : items) total += it.end - it.begin;
  const int64_t cap = std::max<int64_t>(1, total / (4 * at::get_num_threads()));
  std::vector<ItemRun> runs;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const int64_t tokens = items[i].end - items[i].begin;
    if (!runs.empty() && *table_from(items[i]) == *table_from(items[i - 1]) && runs.back().tokens + tokens <= cap) {
      runs.back().end = i + 1;
      runs.back().tokens += tokens;
    } else {
      runs.push_back({i, i + 1, tokens});
    }
  }
  std::stable_sort(runs.begin(), runs.end(), [](const ItemRun& a, const ItemRun& b) { return a.tokens > b.tokens; });
  return runs;
}

// q and out of T, caches of C (T, or int8 codes).
template <typename T, typename C>
void decode_attention_impl(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                           const int64_t* context_lens, T* out, int64_t num_seqs, int64_t max_len,
                           const PagedGeometry& g) {
  // A work item is a whole sequence, so that each token's row (all KV heads) is read in one piece. A context
  // longer than kChunkTokens is cut into chunks of that many tokens, each its own item, merged at the end: so one
  // long sequence is read by all threads. The chunks depend on the context length alone, never on the batch, so a
  // sequence gets the same bits in any batch. Handed out one run at a time (runs_sharing_blocks), longest first for
  // an even split.
  // Items are whole rows, not KV heads: an item per head read a third of every row, and the hardware prefetchers
  // brought in whole rows anyway, so each row came from memory up to three times (docs/kernels.md).
  std::vector<DecodeItem> items;
  std::vector<int64_t> first_chunk(num_seqs, -1);  // a chunked sequence's first chunk index
  int64_t num_chunks = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = context_lens[seq], chunks = (len + kChunkTokens - 1) / kChunkTokens;
    if (chunks > 1) first_chunk[seq] = num_chunks, num_chunks += chunks;
    for (int64_t c = 0; c < chunks; ++c)
      items.push_back({seq, c * kChunkTokens, std::min(len, (c + 1) * kChunkTokens),
                       chunks > 1 ? first_chunk[seq] + c : -1});
  }
  std::vector<float> chunk_acc(num_chunks * g.num_heads * g.head_dim), chunk_max(num_chunks * g.num_heads),
      chunk_sum(num_chunks * g.num_heads);
  // Where a chunk's results go before the merge (a whole context's: none, straight to `out`).
  const auto partial_of = [&](const DecodeItem& it) -> std::optional<Partial> {
    if (it.chunk < 0) return std::nullopt;
    const int64_t first = it.chunk * g.num_heads;  // the chunk's first head
    return Partial{chunk_acc.data() + first * g.head_dim, chunk_max.data() + first, chunk_sum.data() + first};
  };
  const auto merge = [&](int64_t seq) {
    const int64_t c = first_chunk[seq];
    merge_chunks(chunk_acc.data() + c * g.num_heads * g.head_dim, chunk_max.data() + c * g.num_heads,
                 chunk_sum.data() + c * g.num_heads, (context_lens[seq] + kChunkTokens - 1) / kChunkTokens,
                 out + seq * g.num_heads * g.head_dim, g);
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
    Bf16Phases phases{nullptr, nullptr};
    if (g.head_dim == 32) phases = bf16_phases_for<1>(g.group());
    if (g.head_dim == 64) phases = bf16_phases_for<2>(g.group());
    if (g.head_dim == 128) phases = bf16_phases_for<4>(g.group());
    // Halves where they share the work out more evenly than whole items, by kHalvesGain tokens on the busiest thread
    // (they cost two more waits for all threads); only for a few items a thread, whose values stay in L2 between the
    // two phases.
    const int64_t threads = at::get_num_threads();
    if (phases.scores && threads > 1 && static_cast<int64_t>(items.size()) <= 2 * threads) {
      std::vector<int64_t> item_tokens, half_tokens;
      for (const DecodeItem& it : items) {
        const int64_t mid = second_half(it.begin, it.end);
        item_tokens.push_back(it.end - it.begin);
        half_tokens.push_back(mid - it.begin), half_tokens.push_back(it.end - mid);
      }
      const Shares halves = share_out(half_tokens, threads);
      if (halves.most + kHalvesGain <= share_out(item_tokens, threads).most) {
        attend_in_halves(phases, q, k_cache, v_cache, block_tables, items, halves, out, g, partial_of);
        for (int64_t seq = 0; seq < num_seqs; ++seq)
          if (first_chunk[seq] >= 0) merge(seq);
        return;
      }
    }
  }
#endif
  // Chunks of each chunked sequence still to attend: the thread that finishes its last one merges them, inside the
  // parallel loop (merging after it, on one thread, left the other waiting).
  std::unique_ptr<std::atomic<int64_t>[]> chunks_left(new std::atomic<int64_t>[num_seqs]);
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    chunks_left[seq].store((context_lens[seq] + kChunkTokens - 1) / kChunkTokens, std::memory_order_relaxed);
  // Rows in place where vec.h can load them (float32, bfloat16) as whole vectors; copied otherwise (int8 codes
  // among them).
  auto attend = attend_decode<T, C, float, 0>;
  if constexpr (std::is_same_v<C, T> && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>)) {
    if (g.head_dim == g.padded_dim())
      attend = g.padded_dim() == 8 * kLanes    ? attend_decode<T, T, T, 8>
               : g.padded_dim() == 16 * kLanes ? attend_decode<T, T, T, 16>
                                             : attend_decode<T, T, T, 0>;
  }
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if constexpr (std::is_same_v<C, int8_t> && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>)) {
    decltype(attend) fast = nullptr;
    if (g.head_dim == 32) fast = int8_decode_for<T, 2>(g.group());
    if (g.head_dim == 64) fast = int8_decode_for<T, 4>(g.group());
    if (g.head_dim == 128) fast = int8_decode_for<T, 8>(g.group());
    if (fast) attend = fast;
  }
#endif
#if defined(__AVX512BF16__) || defined(__AVX2__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
    decltype(attend) fast = nullptr;
    if (g.head_dim == 32) fast = bf16_decode_for<32 / kBf16Unit>(g.group());
    if (g.head_dim == 64) fast = bf16_decode_for<64 / kBf16Unit>(g.group());
    if (g.head_dim == 128) fast = bf16_decode_for<128 / kBf16Unit>(g.group());
    if (fast) attend = fast;
  }
#endif
  const std::vector<ItemRun> runs = runs_sharing_blocks(items, block_tables, g);
  loom::for_each_item(
      static_cast<int64_t>(runs.size()),
      [&]() -> DecodeScratch& { return kept_decode_scratch(g, std::min(max_len, kChunkTokens)); },
      [&](int64_t r, DecodeScratch& scratch) {
        for (int64_t i = runs[r].first; i < runs[r].end; ++i) {
          const DecodeItem& it = items[i];
          const std::optional<Partial> partial = partial_of(it);
          attend(q + it.seq * g.q_row_stride, k_cache, v_cache, block_tables + it.seq * g.max_blocks, it.begin,
                 it.end, out + it.seq * g.num_heads * g.head_dim, partial ? &*partial : nullptr, g, scratch);
          // acq_rel: the merging thread sees every other chunk's partials.
          if (partial && chunks_left[it.seq].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(it.seq);
        }
      });
}

}  // namespace

// q, out: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or
// int8 with their scales (paged_geometry.h); block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs]
// int64 (keys each query may see).
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_tables, const torch::Tensor& context_lens, torch::Tensor& out,
                      double scale, const std::optional<torch::Tensor>& k_scales,
                      const std::optional<torch::Tensor>& v_scales) {
  const PagedGeometry g = loom::check_paged_inputs("decode_attention", q, k_cache, v_cache, block_tables, context_lens,
                                                   out, scale, k_scales, v_scales);
  TORCH_CHECK(g.head_dim <= kMaxHeadVecs * kLanes, "head sizes up to ", kMaxHeadVecs * kLanes, " are supported");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(lens.numel() == q.size(0) && tables.size(0) == q.size(0), "one block table and length per query");
  // The lengths' checks and maximum by a plain loop: torch's min() and max() were two reductions a layer.
  const int64_t* len_data = lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t i = 0; i < lens.numel(); ++i) {
    TORCH_CHECK(len_data[i] >= 1, "every sequence needs at least one key");
    max_len = std::max(max_len, len_data[i]);
  }
  TORCH_CHECK(max_len <= tables.size(1) * k_cache.size(1), "a context length exceeds its block table");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    if (g.k_scales)
      decode_attention_impl(q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
                            max_len, g);
    else
      decode_attention_impl(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0),
                            max_len, g);
  });
}

// Defined in prefill_attention.cpp.
void prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                       const torch::Tensor& query_starts, int64_t first_seq, torch::Tensor& out, double scale,
                       const std::optional<torch::Tensor>& k_scales, const std::optional<torch::Tensor>& v_scales);

// Defined in write_kv.cpp.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping, const std::optional<torch::Tensor>& k_scales,
              const std::optional<torch::Tensor>& v_scales);

// One layer's attention for a whole step: the step's K/V stored at their slots, then rows [0, num_decodes) by
// decode_attention and the prompt chunks after them by prefill_attention, into a new out [T, H * D]. One call from
// Python instead of two or three, with their views: between the kernels of a decode step, each Python frame and
// torch op costs microseconds. Scales: an int8 cache's (None for others).
torch::Tensor attend_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          torch::Tensor& k_cache, torch::Tensor& v_cache, const std::optional<torch::Tensor>& k_scales,
                          const std::optional<torch::Tensor>& v_scales, const torch::Tensor& slot_mapping,
                          const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                          const torch::Tensor& query_starts, int64_t num_decodes, double scale) {
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= num_seqs && num_decodes <= q.size(0),
              "num_decodes must count the step's first sequences, one query row each");
  write_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales);
  auto out = torch::empty(q.sizes(), q.options());
  // The first n rows of t: t itself when they are all of it, as in a step of decodes alone (a view costs about
  // 2 us here, and this call runs once a layer).
  const auto first_rows = [](const torch::Tensor& t, int64_t n) { return n == t.size(0) ? t : t.narrow(0, 0, n); };
  if (num_decodes > 0) {
    auto decode_out = first_rows(out, num_decodes);
    decode_attention(first_rows(q, num_decodes), k_cache, v_cache, first_rows(block_tables, num_decodes),
                     first_rows(context_lens, num_decodes), decode_out, scale, k_scales, v_scales);
  }
  if (num_seqs > num_decodes)
    prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_starts, num_decodes, out, scale, k_scales,
                      v_scales);
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_step", &attend_step, "one layer's store + decode + prefill attention for a step");
  using pybind11::arg;
  m.def("write_kv", &write_kv, "store the step's K/V rows at their cache slots", arg("k"), arg("v"), arg("k_cache"),
        arg("v_cache"), arg("slot_mapping"), arg("k_scales") = pybind11::none(), arg("v_scales") = pybind11::none());
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)", arg("q"), arg("k_cache"),
        arg("v_cache"), arg("block_tables"), arg("context_lens"), arg("out"), arg("scale"),
        arg("k_scales") = pybind11::none(), arg("v_scales") = pybind11::none());
  m.def("prefill_attention", &prefill_attention, "paged prefill attention, flash style (CPU)", arg("q"),
        arg("k_cache"), arg("v_cache"), arg("block_tables"), arg("context_lens"), arg("query_starts"),
        arg("first_seq"), arg("out"), arg("scale"), arg("k_scales") = pybind11::none(),
        arg("v_scales") = pybind11::none());
  m.attr("attend_step_entry") = loom::entry::export_entry<loom::entry::AttendStep>(&attend_step);
}
