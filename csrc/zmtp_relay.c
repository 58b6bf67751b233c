/* The routing-id gate's relay after the handshake (radixserve/utils/zmtp_gate.py).
 *
 * Once a connection's READY has been rewritten, its bytes pass unchanged both ways
 * until either end closes. This module does that outside the interpreter: one
 * thread of its own, never holding the GIL, runs every handed-over connection with
 * epoll and moves bytes with splice(2) through one pipe (each splice in is spliced
 * out, or read into the destination's buffer, before the next: the pipe is empty
 * between events). While a destination holds buffered bytes its source is not
 * read, so a slow reader backs up to its sender as on a direct connection. A side
 * that ends has what it sent passed on, then both sockets are closed and the
 * connection's id is reported (``closed``), with the eventfd ``notify_fd`` made
 * readable so the gate's own loop learns of it.
 *
 * Python API (all functions take the handle ``start`` returns):
 *   start() -> handle          the thread runs until stop()
 *   add(h, id, client_fd, upstream_fd)   takes ownership of both descriptors
 *   closed(h) -> list[int]     ids of connections closed since the last call
 *   notify_fd(h) -> int        readable while closed() has something
 *   stop(h)                    closes every connection, joins the thread
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "native_thread.h"
#include "zmtp_gone.h"

#define PIPE_BYTES (1 << 20)
#define SPLICE_FLAGS (SPLICE_F_MOVE | SPLICE_F_NONBLOCK)
#define MAX_EVENTS 256
#define SMALL_BYTES 16384

typedef struct conn conn_t;

typedef struct {
    conn_t *conn;
    int side; /* 0: the client, 1: the ROUTER */
} side_t;

struct conn {
    long long id;
    int fd[2];
    uint32_t events[2]; /* registered with epoll (0: not registered) */
    char *buf[2];       /* bytes waiting to be written to fd[i] */
    size_t len[2], off[2], cap[2];
    int ended; /* the side that closed first, or -1 */
    int closed; /* its sockets are closed; freed once the current epoll batch is through */
    side_t sides[2];
    conn_t *next, *prev; /* every live connection, for stop() */
};

typedef struct {
    long long id;
    int fd[2];
} pending_t;

typedef struct {
    int epfd, wake_fd, notify_fd, pipe_r, pipe_w;
    pthread_t thread;
    pthread_mutex_t lock;
    int stopping;
    pending_t *incoming; /* handed over, not yet registered (under lock) */
    size_t n_in, cap_in;
    gone_list_t gone; /* closed, not yet reported (under lock) */
    conn_t *live;
    conn_t *dead; /* closed during the current batch, freed after it */
} relay_t;

static int set_events(relay_t *r, conn_t *c, int side, uint32_t want) {
    uint32_t have = c->events[side];
    if (want == have) return 0;
    struct epoll_event ev = {.events = want, .data.ptr = &c->sides[side]};
    int rc;
    if (!want)
        rc = epoll_ctl(r->epfd, EPOLL_CTL_DEL, c->fd[side], NULL);
    else if (have)
        rc = epoll_ctl(r->epfd, EPOLL_CTL_MOD, c->fd[side], &ev);
    else
        rc = epoll_ctl(r->epfd, EPOLL_CTL_ADD, c->fd[side], &ev);
    if (rc == 0) c->events[side] = want;
    return rc;
}

static void report(relay_t *r, long long id) {
    pthread_mutex_lock(&r->lock);
    gone_push(&r->gone, id);
    pthread_mutex_unlock(&r->lock);
    uint64_t one = 1;
    ssize_t w = write(r->notify_fd, &one, sizeof one);
    (void)w;
}

