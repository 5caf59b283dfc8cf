/* fusedops._C: the importable extension module. Importing it loads the shared
 * library, whose static initialisers register torch.ops.fusedops.*. Plain
 * CPython limited API; the attributes say what this binary was built with.
 * Two private functions serve tests and probes: _tune (common/tune.h) and
 * _norm_plan (norm/norm_plan.h). */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include "common/tune.h"
#include "norm/norm.h"

#ifndef FUSEDOPS_CUDA_ARCHS
#define FUSEDOPS_CUDA_ARCHS ""
#endif
#ifndef FUSEDOPS_TORCH_TARGET
#define FUSEDOPS_TORCH_TARGET ""
#endif
#ifndef FUSEDOPS_BUILT_WITH_TORCH
#define FUSEDOPS_BUILT_WITH_TORCH ""
#endif

/* _tune(name, value=None) -> the knob's old value; None resets it to its
 * default. _tune() -> {name: (value, lowest, highest, default)}. */
static PyObject *tune(PyObject *self, PyObject *args) {
  (void)self;
  const char *name = NULL;
  PyObject *value = Py_None;
  if (!PyArg_ParseTuple(args, "|sO", &name, &value)) return NULL;
  if (!name) {
    PyObject *all = PyDict_New();
    int v, lo, hi, dflt;
    const char *n;
    for (int i = 0; all && (n = fo_tune_knob(i, &v, &lo, &hi, &dflt)); ++i) {
      PyObject *t = Py_BuildValue("(iiii)", v, lo, hi, dflt);
      if (!t || PyDict_SetItemString(all, n, t) < 0) Py_CLEAR(all);
      Py_XDECREF(t);
    }
    return all;
  }
  const long v = value == Py_None ? 0 : PyLong_AsLong(value);
  if (v == -1 && PyErr_Occurred()) return NULL;
  int old = 0;
  const int rc = fo_tune_set(name, (int)v, value == Py_None, &old);
  if (rc == -1) return PyErr_Format(PyExc_KeyError, "fusedops._C._tune: no knob named %s", name);
  if (rc == -2 || v != (int)v)
    return PyErr_Format(PyExc_ValueError, "fusedops._C._tune: %s=%ld is outside its range", name, v);
  return PyLong_FromLong(old);
}

/* _norm_plan: the CUDA plan of a norm call, made on the CPU for a device
 * described by its facts, with occupancy answered by Python callables. */
typedef struct occupancy {
  PyObject *blocks, *clusters; /* callables (plan dict, threads, smem) -> int */
  int failed;
} occupancy;

static PyObject *plan_dict(const fo_norm_plan *pl) {
  static const char *kinds[] = {"none", "narrow", "group", "shift", "park", "pipe", "regs", "loop"};
  return Py_BuildValue("{s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:L,s:n,s:L,s:L,s:L}", "kernel",
                       kinds[pl->kernel >= 0 && pl->kernel <= 7 ? pl->kernel : 0], "vec", pl->vec, "nv", pl->nv,
                       "team", pl->team, "rpb", pl->rpb, "cl", pl->cl, "stages", pl->stages,
                       "small_l1", pl->small_l1, "grid", (long long)pl->grid, "smem", (Py_ssize_t)pl->smem, "parts",
                       (long long)pl->parts, "col_blocks", (long long)pl->col_blocks, "rows_per_part",
                       (long long)pl->rows_per_part);
}

static int ask(PyObject *fn, occupancy *o, const fo_norm_plan *pl, int threads, size_t smem) {
  if (o->failed) return 1;
  PyObject *d = plan_dict(pl);
  PyObject *r = d ? PyObject_CallFunction(fn, "Oin", d, threads, (Py_ssize_t)smem) : NULL;
  const long n = r ? PyLong_AsLong(r) : -1;
  Py_XDECREF(d);
  Py_XDECREF(r);
  if (PyErr_Occurred()) o->failed = 1;
  return n < 1 ? 1 : (int)n;
}
static int ask_blocks(void *ctx, const fo_norm_plan *pl, int threads, size_t smem) {
  return ask(((occupancy *)ctx)->blocks, ctx, pl, threads, smem);
}
static int ask_clusters(void *ctx, const fo_norm_plan *pl, int threads, size_t smem) {
  return ask(((occupancy *)ctx)->clusters, ctx, pl, threads, smem);
}

static int flag(PyObject *opts, const char *key, long dflt) {
  PyObject *v = PyDict_GetItemString(opts, key); /* borrowed */
  return (int)(v ? PyLong_AsLong(v) : dflt);
}

