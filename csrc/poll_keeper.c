/* The HTTP front's poll keeper (radixserve/http/poll_keeper.py).
 *
 * A dashboard left open polls its figures again and again over one kept-alive
 * connection, each time with the very same request head. Once the front's protocol
 * has answered such a head itself (the figures were ready, the key checked), it hands
 * the connection here with that head ("learned"): one thread of its own, never holding
 * the GIL, runs every such connection with epoll and answers each request that is
 * byte for byte the learned head with the answer the front published for its route
 * (``set_answer``: the whole HTTP/1.1 response, headers and body), as many as arrive
 * pipelined, in order. Anything else goes back to the front's loop at once:
 *   - bytes that are not the learned head (another request, another header value),
 *     or the learned head while no answer is published (the figures not ready, the
 *     server draining): the connection leaves epoll and is handed back with every byte
 *     read from it (``take``: the token, the descriptor and those bytes), for the
 *     front's protocol to parse as if it had read them itself;
 *   - the peer closing, or an error on the socket: the connection is closed here and
 *     reported (``take``: the token and -1);
 *   - no byte read and no answer written for ``idle_ms``: closed and reported as the
 *     front closes an idle kept-alive connection, or handed back where part of a head
 *     waits (the front's own timeouts then apply).
 * A client that does not read its answers is not read either (its answer waits for
 * the socket to take it; the next head is read after), and closed when the socket
 * has taken nothing for ``idle_ms``.
 *
 * Answers are immutable buffers shared by reference: publishing a new one never waits
 * for a write in progress, which ends with the buffer it began with.
 *
 * Python API (every function takes the handle ``start`` returns):
 *   start(idle_ms)
 *   add(h, token, fd, head, route)           takes ownership of fd (non-blocking)
 *   set_answer(h, route, response | None)       route 0 or 1
 *   take(h) -> [(token, fd | -1, bytes)]         handed back, or closed (-1)
 *   fd(h) -> int                                 readable while take(h) has something
 *   stats(h) -> (connections held, requests answered so far)
 *   stop(h)                                      closes every connection, joins the thread
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "native_thread.h"

#define ROUTES 2
#define MAX_EVENTS 256
#define READ_SPARE 4096 /* read room past one head: pipelined heads come in one read */
#define MAX_HEAD 65536

typedef struct answer {
    int refs; /* atomic */
    size_t len;
    char data[];
} answer_t;

typedef struct conn {
    struct conn *prev, *next;
    long long token;
    int fd, route;
    uint32_t watching; /* EPOLLIN or EPOLLOUT */
    char *head;
    size_t head_len;
    char *in;
    size_t in_len, in_cap;
    answer_t *out; /* the answer being written, from out_off on */
    size_t out_off;
    int64_t active; /* the last byte read or written */
} conn_t;

typedef struct back {
    struct back *next;
    long long token;
    int fd; /* -1: closed here */
    char *data;
    size_t n;
} back_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_t thread;
    int epfd, wake_fd, back_fd;
    int stopping;
    int64_t idle_ns;
    long gap_ns; /* the least time between two waits that found something */
    /* under lock */
    answer_t *answers[ROUTES];
    conn_t *incoming;
    back_t *back_head, **back_tail;
    size_t n_conns;
    unsigned long long answered;
    /* the thread's own */
    conn_t *live;
} keeper_t;

enum { KEEP, BACK, CLOSE };

static void unref(answer_t *a) {
    if (a && __atomic_sub_fetch(&a->refs, 1, __ATOMIC_ACQ_REL) == 0) free(a);
}

static void free_conn(conn_t *c) {
    unref(c->out);
    free(c->head);
    free(c->in);
    free(c);
}

/* Take c out of the thread's list and of epoll; hand it back (its descriptor and the
 * bytes read) or close it and report it. */
static void release(keeper_t *s, conn_t *c, int how) {
    if (c->prev) c->prev->next = c->next;
    else s->live = c->next;
    if (c->next) c->next->prev = c->prev;
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    back_t *b = calloc(1, sizeof *b);
    if (how == BACK && b) {
        b->fd = c->fd;
        b->data = c->in; /* handed over with the connection */
        b->n = c->in_len;
        c->in = NULL;
    } else {
        close(c->fd);
        if (b) b->fd = -1;
    }
    pthread_mutex_lock(&s->lock);
    s->n_conns--;
    if (b) {
        b->token = c->token;
        *s->back_tail = b;
        s->back_tail = &b->next;
    }
    pthread_mutex_unlock(&s->lock);
    if (b) poke(s->back_fd);
    free_conn(c);
}

