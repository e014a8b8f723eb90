// The record sizes of GGUF's blocks as Loom's kernels keep them (loom/model/quantized.py pack_records; the layout is
// documented in quantized_linear.cpp), shared by the quantized kernel and the AMX kernel's dequantizing, with the
// check of a weight's records that both make.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace loom::gguf {

constexpr int64_t kQ4_1RecordBytes = 320;   // d[16] float16 | m[16] float16 | 32 steps x 8 bytes: 5 bits a weight
constexpr int64_t kQ4_1FRecordBytes = 384;  // d[16] float32 | m[16] float32 | 32 steps x 8 bytes: 6 bits a weight
constexpr int64_t kQ8_0RecordBytes = 544;   // d[16] float16 | 32 steps x 16 int8 codes: 8.5 bits a weight
constexpr int64_t kQ8FRecordBytes = 704;    // d[16], d[16], m[16] float32 | 32 steps x 16 int8 codes: 11 bits a weight

inline int64_t record_bytes(const std::string& format) {
  if (format == "q4_1") return kQ4_1RecordBytes;
  if (format == "q4_1f") return kQ4_1FRecordBytes;
  if (format == "q8_0") return kQ8_0RecordBytes;
  if (format == "q8f") return kQ8FRecordBytes;
  return 0;
}

// Checks that `records` is a weight in `format` ("q4_1", "q4_1f", "q8_0" or "q8f") as the kernels read it: a
// contiguous uint8 CPU tensor [num_panels, in_features / 32, record bytes]. Anything else is an error that says which.
inline void check_records(const torch::Tensor& records, const std::string& format) {
  const int64_t bytes = record_bytes(format);
  TORCH_CHECK(bytes > 0, "format must be 'q4_1', 'q4_1f', 'q8_0' or 'q8f', not '", format, "'");
  TORCH_CHECK(records.device().is_cpu() && records.dim() == 3 && records.scalar_type() == torch::kUInt8 &&
                  records.is_contiguous() && records.size(2) == bytes,
              "records must be a contiguous uint8 [num_panels, in_features / 32, ", bytes, "] CPU tensor");
}

}  // namespace loom::gguf
