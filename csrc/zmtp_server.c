/* The public TCP port's ZMTP server (radixserve/utils/zmtp_server.py).
 *
 * The routing-id gate (radixserve/utils/zmtp_gate.py) accepts each TCP connection,
 * applies the connection limits, sends the server's greeting and READY and checks the
 * peer's (ZMTP 3, NULL, a DEALER, REQ or ROUTER peer). A NULL connection then comes
 * here, with the routing id the gate drew for it: no libzmq socket stands behind it.
 *
 * One thread of its own, never holding the GIL, runs every connection with epoll:
 *   - it reads ZMTP 3.x frames (short and long, MORE, commands), answers PING with
 *     PONG, sends its own PING every heartbeat interval and closes a connection that
 *     has sent nothing for the heartbeat timeout after a PING (as libzmq's
 *     ZMQ_HEARTBEAT_IVL and ZMQ_HEARTBEAT_TIMEOUT do);
 *   - a message larger than max_message_bytes (all its frames together), a command
 *     over MAX_COMMAND bytes, a frame with reserved flag bits, a command with MORE, or
 *     an ERROR command closes that connection (libzmq's ROUTER drops a connection on
 *     an over-size message as well);
 *   - each complete message is queued with the connection's routing id for the
 *     Python loop (``take``), which polls the eventfd ``fd``; so is each close
 *     (``None`` in place of the frames). A connection with max_unread messages
 *     waiting there is not read until the loop takes them (a client that floods
 *     backs up to its own socket, as a ROUTER's RCVHWM does).
 *
 * Replies (``send``) are written from the caller's thread straight to the socket when
 * nothing is waiting for that connection: no thread hop. What the socket cannot take
 * now goes to the connection's outbox, which the thread flushes when the socket is
 * writable; a connection with max_queued replies waiting refuses more (``send``
 * returns SEND_FULL, as a ROUTER's SNDHWM does). One mutex guards the connection
 * table and every outbox, and every write and close happens under it, so a reply
 * never reaches a descriptor that a closed connection freed for another.
 *
 * Python API (every function takes the handle ``start`` returns):
 *   start(max_message_bytes, max_queued, max_unread, heartbeat_ivl_ms,
 *         heartbeat_timeout_ms)
 *   add(h, token, fd, routing_id, received, unsent)   takes ownership of fd
 *   take(h) -> [(routing_id, [frame, ...] | None)]    messages and closes, in order
 *   fd(h) -> int                readable while take(h) has something
 *   send(h, routing_id, frames) -> SEND_OK | SEND_UNKNOWN | SEND_FULL
 *   closed(h) -> [token]        tokens of connections closed since the last call
 *   notify_fd(h) -> int         readable while closed(h) has tokens
 *   unsent(h) -> int            connections whose outbox holds bytes
 *   count(h) -> int             connections open
 *   stop(h)                     closes every connection, joins the thread
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
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "native_thread.h"
#include "zmtp_gone.h"

#define RID_BYTES 16
#define MAX_EVENTS 256
#define READ_BYTES 65536
#define DIRECT_READ 16384   /* a frame body with this much left is read into place */
#define MAX_COMMAND 65536   /* PING, PONG, ERROR: a few bytes; anything larger is abuse */
#define MAX_FRAMES 1024     /* frames of one message */
#define READS_PER_EVENT 8   /* then the next connection's turn */
#define MAX_IOV 64
#define SEND_OK 0
#define SEND_UNKNOWN 1
#define SEND_FULL 2

#define F_MORE 0x01
#define F_LONG 0x02
#define F_COMMAND 0x04
#define F_RESERVED 0xF8

typedef struct chunk {
    struct chunk *next;
    size_t len, off;
    int counted; /* a reply (counts against max_queued), not a command */
    char data[];
} chunk_t;

typedef struct {
    char *data;
    size_t len;
} frame_t;

/* A queued message (frames != NULL) or close (frames == NULL), for ``take``. */
typedef struct event {
    struct event *next;
    unsigned char rid[RID_BYTES];
    frame_t *frames;
    size_t n;
} event_t;

