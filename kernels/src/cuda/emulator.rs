//! A CUDA device emulated on the CPU (feature `cuda-emulator`), so that CI, which has no GPU,
//! runs the GPU backend's own code: `kernels.cu` compiled as C++ (`emulator/`), launched by the
//! same `Gpu` methods, over the same buffers, through the same argument marshalling as on a GPU.
//!
//! This module has the shape of the part of `cudarc::driver` (and `cudarc::nccl`) that the
//! runtime uses, so `runtime.rs` and `nccl.rs` compile against either without a line of their
//! logic changing. Device memory is host memory; a "device pointer" is its address.
//!
//! - A launch passes an array of pointers to each argument's value with its size, as
//!   `cuLaunchKernel` does; the C++ side checks the count and every size against the kernel's
//!   own signature, so a launch whose arguments do not match fails here instead of corrupting
//!   memory on the first GPU run.
//! - Each thread of a block runs as a fiber; `__syncthreads` is a real barrier (all of a
//!   block's threads reach it before any passes), and `__shared__` memory is per block.
//! - Arithmetic is compiled with contraction off (NVRTC's `--fmad=false`), so a kernel that
//!   repeats the CPU kernels' operations in order gives their bits here too.
//!
//! What it cannot show: speed, the device's memory limits, and faults a GPU alone has (a kernel
//! that reads out of bounds may read host memory here without failing). It is never a
//! fallback: a build with this feature has no real GPU support and says so in the device name.

use std::ffi::{c_char, c_int, c_void, CString};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

extern "C" {
    fn zl_emu_launch(name: *const c_char, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, params: *mut *mut c_void, sizes: *const usize, n: usize) -> c_int;
    fn zl_emu_has_kernel(name: *const c_char) -> c_int;
}

/// The emulated devices' name.
pub const NAME: &str = "zerolayer CUDA emulator (CPU)";

/// How many devices the emulator shows (`ZEROLAYER_EMULATOR_DEVICES`, default 2, so tensor
/// parallelism over two "GPUs" runs too).
fn device_count() -> usize {
    std::env::var("ZEROLAYER_EMULATOR_DEVICES").ok().and_then(|v| v.parse().ok()).unwrap_or(2)
}

/// Each emulated device's memory (`ZEROLAYER_EMULATOR_MEMORY_MB`, default 1,024).
fn memory_total() -> usize {
    std::env::var("ZEROLAYER_EMULATOR_MEMORY_MB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1024) << 20
}

/// Bytes allocated on the emulated devices (all of them together).
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug, Clone)]
pub struct DriverError(pub String);

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CUDA emulator: {}", self.0)
    }
}

impl std::error::Error for DriverError {}

type Result<T> = std::result::Result<T, DriverError>;

/// A value that may live in device memory (plain old data).
pub trait DeviceRepr: Copy + Send + Sync + 'static {}
/// A type whose all-zero bytes are a valid value.
pub trait ValidAsZeroBits {}

macro_rules! pod {
    ($($t:ty),*) => { $(impl DeviceRepr for $t {} impl ValidAsZeroBits for $t {})* };
}
pod!(f32, f64, i8, u8, i16, u16, i32, u32, i64, u64, usize, isize, half::f16, half::bf16);

pub mod sys {
    /// Event flags (the emulator's events ignore them).
    #[allow(non_camel_case_types)]
    #[derive(Clone, Copy, Debug)]
    pub enum CUevent_flags {
        CU_EVENT_DEFAULT,
    }
}

/// One emulated device.
#[derive(Debug)]
pub struct CudaContext {
    ordinal: usize,
}

impl CudaContext {
    pub fn device_count() -> Result<i32> {
        Ok(device_count() as i32)
    }

    pub fn new(ordinal: usize) -> Result<Arc<CudaContext>> {
        if ordinal >= device_count() {
            return Err(DriverError(format!("no device {ordinal}")));
        }
        Ok(Arc::new(CudaContext { ordinal }))
    }

    pub fn default_stream(self: &Arc<Self>) -> Arc<CudaStream> {
        Arc::new(CudaStream { _ctx: self.clone() })
    }

