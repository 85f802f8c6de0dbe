/*
 * The in-line lane of sarp/serving/lane.py (its reference): the live messages that come
 * next in an engine's sequence, taken from its SUB socket and decoded into the commit's
 * columns in one call, with no Python object per frame.
 *
 * libzmq is pyzmq's own (the library its extension loaded): lane.py finds its C API
 * with ctypes and hands the addresses to lane_bind once; a socket is pyzmq's
 * `Socket.underlying`.  Only the stable C API of libzmq 4 is called (zmq_msg_t is 64
 * opaque bytes there).  The caller's thread owns the socket, as for pyzmq's recv.
 *
 * lane_prefetch runs the same takes on a thread of its own, without the GIL, while
 * the caller commits (its sockets are the thread's until lane_prefetch_end): into C's
 * own columns, with the names and LoRA seeds learnt so far (events.c's Known).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../native.h"

typedef struct {
    _Alignas(8) unsigned char _[64];
} zmsg;

static struct {
    int (*init)(zmsg *);
    int (*recv)(zmsg *, void *, int);
    void *(*data)(zmsg *);
    size_t (*size)(const zmsg *);
    int (*more)(const zmsg *);
    int (*close)(zmsg *);
    int (*error)(void);
} Z;
static int bound;

#define ZMQ_DONTWAIT 1
#define KEPT 4 /* frames a message in line has at most (parse_frames) */

/* lane_bind(addresses) -> None: libzmq's zmq_msg_init, zmq_msg_recv, zmq_msg_data,
 * zmq_msg_size, zmq_msg_more, zmq_msg_close and zmq_errno, as integers. */
PyObject *sarp_lane_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 7) {
        PyErr_SetString(PyExc_TypeError, "lane_bind((init, recv, data, size, more, close, "
                                         "errno))");
        return NULL;
    }
    void *at[7];
    for (int i = 0; i < 7; i++) {
        at[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[0], i));
        if (at[i] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lane_bind: a null address");
            return NULL;
        }
    }
    memcpy(&Z.init, &at[0], sizeof(void *));
    memcpy(&Z.recv, &at[1], sizeof(void *));
    memcpy(&Z.data, &at[2], sizeof(void *));
    memcpy(&Z.size, &at[3], sizeof(void *));
    memcpy(&Z.more, &at[4], sizeof(void *));
    memcpy(&Z.close, &at[5], sizeof(void *));
    memcpy(&Z.error, &at[6], sizeof(void *));
    bound = 1;
    Py_RETURN_NONE;
}

/* One message's frames, as libzmq holds them: the first KEPT in `f`, any more in
 * `extra` (malloc'd).  Kept without the GIL; made bytes by message_frames. */
typedef struct {
    zmsg f[KEPT];
    zmsg *extra;
    int n, extra_cap;
} Message;

static zmsg *message_frame(Message *m, int i) { return i < KEPT ? &m->f[i] : &m->extra[i - KEPT]; }

static void message_close(Message *m) {
    for (int i = 0; i < m->n; i++) Z.close(message_frame(m, i));
    free(m->extra);
    m->extra = NULL;
    m->n = m->extra_cap = 0;
}

/* Its frames as a list of bytes (a new reference), or NULL with an error. */
static PyObject *message_frames(Message *m) {
    PyObject *list = PyList_New(m->n);
    if (list == NULL) return NULL;
    for (int i = 0; i < m->n; i++) {
        zmsg *f = message_frame(m, i);
        PyObject *b = PyBytes_FromStringAndSize(Z.data(f), (Py_ssize_t)Z.size(f));
        if (b == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, b);
    }
    return list;
}

/* Receive one whole message (no GIL needed): 1 taken, 0 none waiting (EAGAIN), -2
 * another receive error (errno in *err; the message's frames so far dropped), -1 out
 * of memory (the same). */
