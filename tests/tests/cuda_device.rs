//! The device-buffer calls (`a2e_send_device`, `e2a_recv_device`, `a2e_recv_device`,
//! `e2a_send_device`) between real processes on the cuda fabric, against the **stand-in** CUDA
//! driver (`tests/cuda_standin/`; no GPU is involved), every buffer in (stand-in) device memory:
//! - bit for bit against the reference (the host calls' bits), 1A:1E, 2A:3E and 3A:2E, f32 and
//!   bf16, many calls in a row, push and pull, host calls interleaved on the same communicator,
//!   empty ranks, rounds in which no attention rank sends, tokens routed to no expert;
//! - INT8 on the wire both ways; a non-finite row with INT8 is an error before anything is
//!   published, and the call is retried;
//! - relays (INT8 and dtype rows through them; a pull A2E through them refused, nothing sent);
//! - (in `shrink.rs`) a shrink past a SIGKILLed rank, then device calls on the shrunk job;
//! - bad buffers (host memory, another device's memory, too short, past the allocation, the
//!   stream of another device, a device call on a shm communicator): each a clear error naming
//!   the buffer, nothing sent or consumed, the next good call succeeds;
//! - the stand-in's transfer counters, and the bound on what the calls copy between host and
//!   device: metadata only (dtype rows, INT8 on the wire, through relays).
//!
//! Every test re-runs this binary as its ranks (see `xccl_tests::Job`); every job's stand-in
//! segments are checked to be gone from `/dev/shm`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use xccl::cuda::{Device, DeviceMemory, Stream};
use xccl::testing::harness::{
    attention_round_with, expert_round, expert_step, lend, lend_mut, Buffers, DeviceRows, Routes,
    Sparse, Workload,
};
use xccl::testing::reference::{expected_combine_quant, test_expert};
use xccl::{
    Communicator, DType, DeviceSlice, DeviceSliceMut, Element, Error, ExpertBatch, MoeConfig,
    Quant, Role, Routing, Topology, TransferMode,
};
use xccl_tests::cuda_support::{device_round, StandinCounters, DEVICES_ENV};
use xccl_tests::{announce, child_main, ChildCtx, Job, StandinSegments};

const ENTRY: &str = "child_rank_entry";
const CONNECT: Duration = Duration::from_secs(30);
/// Elements per row of the checked rounds.
const HIDDEN: usize = 32;
/// Top-k of the checked rounds.
const TOPK: usize = 4;
/// Most tokens an attention rank sends per call.
const TOKENS: usize = 16;

#[test]
fn child_rank_entry() {
    child_main(dispatch);
}

fn dispatch(scenario: &str, ctx: &ChildCtx) -> Result<(), String> {
    let parts: Vec<&str> = scenario.split(':').collect();
    let p = |s: &str| s.parse::<usize>().map_err(|e| format!("{scenario}: {e}"));
    match parts.as_slice() {
        ["rounds", m, n, dtype, relays, quant, rounds] => {
            let shape = Shape {
                m: p(m)?,
                n: p(n)?,
                dtype: match *dtype {
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    other => return Err(format!("dtype {other}")),
                },
                relays: p(relays)?,
                quant: quant.to_string(),
                rounds: p(rounds)? as u64,
            };
            checked_rounds(ctx, &shape)
        }
        ["int8_non_finite"] => int8_non_finite(ctx),
        ["bad_buffers"] => bad_buffers(ctx),
        ["on_shm"] => device_calls_on_shm(ctx),
        ["counters"] => counters_count(ctx),
        ["native_counters", m, n, relays, quant] => {
            let quant = if *quant == "int8" {
                Quant::Int8
            } else {
                Quant::None
            };
            native_counters(ctx, (p(m)?, p(n)?), p(relays)?, quant)
        }
        _ => Err(format!("unknown scenario {scenario:?}")),
    }
}

fn s(e: Error) -> String {
    e.to_string()
}

/// A job of checked rounds.
struct Shape {
    m: usize,
    n: usize,
    dtype: DType,
    /// Relays (0: none).
    relays: usize,
    /// `none`, `int8` (both ways) or `mix` (per round: none, INT8 replies, INT8 both ways).
    quant: String,
    rounds: u64,
}

/// The workload of the checked rounds: up to [`TOKENS`] tokens per rank (varying), each rank
/// empty every third round (staggered), no rank sending every fifth round, every fourth token
/// routed to no expert.
fn sparse(seed: u64) -> Sparse {
    Sparse {
        base: Workload {
            seed,
            tokens: TOKENS,
            vary: true,
            skew: None,
            shared_experts: 0,
        },
        empty_every: 3,
        silent_every: 5,
        unrouted_every: 4,
    }
}

/// A communicator of an `m`A:`n`E job on the cuda fabric (experts `4 * max(n, 2)`), rows of
/// `hidden` elements of `dtype`, top-[`TOPK`], with `relays` relays.
fn cuda_comm(
    ctx: &ChildCtx,
    (m, n): (usize, usize),
    dtype: DType,
    hidden: usize,
    relays: usize,
) -> Result<Communicator, String> {
    let mut cfg = MoeConfig::new(hidden, dtype, TOPK, TOKENS);
    cfg.timeout = Duration::from_secs(30);
    let ex = ctx.connect(CONNECT).map_err(s)?;
    let mut topo = Topology::contiguous(m, n, 4 * n.max(2)).map_err(s)?;
    if relays > 0 {
        topo = topo.with_relays(Some(relays)).map_err(s)?;
    }
    let comm = Communicator::init_cuda(ex, Arc::new(topo), cfg, None).map_err(s)?;
    if comm.fabric_name() != "cuda" || comm.cuda_device().is_none() {
        return Err(format!("fabric {}", comm.fabric_name()));
    }
    Ok(comm)
}

