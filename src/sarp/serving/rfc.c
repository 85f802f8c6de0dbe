/*
 * The C mirror of sarp/serving/rfc.py's `answer` (sarp._native; sarp/native.py loads
 * it): RFC #1403's answer to a `/query`, as the JSON bytes orjson makes of `answer`'s
 * dict, read straight from the match's rows (answer.HolderRows: each holder's
 * presence over the verified blocks, and the holders' names), with no dict, numpy
 * array or run per holder in Python.  rfc.answer_c calls it; tests hold its bytes
 * equal to orjson.dumps(rfc.answer(match, model)).  And a /query body's fields read in one
 * pass (query_fields), where routers' bodies take no Python parse; and the whole of a
 * /query on a readonly LMDB index in one call (rfc_query: rfc.answer_now), whose
 * reference is the general path those parts are called from.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../native.h"

/* More holders than this go to the Python answer (each lookup below is a scan). */
enum { MAX_ANSWER_HOLDERS = 256 };

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Buf;

static int put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->n + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        char *p = PyMem_Realloc(b->p, cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

#define PUT(b, lit) put((b), (lit), (Py_ssize_t)sizeof(lit) - 1)

static int put_int(Buf *b, long long v) { /* (snprintf was half of a call's time) */
    char s[24], *end = s + sizeof s, *p = end;
    unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
    do {
        *--p = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *--p = '-';
    return put(b, p, end - p);
}

/* A str as JSON, escaped as orjson escapes it: '"', '\\', and the control characters
 * (\b \t \n \f \r by name, the rest as \u00XX); anything else as its UTF-8. */
static int put_str(Buf *b, PyObject *s) {
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL || PUT(b, "\"") < 0) return -1;
    Py_ssize_t from = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)u[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        if (put(b, u + from, i - from) < 0) return -1;
        from = i + 1;
        char esc[8] = {'\\', 0};
        int len = 2;
        switch (c) {
            case '"': esc[1] = '"'; break;
            case '\\': esc[1] = '\\'; break;
            case '\b': esc[1] = 'b'; break;
            case '\t': esc[1] = 't'; break;
            case '\n': esc[1] = 'n'; break;
            case '\f': esc[1] = 'f'; break;
            case '\r': esc[1] = 'r'; break;
            default: len = snprintf(esc, sizeof esc, "\\u%04x", c);
        }
        if (put(b, esc, len) < 0) return -1;
    }
    return put(b, u + from, n - from) < 0 || PUT(b, "\"") < 0 ? -1 : 0;
}

/* One instance (engine and rank) as `answer` sees it through Match: `order`, its place
 * in by_medium (the first holder of it with a leading run; -1 none), `gpu` by_medium's
 * GPU run (the last holder's that has one), and the last rows named CPU and DISK
 * (presence's). */
typedef struct {
    PyObject *name;
    Py_ssize_t order, gpu, cpu_len, disk_len;
    const uint8_t *cpu, *disk;
} Inst;

/* An entry of one of the answer's maps keyed by instance id then rank, in the order
 * Python's dicts would keep (the first insert's place; a later one overwrites). */
typedef struct {
    PyObject *iid;
    long long rank, value;
} Entry;

/* A reported instance id's tiers (answer's "instances" entry), in first-insert order. */
typedef struct {
    PyObject *iid;
    long long longest, gpu, cpu, disk;
} Tiers;

static Py_ssize_t run_from(const uint8_t *row, Py_ssize_t len, Py_ssize_t start) {
    if (row == NULL || start >= len) return 0;
    const uint8_t *gap = memchr(row + start, 0, len - start);
    return (gap == NULL ? len : gap - row) - start;
}

/* 1 equal, 0 not, -1 error */
static int same(PyObject *a, PyObject *b) { return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ); }

/* Set (iid, rank) in `e` (n of them so far) to value; the new count, or -1. */
static Py_ssize_t upsert(Entry *e, Py_ssize_t n, PyObject *iid, long long rank, long long value) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (e[i].rank != rank) continue;
        int eq = same(e[i].iid, iid);
        if (eq < 0) return -1;
        if (eq) {
            e[i].value = value;
            return n;
        }
    }
    e[n] = (Entry){iid, rank, value};
    return n + 1;
}

