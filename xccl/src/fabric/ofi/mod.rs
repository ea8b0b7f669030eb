//! The libfabric fabric (`ofi`): ranks on any hosts, over verbs, EFA or tcp providers.
//!
//! This module owns one reliable-datagram (`FI_EP_RDM`) endpoint per rank, the rank's
//! registered host memory, and a progress thread. libfabric is opened at run time
//! (`xccl_sys::ofi`), so a machine without it gets [`Error::FabricUnavailable`] naming
//! `libfabric1` only when this fabric is asked for.
//!
//! # Memory
//! Each rank allocates one page-aligned region and registers it for remote read and write:
//!
//! | offset | what |
//! |---|---|
//! | 0 | the rank's [`ControlArea`] (header, doorbell, abort word, signal slots) |
//! | `mailbox_off` | one 64-bit mailbox per (sender rank, slot), plus one heartbeat word per sender |
//! | `abort_off` | one abort record per sender (272 bytes): the by word (0: the sender's own abort, or 1 + the rank whose abort it passes on), the dead word (0, or 1 + the rank whose death the abort reports), then up to 256 bytes of reason |
//! | `window_off` (page-aligned) | the data window, `window_len` bytes |
//!
//! Addresses (`fi_getname`), keys and base addresses are allgathered through the bootstrap.
//! The registration modes `FI_MR_VIRT_ADDR` (remote addresses are virtual addresses, else
//! offsets), `FI_MR_PROV_KEY` (the provider picks the key), `FI_MR_ALLOCATED` and
//! `FI_MR_ENDPOINT` are honoured; providers that need `FI_MR_LOCAL` or `FI_MR_RAW` are refused
//! with an error (see "Hardware" below).
//!
//! # Operations, completion and ordering
//! - `put` = RMA write from a copy of the caller's bytes (so the call may return before the
//!   write completes), posted with `FI_DELIVERY_COMPLETE`: its completion means the bytes are in
//!   the target's memory, not merely handed to the transport.
//! - `get` = RMA read into a bounce buffer, complete on return.
//! - `signal` = an 8-byte write of the value into this rank's mailbox for that slot at the peer,
//!   with remote CQ data naming (sender, slot), ordered after every earlier put to that peer in
//!   one of two ways ([`SignalOrdering`], chosen at init and logged):
//!   - **ordered** (where the provider grants `FI_ORDER_RMA_WAW` on transmit and receive, as
//!     `tcp;ofi_rxm` does): puts are cut to `max_order_waw_size`, and the signal write is posted
//!     at once: the provider places writes to one peer in order and reports the signal at the
//!     target only once it is placed, so every earlier put is in memory by then;
//!   - **completion** (every other provider, e.g. EFA, which does not order RMA; or forced by
//!     `XCCL_OFI_ORDERING=completion`): the signal first waits for the delivery completion of
//!     every earlier put to that peer. libfabric only orders transport headers unless asked, so
//!     there is no third way of hoping for order.
//!
//!   The target's completion queue reports the signal write; whoever reads it (the progress
//!   thread or a spinning waiter, one at a time) copies the mailbox into the slot with the
//!   control area's Release store and futex wake ([`ControlArea::store`]), so a torn 8-byte
//!   network write is never seen by a waiter and sleepers are woken. `flush` waits for every
//!   outstanding operation (all delivery-complete). Both orderings are tested with many puts in
//!   flight (`tests/tests/ofi.rs`).
//! - Puts and gets to this rank itself are memcpys into / out of the own window.
//!
//! # Progress
//! A progress thread per fabric reads the completion queue (tcp and most providers have
//! `FI_PROGRESS_MANUAL` data progress: nothing moves unless someone calls into libfabric). While
//! operations of this rank are in flight, or a wait has just started, it polls (yielding between
//! polls); otherwise it blocks in 1 ms chunks: on the CQ's wait fd (`FI_WAIT_FD`, after
//! `fi_trywait`) without holding the CQ, else in `fi_cq_sread`, else in 100 us sleeps. Waiters run the control area's spin-then-futex loop; while spinning
//! they also read the CQ themselves (when the progress thread is not), so a hot wait costs no
//! thread hop, and a long wait sleeps on the futex that the progress thread's slot stores wake.
//! Reading the CQ is serialised by a lock, so two signals to one slot land in completion order.
//!
//! # Liveness
//! Two sources, both checked between sleeps of every wait: **completion errors** (a write or read
//! to a dead peer fails on its connection; the peer is marked failed with libfabric's reason) and
//! **heartbeats**: the progress thread writes a heartbeat word with CQ data to every peer every
//! 250 ms, and a peer not heard from (heartbeat or any signal) for [`LIVENESS_TIMEOUT`] is
//! reported failed. A rank that leaves cleanly (drops its fabric after its last call) first
//! tells every peer so (a last heartbeat marked "departing", after its outstanding writes): waits
//! on other ranks then ignore its silence, and a wait on it fails at once, naming it. On
//! `tcp;ofi_rxm` a SIGKILLed rank is reported after about 3 s in the tests
//! (rxm gives up reconnecting and fails the pending write, "Transport endpoint is not connected",
//! about when the heartbeat bound expires); a host that vanishes is seen within the timeout.
//! Every error names the rank. `wait_until` also returns
//! [`Error::Aborted`] when the bootstrap relays an out-of-band abort
//! ([`Exchange::poll_abort`]).
//!
//! # Provider choice
//! [`OfiOptions::provider`], else `XCCL_OFI_PROVIDER`, else `tcp;ofi_rxm`. A missing provider, or
//! one without RMA, is an error naming it; there is no fallback. The interface is chosen by
//! [`OfiOptions::addr`] / `XCCL_OFI_ADDR` (an address of this host), else the provider's first.
//! Rank 0 logs the provider, fabric, domain (interface), registration mode and progress model
//! it got on stderr (`XCCL_OFI_QUIET=1` silences it); [`OfiFabric::provider`] returns the name.
//!
//! # Init
//! Two allgathers: the adverts (address, key, base, layout), then each rank's outcome of
//! addressing every peer, so that a rank that cannot join makes every rank fail at once, naming
//! it. A rank must not drop its fabric while peers may still read its window or wait on it
//! (its registered memory goes away with it): end a job with a barrier.
//!
//! # Hardware
//! What would change on hardware that could not be tested here (only the tcp provider runs on
//! the development machine):
//! - **verbs** (`verbs;ofi_rxm`, InfiniBand/RoCE): requires `FI_MR_LOCAL`, which this fabric
//!   refuses today: the put/get bounce buffers would become a registered staging pool whose
//!   `fi_mr_desc` is passed with each operation. `FI_MR_VIRT_ADDR`, `FI_MR_PROV_KEY` and
//!   `FI_MR_ALLOCATED` (which verbs also sets) are already honoured. Device memory (`FI_HMEM`:
//!   CUDA, Ascend) is not registered; windows are host memory.
//! - **EFA**: needs `FI_CONTEXT2` mode (the integer context would become a real `fi_context2`
//!   per operation, kept in the op table); RMA is unordered, which the completion-based signal
//!   already assumes, but `FI_DELIVERY_COMPLETE` and RDMA read/write depend on the device
//!   generation and provider version, so older EFA would need a read-back fence instead; 4 bytes
//!   of CQ data, which the 32-bit signal encoding fits.
//! - Inject sizes (`tx_attr.inject_size`, 64 B on tcp): small signals could use `FI_INJECT` to
//!   skip the bounce copy; queue depths (`tx_attr.size`) bound puts in flight (`-FI_EAGAIN` is
//!   already handled by progressing and retrying).
//! - Auto-progress providers would need the progress thread only for heartbeats and wake-ups.
//! - Peers on one host are found dead in milliseconds by shm's pidfd; across hosts the 3 s
//!   heartbeat bound applies unless a completion to the dead peer fails first.

