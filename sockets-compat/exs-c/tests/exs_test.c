/*
 * A C program on exs.h: registered memory, event queues, both socket types, every byte
 * checked, and the errors a caller can cause.
 *
 *   exs_test self                     both ends in this process
 *   exs_test serve PORT stream|seq    echo one connection's data back, then exit
 *   exs_test client IP PORT stream|seq  send messages of many sizes, check the echo
 *
 * Prints "PASS ..." and exits 0, or "FAIL ..." and exits 1.
 */
#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "exs.h"

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            printf("FAIL line %d: ", __LINE__);                             \
            printf(__VA_ARGS__);                                            \
            printf(" (errno %d: %s)\n", errno, strerror(errno));            \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

static const struct timespec LIMIT = {20, 0};

/* An event's fields, for a failed check (errno then is the call's, not the event's). */
#define EVENT_FMT "type %d, event errno %d, result %zd"
#define EVENT(ev) EVENT_FMT, (ev).exs_evt_type, (ev).exs_evt_errno, (ssize_t)(ev).exs_evt_result

/* Takes one event, failing on a timeout. */
static exs_event_t one(exs_qhandle_t q) {
    exs_event_t ev;
    int n = exs_qdequeue(q, &ev, 1, &LIMIT);
    CHECK(n == 1, "no event within 20 s");
    return ev;
}

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)((i * 131 + seed) % 251); }

static struct sockaddr_in addr_of(const char *ip, int port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    inet_pton(AF_INET, ip, &a.sin_addr);
    return a;
}

static const size_t SIZES[] = {1, 8, 100, 128, 129, 4096, 65536, 300000, 1 << 20, 4 << 20};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])
#define SLOT (4 << 20)

/* Sends every size (all outstanding at once), receives each echo into its own slot. */
static void exchange(int fd, int seq, exs_qhandle_t q, unsigned char *tx, unsigned char *rx,
                     exs_mhandle_t mt, exs_mhandle_t mr) {
    size_t total = 0;
    for (size_t i = 0; i < NSIZES; i++) {
        for (size_t k = 0; k < SIZES[i]; k++) tx[i * SLOT + k] = pattern(k, (unsigned)i);
        CHECK(exs_send(fd, tx + i * SLOT, SIZES[i], 0, q, (void *)(100 + i), mt) == 0, "send %zu", i);
        total += SIZES[i];
    }
    if (seq) {
        for (size_t i = 0; i < NSIZES; i++)
            CHECK(exs_recv(fd, rx + i * SLOT, SLOT, 0, q, (void *)(200 + i), mr) == 0, "recv %zu", i);
        size_t sends = 0, recvs = 0;
        while (sends + recvs < 2 * NSIZES) {
            exs_event_t ev = one(q);
            CHECK(ev.exs_evt_errno == 0, "event %ld failed: " EVENT_FMT, (long)(size_t)ev.exs_evt_context,
                  ev.exs_evt_type, ev.exs_evt_errno, (ssize_t)ev.exs_evt_result);
            size_t id = (size_t)ev.exs_evt_context;
            if (ev.exs_evt_type == EXS_EVT_SEND) {
                CHECK(ev.exs_evt_result == (ssize_t)SIZES[id - 100], "send result");
                sends++;
            } else {
                CHECK(ev.exs_evt_type == EXS_EVT_RECV, "event type %d", ev.exs_evt_type);
                size_t i = id - 200;
                CHECK(ev.exs_evt_result == (ssize_t)SIZES[i] && ev.exs_evt_flags == 0,
                      "message %zu: %zd bytes", i, ev.exs_evt_result);
                for (size_t k = 0; k < SIZES[i]; k++)
                    CHECK(rx[i * SLOT + k] == pattern(k, (unsigned)i), "message %zu byte %zu", i, k);
                recvs++;
            }
        }
    } else {
        /* A stream: receives take what is there; the bytes come back in order. */
        size_t got = 0, sends = 0, expect_i = 0, expect_k = 0;
        int recv_out = 0;
        while (got < total || sends < NSIZES) {
            if (got < total && !recv_out) {
                size_t want = total - got < SLOT ? total - got : SLOT;
                CHECK(exs_recv(fd, rx, want, 0, q, (void *)300, mr) == 0, "recv");
                recv_out = 1;
            }
            exs_event_t ev = one(q);
            CHECK(ev.exs_evt_errno == 0, "event failed: " EVENT(ev));
            if (ev.exs_evt_type == EXS_EVT_SEND) {
                sends++;
                continue;
            }
            CHECK(ev.exs_evt_result > 0, "early end of the stream at %zu", got);
            recv_out = 0;
            for (ssize_t k = 0; k < ev.exs_evt_result; k++) {
                while (expect_k == SIZES[expect_i]) expect_i++, expect_k = 0;
                CHECK(rx[k] == pattern(expect_k, (unsigned)expect_i), "stream byte %zu", got + k);
                expect_k++;
            }
            got += ev.exs_evt_result;
        }
    }
}

