// The CUDA emulator's launcher: kernels.cu compiled for the CPU (prelude.h), and
// zl_emu_launch, which runs one kernel over a grid the way cuLaunchKernel does: the arguments
// come as an array of pointers to each value, checked here against the kernel's own parameter
// count and sizes (so a launch whose arguments do not match the signature fails, as it would
// corrupt memory on a GPU).
#include "prelude.h"

#include <setjmp.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#include "../kernels.cu"

dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace {

constexpr size_t STACK = 64 << 10;

// A fiber is entered the first time through its ucontext (which sets up its stack), and from
// then on by _setjmp/_longjmp, which switch without the signal-mask system call swapcontext
// makes each time (the masks never change here).
struct Fiber {
    ucontext_t ctx;
    jmp_buf at;
    std::vector<char> stack;
    bool started;
    bool done;
};

ucontext_t scheduler_ctx;
jmp_buf scheduler;
std::vector<Fiber> fibers;
size_t current;
void (*thunk)(void*);
void* thunk_arg;

void fiber_main() {
    thunk(thunk_arg);
    fibers[current].done = true;
    _longjmp(scheduler, 1);
}

// Whether the running thread is a fiber (a kernel that synchronizes) or a plain call.
bool in_fiber;
const char* running;

dim3 thread_of(size_t i, dim3 block) {
    return dim3{(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / ((size_t)block.x * block.y))};
}

// Runs every block of the grid. A kernel that synchronizes (`fibers`) runs each block's threads
// as fibers, round-robin from the highest thread index down, each until its next barrier: a
// thread that reads what a lower thread writes before a barrier that is missing reads stale
// memory here, as it may on a GPU. Other kernels run each thread as a plain call (faster);
// a __syncthreads() in one stops the process, naming it (list it in SYNCHRONIZING below).
void run_grid(dim3 grid, dim3 block, bool use_fibers, void (*f)(void*), void* arg) {
    size_t n = (size_t)block.x * block.y * block.z;
    if (use_fibers && fibers.size() < n) fibers.resize(n);
    thunk = f;
    thunk_arg = arg;
    gridDim = grid;
    blockDim = block;
    in_fiber = use_fibers;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = dim3{bx, by, bz};
                if (!use_fibers) {
                    for (size_t i = n; i-- > 0;) {
                        threadIdx = thread_of(i, block);
                        f(arg);
                    }
                    continue;
                }
                for (size_t i = 0; i < n; i++) {
                    Fiber& fb = fibers[i];
                    if (fb.stack.empty()) fb.stack.resize(STACK);
                    getcontext(&fb.ctx);
                    fb.ctx.uc_stack.ss_sp = fb.stack.data();
                    fb.ctx.uc_stack.ss_size = fb.stack.size();
                    fb.ctx.uc_link = nullptr;
                    fb.started = false;
                    fb.done = false;
                    makecontext(&fb.ctx, fiber_main, 0);
                }
                size_t live = n;
                while (live > 0) {
                    live = 0;
                    for (size_t i = n; i-- > 0;) {
                        if (fibers[i].done) continue;
                        current = i;
                        threadIdx = thread_of(i, block);
                        if (_setjmp(scheduler) == 0) {
                            if (!fibers[i].started) {
                                fibers[i].started = true;
                                swapcontext(&scheduler_ctx, &fibers[i].ctx);
                            } else {
                                _longjmp(fibers[i].at, 1);
                            }
                        }
                        if (!fibers[i].done) live++;
                    }
                }
            }
}

template <typename... A>
struct Call {
    void (*kernel)(A...);
    void** params;
};

template <typename... A, size_t... I>
void invoke(Call<A...>* c, std::index_sequence<I...>) {
    c->kernel(*static_cast<A*>(c->params[I])...);
}

template <typename... A>
void trampoline(void* p) {
    invoke(static_cast<Call<A...>*>(p), std::index_sequence_for<A...>{});
}

// The kernels that call __syncthreads().
const char* const SYNCHRONIZING[] = {"rms_norm", "matmul_q_tiled", "qkv_rope_store", "attention", "argmax_rows", "top_k_rows"};

template <typename... A>
int launch(const char* name, void (*kernel)(A...), dim3 grid, dim3 block, void** params, const size_t* sizes, size_t n) {
    if (n != sizeof...(A)) return 2;
    const size_t want[] = {sizeof(A)..., 0};
    for (size_t i = 0; i < n; i++)
        if (sizes[i] != want[i]) return 3;
    bool sync = false;
    for (const char* k : SYNCHRONIZING) sync |= std::strcmp(k, name) == 0;
    Call<A...> c{kernel, params};
    running = name;
    run_grid(grid, block, sync, trampoline<A...>, &c);
    return 0;
}

}  // namespace

void __syncthreads() {
    if (!in_fiber) {
        fprintf(stderr, "CUDA emulator: kernel %s calls __syncthreads(): list it in SYNCHRONIZING (emulator.cpp)\n", running);
        abort();
    }
    // Back to the scheduler, which resumes this fiber once every other thread of the block
    // has reached a barrier (or returned).
    if (_setjmp(fibers[current].at) == 0) _longjmp(scheduler, 1);
}

// Every kernel of kernels.cu, once: both the launch table and load_function's check read it.
#define ZL_KERNELS(X) \
    X(embed_rows)     \
    X(embed_rows_f32) \
    X(rms_norm)       \
    X(quantize_act)   \
    X(matmul_q)       \
    X(matmul_q_tiled) \
    X(matmul_f32)     \
    X(qkv_rope_store) \
    X(attention)      \
    X(silu_mul)       \
    X(add_assign)     \
    X(argmax_rows)    \
    X(top_k_rows)     \
    X(copy_f32)       \
    X(sum_ranks)

#define LAUNCH_IF_NAMED(k) \
    if (std::strcmp(name, #k) == 0) return launch(#k, k, grid, block, params, sizes, n);
#define IS_NAMED(k) \
    if (std::strcmp(name, #k) == 0) return 1;

// 0: ran; 1: no such kernel; 2: wrong argument count; 3: an argument's size differs from the
// parameter's; 4: a block of more than 1,024 threads.
extern "C" int zl_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, void** params,
                             const size_t* sizes, size_t n) {
    dim3 grid{gx, gy, gz}, block{bx, by, bz};
    if ((size_t)bx * by * bz > 1024) return 4;
    // One launch at a time, whichever thread (a tensor-parallel group's ranks launch from
    // their own threads): the fibers and the built-in variables are the emulator's one set.
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> hold(one_at_a_time);
    ZL_KERNELS(LAUNCH_IF_NAMED)
    return 1;
}

// Whether `name` is a kernel of kernels.cu (the emulator's load_function).
extern "C" int zl_emu_has_kernel(const char* name) {
    ZL_KERNELS(IS_NAMED)
    return 0;
}
