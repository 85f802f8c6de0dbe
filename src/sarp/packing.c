/*
 * The C mirror of sarp/packing.py (sarp._native; sarp/native.py loads it): Packer.batch's
 * common operations in C (packing.py is the reference, and tests hold the two to the same bytes on disk).
 *
 * pack_batch applies a batch's operations in order, as Packer.add_insert (its walk,
 * _walk_insert and _place) and Packer.add_remove (_remove_runs) do, on segments held
 * here in C, and at the end writes each touched segment once (Touched.flush).  The
 * LMDB transaction is py-lmdb's, reached through the callables in `ctx`, or through
 * liblmdb's own calls on it (lmdb_env.c) for `blocks` and `segments`.  An operation
 * it does not take (a clear, an insert with meta, a walk that meets a conflict, a claim
 * that finds a stored block, a new holder when every id is taken) stops it before that operation
 * changes anything: it then hands back every touched segment as a record, and
 * Python's Packer carries on from that operation with them.
 *
 * Record layout: native.h (segment.py is the reference).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

/* -- a segment being written ------------------------------------------------------ */

typedef struct {
    uint64_t id, start_pos, parent;
    int is_root, is_new, cleared;
    Py_ssize_t n, cap;   /* blocks, and room per row */
    Py_ssize_t nh, hcap; /* holder rows, and room for them */
    uint64_t *hashes;    /* cap */
    uint16_t *holders;   /* hcap */
    uint8_t *presence;   /* hcap rows of cap */
    int64_t *meta;       /* NULL, or hcap rows of cap */
} Seg;

static void seg_free(Seg *s) {
    if (s == NULL) return;
    PyMem_Free(s->hashes);
    PyMem_Free(s->holders);
    PyMem_Free(s->presence);
    PyMem_Free(s->meta);
    PyMem_Free(s);
}

static Seg *seg_new(Py_ssize_t n, Py_ssize_t nh, int with_meta) {
    Seg *s = PyMem_Calloc(1, sizeof(Seg));
    if (s == NULL) return NULL;
    s->n = n;
    s->nh = nh;
    s->cap = n < 16 ? 16 : n;
    s->hcap = nh < 2 ? 2 : nh;
    s->hashes = PyMem_Malloc((size_t)s->cap * 8);
    s->holders = PyMem_Malloc((size_t)s->hcap * 2);
    s->presence = PyMem_Calloc((size_t)(s->hcap * s->cap), 1);
    if (with_meta) s->meta = PyMem_Malloc((size_t)(s->hcap * s->cap) * 8);
    if (s->hashes == NULL || s->holders == NULL || s->presence == NULL
        || (with_meta && s->meta == NULL)) {
        seg_free(s);
        return NULL;
    }
    return s;
}

/* Room for `n` blocks per row. */
static int seg_grow_blocks(Seg *s, Py_ssize_t n) {
    if (n <= s->cap) return 0;
    Py_ssize_t cap = s->cap * 2 > n ? s->cap * 2 : n;
    uint64_t *hashes = PyMem_Realloc(s->hashes, (size_t)cap * 8);
    if (hashes == NULL) return -1;
    s->hashes = hashes;
    uint8_t *presence = PyMem_Calloc((size_t)(s->hcap * cap), 1);
    int64_t *meta = s->meta ? PyMem_Malloc((size_t)(s->hcap * cap) * 8) : NULL;
    if (presence == NULL || (s->meta && meta == NULL)) {
        PyMem_Free(presence);
        PyMem_Free(meta);
        return -1;
    }
    for (Py_ssize_t r = 0; r < s->nh; r++) {
        memcpy(presence + r * cap, s->presence + r * s->cap, (size_t)s->n);
        if (meta) memcpy(meta + r * cap, s->meta + r * s->cap, (size_t)s->n * 8);
    }
    PyMem_Free(s->presence);
    PyMem_Free(s->meta);
    s->presence = presence;
    s->meta = meta;
    s->cap = cap;
    return 0;
}

/* Room for `nh` rows. */
static int seg_grow_rows(Seg *s, Py_ssize_t nh) {
    if (nh <= s->hcap) return 0;
    Py_ssize_t hcap = s->hcap * 2 > nh ? s->hcap * 2 : nh;
    uint16_t *holders = PyMem_Realloc(s->holders, (size_t)hcap * 2);
    if (holders == NULL) return -1;
    s->holders = holders;
    uint8_t *presence = PyMem_Realloc(s->presence, (size_t)(hcap * s->cap));
    if (presence == NULL) return -1;
    s->presence = presence;
    if (s->meta) {
        int64_t *meta = PyMem_Realloc(s->meta, (size_t)(hcap * s->cap) * 8);
        if (meta == NULL) return -1;
        s->meta = meta;
    }
    s->hcap = hcap;
    return 0;
}

/* Segment.row_of: the row of `holder`, adding an empty one if it has none. */
static Py_ssize_t seg_row_of(Seg *s, uint16_t holder) {
    for (Py_ssize_t r = 0; r < s->nh; r++) {
        if (s->holders[r] == holder) return r;
    }
    if (seg_grow_rows(s, s->nh + 1) < 0) return -1;
    Py_ssize_t r = s->nh++;
    s->holders[r] = holder;
    memset(s->presence + r * s->cap, 0, (size_t)s->cap);
    if (s->meta) {
        for (Py_ssize_t i = 0; i < s->cap; i++) s->meta[r * s->cap + i] = -1;
    }
    return r;
}

static Py_ssize_t seg_find_row(const Seg *s, uint16_t holder) {
    for (Py_ssize_t r = 0; r < s->nh; r++) {
        if (s->holders[r] == holder) return r;
    }
    return -1;
}

/* Segment.append: blocks held by `holder` at the tail. */
static int seg_append(Seg *s, const uint64_t *hashes, Py_ssize_t k, uint16_t holder) {
    Py_ssize_t row = seg_row_of(s, holder);
    if (row < 0 || seg_grow_blocks(s, s->n + k) < 0) return -1;
    memcpy(s->hashes + s->n, hashes, (size_t)k * 8);
    for (Py_ssize_t r = 0; r < s->nh; r++) {
        memset(s->presence + r * s->cap + s->n, r == row, (size_t)k);
        if (s->meta) {
            for (Py_ssize_t i = 0; i < k; i++) s->meta[r * s->cap + s->n + i] = -1;
        }
    }
    s->n += k;
    return 0;
}

/* Segment.drop_empty_rows; the holder ids dropped go to `gone` (a list). */
static int seg_drop_empty_rows(Seg *s, PyObject *gone) {
    Py_ssize_t kept = 0;
    for (Py_ssize_t r = 0; r < s->nh; r++) {
        const uint8_t *row = s->presence + r * s->cap;
        int held = 0;
        for (Py_ssize_t i = 0; i < s->n && !held; i++) held = row[i] != 0;
        if (!held) {
            PyObject *id = PyLong_FromLong(s->holders[r]);
            if (id == NULL || PyList_Append(gone, id) < 0) {
                Py_XDECREF(id);
                return -1;
            }
            Py_DECREF(id);
            continue;
        }
        if (kept != r) {
            s->holders[kept] = s->holders[r];
            memcpy(s->presence + kept * s->cap, row, (size_t)s->n);
            if (s->meta) memcpy(s->meta + kept * s->cap, s->meta + r * s->cap, (size_t)s->n * 8);
        }
        kept++;
    }
    s->nh = kept;
    return 0;
}

/* Segment.encode: the record, checksum included. */
static PyObject *seg_encode(const Seg *s) {
    Py_ssize_t n = s->n, nh = s->nh;
    uint8_t flags = (uint8_t)((s->meta ? HAS_META : 0) | (s->is_root ? IS_ROOT : 0));
    Layout L = record_sections(n, nh, flags);
    Py_ssize_t holders_at = L.holders_at, presence_at = L.presence_at, meta_at = L.meta_at;
    Py_ssize_t size = L.size;
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) return NULL;
    uint8_t *r = (uint8_t *)PyBytes_AS_STRING(out);
    memset(r, 0, (size_t)size);
    uint16_t n16 = (uint16_t)n, nh16 = (uint16_t)nh;
    uint64_t parent = s->is_root ? 0 : s->parent;
    r[0] = 'S';
    r[1] = 'G';
    r[2] = RECORD_VERSION;
    r[3] = flags;
    memcpy(r + 4, &n16, 2);
    memcpy(r + 6, &nh16, 2);
    memcpy(r + 8, &s->start_pos, 8);
    memcpy(r + 16, &parent, 8);
    memcpy(r + HEADER_BYTES, s->hashes, (size_t)n * 8);
    memcpy(r + holders_at, s->holders, (size_t)nh * 2);
    for (Py_ssize_t row = 0; row < nh; row++) {
        memcpy(r + presence_at + row * n, s->presence + row * s->cap, (size_t)n);
        if (s->meta) memcpy(r + meta_at + 8 * row * n, s->meta + row * s->cap, (size_t)n * 8);
    }
    uint64_t sum = XXH3_64bits(r, (size_t)(size - 8));
    memcpy(r + size - 8, &sum, 8);
    return out;
}

/* A record as segment.writable reads it, or NULL without an exception when the record
 * is not one (the caller lets Python name the damage). */
static Seg *seg_parse(uint64_t id, const uint8_t *r, Py_ssize_t size, int *bad) {
    Layout L;
    *bad = record_layout(r, size, &L) != 0;
    if (*bad) return NULL;
    Py_ssize_t n = L.n, nh = L.nh;
    Seg *s = seg_new(n, nh, L.flags & HAS_META);
    if (s == NULL) return NULL;
    s->id = id;
    s->start_pos = u64_at(r + 8);
    s->is_root = (L.flags & IS_ROOT) != 0;
    s->parent = s->is_root ? 0 : u64_at(r + 16);
    memcpy(s->hashes, r + HEADER_BYTES, (size_t)n * 8);
    memcpy(s->holders, r + L.holders_at, (size_t)nh * 2);
    for (Py_ssize_t row = 0; row < nh; row++) {
        memcpy(s->presence + row * s->cap, r + L.presence_at + row * n, (size_t)n);
        if (s->meta) {
            memcpy(s->meta + row * s->cap, r + L.meta_at + 8 * row * n, (size_t)n * 8);
        }
    }
    return s;
}

/* -- u64 -> u64 map (open addressing) -------------------------------------------- */

typedef struct { uint64_t key, val; } Slot; /* together: one cache line read per probe */

typedef struct {
    Slot *slots;
    uint8_t *used;
    size_t mask, count;
} Map;

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser: ids and hashes alike */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static void map_free(Map *m) {
    PyMem_Free(m->slots);
    PyMem_Free(m->used);
    memset(m, 0, sizeof(*m));
}

static int map_init(Map *m, size_t slots) {
    m->slots = PyMem_Malloc(slots * sizeof(Slot));
    m->used = PyMem_Calloc(slots, 1);
    m->mask = slots - 1;
    m->count = 0;
    if (m->slots == NULL || m->used == NULL) {
        map_free(m);
        return -1;
    }
    return 0;
}

