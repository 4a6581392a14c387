/*
 * CPython extension around the SIMT emulator: one translation unit holds the kernels of
 * UZSIM_SOURCE (the .cu file, its kernels registered with UZSIM_EXPORT) and this glue.
 * tests/simt/build.py compiles it with -include simt_host.h -DUZSIM_SOURCE="..." and
 * -DUZSIM_MODULE=<module name>.
 *
 *   launch(name, grid, block, smem, args)   grid / block: int or tuple of 1-3 ints; args: ints
 *   kernels() -> list of registered names
 *   configure(concurrent_blocks=3, stack_bytes=131072, reverse_blocks=False)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include UZSIM_SOURCE

#ifndef UZSIM_MODULE
#error "compile with -DUZSIM_MODULE=<module name> (tests/simt/build.py does)"
#endif
#define UZSIM_STR2(x) #x
#define UZSIM_STR(x) UZSIM_STR2(x)
#define UZSIM_CAT2(a, b) a##b
#define UZSIM_CAT(a, b) UZSIM_CAT2(a, b)

namespace {

bool parse_dim(PyObject* o, const char* what, dim3& out) {
    const bool tuple = PyTuple_Check(o);
    const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(o) : 1;
    if (n < 1 || n > 3) {
        PyErr_Format(PyExc_ValueError, "%s must be an int or a tuple of 1 to 3 ints", what);
        return false;
    }
    unsigned v[3] = {1, 1, 1};
    for (Py_ssize_t i = 0; i < n; ++i) {
        const long long x = PyLong_AsLongLong(tuple ? PyTuple_GET_ITEM(o, i) : o);
        if (x == -1 && PyErr_Occurred()) return false;
        if (x < 1 || x > 0xffffffffLL) {
            PyErr_Format(PyExc_ValueError, "%s dimensions must be in [1, 2**32), got %lld", what, x);
            return false;
        }
        v[i] = static_cast<unsigned>(x);
    }
    out = dim3(v[0], v[1], v[2]);
    return true;
}

// Any int in [-2**63, 2**64) (OverflowError past that); the kernel's invoker checks the type.
bool to_int128(PyObject* o, __int128& v) {
    PyObject* idx = PyNumber_Index(o);
    if (!idx) return false;
    int overflow = 0;
    const long long s = PyLong_AsLongLongAndOverflow(idx, &overflow);
    if (overflow == 0)
        v = s;
    else if (overflow > 0)
        v = PyLong_AsUnsignedLongLong(idx);
    else
        PyErr_SetString(PyExc_OverflowError, "below -2**63");
    Py_DECREF(idx);
    return !PyErr_Occurred();
}

std::string signature(const std::string& name, const uzsim::Kernel& k) {
    std::string s = name + "(";
    for (size_t i = 0; i < k.params.size(); ++i) s += (i ? ", " : "") + k.params[i];
    return s + ")";
}

void arg_does_not_fit(const char* name, const uzsim::Kernel& k, Py_ssize_t i, PyObject* item) {
    PyErr_Format(PyExc_ValueError, "%s: argument %zd = %R does not fit its type %s", signature(name, k).c_str(), i,
                 item, k.params[static_cast<size_t>(i)].c_str());
}

PyObject* py_launch(PyObject*, PyObject* args, PyObject* kwargs) {
    static const char* kwlist[] = {"name", "grid", "block", "smem", "args", nullptr};
    const char* name;
    PyObject *grid_o, *block_o, *args_o;
    Py_ssize_t smem;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOOnO", const_cast<char**>(kwlist), &name, &grid_o, &block_o,
                                     &smem, &args_o))
        return nullptr;
    const auto& reg = uzsim::registry();
    const auto it = reg.find(name);
    if (it == reg.end()) {
        std::string known;
        for (const auto& kv : reg) known += (known.empty() ? "" : ", ") + kv.first;
        PyErr_Format(PyExc_KeyError, "no kernel %s; registered: %s", name, known.c_str());
        return nullptr;
    }
    const uzsim::Kernel& kernel = it->second;
    dim3 grid, block;
    if (!parse_dim(grid_o, "grid", grid) || !parse_dim(block_o, "block", block)) return nullptr;
    if (smem < 0) return PyErr_Format(PyExc_ValueError, "smem must be >= 0, got %zd", smem);
    PyObject* seq = PySequence_Fast(args_o, "args must be a tuple of ints");
    if (!seq) return nullptr;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    std::vector<__int128> values(static_cast<size_t>(n));
    bool ok = static_cast<size_t>(n) == kernel.params.size();
    if (!ok)
        PyErr_Format(PyExc_TypeError, "%s takes %zu arguments, got %zd", signature(name, kernel).c_str(),
                     kernel.params.size(), n);
    for (Py_ssize_t i = 0; ok && i < n; ++i) {
        PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
        ok = to_int128(item, values[static_cast<size_t>(i)]);
        if (ok) continue;
        const bool type_error = PyErr_ExceptionMatches(PyExc_TypeError);
        PyErr_Clear();
        if (type_error)
            PyErr_Format(PyExc_TypeError, "%s: argument %zd must be an int, not %s", signature(name, kernel).c_str(),
                         i, Py_TYPE(item)->tp_name);
        else
            arg_does_not_fit(name, kernel, i, item);
    }
    if (!ok) {
        Py_DECREF(seq);
        return nullptr;
    }
    try {
        kernel.invoke(grid, block, static_cast<size_t>(smem), values.data());
    } catch (const uzsim::ArgError& e) {
        arg_does_not_fit(name, kernel, static_cast<Py_ssize_t>(e.index), PySequence_Fast_GET_ITEM(seq, e.index));
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
}

PyObject* py_kernels(PyObject*, PyObject*) {
    PyObject* list = PyList_New(0);
    for (const auto& kv : uzsim::registry()) {
        PyObject* s = PyUnicode_FromString(kv.first.c_str());
        if (!s || PyList_Append(list, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(list);
            return nullptr;
        }
        Py_DECREF(s);
    }
    return list;
}

PyObject* py_configure(PyObject*, PyObject* args, PyObject* kwargs) {
    static const char* kwlist[] = {"concurrent_blocks", "stack_bytes", "reverse_blocks", nullptr};
    Py_ssize_t blocks = 3, stack = 128 * 1024;
    int reverse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|nnp", const_cast<char**>(kwlist), &blocks, &stack, &reverse))
        return nullptr;
    if (blocks < 1 || blocks > 4096) return PyErr_Format(PyExc_ValueError, "concurrent_blocks must be in [1, 4096]");
    if (stack < 16 * 1024 || stack > (Py_ssize_t{1} << 30))
        return PyErr_Format(PyExc_ValueError, "stack_bytes must be in [16 KiB, 1 GiB]");
    uzsim::config().concurrent_blocks = static_cast<unsigned>(blocks);
    uzsim::config().stack_bytes = static_cast<size_t>(stack);
    uzsim::config().reverse_blocks = reverse != 0;
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_launch)), METH_VARARGS | METH_KEYWORDS,
     "launch(name, grid, block, smem, args): run a registered kernel on the SIMT emulator"},
    {"kernels", py_kernels, METH_NOARGS, "kernels() -> sorted names of the registered kernels"},
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_configure)),
     METH_VARARGS | METH_KEYWORDS, "configure(concurrent_blocks=3, stack_bytes=131072, reverse_blocks=False)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, UZSIM_STR(UZSIM_MODULE),
                          "CUDA kernels of " UZSIM_SOURCE " on the SIMT emulator", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC UZSIM_CAT(PyInit_, UZSIM_MODULE)(void) { return PyModule_Create(&module_def); }
