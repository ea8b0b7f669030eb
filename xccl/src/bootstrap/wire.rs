//! The TCP wire format between ranks and the root service.
//!
//! Every message is a frame: a 24-byte header followed by `len` payload bytes. All integers are
//! little endian.
//!
//! | bytes  | field                                            |
//! |--------|--------------------------------------------------|
//! | 0..4   | magic `b"XCBT"`                                  |
//! | 4..6   | protocol version ([`PROTOCOL_VERSION`])          |
//! | 6..8   | kind ([`Kind`])                                  |
//! | 8..16  | round number (collective rounds), otherwise 0    |
//! | 16..24 | payload length                                   |
//!
//! The reader checks the magic as soon as its 4 bytes arrive, so a stranger speaking another
//! protocol is rejected without waiting for a full header. Payload lengths are bounded per kind
//! ([`max_payload`]), so a malformed length can never make a peer allocate gigabytes; within the
//! bound, the payload buffer grows only as bytes arrive ([`PAYLOAD_STEP`]), so a length field alone
//! never makes the reader allocate more than twice what the peer actually sent (plus one step).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::key::{MAC_LEN, NONCE_LEN};

/// Frame magic: "XCBT" (xccl bootstrap transport).
pub(crate) const MAGIC: [u8; 4] = *b"XCBT";
/// Version of the frame protocol; a peer speaking another version is rejected.
pub(crate) const PROTOCOL_VERSION: u16 = 3;
/// Size of a frame header in bytes.
pub(crate) const HEADER_LEN: usize = 24;
/// Largest blob one rank may contribute to one allgather round (16 MiB).
pub const MAX_BLOB: usize = 16 << 20;
/// Largest payload of a control frame (error text, abort reason, status list).
pub(crate) const MAX_CONTROL: usize = 1 << 20;
/// Longest abort reason or error text sent on the wire; longer text is truncated.
pub(crate) const MAX_TEXT: usize = 4096;
/// Payload length of a HELLO frame: job id, rank, size (each a u64), the rank's nonce.
pub(crate) const HELLO_LEN: usize = 24 + NONCE_LEN;
/// Largest world size a root accepts in a hello: its per-rank state is allocated from the size.
pub(crate) const MAX_WORLD: usize = 1 << 16;
/// Bytes a payload buffer starts with; it grows (doubling) only as the bytes arrive.
pub(crate) const PAYLOAD_STEP: usize = 64 << 10;
/// How often blocking reads wake up to look at their stop flag.
pub(crate) const READ_TICK: Duration = Duration::from_millis(100);

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum Kind {
    /// rank -> root: `{job_id, rank, size, rank_nonce[32]}`.
    Hello = 1,
    /// root -> rank: the rank is admitted; `{root_mac[32]}` proves the root holds the job key.
    Welcome = 2,
    /// root -> peer: UTF-8 text; the root closes the connection after it.
    Error = 3,
    /// rank -> root: this rank's blob for round `round`.
    Data = 4,
    /// root -> rank: every rank's blob of round `round`, see [`encode_blobs`].
    Result = 5,
    /// rank -> root: which ranks have not contributed to round `round`?
    Query = 6,
    /// root -> rank: answer to a query, see [`encode_missing`].
    Status = 7,
    /// rank -> root: `{dead: u64}` then the UTF-8 reason ([`encode_abort`]). root -> rank:
    /// `{from: u64, dead: u64}` then the UTF-8 reason ([`encode_relayed_abort`]). `dead` is the
    /// rank whose death the abort reports, [`NO_DEAD`] for none.
    Abort = 8,
    /// root -> rank: round `round` cannot complete: `{rank: u64}` then UTF-8 detail.
    Failed = 9,
    /// rank -> root: this rank leaves the job cleanly.
    Bye = 10,
    /// root -> rank: the bye was processed; everything sent before it was delivered.
    ByeAck = 11,
    /// rank -> root: this rank's blob for round `round` of a survivors' round, which completes
    /// once every rank has either contributed or left the job (result: RESULT, with an empty
    /// blob for each rank that left).
    Survivors = 12,
    /// root -> rank, after a hello for this job: `{root_nonce[32]}`.
    Challenge = 13,
    /// rank -> root: `{rank_mac[32]}`, the HMAC of the hello fields and both nonces.
    Auth = 14,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Error,
            4 => Kind::Data,
            5 => Kind::Result,
            6 => Kind::Query,
            7 => Kind::Status,
            8 => Kind::Abort,
            9 => Kind::Failed,
            10 => Kind::Bye,
            11 => Kind::ByeAck,
            12 => Kind::Survivors,
            13 => Kind::Challenge,
            14 => Kind::Auth,
            _ => return None,
        })
    }
}

