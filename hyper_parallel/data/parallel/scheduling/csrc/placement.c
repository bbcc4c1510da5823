/*
 * The C helper of hyper_parallel.data.parallel.scheduling: the size-1 placement of the cost-balanced schedulers
 * (dynamic_cp and compute_balanced, balanced._Step.place_singles).
 *
 * It is longest-processing-time placement: each sequence, in the given order, goes to the least-loaded position
 * (ties: the lowest) that has room in one of its micro-batches, the first such micro-batch, and its cost is added to
 * that position's load. Each step depends on the loads the previous ones left, so numpy cannot vectorise it; in
 * Python the loop was a third to a half of the schedulers' time (about 0.7 ms of the 1.8 ms `dynamic_cp` took to
 * plan the 1,143 sequences of benchmarks/bench_schedule.py; 20-30 us here). The walk is the one the
 * Python loop did, with the same keys: positions wait in a binary heap by (load, position); one whose micro-batches
 * have no room for a sequence is parked, in a heap by (largest room descending, load, position), until a sequence
 * that fits its largest room comes; when no position has room, every position gets `grow` fresh micro-batches and
 * every parked position goes back. The keys are distinct (each holds its position), so the pops, hence the plans, do
 * not depend on how the heaps break ties. A load is a plain IEEE double sum, the costs added in placement order; the
 * build disables floating-point contraction.
 *
 * Arguments are numpy arrays of exact dtypes, checked here. The inputs are copied before the walk, which then runs
 * with the GIL released on memory only this call holds (its copies and the arrays it returns).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double load;
    int64_t position;
} Ready; /* a position in the heap by (load, position) */

typedef struct {
    int64_t largest;
    double load;
    int64_t position;
} Parked; /* a position in the heap by (-largest room, load, position) */

static inline int ready_less(const Ready *a, const Ready *b) {
    return a->load < b->load || (a->load == b->load && a->position < b->position);
}

static inline int parked_less(const Parked *a, const Parked *b) {
    if (a->largest != b->largest) return a->largest > b->largest;
    return a->load < b->load || (a->load == b->load && a->position < b->position);
}

/* A binary min-heap's two sifts for entries of TYPE ordered by LESS: NAME##_down and NAME##_up. */
#define DEFINE_HEAP(NAME, TYPE, LESS)                                                    \
    static void NAME##_down(TYPE *heap, Py_ssize_t size, Py_ssize_t i) {                 \
        TYPE item = heap[i];                                                             \
        for (;;) {                                                                       \
            Py_ssize_t child = 2 * i + 1;                                                \
            if (child >= size) break;                                                    \
            if (child + 1 < size && LESS(&heap[child + 1], &heap[child])) child++;       \
            if (!LESS(&heap[child], &item)) break;                                       \
            heap[i] = heap[child];                                                       \
            i = child;                                                                   \
        }                                                                                \
        heap[i] = item;                                                                  \
    }                                                                                    \
    static void NAME##_up(TYPE *heap, Py_ssize_t i) {                                    \
        TYPE item = heap[i];                                                             \
        while (i > 0) {                                                                  \
            Py_ssize_t parent = (i - 1) / 2;                                             \
            if (!LESS(&item, &heap[parent])) break;                                      \
            heap[i] = heap[parent];                                                      \
            i = parent;                                                                  \
        }                                                                                \
        heap[i] = item;                                                                  \
    }

DEFINE_HEAP(ready, Ready, ready_less)
DEFINE_HEAP(parked, Parked, parked_less)

/* A C-contiguous, aligned array of `ndim` dimensions and exactly `type_num`'s dtype in native byte order (a new
 * reference; a copy only when `obj` is neither), or NULL with TypeError / ValueError naming `name`. */
static PyArrayObject *checked_array(PyObject *obj, int type_num, int ndim, const char *name, const char *dtype) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array of %s, got %s", name, dtype, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *array = (PyArrayObject *)obj;
    if (!PyArray_EquivTypenums(PyArray_TYPE(array), type_num) || PyArray_ISBYTESWAPPED(array)) {
        PyErr_Format(PyExc_TypeError, "%s must be %s in native byte order, got %R", name, dtype,
                     (PyObject *)PyArray_DESCR(array));
        return NULL;
    }
    if (PyArray_NDIM(array) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be %d-D, got %d-D", name, ndim, PyArray_NDIM(array));
        return NULL;
    }
    return (PyArrayObject *)PyArray_FromArray(array, NULL, NPY_ARRAY_IN_ARRAY);
}

