/*
 * liblmdb called from C, on py-lmdb's own transactions (sarp/lmdb_env.py finds them and
 * is the reference: its check holds every call here to py-lmdb's answer once per
 * process, and without it C goes through py-lmdb's methods as before).
 *
 * py-lmdb links the LMDB engines it bundles into its extension and exports their C
 * API under a prefix per engine (mdb09_ for 0.9, mdb10_ for 1.0); an environment is
 * bound to one of them.  lmdb_env.py hands the addresses of the calls below to
 * lmdb_bind once per engine, and a write transaction's MDB_txn address with its
 * engine for each commit; the packer (packing.c) then reads and writes `blocks` and
 * `segments` without a Python object or a GIL hand-over per call.  Only liblmdb's
 * public, stable calls are made; the GIL stays held throughout (the transaction is
 * the writer thread's, as py-lmdb's methods require).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

static RawApi engines[RAW_ENGINES];
static int bound[RAW_ENGINES];

/* lmdb_bind(engine, addresses) -> None: mdb_get, mdb_put, mdb_del, mdb_cursor_open,
 * mdb_cursor_close, mdb_cursor_get, mdb_cursor_put, mdb_cursor_del, mdb_txn_id,
 * mdb_txn_env, mdb_dbi_open, mdb_txn_begin, mdb_txn_abort and mdb_set_compare of one
 * engine, as integers. */
PyObject *sarp_lmdb_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != RAW_CALLS) {
        PyErr_SetString(PyExc_TypeError, "lmdb_bind(engine, (get, put, del, cursor_open, "
                                         "cursor_close, cursor_get, cursor_put, cursor_del, "
                                         "txn_id, txn_env, dbi_open, txn_begin, "
                                         "txn_abort, set_compare))");
        return NULL;
    }
    long engine = PyLong_AsLong(args[0]);
    if (engine == -1 && PyErr_Occurred()) return NULL;
    if (engine < 0 || engine >= RAW_ENGINES) {
        PyErr_Format(PyExc_ValueError, "lmdb_bind: engine %ld (0 to %d)", engine,
                     RAW_ENGINES - 1);
        return NULL;
    }
    void *at[RAW_CALLS];
    for (int i = 0; i < RAW_CALLS; i++) {
        at[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[1], i));
        if (at[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lmdb_bind: a null address");
            return NULL;
        }
    }
    RawApi *a = &engines[engine];
    memcpy(&a->get, &at[0], sizeof(void *));
    memcpy(&a->put, &at[1], sizeof(void *));
    memcpy(&a->del, &at[2], sizeof(void *));
    memcpy(&a->cursor_open, &at[3], sizeof(void *));
    memcpy(&a->cursor_close, &at[4], sizeof(void *));
    memcpy(&a->cursor_get, &at[5], sizeof(void *));
    memcpy(&a->cursor_put, &at[6], sizeof(void *));
    memcpy(&a->cursor_del, &at[7], sizeof(void *));
    memcpy(&a->txn_id, &at[8], sizeof(void *));
    memcpy(&a->txn_env, &at[9], sizeof(void *));
    memcpy(&a->dbi_open, &at[10], sizeof(void *));
    memcpy(&a->txn_begin, &at[11], sizeof(void *));
    memcpy(&a->txn_abort, &at[12], sizeof(void *));
    memcpy(&a->set_compare, &at[13], sizeof(void *));
    bound[engine] = 1;
    Py_RETURN_NONE;
}

const RawApi *raw_api(PyObject *engine_obj) {
    long engine = PyLong_AsLong(engine_obj);
    if (engine == -1 && PyErr_Occurred()) return NULL;
    if (engine < 0 || engine >= RAW_ENGINES || !bound[engine]) {
        PyErr_Format(PyExc_ValueError, "lmdb: engine %ld is not bound (lmdb_bind)", engine);
        return NULL;
    }
    return &engines[engine];
}

/* An engine bound and a transaction's address: 0, or -1 with an error. */
static int engine_txn(PyObject *engine_obj, PyObject *txn_obj, const RawApi **api, void **txn) {
    if ((*api = raw_api(engine_obj)) == NULL) return -1;
    *txn = PyLong_AsVoidPtr(txn_obj);
    if (*txn == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lmdb: a null transaction");
        return -1;
    }
    return 0;
}