static int message_recv(void *sock, Message *m, int *err) {
    m->n = m->extra_cap = 0;
    m->extra = NULL;
    for (;;) {
        if (m->n >= KEPT && m->n - KEPT == m->extra_cap) {
            int cap = m->extra_cap ? 2 * m->extra_cap : 4;
            zmsg *extra = realloc(m->extra, (size_t)cap * sizeof(zmsg));
            if (extra == NULL) {
                message_close(m);
                return -1;
            }
            m->extra = extra;
            m->extra_cap = cap;
        }
        zmsg *one = message_frame(m, m->n);
        Z.init(one);
        if (Z.recv(one, sock, ZMQ_DONTWAIT) < 0) {
            *err = Z.error();
            Z.close(one);
            if (m->n == 0 && *err == EAGAIN) {
                message_close(m);
                return 0;
            }
            message_close(m);
            return -2;
        }
        m->n++;
        if (!Z.more(one)) return 1;
    }
}

/* parse_frames: the sequence and payload frame of `[topic,] seq, payload` (an empty
 * frame before either form, or a DEALER's empty delimiter); 0 not that shape. */
static int message_parts(Message *m, int64_t *seq, zmsg **payload) {
    if (m->n > KEPT) return 0;
    int at = 0, n = m->n;
    if (n == 4 && Z.size(&m->f[0]) == 0) at = 1, n = 3;
    if (n == 3 && Z.size(&m->f[at]) == 0 && Z.size(&m->f[at + 1]) == 8) at++, n = 2;
    if (n == 3) at++, n = 2;
    if (n != 2 || Z.size(&m->f[at]) != 8) return 0;
    const uint8_t *b = Z.data(&m->f[at]);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | b[i];
    *seq = (int64_t)v;
    *payload = &m->f[at + 1];
    return 1;
}

enum { TAKEN_ALL = 0, DRY = 1, NOT_IN_LINE = 2, RECV_FAILED = 3 };

/* Where a source's line stands, and what it asks of its messages (take_line's
 * arguments). */
typedef struct {
    void *sock;
    long long expected;
    double floor, slack;
    int with_tokens, has_rank, rank_fixed;
    uint64_t root;
    unsigned long long rank;
    long holder;
} Line;

/* What one take got: the digests and timestamps of the messages taken, their events
 * and those skipped, the rows they added to the columns, and the message after them
 * when it was not in line (`parked`). */
typedef struct {
    uint64_t *digests;
    double *stamps;
    Py_ssize_t n, cap, rows;
    size_t events, skipped;
    int status;
    Message parked;
} Take;

static void take_free(Take *t) {
    free(t->digests);
    free(t->stamps);
    message_close(&t->parked);
    t->digests = NULL;
    t->stamps = NULL;
}

/* Up to `count` messages of `line` in line into the columns (take_line's rules; the
 * GIL held unless c->bufs): 0, with *t filled and the line moved on past them, or -1
 * (an error: with the GIL an exception, without it c->nomem; the columns as they were
 * and *t freed). */
static int take_core(Line *line, Py_ssize_t count, IntoCols *c, Take *t) {
    memset(t, 0, sizeof(*t));
    Py_ssize_t entry[INTO_COLS];
    for (int i = 0; i < INTO_COLS; i++) entry[i] = col_len(c, i);
    t->status = TAKEN_ALL;
    for (Py_ssize_t k = 0; k < count; k++) {
        Message m;
        int err = 0;
        int got = message_recv(line->sock, &m, &err);
        if (got == 0 || got == -2) {
            t->status = got == 0 ? DRY : RECV_FAILED;
            break;
        }
        if (got < 0) goto nomem;
        int64_t seq;
        zmsg *payload;
        Py_ssize_t marks[INTO_COLS];
        for (int i = 0; i < INTO_COLS; i++) marks[i] = col_len(c, i);
        IntoBatch b;
        int in_line = message_parts(&m, &seq, &payload) && seq == line->expected;
        if (in_line) {
            const uint8_t *data = Z.data(payload);
            Py_ssize_t len = (Py_ssize_t)Z.size(payload);
            int read = payload_into(data, len, line->with_tokens, line->root, line->holder, c, &b);
            if (read < 0) {
                message_close(&m);
                goto fail;
            }
            in_line = read == 1 && b.ts >= line->floor
                      && (line->rank_fixed ? !b.has_rank || (line->has_rank && b.rank == line->rank)
                                           : b.has_rank == line->has_rank && b.rank == line->rank);
            if (read == 1 && !in_line && columns_back(c, marks) < 0) {
                message_close(&m);
                goto fail;
            }
            if (in_line) {
                if (t->n == t->cap) {
                    Py_ssize_t cap = t->cap ? 2 * t->cap : 16;
                    uint64_t *d = realloc(t->digests, (size_t)cap * sizeof(uint64_t));
                    if (d != NULL) t->digests = d;
                    double *s = d == NULL ? NULL : realloc(t->stamps, (size_t)cap * sizeof(double));
                    if (s == NULL) {
                        message_close(&m);
                        goto nomem;
                    }
                    t->stamps = s;
                    t->cap = cap;
                }
                t->digests[t->n] = XXH3_64bits(data, (size_t)len);
                t->stamps[t->n++] = b.ts;
                t->events += b.events;
                t->skipped += b.skipped;
                line->floor = b.ts - line->slack;
                line->expected++;
            }
        }
        if (!in_line) {
            t->parked = m;
            t->status = NOT_IN_LINE;
            break;
        }
        message_close(&m);
    }
    t->rows = col_len(c, 0) - entry[0];
    return 0;
nomem:
    if (c->bufs == NULL) PyErr_NoMemory();
    c->nomem = 1;
fail:
    /* (an error: what was taken is dropped, unapplied; the next message makes a gap,
     * which a replay proves) */
    columns_back(c, entry);
    take_free(t);
    return -1;
}

