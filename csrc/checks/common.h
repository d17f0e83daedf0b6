// What the argument checks of every op share: the error word's pointer, the dtype dispatch, the tables of error
// bits and their messages, the KV layout argument. The checks themselves are one header per op family in this
// folder, used by the CPU, CUDA and emulated implementations of the op. The Python wrappers in specdec_ext/ops.py
// check the same things first with friendlier messages; these keep direct torch.ops calls from reading or writing
// out of bounds.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace specdec {

// The kernels' device-side error word: a one-element int32 tensor on `device`, or none.
inline int32_t* error_flags_pointer(const char* op, const std::optional<at::Tensor>& error_flags, const at::Device& device) {
  if (!error_flags.has_value()) return nullptr;
  TORCH_CHECK_VALUE(error_flags->numel() == 1 && error_flags->scalar_type() == at::kInt, op,
                    ": error_flags must be a one-element int32 tensor");
  TORCH_CHECK_VALUE(error_flags->device() == device, op, ": error_flags is on ", error_flags->device(), ", expected ", device);
  return error_flags->data_ptr<int32_t>();
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the backend's element type for `dtype`: Float for float32, Half for float16,
// BFloat16 for bfloat16, `void` where the kernel does not take that dtype. Every other dtype throws naming
// the op, so that a dtype added to the Python checks is never reinterpreted as one of these.
template <typename Float, typename Half, typename BFloat16, typename F>
void dispatch_float_types(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kFloat) {
    if constexpr (!std::is_void_v<Float>) return f(TypeTag<Float>{});
  } else if (dtype == at::kHalf) {
    if constexpr (!std::is_void_v<Half>) return f(TypeTag<Half>{});
  } else if (dtype == at::kBFloat16) {
    if constexpr (!std::is_void_v<BFloat16>) return f(TypeTag<BFloat16>{});
  }
  TORCH_CHECK_VALUE(false, op, ": no kernel for dtype ", dtype);
}

// What an error bit of a kernel's device-side error word means: the one table per op, used by the C++
// messages and exported to Python (specdec_ext._C.constants()). "{target}" and "{draft}" stand for the
// names of the op's inputs (target_probs or target_logits, ...).
struct ErrorBit {
  int32_t bit;
  const char* message;
};

// Joins the messages of the bits set in `bits`, with the input names filled in.
template <size_t N>
std::string describe_error_bits(int32_t bits, const ErrorBit (&table)[N], const std::string& target = "",
                                const std::string& draft = "") {
  std::string joined;
  for (const ErrorBit& e : table) {
    if (!(bits & e.bit)) continue;
    std::string m = e.message;
    for (const auto& [key, value] : {std::pair<std::string, std::string>{"{target}", target}, {"{draft}", draft}}) {
      for (size_t at = m.find(key); at != std::string::npos; at = m.find(key)) m.replace(at, key.size(), value);
    }
    joined += (joined.empty() ? "" : "; ") + m;
  }
  return joined;
}

// Whether kv_layout names HND (true) or NHD (false); anything else is a ValueError naming kv_layout.
inline bool kv_layout_is_hnd(const char* op, c10::string_view kv_layout) {
  TORCH_CHECK_VALUE(kv_layout == "NHD" || kv_layout == "HND", op, ": kv_layout must be \"NHD\" or \"HND\", got \"",
                    std::string(kv_layout), "\"");
  return kv_layout == "HND";
}

}  // namespace specdec
