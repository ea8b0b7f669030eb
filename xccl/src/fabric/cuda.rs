//! The CUDA fabric: ranks are processes on one host, one rank per process, any number of ranks
//! per GPU; each rank's data window is device memory that every other rank maps by CUDA IPC.
//!
//! **CI tests the cuda fabric against a stand-in driver** (`tests/cuda_standin/`, host shared
//! memory behind the driver calls): the calls, their order and the error paths are exercised,
//! the behaviour of real GPUs is not.
//!
//! ## Memory
//! - The **data window**: `window_len` bytes of `cuMemAlloc`'d memory on this rank's device
//!   (the config's device, by default `rank % device count`), zeroed at init and exported with
//!   `cuIpcGetMemHandle`. The handles are allgathered through the bootstrap and every rank opens
//!   every peer's (`cuIpcOpenMemHandle`, peer access enabled lazily where the peer's device is
//!   another), ranks on the same device included; its own window it uses directly (the driver
//!   refuses to open a handle in the process that exported it).
//! - The **control area** (signal slots, doorbell, abort word and reason, departure marks) is a
//!   [`ShmFabric`], in host shared memory exactly as the shm fabric has it: signals, waits,
//!   liveness (pidfds), aborts and the failure rule are that fabric's code. Its window holds
//!   each rank's **host prefix** ([`CudaFabric::with_host_prefix`]): the first bytes of the
//!   rank's window live there, not on the device (the protocol puts its handshake and records
//!   there), so reading or writing a record is a host copy with no stream wait.
//!
//! ## Transfers (host-driven)
//! - `put`/`get` with host bytes are host-to-device / device-to-host copies on this rank's
//!   stream ([`CudaFabric::stream`]), through the stream's host buffer, complete (bounded wait)
//!   before they return.
//! - `signal` synchronizes the stream (bounded: work the data plane queued on it, e.g. device
//!   copies into a peer's window, completes first), then stores into the peer's slot in host
//!   memory: the value is ordered after every earlier put of this rank.
//! - `local_window()`/`peer_window()` are `None`: the host cannot address device memory; the
//!   data plane reaches the windows through [`CudaFabric::device_window`] and the stream.
//!
//! ## Init
//! Each rank opens the driver and its device, creates its stream, allocates, zeroes and exports
//! its window; round 1 allgathers `{pid, device, host, window length, IPC handle}` or the rank's
//! error (so a rank without a driver or device memory makes every rank fail at once, naming it);
//! round 2 reports each rank's check of the adverts; then the control area is made (the shm
//! fabric's own rounds); round 3 reports each rank's IPC opens. Every error names the driver call
//! and the rank; whatever a failing rank made is released (nothing stays mapped or allocated).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::local::LocalFabric;
use super::shm::{host_id, ShmFabric};
use super::{
    deadline_after, gather_adverts, gather_outcomes, Capabilities, Fabric, WaitCounters, Waiting,
    Window,
};
use crate::bootstrap::Exchange;
use crate::cuda::{
    Device, DeviceMemory, DevicePtr, DeviceRegion, Driver, IpcExport, IpcMapping, Stream,
};
use crate::{AbortNotice, Error, Result};

/// How long [`CudaFabric::new`] waits for the other ranks at each rendezvous step.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(60);
/// The smallest chunk between two progress signals ([`Capabilities::chunk_floor`]): a signal
/// waits for the stream (every copy and kernel queued before it), a few microseconds on a GPU,
/// and the data plane launches once per chunk, so chunks are made large enough that their copy
/// takes longer than those (16 MiB: about 8 us at 2 TB/s; T=4096 rows of H=7168 bf16, 59 MB, go
/// in 4 chunks instead of the default 64 KiB's 900). Not measured on a GPU yet.
pub const CHUNK_FLOOR: usize = 16 << 20;

/// Longest a copy or a stream synchronize of the fabric may take before it is an error.
pub const STREAM_TIMEOUT: Duration = Duration::from_secs(60);