mod endpoint;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xccl_sys::ofi as sys;

use self::endpoint::{CqEntry, Endpoint};
use super::signals::ABORT_REASON_BYTES;
use super::{
    deadline_after, AlignedBuf, Capabilities, ControlArea, Fabric, WaitCounters, WaitPolicy,
    WaitState, Waiting, Window,
};
use crate::bootstrap::Exchange;
use crate::{AbortNotice, Error, Result};

/// Provider used when neither the options nor `XCCL_OFI_PROVIDER` name one.
pub const DEFAULT_PROVIDER: &str = "tcp;ofi_rxm";
/// Environment variable naming the provider (`tcp`, `verbs`, `efa`, `tcp;ofi_rxm`, ...).
pub const PROVIDER_ENV: &str = "XCCL_OFI_PROVIDER";
/// Environment variable naming the local address (interface) to open the endpoint on.
pub const ADDR_ENV: &str = "XCCL_OFI_ADDR";
/// Environment variable choosing how a signal is ordered after puts: `ordered` (the provider's
/// write-after-write ordering; an error if it has none) or `completion` (wait for the puts'
/// delivery completion); unset: `ordered` where the provider grants it, else `completion`.
pub const ORDERING_ENV: &str = "XCCL_OFI_ORDERING";

/// How a signal is ordered after the puts before it (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOrdering {
    /// The provider places RMA writes in order (`FI_ORDER_RMA_WAW`) up to `max` bytes each:
    /// puts are cut to that size and the signal write follows them without waiting.
    Ordered {
        /// `max_order_waw_size`.
        max: usize,
    },
    /// The signal waits for the delivery completion of every earlier put to that peer.
    Completion,
}
/// A peer not heard from for this long is reported failed.
pub const LIVENESS_TIMEOUT: Duration = Duration::from_secs(3);
/// Idle polls (each a yield) the progress thread makes while a wait is on before it blocks in
/// `fi_cq_sread` (about the spin phase of [`WaitPolicy::DEDICATED`]).
const POLL_WHILE_WAITED: u32 = 512;
/// How often the progress thread sends heartbeats.
const HEARTBEAT_EVERY: Duration = Duration::from_millis(250);

/// Tag at the start of each rank's advert ("XCCLOFI1").
const ADVERT_MAGIC: u64 = u64::from_le_bytes(*b"XCCLOFI2");
/// One sender's abort record at a peer: the by word (0: the sender raised it; else 1 + the rank
/// whose abort it passes on), the dead word, then the reason (its length travels in the CQ data).
const ABORT_RECORD_BYTES: usize = 16 + ABORT_REASON_BYTES;
const ADVERT_WORDS: usize = 10;

/// Remote CQ data (32 bits, so that 4-byte providers work): kind (2) | sender (14) | slot (16).
const KIND_SIGNAL: u64 = 1;
const KIND_HEARTBEAT: u64 = 2;
const KIND_ABORT: u64 = 3;
/// Slot field of a heartbeat that says the sender leaves the job cleanly.
const DEPARTING: usize = 1;
const MAX_RANKS: usize = 1 << 14;
const MAX_SLOTS: usize = (1 << 16) - 1;

/// The [`Capabilities::chunk_floor`] of `provider`: 4 MiB for the kernel-stack `tcp` provider
/// (alone or under `ofi_rxm`), where it was measured; none for the others, which no machine here
/// could measure.
fn chunk_floor(provider: &str) -> usize {
    match provider.split(';').next() {
        Some("tcp") => 4 << 20,
        _ => 0,
    }
}

fn encode(kind: u64, sender: usize, slot: usize) -> u64 {
    (kind << 30) | ((sender as u64) << 16) | slot as u64
}

fn decode(data: u64) -> (u64, usize, usize) {
    (
        (data >> 30) & 3,
        ((data >> 16) & 0x3fff) as usize,
        (data & 0xffff) as usize,
    )
}

/// How to open the fabric.
#[derive(Clone, Debug)]
pub struct OfiOptions {
    /// libfabric provider name (`prov_name`); `None`: `XCCL_OFI_PROVIDER`, else
    /// [`DEFAULT_PROVIDER`].
    pub provider: Option<String>,
    /// Local address to bind (selects the interface); `None`: `XCCL_OFI_ADDR`, else the
    /// provider's first interface.
    pub addr: Option<String>,
    /// Bound of the init rendezvous and of every internal wait (get, flush, signal fence).
    pub timeout: Duration,
    /// `Some(SignalOrdering::Completion)` forces completion-based ordering even where the
    /// provider orders writes; `Some(Ordered { .. })` requires provider ordering; `None`:
    /// `XCCL_OFI_ORDERING`, else the provider's ordering where it has it.
    pub ordering: Option<SignalOrdering>,
}

impl Default for OfiOptions {
    fn default() -> Self {
        OfiOptions {
            provider: None,
            addr: None,
            timeout: Duration::from_secs(60),
            ordering: None,
        }
    }
}

/// What each rank tells the others.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Advert {
    key: u64,
    remote_base: u64,
    num_slots: usize,
    mailbox_off: usize,
    abort_off: usize,
    window_off: usize,
    window_len: usize,
    pid: u32,
    name: Vec<u8>,
}

