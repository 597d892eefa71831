//! [`EpGroup`]: one rank's NCCL communicator of an EP group, bound to one stream, and the
//! fixed-size collectives the EP step needs (all-gather of the counts, the block exchange of
//! dispatch / combine, the broadcast of spare-slot gradients).
//!
//! Every collective is enqueued on the group's stream with sizes fixed by the caller; none
//! synchronises, allocates or reads device data on the host, so all of them can be captured in
//! a CUDA graph and replayed (NCCL 2.9+ supports capture). Two things to know:
//! - NCCL connects a pair of ranks on their first transfer: run each collective once eagerly
//!   before capturing it (the graph then holds no connection setup).
//! - A graph that captured a collective uses the communicator on every replay: keep the
//!   [`EpGroup`] alive while such a graph may still be launched.
//!
//! Buffers move as bytes (`ncclUint8`): a block is `block` elements of `T`, any `DeviceRepr`.
//! Every rank must enqueue the same collectives with the same sizes, in the same order (NCCL's
//! rule; sizes fixed at plan time satisfy it). Transfers go through cudarc's NCCL bindings
//! (`cudarc::nccl::result`); the communicator is held raw so that every NCCL status becomes a
//! typed error instead of cudarc's panics.

mod id;
mod library;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys::CUdeviceptr, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};
use cudarc::nccl::{result, sys};

pub use id::{EpEnv, EpGroupId, EP_GROUP_ID_BYTES};
use library::nccl_error;
pub use library::nccl_version;

use crate::device::{ensure_bound_stream, ensure_buffer};
use crate::graph::ensure_not_capturing;
use crate::{Error, Result};

/// What an [`EpGroup`] was made for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpGroupDesc {
    /// This rank, `< ranks`.
    pub rank: usize,
    /// R, the ranks of the group.
    pub ranks: usize,
    /// The CUDA device ordinal of the group's stream.
    pub device: usize,
    /// The NCCL library's version code (`ncclGetVersion`: 22703 = 2.27.3).
    pub nccl_version: i32,
}

/// One rank of an EP group: an NCCL communicator bound to one stream (one GPU per rank).
///
/// Made by [`EpGroup::from_id`] (the id reached every rank by the caller's means),
/// [`EpGroup::from_id_file`] / [`EpGroup::from_env`] (one process per GPU, the id through a
/// file), or [`EpGroup::single_process`] (every rank in this process, one GPU each: tests,
/// benchmarks). Dropping it waits for its stream, then destroys the communicator.
#[derive(Debug)]
pub struct EpGroup {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    ranks: usize,
    nccl_version: i32,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `EpGroup` is
// not `Sync`, so its calls from several threads cannot overlap.
unsafe impl Send for EpGroup {}

impl Drop for EpGroup {
    fn drop(&mut self) {
        // NOTE: destroying a communicator with transfers in flight would abort them (or wait
        // on peers forever in ncclCommDestroy's finalize); let the stream finish first, and
        // abort only a communicator whose stream failed.
        let finished = self.stream.synchronize().is_ok();
        // SAFETY: the communicator is this group's own and is not used after this.
        unsafe {
            let _ = if finished { result::comm_destroy(self.comm) } else { result::comm_abort(self.comm) };
        }
    }
}

fn check_ranks(op: &'static str, rank: usize, ranks: usize) -> Result<()> {
    if ranks == 0 || ranks > i32::MAX as usize || rank >= ranks {
        return Err(Error::InvalidArgument {
            op,
            why: format!("rank {rank} of {ranks} ranks: need 1 <= ranks <= {} and rank < ranks", i32::MAX),
        });
    }
    Ok(())
}

/// `a * b` elements, or [`Error::InvalidArgument`] when that overflows.
fn elements(op: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::InvalidArgument { op, why: format!("{a} x {b} elements overflow usize") })
}