/* Entries grouped by iid in the order each iid first came, each group in its order. */
static int put_grouped(Buf *b, const Entry *e, Py_ssize_t n, Py_ssize_t i) {
    /* the entries of e[i].iid, from i on (none of them before i) */
    if (PUT(b, "{") < 0) return -1;
    int first = 1;
    for (Py_ssize_t j = i; j < n; j++) {
        int eq = same(e[j].iid, e[i].iid);
        if (eq < 0) return -1;
        if (!eq) continue;
        if ((!first && PUT(b, ",") < 0) || PUT(b, "\"") < 0 || put_int(b, e[j].rank) < 0
            || PUT(b, "\":") < 0 || put_int(b, e[j].value) < 0)
            return -1;
        first = 0;
    }
    return PUT(b, "}");
}

/* Whether e[i] is its iid's first entry. 1, 0, -1 error. */
static int first_of(const Entry *e, Py_ssize_t i) {
    for (Py_ssize_t j = 0; j < i; j++) {
        int eq = same(e[j].iid, e[i].iid);
        if (eq != 0) return eq < 0 ? -1 : 0;
    }
    return 1;
}

/* A call's tables, room for `room` holders each, in one allocation. */
typedef struct {
    Inst *insts;
    Py_ssize_t *ordered;
    Entry *scores, *dp;
    Tiers *tiers;
    Buf out;
} Work;

