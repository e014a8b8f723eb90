// bfloat16 linear layers y = x W^T on Intel AMX (Sapphire Rapids and later): W packed once, at model load, into
// 16 x 32 tiles, each multiply-accumulated by TDPBF16PS into 16 x 16 float32 sums held in tile registers.
//
// Why our own and not torch's bfloat16 matmul (oneDNN, also on AMX, about as fast): oneDNN picks its blocking by the
// number of rows, so a row's result changed with the rows batched beside it. Here every row walks k in the same
// 32-wide steps from zero, whatever the batch: y[i] depends on x[i] and W alone, so packing changes no result.
//
// Layout (loom/model/linear.py, pack_amx_tiles): panels of 16 output columns; within a panel, one 1 KiB tile per 32
// k values, tile row r holding, for each column n, the pair W[n][32c + 2r], W[n][32c + 2r + 1] (AMX's "VNNI" order).
//
// SwiGLU's gate and up projections run as one product whose panels hold 8 columns of each (amx_silu_mul_linear):
// each panel's sums become SiLU(gate) * up as they are stored, so the [rows, 2I] product is never written and read
// back; SiLU comes from a table (silu.h).
//
// W may also come as GGUF Q4_1 / Q8_0 records (amx_quantized_linear): each slice of a panel group's records is
// dequantized into tiles in L1 (amx_dequantize.h) just before the row blocks use it, with the bits of the bfloat16
// weights. A decode step then reads 5 or 8.5 bits a weight instead of 16, at ~70 cycles a tile of dequantizing that
// this core does not overlap with the tile products: faster up to a few hundred rows (docs/kernels.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_dequantize.h"
#include "amx_tiles.h"
#include "bfloat16.h"
#include "entry_points.h"
#include "silu.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "the AMX linear kernel needs a CPU with AMX-BF16; Loom uses its other matmuls"
#endif

