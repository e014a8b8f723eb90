// Prefill attention straight from the paged KV cache, flash-attention style: every prompt chunk of the step in one
// call, each chunk's queries causal over its whole context (earlier chunks included), K and V read block by block
// through the block table, scores never leaving the cache.
//
// A tile is kRows query rows of one (sequence, KV head): the rows are the (token, head) pairs of that head's GQA
// group, so each key is read once for the whole group. Vectors run along the query rows: Q^T[d][r], scores
// S^T[key][r], the running max and sum per row, and the output O^T[d][r] are all rows of kRows floats, so the online
// softmax (max, exp, rescale) is elementwise and both matmuls are register tiles of broadcast-FMAs. A work item is up
// to kMaxTilesPerItem consecutive tiles, which share each step's keys and values, read (and widened to float32) once:
// per tile, widening took about a tenth of the kernel.
// Written with the vector extensions of vec.h. Bound into the `loom_paged_attention` module by paged_attention.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bfloat16.h"
#include "int8_kv.h"
#include "paged_geometry.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using loom::exp_nonpositive;
using loom::kLanes;
using loom::kMasked;
using loom::PagedGeometry;
using loom::splat;
using loom::Vec;
using loom::vmax;
using loom::widen;

constexpr int kVecs = 3;                 // query rows per tile = kVecs * kLanes (24: 8 tokens of a group of 3)
constexpr int kRows = kVecs * kLanes;
constexpr int kKeyTile = 4;              // keys per score register tile: 4 x kVecs accumulators
constexpr int kDimTile = 4;              // head dims per output register tile
constexpr int64_t kStepKeys = 64;        // keys per online-softmax step (whole cache blocks, at least one)
constexpr int kMaxRuns = kStepKeys;      // blocks per step at most (block_size 1)
constexpr int kMaxTilesPerItem = 8;      // tiles of one work item, which share each step's keys
constexpr int kItemsPerThread = 4;       // fewer tiles an item while there would be fewer items a thread

// A run of keys (one cache block's) as float32 rows: `stride` floats apart.
struct KeyRun {
  const float* rows;
  int64_t stride, count;
};

// One cache block's K or V rows for one KV head as float32: float32 read in place (a row every row_size floats),
// bfloat16 widened and int8 codes dequantized into `buffer` (a row every head_dim floats). scales: an int8 cache's,
// the block's first row's for this head, a row every num_kv_heads (else null).
template <typename C>
inline KeyRun block_rows(const C* rows, const float* scales, int64_t count, int64_t head_dim, int64_t row_size,
                         int64_t num_kv_heads, float* buffer) {
  if constexpr (std::is_same_v<C, float>) {
    return {rows, row_size, count};
  } else {
    for (int64_t j = 0; j < count; ++j) {
      const float scale = scales ? scales[j * num_kv_heads] : 1.f;
      for (int64_t d = 0; d < head_dim; ++d) buffer[j * head_dim + d] = loom::dequantized(rows[j * row_size + d], scale);
    }
    return {buffer, head_dim, count};
  }
}

// s[j] = Q^T . key_j for KEYS keys: s[j][v] are the scores of key j for the tile's rows (vector v).
template <int KEYS>
inline void score_tile(const Vec* qt, const float* keys, int64_t stride, int64_t head_dim, Vec* s) {
  Vec acc[KEYS][kVecs] = {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const Vec* q = qt + d * kVecs;
#pragma GCC unroll 4
    for (int j = 0; j < KEYS; ++j) {
      const Vec k = splat(keys[j * stride + d]);
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[j][v] += k * q[v];
    }
  }
  for (int j = 0; j < KEYS; ++j)
    for (int v = 0; v < kVecs; ++v) s[j * kVecs + v] = acc[j][v];
}

