/*
 * Mirror of sarp/tokenkeys.py: the keys of blocks keyed by their tokens.
 *
 * A block's local hash is xxh3-64 of its tokens as little-endian u32 under a seed
 * (the RFC's per-block hash, Dynamo's LocalBlockHash); its key chains the local hash
 * to the key before it: key = xxh3-64(local as 8 LE bytes, seed = key before).
 */
#define PY_SSIZE_T_CLEAN
#include "native.h"

#include <pthread.h>
#include <sys/mman.h>

/* token_keys(data, width, block_size, seed, parent) -> (keys, locals) as uint64 bytes.
 * width 4: data are tokens (u32, machine order), hashed block by block under `seed`;
 * width 8: data are local hashes already (block_size and seed unused).  Each key
 * chains on the one before, the first on `parent`. */
PyObject *sarp_token_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_TOKEN_KEYS]++;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "token_keys(data, width, block_size, seed, parent)");
        return NULL;
    }
    long width = PyLong_AsLong(args[1]);
    long block_size = PyLong_AsLong(args[2]);
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long key = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if ((width != 4 && width != 8) || (width == 4 && block_size <= 0)) {
        PyErr_SetString(PyExc_ValueError, "token_keys: width is 4 or 8, block_size > 0");
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t stride = width == 4 ? 4 * block_size : 8;
    Py_ssize_t n = buf.len / stride;
    PyObject *keys = PyBytes_FromStringAndSize(NULL, 8 * n);
    PyObject *locals = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (keys == NULL || locals == NULL) {
        Py_XDECREF(keys);
        Py_XDECREF(locals);
        PyBuffer_Release(&buf);
        return NULL;
    }
    uint64_t *k = (uint64_t *)PyBytes_AS_STRING(keys);
    uint64_t *l = (uint64_t *)PyBytes_AS_STRING(locals);
    const uint8_t *p = buf.buf;
    /* a long request's blocks are hashed without the GIL (the event loop goes on) */
    PyThreadState *state = n >= 256 ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++, p += stride) {
        /* as all of sarp's C, for little-endian machines: the bytes are LE u32s */
        uint64_t local = width == 4 ? XXH3_64bits_withSeed(p, (size_t)stride, seed) : u64_at(p);
        key = XXH3_64bits_withSeed(&local, 8, key);
        l[i] = local;
        k[i] = key;
    }
    if (state != NULL) PyEval_RestoreThread(state);
    PyBuffer_Release(&buf);
    return Py_BuildValue("(NN)", keys, locals);
}

/* An open-addressing table of (root, engine hash) -> token key: the aliases stored
 * and those a batch's stores make, first writer kept.  It grows with its entries
 * (at most half full), not with the blocks a batch names: a batch of 400,000 blocks
 * names about 50,000 distinct ones, and a table sized for all of them (32 MB) cost
 * more in page faults and cache misses than every probe of it.
 *
 * Its slots outlive the call (`kept`, up to KEEP_SLOTS of them): fresh zeroed memory
 * per call cost a page fault per 4 kB, and as a probe reads a slot before its write,
 * a TLB shootdown of the other core too (18% of serve's writer during a backlog).  A
 * slot is used when its `used` is the call's generation, so a call clears nothing. */
typedef struct {
    uint64_t root, hash, key;
    uint32_t used; /* the generation that filled it */
} Alias;

typedef struct {
    Alias *slots;
    size_t mask, count;
    uint32_t gen;
} AliasTable;

enum { KEEP_SLOTS = 1 << 19 }; /* 16 MB: a bigger table is the call's own, freed after;
                                   resolve_aliases_release hands them back when idle */
static Alias *kept;            /* (under kept_lock, taken without the GIL) */
static size_t kept_cap;
static uint32_t kept_gen;
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;

/* `cap` zeroed slots, their pages mapped writable now (MAP_POPULATE): calloc's or
 * malloc and memset's (which the compiler turns into calloc) fault later. */
