//! Entry points of the fuzz targets in `fuzz/` (cargo feature `fuzzing`): not part of xccl's
//! API, hidden from its docs, and free to change with the fuzz targets.
//!
//! Each function takes the fuzzer's bytes, drives one decoder or validator with them and panics
//! only when a promise of that code is broken; an error is the expected outcome of most inputs.
//! The promises checked:
//! - [`bootstrap`]: the frame reader never yields a payload above its kind's bound, and each
//!   decoder that accepts a payload round-trips it through its encoder; [`UniqueId`] parsing
//!   round-trips through bytes and hex.
//! - [`record`]: a metadata record that passes the receiver's checks (its epoch, check word,
//!   count, and [`Record::check_region`]) addresses only rows inside the window regions the
//!   [`WindowLayout`] gives it, for the A2E push, pull and gather paths and the E2A pull path.
//! - [`row`]: a decoded A2E row names a token below `max_tokens` and at most `topk` distinct
//!   local experts below the rank's count, ascending, and re-encodes to the same decode.
//! - [`routing`]: a dispatch layout that is built holds only finite weights, in-range tokens and
//!   local experts, one entry per (token, destination); a rejected routing leaves the previous
//!   layout unchanged.
//! - [`config`]: the string parsers round-trip their names; [`MoeConfig::validate`] never
//!   panics, and a config it accepts has a window layout whose sizes do not overflow.
//! - [`c_config`]: the C `xcclConfig_t` parse never panics, whatever the fields say.
//! - [`handshake`]: the rank's side of the bootstrap handshake, against a root that answers with
//!   the fuzzer's bytes, fails with an error (never a panic) and never admits the rank.
//!
//! The input is read with [`Input`], a cursor that yields zeros once the bytes run out, so every
//! byte string is a valid input. The regression tests of the crashes the fuzzers found call
//! these functions with the crashing input (module `tests`).

use std::ffi::{c_int, c_uint, CString};
use std::sync::atomic::AtomicBool;

use crate::bootstrap::wire::{self, Kind};
use crate::bootstrap::UniqueId;
use crate::capi::config::{self as c, xcclConfig_t};
use crate::fabric::WaitPolicy;
use crate::moe::record::{Record, WireMode};
use crate::moe::routing::{mask_count, mask_iter, DispatchLayout};
use crate::moe::rows::A2eRow;
use crate::moe::window_layout::WindowLayout;
use crate::{DType, MoeConfig, Quant, Topology, TopologyBuilder, TransferMode};

/// A fuzz entry point: takes any bytes, panics only on a broken promise.
pub type Entry = fn(&[u8]);

/// Every entry point by the name of its fuzz target in `fuzz/fuzz_targets/`.
pub const ENTRIES: [(&str, Entry); 7] = [
    ("bootstrap", bootstrap),
    ("record", record),
    ("row", row),
    ("routing", routing),
    ("config", config),
    ("c_config", c_config),
    ("handshake", handshake),
];

/// A cursor over fuzz bytes; reads past the end yield zeros.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    /// The next `n` bytes (fewer when the input runs out).
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.data.split_at(n.min(self.data.len()));
        self.data = tail;
        head
    }

    /// The bytes not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        self.take(self.data.len())
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let got = self.take(N);
        b[..got.len()].copy_from_slice(got);
        b
    }

    /// The next byte.
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    /// The next little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    /// The next little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    /// The next little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.u16() as usize % n
    }
}

/// A small topology: 1-4 attention and 1-4 expert ranks, 1-200 experts (several mask words),
/// sometimes an extra replica, relays or DP domains. `None` when the builder rejects it.
fn topology(inp: &mut Input) -> Option<Topology> {
    let m = 1 + inp.below(4);
    let n = 1 + inp.below(4);
    let experts = 1 + inp.below(200);
    let flags = inp.u8();
    let mut b = TopologyBuilder::contiguous(m, n, experts);
    if flags & 1 != 0 {
        b = b.replicas(&[(inp.below(experts), m + inp.below(n))]);
    }
    let mut t = b.build().ok()?;
    if flags & 2 != 0 {
        t = t.with_relays(Some(1 + inp.below(n))).ok()?;
    }
    if flags & 4 != 0 {
        t = t.with_domains(1 + inp.below(m)).ok()?;
    }
    Some(t)
}

