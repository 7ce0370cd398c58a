// zerolayer's CUDA kernels, compiled at run time with NVRTC (kernels/src/cuda/mod.rs) for the
// device's own architecture, with --fmad=false so that a*b+c is two roundings unless written
// as fma(): every kernel below repeats the CPU kernel's operations in the CPU kernel's order.
//
// Batch invariance: each output element is computed by one thread (or one thread block) whose
// work depends only on its own row, the weights and the KV cache, never on how many rows there
// are or where its row sits; no split-K, no atomics, no algorithm chosen by shape.
//
// Weights are "flat blocks" (quant::FlatBlocks): per 32-element block of a row, two f32 scales
// (d, and m: Q4_1/Q4K's min, Q6K's upper-half scale) and the stored codes, 16 bytes of nibbles
// (GGUF order: element k < 16 in the low nibble of byte k, k >= 16 in the high nibble of byte
// k - 16) or 32 bytes. Formats: 1 Q4_0, 2 Q4_1, 3 Q8_0, 4 Q4K, 5 Q6K.

#define QK 32

__device__ __forceinline__ float f16_round(float x) {
#ifdef ZL_EMULATOR
    return zl_f16_round(x);
#else
    unsigned short h;
    float r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
#endif
}

__device__ __forceinline__ int four_bit(int fmt) { return fmt == 1 || fmt == 2 || fmt == 4; }
// Formats whose value is d·q + m: Q4_1, Q4K, Q5K.
__device__ __forceinline__ int has_min(int fmt) { return fmt == 2 || fmt == 4 || fmt == 6; }
__device__ __forceinline__ int code_offset(int fmt) { return fmt == 1 ? 8 : fmt == 3 ? 128 : fmt == 5 ? 32 : 0; }

__device__ __forceinline__ int code_at(const unsigned char* c, int fmt, int k) {
    if (four_bit(fmt)) return k < 16 ? (c[k] & 15) : (c[k - 16] >> 4);
    return c[k];
}

// ops::exp_fast, operation for operation (f64 Horner polynomial with fused multiply-adds).
__device__ float exp_fast(float xf) {
    xf = fminf(fmaxf(xf, -104.0f), 89.0f);
    double x = (double)xf;
    double n = floor(fma(x, 1.4426950408889634, 0.5));
    double r = fma(-n, 6.9314718036912381649e-1, x);
    r = fma(-n, 1.9082149292705877000e-10, r);
    const double c[12] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,
                          1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
    double y = c[0];
    for (int i = 1; i < 12; i++) y = fma(y, r, c[i]);
    return (float)(y * __longlong_as_double(((long long)n + 1023) << 52));
}

// Rows `tokens[t]` of an embedding in flat blocks, dequantized (Weight::dequantize_row).
extern "C" __global__ void embed_rows(const float* sc, const unsigned char* codes, int fmt, int cols, const int* tokens, int n_tokens, float* x) {
    int t = blockIdx.y;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tokens || i >= cols) return;
    int nb = cols / QK, j = i / QK, k = i % QK;
    size_t blk = (size_t)tokens[t] * nb + j;
    int cb = four_bit(fmt) ? 16 : 32;
    float d = sc[2 * blk], m = sc[2 * blk + 1];
    float q = (float)(code_at(codes + blk * cb, fmt, k) - code_offset(fmt));
    float v;
    if (has_min(fmt)) v = __fadd_rn(__fmul_rn(d, q), m);
    else if (fmt == 5 && k >= 16) v = __fmul_rn(m, q);
    else v = __fmul_rn(d, q);
    x[(size_t)t * cols + i] = v;
}

// Rows of an f32 embedding.
extern "C" __global__ void embed_rows_f32(const float* w, int cols, const int* tokens, int n_tokens, float* x) {
    int t = blockIdx.y;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tokens || i >= cols) return;
    x[(size_t)t * cols + i] = w[(size_t)tokens[t] * cols + i];
}