static int work_init(Work *w, Py_ssize_t room) {
    size_t each = sizeof(Inst) + sizeof(Py_ssize_t) + 2 * sizeof(Entry) + sizeof(Tiers);
    char *p = PyMem_Malloc(room * each);
    *w = (Work){(Inst *)p, NULL, NULL, NULL, NULL, {NULL, 0, 0}};
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->scores = (Entry *)(p + room * sizeof(Inst));
    w->dp = w->scores + room;
    w->tiers = (Tiers *)(w->dp + room);
    w->ordered = (Py_ssize_t *)(w->tiers + room);
    w->out.cap = 128 + 160 * room; /* an answer's usual size: no realloc */
    w->out.p = PyMem_Malloc(w->out.cap);
    if (w->out.p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void work_free(Work *w) {
    PyMem_Free(w->insts);
    PyMem_Free(w->out.p);
}

/* The instances of the named rows, in `w->insts`; how many by_medium holds (their
 * indexes in w->ordered), -1 on error, -2 for the Python answer. */
static Py_ssize_t gather(Work *w, PyObject *rows, PyObject *names, Py_ssize_t *ninsts) {
    PyObject *hid, *row;
    Py_ssize_t pos = 0, n = 0, ordered = 0;
    while (PyDict_Next(rows, &pos, &hid, &row)) {
        PyObject *name = PyDict_GetItemWithError(names, hid);
        if (name == NULL) {
            if (PyErr_Occurred()) return -1;
            continue; /* a holder without a (verified) name is never reported */
        }
        if (!PyBytes_Check(row) || !PyTuple_Check(name) || PyTuple_GET_SIZE(name) != 2
            || !PyUnicode_Check(PyTuple_GET_ITEM(name, 1)))
            return -2;
        PyObject *instance = PyTuple_GET_ITEM(name, 0), *medium = PyTuple_GET_ITEM(name, 1);
        Py_ssize_t k = 0;
        for (; k < n; k++) {
            int eq = same(w->insts[k].name, instance);
            if (eq < 0) return -1;
            if (eq) break;
        }
        if (k == n) w->insts[n++] = (Inst){instance, -1, 0, 0, 0, NULL, NULL};
        Inst *in = &w->insts[k];
        const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(row);
        Py_ssize_t len = PyBytes_GET_SIZE(row), run = run_from(p, len, 0);
        if (run > 0 && in->order < 0) {
            in->order = ordered;
            w->ordered[ordered++] = k;
        }
        if (PyUnicode_CompareWithASCIIString(medium, "GPU") == 0) {
            if (run > 0) in->gpu = run;
        } else if (PyUnicode_CompareWithASCIIString(medium, "CPU") == 0) {
            in->cpu = p;
            in->cpu_len = len;
        } else if (PyUnicode_CompareWithASCIIString(medium, "DISK") == 0) {
            in->disk = p;
            in->disk_len = len;
        }
    }
    *ninsts = n;
    return ordered;
}

/* rfc_answer(rows, names, ranks, block_size) -> bytes | None
 * rows: holder id -> bytes of 0 and 1 over the verified blocks; names: holder id ->
 * (instance, medium); ranks: instance -> (instance id, DP rank), the model's.  The
 * JSON orjson.dumps(rfc.answer(match, model)) gives, or None (more holders than
 * MAX_ANSWER_HOLDERS, or a shape it does not know) for that Python answer. */
PyObject *sarp_rfc_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "rfc_answer(rows: dict, names: dict, ranks: dict, "
                                         "block_size: int)");
        return NULL;
    }
    long long size = PyLong_AsLongLong(args[3]);
    if (size == -1 && PyErr_Occurred()) return NULL;
    sarp_calls[CALL_RFC_ANSWER]++;
    Py_ssize_t nrows = PyDict_GET_SIZE(args[0]);
    if (nrows > MAX_ANSWER_HOLDERS) Py_RETURN_NONE;
    Work w = {0};
    PyObject *result = NULL;
    Py_ssize_t ninsts = 0, nscores = 0, ndp = 0, ntiers = 0;
    if (work_init(&w, nrows ? nrows : 1) < 0) goto done;
    Py_ssize_t ordered = gather(&w, args[0], args[1], &ninsts);
    if (ordered == -2) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (ordered < 0) goto done;
    for (Py_ssize_t o = 0; o < ordered; o++) {
        Inst *in = &w.insts[w.ordered[o]];
        PyObject *who = PyDict_GetItemWithError(args[2], in->name);
        if (who == NULL) {
            if (PyErr_Occurred()) goto done;
            continue; /* not an engine of this model */
        }
        if (!PyTuple_Check(who) || PyTuple_GET_SIZE(who) != 2
            || !PyUnicode_Check(PyTuple_GET_ITEM(who, 0))
            || !PyLong_CheckExact(PyTuple_GET_ITEM(who, 1))) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *iid = PyTuple_GET_ITEM(who, 0);
        long long rank = PyLong_AsLongLong(PyTuple_GET_ITEM(who, 1));
        if (rank == -1 && PyErr_Occurred()) goto done;
        Py_ssize_t g = in->gpu, c = g + run_from(in->cpu, in->cpu_len, g);
        Py_ssize_t d = c + run_from(in->disk, in->disk_len, c);
        if (d == 0) continue;
        if (g && (nscores = upsert(w.scores, nscores, iid, rank, g * size)) < 0) goto done;
        if ((ndp = upsert(w.dp, ndp, iid, rank, g * size)) < 0) goto done;
        Py_ssize_t t = 0;
        for (; t < ntiers; t++) {
            int eq = same(w.tiers[t].iid, iid);
            if (eq < 0) goto done;
            if (eq) break;
        }
        if (t == ntiers) w.tiers[ntiers++] = (Tiers){iid, 0, 0, 0, 0};
        Tiers *tr = &w.tiers[t];
        if (g * size > tr->gpu) tr->gpu = g * size;
        if (c * size > tr->cpu) tr->cpu = c * size;
        if (d * size > tr->disk) tr->disk = d * size;
        if (d * size > tr->longest) tr->longest = d * size;
    }
    Buf *b = &w.out;
    if (PUT(b, "{\"scores\":{") < 0) goto done;
    int comma = 0;
    for (Py_ssize_t i = 0; i < nscores; i++) {
        int first = first_of(w.scores, i);
        if (first < 0) goto done;
        if (!first) continue;
        if ((comma && PUT(b, ",") < 0) || put_str(b, w.scores[i].iid) < 0 || PUT(b, ":") < 0
            || put_grouped(b, w.scores, nscores, i) < 0)
            goto done;
        comma = 1;
    }
    if (PUT(b, "},\"frequencies\":[],\"instances\":{") < 0) goto done;
    for (Py_ssize_t t = 0; t < ntiers; t++) {
        Tiers *tr = &w.tiers[t];
        Py_ssize_t at = 0; /* the iid's first dp entry */
        for (; at < ndp; at++) {
            int eq = same(w.dp[at].iid, tr->iid);
            if (eq < 0) goto done;
            if (eq) break;
        }
        if ((t && PUT(b, ",") < 0) || put_str(b, tr->iid) < 0
            || PUT(b, ":{\"longest_matched\":") < 0 || put_int(b, tr->longest) < 0
            || PUT(b, ",\"gpu\":") < 0 || put_int(b, tr->gpu) < 0 || PUT(b, ",\"dp\":") < 0
            || put_grouped(b, w.dp, ndp, at) < 0 || PUT(b, ",\"cpu\":") < 0
            || put_int(b, tr->cpu) < 0 || PUT(b, ",\"disk\":") < 0 || put_int(b, tr->disk) < 0
            || PUT(b, "}") < 0)
            goto done;
    }
    if (PUT(b, "}}") < 0) goto done;
    result = PyBytes_FromStringAndSize(b->p, b->n);
