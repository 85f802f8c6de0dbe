/*
 * sarp._native: the match step's record check in C (see sarp/verify.py, `examine`).
 *
 * One call per segment step replaces some twenty Python operations: the record's
 * checksum (xxh3-64, from the vendored xxhash.h), its header and sizes, where it sits
 * (position and parent), how many leading hashes equal the query's, and each holder
 * row's leading run.  It builds nothing but the answer.  Anything it cannot vouch for
 * (a short record, a bad checksum, magic or size) comes back as a negative code, and
 * the Python caller re-examines the record to raise the error that names the damage.
 * The pure-Python `examine` is the reference: tests hold the two equal.
 *
 * Layout (segment.py): header 24 B (magic "SG", version u8, flags u8, n u16, nh u16,
 * start_pos u64, parent u64), hashes 8n, holder ids 2nh padded to 8, presence nh*n
 * padded to 8, meta 8*nh*n when flags & HAS_META, checksum 8.  Little-endian.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

#define ABI_VERSION 1
#define RECORD_VERSION 1
#define HEADER_BYTES 24
#define HAS_META 0x01
#define IS_ROOT 0x02

enum { BAD_SHORT = -1, BAD_CHECKSUM = -2, BAD_MAGIC = -3, BAD_SIZE = -4 };

static uint16_t u16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint64_t u64_at(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* examine(record, query_bytes, start, parent, has_parent)
 *   -> (same, any_run, holder_ids, runs) | None (not at this place) | negative int */
static PyObject *examine(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "examine(record, query_bytes, start, parent, has_parent)");
        return NULL;
    }
    long long start = PyLong_AsLongLong(args[2]);
    unsigned long long parent = PyLong_AsUnsignedLongLongMask(args[3]);
    int has_parent = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred() || has_parent < 0) return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return NULL;
    }
    Py_buffer rec, q;
    if (PyObject_GetBuffer(args[0], &rec, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &q, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&rec);
        return NULL;
    }
    PyObject *out = NULL;
    const uint8_t *r = rec.buf;
    Py_ssize_t size = rec.len;
    if (size < HEADER_BYTES + 8) { out = PyLong_FromLong(BAD_SHORT); goto done; }
    if (XXH3_64bits(r, (size_t)(size - 8)) != u64_at(r + size - 8)) {
        out = PyLong_FromLong(BAD_CHECKSUM);
        goto done;
    }
    if (r[0] != 'S' || r[1] != 'G' || r[2] != RECORD_VERSION) {
        out = PyLong_FromLong(BAD_MAGIC);
        goto done;
    }
    uint8_t flags = r[3];
    Py_ssize_t n = u16_at(r + 4), nh = u16_at(r + 6);
    Py_ssize_t holders_at = HEADER_BYTES + 8 * n;
    Py_ssize_t presence_at = holders_at + ((2 * nh + 7) & ~(Py_ssize_t)7);
    Py_ssize_t meta_at = presence_at + ((nh * n + 7) & ~(Py_ssize_t)7);
    if (meta_at + ((flags & HAS_META) ? 8 * nh * n : 0) + 8 != size) {
        out = PyLong_FromLong(BAD_SIZE);
        goto done;
    }
    /* at this place: the query's position and the block before it */
    int is_root = flags & IS_ROOT;
    if ((long long)u64_at(r + 8) != start
        || (is_root ? has_parent : (!has_parent || u64_at(r + 16) != parent))) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t m = q.len / 8 - (Py_ssize_t)start;
    if (m > n) m = n;
    if (m < 0) m = 0;
    const uint8_t *ours = r + HEADER_BYTES, *theirs = (const uint8_t *)q.buf + 8 * start;
    Py_ssize_t same = 0;
    if (memcmp(ours, theirs, (size_t)(8 * m)) == 0) {
        same = m;
    } else {
        while (memcmp(ours + 8 * same, theirs + 8 * same, 8) == 0) same++;
    }
    PyObject *ids = PyList_New(nh), *runs = PyList_New(nh);
    if (ids == NULL || runs == NULL) {
        Py_XDECREF(ids);
        Py_XDECREF(runs);
        goto done;
    }
    Py_ssize_t longest = 0;
    for (Py_ssize_t h = 0; h < nh; h++) {
        const uint8_t *row = r + presence_at + h * n;
        const uint8_t *gap = memchr(row, 0, (size_t)same);
        Py_ssize_t run = gap == NULL ? same : gap - row;
        if (run > longest) longest = run;
        PyObject *id = PyLong_FromLong(u16_at(r + holders_at + 2 * h));
        PyObject *length = PyLong_FromSsize_t(run);
        if (id == NULL || length == NULL) {
            Py_XDECREF(id);
            Py_XDECREF(length);
            Py_DECREF(ids);
            Py_DECREF(runs);
            goto done;
        }
        PyList_SET_ITEM(ids, h, id);
        PyList_SET_ITEM(runs, h, length);
    }
    /* blocks some holder holds: the longest row run, unless rows take turns */
    Py_ssize_t any_run = longest;
    if (longest < same) {
        for (;;) {
            int held = 0;
            for (Py_ssize_t h = 0; h < nh && !held; h++) held = r[presence_at + h * n + any_run];
            if (!held || ++any_run == same) break;
        }
    }
    out = Py_BuildValue("nnNN", same, any_run, ids, runs);
done:
    PyBuffer_Release(&rec);
    PyBuffer_Release(&q);
    return out;
}

static PyMethodDef methods[] = {
    {"examine", (PyCFunction)(void (*)(void))examine, METH_FASTCALL,
     "examine(record, query_bytes, start, parent, has_parent): see sarp.verify.examine"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sarp._native",
    "The match step's record check in C (sarp.verify.examine is the reference).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddIntConstant(mod, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
