// The module's way into fastaxial::axial_attention from Python: a builtin function (METH_FASTCALL)
// that takes the module's call, x, the ten weights, num_heads, eps and dropout, as positional
// arguments, and calls the operator through its typed dispatcher handle. It makes the same call as
// torch.ops.fastaxial.axial_attention.default, without the boxed path's per-call work: no
// conversion of each argument to an IValue against the schema, no argument vector, no Python
// args tuple and kwargs dict built by pybind11. Measured in docs/perf-notes.md.
//
// Only the module's plain calls take this path. Every call whose result could differ from
// torch.ops' goes to the boxed operator instead (the fallback, given when the function is made: its
// __self__), with its arguments as given, so that it does what it always does (errors included):
//  - a tensor argument that is not exactly a torch.Tensor or nn.Parameter (a subclass may
//    override __torch_function__ or __torch_dispatch__), or a named tensor (the boxed path refuses
//    them), or a torch function mode active: the boxed path hands those to __torch_function__;
//  - any argument count other than 14, keyword arguments (rng_state included), num_heads other than
//    an int (bool, SymInt, ...), eps or dropout other than a float or an int, an int out of range.
// Everything below the Python binding (autograd through the C++ autograd kernel, inference mode,
// FakeTensorMode and other dispatch modes, the profiler, torch.jit tracing) sits in the dispatcher,
// which this call goes through like the boxed one. Like torch.ops, it releases the GIL while the
// operator runs.
//
// This file is a shared library of its own, _python_entry.so beside _C.so (torch_binding/
// CMakeLists.txt), built only where CMake finds Python's headers. It holds neither the core nor any
// operator registration: it finds the operator in the dispatcher, where _C.so (loaded first, by
// python/fastaxial/ops.py) registered it. So _C.so needs no Python and loads in a process without
// one (a C++ program running a traced model); only this library links Python and libtorch_python.
// It is compiled for one Python ABI (fastaxial_python_abi(), also in the build record
// _build_info.PYTHON_ENTRY), and ops.py opens it only under that one. A GIL build of it takes only
// Python functions every Python 3 from 3.10 on has (tests/python/test_python_entry.py lists them), so
// it also opens, and then declines, under another one.
#include <torch/csrc/python_headers.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>

#include "op_handles.h"