// O^T[d] = O^T[d] * alpha + sum_j p[j] * value_j[d] for DIMS dims starting at d0, over the step's runs of values.
template <int DIMS>
inline void value_tile(Vec* ot, const Vec* alpha, const Vec* p, const KeyRun* runs, int num_runs, int64_t d0) {
  Vec acc[DIMS][kVecs];
#pragma GCC unroll 4
  for (int i = 0; i < DIMS; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[i][v] = ot[(d0 + i) * kVecs + v] * alpha[v];
  for (int run = 0; run < num_runs; ++run) {
    const float* values = runs[run].rows + d0;
    const int64_t stride = runs[run].stride;
    for (int64_t j = 0; j < runs[run].count; ++j, p += kVecs) {
#pragma GCC unroll 4
      for (int i = 0; i < DIMS; ++i) {
        const Vec x = splat(values[j * stride + i]);
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) acc[i][v] += x * p[v];
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < DIMS; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) ot[(d0 + i) * kVecs + v] = acc[i][v];
}

// The running state of one register tile: its query rows transposed and scaled, its output, and the online
// softmax's max and sum per row.
struct TileState {
  Vec* qt;  // [head_dim][kVecs]
  Vec* ot;  // [head_dim][kVecs]
  Vec m[kVecs], l[kVecs], row_pos[kVecs];
  int64_t row0, rows, first_pos, last_pos;
};

// The first `count` keys of `runs` as runs of their own; returns how many runs that takes.
inline int first_keys(const KeyRun* runs, int num_runs, int64_t count, KeyRun* out) {
  int used = 0;
  for (; used < num_runs && count > 0; ++used) {
    out[used] = runs[used];
    out[used].count = std::min(out[used].count, count);
    count -= out[used].count;
  }
  return used;
}

// One step of one tile over the step's first `count` keys (positions t0...): scores into s, the online-softmax
// update, then one pass of V.
inline void tile_step(TileState& tile, const KeyRun* key_runs, const KeyRun* value_runs, int num_runs, int64_t t0,
                      int64_t count, int64_t head_dim, Vec* s) {
  KeyRun keys[kMaxRuns], values[kMaxRuns];
  num_runs = first_keys(key_runs, num_runs, count, keys);
  first_keys(value_runs, num_runs, count, values);
  for (int run = 0, offset = 0; run < num_runs; offset += keys[run].count, ++run) {
    Vec* sr = s + offset * kVecs;
    int64_t j = 0;
    for (; j + kKeyTile <= keys[run].count; j += kKeyTile)
      score_tile<kKeyTile>(tile.qt, keys[run].rows + j * keys[run].stride, keys[run].stride, head_dim, sr + j * kVecs);
    for (; j < keys[run].count; ++j)
      score_tile<1>(tile.qt, keys[run].rows + j * keys[run].stride, keys[run].stride, head_dim, sr + j * kVecs);
  }
  if (t0 + count - 1 > tile.first_pos)  // the diagonal: a key after a row's own position is masked
    for (int64_t j = 0; j < count; ++j)
      for (int v = 0; v < kVecs; ++v)
        s[j * kVecs + v] = splat(static_cast<float>(t0 + j)) > tile.row_pos[v] ? splat(kMasked) : s[j * kVecs + v];
  Vec alpha[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    Vec step_max = tile.m[v];
    for (int64_t j = 0; j < count; ++j) step_max = vmax(step_max, s[j * kVecs + v]);
    alpha[v] = exp_nonpositive(tile.m[v] - step_max);
    Vec sum = Vec{};
    for (int64_t j = 0; j < count; ++j) {
      const Vec p = exp_nonpositive(s[j * kVecs + v] - step_max);
      s[j * kVecs + v] = p;
      sum += p;
    }
    tile.l[v] = tile.l[v] * alpha[v] + sum;
    tile.m[v] = step_max;
  }
  int64_t d0 = 0;
  for (; d0 + kDimTile <= head_dim; d0 += kDimTile) value_tile<kDimTile>(tile.ot, alpha, s, values, num_runs, d0);
  for (; d0 < head_dim; ++d0) value_tile<1>(tile.ot, alpha, s, values, num_runs, d0);
}

// Per-thread buffers: the tiles' states, one step's scores, one step's keys and values as float32.
struct Scratch {
  std::vector<Vec> tiles;   // tiles per item x (qt, ot)
  std::vector<Vec> scores;  // [step keys][kVecs]
  std::vector<float> kv_buffer;
};

// One item: up to `tiles_per_item` consecutive tiles of kRows query rows, from row0 of the chunk's (token, group head)
// rows for KV head kvh. Each step's keys are read (and widened) once for all of the item's tiles. q and out of T,
// caches of C (T, or int8 codes).
template <typename T, typename C>
void attend_tiles(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t n, int64_t ctx,
                  int64_t kvh, int64_t row0, int64_t tiles_per_item, T* out, const PagedGeometry& g,
                  Scratch& scratch) {
  const int64_t group = g.group(), head_dim = g.head_dim;
  const int64_t num_tiles = std::min<int64_t>(tiles_per_item, (n * group - row0 + kRows - 1) / kRows);
  TileState tiles[kMaxTilesPerItem];
  for (int64_t t = 0; t < num_tiles; ++t) {
    TileState& tile = tiles[t];
    tile.qt = scratch.tiles.data() + 2 * t * head_dim * kVecs;
    tile.ot = tile.qt + head_dim * kVecs;
    tile.row0 = row0 + t * kRows;
    tile.rows = std::min<int64_t>(kRows, n * group - tile.row0);
    float* qt_f = reinterpret_cast<float*>(tile.qt);
    float* pos_f = reinterpret_cast<float*>(tile.row_pos);
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t token = (tile.row0 + std::min(r, tile.rows - 1)) / group;
      const int64_t head = kvh * group + (tile.row0 + r) % group;
      pos_f[r] = static_cast<float>(ctx - n + token);
      const T* qr = q + token * g.q_row_stride + head * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) qt_f[d * kRows + r] = r < tile.rows ? widen(qr[d]) * g.scale : 0.f;
    }
    std::fill(tile.ot, tile.ot + head_dim * kVecs, Vec{});
    for (int v = 0; v < kVecs; ++v) tile.m[v] = splat(kMasked), tile.l[v] = Vec{};
    tile.first_pos = ctx - n + tile.row0 / group;
    tile.last_pos = ctx - n + (tile.row0 + tile.rows - 1) / group;
  }

  const int64_t last_pos = tiles[num_tiles - 1].last_pos;
  const int64_t step_blocks = std::max<int64_t>(1, kStepKeys / g.block_size);
  KeyRun key_runs[kMaxRuns], value_runs[kMaxRuns];
  for (int64_t b = 0, t0 = 0; t0 <= last_pos; t0 += step_blocks * g.block_size) {
    // One step: up to step_blocks blocks of keys, then each tile that reaches them takes its share.
    int num_runs = 0;
    int64_t count = 0;
    for (; num_runs < step_blocks && t0 + count <= last_pos; ++num_runs, ++b) {
      const int64_t run_count = std::min(g.block_size, last_pos + 1 - t0 - count);
      const int64_t offset = table[b] * g.block_stride + kvh * head_dim;
      const int64_t scale_at = table[b] * g.block_size * g.num_kv_heads + kvh;
      float* k_buffer = scratch.kv_buffer.data() + count * head_dim;
      float* v_buffer = k_buffer + step_blocks * g.block_size * head_dim;
      key_runs[num_runs] = block_rows(k_cache + offset, g.k_scales ? g.k_scales + scale_at : nullptr, run_count,
                                      head_dim, g.row_size, g.num_kv_heads, k_buffer);
      value_runs[num_runs] = block_rows(v_cache + offset, g.v_scales ? g.v_scales + scale_at : nullptr, run_count,
                                        head_dim, g.row_size, g.num_kv_heads, v_buffer);
      count += run_count;
    }
    for (int64_t t = 0; t < num_tiles; ++t)
      if (tiles[t].last_pos >= t0)
        tile_step(tiles[t], key_runs, value_runs, num_runs, t0, std::min(count, tiles[t].last_pos + 1 - t0),
                  head_dim, scratch.scores.data());
  }

  for (int64_t t = 0; t < num_tiles; ++t) {
    const TileState& tile = tiles[t];
    const float* ot_f = reinterpret_cast<const float*>(tile.ot);
    const float* l_f = reinterpret_cast<const float*>(tile.l);
    for (int64_t r = 0; r < tile.rows; ++r) {
      const int64_t token = (tile.row0 + r) / group, head = kvh * group + (tile.row0 + r) % group;
      T* o = out + (token * g.num_heads + head) * head_dim;
      const float inv = 1.f / l_f[r];
      for (int64_t d = 0; d < head_dim; ++d) o[d] = T(ot_f[d * kRows + r] * inv);
    }
  }
}

