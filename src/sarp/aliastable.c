/*
 * AliasTable: a writer's `aliases` in memory, (model root, engine hash) -> token key
 * (sarp._native.AliasTable; its Python reference is aliastable.PyTable).  The store
 * keeps the table on disk as a dump and a journal of the changes since
 * (aliastable.py); lookups and changes are here, a batch's worth per call, with no
 * Python object per alias.
 *
 * Open addressing with linear probing over parallel arrays.  A delete leaves a
 * tombstone (an alias never moves to an earlier slot, which a sweep's scan would then
 * skip), and the table is rebuilt, doubled when the aliases need it, once aliases and
 * tombstones pass 70% of it.  An entry's home slot is its mixed hash's top bits, so
 * slots keep the hashes' order across a rebuild (slot i becomes 2i or 2i + 1 in a
 * doubled table) and a scan's cursor, a position in that order (a u64), goes on from
 * the same place after one.
 * Arguments are C-contiguous uint64 buffers (numpy arrays, bytes); `roots` may hold
 * one value for every hash.  Results are bytes (the caller wraps them in numpy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "native.h"

enum { LIVE = 1, GONE = 2 };

typedef struct {
    PyObject_HEAD
    uint64_t *roots, *hashes, *keys;
    uint8_t *used; /* 0 empty, LIVE, or GONE (a tombstone) */
    size_t mask, n, gone;
    int shift; /* 64 - log2(slots) */
} AliasTable;

static inline size_t at_slot(const AliasTable *t, uint64_t root, uint64_t hash) {
    uint64_t h = hash ^ (root * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ULL;
    h ^= h >> 29;
    return (size_t)(h >> t->shift);
}

static int at_alloc(AliasTable *t, size_t slots) {
    t->roots = PyMem_Calloc(slots, 8);
    t->hashes = PyMem_Calloc(slots, 8);
    t->keys = PyMem_Calloc(slots, 8);
    t->used = PyMem_Calloc(slots, 1);
    t->mask = slots - 1;
    t->n = t->gone = 0;
    t->shift = 64;
    while (slots > 1) slots >>= 1, t->shift--;
    if (t->roots && t->hashes && t->keys && t->used) return 0;
    PyMem_Free(t->roots), PyMem_Free(t->hashes), PyMem_Free(t->keys), PyMem_Free(t->used);
    t->roots = t->hashes = t->keys = NULL;
    t->used = NULL;
    return -1;
}

static void at_release(AliasTable *t) {
    PyMem_Free(t->roots), PyMem_Free(t->hashes), PyMem_Free(t->keys), PyMem_Free(t->used);
    t->roots = t->hashes = t->keys = NULL;
    t->used = NULL;
}

/* The slot of (root, hash), or where it would go (*found 0): the first tombstone of
 * its run, else the empty slot that ends it. */
static inline size_t at_find(const AliasTable *t, uint64_t root, uint64_t hash, int *found) {
    size_t i = at_slot(t, root, hash), free = SIZE_MAX;
    for (; t->used[i]; i = (i + 1) & t->mask) {
        if (t->used[i] == GONE) {
            if (free == SIZE_MAX) free = i;
        } else if (t->hashes[i] == hash && t->roots[i] == root) {
            *found = 1;
            return i;
        }
    }
    *found = 0;
    return free == SIZE_MAX ? i : free;
}

/* Room for `more` aliases with aliases and tombstones at most 70% of the slots (a
 * rebuild, doubled as the aliases need): 0, or -1 (MemoryError set; nothing changed). */
static int at_reserve(AliasTable *t, size_t more) {
    size_t slots = t->mask + 1;
    if ((t->n + t->gone + more) * 10 <= slots * 7) return 0;
    while ((t->n + more) * 10 > slots * 5) slots *= 2;  /* (half full at most, after) */
    AliasTable old = *t;
    if (at_alloc(t, slots) < 0) {
        *t = old;
        PyErr_NoMemory();
        return -1;
    }
    GilTurn turn = {0, 0}; /* (a rehash of a million slots takes milliseconds) */
    for (size_t i = 0; i <= old.mask; i++) {
        gil_turn(&turn);
        if (old.used[i] != LIVE) continue;
        int found;
        size_t j = at_find(t, old.roots[i], old.hashes[i], &found);
        t->used[j] = LIVE, t->roots[j] = old.roots[i], t->hashes[j] = old.hashes[i];
        t->keys[j] = old.keys[i];
        t->n++;
    }
    at_release(&old);
    return 0;
}

/* The buffers of (roots, hashes[, more]): roots one value or as many as the hashes. */
typedef struct {
    Py_buffer b[3];
    int taken;
    Py_ssize_t n, nroots;
} Cols;

static void cols_release(Cols *c) {
    for (int i = 0; i < c->taken; i++) PyBuffer_Release(&c->b[i]);
    c->taken = 0;
}

static int cols_take(Cols *c, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                     const char *usage) {
    c->taken = 0;
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s", usage);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (PyObject_GetBuffer(args[i], &c->b[i], PyBUF_C_CONTIGUOUS) < 0) goto fail;
        c->taken++;
        if (c->b[i].len % 8) {
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not whole uint64s", usage,
                         c->b[i].len);
            goto fail;
        }
    }
    c->nroots = c->b[0].len / 8;
    c->n = c->b[1].len / 8;
    if ((c->nroots != 1 && c->nroots != c->n) || (want == 3 && c->b[2].len / 8 != c->n)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd roots, %zd hashes%s", usage, c->nroots, c->n,
                     want == 3 ? " and keys of another length" : "");
        goto fail;
    }
    return 0;
