//! Micro view of the grouped GEMM: GPU time per launch (CUDA events, `iter_custom`) for a few
//! shapes, eager. The report binary (`capmoe-bench`) gives the full comparison table.

use std::sync::Arc;
use std::time::Duration;

use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use criterion::{criterion_group, criterion_main, Criterion};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Random non-zero bf16 (|x| in [0.05, 1), random sign), as capmoe-bench's `measure::random_bf16`
/// draws them (that one lives in the binary crate): one random host block tiled over the buffer.
fn random_bf16(stream: &Arc<CudaStream>, len: usize, seed: u64) -> CudaSlice<bf16> {
    const BLOCK: usize = 1 << 22;
    let mut rng = StdRng::seed_from_u64(seed);
    let block: Vec<bf16> = (0..BLOCK.min(len))
        .map(|_| {
            let x: f32 = rng.random_range(0.05..1.0);
            bf16::from_f32(if rng.random_bool(0.5) { x } else { -x })
        })
        .collect();
    let mut buf = stream.alloc_zeros::<bf16>(len).unwrap();
    for at in (0..len).step_by(BLOCK) {
        let n = BLOCK.min(len - at);
        stream.memcpy_htod(&block[..n], &mut buf.slice_mut(at..at + n)).unwrap();
    }
    buf
}

fn bench(c: &mut Criterion) {
    let Ok(ctx) = capturable_moe::device::open(0) else {
        println!("skipping: no usable GPU");
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let mut group = c.benchmark_group("grouped_gemm");
    for (name, op, experts, rows, k, n) in [
        ("qwen3moe_fc1_fprop", GemmOp::Fprop, 128, 32768, 2048, 1536),
        ("qwen3moe_fc1_dgrad", GemmOp::Dgrad, 128, 32768, 2048, 1536),
        ("qwen3moe_fc1_wgrad", GemmOp::Wgrad, 128, 32768, 2048, 1536),
        ("decode_fc1_fprop", GemmOp::Fprop, 64, 1024, 2048, 2816),
    ] {
        let spec = GroupedGemmSpec::new(op, experts, n, k, rows);
        let plan = GroupedGemm::new(spec.clone(), &stream).unwrap();
        let (a_len, b_len, d_len) = spec.operand_lens();
        // Random non-zero operands, as in capmoe-bench: constant data toggles fewer bits, draws
        // less power and can hold higher clocks than real activations and weights.
        let a = random_bf16(&stream, a_len, 1);
        let b = random_bf16(&stream, b_len, 2);
        let mut d = stream.alloc_zeros::<bf16>(d_len).unwrap();
        let splits = stream.clone_htod(&vec![(rows / experts) as i32; experts]).unwrap();
        let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes()).unwrap();
        group.bench_function(name, |bencher| {
            bencher.iter_custom(|iters| {
                // NOTE: cudarc's default event flags disable timing.
                let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
                let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
                start.record(&stream).unwrap();
                for _ in 0..iters {
                    plan.run(&stream, &a, &b, &mut d, &splits, None, &mut ws).unwrap();
                }
                end.record(&stream).unwrap();
                end.synchronize().unwrap();
                Duration::from_secs_f64(start.elapsed_ms(&end).unwrap() as f64 * 1e-3)
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
