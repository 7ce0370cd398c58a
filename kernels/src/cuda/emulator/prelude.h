// The CUDA built-ins kernels.cu uses, for running it on the CPU (the emulator, emulator.rs).
//
// A kernel that synchronizes runs each thread of a block as a fiber (ucontext) on the launching
// OS thread; a block's fibers run round-robin from the highest thread down, each until it
// reaches __syncthreads() or returns, so every thread of a block reaches a barrier before any
// passes it, as on a GPU. Other kernels run each thread as a plain call. Blocks run one after
// another, so `__shared__` (a static here) is one block's at a time. Arithmetic: this file is compiled
// with -ffp-contract=off, so a*b+c is two roundings and only fma()/fmaf() fuse, as with NVRTC's
// --fmad=false; the __f*_rn intrinsics are the plain IEEE operations they name.
#pragma once
#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define ZL_EMULATOR 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
};

extern dim3 threadIdx, blockIdx, blockDim, gridDim;

void __syncthreads();


inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
// cvt.rn.f16.f32 then back: round to the nearest f16 (ties to even), subnormals kept.
inline float zl_f16_round(float x) { return (float)(_Float16)x; }
