/* What sarp._native's translation units share.  Each C file sits beside the Python it
 * mirrors and is named after it: verify.c (examine, walk; rows_result and plain_result,
 * whose references are in answer.py), packing.c (pack_batch), serving/events.c
 * (decode_batch), serving/http.c (u64_array), serving/rfc.c (rfc_answer, query_fields,
 * rfc_query), serving/wire.c (Conn, whose reference is wire.Connection),
 * tokenkeys.c (token_keys), directory.c (find, predict), valkey_read.c (read_match),
 * segment.c (heads), aliastable.c (AliasTable), serving/lane.c (take_line), lmdb_env.c
 * (liblmdb's calls on py-lmdb's transactions, for packing.c);
 * native.c is the module (native.py is its only loader).  The segment record's layout
 * is read in one place, here (segment.py is the reference). */
#ifndef SARP_NATIVE_H
#define SARP_NATIVE_H
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include "vendor/xxhash.h"

PyObject *sarp_examine(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_u64_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_pack_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_decode_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_decode_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_token_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_resolve_aliases(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_resolve_aliases_release(PyObject *self, PyObject *unused);
PyObject *sarp_find(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_predict(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_read_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_rfc_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_rows_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_plain_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_query_fields(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_rfc_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_heads(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* serving/events.c: decode_into's core, for serving/lane.c too.  The commit's
 * columns (serving/columns.py) and what learns their names; a payload appended to
 * them: 1 read (*out filled), 0 not read, -1 error; the columns as they were unless 1. */
#define INTO_COLS 12
/* Without the GIL (serving/lane.c's prefetch) the columns are C's own, and the names
 * and LoRA seeds are those learnt before it began: a pair or a name not among them
 * leaves the payload unread (0), for Python to learn. */
typedef struct {
    uint8_t *p;
    Py_ssize_t len, cap;
} ColBuf;
typedef struct {
    long holder;
    const char *medium; /* UTF-8, or NULL for none sent */
    size_t medium_len;
    int32_t index;      /* in the names, or -1: a medium sarp refuses */
} KnownPair;
typedef struct {
    const char *name;   /* UTF-8, or NULL for none */
    size_t name_len;
    uint64_t seed;
} KnownSeed;
typedef struct {
    KnownPair *pairs;
    Py_ssize_t npairs;
    KnownSeed *seeds;
    Py_ssize_t nseeds;
} Known;
typedef struct {
    PyObject *cols[INTO_COLS], *names, *learn_name, *seeds, *learn_seed; /* with the GIL */
    ColBuf *bufs;       /* or, when not NULL, C's own columns ... */
    const Known *known; /* ... and what was learnt */
    int nomem;          /* (without the GIL: an allocation failed) */
} IntoCols;
typedef struct {
    double ts;
    int has_rank;
    uint64_t rank;
    size_t events, skipped;
} IntoBatch;
int columns_of(PyObject *ctx, IntoCols *c);
int columns_back(IntoCols *c, const Py_ssize_t *marks);
Py_ssize_t col_len(const IntoCols *c, int col);
void decode_ready(void);
void colbuf_free(ColBuf *b);
int payload_into(const uint8_t *p, Py_ssize_t len, int with_tokens, uint64_t root, long holder,
                 IntoCols *c, IntoBatch *out);
PyObject *sarp_lane_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_take_line(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lane_prefetch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lane_prefetch_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* lmdb_env.c: liblmdb's calls of an engine py-lmdb bundles (sarp/lmdb_env.py binds
 * them), on a write transaction of py-lmdb's; the GIL held. */
#define RAW_ENGINES 2 /* LMDB 0.9 and 1.0 */
#define RAW_CALLS 14
#define RAW_NOOVERWRITE 0x10
#define RAW_KEYEXIST (-30799)
#define RAW_NOTFOUND (-30798)
#define RAW_SET 15 /* MDB_SET */
#define RAW_RDONLY 0x20000
typedef struct {
    size_t size;
    void *data;
} RawVal; /* MDB_val */
typedef struct {
    int (*get)(void *txn, unsigned dbi, RawVal *key, RawVal *data);
    int (*put)(void *txn, unsigned dbi, RawVal *key, RawVal *data, unsigned flags);
    int (*del)(void *txn, unsigned dbi, RawVal *key, RawVal *data);
    int (*cursor_open)(void *txn, unsigned dbi, void **cursor);
    void (*cursor_close)(void *cursor);
    int (*cursor_get)(void *cursor, RawVal *key, RawVal *data, int op);
    int (*cursor_put)(void *cursor, RawVal *key, RawVal *data, unsigned flags);
    int (*cursor_del)(void *cursor, unsigned flags);
    size_t (*txn_id)(void *txn);
    void *(*txn_env)(void *txn);
    int (*dbi_open)(void *txn, const char *name, unsigned flags, unsigned *dbi);
    int (*txn_begin)(void *env, void *parent, unsigned flags, void **txn);
    void (*txn_abort)(void *txn);
    int (*set_compare)(void *txn, unsigned dbi, int (*cmp)(const RawVal *, const RawVal *));
} RawApi;
typedef struct {
    const RawApi *api;
    void *txn, *cursor; /* cursor: on `blocks`, opened by raw_cursor */
    unsigned blocks, segments, meta, log;
    PyObject *raise_for; /* raise_for(rc) raises py-lmdb's error for an LMDB code */
} RawTxn;
/* spec (lmdb_env.raw_tables): (engine, txn address, the blocks, segments, meta and log
 * tables' dbi, raise_for); 0, or -1 with an error */
int raw_of(PyObject *spec, RawTxn *out);
int raw_failed(const RawTxn *r, int rc); /* py-lmdb's error for rc set; -1 */
int raw_cursor(RawTxn *r);               /* 0, or -1 with an error */
void raw_close(RawTxn *r);               /* the cursor closed, if open */
const RawApi *raw_api(PyObject *engine); /* an engine bound, or NULL with an error */
/* verify.c: walk's result over liblmdb's read transaction `txn` (records in table
 * `dbi`), the directory probed as walk probes it; NULL with an error */
PyObject *walk_raw(const RawApi *api, void *txn, unsigned dbi, PyObject *lookup,
                   PyObject *recent, PyObject *remembered, PyObject *query, int with_presence);
PyObject *sarp_lmdb_read_dbi(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lmdb_read_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lmdb_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lmdb_txn(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lmdb_dbi(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lmdb_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_lmdb_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
extern PyTypeObject sarp_BlockTableType; /* packing.c: a write's `blocks` table on Valkey */
extern PyTypeObject sarp_ReadsType; /* valkey_read.c: the READs read_match sent */
extern PyTypeObject sarp_ConnType; /* serving/wire.c: a connection answered in C */
extern PyTypeObject sarp_AliasTableType; /* aliastable.c: a writer's aliases in memory */

/* directory.c: a query's probes of a directory's sorted arrays (find, predict, and a
 * reader's match in valkey_read.c): the buffers of query, keys, segs[, added,
 * added_segs, gone]. */
typedef struct {
    Py_buffer b[6];
    Py_ssize_t taken, n, nkeys, nadded, ngone;
} Probe;
/* A directory's lookup after its two dicts missed (Directory.lookup's end): the set
 * of first hashes removed since its arrays were merged, then a binary search of them. */
typedef struct {
    PyObject *removed; /* borrowed from the tuple taken */
    Py_buffer keys, segs;
    Py_ssize_t n;
    int taken;
} SortedDir;
int take_sorted(SortedDir *d, PyObject *triple);
void release_sorted(SortedDir *d);
/* 1 with the segment id of first hash `hash` (`key`: it as a Python int), 0 none, -1
 * with an exception set */
int sorted_lookup(const SortedDir *d, PyObject *key, uint64_t hash, uint64_t *seg);
int take_probe(Probe *p, PyObject *const *args, Py_ssize_t nargs, const char *name);
void release_probe(Probe *p);
int64_t probe_hash(const Probe *p, uint64_t key);  /* Directory.lookup: a segment or -1 */
/* The distinct segments the query's hashes name, in query order, into `ids` (room for
 * p->n of them); how many, or -1 with MemoryError set. */
Py_ssize_t predict_ids(const Probe *p, int64_t *ids);

/* verify.c: the walk's holders (those of its first step, each with its prefix so far
 * and whether it still holds every block, so may extend), and the walk over a source
 * of records (the read transaction's, or a reply C read: valkey_read.c). */
typedef struct {
    uint16_t id;
    int extending;
    Py_ssize_t blocks;
} Holder;
#define MAX_WALK_HOLDERS 64
typedef struct {
    /* a segment id, -1 (none), or -2 (an error, set) */
    int64_t (*probe)(void *ctx, uint64_t first_hash);
    /* the record of a segment, or NULL with *len 0 (none stored), -1 (not at hand: the
     * caller walks another way) or -2 (an error, set).  With `owner`, it may give a
     * new reference to bytes holding the record (else the walk copies what it keeps) */
    const uint8_t *(*record)(void *ctx, int64_t seg_id, Py_ssize_t *len, PyObject **owner);
    void *ctx;
} RecordSource;
typedef struct Rows Rows;  /* a step's presence rows, kept (verify.c) */
typedef struct {
    int with_rows;  /* keep each step's presence rows (set before the walk) */
    Py_ssize_t total, reads, stopped_at, nholders, nsteps, cap;
    Holder holders[MAX_WALK_HOLDERS];
    Rows *steps;
} Walk;
/* walk's loop: 0 with `w` filled (stopped_at as walk's), 1 when a record it needs is
 * not at hand, -1 with an error set.  walk_answer: walk's result tuple (presence rows
 * with with_rows); walk_release frees the kept rows (after either). */
int walk_records(const RecordSource *src, const uint8_t *query, Py_ssize_t size, Walk *w);
PyObject *walk_answer(Walk *w);
void walk_release(Walk *w);

/* Calls of each entry point since the module loaded (native.calls(): the tests that
 * hold C to its Python reference assert which path ran).  Counted with the GIL held. */
enum { CALL_EXAMINE, CALL_WALK, CALL_PACK_BATCH, CALL_DECODE_BATCH, CALL_U64_ARRAY, CALL_TOKEN_KEYS,
       CALL_RESOLVE_ALIASES, CALL_BLOCK_TABLE, CALL_DECODE_INTO, CALL_FIND, CALL_READ_MATCH,
       CALL_RFC_ANSWER, CALL_ROWS_RESULT,
       CALL_PLAIN_RESULT, CALL_QUERY_FIELDS, CALL_CONN, CALL_RFC_QUERY, CALL_HEADS,
       CALL_XXH3_64, CALL_ALIAS_TABLE, CALL_TAKE_LINE, CALL_LMDB_PACK, CALL_LMDB_READ, CALL_KINDS };
extern unsigned long long sarp_calls[CALL_KINDS];

/* Record layout (segment.py): header 24 B (magic "SG", version u8, flags u8, n u16,
 * nh u16, start_pos u64, parent u64), hashes 8n, holder ids 2nh padded to 8,
 * presence nh*n padded to 8, meta 8*nh*n when flags & HAS_META, checksum 8 (xxh3 of
 * everything before it).  Little-endian. */
#define RECORD_VERSION 1
#define HEADER_BYTES 24
#define HAS_META 0x01
#define IS_ROOT 0x02
/* store.ID_STRIDE: new segment ids are multiples of it, and the ids after one are
 * kept for the tails split off that segment */
#define SEG_ID_STRIDE 8
#define MAX_SEGMENT_ID 0xFFFFFFFFull /* store.MAX_SEGMENT_ID */

enum { BAD_SHORT = -1, BAD_CHECKSUM = -2, BAD_MAGIC = -3, BAD_SIZE = -4, BAD_HOLDERS = -5 };

static inline uint16_t u16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t u32_at(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t u64_at(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline Py_ssize_t pad8(Py_ssize_t n) { return (n + 7) & ~(Py_ssize_t)7; }

/* Where a record's sections sit (segment._sections), and its size. */
typedef struct {
    uint8_t flags;
    Py_ssize_t n, nh, holders_at, presence_at, meta_at, size;
} Layout;

static inline Layout record_sections(Py_ssize_t n, Py_ssize_t nh, uint8_t flags) {
    Layout L;
    L.flags = flags;
    L.n = n;
    L.nh = nh;
    L.holders_at = HEADER_BYTES + 8 * n;
    L.presence_at = L.holders_at + pad8(2 * nh);
    L.meta_at = L.presence_at + pad8(nh * n);
    L.size = L.meta_at + ((flags & HAS_META) ? 8 * nh * n : 0) + 8;
    return L;
}

/* Does a record name a holder id twice (segment.layout refuses it too: a walk would
 * count that holder's rows differently in C and in Python)?  A few ids pair by pair,
 * more through a bitmap of every u16. */
static inline int repeated_holders(const uint8_t *ids, Py_ssize_t nh) {
    if (nh <= 16) {
        for (Py_ssize_t i = 1; i < nh; i++)
            for (Py_ssize_t j = 0; j < i; j++)
                if (u16_at(ids + 2 * i) == u16_at(ids + 2 * j)) return 1;
        return 0;
    }
    uint64_t seen[1024] = {0};
    for (Py_ssize_t i = 0; i < nh; i++) {
        uint16_t id = u16_at(ids + 2 * i);
        if (seen[id >> 6] >> (id & 63) & 1) return 1;
        seen[id >> 6] |= (uint64_t)1 << (id & 63);
    }
    return 0;
}

/* Check a record (size, checksum, magic and version, layout; segment.layout): 0 with
 * `L` filled, or a negative BAD_* code. */
static inline int record_layout(const uint8_t *r, Py_ssize_t size, Layout *L) {
    if (size < HEADER_BYTES + 8) return BAD_SHORT;
    if (XXH3_64bits(r, (size_t)(size - 8)) != u64_at(r + size - 8)) return BAD_CHECKSUM;
    if (r[0] != 'S' || r[1] != 'G' || r[2] != RECORD_VERSION) return BAD_MAGIC;
    *L = record_sections(u16_at(r + 4), u16_at(r + 6), r[3]);
    if (L->size != size) return BAD_SIZE;
    return L->nh > 1 && repeated_holders(r + L->holders_at, L->nh) ? BAD_HOLDERS : 0;
}

/* A big-endian 8-byte key (store.py's `_U64`: byte order is numeric order). */
static inline void be8(uint64_t v, uint8_t *out) {
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(v >> (56 - 8 * i));
}

static inline PyObject *be_key(uint64_t v) {
    uint8_t be[8];
    be8(v, be);
    return PyBytes_FromStringAndSize((const char *)be, 8);
}

/* A long C call of the writer's (the packer, the aliases' resolution and table) lets a
 * thread that waits for the GIL run, at most every GIL_TURN_NS: serve's HTTP thread,
 * which answers from memory the writer changes only between its calls (Index._apply),
 * then waits for no more than Python's switch interval and this, where it waited for
 * a whole commit.  Call gil_turn between two steps that leave no Python object half
 * made; the thread it lets in may read, never change, what the call reads.  Cost: a
 * counter per step, a clock read every 64, a release and an acquire per turn. */
#define GIL_TURN_NS 1000000
typedef struct {
    uint64_t last_ns;
    unsigned steps;
} GilTurn;

static inline uint64_t mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void gil_turn(GilTurn *t) {
    if ((++t->steps & 63) != 0) return;
    uint64_t now = mono_ns();
    if (t->last_ns == 0) {
        t->last_ns = now;
    } else if (now - t->last_ns >= GIL_TURN_NS) {
        Py_BEGIN_ALLOW_THREADS
        Py_END_ALLOW_THREADS
        t->last_ns = mono_ns();
    }
}

#endif