const ADVERT_MAGIC: u64 = u64::from_le_bytes(*b"XCCLCUD1");
const ADVERT_WORDS: usize = 6;
const HANDLE_BYTES: usize = 64;

/// What each rank tells the others at init.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Advert {
    pid: u32,
    device: usize,
    host: u64,
    window_len: usize,
    /// Bytes at the start of the window that live in host memory (the control area's).
    host_prefix: usize,
    handle: [u8; HANDLE_BYTES],
}

impl Advert {
    fn encode(&self) -> Vec<u8> {
        let words: [u64; ADVERT_WORDS] = [
            ADVERT_MAGIC,
            u64::from(self.pid),
            self.device as u64,
            self.host,
            self.window_len as u64,
            self.host_prefix as u64,
        ];
        let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        out.extend_from_slice(&self.handle);
        out
    }

    fn decode(blob: &[u8], peer: usize) -> Result<Self> {
        let bad = |detail: String| Error::Protocol { peer, detail };
        if blob.len() != ADVERT_WORDS * 8 + HANDLE_BYTES {
            return Err(bad(format!(
                "cuda advert of {} bytes, expected {}",
                blob.len(),
                ADVERT_WORDS * 8 + HANDLE_BYTES
            )));
        }
        let w: Vec<u64> = blob[..ADVERT_WORDS * 8]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect();
        if w[0] != ADVERT_MAGIC {
            return Err(bad(format!(
                "cuda advert tag {:#x}, expected {ADVERT_MAGIC:#x} (not an xccl cuda rank?)",
                w[0]
            )));
        }
        let size = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| bad(format!("{what} {v} does not fit in usize")))
        };
        let mut handle = [0u8; HANDLE_BYTES];
        handle.copy_from_slice(&blob[ADVERT_WORDS * 8..]);
        Ok(Advert {
            pid: u32::try_from(w[1]).map_err(|_| bad(format!("pid {} out of range", w[1])))?,
            device: size(w[2], "device")?,
            host: w[3],
            window_len: size(w[4], "window length")?,
            host_prefix: match size(w[5], "host prefix")? {
                p if p <= size(w[4], "window length")? => p,
                p => return Err(bad(format!("host prefix {p} is longer than its window"))),
            },
            handle,
        })
    }
}

/// A peer's window as this rank reaches it.
#[derive(Debug)]
enum PeerWindow {
    /// This rank's own window (`CudaFabric::window`).
    Own,
    /// Another process's window, opened from its IPC handle.
    Mapped(IpcMapping),
    /// Another thread's window in this process ([`CudaFabric::local_group`]), shared.
    Shared(Arc<DeviceMemory>),
}

/// The host control area: the shm fabric's (ranks as processes) or the local fabric's (ranks
/// as threads of one process).
enum Control {
    Shm(ShmFabric),
    Local(LocalFabric),
}

impl Control {
    fn get(&self) -> &dyn Fabric {
        match self {
            Control::Shm(f) => f,
            Control::Local(f) => f,
        }
    }
}

/// What [`CudaFabric::setup_local`] made.
struct Local {
    device: Device,
    stream: Stream,
    window: DeviceMemory,
    mine: Advert,
}

/// One rank's endpoint of the cuda fabric. See the module docs.
pub struct CudaFabric {
    rank: usize,
    window_len: usize,
    /// Indexed by rank. Declared (so dropped) before the memory and the stream.
    peers: Vec<PeerWindow>,
    /// Each rank's device, as advertised.
    devices: Vec<usize>,
    /// Each rank's host prefix ([`CudaFabric::with_host_prefix`]), as advertised.
    prefixes: Vec<usize>,
    /// This rank's window (shared with the other ranks' fabrics in [`CudaFabric::local_group`]).
    window: Arc<DeviceMemory>,
    stream: Stream,
    device: Device,
    /// The smallest chunk between two progress signals it asks for ([`CHUNK_FLOOR`] unless
    /// [`CudaFabric::set_chunk_floor`] said otherwise).
    chunk_floor: usize,
    /// The control area (and the bootstrap): dropped last (its drop marks this rank departed).
    control: Control,
}