/* A take as take_line answers it: (status, digests, stamps, events, skipped, frames). */
static PyObject *take_result(Take *t) {
    PyObject *digests = PyList_New(t->n), *stamps = PyList_New(t->n), *frames = NULL;
    if (digests == NULL || stamps == NULL) goto fail;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(t->digests[i]);
        PyObject *s = PyFloat_FromDouble(t->stamps[i]);
        if (d == NULL || s == NULL) {
            Py_XDECREF(d);
            Py_XDECREF(s);
            goto fail;
        }
        PyList_SET_ITEM(digests, i, d);
        PyList_SET_ITEM(stamps, i, s);
    }
    frames = t->status == NOT_IN_LINE ? message_frames(&t->parked) : Py_NewRef(Py_None);
    if (frames == NULL) goto fail;
    return Py_BuildValue("(iNNnnN)", t->status, digests, stamps, (Py_ssize_t)t->events,
                         (Py_ssize_t)t->skipped, frames);
fail:
    Py_XDECREF(digests);
    Py_XDECREF(stamps);
    return NULL;
}

/* take_line's arguments from `args` (9 of them, from the socket on); 0 with an error. */
static int line_of(PyObject *const *args, Line *line) {
    line->sock = PyLong_AsVoidPtr(args[0]);
    line->expected = PyLong_AsLongLong(args[1]);
    line->floor = PyFloat_AsDouble(args[2]);
    line->slack = PyFloat_AsDouble(args[3]);
    line->with_tokens = PyObject_IsTrue(args[4]);
    line->root = PyLong_AsUnsignedLongLong(args[5]);
    line->holder = PyLong_AsLong(args[6]);
    line->has_rank = args[7] != Py_None;
    line->rank = line->has_rank ? PyLong_AsUnsignedLongLong(args[7]) : 0;
    line->rank_fixed = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred() || line->with_tokens < 0 || line->rank_fixed < 0) return 0;
    if (line->sock == NULL) {
        PyErr_SetString(PyExc_ValueError, "take_line: a closed socket");
        return 0;
    }
    return 1;
}

/* take_line(socket, count, expected, ts_floor, slack, with_tokens, root, holder, rank,
 *           rank_fixed, ctx) -> (status, digests, stamps, events, skipped, frames)
 * Up to `count` messages from the socket whose sequences are `expected`, `expected`
 * + 1, ..., each decoded into the columns (ctx: decode_into's) under `holder` as
 * Columns.add would, with its payload's digest (xxh3-64) and timestamp appended to
 * `digests` and `stamps`.  A message stays in line while its timestamp is at least
 * `ts_floor` (then the last one's less `slack`) and its dp_rank is `rank` (None or
 * an int; with `rank_fixed`, one without a rank is in line too).  status: 0 `count`
 * taken, 1 the socket ran dry, 2 the message after them is not in line (its frames,
 * as bytes, in `frames`; nothing of it in the columns), 3 a receive failed (pyzmq's
 * recv says why). */
