/* The bounds check of pickle_scan.py, in C: a rank file at world size 1024 holds a pickle of ~50 MB,
 * which the Python version walks in seconds and this in milliseconds. Same accepted inputs, same
 * messages; tests/read/primitives/test_pickle_scan.py holds the two to that. It builds nothing and calls nothing. */
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


/* ---------------------------------------------------------------------------------------------------
 * skim: a rank file's pickle without its global shard metadata (see skim.py for what and why).
 *
 * Every ShardedTensorMetadata's `shards_metadata` list (W entries in every one of W files) is cut out of
 * the opcode stream and replaced by a global naming a placeholder, so the unpickler never builds it; the
 * sharding spec's `placements` list of the same devices is cut too. Each shard list's opcodes are reduced
 * to a normal form that does not depend on where in the file the list is: atoms it takes from outside
 * (strings, numbers, globals) are written out in full, its own memo entries are numbered from 0. The form
 * is itself a pickle of the list, and the caller's digest function gets it: a worker compares digests
 * with the plan's, the planner decodes one list per distinct digest. Memo entries a list defines that the
 * rest of the pickle uses again are inlined when they are atoms, else replaced by a second placeholder
 * that the caller checks nothing kept. The rest of the pickle is copied, its memo renumbered from 0.
 * Anything outside the subset torch.save writes returns None: the caller then unpickles the whole file.
 * Nothing is built but byte buffers; nothing is called but the caller's digest function.
 * ------------------------------------------------------------------------------------------------- */

typedef struct { unsigned char *p; size_t len, cap; } Buf;

