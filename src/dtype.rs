//! Element types that cross the C ABI, and the Rust types that carry them.

use cudarc::driver::DeviceRepr;

use crate::sys;

/// An element type of a device buffer, as the C ABI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    F16,
    F32,
    I32,
    I64,
}

impl DType {
    pub(crate) fn abi(self) -> sys::capmoe_dtype_t {
        (match self {
            DType::Bf16 => sys::CAPMOE_DTYPE_BF16,
            DType::F16 => sys::CAPMOE_DTYPE_F16,
            DType::F32 => sys::CAPMOE_DTYPE_F32,
            DType::I32 => sys::CAPMOE_DTYPE_I32,
            DType::I64 => sys::CAPMOE_DTYPE_I64,
        }) as sys::capmoe_dtype_t
    }

    pub fn size_bytes(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }
}

/// A Rust element type with a device representation and a C ABI dtype.
pub trait Element: DeviceRepr + Copy + 'static {
    const DTYPE: DType;
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
