//! The Ascend NPU fabric: ranks are processes on one host, one NPU each, whose windows live in
//! device memory and reach each other over HCCS/UB through the CANN runtime's C API
//! (`libascendcl.so`, opened at run time by `xccl_sys::acl`).
//!
//! **Tested against a stand-in runtime only** (`tests/ascend_standin/acl_standin.c`, host shared
//! memory behind the same calls): the calls, their order and the error paths are exercised, the
//! behaviour of real devices is not.
//!
//! ## Memory
//! Each rank allocates one block of device memory (`aclrtMalloc`):
//!
//! | offset | what |
//! |---|---|
//! | 0 | abort word: 0, or 1 + the rank that aborted |
//! | 8 | dead word: 0, or 1 + the rank whose death the abort reports |
//! | 64 | abort reason: up to 256 bytes of UTF-8, NUL-padded |
//! | 384 + 128*i | signal slot `i`, a 64-bit value alone on its 128-byte line |
//! | 384 + 128*slots + 8*r | departure mark of rank `r`: 1 once it left the job cleanly |
//! | `window_offset` (4096-aligned) | the data window, `window_len` bytes |
//!
//! and a private staging buffer for host data. [`AscendFabric::new`] exports the block
//! (`aclrtIpcMemGetExportKey`, pid whitelist on) and allgathers `{pid, driver pid, device, host,
//! sizes, key}` through the bootstrap; each rank whitelists every peer's driver pid
//! (`aclrtIpcMemSetImportPid`, with pids from `aclrtDeviceGetBareTgid`) after checking the
//! adverts agree (slot counts, one host), a second round confirms both, then each rank enables
//! peer access to every other device
//! (`aclrtDeviceCanAccessPeer`, `aclrtDeviceEnablePeerAccess`) and imports every peer's block
//! (`aclrtIpcMemImportByKey`); a third round reports each rank's outcome, so one rank that fails
//! makes every rank fail, naming it. A rank whose local setup fails (no runtime, a runtime error)
//! publishes its error instead of an advert in the first round, so its peers fail at once too.
//! Every runtime call's non-zero code becomes [`Error::Native`] naming the call, the code, what
//! xccl was doing (and for which rank) and `aclGetRecentErrMsg`'s text.
//!
//! ## Transfers (host-driven)
//! The runtime forbids host<->device copies of imported memory and synchronous copies of it, so:
//! - `put` to a peer: host bytes go to the staging buffer (`aclrtMemcpy` host-to-device), then a
//!   device-to-device `aclrtMemcpyAsync` on this rank's stream moves them into the peer's window.
//!   Copies stay queued until the stream is synchronized (by `signal`, `flush`, `get`, or when the
//!   staging buffer is full): a put is complete once `signal` or `flush` returns.
//! - `get` from a peer: device-to-device into staging, synchronize, then device-to-host.
//! - `put`/`get` on this rank's own window are direct host<->device copies.
//! - `signal`: `aclrtValueWrite` of the value into the peer's slot **on the same stream**, after
//!   the copies, then a synchronize: stream order puts the value after every earlier put.
//! - Waits poll this rank's own slots with a 64-bit device-to-host copy each (`signal_value`),
//!   spin briefly, then sleep in growing naps (up to 1 ms); between naps they check every peer
//!   process (pidfd, as the shm fabric), the abort word, a local abort flag and the bootstrap's
//!   out-of-band abort ([`Exchange::poll_abort`]). Every wait has a deadline. A rank that drops
//!   its fabric writes its departure mark into every peer's control area first, so its exit is
//!   reported only by a wait for that rank itself, not taken for a crash by waits on others.
//! - `abort(reason)`: the reason goes into every rank's reason area (staged, device-to-device)
//!   and the dead rank it reports (if any) into its dead word, then `by + 1` into its abort word
//!   with a value write on the same stream, so a rank that sees the word reads the whole record;
//!   the bootstrap carries it out of band too. A rank that has
//!   already seen an abort does not raise another (the first abort wins, as far as a rank can
//!   tell without a remote compare-and-swap).
//!
//! Signals use `aclrtValueWrite` rather than notifies: value writes are documented as 64-bit
//! stores into any device memory, imported memory included, so a signal is one store into the
//! block the peer already exported, and the host can read the value; a notify is a binary event
//! (no value, reset by the wait), needs its own IPC export per peer and cannot be read from the
//! host. `aclrtValueWait` is declared but not used here: it blocks a *stream*, not the host, so
//! it cannot observe a deadline, an abort or a dead peer; it is what a device-side consumer would
//! use (below).
//!
//! ## What a device kernel would do faster on real hardware
//! This is the host-driven path, like the host fallback of CANN's MoE operators: every put costs
//! a host-to-device copy into staging plus a device-to-device copy, every signal a stream
//! synchronize, every poll a device-to-host copy. An AIV kernel (as in
//! `aclnnMoeDistributeDispatch`) would write token rows straight from device memory into the
//! peer window over HCCS/UB, write the status flag with the vector unit after the rows, and spin
//! on its own flags in device memory without a host round trip; an AICPU task could drive the
//! metadata records. Here rows come from and go to host memory, which is the API this crate's
//! protocol offers today; since the host cannot address the window ([`Fabric::local_window`] is
//! `None`), the protocol's registered buffers (`a2e_input`, `e2a_output`), which are slices of
//! the window, are not available on this fabric.
//!
//! ## Threads, teardown
//! ACL binds a device per thread: the constructor binds the calling thread (`aclrtSetDevice`),
//! and every call from another thread binds that thread first (once). Dropping the fabric drains
//! the stream, closes the imported keys, stops exporting its own, frees and resets the device;
//! [`AscendFabric::close`] does the same collectively, with barriers so that every importer has
//! closed before any exporter does (the order the runtime documents for IPC memory). ACL itself
//! is initialised once per process and finalized only on request ([`finalize_runtime`]).
//!
//! ## Known gaps (not verified without hardware)
//! - On-chip device-to-device copies need 64-byte aligned addresses; puts at unaligned offsets
//!   keep the destination's misalignment in staging but may still be rejected by a real device.
//! - That a value write is visible to the peer only after the earlier copies of the same stream
//!   (the runtime's stream order) is assumed from the documentation, not measured.
//! - All ranks must run on one host (IPC keys are per server) and share a pid namespace (pidfds).

