//! Micro view of the grouped GEMM: GPU time per launch (CUDA events, `iter_custom`) for a few
//! shapes, eager. The report binary (`capmoe-bench`) gives the full comparison table.

use std::time::Duration;

use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use criterion::{criterion_group, criterion_main, Criterion};
use cudarc::driver::sys::CUevent_flags;
use half::bf16;

#[path = "../src/data.rs"]
mod data;
use data::random_bf16;

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
