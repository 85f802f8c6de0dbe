/*
 * The C mirror of sarp/verify.py's match step and walk (sarp._native; sarp/native.py
 * loads it).  Each call has a Python reference that tests hold it equal to:
 *
 * - examine (verify.examine_py): one segment step's record check in one call: the
 *   checksum (xxh3-64, from the vendored xxhash.h), header and sizes, where the record
 *   sits (position and parent), how many leading hashes equal the query's, and each
 *   holder row's leading run.  Anything it cannot vouch for (a short record, a bad
 *   checksum, magic or size) comes back as a negative code, and the Python caller
 *   re-examines the record to raise the error that names the damage.
 * - walk (verify.walk's loop): match's whole walk for one-medium instances on LMDB,
 *   calling the directory's lookup and the transaction's get from here.
 *
 * The record layout is read by native.h's record_layout (segment.py's reference).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

/* What one step learns from a record (see examine_py). */
typedef struct {
    Py_ssize_t n, nh, holders_at, presence_at, same, any_run;
} Step;

/* Check the record and compare it with the query at `start`.  Returns 1 with `st`
 * filled, 0 when the record does not sit at this place, or a negative BAD_* code. */
static int check_record(const uint8_t *r, Py_ssize_t size, const uint8_t *query,
                        Py_ssize_t query_blocks, Py_ssize_t start, uint64_t parent,
                        int has_parent, Step *st) {
    Layout L;
    int bad = record_layout(r, size, &L);
    if (bad) return bad;
    Py_ssize_t n = L.n;
    /* at this place: the query's position and the block before it */
    int is_root = L.flags & IS_ROOT;
    if ((Py_ssize_t)u64_at(r + 8) != start
        || (is_root ? has_parent : (!has_parent || u64_at(r + 16) != parent))) {
        return 0;
    }
    Py_ssize_t m = query_blocks - start;
    if (m > n) m = n;
    Py_ssize_t same = 0;
    if (m > 0) {
        const uint8_t *ours = r + HEADER_BYTES, *theirs = query + 8 * start;
        if (memcmp(ours, theirs, (size_t)(8 * m)) == 0) {
            same = m;
        } else {
            while (memcmp(ours + 8 * same, theirs + 8 * same, 8) == 0) same++;
        }
    }
    st->n = n;
    st->nh = L.nh;
    st->holders_at = L.holders_at;
    st->presence_at = L.presence_at;
    st->same = same;
    return 1;
}

static Py_ssize_t row_run(const uint8_t *r, const Step *st, Py_ssize_t h) {
    const uint8_t *row = r + st->presence_at + h * st->n;
    const uint8_t *gap = memchr(row, 0, (size_t)st->same);
    return gap == NULL ? st->same : gap - row;
}

/* Blocks some holder holds, from the longest row run (rows may take turns). */
static Py_ssize_t any_run_from(const uint8_t *r, const Step *st, Py_ssize_t longest) {
    Py_ssize_t any_run = longest;
    while (any_run < st->same) {
        int held = 0;
        for (Py_ssize_t h = 0; h < st->nh && !held; h++) {
            held = r[st->presence_at + h * st->n + any_run];
        }
        if (!held) break;
        any_run++;
    }
    return any_run;
}

/* examine(record, query_bytes, start, parent, has_parent)
 *   -> (same, any_run, holder_ids, runs) | None (not at this place) | negative int */
PyObject *sarp_examine(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_EXAMINE]++;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "examine(record, query_bytes, start, parent, has_parent)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
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
    Step st;
    int found = check_record(r, rec.len, q.buf, q.len / 8, start, parent, has_parent, &st);
    if (found < 0) {
        out = PyLong_FromLong(found);
        goto done;
    }
    if (found == 0) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *ids = PyList_New(st.nh), *runs = PyList_New(st.nh);
    if (ids == NULL || runs == NULL) {
        Py_XDECREF(ids);
        Py_XDECREF(runs);
        goto done;
    }
    Py_ssize_t longest = 0;
    for (Py_ssize_t h = 0; h < st.nh; h++) {
        Py_ssize_t run = row_run(r, &st, h);
        if (run > longest) longest = run;
        PyObject *id = PyLong_FromLong(u16_at(r + st.holders_at + 2 * h));
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
    out = Py_BuildValue("nnNN", st.same, any_run_from(r, &st, longest), ids, runs);
done:
    PyBuffer_Release(&rec);
    PyBuffer_Release(&q);
    return out;
}

