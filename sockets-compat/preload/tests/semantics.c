#define _GNU_SOURCE
/* Socket semantics a program relies on, checked step by step; the same program must pass over
 * kernel TCP and under libsdp_preload.so. Usage: semantics server PORT | semantics client PORT */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHECK(cond, what) do { if (!(cond)) { fprintf(stderr, "FAILED %s: %s (errno %d %s)\n", argv[1], what, errno, strerror(errno)); return 1; } printf("ok %s\n", what); fflush(stdout); } while (0)

static volatile sig_atomic_t sigpipes;
static void on_sigpipe(int s) { (void)s; sigpipes++; }
static volatile sig_atomic_t alarms;
static void on_alarm(int s) { (void)s; alarms++; }

static int recv_all(int fd, char *buf, int n) {
    int got = 0;
    while (got < n) {
        int k = recv(fd, buf + got, n - got, 0);
        if (k <= 0) return got;
        got += k;
    }
    return got;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int port = atoi(argv[2]);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char buf[256];
    if (strcmp(argv[1], "server") == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        CHECK(bind(l, (struct sockaddr *)&a, sizeof a) == 0, "bind");
        CHECK(listen(l, 16) == 0, "listen");
        struct sockaddr_in peer;
        socklen_t pl = sizeof peer;
        int fd = accept4(l, (struct sockaddr *)&peer, &pl, SOCK_CLOEXEC);
        CHECK(fd >= 0 && pl == sizeof peer && peer.sin_family == AF_INET, "accept4 with the peer's address");
        int type = 0;
        socklen_t tl = sizeof type;
        CHECK(getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) == 0 && type == SOCK_STREAM, "SO_TYPE");
        CHECK(recv(fd, buf, 5, MSG_PEEK) == 5 && memcmp(buf, "hello", 5) == 0, "MSG_PEEK");
        int avail = 0;
        for (int i = 0; i < 1000 && avail < 11; i++) { ioctl(fd, FIONREAD, &avail); if (avail < 11) usleep(1000); }
        CHECK(avail == 11, "FIONREAD");
        CHECK(recv(fd, buf, 11, MSG_WAITALL) == 11 && memcmp(buf, "hello world", 11) == 0, "MSG_WAITALL after a peek");
        CHECK(recv(fd, buf, 1, MSG_DONTWAIT) == -1 && (errno == EAGAIN || errno == EWOULDBLOCK), "MSG_DONTWAIT: EAGAIN");
        /* An epoll set holding the socket and a pipe: each reports its own event. */
        int ep = epoll_create1(EPOLL_CLOEXEC), p[2];
        CHECK(pipe(p) == 0, "pipe");
        struct epoll_event ev = {.events = EPOLLIN | EPOLLET, .data.fd = fd};
        epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
        struct epoll_event pev = {.events = EPOLLIN, .data.fd = p[0]};
        epoll_ctl(ep, EPOLL_CTL_ADD, p[0], &pev);
        usleep(3000000); /* the client's waits meanwhile are interrupted by its alarms */
        CHECK(send(fd, "go", 2, 0) == 2, "send");
        struct epoll_event out[4];
        int n = epoll_wait(ep, out, 4, 10000);
        CHECK(n == 1 && out[0].data.fd == fd, "epoll: the socket's arrival");
        CHECK(recv(fd, buf, sizeof buf, 0) == 1 && buf[0] == 'x', "recv after epoll");
        CHECK(write(p[1], "p", 1) == 1, "write to the pipe");
        n = epoll_wait(ep, out, 4, 10000);
        CHECK(n == 1 && out[0].data.fd == p[0], "epoll: the pipe's event, in the same set");
        int d = dup(fd);
        CHECK(d >= 0 && send(d, "dup ok", 6, 0) == 6, "send through a dup");
        CHECK(close(d) == 0 && send(fd, "!", 1, 0) == 1, "the socket outlives its dup's close");
        CHECK(shutdown(fd, SHUT_WR) == 0, "shutdown(SHUT_WR)");
        CHECK(recv_all(fd, buf, 1) == 0, "EOF once the client closed");
        /* Writing to a closed peer: EPIPE, a SIGPIPE unless MSG_NOSIGNAL. */
        signal(SIGPIPE, on_sigpipe);
        int r = 0;
        for (int i = 0; i < 1000; i++) { r = send(fd, "z", 1, MSG_NOSIGNAL); if (r < 0) break; usleep(1000); }
        CHECK(r == -1 && errno == EPIPE && sigpipes == 0, "MSG_NOSIGNAL: EPIPE, no signal");
        CHECK(send(fd, "z", 1, 0) == -1 && errno == EPIPE && sigpipes == 1, "EPIPE raises SIGPIPE");
        CHECK(close(fd) == 0, "close");
        /* The client's second connection, registered with epoll before it connected. */
        fd = accept(l, NULL, NULL);
        CHECK(fd >= 0 && recv_all(fd, buf, 6) == 6 && memcmp(buf, "second", 6) == 0, "the second connection's bytes");
        /* Not reading for a while: the client's blocking sends wait for room, and its alarms
         * end them. Then every byte it sent, and EOF. */
        usleep(1500000);
        long total = 0, bad = 0;
        for (;;) {
            ssize_t k = recv(fd, buf, sizeof buf, 0);
            if (k <= 0) break;
            for (ssize_t i = 0; i < k; i++) bad += buf[i] != 'b';
            total += k;
        }
        CHECK(total > 0 && bad == 0, "the interrupted sends' bytes, all of them");
        CHECK(close(fd) == 0 && close(l) == 0, "EOF and close");
        printf("ALL OK\n");
        return 0;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int r = connect(fd, (struct sockaddr *)&a, sizeof a);
    CHECK(r == 0 || errno == EINPROGRESS, "nonblocking connect");
    struct pollfd pf = {.fd = fd, .events = POLLOUT};
    CHECK(poll(&pf, 1, 10000) == 1 && (pf.revents & POLLOUT), "connect completes: POLLOUT");
    int err = -1;
    socklen_t el = sizeof err;
    CHECK(getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && err == 0, "SO_ERROR 0");
    struct sockaddr_in peer;
    socklen_t pl = sizeof peer;
    CHECK(getpeername(fd, (struct sockaddr *)&peer, &pl) == 0 && ntohs(peer.sin_port) == port, "getpeername: the server's port");
    int fl = fcntl(fd, F_GETFL);
    CHECK(fl >= 0 && (fl & O_NONBLOCK), "F_GETFL shows O_NONBLOCK");
    CHECK(fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == 0 && !(fcntl(fd, F_GETFL) & O_NONBLOCK), "F_SETFL: blocking");
    int one = 1;
    CHECK(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0, "TCP_NODELAY");
    CHECK(send(fd, "hello world", 11, 0) == 11, "send");
    /* A signal whose handler does not ask for SA_RESTART ends a waiting receive: EINTR. */
    struct sigaction sa = {0};
    sa.sa_handler = on_alarm;
    sigaction(SIGALRM, &sa, NULL);
    alarm(1);
    CHECK(recv(fd, buf, 2, 0) == -1 && errno == EINTR && alarms == 1, "EINTR from a waiting recv");
    /* Waits on the socket that a signal ends (whether it comes while the library polls or once
     * the kernel sleeps), and mixed sets whose plain member is ready first. */
    struct pollfd rf = {.fd = fd, .events = POLLIN};
    ualarm(150000, 0);
    CHECK(poll(&rf, 1, 5000) == -1 && errno == EINTR && alarms == 2, "EINTR from poll");
    fd_set rs;
    FD_ZERO(&rs);
    FD_SET(fd, &rs);
    struct timeval tv = {.tv_sec = 5};
    ualarm(150000, 0);
    CHECK(select(fd + 1, &rs, NULL, NULL, &tv) == -1 && errno == EINTR && alarms == 3, "EINTR from select");
    int cep = epoll_create1(0);
    struct epoll_event cev = {.events = EPOLLIN, .data.fd = fd}, cout[2];
    CHECK(epoll_ctl(cep, EPOLL_CTL_ADD, fd, &cev) == 0, "epoll_ctl");
    ualarm(150000, 0);
    CHECK(epoll_wait(cep, cout, 2, 5000) == -1 && errno == EINTR && alarms == 4, "EINTR from epoll_wait");
    int cp[2];
    CHECK(pipe(cp) == 0 && write(cp[1], "p", 1) == 1, "a pipe with a byte");
    struct pollfd two[2] = {{.fd = fd, .events = POLLIN}, {.fd = cp[0], .events = POLLIN}};
    CHECK(poll(two, 2, 5000) == 1 && two[1].revents == POLLIN && two[0].revents == 0, "poll: the pipe, not the socket");
    FD_ZERO(&rs);
    FD_SET(fd, &rs);
    FD_SET(cp[0], &rs);
    tv.tv_sec = 5;
    CHECK(select((fd > cp[0] ? fd : cp[0]) + 1, &rs, NULL, NULL, &tv) == 1 && FD_ISSET(cp[0], &rs) && !FD_ISSET(fd, &rs), "select: the pipe, not the socket");
    tv.tv_sec = 0;
    tv.tv_usec = 1000;
    FD_ZERO(&rs);
    FD_SET(fd, &rs);
    CHECK(select(fd + 1, &rs, NULL, NULL, &tv) == 0 && !FD_ISSET(fd, &rs), "select times out: nothing to read");
    close(cp[0]);
    close(cp[1]);
    CHECK(recv_all(fd, buf, 2) == 2 && memcmp(buf, "go", 2) == 0, "recv");
    CHECK(send(fd, "x", 1, 0) == 1, "send after recv");
    CHECK(recv_all(fd, buf, 7) == 7 && memcmp(buf, "dup ok!", 7) == 0, "bytes through the server's dup");
    CHECK(recv_all(fd, buf, 1) == 0, "EOF after the server's shutdown");
    CHECK(close(fd) == 0, "close");
    /* A socket registered with epoll before it connects reports the connection there. */
    fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct epoll_event wev = {.events = EPOLLOUT, .data.fd = fd};
    CHECK(epoll_ctl(cep, EPOLL_CTL_ADD, fd, &wev) == 0, "epoll_ctl before connect");
    r = connect(fd, (struct sockaddr *)&a, sizeof a);
    CHECK(r == 0 || errno == EINPROGRESS, "the second nonblocking connect");
    CHECK(epoll_wait(cep, cout, 2, 10000) == 1 && cout[0].data.fd == fd && (cout[0].events & EPOLLOUT), "epoll: the connection completes");
    CHECK(send(fd, "second", 6, 0) == 6, "send on the second connection");
    /* A blocking send waiting for room that a signal ends: the bytes sent so far (or EINTR
     * when none went: the kernel may find room for some, as its buffers grow). */
    int bfl = fcntl(fd, F_GETFL);
    CHECK(fcntl(fd, F_SETFL, bfl & ~O_NONBLOCK) == 0, "blocking again");
    size_t big_len = 64 << 20;
    char *big = malloc(big_len);
    memset(big, 'b', big_len);
    ualarm(300000, 0);
    ssize_t sent = send(fd, big, big_len, 0);
    CHECK(sent > 0 && (size_t)sent < big_len && alarms == 5, "a signal ends a blocking send: the bytes so far");
    ualarm(300000, 0);
    sent = send(fd, big, big_len, 0);
    CHECK((sent == -1 ? errno == EINTR : sent > 0 && (size_t)sent < big_len) && alarms == 6, "a signal ends a blocking send again");
    free(big);
    CHECK(close(fd) == 0 && close(cep) == 0, "close");
    printf("ALL OK\n");
    return 0;
}