enum { PLACED, NO_MEMORY, TOO_LARGE };

/* The walk's state: rooms[p * stride + m] and members[p * stride + m] for micro-batch m < count of position p. */
typedef struct {
    int64_t *rooms, *members;
    Py_ssize_t stride;
} Rows;

/* `grow` more micro-batches of `fresh` room on each of `positions` rows of `count`; the rows move when full. */
static int add_micro_batches(Rows *rows, Py_ssize_t positions, Py_ssize_t count, Py_ssize_t grow, int64_t fresh) {
    if (grow > PY_SSIZE_T_MAX - count) return NO_MEMORY;
    Py_ssize_t needed = count + grow;
    if (needed > rows->stride) {
        Py_ssize_t stride = rows->stride > needed / 2 ? 2 * rows->stride : needed;
        if (stride > PY_SSIZE_T_MAX / positions / (Py_ssize_t)sizeof(int64_t)) return NO_MEMORY;
        int64_t *rooms = malloc((size_t)(positions * stride) * sizeof(int64_t));
        int64_t *members = malloc((size_t)(positions * stride) * sizeof(int64_t));
        if (rooms == NULL || members == NULL) {
            free(rooms);
            free(members);
            return NO_MEMORY;
        }
        for (Py_ssize_t p = 0; p < positions; p++) {
            memcpy(rooms + p * stride, rows->rooms + p * rows->stride, (size_t)count * sizeof(int64_t));
            memcpy(members + p * stride, rows->members + p * rows->stride, (size_t)count * sizeof(int64_t));
        }
        free(rows->rooms);
        free(rows->members);
        rows->rooms = rooms;
        rows->members = members;
        rows->stride = stride;
    }
    for (Py_ssize_t p = 0; p < positions; p++) {
        for (Py_ssize_t m = count; m < needed; m++) {
            rows->rooms[p * rows->stride + m] = fresh;
            rows->members[p * rows->stride + m] = 0;
        }
    }
    return PLACED;
}

/* The walk's buffers: the heaps (`positions` entries each), the rows, and copies of the sequences' needs and costs. */
typedef struct {
    Ready *ready;
    Parked *parked;
    Rows rows;
    int64_t *needs;
    double *weights;
} Work;

/*
 * The walk over n sequences and `positions` positions of `*count` micro-batches: writes each sequence's position and
 * micro-batch, updates loads and *count. Returns PLACED; NO_MEMORY; or TOO_LARGE, with *failed the sequence that
 * needs more than a fresh micro-batch's room when no micro-batch has room for it (no growth could place it). Runs
 * without the GIL: it touches only the memory it is given.
 */
static int walk(Work *work, Py_ssize_t n, Py_ssize_t positions, double *loads, Py_ssize_t *count, int64_t fresh,
                int64_t limit, Py_ssize_t grow, int64_t *out_position, int64_t *out_micro_batch, Py_ssize_t *failed) {
    Ready *ready = work->ready;
    Parked *parked = work->parked;
    Rows *rows = &work->rows;
    Py_ssize_t ready_size = positions, parked_size = 0, micro_batches = *count;
    int64_t reopen = -1; /* the largest room of a parked position, -1 when none is parked */
    for (Py_ssize_t p = 0; p < positions; p++) {
        ready[p].load = loads[p];
        ready[p].position = p;
    }
    for (Py_ssize_t k = positions / 2 - 1; k >= 0; k--) ready_down(ready, ready_size, k);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t need = work->needs[i];
        if (need <= reopen) { /* the parked positions with room for it go back */
            while (parked_size > 0 && parked[0].largest >= need) {
                ready[ready_size].load = parked[0].load;
                ready[ready_size].position = parked[0].position;
                ready_up(ready, ready_size++);
                parked[0] = parked[--parked_size];
                parked_down(parked, parked_size, 0);
            }
            reopen = parked_size > 0 ? parked[0].largest : -1;
        }
        int64_t *row;
        Py_ssize_t m;
        for (;;) { /* the least-loaded position's first micro-batch with room; a position without one is parked */
            row = rows->rooms + ready[0].position * rows->stride;
            m = 0;
            while (m < micro_batches && row[m] < need) m++;
            if (m < micro_batches) break;
            int64_t largest = row[0];
            for (Py_ssize_t k = 1; k < micro_batches; k++) largest = row[k] > largest ? row[k] : largest;
            parked[parked_size].largest = largest;
            parked[parked_size].load = ready[0].load;
            parked[parked_size].position = ready[0].position;
            parked_up(parked, parked_size++);
            reopen = largest > reopen ? largest : reopen;
            ready[0] = ready[--ready_size];
            ready_down(ready, ready_size, 0);
            if (ready_size == 0) { /* no position has room: more micro-batches, every position back */
                if (need > fresh) {
                    *failed = i;
                    return TOO_LARGE;
                }
                if (add_micro_batches(rows, positions, micro_batches, grow, fresh) != PLACED) return NO_MEMORY;
                micro_batches += grow;
                for (Py_ssize_t k = 0; k < parked_size; k++) {
                    ready[k].load = parked[k].load;
                    ready[k].position = parked[k].position;
                }
                ready_size = parked_size;
                for (Py_ssize_t k = ready_size / 2 - 1; k >= 0; k--) ready_down(ready, ready_size, k);
                parked_size = 0;
                reopen = -1;
            }
        }
        int64_t position = ready[0].position;
        ready[0].load += work->weights[i];
        loads[position] = ready[0].load;
        ready_down(ready, ready_size, 0);
        out_position[i] = position;
        out_micro_batch[i] = m;
        int64_t members = ++rows->members[position * rows->stride + m];
        row[m] = limit > 0 && members >= limit ? -1 : row[m] - need;
    }
    *count = micro_batches;
    return PLACED;
}

