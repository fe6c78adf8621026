/* The Python face of the kernels: `tokenwire.kernels.cpu._cpu`.
 *
 * Arrays come in through the buffer protocol (no numpy headers needed to build), are checked
 * here (dtype, shape, contiguity) with errors that name the argument, and every call that
 * does real work drops the GIL for its whole duration, so the event loop keeps running while
 * the engine thread computes. kernels/cpu/__init__.py is the documented API over this. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "py_common.h"
#include "tw.h"

/* ------------------------------------------------------------------ buffers */

static char buffer_kind(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[1] == '\0' ? f[0] : '?';
}

int tw_py_buffer(PyObject *obj, Py_buffer *view, const char *name, char kind, int ndim, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s array", name, writable ? " writable" : "");
        return -1;
    }
    if (buffer_kind(view) != kind || (ndim && view->ndim != ndim)) {
        const char *names = kind == 'f' ? "float32" : kind == 'e' ? "float16" : kind == 'B' ? "uint8" : kind == 'i' ? "int32" : kind == 'd' ? "float64" : "int8";
        PyErr_Format(PyExc_ValueError, "%s must be a %d-D %s array, got format '%s' with %d dimensions",
                     name, ndim, names, view->format ? view->format : "B", view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ Int4Matrix */

typedef struct {
    PyObject_HEAD
    tw_int4 w;
} Int4Matrix;

static void Int4Matrix_dealloc(Int4Matrix *self) {
    tw_int4_free(&self->w);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Int4Matrix_get(Int4Matrix *self, void *which) {
    const tw_int4 *w = &self->w;
    switch ((int)(intptr_t)which) {
    case 0: return PyLong_FromLong(w->n);
    case 1: return PyLong_FromLong(w->k);
    case 2: return PyLong_FromLong(w->group_size);
    default: return PyLong_FromSize_t((size_t)w->num_tiles * w->num_groups * w->block_bytes);
    }
}

static PyGetSetDef Int4Matrix_getset[] = {
    {"out_features", (getter)Int4Matrix_get, NULL, "N", (void *)0},
    {"in_features", (getter)Int4Matrix_get, NULL, "K", (void *)1},
    {"group_size", (getter)Int4Matrix_get, NULL, "G", (void *)2},
    {"nbytes", (getter)Int4Matrix_get, NULL, "bytes one product reads", (void *)3},
    {NULL},
};

PyTypeObject Int4Matrix_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokenwire.kernels.cpu._cpu.Int4Matrix",
    .tp_basicsize = sizeof(Int4Matrix),
    .tp_dealloc = (destructor)Int4Matrix_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An INT4 weight repacked into the kernels' tiled layout (made by pack_int4).",
    .tp_getset = Int4Matrix_getset,
};

const tw_int4 *tw_py_int4(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &Int4Matrix_Type)) {
        PyErr_SetString(PyExc_TypeError, "expected an Int4Matrix from pack_int4");
        return NULL;
    }
    return &((Int4Matrix *)obj)->w;
}

/* pack_int4(qweight u8 [N, Kp/2], scales f16 [N, Kp/G], zeros f16 [N, Kp/G], in_features) */
static PyObject *py_pack_int4(PyObject *mod, PyObject *args) {
    PyObject *oq, *os, *oz;
    int k;
    if (!PyArg_ParseTuple(args, "OOOi", &oq, &os, &oz, &k)) return NULL;
    Py_buffer q, s, z;
    if (tw_py_buffer(oq, &q, "qweight", 'B', 2, 0)) return NULL;
    if (tw_py_buffer(os, &s, "scales", 'e', 2, 0)) { PyBuffer_Release(&q); return NULL; }
    if (tw_py_buffer(oz, &z, "zeros", 'e', 2, 0)) { PyBuffer_Release(&q); PyBuffer_Release(&s); return NULL; }
    PyObject *result = NULL;
    Py_ssize_t n = q.shape[0], kp = 2 * q.shape[1], ng = s.shape[1];
    if (s.shape[0] != n || z.shape[0] != n || z.shape[1] != ng || ng == 0 || kp % ng || (kp / ng) % 8) {
        PyErr_Format(PyExc_ValueError, "INT4 parts disagree: qweight [%zd, %zd], scales [%zd, %zd], zeros [%zd, %zd]",
                     q.shape[0], q.shape[1], s.shape[0], s.shape[1], z.shape[0], z.shape[1]);
    } else if (k < 1 || k > kp || kp - k >= kp / ng) {
        PyErr_Format(PyExc_ValueError, "in_features %d does not fit padded K %zd with group size %zd", k, kp, kp / ng);
    } else {
        Int4Matrix *m = PyObject_New(Int4Matrix, &Int4Matrix_Type);
        if (m) {
            int rc;
            Py_BEGIN_ALLOW_THREADS
            rc = tw_int4_pack(&m->w, q.buf, s.buf, z.buf, (int)n, k, (int)kp, (int)(kp / ng));
            Py_END_ALLOW_THREADS
            if (rc != 0) {
                m->w.data = NULL;
                Py_DECREF(m);
                PyErr_NoMemory();
            } else {
                result = (PyObject *)m;
            }
        }
    }
    PyBuffer_Release(&q);
    PyBuffer_Release(&s);
    PyBuffer_Release(&z);
    return result;
}

