// Registration shim for fusedops::attn_fwd / attn_bwd / attn_bwd_packed and
// their packed-sequence forms attn_varlen_fwd / attn_varlen_bwd: checks the
// arguments, allocates outputs, fills the C params struct, calls the kernel.
#include "../common/shim.h"
#include "attention.h"

#include <cmath>
#include <limits>
#include <tuple>


namespace fusedops {
namespace {

// The kernels' strides (batch, seq, head) of a [B, S, H, D] tensor, or of a
// varlen [total, H, D] one (no batch: 0).
fo_attn_strides bshd_strides(const Tensor &t) {
  if (t.dim() == 3) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

#ifdef FUSEDOPS_WITH_CUDA
// The CUDA kernels move 16-byte chunks: a 16-byte aligned base and strides
// that are multiples of 8 elements. Other inputs are copied (clone keeps a
// dense layout's strides, all multiples of D, on fresh aligned storage).
Tensor cuda_readable(const char *op, const char *arg, const Tensor &t) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  if (ok) return t;
  Tensor c;
  try {
    c = torch::stable::clone(t);
  } catch (const std::exception &) {
    out_of_memory(op, std::string("an aligned copy of ") + arg, sizes_of(t), t.scalar_type(), device_name(t));
  }
  bool dense_ok = true;
  for (int64_t d = 0; d + 1 < c.dim(); ++d) dense_ok = dense_ok && (c.size(d) <= 1 || c.stride(d) % 8 == 0);
  return dense_ok ? c : contiguous_copy(c, op, arg);
}

// Head dims and dtypes attention_fwd_cuda.cu and attention_bwd_cuda.cu are
// built for. batch: q's batch size, or the number of sequences (varlen).
void check_cuda_fwd(const char *op, const Tensor &q, int64_t batch) {
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Half || q.scalar_type() == ScalarType::BFloat16,
                  op, ": q has dtype ", dtype_name(q.scalar_type()),
                  ", expected float16 or bfloat16 on CUDA");
  const int64_t d = q.size(q.dim() - 1), heads = q.size(q.dim() - 2);
  STD_TORCH_CHECK(d == 32 || d == 64 || d == 96 || d == 128 || d == 256, op, ": q has head_dim ", d,
                  ", expected 32, 64, 96, 128 or 256 on CUDA");
  // One grid row per (batch, head): the CUDA grid's y extent.
  STD_TORCH_CHECK(batch * heads <= 65535, op, ": q has batch x heads = ", batch, " x ", heads, " = ",
                  batch * heads, ", expected at most 65535 on CUDA");
}

#endif

// An operand as the kernels of its device read it: unit-stride last dimension,
// and on CUDA the alignment cuda_readable asks for.
Tensor kernel_readable(const char *op, const char *arg, const Tensor &t) {
  Tensor r = unit_last(t, op, arg);
#ifdef FUSEDOPS_WITH_CUDA
  if (r.is_cuda()) r = cuda_readable(op, arg, r);
#endif
  return r;
}

// The padded layout: [B, S, H, D] tensors; varlen: [total, H, D].
void check_dims(const char *op, const char *arg, const Tensor &t, bool varlen) {
  STD_TORCH_CHECK(t.dim() == (varlen ? 3 : 4), op, ": ", arg, " has shape ", shape_str(t),
                  varlen ? ", expected 3 dimensions [total_tokens, heads, head_dim]"
                         : ", expected 4 dimensions [batch, seq, heads, head_dim]");
}

// q [B, Sq, Hq, D]; k, v [B, Sk, Hkv, D] (varlen: q [total_q, Hq, D]; k, v
// [total_k, Hkv, D]) with Hq a multiple of Hkv; one dtype and one device.
// Returns the dtype tag.
fo_dtype check_qkv(const char *op, const Tensor &q, const Tensor &k, const Tensor &v, bool varlen = false) {
  check_dims(op, "q", q, varlen);
  check_dims(op, "k", k, varlen);
  check_dims(op, "v", v, varlen);
  const fo_dtype dt = kernel_dtype(op, "q", q);
  const char *qdt = dtype_name(q.scalar_type());
  check_dtype_in(op, "k", k, q.scalar_type(), q.scalar_type(), qdt);
  check_dtype_in(op, "v", v, q.scalar_type(), q.scalar_type(), qdt);
  check_same_device(op, "k", k, q, "q");
  check_same_device(op, "v", v, q, "q");
  const int64_t hd = q.dim() - 1, hh = q.dim() - 2;  // head_dim, heads
  STD_TORCH_CHECK(q.size(hd) >= 1, op, ": q has head_dim 0, expected at least 1");
  STD_TORCH_CHECK(varlen || k.size(0) == q.size(0), op, ": k has batch size ", k.size(0),
                  ", expected the batch size of q (", q.size(0), ")");
  STD_TORCH_CHECK(k.size(hd) == q.size(hd), op, ": k has head_dim ", k.size(hd),
                  ", expected the head_dim of q (", q.size(hd), ")");
  check_same_shape(op, "v", v, k, "k");
  STD_TORCH_CHECK(k.size(hh) >= 1, op, ": k has 0 heads, expected at least 1");
  STD_TORCH_CHECK(q.size(hh) % k.size(hh) == 0, op, ": q has ", q.size(hh),
                  " heads, expected a multiple of the ", k.size(hh), " heads of k");
  return dt;
}

// The mask of a call in the params' terms (attention.h): the window sides
// checked (-1: unbounded), causal folded in as window_right = 0, p.causal
// set where that is the whole mask; softcap checked.
fo_attn_params mask_params(const char *op, bool causal, int64_t window_left, int64_t window_right,
                           double softcap) {
  STD_TORCH_CHECK(window_left >= -1, op, ": window_left is ", window_left,
                  ", expected -1 (unbounded) or a number of keys >= 0");
  STD_TORCH_CHECK(window_right >= -1, op, ": window_right is ", window_right,
                  ", expected -1 (unbounded) or a number of keys >= 0");
  STD_TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, op, ": softcap is ", softcap,
                  ", expected a finite value >= 0 (0: no soft-capping)");
  fo_attn_params p{};
  p.window_left = window_left;
  p.window_right = causal ? 0 : window_right;
  p.causal = p.window_left < 0 && p.window_right == 0;
  p.softcap = static_cast<float>(softcap);
  return p;
}

