/* valkey_read.c: a reader's match on Valkey namespaces in one call (sarp/valkey_read.py
 * calls it; Index.match's general path, recovery.current_read and verify.walk, is the
 * reference the tests hold it equal to).
 *
 * For each namespace (a shard, or the one index): the directory's prediction for the
 * query (directory.c), the READ script's EVALSHA packed and sent on the namespace's
 * match connection; then each reply read, parsed, its counters checked against the
 * reader's memory (the catch-up's first test: the same index, nothing logged since),
 * and the walk done over the records it brought (verify.c's walk_plain).  Every
 * namespace's read is sent before the first reply is read, so the nodes work at once;
 * the sockets' waits release the GIL.  What it cannot finish (counters moved, a record
 * the prediction missed, an error reply) comes back for the Python path to take up. */
#define PY_SSIZE_T_CLEAN
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include "native.h"

/* One namespace's part of a call. */
typedef struct {
    Probe probe;
    int fd, probed;
    Py_buffer head, index_id;
    int has_head, has_index_id;
    uint64_t watermark;
    int64_t *ids;      /* the predicted segments, in query order */
    Py_ssize_t count;  /* how many */
    char *buf;         /* the command, then the reply */
    Py_ssize_t len, cap;
    /* the parsed reply: meta pairs and values (pointers into buf; NULL: nil) */
    const char **meta, **vals;
    Py_ssize_t *meta_len, *val_len, nmeta, nvals, cursor;
    const char *error;  /* an error reply's text, when it was one */
    Py_ssize_t error_len;
} Shard;

