//! The Echo spare-slot weight kernels without a GPU: `csrc/echo/echo_weights.cu` compiled as host
//! C++ against the CPU emulation of `tests/emulation/` and run through its C ABI by
//! `tests/emulation/echo_weights_driver.cpp`. The fill (`capmoe_echo_fill_spare_weights`) on
//! bf16, fp16, f32 and byte weights, odd sizes (byte path), 16-byte multiples (vector path) and
//! misaligned pointers, a local slot range, one and many blocks per slot and the grid-stride
//! wrap; the fold (`capmoe_echo_fold_spare_grads`, f32) with several slots on one home expert
//! (summation order checked), all slots on one expert, up to the 8192-slot limit. Both with
//! empty (-1) slots, out-of-range slot experts (flagged with `BAD_SLOT_EXPERT`, OR-ed into the
//! existing error word, or no error word at all), the no-op sizes and every argument the entry
//! points reject. Outputs start poisoned with a guard tail and must equal the reference below
//! bit for bit (status, error word, every output byte), in both thread orders. `echo_gpu`
//! checks the same kernels on the device.
//!
//! Needs a C++17 compiler (`CXX`, default `c++`); ~8 s (half of it the two 8192-slot cases). `CAPMOE_EMULATION_CXXFLAGS` adds
//! compiler flags (sanitizers), as for `echo_emulated`.

mod common;

use bytemuck::Pod;
use capturable_moe::echo::DeviceErrors;
use capturable_moe::sys;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Poisoned bytes after every buffer.
const GUARD: usize = 64;
/// What an output byte starts as (0xBEEF per 2-byte element, as in `echo_gpu`).
const OUTPUT_POISON: [u8; 2] = [0xef, 0xbe];
/// What an input byte past the end reads as.
const INPUT_POISON: u8 = 0xa5;
/// The slot limit of both entry points (`CAPMOE_ECHO_MAX_WEIGHT_SLOTS`).
const MAX_SLOTS: usize = capturable_moe::echo::MAX_WEIGHT_SLOTS;
const OK: i32 = sys::CAPMOE_OK as i32;
const INVALID: i32 = sys::CAPMOE_ERR_INVALID_ARGUMENT as i32;
const MISALIGNED: i32 = sys::CAPMOE_ERR_MISALIGNED as i32;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Op {
    Fill,
    Fold,
}

/// One call of an entry point, in the driver's terms (see echo_weights_driver.cpp).
#[derive(Clone)]
struct Case {
    name: String,
    op: Op,
    num_experts: i64,
    slot_begin: i64,
    num_slots: i64,
    /// Bytes (fill) or f32 elements (fold) per expert.
    per_expert: i64,
    slot_expert: Vec<i64>,
    /// home (fill) or dw_slot (fold), then the poisoned tail.
    input: Vec<u8>,
    /// spare (fill) or dw_home (fold) as it starts, guard included.
    output: Vec<u8>,
    /// The error word's initial value, or `None` to pass NULL.
    errors: Option<i64>,
    /// Byte offsets of the input / output from a 16-byte boundary.
    offsets: (usize, usize),
    /// Pointers passed as NULL: bit 0 slot_expert, 1 input, 2 output.
    null_mask: i64,
    /// `Some(status)`: the call returns `status` and writes nothing (rejected arguments,
    /// no-op sizes).
    writes_nothing: Option<i32>,
}

/// What the driver must write back for a case.
struct Expected {
    status: i32,
    errors: i64,
    output: Vec<u8>,
}

fn with_tail(mut v: Vec<u8>, byte: u8) -> Vec<u8> {
    v.extend(std::iter::repeat_n(byte, GUARD));
    v
}

fn poisoned_output(bytes: usize) -> Vec<u8> {
    (0..bytes + GUARD).map(|i| OUTPUT_POISON[i % 2]).collect()
}

fn to_bytes<T: Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// `n` random weights of type T as bytes.
fn weights<T: Pod>(rng: &mut StdRng, n: usize, value: fn(&mut StdRng) -> T) -> Vec<u8> {
    to_bytes(&(0..n).map(|_| value(rng)).collect::<Vec<T>>())
}

fn bf16_value(rng: &mut StdRng) -> bf16 {
    bf16::from_f32(rng.random_range(-2.0f32..2.0))
}
fn f16_value(rng: &mut StdRng) -> f16 {
    f16::from_f32(rng.random_range(-2.0f32..2.0))
}
fn f32_value(rng: &mut StdRng) -> f32 {
    rng.random_range(-1.0f32..1.0)
}
fn byte_value(rng: &mut StdRng) -> u8 {
    rng.random()
}

/// A gradient whose magnitude varies over 2^-12 .. 2^12, so the order of a sum shows.
fn grad_value(rng: &mut StdRng) -> f32 {
    rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-12..12))
}

