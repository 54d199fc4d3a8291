/* The routing policy's load book, compiled: the same state and results as ``PyLoadBook`` in
 * engine/routing/load.py (that module's docstrings state every rule; this file follows them
 * operation by operation, so the floating-point results are bit-identical, and draws the load
 * order's tie-breaking numbers from a ``random.Random(seed)`` like ``LoadOrder``).
 *
 * One record per worker holds its time-averaged queue (value, average, time of the last change),
 * its decayed work (value, time) and its live load-order key; a dict maps each worker object to
 * its record. The load order is a binary heap of keys (cost, work rank, draw, counter) holding
 * each worker's live key once (a record knows its key's position, so a new key moves it in place:
 * ``LoadOrder`` pushes a new entry and skips the stale ones, which orders the live keys alike,
 * as the keys are distinct); the least few are read by a best-first walk down the heap, which
 * leaves it untouched. The book also keeps the per-worker ``queued`` and ``load_cost`` dicts (the
 * policy reads them) and the sum of the queues. Built at install time by setup.py; optional.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject *worker;           /* owned; NULL: the record is free */
    double s_value, s_avg, s_at; /* SmoothedQueues: the queue, its average, when it changed */
    double w_value, w_at;       /* DecayedWork: the work, when it changed */
    double cost, rank, draw;    /* the live load-order key */
    uint64_t counter;           /* the live entry's counter */
    int has_entry;
    Py_ssize_t pos;             /* the live entry's position in the heap (while has_entry) */
} Rec;

typedef struct {
    double cost, rank, draw;
    uint64_t counter;
    Py_ssize_t rec;
} Entry;

typedef struct {
    PyObject_HEAD
    int smoothed;      /* 0: no time-averaged queues (load_halflife_s == 0) */
    double s_half, w_half;
    /* ``Knobs``: the guards' ratios and slack, the work per request, the anchor credit */
    double imbalance_ratio, imbalance_slack, sustained_ratio, work_ratio, request_work, anchor;
    double w_queued, w_running, w_used; /* the load cost's weights (``report``) */
    double promote_seconds, w_miss; /* a host-tier hit token's price (``promote_load``) */
    Py_ssize_t extra_probes; /* ``Knobs.extra_probes`` */
    PyObject *load_cost, *queued; /* dicts: worker -> load cost, worker -> queued tokens */
    double queued_sum;  /* the sum of ``queued`` */
    PyObject *loads;    /* the router's load copies (dict, the policy's): ``assign`` updates them */
    PyObject *randrange; /* the policy's seeded ``rng.randrange`` (ties) */
    PyObject *decision_type; /* ``engine.routing.types.Decision`` */
    double s_now;      /* SmoothedQueues.now */
    double st_value, st_avg, st_at; /* the total queue's average */
    double w_now;      /* DecayedWork.now */
    double wt_value, wt_at; /* the total work */
    Py_ssize_t count;  /* workers tracked */
    Rec *recs;
    Py_ssize_t nrecs, caprecs;
    Py_ssize_t *free_recs;
    Py_ssize_t nfree;
    PyObject *index;   /* dict: worker -> record number (int) */
    Entry *heap;
    Py_ssize_t nheap, capheap;
    uint64_t next_counter;
    PyObject *draw;    /* random.Random(seed).random */
    /* ``scan``'s results, kept between calls and emptied at the start of each (no containers
     * made per decision): the argmin's ties, the pending holders, the holders over their share */
    PyObject *scan_best, *scan_deferred, *scan_spread;
} Book;

/* -- the averages (``_Average`` and ``DecayedWork._at``) ------------------------------------- */

static inline double avg_get(double value, double avg, double at, double now, double half) {
    if (now <= at)
        return avg;
    return value + (avg - value) * pow(0.5, (now - at) / half);
}

static inline void avg_set(double *value, double *avg, double *at, double new_value, double now, double half) {
    *avg = avg_get(*value, *avg, *at, now, half);
    *at = (now > *at) ? now : *at;
    *value = new_value;
}

static inline double decayed(double value, double at, double now, double half) {
    if (now <= at)
        return value;
    return value * pow(0.5, (now - at) / half);
}

static inline double rank_of(const Book *b, const Rec *r) {
    return r->w_value > 0 ? log2(r->w_value) + r->w_at / b->w_half : -INFINITY;
}

/* -- records --------------------------------------------------------------------------------- */

static Py_ssize_t find(Book *b, PyObject *worker) {
    PyObject *num = PyDict_GetItemWithError(b->index, worker);
    if (num == NULL)
        return PyErr_Occurred() ? -2 : -1;
    return PyLong_AsSsize_t(num);
}

static Py_ssize_t require(Book *b, PyObject *worker) {
    Py_ssize_t i = find(b, worker);
    if (i == -1)
        PyErr_SetObject(PyExc_KeyError, worker);
    return i;
}

/* -- the load order ------------------------------------------------------------------------------ */

static inline int less(const Entry *a, const Entry *b) {
    if (a->cost != b->cost)
        return a->cost < b->cost;
    if (a->rank != b->rank)
        return a->rank < b->rank;
    if (a->draw != b->draw)
        return a->draw < b->draw;
    return a->counter < b->counter;
}

/* Put ``e`` at heap position i, telling its record. */
static inline void heap_place(Book *b, Py_ssize_t i, Entry e) {
    b->heap[i] = e;
    b->recs[e.rec].pos = i;
}

/* Move the entry at i up, then down, to where the heap order puts it. */
static void heap_fix(Book *b, Py_ssize_t i) {
    Entry *heap = b->heap;
    Entry item = heap[i];
    while (i > 0) {
        Py_ssize_t parent = (i - 1) >> 1;
        if (!less(&item, &heap[parent]))
            break;
        heap_place(b, i, heap[parent]);
        i = parent;
    }
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= b->nheap)
            break;
        if (child + 1 < b->nheap && less(&heap[child + 1], &heap[child]))
            child++;
        if (!less(&heap[child], &item))
            break;
        heap_place(b, i, heap[child]);
        i = child;
    }
    heap_place(b, i, item);
}

static int heap_push(Book *b, Entry e) {
    if (b->nheap == b->capheap) {
        Py_ssize_t cap = b->capheap ? 2 * b->capheap : 64;
        Entry *grown = PyMem_Realloc(b->heap, (size_t)cap * sizeof(Entry));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->heap = grown;
        b->capheap = cap;
    }
    heap_place(b, b->nheap++, e);
    heap_fix(b, b->nheap - 1);
    return 0;
}

