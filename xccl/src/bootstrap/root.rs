//! The root service: the rendezvous point every rank of a TCP job connects to.
//!
//! Threads:
//! - an **acceptor** polls the listener and starts one reader thread per connection;
//! - a **reader** per connection reads frames (with a read timeout, so it notices the stop flag)
//!   and forwards them over a channel; before a connection has said hello it also answers
//!   strangers with an error on its own;
//! - the **coordinator** (the thread behind [`RootHandle`]) owns all job state and does every
//!   write to a joined rank, so the state needs no lock.
//!
//! A round is an ordinary one (DATA: it needs every rank, and a rank that leaves before
//! contributing fails it) or a **survivors' round** (SURVIVORS: it completes once every rank has
//! contributed or left, and the result has an empty blob for each rank that left; shrinking a
//! job past dead ranks agrees on them this way). The first contribution sets the round's kind;
//! a rank contributing the other kind to it is dropped.
//!
//! **Admission.** A connection says hello (job id, rank, world size, a nonce), gets a challenge
//! (the root's nonce) and answers with the HMAC of all of them under the job key
//! ([`JobKey`]); the root checks it and welcomes the rank with its own HMAC, which the rank
//! checks in turn. Only then is the hello checked against the job (rank range, world size,
//! duplicates), so a stranger without the key learns nothing but "authentication failed".
//!
//! Rejections (a stranger, a wrong version, job id or key, rank or world size, a duplicate rank)
//! get an ERROR frame that names the cause but no secret and not the job's real id, and the
//! connection is closed at once; the job goes on. Every rejection is logged at `warn` and listed
//! in [`RootReport::rejected`] (the first [`MAX_KEPT_REJECTIONS`]; the rest are counted). A
//! connection has [`RootConfig::hello_timeout`] to authenticate, and at most
//! [`MAX_PENDING_HELLOS`] connections may be unauthenticated at once (a new one closes the
//! oldest), so idle or half-open connections cost one thread and two descriptors each for a
//! bounded time and never lock the ranks out. A rank that sends a malformed frame is
//! dropped from the job, and the ranks waiting on a round it can no longer join are told so.
//! The coordinator exits when every rank has joined and left, when no rank has been connected for
//! [`RootConfig::idle_timeout`], or when [`RootHandle::shutdown`] asks it to.

use std::collections::HashMap;
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::key::{self, HelloFields, JobKey, Side, NONCE_LEN};
use super::wire::{self, Absence, Frame, Kind, ReadError, READ_TICK};
use crate::fabric::deadline_after;
use crate::{AbortNotice, Error, Result};

/// Settings of a root service.
#[derive(Debug, Clone)]
pub struct RootConfig {
    /// The job this root serves; hellos for another job id are rejected.
    pub job_id: u64,
    /// The job's secret: ranks must prove they hold it (see the module docs).
    pub key: JobKey,
    /// The world size, if known in advance; otherwise the first accepted hello fixes it.
    pub size: Option<usize>,
    /// The root exits after no rank has been connected for this long (default 5 minutes).
    pub idle_timeout: Duration,
    /// A connection must send its hello within this time (default 30 s).
    pub hello_timeout: Duration,
    /// A write to a rank that takes longer than this drops the rank (default 30 s).
    pub write_timeout: Duration,
}

impl RootConfig {
    /// Defaults for job `job_id` with a fresh random key ([`JobKey::random`]): size learned
    /// from the first hello, 5 min idle timeout, 30 s hello and write timeouts.
    pub fn new(job_id: u64) -> Self {
        Self::with_key(job_id, JobKey::random())
    }

