/* tokenwire.net.protocol._frames: a step's DATA frames for one HTTP/2 connection, in C.
 *
 * The per-step hot path of net/protocol/http2.py's `send_batch` (see net/protocol/frames.py,
 * whose pure-Python `frame_data_py` is the reference this file must match byte for byte):
 *
 *   frame_data(session, items, out, closing_state) -> the item it stopped at, or None
 *
 * `items` is an iterator over (data key, *pieces): the key is the session's `_Stream`, the
 * DATA payload is the pieces in order, a `bytes` piece as it is, a `str` piece as the JSON
 * string orjson makes of it (the SSE splice: prefix, text, suffix). Items are taken in order
 * while each payload fits in one frame at once: the stream has no queue, its state is below
 * `closing_state`, and the payload fits the connection window, the stream window and the
 * peer's max frame size. Each such item becomes one DATA frame (9-byte header: 24-bit
 * length, type 0, flags 0, stream id) in one bytes object, and both windows are debited by
 * exactly its length. The first item that does not fit, or that this file cannot encode (a
 * piece that is neither exact bytes nor a str, a str that is not valid UTF-8, a failed
 * allocation), is returned untouched for the session's general path, which queues, splits
 * or raises as it does for any `send_data`.
 *
 * Whenever it returns or raises, the frames made so far are appended to `out` (a list, as
 * one bytes object) and `session.send_window` holds the connection window they left: the
 * session's accounting is exact either way. The GIL is held throughout (it touches objects).
 */
#include "_slots.h"              /* the stream's fields at their __slots__ offsets (core/_slots.h) */
#include <string.h>

#define FRAME_HEADER_LEN 9
#define FIRST_CAPACITY 4096         /* bytes, at least */
#define MAX_FIRST_CAPACITY (1 << 20)    /* bytes, at most: a long batch grows past it by doubling */

/* interned attribute names, made once at import */
static PyObject *str_send_window, *str_max_frame_size;

/* The output: one bytes object grown by doubling, shrunk to its length at the end.
 * `data` is NULL until the first frame. */
typedef struct {
    PyObject *data;
    Py_ssize_t len;
    Py_ssize_t num_expected;    /* items the iterator said it holds: the first size is one frame times that */
} Buffer;

/* Room for `n` more bytes. -> where they go, or NULL with an exception; the frames already
 * written stay in `b` either way (a bigger object is made and copied into before the old goes) */
static char *reserve(Buffer *b, Py_ssize_t n) {
    Py_ssize_t need = b->len + n;
    Py_ssize_t cap = FIRST_CAPACITY;
    if (b->data != NULL)
        cap = PyBytes_GET_SIZE(b->data);
    else if (b->num_expected > 0 && n <= PY_SSIZE_T_MAX / (b->num_expected + 1))
        cap = Py_MIN(Py_MAX(cap, n * (b->num_expected + 1)), Py_MAX(MAX_FIRST_CAPACITY, n));
    if (b->data == NULL || need > cap) {
        while (cap < need) cap *= 2;          /* need <= a few frames past cap: no overflow */
        PyObject *bigger = PyBytes_FromStringAndSize(NULL, cap);
        if (bigger == NULL) return NULL;
        if (b->len) memcpy(PyBytes_AS_STRING(bigger), PyBytes_AS_STRING(b->data), b->len);
        Py_XSETREF(b->data, bigger);
    }
    return PyBytes_AS_STRING(b->data) + b->len;
}

/* Hand the frames to `out`, the bytes trimmed to their length (a shrinking realloc, which
 * does not fail in practice; if it does, MemoryError). -> 0, or -1 with an exception */
static int flush_buffer(Buffer *b, PyObject *out) {
    if (b->len == 0) {
        Py_CLEAR(b->data);
        return 0;
    }
    if (_PyBytes_Resize(&b->data, b->len) < 0) return -1;      /* b->data is NULL then */
    int rc = PyList_Append(out, b->data);
    Py_CLEAR(b->data);
    return rc;
}

/* ------------------------------------------------------------------ JSON strings */

