// What bounds the AVX-512 VNNI Q4_1 panel kernel (kernels/src/quant/simd.rs, `tile_vnni`):
// built and run by scripts/vnni-bound. The AVX2 kernel's counterpart is scripts/avx2-bound.c.
//
// Part 1, vector pipes: instructions per nanosecond of vpdpbusd, vmulps, vaddps and
// vcvtdq2ps alone (12 independent chains of one instruction), and of vpdpbusd mixed 2:1 with
// each of the others. A mix that runs at the pure vpdpbusd rate shares no pipe with it; one
// that runs at its own instructions' sum shares both.
//
// Part 2, the block loop's arithmetic: 8 activation rows against one panel block (8 weight
// rows x 32 codes, the codes in registers, each activation group broadcast from L1), per row
// 8 vpdpbusd and then either the kernel's float term `(f32(s) * d_w) * d_a + m_w * s_a`
// added to the row's accumulator ("dot + float term") or the integer sum added as is ("dot
// only"); the dot as one chain per row (the kernel's form) or two (groups 0-3 and 4-7, added).
// GOP/s per core counts 2 ops per multiply-add of 4-bit code and 8-bit activation; compare it
// with `matmul_bench 1 16 20` (the real kernel, single thread, nibble decoding and weight
// streaming included). Each variant's best of 5 rounds, interleaved (this kind of host drifts).
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// ---- Part 1 ----
#define N1 20000000L
#define DP(r) "vpdpbusd %%ymm14, %%ymm15, %%ymm" #r "\n\t"
#define OP(ins, r) ins " %%ymm14, %%ymm" #r ", %%ymm" #r "\n\t"
#define CLOB "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"
#define TWELVE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define MIX(ins) DP(0) DP(1) OP(ins, 8) DP(2) DP(3) OP(ins, 9) DP(4) DP(5) OP(ins, 10) DP(6) DP(7) OP(ins, 11)
#define MUL(r) OP("vmulps", r)
#define ADD(r) OP("vaddps", r)
#define CVT(r) "vcvtdq2ps %%ymm14, %%ymm" #r "\n\t"
static void dp(long n) { for (long i = 0; i < n; i++) __asm__ volatile(TWELVE(DP) ::: CLOB); }
static void mul(long n) { for (long i = 0; i < n; i++) __asm__ volatile(TWELVE(MUL) ::: CLOB); }
static void add(long n) { for (long i = 0; i < n; i++) __asm__ volatile(TWELVE(ADD) ::: CLOB); }
static void cvt(long n) { for (long i = 0; i < n; i++) __asm__ volatile(TWELVE(CVT) ::: CLOB); }
static void dp_mul(long n) { for (long i = 0; i < n; i++) __asm__ volatile(MIX("vmulps") ::: CLOB); }
static void dp_add(long n) { for (long i = 0; i < n; i++) __asm__ volatile(MIX("vaddps") ::: CLOB); }
static void dp_cvt(long n) {
    for (long i = 0; i < n; i++)
        __asm__ volatile(DP(0) DP(1) CVT(8) DP(2) DP(3) CVT(9) DP(4) DP(5) CVT(10) DP(6) DP(7) CVT(11) ::: CLOB);
}
// The same on 512-bit vectors: where a 512-bit instruction runs at the 256-bit rate (two
// full-width ports, as on Intel Xeon), the 512-bit kernel (kernels/src/quant/simd512.rs) does
// twice the work per instruction; Zen 4 splits it over its 256-bit pipes.
#define DPZ(r) "vpdpbusd %%zmm14, %%zmm15, %%zmm" #r "\n\t"
#define MULZ(r) "vmulps %%zmm14, %%zmm" #r ", %%zmm" #r "\n\t"
static void dpz(long n) { for (long i = 0; i < n; i++) __asm__ volatile(TWELVE(DPZ) ::: CLOB); }
static void mulz(long n) { for (long i = 0; i < n; i++) __asm__ volatile(TWELVE(MULZ) ::: CLOB); }
static double rate(void (*f)(long)) {
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        double t0 = now();
        f(N1);
        double t = now() - t0;
        if (t < best) best = t;
    }
    return 12.0 * N1 / best / 1e9;
}

