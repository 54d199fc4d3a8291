/* The compiled prefix reuse counts (engine/routing/prefix_reuse.py describes the interface; the
 * pure-Python PrefixReuse there is the reference this must match call by call: the same counts
 * from the same floating-point operations, decay.decayed's, and the same prefix dropped first).
 *
 * ``keys`` maps a prefix's key to its record's number (an int, one object per record number,
 * kept in ``numbers``), in order of last reuse: a reuse deletes and re-inserts its key, as the
 * reference's dict does, so the first key is the least recently reused. ``records[n]`` is
 * record n's (count, at); a dropped prefix's record number goes on ``spare`` for the next new
 * one. Built with -ffp-contract=off (setup.py): ``1.0 + count * factor`` must round twice, as
 * the reference's does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include "structmember.h"

typedef struct {
    double count, at;
} Record;

typedef struct {
    PyObject_HEAD
    double halflife_s;
    Py_ssize_t capacity;
    PyObject *keys;     /* dict: key -> its record number (an int of ``numbers``) */
    Record *records;    /* ``allocated`` of them */
    PyObject **numbers; /* the int objects 0 .. ``used`` - 1 */
    Py_ssize_t *spare;  /* record numbers free for reuse, ``nspare`` of them */
    Py_ssize_t used, allocated, nspare;
} Reuse;

/* ``value`` recorded at ``at``, decayed to ``now`` (decay.decayed). */
static inline double decayed(double value, double at, double now, double halflife_s) {
    if (now <= at)
        return value;
    return value * pow(0.5, (now - at) / halflife_s);
}

static int Reuse_init(Reuse *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"halflife_s", "capacity", NULL};
    double halflife_s;
    Py_ssize_t capacity = 1 << 16;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "d|n", kwlist, &halflife_s, &capacity))
        return -1;
    if (!(halflife_s > 0)) {
        PyObject *got = PyFloat_FromDouble(halflife_s);
        if (got != NULL)
            PyErr_Format(PyExc_ValueError, "halflife_s: must be > 0 (got %R)", got);
        Py_XDECREF(got);
        return -1;
    }
    if (capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "capacity: must be >= 0");
        return -1;
    }
    if (self->keys != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PrefixReuse: already initialised");
        return -1;
    }
    self->keys = PyDict_New();
    if (self->keys == NULL)
        return -1;
    self->halflife_s = halflife_s;
    self->capacity = capacity;
    return 0;
}