namespace {

constexpr int64_t kRows = 16;    // rows of x and y in one tile
constexpr int64_t kPanel = 16;   // output columns in one tile (a panel)
constexpr int64_t kChunk = 32;   // k values in one tile row: 64 bytes of bfloat16
constexpr int64_t kTileElems = 16 * kChunk;  // one packed weight tile: 16 pair-rows x 16 columns x 2
constexpr int64_t kBlockRows = 256;  // rows of x per pass over the weights, so the rows stay in L2
// Within a pass, a panel group's weights go by in slices of kSliceChunks k chunks (12 KiB for two panels), each
// slice used by a sub-pass of row blocks in turn while it stays in L1 (kSubBlocks of them in 2 x 2 groups, whose
// sums, 8 KiB, wait in L1 for the next slice; the whole pass, one row block a group, where x has two blocks or more:
// below). Without slicing, each row block pair read its panel pair from L2 again.
constexpr int64_t kSliceChunks = 6;
constexpr int64_t kSubBlocks = 4;
constexpr int64_t kTripleMaxPanels = 256;  // dense weights up to which panels go three at a time (4096 outputs; below)
constexpr int64_t kSliceMaxChunks = 18;  // k chunks of an x row block pair that stay in L1 (36 KiB)
// Weight tiles that wait in L2 for all of a thread's rows (576 KiB). 1152 where a thread's x passes 1 MiB (qkv and o
// in one range) gained in o and down but lost in gate/up (docs/kernels.md).
constexpr int64_t kRangeTiles = 576;
constexpr int64_t kSubPassTiles = 3 * kBlockRows / kRows;  // sums tiles of a sub-pass: a pass's 16 groups of 3
constexpr int64_t kSplitBlocks = 8;  // row blocks a thread from which threads split rows, not panels (below)

using bf16 = c10::BFloat16;
using loom::amx::configure_tiles;
using loom::amx::Q4_1FTiles;
using loom::amx::Q4_1Tiles;
using loom::amx::Q8_0Tiles;
using loom::amx::Q8FTiles;
using loom::amx::request_amx;

// Where a row block of x starts and its row stride in bytes: x itself, or a zero-padded copy of its last,
// partial block (AMX loads whole 16-row tiles).
struct RowBlock {
  const bf16* rows;
  int64_t stride_bytes;
};

// sums[RB][PB][16 x 16] (+)= RB row blocks of x . PB panels of W over k chunks [c0, c1), in order of k: from zero,
// or resuming the sums stored by the previous k slice (float32 stored and reloaded exactly, so slicing changes no
// bit). `panel` is the first panel's tile at chunk c0, the others panel_elems apart. Tiles 0-3 hold the sums of (row
// block i, panel j) at 2i + j; 4-5 the two row blocks of x; 6-7 the two panels (a third panel, with one row block, in
// tile 5).
// kDoubleBuffered (one row block, two panels, all tiles configured with 16 rows): the chunks alternate between two
// sets of operand tiles, x in 4 and the panels in 6-7, then x in 5 and the panels in 2-3, so a chunk's loads need not
// wait for the products that read the chunk before (a tile register is not renamed); see amx_linear_impl.
template <int RB, int PB, bool kStreamPanels = false, bool kDoubleBuffered = false>
void tile_group(const RowBlock* a, const bf16* panel, int64_t panel_elems, int64_t c0, int64_t c1, bool resume,
                float* sums) {
  static_assert(RB * PB <= 4 && RB + PB <= 4, "8 tiles: RB x PB sums, RB row blocks, PB panels");
  static_assert(!kDoubleBuffered || (RB == 1 && PB == 2 && !kStreamPanels), "double buffers: 1 x 2 groups");
  constexpr int64_t kSums = kRows * kPanel;
  if (resume) {
    _tile_loadd(0, sums, 64);
    if constexpr (PB >= 2) _tile_loadd(1, sums + kSums, 64);
    if constexpr (RB == 2 || PB == 3) _tile_loadd(2, sums + 2 * kSums, 64);
    if constexpr (RB == 2 && PB == 2) _tile_loadd(3, sums + 3 * kSums, 64);
  } else {
    _tile_zero(0);
    if constexpr (PB >= 2) _tile_zero(1);
    if constexpr (RB == 2 || PB == 3) _tile_zero(2);
    if constexpr (RB == 2 && PB == 2) _tile_zero(3);
  }
  if constexpr (kDoubleBuffered) {
    // Chunk c's products, its operands in tiles 4, 6, 7 (the first set) or 5, 2, 3 (the second).
    const auto first_set = [&](int64_t c) {
      const bf16* w = panel + (c - c0) * kTileElems;
      _tile_loadd(4, a[0].rows + c * kChunk, a[0].stride_bytes);
      _tile_loadd(6, w, 64);
      _tile_loadd(7, w + panel_elems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    };
    const auto second_set = [&](int64_t c) {
      const bf16* w = panel + (c - c0) * kTileElems;
      _tile_loadd(5, a[0].rows + c * kChunk, a[0].stride_bytes);
      _tile_loadd(2, w, 64);
      _tile_loadd(3, w + panel_elems, 64);
      _tile_dpbf16ps(0, 5, 2);
      _tile_dpbf16ps(1, 5, 3);
    };
    int64_t c = c0;
    for (; c + 1 < c1; c += 2) first_set(c), second_set(c + 1);
    if (c < c1) first_set(c);
    _tile_stored(0, sums, 64);
    _tile_stored(1, sums + kSums, 64);
    return;
  }
  if constexpr (RB == 2 && PB == 2) {
    // Software-pipelined: chunk c + 1's operands are loaded as soon as chunk c's last product that reads their tile
    // is issued (x0 after the products into 0 and 1, panel 0 after 2, x1 and panel 1 after 3), rather than all four
    // before chunk c + 1's products, so the loads overlap the products still running. The same products in the same
    // order: the same bits (docs/kernels.md).
    const auto load_x = [&](int i, int64_t c) {
      if (i == 0) _tile_loadd(4, a[0].rows + c * kChunk, a[0].stride_bytes);
      else _tile_loadd(5, a[1].rows + c * kChunk, a[1].stride_bytes);
    };
    const auto load_panel = [&](int j, int64_t c) {
      const bf16* w = panel + (c - c0) * kTileElems + j * panel_elems;
      if constexpr (kStreamPanels) {
        if (j == 0) _tile_stream_loadd(6, w, 64);
        else _tile_stream_loadd(7, w, 64);
      } else {
        if (j == 0) _tile_loadd(6, w, 64);
        else _tile_loadd(7, w, 64);
      }
    };
    load_x(0, c0), load_x(1, c0), load_panel(0, c0), load_panel(1, c0);
    for (int64_t c = c0; c < c1; ++c) {
      const bool next = c + 1 < c1;
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (next) load_x(0, c + 1);
      _tile_dpbf16ps(2, 5, 6);
      if (next) load_panel(0, c + 1);
      _tile_dpbf16ps(3, 5, 7);
      if (next) load_x(1, c + 1), load_panel(1, c + 1);
    }
  } else {
    for (int64_t c = c0; c < c1; ++c) {
      const bf16* w = panel + (c - c0) * kTileElems;
      _tile_loadd(4, a[0].rows + c * kChunk, a[0].stride_bytes);
      if constexpr (RB == 2) _tile_loadd(5, a[1].rows + c * kChunk, a[1].stride_bytes);
      if constexpr (kStreamPanels) {
        _tile_stream_loadd(6, w, 64);
        if constexpr (PB >= 2) _tile_stream_loadd(7, w + panel_elems, 64);
      } else {
        _tile_loadd(6, w, 64);
        if constexpr (PB >= 2) _tile_loadd(7, w + panel_elems, 64);
      }
      if constexpr (PB == 3) _tile_loadd(5, w + 2 * panel_elems, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (PB >= 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (PB == 3) _tile_dpbf16ps(2, 4, 5);
      if constexpr (RB == 2) _tile_dpbf16ps(2, 5, 6);
    }
  }
  _tile_stored(0, sums, 64);
  if constexpr (PB >= 2) _tile_stored(1, sums + kSums, 64);
  if constexpr (RB == 2 || PB == 3) _tile_stored(2, sums + 2 * kSums, 64);
  if constexpr (RB == 2 && PB == 2) _tile_stored(3, sums + 3 * kSums, 64);
}

// tile_group for a group of rb row blocks and pb panels, as amx_linear_impl and rows_against_panel_ranges form them
// (1 x 2 double-buffered where asked, 1 x 3, 2 x 2, and the smaller ones at the edges).
template <bool kStreamPanels = false>
void tile_group_of(int rb, int pb, const RowBlock* a, const bf16* panel, int64_t panel_elems, int64_t c0, int64_t c1,
                   bool resume, float* sums, bool double_buffered = false) {
  if constexpr (!kStreamPanels) {
    if (double_buffered && rb == 1 && pb == 2) return tile_group<1, 2, false, true>(a, panel, panel_elems, c0, c1,
                                                                                     resume, sums);
  }
  if (pb == 3) tile_group<1, 3, kStreamPanels>(a, panel, panel_elems, c0, c1, resume, sums);
  else if (rb == 2 && pb == 2) tile_group<2, 2, kStreamPanels>(a, panel, panel_elems, c0, c1, resume, sums);
  else if (rb == 2) tile_group<2, 1, kStreamPanels>(a, panel, panel_elems, c0, c1, resume, sums);
  else if (pb == 2) tile_group<1, 2, kStreamPanels>(a, panel, panel_elems, c0, c1, resume, sums);
  else tile_group<1, 1, kStreamPanels>(a, panel, panel_elems, c0, c1, resume, sums);
}

// y[rows, cols] (row stride out_features) = one tile's float32 sums + bias, rounded to bfloat16 (nearest even): for
// a panel at the right edge, or one without a neighbour.
void store_tile(const float* sums, const float* bias, int64_t rows, int64_t cols, bf16* y, int64_t out_features) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = sums + r * kPanel;
    bf16* yr = y + r * out_features;
    if (cols == kPanel) {
      for (int64_t h = 0; h < kPanel; h += loom::kLanes) {
        loom::Vec v = loom::load(s + h);
        if (bias) v += loom::load(bias + h);
        loom::store(yr + h, v);
      }
    } else {
      for (int64_t n = 0; n < cols; ++n) yr[n] = loom::narrow<bf16>(s[n] + (bias ? bias[n] : 0.f));
    }
  }
}

// Two neighbouring whole panels' sums (+ bias) -> 32 bfloat16 columns of y, written as one 64-byte store a row
// rather than two halves of a cache line. Rounded by VCVTNE2PS2BF16: nearest even, as torch rounds, except that it
// takes a float32 denormal (a sum under 2^-126 in magnitude) as zero.
void store_tile_pair(const float* sums, const float* bias, int64_t rows, bf16* y, int64_t out_features) {
  const __m512 bias0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_loadu_ps(bias + kPanel) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 low = _mm512_add_ps(_mm512_load_ps(sums + r * kPanel), bias0);
    const __m512 high = _mm512_add_ps(_mm512_load_ps(sums + kRows * kPanel + r * kPanel), bias1);
    _mm512_storeu_si512(y + r * out_features, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
  }
}

// A gated panel's sums (+ bias): columns 0-7 gate, 8-15 up (interleave_gate_up in linear.py) -> SiLU(gate) * up, 8
// bfloat16 columns of y (row stride width), with the bits of gate and up rounded to bfloat16 (as store_tile_pair
// rounds) and then silu_mul: two rows at a time. Both rows are rounded by one VCVTNE2PS2BF16; one word permute (zeros
// in the other halves) makes the gates' table indices and another the ups as float32, for silu.h's table_mul16 (its
// product rounded by VCVTNEPS2BF16, a float32 denormal one by the integer steps).
void store_gated_tile(const float* sums, const float* bias, int64_t rows, const uint16_t* silu_table, bf16* y,
                      int64_t width) {
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  // Words of cvtne2ps(second, first): 0-7 the first row's gates, 8-15 its ups, 16-23 the second's gates, 24-31 its
  // ups. Lane i (row i / 8, column i % 8) takes its gate in its low word and its up in its high word.
  const __m512i gate_words = _mm512_set_epi16(0, 23, 0, 22, 0, 21, 0, 20, 0, 19, 0, 18, 0, 17, 0, 16, 0, 7, 0, 6, 0,
                                              5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0);
  const __m512i up_words = _mm512_set_epi16(31, 0, 30, 0, 29, 0, 28, 0, 27, 0, 26, 0, 25, 0, 24, 0, 15, 0, 14, 0, 13,
                                            0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0);
  for (int64_t r = 0; r < rows; r += 2) {
    const __m512 first = _mm512_add_ps(_mm512_load_ps(sums + r * kPanel), b);
    const __m512 second = _mm512_add_ps(_mm512_load_ps(sums + std::min(r + 1, rows - 1) * kPanel), b);
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));
    const __m512i gates = _mm512_maskz_permutexvar_epi16(0x55555555u, gate_words, both);
    const __m512 ups = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, up_words, both));
    const __m256i out = loom::table_mul16(silu_table, gates, ups);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * width), _mm256_castsi256_si128(out));
    if (r + 1 < rows)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + (r + 1) * width), _mm256_extracti128_si256(out, 1));
  }
}