static int buf_add(Buf *b, const void *src, size_t n) {
    if (n == 0) return 0; /* memcpy from or to NULL is undefined even for 0 bytes (a pickle starting with PUT) */
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        unsigned char *p = PyMem_Realloc(b->p, cap);
        if (!p) { PyErr_NoMemory(); return -1; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

#define OWNER_UNSET -1
#define OWNER_OUTSIDE -2 /* a mutable object built outside every list */
#define OWNER_ATOM -3    /* an immutable atom: `val` is the offset of the opcode that made it */
#define OWNER_LIST_ATOM -4 /* the same, memoized inside a skimmed list */
#define MEMO_SLACK 64    /* torch.save numbers memo entries in order; a far larger index is not skimmed */
#define LOOKAHEAD 65536  /* bytes looked at to tell a list's last single item from what follows the list */
#define PLACEMENTS (1 << 30) /* the memo owner of a placements list's entries: elided, not digested */

/* The lists of a file skimmed before (see `skim`'s `reference`): each list's bytes, and what it took from
 * outside itself (a memo entry it reads back that was set before the list began). */
typedef struct {
    size_t raw, len;      /* its bytes, from its EMPTY_LIST to its end, in Ref.raw */
    int key;              /* 1: shards_metadata, 2: placements */
    size_t first, count;  /* its outside entries, in Ref.outs */
    PyObject *digest;     /* key 1: the digest its normal form got */
    /* the memo entries walking it sets, when they are `puts` consecutive ones from `lo` (as torch.save
     * numbers them) and every atom it memoizes lies inside it: each a byte in Ref.kinds from `kinds` (1: an
     * atom, at the offset from the list's start next in Ref.offsets from `offsets`; 0: the list's own) */
    int simple;
    uint32_t lo, puts;
    size_t kinds, offsets;
} RefList;

typedef struct {
    uint32_t index;       /* the memo entry */
    int list_owned;       /* 0: an atom (`atom`, `alen`: its bytes in Ref.atoms); 1: an entry of a cut list */
    size_t atom;
    uint32_t alen;
} RefOut;

typedef struct {
    Buf raw, atoms, kinds, offsets;
    RefList *lists;
    RefOut *outs;
    size_t nlists, caplists, nouts, capouts;
    size_t cap;           /* the memo capacity that file needed: another file of its save needs about as much */
} Ref;

typedef struct {
    const unsigned char *raw;
    long long n;
    int32_t *owner;
    uint32_t *val;
    uint32_t *renum; /* an entry's number in the output, where memo entries are numbered anew from 0 */
    uint32_t *alen;  /* an atom's length in bytes (its opcode and argument) */
    uint32_t *epoch; /* the list (numbered from 1) inside which the entry was set, 0 outside every list */
    uint32_t *seen;  /* the last list that read the entry back from outside itself (recorded once per list) */
    size_t cap, puts, kept;
    uint32_t list;   /* the list being walked, numbered from 1; 0 outside */
    Ref *build;      /* the reference being built from this file, or NULL */
    /* while building, the memo entries the list being walked sets (see RefList) */
    long long list_at;
    int list_simple;
    uint32_t list_lo, list_puts, list_atoms;
} Skim;

static unsigned char atom_ops[256]; /* opcodes that push an immutable value of their own: inlined by value */

static void init_atoms(void) {
    const unsigned char atoms[] = "cXVUTSJKMGNILFBC)\x8c\x8d\x88\x89\x8a\x8b\x8e";
    for (size_t i = 0; i < sizeof atoms - 1; i++) atom_ops[atoms[i]] = 1;
}

#define is_atom(op) (atom_ops[(unsigned char)(op)])

/* End of the opcode at `at` (its argument included), or -1 when it runs past the data or is unknown. */
static unsigned char fixed_len[256]; /* whole length of an opcode whose argument has a fixed size, else 0 */

static inline long long op_end(const Skim *s, long long at, long long *arg) {
    unsigned char op = s->raw[at];
    long long pos = at + 1;
    *arg = 0;
    if (fixed_len[op]) {
        if (at + fixed_len[op] > s->n) return -1;
        if (op == 'q' || op == 'h') *arg = s->raw[pos];
        else if (op == 'r' || op == 'j') *arg = read_int(s->raw + pos, 4, 0);
        return at + fixed_len[op];
    }
    int kind = kinds[op], width = widths[op], size = width < 0 ? -width : width;
    switch (kind) {
    case STOP: case NO_ARG: return pos;
    case MEMO_FIXED: case FIXED:
        if (pos + size > s->n) return -1;
        if (kind == MEMO_FIXED) *arg = size == 1 ? s->raw[pos] : read_int(s->raw + pos, size, 0);
        return pos + size;
    case COUNTED: case FRAME:
        if (pos + size > s->n) return -1;
        *arg = read_int(s->raw + pos, size, width < 0);
        pos += size;
        if (kind == COUNTED) {
            if (*arg < 0 || *arg > s->n - pos) return -1;
            pos += *arg;
        }
        return pos;
    case LINES: case MEMO_LINE:
        for (int line = 0; line < width; line++) {
            const unsigned char *nl = memchr(s->raw + pos, '\n', (size_t)(s->n - pos));
            if (!nl) return -1;
            pos = nl - s->raw + 1;
        }
        return pos;
    default: return -1;
    }
}

/* Room for memo entries [0, need): the columns grown (epoch and seen only while building a reference). */
static int memo_grow(Skim *s, size_t need) {
    if (need <= s->cap) return 0;
    size_t cap = s->cap ? s->cap : 1024;
    while (cap < need) cap *= 2;
#define GROW(column) do { \
        void *grown = PyMem_Realloc(s->column, cap * sizeof *s->column); \
        if (!grown) { PyErr_NoMemory(); return -1; } \
        s->column = grown; \
    } while (0)
    GROW(owner); GROW(val); GROW(renum); GROW(alen);
    if (s->build) { GROW(epoch); GROW(seen); }
#undef GROW
    for (size_t i = s->cap; i < cap; i++) s->owner[i] = OWNER_UNSET;
    if (s->build)
        for (size_t i = s->cap; i < cap; i++) s->epoch[i] = 0, s->seen[i] = 0;
    s->cap = cap;
    return 0;
}

static int memo_set(Skim *s, long long index, int32_t owner, uint32_t val) {
    if (index < 0 || (size_t)index > s->puts + MEMO_SLACK) return 1;
    if (memo_grow(s, (size_t)index + 1) < 0) return -1;
    s->owner[index] = owner;
    s->val[index] = val;
    if (owner == OWNER_ATOM || owner == OWNER_LIST_ATOM) {
        long long arg;
        s->alen[index] = (uint32_t)(op_end(s, val, &arg) - val);
    }
    if (owner == OWNER_ATOM || owner == OWNER_OUTSIDE) s->renum[index] = (uint32_t)s->kept++;
    s->puts++;
    if (s->build) {
        s->epoch[index] = s->list;
        if (s->list && s->list_simple) { /* what RefList keeps to set these entries again without walking */
            int atom = owner == OWNER_LIST_ATOM;
            uint32_t offset = (uint32_t)(val - s->list_at);
            if (s->list_puts == 0) s->list_lo = (uint32_t)index;
            if ((uint32_t)index != s->list_lo + s->list_puts || (atom && (long long)val < s->list_at)) {
                s->list_simple = 0; /* walked again when matched: what it recorded so far is dropped */
                s->build->kinds.len -= s->list_puts;
                s->build->offsets.len -= s->list_atoms * sizeof offset;
            } else {
                unsigned char kind = (unsigned char)atom;
                if (buf_add(&s->build->kinds, &kind, 1) < 0 ||
                    (atom && buf_add(&s->build->offsets, &offset, sizeof offset) < 0)) return -1;
                s->list_puts++;
                s->list_atoms += (uint32_t)atom;
            }
        }
    }
    return 0;
}

/* What walking a simple reference list (RefList) at `at` sets, without walking it: the same entries, the
 * same owners and values, since its bytes are the same. 1 where memo_set would give up. */
static int memo_set_again(Skim *s, const Ref *r, const RefList *l, long long at, int span) {
    if ((size_t)l->lo > s->puts + MEMO_SLACK) return 1;
    if (memo_grow(s, (size_t)l->lo + l->puts) < 0) return -1;
    const unsigned char *kinds = r->kinds.p + l->kinds;
    const unsigned char *offsets = r->offsets.p + l->offsets;
    uint32_t rel = 0;
    for (uint32_t k = 0; k < l->puts; k++) {
        uint32_t index = l->lo + k;
        if (kinds[k]) {
            uint32_t offset;
            memcpy(&offset, offsets, sizeof offset);
            offsets += sizeof offset;
            long long arg, a = at + offset;
            s->owner[index] = OWNER_LIST_ATOM;
            s->val[index] = (uint32_t)a;
            s->alen[index] = (uint32_t)(op_end(s, a, &arg) - a);
        } else {
            s->owner[index] = span;
            s->val[index] = rel++;
        }
    }
    s->puts += l->puts;
    return 0;
}

static int32_t memo_owner(const Skim *s, long long index) {
    return index >= 0 && (size_t)index < s->cap ? s->owner[index] : OWNER_UNSET;
}

/* Notes, for the reference being built, that the list being walked reads memo entry `index` back from
 * outside itself (once per list): what another file's same bytes must find there to mean the same. */
static int note_outside(Skim *s, long long index, int32_t owner) {
    if (!s->build || s->epoch[index] == s->list || s->seen[index] == s->list) return 0;
    s->seen[index] = s->list;
    Ref *r = s->build;
    if (r->nouts == r->capouts) {
        size_t cap = r->capouts ? 2 * r->capouts : 64;
        RefOut *grown = PyMem_Realloc(r->outs, cap * sizeof *grown);
        if (!grown) { PyErr_NoMemory(); return -1; }
        r->outs = grown;
        r->capouts = cap;
    }
    RefOut *o = &r->outs[r->nouts++];
    o->index = (uint32_t)index;
    o->list_owned = owner >= 0;
    o->atom = r->atoms.len;
    o->alen = owner >= 0 ? 0 : s->alen[index];
    return owner >= 0 ? 0 : buf_add(&r->atoms, s->raw + s->val[index], o->alen);
}

/* 1 when the atom at `at` is the string "shards_metadata" (ShardedTensorMetadata's list of every rank's
 * shard), 2 for "placements" (ChunkShardingSpec's list of every rank's device), else 0. */
static int list_key(const Skim *s, long long at) {
    static const char *keys[] = {"shards_metadata", "placements"};
    unsigned char op = s->raw[at];
    long long start = op == 'X' ? at + 5 : op == 0x8c ? at + 2 : op == 0x8d ? at + 9 : -1, arg;
    long long len = op_end(s, at, &arg) - start;
    for (int k = 0; k < 2 && start > 0; k++)
        if (len == (long long)strlen(keys[k]) && memcmp(s->raw + start, keys[k], (size_t)len) == 0) return k + 1;
    return 0;
}

/* Stack effect of an opcode: items popped (below any mark) and pushed; `target`: it also changes the item
 * under what it pops (APPEND, BUILD, SETITEM); `to_mark`: it pops back to the last mark first. */
typedef struct { unsigned char pops, pushes, target, to_mark, mark; } Effect;

static Effect effects[256];
static unsigned char has_effect[256];

static void init_effects(void) {
    const unsigned char mark[] = "(", to_mark_push[] = "tld\x91", to_mark_target[] = "eu\x90", to_mark[] = "1",
                        push[] = "]})hj2\x8f", none[] = "qr\x80", pop1_push[] = "\x85", pop2_push[] = "\x86R\x81",
                        pop3_push[] = "\x87\x92", pop1_target[] = "ab", pop2_target[] = "s", pop1[] = "0";
#define SET(ops, ...) for (const unsigned char *p = ops; *p; p++) { effects[*p] = (Effect){__VA_ARGS__}; has_effect[*p] = 1; }
    SET(mark, .mark = 1);
    SET(to_mark_push, .to_mark = 1, .pushes = 1);
    SET(to_mark_target, .to_mark = 1, .target = 1);
    SET(to_mark, .to_mark = 1);
    SET(push, .pushes = 1);
    SET(none, .pops = 0);
    SET(pop1_push, .pops = 1, .pushes = 1);
    SET(pop2_push, .pops = 2, .pushes = 1);
    SET(pop3_push, .pops = 3, .pushes = 1);
    SET(pop1_target, .pops = 1, .target = 1);
    SET(pop2_target, .pops = 2, .target = 1);
    SET(pop1, .pops = 1);
#undef SET
    for (int op = 0; op < 256; op++) {
        if (atom_ops[op]) { effects[op] = (Effect){.pushes = 1}; has_effect[op] = 1; }
        if (kinds[op] == NO_ARG || kinds[op] == STOP) fixed_len[op] = 1;
        if (kinds[op] == FIXED || kinds[op] == MEMO_FIXED) fixed_len[op] = (unsigned char)(1 + widths[op]);
    }
    /* left out (no effect: not skimmed): persistent ids, OBJ/INST, extensions, text memo, protocol 4 */
}

#define MAX_MARKS 256

/* BINPUT/BINGET (`small`) or LONG_BINPUT/LONG_BINGET (`large`) of an entry's output number */
static int emit_memo(Buf *out, unsigned char small, unsigned char large, uint32_t index) {
    unsigned char op[5] = {index < 256 ? small : large, (unsigned char)index, (unsigned char)(index >> 8),
                           (unsigned char)(index >> 16), (unsigned char)(index >> 24)};
    return buf_add(out, op, index < 256 ? 2 : 5);
}

/* LONG_BINPUT/LONG_BINGET of a list's own memo entry, numbered from 0 within the list: the normal form
 * numbers them the same way in every file, and stays a pickle (read/primitives/skim.py decodes it) */
static int emit_long(Buf *out, unsigned char op, uint32_t index) {
    unsigned char code[5] = {op, (unsigned char)index, (unsigned char)(index >> 8), (unsigned char)(index >> 16),
                             (unsigned char)(index >> 24)};
    return buf_add(out, code, 5);
}

/* Walks one part of a list: a MARK ... APPENDS batch (`batch`), or a single item ended by APPEND. With
 * `norm` it appends the normal form to `out` and records memo entries for list `span`; without, it only
 * tells where the part ends. Returns its end, 0 when what starts at `at` is not such a part, -1 to give up
 * on skimming (-2 with a Python error set). */
static long long walk(Skim *s, long long at, int batch, int span, uint32_t *rel, Buf *out) {
    long long marks[MAX_MARKS];
    int nmarks = 0;
    long long depth = 0, top_atom = -1, pos = at, run = at; /* run: start of opcodes not yet copied to out */
    for (;;) {
        if (pos >= s->n) return -1;
        if (!out && pos - at > LOOKAHEAD) return -1;
        unsigned char op = s->raw[pos];
        long long arg, end = op_end(s, pos, &arg);
        if (end < 0 || !has_effect[op]) return -1;
        Effect e = effects[op];
        if (e.mark) {
            if (nmarks == MAX_MARKS) return -1;
            marks[nmarks++] = depth;
        } else {
            /* depth counts the items above the list; a mark's depth is a floor nothing may pop through */
            if (e.to_mark) {
                if (!nmarks) return batch ? -1 : 0;
                depth = marks[--nmarks];
            } else {
                if (depth - e.pops < (nmarks ? marks[nmarks - 1] : 0)) return batch ? -1 : 0;
                depth -= e.pops;
            }
            if (e.target && depth == 0) {
                /* it changes the list itself: the end of this part if it is the APPENDS closing the batch's
                 * mark, or the APPEND of a single item; anything else is not a list this skims */
                if (nmarks || op != (batch ? 'e' : 'a')) return batch ? -1 : 0;
                if (out && buf_add(out, s->raw + run, (size_t)(end - run)) < 0) return -2;
                return end;
            }
            if (e.target && depth <= (nmarks ? marks[nmarks - 1] : 0)) return batch ? -1 : 0;
            depth += e.pushes;
        }
        if (batch && nmarks == 0) return -1; /* the batch's mark closed by something other than APPENDS */
        if (out && (op == 'q' || op == 'r' || op == 'h' || op == 'j')) {
            /* memo opcodes are what the normal form changes: the run of opcodes before them goes out as is */
            if (buf_add(out, s->raw + run, (size_t)(pos - run)) < 0) return -2;
            run = end;
            int32_t owner;
            if (op == 'q' || op == 'r') {
                int r = top_atom >= 0 ? memo_set(s, arg, OWNER_LIST_ATOM, (uint32_t)top_atom)
                                      : memo_set(s, arg, span, *rel);
                if (r) return r < 0 ? -2 : -1;
                if (top_atom < 0 && emit_long(out, 'r', (*rel)++) < 0) return -2;
            } else if (op == 'h' || op == 'j') {
                owner = memo_owner(s, arg);
                if ((owner == OWNER_ATOM || owner == OWNER_LIST_ATOM || owner >= 0) && note_outside(s, arg, owner) < 0)
                    return -2;
                if (owner == OWNER_ATOM || owner == OWNER_LIST_ATOM) {
                    long long a = s->val[arg];
                    if (buf_add(out, s->raw + a, s->alen[arg]) < 0) return -2;
                    top_atom = a;
                } else if (owner == span || (owner >= 0 && span == PLACEMENTS)) {
                    if (emit_long(out, 'j', s->val[arg]) < 0) return -2;
                    top_atom = -1;
                } else {
                    return -1; /* a mutable object from outside this list */
                }
            }
        } else {
            top_atom = is_atom(op) ? pos : -1;
        }
        pos = end;
    }
}

/* The list starting with EMPTY_LIST at `at`: its normal form goes to `out`; returns its end, or -1/-2. */
static long long skim_list(Skim *s, long long at, int span, Buf *out) {
    uint32_t rel = 0;
    long long arg, pos = at + 1;
    unsigned char empty = ']';
    if (buf_add(out, &empty, 1) < 0) return -2;
    if (pos < s->n && (s->raw[pos] == 'q' || s->raw[pos] == 'r')) {
        long long end = op_end(s, pos, &arg);
        if (end < 0) return -1;
        int r = memo_set(s, arg, span, rel);
        if (r) return r < 0 ? -2 : -1;
        if (emit_long(out, 'r', rel++) < 0) return -2;
        pos = end;
    }
    for (;;) {
        if (pos >= s->n) return -1;
        int batch = s->raw[pos] == '(';
        if (!batch) {
            long long end = walk(s, pos, 0, span, &rel, NULL);
            if (end == 0) return pos; /* what follows is not an item of the list: it has ended */
            if (end < 0) return end;
        }
        long long end = walk(s, pos, batch, span, &rel, out);
        if (end <= 0) return end < 0 ? end : -1;
        pos = end;
    }
}

#define REF_CAPSULE "shardstore._pickle_scan.reference"

static void ref_free(Ref *r) {
    if (!r) return;
    for (size_t i = 0; i < r->nlists; i++) Py_XDECREF(r->lists[i].digest);
    PyMem_Free(r->raw.p);
    PyMem_Free(r->atoms.p);
    PyMem_Free(r->kinds.p);
    PyMem_Free(r->offsets.p);
    PyMem_Free(r->lists);
    PyMem_Free(r->outs);
    PyMem_Free(r);
}

static void ref_destroy(PyObject *capsule) { ref_free(PyCapsule_GetPointer(capsule, REF_CAPSULE)); }

/* Adds the list at [at, stop) just skimmed (its outside entries are the ones noted since `first`). */
static int ref_add_list(Skim *s, long long at, long long stop, int key, size_t first, PyObject *digest) {
    Ref *r = s->build;
    if (r->nlists == r->caplists) {
        size_t cap = r->caplists ? 2 * r->caplists : 64;
        RefList *grown = PyMem_Realloc(r->lists, cap * sizeof *grown);
        if (!grown) { PyErr_NoMemory(); return -1; }
        r->lists = grown;
        r->caplists = cap;
    }
    RefList *l = &r->lists[r->nlists];
    *l = (RefList){r->raw.len, (size_t)(stop - at), key, first, r->nouts - first, Py_XNewRef(digest),
                   s->list_simple, s->list_lo, s->list_puts, r->kinds.len - s->list_puts,
                   r->offsets.len - s->list_atoms * sizeof(uint32_t)};
    r->nlists++;
    return buf_add(&r->raw, s->raw + at, (size_t)(stop - at));
}

/* The list at `at` if it is the reference's list `l`: the same bytes, reading back from outside itself
 * memo entries that hold the same atoms (or, for a placements list, entries of cut lists), and ending
 * where that list ended. Then it has the normal form, so the digest, of that list, and walking it would
 * make the memo entries `replay` makes. Returns its end, or 0 when it is not (it is then walked). */
static long long matches(Skim *s, const Ref *r, const RefList *l, long long at, int span) {
    long long stop = at + (long long)l->len;
    if (stop >= s->n || memcmp(s->raw + at, r->raw.p + l->raw, l->len) != 0) return 0;
    for (size_t i = l->first; i < l->first + l->count; i++) {
        const RefOut *o = &r->outs[i];
        int32_t owner = memo_owner(s, o->index);
        if (o->list_owned ? owner < 0
                          : (owner != OWNER_ATOM && owner != OWNER_LIST_ATOM) || s->alen[o->index] != o->alen ||
                                memcmp(s->raw + s->val[o->index], r->atoms.p + o->atom, o->alen) != 0)
            return 0;
    }
    uint32_t rel = 0;
    if (s->raw[stop] == '(' || walk(s, stop, 0, span, &rel, NULL) != 0) return 0; /* it goes on */
    return stop;
}

/* The memo entries walking the list at [at, stop) makes (see `walk`), without its normal form: -1 to give
 * up on skimming where walking it would, -2 with a Python error set. */
static int replay(Skim *s, long long at, long long stop, int span) {
    uint32_t rel = 0;
    long long top = -1, pos = at + 1, arg;
    while (pos < stop) {
        unsigned char op = s->raw[pos];
        long long end = op_end(s, pos, &arg);
        if (end < 0 || end > stop) return -1;
        if (op == 'q' || op == 'r') {
            int r = top >= 0 ? memo_set(s, arg, OWNER_LIST_ATOM, (uint32_t)top) : memo_set(s, arg, span, rel++);
            if (r) return r < 0 ? -2 : -1;
        } else if (op == 'h' || op == 'j') {
            int32_t owner = memo_owner(s, arg);
            top = owner == OWNER_ATOM || owner == OWNER_LIST_ATOM ? (long long)s->val[arg] : -1;
        } else {
            top = is_atom(op) ? pos : -1;
        }
        pos = end;
    }
    return 0;
}

static int emit_global(Buf *out, PyObject *module, const char *name) {
    Py_ssize_t len;
    const char *m = PyUnicode_AsUTF8AndSize(module, &len);
    if (!m) return -1;
    unsigned char c = 'c', nl = '\n';
    if (buf_add(out, &c, 1) < 0 || buf_add(out, m, (size_t)len) < 0 || buf_add(out, &nl, 1) < 0 ||
        buf_add(out, name, strlen(name)) < 0 || buf_add(out, &nl, 1) < 0) return -1;
    return 0;
}

static PyObject *skim(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *module, *digest, *reference = Py_None, *result = NULL, *digests = NULL;
    if (!PyArg_ParseTuple(args, "y*UO|O", &view, &module, &digest, &reference)) return NULL;
    Skim s = {.raw = view.buf, .n = view.len};
    Buf out = {0}, norm = {0};
    Ref *ref = NULL;
    long long pos = 0, copied = 0, top_atom = -1;
    size_t lists = 0, matched = 0;
    int spans = 0, key, give_up = s.n >= UINT32_MAX; /* offsets are kept in 32 bits */
    if (reference != Py_None && !(ref = PyCapsule_GetPointer(reference, REF_CAPSULE))) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (!ref) {
        if (!(s.build = PyMem_Realloc(NULL, sizeof *s.build))) {
            PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        memset(s.build, 0, sizeof *s.build);
    }
    if (!(digests = PyList_New(0))) goto done;
    if (ref && memo_grow(&s, ref->cap) < 0) goto done; /* at once, not doubling through copies */
    while (!give_up) {
        if (pos >= s.n) { give_up = 1; break; }
        unsigned char op = s.raw[pos];
        long long arg, end = op_end(&s, pos, &arg);
        if (end < 0 || op == 'g' || op == 'p' || op == 0x94 || op == 0x95) { give_up = 1; break; }
        if (op == '.') {
            if (buf_add(&out, s.raw + copied, (size_t)(end - copied)) < 0) goto done;
            break;
        }
        if (op == 'q' || op == 'r') {
            int r = memo_set(&s, arg, top_atom >= 0 ? OWNER_ATOM : OWNER_OUTSIDE, (uint32_t)(top_atom >= 0 ? top_atom : 0));
            if (r < 0) goto done;
            if (r) { give_up = 1; break; }
            if (buf_add(&out, s.raw + copied, (size_t)(pos - copied)) < 0 || emit_memo(&out, 'q', 'r', s.renum[arg]) < 0)
                goto done;
            copied = end;
        } else if (op == 'h' || op == 'j') {
            int32_t owner = memo_owner(&s, arg);
            if (owner == OWNER_UNSET) { give_up = 1; break; }
            top_atom = owner == OWNER_ATOM || owner == OWNER_LIST_ATOM ? (long long)s.val[arg] : -1;
            if (buf_add(&out, s.raw + copied, (size_t)(pos - copied)) < 0) goto done;
            copied = end;
            if (owner == OWNER_ATOM || owner == OWNER_OUTSIDE) {
                if (emit_memo(&out, 'h', 'j', s.renum[arg]) < 0) goto done;
            } else if (owner == OWNER_LIST_ATOM) { /* memoized inside a cut list: written out again */
                if (buf_add(&out, s.raw + top_atom, s.alen[arg]) < 0) goto done;
            } else if (emit_global(&out, module, "ref") < 0) { /* anything else made inside a cut list */
                goto done;
            }
        } else if (op == ']' && top_atom >= 0 && (key = list_key(&s, top_atom))) {
            int span = key == 1 ? spans : PLACEMENTS;
            const RefList *same = ref && lists < ref->nlists && ref->lists[lists].key == key ? &ref->lists[lists] : NULL;
            long long stop = same ? matches(&s, ref, same, pos, span) : 0;
            size_t first = s.build ? s.build->nouts : 0;
            PyObject *text = NULL;
            s.list = (uint32_t)++lists;
            s.list_at = pos, s.list_simple = 1, s.list_lo = s.list_puts = s.list_atoms = 0;
            if (stop > 0) { /* the reference's list: its digest, and the memo entries walking it would make */
                int r = same->simple ? memo_set_again(&s, ref, same, pos, span) : replay(&s, pos, stop, span);
                if (same->simple && r) r = r < 0 ? -2 : -1;
                if (r == -2) goto done;
                if (r < 0) { give_up = 1; break; }
                text = Py_XNewRef(same->digest);
                matched++;
            } else {
                norm.len = 0;
                stop = skim_list(&s, pos, span, &norm);
                if (stop == -2) goto done;
                if (stop < 0) { give_up = 1; break; }
                if (key == 1 && !(text = PyObject_CallFunction(digest, "y#", (const char *)norm.p, (Py_ssize_t)norm.len)))
                    goto done;
                if (s.build && ref_add_list(&s, pos, stop, key, first, text) < 0) { Py_XDECREF(text); goto done; }
            }
            s.list = 0;
            char name[32] = "ref";
            if (key == 1) {
                int r = PyList_Append(digests, text);
                Py_DECREF(text);
                if (r < 0) goto done;
                snprintf(name, sizeof name, "span%d", spans++);
            }
            if (buf_add(&out, s.raw + copied, (size_t)(pos - copied)) < 0 || emit_global(&out, module, name) < 0)
                goto done;
            copied = pos = stop;
            top_atom = -1;
            if (pos < s.n && (s.raw[pos] == 'q' || s.raw[pos] == 'r')) {
                /* memoised after its items: the entry is the cut list's own, so a GET of it elsewhere reads
                 * back the elided record (which the caller checks nothing kept), never the placeholder */
                long long put_end = op_end(&s, pos, &arg);
                if (put_end < 0) { give_up = 1; break; }
                int r = memo_set(&s, arg, key == 1 ? spans - 1 : PLACEMENTS, 0);
                if (r < 0) goto done;
                if (r) { give_up = 1; break; }
                copied = pos = put_end;
            }
            continue;
        } else {
            top_atom = is_atom(op) ? pos : -1;
        }
        pos = end;
    }
    if (give_up) {
        result = Py_NewRef(Py_None);
    } else {
        /* (the pickle, the digests, this file's lists as a reference for other files when none was given,
         * how many lists were the given reference's, how many lists were cut) */
        PyObject *bytes = PyBytes_FromStringAndSize((const char *)out.p, (Py_ssize_t)out.len), *built = NULL;
        if (bytes && s.build) {
            s.build->cap = s.cap;
            if ((built = PyCapsule_New(s.build, REF_CAPSULE, ref_destroy))) s.build = NULL; /* the capsule owns it */
        } else if (bytes) {
            built = Py_NewRef(Py_None);
        }
        if (bytes && built) {
            result = Py_BuildValue("(NONnn)", bytes, digests, built, (Py_ssize_t)matched, (Py_ssize_t)lists);
        } else {
            Py_XDECREF(bytes);
        }
    }
done:
    ref_free(s.build);
    PyMem_Free(out.p);
    PyMem_Free(norm.p);
    PyMem_Free(s.owner);
    PyMem_Free(s.val);
    PyMem_Free(s.renum);
    PyMem_Free(s.alen);
    PyMem_Free(s.epoch);
    PyMem_Free(s.seen);
    Py_XDECREF(digests);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "Check a pickle's opcode stream; return its opcode count (see pickle_scan.py)."},
    {"skim", skim, METH_VARARGS, "A rank file's pickle without its global shard metadata (see skim.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pickle_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pickle_scan(void) {
    init_tables();
    init_atoms();
    init_effects();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    ScanError = PyErr_NewExceptionWithDoc("shardstore.read.primitives.pickle_scan.ScanError",
                                          "The pickle is malformed or hostile; the message says where.",
                                          PyExc_ValueError, NULL);
    if (!ScanError || PyModule_AddObjectRef(m, "ScanError", ScanError) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
