//! The GPU path: cudarc with libraries loaded at run time (`fallback-dynamic-loading`), so this
//! compiles without a CUDA toolkit. Today it probes for a usable driver and NCCL; the GPU worker
//! backend builds on it.

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

#[cfg(test)]
mod tests {
    #[test]
    fn probing_never_panics_without_a_gpu() {
        let _ = super::driver_present();
        let _ = super::nccl_present();
    }
}