/// Runs `body` inside one NCCL group (`ncclGroupStart` / `ncclGroupEnd`): every collective it
/// enqueues, on any [`EpGroup`], is launched together when it returns.
///
/// For bare collectives only ([`EpGroup::all_gather`], [`EpGroup::exchange`],
/// [`EpGroup::exchange_many`], [`EpGroup::broadcast_block`]) where one thread drives several
/// ranks ([`EpGroup::single_process`]): each rank's collective waits for its peers, so
/// enqueueing them one after the other outside a group would deadlock. Groups nest (the
/// exchanges and `broadcast_block` open their own inside). The group is ended also when `body`
/// fails; its error is returned first.
///
/// NOT for [`super::EpMoe`] (or any sequence with kernels between collectives): inside the
/// group NCCL only records its calls until the outermost `ncclGroupEnd`, while kernels launch
/// at once, so a kernel that reads what a collective receives would read stale data. Drive an
/// `EpMoe` per rank from its own thread (one process per GPU, or a thread per rank over
/// `single_process`). `EpMoe::{dispatch, combine, backward}` return
/// [`Error::InvalidArgument`] when called inside `nccl_group` on the same thread.
///
/// NOTE: inside the group cudarc's event tracking records each buffer's "used here" event
/// before NCCL has launched the transfer; work on other streams of the same context that
/// reads those buffers must be ordered by the caller (the EP step runs on one stream, where
/// stream order is enough).
pub fn nccl_group<R>(body: impl FnOnce() -> Result<R>) -> Result<R> {
    nccl_version()?;
    result::group_start().map_err(|e| nccl_error("ep::nccl_group (ncclGroupStart)", e, None))?;
    let value = {
        let _depth = GroupDepth::enter();
        body()
    };
    let end = result::group_end().map_err(|e| nccl_error("ep::nccl_group (ncclGroupEnd)", e, None));
    let value = value?;
    end?;
    Ok(value)
}

thread_local! {
    /// How many [`nccl_group`] bodies this thread is inside.
    static GROUP_DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// One level of [`nccl_group`] on this thread, left on drop (also when the body panics).
struct GroupDepth;

impl GroupDepth {
    fn enter() -> GroupDepth {
        GROUP_DEPTH.with(|d| d.set(d.get() + 1));
        GroupDepth
    }
}

impl Drop for GroupDepth {
    fn drop(&mut self) {
        GROUP_DEPTH.with(|d| d.set(d.get() - 1));
    }
}

/// [`Error::InvalidArgument`] inside an [`nccl_group`] body of this thread: `op` runs kernels
/// on what its collectives receive, which an open NCCL group has not sent yet.
pub(crate) fn ensure_outside_nccl_group(op: &'static str) -> Result<()> {
    if GROUP_DEPTH.with(|d| d.get()) == 0 {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op,
        why: "called inside ep::nccl_group, where NCCL only records collectives until the group ends while kernels launch at once (they would read data not received yet); drive each rank's EpMoe from its own thread, outside nccl_group".into(),
    })
}

impl EpGroup {
    /// Joins the group with id `id` as rank `rank` of `ranks` (`ncclCommInitRank`, collective:
    /// it returns once every rank has called it with the same id). `stream`'s device is this
    /// rank's GPU. [`Error::Nccl`] when libnccl is missing or NCCL refuses (e.g. two ranks on
    /// one GPU), [`Error::Capturing`] while `stream` captures.
    pub fn from_id(stream: &Arc<CudaStream>, rank: usize, ranks: usize, id: EpGroupId) -> Result<EpGroup> {
        const OP: &str = "EpGroup::from_id";
        check_ranks(OP, rank, ranks)?;
        let nccl_version = nccl_version()?;
        ensure_not_capturing(stream, OP)?;
        // NCCL takes the rank's device from the thread's current one.
        stream.context().bind_to_thread()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: one out pointer; rank and ranks fit in c_int (check_ranks).
        unsafe { result::comm_init_rank(&mut comm, ranks as i32, id.to_nccl(), rank as i32) }
            .map_err(|e| nccl_error(OP, e, None))?;
        Ok(EpGroup { comm, stream: stream.clone(), rank, ranks, nccl_version })
    }