static int grow(Shard *s, Py_ssize_t need) {
    if (need <= s->cap) return 0;
    Py_ssize_t cap = s->cap ? s->cap : 4096;
    while (cap < need) cap *= 2;
    char *more = PyMem_Realloc(s->buf, (size_t)cap);
    if (more == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->buf = more;
    s->cap = cap;
    return 0;
}

/* Wait for the socket (POLLIN or POLLOUT) up to timeout_ms; 0, or -1 with an error. */
static int wait_for(int fd, short events, int timeout_ms) {
    struct pollfd p = {fd, events, 0};
    int got;
    do {
        Py_BEGIN_ALLOW_THREADS
        got = poll(&p, 1, timeout_ms);
        Py_END_ALLOW_THREADS
    } while (got < 0 && errno == EINTR && PyErr_CheckSignals() == 0);
    if (got < 0 && PyErr_Occurred()) return -1;  /* a signal's handler raised */
    if (got < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (got == 0) {
        PyErr_SetString(PyExc_TimeoutError, "read_match: Valkey did not answer in time");
        return -1;
    }
    return 0;
}

static int send_all(int fd, const char *data, Py_ssize_t len, int timeout_ms) {
    while (len > 0) {
        ssize_t sent;
        Py_BEGIN_ALLOW_THREADS
        sent = send(fd, data, (size_t)len, MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) return -1;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            if (wait_for(fd, POLLOUT, timeout_ms) < 0) return -1;
            continue;
        }
        data += sent;
        len -= sent;
    }
    return 0;
}

/* A RESP line's integer after its type byte at `*at`; moves *at past the line.
 * 1 done, 0 the line is not all here, -1 not a number. */
static int resp_int(const char *b, Py_ssize_t len, Py_ssize_t *at, long long *out) {
    const char *end = memchr(b + *at, '\r', (size_t)(len - *at));
    if (end == NULL || end + 1 >= b + len) return 0;
    if (end[1] != '\n') return -1;
    const char *p = b + *at + 1;
    int negative = p < end && *p == '-';
    if (negative) p++;
    if (p == end) return -1;
    long long v = 0;
    for (; p < end; p++) {
        if (*p < '0' || *p > '9' || v > (1LL << 50)) return -1;
        v = 10 * v + (*p - '0');
    }
    *out = negative ? -v : v;
    *at = end + 2 - b;
    return 1;
}

/* A bulk string (or nil) at *at: 1 with *s (NULL for nil) and *n, 0 not all here, -1
 * not a bulk string. */
static int resp_bulk(const char *b, Py_ssize_t len, Py_ssize_t *at, const char **s,
                     Py_ssize_t *n) {
    if (*at >= len) return 0;
    if (b[*at] == '_') {  /* RESP3's null */
        if (*at + 3 > len) return 0;
        *s = NULL;
        *at += 3;
        return 1;
    }
    if (b[*at] != '$') return -1;
    long long size;
    Py_ssize_t p = *at;
    int got = resp_int(b, len, &p, &size);
    if (got <= 0) return got;
    if (size < 0) {
        *s = NULL;
        *at = p;
        return 1;
    }
    if (p + size + 2 > len) return 0;
    *s = b + p;
    *n = (Py_ssize_t)size;
    *at = p + size + 2;
    return 1;
}

/* An array header at *at: 1 with its length, 0 not all here, -1 not an array. */
static int resp_array(const char *b, Py_ssize_t len, Py_ssize_t *at, long long *n) {
    if (*at >= len) return 0;
    if (b[*at] != '*') return -1;
    int got = resp_int(b, len, at, n);
    return got == 1 && *n < 0 ? -1 : got;
}

static int fill(const char *b, Py_ssize_t len, Py_ssize_t *at, Py_ssize_t count,
                const char **s, Py_ssize_t *n) {
    for (Py_ssize_t i = 0; i < count; i++) {
        int got = resp_bulk(b, len, at, &s[i], &n[i]);
        if (got <= 0) return got;
    }
    return 1;
}

/* The READ reply in s->buf: [[meta field, value, ...], [record or nil, ...]], or an
 * error line.  1 parsed, 0 not all here, -1 another shape. */
static int parse_reply(Shard *s) {
    const char *b = s->buf;
    Py_ssize_t len = s->len, at = 0;
    if (len == 0) return 0;
    if (b[0] == '-') {
        const char *end = memchr(b, '\r', (size_t)len);
        if (end == NULL) return 0;
        s->error = b + 1;
        s->error_len = end - b - 1;
        return 1;
    }
    long long outer, nmeta, nvals;
    int got = resp_array(b, len, &at, &outer);
    if (got <= 0) return got;
    if (outer != 2) return -1;
    if ((got = resp_array(b, len, &at, &nmeta)) <= 0) return got;
    if (nmeta % 2) return -1;
    PyMem_Free(s->meta);
    PyMem_Free(s->meta_len);
    s->meta = PyMem_Malloc(sizeof(char *) * (size_t)(nmeta + 1));
    s->meta_len = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(nmeta + 1));
    if (s->meta == NULL || s->meta_len == NULL) return -2;
    s->nmeta = (Py_ssize_t)nmeta;
    if ((got = fill(b, len, &at, s->nmeta, s->meta, s->meta_len)) <= 0) return got;
    if ((got = resp_array(b, len, &at, &nvals)) <= 0) return got;
    if (nvals != s->count) return -1;
    PyMem_Free(s->vals);
    PyMem_Free(s->val_len);
    s->vals = PyMem_Malloc(sizeof(char *) * (size_t)(nvals + 1));
    s->val_len = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(nvals + 1));
    if (s->vals == NULL || s->val_len == NULL) return -2;
    s->nvals = (Py_ssize_t)nvals;
    if ((got = fill(b, len, &at, s->nvals, s->vals, s->val_len)) <= 0) return got;
    return at == len ? 1 : -1;  /* one command, one reply: nothing after it */
}

static int read_reply(Shard *s, int timeout_ms) {
    s->len = 0;
    for (;;) {
        if (grow(s, s->len + 65536) < 0) return -1;
        ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        got = recv(s->fd, s->buf + s->len, (size_t)(s->cap - s->len), 0);
        Py_END_ALLOW_THREADS
        if (got < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) return -1;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            if (wait_for(s->fd, POLLIN, timeout_ms) < 0) return -1;
            continue;
        }
        if (got == 0) {
            PyErr_SetString(PyExc_ConnectionResetError, "read_match: Valkey closed the "
                                                        "connection");
            return -1;
        }
        s->len += got;
        int parsed = parse_reply(s);
        if (parsed == 1) return 0;
        if (parsed == -2) {
            PyErr_NoMemory();
            return -1;
        }
        if (parsed < 0) {
            PyErr_SetString(PyExc_ValueError, "read_match: a reply of another shape than "
                                              "READ's");
            return -1;
        }
    }
}

