/* What sarp._native's translation units share: each call lives in its own file
 * (_native.c: the read path and the module; native_pack.c: the write path;
 * native_events.c: the event decoder). */
#ifndef SARP_NATIVE_H
#define SARP_NATIVE_H
#include <Python.h>

PyObject *sarp_pack_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *sarp_decode_batch(PyObject *self, PyObject *arg);

#endif