mod runtime;

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::shm::{host_id, Liveness};
use super::signals::ControlArea;
use super::{gather_adverts, gather_outcomes, Capabilities, Fabric, Waiting, Window};
use crate::bootstrap::Exchange;
use crate::{AbortNotice, Error, Result};
use runtime::{DevPtr, Runtime, Stream};

pub use runtime::finalize_runtime;

/// How long [`AscendFabric::new`] waits for the other ranks at each rendezvous step.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes of the private staging buffer (host data passes through it on its way to a peer).
pub const STAGING_BYTES: usize = 1 << 20;
/// Longest a stream synchronize may take before it is an error: every synchronize is
/// `aclrtSynchronizeStreamWithTimeout`, and a runtime without it is refused at init (an
/// unbounded `aclrtSynchronizeStream` would be a wait without a deadline).
pub const STREAM_TIMEOUT: Duration = Duration::from_secs(60);

/// Optional runtime functions this fabric cannot work without.
const NEEDS: &[&str] = &[
    "aclrtSynchronizeStreamWithTimeout",
    "aclrtValueWrite",
    "aclrtIpcMemGetExportKey",
    "aclrtIpcMemSetImportPid",
    "aclrtIpcMemImportByKey",
    "aclrtIpcMemClose",
];

/// Alignment the runtime wants for device-to-device copies.
const LINE: usize = 64;
/// Distance between signal slots (two 64-byte lines: no false sharing with prefetch).
const SLOT_STRIDE: usize = 128;
const ABORT_OFF: usize = 0;
/// The dead rank of the abort record (0: it reports no death), written before the abort word.
const DEAD_OFF: usize = 8;
const REASON_OFF: usize = 64;
/// Longest abort reason carried in device memory (longer ones are cut).
const REASON_BYTES: usize = 256;
const SLOTS_OFF: usize = 384;
// The abort word, the reason and the slots do not overlap, and no two slots share a line.
const _: () = assert!(REASON_OFF >= DEAD_OFF + 8 && REASON_OFF + REASON_BYTES <= SLOTS_OFF);
const _: () = assert!(SLOTS_OFF.is_multiple_of(SLOT_STRIDE) && SLOT_STRIDE >= 2 * LINE);
const ADVERT_MAGIC: u64 = u64::from_le_bytes(*b"XCCLACL2");
const ADVERT_WORDS: usize = 8;
const KEY_LEN: usize = xccl_sys::acl::ACL_IPC_MEM_KEY_LEN as usize;
/// Polls before a wait starts to sleep (each poll is a device-to-host copy per slot).
const SPIN_POLLS: u32 = 64;
const FIRST_NAP: Duration = Duration::from_micros(20);
const LONGEST_NAP: Duration = Duration::from_millis(1);
/// How often a sleeping wait checks the peers and the abort channels.
const CHECK_EVERY: Duration = Duration::from_millis(10);

/// Where the departure marks start: one 64-bit word per rank, after the slots.
fn departed_off(num_slots: usize) -> usize {
    SLOTS_OFF + SLOT_STRIDE * num_slots
}

fn control_bytes(num_slots: usize, world: usize) -> usize {
    departed_off(num_slots) + 8 * world
}

fn round_up(v: usize, to: usize) -> Option<usize> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// What each rank tells the others at init.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Advert {
    pid: u32,
    ipc_pid: i32,
    device: i32,
    host: u64,
    num_slots: usize,
    window_offset: usize,
    window_len: usize,
    key: CString,
}

impl Advert {
    fn encode(&self) -> Vec<u8> {
        let words: [u64; ADVERT_WORDS] = [
            ADVERT_MAGIC,
            u64::from(self.pid),
            self.ipc_pid as u32 as u64,
            self.device as u32 as u64,
            self.host,
            self.num_slots as u64,
            self.window_offset as u64,
            self.window_len as u64,
        ];
        let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut key = [0u8; KEY_LEN];
        let bytes = self.key.as_bytes();
        key[..bytes.len().min(KEY_LEN - 1)].copy_from_slice(&bytes[..bytes.len().min(KEY_LEN - 1)]);
        out.extend_from_slice(&key);
        out
    }