/* A step's run `any_run` into the walk's holders (Holder, native.h): the first step
 * names them, each later one extends those still holding every block so far. */
static void holders_step(Holder *holders, Py_ssize_t *nholders, int *first,
                         const uint8_t *r, const Step *st, const Py_ssize_t *runs,
                         Py_ssize_t any_run) {
    if (*first) {
        for (Py_ssize_t h = 0; h < st->nh; h++) {
            holders[*nholders].id = u16_at(r + st->holders_at + 2 * h);
            holders[*nholders].blocks = runs[h];
            holders[*nholders].extending = runs[h] == any_run;
            (*nholders)++;
        }
        *first = 0;
        return;
    }
    for (Py_ssize_t k = 0; k < *nholders; k++) {
        if (!holders[k].extending) continue;
        Py_ssize_t run = 0;
        for (Py_ssize_t h = 0; h < st->nh; h++) {
            if (u16_at(r + st->holders_at + 2 * h) == holders[k].id) {
                run = runs[h];
                break;
            }
        }
        holders[k].blocks += run;
        holders[k].extending = run == any_run;
    }
}

/* One step of a walk at `pos` on record `r`: its runs into `holders`.  Returns the
 * blocks it adds (0: the walk ends), with *going (the walk may go on) and *stopped_at
 * (the segment id of a damaged record, or -2: more than MAX_WALK_HOLDERS holders). */
static Py_ssize_t walk_step(const uint8_t *r, Py_ssize_t len, const uint8_t *query,
                            Py_ssize_t size, Py_ssize_t pos, int64_t seg_id, Holder *holders,
                            Py_ssize_t *nholders, int *first, int *going,
                            Py_ssize_t *stopped_at, Step *st) {
    int found = check_record(r, len, query, size, pos,
                             pos ? u64_at(query + 8 * (pos - 1)) : 0, pos > 0, st);
    *going = 0;
    if (found < 0) {
        *stopped_at = (Py_ssize_t)seg_id;
        return 0;
    }
    if (found == 0) return 0;
    if (st->nh > MAX_WALK_HOLDERS) {
        *stopped_at = -2;
        return 0;
    }
    Py_ssize_t runs[MAX_WALK_HOLDERS], longest = 0;
    for (Py_ssize_t h = 0; h < st->nh; h++) {
        runs[h] = row_run(r, st, h);
        if (runs[h] > longest) longest = runs[h];
    }
    Py_ssize_t any_run = any_run_from(r, st, longest);
    *going = any_run == st->same && any_run > 0;
    if (any_run > 0) holders_step(holders, nholders, first, r, st, runs, any_run);
    return any_run;
}

/* One step's part of the per-block presence (walk with presence): the record, kept
 * alive, and where in it the held run's rows are. */
struct Rows {
    PyObject *record;
    Py_ssize_t presence_at, holders_at, n, nh, width, offset;
};

#define MAX_PRESENCE_HOLDERS 1024

/* Each holder's presence over the whole walk (`total` blocks, 0 or 1 each) from the
 * steps' rows: {holder_id: bytes}.  A holder absent from a step has zeros there. */
static PyObject *presence_of(Rows *steps, Py_ssize_t nsteps, Py_ssize_t total) {
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    uint16_t ids[MAX_PRESENCE_HOLDERS];
    char *bufs[MAX_PRESENCE_HOLDERS];
    Py_ssize_t nids = 0;
    for (Py_ssize_t s = 0; s < nsteps; s++) {
        const uint8_t *r = (const uint8_t *)PyBytes_AS_STRING(steps[s].record);
        for (Py_ssize_t h = 0; h < steps[s].nh; h++) {
            uint16_t id = u16_at(r + steps[s].holders_at + 2 * h);
            Py_ssize_t k = 0;
            while (k < nids && ids[k] != id) k++;
            if (k == nids) {
                if (nids == MAX_PRESENCE_HOLDERS) goto too_many;
                PyObject *row = PyBytes_FromStringAndSize(NULL, total);
                if (row == NULL) goto fail;
                memset(PyBytes_AS_STRING(row), 0, (size_t)total);
                PyObject *key = PyLong_FromLong(id);
                if (key == NULL || PyDict_SetItem(out, key, row) < 0) {
                    Py_XDECREF(key);
                    Py_DECREF(row);
                    goto fail;
                }
                Py_DECREF(key);
                Py_DECREF(row);  /* the dict holds it */
                ids[nids] = id;
                bufs[nids++] = PyBytes_AS_STRING(row);
            }
            const uint8_t *src = r + steps[s].presence_at + h * steps[s].n;
            char *dst = bufs[k] + steps[s].offset;
            for (Py_ssize_t b = 0; b < steps[s].width; b++) dst[b] = src[b] != 0;
        }
    }
    return out;
too_many:
    Py_DECREF(out);
    return Py_NewRef(Py_None);
fail:
    Py_DECREF(out);
    return NULL;
}