static int check_no_nan(PyArrayObject *array, const char *name) {
    const double *values = PyArray_DATA(array);
    for (Py_ssize_t i = 0; i < PyArray_DIM(array, 0); i++) {
        if (isnan(values[i])) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is NaN; costs and loads must be numbers", name, i);
            return -1;
        }
    }
    return 0;
}

/* max_num_seqs as the walk's limit (0: none), or -1 with an error set. */
static int64_t parse_limit(PyObject *obj) {
    if (obj == Py_None) return 0;
    PyObject *index = PyNumber_Index(obj);
    if (index == NULL) {
        PyErr_Format(PyExc_TypeError, "max_num_seqs must be an int or None, got %s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    long long value = PyLong_AsLongLong(index);
    Py_DECREF(index);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < 1) {
        PyErr_Format(PyExc_ValueError, "max_num_seqs must be >= 1 or None, got %lld", value);
        return -1;
    }
    return value;
}

/* The arguments' checks: shapes that agree, needs >= 1, no NaN cost or load. */
static int check_shapes(PyArrayObject *needs, PyArrayObject *weights, PyArrayObject *loads, PyArrayObject *rooms) {
    Py_ssize_t n = PyArray_DIM(needs, 0), positions = PyArray_DIM(loads, 0);
    if (PyArray_DIM(weights, 0) != n) {
        PyErr_Format(PyExc_ValueError, "needs and weights must have one entry a sequence, got %zd and %zd", n,
                     (Py_ssize_t)PyArray_DIM(weights, 0));
        return -1;
    }
    if (positions < 1 || PyArray_DIM(rooms, 1) < 1 || PyArray_DIM(rooms, 0) != positions) {
        PyErr_Format(PyExc_ValueError,
                     "rooms must be [positions, micro_batches] with at least one of each and loads one entry a "
                     "position, got rooms of shape (%zd, %zd) and %zd loads",
                     (Py_ssize_t)PyArray_DIM(rooms, 0), (Py_ssize_t)PyArray_DIM(rooms, 1), positions);
        return -1;
    }
    const int64_t *values = PyArray_DATA(needs);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (values[i] < 1) {
            PyErr_Format(PyExc_ValueError, "needs[%zd] is %lld; each sequence needs at least one token", i,
                         (long long)values[i]);
            return -1;
        }
    }
    return check_no_nan(weights, "weights") < 0 || check_no_nan(loads, "loads") < 0 ? -1 : 0;
}

/* place_singles(needs: int64[n], weights: float64[n], loads: float64[P], rooms: int64[P, M], fresh_room: int,
 *               max_num_seqs: int | None, grow: int) -> (position int64[n], micro_batch int64[n], loads float64[P],
 *               count) */