    /// Like [`RootConfig::new`] with the job's key given (launchers: from the environment).
    pub fn with_key(job_id: u64, key: JobKey) -> Self {
        RootConfig {
            job_id,
            key,
            size: None,
            idle_timeout: Duration::from_secs(300),
            hello_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// What a root service did, returned when it exits.
#[derive(Debug, Clone, Default)]
pub struct RootReport {
    /// Number of ranks whose hello was accepted.
    pub joined: usize,
    /// Number of collective rounds completed.
    pub rounds: u64,
    /// One line per rejected connection or dropped rank: peer address and reason (the first
    /// [`MAX_KEPT_REJECTIONS`]).
    pub rejected: Vec<String>,
    /// Rejections past the first [`MAX_KEPT_REJECTIONS`], counted but not kept.
    pub rejected_not_kept: u64,
    /// Why the root exited.
    pub exit: String,
}

/// A running root service.
///
/// Dropping the handle detaches the service: it keeps serving the job and exits on its own.
#[derive(Debug)]
pub struct RootHandle {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<RootReport>>,
}

impl RootHandle {
    /// Binds a listener on `addr` (port 0 picks an ephemeral port) and starts serving.
    ///
    /// The listener has `SO_REUSEADDR` set (the standard library sets it on Unix), so a root can
    /// rebind a well-known port that a previous job left in `TIME_WAIT`.
    pub fn bind(addr: SocketAddr, config: RootConfig) -> Result<RootHandle> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::os(format!("binding the bootstrap root to {addr}"), e))?;
        Self::spawn(listener, config)
    }

    /// Starts serving on an already bound listener.
    pub fn spawn(listener: TcpListener, config: RootConfig) -> Result<RootHandle> {
        let addr = listener
            .local_addr()
            .map_err(|e| Error::os("reading the bootstrap root's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::os("making the bootstrap listener non-blocking", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let acceptor = {
            let intake = Intake {
                tx,
                stop: stop.clone(),
                hello_timeout: config.hello_timeout,
                job_id: config.job_id,
                key: config.key.clone(),
                live: Arc::default(),
            };
            std::thread::Builder::new()
                .name("xccl-root-accept".into())
                .spawn(move || accept_loop(listener, intake))
                .map_err(|e| Error::os("spawning the bootstrap acceptor thread", e))?
        };
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("xccl-root".into())
                .spawn(move || Coordinator::new(config, stop, acceptor).run(rx))
        };
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                // The acceptor exits on its own once its channel's receiver is gone.
                stop.store(true, Ordering::Release);
                return Err(Error::os("spawning the bootstrap root thread", e));
            }
        };
        Ok(RootHandle {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address the root listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the root has exited.
    pub fn is_finished(&self) -> bool {
        !matches!(&self.thread, Some(t) if !t.is_finished())
    }

    /// Waits for the root to exit on its own (all ranks left, or idle timeout).
    pub fn join(mut self) -> RootReport {
        self.take_report()
    }

    /// Asks the root to exit now (closing every connection) and waits for it.
    pub fn shutdown(mut self) -> RootReport {
        // SYNC POINT: pairs with the Acquire loads in the coordinator, acceptor and readers.
        self.stop.store(true, Ordering::Release);
        self.take_report()
    }

    fn take_report(&mut self) -> RootReport {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(report)) => report,
            Some(Err(_)) => RootReport {
                exit: "root thread panicked".into(),
                ..RootReport::default()
            },
            None => RootReport::default(),
        }
    }
}

/// What readers tell the coordinator.
enum Event {
    /// A connection said hello for this job and proved it holds the key; `stream` is its
    /// write half, `welcome` the root's proof to send back if the rank is admitted.
    Hello {
        conn: u64,
        stream: TcpStream,
        peer: SocketAddr,
        rank: u64,
        size: u64,
        welcome: [u8; key::MAC_LEN],
    },
    /// A frame from a connection that has said hello.
    Frame { conn: u64, frame: Frame },
    /// The connection ended; `protocol` when because of a malformed frame.
    Closed {
        conn: u64,
        reason: String,
        protocol: bool,
    },
    /// A connection was rejected before it said hello.
    Rejected { peer: SocketAddr, reason: String },
}

/// Most connections that may be unauthenticated at once. When one more arrives, the oldest
/// waiting connection is closed, so a flood of idle connections neither exhausts the root's
/// threads or descriptors nor locks the real ranks out (they authenticate at once).
pub const MAX_PENDING_HELLOS: usize = 64;