    fn decode(blob: &[u8], peer: usize) -> Result<Self> {
        let bad = |detail: String| Error::Protocol { peer, detail };
        if blob.len() != ADVERT_WORDS * 8 + KEY_LEN {
            return Err(bad(format!(
                "ascend advert of {} bytes, expected {}",
                blob.len(),
                ADVERT_WORDS * 8 + KEY_LEN
            )));
        }
        let mut w = [0u64; ADVERT_WORDS];
        for (i, chunk) in blob[..ADVERT_WORDS * 8].chunks_exact(8).enumerate() {
            w[i] = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
        }
        if w[0] != ADVERT_MAGIC {
            return Err(bad(format!(
                "ascend advert tag {:#x}, expected {ADVERT_MAGIC:#x} (not an xccl ascend rank?)",
                w[0]
            )));
        }
        let size = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| bad(format!("{what} {v} does not fit in usize")))
        };
        let key_bytes = &blob[ADVERT_WORDS * 8..];
        let end = key_bytes.iter().position(|&b| b == 0).unwrap_or(0);
        if end == 0 {
            return Err(bad("ascend advert without an IPC key".into()));
        }
        Ok(Advert {
            pid: u32::try_from(w[1]).map_err(|_| bad(format!("pid {} out of range", w[1])))?,
            ipc_pid: w[2] as u32 as i32,
            device: w[3] as u32 as i32,
            host: w[4],
            num_slots: size(w[5], "slot count")?,
            window_offset: size(w[6], "window offset")?,
            window_len: size(w[7], "window length")?,
            key: CString::new(&key_bytes[..end]).expect("no NUL before `end`"),
        })
    }
}

/// A peer as this rank sees it.
#[derive(Debug)]
struct Peer {
    /// Its block in this process's device address space (own block for this rank).
    base: DevPtr,
    window_offset: usize,
    window_len: usize,
    pid: u32,
    device: i32,
    liveness: Liveness,
}

/// State behind the stream: serialises use of the stream and the staging buffer.
#[derive(Debug)]
struct StreamState {
    stream: Stream,
    /// Bytes of staging used by copies queued since the last synchronize.
    staged: usize,
    /// Whether tasks are queued since the last synchronize.
    pending: bool,
}

/// Everything this rank owns in the runtime; released in order on drop, best effort.
struct Owned {
    rt: Runtime,
    block: Option<DevPtr>,
    staging: Option<DevPtr>,
    stream: Option<Arc<Mutex<StreamState>>>,
    /// This rank's export key, once exported.
    own_key: Option<CString>,
    /// Keys imported from peers: `(peer, key)`.
    imports: Vec<(usize, CString)>,
    /// Whether the device binding of `Runtime::open` is still to be reset.
    device_bound: bool,
}

impl Owned {
    fn release(&mut self) -> Vec<Error> {
        let mut errors = Vec::new();
        let anything = self.stream.is_some()
            || !self.imports.is_empty()
            || self.own_key.is_some()
            || self.staging.is_some()
            || self.block.is_some()
            || self.device_bound;
        if !anything {
            // Released already (`close`): do not bind the thread to the device again.
            return errors;
        }
        let mut note = |r: Result<()>| {
            if let Err(e) = r {
                errors.push(e);
            }
        };
        note(self.rt.bind_thread());
        if let Some(state) = self.stream.take() {
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            if st.pending {
                let ms = STREAM_TIMEOUT.as_millis() as i32;
                note(
                    self.rt
                        .synchronize(&st.stream, ms, || "draining the stream at close".into()),
                );
            }
            let stream = std::mem::replace(&mut st.stream, Stream(std::ptr::null_mut()));
            note(self.rt.destroy_stream(stream));
        }
        // Importers close before the exporter (documented order for IPC memory).
        for (peer, key) in self.imports.drain(..) {
            note(
                self.rt
                    .close_key(&key, &format!("rank {peer}'s imported window")),
            );
        }
        if let Some(key) = self.own_key.take() {
            note(self.rt.close_key(&key, "this rank's exported window"));
        }
        if let Some(p) = self.staging.take() {
            note(self.rt.free(p));
        }
        if let Some(p) = self.block.take() {
            note(self.rt.free(p));
        }
        if std::mem::take(&mut self.device_bound) {
            // Balances the aclrtSetDevice of `Runtime::open`.
            note(self.rt.reset_device());
        }
        errors
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// What [`AscendFabric::setup_local`] made.
struct Local {
    rt: Runtime,
    owned: Owned,
    block: DevPtr,
    staging: DevPtr,
    state: Arc<Mutex<StreamState>>,
    mine: Advert,
}

/// One rank's endpoint of the Ascend fabric. See the module docs.
pub struct AscendFabric {
    exchange: Arc<dyn Exchange>,
    rank: usize,
    num_slots: usize,
    peers: Vec<Peer>,
    state: Arc<Mutex<StreamState>>,
    staging: DevPtr,
    /// Set by this rank's own `abort`.
    aborted: AtomicBool,
    /// Set once this rank told its peers it left the job (drop or `close`).
    departed: AtomicBool,
    /// The reason this rank gave.
    abort_reason: Mutex<AbortNotice>,
    /// The first runtime error seen where none can be returned (`signal_value`).
    sticky: Mutex<Option<Error>>,
    /// Released last (fields drop in declaration order).
    owned: Owned,
}

impl std::fmt::Debug for AscendFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AscendFabric")
            .field("rank", &self.rank)
            .field("world_size", &self.peers.len())
            .field("device", &self.owned.rt.device())
            .field("num_slots", &self.num_slots)
            .finish()
    }
}