/// One round of `T`: the device calls, or (`host`) the host calls on the same communicator.
fn one_round<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &mut ExpertBatch,
    host: bool,
) -> xccl::Result<Result<(), String>> {
    match (comm.role(), host) {
        (_, false) => device_round::<T>(comm, wl, round, batch),
        (Role::Attention, true) => attention_round_with::<T>(comm, wl, round, Buffers::Copy),
        (Role::Expert, true) => expert_round::<T>(comm, wl, round, batch, true),
    }
}

/// `shape.rounds` checked rounds: device calls, every fourth round the host calls instead;
/// pull on a rank every third round where there are no relays (relays take push only); the
/// quantization `shape.quant` says.
fn checked_rounds(ctx: &ChildCtx, shape: &Shape) -> Result<(), String> {
    let (m, n) = (shape.m, shape.n);
    let mut comm = cuda_comm(ctx, (m, n), shape.dtype, HIDDEN, shape.relays)?;
    let wl = sparse(0xde5e_ed00 + (m * 10 + n) as u64);
    let mut batch = ExpertBatch::new();
    if shape.relays > 0 && comm.role() == Role::Attention {
        pull_through_relays_is_refused(&mut comm)?;
    }
    let mut device_calls = 0;
    for round in 0..shape.rounds {
        let (a2e, e2a) = match (shape.quant.as_str(), round % 3) {
            ("none", _) | ("mix", 0) => (Quant::None, Quant::None),
            ("mix", 1) => (Quant::None, Quant::Int8),
            _ => (Quant::Int8, Quant::Int8),
        };
        comm.set_a2e_quant(a2e);
        comm.set_e2a_quant(e2a);
        let pull = shape.relays == 0 && (round + ctx.rank as u64).is_multiple_of(3);
        comm.set_mode(if pull {
            TransferMode::Pull
        } else {
            TransferMode::Push
        });
        let host = round % 4 == 3;
        device_calls += usize::from(!host);
        let verdict = match shape.dtype {
            DType::BF16 => one_round::<bf16>(&mut comm, &wl, round, &mut batch, host),
            _ => one_round::<f32>(&mut comm, &wl, round, &mut batch, host),
        };
        verdict
            .map_err(|e| format!("round {round}: {e}"))?
            .map_err(|e| format!("round {round}: {e}"))?;
    }
    comm.barrier().map_err(s)?;
    announce(&format!(
        "rank {}: {device_calls} rounds of device calls and {} of host calls checked",
        ctx.rank,
        shape.rounds as usize - device_calls
    ));
    Ok(())
}

/// A pull A2E device send through relays (which take push only) is refused before anything is
/// sent; the rounds that follow check that nothing was.
fn pull_through_relays_is_refused(comm: &mut Communicator) -> Result<(), String> {
    let dev = DeviceRows::of(comm).map_err(s)?;
    let row = comm.config().hidden * comm.config().dtype.size();
    let x = dev.upload(&vec![0u8; row]).map_err(s)?;
    let idx: Vec<i32> = (0..TOPK as i32).collect();
    let routing = Routing::Host {
        topk_idx: &idx,
        topk_weights: &[0.25; TOPK],
    };
    comm.set_mode(TransferMode::Pull);
    let r = comm.a2e_send_device(lend(&x, row), routing, dev.stream());
    comm.set_mode(TransferMode::Push);
    let words = ["pull A2E", "not supported through relays"];
    refused(comm, "a pull A2E through relays", r, &words).map(drop)
}

/// Checks that `r` is `InvalidArgument` whose text contains every one of `words`, and that
/// `comm` is not poisoned (the call is retryable). Returns the text.
fn refused<X>(
    comm: &Communicator,
    what: &str,
    r: xccl::Result<X>,
    words: &[impl AsRef<str> + std::fmt::Debug],
) -> Result<String, String> {
    match r {
        Err(Error::InvalidArgument(msg)) if words.iter().all(|w| msg.contains(w.as_ref())) => {
            if let Some(p) = comm.poisoned() {
                return Err(format!(
                    "{what}: refused, but the communicator is poisoned: {p}"
                ));
            }
            announce(&format!("rank {}: {what}: {msg}", comm.rank()));
            Ok(msg)
        }
        Err(e) => Err(format!(
            "{what}: expected InvalidArgument with {words:?}, got {e}"
        )),
        Ok(_) => Err(format!("{what}: accepted")),
    }
}

/// A probed attention round's hook before the send: may try bad sends of the rows and routing.
type SendHook<'h> = &'h dyn Fn(&mut Communicator, &DeviceRows, &Routed) -> Result<(), String>;
/// A probed attention round's hook before the receive: may try bad receives of the handle,
/// whose output takes the given number of bytes.
type RecvHook<'h> =
    &'h dyn Fn(&mut Communicator, &DeviceRows, &xccl::A2eHandle, usize) -> Result<(), String>;