/* Take the entry at i out of the heap. */
static void heap_remove(Book *b, Py_ssize_t i) {
    b->nheap--;
    if (i < b->nheap) {
        heap_place(b, i, b->heap[b->nheap]);
        heap_fix(b, i);
    }
}

/* ``LoadOrder.set``: a new key for record i (unless it equals the live one). */
static int order_set(Book *b, Py_ssize_t i, double cost, double rank) {
    Rec *r = &b->recs[i];
    if (r->has_entry && r->cost == cost && r->rank == rank)
        return 0;
    PyObject *drawn = PyObject_CallNoArgs(b->draw);
    if (drawn == NULL)
        return -1;
    double draw = PyFloat_AsDouble(drawn);
    Py_DECREF(drawn);
    if (draw == -1.0 && PyErr_Occurred())
        return -1;
    r = &b->recs[i];
    r->cost = cost;
    r->rank = rank;
    r->draw = draw;
    r->counter = b->next_counter++;
    Entry e = {cost, rank, draw, r->counter, i};
    if (r->has_entry) { /* the key moves in place */
        b->heap[r->pos] = e;
        heap_fix(b, r->pos);
        return 0;
    }
    if (heap_push(b, e) < 0)
        return -1;
    b->recs[i].has_entry = 1;
    return 0;
}

static double dict_double(PyObject *dict, PyObject *key, int *failed) {
    PyObject *value = PyDict_GetItemWithError(dict, key);
    if (value == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        *failed = 1;
        return 0.0;
    }
    double x = PyFloat_AsDouble(value);
    if (x == -1.0 && PyErr_Occurred())
        *failed = 1;
    return x;
}

#define SMALL_FRONTIER 64

/* ``LoadOrder.first``: the least live worker not in ``exclude`` whose queue is within ``limit``,
 * among the ``probes`` smallest live entries; *refused: a smaller one was over the limit.
 * Returns a borrowed worker, NULL with no error when none, NULL with an error on failure.
 * The entries are met in increasing order by a best-first walk down the heap: a frontier of
 * positions (itself a small heap, at most one more than the entries met) starts at the root,
 * and each position taken from it adds its children. */
static PyObject *order_first(Book *b, PyObject *exclude, PyObject *queued, double limit, Py_ssize_t probes,
                             int *refused) {
    PyObject *found = NULL;
    Py_ssize_t small[SMALL_FRONTIER], *frontier = small, nfront = 0, met = 0;
    int failed = 0;
    if (probes <= 0 || b->nheap == 0)
        return NULL;
    if (probes + 2 > SMALL_FRONTIER) {
        frontier = PyMem_Malloc((size_t)(probes + 2) * sizeof(Py_ssize_t));
        if (frontier == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
    }
    const Entry *heap = b->heap;
    frontier[nfront++] = 0;
    while (nfront > 0 && met < probes) {
        Py_ssize_t at = frontier[0]; /* the least position of the frontier: take it out */
        Py_ssize_t last = frontier[--nfront], i = 0;
        for (;;) {
            Py_ssize_t child = 2 * i + 1;
            if (child >= nfront)
                break;
            if (child + 1 < nfront && less(&heap[frontier[child + 1]], &heap[frontier[child]]))
                child++;
            if (!less(&heap[frontier[child]], &heap[last]))
                break;
            frontier[i] = frontier[child];
            i = child;
        }
        if (nfront > 0)
            frontier[i] = last;
        for (Py_ssize_t c = 2 * at + 1; c <= 2 * at + 2 && c < b->nheap; c++) { /* its children join */
            Py_ssize_t j = nfront++;
            while (j > 0 && less(&heap[c], &heap[frontier[(j - 1) >> 1]])) {
                frontier[j] = frontier[(j - 1) >> 1];
                j = (j - 1) >> 1;
            }
            frontier[j] = c;
        }
        met++;
        PyObject *worker = b->recs[heap[at].rec].worker;
        int excluded = PyDict_Contains(exclude, worker);
        if (excluded < 0) {
            failed = 1;
            break;
        }
        if (excluded)
            continue;
        double q = dict_double(queued, worker, &failed);
        if (failed)
            break;
        if (!(q <= limit)) {
            *refused = 1;
            continue;
        }
        found = worker;
        break;
    }
    if (frontier != small)
        PyMem_Free(frontier);
    return failed ? NULL : found;
}

/* -- the type ------------------------------------------------------------------------------------ */

static int Book_init(Book *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"load_halflife_s", "work_halflife_s", "seed", "imbalance_ratio",
                             "imbalance_slack_tokens", "sustained_imbalance_ratio", "work_imbalance_ratio",
                             "request_work_tokens", "anchor_credit", "w_queued", "w_running", "w_used",
                             "promote_seconds", "w_miss", "extra_probes", "loads", "randrange", NULL};
    double load_half, work_half;
    PyObject *seed, *loads, *randrange;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ddOdddddddddddnO!O", kwlist, &load_half, &work_half, &seed,
                                     &self->imbalance_ratio, &self->imbalance_slack, &self->sustained_ratio,
                                     &self->work_ratio, &self->request_work, &self->anchor, &self->w_queued,
                                     &self->w_running, &self->w_used, &self->promote_seconds, &self->w_miss,
                                     &self->extra_probes, &PyDict_Type, &loads,
                                     &randrange))
        return -1;
    if (!PyCallable_Check(randrange)) {
        PyErr_SetString(PyExc_TypeError, "randrange: must be callable");
        return -1;
    }
    if (!(work_half > 0)) {
        PyObject *got = PyFloat_FromDouble(work_half);
        if (got != NULL) {
            PyErr_Format(PyExc_ValueError, "work_halflife_s: must be > 0 (got %R)", got);
            Py_DECREF(got);
        }
        return -1;
    }
    if (self->index != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LoadBook: already initialised");
        return -1;
    }
    self->smoothed = load_half > 0;
    self->s_half = load_half;
    self->w_half = work_half;
    self->index = PyDict_New();
    self->load_cost = PyDict_New();
    self->queued = PyDict_New();
    if (self->index == NULL || self->load_cost == NULL || self->queued == NULL)
        return -1;
    self->loads = Py_NewRef(loads);
    self->randrange = Py_NewRef(randrange);
    PyObject *types = PyImport_ImportModule("engine.routing.types");
    if (types == NULL)
        return -1;
    self->decision_type = PyObject_GetAttrString(types, "Decision");
    Py_DECREF(types);
    if (self->decision_type == NULL)
        return -1;
    if (!PyType_Check(self->decision_type)) {
        PyErr_SetString(PyExc_TypeError, "engine.routing.types.Decision: not a type");
        return -1;
    }
    PyObject *random = PyImport_ImportModule("random");
    if (random == NULL)
        return -1;
    PyObject *rng = PyObject_CallMethod(random, "Random", "O", seed);
    Py_DECREF(random);
    if (rng == NULL)
        return -1;
    self->draw = PyObject_GetAttrString(rng, "random");
    Py_DECREF(rng);
    self->scan_best = PyList_New(0);
    self->scan_deferred = PyList_New(0);
    self->scan_spread = PySet_New(NULL);
    return self->draw == NULL || self->scan_best == NULL || self->scan_deferred == NULL || self->scan_spread == NULL
               ? -1
               : 0;
}

