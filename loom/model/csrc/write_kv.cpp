// Stores a step's new keys and values at their slots of the paged KV cache: one row copy per token and cache, in
// one call where torch's index_copy_ took two. The rows may be strided views into the fused qkv projection, so
// nothing is made contiguous first. Every slot is checked before anything is written. An int8 cache gets each head's
// row quantized (int8_kv.h), its scale stored at the same slot of the scales.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <optional>

#include "int8_kv.h"
#include "paged_geometry.h"

namespace {

// Steps of fewer tokens (decode) copy on the calling thread: a parallel region costs more than their copies. A
// prefill's rows are split between threads: on one thread its copies left the other waiting.
constexpr int64_t kGrainTokens = 256;

void check_rows(const torch::Tensor& rows, const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3), name,
              " must be [tokens, num_kv_heads, head_dim] as the cache holds them");
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2), "each of ", name, "'s rows must be contiguous");
  TORCH_CHECK(rows.device().is_cpu() && (rows.scalar_type() == cache.scalar_type() ||
                                         (cache.scalar_type() == at::kChar && (rows.scalar_type() == at::kFloat ||
                                                                               rows.scalar_type() == at::kBFloat16))),
              name, " must be a CPU tensor of the cache's dtype (float32 or bfloat16 for an int8 cache)");
}

// Where slot's row starts in a cache whose blocks lie block_stride values apart, in values.
inline int64_t slot_offset(int64_t slot, int64_t block_size, int64_t block_stride, int64_t row_size) {
  return slot / block_size * block_stride + slot % block_size * row_size;
}

// Token t's rows of `rows` quantized into an int8 cache (blocks block_stride apart) at row slot[t], their scales
// alongside (contiguous).
template <typename T>
void quantize_rows(const torch::Tensor& rows, const int64_t* slot, int64_t begin, int64_t end, torch::Tensor& cache,
                   int64_t block_stride, torch::Tensor& scales) {
  const int64_t heads = rows.size(1), dim = rows.size(2);
  const T* from = rows.data_ptr<T>();
  int8_t* codes = cache.data_ptr<int8_t>();
  float* scale = scales.data_ptr<float>();
  for (int64_t t = begin; t < end; ++t) {
    int8_t* row = codes + slot_offset(slot[t], cache.size(1), block_stride, heads * dim);
    for (int64_t h = 0; h < heads; ++h)
      scale[slot[t] * heads + h] = loom::quantize_head(from + t * rows.stride(0) + h * dim, dim, row + h * dim);
  }
}

}  // namespace

// k, v [T, num_kv_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim], each block's rows
// contiguous and blocks the same distance apart in both (loom::check_cache_layout); slot_mapping [T] int64: token t
// goes to row slot_mapping[t] % block_size of block slot_mapping[t] / block_size. int8 caches take their scales
// [num_blocks, block_size, num_kv_heads] float32 too.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping, const std::optional<torch::Tensor>& k_scales,
              const std::optional<torch::Tensor>& v_scales) {
  const int64_t block_stride = loom::check_cache_layout("write_kv", k_cache, v_cache);
  check_rows(k, k_cache, "k");
  check_rows(v, v_cache, "v");
  loom::check_scales(k_cache, k_scales, "k_scales");
  loom::check_scales(v_cache, v_scales, "v_scales");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.numel() == k.size(0) &&
                  v.size(0) == k.size(0) && k.scalar_type() == v.scalar_type(),
              "one int64 slot per token, and k and v alike");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(0 <= slot[t] && slot[t] < num_slots, "slot ", slot[t], " is outside the cache");
  const int64_t row_size = k_cache.size(2) * k_cache.size(3), cache_elem = k_cache.element_size();
  const int64_t row_bytes = row_size * cache_elem;
  const int64_t elem = k.element_size();
  auto* k_to = static_cast<char*>(k_cache.data_ptr());
  auto* v_to = static_cast<char*>(v_cache.data_ptr());
  const auto* k_from = static_cast<const char*>(k.data_ptr());
  const auto* v_from = static_cast<const char*>(v.data_ptr());
  const bool int8 = k_cache.scalar_type() == at::kChar;
  torch::Tensor k_scale = int8 ? *k_scales : torch::Tensor(), v_scale = int8 ? *v_scales : torch::Tensor();
  at::parallel_for(0, k.size(0), kGrainTokens, [&](int64_t begin, int64_t end) {
    if (int8) {
      if (k.scalar_type() == at::kBFloat16) {
        quantize_rows<c10::BFloat16>(k, slot, begin, end, k_cache, block_stride, k_scale);
        quantize_rows<c10::BFloat16>(v, slot, begin, end, v_cache, block_stride, v_scale);
      } else {
        quantize_rows<float>(k, slot, begin, end, k_cache, block_stride, k_scale);
        quantize_rows<float>(v, slot, begin, end, v_cache, block_stride, v_scale);
      }
      return;
    }
    for (int64_t t = begin; t < end; ++t) {
      const int64_t at = slot_offset(slot[t], k_cache.size(1), block_stride, row_size) * cache_elem;
      std::memcpy(k_to + at, k_from + t * k.stride(0) * elem, row_bytes);
      std::memcpy(v_to + at, v_from + t * v.stride(0) * elem, row_bytes);
    }
  });
}