typedef struct conn {
    unsigned char rid[RID_BYTES];
    long long token;
    int fd;
    int registered;  /* with epoll: the thread registers an added connection */
    uint32_t events; /* what it is registered for */
    int closed;
    /* the frame being read (the thread only) */
    unsigned char head[9];
    size_t head_len, head_want;
    int flags;
    uint64_t size, got;
    char *body;
    frame_t *frames; /* the message being read */
    size_t n_frames, cap_frames;
    uint64_t msg_bytes;
    /* heartbeats (the thread only) */
    int64_t next_ping, ping_sent; /* ping_sent: an unanswered PING's time, or 0 */
    /* under the lock */
    chunk_t *out_head, *out_tail;
    size_t out_count; /* counted chunks in the outbox */
    size_t in_count;  /* messages queued for take() */
    int paused;       /* not read: in_count reached max_unread */
    struct conn *hnext;             /* hash chain */
    struct conn *next, *prev;       /* every live connection */
    struct conn *in_next;           /* added, not yet registered */
    char *received;                 /* bytes the gate read past READY */
    size_t n_received;
} conn_t;

typedef struct {
    int epfd, wake_fd, take_fd, notify_fd;
    pthread_t thread;
    pthread_mutex_t lock;
    int stopping; /* 1: asked to stop; 2: stopped */
    int64_t max_message, heartbeat_ivl, heartbeat_timeout; /* ns; < 0: no limit */
    size_t max_queued, max_unread; /* replies unsent, messages untaken, per connection */
    conn_t **table; /* by routing id, chained */
    size_t buckets, n_conns, n_unsent;
    conn_t *live;     /* registered connections (the thread's) */
    conn_t *incoming; /* added, not yet registered (under the lock) */
    int resume; /* a paused connection may be read again */
    event_t *ev_head, *ev_tail;
    gone_list_t gone; /* closed, not yet reported (under lock) */
    conn_t *dead; /* closed during the current epoll batch, freed after it */
} server_t;


/* ------------------------------------------------------------- the table */
static size_t bucket_of(server_t *s, const unsigned char *rid) {
    uint64_t h;
    memcpy(&h, rid + 1, sizeof h); /* drawn at random: any 8 bytes hash well */
    return (size_t)(h & (s->buckets - 1));
}

static conn_t *lookup(server_t *s, const unsigned char *rid) {
    for (conn_t *c = s->table[bucket_of(s, rid)]; c; c = c->hnext)
        if (memcmp(c->rid, rid, RID_BYTES) == 0) return c;
    return NULL;
}

static void table_grow(server_t *s) {
    size_t buckets = s->buckets * 2;
    conn_t **grown = calloc(buckets, sizeof *grown);
    if (!grown) return; /* longer chains; still correct */
    conn_t **old = s->table;
    size_t n = s->buckets;
    s->table = grown;
    s->buckets = buckets;
    for (size_t i = 0; i < n; i++)
        for (conn_t *c = old[i], *next; c; c = next) {
            next = c->hnext;
            size_t b = bucket_of(s, c->rid);
            c->hnext = s->table[b];
            s->table[b] = c;
        }
    free(old);
}

static void table_remove(server_t *s, conn_t *c) {
    conn_t **at = &s->table[bucket_of(s, c->rid)];
    while (*at && *at != c) at = &(*at)->hnext;
    if (*at) *at = c->hnext;
}

/* ------------------------------------------------------------ the outbox */
/* Write what the outbox holds (under the lock). 0, or -1 on an error. */
static int flush_locked(conn_t *c) {
    while (c->out_head) {
        struct iovec iov[MAX_IOV];
        int n = 0;
        for (chunk_t *k = c->out_head; k && n < MAX_IOV; k = k->next, n++) {
            iov[n].iov_base = k->data + k->off;
            iov[n].iov_len = k->len - k->off;
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t out = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (out < 0) {
            if (errno == EINTR) continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
        }
        size_t left = (size_t)out;
        while (c->out_head && left >= c->out_head->len - c->out_head->off) {
            chunk_t *k = c->out_head;
            left -= k->len - k->off;
            c->out_head = k->next;
            c->out_count -= (size_t)k->counted;
            free(k);
        }
        if (!c->out_head) c->out_tail = NULL;
        else c->out_head->off += left;
        if (out == 0) break;
    }
    return 0;
}

/* Read unless paused, watch writability while the outbox holds bytes (under the lock).
   Registered for neither, epoll still reports a hang-up or an error. */
static void watch(server_t *s, conn_t *c) {
    uint32_t want = (c->paused ? 0 : EPOLLIN) | (c->out_head ? EPOLLOUT : 0);
    if (!c->registered || want == c->events) return; /* not registered yet: take_incoming does */
    struct epoll_event ev = {.events = want, .data.ptr = c};
    if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, c->fd, &ev) == 0) c->events = want;
}

