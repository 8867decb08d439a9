//! Aligned buffers for `O_DIRECT` I/O, and a bounded pool of reusable ones.
//!
//! Every transfer on the direct path moves between a LUN opened with `O_DIRECT` and memory
//! whose start is aligned to the device's direct-I/O memory alignment (512 or 4096 bytes). An
//! [`AlignedBuf`] is one heap allocation aligned to [`BUF_ALIGN`] (4096, enough for every
//! device), zeroed when allocated, and freed on drop, or given back to its pool when it came
//! from one. Its bytes are always initialised, so it can be shortened and lengthened again
//! within its capacity without `unsafe` at the call site.
//!
//! A [`BufferPool`] hands out buffers of one capacity, at most `max_buffers` at a time. Policy:
//! buffers are allocated lazily, up to the cap; once the cap is reached [`BufferPool::take`]
//! waits (asynchronously) until a buffer is dropped, and [`BufferPool::try_take`] returns
//! `None`. A recycled buffer keeps the bytes of its previous user: the plan executors in
//! [`crate::engine`] overwrite every byte of the planned range (device data or zero fill), and
//! [`BufferPool::take_zeroed`] is there for anyone else.

use std::alloc::{self, Layout};
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Alignment of every buffer's start and capacity (bytes).
pub const BUF_ALIGN: usize = 4096;

/// One zeroed, [`BUF_ALIGN`]-aligned heap allocation.
struct RawAlloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl RawAlloc {
    /// Allocates `capacity` bytes rounded up to [`BUF_ALIGN`] (at least one unit, since a
    /// zero-sized allocation is not allowed), zeroed.
    fn zeroed(capacity: usize) -> RawAlloc {
        let size = capacity
            .max(1)
            .div_ceil(BUF_ALIGN)
            .saturating_mul(BUF_ALIGN);
        let layout = match Layout::from_size_align(size, BUF_ALIGN) {
            Ok(layout) => layout,
            Err(_) => panic!("buffer of {capacity} bytes is larger than the address space"),
        };
        // SAFETY: the layout has a non-zero size (at least BUF_ALIGN) and a power-of-two
        // alignment, as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        RawAlloc { ptr, layout }
    }