impl Advert {
    fn encode(&self) -> Vec<u8> {
        let words: [u64; ADVERT_WORDS] = [
            ADVERT_MAGIC,
            self.key,
            self.remote_base,
            self.num_slots as u64,
            self.mailbox_off as u64,
            self.abort_off as u64,
            self.window_off as u64,
            self.window_len as u64,
            u64::from(self.pid),
            self.name.len() as u64,
        ];
        let mut v: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        v.extend_from_slice(&self.name);
        v
    }

    fn decode(blob: &[u8], peer: usize) -> Result<Self> {
        let bad = |detail: String| Error::Protocol { peer, detail };
        if blob.len() < ADVERT_WORDS * 8 {
            return Err(bad(format!(
                "ofi advert of {} bytes is too short",
                blob.len()
            )));
        }
        let w: Vec<u64> = blob[..ADVERT_WORDS * 8]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect();
        if w[0] != ADVERT_MAGIC {
            return Err(bad(format!(
                "ofi advert tag {:#x}, expected {ADVERT_MAGIC:#x} (not an xccl ofi rank?)",
                w[0]
            )));
        }
        let size = |v: u64| usize::try_from(v).map_err(|_| bad(format!("{v} out of range")));
        let name = &blob[ADVERT_WORDS * 8..];
        if name.len() as u64 != w[9] {
            return Err(bad(format!(
                "ofi advert names a {}-byte address but carries {}",
                w[9],
                name.len()
            )));
        }
        Ok(Advert {
            key: w[1],
            remote_base: w[2],
            num_slots: size(w[3])?,
            mailbox_off: size(w[4])?,
            abort_off: size(w[5])?,
            window_off: size(w[6])?,
            window_len: size(w[7])?,
            pid: u32::try_from(w[8]).map_err(|_| bad("pid out of range".into()))?,
            name: name.to_vec(),
        })
    }
}

/// A peer as this rank addresses it.
#[derive(Debug)]
struct Peer {
    addr: sys::fi_addr_t,
    key: u64,
    remote_base: u64,
    mailbox_off: usize,
    abort_off: usize,
    window_off: usize,
    window_len: usize,
}

/// An operation posted to libfabric: owns the bytes the provider reads or writes until its
/// completion is read. An operation whose wait gave up stays here, so late completions never
/// touch freed memory.
struct Op {
    peer: usize,
    buf: Box<[u8]>,
    /// Set on completion for operations someone waits for (gets).
    done: Option<std::result::Result<(), String>>,
    /// Dropped from the table on completion (puts, signals, heartbeats).
    fire_and_forget: bool,
    heartbeat: bool,
}

#[derive(Default)]
struct Ops {
    next: u64,
    table: HashMap<u64, Op>,
}

/// State shared by the fabric's callers and its progress thread.
struct Shared {
    /// Declared before `region` so that it is closed (deregistering the memory) first.
    ep: Endpoint,
    region: AlignedBuf,
    control: ControlArea,
    rank: usize,
    num_slots: usize,
    mailbox_off: usize,
    /// One abort record of `ABORT_RECORD_BYTES` per sender.
    abort_off: usize,
    window_off: usize,
    window_len: usize,
    peers: Vec<Peer>,
    ops: Mutex<Ops>,
    /// Serialises CQ reading, so mailbox-to-slot copies happen in completion order.
    cq_lock: Mutex<()>,
    /// Writes posted to each peer and not yet completed.
    outstanding: Vec<AtomicUsize>,
    /// Operations (not heartbeats) posted and not yet completed: while any are, the progress
    /// thread polls instead of blocking in `fi_cq_sread` (the provider only pushes queued sends
    /// from inside a call, and a blocked reader holds the CQ lock that waiters would use).
    inflight: AtomicUsize,
    /// Threads of this rank inside a wait: while there are, the progress thread keeps polling
    /// for a while before it blocks, so the spin phase of a wait sees completions at once.
    waiters: AtomicUsize,
    heartbeat_pending: Vec<AtomicBool>,
    failed: Vec<OnceLock<String>>,
    /// Peers that left the job cleanly (their fabric dropped after their last call).
    departed: Vec<AtomicBool>,
    /// Milliseconds since `epoch` when each peer was last heard from.
    last_heard: Vec<AtomicU64>,
    epoch: Instant,
    ordering: SignalOrdering,
    /// Largest single RMA this fabric posts (puts and gets are cut to it).
    max_op: usize,
    stop: AtomicBool,
    exchange: Arc<dyn Exchange>,
    timeout: Duration,
}

/// One rank's endpoint of the libfabric fabric. See the module docs.
pub struct OfiFabric {
    shared: Arc<Shared>,
    progress: Option<JoinHandle<()>>,
    wait_policy: WaitPolicy,
    wait_state: WaitState,
}

impl std::fmt::Debug for OfiFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OfiFabric")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.peers.len())
            .field("provider", &self.shared.ep.provider.name)
            .finish()
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

fn round_up(v: usize, to: usize) -> Option<usize> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// Checks `peer`'s advert against this rank's and inserts its address.
fn attach_peer(ep: &Endpoint, peer: usize, blob: &[u8], num_slots: usize) -> Result<Peer> {
    let ad = Advert::decode(blob, peer)?;
    if ad.num_slots != num_slots {
        return Err(Error::Protocol {
            peer,
            detail: format!(
                "rank {peer} has {} signal slots, this rank {num_slots}: every rank must pass \
                 the same count",
                ad.num_slots
            ),
        });
    }
    let addr = ep.insert_peer(&ad.name).map_err(|e| Error::PeerFailed {
        peer,
        detail: format!("cannot address rank {peer}: {e}"),
    })?;
    Ok(Peer {
        addr,
        key: ad.key,
        remote_base: ad.remote_base,
        mailbox_off: ad.mailbox_off,
        abort_off: ad.abort_off,
        window_off: ad.window_off,
        window_len: ad.window_len,
    })
}

impl OfiFabric {
    /// Opens this rank's endpoint with `window_len` bytes of window and `num_slots` signal
    /// slots, on `provider` (`None`: `XCCL_OFI_PROVIDER`, else [`DEFAULT_PROVIDER`]).
    /// Collective: every rank of `exchange` calls it.
    pub fn new(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        provider: Option<&str>,
    ) -> Result<Self> {
        let opts = OfiOptions {
            provider: provider.map(str::to_string),
            ..OfiOptions::default()
        };
        Self::with_options(exchange, window_len, num_slots, &opts)
    }