// One tile_group's place in y: panels p .. p + pb - 1, row blocks b (and b + 1 when rb == 2).
struct TileGroup {
  int64_t p, b;
  int rb, pb;
};

// A tile_group's sums (laid out as tile_group stores them) + bias, rounded into y[rows, out_features]; or, gated,
// each panel's SiLU(gate) * up into y[rows, out_features / 2].
void store_group(const float* sums, const TileGroup& g, const float* bias, int64_t rows, bf16* y,
                 int64_t out_features, const uint16_t* silu_table) {
  for (int i = 0; i < g.rb; ++i) {
    const int64_t r0 = (g.b + i) * kRows;
    const int64_t n_rows = std::min(kRows, rows - r0);
    if (silu_table) {
      const int64_t width = out_features / 2;
      for (int j = 0; j < g.pb; ++j)
        store_gated_tile(sums + (2 * i + j) * kRows * kPanel, bias ? bias + (g.p + j) * kPanel : nullptr, n_rows,
                         silu_table, y + r0 * width + (g.p + j) * kPanel / 2, width);
      continue;
    }
    for (int j = 0; j < g.pb;) {
      const int64_t c = (g.p + j) * kPanel;
      const float* tile_sums = sums + (2 * i + j) * kRows * kPanel;
      // Two panels as one 64-byte store where that fills a cache line of y: from an even panel (a group of three
      // starts at odd panels too).
      if ((g.p + j) % 2 == 0 && j + 1 < g.pb && c + 2 * kPanel <= out_features) {
        store_tile_pair(tile_sums, bias ? bias + c : nullptr, n_rows, y + r0 * out_features + c, out_features);
        j += 2;
      } else {
        store_tile(tile_sums, bias ? bias + c : nullptr, n_rows, std::min(kPanel, out_features - c),
                   y + r0 * out_features + c, out_features);
        j += 1;
      }
    }
  }
}

