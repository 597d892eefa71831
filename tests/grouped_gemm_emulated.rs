//! The grouped GEMM's device-side argument writing without a GPU: the argument kernel and the
//! WGRAD zero fill of `csrc/grouped_gemm/arguments.cuh`, compiled as host C++ against the CPU
//! emulation of `tests/emulation/` and run by `tests/emulation/grouped_gemm_driver.cpp`, which
//! records every group the kernel hands to CUTLASS (problem size and A/B/D pointers). Checked
//! against the contract of `capturable_moe/grouped_gemm.h`, written out below: clamped 64-bit
//! row offsets, the overflow bits (capacity, negative counts, null / misaligned per-expert
//! pointers, which skip their expert), each op's operand roles for both weight layouts, and
//! dW_e = 0 for exactly the experts without rows. Counts in int32 and int64, up to 65535
//! experts (64 per thread of the one block), both thread orders. The CUTLASS GEMM itself is
//! not emulated; `grouped_gemm_gpu` checks the products on the device.
//!
//! Needs a C++17 compiler (`CXX`, default `c++`); ~5 s.

mod common;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const FPROP: i64 = 0;
const DGRAD: i64 = 1;
const WGRAD: i64 = 2;

const OVERFLOW_CAPACITY: i64 = 1;
const OVERFLOW_NEGATIVE: i64 = 2;
const OVERFLOW_MISALIGNED: i64 = 32;
const OVERFLOW_NULL_POINTER: i64 = 64;

/// Per-expert pointer faults (`kPointerKind` of the driver).
const VALID: i64 = 0;
const NULL: i64 = 1;
const MISALIGNED: i64 = 2;

/// Where a recorded pointer points (`kBuffer` of the driver): buffer A, B, D, or null.
const BUFFER_A: i64 = 0;
const BUFFER_B: i64 = 1;
const BUFFER_D: i64 = 2;
const NULL_POINTER: i64 = 3;

/// The driver's initial byte of every buffer.
const POISON: u8 = 0x5a;

#[derive(Clone, Debug)]
struct Case {
    op: i64,
    splits_i64: bool,
    /// Per-expert pointer faults; `None`: the weights are one strided tensor.
    pointer_kinds: Option<Vec<i64>>,
    transposed: bool,
    n: i64,
    k: i64,
    capacity: i64,
    d_bytes: i64,
    counts: Vec<i64>,
}

