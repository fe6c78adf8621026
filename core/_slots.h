/* core/_slots.h: a Python object's __slots__ fields read and written from C at their offsets.
 *
 * The per-token loops tokenwire moves into C (core/_rows.c, net/writer/_columns.c,
 * net/protocol/_frames.c) touch a handful of fields of objects whose classes keep them in
 * __slots__ (Request, DecodeStep, Exchange, Outbox, the session's _Stream, ...). Through getattr a field costs a type lookup and a descriptor call;
 * at its offset it is one load, as CPython's own specialized LOAD_ATTR_SLOT does. A layout
 * is learned once per type from the type's member descriptors; an object of another type, or
 * a class whose field is not a plain object slot (a property, an instance dict), has no
 * complete layout, and the caller then leaves that object to its Python path, which is the
 * reference the C loop is tested against (or, in _frames.c, reads it through getattr).
 */
#ifndef TOKENWIRE_SLOTS_H
#define TOKENWIRE_SLOTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>       /* T_OBJECT_EX, READONLY: how a __slots__ field is stored */

#define TW_MAX_FIELDS 16

typedef struct {
    const char *const *spellings;       /* the field names, as written in the class */
    int num_fields;
    PyObject *names[TW_MAX_FIELDS];     /* interned at import (tw_layout_init) */
    PyTypeObject *type;                 /* a strong reference, or NULL before the first object */
    int complete;                       /* every field is a writable object slot of `type` */
    Py_ssize_t offsets[TW_MAX_FIELDS];
} tw_layout;

/* -> 0, or -1 with an exception (at import) */
static inline int tw_layout_init(tw_layout *l) {
    if (l->num_fields > TW_MAX_FIELDS) {
        PyErr_SetString(PyExc_SystemError, "tw_layout: too many fields");
        return -1;
    }
    for (int f = 0; f < l->num_fields; f++)
        if (!(l->names[f] = PyUnicode_InternFromString(l->spellings[f]))) return -1;
    return 0;
}

static inline void tw_layout_learn(tw_layout *l, PyTypeObject *type) {
    Py_INCREF(type);
    Py_XSETREF(l->type, type);
    l->complete = 1;
    for (int f = 0; f < l->num_fields; f++) {
        l->offsets[f] = 0;
        PyObject *descr = PyObject_GetAttr((PyObject *)type, l->names[f]);   /* a slot's descriptor */
        if (descr == NULL) {
            PyErr_Clear();
        } else {
            if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
                PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
                if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) l->offsets[f] = member->offset;
            }
            Py_DECREF(descr);
        }
        if (l->offsets[f] == 0) l->complete = 0;
    }
}

/* Whether `obj`'s fields may be read at their offsets (learning its type's layout first). */
static inline int tw_layout_fits(tw_layout *l, PyObject *obj) {
    if (Py_TYPE(obj) != l->type) tw_layout_learn(l, Py_TYPE(obj));
    return l->complete;
}

/* The field of an object that fits the layout: a borrowed reference, NULL when it is unset
 * (no exception: the caller leaves the object to Python, where reading it raises). */
#define TW_FIELD(l, obj, f) (*(PyObject **)((char *)(obj) + (l)->offsets[f]))

/* Set a field of an object that fits the layout to `value` (a new reference, stolen). */
static inline void tw_set_field(tw_layout *l, PyObject *obj, int f, PyObject *value) {
    Py_XSETREF(TW_FIELD(l, obj, f), value);
}

/* An int field as a long long; -> 0, or -1 when it is unset or not an int that fits (no exception) */
static inline int tw_field_ll(tw_layout *l, PyObject *obj, int f, long long *value) {
    PyObject *v = TW_FIELD(l, obj, f);
    if (v == NULL || !PyLong_CheckExact(v)) return -1;
    int overflow;
    *value = PyLong_AsLongLongAndOverflow(v, &overflow);
    return overflow ? -1 : 0;
}

/* Set an int field; -> 0, or -1 with an exception (no memory) */
static inline int tw_set_field_ll(tw_layout *l, PyObject *obj, int f, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    tw_set_field(l, obj, f, v);
    return 0;
}

#endif