static void Book_dealloc(Book *self) {
    for (Py_ssize_t k = 0; k < self->nrecs; k++)
        Py_XDECREF(self->recs[k].worker);
    PyMem_Free(self->recs);
    PyMem_Free(self->free_recs);
    PyMem_Free(self->heap);
    Py_XDECREF(self->index);
    Py_XDECREF(self->load_cost);
    Py_XDECREF(self->queued);
    Py_XDECREF(self->loads);
    Py_XDECREF(self->randrange);
    Py_XDECREF(self->decision_type);
    Py_XDECREF(self->draw);
    Py_XDECREF(self->scan_best);
    Py_XDECREF(self->scan_deferred);
    Py_XDECREF(self->scan_spread);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Book_add(Book *self, PyObject *worker) {
    Py_ssize_t i = find(self, worker);
    if (i == -2)
        return NULL;
    if (i >= 0) {
        PyErr_Format(PyExc_ValueError, "worker %R is already in the load book", worker);
        return NULL;
    }
    if (self->nfree > 0) {
        i = self->free_recs[--self->nfree];
    } else {
        if (self->nrecs == self->caprecs) {
            Py_ssize_t cap = self->caprecs ? 2 * self->caprecs : 64;
            Rec *grown = PyMem_Realloc(self->recs, (size_t)cap * sizeof(Rec));
            Py_ssize_t *free_grown = PyMem_Realloc(self->free_recs, (size_t)cap * sizeof(Py_ssize_t));
            if (grown != NULL)
                self->recs = grown;
            if (free_grown != NULL)
                self->free_recs = free_grown;
            if (grown == NULL || free_grown == NULL)
                return PyErr_NoMemory();
            self->caprecs = cap;
        }
        i = self->nrecs++;
    }
    PyObject *num = PyLong_FromSsize_t(i), *zero = PyFloat_FromDouble(0.0);
    if (num == NULL || zero == NULL || PyDict_SetItem(self->index, worker, num) < 0) {
        Py_XDECREF(num);
        Py_XDECREF(zero);
        self->free_recs[self->nfree++] = i;
        return NULL;
    }
    Py_DECREF(num);
    if (PyDict_SetItem(self->load_cost, worker, zero) < 0 || PyDict_SetItem(self->queued, worker, zero) < 0) {
        Py_DECREF(zero);
        return NULL;
    }
    Py_DECREF(zero);
    Rec *r = &self->recs[i];
    memset(r, 0, sizeof(Rec));
    Py_INCREF(worker);
    r->worker = worker;
    r->s_at = self->s_now;
    r->w_at = self->w_now;
    self->count++;
    if (order_set(self, i, 0.0, rank_of(self, r)) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Book_remove(Book *self, PyObject *worker) {
    Py_ssize_t i = find(self, worker);
    if (i == -2)
        return NULL;
    if (i == -1)
        Py_RETURN_NONE;
    int failed = 0;
    double left_queued = dict_double(self->queued, worker, &failed);
    if (failed || PyDict_DelItem(self->index, worker) < 0 || PyDict_DelItem(self->queued, worker) < 0 ||
        PyDict_DelItem(self->load_cost, worker) < 0)
        return NULL;
    self->queued_sum -= left_queued;
    Rec *r = &self->recs[i];
    if (self->smoothed) { /* ``SmoothedQueues.remove`` */
        double total = self->st_value - r->s_value;
        avg_set(&self->st_value, &self->st_avg, &self->st_at, total, self->s_now, self->s_half);
        self->st_avg -= avg_get(r->s_value, r->s_avg, r->s_at, self->s_now, self->s_half);
    }
    /* ``DecayedWork.remove`` */
    double left = decayed(self->wt_value, self->wt_at, self->w_now, self->w_half) -
                  decayed(r->w_value, r->w_at, self->w_now, self->w_half);
    self->wt_value = left > 0.0 ? left : 0.0;
    self->wt_at = self->w_now;
    Py_CLEAR(r->worker);
    if (r->has_entry)
        heap_remove(self, r->pos);
    r->has_entry = 0;
    self->free_recs[self->nfree++] = i;
    self->count--;
    Py_RETURN_NONE;
}

static PyObject *Book_advance(Book *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (self->smoothed && now > self->s_now)
        self->s_now = now;
    Py_RETURN_NONE;
}

/* ``PyLoadBook.set_load`` on record i. */
static int set_load_core(Book *self, Py_ssize_t i, double queued, double cost) {
    Rec *r = &self->recs[i];
    if (self->smoothed) { /* ``SmoothedQueues.set`` without a time: at ``now`` */
        double now = self->s_now;
        double total = self->st_value + queued - r->s_value;
        avg_set(&self->st_value, &self->st_avg, &self->st_at, total, now, self->s_half);
        avg_set(&r->s_value, &r->s_avg, &r->s_at, queued, now, self->s_half);
    }
    return order_set(self, i, cost, rank_of(self, r));
}

/* ``DecayedWork.add`` on record i. */
static void add_work_core(Book *self, Py_ssize_t i, double amount, double now) {
    Rec *r = &self->recs[i];
    if (!(now >= self->w_now))
        now = self->w_now;
    self->w_now = now;
    r->w_value = decayed(r->w_value, r->w_at, now, self->w_half) + amount;
    r->w_at = now;
    self->wt_value = decayed(self->wt_value, self->wt_at, now, self->w_half) + amount;
    self->wt_at = now;
}

static PyObject *Book_add_work(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add_work(worker, amount, now)");
        return NULL;
    }
    double amount = PyFloat_AsDouble(args[1]);
    if (amount == -1.0 && PyErr_Occurred())
        return NULL;
    double now = PyFloat_AsDouble(args[2]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    Py_ssize_t i = find(self, args[0]);
    if (i == -2)
        return NULL;
    if (i >= 0)
        add_work_core(self, i, amount, now);
    Py_RETURN_NONE;
}

static PyObject *str_queued_tokens, *str_running_requests, *str_used_block_fraction,
    *str_promote_s_per_token; /* interned at import */
/* ``Decision``'s fields in declaration order (engine/routing/types.py), interned at import */
static const char *const decision_fields[9] = {"prefill_worker", "decode_worker", "predicted_hit",
                                               "num_tokens",     "reason",        "pin_id",
                                               "predicted_decode_hit", "best_hit", "predicted_host_hit"};
static PyObject *str_decision[9];
static PyObject *str_reasons[4]; /* "cost", "guard", "prefix", "inflight": ``REASON_*`` */
enum { REASON_COST, REASON_GUARD, REASON_PREFIX, REASON_INFLIGHT };

/* ``report``: see ``PyLoadBook.report``, operation by operation. */
static int report_core(Book *self, Py_ssize_t i, PyObject *worker, PyObject *load) {
    PyObject *q_obj = PyObject_GetAttr(load, str_queued_tokens), *r_obj = NULL, *u_obj = NULL, *cost_obj = NULL;
    int rc = -1, failed = 0;
    if (q_obj == NULL || (r_obj = PyObject_GetAttr(load, str_running_requests)) == NULL ||
        (u_obj = PyObject_GetAttr(load, str_used_block_fraction)) == NULL)
        goto done;
    double q = PyFloat_AsDouble(q_obj), r = PyFloat_AsDouble(r_obj), u = PyFloat_AsDouble(u_obj);
    if (PyErr_Occurred())
        goto done;
    double cost = self->w_queued * q + self->w_running * r + self->w_used * u;
    double old = dict_double(self->queued, worker, &failed);
    if (failed)
        goto done;
    if ((cost_obj = PyFloat_FromDouble(cost)) == NULL || PyDict_SetItem(self->queued, worker, q_obj) < 0 ||
        PyDict_SetItem(self->load_cost, worker, cost_obj) < 0)
        goto done;
    self->queued_sum += q - old;
    rc = set_load_core(self, i, q, cost);
done:
    Py_XDECREF(q_obj);
    Py_XDECREF(r_obj);
    Py_XDECREF(u_obj);
    Py_XDECREF(cost_obj);
    return rc;
}

static PyObject *Book_report(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "report(worker, load)");
        return NULL;
    }
    Py_ssize_t i = require(self, args[0]);
    if (i < 0 || report_core(self, i, args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ``assign``: see ``PyLoadBook.assign``, operation by operation: the work, the load copy's queued
 * tokens and running requests, then ``report``. */
static int assign_core(Book *self, PyObject *worker, PyObject *uncached, double now) {
    double amount = PyFloat_AsDouble(uncached);
    if (amount == -1.0 && PyErr_Occurred())
        return -1;
    Py_ssize_t i = require(self, worker);
    if (i < 0)
        return -1;
    PyObject *load = PyDict_GetItemWithError(self->loads, worker); /* borrowed */
    if (load == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, worker);
        return -1;
    }
    Py_INCREF(load);
    int rc = -1;
    PyObject *before = NULL, *after = NULL, *running = NULL, *more = NULL;
    PyObject *one = PyLong_FromLong(1);
    add_work_core(self, i, amount + self->request_work, now);
    if (one == NULL || (before = PyObject_GetAttr(load, str_queued_tokens)) == NULL ||
        (after = PyNumber_Add(before, uncached)) == NULL || PyObject_SetAttr(load, str_queued_tokens, after) < 0)
        goto done;
    if ((running = PyObject_GetAttr(load, str_running_requests)) == NULL ||
        (more = PyNumber_Add(running, one)) == NULL || PyObject_SetAttr(load, str_running_requests, more) < 0)
        goto done;
    rc = report_core(self, i, worker, load);
done:
    Py_DECREF(load);
    Py_XDECREF(one);
    Py_XDECREF(before);
    Py_XDECREF(after);
    Py_XDECREF(running);
    Py_XDECREF(more);
    return rc;
}

static PyObject *Book_assign(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "assign(worker, uncached, now)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[2]);
    if ((now == -1.0 && PyErr_Occurred()) || assign_core(self, args[0], args[1], now) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int worker_and_now(Book *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t *i, double *now) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (worker, now)");
        return -1;
    }
    *now = PyFloat_AsDouble(args[1]);
    if (*now == -1.0 && PyErr_Occurred())
        return -1;
    *i = require(self, args[0]);
    return *i < 0 ? -1 : 0;
}

static PyObject *Book_smoothed(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t i;
    double now;
    if (worker_and_now(self, args, nargs, &i, &now) < 0)
        return NULL;
    if (!self->smoothed)
        return PyFloat_FromDouble(0.0);
    Rec *r = &self->recs[i];
    return PyFloat_FromDouble(avg_get(r->s_value, r->s_avg, r->s_at, now, self->s_half));
}

static PyObject *Book_work(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t i;
    double now;
    if (worker_and_now(self, args, nargs, &i, &now) < 0)
        return NULL;
    Rec *r = &self->recs[i];
    return PyFloat_FromDouble(decayed(r->w_value, r->w_at, now, self->w_half));
}

static PyObject *Book_smoothed_mean(Book *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (!self->smoothed)
        return PyFloat_FromDouble(0.0);
    double total = avg_get(self->st_value, self->st_avg, self->st_at, now, self->s_half);
    return PyFloat_FromDouble(total / (double)(self->count > 1 ? self->count : 1));
}

static PyObject *Book_work_mean(Book *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    double total = decayed(self->wt_value, self->wt_at, now, self->w_half);
    return PyFloat_FromDouble(total / (double)(self->count > 1 ? self->count : 1));
}

static inline int is_over(const Book *self, const Rec *r, double now, double slow, double cap) {
    return (self->smoothed && avg_get(r->s_value, r->s_avg, r->s_at, now, self->s_half) > slow) ||
           decayed(r->w_value, r->w_at, now, self->w_half) > cap;
}

static PyObject *Book_over(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "over(worker, now, slow, cap)");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[1]), slow = PyFloat_AsDouble(args[2]), cap = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t i = require(self, args[0]);
    if (i < 0)
        return NULL;
    return PyBool_FromLong(is_over(self, &self->recs[i], now, slow, cap));
}

/* the mean of ``queued`` over every worker (``PyLoadBook.thresholds`` with no ``mean_queued``) */
static inline double own_mean_queued(const Book *self) {
    return self->queued_sum / (double)(self->count > 1 ? self->count : 1);
}

/* ``thresholds``: see ``PyLoadBook.thresholds``. ``mean_smoothed`` / ``mean_work`` NULL: the
 * book's own means over every worker. */
static void thresholds_of(const Book *self, double n, double now, double mean_queued, const double *mean_smoothed,
                          const double *mean_work, double *limit, double *slow, double *cap) {
    double count = (double)(self->count > 1 ? self->count : 1);
    *limit = self->imbalance_ratio * mean_queued + n + self->imbalance_slack;
    *slow = INFINITY;
    *cap = INFINITY;
    if (self->smoothed) {
        double mean = mean_smoothed == NULL
                          ? avg_get(self->st_value, self->st_avg, self->st_at, now, self->s_half) / count
                          : *mean_smoothed;
        *slow = self->sustained_ratio * mean + n;
    }
    if (self->work_ratio != 0.0) {
        double mean = mean_work == NULL ? decayed(self->wt_value, self->wt_at, now, self->w_half) / count : *mean_work;
        *cap = self->work_ratio * mean + n + self->request_work;
    }
}

static PyObject *Book_thresholds(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "thresholds(num_tokens, now, mean_queued, mean_smoothed, mean_work)");
        return NULL;
    }
    double n = PyFloat_AsDouble(args[0]), now = PyFloat_AsDouble(args[1]);
    double mean_queued = args[2] == Py_None ? own_mean_queued(self) : PyFloat_AsDouble(args[2]);
    double mean_smoothed = args[3] == Py_None ? 0.0 : PyFloat_AsDouble(args[3]);
    double mean_work = args[4] == Py_None ? 0.0 : PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred())
        return NULL;
    double limit, slow, cap;
    thresholds_of(self, n, now, mean_queued, args[3] == Py_None ? NULL : &mean_smoothed,
                  args[4] == Py_None ? NULL : &mean_work, &limit, &slow, &cap);
    return Py_BuildValue("(ddd)", limit, slow, cap);
}

