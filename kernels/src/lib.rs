//! zerolayer's compute kernels. The only crate in the workspace with `unsafe`.
//!
//! - [`quant`]: weight formats (F32; Q4_0, Q4_1, Q8_0, and Q4_K/Q6_K repacked) in 8-row panels,
//!   and the matrix kernel (batch 1 and batches alike).
//! - [`attention`]: paged attention reading K/V through block tables.
//! - [`ops`]: RMSNorm, RoPE, SiLU·mul, and a correctly rounded vectorizable `exp`.
//! - [`pool`]: a spin-then-park thread pool with no per-call spawn cost.
//! - [`collective`]: the all-reduce of tensor-parallel shards, in a fixed rank order.
//! - [`memory`]: large buffers on transparent huge pages (weights, KV cache).
//!
//! Invariant: every kernel computes each output element with a fixed reduction order that does
//! not depend on batch size, batch position, thread count or chunking (batch invariance).

pub mod attention;
pub mod collective;
pub mod memory;
pub mod ops;
pub mod pool;
pub mod quant;

#[cfg(feature = "gpu")]
pub mod cuda;

/// A CPU-feature check, detected once (false off x86-64).
macro_rules! cpu_feature {
    ($(#[$doc:meta])* $name:ident => $probe:expr) => {
        $(#[$doc])*
        pub fn $name() -> bool {
            #[cfg(target_arch = "x86_64")]
            {
                static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                *DETECTED.get_or_init(|| $probe)
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        }
    };
}

cpu_feature! {
    /// Whether the AVX2+FMA+F16C code paths may run on this CPU.
    has_avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

cpu_feature! {
    /// AVX-512 VNNI with 256-bit forms (and AVX2), for the integer dot products. Setting
    /// `ZEROLAYER_NO_VNNI` turns it off (for A/B benchmarks; results are identical either way).
    has_vnni => has_avx2()
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vl")
        && std::env::var_os("ZEROLAYER_NO_VNNI").is_none()
}

cpu_feature! {
    /// Whether the 512-bit AVX-512 VNNI matmul kernel can run here: [`has_vnni`] with AVX-512F
    /// and BW (the kernel tests run it wherever it can, whichever kernel [`has_vnni512`] picks).
    can_vnni512 => has_vnni() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

cpu_feature! {
    /// Whether the matmul may run its 512-bit VNNI kernel: where it can, unless
    /// `ZEROLAYER_NO_VNNI512` is set (for A/B benchmarks; results are identical either way).
    /// [`vnni512_min_rows`] says from how many activation rows it runs.
    has_vnni512 => can_vnni512() && std::env::var_os("ZEROLAYER_NO_VNNI512").is_none()
}

/// The fewest activation rows (sequences in a decode step, tokens in a prefill chunk) for
/// which the matmul takes its 512-bit VNNI kernel over the 256-bit one, where
/// [`has_vnni512`]. On Intel Xeon (full 512-bit pipes) the 512-bit kernel does twice the
/// arithmetic per instruction and wins from 1 row. On AMD Zen 4 (family 19h, which splits
/// every 512-bit operation over its two 256-bit pipes) and Zen 5 (family 1Ah) it pays only
/// where a decoded block of two panels feeds several rows (in chunks of 16): batch-1 runs at
/// about 0.6× the 256-bit kernel on Zen 4 and 0.87–0.92× on Zen 5, 16 rows at 1.14–1.24× and
/// 1.29–1.35×. So on AMD from 8 rows (BENCHMARKS "The 512-bit matmul on Zen 4", "A Zen 5
/// host"). `ZEROLAYER_VNNI512_ROWS=N` sets it instead (for A/B benchmarks; results are
/// identical).
pub fn vnni512_min_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| match std::env::var("ZEROLAYER_VNNI512_ROWS").ok().and_then(|v| v.parse().ok()) {
        Some(n) => n,
        #[cfg(target_arch = "x86_64")]
        None if amd_zen4_or_zen5() => 8,
        None => 1,
    })
}

/// The CPU's vendor string and family, from CPUID (leaves 0 and 1).
#[cfg(target_arch = "x86_64")]
fn vendor_family() -> ([u8; 12], u32) {
    use std::arch::x86_64::__cpuid;
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaves 0 and 1 exist on every x86-64 CPU.
    let (v, f) = unsafe { (__cpuid(0), __cpuid(1)) };
    let mut vendor = [0u8; 12];
    for (i, r) in [v.ebx, v.edx, v.ecx].iter().enumerate() {
        vendor[4 * i..4 * i + 4].copy_from_slice(&r.to_le_bytes());
    }
    let base = (f.eax >> 8) & 0xF;
    (vendor, if base == 0xF { base + ((f.eax >> 20) & 0xFF) } else { base })
}

/// Whether this is an AMD CPU of family 19h (Zen 3 and Zen 4) or 1Ah (Zen 5).
#[cfg(target_arch = "x86_64")]
fn amd_zen4_or_zen5() -> bool {
    let (vendor, family) = vendor_family();
    &vendor == b"AuthenticAMD" && (family == 0x19 || family == 0x1A)
}

cpu_feature! {
    /// Whether prefetching the next layer's KV during a layer's projections (the engine's KV
    /// warming, a cache hint that changes no value) is expected to pay on this CPU: on AMD
    /// (measured +14–20% at 16 sequences on Zen 3 and Zen 4), not elsewhere (on an Intel Xeon
    /// the prefetches held the matmul back: −9%; BENCHMARKS "An Intel Xeon host").
    /// `ZEROLAYER_KV_WARM=1` or `ZEROLAYER_NO_KV_WARM=1` decide it instead (for A/B runs).
    kv_warming_pays => match (std::env::var_os("ZEROLAYER_KV_WARM"), std::env::var_os("ZEROLAYER_NO_KV_WARM")) {
        (_, Some(_)) => false,
        (Some(_), None) => true,
        (None, None) => &vendor_family().0 == b"AuthenticAMD",
    }
}

cpu_feature! {
    /// AVX-512F and VL with AVX2 (32 vector registers for 256-bit code), for the attention
    /// kernel that runs several query heads per pass. Setting `ZEROLAYER_NO_AVX512` turns it off
    /// (for A/B benchmarks; results are identical either way).
    has_avx512vl => has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && std::env::var_os("ZEROLAYER_NO_AVX512").is_none()
}

/// For the kernel tests: whether the AVX2 paths can run here, so they are compared with the
/// portable code. A CPU without AVX2 fails the tests (the SIMD paths would silently go
/// untested) unless `ZEROLAYER_ALLOW_PORTABLE_ONLY` is set; a missing VNNI path is reported.
#[cfg(test)]
pub(crate) fn test_simd_paths(what: &str) -> bool {
    let avx2 = has_avx2();
    if !avx2 {
        assert!(
            std::env::var_os("ZEROLAYER_ALLOW_PORTABLE_ONLY").is_some(),
            "{what}: this CPU lacks AVX2/FMA/F16C, so the SIMD path would go untested; set ZEROLAYER_ALLOW_PORTABLE_ONLY=1 to accept that"
        );
        eprintln!("{what}: the AVX2 path was NOT exercised (no AVX2 on this CPU)");
    }
    if !has_vnni() {
        eprintln!("{what}: the AVX-512 VNNI path was NOT exercised (not on this CPU, or ZEROLAYER_NO_VNNI is set)");
    } else if !can_vnni512() {
        eprintln!("{what}: the 512-bit VNNI matmul was NOT exercised (no AVX-512F/BW on this CPU)");
    }
    avx2
}

/// Views little-endian bytes as f32s. Panics if misaligned or of a length not a multiple of 4.
pub fn cast_f32(bytes: &[u8]) -> &[f32] {
    assert!(cfg!(target_endian = "little"), "zerolayer kernels assume a little-endian target");
    assert_eq!(bytes.len() % 4, 0);
    assert_eq!(bytes.as_ptr() as usize % std::mem::align_of::<f32>(), 0, "f32 data must be 4-byte aligned");
    // SAFETY: length and alignment checked above; every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4) }
}

/// A raw output pointer handed to pool tasks that write disjoint ranges of one buffer (f32
/// outputs, or a KV cache's elements).
pub(crate) struct SyncPtr<T = f32>(pub(crate) *mut T);
impl<T> Clone for SyncPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SyncPtr<T> {}
// SAFETY: only used to give pool tasks disjoint output ranges of a buffer that outlives the
// parallel region (see `quant::matmul`, `attention::paged_attention` and
// `attention::write_kv_rows`).
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
