//! Criterion benchmarks of the MoE protocol's CPU paths, each beside a memcpy of the same bytes
//! in the same group (`Throughput::Bytes`), so the report reads as "fraction of memcpy speed":
//!
//! - `layout/T`: `DispatchLayout::build_into` for T tokens, top-8 of 64 experts over 2 expert
//!   ranks, a different routing each call (bytes = the routing read: `T * K * (4 + 4)`);
//! - `record`: `Record::new` + `Record::validate` (32 bytes);
//! - `row_meta`: `A2eRow::encode_meta` + `decode_meta` (the metadata bytes of one row);
//! - `roundtrip_local`: one A2E + E2A over the `local` fabric, 1A:1E, T=128, H=7168 and T=1,
//!   H=16, bf16, with the identity as expert (bytes = rows sent x H x 2, both directions).
//!
//! Run: `cargo bench -p xccl-benches --bench protocol -- --warm-up-time 1 --measurement-time 2`.

use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_main, Criterion, Throughput};
use half::bf16;
use xccl::moe::dtype::slice_from_f32;
use xccl::moe::record::Record;
use xccl::moe::routing::DispatchLayout;
use xccl::moe::rows::A2eRow;
use xccl::testing::harness::Workload;
use xccl::testing::reference::random_routing;
use xccl::{Communicator, DType, ExpertBatch, MoeConfig, TokenBatch, Topology, TransferMode};

const K: usize = 8;
const EXPERTS: usize = 64;
/// Routings the layout benchmark cycles through.
const ROUTINGS: usize = 64;

/// A memcpy of `bytes` bytes, as a benchmark in `group`.
fn memcpy_bench(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    bytes: usize,
) {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        })
    });
}

fn layout(c: &mut Criterion) {
    let topo = Topology::contiguous(1, 2, EXPERTS).expect("topology");
    for t in [1usize, 128, 512] {
        // A new routing each call, as every layer brings: one routing repeated would let the
        // branch predictor learn it, which no real call sees.
        let routings: Vec<_> = (0..ROUTINGS)
            .map(|seed| random_routing(seed as u64, t, K, EXPERTS, None))
            .collect();
        let bytes = t * K * 8;
        let mut group = c.benchmark_group(format!("layout/{t}"));
        group.throughput(Throughput::Bytes(bytes as u64));
        let mut layout = DispatchLayout::default();
        let mut next = 0;
        group.bench_function("build_into", |b| {
            b.iter(|| {
                let (idx, w) = &routings[next % ROUTINGS];
                next += 1;
                layout
                    .build_into(&topo, 0, t, black_box(idx), black_box(w), K)
                    .expect("layout");
                black_box(layout.total_entries());
            })
        });
        memcpy_bench(&mut group, bytes);
        group.finish();
    }
}

fn record(c: &mut Criterion) {
    let mut group = c.benchmark_group("record");
    group.throughput(Throughput::Bytes(std::mem::size_of::<Record>() as u64));
    let mut epoch = 0u64;
    group.bench_function("new_validate", |b| {
        b.iter(|| {
            epoch += 1;
            let r = Record::new(black_box(epoch), 37, 1024, TransferMode::Push);
            black_box(black_box(r).validate(1, epoch, 4096, 1).expect("valid"));
        })
    });
    memcpy_bench(&mut group, std::mem::size_of::<Record>());
    group.finish();
}