// Packed sequences: cu_seqlens_q / _k int32, 1-D, B + 1 values each, on q's
// device; on the CPU also their values: first 0, non-decreasing, last the
// number of tokens of q (k), no sequence longer than max_seqlen_q (_k). On a
// GPU the values are the caller's to keep, as FlashAttention's: reading them
// would synchronise the stream inside the op.
void check_cu_values(const char *op, const char *arg, const Tensor &cu, int64_t total, const char *of,
                     int64_t max_len, const char *max_arg) {
  if (!cu.is_cpu()) return;
  const int32_t *c = static_cast<const int32_t *>(cu.data_ptr());
  const int64_t n = cu.size(0), st = cu.stride(0);
  STD_TORCH_CHECK(c[0] == 0, op, ": ", arg, "[0] is ", c[0], ", expected 0 (the prefix sums of the sequence lengths)");
  for (int64_t b = 0; b + 1 < n; ++b)
    STD_TORCH_CHECK(c[(b + 1) * st] >= c[b * st], op, ": ", arg, " decreases from ", c[b * st], " to ",
                    c[(b + 1) * st], " at index ", b + 1,
                    ", expected non-decreasing prefix sums of the sequence lengths");
  STD_TORCH_CHECK(c[(n - 1) * st] == total, op, ": ", arg, "[-1] is ", c[(n - 1) * st], ", expected the ", of,
                  " (", total, ")");
  for (int64_t b = 0; b + 1 < n; ++b) {
    const int64_t len = static_cast<int64_t>(c[(b + 1) * st]) - c[b * st];
    STD_TORCH_CHECK(len <= max_len, op, ": ", arg, " gives sequence ", b, " ", len, " tokens, expected at most ",
                    max_arg, " (", max_len, ")");
  }
}

