//! The shared-memory fabric: ranks are processes on one host.
//!
//! This module owns the POSIX shared-memory segments of a job, their mappings, and the liveness
//! check of peer processes. Each rank creates **one** segment, named
//! `/xccl-<job id, 16 hex digits>-<tag, 24 hex digits>` (`O_CREAT | O_EXCL`, mode `0600`), where
//! the tag is derived from the job's secret key, the job id and the rank ([`segment_name`]):
//! other users of the host, who may know the job id, cannot predict the names and so cannot
//! create them first. A rank attaching to a peer's segment checks, before mapping it, that the
//! segment belongs to this process's user and has mode `0600` (`fstat`), so a segment someone
//! else made is never mapped nor given the job's data:
//!
//! | offset | what |
//! |---|---|
//! | 0 | the rank's [`ControlArea`] (header, doorbell, abort word, signal slots) |
//! | `window_offset` (page-aligned) | the rank's data window, `window_len` bytes |
//!
//! [`ShmFabric::new`] allgathers `{pid, window offset and length, segment length, slot count,
//! host}` through the bootstrap, then every rank opens and maps every peer's segment and checks
//! its header ([`ControlArea::attach`]: magic, layout version, size; then slot count and owner
//! pid). A second allgather reports each rank's outcome, so a rank that cannot attach makes every
//! rank fail fast, naming it; it is also the barrier after which every segment has been opened
//! by every rank. Then each rank unlinks its own name and, idempotently, every other rank's: once
//! `new` returns, `/dev/shm` holds nothing of the job, whatever is killed later (the kernel frees
//! the memory when the last mapping goes). If `new` fails midway, the rank still unlinks what it
//! created, and the names of peers that may have died after creating theirs.
//!
//! `put`/`get` are bounds-checked `memcpy` into/out of the mapped peer window; `signal` is a
//! Release store plus a futex wake on the peer's mapped control area, which orders it after every
//! earlier put of this rank (all puts are plain stores to coherent memory). Waits run the shared
//! loop of [`ControlArea::wait_with`] on this rank's own area, with the [`WaitPolicy`] for the
//! job's rank count on this host; between sleeps they check that
//! the awaited peer process is alive through a `pidfd` opened at init (readable once the process
//! exits, even while it is an unreaped zombie), falling back to `kill(pid, 0)` on kernels
//! without `pidfd_open`.

use std::ffi::CString;
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{mmap, munmap, shm_open, shm_unlink, MapFlags, ProtFlags};
use nix::sys::stat::Mode;

use super::{
    Capabilities, ControlArea, Fabric, WaitCounters, WaitPolicy, WaitState, Waiting, Window,
};
use crate::bootstrap::{Exchange, JobKey};
use crate::{AbortNotice, Error, Result};

/// How long [`ShmFabric::new`] waits for the other ranks at each rendezvous step.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Tag at the start of the blob each rank publishes at init ("XCCLSHM1").
const ADVERT_MAGIC: u64 = u64::from_le_bytes(*b"XCCLSHM1");
/// Number of little-endian `u64` fields in the advert blob.
const ADVERT_WORDS: usize = 8;

/// The name, as it appears in `/dev/shm`, that every segment of job `job_id` starts with.
///
/// Useful to check that a job left nothing behind.
pub fn segment_prefix(job_id: u64) -> String {
    format!("xccl-{job_id:016x}-")
}

/// The `shm_open` name of rank `rank`'s segment in job `job_id` with key `key`: the job's
/// [`segment_prefix`] and 96 bits of an HMAC of the job id and rank under the key.
pub fn segment_name(key: &JobKey, job_id: u64, rank: usize) -> String {
    let tag = key.derive(
        "shm-segment",
        &[&job_id.to_le_bytes(), &(rank as u64).to_le_bytes()],
    );
    let hex: String = tag[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("/{}{hex}", segment_prefix(job_id))
}

/// This process's effective user id: the owner of every segment of the job on this host.
fn effective_uid() -> u32 {
    // SAFETY: `geteuid` takes no arguments, touches no memory of ours and always succeeds.
    unsafe { libc::geteuid() }
}

/// Checks, before mapping, that `file` (rank `peer`'s segment `name`) is owned by this process's
/// effective user and is readable and writable by it alone (mode `0600`).
fn check_owner_and_mode(file: &File, peer: usize, name: &str) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    // `fstat` of the open descriptor: what is checked is what gets mapped.
    let st = file
        .metadata()
        .map_err(|e| Error::os(format!("inspecting rank {peer}'s segment {name}"), e))?;
    let me = effective_uid();
    let mode = st.mode() & 0o7777;
    if st.uid() != me || mode != 0o600 {
        return Err(Error::Protocol {
            peer,
            detail: format!(
                "shared-memory segment {name} belongs to uid {} with mode {mode:04o}; a segment \
                 of this job belongs to uid {me} with mode 0600 (someone else created it: not \
                 mapped)",
                st.uid()
            ),
        });
    }
    Ok(())
}

