/* The compiled in-flight prefixes (engine/routing/inflight.py describes the interface; the
 * pure-Python PyInFlightPrefixes there is the reference this must match call by call, down to
 * the order of the workers in a ``depths`` result, which the pick's ties read).
 *
 * An announcement (``Sent``) holds references to the hashes of its blocks [start, end), its
 * worker and its expiry. Keyed announcements sit in a chained hash table by the hash of their
 * first block (a chain keeps announcements in the order they were added, so those of one key are
 * met in that order, as the reference's per-key lists are) and in their worker's list; every
 * announcement, keyed or not, sits in a FIFO by expiry until ``expire`` passes it. Unkeying
 * (reported, forgotten or expired) drops its hash references at once; the FIFO frees it later.
 * ``workers`` maps a worker with keyed announcements to its record (number of them, list head):
 * ``announced`` is one dict lookup.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "structmember.h"

typedef struct Sent Sent;
struct Sent {
    PyObject *worker; /* strong until freed */
    Py_ssize_t start, end, held; /* held: hash references still owned (end - start while keyed, then 0) */
    double expiry;
    Py_hash_t khash; /* hash of the first block's hash (the key) */
    Py_ssize_t rec;  /* the worker's record while keyed */
    int keyed;
    Sent *chain;       /* next in the key's bucket */
    Sent *wprev, *wnext; /* the worker's keyed announcements */
    PyObject *hashes[];  /* block start + i at i */
};

typedef struct {
    Sent *head;
    Py_ssize_t count;
} WorkerRec;

typedef struct {
    PyObject_HEAD
    double ttl_s;
    Sent **buckets;
    size_t mask;
    Py_ssize_t keyed;
    Sent **fifo; /* ring buffer */
    size_t fcap, fhead, flen;
    PyObject *workers; /* dict: worker -> record number (int) */
    WorkerRec *recs;
    Py_ssize_t nrecs, caprecs;
    Py_ssize_t *free_recs;
    Py_ssize_t nfree;
} Tracker;

/* -- the key table -------------------------------------------------------------------------- */

static inline Sent **bucket_of(const Tracker *t, Py_hash_t h) { return &t->buckets[(size_t)h & t->mask]; }

/* Append at the chain's tail (the order of announcements of one key is their order of adding). */
static inline void chain_append(Sent **slot, Sent *s) {
    s->chain = NULL;
    while (*slot != NULL)
        slot = &(*slot)->chain;
    *slot = s;
}

static int grow_buckets(Tracker *t) {
    size_t n = (t->mask + 1) * 2;
    Sent **fresh = calloc(n, sizeof(Sent *));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Sent **old = t->buckets;
    size_t old_n = t->mask + 1;
    t->buckets = fresh;
    t->mask = n - 1;
    for (size_t i = 0; i < old_n; i++) {
        Sent *s = old[i];
        while (s != NULL) {
            Sent *next = s->chain;
            chain_append(bucket_of(t, s->khash), s);
            s = next;
        }
    }
    free(old);
    return 0;
}

static void chain_remove(Tracker *t, Sent *s) {
    Sent **slot = bucket_of(t, s->khash);
    while (*slot != s)
        slot = &(*slot)->chain;
    *slot = s->chain;
    s->chain = NULL;
}

/* 1 if ``a`` and ``b`` are equal keys (``==``, identity first), 0, or -1 on error. */
static inline int same(PyObject *a, PyObject *b) { return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ); }

/* -- workers -------------------------------------------------------------------------------- */

/* The worker's record number, -1 if it has no keyed announcement, -2 on error. */
static Py_ssize_t rec_of(Tracker *t, PyObject *worker) {
    PyObject *got = PyDict_GetItemWithError(t->workers, worker);
    if (got == NULL)
        return PyErr_Occurred() ? -2 : -1;
    return PyLong_AsSsize_t(got);
}