int64_t check_varlen(const char *op, const Tensor &q, const Tensor &k, const Tensor &cu_q, const Tensor &cu_k,
                     int64_t max_q, int64_t max_k) {
  for (const Tensor *t : {&cu_q, &cu_k}) {
    const char *arg = t == &cu_q ? "cu_seqlens_q" : "cu_seqlens_k";
    check_dtype_in(op, arg, *t, ScalarType::Int, ScalarType::Int, "int32");
    STD_TORCH_CHECK(t->dim() == 1 && t->size(0) >= 1, op, ": ", arg, " has shape ", shape_str(*t),
                    ", expected 1 dimension of batch + 1 >= 1 values (prefix sums of the sequence lengths)");
    check_same_device(op, arg, *t, q, "q");
  }
  STD_TORCH_CHECK(cu_k.size(0) == cu_q.size(0), op, ": cu_seqlens_k has ", cu_k.size(0),
                  " values, expected as many as cu_seqlens_q (", cu_q.size(0), ")");
  STD_TORCH_CHECK(max_q >= 0, op, ": max_seqlen_q is ", max_q, ", expected at least 0");
  STD_TORCH_CHECK(max_k >= 0, op, ": max_seqlen_k is ", max_k, ", expected at least 0");
  check_cu_values(op, "cu_seqlens_q", cu_q, q.size(0), "number of tokens of q", max_q, "max_seqlen_q");
  check_cu_values(op, "cu_seqlens_k", cu_k, k.size(0), "number of tokens of k", max_k, "max_seqlen_k");
  return cu_q.size(0) - 1;
}

// Packed sequences (varlen): the offsets, contiguous, and the longest lengths.
struct Varlen {
  Tensor cu_q, cu_k;
  int64_t max_q, max_k;
};

Varlen varlen_args(const char *op, const Tensor &q, const Tensor &k, const Tensor &cu_q, const Tensor &cu_k,
                   int64_t max_q, int64_t max_k) {
  check_varlen(op, q, k, cu_q, cu_k, max_q, max_k);
  return {contiguous_copy(cu_q, op, "cu_seqlens_q"), contiguous_copy(cu_k, op, "cu_seqlens_k"), max_q, max_k};
}

// The number of sequences: the batch size, or the entries of cu_seqlens_q less one.
int64_t sequences(const Tensor &q, const Varlen *vl) { return vl ? vl->cu_q.size(0) - 1 : q.size(0); }

// The seq dimension of q, k, v: 1, or 0 in varlen.
int64_t seq_dim(const Tensor &t) { return t.dim() - 3; }

// lse [B, Hq, Sq], or [Hq, total_q] in varlen.
std::vector<int64_t> lse_shape(const Tensor &q, const Varlen *vl) {
  const int64_t s = seq_dim(q);
  if (vl) return {q.size(s + 1), q.size(s)};
  return {q.size(0), q.size(s + 1), q.size(s)};
}
fo_attn_strides lse_strides(const Tensor &lse) {
  if (lse.dim() == 2) return {0, lse.stride(1), lse.stride(0)};
  return {lse.stride(0), lse.stride(2), lse.stride(1)};
}