/* (rc, dbi) of mdb_dbi_open(name), and (rc, value or None) of mdb_get(key): the
 * answers of the calls below, in a write transaction or a read one of their own. */
static PyObject *dbi_answer(const RawApi *api, void *txn, PyObject *name) {
    unsigned dbi = 0;
    int rc = api->dbi_open(txn, PyBytes_AS_STRING(name), 0, &dbi);
    return Py_BuildValue("(iI)", rc, dbi);
}

static PyObject *get_answer(const RawApi *api, void *txn, unsigned dbi, PyObject *key) {
    RawVal k = {(size_t)PyBytes_GET_SIZE(key), PyBytes_AS_STRING(key)}, v = {0, NULL};
    int rc = api->get(txn, dbi, &k, &v);
    if (rc) return Py_BuildValue("(iO)", rc, Py_None);
    return Py_BuildValue("(iy#)", rc, (const char *)v.data, (Py_ssize_t)v.size);
}

/* The order of 8-byte big-endian keys (`blocks` and `segments`) as unsigned integers:
 * memcmp's order, LMDB's default, with a load and a compare for its call; other sizes
 * as LMDB's own (mdb_cmp_memn).  Readers elsewhere keep the default: the same order. */
static int be64_cmp(const RawVal *a, const RawVal *b) {
    if (a->size == 8 && b->size == 8) {
        uint64_t x, y;
        memcpy(&x, a->data, 8);
        memcpy(&y, b->data, 8);
        x = __builtin_bswap64(x), y = __builtin_bswap64(y);
        return x < y ? -1 : x > y;
    }
    size_t n = a->size < b->size ? a->size : b->size;
    int d = memcmp(a->data, b->data, n);
    return d ? d : (a->size < b->size ? -1 : a->size > b->size);
}

int raw_of(PyObject *spec, RawTxn *out) {
    memset(out, 0, sizeof(*out));
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 7) {
        PyErr_SetString(PyExc_TypeError, "lmdb: (engine, txn, blocks, segments, meta and log "
                                         "dbi, raise_for)");
        return -1;
    }
    if (engine_txn(PyTuple_GET_ITEM(spec, 0), PyTuple_GET_ITEM(spec, 1), &out->api, &out->txn)
        < 0) {
        return -1;
    }
    unsigned *dbi[4] = {&out->blocks, &out->segments, &out->meta, &out->log};
    for (int i = 0; i < 4; i++) *dbi[i] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(spec, 2 + i));
    out->raise_for = PyTuple_GET_ITEM(spec, 6);
    if (PyErr_Occurred()) return -1;
    /* (a refusal, EINVAL for a dbi not open here, leaves LMDB's compare: the same order) */
    out->api->set_compare(out->txn, out->blocks, be64_cmp);
    out->api->set_compare(out->txn, out->segments, be64_cmp);
    return 0;
}

int raw_failed(const RawTxn *r, int rc) {
    PyObject *code = PyLong_FromLong(rc);
    PyObject *got = code ? PyObject_CallOneArg(r->raise_for, code) : NULL;
    Py_XDECREF(code);
    if (got != NULL) { /* raise_for must raise; say so if it did not */
        Py_DECREF(got);
        PyErr_Format(PyExc_RuntimeError, "lmdb: return code %d", rc);
    }
    return -1;
}

void raw_close(RawTxn *r) {
    if (r->cursor != NULL) r->api->cursor_close(r->cursor);
    r->cursor = NULL;
}

int raw_cursor(RawTxn *r) {
    if (r->cursor != NULL) return 0;
    int rc = r->api->cursor_open(r->txn, r->blocks, &r->cursor);
    if (rc) {
        r->cursor = NULL;
        return raw_failed(r, rc);
    }
    return 0;
}

/* lmdb_txn(engine, txn) -> (mdb_txn_id, mdb_txn_env as an integer) */
PyObject *sarp_lmdb_txn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const RawApi *api;
    void *txn;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lmdb_txn(engine, txn)");
        return NULL;
    }
    if (engine_txn(args[0], args[1], &api, &txn) < 0) return NULL;
    size_t id = api->txn_id(txn);
    void *env = api->txn_env(txn);
    return Py_BuildValue("(nN)", (Py_ssize_t)id, PyLong_FromVoidPtr(env));
}