/* ``promote_load``: see ``PyLoadBook.promote_load``, operation by operation (``min`` and ``max``
 * keep their first argument on ties). Sets *failed on an error. */
static double promote_load_of(const Book *self, PyObject *worker, int *failed) {
    PyObject *load = PyDict_GetItemWithError(self->loads, worker); /* borrowed */
    if (load == NULL) {
        if (PyErr_Occurred())
            *failed = 1;
        return 0.0;
    }
    PyObject *p_obj = PyObject_GetAttr(load, str_promote_s_per_token);
    if (p_obj == NULL) {
        *failed = 1;
        return 0.0;
    }
    double p = PyFloat_AsDouble(p_obj);
    Py_DECREF(p_obj);
    if (p == -1.0 && PyErr_Occurred()) {
        *failed = 1;
        return 0.0;
    }
    if (p <= 0)
        return 0.0;
    double w_miss = 1e-9 > self->w_miss ? 1e-9 : self->w_miss;
    double share = self->promote_seconds * p / w_miss;
    return share < 1.0 ? share : 1.0;
}

static PyObject *Book_promote_load(Book *self, PyObject *worker) {
    int failed = 0;
    double share = promote_load_of(self, worker, &failed);
    return failed ? NULL : PyFloat_FromDouble(share);
}