static void close_conn(relay_t *r, conn_t *c) {
    for (int s = 0; s < 2; s++) {
        if (c->events[s]) epoll_ctl(r->epfd, EPOLL_CTL_DEL, c->fd[s], NULL);
        close(c->fd[s]);
        free(c->buf[s]);
        c->buf[s] = NULL;
    }
    if (c->prev) c->prev->next = c->next;
    else r->live = c->next;
    if (c->next) c->next->prev = c->prev;
    c->closed = 1;
    c->next = r->dead; /* a later event of this batch may still name it */
    r->dead = c;
    report(r, c->id);
}

static void free_dead(relay_t *r) {
    while (r->dead) {
        conn_t *c = r->dead;
        r->dead = c->next;
        free(c);
    }
}

/* Which events each side wants now; -1 if epoll refused (the connection is closed). */
static int update(relay_t *r, conn_t *c) {
    for (int s = 0; s < 2; s++) {
        int d = 1 - s;
        uint32_t want = 0;
        if (c->ended != s && c->len[d] == c->off[d]) want |= EPOLLIN;
        if (c->len[s] > c->off[s]) want |= EPOLLOUT;
        if (set_events(r, c, s, want) != 0) return -1;
    }
    return 0;
}

static int buffer(conn_t *c, int d, size_t need) {
    if (c->off[d] == c->len[d]) c->off[d] = c->len[d] = 0;
    if (c->len[d] + need <= c->cap[d]) return 0;
    size_t cap = c->cap[d] ? c->cap[d] : 65536;
    while (cap < c->len[d] + need) cap *= 2;
    char *grown = realloc(c->buf[d], cap);
    if (!grown) return -1;
    c->buf[d] = grown;
    c->cap[d] = cap;
    return 0;
}

/* Write what d's buffer holds; 0 on success (EAGAIN included), -1 on an error. */
static int flush(conn_t *c, int d) {
    while (c->off[d] < c->len[d]) {
        ssize_t n = send(c->fd[d], c->buf[d] + c->off[d], c->len[d] - c->off[d], MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
        }
        c->off[d] += (size_t)n;
    }
    return 0;
}

/* Send `n` bytes at `data` to side d; what it cannot take now goes to its buffer.
   0, or -1 on an error. */