done:
    work_free(&w);
    return result;
}

/* A JSON string without escapes or control characters at *p (its opening quote), as
 * str; *p moves past its closing quote.  NULL with no error set on any doubt. */
static PyObject *plain_string(const uint8_t **p, const uint8_t *end) {
    const uint8_t *q = *p + 1, *from = q;
    while (q < end && *q != '"') {
        if (*q == '\\' || *q < 0x20) return NULL;
        q++;
    }
    if (q == end) return NULL;
    *p = q + 1;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)from, q - from, "strict");
    if (s == NULL) PyErr_Clear();
    return s;
}

static const uint8_t *skip_ws(const uint8_t *p, const uint8_t *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

enum { F_MODEL, F_GROUP, F_TENANT, F_LORA, NFIELDS };
static const char *const FIELD_NAMES[NFIELDS] = {"model_name", "routing_group", "tenant_id",
                                                 "lora_name"};

/* query_fields(body) -> (token_ids: bytes, model_name, group, lora) | None
 * (rfc.query_fields; the general parse, orjson then rfc.parse_query, its reference)
 * RFC #1403's /query body in the shape routers send, read in one pass: an object whose
 * first field is "token_ids" (an array of ints, parsed as u64_array(..., u32) does),
 * then "model_name" and optionally "routing_group" (or "tenant_id", the first of them
 * given) and "lora_name" (a string or null), each string without escapes.  group and
 * lora are None when absent (lora also when null).  None for anything else, which the
 * general parse (orjson, then rfc.parse_query) then reads and, if wrong, names. */
PyObject *sarp_query_fields(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "query_fields(body: bytes)");
        return NULL;
    }
    sarp_calls[CALL_QUERY_FIELDS]++;
    const uint8_t *base = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    const uint8_t *end = base + PyBytes_GET_SIZE(args[0]), *p = skip_ws(base, end);
    static const char head[] = "\"token_ids\"";
    if (p == end || *p++ != '{') Py_RETURN_NONE;
    p = skip_ws(p, end);
    if (end - p < (Py_ssize_t)sizeof head - 1 || memcmp(p, head, sizeof head - 1) != 0)
        Py_RETURN_NONE;
    p = skip_ws(p + sizeof head - 1, end);
    if (p == end || *p++ != ':') Py_RETURN_NONE;
    p = skip_ws(p, end);
    if (p == end || *p++ != '[') Py_RETURN_NONE;
    const uint8_t *close = memchr(p, ']', end - p);
    if (close == NULL) Py_RETURN_NONE;
    PyObject *fields[NFIELDS] = {NULL}, *out = NULL, *ids = NULL;
    PyObject *range[4] = {args[0], PyLong_FromSsize_t(p - base),
                          PyLong_FromSsize_t(close - base), Py_True};
    if (range[1] == NULL || range[2] == NULL) goto done;
    ids = sarp_u64_array(NULL, range, 4);
    if (ids == NULL || ids == Py_None) goto done;
    for (p = skip_ws(close + 1, end);; p = skip_ws(p, end)) {
        if (p == end) goto none;
        if (*p == '}') break;
        if (*p++ != ',') goto none;
        p = skip_ws(p, end);
        if (p == end || *p != '"') goto none;
        int k = 0;
        for (; k < NFIELDS; k++) {
            size_t len = strlen(FIELD_NAMES[k]);
            if ((size_t)(end - p) > len + 1 && memcmp(p + 1, FIELD_NAMES[k], len) == 0
                && p[len + 1] == '"')
                break;
        }
        if (k == NFIELDS || fields[k] != NULL) goto none; /* another field, or twice */
        p = skip_ws(p + strlen(FIELD_NAMES[k]) + 2, end);
        if (p == end || *p++ != ':') goto none;
        p = skip_ws(p, end);
        if (k == F_LORA && end - p >= 4 && memcmp(p, "null", 4) == 0) {
            fields[k] = Py_NewRef(Py_None);
            p += 4;
            continue;
        }
        if (p == end || *p != '"' || (fields[k] = plain_string(&p, end)) == NULL) {
            if (PyErr_Occurred()) goto done;
            goto none;
        }
    }
    if (skip_ws(p + 1, end) != end || fields[F_MODEL] == NULL) goto none;
    PyObject *group = fields[F_GROUP] ? fields[F_GROUP] : fields[F_TENANT];
    out = PyTuple_Pack(4, ids, fields[F_MODEL], group ? group : Py_None,
                       fields[F_LORA] ? fields[F_LORA] : Py_None);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    if (out == NULL && !PyErr_Occurred()) out = Py_NewRef(Py_None);
    for (int k = 0; k < NFIELDS; k++) Py_XDECREF(fields[k]);
    Py_XDECREF(ids);
    Py_XDECREF(range[1]);
    Py_XDECREF(range[2]);
    return out;
}

