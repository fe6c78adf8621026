/* Shared by the py_*.c files, the only ones that include Python.h. */
#ifndef TW_PY_COMMON_H
#define TW_PY_COMMON_H

#include <Python.h>

#include "tw.h"

/* Get a C-contiguous buffer of one element kind ('f' float32, 'e' float16, 'B' uint8, 'b' int8,
 * 'i' int32) and `ndim` dimensions (0: any); on failure sets ValueError naming `name`, returns -1. */
int tw_py_buffer(PyObject *obj, Py_buffer *view, const char *name, char kind, int ndim, int writable);

/* The tw_int4 inside an Int4Matrix, or NULL with TypeError set. */
const tw_int4 *tw_py_int4(PyObject *obj);

/* Adds the Model type (py_model.c) to the module. */
int tw_py_add_model_type(PyObject *module);

#endif