template <typename T, typename C>
void prefill_attention_impl(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                            const int64_t* context_lens, const int64_t* query_starts, int64_t first_seq,
                            int64_t num_seqs, T* out, const PagedGeometry& g) {
  const int64_t group = g.group();
  // Work items (seq, kv head, first row), the costliest (last) rows of each chunk first for an even split. The
  // grouping of tiles into items changes no result: each tile reads the same keys in the same steps.
  int64_t num_tiles = 0;
  for (int64_t seq = first_seq; seq < num_seqs; ++seq)
    num_tiles += ((query_starts[seq + 1] - query_starts[seq]) * group + kRows - 1) / kRows * g.num_kv_heads;
  const int64_t tiles_per_item = std::clamp<int64_t>(
      num_tiles / (kItemsPerThread * at::get_num_threads()), 1, kMaxTilesPerItem);
  const int64_t item_rows = tiles_per_item * kRows;
  struct Item { int64_t seq, kvh, row0; };
  std::vector<Item> items;
  for (int64_t seq = first_seq; seq < num_seqs; ++seq) {
    const int64_t rows = (query_starts[seq + 1] - query_starts[seq]) * group;
    for (int64_t row0 = (rows - 1) / item_rows * item_rows; row0 >= 0; row0 -= item_rows)
      for (int64_t kvh = 0; kvh < g.num_kv_heads; ++kvh) items.push_back({seq, kvh, row0});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t step_keys = std::max<int64_t>(1, kStepKeys / g.block_size) * g.block_size;
  loom::for_each_item(
      num_items,
      [&] { return Scratch{std::vector<Vec>(tiles_per_item * 2 * g.head_dim * kVecs),
                           std::vector<Vec>(step_keys * kVecs), std::vector<float>(2 * step_keys * g.head_dim)}; },
      [&](int64_t i, Scratch& scratch) {
        const Item& it = items[i];
        const int64_t start = query_starts[it.seq];
        attend_tiles(q + start * g.q_row_stride, k_cache, v_cache, block_tables + it.seq * g.max_blocks,
                     query_starts[it.seq + 1] - start, context_lens[it.seq], it.kvh, it.row0, tiles_per_item,
                     out + start * g.num_heads * g.head_dim, g, scratch);
      });
}

}  // namespace