    /// [`OfiFabric::new`] with every option.
    pub fn with_options(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        opts: &OfiOptions,
    ) -> Result<Self> {
        let (rank, size) = (exchange.rank(), exchange.size());
        if rank >= size || size > MAX_RANKS {
            return Err(Error::invalid(format!(
                "rank {rank} of {size}: the ofi fabric takes up to {MAX_RANKS} ranks"
            )));
        }
        if num_slots > MAX_SLOTS {
            return Err(Error::invalid(format!(
                "{num_slots} signal slots: the ofi fabric takes up to {MAX_SLOTS}"
            )));
        }
        let provider = opts
            .provider
            .clone()
            .or_else(|| std::env::var(PROVIDER_ENV).ok().filter(|p| !p.is_empty()))
            .unwrap_or_else(|| DEFAULT_PROVIDER.to_string());
        let addr = opts
            .addr
            .clone()
            .or_else(|| std::env::var(ADDR_ENV).ok().filter(|a| !a.is_empty()));

        let too_large = || Error::invalid(format!("a window of {window_len} bytes is too large"));
        let page = page_size();
        let mailbox_off = ControlArea::bytes_for(num_slots);
        let mailbox_len = size * (num_slots + 1) * 8;
        let abort_off = mailbox_off + mailbox_len;
        let window_off =
            round_up(abort_off + size * ABORT_RECORD_BYTES, page).ok_or_else(too_large)?;
        let region_len = window_off.checked_add(window_len).ok_or_else(too_large)?;
        let region = AlignedBuf::zeroed(region_len)?;
        // SAFETY: the buffer is page-aligned, zeroed and at least bytes_for(num_slots) long;
        // `Shared` keeps it alive as long as the view.
        let control =
            unsafe { ControlArea::init(region.ptr(), num_slots, rank, size, std::process::id()) };

        let ep = Endpoint::open(&provider, addr.as_deref(), region.ptr(), region_len)?;
        let wanted = match opts.ordering {
            Some(o) => Some(o),
            None => match std::env::var(ORDERING_ENV).as_deref() {
                Ok("completion") => Some(SignalOrdering::Completion),
                Ok("ordered") => Some(SignalOrdering::Ordered { max: 0 }),
                Ok("") | Err(_) => None,
                Ok(other) => {
                    return Err(Error::invalid(format!(
                        "{ORDERING_ENV}={other}: expected `ordered` or `completion`"
                    )))
                }
            },
        };
        let ordering = match (wanted, ep.provider.ordered_writes) {
            (Some(SignalOrdering::Completion), _) | (None, None) => SignalOrdering::Completion,
            (_, Some(max)) => SignalOrdering::Ordered { max },
            (Some(SignalOrdering::Ordered { .. }), None) => {
                return Err(Error::FabricUnavailable {
                    fabric: "ofi".into(),
                    detail: format!(
                        "provider {} does not order RMA writes (FI_ORDER_RMA_WAW), which \
                         ordered signals need",
                        ep.provider.name
                    ),
                })
            }
        };
        let max_op = match ordering {
            SignalOrdering::Ordered { max } => max.min(ep.provider.max_msg_size),
            SignalOrdering::Completion => ep.provider.max_msg_size,
        }
        .max(4096);
        if std::env::var_os("XCCL_OFI_QUIET").is_none() && rank == 0 {
            eprintln!(
                "xccl ofi: provider {} (fabric {}, domain {}, mr_mode {:#x}, {} progress, cq {}, \
                 signals {:?})",
                ep.provider.name,
                ep.provider.fabric,
                ep.provider.domain,
                ep.provider.mr_mode,
                if ep.provider.manual_progress {
                    "manual"
                } else {
                    "auto"
                },
                if ep.provider.wait_fd.is_some() {
                    "wait fd"
                } else if ep.provider.cq_can_block {
                    "sread"
                } else {
                    "polled"
                },
                ordering,
            );
        }
        let mine = Advert {
            key: ep.key,
            remote_base: ep.remote_base,
            num_slots,
            mailbox_off,
            abort_off,
            window_off,
            window_len,
            pid: std::process::id(),
            name: ep.name.clone(),
        };
        let blobs = exchange.allgather(&mine.encode(), opts.timeout)?;
        if blobs.len() != size {
            return Err(Error::Bootstrap(format!(
                "allgather returned {} blobs for {size} ranks",
                blobs.len()
            )));
        }
        let attached: Result<Vec<Peer>> = blobs
            .iter()
            .enumerate()
            .map(|(peer, blob)| attach_peer(&ep, peer, blob, num_slots))
            .collect();
        // Second round: every rank learns whether every other rank could address every peer,
        // so that one failure fails every rank at once, naming it, instead of a timeout later.
        let status = match &attached {
            Ok(_) => vec![0u8],
            Err(e) => {
                let mut s = vec![1u8];
                s.extend_from_slice(e.to_string().as_bytes());
                s
            }
        };
        let outcomes = exchange.allgather(&status, opts.timeout)?;
        let peers = attached?;
        for (peer, outcome) in outcomes.iter().enumerate() {
            if outcome.first() != Some(&0) {
                let why = String::from_utf8_lossy(outcome.get(1..).unwrap_or_default());
                return Err(Error::PeerFailed {
                    peer,
                    detail: format!("could not join the ofi fabric: {why}"),
                });
            }
        }
        let shared = Arc::new(Shared {
            ep,
            region,
            control,
            rank,
            num_slots,
            mailbox_off,
            abort_off,
            window_off,
            window_len,
            outstanding: (0..size).map(|_| AtomicUsize::new(0)).collect(),
            inflight: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            heartbeat_pending: (0..size).map(|_| AtomicBool::new(false)).collect(),
            failed: (0..size).map(|_| OnceLock::new()).collect(),
            departed: (0..size).map(|_| AtomicBool::new(false)).collect(),
            last_heard: (0..size).map(|_| AtomicU64::new(0)).collect(),
            peers,
            ops: Mutex::new(Ops::default()),
            cq_lock: Mutex::new(()),
            epoch: Instant::now(),
            ordering,
            max_op,
            stop: AtomicBool::new(false),
            exchange,
            timeout: opts.timeout,
        });
        let thread_shared = shared.clone();
        let progress = std::thread::Builder::new()
            .name(format!("xccl-ofi-progress-{rank}"))
            .spawn(move || thread_shared.progress_loop())
            .map_err(|e| Error::os("starting the ofi progress thread", e))?;
        let fabric = OfiFabric {
            shared,
            progress: Some(progress),
            wait_policy: WaitPolicy::for_ranks_on_host(size),
            wait_state: WaitState::default(),
        };
        // Every rank has its endpoint and peers addressed (the status round) before anyone
        // writes; heartbeats count from here.
        fabric.shared.touch_all();
        Ok(fabric)
    }

