//! The EP group's NCCL transport on the GPU. R = 1 with real NCCL on one GPU: every collective
//! (all_gather, exchange, exchange_many, broadcast_block) bit-exact against its reference, made
//! by each constructor; the same step captured in one CUDA graph and replayed 100 times with
//! new inputs; the refusals (short buffers, another stream, another group's part, two ranks on
//! one GPU, construction while capturing). R > 1, eager: `single_process` over every visible
//! GPU, and one thread per GPU joining through the id file (both skipped, saying so, with
//! fewer than two GPUs).
//!
//! Every receive buffer is poisoned before each run and has a poisoned tail past what the
//! collective may write; every element is checked bit for bit (NaN payloads included: the
//! inputs are random bits). Without libnccl the tests print `skipping: libnccl not found`;
//! with `CAPMOE_REQUIRE_NCCL=1` (scripts/gpu-run.sh sets it where it finds libnccl) they fail
//! instead.
#![cfg(feature = "nccl")]

mod common;

use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use bytemuck::Pod;
use capturable_moe::ep::{nccl_group, EpGroup, EpGroupId};
use capturable_moe::graph::capture;
use capturable_moe::Error;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use half::bf16;
use rand::{rngs::StdRng, RngCore, SeedableRng};

/// The tests of this binary run one at a time (also under a plain `cargo test`): the capture
/// tests capture in global mode, which forbids allocations and syncs on other threads while a
/// capture is open.
fn serial() -> MutexGuard<'static, ()> {
    common::CAPTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The GPU stream, or returns from the test after printing why (no GPU, no libnccl).
macro_rules! nccl_gpu_or_skip {
    () => {{
        let stream = gpu_or_skip!();
        if !common::nccl::nccl_present() {
            return;
        }
        stream
    }};
}

/// Elements past what a collective may write, checked to stay poisoned.
const TAIL: usize = 5;
const POISON_BYTE: u8 = 0xA5;

/// The sizes of one step: E counts per rank, `cap` rows of H per peer block, and a spare-slot
/// gradient block of `grad` fp32.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    experts: usize,
    cap: usize,
    hidden: usize,
    grad: usize,
}

/// Odd sizes on purpose (no power-of-two block hides an offset error).
const SIZES: Sizes = Sizes { experts: 256, cap: 333, hidden: 2048, grad: 4099 };

/// Sizes of the threaded test, where every thread builds every rank's inputs.
const SMALL: Sizes = Sizes { experts: 64, cap: 37, hidden: 256, grad: 129 };

fn random_bits<T: Pod>(rng: &mut StdRng, n: usize) -> Vec<T> {
    let mut bytes = vec![0u8; n * std::mem::size_of::<T>()];
    rng.fill_bytes(&mut bytes);
    bytemuck::pod_collect_to_vec(&bytes)
}

fn poison<T: Pod>(n: usize) -> Vec<T> {
    bytemuck::pod_collect_to_vec(&vec![POISON_BYTE; n * std::mem::size_of::<T>()])
}

/// `got` equals `want` bit for bit on `want.len()` elements, and the rest of `got` is poison.
fn assert_bits_then_poison<T: Pod>(what: &str, got: &[T], want: &[T]) {
    let size = std::mem::size_of::<T>();
    let (got_bytes, want_bytes) = (bytemuck::cast_slice::<T, u8>(got), bytemuck::cast_slice::<T, u8>(want));
    assert!(got.len() >= want.len(), "{what}: {} elements read back, want {}", got.len(), want.len());
    if let Some(i) = (0..want_bytes.len()).find(|&i| got_bytes[i] != want_bytes[i]) {
        panic!(
            "{what}: element {} of {} differs (byte {i}: got {:#04x}, want {:#04x})",
            i / size,
            want.len(),
            got_bytes[i],
            want_bytes[i]
        );
    }
    if let Some(i) = (want_bytes.len()..got_bytes.len()).find(|&i| got_bytes[i] != POISON_BYTE) {
        panic!("{what}: element {} past the {} written was overwritten", i / size, want.len());
    }
}

/// One rank's send buffers of a step, random bits from a seed (so any thread can rebuild any
/// rank's inputs to make its references).
struct Inputs {
    counts: Vec<i64>,
    rows: Vec<bf16>,
    ids: Vec<i32>,
    probs: Vec<f32>,
    back: Vec<bf16>,
    grads: Vec<f32>,
}

