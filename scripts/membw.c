// Memory read bandwidth with N threads (default 2): each thread sums its share of a 1 GiB
// buffer of 64-bit words, 5 passes; prints GB/s (1e9 bytes) of the best pass.
// Built and run by scripts/membw. The sum is printed so the reads cannot be optimized away.
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static uint64_t *buf;
static size_t words;
static int nthreads;
typedef struct { size_t lo, hi; uint64_t sum; } job;

static void *run(void *p) {
    job *j = p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = j->lo; i + 4 <= j->hi; i += 4) {
        s0 += buf[i]; s1 += buf[i + 1]; s2 += buf[i + 2]; s3 += buf[i + 3];
    }
    j->sum = s0 + s1 + s2 + s3;
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    nthreads = argc > 1 ? atoi(argv[1]) : 2;
    size_t bytes = (size_t)1 << 30;
    words = bytes / 8;
    buf = malloc(bytes);
    for (size_t i = 0; i < words; i++) buf[i] = i;
    double best = 0;
    uint64_t total = 0;
    for (int pass = 0; pass < 5; pass++) {
        pthread_t th[64];
        job jobs[64];
        double t0 = now();
        for (int t = 0; t < nthreads; t++) {
            jobs[t].lo = words / nthreads * t;
            jobs[t].hi = words / nthreads * (t + 1);
            pthread_create(&th[t], NULL, run, &jobs[t]);
        }
        for (int t = 0; t < nthreads; t++) { pthread_join(th[t], NULL); total += jobs[t].sum; }
        double gbs = bytes / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    printf("{\"threads\": %d, \"read_gb_per_s\": %.2f, \"checksum\": %llu}\n", nthreads, best, (unsigned long long)(total & 0xffff));
    return 0;
}
