/* Listeners of one process bound to one address instead of every interface.
 *
 * Mooncake's transfer engine (prefill/decode disaggregation,
 * radixserve/worker/kv_transfer.py) binds its handshake and data ports to the
 * wildcard address whatever host it is given, and its TCP data port writes into
 * registered memory for whoever connects. The launcher starts a prefill or decode
 * server's worker with this library in LD_PRELOAD and the address in
 * RADIXSERVE_BIND_ADDRESS (--kv-transfer-host): every bind() of that process to
 * 0.0.0.0 or :: then binds to that address instead (an IPv4 address on an IPv6
 * socket as its v4-mapped form, which a dual-stack socket accepts). Binds to a
 * given address, and binds of other families (the worker's ipc sockets), pass
 * unchanged. Without the variable, every bind passes unchanged.
 *
 * Built by setup.py as radixserve.worker._bind_address (a plain shared library:
 * Python never imports it).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int real_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn next;
    if (next == NULL) {
        next = (bind_fn)dlsym(RTLD_NEXT, "bind");
        if (next == NULL) {
            errno = ENOSYS;
            return -1;
        }
    }
    return next(fd, addr, len);
}

/* ``host`` as an IPv6 address: itself, or an IPv4 address's v4-mapped form. */
static int to_ipv6(const char *host, struct in6_addr *out) {
    struct in_addr v4;
    if (inet_pton(AF_INET6, host, out) == 1) return 1;
    if (inet_pton(AF_INET, host, &v4) != 1) return 0;
    memset(out, 0, sizeof(*out));
    out->s6_addr[10] = 0xff;
    out->s6_addr[11] = 0xff;
    memcpy(&out->s6_addr[12], &v4, sizeof(v4));
    return 1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    const char *host = getenv("RADIXSERVE_BIND_ADDRESS");
    if (host == NULL || *host == '\0' || addr == NULL) return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof(a));
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) && inet_pton(AF_INET, host, &a.sin_addr) == 1)
            return real_bind(fd, (const struct sockaddr *)&a, sizeof(a));
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof(a));
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) && to_ipv6(host, &a.sin6_addr))
            return real_bind(fd, (const struct sockaddr *)&a, sizeof(a));
    }
    return real_bind(fd, addr, len);
}