fn row_meta(c: &mut Criterion) {
    let topo = Topology::contiguous(1, 2, EXPERTS).expect("topology");
    let cfg = MoeConfig::new(7168, DType::BF16, K, 128);
    let row = A2eRow::new(&cfg, &topo);
    let mut meta = vec![0u8; row.stride - row.meta_offset()];
    // Four local experts (bits 0, 4, 5, 7), within a rank hosting 64.
    let mut mask = vec![0u64; row.mask_words];
    mask[0] = 0b1011_0001;
    let weights = [0.125f32; K];
    let mut experts = Vec::with_capacity(K);
    let mut group = c.benchmark_group("row_meta");
    group.throughput(Throughput::Bytes(meta.len() as u64));
    group.bench_function("encode_decode", |b| {
        b.iter(|| {
            row.encode_meta(
                &mut meta,
                black_box(9),
                black_box(&mask),
                black_box(&weights),
            );
            let tok = row
                .decode_row(black_box(&meta), 1, 16, 64, &mut experts)
                .expect("valid row");
            black_box((tok, experts.len()));
        })
    });
    memcpy_bench(&mut group, meta.len());
    group.finish();
}

fn roundtrip_local(c: &mut Criterion) {
    roundtrip_local_at(c, 128, 7168, false);
    // One token of 16 elements, token-major as a decode step's: the copies cost nothing, what
    // is left is the four calls' own fixed work, which no bandwidth hides.
    roundtrip_local_at(c, 1, 16, true);
}

/// [`roundtrip_local`] with `t` tokens of hidden size `h` (the routing of round 0 every call),
/// the expert rank receiving expert-major, or token-major when `tokens`.
fn roundtrip_local_at(c: &mut Criterion, t: usize, h: usize, tokens: bool) {
    let topo = Topology::contiguous(1, 1, EXPERTS).expect("topology");
    let cfg = MoeConfig::new(h, DType::BF16, K, t);
    let mut comms = Communicator::local_group(&topo, &cfg).expect("local group");
    let mut expert = comms.pop().expect("expert rank");
    let mut attention = comms.pop().expect("attention rank");
    let wl = Workload {
        seed: 3,
        tokens: t,
        vary: false,
        skew: None,
        shared_experts: 0,
    };
    let input = wl.input(&topo, K, 0, 0);
    let x: Vec<bf16> = slice_from_f32(&wl.hidden_states(0, 0, t, h));
    let mut out = vec![bf16::ZERO; t * h];
    // One row per (token, destination rank); with one expert rank every token is one row.
    let bytes = 2 * t * h * 2;

    let (tx, rx) = mpsc::channel::<u64>();
    let server = std::thread::spawn(move || {
        let (mut batch, mut token_batch) = (ExpertBatch::new(), TokenBatch::new());
        while let Ok(n) = rx.recv() {
            for _ in 0..n {
                if tokens {
                    let tb = &mut token_batch;
                    expert
                        .a2e_recv_tokens(tb, &mut |_, _| {})
                        .expect("a2e_recv_tokens");
                    let rows = tb.rows::<bf16>().expect("rows");
                    expert.e2a_send_tokens(tb, rows).expect("e2a_send_tokens");
                } else {
                    expert.a2e_recv(&mut batch).expect("a2e_recv");
                    let rows = batch.rows::<bf16>().expect("rows");
                    expert.e2a_send(&batch, rows).expect("e2a_send");
                }
            }
        }
    });

    let mut group = c.benchmark_group("roundtrip_local");
    group.throughput(Throughput::Bytes(bytes as u64));
    let layout = if tokens { "tokens" } else { "experts" };
    group.bench_function(format!("a2e_e2a_1A1E_T{t}_H{h}_bf16_{layout}"), |b| {
        b.iter_custom(|iters| {
            tx.send(iters).expect("expert thread alive");
            let start = Instant::now();
            for _ in 0..iters {
                let handle = attention
                    .a2e_send(&x, &input.topk_idx, &input.topk_weights)
                    .expect("a2e_send");
                attention.e2a_recv(&handle, &mut out).expect("e2a_recv");
            }
            start.elapsed()
        })
    });
    memcpy_bench(&mut group, bytes);
    group.finish();
    drop(tx);
    server.join().expect("expert thread");
}

/// Every benchmark of this file, with timings short enough for CI (command-line flags override).
fn benches() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();
    layout(&mut c);
    record(&mut c);
    row_meta(&mut c);
    roundtrip_local(&mut c);
}
criterion_main!(benches);