/* Write what is left of c's answer: 0 done or waiting for the socket, -1 failed. */
static int flush(conn_t *c, int64_t now) {
    while (c->out) {
        ssize_t n = send(c->fd, c->out->data + c->out_off, c->out->len - c->out_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR) continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
        }
        c->active = now;
        c->out_off += (size_t)n;
        if (c->out_off == c->out->len) {
            unref(c->out);
            c->out = NULL;
        }
    }
    return 0;
}

/* Answer every whole learned head read so far, in order, while the socket takes the
 * answers. KEEP (waiting for bytes or for the socket), BACK or CLOSE. */
static int serve(keeper_t *s, conn_t *c, int64_t now) {
    while (!c->out && c->in_len) {
        size_t m = c->in_len < c->head_len ? c->in_len : c->head_len;
        if (memcmp(c->in, c->head, m) != 0) return BACK;
        if (c->in_len < c->head_len) return KEEP; /* part of a head */
        pthread_mutex_lock(&s->lock);
        answer_t *a = s->answers[c->route];
        if (a) {
            __atomic_add_fetch(&a->refs, 1, __ATOMIC_ACQ_REL);
            s->answered++;
        }
        pthread_mutex_unlock(&s->lock);
        if (!a) return BACK;
        c->out = a;
        c->out_off = 0;
        c->in_len -= c->head_len;
        memmove(c->in, c->in + c->head_len, c->in_len);
        if (flush(c, now) != 0) return CLOSE;
    }
    return KEEP;
}

static int rewatch(keeper_t *s, conn_t *c) {
    uint32_t want = c->out ? EPOLLOUT : EPOLLIN;
    if (want == c->watching) return 0;
    struct epoll_event ev = {.events = want, .data.ptr = c};
    if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, c->fd, &ev) != 0) return -1;
    c->watching = want;
    return 0;
}

static void on_event(keeper_t *s, conn_t *c, uint32_t events, int64_t now) {
    int how = KEEP;
    if (c->out) {
        if (flush(c, now) != 0) how = CLOSE;
    } else if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
        ssize_t n;
        do n = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        if (n == 0) how = CLOSE;
        else if (n < 0) how = (errno == EAGAIN || errno == EWOULDBLOCK) ? KEEP : CLOSE;
        else {
            c->in_len += (size_t)n;
            c->active = now;
        }
    }
    if (how == KEEP) how = serve(s, c, now);
    if (how == KEEP && rewatch(s, c) != 0) how = CLOSE;
    if (how != KEEP) release(s, c, how);
}

/* The connections added since the last call (under lock). */
static conn_t *added(keeper_t *s) {
    pthread_mutex_lock(&s->lock);
    conn_t *c = s->incoming;
    s->incoming = NULL;
    pthread_mutex_unlock(&s->lock);
    return c;
}

static void take_incoming(keeper_t *s, int64_t now) {
    conn_t *c = added(s);
    while (c) {
        conn_t *next = c->next;
        c->prev = NULL;
        c->next = s->live;
        if (s->live) s->live->prev = c;
        s->live = c;
        c->active = now;
        c->watching = EPOLLIN;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0) release(s, c, CLOSE);
        c = next;
    }
}

static void sweep(keeper_t *s, int64_t now) {
    for (conn_t *c = s->live, *next; c; c = next) {
        next = c->next;
        if (now - c->active >= s->idle_ns) release(s, c, c->in_len && !c->out ? BACK : CLOSE);
    }
}

