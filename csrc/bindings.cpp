// The Python module of the extension (specdec_ext._C, or specdec_ext._sim with SPECDEC_SIM). Importing it
// runs the TORCH_LIBRARY registrations; build_info() says what was compiled in.
#include <Python.h>

#include "checks/chain_sampling.h"
#include "checks/skinny_linear.h"
#include "checks/tree_sampling.h"
#include "checks/truncate_kv_cache.h"
#include "checks/verify_attention.h"
#include "specdec/library.h"
#if defined(SPECDEC_SIM)
#include "sim/sim.h"
#endif
#if defined(SPECDEC_WITH_CUDA) && !defined(SPECDEC_SIM)
#include <cuda_runtime_api.h>
#endif

#ifndef SPECDEC_VERSION
#define SPECDEC_VERSION "0+unknown"
#endif
#ifndef SPECDEC_CUDA_ARCHS
#define SPECDEC_CUDA_ARCHS ""
#endif

namespace {

PyObject* build_info(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  auto set = [d](const char* key, PyObject* value) {
    PyDict_SetItemString(d, key, value);
    Py_DECREF(value);
  };
  set("version", PyUnicode_FromString(SPECDEC_VERSION));
  set("namespace", PyUnicode_FromString(SPECDEC_LIB_NAME));
#if defined(SPECDEC_WITH_CUDA) && !defined(SPECDEC_SIM)
  set("cuda", Py_NewRef(Py_True));
  set("cuda_archs", PyUnicode_FromString(SPECDEC_CUDA_ARCHS));
  set("cuda_runtime_compiled", PyLong_FromLong(CUDART_VERSION));
#else
  set("cuda", Py_NewRef(Py_False));
  set("cuda_archs", PyUnicode_FromString(""));
#endif
  set("compiler", PyUnicode_FromString(__VERSION__));
  PyObject* features = PyList_New(0);
  [[maybe_unused]] auto feature = [features](const char* name) {
    PyObject* s = PyUnicode_FromString(name);
    PyList_Append(features, s);
    Py_DECREF(s);
  };
#if defined(__AVX512F__)
  feature("avx512f");
#endif
#if defined(__AVX2__)
  feature("avx2");
#endif
#if defined(__FMA__)
  feature("fma");
#endif
#if defined(__ARM_NEON)
  feature("neon");
#endif
  set("cpu_features_compiled", features);
  // Without OpenMP, at::parallel_for in the CPU kernels runs on one thread.
#if defined(_OPENMP)
  set("openmp", Py_NewRef(Py_True));
#else
  set("openmp", Py_NewRef(Py_False));
#endif
#if defined(__SANITIZE_ADDRESS__)
  set("address_sanitizer", Py_NewRef(Py_True));
#else
  set("address_sanitizer", Py_NewRef(Py_False));
#endif
  return d;
}

// {bit: message} of an op's device-side error word (the message may hold "{target}" and "{draft}").
template <size_t N>
PyObject* error_bit_dict(const specdec::ErrorBit (&table)[N]) {
  PyObject* d = PyDict_New();
  for (const specdec::ErrorBit& e : table) {
    PyObject* key = PyLong_FromLong(e.bit);
    PyObject* value = PyUnicode_FromString(e.message);
    PyDict_SetItem(d, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
  }
  return d;
}

// The constants the Python layer checks against and reports with, defined once in C++: the ops' limits and
// the meaning of each error bit.
PyObject* constants(PyObject*, PyObject*) {
  PyObject* limits = Py_BuildValue("{s:i,s:i,s:i,s:L,s:i,s:i,s:i,s:i,s:d}", "max_skinny_rows", specdec::kMaxSkinnyRows,
                                   "max_draft_tokens", specdec::kMaxDraftTokens,
                                   "max_verify_queries", specdec::kMaxVerifyQueries, "max_head_dim",
                                   specdec::kMaxHeadDim, "max_vocab", static_cast<long long>(specdec::kMaxVocab),
                                   "max_block_len", specdec::kMaxBlockLen, "max_cache_layers", specdec::kMaxCacheLayers,
                                   "max_tree_nodes", specdec::kMaxTreeNodes, "min_temperature",
                                   static_cast<double>(specdec::kMinTemperature));  // exact: a float32 value
  PyObject* errors = PyDict_New();
  auto add = [errors](const char* op, PyObject* table) {
    PyDict_SetItemString(errors, op, table);
    Py_DECREF(table);
  };
  add("chain_speculative_sampling", error_bit_dict(specdec::kSamplingErrorBits));
  add("tree_speculative_sampling", error_bit_dict(specdec::kTreeSamplingErrorBits));
  add("truncate_kv_cache", error_bit_dict(specdec::kTruncateErrorBits));
  add("verify_attention", error_bit_dict(specdec::kAttentionErrorBits));
  // The sampling error bits the Python layer sets itself (strict mode, on a device).
  PyObject* sampling_bits = Py_BuildValue("{s:i}", "draft_to_target", static_cast<int>(specdec::kErrDraftToTarget));
  PyObject* d = Py_BuildValue("{s:N,s:N,s:N}", "limits", limits, "error_bits", errors, "sampling_bits", sampling_bits);
  return d;
}

#if !defined(SPECDEC_SIM)
}  // namespace
namespace specdec {
const char* cpu_isa_name();  // cpu/linear.cpp
}
namespace {
// The instruction set the CPU GEMM kernels use now (SPECDEC_CPU_ISA, or the best the CPU has).
PyObject* cpu_isa(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(specdec::cpu_isa_name());
  } catch (const c10::Error& e) {  // the message alone: the C++ backtrace says nothing to a user who set a variable
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}
#endif

// The sampling kernels' grid on a device of `multiprocessors` SMs at `batch` requests (sampling_slices,
// sampling_groups; every group assumed resident): (blocks per request, blocks), for the benchmarks' grid column.
PyObject* sampling_grid(PyObject*, PyObject* args) {
  long long batch = 0;
  int multiprocessors = 0;
  if (!PyArg_ParseTuple(args, "Li", &batch, &multiprocessors)) return nullptr;
  const auto any = [](int) { return 1 << 30; };
  const int slices = specdec::sampling_slices(batch, multiprocessors, any);
  const int64_t groups = specdec::sampling_groups(batch, slices, int64_t{1} << 30);
  return Py_BuildValue("(iL)", slices, static_cast<long long>(groups * slices));
}

// The CUDA verify_attention kernel's split size (keys) for a request with `length` cached tokens
// (attention_length_split_keys), for the benchmark's plan column and its test.
PyObject* attention_split_keys(PyObject*, PyObject* args) {
  long long length = 0;
  if (!PyArg_ParseTuple(args, "L", &length)) return nullptr;
  if (length < 0) {
    PyErr_SetString(PyExc_ValueError, "attention_split_keys: length must be >= 0");
    return nullptr;
  }
  return PyLong_FromLongLong(static_cast<long long>(specdec::attention_length_split_keys(length)));
}

#if defined(SPECDEC_SIM)
// The shape of the last kernel launch on the calling thread, for tests of the launchers' choices.
PyObject* last_launch(PyObject*, PyObject*) {
  const specdec::sim::LaunchStats s = specdec::sim::last_launch_stats();
  return Py_BuildValue("{s:K,s:I,s:I,s:O}", "blocks", static_cast<unsigned long long>(s.blocks), "threads_per_block",
                       s.threads_per_block, "cluster_blocks", s.cluster_blocks, "cooperative",
                       s.cooperative ? Py_True : Py_False);
}
#endif

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS, "What this build of the extension contains."},
    {"constants", constants, METH_NOARGS, "The ops' limits and the meaning of their error bits."},
    {"sampling_grid", sampling_grid, METH_VARARGS, "The sampling kernels' (blocks per request, blocks) at a batch."},
    {"attention_split_keys", attention_split_keys, METH_VARARGS, "verify_attention's CUDA split size at a length."},
#if defined(SPECDEC_SIM)
    {"last_launch", last_launch, METH_NOARGS, "The shape of the last kernel launch on this thread."},
#else
    {"cpu_isa", cpu_isa, METH_NOARGS, "The instruction set the CPU GEMM kernels use now."},
#endif
    {nullptr, nullptr, 0, nullptr},
};

#if defined(SPECDEC_SIM)
PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_sim", "specdec emulated CUDA kernels", -1, methods};
#else
PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "specdec kernels", -1, methods};
#endif

}  // namespace

#if defined(SPECDEC_SIM)
PyMODINIT_FUNC PyInit__sim() { return PyModule_Create(&module_def); }
#else
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module_def); }
#endif
