// The record sizes of GGUF's blocks as Loom's kernels keep them (loom/model/quantized.py pack_records; the layout is
// documented in quantized_linear.cpp), shared by the quantized kernel and the AMX kernel's dequantizing, with the
// check of a weight's records that both make.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace loom::gguf {

constexpr int64_t kQ4_1RecordBytes = 320;  // d[16] float16 | m[16] float16 | 32 steps x 8 bytes: 5 bits a weight
constexpr int64_t kQ8_0RecordBytes = 544;  // d[16] float16 | 32 steps x 16 int8 codes: 8.5 bits a weight

// Checks that `records` is a weight in `format` ("q4_1" or "q8_0") as the kernels read it: a contiguous uint8 CPU
// tensor [num_panels, in_features / 32, record bytes]. Anything else is an error that says which.
inline void check_records(const torch::Tensor& records, const std::string& format) {
  TORCH_CHECK(format == "q4_1" || format == "q8_0", "format must be 'q4_1' or 'q8_0', not '", format, "'");
  const int64_t record_bytes = format == "q4_1" ? kQ4_1RecordBytes : kQ8_0RecordBytes;
  TORCH_CHECK(records.device().is_cpu() && records.dim() == 3 && records.scalar_type() == torch::kUInt8 &&
                  records.is_contiguous() && records.size(2) == record_bytes,
              "records must be a contiguous uint8 [num_panels, in_features / 32, ", record_bytes, "] CPU tensor");
}

}  // namespace loom::gguf