// The params of a call from its checked, kernel-readable inputs; p holds the mask.
void fill_params(fo_attn_params &p, const Tensor &q, const Tensor &k, const Tensor &v, double scale,
                 fo_dtype dt, const Varlen *vl) {
  const int64_t s = seq_dim(q);
  p.B = sequences(q, vl);
  p.Sq = vl ? vl->max_q : q.size(s);
  p.Sk = vl ? vl->max_k : k.size(s);
  p.Hq = q.size(s + 1);
  p.D = q.size(s + 2);
  p.Hkv = k.size(s + 1);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_st = bshd_strides(q);
  p.k_st = bshd_strides(k);
  p.v_st = bshd_strides(v);
  p.scale = static_cast<float>(scale);
  p.dtype = dt;
  if (vl) {
    p.cu_seqlens_q = static_cast<const int32_t *>(vl->cu_q.data_ptr());
    p.cu_seqlens_k = static_cast<const int32_t *>(vl->cu_k.data_ptr());
    p.total_q = q.size(0);
    p.total_k = k.size(0);
  }
}

// The forward of both layouts (vl null: padded).
std::tuple<Tensor, Tensor> fwd(const char *op, Tensor q, Tensor k, Tensor v, const Tensor *cu_q,
                               const Tensor *cu_k, int64_t max_q, int64_t max_k, double scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap) {
  const bool varlen = cu_q != nullptr;
  const fo_dtype dt = check_qkv(op, q, k, v, varlen);
  fo_attn_params p = mask_params(op, causal, window_left, window_right, softcap);
  Varlen vlen;
  if (varlen) vlen = varlen_args(op, q, k, *cu_q, *cu_k, max_q, max_k);
  const Varlen *vl = varlen ? &vlen : nullptr;
  Tensor out = new_output(q, sizes_of(q), q.scalar_type(), op, "out");
  Tensor lse = new_output(q, lse_shape(q, vl), ScalarType::Float, op, "lse");
#ifdef FUSEDOPS_WITH_CUDA
  if (q.is_cuda()) check_cuda_fwd(op, q, sequences(q, vl));
#endif
  if (out.numel() == 0) return {out, lse};  // no batch, query or head (head_dim >= 1)
  if (k.size(seq_dim(k)) == 0) {
    // No key: every row attends to nothing. torch gives out = 0; lse = -inf.
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  q = kernel_readable(op, "q", q);
  k = kernel_readable(op, "k", k);
  v = kernel_readable(op, "v", v);

  fill_params(p, q, k, v, scale, dt, vl);
  p.out = out.data_ptr();
  p.out_st = bshd_strides(out);
  p.lse = static_cast<float *>(lse.data_ptr());
  p.lse_st = lse_strides(lse);
  run_kernel(op, "q", q, [&] { return fo_attn_fwd_cpu(&p); },
             [&](void *stream) {
               p.wgmma = fo_attn_wgmma_applies(&p);
               return fo_attn_fwd_cuda(&p, stream);
             });
  return {out, lse};
}

std::tuple<Tensor, Tensor> attn_fwd(Tensor q, Tensor k, Tensor v, double scale, bool causal, bool deterministic,
                                    int64_t window_left, int64_t window_right, double softcap) {
  (void)deterministic;  // kept for the backward (see library.cpp)
  return fwd("fusedops.attn_fwd", q, k, v, nullptr, nullptr, 0, 0, scale, causal, window_left, window_right,
             softcap);
}

std::tuple<Tensor, Tensor> attn_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                                           int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, bool causal,
                                           bool deterministic, int64_t window_left, int64_t window_right,
                                           double softcap) {
  (void)deterministic;
  return fwd("fusedops.attn_varlen_fwd", q, k, v, &cu_seqlens_q, &cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
             causal, window_left, window_right, softcap);
}