impl std::fmt::Debug for CudaFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaFabric")
            .field("rank", &self.rank)
            .field("world_size", &self.peers.len())
            .field("device", &self.device.ordinal())
            .field("window_len", &self.window_len)
            .finish()
    }
}

/// The driver and its device count; no device at all is [`Error::FabricUnavailable`].
fn driver_with_devices() -> Result<(Arc<Driver>, usize)> {
    let driver = Driver::get()?;
    let count = driver.device_count()?;
    if count == 0 {
        return Err(Error::FabricUnavailable {
            fabric: "cuda".into(),
            detail: format!("{} sees no CUDA device", driver.path().display()),
        });
    }
    Ok((driver, count))
}

/// `e` with the rank named: in a driver error's context, or a missing driver's detail.
fn on_rank(rank: usize, e: Error) -> Error {
    e.prefixed(&format!("rank {rank}"))
}

impl CudaFabric {
    /// Joins the cuda fabric of the job `exchange` belongs to, with a window of `window_len`
    /// bytes of device memory on `device` (`None`: `rank % device count`) and `num_slots`
    /// signal slots (the same on every rank). Collective: every rank of the job calls it.
    /// Fails with [`Error::FabricUnavailable`] naming `libcuda.so.1` where there is no driver.
    pub fn new(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        device: Option<usize>,
    ) -> Result<Self> {
        Self::with_timeout(
            exchange,
            window_len,
            num_slots,
            device,
            DEFAULT_INIT_TIMEOUT,
        )
    }

    /// [`CudaFabric::new`] with an explicit timeout for each rendezvous step.
    pub fn with_timeout(
        exchange: Arc<dyn Exchange>,
        window_len: usize,
        num_slots: usize,
        device: Option<usize>,
        timeout: Duration,
    ) -> Result<Self> {
        Self::with_host_prefix(exchange, (window_len, 0), num_slots, device, timeout)
    }

    /// [`CudaFabric::with_timeout`] with the first `host_prefix` bytes of this rank's window
    /// in host memory: `put`/`get` of them are host copies into the control area (no device
    /// copy, no stream wait), the rest is device memory. The protocol keeps its records there
    /// (`WindowLayout::record_area_end`); the data plane must not address them on the device
    /// ([`CudaFabric::host_prefix`]). Each rank may have its own; every rank learns the others'.
    pub fn with_host_prefix(
        exchange: Arc<dyn Exchange>,
        (window_len, host_prefix): (usize, usize),
        num_slots: usize,
        device: Option<usize>,
        timeout: Duration,
    ) -> Result<Self> {
        let (rank, size) = (exchange.rank(), exchange.size());
        if host_prefix > window_len {
            return Err(Error::invalid(format!(
                "a host prefix of {host_prefix} bytes is longer than the {window_len}-byte window"
            )));
        }
        if rank >= size {
            return Err(Error::invalid(format!(
                "rank {rank} out of range for a job of {size} ranks"
            )));
        }
        // Round 1: adverts, or this rank's setup error.
        let setup = Self::setup_local(rank, (window_len, host_prefix), device)
            .map_err(|e| on_rank(rank, e));
        let blobs = gather_adverts(
            &*exchange,
            setup.as_ref().map(|l| l.mine.encode()),
            timeout,
            "cuda",
        );
        let Local {
            device,
            stream,
            window,
            mine,
        } = setup?;
        let blobs = blobs?;
        // Round 2: every rank checks the adverts and tells the others.
        let checked: Result<Vec<Advert>> = blobs
            .iter()
            .enumerate()
            .map(|(peer, b)| {
                let ad = if peer == rank {
                    mine.clone()
                } else {
                    Advert::decode(b, peer)?
                };
                check_compatible(peer, rank, &ad, &mine)?;
                Ok(ad)
            })
            .collect();
        gather_outcomes(&*exchange, &checked, timeout, "check the cuda adverts")?;
        let adverts = checked?;
        // The control area: the shm fabric's own rounds, collective and failing together.
        let control = Control::Shm(ShmFabric::with_timeout(
            exchange.clone(),
            host_prefix,
            num_slots,
            timeout,
        )?);
        // Round 3: open every peer's window; report.
        let opened: Result<Vec<PeerWindow>> = adverts
            .iter()
            .enumerate()
            .map(|(peer, ad)| {
                if peer == rank {
                    return Ok(PeerWindow::Own);
                }
                let export = IpcExport {
                    handle: ad.handle,
                    len: ad.window_len,
                    device: ad.device,
                };
                device
                    .open_ipc(&export, || {
                        format!(
                            "rank {peer}'s window ({} bytes on device {})",
                            ad.window_len, ad.device
                        )
                    })
                    .map(PeerWindow::Mapped)
                    .map_err(|e| on_rank(rank, e))
            })
            .collect();
        gather_outcomes(&*exchange, &opened, timeout, "join the cuda fabric")?;
        let peers = opened?;
        tracing::debug!(
            rank,
            world = size,
            device = device.ordinal(),
            window_len,
            num_slots,
            library = %device.driver().path().display(),
            "cuda fabric ready; every peer's window opened"
        );
        Ok(CudaFabric {
            rank,
            window_len,
            peers,
            devices: adverts.iter().map(|a| a.device).collect(),
            prefixes: adverts.iter().map(|a| a.host_prefix).collect(),
            window: Arc::new(window),
            stream,
            device,
            chunk_floor: CHUNK_FLOOR,
            control,
        })
    }