static void count_unsent(server_t *s, conn_t *c, int had) {
    int has = c->out_head != NULL;
    if (has != had) s->n_unsent += has ? 1 : (size_t)-1;
}

/* Append `n` bytes from the iovecs, `skip` bytes in, as one chunk. */
static int append(conn_t *c, const struct iovec *iov, int n_iov, size_t skip, size_t n,
                  int counted) {
    chunk_t *k = malloc(sizeof *k + n);
    if (!k) return -1;
    k->next = NULL;
    k->len = n;
    k->off = 0;
    k->counted = counted;
    size_t at = 0;
    for (int i = 0; i < n_iov && at < n; i++) {
        size_t len = iov[i].iov_len;
        if (skip >= len) {
            skip -= len;
            continue;
        }
        memcpy(k->data + at, (char *)iov[i].iov_base + skip, len - skip);
        at += len - skip;
        skip = 0;
    }
    if (c->out_tail) c->out_tail->next = k;
    else c->out_head = k;
    c->out_tail = k;
    c->out_count += (size_t)counted;
    return 0;
}

/* Send the iovecs at once if nothing waits before them, the rest to the outbox
   (under the lock). -1: the connection failed (its reader will close it). */
static int write_locked(server_t *s, conn_t *c, struct iovec *iov, int n_iov, int counted) {
    size_t total = 0;
    for (int i = 0; i < n_iov; i++) total += iov[i].iov_len;
    size_t sent = 0;
    int had = c->out_head != NULL;
    if (!had) {
        for (;;) {
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n_iov};
            ssize_t out = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (out >= 0) {
                sent = (size_t)out;
                break;
            }
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
            break;
        }
    }
    if (sent < total) {
        if (append(c, iov, n_iov, sent, total - sent, counted) != 0) return -1;
        count_unsent(s, c, had);
        watch(s, c);
    }
    return 0;
}

/* A command from the thread (PING, PONG): after the replies queued before it. */
static void command(server_t *s, conn_t *c, const char *name, const char *data, size_t n) {
    unsigned char head[2 + 1 + 4];
    size_t name_len = strlen(name);
    head[0] = F_COMMAND;
    head[1] = (unsigned char)(1 + name_len + n);
    head[2] = (unsigned char)name_len;
    memcpy(head + 3, name, name_len);
    struct iovec iov[2] = {{head, 3 + name_len}, {(void *)data, n}};
    pthread_mutex_lock(&s->lock);
    write_locked(s, c, iov, 2, 0);
    pthread_mutex_unlock(&s->lock);
}

/* --------------------------------------------------------------- events */
static void push_event(server_t *s, event_t *e) {
    e->next = NULL;
    if (s->ev_tail) s->ev_tail->next = e;
    else s->ev_head = e;
    s->ev_tail = e;
}

static void free_frames(frame_t *frames, size_t n) {
    for (size_t i = 0; i < n; i++) free(frames[i].data);
    free(frames);
}

static void close_conn(server_t *s, conn_t *c) {
    if (c->closed) return;
    event_t *e = calloc(1, sizeof *e);
    pthread_mutex_lock(&s->lock);
    c->closed = 1;
    table_remove(s, c);
    if (c->registered) epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    count_unsent(s, c, c->out_head != NULL);
    while (c->out_head) {
        chunk_t *k = c->out_head;
        c->out_head = k->next;
        free(k);
    }
    c->out_tail = NULL;
    if (c->prev) c->prev->next = c->next;
    else s->live = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_conns--;
    if (e && s->stopping == 0) {
        memcpy(e->rid, c->rid, RID_BYTES);
        push_event(s, e);
        e = NULL;
    }
    gone_push(&s->gone, c->token);
    pthread_mutex_unlock(&s->lock);
    free(e);
    poke(s->take_fd);
    poke(s->notify_fd);
    free(c->body);
    c->body = NULL;
    free_frames(c->frames, c->n_frames);
    c->frames = NULL;
    c->n_frames = 0;
    free(c->received);
    c->received = NULL;
    c->next = s->dead; /* a later event of this batch may still name it */
    s->dead = c;
}