/* what orjson writes for each byte: 0 = the byte itself; else the escape's length (2 or 6) */
static unsigned char escape_len[256];
static char short_escape[0x20];     /* 'b', 't', 'n', 'f', 'r' for those five controls, else 0 */

static void init_escapes(void) {
    for (int c = 0; c < 0x20; c++) escape_len[c] = 6;                       /* \u00XX */
    short_escape['\b'] = 'b'; short_escape['\t'] = 't'; short_escape['\n'] = 'n';
    short_escape['\f'] = 'f'; short_escape['\r'] = 'r';
    for (int c = 0; c < 0x20; c++) if (short_escape[c]) escape_len[c] = 2;
    escape_len['"'] = 2;
    escape_len['\\'] = 2;
}

/* A str's UTF-8 bytes and its JSON string's length (quotes included).
 * -> 0, or -1 when it has none (a lone surrogate: the error is cleared, the caller gives up) */
static int json_string_size(PyObject *s, const char **utf8, Py_ssize_t *utf8_len, Py_ssize_t *json_len) {
    *utf8 = PyUnicode_AsUTF8AndSize(s, utf8_len);     /* cached on the str; no copy for ASCII */
    if (*utf8 == NULL) {
        PyErr_Clear();
        return -1;
    }
    const unsigned char *p = (const unsigned char *)*utf8;
    Py_ssize_t n = *utf8_len + 2;
    for (Py_ssize_t i = 0; i < *utf8_len; i++) {
        unsigned char e = escape_len[p[i]];
        if (e) n += e - 1;
    }
    *json_len = n;
    return 0;
}

/* Write the JSON string of `utf8` (json_string_size's result) at `dst`; -> the end */
static char *write_json_string(char *dst, const char *utf8, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)utf8;
    Py_ssize_t run = 0;             /* bytes since the last escape, copied in one memcpy */
    *dst++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = p[i];
        if (!escape_len[c]) {
            run++;
            continue;
        }
        memcpy(dst, p + i - run, run);
        dst += run;
        run = 0;
        *dst++ = '\\';
        if (c >= 0x20) {
            *dst++ = (char)c;                       /* " or \ */
        } else if (short_escape[c]) {
            *dst++ = short_escape[c];
        } else {
            memcpy(dst, "u00", 3);
            dst[3] = hex[c >> 4];
            dst[4] = hex[c & 0xF];
            dst += 5;
        }
    }
    memcpy(dst, p + n - run, run);
    dst += run;
    *dst++ = '"';
    return dst;
}

/* ------------------------------------------------------------------ one item */

#define MAX_PIECES 8

typedef struct {
    const char *data;
    Py_ssize_t len;     /* bytes: its length; str: its UTF-8 length */
    int is_str;
} Piece;

/* The payload's pieces and length; -> 0, or 1 when this file cannot encode the item */
static int measure(PyObject *item, Piece *pieces, Py_ssize_t *num_pieces, Py_ssize_t *payload_len) {
    Py_ssize_t n = PyTuple_GET_SIZE(item) - 1;
    if (n < 1 || n > MAX_PIECES) return 1;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyTuple_GET_ITEM(item, i + 1);
        if (PyBytes_CheckExact(p)) {
            pieces[i] = (Piece){PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p), 0};
            total += pieces[i].len;
        } else if (PyUnicode_Check(p)) {        /* a str subclass too, as orjson */
            Py_ssize_t json_len;
            pieces[i].is_str = 1;
            if (json_string_size(p, &pieces[i].data, &pieces[i].len, &json_len) < 0) return 1;
            total += json_len;
        } else {
            return 1;
        }
    }
    *num_pieces = n;
    *payload_len = total;
    return 0;
}

/* ------------------------------------------------------------------ the stream's fields */

/* A key's four fields (id, state, pending, send_window). The session's `_Stream` keeps them
 * in __slots__, so they are read and written at their offsets in the object, as CPython's
 * own specialized LOAD_ATTR_SLOT does: through getattr they cost ~5x more, most of this
 * file's time per chunk in a server. The layout is learned once per key type (core/_slots.h);
 * a key of a type whose four fields are not all plain object slots goes through getattr /
 * setattr. */