/* rfc_query(body, models, tenant, seed, max_blocks, reading) -> bytes | None
 * A whole /query in one call, when it can be: the body read as query_fields reads it,
 * its model found in `models` ((model_name, routing group) -> rfc.Model; `tenant` when
 * the body names none), its token keys (token_keys, with the local hashes' `seed`),
 * the match on a readonly LMDB index (`reading`, rfc.reading_of's: the index's lock,
 * its env's begin, the kwargs naming the segments' and the meta tables, its store,
 * memory and match observers), and the answer from the walk's rows (rfc_answer).  The
 * same bytes as the general path (serving.http's rfc_answer: rfc.query_keys,
 * Index.match(keys, with_presence="rows"), rfc.answer_c), which answers whenever this
 * gives None: a body in another shape, a LoRA adapter, a model not in the table, no
 * full block or more than `max_blocks`, the lock held (the parse thread matches), a
 * match observer, a writer's commit since this reader caught up (the Python path
 * catches up), a walk C hands back or a damaged record, more holders than C answers,
 * or any error (the general path meets it again, and says what it is).  The index's
 * match counters are not counted here. */
static PyObject *call_kw(PyObject *fn, PyObject *arg, PyObject *kwargs) {
    PyObject *args = arg == NULL ? PyTuple_New(0) : PyTuple_Pack(1, arg);
    PyObject *out = args == NULL ? NULL : PyObject_Call(fn, args, kwargs);
    Py_XDECREF(args);
    return out;
}

/* The attribute and method names rfc_query asks for, interned once (a name made and
 * hashed per request cost a few per cent of a /query under load). */
enum { N_BLOCK_SIZE, N_ROOT, N_RANKS, N_ACQUIRE, N_RELEASE, N_ABORT, N_GET, N_INDEX_ID,
       N_WATERMARK, N_DIRECTORY, N_LOOKUP, N_PROBE_DICTS, N_HOLDERS, N_NAMES, N_COUNT };
static PyObject *names_[N_COUNT];

static int names_ready(void) {
    static const char *text[N_COUNT] = {"block_size", "root", "ranks", "acquire", "release",
                                        "abort", "get", "index_id", "watermark", "directory",
                                        "lookup", "probe_dicts", "holders", "names"};
    for (int i = 0; i < N_COUNT; i++) {
        if (names_[i] == NULL && (names_[i] = PyUnicode_InternFromString(text[i])) == NULL)
            return -1;
    }
    return 0;
}

/* obj.name(), the error set before it (if any) kept, its own dropped */
static void call_aside(PyObject *obj, PyObject *name) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *got = PyObject_CallMethodNoArgs(obj, name);
    Py_XDECREF(got);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
}

/* a meta counter's 8 big-endian bytes (store.counter_value; absent: 0), or -1 */
static int counter_of(PyObject *raw, unsigned long long *value) {
    if (raw == Py_None) {
        *value = 0;
        return 0;
    }
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) != 8) return -1;
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(raw);
    unsigned long long v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | p[i];
    *value = v;
    return 0;
}

/* The index's id and next_seq read in a read-only transaction of liblmdb's own
 * (`raw`: lmdb_env.raw_reads' (engine, env, segments dbi, meta dbi)), left open in
 * *txn for the walk: 0, or -1 (no transaction, or an error set: the general path). */