/// A probed expert round's hook before the receive: may try bad receives into the batch, whose
/// output takes at least the given number of bytes.
type ExpertRecvHook<'h> =
    &'h dyn Fn(&mut Communicator, &DeviceRows, usize, &mut ExpertBatch) -> Result<(), String>;
/// A probed expert round's hook before the reply: may try bad replies to the batch, given the
/// good outputs.
type ReplyHook<'h, T> =
    &'h dyn Fn(&mut Communicator, &DeviceRows, &ExpertBatch, &[T]) -> Result<(), String>;

/// An attention rank's A2E of `round` (routing and rows in device memory) with a hook that may
/// try bad calls first (`before_send`) and between the send and the receive (`before_recv`),
/// then the good receive, checked bit for bit against the reference.
fn attention_round_probed<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    before_send: SendHook<'_>,
    before_recv: RecvHook<'_>,
) -> Result<(), String> {
    let topo = comm.topology().clone();
    let (k, hidden) = (comm.config().topk, comm.config().hidden);
    let input = wl.input(&topo, k, comm.rank(), round);
    let x: Vec<T> = wl.hidden_states(comm.rank(), round, input.num_tokens, hidden);
    let dev = DeviceRows::of(comm).map_err(s)?;
    let bytes = std::mem::size_of_val(x.as_slice());
    let routed = Routed {
        x: dev.upload(&x).map_err(s)?,
        bytes,
        idx: dev.upload(&input.topk_idx).map_err(s)?,
        weights: dev.upload(&input.topk_weights).map_err(s)?,
        slots: input.topk_idx.len(),
    };
    before_send(comm, &dev, &routed)?;
    let handle = comm
        .a2e_send_device(lend(&routed.x, bytes), routed.routing(), dev.stream())
        .map_err(s)?;
    before_recv(comm, &dev, &handle, bytes)?;
    let mut out = dev.alloc(bytes).map_err(s)?;
    comm.e2a_recv_device(&handle, lend_mut(&mut out, bytes), dev.stream())
        .map_err(s)?;
    let got: Vec<T> = dev.download(&out, x.len()).map_err(s)?;
    let (a2e, e2a) = (comm.config().a2e_quant, comm.config().e2a_quant);
    let want = expected_combine_quant(&topo, &input, &x, hidden, &test_expert, a2e, e2a);
    match xccl::testing::harness::first_difference(&got, &want, hidden) {
        None => Ok(()),
        Some(d) => Err(format!("round {round}: out{d}")),
    }
}

/// An attention rank's rows and routing in device memory.
struct Routed {
    x: DeviceMemory,
    /// Bytes of `x` the call takes.
    bytes: usize,
    idx: DeviceMemory,
    weights: DeviceMemory,
    /// `T * topk`.
    slots: usize,
}

impl Routed {
    fn routing(&self) -> Routing<'_> {
        Routing::Device {
            topk_idx: lend(&self.idx, self.slots * 4),
            topk_weights: lend(&self.weights, self.slots * 4),
        }
    }
}

/// An expert rank's expert-major round of `round` with device buffers, with hooks that may try
/// bad calls before the receive (`before_recv`, given the receive's length) and before the
/// reply (`before_reply`, given the batch and the good outputs); the batch is checked against
/// the reference.
fn expert_round_probed<T: Element>(
    comm: &mut Communicator,
    wl: &impl Routes,
    round: u64,
    batch: &mut ExpertBatch,
    before_recv: ExpertRecvHook<'_>,
    before_reply: ReplyHook<'_, T>,
) -> Result<(), String> {
    let dev = DeviceRows::of(comm).map_err(s)?;
    let row = comm.config().hidden * comm.config().dtype.size();
    let len = comm.max_expert_rows() * row;
    before_recv(comm, &dev, len, batch)?;
    let mut rows_mem = dev.alloc(len).map_err(s)?;
    comm.a2e_recv_device(batch, lend_mut(&mut rows_mem, len), dev.stream())
        .map_err(s)?;
    let n = batch.num_rows() * comm.config().hidden;
    let rows: Vec<T> = dev.download(&rows_mem, n).map_err(s)?;
    let (verdict, out) = expert_step(comm, wl, round, batch, &rows, true);
    verdict?;
    before_reply(comm, &dev, batch, &out)?;
    let out_mem = dev.upload(&out).map_err(s)?;
    comm.e2a_send_device(batch, lend(&out_mem, n * T::DTYPE.size()), dev.stream())
        .map_err(s)
}