/* Keep a step's record for the presence: `owner` (a new reference to bytes holding
 * it, taken over) or a copy of the `len` bytes at `r`.  0, or -1 with an error. */
static int keep_rows(Walk *w, const uint8_t *r, Py_ssize_t len, PyObject *owner,
                     const Step *st, Py_ssize_t step) {
    PyObject *kept = owner != NULL ? owner : PyBytes_FromStringAndSize((const char *)r, len);
    if (kept == NULL) return -1;
    if (w->nsteps == w->cap) {
        Py_ssize_t grown = w->cap ? 2 * w->cap : 16;
        Rows *more = PyMem_Realloc(w->steps, (size_t)grown * sizeof(Rows));
        if (more == NULL) {
            Py_DECREF(kept);
            PyErr_NoMemory();
            return -1;
        }
        w->steps = more;
        w->cap = grown;
    }
    w->steps[w->nsteps++] = (Rows){kept, st->presence_at, st->holders_at, st->n, st->nh,
                                   step, w->total};
    return 0;
}

int walk_records(const RecordSource *src, const uint8_t *query, Py_ssize_t size, Walk *w) {
    w->total = w->reads = w->nholders = w->nsteps = 0;
    w->stopped_at = -1;
    Py_ssize_t pos = 0;
    int first = 1, going;
    while (pos < size) {
        int64_t seg_id = src->probe(src->ctx, u64_at(query + 8 * pos));
        if (seg_id == -2) return -1;
        if (seg_id < 0) break;
        Py_ssize_t len = 0;
        PyObject *owner = NULL;
        const uint8_t *r = src->record(src->ctx, seg_id, &len, w->with_rows ? &owner : NULL);
        if (r == NULL && len == -2) return -1;
        if (r == NULL && len == -1) return 1;
        w->reads++;
        if (r == NULL) break;
        Step st;
        Py_ssize_t step = walk_step(r, len, query, size, pos, seg_id, w->holders,
                                    &w->nholders, &first, &going, &w->stopped_at, &st);
        if (step > 0 && w->with_rows) {
            if (keep_rows(w, r, len, owner, &st, step) < 0) return -1;
        } else {
            Py_XDECREF(owner);
        }
        w->total += step;
        if (w->stopped_at != -1 || step == 0 || !going) break;
        pos += step;
    }
    return 0;
}

void walk_release(Walk *w) {
    for (Py_ssize_t k = 0; k < w->nsteps; k++) Py_DECREF(w->steps[k].record);
    PyMem_Free(w->steps);
    w->steps = NULL;
    w->nsteps = w->cap = 0;
}

PyObject *walk_answer(Walk *w) {
    PyObject *third;
    if (w->with_rows && w->stopped_at != -2) {
        third = presence_of(w->steps, w->nsteps, w->total);
        if (third == Py_None) {  /* more holders than the rows take: Python walks it */
            Py_DECREF(third);
            w->stopped_at = -2;
            third = PyDict_New();
        }
    } else {
        third = PyDict_New();
        for (Py_ssize_t k = 0; third != NULL && k < w->nholders; k++) {
            PyObject *id = PyLong_FromLong(w->holders[k].id);
            PyObject *blocks = PyLong_FromSsize_t(w->holders[k].blocks);
            if (id == NULL || blocks == NULL || PyDict_SetItem(third, id, blocks) < 0)
                Py_CLEAR(third);
            Py_XDECREF(id);
            Py_XDECREF(blocks);
        }
    }
    if (third == NULL) return NULL;
    return Py_BuildValue("nnNn", w->total, w->reads, third, w->stopped_at);
}

/* walk's record source: the directory's two dicts, then its lookup, and the read
 * transaction's get (the record it returned is kept until the next). */
typedef struct {
    PyObject *get, *lookup, *recent, *remembered, *record;
    Py_buffer rec;
} PySource;