/// Most reader threads of unauthenticated connections alive at once (evicted ones take up to one
/// read tick to end): past it, a new connection is closed at once without a thread.
pub const MAX_UNAUTHENTICATED_THREADS: usize = 2 * MAX_PENDING_HELLOS;

/// Rejections a report keeps (later ones are counted in [`RootReport::rejected_not_kept`]).
pub const MAX_KEPT_REJECTIONS: usize = 256;

/// Aborts the root keeps to replay to ranks that join later (later ones are still forwarded).
pub const MAX_KEPT_ABORTS: usize = 1024;

/// Connections that have not said hello yet, oldest first: `(conn, a clone of its socket)`.
type PendingList = Arc<std::sync::Mutex<std::collections::VecDeque<(u64, TcpStream)>>>;

/// Removes a connection from the pending list when it says hello or ends.
struct Pending {
    conn: u64,
    list: PendingList,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|(c, _)| *c != self.conn);
    }
}

/// What the acceptor and the readers of connections that have not said hello share: the
/// channel to the coordinator and the root's settings.
#[derive(Clone)]
struct Intake {
    tx: Sender<Event>,
    stop: Arc<AtomicBool>,
    hello_timeout: Duration,
    job_id: u64,
    key: JobKey,
    /// Reader threads of connections that have not authenticated yet.
    live: Arc<std::sync::atomic::AtomicUsize>,
}

/// Counts one unauthenticated reader thread in [`Intake::live`] until dropped.
struct LiveGuard(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Intake {
    /// Logs a connection rejected before its hello (`warn`) and reports it to the coordinator.
    /// Logged here, not by the coordinator, so a stranger is logged even after the job is over.
    fn reject(&self, peer: SocketAddr, reason: String) {
        tracing::warn!(
            job = %format_args!("{:016x}", self.job_id),
            "bootstrap root: {peer}: {reason}"
        );
        let _ = self.tx.send(Event::Rejected { peer, reason });
    }

    /// [`Intake::reject`], then tells the peer why and closes the connection.
    fn reject_and_drain(&self, stream: &mut TcpStream, peer: SocketAddr, reason: String) {
        let text = reason.clone();
        self.reject(peer, reason);
        reject_and_close(stream, &text);
    }
}

fn accept_loop(listener: TcpListener, intake: Intake) {
    let stop = &intake.stop;
    use nix::poll::{poll, PollFd, PollFlags};
    let mut next_conn = 0u64;
    let pending: PendingList = Arc::default();
    // SYNC POINT: pairs with the Release store in `RootHandle::shutdown` / the coordinator exit.
    while !stop.load(Ordering::Acquire) {
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, 100u16) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => {
                std::thread::sleep(READ_TICK);
                continue;
            }
        }
        loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    let conn = next_conn;
                    next_conn += 1;
                    if intake.live.load(Ordering::Acquire) >= MAX_UNAUTHENTICATED_THREADS {
                        // Evicted readers have not ended yet: close this one at once, no thread.
                        drop(stream);
                        intake.reject(
                            peer,
                            format!(
                                "closed at once: {MAX_UNAUTHENTICATED_THREADS} unauthenticated \
                                 connections are being served"
                            ),
                        );
                        continue;
                    }
                    let waiting = match wait_for_hello(&pending, conn, &stream) {
                        Ok((waiting, evicted)) => {
                            if let Some(old) = evicted {
                                intake.reject(
                                    old,
                                    format!(
                                        "closed without a hello: {MAX_PENDING_HELLOS} newer \
                                         connections were waiting to say hello"
                                    ),
                                );
                            }
                            waiting
                        }
                        Err(e) => {
                            intake.reject(peer, format!("cannot clone the socket: {e}"));
                            continue;
                        }
                    };
                    let intake = intake.clone();
                    intake.live.fetch_add(1, Ordering::AcqRel);
                    let live = LiveGuard(intake.live.clone());
                    let spawned = std::thread::Builder::new()
                        .name("xccl-root-conn".into())
                        .spawn(move || conn_reader(conn, stream, peer, intake, waiting, live));
                    if spawned.is_err() {
                        // Out of threads: the connection is dropped (closed) and the peer retries
                        // or times out; the root itself goes on.
                        continue;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // EMFILE and friends: the backlog stays readable, so wait a little first.
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
    }
}

