/*
 * sarp._native: sarp's hot loops in C, one file beside each Python module it mirrors
 * (native.h lists them), each call with a Python reference that tests hold it equal
 * to.  This file is the module: its methods, its ABI version and its call counters.
 * sarp/native.py is the only Python that imports it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "native.h"

/* native.py refuses a build whose ABI differs (a stale .so from another checkout) */
#define ABI_VERSION 35

unsigned long long sarp_calls[CALL_KINDS];

/* calls() -> (examine, walk, pack_batch, decode_batch, u64_array, token_keys,
 * resolve_aliases, BlockTable, decode_into, find, read_match, rfc_answer, rows_result,
 * plain_result, query_fields, conn, rfc_query, heads, xxh3_64, alias_table, take_line,
 * lmdb_pack, lmdb_read): calls so far
 * (conn: requests a Conn answered; lmdb_pack: pack_batch calls on liblmdb's own calls;
 * lmdb_read: rfc_query calls that read in a transaction of liblmdb's own) */
static PyObject *calls(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(KKKKKKKKKKKKKKKKKKKKKKK)", sarp_calls[CALL_EXAMINE], sarp_calls[CALL_WALK],
                         sarp_calls[CALL_PACK_BATCH], sarp_calls[CALL_DECODE_BATCH],
                         sarp_calls[CALL_U64_ARRAY], sarp_calls[CALL_TOKEN_KEYS],
                         sarp_calls[CALL_RESOLVE_ALIASES], sarp_calls[CALL_BLOCK_TABLE],
                         sarp_calls[CALL_DECODE_INTO], sarp_calls[CALL_FIND],
                         sarp_calls[CALL_READ_MATCH], sarp_calls[CALL_RFC_ANSWER],
                         sarp_calls[CALL_ROWS_RESULT], sarp_calls[CALL_PLAIN_RESULT],
                         sarp_calls[CALL_QUERY_FIELDS], sarp_calls[CALL_CONN],
                         sarp_calls[CALL_RFC_QUERY], sarp_calls[CALL_HEADS],
                         sarp_calls[CALL_XXH3_64], sarp_calls[CALL_ALIAS_TABLE],
                         sarp_calls[CALL_TAKE_LINE], sarp_calls[CALL_LMDB_PACK],
                         sarp_calls[CALL_LMDB_READ]);
}

/* xxh3_64(data[, seed]) -> int: xxhash's xxh3_64_intdigest (sarp.hashing.checksum), for
 * code that runs before numpy and xxhash are imported (serving/early.py) */