static int map_get(const Map *m, uint64_t key, uint64_t *val) {
    for (size_t i = mix(key) & m->mask;; i = (i + 1) & m->mask) {
        if (!m->used[i]) return 0;
        if (m->slots[i].key == key) {
            *val = m->slots[i].val;
            return 1;
        }
    }
}

static int map_put(Map *m, uint64_t key, uint64_t val) {
    if (2 * (m->count + 1) > m->mask + 1) {
        Map bigger;
        if (map_init(&bigger, 2 * (m->mask + 1)) < 0) return -1;
        for (size_t i = 0; i <= m->mask; i++) {
            if (m->used[i]) map_put(&bigger, m->slots[i].key, m->slots[i].val);
        }
        map_free(m);
        *m = bigger;
    }
    size_t i = mix(key) & m->mask;
    while (m->used[i] && m->slots[i].key != key) i = (i + 1) & m->mask;
    if (!m->used[i]) m->count++;
    m->used[i] = 1;
    m->slots[i].key = key;
    m->slots[i].val = val;
    return 0;
}

/* The slot of `key`, made (`*found` 0, its value 0) when the map has none; NULL when
 * out of memory.  One probe where map_get then map_put take two. */
static Slot *map_slot(Map *m, uint64_t key, int *found) {
    int made = 0;
    if (2 * (m->count + 1) > m->mask + 1) { /* grow (map_put does), the key put */
        uint64_t val;
        if (!map_get(m, key, &val)) {
            if (map_put(m, key, 0) < 0) return NULL;
            made = 1;
        }
    }
    size_t i = mix(key) & m->mask;
    while (m->used[i]) {
        if (m->slots[i].key == key) {
            *found = !made;
            return &m->slots[i];
        }
        i = (i + 1) & m->mask;
    }
    m->used[i] = 1;
    m->slots[i] = (Slot){key, 0};
    m->count++;
    *found = 0;
    return &m->slots[i];
}

/* -- a write's `blocks` table on Valkey ------------------------------------------- */

/* BlockTable(fetch): what a write on Valkey knows of the `blocks` table, hash -> entry,
 * as the server had it and as the write changed it (ValkeyWriteTxn's; its Python
 * reference is valkey_write.BlockView).  pack_batch reads and changes it in C, and the
 * commit takes its changes as arrays: no Python object per block.  fetch(key) -> bytes
 * or None reads one entry nobody fetched ahead (a round trip). */
#define E_VALUE(e) ((e) & 0xffffffffffffULL) /* segment id << 16 | offset */
#define E_PRESENT (1ULL << 48)
#define E_CHANGED (1ULL << 49)
#define E_GONE (1ULL << 50) /* the server has no entry: a delete need not be sent */
#define E_WANTED (1ULL << 51) /* named by wanted(), not loaded yet: not known */

typedef struct {
    PyObject_HEAD
    Map map;
    PyObject *fetch;
} BlockTable;

/* An entry as the server gave it (bytes, or None): 0 with `*e`, or -1 error. */
static int bt_parse(PyObject *value, uint64_t *e) {
    *e = E_GONE;
    if (value != Py_None) {
        char *p;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(value, &p, &len) < 0) return -1;
        if (len != 6) {
            PyErr_Format(PyExc_ValueError, "blocks table entry of %zd bytes", len);
            return -1;
        }
        *e = E_PRESENT | ((uint64_t)u32_at((const uint8_t *)p) << 16)
             | u16_at((const uint8_t *)p + 4);
    }
    return 0;
}

static int bt_record(BlockTable *t, uint64_t hash, PyObject *value) {
    uint64_t e;
    if (bt_parse(value, &e) < 0) return -1;
    if (map_put(&t->map, hash, e) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The entry of `hash`, fetched when the write does not know it yet: 0, or -1 error. */
static int bt_lookup(BlockTable *t, uint64_t hash, uint64_t *e) {
    if (map_get(&t->map, hash, e) && !(*e & E_WANTED)) return 0;
    PyObject *key = be_key(hash);
    if (key == NULL) return -1;
    PyObject *value = PyObject_CallOneArg(t->fetch, key);
    Py_DECREF(key);
    if (value == NULL) return -1;
    int r = bt_record(t, hash, value);
    Py_DECREF(value);
    if (r < 0) return -1;
    map_get(&t->map, hash, e);
    return 0;
}

/* Set (present) or delete (seg_id 0 with `present` 0) one entry; what the server had
 * is kept (E_GONE). */
static int bt_change(BlockTable *t, uint64_t hash, int present, uint64_t seg_id,
                     Py_ssize_t off) {
    int found;
    Slot *slot = map_slot(&t->map, hash, &found);
    if (slot == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* (a wanted entry changed before it is loaded is not known gone: its delete is sent) */
    uint64_t e = (found ? slot->val & E_GONE : 0) | E_CHANGED;
    if (present) e |= E_PRESENT | ((uint64_t)(uint32_t)seg_id << 16) | (uint16_t)off;
    slot->val = e;
    return 0;
}

static int bt_u64s(PyObject *obj, Py_buffer *buf) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (buf->len % 8) {
        PyErr_Format(PyExc_ValueError, "%zd bytes is not whole uint64s", buf->len);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

/* The uint64s of `obj` in `in`, and bytes as long for those a call keeps (cut to
 * them by bt_kept): the bytes' data, or NULL on error (nothing held then). */
static uint64_t *bt_u64s_out(PyObject *obj, Py_buffer *in, PyObject **out) {
    if (bt_u64s(obj, in) < 0) return NULL;
    *out = PyBytes_FromStringAndSize(NULL, in->len);
    if (*out == NULL) {
        PyBuffer_Release(in);
        return NULL;
    }
    return (uint64_t *)PyBytes_AS_STRING(*out);
}

static PyObject *bt_kept(Py_buffer *in, PyObject *out, Py_ssize_t k) {
    PyBuffer_Release(in);
    if (_PyBytes_Resize(&out, k * 8) < 0) return NULL;
    return out;
}

static PyObject *bt_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *fetch;
    if (!PyArg_ParseTuple(args, "O:BlockTable", &fetch)) return NULL;
    sarp_calls[CALL_BLOCK_TABLE]++;
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    if (map_init(&t->map, 1024) < 0) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->fetch = Py_NewRef(fetch);
    return (PyObject *)t;
}

static void bt_dealloc(BlockTable *t) {
    map_free(&t->map);
    Py_XDECREF(t->fetch);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* wanted(hashes) -> bytes: the distinct hashes the write knows nothing of, first seen
 * first (what a prefetch asks the server for); each is marked wanted, so that it is
 * named once, until load() records it. */
static PyObject *bt_wanted(BlockTable *t, PyObject *arg) {
    Py_buffer in;
    PyObject *out;
    uint64_t *dst = bt_u64s_out(arg, &in, &out);
    if (dst == NULL) return NULL;
    Py_ssize_t n = in.len / 8, k = 0;
    const uint64_t *src = in.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int found;
        Slot *slot = map_slot(&t->map, src[i], &found);
        if (slot == NULL) {
            PyBuffer_Release(&in);
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
        if (!found) {
            slot->val = E_WANTED;
            dst[k++] = src[i];
        }
    }
    return bt_kept(&in, out, k);
}

/* load(hashes, values): the server's entries (bytes, or None where it has none) of
 * hashes the write knows nothing of yet (a known one keeps what the write has). */
static PyObject *bt_load(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "load(hashes, values: list)");
        return NULL;
    }
    Py_buffer in;
    if (bt_u64s(args[0], &in) < 0) return NULL;
    const uint64_t *h = in.buf;
    Py_ssize_t n = in.len / 8;
    if (PyList_GET_SIZE(args[1]) != n) {
        PyBuffer_Release(&in);
        PyErr_Format(PyExc_ValueError, "load: %zd hashes and %zd values", n,
                     PyList_GET_SIZE(args[1]));
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int found;
        Slot *slot = map_slot(&t->map, h[i], &found);
        uint64_t e;
        if (slot == NULL || (found && !(slot->val & E_WANTED))) {
            if (slot != NULL) continue;
            PyBuffer_Release(&in);
            return PyErr_NoMemory();
        }
        if (bt_parse(PyList_GET_ITEM(args[1], i), &e) < 0) {
            slot->val = E_WANTED; /* (made here: not known) */
            PyBuffer_Release(&in);
            return NULL;
        }
        slot->val = e;
    }
    PyBuffer_Release(&in);
    Py_RETURN_NONE;
}

/* get(hashes) -> (segment ids, offsets) as uint32 and uint16 bytes, 0 where absent
 * (an entry the write does not know is fetched). */
static PyObject *bt_get(BlockTable *t, PyObject *arg) {
    Py_buffer in;
    if (bt_u64s(arg, &in) < 0) return NULL;
    Py_ssize_t n = in.len / 8;
    PyObject *segs = PyBytes_FromStringAndSize(NULL, n * 4);
    PyObject *offs = PyBytes_FromStringAndSize(NULL, n * 2);
    if (segs == NULL || offs == NULL) goto fail;
    uint32_t *sp = (uint32_t *)PyBytes_AS_STRING(segs);
    uint16_t *op = (uint16_t *)PyBytes_AS_STRING(offs);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t e;
        if (bt_lookup(t, ((const uint64_t *)in.buf)[i], &e) < 0) goto fail;
        sp[i] = e & E_PRESENT ? (uint32_t)(E_VALUE(e) >> 16) : 0;
        op[i] = e & E_PRESENT ? (uint16_t)E_VALUE(e) : 0;
    }
    PyBuffer_Release(&in);
    return Py_BuildValue("(NN)", segs, offs);
fail:
    PyBuffer_Release(&in);
    Py_XDECREF(segs);
    Py_XDECREF(offs);
    return NULL;
}

/* put(hashes, seg_id, first_offset): the entries of consecutive blocks of a segment. */
static PyObject *bt_put(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long seg_id;
    Py_ssize_t first;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put(hashes, seg_id, first_offset)");
        return NULL;
    }
    seg_id = PyLong_AsUnsignedLongLong(args[1]);
    first = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer in;
    if (bt_u64s(args[0], &in) < 0) return NULL;
    for (Py_ssize_t i = 0; i < in.len / 8; i++) {
        if (bt_change(t, ((const uint64_t *)in.buf)[i], 1, seg_id, first + i) < 0) {
            PyBuffer_Release(&in);
            return NULL;
        }
    }
    PyBuffer_Release(&in);
    Py_RETURN_NONE;
}

