/*
 * The C mirror of sarp/serving/events.py's decoder (sarp._native; sarp/native.py loads
 * it): the shape engines send, read straight from msgpack (events.py is the reference: `_decode_common`, then `_event`).
 *
 * decode_batch takes a payload `[ts, [event, ...](, dp_rank)]` whose events are
 * tagged arrays (vLLM up to 0.11) or maps (vLLM 0.12 on, SGLang), and returns what
 * the Python decoder would build, as plain tuples; anything else, or anything the
 * Python decoder would turn into an error or a Malformed event (bytes hashes, a
 * repeated hash, a bad field, text that is not UTF-8, ...), returns None, and Python
 * decodes the payload itself.  So the answer is always the Python decoder's.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE /* mremap */
#include <Python.h>
#include <math.h>
#include <sys/mman.h>
#include <stdint.h>
#include <string.h>

#include "../native.h"

#define MAX_DP_RANK 4095
#define MAX_DEPTH 64

typedef struct {
    const uint8_t *p, *end;
} Reader;

static int need(Reader *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

static int is_container(uint8_t t) {
    return (t >= 0x80 && t <= 0x9F) || (t >= 0xDC && t <= 0xDF);
}

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* Strict UTF-8, as Python's decoder: no overlongs, no surrogates, at most U+10FFFF. */
static int utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        int len;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; min = 0x10000; }
        else return 0;
        if (i + (size_t)len > n) return 0;
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += (size_t)len;
    }
    return 1;
}

/* A str header: 1 with its bytes, 0 if the next value is not a str, -1 if cut short. */
static int read_str(Reader *r, const uint8_t **s, size_t *n) {
    if (!need(r, 1)) return -1;
    uint8_t t = *r->p;
    size_t len, head;
    if (t >= 0xA0 && t <= 0xBF) { len = t & 0x1F; head = 1; }
    else if (t == 0xD9 && need(r, 2)) { len = r->p[1]; head = 2; }
    else if (t == 0xDA && need(r, 3)) { len = (size_t)be(r->p + 1, 2); head = 3; }
    else if (t == 0xDB && need(r, 5)) { len = (size_t)be(r->p + 1, 4); head = 5; }
    else return 0;
    if (!need(r, head + len)) return -1;
    *s = r->p + head;
    *n = len;
    r->p += head + len;
    return 1;
}

/* An array or map header: 1 with its count, 0 if not one, -1 if cut short. */
static int read_container(Reader *r, int map, size_t *count) {
    if (!need(r, 1)) return -1;
    uint8_t t = *r->p;
    uint8_t fix = map ? 0x80 : 0x90, t16 = map ? 0xDE : 0xDC, t32 = map ? 0xDF : 0xDD;
    if (t >= fix && t <= fix + 15) { *count = t & 0x0F; r->p += 1; return 1; }
    if (t == t16) {
        if (!need(r, 3)) return -1;
        *count = (size_t)be(r->p + 1, 2);
        r->p += 3;
        return 1;
    }
    if (t == t32) {
        if (!need(r, 5)) return -1;
        *count = (size_t)be(r->p + 1, 4);
        r->p += 5;
        return 1;
    }
    return 0;
}

/* An int: 1 with its value (as uint64, and whether it was negative), 0 if not an
 * int, -1 if cut short. */
static int read_int(Reader *r, uint64_t *v, int *negative) {
    if (!need(r, 1)) return -1;
    uint8_t t = *r->p;
    *negative = 0;
    if (t <= 0x7F) { *v = t; r->p += 1; return 1; }
    if (t >= 0xE0) { *v = (uint64_t)(int64_t)(int8_t)t; *negative = 1; r->p += 1; return 1; }
    int n;
    int is_signed;
    switch (t) {
        case 0xCC: n = 1; is_signed = 0; break;
        case 0xCD: n = 2; is_signed = 0; break;
        case 0xCE: n = 4; is_signed = 0; break;
        case 0xCF: n = 8; is_signed = 0; break;
        case 0xD0: n = 1; is_signed = 1; break;
        case 0xD1: n = 2; is_signed = 1; break;
        case 0xD2: n = 4; is_signed = 1; break;
        case 0xD3: n = 8; is_signed = 1; break;
        default: return 0;
    }
    if (!need(r, 1 + (size_t)n)) return -1;
    uint64_t raw = be(r->p + 1, n);
    if (is_signed && n < 8 && (raw >> (8 * n - 1)) & 1) raw |= ~(uint64_t)0 << (8 * n);
    *v = raw;
    *negative = is_signed && (int64_t)raw < 0;
    r->p += 1 + n;
    return 1;
}

/* Bytes of a value whose size its first byte tells (ints, floats, nil, bools,
 * fixext): 0 for everything else. */
static uint8_t fixed_size[256];
static uint8_t plain_size[256]; /* the same for ints, floats, nil and bools only */

static void init_sizes(void) {
    for (int t = 0; t < 256; t++) {
        int n = 0;
        if (t <= 0x7F || t >= 0xE0 || t == 0xC0 || t == 0xC2 || t == 0xC3) n = 1;
        else if (t == 0xCC || t == 0xD0) n = 2;
        else if (t == 0xCD || t == 0xD1) n = 3;
        else if (t == 0xCE || t == 0xD2 || t == 0xCA) n = 5;
        else if (t == 0xCF || t == 0xD3 || t == 0xCB) n = 9;
        else if (t == 0xD4) n = 3;
        else if (t == 0xD5) n = 4;
        else if (t == 0xD6) n = 6;
        else if (t == 0xD7) n = 10;
        else if (t == 0xD8) n = 18;
        fixed_size[t] = (uint8_t)n;
        plain_size[t] = (t >= 0xD4 && t <= 0xD8) ? 0 : (uint8_t)n;
    }
}