/* The message read is complete: queue it for take(). */
static int deliver(server_t *s, conn_t *c) {
    event_t *e = malloc(sizeof *e);
    if (!e) return -1;
    memcpy(e->rid, c->rid, RID_BYTES);
    e->frames = c->frames;
    e->n = c->n_frames;
    c->frames = NULL;
    c->n_frames = c->cap_frames = 0;
    c->msg_bytes = 0;
    pthread_mutex_lock(&s->lock);
    push_event(s, e);
    if (++c->in_count >= s->max_unread) {
        c->paused = 1;
        watch(s, c);
    }
    pthread_mutex_unlock(&s->lock);
    poke(s->take_fd);
    return 0;
}

/* ------------------------------------------------------------- reading */
/* A command received. 0, or -1: close the connection. */
static int on_command(server_t *s, conn_t *c) {
    const unsigned char *b = (const unsigned char *)c->body;
    size_t n = c->size;
    if (n < 1 || (size_t)b[0] + 1 > n) return -1;
    size_t name_len = b[0];
    const char *name = (const char *)b + 1;
    if (name_len == 4 && memcmp(name, "PING", 4) == 0) {
        if (n < 1 + 4 + 2 || n - 7 > 16) return -1; /* TTL, then a context of <= 16 bytes */
        command(s, c, "PONG", (const char *)b + 7, n - 7);
    } else if (name_len == 5 && memcmp(name, "ERROR", 5) == 0) {
        return -1;
    }
    /* PONG: any bytes received answer a PING already. Other commands: ignored, as
       libzmq ignores those it does not know. */
    return 0;
}

/* The frame whose header is in c->head is complete (body read). */
static int on_frame(server_t *s, conn_t *c) {
    if (c->flags & F_COMMAND) {
        int rc = on_command(s, c);
        free(c->body);
        c->body = NULL;
        return rc;
    }
    if (c->n_frames == c->cap_frames) {
        size_t cap = c->cap_frames ? 2 * c->cap_frames : 2;
        frame_t *grown = realloc(c->frames, cap * sizeof *grown);
        if (!grown) return -1;
        c->frames = grown;
        c->cap_frames = cap;
    }
    c->frames[c->n_frames++] = (frame_t){c->body, c->size};
    c->body = NULL;
    if (c->flags & F_MORE) return c->n_frames < MAX_FRAMES ? 0 : -1;
    return deliver(s, c);
}

/* A header is complete: check it, allocate the body. */
static int on_header(server_t *s, conn_t *c) {
    c->flags = c->head[0];
    if (c->flags & F_RESERVED) return -1;
    if ((c->flags & F_COMMAND) && (c->flags & F_MORE)) return -1;
    uint64_t size = 0;
    for (size_t i = 1; i < c->head_len; i++) size = (size << 8) | c->head[i];
    if (c->flags & F_COMMAND) {
        if (size > MAX_COMMAND) return -1;
    } else {
        c->msg_bytes += size;
        if (s->max_message >= 0 && c->msg_bytes > (uint64_t)s->max_message) return -1;
        if (size > (uint64_t)PY_SSIZE_T_MAX) return -1;
    }
    c->size = size;
    c->got = 0;
    c->body = malloc(size ? size : 1);
    return c->body ? 0 : -1;
}

/* Parse `n` bytes read. 0, or -1: close the connection. */
static int consume(server_t *s, conn_t *c, const unsigned char *p, size_t n) {
    while (n) {
        if (!c->body) { /* a header */
            if (c->head_len == 0) c->head_want = (p[0] & F_LONG) ? 9 : 2;
            size_t take = c->head_want - c->head_len;
            if (take > n) take = n;
            memcpy(c->head + c->head_len, p, take);
            c->head_len += take;
            p += take;
            n -= take;
            if (c->head_len < c->head_want) return 0;
            if (on_header(s, c) != 0) return -1;
            c->head_len = 0;
        }
        size_t take = c->size - c->got < n ? (size_t)(c->size - c->got) : n;
        memcpy(c->body + c->got, p, take);
        c->got += take;
        p += take;
        n -= take;
        if (c->got == c->size && on_frame(s, c) != 0) return -1;
    }
    return 0;
}