PyObject *sarp_take_line(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "take_line(socket, count, expected, ts_floor, slack, "
                                         "with_tokens, root, holder, rank, rank_fixed, ctx)");
        return NULL;
    }
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "take_line: lane_bind was not called");
        return NULL;
    }
    IntoCols c;
    Line line;
    const PyObject *line_args[9] = {args[0], args[2], args[3], args[4], args[5], args[6],
                                    args[7], args[8], args[9]};
    if (!columns_of(args[10], &c) || !line_of((PyObject *const *)line_args, &line)) return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t entry[INTO_COLS];
    for (int i = 0; i < INTO_COLS; i++) entry[i] = col_len(&c, i);
    Take t;
    if (take_core(&line, count, &c, &t) < 0) return NULL;
    PyObject *out = take_result(&t);
    if (out == NULL) columns_back(&c, entry); /* (what was taken is dropped, as on an error) */
    take_free(&t);
    sarp_calls[CALL_TAKE_LINE]++;
    return out;
}

/* -- the prefetch: takes on a thread of its own while the caller commits ---------------- */

typedef struct {
    Line *lines;
    Py_ssize_t nlines, count;
    size_t max_events;
    int *done;            /* per line: dry, out of line or failed */
    ColBuf bufs[INTO_COLS];
    Known known;
    Take *takes;
    Py_ssize_t *take_line_of; /* each take's line */
    Py_ssize_t ntakes, takes_cap;
    int stop, nomem, running;
    pthread_t thread;
} Prefetch;

static int stop_asked(Prefetch *pf) { return __atomic_load_n(&pf->stop, __ATOMIC_ACQUIRE); }

/* The prefetch's thread: round after round, up to `count` messages of each line
 * still going, until every line has stopped, `max_events` were taken, or the caller
 * asks it to stop. */
static void *prefetch_run(void *arg) {
    Prefetch *pf = arg;
    IntoCols c = {.bufs = pf->bufs, .known = &pf->known};
    size_t events = 0;
    int going = 1;
    while (going && !stop_asked(pf) && events < pf->max_events) {
        going = 0;
        for (Py_ssize_t j = 0; j < pf->nlines && !stop_asked(pf); j++) {
            if (pf->done[j]) continue;
            if (pf->ntakes == pf->takes_cap) {
                Py_ssize_t cap = pf->takes_cap ? 2 * pf->takes_cap : 16;
                Take *takes = realloc(pf->takes, (size_t)cap * sizeof(Take));
                if (takes != NULL) pf->takes = takes;
                Py_ssize_t *of = takes == NULL ? NULL
                                 : realloc(pf->take_line_of, (size_t)cap * sizeof(Py_ssize_t));
                if (of == NULL) {
                    pf->nomem = 1;
                    return NULL;
                }
                pf->take_line_of = of;
                pf->takes_cap = cap;
            }
            Take *t = &pf->takes[pf->ntakes];
            if (take_core(&pf->lines[j], pf->count, &c, t) < 0) {
                pf->nomem = 1;
                return NULL;
            }
            if (t->status != TAKEN_ALL) pf->done[j] = 1;
            else going = 1;
            if (t->n == 0 && t->status != NOT_IN_LINE) {
                take_free(t);
                continue;
            }
            pf->take_line_of[pf->ntakes++] = j;
            events += t->events;
        }
    }
    return NULL;
}

static void prefetch_free(Prefetch *pf) {
    for (Py_ssize_t i = 0; i < pf->ntakes; i++) take_free(&pf->takes[i]);
    for (int i = 0; i < INTO_COLS; i++) colbuf_free(&pf->bufs[i]);
    for (Py_ssize_t i = 0; i < pf->known.npairs; i++) free((void *)pf->known.pairs[i].medium);
    for (Py_ssize_t i = 0; i < pf->known.nseeds; i++) free((void *)pf->known.seeds[i].name);
    free(pf->known.pairs);
    free(pf->known.seeds);
    free(pf->takes);
    free(pf->take_line_of);
    free(pf->lines);
    free(pf->done);
    free(pf);
}

/* Ask the thread to stop (unless `finish`: let it end by itself) and wait for it (the
 * GIL let go meanwhile when `release`). */
