/* Fuzz harness for the C opcode scanner and skimmer (shardstore/read/primitives/_pickle_scan.c).
 *
 * Each input goes through `scan` and, whatever scan says, through `skim` (which must give up or return a
 * pickle, never read outside its input). Skimming compares lists with a reference file's where one is
 * given, and must give the same result as without: each input is skimmed again with its own lists as the
 * reference (every list must then match), and in the driver's runs each mutant also with its seed's. The extension's source is included here, so the sanitizers see
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
static long kept; /* of those, the seeds' references the driver keeps */

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

/* the "digest" is the normal form itself, so comparing results compares the forms exactly */
static PyObject *digest_form(PyObject *self, PyObject *form) {
    (void)self;
    if (!PyBytes_Check(form)) { PyErr_SetString(PyExc_TypeError, "form must be bytes"); return NULL; }
    return Py_NewRef(form);
}

static PyMethodDef digest_def = {"digest", digest_form, METH_O, NULL};

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

static PyObject *seed_ref; /* the driver's: the reference of the seed this input was mutated from */

/* skim(data, module, digest[, reference]); aborts on anything but a result or None (giving up) */
static PyObject *skim_with(PyObject *bytes, PyObject *module, PyObject *reference) {
    PyObject *args = reference ? PyTuple_Pack(4, bytes, module, digest_fn, reference)
                               : PyTuple_Pack(3, bytes, module, digest_fn);
    if (!args) abort();
    PyObject *cut = skim(NULL, args);
    Py_DECREF(args);
    if (!cut) abort(); /* skim gives up with None; an exception means a bug (or no memory) */
    if (cut != Py_None && !(PyTuple_Check(cut) && PyTuple_GET_SIZE(cut) == 5)) abort();
    return cut;
}

/* The same pickle and digests, or both None; with `all_matched`, every list was the reference's. */
static void same_result(PyObject *a, PyObject *b, int all_matched) {
    if ((a == Py_None) != (b == Py_None)) abort();
    if (a == Py_None) return;
    for (int i = 0; i < 2; i++)
        if (PyObject_RichCompareBool(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i), Py_EQ) != 1) abort();
    if (all_matched && PyLong_AsSsize_t(PyTuple_GET_ITEM(b, 3)) != PyLong_AsSsize_t(PyTuple_GET_ITEM(b, 4))) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init();
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
    PyObject *module = PyUnicode_FromString("shardstore_elided_fuzz");
    if (!bytes || !module) abort();
    PyObject *count = scan(NULL, bytes);
    if (!count && !PyErr_ExceptionMatches(ScanError)) abort(); /* only ScanError, never another failure */
    Py_XDECREF(count);
    PyErr_Clear();
    PyObject *cut = skim_with(bytes, module, NULL);
    if (cut != Py_None && PyTuple_GET_ITEM(cut, 2) != Py_None) { /* its own lists as the reference */
        PyObject *again = skim_with(bytes, module, PyTuple_GET_ITEM(cut, 2));
        same_result(cut, again, 1);
        Py_DECREF(again);
    }
    if (seed_ref) {
        PyObject *other = skim_with(bytes, module, seed_ref);
        same_result(cut, other, 0);
        Py_DECREF(other);
    }
    Py_DECREF(cut);
    Py_DECREF(module);
    Py_DECREF(bytes);
    if (live != kept) {
        fprintf(stderr, "leak: %ld buffer(s) of the extension still live after an input of %zu bytes\n",
                live - kept, size);
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
    PyObject **refs = calloc((size_t)nseeds, sizeof *refs);
    for (int i = 0; i < nseeds; i++) {
        seeds[i] = read_all(argv[i + 2], &sizes[i]);
        LLVMFuzzerTestOneInput(seeds[i], sizes[i]);
        if (sizes[i] > biggest) biggest = sizes[i];
        PyObject *bytes = PyBytes_FromStringAndSize((const char *)seeds[i], (Py_ssize_t)sizes[i]);
        PyObject *module = PyUnicode_FromString("shardstore_elided_fuzz");
        PyObject *cut = bytes && module ? skim_with(bytes, module, NULL) : NULL;
        if (!cut) abort();
        refs[i] = Py_NewRef(cut == Py_None ? Py_None : PyTuple_GET_ITEM(cut, 2));
        Py_DECREF(cut), Py_DECREF(module), Py_DECREF(bytes);
        kept = live; /* the seeds' references stay live from here on */
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
        seed_ref = refs[k] == Py_None ? NULL : refs[k];
        LLVMFuzzerTestOneInput(buf, n);
        runs++;
    }
    printf("%ld inputs, no finding\n", runs);
    return 0;
}
#endif