/// A small valid config for `topo` (hidden 1-300, every dtype, topk 1-9, 1-600 tokens).
fn small_config(inp: &mut Input, topo: &Topology) -> Option<MoeConfig> {
    let dtype = [DType::F32, DType::F16, DType::BF16][inp.below(3)];
    let mut cfg = MoeConfig::new(
        1 + inp.below(300),
        dtype,
        1 + inp.below(9),
        1 + inp.below(600),
    );
    cfg.max_in_flight = if topo.num_domains() > 1 {
        1
    } else {
        1 + inp.below(3)
    };
    cfg.recv_capacity = inp.below(cfg.max_tokens_per_rank + 1);
    cfg.validate(topo).ok()?;
    Some(cfg)
}

/// A topology and a small valid config for it.
fn setup(inp: &mut Input) -> Option<(Topology, MoeConfig)> {
    let topo = topology(inp)?;
    let cfg = small_config(inp, &topo)?;
    Some((topo, cfg))
}

/// Which frame kinds a reader accepts, by who reads: the root before a hello, the root after,
/// a rank, or anyone.
fn allowed(gate: u8) -> fn(Kind) -> bool {
    match gate % 4 {
        0 => |k| k == Kind::Hello,
        1 => |k| matches!(k, Kind::Data | Kind::Query | Kind::Abort | Kind::Bye),
        2 => |k| {
            matches!(
                k,
                Kind::Result | Kind::Status | Kind::Abort | Kind::Failed | Kind::Error
            )
        },
        _ => |_| true,
    }
}

/// Reads frames from the bytes as the root and ranks do, then feeds the bytes to every
/// payload decoder and to the [`UniqueId`] parsers.
pub fn bootstrap(data: &[u8]) {
    let mut inp = Input::new(data);
    let gate = inp.u8();
    let size = 1 + inp.below(8);
    let rest = inp.rest();
    let result_max = wire::result_max(size);
    let stop = AtomicBool::new(false);
    let mut stream = rest;
    let accept = allowed(gate);
    while let Ok(frame) = wire::read_frame(&mut stream, None, &stop, result_max, &accept) {
        assert!(accept(frame.kind));
        assert!(frame.payload.len() as u64 <= wire::max_payload(frame.kind, result_max));
        if let Some(exact) = wire::exact_payload(frame.kind) {
            assert_eq!(frame.payload.len() as u64, exact);
        }
        payload_decoders(&frame.payload, size);
    }
    payload_decoders(rest, size);
    if let Ok(id) = UniqueId::from_bytes(rest) {
        assert_eq!(&id.to_bytes()[..], rest);
        assert_eq!(id.to_string().parse::<UniqueId>().ok(), Some(id));
    }
    if let Ok(id) = String::from_utf8_lossy(rest).parse::<UniqueId>() {
        assert_eq!(UniqueId::from_bytes(&id.to_bytes()).ok(), Some(id));
    }
}