static int is_ext(uint8_t t) { return (t >= 0xD4 && t <= 0xD8) || (t >= 0xC7 && t <= 0xC9); }

/* Past the next value.  With `check`, every str in it must be UTF-8 (as msgpack's
 * unpack, which builds them, requires), and an ext or a container as a map key is
 * left to Python (unpack judges them); without, nothing is checked (as its skip).
 * 1 done, 0 not a value Python would read this way, -1 cut short. */
static int skip(Reader *r, int check, int depth) {
    if (depth > MAX_DEPTH || !need(r, 1)) return -1;
    uint8_t t = *r->p;
    size_t size = fixed_size[t];
    if (size) {
        if (check && is_ext(t)) return 0;
        if (!need(r, size)) return -1;
        r->p += size;
        return 1;
    }
    const uint8_t *s;
    size_t n;
    int got = read_str(r, &s, &n);
    if (got) return got < 0 ? -1 : (!check || utf8_ok(s, n));
    if (is_container(t)) {
        int map = (t >= 0x80 && t <= 0x8F) || t == 0xDE || t == 0xDF;
        if (read_container(r, map, &n) < 0) return -1;
        size_t items = map ? 2 * n : n;
        for (size_t i = 0; i < items; i++) {
            /* the common items first, in a tight loop: ints, nil, bools (token ids) */
            const uint8_t *p = r->p, *end = r->end;
            while (i < items && p < end) {
                size_t plain = plain_size[*p];
                if (!plain || (size_t)(end - p) < plain) break;
                p += plain;
                i++;
            }
            r->p = p;
            if (i == items) break;
            if (check && map && i % 2 == 0 && need(r, 1) && is_container(*r->p)) {
                return 0; /* a list as a key: unhashable where Python builds it */
            }
            int ok = skip(r, check, depth + 1);
            if (ok <= 0) return ok;
        }
        return 1;
    }
    if (check && is_ext(t)) return 0;
    if (t == 0xC4 && need(r, 2)) size = 2 + r->p[1];
    else if (t == 0xC5 && need(r, 3)) size = 3 + (size_t)be(r->p + 1, 2);
    else if (t == 0xC6 && need(r, 5)) size = 5 + (size_t)be(r->p + 1, 4);
    else if (t == 0xC7 && need(r, 2)) size = 3 + r->p[1];
    else if (t == 0xC8 && need(r, 3)) size = 4 + (size_t)be(r->p + 1, 2);
    else if (t == 0xC9 && need(r, 5)) size = 6 + (size_t)be(r->p + 1, 4);
    else return t == 0xC1 ? 0 : -1;
    if (!need(r, size)) return -1;
    r->p += size;
    return 1;
}

/* The hashes of a `block_hashes` array of ints, as a uint64 bytearray; NULL with no
 * exception when it is anything else (bytes hashes, empty, ...), or with one. */