    /// How signals are ordered after puts on this fabric.
    pub fn signal_ordering(&self) -> SignalOrdering {
        self.shared.ordering
    }

    /// The provider actually opened (`prov_name`).
    pub fn provider(&self) -> &str {
        &self.shared.ep.provider.name
    }

    /// Overrides the wait policy of this rank.
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        self.wait_policy = policy;
    }

    /// The bootstrap this fabric was built on.
    pub fn exchange(&self) -> &Arc<dyn Exchange> {
        &self.shared.exchange
    }
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn touch_all(&self) {
        let now = self.now_ms();
        for t in &self.last_heard {
            t.store(now, Ordering::Relaxed);
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

    fn window(&self) -> Window<'_> {
        // SAFETY: the window lies inside the region (window_off + window_len = region length),
        // which lives as long as `self`.
        unsafe {
            Window::from_raw(
                self.region.ptr().add(self.window_off),
                self.window_len,
                self.rank,
            )
        }
    }

    fn mark_failed(&self, peer: usize, detail: String) {
        if peer < self.failed.len() {
            let _ = self.failed[peer].set(detail);
        }
        self.control.wake();
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        self.peer(peer)?;
        if peer == self.rank {
            return Ok(());
        }
        if self.departed[peer].load(Ordering::Acquire) {
            return Err(Error::PeerFailed {
                peer,
                detail: "left the job (its ofi fabric was dropped)".into(),
            });
        }
        if let Some(detail) = self.failed[peer].get() {
            return Err(Error::PeerFailed {
                peer,
                detail: detail.clone(),
            });
        }
        let silent = self
            .now_ms()
            .saturating_sub(self.last_heard[peer].load(Ordering::Relaxed));
        if silent > LIVENESS_TIMEOUT.as_millis() as u64 {
            let detail = format!("no heartbeat for {silent} ms over libfabric");
            self.mark_failed(peer, detail.clone());
            return Err(Error::PeerFailed { peer, detail });
        }
        Ok(())
    }

    /// Out-of-band abort, then every peer that has not left the job cleanly (see
    /// [`Fabric::check_peers`]).
    fn check_peers(&self) -> Result<()> {
        if let Some(notice) = self.exchange.poll_abort() {
            return Err(notice.to_error(self.peers.len()));
        }
        (0..self.peers.len())
            .filter(|&p| !self.departed[p].load(Ordering::Acquire))
            .try_for_each(|p| self.check_peer(p))
    }

    /// Reads and handles completions. `block_ms > 0` waits that long for one (progress thread
    /// only). Returns how many were handled; 0 if another thread is reading the CQ.
    fn progress(&self, block_ms: i32) -> usize {
        let guard = if block_ms > 0 {
            self.cq_lock.lock().unwrap_or_else(|e| e.into_inner())
        } else {
            match self.cq_lock.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return 0,
            }
        };
        // SAFETY: fi_cq_data_entry is plain old data; zeroed is a valid value.
        let mut entries: [CqEntry; 16] = unsafe { std::mem::zeroed() };
        let mut handled = 0;
        let mut block = block_ms;
        loop {
            let n = self.ep.read_cq(&mut entries, block);
            block = 0;
            if n > 0 {
                for e in &entries[..n as usize] {
                    self.complete(e);
                }
                handled += n as usize;
                if (n as usize) < entries.len() {
                    break;
                }
            } else if n == -(sys::FI_EAVAIL as isize) {
                let mut any = false;
                while let Some((context, detail)) = self.ep.read_error() {
                    self.fail_op(context, detail);
                    handled += 1;
                    any = true;
                }
                if !any {
                    break;
                }
            } else {
                // -FI_EAGAIN (nothing) or a CQ-level error; the latter shows up as op timeouts
                // naming the peer.
                break;
            }
        }
        drop(guard);
        handled
    }

    fn complete(&self, e: &CqEntry) {
        if e.flags & u64::from(sys::FI_REMOTE_CQ_DATA) != 0 {
            self.remote_event(e.data);
            return;
        }
        let id = e.op_context as u64;
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let forget = match ops.table.get_mut(&id) {
            Some(op) => {
                self.finish(op, Ok(()));
                op.fire_and_forget
            }
            None => false,
        };
        if forget {
            if let Some(op) = ops.table.remove(&id) {
                self.retire(&op);
            }
        }
    }

    /// Records the outcome of an operation (once).
    fn finish(&self, op: &mut Op, result: std::result::Result<(), String>) {
        if op.done.is_none() && !op.heartbeat {
            self.inflight.fetch_sub(1, Ordering::AcqRel);
        }
        op.done = Some(result);
    }

    /// Removes an operation that was never posted.
    fn unpost(&self, id: u64) {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mut op) = ops.table.remove(&id) {
            self.finish(&mut op, Err("not posted".into()));
            self.retire(&op);
        }
    }

    fn retire(&self, op: &Op) {
        if op.heartbeat {
            self.heartbeat_pending[op.peer].store(false, Ordering::Release);
        } else if op.fire_and_forget {
            self.outstanding[op.peer].fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn fail_op(&self, context: u64, detail: String) {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let Some(op) = ops.table.get_mut(&context) else {
            return;
        };
        let peer = op.peer;
        self.finish(op, Err(detail.clone()));
        if op.fire_and_forget {
            if let Some(op) = ops.table.remove(&context) {
                self.retire(&op);
            }
        }
        drop(ops);
        self.mark_failed(peer, format!("libfabric operation failed: {detail}"));
    }

    fn remote_event(&self, data: u64) {
        let (kind, sender, slot) = decode(data);
        if sender >= self.peers.len() {
            return;
        }
        self.last_heard[sender].store(self.now_ms(), Ordering::Relaxed);
        match kind {
            KIND_SIGNAL if slot < self.num_slots => {
                let off = self.mailbox_off + (sender * (self.num_slots + 1) + slot) * 8;
                // SAFETY: `off` is 8-aligned inside the mailbox area of the region; the provider
                // placed the write before reporting its completion, and the word is only read
                // atomically here (the wire write is not atomic, so waiters never read it).
                let word = unsafe { &*self.region.ptr().as_ptr().add(off).cast::<AtomicU64>() };
                let value = word.load(Ordering::Acquire);
                let _ = self.control.store(slot, value, self.rank);
            }
            KIND_HEARTBEAT if slot == DEPARTING => {
                self.departed[sender].store(true, Ordering::Release);
                self.control.wake();
            }
            KIND_ABORT => {
                let len = slot.min(ABORT_REASON_BYTES);
                let off = self.abort_off + sender * ABORT_RECORD_BYTES;
                let mut record = vec![0u8; 16 + len];
                // SAFETY: the sender's abort record lies inside the region; the provider placed
                // the write before reporting its completion, and only that sender writes it.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.region.ptr().as_ptr().add(off),
                        record.as_mut_ptr(),
                        16 + len,
                    )
                };
                let word = |i: usize| {
                    u64::from_le_bytes(record[8 * i..8 * i + 8].try_into().expect("8 bytes"))
                };
                // A rank outside the job cannot have raised it: then it is the sender's.
                let by = match word(0) {
                    0 => sender,
                    b => usize::try_from(b - 1)
                        .ok()
                        .filter(|&b| b < self.peers.len())
                        .unwrap_or(sender),
                };
                // Checked against the job where it is turned into an error
                // (`AbortNotice::to_error`).
                let dead = match word(1) {
                    0 => None,
                    d => Some(usize::try_from(d - 1).unwrap_or(usize::MAX)),
                };
                self.control
                    .set_abort(by, dead, &String::from_utf8_lossy(&record[16..]));
            }
            _ => {}
        }
    }

    /// Registers an operation owning `buf`; returns its id (the libfabric context).
    fn new_op(&self, peer: usize, buf: Box<[u8]>, fire_and_forget: bool, heartbeat: bool) -> u64 {
        if !heartbeat {
            self.inflight.fetch_add(1, Ordering::AcqRel);
        }
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        ops.next += 1;
        let id = ops.next;
        ops.table.insert(
            id,
            Op {
                peer,
                buf,
                done: None,
                fire_and_forget,
                heartbeat,
            },
        );
        id
    }

    fn buf_ptr(&self, id: u64) -> (*mut u8, usize) {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let op = ops.table.get_mut(&id).expect("op registered just before");
        (op.buf.as_mut_ptr(), op.buf.len())
    }

    /// Posts `post` (which returns a libfabric code) until it is accepted, driving progress on
    /// `-FI_EAGAIN`; fails naming `peer` on another error, a dead peer or the deadline.
    fn post_retrying(
        &self,
        peer: usize,
        what: &str,
        deadline: Instant,
        post: &dyn Fn() -> isize,
    ) -> Result<()> {
        loop {
            let rc = post();
            if rc == 0 {
                return Ok(());
            }
            if rc != -(sys::FI_EAGAIN as isize) {
                return Err(Error::PeerFailed {
                    peer,
                    detail: format!(
                        "posting {what} to rank {peer}: {}",
                        self.ep.error_string(rc as i64)
                    ),
                });
            }
            self.check_peer(peer)?;
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    peer,
                    what: format!("room in the libfabric queue to post {what}"),
                    waited: self.timeout,
                });
            }
            if self.progress(0) == 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Posts a delivery-complete write of `bytes` to `remote` at `peer`, owned by the op table.
    fn write(
        &self,
        peer: usize,
        remote: u64,
        bytes: Box<[u8]>,
        data: Option<u64>,
        heartbeat: bool,
    ) -> Result<()> {
        let p = self.peer(peer)?;
        let id = self.new_op(peer, bytes, true, heartbeat);
        let (ptr, len) = self.buf_ptr(id);
        if !heartbeat {
            self.outstanding[peer].fetch_add(1, Ordering::AcqRel);
        }
        let deadline = deadline_after(self.timeout);
        let r = self.post_retrying(peer, "an RMA write", deadline, &|| {
            // SAFETY: the buffer is owned by op `id`, which stays in the table until its
            // completion is read (or forever, if none comes).
            unsafe {
                self.ep
                    .post_write(p.addr, ptr, len, remote, p.key, data, id)
            }
        });
        if let Err(e) = r {
            // Never posted: nothing will complete it.
            self.unpost(id);
            return Err(e);
        }
        Ok(())
    }

    /// Waits until `done()` or the deadline, driving progress; fails early if `peer` fails.
    fn wait_op(
        &self,
        peer: usize,
        what: &str,
        deadline: Instant,
        done: &dyn Fn() -> bool,
    ) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if done() {
                return Ok(());
            }
            if self.progress(0) > 0 {
                continue;
            }
            if done() {
                return Ok(());
            }
            self.check_peer(peer)?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    peer,
                    what: what.to_string(),
                    waited: now - start,
                });
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 2048 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn progress_loop(&self) {
        let mut last_beat = Instant::now() - HEARTBEAT_EVERY;
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            let quiet = self.inflight.load(Ordering::Acquire) == 0;
            let patience = if self.waiters.load(Ordering::Acquire) > 0 {
                POLL_WHILE_WAITED
            } else {
                16
            };
            let sleepy = quiet && idle > patience;
            let provider = &self.ep.provider;

            // Blocking: on the wait fd without the CQ lock where there is one (waiters may read
            // the CQ meanwhile), else in fi_cq_sread, else a short sleep.
            let handled = if sleepy && provider.wait_fd.is_some() {
                self.ep.wait_for_activity(1);
                self.progress(0)
            } else if sleepy && provider.cq_can_block {
                self.progress(1)
            } else {
                self.progress(0)
            };
            if handled > 0 {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if sleepy && !provider.cq_can_block {
                    std::thread::sleep(Duration::from_micros(100));
                } else if !sleepy {
                    std::thread::yield_now();
                }
            }
            if last_beat.elapsed() >= HEARTBEAT_EVERY {
                last_beat = Instant::now();
                self.send_heartbeats();
            }
        }
    }

    fn send_heartbeats(&self) {
        for (peer, p) in self.peers.iter().enumerate() {
            if peer == self.rank || self.failed[peer].get().is_some() {
                continue;
            }
            if self.heartbeat_pending[peer].swap(true, Ordering::AcqRel) {
                continue;
            }
            let remote = p.remote_base
                + (p.mailbox_off + (self.rank * (self.num_slots + 1) + self.num_slots) * 8) as u64;
            let data = encode(KIND_HEARTBEAT, self.rank, 0);
            let beat = self.now_ms().to_le_bytes();
            let id = self.new_op(peer, Box::new(beat), true, true);
            let (ptr, len) = self.buf_ptr(id);
            // SAFETY: the buffer is owned by op `id` until its completion.
            let rc = unsafe {
                self.ep
                    .post_write(p.addr, ptr, len, remote, p.key, Some(data), id)
            };
            if rc != 0 {
                // Not posted (queue full or error): try again next period.
                self.unpost(id);
            }
        }
    }

    /// Waits (bounded) for every outstanding write.
    /// Waits (bounded) for every outstanding write to every peer; a peer that fails does not
    /// stop the wait for the others. The error names the first peer that failed.
    fn flush(&self, deadline: Instant) -> Result<()> {
        let mut first = Ok(());
        for peer in 0..self.peers.len() {
            let r = self.wait_op(
                peer,
                "completion of earlier writes (flush)",
                deadline,
                &|| self.outstanding[peer].load(Ordering::Acquire) == 0,
            );
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

// SAFETY: put, get and signal touch only the bounds-checked ranges they are given in windows
// registered for the fabric's life; the fabric writes no window on its own.
unsafe impl Fabric for OfiFabric {
    fn name(&self) -> &'static str {
        "ofi"
    }

    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.peers.len()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            load_store: false,
            remote_read: true,
            chunk_floor: chunk_floor(self.provider()),
        }
    }

    fn window_len(&self, rank: usize) -> usize {
        self.shared.peers.get(rank).map_or(0, |p| p.window_len)
    }

    fn num_signal_slots(&self) -> usize {
        self.shared.num_slots
    }

    fn local_window(&self) -> Option<Window<'_>> {
        Some(self.shared.window())
    }

    fn peer_window(&self, _peer: usize) -> Option<Window<'_>> {
        None
    }

    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()> {
        let s = &self.shared;
        let p = s.peer(peer)?;
        if peer == s.rank {
            return s.window().write(offset, data);
        }
        match offset.checked_add(data.len()) {
            Some(end) if end <= p.window_len => {}
            _ => {
                return Err(Error::OutOfWindow {
                    peer,
                    offset,
                    len: data.len(),
                    window: p.window_len,
                })
            }
        }
        s.check_peer(peer)?;
        if data.is_empty() {
            return Ok(());
        }
        let max = s.max_op;
        for (i, chunk) in data.chunks(max).enumerate() {
            let remote = p.remote_base + (p.window_off + offset + i * max) as u64;
            s.write(peer, remote, chunk.into(), None, false)?;
        }
        Ok(())
    }

    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        let s = &self.shared;
        let p = s.peer(peer)?;
        if peer == s.rank {
            return s.window().read(offset, buf);
        }
        match offset.checked_add(buf.len()) {
            Some(end) if end <= p.window_len => {}
            _ => {
                return Err(Error::OutOfWindow {
                    peer,
                    offset,
                    len: buf.len(),
                    window: p.window_len,
                })
            }
        }
        s.check_peer(peer)?;
        if buf.is_empty() {
            return Ok(());
        }
        let deadline = deadline_after(s.timeout);
        let max = s.max_op;
        for (i, out) in buf.chunks_mut(max).enumerate() {
            let remote = p.remote_base + (p.window_off + offset + i * max) as u64;
            let id = s.new_op(peer, vec![0u8; out.len()].into(), false, false);
            let (ptr, len) = s.buf_ptr(id);
            let posted = s.post_retrying(peer, "an RMA read", deadline, &|| {
                // SAFETY: the bounce buffer is owned by op `id`, which stays in the table until
                // its completion is read (or forever, if none comes).
                unsafe { s.ep.post_read(p.addr, ptr, len, remote, p.key, id) }
            });
            if let Err(e) = posted {
                s.unpost(id);
                return Err(e);
            }
            let finished = || {
                let ops = s.ops.lock().unwrap_or_else(|p| p.into_inner());
                ops.table.get(&id).is_some_and(|op| op.done.is_some())
            };
            s.wait_op(peer, "completion of an RMA read", deadline, &finished)?;
            let op = {
                let mut ops = s.ops.lock().unwrap_or_else(|p| p.into_inner());
                ops.table.remove(&id).expect("completed op is in the table")
            };
            match op.done {
                Some(Ok(())) => out.copy_from_slice(&op.buf),
                Some(Err(detail)) => {
                    return Err(Error::PeerFailed {
                        peer,
                        detail: format!("RMA read failed: {detail}"),
                    })
                }
                None => unreachable!("waited for completion"),
            }
        }
        Ok(())
    }

    fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        let s = &self.shared;
        let p = s.peer(peer)?;
        if slot >= s.num_slots {
            return Err(Error::invalid(format!(
                "signal slot {slot} out of range: rank {peer} has {} slots",
                s.num_slots
            )));
        }
        if peer == s.rank {
            return s.control.store(slot, value, peer);
        }
        s.check_peer(peer)?;
        if s.ordering == SignalOrdering::Completion {
            // Ordering by completion: every earlier put to `peer` is delivered before the signal
            // is posted.
            let deadline = deadline_after(s.timeout);
            s.wait_op(
                peer,
                "delivery of earlier puts before a signal",
                deadline,
                &|| s.outstanding[peer].load(Ordering::Acquire) == 0,
            )?;
        }
        // Ordered: the provider places this write after every earlier one to `peer` (each at
        // most `max_order_waw_size`), and reports it at the target only once placed.
        let remote =
            p.remote_base + (p.mailbox_off + (s.rank * (s.num_slots + 1) + slot) * 8) as u64;
        s.write(
            peer,
            remote,
            Box::new(value.to_le_bytes()),
            Some(encode(KIND_SIGNAL, s.rank, slot)),
            false,
        )
    }

    fn signal_value(&self, slot: usize) -> u64 {
        self.shared.control.load(slot)
    }

    fn flush(&self) -> Result<()> {
        self.shared.flush(deadline_after(self.shared.timeout))
    }

    fn wait_counters(&self) -> WaitCounters {
        self.wait_state.counters()
    }

    fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()> {
        let s = &self.shared;
        let liveness = |awaited: usize| {
            s.check_peer(awaited)?;
            s.check_peers()
        };
        let mut polled = || {
            s.progress(0);
            poll()
        };
        s.waiters.fetch_add(1, Ordering::AcqRel);
        let r = s.control.wait_with(
            self.wait_policy,
            &self.wait_state,
            deadline,
            &mut polled,
            &liveness,
        );
        s.waiters.fetch_sub(1, Ordering::AcqRel);
        r
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.shared.exchange.barrier(timeout)
    }

    fn abort_reporting(&self, dead: Option<usize>, reason: &str) {
        let s = &self.shared;
        self.raise_abort(s.rank, dead, reason);
        // Ranks that lost their connection to us, or wait on the bootstrap, hear it out of band.
        let _ = s.exchange.broadcast_abort_reporting(dead, reason);
    }

    fn forward_abort(&self, notice: &AbortNotice) {
        self.raise_abort(notice.by, notice.dead, &notice.reason);
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        self.shared.check_peer(peer)
    }

    fn check_peers(&self) -> Result<()> {
        self.shared.check_peers()
    }

    fn aborted(&self) -> Option<AbortNotice> {
        self.shared.control.aborted_by()
    }
}