// ops::rms_norm_row for rows `rows[r]` of x (or every row when rows is null): a sequential
// sum of squares by one thread, then the scaling by all.
extern "C" __global__ void rms_norm(const float* x, const int* rows, const float* w, float eps, int d, float* out) {
    __shared__ float rms;
    int r = blockIdx.x;
    const float* xr = x + (size_t)(rows ? rows[r] : r) * d;
    if (threadIdx.x == 0) {
        float ss = 0.0f;
        for (int i = 0; i < d; i++) ss = __fadd_rn(ss, __fmul_rn(xr[i], xr[i]));
        rms = __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)d), eps));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[(size_t)r * d + i] = __fmul_rn(__fdiv_rn(xr[i], rms), w[i]);
}

// quant::quantize_row: one thread per 32-element block (Q8_1 scheme, scales at f16 precision).
extern "C" __global__ void quantize_act(const float* x, int cols, int n_rows, signed char* q, float* ad, float* as) {
    int t = blockIdx.y;
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int nb = cols / QK;
    if (t >= n_rows || j >= nb) return;
    const float* xb = x + (size_t)t * cols + j * QK;
    float amax = 0.0f;
    for (int k = 0; k < QK; k++) amax = fmaxf(amax, fabsf(xb[k]));
    float d = __fdiv_rn(amax, 127.0f);
    float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    int sum = 0;
    signed char* qb = q + ((size_t)t * nb + j) * QK;
    for (int k = 0; k < QK; k++) {
        int r = (int)roundf(__fmul_rn(xb[k], id));
        qb[k] = (signed char)r;
        sum += r;
    }
    float d16 = f16_round(d);
    ad[(size_t)t * nb + j] = d16;
    as[(size_t)t * nb + j] = f16_round(__fmul_rn(f16_round((float)sum), d16));
}

// One block's term of quant::dot_block_row: the exact integer sum of codes × activations, then
// sumi*d_w*d_a (+ m_w*s_a); Q6_K's two halves each with its own scale. `c` is the block's codes,
// `a` its 32 activation codes; every matmul kernel below adds these terms in block order.
__device__ __forceinline__ float block_term(const unsigned char* c, int fmt, int off, const signed char* a, float d, float m, float da, float sa) {
    if (fmt == 5) {
        int lo = 0, hi = 0;
        for (int k = 0; k < 16; k++) lo += (code_at(c, fmt, k) - off) * a[k];
        for (int k = 16; k < 32; k++) hi += (code_at(c, fmt, k) - off) * a[k];
        return __fmul_rn(__fadd_rn(__fmul_rn((float)lo, d), __fmul_rn((float)hi, m)), da);
    }
    int s = 0;
    for (int k = 0; k < QK; k++) s += (code_at(c, fmt, k) - off) * a[k];
    float term = __fmul_rn(__fmul_rn((float)s, d), da);
    if (has_min(fmt)) term = __fadd_rn(term, __fmul_rn(m, sa));
    return term;
}

// quant::dot_block_row for every (activation row t, weight row r), blocks added in order. One
// thread per output, reading the weights from global memory: the kernel for small batches
// (decode), where each weight is read about once per step anyway.
extern "C" __global__ void matmul_q(const float* sc, const unsigned char* codes, int fmt, int rows, int nb, const signed char* aq, const float* ad,
                                    const float* as, int n_rows, float* y) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (r >= rows || t >= n_rows) return;
    int cb = four_bit(fmt) ? 16 : 32, off = code_offset(fmt);
    float acc = 0.0f;
    for (int j = 0; j < nb; j++) {
        size_t blk = (size_t)r * nb + j;
        size_t ab = (size_t)t * nb + j;
        acc = __fadd_rn(acc, block_term(codes + blk * cb, fmt, off, aq + ab * QK, sc[2 * blk], sc[2 * blk + 1], ad[ab], as[ab]));
    }
    y[(size_t)t * rows + r] = acc;
}

