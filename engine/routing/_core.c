/* The compiled holder maps of the prefix index (engine/routing/holder_maps.py describes the
 * interface; the pure-Python HolderMaps there is the reference this must match exactly).
 *
 * One open-addressing table maps a block hash to its holders in every group. An entry stores a
 * 32-byte hash inline (any other length: a reference to the bytes object) and per group one
 * 32-bit holder value: NONE_ID (nobody holds the key in that group), a single holder's code
 * (slot << 2 | pin level), or, with the MULTI bit, the index of a small array of codes sorted by
 * slot; the entry goes when no group holds its key. One entry for all groups, because a prompt's
 * blocks are the same hashes in every group (a coarser group's view takes every k-th): the
 * prediction's checks of the other groups read the entries its first group's walk just brought
 * into the cache, a worker's report of the same blocks in several groups finds them warm, and the
 * key is stored once. Entries live in chunks of CHUNK, so they never move and the table wastes at
 * most one partly used chunk; the hash index is an array of 32-bit entry numbers. Per slot and group a list of entry numbers records the keys
 * the worker announced (some it no longer holds, or twice; compacted as it grows) so forgetting
 * a worker walks its own keys only. A freed entry number may be reused by another key: every
 * walk of a slot's list checks that the entry is alive and held by that slot.
 *
 * Loops over a list of keys prefetch the index word and then the entry a few keys ahead (a lookup
 * in a large table is about two cache misses; the prediction's walk also prefetches the key
 * objects, and reads every group's view of the request's hashes in place, by stride).
 * ``predict`` writes the walk's results straight into the caller's dicts and ``absorb`` applies a
 * run of events in one call, so a decision and a worker's event batch each cross into C once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KEY_BYTES 32
#define CHUNK_BITS 10
#define CHUNK (1u << CHUNK_BITS)
#define MULTI 0x80000000u  /* holder value: the rest is a set number */
#define OBJKEY 0x40000000u /* entry word: the key is a PyObject * (not 32 bytes long) */
#define FREE_WORD 0xFFFFFFFFu
#define MAX_SETS (OBJKEY - 1)
#define NONE_ID 0xFFFFFFFFu
#define SLOT_EMPTY 0u
#define SLOT_DUMMY 1u
#define MAX_SLOT ((1u << 28) - 1)

typedef struct {
    unsigned char key[KEY_BYTES]; /* the hash, or a PyObject * (OBJKEY); when free: the next free entry */
    uint32_t flags;               /* FREE_WORD, or OBJKEY if the key is an object, else 0 */
    uint32_t words[];             /* per group: the holder value, or NONE_ID (nobody holds it there) */
} Entry;

static inline int e_free(const Entry *e) { return e->flags == FREE_WORD; }
static inline int e_object(const Entry *e) { return (e->flags & OBJKEY) != 0; }

typedef struct {
    uint32_t n, cap;
    uint32_t codes[];
} HSet;

typedef struct {
    char **chunks;   /* CHUNK entries of ``stride`` bytes each */
    uint32_t nchunks, top, free_head, used;
    uint32_t *index; /* 0 empty, 1 dummy, else entry + 2 */
    uint32_t mask, filled;
    size_t stride;   /* an entry's bytes: the key, the flags and a word per group */
    int nwords;
    uint64_t epoch;  /* counts entries made and dropped: an entry number read before is valid while it holds */
} Table;

typedef struct {
    uint32_t *ids;
    uint32_t n, cap;
} IdList;

typedef struct {
    IdList *lists; /* per group */
    int64_t num_cached;
    int64_t listed;
} Slot;

typedef struct {
    PyObject_HEAD
    int ngroups;
    Table table;          /* every group's keys: one entry per key, a holder word per group */
    uint32_t *group_used; /* per group: keys held by anyone in it */
    HSet **sets;
    uint32_t sets_top, sets_cap;
    uint32_t *sets_free;
    uint32_t nfree, free_cap;
    int64_t set_bytes;
    Slot *slots;
    uint32_t nslots;
    uint32_t *scratch; /* walk buffers */
    size_t scratch_cap;
    uint32_t *walked; /* the walk's step 1: the entry of each position it met (NONE_ID: none) */
    size_t walked_cap;
    /* what ``walked`` holds after a walk, for ``tiered`` to read instead of looking the same
     * positions up again: its first ``walked_n`` positions of ``walked_list`` (a reference, so the
     * list stays that object) every ``walked_factor``-th hash, valid while the table's epoch is
     * ``walked_epoch`` (no entry made or dropped since, so each entry number is still its key's) */
    PyObject *walked_list;
    Py_ssize_t walked_n, walked_factor;
    uint64_t walked_epoch;
    /* the positions of that walk where group ``walked_group``'s holder value changes: 0, each
     * change, and the first nobody holds (the ``walked_changes`` first of ``changes``) */
    uint32_t *changes;
    size_t changes_cap;
    Py_ssize_t walked_changes;
    int walked_group;
} Maps;

static inline Entry *ent(const Table *t, uint32_t id) {
    return (Entry *)(t->chunks[id >> CHUNK_BITS] + (size_t)(id & (CHUNK - 1)) * t->stride);
}

/* Whether no group holds the entry's key (it can go). */
static inline int e_unheld(const Table *t, const Entry *e) {
    for (int g = 0; g < t->nwords; g++) {
        if (e->words[g] != NONE_ID)
            return 0;
    }
    return 1;
}

/* -- keys ----------------------------------------------------------------------------------- */

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t hash_key(const char *p, Py_ssize_t n) {
    if (n == KEY_BYTES) {
        uint64_t w[4];
        memcpy(w, p, KEY_BYTES);
        return mix64(w[0] ^ rotl(w[1], 17) ^ rotl(w[2], 31) ^ rotl(w[3], 47));
    }
    uint64_t h = 0xcbf29ce484222325ULL ^ (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 0x100000001b3ULL;
    }
    return mix64(h);
}

static inline int key_of(PyObject *o, const char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "block hash: expected bytes, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *p = PyBytes_AS_STRING(o);
    *n = PyBytes_GET_SIZE(o);
    return 0;
}

static inline PyObject *entry_object(const Entry *e) {
    PyObject *o;
    memcpy(&o, e->key, sizeof o);
    return o;
}

static inline int entry_eq(const Entry *e, const char *p, Py_ssize_t n) {
    if (!e_object(e))
        return n == KEY_BYTES && memcmp(e->key, p, KEY_BYTES) == 0;
    PyObject *o = entry_object(e);
    return PyBytes_GET_SIZE(o) == n && memcmp(PyBytes_AS_STRING(o), p, (size_t)n) == 0;
}

