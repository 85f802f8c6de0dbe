/* directory.c: Directory.lookup_many's probes in one call (sarp/directory.py; its numpy
 * `_find` passes are the reference).  A long query's lookups had been a dozen numpy
 * calls (about 8 µs for 333 hashes, twice that beside three Valkey nodes); here they
 * are one binary search per hash in each sorted array. */
#define PY_SSIZE_T_CLEAN
#include "native.h"

/* The index of `key` in sorted `keys[0..n)` (8-byte native integers), or -1: a
 * branchless lower bound (the compare picks the half, no jump to mispredict: most
 * hashes of a query are in no directory, so every probe's outcome is a coin toss). */
static Py_ssize_t find_sorted(const uint8_t *keys, Py_ssize_t n, uint64_t key) {
    if (n <= 0) return -1;
    const uint8_t *base = keys;
    for (Py_ssize_t len = n; len > 1;) {
        Py_ssize_t half = len / 2;
        base = u64_at(base + 8 * half) < key ? base + 8 * half : base;
        len -= half;
    }
    Py_ssize_t i = (base - keys) / 8 + (u64_at(base) < key);  /* the lower bound */
    return i < n && u64_at(keys + 8 * i) == key ? i : -1;
}

/* Directory.sorted_probe's (removed, keys, segs): the set of first hashes removed
 * since the arrays were merged, and the sorted arrays (uint64, uint32).  0, or -1
 * with an exception set (nothing taken). */
int take_sorted(SortedDir *d, PyObject *triple) {
    memset(d, 0, sizeof(*d));
    if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != 3
        || !PyAnySet_Check(PyTuple_GET_ITEM(triple, 0))) {
        PyErr_SetString(PyExc_TypeError, "the directory's sorted probe is (removed set, keys, "
                                         "segs)");
        return -1;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(triple, 1), &d->keys, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(triple, 2), &d->segs, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&d->keys);
        return -1;
    }
    d->n = d->keys.len / 8;
    if (d->keys.len % 8 || d->segs.len != 4 * d->n) {
        PyErr_Format(PyExc_ValueError, "the directory's arrays: %zd key bytes, %zd segment "
                     "bytes (uint64 and uint32, as many)", d->keys.len, d->segs.len);
        PyBuffer_Release(&d->keys);
        PyBuffer_Release(&d->segs);
        return -1;
    }
    d->removed = PyTuple_GET_ITEM(triple, 0);
    d->taken = 1;
    return 0;
}

void release_sorted(SortedDir *d) {
    if (!d->taken) return;
    PyBuffer_Release(&d->keys);
    PyBuffer_Release(&d->segs);
    d->taken = 0;
}

int sorted_lookup(const SortedDir *d, PyObject *key, uint64_t hash, uint64_t *seg) {
    int gone = PySet_Contains(d->removed, key);
    if (gone != 0) return gone < 0 ? -1 : 0;
    Py_ssize_t i = find_sorted(d->keys.buf, d->n, hash);
    if (i < 0) return 0;
    *seg = u32_at((const uint8_t *)d->segs.buf + 4 * i);
    return 1;
}

/* The buffers of find's and predict's arguments after their leading ones (find's
 * out): query, keys, segs[, added, added_segs, gone].  0, or -1 with an exception set
 * (none left taken). */
int take_probe(Probe *p, PyObject *const *args, Py_ssize_t nargs, const char *name) {
    static const Py_ssize_t width[6] = {8, 8, 4, 8, 8, 8};
    p->taken = 0;
    for (; p->taken < nargs; p->taken++) {
        Py_ssize_t i = p->taken;
        if (PyObject_GetBuffer(args[i], &p->b[i], PyBUF_SIMPLE) < 0) goto fail;
        if (p->b[i].len % width[i]) {
            p->taken++;
            PyErr_Format(PyExc_ValueError, "%s: argument %zd is not an array of %zd-byte "
                         "items", name, i, width[i]);
            goto fail;
        }
    }
    p->n = p->b[0].len / 8;
    p->nkeys = p->b[1].len / 8;
    p->nadded = nargs == 6 ? p->b[3].len / 8 : 0;
    p->ngone = nargs == 6 ? p->b[5].len / 8 : 0;
    if (p->b[2].len / 4 != p->nkeys || (nargs == 6 && p->b[4].len / 8 != p->nadded)) {
        PyErr_Format(PyExc_ValueError, "%s: keys and segs, added and added_segs must be of "
                     "one length each", name);
        goto fail;
    }
    return 0;
fail:
    for (Py_ssize_t i = 0; i < p->taken; i++) PyBuffer_Release(&p->b[i]);
    return -1;
}

