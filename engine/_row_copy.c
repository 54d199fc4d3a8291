/* Row copies between host buffers, one call for a whole batch: the host tier's copies on the CPU
 * (engine/host_kv.py, HostKVMemory). A batch of the host tier moves the same rows of every slot
 * tensor of one pool; done with one tensor operation per row and slot, or a gather and a scatter
 * per slot, its per-call cost rather than its bytes sets the time, for the small pages of
 * recurrent and small attention layers above all. Here one call validates every row index once,
 * then copies each (source row, target row) pair of every slot with memmove. It keeps the GIL: a
 * batch copies microseconds to a few milliseconds of bytes, and a thread that gave the GIL up
 * waits for it back behind the worker's other Python threads (up to the switch interval, 5 ms),
 * which in the tiered bench's workers made the offloads 8x slower than the copies themselves.
 *
 * copy_rows(targets, sources, target_rows, source_rows): ``targets`` and ``sources`` are
 * sequences of the same length of C-contiguous 2-D buffers (numpy views of the slot tensors), the
 * i-th target row-compatible with the i-th source (same bytes per row); row ``target_rows[j]`` of
 * every target receives row ``source_rows[j]`` of its source. Nothing is copied unless every
 * index is within its buffer's rows (IndexError otherwise).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

static int read_rows(PyObject *list, Py_ssize_t n, Py_ssize_t *out, const char *what) {
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t value = PyLong_AsSsize_t(PyList_GET_ITEM(list, j));
        if (value == -1 && PyErr_Occurred())
            return -1;
        if (value < 0) {
            PyErr_Format(PyExc_IndexError, "%s[%zd]: row %zd is negative", what, j, value);
            return -1;
        }
        out[j] = value;
    }
    return 0;
}

static int check_rows(const Py_ssize_t *rows, Py_ssize_t n, Py_ssize_t limit, const char *what, Py_ssize_t slot) {
    for (Py_ssize_t j = 0; j < n; j++) {
        if (rows[j] >= limit) {
            PyErr_Format(PyExc_IndexError, "%s[%zd]: row %zd outside buffer %zd (%zd rows)", what, j, rows[j], slot,
                         limit);
            return -1;
        }
    }
    return 0;
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *targets, *sources, *target_list, *source_list;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO!O!:copy_rows", &targets, &sources, &PyList_Type, &target_list, &PyList_Type,
                          &source_list))
        return NULL;
    PyObject *target_seq = PySequence_Fast(targets, "copy_rows: targets must be a sequence of buffers");
    if (target_seq == NULL)
        return NULL;
    PyObject *source_seq = PySequence_Fast(sources, "copy_rows: sources must be a sequence of buffers");
    if (source_seq == NULL) {
        Py_DECREF(target_seq);
        return NULL;
    }
    Py_ssize_t num_buffers = PySequence_Fast_GET_SIZE(target_seq);
    Py_ssize_t n = PyList_GET_SIZE(target_list);
    Py_buffer *views = NULL;
    Py_ssize_t *rows = NULL;
    Py_ssize_t acquired = 0;
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(source_seq) != num_buffers) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %zd targets but %zd sources", num_buffers,
                     PySequence_Fast_GET_SIZE(source_seq));
        goto done;
    }
    if (PyList_GET_SIZE(source_list) != n) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %zd target rows but %zd source rows", n,
                     PyList_GET_SIZE(source_list));
        goto done;
    }
    views = PyMem_Calloc((size_t)(2 * num_buffers) + 1, sizeof(Py_buffer));
    rows = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(2 * n + 1));
    if (views == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_rows(target_list, n, rows, "target_rows") < 0 || read_rows(source_list, n, rows + n, "source_rows") < 0)
        goto done;
    for (Py_ssize_t i = 0; i < num_buffers; i++) {
        Py_buffer *target = &views[2 * i], *source = &views[2 * i + 1];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(target_seq, i), target, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        acquired++;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(source_seq, i), source, PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        acquired++;
        if (target->ndim != 2 || source->ndim != 2) {
            PyErr_Format(PyExc_ValueError, "copy_rows: buffer %zd is not 2-D (target %d, source %d dimensions)", i,
                         target->ndim, source->ndim);
            goto done;
        }
        if (target->shape[1] * target->itemsize != source->shape[1] * source->itemsize) {
            PyErr_Format(PyExc_ValueError, "copy_rows: buffer %zd: target rows of %zd bytes, source rows of %zd", i,
                         target->shape[1] * target->itemsize, source->shape[1] * source->itemsize);
            goto done;
        }
        if (check_rows(rows, n, target->shape[0], "target_rows", i) < 0 ||
            check_rows(rows + n, n, source->shape[0], "source_rows", i) < 0)
            goto done;
    }
    for (Py_ssize_t i = 0; i < num_buffers; i++) {
        const Py_buffer *target = &views[2 * i], *source = &views[2 * i + 1];
        size_t row_bytes = (size_t)(target->shape[1] * target->itemsize);
        char *to = target->buf;
        const char *from = source->buf;
        for (Py_ssize_t j = 0; j < n; j++)
            memmove(to + (size_t)rows[j] * row_bytes, from + (size_t)rows[n + j] * row_bytes, row_bytes);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t k = 0; k < acquired; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(rows);
    Py_DECREF(target_seq);
    Py_DECREF(source_seq);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(targets, sources, target_rows, source_rows): row target_rows[j] of every target buffer "
     "receives row source_rows[j] of its source buffer (2-D, C-contiguous, equal row bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__row_copy(void) { return PyModule_Create(&module); }
