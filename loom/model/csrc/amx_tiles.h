// What Loom's AMX kernels share (amx_linear.cpp, prefill_attention_amx.cpp, paged_attention.cpp): asking Linux for
// the tile state, the tile config's layout, the square tile shape the matmul and prefill attention use (their float32
// results are rounded to bfloat16 by bfloat16.h's round_to_bf16).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace loom::amx {

// The tile shapes, as LDTILECFG reads them.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 64 bytes wide: 16 x 16 float32 sums, or 16 x 32 bfloat16 operands. Tiles 6-7 have 16 rows; tiles
// 0-5 have `x_rows` (the matmul's sums and x tiles when all of x is one block of fewer than 16 rows; 16 otherwise).
// Tile state is per thread, and other code (oneDNN) may configure it differently between our calls, so each kernel
// configures before use.
inline void configure_tiles(int x_rows = 16) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t < 6 ? x_rows : 16;
  }
  _tile_loadconfig(&config);
}

// Linux hands AMX's tile state to a process only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
inline bool request_amx() {
  constexpr int kReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Tile rows that straddle two cache lines load and store several times slower (P V's loads of a prefill, 4 products
// a step: 25 ns a step from 64-byte aligned rows, 85-100 ns 16 bytes off, where large mallocs land), so buffers that
// tiles read or write are allocated on cache lines.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
template <typename T>
using TileBuffer = std::vector<T, CacheLineAllocator<T>>;

}  // namespace loom::amx
