/* The ids of closed connections a native thread reports to Python, shared by the
 * public port's ZMTP server (zmtp_server.c) and its relay (zmtp_relay.c): the thread
 * appends under its lock, the caller of closed() takes the whole list under it.
 * Include after Python.h and pthread.h. */
#ifndef RADIXSERVE_ZMTP_GONE_H
#define RADIXSERVE_ZMTP_GONE_H

#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct {
    long long *ids;
    size_t n, cap;
} gone_list_t;

/* Append id (the caller holds the lock). Where the list cannot grow the id is dropped:
 * its requests are then aborted when the tokenizer next finds the connection gone. */
static void gone_push(gone_list_t *g, long long id) {
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 64;
        long long *grown = realloc(g->ids, cap * sizeof *grown);
        if (grown) {
            g->ids = grown;
            g->cap = cap;
        }
    }
    if (g->n < g->cap) g->ids[g->n++] = id;
}

/* Every id reported so far, as a Python list, the list emptied (under lock); the
 * eventfd notify_fd read so that it is readable again only for later reports. */
static PyObject *gone_take(gone_list_t *g, pthread_mutex_t *lock, int notify_fd) {
    uint64_t v;
    ssize_t got = read(notify_fd, &v, sizeof v);
    (void)got;
    pthread_mutex_lock(lock);
    gone_list_t taken = *g;
    g->ids = NULL;
    g->n = g->cap = 0;
    pthread_mutex_unlock(lock);
    PyObject *out = PyList_New((Py_ssize_t)taken.n);
    for (size_t i = 0; out && i < taken.n; i++) {
        PyObject *item = PyLong_FromLongLong(taken.ids[i]);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    free(taken.ids);
    return out;
}

#endif