/* lmdb_dbi(engine, txn, name) -> (rc, dbi): mdb_dbi_open of a named table, no flags */
PyObject *sarp_lmdb_dbi(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const RawApi *api;
    void *txn;
    if (nargs != 3 || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "lmdb_dbi(engine, txn, name: bytes)");
        return NULL;
    }
    if (engine_txn(args[0], args[1], &api, &txn) < 0) return NULL;
    return dbi_answer(api, txn, args[2]);
}

/* lmdb_get(engine, txn, dbi, key) -> (rc, value or None) */
PyObject *sarp_lmdb_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const RawApi *api;
    void *txn;
    if (nargs != 4 || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "lmdb_get(engine, txn, dbi, key: bytes)");
        return NULL;
    }
    if (engine_txn(args[0], args[1], &api, &txn) < 0) return NULL;
    unsigned dbi = (unsigned)PyLong_AsUnsignedLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    return get_answer(api, txn, dbi, args[3]);
}

/* lmdb_put(engine, txn, dbi, key, value, overwrite) -> rc (MDB_KEYEXIST: refused) */
PyObject *sarp_lmdb_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const RawApi *api;
    void *txn;
    if (nargs != 6 || !PyBytes_Check(args[3]) || !PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "lmdb_put(engine, txn, dbi, key: bytes, value: bytes, "
                                         "overwrite)");
        return NULL;
    }
    if (engine_txn(args[0], args[1], &api, &txn) < 0) return NULL;
    unsigned dbi = (unsigned)PyLong_AsUnsignedLong(args[2]);
    int overwrite = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred() || overwrite < 0) return NULL;
    RawVal k = {(size_t)PyBytes_GET_SIZE(args[3]), PyBytes_AS_STRING(args[3])};
    RawVal v = {(size_t)PyBytes_GET_SIZE(args[4]), PyBytes_AS_STRING(args[4])};
    return PyLong_FromLong(api->put(txn, dbi, &k, &v, overwrite ? 0 : RAW_NOOVERWRITE));
}

/* A read-only transaction of liblmdb's own on an environment's address: 0, or an LMDB
 * code (MDB_MAP_RESIZED: py-lmdb's begin adopts the new size first). */
static int read_begin(PyObject *engine, PyObject *env_obj, const RawApi **api, void **txn) {
    *api = raw_api(engine);
    void *env = *api == NULL ? NULL : PyLong_AsVoidPtr(env_obj);
    if (env == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lmdb: a null environment");
        return -1;
    }
    return (*api)->txn_begin(env, NULL, RAW_RDONLY, txn);
}

/* lmdb_read_dbi(engine, env, name) -> (rc, dbi): mdb_dbi_open of a table the
 * environment has open, in a read-only transaction of its own */
PyObject *sarp_lmdb_read_dbi(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "lmdb_read_dbi(engine, env, name: bytes)");
        return NULL;
    }
    const RawApi *api;
    void *txn;
    int rc = read_begin(args[0], args[1], &api, &txn);
    if (rc == -1 && PyErr_Occurred()) return NULL;
    if (rc) return Py_BuildValue("(iI)", rc, 0u);
    PyObject *out = dbi_answer(api, txn, args[2]);
    api->txn_abort(txn);
    return out;
}

/* lmdb_read_get(engine, env, dbi, key) -> (rc, value or None), in a read-only
 * transaction of its own */
PyObject *sarp_lmdb_read_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "lmdb_read_get(engine, env, dbi, key: bytes)");
        return NULL;
    }
    unsigned dbi = (unsigned)PyLong_AsUnsignedLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    const RawApi *api;
    void *txn;
    int rc = read_begin(args[0], args[1], &api, &txn);
    if (rc == -1 && PyErr_Occurred()) return NULL;
    if (rc) return Py_BuildValue("(iO)", rc, Py_None);
    PyObject *out = get_answer(api, txn, dbi, args[3]);
    api->txn_abort(txn);
    return out;
}
