//! A memory pool for many graphs of different shapes in the memory of the largest (CUDA
//! virtual memory management).
//!
//! Each graph captured for one shape (a token bucket, a capacity, a layer configuration) gets
//! its own [`PoolRange`]: a virtual address range of its own (`cuMemAddressReserve`), so no two
//! graphs ever see the same address. Every range maps the same physical allocations
//! (`cuMemCreate` / `cuMemMap` / `cuMemSetAccess`, in multiples of the allocation granularity),
//! so the physical bytes are the largest range's use rounded up to the granularity — max over
//! the shapes, not their sum.
//!
//! The rule that makes this correct: **graphs sharing physical memory never run at the same
//! time, and nothing written into a range survives another range's use.** The pool enforces
//! the first half where it can:
//! - a pool is bound to one stream; every buffer handed out ([`PoolSlice`]) reports that stream,
//!   and using one on another stream panics (cudarc's `device_ptr` cannot return an error);
//! - a graph captured on that stream (by [`capture`](super::capture)) replays on it, so the
//!   pool's graphs run one after another;
//! - plans taking buffers from a range ([`crate::moe::MoeExperts::with_pool`]) must be bound
//!   to the pool's stream ([`Error::WrongStream`]).
//!
//! The second half is the caller's: put into a range only scratch that one replay writes before
//! it reads it (activations between forward and backward of one graph, say). State that lives
//! across replays (sticky flag words, route maps read back afterwards, inputs, outputs,
//! weights) stays in ordinary allocations. Forward and backward in two separate graphs of one
//! range must run back to back, with no other graph of the pool between them.
//!
//! A range's virtual size is fixed when the pool is made (`range_bytes`); physical memory grows
//! as ranges hand out bytes (new handles are mapped into every range at the same offset, so
//! addresses already captured stay valid). Everything is unmapped and released when the pool,
//! its ranges and every slice are dropped, after synchronising the pool's stream.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    self, CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationGranularity_flags, CUmemAllocationProp,
    CUmemAllocationType, CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType,
};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop};

use super::ensure_not_capturing;
use crate::{Error, Result};

/// Alignment of every buffer a range hands out: what `cudaMalloc` guarantees, so TMA (16 B) and
/// the C ABI's checks (up to 256 B for workspaces) hold.
pub const POOL_ALIGNMENT: usize = 256;

/// `value` rounded up to a multiple of `multiple` (> 0); `None` on overflow.
pub fn round_up(value: usize, multiple: usize) -> Option<usize> {
    assert!(multiple > 0, "round_up: multiple must be positive");
    value.checked_add(multiple - 1).map(|v| v / multiple * multiple)
}

/// A bump cursor over one range's `reserve` bytes: where the next buffer starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BumpCursor {
    pub used: usize,
    pub reserve: usize,
}

impl BumpCursor {
    pub fn new(reserve: usize) -> BumpCursor {
        BumpCursor { used: 0, reserve }
    }

    /// The offset of a new buffer of `bytes` (at least 1) aligned to `align`, advancing the
    /// cursor; [`Error::PoolExhausted`] past the reserve (the cursor is left unchanged).
    pub fn take(&mut self, op: &'static str, bytes: usize, align: usize) -> Result<usize> {
        let exhausted = || Error::PoolExhausted { op, need: bytes, used: self.used, reserve: self.reserve };
        let start = round_up(self.used, align).ok_or_else(exhausted)?;
        let end = start.checked_add(bytes.max(1)).ok_or_else(exhausted)?;
        if end > self.reserve {
            return Err(exhausted());
        }
        self.used = end;
        Ok(start)
    }
}

/// The physical chunks behind every range: chunk `i` covers `[offset_i, offset_i + size_i)`
/// of each range, the chunks tile `[0, bytes)` with no gap, each a multiple of the granularity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhysicalLayout {
    pub granularity: usize,
    /// `(offset, size)` per chunk, in order.
    pub chunks: Vec<(usize, usize)>,
}

impl PhysicalLayout {
    pub fn new(granularity: usize) -> PhysicalLayout {
        PhysicalLayout { granularity, chunks: Vec::new() }
    }

    /// Physical bytes mapped so far.
    pub fn bytes(&self) -> usize {
        self.chunks.last().map_or(0, |&(offset, size)| offset + size)
    }

