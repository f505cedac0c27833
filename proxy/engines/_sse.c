/* proxy.engines._sse: token_kind() and token_runs(), documented in
   proxy.engines.token_read.

   Why C: a stream's every read is asked the same few questions (whole events? token
   deltas? usage? a finish reason?), dozens of events a read at full speed, and in
   CPython each bytes.find or slice costs more in argument parsing and objects than in
   searching. Built by every install (setup.py, the container image's build stage);
   tests/unit/test_token_read.py holds it to the Python reference
   (tests/unit/sse_reference.py) and to the tap's per-event path on any input. */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <string.h>

#define GENERAL -1 /* not plain token events: the tap's general path decides */
#define PATTERN -2 /* one plain token event that only its payload can tell about */
/* n >= 1: n plain token events, each carrying output */

static const char FINISH[] = "\"finish_reason\":"; /* 16 bytes */

/* One single-line event d[0:n], its "\n\n" included (the caller checked the lines):
   1 (output), PATTERN or GENERAL. */
static long
event_kind(const char *d, Py_ssize_t n)
{
    const char *p;
    Py_ssize_t i;

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
    if (p != NULL && (p - d + 11 >= n || p[11] != '"')) return 1;
    p = memmem(d, (size_t)n, "\"text\":\"", 8);
    if (p != NULL && (p - d + 8 >= n || p[8] != '"')) return 1;
    return PATTERN;
}

static long
kind_of(const char *d, Py_ssize_t n)
{
    const char *p;
    Py_ssize_t pos = 0, end;
    long k, count = 0;

    /* whole single-line LF-only events: every newline is half of an event's end */
    if (n < 2 || d[n - 1] != '\n' || d[n - 2] != '\n') return GENERAL;
    if (memchr(d, '\r', (size_t)n) != NULL) return GENERAL;
    while (pos < n) {
        p = memchr(d + pos, '\n', (size_t)(n - pos)); /* found: d ends with one */
        end = p - d + 2;
        if (d[end - 1] != '\n') return GENERAL; /* a line that does not end the event */
        k = event_kind(d + pos, end - pos);
        if (pos == 0 && end == n) return k; /* one event (how engines write them) */
        if (k != 1) return GENERAL;
        count++;
        pos = end;
    }
    return count;
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

/* The runs of plain token events that begin and end a read of LF-only events (events
   found as the tap's framer finds them: at each next blank line). */
static PyObject *
token_runs(PyObject *module, PyObject *chunk)
{
    const char *d, *p, *nl;
    Py_ssize_t n, pos = 0, end, lead = 0, lead_end = 0, tail = 0, tail_start;
    int leading = 1, plain;

    if (!PyBytes_Check(chunk)) {
        PyErr_Format(PyExc_TypeError, "token_runs() takes bytes, not %.100s",
                     Py_TYPE(chunk)->tp_name);
        return NULL;
    }
    d = PyBytes_AS_STRING(chunk);
    n = PyBytes_GET_SIZE(chunk);
    tail_start = n;
    if (memchr(d, '\r', (size_t)n) == NULL) {
        while (pos < n) {
            p = memmem(d + pos, (size_t)(n - pos), "\n\n", 2);
            if (p == NULL) break; /* an unfinished event ends the read */
            end = p - d + 2;
            nl = memchr(d + pos, '\n', (size_t)(end - pos)); /* found: the event has one */
            plain = nl - d == end - 2 && event_kind(d + pos, end - pos) == 1;
            if (plain && leading) {
                lead++;
                lead_end = end;
            } else if (plain) {
                if (tail == 0) tail_start = pos;
                tail++;
            } else {
                leading = 0;
                tail = 0;
                tail_start = n;
            }
            pos = end;
        }
        if (pos < n) { /* no trailing run before an unfinished event */
            tail = 0;
            tail_start = n;
        }
    }
    return Py_BuildValue("(nnnn)", lead, lead_end, tail, tail_start);
}

static PyMethodDef methods[] = {
    {"token_kind", token_kind, METH_O,
     "token_kind(chunk) -> n >= 1 (n plain token events with output), -2 (one plain "
     "event: ask its payload) or -1 (the general path)."},
    {"token_runs", token_runs, METH_O,
     "token_runs(chunk) -> (lead, lead_end, tail, tail_start): the plain token events "
     "that begin the read (how many, where they end) and that end it (how many, where "
     "they begin)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sse", "token_kind(), token_runs(): proxy.engines.token_read.", 0, methods,
};

PyMODINIT_FUNC
PyInit__sse(void)
{
    return PyModuleDef_Init(&module);
}
