// Helpers shared by every *_ops.cpp shim: argument checks that produce the
// library's error messages ("<op>: <arg> <what was given>, expected <what>"),
// dtype mapping, 2-D row views and the current CUDA stream.
#pragma once
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fo_types.h"

// torch's STD_TORCH_CHECK starts every message with the C++ function and the
// build machine's source path ("kernel_dtype, /home/.../shim.h:60, fusedops...."),
// which tell a user nothing. Redefined here, for every shim (each includes this
// header first): the same condition and message arguments, the same exception
// (std::runtime_error, a RuntimeError in Python), the message in the op's own
// words only.
#undef STD_TORCH_CHECK
#define STD_TORCH_CHECK(cond, ...)                    \
  if (C10_UNLIKELY_OR_CONST(!(cond))) {              \
    ::fusedops::check_failed(__VA_ARGS__);          \
  }

// Hidden like torch::stable itself, whose types these helpers hold.
namespace fusedops __attribute__((visibility("hidden"))) {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

template <class... Args>
[[noreturn]] void check_failed(const Args &...message) {
  std::ostringstream out;
  (out << ... << message);
  throw std::runtime_error(out.str());
}

// The name torch gives the dtype in Python (torch.<name>).
inline const char *dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Double: return "float64";
    case ScalarType::Long: return "int64";
    case ScalarType::Int: return "int32";
    case ScalarType::Short: return "int16";
    case ScalarType::Char: return "int8";
    case ScalarType::Byte: return "uint8";
    case ScalarType::UInt16: return "uint16";
    case ScalarType::UInt32: return "uint32";
    case ScalarType::UInt64: return "uint64";
    case ScalarType::Bool: return "bool";
    case ScalarType::ComplexHalf: return "complex32";
    case ScalarType::ComplexFloat: return "complex64";
    case ScalarType::ComplexDouble: return "complex128";
    case ScalarType::Float8_e5m2: return "float8_e5m2";
    case ScalarType::Float8_e4m3fn: return "float8_e4m3fn";
    case ScalarType::Float8_e5m2fnuz: return "float8_e5m2fnuz";
    case ScalarType::Float8_e4m3fnuz: return "float8_e4m3fnuz";
    case ScalarType::Float8_e8m0fnu: return "float8_e8m0fnu";
    case ScalarType::QInt8: return "qint8";
    case ScalarType::QUInt8: return "quint8";
    case ScalarType::QInt32: return "qint32";
    default: return torch::headeronly::toString(t);  // the C++ name of the rarer ones (Bits8, UInt4, ...)
  }
}

inline std::string device_name(const Tensor &t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device_index());
  return "device type " + std::to_string(static_cast<int>(t.get_device()));
}

inline std::string shape_str(const Tensor &t, bool strides = false) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(strides ? t.stride(d) : t.size(d));
  return s + "]";
}

inline std::string strides_str(const Tensor &t) { return shape_str(t, true); }

// fp32, fp16 or bf16, else an error naming the op and argument.
inline fo_dtype kernel_dtype(const char *op, const char *arg, const Tensor &t) {
  switch (t.scalar_type()) {
    case ScalarType::Float: return FO_F32;
    case ScalarType::Half: return FO_F16;
    case ScalarType::BFloat16: return FO_BF16;
    default:
      STD_TORCH_CHECK(false, op, ": ", arg, " has dtype ", dtype_name(t.scalar_type()),
                      ", expected float32, float16 or bfloat16");
  }
  return FO_F32;
}

inline void check_dtype_in(const char *op, const char *arg, const Tensor &t, ScalarType a,
                           ScalarType b, const char *expected) {
  STD_TORCH_CHECK(t.scalar_type() == a || t.scalar_type() == b, op, ": ", arg, " has dtype ",
                  dtype_name(t.scalar_type()), ", expected ", expected);
}

inline void check_same_device(const char *op, const char *arg, const Tensor &t, const Tensor &ref,
                              const char *ref_arg) {
  STD_TORCH_CHECK(t.get_device() == ref.get_device() &&
                      t.get_device_index() == ref.get_device_index(),
                  op, ": ", arg, " is on ", device_name(t), " but ", ref_arg, " is on ",
                  device_name(ref), "; all tensors must be on one device");
}

