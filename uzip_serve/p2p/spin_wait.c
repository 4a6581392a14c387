/* spin_wait(flag, timeout_s) -> bool: waits until flag[0] != 0 or timeout_s has passed,
 * without the GIL and without sleeping.
 *
 * Why (docs/gpu_p2p.md): a caller waiting for a same-host GPU transfer that runs on the
 * UCX loop's thread would otherwise sleep, and in a VM the wake-up of a thread whose vCPU
 * has halted costs ~0.1-0.2 ms, a quarter of a 256 MiB transfer. Spinning in Python instead
 * (yielding to an event loop) hands the GIL back and forth with the UCX loop's thread and was
 * measured slower still. Here the GIL is released for the whole wait, so the UCX loop runs
 * undisturbed, and the flag is written by that loop (a Future's done-callback).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() do { } while (0)
#endif

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static PyObject *py_spin_wait(PyObject *self, PyObject *args) {
    Py_buffer b;
    double timeout;
    if (!PyArg_ParseTuple(args, "w*d", &b, &timeout))
        return NULL;
    if (b.len < 1) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "spin_wait: the flag buffer is empty");
        return NULL;
    }
    const unsigned char *flag = (const unsigned char *)b.buf;
    int set = 0;
    Py_BEGIN_ALLOW_THREADS
    double end = now_s() + timeout;
    for (unsigned i = 0;; i++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
            set = 1;
            break;
        }
        if ((i & 255) == 0 && now_s() > end)
            break;
        CPU_RELAX();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyBool_FromLong(set);
}

static PyMethodDef methods[] = {
    {"spin_wait", py_spin_wait, METH_VARARGS,
     "spin_wait(flag, timeout_s) -> bool: True once flag[0] != 0, False after timeout_s (GIL released)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_spin", NULL, -1, methods};

PyMODINIT_FUNC PyInit__spin(void) { return PyModule_Create(&module); }