static Alias *slots_new(size_t cap) {
    void *p = mmap(NULL, cap * sizeof(Alias), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void slots_free(Alias *slots, size_t cap) {
    if (slots != NULL) munmap(slots, cap * sizeof(Alias));
}

static size_t alias_slot(const AliasTable *t, uint64_t root, uint64_t hash) {
    uint64_t h = (hash ^ (root * 0x9E3779B97F4A7C15ull)) * 0xff51afd7ed558ccdull;
    size_t at = (size_t)(h ^ (h >> 32)) & t->mask;
    const Alias *slots = t->slots;
    while (slots[at].used == t->gen && (slots[at].root != root || slots[at].hash != hash)) {
        at = (at + 1) & t->mask;
    }
    return at;
}

/* `cap` empty slots for `t` (a power of two): the kept ones under a new generation,
 * else new zeroed memory (kept when at most KEEP_SLOTS).  0, or -1 (no memory). */
static int alias_slots(AliasTable *t, size_t cap) {
    if (cap > kept_cap) {
        Alias *slots = slots_new(cap);
        if (slots == NULL) return -1;
        if (cap <= KEEP_SLOTS) {
            slots_free(kept, kept_cap);
            kept = slots, kept_cap = cap, kept_gen = 0;
        } else {
            t->slots = slots, t->gen = 1;
        }
    }
    if (cap <= kept_cap) {
        if (++kept_gen == 0) { /* after 2^32 calls: clear once and start again */
            memset(kept, 0, kept_cap * sizeof(Alias));
            kept_gen = 1;
        }
        t->slots = kept, t->gen = kept_gen;
    }
    t->mask = cap - 1;
    t->count = 0;
    return 0;
}

static void alias_done(AliasTable *t) {
    if (t->slots != kept) slots_free(t->slots, t->mask + 1);
    t->slots = NULL;
}

/* Slots for `entries` aliases, or as many of the kept ones as `most` aliases could
 * fill: a batch like the last one then doubles none (a doubling puts each alias again). */
static int alias_init(AliasTable *t, size_t entries, size_t most) {
    size_t cap = 1024, enough = 1024;
    while (cap < 2 * entries) cap <<= 1;
    while (enough < 2 * most && enough < kept_cap) enough <<= 1;
    return alias_slots(t, cap > enough ? cap : enough);
}

/* 1 added, 0 there already (the first writer kept), -1 no memory. */
static int alias_add(AliasTable *t, uint64_t root, uint64_t hash, uint64_t key) {
    if (2 * (t->count + 1) > t->mask + 1) { /* doubled: its entries set aside, put back */
        Alias *live = malloc((t->count + 1) * sizeof(Alias));
        if (live == NULL) return -1;
        size_t n = 0;
        for (size_t i = 0; i <= t->mask; i++) {
            if (t->slots[i].used == t->gen) live[n++] = t->slots[i];
        }
        AliasTable old = *t;
        int was_kept = old.slots == kept; /* (freed by alias_slots if it grows them) */
        if (alias_slots(t, 2 * (old.mask + 1)) < 0) {
            *t = old;
            free(live);
            return -1;
        }
        if (!was_kept) slots_free(old.slots, old.mask + 1);
        for (size_t i = 0; i < n; i++) {
            Alias *a = &t->slots[alias_slot(t, live[i].root, live[i].hash)];
            *a = live[i];
            a->used = t->gen;
        }
        t->count = n;
        free(live);
    }
    Alias *a = &t->slots[alias_slot(t, root, hash)];
    if (a->used == t->gen) return 0;
    *a = (Alias){root, hash, key, t->gen};
    t->count++;
    return 1;
}

static int alias_get(const AliasTable *t, uint64_t root, uint64_t hash, uint64_t *key) {
    const Alias *a = &t->slots[alias_slot(t, root, hash)];
    if (a->used != t->gen) return 0;
    *key = a->key;
    return 1;
}

/* resolve_aliases_release() -> bytes the kept slots held, handed back (serve calls it
 * once idle, with malloc_trim: the next batch maps them again). */
PyObject *sarp_resolve_aliases_release(PyObject *self, PyObject *unused) {
    size_t bytes;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&kept_lock);
    bytes = kept_cap * sizeof(Alias);
    slots_free(kept, kept_cap);
    kept = NULL, kept_cap = 0, kept_gen = 0;
    pthread_mutex_unlock(&kept_lock);
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(bytes);
}

/* One buffer argument, checked for its item size. */
static int take(PyObject *obj, Py_buffer *view, Py_ssize_t item, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len % item) {
        PyErr_Format(PyExc_ValueError, "resolve_aliases: %s is not of %zd-byte items", name,
                     item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* resolve_aliases(kinds, roots, sizes, hashes, parents, has_parent, tokens,
 *                 token_counts, block_sizes, seeds, stored_roots, stored_hashes,
 *                 stored_keys[, locals]) -> (keys, found, made, parent_keys, first)
 * sarp/aliases.py's _Batch in one call: a batch's engine-hash operations, in order
 * (kinds u8: 0 a store, 1 a removal; per operation roots u64, sizes i64, parents u64,
 * has_parent u8, token_counts i64 (the tokens a store carries for all its blocks, or
 * 0), block_sizes i64, seeds u64 (its LoRA's)), their hashes and tokens (u32)
 * concatenated, and the aliases stored that they may need.  A store's parent resolves
 * through the stored aliases or an earlier store of the batch; its keys are made from
 * its tokens, chained on the parent's key (or the root), or else resolved like the
 * parent, block by block; it is made only when all of that resolves.  A removal's
 * hashes resolve through the stored aliases and every store made.  Out, aligned with
 * the hashes: keys (u64), found (u8) and first (u8: a store's block whose alias is
 * new, neither stored nor made by an earlier store: the aliases to write); per
 * operation: made (u8), parent_keys (u64).  With `locals` true, `tokens` holds the
 * blocks' local hashes instead (u64, one per block of a store with token_counts > 0:
 * the columns' decoder took them, serving/columns.py), and only the chain is left. */
PyObject *sarp_resolve_aliases(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    sarp_calls[CALL_RESOLVE_ALIASES]++;
    if (nargs != 13 && nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "resolve_aliases: 13 buffers[, locals]");
        return NULL;
    }
    int given = nargs == 14 ? PyObject_IsTrue(args[13]) : 0;
    if (given < 0) return NULL;
    Py_ssize_t items[13] = {1, 8, 8, 8, 8, 1, 4, 8, 8, 8, 8, 8, 8};
    items[6] = given ? 8 : 4;
    static const char *names[13] = {"kinds", "roots", "sizes", "hashes", "parents",
                                    "has_parent", "tokens", "token_counts", "block_sizes",
                                    "seeds", "stored_roots", "stored_hashes", "stored_keys"};
    Py_buffer v[13];
    int got = 0;
    PyObject *out = NULL, *keys = NULL, *found = NULL, *made = NULL, *parent_keys = NULL;
    PyObject *first = NULL;
    AliasTable t = {NULL, 0, 0, 0};
    for (; got < 13; got++) {
        if (take(args[got], &v[got], items[got], names[got]) < 0) goto done;
    }
    const uint8_t *kinds = v[0].buf, *has_parent = v[5].buf;
    const uint64_t *roots = v[1].buf, *hashes = v[3].buf, *parents = v[4].buf;
    const int64_t *sizes = v[2].buf, *token_counts = v[7].buf, *block_sizes = v[8].buf;
    const uint64_t *seeds = v[9].buf, *s_roots = v[10].buf, *s_hashes = v[11].buf;
    const uint64_t *s_keys = v[12].buf;
    const uint8_t *tokens = v[6].buf;
    Py_ssize_t ops = v[0].len, total = v[3].len / 8, stored = v[10].len / 8;
    Py_ssize_t token_total = v[6].len / items[6];
    if (v[1].len / 8 != ops || v[2].len / 8 != ops || v[4].len / 8 != ops || v[5].len != ops
        || v[7].len / 8 != ops || v[8].len / 8 != ops || v[9].len / 8 != ops
        || v[11].len / 8 != stored || v[12].len / 8 != stored) {
        PyErr_SetString(PyExc_ValueError, "resolve_aliases: per-operation arrays differ");
        goto done;
    }
    Py_ssize_t sum = 0, token_sum = 0, store_blocks = 0;
    for (Py_ssize_t i = 0; i < ops; i++) {
        if (sizes[i] < 0 || token_counts[i] < 0
            || (token_counts[i] && (kinds[i] != 0 || block_sizes[i] <= 0
                                    || token_counts[i] < sizes[i] * block_sizes[i]))) {
            PyErr_SetString(PyExc_ValueError, "resolve_aliases: bad sizes or token counts");
            goto done;
        }
        sum += sizes[i];
        store_blocks += kinds[i] == 0 ? sizes[i] : 0;
        token_sum += given ? (token_counts[i] ? sizes[i] : 0) : token_counts[i];
    }
    if (sum != total || token_sum != token_total) {
        PyErr_SetString(PyExc_ValueError, "resolve_aliases: sizes do not add up");
        goto done;
    }
    keys = PyBytes_FromStringAndSize(NULL, 8 * total);
    found = PyBytes_FromStringAndSize(NULL, total);
    made = PyBytes_FromStringAndSize(NULL, ops);
    parent_keys = PyBytes_FromStringAndSize(NULL, 8 * ops);
    first = PyBytes_FromStringAndSize(NULL, total);
    if (keys == NULL || found == NULL || made == NULL || parent_keys == NULL || first == NULL) {
        goto done;
    }
    uint64_t *k = (uint64_t *)PyBytes_AS_STRING(keys);
    uint8_t *f = (uint8_t *)PyBytes_AS_STRING(found), *m = (uint8_t *)PyBytes_AS_STRING(made);
    uint64_t *pk = (uint64_t *)PyBytes_AS_STRING(parent_keys);
    uint8_t *fst = (uint8_t *)PyBytes_AS_STRING(first);
    /* the rest reads the buffers and writes these, no Python object: without the GIL
     * (serve's HTTP thread answers meanwhile), the kept slots under their lock */
    int no_memory = 0;
    PyThreadState *state = PyEval_SaveThread();
    pthread_mutex_lock(&kept_lock);
    if (alias_init(&t, (size_t)stored, (size_t)(stored + store_blocks)) < 0) {
        no_memory = 1;
        goto unlock;
    }
    for (Py_ssize_t j = 0; j < stored; j++) {
        if (alias_add(&t, s_roots[j], s_hashes[j], s_keys[j]) < 0) {
            no_memory = 1;
            goto unlock;
        }
    }
    memset(f, 0, (size_t)total);
    memset(fst, 0, (size_t)total);
    memset(k, 0, 8 * (size_t)total);
    Py_ssize_t at = 0, token_at = 0;
    for (Py_ssize_t i = 0; i < ops;
         at += sizes[i], token_at += given ? (token_counts[i] ? sizes[i] : 0) : token_counts[i],
         i++) {
        m[i] = 0;
        pk[i] = 0;
        if (kinds[i] != 0) continue;  /* removals: after every store */
        uint64_t root = roots[i], chain = root;
        if (has_parent[i]) {
            if (!alias_get(&t, root, parents[i], &chain)) continue;  /* an orphan */
            pk[i] = chain;
        }
        if (token_counts[i] && given) {
            const uint8_t *p = tokens + 8 * token_at;
            for (Py_ssize_t b = 0; b < sizes[i]; b++, p += 8) {
                chain = XXH3_64bits_withSeed(p, 8, chain);
                k[at + b] = chain;
            }
        } else if (token_counts[i]) {
            Py_ssize_t stride = 4 * block_sizes[i];
            const uint8_t *p = tokens + 4 * token_at;
            for (Py_ssize_t b = 0; b < sizes[i]; b++, p += stride) {
                uint64_t local = XXH3_64bits_withSeed(p, (size_t)stride, seeds[i]);
                chain = XXH3_64bits_withSeed(&local, 8, chain);
                k[at + b] = chain;
            }
        } else {
            Py_ssize_t b = 0;
            while (b < sizes[i] && alias_get(&t, root, hashes[at + b], &k[at + b])) b++;
            if (b < sizes[i]) continue;  /* a block no alias names */
        }
        m[i] = 1;
        for (Py_ssize_t b = 0; b < sizes[i]; b++) {
            f[at + b] = 1;
            int added = alias_add(&t, root, hashes[at + b], k[at + b]);
            if (added < 0) {
                no_memory = 1;
                goto unlock;
            }
            fst[at + b] = (uint8_t)added;
        }
    }
    at = 0;
    for (Py_ssize_t i = 0; i < ops; at += sizes[i], i++) {
        if (kinds[i] != 1) continue;
        for (Py_ssize_t b = 0; b < sizes[i]; b++) {
            f[at + b] = (uint8_t)alias_get(&t, roots[i], hashes[at + b], &k[at + b]);
        }
    }
unlock:
    alias_done(&t);
    pthread_mutex_unlock(&kept_lock);
    PyEval_RestoreThread(state);
    if (no_memory) {
        PyErr_NoMemory();
        goto done;
    }
    out = Py_BuildValue("(OOOOO)", keys, found, made, parent_keys, first);
done:
    Py_XDECREF(keys);
    Py_XDECREF(found);
    Py_XDECREF(made);
    Py_XDECREF(parent_keys);
    Py_XDECREF(first);
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return out;
}