    /// A whole job of `lens.len()` ranks as threads of this process, for runtimes that refuse
    /// CUDA IPC: rank `r`'s window (`lens[r]` bytes, the first `host_prefixes[r]` of them in
    /// host memory as [`CudaFabric::with_host_prefix`] says) on `device` (`None`: `r % device
    /// count`),
    /// every window shared in-process, the control area a [`LocalFabric`] group's. Returns one
    /// fabric per rank, in rank order (move each to its own thread). Whatever was made is
    /// released if a step fails.
    pub fn local_group(
        lens: &[usize],
        host_prefixes: &[usize],
        num_slots: usize,
        device: Option<usize>,
    ) -> Result<Vec<CudaFabric>> {
        if host_prefixes.len() != lens.len() || lens.iter().zip(host_prefixes).any(|(l, p)| p > l) {
            return Err(Error::invalid(
                "one host prefix per rank, none longer than its window",
            ));
        }
        let (driver, count) = driver_with_devices()?;
        let mut made = Vec::with_capacity(lens.len());
        for (rank, &len) in lens.iter().enumerate() {
            let ordinal = device.unwrap_or(rank % count);
            let device = driver.device(ordinal).map_err(|e| on_rank(rank, e))?;
            let stream = Stream::new(&device).map_err(|e| on_rank(rank, e))?;
            let window = Self::zeroed_window(&device, &stream, rank, len)?;
            made.push((device, stream, Arc::new(window), len));
        }
        let controls = LocalFabric::group(host_prefixes, num_slots)?;
        let devices: Vec<usize> = made.iter().map(|m| m.0.ordinal()).collect();
        let windows: Vec<Arc<DeviceMemory>> = made.iter().map(|m| m.2.clone()).collect();
        Ok(made
            .into_iter()
            .zip(controls)
            .enumerate()
            .map(|(rank, ((device, stream, window, window_len), control))| {
                let peers = (windows.iter().enumerate())
                    .map(|(r, w)| {
                        if r == rank {
                            PeerWindow::Own
                        } else {
                            PeerWindow::Shared(w.clone())
                        }
                    })
                    .collect();
                CudaFabric {
                    rank,
                    window_len,
                    peers,
                    devices: devices.clone(),
                    prefixes: host_prefixes.to_vec(),
                    window,
                    stream,
                    device,
                    chunk_floor: CHUNK_FLOOR,
                    control: Control::Local(control),
                }
            })
            .collect())
    }

