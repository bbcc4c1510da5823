/*
 * The C helper of hyper_parallel.data.indexed: the sequential index builders (the sample index, the blending indices
 * and the legacy RandomState shuffle) and the reader's per-call paths (gather's copy, reader[i] and slices' views).
 *
 * Both builders are walks where each step depends on the previous one. The blending schedule cannot be vectorised;
 * the sample index can (indexed_helpers.build_sample_index_numpy), but the benchmarks show a single pass here is 3-4x
 * faster on the document indices of multi-epoch blends (benchmarks/bench_indexed_dataset.py). The arithmetic
 * is plain IEEE double `weight * max(s, 1) - count`, scanned in ascending dataset order with a strict '>',
 * which is what Megatron-Core's helpers compute; the build disables floating-point contraction (FMA) so the
 * results do not depend on the processor.
 *
 * The shuffle is numpy's RandomState.shuffle of a 1-D array (MT19937 draws, random_interval, swaps from the end),
 * run on a copy of the generator state: it consumes the same draws and produces the same permutation, but draws
 * the swap targets ahead of the swaps and prefetches them, since on arrays larger than the caches each swap is
 * otherwise a cache miss waited for in turn.
 *
 * copy_ranges is the reader's batched gather: byte ranges of the memory-mapped .bin copied one after another into
 * one preallocated output, with the GIL released, so that a batch of many documents costs no Python object per
 * document. The ranges of a batch lie anywhere in the map, so each copy prefetches the ranges a few places ahead:
 * their cache and TLB misses overlap the copies before them instead of stalling each copy in turn.
 *
 * MappedItems is the base type of the reader: once armed with the token array and the index arrays, reader[i] with
 * a plain int is answered here, a view made directly through the numpy C API with no Python frame (the Python path
 * cost three times as much per call, which is most of a 2 KB document's read); anything else goes to the reader's
 * _item_or_slice. split_views cuts one array into consecutive views the same way, for slices of many sequences.
 *
 * fill_token_lists is the Online transforms' flattening of tokenized documents: the tokenizer hands each document's
 * ids as a Python list of ints, and numpy's fastest way to one array (fromiter over a chain of the lists) still
 * costs an iterator step and a conversion per token; here each list is read in place (benchmarks/bench_online.py).
 *
 * Arguments are Python buffers (numpy arrays) of exact dtypes; the Python wrapper checks them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        return -1;
    }
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must have %zd-byte items, got %zd", name, itemsize, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* build_blending_indices(dataset_index: int16[size], dataset_sample_index: int64[size], weights: float64[K]) */
static PyObject *build_blending_indices(PyObject *self, PyObject *args) {
    PyObject *index_obj, *sample_obj, *weights_obj;
    if (!PyArg_ParseTuple(args, "OOO", &index_obj, &sample_obj, &weights_obj)) {
        return NULL;
    }
    Py_buffer index, sample, weights;
    if (get_buffer(index_obj, &index, 1, 2, "dataset_index") != 0) return NULL;
    if (get_buffer(sample_obj, &sample, 1, 8, "dataset_sample_index") != 0) {
        PyBuffer_Release(&index);
        return NULL;
    }
    if (get_buffer(weights_obj, &weights, 0, 8, "weights") != 0) {
        PyBuffer_Release(&index);
        PyBuffer_Release(&sample);
        return NULL;
    }
    Py_ssize_t size = index.len / 2;
    Py_ssize_t num_datasets = weights.len / 8;
    int16_t *out_index = (int16_t *)index.buf;
    int64_t *out_sample = (int64_t *)sample.buf;
    const double *w = (const double *)weights.buf;
    int64_t *counts = (int64_t *)calloc(num_datasets > 0 ? num_datasets : 1, sizeof(int64_t));
    if (counts == NULL) {
        PyBuffer_Release(&index);
        PyBuffer_Release(&sample);
        PyBuffer_Release(&weights);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < size; ++s) {
        double step = (double)(s > 1 ? s : 1);
        Py_ssize_t best = 0;
        double best_error = w[0] * step - (double)counts[0];
        for (Py_ssize_t k = 1; k < num_datasets; ++k) {
            double error = w[k] * step - (double)counts[k];
            if (error > best_error) {
                best_error = error;
                best = k;
            }
        }
        out_index[s] = (int16_t)best;
        out_sample[s] = counts[best];
        counts[best] += 1;
    }
    Py_END_ALLOW_THREADS
    free(counts);
    PyBuffer_Release(&index);
    PyBuffer_Release(&sample);
    PyBuffer_Release(&weights);
    Py_RETURN_NONE;
}

