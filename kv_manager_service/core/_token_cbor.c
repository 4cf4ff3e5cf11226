/* Canonical CBOR of token blocks: the one loop of block hashing that Python
 * cannot do fast. encode_blocks(token_ids, block_size, num_blocks, head, tail)
 * returns one bytes object per block: head + CBOR(token) for each token of the
 * block + tail. Token ids must be ints in 0..2**32-1; anything else raises.
 * The pure-Python twin is `hashing.encode_blocks_py`; tests compare them. */

#include "_token_cbor.h"
#include <string.h>

static PyObject *encode_blocks(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size, num_blocks;
    Py_buffer head, tail;
    if (!PyArg_ParseTuple(args, "Onny*y*", &tokens, &block_size, &num_blocks, &head, &tail)) return NULL;
    PyObject *result = NULL, *seq = NULL;
    unsigned char *buffer = NULL;
    seq = PySequence_Fast(tokens, "token_ids must be a sequence");
    if (seq == NULL) goto done;
    if (block_size < 1 || num_blocks < 0 || block_size * num_blocks > PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_ValueError, "block_size * num_blocks exceeds the number of tokens");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    buffer = PyMem_Malloc(head.len + TOKEN_CBOR_MAX * block_size + tail.len);
    if (buffer == NULL) { PyErr_NoMemory(); goto done; }
    memcpy(buffer, head.buf, head.len);
    result = PyList_New(num_blocks);
    if (result == NULL) goto done;
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        Py_ssize_t n = head.len;
        for (Py_ssize_t i = b * block_size; i < (b + 1) * block_size; i++) {
            uint32_t token;
            if (read_token_at(seq, &items, i, num_blocks * block_size, &token) < 0) goto fail;
            n += put_token(buffer + n, token);
        }
        memcpy(buffer + n, tail.buf, tail.len);
        PyObject *block = PyBytes_FromStringAndSize((const char *)buffer, n + tail.len);
        if (block == NULL) goto fail;
        PyList_SET_ITEM(result, b, block);
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    PyMem_Free(buffer);
    Py_XDECREF(seq);
    PyBuffer_Release(&head);
    PyBuffer_Release(&tail);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_blocks", encode_blocks, METH_VARARGS, "head + CBOR(tokens) + tail, per block of token ids."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_token_cbor", NULL, -1, methods};

PyMODINIT_FUNC PyInit__token_cbor(void) { return PyModule_Create(&module); }
