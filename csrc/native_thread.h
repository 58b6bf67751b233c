/* What the native threads of the public port and the HTTP front share: the ZMTP
 * server (zmtp_server.c), its relay (zmtp_relay.c) and the poll keeper
 * (poll_keeper.c) each run one thread with epoll, woken through an eventfd and
 * stopped under a flag its lock guards. Include after Python.h and pthread.h. */
#ifndef RADIXSERVE_NATIVE_THREAD_H
#define RADIXSERVE_NATIVE_THREAD_H

#include <stdint.h>
#include <time.h>
#include <unistd.h>

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Make the eventfd fd readable. */
static inline void poke(int fd) {
    uint64_t one = 1;
    ssize_t w = write(fd, &one, sizeof one);
    (void)w;
}

/* Set *stopping (under lock), wake the thread through wake_fd, and wait for it to end,
 * without the GIL. */
static inline void stop_thread(pthread_mutex_t *lock, int *stopping, int wake_fd, pthread_t thread) {
    pthread_mutex_lock(lock);
    *stopping = 1;
    pthread_mutex_unlock(lock);
    poke(wake_fd);
    Py_BEGIN_ALLOW_THREADS pthread_join(thread, NULL);
    Py_END_ALLOW_THREADS
}

#endif
