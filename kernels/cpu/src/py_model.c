/* `_cpu.Model`: the C forward as a Python object. kernels/cpu/model.py builds it from a
 * ModelConfig and engine tensors (set_* once per weight), then calls forward() once per step
 * with the ForwardBatch arrays; the GIL is released for the whole step.
 *
 * Weights: INT4 matrices are repacked into memory the model owns; dense and int8 matrices are
 * read in place from the caller's arrays (the engine's mmap), whose buffers this object holds
 * until it dies; norm and bias vectors are copied. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <string.h>

#include "model.h"
#include "py_common.h"

typedef struct {
    PyObject_HEAD
    tw_model m;
    Py_buffer *held;            /* buffers of borrowed weights */
    int num_held, cap_held;
    _Atomic int busy;
} Model;

static void Model_dealloc(Model *self) {
    tw_model_free(&self->m);
    for (int i = 0; i < self->num_held; i++) PyBuffer_Release(&self->held[i]);
    PyMem_Free(self->held);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_activation(const char *s) {
    if (strcmp(s, "silu") == 0) return TW_ACT_SILU;
    if (strcmp(s, "gelu_tanh") == 0) return TW_ACT_GELU_TANH;
    PyErr_Format(PyExc_ValueError, "activation must be 'silu' or 'gelu_tanh', got '%s'", s);
    return -1;
}

static void clear_weight(tw_weight *w) { memset(w, 0, sizeof *w), w->kind = -1; }

/* Model(dim, hidden, num_layers, num_heads, num_kv_heads, head_dim, vocab, activation,
 *       sliding_window, eps, embed_mult, inv_freq f64[hd/2], block_size, num_blocks, precision) */
static int Model_init(Model *self, PyObject *args, PyObject *kw) {
    tw_model *m = &self->m;
    const char *act, *precision;
    PyObject *oinv;
    memset(m, 0, sizeof *m);
    if (!PyArg_ParseTuple(args, "iiiiiiisiffOiis", &m->dim, &m->hidden, &m->num_layers, &m->num_heads,
                          &m->num_kv_heads, &m->head_dim, &m->vocab, &act, &m->sliding_window, &m->eps,
                          &m->embed_mult, &oinv, &m->block_size, &m->num_blocks, &precision))
        return -1;
    if ((m->activation = parse_activation(act)) < 0) return -1;
    if (strcmp(precision, "fp32") && strcmp(precision, "int8")) {
        PyErr_Format(PyExc_ValueError, "activation precision must be 'fp32' or 'int8', got '%s'", precision);
        return -1;
    }
    m->prec = strcmp(precision, "int8") == 0 ? TW_PREC_Q8 : TW_PREC_F32;
    if (m->dim < 1 || m->hidden < 1 || m->num_layers < 1 || m->num_heads < 1 || m->num_kv_heads < 1 ||
        m->num_heads % m->num_kv_heads || m->head_dim < 2 || m->head_dim % 2 || m->vocab < 1 ||
        m->block_size < 1 || m->num_blocks < 1 || m->sliding_window < 0) {
        PyErr_SetString(PyExc_ValueError, "invalid model dimensions");
        return -1;
    }
    Py_buffer inv;
    if (PyObject_GetBuffer(oinv, &inv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
    int ok = inv.format && strcmp(inv.format, "d") == 0 && inv.len == (Py_ssize_t)(m->head_dim / 2 * sizeof(double));
    if (ok && (m->inv_freq = tw_alloc((size_t)inv.len))) memcpy(m->inv_freq, inv.buf, (size_t)inv.len);
    PyBuffer_Release(&inv);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "inv_freq must be a float64 array of head_dim / 2 values");
        return -1;
    }
    m->layers = tw_alloc((size_t)m->num_layers * sizeof(tw_layer));
    if (!m->inv_freq || !m->layers || tw_model_init(m) != 0) {
        PyErr_NoMemory();
        return -1;
    }
    clear_weight(&m->embed);
    clear_weight(&m->lm_head);
    for (int l = 0; l < m->num_layers; l++) {
        tw_layer *L = &m->layers[l];
        clear_weight(&L->qkv), clear_weight(&L->o), clear_weight(&L->gate_up), clear_weight(&L->down);
        L->window = m->sliding_window;
    }
    return 0;
}

/* set_attention(attn_scale, attn_softcap, final_softcap, windows i32 [L], local_rope u8 [L],
 * inv_freq_local f64 [hd/2] or None): the per-layer and soft-capping options of core/config.py
 * (Gemma 2/3, Qwen2 layer windows); 0 means none. */
static PyObject *Model_set_attention(Model *self, PyObject *args) {
    tw_model *m = &self->m;
    float scale, attn_cap, final_cap;
    PyObject *ow, *ol, *oinv;
    if (!PyArg_ParseTuple(args, "fffOOO", &scale, &attn_cap, &final_cap, &ow, &ol, &oinv)) return NULL;
    if (scale <= 0.0f || attn_cap < 0.0f || final_cap < 0.0f) {
        PyErr_SetString(PyExc_ValueError, "attention scale must be > 0 and soft caps >= 0");
        return NULL;
    }
    Py_buffer w, l;
    if (tw_py_buffer(ow, &w, "windows", 'i', 1, 0)) return NULL;
    if (tw_py_buffer(ol, &l, "local_rope", 'B', 1, 0)) return PyBuffer_Release(&w), NULL;
    double *local = NULL;
    if (w.shape[0] != m->num_layers || l.shape[0] != m->num_layers) {
        PyErr_Format(PyExc_ValueError, "windows and local_rope need one value per layer (%d)", m->num_layers);
        goto fail;
    }
    if (oinv != Py_None) {
        Py_buffer inv;
        if (PyObject_GetBuffer(oinv, &inv, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) goto fail;
        const int ok = inv.format && strcmp(inv.format, "d") == 0 && inv.len == (Py_ssize_t)(m->head_dim / 2 * sizeof(double));
        if (ok && (local = tw_alloc((size_t)inv.len))) memcpy(local, inv.buf, (size_t)inv.len);
        PyBuffer_Release(&inv);
        if (!ok) PyErr_SetString(PyExc_ValueError, "inv_freq_local must be a float64 array of head_dim / 2 values");
        else if (!local) PyErr_NoMemory();
        if (!local) goto fail;
    }
    for (int i = 0; i < m->num_layers; i++) {
        const int window = ((const int32_t *)w.buf)[i], uses_local = ((const uint8_t *)l.buf)[i];
        if (window < 0 || (uses_local && !local)) {
            PyErr_Format(PyExc_ValueError, "layer %d: bad window %d or local RoPE without inv_freq_local", i, window);
            tw_free(local);
            goto fail;
        }
        m->layers[i].window = window;
        m->layers[i].local_rope = uses_local;
    }
    tw_free(m->inv_freq_local);
    m->inv_freq_local = local;
    m->attn_scale = scale, m->attn_softcap = attn_cap, m->final_softcap = final_cap;
    PyBuffer_Release(&w), PyBuffer_Release(&l);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&w), PyBuffer_Release(&l);
    return NULL;
}

/* ------------------------------------------------------------------ weights */

static tw_weight *matrix_slot(Model *self, const char *name, int layer, int *n, int *k) {
    tw_model *m = &self->m;
    const int q = m->num_heads * m->head_dim, kv = m->num_kv_heads * m->head_dim;
    if (!strcmp(name, "embed") || !strcmp(name, "lm_head")) {
        *n = m->vocab, *k = m->dim;
        return !strcmp(name, "embed") ? &m->embed : &m->lm_head;
    }
    if (layer < 0 || layer >= m->num_layers) {
        PyErr_Format(PyExc_ValueError, "layer %d out of range for %s (the model has %d)", layer, name, m->num_layers);
        return NULL;
    }
    tw_layer *L = &m->layers[layer];
    if (!strcmp(name, "qkv_proj")) return *n = q + 2 * kv, *k = m->dim, &L->qkv;
    if (!strcmp(name, "o_proj")) return *n = m->dim, *k = q, &L->o;
    if (!strcmp(name, "gate_up_proj")) return *n = 2 * m->hidden, *k = m->dim, &L->gate_up;
    if (!strcmp(name, "down_proj")) return *n = m->dim, *k = m->hidden, &L->down;
    PyErr_Format(PyExc_ValueError, "unknown matrix weight '%s'", name);
    return NULL;
}

static int check_shape(const char *name, int layer, int n, int k, Py_ssize_t got_n, Py_ssize_t got_k) {
    if (got_n == n && got_k == k) return 0;
    PyErr_Format(PyExc_ValueError, "weight %s (layer %d) has shape [%zd, %zd], the model needs [%d, %d]",
                 name, layer, got_n, got_k, n, k);
    return -1;
}

static int hold(Model *self, Py_buffer *view) {
    if (self->num_held == self->cap_held) {
        int cap = self->cap_held ? 2 * self->cap_held : 16;
        Py_buffer *more = PyMem_Realloc(self->held, (size_t)cap * sizeof(Py_buffer));
        if (!more) return PyErr_NoMemory(), -1;
        self->held = more;
        self->cap_held = cap;
    }
    self->held[self->num_held++] = *view;
    return 0;
}

/* set_int4(name, layer, qweight u8 [N, Kp/2], scales f16 [N, Kp/G], zeros f16 [N, Kp/G]) */
static PyObject *Model_set_int4(Model *self, PyObject *args) {
    const char *name;
    int layer, n, k;
    PyObject *oq, *os, *oz;
    if (!PyArg_ParseTuple(args, "siOOO", &name, &layer, &oq, &os, &oz)) return NULL;
    tw_weight *w = matrix_slot(self, name, layer, &n, &k);
    if (!w) return NULL;
    Py_buffer q, s, z;
    if (tw_py_buffer(oq, &q, "qweight", 'B', 2, 0)) return NULL;
    if (tw_py_buffer(os, &s, "scales", 'e', 2, 0)) return PyBuffer_Release(&q), NULL;
    if (tw_py_buffer(oz, &z, "zeros", 'e', 2, 0)) return PyBuffer_Release(&q), PyBuffer_Release(&s), NULL;
    const Py_ssize_t kp = 2 * q.shape[1], ng = s.shape[1];
    int rc = -1;
    if (q.shape[0] != n || s.shape[0] != n || z.shape[0] != n || z.shape[1] != ng || ng < 1 || kp % ng ||
        (kp / ng) % 8 || kp < k || kp - k >= kp / ng) {
        PyErr_Format(PyExc_ValueError, "INT4 weight %s (layer %d): qweight [%zd, %zd], scales [%zd, %zd], zeros [%zd, %zd] "
                     "do not encode [%d, %d]", name, layer, q.shape[0], q.shape[1], s.shape[0], s.shape[1],
                     z.shape[0], z.shape[1], n, k);
    } else {
        if (w->kind == TW_W_I4) tw_int4_free(&w->i4);
        Py_BEGIN_ALLOW_THREADS
        rc = tw_int4_pack(&w->i4, q.buf, s.buf, z.buf, n, k, (int)kp, (int)(kp / ng));
        Py_END_ALLOW_THREADS
        if (rc) PyErr_NoMemory();
        w->kind = rc ? -1 : TW_W_I4;
        w->n = n, w->k = k;
    }
    PyBuffer_Release(&q), PyBuffer_Release(&s), PyBuffer_Release(&z);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* set_dense(name, layer, weight f32|f16 [N, K]) and set_int8(name, layer, qweight i8 [N, K], scales f16 [N]) */
static PyObject *set_rows(Model *self, PyObject *args, int int8) {
    const char *name;
    int layer, n, k;
    PyObject *ow, *os = NULL;
    if (!PyArg_ParseTuple(args, int8 ? "siOO" : "siO", &name, &layer, &ow, &os)) return NULL;
    tw_weight *w = matrix_slot(self, name, layer, &n, &k);
    if (!w) return NULL;
    Py_buffer wv, sv;
    int kind = TW_W_I8;
    if (int8) {
        if (tw_py_buffer(ow, &wv, "qweight", 'b', 2, 0)) return NULL;
        if (tw_py_buffer(os, &sv, "scales", 'e', 1, 0)) return PyBuffer_Release(&wv), NULL;
        if (check_shape(name, layer, n, k, wv.shape[0], wv.shape[1]) || check_shape(name, layer, n, 1, sv.shape[0], 1) ||
            hold(self, &wv))
            return PyBuffer_Release(&wv), PyBuffer_Release(&sv), NULL;
        if (hold(self, &sv)) return PyBuffer_Release(&sv), NULL;
        w->row_scales = sv.buf;
    } else {
        if (tw_py_buffer(ow, &wv, "weight", 'f', 2, 0) && (PyErr_Clear(), tw_py_buffer(ow, &wv, "weight", 'e', 2, 0))) {
            PyErr_Format(PyExc_ValueError, "dense weight %s (layer %d) must be a 2-D float32 or float16 array", name, layer);
            return NULL;
        }
        kind = strchr(wv.format, 'f') ? TW_W_F32 : TW_W_F16;
        if (check_shape(name, layer, n, k, wv.shape[0], wv.shape[1]) || hold(self, &wv))
            return PyBuffer_Release(&wv), NULL;
    }
    if (w->kind == TW_W_I4) tw_int4_free(&w->i4);
    w->kind = kind;
    w->n = n, w->k = k;
    w->data = wv.buf;
    Py_RETURN_NONE;
}

static PyObject *Model_set_dense(Model *self, PyObject *args) { return set_rows(self, args, 0); }
static PyObject *Model_set_int8(Model *self, PyObject *args) { return set_rows(self, args, 1); }

/* set_vector(name, layer, f32 [n]): norm (layer ignored), attn_norm, mlp_norm, qkv_bias, q_norm, k_norm,
 * post_attn_norm, post_mlp_norm */
static PyObject *Model_set_vector(Model *self, PyObject *args) {
    const char *name;
    int layer;
    PyObject *ov;
    if (!PyArg_ParseTuple(args, "siO", &name, &layer, &ov)) return NULL;
    tw_model *m = &self->m;
    float **slot = NULL;
    int n = m->dim;
    if (!strcmp(name, "norm")) {
        slot = &m->norm;
    } else if (layer < 0 || layer >= m->num_layers) {
        PyErr_Format(PyExc_ValueError, "layer %d out of range for %s (the model has %d)", layer, name, m->num_layers);
        return NULL;
    } else if (!strcmp(name, "attn_norm")) {
        slot = &m->layers[layer].attn_norm;
    } else if (!strcmp(name, "mlp_norm")) {
        slot = &m->layers[layer].mlp_norm;
    } else if (!strcmp(name, "qkv_bias")) {
        slot = &m->layers[layer].qkv_bias;
        n = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    } else if (!strcmp(name, "q_norm") || !strcmp(name, "k_norm")) {
        slot = !strcmp(name, "q_norm") ? &m->layers[layer].q_norm : &m->layers[layer].k_norm;
        n = m->head_dim;
    } else if (!strcmp(name, "post_attn_norm")) {
        slot = &m->layers[layer].post_attn_norm;
    } else if (!strcmp(name, "post_mlp_norm")) {
        slot = &m->layers[layer].post_mlp_norm;
    } else {
        PyErr_Format(PyExc_ValueError, "unknown vector weight '%s'", name);
        return NULL;
    }
    Py_buffer v;
    if (tw_py_buffer(ov, &v, name, 'f', 1, 0)) return NULL;
    if (v.shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "vector %s (layer %d) has %zd values, the model needs %d", name, layer, v.shape[0], n);
        PyBuffer_Release(&v);
        return NULL;
    }
    tw_free(*slot);
    if ((*slot = tw_alloc((size_t)n * sizeof(float)))) memcpy(*slot, v.buf, (size_t)n * sizeof(float));
    PyBuffer_Release(&v);
    if (!*slot) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ forward */

static const char *BATCH_NAMES[] = {"token_ids", "positions", "seq_starts", "context_lens", "block_tables",
                                    "slot_mapping", "logits_indices"};

/* forward(token_ids, positions, seq_starts, context_lens, block_tables, slot_mapping, logits_indices, logits,
 *         threads=0, argmax=None): threads 0 = as many as the step's work is worth; argmax, an int32
 *         [len(logits_indices)] array, receives each logits row's first maximum (fused into lm_head) */
static PyObject *Model_forward(Model *self, PyObject *args) {
    PyObject *obj[9] = {NULL};
    int threads = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOOO|iO", &obj[0], &obj[1], &obj[2], &obj[3], &obj[4], &obj[5], &obj[6], &obj[7],
                          &threads, &obj[8]))
        return NULL;
    const int want_argmax = obj[8] && obj[8] != Py_None;
    const char *missing = tw_model_missing(&self->m);
    if (missing) return PyErr_Format(PyExc_ValueError, "the C model has no weight %s", missing);
    Py_buffer v[9];
    int got = 0;
    for (; got < 7; got++)
        if (tw_py_buffer(obj[got], &v[got], BATCH_NAMES[got], 'i', got == 4 ? 2 : 1, 0)) break;
    if (got == 7 && tw_py_buffer(obj[7], &v[7], "logits", 'f', 2, 1) == 0) got = 8;
    if (got == 8 && want_argmax && tw_py_buffer(obj[8], &v[8], "argmax", 'i', 1, 1) == 0) got = 9;
    PyObject *result = NULL;
    int32_t *token_seq = NULL;
    if (got == 8 + want_argmax) {
        tw_batch b = {
            .num_tokens = (int)v[0].shape[0], .num_seqs = (int)v[3].shape[0], .num_logits = (int)v[6].shape[0],
            .max_blocks = (int)v[4].shape[1], .token_ids = v[0].buf, .positions = v[1].buf, .seq_starts = v[2].buf,
            .context_lens = v[3].buf, .block_tables = v[4].buf, .slot_mapping = v[5].buf, .logits_indices = v[6].buf,
            .logits = v[7].buf, .argmax = want_argmax ? v[8].buf : NULL,
        };
        const char *bad = NULL;
        if (v[1].shape[0] != b.num_tokens || v[5].shape[0] != b.num_tokens) bad = "positions and slot_mapping need one entry per token";
        else if (v[2].shape[0] != b.num_seqs + 1 || v[4].shape[0] != b.num_seqs) bad = "seq_starts needs S + 1 entries and block_tables S rows";
        else if (v[7].shape[0] != b.num_logits || v[7].shape[1] != self->m.vocab) bad = "logits must be [len(logits_indices), vocab]";
        else if (want_argmax && v[8].shape[0] != b.num_logits) bad = "argmax must have len(logits_indices) entries";
        else if (!(token_seq = PyMem_Malloc((size_t)(2 * b.num_tokens + 1) * sizeof(int32_t)))) PyErr_NoMemory();
        else {
            b.token_seq = token_seq;
            b.logit_row = token_seq + b.num_tokens + 1;
            bad = tw_batch_check(&self->m, &b);
        }
        if (bad) PyErr_SetString(PyExc_ValueError, bad);
        else if (token_seq && atomic_exchange(&self->busy, 1))
            PyErr_SetString(PyExc_RuntimeError, "this C model is already running a step in another thread");
        else if (token_seq) {
            threads = tw_model_threads(&self->m, &b, threads);
            int rc = tw_model_reserve(&self->m, &b, threads);
            if (rc) PyErr_NoMemory();
            else {
                Py_BEGIN_ALLOW_THREADS
                tw_model_forward(&self->m, &b, threads);
                Py_END_ALLOW_THREADS
                result = Py_None;
                Py_INCREF(result);
            }
            atomic_store(&self->busy, 0);
        }
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    PyMem_Free(token_seq);
    return result;
}

static PyObject *Model_weight_bytes(Model *self, void *unused) {
    return PyLong_FromSize_t(tw_model_weight_bytes(&self->m));
}

static PyObject *Model_precision(Model *self, void *unused) {
    return PyUnicode_FromString(self->m.prec == TW_PREC_Q8 ? "int8" : "fp32");
}

/* profile(reset=False) -> {"steps": n, "step_ns": total, stage: ns, ...} of thread 0 */
static PyObject *Model_profile(Model *self, PyObject *args) {
    int reset = 0;
    if (!PyArg_ParseTuple(args, "|p", &reset)) return NULL;
    static const char *names[] = TW_PROF_NAMES;
    tw_profile *p = &self->m.prof;
    PyObject *d = Py_BuildValue("{s:K,s:K}", "steps", (unsigned long long)p->steps, "step_ns", (unsigned long long)p->step_ns);
    for (int i = 0; d && i < TW_PROF_STAGES; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(p->ns[i]);
        if (!v || PyDict_SetItemString(d, names[i], v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    if (d && reset) memset(p, 0, sizeof *p);
    return d;
}

static PyMethodDef Model_methods[] = {
    {"profile", (PyCFunction)Model_profile, METH_VARARGS, "profile(reset=False) -> ns per stage of thread 0"},
    {"set_int4", (PyCFunction)Model_set_int4, METH_VARARGS, "set_int4(name, layer, qweight, scales, zeros)"},
    {"set_dense", (PyCFunction)Model_set_dense, METH_VARARGS, "set_dense(name, layer, weight)"},
    {"set_int8", (PyCFunction)Model_set_int8, METH_VARARGS, "set_int8(name, layer, qweight, scales)"},
    {"set_vector", (PyCFunction)Model_set_vector, METH_VARARGS, "set_vector(name, layer, values)"},
    {"set_attention", (PyCFunction)Model_set_attention, METH_VARARGS,
     "set_attention(scale, attn_softcap, final_softcap, windows, local_rope, inv_freq_local)"},
    {"forward", (PyCFunction)Model_forward, METH_VARARGS,
     "forward(token_ids, positions, seq_starts, context_lens, block_tables, slot_mapping, logits_indices, logits, "
     "threads=0, argmax=None)"},
    {NULL},
};

static PyGetSetDef Model_getset[] = {
    {"weight_bytes_per_token", (getter)Model_weight_bytes, NULL, "bytes of matrix weights one decode step reads", NULL},
    {"precision", (getter)Model_precision, NULL, "activation precision of the INT4 products", NULL},
    {NULL},
};

static PyTypeObject Model_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokenwire.kernels.cpu._cpu.Model",
    .tp_basicsize = sizeof(Model),
    .tp_dealloc = (destructor)Model_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The C forward (see kernels/cpu/model.py).",
    .tp_methods = Model_methods,
    .tp_getset = Model_getset,
    .tp_init = (initproc)Model_init,
    .tp_new = PyType_GenericNew,
};

int tw_py_add_model_type(PyObject *module) {
    if (PyType_Ready(&Model_Type) < 0) return -1;
    Py_INCREF(&Model_Type);
    return PyModule_AddObject(module, "Model", (PyObject *)&Model_Type);
}
