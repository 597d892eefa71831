// For the host layout checks of the sm_100a kernels (tests/layout/*_sm100_layout.cu): how a
// UMMA shared-memory descriptor of an MN-major, 128B-swizzled operand reads (column n, K row k)
// of one k16 step, following the PTX ISA's canonical MN-major SW128 form: in 16-byte units
// ((8, n), (8, k)) : ((1, LBO), (8, SBO)), then the 128B swizzle (16-byte chunk bits [4,7) XOR
// the 128-byte row bits [7,10) of the byte offset), relative to the step's 1024-byte aligned
// base. lbo / sbo in 16-byte units, as the descriptor holds them.
#pragma once

inline long mn_sw128_descriptor_offset(int n, int k, long lbo, long sbo, int elem_bytes) {
  const int per_chunk = 16 / elem_bytes;   // elements in 16 bytes
  const int atom_columns = 8 * per_chunk;  // 128 bytes of columns
  const int m = n % atom_columns;
  const long unit = (m / per_chunk) + (n / atom_columns) * lbo + (k % 8) * 8 + (k / 8) * sbo;
  const long plain = unit * 16 + (m % per_chunk) * elem_bytes;
  return plain ^ (((plain >> 7) & 7) << 4);
}
