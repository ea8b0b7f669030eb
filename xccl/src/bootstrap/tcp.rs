//! [`TcpBootstrap`]: the rank side of a TCP rendezvous through a root service.
//!
//! Each rank holds one connection to the root. The calling thread writes (DATA, QUERY, ABORT,
//! BYE); a background reader thread reads everything the root sends into an inbox, so aborts are
//! noticed even when no collective is running.
//!
//! A collective round that passes its deadline asks the root which ranks have not contributed
//! (a QUERY, answered by a STATUS within [`QUERY_GRACE`]) and names them in the error. After a
//! round fails (timeout, abort, a peer gone, the root gone) the round stays half-done at the
//! root, so the bootstrap refuses further collectives with [`Error::Bootstrap`]; abort messages
//! still flow.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::key::{self, HelloFields, JobKey, Side, NONCE_LEN};
use super::root::{RootHandle, MAX_KEPT_ABORTS};
use super::unique_id::UniqueId;
use super::wire::{self, Absence, Kind, ReadError, MAX_BLOB, READ_TICK};
use super::{Exchange, Survivors};
use crate::fabric::deadline_after;
use crate::{AbortNotice, Error, Result};

/// How long a rank whose round timed out waits for the root to say who is missing.
pub const QUERY_GRACE: Duration = Duration::from_secs(1);
/// How long dropping a [`TcpBootstrap`] waits for the root to acknowledge the goodbye.
const BYE_WAIT: Duration = Duration::from_secs(2);
/// Longest [`Exchange::broadcast_abort`] waits for another thread's write to finish.
pub(crate) const ABORT_LOCK_WAIT: Duration = Duration::from_millis(250);
/// Write timeout of an abort frame.
pub(crate) const ABORT_WRITE_TIMEOUT: Duration = Duration::from_millis(500);
/// Write timeout for control frames (hello, query).
const CONTROL_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// One rank's connection to a TCP rendezvous; implements [`Exchange`].
///
/// Dropping it says goodbye to the root (waiting at most 2 s for the acknowledgement, which
/// also guarantees the root has delivered every earlier result), closes the connection and joins
/// the reader thread.
pub struct TcpBootstrap {
    rank: usize,
    size: usize,
    job_id: u64,
    key: JobKey,
    root: SocketAddr,
    writer: Mutex<TcpStream>,
    shared: Arc<Shared>,
    calls: Mutex<Calls>,
    reader: Option<JoinHandle<()>>,
    /// The root service this rank hosts, if any (launcher mode, rank 0); detached on drop.
    hosted_root: Option<RootHandle>,
}

impl std::fmt::Debug for TcpBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBootstrap")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("job_id", &format_args!("{:016x}", self.job_id))
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

/// State shared with the reader thread.
struct Shared {
    inbox: Mutex<Inbox>,
    cv: Condvar,
    stop: AtomicBool,
}

/// What the reader thread has received.
#[derive(Default)]
struct Inbox {
    /// The RESULT of a round, undecoded: `(round, payload, aborts received before it)`.
    result: Option<(u64, Vec<u8>, usize)>,
    /// The latest STATUS: `(round, missing ranks)`.
    status: Option<(u64, Vec<(usize, Absence)>)>,
    /// A round that cannot complete: `(round, gone rank, detail)`.
    failed: Option<(u64, usize, String)>,
    /// Abort records raised by other ranks, in arrival order: the first [`MAX_KEPT_ABORTS`].
    aborts: Vec<AbortNotice>,
    /// Aborts received in all (later ones are counted, not kept).
    abort_count: usize,
    /// Why the connection to the root ended, once it has.
    closed: Option<String>,
    bye_acked: bool,
}

impl Inbox {
    /// The `i`-th abort received; past the kept ones, the last kept one (so an abort is never
    /// missed, only its text).
    fn abort_at(&self, i: usize) -> Option<&AbortNotice> {
        if i < self.aborts.len() {
            self.aborts.get(i)
        } else if i < self.abort_count {
            self.aborts.last()
        } else {
            None
        }
    }
}

/// How a round treats ranks that left and aborts.
#[derive(Clone, Copy, Debug)]
enum RoundKind {
    /// Every rank must contribute; any abort fails the round.
    All,
    /// A survivors' round: ranks that left are skipped, and the aborts received before the
    /// `horizon`-th (in arrival order) do not fail it.
    Survivors { horizon: usize },
}

