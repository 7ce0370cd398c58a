// What bounds the AVX2 Q4_1 panel kernel (kernels/src/quant/simd.rs, `chunk` for 4-bit codes
// with a min, 4 activation rows): built and run by scripts/avx2-bound.
//
// Part 1, vector pipes: the throughput of the loop's instructions alone and in pairs, as
// operations per cycle (a cycle: one dependent 64-bit add, timed first).
//
// Part 2, the loop itself: the kernel's block loop written out in assembly with a fixed
// register for every value (no stack traffic), over a tile of 8 panels x 18 blocks (SmolLM2's
// 576 columns) against 16 activation rows in chunks of 4, in L1/L2. Variants that remove or
// move one kind of work, each timed interleaved with the full loop in the same process (this
// host's speed drifts), as a fraction of the full loop's time:
//   - no finalize: the per-block float term `(f32(madd(s)) * d_w) * d_a + m_w * s_a`
//     replaced by one integer add;
//   - no pmaddubsw: the 8 multiplies per block and row removed (the broadcasts stay);
//   - magic cvt: `vcvtdq2ps` replaced by the exact integer-add / float-subtract trick
//     (one multiply-pipe operation traded for two others);
//   - 2 panels x 2 rows: each activation broadcast feeds two panels (half the broadcasts);
//   - pre-broadcast acts: the activations splatted once into 320-byte blocks (each 4-byte
//     group repeated in 8 lanes, then d and s repeated), read as memory operands of
//     pmaddubsw and vmulps: no broadcast instruction left in the loop;
//   - 2 panels x 4 rows: each broadcast feeds two panels, the 8 block sums in registers and
//     the 8 accumulators in memory (16 registers do not hold both).
// All variants that compute the product are checked bit for bit against the full loop. This
// measures the loop in cache; BENCHMARKS "The AVX2 matmul at its issue bound" has what each
// variant did inside the real matmul.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double cycle_s(void) {
    uint64_t x = 0;
    double t0 = now();
    for (long i = 0; i < 200000000L; i++) __asm__ volatile("add $1, %0" : "+r"(x));
    return (now() - t0) / 200000000.0;
}

// ---- Part 1 ----
#define N1 50000000L
#define BAR __asm__ volatile("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3), "+x"(x4), "+x"(x5), \
                             "+x"(x6), "+x"(x7), "+x"(x8), "+x"(x9), "+x"(x10), "+x"(x11))
#define MULPS(a, b) _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b)))
#define CVT(a, b) _mm256_castps_si256(_mm256_cvtepi32_ps(a))
#define MB(a, b) _mm256_maddubs_epi16(a, b)
#define AW(a, b) _mm256_add_epi16(a, b)
#define SG(a, b) _mm256_sign_epi8(a, b)
#define MW(a, b) _mm256_madd_epi16(a, b)
// 12 independent chains: ops A on x0..x5, B on x6..x11.
#define PAIR(name, A, B)                                                                      \
    {                                                                                         \
        double best = 1e9;                                                                    \
        for (int r = 0; r < 3; r++) {                                                         \
            double t0 = now();                                                                \
            for (long i = 0; i < N1; i++) {                                                   \
                x0 = A(x0, y); x1 = A(x1, y); x2 = A(x2, y); x3 = A(x3, y); x4 = A(x4, y);    \
                x5 = A(x5, y); x6 = B(x6, y); x7 = B(x7, y); x8 = B(x8, y); x9 = B(x9, y);    \
                x10 = B(x10, y); x11 = B(x11, y);                                             \
                BAR;                                                                          \
            }                                                                                 \
            double t = (now() - t0) / N1 / cyc;                                               \
            if (t < best) best = t;                                                           \
        }                                                                                     \
        printf("  %-28s %5.2f ops per cycle\n", name, 12 / best);                            \
    }

static void part1(double cyc) {
    __m256i y = _mm256_set1_epi8(1);
    __m256i x0 = y, x1 = y, x2 = y, x3 = y, x4 = y, x5 = y, x6 = y, x7 = y, x8 = y, x9 = y, x10 = y, x11 = y;
    printf("vector pipes (12 independent chains):\n");
    PAIR("vpmaddubsw", MB, MB)
    PAIR("vpmaddwd", MW, MW)
    PAIR("vmulps", MULPS, MULPS)
    PAIR("vcvtdq2ps", CVT, CVT)
    PAIR("vpsignb", SG, SG)
    PAIR("vpaddw", AW, AW)
    PAIR("6 vpmaddubsw + 6 vmulps", MB, MULPS)
    PAIR("6 vpmaddubsw + 6 vcvtdq2ps", MB, CVT)
    PAIR("6 vpmaddubsw + 6 vpsignb", MB, SG)
    PAIR("6 vpmaddubsw + 6 vpaddw", MB, AW)
    int out[8];
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi32(x0, _mm256_add_epi32(x6, x11)));
    printf("  (checksum %d)\n", out[0]);
}

