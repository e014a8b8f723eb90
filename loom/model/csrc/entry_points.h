// Kernel functions handed from one of Loom's modules to another's C++ (the layer loop), so that each kernel is
// compiled once, in its own module, and still called as a C++ function: a module exports a function's address as a
// PyCapsule named after the function's signature, and the caller takes the address back only under that name (a
// capsule of another signature, or any other object, raises a TypeError).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

namespace loom::entry {

// x [rows, in_features] -> x W^T (+ bias), [rows, out_features] (or a gated kernel's SiLU(gate) * up, half as
// wide): W as the kernel packs it, `format` its GGUF record layout ("" for dense weights).
using Matmul = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& weight, const std::string& format,
                                 int64_t out_features, const std::optional<torch::Tensor>& bias);
// hidden += delta (in place, where given) -> RMSNorm(hidden) * weight.
using AddRmsNorm = torch::Tensor (*)(torch::Tensor& hidden, const std::optional<torch::Tensor>& delta,
                                     const torch::Tensor& weight, double eps);
// RoPE on the first `heads` heads of each row of qkv, in place.
using Rotary = void (*)(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                        int64_t head_dim);
// gate_up [rows, 2I] (gate's columns, then up's) -> SiLU(gate) * up, [rows, I].
using SiluMul = torch::Tensor (*)(const torch::Tensor& gate_up);
// One layer's attention for a step: the step's K/V stored at their slots, then its decodes and prompt chunks.
using AttendStep = torch::Tensor (*)(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     torch::Tensor& k_cache, torch::Tensor& v_cache,
                                     const std::optional<torch::Tensor>& k_scales,
                                     const std::optional<torch::Tensor>& v_scales, const torch::Tensor& slot_mapping,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     const torch::Tensor& query_starts, int64_t num_decodes, double scale);

template <typename F>
struct Name;
template <>
struct Name<Matmul> { static constexpr const char* value = "loom.entry.Matmul"; };
template <>
struct Name<AddRmsNorm> { static constexpr const char* value = "loom.entry.AddRmsNorm"; };
template <>
struct Name<Rotary> { static constexpr const char* value = "loom.entry.Rotary"; };
template <>
struct Name<SiluMul> { static constexpr const char* value = "loom.entry.SiluMul"; };
template <>
struct Name<AttendStep> { static constexpr const char* value = "loom.entry.AttendStep"; };

// f's address as a capsule named after its signature F.
template <typename F>
pybind11::capsule export_entry(F f) {
  return pybind11::capsule(reinterpret_cast<void*>(f), Name<F>::value);
}

// The function a capsule from export_entry<F> holds; a TypeError for anything else.
template <typename F>
F import_entry(const pybind11::object& capsule) {
  if (!PyCapsule_IsValid(capsule.ptr(), Name<F>::value))
    throw pybind11::type_error(std::string("expected a kernel entry point of signature ") + Name<F>::value);
  return reinterpret_cast<F>(PyCapsule_GetPointer(capsule.ptr(), Name<F>::value));
}

}  // namespace loom::entry
