// Registration shim for fusedops::attn_fwd / attn_bwd: checks the arguments,
// allocates outputs, fills the C params struct, calls the kernel.
#include "../common/shim.h"
#include "attention.h"

#include <limits>
#include <tuple>

namespace fusedops {
namespace {

fo_attn_strides bshd_strides(const Tensor &t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

#ifdef FUSEDOPS_WITH_CUDA
// The CUDA kernels move 16-byte chunks: a 16-byte aligned base and strides
// that are multiples of 8 elements. Other inputs are copied (clone keeps a
// dense layout's strides, all multiples of D, on fresh aligned storage).
Tensor cuda_readable(const char *op, const char *arg, const Tensor &t) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d < 3; ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  if (ok) return t;
  Tensor c;
  try {
    c = torch::stable::clone(t);
  } catch (const std::exception &) {
    out_of_memory(op, std::string("an aligned copy of ") + arg, sizes_of(t), t.scalar_type(), device_name(t));
  }
  bool dense_ok = true;
  for (int64_t d = 0; d < 3; ++d) dense_ok = dense_ok && (c.size(d) <= 1 || c.stride(d) % 8 == 0);
  return dense_ok ? c : contiguous_copy(c, op, arg);
}

// Head dims and dtypes attention_fwd_cuda.cu and attention_bwd_cuda.cu are built for.
void check_cuda_fwd(const char *op, const Tensor &q) {
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::Half || q.scalar_type() == ScalarType::BFloat16,
                  op, ": q has dtype ", dtype_name(q.scalar_type()),
                  ", expected float16 or bfloat16 on CUDA");
  const int64_t d = q.size(3);
  STD_TORCH_CHECK(d == 32 || d == 64 || d == 96 || d == 128 || d == 256, op, ": q has head_dim ", d,
                  ", expected 32, 64, 96, 128 or 256 on CUDA");
  // One grid row per (batch, head): the CUDA grid's y extent.
  STD_TORCH_CHECK(q.size(0) * q.size(2) <= 65535, op, ": q has batch x heads = ", q.size(0), " x ",
                  q.size(2), " = ", q.size(0) * q.size(2), ", expected at most 65535 on CUDA");
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

void check_4d(const char *op, const char *arg, const Tensor &t) {
  STD_TORCH_CHECK(t.dim() == 4, op, ": ", arg, " has shape ", shape_str(t),
                  ", expected 4 dimensions [batch, seq, heads, head_dim]");
}

// q [B, Sq, Hq, D]; k, v [B, Sk, Hkv, D] with Hq a multiple of Hkv; one dtype
// and one device. Returns the dtype tag.
fo_dtype check_qkv(const char *op, const Tensor &q, const Tensor &k, const Tensor &v) {
  check_4d(op, "q", q);
  check_4d(op, "k", k);
  check_4d(op, "v", v);
  const fo_dtype dt = kernel_dtype(op, "q", q);
  const char *qdt = dtype_name(q.scalar_type());
  check_dtype_in(op, "k", k, q.scalar_type(), q.scalar_type(), qdt);
  check_dtype_in(op, "v", v, q.scalar_type(), q.scalar_type(), qdt);
  check_same_device(op, "k", k, q, "q");
  check_same_device(op, "v", v, q, "q");
  STD_TORCH_CHECK(q.size(3) >= 1, op, ": q has head_dim 0, expected at least 1");
  STD_TORCH_CHECK(k.size(0) == q.size(0), op, ": k has batch size ", k.size(0),
                  ", expected the batch size of q (", q.size(0), ")");
  STD_TORCH_CHECK(k.size(3) == q.size(3), op, ": k has head_dim ", k.size(3),
                  ", expected the head_dim of q (", q.size(3), ")");
  check_same_shape(op, "v", v, k, "k");
  STD_TORCH_CHECK(k.size(2) >= 1, op, ": k has 0 heads, expected at least 1");
  STD_TORCH_CHECK(q.size(2) % k.size(2) == 0, op, ": q has ", q.size(2),
                  " heads, expected a multiple of the ", k.size(2), " heads of k");
  return dt;
}

fo_attn_params make_params(const Tensor &q, const Tensor &k, const Tensor &v, double scale,
                           bool causal, fo_dtype dt) {
  fo_attn_params p{};
  p.B = q.size(0);
  p.Sq = q.size(1);
  p.Hq = q.size(2);
  p.D = q.size(3);
  p.Sk = k.size(1);
  p.Hkv = k.size(2);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_st = bshd_strides(q);
  p.k_st = bshd_strides(k);
  p.v_st = bshd_strides(v);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.window_left = -1;
  p.window_right = causal ? 0 : -1;
  p.dtype = dt;
  return p;
}

std::tuple<Tensor, Tensor> attn_fwd(Tensor q, Tensor k, Tensor v, double scale, bool causal,
                                    bool deterministic) {
  (void)deterministic;  // kept for the backward (see library.cpp)
  const char *op = "fusedops.attn_fwd";
  const fo_dtype dt = check_qkv(op, q, k, v);
  const int64_t B = q.size(0), Sq = q.size(1), Hq = q.size(2), D = q.size(3);
  Tensor out = new_output(q, {B, Sq, Hq, D}, q.scalar_type(), op, "out");
  Tensor lse = new_output(q, {B, Hq, Sq}, ScalarType::Float, op, "lse");
#ifdef FUSEDOPS_WITH_CUDA
  if (q.is_cuda()) check_cuda_fwd(op, q);
#endif
  if (B == 0 || Sq == 0 || Hq == 0) return {out, lse};
  if (k.size(1) == 0) {
    // No key: every row attends to nothing. torch gives out = 0; lse = -inf.
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  q = kernel_readable(op, "q", q);
  k = kernel_readable(op, "k", k);
  v = kernel_readable(op, "v", v);

  fo_attn_params p = make_params(q, k, v, scale, causal, dt);
  p.out = out.data_ptr();
  p.out_st = bshd_strides(out);
  p.lse = static_cast<float *>(lse.data_ptr());
  p.lse_st = {lse.stride(0), lse.stride(2), lse.stride(1)};
  run_kernel(op, "q", q, [&] { return fo_attn_fwd_cpu(&p); },
             [&](void *stream) {
               p.wgmma = fo_attn_wgmma_applies(&p);
               return fo_attn_fwd_cuda(&p, stream);
             });
  return {out, lse};
}

// The gradients into dq, dk, dv (shaped as q, k, v; any strides the kernels
// write: unit-stride last dimension, and on CUDA those of cuda_readable).
void attn_bwd_into(const char *op, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                   double scale, bool causal, bool deterministic, Tensor dq, Tensor dk, Tensor dv) {
  const fo_dtype dt = check_qkv(op, q, k, v);
  const char *qdt = dtype_name(q.scalar_type());
  for (const Tensor *t : {&dout, &out}) {
    const char *arg = t == &dout ? "dout" : "out";
    check_same_device(op, arg, *t, q, "q");
    check_same_shape(op, arg, *t, q, "q");
    check_dtype_in(op, arg, *t, q.scalar_type(), q.scalar_type(), qdt);
  }
  const int64_t B = q.size(0), Sq = q.size(1), Hq = q.size(2);
  check_same_device(op, "lse", lse, q, "q");
  check_dtype_in(op, "lse", lse, ScalarType::Float, ScalarType::Float, "float32");
  STD_TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == Sq, op,
                  ": lse has shape ", shape_str(lse), ", expected [", B, ", ", Hq, ", ", Sq,
                  "] (batch, q heads, q seq)");

#ifdef FUSEDOPS_WITH_CUDA
  if (q.is_cuda()) check_cuda_fwd(op, q);
#endif
  if (B == 0 || Sq == 0 || Hq == 0) {
    // No query: nothing flows back to k and v (which may still have keys).
    torch::stable::zero_(dk);
    torch::stable::zero_(dv);
    return;
  }
  if (k.size(1) == 0) {
    // No key: out was 0 whatever q was; dk and dv are empty.
    torch::stable::zero_(dq);
    return;
  }
  q = kernel_readable(op, "q", q);
  k = kernel_readable(op, "k", k);
  v = kernel_readable(op, "v", v);
  dout = kernel_readable(op, "dout", dout);
  out = kernel_readable(op, "out", out);

  fo_attn_params p = make_params(q, k, v, scale, causal, dt);
  p.deterministic = deterministic;
  p.out = out.data_ptr();
  p.out_st = bshd_strides(out);
  p.dout = dout.data_ptr();
  p.dout_st = bshd_strides(dout);
  p.lse = static_cast<float *>(lse.data_ptr());
  p.lse_st = {lse.stride(0), lse.stride(2), lse.stride(1)};
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

std::tuple<Tensor, Tensor, Tensor> attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                            Tensor lse, double scale, bool causal,
                                            bool deterministic) {
  const char *op = "fusedops.attn_bwd";
  Tensor dq = empty_like_shape(q, q.scalar_type(), op, "dq");
  Tensor dk = empty_like_shape(k, k.scalar_type(), op, "dk");
  Tensor dv = empty_like_shape(v, v.scalar_type(), op, "dv");
  attn_bwd_into(op, dout, q, k, v, out, lse, scale, causal, deterministic, dq, dk, dv);
  return {dq, dk, dv};
}

// The gradients as one [B, S, Hq + 2 Hkv, D] tensor: dq, dk, dv side by side
// along the heads, the layout of a joint q / k / v projection's output, so
// that its backward is one matmul and nothing is copied or summed on the way.
Tensor attn_bwd_packed(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, double scale,
                       bool causal, bool deterministic) {
  const char *op = "fusedops.attn_bwd_packed";
  check_qkv(op, q, k, v);
  STD_TORCH_CHECK(k.size(1) == q.size(1), op, ": k has ", k.size(1), " keys, expected as many as q has queries (",
                  q.size(1), "): the packed gradient holds dq, dk and dv row by row");
  const int64_t hq = q.size(2), hkv = k.size(2);
  Tensor dqkv = new_output(q, {q.size(0), q.size(1), hq + 2 * hkv, q.size(3)}, q.scalar_type(), op, "dqkv");
  attn_bwd_into(op, dout, q, k, v, out, lse, scale, causal, deterministic,
                torch::stable::narrow(dqkv, 2, 0, hq), torch::stable::narrow(dqkv, 2, hq, hkv),
                torch::stable::narrow(dqkv, 2, hq + hkv, hkv));
  return dqkv;
}

}  // namespace
}  // namespace fusedops

STABLE_TORCH_LIBRARY_IMPL(fusedops, CPU, m) {
  m.impl("attn_fwd", TORCH_BOX(&fusedops::attn_fwd));
  m.impl("attn_bwd", TORCH_BOX(&fusedops::attn_bwd));
  m.impl("attn_bwd_packed", TORCH_BOX(&fusedops::attn_bwd_packed));
}

#ifdef FUSEDOPS_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("attn_fwd", TORCH_BOX(&fusedops::attn_fwd));
  m.impl("attn_bwd", TORCH_BOX(&fusedops::attn_bwd));
  m.impl("attn_bwd_packed", TORCH_BOX(&fusedops::attn_bwd_packed));
}
#endif