/// What each rank tells the others about its segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Advert {
    pid: u32,
    num_slots: usize,
    window_offset: usize,
    window_len: usize,
    segment_len: usize,
    /// FNV-1a of the kernel boot id; 0 if unknown. Ranks on different hosts cannot share memory.
    host: u64,
}

impl Advert {
    fn encode(&self) -> Vec<u8> {
        let words: [u64; ADVERT_WORDS] = [
            ADVERT_MAGIC,
            u64::from(self.pid),
            self.num_slots as u64,
            self.window_offset as u64,
            self.window_len as u64,
            self.segment_len as u64,
            self.host,
            0,
        ];
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn decode(blob: &[u8], peer: usize) -> Result<Self> {
        let bad = |detail: String| Error::Protocol { peer, detail };
        if blob.len() != ADVERT_WORDS * 8 {
            return Err(bad(format!(
                "shm advert of {} bytes, expected {}",
                blob.len(),
                ADVERT_WORDS * 8
            )));
        }
        let mut w = [0u64; ADVERT_WORDS];
        for (i, chunk) in blob.chunks_exact(8).enumerate() {
            w[i] = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
        }
        if w[0] != ADVERT_MAGIC {
            return Err(bad(format!(
                "shm advert tag {:#x}, expected {ADVERT_MAGIC:#x} (not an xccl shm rank?)",
                w[0]
            )));
        }
        let size = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| bad(format!("{what} {v} does not fit in usize")))
        };
        Ok(Advert {
            pid: u32::try_from(w[1]).map_err(|_| bad(format!("pid {} out of range", w[1])))?,
            num_slots: size(w[2], "slot count")?,
            window_offset: size(w[3], "window offset")?,
            window_len: size(w[4], "window length")?,
            segment_len: size(w[5], "segment length")?,
            host: w[6],
        })
    }
}

/// A `MAP_SHARED` mapping, unmapped on drop.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; all concurrent access goes
// through atomics (control area) or byte copies / protocol-guarded borrows (`Window`).
unsafe impl Send for Mapping {}
// SAFETY: see `Send`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` read-write and shared.
    fn map(file: &File, len: usize, what: impl Fn() -> String) -> Result<Self> {
        let nz = NonZeroUsize::new(len)
            .ok_or_else(|| Error::invalid(format!("{}: zero-length segment", what())))?;
        // SAFETY: a fresh mapping chosen by the kernel (no fixed address), so no existing memory
        // of this process is replaced; the fd refers to a shared-memory object at least `len`
        // bytes long (checked or set by every caller). The mapping lives until `Drop`.
        let ptr = unsafe {
            mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                file.as_fd(),
                0,
            )
        }
        .map_err(|e| Error::os(format!("mapping {}", what()), e))?;
        Ok(Mapping {
            base: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is exactly a mapping made in `Mapping::map` and not unmapped
        // since; every view into it (control areas, windows) borrows the owning fabric, so none
        // outlives this call.
        let _ = unsafe { munmap(self.base.cast(), self.len) };
    }
}

/// How this rank learns whether a peer process is still alive.
#[derive(Debug)]
pub(crate) enum Liveness {
    /// The peer lives in this very process (ranks as threads): alive while we are.
    SameProcess,
    /// A pidfd, readable once the process has exited.
    PidFd(OwnedFd),
    /// No pidfd support: `kill(pid, 0)` (cannot see zombies as dead).
    Kill(i32),
}

/// Pidfds one `poll` of [`Liveness::check_all`] looks at (an array on the stack).
const POLL_BATCH: usize = 64;

impl Liveness {
    pub(crate) fn open(pid: u32, peer: usize) -> Result<Self> {
        if pid == std::process::id() {
            return Ok(Liveness::SameProcess);
        }
        let raw_pid = i32::try_from(pid).map_err(|_| Error::Protocol {
            peer,
            detail: format!("pid {pid} out of range"),
        })?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is
        // passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
        if fd >= 0 {
            // SAFETY: the syscall returned a fresh fd that nothing else owns.
            return Ok(Liveness::PidFd(unsafe { OwnedFd::from_raw_fd(fd as i32) }));
        }
        match Errno::last() {
            Errno::ESRCH => Err(Error::PeerFailed {
                peer,
                detail: format!("process {pid} exited during init"),
            }),
            _ => Ok(Liveness::Kill(raw_pid)),
        }
    }