/* build_exhaustive_blending_indices(dataset_index: int16[sum], dataset_sample_index: int64[sum], sizes: int64[K]) */
static PyObject *build_exhaustive_blending_indices(PyObject *self, PyObject *args) {
    PyObject *index_obj, *sample_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "OOO", &index_obj, &sample_obj, &sizes_obj)) {
        return NULL;
    }
    Py_buffer index, sample, sizes;
    if (get_buffer(index_obj, &index, 1, 2, "dataset_index") != 0) return NULL;
    if (get_buffer(sample_obj, &sample, 1, 8, "dataset_sample_index") != 0) {
        PyBuffer_Release(&index);
        return NULL;
    }
    if (get_buffer(sizes_obj, &sizes, 0, 8, "sizes") != 0) {
        PyBuffer_Release(&index);
        PyBuffer_Release(&sample);
        return NULL;
    }
    Py_ssize_t num_datasets = sizes.len / 8;
    Py_ssize_t size = index.len / 2;
    int16_t *out_index = (int16_t *)index.buf;
    int64_t *out_sample = (int64_t *)sample.buf;
    const int64_t *n = (const int64_t *)sizes.buf;
    int64_t *counts = (int64_t *)calloc(num_datasets > 0 ? num_datasets : 1, sizeof(int64_t));
    double *w = (double *)calloc(num_datasets > 0 ? num_datasets : 1, sizeof(double));
    if (counts == NULL || w == NULL) {
        free(counts);
        free(w);
        PyBuffer_Release(&index);
        PyBuffer_Release(&sample);
        PyBuffer_Release(&sizes);
        return PyErr_NoMemory();
    }
    int64_t total = 0;
    for (Py_ssize_t k = 0; k < num_datasets; ++k) total += n[k];
    for (Py_ssize_t k = 0; k < num_datasets; ++k) w[k] = (double)n[k] / (double)total;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < size; ++s) {
        double step = (double)(s > 1 ? s : 1);
        Py_ssize_t best = -1;
        double best_error = -DBL_MAX;
        for (Py_ssize_t k = 0; k < num_datasets; ++k) {
            if (counts[k] >= n[k]) continue; /* spent */
            double error = w[k] * step - (double)counts[k];
            if (best < 0 || error > best_error) {
                best_error = error;
                best = k;
            }
        }
        if (best < 0) break; /* cannot happen when size == sum(sizes) */
        out_index[s] = (int16_t)best;
        out_sample[s] = counts[best];
        counts[best] += 1;
    }
    Py_END_ALLOW_THREADS
    free(counts);
    free(w);
    PyBuffer_Release(&index);
    PyBuffer_Release(&sample);
    PyBuffer_Release(&sizes);
    Py_RETURN_NONE;
}

/*
 * fill_sample_index(sizes: int32[num_sequences], document_index: int32[D], sample_index: int32|int64[n+1, 2],
 *                   sequence_length, add_extra_token)
 * Megatron's walk: sample k reads S + x tokens from boundary k; boundary k + 1 is where they end, minus x.
 */
