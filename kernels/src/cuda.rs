//! The GPU path: cudarc with libraries loaded at run time, so this compiles without a CUDA
//! toolkit. Today it only probes for a usable driver; the GPU worker backend builds on it.

/// Whether a CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    cudarc::driver::sys::is_culib_present()
}

/// Whether NCCL can be loaded on this machine.
pub fn nccl_present() -> bool {
    cudarc::nccl::sys::is_culib_present()
}