static void prefetch_join(Prefetch *pf, int release, int finish) {
    if (!pf->running) return;
    if (!finish) __atomic_store_n(&pf->stop, 1, __ATOMIC_RELEASE);
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(pf->thread, NULL);
        Py_END_ALLOW_THREADS
    } else {
        pthread_join(pf->thread, NULL);
    }
    pf->running = 0;
}

static void prefetch_capsule_free(PyObject *capsule) {
    Prefetch *pf = PyCapsule_GetPointer(capsule, "sarp.prefetch");
    if (pf == NULL) return;
    prefetch_join(pf, 0, 0); /* (its thread never takes the GIL) */
    prefetch_free(pf);
}

/* A copy of UTF-8 `s` (str) or NULL for None: 1, 0 with an error. */
static int utf8_copy(PyObject *s, const char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    if (s == Py_None) return 1;
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL) return 0;
    char *copy = malloc((size_t)n + 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    memcpy(copy, u, (size_t)n + 1);
    *out = copy;
    *len = (size_t)n;
    return 1;
}

/* What the columns learnt: pairs [(holder, medium | None, index | None)] and seeds
 * [(lora_name | None, seed)]; 0 with an error. */
static int known_of(PyObject *pairs, PyObject *seeds, Known *k) {
    if (!PyList_Check(pairs) || !PyList_Check(seeds)) {
        PyErr_SetString(PyExc_TypeError, "lane_prefetch: pairs and seeds are lists");
        return 0;
    }
    Py_ssize_t np = PyList_GET_SIZE(pairs), ns = PyList_GET_SIZE(seeds);
    k->pairs = calloc((size_t)(np ? np : 1), sizeof(KnownPair));
    k->seeds = calloc((size_t)(ns ? ns : 1), sizeof(KnownSeed));
    if (k->pairs == NULL || k->seeds == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *p = PyList_GET_ITEM(pairs, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 3) {
            PyErr_SetString(PyExc_TypeError, "lane_prefetch: a pair is (holder, medium, index)");
            return 0;
        }
        KnownPair *kp = &k->pairs[k->npairs++];
        kp->holder = PyLong_AsLong(PyTuple_GET_ITEM(p, 0));
        PyObject *index = PyTuple_GET_ITEM(p, 2);
        kp->index = index == Py_None ? -1 : (int32_t)PyLong_AsLong(index);
        if (PyErr_Occurred() || !utf8_copy(PyTuple_GET_ITEM(p, 1), &kp->medium, &kp->medium_len))
            return 0;
    }
    for (Py_ssize_t i = 0; i < ns; i++) {
        PyObject *e = PyList_GET_ITEM(seeds, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 2) {
            PyErr_SetString(PyExc_TypeError, "lane_prefetch: a seed is (name, seed)");
            return 0;
        }
        KnownSeed *ks = &k->seeds[k->nseeds++];
        ks->seed = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 1));
        if (PyErr_Occurred() || !utf8_copy(PyTuple_GET_ITEM(e, 0), &ks->name, &ks->name_len))
            return 0;
    }
    return 1;
}

/* lane_prefetch(lines, count, max_events, pairs, seeds) -> handle
 * lines: [(socket, expected, ts_floor, slack, with_tokens, root, holder, rank,
 * rank_fixed)], take_line's arguments without count and ctx.  Starts a thread that
 * takes, round after round, up to `count` messages in line from each (as take_line,
 * into columns of its own, learning no name: a (holder, medium) pair or a LoRA name
 * not in `pairs` or `seeds` leaves its message out of line), until every line has
 * stopped or `max_events` were taken, or lane_prefetch_end.  The sockets are the
 * thread's until then. */