/* delete(hashes): their entries, at the commit. */
static PyObject *bt_delete(BlockTable *t, PyObject *arg) {
    Py_buffer in;
    if (bt_u64s(arg, &in) < 0) return NULL;
    for (Py_ssize_t i = 0; i < in.len / 8; i++) {
        if (bt_change(t, ((const uint64_t *)in.buf)[i], 0, 0, 0) < 0) {
            PyBuffer_Release(&in);
            return NULL;
        }
    }
    PyBuffer_Release(&in);
    Py_RETURN_NONE;
}

/* changes() -> (set keys, set values, delete keys): the commit's, as big-endian 8-byte
 * keys and 6-byte values end to end; a delete of an entry the server has not is left
 * out (nobody else writes while the write holds the lease). */
static PyObject *bt_changes(BlockTable *t, PyObject *unused) {
    size_t sets = 0, dels = 0;
    for (size_t i = 0; i <= t->map.mask; i++) {
        uint64_t e = t->map.slots[i].val;
        if (!t->map.used[i] || !(e & E_CHANGED)) continue;
        if (e & E_PRESENT) sets++;
        else if (!(e & E_GONE)) dels++;
    }
    PyObject *keys = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sets * 8);
    PyObject *vals = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sets * 6);
    PyObject *gone = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)dels * 8);
    if (keys == NULL || vals == NULL || gone == NULL) {
        Py_XDECREF(keys);
        Py_XDECREF(vals);
        Py_XDECREF(gone);
        return NULL;
    }
    uint8_t *kp = (uint8_t *)PyBytes_AS_STRING(keys), *vp = (uint8_t *)PyBytes_AS_STRING(vals);
    uint8_t *gp = (uint8_t *)PyBytes_AS_STRING(gone);
    for (size_t i = 0; i <= t->map.mask; i++) {
        uint64_t e = t->map.slots[i].val, h = t->map.slots[i].key;
        if (!t->map.used[i] || !(e & E_CHANGED)) continue;
        uint8_t *out = e & E_PRESENT ? kp : !(e & E_GONE) ? gp : NULL;
        if (out == NULL) continue;
        for (int b = 0; b < 8; b++) out[b] = (uint8_t)(h >> (56 - 8 * b));
        if (e & E_PRESENT) {
            uint32_t sid = (uint32_t)(E_VALUE(e) >> 16);
            uint16_t off = (uint16_t)E_VALUE(e);
            memcpy(vp, &sid, 4);
            memcpy(vp + 4, &off, 2);
            vp += 6;
            kp += 8;
        } else {
            gp += 8;
        }
    }
    return Py_BuildValue("(NNN)", keys, vals, gone);
}

/* take(known, hashes) -> bytes: the entries `known` (the writer's table of what the
 * server has, kept between writes) has of `hashes`, copied in as read; returns the
 * hashes it lacks (what is still to be fetched). */
static PyObject *bt_take(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyObject_TypeCheck(args[0], &sarp_BlockTableType)) {
        PyErr_SetString(PyExc_TypeError, "take(known: BlockTable, hashes)");
        return NULL;
    }
    const Map *known = &((BlockTable *)args[0])->map;
    Py_buffer in;
    PyObject *out;
    uint64_t *dst = bt_u64s_out(args[1], &in, &out);
    if (dst == NULL) return NULL;
    Py_ssize_t n = in.len / 8, k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = ((const uint64_t *)in.buf)[i], e;
        if (!map_get(known, h, &e) || (e & E_WANTED)) {
            dst[k++] = h;
            continue;
        }
        int found;
        Slot *slot = map_slot(&t->map, h, &found);
        if (slot == NULL) {
            PyBuffer_Release(&in);
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
        if (!found || (slot->val & E_WANTED)) {
            slot->val = e & (E_PRESENT | E_GONE | E_VALUE(~0ULL));
        }
    }
    return bt_kept(&in, out, k);
}

/* absorb(write): what a committed write's table knows, as the server now has it. */
static PyObject *bt_absorb(BlockTable *t, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &sarp_BlockTableType)) {
        PyErr_SetString(PyExc_TypeError, "absorb(write: BlockTable)");
        return NULL;
    }
    const Map *w = &((BlockTable *)arg)->map;
    for (size_t i = 0; i <= w->mask; i++) {
        uint64_t e = w->slots[i].val;
        if (!w->used[i] || (e & E_WANTED)) continue;
        if (map_put(&t->map, w->slots[i].key, e & E_PRESENT ? E_PRESENT | E_VALUE(e) : E_GONE)
            < 0) {
            return PyErr_NoMemory();
        }
    }
    Py_RETURN_NONE;
}

static Py_ssize_t bt_len(BlockTable *t) { return (Py_ssize_t)t->map.count; }

static PySequenceMethods bt_sequence = {.sq_length = (lenfunc)bt_len};