/* ``credit``: see ``PyLoadBook.credit``. Works on Python numbers as it does, so an int hit stays
 * an int where nothing changes it; a host-tier deduction is the double arithmetic Python does on
 * an int or a float (``tokens * promote_load``, then the credit less that). ``shared``, ``host``,
 * ``ahead``: dicts or NULL. */
static PyObject *credit_of(const Book *self, PyObject *hits, PyObject *shared, PyObject *host, PyObject *ahead) {
    PyObject *credit = PyDict_Copy(hits);
    if (credit == NULL)
        return NULL;
    PyObject *worker, *value;
    Py_ssize_t pos = 0;
    if (shared != NULL) {
        while (PyDict_Next(shared, &pos, &worker, &value)) {
            PyObject *hit = PyDict_GetItemWithError(hits, worker);
            if (hit == NULL && PyErr_Occurred())
                goto error;
            double h = hit == NULL ? 0.0 : PyFloat_AsDouble(hit);
            double depth = PyFloat_AsDouble(value);
            if (PyErr_Occurred())
                goto error;
            /* hit + c * (depth - hit), each operand a double as Python converts it */
            PyObject *got = PyFloat_FromDouble(h + self->anchor * (depth - h));
            if (got == NULL || PyDict_SetItem(credit, worker, got) < 0) {
                Py_XDECREF(got);
                goto error;
            }
            Py_DECREF(got);
        }
    }
    if (host != NULL) {
        pos = 0;
        while (PyDict_Next(host, &pos, &worker, &value)) {
            PyObject *have = PyDict_GetItemWithError(credit, worker);
            if (have == NULL) {
                if (PyErr_Occurred())
                    goto error;
                continue;
            }
            int failed = 0;
            double tokens = PyFloat_AsDouble(value);
            if (tokens == -1.0 && PyErr_Occurred())
                goto error;
            double amount = tokens * promote_load_of(self, worker, &failed);
            double h = failed ? 0.0 : PyFloat_AsDouble(have);
            if (failed || (h == -1.0 && PyErr_Occurred()))
                goto error;
            PyObject *less = PyFloat_FromDouble(h - amount);
            if (less == NULL || PyDict_SetItem(credit, worker, less) < 0) {
                Py_XDECREF(less);
                goto error;
            }
            Py_DECREF(less);
        }
    }
    if (ahead != NULL) {
        pos = 0;
        while (PyDict_Next(ahead, &pos, &worker, &value)) {
            PyObject *have = PyDict_GetItemWithError(credit, worker);
            if (have == NULL && PyErr_Occurred())
                goto error;
            int more;
            if (have == NULL) {
                PyObject *zero = PyLong_FromLong(0);
                if (zero == NULL)
                    goto error;
                more = PyObject_RichCompareBool(value, zero, Py_GT);
                Py_DECREF(zero);
            } else {
                more = PyObject_RichCompareBool(value, have, Py_GT);
            }
            if (more < 0)
                goto error;
            if (more && PyDict_SetItem(credit, worker, value) < 0)
                goto error;
        }
    }
    return credit;
error:
    Py_DECREF(credit);
    return NULL;
}

