//! Element types that cross the C ABI. Each capability maps Rust element types onto them
//! with its own trait (`routing::Element`, `grouped_gemm::GemmOperand`), since each accepts a
//! different set.

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