// Where the tile groups find a panel group's weight tiles for k chunks [c0, c1): packed bfloat16 tiles, read in
// place; or GGUF records (amx_dequantize.h), dequantized into a per-thread buffer of tiles that then serves the
// sub-pass's row blocks from L1.
struct DenseTiles {
  const bf16* panels;  // [num_panels][chunks] tiles
  int64_t chunks;
  static constexpr int64_t kBufferElems = 0;
  // The tiles of panels p .. p + pb - 1 from chunk c0, and the distance between panels (in elements).
  const bf16* slice(int64_t p, int /*pb*/, int64_t c0, int64_t /*c1*/, bf16* /*buffer*/, int64_t& panel_elems) const {
    panel_elems = chunks * kTileElems;
    return panels + p * panel_elems + c0 * kTileElems;
  }
};

template <typename Format>
struct RecordTiles {
  const uint8_t* records;  // [num_panels][chunks] records of Format
  int64_t chunks;
  static constexpr int64_t kBufferElems = 2 * kSliceChunks * kTileElems;  // a slice of two panels: 12 KiB
  // Each record's lines are asked for this far ahead, to L2: the dequantizing keeps the core busy between reads, and
  // the hardware prefetchers alone fell behind (docs/kernels.md).
  static constexpr int64_t kPrefetchBytes = 10240;
  const bf16* slice(int64_t p, int pb, int64_t c0, int64_t c1, bf16* buffer, int64_t& panel_elems) const {
    panel_elems = (c1 - c0) * kTileElems;
    for (int j = 0; j < pb; ++j) {
      const uint8_t* record = records + ((p + j) * chunks + c0) * Format::kRecordBytes;
      for (int64_t c = c0; c < c1; ++c, record += Format::kRecordBytes) {
        for (int64_t line = 0; line < Format::kRecordBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(record) + kPrefetchBytes + line, _MM_HINT_T1);
        Format::tile(record, buffer + j * panel_elems + (c - c0) * kTileElems);
      }
    }
    return buffer;
  }
};