/// The fill of slots `slot_begin .. slot_begin + num_slots` of `slot_expert` from `home`
/// ([E, per_expert] elements of T, made by `value`).
#[allow(clippy::too_many_arguments)]
fn fill_case<T: Pod>(
    name: &str,
    rng: &mut StdRng,
    e: usize,
    slot_expert: &[i64],
    slot_begin: usize,
    num_slots: usize,
    per_expert: usize,
    value: fn(&mut StdRng) -> T,
) -> Case {
    let bytes = per_expert * std::mem::size_of::<T>();
    Case {
        name: format!(
            "fill {name} ({}, {per_expert} per expert)",
            std::any::type_name::<T>().rsplit("::").next().unwrap()
        ),
        op: Op::Fill,
        num_experts: e as i64,
        slot_begin: slot_begin as i64,
        num_slots: num_slots as i64,
        per_expert: bytes as i64,
        slot_expert: slot_expert.to_vec(),
        input: with_tail(weights(rng, e * per_expert, value), INPUT_POISON),
        output: poisoned_output(num_slots * bytes),
        errors: Some(0),
        offsets: (0, 0),
        null_mask: 0,
        writes_nothing: None,
    }
}

/// The fold of every slot of `slot_expert` into [E, per_expert] f32 home gradients.
fn fold_case(name: &str, rng: &mut StdRng, e: usize, slot_expert: &[i64], per_expert: usize) -> Case {
    let n = slot_expert.len();
    let home: Vec<f32> = (0..e * per_expert).map(|_| grad_value(rng)).collect();
    let slots: Vec<f32> = (0..n * per_expert).map(|_| grad_value(rng)).collect();
    let mut output = to_bytes(&home);
    output.extend_from_slice(&poisoned_output(0));
    Case {
        name: format!("fold {name} ({per_expert} per expert)"),
        op: Op::Fold,
        num_experts: e as i64,
        slot_begin: 0,
        num_slots: n as i64,
        per_expert: per_expert as i64,
        slot_expert: slot_expert.to_vec(),
        input: with_tail(to_bytes(&slots), INPUT_POISON),
        output,
        errors: Some(0),
        offsets: (0, 0),
        null_mask: 0,
        writes_nothing: None,
    }
}

/// The home expert of a slot, `Err(())` for an id outside [-1, E), `Ok(None)` for -1.
fn home_of(id: i64, e: i64) -> Result<Option<usize>, ()> {
    match id {
        -1 => Ok(None),
        id if (0..e).contains(&id) => Ok(Some(id as usize)),
        _ => Err(()),
    }
}

/// `spare[i] = home[slot_expert[slot_begin + i]]` for the slots with a home expert.
fn fill_reference(c: &Case, out: &mut [u8]) -> bool {
    let bytes = c.per_expert as usize;
    let mut bad = false;
    for i in 0..c.num_slots as usize {
        match home_of(c.slot_expert[c.slot_begin as usize + i], c.num_experts) {
            Ok(Some(e)) => out[i * bytes..(i + 1) * bytes].copy_from_slice(&c.input[e * bytes..(e + 1) * bytes]),
            Ok(None) => {}
            Err(()) => bad = true,
        }
    }
    bad
}

/// `dw_home[e] += dw_slot[j]` over the slots j of e, in ascending j, in f32.
fn fold_reference(c: &Case, out: &mut [u8]) -> bool {
    let n = c.per_expert as usize;
    let slots: Vec<f32> = bytemuck::pod_collect_to_vec(&c.input);
    let mut home: Vec<f32> = bytemuck::pod_collect_to_vec(&out[..c.num_experts as usize * n * 4]);
    let mut bad = false;
    for j in 0..c.num_slots as usize {
        match home_of(c.slot_expert[j], c.num_experts) {
            Ok(Some(e)) => (0..n).for_each(|v| home[e * n + v] += slots[j * n + v]),
            Ok(None) => {}
            Err(()) => bad = true,
        }
    }
    out[..home.len() * 4].copy_from_slice(bytemuck::cast_slice(&home));
    bad
}

fn expected(c: &Case) -> Expected {
    let initial = c.errors.unwrap_or(0);
    if let Some(status) = c.writes_nothing {
        return Expected { status, errors: initial, output: c.output.clone() };
    }
    let mut output = c.output.clone();
    let bad = match c.op {
        Op::Fill => fill_reference(c, &mut output),
        Op::Fold => fold_reference(c, &mut output),
    };
    let flag = if bad && c.errors.is_some() { DeviceErrors::BAD_SLOT_EXPERT as i64 } else { 0 };
    Expected { status: OK, errors: initial | flag, output }
}