/* _norm_plan(direction "fwd" | "bwd", rows, cols, x_dtype, s_dtype, w_dtype
 * (0 fp32, 1 fp16, 2 bf16), options dict, (sm_count, smem_optin,
 * gbps_per_sm, cc), blocks_per_sm, clusters) -> plan dict. Options (0 / 1
 * unless said): rms; forward: residual, weight, bias, stats; backward: ds,
 * weight, dweight, dbias; offset (x's or dy's first element, in elements,
 * past a 256-byte boundary) and stride (their row stride; default cols).
 * Arrays sit at made-up 256-byte-aligned addresses: none is read. */
static PyObject *norm_plan(PyObject *self, PyObject *args) {
  (void)self;
  const char *dir;
  long long rows, cols;
  int xt, st, wt;
  PyObject *opts;
  fo_norm_device d = {0};
  occupancy o = {NULL, NULL, 0};
  if (!PyArg_ParseTuple(args, "sLLiiiO!(iiii)OO", &dir, &rows, &cols, &xt, &st, &wt, &PyDict_Type, &opts,
                        &d.sm_count, &d.smem_optin, &d.gbps_per_sm, &d.cc, &o.blocks, &o.clusters))
    return NULL;
  d.blocks_per_sm = ask_blocks;
  d.clusters = ask_clusters;
  d.ctx = &o;
  const int rms = flag(opts, "rms", 0), weight = flag(opts, "weight", 1);
  const long long offset = flag(opts, "offset", 0), stride = flag(opts, "stride", (long)cols);
  if (PyErr_Occurred()) return NULL;
  char *base = (char *)(uintptr_t)0x10000000; /* array i at base + i * 2^28 */
#define AT(i) ((void *)(base + ((uintptr_t)(i) << 28)))
  const void *first = (const char *)AT(1) + offset * fo_dtype_size((fo_dtype)xt);
  fo_norm_plan pl;
  if (dir[0] == 'f') {
    const int residual = flag(opts, "residual", 1), stats = flag(opts, "stats", 1);
    fo_norm_fwd_params p = {0};
    p.rows = rows;
    p.cols = cols;
    p.x = first;
    p.x_stride = stride;
    p.residual = residual ? AT(2) : NULL;
    p.res_stride = cols;
    p.weight = weight ? AT(3) : NULL;
    p.bias = flag(opts, "bias", !rms) ? AT(4) : NULL;
    p.y = AT(5);
    p.s = residual || st != xt ? AT(6) : NULL;
    p.mean = stats && !rms ? AT(7) : NULL;
    p.rstd = stats ? AT(8) : NULL;
    p.rms = rms;
    p.x_dtype = (fo_dtype)xt;
    p.s_dtype = (fo_dtype)st;
    p.w_dtype = (fo_dtype)wt;
    if (PyErr_Occurred()) return NULL;
    pl = fo_norm_fwd_plan(&p, &d);
  } else {
    fo_norm_bwd_params p = {0};
    p.rows = rows;
    p.cols = cols;
    p.dy = first;
    p.dy_stride = stride;
    p.ds = flag(opts, "ds", 1) ? AT(2) : NULL;
    p.ds_stride = cols;
    p.s = AT(6);
    p.s_stride = cols;
    p.weight = weight ? AT(3) : NULL;
    p.mean = rms ? NULL : AT(7);
    p.rstd = AT(8);
    p.dx = AT(9);
    p.dweight = flag(opts, "dweight", weight) ? AT(10) : NULL;
    p.dbias = flag(opts, "dbias", !rms) ? AT(11) : NULL;
    p.rms = rms;
    p.x_dtype = (fo_dtype)xt;
    p.s_dtype = (fo_dtype)st;
    p.w_dtype = (fo_dtype)wt;
    if (PyErr_Occurred()) return NULL;
    pl = fo_norm_bwd_plan(&p, &d);
  }
#undef AT
  if (o.failed) return NULL;
  return plan_dict(&pl);
}

static int exec_module(PyObject *m) {
#ifdef FUSEDOPS_WITH_CUDA
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  if (PyModule_AddIntConstant(m, "with_cuda", with_cuda) < 0) return -1;
  if (PyModule_AddStringConstant(m, "cuda_archs", FUSEDOPS_CUDA_ARCHS) < 0) return -1;
  if (PyModule_AddStringConstant(m, "torch_target", FUSEDOPS_TORCH_TARGET) < 0) return -1;
  if (PyModule_AddStringConstant(m, "built_with_torch", FUSEDOPS_BUILT_WITH_TORCH) < 0) return -1;
  return 0;
}

static PyMethodDef methods[] = {
    {"_tune", tune, METH_VARARGS, "private: a GPU plan's tuning knob (common/tune.h), for tests and probes"},
    {"_norm_plan", norm_plan, METH_VARARGS, "private: the norm's CUDA launch plan, made on the CPU, for tests"},
    {NULL, NULL, 0, NULL}};

static PyModuleDef_Slot slots[] = {{Py_mod_exec, (void *)exec_module}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "fusedops._C",
    "fusedops compiled kernels; the ops live in torch.ops.fusedops", 0, methods, slots,
    NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