/// Every payload decoder on `p`: what one accepts must encode back to `p`.
fn payload_decoders(p: &[u8], size: usize) {
    if let Some((job, rank, size, nonce)) = wire::decode_hello(p) {
        let (rank, size) = (rank as usize, size as usize);
        assert_eq!(wire::encode_hello(job, rank, size, &nonce), p);
    }
    if let Some(blobs) = wire::decode_blobs(p, size) {
        assert_eq!(blobs.len(), size);
        assert_eq!(wire::encode_blobs(&blobs), p);
    }
    if let Some(missing) = wire::decode_missing(p) {
        assert_eq!(wire::encode_missing(&missing), p);
    }
    if let Some((rank, text)) = wire::decode_rank_text(p) {
        if text.len() <= wire::MAX_TEXT && std::str::from_utf8(&p[8..]).is_ok() {
            assert_eq!(wire::encode_rank_text(rank, &text), p);
        }
    }
    let exact = |text: &[u8]| text.len() <= wire::MAX_TEXT && std::str::from_utf8(text).is_ok();
    if let Some((dead, text)) = wire::decode_abort(p) {
        if exact(&p[8..]) {
            assert_eq!(wire::encode_abort(dead, &text), p);
        }
    }
    if let Some(notice) = wire::decode_relayed_abort(p) {
        // Whatever a peer claims, the record becomes an error, never a panic.
        let _ = notice.to_error(size);
        if exact(&p[16..]) {
            assert_eq!(
                wire::encode_relayed_abort(notice.by, notice.dead, &notice.reason),
                p
            );
        }
    }
}

/// A metadata record (raw, or with its check word recomputed so it reaches the later checks)
/// against a layout: whatever passes the receiver's checks stays inside its regions.
pub fn record(data: &[u8]) {
    let mut inp = Input::new(data);
    let Some((topo, cfg)) = setup(&mut inp) else {
        return;
    };
    let layout = WindowLayout::new(&topo, &cfg);
    let flags = inp.u8();
    let mut rec: Record = bytemuck::pod_read_unaligned(&inp.array::<32>());
    if flags & 1 != 0 {
        rec.check = rec.expected_check();
    }
    let epoch = if flags & 2 != 0 { inp.u64() } else { rec.epoch };
    let buf = layout.buffer(epoch);
    let (m, n) = (topo.attention_ranks(), topo.expert_ranks());
    let a = inp.below(m.len());
    let e = inp.below(n.len());
    let (attention, expert) = (m[a], n[e]);
    let int8 = rec.int8();
    let end = rec.offset as usize + rec.count as usize;

    // A2E, checked by expert rank `expert` as `dispatch.rs` does.
    let a2e = rec
        .validate(attention, epoch, layout.recv_rows, layout.depth)
        .and_then(|mode| {
            rec.check_region(attention, layout.attention_rows, "A2E staging")?;
            Ok(mode)
        });
    if let Ok(mode) = a2e {
        let stride = layout.a2e.stride_for(int8);
        // Pushed rows and the replies are in the buffer the record names.
        let landing = rec.landing();
        match mode {
            WireMode::Push => {
                let area = layout.a2e_recv(a, landing);
                assert!(rec.count as usize * stride <= layout.a2e_recv_bytes());
                assert!(area + layout.a2e_recv_bytes() <= layout.window_len(expert));
            }
            WireMode::Pull | WireMode::Gather => {
                let rows = if mode == WireMode::Gather {
                    layout.a2e.meta_stride
                } else {
                    stride
                };
                assert!(layout.a2e_stage(buf) + end * rows <= layout.a2e_stage(buf + 1));
            }
        }
        // The replies come back at the record's offset in the E2A receive area.
        let room = layout
            .e2a_stride_for(false)
            .max(layout.e2a_stride_for(true));
        assert!(layout.e2a_recv(landing) + end * room <= layout.e2a_recv(landing + 1));
        assert!(layout.e2a_recv(landing + 1) <= layout.window_len(attention));
    }

    // E2A in pull mode, checked by attention rank `attention` as `combine.rs` does.
    let e2a = rec
        .validate(expert, epoch, layout.attention_rows, 1)
        .and_then(|mode| {
            rec.check_region(expert, layout.expert_rows(), "E2A staging")?;
            Ok(mode)
        });
    if let Ok(WireMode::Pull) = e2a {
        let stage = layout.e2a_stage(buf);
        assert!(stage + end * layout.e2a_stride_for(int8) <= layout.e2a_stage(buf + 1));
        assert!(layout.e2a_stage(buf + 1) <= layout.window_len(expert));
    }
}