static int64_t py_probe(void *ctx, uint64_t first_hash) {
    PySource *s = ctx;
    PyObject *key = PyLong_FromUnsignedLongLong(first_hash);
    if (key == NULL) return -2;
    PyObject *seg = PyDict_GetItemWithError(s->recent, key);
    if (seg == NULL && !PyErr_Occurred()) seg = PyDict_GetItemWithError(s->remembered, key);
    if (seg != NULL) {
        Py_INCREF(seg);
    } else if (!PyErr_Occurred()) {
        seg = PyObject_CallOneArg(s->lookup, key);
    }
    Py_DECREF(key);
    if (seg == NULL) return -2;
    if (seg == Py_None) {
        Py_DECREF(seg);
        return -1;
    }
    unsigned long long seg_id = PyLong_AsUnsignedLongLong(seg);
    Py_DECREF(seg);
    return PyErr_Occurred() ? -2 : (int64_t)seg_id;
}

static void py_drop_record(PySource *s) {
    if (s->record == NULL) return;
    PyBuffer_Release(&s->rec);
    Py_CLEAR(s->record);
}

static const uint8_t *py_record(void *ctx, int64_t seg_id, Py_ssize_t *len, PyObject **owner) {
    PySource *s = ctx;
    py_drop_record(s);
    *len = -2;
    PyObject *key = be_key((uint64_t)seg_id);
    if (key == NULL) return NULL;
    PyObject *record = PyObject_CallOneArg(s->get, key);
    Py_DECREF(key);
    if (record == NULL) return NULL;
    if (record == Py_None) {
        Py_DECREF(record);
        *len = 0;
        return NULL;
    }
    if (PyObject_GetBuffer(record, &s->rec, PyBUF_SIMPLE) < 0) {
        Py_DECREF(record);
        return NULL;
    }
    s->record = record;
    *len = s->rec.len;
    if (owner != NULL && PyBytes_CheckExact(record)) *owner = Py_NewRef(record);
    return s->rec.buf;
}

/* walk(get, lookup, recent, remembered, query_bytes[, with_presence])
 *   -> (total, reads, {holder_id: blocks} | {holder_id: presence bytes}, stopped_at)
 * `match`'s walk.  The directory probe is Directory.lookup's:
 * its two dicts first (`recent`: changes since the arrays were merged; `remembered`:
 * array entries looked up before), then `lookup(first_hash)` itself (segment id or
 * None).  `get(key)` is the read transaction's (record bytes or None; keys big-endian
 * u64).  With `with_presence`, the third item is each holder's presence over the
 * `total` verified blocks (bytes of 0 and 1, every holder of every step), from which
 * runs per holder, per instance over its media and per tier follow; without, each
 * first-step holder's leading run.  stopped_at: -1, or the id of a damaged segment at
 * which the walk stopped (the caller logs it), or -2: a step with more than
 * MAX_WALK_HOLDERS holders (or a walk with more than MAX_PRESENCE_HOLDERS), which the
 * caller walks in Python instead. */
PyObject *sarp_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_WALK]++;
    if ((nargs != 5 && nargs != 6) || !PyDict_CheckExact(args[2])
        || !PyDict_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "walk(get, lookup, recent: dict, remembered: dict, "
                                         "query_bytes[, with_presence])");
        return NULL;
    }
    int with_presence = nargs == 6 ? PyObject_IsTrue(args[5]) : 0;
    if (with_presence < 0) return NULL;
    Py_buffer q;
    if (PyObject_GetBuffer(args[4], &q, PyBUF_SIMPLE) < 0) return NULL;
    PySource source = {args[0], args[1], args[2], args[3], NULL};
    RecordSource src = {py_probe, py_record, &source};
    Walk w = {.with_rows = with_presence};
    int done = walk_records(&src, q.buf, q.len / 8, &w);
    py_drop_record(&source);
    PyObject *out = done == 0 ? walk_answer(&w) : NULL;
    walk_release(&w);
    PyBuffer_Release(&q);
    return out;
}

/* walk's record source on liblmdb's read transaction (lmdb_env.c): the directory probed
 * as py_probe does, each record read in place (valid while the transaction is open). */
typedef struct {
    PySource py;
    const RawApi *api;
    void *txn;
    unsigned dbi;
} RawSource;

static int64_t raw_probe(void *ctx, uint64_t first_hash) {
    return py_probe(&((RawSource *)ctx)->py, first_hash);
}

