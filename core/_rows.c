/* tokenwire.core._rows: the scheduler's two per-row loops, their common case in C.
 *
 * core/scheduler.py's `_schedule_decodes` and `_append_tokens` run once per running request
 * per step, and at a few hundred streams they were about half the engine thread's host time
 * (a microsecond a row each, on this project's 2-core development VM). The Python loops stay
 * the reference and the whole behaviour; each now calls into here at the top of its loop body:
 *
 *   schedule_decodes(running, i, scheduled, seqs, block_size, decoding, free_block_ids, ref_counts)
 *       -> the row it stopped at
 *   append_tokens(reqs, sampled_ids, i, now_ns, request_ids, token_ids, texts, fast_decoder)
 *       -> the row it stopped at
 *
 * Each goes through rows from `i` while a row is its common case, does for it exactly what the
 * Python body does, and returns the index of the first row that is not (or the row count): the
 * Python body then takes that one row and calls again from the next. A row is left to Python
 * before anything of it is changed, so the two paths never split one row between them.
 *
 * schedule_decodes' common case: a DECODING request whose next token fits in its blocks, or
 * starts a new one while a block is free (the block manager's `free_block_ids` stack, popped
 * as `BlockManager.append_block` pops it, its `ref_counts` entry set to 1; an eviction or a
 * preemption is Python's). Like the Python body it skips a request whose last token is in
 * flight, and otherwise appends the request to `scheduled`, its DecodeStep (start_pos,
 * num_pending set) to `seqs`, and counts the row in its num_pending.
 *
 * append_tokens' common case, for a step whose outputs go to columns: a row with a token in
 * flight, no grammar, a token that is not a stop id, a request that does not reach its length
 * with it, and a text stream of exactly the type `fast_decoder` (the byte-table decoder) with no
 * held-back bytes and a whole-UTF-8 text for the token. Such a row goes on: the token is
 * appended, stamped and becomes the next step's feed, and its (id, token, text) joins the
 * columns. A row without a token in flight is skipped, as in Python. Any row that stops, is
 * constrained or needs the decoder's slow path is Python's.
 *
 * The GIL is held throughout; fields are read at their __slots__ offsets (core/_slots.h).
 */
#include "_slots.h"

/* ------------------------------------------------------------------ layouts */

enum { REQ_STATE, REQ_NUM_PENDING, REQ_NUM_COMPUTED, REQ_OUTPUT_IDS, REQ_MAX_OUTPUT, REQ_BLOCK_TABLE,
       REQ_DECODE_STEP, REQ_STEP_DONE_NS, REQ_STOP_IDS, REQ_TEXT_STREAM, REQ_CONSTRAINT, REQ_ID,
       REQ_NUM_FIELDS };
static const char *const request_fields[REQ_NUM_FIELDS] = {
    "state", "num_pending", "num_computed_tokens", "output_token_ids", "max_output_tokens", "block_table",
    "decode_step", "step_done_ns", "stop_token_ids", "text_stream", "constraint", "request_id"};

enum { STEP_START_POS, STEP_NUM_PENDING, STEP_TOKEN_IDS, STEP_NUM_FIELDS };
static const char *const step_fields[STEP_NUM_FIELDS] = {"start_pos", "num_pending", "token_ids"};

enum { DEC_PENDING, DEC_TEXT_TABLE, DEC_NUM_FIELDS };
static const char *const decoder_fields[DEC_NUM_FIELDS] = {"pending", "text_table"};

static tw_layout request_layout = {.spellings = request_fields, .num_fields = REQ_NUM_FIELDS};
static tw_layout step_layout = {.spellings = step_fields, .num_fields = STEP_NUM_FIELDS};
static tw_layout decoder_layout = {.spellings = decoder_fields, .num_fields = DEC_NUM_FIELDS};

#define REQ(obj, f) TW_FIELD(&request_layout, obj, f)
#define STEP(obj, f) TW_FIELD(&step_layout, obj, f)

/* A list field of a request that fits its layout, or NULL when it is not a list */
static PyObject *list_field(PyObject *req, int f) {
    PyObject *v = REQ(req, f);
    return v != NULL && PyList_CheckExact(v) ? v : NULL;
}

/* ------------------------------------------------------------------ schedule_decodes */

/* BlockManager.append_block's common case: the top of the free stack goes to `block_table`
 * with one holder. -> 1 done, 0 nothing free (or a stack entry that is not a block id: Python
 * says what is wrong), -1 with an exception. Nothing is changed unless it returns 1. */