    /// The chunk to add so that `need` bytes of every range are backed: `None` when they already
    /// are, else `(offset, size)` with size the shortfall rounded up to the granularity.
    pub fn growth_for(&self, need: usize) -> Option<(usize, usize)> {
        let have = self.bytes();
        (need > have).then(|| (have, round_up(need - have, self.granularity).expect("pool size overflows usize")))
    }
}

/// One physical allocation, mapped into every range at `offset`.
struct Chunk {
    handle: CUmemGenericAllocationHandle,
    offset: usize,
    size: usize,
}

struct PoolState {
    layout: PhysicalLayout,
    handles: Vec<Chunk>,
    /// Base address of every range reserved so far.
    ranges: Vec<CUdeviceptr>,
}

/// What the pool, its ranges and their slices share; unmapped and freed on the last drop.
struct PoolShared {
    stream: Arc<CudaStream>,
    range_bytes: usize,
    state: Mutex<PoolState>,
}

fn allocation_prop(device: i32) -> CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is the documented default for the fields not set.
    let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device };
    prop
}

impl PoolShared {
    fn device(&self) -> i32 {
        self.stream.context().ordinal() as i32
    }

    /// Maps `chunk` into the range at `base` with read-write access for the pool's device. All
    /// or nothing: when the access cannot be set, the mapping is undone, so the callers' rollbacks
    /// (which unmap only the chunks that mapped) leave no mapping behind.
    fn map_into(&self, base: CUdeviceptr, chunk: &Chunk) -> Result<()> {
        let at = base + chunk.offset as u64;
        let access = CUmemAccessDesc {
            location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: self.device() },
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `at .. at + size` lies inside a reserved range (chunks end at the physical
        // size, which never exceeds `range_bytes`) and is not mapped yet; the handle is live.
        unsafe {
            sys::cuMemMap(at, chunk.size, 0, chunk.handle, 0).result()?;
            if let Err(e) = sys::cuMemSetAccess(at, chunk.size, &access, 1).result() {
                sys::cuMemUnmap(at, chunk.size);
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Backs the first `need` bytes of every range with physical memory.
    fn ensure_physical(&self, state: &mut PoolState, need: usize) -> Result<()> {
        let Some((offset, size)) = state.layout.growth_for(need) else { return Ok(()) };
        self.stream.context().bind_to_thread()?;
        let mut handle: CUmemGenericAllocationHandle = 0;
        // SAFETY: a valid property struct for this device; size is a granularity multiple.
        unsafe { sys::cuMemCreate(&mut handle, size, &allocation_prop(self.device()), 0).result()? };
        let chunk = Chunk { handle, offset, size };
        for &base in &state.ranges {
            if let Err(e) = self.map_into(base, &chunk) {
                // Unmap what was mapped, release the handle: the pool stays as it was.
                for &done in state.ranges.iter().take_while(|&&b| b != base) {
                    // SAFETY: mapped just above.
                    unsafe { sys::cuMemUnmap(done + offset as u64, size) };
                }
                // SAFETY: created above, no longer mapped.
                unsafe { sys::cuMemRelease(handle) };
                return Err(e);
            }
        }
        state.layout.chunks.push((offset, size));
        state.handles.push(chunk);
        Ok(())
    }

    /// Reserves a new range and maps every existing chunk into it.
    fn reserve_range(&self, state: &mut PoolState) -> Result<CUdeviceptr> {
        self.stream.context().bind_to_thread()?;
        let mut base: CUdeviceptr = 0;
        // SAFETY: `range_bytes` is a granularity multiple (checked by `MemoryPool::new`).
        unsafe { sys::cuMemAddressReserve(&mut base, self.range_bytes, state.layout.granularity, 0, 0).result()? };
        for (i, chunk) in state.handles.iter().enumerate() {
            if let Err(e) = self.map_into(base, chunk) {
                for done in &state.handles[..i] {
                    // SAFETY: mapped just above.
                    unsafe { sys::cuMemUnmap(base + done.offset as u64, done.size) };
                }
                // SAFETY: reserved above, nothing mapped any more.
                unsafe { sys::cuMemAddressFree(base, self.range_bytes) };
                return Err(e);
            }
        }
        state.ranges.push(base);
        Ok(base)
    }
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        // NOTE: graphs of the pool may still be running on its stream; unmapping under them
        // would fault. Errors cannot be returned from drop: the driver records them.
        let _ = self.stream.synchronize();
        let _ = self.stream.context().bind_to_thread();
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for &base in &state.ranges {
            for chunk in &state.handles {
                // SAFETY: every chunk was mapped into every range; the stream is idle.
                unsafe { sys::cuMemUnmap(base + chunk.offset as u64, chunk.size) };
            }
            // SAFETY: reserved by this pool with this size; nothing is mapped any more.
            unsafe { sys::cuMemAddressFree(base, self.range_bytes) };
        }
        for chunk in &state.handles {
            // SAFETY: created by this pool and unmapped everywhere above.
            unsafe { sys::cuMemRelease(chunk.handle) };
        }
    }
}

/// Physical memory shared by many graphs, one virtual range each (module docs).
#[derive(Clone)]
pub struct MemoryPool {
    shared: Arc<PoolShared>,
}

/// What a [`MemoryPool`] holds now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Allocation granularity of the device (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`).
    pub granularity: usize,
    /// Virtual bytes of each range.
    pub range_bytes: usize,
    /// Physical bytes mapped (into every range).
    pub physical_bytes: usize,
    /// Ranges reserved.
    pub ranges: usize,
}

impl MemoryPool {
    /// The allocation granularity of `stream`'s device: sizes of physical allocations and of
    /// ranges are multiples of it.
    pub fn granularity(stream: &CudaStream) -> Result<usize> {
        stream.context().bind_to_thread()?;
        let mut granularity = 0usize;
        let prop = allocation_prop(stream.context().ordinal() as i32);
        // SAFETY: a valid property struct; the driver writes one usize.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            .result()?
        };
        Ok(granularity)
    }

    /// A pool bound to `stream`, whose ranges are `range_bytes` of virtual addresses each
    /// (rounded up to the granularity; it bounds what one graph may take, and costs no
    /// physical memory). Nothing physical is allocated until a range hands out bytes.
    pub fn new(stream: &Arc<CudaStream>, range_bytes: usize) -> Result<MemoryPool> {
        const OP: &str = "MemoryPool::new";
        ensure_not_capturing(stream, OP)?;
        let granularity = Self::granularity(stream)?;
        let range_bytes = round_up(range_bytes.max(1), granularity)
            .ok_or_else(|| Error::InvalidArgument { op: OP, why: format!("range_bytes {range_bytes} overflows") })?;
        let state = PoolState { layout: PhysicalLayout::new(granularity), handles: Vec::new(), ranges: Vec::new() };
        Ok(MemoryPool {
            shared: Arc::new(PoolShared { stream: stream.clone(), range_bytes, state: Mutex::new(state) }),
        })
    }

    /// The one stream every buffer and graph of the pool is used on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.shared.stream
    }