static PyObject *fill_sample_index(PyObject *self, PyObject *args) {
    PyObject *sizes_obj, *documents_obj, *out_obj;
    long long sequence_length, extra;
    if (!PyArg_ParseTuple(args, "OOOLL", &sizes_obj, &documents_obj, &out_obj, &sequence_length, &extra)) {
        return NULL;
    }
    Py_buffer sizes, documents, out;
    if (get_buffer(sizes_obj, &sizes, 0, 4, "sizes") != 0) return NULL;
    if (get_buffer(documents_obj, &documents, 0, 4, "document_index") != 0) {
        PyBuffer_Release(&sizes);
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&sizes);
        PyBuffer_Release(&documents);
        return NULL;
    }
    const int32_t *length = (const int32_t *)sizes.buf;
    const int32_t *doc = (const int32_t *)documents.buf;
    Py_ssize_t num_documents = documents.len / 4;
    int wide = out.itemsize == 8;
    Py_ssize_t rows = out.len / (2 * out.itemsize);
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t d = 0;
    int64_t offset = 0;
    for (Py_ssize_t k = 1; k < rows && num_documents > 0; ++k) {
        int64_t need = sequence_length + extra;
        while (need != 0) {
            int64_t available = (int64_t)length[doc[d]] - offset;
            need -= available;
            if (need <= 0) {
                offset += available + need - extra;
                need = 0;
            } else if (d == num_documents - 1) {
                offset = (int64_t)length[doc[d]] - extra;
                break;
            } else {
                ++d;
                offset = 0;
            }
        }
        if (wide) {
            ((int64_t *)out.buf)[2 * k] = d;
            ((int64_t *)out.buf)[2 * k + 1] = offset;
        } else {
            ((int32_t *)out.buf)[2 * k] = (int32_t)d;
            ((int32_t *)out.buf)[2 * k + 1] = (int32_t)offset;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&documents);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/*
 * MT19937 as numpy's legacy RandomState runs it (numpy/random/src/mt19937): `key` is the 624-word state of
 * RandomState.get_state() and `pos` the number of its words already used; 624 means regenerate first.
 */
#define MT_N 624
#define MT_M 397

typedef struct {
    uint32_t *key;
    int pos;
} mt_state;

static void mt_regenerate(uint32_t *key) {
    int i;
    uint32_t y;
    for (i = 0; i < MT_N - MT_M; i++) {
        y = (key[i] & 0x80000000U) | (key[i + 1] & 0x7fffffffU);
        key[i] = key[i + MT_M] ^ (y >> 1) ^ (-(y & 1U) & 0x9908b0dfU);
    }
    for (; i < MT_N - 1; i++) {
        y = (key[i] & 0x80000000U) | (key[i + 1] & 0x7fffffffU);
        key[i] = key[i + (MT_M - MT_N)] ^ (y >> 1) ^ (-(y & 1U) & 0x9908b0dfU);
    }
    y = (key[MT_N - 1] & 0x80000000U) | (key[0] & 0x7fffffffU);
    key[MT_N - 1] = key[MT_M - 1] ^ (y >> 1) ^ (-(y & 1U) & 0x9908b0dfU);
}

static inline uint32_t mt_temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= y >> 18;
    return y;
}

static inline uint32_t mt_next32(mt_state *state) {
    if (state->pos == MT_N) {
        mt_regenerate(state->key);
        state->pos = 0;
    }
    return mt_temper(state->key[state->pos++]);
}

/* numpy's random_interval for max > 2**32 - 1: masked 64-bit draws, high word first, until one is <= max. */
static uint64_t mt_interval64(mt_state *state, uint64_t max) {
    uint64_t mask = max, value;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    do {
        uint64_t high = mt_next32(state);
        value = ((high << 32) | mt_next32(state)) & mask;
    } while (value > max);
    return value;
}

/*
 * Shuffle step i swaps x[i] with x[random_interval(i)], for i = n-1 down to 1. Targets are drawn in batches of
 * SHUFFLE_BATCH steps into a ring of two batches (step i in slot i % SHUFFLE_RING), one batch ahead of the swaps, and
 * each swap prefetches the target SHUFFLE_AHEAD steps later, so the cache misses of a large array overlap instead
 * of being waited for one by one.
 */