static int take_free_block(PyObject *free_ids, PyObject *ref_counts, PyObject *block_table) {
    Py_ssize_t num_free = PyList_GET_SIZE(free_ids);
    if (!num_free) return 0;
    PyObject *block = PyList_GET_ITEM(free_ids, num_free - 1);
    if (!PyLong_CheckExact(block)) return 0;
    Py_ssize_t id = PyLong_AsSsize_t(block);
    if (id == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (id < 0 || id >= PyList_GET_SIZE(ref_counts)) return 0;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) return -1;
    Py_INCREF(block);
    int rc = PyList_Append(block_table, block);
    if (rc == 0) rc = PyList_SetSlice(free_ids, num_free - 1, num_free, NULL);
    Py_DECREF(block);
    if (rc < 0) {
        Py_DECREF(one);
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(ref_counts, id);
    PyList_SET_ITEM(ref_counts, id, one);
    Py_DECREF(old);
    return 1;
}

static PyObject *schedule_decodes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "schedule_decodes(running, i, scheduled, seqs, block_size, decoding, "
                                         "free_block_ids, ref_counts)");
        return NULL;
    }
    PyObject *running = args[0], *scheduled = args[2], *seqs = args[3], *decoding = args[5];
    PyObject *free_ids = args[6], *ref_counts = args[7];
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    long long block_size = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(running) || !PyList_CheckExact(scheduled) || !PyList_CheckExact(seqs)
        || !PyList_CheckExact(free_ids) || !PyList_CheckExact(ref_counts)) {
        PyErr_SetString(PyExc_TypeError,
                        "schedule_decodes: running, scheduled, seqs, free_block_ids and ref_counts must be lists");
        return NULL;
    }
    for (; i < PyList_GET_SIZE(running); i++) {
        PyObject *req = PyList_GET_ITEM(running, i);
        long long pending, computed, max_output;
        if (!tw_layout_fits(&request_layout, req) || REQ(req, REQ_STATE) != decoding
            || tw_field_ll(&request_layout, req, REQ_NUM_PENDING, &pending) < 0
            || tw_field_ll(&request_layout, req, REQ_NUM_COMPUTED, &computed) < 0)
            break;
        PyObject *output_ids = list_field(req, REQ_OUTPUT_IDS), *block_table = list_field(req, REQ_BLOCK_TABLE);
        PyObject *step = REQ(req, REQ_DECODE_STEP);
        if (output_ids == NULL || block_table == NULL || step == NULL || !tw_layout_fits(&step_layout, step)
            || tw_field_ll(&request_layout, req, REQ_MAX_OUTPUT, &max_output) < 0)
            break;
        if (pending && PyList_GET_SIZE(output_ids) + pending >= max_output)
            continue;                       /* its last token is in flight: it ends on it */
        long long start = computed + pending;   /* its pending token goes one position on */
        if (start >= PyList_GET_SIZE(block_table) * block_size) {    /* its next token starts a new block */
            int took = take_free_block(free_ids, ref_counts, block_table);
            if (took < 0) return NULL;
            if (!took) break;               /* none free: an eviction or a preemption, Python's */
        }
        if (PyList_Append(scheduled, req) < 0 || tw_set_field_ll(&step_layout, step, STEP_START_POS, start) < 0
            || tw_set_field_ll(&step_layout, step, STEP_NUM_PENDING, pending) < 0
            || tw_set_field_ll(&request_layout, req, REQ_NUM_PENDING, pending + 1) < 0
            || PyList_Append(seqs, step) < 0)
            return NULL;
    }
    return PyLong_FromSsize_t(i);
}

/* ------------------------------------------------------------------ append_tokens */

/* The token's text when `stream` gives it without its slow path, else NULL (borrowed) */
static PyObject *fast_text(PyObject *stream, PyObject *fast_decoder, PyObject *token) {
    if ((PyObject *)Py_TYPE(stream) != fast_decoder || !tw_layout_fits(&decoder_layout, stream)) return NULL;
    PyObject *held = TW_FIELD(&decoder_layout, stream, DEC_PENDING);
    PyObject *table = TW_FIELD(&decoder_layout, stream, DEC_TEXT_TABLE);
    if (held == NULL || !PyBytes_CheckExact(held) || PyBytes_GET_SIZE(held) || table == NULL
        || !PyList_CheckExact(table))
        return NULL;
    int overflow;
    long long id = PyLong_AsLongLongAndOverflow(token, &overflow);
    if (overflow || id < 0 || id >= PyList_GET_SIZE(table)) return NULL;
    PyObject *text = PyList_GET_ITEM(table, id);
    return PyUnicode_CheckExact(text) ? text : NULL;    /* None: its bytes are not whole UTF-8 */
}