    /// A new virtual range over the pool's physical memory, for one graph (one shape).
    pub fn range(&self) -> Result<PoolRange> {
        ensure_not_capturing(&self.shared.stream, "MemoryPool::range")?;
        let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        let base = self.shared.reserve_range(&mut state)?;
        let cursor = BumpCursor::new(self.shared.range_bytes);
        Ok(PoolRange { inner: Arc::new(RangeInner { shared: self.shared.clone(), base, cursor: Mutex::new(cursor) }) })
    }

    pub fn stats(&self) -> PoolStats {
        let state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        PoolStats {
            granularity: state.layout.granularity,
            range_bytes: self.shared.range_bytes,
            physical_bytes: state.layout.bytes(),
            ranges: state.ranges.len(),
        }
    }

    /// Physical bytes mapped: the largest range's use, rounded up to the granularity.
    pub fn physical_bytes(&self) -> usize {
        self.stats().physical_bytes
    }
}

struct RangeInner {
    shared: Arc<PoolShared>,
    base: CUdeviceptr,
    cursor: Mutex<BumpCursor>,
}

/// One graph's virtual range of a [`MemoryPool`]: hands out 256-byte aligned buffers from its
/// start, backed by the pool's shared physical memory (module docs for the rule of use).
/// Cloning gives another handle to the same range.
#[derive(Clone)]
pub struct PoolRange {
    inner: Arc<RangeInner>,
}

