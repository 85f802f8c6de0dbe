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
    static const Py_ssize_t width[7] = {8, 8, 8, 4, 8, 8, 8};
    Py_buffer b[7];
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    for (; got < nargs; got++) {
        if (PyObject_GetBuffer(args[got], &b[got], got ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0)
            goto done;
        if (b[got].len % width[got]) {
            got++;
            PyErr_Format(PyExc_ValueError, "find: argument %zd is not an array of %zd-byte "
                         "items", got - 1, width[got - 1]);
            goto done;
        }
    }
    Py_ssize_t n = b[1].len / 8, nkeys = b[2].len / 8;
    Py_ssize_t nadded = nargs == 7 ? b[4].len / 8 : 0, ngone = nargs == 7 ? b[6].len / 8 : 0;
    if (b[0].len / 8 != n || b[3].len / 4 != nkeys || (nargs == 7 && b[5].len / 8 != nadded)) {
        PyErr_SetString(PyExc_ValueError, "find: out and query, keys and segs, added and "
                                          "added_segs must be of one length each");
        goto done;
    }
    uint8_t *out = b[0].buf;
    const uint8_t *query = b[1].buf, *keys = b[2].buf, *segs = b[3].buf;
    const uint8_t *added = nargs == 7 ? b[4].buf : NULL, *added_segs = nargs == 7 ? b[5].buf : NULL;
    const uint8_t *gone = nargs == 7 ? b[6].buf : NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t key = u64_at(query + 8 * j);
        int64_t seg = -1;
        Py_ssize_t i = find_sorted(keys, nkeys, key);
        if (i >= 0) seg = (int64_t)u32_at(segs + 4 * i);
        if (nadded && (i = find_sorted(added, nadded, key)) >= 0) {
            seg = (int64_t)u64_at(added_segs + 8 * i);
        } else if (ngone && find_sorted(gone, ngone, key) >= 0) {
            seg = -1;
        }
        memcpy(out + 8 * j, &seg, 8);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return result;
}