/* ------------------------------------------------------------------ products */

static int parse_precision(const char *p) {
    if (strcmp(p, "fp32") == 0) return TW_PREC_F32;
    if (strcmp(p, "int8") == 0) return TW_PREC_Q8;
    PyErr_Format(PyExc_ValueError, "activation precision must be 'fp32' or 'int8', got '%s'", p);
    return -1;
}

/* int4_linear(x f32 [M, K], w Int4Matrix, out f32 [M, N], precision) */
static PyObject *py_int4_linear(PyObject *mod, PyObject *args) {
    PyObject *ox, *ow, *oy;
    const char *precision = "fp32";
    if (!PyArg_ParseTuple(args, "OOO|s", &ox, &ow, &oy, &precision)) return NULL;
    const tw_int4 *w = tw_py_int4(ow);
    int prec = parse_precision(precision);
    if (!w || prec < 0) return NULL;
    Py_buffer x, y;
    if (tw_py_buffer(ox, &x, "x", 'f', 2, 0)) return NULL;
    if (tw_py_buffer(oy, &y, "out", 'f', 2, 1)) { PyBuffer_Release(&x); return NULL; }
    int rc = 0;
    if (x.shape[1] != w->k || y.shape[0] != x.shape[0] || y.shape[1] != w->n) {
        PyErr_Format(PyExc_ValueError, "shapes do not match: x [%zd, %zd], weight [%d, %d], out [%zd, %zd]",
                     x.shape[0], x.shape[1], w->n, w->k, y.shape[0], y.shape[1]);
        rc = 1;
    } else if (x.shape[0] > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = tw_int4_linear(w, x.buf, (int)x.shape[0], y.buf, prec);
        Py_END_ALLOW_THREADS
        if (rc) PyErr_NoMemory();
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* rows_linear(x f32 [M, K], weight f32|f16|i8 [N, K], row_scales f16 [N] or None, out f32 [M, N],
 * precision 'fp32' | 'int8'): int8 activations apply to int8 weights with K % 32 == 0 */
static PyObject *py_rows_linear(PyObject *mod, PyObject *args) {
    PyObject *ox, *ow, *os, *oy;
    const char *precision = "fp32";
    if (!PyArg_ParseTuple(args, "OOOO|s", &ox, &ow, &os, &oy, &precision)) return NULL;
    const int prec = parse_precision(precision);
    if (prec < 0) return NULL;
    Py_buffer x, w, s = {0}, y;
    if (PyObject_GetBuffer(ow, &w, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "weight must be a C-contiguous array");
        return NULL;
    }
    char kc = buffer_kind(&w);
    int kind = kc == 'f' ? TW_W_F32 : kc == 'e' ? TW_W_F16 : kc == 'b' ? TW_W_I8 : -1;
    PyBuffer_Release(&w);
    if (kind < 0) {
        PyErr_SetString(PyExc_ValueError, "weight must be float32, float16 or int8");
        return NULL;
    }
    if (tw_py_buffer(ow, &w, "weight", kc, 2, 0)) return NULL;
    if (tw_py_buffer(ox, &x, "x", 'f', 2, 0)) { PyBuffer_Release(&w); return NULL; }
    if (tw_py_buffer(oy, &y, "out", 'f', 2, 1)) { PyBuffer_Release(&w); PyBuffer_Release(&x); return NULL; }
    int bad = 0;
    if (kind == TW_W_I8 && (os == Py_None || tw_py_buffer(os, &s, "row_scales", 'e', 1, 0))) {
        if (os == Py_None) PyErr_SetString(PyExc_ValueError, "int8 weights need row_scales");
        bad = 1;
    }
    if (!bad && (x.shape[1] != w.shape[1] || y.shape[0] != x.shape[0] || y.shape[1] != w.shape[0] ||
                 (kind == TW_W_I8 && s.shape[0] != w.shape[0]))) {
        PyErr_Format(PyExc_ValueError, "shapes do not match: x [%zd, %zd], weight [%zd, %zd], out [%zd, %zd]",
                     x.shape[0], x.shape[1], w.shape[0], w.shape[1], y.shape[0], y.shape[1]);
        bad = 1;
    }
    if (!bad) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = tw_rows_linear(w.buf, s.buf, kind, (int)w.shape[0], (int)w.shape[1], x.buf, (int)x.shape[0], y.buf, prec);
        Py_END_ALLOW_THREADS
        if (rc != 0) {
            PyErr_NoMemory();
            bad = 1;
        }
    }
    if (s.obj) PyBuffer_Release(&s);
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

/* gated(gate f32 [n], up f32 [n], out f32 [n], gelu: bool): out = act(gate) * up */
static PyObject *py_gated(PyObject *mod, PyObject *args) {
    PyObject *og, *ou, *oo;
    int gelu;
    if (!PyArg_ParseTuple(args, "OOOp", &og, &ou, &oo, &gelu)) return NULL;
    Py_buffer g, u, o;
    if (tw_py_buffer(og, &g, "gate", 'f', 1, 0)) return NULL;
    if (tw_py_buffer(ou, &u, "up", 'f', 1, 0)) return PyBuffer_Release(&g), NULL;
    if (tw_py_buffer(oo, &o, "out", 'f', 1, 1)) return PyBuffer_Release(&g), PyBuffer_Release(&u), NULL;
    int ok = g.shape[0] == u.shape[0] && g.shape[0] == o.shape[0];
    if (ok) tw_active()->gated(o.buf, g.buf, u.buf, (int)g.shape[0], gelu);
    else PyErr_SetString(PyExc_ValueError, "gate, up and out must have the same length");
    PyBuffer_Release(&g), PyBuffer_Release(&u), PyBuffer_Release(&o);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* exp_blocks(logits f32 [R, V], temperatures f64 [R] (> 0), e f64 [R, V], sums f64 [R, ceil(V / block)],
 * block): temperature sampling's exponentials and their block sums (tw_kernels.exp_blocks) */
static PyObject *py_exp_blocks(PyObject *mod, PyObject *args) {
    PyObject *ol, *ot, *oe, *os;
    int block;
    if (!PyArg_ParseTuple(args, "OOOOi", &ol, &ot, &oe, &os, &block)) return NULL;
    Py_buffer l, t, e, s;
    if (tw_py_buffer(ol, &l, "logits", 'f', 2, 0)) return NULL;
    if (tw_py_buffer(ot, &t, "temperatures", 'd', 1, 0)) return PyBuffer_Release(&l), NULL;
    if (tw_py_buffer(oe, &e, "e", 'd', 2, 1)) return PyBuffer_Release(&l), PyBuffer_Release(&t), NULL;
    if (tw_py_buffer(os, &s, "sums", 'd', 2, 1))
        return PyBuffer_Release(&l), PyBuffer_Release(&t), PyBuffer_Release(&e), NULL;
    const Py_ssize_t rows = l.shape[0], v = l.shape[1];
    const double *temps = t.buf;
    int ok = block > 0 && v > 0 && v < INT32_MAX && t.shape[0] == rows && e.shape[0] == rows && e.shape[1] == v &&
             s.shape[0] == rows && s.shape[1] == (v + block - 1) / block;
    for (Py_ssize_t r = 0; ok && r < rows; r++) ok = temps[r] > 0.0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < rows; r++)
            tw_active()->exp_blocks((const float *)l.buf + r * v, (int)v, temps[r], (double *)e.buf + r * v,
                                    (double *)s.buf + r * s.shape[1], block);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_SetString(PyExc_ValueError, "exp_blocks: logits [R, V], temperatures [R] > 0, e [R, V], "
                                          "sums [R, ceil(V / block)], block > 0");
    }
    PyBuffer_Release(&l), PyBuffer_Release(&t), PyBuffer_Release(&e), PyBuffer_Release(&s);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ machine */

static const char *ISA_NAMES[] = {"scalar", "avx2", "avx512"};

static int parse_isa(PyObject *name) {
    const char *s = PyUnicode_AsUTF8(name);
    if (!s) return -1;
    for (int i = 0; i < 3; i++)
        if (strcmp(s, ISA_NAMES[i]) == 0) return i;
    PyErr_Format(PyExc_ValueError, "unknown ISA %R: expected 'scalar', 'avx2' or 'avx512'", name);
    return -1;
}

static PyObject *py_isa(PyObject *mod, PyObject *unused) { return PyUnicode_FromString(tw_active()->name); }

static PyObject *py_isa_supported(PyObject *mod, PyObject *name) {
    int isa = parse_isa(name);
    if (isa < 0) return NULL;
    return PyBool_FromLong(tw_isa_supported(isa));
}

static PyObject *py_set_isa(PyObject *mod, PyObject *name) {
    int isa = parse_isa(name);
    if (isa < 0) return NULL;
    if (tw_set_isa(isa) != 0) {
        PyErr_Format(PyExc_ValueError, "this CPU does not support the %s kernels", ISA_NAMES[isa]);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_num_threads(PyObject *mod, PyObject *unused) { return PyLong_FromLong(tw_pool_num_threads()); }

static PyObject *py_pool_state(PyObject *mod, PyObject *unused) {
    return Py_BuildValue("(iL)", tw_pool_active_threads(), tw_pool_demotions());
}

static PyObject *py_set_adaptive(PyObject *mod, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    tw_pool_set_adaptive(on);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_task_threads(PyObject *mod, PyObject *args) {
    long long key, now;
    if (!PyArg_ParseTuple(args, "LL", &key, &now)) return NULL;
    int nth;
    Py_BEGIN_ALLOW_THREADS
    nth = tw_pool_task_threads(key, now);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(nth);
}

static PyObject *py_judge_task(PyObject *mod, PyObject *args) {
    int nth;
    long long wall, waited, key, now;
    if (!PyArg_ParseTuple(args, "iLLLL", &nth, &wall, &waited, &key, &now)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    tw_pool_judge_task(nth, wall, waited, key, now);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_physical_cores(PyObject *mod, PyObject *unused) { return PyLong_FromLong(tw_physical_cores()); }

static PyObject *py_set_num_threads(PyObject *mod, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 1024) {
        PyErr_Format(PyExc_ValueError, "thread count must be in 1..1024, got %ld", n);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tw_pool_set_threads((int)n);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_Format(PyExc_OSError, "could not start %ld threads", n);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* read_bandwidth(nbytes, reps) -> list of seconds per pass (after one warm-up pass) */
static PyObject *py_read_bandwidth(PyObject *mod, PyObject *args) {
    Py_ssize_t nbytes;
    int reps;
    if (!PyArg_ParseTuple(args, "ni", &nbytes, &reps)) return NULL;
    if (nbytes < 4096 || reps < 1 || reps > 10000) {
        PyErr_SetString(PyExc_ValueError, "read_bandwidth needs nbytes >= 4096 and 1 <= reps <= 10000");
        return NULL;
    }
    double *seconds = PyMem_Calloc((size_t)reps, sizeof(double));
    if (!seconds) return PyErr_NoMemory();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tw_read_bandwidth((size_t)nbytes, reps, seconds);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (rc != 0) {
        PyErr_Format(PyExc_MemoryError, "cannot allocate %zd bytes for the bandwidth probe", nbytes);
    } else if ((out = PyList_New(reps))) {
        for (int i = 0; i < reps; i++) PyList_SET_ITEM(out, i, PyFloat_FromDouble(seconds[i]));
    }
    PyMem_Free(seconds);
    return out;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"pack_int4", py_pack_int4, METH_VARARGS, "pack_int4(qweight, scales, zeros, in_features) -> Int4Matrix"},
    {"int4_linear", py_int4_linear, METH_VARARGS, "int4_linear(x, w, out, precision='fp32'): out = x @ W.T"},
    {"rows_linear", py_rows_linear, METH_VARARGS, "rows_linear(x, weight, row_scales, out): dense or int8 rows"},
    {"exp_blocks", py_exp_blocks, METH_VARARGS,
     "exp_blocks(logits, temperatures, e, sums, block): temperature sampling's exponentials and block sums"},
    {"gated", py_gated, METH_VARARGS, "gated(gate, up, out, gelu): out = silu(gate) * up, or tanh-GELU"},
    {"isa", py_isa, METH_NOARGS, "the active kernel ISA"},
    {"isa_supported", py_isa_supported, METH_O, "isa_supported(name) -> bool"},
    {"set_isa", py_set_isa, METH_O, "set_isa(name): choose 'scalar', 'avx2' or 'avx512'"},
    {"num_threads", py_num_threads, METH_NOARGS, "threads a kernel call uses"},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n)"},
    {"pool_state", py_pool_state, METH_NOARGS, "pool_state() -> (threads tasks run on now, contended tasks so far)"},
    {"set_adaptive", py_set_adaptive, METH_O, "set_adaptive(on): fewer threads while a core is taken (default on)"},
    {"task_threads", py_task_threads, METH_VARARGS, "task_threads(key, now_ns) -> threads a task gets (tests)"},
    {"judge_task", py_judge_task, METH_VARARGS,
     "judge_task(nth, wall_ns, waited_ns, key, now_ns): the pool's judgment of a task that did not run (tests)"},
    {"physical_cores", py_physical_cores, METH_NOARGS, "physical cores this process may run on"},
    {"read_bandwidth", py_read_bandwidth, METH_VARARGS, "read_bandwidth(nbytes, reps) -> [seconds per pass]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu", "tokenwire C kernels", -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) {
    if (PyType_Ready(&Int4Matrix_Type) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&Int4Matrix_Type);
    if (PyModule_AddObject(m, "Int4Matrix", (PyObject *)&Int4Matrix_Type) < 0 || tw_py_add_model_type(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