    /// [`EpGroup::from_id`] with the id passed through the file `path` on a file system every
    /// rank sees: rank 0 makes the id and writes it atomically ([`EpGroupId::write_file`]; it
    /// refuses a file left by an earlier run), the others wait for it up to `timeout`
    /// ([`EpGroupId::wait_for_file`]: a clear error when rank 0 never writes it). Rank 0
    /// removes the file once the group is made (every rank has read it by then).
    pub fn from_id_file(
        stream: &Arc<CudaStream>,
        rank: usize,
        ranks: usize,
        path: impl AsRef<Path>,
        timeout: Duration,
    ) -> Result<EpGroup> {
        const OP: &str = "EpGroup::from_id_file";
        let path = path.as_ref();
        check_ranks(OP, rank, ranks)?;
        // Before the file: a rank 0 that cannot use NCCL must not publish an id.
        nccl_version()?;
        ensure_not_capturing(stream, OP)?;
        let id = if rank == 0 {
            let id = EpGroupId::new()?;
            id.write_file(path)?;
            id
        } else {
            EpGroupId::wait_for_file(path, timeout)?
        };
        let group = EpGroup::from_id(stream, rank, ranks, id);
        if rank == 0 {
            // NOTE: also after a failure, so that a retry does not meet a stale file.
            let _ = std::fs::remove_file(path);
        }
        group
    }

    /// [`EpGroup::from_id_file`] with rank, ranks, id file and timeout from the environment
    /// ([`EpEnv`]: `CAPMOE_EP_RANK`, `CAPMOE_EP_SIZE`, `CAPMOE_EP_ID_FILE`, optional
    /// `CAPMOE_EP_ID_TIMEOUT_S`).
    pub fn from_env(stream: &Arc<CudaStream>) -> Result<EpGroup> {
        let env = EpEnv::from_env()?;
        EpGroup::from_id_file(stream, env.rank, env.ranks, &env.id_file, env.timeout)
    }

