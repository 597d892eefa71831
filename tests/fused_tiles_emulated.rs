//! The fused kernels' tile list without a GPU: `csrc/fused/tile_list.cuh` (warp 0 builds the
//! per-expert M-tile prefix from the device offsets, then every CTA locates its tiles), the
//! scheduling both `fc1_sm90.cu` and `swiglu_dgrad_sm90.cu` run, compiled as host C++ against
//! the CPU emulation of `tests/emulation/` and driven by `tests/emulation/tile_list_driver.cpp`.
//! Checked against the contract written out below: expert e owns rows [offsets[e],
//! offsets[e + 1]) clamped into [0, capacity]; its tiles are ceil(rows / 128) M tiles per
//! column slice (for SM90_COUNTER's list: one fewer for experts of 2 to 8 tiles where that
//! many hold the rows at up to 128 + 16 each, those rows spread evenly over the tiles), the M
//! tiles of one slice consecutive, experts in order; every (row, slice) of
//! the clamped rows lands in exactly one tile, no tile holds a row of another expert, and the
//! count stays within the host bound that sizes the grid. Empty experts, a negative first
//! offset, offsets past capacity, 1 to 1024 experts (up to 32 per lane of the building warp),
//! grids smaller and larger than the tile count, both thread orders. Also the fused fc1's tile
//! schedule (`csrc/fused/tile_schedule.cuh`): the hand-out of tiles from a device counter and
//! its reset at the end of each launch.
//!
//! Also the quad exchange of the sm_90a epilogues' 16-byte stores (`fused_quad_exchange_emulated`).
//!
//! Needs a C++17 compiler (`CXX`, default `c++`); ~2 s.

mod common;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TILE: i64 = 128;
/// `kCounterTailRows` (csrc/grouped_gemm/counter.h): rows an SM90_COUNTER tile holds past 128.
const COUNTER_TAIL: i64 = 16;

#[derive(Clone, Debug)]
struct Case {
    capacity: i64,
    slices: i64,
    blocks: i64,
    threads: i64,
    /// Rows past 128 a tile may hold: 0 (the fused kernels) or COUNTER_TAIL.
    tail: i64,
    offsets: Vec<i64>,
}

impl Case {
    fn experts(&self) -> usize {
        self.offsets.len() - 1
    }

    fn write(&self, out: &mut Vec<u8>) {
        for v in [self.experts() as i64, self.capacity, self.slices, self.blocks, self.threads, self.tail] {
            out.extend(v.to_le_bytes());
        }
        for v in &self.offsets {
            out.extend(v.to_le_bytes());
        }
    }
}

/// The contract: (expert, row0, rows, n0) of every tile in order, the M-tile prefix and the
/// clamped row starts.
struct Expected {
    prefix: Vec<i64>,
    row_start: Vec<i64>,
    tiles: Vec<[i64; 4]>,
}

fn expected(c: &Case) -> Expected {
    let clamp = |o: i64| o.clamp(0, c.capacity);
    let e = c.experts();
    let mut prefix = vec![0i64; e + 1];
    let mut row_start = vec![0i64; e + 1];
    let mut tiles = Vec::new();
    for x in 0..e {
        let (start, end) = (clamp(c.offsets[x]), clamp(c.offsets[x + 1]));
        let rows = (end - start).max(0);
        let whole = (rows + TILE - 1) / TILE;
        let absorbs = (2..=8).contains(&whole) && rows <= (whole - 1) * (TILE + c.tail);
        let m_tiles = if absorbs { whole - 1 } else { whole };
        row_start[x] = start;
        prefix[x + 1] = prefix[x] + m_tiles;
        for slice in 0..c.slices {
            let mut row0 = start;
            for m in 0..m_tiles {
                let rows = if absorbs {
                    // Tiles with tails: spread evenly, the first rows % m_tiles one row longer.
                    rows / m_tiles + i64::from(m < rows % m_tiles)
                } else {
                    TILE.min(end - row0)
                };
                tiles.push([x as i64, row0, rows, slice * TILE]);
                row0 += rows;
            }
        }
    }
    row_start[e] = clamp(c.offsets[e]);
    Expected { prefix, row_start, tiles }
}

