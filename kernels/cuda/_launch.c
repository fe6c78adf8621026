/* One kernel launch from Python in one C call: the arguments converted by their type codes and
 * cuLaunchKernelEx called through the pointer `bind` looked up in libcuda (kernels/cuda/driver.py,
 * NativeLaunch, uses this when it was built; its ctypes path is the twin and the fallback).
 *
 *   bind(library_path) -> entry                   dlopen + dlsym("cuLaunchKernelEx") (its address); OSError
 *   launch(entry, function, gx, gy, gz, block, smem, stream, pdl, types, args) -> CUresult as an int
 *       function, stream: handles as integers; types: one code per argument ("p" pointer, "i" int32,
 *       "f" float32); args: a tuple of as many values. A wrong count is a ValueError, a value that
 *       does not convert a TypeError or OverflowError, and nothing is launched.
 *
 * cuLaunchKernelEx takes an array of pointers to the arguments (kernelParams) and copies them during
 * the call, so each argument sits in its own 8-byte slot on this function's stack and no layout is
 * assumed. The two structs below are cuda.h's CUlaunchConfig and CUlaunchAttribute on x86-64, which
 * tests/test_cuda_launch.py checks against the header through a stub libcuda compiled with it.
 * No CUDA header or library is needed to build this file. The GIL stays held: the call queues work
 * and returns in microseconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 64
#define ATTR_PROGRAMMATIC_STREAM_SERIALIZATION 6

typedef struct {
    int id;
    char pad[4];
    union { int programmatic_stream_serialization_allowed; char bytes[64]; } value;
} launch_attribute;                 /* CUlaunchAttribute: 72 bytes */

typedef struct {
    unsigned grid[3], block[3], smem;
    void *stream;
    launch_attribute *attrs;
    unsigned num_attrs;
} launch_config;                    /* CUlaunchConfig: 56 bytes */

typedef int (*launch_fn)(const launch_config *, void *, void **, void **);

static PyObject *py_bind(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "dlopen(%s): %s", path, dlerror());
    void *fn = dlsym(lib, "cuLaunchKernelEx");
    if (fn == NULL) return PyErr_Format(PyExc_OSError, "%s has no cuLaunchKernelEx (a driver older than CUDA 11.8)", path);
    return PyLong_FromVoidPtr(fn);
}

static PyObject *py_launch(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 11) return PyErr_Format(PyExc_TypeError, "launch() takes 11 arguments, got %zd", argc);
    launch_fn cu_launch = (launch_fn)PyLong_AsVoidPtr(argv[0]);
    if (cu_launch == NULL) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "launch(): no entry");
    argv++;                                             /* the rest as documented, from the function on */
    launch_config config;
    memset(&config, 0, sizeof config);
    void *function = PyLong_AsVoidPtr(argv[0]);
    if (function == NULL && PyErr_Occurred()) return NULL;
    unsigned dims[5];                                   /* grid x, y, z, block, smem */
    for (int i = 0; i < 5; ++i) {
        unsigned long d = PyLong_AsUnsignedLong(argv[1 + i]);
        if (d == (unsigned long)-1 && PyErr_Occurred()) return NULL;
        if (d > UINT32_MAX) return PyErr_Format(PyExc_OverflowError, "launch dimension %d: %lu", i, d);
        dims[i] = (unsigned)d;
    }
    memcpy(config.grid, dims, sizeof config.grid);
    config.block[0] = dims[3];
    config.block[1] = config.block[2] = 1;
    config.smem = dims[4];
    config.stream = PyLong_AsVoidPtr(argv[6]);
    if (config.stream == NULL && PyErr_Occurred()) return NULL;
    int pdl = PyObject_IsTrue(argv[7]);
    if (pdl < 0) return NULL;
    Py_ssize_t num_types;
    const char *types = PyUnicode_AsUTF8AndSize(argv[8], &num_types);
    if (types == NULL) return NULL;
    if (!PyTuple_Check(argv[9])) return PyErr_Format(PyExc_TypeError, "launch(): args must be a tuple");
    Py_ssize_t n = PyTuple_GET_SIZE(argv[9]);
    if (n != num_types || n > MAX_ARGS)
        return PyErr_Format(PyExc_ValueError, "kernel arguments: %zd values for the %zd of signature '%s'", n,
                            num_types, types);
    uint64_t slots[MAX_ARGS];
    void *params[MAX_ARGS];
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *v = PyTuple_GET_ITEM(argv[9], i);
        slots[i] = 0;
        params[i] = &slots[i];
        switch (types[i]) {
        case 'p': {
            unsigned long long p = PyLong_AsUnsignedLongLong(v);
            if (p == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
            slots[i] = p;
            break;
        }
        case 'i': {
            long x = PyLong_AsLong(v);
            if (x == -1 && PyErr_Occurred()) return NULL;
            if (x < INT32_MIN || x > INT32_MAX)
                return PyErr_Format(PyExc_OverflowError, "kernel argument %zd: %ld does not fit an int32", i, x);
            int32_t x32 = (int32_t)x;
            memcpy(&slots[i], &x32, sizeof x32);
            break;
        }
        case 'f': {
            double x = PyFloat_AsDouble(v);
            if (x == -1.0 && PyErr_Occurred()) return NULL;
            float f = (float)x;
            memcpy(&slots[i], &f, sizeof f);
            break;
        }
        default:
            return PyErr_Format(PyExc_ValueError, "kernel argument %zd: unknown type code '%c'", i, types[i]);
        }
    }
    launch_attribute attr;
    memset(&attr, 0, sizeof attr);
    if (pdl) {
        attr.id = ATTR_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmatic_stream_serialization_allowed = 1;
        config.attrs = &attr;
        config.num_attrs = 1;
    }
    return PyLong_FromLong(cu_launch(&config, function, params, NULL));
}

static PyMethodDef methods[] = {
    {"bind", py_bind, METH_VARARGS, "bind(library_path) -> the address of its cuLaunchKernelEx"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL,
     "launch(entry, function, gx, gy, gz, block, smem, stream, pdl, types, args) -> CUresult"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_launch", "cuLaunchKernelEx in one C call", -1, methods};

PyMODINIT_FUNC PyInit__launch(void) { return PyModule_Create(&module); }
