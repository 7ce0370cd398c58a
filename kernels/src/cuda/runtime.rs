//! One device: its context, its stream, the compiled kernels and a method per kernel.

use std::path::PathBuf;
use std::sync::Arc;

#[cfg(not(feature = "cuda-emulator"))]
use cudarc::driver as drv;
#[cfg(not(feature = "cuda-emulator"))]
use cudarc::nvrtc::Ptx;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
#[cfg_attr(feature = "cuda-emulator", allow(unused_imports))]
use drv::{CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};

#[cfg(feature = "cuda-emulator")]
use super::emulator as drv;

use crate::quant::{Weight, QK};

/// The kernels' source, compiled at run time.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Elements per activation quantization block (the kernels' `QK`).
pub const ACT_BLOCK: usize = QK;

/// Why a GPU could not be used, in words an operator can act on.
#[derive(Debug, Clone)]
pub struct GpuError(pub String);

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GpuError {}

impl From<drv::DriverError> for GpuError {
    fn from(e: drv::DriverError) -> Self {
        GpuError(format!("CUDA driver: {e}"))
    }
}

type R<T> = Result<T, GpuError>;

/// A device's memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: u64,
    pub total: u64,
}

/// A weight in device memory: quantized formats as flat blocks (`format` 1..=5, see
/// `kernels.cu`), F32 row-major (`format` 0, values in `scales`).
pub struct DeviceWeight {
    pub format: i32,
    pub rows: usize,
    pub cols: usize,
    scales: CudaSlice<f32>,
    codes: CudaSlice<u8>,
}

impl DeviceWeight {
    pub fn bytes(&self) -> usize {
        self.scales.len() * 4 + self.codes.len()
    }
}

/// Activation rows quantized for the next matmul (grown to the largest batch, then reused).
pub struct ActScratch {
    q: CudaSlice<i8>,
    d: CudaSlice<f32>,
    s: CudaSlice<f32>,
}

struct Kernels {
    embed_rows: CudaFunction,
    embed_rows_f32: CudaFunction,
    rms_norm: CudaFunction,
    quantize_act: CudaFunction,
    matmul_q: CudaFunction,
    matmul_q_tiled: CudaFunction,
    matmul_f32: CudaFunction,
    qkv_rope_store: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
    add_assign: CudaFunction,
    argmax_rows: CudaFunction,
    top_k_rows: CudaFunction,
    copy_f32: CudaFunction,
    sum_ranks: CudaFunction,
}

/// One GPU, opened for a worker (module docs).
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Kernels,
    /// The virtual architecture the kernels were compiled for (`compute_90`).
    pub arch: String,
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    pub ordinal: usize,
}

/// `matmul_q_tiled`'s tile (`TILE_R` weight rows × `TILE_T` activation rows, as in kernels.cu),
/// and the batch from which it runs instead of `matmul_q`.
const TILE_R: usize = 64;
const TILE_T: usize = 16;
pub const TILED_FROM_ROWS: usize = TILE_T;

/// A null device pointer, for optional kernel arguments.
const NULL: u64 = 0;