fail:
    cols_release(c);
    return -1;
}

static inline uint64_t cols_root(const Cols *c, Py_ssize_t i) {
    return ((const uint64_t *)c->b[0].buf)[c->nroots == 1 ? 0 : i];
}

static PyObject *at_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (!PyArg_ParseTuple(args, ":AliasTable")) return NULL;
    sarp_calls[CALL_ALIAS_TABLE]++;
    AliasTable *t = (AliasTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    if (at_alloc(t, 1024) < 0) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void at_dealloc(AliasTable *t) {
    at_release(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* get(roots, hashes) -> (keys, found): uint64 and bool bytes, key 0 where not found. */
static PyObject *at_get(AliasTable *t, PyObject *const *args, Py_ssize_t nargs) {
    Cols c;
    if (cols_take(&c, args, nargs, 2, "get(roots, hashes)") < 0) return NULL;
    sarp_calls[CALL_ALIAS_TABLE]++;
    PyObject *keys = PyBytes_FromStringAndSize(NULL, c.n * 8);
    PyObject *found = PyBytes_FromStringAndSize(NULL, c.n);
    if (keys == NULL || found == NULL) {
        cols_release(&c);
        Py_XDECREF(keys);
        Py_XDECREF(found);
        return NULL;
    }
    uint64_t *k = (uint64_t *)PyBytes_AS_STRING(keys);
    uint8_t *f = (uint8_t *)PyBytes_AS_STRING(found);
    const uint64_t *h = c.b[1].buf;
    for (Py_ssize_t i = 0; i < c.n; i++) {
        int hit;
        size_t s = at_find(t, cols_root(&c, i), h[i], &hit);
        k[i] = hit ? t->keys[s] : 0;
        f[i] = (uint8_t)hit;
    }
    cols_release(&c);
    return Py_BuildValue("(NN)", keys, found);
}

/* put(roots, hashes, keys): set each alias (a later one of the same pair wins). */
static PyObject *at_put(AliasTable *t, PyObject *const *args, Py_ssize_t nargs) {
    Cols c;
    if (cols_take(&c, args, nargs, 3, "put(roots, hashes, keys)") < 0) return NULL;
    sarp_calls[CALL_ALIAS_TABLE]++;
    if (at_reserve(t, (size_t)c.n) < 0) {
        cols_release(&c);
        return NULL;
    }
    const uint64_t *h = c.b[1].buf, *k = c.b[2].buf;
    GilTurn turn = {0, 0};
    for (Py_ssize_t i = 0; i < c.n; i++) {
        gil_turn(&turn);
        uint64_t root = cols_root(&c, i);
        int hit;
        size_t s = at_find(t, root, h[i], &hit);
        if (!hit) {
            t->gone -= t->used[s] == GONE;
            t->used[s] = LIVE, t->roots[s] = root, t->hashes[s] = h[i], t->n++;
        }
        t->keys[s] = k[i];
    }
    cols_release(&c);
    Py_RETURN_NONE;
}

/* delete(roots, hashes) -> int: the aliases that were there and are gone. */
static PyObject *at_delete(AliasTable *t, PyObject *const *args, Py_ssize_t nargs) {
    Cols c;
    if (cols_take(&c, args, nargs, 2, "delete(roots, hashes)") < 0) return NULL;
    sarp_calls[CALL_ALIAS_TABLE]++;
    const uint64_t *h = c.b[1].buf;
    Py_ssize_t gone = 0;
    for (Py_ssize_t i = 0; i < c.n; i++) {
        int hit;
        size_t s = at_find(t, cols_root(&c, i), h[i], &hit);
        if (hit) t->used[s] = GONE, t->n--, t->gone++, gone++;
    }
    cols_release(&c);
    return PyLong_FromSsize_t(gone);
}

/* Up to `count` entries from slot `from` on, as three uint64 bytes, and the cursor of
 * the slot after them (-1: the table's end was reached). */
static PyObject *at_slots(AliasTable *t, size_t from, size_t count) {
    size_t slots = t->mask + 1, k = 0, i = from;
    size_t room = count < t->n ? count : t->n;
    PyObject *r = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)room * 8);
    PyObject *h = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)room * 8);
    PyObject *v = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)room * 8);
    if (r == NULL || h == NULL || v == NULL) goto fail;
    uint64_t *rp = (uint64_t *)PyBytes_AS_STRING(r), *hp = (uint64_t *)PyBytes_AS_STRING(h);
    uint64_t *vp = (uint64_t *)PyBytes_AS_STRING(v);
    for (; i < slots && k < room; i++) {
        if (t->used[i] != LIVE) continue;
        rp[k] = t->roots[i], hp[k] = t->hashes[i], vp[k] = t->keys[i];
        k++;
    }
    if (_PyBytes_Resize(&r, (Py_ssize_t)k * 8) < 0 || _PyBytes_Resize(&h, (Py_ssize_t)k * 8) < 0
        || _PyBytes_Resize(&v, (Py_ssize_t)k * 8) < 0)
        goto fail;
    for (; i < slots && t->used[i] != LIVE; i++) {}
    if (i == slots) return Py_BuildValue("(NNNi)", r, h, v, -1);
    return Py_BuildValue("(NNNK)", r, h, v, (unsigned long long)i << t->shift);
