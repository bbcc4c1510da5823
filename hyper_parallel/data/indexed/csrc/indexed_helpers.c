/*
 * Sequential index builders for hyper_parallel.data.indexed: the sample index and the blending indices.
 *
 * Both are walks where each step depends on the previous one. The blending schedule cannot be vectorised; the
 * sample index can (indexed_helpers.build_sample_index_numpy), but the benchmarks show a single pass here is 3-4x
 * faster on the document indices of multi-epoch blends (benchmarks/bench_indexed_dataset.py). The arithmetic
 * is plain IEEE double `weight * max(s, 1) - count`, scanned in ascending dataset order with a strict '>',
 * which is what Megatron-Core's helpers compute; the build disables floating-point contraction (FMA) so the
 * results do not depend on the processor.
 *
 * Arguments are Python buffers (numpy arrays) of exact dtypes; the Python wrapper checks them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

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

static PyMethodDef methods[] = {
    {"fill_sample_index", fill_sample_index, METH_VARARGS,
     "Fill rows 1..n of an int32/int64 [n+1, 2] sample index; Megatron's walk."},
    {"build_blending_indices", build_blending_indices, METH_VARARGS,
     "Fill (dataset_index int16, dataset_sample_index int64) for float64 weights; Megatron's schedule."},
    {"build_exhaustive_blending_indices", build_exhaustive_blending_indices, METH_VARARGS,
     "Fill (dataset_index int16, dataset_sample_index int64) using every sample of every dataset once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_indexed_helpers", NULL, -1, methods};

PyMODINIT_FUNC PyInit__indexed_helpers(void) { return PyModule_Create(&module); }
