//! A candle tensor's CUDA memory handed to capturable-moe as is: no copy, no new allocation.
//!
//! capturable-moe takes cudarc's `DevicePtr` / `DevicePtrMut`. candle 0.11 hands out
//! `&CudaSlice` (read-only) through `Tensor::storage_and_layout`, so this wrapper keeps the
//! tensor alive and gives out its device address for reading and writing. It does no
//! cross-stream synchronisation: every user of these buffers (candle's ops and capturable-moe's
//! launches) runs on candle's one stream, in order. It records no events either, so a launch
//! that uses it can be captured in a CUDA graph.

use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::cuda::cudarc::driver::sys::CUdeviceptr;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use candle_core::cuda::CudaStorageSlice;
use candle_core::{Storage, Tensor};

pub struct CandleBuffer<T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    /// Keeps the memory allocated while the buffer (or a graph that baked in its address) is used.
    _tensor: Tensor,
    _element: PhantomData<T>,
}

fn address<U>(slice: &CudaSlice<U>, first: usize) -> (CUdeviceptr, Arc<CudaStream>) {
    let stream = slice.stream().clone();
    let base = slice.device_ptr(&stream).0;
    (base + (first * std::mem::size_of::<U>()) as CUdeviceptr, stream)
}

impl<T> CandleBuffer<T> {
    /// The memory of a contiguous CUDA tensor whose element has `T`'s size (u32 expert ids may
    /// be read as i32: equal bits below 2^31). Writing through it changes the tensor in place:
    /// only do that to a tensor nothing else reads meanwhile.
    pub fn of(tensor: &Tensor) -> candle_core::Result<Self> {
        if tensor.dtype().size_in_bytes() != std::mem::size_of::<T>() {
            candle_core::bail!("{:?} elements are not {} bytes", tensor.dtype(), std::mem::size_of::<T>())
        }
        let (storage, layout) = tensor.storage_and_layout();
        let Some((first, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("the tensor is not contiguous")
        };
        let Storage::Cuda(cuda) = &*storage else { candle_core::bail!("the tensor is not on a CUDA device") };
        let (ptr, stream) = match &cuda.slice {
            CudaStorageSlice::BF16(s) => address(s, first),
            CudaStorageSlice::F16(s) => address(s, first),
            CudaStorageSlice::F32(s) => address(s, first),
            CudaStorageSlice::U32(s) => address(s, first),
            CudaStorageSlice::I32(s) => address(s, first),
            CudaStorageSlice::I64(s) => address(s, first),
            _ => candle_core::bail!("unsupported dtype {:?}", tensor.dtype()),
        };
        Ok(CandleBuffer { ptr, len: end - first, stream, _tensor: tensor.clone(), _element: PhantomData })
    }
}

impl<T> DeviceSlice<T> for CandleBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for CandleBuffer<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for CandleBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}
