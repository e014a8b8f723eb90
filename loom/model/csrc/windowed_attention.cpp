// Sliding-window attention straight from the paged KV cache, for a model's local layers (Gemma 3's): each query row
// at position p sees keys (p - window, p]. One work item is one query row and one KV head: it walks its keys in tiles
// of kTile positions aligned to multiples of kTile (the first tile starts at the window's first key), with an online
// softmax in float32 rescaled once a tile, and rounds once at the end. A tile's scores take the KV head's query heads
// together, so each key and value is read once for all of them, 16 lanes at a time. The tiles depend on the row's
// own position only, so its result does too, never on which rows share its step, chunk or thread: a prompt
// prefilled whole, in chunks, or beside any other requests gives the same bits, and its decode rows the same as if
// computed in prefill.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bfloat16.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using loom::I16;
using loom::V16;
using loom::load16;
using loom::max16;
using loom::store16;
using loom::sum16;
using loom::widen;

constexpr int64_t kTile = 16;  // keys a tile: one score vector per query head
static_assert(sizeof(V16) == kTile * sizeof(float), "a tile's scores for one query head fill one V16");
constexpr int kMaxHeadsTogether = 4;  // query heads of one KV head scored together (registers for their sums)

// scores[g * kTile + j] = scale * (query head g . key j) for G query heads (rows of `query`, head_dim apart) and the
// tile's n keys.
template <int G, typename T>
void score_keys(const float* query, const T* const* keys, int64_t n, int64_t head_dim, float scale, float* scores) {
  const int64_t vector_end = head_dim / kTile * kTile;
  for (int64_t j = 0; j < n; ++j) {
    const T* k = keys[j];
    V16 dot[G] = {};
    for (int64_t d = 0; d < vector_end; d += kTile) {
      const V16 kv = load16(k + d);
      for (int g = 0; g < G; ++g) dot[g] += load16(query + g * head_dim + d) * kv;
    }
    for (int g = 0; g < G; ++g) {
      float s = sum16(dot[g]);
      for (int64_t d = vector_end; d < head_dim; ++d) s += query[g * head_dim + d] * widen(k[d]);
      scores[g * kTile + j] = s * scale;
    }
  }
}

// acc[g] = acc[g] * rescale[g] + sum over the tile's n values of weights[g * kTile + j] * value j, for G heads.
template <int G, typename T>
void accumulate_values(float* acc, const float* rescale, const float* weights, const T* const* values, int64_t n,
                       int64_t head_dim) {
  const int64_t vector_end = head_dim / kTile * kTile;
  for (int64_t d = 0; d < vector_end; d += kTile) {
    V16 sum[G];
    for (int g = 0; g < G; ++g) sum[g] = load16(acc + g * head_dim + d) * rescale[g];
    for (int64_t j = 0; j < n; ++j) {
      const V16 v = load16(values[j] + d);
      for (int g = 0; g < G; ++g) sum[g] += weights[g * kTile + j] * v;
    }
    for (int g = 0; g < G; ++g) store16(acc + g * head_dim + d, sum[g]);
  }
  for (int64_t d = vector_end; d < head_dim; ++d)
    for (int g = 0; g < G; ++g) {
      float a = acc[g * head_dim + d] * rescale[g];
      for (int64_t j = 0; j < n; ++j) a += weights[g * kTile + j] * widen(values[j][d]);
      acc[g * head_dim + d] = a;
    }
}

// One work item's query heads in runs of up to kMaxHeadsTogether, each run's count a compile-time constant.
template <typename F>
void by_head_runs(int64_t heads, F&& run) {
  int64_t g = 0;
  for (; g + kMaxHeadsTogether <= heads; g += kMaxHeadsTogether)
    run(g, std::integral_constant<int, kMaxHeadsTogether>{});
  for (; g < heads; ++g) run(g, std::integral_constant<int, 1>{});
}