    /// Checks every peer process but `me`, with one `poll` per [`POLL_BATCH`] of their pidfds
    /// (one check each where there is no pidfd); the error names the lowest dead rank. Nothing
    /// is allocated: waits run this while they wait, calls in steady state allocate nothing.
    fn check_all(segments: &[Segment], me: usize) -> Result<()> {
        let none = libc::pollfd {
            fd: -1,
            events: 0,
            revents: 0,
        };
        let mut fds = [none; POLL_BATCH];
        let mut ranks = [0usize; POLL_BATCH];
        let mut n = 0;
        for (peer, s) in segments.iter().enumerate() {
            match &s.liveness {
                _ if peer == me => {}
                // Finished, not dead: only a wait for it (the awaited peer) reports it.
                _ if s.control.departed() => {}
                Liveness::SameProcess => {}
                Liveness::PidFd(fd) => {
                    fds[n] = libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    ranks[n] = peer;
                    n += 1;
                    if n == POLL_BATCH {
                        Self::poll_batch(segments, &mut fds[..n], &ranks[..n])?;
                        n = 0;
                    }
                }
                Liveness::Kill(_) => s.liveness.check(peer, s.pid)?,
            }
        }
        Self::poll_batch(segments, &mut fds[..n], &ranks[..n])
    }

    /// One `poll` of the pidfds `fds` of peers `ranks`: the first that is readable (its
    /// process exited) is an error, unless it departed cleanly meanwhile.
    fn poll_batch(segments: &[Segment], fds: &mut [libc::pollfd], ranks: &[usize]) -> Result<()> {
        if fds.is_empty() {
            return Ok(());
        }
        // SAFETY: `fds` is an exclusive slice of `fds.len()` initialized `pollfd`s (at most
        // POLL_BATCH, so the count fits `nfds_t`); their descriptors are pidfds the segments own
        // and keep open for this call; timeout 0 never blocks.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
        match ready {
            0 => Ok(()),
            r if r < 0 => match Errno::last() {
                Errno::EINTR => Ok(()),
                e => Err(Error::os("polling the pidfds of the peer processes", e)),
            },
            _ => {
                let dead = fds
                    .iter()
                    .zip(ranks)
                    .find(|(fd, _)| fd.revents != 0)
                    .map_or(ranks[0], |(_, &r)| r);
                if segments[dead].control.departed() {
                    // It left cleanly between the two reads.
                    return Ok(());
                }
                Err(Error::PeerFailed {
                    peer: dead,
                    detail: format!("process {} exited", segments[dead].pid),
                })
            }
        }
    }

    pub(crate) fn check(&self, peer: usize, pid: u32) -> Result<()> {
        let dead = || Error::PeerFailed {
            peer,
            detail: format!("process {pid} exited"),
        };
        match self {
            Liveness::SameProcess => Ok(()),
            Liveness::PidFd(fd) => {
                use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
                let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
                match poll(&mut fds, PollTimeout::ZERO) {
                    Ok(0) | Err(Errno::EINTR) => Ok(()),
                    Ok(_) => Err(dead()),
                    Err(e) => Err(Error::os(
                        format!("polling the pidfd of rank {peer} (process {pid})"),
                        e,
                    )),
                }
            }
            Liveness::Kill(p) => {
                match nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p), None) {
                    Err(Errno::ESRCH) => Err(dead()),
                    _ => Ok(()),
                }
            }
        }
    }
}

/// One rank's segment as mapped in this process.
struct Segment {
    /// Owns the memory that `control` and the window view.
    map: Mapping,
    control: ControlArea,
    window_offset: usize,
    window_len: usize,
    pid: u32,
    liveness: Liveness,
}

/// Unlinks segment names when dropped: this rank's own, and, once the segments of the other
/// ranks are known to exist, theirs too (`ENOENT` is ignored, so every rank can do it).
struct Unlinker(Vec<CString>);

impl Drop for Unlinker {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = shm_unlink(name.as_c_str());
        }
    }
}

/// One rank's endpoint of the shared-memory fabric. See the module docs.
///
/// Ranks may also be threads of one process (over [`crate::bootstrap::ThreadExchange`]); such
/// peers share this process's pid and are never reported dead by [`Fabric::check_peer`].
pub struct ShmFabric {
    exchange: Arc<dyn Exchange>,
    rank: usize,
    num_slots: usize,
    /// Indexed by rank; this rank's own segment included.
    segments: Vec<Segment>,
    /// How waits spin, yield and sleep (every rank of the job is on this host).
    wait_policy: WaitPolicy,
    /// What this rank's waits observed (adapts the phases) and their counters.
    wait_state: WaitState,
}

impl std::fmt::Debug for ShmFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmFabric")
            .field("rank", &self.rank)
            .field("world_size", &self.segments.len())
            .field("num_slots", &self.num_slots)
            .field("job_id", &format_args!("{:016x}", self.exchange.job_id()))
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