/* The reply's counters say the reader's memory is current: the same index, and the
 * log's next sequence where the memory stands (recovery.catch_up's first test). */
static int current(const Shard *s) {
    int same_index = 0, same_seq = 0;
    for (Py_ssize_t i = 0; i + 1 < s->nmeta; i += 2) {
        const char *k = s->meta[i], *v = s->meta[i + 1];
        Py_ssize_t kn = s->meta_len[i], vn = s->meta_len[i + 1];
        if (k == NULL || v == NULL) continue;
        if (kn == 8 && memcmp(k, "index_id", 8) == 0) {
            same_index = vn == s->index_id.len && memcmp(v, s->index_id.buf, (size_t)vn) == 0;
        } else if (kn == 8 && memcmp(k, "next_seq", 8) == 0 && vn == 8) {
            uint64_t seq = 0;
            for (int j = 0; j < 8; j++) seq = seq << 8 | (uint8_t)v[j];
            same_seq = seq == s->watermark;
        }
    }
    return same_index && same_seq;
}

static int64_t shard_probe(void *ctx, uint64_t hash) {
    return probe_hash(&((Shard *)ctx)->probe, hash);
}

/* A predicted segment's record from the reply (the walk visits them in query order,
 * as they were predicted: the search starts where the last one was found). */
static const uint8_t *shard_record(void *ctx, int64_t seg_id, Py_ssize_t *len) {
    Shard *s = ctx;
    for (Py_ssize_t k = 0; k < s->count; k++) {
        Py_ssize_t i = (s->cursor + k) % s->count;
        if (s->ids[i] != seg_id) continue;
        s->cursor = i;
        *len = s->val_len[i];
        return (const uint8_t *)s->vals[i];
    }
    *len = -1;  /* not predicted: not at hand */
    return NULL;
}