/* Echoes until the peer's end: SOCK_SEQPACKET message by message, SOCK_STREAM piece by piece. */
static void echo(int fd, exs_qhandle_t q, unsigned char *buf, exs_mhandle_t m) {
    for (;;) {
        CHECK(exs_recv(fd, buf, SLOT, 0, q, (void *)1, m) == 0, "echo recv");
        exs_event_t ev = one(q);
        CHECK(ev.exs_evt_type == EXS_EVT_RECV && ev.exs_evt_errno == 0, "echo recv event: " EVENT(ev));
        if (ev.exs_evt_result == 0) return;
        CHECK(exs_send(fd, buf, ev.exs_evt_result, 0, q, (void *)2, m) == 0, "echo send");
        ev = one(q);
        CHECK(ev.exs_evt_type == EXS_EVT_SEND && ev.exs_evt_errno == 0, "echo send event: " EVENT(ev));
    }
}

static void close_and_wait(int fd, exs_qhandle_t q) {
    CHECK(exs_close(fd, q, (void *)9) == 0, "close");
    exs_event_t ev = one(q);
    CHECK(ev.exs_evt_type == EXS_EVT_CLOSE && ev.exs_evt_errno == 0, "close event: " EVENT(ev));
}

static int self_test(void) {
    exs_qhandle_t q = exs_qcreate(64);
    CHECK(q >= 0, "qcreate");
    size_t bytes = NSIZES * (size_t)SLOT;
    unsigned char *tx = malloc(bytes), *rx = malloc(bytes);
    exs_mhandle_t mt = exs_mregister(tx, bytes, 0), mr = exs_mregister(rx, bytes, 0);
    CHECK(mt && mr, "mregister");
    for (int seq = 0; seq <= 1; seq++) {
        int type = seq ? SOCK_SEQPACKET : SOCK_STREAM;
        int l = exs_socket(AF_INET, type, 0);
        CHECK(l >= 0, "socket");
        struct sockaddr_in a = addr_of("127.0.0.1", 0);
        CHECK(exs_bind(l, (struct sockaddr *)&a, sizeof a) == 0, "bind");
        CHECK(exs_listen(l, 4) == 0, "listen");
        socklen_t len = sizeof a;
        CHECK(exs_getsockname(l, (struct sockaddr *)&a, &len) == 0 && a.sin_port != 0, "getsockname");
        CHECK(exs_accept(l, q, (void *)1) == 0, "accept");
        int c = exs_socket(AF_INET, type, 0);
        CHECK(exs_connect(c, (struct sockaddr *)&a, sizeof a, q, (void *)2) == 0, "connect");
        int s = -1;
        for (int i = 0; i < 2; i++) {
            exs_event_t ev = one(q);
            CHECK(ev.exs_evt_errno == 0, "connection event %d", ev.exs_evt_type);
            if (ev.exs_evt_type == EXS_EVT_ACCEPT) s = (int)ev.exs_evt_result;
        }
        CHECK(s >= 0, "accepted socket");
        /* The echo runs in a child of this process would need fork; here the server side
         * receives everything, then sends it back. */
        exs_qhandle_t qs = exs_qcreate(64);
        for (size_t i = 0; i < NSIZES; i++) {
            for (size_t k = 0; k < SIZES[i]; k++) tx[i * SLOT + k] = pattern(k, (unsigned)i);
            CHECK(exs_send(c, tx + i * SLOT, SIZES[i], 0, q, (void *)(100 + i), mt) == 0, "send");
            CHECK(exs_recv(s, rx + i * SLOT, SLOT, 0, qs, (void *)(200 + i), mr) == 0, "recv");
        }
        size_t total = 0, got = 0, done = 0, posted = NSIZES, expect_i = 0, expect_k = 0;
        for (size_t i = 0; i < NSIZES; i++) total += SIZES[i];
        while (seq ? done < NSIZES : got < total) {
            if (done == posted) {
                /* A stream's receives each took a part: the rest goes into the first slot. */
                CHECK(exs_recv(s, rx, SLOT, 0, qs, (void *)7, mr) == 0, "recv rest");
                posted++;
            }
            exs_event_t ev = one(qs);
            CHECK(ev.exs_evt_errno == 0 && ev.exs_evt_result > 0, "receive");
            got += ev.exs_evt_result;
            done++;
            size_t slot = (size_t)ev.exs_evt_context == 7 ? 0 : (size_t)ev.exs_evt_context - 200;
            if (seq) {
                CHECK(ev.exs_evt_result == (ssize_t)SIZES[slot], "message %zu size", slot);
                for (size_t k = 0; k < SIZES[slot]; k++)
                    CHECK(rx[slot * SLOT + k] == pattern(k, (unsigned)slot), "message %zu byte %zu", slot, k);
            } else {
                /* Receives complete in order: the stream's bytes, each where it landed. */
                for (ssize_t k = 0; k < ev.exs_evt_result; k++) {
                    while (expect_k == SIZES[expect_i]) expect_i++, expect_k = 0;
                    CHECK(rx[slot * SLOT + k] == pattern(expect_k, (unsigned)expect_i), "stream byte %zu",
                          got - ev.exs_evt_result + k);
                    expect_k++;
                }
            }
        }
        /* A stream may join sends into fewer receives: those still waiting take a byte each. */
        for (; done < posted; done++) {
            CHECK(exs_send(c, tx, 1, 0, q, (void *)8, mt) == 0, "send a byte");
            exs_event_t ev = one(qs);
            CHECK(ev.exs_evt_errno == 0 && ev.exs_evt_result == 1, "a byte");
            ev = one(q);
            CHECK(ev.exs_evt_type == EXS_EVT_SEND && ev.exs_evt_errno == 0, "the byte's send: " EVENT(ev));
        }
        for (size_t i = 0; i < NSIZES; i++) {
            exs_event_t ev = one(q);
            CHECK(ev.exs_evt_type == EXS_EVT_SEND && ev.exs_evt_errno == 0, "send event: " EVENT(ev));
        }

        /* Errors a caller can cause. */
        errno = 0;
        CHECK(exs_send(c, tx + bytes - 10, 100, 0, q, 0, mt) == -1 && errno == EFAULT, "outside the region");
        CHECK(exs_send(c, tx, 1, 0, q, 0, (exs_mhandle_t)0x12345) == -1 && errno == EINVAL, "bad handle");
        CHECK(exs_send(12345, tx, 1, 0, q, 0, mt) == -1 && errno == EBADF, "bad socket");
        CHECK(exs_recv(s, rx, 10, 0, qs, (void *)8, mr) == 0, "recv for the busy test");
        CHECK(exs_mderegister(mr) == -1 && errno == EBUSY, "deregister with a receive in flight");
        CHECK(exs_qdelete(qs) == -1 && errno == EBUSY, "delete a queue with work in flight");
        exs_qstatus_t st;
        CHECK(exs_qstatus(qs, &st) == 0 && st.exs_q_pending == 1 && st.exs_q_queued == 0, "qstatus");
        /* The queue's descriptor wakes when the event arrives. */
        CHECK(exs_send(c, tx, 5, 0, q, (void *)9, mt) == 0, "send 5");
        struct pollfd p = {st.exs_q_fd, POLLIN, 0};
        CHECK(poll(&p, 1, 20000) == 1, "queue descriptor readable");
        exs_event_t ev = one(qs);
        CHECK(ev.exs_evt_result == 5, "5 bytes");
        one(q);
        CHECK(exs_qdelete(qs) == 0, "qdelete");
        long small = exs_fcntl(c, EXS_F_SMALL_MAX | EXS_F_GET, 0);
        CHECK(small == 128, "small max %ld", small);
        CHECK(exs_fcntl(c, EXS_F_SMALL_MAX, 64) == -1 && errno == EISCONN, "tunable after connect");
        close_and_wait(c, q);
        close_and_wait(s, q);
        close_and_wait(l, q);
        CHECK(exs_close(c, q, 0) == -1 && errno == EBADF, "closed twice");
    }
    CHECK(exs_mderegister(mt) == 0 && exs_mderegister(mr) == 0, "mderegister");
    CHECK(exs_qdelete(q) == 0, "qdelete");
    printf("PASS self\n");
    return 0;
}