static int read_raw(PyObject *raw, const RawApi **api, void **txn, unsigned *seg_dbi,
                    unsigned *meta_dbi, PyObject **id, PyObject **seq) {
    if (!PyTuple_Check(raw) || PyTuple_GET_SIZE(raw) != 4) {
        PyErr_SetString(PyExc_TypeError, "rfc_query: raw reads are (engine, env, dbi, dbi)");
        return -1;
    }
    *api = raw_api(PyTuple_GET_ITEM(raw, 0));
    void *env = *api ? PyLong_AsVoidPtr(PyTuple_GET_ITEM(raw, 1)) : NULL;
    *seg_dbi = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(raw, 2));
    *meta_dbi = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(raw, 3));
    if (env == NULL || PyErr_Occurred()) return -1;
    if ((*api)->txn_begin(env, NULL, RAW_RDONLY, txn) != 0) { /* a map grown: Python's */
        *txn = NULL;
        return -1;
    }
    static const char *names[2] = {"index_id", "next_seq"};
    PyObject **out[2] = {id, seq};
    for (int i = 0; i < 2; i++) {
        RawVal k = {strlen(names[i]), (void *)names[i]}, v = {0, NULL};
        int rc = (*api)->get(*txn, *meta_dbi, &k, &v);
        if (rc != 0 && rc != RAW_NOTFOUND) return -1;
        *out[i] = rc ? Py_NewRef(Py_None)
                     : PyBytes_FromStringAndSize((const char *)v.data, (Py_ssize_t)v.size);
        if (*out[i] == NULL) return -1;
    }
    return 0;
}