impl AscendFabric {
    /// Joins the job on `device`: allocates, exports and imports the windows. Collective:
    /// every rank of `exchange` calls it (with its own device). Fails with
    /// [`Error::FabricUnavailable`] if `libascendcl.so` cannot be found (naming it and
    /// `ASCEND_HOME_PATH`) or lacks the calls this fabric needs.
    pub fn new(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        device: i32,
    ) -> Result<Self> {
        Self::with_timeout(
            exchange,
            window_len,
            num_slots,
            device,
            DEFAULT_INIT_TIMEOUT,
        )
    }

    /// [`AscendFabric::new`] with an explicit timeout for each rendezvous step.
    pub fn with_timeout(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        device: i32,
        timeout: Duration,
    ) -> Result<Self> {
        let (rank, size) = (exchange.rank(), exchange.size());
        if rank >= size {
            return Err(Error::invalid(format!(
                "rank {rank} out of range for a job of {size} ranks"
            )));
        }
        if u32::try_from(num_slots).is_err() {
            return Err(Error::invalid(format!(
                "{num_slots} signal slots is too many"
            )));
        }
        let too_large = || Error::invalid(format!("a window of {window_len} bytes is too large"));
        let window_offset = round_up(control_bytes(num_slots, size), 4096).ok_or_else(too_large)?;
        let block_len = window_offset
            .checked_add(window_len)
            .ok_or_else(too_large)?;

        // Local setup; a rank that fails here still takes part in round 1 (with its error
        // instead of an advert), so that no peer waits for it until the timeout.
        let setup = Self::setup_local(window_len, num_slots, device, window_offset, block_len);
        // Round 1: adverts.
        let blobs = gather_adverts(
            &*exchange,
            setup.as_ref().map(|local| local.mine.encode()),
            timeout,
            "ascend",
        );
        let Local {
            rt,
            mut owned,
            block,
            staging,
            state,
            mine,
        } = setup?;
        let blobs = blobs?;
        // Round 2: every rank checks the adverts and whitelists every peer's driver pid, and
        // tells the others whether it could (so a mismatch fails every rank at once).
        let checked: Result<Vec<Advert>> = (|| {
            let adverts: Vec<Advert> = blobs
                .iter()
                .enumerate()
                .map(|(peer, b)| {
                    if peer == rank {
                        Ok(mine.clone())
                    } else {
                        Advert::decode(b, peer)
                    }
                })
                .collect::<Result<_>>()?;
            for (peer, ad) in adverts.iter().enumerate() {
                check_compatible(peer, ad, &mine, size)?;
            }
            let pids: Vec<i32> = adverts
                .iter()
                .enumerate()
                .filter(|&(p, _)| p != rank)
                .map(|(_, a)| a.ipc_pid)
                .collect();
            rt.allow_importers(&mine.key, &pids)?;
            Ok(adverts)
        })();
        gather_outcomes(
            &*exchange,
            &checked,
            timeout,
            "check the adverts and allow imports",
        )?;
        let adverts = checked?;
        // Round 3: import every peer's block; report.
        let mut peers = Vec::with_capacity(size);
        let imported: Result<()> = (|| {
            for (peer, ad) in adverts.iter().enumerate() {
                if peer == rank {
                    peers.push(Peer {
                        base: block,
                        window_offset,
                        window_len,
                        pid: mine.pid,
                        device,
                        liveness: Liveness::open(mine.pid, peer)?,
                    });
                    continue;
                }
                rt.enable_peer_access(ad.device, peer)?;
                let base = rt.import(&ad.key, peer)?;
                owned.imports.push((peer, ad.key.clone()));
                peers.push(Peer {
                    base,
                    window_offset: ad.window_offset,
                    window_len: ad.window_len,
                    pid: ad.pid,
                    device: ad.device,
                    liveness: Liveness::open(ad.pid, peer)?,
                });
            }
            Ok(())
        })();
        gather_outcomes(&*exchange, &imported, timeout, "join the ascend fabric")?;
        imported?;
        tracing::debug!(
            rank,
            world = size,
            device,
            window_len,
            num_slots,
            library = %rt.library_path().display(),
            "ascend fabric ready; every peer's window imported"
        );
        Ok(AscendFabric {
            exchange,
            rank,
            num_slots,
            peers,
            state,
            staging,
            aborted: AtomicBool::new(false),
            departed: AtomicBool::new(false),
            abort_reason: Mutex::new(AbortNotice::raised_by(rank, "")),
            sticky: Mutex::new(None),
            owned,
        })
    }

    /// Opens the runtime and makes this rank's block, staging buffer, stream and export key.
    fn setup_local(
        window_len: usize,
        num_slots: usize,
        device: i32,
        window_offset: usize,
        block_len: usize,
    ) -> Result<Local> {
        let rt = Runtime::open(device, NEEDS)?;
        // From here on `owned` releases whatever exists if a later step fails.
        let mut owned = Owned {
            rt: rt.clone(),
            block: None,
            staging: None,
            stream: None,
            own_key: None,
            imports: Vec::new(),
            device_bound: true,
        };
        let block = rt.malloc(block_len, "this rank's window")?;
        owned.block = Some(block);
        // Device memory is not zeroed: clear the control area and the window.
        let zeros = vec![0u8; block_len.min(STAGING_BYTES)];
        let mut at = 0;
        while at < block_len {
            let n = (block_len - at).min(zeros.len());
            rt.copy_to_device(block.add(at), &zeros[..n], || {
                "clearing this rank's window".into()
            })?;
            at += n;
        }
        let staging = rt.malloc(STAGING_BYTES, "the staging buffer")?;
        owned.staging = Some(staging);
        let state = Arc::new(Mutex::new(StreamState {
            stream: rt.create_stream()?,
            staged: 0,
            pending: false,
        }));
        owned.stream = Some(state.clone());
        let key = rt.export(block, block_len)?;
        owned.own_key = Some(key.clone());
        let mine = Advert {
            pid: std::process::id(),
            ipc_pid: rt.ipc_pid()?,
            device,
            host: host_id(),
            num_slots,
            window_offset,
            window_len,
            key,
        };
        Ok(Local {
            rt,
            owned,
            block,
            staging,
            state,
            mine,
        })
    }

