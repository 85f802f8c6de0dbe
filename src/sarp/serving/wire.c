/*
 * The C mirror of sarp/serving/wire.py's Connection, for the requests routers send
 * most (sarp._native.Conn; wire.take loads it): a keep-alive connection whose
 * requests are in a strict subset of HTTP/1.1 is read, framed and answered here, each
 * request one call of its route's Python handler and nothing else in Python; at the
 * first byte outside the subset the connection, with what it has read and not yet
 * answered, is handed to wire.Connection (the reference), which serves it from then on.
 *
 * The subset, the shape of what routers' HTTP clients send: a request line
 * `METHOD SP PATH SP HTTP/1.1` whose `METHOD PATH` is one of the routes given; header
 * lines `Name: value` ending in CRLF, names of token characters, values without
 * control characters, at most MAX_HEADERS of them in MAX_HEAD_BYTES; a
 * Content-Length of digits on a POST (none, or 0, on a GET) of at most `max_body`;
 * no Transfer-Encoding, Expect or Upgrade, and Connection only as "keep-alive" or
 * "close".  Anything else (HEAD, HTTP/1.0, a query string, an unknown path, chunked
 * bodies, a header line folded or too long) is the reference's, with every bound and
 * refusal it has.
 *
 * An answer that closes the connection (the request asked to, or the handler's
 * Response does) is sent, then the connection lingers as the reference's does: our
 * side shut (FIN), what the client still sends read and dropped (up to
 * MAX_LINGER_BYTES) until it closes, within the request bound.  What stays the
 * reference's: an answer the socket does not take at once (the rest is handed over,
 * and the Python transport's flow control and answer bound take it).  Here a
 * connection never waits on a handler or on the client, so of wire.Connection's time
 * bounds two apply, read by Server.sweep through expired(): a request's bytes (or a
 * linger) within `request_timeout_s` of its first, and at most `idle_timeout_s`
 * between requests.
 *
 * The side object (wire._Side) gives three calls: release(conn, fd) before the
 * descriptor is closed or handed over (the loop's reader removed, the server's set
 * left), hand_over(fd, rest, out, linger), and frame(response, close) -> (bytes,
 * close) for a handler's answer that is not plain 200 JSON bytes.
 */
#define _GNU_SOURCE /* memmem */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../native.h"

enum {
    MAX_ROUTES = 8,
    MAX_HEADERS = 100,          /* wire.MAX_HEADERS */
    MAX_HEAD_BYTES = 8 << 10,   /* the request line and headers; more: the reference's */
    FLUSH_BYTES = 256 << 10,    /* answers sent once this much waits */
    KEPT_BYTES = 16 << 10,      /* what an idle connection keeps of each buffer */
};
#define MAX_LINGER_BYTES ((Py_ssize_t)64 << 20) /* wire.MAX_LINGER_BYTES */

typedef struct {
    PyObject_HEAD
    int fd;
    int nroutes;
    PyObject *keys[MAX_ROUTES];      /* bytes: b"POST /query" */
    PyObject *handlers[MAX_ROUTES];  /* handler(body, authorization) -> bytes | Response */
    PyObject *release, *hand_over, *frame;
    double request_timeout, idle_timeout, pending_since, last_activity;
    Py_ssize_t max_body;
    uint8_t *in;
    Py_ssize_t in_len, in_cap, in_max;  /* in_max: a request's head and body, and more */
    uint8_t *out;
    Py_ssize_t out_len, out_cap;
    Py_ssize_t lingering;  /* -1, or the bytes dropped since the answer that closes */
} Conn;

