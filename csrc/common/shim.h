// Helpers shared by every *_ops.cpp shim: argument checks that produce the
// library's error messages ("<op>: <arg> <what was given>, expected <what>"),
// dtype mapping, 2-D row views and the current CUDA stream.
#pragma once
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
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

// A new contiguous tensor of `sizes` and `dtype` on like's device: output
// `name` of `op`. Through the C shim's aoti_torch_aten_new_empty, which
// calls ATen's new_empty directly, not torch::stable::new_empty, which (with
// the 2.11 target) looks aten::new_empty up by name in the dispatcher and
// boxes its arguments every call. Still ATen's empty underneath: the caching
// allocator on a GPU, and the NaN fill of torch's deterministic mode with
// fill_uninitialized_memory (the tests' poisoned outputs).
inline Tensor new_output(const Tensor &like, const std::vector<int64_t> &sizes, ScalarType dtype,
                         const char *op = "fusedops", const char *name = "an output") {
  int32_t dt = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  int32_t layout = aoti_torch_layout_strided(), device_type = 0;
  AtenTensorHandle out = nullptr;
  if (aoti_torch_get_device_type(like.get(), &device_type) != AOTI_TORCH_SUCCESS ||
      aoti_torch_aten_new_empty(like.get(), sizes.data(), static_cast<int64_t>(sizes.size()), &dt, &layout,
                                &device_type, like.get_device_index(), nullptr, &out) != AOTI_TORCH_SUCCESS)
    out_of_memory(op, name, sizes, dtype, device_name(like));
  return Tensor(out);
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

// ---- aliasing: the checks of every op that writes an argument -------------------
// An op that writes a tensor in place reads and writes its elements on several
// threads at once, in an order of its own. That is only right when
//  - each element of a written tensor is stored once: no stride 0 (expand())
//    or overlapping strides along a dimension of size > 1 (the element would
//    be updated once for every index that reaches it), and
//  - no element of a written tensor belongs to another argument: a write
//    would change what that argument still has to give, or two writes race.
// check_no_aliasing(op, args) checks both, each written arg against every
// other arg (two read-only args may share memory), and raises naming the
// args before anything is written. Views of one buffer that never meet (the
// q and k heads of a packed q/k/v projection) pass: memory is compared
// element by element, not by the span from first to last byte.
struct AliasArg {
  const char *name;   // the argument, e.g. "q" or "params"
  int64_t index;      // its place in a tensor list, or -1
  const Tensor *t;
  bool written;
};

namespace alias_detail {

inline std::string arg_name(const AliasArg &a) {
  return a.index < 0 ? std::string(a.name) : std::string(a.name) + "[" + std::to_string(a.index) + "]";
}

// One tensor's elements as bytes: the span [lo, hi) from its first to its last
// byte, and its dimensions of size > 1 and stride != 0 as (stride, size) in bytes.
struct Bytes {
  intptr_t lo, hi;
  int64_t item;
  std::vector<std::pair<int64_t, int64_t>> dims;
};

inline Bytes bytes_of(const Tensor &t) {
  Bytes b{reinterpret_cast<intptr_t>(t.data_ptr()), 0, static_cast<int64_t>(t.element_size()), {}};
  int64_t last = 0;  // offset of the last element, in bytes
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1 || t.stride(d) == 0) continue;
    b.dims.emplace_back(t.stride(d) * b.item, t.size(d));
    last += (t.size(d) - 1) * t.stride(d) * b.item;
  }
  b.hi = b.lo + last + b.item;
  return b;
}

// Whether every element of t is stored once: t has no dimension of size > 1
// and stride 0, and, its dimensions taken from the smallest stride up, each
// stride steps past everything the smaller ones reach (the layout of every
// view that slicing, transposing or permuting a tensor gives). A layout that
// passes neither test (as_strided's) is taken as overlapping.
inline bool stored_once(const Tensor &t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size), in elements
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return true;
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 1;  // elements from the first to one past the last, over the dims so far
  for (auto [stride, size] : dims) {
    if (stride < reach) return false;
    reach += stride * (size - 1);
  }
  return true;
}

// Whether sum_k coef[k] * v[k] == target for some integers lo[k] <= v[k] <=
// hi[k] (terms sorted by coef, largest first, coef > 0): a search over the
// terms that keeps, for each, only the values the remaining terms can still
// make up. With the strides of real views a handful of steps; past `budget`
// steps the answer is yes (taken as shared: refused, never misread).
struct Term {
  int64_t coef, lo, hi;
};

inline int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
inline int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

inline bool solvable(const std::vector<Term> &terms, const std::vector<int64_t> &min_from,
                     const std::vector<int64_t> &max_from, size_t k, int64_t target, int64_t &budget) {
  if (k == terms.size()) return target == 0;
  if (target < min_from[k] || target > max_from[k]) return false;
  const Term &t = terms[k];
  const int64_t v0 = std::max(t.lo, ceil_div(target - max_from[k + 1], t.coef));
  const int64_t v1 = std::min(t.hi, floor_div(target - min_from[k + 1], t.coef));
  for (int64_t v = v0; v <= v1; ++v) {
    if (--budget < 0) return true;
    if (solvable(terms, min_from, max_from, k + 1, target - v * t.coef, budget)) return true;
  }
  return false;
}

