/* tokenwire.net.writer._columns: the step writer's per-token loop, its common case in C.
 *
 * net/writer/dispatch.py's `_write_columns` runs once per streamed token: at a few hundred
 * streams it was a third of the loop thread's time per step (about a microsecond a token on
 * this project's 2-core development VM). The Python loop stays the reference and the whole
 * behaviour; it calls into here at the top of its body:
 *
 *   write_columns(request_ids, texts, i, exchanges, now, touched, observe, run_last, run_len,
 *                 num_tokens) -> (the entry it stopped at, run_last, run_len, num_tokens)
 *
 * It goes through the columns from `i` while an entry is the common case, a later token of an
 * SSE stream (the exchange has sent a token before and splices its chunks as prefix + text +
 * suffix), doing for it exactly what the Python body does: the exchange's `last_ns` becomes
 * `now`, the inter-token run (run_last, run_len, num_tokens) is carried on and `observe(ns,
 * count)` is called when a run ends, the chunk (key, prefix, text, suffix) goes to the
 * exchange's `queue`, and its outbox is listed in `touched` once. An entry whose request has
 * no exchange any more (cancelled) is skipped, as in Python. It returns at the first entry it
 * does not take, before touching it, and the Python body takes that one.
 *
 * The GIL is held throughout; fields are read at their __slots__ offsets (core/_slots.h).
 */
#include "_slots.h"

enum { EX_LAST_NS, EX_PREFIX, EX_SUFFIX, EX_KEY, EX_QUEUE, EX_OUTBOX, EX_NUM_FIELDS };
static const char *const exchange_fields[EX_NUM_FIELDS] = {"last_ns", "prefix", "suffix", "key", "queue", "outbox"};

enum { OUTBOX_PENDING, OUTBOX_NUM_FIELDS };
static const char *const outbox_fields[OUTBOX_NUM_FIELDS] = {"pending"};

static tw_layout exchange_layout = {.spellings = exchange_fields, .num_fields = EX_NUM_FIELDS};
static tw_layout outbox_layout = {.spellings = outbox_fields, .num_fields = OUTBOX_NUM_FIELDS};

#define EX(obj, f) TW_FIELD(&exchange_layout, obj, f)

static PyObject *write_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "write_columns(request_ids, texts, i, exchanges, now, touched, observe, "
                                         "run_last, run_len, num_tokens)");
        return NULL;
    }
    PyObject *ids = args[0], *texts = args[1], *exchanges = args[3], *now = args[4], *touched = args[5];
    PyObject *observe = args[6];
    Py_ssize_t i = PyLong_AsSsize_t(args[2]);
    long long now_ns = PyLong_AsLongLong(now), run_last = PyLong_AsLongLong(args[7]);
    long long run_len = PyLong_AsLongLong(args[8]), num_tokens = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(ids) || !PyList_CheckExact(texts) || !PyDict_CheckExact(exchanges)
        || !PyList_CheckExact(touched)) {
        PyErr_SetString(PyExc_TypeError, "write_columns: lists of ids and texts, a dict of exchanges, a list touched");
        return NULL;
    }
    /* the sizes are read each time round: `observe` and `queue` are Python calls */
    for (; i < PyList_GET_SIZE(ids) && i < PyList_GET_SIZE(texts); i++) {
        PyObject *ex = PyDict_GetItemWithError(exchanges, PyList_GET_ITEM(ids, i));    /* borrowed */
        if (ex == NULL) {
            if (PyErr_Occurred()) return NULL;
            continue;                       /* cancelled: the client is gone */
        }
        long long last;
        if (!tw_layout_fits(&exchange_layout, ex) || tw_field_ll(&exchange_layout, ex, EX_LAST_NS, &last) < 0
            || !last)
            break;                          /* its first token: Python's */
        PyObject *prefix = EX(ex, EX_PREFIX), *suffix = EX(ex, EX_SUFFIX), *key = EX(ex, EX_KEY);
        PyObject *queue = EX(ex, EX_QUEUE), *outbox = EX(ex, EX_OUTBOX);
        if (prefix == NULL || prefix == Py_None || suffix == NULL || key == NULL || queue == NULL
            || outbox == NULL || !tw_layout_fits(&outbox_layout, outbox)
            || TW_FIELD(&outbox_layout, outbox, OUTBOX_PENDING) == NULL)
            break;                          /* another encoder's chunk (splice), or an odd object */
        /* Python runs from here on (observe, queue): what is used across it is held, and the
         * chunk is made first (the Python body reads the same fields, which nothing changes) */
        PyObject *chunk = PyTuple_Pack(4, key, prefix, PyList_GET_ITEM(texts, i), suffix);
        if (chunk == NULL) return NULL;
        Py_INCREF(queue);
        Py_INCREF(outbox);
        num_tokens++;
        Py_INCREF(now);
        tw_set_field(&exchange_layout, ex, EX_LAST_NS, now);
        PyObject *r = Py_None;
        Py_INCREF(r);
        if (last != run_last) {
            if (run_len) {
                Py_DECREF(r);
                r = PyObject_CallFunction(observe, "LL", now_ns - run_last, run_len);
            }
            run_last = last;
            run_len = 0;
        }
        run_len++;
        if (r != NULL) {
            Py_DECREF(r);
            r = PyObject_CallOneArg(queue, chunk);
        }
        Py_DECREF(chunk);
        Py_DECREF(queue);
        int pending = -1;
        if (r != NULL) {
            Py_DECREF(r);
            PyObject *flag = TW_FIELD(&outbox_layout, outbox, OUTBOX_PENDING);
            if (flag == NULL)
                PyErr_SetObject(PyExc_AttributeError, outbox_layout.names[OUTBOX_PENDING]);
            else if ((pending = PyObject_IsTrue(flag)) == 0) {
                if (PyList_Append(touched, outbox) < 0) {
                    pending = -1;
                } else {
                    Py_INCREF(Py_True);
                    tw_set_field(&outbox_layout, outbox, OUTBOX_PENDING, Py_True);
                }
            }
        }
        Py_DECREF(outbox);
        if (pending < 0) return NULL;
    }
    return Py_BuildValue("nLLL", i, run_last, run_len, num_tokens);
}

static PyMethodDef methods[] = {
    {"write_columns", (PyCFunction)(void (*)(void))write_columns, METH_FASTCALL,
     "write_columns(request_ids, texts, i, exchanges, now, touched, observe, run_last, run_len, num_tokens) "
     "-> (the entry it stopped at, run_last, run_len, num_tokens)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tokenwire.net.writer._columns",
                                    "the step writer's per-token loop, its common case in C (net/writer/dispatch.py)",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__columns(void) {
    if (tw_layout_init(&exchange_layout) < 0 || tw_layout_init(&outbox_layout) < 0) return NULL;
    return PyModule_Create(&module);
}
