/* Token ids read from Python and written as canonical CBOR (major type 0,
 * shortest form), shared by the C extensions of block hashing. Token ids are
 * ints (or int-likes) in 0..2**32-1. */

#ifndef KV_MANAGER_TOKEN_CBOR_H
#define KV_MANAGER_TOKEN_CBOR_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The most bytes one token id takes. */
#define TOKEN_CBOR_MAX 5

/* Reads `item` as a token id into *out. Returns 0 for an int, 1 for an
 * int-like whose __index__ ran (Python code, which may have changed the
 * sequence being read: see read_token_at), -1 with an exception set
 * (TypeError for a non-int, OverflowError outside 0..2**32-1). */
static inline int read_token_id(PyObject *item, uint32_t *out) {
    unsigned long value;
    int ran_python = 0;
    if (PyLong_CheckExact(item)) {
        value = PyLong_AsUnsignedLong(item);
    } else {
        PyObject *index = PyNumber_Index(item);
        if (index == NULL) return -1;
        value = PyLong_AsUnsignedLong(index);
        Py_DECREF(index);
        ran_python = 1;
    }
    if (value == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (value > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_OverflowError, "token id exceeds 2**32-1");
        return -1;
    }
    *out = (uint32_t)value;
    return ran_python;
}

/* Reads token `i` of `seq` (from PySequence_Fast) into *out; 0 or -1 with an
 * exception set. *items caches PySequence_Fast_ITEMS(seq) and is re-read after
 * an __index__ ran, which may have resized the list; fewer than `num_needed`
 * items left is then an error. */
static inline int read_token_at(PyObject *seq, PyObject ***items, Py_ssize_t i, Py_ssize_t num_needed,
                                uint32_t *out) {
    int read = read_token_id((*items)[i], out);
    if (read <= 0) return read;
    if (PySequence_Fast_GET_SIZE(seq) < num_needed) {
        PyErr_SetString(PyExc_RuntimeError, "token_ids changed size while being read");
        return -1;
    }
    *items = PySequence_Fast_ITEMS(seq);
    return 0;
}

/* Writes the CBOR of token id `t` at `out`; returns the number of bytes (1..5). */
static inline Py_ssize_t put_token(unsigned char *out, uint32_t t) {
    if (t < 24) { out[0] = (unsigned char)t; return 1; }
    if (t < 0x100) { out[0] = 24; out[1] = (unsigned char)t; return 2; }
    if (t < 0x10000) { out[0] = 25; out[1] = (unsigned char)(t >> 8); out[2] = (unsigned char)t; return 3; }
    out[0] = 26;
    out[1] = (unsigned char)(t >> 24); out[2] = (unsigned char)(t >> 16);
    out[3] = (unsigned char)(t >> 8); out[4] = (unsigned char)t;
    return 5;
}

#endif
