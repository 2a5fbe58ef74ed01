/* The bounds check of pickle_scan.py, in C: a rank file at world size 1024 holds a pickle of ~50 MB,
 * which the Python version walks in seconds and this in milliseconds. Same accepted inputs, same
 * messages; tests/read/test_pickle_scan.py holds the two to that. It builds nothing and calls nothing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *ScanError;

enum kind { UNKNOWN = 0, NO_ARG, OUT_OF_BAND, FIXED, MEMO_FIXED, COUNTED, FRAME, LINES, MEMO_LINE, STOP };

static unsigned char kinds[256];
static signed char widths[256]; /* negative: a signed length */

static void init_tables(void) {
    const char *no_arg = "(.0123NRabd}elo]st)uQ";
    for (const char *p = no_arg; *p; p++) kinds[(unsigned char)*p] = NO_ARG;
    const unsigned char more[] = {0x81, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8F, 0x90, 0x91, 0x92, 0x93, 0x94};
    for (size_t i = 0; i < sizeof more; i++) kinds[more[i]] = NO_ARG;
    kinds['.'] = STOP;
    kinds[0x97] = kinds[0x98] = OUT_OF_BAND;
#define SET(op, kind, width) (kinds[(op)] = (kind), widths[(op)] = (width))
    SET('K', FIXED, 1); SET('M', FIXED, 2); SET('J', FIXED, 4); SET('G', FIXED, 8);
    SET(0x80, FIXED, 1); SET(0x82, FIXED, 1); SET(0x83, FIXED, 2); SET(0x84, FIXED, 4);
    SET('q', MEMO_FIXED, 1); SET('h', MEMO_FIXED, 1); SET('r', MEMO_FIXED, 4); SET('j', MEMO_FIXED, 4);
    SET('U', COUNTED, 1); SET('C', COUNTED, 1); SET(0x8C, COUNTED, 1); SET(0x8A, COUNTED, 1);
    SET('T', COUNTED, -4); SET('B', COUNTED, 4); SET('X', COUNTED, 4); SET(0x8B, COUNTED, -4);
    SET(0x8E, COUNTED, 8); SET(0x8D, COUNTED, 8); SET(0x96, COUNTED, 8);
    SET(0x95, FRAME, 8);
    SET('I', LINES, 1); SET('L', LINES, 1); SET('F', LINES, 1); SET('S', LINES, 1); SET('V', LINES, 1);
    SET('P', LINES, 1); SET('c', LINES, 2); SET('i', LINES, 2);
    SET('g', MEMO_LINE, 1); SET('p', MEMO_LINE, 1);
#undef SET
}

/* little-endian unsigned or signed integer of 1, 2, 4 or 8 bytes; 8-byte values above INT64_MAX come back
 * as -1 so that every caller's "negative or too large" test refuses them */
static long long read_int(const unsigned char *p, int width, int is_signed) {
    unsigned long long v = 0;
    for (int i = width - 1; i >= 0; i--) v = (v << 8) | p[i];
    if (is_signed && width == 4) return (long long)(int)(unsigned int)v;
    if (width == 8 && v > (unsigned long long)LLONG_MAX) return -1;
    return (long long)v;
}

static PyObject *fail(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, args);
    va_end(args);
    if (msg) {
        PyErr_SetObject(ScanError, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

static PyObject *scan(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *raw = view.buf;
    const long long n = view.len;
    long long pos = 0, ops = 0;
    PyObject *result = NULL;
    for (;;) {
        if (pos >= n) { fail("ends without a STOP opcode (at byte %lld)", pos); goto done; }
        unsigned char op = raw[pos];
        long long at = pos;
        pos++;
        ops++;
        int kind = kinds[op], width = widths[op], size = width < 0 ? -width : width;
        switch (kind) {
        case STOP:
            result = PyLong_FromLongLong(ops);
            goto done;
        case NO_ARG:
            continue;
        case OUT_OF_BAND:
            fail("uses out-of-band buffers (opcode at byte %lld), which no checkpoint does", at);
            goto done;
        case FIXED: case MEMO_FIXED: case COUNTED: case FRAME: {
            if (pos + size > n) { fail("truncated argument at byte %lld", at); goto done; }
            long long value = read_int(raw + pos, size, width < 0);
            pos += size;
            if (kind == MEMO_FIXED && value >= n) {
                fail("memo index %lld at byte %lld is beyond what %lld bytes of pickle can hold", value, at, n);
                goto done;
            }
            if (kind == COUNTED || kind == FRAME) {
                if (value < 0 || value > n - pos) {
                    if (value < 0 && width == 8) {  /* report the unsigned number the Python version reports */
                        unsigned long long u = 0;
                        for (int i = 7; i >= 0; i--) u = (u << 8) | raw[pos - 8 + i];
                        fail("length %llu at byte %lld runs past the end of the data", u, at);
                    } else {
                        fail("length %lld at byte %lld runs past the end of the data", value, at);
                    }
                    goto done;
                }
                if (kind == COUNTED) pos += value;
            }
            continue;
        }
        case LINES: case MEMO_LINE:
            for (int line = 0; line < width; line++) {
                const unsigned char *nl = memchr(raw + pos, '\n', (size_t)(n - pos));
                if (!nl) { fail("unterminated text argument at byte %lld", at); goto done; }
                long long end = nl - raw;
                if (kind == MEMO_LINE) {
                    int ok = end > pos && end - pos <= 19;
                    unsigned long long index = 0;
                    for (long long i = pos; ok && i < end; i++) {
                        if (raw[i] < '0' || raw[i] > '9') ok = 0;
                        else index = index * 10 + (raw[i] - '0');
                    }
                    if (!ok || index >= (unsigned long long)n) {
                        /* the Python version shows repr() of at most 20 bytes of the argument */
                        long long shown = end - pos < 20 ? end - pos : 20;
                        PyObject *text = PyBytes_FromStringAndSize((const char *)raw + pos, (Py_ssize_t)shown);
                        if (text) {
                            fail("memo index %R at byte %lld is not one %lld bytes can hold", text, at, n);
                            Py_DECREF(text);
                        }
                        goto done;
                    }
                }
                pos = end + 1;
            }
            continue;
        default:
            fail("unknown opcode 0x%02x at byte %lld", (unsigned int)op, at);
            goto done;
        }
    }
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "Check a pickle's opcode stream; return its opcode count (see pickle_scan.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pickle_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pickle_scan(void) {
    init_tables();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    ScanError = PyErr_NewExceptionWithDoc("shardstore.read.pickle_scan.ScanError",
                                          "The pickle is malformed or hostile; the message says where.",
                                          PyExc_ValueError, NULL);
    if (!ScanError || PyModule_AddObjectRef(m, "ScanError", ScanError) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
