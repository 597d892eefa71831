//! Host-only checks of the graph module: the pool's size arithmetic (granularity rounding,
//! aligned bump allocation, physical growth = max over ranges), the typed errors, and the
//! decoding of update failures. The GPU side is tests/graph_gpu.rs.

use capturable_moe::graph::{round_up, update_failure, BumpCursor, CaptureOptions, PhysicalLayout, POOL_ALIGNMENT};
use capturable_moe::Error;
use cudarc::driver::sys::CUgraphExecUpdateResult;

const MIB2: usize = 2 << 20; // the usual minimum granularity

#[test]
fn round_up_hits_multiples_and_reports_overflow_host() {
    assert_eq!(round_up(0, MIB2), Some(0));
    assert_eq!(round_up(1, MIB2), Some(MIB2));
    assert_eq!(round_up(MIB2, MIB2), Some(MIB2));
    assert_eq!(round_up(MIB2 + 1, MIB2), Some(2 * MIB2));
    assert_eq!(round_up(255, 256), Some(256));
    assert_eq!(round_up(usize::MAX - 3, 256), None);
}

/// Buffers start at 256-byte multiples, never overlap, and a buffer past the reserve is
/// `PoolExhausted` with the cursor left where it was.
#[test]
fn bump_cursor_aligns_and_stops_at_the_reserve_host() {
    let mut c = BumpCursor::new(4096);
    let a = c.take("t", 10, POOL_ALIGNMENT).unwrap();
    let b = c.take("t", 300, POOL_ALIGNMENT).unwrap();
    let z = c.take("t", 0, POOL_ALIGNMENT).unwrap(); // an empty buffer still gets its own byte
    assert_eq!((a, b, z), (0, 256, 768));
    assert_eq!(c.used, 769);
    let before = c;
    match c.take("t", 4096, POOL_ALIGNMENT) {
        Err(Error::PoolExhausted { op: "t", need: 4096, used: 769, reserve: 4096 }) => {}
        other => panic!("expected PoolExhausted, got {other:?}"),
    }
    assert_eq!(c, before);
    assert_eq!(c.take("t", 4096 - 1024, POOL_ALIGNMENT).unwrap(), 1024);
    assert!(c.take("t", 1, POOL_ALIGNMENT).is_err(), "the reserve is full");
}

/// Growth adds one granularity-rounded chunk per shortfall, chunks tile `[0, bytes)`, and
/// nothing is added while the need is covered.
#[test]
fn physical_layout_grows_by_granularity_rounded_chunks_host() {
    let mut layout = PhysicalLayout::new(MIB2);
    assert_eq!(layout.growth_for(0), None);
    let first = layout.growth_for(1).unwrap();
    assert_eq!(first, (0, MIB2));
    layout.chunks.push(first);
    assert_eq!(layout.growth_for(MIB2), None);
    let second = layout.growth_for(5 * MIB2 + 7).unwrap();
    assert_eq!(second, (MIB2, 5 * MIB2));
    layout.chunks.push(second);
    assert_eq!(layout.bytes(), 6 * MIB2);
}

/// What `PoolRange::alloc` does, over eight ranges of token-bucket sizes: the physical bytes
/// end at the largest range's use rounded up to the granularity (max, not sum), whatever order
/// the ranges allocate in.
#[test]
fn physical_bytes_are_the_max_over_ranges_not_the_sum_host() {
    // Bytes of the eight activation buffers per bucket, Qwen3-30B-A3B-like (H 2048, F 768,
    // k 8, bf16): (4H + 6F) * 2 bytes per routed row.
    let per_row = (4 * 2048 + 6 * 768) * 2;
    let buckets = [128usize, 256, 512, 1024, 2048, 4096, 8192, 16384];
    let sizes: Vec<Vec<usize>> =
        buckets.iter().map(|t| [2048, 1536, 768, 2048, 2048, 768, 1536, 2048].iter().map(|w| t * 8 * w * 2).collect()).collect();
    for order in [vec![0, 1, 2, 3, 4, 5, 6, 7], vec![7, 0, 6, 1, 5, 2, 4, 3]] {
        let mut layout = PhysicalLayout::new(MIB2);
        let mut used = [0usize; 8];
        for &r in &order {
            let mut cursor = BumpCursor::new(usize::MAX / 2);
            for &bytes in &sizes[r] {
                cursor.take("t", bytes, POOL_ALIGNMENT).unwrap();
                if let Some(chunk) = layout.growth_for(cursor.used) {
                    layout.chunks.push(chunk);
                }
            }
            used[r] = cursor.used;
        }
        let largest = *used.iter().max().unwrap();
        assert_eq!(largest, buckets[7] * 8 * per_row);
        assert_eq!(layout.bytes(), round_up(largest, MIB2).unwrap());
        let sum: usize = used.iter().sum();
        assert!(layout.bytes() * 19 / 10 < sum, "max {} vs sum {sum}", layout.bytes());
    }
}

#[test]
fn graph_errors_say_what_to_do_host() {
    let e = Error::Capturing { op: "MoeExperts::new" }.to_string();
    assert!(e.starts_with("MoeExperts::new needs the host") && e.contains("before begin_capture"), "{e}");
    let e = Error::PoolExhausted { op: "PoolRange::alloc", need: 10, used: 20, reserve: 24 }.to_string();
    assert!(e.contains("larger range_bytes") && e.contains("10") && e.contains("24"), "{e}");
    let e = Error::GraphUpdate { why: update_failure(CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED) };
    assert!(e.to_string().contains("topology"), "{e}");
}

#[test]
fn every_update_failure_is_named_host() {
    use CUgraphExecUpdateResult as R;
    for r in [
        R::CU_GRAPH_EXEC_UPDATE_ERROR,
        R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED,
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED,
        R::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED,
        R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED,
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED,
        R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE,
        R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED,
    ] {
        let why = update_failure(r);
        assert!(why.contains(&format!("{r:?}")) && !why.starts_with("no failure"), "{why}");
    }
}

/// `capture` uploads by default: the first replay then costs what the later ones do.
#[test]
fn capture_uploads_by_default_host() {
    assert!(CaptureOptions::default().upload);
}
