// The record sizes of GGUF's blocks as Loom's kernels keep them (loom/model/quantized.py pack_records; the layout is
// documented in quantized_linear.cpp), shared by the quantized kernel and the AMX kernel's dequantizing, with the
// check of a record format's name that both make.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace loom::gguf {

constexpr int64_t kQ4_1RecordBytes = 320;  // d[16] float16 | m[16] float16 | 32 steps x 8 bytes: 5 bits a weight
constexpr int64_t kQ8_0RecordBytes = 544;  // d[16] float16 | 32 steps x 16 int8 codes: 8.5 bits a weight

// The bytes of one record in `format` ("q4_1" or "q8_0"; anything else is an error that says so).
inline int64_t record_bytes(const std::string& format) {
  TORCH_CHECK(format == "q4_1" || format == "q8_0", "format must be 'q4_1' or 'q8_0', not '", format, "'");
  return format == "q4_1" ? kQ4_1RecordBytes : kQ8_0RecordBytes;
}

}  // namespace loom::gguf