fn put_case(out: &mut Vec<u8>, c: &Case) {
    let header = [
        (c.op == Op::Fold) as i64,
        c.num_experts,
        c.slot_begin,
        c.num_slots,
        c.per_expert,
        c.errors.is_some() as i64,
        c.errors.unwrap_or(0),
        c.offsets.0 as i64,
        c.offsets.1 as i64,
        c.null_mask,
        c.slot_expert.len() as i64,
        c.input.len() as i64,
        c.output.len() as i64,
    ];
    out.extend_from_slice(bytemuck::cast_slice(&header));
    out.extend_from_slice(bytemuck::cast_slice(&c.slot_expert));
    out.extend_from_slice(&c.input);
    out.extend_from_slice(&c.output);
}

/// The slot map of `echo_gpu`'s weight test: empty slots, three slots on expert 3, two on 7.
const SLOTS: [i64; 12] = [-1, 3, 3, 7, -1, 0, 15, 3, -1, 7, 2, -1];

fn fill_cases(rng: &mut StdRng) -> Vec<Case> {
    let mut x = Vec::new();
    // echo_gpu's sizes: 2 and 10 bytes take the byte path, 128 and 2000 the 16-byte one.
    for per in [1, 5, 64, 1000] {
        x.push(fill_case("all slots", rng, 16, &SLOTS, 0, 12, per, bf16_value));
    }
    x.push(fill_case("slots 4..8 (rank 1 of 3)", rng, 16, &SLOTS, 4, 4, 64, f16_value));
    x.push(fill_case("slots 8..12, odd size", rng, 16, &SLOTS, 8, 4, 37, f16_value));
    x.push(fill_case("all slots", rng, 16, &SLOTS, 0, 12, 3, f32_value));
    x.push(fill_case("all slots", rng, 16, &SLOTS, 0, 12, 17, byte_value));
    // A 16-byte multiple, but a pointer off a 16-byte boundary: the byte path.
    for offsets in [(2, 0), (0, 2), (8, 8)] {
        let mut c = fill_case("misaligned", rng, 16, &SLOTS, 0, 12, 64, bf16_value);
        c.name = format!("{} by {offsets:?}", c.name);
        c.offsets = offsets;
        x.push(c);
    }
    // Several blocks per slot, then the grid-stride wrap past 1024 blocks x 256 threads.
    x.push(fill_case("20 blocks per slot", rng, 4, &[2, -1, 0], 0, 3, 40_000, bf16_value));
    x.push(fill_case("157 blocks per slot, byte path", rng, 3, &[1, 1], 0, 2, 20_001, f16_value));
    x.push(fill_case("stride wrap, 16-byte path", rng, 2, &[1], 0, 1, 4 * (262_144 + 5), f32_value));
    x.push(fill_case("stride wrap, byte path", rng, 2, &[1], 0, 1, 262_144 + 77, byte_value));
    x.push(fill_case("every slot empty", rng, 8, &[-1; 6], 0, 6, 16, bf16_value));
    let slots: Vec<i64> = (0..MAX_SLOTS).map(|_| rng.random_range(-1..64)).collect();
    x.push(fill_case("8192 slots (the limit)", rng, 64, &slots, 0, MAX_SLOTS, 8, bf16_value));
    x.extend(bad_slot_cases(fill_case(
        "bad ids",
        rng,
        16,
        &[16, 0, -2, 5, 1 << 40, -1, i64::MIN],
        0,
        7,
        8,
        bf16_value,
    )));
    x.extend(rejected_cases(fill_case("valid", rng, 16, &SLOTS, 0, 12, 8, bf16_value)));
    x
}

fn fold_cases(rng: &mut StdRng) -> Vec<Case> {
    let mut x = Vec::new();
    for per in [1, 5, 64, 1000, 3, 257] {
        x.push(fold_case("all slots", rng, 16, &SLOTS, per));
    }
    x.push(order_case());
    x.push(fold_case("20 slots on one expert", rng, 3, &[0; 20], 300));
    x.push(fold_case("stride wrap", rng, 1, &[0], 262_144 + 37));
    x.push(fold_case("every slot empty", rng, 8, &[-1; 5], 16));
    let slots: Vec<i64> = (0..MAX_SLOTS).map(|_| rng.random_range(-1..1024)).collect();
    x.push(fold_case("8192 slots (the limit, 32 KB of shared memory)", rng, 1024, &slots, 4));
    x.extend(bad_slot_cases(fold_case("bad ids", rng, 4, &[4, 3, -7, 3, -1, 0, 99], 40)));
    x.extend(rejected_cases(fold_case("valid", rng, 16, &SLOTS, 8)));
    x
}

