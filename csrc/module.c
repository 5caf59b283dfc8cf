/* fusedops._C: the importable extension module. Importing it loads the shared
 * library, whose static initialisers register torch.ops.fusedops.*. Plain
 * CPython limited API; the attributes say what this binary was built with. */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#ifndef FUSEDOPS_CUDA_ARCHS
#define FUSEDOPS_CUDA_ARCHS ""
#endif
#ifndef FUSEDOPS_TORCH_TARGET
#define FUSEDOPS_TORCH_TARGET ""
#endif
#ifndef FUSEDOPS_BUILT_WITH_TORCH
#define FUSEDOPS_BUILT_WITH_TORCH ""
#endif

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

static PyModuleDef_Slot slots[] = {{Py_mod_exec, (void *)exec_module}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "fusedops._C",
    "fusedops compiled kernels; the ops live in torch.ops.fusedops", 0, NULL, slots,
    NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