template <typename T>
void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                 const torch::Tensor& cu_seqlens_q, int64_t window, double scale, torch::Tensor& out) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2), q_row_stride = q.stride(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t kb = k_cache.stride(0), kr = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vr = v_cache.stride(1), vh = v_cache.stride(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_width = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* starts = cu_seqlens_q.data_ptr<int64_t>();
  const int64_t num_seqs = context_lens.size(0);
  // Each row's sequence, found once.
  std::vector<int64_t> row_seq(num_rows);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t r = starts[s]; r < starts[s + 1]; ++r) row_seq[r] = s;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), score_max(group), total(group),
        rescale(group), scores(group * kTile);
    const T* keys[kTile];
    const T* values[kTile];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / num_kv_heads, kv_head = item % num_kv_heads, seq = row_seq[row];
      const int64_t position = lens[seq] - (starts[seq + 1] - row);  // the row's own position in its sequence
      const int64_t first = std::max<int64_t>(0, position - window + 1);
      const T* query_row = qp + row * q_row_stride + kv_head * group * head_dim;  // the KV head's query heads
      for (int64_t i = 0; i < group * head_dim; ++i) query[i] = widen(query_row[i]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(score_max.begin(), score_max.end(), loom::kMasked);  // no key yet: exp(kMasked - s) is 0
      std::fill(total.begin(), total.end(), 0.0f);
      const int64_t* table = tables + seq * table_width;
      for (int64_t tile = first; tile <= position;) {
        const int64_t tile_end = std::min(position + 1, (tile / kTile + 1) * kTile), n = tile_end - tile;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t key = tile + j, block = table[key / block_size], offset = key % block_size;
          keys[j] = kp + block * kb + offset * kr + kv_head * kh;
          values[j] = vp + block * vb + offset * vr + kv_head * vh;
        }
        by_head_runs(group, [&](int64_t g, auto heads) {
          score_keys<decltype(heads)::value>(query.data() + g * head_dim, keys, n, head_dim, fscale,
                                             scores.data() + g * kTile);
        });
        for (int64_t g = 0; g < group; ++g) {  // the tile's softmax weights, the lanes past n masked to 0
          float* s = scores.data() + g * kTile;
          for (int64_t j = n; j < kTile; ++j) s[j] = loom::kMasked;
          const V16 tile_scores = load16(s);
          const float new_max = std::max(score_max[g], max16(tile_scores));
          rescale[g] = std::exp(score_max[g] - new_max);
          const V16 weights = loom::exp_nonpositive_lanes<V16, I16>(tile_scores - new_max);
          store16(s, weights);
          total[g] = total[g] * rescale[g] + sum16(weights);
          score_max[g] = new_max;
        }
        by_head_runs(group, [&](int64_t g, auto heads) {
          accumulate_values<decltype(heads)::value>(acc.data() + g * head_dim, rescale.data() + g,
                                                    scores.data() + g * kTile, values, n, head_dim);
        });
        tile = tile_end;
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = op + (row * num_heads + kv_head * group + g) * head_dim;
        const float inverse = 1.0f / total[g];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d] * inverse);
      }
    }
  });
}

// q [T, H, D] (its rows may lie apart, as in a view of wider rows); k_cache / v_cache [num_blocks, block_size, KVH,
// D] of q's dtype (float32 or bfloat16), already holding this step's K/V; block_tables [B, M], context_lens [B]
// (tokens in the cache after this step), cu_seqlens_q [B + 1] int64 -> out [T, H * D].
torch::Tensor windowed_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                 const torch::Tensor& cu_seqlens_q, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "windowed_attention: q must be [T, H, D] with each row's heads contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "windowed_attention: the caches must have q's dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "windowed_attention: a head's values must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "windowed_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(window > 0, "windowed_attention: the window must be positive");
  auto tables = block_tables.contiguous(), lens = context_lens.contiguous(), starts = cu_seqlens_q.contiguous();
  torch::Tensor out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  loom::by_dtype(q, "windowed_attention", [&](auto* typed) {
    attend_rows<std::remove_pointer_t<decltype(typed)>>(q, k_cache, v_cache, tables, lens, starts, window, scale, out);
  });
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("windowed_attention", &windowed_attention, "sliding-window attention from the paged cache (CPU)");
}