/// Adds connection `conn` to the pending list; when the list is full, first closes its oldest
/// connection (whose reader then ends) and returns that one's peer address.
fn wait_for_hello(
    pending: &PendingList,
    conn: u64,
    stream: &TcpStream,
) -> std::io::Result<(Pending, Option<SocketAddr>)> {
    let clone = stream.try_clone()?;
    let mut list = pending.lock().unwrap_or_else(|e| e.into_inner());
    let mut evicted = None;
    if list.len() >= MAX_PENDING_HELLOS {
        if let Some((_, old)) = list.pop_front() {
            evicted = old.peer_addr().ok();
            let _ = old.shutdown(Shutdown::Both);
        }
    }
    list.push_back((conn, clone));
    drop(list);
    let waiting = Pending {
        conn,
        list: pending.clone(),
    };
    Ok((waiting, evicted))
}

/// Sends an error frame to a peer that is being rejected and closes the connection at once,
/// first discarding what the peer already sent (without waiting for more) so the close does not
/// reset the connection before the peer has read the error.
fn reject_and_close(stream: &mut TcpStream, reason: &str) {
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = wire::write_frame(stream, Kind::Error, 0, wire::clip(reason).as_bytes());
    let _ = stream.shutdown(Shutdown::Write);
    discard_buffered(stream);
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads and drops what has already arrived on `stream`, without waiting for more.
fn discard_buffered(stream: &mut TcpStream) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let mut sink = [0u8; 4096];
    for _ in 0..64 {
        match stream.read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
}

fn drain(stream: &mut TcpStream, stop: &AtomicBool) {
    let until = Instant::now() + Duration::from_secs(1);
    let mut sink = [0u8; 4096];
    // SYNC POINT: pairs with the Release store that stops the root.
    while Instant::now() < until && !stop.load(Ordering::Acquire) {
        match stream.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
}

/// Reads the hello, challenges the peer and checks its proof of the job key, all within the
/// hello timeout. Returns the claimed `(rank, size)` and the root's own proof; on any failure
/// the peer is told what was wrong (never a secret, nor this job's id) and the connection is
/// closed at once.
fn authenticate(
    stream: &mut TcpStream,
    peer: SocketAddr,
    intake: &Intake,
) -> Option<(u64, u64, [u8; key::MAC_LEN])> {
    let hello_timeout = intake.hello_timeout;
    let deadline = deadline_after(hello_timeout);
    let stop = &intake.stop;
    let hello = match wire::read_frame(stream, Some(deadline), stop, 0, &|k| k == Kind::Hello) {
        Ok(frame) => wire::decode_hello(&frame.payload),
        Err(ReadError::Stopped) => return None,
        Err(ReadError::Eof) => {
            intake.reject(peer, "closed the connection before saying hello".into());
            return None;
        }
        Err(ReadError::Timeout) => {
            let reason = format!("no hello within {hello_timeout:?}");
            intake.reject_and_drain(stream, peer, reason);
            return None;
        }
        Err(e) => {
            let reason = format!("rejected before hello: {e}");
            intake.reject_and_drain(stream, peer, reason);
            return None;
        }
    };
    let Some((job_id, rank, size, rank_nonce)) = hello else {
        intake.reject_and_drain(stream, peer, "malformed hello".into());
        return None;
    };
    if job_id != intake.job_id {
        let reason = format!(
            "job id mismatch: the hello is for job {job_id:016x}, which this root does not serve"
        );
        intake.reject_and_drain(stream, peer, reason);
        return None;
    }
    let mut root_nonce = [0u8; NONCE_LEN];
    if let Err(e) = key::random_bytes(&mut root_nonce) {
        intake.reject_and_drain(stream, peer, format!("the root cannot make a nonce: {e}"));
        return None;
    }
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    if wire::write_frame(stream, Kind::Challenge, 0, &root_nonce).is_err() {
        intake.reject(peer, "the challenge could not be sent".into());
        return None;
    }
    let fields = HelloFields {
        job_id,
        rank,
        size,
        rank_nonce,
        root_nonce,
    };
    let proof = match wire::read_frame(stream, Some(deadline), stop, 0, &|k| k == Kind::Auth) {
        Ok(frame) => frame.payload,
        Err(ReadError::Stopped) => return None,
        Err(ReadError::Eof) => {
            intake.reject(peer, "closed the connection before authenticating".into());
            return None;
        }
        Err(ReadError::Timeout) => {
            let reason = format!("no hello within {hello_timeout:?} (not authenticated)");
            intake.reject_and_drain(stream, peer, reason);
            return None;
        }
        Err(e) => {
            intake.reject_and_drain(stream, peer, format!("rejected before authenticating: {e}"));
            return None;
        }
    };
    if !intake.key.verify_hello(Side::Rank, &fields, &proof) {
        let reason = format!(
            "authentication failed: the hello for rank {rank} was not made with this job's key \
             (a unique id or {} of another job?)",
            key::KEY_ENV
        );
        intake.reject_and_drain(stream, peer, reason);
        return None;
    }
    Some((rank, size, intake.key.hello_mac(Side::Root, &fields)))
}

fn conn_reader(
    conn: u64,
    mut stream: TcpStream,
    peer: SocketAddr,
    intake: Intake,
    waiting: Pending,
    live: LiveGuard,
) {
    let setup = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(READ_TICK)));
    if let Err(e) = setup {
        intake.reject(peer, format!("socket setup failed: {e}"));
        return;
    }
    wire::tune(&stream);
    let Some((rank, size, welcome)) = authenticate(&mut stream, peer, &intake) else {
        return;
    };
    // Authenticated: no longer counts against the pending cap or the thread bound.
    drop(waiting);
    drop(live);
    let Intake {
        ref tx, ref stop, ..
    } = intake;
    let write_half = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            intake.reject(peer, format!("cannot clone the socket: {e}"));
            return;
        }
    };
    let sent = tx.send(Event::Hello {
        conn,
        stream: write_half,
        peer,
        rank,
        size,
        welcome,
    });
    if sent.is_err() {
        return;
    }
    let allowed = |k: Kind| {
        matches!(
            k,
            Kind::Data | Kind::Survivors | Kind::Query | Kind::Abort | Kind::Bye
        )
    };
    loop {
        match wire::read_frame(&mut stream, None, stop, 0, &allowed) {
            Ok(frame) => {
                if tx.send(Event::Frame { conn, frame }).is_err() {
                    return;
                }
            }
            Err(ReadError::Stopped) => return,
            Err(e) => {
                let protocol = matches!(e, ReadError::Malformed(_));
                let _ = tx.send(Event::Closed {
                    conn,
                    reason: e.to_string(),
                    protocol,
                });
                if protocol {
                    drain(&mut stream, stop);
                }
                return;
            }
        }
    }
}