static PyObject *dict_or_null(PyObject *o) { return (o != Py_None && PyDict_Check(o)) ? o : NULL; }

static PyObject *Book_credit(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "credit(hits: dict, shared, host, ahead)");
        return NULL;
    }
    return credit_of(self, args[0], dict_or_null(args[1]), dict_or_null(args[2]), dict_or_null(args[3]));
}

/* Fold (worker, cost) into the running argmin: ``load.better``. */
static int fold(PyObject *best, double *best_cost, PyObject *worker, double cost) {
    if (cost < *best_cost - 1e-9) {
        *best_cost = cost;
        if (PyList_SetSlice(best, 0, PyList_GET_SIZE(best), NULL) < 0)
            return -1;
        return PyList_Append(best, worker);
    }
    if (cost <= *best_cost + 1e-9)
        return PyList_Append(best, worker);
    return 0;
}

typedef struct {
    double best_cost;
    PyObject *best, *deferred, *spread; /* the book's scan_* containers (borrowed) */
    int guarded, fresh;
} ScanOut;

/* Empty the book's scan containers (they keep their objects for the next scan). */
static void scan_clear(ScanOut *out) {
    if (out->best != NULL && PyList_GET_SIZE(out->best) > 0)
        (void)PyList_SetSlice(out->best, 0, PyList_GET_SIZE(out->best), NULL);
    if (out->deferred != NULL && PyList_GET_SIZE(out->deferred) > 0)
        (void)PyList_SetSlice(out->deferred, 0, PyList_GET_SIZE(out->deferred), NULL);
    if (out->spread != NULL && PySet_GET_SIZE(out->spread) > 0)
        (void)PySet_Clear(out->spread);
}

/* ``PyLoadBook.scan``; on failure returns -1 with ``out`` cleared. */
static int scan_core(Book *self, PyObject *credit, PyObject *among, double limit, double now, double slow,
                     double cap, double w_uncached, double w_spread, PyObject *pending, Py_ssize_t probes,
                     ScanOut *out) {
    PyObject *load_cost = self->load_cost, *queued = self->queued;
    int among_is_dict = PyDict_Check(among);
    Py_ssize_t pending_size = PyObject_Length(pending);
    if (pending_size < 0)
        return -1;
    int failed = 0, refused = 0;
    out->best_cost = INFINITY;
    out->guarded = out->fresh = 0;
    if (self->scan_best == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LoadBook: __init__ was not called");
        return -1;
    }
    out->best = self->scan_best;
    out->deferred = self->scan_deferred;
    out->spread = self->scan_spread;
    scan_clear(out); /* (empty already unless a scan failed half way) */
    Py_ssize_t pos = 0;
    PyObject *worker, *value;
    while (PyDict_Next(credit, &pos, &worker, &value)) {
        int in = among_is_dict ? PyDict_Contains(among, worker) : PySequence_Contains(among, worker);
        if (in < 0)
            goto error;
        if (!in)
            continue;
        double q = dict_double(queued, worker, &failed);
        if (failed)
            goto error;
        if (!(q <= limit)) {
            out->guarded = 1;
            continue;
        }
        double v = PyFloat_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred())
            goto error;
        double weight = w_uncached;
        if (w_spread < w_uncached && v > 0) {
            Py_ssize_t i = require(self, worker);
            if (i < 0)
                goto error;
            if (is_over(self, &self->recs[i], now, slow, cap)) {
                if (PySet_Add(out->spread, worker) < 0)
                    goto error;
                weight = w_spread;
            }
        }
        if (pending_size > 0) {
            int is_pending = PySequence_Contains(pending, worker);
            if (is_pending < 0)
                goto error;
            if (is_pending) {
                if (PyList_Append(out->deferred, worker) < 0)
                    goto error;
                continue;
            }
        }
        double lc = dict_double(load_cost, worker, &failed);
        if (failed)
            goto error;
        double product = weight * v;
        if (fold(out->best, &out->best_cost, worker, lc - product) < 0)
            goto error;
    }
    if (probes >= 0) {
        PyObject *fresh = order_first(self, credit, queued, limit, probes, &refused);
        if (fresh == NULL && PyErr_Occurred())
            goto error;
        out->guarded = out->guarded || refused;
        if (fresh != NULL) {
            out->fresh = 1;
            double rest = dict_double(load_cost, fresh, &failed);
            if (failed || fold(out->best, &out->best_cost, fresh, rest) < 0)
                goto error;
        }
    }
    return 0;
error:
    scan_clear(out);
    return -1;
}

/* ``scan``: see ``PyLoadBook.scan``. */
static PyObject *Book_scan(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "scan(credit, among, limit, now, slow, cap, w_uncached, w_spread, pending, probes)");
        return NULL;
    }
    PyObject *credit = args[0], *among = args[1], *pending = args[8];
    if (!PyDict_CheckExact(credit)) {
        PyErr_SetString(PyExc_TypeError, "scan: credit must be a dict");
        return NULL;
    }
    double limit = PyFloat_AsDouble(args[2]), now = PyFloat_AsDouble(args[3]), slow = PyFloat_AsDouble(args[4]),
           cap = PyFloat_AsDouble(args[5]), w_uncached = PyFloat_AsDouble(args[6]),
           w_spread = PyFloat_AsDouble(args[7]);
    Py_ssize_t probes = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred())
        return NULL;
    ScanOut out;
    if (scan_core(self, credit, among, limit, now, slow, cap, w_uncached, w_spread, pending, probes, &out) < 0)
        return NULL;
    PyObject *result = Py_BuildValue("(dNNNNN)", out.best_cost, PyList_GetSlice(out.best, 0, PyList_GET_SIZE(out.best)),
                                     PyList_GetSlice(out.deferred, 0, PyList_GET_SIZE(out.deferred)),
                                     PySet_New(out.spread), PyBool_FromLong(out.guarded),
                                     PyBool_FromLong(out.fresh));
    scan_clear(&out);
    return result;
}