/// A received A2E row's metadata: whatever decodes is in range and re-encodes identically.
pub fn row(data: &[u8]) {
    let mut inp = Input::new(data);
    let Some((topo, cfg)) = setup(&mut inp) else {
        return;
    };
    let row = A2eRow::new(&cfg, &topo);
    let expert = topo.expert_ranks()[inp.below(topo.expert_ranks().len())];
    let local = topo.local_experts(expert).len();
    let src = inp.below(topo.world_size());
    let mut meta = inp.take(row.meta_len()).to_vec();
    meta.resize(row.meta_len(), 0);
    let mut experts = Vec::new();
    let Ok(token) = row.decode_row(&meta, src, cfg.max_tokens_per_rank, local, &mut experts) else {
        return;
    };
    assert!((token as usize) < cfg.max_tokens_per_rank);
    assert!(experts.len() <= cfg.topk);
    assert!(experts.windows(2).all(|p| p[0].0 < p[1].0));
    assert!(experts.iter().all(|&(j, _)| (j as usize) < local));
    let mut mask = vec![0u64; row.mask_words];
    for &(j, _) in &experts {
        crate::moe::routing::mask_set(&mut mask, j as usize);
    }
    let weights: Vec<f32> = experts.iter().map(|&(_, w)| w).collect();
    let mut again = vec![0u8; row.meta_len()];
    row.encode_meta(&mut again, token, &mask, &weights);
    let mut decoded = Vec::new();
    let token2 = row
        .decode_row(&again, src, cfg.max_tokens_per_rank, local, &mut decoded)
        .expect("a re-encoded row decodes");
    assert_eq!(token2, token);
    assert_eq!(
        decoded
            .iter()
            .map(|&(j, w)| (j, w.to_bits()))
            .collect::<Vec<_>>(),
        experts
            .iter()
            .map(|&(j, w)| (j, w.to_bits()))
            .collect::<Vec<_>>()
    );
}

/// Routing (expert ids, weights, token counts, `k`) into the dispatch layout.
pub fn routing(data: &[u8]) {
    let mut inp = Input::new(data);
    let Some(topo) = topology(&mut inp) else {
        return;
    };
    let attention = topo.attention_ranks();
    let src = if inp.u8() == 0xff {
        inp.below(topo.world_size() + 2)
    } else {
        attention[inp.below(attention.len())]
    };
    let k = inp.below(10);
    let tokens = inp.below(40);
    let skew = inp.u8();
    let experts = topo.num_experts() as i64;
    let mut idx: Vec<i32> = (0..tokens * k)
        .map(|_| match inp.u8() {
            0xff => inp.u32() as i32,
            b => (i64::from(b) % (experts + 3) - 2) as i32,
        })
        .collect();
    let mut weights: Vec<f32> = (0..tokens * k)
        .map(|_| match inp.u8() {
            0xff => f32::from_bits(inp.u32()),
            0xfe => f32::MAX,
            0xfd => f32::MIN_POSITIVE,
            b => f32::from(b) / 16.0 - 4.0,
        })
        .collect();
    match skew % 8 {
        1 => drop(idx.pop()),
        2 => weights.push(0.5),
        _ => {}
    }
    let mut layout = DispatchLayout::build(&topo, attention[0], 1, &[0], &[1.0], 1)
        .expect("one token to expert 0 routes");
    let before = (
        layout.tokens.clone(),
        layout.masks.clone(),
        layout.weights.clone(),
    );
    if layout
        .build_into(&topo, src, tokens, &idx, &weights, k)
        .is_err()
    {
        let after = (
            layout.tokens.clone(),
            layout.masks.clone(),
            layout.weights.clone(),
        );
        assert!(before == after, "a rejected routing changed the layout");
        return;
    }
    assert_eq!(layout.world_size(), topo.world_size());
    assert_eq!(layout.num_tokens(), tokens);
    for d in 0..topo.world_size() {
        let entries = layout.entries(d);
        if topo.expert_index(d).is_none() {
            assert!(entries.is_empty(), "entries for attention rank {d}");
        }
        let local = topo.local_experts(d).len();
        assert!(layout.tokens[entries.clone()]
            .windows(2)
            .all(|p| p[0] < p[1]));
        for i in entries {
            assert!(layout.token(i) < tokens);
            let bits = mask_count(layout.mask(i));
            assert!((1..=k).contains(&bits));
            assert!(mask_iter(layout.mask(i)).all(|j| j < local));
            for (slot, w) in layout.weights(i).iter().enumerate() {
                assert!(w.is_finite(), "entry {i} slot {slot} has weight {w}");
                if slot >= bits {
                    assert_eq!(*w, 0.0);
                }
            }
        }
    }
}