impl Inputs {
    fn random(s: Sizes, ranks: usize, seed: u64) -> Inputs {
        let rng = &mut StdRng::seed_from_u64(seed);
        let rows = ranks * s.cap * s.hidden;
        Inputs {
            counts: random_bits(rng, s.experts),
            rows: random_bits(rng, rows),
            ids: random_bits(rng, ranks * s.cap),
            probs: random_bits(rng, ranks * s.cap),
            back: random_bits(rng, rows),
            grads: random_bits(rng, s.grad),
        }
    }
}

/// A send buffer and a receive buffer of `recv_len + TAIL` elements.
struct Pair<T: DeviceRepr> {
    send: CudaSlice<T>,
    recv: CudaSlice<T>,
}

impl<T: DeviceRepr + Pod> Pair<T> {
    fn new(stream: &Arc<CudaStream>, send_len: usize, recv_len: usize) -> Pair<T> {
        Pair {
            send: stream.clone_htod(&poison::<T>(send_len)).unwrap(),
            recv: stream.clone_htod(&poison::<T>(recv_len + TAIL)).unwrap(),
        }
    }

    /// `input` into the send buffer and poison into the receive buffer, enqueued on `stream`.
    fn load(&mut self, stream: &Arc<CudaStream>, input: &[T]) {
        assert_eq!(input.len(), self.send.len());
        stream.memcpy_htod(input, &mut self.send).unwrap();
        stream.memcpy_htod(&poison::<T>(self.recv.len()), &mut self.recv).unwrap();
    }

    fn received(&self, stream: &Arc<CudaStream>) -> Vec<T> {
        stream.clone_dtoh(&self.recv).unwrap()
    }
}

/// One rank's buffers of a step: the counts all-gather, the dispatch exchange of rows + ids +
/// probs (one NCCL group), the combine exchange of rows back, the spare-gradient broadcast.
struct RankIo {
    stream: Arc<CudaStream>,
    ranks: usize,
    sizes: Sizes,
    counts: Pair<i64>,
    rows: Pair<bf16>,
    ids: Pair<i32>,
    probs: Pair<f32>,
    back: Pair<bf16>,
    grads: Pair<f32>,
}

impl RankIo {
    fn new(stream: &Arc<CudaStream>, ranks: usize, s: Sizes) -> RankIo {
        let rows = ranks * s.cap * s.hidden;
        RankIo {
            stream: stream.clone(),
            ranks,
            sizes: s,
            counts: Pair::new(stream, s.experts, ranks * s.experts),
            rows: Pair::new(stream, rows, rows),
            ids: Pair::new(stream, ranks * s.cap, ranks * s.cap),
            probs: Pair::new(stream, ranks * s.cap, ranks * s.cap),
            back: Pair::new(stream, rows, rows),
            grads: Pair::new(stream, s.grad, ranks * s.grad),
        }
    }

    fn load(&mut self, inputs: &Inputs) {
        let stream = self.stream.clone();
        self.counts.load(&stream, &inputs.counts);
        self.rows.load(&stream, &inputs.rows);
        self.ids.load(&stream, &inputs.ids);
        self.probs.load(&stream, &inputs.probs);
        self.back.load(&stream, &inputs.back);
        self.grads.load(&stream, &inputs.grads);
    }

    /// Every collective of the step, on `group` (this rank's).
    fn enqueue(&mut self, group: &EpGroup) -> capturable_moe::Result<()> {
        let (s, stream) = (self.sizes, self.stream.clone());
        let row_block = s.cap * s.hidden;
        group.all_gather(&stream, &self.counts.send, &mut self.counts.recv, s.experts)?;
        group.exchange_many(
            &stream,
            &[
                group.blocks(&self.rows.send, &mut self.rows.recv, row_block)?,
                group.blocks(&self.ids.send, &mut self.ids.recv, s.cap)?,
                group.blocks(&self.probs.send, &mut self.probs.recv, s.cap)?,
            ],
        )?;
        group.exchange(&stream, &self.back.send, &mut self.back.recv, row_block)?;
        group.broadcast_block(&stream, &self.grads.send, &mut self.grads.recv, s.grad)
    }