#define SHUFFLE_BATCH 256
#define SHUFFLE_RING (2 * SHUFFLE_BATCH)
#define SHUFFLE_AHEAD 64

/*
 * Draw the targets of steps `step`, step-1, ... (at most `count` of them, none below 1) into the ring, consuming
 * exactly numpy's draws; returns the next step left to draw (0 when all are drawn). For max <= 2**32 - 1,
 * random_interval keeps the first 32-bit draw whose masked value is <= max. Here a rejected draw just leaves its
 * step in place for the next word instead of branching, and the mask is fixed while the steps stay in one power of
 * two.
 */
static uint64_t draw_targets(mt_state *state, uint64_t *ring, uint64_t step, uint64_t count) {
    uint64_t stop = step > count ? step - count : 0;
    while (step > stop) {
        if (step > 0xffffffffU) {
            ring[step % SHUFFLE_RING] = mt_interval64(state, step);
            --step;
            continue;
        }
        if (state->pos == MT_N) {
            mt_regenerate(state->key);
            state->pos = 0;
        }
        uint32_t mask = 0xffffffffU >> __builtin_clz((uint32_t)step);
        uint64_t low = stop > (mask >> 1) ? stop : (mask >> 1);
        const uint32_t *key = state->key;
        int pos = state->pos;
        while (pos < MT_N && step > low) {
            uint64_t value = mt_temper(key[pos++]) & mask;
            ring[step % SHUFFLE_RING] = value;
            step -= value <= step;
        }
        state->pos = pos;
    }
    return step;
}

static inline void swap_items(char *x, uint64_t i, uint64_t j, int wide) {
    if (wide) {
        uint64_t *y = (uint64_t *)x, t = y[i];
        y[i] = y[j];
        y[j] = t;
    } else {
        uint32_t *y = (uint32_t *)x, t = y[i];
        y[i] = y[j];
        y[j] = t;
    }
}

static void shuffle_items(char *x, uint64_t n, int wide, mt_state *state) {
    uint64_t ring[SHUFFLE_RING];
    uint64_t itemsize = wide ? 8 : 4;
    uint64_t i, next;
    if (n < 2) return;
    next = draw_targets(state, ring, n - 1, SHUFFLE_BATCH);
    for (i = n - 1; i >= 1 && n - 1 - i < SHUFFLE_AHEAD; --i) {
        __builtin_prefetch(x + ring[i % SHUFFLE_RING] * itemsize, 1);
    }
    i = n - 1;
    while (i >= 1) {
        /* the batch after steps i .. end+1, so that every prefetched step below is drawn */
        uint64_t end = i > SHUFFLE_BATCH ? i - SHUFFLE_BATCH : 0;
        next = draw_targets(state, ring, next, SHUFFLE_BATCH);
        for (; i > end; --i) {
            if (i > SHUFFLE_AHEAD) {
                __builtin_prefetch(x + ring[(i - SHUFFLE_AHEAD) % SHUFFLE_RING] * itemsize, 1);
            }
            swap_items(x, i, ring[i % SHUFFLE_RING], wide);
        }
    }
}

/*
 * legacy_shuffle(x: 4- or 8-byte items[n], key: uint32[624], pos) -> pos
 * Shuffles x in place as RandomState.shuffle would from state (key, pos); advances key in place, returns the new pos.
 */
static PyObject *legacy_shuffle(PyObject *self, PyObject *args) {
    PyObject *array_obj, *key_obj;
    int pos;
    if (!PyArg_ParseTuple(args, "OOi", &array_obj, &key_obj, &pos)) {
        return NULL;
    }
    if (pos < 0 || pos > MT_N) {
        PyErr_Format(PyExc_ValueError, "pos must be in [0, %d], got %d", MT_N, pos);
        return NULL;
    }
    Py_buffer array, key;
    if (PyObject_GetBuffer(array_obj, &array, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return NULL;
    if (array.itemsize != 4 && array.itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "array must have 4- or 8-byte items, got %zd", array.itemsize);
        PyBuffer_Release(&array);
        return NULL;
    }
    if (get_buffer(key_obj, &key, 1, 4, "key") != 0) {
        PyBuffer_Release(&array);
        return NULL;
    }
    if (key.len != MT_N * 4) {
        PyErr_Format(PyExc_ValueError, "key must hold %d words, got %zd", MT_N, key.len / 4);
        PyBuffer_Release(&array);
        PyBuffer_Release(&key);
        return NULL;
    }
    mt_state state = {(uint32_t *)key.buf, pos};
    uint64_t n = (uint64_t)(array.len / array.itemsize);
    Py_BEGIN_ALLOW_THREADS
    shuffle_items((char *)array.buf, n, array.itemsize == 8, &state);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&array);
    PyBuffer_Release(&key);
    return PyLong_FromLong(state.pos);
}

