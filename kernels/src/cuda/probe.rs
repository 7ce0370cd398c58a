//! Probes for the CUDA libraries that load nothing else.

/// Whether a CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NCCL can be loaded on this machine.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen libnccl; no NCCL call is made.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}
