// What both paged attention kernels read their inputs by, and the checks on those inputs they share.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "vec.h"

namespace loom {

// q and out [rows, num_heads, head_dim], q's rows q_row_stride values apart (a view of the fused qkv projection's rows,
// read in place) and out's contiguous; caches [blocks, block_size, num_kv_heads, head_dim], so one token's row of a
// block holds row_size = num_kv_heads * head_dim values; block tables [sequences, max_blocks]. A block's rows are
// contiguous, and blocks lie block_stride values apart in both caches: block_size * row_size for caches of their
// own, twice that where the K and V caches are views of one buffer with each block's K and V side by side
// (KVCacheSpec.allocate).
// int8 caches (kv_cache_dtype "int8") hold codes, and k_scales / v_scales one float32 scale per token and KV head
// ([blocks, block_size, num_kv_heads], the scale of a token's row at the same slot): a value is code * scale. Other
// caches hold q's dtype and have no scales (null).
struct PagedGeometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, row_size, q_row_stride, block_stride;
  float scale;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;

  int64_t group() const { return num_heads / num_kv_heads; }              // query heads per KV head
  int64_t padded_dim() const { return (head_dim + kLanes - 1) / kLanes * kLanes; }  // whole vectors
  // Where row `offset` of cache block `block` starts in a cache, in values.
  int64_t row_offset(int64_t block, int64_t offset) const { return block * block_stride + offset * row_size; }
};

// The block stride of a K and a V cache [blocks, block_size, num_kv_heads, head_dim] whose blocks' rows are
// contiguous and lie the same distance apart in both (see PagedGeometry); `kernel` names the caller in the errors.
inline int64_t check_cache_layout(const char* kernel, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              kernel, ": caches must be alike, [blocks, block_size, num_kv_heads, head_dim]");
  const int64_t row_size = k_cache.size(2) * k_cache.size(3), block_elems = k_cache.size(1) * row_size;
  for (const torch::Tensor* cache : {&k_cache, &v_cache})
    TORCH_CHECK(cache->stride(3) == 1 && cache->stride(2) == cache->size(3) && cache->stride(1) == row_size &&
                    (cache->size(0) <= 1 || cache->stride(0) >= block_elems),
                kernel, " needs each cache block's rows contiguous, blocks apart");
  TORCH_CHECK(k_cache.size(0) <= 1 || k_cache.stride(0) == v_cache.stride(0), kernel,
              " needs the K and V caches' blocks the same distance apart");
  return k_cache.size(0) <= 1 ? block_elems : k_cache.stride(0);
}

// A cache's scales: for an int8 cache, float32 [blocks, block_size, num_kv_heads], contiguous; for a cache of
// values, none.
inline void check_scales(const torch::Tensor& cache, const std::optional<torch::Tensor>& scales, const char* name) {
  if (cache.scalar_type() != at::kChar) {
    TORCH_CHECK(!scales, "scales go with int8 caches alone");
    return;
  }
  TORCH_CHECK(scales.has_value(), "an int8 cache needs its ", name);
  TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 3 &&
                  scales->size(0) == cache.size(0) && scales->size(1) == cache.size(1) &&
                  scales->size(2) == cache.size(2),
              name, " must be contiguous float32 [blocks, block_size, num_kv_heads] for its int8 cache");
}

// Checks what both kernels need (CPU, contiguous out, cache blocks as check_cache_layout takes them, each row of q
// contiguous, shapes, matching dtypes, int64 tables and lengths, whole GQA groups; an int8 cache's scales) and
// returns the geometry; `kernel` names the caller in the errors.
inline PagedGeometry check_paged_inputs(const char* kernel, const torch::Tensor& q, const torch::Tensor& k_cache,
                                        const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                        const torch::Tensor& context_lens, const torch::Tensor& out, double scale,
                                        const std::optional<torch::Tensor>& k_scales,
                                        const std::optional<torch::Tensor>& v_scales) {
  TORCH_CHECK(q.device().is_cpu(), kernel, " runs on CPU tensors");
  TORCH_CHECK(out.is_contiguous(), kernel, " needs a contiguous out");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [rows, H, D] and caches [blocks, block_size, KVH, D]");
  const int64_t block_stride = check_cache_layout(kernel, k_cache, v_cache);
  TORCH_CHECK((q.size(2) <= 1 || q.stride(2) == 1) && (q.size(1) <= 1 || q.stride(1) == q.size(2)) &&
                  (q.size(0) <= 1 || q.stride(0) >= q.size(1) * q.size(2)),
              kernel, " needs each row of q contiguous");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((int8 || q.scalar_type() == k_cache.scalar_type()) && k_cache.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "dtype mismatch");
  check_scales(k_cache, k_scales, "k_scales");
  check_scales(v_cache, v_scales, "v_scales");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  const int64_t num_heads = q.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "the caches' head size must be q's");
  return {num_heads, num_kv_heads, q.size(2), k_cache.size(1), block_tables.size(1), num_kv_heads * q.size(2),
          q.size(0) > 1 ? q.stride(0) : q.size(1) * q.size(2), block_stride, static_cast<float>(scale),
          int8 ? k_scales->data_ptr<float>() : nullptr, int8 ? v_scales->data_ptr<float>() : nullptr};
}

// Runs work(i, scratch) for every i in [0, num_items) on up to torch's thread count, items handed out one at a time
// (the kernels order them costliest first); each thread gets its scratch once, from make_scratch(): a new one, or a
// reference to one it keeps between calls.
template <typename MakeScratch, typename Work>
void for_each_item(int64_t num_items, MakeScratch make_scratch, Work work) {
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items)))
  {
    decltype(auto) scratch = make_scratch();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) work(i, scratch);
  }
}

}  // namespace loom