/// The string parsers and [`MoeConfig::validate`] with any numbers.
pub fn config(data: &[u8]) {
    let mut inp = Input::new(data);
    let mut cfg = MoeConfig::new(
        inp.u64() as usize,
        [DType::F32, DType::F16, DType::BF16][inp.below(3)],
        inp.u64() as usize,
        inp.u64() as usize,
    );
    cfg.max_in_flight = inp.u64() as usize;
    cfg.chunk_bytes = inp.u64() as usize;
    cfg.epoch_base = inp.u64();
    cfg.timeout = std::time::Duration::from_millis(inp.u32().into());
    cfg.recv_capacity = inp.u64() as usize;
    let topo = topology(&mut inp);
    let text = String::from_utf8_lossy(inp.rest()).into_owned();
    for s in text.split(['\0', '\n']).take(8) {
        if let Ok(d) = DType::parse(s) {
            assert_eq!(DType::parse(d.name()).ok(), Some(d));
        }
        if let Ok(q) = Quant::parse(s) {
            assert_eq!(Quant::parse(q.name()).ok(), Some(q));
        }
        if let Ok(m) = TransferMode::parse(s) {
            assert_eq!(TransferMode::parse(m.name()).ok(), Some(m));
        }
        let _ = WaitPolicy::parse(s);
    }
    let Some(topo) = topo else {
        return;
    };
    if cfg.validate(&topo).is_ok() {
        let layout = WindowLayout::new(&topo, &cfg);
        for r in 0..topo.world_size() {
            assert!(layout.window_len(r) > 0);
        }
    }
}

/// An int field: mostly small (-2..68), sometimes unset or any value.
fn int(inp: &mut Input) -> c_int {
    match inp.u8() {
        0xfe => c::UNDEF,
        0xff => inp.u32() as c_int,
        b => c_int::from(b % 70) - 2,
    }
}