static PyMethodDef bt_methods[] = {
    {"take", (PyCFunction)(void (*)(void))bt_take, METH_FASTCALL,
     "take(known, hashes) -> bytes: known's entries of hashes copied in; those it lacks"},
    {"absorb", (PyCFunction)bt_absorb, METH_O,
     "absorb(write): a committed write's entries, as the server now has them"},
    {"wanted", (PyCFunction)bt_wanted, METH_O,
     "wanted(hashes) -> bytes: the distinct hashes not known yet, first seen first"},
    {"load", (PyCFunction)(void (*)(void))bt_load, METH_FASTCALL,
     "load(hashes, values): the server's entries (None: it has none)"},
    {"get", (PyCFunction)bt_get, METH_O,
     "get(hashes) -> (uint32 segment ids, uint16 offsets) bytes, 0 where absent"},
    {"put", (PyCFunction)(void (*)(void))bt_put, METH_FASTCALL,
     "put(hashes, seg_id, first_offset): entries of consecutive blocks"},
    {"delete", (PyCFunction)bt_delete, METH_O, "delete(hashes): entries to delete"},
    {"changes", (PyCFunction)bt_changes, METH_NOARGS,
     "changes() -> (set keys, set values, delete keys) as bytes"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject sarp_BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sarp._native.BlockTable",
    .tp_basicsize = sizeof(BlockTable),
    .tp_dealloc = (destructor)bt_dealloc,
    .tp_as_sequence = &bt_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BlockTable(fetch): a write's view of the blocks table on Valkey",
    .tp_methods = bt_methods,
    .tp_new = bt_new,
};

/* -- the batch -------------------------------------------------------------------- */

/* ctx's callables, in order: the write transaction's (WriteTxn.native_calls), then the
 * directory's lookup, its two dicts (as walk in _native.c probes them) and its sorted
 * probe (Directory.sorted_probe: C's own end of the lookup), or None (the lookup's). */
enum {
    CB_BLOCK_GET, CB_SEG_GET, CB_SEGMENT_PY, CB_NEW_SEG_ID, CB_UNTAKE_SEG_IDS, CB_HOLDER_ID,
    CB_NEW_HOLDER, CB_PUT, CB_DELETE, CB_SEGMENTS_DB, CB_BLOCKS_DB, CB_CUR_PUT, CB_CUR_SET_KEY,
    CB_CUR_POP, CB_LOOKUP, CB_RECENT, CB_REMEMBERED, CB_SORTED, NUM_CB
};

/* A deferred batch keeps its `blocks` changes in `pend` (hash -> kind, segment id,
 * offset) and writes them at the end in key order through one cursor (apply_pending):
 * LMDB then finds most keys on the leaf its cursor is on instead of descending from
 * the root for each.  A claim is checked against `pend` only; the no-overwrite put at
 * the end proves it against the table, and a refusal there makes the whole batch run
 * again undeferred (Packer._native_batch), so every answer is the undeferred one. */
enum { PEND_NONE = 0, PEND_NEW = 1, PEND_SET = 2, PEND_DONE = 3 };
#define PEND(kind, seg, off) \
    (((uint64_t)(kind) << 48) | ((uint64_t)(uint32_t)(seg) << 16) | (uint64_t)(uint16_t)(off))
#define PEND_KIND(v) ((int)((v) >> 48))
#define PEND_SEG(v) (((v) >> 16) & 0xffffffffu)
#define PEND_OFF(v) ((Py_ssize_t)((v) & 0xffffu))

typedef struct {
    PyObject *cb[NUM_CB];
    SortedDir sorted;  /* the directory's arrays (CB_SORTED), when given */
    PyObject *names;   /* holder name -> id or None, as looked up in this batch */
    PyObject *created; /* [(id, name)] of holders named by this batch */
    Py_ssize_t cap_blocks, split_tail;
    Seg **segs;      /* touched, in the order first touched */
    Py_ssize_t nsegs, segs_cap;
    Map index;       /* segment id -> position in segs */
    Map heads;       /* first hash of a segment created here -> its id */
    int deferred;    /* `blocks` changes wait in `pend` for apply_pending */
    Map pend;
    BlockTable *table; /* the write's `blocks` on Valkey, or NULL: the callables' */
    int has_raw;       /* `blocks` and `segments` through liblmdb's own calls (raw) */
    RawTxn raw;
    Py_ssize_t new_blocks, removed_blocks;
    PyObject *empty; /* b"" */
    GilTurn turn;    /* (native.h: a waiting thread's turns, between operations) */
} Batch;

enum { OP_DONE = 0, OP_NO_PARENT = 1, OP_TO_PYTHON = 2, OP_ERROR = -1 };

static PyObject *call1(PyObject *fn, PyObject *arg) {
    PyObject *out = PyObject_CallOneArg(fn, arg);
    Py_DECREF(arg);
    return out;
}

/* -- liblmdb's own calls (b->has_raw), each as its py-lmdb method does it ------------ */

/* txn.get of a big-endian u64 key: 1 found (*v, valid until the next write), 0 not,
 * -1 error. */
static int raw_get(Batch *b, unsigned dbi, uint64_t key, RawVal *v) {
    uint8_t k[8];
    be8(key, k);
    RawVal kv = {8, k};
    int rc = b->raw.api->get(b->raw.txn, dbi, &kv, v);
    if (rc == 0) return 1;
    return rc == RAW_NOTFOUND ? 0 : raw_failed(&b->raw, rc);
}

/* txn.put (through the `blocks` cursor with `cursor`): 1 written, 0 refused (there,
 * and overwrite off), -1 error. */
static int raw_put(Batch *b, unsigned dbi, uint64_t key, const void *data, size_t size,
                   int overwrite, int cursor) {
    uint8_t k[8];
    be8(key, k);
    RawVal kv = {8, k}, dv = {size, (void *)data};
    unsigned flags = overwrite ? 0 : RAW_NOOVERWRITE;
    if (cursor && raw_cursor(&b->raw) < 0) return -1;
    int rc = cursor ? b->raw.api->cursor_put(b->raw.cursor, &kv, &dv, flags)
                    : b->raw.api->put(b->raw.txn, dbi, &kv, &dv, flags);
    if (rc == 0) return 1;
    return rc == RAW_KEYEXIST && !overwrite ? 0 : raw_failed(&b->raw, rc);
}

/* txn.delete(key, b"", db): 0 (deleted or absent), -1 error. */
static int raw_del(Batch *b, unsigned dbi, uint64_t key) {
    uint8_t k[8];
    be8(key, k);
    RawVal kv = {8, k};
    int rc = b->raw.api->del(b->raw.txn, dbi, &kv, NULL);
    return rc == 0 || rc == RAW_NOTFOUND ? 0 : raw_failed(&b->raw, rc);
}

/* A meta counter (store.counter_value: 8 bytes big-endian, 0 when absent): 1 read,
 * 0 not 8 bytes (damaged: Python names it), -1 error. */
static int raw_counter(Batch *b, const char *name, uint64_t *value) {
    RawVal k = {strlen(name), (void *)name}, v = {0, NULL};
    int rc = b->raw.api->get(b->raw.txn, b->raw.meta, &k, &v);
    *value = 0;
    if (rc == RAW_NOTFOUND) return 1;
    if (rc) return raw_failed(&b->raw, rc);
    if (v.size != 8) return 0;
    for (int i = 0; i < 8; i++) *value = *value << 8 | ((const uint8_t *)v.data)[i];
    return 1;
}

/* WriteTxn.set_counter: 0, or -1 on error. */
static int raw_set_counter(Batch *b, const char *name, uint64_t value) {
    uint8_t be[8];
    be8(value, be);
    RawVal k = {strlen(name), (void *)name}, v = {8, be};
    int rc = b->raw.api->put(b->raw.txn, b->raw.meta, &k, &v, 0);
    return rc ? raw_failed(&b->raw, rc) : 0;
}

/* WriteTxn.log of the flushed segments' (id, first hash), under the next sequence
 * numbers (take_seqs): 1 written, 0 the counter is damaged (Python's log names it),
 * -1 error. */
static int raw_log(Batch *b) {
    uint64_t last;
    int got = raw_counter(b, "next_seq", &last);
    if (got <= 0 || b->nsegs == 0) return got;
    for (Py_ssize_t x = 0; x < b->nsegs; x++) {
        const Seg *s = b->segs[x];
        uint32_t id = (uint32_t)s->id;
        uint64_t first = s->hashes[0];
        uint8_t value[12]; /* LOG_VALUE: <IQ */
        for (int i = 0; i < 4; i++) value[i] = (uint8_t)(id >> (8 * i));
        for (int i = 0; i < 8; i++) value[4 + i] = (uint8_t)(first >> (8 * i));
        if (raw_put(b, b->raw.log, last + 1 + (uint64_t)x, value, 12, 1, 0) < 0) return -1;
    }
    return raw_set_counter(b, "next_seq", last + (uint64_t)b->nsegs) < 0 ? -1 : 1;
}

/* The `blocks` cursor's set_key, and with `pop` its delete: 1 found, 0 not, -1 error. */
static int raw_find(Batch *b, uint64_t key, int pop) {
    uint8_t k[8];
    be8(key, k);
    RawVal kv = {8, k}, dv = {0, NULL};
    if (raw_cursor(&b->raw) < 0) return -1;
    int rc = b->raw.api->cursor_get(b->raw.cursor, &kv, &dv, RAW_SET);
    if (rc == RAW_NOTFOUND) return 0;
    if (rc == 0 && pop) rc = b->raw.api->cursor_del(b->raw.cursor, 0);
    return rc == 0 ? 1 : raw_failed(&b->raw, rc);
}

static int touched_add(Batch *b, Seg *s) {
    if (b->nsegs == b->segs_cap) {
        Py_ssize_t cap = b->segs_cap ? 2 * b->segs_cap : 64;
        Seg **segs = PyMem_Realloc(b->segs, (size_t)cap * sizeof(Seg *));
        if (segs == NULL) return -1;
        b->segs = segs;
        b->segs_cap = cap;
    }
    if (map_put(&b->index, s->id, (uint64_t)b->nsegs) < 0) return -1;
    b->segs[b->nsegs++] = s;
    return 0;
}

/* Touched.add_new */
static int touched_add_new(Batch *b, Seg *s) {
    s->is_new = 1;
    if (touched_add(b, s) < 0) return -1;
    return map_put(&b->heads, s->hashes[0], s->id);
}

/* Touched.get: the segment, read (and checked) on first touch.  NULL with an
 * exception set: Python's reader names a damaged record. */
static Seg *touched_get(Batch *b, uint64_t id) {
    uint64_t at;
    if (map_get(&b->index, id, &at)) return b->segs[at];
    Seg *s = NULL;
    int bad = 1;
    if (b->has_raw) {
        RawVal v;
        int got = raw_get(b, b->raw.segments, id, &v);
        if (got < 0) return NULL;
        if (got) s = seg_parse(id, v.data, (Py_ssize_t)v.size, &bad);
    } else {
        PyObject *key = be_key(id);
        if (key == NULL) return NULL;
        PyObject *rec = call1(b->cb[CB_SEG_GET], key);
        if (rec == NULL) return NULL;
        if (rec != Py_None) {
            Py_buffer buf;
            if (PyObject_GetBuffer(rec, &buf, PyBUF_SIMPLE) < 0) {
                Py_DECREF(rec);
                return NULL;
            }
            s = seg_parse(id, buf.buf, buf.len, &bad);
            PyBuffer_Release(&buf);
        }
        Py_DECREF(rec);
    }
    if (bad) { /* missing or damaged: WriteTxn.segment raises the error that says so */
        PyObject *idobj = PyLong_FromUnsignedLongLong(id);
        if (idobj == NULL) return NULL;
        PyObject *out = call1(b->cb[CB_SEGMENT_PY], idobj);
        if (out != NULL) {
            Py_DECREF(out);
            PyErr_Format(PyExc_RuntimeError,
                         "sarp._native: segment %llu reads in Python but not in C",
                         (unsigned long long)id);
        }
        return NULL;
    }
    if (s == NULL) return (Seg *)PyErr_NoMemory();
    if (touched_add(b, s) < 0) {
        seg_free(s);
        PyErr_NoMemory();
        return NULL;
    }
    return s;
}

/* WriteTxn.locate_one: 1 with (segment id, offset), 0 if absent, -1 on error. */
static int locate_one(Batch *b, uint64_t hash, uint64_t *seg_id, Py_ssize_t *off) {
    uint64_t v;
    if (b->deferred && map_get(&b->pend, hash, &v) && PEND_KIND(v) != PEND_NONE) {
        *seg_id = PEND_SEG(v);
        *off = PEND_OFF(v);
        return 1;
    }
    if (b->table != NULL) {
        if (bt_lookup(b->table, hash, &v) < 0) return -1;
        *seg_id = E_VALUE(v) >> 16;
        *off = (Py_ssize_t)(E_VALUE(v) & 0xffff);
        return (v & E_PRESENT) && *seg_id != 0;
    }
    if (b->has_raw) {
        RawVal got;
        int found = raw_get(b, b->raw.blocks, hash, &got);
        if (found <= 0) return found;
        if (got.size != 6) {
            PyErr_Format(PyExc_ValueError, "blocks table entry of %zd bytes",
                         (Py_ssize_t)got.size);
            return -1;
        }
        *seg_id = u32_at((const uint8_t *)got.data);
        *off = u16_at((const uint8_t *)got.data + 4);
        return *seg_id != 0;
    }
    PyObject *key = be_key(hash);
    if (key == NULL) return -1;
    PyObject *value = call1(b->cb[CB_BLOCK_GET], key);
    if (value == NULL) return -1;
    int found = 0;
    if (value != Py_None) {
        char *p;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(value, &p, &len) < 0) {
            Py_DECREF(value);
            return -1;
        }
        if (len != 6) {
            Py_DECREF(value);
            PyErr_Format(PyExc_ValueError, "blocks table entry of %zd bytes", len);
            return -1;
        }
        *seg_id = u32_at((const uint8_t *)p);
        *off = u16_at((const uint8_t *)p + 4);
        found = *seg_id != 0;
    }
    Py_DECREF(value);
    return found;
}

/* The directory's lookup, as Packer.heads does it after Touched.head: 1 with the id,
 * 0 if none, -1 on error. */
static int head_of(Batch *b, uint64_t hash, uint64_t *seg_id) {
    if (map_get(&b->heads, hash, seg_id)) return 1;
    PyObject *key = PyLong_FromUnsignedLongLong(hash);
    if (key == NULL) return -1;
    PyObject *seg = PyDict_GetItemWithError(b->cb[CB_RECENT], key);
    if (seg == NULL && !PyErr_Occurred()) seg = PyDict_GetItemWithError(b->cb[CB_REMEMBERED], key);
    if (seg != NULL) {
        Py_INCREF(seg);
    } else if (!PyErr_Occurred() && b->sorted.taken) {
        int got = sorted_lookup(&b->sorted, key, hash, seg_id);
        Py_DECREF(key);
        return got;
    } else if (!PyErr_Occurred()) {
        seg = PyObject_CallOneArg(b->cb[CB_LOOKUP], key);
    }
    Py_DECREF(key);
    if (seg == NULL) return -1;
    if (seg == Py_None) {
        Py_DECREF(seg);
        return 0;
    }
    *seg_id = PyLong_AsUnsignedLongLong(seg);
    Py_DECREF(seg);
    return PyErr_Occurred() ? -1 : 1;
}

static int new_segment_id(Batch *b, uint64_t *id) {
    if (b->has_raw) { /* WriteLogic.new_segment_id on the meta table */
        uint64_t last;
        int got = raw_counter(b, "next_seg_id", &last);
        if (got < 0) return -1;
        uint64_t seg_id = (last / SEG_ID_STRIDE + 1) * SEG_ID_STRIDE;
        if (got == 1 && seg_id + SEG_ID_STRIDE - 1 <= MAX_SEGMENT_ID) {
            *id = seg_id;
            return raw_set_counter(b, "next_seg_id", seg_id + SEG_ID_STRIDE - 1);
        } /* damaged, or every id taken: Python's raises the error that says so */
    }
    PyObject *out = PyObject_CallNoArgs(b->cb[CB_NEW_SEG_ID]);
    if (out == NULL) return -1;
    *id = PyLong_AsUnsignedLongLong(out);
    Py_DECREF(out);
    return PyErr_Occurred() ? -1 : 0;
}

/* Give back segment ids from `first` on (an insert that took them and then found one
 * of its blocks stored, so that Python's rerun takes the same ids). */
static int untake_seg_ids(Batch *b, uint64_t first) {
    PyObject *arg = PyLong_FromUnsignedLongLong(first);
    if (arg == NULL) return -1;
    PyObject *out = call1(b->cb[CB_UNTAKE_SEG_IDS], arg);
    if (out == NULL) return -1;
    Py_DECREF(out);
    return 0;
}

/* The `blocks` entry of a block at (seg_id, offset), as _block_items makes it. */
static PyObject *block_value(uint64_t seg_id, Py_ssize_t offset) {
    uint8_t v[6];
    uint32_t sid = (uint32_t)seg_id;
    uint16_t off = (uint16_t)offset;
    memcpy(v, &sid, 4);
    memcpy(v + 4, &off, 2);
    return PyBytes_FromStringAndSize((const char *)v, 6);
}