static PyObject *read_hashes(Reader *r) {
    size_t n;
    if (read_container(r, 0, &n) != 1 || n == 0 || !need(r, n)) return NULL;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (out == NULL) return NULL;
    uint64_t *h = (uint64_t *)PyByteArray_AS_STRING(out);
    for (size_t i = 0; i < n; i++) {
        int negative;
        if (read_int(r, &h[i], &negative) != 1) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* Whether `hashes` repeat a value, or hold `parent` (hashing.repeats): one pass
 * through an open-addressing set (malloc's, not PyMem's: lane.c's prefetch decodes
 * without the GIL). */
static int chain_fault(const uint64_t *hashes, size_t n, int has_parent, uint64_t parent) {
    size_t slots = 16;
    while (slots < 2 * (n + 1)) slots *= 2;
    uint64_t small_keys[256];
    uint8_t small_used[256];
    uint64_t *keys = slots <= 256 ? small_keys : malloc(slots * 8);
    uint8_t *used = slots <= 256 ? small_used : malloc(slots);
    if (keys == NULL || used == NULL) {
        if (keys != small_keys) free(keys);
        if (used != small_used) free(used);
        return 1; /* let Python decide */
    }
    memset(used, 0, slots);
    int fault = 0;
    for (size_t i = 0; i <= n && !fault; i++) {
        if (i == n && !has_parent) break;
        uint64_t h = i < n ? hashes[i] : parent;
        uint64_t x = h * 0x9E3779B97F4A7C15ULL;
        size_t at = (size_t)(x >> 32) & (slots - 1);
        while (used[at] && keys[at] != h) at = (at + 1) & (slots - 1);
        if (used[at]) fault = 1; /* a repeat, or the parent among the hashes */
        used[at] = 1;
        keys[at] = h;
    }
    if (keys != small_keys) free(keys);
    if (used != small_used) free(used);
    return fault;
}

enum { F_HASHES, F_PARENT, F_MEDIUM, F_LORA, F_GROUP, F_TOKENS, F_BSIZE, F_EXTRA, F_SKIP,
       F_READ };

/* Which field a name is, for an event of `kind` (0 stored, 1 removed, 2 other). */
static int field_of(const uint8_t *s, size_t n, int kind) {
#define IS(lit) (n == sizeof(lit) - 1 && memcmp(s, lit, n) == 0)
    if (kind == 0 && IS("token_ids")) return F_TOKENS;
    if (kind == 0 && IS("extra_keys")) return F_EXTRA;
    if (IS("token_ids") || IS("extra_keys")) return F_SKIP;
    if (kind == 2) return F_READ;
    if (kind == 0 && IS("block_size")) return F_BSIZE;
    if (IS("block_hashes")) return F_HASHES;
    if (IS("medium")) return F_MEDIUM;
    if (IS("group_idx")) return F_GROUP;
    if (kind == 0 && IS("parent_block_hash")) return F_PARENT;
    if (kind == 0 && IS("lora_name")) return F_LORA;
    return F_READ;
#undef IS
}

static const int STORED_ARRAY[] = {F_HASHES, F_PARENT, F_TOKENS, F_BSIZE, F_READ, F_MEDIUM,
                                   F_LORA, F_EXTRA, F_GROUP};

/* Token ids, extra keys and fields read past (not checked: their text need not be
 * UTF-8). */
static int unchecked(int f) { return f == F_SKIP || f == F_TOKENS || f == F_EXTRA; }

/* Whether a store's extra keys hold more than its LoRA name (multimodal inputs, a cache
 * salt, prompt embeddings): then its tokens alone do not name its blocks.  Absent or
 * nil: no; entries nil or [lora_name]: no; anything else, or any doubt: yes. */
static int has_extras(const uint8_t *at, const uint8_t *end, const uint8_t *lora_at) {
    if (at == NULL || *at == 0xC0) return 0;
    Reader f = {at, end};
    size_t n, m, ln = 0, sn;
    const uint8_t *lora = NULL, *s;
    if (lora_at != NULL) {
        Reader l = {lora_at, end};
        if (read_str(&l, &lora, &ln) != 1) lora = NULL;
    }
    if (read_container(&f, 0, &n) != 1) return 1;
    for (size_t i = 0; i < n; i++) {
        if (!need(&f, 1)) return 1;
        if (*f.p == 0xC0) {
            f.p++;
            continue;
        }
        if (read_container(&f, 0, &m) != 1 || m != 1 || read_str(&f, &s, &sn) != 1
            || lora == NULL || sn != ln || memcmp(s, lora, ln) != 0) {
            return 1;
        }
    }
    return 0;
}

/* Reads up to `count` token ids from a msgpack array's items at `f`, every one
 * checked (a non-negative int below 2^32, as read_tokens wants), the first `keep`
 * of them into `out`; returns how many were read (less than `count`: one was not a
 * token id).  Ids come as fixints, uint16 or uint32 (a vocabulary of 152,000): those
 * are read inline, five bytes at a time at most, the rest by read_int. */
static size_t read_token_ids(Reader *f, size_t count, uint32_t *out, size_t keep) {
    const uint8_t *p = f->p, *end = f->end;
    size_t i = 0;
    for (; i < count; i++) {
        uint32_t id;
        uint8_t t = end - p >= 5 ? *p : 0xC1; /* near the end: read_int, which checks */
        if (t <= 0x7F) {
            id = t;
            p += 1;
        } else if (t == 0xCD) {
            id = (uint32_t)p[1] << 8 | p[2];
            p += 3;
        } else if (t == 0xCE) {
            id = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 8 | p[4];
            p += 5;
        } else {
            uint64_t v;
            int negative;
            f->p = p;
            if (read_int(f, &v, &negative) != 1 || negative || v > 0xFFFFFFFFu) break;
            p = f->p;
            id = (uint32_t)v;
        }
        if (i < keep) out[i] = id;
    }
    f->p = p;
    return i;
}

/* A store's token ids as a bytes of u32s (machine order), or None when absent or not
 * all ints from 0 to 2**32 - 1 (such a store is keyed through its engine hashes). */
static PyObject *read_tokens(const uint8_t *at, const uint8_t *end) {
    size_t n;
    Reader f = {at, end};
    if (at == NULL || read_container(&f, 0, &n) != 1 || !need(&f, n)) return Py_NewRef(Py_None);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 4));
    if (out == NULL) return NULL;
    if (read_token_ids(&f, n, (uint32_t *)PyBytes_AS_STRING(out), n) < n) {
        Py_DECREF(out);
        return Py_NewRef(Py_None);
    }
    return out;
}
static const int REMOVED_ARRAY[] = {F_HASHES, F_MEDIUM, F_GROUP};

/* An optional str field (absent or nil: None), as a new reference; NULL when it holds
 * anything else (no exception: Python decides), or with an exception. */
static PyObject *opt_str(const uint8_t *at, const uint8_t *end) {
    if (at == NULL || *at == 0xC0) return Py_NewRef(Py_None);
    Reader f = {at, end};
    const uint8_t *s;
    size_t n;
    if (read_str(&f, &s, &n) != 1) return NULL;
    return PyUnicode_DecodeUTF8((const char *)s, (Py_ssize_t)n, "strict");
}

/* An optional int field: 1 with its value, 0 absent or nil, -1 anything else. */
static int opt_int(const uint8_t *at, const uint8_t *end, uint64_t *v, int *negative) {
    if (at == NULL || *at == 0xC0) return 0;
    Reader f = {at, end};
    return read_int(&f, v, negative) == 1 ? 1 : -1;
}

/* A store's token ids, read as find_fields passes them: into the tokens column (u32s)
 * of `c` from `start` on; `ok` when the field held ids alone (`count` of them), else
 * nothing is left in the column past `start`. */
typedef struct {
    IntoCols *c;
    Py_ssize_t start;
    int ok;
    size_t count;
} TokenSink;

/* (COL_TOKENS is the decoder's own: a store's token ids while it is read, hashed into
 * COL_LOCALS, one u64 per block, and dropped; it is left empty after every event) */
enum { COL_KIND, COL_NAME, COL_ROOT, COL_SIZE, COL_PARENT, COL_HAS_PARENT, COL_TOKEN_COUNT,
       COL_BLOCK_SIZE, COL_SEED, COL_HASHES, COL_LOCALS, COL_TOKENS };