    /// Allocates rank `rank`'s window of `len` bytes (at least one) on `device` and zeroes it
    /// (device memory is not zeroed: the window starts clear, as the shm fabric's does).
    fn zeroed_window(
        device: &Device,
        stream: &Stream,
        rank: usize,
        len: usize,
    ) -> Result<DeviceMemory> {
        let window = DeviceMemory::alloc(device, len.max(1), || format!("rank {rank}'s window"))
            .map_err(|e| on_rank(rank, e))?;
        let what = || format!("zeroing rank {rank}'s window");
        stream.memset(&window, 0, 0, window.len(), &what)?;
        stream.synchronize(deadline_after(STREAM_TIMEOUT), rank, &what)?;
        Ok(window)
    }

    /// Opens the driver and the device, creates the stream, allocates, zeroes and exports the
    /// window. What it made is released if a later step fails (owned values).
    fn setup_local(
        rank: usize,
        (window_len, host_prefix): (usize, usize),
        device: Option<usize>,
    ) -> Result<Local> {
        let (driver, count) = driver_with_devices()?;
        let ordinal = device.unwrap_or(rank % count);
        let device = driver.device(ordinal)?;
        let stream = Stream::new(&device)?;
        let window = Self::zeroed_window(&device, &stream, rank, window_len)?;
        let export = window.export()?;
        let mine = Advert {
            pid: std::process::id(),
            device: ordinal,
            host: host_id(),
            window_len,
            host_prefix,
            handle: export.handle,
        };
        Ok(Local {
            device,
            stream,
            window,
            mine,
        })
    }

    /// The base address of `rank`'s window as mapped in this process (this rank's own
    /// allocation for itself); `None` for a rank out of range. For the data plane's device
    /// copies and kernels: only the driver and kernels may dereference it.
    pub fn device_window(&self, rank: usize) -> Option<DevicePtr> {
        match self.peers.get(rank)? {
            PeerWindow::Own => Some(self.window.ptr()),
            PeerWindow::Mapped(m) => Some(m.ptr()),
            PeerWindow::Shared(w) => Some(w.ptr()),
        }
    }

    /// The fabric's stream: `put`/`get` copy on it and `signal`/`flush` synchronize it, so
    /// device work queued on it before a signal is ordered before the signal.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// This rank's device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<Driver> {
        self.device.driver()
    }

    /// The device ordinal `rank` uses, as it advertised at init.
    pub fn device_of(&self, rank: usize) -> Option<usize> {
        self.devices.get(rank).copied()
    }

    /// The process id of `rank`, as it advertised at init.
    pub fn pid_of(&self, rank: usize) -> Option<u32> {
        match &self.control {
            Control::Shm(f) => f.pid_of(rank),
            Control::Local(_) => (rank < self.peers.len()).then(std::process::id),
        }
    }

    /// The job id of the bootstrap this fabric was built on (0 for a
    /// [`CudaFabric::local_group`], which has none).
    pub fn job_id(&self) -> u64 {
        match &self.control {
            Control::Shm(f) => f.job_id(),
            Control::Local(_) => 0,
        }
    }

    /// The bytes at the start of `rank`'s window that live in host memory (0 for a rank out
    /// of range): the data plane addresses only what lies past them.
    pub fn host_prefix(&self, rank: usize) -> usize {
        self.prefixes.get(rank).copied().unwrap_or(0)
    }

    /// Sets the smallest chunk between two progress signals this fabric asks the protocol for
    /// (its [`Capabilities::chunk_floor`]; [`CHUNK_FLOOR`] by default): smaller chunks let a
    /// receiver start sooner and cost a stream wait each. Before the communicator is built on
    /// it (the protocol reads it once); every rank should set the same.
    pub fn set_chunk_floor(&mut self, bytes: usize) {
        self.chunk_floor = bytes;
    }

    /// Whether the ranks are threads of this process ([`CudaFabric::local_group`]) rather
    /// than processes joined by CUDA IPC.
    pub fn threads(&self) -> bool {
        matches!(self.control, Control::Local(_))
    }

    /// `peer`'s window as a device region, after checking `[offset, offset + len)` lies in it.
    fn region(&self, peer: usize, offset: usize, len: usize) -> Result<&dyn DeviceRegion> {
        let p = self.peers.get(peer).ok_or_else(|| {
            Error::invalid(format!(
                "rank {peer} out of range: the job has {} ranks",
                self.peers.len()
            ))
        })?;
        let region: &dyn DeviceRegion = match p {
            PeerWindow::Own => &*self.window,
            PeerWindow::Mapped(m) => m,
            PeerWindow::Shared(w) => &**w,
        };
        let window = if peer == self.rank {
            self.window_len
        } else {
            region.len()
        };
        match offset.checked_add(len) {
            Some(end) if end <= window => Ok(region),
            _ => Err(Error::OutOfWindow {
                peer,
                offset,
                len,
                window,
            }),
        }
    }

    /// Waits (bounded) until the work queued on the stream so far completed.
    fn sync(&self, peer: usize, what: &dyn Fn() -> String) -> Result<()> {
        self.stream
            .synchronize(deadline_after(STREAM_TIMEOUT), peer, what)
    }
}