// The same outputs, tiled for prefill: a thread block computes TILE_R weight rows × TILE_T
// activation rows, staging TILE_J blocks of each weight row and each activation row in shared
// memory at a time, so a weight block is read from global memory once per TILE_T activation
// rows instead of once per row. Each output is still one thread's, its terms added in block
// order by block_term: bit-identical to matmul_q, so which kernel runs (a choice by batch size)
// never changes a result. 256 threads; thread i computes rows (i % TILE_R) and activation rows
// i / TILE_R + 4k (k < TILE_T / 4).
#define TILE_R 64
#define TILE_T 16
#define TILE_J 4
extern "C" __global__ void matmul_q_tiled(const float* sc, const unsigned char* codes, int fmt, int rows, int nb, const signed char* aq, const float* ad,
                                          const float* as, int n_rows, float* y) {
    __shared__ unsigned char wc[TILE_R][TILE_J][32];
    __shared__ float wd[TILE_R][TILE_J][2];
    __shared__ signed char xa[TILE_T][TILE_J][QK];
    __shared__ float xd[TILE_T][TILE_J][2];
    int r0 = blockIdx.x * TILE_R, t0 = blockIdx.y * TILE_T;
    int cb = four_bit(fmt) ? 16 : 32, off = code_offset(fmt);
    int tid = threadIdx.x;
    int lr = tid % TILE_R, lt = tid / TILE_R;
    float acc[TILE_T / 4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = 0; j0 < nb; j0 += TILE_J) {
        int jn = nb - j0 < TILE_J ? nb - j0 : TILE_J;
        // Stage the weight blocks (codes byte by byte, scales) and the activation blocks.
        for (int u = tid; u < TILE_R * TILE_J * 32; u += blockDim.x) {
            int rr = u / (TILE_J * 32), jj = u / 32 % TILE_J, b = u % 32;
            int r = r0 + rr;
            wc[rr][jj][b] = (r < rows && jj < jn && b < cb) ? codes[((size_t)r * nb + j0 + jj) * cb + b] : 0;
        }
        for (int u = tid; u < TILE_R * TILE_J; u += blockDim.x) {
            int rr = u / TILE_J, jj = u % TILE_J, r = r0 + rr;
            size_t blk = (size_t)r * nb + j0 + jj;
            wd[rr][jj][0] = (r < rows && jj < jn) ? sc[2 * blk] : 0.0f;
            wd[rr][jj][1] = (r < rows && jj < jn) ? sc[2 * blk + 1] : 0.0f;
        }
        for (int u = tid; u < TILE_T * TILE_J * QK; u += blockDim.x) {
            int tt = u / (TILE_J * QK), jj = u / QK % TILE_J, k = u % QK, t = t0 + tt;
            xa[tt][jj][k] = (t < n_rows && jj < jn) ? aq[((size_t)t * nb + j0 + jj) * QK + k] : 0;
        }
        for (int u = tid; u < TILE_T * TILE_J; u += blockDim.x) {
            int tt = u / TILE_J, jj = u % TILE_J, t = t0 + tt;
            size_t ab = (size_t)t * nb + j0 + jj;
            xd[tt][jj][0] = (t < n_rows && jj < jn) ? ad[ab] : 0.0f;
            xd[tt][jj][1] = (t < n_rows && jj < jn) ? as[ab] : 0.0f;
        }
        __syncthreads();
        for (int jj = 0; jj < jn; jj++)
            for (int k = 0; k < TILE_T / 4; k++) {
                int tt = lt + 4 * k;
                acc[k] = __fadd_rn(acc[k], block_term(wc[lr][jj], fmt, off, xa[tt][jj], wd[lr][jj][0], wd[lr][jj][1], xd[tt][jj][0], xd[tt][jj][1]));
            }
        __syncthreads();
    }
    int r = r0 + lr;
    for (int k = 0; k < TILE_T / 4; k++) {
        int t = t0 + lt + 4 * k;
        if (r < rows && t < n_rows) y[(size_t)t * rows + r] = acc[k];
    }
}

// quant::dot_f32 for f32 weights: eight lanes over chunks of 8, reduced in a fixed tree.
extern "C" __global__ void matmul_f32(const float* w, int rows, int cols, const float* x, int n_rows, float* y) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (r >= rows || t >= n_rows) return;
    const float* a = x + (size_t)t * cols;
    const float* b = w + (size_t)r * cols;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int c8 = cols / 8 * 8;
    for (int i = 0; i < c8; i += 8)
        for (int l = 0; l < 8; l++) acc[l] = __fadd_rn(acc[l], __fmul_rn(a[i + l], b[i + l]));
    float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[4]), __fadd_rn(acc[1], acc[5])), __fadd_rn(__fadd_rn(acc[2], acc[6]), __fadd_rn(acc[3], acc[7])));
    for (int i = c8; i < cols; i++) s = __fadd_rn(s, __fmul_rn(a[i], b[i]));
    y[(size_t)t * rows + r] = s;
}

