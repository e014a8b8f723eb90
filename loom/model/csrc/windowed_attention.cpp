// Sliding-window attention straight from the paged KV cache, for a model's local layers (Gemma 3's): each query row
// at position p sees keys (p - window, p]. One work item is one query row and one KV head; it walks its keys in
// position order with an online softmax in float32 and rounds once at the end. A row's result depends on its own
// position and context only, never on which rows share its step, chunk or thread: a prompt prefilled whole, in
// chunks, or beside any other requests gives the same bits, and its decode rows the same as if computed in prefill.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bfloat16.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using loom::widen;

template <typename T>
void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                 const torch::Tensor& cu_seqlens_q, int64_t window, double scale, torch::Tensor& out) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
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
    std::vector<float> query(group * head_dim), acc(group * head_dim), score_max(group), total(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / num_kv_heads, kv_head = item % num_kv_heads, seq = row_seq[row];
      const int64_t position = lens[seq] - (starts[seq + 1] - row);  // the row's own position in its sequence
      const int64_t first = std::max<int64_t>(0, position - window + 1);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          query[g * head_dim + d] = widen(qp[(row * num_heads + kv_head * group + g) * head_dim + d]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      // The lowest finite float, not -inf: -ffast-math assumes no infinities. exp(lowest - s) is 0 all the same.
      std::fill(score_max.begin(), score_max.end(), std::numeric_limits<float>::lowest());
      std::fill(total.begin(), total.end(), 0.0f);
      const int64_t* table = tables + seq * table_width;
      for (int64_t key = first; key <= position; ++key) {
        const int64_t block = table[key / block_size], offset = key % block_size;
        const T* k = kp + block * kb + offset * kr + kv_head * kh;
        const T* v = vp + block * vb + offset * vr + kv_head * vh;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * head_dim;
          float dot = 0.0f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * widen(k[d]);
          const float s = dot * fscale;
          const float new_max = std::max(score_max[g], s);
          const float rescale = std::exp(score_max[g] - new_max), weight = std::exp(s - new_max);
          score_max[g] = new_max;
          total[g] = total[g] * rescale + weight;
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] = ag[d] * rescale + weight * widen(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = op + (row * num_heads + kv_head * group + g) * head_dim;
        const float inverse = 1.0f / total[g];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d] * inverse);
      }
    }
  });
}

// q [T, H, D]; k_cache / v_cache [num_blocks, block_size, KVH, D] of q's dtype (float32 or bfloat16), already holding
// this step's K/V; block_tables [B, M], context_lens [B] (tokens in the cache after this step), cu_seqlens_q [B + 1]
// int64 -> out [T, H * D].
torch::Tensor windowed_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                 const torch::Tensor& cu_seqlens_q, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "windowed_attention: q must be contiguous [T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "windowed_attention: the caches must have q's dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "windowed_attention: a head's values must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "windowed_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(window > 0, "windowed_attention: the window must be positive");
  auto tables = block_tables.contiguous(), lens = context_lens.contiguous(), starts = cu_seqlens_q.contiguous();
  torch::Tensor out = torch::empty_like(q);
  loom::by_dtype(q, "windowed_attention", [&](auto* typed) {
    attend_rows<std::remove_pointer_t<decltype(typed)>>(q, k_cache, v_cache, tables, lens, starts, window, scale, out);
  });
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("windowed_attention", &windowed_attention, "sliding-window attention from the paged cache (CPU)");
}