/* ``choose``: ``RoutingPolicy._pick`` over the whole pool for a request without a pin, in one
 * call: the thresholds, the credit (its host-tier deduction included), the scan, the random
 * tie-break (``randrange``: the policy's ``rng.randrange``) and the reason. Returns 0, having
 * changed nothing, where ``_pick`` has more to do (pending holders to resolve, no least loaded
 * worker in the load order's first entries, nobody allowed): the policy then runs ``_pick``
 * itself. Returns 1 with *chosen (a new reference) and *why (borrowed, interned), and where
 * asked (non-NULL) *hit: ``hits.get(choice, 0)`` and *top: ``max(hits.values(), default=0)``
 * (the first of equal values, as ``max`` keeps it), new references, from the one pass over
 * ``hits`` the reason needs. */
static int choose_core(Book *self, PyObject *const *args, Py_ssize_t nargs, PyObject **chosen, PyObject **why,
                       PyObject **hit_out, PyObject **top_out) {
    PyObject *hits = args[0], *shared = dict_or_null(args[1]), *host = dict_or_null(args[2]);
    PyObject *ahead = dict_or_null(args[3]), *pending = args[4];
    PyObject *randrange = self->randrange;
    if (!PyDict_Check(hits)) {
        PyErr_SetString(PyExc_TypeError, "choose: hits must be a dict");
        return -1;
    }
    double n = PyFloat_AsDouble(args[5]), now = PyFloat_AsDouble(args[6]), w_uncached = PyFloat_AsDouble(args[7]),
           w_spread = PyFloat_AsDouble(args[8]);
    Py_ssize_t extra = self->extra_probes;
    if (PyErr_Occurred())
        return -1;
    int guard = nargs > 9 ? PyObject_IsTrue(args[9]) : 1; /* False: no instantaneous guard */
    if (guard < 0)
        return -1;
    double limit, slow, cap;
    thresholds_of(self, n, now, own_mean_queued(self), NULL, NULL, &limit, &slow, &cap);
    if (!guard)
        limit = Py_HUGE_VAL;
    PyObject *credit = credit_of(self, hits, shared, host, ahead);
    if (credit == NULL)
        return -1;
    ScanOut out;
    PyObject *choice = NULL;
    int rc = scan_core(self, credit, self->load_cost, limit, now, slow, cap, w_uncached, w_spread, pending,
                       PyDict_GET_SIZE(credit) + extra, &out);
    Py_DECREF(credit);
    if (rc < 0)
        return -1;
    Py_ssize_t size = PyList_GET_SIZE(out.best);
    if (PyList_GET_SIZE(out.deferred) > 0 || !out.fresh || size == 0) {
        scan_clear(&out);
        return 0;
    }
    if (size == 1) {
        choice = PyList_GET_ITEM(out.best, 0);
    } else {
        PyObject *num = PyLong_FromSsize_t(size);
        if (num == NULL)
            goto fail;
        PyObject *drawn = PyObject_CallOneArg(randrange, num);
        Py_DECREF(num);
        if (drawn == NULL)
            goto fail;
        Py_ssize_t k = PyLong_AsSsize_t(drawn);
        Py_DECREF(drawn);
        if (k < 0 || k >= size) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "choose: randrange gave an index out of range");
            goto fail;
        }
        choice = PyList_GET_ITEM(out.best, k);
    }
    Py_INCREF(choice);
    int reason = REASON_COST;
    int in_spread = PySet_Contains(out.spread, choice);
    if (in_spread < 0)
        goto fail;
    PyObject *hit = PyDict_GetItemWithError(hits, choice); /* borrowed */
    if (hit == NULL && PyErr_Occurred())
        goto fail;
    double h = hit == NULL ? 0.0 : PyFloat_AsDouble(hit);
    if (h == -1.0 && PyErr_Occurred())
        goto fail;
    PyObject *top = NULL; /* max(hits.values()): borrowed; NULL: the default 0 */
    double top_value = 0.0;
    Py_ssize_t at = 0;
    PyObject *key, *value;
    while (PyDict_Next(hits, &at, &key, &value)) {
        double v = PyFloat_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred())
            goto fail;
        if (top == NULL || v > top_value) {
            top = value;
            top_value = v;
        }
    }
    if ((out.guarded || PySet_GET_SIZE(out.spread) > 0) && !in_spread && h < top_value) {
        reason = REASON_GUARD;
    } else {
        if (h > 0) {
            reason = REASON_PREFIX;
        } else if (ahead != NULL) {
            PyObject *routed = PyDict_GetItemWithError(ahead, choice);
            if (routed == NULL && PyErr_Occurred())
                goto fail;
            double a = routed == NULL ? 0.0 : PyFloat_AsDouble(routed);
            if (a == -1.0 && PyErr_Occurred())
                goto fail;
            if (a > 0)
                reason = REASON_INFLIGHT;
        }
    }
    if (hit_out != NULL && (*hit_out = hit != NULL ? Py_NewRef(hit) : PyLong_FromLong(0)) == NULL)
        goto fail;
    if (top_out != NULL && (*top_out = top != NULL ? Py_NewRef(top) : PyLong_FromLong(0)) == NULL) {
        if (hit_out != NULL)
            Py_CLEAR(*hit_out);
        goto fail;
    }
    scan_clear(&out);
    *chosen = choice;
    *why = str_reasons[reason]; /* borrowed: interned at import */
    return 1;
fail:
    Py_XDECREF(choice);
    scan_clear(&out);
    return -1;
}

static PyObject *Book_choose(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "choose(hits, shared, host, ahead, pending, num_tokens, now, w_uncached, w_spread, guard=True)");
        return NULL;
    }
    PyObject *choice, *why;
    int rc = choose_core(self, args, nargs, &choice, &why, NULL, NULL);
    if (rc < 0)
        return NULL;
    if (rc == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(NO)", choice, why);
}

/* ``place``: see ``PyLoadBook.place``: ``choose`` and, when it chooses, ``assign`` of the request
 * to the chosen worker; the ``Decision`` is made with its fields written as ``Decision.__init__``
 * writes them (the worker both ways, its hit, ``num_tokens``, the reason, no pin, no decode hit,
 * the best hit ``max(hits.values(), default=0)``, the worker's host-tier hit from ``host``). None,
 * having changed nothing, where ``choose`` gives None. */