    /// This rank's (`p`) receive buffers against the references built from every rank's
    /// inputs: all_gather concatenates, an exchange puts block p of rank q's send buffer into
    /// block q, broadcast_block puts rank q's whole send buffer into block q.
    fn check(&self, what: &str, p: usize, all: &[Inputs]) {
        assert_eq!(self.ranks, all.len());
        let (s, stream) = (self.sizes, &self.stream);
        let row_block = s.cap * s.hidden;
        let check = |name: &str, got: Vec<u8>, want: Vec<u8>| {
            assert_bits_then_poison(&format!("{what}: rank {p} {name}"), &got, &want)
        };
        let concat = |pick: &dyn Fn(&Inputs) -> Vec<u8>| -> Vec<u8> { all.iter().flat_map(pick).collect() };
        let block = |pick: &dyn Fn(&Inputs) -> Vec<u8>, elems: usize, size: usize| -> Vec<u8> {
            let bytes = elems * size;
            all.iter().flat_map(|q| pick(q)[p * bytes..(p + 1) * bytes].to_vec()).collect()
        };
        check("counts (all_gather)", bytes(&self.counts.received(stream)), concat(&|q| bytes(&q.counts)));
        check("rows (exchange_many)", bytes(&self.rows.received(stream)), block(&|q| bytes(&q.rows), row_block, 2));
        check("ids (exchange_many)", bytes(&self.ids.received(stream)), block(&|q| bytes(&q.ids), s.cap, 4));
        check("probs (exchange_many)", bytes(&self.probs.received(stream)), block(&|q| bytes(&q.probs), s.cap, 4));
        check("back rows (exchange)", bytes(&self.back.received(stream)), block(&|q| bytes(&q.back), row_block, 2));
        check("grads (broadcast_block)", bytes(&self.grads.received(stream)), concat(&|q| bytes(&q.grads)));
    }
}

/// Every rank's receive buffers checked ([`RankIo::check`]).
fn check_step(what: &str, ios: &[RankIo], inputs: &[Inputs]) {
    for (p, io) in ios.iter().enumerate() {
        io.check(what, p, inputs);
    }
}

fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice::<T, u8>(v).to_vec()
}

fn r1_group(stream: &Arc<CudaStream>) -> EpGroup {
    EpGroup::from_id(stream, 0, 1, EpGroupId::new().unwrap()).unwrap()
}

/// One eager step on R = 1, loaded, run and checked.
fn eager_step_r1(what: &str, group: &EpGroup, seed: u64) {
    let stream = group.stream().clone();
    let mut io = RankIo::new(&stream, 1, SIZES);
    let inputs = [Inputs::random(SIZES, 1, seed)];
    io.load(&inputs[0]);
    io.enqueue(group).unwrap();
    check_step(what, &[io], &inputs);
}

// ---------------------------------------------------------------- R = 1, eager

#[test]
fn r1_every_collective_is_bit_exact_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let group = r1_group(&stream);
    let desc = group.desc();
    assert_eq!((desc.rank, desc.ranks, group.rank(), group.ranks()), (0, 1, 0, 1));
    assert_eq!(desc.device, stream.context().ordinal());
    assert!(desc.nccl_version >= 20900, "NCCL {} is older than 2.9 (no CUDA graph support)", desc.nccl_version);
    println!("NCCL version code {}", desc.nccl_version);
    for seed in 0..3 {
        eager_step_r1(&format!("from_id, step {seed}"), &group, seed);
    }
}

#[test]
fn r1_from_id_file_makes_the_group_and_removes_the_file_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let path = std::env::temp_dir().join(format!("capmoe-ep-gpu-{}.id", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let group = EpGroup::from_id_file(&stream, 0, 1, &path, Duration::from_secs(10)).unwrap();
    assert!(!path.exists(), "rank 0 left the id file {} behind", path.display());
    eager_step_r1("from_id_file", &group, 7);
}

#[test]
fn r1_single_process_of_one_gpu_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let groups = EpGroup::single_process(std::slice::from_ref(&stream)).unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!((groups[0].rank(), groups[0].ranks()), (0, 1));
    eager_step_r1("single_process(1)", &groups[0], 8);
}