PyObject *sarp_lane_prefetch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "lane_prefetch(lines: list, count, max_events, "
                                         "pairs, seeds)");
        return NULL;
    }
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "lane_prefetch: lane_bind was not called");
        return NULL;
    }
    Prefetch *pf = calloc(1, sizeof(Prefetch));
    if (pf == NULL) return PyErr_NoMemory();
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    pf->lines = calloc((size_t)(n ? n : 1), sizeof(Line));
    pf->done = calloc((size_t)(n ? n : 1), sizeof(int));
    if (pf->lines == NULL || pf->done == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *t = PyList_GET_ITEM(args[0], j);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 9) {
            PyErr_SetString(PyExc_TypeError, "lane_prefetch: a line is take_line's arguments "
                                             "without count and ctx");
            goto fail;
        }
        if (!line_of(&PyTuple_GET_ITEM(t, 0), &pf->lines[j])) goto fail;
        pf->nlines++;
    }
    pf->count = PyLong_AsSsize_t(args[1]);
    pf->max_events = (size_t)PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred() || !known_of(args[3], args[4], &pf->known)) goto fail;
    if (pf->count < 1) {
        PyErr_SetString(PyExc_ValueError, "lane_prefetch: count is 1 or more");
        goto fail;
    }
    decode_ready();
    if (pthread_create(&pf->thread, NULL, prefetch_run, pf) != 0) {
        PyErr_SetString(PyExc_OSError, "lane_prefetch: no thread");
        goto fail;
    }
    pf->running = 1;
    PyObject *capsule = PyCapsule_New(pf, "sarp.prefetch", prefetch_capsule_free);
    if (capsule == NULL) {
        prefetch_join(pf, 1, 0);
        goto fail;
    }
    return capsule;
fail:
    prefetch_free(pf);
    return NULL;
}

/* lane_prefetch_end(handle, ctx, finish) -> [(line, rows, (status, digests, stamps,
 * events, skipped, frames))] | None
 * Stops the prefetch's thread (with `finish`, lets it end by itself: every line
 * stopped, or `max_events`) and waits for it; with ctx (decode_into's), appends
 * what it decoded to those columns, and answers its takes in the order taken, each
 * as take_line would have (`rows`: the rows it added, in order from the columns' end
 * before); with None, drops it all (its messages are lost: a gap, which a replay
 * proves).  A handle ends once. */
PyObject *sarp_lane_prefetch_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int finish = nargs == 3 ? PyObject_IsTrue(args[2]) : -1;
    if (finish < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "lane_prefetch_end(handle, ctx | None, finish)");
        return NULL;
    }
    Prefetch *pf = PyCapsule_GetPointer(args[0], "sarp.prefetch");
    if (pf == NULL) return NULL;
    if (PyCapsule_GetContext(args[0]) != NULL) {
        PyErr_SetString(PyExc_ValueError, "lane_prefetch_end: this prefetch has ended");
        return NULL;
    }
    prefetch_join(pf, 1, finish);
    if (PyCapsule_SetContext(args[0], pf) < 0) return NULL; /* (ended) */
    PyObject *out = NULL;
    IntoCols c;
    if (args[1] == Py_None) {
        out = Py_NewRef(Py_None);
    } else if (pf->nomem) {
        PyErr_NoMemory();
    } else if (columns_of(args[1], &c)) {
        Py_ssize_t at[INTO_COLS];
        int ok = 1;
        for (int i = 0; i < INTO_COLS && ok; i++) {
            at[i] = PyByteArray_GET_SIZE(c.cols[i]);
            ok = PyByteArray_Resize(c.cols[i], at[i] + pf->bufs[i].len) == 0;
            if (ok && pf->bufs[i].len)
                memcpy(PyByteArray_AS_STRING(c.cols[i]) + at[i], pf->bufs[i].p,
                       (size_t)pf->bufs[i].len);
        }
        out = ok ? PyList_New(pf->ntakes) : NULL;
        for (Py_ssize_t i = 0; out != NULL && i < pf->ntakes; i++) {
            PyObject *r = take_result(&pf->takes[i]);
            PyObject *item = r == NULL ? NULL
                             : Py_BuildValue("(nnO)", pf->take_line_of[i], pf->takes[i].rows, r);
            Py_XDECREF(r);
            if (item == NULL) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, item);
        }
        if (out == NULL) columns_back(&c, at);
        else sarp_calls[CALL_TAKE_LINE] += (unsigned long long)pf->ntakes;
    }
    /* what it held goes now (the capsule keeps only the ended mark) */
    for (Py_ssize_t i = 0; i < pf->ntakes; i++) take_free(&pf->takes[i]);
    pf->ntakes = 0;
    for (int i = 0; i < INTO_COLS; i++) colbuf_free(&pf->bufs[i]);
    return out;
}