/// Largest payload accepted for a frame of `kind`; `result_max` bounds RESULT frames, whose size
/// depends on the world size.
pub(crate) fn max_payload(kind: Kind, result_max: u64) -> u64 {
    match kind {
        Kind::Hello => HELLO_LEN as u64,
        Kind::Challenge => NONCE_LEN as u64,
        Kind::Auth | Kind::Welcome => MAC_LEN as u64,
        Kind::Query | Kind::Bye | Kind::ByeAck => 0,
        Kind::Data => MAX_BLOB as u64,
        // One byte more: the rank's presence mark (see `TcpBootstrap::gather_survivors`).
        Kind::Survivors => MAX_BLOB as u64 + 1,
        Kind::Result => result_max,
        Kind::Error | Kind::Status | Kind::Abort | Kind::Failed => MAX_CONTROL as u64,
    }
}

/// The one payload length a frame of `kind` may have, for the kinds of fixed size (hello,
/// challenge, proof, welcome, and the empty ones); `None` for the kinds of variable size.
/// [`read_frame`] refuses any other length, so no reader ever sees a short fixed-size payload.
pub(crate) fn exact_payload(kind: Kind) -> Option<u64> {
    match kind {
        Kind::Hello | Kind::Challenge | Kind::Auth | Kind::Welcome => Some(max_payload(kind, 0)),
        Kind::Query | Kind::Bye | Kind::ByeAck => Some(0),
        Kind::Data
        | Kind::Survivors
        | Kind::Result
        | Kind::Error
        | Kind::Status
        | Kind::Abort
        | Kind::Failed => None,
    }
}

/// Upper bound of a RESULT payload for a job of `size` ranks.
pub(crate) fn result_max(size: usize) -> u64 {
    // A survivors' round carries one presence byte more per blob.
    (size as u64).saturating_mul(MAX_BLOB as u64 + 9)
}