/* A put into a write's buffered changes, `put` being the pair (views, pending) of
 * dicts by table name (ValkeyWriteTxn.native_calls): with overwrite off, refused when
 * the view has a value (its lookup of a key not read yet fetches it).  1 written,
 * 0 refused, -1 error.  Borrows key and value. */
static int dict_put(PyObject *put, PyObject *key, PyObject *value, int overwrite,
                    PyObject *db) {
    PyObject *view = PyDict_GetItemWithError(PyTuple_GET_ITEM(put, 0), db);
    PyObject *pend = view ? PyDict_GetItemWithError(PyTuple_GET_ITEM(put, 1), db) : NULL;
    if (pend == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "no such table");
        return -1;
    }
    if (!overwrite && value != Py_None) {
        PyObject *now = PyObject_GetItem(view, key);
        if (now == NULL) return -1;
        int there = now != Py_None;
        Py_DECREF(now);
        if (there) return 0;
    }
    if (PyDict_SetItem(view, key, value) < 0 || PyDict_SetItem(pend, key, value) < 0) {
        return -1;
    }
    return 1;
}

/* put(key, value, dupdata, overwrite, append[, db]) through `put` (a transaction's,
 * called with `db`, or a cursor's, with `db` NULL): 1 written, 0 refused (the key is
 * there and overwrite is off), -1 error.  Consumes key and value. */
static int put_call(PyObject *put, PyObject *key, PyObject *value, int overwrite,
                    PyObject *db) {
    int result = -1;
    if (key != NULL && value != NULL && PyTuple_Check(put)) {
        result = dict_put(put, key, value, overwrite, db);
    } else if (key != NULL && value != NULL) {
        PyObject *args[] = {key, value, Py_True, overwrite ? Py_True : Py_False, Py_False, db};
        PyObject *out = PyObject_Vectorcall(put, args, db != NULL ? 6 : 5, NULL);
        if (out != NULL) {
            result = PyObject_IsTrue(out);
            Py_DECREF(out);
        }
    }
    Py_XDECREF(key);
    Py_XDECREF(value);
    return result;
}

/* The `blocks` entry of `hash` at (seg_id, offset) put, by the transaction or (with
 * `cursor`) by the blocks cursor: 1 written, 0 refused (see put_call), -1 error. */
static int put_block(Batch *b, uint64_t hash, uint64_t seg_id, Py_ssize_t offset,
                     int overwrite, int cursor) {
    if (b->has_raw) {
        uint8_t v[6];
        uint32_t sid = (uint32_t)seg_id;
        uint16_t off = (uint16_t)offset;
        memcpy(v, &sid, 4);
        memcpy(v + 4, &off, 2);
        return raw_put(b, b->raw.blocks, hash, v, 6, overwrite, cursor);
    }
    return cursor ? put_call(b->cb[CB_CUR_PUT], be_key(hash), block_value(seg_id, offset),
                             overwrite, NULL)
                  : put_call(b->cb[CB_PUT], be_key(hash), block_value(seg_id, offset),
                             overwrite, b->cb[CB_BLOCKS_DB]);
}

/* txn.delete(key, b"", db) of a big-endian u64 key: 0, or -1 on error. */
static int delete_key(Batch *b, uint64_t k, int db) {
    if (b->has_raw) return raw_del(b, db == CB_BLOCKS_DB ? b->raw.blocks : b->raw.segments, k);
    PyObject *key = be_key(k);
    if (key == NULL) return -1;
    if (PyTuple_Check(b->cb[CB_DELETE])) {
        int r = dict_put(b->cb[CB_DELETE], key, Py_None, 1, b->cb[db]);
        Py_DECREF(key);
        return r < 0 ? -1 : 0;
    }
    PyObject *args[] = {key, b->empty, b->cb[db]};
    PyObject *out = PyObject_Vectorcall(b->cb[CB_DELETE], args, 3, NULL);
    Py_DECREF(key);
    if (out == NULL) return -1;
    Py_DECREF(out);
    return 0;
}

/* A `blocks` entry set (overwriting) or deleted, in the table or through the
 * callables: 0, or -1 on error. */
static int blk_set(Batch *b, uint64_t hash, uint64_t seg_id, Py_ssize_t off) {
    if (b->table != NULL) return bt_change(b->table, hash, 1, seg_id, off);
    return put_block(b, hash, seg_id, off, 1, 0) < 0 ? -1 : 0;
}

static int blk_delete(Batch *b, uint64_t hash) {
    if (b->table != NULL) return bt_change(b->table, hash, 0, 0, 0);
    return delete_key(b, hash, CB_BLOCKS_DB);
}

/* WriteTxn.claim_blocks: 1 claimed, 0 refused (nothing of it left; *refused: the
 * first of `hashes` that is stored), -1 error.  Each entry goes in with LMDB's
 * no-overwrite put; at the first refusal the ones put are deleted again. */
static int claim(Batch *b, const uint64_t *hashes, Py_ssize_t k, uint64_t seg_id,
                 Py_ssize_t first_offset, Py_ssize_t *refused) {
    if (b->deferred) { /* against this batch's entries; the table's are checked at the end */
        for (Py_ssize_t i = 0; i < k; i++) {
            uint64_t v;
            if (map_get(&b->pend, hashes[i], &v) && PEND_KIND(v) != PEND_NONE) {
                for (Py_ssize_t j = 0; j < i; j++) {
                    if (map_put(&b->pend, hashes[j], PEND(PEND_NONE, 0, 0)) < 0) goto oom;
                }
                *refused = i;
                return 0;
            }
            if (map_put(&b->pend, hashes[i], PEND(PEND_NEW, seg_id, first_offset + i)) < 0) {
                goto oom;
            }
        }
        return 1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        int put;
        if (b->table != NULL) {
            uint64_t e;
            if (bt_lookup(b->table, hashes[i], &e) < 0) return -1;
            put = !(e & E_PRESENT);
            if (put && bt_change(b->table, hashes[i], 1, seg_id, first_offset + i) < 0) {
                return -1;
            }
        } else {
            put = put_block(b, hashes[i], seg_id, first_offset + i, 0, 0);
            if (put < 0) return -1;
        }
        if (!put) {
            for (Py_ssize_t j = 0; j < i; j++) {
                if (blk_delete(b, hashes[j]) < 0) return -1;
            }
            *refused = i;
            return 0;
        }
    }
    return 1;
oom:
    PyErr_NoMemory();
    return -1;
}

/* WriteLogic.tail_segment_id: the first id kept after `home` (a multiple of the
 * stride) that no record has and this batch has not touched; else a new id. */
static int tail_segment_id(Batch *b, uint64_t home, uint64_t *id) {
    if (home % SEG_ID_STRIDE == 0) {
        for (uint64_t candidate = home + 1; candidate < home + SEG_ID_STRIDE; candidate++) {
            uint64_t at;
            if (map_get(&b->index, candidate, &at)) continue;
            int free_id;
            if (b->has_raw) {
                RawVal v;
                int got = raw_get(b, b->raw.segments, candidate, &v);
                if (got < 0) return -1;
                free_id = !got;
            } else {
                PyObject *key = be_key(candidate);
                if (key == NULL) return -1;
                PyObject *rec = call1(b->cb[CB_SEG_GET], key);
                if (rec == NULL) return -1;
                free_id = rec == Py_None;
                Py_DECREF(rec);
            }
            if (free_id) {
                *id = candidate;
                return 0;
            }
        }
    }
    return new_segment_id(b, id);
}

/* Packer._split: move `s`'s blocks from `at` on into a new segment. */
static int split(Batch *b, Seg *s, Py_ssize_t at) {
    uint64_t id;
    if (tail_segment_id(b, s->id, &id) < 0) return -1;
    Py_ssize_t k = s->n - at;
    Seg *t = seg_new(k, s->nh, s->meta != NULL);
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->id = id;
    t->start_pos = s->start_pos + (uint64_t)at;
    t->parent = s->hashes[at - 1];
    t->is_root = 0;
    memcpy(t->hashes, s->hashes + at, (size_t)k * 8);
    memcpy(t->holders, s->holders, (size_t)s->nh * 2);
    for (Py_ssize_t r = 0; r < s->nh; r++) {
        memcpy(t->presence + r * t->cap, s->presence + r * s->cap + at, (size_t)k);
        if (s->meta) memcpy(t->meta + r * t->cap, s->meta + r * s->cap + at, (size_t)k * 8);
    }
    s->n = at;
    if (touched_add_new(b, t) < 0) {
        seg_free(t);
        PyErr_NoMemory();
        return -1;
    }
    s->cleared = 1;
    t->cleared = 1;
    for (Py_ssize_t i = 0; i < k; i++) { /* the tail's entries move to it */
        if (b->deferred) {
            uint64_t v;
            int kind = map_get(&b->pend, t->hashes[i], &v) && PEND_KIND(v) == PEND_NEW
                       ? PEND_NEW : PEND_SET; /* a claim still to be proven stays one */
            if (map_put(&b->pend, t->hashes[i], PEND(kind, id, i)) < 0) {
                PyErr_NoMemory();
                return -1;
            }
        } else if (blk_set(b, t->hashes[i], id, i) < 0) {
            return -1;
        }
    }
    return 0;
}

/* The holder id of `name` (cached per batch): 1 with it, 0 if it has none, -1 error. */
static int holder_of(Batch *b, PyObject *name, uint16_t *id) {
    PyObject *known = PyDict_GetItemWithError(b->names, name);
    if (known == NULL) {
        if (PyErr_Occurred()) return -1;
        known = PyObject_CallOneArg(b->cb[CB_HOLDER_ID], name);
        if (known == NULL) return -1;
        int bad = PyDict_SetItem(b->names, name, known);
        Py_DECREF(known);
        if (bad < 0) return -1;
    }
    if (known == Py_None) return 0;
    long v = PyLong_AsLong(known);
    if (v == -1 && PyErr_Occurred()) return -1;
    *id = (uint16_t)v;
    return 1;
}

/* A new id for holder `name` (Packer._holder_for_insert): 1 with it, 0 when only
 * Python can give one (every id taken: one must be reclaimed), -1 on error. */
static int new_holder(Batch *b, PyObject *name, uint16_t *id) {
    PyObject *got = PyObject_CallOneArg(b->cb[CB_NEW_HOLDER], name);
    if (got == NULL) return -1;
    if (got == Py_None) {
        Py_DECREF(got);
        return 0;
    }
    long v = PyLong_AsLong(got);
    PyObject *item = Py_BuildValue("(OO)", got, name);
    int bad = (v == -1 && PyErr_Occurred()) || item == NULL
              || PyDict_SetItem(b->names, name, got) < 0 || PyList_Append(b->created, item) < 0;
    Py_DECREF(got);
    Py_XDECREF(item);
    if (bad) return -1;
    *id = (uint16_t)v;
    return 1;
}