#define NUM_COLS INTO_COLS
static const Py_ssize_t COL_ITEM[NUM_COLS] = {1, 4, 8, 8, 8, 1, 8, 8, 8, 8, 8, 4};

/* Column `col`'s size in bytes, its bytes, and its size set to `n` bytes (0, or -1:
 * out of memory; with the GIL, the exception set): a bytearray's, or C's own (when
 * the GIL is not held: IntoCols.bufs). */
Py_ssize_t col_len(const IntoCols *c, int col) {
    return c->bufs != NULL ? c->bufs[col].len : PyByteArray_GET_SIZE(c->cols[col]);
}

static uint8_t *col_bytes(const IntoCols *c, int col) {
    return c->bufs != NULL ? c->bufs[col].p : (uint8_t *)PyByteArray_AS_STRING(c->cols[col]);
}

static int col_resize(IntoCols *c, int col, Py_ssize_t n) {
    if (c->bufs == NULL) return PyByteArray_Resize(c->cols[col], n);
    ColBuf *b = &c->bufs[col];
    if (n > b->cap) {
        /* mapped, not malloc'd: what a prefetch took goes back to the system at its end
         * (a thread's malloc arena would keep a backlog's megabytes until a trim) */
        Py_ssize_t cap = b->cap < 65536 ? 65536 : b->cap;
        while (cap < n) cap *= 2;
        void *p = b->p == NULL ? mmap(NULL, (size_t)cap, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                               : mremap(b->p, (size_t)b->cap, (size_t)cap, MREMAP_MAYMOVE);
        if (p == MAP_FAILED) {
            c->nomem = 1;
            return -1;
        }
        b->p = p;
        b->cap = cap;
    }
    b->len = n;
    return 0;
}

void colbuf_free(ColBuf *b) {
    if (b->p != NULL) munmap(b->p, (size_t)b->cap);
    *b = (ColBuf){0};
}

/* Past the value at `r` (the field `f` of the event): as skip, or, with a sink and at
 * the token ids, read into the sink on the way (so that the ids are read once, not
 * skipped and then read); 1, 0 as skip, -1 with an exception (no memory). */
static int pass_field(Reader *r, int f, TokenSink *sink) {
    if (sink != NULL && f == F_TOKENS) {
        sink->ok = 0;  /* the last of a field twice counts, as in a dict */
        if (col_resize(sink->c, COL_TOKENS, sink->start) < 0) return -1;
        Reader t = *r;
        size_t nt;
        if (read_container(&t, 0, &nt) == 1 && need(&t, nt)) {
            if (col_resize(sink->c, COL_TOKENS, sink->start + (Py_ssize_t)nt * 4) < 0) return -1;
            uint32_t *out = (uint32_t *)(col_bytes(sink->c, COL_TOKENS) + sink->start);
            if (read_token_ids(&t, nt, out, nt) == nt) {
                sink->ok = 1;
                sink->count = nt;
                r->p = t.p;
                return 1;
            }
            if (col_resize(sink->c, COL_TOKENS, sink->start) < 0) return -1;
        }
    }
    return skip(r, !unchecked(f), 0);
}

/* Where an event's fields are (`where`, by F_*) and its kind (0 stored, 1 removed,
 * 2 cleared): 1, or 0 when it is not the shape engines send (Python decides), or -1
 * with an exception (a sink's memory).  With a sink, a store's token ids go into it. */
static int find_fields(Reader *r, const uint8_t **where, int *kind_out, TokenSink *sink) {
    int kind = -1; /* 0 stored, 1 removed, 2 cleared */
    size_t count;
    const uint8_t *s;
    size_t n;
    int got = read_container(r, 0, &count);
    if (got < 0) return 0;
    if (got == 1) {
        if (count == 0 || read_str(r, &s, &n) != 1) return 0;
        if (n == 11 && memcmp(s, "BlockStored", 11) == 0) kind = 0;
        else if (n == 12 && memcmp(s, "BlockRemoved", 12) == 0) kind = 1;
        else if (n == 16 && memcmp(s, "AllBlocksCleared", 16) == 0) kind = 2;
        else return 0;
        const int *names = kind == 0 ? STORED_ARRAY : REMOVED_ARRAY;
        size_t known = kind == 0 ? 9 : kind == 1 ? 3 : 0;
        for (size_t i = 0; i + 1 < count; i++) {
            int f = i < known ? names[i] : F_SKIP;
            if (f < F_SKIP) where[f] = r->p;
            int passed = pass_field(r, f, kind == 0 ? sink : NULL);
            if (passed != 1) return passed;
        }
    } else {
        if (read_container(r, 1, &count) != 1) return 0;
        const uint8_t *type_at = NULL;
        /* which names count depends on the type, which may come last: note every
         * field of either kind, keyed by name, then read the ones the type wants */
        const uint8_t *stored[F_SKIP] = {NULL}, *removed[F_SKIP] = {NULL};
        for (size_t i = 0; i < count; i++) {
            int f0 = F_READ, f1 = F_READ;
            const uint8_t *key = r->p;
            got = read_str(r, &s, &n);
            if (got < 0) return 0;
            if (got == 1) {
                if (!utf8_ok(s, n)) return 0;
                if (n == 4 && memcmp(s, "type", 4) == 0) type_at = r->p;
                f0 = field_of(s, n, 0);
                f1 = field_of(s, n, 1);
            } else {
                r->p = key;
                if (is_container(*key) || skip(r, 1, 0) != 1) return 0; /* an odd key */
            }
            if (f0 < F_SKIP) stored[f0] = r->p;
            if (f1 < F_SKIP) removed[f1] = r->p;
            int passed = pass_field(r, f0, sink);
            if (passed != 1) return passed;
        }
        if (type_at == NULL) return 0;
        Reader t = {type_at, r->end};
        if (read_str(&t, &s, &n) != 1) return 0;
        if (n == 11 && memcmp(s, "BlockStored", 11) == 0) kind = 0;
        else if (n == 12 && memcmp(s, "BlockRemoved", 12) == 0) kind = 1;
        else if (n == 16 && memcmp(s, "AllBlocksCleared", 16) == 0) kind = 2;
        else return 0;
        memcpy(where, kind == 0 ? stored : removed, sizeof(stored));
    }
    *kind_out = kind;
    return 1;
}

/* A batch's head, `[ts, [` (with its size: 2 or 3): 1 with the event count, 0 not
 * this shape. */
static int read_head(Reader *r, size_t *size, double *ts, size_t *count) {
    uint64_t v;
    int negative;
    if (read_container(r, 0, size) != 1 || *size < 2 || *size > 3 || !need(r, 1)) return 0;
    if (*r->p == 0xCB && need(r, 9)) {
        uint64_t bits = be(r->p + 1, 8);
        memcpy(ts, &bits, 8);
        r->p += 9;
    } else if (*r->p == 0xCA && need(r, 5)) {
        uint32_t bits = (uint32_t)be(r->p + 1, 4);
        float f;
        memcpy(&f, &bits, 4);
        *ts = f;
        r->p += 5;
    } else if (read_int(r, &v, &negative) == 1) {
        *ts = negative ? (double)(int64_t)v : (double)v;
    } else {
        return 0;
    }
    return isfinite(*ts) && read_container(r, 0, count) == 1;
}

/* A batch's tail, `(, dp_rank)]` to its end: 1 with *has_rank and *rank, 0 not this
 * shape. */
static int read_tail(Reader *r, size_t size, int *has_rank, uint64_t *rank) {
    int negative;
    *has_rank = 0;
    if (size == 3) {
        if (need(r, 1) && *r->p == 0xC0) {
            r->p++;
        } else if (read_int(r, rank, &negative) == 1 && !negative && *rank <= MAX_DP_RANK) {
            *has_rank = 1;
        } else {
            return 0;
        }
    }
    return r->p == r->end;
}

/* One event, or NULL (no exception: Python decides; or with one). */
static PyObject *read_event(Reader *r, int with_tokens) {
    const uint8_t *where[F_SKIP] = {NULL};
    int kind;
    if (find_fields(r, where, &kind, NULL) != 1) return NULL;
    if (kind == 2) return Py_BuildValue("(s)", "AllBlocksCleared");
    if (where[F_HASHES] == NULL) return NULL;
    Reader h = {where[F_HASHES], r->end};
    PyObject *hashes = read_hashes(&h);
    if (hashes == NULL) return NULL;
    PyObject *medium = NULL, *lora = NULL, *group = NULL, *parent = NULL, *out = NULL;
    PyObject *tokens = NULL, *block_size = NULL;
    uint64_t v, parent_hash = 0;
    int negative, has_parent = 0;
    medium = opt_str(where[F_MEDIUM], r->end);
    int got_group = opt_int(where[F_GROUP], r->end, &v, &negative);
    if (medium == NULL || got_group < 0) goto done;
    group = !got_group  ? Py_NewRef(Py_None)
            : negative  ? PyLong_FromLongLong((long long)(int64_t)v)
                        : PyLong_FromUnsignedLongLong(v);
    if (group == NULL) goto done;
    if (kind == 1) {
        out = Py_BuildValue("(sNNN)", "BlockRemoved", hashes, medium, group);
        hashes = medium = group = NULL;
        goto done;
    }
    has_parent = opt_int(where[F_PARENT], r->end, &parent_hash, &negative);
    if (has_parent < 0) goto done;
    parent = has_parent ? PyLong_FromUnsignedLongLong(parent_hash) : Py_NewRef(Py_None);
    lora = opt_str(where[F_LORA], r->end);
    if (parent == NULL || lora == NULL
        || chain_fault((const uint64_t *)PyByteArray_AS_STRING(hashes),
                       (size_t)PyByteArray_GET_SIZE(hashes) / 8, has_parent, parent_hash)) {
        goto done;
    }
    uint64_t size = 0;
    int got_size = with_tokens ? opt_int(where[F_BSIZE], r->end, &size, &negative) : 0;
    if (got_size == 1 && !negative && size > 0 && size <= 0xFFFF) {
        tokens = has_extras(where[F_EXTRA], r->end, where[F_LORA]) ? Py_NewRef(Py_None)
                 : read_tokens(where[F_TOKENS], r->end);
        block_size = tokens == Py_None ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(size);
    } else {
        tokens = Py_NewRef(Py_None);
        block_size = Py_NewRef(Py_None);
    }
    if (tokens == NULL || block_size == NULL) goto done;
    out = Py_BuildValue("(sNNNNNNN)", "BlockStored", hashes, parent, medium, lora, group,
                        tokens, block_size);
    hashes = parent = medium = lora = group = tokens = block_size = NULL;
done:
    Py_XDECREF(tokens);
    Py_XDECREF(block_size);
    Py_XDECREF(hashes);
    Py_XDECREF(parent);
    Py_XDECREF(medium);
    Py_XDECREF(lora);
    Py_XDECREF(group);
    return out;
}

/* decode_batch(payload, with_tokens) -> (ts, dp_rank | None, [event, ...]) | None
 * event: ("BlockStored", hashes, parent | None, medium | None, lora_name | None,
 * group_idx | None, token_ids | None, block_size | None) with token ids as a bytes of
 * u32s (read only `with_tokens`), ("BlockRemoved", hashes, medium | None, group_idx | None) or
 * ("AllBlocksCleared",); hashes are a bytearray of uint64s in the machine's order.
 * None: let the Python decoder read this payload. */
PyObject *sarp_decode_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_DECODE_BATCH]++;
    if (!fixed_size[0]) init_sizes();
    Py_buffer buf;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "decode_batch(payload, with_tokens)");
        return NULL;
    }
    int with_tokens = PyObject_IsTrue(args[1]);
    if (with_tokens < 0 || PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {buf.buf, (const uint8_t *)buf.buf + buf.len};
    PyObject *events = NULL, *out = NULL;
    size_t size, count;
    double ts;
    uint64_t v;
    int has_rank;
    if (!read_head(&r, &size, &ts, &count)) goto none;
    events = PyList_New(0);
    if (events == NULL) goto fail;
    for (size_t i = 0; i < count; i++) {
        PyObject *e = read_event(&r, with_tokens);
        if (e == NULL) {
            if (PyErr_Occurred()) goto fail;
            goto none;
        }
        int bad = PyList_Append(events, e);
        Py_DECREF(e);
        if (bad < 0) goto fail;
    }
    if (!read_tail(&r, size, &has_rank, &v)) goto none;
    out = has_rank ? Py_BuildValue("(dKO)", ts, (unsigned long long)v, events)
                   : Py_BuildValue("(dOO)", ts, Py_None, events);
    goto fail; /* release and return out */
none:
    out = Py_NewRef(Py_None);
fail:
    Py_XDECREF(events);
    PyBuffer_Release(&buf);
    return out;
}