int main(int argc, char **argv) {
    CHECK(exs_init(EXS_VERSION) == 0, "init");
    if (argc >= 2 && strcmp(argv[1], "self") == 0) return self_test();
    CHECK(argc >= 4, "usage: exs_test self | serve PORT stream|seq | client IP PORT stream|seq");
    int serve = strcmp(argv[1], "serve") == 0;
    int seq = strcmp(argv[argc - 1], "seq") == 0;
    int type = seq ? SOCK_SEQPACKET : SOCK_STREAM;
    exs_qhandle_t q = exs_qcreate(64);
    size_t bytes = NSIZES * (size_t)SLOT;
    unsigned char *tx = malloc(bytes), *rx = malloc(bytes);
    exs_mhandle_t mt = exs_mregister(tx, bytes, 0), mr = exs_mregister(rx, bytes, 0);
    CHECK(q >= 0 && mt && mr, "setup");
    int fd = exs_socket(AF_INET, type, 0);
    if (serve) {
        struct sockaddr_in a = addr_of("0.0.0.0", atoi(argv[2]));
        CHECK(exs_bind(fd, (struct sockaddr *)&a, sizeof a) == 0, "bind");
        CHECK(exs_listen(fd, 1) == 0, "listen");
        printf("LISTENING\n");
        fflush(stdout);
        CHECK(exs_accept(fd, q, 0) == 0, "accept");
        exs_event_t ev;
        const struct timespec minute = {60, 0};
        CHECK(exs_qdequeue(q, &ev, 1, &minute) == 1 && ev.exs_evt_errno == 0, "accept event");
        int s = (int)ev.exs_evt_result;
        echo(s, q, rx, mr);
        close_and_wait(s, q);
        close_and_wait(fd, q);
        printf("PASS serve\n");
        return 0;
    }
    struct sockaddr_in a = addr_of(argv[2], atoi(argv[3]));
    exs_event_t ev;
    for (int tries = 0;; tries++) {
        CHECK(exs_connect(fd, (struct sockaddr *)&a, sizeof a, q, 0) == 0, "connect");
        ev = one(q);
        if (ev.exs_evt_errno == 0) break;
        CHECK(tries < 200, "connect failed: %d", ev.exs_evt_errno);
        struct timespec nap = {0, 50000000};
        nanosleep(&nap, 0);
    }
    exchange(fd, seq, q, tx, rx, mt, mr);
    close_and_wait(fd, q);
    printf("PASS client\n");
    return 0;
}
