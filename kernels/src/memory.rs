//! Large fixed-length buffers on transparent huge pages: the weight panels and the KV cache.
//!
//! A 16-sequence decode step streams ~100 MB of weights and reads K/V scattered over hundreds of
//! megabytes. On 4 KiB pages that is a TLB miss (a page walk) every 64 cache lines of a weight
//! stream and at almost every K/V run, and the warming prefetches wait on the same walks. With
//! 2 MiB pages (`madvise(MADV_HUGEPAGE)`, which Linux honours under its default THP setting
//! `madvise`) the whole working set fits the second-level TLB. Values are untouched: only the
//! pages under them change.
//!
//! Buffers of at least [`HUGE_PAGE`] bytes are aligned to it and advised before their first
//! write (the zero fill), so the first touch of each 2 MiB faults in one huge page. Smaller
//! buffers are cache-line aligned heap memory. Where the kernel has no THP the advice fails
//! silently and the buffer is ordinary memory.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;
use std::ops::Range;

/// The huge page size (x86-64 and most aarch64 kernels).
pub const HUGE_PAGE: usize = 2 << 20;

/// Element types whose all-zero bit pattern is a valid value (so a buffer can start zeroed).
///
/// # Safety
/// Implement only for plain types (no padding, no invariants) whose zero bits are a value.
pub unsafe trait Plain: Copy + Send + Sync + 'static {}
// SAFETY: integers and IEEE floats are plain, and zero bits are 0 / +0.0.
unsafe impl Plain for u8 {}
unsafe impl Plain for f32 {}
unsafe impl Plain for half::f16 {}

/// A zero-initialised `[T]` of fixed length, on huge pages when large (module docs).
///
/// Invariant: `ptr` points to an allocation made with `layout(len)` holding `len` initialised
/// `T`s (dangling when that layout has size 0), owned by this value alone.
pub struct HugeBuf<T: Plain> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer owns its elements (`T: Send + Sync`), like a `Vec<T>`.
unsafe impl<T: Plain> Send for HugeBuf<T> {}
unsafe impl<T: Plain> Sync for HugeBuf<T> {}

impl<T: Plain> HugeBuf<T> {
    /// The allocation for `len` elements: huge-page aligned from [`HUGE_PAGE`] bytes up.
    fn layout(len: usize) -> Layout {
        let bytes = len.checked_mul(size_of::<T>()).expect("buffer size overflows");
        let align = if bytes >= HUGE_PAGE { HUGE_PAGE } else { 64.max(align_of::<T>()) };
        Layout::from_size_align(bytes, align).expect("buffer layout")
    }

    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        if layout.size() == 0 {
            return HugeBuf { ptr: NonNull::dangling(), len };
        }
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else { handle_alloc_error(layout) };
        if layout.align() == HUGE_PAGE {
            advise_huge(raw, layout.size());
        }
        // SAFETY: `raw` is a fresh allocation of `layout.size()` bytes, and zero bits are a
        // `T` (`Plain`); this first write is what faults the (huge) pages in.
        unsafe { std::ptr::write_bytes(raw, 0, layout.size()) };
        HugeBuf { ptr: ptr.cast(), len }
    }

    /// A copy of `values`.
    pub fn from_slice(values: &[T]) -> Self {
        let mut b = Self::zeroed(values.len());
        b.copy_from_slice(values);
        b
    }
}

/// Asks the kernel for transparent huge pages under `[ptr, ptr + len)`. Advice only: a kernel
/// without THP (or with it set to `never`) refuses, and the memory stays ordinary.
#[cfg(target_os = "linux")]
fn advise_huge(ptr: *mut u8, len: usize) {
    // SAFETY: the range is one live allocation, aligned to the huge page (hence to the base
    // page, as `madvise` requires); MADV_HUGEPAGE changes no contents.
    let _ = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_ptr: *mut u8, _len: usize) {}

impl<T: Plain> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        if layout.size() != 0 {
            // SAFETY: allocated in `zeroed` with this very layout (the invariant).
            unsafe { dealloc(self.ptr.as_ptr().cast(), layout) };
        }
    }
}

impl<T: Plain> Deref for HugeBuf<T> {
    type Target = [T];
    #[inline]
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised elements at `ptr` (the invariant).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Plain> DerefMut for HugeBuf<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Plain> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T: Plain + std::fmt::Debug> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

impl<T: Plain> From<Vec<T>> for HugeBuf<T> {
    fn from(v: Vec<T>) -> Self {
        Self::from_slice(&v)
    }
}

/// Bytes in a buffer of their own, or a slab of an arena shared with others ([`pack`]). Reads
/// see the bytes either way; a write to a shared slab first copies it out (copy on write), so
/// packing never changes what a holder sees.
#[derive(Clone, Debug)]
pub enum Slab {
    Own(HugeBuf<u8>),
    Shared { arena: Arc<HugeBuf<u8>>, range: Range<usize> },
}

impl Slab {
    pub fn zeroed(len: usize) -> Self {
        Slab::Own(HugeBuf::zeroed(len))
    }
}

impl From<Vec<u8>> for Slab {
    fn from(v: Vec<u8>) -> Self {
        Slab::Own(HugeBuf::from(v))
    }
}

impl Deref for Slab {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        match self {
            Slab::Own(b) => b,
            Slab::Shared { arena, range } => &arena[range.clone()],
        }
    }
}