    /// Every rank in this process (`ncclCommInitAll`): rank i on `streams[i]`'s GPU. NCCL
    /// refuses two ranks on one GPU, so the streams must be on distinct devices
    /// ([`Error::InvalidArgument`] before NCCL is asked). Bare collectives of several ranks can
    /// be driven from one thread inside [`nccl_group`]; an [`super::EpMoe`] per rank needs a
    /// thread per rank (move each group to its thread; see [`nccl_group`] for why).
    pub fn single_process(streams: &[Arc<CudaStream>]) -> Result<Vec<EpGroup>> {
        const OP: &str = "EpGroup::single_process";
        if streams.is_empty() || streams.len() > i32::MAX as usize {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("{} streams: need at least one", streams.len()),
            });
        }
        let ordinals: Vec<i32> = streams.iter().map(|s| s.context().ordinal() as i32).collect();
        for (i, a) in ordinals.iter().enumerate() {
            if let Some(j) = ordinals[..i].iter().position(|b| b == a) {
                return Err(Error::InvalidArgument {
                    op: OP,
                    why: format!(
                        "streams {j} and {i} are both on GPU {a}: NCCL refuses two ranks of a communicator on one GPU; give one stream per GPU"
                    ),
                });
            }
        }
        let nccl_version = nccl_version()?;
        for stream in streams {
            ensure_not_capturing(stream, OP)?;
        }
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); streams.len()];
        // SAFETY: one out pointer per device of `ordinals`, which has streams.len() entries.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), streams.len() as i32, ordinals.as_ptr()) }
            .map_err(|e| nccl_error(OP, e, None))?;
        let ranks = streams.len();
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (comm, stream))| EpGroup { comm, stream: stream.clone(), rank, ranks, nccl_version })
            .collect())
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The stream every collective of the group is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn desc(&self) -> EpGroupDesc {
        EpGroupDesc {
            rank: self.rank,
            ranks: self.ranks,
            device: self.stream.context().ordinal(),
            nccl_version: self.nccl_version,
        }
    }

    /// `Ok` for the bound stream, else [`Error::WrongStream`].
    fn ensure_bound_stream(&self, op: &'static str, stream: &CudaStream) -> Result<()> {
        ensure_bound_stream(op, &self.stream, stream)
    }

    fn nccl_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// `recv[p * n .. (p + 1) * n] = rank p's send[.. n]` for every rank p (`ncclAllGather`):
    /// the EP step's counts exchange (`[E]` per rank -> `[R, E]` on every rank).
    /// send: `[n]`, recv: `[R * n]` elements (at least).
    pub fn all_gather<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        n: usize,
    ) -> Result<()> {
        self.one_to_every_rank("EpGroup::all_gather", stream, send, recv, n, Self::enqueue_all_gather)
    }

    /// [`EpGroup::all_gather`] on raw device pointers.
    ///
    /// # Safety
    /// `send` holds `n` and `recv` `R * n` elements of `T` in the stream's context, live until
    /// the transfer has run; `recv` does not overlap `send` except where NCCL's in-place rule
    /// allows (`send == recv + rank * n`).
    pub unsafe fn all_gather_raw<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "EpGroup::all_gather_raw";
        let bytes = self.one_to_every_rank_bytes::<T>(OP, stream, n)?;
        self.enqueue_all_gather(OP, send, recv, bytes)
    }

    /// # Safety
    /// As [`EpGroup::all_gather_raw`], in bytes.
    unsafe fn enqueue_all_gather(
        &self,
        op: &'static str,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        result::all_gather(
            send as *const _,
            recv as *mut _,
            bytes,
            sys::ncclDataType_t::ncclUint8,
            self.comm,
            self.nccl_stream(),
        )
        .map(drop)
        .map_err(|e| nccl_error(op, e, Some(self.comm)))
    }

    /// The block exchange of one buffer pair: block p of `send` goes to rank p, and block p of
    /// `recv` comes from rank p (its block `rank` of its `send`), for every p, self included.
    /// send, recv: `[R * block]` elements (at least). See [`EpGroup::exchange_many`] to move
    /// several pairs in one NCCL group.
    pub fn exchange<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        block: usize,
    ) -> Result<()> {
        self.ensure_bound_stream("EpGroup::exchange", stream)?;
        self.exchange_many(stream, &[self.blocks(send, recv, block)?])
    }

    /// A checked (send, recv, block) pair of [`EpGroup::exchange_many`] (as in
    /// [`EpGroup::exchange`]); it holds the buffers until the exchange is enqueued.
    pub fn blocks<'a, T: DeviceRepr>(
        &'a self,
        send: &'a impl DevicePtr<T>,
        recv: &'a mut impl DevicePtrMut<T>,
        block: usize,
    ) -> Result<EpBlocks<'a>> {
        const OP: &str = "EpGroup::blocks";
        let need = elements(OP, self.ranks, block)?;
        ensure_buffer(OP, "send", &self.stream, send, need)?;
        ensure_buffer(OP, "recv", &self.stream, recv, need)?;
        let (send, send_guard) = send.device_ptr(&self.stream);
        let (recv, recv_guard) = recv.device_ptr_mut(&self.stream);
        Ok(EpBlocks {
            comm: self.comm,
            send,
            recv,
            block_bytes: block * std::mem::size_of::<T>(),
            _guards: [send_guard, recv_guard],
        })
    }

    /// [`EpGroup::blocks`] on raw device pointers.
    ///
    /// # Safety
    /// `send` and `recv` each hold `R * block` elements of `T` in the stream's context, do not
    /// overlap, and stay live until the exchange has run.
    pub unsafe fn blocks_raw<T: DeviceRepr>(
        &self,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        block: usize,
    ) -> Result<EpBlocks<'_>> {
        const OP: &str = "EpGroup::blocks_raw";
        let block_bytes = elements(OP, block, std::mem::size_of::<T>())?;
        elements(OP, self.ranks, block_bytes)?;
        Ok(EpBlocks {
            comm: self.comm,
            send,
            recv,
            block_bytes,
            _guards: [SyncOnDrop::Record(None), SyncOnDrop::Record(None)],
        })
    }

    /// Every pair of `parts` exchanged as [`EpGroup::exchange`] does, all in ONE NCCL group (one
    /// launch, the transfers to one peer share its connection): the dispatch moves rows, ids
    /// and probs together this way. Each part must come from this group's
    /// [`EpGroup::blocks`] / [`EpGroup::blocks_raw`].
    pub fn exchange_many(&self, stream: &CudaStream, parts: &[EpBlocks<'_>]) -> Result<()> {
        const OP: &str = "EpGroup::exchange_many";
        self.ensure_bound_stream(OP, stream)?;
        if let Some(i) = parts.iter().position(|p| p.comm != self.comm) {
            return Err(Error::InvalidArgument { op: OP, why: format!("part {i} was made by another EpGroup") });
        }
        stream.context().bind_to_thread()?;
        // NOTE: a send / recv that fails partway through this loop (only bad arguments do)
        // still leaves the calls recorded before it, which ncclGroupEnd launches: the peers
        // then wait for transfers that never come. The arguments are checked by blocks() /
        // blocks_raw(), so this is left as a documented hazard.
        self.in_group(OP, || {
            for part in parts.iter().filter(|p| p.block_bytes > 0) {
                for peer in 0..self.ranks {
                    let offset = (peer * part.block_bytes) as u64;
                    // SAFETY: blocks() / blocks_raw() established R * block_bytes bytes in each.
                    unsafe {
                        self.send_bytes(OP, part.send + offset, part.block_bytes, peer)?;
                        self.recv_bytes(OP, part.recv + offset, part.block_bytes, peer)?;
                    }
                }
            }
            Ok(())
        })
    }

    /// The same `[block]` of `send` to every rank, and one block from each rank p into block p
    /// of `recv` (self included): the return of the spare-slot weight gradients, where every
    /// rank needs every rank's `[S_per, W]`. send: `[block]`, recv: `[R * block]` elements.
    pub fn broadcast_block<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        block: usize,
    ) -> Result<()> {
        self.one_to_every_rank("EpGroup::broadcast_block", stream, send, recv, block, Self::enqueue_broadcast_block)
    }

    /// [`EpGroup::broadcast_block`] on raw device pointers.
    ///
    /// # Safety
    /// `send` holds `block` and `recv` `R * block` elements of `T` in the stream's context, do
    /// not overlap, and stay live until the transfer has run.
    pub unsafe fn broadcast_block_raw<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        block: usize,
    ) -> Result<()> {
        const OP: &str = "EpGroup::broadcast_block_raw";
        let bytes = self.one_to_every_rank_bytes::<T>(OP, stream, block)?;
        self.enqueue_broadcast_block(OP, send, recv, bytes)
    }

    /// # Safety
    /// As [`EpGroup::broadcast_block_raw`], in bytes.
    unsafe fn enqueue_broadcast_block(
        &self,
        op: &'static str,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.in_group(op, || {
            for peer in 0..self.ranks {
                self.send_bytes(op, send, bytes, peer)?;
                self.recv_bytes(op, recv + (peer * bytes) as u64, bytes, peer)?;
            }
            Ok(())
        })
    }

    /// The safe form of a collective that sends `[n]` and receives `[R * n]` (all_gather,
    /// broadcast_block): the stream and both buffers checked, then `enqueue` on their
    /// addresses, in bytes.
    fn one_to_every_rank<T: DeviceRepr>(
        &self,
        op: &'static str,
        stream: &CudaStream,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        n: usize,
        enqueue: unsafe fn(&Self, &'static str, CUdeviceptr, CUdeviceptr, usize) -> Result<()>,
    ) -> Result<()> {
        self.ensure_bound_stream(op, stream)?;
        ensure_buffer(op, "send", stream, send, n)?;
        ensure_buffer(op, "recv", stream, recv, elements(op, self.ranks, n)?)?;
        // As the raw forms and the exchanges: a rank thread's first call may be this one.
        stream.context().bind_to_thread()?;
        let (s, _g0) = send.device_ptr(stream);
        let (r, _g1) = recv.device_ptr_mut(stream);
        // SAFETY: both buffers checked above to hold n and R * n elements of the stream's context.
        unsafe { enqueue(self, op, s, r, n * std::mem::size_of::<T>()) }
    }

    /// The raw form's part of [`EpGroup::one_to_every_rank`]: the stream checked and bound, and
    /// the bytes of `[n]` (with `R` times them) checked against overflow.
    fn one_to_every_rank_bytes<T: DeviceRepr>(&self, op: &'static str, stream: &CudaStream, n: usize) -> Result<usize> {
        self.ensure_bound_stream(op, stream)?;
        let bytes = elements(op, n, std::mem::size_of::<T>())?;
        elements(op, self.ranks, bytes)?;
        stream.context().bind_to_thread()?;
        Ok(bytes)
    }

    /// `body`'s point-to-point calls in one NCCL group, which is ended also when one fails
    /// (an open group would swallow every later NCCL call of the thread).
    fn in_group(&self, op: &'static str, body: impl FnOnce() -> Result<()>) -> Result<()> {
        result::group_start().map_err(|e| nccl_error(op, e, Some(self.comm)))?;
        let enqueued = body();
        let ended = result::group_end().map(drop).map_err(|e| nccl_error(op, e, Some(self.comm)));
        enqueued.and(ended)
    }

    /// # Safety
    /// `bytes` bytes at `ptr` in the group's context, live until the transfer has run.
    unsafe fn send_bytes(&self, op: &'static str, ptr: CUdeviceptr, bytes: usize, peer: usize) -> Result<()> {
        result::send(ptr as *const _, bytes, sys::ncclDataType_t::ncclUint8, peer as i32, self.comm, self.nccl_stream())
            .map(drop)
            .map_err(|e| nccl_error(op, e, Some(self.comm)))
    }

    /// # Safety
    /// As [`EpGroup::send_bytes`], written.
    unsafe fn recv_bytes(&self, op: &'static str, ptr: CUdeviceptr, bytes: usize, peer: usize) -> Result<()> {
        result::recv(ptr as *mut _, bytes, sys::ncclDataType_t::ncclUint8, peer as i32, self.comm, self.nccl_stream())
            .map(drop)
            .map_err(|e| nccl_error(op, e, Some(self.comm)))
    }
}