// The gradients into dq, dk, dv (shaped as q, k, v; any strides the kernels
// write: unit-stride last dimension, and on CUDA those of cuda_readable), for
// both layouts (cu_q null: padded).
void bwd_into(const char *op, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
              const Tensor *cu_q, const Tensor *cu_k, int64_t max_q, int64_t max_k, double scale, bool causal,
              bool deterministic, int64_t window_left, int64_t window_right, double softcap, Tensor dq,
              Tensor dk, Tensor dv) {
  const bool varlen = cu_q != nullptr;
  const fo_dtype dt = check_qkv(op, q, k, v, varlen);
  const char *qdt = dtype_name(q.scalar_type());
  for (const Tensor *t : {&dout, &out}) {
    const char *arg = t == &dout ? "dout" : "out";
    check_same_device(op, arg, *t, q, "q");
    check_same_shape(op, arg, *t, q, "q");
    check_dtype_in(op, arg, *t, q.scalar_type(), q.scalar_type(), qdt);
  }
  fo_attn_params p = mask_params(op, causal, window_left, window_right, softcap);
  Varlen vlen;
  if (varlen) vlen = varlen_args(op, q, k, *cu_q, *cu_k, max_q, max_k);
  const Varlen *vl = varlen ? &vlen : nullptr;
  check_same_device(op, "lse", lse, q, "q");
  check_dtype_in(op, "lse", lse, ScalarType::Float, ScalarType::Float, "float32");
  const std::vector<int64_t> want = lse_shape(q, vl);
  bool lse_ok = lse.dim() == static_cast<int64_t>(want.size());
  for (int64_t d = 0; lse_ok && d < lse.dim(); ++d) lse_ok = lse.size(d) == want[d];
  if (varlen) {
    STD_TORCH_CHECK(lse_ok, op, ": lse has shape ", shape_str(lse), ", expected [", want[0], ", ", want[1],
                    "] (q heads, total q tokens)");
  } else {
    STD_TORCH_CHECK(lse_ok, op, ": lse has shape ", shape_str(lse), ", expected [", want[0], ", ", want[1], ", ",
                    want[2], "] (batch, q heads, q seq)");
  }

#ifdef FUSEDOPS_WITH_CUDA
  if (q.is_cuda()) check_cuda_fwd(op, q, sequences(q, vl));
#endif
  if (q.numel() == 0) {
    // No query: nothing flows back to k and v (which may still have keys).
    torch::stable::zero_(dk);
    torch::stable::zero_(dv);
    return;
  }
  if (k.size(seq_dim(k)) == 0) {
    // No key: out was 0 whatever q was; dk and dv are empty.
    torch::stable::zero_(dq);
    return;
  }
  q = kernel_readable(op, "q", q);
  k = kernel_readable(op, "k", k);
  v = kernel_readable(op, "v", v);
  dout = kernel_readable(op, "dout", dout);
  out = kernel_readable(op, "out", out);
  if (varlen) lse = contiguous_copy(lse, op, "lse");  // attention.h: [Hq, total_q] dense

  fill_params(p, q, k, v, scale, dt, vl);
  p.deterministic = deterministic;
  p.out = out.data_ptr();
  p.out_st = bshd_strides(out);
  p.dout = dout.data_ptr();
  p.dout_st = bshd_strides(dout);
  p.lse = static_cast<float *>(lse.data_ptr());
  p.lse_st = lse_strides(lse);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_st = bshd_strides(dq);
  p.dk_st = bshd_strides(dk);
  p.dv_st = bshd_strides(dv);
  // The kernel's scratch, sized by the device's kernels; kept alive by the
  // caller until the kernel has run (or been queued on the current stream).
  auto workspace = [&](int64_t floats) {
    Tensor t = new_output(q, {floats}, ScalarType::Float, op, "the kernel's workspace");
    p.workspace = static_cast<float *>(t.data_ptr());
    return t;
  };
  run_kernel(op, "q", q,
             [&] {
               p.splits = fo_attn_bwd_cpu_splits(&p);
               Tensor ws = workspace(fo_attn_bwd_cpu_workspace(&p));
               return fo_attn_bwd_cpu(&p);
             },
             [&](void *stream) {
               p.wgmma = fo_attn_wgmma_applies(&p);  // once: the workspace's size and the launches agree
               Tensor ws = workspace(fo_attn_bwd_cuda_workspace(&p));
               return fo_attn_bwd_cuda(&p, stream);
             });
}