PyObject *sarp_rfc_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyBytes_Check(args[0]) || !PyDict_Check(args[1])
        || !PyTuple_Check(args[5]) || PyTuple_GET_SIZE(args[5]) != 8) {
        PyErr_SetString(PyExc_TypeError, "rfc_query(body: bytes, models: dict, tenant, seed, "
                                         "max_blocks, reading: tuple of 8)");
        return NULL;
    }
    sarp_calls[CALL_RFC_QUERY]++;
    long long max_blocks = PyLong_AsLongLong(args[4]);
    if (max_blocks == -1 && PyErr_Occurred()) return NULL;
    PyObject *lock = PyTuple_GET_ITEM(args[5], 0), *begin = PyTuple_GET_ITEM(args[5], 1),
             *at_segments = PyTuple_GET_ITEM(args[5], 2),
             *at_meta = PyTuple_GET_ITEM(args[5], 3), *store = PyTuple_GET_ITEM(args[5], 4),
             *memory = PyTuple_GET_ITEM(args[5], 5), *observers = PyTuple_GET_ITEM(args[5], 6),
             *raw = PyTuple_GET_ITEM(args[5], 7);
    PyObject *fields = NULL, *key = NULL, *bs = NULL, *root = NULL, *ranks = NULL,
             *keyed = NULL, *txn = NULL, *get = NULL, *id = NULL, *seq = NULL,
             *store_id = NULL, *mark = NULL, *dir = NULL, *lookup = NULL, *dicts = NULL,
             *walked = NULL, *holders = NULL, *names = NULL, *out = NULL, *got;
    int locked = 0;
    const RawApi *api = NULL; /* liblmdb's own read transaction (lmdb_env.raw_reads) */
    void *rtxn = NULL;
    unsigned seg_dbi = 0, meta_dbi = 0;
    fields = sarp_query_fields(NULL, args, 1);
    if (fields == NULL || fields == Py_None || PyTuple_GET_ITEM(fields, 3) != Py_None)
        goto done;  /* another shape, or a LoRA adapter's keys */
    PyObject *tenant = PyTuple_GET_ITEM(fields, 2);
    key = PyTuple_Pack(2, PyTuple_GET_ITEM(fields, 1), tenant == Py_None ? args[2] : tenant);
    PyObject *model = key ? PyDict_GetItemWithError(args[1], key) : NULL;  /* borrowed */
    if (model == NULL) goto done;
    if (names_ready() < 0) goto done;
    bs = PyObject_GetAttr(model, names_[N_BLOCK_SIZE]);
    root = bs ? PyObject_GetAttr(model, names_[N_ROOT]) : NULL;
    ranks = root ? PyObject_GetAttr(model, names_[N_RANKS]) : NULL;
    long size = ranks && PyDict_Check(ranks) ? PyLong_AsLong(bs) : -1;
    if (size <= 0) goto done;
    Py_ssize_t blocks = PyBytes_GET_SIZE(PyTuple_GET_ITEM(fields, 0)) / 4 / size;
    if (blocks == 0 || blocks > max_blocks || !PyList_Check(observers)
        || PyList_GET_SIZE(observers) != 0)
        goto done;
    PyObject *four = PyLong_FromLong(4);
    PyObject *kargs[5] = {PyTuple_GET_ITEM(fields, 0), four, bs, args[3], root};
    keyed = four ? sarp_token_keys(NULL, kargs, 5) : NULL;
    Py_XDECREF(four);
    if (keyed == NULL) goto done;
    /* Index.match on a reader: under its lock, a transaction its memory is current
     * with (recovery.catch_up's first test: the same index, no commit since) */
    got = PyObject_CallMethodOneArg(lock, names_[N_ACQUIRE], Py_False);
    locked = got == Py_True;
    Py_XDECREF(got);
    if (!locked) goto done;
    if (raw != Py_None) {
        if (read_raw(raw, &api, &rtxn, &seg_dbi, &meta_dbi, &id, &seq) < 0) goto done;
        sarp_calls[CALL_LMDB_READ]++;
    } else {
        txn = call_kw(begin, NULL, at_segments);
        get = txn ? PyObject_GetAttr(txn, names_[N_GET]) : NULL;
        PyObject *name = get ? PyBytes_FromString("index_id") : NULL;
        id = name ? call_kw(get, name, at_meta) : NULL;
        Py_XDECREF(name);
        name = id ? PyBytes_FromString("next_seq") : NULL;
        seq = name ? call_kw(get, name, at_meta) : NULL;
        Py_XDECREF(name);
    }
    store_id = seq ? PyObject_GetAttr(store, names_[N_INDEX_ID]) : NULL;
    mark = store_id ? PyObject_GetAttr(memory, names_[N_WATERMARK]) : NULL;
    unsigned long long next_seq, watermark = mark ? PyLong_AsUnsignedLongLong(mark) : 0;
    if (mark == NULL || PyErr_Occurred() || counter_of(seq, &next_seq) < 0
        || next_seq != watermark || PyObject_RichCompareBool(id, store_id, Py_EQ) != 1)
        goto done;
    dir = PyObject_GetAttr(memory, names_[N_DIRECTORY]);
    lookup = dir ? PyObject_GetAttr(dir, names_[N_LOOKUP]) : NULL;
    dicts = lookup ? PyObject_CallMethodNoArgs(dir, names_[N_PROBE_DICTS]) : NULL;
    if (dicts == NULL || !PyTuple_Check(dicts) || PyTuple_GET_SIZE(dicts) != 2) goto done;
    PyObject *wargs[6] = {get, lookup, PyTuple_GET_ITEM(dicts, 0), PyTuple_GET_ITEM(dicts, 1),
                          PyTuple_GET_ITEM(keyed, 0), Py_True};
    walked = api != NULL ? walk_raw(api, rtxn, seg_dbi, lookup, wargs[2], wargs[3], wargs[4], 1)
                         : sarp_walk(NULL, wargs, 6);
    if (walked == NULL || PyLong_AsLong(PyTuple_GET_ITEM(walked, 3)) != -1)
        goto done;  /* handed back (-2), or a damaged record: the Python walk says so */
    holders = PyObject_GetAttr(memory, names_[N_HOLDERS]);
    names = holders ? PyObject_GetAttr(holders, names_[N_NAMES]) : NULL;
    if (names == NULL) goto done;
    PyObject *rargs[4] = {PyTuple_GET_ITEM(walked, 2), names, ranks, bs};
    out = sarp_rfc_answer(NULL, rargs, 4);  /* None past MAX_ANSWER_HOLDERS */
done:
    if (rtxn != NULL) api->txn_abort(rtxn);
    if (txn != NULL) call_aside(txn, names_[N_ABORT]);
    if (locked) call_aside(lock, names_[N_RELEASE]);
    Py_XDECREF(fields);
    Py_XDECREF(key);
    Py_XDECREF(bs);
    Py_XDECREF(root);
    Py_XDECREF(ranks);
    Py_XDECREF(keyed);
    Py_XDECREF(txn);
    Py_XDECREF(get);
    Py_XDECREF(id);
    Py_XDECREF(seq);
    Py_XDECREF(store_id);
    Py_XDECREF(mark);
    Py_XDECREF(dir);
    Py_XDECREF(lookup);
    Py_XDECREF(dicts);
    Py_XDECREF(walked);
    Py_XDECREF(holders);
    Py_XDECREF(names);
    if (out == NULL) {  /* an error here is the general path's to meet and name */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return out;
}
