/* FP8 block dequantization (export/fp8.py's) and MXFP4's (export/mxfp4.py's, below), in C: one pass over the weight's bytes, where numpy makes
 * seven (widen, gather the scales, multiply, five steps of rounding) and a DeepSeek-V3's ~650 GB of FP8
 * weights become bfloat16 at tens of MB/s a core. The same arithmetic as fp8.py's numpy path, so the
 * same bytes (tests/export/test_fp8.py holds the two to that): each FP8 byte widened by `table`
 * (float32), times its block's float32 scale in float32 (one IEEE multiply, rounded to nearest even),
 * then rounded once to bfloat16 (to nearest even; every NaN 0x7FC0) or kept as float32. It reads the
 * buffers it is given and builds nothing but its output. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static int need(Py_buffer *view, Py_ssize_t size, const char *what) {
    if (view->len < size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, %zd needed", what, view->len, size);
        return 0;
    }
    return 1;
}

static uint16_t to_bfloat16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu)) return 0x7FC0u;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* fp8_block(weight, table, scales, rows, columns, scale_columns, block_rows, block_columns, first_row, bf16)
 * -> bytes: rows x columns values of `weight` (one byte each), row r scaled by the scales' row
 * (first_row + r) / block_rows, column c by column c / block_columns. */
static PyObject *fp8_block(PyObject *self, PyObject *args) {
    Py_buffer weight, table, scales;
    Py_ssize_t rows, columns, scale_columns, block_rows, block_columns, first_row;
    int bf16;
    if (!PyArg_ParseTuple(args, "y*y*y*nnnnnnp", &weight, &table, &scales, &rows, &columns, &scale_columns,
                          &block_rows, &block_columns, &first_row, &bf16))
        return NULL;
    PyObject *out = NULL;
    if (rows < 0 || columns < 0 || block_rows <= 0 || block_columns <= 0 || first_row < 0 || scale_columns < 0 ||
        (columns > 0 && (columns - 1) / block_columns >= scale_columns) ||
        (columns > 0 && rows > PY_SSIZE_T_MAX / columns / 4) || first_row > PY_SSIZE_T_MAX - rows) {
        PyErr_SetString(PyExc_ValueError, "fp8_block: sizes out of range");
        goto done;
    }
    Py_ssize_t scale_rows = rows ? (first_row + rows - 1) / block_rows + 1 : 0;  /* the scales' rows it reads */
    if (scale_columns && scale_rows > scales.len / 4 / scale_columns) {
        PyErr_Format(PyExc_ValueError, "scales: %zd bytes, %zd rows of %zd needed", scales.len, scale_rows,
                     scale_columns);
        goto done;
    }
    if (!need(&weight, rows * columns, "weight") || !need(&table, 256 * 4, "table"))
        goto done;
    Py_ssize_t width = bf16 ? 2 : 4;
    out = PyBytes_FromStringAndSize(NULL, rows * columns * width);
    if (!out) goto done;
    const uint8_t *w = weight.buf;
    const float *widen = table.buf, *scale_at = scales.buf;
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *scale_row = scale_at + (first_row + r) / block_rows * scale_columns;
        const uint8_t *src = w + r * columns;
        for (Py_ssize_t c0 = 0; c0 < columns; c0 += block_columns) {
            float scale = scale_row[c0 / block_columns];
            Py_ssize_t c1 = c0 + block_columns < columns ? c0 + block_columns : columns;
            if (bf16) {
                uint16_t *o = (uint16_t *)dst + r * columns;
                for (Py_ssize_t c = c0; c < c1; c++) o[c] = to_bfloat16(widen[src[c]] * scale);
            } else {
                float *o = (float *)dst + r * columns;
                for (Py_ssize_t c = c0; c < c1; c++) o[c] = widen[src[c]] * scale;
            }
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&weight);
    PyBuffer_Release(&table);
    PyBuffer_Release(&scales);
    return out;
}

/* MXFP4 (export/mxfp4.py's): E2M1's sixteen values times each power of two a scale byte can say, exactly
 * (ldexpf: 2**(s - 127), past float32's range infinity, as torch's ldexp), built once at import. */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static float mxfp4_value[256][16];
static uint16_t mxfp4_bf16[256][16];

/* mxfp4(packed, exponents, bf16) -> bytes: each group of 16 packed bytes (two values a byte, the low nibble
 * first) times 2**(its exponent byte - 127), as 32 bfloat16 or float32 values, groups in order. */
