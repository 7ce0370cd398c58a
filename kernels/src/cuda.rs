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
    /// Whether the dynamic loader's cache lists `lib` (what `dlopen` of a bare name finds).
    fn loader_knows(lib: &str) -> bool {
        let out = std::process::Command::new("ldconfig").arg("-p").output().or_else(|_| std::process::Command::new("/sbin/ldconfig").arg("-p").output());
        let listed = out.map(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim_start().starts_with(lib))).unwrap_or(false);
        let on_path = std::env::var("LD_LIBRARY_PATH")
            .unwrap_or_default()
            .split(':')
            .filter(|d| !d.is_empty())
            .any(|d| std::fs::read_dir(d).map(|es| es.flatten().any(|e| e.file_name().to_string_lossy().starts_with(lib))).unwrap_or(false));
        listed || on_path
    }

    /// The probes agree with the system's loader, and answer the same twice: on a machine
    /// without a driver they say so (and do not panic); on a GPU machine they find it.
    #[test]
    fn probes_agree_with_the_loader() {
        let driver = super::driver_present();
        assert_eq!(driver, super::driver_present());
        assert_eq!(driver, loader_knows("libcuda.so"), "the CUDA driver probe disagrees with the loader's cache");
        let nccl = super::nccl_present();
        assert_eq!(nccl, super::nccl_present());
        if nccl {
            assert!(loader_knows("libnccl.so"), "NCCL was found, so the loader must know it");
        }
        eprintln!("CUDA driver present: {driver}; NCCL present: {nccl}");
    }
}
