//! The GPU path: cudarc with libraries loaded at run time (`fallback-dynamic-loading`), so this
//! compiles without a CUDA toolkit, and CI builds it on machines with no GPU.
//!
//! - [`Gpu`]: one device's context and stream, and the kernels of `kernels.cu`, compiled at run
//!   time with NVRTC for the device's own architecture (`compute_90` on Hopper) and cached on
//!   disk per architecture and source (so a worker compiles once per machine).
//! - [`DeviceWeight`]: a weight uploaded once, kept in its quantized format (flat blocks).
//! - One method per kernel; each launch's grid depends on the batch, what a thread computes does
//!   not (the batch invariance of `kernels.cu`).
//! - [`NcclGroup`]: the tensor-parallel all-reduce of GPU ranks (an NCCL all-gather, then a
//!   rank-order sum on each device, so batch invariance holds across a group).
//! - [`driver_present`] / [`nccl_present`]: probes that load nothing else.
//! - `emulator` (feature `cuda-emulator`, for CI): the same runtime over a device emulated on
//!   the CPU, which runs `kernels.cu` compiled as C++ (see its docs).

#[cfg(feature = "cuda-emulator")]
pub mod emulator;
mod nccl;
mod probe;
mod runtime;

#[cfg(not(feature = "cuda-emulator"))]
pub use cudarc::driver::CudaSlice;
#[cfg(feature = "cuda-emulator")]
pub use emulator::CudaSlice;
pub use nccl::{group_id, NcclGroup};
pub use probe::{driver_present, nccl_present};
pub use runtime::{cached_ptx_path, compile, ActScratch, DeviceMemory, DeviceWeight, Gpu, GpuError, ACT_BLOCK, SOURCE, TILED_FROM_ROWS};

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

    /// A machine without a GPU refuses to open one, saying what is missing.
    #[test]
    fn opening_a_gpu_says_what_is_missing() {
        match super::Gpu::open(0) {
            Ok(g) => eprintln!("opened cuda:0: {} ({})", g.name, g.arch),
            Err(e) => {
                assert!(!super::driver_present(), "a driver is present, yet: {e}");
                assert!(e.to_string().contains("no CUDA driver on this machine"), "{e}");
            }
        }
    }

    /// The kernels compile with NVRTC (which needs no GPU) for Hopper and for an older
    /// architecture, and every kernel the runtime loads is in the PTX. `scripts/test` provides
    /// NVRTC (`scripts/fetch-nvrtc`) and sets `ZEROLAYER_REQUIRE_NVRTC`, so there this cannot skip.
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to dlopen libnvrtc.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !present {
            assert!(std::env::var_os("ZEROLAYER_REQUIRE_NVRTC").is_none(), "NVRTC is required here: run scripts/fetch-nvrtc and put its lib directory on LD_LIBRARY_PATH");
            eprintln!("NVRTC not loadable: kernel compilation not checked");
            return;
        }
        for arch in ["compute_90", "compute_80"] {
            let ptx = super::compile(arch).unwrap_or_else(|e| panic!("{e}"));
            for k in ["embed_rows", "embed_rows_f32", "rms_norm", "quantize_act", "matmul_q", "matmul_q_tiled", "matmul_f32", "qkv_rope_store", "attention", "silu_mul", "add_assign", "argmax_rows", "top_k_rows", "copy_f32", "sum_ranks"] {
                assert!(ptx.contains(&format!(".entry {k}(")), "{arch}: kernel {k} missing from the PTX");
            }
            assert!(ptx.contains(&format!(".target sm_{}", &arch[8..])), "{arch}: PTX target");
        }
    }
}