    /// Allocates room for `bytes` as [`RawAlloc::zeroed`] does, holding a copy of them
    /// (the rest zeroed): one pass over the bytes instead of a zero fill and a copy.
    fn copied(bytes: &[u8]) -> RawAlloc {
        let size = bytes
            .len()
            .max(1)
            .div_ceil(BUF_ALIGN)
            .saturating_mul(BUF_ALIGN);
        let layout = match Layout::from_size_align(size, BUF_ALIGN) {
            Ok(layout) => layout,
            Err(_) => panic!(
                "buffer of {} bytes is larger than the address space",
                bytes.len()
            ),
        };
        // SAFETY: the layout has a non-zero size (at least BUF_ALIGN) and a power-of-two
        // alignment, as `alloc` requires.
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        // SAFETY: the allocation holds `size >= bytes.len()` bytes and does not overlap
        // `bytes`; every byte of it is written here (the copy, then zeros up to `size`), so
        // all of it is initialised as the other constructors leave it.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.as_ptr(), bytes.len());
            std::ptr::write_bytes(ptr.as_ptr().add(bytes.len()), 0, size - bytes.len());
        }
        RawAlloc { ptr, layout }
    }

    fn capacity(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and is freed only
        // here, once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: a RawAlloc uniquely owns its heap block (no aliasing handles exist), so moving it to
// another thread or sharing `&RawAlloc` (which gives no access to the bytes) is sound.
unsafe impl Send for RawAlloc {}
// SAFETY: see above; `&RawAlloc` exposes only the pointer value and the layout.
unsafe impl Sync for RawAlloc {}

/// Where a pooled buffer goes back to on drop.
struct PoolHome {
    shared: Arc<PoolShared>,
    _permit: OwnedSemaphorePermit,
}

/// A zeroed byte buffer whose start is aligned to [`BUF_ALIGN`], for `O_DIRECT` I/O.
///
/// `len` bytes are visible through [`AlignedBuf::as_slice`]; the allocation holds
/// [`AlignedBuf::capacity`] bytes, all initialised.
pub struct AlignedBuf {
    raw: ManuallyDrop<RawAlloc>,
    len: usize,
    home: Option<PoolHome>,
}

impl AlignedBuf {
    /// A new zeroed buffer of `len` bytes (capacity rounded up to [`BUF_ALIGN`]).
    pub fn zeroed(len: usize) -> AlignedBuf {
        AlignedBuf {
            raw: ManuallyDrop::new(RawAlloc::zeroed(len)),
            len,
            home: None,
        }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> AlignedBuf {
        AlignedBuf {
            raw: ManuallyDrop::new(RawAlloc::copied(bytes)),
            len: bytes.len(),
            home: None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated (a multiple of [`BUF_ALIGN`]).
    pub fn capacity(&self) -> usize {
        self.raw.capacity()
    }

    /// Changes the visible length within the capacity. Bytes that become visible keep what
    /// they held (zeros for a fresh buffer). Returns `false` (and changes nothing) if `len`
    /// exceeds the capacity.
    pub fn set_len(&mut self, len: usize) -> bool {
        if len > self.capacity() {
            return false;
        }
        self.len = len;
        true
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation holds `capacity() >= len` initialised bytes (zeroed at
        // allocation, only ever overwritten with bytes), and `&self` guarantees no `&mut`
        // view exists for the returned lifetime.
        unsafe { std::slice::from_raw_parts(self.raw.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.raw.ptr.as_ptr(), self.len) }
    }

    /// The start of the allocation, for handing to the kernel. The pointer stays valid (and
    /// does not move) for as long as this buffer lives, wherever the buffer is moved to.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.raw.ptr.as_ptr()
    }

    /// Whether this buffer goes back to a pool when dropped.
    pub fn is_pooled(&self) -> bool {
        self.home.is_some()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `raw` is taken exactly once, here, and `self` is not used afterwards.
        let raw = unsafe { ManuallyDrop::take(&mut self.raw) };
        if let Some(home) = self.home.take() {
            home.shared.give_back(raw);
            // The permit drops after the block is back on the free list, so a waiter woken by
            // it finds the block.
            drop(home);
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pooled", &self.is_pooled())
            .finish()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// Buffers handed back for reuse by callers that allocate the same kind of buffer again and
/// again (the read-ahead): the next caller gets an allocation whose pages are already
/// faulted in, instead of a fresh zeroed one (a `calloc` of megabytes is a `memset` or page
/// faults, then the kernel pins fresh pages for the device I/O). Its contents are whatever
/// the last user left: initialised bytes, to be overwritten.
#[derive(Debug, Default)]
pub struct Recycler {
    free: Mutex<Vec<AlignedBuf>>,
}

/// Buffers a [`Recycler`] keeps at most.
const RECYCLED_MAX: usize = 8;

impl Recycler {
    /// A buffer of `len` bytes: a kept one at least that large, else a new zeroed one.
    pub fn take(&self, len: usize) -> AlignedBuf {
        let kept = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter()
                .position(|b| b.capacity() >= len)
                .map(|i| free.swap_remove(i))
        };
        if let Some(mut b) = kept
            && b.set_len(len)
        {
            return b;
        }
        AlignedBuf::zeroed(len)
    }

    /// Keeps `buf` for a later [`Recycler::take`] (a pooled buffer goes back to its pool).
    pub fn give(&self, buf: AlignedBuf) {
        if buf.is_pooled() {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < RECYCLED_MAX {
            free.push(buf);
        }
    }

    /// Buffers kept now.
    pub fn kept(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

struct PoolShared {
    buf_capacity: usize,
    free: Mutex<Vec<RawAlloc>>,
}

impl PoolShared {
    fn give_back(&self, raw: RawAlloc) {
        if raw.capacity() != self.buf_capacity {
            return; // not ours (cannot happen); freeing it is always safe
        }
        match self.free.lock() {
            Ok(mut free) => free.push(raw),
            Err(poisoned) => poisoned.into_inner().push(raw),
        }
    }

    fn pop(&self) -> Option<RawAlloc> {
        match self.free.lock() {
            Ok(mut free) => free.pop(),
            Err(poisoned) => poisoned.into_inner().pop(),
        }
    }
}

/// A bounded pool of [`AlignedBuf`]s of one capacity. Cheap to clone (shared state).
#[derive(Clone)]
pub struct BufferPool {
    shared: Arc<PoolShared>,
    permits: Arc<Semaphore>,
    max_buffers: usize,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("buf_capacity", &self.shared.buf_capacity)
            .field("max_buffers", &self.max_buffers)
            .field("available", &self.permits.available_permits())
            .finish()
    }
}

impl BufferPool {
    /// A pool of at most `max_buffers` (at least 1) buffers of `buf_len` bytes each (capacity
    /// rounded up to [`BUF_ALIGN`]). Nothing is allocated until buffers are taken.
    pub fn new(buf_len: usize, max_buffers: usize) -> BufferPool {
        let max_buffers = max_buffers.clamp(1, Semaphore::MAX_PERMITS);
        let buf_capacity = buf_len.max(1).div_ceil(BUF_ALIGN).saturating_mul(BUF_ALIGN);
        BufferPool {
            shared: Arc::new(PoolShared {
                buf_capacity,
                free: Mutex::new(Vec::new()),
            }),
            permits: Arc::new(Semaphore::new(max_buffers)),
            max_buffers,
        }
    }

    /// Capacity of each buffer.
    pub fn buf_capacity(&self) -> usize {
        self.shared.buf_capacity
    }

    pub fn max_buffers(&self) -> usize {
        self.max_buffers
    }

    /// Buffers that can be taken now without waiting.
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }

    /// Buffers allocated and currently idle in the pool.
    pub fn idle(&self) -> usize {
        match self.shared.free.lock() {
            Ok(free) => free.len(),
            Err(poisoned) => poisoned.into_inner().len(),
        }
    }

    fn wrap(&self, permit: OwnedSemaphorePermit) -> AlignedBuf {
        let raw = self
            .shared
            .pop()
            .unwrap_or_else(|| RawAlloc::zeroed(self.shared.buf_capacity));
        AlignedBuf {
            len: raw.capacity(),
            raw: ManuallyDrop::new(raw),
            home: Some(PoolHome {
                shared: Arc::clone(&self.shared),
                _permit: permit,
            }),
        }
    }

    /// A buffer (length = capacity; contents left by its last user), waiting while
    /// `max_buffers` are out.
    pub async fn take(&self) -> AlignedBuf {
        match Arc::clone(&self.permits).acquire_owned().await {
            Ok(permit) => self.wrap(permit),
            // The semaphore is never closed; should it be, fall back to an unpooled buffer.
            Err(_) => AlignedBuf::zeroed(self.shared.buf_capacity),
        }
    }

    /// As [`BufferPool::take`], with every byte zeroed.
    pub async fn take_zeroed(&self) -> AlignedBuf {
        let mut buf = self.take().await;
        buf.as_mut_slice().fill(0);
        buf
    }

    /// A buffer if one can be had without waiting.
    pub fn try_take(&self) -> Option<AlignedBuf> {
        Arc::clone(&self.permits)
            .try_acquire_owned()
            .ok()
            .map(|permit| self.wrap(permit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_holds_the_bytes_and_zeros_past_them() {
        for len in [0usize, 1, 4095, 4096, 4097, (1 << 20) + 3] {
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
            let mut b = AlignedBuf::from_slice(&bytes);
            assert_eq!(b.as_mut_ptr() as usize % BUF_ALIGN, 0);
            assert_eq!(b.as_slice(), &bytes[..]);
            let cap = b.capacity();
            // Grown to its capacity, the bytes past the copy read as zeros.
            assert!(b.set_len(cap));
            assert!(b.as_slice()[len..].iter().all(|&x| x == 0), "{len}");
        }
    }

    #[test]
    fn buffers_are_aligned_zeroed_and_resizable() {
        for len in [0usize, 1, 511, 4096, 4097, 1 << 20] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.as_mut_ptr() as usize % BUF_ALIGN, 0);
            assert_eq!(b.len(), len);
            assert!(b.capacity() >= len.max(1));
            assert_eq!(b.capacity() % BUF_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0));
        }
        let mut b = AlignedBuf::from_slice(b"hello");
        assert_eq!(&b[..], b"hello");
        assert!(b.set_len(4096));
        assert_eq!(&b[..6], b"hello\0");
        assert!(!b.set_len(4097));
        assert_eq!(b.len(), 4096);
    }

    #[test]
    fn buffers_move_between_threads() {
        let mut b = AlignedBuf::zeroed(8192);
        b[100] = 7;
        let b = std::thread::spawn(move || {
            let mut b = b;
            b[101] = 8;
            b
        })
        .join()
        .unwrap();
        assert_eq!((b[100], b[101]), (7, 8));
    }

    #[test]
    fn a_recycler_hands_back_the_same_allocation_and_keeps_a_few() {
        let r = Recycler::default();
        let mut b = r.take(8192);
        assert_eq!(b.len(), 8192);
        b.as_mut_slice()[0] = 7;
        let ptr = b.as_mut_ptr();
        r.give(b);
        assert_eq!(r.kept(), 1);
        // A smaller request reuses it (its bytes as left, the length as asked).
        let mut again = r.take(4096);
        assert_eq!(again.as_mut_ptr(), ptr);
        assert_eq!((again.len(), again.as_slice()[0]), (4096, 7));
        // A larger one cannot: a new zeroed buffer.
        r.give(again);
        let big = r.take(1 << 20);
        assert_eq!(big.len(), 1 << 20);
        assert!(big.as_slice().iter().all(|&x| x == 0));
        assert_eq!(r.kept(), 1);
        for _ in 0..2 * RECYCLED_MAX {
            r.give(AlignedBuf::zeroed(4096));
        }
        assert_eq!(r.kept(), RECYCLED_MAX);
    }

    #[tokio::test]
    async fn the_pool_is_bounded_and_recycles() {
        let pool = BufferPool::new(10_000, 2);
        assert_eq!(pool.buf_capacity(), 12_288);
        let mut a = pool.take().await;
        a[0] = 42;
        let a_ptr = a.as_mut_ptr();
        let b = pool.try_take().unwrap();
        assert!(pool.try_take().is_none());
        assert_eq!(pool.available(), 0);
        drop(a);
        assert_eq!(pool.idle(), 1);
        let mut c = pool.take().await;
        assert_eq!(c.as_mut_ptr(), a_ptr, "the idle block is reused");
        assert_eq!(c[0], 42, "take() keeps old contents");
        drop(c);
        let z = pool.take_zeroed().await;
        assert!(z.iter().all(|&x| x == 0));
        assert!(z.is_pooled() && b.is_pooled());
    }

    #[tokio::test]
    async fn take_waits_for_a_buffer_to_come_back() {
        let pool = BufferPool::new(4096, 1);
        let held = pool.take().await;
        let p2 = pool.clone();
        let waiter = tokio::spawn(async move { p2.take().await.len() });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(held);
        assert_eq!(waiter.await.unwrap(), 4096);
    }
}