fail:
    Py_XDECREF(r);
    Py_XDECREF(h);
    Py_XDECREF(v);
    return NULL;
}

/* scan(cursor, count) -> (roots, hashes, keys, next): up to `count` aliases from the
 * cursor on (0: the start; a u64), and the cursor to go on from (-1: the end). */
static PyObject *at_scan(AliasTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "scan(cursor, count)");
        return NULL;
    }
    unsigned long long cursor = PyLong_AsUnsignedLongLong(args[0]);
    if (cursor == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "scan(cursor, %zd): count must be >= 0", count);
        return NULL;
    }
    sarp_calls[CALL_ALIAS_TABLE]++;
    return at_slots(t, t->shift == 64 ? 0 : (size_t)(cursor >> t->shift), (size_t)count);
}

/* items() -> (roots, hashes, keys): every alias, in slot order. */
static PyObject *at_items(AliasTable *t, PyObject *unused) {
    sarp_calls[CALL_ALIAS_TABLE]++;
    PyObject *got = at_slots(t, 0, t->n);
    if (got == NULL) return NULL;
    PyObject *out = PyTuple_GetSlice(got, 0, 3);
    Py_DECREF(got);
    return out;
}

/* clear(): no aliases (the memory goes back to a small table). */
static PyObject *at_clear(AliasTable *t, PyObject *unused) {
    AliasTable old = *t;
    if (at_alloc(t, 1024) < 0) {
        *t = old;
        return PyErr_NoMemory();
    }
    at_release(&old);
    Py_RETURN_NONE;
}

static Py_ssize_t at_len(AliasTable *t) { return (Py_ssize_t)t->n; }

static PyObject *at_nbytes(AliasTable *t, void *unused) {
    return PyLong_FromSize_t((t->mask + 1) * 25);
}

static PyMethodDef at_methods[] = {
    {"get", (PyCFunction)(void (*)(void))at_get, METH_FASTCALL,
     "get(roots, hashes) -> (keys, found): uint64 and bool bytes"},
    {"put", (PyCFunction)(void (*)(void))at_put, METH_FASTCALL,
     "put(roots, hashes, keys): set the aliases"},
    {"delete", (PyCFunction)(void (*)(void))at_delete, METH_FASTCALL,
     "delete(roots, hashes) -> int: the aliases gone"},
    {"scan", (PyCFunction)(void (*)(void))at_scan, METH_FASTCALL,
     "scan(cursor, count) -> (roots, hashes, keys, next): up to count aliases from a cursor"},
    {"items", (PyCFunction)at_items, METH_NOARGS, "items() -> (roots, hashes, keys)"},
    {"clear", (PyCFunction)at_clear, METH_NOARGS, "clear(): no aliases"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef at_getset[] = {
    {"nbytes", (getter)at_nbytes, NULL, "the table's memory, in bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods at_sequence = {.sq_length = (lenfunc)at_len};

PyTypeObject sarp_AliasTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sarp._native.AliasTable",
    .tp_doc = "AliasTable(): a writer's aliases in memory, (root, engine hash) -> token key "
              "(sarp.aliastable)",
    .tp_basicsize = sizeof(AliasTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = at_new,
    .tp_dealloc = (destructor)at_dealloc,
    .tp_methods = at_methods,
    .tp_getset = at_getset,
    .tp_as_sequence = &at_sequence,
};