impl Drop for CudaFabric {
    fn drop(&mut self) {
        // Queued device work that uses the windows completes before they are closed and freed.
        let _ = self.sync(self.rank, &|| "draining the stream at teardown".into());
    }
}

/// Checks that `peer`'s advert can work with this rank's.
fn check_compatible(peer: usize, rank: usize, ad: &Advert, mine: &Advert) -> Result<()> {
    if ad.host != 0 && mine.host != 0 && ad.host != mine.host {
        return Err(Error::FabricUnavailable {
            fabric: "cuda".into(),
            detail: format!("rank {peer} runs on another host: CUDA IPC works within one host"),
        });
    }
    if peer != rank && ad.pid == mine.pid {
        return Err(Error::FabricUnavailable {
            fabric: "cuda".into(),
            detail: format!(
                "rank {peer} runs in this process (pid {}): the cuda fabric takes one rank per \
                 process (CUDA IPC cannot open a handle in the process that exported it)",
                mine.pid
            ),
        });
    }
    Ok(())
}

// SAFETY: put, get and signal touch only the bounds-checked ranges they are given in device
// windows allocated or IPC-mapped for the fabric's life; the fabric writes no window on its own,
// and the host never holds a reference into device memory.
unsafe impl Fabric for CudaFabric {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn as_cuda(&self) -> Option<&CudaFabric> {
        Some(self)
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
            chunk_floor: self.chunk_floor,
        }
    }

    fn window_len(&self, rank: usize) -> usize {
        match self.peers.get(rank) {
            Some(PeerWindow::Own) => self.window_len,
            Some(PeerWindow::Mapped(m)) => m.len(),
            Some(PeerWindow::Shared(w)) => w.len(),
            None => 0,
        }
    }

    fn num_signal_slots(&self) -> usize {
        self.control.get().num_signal_slots()
    }

    fn local_window(&self) -> Option<Window<'_>> {
        None
    }

    fn peer_window(&self, _peer: usize) -> Option<Window<'_>> {
        None
    }

    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> Result<()> {
        let region = self.region(peer, offset, data.len())?;
        // The bytes below the peer's host prefix: a host copy into its control area.
        let host = self
            .host_prefix(peer)
            .saturating_sub(offset)
            .min(data.len());
        if host > 0 {
            self.control.get().put(peer, offset, &data[..host])?;
        }
        let (offset, data) = (offset + host, &data[host..]);
        if data.is_empty() {
            return Ok(());
        }
        let deadline = deadline_after(STREAM_TIMEOUT);
        self.stream
            .write(region, offset, data, deadline, peer, &|| {
                format!(
                    "rank {}: put of {} bytes to rank {peer} at offset {offset}",
                    self.rank,
                    data.len()
                )
            })
    }

    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        let region = self.region(peer, offset, buf.len())?;
        let host = self.host_prefix(peer).saturating_sub(offset).min(buf.len());
        if host > 0 {
            self.control.get().get(peer, offset, &mut buf[..host])?;
        }
        let (offset, buf) = (offset + host, &mut buf[host..]);
        if buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let deadline = deadline_after(STREAM_TIMEOUT);
        self.stream.read(region, offset, buf, deadline, peer, &|| {
            format!(
                "rank {}: get of {len} bytes from rank {peer} at offset {offset}",
                self.rank
            )
        })
    }

    fn signal(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.sync(peer, &|| {
            format!(
                "rank {}: completing puts before a signal to rank {peer}",
                self.rank
            )
        })?;
        self.control.get().signal(peer, slot, value)
    }

    fn signal_quiet(&self, peer: usize, slot: usize, value: u64) -> Result<()> {
        self.sync(peer, &|| {
            format!(
                "rank {}: completing puts before a signal to rank {peer}",
                self.rank
            )
        })?;
        self.control.get().signal_quiet(peer, slot, value)
    }

    fn signal_value(&self, slot: usize) -> u64 {
        self.control.get().signal_value(slot)
    }

    fn flush(&self) -> Result<()> {
        self.sync(self.rank, &|| format!("rank {}: flushing puts", self.rank))
    }

    fn wait_until(
        &self,
        deadline: Instant,
        poll: &mut dyn FnMut() -> Option<Waiting>,
    ) -> Result<()> {
        self.control.get().wait_until(deadline, poll)
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.control.get().barrier(timeout)
    }

    fn abort_reporting(&self, dead: Option<usize>, reason: &str) {
        self.control.get().abort_reporting(dead, reason)
    }

    fn forward_abort(&self, notice: &AbortNotice) {
        self.control.get().forward_abort(notice)
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        self.control.get().check_peer(peer)
    }

    fn leave(&self) {
        self.control.get().leave()
    }

    fn wait_counters(&self) -> WaitCounters {
        self.control.get().wait_counters()
    }

    fn aborted(&self) -> Option<AbortNotice> {
        self.control.get().aborted()
    }

    fn check_peers(&self) -> Result<()> {
        self.control.get().check_peers()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advert_round_trips_and_rejects_garbage() {
        let mut handle = [0u8; HANDLE_BYTES];
        handle[3] = 7;
        let a = Advert {
            pid: 42,
            device: 3,
            host: 99,
            window_len: 123,
            host_prefix: 64,
            handle,
        };
        assert_eq!(Advert::decode(&a.encode(), 3).unwrap(), a);
        // A host prefix longer than the window: the peer's error.
        let long = Advert {
            host_prefix: 124,
            ..a.clone()
        };
        assert!(matches!(
            Advert::decode(&long.encode(), 3),
            Err(Error::Protocol { peer: 3, .. })
        ));
        assert!(matches!(
            Advert::decode(&[0u8; ADVERT_WORDS * 8 + HANDLE_BYTES], 3),
            Err(Error::Protocol { peer: 3, .. })
        ));
        assert!(matches!(
            Advert::decode(&[1, 2, 3], 5),
            Err(Error::Protocol { peer: 5, .. })
        ));
    }

    #[test]
    fn ranks_in_one_process_or_on_two_hosts_are_refused_naming_the_peer() {
        let mine = Advert {
            pid: 10,
            device: 0,
            host: 1,
            window_len: 8,
            host_prefix: 0,
            handle: [0; HANDLE_BYTES],
        };
        let twin = Advert { ..mine.clone() };
        let e = check_compatible(2, 0, &twin, &mine).unwrap_err();
        assert!(e.to_string().contains("one rank per process"), "{e}");
        let far = Advert {
            pid: 11,
            host: 2,
            ..mine.clone()
        };
        let e = check_compatible(2, 0, &far, &mine).unwrap_err();
        assert!(e.to_string().contains("rank 2 runs on another host"), "{e}");
        // Itself, and a peer process on this host, are fine.
        check_compatible(0, 0, &mine, &mine).unwrap();
        let peer = Advert {
            pid: 11,
            ..mine.clone()
        };
        check_compatible(1, 0, &peer, &mine).unwrap();
    }
}