    /// The device this rank uses.
    pub fn device(&self) -> i32 {
        self.owned.rt.device()
    }

    /// The device rank `rank` uses, as it advertised at init.
    pub fn device_of(&self, rank: usize) -> Option<i32> {
        self.peers.get(rank).map(|p| p.device)
    }

    /// The process id of `rank`, as it advertised at init.
    pub fn pid_of(&self, rank: usize) -> Option<u32> {
        self.peers.get(rank).map(|p| p.pid)
    }

    /// The job id of the bootstrap this fabric was built on.
    pub fn job_id(&self) -> u64 {
        self.exchange.job_id()
    }

    /// Closes the fabric collectively: waits for every rank to stop using the windows, closes
    /// the imports, waits until every rank has, then stops exporting and frees. Dropping the
    /// fabric does the same without the two barriers (the runtime documents that importers
    /// should close before the exporter, which only a collective close can guarantee).
    pub fn close(mut self, timeout: Duration) -> Result<()> {
        let rt = self.owned.rt.clone();
        let mut first: Option<Error> = None;
        let mut note = |r: Result<()>| {
            if let (Err(e), None) = (r, first.as_ref()) {
                first = Some(e);
            }
        };
        note(self.flush());
        self.mark_departed();
        note(self.exchange.barrier(timeout));
        note(rt.bind_thread());
        for (peer, key) in std::mem::take(&mut self.owned.imports) {
            note(rt.close_key(&key, &format!("rank {peer}'s imported window")));
        }
        note(self.exchange.barrier(timeout));
        for e in self.owned.release() {
            note(Err(e));
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn peer(&self, peer: usize) -> Result<&Peer> {
        self.peers.get(peer).ok_or_else(|| {
            Error::invalid(format!(
                "rank {peer} out of range: the job has {} ranks",
                self.peers.len()
            ))
        })
    }

    fn check_range(&self, peer: usize, offset: usize, len: usize) -> Result<&Peer> {
        let p = self.peer(peer)?;
        match offset.checked_add(len) {
            Some(end) if end <= p.window_len => Ok(p),
            _ => Err(Error::OutOfWindow {
                peer,
                offset,
                len,
                window: p.window_len,
            }),
        }
    }

    fn slot_addr(&self, peer: usize, slot: usize) -> Result<DevPtr> {
        if slot >= self.num_slots {
            return Err(Error::invalid(format!(
                "signal slot {slot} out of range: rank {peer} has {} slots",
                self.num_slots
            )));
        }
        Ok(self.peer(peer)?.base.add(SLOTS_OFF + SLOT_STRIDE * slot))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sync(&self, st: &mut StreamState, what: impl FnOnce() -> String) -> Result<()> {
        if !st.pending {
            return Ok(());
        }
        let ms = i32::try_from(STREAM_TIMEOUT.as_millis()).unwrap_or(i32::MAX);
        // Whatever the outcome, the queue is drained or failed: do not synchronize it again.
        st.pending = false;
        st.staged = 0;
        self.owned.rt.synchronize(&st.stream, ms, what)
    }

    /// Reads this rank's own 64-bit word at `off` of its block.
    fn read_own_word(&self, off: usize) -> Result<u64> {
        let mut buf = [0u8; 8];
        self.owned
            .rt
            .copy_to_host(&mut buf, self.peers[self.rank].base.add(off), || {
                format!("reading this rank's control word at {off}")
            })?;
        Ok(u64::from_ne_bytes(buf))
    }

    /// An error that ends every wait: a remembered runtime error, or an abort from anywhere.
    fn interrupted(&self, waiting: &Waiting) -> Option<Error> {
        if let Some(e) = self.sticky.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Some(e);
        }
        let _ = waiting;
        // The device's record first: it names the first rank that aborted.
        match self.aborted_in_device() {
            Ok(None) => {}
            Ok(Some(notice)) => return Some(notice.to_error(self.peers.len())),
            Err(e) => return Some(e),
        }
        self.own_abort().map(|n| n.to_error(self.peers.len()))
    }

    /// This rank's own abort, once it raised one.
    fn own_abort(&self) -> Option<AbortNotice> {
        self.aborted.load(Ordering::Acquire).then(|| {
            self.abort_reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }

    /// The abort record in this rank's own control area, if any (peers wrote it: checked by
    /// [`AbortNotice::to_error`]).
    fn aborted_in_device(&self) -> Result<Option<AbortNotice>> {
        let word = self.read_own_word(ABORT_OFF)?;
        if word == 0 {
            return Ok(None);
        }
        let dead = match self.read_own_word(DEAD_OFF)? {
            0 => None,
            d => Some(usize::try_from(d - 1).unwrap_or(usize::MAX)),
        };
        let mut reason = vec![0u8; REASON_BYTES];
        self.owned.rt.copy_to_host(
            &mut reason,
            self.peers[self.rank].base.add(REASON_OFF),
            || "reading the abort reason".into(),
        )?;
        let end = reason.iter().position(|&b| b == 0).unwrap_or(reason.len());
        let by = usize::try_from(word - 1).unwrap_or(usize::MAX);
        Ok(Some(AbortNotice {
            by,
            dead,
            reason: String::from_utf8_lossy(&reason[..end]).into_owned(),
        }))
    }

    fn remember(&self, e: Error) {
        let mut s = self.sticky.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            *s = Some(e);
        }
    }
}

/// Checks that `peer`'s advert can work with this rank's.
fn check_compatible(peer: usize, ad: &Advert, mine: &Advert, world: usize) -> Result<()> {
    if ad.num_slots != mine.num_slots {
        return Err(Error::Protocol {
            peer,
            detail: format!(
                "rank {peer} has {} signal slots, this rank {}: every rank must pass the same count",
                ad.num_slots, mine.num_slots
            ),
        });
    }
    if ad.host != 0 && mine.host != 0 && ad.host != mine.host {
        return Err(Error::FabricUnavailable {
            fabric: "ascend".into(),
            detail: format!(
                "rank {peer} runs on another host: IPC memory keys work within one server"
            ),
        });
    }
    if ad.window_offset < control_bytes(ad.num_slots, world)
        || !ad.window_offset.is_multiple_of(LINE)
    {
        return Err(Error::Protocol {
            peer,
            detail: format!(
                "inconsistent layout: window at {} with {} slots",
                ad.window_offset, ad.num_slots
            ),
        });
    }
    Ok(())
}

// SAFETY: put, get and signal touch only the bounds-checked ranges they are given in windows
// allocated for the fabric's life; the fabric writes no window on its own.
unsafe impl Fabric for AscendFabric {
    fn name(&self) -> &'static str {
        "ascend"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.peers.len()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            load_store: false,
            remote_read: true,
            chunk_floor: 0,
        }
    }

    fn window_len(&self, rank: usize) -> usize {
        self.peers.get(rank).map_or(0, |p| p.window_len)
    }

    fn num_signal_slots(&self) -> usize {
        self.num_slots
    }

    fn local_window(&self) -> Option<Window<'_>> {
        // Device memory: the host cannot address it. The protocol uses put/get to this rank.
        None
    }