impl DerefMut for Slab {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u8] {
        if let Slab::Shared { arena, range } = self {
            *self = Slab::Own(HugeBuf::from_slice(&arena[range.clone()]));
        }
        match self {
            Slab::Own(b) => b,
            Slab::Shared { .. } => unreachable!("copied out above"),
        }
    }
}

/// Moves `slabs` into one arena on huge pages, each starting on a cache line, in the order
/// given. Many buffers below [`HUGE_PAGE`] each (a small model's per-layer weights: a few
/// hundred KiB to a few MiB) would otherwise sit on ordinary pages wherever the heap put them;
/// packed, a step that streams them in order walks a handful of huge pages.
pub fn pack<'a>(slabs: impl IntoIterator<Item = &'a mut Slab>) {
    let mut slabs: Vec<&mut Slab> = slabs.into_iter().collect();
    let mut at = Vec::with_capacity(slabs.len());
    let mut total = 0usize;
    for s in &slabs {
        at.push(total);
        total = (total + s.len()).next_multiple_of(64);
    }
    let mut arena = HugeBuf::<u8>::zeroed(total);
    for (s, &o) in slabs.iter().zip(&at) {
        arena[o..o + s.len()].copy_from_slice(s);
    }
    let arena = Arc::new(arena);
    for (s, o) in slabs.iter_mut().zip(at) {
        let len = s.len();
        **s = Slab::Shared { arena: arena.clone(), range: o..o + len };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_huge_page_aligned_zeroed_and_writable() {
        let mut b = HugeBuf::<f32>::zeroed(3 * HUGE_PAGE / 4 + 5);
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
        assert!(b.iter().all(|&x| x.to_bits() == 0));
        let n = b.len();
        b[n - 1] = 7.5;
        b[0] = -1.0;
        let c = b.clone();
        assert_eq!((c[0], c[n - 1], c.len()), (-1.0, 7.5, n));
        assert_ne!(c.as_ptr(), b.as_ptr());
    }

    #[test]
    fn small_and_empty_buffers() {
        let b = HugeBuf::<u8>::from_slice(&[1, 2, 3]);
        assert_eq!(&b[..], &[1, 2, 3]);
        assert_eq!(b.as_ptr() as usize % 64, 0);
        let e = HugeBuf::<half::f16>::zeroed(0);
        assert!(e.is_empty());
        assert_eq!(HugeBuf::from(vec![half::f16::ONE]).to_vec(), vec![half::f16::ONE]);
    }

    #[test]
    fn packed_slabs_read_the_same_and_copy_out_on_write() {
        let mut a = Slab::from(vec![1u8, 2, 3]);
        let mut b = Slab::zeroed(100);
        b[99] = 9;
        let mut c = Slab::from(Vec::new());
        pack([&mut a, &mut b, &mut c]);
        assert_eq!((&a[..], b.len(), b[99], c.len()), (&[1u8, 2, 3][..], 100, 9, 0));
        let (Slab::Shared { arena: x, range: ra }, Slab::Shared { arena: y, range: rb }) = (&a, &b) else { panic!("packed") };
        assert!(Arc::ptr_eq(x, y));
        assert_eq!((ra.start, rb.start % 64), (0, 0));
        let before = b.clone();
        b[0] = 5;
        assert!(matches!(b, Slab::Own(_)));
        assert_eq!((b[0], b[99], before[0], a[2]), (5, 9, 0, 3));
    }

    /// On Linux with THP in `madvise` or `always` mode, a large buffer's touched memory is
    /// backed by huge pages (read from /proc/self/smaps). Where THP is off the kernel says so,
    /// and there is nothing to check.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_get_huge_pages_where_the_kernel_offers_them() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        let b = HugeBuf::<u8>::zeroed(8 * HUGE_PAGE);
        let start = b.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        // The mapping holding the buffer, and its AnonHugePages line.
        let mut inside = false;
        let mut huge_kb = None;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                        inside = lo <= start && start < hi;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(v) = line.strip_prefix("AnonHugePages:") {
                    huge_kb = v.trim().trim_end_matches(" kB").trim().parse::<usize>().ok();
                }
            }
        }
        let huge_kb = huge_kb.expect("the buffer's mapping in smaps");
        if mode.contains("[never]") || mode.is_empty() {
            eprintln!("THP is off here ({mode:?}): nothing to check");
            return;
        }
        // Memory pressure can deny some huge pages; most of 16 MiB must be huge.
        assert!(huge_kb >= 8 * 1024, "{huge_kb} kB of 16 MiB on huge pages (THP {mode:?})");
        drop(b);
    }
}