/* Read what the socket holds. 0, or -1: close (the peer closed, or an error). */
static int on_readable(server_t *s, conn_t *c) {
    static __thread unsigned char buf[READ_BYTES];
    for (int i = 0; i < READS_PER_EVENT && !c->paused; i++) {
        ssize_t got;
        if (c->body && c->size - c->got >= DIRECT_READ) { /* a large body: into place */
            got = recv(c->fd, c->body + c->got, (size_t)(c->size - c->got), 0);
            if (got > 0) {
                c->ping_sent = 0;
                c->got += (uint64_t)got;
                if (c->got == c->size && on_frame(s, c) != 0) return -1;
                continue;
            }
        } else {
            got = recv(c->fd, buf, sizeof buf, 0);
            if (got > 0) {
                c->ping_sent = 0;
                if (consume(s, c, buf, (size_t)got) != 0) return -1;
                if ((size_t)got < sizeof buf) return 0;
                continue;
            }
        }
        if (got == 0) return -1;
        return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    }
    return 0;
}

static void on_event(server_t *s, conn_t *c, uint32_t events) {
    if (c->closed) return;
    if (events & EPOLLOUT) {
        pthread_mutex_lock(&s->lock);
        int had = c->out_head != NULL;
        int rc = flush_locked(c);
        count_unsent(s, c, had);
        if (rc == 0) watch(s, c);
        pthread_mutex_unlock(&s->lock);
        if (rc != 0) {
            close_conn(s, c);
            return;
        }
    }
    if (events & (EPOLLHUP | EPOLLERR) && c->paused) {
        close_conn(s, c); /* gone while not read: its last bytes have no one to answer */
        return;
    }
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR) && on_readable(s, c) != 0) close_conn(s, c);
}

/* --------------------------------------------------------------- the loop */
static void take_incoming(server_t *s) {
    pthread_mutex_lock(&s->lock);
    conn_t *in = s->incoming;
    s->incoming = NULL;
    int resume = s->resume;
    s->resume = 0;
    pthread_mutex_unlock(&s->lock);
    int64_t now = now_ns();
    while (in) {
        conn_t *c = in;
        in = c->in_next;
        c->next_ping = s->heartbeat_ivl > 0 ? now + s->heartbeat_ivl : 0;
        pthread_mutex_lock(&s->lock);
        c->next = s->live; /* the live list is this thread's: no other walks it */
        if (s->live) s->live->prev = c;
        s->live = c;
        uint32_t want = EPOLLIN | (c->out_head ? EPOLLOUT : 0);
        struct epoll_event ev = {.events = want, .data.ptr = c};
        int rc = epoll_ctl(s->epfd, EPOLL_CTL_ADD, c->fd, &ev);
        if (rc == 0) {
            c->registered = 1;
            c->events = want;
        }
        pthread_mutex_unlock(&s->lock);
        if (rc != 0 || (c->n_received &&
                        consume(s, c, (unsigned char *)c->received, c->n_received) != 0)) {
            close_conn(s, c);
            continue;
        }
        free(c->received);
        c->received = NULL;
    }
    if (resume) {
        pthread_mutex_lock(&s->lock);
        for (conn_t *c = s->live; c; c = c->next)
            if (c->paused && c->in_count < s->max_unread) {
                c->paused = 0;
                watch(s, c);
            }
        pthread_mutex_unlock(&s->lock);
    }
}

/* Ping every connection whose interval is up; close those that did not answer. */
static void heartbeats(server_t *s, int64_t now) {
    static const char ttl[2] = {0, 0}; /* no TTL asked of the peer: its own timeout rules */
    for (conn_t *c = s->live, *next; c; c = next) {
        next = c->next;
        if (!c->registered) continue;
        if (c->paused) { /* not read on purpose: its silence is not its fault */
            c->ping_sent = 0;
            continue;
        }
        if (c->ping_sent && now - c->ping_sent >= s->heartbeat_timeout) {
            close_conn(s, c);
            continue;
        }
        if (now >= c->next_ping) {
            command(s, c, "PING", ttl, sizeof ttl);
            if (!c->ping_sent) c->ping_sent = now;
            c->next_ping = now + s->heartbeat_ivl;
        }
    }
}

static void free_dead(server_t *s) {
    while (s->dead) {
        conn_t *c = s->dead;
        s->dead = c->next;
        free(c);
    }
}

