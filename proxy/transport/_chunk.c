/* proxy.transport._chunk: whole_chunk(), documented in proxy.transport.wire.

   Why C: every read of a paced stream is asked whether it is exactly one chunk in the
   form a server writes, next to the C parser it then skips. Built by every install
   (setup.py, the container image's build stage); tests/unit/test_whole_chunk.py holds
   it to the definition (a pattern) on any input. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *
whole_chunk(PyObject *module, PyObject *data)
{
    const char *d;
    Py_ssize_t n, i, k, lim, size, value;
    char c;

    if (!PyBytes_Check(data)) {
        PyErr_Format(PyExc_TypeError, "whole_chunk() takes bytes, not %.100s",
                     Py_TYPE(data)->tp_name);
        return NULL;
    }
    d = PyBytes_AS_STRING(data);
    n = PyBytes_GET_SIZE(data);
    /* the size line's end within the first ten bytes */
    lim = n < 10 ? n : 10;
    for (i = 0; i + 1 < lim; i++) {
        if (d[i] == '\r' && d[i + 1] == '\n') break;
    }
    if (i + 1 >= lim || i == 0) Py_RETURN_NONE;
    size = n - i - 4;
    if (size <= 0 || d[n - 2] != '\r' || d[n - 1] != '\n') Py_RETURN_NONE;
    /* the size line is the size in lowercase hex without leading zeros (at most 8
       digits: it ends within the first ten bytes) */
    if (d[0] == '0') Py_RETURN_NONE;
    value = 0;
    for (k = 0; k < i; k++) {
        c = d[k];
        if (c >= '0' && c <= '9') value = value * 16 + (c - '0');
        else if (c >= 'a' && c <= 'f') value = value * 16 + (c - 'a' + 10);
        else Py_RETURN_NONE;
    }
    if (value != size) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(d + i + 2, size);
}

static PyMethodDef methods[] = {
    {"whole_chunk", whole_chunk, METH_O,
     "whole_chunk(data) -> the body piece when data is exactly one canonical chunk, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chunk", "whole_chunk(): proxy.transport.wire.", 0,
    methods,
};

PyMODINIT_FUNC
PyInit__chunk(void)
{
    return PyModuleDef_Init(&module);
}
