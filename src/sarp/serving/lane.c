/*
 * The in-line lane of sarp/serving/lane.py (its reference): the live messages that come
 * next in an engine's sequence, taken from its SUB socket and decoded into the commit's
 * columns in one call, with no Python object per frame.
 *
 * libzmq is pyzmq's own (the library its extension loaded): lane.py finds its C API
 * with ctypes and hands the addresses to lane_bind once; a socket is pyzmq's
 * `Socket.underlying`.  Only the stable C API of libzmq 4 is called (zmq_msg_t is 64
 * opaque bytes there).  The caller's thread owns the socket, as for pyzmq's recv.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

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

/* One message's frames: the first KEPT as libzmq holds them, all of them as bytes in
 * `spilled` once there are more. */
typedef struct {
    zmsg f[KEPT];
    int n;
    PyObject *spilled;
} Message;

static void message_close(Message *m) {
    for (int i = 0; i < m->n && i < KEPT; i++) Z.close(&m->f[i]);
    m->n = 0;
    Py_CLEAR(m->spilled);
}

static PyObject *frame_bytes(zmsg *f) {
    return PyBytes_FromStringAndSize(Z.data(f), (Py_ssize_t)Z.size(f));
}

/* Its frames as a list of bytes (a new reference), or NULL with an error. */
static PyObject *message_frames(Message *m) {
    if (m->spilled != NULL) return Py_NewRef(m->spilled);
    int kept = m->n < KEPT ? m->n : KEPT;
    PyObject *list = PyList_New(kept);
    if (list == NULL) return NULL;
    for (int i = 0; i < kept; i++) {
        PyObject *b = frame_bytes(&m->f[i]);
        if (b == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, b);
    }
    return list;
}

/* Receive one whole message: 1 taken, 0 none waiting (EAGAIN), -2 another receive
 * error (errno in *err; the message's frames so far dropped), -1 a Python error. */
static int message_recv(void *sock, Message *m, int *err) {
    m->n = 0;
    m->spilled = NULL;
    for (;;) {
        zmsg spare, *one = m->n < KEPT ? &m->f[m->n] : &spare;
        Z.init(one);
        if (Z.recv(one, sock, ZMQ_DONTWAIT) < 0) {
            *err = Z.error();
            Z.close(one);
            if (m->n == 0 && *err == EAGAIN) return 0;
            message_close(m);
            return -2;
        }
        int more = Z.more(one);
        if (one == &spare) {
            /* a fifth frame: not a message in line; all its frames as bytes */
            if (m->spilled == NULL && (m->spilled = message_frames(m)) == NULL) {
                Z.close(one);
                message_close(m);
                return -1;
            }
            PyObject *b = frame_bytes(one);
            Z.close(one);
            if (b == NULL || PyList_Append(m->spilled, b) < 0) {
                Py_XDECREF(b);
                message_close(m);
                return -1;
            }
            Py_DECREF(b);
        }
        m->n++;
        if (!more) return 1;
    }
}

/* parse_frames: the sequence and payload frame of `[topic,] seq, payload` (an empty
 * frame before either form, or a DEALER's empty delimiter); 0 not that shape. */
static int message_parts(Message *m, int64_t *seq, zmsg **payload) {
    if (m->spilled != NULL) return 0;
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
    if (!columns_of(args[10], &c)) return NULL;
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    long long expected = PyLong_AsLongLong(args[2]);
    double floor = PyFloat_AsDouble(args[3]), slack = PyFloat_AsDouble(args[4]);
    int with_tokens = PyObject_IsTrue(args[5]);
    uint64_t root = PyLong_AsUnsignedLongLong(args[6]);
    long holder = PyLong_AsLong(args[7]);
    int has_rank = args[8] != Py_None;
    unsigned long long rank = has_rank ? PyLong_AsUnsignedLongLong(args[8]) : 0;
    int rank_fixed = PyObject_IsTrue(args[9]);
    if (PyErr_Occurred() || with_tokens < 0 || rank_fixed < 0) return NULL;
    if (sock == NULL) {
        PyErr_SetString(PyExc_ValueError, "take_line: a closed socket");
        return NULL;
    }
    Py_ssize_t entry[INTO_COLS];
    for (int i = 0; i < INTO_COLS; i++) entry[i] = PyByteArray_GET_SIZE(c.cols[i]);
    PyObject *digests = PyList_New(0), *stamps = PyList_New(0), *frames = Py_NewRef(Py_None);
    if (digests == NULL || stamps == NULL) goto fail;
    size_t events = 0, skipped = 0;
    int status = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        Message m;
        int err = 0;
        int got = message_recv(sock, &m, &err);
        if (got == 0 || got == -2) {
            status = got == 0 ? 1 : 3;
            break;
        }
        if (got < 0) goto fail;
        int64_t seq;
        zmsg *payload;
        Py_ssize_t marks[INTO_COLS];
        for (int i = 0; i < INTO_COLS; i++) marks[i] = PyByteArray_GET_SIZE(c.cols[i]);
        IntoBatch b;
        int in_line = message_parts(&m, &seq, &payload) && seq == expected + k;
        if (in_line) {
            const uint8_t *data = Z.data(payload);
            Py_ssize_t len = (Py_ssize_t)Z.size(payload);
            int read = payload_into(data, len, with_tokens, root, holder, &c, &b);
            if (read < 0) {
                message_close(&m);
                goto fail;
            }
            in_line = read == 1 && b.ts >= floor
                      && (rank_fixed ? !b.has_rank || (has_rank && b.rank == rank)
                                     : b.has_rank == has_rank && b.rank == rank);
            if (read == 1 && !in_line && columns_back(&c, marks) < 0) {
                message_close(&m);
                goto fail;
            }
            if (in_line) {
                PyObject *d = PyLong_FromUnsignedLongLong(XXH3_64bits(data, (size_t)len));
                PyObject *t = PyFloat_FromDouble(b.ts);
                int bad = d == NULL || t == NULL || PyList_Append(digests, d) < 0
                          || PyList_Append(stamps, t) < 0;
                Py_XDECREF(d);
                Py_XDECREF(t);
                if (bad) {
                    message_close(&m);
                    goto fail;
                }
                events += b.events;
                skipped += b.skipped;
                floor = b.ts - slack;
            }
        }
        if (!in_line) {
            Py_SETREF(frames, message_frames(&m));
            message_close(&m);
            if (frames == NULL) goto fail;
            status = 2;
            break;
        }
        message_close(&m);
    }
    sarp_calls[CALL_TAKE_LINE]++;
    return Py_BuildValue("(iNNnnN)", status, digests, stamps, (Py_ssize_t)events,
                         (Py_ssize_t)skipped, frames);
fail:
    /* (an error: what was taken is dropped, unapplied; the next message makes a gap,
     * which a replay proves) */
    columns_back(&c, entry);
    Py_XDECREF(digests);
    Py_XDECREF(stamps);
    Py_XDECREF(frames);
    return NULL;
}