static void *run(void *arg) {
    server_t *s = arg;
    struct epoll_event events[MAX_EVENTS];
    int beats = s->heartbeat_ivl > 0 && s->heartbeat_timeout > 0;
    int64_t tick = 0;
    if (beats) {
        tick = (s->heartbeat_ivl < s->heartbeat_timeout ? s->heartbeat_ivl : s->heartbeat_timeout) / 4;
        if (tick < 1000000) tick = 1000000;
    }
    int64_t next_beat = beats ? now_ns() + tick : 0;
    for (;;) {
        int timeout = -1;
        if (beats) {
            int64_t wait = next_beat - now_ns();
            timeout = wait > 0 ? (int)(wait / 1000000) + 1 : 0;
        }
        int n = epoll_wait(s->epfd, events, MAX_EVENTS, timeout);
        if (n < 0 && errno != EINTR) break;
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
            take_incoming(s);
        }
        for (int i = 0; i < n; i++)
            if (events[i].data.ptr) on_event(s, events[i].data.ptr, events[i].events);
        if (beats) {
            int64_t now = now_ns();
            if (now >= next_beat) {
                heartbeats(s, now);
                next_beat = now + tick;
            }
        }
        free_dead(s);
    }
    take_incoming(s);
    while (s->live) close_conn(s, s->live);
    free_dead(s);
    return NULL;
}

/* ---------------------------------------------------------------- Python */
static void join_thread(server_t *s) { stop_thread(&s->lock, &s->stopping, s->wake_fd, s->thread); }