    /// Hopper's, so the runtime's architecture string is the H200's.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((9, 0))
    }

    /// The kernels are linked in; there is nothing to load.
    pub fn load_module(&self) -> Result<Arc<CudaModule>> {
        Ok(Arc::new(CudaModule))
    }

    pub fn name(&self) -> Result<String> {
        Ok(format!("{NAME} #{}", self.ordinal))
    }

    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        let total = memory_total();
        Ok((total.saturating_sub(ALLOCATED.load(Ordering::Relaxed)), total))
    }

    pub fn bind_to_thread(&self) -> Result<()> {
        Ok(())
    }

    pub fn new_event(&self, _flags: Option<sys::CUevent_flags>) -> Result<CudaEvent> {
        Ok(CudaEvent { at: std::sync::Mutex::new(None) })
    }
}

/// A timing event (host time: every launch runs to completion when it is made).
pub struct CudaEvent {
    at: std::sync::Mutex<Option<Instant>>,
}

impl CudaEvent {
    pub fn record(&self, _stream: &CudaStream) -> Result<()> {
        *self.at.lock().unwrap() = Some(Instant::now());
        Ok(())
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f32> {
        let (a, b) = (*self.at.lock().unwrap(), *end.at.lock().unwrap());
        match (a, b) {
            (Some(a), Some(b)) => Ok(b.duration_since(a).as_secs_f32() * 1e3),
            _ => Err(DriverError("an event was not recorded".into())),
        }
    }
}

pub struct CudaModule;

impl CudaModule {
    pub fn load_function(&self, name: &str) -> Result<CudaFunction> {
        let c = CString::new(name).map_err(|_| DriverError(format!("bad kernel name {name:?}")))?;
        // SAFETY: a NUL-terminated string the call only reads.
        if unsafe { zl_emu_has_kernel(c.as_ptr()) } == 0 {
            return Err(DriverError(format!("no kernel {name} in kernels.cu")));
        }
        Ok(CudaFunction { name: c })
    }
}

#[derive(Debug, Clone)]
pub struct CudaFunction {
    name: CString,
}

/// Device memory: `len` values of `T` at a host address the emulated kernels write through.
pub struct CudaSlice<T> {
    ptr: *mut T,
    len: usize,
    cap: usize,
}

// SAFETY: the slice owns its allocation; like device memory, it is only touched through the
// stream's calls (which take `&`/`&mut` of the slice as cudarc's do) and by kernels launched on
// it, which run to completion inside the launch.
unsafe impl<T: Send> Send for CudaSlice<T> {}
unsafe impl<T: Sync> Sync for CudaSlice<T> {}

impl<T> CudaSlice<T> {
    fn from_vec(v: Vec<T>) -> CudaSlice<T> {
        let mut v = ManuallyDrop::new(v);
        ALLOCATED.fetch_add(v.capacity() * std::mem::size_of::<T>(), Ordering::Relaxed);
        CudaSlice { ptr: v.as_mut_ptr(), len: v.len(), cap: v.capacity() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, r: impl RangeBounds<usize>) -> (usize, usize) {
        let a = match r.start_bound() {
            Bound::Included(&a) => a,
            Bound::Excluded(&a) => a + 1,
            Bound::Unbounded => 0,
        };
        let b = match r.end_bound() {
            Bound::Included(&b) => b + 1,
            Bound::Excluded(&b) => b,
            Bound::Unbounded => self.len,
        };
        assert!(a <= b && b <= self.len, "device slice {a}..{b} out of 0..{}", self.len);
        (a, b - a)
    }

    pub fn slice(&self, r: impl RangeBounds<usize>) -> CudaView<'_, T> {
        let (at, len) = self.range(r);
        // SAFETY: `at + len <= self.len`, inside the allocation.
        CudaView { ptr: unsafe { self.ptr.add(at) }, len, _life: PhantomData }
    }

    pub fn slice_mut(&mut self, r: impl RangeBounds<usize>) -> CudaViewMut<'_, T> {
        let (at, len) = self.range(r);
        // SAFETY: as in `slice`.
        CudaViewMut { ptr: unsafe { self.ptr.add(at) }, len, _life: PhantomData }
    }
}

impl<T> Drop for CudaSlice<T> {
    fn drop(&mut self) {
        ALLOCATED.fetch_sub(self.cap * std::mem::size_of::<T>(), Ordering::Relaxed);
        // SAFETY: ptr, len and cap came from a Vec<T> that was not dropped.
        drop(unsafe { Vec::from_raw_parts(self.ptr, self.len, self.cap) });
    }
}

pub struct CudaView<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: PhantomData<&'a T>,
}

pub struct CudaViewMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: PhantomData<&'a mut T>,
}

impl<T> CudaView<'_, T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> CudaViewMut<'_, T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The one stream of a device: every call runs to completion before it returns.
#[derive(Debug)]
pub struct CudaStream {
    _ctx: Arc<CudaContext>,
}