// A thread's rows [first_block, end_block) of y against all of the weight's panels, where the threads split the rows
// (a prefill, a big MLP chunk): panels a range at a time, their tiles dequantized once for all the thread's rows
// (kRangeTiles of them, waiting in L2), then each pair of row blocks against every panel pair of the range, k in
// slices of up to kSliceMaxChunks whose x tiles (36 KiB at most) stay in L1 across the range, in 2 x 2 groups.
// The weights come from L2 by TILELOADDT1, a hint not to keep them in L1, so that they do not push x out. The
// groups' sums are rounded into y one group late, as in amx_linear_impl. Each row walks k from zero in 32-wide
// steps (sums stored and reloaded exactly between slices): the bits of every other path.
// For fewer rows than kSplitBlocks row blocks a thread, panels are split instead: each dequantized tile then serves
// few row blocks and is better used straight from L1 (docs/kernels.md).
// The range's tiles and the groups' sums live in per-thread buffers kept between calls: allocated per call, their
// page faults took half the gain.
template <typename Weights, typename RowBlockOf>
void rows_against_panel_ranges(const Weights& weights, const RowBlockOf& row_block, int64_t first_block,
                               int64_t end_block, int64_t num_panels, const float* bias, int64_t rows, bf16* y,
                               int64_t out_features, const uint16_t* silu_table) {
  constexpr int64_t kTileSums = kRows * kPanel;
  const int64_t chunks = weights.chunks;
  int64_t panel_elems = chunks * kTileElems;  // as slice() sets it for all of k
  const int64_t range_panels = std::max<int64_t>(2, kRangeTiles / chunks / 2 * 2), range_pairs = range_panels / 2;
  static thread_local loom::amx::TileBuffer<bf16> range_tiles;  // dequantized weights (none for dense tiles)
  static thread_local loom::amx::TileBuffer<float> pair_sums;   // [visit % 2][panel pair][4 tiles]
  if (Weights::kBufferElems > 0 && range_tiles.size() < static_cast<size_t>(range_panels * panel_elems))
    range_tiles.resize(range_panels * panel_elems);
  if (pair_sums.size() < static_cast<size_t>(2 * range_pairs * 4 * kTileSums))
    pair_sums.resize(2 * range_pairs * 4 * kTileSums);
  std::optional<TileGroup> waiting;
  const float* waiting_sums = nullptr;
  int64_t visits = 0;  // row block pairs visited, over all ranges
  for (int64_t p0 = 0; p0 < num_panels; p0 += range_panels) {
    const int64_t p1 = std::min(num_panels, p0 + range_panels);
    const bf16* tiles = weights.slice(p0, static_cast<int>(p1 - p0), 0, chunks, range_tiles.data(), panel_elems);
    for (int64_t b = first_block; b < end_block; b += 2, ++visits) {
      const int rb = b + 1 < end_block ? 2 : 1;
      const RowBlock a[2] = {row_block(b), row_block(rb == 2 ? b + 1 : b)};
      // Sums by the visit's parity, so that the group waiting to be rounded (the last of the visit before, which
      // may be another range's) is never overwritten by this visit's slices.
      float* block_sums = pair_sums.data() + visits % 2 * range_pairs * 4 * kTileSums;
      for (int64_t c0 = 0; c0 < chunks; c0 += kSliceMaxChunks) {
        const int64_t c1 = std::min(chunks, c0 + kSliceMaxChunks);
        for (int64_t p = p0; p < p1; p += 2) {
          const int pb = p + 1 < p1 ? 2 : 1;
          const bf16* panel = tiles + (p - p0) * panel_elems + c0 * kTileElems;
          float* group_sums = block_sums + (p - p0) / 2 * 4 * kTileSums;
          const bool resume = c0 > 0;
          tile_group_of<true>(rb, pb, a, panel, panel_elems, c0, c1, resume, group_sums);
          if (c1 < chunks) continue;
          if (waiting) store_group(waiting_sums, *waiting, bias, rows, y, out_features, silu_table);
          waiting = TileGroup{p, b, rb, pb};
          waiting_sums = group_sums;
        }
      }
    }
  }
  if (waiting) store_group(waiting_sums, *waiting, bias, rows, y, out_features, silu_table);
}