static void destroy(PyObject *capsule) {
    server_t *s = PyCapsule_GetPointer(capsule, "zmtp_server");
    if (!s) return;
    if (!s->stopping) join_thread(s); /* never stopped: the thread must not outlive s */
    close(s->epfd);
    close(s->wake_fd);
    close(s->take_fd);
    close(s->notify_fd);
    while (s->ev_head) {
        event_t *e = s->ev_head;
        s->ev_head = e->next;
        free_frames(e->frames, e->n);
        free(e);
    }
    free(s->gone.ids);
    free(s->table);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static server_t *handle(PyObject *obj) {
    server_t *s = PyCapsule_GetPointer(obj, "zmtp_server");
    if (s && s->stopping) {
        PyErr_SetString(PyExc_ValueError, "the ZMTP server is stopped");
        return NULL;
    }
    return s;
}

static PyObject *py_start(PyObject *self, PyObject *args) {
    (void)self;
    long long max_message, ivl_ms, timeout_ms;
    Py_ssize_t max_queued, max_unread;
    if (!PyArg_ParseTuple(args, "LnnLL", &max_message, &max_queued, &max_unread, &ivl_ms,
                          &timeout_ms))
        return NULL;
    if (max_queued < 1 || max_unread < 1) {
        PyErr_SetString(PyExc_ValueError, "max_queued and max_unread must be at least 1");
        return NULL;
    }
    server_t *s = calloc(1, sizeof *s);
    if (!s) return PyErr_NoMemory();
    s->max_message = max_message;
    s->max_queued = (size_t)max_queued;
    s->max_unread = (size_t)max_unread;
    s->heartbeat_ivl = ivl_ms * 1000000;
    s->heartbeat_timeout = timeout_ms * 1000000;
    s->buckets = 1024;
    s->table = calloc(s->buckets, sizeof *s->table);
    s->epfd = s->wake_fd = s->take_fd = s->notify_fd = -1;
    if (!s->table || (s->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
        (s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0 ||
        (s->take_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0 ||
        (s->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
        goto fail;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, s->wake_fd, &ev) != 0) goto fail;
    pthread_mutex_init(&s->lock, NULL);
    if (pthread_create(&s->thread, NULL, run, s) != 0) {
        pthread_mutex_destroy(&s->lock);
        goto fail;
    }
    return PyCapsule_New(s, "zmtp_server", destroy);
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    int all[] = {s->epfd, s->wake_fd, s->take_fd, s->notify_fd};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (all[i] >= 0) close(all[i]);
    free(s->table);
    free(s);
    return NULL;
}

static PyObject *py_add(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    long long token;
    int fd;
    Py_buffer rid, received, unsent;
    if (!PyArg_ParseTuple(args, "OLiy*y*y*", &h, &token, &fd, &rid, &received, &unsent))
        return NULL;
    PyObject *result = NULL;
    server_t *s = handle(h);
    conn_t *c = NULL;
    if (!s) goto done;
    if (rid.len != RID_BYTES) {
        PyErr_SetString(PyExc_ValueError, "a routing id is 16 bytes");
        goto done;
    }
    c = calloc(1, sizeof *c);
    if (!c || (received.len && !(c->received = malloc((size_t)received.len)))) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(c->rid, rid.buf, RID_BYTES);
    c->token = token;
    c->fd = fd;
    memcpy(c->received, received.buf, (size_t)received.len);
    c->n_received = (size_t)received.len;
    struct iovec iov = {unsent.buf, (size_t)unsent.len};
    if (unsent.len && append(c, &iov, 1, 0, (size_t)unsent.len, 0) != 0) {
        PyErr_NoMemory();
        goto done;
    }
    pthread_mutex_lock(&s->lock);
    if (lookup(s, c->rid)) {
        pthread_mutex_unlock(&s->lock);
        PyErr_SetString(PyExc_ValueError, "that routing id is taken");
        goto done;
    }
    size_t b = bucket_of(s, c->rid);
    c->hnext = s->table[b];
    s->table[b] = c;
    c->in_next = s->incoming;
    s->incoming = c;
    if (c->out_head) s->n_unsent++;
    if (++s->n_conns > s->buckets) table_grow(s);
    pthread_mutex_unlock(&s->lock);
    poke(s->wake_fd);
    c = NULL;
    result = Py_None;
    Py_INCREF(result);
done:
    if (c) {
        free(c->received);
        if (c->out_head) free(c->out_head);
        free(c);
    }
    PyBuffer_Release(&rid);
    PyBuffer_Release(&received);
    PyBuffer_Release(&unsent);
    return result;
}

static PyObject *frames_list(event_t *e) {
    PyObject *list = PyList_New((Py_ssize_t)e->n);
    for (size_t i = 0; list && i < e->n; i++) {
        PyObject *b = PyBytes_FromStringAndSize(e->frames[i].data, (Py_ssize_t)e->frames[i].len);
        if (!b) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, b);
    }
    return list;
}

static PyObject *py_take(PyObject *self, PyObject *h) {
    (void)self;
    server_t *s = handle(h);
    if (!s) return NULL;
    uint64_t v;
    ssize_t got = read(s->take_fd, &v, sizeof v);
    (void)got;
    pthread_mutex_lock(&s->lock);
    event_t *e = s->ev_head;
    s->ev_head = s->ev_tail = NULL;
    int resume = 0;
    for (event_t *m = e; m; m = m->next) {
        conn_t *c = m->frames ? lookup(s, m->rid) : NULL;
        if (c && --c->in_count < s->max_unread && c->paused) resume = 1;
    }
    if (resume) s->resume = 1;
    pthread_mutex_unlock(&s->lock);
    if (resume) poke(s->wake_fd);
    PyObject *out = PyList_New(0);
    while (e) {
        event_t *next = e->next;
        if (out) {
            PyObject *rid = PyBytes_FromStringAndSize((char *)e->rid, RID_BYTES);
            PyObject *frames = e->frames ? frames_list(e) : (Py_INCREF(Py_None), Py_None);
            PyObject *item = rid && frames ? PyTuple_Pack(2, rid, frames) : NULL;
            if (!item || PyList_Append(out, item) != 0) Py_CLEAR(out);
            Py_XDECREF(item);
            Py_XDECREF(rid);
            Py_XDECREF(frames);
        }
        free_frames(e->frames, e->n);
        free(e);
        e = next;
    }
    return out;
}

static PyObject *py_send(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h, *seq;
    Py_buffer rid;
    if (!PyArg_ParseTuple(args, "Oy*O", &h, &rid, &seq)) return NULL;
    server_t *s = handle(h);
    PyObject *fast = s ? PySequence_Fast(seq, "frames must be a sequence of bytes") : NULL;
    Py_ssize_t n = fast ? PySequence_Fast_GET_SIZE(fast) : 0;
    if (fast && (n < 1 || n > MAX_IOV / 2)) {
        PyErr_SetString(PyExc_ValueError, "a message has 1 to 32 frames");
        Py_CLEAR(fast);
    }
    if (!fast || rid.len != RID_BYTES) {
        if (fast && rid.len != RID_BYTES) PyErr_SetString(PyExc_ValueError, "a routing id is 16 bytes");
        Py_XDECREF(fast);
        PyBuffer_Release(&rid);
        return NULL;
    }
    Py_buffer bufs[MAX_IOV / 2];
    unsigned char heads[MAX_IOV / 2][9];
    struct iovec iov[MAX_IOV];
    Py_ssize_t held = 0;
    size_t total = 0;
    int rc = -1;
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &bufs[held], PyBUF_SIMPLE) != 0)
            goto done;
        uint64_t len = (uint64_t)bufs[held].len;
        unsigned char *hd = heads[held];
        hd[0] = held + 1 < n ? F_MORE : 0;
        size_t hl = 2;
        if (len > 255) {
            hd[0] |= F_LONG;
            for (int i = 0; i < 8; i++) hd[1 + i] = (unsigned char)(len >> (56 - 8 * i));
            hl = 9;
        } else {
            hd[1] = (unsigned char)len;
        }
        iov[2 * held] = (struct iovec){hd, hl};
        iov[2 * held + 1] = (struct iovec){bufs[held].buf, (size_t)len};
        total += hl + len;
    }
    int large = total > 65536; /* copies and syscalls worth letting other threads run */
    PyThreadState *ts = large ? PyEval_SaveThread() : NULL;
    pthread_mutex_lock(&s->lock);
    conn_t *c = lookup(s, rid.buf);
    if (!c) rc = SEND_UNKNOWN;
    else if (c->out_count >= s->max_queued) rc = SEND_FULL;
    else {
        write_locked(s, c, iov, (int)(2 * n), 1); /* a failed socket: its reader closes it */
        rc = SEND_OK;
    }
    pthread_mutex_unlock(&s->lock);
    if (ts) PyEval_RestoreThread(ts);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&bufs[i]);
    Py_DECREF(fast);
    PyBuffer_Release(&rid);
    return rc < 0 ? NULL : PyLong_FromLong(rc);
}

