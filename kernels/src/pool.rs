//! A fixed-size thread pool for data-parallel kernels, with no per-call spawn cost.
//!
//! Design: `n - 1` worker threads are created once. A parallel region publishes a job (a
//! borrowed `Fn(usize)` and a task count) behind a generation counter; workers spin briefly on
//! the counter, then park. Tasks are claimed with an atomic counter, so each index runs exactly
//! once, on whichever thread gets there first. The caller participates and returns only after
//! every task has finished, which is what makes lending a non-`'static` closure sound.
//!
//! A task that panics does not break the pool: the panic is caught where it happens, the task
//! counts as done, every other task still runs, and once none is running `run` resumes the
//! first panic on the caller's thread. So no thread is left running a closure whose region has
//! ended, and the pool's threads live on for the next region.
//!
//! Determinism: the pool decides *which thread* runs a task, never *what a task computes*.
//! Kernels split work so that each output element is produced by one task with a fixed
//! reduction order, which keeps results bit-identical whatever the thread count or timing.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type Job = *const (dyn Fn(usize) + Sync);

/// One value on its own cache line, so that counters written by different threads do not
/// bounce one line between cores.
#[repr(align(128))]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

struct Shared {
    generation: Line<AtomicU64>,
    /// The current region's closure and task count; `None` between regions.
    job: Mutex<Option<(SendPtr, usize)>>,
    /// The next task index to claim.
    next: Line<AtomicUsize>,
    /// Tasks finished (each thread adds its count once it finds no more to claim).
    done: Line<AtomicUsize>,
    active_workers: Line<AtomicUsize>,
    /// Workers parked on `park_cv` (a region only takes the lock to wake them if any are).
    parked: AtomicUsize,
    shutdown: AtomicBool,
    park_lock: Mutex<()>,
    park_cv: Condvar,
    /// The first panic of the current region's tasks, resumed by `run` once the region ends.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

#[derive(Clone, Copy)]
struct SendPtr(Job);
// SAFETY: the pointer is only dereferenced while the owning `run` call is blocked waiting for
// every task to finish, so the pointee outlives every use; the closure itself is `Sync`.
unsafe impl Send for SendPtr {}

/// A fixed pool of threads for kernel parallelism. Cheap to call many times per step.
pub struct ThreadPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    n_threads: usize,
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool that runs regions on `n_threads` threads in total (the caller counts as one).
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: Line(AtomicU64::new(0)),
            job: Mutex::new(None),
            next: Line(AtomicUsize::new(0)),
            done: Line(AtomicUsize::new(0)),
            active_workers: Line(AtomicUsize::new(0)),
            parked: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            park_lock: Mutex::new(()),
            park_cv: Condvar::new(),
            panic: Mutex::new(None),
        });
        let threads = (1..n_threads)
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("zl-kernel-{i}"))
                    .spawn(move || worker_loop(&shared))
                    .expect("spawn kernel thread")
            })
            .collect();
        ThreadPool { shared, threads, n_threads, run_lock: Mutex::new(()) }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(i)` for every `i in 0..n_tasks` across the pool and returns when all are done.
    pub fn run<F: Fn(usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks == 0 {
            return;
        }
        if self.n_threads == 1 || n_tasks == 1 {
            for i in 0..n_tasks {
                f(i);
            }
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let dyn_f: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: we erase the lifetime of `dyn_f`; it is only used by workers until
        // `done == n_tasks` and `active_workers == 0`, both awaited below before returning.
        let ptr: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(dyn_f) };
        // Counters are reset before the job is published, so a worker that sees the job
        // (under the mutex) also sees fresh counters.
        s.next.store(0, Ordering::SeqCst);
        s.done.store(0, Ordering::SeqCst);
        *s.job.lock().unwrap() = Some((SendPtr(ptr), n_tasks));
        s.generation.fetch_add(1, Ordering::SeqCst);
        // A worker registers in `parked` (SeqCst) before re-checking the generation under the
        // lock, so either it sees the new generation or we see it parked and wake it.
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _l = s.park_lock.lock().unwrap();
            s.park_cv.notify_all();
        }
        // Participate.
        claim_tasks(s, &f, n_tasks);
        while s.done.load(Ordering::Acquire) < n_tasks || s.active_workers.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        *s.job.lock().unwrap() = None;
        // A worker that registered after the wait above found `None` (or a later job); wait
        // for stragglers so none can touch this closure after we return.
        while s.active_workers.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        if let Some(p) = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(p);
        }
    }
}

/// Claims and runs tasks until none are left, then adds how many this thread ran to `done`.
#[inline]
fn claim_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync), n: usize) {
    let mut ran = 0;
    loop {
        let i = s.next.fetch_add(1, Ordering::AcqRel);
        if i >= n {
            break;
        }
        // A panicking task still counts as done (module docs); its panic waits for `run`.
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
            s.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
        }
        ran += 1;
    }
    if ran > 0 {
        s.done.fetch_add(ran, Ordering::AcqRel);
    }
}

fn worker_loop(s: &Shared) {
    let mut seen = 0u64;
    loop {
        // Spin a little for the next region (steps issue hundreds back to back), then park.
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins < 20_000 {
                std::hint::spin_loop();
            } else {
                let l = s.park_lock.lock().unwrap();
                s.parked.fetch_add(1, Ordering::SeqCst);
                if s.generation.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::Acquire) {
                    let _ = s.park_cv.wait_timeout(l, std::time::Duration::from_millis(50)).unwrap();
                }
                s.parked.fetch_sub(1, Ordering::SeqCst);
                spins = 0;
            }
        }
        s.active_workers.fetch_add(1, Ordering::AcqRel);
        let job = *s.job.lock().unwrap();
        if let Some((SendPtr(p), n)) = job {
            // SAFETY: `run` keeps the closure alive until `active_workers` drops back to 0.
            let f = unsafe { &*p };
            claim_tasks(s, f, n);
        }
        s.active_workers.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _l = self.shared.park_lock.lock().unwrap();
            self.shared.park_cv.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn every_task_runs_once() {
        let pool = ThreadPool::new(3);
        for n in [1usize, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    /// A task that panics, on a pool thread or on the caller's: every other task still runs,
    /// `run` returns only after all of them with the task's panic, and the pool serves the next
    /// region on all its threads.
    #[test]
    fn a_panicking_task_ends_its_region_whole_and_the_pool_lives_on() {
        let pool = ThreadPool::new(3);
        for bad in [0usize, 5, 63] {
            let hits: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.run(64, |i| {
                    if i == bad {
                        panic!("task {i} fails");
                    }
                    std::thread::sleep(std::time::Duration::from_micros(200));
                    hits[i].fetch_add(1, Ordering::Relaxed);
                })
            }));
            let p = r.expect_err("the task's panic reaches the caller");
            assert_eq!(p.downcast_ref::<String>().map(String::as_str), Some(format!("task {bad} fails").as_str()));
            assert!(hits.iter().enumerate().all(|(i, h)| h.load(Ordering::Relaxed) == usize::from(i != bad)), "every other task ran once");
            let threads: Mutex<std::collections::HashSet<std::thread::ThreadId>> = Mutex::new(Default::default());
            let n = AtomicUsize::new(0);
            pool.run(256, |_| {
                n.fetch_add(1, Ordering::Relaxed);
                threads.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(std::time::Duration::from_micros(100));
            });
            assert_eq!(n.load(Ordering::Relaxed), 256);
            assert!(threads.lock().unwrap().len() >= 2, "the pool's threads still take tasks");
        }
    }
}