/* ---- decode_into: a batch's events appended to the columns of a commit ------------- */

/* Append `n` items of column `col` (uninitialised); NULL out of memory. */
static void *col_grow(IntoCols *c, int col, Py_ssize_t n) {
    Py_ssize_t at = col_len(c, col);
    if (col_resize(c, col, at + n * COL_ITEM[col]) < 0) return NULL;
    return col_bytes(c, col) + at;
}

/* An optional str field (absent or nil: *s NULL): 1, 0 when it holds anything else. */
static int opt_str_raw(const uint8_t *at, const uint8_t *end, const uint8_t **s, size_t *n) {
    *s = NULL;
    *n = 0;
    if (at == NULL || *at == 0xC0) return 1;
    Reader f = {at, end};
    return read_str(&f, s, n) == 1;
}

/* Is the learnt `name` (UTF-8, NULL for none) the field's `s` (NULL for none)? */
static int same_str(const char *name, size_t name_len, const uint8_t *s, size_t n) {
    return s == NULL ? name == NULL : name != NULL && name_len == n && memcmp(name, s, n) == 0;
}

/* Without the GIL: the name index of (holder, medium) learnt before (1; 0 unknown,
 * or a medium sarp refuses, or not a str). */
static int known_name(const Known *k, long holder, const uint8_t *at, const uint8_t *end,
                      int32_t *out) {
    const uint8_t *s;
    size_t n;
    if (!opt_str_raw(at, end, &s, &n)) return 0;
    for (Py_ssize_t i = 0; i < k->npairs; i++) {
        const KnownPair *p = &k->pairs[i];
        if (p->holder == holder && same_str(p->medium, p->medium_len, s, n)) {
            *out = p->index;
            return p->index >= 0;
        }
    }
    return 0;
}