/// FNV-1a of the kernel's boot id: equal for processes of one host (one kernel).
pub(crate) fn host_id() -> u64 {
    match std::fs::read("/proc/sys/kernel/random/boot_id") {
        Ok(bytes) => bytes
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
            .max(1),
        Err(_) => 0,
    }
}

/// Creates, sizes and maps this rank's segment, and formats its control area.
fn create_own(
    name: &CString,
    segment_len: usize,
    num_slots: usize,
    rank: usize,
    world: usize,
) -> Result<(Unlinker, Mapping, ControlArea)> {
    let shown = name.to_string_lossy();
    let fd = shm_open(
        name.as_c_str(),
        OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
        Mode::S_IRUSR | Mode::S_IWUSR,
    )
    .map_err(|e| {
        let hint = if e == Errno::EEXIST {
            " (a segment of the same job id and rank exists: a duplicate rank, or a leftover \
             of a crashed job in /dev/shm)"
        } else {
            ""
        };
        Error::os(format!("creating shared-memory segment {shown}{hint}"), e)
    })?;
    // From here on the name exists: unlink it whatever happens.
    let unlinker = Unlinker(vec![name.clone()]);
    let file = File::from(fd);
    let len = i64::try_from(segment_len)
        .map_err(|_| Error::invalid(format!("segment of {segment_len} bytes is too large")))?;
    nix::unistd::ftruncate(&file, len)
        .map_err(|e| Error::os(format!("sizing {shown} to {segment_len} bytes"), e))?;
    let map = Mapping::map(&file, segment_len, || format!("own segment {shown}"))?;
    // SAFETY: the mapping is page-aligned (hence 64-aligned), freshly truncated (zeroed), at
    // least `bytes_for(num_slots)` long (the window offset is past it), and owned by the
    // `Segment` that keeps the view, so it stays mapped while the view is used.
    let control =
        unsafe { ControlArea::init(map.base, num_slots, rank, world, std::process::id()) };
    Ok((unlinker, map, control))
}

/// Opens, maps and checks `peer`'s segment against what it advertised.
fn attach_peer(
    name: &str,
    peer: usize,
    world: usize,
    ad: &Advert,
    mine: &Advert,
) -> Result<Segment> {
    let proto = |detail: String| Error::Protocol { peer, detail };
    if ad.num_slots != mine.num_slots {
        return Err(proto(format!(
            "rank {peer} has {} signal slots, this rank {}: every rank must pass the same count",
            ad.num_slots, mine.num_slots
        )));
    }
    if ad.host != 0 && mine.host != 0 && ad.host != mine.host {
        return Err(Error::FabricUnavailable {
            fabric: "shm".into(),
            detail: format!("rank {peer} runs on another host (its kernel boot id differs)"),
        });
    }
    if ad.window_offset < ControlArea::bytes_for(ad.num_slots)
        || ad.window_offset & 63 != 0
        || !matches!(ad.window_offset.checked_add(ad.window_len), Some(end) if end <= ad.segment_len)
    {
        return Err(proto(format!(
            "inconsistent segment layout: window [{}, +{}) in a segment of {} bytes with {} slots",
            ad.window_offset, ad.window_len, ad.segment_len, ad.num_slots
        )));
    }
    let fd = shm_open(name, OFlag::O_RDWR, Mode::empty()).map_err(|e| {
        Error::os(
            format!(
                "opening rank {peer}'s shared-memory segment {name} (is rank {peer} on this host, \
                 with the same /dev/shm?)"
            ),
            e,
        )
    })?;
    let file = File::from(fd);
    check_owner_and_mode(&file, peer, name)?;
    let actual = file
        .metadata()
        .map_err(|e| Error::os(format!("inspecting rank {peer}'s segment {name}"), e))?
        .len();
    if actual < ad.segment_len as u64 {
        return Err(proto(format!(
            "segment {name} is {actual} bytes, rank {peer} advertised {}",
            ad.segment_len
        )));
    }
    let map = Mapping::map(&file, ad.segment_len, || {
        format!("rank {peer}'s segment {name}")
    })?;
    // SAFETY: page-aligned mapping of `segment_len >= window_offset` bytes, owned by the
    // `Segment` built below together with the view.
    let control = unsafe { ControlArea::attach(map.base, ad.window_offset, peer, world) }?;
    if control.num_slots() != ad.num_slots {
        return Err(proto(format!(
            "control area of {name} has {} slots, rank {peer} advertised {}",
            control.num_slots(),
            ad.num_slots
        )));
    }
    if control.owner_pid() != ad.pid {
        return Err(proto(format!(
            "control area of {name} belongs to process {}, rank {peer} is process {}",
            control.owner_pid(),
            ad.pid
        )));
    }
    let liveness = Liveness::open(ad.pid, peer)?;
    Ok(Segment {
        map,
        control,
        window_offset: ad.window_offset,
        window_len: ad.window_len,
        pid: ad.pid,
        liveness,
    })
}

