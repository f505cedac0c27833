/* proxy.engines._sse: token_kind(), the C twin of proxy.engines.token_read.token_kind_py.

   Why C: a paced stream's every read is asked the same few questions (one event? a token
   delta? usage? a finish reason?), and in CPython 3.11 each bytes.find or slice the
   Python version makes costs more in argument parsing and objects than in searching.
   The answers must be the Python version's, byte for byte: tests/unit/test_token_read.py
   holds the two to the same answers on any input. Built when a compiler is at hand
   (setup.py marks it optional); without it the Python version runs. */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <string.h>

#define GENERAL -1 /* not a plain token event: the tap's general path decides */
#define OUTPUT 1   /* a plain token event that carries output */
#define PATTERN 2  /* a plain token event only OUTPUT_RE can tell about */

static const char FINISH[] = "\"finish_reason\":"; /* 16 bytes */

static int
kind_of(const char *d, Py_ssize_t n)
{
    const char *p;
    Py_ssize_t i;

    /* one single-line LF-only event: its only newlines are the two that end it */
    if (n < 2) return GENERAL;
    p = memchr(d, '\n', (size_t)n);
    if (p == NULL || p - d != n - 2 || d[n - 1] != '\n') return GENERAL;
    if (memchr(d, '\r', (size_t)n) != NULL) return GENERAL;
    /* data: {"... and not an error object */
    if (n < 8 || memcmp(d, "data: {\"", 8) != 0) return GENERAL;
    if (n >= 14 && memcmp(d + 8, "error\"", 6) == 0) return GENERAL;
    /* no usage key, and no finish reason but a single null one */
    if (memmem(d, (size_t)n, "\"usage\":", 8) != NULL) return GENERAL;
    p = memmem(d, (size_t)n, FINISH, 16);
    if (p != NULL) {
        i = p - d;
        if (i + 20 > n || memcmp(d + i + 16, "null", 4) != 0) return GENERAL;
        if (memmem(d + i + 16, (size_t)(n - i - 16), FINISH, 16) != NULL) return GENERAL;
    }
    /* output: a "content" or "text" string that is not empty */
    p = memmem(d, (size_t)n, "\"content\":\"", 11);
    if (p != NULL && (p - d + 11 >= n || p[11] != '"')) return OUTPUT;
    p = memmem(d, (size_t)n, "\"text\":\"", 8);
    if (p != NULL && (p - d + 8 >= n || p[8] != '"')) return OUTPUT;
    return PATTERN;
}

static PyObject *
token_kind(PyObject *module, PyObject *chunk)
{
    if (!PyBytes_Check(chunk)) {
        PyErr_Format(PyExc_TypeError, "token_kind() takes bytes, not %.100s",
                     Py_TYPE(chunk)->tp_name);
        return NULL;
    }
    return PyLong_FromLong(kind_of(PyBytes_AS_STRING(chunk), PyBytes_GET_SIZE(chunk)));
}

static PyMethodDef methods[] = {
    {"token_kind", token_kind, METH_O,
     "token_kind(chunk) -> -1 (general path), 1 (output) or 2 (ask OUTPUT_RE)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sse", "C twin of proxy.engines.token_read.", 0, methods,
};

PyMODINIT_FUNC
PyInit__sse(void)
{
    return PyModuleDef_Init(&module);
}