static Py_ssize_t common_prefix(const uint64_t *a, const uint64_t *b, Py_ssize_t m) {
    Py_ssize_t k = 0;
    while (k < m && a[k] == b[k]) k++;
    return k;
}

/* Undo an insert's claims: (chain index, count) pairs. */
static int release_claims(Batch *b, const uint64_t *chain, const Py_ssize_t *claims,
                          Py_ssize_t nclaims) {
    for (Py_ssize_t c = 0; c < nclaims; c++) {
        for (Py_ssize_t i = claims[2 * c]; i < claims[2 * c] + claims[2 * c + 1]; i++) {
            if (b->deferred) {
                if (map_put(&b->pend, chain[i], PEND(PEND_NONE, 0, 0)) < 0) {
                    PyErr_NoMemory();
                    return -1;
                }
            } else if (blk_delete(b, chain[i]) < 0) {
                return -1;
            }
        }
    }
    return 0;
}

typedef struct { Seg *seg; Py_ssize_t at, j, k; } Run;
typedef struct { Seg *seg; uint64_t new_id; Py_ssize_t split_at, j, k; } Placement;

/* Packer._place_run: claims for the new blocks chain[i:end) after the block at
 * (prev, o) (prev NULL: the chain starts at i), as Placements.  1 placed; 0 a block
 * is stored (*stored: its chain index), nothing of this run kept, its segment ids
 * given back; -1 error.  *first_id: the first id an insert takes. */
static int place_run(Batch *b, const uint64_t *chain, Py_ssize_t i, Py_ssize_t end,
                     Seg *prev, Py_ssize_t o, Placement *places, Py_ssize_t *nplaces,
                     Py_ssize_t *claims, Py_ssize_t *nclaims, uint64_t *first_id,
                     Py_ssize_t *stored) {
    Py_ssize_t places0 = *nplaces, claims0 = *nclaims, at = i, refused;
    uint64_t run_id = 0; /* the first id this run took */
    int got = 1;
    if (prev != NULL) {
        Py_ssize_t blocks = prev->n, split_at = -1;
        if (0 < blocks - 1 - o && blocks - 1 - o <= b->split_tail) split_at = blocks = o + 1;
        if (o == blocks - 1 && blocks < b->cap_blocks) {
            Py_ssize_t k = b->cap_blocks - blocks < end - at ? b->cap_blocks - blocks : end - at;
            got = claim(b, chain + at, k, prev->id, blocks, &refused);
            if (got < 0) return -1;
            if (got) {
                claims[2 * *nclaims] = at;
                claims[2 * *nclaims + 1] = k;
                (*nclaims)++;
                places[(*nplaces)++] = (Placement){prev, 0, split_at, at, k};
                at += k;
            }
        }
    }
    while (got && at < end) {
        Py_ssize_t k = b->cap_blocks < end - at ? b->cap_blocks : end - at;
        uint64_t id;
        if (new_segment_id(b, &id) < 0) return -1;
        if (!run_id) run_id = id;
        got = claim(b, chain + at, k, id, 0, &refused);
        if (got < 0) return -1;
        if (got) {
            claims[2 * *nclaims] = at;
            claims[2 * *nclaims + 1] = k;
            (*nclaims)++;
            places[(*nplaces)++] = (Placement){NULL, id, -1, at, k};
            at += k;
        }
    }
    if (got) {
        if (run_id && !*first_id) *first_id = run_id;
        return 1;
    }
    *stored = at + refused;
    if (release_claims(b, chain, claims + 2 * claims0, *nclaims - claims0) < 0) return -1;
    if (run_id && untake_seg_ids(b, run_id) < 0) return -1;
    *nplaces = places0;
    *nclaims = claims0;
    return 0;
}

/* Packer._walk_insert, with _held_parent and _place. */
static int insert(Batch *b, const uint64_t *chain, Py_ssize_t n, int has_parent,
                  uint64_t parent, PyObject *name) {
    uint16_t holder;
    int known = holder_of(b, name, &holder);
    if (known < 0) return OP_ERROR;
    Seg *seg = NULL;
    Py_ssize_t off = -1;
    uint64_t start_pos = 0;
    if (has_parent) {
        uint64_t sid;
        Py_ssize_t o;
        int found = locate_one(b, parent, &sid, &o);
        if (found < 0) return OP_ERROR;
        if (!found) return OP_NO_PARENT;
        seg = touched_get(b, sid);
        if (seg == NULL) return OP_ERROR;
        if (o >= seg->n) {
            PyErr_Format(PyExc_ValueError, "blocks table places a block at offset %zd of "
                         "segment %llu, which has %zd", o, (unsigned long long)sid, seg->n);
            return OP_ERROR;
        }
        int held = 0;
        for (Py_ssize_t r = 0; r < seg->nh && !held; r++) held = seg->presence[r * seg->cap + o];
        if (!held) return OP_NO_PARENT;
        off = o;
        start_pos = seg->start_pos + (uint64_t)o + 1;
    }
    Placement *places = NULL;
    Py_ssize_t *claims = NULL;
    Run *runs = PyMem_Malloc(sizeof(Run) * (size_t)(n + 1));
    Py_ssize_t nruns = 0, nplaces = 0, nclaims = 0, new_blocks = 0;
    int result = OP_ERROR;
    /* at most one placement more than its segments per new run, and a run per block */
    Py_ssize_t most = 2 * n + n / b->cap_blocks + 2;
    places = PyMem_Malloc(sizeof(Placement) * (size_t)most);
    claims = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)most);
    if (runs == NULL || places == NULL || claims == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Seg *prev = seg; /* the block before chain[i]: the parent's, then each run's last */
    Py_ssize_t prev_off = off, i = 0, stored = -1;
    uint64_t first_id = 0; /* the first segment id taken here, given back on a refusal */
    while (i < n) {
        Py_ssize_t nxt = off + 1;
        if (seg != NULL && nxt < seg->n) {
            Py_ssize_t m = seg->n - nxt < n - i ? seg->n - nxt : n - i;
            Py_ssize_t k = common_prefix(seg->hashes + nxt, chain + i, m);
            if (k) {
                runs[nruns++] = (Run){seg, nxt, i, k};
                i += k;
                off = nxt + k - 1;
                prev = seg;
                prev_off = off;
                continue;
            }
        }
        uint64_t sid;
        int found = head_of(b, chain[i], &sid);
        if (found < 0) goto out;
        if (found) {
            seg = touched_get(b, sid);
            if (seg == NULL) goto out;
            if (seg->n == 0 || seg->hashes[0] != chain[i]) {
                /* named for a head it does not start with: the walk would ask again for
                 * ever; Python's walk raises the CorruptRecordError that says so */
                goto to_python;
            }
            int want_root = i == 0 && !has_parent;
            uint64_t want_parent = i ? chain[i - 1] : parent;
            if ((want_root ? !seg->is_root : (seg->is_root || seg->parent != want_parent))
                || seg->start_pos != start_pos + (uint64_t)i) {
                goto to_python; /* a conflict: the general path names it */
            }
            off = -1;
            continue;
        }
        if (i == stored) goto to_python; /* stored, but not where the walk can reach */
        /* _place: new blocks from i on, up to the first that is stored (a block
         * evicted under a child still held: the walk goes on from that child) */
        Py_ssize_t end = n;
        for (;;) {
            int got = place_run(b, chain, i, end, prev, prev_off, places, &nplaces, claims,
                                &nclaims, &first_id, &stored);
            if (got < 0) goto out;
            if (got) break;
            if (stored == i) goto to_python;
            end = stored;
        }
        new_blocks += end - i;
        i = end;
        seg = NULL;
        off = -1;
    }
    if (!known) { /* named now, as Python names it: after the claims */
        known = new_holder(b, name, &holder);
        if (known < 0) goto out;
        if (!known) goto to_python;
    }
    /* nothing can refuse from here on */
    for (Py_ssize_t r = 0; r < nruns; r++) {
        Py_ssize_t row = seg_row_of(runs[r].seg, holder);
        if (row < 0) {
            PyErr_NoMemory();
            goto out;
        }
        memset(runs[r].seg->presence + row * runs[r].seg->cap + runs[r].at, 1,
               (size_t)runs[r].k);
    }
    for (Py_ssize_t p = 0; p < nplaces; p++) {
        Placement *pl = &places[p];
        if (pl->seg != NULL) {
            if (pl->split_at >= 0 && split(b, pl->seg, pl->split_at) < 0) goto out;
            if (seg_append(pl->seg, chain + pl->j, pl->k, holder) < 0) {
                PyErr_NoMemory();
                goto out;
            }
        } else {
            Seg *s = seg_new(pl->k, 1, 0);
            if (s == NULL) {
                PyErr_NoMemory();
                goto out;
            }
            s->id = pl->new_id;
            s->start_pos = start_pos + (uint64_t)pl->j;
            s->is_root = pl->j == 0 && !has_parent;
            s->parent = pl->j == 0 ? parent : chain[pl->j - 1];
            memcpy(s->hashes, chain + pl->j, (size_t)pl->k * 8);
            s->holders[0] = holder;
            memset(s->presence, 1, (size_t)pl->k);
            if (touched_add_new(b, s) < 0) {
                seg_free(s);
                PyErr_NoMemory();
                goto out;
            }
        }
    }
    b->new_blocks += new_blocks;
    result = OP_DONE;
    goto out;
to_python: /* nothing of this insert is left: Python's rerun takes the same ids */
    if (release_claims(b, chain, claims, nclaims) < 0) goto out;
    if (first_id && untake_seg_ids(b, first_id) < 0) goto out;
    result = OP_TO_PYTHON;
out:
    PyMem_Free(runs);
    PyMem_Free(places);
    PyMem_Free(claims);
    return result;
}

/* Packer.add_remove with local lookups (_remove_runs). */
static int remove_op(Batch *b, const uint64_t *chain, Py_ssize_t n, PyObject *name) {
    uint16_t holder;
    int known = holder_of(b, name, &holder);
    if (known <= 0) return known < 0 ? OP_ERROR : OP_DONE; /* it holds nothing */
    Py_ssize_t i = 0;
    while (i < n) {
        uint64_t sid;
        Py_ssize_t off;
        int found = locate_one(b, chain[i], &sid, &off);
        if (found < 0) return OP_ERROR;
        if (!found) {
            i++;
            continue;
        }
        Seg *s = touched_get(b, sid);
        if (s == NULL) return OP_ERROR;
        if (off >= s->n) {
            PyErr_Format(PyExc_ValueError, "blocks table places a block at offset %zd of "
                         "segment %llu, which has %zd", off, (unsigned long long)sid, s->n);
            return OP_ERROR;
        }
        const uint64_t *rest = chain + i + 1;
        Py_ssize_t left = n - i - 1, k = 0, lo, hi;
        if (off) { /* backwards: the blocks before `off`, last first */
            Py_ssize_t m = off < left ? off : left;
            while (k < m && s->hashes[off - 1 - k] == rest[k]) k++;
        }
        if (k) {
            lo = off - k;
            hi = off + 1;
        } else {
            Py_ssize_t m = s->n - off - 1 < left ? s->n - off - 1 : left;
            k = common_prefix(s->hashes + off + 1, rest, m);
            lo = off;
            hi = off + k + 1;
        }
        i += k + 1;
        Py_ssize_t row = seg_find_row(s, holder);
        if (row < 0) continue;
        uint8_t *p = s->presence + row * s->cap;
        for (Py_ssize_t x = lo; x < hi; x++) {
            b->removed_blocks += p[x] != 0;
            p[x] = 0;
        }
        int held = 0;
        for (Py_ssize_t x = 0; x < s->n && !held; x++) held = p[x] != 0;
        if (!held) s->cleared = 1;
        if (s->meta) {
            for (Py_ssize_t x = lo; x < hi; x++) s->meta[row * s->cap + x] = -1;
        }
    }
    return OP_DONE;
}