impl ShmFabric {
    /// Joins the shared-memory fabric of the job `exchange` belongs to, with a window of
    /// `window_len` bytes (sizes may differ between ranks) and `num_slots` signal slots (the same
    /// on every rank). Every rank of the job must call it; it returns once every rank has mapped
    /// every other rank's segment, and by then no segment name of the job is left in `/dev/shm`.
    ///
    /// Waits at most [`DEFAULT_INIT_TIMEOUT`] for each rendezvous step.
    pub fn new(exchange: Arc<dyn Exchange>, window_len: usize, num_slots: usize) -> Result<Self> {
        Self::with_timeout(exchange, window_len, num_slots, DEFAULT_INIT_TIMEOUT)
    }

    /// [`ShmFabric::new`] with an explicit timeout for each rendezvous step.
    pub fn with_timeout(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        timeout: Duration,
    ) -> Result<Self> {
        Self::create(exchange, window_len, num_slots, timeout, &|_| {})
    }

    /// The body of `new`; `before_publish` sees the own mapping before peers are told about it
    /// (a test hook).
    fn create(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        timeout: Duration,
        before_publish: &dyn Fn(&Mapping),
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
        let page = page_size();
        let too_large = || Error::invalid(format!("a window of {window_len} bytes is too large"));
        let window_offset =
            round_up(ControlArea::bytes_for(num_slots), page).ok_or_else(too_large)?;
        let segment_len = round_up(window_len, page)
            .and_then(|w| w.checked_add(window_offset))
            .ok_or_else(too_large)?;
        let job_id = exchange.job_id();
        let key = exchange.key();
        let name =
            CString::new(segment_name(key, job_id, rank)).expect("segment names have no NUL");

        let (mut unlinker, own_map, own_control) =
            create_own(&name, segment_len, num_slots, rank, size)?;
        before_publish(&own_map);
        fault_point!("init.shm.created");
        let mine = Advert {
            pid: std::process::id(),
            num_slots,
            window_offset,
            window_len,
            segment_len,
            host: host_id(),
        };
        let blobs = exchange.allgather(&mine.encode(), timeout);
        // Whatever happens next, this rank also removes the names of the other ranks when it
        // is done: if init fails because a rank died after creating its segment, the survivors
        // clean up for it; on success, a rank killed just before unlinking its own name leaves
        // nothing behind. Every segment is opened before any rank gets past the second round.
        unlinker.0 = (0..size)
            .map(|r| CString::new(segment_name(key, job_id, r)).expect("segment names have no NUL"))
            .collect();
        let blobs = blobs?;
        if blobs.len() != size {
            return Err(Error::Bootstrap(format!(
                "allgather returned {} blobs for {size} ranks",
                blobs.len()
            )));
        }

        // Attach every peer; keep the outcome, so that it can be reported to every rank.
        let mut own = Some(Segment {
            map: own_map,
            control: own_control,
            window_offset,
            window_len,
            pid: mine.pid,
            liveness: Liveness::SameProcess,
        });
        let attached: Result<Vec<Segment>> = blobs
            .iter()
            .enumerate()
            .map(|(peer, blob)| {
                if peer == rank {
                    return Ok(own.take().expect("own segment is taken once"));
                }
                let name = segment_name(key, job_id, peer);
                attach_peer(&name, peer, size, &Advert::decode(blob, peer)?, &mine)
            })
            .collect();

        // Second round: every rank learns whether every other rank attached. This is also the
        // barrier after which unlinking is safe (every rank has opened every segment).
        let status = match &attached {
            Ok(_) => vec![0u8],
            Err(e) => {
                let mut s = vec![1u8];
                s.extend_from_slice(e.to_string().as_bytes());
                s
            }
        };
        fault_point!("init.shm.attached");
        let outcomes = exchange.allgather(&status, timeout)?;
        drop(unlinker);
        let segments = attached?;
        for (peer, outcome) in outcomes.iter().enumerate() {
            if outcome.first() != Some(&0) {
                let why = String::from_utf8_lossy(outcome.get(1..).unwrap_or_default());
                return Err(Error::PeerFailed {
                    peer,
                    detail: format!("could not join the shm fabric: {why}"),
                });
            }
        }
        let wait_policy = WaitPolicy::for_ranks_on_host(size);
        tracing::debug!(
            rank,
            world = size,
            window_len,
            num_slots,
            ?wait_policy,
            "shm fabric ready; segments unlinked"
        );
        Ok(ShmFabric {
            exchange,
            rank,
            num_slots,
            segments,
            wait_policy,
            wait_state: WaitState::for_ranks_on_host(size),
        })
    }