impl PoolRange {
    /// A buffer of `len` elements (not initialised: another range's graph may have written
    /// these bytes). Grows the pool's physical memory when this range passes it.
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<PoolSlice<T>> {
        const OP: &str = "PoolRange::alloc";
        let shared = &self.inner.shared;
        ensure_not_capturing(&shared.stream, OP)?;
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| Error::InvalidArgument {
            op: OP,
            why: format!("{len} elements of {} bytes overflow", std::mem::size_of::<T>()),
        })?;
        let mut cursor = self.inner.cursor.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = *cursor;
        let offset = next.take(OP, bytes, POOL_ALIGNMENT.max(std::mem::align_of::<T>()))?;
        let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        shared.ensure_physical(&mut state, next.used)?;
        *cursor = next;
        Ok(PoolSlice { range: self.inner.clone(), ptr: self.inner.base + offset as u64, len, _element: PhantomData })
    }

    /// Bytes handed out so far (including alignment padding).
    pub fn used_bytes(&self) -> usize {
        self.inner.cursor.lock().unwrap_or_else(|e| e.into_inner()).used
    }

    /// First address of the range.
    pub fn base(&self) -> CUdeviceptr {
        self.inner.base
    }

    /// Virtual bytes of the range.
    pub fn len_bytes(&self) -> usize {
        self.inner.shared.range_bytes
    }

    /// The pool's stream (the only stream its buffers may be used on).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.shared.stream
    }

    /// The pool this range belongs to.
    pub fn pool(&self) -> MemoryPool {
        MemoryPool { shared: self.inner.shared.clone() }
    }
}

/// `len` elements of `T` in a [`PoolRange`]; keeps the pool's memory mapped while it lives.
/// Usable wherever the crate takes a cudarc buffer (`DevicePtr` / `DevicePtrMut`), on the
/// pool's stream only (another stream panics: module docs). No events are recorded: the pool's
/// one stream orders every use.
pub struct PoolSlice<T> {
    range: Arc<RangeInner>,
    ptr: CUdeviceptr,
    len: usize,
    _element: PhantomData<T>,
}

impl<T> PoolSlice<T> {
    /// The device address (fixed for the pool's lifetime, so a graph may keep it).
    pub fn device_address(&self) -> CUdeviceptr {
        self.ptr
    }

    fn ensure_pool_stream(&self, stream: &CudaStream) {
        // NOTE: a panic, not an error: cudarc's `device_ptr` returns no Result. A buffer of
        // memory shared with other graphs used on a second stream could race with them.
        assert!(
            *stream == *self.range.shared.stream,
            "a pool buffer was used on stream {:#x}, but its pool is bound to stream {:#x}: graphs sharing \
             physical memory must run on the pool's one stream",
            stream.cu_stream() as u64,
            self.range.shared.stream.cu_stream() as u64,
        );
    }
}

impl<T> DeviceSlice<T> for PoolSlice<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.range.shared.stream
    }
}

impl<T> DevicePtr<T> for PoolSlice<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.ensure_pool_stream(stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for PoolSlice<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.ensure_pool_stream(stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// A plan's buffer: its own allocation, or a slice of a pool range.
pub enum DeviceBuffer<T> {
    Owned(CudaSlice<T>),
    Pooled(PoolSlice<T>),
}

/// Where a plan takes its scratch buffers from.
#[derive(Clone, Copy)]
pub enum Scratch<'a> {
    /// Ordinary zeroed allocations on this stream.
    Stream(&'a Arc<CudaStream>),
    /// A pool range (not initialised).
    Pool(&'a PoolRange),
}

impl Scratch<'_> {
    /// A buffer of `len` elements (at least one).
    pub fn alloc<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        Ok(match self {
            Scratch::Stream(stream) => DeviceBuffer::Owned(stream.alloc_zeros(len.max(1))?),
            Scratch::Pool(range) => DeviceBuffer::Pooled(range.alloc(len.max(1))?),
        })
    }
}

impl<T> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        match self {
            DeviceBuffer::Owned(s) => s.len(),
            DeviceBuffer::Pooled(s) => s.len(),
        }
    }
    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            DeviceBuffer::Owned(s) => s.stream(),
            DeviceBuffer::Pooled(s) => DeviceSlice::stream(s),
        }
    }
}

impl<T> DevicePtr<T> for DeviceBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            DeviceBuffer::Owned(s) => s.device_ptr(stream),
            DeviceBuffer::Pooled(s) => s.device_ptr(stream),
        }
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            DeviceBuffer::Owned(s) => s.device_ptr_mut(stream),
            DeviceBuffer::Pooled(s) => s.device_ptr_mut(stream),
        }
    }
}