impl CudaStream {
    pub fn clone_htod<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>> {
        self.room(std::mem::size_of_val(src))?;
        Ok(CudaSlice::from_vec(src.to_vec()))
    }

    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.room(n * std::mem::size_of::<T>())?;
        // SAFETY: `T: ValidAsZeroBits`: all-zero bytes are a T.
        let zero: T = unsafe { std::mem::zeroed() };
        Ok(CudaSlice::from_vec(vec![zero; n]))
    }

    /// Out of memory as on a device of `memory_total()` bytes.
    fn room(&self, bytes: usize) -> Result<()> {
        if ALLOCATED.load(Ordering::Relaxed) + bytes > memory_total() * device_count() {
            return Err(DriverError(format!("out of memory allocating {bytes} bytes")));
        }
        Ok(())
    }

    pub fn clone_dtoh<T: DeviceRepr>(&self, src: &CudaView<'_, T>) -> Result<Vec<T>> {
        // SAFETY: the view lies inside a live allocation; no kernel runs meanwhile.
        Ok(unsafe { std::slice::from_raw_parts(src.ptr, src.len) }.to_vec())
    }

    pub fn memcpy_htod<T: DeviceRepr>(&self, src: &[T], dst: &mut CudaViewMut<'_, T>) -> Result<()> {
        if src.len() > dst.len {
            return Err(DriverError(format!("copy of {} values into {}", src.len(), dst.len)));
        }
        // SAFETY: dst has room for src.len() values (checked); the two do not overlap (host
        // memory against device memory).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr, src.len()) };
        Ok(())
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    pub fn launch_builder<'a>(&'a self, f: &'a CudaFunction) -> LaunchArgs<'a> {
        LaunchArgs { f, values: Vec::new(), sizes: Vec::new() }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct LaunchConfig {
    pub grid_dim: (u32, u32, u32),
    pub block_dim: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// A kernel launch being built: each argument's bytes (a device pointer, or a value) and size.
pub struct LaunchArgs<'a> {
    f: &'a CudaFunction,
    values: Vec<[u8; 8]>,
    sizes: Vec<usize>,
}

/// What may be passed to a kernel: a device buffer (as its address) or a plain value.
pub trait PushKernelArg {
    fn bytes(&self) -> ([u8; 8], usize);
}

impl<T> PushKernelArg for &CudaSlice<T> {
    fn bytes(&self) -> ([u8; 8], usize) {
        ((self.ptr as u64).to_ne_bytes(), 8)
    }
}

impl<T> PushKernelArg for &mut CudaSlice<T> {
    fn bytes(&self) -> ([u8; 8], usize) {
        ((self.ptr as u64).to_ne_bytes(), 8)
    }
}

macro_rules! value_arg {
    ($($t:ty),*) => {$(
        impl PushKernelArg for &$t {
            fn bytes(&self) -> ([u8; 8], usize) {
                let mut b = [0u8; 8];
                let v = self.to_ne_bytes();
                b[..v.len()].copy_from_slice(&v);
                (b, v.len())
            }
        }
    )*};
}
value_arg!(i32, u32, f32, i64, u64, f64, usize);

impl LaunchArgs<'_> {
    pub fn arg<A: PushKernelArg>(&mut self, a: A) -> &mut Self {
        let (b, n) = a.bytes();
        self.values.push(b);
        self.sizes.push(n);
        self
    }

    /// Runs the kernel over the grid, to completion.
    ///
    /// # Safety
    /// As with a GPU launch: the arguments must be what the kernel indexes (the emulator checks
    /// their number and sizes, not the buffers' lengths).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<()> {
        let mut params: Vec<*mut c_void> = self.values.iter_mut().map(|v| v.as_mut_ptr() as *mut c_void).collect();
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        // SAFETY: params points at `n` values that live until the call returns; sizes has `n`
        // entries; the name is NUL-terminated.
        let rc = unsafe { zl_emu_launch(self.f.name.as_ptr(), g.0, g.1, g.2, b.0, b.1, b.2, params.as_mut_ptr(), self.sizes.as_ptr(), params.len()) };
        let name = self.f.name.to_string_lossy();
        match rc {
            0 => Ok(()),
            1 => Err(DriverError(format!("no kernel {name}"))),
            2 => Err(DriverError(format!("{name}: {} arguments do not match the kernel's parameters", params.len()))),
            3 => Err(DriverError(format!("{name}: an argument's size ({:?}) differs from its parameter's", self.sizes))),
            4 => Err(DriverError(format!("{name}: more than 1,024 threads per block ({b:?})"))),
            _ => Err(DriverError(format!("{name}: launch failed ({rc})"))),
        }
    }
}