    /// The job id the segments were named after.
    pub fn job_id(&self) -> u64 {
        self.exchange.job_id()
    }

    /// The process id of `rank`, as it advertised at init.
    pub fn pid_of(&self, rank: usize) -> Option<u32> {
        self.segments.get(rank).map(|s| s.pid)
    }

    /// How waits spin, yield and sleep: by default [`WaitPolicy::for_ranks_on_host`] with the
    /// world size, since every rank of the job runs on this host.
    pub fn wait_policy(&self) -> WaitPolicy {
        self.wait_policy
    }

    /// Overrides the wait policy of this rank.
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        self.wait_policy = policy;
    }

    /// The bootstrap this fabric was built on.
    pub fn exchange(&self) -> &Arc<dyn Exchange> {
        &self.exchange
    }

    fn segment(&self, peer: usize) -> Result<&Segment> {
        self.segments.get(peer).ok_or_else(|| {
            Error::invalid(format!(
                "rank {peer} out of range: the job has {} ranks",
                self.segments.len()
            ))
        })
    }

    fn window_of(&self, peer: usize) -> Result<Window<'_>> {
        let s = self.segment(peer)?;
        // SAFETY: `window_offset + window_len <= map.len` (checked at attach, or by construction
        // for the own segment); the mapping is owned by `self`, which the window borrows.
        Ok(unsafe { Window::from_raw(s.map.base.add(s.window_offset), s.window_len, peer) })
    }
}

impl Drop for ShmFabric {
    fn drop(&mut self) {
        // A clean exit after the last call: peers still waiting for others must not take this
        // rank's exit for a crash.
        self.leave();
    }
}