/// Property checks independent of the enumeration above: each (row, slice) of every expert's
/// clamped rows covered once, by a tile of that expert.
fn check_coverage(what: &str, c: &Case, tiles: &[[i64; 4]]) {
    let clamp = |o: i64| o.clamp(0, c.capacity);
    let mut owner = vec![-1i64; c.capacity as usize];
    for x in 0..c.experts() {
        for r in clamp(c.offsets[x])..clamp(c.offsets[x + 1]).max(clamp(c.offsets[x])) {
            owner[r as usize] = x as i64;
        }
    }
    let mut seen = vec![0u8; (c.capacity * c.slices) as usize];
    for (i, &[x, row0, rows, n0]) in tiles.iter().enumerate() {
        assert!(
            (1..=TILE + c.tail).contains(&rows) && n0 % TILE == 0 && n0 / TILE < c.slices,
            "{what}: tile {i} {:?}",
            tiles[i]
        );
        for r in row0..row0 + rows {
            assert_eq!(owner[r as usize], x, "{what}: tile {i} holds row {r} of another expert");
            seen[(r * c.slices + n0 / TILE) as usize] += 1;
        }
    }
    for r in 0..c.capacity {
        for s in 0..c.slices {
            let want = u8::from(owner[r as usize] >= 0);
            assert_eq!(seen[(r * c.slices + s) as usize], want, "{what}: row {r}, slice {s}");
        }
    }
}

fn read_i64(bytes: &[u8], at: &mut usize) -> i64 {
    let v = i64::from_le_bytes(bytes[*at..*at + 8].try_into().unwrap());
    *at += 8;
    v
}

/// Offsets of `e` experts with `counts` rows each, starting at `start`.
fn offsets_of(start: i64, counts: &[i64]) -> Vec<i64> {
    let mut o = vec![start];
    for c in counts {
        o.push(o.last().unwrap() + c);
    }
    o
}

fn cases() -> Vec<(String, Case)> {
    let mut rng = StdRng::seed_from_u64(21);
    let mut out = Vec::new();
    let mut add = |name: String, capacity: i64, slices: i64, blocks: i64, threads: i64, offsets: Vec<i64>| {
        for tail in [0, COUNTER_TAIL] {
            let case = Case { capacity, slices, blocks, threads, tail, offsets: offsets.clone() };
            out.push((format!("{name}, tail {tail}"), case));
        }
    };
    add("one expert, one row".into(), 1, 1, 1, 32, vec![0, 1]);
    add("one expert, every row, 6 slices".into(), 1000, 6, 7, 64, vec![0, 1000]);
    add("no rows at all".into(), 512, 6, 3, 32, vec![0; 9]);
    add("empty experts between".into(), 700, 2, 5, 64, offsets_of(0, &[0, 129, 0, 0, 128, 1, 0, 255, 0]));
    add("offsets past capacity, negative start".into(), 300, 2, 4, 32, vec![-5, 0, 120, 250, 10_000]);
    add("first expert starts mid-buffer".into(), 600, 1, 3, 32, offsets_of(37, &[100, 300, 5]));
    // Around the tail's edges: 128 + 15 / 16 / 17 rows, 256 + 1, 16 alone, 2 x 144 and one
    // more, 7 x 144 and 8 x 128 + 1 (9 tiles: not absorbed); 150 clamped from 160.
    let edges = [143, 144, 145, 257, 16, 288, 0, 289, 1008, 1025];
    add("tails at their edges".into(), 4000, 3, 4, 64, offsets_of(0, &edges));
    add("a tail cut by the capacity".into(), 150, 2, 2, 32, vec![0, 160]);
    for (i, &e) in [7usize, 33, 64, 128, 1000, 1024].iter().enumerate() {
        let counts: Vec<i64> = (0..e)
            .map(|_| match rng.random_range(0..7) {
                0 => 0,
                1 => rng.random_range(1..4),
                2 => 128,
                3 => rng.random_range(120..300),
                4 => 128 * rng.random_range(1..9) + rng.random_range(1..40),
                _ => rng.random_range(1..80),
            })
            .collect();
        let total: i64 = counts.iter().sum();
        // Half the cases clamp: capacity below the routed rows.
        let capacity = if i % 2 == 0 { total.max(1) } else { (total * 3 / 4).max(1) };
        let slices = [1, 6, 11][i % 3];
        let blocks = [1, 132, 700][i % 3];
        add(
            format!("E = {e}, capacity {capacity} of {total} rows, {slices} slices, {blocks} blocks"),
            capacity,
            slices,
            blocks,
            64,
            offsets_of(0, &counts),
        );
    }
    out
}