static Py_ssize_t rec_new(Tracker *t, PyObject *worker) {
    Py_ssize_t r;
    if (t->nfree > 0) {
        r = t->free_recs[--t->nfree];
    } else {
        if (t->nrecs == t->caprecs) {
            Py_ssize_t cap = t->caprecs ? t->caprecs * 2 : 16;
            WorkerRec *recs = realloc(t->recs, (size_t)cap * sizeof(WorkerRec));
            if (recs == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            Py_ssize_t *free_recs = realloc(t->free_recs, (size_t)cap * sizeof(Py_ssize_t));
            if (free_recs == NULL) {
                t->recs = recs;
                PyErr_NoMemory();
                return -1;
            }
            t->recs = recs;
            t->free_recs = free_recs;
            t->caprecs = cap;
        }
        r = t->nrecs++;
    }
    PyObject *num = PyLong_FromSsize_t(r);
    if (num == NULL || PyDict_SetItem(t->workers, worker, num) < 0) {
        Py_XDECREF(num);
        t->free_recs[t->nfree++] = r;
        return -1;
    }
    Py_DECREF(num);
    t->recs[r].head = NULL;
    t->recs[r].count = 0;
    return r;
}

/* -- announcements -------------------------------------------------------------------------- */

static void release_hashes(Sent *s) {
    for (Py_ssize_t i = 0; i < s->held; i++)
        Py_DECREF(s->hashes[i]);
    s->held = 0;
}

/* Take a keyed announcement out of the key table and its worker's list; its hashes go. Returns
 * -1 if dropping the worker's entry failed (the announcement is unkeyed regardless). */
static int unkey(Tracker *t, Sent *s) {
    chain_remove(t, s);
    WorkerRec *rec = &t->recs[s->rec];
    if (s->wprev != NULL)
        s->wprev->wnext = s->wnext;
    else
        rec->head = s->wnext;
    if (s->wnext != NULL)
        s->wnext->wprev = s->wprev;
    s->wprev = s->wnext = NULL;
    s->keyed = 0;
    t->keyed--;
    int rc = 0;
    if (--rec->count == 0) {
        t->free_recs[t->nfree++] = s->rec;
        rc = PyDict_DelItem(t->workers, s->worker);
    }
    release_hashes(s);
    return rc;
}

static void free_sent(Sent *s) {
    release_hashes(s);
    Py_DECREF(s->worker);
    free(s);
}

static int fifo_push(Tracker *t, Sent *s) {
    if (t->flen == t->fcap) {
        size_t cap = t->fcap ? t->fcap * 2 : 64;
        Sent **ring = malloc(cap * sizeof(Sent *));
        if (ring == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < t->flen; i++)
            ring[i] = t->fifo[(t->fhead + i) % t->fcap];
        free(t->fifo);
        t->fifo = ring;
        t->fcap = cap;
        t->fhead = 0;
    }
    t->fifo[(t->fhead + t->flen) % t->fcap] = s;
    t->flen++;
    return 0;
}

static int expire_core(Tracker *t, double now) {
    int rc = 0;
    while (t->flen > 0 && t->fifo[t->fhead]->expiry <= now) {
        Sent *s = t->fifo[t->fhead];
        t->fhead = (t->fhead + 1) % t->fcap;
        t->flen--;
        if (s->keyed && unkey(t, s) < 0)
            rc = -1;
        free_sent(s);
    }
    return rc;
}

/* Unkey the keyed announcements of ``worker``: all of them, or those whose key is one of ``items[0..n)``. */
static int end_where(Tracker *t, PyObject *worker, PyObject *const *items, Py_ssize_t n, int all) {
    Py_ssize_t r = rec_of(t, worker);
    if (r == -2)
        return -1;
    if (r < 0)
        return 0;
    Sent *s = t->recs[r].head;
    while (s != NULL) {
        Sent *next = s->wnext; /* (unkeying s leaves the rest of the list as it was) */
        int drop = all;
        for (Py_ssize_t i = 0; !drop && i < n; i++) {
            drop = same(s->hashes[0], items[i]);
            if (drop < 0)
                return -1;
        }
        if (drop && unkey(t, s) < 0)
            return -1;
        s = next;
    }
    return 0;
}

/* Fold into ``depth`` how far ``s`` agrees with ``items`` (chained: agreement is a prefix). */
static int deepen(PyObject *depth, const Sent *s, PyObject *const *items, Py_ssize_t n) {
    Py_ssize_t start = s->start, lo = start + 1, hi = s->end < n ? s->end : n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        int eq = same(s->hashes[mid - start], items[mid]);
        if (eq < 0)
            return -1;
        if (eq)
            lo = mid + 1;
        else
            hi = mid;
    }
    PyObject *have = PyDict_GetItemWithError(depth, s->worker);
    if (have == NULL && PyErr_Occurred())
        return -1;
    if (have != NULL) {
        Py_ssize_t d = PyLong_AsSsize_t(have);
        if (d == -1 && PyErr_Occurred())
            return -1;
        if (lo <= d)
            return 0;
    } else if (lo <= 0) {
        return 0;
    }
    PyObject *value = PyLong_FromSsize_t(lo);
    if (value == NULL)
        return -1;
    int rc = PyDict_SetItem(depth, s->worker, value);
    Py_DECREF(value);
    return rc;
}

/* -- Python methods ------------------------------------------------------------------------- */