/// Where a rank stands with the root.
enum Slot {
    /// Has not said hello yet.
    Absent,
    /// Joined; `stream` is the write half of its connection.
    Connected { conn: u64, stream: TcpStream },
    /// Joined and left (cleanly or not).
    Gone { reason: String },
}

struct Coordinator {
    cfg: RootConfig,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    size: Option<usize>,
    ranks: Vec<Slot>,
    conns: HashMap<u64, usize>,
    /// The round being gathered.
    round: u64,
    /// Blobs of the current round, by rank.
    blobs: Vec<Option<Vec<u8>>>,
    contributed: usize,
    /// The current round is a survivors' round (set by its first contribution).
    survivors: bool,
    /// Contributors of the current round already told that it failed.
    told_failed: Vec<bool>,
    /// Aborts raised, with the death each reports: the first [`MAX_KEPT_ABORTS`], replayed to
    /// ranks that join later.
    aborts: Vec<AbortNotice>,
    connected: usize,
    idle_since: Instant,
    report: RootReport,
}

impl Coordinator {
    fn new(cfg: RootConfig, stop: Arc<AtomicBool>, acceptor: JoinHandle<()>) -> Self {
        let mut c = Coordinator {
            cfg,
            stop,
            acceptor: Some(acceptor),
            size: None,
            ranks: Vec::new(),
            conns: HashMap::new(),
            round: 0,
            blobs: Vec::new(),
            contributed: 0,
            survivors: false,
            told_failed: Vec::new(),
            aborts: Vec::new(),
            connected: 0,
            idle_since: Instant::now(),
            report: RootReport::default(),
        };
        if let Some(size) = c.cfg.size.filter(|&s| s > 0) {
            c.set_size(size);
        }
        c
    }