// ---- Part 2 ----
#define ROWS 8
static int32_t ACT[64][8] __attribute__((aligned(64)));
static float AD[64], AS[64];
static inline __attribute__((always_inline)) __m256 block_rows(long n, int full, int chains, const __m256i *w, __m256 dw, __m256 mw) {
    __m256 acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();
    for (long it = 0; it < n; it++) {
        int j = it & 63;
#pragma GCC unroll 8
        for (int i = 0; i < ROWS; i++) {
            const int32_t *a = ACT[(j + i) & 63];
            __m256i s;
            if (chains == 1) {
                s = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++) s = _mm256_dpbusd_epi32(s, w[g], _mm256_set1_epi32(a[g]));
            } else {
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {
                    s0 = _mm256_dpbusd_epi32(s0, w[g], _mm256_set1_epi32(a[g]));
                    s1 = _mm256_dpbusd_epi32(s1, w[g + 4], _mm256_set1_epi32(a[g + 4]));
                }
                s = _mm256_add_epi32(s0, s1);
            }
            if (full) {
                __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), dw), _mm256_set1_ps(AD[(j + i) & 63]));
                acc[i] = _mm256_add_ps(acc[i], _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(AS[(j + i) & 63]))));
            } else {
                acc[i] = _mm256_add_ps(acc[i], _mm256_castsi256_ps(s));
            }
        }
        __asm__ volatile("" ::"m"(ACT));
    }
    __m256 r = acc[0];
    for (int i = 1; i < ROWS; i++) r = _mm256_add_ps(r, acc[i]);
    return r;
}

// One function per variant, so the variant's choices are constants in its loop.
#define VARIANT(name, full, chains) \
    __attribute__((noinline)) static __m256 name(long n, const __m256i *w, __m256 dw, __m256 mw) { return block_rows(n, full, chains, w, dw, mw); }
VARIANT(term1, 1, 1)
VARIANT(term2, 1, 2)
VARIANT(dot1, 0, 1)
VARIANT(dot2, 0, 2)

int main(void) {
    printf("part 1: instructions per ns (12 independent chains)\n");
    double d = rate(dp), m = rate(mul), a = rate(add), c = rate(cvt);
    printf("  vpdpbusd %.2f, vmulps %.2f, vaddps %.2f, vcvtdq2ps %.2f\n", d, m, a, c);
    printf("  512-bit: vpdpbusd %.2f, vmulps %.2f (each twice a 256-bit one's work)\n", rate(dpz), rate(mulz));
    struct { const char *name; void (*f)(long); double other; } mixes[] = {
        {"8 vpdpbusd + 4 vmulps", dp_mul, m}, {"8 vpdpbusd + 4 vaddps", dp_add, a}, {"8 vpdpbusd + 4 vcvtdq2ps", dp_cvt, c}};
    for (int i = 0; i < 3; i++) {
        double r = rate(mixes[i].f);
        // Time per 12 if the 4 others share vpdpbusd's pipes: 8/d + 4/other; if not: 8/d.
        printf("  %-26s %.2f per ns (shared pipes would give %.2f, separate %.2f)\n", mixes[i].name, r,
               12.0 / (8.0 / d + 4.0 / mixes[i].other), 12.0 / (8.0 / d));
    }

    printf("part 2: GOP/s per core, 8 rows x one panel block (8 x 32 codes), best of 5\n");
    __m256i w[8];
    for (int g = 0; g < 8; g++) w[g] = _mm256_set1_epi8((char)(g + 1));  // 4-bit codes
    for (int i = 0; i < 64; i++) {
        for (int g = 0; g < 8; g++) ACT[i][g] = (int32_t)(((i + g) % 64) * 0x01010101u);
        AD[i] = 1.0f / (i + 1);
        AS[i] = (float)i;
    }
    __m256 dw = _mm256_set1_ps(0.5f), mw = _mm256_set1_ps(0.25f);
    const long n = 4000000;
    const char *names[4] = {"dot + float term, 1 chain ", "dot + float term, 2 chains", "dot only, 1 chain         ", "dot only, 2 chains        "};
    double best[4] = {0};
    float sink = 0;
    for (int round = 0; round < 5; round++)
        for (int v = 0; v < 4; v++) {
            double t0 = now();
            __m256 (*f[4])(long, const __m256i *, __m256, __m256) = {term1, term2, dot1, dot2};
            __m256 r = f[v](n, w, dw, mw);
            double g = (double)n * ROWS * 8 * 32 * 2 / (now() - t0) / 1e9;
            sink += r[0];
            if (g > best[v]) best[v] = g;
        }
    for (int v = 0; v < 4; v++) printf("  %s %6.1f\n", names[v], best[v]);
    printf("  (checksum %g)\n", sink);
    return 0;
}