impl OfiFabric {
    /// Sets the abort record `{by, dead, reason}` in this rank's control area and writes it to
    /// every peer not known failed, then waits (bounded) for the writes.
    fn raise_abort(&self, by: usize, dead: Option<usize>, reason: &str) {
        let s = &self.shared;
        s.control.set_abort(by, dead, reason);
        let mut cut = reason.len().min(ABORT_REASON_BYTES);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        // The record: the by and dead words, then the reason (its length travels in the CQ
        // data). `by` is 0 when the sender raised the abort itself.
        let by_word = if by == s.rank { 0 } else { by as u64 + 1 };
        let dead_word = dead.map_or(0, |d| (d as u64).saturating_add(1));
        let mut record = Vec::with_capacity(16 + cut);
        record.extend_from_slice(&by_word.to_le_bytes());
        record.extend_from_slice(&dead_word.to_le_bytes());
        record.extend_from_slice(&reason.as_bytes()[..cut]);
        let bytes: Box<[u8]> = record.into();
        for (peer, p) in s.peers.iter().enumerate() {
            if peer == s.rank || s.failed[peer].get().is_some() {
                continue;
            }
            let remote = p.remote_base + (p.abort_off + s.rank * ABORT_RECORD_BYTES) as u64;
            let data = encode(KIND_ABORT, s.rank, cut);
            let _ = s.write(peer, remote, bytes.clone(), Some(data), false);
        }
        // Bounded: a peer that cannot be reached is dead anyway.
        let _ = s.flush(Instant::now() + Duration::from_secs(2));
    }
}