/// The C config parse with any field values (the pointers always point to what the header
/// says, as the parse's safety contract requires).
pub fn c_config(data: &[u8]) {
    let mut inp = Input::new(data);
    let nranks = 1 + inp.below(64);
    let version = match inp.u8() % 6 {
        0 => 1,
        1 => 2,
        2 => 3,
        3 | 4 => c::CONFIG_VERSION,
        _ => inp.u32(),
    };
    let size = match (inp.u8() % 4, version) {
        (0, _) => inp.u64() as usize,
        (_, 1) => c::CONFIG_V1_SIZE,
        (_, 2) => c::CONFIG_V2_SIZE,
        (_, 3) => c::CONFIG_V3_SIZE,
        _ => std::mem::size_of::<xcclConfig_t>(),
    };
    let magic: c_uint = if inp.u8() == 0xff {
        inp.u32()
    } else {
        c::CONFIG_MAGIC
    };
    let mut fields = [0 as c_int; 16];
    for f in &mut fields {
        *f = int(&mut inp);
    }
    let flags = inp.u8();
    let fabric = CString::new(
        inp.take(8)
            .iter()
            .copied()
            .filter(|&b| b != 0)
            .collect::<Vec<u8>>(),
    )
    .expect("no NUL");
    // Placement arrays as long as the parse may read: `numExperts` counts, then their sum.
    let experts = usize::try_from(fields[2]).unwrap_or(0).min(1 << 12);
    let counts: Vec<c_int> = (0..experts).map(|_| int(&mut inp)).collect();
    let total: usize = counts.iter().map(|&k| k.clamp(0, 64) as usize).sum();
    let ranks: Vec<c_int> = (0..total).map(|_| int(&mut inp)).collect();
    let placement = flags & 2 != 0 && fields[2] >= 0 && fields[2] as usize == experts;
    let config = xcclConfig_t {
        size,
        magic,
        version,
        numAttentionRanks: fields[0],
        numExpertRanks: fields[1],
        numExperts: fields[2],
        topk: fields[3],
        hidden: fields[4],
        maxTokensPerRank: fields[5],
        dtype: fields[6],
        transferMode: fields[7],
        maxInFlight: fields[8],
        timeoutMs: fields[9],
        fabric: if flags & 1 != 0 {
            fabric.as_ptr()
        } else {
            std::ptr::null()
        },
        placementCounts: if placement {
            counts.as_ptr()
        } else {
            std::ptr::null()
        },
        placementRanks: if placement && flags & 4 == 0 {
            ranks.as_ptr()
        } else {
            std::ptr::null()
        },
        a2eQuant: fields[10],
        e2aQuant: fields[11],
        keepInt8: fields[12],
        recvCapacity: fields[13],
        role: fields[14],
        device: fields[15],
        ofiProvider: if flags & 8 != 0 {
            fabric.as_ptr()
        } else {
            std::ptr::null()
        },
        ofiInterface: if flags & 16 != 0 {
            fabric.as_ptr()
        } else {
            std::ptr::null()
        },
    };
    // Counts above 64 replicas exceed `nranks` (at most 64), so the parse rejects them before
    // it reads the ranks; `ranks` covers every sum it can read.
    // SAFETY: `config` is a whole version-4 struct (whatever its `size` field says); `fabric`
    // (also the OFI strings) is NUL-terminated; `placementCounts` has `numExperts` ints and
    // `placementRanks` the sum
    // of every count the parse accepts; all outlive the call.
    let _ = unsafe { c::parse(&config, nranks) };
}