// Whether some byte of an element of a is a byte of an element of b. An
// element of a at a.lo + sum i_d sa_d and one of b at b.lo + sum j_e sb_e
// share a byte when the first minus the second lies in [-(a.item - 1),
// b.item - 1]: sum i_d sa_d - sum j_e sb_e - u = b.lo - a.lo with u in that
// range, i_d and j_e within their sizes.
inline bool share_bytes(const Bytes &a, const Bytes &b) {
  if (a.hi <= b.lo || b.hi <= a.lo) return false;
  std::vector<Term> terms;
  for (auto [stride, size] : a.dims) terms.push_back({stride, 0, size - 1});
  for (auto [stride, size] : b.dims) terms.push_back({stride, -(size - 1), 0});
  terms.push_back({1, -(b.item - 1), a.item - 1});
  std::sort(terms.begin(), terms.end(), [](const Term &x, const Term &y) { return x.coef > y.coef; });
  // Terms of one coef become one (c v1 + c v2 takes every c v with v in the
  // summed range): a and b with the same strides then search a term a dim.
  std::vector<Term> merged;
  for (const Term &t : terms) {
    if (!merged.empty() && merged.back().coef == t.coef) merged.back() = {t.coef, merged.back().lo + t.lo, merged.back().hi + t.hi};
    else merged.push_back(t);
  }
  terms.swap(merged);
  std::vector<int64_t> min_from(terms.size() + 1, 0), max_from(terms.size() + 1, 0);
  for (size_t k = terms.size(); k-- > 0;) {
    min_from[k] = min_from[k + 1] + terms[k].coef * terms[k].lo;
    max_from[k] = max_from[k + 1] + terms[k].coef * terms[k].hi;
  }
  int64_t budget = 1 << 14;
  return solvable(terms, min_from, max_from, 0, static_cast<int64_t>(b.lo - a.lo), budget);
}

inline bool same_device(const Tensor &a, const Tensor &b) {
  return a.get_device() == b.get_device() && a.get_device_index() == b.get_device_index();
}

}  // namespace alias_detail

inline void check_no_aliasing(const char *op, const std::vector<AliasArg> &args) {
  using namespace alias_detail;
  std::vector<Bytes> bytes;
  std::vector<size_t> order;  // the nonempty args, by first byte
  bytes.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const AliasArg &a = args[i];
    bytes.push_back(a.t->numel() ? bytes_of(*a.t) : Bytes{0, 0, 0, {}});
    if (!a.t->numel()) continue;
    order.push_back(i);
    STD_TORCH_CHECK(!a.written || stored_once(*a.t), op, ": ", arg_name(a), " has shape ", shape_str(*a.t),
                    " and strides ", strides_str(*a.t),
                    ", whose elements overlap (a stride of 0, as expand() gives, or strides that overlap), "
                    "expected each element stored once (", arg_name(a), " is written in place)");
  }
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return bytes[x].lo < bytes[y].lo; });
  // Each arg against those whose span starts before its own ends.
  for (size_t i = 0; i < order.size(); ++i) {
    for (size_t j = i + 1; j < order.size() && bytes[order[j]].lo < bytes[order[i]].hi; ++j) {
      const AliasArg &a = args[std::min(order[i], order[j])], &b = args[std::max(order[i], order[j])];
      if (!(a.written || b.written) || !same_device(*a.t, *b.t)) continue;
      if (!share_bytes(bytes[order[i]], bytes[order[j]])) continue;
      const AliasArg &w = a.written ? a : b;
      STD_TORCH_CHECK(false, op, ": ", arg_name(a), " and ", arg_name(b), " share memory, expected separate tensors (",
                      arg_name(w), " is written in place; ", arg_name(a), " has shape ", shape_str(*a.t),
                      " and strides ", strides_str(*a.t), ", ", arg_name(b), " shape ", shape_str(*b.t),
                      " and strides ", strides_str(*b.t), ")");
    }
  }
}

}  // namespace fusedops

// ---- str arguments ----------------------------------------------------------------
// A schema's `str` argument is taken as fusedops::StrArg, never std::string:
// torch 2.11-2.13's stable headers unbox a str by copying it out of a
// std::string they allocate and never free (torch 2.14 frees it). On the CPU
// the lost block lands in memory the call's outputs had used, which then no
// longer fits the next call's outputs: the heap grew by the outputs' size
// every call. StrArg's conversion below frees what it reads, under every torch.
namespace fusedops __attribute__((visibility("hidden"))) {
struct StrArg {
  std::string value;
  operator const std::string &() const { return value; }
};
}  // namespace fusedops

HIDDEN_NAMESPACE_BEGIN(torch, stable, detail)
template <>
struct ToImpl<fusedops::StrArg> {
  static fusedops::StrArg call(StableIValue val, uint64_t, bool) {
    StringHandle handle = to<StringHandle>(val);
    size_t length;
    const char *data;
    TORCH_ERROR_CODE_CHECK(torch_string_length(handle, &length));
    TORCH_ERROR_CODE_CHECK(torch_string_c_str(handle, &data));
    fusedops::StrArg s{std::string(data, length)};
    TORCH_ERROR_CODE_CHECK(torch_delete_string(handle));
    return s;
  }
};
HIDDEN_NAMESPACE_END(torch, stable, detail)