template <typename Weights>
void amx_linear_impl(const bf16* x, int64_t rows, int64_t in_features, const Weights& weights, const float* bias,
                     bf16* y, int64_t out_features, const uint16_t* silu_table) {
  constexpr bool kDequantizes = Weights::kBufferElems > 0;
  const int64_t chunks = weights.chunks;
  const int64_t num_panels = (out_features + kPanel - 1) / kPanel;
  const int64_t padded_k = chunks * kChunk;
  const int64_t num_blocks = (rows + kRows - 1) / kRows;
  // x as AMX reads it: full row blocks in place when each row is whole chunks, else from a zero-padded copy. x of
  // fewer than 16 rows (a decode step's few requests) is one block whose x and sums tiles are configured with just
  // its rows, so it too is read in place: no copy, and loads, products and stores of those rows alone.
  loom::amx::TileBuffer<bf16> padded;
  const bool in_place = in_features == padded_k;
  const int64_t x_tile_rows = num_blocks == 1 ? rows : kRows;
  const int64_t copied_from = in_place ? rows / x_tile_rows * x_tile_rows : 0;
  if (copied_from < rows) {
    padded.assign((num_blocks * x_tile_rows - copied_from) * padded_k, bf16{});
    for (int64_t r = copied_from; r < rows; ++r)
      std::memcpy(padded.data() + (r - copied_from) * padded_k, x + r * in_features, in_features * sizeof(bf16));
  }
  auto row_block = [&](int64_t b) -> RowBlock {
    const int64_t r0 = b * kRows;
    if (r0 < copied_from) return {x + r0 * in_features, in_features * int64_t{sizeof(bf16)}};
    return {padded.data() + (r0 - copied_from) * padded_k, padded_k * int64_t{sizeof(bf16)}};
  };
  // Where x has two row blocks or more (so every tile has 16 rows), a group is one row block: GGUF records in 1 x 2
  // groups, their operands double-buffered (tile_group), and a slice of the panels' dequantized weights serves the
  // pass's row blocks from L1. Dense bfloat16 tiles keep panels three at a time, one row block a group, where the panels
  // divide so: each x tile loaded from L2 then serves three panels instead of two; not for weights as wide as an LM
  // head's, which went slower with three weight streams a thread (docs/kernels.md).
  const bool singles = kDequantizes && num_blocks >= 2;
  const bool triples = !kDequantizes && num_blocks >= 2 && num_panels % 3 == 0 && num_panels <= kTripleMaxPanels;
  const int64_t group_panels = triples ? 3 : 2, group_blocks = triples || singles ? 1 : 2;
  const int64_t blocks_per_pass = kBlockRows / kRows;
  const int64_t sub_blocks = triples || kDequantizes ? blocks_per_pass : kSubBlocks;
  // Threads split the panel groups: each weight tile is read by one thread, once per pass over the rows. Each
  // thread makes all the passes over its own panels, with no barrier between passes (the passes write disjoint
  // rows of y).
  // Where each thread would get at least kSplitBlocks row blocks (a prefill's, a big MLP chunk's, a check of drafts),
  // they split the rows instead, in even runs of row blocks (rows_against_panel_ranges): a thread's rows of y are
  // then in its own L2 when its part of the next call reads them (the gate/up product for down; the norms split rows
  // the same way), where with panels split half of every row came from the other core.
  const int64_t threads = at::get_num_threads();
  const int64_t num_groups = (num_panels + group_panels - 1) / group_panels;
  const bool rows_split = threads > 1 && num_blocks >= threads * kSplitBlocks;
  at::parallel_for(0, rows_split ? threads : num_groups, 1, [&](int64_t i0, int64_t i1) {
    configure_tiles(static_cast<int>(x_tile_rows));
    if (rows_split) {
      rows_against_panel_ranges(weights, row_block, i0 * num_blocks / threads, i1 * num_blocks / threads, num_panels,
                                bias, rows, y, out_features, silu_table);
      _tile_release();
      return;
    }
    constexpr int64_t kTileSums = kRows * kPanel;
    // Each group's sums are rounded into y after the next group's tiles are computed, not straight after their
    // tile stores, so the stores overlap the products; sums come in two sets, the sub-pass's and the one before it.
    alignas(64) float sums[2][kSubPassTiles * kTileSums];
    alignas(64) bf16 buffer[std::max<int64_t>(Weights::kBufferElems, 1)];
    std::optional<TileGroup> pending;
    const float* pending_sums = nullptr;
    int64_t n = 0;
    for (int64_t b0 = 0; b0 < num_blocks; b0 += blocks_per_pass) {
      const int64_t b1 = std::min(num_blocks, b0 + blocks_per_pass);
      for (int64_t q = i0; q < i1; ++q) {
        const int64_t p = group_panels * q;
        const int pb = static_cast<int>(std::min(group_panels, num_panels - p));
        for (int64_t s0 = b0; s0 < b1; s0 += sub_blocks, ++n) {
          const int64_t s1 = std::min(b1, s0 + sub_blocks);
          // One group of packed tiles alone reuses no slice: it walks all of k at once. Dequantized tiles come a
          // slice at a time, to stay in L1.
          const int64_t slice = s1 - s0 > group_blocks || kDequantizes ? kSliceChunks : chunks;
          for (int64_t c0 = 0; c0 < chunks; c0 += slice) {
            const int64_t c1 = std::min(chunks, c0 + slice);
            int64_t panel_elems;
            const bf16* panel = weights.slice(p, pb, c0, c1, buffer, panel_elems);
            for (int64_t b = s0; b < s1; b += group_blocks) {
              const int rb = b + 1 < s1 && !triples && !singles ? 2 : 1;
              const RowBlock a[2] = {row_block(b), rb == 2 ? row_block(b + 1) : row_block(b)};
              float* group_sums = sums[n & 1] + (b - s0) / group_blocks * group_panels * group_blocks * kTileSums;
              const bool resume = c0 > 0;
              tile_group_of(rb, pb, a, panel, panel_elems, c0, c1, resume, group_sums, singles);
              if (c1 < chunks) continue;
              if (pending) store_group(pending_sums, *pending, bias, rows, y, out_features, silu_table);
              pending = TileGroup{p, b, rb, pb};
              pending_sums = group_sums;
            }
          }
        }
      }
    }
    if (pending) store_group(pending_sums, *pending, bias, rows, y, out_features, silu_table);
    _tile_release();
  });
}

