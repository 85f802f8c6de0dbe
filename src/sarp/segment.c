/*
 * The C mirror of sarp/segment.py's heads_py (sarp._native; sarp/native.py loads it):
 * what a reader's replay of the log needs of many records, in one call.
 *
 * - heads (segment.heads_py): each record checked (native.h's record_layout: checksum,
 *   magic and version, sizes, no holder named twice) and, for each one that passes, its
 *   first hash and its holder ids.  A record that is None (its segment is gone) and one
 *   that fails a check come back as states, 0 and the negative BAD_* code; the Python
 *   caller checks a damaged one again to log the error that names the damage.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* heads(records) -> (firsts, states, counts, holder_ids) as bytes: per record a
 * little-endian u64 first hash (0 unless its state is 1), an int8 state (1 checked, 0
 * None, < 0 damaged) and an int64 count of holder ids; then every checked record's
 * holder ids (u16), in record order. */
PyObject *sarp_heads(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_HEADS]++;
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "heads(records)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "heads: records must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *firsts = PyBytes_FromStringAndSize(NULL, 8 * n);
    PyObject *states = PyBytes_FromStringAndSize(NULL, n);
    PyObject *counts = PyBytes_FromStringAndSize(NULL, 8 * n);
    uint16_t *ids = NULL;
    Py_ssize_t nids = 0, room = 0;
    PyObject *out = NULL;
    if (firsts == NULL || states == NULL || counts == NULL) goto done;
    uint8_t *first_at = (uint8_t *)PyBytes_AS_STRING(firsts);
    int8_t *state_at = (int8_t *)PyBytes_AS_STRING(states);
    uint8_t *count_at = (uint8_t *)PyBytes_AS_STRING(counts);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t first = 0;
        int64_t count = 0;
        int8_t state = 0;
        if (items[i] != Py_None) {
            Py_buffer rec;
            if (PyObject_GetBuffer(items[i], &rec, PyBUF_SIMPLE) < 0) goto done;
            const uint8_t *r = rec.buf;
            Layout L;
            int bad = record_layout(r, rec.len, &L);
            if (bad) {
                state = (int8_t)bad;
            } else {
                state = 1;
                first = L.n ? u64_at(r + HEADER_BYTES) : 0;
                count = L.nh;
                if (nids + L.nh > room) {
                    Py_ssize_t want = 2 * (nids + L.nh) + 64;
                    uint16_t *grown = realloc(ids, (size_t)want * sizeof(uint16_t));
                    if (grown == NULL) {
                        PyBuffer_Release(&rec);
                        PyErr_NoMemory();
                        goto done;
                    }
                    ids = grown;
                    room = want;
                }
                memcpy(ids + nids, r + L.holders_at, (size_t)(2 * L.nh));
                nids += L.nh;
            }
            PyBuffer_Release(&rec);
        }
        memcpy(first_at + 8 * i, &first, 8);
        state_at[i] = state;
        memcpy(count_at + 8 * i, &count, 8);
    }
    PyObject *held = PyBytes_FromStringAndSize((const char *)ids, 2 * nids);
    if (held != NULL) out = PyTuple_Pack(4, firsts, states, counts, held);
    Py_XDECREF(held);
done:
    free(ids);
    Py_XDECREF(firsts);
    Py_XDECREF(states);
    Py_XDECREF(counts);
    Py_DECREF(seq);
    return out;
}