// SAFETY: put, get and signal touch only the bounds-checked ranges they are given in segments
// mapped for the fabric's life; the fabric writes no window on its own.
unsafe impl Fabric for ShmFabric {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn leave(&self) {
        if let Some(own) = self.segments.get(self.rank) {
            own.control.set_departed();
        }
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.segments.len()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            load_store: true,
            remote_read: true,
            chunk_floor: 0,
        }
    }

    fn window_len(&self, rank: usize) -> usize {
        self.segments.get(rank).map_or(0, |s| s.window_len)
    }

    fn num_signal_slots(&self) -> usize {
        self.num_slots
    }

    fn local_window(&self) -> Option<Window<'_>> {
        self.window_of(self.rank).ok()
    }

    fn peer_window(&self, peer: usize) -> Option<Window<'_>> {
        self.window_of(peer).ok()
    }

    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()> {
        self.window_of(peer)?.write(offset, data)
    }

    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.window_of(peer)?.read(offset, buf)
    }

    fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        // The Release store inside `store` orders every earlier put (plain stores into the
        // mapped window) before the value, for the peer's Acquire load.
        self.segment(peer)?.control.store(slot, value, peer)
    }

    fn signal_quiet(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.segment(peer)?.control.store_quiet(slot, value, peer)
    }

    fn signal_value(&self, slot: usize) -> u64 {
        self.segments[self.rank].control.load(slot)
    }

    fn flush(&self) -> Result<()> {
        // Puts are stores to coherent shared memory: complete once the memcpy returns.
        Ok(())
    }

    fn wait_counters(&self) -> WaitCounters {
        self.wait_state.counters()
    }

    fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()> {
        let liveness = |awaited: usize| {
            // An out-of-band abort first: a rank that aborted and then left the job is
            // reported by its abort, not as gone.
            if let Some(notice) = self.exchange.poll_abort() {
                return Err(notice.to_error(self.segments.len()));
            }
            self.check_peer(awaited)?;
            self.check_peers()
        };
        self.segments[self.rank].control.wait_with(
            self.wait_policy,
            &self.wait_state,
            deadline,
            poll,
            &liveness,
        )
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.exchange.barrier(timeout)
    }

    fn abort_reporting(&self, dead: Option<usize>, reason: &str) {
        for s in &self.segments {
            s.control.set_abort(self.rank, dead, reason);
        }
        // Ranks that lost their mapping of us (or wait on the bootstrap) hear it out of band.
        let _ = self.exchange.broadcast_abort_reporting(dead, reason);
    }

    fn forward_abort(&self, notice: &AbortNotice) {
        for s in &self.segments {
            s.control.set_abort(notice.by, notice.dead, &notice.reason);
        }
    }

    fn aborted(&self) -> Option<AbortNotice> {
        self.segments[self.rank].control.aborted_by()
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        let s = self.segment(peer)?;
        let alive = s.liveness.check(peer, s.pid);
        if peer == self.rank || !s.control.departed() {
            return alive;
        }
        // Waits look once more before reporting it, so what it sent before leaving counts.
        Err(super::departed(peer, alive))
    }

    fn check_peers(&self) -> Result<()> {
        if let Some(notice) = self.exchange.poll_abort() {
            return Err(notice.to_error(self.segments.len()));
        }
        Liveness::check_all(&self.segments, self.rank)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::bootstrap::ThreadExchange;
    use crate::fabric::conformance::{self, min_slots, MIN_WINDOW};

    fn group(n: usize) -> Vec<Arc<dyn Exchange>> {
        ThreadExchange::group(n)
            .into_iter()
            .map(|e| Arc::new(e) as Arc<dyn Exchange>)
            .collect()
    }

    /// Names of the job's segments still in /dev/shm.
    fn leftovers(job_id: u64) -> Vec<String> {
        let prefix = segment_prefix(job_id);
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Runs `per_rank(exchange)` on `n` threads, returns each rank's result in rank order.
    fn on_threads<T: Send>(
        exchanges: Vec<Arc<dyn Exchange>>,
        per_rank: impl Fn(Arc<dyn Exchange>) -> T + Sync,
    ) -> Vec<T> {
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

    fn conformance_on_threads(n: usize) {
        let exchanges = group(n);
        let job_id = exchanges[0].job_id();
        let results = on_threads(exchanges, |ex| {
            let f = ShmFabric::new(ex, MIN_WINDOW, min_slots(n))?;
            conformance::run_all(&f)
        });
        for (rank, r) in results.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
        assert_eq!(leftovers(job_id), Vec::<String>::new());
    }

    #[test]
    fn shm_fabric_on_threads_passes_conformance_with_2_ranks() {
        conformance_on_threads(2);
    }

    #[test]
    fn shm_fabric_on_threads_passes_conformance_with_3_ranks() {
        conformance_on_threads(3);
    }

    #[test]
    fn segments_are_unlinked_once_new_returns_and_windows_may_differ() {
        let exchanges = group(3);
        let job_id = exchanges[0].job_id();
        let lens = [MIN_WINDOW, 3 * MIN_WINDOW + 5, 1];
        let results = on_threads(exchanges, |ex| {
            let rank = ex.rank();
            let f = ShmFabric::new(ex, lens[rank], 4)?;
            f.barrier(Duration::from_secs(10))?;
            let left = leftovers(job_id);
            let sizes: Vec<usize> = (0..3).map(|r| f.window_len(r)).collect();
            // The last byte of every window is addressable, the next one is not.
            for (peer, &len) in lens.iter().enumerate() {
                f.put(peer, len - 1, &[rank as u8])?;
                assert!(matches!(
                    f.put(peer, len, &[0]),
                    Err(Error::OutOfWindow { peer: p, .. }) if p == peer
                ));
            }
            f.barrier(Duration::from_secs(10))?;
            Ok::<_, Error>((left, sizes, f.pid_of(0)))
        });
        for r in results {
            let (left, sizes, pid) = r.unwrap();
            assert_eq!(left, Vec::<String>::new());
            assert_eq!(sizes, lens);
            assert_eq!(pid, Some(std::process::id()));
        }
    }

    #[test]
    fn segment_with_wrong_magic_is_rejected_naming_the_peer() {
        let exchanges = group(2);
        let job_id = exchanges[0].job_id();
        let results = on_threads(exchanges, |ex| {
            let corrupt = ex.rank() == 1;
            ShmFabric::create(ex, MIN_WINDOW, 4, Duration::from_secs(10), &|map| {
                if corrupt {
                    // SAFETY: the magic is the first, 8-aligned u64 of the own, freshly
                    // formatted control area; written atomically like every header field.
                    let magic = unsafe { &*map.base.as_ptr().cast::<AtomicU64>() };
                    magic.store(0xdead_beef, Ordering::Release);
                }
            })
            .map(drop)
        });
        match &results[0] {
            Err(Error::Protocol { peer: 1, detail }) if detail.contains("magic") => {}
            other => panic!("rank 0: expected a protocol error naming rank 1, got {other:?}"),
        }
        match &results[1] {
            Err(Error::PeerFailed { peer: 0, detail }) if detail.contains("magic") => {}
            other => panic!("rank 1: expected rank 0 reported as failed, got {other:?}"),
        }
        assert_eq!(leftovers(job_id), Vec::<String>::new());
    }

    #[test]
    fn segment_names_are_unpredictable_without_the_key() {
        let (a, b) = (JobKey::random(), JobKey::random());
        let name = segment_name(&a, 7, 1);
        assert!(name.starts_with(&format!("/{}", segment_prefix(7))));
        assert_ne!(name, segment_name(&b, 7, 1));
        assert_ne!(name, segment_name(&a, 7, 2));
        assert_eq!(name, segment_name(&a, 7, 1));
    }

    #[test]
    fn a_segment_of_another_user_or_mode_0666_is_not_mapped() {
        let mine = Advert {
            pid: std::process::id(),
            num_slots: 4,
            window_offset: page_size(),
            window_len: 4096,
            segment_len: page_size() + 4096,
            host: 0,
        };
        for (uid, mode) in [(65534u32, 0o600u32), (effective_uid(), 0o666)] {
            let name = format!("/xccl-test-squat-{}-{uid}-{mode:o}", std::process::id());
            let fd = shm_open(
                name.as_str(),
                OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
                Mode::S_IRUSR | Mode::S_IWUSR,
            )
            .unwrap();
            let file = File::from(fd);
            nix::unistd::ftruncate(&file, mine.segment_len as i64).unwrap();
            use std::os::unix::fs::PermissionsExt;
            file.set_permissions(std::fs::Permissions::from_mode(mode))
                .unwrap();
            if uid != effective_uid() && std::os::unix::fs::fchown(&file, Some(uid), None).is_err()
            {
                let _ = shm_unlink(name.as_str());
                continue; // Not root: cannot give the segment away.
            }
            let got = attach_peer(&name, 1, 2, &mine, &mine);
            let _ = shm_unlink(name.as_str());
            match got {
                Err(Error::Protocol { peer: 1, detail }) => {
                    assert!(detail.contains("someone else created it"), "{detail}")
                }
                Err(e) => panic!("uid {uid} mode {mode:o}: expected a refusal, got {e}"),
                Ok(_) => panic!("uid {uid} mode {mode:o}: a foreign segment was mapped"),
            }
        }
    }

    #[test]
    fn survivors_unlink_the_segment_of_a_rank_that_died_during_init() {
        let exchanges = group(2);
        let job_id = exchanges[0].job_id();
        let results = on_threads(exchanges, |ex| {
            if ex.rank() == 1 {
                // Creates its segment like `new`, then "dies": never unlinks it, never joins.
                let full = segment_name(ex.key(), job_id, 1);
                let name = CString::new(full.clone()).unwrap();
                let (unlinker, _map, _control) = create_own(&name, 1 << 16, 4, 1, 2).unwrap();
                std::mem::forget(unlinker);
                let own = full[1..].to_string();
                assert!(leftovers(job_id).contains(&own), "rank 1's segment exists");
                drop(ex);
                return Ok(());
            }
            ShmFabric::with_timeout(ex, MIN_WINDOW, 4, Duration::from_secs(2)).map(drop)
        });
        assert!(results[0].is_err(), "rank 0 joined a job without rank 1");
        assert_eq!(leftovers(job_id), Vec::<String>::new());
    }

    #[test]
    fn different_slot_counts_are_rejected_naming_the_peer() {
        let results = on_threads(group(2), |ex| {
            let slots = 4 + ex.rank();
            ShmFabric::with_timeout(ex, MIN_WINDOW, slots, Duration::from_secs(10)).map(drop)
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
    fn an_out_of_band_abort_reaches_a_sleeping_wait() {
        // Rank 1 aborts through the bootstrap only (as a rank that lost its mapping would):
        // rank 0's wait on a slot nobody signals ends with the abort, not at its deadline.
        let results = on_threads(group(2), |ex| {
            let f = ShmFabric::new(ex.clone(), MIN_WINDOW, 4)?;
            f.barrier(Duration::from_secs(10))?;
            if ex.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                ex.broadcast_abort("expert 1 lost its device")?;
                return Ok(Duration::ZERO);
            }
            let start = Instant::now();
            let r = f.wait_signal(
                0,
                1,
                "nothing",
                crate::fabric::deadline_after(Duration::from_secs(20)),
                &|v| v > 0,
            );
            match r {
                Err(Error::Aborted { by: 1, reason }) if reason.contains("lost its device") => {
                    Ok(start.elapsed())
                }
                other => Err(Error::invalid(format!("expected the abort, got {other:?}"))),
            }
        });
        for r in results {
            assert!(r.unwrap() < Duration::from_secs(3));
        }
    }

    #[test]
    fn advert_round_trips_and_rejects_garbage() {
        let a = Advert {
            pid: 42,
            num_slots: 7,
            window_offset: 4096,
            window_len: 123,
            segment_len: 8192,
            host: 99,
        };
        assert_eq!(Advert::decode(&a.encode(), 3).unwrap(), a);
        assert!(matches!(
            Advert::decode(&[0u8; 64], 3),
            Err(Error::Protocol { peer: 3, .. })
        ));
        assert!(matches!(
            Advert::decode(&[1, 2, 3], 5),
            Err(Error::Protocol { peer: 5, .. })
        ));
    }
}
