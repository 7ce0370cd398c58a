//! The tensor-parallel all-reduce of GPU ranks, through NCCL, in the fixed rank order of
//! [`crate::collective`]: NCCL all-gathers every rank's partial (an exact copy, no arithmetic)
//! and each rank sums the gathered partials itself in rank order (`sum_ranks`). An NCCL
//! all-reduce would be faster, but its ring or tree decides each element's summation order
//! from the buffer's length and the element's place in it, which would break batch invariance.
//!
//! A group is formed from one unique id that every rank is given: 128 bytes, made by one rank
//! ([`group_id`]) and handed to the others, by value within a process, or over the cluster's
//! mTLS QUIC link for a group that spans nodes.

#[cfg(not(feature = "cuda-emulator"))]
use cudarc::driver::CudaSlice;
#[cfg(not(feature = "cuda-emulator"))]
use cudarc::nccl::{result::NcclError, Comm, Id};

#[cfg(feature = "cuda-emulator")]
use super::emulator::nccl::{Comm, Id, NcclError};
#[cfg(feature = "cuda-emulator")]
use super::emulator::CudaSlice;

use super::runtime::{Gpu, GpuError};

type R<T> = Result<T, GpuError>;

fn nccl(e: NcclError) -> GpuError {
    GpuError(format!("NCCL: {e:?}"))
}

/// A new group's unique id, to give every rank.
pub fn group_id() -> R<[u8; 128]> {
    // SAFETY: only tries to dlopen libnccl.
    #[cfg(not(feature = "cuda-emulator"))]
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(GpuError("NCCL (libnccl.so) cannot be loaded: GPU tensor parallelism needs it".into()));
    }
    let id = Id::new().map_err(nccl)?;
    Ok(id.internal().map(|c| c as u8))
}

/// One GPU rank of a group.
pub struct NcclGroup {
    comm: Comm,
    gathered: CudaSlice<f32>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (NCCL's own
// rule); `NcclGroup` is not `Sync` and every use takes `&mut self`, so no two threads ever use
// it at once. Moving it between threads between calls is what `Send` allows, and is safe.
unsafe impl Send for NcclGroup {}

impl NcclGroup {
    /// Joins the group `id` names as `rank` of `size`, on `gpu`'s stream. Blocks until every
    /// rank has joined, so the ranks must join from different threads.
    pub fn join(gpu: &Gpu, rank: usize, size: usize, id: &[u8; 128]) -> R<NcclGroup> {
        gpu.bind()?;
        let comm = Comm::from_rank(gpu.stream().clone(), rank, size, Id::uninit(id.map(|b| b as core::ffi::c_char))).map_err(nccl)?;
        Ok(NcclGroup { comm, gathered: gpu.zeros(1)? })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.world_size()
    }

    /// Replaces `buf[..n]` on every rank with the rank-order sum of every rank's `buf[..n]`.
    pub fn all_reduce_sum(&mut self, gpu: &Gpu, buf: &mut CudaSlice<f32>, n: usize) -> R<()> {
        let size = self.size();
        gpu.ensure(&mut self.gathered, size * n)?;
        {
            let mut dst = self.gathered.slice_mut(..size * n);
            self.comm.all_gather(&buf.slice(..n), &mut dst).map_err(nccl)?;
        }
        gpu.sum_ranks(&self.gathered, size, n, buf)
    }
}