/// Home 1 with slots 2^24, 1, -2^24 on it: 0 summed in ascending slot order, 2 in the reverse.
fn order_case() -> Case {
    let home = [5.0f32, 1.0];
    let slots = [2f32.powi(24), 7.0, 1.0, -(2f32.powi(24))];
    let mut c = fold_case("summation order", &mut StdRng::seed_from_u64(0), 2, &[1, 0, 1, 1], 1);
    c.input = with_tail(to_bytes(&slots), INPUT_POISON);
    c.output = [to_bytes(&home), poisoned_output(0)].concat();
    let mut want = c.output.clone();
    fold_reference(&c, &mut want);
    assert_eq!(bytemuck::pod_read_unaligned::<f32>(&want[4..8]), 0.0, "the order case must depend on the order");
    c
}

/// A case with out-of-range slot experts: with an empty error word, one with bits already set
/// (they must stay), and with no error word.
fn bad_slot_cases(c: Case) -> Vec<Case> {
    let variant = |what: &str, errors: Option<i64>| Case { name: format!("{} ({what})", c.name), errors, ..c.clone() };
    vec![
        variant("error word 0", Some(0)),
        variant("error word 0x3 set before", Some(3)),
        variant("no error word", None),
    ]
}

/// The arguments the entry point rejects and the sizes it takes as no-ops (OK), derived from
/// a valid case: neither writes anything.
fn rejected_cases(valid: Case) -> Vec<Case> {
    let with = |what: &str, status: i32, change: &dyn Fn(&mut Case)| {
        let mut c = Case { name: format!("{}: {what}", valid.name), writes_nothing: Some(status), ..valid.clone() };
        change(&mut c);
        c
    };
    let mut x = vec![
        with("no experts", INVALID, &|c| c.num_experts = 0),
        with("negative slot count", INVALID, &|c| c.num_slots = -1),
        with("8193 slots", INVALID, &|c| c.num_slots = MAX_SLOTS as i64 + 1),
        with("negative size", INVALID, &|c| c.per_expert = -1),
        with("NULL slot_expert", INVALID, &|c| c.null_mask = 1),
        with("NULL input", INVALID, &|c| c.null_mask = 2),
        with("NULL output", INVALID, &|c| c.null_mask = 4),
        with("0 slots, NULL pointers", OK, &|c| (c.num_slots, c.null_mask) = (0, 7)),
        with("size 0, NULL pointers", OK, &|c| (c.per_expert, c.null_mask) = (0, 7)),
    ];
    // Sizes whose byte offsets would overflow int64 on the device.
    x.push(with("E * size past int64", INVALID, &|c| c.per_expert = i64::MAX / 8));
    if valid.op == Op::Fill {
        x.push(with("negative slot_begin", INVALID, &|c| c.slot_begin = -1));
        x.push(with("slot_begin + slots past int64", INVALID, &|c| c.slot_begin = i64::MAX - 3));
    } else {
        x.push(with("size * 4 bytes past int64", INVALID, &|c| c.per_expert = i64::MAX / 2));
        x.push(with("dw_slot off 4-byte alignment", MISALIGNED, &|c| c.offsets = (2, 0)));
        x.push(with("dw_home off 4-byte alignment", MISALIGNED, &|c| c.offsets = (0, 1)));
    }
    x
}

fn check_output(output: &[u8], cases: &[Case], order: &str) {
    let mut at = 0;
    for c in cases {
        let want = expected(c);
        let status = i32::from_le_bytes(output[at..at + 4].try_into().unwrap());
        let errors = i64::from_le_bytes(output[at + 4..at + 12].try_into().unwrap());
        at += 12;
        let got = &output[at..at + want.output.len()];
        at += want.output.len();
        let what = format!("{} ({order} thread order)", c.name);
        assert_eq!(status, want.status, "{what}: status");
        assert_eq!(errors, want.errors, "{what}: error word");
        if let Some(i) = (0..got.len()).find(|&i| got[i] != want.output[i]) {
            panic!("{what}: output byte {i} of {}: got {:#04x}, expected {:#04x}", got.len(), got[i], want.output[i]);
        }
    }
    assert_eq!(at, output.len(), "the driver wrote more than the cases asked for");
}

#[test]
fn spare_weight_kernels_match_the_reference_under_cpu_emulation() {
    let mut rng = StdRng::seed_from_u64(90);
    let mut cases = fill_cases(&mut rng);
    cases.extend(fold_cases(&mut rng));
    let mut input = Vec::new();
    cases.iter().for_each(|c| put_case(&mut input, c));
    let exe = common::emulation::build(
        "echo_weights_emulator",
        &["csrc/echo/echo_weights.cu"],
        "tests/emulation/echo_weights_driver.cpp",
    );
    common::emulation::run_case_file(&exe, "echo_weights_emulated", &input, cases.len(), |output, order| {
        check_output(output, &cases, order)
    });
}
