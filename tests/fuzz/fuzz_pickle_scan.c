/* Fuzz harness for the C opcode scanner and skimmer (shardstore/read/primitives/_pickle_scan.c).
 *
 * Each input goes through `scan` and, whatever scan says, through `skim` (which must give up or return a
 * pickle, never read outside its input). The extension's source is included here, so the sanitizers see
 * every line of it; its buffers are counted (PyMem_Realloc/PyMem_Free are wrapped), and one still live
 * after a call is a leak, reported with abort().
 *
 * Two ways to build it (tests/fuzz/run.py does either):
 * - libFuzzer, for long runs by hand: clang -fsanitize=fuzzer,address,undefined ... (coverage-guided);
 * - a driver of its own (-DSTANDALONE), for CI with gcc: every seed file, then random mutations of them
 *   (flipped, inserted, deleted and spliced bytes) from a fixed seed for a given number of seconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static long live; /* the extension's buffers not yet freed */

static void *counted_realloc(void *p, size_t n) {
    void *q = PyMem_Realloc(p, n);
    if (q && !p) live++;
    return q;
}

static void counted_free(void *p) {
    if (p) live--;
    PyMem_Free(p);
}

#define PyMem_Realloc counted_realloc
#define PyMem_Free counted_free
#include "../../shardstore/read/primitives/_pickle_scan.c"
#undef PyMem_Realloc
#undef PyMem_Free

static PyObject *digest_fn; /* the digest callback skim calls with each list's normal form */

static PyObject *digest_len(PyObject *self, PyObject *form) {
    (void)self;
    if (!PyBytes_Check(form)) { PyErr_SetString(PyExc_TypeError, "form must be bytes"); return NULL; }
    return PyUnicode_FromFormat("%zd", PyBytes_GET_SIZE(form));
}

static PyMethodDef digest_def = {"digest", digest_len, METH_O, NULL};

static void init(void) {
    if (Py_IsInitialized()) return;
    Py_InitializeEx(0);
    init_tables();
    init_atoms();
    init_effects();
    ScanError = PyErr_NewException("fuzz.ScanError", PyExc_ValueError, NULL);
    digest_fn = PyCFunction_New(&digest_def, NULL);
    if (!ScanError || !digest_fn) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init();
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
    PyObject *module = PyUnicode_FromString("shardstore_elided_fuzz");
    PyObject *args = bytes && module ? PyTuple_Pack(3, bytes, module, digest_fn) : NULL;
    if (!args) abort();
    PyObject *count = scan(NULL, bytes);
    if (!count && !PyErr_ExceptionMatches(ScanError)) abort(); /* only ScanError, never another failure */
    Py_XDECREF(count);
    PyErr_Clear();
    PyObject *cut = skim(NULL, args);
    if (!cut) abort(); /* skim gives up with None; an exception means a bug (or no memory) */
    if (cut != Py_None && !(PyTuple_Check(cut) && PyTuple_GET_SIZE(cut) == 2)) abort();
    Py_DECREF(cut);
    Py_DECREF(args);
    Py_DECREF(module);
    Py_DECREF(bytes);
    if (live != 0) {
        fprintf(stderr, "leak: %ld buffer(s) of the extension still live after an input of %zu bytes\n", live, size);
        abort();
    }
    return 0;
}

#ifdef STANDALONE
static uint64_t state = 0x9E3779B97F4A7C15ULL;

static uint64_t next(void) { /* xorshift64*: the same mutations on every run */
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545F4914F6CDD1DULL;
}

static unsigned char *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(n ? (size_t)n : 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) { perror(path); exit(2); }
    fclose(f);
    *size = (size_t)n;
    return buf;
}

/* Usage: fuzz SECONDS SEED_FILE... ; prints how many inputs ran. Exit 0: no sanitizer report, no leak. */
int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s SECONDS SEED_FILE...\n", argv[0]); return 2; }
    double seconds = atof(argv[1]);
    int nseeds = argc - 2;
    unsigned char **seeds = malloc(sizeof *seeds * (size_t)nseeds);
    size_t *sizes = malloc(sizeof *sizes * (size_t)nseeds), biggest = 0;
    for (int i = 0; i < nseeds; i++) {
        seeds[i] = read_all(argv[i + 2], &sizes[i]);
        LLVMFuzzerTestOneInput(seeds[i], sizes[i]);
        if (sizes[i] > biggest) biggest = sizes[i];
    }
    unsigned char *buf = malloc(biggest + 64);
    long runs = nseeds;
    clock_t start = clock();
    while ((double)(clock() - start) / CLOCKS_PER_SEC < seconds) {
        int k = (int)(next() % (uint64_t)nseeds);
        size_t n = sizes[k];
        memcpy(buf, seeds[k], n);
        for (int edits = 1 + (int)(next() % 4); edits > 0 && n > 0; edits--) {
            size_t at = (size_t)(next() % n);
            switch (next() % 5) {
            case 0: case 1: buf[at] = (unsigned char)next(); break;          /* flip a byte */
            case 2: if (n < biggest + 64) { memmove(buf + at + 1, buf + at, n - at); buf[at] = (unsigned char)next(); n++; } break;
            case 3: memmove(buf + at, buf + at + 1, n - at - 1); n--; break; /* delete a byte */
            default: n = at; break;                                          /* truncate */
            }
        }
        LLVMFuzzerTestOneInput(buf, n);
        runs++;
    }
    printf("%ld inputs, no finding\n", runs);
    return 0;
}
#endif