// Defined in prefill_attention_amx.cpp: the same work for bfloat16 on AMX where it applies, else false.
bool prefill_attention_amx(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const int64_t* tables, const int64_t* context_lens, const int64_t* query_starts,
                           int64_t first_seq, int64_t num_seqs, torch::Tensor& out, const PagedGeometry& g);

// q, out: [T, num_heads, head_dim] for the whole step; caches: [num_blocks, block_size, num_kv_heads, head_dim], q's
// dtype or int8 with their scales (paged_geometry.h); block_tables [S, max_blocks], context_lens [S], query_starts
// [S+1]: int64. Fills the rows of sequences first_seq..S-1, each chunk's queries being the last positions of its
// context_lens[s] keys.
void prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                       const torch::Tensor& query_starts, int64_t first_seq, torch::Tensor& out, double scale,
                       const std::optional<torch::Tensor>& k_scales, const std::optional<torch::Tensor>& v_scales) {
  const PagedGeometry g = loom::check_paged_inputs("prefill_attention", q, k_cache, v_cache, block_tables, context_lens,
                                                   out, scale, k_scales, v_scales);
  TORCH_CHECK(query_starts.scalar_type() == at::kLong, "query_starts must be int64");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto starts = query_starts.contiguous();
  const int64_t num_seqs = lens.numel();
  TORCH_CHECK(tables.size(0) == num_seqs && starts.numel() == num_seqs + 1,
              "one block table, length and start per sequence");
  TORCH_CHECK(0 <= first_seq && first_seq <= num_seqs, "first_seq out of range");
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* c = lens.data_ptr<int64_t>();
  TORCH_CHECK(s[num_seqs] <= q.size(0), "query_starts exceed q");
  for (int64_t i = first_seq; i < num_seqs; ++i) {
    TORCH_CHECK(s[i] < s[i + 1], "every chunk needs at least one query token");
    TORCH_CHECK(s[i + 1] - s[i] <= c[i], "a chunk is longer than its context");
    TORCH_CHECK(c[i] <= tables.size(1) * k_cache.size(1), "a context length exceeds its block table");
  }
  if (prefill_attention_amx(q, k_cache, v_cache, tables.data_ptr<int64_t>(), c, s, first_seq, num_seqs, out, g)) return;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "prefill_attention", [&] {
    if (g.k_scales)
      prefill_attention_impl(q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                             tables.data_ptr<int64_t>(), c, s, first_seq, num_seqs, out.data_ptr<scalar_t>(), g);
    else
      prefill_attention_impl(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                             tables.data_ptr<int64_t>(), c, s, first_seq, num_seqs, out.data_ptr<scalar_t>(), g);
  });
}