/* Without the GIL: a LoRA name's seed learnt before (1; 0 unknown or not a str). */
static int known_seed(const Known *k, const uint8_t *at, const uint8_t *end, uint64_t *out) {
    const uint8_t *s;
    size_t n;
    if (!opt_str_raw(at, end, &s, &n)) return 0;
    for (Py_ssize_t i = 0; i < k->nseeds; i++) {
        if (same_str(k->seeds[i].name, k->seeds[i].name_len, s, n)) {
            *out = k->seeds[i].seed;
            return 1;
        }
    }
    return 0;
}

/* `table[key]`, or `learn(key)` for a key it does not hold (Python adds what it
 * learns to the table); a new reference, NULL with an exception. */
static PyObject *learned(PyObject *table, PyObject *learn, PyObject *key) {
    PyObject *got = PyDict_GetItemWithError(table, key);
    if (got != NULL) return Py_NewRef(got);
    return PyErr_Occurred() ? NULL : PyObject_CallOneArg(learn, key);
}

/* The index a (holder, medium) pair has in `names`: `learn(holder, medium)` is asked
 * once per pair it has not seen, and says None for a medium sarp refuses.
 * 1 with the index, 0 refused, -1 error. */
static int name_index(PyObject *names, PyObject *learn, long holder, const uint8_t *at,
                      const uint8_t *end, int32_t *out) {
    PyObject *medium;
    if (at == NULL || *at == 0xC0) {
        medium = Py_NewRef(Py_None);
    } else {
        Reader f = {at, end};
        const uint8_t *s;
        size_t n;
        if (read_str(&f, &s, &n) != 1) return 0;
        medium = PyUnicode_DecodeUTF8((const char *)s, (Py_ssize_t)n, "strict");
        if (medium == NULL) {
            PyErr_Clear();
            return 0;
        }
    }
    PyObject *key = Py_BuildValue("(lN)", holder, medium);
    if (key == NULL) return -1;
    PyObject *got = learned(names, learn, key);
    Py_DECREF(key);
    if (got == NULL) return -1;
    int ok = got != Py_None;
    if (ok) *out = (int32_t)PyLong_AsLong(got);
    Py_DECREF(got);
    if (ok && PyErr_Occurred()) return -1;
    return ok;
}