impl Drop for OfiFabric {
    fn drop(&mut self) {
        // Deliver what was posted (bounded), tell the peers this rank leaves cleanly (so waits on
        // other ranks do not take its silence for a crash), then stop progress and close.
        let s = &self.shared;
        let _ = s.flush(Instant::now() + Duration::from_secs(2));
        s.control.set_departed();
        for (peer, p) in s.peers.iter().enumerate() {
            if peer == s.rank || s.failed[peer].get().is_some() {
                continue;
            }
            let remote = p.remote_base
                + (p.mailbox_off + (s.rank * (s.num_slots + 1) + s.num_slots) * 8) as u64;
            let data = encode(KIND_HEARTBEAT, s.rank, DEPARTING);
            let _ = s.write(peer, remote, Box::new([0u8; 8]), Some(data), false);
        }
        let _ = s.flush(Instant::now() + Duration::from_secs(2));
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.progress.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::ThreadExchange;
    use crate::fabric::conformance::{self, min_slots, MIN_WINDOW};

    #[test]
    fn only_the_tcp_provider_raises_the_chunk_floor() {
        assert_eq!(chunk_floor("tcp"), 4 << 20);
        assert_eq!(chunk_floor("tcp;ofi_rxm"), 4 << 20);
        for other in ["verbs;ofi_rxm", "efa", "shm", "ofi_rxm;tcp", ""] {
            assert_eq!(chunk_floor(other), 0, "{other}");
        }
    }

    fn on_threads<T: Send>(n: usize, per_rank: impl Fn(Arc<dyn Exchange>) -> T + Sync) -> Vec<T> {
        let exchanges: Vec<Arc<dyn Exchange>> = ThreadExchange::group(n)
            .into_iter()
            .map(|e| Arc::new(e) as Arc<dyn Exchange>)
            .collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = exchanges
                .into_iter()
                .map(|ex| {
                    let f = &per_rank;
                    s.spawn(move || f(ex))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        })
    }

    fn loopback() -> OfiOptions {
        OfiOptions {
            provider: Some(DEFAULT_PROVIDER.into()),
            addr: Some("127.0.0.1".into()),
            timeout: Duration::from_secs(20),
            ordering: None,
        }
    }

    #[test]
    fn ofi_fabric_on_threads_passes_conformance_with_3_ranks() {
        let results = on_threads(3, |ex| {
            let f = OfiFabric::with_options(ex, MIN_WINDOW, min_slots(3), &loopback())?;
            conformance::run_all(&f)
        });
        for (rank, r) in results.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    }

    #[test]
    fn different_slot_counts_fail_every_rank_naming_the_peer() {
        let results = on_threads(2, |ex| {
            let slots = 4 + ex.rank();
            OfiFabric::with_options(ex, MIN_WINDOW, slots, &loopback()).map(drop)
        });
        assert!(
            matches!(&results[0], Err(Error::Protocol { peer: 1, .. })),
            "{:?}",
            results[0]
        );
        assert!(
            matches!(&results[1], Err(Error::Protocol { peer: 0, .. })),
            "{:?}",
            results[1]
        );
    }

    #[test]
    fn cq_data_round_trips_in_32_bits() {
        for (k, s, l) in [(1, 0, 0), (3, MAX_RANKS - 1, MAX_SLOTS), (2, 77, 1234)] {
            let d = encode(k, s, l);
            assert!(d < 1 << 32);
            assert_eq!(decode(d), (k, s, l));
        }
    }

    #[test]
    fn advert_round_trips_and_rejects_garbage() {
        let a = Advert {
            key: 7,
            remote_base: 0x7f00_0000_1000,
            num_slots: 9,
            mailbox_off: 1024,
            abort_off: 2048,
            window_off: 8192,
            window_len: 65536,
            pid: 42,
            name: vec![2, 0, 1, 2, 127, 0, 0, 1],
        };
        assert_eq!(Advert::decode(&a.encode(), 3).unwrap(), a);
        assert!(matches!(
            Advert::decode(&[0u8; 88], 3),
            Err(Error::Protocol { peer: 3, .. })
        ));
        let mut short = a.encode();
        short.pop();
        assert!(matches!(
            Advert::decode(&short, 5),
            Err(Error::Protocol { peer: 5, .. })
        ));
    }
}