/// Zero-sized collectives are no-ops that write nothing (a rank with no spare slots, E = 0).
#[test]
fn r1_empty_blocks_write_nothing_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let group = r1_group(&stream);
    let send = stream.clone_htod(&[1.0f32; 4]).unwrap();
    let mut recv = stream.clone_htod(&poison::<f32>(4)).unwrap();
    group.all_gather(&stream, &send, &mut recv, 0).unwrap();
    group.exchange(&stream, &send, &mut recv, 0).unwrap();
    group.broadcast_block(&stream, &send, &mut recv, 0).unwrap();
    let mut ids = stream.clone_htod(&poison::<i32>(4)).unwrap();
    let ids_send = stream.clone_htod(&[3i32; 4]).unwrap();
    group
        .exchange_many(
            &stream,
            &[group.blocks(&send, &mut recv, 0).unwrap(), group.blocks(&ids_send, &mut ids, 1).unwrap()],
        )
        .unwrap();
    assert_bits_then_poison("empty collectives", &stream.clone_dtoh(&recv).unwrap(), &[]);
    // The non-empty part of the same exchange_many still moved.
    assert_bits_then_poison("ids beside an empty part", &stream.clone_dtoh(&ids).unwrap(), &[3i32]);
}

// ---------------------------------------------------------------- R = 1, captured

/// The whole step captured once (after an eager warm-up, which makes NCCL's connections) and
/// replayed 100 times with new inputs, each replay checked in full.
#[test]
fn r1_captured_step_replays_with_new_inputs_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let group = r1_group(&stream);
    let mut io = RankIo::new(&stream, 1, SIZES);
    let inputs = [Inputs::random(SIZES, 1, 100)];
    io.load(&inputs[0]);
    io.enqueue(&group).unwrap();
    check_step("eager warm-up", std::slice::from_ref(&io), &inputs);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || io.enqueue(&group)).unwrap();
    let replays = if common::under_sanitizer() { 5 } else { 100 };
    for i in 0..replays {
        let inputs = [Inputs::random(SIZES, 1, 101 + i)];
        io.load(&inputs[0]);
        graph.launch().unwrap();
        check_step(&format!("replay {i}"), std::slice::from_ref(&io), &inputs);
    }
}

// ---------------------------------------------------------------- refusals

#[test]
fn refuses_short_buffers_and_another_stream_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let group = r1_group(&stream);
    let send = stream.clone_htod(&[0u32; 8]).unwrap();
    let mut recv = stream.clone_htod(&[0u32; 8]).unwrap();
    let mut short = stream.clone_htod(&[0u32; 7]).unwrap();
    for result in [
        group.all_gather(&stream, &send, &mut short, 8),
        group.all_gather(&stream, &short, &mut recv, 8),
        group.exchange(&stream, &send, &mut short, 8),
        group.broadcast_block(&stream, &send, &mut short, 8),
        group.blocks(&short, &mut recv, 8).map(drop),
    ] {
        assert!(matches!(result, Err(Error::Shape { .. })), "{result:?}");
    }
    let other = stream.context().new_stream().unwrap();
    for result in [
        group.all_gather(&other, &send, &mut recv, 8),
        group.exchange(&other, &send, &mut recv, 8),
        group.broadcast_block(&other, &send, &mut recv, 1),
        group.exchange_many(&other, &[]),
    ] {
        assert!(matches!(result, Err(Error::WrongStream { .. })), "{result:?}");
    }
    // Nothing was enqueued by the refused calls: the buffers are as they were.
    assert_eq!(stream.clone_dtoh(&recv).unwrap(), vec![0u32; 8]);
}