/* A store's LoRA seed (tokenkeys.lora_seed), through `seeds` (name -> seed), asking
 * `learn(name)` for a name it has not seen.  1 with it, -1 error. */
static int lora_seed_of(PyObject *seeds, PyObject *learn, const uint8_t *at,
                        const uint8_t *end, uint64_t *out) {
    PyObject *name = opt_str(at, end);
    if (name == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *got = learned(seeds, learn, name);
    Py_DECREF(name);
    if (got == NULL) return -1;
    *out = PyLong_AsUnsignedLongLong(got);
    Py_DECREF(got);
    return PyErr_Occurred() ? -1 : 1;
}

/* One event appended to the columns: 1 appended, 2 read but not appended (a group
 * other than the first), 0 not this shape (Python decides; columns as they were
 * for the caller to cut back), -1 error. */
static int event_into(Reader *r, int with_tokens, uint64_t root, long holder, IntoCols *c) {
    const uint8_t *where[F_SKIP] = {NULL};
    int kind;
    const uint8_t *s;
    size_t n;
    /* a token-keyed engine's token ids are read as the fields are found */
    TokenSink sink = {c, col_len(c, COL_TOKENS), 0, 0};
    TokenSink *reading = root != 0 && with_tokens ? &sink : NULL;
    int found = find_fields(r, where, &kind, reading);
    if (found <= 0) return found;
    if (kind == 2) return 0; /* a clear: Python's */
    if (where[F_HASHES] == NULL) return 0;
    Reader h = {where[F_HASHES], r->end};
    size_t nh;
    if (read_container(&h, 0, &nh) != 1 || nh == 0 || !need(&h, nh)) return 0;
    uint64_t v, parent = 0;
    int negative, has_parent = 0;
    int got_group = opt_int(where[F_GROUP], r->end, &v, &negative);
    if (got_group < 0) return 0;
    int other_group = got_group && (negative || v != 0);
    int32_t name;
    int named = c->bufs != NULL ? known_name(c->known, holder, where[F_MEDIUM], r->end, &name)
                                : name_index(c->names, c->learn_name, holder, where[F_MEDIUM],
                                             r->end, &name);
    if (named <= 0) return named;
    if (kind == 0) {
        has_parent = opt_int(where[F_PARENT], r->end, &parent, &negative);
        if (has_parent < 0) return 0;
        if (where[F_LORA] != NULL && *where[F_LORA] != 0xC0) {
            Reader l = {where[F_LORA], r->end};
            if (read_str(&l, &s, &n) != 1 || !utf8_ok(s, n)) return 0;
        }
    }
    uint64_t *hashes = col_grow(c, COL_HASHES, (Py_ssize_t)nh);
    if (hashes == NULL) return -1;
    for (size_t i = 0; i < nh; i++) {
        if (read_int(&h, &hashes[i], &negative) != 1) return 0;
    }
    if (kind == 0 && chain_fault(hashes, nh, has_parent, parent)) return 0;
    if (other_group) {
        /* another KV cache group: read (the batch stays this shape) but not applied */
        if (col_resize(c, COL_TOKENS, sink.start) < 0) return -1;
        return col_resize(c, COL_HASHES, col_len(c, COL_HASHES) - (Py_ssize_t)nh * 8) < 0 ? -1
                                                                                         : 2;
    }
    uint64_t tokens_taken = 0, block_size = 0, seed = 0;
    if (kind == 0 && reading != NULL && sink.ok) {
        uint64_t size = 0;
        int got_size = opt_int(where[F_BSIZE], r->end, &size, &negative);
        if (got_size == 1 && !negative && size > 0 && size <= 0xFFFF
            && !has_extras(where[F_EXTRA], r->end, where[F_LORA]) && sink.count >= nh * size) {
            tokens_taken = nh * size;
            block_size = size;
            int seeded = c->bufs != NULL ? known_seed(c->known, where[F_LORA], r->end, &seed)
                                         : lora_seed_of(c->seeds, c->learn_seed, where[F_LORA],
                                                        r->end, &seed);
            if (seeded <= 0) return seeded;
        }
    }
    /* the blocks' local hashes (xxh3-64 of each one's ids, as LE u32s, under the LoRA
     * seed: tokenkeys' first step, here on the decoding core) stay; the ids go */
    if (tokens_taken) {
        uint64_t *locals = col_grow(c, COL_LOCALS, (Py_ssize_t)nh);
        if (locals == NULL) return -1;
        const uint8_t *p = col_bytes(c, COL_TOKENS) + sink.start;
        size_t stride = 4 * (size_t)block_size;
        for (size_t b = 0; b < nh; b++, p += stride) {
            locals[b] = XXH3_64bits_withSeed(p, stride, seed);
        }
    }
    if (reading != NULL && col_resize(c, COL_TOKENS, sink.start) < 0) return -1;
    uint8_t *k = col_grow(c, COL_KIND, 1);
    int32_t *nm = col_grow(c, COL_NAME, 1);
    uint64_t *rt = col_grow(c, COL_ROOT, 1);
    int64_t *sz = col_grow(c, COL_SIZE, 1);
    uint64_t *pa = col_grow(c, COL_PARENT, 1);
    uint8_t *hp = col_grow(c, COL_HAS_PARENT, 1);
    int64_t *tc = col_grow(c, COL_TOKEN_COUNT, 1);
    int64_t *bs = col_grow(c, COL_BLOCK_SIZE, 1);
    uint64_t *sd = col_grow(c, COL_SEED, 1);
    if (!k || !nm || !rt || !sz || !pa || !hp || !tc || !bs || !sd) return -1;
    *k = (uint8_t)kind;
    *nm = name;
    *rt = root;
    *sz = (int64_t)nh;
    *pa = parent;
    *hp = (uint8_t)(has_parent == 1);
    *tc = (int64_t)tokens_taken;
    *bs = (int64_t)block_size;
    *sd = seed;
    return 1;
}

/* decode_into's ctx checked and taken apart (cols, names, learn_name, seeds,
 * learn_seed); 0 with a TypeError when it is not that. */
int columns_of(PyObject *ctx, IntoCols *c) {
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != 5
        || !PyList_Check(PyTuple_GET_ITEM(ctx, 0))
        || PyList_GET_SIZE(PyTuple_GET_ITEM(ctx, 0)) != NUM_COLS
        || !PyDict_Check(PyTuple_GET_ITEM(ctx, 1)) || !PyDict_Check(PyTuple_GET_ITEM(ctx, 3))) {
        PyErr_SetString(PyExc_TypeError, "decode_into(payload, with_tokens, root, holder, "
                                         "(cols, names, learn_name, seeds, learn_seed))");
        return 0;
    }
    PyObject *col_list = PyTuple_GET_ITEM(ctx, 0);
    for (int i = 0; i < NUM_COLS; i++) {
        c->cols[i] = PyList_GET_ITEM(col_list, i);
        if (!PyByteArray_CheckExact(c->cols[i])) {
            PyErr_SetString(PyExc_TypeError, "decode_into: the columns are bytearrays");
            return 0;
        }
    }
    c->bufs = NULL;
    c->known = NULL;
    c->nomem = 0;
    c->names = PyTuple_GET_ITEM(ctx, 1);
    c->learn_name = PyTuple_GET_ITEM(ctx, 2);
    c->seeds = PyTuple_GET_ITEM(ctx, 3);
    c->learn_seed = PyTuple_GET_ITEM(ctx, 4);
    return 1;
}