namespace fastaxial::torch_binding {
namespace {

constexpr Py_ssize_t kArgs = 14;    // x, the ten weights, num_heads, eps, dropout
constexpr Py_ssize_t kTensors = 11;


// The GIL is released while the operator runs, as torch.ops does: its kernels take milliseconds on
// the CPU, and other Python threads (data loading) keep running meanwhile.
struct ReleaseGil {
  PyThreadState* state = PyEval_SaveThread();
  ~ReleaseGil() { PyEval_RestoreThread(state); }
  ReleaseGil() = default;
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;
};

// A float argument as the boxed path reads it (a float, or an int converted); false where this
// path leaves the argument to the boxed one.
bool read_double(PyObject* o, double* out) {
  if (PyFloat_CheckExact(o)) {
    *out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (PyLong_CheckExact(o)) {
    *out = PyLong_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred()) {  // too large for a double: the boxed path says so
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

// The fallback's call with the arguments as given. PyObject_VectorcallDict, not PyObject_Vectorcall:
// a function of every Python 3 from 3.10 on, and the library must load under any of them.
PyObject* call_fallback(PyObject* fallback, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (kwnames == nullptr) return PyObject_VectorcallDict(fallback, args, nargs, nullptr);
  PyObject* kwargs = PyDict_New();
  if (kwargs == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i)
    if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
      Py_DECREF(kwargs);
      return nullptr;
    }
  PyObject* result = PyObject_VectorcallDict(fallback, args, nargs, kwargs);
  Py_DECREF(kwargs);
  return result;
}

// `fallback`: the function's __self__, the boxed operator.
PyObject* axial_attention(PyObject* fallback, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (nargs != kArgs || kwnames != nullptr || at::impl::torch_function_mode_enabled())
    return call_fallback(fallback, args, nargs, kwnames);
  for (Py_ssize_t i = 0; i < kTensors; ++i)
    if (!THPVariable_CheckExact(args[i]) || THPVariable_Unpack(args[i]).has_names())
      return call_fallback(fallback, args, nargs, kwnames);
  int overflow = 1;  // num_heads: an int that fits int64 (PyLong_AsLongLongAndOverflow clears it)
  long long heads = 0;
  if (PyLong_CheckExact(args[11])) heads = PyLong_AsLongLongAndOverflow(args[11], &overflow);
  double eps, dropout;
  if (overflow != 0 || !read_double(args[12], &eps) || !read_double(args[13], &dropout))
    return call_fallback(fallback, args, nargs, kwnames);

  // Strong references, taken with the GIL held. The first C++ copy of a tensor that has a Python
  // object increments that object's reference count, and the last one's release decrements it,
  // each taking the GIL: the kernels copy x and the ten weights (contiguous()), which without
  // these references would take the GIL back 22 times per call. (torch.ops' argument
  // stack holds such references too.) They die after the GIL is back.
  at::Tensor t[kTensors];
  for (Py_ssize_t i = 0; i < kTensors; ++i) t[i] = THPVariable_Unpack(args[i]);
  try {
    at::Tensor out;
    {
      const ReleaseGil no_gil;
      out = op().call(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], heads, eps,
                             dropout, std::nullopt, std::nullopt);
    }
    return THPVariable_Wrap(std::move(out));
  } catch (...) {
    // torch's translation of C++ errors (c10::ValueError to ValueError, ...), as on the boxed path,
    // which installs no warning handler either. Not HANDLE_TH_ERRORS: its pybind11 error types
    // would bring pybind11's internals, and the private Python symbols they use, into the library.
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

PyMethodDef axial_attention_def = {
    "axial_attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&axial_attention)),
    METH_FASTCALL | METH_KEYWORDS,
    "axial_attention(*args, **kwargs)\n--\n\n"
    "torch.ops.fastaxial.axial_attention.default's call. The module's (x, the ten weights, num_heads,\n"
    "eps, dropout; positional) goes through the typed dispatcher handle; every other call goes to the\n"
    "boxed operator, the function's __self__."};

}  // namespace
}  // namespace fastaxial::torch_binding

// The Python ABI this file was compiled for: "3.11", "3.13t" (free-threaded). The Python side
// takes the entry only under that ABI.
#define FASTAXIAL_STR2(x) #x
#define FASTAXIAL_STR(x) FASTAXIAL_STR2(x)
#ifdef Py_GIL_DISABLED
#define FASTAXIAL_PYTHON_ABI FASTAXIAL_STR(PY_MAJOR_VERSION) "." FASTAXIAL_STR(PY_MINOR_VERSION) "t"
#else
#define FASTAXIAL_PYTHON_ABI FASTAXIAL_STR(PY_MAJOR_VERSION) "." FASTAXIAL_STR(PY_MINOR_VERSION)
#endif

// The build record's PYTHON_ENTRY (torch_binding/CMakeLists.txt asks the interpreter) must name the
// ABI of the headers compiled here: ops.py decides from the record whether to open this library.
#ifdef FASTAXIAL_RECORDED_PYTHON_ABI
namespace fastaxial::torch_binding {
constexpr bool same_text(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || same_text(a + 1, b + 1));
}
static_assert(same_text(FASTAXIAL_PYTHON_ABI, FASTAXIAL_RECORDED_PYTHON_ABI),
              "the build record's PYTHON_ENTRY differs from the Python headers this file is compiled with");
}  // namespace fastaxial::torch_binding
#endif

extern "C" __attribute__((visibility("default"))) const char* fastaxial_python_abi() {
  return FASTAXIAL_PYTHON_ABI;
}

// A new reference to an entry function whose fallback, for the calls it leaves to the boxed path,
// is `fallback` (torch.ops.fastaxial.axial_attention.default._op; tests pass a recorder); NULL with a
// Python error set where the operator is missing from the dispatcher (_C.so not loaded) or its schema
// has another signature. Called through ctypes.PyDLL, with the GIL held.
extern "C" __attribute__((visibility("default"))) PyObject* fastaxial_python_entry(PyObject* fallback) {
  using namespace fastaxial::torch_binding;
  try {
    op();
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
  return PyCFunction_NewEx(&axial_attention_def, fallback, nullptr);  // holds a reference to fallback
}
