/* valkey_read.c: a reader's match on Valkey namespaces in one call (sarp/valkey_read.py
 * calls it; Index.match's general path, recovery.current_read and verify.walk, is the
 * reference the tests hold it equal to).
 *
 * For each namespace (a shard, or the one index): the directory's prediction for the
 * query (directory.c), the READ script's EVALSHA packed and sent on the namespace's
 * match connection; then each reply read, parsed, its counters checked against the
 * reader's memory (the catch-up's first test: the same index, nothing logged since),
 * and the walk done over the records it brought (verify.c's walk_records).  Every
 * namespace's read is sent before the first reply is read, so the nodes work at once;
 * the sockets' waits release the GIL.  The replies are read one at a time as the
 * caller asks (an iterator), so that its work on one overlaps the nodes' on the next.
 * What it cannot finish (counters moved, a record the prediction missed, an error
 * reply) comes back for the Python path to take up. */
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

/* After a send or recv that failed: 0 to try again (interrupted, or the socket ready
 * now), or -1 with an error set. */
static int try_again(int fd, short events, int timeout_ms) {
    if (errno == EINTR) return PyErr_CheckSignals() < 0 ? -1 : 0;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return wait_for(fd, events, timeout_ms);
}

static int send_all(int fd, const char *data, Py_ssize_t len, int timeout_ms) {
    while (len > 0) {
        ssize_t sent;
        Py_BEGIN_ALLOW_THREADS
        sent = send(fd, data, (size_t)len, MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (try_again(fd, POLLOUT, timeout_ms) < 0) return -1;
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

/* `count` bulk strings (or nils) at *at into arrays allocated anew (*s, *n): 1, 0 not
 * all here, -1 not bulk strings, -2 no memory. */
static int fill(const char *b, Py_ssize_t len, Py_ssize_t *at, long long count,
                const char ***s, Py_ssize_t **n) {
    PyMem_Free(*s);
    PyMem_Free(*n);
    *s = PyMem_Malloc(sizeof(char *) * (size_t)(count + 1));
    *n = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(count + 1));
    if (*s == NULL || *n == NULL) return -2;
    for (long long i = 0; i < count; i++) {
        int got = resp_bulk(b, len, at, &(*s)[i], &(*n)[i]);
        if (got <= 0) return got;
    }
    return 1;
}

#define MAX_META_FIELDS 512  /* the meta hash's fields and values (it has about 16) */

/* The READ reply in s->buf: [[meta field, value, ...], [record or nil, ...]], or an
 * error line.  1 parsed, 0 not all here, -1 another shape. */
static int parse_reply(Shard *s) {
    const char *b = s->buf;
    Py_ssize_t len = s->len, at = 0;
    if (len == 0) return 0;
    if (b[0] == '-') {  /* the whole line, its \n too: nothing of it left unread */
        const char *end = memchr(b, '\r', (size_t)len);
        if (end == NULL || end + 1 >= b + len) return 0;
        s->error = b + 1;
        s->error_len = end - b - 1;
        return end + 2 == b + len ? 1 : -1;
    }
    long long outer, nmeta, nvals;
    int got = resp_array(b, len, &at, &outer);
    if (got <= 0) return got;
    if (outer != 2) return -1;
    if ((got = resp_array(b, len, &at, &nmeta)) <= 0) return got;
    if (nmeta % 2 || nmeta > MAX_META_FIELDS) return -1;  /* (sized before it is read) */
    s->nmeta = (Py_ssize_t)nmeta;
    if ((got = fill(b, len, &at, nmeta, &s->meta, &s->meta_len)) <= 0) return got;
    if ((got = resp_array(b, len, &at, &nvals)) <= 0) return got;
    if (nvals != s->count) return -1;
    s->nvals = (Py_ssize_t)nvals;
    if ((got = fill(b, len, &at, nvals, &s->vals, &s->val_len)) <= 0) return got;
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
            if (try_again(s->fd, POLLIN, timeout_ms) < 0) return -1;
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
static const uint8_t *shard_record(void *ctx, int64_t seg_id, Py_ssize_t *len,
                                   PyObject **owner) {
    Shard *s = ctx;
    (void)owner;  /* the reply's buffer: what the walk keeps, it copies */
    for (Py_ssize_t k = 0; k < s->count; k++) {
        Py_ssize_t i = (s->cursor + k) % s->count;
        if (s->ids[i] != seg_id) continue;
        s->cursor = i;
        *len = s->vals[i] == NULL ? 0 : s->val_len[i];
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
static PyObject *answer(Shard *s, const uint8_t *query, Py_ssize_t size, int with_rows) {
    if (s->error != NULL)
        return Py_BuildValue("(sy#)", "error", s->error, s->error_len);
    if (current(s)) {
        Walk w = {.with_rows = with_rows};
        RecordSource src = {shard_probe, shard_record, s};
        s->cursor = 0;
        int done = walk_records(&src, query, size, &w);
        PyObject *out = done == 0 ? walk_answer(&w) : NULL;
        walk_release(&w);
        if (done < 0 || (done == 0 && out == NULL)) return NULL;
        if (out != NULL && PyLong_AsSsize_t(PyTuple_GET_ITEM(out, 3)) != -2) return out;
        Py_XDECREF(out);  /* more holders than C takes: the Python path walks it */
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

/* The reads sent: each shard's answer taken in order by iterating (its reply read,
 * parsed and walked), so that the caller's work on one overlaps the nodes' on the
 * next ones.  Everything it holds (the query, the directories' arrays, the buffers)
 * is let go when it is. */
typedef struct {
    PyObject_HEAD
    Shard *shards;
    Py_ssize_t nshards, next;
    Py_buffer q;
    int has_q, timeout_ms, with_rows;
} Reads;

static void shards_free(Shard *shards, Py_ssize_t nshards) {
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
}

static void reads_dealloc(Reads *r) {
    shards_free(r->shards, r->nshards);
    if (r->has_q) PyBuffer_Release(&r->q);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* The next shard's answer (see read_match); StopIteration after the last.  A socket
 * that fails raises OSError, and so does every later one: their replies are unread. */
static PyObject *reads_next(Reads *r) {
    if (r->next >= r->nshards) return NULL;  /* (StopIteration) */
    Shard *s = &r->shards[r->next++];
    if (s->fd < 0) {
        PyErr_SetString(PyExc_ConnectionError, "read_match: an earlier reply failed");
        return NULL;
    }
    if (read_reply(s, r->timeout_ms) < 0) {
        for (Py_ssize_t k = r->next; k < r->nshards; k++) r->shards[k].fd = -1;
        return NULL;
    }
    return answer(s, r->q.buf, r->q.len / 8, r->with_rows);
}

PyTypeObject sarp_ReadsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sarp._native.Reads",
    .tp_basicsize = sizeof(Reads),
    .tp_dealloc = (destructor)reads_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The READs read_match sent: iterate for each shard's answer, in order",
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)reads_next,
};

/* read_match(query, shards, timeout_ms, with_rows) -> Reads (an answer per shard)
 * query: the chain's hashes (uint64, native order).  shards: (fd, head, index_id,
 * watermark, keys, segs[, added, added_segs, gone]) each: the match connection's
 * socket, the READ command's bytes after its count (valkey_scripts.ReadAhead.head),
 * the index id and log sequence the reader's memory stands at, and the directory's
 * arrays (Directory.native_arrays).  Every shard's READ is sent before this returns;
 * iterating the result reads the replies, in order.  An answer is (total, reads,
 * {holder id: blocks} or, with_rows, {holder id: presence bytes}, stopped_at) as walk
 * gives it (with with_presence); ("reply", meta, values): the READ's reply, for the
 * Python path (the counters moved, or the walk needs what C does not do); or
 * ("error", message): the node refused the command.  A socket that fails raises
 * OSError (or TimeoutError): the replies after it are left unread then. */
PyObject *sarp_read_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_READ_MATCH]++;
    if (nargs != 4 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "read_match(query, shards: list, timeout_ms, "
                                         "with_rows)");
        return NULL;
    }
    int with_rows = PyObject_IsTrue(args[3]);
    if (with_rows < 0) return NULL;
    long timeout = PyLong_AsLong(args[2]);
    if (timeout == -1 && PyErr_Occurred()) return NULL;
    Reads *r = PyObject_New(Reads, &sarp_ReadsType);
    if (r == NULL) return NULL;
    r->nshards = PyList_GET_SIZE(args[1]);
    r->next = 0;
    r->has_q = 0;
    r->timeout_ms = timeout > 0 && timeout < INT32_MAX ? (int)timeout : -1;
    r->with_rows = with_rows;
    r->shards = PyMem_Calloc((size_t)(r->nshards ? r->nshards : 1), sizeof(Shard));
    if (r->shards == NULL) {
        r->nshards = 0;
        PyErr_NoMemory();
        goto fail;
    }
    if (PyObject_GetBuffer(args[0], &r->q, PyBUF_SIMPLE) < 0) goto fail;
    r->has_q = 1;
    for (Py_ssize_t i = 0; i < r->nshards; i++) {
        Shard *s = &r->shards[i];
        PyObject *t = PyList_GET_ITEM(args[1], i);
        Py_ssize_t n = PyTuple_Check(t) ? PyTuple_GET_SIZE(t) : 0;
        if (n != 6 && n != 9) {
            PyErr_SetString(PyExc_TypeError, "read_match: a shard is (fd, head, index_id, "
                            "watermark, keys, segs[, added, added_segs, gone])");
            goto fail;
        }
        s->fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
        s->watermark = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 3));
        if (PyErr_Occurred()) goto fail;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 1), &s->head, PyBUF_SIMPLE) < 0) goto fail;
        s->has_head = 1;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 2), &s->index_id, PyBUF_SIMPLE) < 0)
            goto fail;
        s->has_index_id = 1;
        PyObject *probe_args[6] = {args[0]};
        for (Py_ssize_t k = 4; k < n; k++) probe_args[k - 3] = PyTuple_GET_ITEM(t, k);
        if (take_probe(&s->probe, probe_args, n - 3, "read_match") < 0) goto fail;
        s->probed = 1;
        s->ids = PyMem_Malloc(sizeof(int64_t) * (size_t)(s->probe.n ? s->probe.n : 1));
        if (s->ids == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        if ((s->count = predict_ids(&s->probe, s->ids)) < 0) goto fail;
        /* EVALSHA sha 2 meta seg key...: the count, the head, then each key */
        if (grow(s, 32 + s->head.len + 14 * s->count) < 0) goto fail;
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
    for (Py_ssize_t i = 0; i < r->nshards; i++) {
        if (send_all(r->shards[i].fd, r->shards[i].buf, r->shards[i].len, r->timeout_ms) < 0)
            goto fail;
    }
    return (PyObject *)r;
fail:
    Py_DECREF(r);
    return NULL;
}