impl Case {
    fn experts(&self) -> usize {
        self.counts.len()
    }
    /// Whether the case also runs the WGRAD zero fill: not for the 3000-expert shapes, whose
    /// 256-thread blocks would take the emulation several seconds.
    fn zero_fill(&self) -> bool {
        self.op == WGRAD && self.experts() <= 1025
    }
    fn kind(&self, e: usize) -> i64 {
        self.pointer_kinds.as_ref().map_or(VALID, |k| k[e])
    }
    fn weight_element_bytes(&self) -> i64 {
        if self.op == WGRAD {
            self.d_bytes
        } else {
            2
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        let header = [
            self.op,
            self.splits_i64 as i64,
            self.pointer_kinds.is_some() as i64,
            self.transposed as i64,
            self.experts() as i64,
            self.n,
            self.k,
            self.capacity,
            self.d_bytes,
            self.zero_fill() as i64,
        ];
        header
            .iter()
            .chain(&self.counts)
            .chain(self.pointer_kinds.iter().flatten())
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    }
}

/// A pointer as the driver reports it: (buffer, byte offset).
type Located = (i64, i64);

#[derive(Debug, PartialEq)]
struct Group {
    m: i64,
    n: i64,
    k: i64,
    a: Located,
    b: Located,
    d: Located,
}

#[derive(Debug, PartialEq)]
struct Outcome {
    status: i64,
    flags: i64,
    row_offsets: Vec<i64>,
    groups: Vec<Group>,
    /// The weight-shaped buffer after the zero fill.
    weights: Option<Vec<u8>>,
}

/// The contract: what the kernels must produce for `c`.
fn reference(c: &Case) -> Outcome {
    let (n, k, cap) = (c.n, c.k, c.capacity);
    let matrix_bytes = n * k * c.weight_element_bytes();
    let weight_buffer = if c.op == WGRAD { BUFFER_D } else { BUFFER_B };
    let mut flags = 0;
    let mut row_offsets = Vec::new();
    let mut groups = Vec::new();
    let mut offset = 0i64;
    for (e, &raw) in c.counts.iter().enumerate() {
        if raw < 0 {
            flags |= OVERFLOW_NEGATIVE;
        }
        let rows_asked = raw.clamp(0, cap + 1);
        if offset + rows_asked > cap {
            flags |= OVERFLOW_CAPACITY;
        }
        let start = offset.min(cap);
        let rows = (offset + rows_asked).min(cap) - start;
        offset += rows_asked;
        row_offsets.push(start);

        let weight = match c.kind(e) {
            NULL => {
                flags |= OVERFLOW_NULL_POINTER;
                (NULL_POINTER, 0)
            }
            kind => {
                (weight_buffer, e as i64 * matrix_bytes + if kind == MISALIGNED { c.weight_element_bytes() } else { 0 })
            }
        };
        let mut g = match c.op {
            FPROP => {
                Group { m: rows, n, k, a: (BUFFER_A, start * k * 2), b: weight, d: (BUFFER_D, start * n * c.d_bytes) }
            }
            DGRAD => Group {
                m: rows,
                n: k,
                k: n,
                a: (BUFFER_A, start * n * 2),
                b: weight,
                d: (BUFFER_D, start * k * c.d_bytes),
            },
            _ => {
                let (dy, x) = ((BUFFER_A, start * n * 2), (BUFFER_B, start * k * 2));
                let (m, cols, a, b) = if c.transposed { (k, n, x, dy) } else { (n, k, dy, x) };
                let empty = rows == 0;
                Group { m: if empty { 0 } else { m }, n: if empty { 0 } else { cols }, k: rows, a, b, d: weight }
            }
        };
        if c.kind(e) == MISALIGNED {
            flags |= OVERFLOW_MISALIGNED;
        }
        if c.kind(e) != VALID {
            (g.m, g.n, g.k) = (0, 0, 0);
        }
        groups.push(g);
    }
    row_offsets.push(offset.min(cap));

    let weights = c.zero_fill().then(|| {
        let mut bytes = vec![POISON; (matrix_bytes * c.experts() as i64) as usize];
        for e in 0..c.experts() {
            if row_offsets[e] == row_offsets[e + 1] && c.kind(e) == VALID {
                bytes[e * matrix_bytes as usize..(e + 1) * matrix_bytes as usize].fill(0);
            }
        }
        bytes
    });
    Outcome { status: 0, flags, row_offsets, groups, weights }
}

/// Reads the driver's output for `c` from `bytes` at `*at`.
fn read_outcome(c: &Case, bytes: &[u8], at: &mut usize) -> Outcome {
    let mut next = || {
        let v = i64::from_le_bytes(bytes[*at..*at + 8].try_into().unwrap());
        *at += 8;
        v
    };
    let (status, flags) = (next(), next());
    let row_offsets = (0..=c.experts()).map(|_| next()).collect();
    let groups = (0..c.experts())
        .map(|_| Group {
            m: next(),
            n: next(),
            k: next(),
            a: (next(), next()),
            b: (next(), next()),
            d: (next(), next()),
        })
        .collect();
    let weights = c.zero_fill().then(|| {
        let len = (c.n * c.k * c.weight_element_bytes()) as usize * c.experts();
        *at += len;
        bytes[*at - len..*at].to_vec()
    });
    Outcome { status, flags, row_offsets, groups, weights }
}

/// Counts for `experts` experts: mostly around `capacity / experts`, with zeros, and with the
/// odd negative or huge count when `wild`.
fn random_counts(rng: &mut StdRng, experts: usize, capacity: i64, wild: bool) -> Vec<i64> {
    let mean = (capacity / experts as i64).max(1);
    (0..experts)
        .map(|_| match rng.random_range(0..20) {
            0 => 0,
            1 if wild => -rng.random_range(1..1000),
            2 if wild => [i64::MAX, i32::MAX as i64, capacity + 1, capacity][rng.random_range(0..4)],
            _ => rng.random_range(0..=2 * mean),
        })
        .collect()
}

/// Shapes (experts, n, k, capacity): one expert; a few; n x k large enough that the zero fill
/// spreads one expert over several blocks; one per thread of the argument kernel; more
/// experts than threads (several per thread).
fn cases() -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(90);
    let mut cases = Vec::new();
    for op in [FPROP, DGRAD, WGRAD] {
        for &(experts, n, k, capacity) in &[
            (1, 8, 16, 40),
            (7, 24, 16, 100),
            (5, 64, 48, 200),
            (64, 16, 8, 512),
            (1025, 8, 8, 3000),
            (3000, 8, 16, 2048),
        ] {
            for splits_i64 in [false, true] {
                for pointers in [false, true] {
                    for wild in [false, true] {
                        let d_bytes = if op == WGRAD && rng.random_bool(0.5) { 4 } else { 2 };
                        let pointer_kinds = pointers.then(|| {
                            (0..experts)
                                .map(|_| [VALID, VALID, VALID, NULL, MISALIGNED][rng.random_range(0..5)])
                                .collect()
                        });
                        let mut counts = random_counts(&mut rng, experts, capacity, wild);
                        if !splits_i64 {
                            counts.iter_mut().for_each(|v| *v = *v as i32 as i64);
                        }
                        let transposed = rng.random_bool(0.5);
                        cases.push(Case { op, splits_i64, pointer_kinds, transposed, n, k, capacity, d_bytes, counts });
                    }
                }
            }
        }
    }
    // The edges: no rows at all, every row on the last expert, exactly full, capacity 0, and
    // the most experts a plan accepts.
    let edge = |op, counts: Vec<i64>, capacity| Case {
        op,
        splits_i64: true,
        pointer_kinds: None,
        transposed: false,
        n: 8,
        k: 8,
        capacity,
        d_bytes: 2,
        counts,
    };
    for op in [FPROP, WGRAD] {
        cases.push(edge(op, vec![0; 9], 64));
        cases.push(edge(op, [vec![0; 8], vec![64]].concat(), 64));
        cases.push(edge(op, vec![8; 8], 64));
        cases.push(edge(op, vec![1; 5], 0));
    }
    cases.push(edge(FPROP, random_counts(&mut rng, 65535, 70000, true), 70000));
    // dW_e of 512 x 512: more 16-byte vectors than the zero fill's 64 blocks per expert cover
    // in one pass, so its grid-stride loop runs 2 (bf16) or 4 (fp32) times.
    for d_bytes in [2, 4] {
        cases.push(Case { n: 512, k: 512, d_bytes, ..edge(WGRAD, vec![0, 16, 0], 16) });
    }
    cases
}