    fn set_size(&mut self, size: usize) {
        self.size = Some(size);
        self.ranks = (0..size).map(|_| Slot::Absent).collect();
        self.blobs = vec![None; size];
        self.told_failed = vec![false; size];
    }

    fn run(mut self, rx: Receiver<Event>) -> RootReport {
        let exit = loop {
            // SYNC POINT: pairs with the Release store in `RootHandle::shutdown`.
            if self.stop.load(Ordering::Acquire) {
                break "stopped by its owner".to_string();
            }
            if self.size.is_some() && self.ranks.iter().all(|s| matches!(s, Slot::Gone { .. })) {
                break "every rank has left".to_string();
            }
            if self.connected == 0 && self.idle_since.elapsed() >= self.cfg.idle_timeout {
                break format!(
                    "no rank connected for {:?} (idle timeout)",
                    self.cfg.idle_timeout
                );
            }
            match rx.recv_timeout(READ_TICK) {
                Ok(ev) => self.on_event(ev),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break "acceptor stopped".to_string(),
            }
        };
        // SYNC POINT: pairs with the Acquire loads in the acceptor and readers.
        self.stop.store(true, Ordering::Release);
        for slot in &mut self.ranks {
            if let Slot::Connected { stream, .. } = slot {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        self.report.exit = exit;
        self.report
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Hello {
                conn,
                stream,
                peer,
                rank,
                size,
                welcome,
            } => self.on_hello(conn, stream, peer, rank, size, &welcome),
            Event::Frame { conn, frame } => {
                if let Some(&rank) = self.conns.get(&conn) {
                    self.on_frame(rank, frame);
                }
            }
            Event::Closed {
                conn,
                reason,
                protocol,
            } => {
                if let Some(&rank) = self.conns.get(&conn) {
                    if protocol {
                        self.note_rejected(format!("rank {rank} dropped: {reason}"));
                        self.drop_rank(
                            rank,
                            format!("dropped by the root: {reason}"),
                            Some(&reason),
                        );
                    } else {
                        self.drop_rank(rank, format!("connection lost: {reason}"), None);
                    }
                }
            }
            // Logged where it was rejected.
            Event::Rejected { peer, reason } => self.keep_rejection(format!("{peer}: {reason}")),
        }
    }

    fn on_hello(
        &mut self,
        conn: u64,
        mut stream: TcpStream,
        peer: SocketAddr,
        rank: u64,
        size: u64,
        welcome: &[u8],
    ) {
        if let Err(reason) = self.admit(rank, size) {
            // Closed at once (the peer sends nothing while it waits for the welcome); the reader
            // then sees the end of the stream and exits.
            reject_and_close(&mut stream, &reason);
            self.note_rejected(format!("{peer}: {reason}"));
            return;
        }
        // `admit` checked that both fit in `usize` and that `rank < size`.
        let rank = rank as usize;
        let _ = stream.set_write_timeout(Some(self.cfg.write_timeout));
        if let Err(e) = wire::write_frame(&mut stream, Kind::Welcome, 0, welcome) {
            let _ = stream.shutdown(Shutdown::Both);
            self.ranks[rank] = Slot::Gone {
                reason: format!("welcome could not be sent: {e}"),
            };
            self.report.joined += 1;
            self.check_round();
            return;
        }
        self.ranks[rank] = Slot::Connected { conn, stream };
        self.conns.insert(conn, rank);
        self.connected += 1;
        self.report.joined += 1;
        let earlier: Vec<AbortNotice> = self.aborts.clone();
        for a in earlier {
            let payload = wire::encode_relayed_abort(a.by, a.dead, &a.reason);
            self.send(rank, Kind::Abort, 0, &payload);
        }
    }

    /// Checks a hello against the job; the error is the text sent back to the peer.
    fn admit(&mut self, rank: u64, size: u64) -> Result<(), String> {
        let size = match usize::try_from(size) {
            Ok(s) if s <= wire::MAX_WORLD => s,
            _ => {
                return Err(format!(
                    "world size {size} is too large (a root serves at most {} ranks)",
                    wire::MAX_WORLD
                ))
            }
        };
        if size == 0 {
            return Err("world size 0".into());
        }
        match self.size {
            Some(s) if s != size => {
                return Err(format!(
                    "world size mismatch: the job has {s} ranks, rank {rank} says {size}"
                ))
            }
            Some(_) => {}
            None => {
                if rank >= size as u64 {
                    return Err(format!("rank {rank} is out of range for world size {size}"));
                }
                self.set_size(size);
            }
        }
        if rank >= size as u64 {
            return Err(format!("rank {rank} is out of range for world size {size}"));
        }
        match &self.ranks[rank as usize] {
            Slot::Absent => Ok(()),
            Slot::Connected { .. } => {
                Err(format!("duplicate rank: rank {rank} has already joined"))
            }
            Slot::Gone { .. } => Err(format!(
                "duplicate rank: rank {rank} has already joined and left"
            )),
        }
    }

    fn on_frame(&mut self, rank: usize, frame: Frame) {
        match frame.kind {
            Kind::Data => self.on_data(rank, frame.round, frame.payload, false),
            Kind::Survivors => self.on_data(rank, frame.round, frame.payload, true),
            Kind::Query => {
                let missing = if frame.round == self.round {
                    self.missing()
                } else {
                    Vec::new()
                };
                let payload = wire::encode_missing(&missing);
                self.send(rank, Kind::Status, frame.round, &payload);
            }
            Kind::Abort => {
                // The record is relayed as sent; every rank checks the dead rank against its job
                // (`AbortNotice::to_error`). A payload too short for the dead word still aborts.
                let (dead, reason) = wire::decode_abort(&frame.payload).unwrap_or_else(|| {
                    let n = frame.payload.len();
                    (None, format!("malformed abort frame of {n} bytes"))
                });
                if self.aborts.len() < MAX_KEPT_ABORTS {
                    self.aborts.push(AbortNotice {
                        by: rank,
                        dead,
                        reason: reason.clone(),
                    });
                }
                let payload = wire::encode_relayed_abort(rank, dead, &reason);
                for other in 0..self.ranks.len() {
                    if other != rank {
                        self.send(other, Kind::Abort, 0, &payload);
                    }
                }
            }
            Kind::Bye => {
                self.send(rank, Kind::ByeAck, 0, &[]);
                self.drop_rank(rank, "left the job".into(), None);
            }
            // The reader only lets the kinds above through.
            _ => {}
        }
    }

    fn on_data(&mut self, rank: usize, round: u64, blob: Vec<u8>, survivors: bool) {
        let mixed = self.contributed > 0 && self.survivors != survivors;
        if round != self.round || self.blobs[rank].is_some() || mixed {
            let detail = format!(
                "sent data for round {round} while the root is gathering round {}{}",
                self.round,
                if mixed {
                    " (a survivors' round and an ordinary one mixed)"
                } else if round == self.round {
                    " (twice)"
                } else {
                    ""
                }
            );
            self.note_rejected(format!("rank {rank} dropped: {detail}"));
            self.drop_rank(
                rank,
                format!("dropped by the root: {detail}"),
                Some(&detail),
            );
            return;
        }
        self.blobs[rank] = Some(blob);
        self.survivors = survivors;
        self.contributed += 1;
        self.check_round();
    }

    /// Completes the current round if it can: every rank contributed, or (survivors' round)
    /// every rank that did not has left. Sends the result to every connected rank.
    fn complete_round(&mut self) -> bool {
        let all_in = self.contributed == self.blobs.len();
        let rest_gone = || {
            self.blobs
                .iter()
                .zip(&self.ranks)
                .all(|(b, s)| b.is_some() || matches!(s, Slot::Gone { .. }))
        };
        if self.contributed == 0 || !(all_in || (self.survivors && rest_gone())) {
            return false;
        }
        // A rank that left has an empty blob (survivors' rounds carry a presence mark).
        let blobs: Vec<Vec<u8>> = self
            .blobs
            .iter_mut()
            .map(|b| b.take().unwrap_or_default())
            .collect();
        let payload = wire::encode_blobs(&blobs);
        let round = self.round;
        self.round += 1;
        self.contributed = 0;
        self.told_failed.iter_mut().for_each(|t| *t = false);
        self.report.rounds += 1;
        for r in 0..self.ranks.len() {
            self.send(r, Kind::Result, round, &payload);
        }
        true
    }

    /// Ranks that have not contributed to the current round, and why.
    fn missing(&self) -> Vec<(usize, Absence)> {
        self.blobs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.is_none())
            .map(|(r, _)| {
                let absence = match self.ranks[r] {
                    Slot::Absent => Absence::NeverConnected,
                    Slot::Connected { .. } => Absence::Late,
                    Slot::Gone { .. } => Absence::Left,
                };
                (r, absence)
            })
            .collect()
    }