static void Reuse_dealloc(Reuse *self) {
    Py_XDECREF(self->keys);
    for (Py_ssize_t i = 0; i < self->used; i++)
        Py_DECREF(self->numbers[i]);
    PyMem_Free(self->records);
    PyMem_Free(self->numbers);
    PyMem_Free(self->spare);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A record number for a new prefix (borrowed int), or NULL on error. */
static PyObject *new_record(Reuse *self, Py_ssize_t *n) {
    if (self->nspare > 0) {
        *n = self->spare[--self->nspare];
        return self->numbers[*n];
    }
    if (self->used == self->allocated) {
        Py_ssize_t size = self->allocated ? 2 * self->allocated : 64;
        Record *records = PyMem_Realloc(self->records, (size_t)size * sizeof(Record));
        if (records == NULL)
            return PyErr_NoMemory();
        self->records = records;
        PyObject **numbers = PyMem_Realloc(self->numbers, (size_t)size * sizeof(PyObject *));
        if (numbers == NULL)
            return PyErr_NoMemory();
        self->numbers = numbers;
        Py_ssize_t *spare = PyMem_Realloc(self->spare, (size_t)size * sizeof(Py_ssize_t));
        if (spare == NULL)
            return PyErr_NoMemory();
        self->spare = spare;
        self->allocated = size;
    }
    PyObject *number = PyLong_FromSsize_t(self->used);
    if (number == NULL)
        return NULL;
    *n = self->used;
    self->numbers[self->used++] = number;
    return number;
}

/* Count one reuse of ``key`` at ``now``: its count with it, or -1 with an error set. */
static double observe(Reuse *self, PyObject *key, double now) {
    PyObject *number = PyDict_GetItemWithError(self->keys, key);
    if (number != NULL) {
        Py_ssize_t n = PyLong_AsSsize_t(number);
        if (n < 0 && PyErr_Occurred())
            return -1;
        Py_INCREF(key); /* the dict's reference goes with the deletion */
        int rc = PyDict_DelItem(self->keys, key);
        if (rc == 0)
            rc = PyDict_SetItem(self->keys, key, number);
        Py_DECREF(key);
        if (rc < 0)
            return -1;
        Record *r = &self->records[n];
        r->count = 1.0 + decayed(r->count, r->at, now, self->halflife_s);
        r->at = r->at > now ? r->at : now;
        return r->count;
    }
    if (PyErr_Occurred())
        return -1;
    Py_ssize_t n = 0;
    number = new_record(self, &n);
    if (number == NULL || PyDict_SetItem(self->keys, key, number) < 0)
        return -1;
    self->records[n].count = 1.0;
    self->records[n].at = now;
    if (PyDict_GET_SIZE(self->keys) > self->capacity) { /* drop the least recently reused */
        Py_ssize_t pos = 0;
        PyObject *first, *value;
        if (PyDict_Next(self->keys, &pos, &first, &value)) {
            Py_ssize_t dropped = PyLong_AsSsize_t(value);
            Py_INCREF(first);
            int rc = PyDict_DelItem(self->keys, first);
            Py_DECREF(first);
            if (rc < 0)
                return -1;
            self->spare[self->nspare++] = dropped;
        }
    }
    return 1.0;
}

static PyObject *Reuse_observe(Reuse *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "observe: expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    double now = PyFloat_AsDouble(args[1]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    double count = observe(self, args[0], now);
    if (count < 0)
        return NULL;
    return PyFloat_FromDouble(count);
}

/* reused(hashes, hash_block_size, depth, hits, now): see PrefixReuse.reused. */
static PyObject *Reuse_reused(Reuse *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "reused: expected 5 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *hashes = args[0], *hits = args[3];
    Py_ssize_t block = PyLong_AsSsize_t(args[1]);
    Py_ssize_t depth = PyLong_AsSsize_t(args[2]);
    double now = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (block <= 0) {
        PyErr_SetString(PyExc_ValueError, "reused: hash_block_size must be > 0");
        return NULL;
    }
    if (!PyDict_Check(hits)) {
        PyErr_SetString(PyExc_TypeError, "reused: hits must be a dict");
        return NULL;
    }
    if (depth == 0) { /* no full-attention depth: the longest hit */
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(hits, &pos, &k, &v)) {
            Py_ssize_t tokens = PyLong_AsSsize_t(v);
            if (tokens == -1 && PyErr_Occurred())
                return NULL;
            depth = tokens > depth ? tokens : depth;
        }
    }
    Py_ssize_t size = PySequence_Size(hashes);
    if (size < 0)
        return NULL;
    Py_ssize_t blocks = depth >= 0 ? depth / block : -((-depth + block - 1) / block);
    blocks = blocks < size ? blocks : size;
    if (blocks <= 0)
        return PyFloat_FromDouble(0.0);
    PyObject *key = PySequence_GetItem(hashes, blocks - 1);
    if (key == NULL)
        return NULL;
    double count = observe(self, key, now);
    Py_DECREF(key);
    if (count < 0)
        return NULL;
    return PyFloat_FromDouble(count);
}

static Py_ssize_t Reuse_len(Reuse *self) {
    return self->keys == NULL ? 0 : PyDict_GET_SIZE(self->keys);
}

static PyMethodDef Reuse_methods[] = {
    {"observe", (PyCFunction)(void (*)(void))Reuse_observe, METH_FASTCALL,
     "observe(key, now): count one more reuse of the prefix key; its count with it"},
    {"reused", (PyCFunction)(void (*)(void))Reuse_reused, METH_FASTCALL,
     "reused(hashes, hash_block_size, depth, hits, now): count the reuse of the deepest prefix held"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Reuse_members[] = {
    {"halflife_s", T_DOUBLE, offsetof(Reuse, halflife_s), READONLY, "the counts' half-life (s)"},
    {"capacity", T_PYSSIZET, offsetof(Reuse, capacity), READONLY, "prefixes kept at most"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Reuse_as_sequence = {
    .sq_length = (lenfunc)Reuse_len,
};

static PyTypeObject ReuseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine.routing._reuse.PrefixReuse",
    .tp_basicsize = sizeof(Reuse),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Per reused prefix, its reuse count decaying with a half-life (prefix_reuse.PrefixReuse).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reuse_init,
    .tp_dealloc = (destructor)Reuse_dealloc,
    .tp_methods = Reuse_methods,
    .tp_members = Reuse_members,
    .tp_as_sequence = &Reuse_as_sequence,
};

static struct PyModuleDef reuse_module = {
    PyModuleDef_HEAD_INIT, .m_name = "engine.routing._reuse",
    .m_doc = "Compiled prefix reuse counts (see engine/routing/prefix_reuse.py).", .m_size = -1,
};

PyMODINIT_FUNC PyInit__reuse(void) {
    if (PyType_Ready(&ReuseType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&reuse_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ReuseType);
    if (PyModule_AddObject(m, "PrefixReuse", (PyObject *)&ReuseType) < 0) {
        Py_DECREF(&ReuseType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