static int forward(conn_t *c, int d, const char *data, size_t n) {
    size_t sent = 0;
    while (sent < n) {
        ssize_t out = send(c->fd[d], data + sent, n - sent, MSG_NOSIGNAL);
        if (out > 0) {
            sent += (size_t)out;
            continue;
        }
        if (out < 0 && errno == EINTR) continue;
        if (out < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        break;
    }
    if (sent < n) {
        if (buffer(c, d, n - sent) != 0) return -1;
        memcpy(c->buf[d] + c->len[d], data + sent, n - sent);
        c->len[d] += n - sent;
    }
    return 0;
}

/* Move what side s holds to the other side. 1: s ended, 0: go on, -1: an error.
   A read of up to SMALL_BYTES first (a request, a chunk: two plain syscalls); only
   when that fills, the rest goes by splice, which moves large frames without
   copying them through this process but costs more per call. */
static int pump(relay_t *r, conn_t *c, int s) {
    int d = 1 - s;
    char small[SMALL_BYTES];
    ssize_t got = recv(c->fd[s], small, sizeof small, 0);
    if (got == 0) return 1;
    if (got < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    if (forward(c, d, small, (size_t)got) != 0) return -1;
    if ((size_t)got < sizeof small || c->len[d] > c->off[d]) return 0;
    ssize_t n = splice(c->fd[s], NULL, r->pipe_w, NULL, PIPE_BYTES, SPLICE_FLAGS);
    if (n == 0) return 1;
    if (n < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    size_t left = (size_t)n;
    int failed = 0;
    while (left) {
        ssize_t out = splice(r->pipe_r, NULL, c->fd[d], NULL, left, SPLICE_FLAGS);
        if (out > 0) {
            left -= (size_t)out;
            continue;
        }
        if (out < 0 && errno == EINTR) continue;
        if (out < 0 && errno != EAGAIN && errno != EWOULDBLOCK) failed = 1;
        break;
    }
    if (left) { /* the destination is full (or failed): the rest waits in its buffer */
        if (buffer(c, d, left) != 0) failed = 1;
        while (left) {
            char scrap[65536];
            char *to = failed ? scrap : c->buf[d] + c->len[d];
            size_t want = failed && left > sizeof scrap ? sizeof scrap : left;
            ssize_t got = read(r->pipe_r, to, want);
            if (got <= 0) {
                if (got < 0 && errno == EINTR) continue;
                break; /* cannot happen: the pipe holds `left` bytes */
            }
            if (!failed) c->len[d] += (size_t)got;
            left -= (size_t)got;
        }
    }
    return failed ? -1 : 0;
}

static void on_event(relay_t *r, side_t *side, uint32_t events) {
    conn_t *c = side->conn;
    int s = side->side, d = 1 - s;
    if (c->closed) return;
    if (events & EPOLLOUT) {
        if (flush(c, s) != 0) {
            close_conn(r, c);
            return;
        }
        if (c->ended == d && c->off[s] == c->len[s]) { /* the other end's last bytes are through */
            close_conn(r, c);
            return;
        }
    }
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR) && c->ended != s && c->off[d] == c->len[d]) {
        int rc = pump(r, c, s);
        if (rc < 0) {
            close_conn(r, c);
            return;
        }
        if (rc == 1) {
            c->ended = s;
            if (c->off[d] == c->len[d]) {
                close_conn(r, c);
                return;
            }
        }
    }
    if (update(r, c) != 0) close_conn(r, c);
}

static void take_incoming(relay_t *r) {
    pthread_mutex_lock(&r->lock);
    pending_t *in = r->incoming;
    size_t n = r->n_in;
    r->incoming = NULL;
    r->n_in = r->cap_in = 0;
    pthread_mutex_unlock(&r->lock);
    for (size_t i = 0; i < n; i++) {
        conn_t *c = calloc(1, sizeof *c);
        if (!c) {
            close(in[i].fd[0]);
            close(in[i].fd[1]);
            report(r, in[i].id);
            continue;
        }
        c->id = in[i].id;
        c->ended = -1;
        for (int s = 0; s < 2; s++) {
            c->fd[s] = in[i].fd[s];
            c->sides[s].conn = c;
            c->sides[s].side = s;
        }
        c->next = r->live;
        if (r->live) r->live->prev = c;
        r->live = c;
        if (update(r, c) != 0) close_conn(r, c);
    }
    free(in);
}

static void *run(void *arg) {
    relay_t *r = arg;
    struct epoll_event events[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(r->epfd, events, MAX_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        int woken = 0;
        for (int i = 0; i < n; i++) {
            if (events[i].data.ptr == NULL) {
                uint64_t v;
                ssize_t got = read(r->wake_fd, &v, sizeof v);
                (void)got;
                woken = 1;
            }
        }
        if (woken) {
            pthread_mutex_lock(&r->lock);
            int stopping = r->stopping;
            pthread_mutex_unlock(&r->lock);
            if (stopping) break;
            take_incoming(r);
        }
        for (int i = 0; i < n; i++)
            if (events[i].data.ptr) on_event(r, events[i].data.ptr, events[i].events);
        free_dead(r);
    }
    while (r->live) close_conn(r, r->live);
    take_incoming(r); /* any handed over after the last wake: closed at once */
    while (r->live) close_conn(r, r->live);
    free_dead(r);
    return NULL;
}

/* Tell the relay thread to stop, wake it, and wait for it (without the GIL). */
static void join_thread(relay_t *r) { stop_thread(&r->lock, &r->stopping, r->wake_fd, r->thread); }

static void destroy(PyObject *capsule) {
    relay_t *r = PyCapsule_GetPointer(capsule, "zmtp_relay");
    if (!r) return;
    if (!r->stopping) join_thread(r); /* never stopped: the thread must not outlive r */
    close(r->epfd);
    close(r->wake_fd);
    close(r->notify_fd);
    close(r->pipe_r);
    close(r->pipe_w);
    free(r->incoming);
    free(r->gone.ids);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

static relay_t *handle(PyObject *obj) {
    relay_t *r = PyCapsule_GetPointer(obj, "zmtp_relay");
    if (r && r->stopping == 2) {
        PyErr_SetString(PyExc_ValueError, "the relay is stopped");
        return NULL;
    }
    return r;
}

static PyObject *py_start(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    relay_t *r = calloc(1, sizeof *r);
    if (!r) return PyErr_NoMemory();
    int fds[2];
    r->epfd = r->wake_fd = r->notify_fd = r->pipe_r = r->pipe_w = -1;
    if ((r->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
        (r->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0 ||
        (r->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0 ||
        pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0)
        goto fail;
    r->pipe_r = fds[0];
    r->pipe_w = fds[1];
    fcntl(r->pipe_w, F_SETPIPE_SZ, PIPE_BYTES); /* as large as allowed; smaller works too */
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, r->wake_fd, &ev) != 0) goto fail;
    pthread_mutex_init(&r->lock, NULL);
    if (pthread_create(&r->thread, NULL, run, r) != 0) {
        pthread_mutex_destroy(&r->lock);
        goto fail;
    }
    return PyCapsule_New(r, "zmtp_relay", destroy);
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    int all[] = {r->epfd, r->wake_fd, r->notify_fd, r->pipe_r, r->pipe_w};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (all[i] >= 0) close(all[i]);
    free(r);
    return NULL;
}

static PyObject *py_add(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    long long id;
    int cfd, ufd;
    if (!PyArg_ParseTuple(args, "OLii", &h, &id, &cfd, &ufd)) return NULL;
    relay_t *r = handle(h);
    if (!r) return NULL;
    pthread_mutex_lock(&r->lock);
    if (r->n_in == r->cap_in) {
        size_t cap = r->cap_in ? 2 * r->cap_in : 16;
        pending_t *grown = realloc(r->incoming, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&r->lock);
            return PyErr_NoMemory();
        }
        r->incoming = grown;
        r->cap_in = cap;
    }
    r->incoming[r->n_in++] = (pending_t){id, {cfd, ufd}};
    pthread_mutex_unlock(&r->lock);
    uint64_t one = 1;
    ssize_t w = write(r->wake_fd, &one, sizeof one);
    (void)w;
    Py_RETURN_NONE;
}

static PyObject *py_closed(PyObject *self, PyObject *h) {
    (void)self;
    relay_t *r = PyCapsule_GetPointer(h, "zmtp_relay");
    if (!r) return NULL;
    return gone_take(&r->gone, &r->lock, r->notify_fd);
}

static PyObject *py_notify_fd(PyObject *self, PyObject *h) {
    (void)self;
    relay_t *r = PyCapsule_GetPointer(h, "zmtp_relay");
    if (!r) return NULL;
    return PyLong_FromLong(r->notify_fd);
}

static PyObject *py_stop(PyObject *self, PyObject *h) {
    (void)self;
    relay_t *r = PyCapsule_GetPointer(h, "zmtp_relay");
    if (!r) return NULL;
    if (r->stopping) Py_RETURN_NONE;
    join_thread(r);
    r->stopping = 2;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"start", py_start, METH_NOARGS, "Start a relay thread; returns its handle."},
    {"add", py_add, METH_VARARGS, "add(h, id, client_fd, upstream_fd): relay them (owned)."},
    {"closed", py_closed, METH_O, "closed(h): ids of connections closed since the last call."},
    {"notify_fd", py_notify_fd, METH_O, "notify_fd(h): readable while closed(h) has ids."},
    {"stop", py_stop, METH_O, "stop(h): close every connection and join the thread."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_zmtp_relay",
    "The routing-id gate's relay after the handshake (csrc/zmtp_relay.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__zmtp_relay(void) { return PyModule_Create(&module); }