/// INT8 both ways, 1A:1E, f32: in round 0 the attention rank first sends rows with a NaN
/// (token 1) and the expert rank first replies with an infinity; each is refused before
/// anything is published (nothing arrives: the retries' results are the reference's), the
/// communicator stays usable, and the retries with finite rows succeed. Then more rounds.
fn int8_non_finite(ctx: &ChildCtx) -> Result<(), String> {
    let mut comm = cuda_comm(ctx, (1, 1), DType::F32, HIDDEN, 0)?;
    comm.set_a2e_quant(Quant::Int8);
    comm.set_e2a_quant(Quant::Int8);
    let wl = Workload {
        seed: 0x18f1,
        tokens: 6,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let mut batch = ExpertBatch::new();
    if comm.role() == Role::Attention {
        attention_round_probed::<f32>(
            &mut comm,
            &wl,
            0,
            &|comm, dev, routed| {
                let mut bad: Vec<f32> = dev.download(&routed.x, routed.bytes / 4).map_err(s)?;
                bad[HIDDEN + 5] = f32::NAN;
                let bad = dev.upload(&bad).map_err(s)?;
                let r =
                    comm.a2e_send_device(lend(&bad, routed.bytes), routed.routing(), dev.stream());
                refused(
                    comm,
                    "A2E of a NaN row with INT8",
                    r,
                    // The host path's words: the token and the element.
                    &["token 1 has a non-finite element at 5"],
                )
                .map(drop)
            },
            &|_, _, _, _| Ok(()),
        )?;
    } else {
        expert_round_probed::<f32>(
            &mut comm,
            &wl,
            0,
            &mut batch,
            &|_, _, _, _| Ok(()),
            &|comm, dev, batch, out| {
                let mut bad = out.to_vec();
                let last = bad.len() - 1;
                bad[last] = f32::INFINITY;
                let bad = dev.upload(&bad).map_err(s)?;
                let r = comm.e2a_send_device(batch, lend(&bad, out.len() * 4), dev.stream());
                let last_row = batch.num_rows() as u32 - 1;
                let last_token = (0..batch.num_tokens())
                    .find(|&i| batch.token_rows(i).contains(&last_row))
                    .unwrap_or(0);
                let words = format!("the reply of token {last_token} has a non-finite element");
                refused(comm, "E2A of an infinite row with INT8", r, &[&words]).map(drop)
            },
        )?;
    }
    for round in 1..4 {
        device_round::<f32>(&mut comm, &wl, round, &mut batch)
            .map_err(s)?
            .map_err(|e| format!("round {round}: {e}"))?;
    }
    comm.barrier().map_err(s)?;
    announce(&format!("rank {}: the retries succeeded", ctx.rank));
    Ok(())
}

/// A device other than `comm`'s (the next one), or `None` when there is only one (a single
/// real GPU).
fn other_device(comm: &Communicator) -> Result<Option<Device>, String> {
    let device = comm.cuda_device().ok_or("no device")?;
    let count = device.driver().device_count().map_err(s)?;
    if count < 2 {
        return Ok(None);
    }
    Device::open((device.ordinal() + 1) % count)
        .map(Some)
        .map_err(s)
}

/// One bad place for a buffer: where it is, the device the slice claims, and the words its
/// refusal must contain.
struct Bad {
    what: String,
    addr: u64,
    device: usize,
    words: Vec<String>,
}

impl Bad {
    /// The slice of `len` bytes at this place, for reading.
    ///
    /// # Safety
    /// The bytes stay valid memory (host, or device memory of any device) while the slice
    /// lives: the calls given it must refuse it before touching it, and if one did not, it
    /// would still read valid memory.
    unsafe fn slice<'a>(&self, len: usize) -> DeviceSlice<'a> {
        // SAFETY: the caller keeps the bytes valid; nothing writes them during the call.
        unsafe { DeviceSlice::from_raw(self.addr, len, self.device) }
    }

    /// The same for writing.
    ///
    /// # Safety
    /// As [`Bad::slice`].
    unsafe fn slice_mut<'a>(&self, len: usize) -> DeviceSliceMut<'a> {
        // SAFETY: the caller keeps the bytes valid; nothing else uses them during the call.
        unsafe { DeviceSliceMut::from_raw(self.addr, len, self.device) }
    }
}

/// The memory the bad places of a buffer of `len` bytes lie in: host memory, memory of the
/// other device, and an allocation of exactly `len` bytes of this device (a slice 64 bytes in
/// runs past it, and stays inside its mapping).
struct BadMemory {
    host: Vec<u8>,
    far: Option<DeviceMemory>,
    near: DeviceMemory,
    mine: usize,
}

impl BadMemory {
    fn new(
        dev: &DeviceRows,
        other: Option<&Device>,
        mine: usize,
        len: usize,
    ) -> Result<Self, String> {
        let far = other.map(|o| DeviceMemory::alloc(o, len.max(1), || "far".into()));
        Ok(BadMemory {
            host: vec![0u8; len + 64],
            far: far.transpose().map_err(s)?,
            near: dev.alloc(len).map_err(s)?,
            mine,
        })
    }

    /// The bad places of buffer `name`: host memory; memory of the other device, as it is and
    /// claimed to be this device's; running past its allocation.
    fn places(&self, name: &str) -> Vec<Bad> {
        let mine = self.mine;
        let bad = |what: &str, addr: u64, device: usize, words: Vec<String>| Bad {
            what: format!("{name} {what}"),
            addr,
            device,
            words,
        };
        let mut places = vec![
            bad(
                "in host memory",
                self.host.as_ptr() as u64,
                mine,
                vec![name.into(), "not device memory".into()],
            ),
            bad(
                "running past its allocation",
                self.near.as_slice().ptr().addr() + 64,
                mine,
                vec![name.into(), "past the end of their allocation".into()],
            ),
        ];
        if let Some(far) = &self.far {
            let theirs = far.device().ordinal();
            let addr = far.as_slice().ptr().addr();
            let words = vec![
                name.to_string(),
                format!("CUDA device {theirs}"),
                format!("CUDA device {mine}"),
            ];
            places.push(bad("on the other device", addr, theirs, words.clone()));
            let claimed = "on the other device, claimed to be this one's";
            places.push(bad(claimed, addr, mine, words));
        }
        places
    }
}

/// 1A:1E on two stand-in devices (rank 0 on device 0, rank 1 on device 1; both on the one
/// GPU of a real single-GPU machine, which skips the other-device cases), bf16, 8 tokens.
/// Round 0: before each good call, that call's bad buffers ([`BadMemory::places`]; too short;
/// the routing's; the stream of the other device): each refused naming the buffer (and both
/// devices where it is another's), the communicator not poisoned. The good calls then succeed
/// and match the reference, so nothing of a refused call was sent or consumed. Round 1 runs
/// plainly.
fn bad_buffers(ctx: &ChildCtx) -> Result<(), String> {
    let mut comm = cuda_comm(ctx, (1, 1), DType::BF16, HIDDEN, 0)?;
    let wl = Workload {
        seed: 0xbadb,
        tokens: 8,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let mine = comm.cuda_device().ok_or("no device")?.ordinal();
    let other = other_device(&comm)?;
    if other.is_some() && mine != ctx.rank {
        return Err(format!("rank {} on device {mine}", ctx.rank));
    }
    let other = other.as_ref();
    let mut batch = ExpertBatch::new();
    if comm.role() == Role::Attention {
        attention_round_probed::<bf16>(
            &mut comm,
            &wl,
            0,
            &|comm, dev, routed| {
                let n = routed.bytes;
                let mem = BadMemory::new(dev, other, mine, n)?;
                for bad in mem.places("x") {
                    // SAFETY: `mem` outlives the call.
                    let x = unsafe { bad.slice(n) };
                    let r = comm.a2e_send_device(x, routed.routing(), dev.stream());
                    refused(comm, &bad.what, r, &bad.words)?;
                }
                let x = lend(&routed.x, n);
                let r =
                    comm.a2e_send_device(lend(&routed.x, n - 2), routed.routing(), dev.stream());
                refused(comm, "x one element short", r, &["x has", "expected"])?;
                let slots = routed.slots * 4;
                let mem = BadMemory::new(dev, other, mine, slots)?;
                for bad in mem.places("topk_idx") {
                    let routing = Routing::Device {
                        // SAFETY: `mem` outlives the call.
                        topk_idx: unsafe { bad.slice(slots) },
                        topk_weights: lend(&routed.weights, slots),
                    };
                    let r = comm.a2e_send_device(x, routing, dev.stream());
                    refused(comm, &bad.what, r, &bad.words)?;
                }
                let routing = Routing::Device {
                    topk_idx: lend(&routed.idx, slots),
                    topk_weights: lend(&routed.weights, slots - 4),
                };
                let r = comm.a2e_send_device(x, routing, dev.stream());
                refused(
                    comm,
                    "topk_weights one slot short",
                    r,
                    &["topk_weights has"],
                )?;
                if let Some(other) = other {
                    let far_stream = Stream::new(other).map_err(s)?;
                    let r = comm.a2e_send_device(x, routed.routing(), &far_stream);
                    refused(comm, "a stream of the other device", r, &["stream"])?;
                }
                Ok(())
            },
            &|comm, dev, handle, n| {
                let mut mem = BadMemory::new(dev, other, mine, n)?;
                for bad in mem.places("out") {
                    // SAFETY: `mem` outlives the call.
                    let out = unsafe { bad.slice_mut(n) };
                    let r = comm.e2a_recv_device(handle, out, dev.stream());
                    refused(comm, &bad.what, r, &bad.words)?;
                }
                let short = lend_mut(&mut mem.near, n - 2);
                let r = comm.e2a_recv_device(handle, short, dev.stream());
                refused(comm, "out one element short", r, &["out has", "expected"])?;
                Ok(())
            },
        )?;
    } else {
        expert_round_probed::<bf16>(
            &mut comm,
            &wl,
            0,
            &mut batch,
            &|comm, dev, len, batch| {
                let mut mem = BadMemory::new(dev, other, mine, len)?;
                for bad in mem.places("out") {
                    // SAFETY: `mem` outlives the call.
                    let out = unsafe { bad.slice_mut(len) };
                    let r = comm.a2e_recv_device(batch, out, dev.stream());
                    refused(comm, &bad.what, r, &bad.words)?;
                }
                let short = lend_mut(&mut mem.near, len - HIDDEN * 2);
                let r = comm.a2e_recv_device(batch, short, dev.stream());
                let what = "out one row short of max_expert_rows";
                refused(comm, what, r, &["out has", "at least"])?;
                Ok(())
            },
            &|comm, dev, batch, out| {
                let n = std::mem::size_of_val(out);
                if n == 0 {
                    return Err("no rows to reply to".into());
                }
                let mem = BadMemory::new(dev, other, mine, n)?;
                for bad in mem.places("expert_out") {
                    // SAFETY: `mem` outlives the call.
                    let expert_out = unsafe { bad.slice(n) };
                    let r = comm.e2a_send_device(batch, expert_out, dev.stream());
                    refused(comm, &bad.what, r, &bad.words)?;
                }
                let r = comm.e2a_send_device(batch, lend(&mem.near, n - 2), dev.stream());
                refused(
                    comm,
                    "expert_out one element short",
                    r,
                    &["expert_out has", "expected"],
                )?;
                Ok(())
            },
        )?;
    }
    device_round::<bf16>(&mut comm, &wl, 1, &mut batch)
        .map_err(s)?
        .map_err(|e| format!("round 1: {e}"))?;
    comm.barrier().map_err(s)?;
    announce(&format!(
        "rank {}: every bad buffer refused, the good calls matched",
        ctx.rank
    ));
    Ok(())
}

/// A device call on a communicator on the shm fabric: `cuda_device()` is `None`, each device
/// call is `InvalidArgument` saying it needs the cuda fabric, and the host calls that follow
/// succeed (checked against the reference).
fn device_calls_on_shm(ctx: &ChildCtx) -> Result<(), String> {
    let cfg = MoeConfig::new(HIDDEN, DType::BF16, TOPK, TOKENS);
    let ex = ctx.connect(CONNECT).map_err(s)?;
    let topo = Topology::contiguous(1, 1, 4).map_err(s)?;
    let mut comm = Communicator::init_shm(ex, Arc::new(topo), cfg).map_err(s)?;
    if comm.cuda_device().is_some() {
        return Err("a shm communicator has a CUDA device".into());
    }
    let wl = Workload {
        seed: 0x5e11,
        tokens: 4,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    // Device memory of the stand-in's device 0, which the communicator knows nothing of.
    let device = Device::open(0).map_err(s)?;
    let stream = Stream::new(&device).map_err(s)?;
    let mut mem = DeviceMemory::alloc(&device, 4096, || "rows".into()).map_err(s)?;
    let words = ["needs a communicator on the cuda fabric", "shm"];
    let mut batch = ExpertBatch::new();
    if comm.role() == Role::Attention {
        let idx = [0i32; TOPK];
        let routing = Routing::Host {
            topk_idx: &idx,
            topk_weights: &[0.25; TOPK],
        };
        let r = comm.a2e_send_device(lend(&mem, HIDDEN * 2), routing, &stream);
        refused(&comm, "A2E send on shm", r, &words)?;
        attention_round_with::<bf16>(&mut comm, &wl, 0, Buffers::Copy)
            .map_err(s)?
            .map_err(|e| format!("round 0: {e}"))?;
    } else {
        let r = comm.a2e_recv_device(&mut batch, mem.as_slice_mut(), &stream);
        refused(&comm, "A2E receive on shm", r, &words)?;
        comm.a2e_recv(&mut batch).map_err(s)?;
        let r = comm.e2a_send_device(&batch, lend(&mem, 0), &stream);
        refused(&comm, "E2A send on shm", r, &words)?;
        let rows: Vec<bf16> = batch.rows::<bf16>().map_err(s)?.to_vec();
        let (verdict, out) = expert_step(&comm, &wl, 0, &batch, &rows, true);
        verdict?;
        comm.e2a_send(&batch, &out).map_err(s)?;
    }
    comm.barrier().map_err(s)?;
    announce(&format!("rank {}: device calls refused on shm", ctx.rank));
    Ok(())
}

/// The stand-in's counters count what the driver calls move: a write, a read and a copy of
/// known sizes, a memset.
fn counters_count(_ctx: &ChildCtx) -> Result<(), String> {
    let device = Device::open(0).map_err(s)?;
    let stream = Stream::new(&device).map_err(s)?;
    let path = device.driver().path().to_path_buf();
    let read = || StandinCounters::read(&path).ok_or("the stand-in's counters are missing");
    let a = DeviceMemory::alloc(&device, 1000, || "a".into()).map_err(s)?;
    let b = DeviceMemory::alloc(&device, 1000, || "b".into()).map_err(s)?;
    let deadline = || Instant::now() + CONNECT;
    let what = || "counted bytes".to_string();
    let start = read()?;
    stream
        .write(&a, 10, &[7u8; 300], deadline(), 0, &what)
        .map_err(s)?;
    let mut back = [0u8; 200];
    stream
        .read(&a, 20, &mut back, deadline(), 0, &what)
        .map_err(s)?;
    stream.copy(&b, 0, &a, 0, 1000, &what).map_err(s)?;
    stream.memset(&b, 0, 0, 64, &what).map_err(s)?;
    let got = read()?.since(&start);
    let want = StandinCounters {
        htod_calls: 1,
        htod_bytes: 300,
        dtoh_calls: 1,
        dtoh_bytes: 200,
        dtod_calls: 1,
        dtod_bytes: 1000,
        memset_calls: 1,
        memset_bytes: 64,
        launches: 0,
    };
    if got != want || back != [7u8; 200] || got.host_device_bytes() != 500 {
        return Err(format!("counted {got:?}, expected {want:?}"));
    }
    announce(&format!("counted {got:?}"));
    Ok(())
}

/// Rows of the counted rounds: wide enough that a row's metadata is a small part of it.
const WIDE: usize = 1024;

/// `m`A:`n`E, bf16 rows of [`WIDE`] elements, push, `relays` relays, `quant` on the wire both
/// ways, 16 tokens per rank: each rank
/// reads the stand-in's counters around its two calls of a round (not around the test's own
/// uploads and downloads) and checks that the bytes copied between host and device are
/// metadata only: `HtoD + DtoH < rows * hidden * 2 / 8`, where `rows` are the rows the two
/// calls move (an attention rank: `2 T`, its rows out and the combined rows back; an expert
/// rank: twice the batch's rows). The results are checked against the reference too.
fn native_counters(
    ctx: &ChildCtx,
    (m, n): (usize, usize),
    relays: usize,
    quant: Quant,
) -> Result<(), String> {
    let mut comm = cuda_comm(ctx, (m, n), DType::BF16, WIDE, relays)?;
    comm.set_a2e_quant(quant);
    comm.set_e2a_quant(quant);
    let wl = Workload {
        seed: 0xc0c0,
        tokens: TOKENS,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let row = (WIDE * 2) as u64;
    let mut batch = ExpertBatch::new();
    let mut report = Vec::new();
    for round in 0..3 {
        let (calls, rows) = if comm.role() == Role::Attention {
            attention_counted(&mut comm, &wl, round)?
        } else {
            expert_counted(&mut comm, &wl, round, &mut batch)?
        };
        let moved: u64 = calls.iter().map(|(_, c)| c.host_device_bytes()).sum();
        let each: Vec<String> = calls
            .iter()
            .map(|(call, c)| {
                format!(
                    "{call}: HtoD {} B in {} copies, DtoH {} B in {}",
                    c.htod_bytes, c.htod_calls, c.dtoh_bytes, c.dtoh_calls
                )
            })
            .collect();
        let bound = rows * row / 8;
        report.push(format!(
            "round {round}: {moved} bytes for {rows} rows (bound {bound}; {})",
            each.join(", ")
        ));
        if rows == 0 || moved >= bound {
            return Err(format!(
                "rank {} round {round}: {moved} bytes copied between host and device for {rows} \
                 rows of {row} bytes; the bound is {bound} (metadata only); {}",
                ctx.rank,
                each.join(", ")
            ));
        }
    }
    comm.barrier().map_err(s)?;
    announce(&format!("rank {}: {}", ctx.rank, report.join("; ")));
    Ok(())
}

/// What the stand-in counted during `call` on `comm`'s process.
fn counted<R>(
    comm: &mut Communicator,
    call: impl FnOnce(&mut Communicator) -> xccl::Result<R>,
) -> Result<(R, StandinCounters), String> {
    let start = StandinCounters::of(comm).ok_or("no stand-in counters")?;
    let r = call(comm).map_err(s)?;
    let end = StandinCounters::of(comm).ok_or("no stand-in counters")?;
    Ok((r, end.since(&start)))
}

/// What each call of a counted round moved, and the rows the calls moved.
type Counted = (Vec<(&'static str, StandinCounters)>, u64);

/// An attention rank's counted round: what its two calls copied, and `2 T` rows.
fn attention_counted(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
) -> Result<Counted, String> {
    let topo = comm.topology().clone();
    let input = wl.input(&topo, TOPK, comm.rank(), round);
    let x: Vec<bf16> = wl.hidden_states(comm.rank(), round, input.num_tokens, WIDE);
    let dev = DeviceRows::of(comm).map_err(s)?;
    let bytes = x.len() * 2;
    let xs = dev.upload(&x).map_err(s)?;
    let idx = dev.upload(&input.topk_idx).map_err(s)?;
    let w = dev.upload(&input.topk_weights).map_err(s)?;
    let mut out = dev.alloc(bytes).map_err(s)?;
    let routing = Routing::Device {
        topk_idx: lend(&idx, input.topk_idx.len() * 4),
        topk_weights: lend(&w, input.topk_weights.len() * 4),
    };
    let (handle, sent) = counted(comm, |c| {
        c.a2e_send_device(lend(&xs, bytes), routing, dev.stream())
    })?;
    let ((), received) = counted(comm, |c| {
        c.e2a_recv_device(&handle, lend_mut(&mut out, bytes), dev.stream())
    })?;
    let got: Vec<bf16> = dev.download(&out, x.len()).map_err(s)?;
    let (a2e, e2a) = (comm.config().a2e_quant, comm.config().e2a_quant);
    let want = expected_combine_quant(&topo, &input, &x, WIDE, &test_expert, a2e, e2a);
    if let Some(d) = xccl::testing::harness::first_difference(&got, &want, WIDE) {
        return Err(format!("round {round}: out{d}"));
    }
    let calls = vec![("a2e_send_device", sent), ("e2a_recv_device", received)];
    Ok((calls, 2 * input.num_tokens as u64))
}

/// An expert rank's counted round: what its two calls copied, and twice the batch's rows.
fn expert_counted(
    comm: &mut Communicator,
    wl: &Workload,
    round: u64,
    batch: &mut ExpertBatch,
) -> Result<Counted, String> {
    let dev = DeviceRows::of(comm).map_err(s)?;
    let len = comm.max_expert_rows() * WIDE * 2;
    let mut rows_mem = dev.alloc(len).map_err(s)?;
    let ((), received) = counted(comm, |c| {
        c.a2e_recv_device(batch, lend_mut(&mut rows_mem, len), dev.stream())
    })?;
    let n = batch.num_rows() * WIDE;
    let rows: Vec<bf16> = dev.download(&rows_mem, n).map_err(s)?;
    let (verdict, out) = expert_step(comm, wl, round, batch, &rows, true);
    verdict?;
    let out = dev.upload(&out).map_err(s)?;
    let ((), sent) = counted(comm, |c| {
        c.e2a_send_device(batch, lend(&out, n * 2), dev.stream())
    })?;
    let calls = vec![("a2e_recv_device", received), ("e2a_send_device", sent)];
    Ok((calls, 2 * batch.num_rows() as u64))
}

// ---- parent side ----

fn spawn(
    scenario: &str,
    size: usize,
    devices: usize,
    per_rank: &dyn Fn(usize) -> Vec<(&'static str, Option<String>)>,
) -> (Job, StandinSegments) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
    xccl_tests::cuda_support::spawn(ENTRY, scenario, (size, devices), &dir, per_rank)
}

fn run_ok(scenario: &str, size: usize, devices: usize, timeout: Duration) -> Job {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
    xccl_tests::cuda_support::run_ok(ENTRY, scenario, (size, devices), &dir, timeout)
}

#[test]
fn device_calls_match_the_reference_bit_for_bit_1a_1e_in_bf16_and_f32() {
    run_ok("rounds:1:1:bf16:0:none:12", 2, 1, Duration::from_secs(60));
    run_ok("rounds:1:1:f32:0:none:12", 2, 1, Duration::from_secs(60));
}

#[test]
fn device_calls_match_the_reference_bit_for_bit_2a_3e_bf16_on_2_devices() {
    run_ok("rounds:2:3:bf16:0:none:10", 5, 2, Duration::from_secs(90));
}

#[test]
fn device_calls_match_the_reference_bit_for_bit_3a_2e_f32_sharing_one_device() {
    run_ok("rounds:3:2:f32:0:none:10", 5, 1, Duration::from_secs(90));
}

#[test]
fn device_calls_with_int8_on_the_wire_match_the_host_paths_bits() {
    run_ok("rounds:2:2:bf16:0:int8:8", 4, 2, Duration::from_secs(90));
    run_ok("rounds:1:1:f32:0:mix:6", 2, 1, Duration::from_secs(60));
}

#[test]
fn a_non_finite_row_with_int8_is_refused_before_anything_is_published_and_retried() {
    let job = run_ok("int8_non_finite", 2, 1, Duration::from_secs(60));
    assert!(job.output(0).contains("A2E of a NaN row with INT8: "));
    assert!(job.output(1).contains("E2A of an infinite row with INT8"));
}

#[test]
fn device_calls_through_relays_match_the_reference_bit_for_bit() {
    run_ok("rounds:2:3:bf16:1:mix:9", 5, 2, Duration::from_secs(90));
    run_ok("rounds:3:2:f32:2:none:6", 5, 1, Duration::from_secs(90));
}

#[test]
fn bad_device_buffers_are_refused_naming_them_and_the_next_good_call_succeeds() {
    let job = run_ok("bad_buffers", 2, 2, Duration::from_secs(60));
    // Before the A2E send 4 places of x, x short, 4 of topk_idx, topk_weights short, the
    // stream; before the E2A receive 4 places of out, out short; the same 5 + 5 on the expert;
    // and the last line. (A single real GPU has no other device: fewer cases.)
    if xccl_tests::cuda_support::real_cuda() {
        return;
    }
    for (rank, refusals) in [(0, 16), (1, 10)] {
        let out = job.output(rank);
        let n = out
            .lines()
            .filter(|l| l.contains(&format!("rank {rank}: ")))
            .count();
        assert_eq!(n, refusals + 1, "rank {rank}:\n{out}");
    }
}

#[test]
fn device_calls_on_a_shm_communicator_are_refused_and_host_calls_go_on() {
    run_ok("on_shm", 2, 1, Duration::from_secs(60));
}

/// Whether the jobs run on the real driver, which has no counters (then says the test skips).
fn no_counters() -> bool {
    let real = xccl_tests::cuda_support::real_cuda();
    if real {
        eprintln!("skipped: the real driver has no counters");
    }
    real
}

/// Runs the counted rounds of `scenario` ([`native_counters`]) with `size` ranks on 2 devices and
/// prints what each rank's calls copied in round 0.
fn counted_job(scenario: &str, size: usize) {
    let job = run_ok(scenario, size, 2, Duration::from_secs(90));
    for rank in 0..size {
        let out = job.output(rank);
        println!(
            "{scenario}: {}",
            out.lines().find(|l| l.contains("round 0:")).unwrap_or("")
        );
    }
}

#[test]
fn device_calls_with_int8_on_the_wire_copy_only_metadata_between_host_and_device() {
    if no_counters() {
        return;
    }
    counted_job("native_counters:2:2:0:int8", 4);
}

/// Fails on main at ccd576b: E2A through a relay still comes to the host (the attention rank's
/// `e2a_recv_device` writes the relay's reduced rows from the host: 32768 bytes HtoD for 16
/// rows of 2048 bytes; the relay's `e2a_send_device` reads 172128 bytes back in 87 copies).
#[test]
fn device_calls_through_relays_copy_only_metadata_between_host_and_device() {
    if no_counters() {
        return;
    }
    counted_job("native_counters:2:3:1:none", 5);
    counted_job("native_counters:3:2:1:int8", 5);
}

#[test]
fn the_standin_counts_the_bytes_each_copy_moves() {
    if no_counters() {
        return;
    }
    let (mut job, segs) = spawn("counters", 1, 1, &|_| vec![(DEVICES_ENV, Some("1".into()))]);
    job.expect_success(Duration::from_secs(30));
    println!("{}", job.output(0).trim());
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

/// Failed before main's 110efae on the expert ranks (the metadata gather read the whole landing
/// span back: 135232 bytes DtoH for 73 rows of 2048 bytes) and before dcb1923/605383a on every
/// rank (the rows bounced through the host).
#[test]
fn device_calls_copy_only_metadata_between_host_and_device() {
    if no_counters() {
        return;
    }
    counted_job("native_counters:2:2:0:none", 4);
}
