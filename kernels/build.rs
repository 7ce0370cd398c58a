//! Builds the CUDA emulator (feature `cuda-emulator`): `kernels.cu` compiled as C++ for the CPU.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA_EMULATOR").is_none() {
        return;
    }
    for f in ["src/cuda/kernels.cu", "src/cuda/emulator/emulator.cpp", "src/cuda/emulator/prelude.h"] {
        println!("cargo:rerun-if-changed={f}");
    }
    #[cfg(feature = "cuda-emulator")]
    cc::Build::new()
        .cpp(true)
        .file("src/cuda/emulator/emulator.cpp")
        .std("c++17")
        // NVRTC's --fmad=false: only fma() fuses.
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        // Fibers switch stacks with _longjmp, which glibc's fortified longjmp would refuse.
        .flag("-U_FORTIFY_SOURCE")
        .opt_level(2)
        .warnings(false)
        .compile("zl_cuda_emulator");
}