fn grid(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

fn cfg(grid_dim: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim, block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Where compiled kernels are kept: `$ZEROLAYER_CUDA_CACHE`, else `$XDG_CACHE_HOME/zerolayer/cuda`,
/// else `~/.cache/zerolayer/cuda`.
fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("ZEROLAYER_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("zerolayer").join("cuda"))
}

/// FNV-1a of the kernels' source: part of the cache file's name, so an edited kernel recompiles.
fn source_hash() -> u64 {
    SOURCE.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The cache file of the kernels' PTX for `arch` (`compute_90`).
pub fn cached_ptx_path(arch: &str) -> Option<PathBuf> {
    cache_dir().map(|d| d.join(format!("kernels-{:016x}-{arch}.ptx", source_hash())))
}

/// The kernels' PTX for `arch`, from the cache or compiled now (and cached).
#[cfg_attr(feature = "cuda-emulator", allow(dead_code))]
fn ptx_for(arch: &'static str) -> R<String> {
    let file = cached_ptx_path(arch);
    if let Some(f) = &file {
        if let Ok(text) = std::fs::read_to_string(f) {
            return Ok(text);
        }
    }
    let text = compile(arch)?;
    if let Some(f) = &file {
        // A cache that cannot be written only costs the next start a compile.
        if let Some(d) = f.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &text).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(text)
}

/// Compiles the kernels to PTX for `arch` with NVRTC (no device needed: CI compiles them too).
pub fn compile(arch: &'static str) -> R<String> {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError("NVRTC (libnvrtc.so) cannot be loaded: it compiles the CUDA kernels at run time".into()));
    }
    let opts = CompileOptions {
        arch: Some(arch),
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        use_fast_math: Some(false),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(SOURCE, opts).map_err(|e| GpuError(format!("compiling the CUDA kernels with NVRTC for {arch}: {e}")))?;
    Ok(ptx.to_src())
}

impl Gpu {
    /// Opens device `ordinal`: errors say what is missing (no driver, no such device, NVRTC).
    pub fn open(ordinal: usize) -> R<Gpu> {
        #[cfg(not(feature = "cuda-emulator"))]
        if !super::probe::driver_present() {
            return Err(GpuError("no CUDA driver on this machine (libcuda.so cannot be loaded)".into()));
        }
        let count = CudaContext::device_count()?;
        if ordinal as i32 >= count {
            return Err(GpuError(format!("no device cuda:{ordinal}: this machine has {count} CUDA device(s)")));
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.default_stream();
        let (major, minor) = ctx.compute_capability()?;
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        #[cfg(not(feature = "cuda-emulator"))]
        let module = ctx.load_module(Ptx::from_src(ptx_for(arch)?))?;
        #[cfg(feature = "cuda-emulator")]
        let module = ctx.load_module()?;
        let f = |n: &str| module.load_function(n).map_err(GpuError::from);
        let k = Kernels {
            embed_rows: f("embed_rows")?,
            embed_rows_f32: f("embed_rows_f32")?,
            rms_norm: f("rms_norm")?,
            quantize_act: f("quantize_act")?,
            matmul_q: f("matmul_q")?,
            matmul_q_tiled: f("matmul_q_tiled")?,
            matmul_f32: f("matmul_f32")?,
            qkv_rope_store: f("qkv_rope_store")?,
            attention: f("attention")?,
            silu_mul: f("silu_mul")?,
            add_assign: f("add_assign")?,
            argmax_rows: f("argmax_rows")?,
            top_k_rows: f("top_k_rows")?,
            copy_f32: f("copy_f32")?,
            sum_ranks: f("sum_ranks")?,
        };
        let name = ctx.name()?;
        Ok(Gpu { ctx, stream, k, arch: arch.to_string(), name, ordinal })
    }

    /// CUDA devices on this machine.
    pub fn count() -> R<usize> {
        #[cfg(not(feature = "cuda-emulator"))]
        if !super::probe::driver_present() {
            return Ok(0);
        }
        Ok(CudaContext::device_count()? as usize)
    }

    pub fn memory(&self) -> R<DeviceMemory> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok(DeviceMemory { free: free as u64, total: total as u64 })
    }

    pub fn upload<T: DeviceRepr>(&self, v: &[T]) -> R<CudaSlice<T>> {
        Ok(self.stream.clone_htod(v)?)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> R<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    /// `buf` with room for at least `n` elements (reallocated, contents lost, when smaller).
    pub fn ensure<T: DeviceRepr + ValidAsZeroBits>(&self, buf: &mut CudaSlice<T>, n: usize) -> R<()> {
        if buf.len() < n {
            *buf = self.zeros(n.next_power_of_two())?;
        }
        Ok(())
    }

    pub fn download<T: DeviceRepr>(&self, s: &CudaSlice<T>, n: usize) -> R<Vec<T>> {
        let mut v = self.stream.clone_dtoh(&s.slice(..n))?;
        v.truncate(n);
        Ok(v)
    }

    /// Copies `host` to `dst[at..at + host.len()]`.
    pub fn write_at<T: DeviceRepr>(&self, host: &[T], dst: &mut CudaSlice<T>, at: usize) -> R<()> {
        let mut view = dst.slice_mut(at..at + host.len());
        self.stream.memcpy_htod(host, &mut view)?;
        Ok(())
    }

    /// Copies `src[at..at + n]` to the host.
    pub fn read_at<T: DeviceRepr>(&self, src: &CudaSlice<T>, at: usize, n: usize) -> R<Vec<T>> {
        Ok(self.stream.clone_dtoh(&src.slice(at..at + n))?)
    }

    pub fn synchronize(&self) -> R<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Uploads `w`, quantized formats as flat blocks.
    pub fn weight(&self, w: &Weight) -> R<DeviceWeight> {
        match w.flat_blocks() {
            Some(f) => Ok(DeviceWeight { format: f.format_id(), rows: w.rows, cols: w.cols, scales: self.upload(&f.scales)?, codes: self.upload(&f.codes)? }),
            None => {
                debug_assert!(w.format.is_float());
                Ok(DeviceWeight { format: 0, rows: w.rows, cols: w.cols, scales: self.upload(&w.f32_values().expect("f32"))?, codes: self.zeros(1)? })
            }
        }
    }

    pub fn act_scratch(&self) -> R<ActScratch> {
        Ok(ActScratch { q: self.zeros(1)?, d: self.zeros(1)?, s: self.zeros(1)? })
    }

    /// `x[t] = embedding row tokens[t]`, for `n` tokens.
    pub fn embed(&self, w: &DeviceWeight, tokens: &CudaSlice<i32>, n: usize, x: &mut CudaSlice<f32>) -> R<()> {
        let (cols, n_i) = (w.cols as i32, n as i32);
        let c = cfg((grid(w.cols, 256), n as u32, 1), 256);
        let mut b;
        if w.format == 0 {
            b = self.stream.launch_builder(&self.k.embed_rows_f32);
            b.arg(&w.scales).arg(&cols).arg(tokens).arg(&n_i).arg(x);
        } else {
            b = self.stream.launch_builder(&self.k.embed_rows);
            b.arg(&w.scales).arg(&w.codes).arg(&w.format).arg(&cols).arg(tokens).arg(&n_i).arg(x);
        }
        // SAFETY: the arguments match `kernels.cu`'s signature; every buffer holds what the
        // kernel indexes (n rows of `cols`; token ids were checked against the vocabulary).
        unsafe { b.launch(c) }?;
        Ok(())
    }

    /// `out[r] = rms_norm(x[rows[r]])` for `n_rows` rows (`rows` None: row r itself).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(&self, x: &CudaSlice<f32>, rows: Option<&CudaSlice<i32>>, n_rows: usize, w: &CudaSlice<f32>, eps: f32, d: usize, out: &mut CudaSlice<f32>) -> R<()> {
        let d_i = d as i32;
        let mut b = self.stream.launch_builder(&self.k.rms_norm);
        b.arg(x);
        match rows {
            Some(r) => b.arg(r),
            None => b.arg(&NULL),
        };
        b.arg(w).arg(&eps).arg(&d_i).arg(out);
        // SAFETY: signature as in `kernels.cu`; x has the rows named, out n_rows × d.
        unsafe { b.launch(cfg((n_rows as u32, 1, 1), 256)) }?;
        Ok(())
    }

    /// `y = x · wᵀ` for `n_rows` rows (activations quantized first, as on the CPU).
    pub fn matmul(&self, w: &DeviceWeight, x: &CudaSlice<f32>, n_rows: usize, act: &mut ActScratch, y: &mut CudaSlice<f32>) -> R<()> {
        let (rows_i, cols_i, n_i) = (w.rows as i32, w.cols as i32, n_rows as i32);
        let c = cfg((grid(w.rows, 128), n_rows as u32, 1), 128);
        if w.format == 0 {
            let mut b = self.stream.launch_builder(&self.k.matmul_f32);
            b.arg(&w.scales).arg(&rows_i).arg(&cols_i).arg(x).arg(&n_i).arg(y);
            // SAFETY: signature as in `kernels.cu`; x is n_rows × cols, y n_rows × rows.
            unsafe { b.launch(c) }?;
            return Ok(());
        }
        let nb = w.cols / QK;
        self.ensure(&mut act.q, n_rows * w.cols)?;
        self.ensure(&mut act.d, n_rows * nb)?;
        self.ensure(&mut act.s, n_rows * nb)?;
        let mut q = self.stream.launch_builder(&self.k.quantize_act);
        q.arg(x).arg(&cols_i).arg(&n_i).arg(&mut act.q).arg(&mut act.d).arg(&mut act.s);
        // SAFETY: signature as in `kernels.cu`; the scratch holds n_rows × cols codes.
        unsafe { q.launch(cfg((grid(nb, 64), n_rows as u32, 1), 64)) }?;
        let nb_i = nb as i32;
        // From a full tile of activation rows on, the tiled kernel (bit-identical, so the
        // choice never changes a result; see kernels.cu).
        let (kernel, c) = if n_rows >= TILED_FROM_ROWS {
            (&self.k.matmul_q_tiled, cfg((grid(w.rows, TILE_R), grid(n_rows, TILE_T), 1), 256))
        } else {
            (&self.k.matmul_q, c)
        };
        let mut b = self.stream.launch_builder(kernel);
        b.arg(&w.scales).arg(&w.codes).arg(&w.format).arg(&rows_i).arg(&nb_i).arg(&act.q).arg(&act.d).arg(&act.s).arg(&n_i).arg(y);
        // SAFETY: as above; y is n_rows × rows. The tiled kernel takes 256 threads (its tile's
        // TILE_R × 4) and checks both bounds itself.
        unsafe { b.launch(c) }?;
        Ok(())
    }

    /// Bias, RoPE and the K/V store of every row of a step (see `kernels.cu`).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope_store(
        &self,
        qkv: &mut CudaSlice<f32>,
        n_rows: usize,
        width: usize,
        bias: Option<&CudaSlice<f32>>,
        heads: (usize, usize, usize),
        pos: &CudaSlice<i32>,
        rope: (&CudaSlice<f32>, &CudaSlice<f32>, bool),
        slots: (&CudaSlice<i32>, &CudaSlice<i32>, usize),
        cache: (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
    ) -> R<()> {
        let (nq, nkv, hd) = (heads.0 as i32, heads.1 as i32, heads.2 as i32);
        let (w_i, half, bs) = (width as i32, rope.2 as i32, slots.2 as i32);
        let mut b = self.stream.launch_builder(&self.k.qkv_rope_store);
        b.arg(qkv).arg(&w_i);
        match bias {
            Some(x) => b.arg(x),
            None => b.arg(&NULL),
        };
        b.arg(&nq).arg(&nkv).arg(&hd).arg(pos).arg(rope.0).arg(rope.1).arg(&half).arg(slots.0).arg(slots.1).arg(&bs).arg(cache.0).arg(cache.1);
        // SAFETY: signature as in `kernels.cu`; positions are below the RoPE table's length and
        // blocks below the cache's (checked by the caller).
        unsafe { b.launch(cfg((n_rows as u32, 1, 1), 128)) }?;
        Ok(())
    }

    /// Paged attention for every (row, query head) of a step (see `kernels.cu`).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        qkv: &CudaSlice<f32>,
        n_rows: usize,
        width: usize,
        cache: (&CudaSlice<f32>, &CudaSlice<f32>),
        tables: (&CudaSlice<i32>, &CudaSlice<i32>, &CudaSlice<i32>),
        heads: (usize, usize, usize),
        block_size: usize,
        scale: f32,
        scores: &mut CudaSlice<f32>,
        max_ctx: usize,
        out: &mut CudaSlice<f32>,
    ) -> R<()> {
        let (nh, nkv, hd) = (heads.0 as i32, heads.1 as i32, heads.2 as i32);
        let (w_i, bs, mc) = (width as i32, block_size as i32, max_ctx as i32);
        self.ensure(scores, n_rows * heads.0 * max_ctx)?;
        let mut b = self.stream.launch_builder(&self.k.attention);
        b.arg(qkv).arg(&w_i).arg(cache.0).arg(cache.1).arg(tables.0).arg(tables.1).arg(tables.2);
        b.arg(&nh).arg(&nkv).arg(&hd).arg(&bs).arg(&scale).arg(scores).arg(&mc).arg(out);
        // SAFETY: signature as in `kernels.cu`; every position is below max_ctx and covered by
        // its row's block table (checked by the caller). 128 threads: a power of two ≤ 256.
        unsafe { b.launch(cfg((n_rows as u32, heads.0 as u32, 1), 128)) }?;
        Ok(())
    }

    /// `out = silu(gate) · up` over rows of `[gate | up]`.
    pub fn silu_mul(&self, gu: &CudaSlice<f32>, f: usize, n_rows: usize, out: &mut CudaSlice<f32>) -> R<()> {
        let (f_i, n_i) = (f as i32, n_rows as i32);
        let mut b = self.stream.launch_builder(&self.k.silu_mul);
        b.arg(gu).arg(&f_i).arg(&n_i).arg(out);
        // SAFETY: signature as in `kernels.cu`; gu is n_rows × 2f, out n_rows × f.
        unsafe { b.launch(cfg((grid(f, 256), n_rows as u32, 1), 256)) }?;
        Ok(())
    }

    /// `x[..n] += y[..n]`.
    pub fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> R<()> {
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(&self.k.add_assign);
        b.arg(x).arg(y).arg(&n_i);
        // SAFETY: both hold at least n values.
        unsafe { b.launch(cfg((grid(n, 256), 1, 1), 256)) }?;
        Ok(())
    }

    /// The greedy token of each of `n_rows` logits rows.
    pub fn argmax(&self, logits: &CudaSlice<f32>, n_rows: usize, vocab: usize, out: &mut CudaSlice<i32>) -> R<()> {
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(&self.k.argmax_rows);
        b.arg(logits).arg(&v).arg(out);
        // SAFETY: logits is n_rows × vocab, out n_rows; 256 threads as the kernel's arrays.
        unsafe { b.launch(cfg((n_rows as u32, 1, 1), 256)) }?;
        Ok(())
    }

    /// For `n` rows (`rows.0[r]`: which logits row), the `rows.1[r]` first of logit ×
    /// `rows.2[r]` in the sampler's order (see `kernels.cu`), at `out.*[r * kmax..]`.
    pub fn top_k(&self, logits: &CudaSlice<f32>, vocab: usize, rows: (&CudaSlice<i32>, &CudaSlice<i32>, &CudaSlice<f32>), n: usize, kmax: usize, out: (&mut CudaSlice<i32>, &mut CudaSlice<f32>)) -> R<()> {
        let (v, km) = (vocab as i32, kmax as i32);
        let mut b = self.stream.launch_builder(&self.k.top_k_rows);
        b.arg(logits).arg(&v).arg(rows.0).arg(rows.1).arg(rows.2).arg(&km).arg(out.0).arg(out.1);
        // SAFETY: signature as in `kernels.cu`; the row indices are below the logits' rows, each
        // k ≤ kmax and below the vocabulary, out holds n × kmax; 256 threads as its arrays.
        unsafe { b.launch(cfg((n as u32, 1, 1), 256)) }?;
        Ok(())
    }

    /// `dst[..n] = src[..n]` by a kernel (the bandwidth reference of `gpu-check`).
    pub fn copy(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<f32>, n: usize) -> R<()> {
        let mut b = self.stream.launch_builder(&self.k.copy_f32);
        b.arg(src).arg(dst).arg(&n);
        // SAFETY: both hold at least n values.
        unsafe { b.launch(cfg((4 * 132, 1, 1), 512)) }?;
        Ok(())
    }

    /// `out[..n]` = the rank-order sum of `ranks` partials gathered back to back in `gathered`.
    pub fn sum_ranks(&self, gathered: &CudaSlice<f32>, ranks: usize, n: usize, out: &mut CudaSlice<f32>) -> R<()> {
        let (r_i, n_i) = (ranks as i32, n as i32);
        let mut b = self.stream.launch_builder(&self.k.sum_ranks);
        b.arg(gathered).arg(&r_i).arg(&n_i).arg(out);
        // SAFETY: gathered holds ranks × n values, out n.
        unsafe { b.launch(cfg((grid(n, 256), 1, 1), 256)) }?;
        Ok(())
    }

    /// The device's stream (every kernel and copy of this `Gpu` runs on it, in order).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> R<()> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// Times `f` on the device's stream, in seconds (CUDA events).
    pub fn time(&self, f: impl FnOnce() -> R<()>) -> R<f64> {
        let a = self.ctx.new_event(Some(drv::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let b = self.ctx.new_event(Some(drv::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        a.record(&self.stream)?;
        f()?;
        b.record(&self.stream)?;
        b.synchronize()?;
        Ok(a.elapsed_ms(&b)? as f64 / 1e3)
    }
}