// Per row: + bias (Qwen2's Q/K/V), then RoPE on the query and key heads at the row's position,
// then K and V written to the paged cache at (block, slot) (model.rs's per-row loop).
extern "C" __global__ void qkv_rope_store(float* qkv, int width, const float* bias, int n_q_heads, int n_kv_heads, int hd, const int* pos, const float* cos_t,
                                          const float* sin_t, int half_split, const int* blk, const int* slot, int block_size, float* k_cache, float* v_cache) {
    int t = blockIdx.x;
    float* row = qkv + (size_t)t * width;
    if (bias)
        for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] = __fadd_rn(row[i], bias[i]);
    __syncthreads();
    int half = hd / 2;
    const float* c = cos_t + (size_t)pos[t] * half;
    const float* s = sin_t + (size_t)pos[t] * half;
    int n_rot = (n_q_heads + n_kv_heads) * half;
    for (int u = threadIdx.x; u < n_rot; u += blockDim.x) {
        int h = u / half, i = u % half;
        float* hp = row + h * hd;
        int ia = half_split ? i : 2 * i, ib = half_split ? i + half : 2 * i + 1;
        float a = hp[ia], b = hp[ib];
        hp[ia] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s[i]));
        hp[ib] = __fadd_rn(__fmul_rn(a, s[i]), __fmul_rn(b, c[i]));
    }
    __syncthreads();
    int kvd = n_kv_heads * hd;
    const float* k = row + n_q_heads * hd;
    const float* v = k + kvd;
    for (int u = threadIdx.x; u < kvd; u += blockDim.x) {
        int h = u / hd, i = u % hd;
        size_t off = (((size_t)blk[t] * n_kv_heads + h) * block_size + slot[t]) * hd + i;
        k_cache[off] = k[u];
        v_cache[off] = v[u];
    }
}

// attention::attend_one for query head blockIdx.y of row blockIdx.x, over positions 0..pos[t]
// of its sequence (its block table at tables[table_at[t]..]): scores with dot8_fma's order,
// the max, exp_fast, a sequential sum, and each output dimension accumulated in position
// order with fused multiply-adds. `scores` has room for max_ctx per (row, head).
extern "C" __global__ void attention(const float* qkv, int width, const float* k_cache, const float* v_cache, const int* tables, const int* table_at,
                                     const int* pos, int n_heads, int n_kv_heads, int hd, int block_size, float scale, float* scores, int max_ctx, float* out) {
    __shared__ float red[256];
    __shared__ float total;
    int t = blockIdx.x, h = blockIdx.y;
    int kvh = h / (n_heads / n_kv_heads);
    int n = pos[t] + 1;
    const int* table = tables + table_at[t];
    const float* q = qkv + (size_t)t * width + h * hd;
    float* sc = scores + ((size_t)t * n_heads + h) * max_ctx;
    float mx = __int_as_float(0xff800000);
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        const float* k = k_cache + (((size_t)table[p / block_size] * n_kv_heads + kvh) * block_size + p % block_size) * hd;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int c8 = hd / 8 * 8;
        for (int i = 0; i < c8; i += 8)
            for (int l = 0; l < 8; l++) acc[l] = fmaf(q[i + l], k[i + l], acc[l]);
        for (int i = c8; i < hd; i++) acc[i - c8] = fmaf(q[i], k[i], acc[i - c8]);
        float s = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[4]), __fadd_rn(acc[2], acc[6])), __fadd_rn(__fadd_rn(acc[1], acc[5]), __fadd_rn(acc[3], acc[7]))), scale);
        sc[p] = s;
        mx = fmaxf(mx, s);
    }
    red[threadIdx.x] = mx;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
        __syncthreads();
    }
    mx = red[0];
    for (int p = threadIdx.x; p < n; p += blockDim.x) sc[p] = exp_fast(__fsub_rn(sc[p], mx));
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int p = 0; p < n; p++) s = __fadd_rn(s, sc[p]);
        total = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0.0f;
        for (int p = 0; p < n; p++) {
            const float* v = v_cache + (((size_t)table[p / block_size] * n_kv_heads + kvh) * block_size + p % block_size) * hd;
            o = fmaf(__fdiv_rn(sc[p], total), v[i], o);
        }
        out[(size_t)t * n_heads * hd + h * hd + i] = o;
    }
}