void release_probe(Probe *p) {
    for (Py_ssize_t i = 0; i < p->taken; i++) PyBuffer_Release(&p->b[i]);
}

int64_t probe_hash(const Probe *p, uint64_t key) {
    int64_t seg = -1;
    Py_ssize_t i = find_sorted(p->b[1].buf, p->nkeys, key);
    if (i >= 0) seg = (int64_t)u32_at((const uint8_t *)p->b[2].buf + 4 * i);
    if (p->nadded && (i = find_sorted(p->b[3].buf, p->nadded, key)) >= 0) {
        seg = (int64_t)u64_at((const uint8_t *)p->b[4].buf + 8 * i);
    } else if (p->ngone && find_sorted(p->b[5].buf, p->ngone, key) >= 0) {
        seg = -1;
    }
    return seg;
}

static inline int64_t probe_at(const Probe *p, Py_ssize_t j) {
    return probe_hash(p, u64_at((const uint8_t *)p->b[0].buf + 8 * j));
}

Py_ssize_t predict_ids(const Probe *p, int64_t *ids) {
    Py_ssize_t cap = 64, count = 0;
    while (cap < 2 * p->n) cap *= 2;
    int64_t small[64], *seen = cap == 64 ? small : PyMem_Malloc((size_t)cap * sizeof(int64_t));
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(seen, 0xff, (size_t)cap * sizeof(int64_t));  /* -1: empty */
    for (Py_ssize_t j = 0; j < p->n; j++) {
        int64_t seg = probe_at(p, j);
        if (seg < 0) continue;
        size_t slot = ((uint64_t)seg * 0x9E3779B97F4A7C15ull) >> 32 & (size_t)(cap - 1);
        while (seen[slot] >= 0 && seen[slot] != seg) slot = (slot + 1) & (size_t)(cap - 1);
        if (seen[slot] == seg) continue;
        seen[slot] = seg;
        ids[count++] = seg;
    }
    if (seen != small) PyMem_Free(seen);
    return count;
}

/* find(out, query, keys, segs[, added, added_segs, gone]) -> None
 * out[j] = segs[i] where query[j] == keys[i], else -1; with the changes since the
 * arrays were merged, then added_segs[i] where query[j] == added[i], else -1 where
 * query[j] is in gone.  Native-endian buffers: out int64 (written), query uint64,
 * keys, added and gone sorted uint64, segs uint32, added_segs int64. */
PyObject *sarp_find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_FIND]++;
    if (nargs != 4 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "find(out, query, keys, segs[, added, added_segs, gone])");
        return NULL;
    }
    Py_buffer out;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_WRITABLE) < 0) return NULL;
    Probe p;
    if (take_probe(&p, args + 1, nargs - 1, "find") < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    if (out.len % 8 || out.len / 8 != p.n) {
        PyErr_SetString(PyExc_ValueError, "find: out and query must be of one length");
        goto done;
    }
    for (Py_ssize_t j = 0; j < p.n; j++) {
        int64_t seg = probe_at(&p, j);
        memcpy((uint8_t *)out.buf + 8 * j, &seg, 8);
    }
    result = Py_NewRef(Py_None);
done:
    release_probe(&p);
    PyBuffer_Release(&out);
    return result;
}

/* predict(query, keys, segs[, added, added_segs, gone]) -> [segment key, ...]
 * The segments find names for the query's hashes, each once, in the order the query
 * first names them, as the stores' keys (u64 big-endian bytes):
 * the records a match of the query may read, which a reader of a remote store asks
 * for in one round trip.  Seen ids are kept in an open-addressing set. */
PyObject *sarp_predict(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_FIND]++;
    if (nargs != 3 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "predict(query, keys, segs[, added, added_segs, gone])");
        return NULL;
    }
    Probe p;
    if (take_probe(&p, args, nargs, "predict") < 0) return NULL;
    PyObject *out = NULL;
    int64_t *ids = PyMem_Malloc((size_t)(p.n ? p.n : 1) * sizeof(int64_t));
    Py_ssize_t count = ids == NULL ? -1 : predict_ids(&p, ids);
    if (count < 0) {
        if (ids == NULL) PyErr_NoMemory();
        goto done;
    }
    out = PyList_New(count);
    for (Py_ssize_t k = 0; out != NULL && k < count; k++) {
        PyObject *key = be_key((uint64_t)ids[k]);
        if (key == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, k, key);
    }
done:
    PyMem_Free(ids);
    release_probe(&p);
    return out;
}
