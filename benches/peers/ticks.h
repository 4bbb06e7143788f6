/* The clock the peer programs read once or twice per round trip: the same as stack_bench's
 * own layers (benches/src/lib.rs, TickClock) and as cheap as ucx_perftest's, the CPU's
 * time-stamp counter where it runs at a constant rate through sleep states, else
 * clock_gettime. Ticks become microseconds by the rate measured over the block itself
 * (tick_span_start, then tick_us_per_tick at its end). */
#ifndef PEERS_TICKS_H
#define PEERS_TICKS_H

#include <stdio.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

static int tick_tsc;
static double tick_span_ns;
static unsigned long long tick_span_ticks;

static double tick_mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* Chooses the counter if /proc/cpuinfo lists constant_tsc and nonstop_tsc (x86-64 only). */
static void tick_init(void) {
    tick_tsc = 0;
#if defined(__x86_64__)
    FILE *f = fopen("/proc/cpuinfo", "r");
    static char line[16384];
    if (f) {
        while (fgets(line, sizeof line, f)) {
            if (strncmp(line, "flags", 5) == 0) {
                tick_tsc = strstr(line, " constant_tsc") && strstr(line, " nonstop_tsc");
                break;
            }
        }
        fclose(f);
    }
#endif
}

static inline unsigned long long ticks(void) {
#if defined(__x86_64__)
    if (tick_tsc) return __rdtsc();
#endif
    return (unsigned long long)tick_mono_ns();
}

static void tick_span_start(void) {
    tick_span_ns = tick_mono_ns();
    tick_span_ticks = ticks();
}

/* Microseconds per tick since tick_span_start. */
static double tick_us_per_tick(void) {
    unsigned long long now = ticks();
    unsigned long long k = now > tick_span_ticks ? now - tick_span_ticks : 0;
    double ns = tick_mono_ns() - tick_span_ns;
    if (!tick_tsc || k == 0) return 1e-3;
    return ns / 1e3 / (double)k;
}

#endif
