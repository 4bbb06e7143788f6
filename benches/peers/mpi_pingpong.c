/* Open MPI's point-to-point as stack_bench's `mpi` layer measures it: two ranks, each pinned
 * to the CPU named by STACK_BENCH_CPUS ("client,server": rank 0 on the first).
 *   lat SIZE N WARM   prints the median and the 99th percentile of the one-way latency of N
 *                     round trips (half of each), in microseconds
 *   bw  SIZE N WARM   prints the bandwidth of N messages in GB/s (a window of 64 outstanding
 *                     MPI_Isend/MPI_Irecv, then a zero-byte acknowledgement), warm-up excluded */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ticks.h"

#define WINDOW 64

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void pin(int rank) {
    const char *cpus = getenv("STACK_BENCH_CPUS");
    if (!cpus) return;
    int c0 = -1, c1 = -1;
    if (sscanf(cpus, "%d,%d", &c0, &c1) != 2) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(rank == 0 ? c0 : c1, &set);
    sched_setaffinity(0, sizeof set, &set);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size_w;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size_w);
    if (argc != 5 || size_w != 2) {
        if (rank == 0) fprintf(stderr, "usage: mpirun -np 2 %s lat|bw SIZE N WARM\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    pin(rank);
    long size = atol(argv[2]), n = atol(argv[3]), warm = atol(argv[4]);
    char *buf = malloc(size > 0 ? size * WINDOW : 1);
    memset(buf, rank + 1, size > 0 ? size * WINDOW : 1);
    int peer = 1 - rank;
    if (strcmp(argv[1], "lat") == 0) {
        double *t = malloc(sizeof(double) * (n > 0 ? n : 1));
        /* Ticks of the clock stack_bench's own layers read (ticks.h), microseconds after. */
        tick_init();
        tick_span_start();
        for (long i = 0; i < warm + n; i++) {
            unsigned long long start = ticks();
            if (rank == 0) {
                MPI_Send(buf, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
                MPI_Recv(buf, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(buf, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(buf, size, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
            }
            unsigned long long end = ticks();
            if (i >= warm) t[i - warm] = end > start ? (double)(end - start) : 0;
        }
        if (rank == 0) {
            double us_per_tick = tick_us_per_tick();
            qsort(t, n, sizeof(double), cmp);
            printf("%.4f %.4f\n", t[n / 2] * us_per_tick / 2, t[n * 99 / 100] * us_per_tick / 2);
        }
    } else {
        MPI_Request req[WINDOW];
        double start = 0;
        for (long done = -warm; done < n;) {
            if (done == 0 && start == 0) start = MPI_Wtime();
            long k = (done < 0 ? -done : n - done);
            if (k > WINDOW) k = WINDOW;
            for (long j = 0; j < k; j++) {
                if (rank == 0) MPI_Isend(buf + j * size, size, MPI_CHAR, peer, 2, MPI_COMM_WORLD, &req[j]);
                else MPI_Irecv(buf + j * size, size, MPI_CHAR, peer, 2, MPI_COMM_WORLD, &req[j]);
            }
            MPI_Waitall(k, req, MPI_STATUSES_IGNORE);
            if (rank == 0) MPI_Recv(NULL, 0, MPI_CHAR, peer, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            else MPI_Send(NULL, 0, MPI_CHAR, peer, 3, MPI_COMM_WORLD);
            done += k;
            if (done == 0) start = MPI_Wtime();
        }
        double secs = MPI_Wtime() - start;
        if (rank == 0) printf("%.6g\n", (double)size * n / secs / 1e9);
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
