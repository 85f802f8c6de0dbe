/*
 * Mirror of sarp/tokenkeys.py: the keys of blocks keyed by their tokens.
 *
 * A block's local hash is xxh3-64 of its tokens as little-endian u32 under a seed
 * (the RFC's per-block hash, Dynamo's LocalBlockHash); its key chains the local hash
 * to the key before it: key = xxh3-64(local as 8 LE bytes, seed = key before).
 */
#define PY_SSIZE_T_CLEAN
#include "native.h"

/* token_keys(data, width, block_size, seed, parent) -> (keys, locals) as uint64 bytes.
 * width 4: data are tokens (u32, machine order), hashed block by block under `seed`;
 * width 8: data are local hashes already (block_size and seed unused).  Each key
 * chains on the one before, the first on `parent`. */
PyObject *sarp_token_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_TOKEN_KEYS]++;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "token_keys(data, width, block_size, seed, parent)");
        return NULL;
    }
    long width = PyLong_AsLong(args[1]);
    long block_size = PyLong_AsLong(args[2]);
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long key = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if ((width != 4 && width != 8) || (width == 4 && block_size <= 0)) {
        PyErr_SetString(PyExc_ValueError, "token_keys: width is 4 or 8, block_size > 0");
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t stride = width == 4 ? 4 * block_size : 8;
    Py_ssize_t n = buf.len / stride;
    PyObject *keys = PyBytes_FromStringAndSize(NULL, 8 * n);
    PyObject *locals = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (keys == NULL || locals == NULL) {
        Py_XDECREF(keys);
        Py_XDECREF(locals);
        PyBuffer_Release(&buf);
        return NULL;
    }
    uint64_t *k = (uint64_t *)PyBytes_AS_STRING(keys);
    uint64_t *l = (uint64_t *)PyBytes_AS_STRING(locals);
    const uint8_t *p = buf.buf;
    for (Py_ssize_t i = 0; i < n; i++, p += stride) {
        /* as all of sarp's C, for little-endian machines: the bytes are LE u32s */
        uint64_t local = width == 4 ? XXH3_64bits_withSeed(p, (size_t)stride, seed) : u64_at(p);
        key = XXH3_64bits_withSeed(&local, 8, key);
        l[i] = local;
        k[i] = key;
    }
    PyBuffer_Release(&buf);
    return Py_BuildValue("(NN)", keys, locals);
}