static const uint8_t *raw_record(void *ctx, int64_t seg_id, Py_ssize_t *len,
                                 PyObject **owner) {
    RawSource *s = ctx;
    uint8_t be[8];
    be8((uint64_t)seg_id, be);
    RawVal k = {8, be}, v = {0, NULL};
    int rc = s->api->get(s->txn, s->dbi, &k, &v);
    *len = 0;
    if (rc == RAW_NOTFOUND) return NULL;
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "lmdb: mdb_get returned %d", rc);
        *len = -2;
        return NULL;
    }
    *len = (Py_ssize_t)v.size;
    return v.data;
}

PyObject *walk_raw(const RawApi *api, void *txn, unsigned dbi, PyObject *lookup,
                   PyObject *recent, PyObject *remembered, PyObject *query, int with_presence) {
    if (!PyDict_CheckExact(recent) || !PyDict_CheckExact(remembered)) {
        PyErr_SetString(PyExc_TypeError, "walk_raw: the directory's probe dicts are dicts");
        return NULL;
    }
    Py_buffer q;
    if (PyObject_GetBuffer(query, &q, PyBUF_SIMPLE) < 0) return NULL;
    sarp_calls[CALL_WALK]++;
    RawSource source = {{NULL, lookup, recent, remembered, NULL}, api, txn, dbi};
    RecordSource src = {raw_probe, raw_record, &source};
    Walk w = {.with_rows = with_presence};
    int done = walk_records(&src, q.buf, q.len / 8, &w);
    PyObject *out = done == 0 ? walk_answer(&w) : NULL;
    if (done == 1) PyErr_SetString(PyExc_RuntimeError, "walk_raw: a record not at hand");
    walk_release(&w);
    PyBuffer_Release(&q);
    return out;
}

/* The leading run of a row of 0 and 1 bytes: the blocks held from the first on. */
static Py_ssize_t leading_run(const char *row, Py_ssize_t len) {
    const char *gap = memchr(row, 0, len);
    return gap == NULL ? len : gap - row;
}

/* rows_result(rows, names, instance_of, instance_names, total) -> (by_holder, by_medium)
 * sarp.answer.runs_of_rows's runs (its Python is the reference): rows maps holder id
 * -> presence bytes; names holder id -> (instance, medium), a holder without one left
 * out; instance_of None (each instance one holder: its run is its instance's) or the
 * instance of each holder id below its length (an instance's run is the leading run of
 * its holders' rows ORed, over `total` blocks). */