/// NCCL between emulated devices: ranks in one process, meeting through a registry by id.
pub mod nccl {
    use std::collections::HashMap;
    use std::ffi::c_char;
    use std::sync::{Arc, Barrier, Mutex, OnceLock};

    use crate::cuda::emulator::{CudaStream, CudaView, CudaViewMut};

    #[derive(Debug, Clone)]
    pub struct NcclError(pub String);

    /// A group's unique id.
    #[derive(Clone, Copy)]
    pub struct Id([c_char; 128]);

    impl Id {
        pub fn new() -> Result<Id, NcclError> {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut b = [0 as c_char; 128];
            for (i, x) in n.to_le_bytes().iter().chain(std::process::id().to_le_bytes().iter()).enumerate() {
                b[i] = *x as c_char;
            }
            Ok(Id(b))
        }

        pub fn uninit(b: [c_char; 128]) -> Id {
            Id(b)
        }

        pub fn internal(&self) -> [c_char; 128] {
            self.0
        }
    }

    struct Group {
        size: usize,
        barrier: Barrier,
        /// Each rank's send buffer for the collective in progress (address, length).
        sends: Mutex<Vec<(usize, usize)>>,
    }

    /// The groups being formed, by id (each leaves once its last rank has joined; at most a
    /// few at a time, as many as groups are forming).
    fn forming() -> &'static Mutex<HashMap<Vec<u8>, (Arc<Group>, usize)>> {
        static M: OnceLock<Mutex<HashMap<Vec<u8>, (Arc<Group>, usize)>>> = OnceLock::new();
        M.get_or_init(Default::default)
    }

    pub struct Comm {
        group: Arc<Group>,
        rank: usize,
    }

    impl Comm {
        /// Joins as `rank` of `size`; blocks until all have joined (as ncclCommInitRank does).
        pub fn from_rank(_stream: Arc<CudaStream>, rank: usize, size: usize, id: Id) -> Result<Comm, NcclError> {
            if rank >= size {
                return Err(NcclError(format!("rank {rank} of {size}")));
            }
            let key: Vec<u8> = id.0.iter().map(|&c| c as u8).collect();
            let group = {
                let mut m = forming().lock().unwrap();
                let (g, joined) = m.entry(key.clone()).or_insert_with(|| (Arc::new(Group { size, barrier: Barrier::new(size), sends: Mutex::new(vec![(0, 0); size]) }), 0));
                if g.size != size {
                    return Err(NcclError(format!("group of {} joined as one of {size}", g.size)));
                }
                *joined += 1;
                let g = g.clone();
                if m[&key].1 == size {
                    m.remove(&key);
                }
                g
            };
            group.barrier.wait();
            Ok(Comm { group, rank })
        }

        pub fn rank(&self) -> usize {
            self.rank
        }

        pub fn world_size(&self) -> usize {
            self.group.size
        }

        /// `recv` = every rank's `send`, in rank order (each `send.len()` long).
        pub fn all_gather(&self, send: &CudaView<'_, f32>, recv: &mut CudaViewMut<'_, f32>) -> Result<(), NcclError> {
            let (n, size) = (send.len, self.group.size);
            if recv.len < n * size {
                return Err(NcclError(format!("all_gather of {n} × {size} into {}", recv.len)));
            }
            self.group.sends.lock().unwrap()[self.rank] = (send.ptr as usize, n);
            self.group.barrier.wait();
            let sends = self.group.sends.lock().unwrap().clone();
            let mismatch = sends.iter().position(|&(_, len)| len != n);
            if mismatch.is_none() {
                for (r, &(p, _)) in sends.iter().enumerate() {
                    // SAFETY: every rank's send buffer stays alive and unchanged until the
                    // second barrier below; recv has room for size × n (checked) and is this
                    // rank's own.
                    unsafe { std::ptr::copy_nonoverlapping(p as *const f32, recv.ptr.add(r * n), n) };
                }
            }
            // Every rank passes both barriers, whatever it found, so none is left waiting.
            self.group.barrier.wait();
            match mismatch {
                Some(r) => Err(NcclError(format!("rank {r} sent {} values, rank {} {n}", sends[r].1, self.rank))),
                None => Ok(()),
            }
        }
    }
}