    /// Completes the current round if it can; otherwise, if a rank that has not contributed to
    /// an ordinary round is gone, the round cannot complete: tells every contributor (once)
    /// which rank it is.
    fn check_round(&mut self) {
        if self.complete_round() || self.contributed == 0 || self.survivors {
            return;
        }
        let gone = self
            .blobs
            .iter()
            .enumerate()
            .find_map(|(r, b)| match (&self.ranks[r], b) {
                (Slot::Gone { reason }, None) => Some((r, reason.clone())),
                _ => None,
            });
        let Some((gone, reason)) = gone else {
            return;
        };
        let payload = wire::encode_rank_text(gone, &reason);
        for r in 0..self.ranks.len() {
            if self.blobs[r].is_some() && !self.told_failed[r] {
                self.told_failed[r] = true;
                self.send(r, Kind::Failed, self.round, &payload);
            }
        }
    }

    /// Records a rejected connection or dropped rank in the report and logs it (`warn`).
    fn note_rejected(&mut self, line: String) {
        tracing::warn!(job = %format_args!("{:016x}", self.cfg.job_id), "bootstrap root: {line}");
        self.keep_rejection(line);
    }

    /// Keeps a rejection line in the report, or counts it once the report holds
    /// [`MAX_KEPT_REJECTIONS`].
    fn keep_rejection(&mut self, line: String) {
        if self.report.rejected.len() < MAX_KEPT_REJECTIONS {
            self.report.rejected.push(line);
        } else {
            self.report.rejected_not_kept += 1;
        }
    }

    /// Writes a frame to `rank` if it is connected; a failed write drops the rank.
    fn send(&mut self, rank: usize, kind: Kind, round: u64, payload: &[u8]) {
        let Slot::Connected { stream, .. } = &mut self.ranks[rank] else {
            return;
        };
        if let Err(e) = wire::write_frame(stream, kind, round, payload) {
            self.drop_rank(rank, format!("write to the rank failed: {e}"), None);
        }
    }

    /// Marks `rank` gone, optionally telling it why first, and closes its connection.
    fn drop_rank(&mut self, rank: usize, reason: String, tell: Option<&str>) {
        let slot = std::mem::replace(&mut self.ranks[rank], Slot::Gone { reason });
        if let Slot::Connected { conn, mut stream } = slot {
            if let Some(text) = tell {
                let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = wire::write_frame(&mut stream, Kind::Error, 0, wire::clip(text).as_bytes());
            }
            // Half-close: the rank reads what was sent, then closes; the reader sees EOF.
            let _ = stream.shutdown(Shutdown::Write);
            self.conns.remove(&conn);
            self.connected -= 1;
            if self.connected == 0 {
                self.idle_since = Instant::now();
            }
        }
        self.check_round();
    }
}