#[test]
fn refuses_a_part_of_another_group_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let (a, b) = (r1_group(&stream), r1_group(&stream));
    let send = stream.clone_htod(&[1u8; 8]).unwrap();
    let mut recv = stream.clone_htod(&[0u8; 8]).unwrap();
    let parts = [b.blocks(&send, &mut recv, 8).unwrap()];
    let result = a.exchange_many(&stream, &parts);
    match result {
        Err(Error::InvalidArgument { why, .. }) => assert!(why.contains("another EpGroup"), "{why}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn refuses_two_ranks_on_one_gpu_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let second = stream.context().new_stream().unwrap();
    match EpGroup::single_process(&[stream.clone(), second]) {
        Err(Error::InvalidArgument { why, .. }) => assert!(why.contains("NCCL refuses"), "{why}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(matches!(EpGroup::single_process(&[]), Err(Error::InvalidArgument { .. })));
    assert!(matches!(EpGroup::from_id(&stream, 1, 1, EpGroupId::new().unwrap()), Err(Error::InvalidArgument { .. })));
}

/// Construction needs the host: refused while the stream captures, without touching the
/// capture (it stays active).
#[test]
fn construction_is_refused_while_capturing_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let id = EpGroupId::new().unwrap();
    unsafe { stream.context().disable_event_tracking() };
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    let from_id = EpGroup::from_id(&stream, 0, 1, id);
    let single = EpGroup::single_process(std::slice::from_ref(&stream));
    let status = stream.capture_status();
    let _ = stream.end_capture(CUgraphInstantiate_flags(0));
    unsafe { stream.context().enable_event_tracking() };
    assert!(matches!(from_id, Err(Error::Capturing { op: "EpGroup::from_id" })), "{from_id:?}");
    assert!(matches!(single, Err(Error::Capturing { op: "EpGroup::single_process" })), "{:?}", single.err());
    assert_eq!(status.unwrap(), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE);
}

// ---------------------------------------------------------------- R > 1 in one process

/// Every visible GPU as one rank of a `single_process` group; each step's collectives of all
/// ranks are enqueued from this thread inside one `nccl_group`, then checked on every rank.
#[test]
fn single_process_over_every_gpu_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let Some(gpus) = common::gpus_at_least(2, "single_process over several GPUs") else { return };
    drop(stream);
    let streams: Vec<Arc<CudaStream>> =
        (0..gpus).map(|i| capturable_moe::device::open(i).unwrap().new_stream().unwrap()).collect();
    let groups = EpGroup::single_process(&streams).unwrap();
    for (i, g) in groups.iter().enumerate() {
        assert_eq!((g.rank(), g.ranks(), g.desc().device), (i, gpus, streams[i].context().ordinal()));
    }
    let mut ios: Vec<RankIo> = streams.iter().map(|s| RankIo::new(s, gpus, SIZES)).collect();
    for step in 0..3 {
        let inputs: Vec<Inputs> =
            (0..gpus).map(|rank| Inputs::random(SIZES, gpus, 200 + 100 * step + rank as u64)).collect();
        ios.iter_mut().zip(&inputs).for_each(|(io, input)| io.load(input));
        nccl_group(|| {
            for (io, group) in ios.iter_mut().zip(&groups) {
                io.enqueue(group)?;
            }
            Ok(())
        })
        .unwrap();
        check_step(&format!("R = {gpus}, step {step}"), &ios, &inputs);
    }
}

/// One thread per GPU, each joining through the id file as a separate process would
/// (`from_id_file`: rank 0 writes, the others wait), then running steps eagerly on its own
/// and checking its own receive buffers against every rank's inputs, rebuilt from the seeds.
#[test]
fn threads_over_every_gpu_join_through_the_id_file_gpu() {
    let _serial = serial();
    let stream = nccl_gpu_or_skip!();
    let Some(gpus) = common::gpus_at_least(2, "one thread per GPU") else { return };
    drop(stream);
    let path = std::env::temp_dir().join(format!("capmoe-ep-threads-{}.id", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let threads: Vec<_> = (0..gpus)
        .map(|rank| {
            let path = path.clone();
            std::thread::spawn(move || {
                let stream = capturable_moe::device::open(rank).unwrap().new_stream().unwrap();
                let group = EpGroup::from_id_file(&stream, rank, gpus, &path, Duration::from_secs(60)).unwrap();
                assert_eq!((group.rank(), group.ranks()), (rank, gpus));
                let mut io = RankIo::new(&stream, gpus, SMALL);
                // NOTE: a rank that stopped at a failed check would leave its peers waiting in
                // the next step's transfers forever: every rank runs every step, then reports.
                let mut first_failure = None;
                for step in 0..3u64 {
                    let inputs: Vec<Inputs> =
                        (0..gpus).map(|q| Inputs::random(SMALL, gpus, 500 + 100 * step + q as u64)).collect();
                    io.load(&inputs[rank]);
                    io.enqueue(&group).unwrap();
                    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        io.check(&format!("thread R = {gpus}, step {step}"), rank, &inputs)
                    }));
                    if let Err(panic) = checked {
                        first_failure.get_or_insert(panic);
                    }
                }
                if let Some(panic) = first_failure {
                    std::panic::resume_unwind(panic);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(!path.exists(), "rank 0 left the id file behind");
}