// t on ref's device and of ref's dtype.
inline void check_like(const char *op, const char *arg, const Tensor &t, const Tensor &ref,
                       const char *ref_arg) {
  check_same_device(op, arg, t, ref, ref_arg);
  STD_TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", arg, " has dtype ",
                  dtype_name(t.scalar_type()), ", expected the dtype of ", ref_arg, " (",
                  dtype_name(ref.scalar_type()), ")");
}

inline void check_same_shape(const char *op, const char *arg, const Tensor &t, const Tensor &ref,
                             const char *ref_arg) {
  bool same = t.dim() == ref.dim();
  for (int64_t d = 0; same && d < t.dim(); ++d) same = t.size(d) == ref.size(d);
  STD_TORCH_CHECK(same, op, ": ", arg, " has shape ", shape_str(t), ", expected the shape of ",
                  ref_arg, " ", shape_str(ref));
}

// Whether t's last dimension is unit-stride (or of at most one element).
inline bool is_unit_last(const Tensor &t) {
  const int64_t last = t.dim() - 1;
  return t.size(last) <= 1 || t.stride(last) == 1;
}

// Allocation. Every output and every copy a shim makes goes through these.
// Through the stable ABI of torch 2.11 a failed allocation reaches us as
// "torch_call_dispatcher(...) API call failed at .../stable/ops.h", without
// its cause; one of a size that exists (the sizes come from the op's tensors)
// fails for want of memory, so it is raised again as that, naming the op, the
// tensor and the bytes asked for. `op` and `name` default to words that name
// neither, for the shims that do not pass them yet.
inline int64_t element_bytes(ScalarType t) {
  switch (t) {
    case ScalarType::Double: case ScalarType::Long: return 8;
    case ScalarType::Float: case ScalarType::Int: return 4;
    case ScalarType::Half: case ScalarType::BFloat16: case ScalarType::Short: return 2;
    default: return 1;
  }
}

[[noreturn]] inline void out_of_memory(const char *op, const std::string &what, const std::vector<int64_t> &sizes,
                                       ScalarType dtype, const std::string &device) {
  std::string shape = "[", bytes;
  int64_t n = element_bytes(dtype);
  bool overflow = false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    shape += (d ? ", " : "") + std::to_string(sizes[d]);
    overflow = overflow || __builtin_mul_overflow(n, sizes[d], &n);
  }
  bytes = overflow ? "more than 2^63" : std::to_string(n);
  check_failed(op, ": out of memory: could not allocate ", what, " (", shape, "], ", dtype_name(dtype),
               ", ", bytes, " bytes on ", device, ")");
}

inline std::vector<int64_t> sizes_of(const Tensor &t) {
  std::vector<int64_t> s(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) s[d] = t.size(d);
  return s;
}

// A new tensor of `sizes` and `dtype` on like's device: output `name` of `op`.
inline Tensor new_output(const Tensor &like, const std::vector<int64_t> &sizes, ScalarType dtype,
                         const char *op = "fusedops", const char *name = "an output") {
  try {
    return torch::stable::new_empty(like, sizes, dtype);
  } catch (const std::exception &) {
    out_of_memory(op, name, sizes, dtype, device_name(like));
  }
}

// A contiguous copy of t (argument `name` of `op`), or t if it is one.
inline Tensor contiguous_copy(const Tensor &t, const char *op = "fusedops", const char *name = "an input") {
  if (t.is_contiguous()) return t;
  try {
    return torch::stable::contiguous(t);
  } catch (const std::exception &) {
    out_of_memory(op, std::string("a contiguous copy of ") + name, sizes_of(t), t.scalar_type(),
                  device_name(t));
  }
}

inline Tensor empty_like_shape(const Tensor &like, ScalarType dtype, const char *op = "fusedops",
                               const char *name = "an output") {
  return new_output(like, sizes_of(like), dtype, op, name);
}

inline Tensor empty_1d(const Tensor &like, int64_t n, ScalarType dtype, const char *op = "fusedops",
                       const char *name = "an output") {
  return new_output(like, {n}, dtype, op, name);
}