static PyObject *place_singles(PyObject *self, PyObject *args) {
    PyObject *needs_obj, *weights_obj, *loads_obj, *rooms_obj, *limit_obj, *result = NULL;
    long long fresh, grow;
    PyArrayObject *needs = NULL, *weights = NULL, *loads = NULL, *rooms = NULL;
    PyArrayObject *out_position = NULL, *out_micro_batch = NULL, *out_loads = NULL;
    Work work = {NULL, NULL, {NULL, NULL, 0}, NULL, NULL};
    Py_ssize_t n, positions, count, failed = -1;
    int64_t limit;
    int status;
    npy_intp dims[1];
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOLOL:place_singles", &needs_obj, &weights_obj, &loads_obj, &rooms_obj, &fresh,
                          &limit_obj, &grow)) {
        return NULL;
    }
    if ((limit = parse_limit(limit_obj)) < 0) return NULL;
    if (grow < 1) {
        PyErr_Format(PyExc_ValueError, "grow must be >= 1, got %lld", grow);
        return NULL;
    }
    if ((needs = checked_array(needs_obj, NPY_INT64, 1, "needs", "int64")) == NULL ||
        (weights = checked_array(weights_obj, NPY_FLOAT64, 1, "weights", "float64")) == NULL ||
        (loads = checked_array(loads_obj, NPY_FLOAT64, 1, "loads", "float64")) == NULL ||
        (rooms = checked_array(rooms_obj, NPY_INT64, 2, "rooms", "int64")) == NULL ||
        check_shapes(needs, weights, loads, rooms) < 0) {
        goto done;
    }
    n = PyArray_DIM(needs, 0);
    positions = PyArray_DIM(loads, 0);
    count = PyArray_DIM(rooms, 1);
    dims[0] = n;
    out_position = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64);
    out_micro_batch = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64);
    dims[0] = positions;
    out_loads = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_FLOAT64);
    if (out_position == NULL || out_micro_batch == NULL || out_loads == NULL) goto done;
    work.ready = malloc((size_t)positions * sizeof(Ready));
    work.parked = malloc((size_t)positions * sizeof(Parked));
    work.needs = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    work.weights = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    work.rows.stride = count;
    work.rows.rooms = malloc((size_t)(positions * count) * sizeof(int64_t));
    work.rows.members = calloc((size_t)(positions * count), sizeof(int64_t));
    if (work.ready == NULL || work.parked == NULL || work.needs == NULL || work.weights == NULL ||
        work.rows.rooms == NULL || work.rows.members == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(work.needs, PyArray_DATA(needs), (size_t)n * sizeof(int64_t));
    memcpy(work.weights, PyArray_DATA(weights), (size_t)n * sizeof(double));
    memcpy(work.rows.rooms, PyArray_DATA(rooms), (size_t)(positions * count) * sizeof(int64_t));
    memcpy(PyArray_DATA(out_loads), PyArray_DATA(loads), (size_t)positions * sizeof(double));
    Py_BEGIN_ALLOW_THREADS
    status = walk(&work, n, positions, PyArray_DATA(out_loads), &count, fresh, limit, (Py_ssize_t)grow,
                  PyArray_DATA(out_position), PyArray_DATA(out_micro_batch), &failed);
    Py_END_ALLOW_THREADS
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
    } else if (status == TOO_LARGE) {
        PyErr_Format(PyExc_ValueError,
                     "sequence %zd needs %lld tokens, more than a fresh micro-batch's room %lld, and no micro-batch "
                     "has room for it",
                     failed, (long long)work.needs[failed], fresh);
    } else {
        result = Py_BuildValue("OOOn", out_position, out_micro_batch, out_loads, count);
    }
done:
    Py_XDECREF(needs);
    Py_XDECREF(weights);
    Py_XDECREF(loads);
    Py_XDECREF(rooms);
    Py_XDECREF(out_position);
    Py_XDECREF(out_micro_batch);
    Py_XDECREF(out_loads);
    free(work.ready);
    free(work.parked);
    free(work.needs);
    free(work.weights);
    free(work.rows.rooms);
    free(work.rows.members);
    return result;
}

static PyMethodDef methods[] = {
    {"place_singles", place_singles, METH_VARARGS,
     "place_singles(needs, weights, loads, rooms, fresh_room, max_num_seqs, grow) -> (position, micro_batch, loads, "
     "count): each size-1 sequence, in order, to the least (load, position) with room, its first micro-batch with "
     "room; `grow` more micro-batches of fresh_room when none has room."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_placement", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__placement(void) {
    import_array();
    return PyModule_Create(&module);
}