std::tuple<Tensor, Tensor, Tensor> new_grads(const char *op, const Tensor &q, const Tensor &k, const Tensor &v) {
  return {empty_like_shape(q, q.scalar_type(), op, "dq"), empty_like_shape(k, k.scalar_type(), op, "dk"),
          empty_like_shape(v, v.scalar_type(), op, "dv")};
}

std::tuple<Tensor, Tensor, Tensor> attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                                            double scale, bool causal, bool deterministic, int64_t window_left,
                                            int64_t window_right, double softcap) {
  const char *op = "fusedops.attn_bwd";
  auto [dq, dk, dv] = new_grads(op, q, k, v);
  bwd_into(op, dout, q, k, v, out, lse, nullptr, nullptr, 0, 0, scale, causal, deterministic, window_left,
           window_right, softcap, dq, dk, dv);
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor, Tensor> attn_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                   Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                                                   int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                   bool causal, bool deterministic, int64_t window_left,
                                                   int64_t window_right, double softcap) {
  const char *op = "fusedops.attn_varlen_bwd";
  auto [dq, dk, dv] = new_grads(op, q, k, v);
  bwd_into(op, dout, q, k, v, out, lse, &cu_seqlens_q, &cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
           deterministic, window_left, window_right, softcap, dq, dk, dv);
  return {dq, dk, dv};
}

// The gradients as one [B, S, Hq + 2 Hkv, D] tensor: dq, dk, dv side by side
// along the heads, the layout of a joint q / k / v projection's output, so
// that its backward is one matmul and nothing is copied or summed on the way.
Tensor attn_bwd_packed(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, double scale,
                       bool causal, bool deterministic, int64_t window_left, int64_t window_right,
                       double softcap) {
  const char *op = "fusedops.attn_bwd_packed";
  check_qkv(op, q, k, v);
  STD_TORCH_CHECK(k.size(1) == q.size(1), op, ": k has ", k.size(1), " keys, expected as many as q has queries (",
                  q.size(1), "): the packed gradient holds dq, dk and dv row by row");
  const int64_t hq = q.size(2), hkv = k.size(2);
  Tensor dqkv = new_output(q, {q.size(0), q.size(1), hq + 2 * hkv, q.size(3)}, q.scalar_type(), op, "dqkv");
  bwd_into(op, dout, q, k, v, out, lse, nullptr, nullptr, 0, 0, scale, causal, deterministic, window_left,
           window_right, softcap, torch::stable::narrow(dqkv, 2, 0, hq), torch::stable::narrow(dqkv, 2, hq, hkv),
           torch::stable::narrow(dqkv, 2, hq + hkv, hkv));
  return dqkv;
}

}  // namespace
}  // namespace fusedops

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("attn_fwd", TORCH_BOX(&fusedops::attn_fwd));
  m.impl("attn_bwd", TORCH_BOX(&fusedops::attn_bwd));
  m.impl("attn_bwd_packed", TORCH_BOX(&fusedops::attn_bwd_packed));
  m.impl("attn_varlen_fwd", TORCH_BOX(&fusedops::attn_varlen_fwd));
  m.impl("attn_varlen_bwd", TORCH_BOX(&fusedops::attn_varlen_bwd));
}

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("attn_fwd", TORCH_BOX(&fusedops::attn_fwd));
  m.impl("attn_bwd", TORCH_BOX(&fusedops::attn_bwd));
  m.impl("attn_bwd_packed", TORCH_BOX(&fusedops::attn_bwd_packed));
  m.impl("attn_varlen_fwd", TORCH_BOX(&fusedops::attn_varlen_fwd));
  m.impl("attn_varlen_bwd", TORCH_BOX(&fusedops::attn_varlen_bwd));
}
#endif
