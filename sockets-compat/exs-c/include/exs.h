/*
 * exs.h: the Extended Sockets API (Open Group ES-API, as UNH-EXS runs it in user space).
 *
 * Sockets whose connect, accept, send, receive and close start at once and complete as
 * events on an event queue; sends and receives use memory registered with exs_mregister,
 * so that data moves by RDMA between the two programs' buffers. Link with -lexs.
 *
 * Every call returns -1 (or NULL) and sets errno on failure. EXS descriptors are numbers
 * of their own (from 1 << 20): they cannot be passed to read, write, poll or close.
 */
#ifndef EXS_H
#define EXS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EXS_VERSION 1

/* An event queue. */
typedef int exs_qhandle_t;
/* A registered memory region (opaque). */
typedef struct exs_mregion *exs_mhandle_t;

typedef enum {
    EXS_EVT_SEND = 1,
    EXS_EVT_RECV = 2,
    EXS_EVT_ACCEPT = 3,
    EXS_EVT_CONNECT = 4,
    EXS_EVT_CLOSE = 5,
} exs_evt_type_t;

/* A completed operation. */
typedef struct {
    exs_evt_type_t exs_evt_type;
    int exs_evt_errno;      /* 0, or why the operation failed */
    int exs_evt_fd;         /* the socket the operation ran on */
    int exs_evt_flags;      /* MSG_TRUNC: a SOCK_SEQPACKET message cut to the buffer */
    ssize_t exs_evt_result; /* bytes moved (a receive's 0: the peer's end of data);
                               EXS_EVT_ACCEPT: the new socket; -1 on failure */
    void *exs_evt_context;  /* the context the operation was started with */
} exs_event_t;

/* What exs_qstatus reports. */
typedef struct {
    int exs_q_depth;   /* events the queue holds at most */
    int exs_q_queued;  /* events waiting */
    int exs_q_pending; /* operations in flight that report here */
    int exs_q_fd;      /* a descriptor readable while events wait (poll, epoll) */
} exs_qstatus_t;

/* exs_fcntl commands. Socket tunables are set before exs_connect or exs_listen (an
 * accepted socket takes its listener's); EXS_F_BUSY_POLL and EXS_F_COMPLETION_CPU are
 * process-wide. The EXS_F_GET_* forms return the value. */
#define EXS_F_SMALL_MAX 1       /* largest message carried in a control message (0..4096, 128) */
#define EXS_F_INLINE_MAX 2      /* largest write copied into the work request (0..256, 64) */
#define EXS_F_BUSY_POLL 3       /* 1: waits poll (default); 0: waits sleep until notified
                                   (after 20 us of polls) */
#define EXS_F_COMPLETION_CPU 4  /* the completion thread's CPU (-1: any, default) */
#define EXS_F_RECV_BUFFER 5     /* SOCK_STREAM: stream buffer bytes (0: none; 65536) */
#define EXS_F_ADV_CREDITS 6     /* receives advertised at once at most (1..32, 16) */
#define EXS_F_GET 0x100         /* or-ed with a command: read it */

int exs_init(int version);

int exs_socket(int domain, int type, int protocol);
int exs_bind(int fd, const struct sockaddr *addr, socklen_t addrlen);
int exs_listen(int fd, int backlog);
/* The address a bound or listening socket has (its port after binding port 0). */
int exs_getsockname(int fd, struct sockaddr *addr, socklen_t *addrlen);
int exs_accept(int fd, exs_qhandle_t q, void *context);
int exs_connect(int fd, const struct sockaddr *addr, socklen_t addrlen, exs_qhandle_t q, void *context);
int exs_close(int fd, exs_qhandle_t q, void *context);
long exs_fcntl(int fd, int cmd, long value);

exs_qhandle_t exs_qcreate(int depth);
int exs_qdelete(exs_qhandle_t q);
/* Takes up to `max` events; waits up to `timeout` for the first (NULL: as long as it
 * takes). Returns how many (0: the time ran out). */
int exs_qdequeue(exs_qhandle_t q, exs_event_t *events, int max, const struct timespec *timeout);
int exs_qmodify(exs_qhandle_t q, int depth);
int exs_qstatus(exs_qhandle_t q, exs_qstatus_t *status);

exs_mhandle_t exs_mregister(void *addr, size_t len, int flags);
int exs_mderegister(exs_mhandle_t m);

/* Start a transfer; 0 when started. The buffer must lie inside `m`, and a send's bytes
 * must stay unchanged until its event. flags: 0. */
ssize_t exs_send(int fd, const void *buf, size_t len, int flags, exs_qhandle_t q, void *context,
                 exs_mhandle_t m);
ssize_t exs_recv(int fd, void *buf, size_t len, int flags, exs_qhandle_t q, void *context,
                 exs_mhandle_t m);

#ifdef __cplusplus
}
#endif

#endif