static void *run(void *arg) {
    keeper_t *s = arg;
    struct epoll_event events[MAX_EVENTS];
    int64_t tick = s->idle_ns / 4;
    if (tick < 10000000) tick = 10000000;
    if (tick > 1000000000) tick = 1000000000;
    int64_t next_sweep = now_ns() + tick;
    for (;;) {
        int64_t wait = next_sweep - now_ns();
        int n = epoll_wait(s->epfd, events, MAX_EVENTS, wait > 0 ? (int)(wait / 1000000) + 1 : 0);
        if (n < 0 && errno != EINTR) break;
        int64_t now = now_ns();
        int woken = 0;
        for (int i = 0; i < n; i++)
            if (events[i].data.ptr == NULL) {
                uint64_t v;
                ssize_t got = read(s->wake_fd, &v, sizeof v);
                (void)got;
                woken = 1;
            }
        if (woken) {
            pthread_mutex_lock(&s->lock);
            int stopping = s->stopping;
            pthread_mutex_unlock(&s->lock);
            if (stopping) break;
        }
        /* Events first: an event's connection may be released by a later one's only
         * through its own pointer, and each is visited once per wait. */
        for (int i = 0; i < n; i++)
            if (events[i].data.ptr) on_event(s, events[i].data.ptr, events[i].events, now);
        if (woken) take_incoming(s, now);
        if (now >= next_sweep) {
            sweep(s, now);
            next_sweep = now + tick;
        }
        if (s->gap_ns > 0 && n > 0) {
            /* Let the next requests gather: one wake-up answers them all. */
            struct timespec gap = {0, s->gap_ns};
            nanosleep(&gap, NULL);
        }
    }
    conn_t *c = added(s);
    while (c) {
        conn_t *next = c->next;
        close(c->fd);
        free_conn(c);
        c = next;
    }
    while (s->live) {
        c = s->live;
        s->live = c->next;
        close(c->fd);
        free_conn(c);
    }
    return NULL;
}

/* ---------------------------------------------------------------- Python */
static void join_thread(keeper_t *s) { stop_thread(&s->lock, &s->stopping, s->wake_fd, s->thread); }