// ---- Part 2 ----
typedef struct { float d, s; int32_t sum, sum_lo; int8_t qs[32]; } Act;  // ActBlock
#define NB 18
#define NP 8
#define PB 160  // a Q4_1 panel block: 8 f16 d, 8 f16 m, 128 bytes of codes
static uint8_t W[NP * NB * PB] __attribute__((aligned(64)));
static Act A[16 * NB] __attribute__((aligned(64)));
static float OUT_REF[16 * NP * 8], OUT[16 * NP * 8];
static const float MAGIC[8] __attribute__((aligned(32))) = {12582912.f, 12582912.f, 12582912.f, 12582912.f,
                                                              12582912.f, 12582912.f, 12582912.f, 12582912.f};
static const int16_t ONES[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

// One row's 16-bit sum for one 32-byte load of codes (lo nibbles in ymm8, hi in ymm9).
#define RS_FULL(H, ROW, T0, T1, S)                                                            \
    "vpbroadcastd " #H "*8+16" ROW ", %%" T0 "\n\t" "vpmaddubsw %%" T0 ", %%ymm8, %%" T0 "\n\t" \
    "vpbroadcastd " #H "*8+20" ROW ", %%" T1 "\n\t" "vpmaddubsw %%" T1 ", %%ymm9, %%" T1 "\n\t" \
    "vpaddw %%" T1 ", %%" T0 ", %%" T0 "\n\t" "vpaddw %%" T0 ", %%" S ", %%" S "\n\t"
#define RS_NOMB(H, ROW, T0, T1, S)                                                            \
    "vpbroadcastd " #H "*8+16" ROW ", %%" T0 "\n\t" "vpbroadcastd " #H "*8+20" ROW ", %%" T1 "\n\t" \
    "vpaddw %%" T1 ", %%" T0 ", %%" T0 "\n\t" "vpaddw %%" T0 ", %%" S ", %%" S "\n\t"
#define HALF(RS, H)                                                                           \
    "vmovdqu 32+" #H "*32(%[blk]), %%ymm8\n\t" "vpsrlw $4, %%ymm8, %%ymm9\n\t"                 \
    "vpand %%ymm15, %%ymm8, %%ymm8\n\t" "vpand %%ymm15, %%ymm9, %%ymm9\n\t"                    \
    RS(H, "(%[ra])", "ymm10", "ymm11", "ymm4") RS(H, "(%[ra],%[st],1)", "ymm12", "ymm13", "ymm5") \
    RS(H, "(%[ra],%[st],2)", "ymm10", "ymm11", "ymm6") RS(H, "(%[rb],%[st],2)", "ymm12", "ymm13", "ymm7")
#define CVT_HW(S) "vcvtdq2ps %%" S ", %%" S "\n\t"
#define CVT_MAGIC(S) "vpaddd %[magic], %%" S ", %%" S "\n\t" "vsubps %[magic], %%" S ", %%" S "\n\t"
#define TERM(CV, ROW, S, ACC, T0, T1)                                                         \
    "vpmaddwd %%ymm14, %%" S ", %%" S "\n\t" CV(S) "vmulps %%ymm8, %%" S ", %%" S "\n\t"        \
    "vbroadcastss 0" ROW ", %%" T0 "\n\t" "vmulps %%" T0 ", %%" S ", %%" S "\n\t"              \
    "vbroadcastss 4" ROW ", %%" T1 "\n\t" "vmulps %%" T1 ", %%ymm9, %%" T1 "\n\t"             \
    "vaddps %%" T1 ", %%" S ", %%" S "\n\t" "vaddps %%" S ", %%" ACC ", %%" ACC "\n\t"
#define TERMS(CV)                                                                             \
    "vcvtph2ps 0(%[blk]), %%ymm8\n\t" "vcvtph2ps 16(%[blk]), %%ymm9\n\t"                      \
    TERM(CV, "(%[ra])", "ymm4", "ymm0", "ymm10", "ymm11")                                     \
    TERM(CV, "(%[ra],%[st],1)", "ymm5", "ymm1", "ymm12", "ymm13")                             \
    TERM(CV, "(%[ra],%[st],2)", "ymm6", "ymm2", "ymm10", "ymm11")                             \
    TERM(CV, "(%[rb],%[st],2)", "ymm7", "ymm3", "ymm12", "ymm13")
#define TERMS_NONE                                                                            \
    "vpaddd %%ymm4, %%ymm0, %%ymm0\n\t" "vpaddd %%ymm5, %%ymm1, %%ymm1\n\t"                   \
    "vpaddd %%ymm6, %%ymm2, %%ymm2\n\t" "vpaddd %%ymm7, %%ymm3, %%ymm3\n\t"
// The nibble mask in ymm15, zeroed accumulators ymm0-3; per block, zeroed sums ymm4-7.
#define PROLOGUE                                                                              \
    "vpcmpeqb %%ymm15, %%ymm15, %%ymm15\n\t" "vpsrlw $12, %%ymm15, %%ymm15\n\t"             \
    "vpackuswb %%ymm15, %%ymm15, %%ymm15\n\t"                                                \
    "vxorps %%ymm0, %%ymm0, %%ymm0\n\t" "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"                 \
    "vxorps %%ymm2, %%ymm2, %%ymm2\n\t" "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
#define ZERO_SUMS                                                                             \
    "vpxor %%ymm4, %%ymm4, %%ymm4\n\t" "vpxor %%ymm5, %%ymm5, %%ymm5\n\t"                   \
    "vpxor %%ymm6, %%ymm6, %%ymm6\n\t" "vpxor %%ymm7, %%ymm7, %%ymm7\n\t"
// One panel's blocks against 4 rows (row i at acts + i * stride bytes).
#define KERNEL(NAME, RS, FIN)                                                                  \
    static void NAME(const uint8_t *blk, const Act *acts, long stride, long nb, float *out, long os) { \
        const Act *rb = (const Act *)((const char *)acts + stride);                            \
        __asm__ volatile(                                                                      \
            "vmovdqa %[ones], %%ymm14\n\t" PROLOGUE "1:\n\t" ZERO_SUMS                     \
            HALF(RS, 0) HALF(RS, 1) HALF(RS, 2) HALF(RS, 3) FIN                                \
            "add $160, %[blk]\n\t" "add $48, %[ra]\n\t" "add $48, %[rb]\n\t"                   \
            "dec %[n]\n\t" "jnz 1b\n\t"                                                        \
            "vmovups %%ymm0, (%[out])\n\t" "vmovups %%ymm1, (%[out],%[os],1)\n\t"              \
            "vmovups %%ymm2, (%[out],%[os],2)\n\t" "lea (%[out],%[os],2), %[out]\n\t"          \
            "vmovups %%ymm3, (%[out],%[os],1)\n\t"                                             \
            : [blk] "+r"(blk), [ra] "+r"(acts), [rb] "+r"(rb), [n] "+r"(nb), [out] "+r"(out)   \
            : [st] "r"(stride), [os] "r"(os), [magic] "m"(*(const float(*)[8])MAGIC),          \
              [ones] "m"(*(const int16_t(*)[16])ONES)                                          \
            : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",  \
              "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");           \
    }
KERNEL(k_full, RS_FULL, TERMS(CVT_HW))
KERNEL(k_noterm, RS_FULL, TERMS_NONE)
KERNEL(k_nomb, RS_NOMB, TERMS(CVT_HW))
KERNEL(k_magic, RS_FULL, TERMS(CVT_MAGIC))

// 2 panels x 2 rows: accumulators ymm0 (row 0, panel 0), ymm1 (0, 1), ymm2 (1, 0), ymm3 (1, 1).
#define RS2(H, ROW, S0, S1)                                                                   \
    "vpbroadcastd " #H "*8+16" ROW ", %%ymm12\n\t" "vpbroadcastd " #H "*8+20" ROW ", %%ymm13\n\t" \
    "vpmaddubsw %%ymm12, %%ymm8, %%ymm14\n\t" "vpaddw %%ymm14, %%" S0 ", %%" S0 "\n\t"         \
    "vpmaddubsw %%ymm13, %%ymm9, %%ymm14\n\t" "vpaddw %%ymm14, %%" S0 ", %%" S0 "\n\t"         \
    "vpmaddubsw %%ymm12, %%ymm10, %%ymm12\n\t" "vpaddw %%ymm12, %%" S1 ", %%" S1 "\n\t"        \
    "vpmaddubsw %%ymm13, %%ymm11, %%ymm13\n\t" "vpaddw %%ymm13, %%" S1 ", %%" S1 "\n\t"
#define HALF2(H)                                                                              \
    "vmovdqu 32+" #H "*32(%[blk]), %%ymm8\n\t" "vpsrlw $4, %%ymm8, %%ymm9\n\t"                 \
    "vpand %%ymm15, %%ymm8, %%ymm8\n\t" "vpand %%ymm15, %%ymm9, %%ymm9\n\t"                    \
    "vmovdqu 32+" #H "*32(%[blk],%[ps],1), %%ymm10\n\t" "vpsrlw $4, %%ymm10, %%ymm11\n\t"      \
    "vpand %%ymm15, %%ymm10, %%ymm10\n\t" "vpand %%ymm15, %%ymm11, %%ymm11\n\t"                \
    RS2(H, "(%[ra])", "ymm4", "ymm5") RS2(H, "(%[ra],%[st],1)", "ymm6", "ymm7")
#define TERM2(S, ACC, DW, MW)                                                                 \
    "vpmaddwd %[ones], %%" S ", %%" S "\n\t" "vcvtdq2ps %%" S ", %%" S "\n\t"                  \
    "vmulps %%" DW ", %%" S ", %%" S "\n\t" "vmulps %%ymm12, %%" S ", %%" S "\n\t"             \
    "vmulps %%ymm13, %%" MW ", %%ymm14\n\t" "vaddps %%ymm14, %%" S ", %%" S "\n\t"            \
    "vaddps %%" S ", %%" ACC ", %%" ACC "\n\t"
static void k_2p2r(const uint8_t *blk, const Act *acts, long stride, long nb, float *out, long os, long ps) {
    __asm__ volatile(
        PROLOGUE "1:\n\t" ZERO_SUMS
        HALF2(0) HALF2(1) HALF2(2) HALF2(3)
        "vcvtph2ps 0(%[blk]), %%ymm8\n\t" "vcvtph2ps 16(%[blk]), %%ymm9\n\t"
        "vcvtph2ps 0(%[blk],%[ps],1), %%ymm10\n\t" "vcvtph2ps 16(%[blk],%[ps],1), %%ymm11\n\t"
        "vbroadcastss 0(%[ra]), %%ymm12\n\t" "vbroadcastss 4(%[ra]), %%ymm13\n\t"
        TERM2("ymm4", "ymm0", "ymm8", "ymm9") TERM2("ymm5", "ymm1", "ymm10", "ymm11")
        "vbroadcastss 0(%[ra],%[st],1), %%ymm12\n\t" "vbroadcastss 4(%[ra],%[st],1), %%ymm13\n\t"
        TERM2("ymm6", "ymm2", "ymm8", "ymm9") TERM2("ymm7", "ymm3", "ymm10", "ymm11")
        "add $160, %[blk]\n\t" "add $48, %[ra]\n\t" "dec %[n]\n\t" "jnz 1b\n\t"
        "vmovups %%ymm0, (%[out])\n\t" "vmovups %%ymm1, 32(%[out])\n\t"
        "vmovups %%ymm2, (%[out],%[os],1)\n\t" "vmovups %%ymm3, 32(%[out],%[os],1)\n\t"
        : [blk] "+r"(blk), [ra] "+r"(acts), [n] "+r"(nb), [out] "+r"(out)
        : [st] "r"(stride), [os] "r"(os), [ps] "r"(ps), [ones] "m"(*(const int16_t(*)[16])ONES)
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
          "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}

typedef void (*Kernel)(const uint8_t *, const Act *, long, long, float *, long);
static void tile(Kernel k, float *out) {
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < NP; p++)
            k(W + p * NB * PB, A + c * 4 * NB, NB * sizeof(Act), NB, out + c * 4 * NP * 8 + p * 8, NP * 8 * sizeof(float));
}
static void tile_2p2r(Kernel unused, float *out) {
    (void)unused;
    for (int c = 0; c < 8; c++)
        for (int p = 0; p < NP; p += 2)
            k_2p2r(W + p * NB * PB, A + c * 2 * NB, NB * sizeof(Act), NB, out + c * 2 * NP * 8 + p * 8, NP * 8 * sizeof(float), NB * PB);
}


// Pre-broadcast activations: per row and block, 8 groups x 32 bytes (each group's 4 bytes
// repeated) then d_a x 8 and s_a x 8: 320 bytes; pmaddubsw and vmulps take them as memory
// operands, so no broadcast instruction remains in the loop.
#define PRE 320
static int8_t AB[16 * NB * PRE] __attribute__((aligned(64)));
#define RS_PRE(H, ROW, T0, T1, S)                                                             \
    "vpmaddubsw " #H "*64" ROW ", %%ymm8, %%" T0 "\n\t"                                        \
    "vpmaddubsw " #H "*64+32" ROW ", %%ymm9, %%" T1 "\n\t"                                     \
    "vpaddw %%" T1 ", %%" T0 ", %%" T0 "\n\t" "vpaddw %%" T0 ", %%" S ", %%" S "\n\t"
#define TERM_PRE(ROW, S, ACC, T1)                                                             \
    "vpmaddwd %%ymm14, %%" S ", %%" S "\n\t" "vcvtdq2ps %%" S ", %%" S "\n\t"                  \
    "vmulps %%ymm8, %%" S ", %%" S "\n\t" "vmulps 256" ROW ", %%" S ", %%" S "\n\t"            \
    "vmulps 288" ROW ", %%ymm9, %%" T1 "\n\t"                                                  \
    "vaddps %%" T1 ", %%" S ", %%" S "\n\t" "vaddps %%" S ", %%" ACC ", %%" ACC "\n\t"
#define TERMS_PRE                                                                             \
    "vcvtph2ps 0(%[blk]), %%ymm8\n\t" "vcvtph2ps 16(%[blk]), %%ymm9\n\t"                      \
    TERM_PRE("(%[ra])", "ymm4", "ymm0", "ymm11") TERM_PRE("(%[ra],%[st],1)", "ymm5", "ymm1", "ymm13") \
    TERM_PRE("(%[ra],%[st],2)", "ymm6", "ymm2", "ymm11") TERM_PRE("(%[rb],%[st],2)", "ymm7", "ymm3", "ymm13")
static void k_pre(const uint8_t *blk, const Act *acts_, long stride, long nb, float *out, long os) {
    const int8_t *acts = (const int8_t *)acts_;
    const int8_t *rb = acts + stride;
    __asm__ volatile(
        "vmovdqa %[ones], %%ymm14\n\t"
        PROLOGUE "1:\n\t" ZERO_SUMS
        HALF(RS_PRE, 0) HALF(RS_PRE, 1) HALF(RS_PRE, 2) HALF(RS_PRE, 3) TERMS_PRE
        "add $160, %[blk]\n\t" "add $320, %[ra]\n\t" "add $320, %[rb]\n\t"
        "dec %[n]\n\t" "jnz 1b\n\t"
        "vmovups %%ymm0, (%[out])\n\t" "vmovups %%ymm1, (%[out],%[os],1)\n\t"
        "vmovups %%ymm2, (%[out],%[os],2)\n\t" "lea (%[out],%[os],2), %[out]\n\t"
        "vmovups %%ymm3, (%[out],%[os],1)\n\t"
        : [blk] "+r"(blk), [ra] "+r"(acts), [rb] "+r"(rb), [n] "+r"(nb), [out] "+r"(out)
        : [st] "r"(stride), [os] "r"(os), [ones] "m"(*(const int16_t(*)[16])ONES)
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
          "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
static void tile_pre(Kernel unused, float *out) {
    (void)unused;
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < NP; p++)
            k_pre(W + p * NB * PB, (const Act *)(AB + c * 4 * NB * PRE), NB * PRE, NB, out + c * 4 * NP * 8 + p * 8, NP * 8 * sizeof(float));
}


// 2 panels x 4 rows, the accumulators in memory (row i, panel q at acc + (2i + q) * 32 bytes).
// Registers: the sums of (row i, panel q) in ymm(2i + q); the nibbles of panel 0 in ymm8/9 and
// of panel 1 in ymm10/11; broadcasts in ymm12/13; ymm14 a temporary; ymm15 the mask.
#define RS24(H, ROW, S0, S1) \
    "vpbroadcastd " #H "*8+16" ROW ", %%ymm12\n\t" "vpbroadcastd " #H "*8+20" ROW ", %%ymm13\n\t" \
    "vpmaddubsw %%ymm12, %%ymm8, %%ymm14\n\t" "vpaddw %%ymm14, %%" S0 ", %%" S0 "\n\t" \
    "vpmaddubsw %%ymm13, %%ymm9, %%ymm14\n\t" "vpaddw %%ymm14, %%" S0 ", %%" S0 "\n\t" \
    "vpmaddubsw %%ymm12, %%ymm10, %%ymm12\n\t" "vpaddw %%ymm12, %%" S1 ", %%" S1 "\n\t" \
    "vpmaddubsw %%ymm13, %%ymm11, %%ymm13\n\t" "vpaddw %%ymm13, %%" S1 ", %%" S1 "\n\t"
#define HALF24(H) \
    "vmovdqu 32+" #H "*32(%[blk]), %%ymm8\n\t" "vpsrlw $4, %%ymm8, %%ymm9\n\t" \
    "vpand %%ymm15, %%ymm8, %%ymm8\n\t" "vpand %%ymm15, %%ymm9, %%ymm9\n\t" \
    "vmovdqu 32+" #H "*32(%[blk],%[ps],1), %%ymm10\n\t" "vpsrlw $4, %%ymm10, %%ymm11\n\t" \
    "vpand %%ymm15, %%ymm10, %%ymm10\n\t" "vpand %%ymm15, %%ymm11, %%ymm11\n\t" \
    RS24(H, "(%[ra])", "ymm0", "ymm1") RS24(H, "(%[ra],%[st],1)", "ymm2", "ymm3") \
    RS24(H, "(%[ra],%[st],2)", "ymm4", "ymm5") RS24(H, "(%[rb],%[st],2)", "ymm6", "ymm7")
// The block term of (row, panel) from sums S into the accumulator at OFF; the panel's d_w and
// m_w in DW and MW, the row's d_a in ymm12 and s_a in ymm13.
#define TERM24(S, OFF, DW, MW) \
    "vpmaddwd %[ones], %%" S ", %%" S "\n\t" "vcvtdq2ps %%" S ", %%" S "\n\t" \
    "vmulps %%" DW ", %%" S ", %%" S "\n\t" "vmulps %%ymm12, %%" S ", %%" S "\n\t" \
    "vmulps %%ymm13, %%" MW ", %%ymm14\n\t" "vaddps %%ymm14, %%" S ", %%" S "\n\t" \
    "vaddps " #OFF "(%[acc]), %%" S ", %%" S "\n\t" "vmovaps %%" S ", " #OFF "(%[acc])\n\t"
#define ROWTERMS(ROW, SA, SB, OA, OB) \
    "vbroadcastss 0" ROW ", %%ymm12\n\t" "vbroadcastss 4" ROW ", %%ymm13\n\t" \
    TERM24(SA, OA, "ymm8", "ymm9") TERM24(SB, OB, "ymm10", "ymm11")
static void k_2p4r(const uint8_t *blk, const Act *acts, long stride, long nb, float *out, long os, long ps) {
    float acc[8][8] __attribute__((aligned(32))) = {{0}};
    const Act *rb = (const Act *)((const char *)acts + stride);
    float *accp = &acc[0][0];
    __asm__ volatile(
        PROLOGUE "1:\n\t"
        "vpxor %%ymm0, %%ymm0, %%ymm0\n\t" "vpxor %%ymm1, %%ymm1, %%ymm1\n\t"
        "vpxor %%ymm2, %%ymm2, %%ymm2\n\t" "vpxor %%ymm3, %%ymm3, %%ymm3\n\t"
        ZERO_SUMS
        HALF24(0) HALF24(1) HALF24(2) HALF24(3)
        "vcvtph2ps 0(%[blk]), %%ymm8\n\t" "vcvtph2ps 16(%[blk]), %%ymm9\n\t"
        "vcvtph2ps 0(%[blk],%[ps],1), %%ymm10\n\t" "vcvtph2ps 16(%[blk],%[ps],1), %%ymm11\n\t"
        ROWTERMS("(%[ra])", "ymm0", "ymm1", 0, 32)
        ROWTERMS("(%[ra],%[st],1)", "ymm2", "ymm3", 64, 96)
        ROWTERMS("(%[ra],%[st],2)", "ymm4", "ymm5", 128, 160)
        ROWTERMS("(%[rb],%[st],2)", "ymm6", "ymm7", 192, 224)
        "add $160, %[blk]\n\t" "add $48, %[ra]\n\t" "add $48, %[rb]\n\t" "dec %[n]\n\t" "jnz 1b\n\t"
        : [blk] "+r"(blk), [ra] "+r"(acts), [rb] "+r"(rb), [n] "+r"(nb)
        : [st] "r"(stride), [ps] "r"(ps), [acc] "r"(accp), [ones] "m"(*(const int16_t(*)[16])ONES)
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
          "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    for (int i = 0; i < 4; i++) for (int q = 0; q < 2; q++) for (int l = 0; l < 8; l++)
        out[i * (os / 4) + q * 8 + l] = acc[2 * i + q][l];
}
static void tile_2p4r(Kernel unused, float *out) {
    (void)unused;
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < NP; p += 2)
            k_2p4r(W + p * NB * PB, A + c * 4 * NB, NB * sizeof(Act), NB, out + c * 4 * NP * 8 + p * 8, NP * 8 * sizeof(float), NB * PB);
}

static void part2(double cyc) {
    for (int i = 0; i < (int)sizeof W; i++) W[i] = (uint8_t)(i * 37);
    for (int b = 0; b < NP * NB; b++)  // sane f16 scales and mins
        for (int k = 0; k < 16; k++) {
            uint16_t h = (uint16_t)((k < 8 ? 0x211e : 0xaa66) + k);
            W[b * PB + 2 * k] = h & 0xff;
            W[b * PB + 2 * k + 1] = h >> 8;
        }
    for (int i = 0; i < 16 * NB; i++) {
        A[i].d = 0.01f * (i % 7 + 1);
        A[i].s = 0.02f * (i % 5 + 1);
        for (int k = 0; k < 32; k++) A[i].qs[k] = (int8_t)((k * 7 + i) % 50 - 25);
        int8_t *ab = AB + i * PRE;
        for (int g = 0; g < 8; g++)
            for (int r = 0; r < 8; r++)
                for (int k = 0; k < 4; k++) ab[32 * g + 4 * r + k] = A[i].qs[4 * g + k];
        for (int r = 0; r < 8; r++) {
            ((float *)(ab + 256))[r] = A[i].d;
            ((float *)(ab + 288))[r] = A[i].s;
        }
    }
    struct { const char *name; Kernel k; void (*run)(Kernel, float *); int exact; } v[] = {
        {"full loop", k_full, tile, 1},
        {"no finalize", k_noterm, tile, 0},
        {"no pmaddubsw", k_nomb, tile, 0},
        {"magic cvt", k_magic, tile, 1},
        {"2 panels x 2 rows", 0, tile_2p2r, 1},
        {"pre-broadcast acts", 0, tile_pre, 1},
        {"2 panels x 4 rows", 0, tile_2p4r, 1},
    };
    int nv = sizeof v / sizeof v[0];
    double tot[8] = {0};
    long reps = 5000;
    tile(k_full, OUT_REF);
    for (int round = 0; round < 20; round++)
        for (int i = 0; i < nv; i++) {
            double t0 = now();
            for (long r = 0; r < reps; r++) {
                v[i].run(v[i].k, OUT);
                __asm__ volatile("" ::: "memory");
            }
            tot[i] += now() - t0;
        }
    double row_blocks = 16.0 * NP * NB * reps * 20;
    printf("the Q4_1 block loop, 4 rows x 1 panel, 8 x 18 blocks x 16 rows (in cache):\n");
    printf("  full loop: %.2f cycles per (block, row) at the calibration's clock\n", tot[0] / row_blocks / cyc);
    for (int i = 0; i < nv; i++) {
        int bad = 0;
        if (v[i].exact) {
            v[i].run(v[i].k, OUT);
            for (int j = 0; j < 16 * NP * 8; j++) bad += OUT[j] != OUT_REF[j];
        }
        printf("  %-20s %.3f of the full loop's time%s\n", v[i].name, tot[i] / tot[0],
               v[i].exact ? (bad ? "  (RESULTS DIFFER)" : "  (bit-identical)") : "");
    }
}

int main(void) {
    double cyc = cycle_s();
    printf("clock (dependent adds): %.2f GHz\n", 1e-9 / cyc);
    part1(cyc);
    part2(cyc);
    return 0;
}