enum { FIELD_ID, FIELD_STATE, FIELD_PENDING, FIELD_SEND_WINDOW, NUM_FIELDS };
static const char *const stream_fields[NUM_FIELDS] = {"id", "state", "pending", "send_window"};
static tw_layout stream_layout = {.spellings = stream_fields, .num_fields = NUM_FIELDS};

/* The field as a new reference, or NULL with an exception */
static PyObject *get_field(PyObject *st, int f) {
    if (!tw_layout_fits(&stream_layout, st)) return PyObject_GetAttr(st, stream_layout.names[f]);
    PyObject *value = TW_FIELD(&stream_layout, st, f);
    if (value == NULL) {
        PyErr_SetObject(PyExc_AttributeError, stream_layout.names[f]);
        return NULL;
    }
    Py_INCREF(value);
    return value;
}

/* -> 0, or -1 with an exception */
static int get_field_ll(PyObject *st, int f, long long *value) {
    PyObject *v = get_field(st, f);
    if (v == NULL) return -1;
    /* not PyLong_AsLongLong: it takes a byte-array conversion for any int of two digits or
     * more (a send window above 2**30), ~100 instructions a field; an overflow still raises */
    int overflow;
    *value = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) *value = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* -> 0, or -1 with an exception */
static int set_field_ll(PyObject *st, int f, long long value) {
    if (tw_layout_fits(&stream_layout, st)) return tw_set_field_ll(&stream_layout, st, f, value);
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    int rc = PyObject_SetAttr(st, stream_layout.names[f], v);
    Py_DECREF(v);
    return rc;
}

/* Does the stream take a frame of `n` bytes at once?  -> 1 yes (its window in *stream_window
 * and its id in *stream_id), 0 no, -1 with an exception */
static int stream_takes(PyObject *st, Py_ssize_t n, long long closing_state,
                        long long *stream_window, long long *stream_id) {
    long long state;
    if (get_field_ll(st, FIELD_STATE, &state) < 0) return -1;
    if (state >= closing_state) return 0;
    PyObject *pending = get_field(st, FIELD_PENDING);
    if (pending == NULL) return -1;
    int queued = PyObject_IsTrue(pending);
    Py_DECREF(pending);
    if (queued != 0) return queued < 0 ? -1 : 0;
    if (get_field_ll(st, FIELD_SEND_WINDOW, stream_window) < 0
        || get_field_ll(st, FIELD_ID, stream_id) < 0)
        return -1;
    return n <= *stream_window;
}