#[test]
fn fused_tile_list_emulated() {
    let cases = cases();
    let mut input = Vec::new();
    for (_, c) in &cases {
        c.write(&mut input);
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let cases_file = dir.join("fused_tiles_cases.bin");
    let out_file = dir.join("fused_tiles_out.bin");
    std::fs::write(&cases_file, &input).unwrap();
    let exe = common::emulation::build("fused_tiles_emulated", &[], "tests/emulation/tile_list_driver.cpp");
    for order in common::emulation::THREAD_ORDERS {
        let report = common::emulation::run(&exe, &[&cases_file, &out_file], order);
        assert_eq!(report.trim(), format!("{} cases", cases.len()), "{order}");
        let bytes = std::fs::read(&out_file).unwrap();
        let mut at = 0;
        for (name, c) in &cases {
            let what = format!("{name} ({order} thread order)");
            let want = expected(c);
            let bound = read_i64(&bytes, &mut at);
            let total = read_i64(&bytes, &mut at);
            let prefix: Vec<i64> = (0..=c.experts()).map(|_| read_i64(&bytes, &mut at)).collect();
            let row_start: Vec<i64> = (0..=c.experts()).map(|_| read_i64(&bytes, &mut at)).collect();
            let tiles: Vec<[i64; 4]> = (0..total).map(|_| [0; 4].map(|_| read_i64(&bytes, &mut at))).collect();
            assert_eq!(prefix, want.prefix, "{what}: tile prefix");
            assert_eq!(row_start, want.row_start, "{what}: row starts");
            assert_eq!(total as usize, want.tiles.len(), "{what}: tile count");
            assert!(total <= bound, "{what}: {total} tiles past the host bound {bound}");
            for (i, (got, want)) in tiles.iter().zip(&want.tiles).enumerate() {
                assert_eq!(got, want, "{what}: tile {i} (expert, row0, rows, n0)");
            }
            check_coverage(&what, c, &tiles);
        }
        assert_eq!(at, bytes.len(), "{order}: output length");
    }
}

/// The sm_90a fused epilogues' 16-byte stores (`csrc/fused/quad_store.cuh`): after the quad
/// exchange every lane holds one whole 8-column group of its row, each pair lands at its own
/// columns exactly once, and two exchanges give back the input (the dgrad's 16-byte h loads
/// undo the exchange with the same call). `tests/emulation/quad_store_driver.cpp`.
#[test]
fn fused_quad_exchange_emulated() {
    assert_driver_finds_no_mismatch("fused_quad_store_emulated", "tests/emulation/quad_store_driver.cpp");
}

/// The fused fc1's tile schedule (`csrc/fused/tile_schedule.cuh`): launch after launch on the
/// same two words, every tile handed out once, every block stopped, and the words zero again
/// at the end of each launch. `tests/emulation/tile_schedule_driver.cpp`.
#[test]
fn fused_tile_schedule_emulated() {
    assert_driver_finds_no_mismatch("fused_tile_schedule_emulated", "tests/emulation/tile_schedule_driver.cpp");
}

/// Builds a self-checking emulation driver (no input file) and runs it in both thread orders:
/// it must report exactly "0 mismatches".
fn assert_driver_finds_no_mismatch(name: &str, driver: &str) {
    let exe = common::emulation::build(name, &[], driver);
    for order in common::emulation::THREAD_ORDERS {
        let report = common::emulation::run(&exe, &[], order);
        assert_eq!(report.trim(), "0 mismatches", "{name}: {order} thread order");
    }
}