PyObject *sarp_rows_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])
        || (args[2] != Py_None && !PyList_Check(args[2])) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "rows_result(rows: dict, names: dict, instance_of: "
                                         "list | None, instance_names: list, total: int)");
        return NULL;
    }
    Py_ssize_t total = PyLong_AsSsize_t(args[4]);
    if (total == -1 && PyErr_Occurred()) return NULL;
    sarp_calls[CALL_ROWS_RESULT]++;
    PyObject *rows = args[0], *names = args[1], *instance_of = args[2];
    Py_ssize_t known = instance_of == Py_None ? 0 : PyList_GET_SIZE(instance_of);
    Py_ssize_t n = PyDict_GET_SIZE(rows), ngroups = 0, ngrouped = 0;
    /* the instances of the grouped holders, in first-seen order, and each grouped row */
    Py_ssize_t *group = PyMem_Malloc(2 * (n ? n : 1) * sizeof(Py_ssize_t)), *mine = group + n;
    struct { Py_ssize_t g, len; const char *p; } *grouped = PyMem_Malloc((n ? n : 1)
                                                                         * sizeof *grouped);
    PyObject *by_holder = PyDict_New(), *by_medium = PyDict_New(), *out = NULL;
    if (group == NULL || grouped == NULL || by_holder == NULL || by_medium == NULL) {
        if (group == NULL || grouped == NULL) PyErr_NoMemory();
        goto done;
    }
    PyObject *hid, *row;
    Py_ssize_t pos = 0;
    while (PyDict_Next(rows, &pos, &hid, &row)) {
        PyObject *name = PyDict_GetItemWithError(names, hid);
        if (name == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        if (!PyBytes_Check(row) || !PyTuple_Check(name) || PyTuple_GET_SIZE(name) != 2) {
            PyErr_SetString(PyExc_TypeError, "rows_result: rows of bytes, names of pairs");
            goto done;
        }
        const char *p = PyBytes_AS_STRING(row);
        Py_ssize_t len = PyBytes_GET_SIZE(row), run = leading_run(p, len);
        PyObject *instance = PyTuple_GET_ITEM(name, 0);
        if (run) {
            PyObject *media = PyDict_GetItemWithError(by_medium, instance), *value;
            if (media == NULL) {
                if (PyErr_Occurred() || (media = PyDict_New()) == NULL) goto done;
                int bad = PyDict_SetItem(by_medium, instance, media);
                Py_DECREF(media); /* by_medium holds it */
                if (bad < 0) goto done;
            }
            if ((value = PyLong_FromSsize_t(run)) == NULL) goto done;
            int bad = PyDict_SetItem(media, PyTuple_GET_ITEM(name, 1), value);
            if (!bad && instance_of == Py_None) bad = PyDict_SetItem(by_holder, instance, value);
            Py_DECREF(value);
            if (bad < 0) goto done;
        }
        if (instance_of == Py_None) continue;
        Py_ssize_t h = PyLong_AsSsize_t(hid);
        if (h == -1 && PyErr_Occurred()) goto done;
        if (h < 0 || h >= known) continue; /* a holder newer than the names: no instance */
        Py_ssize_t inst = PyLong_AsSsize_t(PyList_GET_ITEM(instance_of, h));
        if (inst == -1 && PyErr_Occurred()) goto done;
        Py_ssize_t g = 0;
        while (g < ngroups && group[g] != inst) g++;
        if (g == ngroups) group[ngroups++] = inst;
        grouped[ngrouped].g = g;
        grouped[ngrouped].len = len;
        grouped[ngrouped++].p = p;
    }
    for (Py_ssize_t g = 0; g < ngroups; g++) {
        if (group[g] < 0) continue;
        /* the leading run of the group's rows ORed: up to the first block none holds */
        Py_ssize_t run = 0, nmine = 0;
        for (Py_ssize_t k = 0; k < ngrouped; k++)
            if (grouped[k].g == g) mine[nmine++] = k;
        for (int any = 1; any && run < total; run += any) {
            any = 0;
            for (Py_ssize_t k = 0; k < nmine && !any; k++)
                any = run < grouped[mine[k]].len && grouped[mine[k]].p[run];
        }
        if (!run) continue;
        if (group[g] >= PyList_GET_SIZE(args[3])) {
            PyErr_SetString(PyExc_IndexError, "rows_result: an instance without a name");
            goto done;
        }
        PyObject *value = PyLong_FromSsize_t(run);
        if (value == NULL) goto done;
        int bad = PyDict_SetItem(by_holder, PyList_GET_ITEM(args[3], group[g]), value);
        Py_DECREF(value);
        if (bad < 0) goto done;
    }
    out = PyTuple_Pack(2, by_holder, by_medium);
done:
    PyMem_Free(group);
    PyMem_Free(grouped);
    Py_XDECREF(by_holder);
    Py_XDECREF(by_medium);
    return out;
}

/* plain_result(runs, names) -> (by_holder, by_medium)
 * sarp.answer.plain_runs's (its Python is the reference): runs maps holder id -> its
 * prefix (a walk where each instance is one holder); names holder id -> (instance,
 * medium).  Each named holder with a prefix: by_holder[instance] = blocks,
 * by_medium[instance] = {medium: blocks}; a holder without a name is left out. */
PyObject *sarp_plain_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "plain_result(runs: dict, names: dict)");
        return NULL;
    }
    sarp_calls[CALL_PLAIN_RESULT]++;
    PyObject *by_holder = PyDict_New(), *by_medium = PyDict_New(), *out = NULL;
    if (by_holder == NULL || by_medium == NULL) goto done;
    PyObject *hid, *blocks;
    Py_ssize_t pos = 0;
    while (PyDict_Next(args[0], &pos, &hid, &blocks)) {
        int held = PyObject_IsTrue(blocks);
        if (held < 0) goto done;
        if (!held) continue;
        PyObject *name = PyDict_GetItemWithError(args[1], hid);
        if (name == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        if (!PyTuple_Check(name) || PyTuple_GET_SIZE(name) != 2) {
            PyErr_SetString(PyExc_TypeError, "plain_result: names of pairs");
            goto done;
        }
        PyObject *instance = PyTuple_GET_ITEM(name, 0);
        PyObject *media = PyDict_New();
        if (media == NULL) goto done;
        int bad = PyDict_SetItem(media, PyTuple_GET_ITEM(name, 1), blocks) < 0
                  || PyDict_SetItem(by_holder, instance, blocks) < 0
                  || PyDict_SetItem(by_medium, instance, media) < 0;
        Py_DECREF(media);
        if (bad) goto done;
    }
    out = PyTuple_Pack(2, by_holder, by_medium);
done:
    Py_XDECREF(by_holder);
    Py_XDECREF(by_medium);
    return out;
}