/* A session attribute as a long long; -> 0, or -1 with an exception */
static int get_ll(PyObject *obj, PyObject *name, long long *value) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    *value = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_ll(PyObject *obj, PyObject *name, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* ------------------------------------------------------------------ frame_data */

static PyObject *frame_data(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "frame_data(session, items, out, closing_state)");
        return NULL;
    }
    PyObject *session = args[0], *items = args[1], *out = args[2];
    if (!PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "frame_data: out must be a list");
        return NULL;
    }
    long long closing_state = PyLong_AsLongLong(args[3]);
    long long window, max_frame;
    if ((closing_state == -1 && PyErr_Occurred()) || get_ll(session, str_send_window, &window) < 0
        || get_ll(session, str_max_frame_size, &max_frame) < 0)
        return NULL;
    Py_ssize_t num_expected = PyObject_LengthHint(items, 0);
    if (num_expected < 0) return NULL;
    PyObject *iter = PyObject_GetIter(items);
    if (iter == NULL) return NULL;

    Buffer buf = {NULL, 0, num_expected};
    PyObject *stopped = NULL;       /* the item handed back (a new reference), or NULL */
    int failed = 0;                 /* an exception is set */
    PyObject *item;
    while ((item = PyIter_Next(iter)) != NULL) {
        Piece pieces[MAX_PIECES];
        Py_ssize_t num_pieces, n;
        long long stream_window, stream_id;
        int takes = 0;
        if (PyTuple_Check(item) && measure(item, pieces, &num_pieces, &n) == 0
            && n <= window && n <= max_frame) {
            takes = stream_takes(PyTuple_GET_ITEM(item, 0), n, closing_state, &stream_window, &stream_id);
        }
        if (takes < 0) {
            PyErr_Clear();          /* not a stream this file can read: the general path says why */
            takes = 0;
        }
        char *dst = takes ? reserve(&buf, FRAME_HEADER_LEN + n) : NULL;
        if (takes && dst == NULL) {
            PyErr_Clear();          /* out of memory: the general path tries, and raises */
            takes = 0;
        }
        if (!takes) {
            stopped = item;
            break;
        }
        if (set_field_ll(PyTuple_GET_ITEM(item, 0), FIELD_SEND_WINDOW, stream_window - n) < 0) {
            Py_DECREF(item);
            failed = 1;
            break;
        }
        window -= n;
        dst[0] = (char)(n >> 16); dst[1] = (char)(n >> 8); dst[2] = (char)n;
        dst[3] = 0; dst[4] = 0;                                     /* type DATA, no flags */
        dst[5] = (char)((stream_id >> 24) & 0x7F); dst[6] = (char)(stream_id >> 16);
        dst[7] = (char)(stream_id >> 8); dst[8] = (char)stream_id;
        dst += FRAME_HEADER_LEN;
        for (Py_ssize_t i = 0; i < num_pieces; i++) {
            if (pieces[i].is_str) {
                dst = write_json_string(dst, pieces[i].data, pieces[i].len);
            } else {
                memcpy(dst, pieces[i].data, pieces[i].len);
                dst += pieces[i].len;
            }
        }
        buf.len += FRAME_HEADER_LEN + n;
        Py_DECREF(item);
    }
    Py_DECREF(iter);
    if (!failed && stopped == NULL && PyErr_Occurred()) failed = 1;    /* the iterator raised */

    /* whatever happened: the frames made go out, and the window they left is the session's */
    PyObject *exc_type = NULL, *exc_value = NULL, *exc_tb = NULL;
    if (failed) PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    if (flush_buffer(&buf, out) < 0 || set_ll(session, str_send_window, window) < 0) {
        Py_XDECREF(exc_type); Py_XDECREF(exc_value); Py_XDECREF(exc_tb);
        Py_XDECREF(stopped);
        return NULL;
    }
    if (failed) {
        PyErr_Restore(exc_type, exc_value, exc_tb);
        Py_XDECREF(stopped);
        return NULL;
    }
    if (stopped == NULL) Py_RETURN_NONE;
    return stopped;
}

/* json_string(text) -> bytes: the JSON string frame_data writes for a str piece (tests compare
 * it with orjson); a str without UTF-8 (a lone surrogate) raises ValueError */
static PyObject *json_string(PyObject *module, PyObject *text) {
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "json_string takes a str");
        return NULL;
    }
    const char *utf8;
    Py_ssize_t utf8_len, json_len;
    if (json_string_size(text, &utf8, &utf8_len, &json_len) < 0) {
        PyErr_SetString(PyExc_ValueError, "the str has no UTF-8 form (a lone surrogate)");
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, json_len);
    if (result == NULL) return NULL;
    write_json_string(PyBytes_AS_STRING(result), utf8, utf8_len);
    return result;
}

static PyMethodDef methods[] = {
    {"frame_data", (PyCFunction)(void (*)(void))frame_data, METH_FASTCALL,
     "frame_data(session, items, out, closing_state) -> the item it stopped at, or None"},
    {"json_string", json_string, METH_O, "json_string(text) -> its JSON string, as orjson writes it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tokenwire.net.protocol._frames",
                                    "a step's HTTP/2 DATA frames in C (net/protocol/frames.py)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__frames(void) {
    init_escapes();
    if (tw_layout_init(&stream_layout) < 0
        || !(str_send_window = PyUnicode_InternFromString("send_window"))
        || !(str_max_frame_size = PyUnicode_InternFromString("max_frame_size")))
        return NULL;
    return PyModule_Create(&module);
}