/// The rank's side of the handshake against a "root" whose replies are `data`: whatever it
/// sends, the handshake fails without a panic, and it never admits the rank (the bytes cannot
/// hold a proof of the key over this rank's fresh nonce).
pub fn handshake(data: &[u8]) {
    /// A peer that answers with fixed bytes and swallows what it is sent.
    struct Scripted<'a>(&'a [u8]);
    impl std::io::Read for Scripted<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(buf)
        }
    }
    impl std::io::Write for Scripted<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let key = crate::bootstrap::JobKey::from_bytes([7; 32]);
    let root = std::net::SocketAddr::from(([127, 0, 0, 1], 29500));
    let deadline = crate::fabric::deadline_after(std::time::Duration::from_secs(5));
    let admitted =
        crate::bootstrap::tcp::handshake_over(&mut Scripted(data), root, 1, &key, (1, 2), deadline);
    assert!(admitted.is_err(), "admitted by a root that holds no key");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` pseudo-random inputs of 0 to 511 bytes (xorshift, fixed seed).
    fn inputs(seed: u64, count: usize) -> impl Iterator<Item = Vec<u8>> {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        (0..count).map(move |_| {
            let len = (next() % 512) as usize;
            (0..len).map(|_| next() as u8).collect()
        })
    }

    #[test]
    fn every_entry_point_takes_random_and_empty_input() {
        for (i, (name, f)) in ENTRIES.iter().enumerate() {
            f(&[]);
            for input in inputs(0x5eed + i as u64, 300) {
                let outcome = std::panic::catch_unwind(|| f(&input));
                assert!(outcome.is_ok(), "{name} panicked on {input:02x?}");
            }
        }
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The `routing` target's first crash: an expert selected twice with weights near
    /// `f32::MAX` was built with an infinite merged weight (fixed in `moe::routing`).
    #[test]
    fn fuzz_crash_routing_duplicate_weights_overflowing_to_infinity() {
        routing(&hex(concat!(
            "feffffffff0018181818181818181818185918181818181818181818181818183079797979797979",
            "79797979797979797979797979797979797979797979797979797979797979797979e7e7e7e71818",
            "7979797979797979feffffffff28ffff797979797979797979797979797979797979797979797979",
            "79797979797979797979797979797979797979797979797979797979797979797979797979797979",
            "797979797979797979797979797979797979797979797918180000",
        )));
    }

    /// The `config` target's first crash: `hidden * dtype size` overflowed in the window
    /// layout that `MoeConfig::validate` computes (fixed in `moe::config`). (Eight zero bytes
    /// of `recv_capacity`, read since, are inserted after the timeout.)
    #[test]
    fn fuzz_crash_config_hidden_size_overflowing_the_layout() {
        config(&hex(concat!(
            "3263efbfbdfff7ffff3100f6ffff3131313131ff0000000000000100000000000000007b00000000",
            "005d0000000000002f5daf313131000000000000000031ff0000005d0000000000afafaf57",
        )));
    }

    /// The `config` target's second crash, in the first fix of the first: the u128 bound of
    /// the window sizes overflowed for a topk near 2^64 (now saturating). (Eight zero bytes of
    /// `recv_capacity` inserted after the timeout, as above.)
    #[test]
    fn fuzz_crash_config_window_bound_overflowing_u128() {
        config(&hex(concat!(
            "004a0000270000000000000000000010fffffffb0000000000000100000000000000002e00000000",
            "002a000000000000000000000100000000000000000000ff7fff29ff000003b0ffffad9eff080100",
            "0002",
        )));
    }

    /// `frames` as a root would send them.
    fn frames(frames: &[(Kind, Vec<u8>)]) -> Vec<u8> {
        let mut data = Vec::new();
        for (kind, payload) in frames {
            wire::write_frame_to(&mut data, *kind, 0, payload).unwrap();
        }
        data
    }

    /// Found by review: a challenge shorter than a nonce panicked the rank (`copy_from_slice`)
    /// before any proof of the key; so did any frame a reader used at a fixed length.
    #[test]
    fn challenges_and_welcomes_of_the_wrong_length_fail_the_handshake_without_a_panic() {
        for n in [0, 5, 31, 33] {
            handshake(&frames(&[(Kind::Challenge, vec![1; n])]));
            let welcome = vec![2; n];
            handshake(&frames(&[
                (Kind::Challenge, vec![1; 32]),
                (Kind::Welcome, welcome),
            ]));
        }
    }

    #[test]
    fn a_valid_frame_stream_reaches_the_decoders() {
        let mut data = vec![3u8, 1];
        for (kind, payload) in [
            (Kind::Hello, wire::encode_hello(7, 1, 2, &[3; 32])),
            (
                Kind::Status,
                wire::encode_missing(&[(1, wire::Absence::Late)]),
            ),
            (Kind::Abort, wire::encode_relayed_abort(1, Some(0), "gone")),
        ] {
            data.extend_from_slice(&wire::MAGIC);
            data.extend_from_slice(&wire::PROTOCOL_VERSION.to_le_bytes());
            data.extend_from_slice(&(kind as u16).to_le_bytes());
            data.extend_from_slice(&0u64.to_le_bytes());
            data.extend_from_slice(&(payload.len() as u64).to_le_bytes());
            data.extend_from_slice(&payload);
        }
        bootstrap(&data);
    }
}
