/* libfabric's shared-memory provider (`shm`) as stack_bench's `libfabric` layer measures it:
 * reliable-datagram endpoints (FI_EP_RDM) sending untagged messages (FI_MSG) between two
 * processes (this one and a child it forks; the endpoint names cross through pipes), each
 * pinned to the CPU named by STACK_BENCH_CPUS ("client,server": this process on the first).
 *   lat SIZE N WARM   prints the median and the 99th percentile of the one-way latency of N
 *                     round trips (half of each), in microseconds
 *   bw  SIZE N WARM   prints the bandwidth of N messages in GB/s (windows of 64 outstanding
 *                     sends and receives, each window acknowledged), warm-up excluded
 * Completions are busy-polled, as ucx_perftest and our layers poll. */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ticks.h"

#define WINDOW 64

struct peer {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    fi_addr_t other;
    long completed;
    struct fi_context ctx[WINDOW + 2];
};

static void die(const char *what, long r) {
    fprintf(stderr, "%s: %s\n", what, fi_strerror((int)(r < 0 ? -r : r)));
    exit(1);
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void pin(int server) {
    const char *cpus = getenv("STACK_BENCH_CPUS");
    int c0, c1;
    if (!cpus || sscanf(cpus, "%d,%d", &c0, &c1) != 2) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(server ? c1 : c0, &set);
    sched_setaffinity(0, sizeof set, &set);
}

/* Takes completions off the queue; counts them. */
static void progress(struct peer *p) {
    struct fi_cq_entry e[16];
    ssize_t r = fi_cq_read(p->cq, e, 16);
    if (r > 0) {
        p->completed += r;
    } else if (r == -FI_EAVAIL) {
        struct fi_cq_err_entry err = {0};
        fi_cq_readerr(p->cq, &err, 0);
        die("completion", err.err);
    } else if (r != -FI_EAGAIN) {
        die("fi_cq_read", r);
    }
}

static void wait_for(struct peer *p, long target) {
    while (p->completed < target) progress(p);
}

static void send_msg(struct peer *p, void *buf, size_t len, int slot) {
    ssize_t r;
    while ((r = fi_send(p->ep, buf, len, NULL, p->other, &p->ctx[slot])) == -FI_EAGAIN) progress(p);
    if (r) die("fi_send", r);
}

static void recv_msg(struct peer *p, void *buf, size_t len, int slot) {
    ssize_t r;
    while ((r = fi_recv(p->ep, buf, len, NULL, FI_ADDR_UNSPEC, &p->ctx[slot])) == -FI_EAGAIN) progress(p);
    if (r) die("fi_recv", r);
}

static void full_write(int fd, const void *b, size_t n) {
    if (write(fd, b, n) != (ssize_t)n) die("pipe write", FI_EIO);
}

static void full_read(int fd, void *b, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, (char *)b + got, n - got);
        if (r <= 0) die("pipe read", FI_EIO);
        got += r;
    }
}

/* Opens an endpoint and swaps names with the other process through the pipes. */
static void open_peer(struct peer *p, int to, int from) {
    struct fi_info *hints = fi_allocinfo();
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG;
    hints->mode = FI_CONTEXT;
    hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup("shm");
    long r = fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, hints, &p->info);
    if (r) die("fi_getinfo(shm)", r);
    fi_freeinfo(hints);
    if ((r = fi_fabric(p->info->fabric_attr, &p->fabric, NULL))) die("fi_fabric", r);
    if ((r = fi_domain(p->fabric, p->info, &p->domain, NULL))) die("fi_domain", r);
    struct fi_cq_attr cq = {.size = 1024, .format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_NONE};
    if ((r = fi_cq_open(p->domain, &cq, &p->cq, NULL))) die("fi_cq_open", r);
    struct fi_av_attr av = {.type = FI_AV_TABLE};
    if ((r = fi_av_open(p->domain, &av, &p->av, NULL))) die("fi_av_open", r);
    if ((r = fi_endpoint(p->domain, p->info, &p->ep, NULL))) die("fi_endpoint", r);
    if ((r = fi_ep_bind(p->ep, &p->cq->fid, FI_TRANSMIT | FI_RECV))) die("fi_ep_bind(cq)", r);
    if ((r = fi_ep_bind(p->ep, &p->av->fid, 0))) die("fi_ep_bind(av)", r);
    if ((r = fi_enable(p->ep))) die("fi_enable", r);
    char name[256], other[256];
    size_t len = sizeof name, olen;
    if ((r = fi_getname(&p->ep->fid, name, &len))) die("fi_getname", r);
    full_write(to, &len, sizeof len);
    full_write(to, name, len);
    full_read(from, &olen, sizeof olen);
    if (olen > sizeof other) die("peer name", FI_EINVAL);
    full_read(from, other, olen);
    if (fi_av_insert(p->av, other, 1, &p->other, 0, NULL) != 1) die("fi_av_insert", FI_EINVAL);
}