/* -- a deferred batch's `blocks` writes ------------------------------------------- */

enum { W_PUT_NEW, W_PUT_SET, W_ABSENT, W_DELETE };
typedef struct { uint64_t key, v; int action; } Write;

/* Sort `w` by key (LSD radix, a byte per pass, passes where every key has the same
 * byte skipped), `tmp` as big; equal keys keep their order.  The result is in `w`. */
static void sort_writes(Write *w, Write *tmp, size_t n) {
    for (int shift = 0; shift < 64; shift += 8) {
        size_t count[256] = {0};
        for (size_t i = 0; i < n; i++) count[(w[i].key >> shift) & 0xff]++;
        if (n == 0 || count[(w[0].key >> shift) & 0xff] == n) continue;
        size_t at = 0;
        for (int d = 0; d < 256; d++) {
            size_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (size_t i = 0; i < n; i++) tmp[count[(w[i].key >> shift) & 0xff]++] = w[i];
        memcpy(w, tmp, n * sizeof(Write));
    }
}

/* The blocks cursor's put of a pending entry (see put_call). */
static int cur_put(Batch *b, uint64_t hash, uint64_t v, int overwrite) {
    return put_block(b, hash, PEND_SEG(v), PEND_OFF(v), overwrite, 1);
}

/* The blocks cursor's set_key(key): 1 found (the cursor is on it), 0 not, -1 error. */
static int cur_find(Batch *b, uint64_t hash) {
    if (b->has_raw) return raw_find(b, hash, 0);
    PyObject *key = be_key(hash);
    if (key == NULL) return -1;
    PyObject *out = call1(b->cb[CB_CUR_SET_KEY], key);
    if (out == NULL) return -1;
    int found = PyObject_IsTrue(out);
    Py_DECREF(out);
    return found;
}

/* Write `pend`'s entries and, with `dead`, delete those of the segments nobody holds
 * any more, in key order through one cursor.  1 done; 0 when the table refuses a claim
 * (it has the block already: the batch must run again undeferred); -1 error. */
static int apply_pending(Batch *b, int dead) {
    size_t cap = b->pend.count + 1, n = 0;
    for (Py_ssize_t x = 0; dead && x < b->nsegs; x++) {
        if (!b->segs[x]->nh) cap += (size_t)b->segs[x]->n;
    }
    Write *w = PyMem_Malloc(2 * cap * sizeof(Write));
    if (w == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int result = -1;
    for (Py_ssize_t x = 0; dead && x < b->nsegs; x++) {
        const Seg *s = b->segs[x];
        for (Py_ssize_t i = 0; !s->nh && i < s->n; i++) {
            uint64_t v;
            int kind = map_get(&b->pend, s->hashes[i], &v) ? PEND_KIND(v) : PEND_NONE;
            if (kind == PEND_DONE) continue; /* only an unproven claim can repeat a key */
            /* a claim that died here must still be proven: the table must not have it */
            w[n++] = (Write){s->hashes[i], 0, kind == PEND_NEW ? W_ABSENT : W_DELETE};
            if (kind != PEND_NONE
                && map_put(&b->pend, s->hashes[i], PEND(PEND_DONE, 0, 0)) < 0) {
                PyErr_NoMemory();
                goto out;
            }
        }
    }
    for (size_t slot = 0; slot <= b->pend.mask; slot++) {
        if (!b->pend.used[slot]) continue;
        int kind = PEND_KIND(b->pend.slots[slot].val);
        if (kind == PEND_NEW || kind == PEND_SET) {
            w[n++] = (Write){b->pend.slots[slot].key, b->pend.slots[slot].val,
                             kind == PEND_NEW ? W_PUT_NEW : W_PUT_SET};
        }
    }
    sort_writes(w, w + cap, n);
    for (size_t i = 0; i < n; i++) {
        int r;
        gil_turn(&b->turn);
        switch (w[i].action) {
        case W_PUT_NEW:
            r = cur_put(b, w[i].key, w[i].v, 0);
            if (r == 0) result = 0;
            break;
        case W_PUT_SET:
            r = cur_put(b, w[i].key, w[i].v, 1);
            break;
        case W_ABSENT:
            r = cur_find(b, w[i].key);
            if (r == 1) result = 0;
            break;
        default: { /* W_DELETE: the cursor's pop finds and deletes in one call */
            if (b->has_raw) {
                r = raw_find(b, w[i].key, 1) < 0 ? -1 : 0;
                break;
            }
            PyObject *key = be_key(w[i].key);
            PyObject *out = key == NULL ? NULL : call1(b->cb[CB_CUR_POP], key);
            r = out == NULL ? -1 : 0;
            Py_XDECREF(out);
        }
        }
        if (r < 0 || result == 0) goto out;
    }
    result = 1;
out:
    PyMem_Free(w);
    return result;
}

/* The hashes of the segments deleted (nobody holds them: they left `blocks`), as u64
 * in native order, for Plan.dead (the aliases' sweep looks at theirs first). */
static PyObject *dead_hashes(Batch *b) {
    Py_ssize_t n = 0;
    for (Py_ssize_t x = 0; x < b->nsegs; x++) n += b->segs[x]->nh ? 0 : b->segs[x]->n;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t x = 0; x < b->nsegs; x++) {
        Seg *s = b->segs[x];
        if (s->nh) continue;
        memcpy(p, s->hashes, (size_t)s->n * sizeof(uint64_t));
        p += s->n * (Py_ssize_t)sizeof(uint64_t);
    }
    return out;
}

/* Touched.flush: each touched segment written once (or deleted with its `blocks`
 * entries when nobody holds it).  Returns (segments, dropped, log entries, dead
 * hashes) for Plan.segments, Plan.dropped, WriteTxn.log and Plan.dead; NULL without an
 * exception and `*conflict` set when a deferred batch's claim is refused. */
static PyObject *flush(Batch *b, int *conflict) {
    PyObject *segments = PyList_New(0), *dropped = PyDict_New(), *entries = PyList_New(0);
    if (segments == NULL || dropped == NULL || entries == NULL) goto fail;
    for (Py_ssize_t x = 0; x < b->nsegs; x++) {
        Seg *s = b->segs[x];
        if (s->cleared) {
            PyObject *gone = PyList_New(0);
            if (gone == NULL || seg_drop_empty_rows(s, gone) < 0) {
                Py_XDECREF(gone);
                goto fail;
            }
            if (PyList_GET_SIZE(gone)) {
                PyObject *id = PyLong_FromUnsignedLongLong(s->id);
                if (id == NULL || PyDict_SetItem(dropped, id, gone) < 0) {
                    Py_XDECREF(id);
                    Py_DECREF(gone);
                    goto fail;
                }
                Py_DECREF(id);
            }
            Py_DECREF(gone);
        }
    }
    if (b->deferred) {
        int r = apply_pending(b, 1);
        if (r <= 0) {
            *conflict = r == 0;
            goto fail;
        }
    }
    for (Py_ssize_t x = 0; x < b->nsegs; x++) {
        Seg *s = b->segs[x];
        PyObject *entry;
        gil_turn(&b->turn);
        if (!s->nh) { /* the record, and its blocks' entries (WriteTxn.delete_segment) */
            if (delete_key(b, s->id, CB_SEGMENTS_DB) < 0) goto fail;
            for (Py_ssize_t i = 0; !b->deferred && i < s->n; i++) {
                if (blk_delete(b, s->hashes[i]) < 0) goto fail;
            }
            entry = Py_BuildValue("(KKOO)", (unsigned long long)s->id,
                                  (unsigned long long)s->hashes[0], Py_None, Py_False);
        } else {
            if (b->has_raw) {
                PyObject *rec = seg_encode(s);
                int r = rec == NULL ? -1
                                    : raw_put(b, b->raw.segments, s->id, PyBytes_AS_STRING(rec),
                                              (size_t)PyBytes_GET_SIZE(rec), 1, 0);
                Py_XDECREF(rec);
                if (r < 0) goto fail;
            } else if (put_call(b->cb[CB_PUT], be_key(s->id), seg_encode(s), 1,
                                b->cb[CB_SEGMENTS_DB]) < 0) {
                goto fail;
            }
            PyObject *ids = PyList_New(s->nh);
            if (ids == NULL) goto fail;
            for (Py_ssize_t r = 0; r < s->nh; r++) {
                PyObject *id = PyLong_FromLong(s->holders[r]);
                if (id == NULL) {
                    Py_DECREF(ids);
                    goto fail;
                }
                PyList_SET_ITEM(ids, r, id);
            }
            entry = Py_BuildValue("(KKNO)", (unsigned long long)s->id,
                                  (unsigned long long)s->hashes[0], ids,
                                  s->is_new ? Py_True : Py_False);
        }
        if (entry == NULL || PyList_Append(segments, entry) < 0) {
            Py_XDECREF(entry);
            goto fail;
        }
        Py_DECREF(entry);
        PyObject *logged = Py_BuildValue("(KK)", (unsigned long long)s->id,
                                         (unsigned long long)s->hashes[0]);
        if (logged == NULL || PyList_Append(entries, logged) < 0) {
            Py_XDECREF(logged);
            goto fail;
        }
        Py_DECREF(logged);
    }
    if (b->has_raw) { /* the log written here: none left for Python (unless damaged) */
        int logged = raw_log(b);
        if (logged < 0) goto fail;
        if (logged == 1 && PyList_SetSlice(entries, 0, PyList_GET_SIZE(entries), NULL) < 0) {
            goto fail;
        }
    }
    PyObject *dead = dead_hashes(b);
    if (dead == NULL) goto fail;
    return Py_BuildValue("(NNNN)", segments, dropped, entries, dead);
fail:
    Py_XDECREF(segments);
    Py_XDECREF(dropped);
    Py_XDECREF(entries);
    return NULL;
}

/* The touched segments for Python to carry on with: [(id, record, is_new, cleared)]. */
static PyObject *hand_over(Batch *b) {
    PyObject *out = PyList_New(b->nsegs);
    if (out == NULL) return NULL;
    for (Py_ssize_t x = 0; x < b->nsegs; x++) {
        Seg *s = b->segs[x];
        PyObject *rec = seg_encode(s);
        PyObject *item = rec ? Py_BuildValue("(KNOO)", (unsigned long long)s->id, rec,
                                             s->is_new ? Py_True : Py_False,
                                             s->cleared ? Py_True : Py_False)
                             : NULL;
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, x, item);
    }
    return out;
}