// What every entry point checks and does around the kernel: x bfloat16 [rows, in_features] against a weight of
// num_panels panels and num_chunks k chunks; bias float32 [16 * num_panels] or None; y bfloat16 [rows, out_features],
// or gated (gate and up interleaved in 8s by interleave_gate_up, out_features whole panels) SiLU(gate) * up, [rows,
// out_features / 2]. run(x, bias, y, silu_table) fills y.
template <typename Run>
torch::Tensor amx_product(const torch::Tensor& x_in, int64_t num_panels, int64_t num_chunks, int64_t out_features,
                          const std::optional<torch::Tensor>& bias, bool gated, Run&& run) {
  TORCH_CHECK(request_amx(), "amx_linear: this process was not granted AMX's tile state");
  TORCH_CHECK(x_in.device().is_cpu(), "amx_linear runs on CPU");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kBFloat16, "x must be a bfloat16 [rows, in_features]");
  TORCH_CHECK(num_panels == (out_features + kPanel - 1) / kPanel, "out_features does not match the weight's panels");
  TORCH_CHECK(!gated || out_features % kPanel == 0, "a gated product's gate and up fill whole panels");
  TORCH_CHECK(num_chunks == (x_in.size(1) + kChunk - 1) / kChunk, "x has ", x_in.size(1),
              " features, the weight expects ", num_chunks * kChunk, " (padded)");
  const float* bias_data = nullptr;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == num_panels * kPanel && bias->is_contiguous() &&
                    bias->scalar_type() == torch::kFloat32,
                "bias must be float32, zero-padded to whole panels (see loom/model/linear.py)");
    bias_data = bias->data_ptr<float>();
  }
  const auto x = x_in.contiguous();
  auto y = torch::empty({x.size(0), gated ? out_features / 2 : out_features}, x.options());
  if (x.size(0) == 0) return y;
  run(x, bias_data, y, gated ? loom::bf16_silu_table() : nullptr);
  return y;
}

// tiles bfloat16 [ceil(out_features / 16), ceil(in_features / 32), 16, 32] (see pack_amx_tiles).
torch::Tensor tiles_product(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features,
                            const std::optional<torch::Tensor>& bias, bool gated) {
  TORCH_CHECK(tiles.device().is_cpu() && tiles.dim() == 4 && tiles.size(2) == 16 && tiles.size(3) == kChunk &&
                  tiles.is_contiguous() && tiles.scalar_type() == torch::kBFloat16,
              "tiles must be a contiguous bfloat16 [num_panels, num_chunks, 16, 32] CPU tensor");
  return amx_product(x, tiles.size(0), tiles.size(1), out_features, bias, gated,
                     [&](const torch::Tensor& xc, const float* b, torch::Tensor& y, const uint16_t* silu_table) {
                       const DenseTiles weights{tiles.data_ptr<bf16>(), tiles.size(1)};
                       amx_linear_impl(xc.data_ptr<bf16>(), xc.size(0), xc.size(1), weights, b, y.data_ptr<bf16>(),
                                       out_features, silu_table);
                     });
}

}  // namespace