/* The decoder's tables made (before a thread without the GIL decodes). */
void decode_ready(void) {
    if (!fixed_size[0]) init_sizes();
}

/* Cut the columns back to `marks` (their sizes before a batch); -1 with an error
 * (the error already set, if any, is kept). */
int columns_back(IntoCols *c, const Py_ssize_t *marks) {
    if (c->bufs != NULL) { /* (shorter: no allocation) */
        for (int i = 0; i < NUM_COLS; i++) c->bufs[i].len = marks[i];
        return 0;
    }
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    PyErr_Fetch(&type, &value, &tb);
    for (int i = 0; i < NUM_COLS; i++) {
        if (PyByteArray_Resize(c->cols[i], marks[i]) < 0) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return -1;
        }
    }
    PyErr_Restore(type, value, tb);
    return 0;
}

/* The core of decode_into: one payload appended to the columns.  1 with *out filled,
 * 0 not read (the columns as they were), -1 with an error (the columns as they were). */
int payload_into(const uint8_t *p, Py_ssize_t len, int with_tokens, uint64_t root, long holder,
                 IntoCols *c, IntoBatch *out) {
    if (!fixed_size[0]) init_sizes();
    Py_ssize_t marks[NUM_COLS];
    for (int i = 0; i < NUM_COLS; i++) marks[i] = col_len(c, i);
    Reader r = {p, p + len};
    size_t size;
    out->skipped = 0;
    out->rank = 0;
    if (!read_head(&r, &size, &out->ts, &out->events)) goto none;
    for (size_t i = 0; i < out->events; i++) {
        int e = event_into(&r, with_tokens, root, holder, c);
        if (e < 0) {
            columns_back(c, marks);
            return -1;
        }
        if (e == 0) goto none;
        out->skipped += e == 2;
    }
    if (read_tail(&r, size, &out->has_rank, &out->rank)) return 1;
none:
    return columns_back(c, marks) < 0 ? -1 : 0;
}

/* decode_into(payload, with_tokens, root, holder, ctx) -> (ts, dp_rank | None, events,
 * skipped) | None
 * ctx: (cols: list of NUM_COLS bytearrays, names: dict, learn_name, seeds: dict,
 * learn_seed).  The batch's stores and removals appended to the columns (the
 * applier's commit; serving/columns.py is the reference), a store keyed by tokens
 * under `root` (0: by the engine's hashes) with its tokens when it carries all of
 * them.  events: the batch's events; skipped: those of another KV cache group, not
 * appended.  None, with the columns as they were: a clear, or anything decode_batch
 * would not read (Python decodes the payload itself). */
PyObject *sarp_decode_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_DECODE_INTO]++;
    IntoCols c;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "decode_into(payload, with_tokens, root, holder, "
                                         "(cols, names, learn_name, seeds, learn_seed))");
        return NULL;
    }
    if (!columns_of(args[4], &c)) return NULL;
    int with_tokens = PyObject_IsTrue(args[1]);
    uint64_t root = PyLong_AsUnsignedLongLong(args[2]);
    long holder = PyLong_AsLong(args[3]);
    if (with_tokens < 0 || PyErr_Occurred()) return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    IntoBatch b;
    int got = payload_into(buf.buf, buf.len, with_tokens, root, holder, &c, &b);
    PyBuffer_Release(&buf);
    if (got < 0) return NULL;
    if (got == 0) return Py_NewRef(Py_None);
    return b.has_rank ? Py_BuildValue("(dKnn)", b.ts, (unsigned long long)b.rank,
                                      (Py_ssize_t)b.events, (Py_ssize_t)b.skipped)
                      : Py_BuildValue("(dOnn)", b.ts, Py_None, (Py_ssize_t)b.events,
                                      (Py_ssize_t)b.skipped);
}