/// One received frame.
#[derive(Debug)]
pub(crate) struct Frame {
    pub kind: Kind,
    pub round: u64,
    pub payload: Vec<u8>,
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The peer closed the connection at a frame boundary.
    Eof,
    /// The deadline passed.
    Timeout,
    /// The stop flag was raised.
    Stopped,
    /// The bytes do not follow the protocol (bad magic, version, kind or length, truncation).
    Malformed(String),
    /// The OS reported an error.
    Io(io::Error),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Eof => write!(f, "connection closed"),
            ReadError::Timeout => write!(f, "timed out"),
            ReadError::Stopped => write!(f, "stopped"),
            ReadError::Malformed(m) => write!(f, "protocol error: {m}"),
            ReadError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Outcome of filling a buffer.
enum Fill {
    Done,
    /// EOF after this many bytes.
    Eof(usize),
}

/// Fills `buf` from `stream`, whose read timeout must be set (to [`READ_TICK`]) if it is a
/// socket; between ticks it checks `stop` and `deadline`, so it never blocks for longer than one
/// tick past either. (Any reader works: the fuzz targets read frames from byte slices.)
fn fill(
    stream: &mut impl Read,
    buf: &mut [u8],
    deadline: Option<Instant>,
    stop: &AtomicBool,
) -> Result<Fill, ReadError> {
    let mut done = 0;
    while done < buf.len() {
        // SYNC POINT: pairs with the Release store of whoever raises the stop flag.
        if stop.load(Ordering::Acquire) {
            return Err(ReadError::Stopped);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(ReadError::Timeout);
        }
        match stream.read(&mut buf[done..]) {
            Ok(0) => return Ok(Fill::Eof(done)),
            Ok(n) => done += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(Fill::Done)
}

/// Reads one frame. `result_max` bounds RESULT payloads; `allowed` rejects kinds the reader does
/// not expect (e.g. a rank sending RESULT to the root).
pub(crate) fn read_frame(
    stream: &mut impl Read,
    deadline: Option<Instant>,
    stop: &AtomicBool,
    result_max: u64,
    allowed: &dyn Fn(Kind) -> bool,
) -> Result<Frame, ReadError> {
    let mut header = [0u8; HEADER_LEN];
    match fill(stream, &mut header[..4], deadline, stop)? {
        Fill::Done => {}
        Fill::Eof(0) => return Err(ReadError::Eof),
        Fill::Eof(_) => return Err(ReadError::Malformed("truncated frame header".into())),
    }
    if header[..4] != MAGIC {
        return Err(ReadError::Malformed(format!(
            "bad magic {:02x?}: not an xccl bootstrap peer",
            &header[..4]
        )));
    }
    if let Fill::Eof(_) = fill(stream, &mut header[4..], deadline, stop)? {
        return Err(ReadError::Malformed("truncated frame header".into()));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(ReadError::Malformed(format!(
            "protocol version mismatch: expected {PROTOCOL_VERSION}, got {version}"
        )));
    }
    let raw_kind = u16::from_le_bytes([header[6], header[7]]);
    let kind = Kind::from_u16(raw_kind)
        .filter(|k| allowed(*k))
        .ok_or_else(|| ReadError::Malformed(format!("unexpected frame kind {raw_kind}")))?;
    let round = u64_at(&header, 8);
    let len = u64_at(&header, 16);
    let max = max_payload(kind, result_max);
    if len > max {
        return Err(ReadError::Malformed(format!(
            "{kind:?} frame of {len} bytes exceeds the limit of {max}"
        )));
    }
    if let Some(exact) = exact_payload(kind).filter(|&n| n != len) {
        return Err(ReadError::Malformed(format!(
            "{kind:?} frame of {len} bytes: it is exactly {exact}"
        )));
    }
    let len = usize::try_from(len)
        .map_err(|_| ReadError::Malformed(format!("frame length {len} too large")))?;
    let payload = read_payload(stream, len, deadline, stop).map_err(|e| match e {
        PayloadError::Truncated(got) => ReadError::Malformed(format!(
            "truncated {kind:?} payload: {got} of {len} bytes before the connection closed"
        )),
        PayloadError::Read(e) => e,
    })?;
    Ok(Frame {
        kind,
        round,
        payload,
    })
}

/// Why a payload could not be read.
enum PayloadError {
    /// The peer closed the connection after this many payload bytes.
    Truncated(usize),
    /// Timeout, stop flag or an OS error.
    Read(ReadError),
}

/// Reads `len` payload bytes. The buffer starts at [`PAYLOAD_STEP`] bytes and at most doubles
/// per step as the bytes arrive, so its capacity stays below twice the bytes received plus one
/// step, whatever `len` the peer claimed.
fn read_payload(
    stream: &mut impl Read,
    len: usize,
    deadline: Option<Instant>,
    stop: &AtomicBool,
) -> Result<Vec<u8>, PayloadError> {
    let mut payload = Vec::with_capacity(len.min(PAYLOAD_STEP));
    while payload.len() < len {
        let have = payload.len();
        let step = (len - have).min(have.max(PAYLOAD_STEP));
        payload.resize(have + step, 0);
        match fill(stream, &mut payload[have..], deadline, stop) {
            Ok(Fill::Done) => {}
            Ok(Fill::Eof(got)) => return Err(PayloadError::Truncated(have + got)),
            Err(e) => return Err(PayloadError::Read(e)),
        }
    }
    Ok(payload)
}

/// Writes one frame. A write that fails or times out half-way leaves the stream unusable; the
/// caller must close it.
pub(crate) fn write_frame(
    stream: &mut TcpStream,
    kind: Kind,
    round: u64,
    payload: &[u8],
) -> io::Result<()> {
    write_frame_to(stream, kind, round, payload)
}

/// [`write_frame`] to any writer (the client handshake over a fuzzer's stream).
pub(crate) fn write_frame_to(
    stream: &mut impl Write,
    kind: Kind,
    round: u64,
    payload: &[u8],
) -> io::Result<()> {
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&MAGIC);
    header[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    header[6..8].copy_from_slice(&(kind as u16).to_le_bytes());
    header[8..16].copy_from_slice(&round.to_le_bytes());
    header[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    if payload.len() <= 64 << 10 {
        let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
        buf.extend_from_slice(&header);
        buf.extend_from_slice(payload);
        stream.write_all(&buf)
    } else {
        stream.write_all(&header)?;
        stream.write_all(payload)
    }
}

/// Reads a little-endian u64 at `at`; the caller guarantees `bytes.len() >= at + 8`.
pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Truncates `text` to at most [`MAX_TEXT`] bytes on a character boundary.
pub(crate) fn clip(text: &str) -> &str {
    if text.len() <= MAX_TEXT {
        return text;
    }
    let mut end = MAX_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Truncates raw text bytes to at most [`MAX_TEXT`] bytes (decoded lossily afterwards).
pub(crate) fn clip_bytes(text: &[u8]) -> &[u8] {
    &text[..text.len().min(MAX_TEXT)]
}

/// HELLO payload: `{job_id, rank, size, rank_nonce}`.
pub(crate) fn encode_hello(
    job_id: u64,
    rank: usize,
    size: usize,
    nonce: &[u8; NONCE_LEN],
) -> Vec<u8> {
    let mut v = Vec::with_capacity(HELLO_LEN);
    v.extend_from_slice(&job_id.to_le_bytes());
    v.extend_from_slice(&(rank as u64).to_le_bytes());
    v.extend_from_slice(&(size as u64).to_le_bytes());
    v.extend_from_slice(nonce);
    v
}

/// Parses a HELLO payload into `(job_id, rank, size, rank_nonce)`.
pub(crate) fn decode_hello(p: &[u8]) -> Option<(u64, u64, u64, [u8; NONCE_LEN])> {
    if p.len() != HELLO_LEN {
        return None;
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&p[24..]);
    Some((u64_at(p, 0), u64_at(p, 8), u64_at(p, 16), nonce))
}

/// A `{rank: u64}` prefix followed by UTF-8 text (ABORT root -> rank, FAILED).
pub(crate) fn encode_rank_text(rank: usize, text: &str) -> Vec<u8> {
    let text = clip(text);
    let mut v = Vec::with_capacity(8 + text.len());
    v.extend_from_slice(&(rank as u64).to_le_bytes());
    v.extend_from_slice(text.as_bytes());
    v
}

/// The `dead` word of an ABORT that reports no death.
pub(crate) const NO_DEAD: u64 = u64::MAX;

fn dead_word(dead: Option<usize>) -> u64 {
    // An out-of-range rank stays out of range (never [`NO_DEAD`]).
    dead.map_or(NO_DEAD, |d| (d as u64).min(NO_DEAD - 1))
}

fn dead_of(word: u64) -> Option<usize> {
    // A value past `usize` stays out of range: the receiver's check names the sender.
    (word != NO_DEAD).then(|| usize::try_from(word).unwrap_or(usize::MAX))
}

/// ABORT rank -> root: `{dead: u64}` then the reason (cut to [`MAX_TEXT`]).
pub(crate) fn encode_abort(dead: Option<usize>, reason: &str) -> Vec<u8> {
    let text = clip(reason);
    let mut v = Vec::with_capacity(8 + text.len());
    v.extend_from_slice(&dead_word(dead).to_le_bytes());
    v.extend_from_slice(text.as_bytes());
    v
}

/// Parses [`encode_abort`]; `None` if the payload is too short for the dead word.
pub(crate) fn decode_abort(p: &[u8]) -> Option<(Option<usize>, String)> {
    if p.len() < 8 {
        return None;
    }
    let text = String::from_utf8_lossy(clip_bytes(&p[8..])).into_owned();
    Some((dead_of(u64_at(p, 0)), text))
}

/// ABORT root -> rank: `{from: u64, dead: u64}` then the reason (cut to [`MAX_TEXT`]).
pub(crate) fn encode_relayed_abort(from: usize, dead: Option<usize>, reason: &str) -> Vec<u8> {
    let text = clip(reason);
    let mut v = Vec::with_capacity(16 + text.len());
    v.extend_from_slice(&(from as u64).to_le_bytes());
    v.extend_from_slice(&dead_word(dead).to_le_bytes());
    v.extend_from_slice(text.as_bytes());
    v
}

/// Parses [`encode_relayed_abort`] into the record as received (checked by the receiver
/// against its job, [`crate::AbortNotice::to_error`]).
pub(crate) fn decode_relayed_abort(p: &[u8]) -> Option<crate::AbortNotice> {
    if p.len() < 16 {
        return None;
    }
    Some(crate::AbortNotice {
        by: usize::try_from(u64_at(p, 0)).ok()?,
        dead: dead_of(u64_at(p, 8)),
        reason: String::from_utf8_lossy(clip_bytes(&p[16..])).into_owned(),
    })
}

/// Parses [`encode_rank_text`].
pub(crate) fn decode_rank_text(p: &[u8]) -> Option<(usize, String)> {
    if p.len() < 8 {
        return None;
    }
    let rank = usize::try_from(u64_at(p, 0)).ok()?;
    Some((rank, String::from_utf8_lossy(&p[8..]).into_owned()))
}

/// RESULT payload: for each rank in order, `{len: u64}` then the blob.
pub(crate) fn encode_blobs(blobs: &[Vec<u8>]) -> Vec<u8> {
    let total: usize = blobs.iter().map(|b| 8 + b.len()).sum();
    let mut v = Vec::with_capacity(total);
    for b in blobs {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
    }
    v
}

/// Parses [`encode_blobs`], expecting exactly `count` blobs.
pub(crate) fn decode_blobs(p: &[u8], count: usize) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(count);
    let mut at = 0usize;
    for _ in 0..count {
        if p.len() - at < 8 {
            return None;
        }
        let len = usize::try_from(u64_at(p, at)).ok()?;
        at += 8;
        if p.len() - at < len {
            return None;
        }
        out.push(p[at..at + len].to_vec());
        at += len;
    }
    (at == p.len()).then_some(out)
}

/// Why a rank is missing from a round, as reported by the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Absence {
    /// Connected, but has not contributed to the round yet.
    Late = 0,
    /// Never connected to the root.
    NeverConnected = 1,
    /// Was connected and has left (or was dropped by the root).
    Left = 2,
}

/// STATUS payload: for each missing rank `{rank: u64, absence: u64}`.
pub(crate) fn encode_missing(missing: &[(usize, Absence)]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 * missing.len());
    for (r, a) in missing {
        v.extend_from_slice(&(*r as u64).to_le_bytes());
        v.extend_from_slice(&(*a as u64).to_le_bytes());
    }
    v
}

/// Parses [`encode_missing`].
pub(crate) fn decode_missing(p: &[u8]) -> Option<Vec<(usize, Absence)>> {
    let chunks = p.chunks_exact(16);
    if !chunks.remainder().is_empty() {
        return None;
    }
    chunks
        .map(|c| {
            let rank = usize::try_from(u64_at(c, 0)).ok()?;
            let absence = match u64_at(c, 8) {
                0 => Absence::Late,
                1 => Absence::NeverConnected,
                2 => Absence::Left,
                _ => return None,
            };
            Some((rank, absence))
        })
        .collect()
}

/// Best-effort TCP tuning for a bootstrap connection: no Nagle delay (frames are small and
/// latency-bound) and keepalive probes so a vanished host is noticed eventually.
pub(crate) fn tune(stream: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let _ = stream.set_nodelay(true);
    let _ = setsockopt(stream, sockopt::KeepAlive, &true);
    let _ = setsockopt(stream, sockopt::TcpKeepIdle, &30);
    let _ = setsockopt(stream, sockopt::TcpKeepInterval, &5);
    let _ = setsockopt(stream, sockopt::TcpKeepCount, &6);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connected pair of localhost TCP streams; the second reads with [`READ_TICK`] ticks.
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        b.set_read_timeout(Some(READ_TICK)).unwrap();
        (a, b)
    }

    /// A frame header of `kind` claiming `len` payload bytes.
    fn header(kind: Kind, len: u64) -> Vec<u8> {
        let mut h = Vec::from(MAGIC);
        h.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h.extend_from_slice(&(kind as u16).to_le_bytes());
        h.extend_from_slice(&0u64.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h
    }

    fn read(b: &mut TcpStream) -> Result<Frame, ReadError> {
        let deadline = Some(Instant::now() + Duration::from_secs(5));
        read_frame(b, deadline, &AtomicBool::new(false), 0, &|_| true)
    }

    fn malformed(r: Result<Frame, ReadError>) -> String {
        match r {
            Err(ReadError::Malformed(m)) => m,
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }

    #[test]
    fn a_4_gib_length_claim_is_rejected_from_the_header_alone() {
        for kind in [Kind::Hello, Kind::Data, Kind::Abort] {
            let (mut a, mut b) = pair();
            // The header only: the rejection must not wait for (or allocate) a payload.
            a.write_all(&header(kind, 4 << 30)).unwrap();
            let m = malformed(read(&mut b));
            assert!(m.contains("4294967296 bytes exceeds the limit"), "{m}");
        }
    }

    #[test]
    fn a_payload_cut_short_is_reported_with_the_bytes_received() {
        let (mut a, mut b) = pair();
        a.write_all(&header(Kind::Data, MAX_BLOB as u64)).unwrap();
        a.write_all(&[7u8; 100_000]).unwrap();
        a.shutdown(std::net::Shutdown::Write).unwrap();
        let m = malformed(read(&mut b));
        assert!(
            m.contains("truncated Data payload: 100000 of 16777216 bytes"),
            "{m}"
        );
    }

    #[test]
    fn a_truncated_header_is_malformed_and_a_clean_close_is_eof() {
        let (mut a, mut b) = pair();
        a.write_all(&header(Kind::Data, 1)[..10]).unwrap();
        a.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(malformed(read(&mut b)).contains("truncated frame header"));
        let (a, mut b) = pair();
        drop(a);
        assert!(matches!(read(&mut b), Err(ReadError::Eof)));
    }

    #[test]
    fn a_large_payload_grows_its_buffer_only_as_it_arrives() {
        let (mut a, mut b) = pair();
        let len = 5 * PAYLOAD_STEP + 123;
        let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let writer = std::thread::spawn(move || {
            a.write_all(&header(Kind::Data, len as u64)).unwrap();
            for piece in body.chunks(10_000) {
                a.write_all(piece).unwrap();
            }
            body
        });
        let frame = read(&mut b).unwrap();
        let body = writer.join().unwrap();
        assert_eq!(frame.payload, body);
        assert!(frame.payload.capacity() <= 2 * len + PAYLOAD_STEP);
    }

    #[test]
    fn blobs_round_trip_and_reject_truncation() {
        let blobs = vec![vec![], vec![1, 2, 3], vec![9; 100]];
        let enc = encode_blobs(&blobs);
        assert_eq!(decode_blobs(&enc, 3).unwrap(), blobs);
        assert!(decode_blobs(&enc[..enc.len() - 1], 3).is_none());
        assert!(decode_blobs(&enc, 2).is_none());
        assert!(decode_blobs(&enc, 4).is_none());
    }

    #[test]
    fn missing_list_round_trips() {
        let m = vec![
            (3, Absence::Late),
            (5, Absence::NeverConnected),
            (7, Absence::Left),
        ];
        assert_eq!(decode_missing(&encode_missing(&m)).unwrap(), m);
        assert!(decode_missing(&[0u8; 15]).is_none());
    }

    #[test]
    fn abort_records_round_trip_with_and_without_a_dead_rank() {
        for dead in [None, Some(0), Some(5)] {
            let p = encode_abort(dead, "why");
            assert_eq!(decode_abort(&p), Some((dead, "why".to_string())));
            let r = decode_relayed_abort(&encode_relayed_abort(2, dead, "why")).unwrap();
            assert_eq!((r.by, r.dead, r.reason.as_str()), (2, dead, "why"));
        }
        let (far, _) = decode_abort(&encode_abort(Some(usize::MAX), "")).unwrap();
        assert!(far.is_some_and(|d| d > 1 << 32), "{far:?}");
        assert_eq!(decode_abort(&[1, 2, 3]), None);
        assert_eq!(decode_relayed_abort(&[0u8; 15]), None);
        // The reason is bounded like every text on the wire.
        let long = "x".repeat(3 * MAX_TEXT);
        assert_eq!(encode_abort(None, &long).len(), 8 + MAX_TEXT);
        let (_, text) = decode_abort(&[&[0u8; 8][..], long.as_bytes()].concat()).unwrap();
        assert_eq!(text.len(), MAX_TEXT);
    }

    #[test]
    fn clip_keeps_char_boundaries() {
        let s = "é".repeat(MAX_TEXT);
        let c = clip(&s);
        assert!(c.len() <= MAX_TEXT);
        assert!(s.starts_with(c));
    }
}