#[test]
fn argument_kernel_and_zero_fill_follow_the_contract_under_cpu_emulation() {
    let cases = cases();
    let mut input = Vec::new();
    cases.iter().for_each(|c| c.write(&mut input));
    let exe = common::emulation::build("grouped_gemm_emulator", &[], "tests/emulation/grouped_gemm_driver.cpp");
    common::emulation::run_case_file(&exe, "grouped_gemm_emulated", &input, cases.len(), |bytes, order| {
        let mut at = 0;
        for (i, c) in cases.iter().enumerate() {
            let got = read_outcome(c, bytes, &mut at);
            let want = reference(c);
            if got != want {
                let first_group = (0..c.experts()).find(|&e| got.groups.get(e) != want.groups.get(e));
                panic!(
                    "case {i} ({order} order, op {}, {} experts, splits_i64 {}, pointers {}, transposed {}): status {} vs {}, flags {} vs {}, row offsets equal {}, first differing group {:?}: {:?} vs {:?}, weights equal {}",
                    c.op, c.experts(), c.splits_i64, c.pointer_kinds.is_some(), c.transposed, got.status, want.status,
                    got.flags, want.flags, got.row_offsets == want.row_offsets, first_group,
                    first_group.map(|e| &got.groups[e]), first_group.map(|e| &want.groups[e]), got.weights == want.weights
                );
            }
        }
        assert_eq!(at, bytes.len(), "the driver wrote more than the cases account for");
    });
}