/// One (send, recv, block) pair of [`EpGroup::exchange_many`], checked when made
/// ([`EpGroup::blocks`]). Holds cudarc's buffer-use records, so the buffers count as used on
/// the group's stream until it is dropped (after the exchange is enqueued).
#[derive(Debug)]
pub struct EpBlocks<'a> {
    comm: sys::ncclComm_t,
    send: CUdeviceptr,
    recv: CUdeviceptr,
    block_bytes: usize,
    _guards: [SyncOnDrop<'a>; 2],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ep_layer_calls_are_refused_inside_nccl_group_and_allowed_after() {
        // The depth nccl_group keeps, without libnccl: entered and left as nccl_group does.
        assert!(ensure_outside_nccl_group("op").is_ok());
        {
            let _outer = GroupDepth::enter();
            let _inner = GroupDepth::enter();
            let err = ensure_outside_nccl_group("EpMoe::dispatch").unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { op: "EpMoe::dispatch", .. }), "{err}");
            assert!(err.to_string().contains("nccl_group"), "{err}");
        }
        assert!(ensure_outside_nccl_group("op").is_ok());
        // Another thread has its own depth.
        let _here = GroupDepth::enter();
        assert!(std::thread::spawn(|| ensure_outside_nccl_group("op").is_ok()).join().unwrap());
        drop(_here);
        // Left also when the body panics.
        let _ = std::panic::catch_unwind(|| {
            let _depth = GroupDepth::enter();
            panic!("body failed");
        });
        assert!(ensure_outside_nccl_group("op").is_ok());
    }
}