static PyObject *mxfp4(PyObject *self, PyObject *args) {
    Py_buffer packed, exponents;
    int bf16;
    if (!PyArg_ParseTuple(args, "y*y*p", &packed, &exponents, &bf16))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t groups = exponents.len;
    if (packed.len != groups * 16 || groups > PY_SSIZE_T_MAX / 128) {
        PyErr_Format(PyExc_ValueError, "mxfp4: %zd packed bytes for %zd groups of 16", packed.len, groups);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, groups * 32 * (bf16 ? 2 : 4));
    if (!out) goto done;
    const uint8_t *src = packed.buf, *scale = exponents.buf;
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < groups; g++) {
        const uint8_t *b = src + g * 16;
        if (bf16) {
            const uint16_t *v = mxfp4_bf16[scale[g]];
            uint16_t *o = (uint16_t *)dst + g * 32;
            for (int k = 0; k < 16; k++) { o[2 * k] = v[b[k] & 15]; o[2 * k + 1] = v[b[k] >> 4]; }
        } else {
            const float *v = mxfp4_value[scale[g]];
            float *o = (float *)dst + g * 32;
            for (int k = 0; k < 16; k++) { o[2 * k] = v[b[k] & 15]; o[2 * k + 1] = v[b[k] >> 4]; }
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&exponents);
    return out;
}

/* mxfp4_columns(packed, exponents, bf16, rows, first, count) -> bytes: of an expert's rows x groups (packed:
 * 16 bytes a group, exponents: a byte a group), the columns of groups [first, first + count), 32 a group,
 * each column its `rows` values in order (the expert transposed, as transformers keeps GptOss's experts). */
static PyObject *mxfp4_columns(PyObject *self, PyObject *args) {
    Py_buffer packed, exponents;
    int bf16;
    Py_ssize_t rows, first, count;
    if (!PyArg_ParseTuple(args, "y*y*pnnn", &packed, &exponents, &bf16, &rows, &first, &count))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t groups = rows > 0 ? exponents.len / rows : 0;
    if (rows <= 0 || exponents.len != rows * groups || packed.len != exponents.len * 16 || first < 0 ||
        count < 0 || first > groups || count > groups - first || rows > PY_SSIZE_T_MAX / 128 / (count ? count : 1)) {
        PyErr_Format(PyExc_ValueError, "mxfp4_columns: %zd packed bytes, %zd exponents, %zd rows, groups %zd + %zd",
                     packed.len, exponents.len, rows, first, count);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, count * 32 * rows * (bf16 ? 2 : 4));
    if (!out) goto done;
    const uint8_t *src = packed.buf, *scale = exponents.buf;
    char *dst = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < count; g++) {
        for (Py_ssize_t r = 0; r < rows; r++) {  /* column g * 32 + k's value of row r at (g * 32 + k) * rows + r */
            Py_ssize_t at = r * groups + first + g;
            const uint8_t *b = src + at * 16;
            Py_ssize_t column = g * 32 * rows + r;
            if (bf16) {
                const uint16_t *v = mxfp4_bf16[scale[at]];
                uint16_t *o = (uint16_t *)dst + column;
                for (int k = 0; k < 16; k++) { o[2 * k * rows] = v[b[k] & 15]; o[(2 * k + 1) * rows] = v[b[k] >> 4]; }
            } else {
                const float *v = mxfp4_value[scale[at]];
                float *o = (float *)dst + column;
                for (int k = 0; k < 16; k++) { o[2 * k * rows] = v[b[k] & 15]; o[(2 * k + 1) * rows] = v[b[k] >> 4]; }
            }
        }
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&exponents);
    return out;
}

static PyMethodDef methods[] = {
    {"fp8_block", fp8_block, METH_VARARGS, "FP8 weight rows times their block scales, as bfloat16 or float32 bytes."},
    {"mxfp4", mxfp4, METH_VARARGS, "MXFP4 groups times their powers of two, as bfloat16 or float32 bytes."},
    {"mxfp4_columns", mxfp4_columns, METH_VARARGS, "Columns of an MXFP4 expert, dequantized and transposed."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dequant", NULL, -1, methods};

PyMODINIT_FUNC PyInit__dequant(void) {
    for (int s = 0; s < 256; s++)
        for (int n = 0; n < 16; n++) {
            mxfp4_value[s][n] = ldexpf(E2M1[n], s - 127);
            mxfp4_bf16[s][n] = to_bfloat16(mxfp4_value[s][n]);
        }
    return PyModule_Create(&module);
}
