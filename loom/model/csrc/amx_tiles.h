// What Loom's AMX kernels share (amx_linear.cpp, prefill_attention_amx.cpp, paged_attention.cpp): asking Linux for
// the tile state, the tile config's layout, and the square tile shape the matmul and prefill attention use.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace loom::amx {

// The tile shapes, as LDTILECFG reads them.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 16 rows x 64 bytes: 16 x 16 float32 sums, or 16 x 32 bfloat16 operands. Tile state is per thread,
// and other code (oneDNN) may configure it differently between our calls, so each kernel configures before use.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
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

}  // namespace loom::amx