static PyObject *Book_place(Book *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "place(hits, shared, host, ahead, pending, num_tokens, now, w_uncached, w_spread, guard=True)");
        return NULL;
    }
    PyObject *choice, *why, *hit = NULL, *best = NULL;
    int rc = choose_core(self, args, nargs, &choice, &why, &hit, &best);
    if (rc < 0)
        return NULL;
    if (rc == 0)
        Py_RETURN_NONE;
    PyObject *host = dict_or_null(args[2]), *result = NULL, *uncached = NULL, *host_hit = NULL, *zero = NULL;
    double now = PyFloat_AsDouble(args[6]);
    if ((now == -1.0 && PyErr_Occurred()) || (uncached = PyNumber_Subtract(args[5], hit)) == NULL)
        goto done;
    if ((zero = PyLong_FromLong(0)) == NULL)
        goto done;
    if (host != NULL && PyDict_GET_SIZE(host) > 0) { /* host.get(worker, 0) if host else 0 */
        host_hit = PyDict_GetItemWithError(host, choice);
        if (host_hit == NULL && PyErr_Occurred())
            goto done;
    }
    host_hit = Py_NewRef(host_hit != NULL ? host_hit : zero);
    if (assign_core(self, choice, uncached, now) < 0)
        goto done;
    PyTypeObject *type = (PyTypeObject *)self->decision_type;
    PyObject *decision = type->tp_alloc(type, 0);
    if (decision == NULL)
        goto done;
    PyObject *values[9] = {choice, choice, hit, args[5], why, Py_None, zero, best, host_hit};
    for (int k = 0; k < 9; k++) {
        if (PyObject_GenericSetAttr(decision, str_decision[k], values[k]) < 0) {
            Py_DECREF(decision);
            goto done;
        }
    }
    result = decision;
done:
    Py_DECREF(choice);
    Py_DECREF(hit);
    Py_DECREF(best);
    Py_XDECREF(uncached);
    Py_XDECREF(host_hit);
    Py_XDECREF(zero);
    return result;
}

static PyMemberDef Book_members[] = {
    {"load_cost", T_OBJECT_EX, offsetof(Book, load_cost), READONLY, "worker -> load cost (``report``)"},
    {"queued", T_OBJECT_EX, offsetof(Book, queued), READONLY, "worker -> queued tokens"},
    {"queued_sum", T_DOUBLE, offsetof(Book, queued_sum), READONLY, "the sum of ``queued``"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef Book_methods[] = {
    {"add", (PyCFunction)Book_add, METH_O, "Track a worker: queue and work 0, load cost 0."},
    {"remove", (PyCFunction)Book_remove, METH_O, "Forget a worker (unknown ones are ignored)."},
    {"advance", (PyCFunction)Book_advance, METH_O, "The time of a decision."},
    {"report", (PyCFunction)(void (*)(void))Book_report, METH_FASTCALL, "report(worker, load)"},
    {"add_work", (PyCFunction)(void (*)(void))Book_add_work, METH_FASTCALL, "add_work(worker, amount, now)"},
    {"smoothed", (PyCFunction)(void (*)(void))Book_smoothed, METH_FASTCALL, "smoothed(worker, now)"},
    {"smoothed_mean", (PyCFunction)Book_smoothed_mean, METH_O, "smoothed_mean(now)"},
    {"work", (PyCFunction)(void (*)(void))Book_work, METH_FASTCALL, "work(worker, now)"},
    {"work_mean", (PyCFunction)Book_work_mean, METH_O, "work_mean(now)"},
    {"over", (PyCFunction)(void (*)(void))Book_over, METH_FASTCALL, "over(worker, now, slow, cap)"},
    {"thresholds", (PyCFunction)(void (*)(void))Book_thresholds, METH_FASTCALL,
     "thresholds(num_tokens, now, mean_queued, mean_smoothed, mean_work)"},
    {"credit", (PyCFunction)(void (*)(void))Book_credit, METH_FASTCALL, "credit(hits, shared, host, ahead)"},
    {"promote_load", (PyCFunction)Book_promote_load, METH_O, "A host-tier hit token's share of a miss's cost."},
    {"assign", (PyCFunction)(void (*)(void))Book_assign, METH_FASTCALL, "The record of a decision: see _load.c."},
    {"choose", (PyCFunction)(void (*)(void))Book_choose, METH_FASTCALL, "The pick over the whole pool: see _load.c."},
    {"place", (PyCFunction)(void (*)(void))Book_place, METH_FASTCALL, "choose, then assign the choice: see _load.c."},
    {"scan", (PyCFunction)(void (*)(void))Book_scan, METH_FASTCALL, "The pick's argmin: see PyLoadBook.scan."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine.routing._load.LoadBook",
    .tp_doc = "The routing policy's load book (see engine.routing.load.PyLoadBook, the reference).",
    .tp_basicsize = sizeof(Book),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Book_init,
    .tp_dealloc = (destructor)Book_dealloc,
    .tp_methods = Book_methods,
    .tp_members = Book_members,
};

static struct PyModuleDef load_module = {
    PyModuleDef_HEAD_INIT, "engine.routing._load", "The routing policy's compiled load book.", -1, NULL,
};

PyMODINIT_FUNC PyInit__load(void) {
    str_queued_tokens = PyUnicode_InternFromString("queued_tokens");
    str_running_requests = PyUnicode_InternFromString("running_requests");
    str_used_block_fraction = PyUnicode_InternFromString("used_block_fraction");
    str_promote_s_per_token = PyUnicode_InternFromString("promote_s_per_token");
    if (str_queued_tokens == NULL || str_running_requests == NULL || str_used_block_fraction == NULL ||
        str_promote_s_per_token == NULL)
        return NULL;
    for (int k = 0; k < 9; k++)
        if ((str_decision[k] = PyUnicode_InternFromString(decision_fields[k])) == NULL)
            return NULL;
    const char *const reasons[4] = {"cost", "guard", "prefix", "inflight"};
    for (int k = 0; k < 4; k++)
        if ((str_reasons[k] = PyUnicode_InternFromString(reasons[k])) == NULL)
            return NULL;
    if (PyType_Ready(&BookType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&load_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BookType);
    if (PyModule_AddObject(m, "LoadBook", (PyObject *)&BookType) < 0) {
        Py_DECREF(&BookType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