/// State of the calling side, one collective at a time.
struct Calls {
    next_round: u64,
    /// Why collectives are refused, once a round has failed.
    poisoned: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl TcpBootstrap {
    /// Joins the job named by `id` as `rank` of `size`.
    ///
    /// Retries connecting until `timeout` passes (the root may start slightly later), then sends
    /// the hello and waits for the root to accept it. Returns once this rank is accepted; the
    /// other ranks may still be on their way (the first collective waits for them).
    ///
    /// The rank proves it holds the id's key and checks that the root does too (see
    /// [`root`](super::root)), so it never joins another job's root on the same port.
    ///
    /// Errors: [`Error::InvalidArgument`] for `rank >= size` or a world size above 65,536;
    /// [`Error::Bootstrap`] when the root rejects the hello (wrong job id, key or world size,
    /// duplicate rank) or cannot prove it holds the key; [`Error::Timeout`] (with `peer` 0, the conventional root host) when the
    /// root cannot be reached in time.
    pub fn connect(id: &UniqueId, rank: usize, size: usize, timeout: Duration) -> Result<Self> {
        let key = id.key();
        Self::connect_to(id.root_addr(), id.job_id(), &key, rank, size, timeout, None)
    }

    /// Like [`TcpBootstrap::connect`] with the root address and job id given directly;
    /// `hosted_root` is a root service this rank started and keeps (detached) for its lifetime.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect_to(
        root: SocketAddr,
        job_id: u64,
        key: &JobKey,
        rank: usize,
        size: usize,
        timeout: Duration,
        hosted_root: Option<RootHandle>,
    ) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(Error::invalid(format!(
                "rank {rank} is out of range for world size {size}"
            )));
        }
        if size > wire::MAX_WORLD {
            return Err(Error::invalid(format!(
                "world size {size} is too large for the TCP bootstrap (at most {})",
                wire::MAX_WORLD
            )));
        }
        let start = Instant::now();
        let deadline = deadline_after(timeout);
        let stream = loop {
            let mut stream = connect_retrying(root, rank, deadline, start)?;
            match handshake(&mut stream, root, job_id, key, rank, size, deadline) {
                Ok(()) => break stream,
                // The root closed before answering (too busy with unauthenticated connections
                // to serve this one): try again while the deadline allows.
                Err(Handshake::Dropped(why)) => {
                    if Instant::now() + Duration::from_millis(50) >= deadline {
                        return Err(Error::Bootstrap(format!(
                            "hello of rank {rank} to the root at {root} failed: {why}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(Handshake::TimedOut) => {
                    return Err(Error::Timeout {
                        peer: crate::error::BOOTSTRAP_ROOT,
                        what: format!(
                            "the bootstrap root at {root} to accept the hello of rank {rank}"
                        ),
                        waited: start.elapsed(),
                    })
                }
                Err(Handshake::Failed(e)) => return Err(e),
            }
        };
        fault_point!("init.connected");
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let read_half = stream
            .try_clone()
            .map_err(|e| Error::os("cloning the bootstrap socket", e))?;
        let reader = {
            let shared = shared.clone();
            let result_max = wire::result_max(size);
            std::thread::Builder::new()
                .name(format!("xccl-boot-{rank}"))
                .spawn(move || reader_loop(read_half, shared, result_max))
                .map_err(|e| Error::os("spawning the bootstrap reader thread", e))?
        };
        Ok(TcpBootstrap {
            rank,
            size,
            job_id,
            key: key.clone(),
            root,
            writer: Mutex::new(stream),
            shared,
            calls: Mutex::new(Calls {
                next_round: 0,
                poisoned: None,
            }),
            reader: Some(reader),
            hosted_root,
        })
    }

    /// The root service's address.
    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }

    /// One collective round: contributes `blob`, returns every rank's blob and the number of
    /// aborts received before the result.
    fn round(
        &self,
        blob: &[u8],
        timeout: Duration,
        what: &str,
        kind: RoundKind,
    ) -> Result<(Vec<Vec<u8>>, usize)> {
        if blob.len() > MAX_BLOB {
            return Err(Error::invalid(format!(
                "bootstrap {what} blob of {} bytes exceeds the limit of {MAX_BLOB}",
                blob.len()
            )));
        }
        let mut calls = lock(&self.calls);
        if let Some(why) = &calls.poisoned {
            return Err(Error::Bootstrap(format!(
                "bootstrap of rank {} is unusable: {why}",
                self.rank
            )));
        }
        let round = calls.next_round;
        let start = Instant::now();
        let deadline = deadline_after(timeout);
        if let Some(err) = self.settled_error(&lock(&self.shared.inbox), round, what, kind) {
            return Err(err);
        }
        let sent = {
            let mut w = lock(&self.writer);
            let budget = timeout.max(Duration::from_millis(1));
            w.set_write_timeout(Some(budget)).and_then(|()| match kind {
                RoundKind::All => wire::write_frame(&mut w, Kind::Data, round, blob),
                // The presence mark: a rank that left has an empty blob in the result.
                RoundKind::Survivors { .. } => {
                    let marked = [&[1u8][..], blob].concat();
                    wire::write_frame(&mut w, Kind::Survivors, round, &marked)
                }
            })
        };
        if let Err(e) = sent {
            calls.poisoned = Some(format!("sending round {round} failed: {e}"));
            return Err(Error::os(
                format!(
                    "sending bootstrap {what} round {round} to the root at {}",
                    self.root
                ),
                e,
            ));
        }
        let outcome = self.wait_round(round, deadline, what, kind);
        match outcome {
            Ok(blobs) => {
                calls.next_round += 1;
                Ok(blobs)
            }
            Err(Wait::Failed(err)) => {
                calls.poisoned = Some(format!("{what} round {round} failed: {err}"));
                Err(err)
            }
            Err(Wait::TimedOut) => match self.timeout_error(round, start, what, kind) {
                // The round completed while we asked who was missing.
                Ok(blobs) => {
                    calls.next_round += 1;
                    Ok(blobs)
                }
                Err(err) => {
                    calls.poisoned = Some(format!("{what} round {round} failed: {err}"));
                    Err(err)
                }
            },
        }
    }

    /// Waits for the result of `round` until `deadline`.
    fn wait_round(
        &self,
        round: u64,
        deadline: Instant,
        what: &str,
        kind: RoundKind,
    ) -> std::result::Result<(Vec<Vec<u8>>, usize), Wait> {
        let mut inbox = lock(&self.shared.inbox);
        loop {
            if let Some(done) = self.take_result(&mut inbox, round) {
                return done.map_err(Wait::Failed);
            }
            if let Some(err) = self.settled_error(&inbox, round, what, kind) {
                return Err(Wait::Failed(err));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Wait::TimedOut);
            }
            inbox = self
                .shared
                .cv
                .wait_timeout(inbox, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Takes and decodes the result of `round` if it is in the inbox.
    fn take_result(&self, inbox: &mut Inbox, round: u64) -> Option<Result<(Vec<Vec<u8>>, usize)>> {
        if !matches!(&inbox.result, Some((r, _, _)) if *r == round) {
            return None;
        }
        let (_, payload, aborts) = inbox.result.take()?;
        let blobs = wire::decode_blobs(&payload, self.size).ok_or_else(|| {
            Error::Bootstrap(format!(
                "malformed result of round {round} from the root at {}",
                self.root
            ))
        });
        Some(blobs.map(|b| (b, aborts)))
    }

    /// An error that ends `round` without waiting further: an abort from another rank, a rank
    /// gone for good, or the connection to the root lost.
    fn settled_error(
        &self,
        inbox: &Inbox,
        round: u64,
        what: &str,
        kind: RoundKind,
    ) -> Option<Error> {
        let ignored = match kind {
            RoundKind::All => 0,
            RoundKind::Survivors { horizon } => horizon,
        };
        if let Some(notice) = inbox.abort_at(ignored) {
            return Some(notice.to_error(self.size));
        }
        if let Some((r, peer, detail)) = &inbox.failed {
            if *r == round {
                return Some(Error::PeerFailed {
                    peer: *peer,
                    detail: format!("{detail}; bootstrap {what} round {round} cannot complete"),
                });
            }
        }
        inbox.closed.as_ref().map(|why| {
            Error::Bootstrap(format!(
                "{what} round {round}: connection to the root at {} lost: {why}",
                self.root
            ))
        })
    }

    /// After the deadline of `round`: asks the root who is missing and builds the timeout error,
    /// or returns the result if it arrives meanwhile.
    fn timeout_error(
        &self,
        round: u64,
        start: Instant,
        what: &str,
        kind: RoundKind,
    ) -> Result<(Vec<Vec<u8>>, usize)> {
        let waited = start.elapsed();
        {
            let mut w = lock(&self.writer);
            let _ = w
                .set_write_timeout(Some(QUERY_GRACE))
                .and_then(|()| wire::write_frame(&mut w, Kind::Query, round, &[]));
        }
        let grace = Instant::now() + QUERY_GRACE;
        let mut inbox = lock(&self.shared.inbox);
        let missing = loop {
            if let Some(done) = self.take_result(&mut inbox, round) {
                return done;
            }
            if let Some(err) = self.settled_error(&inbox, round, what, kind) {
                return Err(err);
            }
            match &inbox.status {
                Some((r, missing)) if *r == round && !missing.is_empty() => {
                    break Some(missing.clone())
                }
                _ => {}
            }
            let now = Instant::now();
            if now >= grace {
                break None;
            }
            inbox = self
                .shared
                .cv
                .wait_timeout(inbox, grace - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(inbox);
        let Some(missing) = missing else {
            return Err(Error::Timeout {
                peer: crate::error::BOOTSTRAP_ROOT,
                what: format!(
                    "bootstrap {what} round {round}: the root at {} did not say which ranks are missing",
                    self.root
                ),
                waited,
            });
        };
        let ranks: Vec<usize> = missing.iter().map(|(r, _)| *r).collect();
        let of = |a: Absence| -> Vec<usize> {
            missing
                .iter()
                .filter(|(_, x)| *x == a)
                .map(|(r, _)| *r)
                .collect()
        };
        let mut notes = Vec::new();
        let never = of(Absence::NeverConnected);
        if !never.is_empty() {
            notes.push(format!("never connected: {never:?}"));
        }
        let left = of(Absence::Left);
        if !left.is_empty() {
            notes.push(format!("left the job: {left:?}"));
        }
        let late = of(Absence::Late);
        if !late.is_empty() {
            notes.push(format!("connected but not in this round: {late:?}"));
        }
        Err(Error::Timeout {
            peer: ranks[0],
            what: format!(
                "bootstrap {what} round {round}: ranks {ranks:?} have not arrived ({})",
                notes.join("; ")
            ),
            waited,
        })
    }
}

/// Why waiting for a round ended without a result.
enum Wait {
    Failed(Error),
    TimedOut,
}

impl Exchange for TcpBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn job_id(&self) -> u64 {
        self.job_id
    }

    fn key(&self) -> &JobKey {
        &self.key
    }

    /// Sends `blob` (at most [`MAX_BLOB`] bytes) to the root and waits for every rank's blob.
    ///
    /// Fails with [`Error::Timeout`] naming the ranks the root is still waiting for,
    /// [`Error::Aborted`] when another rank has raised an abort, [`Error::PeerFailed`] when a
    /// rank that has not contributed has left the job.
    fn allgather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.round(blob, timeout, "allgather", RoundKind::All)
            .map(|(blobs, _)| blobs)
    }

    /// An allgather of empty blobs.
    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.round(&[], timeout, "barrier", RoundKind::All)
            .map(|_| ())
    }

    /// A survivors' round through the root (see [`Exchange::gather_survivors`]): it completes
    /// once every rank has contributed or closed its connection to the root (a killed process's
    /// connection closes at once). Fails when the root is gone, on an abort received after the
    /// first `ignore_aborts` ones, or on timeout naming the ranks still connected that have not
    /// contributed.
    fn gather_survivors(
        &self,
        blob: &[u8],
        timeout: Duration,
        ignore_aborts: usize,
    ) -> Result<Survivors> {
        let kind = RoundKind::Survivors {
            horizon: ignore_aborts,
        };
        let (blobs, aborts_before) = self.round(blob, timeout, "survivors", kind)?;
        let blobs = blobs
            .into_iter()
            .map(|b| b.split_first().map(|(_, rest)| rest.to_vec()))
            .collect();
        Ok(Survivors {
            blobs,
            aborts_before,
        })
    }

    fn poll_abort_since(&self, first: usize) -> Option<AbortNotice> {
        lock(&self.shared.inbox).abort_at(first).cloned()
    }

    /// Sends an abort record (`dead`, then the reason truncated to 4 KiB) to the root, which
    /// forwards it to every other rank (and to ranks that join later).
    ///
    /// Bounded: waits at most 0.25 s for another thread's write on the connection (a
    /// collective's blob) to finish and 0.5 s for its own write; past
    /// that it fails (the fabrics' own abort paths have already told the peers they reach).
    fn broadcast_abort_reporting(&self, dead: Option<usize>, reason: &str) -> Result<()> {
        let until = Instant::now() + ABORT_LOCK_WAIT;
        let mut w = loop {
            match self.writer.try_lock() {
                Ok(w) => break w,
                Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(Error::Bootstrap(format!(
                        "abort not sent to the root at {}: its connection stayed busy for {:?}",
                        self.root, ABORT_LOCK_WAIT
                    )))
                }
            }
        };
        w.set_write_timeout(Some(ABORT_WRITE_TIMEOUT))
            .and_then(|()| {
                let record = wire::encode_abort(dead, reason);
                wire::write_frame(&mut w, Kind::Abort, 0, &record)
            })
            .map_err(|e| Error::os(format!("sending an abort to the root at {}", self.root), e))
    }

    /// The first abort raised by another rank, if any has arrived (it stays there).
    fn poll_abort(&self) -> Option<AbortNotice> {
        lock(&self.shared.inbox).aborts.first().cloned()
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        {
            let mut w = lock(&self.writer);
            let _ = w
                .set_write_timeout(Some(Duration::from_secs(1)))
                .and_then(|()| wire::write_frame(&mut w, Kind::Bye, 0, &[]));
        }
        let until = Instant::now() + BYE_WAIT;
        let mut inbox = lock(&self.shared.inbox);
        while !inbox.bye_acked && inbox.closed.is_none() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            inbox = self
                .shared
                .cv
                .wait_timeout(inbox, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(inbox);
        // SYNC POINT: pairs with the Acquire load in the reader's `wire::read_frame`.
        self.shared.stop.store(true, Ordering::Release);
        let _ = lock(&self.writer).shutdown(Shutdown::Both);
        if let Some(reader) = self.reader.take() {
            // Bounded: the reader wakes every READ_TICK and sees the stop flag.
            let _ = reader.join();
        }
        // A hosted root keeps serving the other ranks, detached.
        drop(self.hosted_root.take());
    }
}

/// [`handshake`] for `rank` of `size` of job `id` on `stream`, as an [`Error`] (for tests
/// that play a rank with raw frames).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn raw_handshake(
    stream: &mut TcpStream,
    id: &UniqueId,
    rank: usize,
    size: usize,
    timeout: Duration,
) -> Result<()> {
    let deadline = deadline_after(timeout);
    handshake(
        stream,
        id.root_addr(),
        id.job_id(),
        &id.key(),
        rank,
        size,
        deadline,
    )
    .map_err(|e| match e {
        Handshake::Failed(e) => e,
        Handshake::Dropped(why) => Error::Bootstrap(why),
        Handshake::TimedOut => Error::Bootstrap("handshake timed out".into()),
    })
}

/// Why a handshake with the root did not admit this rank.
pub(crate) enum Handshake {
    /// The root closed the connection without an answer (it may be shedding load): retry.
    Dropped(String),
    /// The deadline passed.
    TimedOut,
    /// Refused for good (an ERROR frame, or a root that cannot prove it holds the key).
    Failed(Error),
}

/// Hello, challenge, proof, welcome (see [`root`](super::root)) on a fresh connection.
fn handshake(
    stream: &mut TcpStream,
    root: SocketAddr,
    job_id: u64,
    key: &JobKey,
    rank: usize,
    size: usize,
    deadline: Instant,
) -> std::result::Result<(), Handshake> {
    stream
        .set_read_timeout(Some(READ_TICK))
        .and_then(|()| stream.set_write_timeout(Some(CONTROL_WRITE_TIMEOUT)))
        .map_err(|e| Handshake::Failed(Error::os("configuring the bootstrap socket", e)))?;
    wire::tune(stream);
    handshake_over(stream, root, job_id, key, (rank, size), deadline)
}

/// The rank's side of the handshake over any byte stream (a socket set up by [`handshake`];
/// the fuzz target `handshake` plays the root with arbitrary bytes). Whatever the peer sends,
/// it fails with an error and never panics: every frame's length is checked exactly
/// ([`wire::exact_payload`]) before it is used.
pub(crate) fn handshake_over(
    stream: &mut (impl Read + Write),
    root: SocketAddr,
    job_id: u64,
    key: &JobKey,
    (rank, size): (usize, usize),
    deadline: Instant,
) -> std::result::Result<(), Handshake> {
    let io = |e: std::io::Error| Handshake::Dropped(e.to_string());
    let mut rank_nonce = [0u8; NONCE_LEN];
    key::random_bytes(&mut rank_nonce).map_err(Handshake::Failed)?;
    let hello = wire::encode_hello(job_id, rank, size, &rank_nonce);
    wire::write_frame_to(stream, Kind::Hello, 0, &hello).map_err(io)?;
    let challenge = handshake_reply(stream, Kind::Challenge, root, rank, deadline)?;
    let root_nonce: [u8; NONCE_LEN] = challenge
        .as_slice()
        .try_into()
        .map_err(|_| not_a_root(root, rank, "a challenge of the wrong length"))?;
    let fields = HelloFields {
        job_id,
        rank: rank as u64,
        size: size as u64,
        rank_nonce,
        root_nonce,
    };
    let proof = key.hello_mac(Side::Rank, &fields);
    wire::write_frame_to(stream, Kind::Auth, 0, &proof).map_err(io)?;
    let welcome = handshake_reply(stream, Kind::Welcome, root, rank, deadline)?;
    if !key.verify_hello(Side::Root, &fields, &welcome) {
        return Err(Handshake::Failed(Error::Bootstrap(format!(
            "the root at {root} welcomed rank {rank} without proving it holds this job's key \
             (another job's root on this port?)"
        ))));
    }
    Ok(())
}

/// The refusal of a peer at the root's address that does not speak the bootstrap protocol:
/// something else holds the root's port, and the job cannot start there. Names the port.
fn not_a_root(root: SocketAddr, rank: usize, what: impl std::fmt::Display) -> Handshake {
    Handshake::Failed(Error::Bootstrap(format!(
        "rank {rank}: the peer at {root} is not an xccl bootstrap root ({what}): another program \
         holds port {} (taken before this job's root could bind it?), so the job cannot start \
         there; give the job another root port ({})",
        root.port(),
        super::env::ROOT_ENV
    )))
}

/// The root's next handshake frame: `expect`, or an ERROR naming why this rank was refused.
fn handshake_reply(
    stream: &mut impl Read,
    expect: Kind,
    root: SocketAddr,
    rank: usize,
    deadline: Instant,
) -> std::result::Result<Vec<u8>, Handshake> {
    let no_stop = AtomicBool::new(false);
    match wire::read_frame(stream, Some(deadline), &no_stop, 0, &|k| {
        k == expect || k == Kind::Error
    }) {
        Ok(f) if f.kind == expect => Ok(f.payload),
        Ok(f) => Err(Handshake::Failed(Error::Bootstrap(format!(
            "the root at {root} rejected rank {rank}: {}",
            String::from_utf8_lossy(&f.payload)
        )))),
        Err(ReadError::Timeout) => Err(Handshake::TimedOut),
        Err(ReadError::Eof) => Err(Handshake::Dropped("the root closed the connection".into())),
        Err(ReadError::Io(e)) => Err(Handshake::Dropped(e.to_string())),
        Err(ReadError::Malformed(m)) => Err(not_a_root(root, rank, m)),
        Err(e) => Err(Handshake::Failed(Error::Bootstrap(format!(
            "hello of rank {rank} to the root at {root} failed: {e}"
        )))),
    }
}

/// Connects to `root`, retrying refused or failed attempts with backoff until `deadline`.
fn connect_retrying(
    root: SocketAddr,
    rank: usize,
    deadline: Instant,
    start: Instant,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    loop {
        let now = Instant::now();
        let remaining = deadline.saturating_duration_since(now);
        if remaining.is_zero() {
            return Err(Error::Timeout {
                peer: crate::error::BOOTSTRAP_ROOT,
                what: format!("rank {rank} connecting to the bootstrap root at {root}"),
                waited: start.elapsed(),
            });
        }
        match TcpStream::connect_timeout(&root, remaining.min(Duration::from_secs(2))) {
            Ok(s) => return Ok(s),
            Err(_) => {
                let left = deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

/// The reader thread: moves frames from the root into the inbox until the connection ends or
/// the owner stops it.
fn reader_loop(mut stream: TcpStream, shared: Arc<Shared>, result_max: u64) {
    let allowed = |k: Kind| {
        matches!(
            k,
            Kind::Result | Kind::Status | Kind::Abort | Kind::Failed | Kind::Error | Kind::ByeAck
        )
    };
    loop {
        let frame = wire::read_frame(&mut stream, None, &shared.stop, result_max, &allowed);
        let mut inbox = lock(&shared.inbox);
        let done = match frame {
            Ok(f) => {
                match f.kind {
                    Kind::Result => {
                        let aborts = inbox.abort_count;
                        inbox.result = Some((f.round, f.payload, aborts));
                    }
                    Kind::Status => {
                        if let Some(m) = wire::decode_missing(&f.payload) {
                            inbox.status = Some((f.round, m));
                        }
                    }
                    Kind::Abort => {
                        if let Some(a) = wire::decode_relayed_abort(&f.payload) {
                            inbox.abort_count += 1;
                            if inbox.aborts.len() < MAX_KEPT_ABORTS {
                                inbox.aborts.push(a);
                            }
                        }
                    }
                    Kind::Failed => {
                        if let Some((peer, detail)) = wire::decode_rank_text(&f.payload) {
                            inbox.failed = Some((f.round, peer, detail));
                        }
                    }
                    Kind::Error => {
                        let text = String::from_utf8_lossy(&f.payload).into_owned();
                        inbox.closed = Some(format!("the root dropped this rank: {text}"));
                    }
                    Kind::ByeAck => inbox.bye_acked = true,
                    _ => {}
                }
                false
            }
            Err(ReadError::Stopped) => true,
            Err(ReadError::Eof) => {
                inbox
                    .closed
                    .get_or_insert_with(|| "the root closed the connection".into());
                true
            }
            Err(e) => {
                inbox.closed.get_or_insert_with(|| e.to_string());
                true
            }
        };
        drop(inbox);
        shared.cv.notify_all();
        if done {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::{random_job_id, RootConfig};
    use std::io::Write;

    const LONG: Duration = Duration::from_secs(10);

    fn localhost() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    /// A root with short timeouts, for tests.
    fn start_job() -> (UniqueId, RootHandle) {
        let mut cfg = RootConfig::new(random_job_id());
        cfg.idle_timeout = Duration::from_secs(5);
        cfg.hello_timeout = Duration::from_secs(1);
        UniqueId::start_root(localhost(), cfg).unwrap()
    }

    /// Runs `f` on ranks `ranks` of a `size`-rank job, each a thread with its own bootstrap.
    fn run_ranks<T: Send>(
        id: &UniqueId,
        size: usize,
        ranks: std::ops::Range<usize>,
        f: impl Fn(TcpBootstrap) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .map(|r| {
                    let f = &f;
                    s.spawn(move || f(TcpBootstrap::connect(id, r, size, LONG).unwrap()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn free_port() -> SocketAddr {
        let l = std::net::TcpListener::bind(localhost()).unwrap();
        l.local_addr().unwrap()
    }

    #[test]
    fn four_ranks_rendezvous_allgather_and_barrier_over_tcp() {
        let (id, root) = start_job();
        let results = run_ranks(&id, 4, 0..4, |b| {
            assert_eq!(b.size(), 4);
            assert_eq!(b.job_id(), id.job_id());
            let me = format!("rank {}", b.rank());
            let all = b.allgather(me.as_bytes(), LONG).unwrap();
            b.barrier(LONG).unwrap();
            all
        });
        let expected: Vec<Vec<u8>> = (0..4).map(|r| format!("rank {r}").into_bytes()).collect();
        for all in results {
            assert_eq!(all, expected);
        }
        let report = root.join();
        assert_eq!(report.joined, 4);
        assert_eq!(report.rounds, 2);
        assert!(
            report.exit.contains("every rank has left"),
            "{}",
            report.exit
        );
        assert!(report.rejected.is_empty(), "{:?}", report.rejected);
    }

    #[test]
    fn timeouts_of_duration_max_saturate_in_the_root_the_connect_and_the_rounds() {
        let mut cfg = RootConfig::new(random_job_id());
        cfg.idle_timeout = Duration::from_secs(5);
        cfg.hello_timeout = Duration::MAX;
        let (id, _root) = UniqueId::start_root(localhost(), cfg).unwrap();
        let b = TcpBootstrap::connect(&id, 0, 1, Duration::MAX).unwrap();
        assert_eq!(
            b.allgather(b"solo", Duration::MAX).unwrap(),
            vec![b"solo".to_vec()]
        );
        b.barrier(Duration::MAX).unwrap();
    }

    /// Found by review: a stranger holding the root's port first answered with a challenge of
    /// 0, 5 or 31 bytes, and the rank panicked (`copy_from_slice`) before any proof of the key.
    #[test]
    fn a_squatter_on_the_root_port_with_a_short_challenge_fails_the_rank_naming_the_port() {
        let listener = std::net::TcpListener::bind(localhost()).unwrap();
        let addr = listener.local_addr().unwrap();
        let lengths = [0usize, 5, 31];
        let squatter = std::thread::spawn(move || {
            for n in lengths {
                let (mut s, _) = listener.accept().unwrap();
                wire::write_frame(&mut s, Kind::Challenge, 0, &vec![9; n]).unwrap();
                // Until the rank hangs up.
                while s.read(&mut [0; 256]).is_ok_and(|got| got > 0) {}
            }
        });
        for _ in lengths {
            let id = UniqueId::from_parts(random_job_id(), &JobKey::random(), addr);
            let err = TcpBootstrap::connect(&id, 1, 2, Duration::from_secs(5))
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains(&format!("port {}", addr.port()))
                    && err.contains("not an xccl bootstrap root")
                    && err.contains("Challenge frame"),
                "{err}"
            );
        }
        squatter.join().unwrap();
    }

    #[test]
    fn single_rank_job_gathers_its_own_blob() {
        let (id, _root) = start_job();
        let b = TcpBootstrap::connect(&id, 0, 1, LONG).unwrap();
        assert_eq!(b.allgather(b"solo", LONG).unwrap(), vec![b"solo".to_vec()]);
        b.barrier(LONG).unwrap();
    }

    #[test]
    fn many_rounds_in_a_row_over_tcp() {
        let (id, root) = start_job();
        let rounds = 200usize;
        run_ranks(&id, 3, 0..3, |b| {
            for i in 0..rounds {
                if i % 7 == 3 {
                    b.barrier(LONG).unwrap();
                    continue;
                }
                let blob = vec![(b.rank() + i) as u8; (b.rank() * 31 + i * 13) % 700];
                let all = b.allgather(&blob, LONG).unwrap();
                for (r, got) in all.iter().enumerate() {
                    assert_eq!(
                        *got,
                        vec![(r + i) as u8; (r * 31 + i * 13) % 700],
                        "round {i}"
                    );
                }
            }
        });
        assert_eq!(root.join().rounds, rounds as u64);
    }

    #[test]
    fn large_blobs_are_gathered() {
        let (id, _root) = start_job();
        run_ranks(&id, 2, 0..2, |b| {
            let blob = vec![b.rank() as u8 + 1; 3 << 20];
            let all = b.allgather(&blob, LONG).unwrap();
            assert_eq!(all[0], vec![1u8; 3 << 20]);
            assert_eq!(all[1], vec![2u8; 3 << 20]);
        });
    }

    #[test]
    fn oversized_blob_is_an_invalid_argument() {
        let (id, _root) = start_job();
        let b = TcpBootstrap::connect(&id, 0, 1, LONG).unwrap();
        let err = b.allgather(&vec![0u8; MAX_BLOB + 1], LONG).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // Nothing was sent: the bootstrap is still usable.
        b.barrier(LONG).unwrap();
    }

    #[test]
    fn rank_out_of_range_is_an_invalid_argument() {
        let id = UniqueId::from_parts(1, &JobKey::random(), "127.0.0.1:9".parse().unwrap());
        let err = TcpBootstrap::connect(&id, 2, 2, LONG).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }

    /// Reads the ERROR frame a rejected raw connection gets.
    fn read_rejection(s: &mut TcpStream) -> String {
        s.set_read_timeout(Some(READ_TICK)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(3);
        let f = wire::read_frame(s, Some(deadline), &AtomicBool::new(false), 0, &|k| {
            k == Kind::Error
        })
        .unwrap();
        String::from_utf8(f.payload).unwrap()
    }

    #[test]
    fn strangers_sending_garbage_are_rejected_while_the_job_completes() {
        let (id, root) = start_job();
        let addr = id.root_addr();
        let stranger = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            read_rejection(&mut s)
        });
        let wrong_version = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut frame = Vec::from(wire::MAGIC);
            frame.extend_from_slice(&7u16.to_le_bytes());
            frame.extend_from_slice(&[0u8; 18]);
            s.write_all(&frame).unwrap();
            read_rejection(&mut s)
        });
        let results = run_ranks(&id, 3, 0..3, |b| {
            std::thread::sleep(Duration::from_millis(50));
            b.allgather(&[b.rank() as u8], LONG).unwrap()
        });
        assert!(results
            .iter()
            .all(|r| *r == vec![vec![0], vec![1], vec![2]]));
        let msg = stranger.join().unwrap();
        assert!(msg.contains("magic"), "{msg}");
        let msg = wrong_version.join().unwrap();
        assert!(msg.contains("version"), "{msg}");
        let report = root.join();
        assert_eq!(report.joined, 3);
        assert_eq!(report.rejected.len(), 2, "{:?}", report.rejected);
    }

    #[test]
    fn a_silent_connection_is_dropped_after_the_hello_timeout() {
        let mut cfg = RootConfig::new(random_job_id());
        cfg.idle_timeout = Duration::from_secs(5);
        cfg.hello_timeout = Duration::from_millis(300);
        let (id, root) = UniqueId::start_root(localhost(), cfg).unwrap();
        let mut s = TcpStream::connect(id.root_addr()).unwrap();
        let msg = read_rejection(&mut s);
        assert!(msg.contains("no hello"), "{msg}");
        // The root still serves the job.
        run_ranks(&id, 2, 0..2, |b| b.barrier(LONG).unwrap());
        let report = root.join();
        assert_eq!(report.rejected.len(), 1, "{report:?}");
    }

    #[test]
    fn a_flood_of_idle_connections_does_not_lock_the_ranks_out() {
        use crate::bootstrap::root::MAX_PENDING_HELLOS;
        let mut cfg = RootConfig::new(random_job_id());
        cfg.idle_timeout = Duration::from_secs(5);
        let (id, root) = UniqueId::start_root(localhost(), cfg).unwrap();
        let extra = 10;
        let idle: Vec<TcpStream> = (0..MAX_PENDING_HELLOS + extra)
            .map(|_| TcpStream::connect(id.root_addr()).unwrap())
            .collect();
        let idle_addrs: Vec<String> = idle
            .iter()
            .map(|s| s.local_addr().unwrap().to_string())
            .collect();
        // Each newcomer closes the oldest idle connection; the ranks say hello at once.
        let all = run_ranks(&id, 2, 0..2, |b| {
            b.allgather(&[b.rank() as u8], LONG).unwrap()
        });
        assert!(all.iter().all(|a| *a == vec![vec![0], vec![1]]));
        drop(idle);
        let report = root.join();
        let evicted: Vec<&str> = report
            .rejected
            .iter()
            .filter(|r| r.contains("newer connections were waiting"))
            .map(|r| r.split(": ").next().unwrap())
            .collect();
        // The idle connections past the limit close the oldest ones, in order. The first rank
        // closes one more; the second closes another only if the first has not said hello yet
        // (once it has, the list is below the limit), so the count is `extra + 1` or `extra + 2`.
        assert!(
            (extra + 1..=extra + 2).contains(&evicted.len()),
            "{:?}",
            report.rejected
        );
        assert_eq!(
            evicted,
            idle_addrs[..evicted.len()],
            "{:?}",
            report.rejected
        );
    }

    #[test]
    fn wrong_job_id_is_rejected_without_naming_the_real_one() {
        let (id, _root) = start_job();
        let other = UniqueId::from_parts(id.job_id() ^ 1, &id.key(), id.root_addr());
        let err = TcpBootstrap::connect(&other, 0, 2, LONG).unwrap_err();
        assert!(
            matches!(&err, Error::Bootstrap(m) if m.contains("job id mismatch")),
            "{err}"
        );
        let real = format!("{:016x}", id.job_id());
        assert!(!err.to_string().contains(&real), "{err}");
        // The job itself is unaffected, rank 0 included.
        run_ranks(&id, 2, 0..2, |b| b.barrier(LONG).unwrap());
    }

    #[test]
    fn duplicate_rank_is_rejected_with_an_error_on_the_duplicate() {
        let (id, _root) = start_job();
        let first = TcpBootstrap::connect(&id, 0, 2, LONG).unwrap();
        let err = TcpBootstrap::connect(&id, 0, 2, LONG).unwrap_err();
        assert!(
            matches!(&err, Error::Bootstrap(m) if m.contains("duplicate rank")),
            "{err}"
        );
        let all = std::thread::scope(|s| {
            let other = s.spawn(|| {
                let b = TcpBootstrap::connect(&id, 1, 2, LONG).unwrap();
                b.allgather(b"one", LONG).unwrap()
            });
            let mine = first.allgather(b"zero", LONG).unwrap();
            assert_eq!(mine, other.join().unwrap());
            mine
        });
        assert_eq!(all, vec![b"zero".to_vec(), b"one".to_vec()]);
    }

    #[test]
    fn world_size_disagreement_is_rejected() {
        let (id, _root) = start_job();
        let _first = TcpBootstrap::connect(&id, 0, 2, LONG).unwrap();
        let err = TcpBootstrap::connect(&id, 1, 3, LONG).unwrap_err();
        assert!(
            matches!(&err, Error::Bootstrap(m) if m.contains("world size mismatch")),
            "{err}"
        );
    }

    #[test]
    fn missing_ranks_make_the_others_time_out_naming_them() {
        let (id, _root) = start_job();
        let timeout = Duration::from_millis(800);
        // Rank 2 connects but never calls; rank 3 never connects.
        let idle = TcpBootstrap::connect(&id, 2, 4, LONG).unwrap();
        let errors = run_ranks(&id, 4, 0..2, |b| {
            let start = Instant::now();
            let err = b.allgather(b"x", timeout).unwrap_err();
            let took = start.elapsed();
            assert!(took >= timeout, "{took:?}");
            assert!(took < timeout + Duration::from_millis(900), "{took:?}");
            // The bootstrap refuses further rounds.
            let again = b.barrier(timeout).unwrap_err();
            assert!(
                matches!(&again, Error::Bootstrap(m) if m.contains("unusable")),
                "{again}"
            );
            err
        });
        for err in errors {
            match &err {
                Error::Timeout { peer, what, waited } => {
                    assert_eq!(*peer, 2);
                    assert!(
                        what.contains("bootstrap allgather round 0: ranks [2, 3] have not arrived"),
                        "{what}"
                    );
                    assert!(what.contains("never connected: [3]"), "{what}");
                    assert!(*waited >= timeout);
                }
                other => panic!("expected a timeout, got {other}"),
            }
        }
        drop(idle);
    }

    #[test]
    fn abort_broadcast_is_seen_by_idle_and_waiting_ranks() {
        let (id, _root) = start_job();
        let ranks = connect_all(&id, 4);
        std::thread::scope(|s| {
            let waiting: Vec<_> = ranks[1..3]
                .iter()
                .map(|b| s.spawn(move || b.allgather(b"w", LONG).unwrap_err()))
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            let start = Instant::now();
            ranks[0]
                .broadcast_abort("expert 7 lost its device")
                .unwrap();
            for h in waiting {
                let err = h.join().unwrap();
                assert!(
                    matches!(&err, Error::Aborted { by: 0, reason } if reason == "expert 7 lost its device"),
                    "{err}"
                );
            }
            assert!(start.elapsed() < Duration::from_secs(2));
        });
        // Rank 3 never called a collective, yet sees the abort.
        let deadline = Instant::now() + Duration::from_secs(2);
        while ranks[3].poll_abort().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            ranks[3].poll_abort(),
            Some(AbortNotice::raised_by(0, "expert 7 lost its device"))
        );
        assert_eq!(ranks[0].poll_abort(), None);
    }

    #[test]
    fn a_rank_joining_after_an_abort_is_told_about_it() {
        let (id, _root) = start_job();
        let first = TcpBootstrap::connect(&id, 0, 2, LONG).unwrap();
        first.broadcast_abort("early").unwrap();
        let late = TcpBootstrap::connect(&id, 1, 2, LONG).unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        while late.poll_abort().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(late.poll_abort(), Some(AbortNotice::raised_by(0, "early")));
    }

    /// Ranks `0..n` of the job `id`, connected at once.
    fn connect_all(id: &UniqueId, n: usize) -> Vec<TcpBootstrap> {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| s.spawn(move || TcpBootstrap::connect(id, r, n, LONG).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Waits until `b` has received an abort, and returns it.
    fn first_abort(b: &TcpBootstrap) -> AbortNotice {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(a) = b.poll_abort() {
                return a;
            }
            assert!(
                Instant::now() < deadline,
                "no abort reached rank {}",
                b.rank()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn an_out_of_band_abort_whose_text_reads_like_a_death_is_an_abort_by_its_sender() {
        let (id, _root) = start_job();
        let ranks = connect_all(&id, 3);
        let text = "rank 0 died: process 42 exited (noticed by rank 1)";
        ranks[1].broadcast_abort(text).unwrap();
        for r in [0, 2] {
            assert_eq!(first_abort(&ranks[r]), AbortNotice::raised_by(1, text));
            let err = ranks[r].barrier(LONG).unwrap_err();
            assert!(
                matches!(&err, Error::Aborted { by: 1, reason } if reason == text),
                "rank {r}: {err}"
            );
        }
    }

    #[test]
    fn an_out_of_band_death_report_names_the_dead_rank_also_when_replayed_to_a_late_rank() {
        let (id, _root) = start_job();
        let first = TcpBootstrap::connect(&id, 1, 3, LONG).unwrap();
        first
            .broadcast_abort_reporting(Some(0), "process 42 exited")
            .unwrap();
        // Out of range: a protocol error naming the sender, not a panic.
        first
            .broadcast_abort_reporting(Some(9), "nonsense")
            .unwrap();
        let late = TcpBootstrap::connect(&id, 2, 3, LONG).unwrap();
        let got = first_abort(&late);
        assert_eq!((got.by, got.dead), (1, Some(0)));
        let err = late.barrier(LONG).unwrap_err();
        assert!(
            matches!(&err, Error::PeerFailed { peer: 0, detail } if detail.contains("rank 1's abort")),
            "{err}"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while late.poll_abort_since(1).is_none() {
            assert!(Instant::now() < deadline, "the second abort never arrived");
            std::thread::sleep(Duration::from_millis(5));
        }
        let bad = late.poll_abort_since(1).unwrap().to_error(3);
        assert!(matches!(bad, Error::Protocol { peer: 1, .. }), "{bad}");
    }

    #[test]
    fn a_rank_leaving_fails_the_pending_round_naming_it() {
        let (id, _root) = start_job();
        let leaver = TcpBootstrap::connect(&id, 2, 3, LONG).unwrap();
        drop(leaver);
        let errors = run_ranks(&id, 3, 0..2, |b| {
            let start = Instant::now();
            let err = b.allgather(b"x", LONG).unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(2));
            err
        });
        for err in errors {
            assert!(
                matches!(&err, Error::PeerFailed { peer: 2, detail } if detail.contains("left the job")),
                "{err}"
            );
        }
    }

    #[test]
    fn a_joined_rank_sending_garbage_is_dropped_and_the_others_are_told() {
        let (id, root) = start_job();
        let addr = id.root_addr();
        let mut raw = TcpStream::connect(addr).unwrap();
        let until = Instant::now() + Duration::from_secs(3);
        let joined = handshake(&mut raw, addr, id.job_id(), &id.key(), 2, 3, until);
        assert!(joined.is_ok());
        let deadline = Some(until);
        let stop = AtomicBool::new(false);
        raw.write_all(&[0xAB; 64]).unwrap();
        let errors = run_ranks(&id, 3, 0..2, |b| b.allgather(b"x", LONG).unwrap_err());
        for err in errors {
            assert!(
                matches!(&err, Error::PeerFailed { peer: 2, detail } if detail.contains("protocol error")),
                "{err}"
            );
        }
        let told = wire::read_frame(&mut raw, deadline, &stop, 0, &|_| true).unwrap();
        assert_eq!(told.kind, Kind::Error);
        drop(raw);
        let report = root.join();
        assert!(
            report.rejected.iter().any(|r| r.contains("rank 2 dropped")),
            "{report:?}"
        );
    }

    #[test]
    fn connect_retries_until_the_root_appears() {
        let addr = free_port();
        let job = random_job_id();
        let key = JobKey::random();
        let id = UniqueId::from_parts(job, &key, addr);
        let starter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let mut cfg = RootConfig::with_key(job, key);
            cfg.idle_timeout = Duration::from_secs(5);
            RootHandle::bind(addr, cfg).unwrap()
        });
        let b = TcpBootstrap::connect(&id, 0, 1, LONG).unwrap();
        assert_eq!(b.allgather(b"hi", LONG).unwrap(), vec![b"hi".to_vec()]);
        drop(b);
        let report = starter.join().unwrap().join();
        assert_eq!(report.joined, 1);
    }

    #[test]
    fn connect_times_out_without_a_root() {
        let id = UniqueId::from_parts(1, &JobKey::random(), free_port());
        let start = Instant::now();
        let err = TcpBootstrap::connect(&id, 0, 2, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn losing_the_root_fails_rounds_and_drop_is_prompt() {
        let (id, root) = start_job();
        let b = TcpBootstrap::connect(&id, 0, 2, LONG).unwrap();
        let report = root.shutdown();
        assert!(report.exit.contains("stopped"), "{}", report.exit);
        let start = Instant::now();
        let err = b.allgather(b"x", LONG).unwrap_err();
        assert!(
            matches!(&err, Error::Bootstrap(m) if m.contains("lost")),
            "{err}"
        );
        drop(b);
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn root_exits_after_its_idle_timeout_when_nobody_comes() {
        let mut cfg = RootConfig::new(random_job_id());
        cfg.idle_timeout = Duration::from_millis(300);
        let root = RootHandle::bind(localhost(), cfg).unwrap();
        let addr = root.addr();
        let start = Instant::now();
        let report = root.join();
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(report.exit.contains("idle"), "{}", report.exit);
        // The port is closed.
        assert!(TcpStream::connect(addr).is_err());
    }

    #[test]
    fn a_stranger_with_the_job_id_but_not_the_key_is_refused_and_learns_nothing() {
        let (id, root) = start_job();
        let forged = UniqueId::from_parts(id.job_id(), &JobKey::random(), id.root_addr());
        let err = TcpBootstrap::connect(&forged, 0, 2, LONG).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("authentication failed"), "{text}");
        // Not the real rank's slot: rank 0 still joins, and nothing secret was echoed.
        assert!(!text.contains(&id.key().to_hex()[..16]), "{text}");
        assert!(!text.contains("duplicate"), "{text}");
        run_ranks(&id, 2, 0..2, |b| b.barrier(LONG).unwrap());
        let report = root.join();
        assert_eq!(report.joined, 2);
        assert!(
            report
                .rejected
                .iter()
                .any(|r| r.contains("authentication failed")),
            "{report:?}"
        );
    }

    #[test]
    fn two_jobs_with_one_job_id_on_one_root_never_mix() {
        // Job B's rank 1 knows A's root address and job id (same XCCL_ROOT), not A's key.
        let (a, _root) = start_job();
        let b = UniqueId::from_parts(a.job_id(), &JobKey::random(), a.root_addr());
        let intruder = TcpBootstrap::connect(&b, 1, 2, LONG).unwrap_err();
        assert!(
            intruder.to_string().contains("authentication failed"),
            "{intruder}"
        );
        let all = run_ranks(&a, 2, 0..2, |x| {
            x.allgather(&[x.rank() as u8], LONG).unwrap()
        });
        assert!(all.iter().all(|g| *g == vec![vec![0], vec![1]]));
    }

    #[test]
    fn the_rank_refuses_a_root_that_cannot_prove_it_holds_the_key() {
        // A fake root that challenges and welcomes anyone with a made-up proof.
        let l = std::net::TcpListener::bind(localhost()).unwrap();
        let addr = l.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(READ_TICK)).unwrap();
            let stop = AtomicBool::new(false);
            let d = Some(Instant::now() + LONG);
            wire::read_frame(&mut s, d, &stop, 0, &|_| true).unwrap();
            wire::write_frame(&mut s, Kind::Challenge, 0, &[7u8; NONCE_LEN]).unwrap();
            wire::read_frame(&mut s, d, &stop, 0, &|_| true).unwrap();
            wire::write_frame(&mut s, Kind::Welcome, 0, &[0u8; key::MAC_LEN]).unwrap();
            s
        });
        let id = UniqueId::from_parts(5, &JobKey::random(), addr);
        let err = TcpBootstrap::connect(&id, 0, 1, LONG).unwrap_err();
        assert!(
            err.to_string().contains("without proving it holds"),
            "{err}"
        );
        drop(fake.join().unwrap());
    }

    #[test]
    fn a_flood_of_aborts_is_counted_but_only_the_first_ones_are_kept() {
        let (id, _root) = start_job();
        let (noisy, quiet) = std::thread::scope(|s| {
            let a = s.spawn(|| TcpBootstrap::connect(&id, 0, 2, LONG).unwrap());
            let b = s.spawn(|| TcpBootstrap::connect(&id, 1, 2, LONG).unwrap());
            (a.join().unwrap(), b.join().unwrap())
        });
        let n = MAX_KEPT_ABORTS + 50;
        for i in 0..n {
            noisy.broadcast_abort(&format!("abort {i}")).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&quiet.shared.inbox).abort_count < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let inbox = lock(&quiet.shared.inbox);
        assert_eq!(inbox.abort_count, n);
        assert_eq!(inbox.aborts.len(), MAX_KEPT_ABORTS);
        assert!(inbox.abort_at(n - 1).is_some() && inbox.abort_at(n).is_none());
    }

    #[test]
    fn a_flood_of_rejections_is_counted_but_only_the_first_ones_are_kept() {
        use crate::bootstrap::root::MAX_KEPT_REJECTIONS;
        let (id, root) = start_job();
        let n = MAX_KEPT_REJECTIONS + 20;
        for _ in 0..n {
            let mut s = TcpStream::connect(id.root_addr()).unwrap();
            s.write_all(b"garbage!").unwrap();
            let _ = read_rejection(&mut s);
        }
        run_ranks(&id, 1, 0..1, |b| b.barrier(LONG).unwrap());
        let report = root.join();
        assert_eq!(report.rejected.len(), MAX_KEPT_REJECTIONS);
        assert_eq!(report.rejected_not_kept, 20);
    }

    #[test]
    fn an_abort_is_bounded_while_another_thread_holds_the_connection() {
        let (id, _root) = start_job();
        let b = TcpBootstrap::connect(&id, 0, 2, LONG).unwrap();
        std::thread::scope(|s| {
            // Another thread's write holds the connection for 1.5 s.
            let (tx, rx) = std::sync::mpsc::channel();
            let b = &b;
            s.spawn(move || {
                let held = lock(&b.writer);
                tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(1500));
                drop(held);
            });
            rx.recv().unwrap();
            let start = Instant::now();
            let err = b.broadcast_abort("stop").unwrap_err();
            assert!(
                start.elapsed() < Duration::from_secs(1),
                "{:?}",
                start.elapsed()
            );
            assert!(err.to_string().contains("busy"), "{err}");
        });
        b.broadcast_abort("stop").unwrap();
    }
}