// t with a unit-stride last dimension, for kernels that read every other
// dimension through its stride: t itself, or a contiguous copy when its last
// dimension is strided (never misread).
inline Tensor unit_last(const Tensor &t, const char *op = "fusedops", const char *name = "an input") {
  return is_unit_last(t) ? t : contiguous_copy(t, op, name);
}

// A 1-D parameter of `n` elements (weight, bias), made contiguous if it is not.
inline Tensor vector_arg(const char *op, const char *arg, const Tensor &t, int64_t n) {
  STD_TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", arg, " has shape ", shape_str(t),
                  ", expected [", n, "] (the size of the last dimension of the input)");
  return unit_last(t, op, arg);
}

inline int64_t numel_rows(const Tensor &t) {
  int64_t r = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) r *= t.size(d);
  return r;
}

// The leading dims of a tensor (all but the last) as at most `max_levels`
// (size, stride) levels, innermost first: dims of size 1 dropped, a dim merged
// into the next-inner level when it is contiguous with it. ok is false when
// more levels than that remain or the last dim is not unit-stride.
struct RowLevels {
  bool ok;
  int n;
  int64_t size[2], stride[2];
};

inline RowLevels row_levels(const Tensor &in, int max_levels) {
  const int64_t nd = in.dim();
  RowLevels lv{in.size(nd - 1) <= 1 || in.stride(nd - 1) == 1, 0, {0, 0}, {0, 0}};
  for (int64_t d = nd - 2; lv.ok && d >= 0; --d) {
    if (in.size(d) == 1) continue;
    if (lv.n && in.stride(d) == lv.stride[lv.n - 1] * lv.size[lv.n - 1]) {
      lv.size[lv.n - 1] *= in.size(d);
    } else if (lv.n < max_levels) {
      lv.size[lv.n] = in.size(d);
      lv.stride[lv.n++] = in.stride(d);
    } else {
      lv.ok = false;
    }
  }
  return lv;
}

// A tensor read as a [rows, cols] matrix with unit stride along cols and one
// row stride (in elements). Views that fit are read in place (slices along
// the last dimension, broadcast rows); anything else is copied, never misread.
struct RowView {
  Tensor t;
  int64_t rows, cols, stride;
};

inline RowView row_view(const Tensor &in, const char *op = "fusedops", const char *name = "an input") {
  const int64_t cols = in.size(in.dim() - 1);
  const int64_t rows = numel_rows(in);
  const RowLevels lv = row_levels(in, 1);
  if (lv.ok) return {in, rows, cols, lv.n ? lv.stride[0] : cols};
  return {contiguous_copy(in, op, name), rows, cols, cols};
}

inline ScalarType scalar_type_of(fo_dtype t) {
  return t == FO_F32 ? ScalarType::Float : t == FO_F16 ? ScalarType::Half : ScalarType::BFloat16;
}

#ifdef FUSEDOPS_WITH_CUDA
inline void *current_cuda_stream(const Tensor &t) {
  void *stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream) ==
                      AOTI_TORCH_SUCCESS,
                  "fusedops: could not get the current CUDA stream");
  return stream;
}
#endif

// Runs an op's kernel where `on` (the argument named `arg`) lives: cpu() on
// the CPU; cuda(stream) on its GPU, under a guard for that device and on its
// current stream. Each returns NULL, or what stopped it, raised as op's error.
// (Without CUDA, cuda is never called, so its body is never emitted.)
template <class Cpu, class Cuda>
void run_kernel(const char *op, const char *arg, const Tensor &on, Cpu &&cpu, Cuda &&cuda) {
  if (on.is_cpu()) {
    const char *err = cpu();
    STD_TORCH_CHECK(err == nullptr, op, ": ", err);
    return;
  }
#ifdef FUSEDOPS_WITH_CUDA
  torch::stable::accelerator::DeviceGuard guard(on.get_device_index());
  const char *err = cuda(current_cuda_stream(on));
  STD_TORCH_CHECK(err == nullptr, op, ": CUDA error: ", err);
#else
  (void)cuda;
  STD_TORCH_CHECK(false, op, ": ", arg, " is on ", device_name(on), ", expected cpu (built without CUDA)");
#endif
}

}  // namespace fusedops