/* 0 once ``__init__`` ran, else -1 with an error (methods on an object ``__new__`` made alone). */
static int ready(const Tracker *t) {
    if (t->buckets != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "InFlightPrefixes: __init__ was not called");
    return -1;
}

static int Tracker_init(Tracker *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"ttl_s", NULL};
    double ttl;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "d", names, &ttl))
        return -1;
    if (ttl < 0) {
        PyObject *got = PyFloat_FromDouble(ttl);
        if (got != NULL)
            PyErr_Format(PyExc_ValueError, "inflight_ttl_s: must be >= 0 (got %R)", got);
        Py_XDECREF(got);
        return -1;
    }
    if (self->buckets != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "InFlightPrefixes: already initialised");
        return -1;
    }
    self->ttl_s = ttl;
    self->buckets = calloc(64, sizeof(Sent *));
    self->workers = PyDict_New();
    if (self->buckets == NULL || self->workers == NULL) {
        if (self->buckets == NULL)
            PyErr_NoMemory();
        return -1;
    }
    self->mask = 63;
    return 0;
}

static void Tracker_dealloc(Tracker *self) {
    for (size_t i = 0; i < self->flen; i++)
        free_sent(self->fifo[(self->fhead + i) % self->fcap]);
    free(self->fifo);
    free(self->buckets);
    free(self->recs);
    free(self->free_recs);
    Py_XDECREF(self->workers);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t Tracker_len(Tracker *self) { return self->keyed; }

static int Tracker_bool(Tracker *self) { return self->keyed > 0; }

/* add(worker, block_hashes, start, end, now): see PyInFlightPrefixes.add. */
static PyObject *Tracker_add(Tracker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (ready(self) < 0)
        return NULL;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "add(worker, block_hashes, start, end, now)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), end = PyLong_AsSsize_t(args[3]);
    double now = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (start < 0)
        return PyErr_Format(PyExc_ValueError, "start: must be >= 0 (got %zd)", start);
    PyObject *seq = PySequence_Fast(args[1], "block_hashes: expected a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (end > n)
        end = n;
    if (self->ttl_s == 0 || start >= end) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    PyObject *worker = args[0];
    Py_hash_t khash = PyObject_Hash(items[start]);
    if (khash == -1 || PyObject_Hash(worker) == -1) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t r = rec_of(self, worker);
    if (r == -2 || (r == -1 && (r = rec_new(self, worker)) < 0)) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t m = end - start;
    Sent *s = malloc(sizeof(Sent) + (size_t)m * sizeof(PyObject *));
    int pushed = s == NULL ? (PyErr_NoMemory(), -1) : fifo_push(self, s);
    if (pushed < 0) {
        free(s);
        if (self->recs[r].count == 0) { /* the record made for it: nothing keyed there */
            self->free_recs[self->nfree++] = r;
            PyObject *type, *value, *trace;
            PyErr_Fetch(&type, &value, &trace);
            if (PyDict_DelItem(self->workers, worker) < 0)
                PyErr_Clear();
            PyErr_Restore(type, value, trace);
        }
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        s->hashes[i] = Py_NewRef(items[start + i]);
    Py_DECREF(seq);
    s->worker = Py_NewRef(worker);
    s->start = start;
    s->end = end;
    s->held = m;
    s->expiry = now + self->ttl_s;
    s->khash = khash;
    s->rec = r;
    s->keyed = 1;
    WorkerRec *rec = &self->recs[r];
    s->wprev = NULL;
    s->wnext = rec->head;
    if (rec->head != NULL)
        rec->head->wprev = s;
    rec->head = s;
    rec->count++;
    chain_append(bucket_of(self, khash), s);
    self->keyed++;
    if ((size_t)self->keyed > 2 * (self->mask + 1) && grow_buckets(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Tracker_announced(Tracker *self, PyObject *worker) {
    if (ready(self) < 0)
        return NULL;
    int has = PyDict_Contains(self->workers, worker);
    if (has < 0)
        return NULL;
    return PyBool_FromLong(has);
}

static PyObject *Tracker_expire(Tracker *self, PyObject *arg) {
    if (ready(self) < 0)
        return NULL;
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (expire_core(self, now) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* depths(block_hashes, now, known=None): see PyInFlightPrefixes.depths. */
static PyObject *Tracker_depths(Tracker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (ready(self) < 0)
        return NULL;
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "depths(block_hashes, now, known=None)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[1]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *known = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    if (known != NULL && !PyDict_Check(known)) {
        PyErr_SetString(PyExc_TypeError, "depths: known must be a dict or None");
        return NULL;
    }
    if (expire_core(self, now) < 0)
        return NULL;
    PyObject *depth = PyDict_New();
    if (depth == NULL)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "block_hashes: expected a sequence");
    if (seq == NULL)
        goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (self->keyed == 0 || n == 0) {
        Py_DECREF(seq);
        return depth;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    int any_known = known != NULL && PyDict_GET_SIZE(known) > 0;
    Py_hash_t h = PyObject_Hash(items[0]);
    if (h == -1)
        goto fail;
    for (Sent *s = *bucket_of(self, h); s != NULL; s = s->chain) {
        if (s->khash != h)
            continue;
        int eq = same(s->hashes[0], items[0]);
        if (eq < 0)
            goto fail;
        if (!eq)
            continue;
        if (any_known) {
            PyObject *held = PyDict_GetItemWithError(known, s->worker);
            if (held == NULL && PyErr_Occurred())
                goto fail;
            int truthy = held == NULL ? 0 : PyObject_IsTrue(held);
            if (truthy < 0)
                goto fail;
            if (truthy)
                continue;
        }
        if (deepen(depth, s, items, n) < 0)
            goto fail;
    }
    if (any_known) {
        PyObject *worker, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(known, &pos, &worker, &value)) {
            Py_ssize_t start = PyLong_AsSsize_t(value);
            if (start == -1 && PyErr_Occurred())
                goto fail;
            if (start <= 0 || start >= n)
                continue;
            Py_hash_t hk = PyObject_Hash(items[start]);
            if (hk == -1)
                goto fail;
            for (Sent *s = *bucket_of(self, hk); s != NULL; s = s->chain) {
                if (s->khash != hk || s->start != start)
                    continue;
                int eq = same(s->hashes[0], items[start]);
                if (eq > 0)
                    eq = same(s->worker, worker);
                if (eq < 0)
                    goto fail;
                if (eq && deepen(depth, s, items, n) < 0)
                    goto fail;
            }
        }
    }
    Py_DECREF(seq);
    return depth;
fail:
    Py_XDECREF(seq);
    Py_DECREF(depth);
    return NULL;
}

/* discard(worker, block_hashes): see PyInFlightPrefixes.discard. */
static PyObject *Tracker_discard(Tracker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (ready(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "discard(worker, block_hashes)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "block_hashes: expected a sequence");
    if (seq == NULL)
        return NULL;
    int rc = end_where(self, args[0], PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), 0);
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Tracker_forget_worker(Tracker *self, PyObject *worker) {
    if (ready(self) < 0)
        return NULL;
    if (end_where(self, worker, NULL, 0, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Tracker_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Tracker_add, METH_FASTCALL, "worker will hold block_hashes[start:end]."},
    {"announced", (PyCFunction)Tracker_announced, METH_O, "whether worker has an announcement keyed."},
    {"expire", (PyCFunction)Tracker_expire, METH_O, "drop the announcements whose expiry has passed."},
    {"depths", (PyCFunction)(void (*)(void))Tracker_depths, METH_FASTCALL, "per worker, the leading blocks it will hold."},
    {"discard", (PyCFunction)(void (*)(void))Tracker_discard, METH_FASTCALL, "worker reported these blocks."},
    {"forget_worker", (PyCFunction)Tracker_forget_worker, METH_O, "drop every announcement of worker."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Tracker_members[] = {
    {"ttl_s", T_DOUBLE, offsetof(Tracker, ttl_s), READONLY, "how long an announcement lasts"},
    {NULL, 0, 0, 0, NULL},
};

static PyNumberMethods Tracker_as_number = {.nb_bool = (inquiry)Tracker_bool};
static PySequenceMethods Tracker_as_sequence = {.sq_length = (lenfunc)Tracker_len};

static PyTypeObject TrackerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine.routing._inflight.InFlightPrefixes",
    .tp_doc = "Announcements 'worker w will hold blocks [start, end) of this prompt', with an expiry: "
              "see engine/routing/inflight.py.",
    .tp_basicsize = sizeof(Tracker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tracker_init,
    .tp_dealloc = (destructor)Tracker_dealloc,
    .tp_methods = Tracker_methods,
    .tp_members = Tracker_members,
    .tp_as_number = &Tracker_as_number,
    .tp_as_sequence = &Tracker_as_sequence,
};

static struct PyModuleDef inflight_module = {
    PyModuleDef_HEAD_INIT, .m_name = "engine.routing._inflight",
    .m_doc = "The router's in-flight prefixes, compiled (engine/routing/inflight.py is the reference).", .m_size = -1,
};

PyMODINIT_FUNC PyInit__inflight(void) {
    if (PyType_Ready(&TrackerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&inflight_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TrackerType);
    if (PyModule_AddObject(m, "InFlightPrefixes", (PyObject *)&TrackerType) < 0) {
        Py_DECREF(&TrackerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