// Whether this process may use AMX (the kernel compiled, and Linux granted the tile state).
bool amx_available() { return request_amx(); }

// x [rows, in_features] -> x W^T (+ bias), [rows, out_features] (tiles_product).
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features,
                         const std::optional<torch::Tensor>& bias) {
  return tiles_product(x, tiles, out_features, bias, false);
}

// x [rows, in_features] -> SiLU(x G^T) * (x U^T), [rows, out_features / 2] (tiles_product).
torch::Tensor amx_silu_mul_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features,
                                  const std::optional<torch::Tensor>& bias) {
  return tiles_product(x, tiles, out_features, bias, true);
}

// amx_linear, or gated amx_silu_mul_linear, with W in GGUF records: uint8 [ceil(out_features / 16), in_features / 32,
// record bytes] in `format` "q4_1", "q4_1f", "q8_0" or "q8f" (loom/model/quantized.py pack_records, step_pairs). The same bits as on
// the weights dequantized to float32 and rounded to bfloat16.
torch::Tensor amx_quantized_linear(const torch::Tensor& x, const torch::Tensor& records, const std::string& format,
                                   int64_t out_features, const std::optional<torch::Tensor>& bias, bool gated) {
  loom::gguf::check_records(records, format);
  return amx_product(x, records.size(0), records.size(1), out_features, bias, gated,
                     [&](const torch::Tensor& xc, const float* b, torch::Tensor& y, const uint16_t* silu_table) {
                       auto run = [&](const auto& weights) {
                         amx_linear_impl(xc.data_ptr<bf16>(), xc.size(0), xc.size(1), weights, b, y.data_ptr<bf16>(),
                                         out_features, silu_table);
                       };
                       const uint8_t* data = records.data_ptr<uint8_t>();
                       if (format == "q4_1") run(RecordTiles<Q4_1Tiles>{data, records.size(1)});
                       else if (format == "q4_1f") run(RecordTiles<Q4_1FTiles>{data, records.size(1)});
                       else if (format == "q8f") run(RecordTiles<Q8FTiles>{data, records.size(1)});
                       else run(RecordTiles<Q8_0Tiles>{data, records.size(1)});
                     });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_available", &amx_available, "whether this process may run AMX tiles");
  m.def("amx_linear", &amx_linear, "bfloat16 x @ W^T (+ bias) on AMX, W packed in 16 x 32 tiles", py::arg("x"),
        py::arg("tiles"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("amx_silu_mul_linear", &amx_silu_mul_linear,
        "SiLU(x @ G^T) * (x @ U^T) on AMX, G and U's rows interleaved in 8s (out_features counts both)", py::arg("x"),
        py::arg("tiles"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("amx_quantized_linear", &amx_quantized_linear,
        "amx_linear (gated: amx_silu_mul_linear) with W in GGUF Q4_1 or Q8_0 records, dequantized as it goes",
        py::arg("x"), py::arg("records"), py::arg("format"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("gated") = false);
  // For the layer loop (entry_points.h): each matmul with the one signature it calls them by.
  using loom::entry::export_entry;
  using loom::entry::Matmul;
  using Bias = std::optional<torch::Tensor>;
  m.attr("amx_linear_entry") = export_entry<Matmul>(
      +[](const torch::Tensor& x, const torch::Tensor& w, const std::string&, int64_t out, const Bias& bias) {
        return amx_linear(x, w, out, bias);
      });
  m.attr("amx_silu_mul_linear_entry") = export_entry<Matmul>(
      +[](const torch::Tensor& x, const torch::Tensor& w, const std::string&, int64_t out, const Bias& bias) {
        return amx_silu_mul_linear(x, w, out, bias);
      });
  m.attr("amx_quantized_linear_entry") = export_entry<Matmul>(
      +[](const torch::Tensor& x, const torch::Tensor& w, const std::string& format, int64_t out, const Bias& bias) {
        return amx_quantized_linear(x, w, format, out, bias, false);
      });
  m.attr("amx_quantized_silu_mul_linear_entry") = export_entry<Matmul>(
      +[](const torch::Tensor& x, const torch::Tensor& w, const std::string& format, int64_t out, const Bias& bias) {
        return amx_quantized_linear(x, w, format, out, bias, true);
      });
}