/*
 * copy_ranges prefetches the start of range j + COPY_AHEAD while it copies range j: the hardware prefetcher follows a
 * range once its copy has begun, but not the jump to the next one, which would otherwise stall each copy on a cache
 * (and TLB) miss. One line is enough; prefetching more of each range measured no better.
 */
#define COPY_AHEAD 4

/*
 * copy_ranges(source: buffer, starts: int64[k], counts: int64[k], out: writable buffer)
 * Copy source[starts[j] : starts[j] + counts[j]] (bytes) for j = 0..k-1 back to back into out. The caller checks that
 * every range lies in source and that out holds their sum; this only refuses a sum larger than out.
 */
static PyObject *copy_ranges(PyObject *self, PyObject *args) {
    PyObject *source_obj, *starts_obj, *counts_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &source_obj, &starts_obj, &counts_obj, &out_obj)) {
        return NULL;
    }
    Py_buffer source, starts, counts, out;
    if (PyObject_GetBuffer(source_obj, &source, PyBUF_C_CONTIGUOUS) != 0) return NULL;
    if (get_buffer(starts_obj, &starts, 0, 8, "starts") != 0) {
        PyBuffer_Release(&source);
        return NULL;
    }
    if (get_buffer(counts_obj, &counts, 0, 8, "counts") != 0) {
        PyBuffer_Release(&source);
        PyBuffer_Release(&starts);
        return NULL;
    }
    if (counts.len != starts.len) {
        PyBuffer_Release(&source);
        PyBuffer_Release(&starts);
        PyBuffer_Release(&counts);
        PyErr_SetString(PyExc_ValueError, "starts and counts must have the same length");
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&source);
        PyBuffer_Release(&starts);
        PyBuffer_Release(&counts);
        return NULL;
    }
    const int64_t *start = (const int64_t *)starts.buf;
    const int64_t *count = (const int64_t *)counts.buf;
    Py_ssize_t k = starts.len / 8;
    int64_t total = 0;
    for (Py_ssize_t j = 0; j < k; ++j) total += count[j];
    if (total > out.len) {
        PyBuffer_Release(&source);
        PyBuffer_Release(&starts);
        PyBuffer_Release(&counts);
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "the ranges hold %lld bytes but out has %zd", (long long)total, out.len);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    char *to = (char *)out.buf;
    const char *from = (const char *)source.buf;
    for (Py_ssize_t j = 0; j < k && j < COPY_AHEAD; ++j) __builtin_prefetch(from + start[j], 0);
    for (Py_ssize_t j = 0; j < k; ++j) {
        if (j + COPY_AHEAD < k) __builtin_prefetch(from + start[j + COPY_AHEAD], 0);
        memcpy(to, from + start[j], (size_t)count[j]);
        to += count[j];
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&source);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/*
 * A view of `count` items of `array` from `data`, made as numpy's basic slicing makes one: the array's dtype and
 * flags (so a view of a read-only map stays read-only), the array as its base.
 */