int main(int argc, char **argv) {
    if (argc != 5 || (strcmp(argv[1], "lat") && strcmp(argv[1], "bw"))) {
        fprintf(stderr, "usage: %s lat|bw SIZE N WARM\n", argv[0]);
        return 2;
    }
    int lat = strcmp(argv[1], "lat") == 0;
    long size = atol(argv[2]), n = atol(argv[3]), warm = atol(argv[4]);
    int up[2], down[2];
    if (pipe(up) || pipe(down)) die("pipe", FI_EIO);
    pid_t child = fork();
    if (child < 0) die("fork", FI_EIO);
    int server = child == 0;
    pin(server);
    struct peer p = {0};
    if (server) open_peer(&p, up[1], down[0]);
    else open_peer(&p, down[1], up[0]);
    char *buf = malloc(size > 0 ? (size_t)size * WINDOW : 1);
    memset(buf, server + 1, size > 0 ? (size_t)size * WINDOW : 1);
    char ack[4] = {0};
    if (lat) {
        double *t = malloc(sizeof(double) * (n > 0 ? n : 1));
        /* Ticks of the clock stack_bench's own layers read (ticks.h), microseconds after. */
        tick_init();
        tick_span_start();
        for (long i = 0; i < warm + n; i++) {
            unsigned long long start = ticks();
            long base = p.completed;
            if (!server) {
                recv_msg(&p, buf + size, size, 1);
                send_msg(&p, buf, size, 0);
                wait_for(&p, base + 2);
            } else {
                recv_msg(&p, buf, size, 1);
                wait_for(&p, base + 1);
                send_msg(&p, buf, size, 0);
                wait_for(&p, base + 2);
            }
            unsigned long long end = ticks();
            if (i >= warm) t[i - warm] = end > start ? (double)(end - start) : 0;
        }
        if (!server) {
            double us_per_tick = tick_us_per_tick();
            qsort(t, n, sizeof(double), cmp);
            printf("%.4f %.4f\n", t[n / 2] * us_per_tick / 2, t[n * 99 / 100] * us_per_tick / 2);
        }
    } else {
        double start = 0;
        for (long done = -warm; done < n;) {
            if (done == 0 && start == 0) start = tick_mono_ns() * 1e-9;
            long k = done < 0 ? -done : n - done;
            if (k > WINDOW) k = WINDOW;
            long base = p.completed;
            if (!server) {
                recv_msg(&p, ack, sizeof ack, WINDOW);
                for (long j = 0; j < k; j++) send_msg(&p, buf + j * size, size, (int)j);
                wait_for(&p, base + k + 1);
            } else {
                for (long j = 0; j < k; j++) recv_msg(&p, buf + j * size, size, (int)j);
                wait_for(&p, base + k);
                send_msg(&p, ack, sizeof ack, WINDOW);
                wait_for(&p, base + k + 1);
            }
            done += k;
            if (done == 0) start = tick_mono_ns() * 1e-9;
        }
        double secs = tick_mono_ns() * 1e-9 - start;
        if (!server) printf("%.6g\n", (double)size * n / secs / 1e9);
    }
    fflush(stdout);
    fi_close(&p.ep->fid);
    fi_close(&p.av->fid);
    fi_close(&p.cq->fid);
    fi_close(&p.domain->fid);
    fi_close(&p.fabric->fid);
    fi_freeinfo(p.info);
    free(buf);
    if (!server) {
        int st = 0;
        waitpid(child, &st, 0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
    return 0;
}