    fn peer_window(&self, _peer: usize) -> Option<Window<'_>> {
        None
    }

    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()> {
        let p = self.check_range(peer, offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let rt = &self.owned.rt;
        rt.bind_thread()?;
        let dst = p.base.add(p.window_offset + offset);
        let mut st = self.lock();
        if peer == self.rank {
            // Own memory: one direct host-to-device copy, after queued copies that may target
            // the same bytes.
            self.sync(&mut st, || "completing earlier puts".into())?;
            return rt.copy_to_device(dst, data, || {
                format!("put of {} bytes into this rank's window", data.len())
            });
        }
        let mut done = 0;
        while done < data.len() {
            // Keep the destination's misalignment (mod 64) in staging: device-to-device copies
            // want both ends aligned alike.
            let skew = dst.add(done).addr() % LINE;
            let n = (data.len() - done).min(STAGING_BYTES - LINE);
            let mut at = round_up(st.staged, LINE).unwrap_or(usize::MAX);
            if at.saturating_add(skew + n) > STAGING_BYTES {
                self.sync(&mut st, || format!("put to rank {peer} (staging full)"))?;
                at = 0;
            }
            let src = self.staging.add(at + skew);
            rt.copy_to_device(src, &data[done..done + n], || {
                format!("staging {n} bytes of a put to rank {peer}")
            })?;
            // SAFETY: `src` lies in the staging buffer (at + skew + n <= STAGING_BYTES), `dst`
            // in rank `peer`'s imported window (range checked above); both stay allocated until
            // the stream is synchronized (by `self`, before its memory is released).
            unsafe {
                rt.copy_d2d_async(&st.stream, dst.add(done), src, n, || {
                    format!(
                        "put of {n} bytes to rank {peer} at offset {}",
                        offset + done
                    )
                })?;
            }
            st.pending = true;
            st.staged = at + skew + n;
            done += n;
        }
        Ok(())
    }

    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        let p = self.check_range(peer, offset, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let rt = &self.owned.rt;
        rt.bind_thread()?;
        let src = p.base.add(p.window_offset + offset);
        let len = buf.len();
        let mut st = self.lock();
        self.sync(&mut st, || {
            format!("completing puts before a get from rank {peer}")
        })?;
        if peer == self.rank {
            return rt.copy_to_host(buf, src, || {
                format!("get of {len} bytes from this rank's window")
            });
        }
        let mut done = 0;
        while done < len {
            let skew = src.add(done).addr() % LINE;
            let n = (len - done).min(STAGING_BYTES - LINE);
            let stage = self.staging.add(skew);
            // SAFETY: `stage..stage+n` lies in the staging buffer (skew + n <= STAGING_BYTES),
            // the source in rank `peer`'s imported window (range checked); the stream is
            // synchronized right below, before either could be released.
            unsafe {
                rt.copy_d2d_async(&st.stream, stage, src.add(done), n, || {
                    format!(
                        "get of {n} bytes from rank {peer} at offset {}",
                        offset + done
                    )
                })?;
            }
            st.pending = true;
            self.sync(&mut st, || format!("get from rank {peer}"))?;
            rt.copy_to_host(&mut buf[done..done + n], stage, || {
                format!("copying {n} bytes got from rank {peer} to the host")
            })?;
            done += n;
        }
        Ok(())
    }

    fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        let addr = self.slot_addr(peer, slot)?;
        let rt = &self.owned.rt;
        rt.bind_thread()?;
        let mut st = self.lock();
        // SAFETY: `addr` is slot `slot` (checked) of rank `peer`'s block: 8-aligned (slots are
        // 128 bytes apart from offset 384 of an allocation the runtime aligns to at least 64),
        // own or imported with peer access; the stream is synchronized below.
        unsafe {
            rt.write_value_async(&st.stream, addr, value, || {
                format!("signal {value} to rank {peer}, slot {slot}")
            })?;
        }
        st.pending = true;
        self.sync(&mut st, || format!("signal to rank {peer}, slot {slot}"))
    }

    fn signal_value(&self, slot: usize) -> u64 {
        if slot >= self.num_slots {
            return 0;
        }
        let read = self
            .owned
            .rt
            .bind_thread()
            .and_then(|()| self.read_own_word(SLOTS_OFF + SLOT_STRIDE * slot));
        match read {
            Ok(v) => v,
            Err(e) => {
                // Surfaced by the next wait (`interrupted`).
                self.remember(e);
                0
            }
        }
    }

    fn flush(&self) -> Result<()> {
        self.owned.rt.bind_thread()?;
        let mut st = self.lock();
        self.sync(&mut st, || "flushing puts".into())
    }

    fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut polls: u32 = 0;
        let mut nap = FIRST_NAP;
        let mut last_check: Option<Instant> = None;
        loop {
            let waiting = match poll() {
                None => return Ok(()),
                Some(w) => w,
            };
            polls = polls.saturating_add(1);
            if polls < SPIN_POLLS {
                if polls.is_multiple_of(16) {
                    if let Some(e) = self.interrupted(&waiting) {
                        return Err(e);
                    }
                }
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if last_check.is_none_or(|t| now - t >= CHECK_EVERY) {
                if let Some(e) = self.interrupted(&waiting) {
                    return Err(e);
                }
                // The bootstrap's abort channel (a rank that aborted and then left is reported
                // by its abort), the awaited peer (the likeliest culprit), then every other
                // one: a dead rank anywhere stalls the job.
                last_check = Some(now);
                let live = match self.exchange.poll_abort() {
                    Some(notice) => Err(notice.to_error(self.peers.len())),
                    None => self
                        .check_peer(waiting.peer)
                        .and_then(|()| self.check_peers()),
                };
                if let Err(e) = live {
                    match ControlArea::settle(poll, waiting.peer, e) {
                        Some(end) => return end,
                        None => continue,
                    }
                }
            }
            if now >= deadline {
                return Err(Error::Timeout {
                    peer: waiting.peer,
                    what: waiting.what.to_string(),
                    waited: now - start,
                });
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(LONGEST_NAP);
        }
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.exchange.barrier(timeout)
    }

    fn abort_reporting(&self, dead: Option<usize>, reason: &str) {
        let notice = AbortNotice {
            by: self.rank,
            dead,
            reason: reason.to_string(),
        };
        if self.raise_once(&notice) {
            let _ = self.exchange.broadcast_abort_reporting(dead, reason);
        }
    }

    fn forward_abort(&self, notice: &AbortNotice) {
        self.raise_once(notice);
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        let p = self.peer(peer)?;
        let alive = p.liveness.check(peer, p.pid);
        if peer == self.rank || !self.has_departed(peer) {
            return alive;
        }
        Err(crate::fabric::departed(peer, alive))
    }

    fn aborted(&self) -> Option<AbortNotice> {
        let seen = self
            .owned
            .rt
            .bind_thread()
            .and_then(|()| self.aborted_in_device());
        match seen {
            Ok(Some(abort)) => return Some(abort),
            Ok(None) => {}
            Err(e) => self.remember(e),
        }
        self.own_abort()
    }

    fn check_peers(&self) -> Result<()> {
        if let Some(notice) = self.exchange.poll_abort() {
            return Err(notice.to_error(self.peers.len()));
        }
        for (peer, p) in self.peers.iter().enumerate() {
            if peer == self.rank {
                continue;
            }
            // A rank that left cleanly after its last call is finished, not dead: only a wait
            // for it (`check_peer` on the awaited rank) reports it.
            if let Err(e) = p.liveness.check(peer, p.pid) {
                if !self.has_departed(peer) {
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

impl AscendFabric {
    /// Tells every peer that this rank left the job cleanly (a departure mark in each peer's
    /// control area), so that its exit is not taken for a crash by waits on other ranks. Best
    /// effort, once.
    fn mark_departed(&self) {
        if self.departed.swap(true, Ordering::AcqRel) || self.owned.rt.bind_thread().is_err() {
            return;
        }
        let rt = &self.owned.rt;
        let off = departed_off(self.num_slots) + 8 * self.rank;
        let mut st = self.lock();
        for (peer, p) in self.peers.iter().enumerate() {
            if peer == self.rank {
                continue;
            }
            // SAFETY: the mark is an 8-aligned word of rank `peer`'s control area (every rank
            // has the same slot count and world size, checked at init), own or imported; the
            // stream is synchronized below.
            let queued = unsafe {
                rt.write_value_async(&st.stream, p.base.add(off), 1, || {
                    format!("departure mark to rank {peer}")
                })
            };
            if queued.is_ok() {
                st.pending = true;
            }
        }
        let _ = self.sync(&mut st, || "departure marks".into());
    }

    /// Whether `peer` left the job cleanly (its mark in this rank's control area).
    fn has_departed(&self, peer: usize) -> bool {
        let off = departed_off(self.num_slots) + 8 * peer;
        self.owned
            .rt
            .bind_thread()
            .and_then(|()| self.read_own_word(off))
            .is_ok_and(|v| v != 0)
    }
}

impl Drop for AscendFabric {
    fn drop(&mut self) {
        // Leaving the job (the runtime resources go with `owned`, after): peers waiting for
        // other ranks must not take this rank's exit for a crash.
        self.mark_departed();
    }
}

impl AscendFabric {
    /// Raises `notice` unless this rank already raised or saw an abort (the first abort wins,
    /// as far as a rank can tell without a remote compare-and-swap); whether it did.
    fn raise_once(&self, notice: &AbortNotice) -> bool {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return false;
        }
        *self.abort_reason.lock().unwrap_or_else(|e| e.into_inner()) = notice.clone();
        let rt = &self.owned.rt;
        let seen = rt
            .bind_thread()
            .and_then(|()| self.aborted_in_device())
            .ok()
            .flatten();
        if seen.is_none() {
            let _ = self.raise_abort(notice);
        }
        true
    }

    /// Writes the reason, the dead word and then the abort word (`by + 1`) of `notice` into
    /// every rank's control area (best effort: a dead peer's memory may be gone), on the
    /// stream, in that order.
    fn raise_abort(&self, notice: &AbortNotice) -> Result<()> {
        let (by, dead, reason) = (notice.by, notice.dead, notice.reason.as_str());
        let rt = &self.owned.rt;
        let mut text = [0u8; REASON_BYTES];
        let cut = floor_char_boundary(reason, REASON_BYTES - 1);
        text[..cut].copy_from_slice(&reason.as_bytes()[..cut]);
        let mut st = self.lock();
        self.sync(&mut st, || "completing puts before an abort".into())?;
        // The reason is staged once, at the start of the staging buffer.
        rt.copy_to_device(self.staging, &text, || "staging the abort reason".into())?;
        for (peer, p) in self.peers.iter().enumerate() {
            // SAFETY: the reason area and the abort word lie in the control area of rank
            // `peer`'s block (own or imported), the source in staging; the stream is
            // synchronized below, before anything is released.
            let queued = unsafe {
                rt.copy_d2d_async(
                    &st.stream,
                    p.base.add(REASON_OFF),
                    self.staging,
                    REASON_BYTES,
                    || format!("abort reason to rank {peer}"),
                )
                .and_then(|()| {
                    rt.write_value_async(
                        &st.stream,
                        p.base.add(DEAD_OFF),
                        dead.map_or(0, |d| (d as u64).saturating_add(1)),
                        || format!("abort record to rank {peer}"),
                    )
                })
                .and_then(|()| {
                    rt.write_value_async(&st.stream, p.base.add(ABORT_OFF), by as u64 + 1, || {
                        format!("abort to rank {peer}")
                    })
                })
            };
            if queued.is_ok() {
                st.pending = true;
            }
        }
        self.sync(&mut st, || "abort".into())
    }
}

/// The largest index `<= max` that is a char boundary of `s`.
fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    (0..=max)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advert_round_trips_and_rejects_garbage() {
        let a = Advert {
            pid: 42,
            ipc_pid: -7,
            device: 3,
            host: 99,
            num_slots: 7,
            window_offset: 4096,
            window_len: 123,
            key: CString::new("some-key-1").unwrap(),
        };
        assert_eq!(Advert::decode(&a.encode(), 3).unwrap(), a);
        assert!(matches!(
            Advert::decode(&[0u8; ADVERT_WORDS * 8 + KEY_LEN], 3),
            Err(Error::Protocol { peer: 3, .. })
        ));
        assert!(matches!(
            Advert::decode(&[1, 2, 3], 5),
            Err(Error::Protocol { peer: 5, .. })
        ));
    }

    #[test]
    fn abort_reasons_are_cut_at_a_char_boundary() {
        assert_eq!(floor_char_boundary("abc", 10), 3);
        assert_eq!(floor_char_boundary("abcdef", 4), 4);
        // 'é' is two bytes (1..3): a cut at 2 falls inside it.
        assert_eq!(floor_char_boundary("aéb", 2), 1);
    }

    #[test]
    fn window_starts_past_the_control_area_and_aligned() {
        let off = round_up(control_bytes(10, 448), 4096).unwrap();
        assert!(off >= control_bytes(10, 448) && off.is_multiple_of(LINE));
        assert!(departed_off(10) >= SLOTS_OFF + 10 * SLOT_STRIDE);
    }

    #[test]
    fn missing_runtime_is_unavailable_naming_library_and_variable() {
        // This unit test only runs where no Ascend runtime is installed (CI, developers):
        // elsewhere the load succeeds and there is nothing to check.
        if let Err(e) = runtime::load() {
            let s = e.to_string();
            assert!(matches!(e, Error::FabricUnavailable { .. }), "{s}");
            assert!(
                s.contains("libascendcl.so") && s.contains("ASCEND_HOME_PATH"),
                "{s}"
            );
        }
    }
}