// ops::silu_mul on rows of [gate | up] (2f wide) into rows f wide.
extern "C" __global__ void silu_mul(const float* gu, int f, int n_rows, float* out) {
    int t = blockIdx.y;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_rows || i >= f) return;
    float g = gu[(size_t)t * 2 * f + i], u = gu[(size_t)t * 2 * f + f + i];
    out[(size_t)t * f + i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, exp_fast(-g))), u);
}

// x += y, elementwise.
extern "C" __global__ void add_assign(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fadd_rn(x[i], y[i]);
}

// Greedy sampling on the device: the first index of each row's maximum (a fixed tree over
// the vocabulary, ties to the lower index).
extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    __shared__ float bv[256];
    __shared__ int bi[256];
    const float* l = logits + (size_t)blockIdx.x * vocab;
    float best = __int_as_float(0xff800000);
    int at = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (l[i] > best) {
            best = l[i];
            at = i;
        }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = at;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) {
            float ov = bv[threadIdx.x + w];
            int oi = bi[threadIdx.x + w];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = bi[0];
}

// sampler::by_desc's order on a logit × 1/temperature: f32::total_cmp's key (larger first), then
// the lower index. `before(a, b)`: a comes first.
__device__ __forceinline__ int total_key(float v) {
    int b = __float_as_int(v);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}
__device__ __forceinline__ bool before(int ka, int ia, int kb, int ib) { return ka > kb || (ka == kb && ia < ib); }

// Top-k selection for sampling: for row r, logits row rows[r], the ks[r] first values of
// logit × inv_ts[r] in that order (a total order, so exactly the set the host's selection
// takes), written to out_i / out_v[r * kmax ..], in order. One block per row, 256 threads; k
// rounds, each a block-wide search for the first value after the previous round's pick.
extern "C" __global__ void top_k_rows(const float* logits, int vocab, const int* rows, const int* ks, const float* inv_ts, int kmax, int* out_i, float* out_v) {
    __shared__ int bk[256];
    __shared__ int bi[256];
    __shared__ int prev_k, prev_i;
    int r = blockIdx.x, tid = threadIdx.x;
    const float* l = logits + (size_t)rows[r] * vocab;
    int k = ks[r];
    float inv_t = inv_ts[r];
    if (tid == 0) {
        prev_k = 0x7fffffff;  // before everything
        prev_i = -1;
    }
    __syncthreads();
    for (int round = 0; round < k; round++) {
        int pk = prev_k, pi = prev_i;
        int best_k = -0x7fffffff - 1, best_i = 0x7fffffff;  // after everything
        for (int i = tid; i < vocab; i += blockDim.x) {
            int key = total_key(__fmul_rn(l[i], inv_t));
            if (before(pk, pi, key, i) && before(key, i, best_k, best_i)) {
                best_k = key;
                best_i = i;
            }
        }
        bk[tid] = best_k;
        bi[tid] = best_i;
        __syncthreads();
        for (int w = blockDim.x / 2; w > 0; w /= 2) {
            if (tid < w && before(bk[tid + w], bi[tid + w], bk[tid], bi[tid])) {
                bk[tid] = bk[tid + w];
                bi[tid] = bi[tid + w];
            }
            __syncthreads();
        }
        if (tid == 0) {
            out_i[(size_t)r * kmax + round] = bi[0];
            out_v[(size_t)r * kmax + round] = __fmul_rn(l[bi[0]], inv_t);
            prev_k = bk[0];
            prev_i = bi[0];
        }
        __syncthreads();
    }
}

// Device memory bandwidth reference for gpu-check (d): dst = src.
extern "C" __global__ void copy_f32(const float* src, float* dst, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) dst[i] = src[i];
}

// The tensor-parallel reduction: out[i] = ((p0[i] + p1[i]) + p2[i]) + ..., the partials of every
// rank gathered one after another (collective.rs's rank order, whatever the buffer's length).
extern "C" __global__ void sum_ranks(const float* gathered, int ranks, int n, float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = gathered[i];
    for (int r = 1; r < ranks; r++) s = __fadd_rn(s, gathered[(size_t)r * n + i]);
    out[i] = s;
}