static PyObject *append_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "append_tokens(reqs, sampled_ids, i, now_ns, request_ids, token_ids, texts, fast_decoder)");
        return NULL;
    }
    PyObject *reqs = args[0], *sampled = args[1], *now = args[3];
    PyObject *ids_column = args[4], *tokens_column = args[5], *texts_column = args[6], *fast_decoder = args[7];
    Py_ssize_t i = PyLong_AsSsize_t(args[2]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(ids_column) || !PyList_CheckExact(tokens_column) || !PyList_CheckExact(texts_column)) {
        PyErr_SetString(PyExc_TypeError, "append_tokens: the columns must be lists");
        return NULL;
    }
    if (!(PyList_CheckExact(reqs) || PyTuple_CheckExact(reqs)) || !(PyList_CheckExact(sampled)
                                                                    || PyTuple_CheckExact(sampled)))
        return PyLong_FromSsize_t(i);       /* another sequence type: Python's zip takes it */
    Py_ssize_t n = Py_MIN(PySequence_Fast_GET_SIZE(reqs), PySequence_Fast_GET_SIZE(sampled));
    PyObject **req_items = PySequence_Fast_ITEMS(reqs), **token_items = PySequence_Fast_ITEMS(sampled);
    for (; i < n; i++) {
        PyObject *req = req_items[i], *token = token_items[i];
        long long pending, computed, max_output;
        if (!tw_layout_fits(&request_layout, req) || !PyLong_CheckExact(token)
            || tw_field_ll(&request_layout, req, REQ_NUM_PENDING, &pending) < 0)
            break;
        if (!pending)
            continue;                       /* it ended (or was preempted) after the step was launched */
        PyObject *output_ids = list_field(req, REQ_OUTPUT_IDS), *done_ns = list_field(req, REQ_STEP_DONE_NS);
        PyObject *step = REQ(req, REQ_DECODE_STEP), *stops = REQ(req, REQ_STOP_IDS);
        PyObject *stream = REQ(req, REQ_TEXT_STREAM), *request_id = REQ(req, REQ_ID);
        if (output_ids == NULL || done_ns == NULL || step == NULL || !tw_layout_fits(&step_layout, step)
            || stops == NULL || !PyFrozenSet_CheckExact(stops) || stream == NULL || request_id == NULL
            || REQ(req, REQ_CONSTRAINT) != Py_None
            || tw_field_ll(&request_layout, req, REQ_NUM_COMPUTED, &computed) < 0
            || tw_field_ll(&request_layout, req, REQ_MAX_OUTPUT, &max_output) < 0
            || PyList_GET_SIZE(output_ids) + 1 >= max_output)
            break;                          /* constrained, or it ends on this token by length */
        int is_stop = PySet_Contains(stops, token);
        if (is_stop < 0) return NULL;
        PyObject *text = is_stop ? NULL : fast_text(stream, fast_decoder, token);
        if (text == NULL)
            break;                          /* a stop id (or min_tokens' plain token), or the slow decode */
        PyObject *feed = PyTuple_Pack(1, token);     /* this output's ids, and the next step's feed */
        if (feed == NULL || tw_set_field_ll(&request_layout, req, REQ_NUM_PENDING, pending - 1) < 0
            || tw_set_field_ll(&request_layout, req, REQ_NUM_COMPUTED, computed + 1) < 0
            || PyList_Append(output_ids, token) < 0) {
            Py_XDECREF(feed);
            return NULL;
        }
        tw_set_field(&step_layout, step, STEP_TOKEN_IDS, feed);
        if (PyList_Append(done_ns, now) < 0 || PyList_Append(ids_column, request_id) < 0
            || PyList_Append(tokens_column, token) < 0 || PyList_Append(texts_column, text) < 0)
            return NULL;
    }
    return PyLong_FromSsize_t(i);
}

/* ------------------------------------------------------------------ the module */

static PyMethodDef methods[] = {
    {"schedule_decodes", (PyCFunction)(void (*)(void))schedule_decodes, METH_FASTCALL,
     "schedule_decodes(running, i, scheduled, seqs, block_size, decoding) -> the row it stopped at"},
    {"append_tokens", (PyCFunction)(void (*)(void))append_tokens, METH_FASTCALL,
     "append_tokens(reqs, sampled_ids, i, now_ns, request_ids, token_ids, texts, fast_decoder) "
     "-> the row it stopped at"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tokenwire.core._rows",
                                    "the scheduler's per-row loops, their common case in C (core/scheduler.py)",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rows(void) {
    if (tw_layout_init(&request_layout) < 0 || tw_layout_init(&step_layout) < 0
        || tw_layout_init(&decoder_layout) < 0)
        return NULL;
    return PyModule_Create(&module);
}