static PyObject *view_of(PyArrayObject *array, char *data, npy_intp count) {
    PyArray_Descr *descr = PyArray_DESCR(array);
    Py_INCREF(descr);
    int flags = PyArray_FLAGS(array) & NPY_ARRAY_WRITEABLE;
    PyObject *view = PyArray_NewFromDescr(&PyArray_Type, descr, 1, &count, NULL, data, flags, NULL);
    if (view == NULL) return NULL;
    Py_INCREF(array);
    if (PyArray_SetBaseObject((PyArrayObject *)view, (PyObject *)array) != 0) {
        Py_DECREF(view);
        return NULL;
    }
    return view;
}

/* A 1-D C-contiguous array, of native-order items of `type` unless it is -1; else a TypeError naming it. */
static int check_array(PyObject *obj, int type, const char *name) {
    if (!PyArray_Check(obj) || PyArray_NDIM((PyArrayObject *)obj) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)obj) ||
        (type >= 0 && (PyArray_TYPE((PyArrayObject *)obj) != type || !PyArray_ISNOTSWAPPED((PyArrayObject *)obj)))) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous 1-D array%s", name,
                     type == NPY_INT64 ? " of native int64" : (type == NPY_INT32 ? " of native int32" : ""));
        return -1;
    }
    return 0;
}

/* split_views(array: 1-D contiguous, lengths: int32[k]) -> list of k consecutive views of array */
static PyObject *split_views(PyObject *self, PyObject *args) {
    PyObject *array_obj, *lengths_obj;
    if (!PyArg_ParseTuple(args, "OO", &array_obj, &lengths_obj)) return NULL;
    if (check_array(array_obj, -1, "array") != 0 || check_array(lengths_obj, NPY_INT32, "lengths") != 0) return NULL;
    PyArrayObject *array = (PyArrayObject *)array_obj;
    const char *length_data = PyArray_BYTES((PyArrayObject *)lengths_obj);  /* may be unaligned: read by memcpy */
    Py_ssize_t k = PyArray_DIM((PyArrayObject *)lengths_obj, 0);
    npy_intp available = PyArray_DIM(array, 0), total = 0;
    for (Py_ssize_t j = 0; j < k; ++j) {
        int32_t length;
        memcpy(&length, length_data + 4 * j, 4);
        if (length < 0 || length > available - total) {
            PyErr_Format(PyExc_ValueError, "the lengths must be non-negative and sum to at most the %zd items of array",
                         (Py_ssize_t)available);
            return NULL;
        }
        total += length;
    }
    PyObject *views = PyList_New(k);
    if (views == NULL) return NULL;
    char *data = PyArray_BYTES(array);
    npy_intp itemsize = PyArray_ITEMSIZE(array);
    for (Py_ssize_t j = 0; j < k; ++j) {
        int32_t length;
        memcpy(&length, length_data + 4 * j, 4);
        PyObject *view = view_of(array, data, length);
        if (view == NULL) {
            Py_DECREF(views);
            return NULL;
        }
        PyList_SET_ITEM(views, j, view);
        data += (npy_intp)length * itemsize;
    }
    return views;
}

/*
 * MappedItems: the base type of IndexedDataReader. _arm_items(tokens, pointers, lengths) gives reader[i] its fast
 * path (tokens: the mapped .bin as one array; pointers int64 and lengths int32: the index); _arm_items(None, None,
 * None) takes it away. Armed, reader[i] for a plain int in [-n, n) is the view of sequence i; every other key, and a
 * sequence that would not lie whole and aligned in tokens, goes to self._item_or_slice(key).
 */
typedef struct {
    PyObject_HEAD
    PyArrayObject *tokens; /* NULL when not armed */
    PyArrayObject *pointers;
    PyArrayObject *lengths;
} MappedItems;

static PyObject *item_or_slice_name; /* "_item_or_slice", interned at import */

static int mapped_items_traverse(MappedItems *self, visitproc visit, void *arg) {
    Py_VISIT(self->tokens);
    Py_VISIT(self->pointers);
    Py_VISIT(self->lengths);
    return 0;
}

static int mapped_items_clear(MappedItems *self) {
    Py_CLEAR(self->tokens);
    Py_CLEAR(self->pointers);
    Py_CLEAR(self->lengths);
    return 0;
}