static void destroy(PyObject *capsule) {
    keeper_t *s = PyCapsule_GetPointer(capsule, "poll_keeper");
    if (!s) return;
    if (!s->stopping) join_thread(s); /* never stopped: the thread must not outlive s */
    close(s->epfd);
    close(s->wake_fd);
    close(s->back_fd);
    while (s->back_head) {
        back_t *b = s->back_head;
        s->back_head = b->next;
        if (b->fd >= 0) close(b->fd);
        free(b->data);
        free(b);
    }
    for (int r = 0; r < ROUTES; r++) unref(s->answers[r]);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static keeper_t *handle(PyObject *obj) {
    keeper_t *s = PyCapsule_GetPointer(obj, "poll_keeper");
    if (s && s->stopping) {
        PyErr_SetString(PyExc_ValueError, "the poll keeper is stopped");
        return NULL;
    }
    return s;
}

static PyObject *py_start(PyObject *self, PyObject *args) {
    (void)self;
    long long idle_ms;
    int gap_us = 0;
    if (!PyArg_ParseTuple(args, "L|i", &idle_ms, &gap_us)) return NULL;
    if (idle_ms < 1 || gap_us < 0 || gap_us > 100000) {
        PyErr_SetString(PyExc_ValueError, "idle_ms must be at least 1, gap_us 0 to 100000");
        return NULL;
    }
    keeper_t *s = calloc(1, sizeof *s);
    if (!s) return PyErr_NoMemory();
    s->idle_ns = idle_ms * 1000000;
    s->gap_ns = (long)gap_us * 1000;
    s->back_tail = &s->back_head;
    s->epfd = s->wake_fd = s->back_fd = -1;
    if ((s->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
        (s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0 ||
        (s->back_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
        goto fail;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, s->wake_fd, &ev) != 0) goto fail;
    pthread_mutex_init(&s->lock, NULL);
    if (pthread_create(&s->thread, NULL, run, s) != 0) {
        pthread_mutex_destroy(&s->lock);
        goto fail;
    }
    return PyCapsule_New(s, "poll_keeper", destroy);
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    int all[] = {s->epfd, s->wake_fd, s->back_fd};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (all[i] >= 0) close(all[i]);
    free(s);
    return NULL;
}

static PyObject *py_add(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    long long token;
    int fd, route;
    Py_buffer head;
    if (!PyArg_ParseTuple(args, "OLiy*i", &h, &token, &fd, &head, &route)) return NULL;
    PyObject *result = NULL;
    keeper_t *s = handle(h);
    conn_t *c = NULL;
    if (!s) goto done;
    if (route < 0 || route >= ROUTES || head.len < 1 || head.len > MAX_HEAD) {
        PyErr_SetString(PyExc_ValueError, "a route is 0 or 1, a head 1 to 65536 bytes");
        goto done;
    }
    c = calloc(1, sizeof *c);
    size_t cap = (size_t)head.len + READ_SPARE;
    if (!c || !(c->head = malloc((size_t)head.len)) || !(c->in = malloc(cap))) {
        PyErr_NoMemory();
        goto done;
    }
    c->token = token;
    c->fd = fd;
    c->route = route;
    memcpy(c->head, head.buf, (size_t)head.len);
    c->head_len = (size_t)head.len;
    c->in_cap = cap;
    pthread_mutex_lock(&s->lock);
    c->next = s->incoming;
    s->incoming = c;
    s->n_conns++;
    pthread_mutex_unlock(&s->lock);
    c = NULL;
    poke(s->wake_fd);
    result = Py_None;
    Py_INCREF(result);
done:
    if (c) free_conn(c);
    PyBuffer_Release(&head);
    return result;
}

static PyObject *py_set_answer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h, *response;
    int route;
    if (!PyArg_ParseTuple(args, "OiO", &h, &route, &response)) return NULL;
    keeper_t *s = handle(h);
    if (!s) return NULL;
    if (route < 0 || route >= ROUTES) {
        PyErr_SetString(PyExc_ValueError, "a route is 0 or 1");
        return NULL;
    }
    answer_t *a = NULL;
    if (response != Py_None) {
        Py_buffer b;
        if (PyObject_GetBuffer(response, &b, PyBUF_SIMPLE) != 0) return NULL;
        a = malloc(sizeof *a + (size_t)b.len);
        if (!a) {
            PyBuffer_Release(&b);
            return PyErr_NoMemory();
        }
        a->refs = 1;
        a->len = (size_t)b.len;
        memcpy(a->data, b.buf, (size_t)b.len);
        PyBuffer_Release(&b);
    }
    pthread_mutex_lock(&s->lock);
    answer_t *old = s->answers[route];
    s->answers[route] = a;
    pthread_mutex_unlock(&s->lock);
    unref(old);
    Py_RETURN_NONE;
}

static PyObject *py_take(PyObject *self, PyObject *h) {
    (void)self;
    keeper_t *s = PyCapsule_GetPointer(h, "poll_keeper");
    if (!s) return NULL;
    uint64_t v;
    ssize_t got = read(s->back_fd, &v, sizeof v);
    (void)got;
    pthread_mutex_lock(&s->lock);
    back_t *b = s->back_head;
    s->back_head = NULL;
    s->back_tail = &s->back_head;
    pthread_mutex_unlock(&s->lock);
    PyObject *out = PyList_New(0);
    while (b) {
        back_t *next = b->next;
        PyObject *item = out ? Py_BuildValue("(Liy#)", b->token, b->fd, b->data ? b->data : "",
                                             (Py_ssize_t)b->n)
                             : NULL;
        if (!item || PyList_Append(out, item) != 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            if (b->fd >= 0) close(b->fd); /* no one can take it over now */
        } else {
            Py_DECREF(item);
        }
        free(b->data);
        free(b);
        b = next;
    }
    return out;
}

static PyObject *py_fd(PyObject *self, PyObject *h) {
    (void)self;
    keeper_t *s = PyCapsule_GetPointer(h, "poll_keeper");
    return s ? PyLong_FromLong(s->back_fd) : NULL;
}

static PyObject *py_stats(PyObject *self, PyObject *h) {
    (void)self;
    keeper_t *s = PyCapsule_GetPointer(h, "poll_keeper");
    if (!s) return NULL;
    pthread_mutex_lock(&s->lock);
    size_t n = s->n_conns;
    unsigned long long answered = s->answered;
    pthread_mutex_unlock(&s->lock);
    return Py_BuildValue("(nK)", (Py_ssize_t)n, answered);
}

static PyObject *py_stop(PyObject *self, PyObject *h) {
    (void)self;
    keeper_t *s = PyCapsule_GetPointer(h, "poll_keeper");
    if (!s) return NULL;
    if (s->stopping) Py_RETURN_NONE;
    join_thread(s);
    s->stopping = 2;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"start", py_start, METH_VARARGS, "start(idle_ms)"},
    {"add", py_add, METH_VARARGS,
     "add(h, token, fd, head, route): keep the connection (fd is owned)."},
    {"set_answer", py_set_answer, METH_VARARGS,
     "set_answer(h, route, response | None): the answer to a learned head of the route."},
    {"take", py_take, METH_O, "take(h) -> [(token, fd | -1, bytes read)], in order."},
    {"fd", py_fd, METH_O, "fd(h): readable while take(h) has something."},
    {"stats", py_stats, METH_O, "stats(h) -> (connections held, requests answered so far)."},
    {"stop", py_stop, METH_O, "stop(h): close every connection and join the thread."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_poll_keeper",
    "The HTTP front's poll keeper (csrc/poll_keeper.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__poll_keeper(void) { return PyModule_Create(&module); }