static int is_kind(PyObject *op, const char *kind) {
    PyObject *k = PyTuple_GET_ITEM(op, 0);
    return PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, kind) == 0;
}

/* pack_batch(ctx, ops, segment_blocks, split_tail, deferred)
 * ops: a list of ("insert", chain, parent, name, None) and ("remove", chain, name), or
 * the same as columns (see the loop below; Packer.batch_columns). 
 *   -> (done, new_blocks, removed_blocks, removed_per_op, no_parent, names, created, rest)
 *   or None when `deferred` and the table refused a claim: the batch has to run again
 *   undeferred, in a transaction without what this one wrote.
 * ctx: the callables and dicts named by the CB_* order (see Packer._native_batch), and
 * optionally one more: None, or liblmdb's calls on the transaction (RawTxn), which then
 * read and write `blocks` and `segments` in place of the callables.
 * done: how many operations were applied here.  no_parent: [(op index, parent)]
 * refused for a parent nobody holds.  names: holder name -> id or None, as looked up;
 * created: [(id, name)] of the holders it named.
 * rest: when done == len(ops), (segments, dropped, log entries, dead hashes) of the
 * flush done here; otherwise the touched segments for Python,
 * [(id, record, is_new, cleared)]. */
PyObject *sarp_pack_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_PACK_BATCH]++;
    if (nargs != 5 || !PyTuple_Check(args[0])
        || (PyTuple_GET_SIZE(args[0]) != NUM_CB && PyTuple_GET_SIZE(args[0]) != NUM_CB + 1)
        || !(PyList_Check(args[1]) || PyTuple_Check(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "pack_batch(ctx: tuple, ops: list, segment_blocks, "
                                         "split_tail, deferred)");
        return NULL;
    }
    Batch b;
    memset(&b, 0, sizeof(b));
    Py_buffer col[6]; /* the columns' buffers, when ops are columns */
    int ncol = 0;
    for (int c = 0; c < NUM_CB; c++) b.cb[c] = PyTuple_GET_ITEM(args[0], c);
    /* a last item that is not None: liblmdb's own calls (lmdb_env.raw_tables) */
    if (PyTuple_GET_SIZE(args[0]) > NUM_CB && PyTuple_GET_ITEM(args[0], NUM_CB) != Py_None) {
        if (raw_of(PyTuple_GET_ITEM(args[0], NUM_CB), &b.raw) < 0) return NULL;
        b.has_raw = 1;
        sarp_calls[CALL_LMDB_PACK]++;
    }
    if (!PyDict_CheckExact(b.cb[CB_RECENT]) || !PyDict_CheckExact(b.cb[CB_REMEMBERED])) {
        PyErr_SetString(PyExc_TypeError, "pack_batch: the directory's probe dicts are dicts");
        return NULL;
    }
    b.cap_blocks = PyLong_AsSsize_t(args[2]);
    b.split_tail = PyLong_AsSsize_t(args[3]);
    b.deferred = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred() || b.deferred < 0) return NULL;
    if (PyObject_TypeCheck(b.cb[CB_BLOCK_GET], &sarp_BlockTableType)) {
        if (b.deferred) {
            PyErr_SetString(PyExc_ValueError, "pack_batch: a deferred batch runs on LMDB only");
            return NULL;
        }
        b.table = (BlockTable *)b.cb[CB_BLOCK_GET];
    }
    if (b.cap_blocks < 1) {
        PyErr_SetString(PyExc_ValueError, "segment_blocks must be >= 1");
        return NULL;
    }
    if (b.cb[CB_SORTED] != Py_None && take_sorted(&b.sorted, b.cb[CB_SORTED]) < 0) return NULL;
    PyObject *ops = args[1], *out = NULL;
    PyObject *per_op = PyList_New(0), *no_parent = PyList_New(0);
    b.names = PyDict_New();
    b.created = PyList_New(0);
    b.empty = PyBytes_FromStringAndSize(NULL, 0);
    if (per_op == NULL || no_parent == NULL || b.names == NULL || b.created == NULL
        || b.empty == NULL
        || map_init(&b.index, 256) < 0 || map_init(&b.heads, 256) < 0
        || map_init(&b.pend, b.deferred ? 4096 : 2) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    /* ops: a list of tuples, or a commit's columns (Packer.batch_columns):
     * (kinds u8 0 insert 1 remove, sizes i64, hashes u64, parents u64, has_parent u8,
     * name index i32, names) */
    int columns = PyTuple_Check(ops);
    const uint8_t *kinds = NULL, *has_parents = NULL;
    const int64_t *sizes = NULL;
    const uint64_t *hashes = NULL, *parents = NULL;
    const int32_t *name_at = NULL;
    PyObject *col_names = NULL;
    Py_ssize_t nops, i, at = 0, nhashes = 0;
    if (columns) {
        static const Py_ssize_t item[6] = {1, 8, 8, 8, 1, 4};
        if (PyTuple_GET_SIZE(ops) != 7 || !PyList_Check(PyTuple_GET_ITEM(ops, 6))) {
            PyErr_SetString(PyExc_TypeError, "pack_batch: columns are (kinds, sizes, hashes, "
                                             "parents, has_parent, names_at, names)");
            goto done;
        }
        for (; ncol < 6; ncol++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(ops, ncol), &col[ncol], PyBUF_C_CONTIGUOUS)
                < 0) {
                goto done;
            }
            if (col[ncol].itemsize != item[ncol]) {
                ncol++;
                PyErr_SetString(PyExc_TypeError, "pack_batch: a column of the wrong type");
                goto done;
            }
        }
        kinds = col[0].buf;
        sizes = col[1].buf;
        hashes = col[2].buf;
        parents = col[3].buf;
        has_parents = col[4].buf;
        name_at = col[5].buf;
        col_names = PyTuple_GET_ITEM(ops, 6);
        nops = col[0].len;
        nhashes = col[2].len / 8;
        if (col[1].len / 8 != nops || col[3].len / 8 != nops || col[4].len != nops
            || col[5].len / 4 != nops) {
            PyErr_SetString(PyExc_ValueError, "pack_batch: columns of different lengths");
            goto done;
        }
    } else if (PyList_Check(ops)) {
        nops = PyList_GET_SIZE(ops);
    } else {
        PyErr_SetString(PyExc_TypeError, "pack_batch: ops are a list or columns");
        goto done;
    }
    for (i = 0; i < nops; i++) {
        int ins, has_parent = 0;
        uint64_t parent = 0;
        PyObject *name, *parent_obj = NULL;
        const uint64_t *chain;
        Py_ssize_t n;
        Py_buffer buf;
        buf.obj = NULL;
        gil_turn(&b.turn);
        if (columns) {
            n = sizes[i];
            if (kinds[i] > 1 || n < 0 || at + n > nhashes || name_at[i] < 0
                || name_at[i] >= PyList_GET_SIZE(col_names)) {
                PyErr_SetString(PyExc_ValueError, "pack_batch: columns out of range");
                goto done;
            }
            ins = kinds[i] == 0;
            chain = hashes + at;
            at += n;
            has_parent = ins && has_parents[i];
            parent = parents[i];
            name = PyList_GET_ITEM(col_names, name_at[i]);
        } else {
            PyObject *op = PyList_GET_ITEM(ops, i);
            if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < 3) break;
            ins = is_kind(op, "insert");
            if (!(ins ? PyTuple_GET_SIZE(op) == 5 && PyTuple_GET_ITEM(op, 4) == Py_None
                      : is_kind(op, "remove") && PyTuple_GET_SIZE(op) == 3)) {
                break; /* a clear, or meta: Python's */
            }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(op, 1), &buf, PyBUF_C_CONTIGUOUS) < 0) {
                goto done;
            }
            if (buf.itemsize != 8) {
                PyBuffer_Release(&buf);
                break;
            }
            chain = buf.buf;
            n = buf.len / 8;
            parent_obj = PyTuple_GET_ITEM(op, 2);
            name = ins ? PyTuple_GET_ITEM(op, 3) : parent_obj;
            if (ins && parent_obj != Py_None) {
                has_parent = 1;
                parent = PyLong_AsUnsignedLongLong(parent_obj);
                if (PyErr_Occurred()) {
                    PyBuffer_Release(&buf);
                    goto done;
                }
            }
        }
        Py_ssize_t before = b.removed_blocks;
        int r = ins ? insert(&b, chain, n, has_parent, parent, name) : remove_op(&b, chain, n, name);
        if (buf.obj != NULL) PyBuffer_Release(&buf);
        if (r == OP_ERROR) goto done;
        if (r == OP_TO_PYTHON) break;
        if (r == OP_NO_PARENT) {
            PyObject *item = Py_BuildValue("(nK)", i, (unsigned long long)parent);
            if (item == NULL || PyList_Append(no_parent, item) < 0) {
                Py_XDECREF(item);
                goto done;
            }
            Py_DECREF(item);
        }
        PyObject *count = PyLong_FromSsize_t(b.removed_blocks - before);
        if (count == NULL || PyList_Append(per_op, count) < 0) {
            Py_XDECREF(count);
            goto done;
        }
        Py_DECREF(count);
    }
    int conflict = 0;
    PyObject *rest = NULL;
    if (i == nops) {
        rest = flush(&b, &conflict);
    } else { /* what Python carries on with reads the table: it must hold this batch's */
        int r = b.deferred ? apply_pending(&b, 0) : 1;
        conflict = r == 0;
        if (r > 0) rest = hand_over(&b);
    }
    if (rest == NULL) {
        if (conflict) out = Py_NewRef(Py_None);
        goto done;
    }
    out = Py_BuildValue("(nnnOOOON)", i, b.new_blocks, b.removed_blocks, per_op, no_parent,
                        b.names, b.created, rest);
done:
    release_sorted(&b.sorted);
    for (int c = 0; c < ncol; c++) PyBuffer_Release(&col[c]);
    Py_XDECREF(per_op);
    Py_XDECREF(no_parent);
    Py_XDECREF(b.names);
    Py_XDECREF(b.created);
    Py_XDECREF(b.empty);
    for (Py_ssize_t x = 0; x < b.nsegs; x++) seg_free(b.segs[x]);
    PyMem_Free(b.segs);
    if (b.has_raw) raw_close(&b.raw);
    map_free(&b.index);
    map_free(&b.heads);
    map_free(&b.pend);
    return out;
}