static PyObject *xxh3_64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "xxh3_64(data, seed=0)");
        return NULL;
    }
    unsigned long long seed = 0;
    if (nargs == 2) {
        seed = PyLong_AsUnsignedLongLong(args[1]);
        if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    sarp_calls[CALL_XXH3_64]++;
    uint64_t h = XXH3_64bits_withSeed(view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"u64_array", (PyCFunction)(void (*)(void))sarp_u64_array, METH_FASTCALL,
     "u64_array(body, start, end): the JSON integers inside an array, as uint64 bytes"},
    {"examine", (PyCFunction)(void (*)(void))sarp_examine, METH_FASTCALL,
     "examine(record, query_bytes, start, parent, has_parent): see sarp.verify.examine"},
    {"walk", (PyCFunction)(void (*)(void))sarp_walk, METH_FASTCALL,
     "walk(get, lookup, recent, remembered, query_bytes): match's walk for one-medium "
     "instances"},
    {"decode_batch", (PyCFunction)(void (*)(void))sarp_decode_batch, METH_FASTCALL,
     "decode_batch(payload, with_tokens): an engine's event batch, or None for the Python "
     "decoder"},
    {"decode_into", (PyCFunction)(void (*)(void))sarp_decode_into, METH_FASTCALL,
     "decode_into(payload, with_tokens, root, holder, ctx): an engine's event batch "
     "appended to a commit's columns, or None for the Python decoder"},
    {"pack_batch", (PyCFunction)(void (*)(void))sarp_pack_batch, METH_FASTCALL,
     "pack_batch(ctx, ops, segment_blocks, split_tail, deferred): Packer.batch's inserts "
     "and removes"},
    {"token_keys", (PyCFunction)(void (*)(void))sarp_token_keys, METH_FASTCALL,
     "token_keys(data, width, block_size, seed, parent): see sarp.tokenkeys"},
    {"resolve_aliases", (PyCFunction)(void (*)(void))sarp_resolve_aliases, METH_FASTCALL,
     "resolve_aliases(...): a batch's engine hashes resolved to token keys (sarp.aliases)"},
    {"resolve_aliases_release", sarp_resolve_aliases_release, METH_NOARGS,
     "resolve_aliases_release(): the bytes of the table resolve_aliases keeps, handed back "
     "(sarp.aliases.release)"},
    {"find", (PyCFunction)(void (*)(void))sarp_find, METH_FASTCALL,
     "find(out, query, keys, segs[, added, added_segs, gone]): Directory.lookup_many"},
    {"predict", (PyCFunction)(void (*)(void))sarp_predict, METH_FASTCALL,
     "predict(query, keys, segs[, added, added_segs, gone]): Directory.predicted_keys"},
    {"read_match", (PyCFunction)(void (*)(void))sarp_read_match, METH_FASTCALL,
     "read_match(query, shards, timeout_ms, with_rows): readers of Valkey matching one chain "
     "(sarp.valkey_read.match_each)"},
    {"rfc_answer", (PyCFunction)(void (*)(void))sarp_rfc_answer, METH_FASTCALL,
     "rfc_answer(rows, names, ranks, block_size): RFC #1403's /query answer as JSON "
     "(sarp.serving.rfc.answer_c)"},
    {"rows_result", (PyCFunction)(void (*)(void))sarp_rows_result, METH_FASTCALL,
     "rows_result(rows, names, instance_of, instance_names, total): a match's runs from "
     "its holders' rows (sarp.answer.runs_of_rows)"},
    {"plain_result", (PyCFunction)(void (*)(void))sarp_plain_result, METH_FASTCALL,
     "plain_result(runs, names): a one-medium walk's runs named (sarp.answer.plain_runs)"},
    {"query_fields", (PyCFunction)(void (*)(void))sarp_query_fields, METH_FASTCALL,
     "query_fields(body): a /query body's token ids and names, or None "
     "(sarp.serving.rfc.query_fields)"},
    {"rfc_query", (PyCFunction)(void (*)(void))sarp_rfc_query, METH_FASTCALL,
     "rfc_query(body, models, tenant, seed, max_blocks, reading): a whole /query's answer, "
     "or None (sarp.serving.rfc.answer_now)"},
    {"heads", (PyCFunction)(void (*)(void))sarp_heads, METH_FASTCALL,
     "heads(records): each record's check, first hash and holder ids (sarp.segment.heads)"},
    {"xxh3_64", (PyCFunction)(void (*)(void))xxh3_64, METH_FASTCALL,
     "xxh3_64(data, seed=0): xxh3-64 of a buffer (sarp.hashing.checksum)"},
    {"lane_bind", (PyCFunction)(void (*)(void))sarp_lane_bind, METH_FASTCALL,
     "lane_bind(addresses): libzmq's message calls, for take_line (sarp.serving.lane)"},
    {"take_line", (PyCFunction)(void (*)(void))sarp_take_line, METH_FASTCALL,
     "take_line(socket, count, expected, ...): the live messages next in line, decoded into "
     "a commit's columns (sarp.serving.lane)"},
    {"lane_prefetch", (PyCFunction)(void (*)(void))sarp_lane_prefetch, METH_FASTCALL,
     "lane_prefetch(lines, count, max_events, pairs, seeds): take_line's takes on a thread "
     "of their own, without the GIL (sarp.serving.lane.Prefetch)"},
    {"lane_prefetch_end", (PyCFunction)(void (*)(void))sarp_lane_prefetch_end, METH_FASTCALL,
     "lane_prefetch_end(handle, ctx): the prefetch's takes, its columns appended to ctx's"},
    {"lmdb_bind", (PyCFunction)(void (*)(void))sarp_lmdb_bind, METH_FASTCALL,
     "lmdb_bind(engine, addresses): liblmdb's calls of one engine py-lmdb bundles "
     "(sarp.lmdb_env)"},
    {"lmdb_txn", (PyCFunction)(void (*)(void))sarp_lmdb_txn, METH_FASTCALL,
     "lmdb_txn(engine, txn): (mdb_txn_id, mdb_txn_env) of a transaction's address"},
    {"lmdb_dbi", (PyCFunction)(void (*)(void))sarp_lmdb_dbi, METH_FASTCALL,
     "lmdb_dbi(engine, txn, name): (rc, dbi) of mdb_dbi_open"},
    {"lmdb_get", (PyCFunction)(void (*)(void))sarp_lmdb_get, METH_FASTCALL,
     "lmdb_get(engine, txn, dbi, key): (rc, value or None) of mdb_get"},
    {"lmdb_put", (PyCFunction)(void (*)(void))sarp_lmdb_put, METH_FASTCALL,
     "lmdb_put(engine, txn, dbi, key, value, overwrite): rc of mdb_put"},
    {"lmdb_read_dbi", (PyCFunction)(void (*)(void))sarp_lmdb_read_dbi, METH_FASTCALL,
     "lmdb_read_dbi(engine, env, name): (rc, dbi) of mdb_dbi_open in a read transaction"},
    {"lmdb_read_get", (PyCFunction)(void (*)(void))sarp_lmdb_read_get, METH_FASTCALL,
     "lmdb_read_get(engine, env, dbi, key): (rc, value or None) in a read transaction"},
    {"calls", calls, METH_NOARGS,
     "calls(): (examine, walk, pack_batch, decode_batch, u64_array, token_keys, "
     "resolve_aliases, BlockTable, decode_into, find, read_match, rfc_answer, rows_result, "
     "plain_result, query_fields, conn, rfc_query, heads, xxh3_64, alias_table, take_line, "
     "lmdb_pack, lmdb_read) calls so far"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sarp._native",
    "sarp's hot loops in C (examine, walk, u64_array, pack_batch, decode_batch, "
    "decode_into, token_keys, resolve_aliases, BlockTable, find, predict, read_match, "
    "rfc_answer, rows_result, plain_result, query_fields, Conn, rfc_query, heads, xxh3_64, "
    "AliasTable, take_line, lmdb_*); "
    "each has a Python reference.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddIntConstant(mod, "SEG_ID_STRIDE", SEG_ID_STRIDE) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    if (mod != NULL && (PyModule_AddIntConstant(mod, "ABI_VERSION", ABI_VERSION) < 0
                        || PyModule_AddObject(mod, "MAX_SEGMENT_ID",
                                              PyLong_FromUnsignedLongLong(MAX_SEGMENT_ID)) < 0)) {
        Py_DECREF(mod);
        return NULL;
    }
    if (mod != NULL && (PyType_Ready(&sarp_BlockTableType) < 0
                        || PyModule_AddType(mod, &sarp_BlockTableType) < 0
                        || PyType_Ready(&sarp_ReadsType) < 0
                        || PyModule_AddType(mod, &sarp_ReadsType) < 0
                        || PyType_Ready(&sarp_ConnType) < 0
                        || PyModule_AddType(mod, &sarp_ConnType) < 0
                        || PyType_Ready(&sarp_AliasTableType) < 0
                        || PyModule_AddType(mod, &sarp_AliasTableType) < 0)) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