static PyObject *bytes_list(const char **s, const Py_ssize_t *n, Py_ssize_t count) {
    PyObject *out = PyList_New(count);
    for (Py_ssize_t i = 0; out != NULL && i < count; i++) {
        PyObject *v = s[i] == NULL ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize(s[i], n[i]);
        if (v == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* The answer of one namespace: the walk's, or what the Python path takes up. */
static PyObject *answer(Shard *s, const uint8_t *query, Py_ssize_t size) {
    if (s->error != NULL)
        return Py_BuildValue("(sy#)", "error", s->error, s->error_len);
    if (current(s)) {
        PlainWalk w;
        RecordSource src = {shard_probe, shard_record, s};
        s->cursor = 0;
        if (walk_plain(&src, query, size, &w) == 0 && w.stopped_at != -2) {
            PyObject *runs = PyDict_New();
            for (Py_ssize_t k = 0; runs != NULL && k < w.nholders; k++) {
                PyObject *id = PyLong_FromLong(w.holders[k].id);
                PyObject *blocks = PyLong_FromSsize_t(w.holders[k].blocks);
                if (id == NULL || blocks == NULL || PyDict_SetItem(runs, id, blocks) < 0)
                    Py_CLEAR(runs);
                Py_XDECREF(id);
                Py_XDECREF(blocks);
            }
            if (runs == NULL) return NULL;
            return Py_BuildValue("(nnNn)", w.total, w.reads, runs, w.stopped_at);
        }
    }
    PyObject *meta = bytes_list(s->meta, s->meta_len, s->nmeta);
    PyObject *vals = bytes_list(s->vals, s->val_len, s->nvals);
    if (meta == NULL || vals == NULL) {
        Py_XDECREF(meta);
        Py_XDECREF(vals);
        return NULL;
    }
    return Py_BuildValue("(sNN)", "reply", meta, vals);
}

/* read_match(query, shards, timeout_ms) -> [answer per shard]
 * query: the chain's hashes (uint64, native order).  shards: (fd, head, index_id,
 * watermark, keys, segs[, added, added_segs, gone]) each: the match connection's
 * socket, the READ command's bytes after its count (valkey_scripts.ReadAhead.head),
 * the index id and log sequence the reader's memory stands at, and the directory's
 * arrays (Directory._c_arrays).  An answer is (total, reads, {holder id: blocks},
 * stopped_at) as walk gives it; ("reply", meta, values): the READ's reply, for the
 * Python path (the counters moved, or the walk needs what C does not do); or
 * ("error", message): the node refused the command.  A socket that fails raises
 * OSError (or TimeoutError): the replies of the other shards may be unread then. */
PyObject *sarp_read_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_READ_MATCH]++;
    if (nargs != 3 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "read_match(query, shards: list, timeout_ms)");
        return NULL;
    }
    int timeout_ms = PyLong_AsLong(args[2]) > 0 ? (int)PyLong_AsLong(args[2]) : -1;
    if (PyErr_Occurred()) return NULL;
    Py_buffer q;
    if (PyObject_GetBuffer(args[0], &q, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t nshards = PyList_GET_SIZE(args[1]);
    Shard *shards = PyMem_Calloc((size_t)(nshards ? nshards : 1), sizeof(Shard));
    PyObject *out = NULL;
    if (shards == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nshards; i++) {
        Shard *s = &shards[i];
        PyObject *t = PyList_GET_ITEM(args[1], i);
        Py_ssize_t n = PyTuple_Check(t) ? PyTuple_GET_SIZE(t) : 0;
        if (n != 6 && n != 9) {
            PyErr_SetString(PyExc_TypeError, "read_match: a shard is (fd, head, index_id, "
                            "watermark, keys, segs[, added, added_segs, gone])");
            goto done;
        }
        s->fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
        s->watermark = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 3));
        if (PyErr_Occurred()) goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 1), &s->head, PyBUF_SIMPLE) < 0) goto done;
        s->has_head = 1;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 2), &s->index_id, PyBUF_SIMPLE) < 0)
            goto done;
        s->has_index_id = 1;
        PyObject *probe_args[6] = {args[0]};
        for (Py_ssize_t k = 4; k < n; k++) probe_args[k - 3] = PyTuple_GET_ITEM(t, k);
        if (take_probe(&s->probe, probe_args, n - 3, "read_match") < 0) goto done;
        s->probed = 1;
        s->ids = PyMem_Malloc(sizeof(int64_t) * (size_t)(s->probe.n ? s->probe.n : 1));
        if (s->ids == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if ((s->count = predict_ids(&s->probe, s->ids)) < 0) goto done;
        /* EVALSHA sha 2 meta seg key...: the count, the head, then each key */
        if (grow(s, 32 + s->head.len + 14 * s->count) < 0) goto done;
        s->len = sprintf(s->buf, "*%zd\r\n", 5 + s->count);
        memcpy(s->buf + s->len, s->head.buf, (size_t)s->head.len);
        s->len += s->head.len;
        for (Py_ssize_t k = 0; k < s->count; k++) {
            char *p = s->buf + s->len;
            memcpy(p, "$8\r\n", 4);
            for (int j = 0; j < 8; j++) p[4 + j] = (char)((uint64_t)s->ids[k] >> (56 - 8 * j));
            memcpy(p + 12, "\r\n", 2);
            s->len += 14;
        }
    }
    for (Py_ssize_t i = 0; i < nshards; i++) {
        if (send_all(shards[i].fd, shards[i].buf, shards[i].len, timeout_ms) < 0) goto done;
    }
    for (Py_ssize_t i = 0; i < nshards; i++) {
        if (read_reply(&shards[i], timeout_ms) < 0) goto done;
    }
    out = PyList_New(nshards);
    for (Py_ssize_t i = 0; out != NULL && i < nshards; i++) {
        PyObject *a = answer(&shards[i], q.buf, q.len / 8);
        if (a == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, a);
    }
done:
    for (Py_ssize_t i = 0; shards != NULL && i < nshards; i++) {
        Shard *s = &shards[i];
        if (s->probed) release_probe(&s->probe);
        if (s->has_head) PyBuffer_Release(&s->head);
        if (s->has_index_id) PyBuffer_Release(&s->index_id);
        PyMem_Free(s->ids);
        PyMem_Free(s->buf);
        PyMem_Free(s->meta);
        PyMem_Free(s->meta_len);
        PyMem_Free(s->vals);
        PyMem_Free(s->val_len);
    }
    PyMem_Free(shards);
    PyBuffer_Release(&q);
    return out;
}