static inline uint64_t entry_hash(const Entry *e) {
    if (!e_object(e))
        return hash_key((const char *)e->key, KEY_BYTES);
    PyObject *o = entry_object(e);
    return hash_key(PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
}

static PyObject *entry_key(const Entry *e) {
    if (!e_object(e))
        return PyBytes_FromStringAndSize((const char *)e->key, KEY_BYTES);
    PyObject *o = entry_object(e);
    Py_INCREF(o);
    return o;
}

/* -- one group's table ---------------------------------------------------------------------- */

static inline int64_t t_find(const Table *t, const char *p, Py_ssize_t n, uint64_t h) {
    if (t->index == NULL)
        return -1;
    size_t i = (size_t)h & t->mask;
    for (;;) {
        uint32_t s = t->index[i];
        if (s == SLOT_EMPTY)
            return -1;
        if (s != SLOT_DUMMY && entry_eq(ent(t, s - 2), p, n))
            return (int64_t)(s - 2);
        i = (i + 1) & t->mask;
    }
}

/* Prefetching: a lookup costs about two cache misses (the index word, then the entry), so loops
 * over a list of keys ask for the index word PREFETCH_FAR keys ahead and, once it has arrived,
 * for the entry PREFETCH_NEAR keys ahead. Only the first probe position is prefetched. */
#define PREFETCH_FAR 8
#define PREFETCH_NEAR 4

static inline void prefetch_index(const Table *t, PyObject *key) {
    if (t->index == NULL || !PyBytes_Check(key))
        return;
    uint64_t h = hash_key(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
    __builtin_prefetch(&t->index[(size_t)h & t->mask]);
}

static inline void prefetch_entry(const Table *t, PyObject *key) {
    if (t->index == NULL || !PyBytes_Check(key))
        return;
    uint64_t h = hash_key(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
    uint32_t s = t->index[(size_t)h & t->mask];
    if (s > SLOT_DUMMY) {
        const char *e = (const char *)ent(t, s - 2);
        __builtin_prefetch(e);
        __builtin_prefetch(e + t->stride - 1);
    }
}

/* Both prefetches for the loop position ``i`` over ``items[0..n)``. */
static inline void prefetch_ahead(const Table *t, PyObject *const *items, Py_ssize_t i, Py_ssize_t n) {
    if (i + PREFETCH_FAR < n)
        prefetch_index(t, items[i + PREFETCH_FAR]);
    if (i + PREFETCH_NEAR < n)
        prefetch_entry(t, items[i + PREFETCH_NEAR]);
}

/* The loop's first positions: the index words of the first PREFETCH_FAR keys. */
static inline void prefetch_start(const Table *t, PyObject *const *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_FAR; i++)
        prefetch_index(t, items[i]);
}

/* The same for a lookup loop over a group's view of the request's hashes, each key hashed once:
 * view position i is ``items[i * stride]`` (a coarser group's view of the fine hashes: every
 * stride-th). The hashes of the keys ahead wait in a ring (a key that is not bytes gets 0; its
 * lookup reports the error); the key objects themselves are prefetched PREFETCH_KEY positions
 * ahead, before they are hashed (a request's hash objects need not be in cache). */
#define RING 16 /* a power of two above PREFETCH_FAR */
#define PREFETCH_KEY 12

typedef struct {
    const Table *t;
    PyObject *const *items;
    Py_ssize_t stride;
    Py_ssize_t n;
    uint64_t ring[RING];
} Ahead;

static inline void ahead_hash(Ahead *a, Py_ssize_t i) {
    PyObject *key = a->items[i * a->stride];
    uint64_t h = PyBytes_Check(key) ? hash_key(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) : 0;
    a->ring[i & (RING - 1)] = h;
    if (a->t->index != NULL)
        __builtin_prefetch(&a->t->index[(size_t)h & a->t->mask]);
}

static inline void prefetch_key(const Ahead *a, Py_ssize_t i) {
    const char *o = (const char *)a->items[i * a->stride];
    __builtin_prefetch(o);
    __builtin_prefetch(o + 63);
}

/* Start a loop over view positions ``from..n``. */
static inline void ahead_start(Ahead *a, const Table *t, PyObject *const *items, Py_ssize_t stride, Py_ssize_t from,
                               Py_ssize_t n) {
    a->t = t;
    a->items = items;
    a->stride = stride;
    a->n = n;
    for (Py_ssize_t i = from + PREFETCH_FAR; i < n && i < from + PREFETCH_KEY; i++)
        prefetch_key(a, i);
    for (Py_ssize_t i = from; i < n && i < from + PREFETCH_FAR; i++)
        ahead_hash(a, i);
}

/* At position ``i``: prefetch ahead, and return key i's hash. */
static inline uint64_t ahead_step(Ahead *a, Py_ssize_t i) {
    if (i + PREFETCH_KEY < a->n)
        prefetch_key(a, i + PREFETCH_KEY);
    if (i + PREFETCH_FAR < a->n)
        ahead_hash(a, i + PREFETCH_FAR);
    if (i + PREFETCH_NEAR < a->n && a->t->index != NULL) {
        uint64_t h = a->ring[(i + PREFETCH_NEAR) & (RING - 1)];
        uint32_t s = a->t->index[(size_t)h & a->t->mask];
        if (s > SLOT_DUMMY) {
            const char *e = (const char *)ent(a->t, s - 2);
            __builtin_prefetch(e);
            __builtin_prefetch(e + a->t->stride - 1);
        }
    }
    return a->ring[i & (RING - 1)];
}

static int t_rebuild(Table *t) {
    size_t cap = 8;
    while (cap < ((size_t)t->used + 1) * 2)
        cap <<= 1;
    uint32_t *index = PyMem_Calloc(cap, sizeof(uint32_t));
    if (index == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = cap - 1;
    for (uint32_t id = 0; id < t->top; id++) {
        const Entry *e = ent(t, id);
        if (e_free(e))
            continue;
        size_t i = (size_t)entry_hash(e) & mask;
        while (index[i] != SLOT_EMPTY)
            i = (i + 1) & mask;
        index[i] = id + 2;
    }
    PyMem_Free(t->index);
    t->index = index;
    t->mask = (uint32_t)mask;
    t->filled = t->used;
    return 0;
}

/* A new entry, held in no group yet, for a key known to be absent; its number, or -1 on error. */
static int64_t t_insert(Table *t, PyObject *obj, const char *p, Py_ssize_t n, uint64_t h) {
    if (t->index == NULL || ((size_t)t->filled + 1) * 4 > ((size_t)t->mask + 1) * 3) {
        if (t_rebuild(t) < 0)
            return -1;
    }
    uint32_t id;
    if (t->free_head != NONE_ID) {
        id = t->free_head;
        memcpy(&t->free_head, ent(t, id)->key, sizeof t->free_head);
    } else {
        if (t->top == t->nchunks * CHUNK) {
            if (t->nchunks >= ((NONE_ID - 2) >> CHUNK_BITS) - 1) {
                PyErr_SetString(PyExc_OverflowError, "holder map: too many keys");
                return -1;
            }
            char **chunks = PyMem_Realloc(t->chunks, ((size_t)t->nchunks + 1) * sizeof(char *));
            if (chunks == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->chunks = chunks;
            chunks[t->nchunks] = PyMem_Malloc(CHUNK * t->stride);
            if (chunks[t->nchunks] == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->nchunks++;
        }
        id = t->top++;
    }
    t->epoch++;
    Entry *e = ent(t, id);
    if (n == KEY_BYTES) {
        memcpy(e->key, p, KEY_BYTES);
        e->flags = 0;
    } else {
        Py_INCREF(obj);
        memset(e->key, 0, KEY_BYTES);
        memcpy(e->key, &obj, sizeof obj);
        e->flags = OBJKEY;
    }
    for (int g = 0; g < t->nwords; g++)
        e->words[g] = NONE_ID;
    size_t i = (size_t)h & t->mask;
    while (t->index[i] > SLOT_DUMMY)
        i = (i + 1) & t->mask;
    if (t->index[i] == SLOT_EMPTY)
        t->filled++;
    t->index[i] = id + 2;
    t->used++;
    return id;
}

static void t_delete(Table *t, uint32_t id) {
    Entry *e = ent(t, id);
    t->epoch++;
    size_t i = (size_t)entry_hash(e) & t->mask;
    while (t->index[i] != id + 2)
        i = (i + 1) & t->mask;
    t->index[i] = SLOT_DUMMY;
    if (e_object(e)) {
        PyObject *o = entry_object(e);
        Py_DECREF(o);
    }
    e->flags = FREE_WORD;
    memcpy(e->key, &t->free_head, sizeof t->free_head);
    t->free_head = id;
    t->used--;
}

static PyTypeObject MapsType; /* defined below */

/* -- holder values -------------------------------------------------------------------------- */

static inline HSet *set_of(const Maps *m, uint32_t value) { return m->sets[value & ~MULTI]; }

/* The level ``slot`` holds ``value`` at, or -1. */
static inline int v_level(const Maps *m, uint32_t value, uint32_t slot) {
    if (!(value & MULTI))
        return (value >> 2) == slot ? (int)(value & 3) : -1;
    const HSet *s = set_of(m, value);
    uint32_t lo = 0, hi = s->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        uint32_t at = s->codes[mid] >> 2;
        if (at == slot)
            return (int)(s->codes[mid] & 3);
        if (at < slot)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

static inline size_t hset_bytes(uint32_t cap) { return sizeof(HSet) + (size_t)cap * sizeof(uint32_t); }

static int64_t set_new(Maps *m, uint32_t a, uint32_t b) {
    HSet *s = PyMem_Malloc(hset_bytes(4));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->n = 2;
    s->cap = 4;
    s->codes[0] = a < b ? a : b;
    s->codes[1] = a < b ? b : a;
    uint32_t id;
    if (!m->nfree && m->sets_top >= MAX_SETS) {
        PyMem_Free(s);
        PyErr_SetString(PyExc_OverflowError, "holder map: too many shared keys");
        return -1;
    }
    if (m->nfree) {
        id = m->sets_free[--m->nfree];
    } else {
        if (m->sets_top == m->sets_cap) {
            size_t cap = (size_t)m->sets_cap * 2 + 16;
            HSet **sets = PyMem_Realloc(m->sets, cap * sizeof(HSet *));
            if (sets == NULL) {
                PyMem_Free(s);
                PyErr_NoMemory();
                return -1;
            }
            m->sets = sets;
            m->sets_cap = (uint32_t)cap;
        }
        id = m->sets_top++;
    }
    m->sets[id] = s;
    m->set_bytes += (int64_t)hset_bytes(s->cap);
    return id;
}

static int set_free(Maps *m, uint32_t id) {
    HSet *s = m->sets[id];
    m->set_bytes -= (int64_t)hset_bytes(s->cap);
    PyMem_Free(s);
    m->sets[id] = NULL;
    if (m->nfree == m->free_cap) {
        size_t cap = (size_t)m->free_cap * 2 + 16;
        uint32_t *stack = PyMem_Realloc(m->sets_free, cap * sizeof(uint32_t));
        if (stack == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        m->sets_free = stack;
        m->free_cap = (uint32_t)cap;
    }
    m->sets_free[m->nfree++] = id;
    return 0;
}

/* -- per-slot key lists --------------------------------------------------------------------- */

static int list_append(IdList *l, uint32_t id) {
    if (l->n == l->cap) {
        size_t cap = (size_t)l->cap + l->cap / 2 + 8;
        uint32_t *ids = PyMem_Realloc(l->ids, cap * sizeof(uint32_t));
        if (ids == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        l->ids = ids;
        l->cap = (uint32_t)cap;
    }
    l->ids[l->n++] = id;
    return 0;
}

static int check_slot(const Maps *m, long slot) {
    if (slot < 0 || (unsigned long)slot >= m->nslots || m->slots[slot].lists == NULL) {
        PyErr_Format(PyExc_ValueError, "slot: %ld is not an added slot", slot);
        return -1;
    }
    return 0;
}

static int check_group(const Maps *m, long g) {
    if (g < 0 || g >= m->ngroups) {
        PyErr_Format(PyExc_ValueError, "group: %ld is not in 0..%d", g, m->ngroups - 1);
        return -1;
    }
    return 0;
}

/* -- one holder of one key ------------------------------------------------------------------ */

/* ``slot`` holds the key (at ``level`` if it did not already): 1 if newly held, 0, -1 on error. */
static int hold(Maps *m, int g, PyObject *key, uint32_t slot, uint32_t level) {
    const char *p;
    Py_ssize_t n;
    if (key_of(key, &p, &n) < 0)
        return -1;
    Table *t = &m->table;
    uint64_t h = hash_key(p, n);
    int64_t id = t_find(t, p, n, h);
    uint32_t code = (slot << 2) | level;
    if (id < 0 && (id = t_insert(t, key, p, n, h)) < 0)
        return -1;
    Entry *e = ent(t, (uint32_t)id);
    uint32_t value = e->words[g];
    if (value == NONE_ID) {
        e->words[g] = code;
        m->group_used[g]++;
    } else {
        if (!(value & MULTI)) {
            if ((value >> 2) == slot)
                return 0;
            int64_t s = set_new(m, value, code);
            if (s < 0)
                return -1;
            e->words[g] = MULTI | (uint32_t)s;
        } else {
            if (v_level(m, value, slot) >= 0)
                return 0;
            uint32_t sid = value & ~MULTI;
            HSet *s = m->sets[sid];
            if (s->n == s->cap) {
                uint32_t cap = s->cap * 2;
                HSet *grown = PyMem_Realloc(s, hset_bytes(cap));
                if (grown == NULL) {
                    PyErr_NoMemory();
                    return -1;
                }
                m->set_bytes += (int64_t)hset_bytes(cap) - (int64_t)hset_bytes(grown->cap);
                grown->cap = cap;
                m->sets[sid] = s = grown;
            }
            uint32_t i = s->n;
            while (i > 0 && s->codes[i - 1] > code) {
                s->codes[i] = s->codes[i - 1];
                i--;
            }
            s->codes[i] = code;
            s->n++;
        }
    }
    Slot *st = &m->slots[slot];
    if (list_append(&st->lists[g], (uint32_t)id) < 0)
        return -1;
    st->listed++;
    st->num_cached++;
    return 1;
}

/* ``slot`` no longer holds entry ``id``: 1 if it did, 0 if not, -1 on error. */
static int drop(Maps *m, int g, uint32_t id, uint32_t slot) {
    Table *t = &m->table;
    Entry *e = ent(t, id);
    if (e_free(e))
        return 0;
    uint32_t value = e->words[g];
    if (value == NONE_ID)
        return 0;
    if (!(value & MULTI)) {
        if ((value >> 2) != slot)
            return 0;
        e->words[g] = NONE_ID;
        m->group_used[g]--;
        if (e_unheld(t, e))
            t_delete(t, id);
    } else {
        uint32_t sid = value & ~MULTI;
        HSet *s = m->sets[sid];
        uint32_t i = 0;
        while (i < s->n && (s->codes[i] >> 2) != slot)
            i++;
        if (i == s->n)
            return 0;
        memmove(&s->codes[i], &s->codes[i + 1], (s->n - i - 1) * sizeof(uint32_t));
        s->n--;
        if (s->n == 1) {
            e->words[g] = s->codes[0];
            if (set_free(m, sid) < 0)
                return -1;
        }
    }
    m->slots[slot].num_cached--;
    return 1;
}

/* The entry of a key group ``g`` holds, -1 if it does not, -2 on error. */
static int64_t find_key(Maps *m, int g, PyObject *key) {
    const char *p;
    Py_ssize_t n;
    if (key_of(key, &p, &n) < 0)
        return -2;
    int64_t id = t_find(&m->table, p, n, hash_key(p, n));
    return id >= 0 && ent(&m->table, (uint32_t)id)->words[g] == NONE_ID ? -1 : id;
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static void compact_slot(Maps *m, uint32_t slot) {
    Slot *st = &m->slots[slot];
    int64_t listed = 0;
    for (int g = 0; g < m->ngroups; g++) {
        IdList *l = &st->lists[g];
        const Table *t = &m->table;
        uint32_t kept = 0;
        for (uint32_t i = 0; i < l->n; i++) {
            const Entry *e = ent(t, l->ids[i]);
            if (!e_free(e) && e->words[g] != NONE_ID && v_level(m, e->words[g], slot) >= 0)
                l->ids[kept++] = l->ids[i];
        }
        qsort(l->ids, kept, sizeof(uint32_t), cmp_u32);
        uint32_t unique = 0;
        for (uint32_t i = 0; i < kept; i++) {
            if (unique == 0 || l->ids[unique - 1] != l->ids[i])
                l->ids[unique++] = l->ids[i];
        }
        l->n = unique;
        listed += unique;
        if (l->cap > unique + unique / 2 + 16) { /* give back what a longer list needed */
            uint32_t cap = unique + unique / 4 + 8;
            uint32_t *ids = PyMem_Realloc(l->ids, (size_t)cap * sizeof(uint32_t));
            if (ids != NULL) {
                l->ids = ids;
                l->cap = cap;
            }
        }
    }
    st->listed = listed;
}

static int clear_slot(Maps *m, uint32_t slot) {
    Slot *st = &m->slots[slot];
    for (int g = 0; g < m->ngroups; g++) {
        IdList *l = &st->lists[g];
        for (uint32_t i = 0; i < l->n; i++) {
            if (drop(m, g, l->ids[i], slot) < 0)
                return -1;
        }
        l->n = 0;
    }
    st->listed = 0;
    st->num_cached = 0;
    return 0;
}

/* -- Python methods ------------------------------------------------------------------------- */

static int Maps_init(Maps *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"num_groups", NULL};
    int ngroups;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &ngroups))
        return -1;
    if (ngroups < 1 || ngroups > 64) {
        PyErr_Format(PyExc_ValueError, "num_groups: must be in 1..64 (got %d)", ngroups);
        return -1;
    }
    if (self->group_used != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "HolderMaps is already initialised");
        return -1;
    }
    self->group_used = PyMem_Calloc((size_t)ngroups, sizeof(uint32_t));
    if (self->group_used == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->table.free_head = NONE_ID;
    self->table.nwords = ngroups;
    self->table.stride = sizeof(Entry) + (size_t)ngroups * sizeof(uint32_t);
    self->ngroups = ngroups;
    return 0;
}

static void Maps_dealloc(Maps *self) {
    Table *t = &self->table;
    for (uint32_t id = 0; id < t->top; id++) {
        if (!e_free(ent(t, id)) && e_object(ent(t, id))) {
            PyObject *o = entry_object(ent(t, id));
            Py_DECREF(o);
        }
    }
    for (uint32_t c = 0; c < t->nchunks; c++)
        PyMem_Free(t->chunks[c]);
    PyMem_Free(t->chunks);
    PyMem_Free(t->index);
    PyMem_Free(self->group_used);
    for (uint32_t i = 0; i < self->sets_top; i++)
        PyMem_Free(self->sets[i]);
    PyMem_Free(self->sets);
    PyMem_Free(self->sets_free);
    for (uint32_t s = 0; s < self->nslots; s++) {
        if (self->slots[s].lists == NULL)
            continue;
        for (int g = 0; g < self->ngroups; g++)
            PyMem_Free(self->slots[s].lists[g].ids);
        PyMem_Free(self->slots[s].lists);
    }
    PyMem_Free(self->slots);
    PyMem_Free(self->scratch);
    PyMem_Free(self->walked);
    PyMem_Free(self->changes);
    Py_CLEAR(self->walked_list);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Maps_add_slot(Maps *self, PyObject *arg) {
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (slot < 0 || (unsigned long)slot > MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "slot: must be in 0..%u (got %ld)", MAX_SLOT, slot);
        return NULL;
    }
    if ((uint32_t)slot >= self->nslots) {
        size_t n = (size_t)slot + 1;
        size_t cap = self->nslots;
        while (cap < n)
            cap = cap * 2 + 8;
        Slot *slots = PyMem_Realloc(self->slots, cap * sizeof(Slot));
        if (slots == NULL)
            return PyErr_NoMemory();
        memset(slots + self->nslots, 0, (cap - self->nslots) * sizeof(Slot));
        self->slots = slots;
        self->nslots = (uint32_t)cap;
    }
    Slot *st = &self->slots[slot];
    if (st->lists != NULL) {
        PyErr_Format(PyExc_ValueError, "slot: %ld is already added", slot);
        return NULL;
    }
    st->lists = PyMem_Calloc((size_t)self->ngroups, sizeof(IdList));
    if (st->lists == NULL)
        return PyErr_NoMemory();
    st->num_cached = 0;
    st->listed = 0;
    Py_RETURN_NONE;
}

static PyObject *Maps_release_slot(Maps *self, PyObject *arg) {
    long slot = PyLong_AsLong(arg);
    if ((slot == -1 && PyErr_Occurred()) || check_slot(self, slot) < 0)
        return NULL;
    if (clear_slot(self, (uint32_t)slot) < 0)
        return NULL;
    Slot *st = &self->slots[slot];
    for (int g = 0; g < self->ngroups; g++)
        PyMem_Free(st->lists[g].ids);
    PyMem_Free(st->lists);
    st->lists = NULL;
    Py_RETURN_NONE;
}

static PyObject *Maps_clear(Maps *self, PyObject *arg) {
    long slot = PyLong_AsLong(arg);
    if ((slot == -1 && PyErr_Occurred()) || check_slot(self, slot) < 0)
        return NULL;
    if (clear_slot(self, (uint32_t)slot) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Maps_compact(Maps *self, PyObject *arg) {
    long slot = PyLong_AsLong(arg);
    if ((slot == -1 && PyErr_Occurred()) || check_slot(self, slot) < 0)
        return NULL;
    compact_slot(self, (uint32_t)slot);
    Py_RETURN_NONE;
}

static PyObject *Maps_num_cached(Maps *self, PyObject *arg) {
    long slot = PyLong_AsLong(arg);
    if ((slot == -1 && PyErr_Occurred()) || check_slot(self, slot) < 0)
        return NULL;
    return PyLong_FromLongLong(self->slots[slot].num_cached);
}

static PyObject *Maps_listed(Maps *self, PyObject *arg) {
    long slot = PyLong_AsLong(arg);
    if ((slot == -1 && PyErr_Occurred()) || check_slot(self, slot) < 0)
        return NULL;
    return PyLong_FromLongLong(self->slots[slot].listed);
}

/* The worker in ``slot`` announced ``keys`` (held at level 0 unless already held): 0, or -1. */
static int store_keys(Maps *self, int g, PyObject *keys, uint32_t slot) {
    PyObject *seq = PySequence_Fast(keys, "keys: expected a sequence of bytes");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const Table *t = &self->table;
    prefetch_start(t, items, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(t, items, i, n);
        if (hold(self, g, items[i], slot, 0) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    Slot *st = &self->slots[slot];
    if (2 * st->listed > 3 * st->num_cached + 128)
        compact_slot(self, slot);
    return 0;
}

/* store(group, keys, slot): the worker announced ``keys`` (held at level 0 unless already held). */
static PyObject *Maps_store(Maps *self, PyObject *args) {
    int g;
    long slot;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "iOl", &g, &keys, &slot))
        return NULL;
    if (check_group(self, g) < 0 || check_slot(self, slot) < 0)
        return NULL;
    if (store_keys(self, g, keys, (uint32_t)slot) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* hold(group, entries, slot): (key, level) pairs the worker holds (a snapshot). */
static PyObject *Maps_hold(Maps *self, PyObject *args) {
    int g;
    long slot;
    PyObject *entries;
    if (!PyArg_ParseTuple(args, "iOl", &g, &entries, &slot))
        return NULL;
    if (check_group(self, g) < 0 || check_slot(self, slot) < 0)
        return NULL;
    PyObject *it = PyObject_GetIter(entries);
    if (it == NULL)
        return NULL;
    PyObject *item;
    while ((item = PyIter_Next(it)) != NULL) {
        PyObject *key;
        int level;
        int ok = PyArg_ParseTuple(item, "Oi", &key, &level);
        if (ok && (level < 0 || level > 3)) {
            PyErr_Format(PyExc_ValueError, "level: must be in 0..3 (got %d)", level);
            ok = 0;
        }
        if (!ok || hold(self, g, key, (uint32_t)slot, (uint32_t)level) < 0) {
            Py_DECREF(item);
            Py_DECREF(it);
            return NULL;
        }
        Py_DECREF(item);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* Drop the keys from ``slot``; ``gone`` (NULL: not wanted) gets those it held: 0, or -1. */
static int remove_keys(Maps *self, int g, PyObject *keys, uint32_t slot, PyObject *gone) {
    PyObject *seq = PySequence_Fast(keys, "keys: expected a sequence of bytes");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const Table *t = &self->table;
    prefetch_start(t, items, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_ahead(t, items, i, n);
        int64_t id = find_key(self, g, items[i]);
        int dropped = 0;
        if (id == -2 || (id >= 0 && (dropped = drop(self, g, (uint32_t)id, slot)) < 0) ||
            (dropped && gone != NULL && PyList_Append(gone, items[i]) < 0)) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* remove(group, keys, slot, report): drop the keys; the list of those held if ``report``. */
static PyObject *Maps_remove(Maps *self, PyObject *args) {
    int g, report;
    long slot;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "iOlp", &g, &keys, &slot, &report))
        return NULL;
    if (check_group(self, g) < 0 || check_slot(self, slot) < 0)
        return NULL;
    PyObject *gone = NULL;
    if (report && (gone = PyList_New(0)) == NULL)
        return NULL;
    if (remove_keys(self, g, keys, (uint32_t)slot, gone) < 0) {
        Py_XDECREF(gone);
        return NULL;
    }
    if (gone != NULL)
        return gone;
    Py_RETURN_NONE;
}

/* relevel(group, keys, slot, level, raise_only, report): set the level the slot holds each key at
 * (only upwards if raise_only); the list of keys it held if ``report``. */
static int relevel_keys(Maps *self, int g, PyObject *keys, long slot, int level, int raise_only, PyObject *held) {
    PyObject *seq = PySequence_Fast(keys, "keys: expected a sequence of bytes");
    if (seq == NULL)
        return -1;
    Table *t = &self->table;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t code = ((uint32_t)slot << 2) | (uint32_t)level;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = find_key(self, g, items[i]);
        if (id == -2) {
            Py_DECREF(seq);
            return -1;
        }
        if (id < 0)
            continue;
        Entry *e = ent(t, (uint32_t)id);
        int old = v_level(self, e->words[g], (uint32_t)slot);
        if (old < 0)
            continue;
        if (old < level || (old != level && !raise_only)) {
            if (!(e->words[g] & MULTI)) {
                e->words[g] = code;
            } else {
                HSet *s = set_of(self, e->words[g]);
                for (uint32_t j = 0; j < s->n; j++) {
                    if ((s->codes[j] >> 2) == (uint32_t)slot)
                        s->codes[j] = code;
                }
            }
        }
        if (held != NULL && PyList_Append(held, items[i]) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *Maps_relevel(Maps *self, PyObject *args) {
    int g, level, raise_only, report;
    long slot;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "iOlipp", &g, &keys, &slot, &level, &raise_only, &report))
        return NULL;
    if (check_group(self, g) < 0 || check_slot(self, slot) < 0)
        return NULL;
    if (level < 0 || level > 3) {
        PyErr_Format(PyExc_ValueError, "level: must be in 0..3 (got %d)", level);
        return NULL;
    }
    PyObject *held = NULL;
    if (report && (held = PyList_New(0)) == NULL)
        return NULL;
    if (relevel_keys(self, g, keys, slot, level, raise_only, held) < 0) {
        Py_XDECREF(held);
        return NULL;
    }
    if (held != NULL)
        return held;
    Py_RETURN_NONE;
}

/* level(group, key, slot): the pin level the slot holds the key at, or None. */
static PyObject *Maps_level(Maps *self, PyObject *args) {
    int g;
    long slot;
    PyObject *key;
    if (!PyArg_ParseTuple(args, "iOl", &g, &key, &slot))
        return NULL;
    if (check_group(self, g) < 0)
        return NULL;
    int64_t id = find_key(self, g, key);
    if (id == -2)
        return NULL;
    if (id < 0 || slot < 0)
        Py_RETURN_NONE;
    int level = v_level(self, ent(&self->table, (uint32_t)id)->words[g], (uint32_t)slot);
    if (level < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(level);
}

static PyObject *slots_list(const Maps *m, uint32_t value) {
    if (!(value & MULTI)) {
        PyObject *out = PyList_New(1);
        if (out != NULL)
            PyList_SET_ITEM(out, 0, PyLong_FromUnsignedLong(value >> 2));
        return out;
    }
    const HSet *s = set_of(m, value);
    PyObject *out = PyList_New(s->n);
    if (out == NULL)
        return NULL;
    for (uint32_t i = 0; i < s->n; i++)
        PyList_SET_ITEM(out, i, PyLong_FromUnsignedLong(s->codes[i] >> 2));
    return out;
}

/* holders(group, key): the slots holding the key, increasing. */
static PyObject *Maps_holders(Maps *self, PyObject *args) {
    int g;
    PyObject *key;
    if (!PyArg_ParseTuple(args, "iO", &g, &key))
        return NULL;
    if (check_group(self, g) < 0)
        return NULL;
    int64_t id = find_key(self, g, key);
    if (id == -2)
        return NULL;
    if (id < 0)
        return PyList_New(0);
    return slots_list(self, ent(&self->table, (uint32_t)id)->words[g]);
}

/* table(group, slot): {key: level} of every key the slot holds in the group. */
static PyObject *Maps_table(Maps *self, PyObject *args) {
    int g;
    long slot;
    if (!PyArg_ParseTuple(args, "il", &g, &slot))
        return NULL;
    if (check_group(self, g) < 0 || check_slot(self, slot) < 0)
        return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    const IdList *l = &self->slots[slot].lists[g];
    const Table *t = &self->table;
    for (uint32_t i = 0; i < l->n; i++) {
        const Entry *e = ent(t, l->ids[i]);
        if (e_free(e) || e->words[g] == NONE_ID)
            continue;
        int level = v_level(self, e->words[g], (uint32_t)slot);
        if (level < 0)
            continue;
        PyObject *k = entry_key(e);
        PyObject *v = PyLong_FromLong(level);
        if (k == NULL || v == NULL || PyDict_SetItem(out, k, v) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return out;
}

/* size(group): keys held by anyone in the group. */
static PyObject *Maps_size(Maps *self, PyObject *arg) {
    long g = PyLong_AsLong(arg);
    if ((g == -1 && PyErr_Occurred()) || check_group(self, g) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(self->group_used[g]);
}

/* met(group, keys): the set of slots holding any of the keys. */
static PyObject *Maps_met(Maps *self, PyObject *args) {
    int g;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "iO", &g, &keys))
        return NULL;
    if (check_group(self, g) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys: expected a sequence of bytes");
    if (seq == NULL)
        return NULL;
    PyObject *out = PySet_New(NULL);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        int64_t id = find_key(self, g, items[i]);
        if (id == -2) {
            Py_CLEAR(out);
            break;
        }
        if (id < 0)
            continue;
        uint32_t value = ent(&self->table, (uint32_t)id)->words[g];
        const uint32_t *codes = &value;
        uint32_t count = 1;
        if (value & MULTI) {
            codes = set_of(self, value)->codes;
            count = set_of(self, value)->n;
        }
        for (uint32_t j = 0; j < count; j++) {
            PyObject *s = PyLong_FromUnsignedLong(codes[j] >> 2);
            if (s == NULL || PySet_Add(out, s) < 0) {
                Py_XDECREF(s);
                Py_CLEAR(out);
                break;
            }
            Py_DECREF(s);
        }
    }
    Py_DECREF(seq);
    return out;
}

/* -- a batch of events ---------------------------------------------------------------------- */

/* An integer attribute of an event: 0, or -1 on error. */
/* An event's attribute names, interned at import (``PyInit__core``): a report's events are read
 * by name, and a name made per read costs an allocation and a hash each time. */
static PyObject *str_seq, *str_group, *str_block_hashes, *str_explicit;

static int int_attr(PyObject *obj, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* absorb(events, start, slot, last_seq, kinds): see HolderMaps.absorb in holder_maps.py. */
static PyObject *Maps_absorb(Maps *self, PyObject *args) {
    PyObject *events, *stored, *removed, *pinned;
    Py_ssize_t start;
    long slot;
    long long last_seq;
    if (!PyArg_ParseTuple(args, "O!nlL(OOO)", &PyList_Type, &events, &start, &slot, &last_seq, &stored, &removed,
                          &pinned))
        return NULL;
    if (check_slot(self, slot) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(events);
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < n; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        PyTypeObject *kind = Py_TYPE(event);
        if (kind != (PyTypeObject *)stored && kind != (PyTypeObject *)removed && kind != (PyTypeObject *)pinned)
            break;
        long long seq, group;
        if (int_attr(event, str_seq, &seq) < 0)
            return NULL;
        if (seq <= last_seq)
            continue; /* already applied */
        if (seq != last_seq + 1)
            break; /* a gap: the caller starts a resync */
        if (int_attr(event, str_group, &group) < 0)
            return NULL;
        if (group < 0 || group >= self->ngroups) {
            PyErr_Format(PyExc_ValueError, "group: must be in 0..%d (got %lld)", self->ngroups - 1, group);
            return NULL;
        }
        PyObject *keys = PyObject_GetAttr(event, str_block_hashes);
        if (keys == NULL)
            return NULL;
        int rc;
        if (kind == (PyTypeObject *)stored) {
            rc = store_keys(self, (int)group, keys, (uint32_t)slot);
        } else if (kind == (PyTypeObject *)removed) {
            rc = remove_keys(self, (int)group, keys, (uint32_t)slot, NULL);
        } else {
            PyObject *explicit = PyObject_GetAttr(event, str_explicit);
            int is_explicit = explicit == NULL ? -1 : PyObject_IsTrue(explicit);
            Py_XDECREF(explicit);
            rc = is_explicit < 0 ? -1 : relevel_keys(self, (int)group, keys, slot, is_explicit ? 2 : 1, 1, NULL);
        }
        Py_DECREF(keys);
        if (rc < 0)
            return NULL;
        last_seq = seq;
    }
    return Py_BuildValue("(nL)", i, last_seq);
}

/* -- the prediction's walk ------------------------------------------------------------------ */

/* Grow ``*buf`` (``*cap`` words) to hold at least n words: 0, or -1 on error. */
static int ensure_words(uint32_t **buf, size_t *cap, size_t n) {
    if (n <= *cap)
        return 0;
    size_t want = n * 2 + 64;
    uint32_t *grown = PyMem_Realloc(*buf, want * sizeof(uint32_t));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = grown;
    *cap = want;
    return 0;
}

/* The entry of a view's key whose hash ``h`` is known (``Ahead``), or NONE_ID (no group holds
 * it; NONE_ID with *err set on error). */
static inline uint32_t find_hashed(const Maps *m, PyObject *key, uint64_t h, int *err) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "block hash: expected bytes, got %.100s", Py_TYPE(key)->tp_name);
        *err = 1;
        return NONE_ID;
    }
    int64_t id = t_find(&m->table, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), h);
    return id < 0 ? NONE_ID : (uint32_t)id;
}

/* ``lookup`` of a key whose hash ``h`` is known (``Ahead``). */
static inline uint32_t lookup_hashed(const Maps *m, int g, PyObject *key, uint64_t h, int *err) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "block hash: expected bytes, got %.100s", Py_TYPE(key)->tp_name);
        *err = 1;
        return NONE_ID;
    }
    const Table *t = &m->table;
    int64_t id = t_find(t, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), h);
    return id < 0 ? NONE_ID : ent(t, (uint32_t)id)->words[g];
}

/* Intersect sorted slots ``a[0..na)`` with value's slots into ``out``; returns the count. */
static inline uint32_t intersect(const Maps *m, const uint32_t *a, uint32_t na, uint32_t value, uint32_t *out) {
    if (!(value & MULTI)) {
        uint32_t s = value >> 2;
        for (uint32_t i = 0; i < na; i++) {
            if (a[i] == s) {
                out[0] = s;
                return 1;
            }
        }
        return 0;
    }
    const HSet *set = set_of(m, value);
    uint32_t i = 0, j = 0, k = 0;
    while (i < na && j < set->n) {
        uint32_t b = set->codes[j] >> 2;
        if (a[i] == b) {
            out[k++] = b;
            i++;
            j++;
        } else if (a[i] < b) {
            i++;
        } else {
            j++;
        }
    }
    return k;
}

static PyObject *u32_list(const uint32_t *a, uint32_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(a[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* ``a`` minus ``b`` (both sorted) into out. */
static uint32_t difference(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb, uint32_t *out) {
    uint32_t i = 0, j = 0, k = 0;
    while (i < na) {
        if (j < nb && b[j] == a[i]) {
            i++;
            j++;
        } else if (j < nb && b[j] < a[i]) {
            j++;
        } else {
            out[k++] = a[i++];
        }
    }
    return k;
}

/* Where the walk's results go: ``rows`` (walk: one (k, valid, failed) tuple per depth), or, for
 * predict, the caller's dicts keyed by worker id (``ids[slot]``): ``hits`` and ``shared`` get
 * k * align per serving slot (``shared`` also per failing slot; it may be NULL), ``failing``
 * collects the failing workers, ``deepest`` the largest k with one and ``reach`` the largest
 * value put in ``shared`` (tokens; 0: none). */
typedef struct {
    PyObject *rows;
    PyObject *ids, *hits, *shared, *failing; /* failing: a list, or a set (``predict_tiered``) */
    Py_ssize_t align, deepest, reach;
    /* ``predict_tiered``: the failing slots whose host tier holds something (a key of ``counts``) */
    PyObject *counts;
    uint32_t *extra;
    size_t nextra, cap_extra;
} Sink;

/* Set ``dict[ids[slot]] = value`` for each slot of ``a``. */
static int put_slots(PyObject *dict, PyObject *ids, const uint32_t *a, uint32_t n, PyObject *value) {
    for (uint32_t i = 0; i < n; i++) {
        if ((Py_ssize_t)a[i] >= PyList_GET_SIZE(ids)) {
            PyErr_Format(PyExc_IndexError, "ids: no worker for slot %u", a[i]);
            return -1;
        }
        if (PyDict_SetItem(dict, PyList_GET_ITEM(ids, a[i]), value) < 0)
            return -1;
    }
    return 0;
}

/* One depth's result into the sink: 0, or -1 on error. */
static int sink_row(Sink *sink, Py_ssize_t k, const uint32_t *valid, uint32_t nvalid, const uint32_t *failed,
                    uint32_t nfail) {
    if (sink->rows != NULL) {
        PyObject *kk = PyLong_FromSsize_t(k);
        PyObject *lv = u32_list(valid, nvalid);
        PyObject *lf = u32_list(failed, nfail);
        PyObject *row = (kk && lv && lf) ? PyTuple_Pack(3, kk, lv, lf) : NULL;
        Py_XDECREF(kk);
        Py_XDECREF(lv);
        Py_XDECREF(lf);
        int rc = (row == NULL || PyList_Append(sink->rows, row) < 0) ? -1 : 0;
        Py_XDECREF(row);
        return rc;
    }
    PyObject *tokens = PyLong_FromSsize_t(k * sink->align);
    if (tokens == NULL)
        return -1;
    int rc = put_slots(sink->hits, sink->ids, valid, nvalid, tokens);
    if (sink->shared != NULL && nvalid + nfail > 0 && k * sink->align > sink->reach)
        sink->reach = k * sink->align;
    if (rc == 0 && sink->shared != NULL)
        rc = put_slots(sink->shared, sink->ids, valid, nvalid, tokens);
    if (rc == 0 && sink->shared != NULL)
        rc = put_slots(sink->shared, sink->ids, failed, nfail, tokens);
    Py_DECREF(tokens);
    for (uint32_t i = 0; rc == 0 && i < nfail; i++) {
        if ((Py_ssize_t)failed[i] >= PyList_GET_SIZE(sink->ids)) {
            PyErr_Format(PyExc_IndexError, "ids: no worker for slot %u", failed[i]);
            return -1;
        }
        PyObject *worker = PyList_GET_ITEM(sink->ids, failed[i]);
        rc = PyList_Check(sink->failing) ? PyList_Append(sink->failing, worker) : PySet_Add(sink->failing, worker);
        if (rc == 0 && sink->counts != NULL && PyDict_GET_SIZE(sink->counts) > 0) {
            PyObject *key = PyLong_FromUnsignedLong(failed[i]);
            int has = key == NULL ? -1 : PyDict_Contains(sink->counts, key);
            Py_XDECREF(key);
            if (has < 0)
                return -1;
            if (has) {
                if (sink->nextra == sink->cap_extra) {
                    size_t want = sink->cap_extra * 2 + 16;
                    uint32_t *grown = PyMem_Realloc(sink->extra, want * sizeof(uint32_t));
                    if (grown == NULL) {
                        PyErr_NoMemory();
                        return -1;
                    }
                    sink->extra = grown;
                    sink->cap_extra = want;
                }
                sink->extra[sink->nextra++] = failed[i];
            }
        }
    }
    if (nfail > 0 && k > sink->deepest)
        sink->deepest = k;
    return rc;
}

/* One group of step 2, read once per walk from a ``checks`` item (group, hash factor, ranges). */
typedef struct {
    int g;
    Py_ssize_t factor;
    PyObject *ranges; /* list: per aligned step k, the (start, stop) blocks a hit of k steps needs */
} CheckSpec;

#define SMALL_CHECKS 8

static int parse_check(const Maps *m, PyObject *item, CheckSpec *out) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_SetString(PyExc_TypeError, "checks: each item must be a (group, factor, ranges) tuple");
        return -1;
    }
    long g = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
    Py_ssize_t factor = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
    if (PyErr_Occurred())
        return -1;
    if (check_group(m, g) < 0)
        return -1;
    if (factor < 1) {
        PyErr_Format(PyExc_ValueError, "checks: group %ld has hash factor %zd (must be >= 1)", g, factor);
        return -1;
    }
    PyObject *ranges = PyTuple_GET_ITEM(item, 2);
    if (!PyList_Check(ranges)) {
        PyErr_Format(PyExc_TypeError, "checks: group %ld's ranges must be a list", g);
        return -1;
    }
    out->g = (int)g;
    out->factor = factor;
    out->ranges = ranges;
    return 0;
}

/* ``ranges[k]`` as (start, stop): 0, or -1 on error. */
static int needed_range(PyObject *ranges, int g, Py_ssize_t k, Py_ssize_t *start, Py_ssize_t *stop) {
    if (k >= PyList_GET_SIZE(ranges)) {
        PyErr_Format(PyExc_IndexError, "checks: group %d has no needed range at step %zd", g, k);
        return -1;
    }
    PyObject *range = PyList_GET_ITEM(ranges, k);
    if (!PyTuple_Check(range) || PyTuple_GET_SIZE(range) != 2) {
        PyErr_Format(PyExc_TypeError, "checks: group %d's range at step %zd must be a (start, stop) tuple", g, k);
        return -1;
    }
    *start = PyLong_AsSsize_t(PyTuple_GET_ITEM(range, 0));
    *stop = PyLong_AsSsize_t(PyTuple_GET_ITEM(range, 1));
    if (PyErr_Occurred())
        return -1;
    if (*start < 0 || *stop < 0) {
        PyErr_SetString(PyExc_ValueError, "checks: a needed range is negative");
        return -1;
    }
    return 0;
}

/* Steps 1 and 2 of the prediction into ``sink``: see HolderMaps.walk in holder_maps.py. Group
 * ``first``'s view of ``hashes`` is every ``factor``-th hash (``coarse_view``), read in place. */
/* A walk of group ``group`` over ``hashes`` filled the first ``n`` positions of ``walked`` and
 * ``nchanges`` of ``changes``: keep that for ``tiered``. */
static inline void walked_keep(Maps *self, PyObject *hashes, Py_ssize_t factor, Py_ssize_t n, int group,
                               Py_ssize_t nchanges) {
    Py_INCREF(hashes);
    Py_XSETREF(self->walked_list, hashes);
    self->walked_n = n;
    self->walked_factor = factor;
    self->walked_epoch = self->table.epoch;
    self->walked_group = group;
    self->walked_changes = nchanges;
}

static int walk_impl(Maps *self, int first, PyObject *hashes, Py_ssize_t factor, Py_ssize_t limit, Py_ssize_t per,
                     PyObject *checks, Sink *sink) {
    if (check_group(self, first) < 0)
        return -1;
    if (per < 1) {
        PyErr_Format(PyExc_ValueError, "per: must be >= 1 (got %zd)", per);
        return -1;
    }
    if (factor < 1) {
        PyErr_Format(PyExc_ValueError, "factor: must be >= 1 (got %zd)", factor);
        return -1;
    }
    Py_ssize_t nhashes = PyList_GET_SIZE(hashes);
    if (limit > nhashes / factor)
        limit = nhashes / factor;
    self->walked_n = 0; /* ``walked`` is this walk's from here */
    Py_CLEAR(self->walked_list);
    if (limit <= 0)
        return 0;
    PyObject *const *items = &PyList_GET_ITEM(hashes, 0);
    int err = 0;
    if (ensure_words(&self->walked, &self->walked_cap, (size_t)limit) < 0 ||
        ensure_words(&self->changes, &self->changes_cap, (size_t)limit) < 0)
        return -1;
    uint32_t *walked = self->walked;
    uint32_t *changes = self->changes;
    Py_ssize_t nchanges = 1;
    changes[0] = 0;
    PyObject *key0 = items[factor - 1];
    walked[0] = find_hashed(self, key0, PyBytes_Check(key0) ? hash_key(PyBytes_AS_STRING(key0), PyBytes_GET_SIZE(key0)) : 0,
                            &err);
    if (err)
        return -1;
    uint32_t v0 = walked[0] == NONE_ID ? NONE_ID : ent(&self->table, walked[0])->words[first];
    if (v0 == NONE_ID) {
        walked_keep(self, hashes, factor, 1, first, 1);
        return 0;
    }
    Py_ssize_t nwalked = 1; /* positions of ``walked`` filled */
    Py_ssize_t nchecks = PyList_GET_SIZE(checks);
    CheckSpec small[SMALL_CHECKS];
    CheckSpec *specs = small;
    if (nchecks > SMALL_CHECKS) {
        specs = PyMem_Malloc((size_t)nchecks * sizeof(CheckSpec));
        if (specs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t c = 0; c < nchecks; c++) {
        if (parse_check(self, PyList_GET_ITEM(checks, c), &specs[c]) < 0)
            goto fail;
    }
    /* Step 1: stops (blocks n, slots whose run is exactly n), kept in the scratch buffer as
     * [n, count, slots...] records after a working area of 3 * W words. */
    uint32_t width = (v0 & MULTI) ? set_of(self, v0)->n : 1;
    if (ensure_words(&self->scratch, &self->scratch_cap, (size_t)width * 4 + 16) < 0)
        goto fail;
    uint32_t *cur = self->scratch;
    uint32_t ncur;
    if (v0 & MULTI) {
        const HSet *s = set_of(self, v0);
        for (uint32_t i = 0; i < s->n; i++)
            cur[i] = s->codes[i] >> 2;
        ncur = s->n;
    } else {
        cur[0] = v0 >> 2;
        ncur = 1;
    }
    /* Stops are few (each removes at least one holder): record them in a Python-free array. */
    size_t cap_stops = 8, nstops = 0;
    Py_ssize_t *stop_n = PyMem_Malloc(cap_stops * sizeof(Py_ssize_t));
    uint32_t **stop_slots = PyMem_Malloc(cap_stops * sizeof(uint32_t *));
    uint32_t *stop_count = PyMem_Malloc(cap_stops * sizeof(uint32_t));
    if (stop_n == NULL || stop_slots == NULL || stop_count == NULL) {
        PyErr_NoMemory();
        goto fail_stops;
    }
    uint32_t *kept = cur + width;
    uint32_t *tmp = kept + width;
    uint32_t last = v0;
    Py_ssize_t end = limit;
    int emptied = 0;
    PyObject *const *keys = items + (factor - 1);
    Ahead ahead;
    ahead_start(&ahead, &self->table, keys, factor, 1, limit);
    for (Py_ssize_t i = 1; i < limit; i++) {
        uint32_t id = find_hashed(self, keys[i * factor], ahead_step(&ahead, i), &err);
        if (err)
            goto fail_stops;
        walked[i] = id;
        nwalked = i + 1;
        uint32_t v = id == NONE_ID ? NONE_ID : ent(&self->table, id)->words[first];
        if (v == last)
            continue;
        changes[nchanges++] = (uint32_t)i;
        if (v == NONE_ID) {
            end = i;
            break;
        }
        last = v;
        uint32_t nkept = intersect(self, cur, ncur, v, kept);
        if (nkept < ncur) {
            if (nstops == cap_stops) {
                cap_stops *= 2;
                Py_ssize_t *a = PyMem_Realloc(stop_n, cap_stops * sizeof(Py_ssize_t));
                if (a != NULL)
                    stop_n = a;
                uint32_t **b = PyMem_Realloc(stop_slots, cap_stops * sizeof(uint32_t *));
                if (b != NULL)
                    stop_slots = b;
                uint32_t *c = PyMem_Realloc(stop_count, cap_stops * sizeof(uint32_t));
                if (c != NULL)
                    stop_count = c;
                if (a == NULL || b == NULL || c == NULL) {
                    PyErr_NoMemory();
                    goto fail_stops;
                }
            }
            uint32_t nlost = difference(cur, ncur, kept, nkept, tmp);
            uint32_t *lost = PyMem_Malloc((nlost ? nlost : 1) * sizeof(uint32_t));
            if (lost == NULL) {
                PyErr_NoMemory();
                goto fail_stops;
            }
            memcpy(lost, tmp, nlost * sizeof(uint32_t));
            stop_n[nstops] = i;
            stop_slots[nstops] = lost;
            stop_count[nstops] = nlost;
            nstops++;
            memcpy(cur, kept, nkept * sizeof(uint32_t));
            ncur = nkept;
            if (ncur == 0) {
                emptied = 1;
                break;
            }
        }
    }
    if (!emptied) {
        if (nstops == cap_stops) {
            cap_stops += 1;
            Py_ssize_t *a = PyMem_Realloc(stop_n, cap_stops * sizeof(Py_ssize_t));
            if (a != NULL)
                stop_n = a;
            uint32_t **b = PyMem_Realloc(stop_slots, cap_stops * sizeof(uint32_t *));
            if (b != NULL)
                stop_slots = b;
            uint32_t *c = PyMem_Realloc(stop_count, cap_stops * sizeof(uint32_t));
            if (c != NULL)
                stop_count = c;
            if (a == NULL || b == NULL || c == NULL) {
                PyErr_NoMemory();
                goto fail_stops;
            }
        }
        uint32_t *rest = PyMem_Malloc((ncur ? ncur : 1) * sizeof(uint32_t));
        if (rest == NULL) {
            PyErr_NoMemory();
            goto fail_stops;
        }
        memcpy(rest, cur, ncur * sizeof(uint32_t));
        stop_n[nstops] = end;
        stop_slots[nstops] = rest;
        stop_count[nstops] = ncur;
        nstops++;
    }
    /* Step 2: per stop, the holders that hold every other group's needed blocks at its depth. */
    for (size_t s = 0; s < nstops; s++) {
        Py_ssize_t k = stop_n[s] / per;
        if (k <= 0)
            continue;
        uint32_t *slots = stop_slots[s];
        uint32_t nvalid = stop_count[s];
        uint32_t *valid = cur; /* working area: width words each */
        memcpy(valid, slots, nvalid * sizeof(uint32_t));
        for (Py_ssize_t c = 0; c < nchecks && nvalid > 0; c++) {
            const CheckSpec *spec = &specs[c];
            int g = spec->g;
            Py_ssize_t start, stop;
            if (needed_range(spec->ranges, g, k, &start, &stop) < 0)
                goto fail_stops;
            Py_ssize_t gf = spec->factor;
            if (stop > nhashes / gf)
                stop = nhashes / gf;
            uint32_t prev = NONE_ID;
            int same_view = gf == factor && stop <= nwalked; /* the first group's: step 1 met its entries */
            PyObject *const *gkeys = items + (gf - 1);
            Ahead gahead = {0};
            if (!same_view)
                ahead_start(&gahead, &self->table, gkeys, gf, start, stop);
            for (Py_ssize_t i = start; i < stop && nvalid > 0; i++) {
                uint32_t v;
                if (same_view)
                    v = walked[i] == NONE_ID ? NONE_ID : ent(&self->table, walked[i])->words[g];
                else if ((v = lookup_hashed(self, g, gkeys[i * gf], ahead_step(&gahead, i), &err)), err)
                    goto fail_stops;
                if (v == NONE_ID) {
                    nvalid = 0;
                    break;
                }
                if (v == prev)
                    continue;
                prev = v;
                nvalid = intersect(self, valid, nvalid, v, kept);
                memcpy(valid, kept, nvalid * sizeof(uint32_t));
            }
        }
        uint32_t nfail = difference(slots, stop_count[s], valid, nvalid, tmp);
        if (sink_row(sink, k, valid, nvalid, tmp, nfail) < 0)
            goto fail_stops;
    }
    for (size_t s = 0; s < nstops; s++)
        PyMem_Free(stop_slots[s]);
    PyMem_Free(stop_n);
    PyMem_Free(stop_slots);
    PyMem_Free(stop_count);
    if (specs != small)
        PyMem_Free(specs);
    walked_keep(self, hashes, factor, nwalked, first, nchanges);
    return 0;
fail_stops:
    if (stop_slots != NULL) {
        for (size_t s = 0; s < nstops; s++)
            PyMem_Free(stop_slots[s]);
    }
    PyMem_Free(stop_n);
    PyMem_Free(stop_slots);
    PyMem_Free(stop_count);
fail:
    if (specs != small)
        PyMem_Free(specs);
    return -1;
}

/* walk(first, hashes, factor, limit, per, checks): see HolderMaps.walk in holder_maps.py. */
static PyObject *Maps_walk(Maps *self, PyObject *args) {
    int first;
    PyObject *hashes, *checks;
    Py_ssize_t factor, limit, per;
    if (!PyArg_ParseTuple(args, "iO!nnnO!", &first, &PyList_Type, &hashes, &factor, &limit, &per, &PyList_Type,
                          &checks))
        return NULL;
    Sink sink = {0};
    sink.rows = PyList_New(0);
    if (sink.rows == NULL)
        return NULL;
    if (walk_impl(self, first, hashes, factor, limit, per, checks, &sink) < 0) {
        Py_DECREF(sink.rows);
        return NULL;
    }
    return sink.rows;
}

/* predict(first, hashes, factor, limit, per, checks, align, ids, hits, shared): see HolderMaps.predict. */
static PyObject *Maps_predict(Maps *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "predict: expected 10 arguments, got %zd", nargs);
        return NULL;
    }
    long first = PyLong_AsLong(args[0]);
    Py_ssize_t factor = PyLong_AsSsize_t(args[2]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    Py_ssize_t per = PyLong_AsSsize_t(args[4]);
    Py_ssize_t align = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *hashes = args[1], *checks = args[5], *ids = args[7], *hits = args[8], *shared = args[9];
    if (!PyList_Check(hashes) || !PyList_Check(checks) || !PyList_Check(ids) || !PyDict_Check(hits)) {
        PyErr_SetString(PyExc_TypeError, "predict: hashes, checks and ids must be lists, hits a dict");
        return NULL;
    }
    if (shared != Py_None && !PyDict_Check(shared)) {
        PyErr_Format(PyExc_TypeError, "shared: expected a dict or None, got %.100s", Py_TYPE(shared)->tp_name);
        return NULL;
    }
    if (check_group(self, first) < 0)
        return NULL;
    Sink sink = {0};
    sink.ids = ids;
    sink.hits = hits;
    sink.shared = shared == Py_None ? NULL : shared;
    sink.align = align;
    sink.failing = PyList_New(0);
    if (sink.failing == NULL)
        return NULL;
    if (walk_impl(self, (int)first, hashes, factor, limit, per, checks, &sink) < 0) {
        Py_DECREF(sink.failing);
        return NULL;
    }
    return Py_BuildValue("(Nnn)", sink.failing, sink.deepest, sink.reach);
}

/* -- the prediction over both tiers --------------------------------------------------------- */

#define UNREAD 0xFFFFFFFEu /* never a holder value: a slot code is < 2^30, a set number has MULTI */
#define TIER_SMALL 1024 /* positions of a decision's views kept on the stack */

/* One checked group of ``tiered``: its view of the request's hashes (every ``factor``-th, read in
 * place) up to ``n`` positions, each position's device holder value in the group (read when a
 * slot first needs it: UNREAD until then, NONE_ID nobody) and its host holder value (the same
 * group of the host tiers' holder maps, ``host``; UNREAD until read: up front where they decide
 * which slots are walked, else when a slot needs them). */
typedef struct {
    int g;
    Py_ssize_t factor, n;
    PyObject *ranges;
    PyObject *const *keys;
    const Maps *host; /* the host tiers' holder maps (the same group numbers) */
    uint32_t *dev;
    uint32_t *hosted;
    /* the entries the last walk met over these hashes (its first ``known`` positions): a
     * position below ``known`` reads its entry from there instead of looking its key up */
    const uint32_t *walked;
    Py_ssize_t known;
} TierView;

/* The device value of position ``i`` (read once). */
static inline uint32_t tier_dev(const Maps *m, TierView *v, Py_ssize_t i, int *err) {
    uint32_t value = v->dev[i];
    if (value != UNREAD)
        return value;
    if (i < v->known) {
        uint32_t id = v->walked[i];
        value = id == NONE_ID ? NONE_ID : ent(&m->table, id)->words[v->g];
    } else {
        PyObject *key = v->keys[i * v->factor];
        uint64_t h = PyBytes_Check(key) ? hash_key(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) : 0;
        value = lookup_hashed(m, v->g, key, h, err);
        if (*err)
            return value;
    }
    v->dev[i] = value;
    return value;
}

/* The host holder value of position ``i`` (NONE_ID: none; read once). */
static inline uint32_t tier_host(TierView *v, Py_ssize_t i, int *err) {
    uint32_t value = v->hosted[i];
    if (value != UNREAD)
        return value;
    value = NONE_ID;
    if (v->host->group_used[v->g] > 0) {
        PyObject *key = v->keys[i * v->factor];
        uint64_t h = PyBytes_Check(key) ? hash_key(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)) : 0;
        value = lookup_hashed(v->host, v->g, key, h, err);
        if (*err)
            return NONE_ID;
    }
    v->hosted[i] = value;
    return value;
}

/* Whether ``slot`` holds position ``i`` of the view in either tier: 1, 0, or -1 on error. */
static inline int tier_held(const Maps *m, TierView *v, Py_ssize_t i, uint32_t slot) {
    int err = 0;
    uint32_t value = tier_dev(m, v, i, &err);
    if (err)
        return -1;
    if (value != NONE_ID && v_level(m, value, slot) >= 0)
        return 1;
    uint32_t hosted = tier_host(v, i, &err);
    if (err)
        return -1;
    return hosted != NONE_ID && v_level(v->host, hosted, slot) >= 0;
}

static int cmp_u32_t(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* ``dict[key] = tokens`` (or the key dropped at 0, ``drop``): 0, or -1 on error. */
static int put_tokens(PyObject *dict, PyObject *key, Py_ssize_t tokens, int drop) {
    if (tokens == 0) {
        if (!drop)
            return 0;
        int has = PyDict_Contains(dict, key);
        return has < 0 ? -1 : has ? PyDict_DelItem(dict, key) : 0;
    }
    PyObject *value = PyLong_FromSsize_t(tokens);
    if (value == NULL)
        return -1;
    int rc = PyDict_SetItem(dict, key, value);
    Py_DECREF(value);
    return rc;
}

/* The hit over both tiers of one slot (see HolderMaps.tiered in holder_maps.py): its aligned steps
 * into *hit, the first group's depth in steps (``prefix`` only) into *top, the host's tokens into
 * *host (``covered``: a scratch of ``steps * align / unit`` bytes). 0, or -1 on error. */
static int tier_slot(const Maps *m, TierView *views, Py_ssize_t nviews, uint32_t slot, Py_ssize_t steps,
                     Py_ssize_t align, Py_ssize_t unit, int prefix, unsigned char *covered, Py_ssize_t *hit,
                     Py_ssize_t *top, Py_ssize_t *host) {
    Py_ssize_t k = steps;
    *top = 0;
    *host = 0;
    if (prefix) {
        TierView *v = &views[0];
        Py_ssize_t per = align / (v->factor * unit);
        Py_ssize_t end = steps * per < v->n ? steps * per : v->n, depth = 0;
        for (; depth < end; depth++) {
            int held = tier_held(m, v, depth, slot);
            if (held < 0)
                return -1;
            if (!held)
                break;
        }
        k = *top = per > 0 ? depth / per : 0;
    }
    for (; k > 0; k--) {
        int ok = 1;
        for (Py_ssize_t c = prefix ? 1 : 0; c < nviews && ok; c++) {
            TierView *v = &views[c];
            Py_ssize_t start, stop;
            if (needed_range(v->ranges, v->g, k, &start, &stop) < 0)
                return -1;
            if (stop > v->n) {
                ok = 0;
                break;
            }
            for (Py_ssize_t i = start; i < stop; i++) {
                int held = tier_held(m, v, i, slot);
                if (held < 0)
                    return -1;
                if (!held) {
                    ok = 0;
                    break;
                }
            }
        }
        if (ok)
            break;
    }
    *hit = k;
    if (k <= 0)
        return 0;
    Py_ssize_t units = k * align / unit, count = 0;
    memset(covered, 0, (size_t)units);
    for (Py_ssize_t c = 0; c < nviews; c++) {
        TierView *v = &views[c];
        Py_ssize_t start, stop;
        if (needed_range(v->ranges, v->g, k, &start, &stop) < 0)
            return -1;
        for (Py_ssize_t i = start; i < stop; i++) {
            int err = 0;
            uint32_t value = tier_dev(m, v, i, &err);
            if (err)
                return -1;
            if (value != NONE_ID && v_level(m, value, slot) >= 0)
                continue;
            Py_ssize_t from = i * v->factor, to = from + v->factor < units ? from + v->factor : units;
            for (Py_ssize_t u = from; u < to; u++) {
                count += !covered[u];
                covered[u] = 1;
            }
        }
    }
    *host = count * unit;
    return 0;
}

/* Append the slots of a host holder value to ``*met``: 0, or -1 on error. */
static int met_add(const Maps *host, uint32_t **met, size_t *nmet, size_t *cap, uint32_t value) {
    uint32_t ns = (value & MULTI) ? set_of(host, value)->n : 1;
    if (*nmet + (size_t)ns > *cap) {
        size_t want = (*nmet + (size_t)ns) * 2 + 16;
        uint32_t *grown = PyMem_Realloc(*met, want * sizeof(uint32_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *met = grown;
        *cap = want;
    }
    if (!(value & MULTI)) {
        (*met)[(*nmet)++] = value >> 2;
        return 0;
    }
    const HSet *set = set_of(host, value);
    for (uint32_t j = 0; j < set->n; j++)
        (*met)[(*nmet)++] = set->codes[j] >> 2;
    return 0;
}

/* The prediction over both tiers (see HolderMaps.tiered in holder_maps.py), its arguments
 * checked: the slots met, or -1 on error. ``extra``: ``nextra`` slots walked besides the met.
 * ``reach`` (may be NULL) is raised to each value put in ``shared``. */
static Py_ssize_t tiered_impl(Maps *self, PyObject *hashes, PyObject *order, const Maps *host, Py_ssize_t steps,
                              Py_ssize_t align, Py_ssize_t unit, int prefix, PyObject *ids, PyObject *hits,
                              PyObject *shared, PyObject *host_hits, PyObject *pending, const uint32_t *extra,
                              size_t nextra, Py_ssize_t *reach) {
    Py_ssize_t nviews = PyList_GET_SIZE(order);
    if (steps <= 0 || nviews == 0)
        return 0;
    Py_ssize_t nhashes = PyList_GET_SIZE(hashes);
    PyObject *const *items = nhashes ? &PyList_GET_ITEM(hashes, 0) : NULL;
    /* A decision's views and their positions on the stack (a few groups, a prompt of up to
     * TIER_SMALL positions over them), else on the heap. */
    TierView small_views[SMALL_CHECKS];
    uint32_t small_dev[TIER_SMALL];
    uint32_t small_hosted[TIER_SMALL];
    TierView *views = nviews <= SMALL_CHECKS ? small_views : PyMem_Calloc((size_t)nviews, sizeof(TierView));
    uint32_t *dev = NULL, *met = NULL, *hosted = NULL;
    unsigned char *covered = NULL;
    size_t nmet = 0, cap_met = 0;
    Py_ssize_t result = -1;
    if (views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t positions = 0;
    for (Py_ssize_t c = 0; c < nviews; c++) {
        CheckSpec spec;
        if (parse_check(self, PyList_GET_ITEM(order, c), &spec) < 0)
            goto done;
        TierView *v = &views[c];
        v->g = spec.g;
        v->factor = spec.factor;
        v->ranges = spec.ranges;
        if (check_group(host, v->g) < 0)
            goto done;
        v->host = host;
        Py_ssize_t n = steps * align / (spec.factor * unit);
        v->n = n < nhashes / spec.factor ? n : nhashes / spec.factor;
        v->keys = items + (spec.factor - 1);
        v->walked = self->walked;
        v->known = 0; /* positions the last walk met over these hashes: read from ``walked`` */
        if (self->walked_list == hashes && self->walked_factor == v->factor &&
            self->walked_epoch == self->table.epoch)
            v->known = self->walked_n < v->n ? self->walked_n : v->n;
        positions += v->n;
    }
    if (positions <= TIER_SMALL) {
        dev = small_dev;
        hosted = small_hosted;
    } else {
        dev = PyMem_Malloc((size_t)positions * sizeof(uint32_t));
        hosted = PyMem_Malloc((size_t)positions * sizeof(uint32_t));
        if (dev == NULL || hosted == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < positions; i++) {
        dev[i] = UNREAD;
        hosted[i] = UNREAD;
    }
    positions = 0;
    for (Py_ssize_t c = 0; c < nviews; c++) {
        views[c].dev = dev + positions;
        views[c].hosted = hosted + positions;
        positions += views[c].n;
    }
    /* Every checked group's view within ``steps``: its host holders now (the met slots), its
     * device values when a slot needs them. */
    for (Py_ssize_t c = 0; c < nviews; c++) {
        TierView *v = &views[c];
        if (host->group_used[v->g] == 0 || (prefix && c > 0))
            continue; /* read as the walked slots need them */
        /* The slots met: with ``prefix``, a slot's depth over both tiers passes its device depth
         * only if its host holds the block where its device run ends, a position where the
         * device value changes (or 0): only those are read, up to the first nobody holds on the
         * device; without, every position (any group's host block may serve a window). */
        uint32_t last = NONE_ID, before = UNREAD;
        Py_ssize_t from = 0;
        int err = 0;
        if (prefix && v->known > 0 && self->walked_group == v->g) {
            /* the walk met the positions below ``known``: where the value changes is its list */
            for (Py_ssize_t j = 0; j < self->walked_changes && before != NONE_ID; j++) {
                Py_ssize_t i = self->changes[j];
                if (i >= v->known)
                    break;
                before = tier_dev(self, v, i, &err);
                uint32_t slots = err ? NONE_ID : tier_host(v, i, &err);
                if (err)
                    goto done;
                if (slots != NONE_ID && slots != last) {
                    last = slots;
                    if (met_add(host, &met, &nmet, &cap_met, slots) < 0)
                        goto done;
                }
            }
            if (before == NONE_ID)
                continue; /* no slot's device run passes here: the met slots are known */
            from = v->known;
            before = tier_dev(self, v, from - 1, &err);
        }
        for (Py_ssize_t i = from; i < v->n; i++) {
            if (prefix) {
                uint32_t value = tier_dev(self, v, i, &err);
                if (err)
                    goto done;
                int same = i > 0 && value == before;
                before = value;
                if (same)
                    continue;
            }
            uint32_t slots = tier_host(v, i, &err);
            if (err)
                goto done;
            if (prefix && before == NONE_ID)
                i = v->n; /* no slot's device run passes here: the met slots are known */
            if (slots == NONE_ID || slots == last)
                continue;
            last = slots;
            if (met_add(host, &met, &nmet, &cap_met, slots) < 0)
                goto done;
        }
    }
    if (nextra > 0) {
        if (nmet + nextra > cap_met) {
            uint32_t *grown = PyMem_Realloc(met, (nmet + nextra) * sizeof(uint32_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            met = grown;
            cap_met = nmet + nextra;
        }
        memcpy(met + nmet, extra, nextra * sizeof(uint32_t));
        nmet += nextra;
    }
    size_t unique = 0;
    if (nmet) {
        qsort(met, nmet, sizeof(uint32_t), cmp_u32_t);
        for (size_t i = 0; i < nmet; i++) {
            if (i == 0 || met[i] != met[i - 1])
                met[unique++] = met[i];
        }
        covered = PyMem_Malloc((size_t)(steps * align / unit) + 1);
        if (covered == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (size_t j = 0; j < unique; j++) {
        uint32_t slot = met[j];
        if ((Py_ssize_t)slot >= PyList_GET_SIZE(ids)) {
            PyErr_Format(PyExc_IndexError, "ids: no worker for slot %u", slot);
            goto done;
        }
        PyObject *worker = PyList_GET_ITEM(ids, slot);
        Py_ssize_t k, top, host_tokens;
        if (tier_slot(self, views, nviews, slot, steps, align, unit, prefix, covered, &k, &top, &host_tokens) < 0)
            goto done;
        if (pending && PySet_Discard(pending, worker) < 0)
            goto done;
        if (put_tokens(hits, worker, k * align, 1) < 0)
            goto done;
        if (host_hits && put_tokens(host_hits, worker, host_tokens, 0) < 0)
            goto done;
        if (shared && prefix && put_tokens(shared, worker, top * align, 0) < 0)
            goto done;
        if (shared && prefix && reach != NULL && top * align > *reach)
            *reach = top * align;
    }
    result = (Py_ssize_t)unique;
done:
    if (dev != small_dev)
        PyMem_Free(dev);
    if (hosted != small_hosted)
        PyMem_Free(hosted);
    if (views != small_views)
        PyMem_Free(views);
    PyMem_Free(met);
    PyMem_Free(covered);
    return result;
}

/* tiered(hashes, order, host, steps, align, unit, prefix, ids, hits, shared, host_hits, pending, extra):
 * see HolderMaps.tiered in holder_maps.py. */
static PyObject *Maps_tiered(Maps *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "tiered: expected 13 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *hashes = args[0], *order = args[1], *host = args[2], *ids = args[7], *hits = args[8];
    PyObject *extra = args[12];
    PyObject *shared = args[9] == Py_None ? NULL : args[9];
    PyObject *host_hits = args[10] == Py_None ? NULL : args[10];
    PyObject *pending = args[11] == Py_None ? NULL : args[11];
    Py_ssize_t steps = PyLong_AsSsize_t(args[3]);
    Py_ssize_t align = PyLong_AsSsize_t(args[4]);
    Py_ssize_t unit = PyLong_AsSsize_t(args[5]);
    int prefix = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || prefix < 0)
        return NULL;
    if (!PyList_Check(hashes) || !PyList_Check(order) || !PyList_Check(ids) || !PyDict_Check(hits) ||
        !PyList_Check(extra) || !PyObject_TypeCheck(host, &MapsType)) {
        PyErr_SetString(PyExc_TypeError,
                        "tiered: hashes, order, ids and extra must be lists, hits a dict, host holder maps");
        return NULL;
    }
    if ((shared && !PyDict_Check(shared)) || (host_hits && !PyDict_Check(host_hits)) ||
        (pending && !PySet_Check(pending))) {
        PyErr_SetString(PyExc_TypeError, "tiered: shared and host_hits must be dicts or None, pending a set or None");
        return NULL;
    }
    if (align < 1 || unit < 1 || align % unit) {
        PyErr_Format(PyExc_ValueError, "tiered: align %zd must be a positive multiple of unit %zd", align, unit);
        return NULL;
    }
    Py_ssize_t nextra = PyList_GET_SIZE(extra);
    uint32_t small_extra[64];
    uint32_t *slots = nextra <= 64 ? small_extra : PyMem_Malloc((size_t)nextra * sizeof(uint32_t));
    if (slots == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t j = 0; j < nextra; j++) {
        unsigned long s = PyLong_AsUnsignedLong(PyList_GET_ITEM(extra, j));
        if (s == (unsigned long)-1 && PyErr_Occurred()) {
            if (slots != small_extra)
                PyMem_Free(slots);
            return NULL;
        }
        slots[j] = (uint32_t)s;
    }
    Py_ssize_t met = tiered_impl(self, hashes, order, (const Maps *)host, steps, align, unit, prefix, ids, hits, shared, host_hits,
                                 pending, slots, (size_t)nextra, NULL);
    if (slots != small_extra)
        PyMem_Free(slots);
    return met < 0 ? NULL : PyLong_FromSsize_t(met);
}

/* predict_tiered(first, hashes, factor, limit, per, checks, align, ids, hits, shared, order, host, counts,
 * steps, unit, prefix, host_hits): see HolderMaps.predict_tiered in holder_maps.py. ``predict`` then ``tiered``
 * over the same hashes in one call: the failing workers go into a set, and those of them whose slot
 * ``counts`` (the host tiers' entry counts per slot) names are walked over both tiers as ``extra``. */
static PyObject *Maps_predict_tiered(Maps *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 17) {
        PyErr_Format(PyExc_TypeError, "predict_tiered: expected 17 arguments, got %zd", nargs);
        return NULL;
    }
    long first = PyLong_AsLong(args[0]);
    Py_ssize_t factor = PyLong_AsSsize_t(args[2]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    Py_ssize_t per = PyLong_AsSsize_t(args[4]);
    Py_ssize_t align = PyLong_AsSsize_t(args[6]);
    Py_ssize_t steps = PyLong_AsSsize_t(args[13]);
    Py_ssize_t unit = PyLong_AsSsize_t(args[14]);
    int prefix = PyObject_IsTrue(args[15]);
    if (PyErr_Occurred() || prefix < 0)
        return NULL;
    PyObject *hashes = args[1], *checks = args[5], *ids = args[7], *hits = args[8];
    PyObject *shared = args[9] == Py_None ? NULL : args[9];
    PyObject *order = args[10], *host = args[11], *counts = args[12];
    PyObject *host_hits = args[16] == Py_None ? NULL : args[16];
    if (!PyList_Check(hashes) || !PyList_Check(checks) || !PyList_Check(ids) || !PyDict_Check(hits) ||
        !PyList_Check(order) || !PyObject_TypeCheck(host, &MapsType) || !PyDict_Check(counts)) {
        PyErr_SetString(PyExc_TypeError, "predict_tiered: hashes, checks, ids and order must be lists, hits and "
                                         "counts dicts, host holder maps");
        return NULL;
    }
    if ((shared && !PyDict_Check(shared)) || (host_hits && !PyDict_Check(host_hits))) {
        PyErr_SetString(PyExc_TypeError, "predict_tiered: shared and host_hits must be dicts or None");
        return NULL;
    }
    if (align < 1 || unit < 1 || align % unit) {
        PyErr_Format(PyExc_ValueError, "predict_tiered: align %zd must be a positive multiple of unit %zd", align,
                     unit);
        return NULL;
    }
    if (check_group(self, first) < 0)
        return NULL;
    Sink sink = {0};
    sink.ids = ids;
    sink.hits = hits;
    sink.shared = shared;
    sink.align = align;
    sink.failing = PySet_New(NULL);
    if (sink.failing == NULL)
        return NULL;
    sink.counts = prefix ? counts : NULL;
    PyObject *result = NULL;
    if (walk_impl(self, (int)first, hashes, factor, limit, per, checks, &sink) < 0)
        goto done;
    int failed = PySet_GET_SIZE(sink.failing) > 0;
    if (tiered_impl(self, hashes, order, (const Maps *)host, steps, align, unit, prefix, ids, hits, shared, host_hits,
                    failed ? sink.failing : NULL, sink.extra, sink.nextra, &sink.reach) < 0)
        goto done;
    result = failed ? Py_BuildValue("(Onn)", sink.failing, sink.deepest, sink.reach)
                    : Py_BuildValue("(Onn)", Py_None, (Py_ssize_t)0, sink.reach);
done:
    Py_DECREF(sink.failing);
    PyMem_Free(sink.extra);
    return result;
}

static PyObject *Maps_sizeof(Maps *self, PyObject *Py_UNUSED(ignored)) {
    size_t total = sizeof(Maps) + (size_t)self->ngroups * sizeof(uint32_t);
    const Table *t = &self->table;
    total += (size_t)t->nchunks * (CHUNK * t->stride + sizeof(char *));
    if (t->index != NULL)
        total += ((size_t)t->mask + 1) * sizeof(uint32_t);
    for (uint32_t id = 0; id < t->top; id++) {
        const Entry *e = ent(t, id);
        if (!e_free(e) && e_object(e))
            total += (size_t)PyBytes_GET_SIZE(entry_object(e)) + 33;
    }
    total += (size_t)self->sets_cap * sizeof(HSet *) + (size_t)self->free_cap * sizeof(uint32_t);
    total += (size_t)self->set_bytes;
    total += (size_t)self->nslots * sizeof(Slot);
    for (uint32_t s = 0; s < self->nslots; s++) {
        if (self->slots[s].lists == NULL)
            continue;
        total += (size_t)self->ngroups * sizeof(IdList);
        for (int g = 0; g < self->ngroups; g++)
            total += (size_t)self->slots[s].lists[g].cap * sizeof(uint32_t);
    }
    total += (self->scratch_cap + self->walked_cap) * sizeof(uint32_t);
    return PyLong_FromSize_t(total);
}


/* stats(): bytes per part and counts (what __sizeof__ adds up), for sizing reports. */
static PyObject *Maps_stats(Maps *self, PyObject *Py_UNUSED(ignored)) {
    size_t entries = 0, index = 0, keys = 0, entry_cap = 0, lists = 0, listed = 0;
    const Table *t = &self->table;
    entries += (size_t)t->nchunks * (CHUNK * t->stride + sizeof(char *));
    entry_cap += (size_t)t->nchunks * CHUNK;
    keys += t->used;
    if (t->index != NULL)
        index += ((size_t)t->mask + 1) * sizeof(uint32_t);
    for (uint32_t s = 0; s < self->nslots; s++) {
        if (self->slots[s].lists == NULL)
            continue;
        for (int g = 0; g < self->ngroups; g++) {
            lists += (size_t)self->slots[s].lists[g].cap * sizeof(uint32_t);
            listed += self->slots[s].lists[g].n;
        }
    }
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "keys", (Py_ssize_t)keys, "entry_capacity",
                         (Py_ssize_t)entry_cap, "entry_bytes", (Py_ssize_t)entries, "index_bytes", (Py_ssize_t)index,
                         "set_bytes", (Py_ssize_t)(self->set_bytes + (int64_t)self->sets_cap * (int64_t)sizeof(HSet *)),
                         "live_sets", (Py_ssize_t)(self->sets_top - self->nfree), "list_bytes", (Py_ssize_t)lists,
                         "listed", (Py_ssize_t)listed);
}

static PyMethodDef Maps_methods[] = {
    {"add_slot", (PyCFunction)Maps_add_slot, METH_O, "Start an empty slot."},
    {"release_slot", (PyCFunction)Maps_release_slot, METH_O, "Forget a slot's keys and free the slot."},
    {"clear", (PyCFunction)Maps_clear, METH_O, "Forget every key the slot holds."},
    {"compact", (PyCFunction)Maps_compact, METH_O, "Keep in the slot's key lists only keys it holds, once."},
    {"num_cached", (PyCFunction)Maps_num_cached, METH_O, "(group, key) entries the slot holds."},
    {"listed", (PyCFunction)Maps_listed, METH_O, "Entries in the slot's key lists."},
    {"store", (PyCFunction)Maps_store, METH_VARARGS, "store(group, keys, slot)"},
    {"hold", (PyCFunction)Maps_hold, METH_VARARGS, "hold(group, entries, slot)"},
    {"remove", (PyCFunction)Maps_remove, METH_VARARGS, "remove(group, keys, slot, report)"},
    {"relevel", (PyCFunction)Maps_relevel, METH_VARARGS, "relevel(group, keys, slot, level, raise_only, report)"},
    {"level", (PyCFunction)Maps_level, METH_VARARGS, "level(group, key, slot)"},
    {"holders", (PyCFunction)Maps_holders, METH_VARARGS, "holders(group, key)"},
    {"table", (PyCFunction)Maps_table, METH_VARARGS, "table(group, slot)"},
    {"size", (PyCFunction)Maps_size, METH_O, "size(group)"},
    {"met", (PyCFunction)Maps_met, METH_VARARGS, "met(group, keys)"},
    {"absorb", (PyCFunction)Maps_absorb, METH_VARARGS, "absorb(events, start, slot, last_seq, kinds)"},
    {"walk", (PyCFunction)Maps_walk, METH_VARARGS, "walk(first, hashes, factor, limit, per, checks)"},
    {"predict", (PyCFunction)(void (*)(void))Maps_predict, METH_FASTCALL,
     "predict(first, hashes, factor, limit, per, checks, align, ids, hits, shared)"},
    {"tiered", (PyCFunction)(void (*)(void))Maps_tiered, METH_FASTCALL,
     "tiered(hashes, order, host, steps, align, unit, prefix, ids, hits, shared, host_hits, pending, extra)"},
    {"predict_tiered", (PyCFunction)(void (*)(void))Maps_predict_tiered, METH_FASTCALL,
     "predict_tiered(first, hashes, factor, limit, per, checks, align, ids, hits, shared, order, host, counts, "
     "steps, unit, prefix, host_hits)"},
    {"stats", (PyCFunction)Maps_stats, METH_NOARGS, "Bytes per part and counts."},
    {"__sizeof__", (PyCFunction)Maps_sizeof, METH_NOARGS, "Bytes held, tables and lists included."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MapsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engine.routing._core.HolderMaps",
    .tp_basicsize = sizeof(Maps),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The prefix index's device holder maps, compiled (see engine/routing/holder_maps.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Maps_init,
    .tp_dealloc = (destructor)Maps_dealloc,
    .tp_methods = Maps_methods,
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core", "Compiled hot path of the routing index.", -1, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    str_seq = PyUnicode_InternFromString("seq");
    str_group = PyUnicode_InternFromString("group");
    str_block_hashes = PyUnicode_InternFromString("block_hashes");
    str_explicit = PyUnicode_InternFromString("explicit");
    if (str_seq == NULL || str_group == NULL || str_block_hashes == NULL || str_explicit == NULL)
        return NULL;
    if (PyType_Ready(&MapsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MapsType);
    if (PyModule_AddObject(m, "HolderMaps", (PyObject *)&MapsType) < 0) {
        Py_DECREF(&MapsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