static PyObject *py_closed(PyObject *self, PyObject *h) {
    (void)self;
    server_t *s = PyCapsule_GetPointer(h, "zmtp_server");
    if (!s) return NULL;
    return gone_take(&s->gone, &s->lock, s->notify_fd);
}

static PyObject *py_fd(PyObject *self, PyObject *h) {
    (void)self;
    server_t *s = PyCapsule_GetPointer(h, "zmtp_server");
    return s ? PyLong_FromLong(s->take_fd) : NULL;
}

static PyObject *py_notify_fd(PyObject *self, PyObject *h) {
    (void)self;
    server_t *s = PyCapsule_GetPointer(h, "zmtp_server");
    return s ? PyLong_FromLong(s->notify_fd) : NULL;
}

static PyObject *py_unsent(PyObject *self, PyObject *h) {
    (void)self;
    server_t *s = PyCapsule_GetPointer(h, "zmtp_server");
    if (!s) return NULL;
    pthread_mutex_lock(&s->lock);
    size_t n = s->n_unsent;
    pthread_mutex_unlock(&s->lock);
    return PyLong_FromSize_t(n);
}

static PyObject *py_count(PyObject *self, PyObject *h) {
    (void)self;
    server_t *s = PyCapsule_GetPointer(h, "zmtp_server");
    if (!s) return NULL;
    pthread_mutex_lock(&s->lock);
    size_t n = s->n_conns;
    pthread_mutex_unlock(&s->lock);
    return PyLong_FromSize_t(n);
}

static PyObject *py_stop(PyObject *self, PyObject *h) {
    (void)self;
    server_t *s = PyCapsule_GetPointer(h, "zmtp_server");
    if (!s) return NULL;
    if (s->stopping) Py_RETURN_NONE;
    join_thread(s);
    s->stopping = 2;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"start", py_start, METH_VARARGS,
     "start(max_message_bytes, max_queued, max_unread, heartbeat_ivl_ms, heartbeat_timeout_ms)"},
    {"add", py_add, METH_VARARGS,
     "add(h, token, fd, routing_id, received, unsent): serve the connection (fd is owned)."},
    {"take", py_take, METH_O, "take(h) -> [(routing_id, frames | None)], in order."},
    {"fd", py_fd, METH_O, "fd(h): readable while take(h) has something."},
    {"send", py_send, METH_VARARGS, "send(h, routing_id, frames) -> 0 sent, 1 unknown, 2 full."},
    {"closed", py_closed, METH_O, "closed(h): tokens of connections closed since the last call."},
    {"notify_fd", py_notify_fd, METH_O, "notify_fd(h): readable while closed(h) has tokens."},
    {"unsent", py_unsent, METH_O, "unsent(h): connections whose outbox holds bytes."},
    {"count", py_count, METH_O, "count(h): connections open."},
    {"stop", py_stop, METH_O, "stop(h): close every connection and join the thread."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_zmtp_server",
    "The public TCP port's ZMTP server (csrc/zmtp_server.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__zmtp_server(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "SEND_OK", SEND_OK) || PyModule_AddIntConstant(m, "SEND_UNKNOWN", SEND_UNKNOWN) ||
              PyModule_AddIntConstant(m, "SEND_FULL", SEND_FULL))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