static double now_s(void) { /* time.monotonic()'s clock */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* RFC 9110's tchar: the bytes a header name may hold */
static int is_tchar(uint8_t c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
           || (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

static int named(const uint8_t *name, Py_ssize_t n, const char *lower) {
    return (size_t)n == strlen(lower) && strncasecmp((const char *)name, lower, n) == 0;
}

typedef struct {
    int route;
    Py_ssize_t body_at, body_len, total;
    const uint8_t *auth;
    Py_ssize_t auth_len;
    int close;  /* Connection: close */
} Parsed;

/* One request at p[0:n]: 1 with `r` filled, 0 when its bytes are not all here yet, -1
 * when it is outside the subset (the reference takes the connection). */
static int parse_one(Conn *c, const uint8_t *p, Py_ssize_t n, Parsed *r) {
    Py_ssize_t look = n < MAX_HEAD_BYTES + 4 ? n : MAX_HEAD_BYTES + 4;
    const uint8_t *end = memmem(p, look, "\r\n\r\n", 4);
    if (end == NULL) return n >= MAX_HEAD_BYTES + 4 ? -1 : 0;
    Py_ssize_t head = end - p;  /* the bytes before the blank line */
    const uint8_t *eol = memchr(p, '\n', head + 2);
    if (eol == p || eol[-1] != '\r') return -1;
    Py_ssize_t line = eol - 1 - p;  /* the request line, without its CRLF */
    static const char version[] = " HTTP/1.1";
    Py_ssize_t target_end = line - (Py_ssize_t)(sizeof version - 1);
    if (target_end <= 0 || memcmp(p + target_end, version, sizeof version - 1) != 0) return -1;
    r->route = -1;
    for (int i = 0; i < c->nroutes; i++) {
        if (PyBytes_GET_SIZE(c->keys[i]) == target_end
            && memcmp(PyBytes_AS_STRING(c->keys[i]), p, target_end) == 0) {
            r->route = i;
            break;
        }
    }
    if (r->route < 0) return -1;
    int get = memcmp(p, "GET ", 4) == 0;  /* (a route key is longer than 4 bytes) */
    Py_ssize_t length = -1;
    int headers = 0;
    r->auth = NULL;
    r->auth_len = 0;
    r->close = 0;
    for (const uint8_t *q = eol + 1; q < end + 2;) {
        const uint8_t *e = memchr(q, '\n', end + 2 - q);
        if (e == NULL || e[-1] != '\r' || ++headers > MAX_HEADERS) return -1;
        const uint8_t *colon = q, *stop = e - 1;
        while (colon < stop && is_tchar(*colon)) colon++;
        if (colon == q || colon == stop || *colon != ':') return -1;  /* folded, or no name */
        const uint8_t *v = colon + 1, *ve = stop;
        while (v < ve && (*v == ' ' || *v == '\t')) v++;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
        for (const uint8_t *x = v; x < ve; x++)
            if ((*x < 0x20 && *x != '\t') || *x == 0x7f) return -1;
        Py_ssize_t nlen = colon - q, vlen = ve - v;
        if (named(q, nlen, "content-length")) {
            if (length >= 0 || vlen == 0 || vlen > 9) return -1;
            length = 0;
            for (const uint8_t *x = v; x < ve; x++) {
                if (*x < '0' || *x > '9') return -1;
                length = length * 10 + (*x - '0');
            }
        } else if (named(q, nlen, "authorization")) {
            if (r->auth != NULL) return -1;
            r->auth = v;
            r->auth_len = vlen;
        } else if (named(q, nlen, "connection")) {
            if (named(v, vlen, "close"))
                r->close = 1;
            else if (!named(v, vlen, "keep-alive"))
                return -1;
        } else if (named(q, nlen, "transfer-encoding") || named(q, nlen, "expect")
                   || named(q, nlen, "upgrade")) {
            return -1;
        }
        q = e + 1;
    }
    if (get ? length > 0 : length < 0) return -1;
    if (length < 0) length = 0;
    if (length > c->max_body) return -1;
    r->body_at = head + 4;
    r->body_len = length;
    r->total = head + 4 + length;
    return n >= r->total ? 1 : 0;
}

static int reserve_out(Conn *c, Py_ssize_t more) {
    if (c->out_len + more <= c->out_cap) return 0;
    Py_ssize_t cap = c->out_cap ? c->out_cap : 4096;
    while (cap < c->out_len + more) cap *= 2;
    uint8_t *p = PyMem_Realloc(c->out, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->out = p;
    c->out_cap = cap;
    return 0;
}

/* wire.frame(Response(body), close): the same bytes */
static int put_ok(Conn *c, const char *body, Py_ssize_t n, int close) {
    char head[160];
    int h = snprintf(head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Type: application/json"
                     "\r\nContent-Length: %zd\r\n%s\r\n", n,
                     close ? "Connection: close\r\n" : "");
    if (reserve_out(c, h + n) < 0) return -1;
    memcpy(c->out + c->out_len, head, h);
    memcpy(c->out + c->out_len + h, body, n);
    c->out_len += h + n;
    return 0;
}

/* Send what waits: 1 all sent, 0 the socket took part (the rest stays in `out`), -1
 * the connection is gone. */
static int flush(Conn *c) {
    Py_ssize_t sent = 0;
    while (sent < c->out_len) {
        ssize_t k = send(c->fd, c->out + sent, c->out_len - sent, MSG_NOSIGNAL);
        if (k > 0) {
            sent += k;
        } else if (k < 0 && errno == EINTR) {
            continue;
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
        } else {
            return -1;
        }
    }
    memmove(c->out, c->out + sent, c->out_len - sent);
    c->out_len -= sent;
    return c->out_len == 0;
}

/* The descriptor leaves this object: the side's release (the reader removed), then
 * closed here or handed to the reference with what was read and not answered
 * (`rest`) and answered and not sent (`out`). */
static void leave(Conn *c, int hand, Py_ssize_t rest_at, int linger) {
    int fd = c->fd;
    if (fd < 0) return;
    PyObject *got = PyObject_CallFunction(c->release, "Oi", (PyObject *)c, fd);
    if (got == NULL) PyErr_WriteUnraisable(c->release);
    Py_XDECREF(got);
    c->fd = -1;
    if (!hand) {
        close(fd);
    } else {
        got = PyObject_CallFunction(c->hand_over, "iy#y#i", fd, c->in + rest_at,
                                    c->in_len - rest_at, c->out ? (char *)c->out : "",
                                    c->out_len, linger);  /* (y# of NULL is None) */
        if (got == NULL) {
            PyErr_WriteUnraisable(c->hand_over);
            close(fd);
        }
        Py_XDECREF(got);
    }
    c->in_len = c->out_len = 0;
}

/* Answer each whole request read, in order; hand over at the first outside the
 * subset. */
static void answer_all(Conn *c, double now) {
    Py_ssize_t pos = 0;
    int answered = 0;
    while (pos < c->in_len) {
        Parsed r;
        int got = parse_one(c, c->in + pos, c->in_len - pos, &r);
        if (got == 0) break;
        if (got < 0) {
            leave(c, 1, pos, 0);
            return;
        }
        PyObject *args[2];
        args[0] = PyBytes_FromStringAndSize((const char *)c->in + pos + r.body_at, r.body_len);
        args[1] = r.auth ? PyBytes_FromStringAndSize((const char *)r.auth, r.auth_len)
                         : Py_NewRef(Py_None);
        PyObject *out = args[0] && args[1]
                        ? PyObject_Vectorcall(c->handlers[r.route], args, 2, NULL) : NULL;
        Py_XDECREF(args[0]);
        Py_XDECREF(args[1]);
        if (c->fd < 0) {  /* the handler closed this connection (abort) */
            Py_XDECREF(out);
            return;
        }
        pos += r.total;
        answered = 1;
        sarp_calls[CALL_CONN]++;
        int close_after = r.close, ok;
        if (out != NULL && PyBytes_CheckExact(out)) {
            ok = put_ok(c, PyBytes_AS_STRING(out), PyBytes_GET_SIZE(out), r.close) == 0;
        } else if (out != NULL) {  /* a Response: the reference frames it */
            PyObject *framed = PyObject_CallFunction(c->frame, "Oi", out, r.close);
            const char *bytes;
            Py_ssize_t n;
            ok = framed != NULL && PyArg_ParseTuple(framed, "y#p", &bytes, &n, &close_after)
                 && reserve_out(c, n) == 0;
            if (ok) {
                memcpy(c->out + c->out_len, bytes, n);
                c->out_len += n;
            }
            Py_XDECREF(framed);
        } else {
            ok = 0;
        }
        Py_XDECREF(out);
        if (!ok) {  /* the side wraps handlers in the 500 answer: a bug here, reported */
            PyErr_WriteUnraisable(c->handlers[r.route]);
            leave(c, 0, 0, 0);
            return;
        }
        if (close_after) {  /* nothing after it is read; then the connection lingers */
            c->in_len = 0;
            int sent = flush(c);
            if (sent == 1 && shutdown(c->fd, SHUT_WR) == 0) {
                c->lingering = 0;
                if (c->pending_since < 0) c->pending_since = now;
            } else {  /* the rest is the reference's to send (then it lingers), or the
                       * client is gone */
                leave(c, sent == 0, 0, 1);
            }
            return;
        }
        if (c->out_len >= FLUSH_BYTES) {
            int sent = flush(c);
            if (sent <= 0) {
                leave(c, sent == 0, pos, 0);
                return;
            }
        }
    }
    memmove(c->in, c->in + pos, c->in_len - pos);
    c->in_len -= pos;
    if (c->in_len == 0)
        c->pending_since = -1;
    else if (answered || c->pending_since < 0)
        c->pending_since = now;
    int sent = c->out_len ? flush(c) : 1;
    if (sent <= 0) leave(c, sent == 0, 0, 0);
}

/* readable(): the loop's reader callback: one recv, then every whole request answered */
/* Resize a buffer (the bytes kept); -1 with MemoryError set. */
static int resize(uint8_t **buf, Py_ssize_t *cap, Py_ssize_t to) {
    uint8_t *p = PyMem_Realloc(*buf, to);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = p;
    *cap = to;
    return 0;
}

/* A lingering connection: what the client sends is dropped until it closes. */
static PyObject *linger_read(Conn *c) {
    ssize_t k = recv(c->fd, c->in, c->in_cap, 0);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) Py_RETURN_NONE;
    if (k <= 0 || (c->lingering += k) > MAX_LINGER_BYTES) leave(c, 0, 0, 0);
    Py_RETURN_NONE;
}

static PyObject *conn_readable(Conn *c, PyObject *unused) {
    if (c->fd < 0) Py_RETURN_NONE;
    if (c->lingering >= 0) return linger_read(c);
    if (c->in_cap - c->in_len < 4096 && c->in_cap < c->in_max) {  /* a large request */
        Py_ssize_t to = 2 * c->in_cap < c->in_max ? 2 * c->in_cap : c->in_max;
        if (resize(&c->in, &c->in_cap, to) < 0) return NULL;
    }
    if (c->in_len == c->in_cap) {  /* cannot happen: a request fits, or was handed over */
        leave(c, 1, 0, 0);
        Py_RETURN_NONE;
    }
    ssize_t k = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) Py_RETURN_NONE;
    if (k <= 0) {  /* the client closed (all it sent is answered), or the socket failed */
        leave(c, 0, 0, 0);
        Py_RETURN_NONE;
    }
    double now = now_s();
    c->last_activity = now;
    c->in_len += k;
    answer_all(c, now);
    /* an idle connection keeps little: its buffers back to KEPT_BYTES once emptied */
    if (c->fd >= 0 && c->in_len <= KEPT_BYTES && c->in_cap > KEPT_BYTES
        && resize(&c->in, &c->in_cap, KEPT_BYTES) < 0)
        return NULL;
    if (c->fd >= 0 && c->out_cap > KEPT_BYTES) {
        PyMem_Free(c->out);
        c->out = NULL;
        c->out_cap = 0;
    }
    Py_RETURN_NONE;
}

/* expired(now) -> "request" | "idle" | None: which time bound the connection is past */
static PyObject *conn_expired(Conn *c, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    if (c->pending_since >= 0) {
        if (now - c->pending_since > c->request_timeout) return PyUnicode_FromString("request");
    } else if (now - c->last_activity > c->idle_timeout) {
        return PyUnicode_FromString("idle");
    }
    Py_RETURN_NONE;
}

/* abort(): close now (the sweep's cut, the worker's stop) */
static PyObject *conn_abort(Conn *c, PyObject *unused) {
    leave(c, 0, 0, 0);
    Py_RETURN_NONE;
}

static PyObject *conn_fd(Conn *c, void *closure) { return PyLong_FromLong(c->fd); }
static PyObject *conn_busy(Conn *c, void *closure) { Py_RETURN_FALSE; }

/* Conn(fd, routes, side, request_timeout_s, idle_timeout_s, max_body): `routes` maps
 * b"METHOD /path" to handler(body, authorization); the descriptor is non-blocking
 * and this object's from now on. */
static int conn_init(Conn *c, PyObject *args, PyObject *kwargs) {
    int fd;
    PyObject *routes, *side;
    if (!PyArg_ParseTuple(args, "iO!Oddn", &fd, &PyDict_Type, &routes, &side,
                          &c->request_timeout, &c->idle_timeout, &c->max_body))
        return -1;
    if (c->fd >= 0 || c->in != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Conn is initialised once");
        return -1;
    }
    if (PyDict_GET_SIZE(routes) > MAX_ROUTES || c->max_body < 0 || c->max_body > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "Conn takes at most %d routes and bodies up to 1 MiB",
                     MAX_ROUTES);
        return -1;
    }
    PyObject *key, *handler;
    Py_ssize_t at = 0;
    while (PyDict_Next(routes, &at, &key, &handler)) {
        if (!PyBytes_CheckExact(key) || !PyCallable_Check(handler)) {
            PyErr_SetString(PyExc_TypeError, "Conn's routes map bytes to callables");
            return -1;
        }
        c->keys[c->nroutes] = Py_NewRef(key);
        c->handlers[c->nroutes++] = Py_NewRef(handler);
    }
    c->release = PyObject_GetAttrString(side, "release");
    c->hand_over = c->release ? PyObject_GetAttrString(side, "hand_over") : NULL;
    c->frame = c->hand_over ? PyObject_GetAttrString(side, "frame") : NULL;
    if (c->frame == NULL) return -1;
    c->in_max = MAX_HEAD_BYTES + 4 + c->max_body + 4096;
    c->in_cap = c->in_max < KEPT_BYTES ? c->in_max : KEPT_BYTES;
    c->in = PyMem_Malloc(c->in_cap);
    if (c->in == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->pending_since = -1;
    c->lingering = -1;
    c->last_activity = now_s();
    c->fd = fd;
    return 0;
}

static PyObject *conn_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Conn *c = (Conn *)type->tp_alloc(type, 0);
    if (c != NULL) c->fd = -1;
    return (PyObject *)c;
}

static void conn_dealloc(Conn *c) {
    if (c->fd >= 0) close(c->fd);  /* (released objects have none) */
    for (int i = 0; i < c->nroutes; i++) {
        Py_DECREF(c->keys[i]);
        Py_DECREF(c->handlers[i]);
    }
    Py_XDECREF(c->release);
    Py_XDECREF(c->hand_over);
    Py_XDECREF(c->frame);
    PyMem_Free(c->in);
    PyMem_Free(c->out);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef conn_methods[] = {
    {"readable", (PyCFunction)conn_readable, METH_NOARGS,
     "readable(): read once, answer every whole request (the loop's reader callback)"},
    {"expired", (PyCFunction)conn_expired, METH_O,
     "expired(now): 'request', 'idle' or None (wire.Connection.expired)"},
    {"abort", (PyCFunction)conn_abort, METH_NOARGS, "abort(): close the connection now"},
    {"close", (PyCFunction)conn_abort, METH_NOARGS,
     "close(): the same (nothing waits to be sent between calls)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef conn_getset[] = {
    {"fd", (getter)conn_fd, NULL, "the descriptor, or -1 once closed or handed over", NULL},
    {"busy", (getter)conn_busy, NULL, "False: a handler never runs past a call", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject sarp_ConnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sarp._native.Conn",
    .tp_basicsize = sizeof(Conn),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Conn(fd, routes, side, request_timeout_s, idle_timeout_s, max_body): one "
              "HTTP/1.1 connection answered in C while its requests stay in the subset "
              "(sarp.serving.wire.take)",
    .tp_new = conn_new,
    .tp_init = (initproc)conn_init,
    .tp_dealloc = (destructor)conn_dealloc,
    .tp_methods = conn_methods,
    .tp_getset = conn_getset,
};