static void mapped_items_dealloc(MappedItems *self) {
    PyObject_GC_UnTrack(self);
    mapped_items_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *mapped_items_arm(MappedItems *self, PyObject *args) {
    PyObject *tokens, *pointers, *lengths;
    if (!PyArg_ParseTuple(args, "OOO", &tokens, &pointers, &lengths)) return NULL;
    if (tokens == Py_None) {
        mapped_items_clear(self);
        Py_RETURN_NONE;
    }
    if (check_array(tokens, -1, "tokens") != 0 || check_array(pointers, NPY_INT64, "pointers") != 0 ||
        check_array(lengths, NPY_INT32, "lengths") != 0) {
        return NULL;
    }
    if (PyArray_DIM((PyArrayObject *)pointers, 0) != PyArray_DIM((PyArrayObject *)lengths, 0)) {
        PyErr_SetString(PyExc_ValueError, "pointers and lengths must have the same length");
        return NULL;
    }
    Py_INCREF(tokens);
    Py_INCREF(pointers);
    Py_INCREF(lengths);
    Py_XSETREF(self->tokens, (PyArrayObject *)tokens);
    Py_XSETREF(self->pointers, (PyArrayObject *)pointers);
    Py_XSETREF(self->lengths, (PyArrayObject *)lengths);
    Py_RETURN_NONE;
}

static PyObject *mapped_items_subscript(MappedItems *self, PyObject *key) {
    PyArrayObject *tokens = self->tokens;
    if (tokens != NULL && PyLong_CheckExact(key)) {
        Py_ssize_t i = PyLong_AsSsize_t(key);
        Py_ssize_t n = PyArray_DIM(self->lengths, 0);
        if (i == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* too large: the general path names it */
        } else if (i >= -n && i < n) {
            if (i < 0) i += n;
            /* The index arrays sit unaligned after the 34-byte header. */
            int64_t pointer;
            int32_t length;
            memcpy(&pointer, PyArray_BYTES(self->pointers) + 8 * i, 8);
            memcpy(&length, PyArray_BYTES(self->lengths) + 4 * i, 4);
            int64_t itemsize = PyArray_ITEMSIZE(tokens), size = PyArray_NBYTES(tokens);
            if (pointer >= 0 && pointer % itemsize == 0 && length >= 0 && pointer <= size &&
                length <= (size - pointer) / itemsize) {
                return view_of(tokens, PyArray_BYTES(tokens) + pointer, length);
            }
        }
    }
    return PyObject_CallMethodOneArg((PyObject *)self, item_or_slice_name, key);
}

static PyMappingMethods mapped_items_mapping = {NULL, (binaryfunc)mapped_items_subscript, NULL};

static PyMethodDef mapped_items_methods[] = {
    {"_arm_items", (PyCFunction)mapped_items_arm, METH_VARARGS,
     "_arm_items(tokens, pointers, lengths): answer reader[i] with views of tokens; all None: stop."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MappedItemsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hyper_parallel.data.indexed._indexed_helpers.MappedItems",
    .tp_doc = "Base of IndexedDataReader: reader[i] of a plain int as a view of the armed token array.",
    .tp_basicsize = sizeof(MappedItems),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)mapped_items_dealloc,
    .tp_traverse = (traverseproc)mapped_items_traverse,
    .tp_clear = (inquiry)mapped_items_clear,
    .tp_as_mapping = &mapped_items_mapping,
    .tp_methods = mapped_items_methods,
};

/*
 * fill_token_lists(documents: sequence of lists of int, end_token: int, out: writable int64 buffer)
 * Write each document's ids back to back into out, followed by end_token after every document when end_token >= 0.
 * The caller sizes out from the documents' lengths; anything else is refused: a length that does not fill out
 * exactly, an item that is not a list, an id that is not an int or does not fit int64 (no id is ever negative for a
 * tokenizer, but the values are copied as they are).
 */
static PyObject *fill_token_lists(PyObject *self, PyObject *args) {
    PyObject *documents_obj, *out_obj;
    long long end_token;
    if (!PyArg_ParseTuple(args, "OLO", &documents_obj, &end_token, &out_obj)) {
        return NULL;
    }
    PyObject *documents = PySequence_Fast(documents_obj, "documents must be a sequence of lists of token ids");
    if (documents == NULL) return NULL;
    Py_buffer out;
    if (get_buffer(out_obj, &out, 1, 8, "out") != 0) {
        Py_DECREF(documents);
        return NULL;
    }
    int64_t *to = (int64_t *)out.buf;
    Py_ssize_t room = out.len / 8, written = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(documents);
    PyObject **items = PySequence_Fast_ITEMS(documents);
    for (Py_ssize_t d = 0; d < count; ++d) {
        PyObject *ids = items[d];
        if (!PyList_Check(ids)) {
            PyErr_Format(PyExc_TypeError, "document %zd is a %s, expected a list of token ids", d, Py_TYPE(ids)->tp_name);
            goto fail;
        }
        Py_ssize_t length = PyList_GET_SIZE(ids);
        if (written + length + (end_token >= 0) > room) {
            PyErr_Format(PyExc_ValueError, "the documents hold more tokens than out's %zd", room);
            goto fail;
        }
        for (Py_ssize_t i = 0; i < length; ++i) {
            PyObject *id = PyList_GET_ITEM(ids, i);
            if (!PyLong_Check(id)) {
                PyErr_Format(PyExc_TypeError, "token %zd of document %zd is a %s, expected an int", i, d,
                             Py_TYPE(id)->tp_name);
                goto fail;
            }
            long long value = PyLong_AsLongLong(id);
            if (value == -1 && PyErr_Occurred()) goto fail;
            to[written++] = (int64_t)value;
        }
        if (end_token >= 0) to[written++] = (int64_t)end_token;
    }
    if (written != room) {
        PyErr_Format(PyExc_ValueError, "the documents hold %zd tokens but out has %zd", written, room);
        goto fail;
    }
    PyBuffer_Release(&out);
    Py_DECREF(documents);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&out);
    Py_DECREF(documents);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fill_sample_index", fill_sample_index, METH_VARARGS,
     "Fill rows 1..n of an int32/int64 [n+1, 2] sample index; Megatron's walk."},
    {"build_blending_indices", build_blending_indices, METH_VARARGS,
     "Fill (dataset_index int16, dataset_sample_index int64) for float64 weights; Megatron's schedule."},
    {"build_exhaustive_blending_indices", build_exhaustive_blending_indices, METH_VARARGS,
     "Fill (dataset_index int16, dataset_sample_index int64) using every sample of every dataset once."},
    {"legacy_shuffle", legacy_shuffle, METH_VARARGS,
     "Shuffle a 1-D array of 4- or 8-byte items as RandomState.shuffle does from MT19937 state (key, pos); "
     "advance key in place and return the new pos."},
    {"copy_ranges", copy_ranges, METH_VARARGS,
     "Copy the byte ranges (starts, counts) of source back to back into the writable buffer out."},
    {"split_views", split_views, METH_VARARGS,
     "Consecutive views of a 1-D contiguous array, one per int32 length, as a list."},
    {"fill_token_lists", fill_token_lists, METH_VARARGS,
     "Write lists of token ids back to back into the int64 buffer out, end_token after each when >= 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_indexed_helpers", NULL, -1, methods};

PyMODINIT_FUNC PyInit__indexed_helpers(void) {
    import_array();
    item_or_slice_name = PyUnicode_InternFromString("_item_or_slice");
    if (item_or_slice_name == NULL || PyType_Ready(&MappedItemsType) < 0) return NULL;
    PyObject *module_obj = PyModule_Create(&module);
    if (module_obj == NULL) return NULL;
    if (PyModule_AddObjectRef(module_obj, "MappedItems", (PyObject *)&MappedItemsType) != 0) {
        Py_DECREF(module_obj);
        return NULL;
    }
    return module_obj;
}
