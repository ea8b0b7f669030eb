//! Communicator tests over the in-process fabric: every result checked bit for bit against the
//! reference, and every defined failure state (rejected calls, poisoning, aborts, bad peer data).

use std::time::{Duration, Instant};

use half::{bf16, f16};
use proptest::prelude::*;

use crate::fabric::Capabilities;
use crate::moe::config::{MoeConfig, TransferMode};
use crate::moe::context::CheckDue;
use crate::moe::dtype::{DType, Element};
use crate::moe::quant::Quant;
use crate::testing::harness::{
    attention_round, attention_round_with, expert_round, expert_round_tokens_with,
    expert_round_view, first_difference, token_replies, Buffers, Workload,
};
use crate::testing::reference::{expected_combine_exact, test_expert};
use crate::topology::{Role, Topology, TopologyBuilder};
use crate::{Communicator, Error, ExpertBatch, TokenBatch};

/// Runs `rounds` A2E+E2A rounds on every rank (threads) and returns the first failure. Expert
/// ranks alternate between the expert-major and the token-major receive path.
fn run_local<T: Element>(
    topo: &Topology,
    cfg: &MoeConfig,
    wl: &Workload,
    rounds: u64,
    modes: &[TransferMode],
) -> Result<(), String> {
    run_local_caps::<T>(topo, cfg, wl, rounds, modes, true)
}

/// [`run_local`] on a fabric with or without load/store access to peer windows.
fn run_local_caps<T: Element>(
    topo: &Topology,
    cfg: &MoeConfig,
    wl: &Workload,
    rounds: u64,
    modes: &[TransferMode],
    load_store: bool,
) -> Result<(), String> {
    let caps = Capabilities {
        load_store,
        remote_read: true,
        chunk_floor: 0,
    };
    let comms = Communicator::local_group_with(topo, cfg, caps).map_err(|e| e.to_string())?;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || -> Result<(), String> {
                    let mut batch = ExpertBatch::new();
                    let mut tokens = TokenBatch::new();
                    for round in 0..rounds {
                        c.set_mode(modes[(round as usize + c.rank()) % modes.len()]);
                        // Registered buffers every third round, on both sides independently.
                        let buffers = if (round + c.rank() as u64) % 3 == 1 {
                            Buffers::Registered
                        } else {
                            Buffers::Copy
                        };
                        let verdict = match c.role() {
                            Role::Attention => {
                                attention_round_with::<T>(&mut c, wl, round, buffers)
                            }
                            Role::Expert if (round + c.rank() as u64).is_multiple_of(2) => {
                                expert_round::<T>(&mut c, wl, round, &mut batch, true)
                            }
                            Role::Expert if (round + c.rank() as u64) % 4 == 1 => {
                                expert_round_view::<T>(&mut c, wl, round, true)
                            }
                            Role::Expert => expert_round_tokens_with::<T>(
                                &mut c,
                                wl,
                                round,
                                &mut tokens,
                                true,
                                buffers,
                            ),
                        };
                        verdict.map_err(|e| format!("rank {}: {e}", c.rank()))??;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "rank panicked".to_string())?)
            .collect::<Result<Vec<()>, String>>()
            .map(|_| ())
    })
}

fn cfg(hidden: usize, dtype: DType, topk: usize, max_tokens: usize) -> MoeConfig {
    let mut c = MoeConfig::new(hidden, dtype, topk, max_tokens);
    c.timeout = Duration::from_secs(20);
    c
}

fn wl(seed: u64, tokens: usize, vary: bool) -> Workload {
    Workload {
        seed,
        tokens,
        vary,
        skew: None,
        shared_experts: 0,
    }
}

const BOTH: &[TransferMode] = &[TransferMode::Push, TransferMode::Pull];

#[test]
fn one_attention_one_expert_round_trips_f32() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    run_local::<f32>(
        &topo,
        &cfg(32, DType::F32, 2, 16),
        &wl(1, 16, false),
        4,
        BOTH,
    )
    .unwrap();
}

#[test]
fn two_by_two_round_trips_bf16_in_push_and_pull() {
    let topo = Topology::contiguous(2, 2, 8).unwrap();
    run_local::<bf16>(
        &topo,
        &cfg(64, DType::BF16, 4, 32),
        &wl(2, 32, false),
        6,
        BOTH,
    )
    .unwrap();
}

#[test]
fn three_attention_one_expert_f16() {
    let topo = Topology::contiguous(3, 1, 6).unwrap();
    run_local::<f16>(&topo, &cfg(16, DType::F16, 3, 8), &wl(3, 8, true), 6, BOTH).unwrap();
}

#[test]
fn one_attention_three_experts_pull_only() {
    let topo = Topology::contiguous(1, 3, 9).unwrap();
    let pull = &[TransferMode::Pull];
    run_local::<f32>(&topo, &cfg(8, DType::F32, 4, 8), &wl(4, 8, true), 6, pull).unwrap();
}

#[test]
fn eight_by_sixteen_with_varying_tokens() {
    let topo = Topology::contiguous(8, 16, 64).unwrap();
    run_local::<bf16>(
        &topo,
        &cfg(16, DType::BF16, 8, 12),
        &wl(5, 12, true),
        5,
        BOTH,
    )
    .unwrap();
}

#[test]
fn rows_larger_than_a_chunk_stream_in_pieces() {
    // 32 KiB rows: two rows per progress signal, so every message arrives in several chunks.
    let topo = Topology::contiguous(2, 2, 8).unwrap();
    let c = cfg(8192, DType::F32, 3, 16);
    assert_eq!(
        crate::moe::progress::chunk_rows(8192 * 4 + 64, c.chunk_bytes),
        1
    );
    run_local::<f32>(&topo, &c, &wl(15, 16, true), 6, BOTH).unwrap();
    run_local::<bf16>(
        &topo,
        &cfg(8192, DType::BF16, 3, 16),
        &wl(16, 16, true),
        6,
        BOTH,
    )
    .unwrap();
}

#[test]
fn a_communicator_raises_chunk_bytes_to_its_fabrics_chunk_floor() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let mut c = cfg(8, DType::F32, 2, 4);
    for (asked, floor, used) in [(64, 4096, 4096), (8192, 4096, 8192), (64, 0, 64)] {
        c.chunk_bytes = asked;
        let caps = Capabilities {
            load_store: true,
            remote_read: true,
            chunk_floor: floor,
        };
        let comms = Communicator::local_group_with(&topo, &c, caps).unwrap();
        for comm in &comms {
            assert_eq!(
                comm.config().chunk_bytes,
                used,
                "asked {asked}, floor {floor}"
            );
        }
    }
}

#[test]
fn fabrics_without_load_store_stage_put_and_get() {
    // The paths an RDMA fabric takes: push stages rows then puts them, pull gets them into a
    // landing buffer; with rows larger than a chunk, several puts and gets per message.
    let topo = Topology::contiguous(3, 2, 8).unwrap();
    run_local_caps::<bf16>(
        &topo,
        &cfg(32, DType::BF16, 3, 16),
        &wl(17, 16, true),
        8,
        BOTH,
        false,
    )
    .unwrap();
    run_local_caps::<f32>(
        &topo,
        &cfg(8192, DType::F32, 3, 8),
        &wl(18, 8, true),
        4,
        BOTH,
        false,
    )
    .unwrap();
}

#[test]
fn zero_tokens_everywhere_is_a_valid_call() {
    let topo = Topology::contiguous(2, 3, 6).unwrap();
    run_local::<f32>(&topo, &cfg(8, DType::F32, 2, 4), &wl(6, 0, false), 3, BOTH).unwrap();
}

#[test]
fn every_token_to_one_hot_expert() {
    let topo = Topology::contiguous(3, 2, 4).unwrap();
    let mut w = wl(7, 16, false);
    w.skew = Some(50.0);
    run_local::<f32>(&topo, &cfg(8, DType::F32, 2, 16), &w, 3, BOTH).unwrap();
}

#[test]
fn replicas_of_hot_experts_are_used() {
    let topo = TopologyBuilder::contiguous(4, 3, 6)
        .replicas(&[(0, 2), (1, 1)])
        .build()
        .unwrap();
    let mut w = wl(8, 16, true);
    w.skew = Some(1.5);
    run_local::<bf16>(&topo, &cfg(16, DType::BF16, 3, 16), &w, 4, BOTH).unwrap();
}

#[test]
fn topk_larger_than_experts_on_one_rank() {
    let topo = Topology::contiguous(2, 4, 8).unwrap();
    run_local::<f32>(&topo, &cfg(8, DType::F32, 6, 8), &wl(9, 8, false), 3, BOTH).unwrap();
}

#[test]
fn many_back_to_back_rounds_with_random_token_counts() {
    let topo = Topology::contiguous(2, 2, 8).unwrap();
    run_local::<f32>(
        &topo,
        &cfg(8, DType::F32, 4, 16),
        &wl(10, 16, true),
        300,
        BOTH,
    )
    .unwrap();
}

#[test]
fn interleaved_roles_work() {
    let roles = vec![
        Role::Expert,
        Role::Attention,
        Role::Expert,
        Role::Attention,
        Role::Expert,
    ];
    let topo = TopologyBuilder::new(roles, 7).build().unwrap();
    run_local::<f32>(&topo, &cfg(8, DType::F32, 3, 8), &wl(11, 8, true), 4, BOTH).unwrap();
}

/// Runs `f` on every communicator of `comms`, each on its own thread; the results in rank order.
fn on_every_rank<C: Send, R: Send>(comms: Vec<C>, f: impl Fn(C) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn results_are_bitwise_identical_run_to_run() {
    let topo = Topology::contiguous(2, 3, 12).unwrap();
    let c = cfg(16, DType::BF16, 4, 8);
    let run = || {
        let comms = Communicator::local_group(&topo, &c).unwrap();
        let w = wl(12, 8, false);
        on_every_rank(comms, |mut comm| {
            if comm.role() == Role::Expert {
                let mut b = ExpertBatch::new();
                expert_round::<bf16>(&mut comm, &w, 0, &mut b, false)
                    .unwrap()
                    .unwrap();
                return Vec::new();
            }
            let input = w.input(comm.topology(), 4, comm.rank(), 0);
            let x: Vec<bf16> = w.hidden_states(comm.rank(), 0, input.num_tokens, 16);
            let h = comm
                .a2e_send(&x, &input.topk_idx, &input.topk_weights)
                .unwrap();
            let mut out = vec![bf16::ZERO; x.len()];
            comm.e2a_recv(&h, &mut out).unwrap();
            out.iter().map(|v| v.to_bits()).collect::<Vec<u16>>()
        })
    };
    assert_eq!(run(), run());
}

/// Runs `f` on attention rank 0 of a 1A:1E job, then checks a normal round still works — so a
/// rejected call left nothing behind on either side.
fn rejected_then_clean_round(f: impl FnOnce(&mut Communicator) -> Error + Send) -> Error {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let err = f(&mut attn);
    let w = wl(13, 4, false);
    std::thread::scope(|s| {
        let e = s.spawn(move || {
            let mut b = ExpertBatch::new();
            expert_round::<f32>(&mut expert, &w, 0, &mut b, true)
                .unwrap()
                .unwrap()
        });
        attention_round::<f32>(&mut attn, &wl(13, 4, false), 0)
            .unwrap()
            .unwrap();
        e.join().unwrap();
    });
    err
}

#[test]
fn out_of_range_expert_id_is_rejected_before_any_write() {
    let err = rejected_then_clean_round(|c| {
        c.a2e_send(&[0f32; 16], &[0, 1, 4, -1], &[0.5; 4])
            .unwrap_err()
    });
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("4")),
        "{err}"
    );
}

#[test]
fn too_many_tokens_are_rejected() {
    let err =
        rejected_then_clean_round(|c| c.a2e_send(&[0f32; 40], &[0; 10], &[0.5; 10]).unwrap_err());
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("max_tokens")),
        "{err}"
    );
}

#[test]
fn wrong_hidden_size_and_dtype_are_rejected() {
    let err =
        rejected_then_clean_round(|c| c.a2e_send(&[0f32; 7], &[0, 1], &[0.5; 2]).unwrap_err());
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let err = rejected_then_clean_round(|c| {
        c.a2e_send(&[bf16::ZERO; 8], &[0, 1], &[0.5; 2])
            .unwrap_err()
    });
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("dtype")),
        "{err}"
    );
}

#[test]
fn length_mismatch_of_routing_is_rejected() {
    let err =
        rejected_then_clean_round(|c| c.a2e_send(&[0f32; 16], &[0, 1, 2], &[0.5; 4]).unwrap_err());
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn calls_on_the_wrong_role_are_rejected() {
    let err = rejected_then_clean_round(|c| c.a2e_recv(&mut ExpertBatch::new()).unwrap_err());
    assert!(matches!(err, Error::WrongRole(_)), "{err}");
}

#[test]
fn mismatched_config_is_caught_at_init_naming_the_peer() {
    use crate::fabric::local::LocalFabric;
    use std::sync::Arc;
    let topo = Arc::new(Topology::contiguous(1, 1, 4).unwrap());
    let a = cfg(8, DType::F32, 2, 4);
    let mut b = a.clone();
    b.topk = 3;
    let lens: Vec<usize> = Communicator::window_lens(&topo, &a)
        .unwrap()
        .iter()
        .zip(Communicator::window_lens(&topo, &b).unwrap())
        .map(|(x, y)| (*x).max(y))
        .collect();
    let mut fabrics = LocalFabric::group(&lens, Communicator::signal_slots(&topo)).unwrap();
    let f1 = fabrics.pop().unwrap();
    let f0 = fabrics.pop().unwrap();
    let t2 = topo.clone();
    let h = std::thread::spawn(move || Communicator::from_fabric(Box::new(f1), t2, b).err());
    let e0 = Communicator::from_fabric(Box::new(f0), topo, a).err();
    let e1 = h.join().unwrap();
    match e0 {
        Some(Error::Protocol { peer: 1, detail }) => assert!(
            detail.contains("topk = 3") && detail.contains("topk = 2"),
            "names the field and both values: {detail}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(e1, Some(Error::Protocol { peer: 0, .. })),
        "{e1:?}"
    );
}

#[test]
fn missing_expert_rank_times_out_naming_it() {
    let topo = Topology::contiguous(1, 2, 4).unwrap();
    let mut c = cfg(8, DType::F32, 2, 4);
    c.timeout = Duration::from_millis(300);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let _e2 = comms.pop().unwrap();
    let _e1 = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let input = wl(14, 4, false).input(&topo, 2, 0, 0);
    let h = attn
        .a2e_send(&[0f32; 32], &input.topk_idx, &input.topk_weights)
        .unwrap();
    let err = attn.e2a_recv(&h, &mut [0f32; 32]).unwrap_err();
    assert!(matches!(err, Error::Timeout { peer: 1, .. }), "{err}");
}

#[test]
fn a_receive_without_deadline_waits_past_the_timeout_and_ends_when_its_peer_leaves() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let mut c = cfg(8, DType::F32, 2, 4);
    c.timeout = Duration::from_millis(200);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let input = wl(15, 4, false).input(&topo, 2, 0, 0);
    let idle = Duration::from_millis(700);
    let attention = std::thread::spawn(move || {
        // Idle for more than three timeouts, then one call, then gone.
        std::thread::sleep(idle);
        let h = attn
            .a2e_send(&[1f32; 32], &input.topk_idx, &input.topk_weights)
            .unwrap();
        attn.e2a_recv(&h, &mut [0f32; 32]).unwrap();
    });
    let start = Instant::now();
    let mut batch = ExpertBatch::default();
    expert
        .without_deadline(|e| e.a2e_recv(&mut batch))
        .expect("the idle receive waits for the call");
    assert!(start.elapsed() >= idle, "{:?}", start.elapsed());
    let out = vec![0f32; batch.num_rows() * 8];
    expert.e2a_send(&batch, &out).unwrap();
    attention.join().unwrap();
    // The peer left: the next idle receive ends naming it, not at a deadline.
    let err = expert
        .without_deadline(|e| e.a2e_recv(&mut batch))
        .unwrap_err();
    assert!(matches!(err, Error::PeerFailed { peer: 0, .. }), "{err}");
    // The configured timeout applies again.
    assert_eq!(expert.config().timeout, Duration::from_millis(200));
}

#[test]
fn a_communicator_that_left_is_seen_gone_at_once_and_refuses_later_calls() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let mut c = cfg(8, DType::F32, 2, 4);
    c.timeout = Duration::from_secs(20);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    attn.leave();
    // Still alive and mapped, but gone for its peer: not a 20 s timeout.
    let start = Instant::now();
    let err = expert.a2e_recv(&mut ExpertBatch::default()).unwrap_err();
    assert!(matches!(err, Error::PeerFailed { peer: 0, .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let input = wl(16, 4, false).input(&topo, 2, 0, 0);
    let err = attn
        .a2e_send(&[0f32; 32], &input.topk_idx, &input.topk_weights)
        .unwrap_err();
    assert!(err.to_string().contains("left the job"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn random_topologies_and_routings_match_the_reference(
        topo in crate::topology::tests::arb_topology(),
        hidden in 1usize..24,
        topk in 1usize..6,
        tokens in 0usize..10,
        seed in any::<u64>(),
        skewed in any::<bool>(),
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16)],
        quant in 0u8..4,
    ) {
        let mut c = cfg(hidden, dtype, topk, tokens.max(1));
        c.a2e_quant = if quant & 1 == 1 { Quant::Int8 } else { Quant::None };
        c.e2a_quant = if quant & 2 == 2 { Quant::Int8 } else { Quant::None };
        let w = Workload { seed, tokens, vary: true, skew: skewed.then_some(1.2), shared_experts: 0 };
        let r = match dtype {
            DType::BF16 => run_local::<bf16>(&topo, &c, &w, 3, BOTH),
            _ => run_local::<f32>(&topo, &c, &w, 3, BOTH),
        };
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// Tokens routed to several expert ranks are summed from rows read where they landed (mapped
/// windows) or copied out (no load/store): both give the reference's bits, in the dtype and
/// with INT8 replies, push and pull.
#[test]
fn e2a_sums_over_several_expert_ranks_read_in_place_match_the_reference_bit_for_bit() {
    let topo = Topology::contiguous(2, 3, 12).unwrap();
    for e2a_quant in [Quant::None, Quant::Int8] {
        for load_store in [true, false] {
            let mut c = cfg(40, DType::BF16, 6, 16);
            c.e2a_quant = e2a_quant;
            let w = wl(23, 16, true);
            run_local_caps::<bf16>(&topo, &c, &w, 4, BOTH, load_store)
                .unwrap_or_else(|e| panic!("{e2a_quant:?}, load/store {load_store}: {e}"));
        }
    }
}

#[test]
fn two_microbatches_in_flight_come_back_right() {
    // a2e(1), a2e(2), e2a(1), e2a(2) on every rank: both buffers in use at once.
    let topo = Topology::contiguous(2, 3, 9).unwrap();
    let c = cfg(4096, DType::F32, 3, 12);
    let w = wl(19, 12, true);
    let comms = Communicator::local_group(&topo, &c).unwrap();
    std::thread::scope(|s| {
        for mut comm in comms {
            let (topo, w) = (&topo, &w);
            s.spawn(move || {
                let hidden = 4096;
                if comm.role() == Role::Expert {
                    let mut batches = [TokenBatch::new(), TokenBatch::new()];
                    for _ in 0..3 {
                        for b in &mut batches {
                            comm.a2e_recv_tokens(b, &mut |_, _| {}).unwrap();
                        }
                        for b in &batches {
                            let locals = topo.local_experts(comm.rank()).to_vec();
                            let out: Vec<f32> = token_replies(&locals, b);
                            comm.e2a_send_tokens(b, &out).unwrap();
                        }
                    }
                    return;
                }
                for round in 0..3u64 {
                    let inputs = [
                        w.input(topo, 3, comm.rank(), 2 * round),
                        w.input(topo, 3, comm.rank(), 2 * round + 1),
                    ];
                    let xs: Vec<Vec<f32>> = inputs
                        .iter()
                        .enumerate()
                        .map(|(m, inp)| {
                            w.hidden_states(
                                comm.rank(),
                                2 * round + m as u64,
                                inp.num_tokens,
                                hidden,
                            )
                        })
                        .collect();
                    let h0 = comm
                        .a2e_send(&xs[0], &inputs[0].topk_idx, &inputs[0].topk_weights)
                        .unwrap();
                    let h1 = comm
                        .a2e_send(&xs[1], &inputs[1].topk_idx, &inputs[1].topk_weights)
                        .unwrap();
                    for (m, h) in [h0, h1].into_iter().enumerate() {
                        let mut out = vec![0f32; xs[m].len()];
                        comm.e2a_recv(&h, &mut out).unwrap();
                        let want =
                            expected_combine_exact(topo, &inputs[m], &xs[m], hidden, &test_expert);
                        assert_eq!(
                            first_difference(&out, &want, hidden),
                            None,
                            "microbatch {m}"
                        );
                    }
                }
            });
        }
    });
}

#[test]
fn registered_input_must_be_requested_before_sending_it() {
    let err =
        rejected_then_clean_round(|c| c.a2e_send_input(2, &[0, 1, 2, 3], &[0.5; 4]).unwrap_err());
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("a2e_input")),
        "{err}"
    );
}

#[test]
fn registered_output_must_be_requested_for_the_same_batch() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let w = wl(20, 4, false);
    std::thread::scope(|s| {
        s.spawn(|| attention_round::<f32>(&mut attn, &w, 0).unwrap().unwrap());
        let mut batch = TokenBatch::new();
        expert.a2e_recv_tokens(&mut batch, &mut |_, _| {}).unwrap();
        let err = expert.e2a_send_output(&batch).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("e2a_output")),
            "{err}"
        );
        let mut stale = batch.clone();
        stale.recv.epoch += 1;
        let err = expert.e2a_output::<f32>(&stale).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = expert.e2a_send_output(&batch).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // Nothing was sent: the real reply still goes through and checks out.
        let locals = topo.local_experts(1).to_vec();
        let out: Vec<f32> = token_replies(&locals, &batch);
        expert
            .e2a_output::<f32>(&batch)
            .unwrap()
            .copy_from_slice(&out);
        expert.e2a_send_output(&batch).unwrap();
    });
}

#[test]
fn dropped_view_aborts_the_job_naming_the_expert_and_the_epoch() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let input = wl(21, 4, false).input(&topo, 2, 0, 0);
    let h = attn
        .a2e_send(&[1f32; 32], &input.topk_idx, &input.topk_weights)
        .unwrap();
    let view = expert.a2e_recv_view().unwrap();
    assert_eq!(view.num_tokens(), 4);
    assert_eq!(view.row::<f32>(3).unwrap(), &[1f32; 8]);
    drop(view);
    let start = std::time::Instant::now();
    let err = attn.e2a_recv(&h, &mut [0f32; 32]).unwrap_err();
    assert!(
        matches!(&err, Error::Aborted { by: 1, reason } if reason.contains("dropped its view of A2E epoch 1")),
        "{err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "seen at once, not at the deadline"
    );
}

/// A 1A:1E job over the local fabric: (attention rank 0, expert rank 1).
fn pair(c: &MoeConfig) -> (Communicator, Communicator) {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let mut comms = Communicator::local_group(&topo, c).unwrap();
    let expert = comms.pop().unwrap();
    (comms.pop().unwrap(), expert)
}

/// Serves `rounds` expert rounds (token path, checked) on its own thread.
fn serve<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    mut expert: Communicator,
    rounds: u64,
) -> std::thread::ScopedJoinHandle<'s, Communicator> {
    s.spawn(move || {
        let mut b = TokenBatch::new();
        let w = wl(31, 4, false);
        for round in 0..rounds {
            crate::testing::harness::expert_round_tokens::<f32>(
                &mut expert,
                &w,
                round,
                &mut b,
                false,
            )
            .unwrap()
            .unwrap();
        }
        expert
    })
}

/// Attention rank 0's input of `round` in the [`serve`] workload.
fn input_of(round: u64) -> (crate::testing::reference::RankInput, Vec<f32>) {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let w = wl(31, 4, false);
    let input = w.input(&topo, 2, 0, round);
    let x = w.hidden_states(0, round, input.num_tokens, 8);
    (input, x)
}

fn expected_of(round: u64) -> Vec<f32> {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let (input, x) = input_of(round);
    expected_combine_exact(&topo, &input, &x, 8, &test_expert)
}

#[test]
fn e2a_handles_are_matched_to_their_a2e_by_epoch() {
    let c = cfg(8, DType::F32, 2, 4);
    let (mut attn, expert) = pair(&c);
    let (mut other, _other_expert) = pair(&c);
    std::thread::scope(|s| {
        let e = serve(s, expert, 2);
        let (i0, x0) = input_of(0);
        let (i1, x1) = input_of(1);
        let h1 = attn.a2e_send(&x0, &i0.topk_idx, &i0.topk_weights).unwrap();
        let h2 = attn.a2e_send(&x1, &i1.topk_idx, &i1.topk_weights).unwrap();
        let mut out = vec![0f32; 32];
        // Out of order: an error naming both epochs, nothing consumed.
        let err = attn.e2a_recv(&h2, &mut out).unwrap_err().to_string();
        assert!(err.contains("epoch 1") && err.contains("epoch 2"), "{err}");
        // A validation error (wrong length) keeps the handle valid.
        let err = attn.e2a_recv(&h1, &mut out[..8]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // A handle of another communicator is rejected.
        let foreign = other.a2e_send(&x0, &i0.topk_idx, &i0.topk_weights).unwrap();
        let err = attn.e2a_recv(&foreign, &mut out).unwrap_err().to_string();
        assert!(err.contains("another communicator"), "{err}");
        attn.e2a_recv(&h1, &mut out).unwrap();
        assert_eq!(first_difference(&out, &expected_of(0), 8), None);
        // Reused: rejected, naming both epochs.
        let err = attn.e2a_recv(&h1, &mut out).unwrap_err().to_string();
        assert!(
            err.contains("already used") && err.contains("epoch 2"),
            "{err}"
        );
        attn.e2a_recv(&h2, &mut out).unwrap();
        assert_eq!(first_difference(&out, &expected_of(1), 8), None);
        assert!(attn.poisoned().is_none());
        e.join().unwrap();
    });
}

#[test]
fn expert_replies_must_follow_a2e_order() {
    let c = cfg(8, DType::F32, 2, 4);
    let (mut attn, mut expert) = pair(&c);
    let (i0, x0) = input_of(0);
    let (i1, x1) = input_of(1);
    let h1 = attn.a2e_send(&x0, &i0.topk_idx, &i0.topk_weights).unwrap();
    let h2 = attn.a2e_send(&x1, &i1.topk_idx, &i1.topk_weights).unwrap();
    let mut b1 = TokenBatch::new();
    let mut b2 = TokenBatch::new();
    expert.a2e_recv_tokens(&mut b1, &mut |_, _| {}).unwrap();
    expert.a2e_recv_tokens(&mut b2, &mut |_, _| {}).unwrap();
    let locals = [0usize, 1, 2, 3];
    let err = expert
        .e2a_send_tokens(&b2, &token_replies::<f32>(&locals, &b2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("epoch 1") && err.contains("epoch 2"), "{err}");
    expert
        .e2a_send_tokens(&b1, &token_replies::<f32>(&locals, &b1))
        .unwrap();
    expert
        .e2a_send_tokens(&b2, &token_replies::<f32>(&locals, &b2))
        .unwrap();
    let err = expert
        .e2a_send_tokens(&b2, &token_replies::<f32>(&locals, &b2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("already replied"), "{err}");
    let mut out = vec![0f32; 32];
    attn.e2a_recv(&h1, &mut out).unwrap();
    assert_eq!(first_difference(&out, &expected_of(0), 8), None);
    attn.e2a_recv(&h2, &mut out).unwrap();
    assert_eq!(first_difference(&out, &expected_of(1), 8), None);
}

#[test]
fn a2e_past_max_in_flight_fails_at_once_and_changes_nothing() {
    let c = cfg(8, DType::F32, 2, 4);
    let (mut attn, expert) = pair(&c);
    std::thread::scope(|s| {
        let e = serve(s, expert, 3);
        let (i0, x0) = input_of(0);
        let (i1, x1) = input_of(1);
        let (i2, x2) = input_of(2);
        let h1 = attn.a2e_send(&x0, &i0.topk_idx, &i0.topk_weights).unwrap();
        let h2 = attn.a2e_send(&x1, &i1.topk_idx, &i1.topk_weights).unwrap();
        let start = std::time::Instant::now();
        let err = attn
            .a2e_send(&x2, &i2.topk_idx, &i2.topk_weights)
            .unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "no wait for a credit"
        );
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("max_in_flight")),
            "{err}"
        );
        let mut out = vec![0f32; 32];
        attn.e2a_recv(&h1, &mut out).unwrap();
        let h3 = attn.a2e_send(&x2, &i2.topk_idx, &i2.topk_weights).unwrap();
        attn.e2a_recv(&h2, &mut out).unwrap();
        assert_eq!(first_difference(&out, &expected_of(1), 8), None);
        attn.e2a_recv(&h3, &mut out).unwrap();
        assert_eq!(first_difference(&out, &expected_of(2), 8), None);
        e.join().unwrap();
    });
}

#[test]
fn epochs_cross_the_40_bit_wire_boundary_without_harm() {
    let topo = Topology::contiguous(2, 2, 8).unwrap();
    let mut c = cfg(16, DType::BF16, 3, 8);
    c.epoch_base = (1 << 40) - 3;
    run_local::<bf16>(&topo, &c, &wl(32, 8, true), 8, BOTH).unwrap();
    c.max_in_flight = 3;
    c.epoch_base = (1 << 41) - 4;
    run_local::<bf16>(&topo, &c, &wl(33, 8, true), 8, BOTH).unwrap();
}

#[test]
fn a_wait_that_finds_a_peer_gone_after_an_abort_reached_it_reports_the_abort() {
    // Peers leave the job once they see an abort; a rank that slept through both the abort
    // and a departure must report the abort (the C ABI test saw the departure reported).
    let c = cfg(8, DType::F32, 2, 4);
    let (attn, expert) = pair(&c);
    drop(expert);
    let ctx = attn.ctx();
    let mut due = CheckDue::now();
    let gone = ctx.check_awaited([1], &mut due).unwrap_err();
    assert!(matches!(gone, Error::PeerFailed { peer: 1, .. }), "{gone}");
    ctx.fabric.abort("stop the job");
    for err in [
        ctx.check_awaited([1], &mut CheckDue::now()),
        ctx.check_awaited_again([1], &mut CheckDue::now(), &|_| true),
        ctx.all_done([1], &|_| Ok(false)).map(|_| ()),
    ] {
        let err = err.unwrap_err();
        assert!(matches!(err, Error::Aborted { by: 0, .. }), "{err}");
    }
}

#[test]
fn a_dead_peer_is_reported_while_waiting_for_another() {
    let topo = Topology::contiguous(1, 2, 4).unwrap();
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let dead = comms.pop().unwrap();
    let mut silent = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    drop(dead);
    let input = wl(34, 4, false).input(&topo, 2, 0, 0);
    let h = attn
        .a2e_send(&[0f32; 32], &input.topk_idx, &input.topk_weights)
        .unwrap();
    let start = std::time::Instant::now();
    let err = attn.e2a_recv(&h, &mut [0f32; 32]).unwrap_err();
    assert!(matches!(err, Error::PeerFailed { peer: 2, .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // Poisoned: the next call fails fast with the first error, not a misleading one.
    let err = attn
        .a2e_send(&[0f32; 32], &input.topk_idx, &input.topk_weights)
        .unwrap_err();
    assert!(matches!(err, Error::PeerFailed { peer: 2, .. }), "{err}");
    // And every peer is told: the silent expert's next call fails naming the dead rank, learnt
    // through rank 0's abort.
    let mut b = TokenBatch::new();
    let err = loop {
        match silent.a2e_recv_tokens(&mut b, &mut |_, _| {}) {
            Ok(()) => continue,
            Err(e) => break e,
        }
    };
    assert!(
        matches!(&err, Error::PeerFailed { peer: 2, detail } if detail.contains("rank 0's abort")),
        "{err}"
    );
    assert!(silent.poisoned().is_some());
}

#[test]
fn a_peer_gone_after_another_ranks_abort_is_reported_as_that_abort() {
    // Rank 1 noticed that rank 2 died, aborted with a death report naming it (what its poison
    // path sends), and left: a wait of rank 0 that then finds rank 1 gone (or times out on it)
    // reports rank 2, as every other survivor does.
    let topo = Topology::contiguous(1, 2, 4).unwrap();
    let comms = Communicator::local_group(&topo, &cfg(8, DType::F32, 2, 4)).unwrap();
    let dead = Error::PeerFailed {
        peer: 2,
        detail: "process 42 exited".into(),
    };
    comms[1]
        .ctx()
        .fabric
        .abort_reporting(dead.dead_rank(1), &dead.abort_reason(1));
    let attn = &comms[0];
    let left = Error::PeerFailed {
        peer: 1,
        detail: "process 43 exited after leaving the job".into(),
    };
    let timeout = Error::Timeout {
        peer: 1,
        what: "E2A rows".into(),
        waited: Duration::from_secs(1),
    };
    for e in [left, timeout] {
        match attn.first_failure(e) {
            Error::PeerFailed { peer: 2, detail } => assert!(detail.contains("rank 1's abort")),
            other => panic!("expected rank 2 named through rank 1's abort, got {other:?}"),
        }
    }
    // Its own account of the same death is kept; errors of another kind are not replaced.
    let own = attn.first_failure(Error::PeerFailed {
        peer: 2,
        detail: "seen here".into(),
    });
    assert!(matches!(&own, Error::PeerFailed { peer: 2, detail } if detail == "seen here"));
    let bad = Error::Protocol {
        peer: 1,
        detail: "bad record".into(),
    };
    assert!(matches!(
        attn.first_failure(bad),
        Error::Protocol { peer: 1, .. }
    ));
    // Without an abort from another rank nothing changes.
    let alone = Communicator::local_group(&topo, &cfg(8, DType::F32, 2, 4)).unwrap();
    let t = alone[0].first_failure(Error::Timeout {
        peer: 1,
        what: "E2A rows".into(),
        waited: Duration::from_secs(1),
    });
    assert!(matches!(t, Error::Timeout { peer: 1, .. }));
}

#[test]
fn a_user_abort_whose_text_reads_like_a_death_is_reported_as_that_abort_by_every_rank() {
    // Rank 1's user abort says "rank 0 died: ..." while rank 0 is alive: every rank, rank 0
    // included, reports an abort by rank 1 with that reason, never rank 0's failure, also for a
    // peer failure or timeout seen after it.
    let topo = Topology::contiguous(1, 2, 4).unwrap();
    let mut comms = Communicator::local_group(&topo, &cfg(8, DType::F32, 2, 4)).unwrap();
    let text = "rank 0 died: process 42 exited (noticed by rank 1)";
    comms[1].abort(text);
    let timeout = Error::Timeout {
        peer: 1,
        what: "E2A rows".into(),
        waited: Duration::from_secs(1),
    };
    let after = comms[2].first_failure(timeout);
    assert!(
        matches!(&after, Error::Aborted { by: 1, reason } if reason == text),
        "{after}"
    );
    let input = wl(34, 4, false).input(&topo, 2, 0, 0);
    let err = comms[0]
        .a2e_send(&[0f32; 32], &input.topk_idx, &input.topk_weights)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Aborted { by: 1, reason } if reason == text),
        "{err}"
    );
    let mut b = TokenBatch::new();
    let err = comms[2]
        .a2e_recv_tokens(&mut b, &mut |_, _| {})
        .unwrap_err();
    assert!(
        matches!(&err, Error::Aborted { by: 1, reason } if reason == text),
        "{err}"
    );
}

#[test]
fn a_timeout_before_anything_was_published_can_be_retried() {
    let mut c = cfg(8, DType::F32, 2, 4);
    c.timeout = Duration::from_millis(200);
    let (mut attn, mut expert) = pair(&c);
    let mut b = TokenBatch::new();
    let err = expert.a2e_recv_tokens(&mut b, &mut |_, _| {}).unwrap_err();
    assert!(matches!(err, Error::Timeout { peer: 0, .. }), "{err}");
    assert!(expert.poisoned().is_none());
    expert.set_timeout(Duration::from_secs(20)).unwrap();
    attn.set_timeout(Duration::from_secs(20)).unwrap();
    std::thread::scope(|s| {
        let e = serve(s, expert, 1);
        let (i0, x0) = input_of(0);
        let h = attn.a2e_send(&x0, &i0.topk_idx, &i0.topk_weights).unwrap();
        let mut out = vec![0f32; 32];
        attn.e2a_recv(&h, &mut out).unwrap();
        assert_eq!(first_difference(&out, &expected_of(0), 8), None);
        e.join().unwrap();
    });
}

#[test]
fn abort_reason_reaches_every_peer() {
    let c = cfg(8, DType::F32, 2, 4);
    let (mut attn, mut expert) = pair(&c);
    std::thread::scope(|s| {
        let e = s.spawn(move || {
            let mut b = TokenBatch::new();
            expert.a2e_recv_tokens(&mut b, &mut |_, _| {}).unwrap_err()
        });
        std::thread::sleep(Duration::from_millis(50));
        attn.abort("the scheduler drained this replica");
        let err = e.join().unwrap();
        assert!(
            matches!(&err, Error::Aborted { by: 0, reason } if reason.contains("drained this replica")),
            "{err}"
        );
    });
    let err = attn.a2e_send(&[0f32; 8], &[0, 1], &[0.5, 0.5]).unwrap_err();
    assert!(matches!(err, Error::Aborted { by: 0, .. }), "{err}");
}

#[test]
fn non_finite_gating_weights_are_rejected_before_any_write() {
    let err = rejected_then_clean_round(|c| {
        c.a2e_send(&[0f32; 16], &[0, 1, 2, 3], &[0.5, f32::NAN, 0.5, 0.5])
            .unwrap_err()
    });
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("token 0") && m.contains("slot 1")),
        "{err}"
    );
}

#[test]
fn a_record_addressing_rows_outside_its_region_is_a_protocol_error_naming_the_sender() {
    use crate::moe::record::Record;
    let c = cfg(8, DType::F32, 2, 4);
    let (mut attn, mut expert) = pair(&c);
    let (i0, x0) = input_of(0);
    let _h = attn.a2e_send(&x0, &i0.topk_idx, &i0.topk_weights).unwrap();
    // Rank 0's record at rank 1 now claims a reply offset past its E2A receive area: a valid
    // check word, a count within capacity, but rows attention_rows..attention_rows+1.
    let ctx = attn.ctx();
    let layout = &ctx.layout;
    let bad = Record::new(1, 1, layout.attention_rows as u32, TransferMode::Push);
    ctx.fabric
        .put(
            1,
            layout.record(0, layout.buffer(1)),
            bytemuck::bytes_of(&bad),
        )
        .unwrap();
    let rows = format!(
        "rows {}..{}",
        layout.attention_rows,
        layout.attention_rows + 1
    );
    let err = expert
        .a2e_recv_tokens(&mut TokenBatch::new(), &mut |_, _| {})
        .unwrap_err();
    assert!(
        matches!(&err, Error::Protocol { peer: 0, detail } if detail.contains(&rows)),
        "{err}"
    );
    assert!(expert.poisoned().is_some());
}

/// Sends [`input_of`] `round` from `attn`; returns the handle and the rows sent.
fn send_round(attn: &mut Communicator, round: u64) -> (crate::A2eHandle, Vec<f32>) {
    let (i, x) = input_of(round);
    let h = attn.a2e_send(&x, &i.topk_idx, &i.topk_weights).unwrap();
    (h, x)
}

/// The landing buffer rank 0's A2E record of `epoch` at rank 1 names.
fn landing_of(attn: &Communicator, epoch: u64) -> usize {
    use crate::moe::record::Record;
    let ctx = attn.ctx();
    let mut rec = Record::default();
    let at = ctx.layout.record(0, ctx.layout.buffer(epoch));
    ctx.fabric
        .get(1, at, bytemuck::bytes_of_mut(&mut rec))
        .unwrap();
    assert_eq!(rec.epoch, epoch);
    rec.landing()
}

/// The bits of the first row pushed into rank 1's receive area for rank 0, `buffer`.
fn first_landed_row(attn: &Communicator, buffer: usize) -> Vec<u32> {
    let ctx = attn.ctx();
    let mut row = vec![0u32; ctx.cfg.hidden];
    let at = ctx.layout.a2e_recv(0, buffer);
    ctx.fabric
        .get(1, at, bytemuck::cast_slice_mut(&mut row))
        .unwrap();
    row
}

#[test]
fn a_call_after_an_answered_one_lands_in_its_buffer_and_overlapping_calls_in_free_ones() {
    let c = cfg(8, DType::F32, 2, 4);
    assert_eq!(c.max_in_flight, 2);
    let (mut attn, mut expert) = pair(&c);
    let locals = [0usize, 1, 2, 3];
    let bits = |x: &[f32]| x[..8].iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut out = vec![0f32; 32];
    let reply = |expert: &mut Communicator| {
        let mut b = TokenBatch::new();
        expert.a2e_recv_tokens(&mut b, &mut |_, _| {}).unwrap();
        expert
            .e2a_send_tokens(&b, &token_replies::<f32>(&locals, &b))
            .unwrap();
    };
    // Back-to-back round trips: every call lands where the one before did (the rotation put
    // call 2 in buffer 1).
    for round in 0..3 {
        let (h, x) = send_round(&mut attn, round);
        assert_eq!(landing_of(&attn, round + 1), 0, "call {}", round + 1);
        assert_eq!(first_landed_row(&attn, 0), bits(&x), "call {}", round + 1);
        reply(&mut expert);
        attn.e2a_recv(&h, &mut out).unwrap();
        assert_eq!(first_difference(&out, &expected_of(round), 8), None);
    }
    // Two in flight: the second takes the free buffer; both come back right.
    let (h3, x3) = send_round(&mut attn, 3);
    let (h4, x4) = send_round(&mut attn, 4);
    assert_eq!((landing_of(&attn, 4), landing_of(&attn, 5)), (0, 1));
    assert_eq!(first_landed_row(&attn, 0), bits(&x3));
    assert_eq!(first_landed_row(&attn, 1), bits(&x4));
    reply(&mut expert);
    reply(&mut expert);
    attn.e2a_recv(&h3, &mut out).unwrap();
    assert_eq!(first_difference(&out, &expected_of(3), 8), None);
    attn.e2a_recv(&h4, &mut out).unwrap();
    assert_eq!(first_difference(&out, &expected_of(4), 8), None);
    // Both answered: the next call stays in the last one's buffer (the one the caches hold).
    let (h5, _) = send_round(&mut attn, 5);
    assert_eq!(landing_of(&attn, 6), 1);
    reply(&mut expert);
    attn.e2a_recv(&h5, &mut out).unwrap();
    assert_eq!(first_difference(&out, &expected_of(5), 8), None);
    assert!(attn.poisoned().is_none() && expert.poisoned().is_none());
}

#[test]
fn a_record_naming_a_landing_buffer_still_held_is_a_protocol_error_naming_the_sender() {
    use crate::moe::record::Record;
    let c = cfg(8, DType::F32, 2, 4);
    let (mut attn, mut expert) = pair(&c);
    let _call1 = send_round(&mut attn, 0);
    // The expert holds call 1's rows in buffer 0 (received, not replied to).
    let mut held = TokenBatch::new();
    expert.a2e_recv_tokens(&mut held, &mut |_, _| {}).unwrap();
    let _call2 = send_round(&mut attn, 1);
    assert_eq!(landing_of(&attn, 2), 1);
    // Call 2's record rewritten to name buffer 0, with a valid check word.
    let ctx = attn.ctx();
    let at = ctx.layout.record(0, ctx.layout.buffer(2));
    let mut rec = Record::default();
    ctx.fabric
        .get(1, at, bytemuck::bytes_of_mut(&mut rec))
        .unwrap();
    let bad = rec.landing_in(0);
    ctx.fabric.put(1, at, bytemuck::bytes_of(&bad)).unwrap();
    let err = expert
        .a2e_recv_tokens(&mut TokenBatch::new(), &mut |_, _| {})
        .unwrap_err();
    assert!(
        matches!(&err, Error::Protocol { peer: 0, detail }
            if detail.contains("epoch 2") && detail.contains("landing buffer 0")),
        "{err}"
    );
    assert!(expert.poisoned().is_some());
}

#[test]
fn a_view_reply_rejected_before_sending_keeps_the_view_and_a_replied_view_hands_out_no_rows() {
    let c = cfg(8, DType::F32, 2, 4);
    let (mut attn, mut expert) = pair(&c);
    let (i0, x0) = input_of(0);
    let h = attn.a2e_send(&x0, &i0.topk_idx, &i0.topk_weights).unwrap();
    let mut view = expert.a2e_recv_view().unwrap();
    let err = view
        .e2a_send::<bf16>(TransferMode::Push, |_, _, _| {})
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let meta = view.meta().clone();
    let locals = [0usize, 1, 2, 3];
    let replies: Vec<f32> = {
        let mut rows = Vec::new();
        for i in 0..view.num_tokens() {
            rows.extend_from_slice(view.row::<f32>(i).unwrap());
        }
        let mut with_rows = meta.clone();
        with_rows.rows.resize(rows.len() * 4);
        with_rows
            .rows
            .bytes_mut()
            .copy_from_slice(bytemuck::cast_slice(&rows));
        token_replies(&locals, &with_rows)
    };
    view.e2a_send::<f32>(TransferMode::Push, |i, _, out| {
        out.copy_from_slice(&replies[i * 8..(i + 1) * 8])
    })
    .unwrap();
    // Replied: the senders may overwrite the rows now, so the view hands none out.
    let stale = view.row::<f32>(0).unwrap_err();
    assert!(stale.to_string().contains("has replied"), "{stale}");
    drop(view);
    let mut out = vec![0f32; 32];
    attn.e2a_recv(&h, &mut out).unwrap();
    assert_eq!(first_difference(&out, &expected_of(0), 8), None);
}

fn int8_cfg(hidden: usize, dtype: DType, a2e: Quant, e2a: Quant) -> MoeConfig {
    let mut c = cfg(hidden, dtype, 3, 12);
    c.a2e_quant = a2e;
    c.e2a_quant = e2a;
    c
}

#[test]
fn int8_on_the_wire_matches_the_quantizing_reference_bit_for_bit() {
    let topo = TopologyBuilder::contiguous(3, 2, 8)
        .replicas(&[(0, 1)])
        .build()
        .unwrap();
    for (a2e, e2a) in [
        (Quant::Int8, Quant::None),
        (Quant::None, Quant::Int8),
        (Quant::Int8, Quant::Int8),
    ] {
        let c = int8_cfg(96, DType::BF16, a2e, e2a);
        run_local::<bf16>(&topo, &c, &wl(40, 12, true), 6, BOTH).unwrap();
        run_local_caps::<bf16>(&topo, &c, &wl(41, 12, true), 4, BOTH, false).unwrap();
        let c = int8_cfg(33, DType::F16, a2e, e2a);
        run_local::<f16>(&topo, &c, &wl(42, 12, true), 4, BOTH).unwrap();
        let c = int8_cfg(8192, DType::F32, a2e, e2a);
        run_local::<f32>(&topo, &c, &wl(43, 12, true), 2, BOTH).unwrap();
    }
}

#[test]
fn keep_int8_hands_out_the_rows_and_scales_of_the_quantizer() {
    use crate::testing::reference::quantize_int8;
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    for a2e in [Quant::Int8, Quant::None] {
        let mut c = int8_cfg(16, DType::BF16, a2e, Quant::None);
        c.keep_int8 = true;
        let mut comms = Communicator::local_group(&topo, &c).unwrap();
        let mut expert = comms.pop().unwrap();
        let mut attn = comms.pop().unwrap();
        let w = wl(44, 6, false);
        let input = w.input(&topo, 3, 0, 0);
        let x: Vec<bf16> = w.hidden_states(0, 0, input.num_tokens, 16);
        let _h = attn
            .a2e_send(&x, &input.topk_idx, &input.topk_weights)
            .unwrap();
        let mut batch = ExpertBatch::new();
        expert.a2e_recv(&mut batch).unwrap();
        assert!(batch.rows::<bf16>().unwrap().is_empty());
        let (q, scales) = batch.int8_rows().expect("kept as INT8");
        assert_eq!(q.len(), batch.num_rows() * 16);
        for r in 0..batch.num_rows() {
            let t = batch.src_token()[r] as usize;
            let wide: Vec<f32> = x[t * 16..(t + 1) * 16].iter().map(|v| v.to_f32()).collect();
            let (wq, ws) = quantize_int8(&wide);
            assert_eq!(&q[r * 16..(r + 1) * 16], &wq[..], "row {r} ({a2e:?})");
            assert_eq!(scales[r].to_bits(), ws.to_bits());
        }
    }
}

#[test]
fn int8_rejects_non_finite_hidden_states_naming_the_token_before_any_write() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let c = int8_cfg(8, DType::F32, Quant::Int8, Quant::None);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let mut x = vec![1f32; 16];
    x[8 + 3] = f32::NAN;
    let err = attn.a2e_send(&x, &[0, 1, 2, 3], &[0.5; 4]).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("token 1") && m.contains("at 3")),
        "{err}"
    );
    assert!(attn.poisoned().is_none());
    std::thread::scope(|s| {
        let e = s.spawn(move || {
            let mut b = TokenBatch::new();
            expert_round_tokens_with::<f32>(
                &mut expert,
                &wl(45, 4, false),
                0,
                &mut b,
                true,
                Buffers::Copy,
            )
            .unwrap()
            .unwrap();
        });
        attention_round::<f32>(&mut attn, &wl(45, 4, false), 0)
            .unwrap()
            .unwrap();
        e.join().unwrap();
    });
}

/// A2E and E2A records one round wrote, added over every rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RoundRecords {
    a2e: u64,
    e2a: u64,
    polled: u64,
    /// Bytes put to other ranks (records and rows, both directions).
    bytes: u64,
    /// The most bytes put over one link (one rank to one other rank).
    max_link: u64,
}

/// Runs `rounds` rounds through the paths relays support (push, caller buffers; experts
/// alternate expert-major and token-major receives) and checks every result against the
/// reference bit for bit (which the direct path matches too). Returns the records written per
/// round (the A2E ones are the round's total minus its E2A call's).
fn run_relayed<T: Element>(
    topo: &Topology,
    cfg: &MoeConfig,
    wl: &Workload,
    rounds: u64,
    load_store: bool,
) -> Result<Vec<RoundRecords>, String> {
    let caps = Capabilities {
        load_store,
        remote_read: true,
        chunk_floor: 0,
    };
    let comms = Communicator::local_group_with(topo, cfg, caps).map_err(|e| e.to_string())?;
    let per_rank = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || -> Result<Vec<RoundRecords>, String> {
                    let mut batch = ExpertBatch::new();
                    let mut tokens = TokenBatch::new();
                    let mut counts = Vec::new();
                    for round in 0..rounds {
                        let before = c.total_stats().clone();
                        let verdict = match c.role() {
                            Role::Attention if !c.topology().in_call(c.rank(), round) => {
                                // Not this rank's DP domain's turn.
                                counts.push(RoundRecords::default());
                                continue;
                            }
                            Role::Attention => attention_round::<T>(&mut c, wl, round),
                            Role::Expert if (round + c.rank() as u64).is_multiple_of(2) => {
                                expert_round::<T>(&mut c, wl, round, &mut batch, true)
                            }
                            Role::Expert => expert_round_tokens_with::<T>(
                                &mut c,
                                wl,
                                round,
                                &mut tokens,
                                true,
                                Buffers::Copy,
                            ),
                        };
                        verdict.map_err(|e| format!("rank {}: {e}", c.rank()))??;
                        let after = c.total_stats();
                        let all = after.records_written - before.records_written;
                        let e2a = c.last_call_stats().records_written;
                        // The totals start without peers: absent is zero.
                        let was = |p: usize| before.peers.get(p).map_or(0, |b| b.bytes_put);
                        let links = (after.peers.iter().enumerate())
                            .filter(|&(p, _)| p != c.rank())
                            .map(|(p, a)| a.bytes_put - was(p));
                        counts.push(RoundRecords {
                            a2e: all - e2a,
                            e2a,
                            polled: after.records_polled - before.records_polled,
                            bytes: links.clone().sum(),
                            max_link: links.max().unwrap_or(0),
                        });
                    }
                    Ok(counts)
                })
            })
            .collect();
        let results: Vec<Result<Vec<RoundRecords>, String>> = handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "rank panicked".to_string())?)
            .collect();
        // An error that is not an abort or a departure caused by another rank's failure explains it.
        let cause = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .filter(|e| !e.contains("aborted by") && !e.contains("endpoint was dropped"))
            .min_by_key(|e| e.len())
            .cloned();
        results
            .into_iter()
            .collect::<Result<Vec<_>, String>>()
            .map_err(|first| cause.unwrap_or(first))
    })?;
    Ok((0..rounds as usize)
        .map(|r| {
            per_rank
                .iter()
                .fold(RoundRecords::default(), |acc, c| RoundRecords {
                    a2e: acc.a2e + c[r].a2e,
                    e2a: acc.e2a + c[r].e2a,
                    polled: acc.polled + c[r].polled,
                    bytes: acc.bytes + c[r].bytes,
                    max_link: acc.max_link.max(c[r].max_link),
                })
        })
        .collect())
}

fn relayed(m: usize, n: usize, experts: usize, relays: usize) -> Topology {
    Topology::contiguous(m, n, experts)
        .unwrap()
        .with_relays(Some(relays))
        .unwrap()
}

#[test]
fn relays_match_the_direct_path_bit_for_bit_in_every_dtype() {
    for (m, n, e, r) in [(2, 3, 12, 1), (3, 2, 8, 2), (4, 5, 20, 5), (5, 3, 9, 2)] {
        let topo = relayed(m, n, e, r);
        let plan = topo.relay_plan().unwrap();
        let want = (m + r * n) as u64;
        let rec = run_relayed::<f32>(&topo, &cfg(40, DType::F32, 3, 9), &wl(70, 9, true), 4, true)
            .unwrap();
        for c in &rec {
            assert_eq!((c.a2e, c.e2a), (want, want), "{m}x{n} R={r}: {c:?}");
            assert_eq!(c.polled, 2 * want, "every record written is polled once");
        }
        assert_eq!(plan.records_per_call(m, n) as u64, want);
        run_relayed::<bf16>(
            &topo,
            &cfg(72, DType::BF16, 4, 7),
            &wl(71, 7, true),
            4,
            true,
        )
        .unwrap();
        run_relayed::<f16>(
            &topo,
            &cfg(33, DType::F16, 2, 6),
            &wl(72, 6, false),
            3,
            true,
        )
        .unwrap();
        run_relayed::<bf16>(
            &topo,
            &cfg(24, DType::BF16, 3, 8),
            &wl(73, 8, true),
            3,
            false,
        )
        .unwrap();
    }
}

#[test]
fn relays_forward_large_rows_in_chunks_and_many_rounds_in_flight() {
    let topo = relayed(3, 4, 16, 2);
    let mut c = cfg(3000, DType::F32, 4, 24);
    c.chunk_bytes = 4096;
    c.max_in_flight = 1;
    run_relayed::<f32>(&topo, &c, &wl(74, 24, true), 5, true).unwrap();
    let mut c = cfg(16, DType::BF16, 8, 16);
    c.max_in_flight = 3;
    c.epoch_base = crate::moe::progress::EPOCH_MASK - 3;
    run_relayed::<bf16>(&topo, &c, &wl(75, 16, true), 8, true).unwrap();
}

/// The relay reduces each expert rank's replies as their chunks land and streams the reduced
/// rows per chunk: chunks of one row and of a few rows with a partial last one, sources with no
/// tokens (the varying workload gives some), several members per relay, INT8 both ways and DP
/// domains, on mapped and unmapped windows; every result against the reference, bit for bit.
#[test]
fn relays_reduce_and_forward_replies_chunk_by_chunk_bit_for_bit() {
    for (m, n, e, r) in [(5, 3, 12, 1), (4, 4, 16, 2)] {
        let topo = relayed(m, n, e, r);
        for (hidden, chunk) in [(40, 100), (40, 250), (24, 1)] {
            let mut c = cfg(hidden, DType::BF16, 3, 9);
            c.chunk_bytes = chunk;
            for mapped in [true, false] {
                run_relayed::<bf16>(&topo, &c, &wl(150 + chunk as u64, 9, true), 4, mapped)
                    .unwrap();
            }
            let mut c = int8_cfg(hidden, DType::BF16, Quant::Int8, Quant::Int8);
            c.chunk_bytes = chunk;
            for mapped in [true, false] {
                run_relayed::<bf16>(&topo, &c, &wl(160 + chunk as u64, 12, true), 3, mapped)
                    .unwrap();
            }
        }
        let topo = Topology::contiguous(m, n, e)
            .unwrap()
            .with_relays(Some(r))
            .unwrap()
            .with_domains(2)
            .unwrap();
        let mut c = cfg(40, DType::F32, 3, 8);
        c.chunk_bytes = 300;
        c.max_in_flight = 1;
        run_relayed::<f32>(&topo, &c, &wl(170, 8, true), 6, true).unwrap();
    }
}

#[test]
fn relays_forward_int8_a2e_rows_as_they_are() {
    let topo = relayed(3, 2, 8, 1);
    let c = int8_cfg(96, DType::BF16, Quant::Int8, Quant::None);
    run_relayed::<bf16>(&topo, &c, &wl(76, 12, true), 4, true).unwrap();
    run_relayed::<bf16>(&topo, &c, &wl(77, 12, true), 3, false).unwrap();
}

#[test]
fn relays_at_32_by_48_with_one_some_and_every_expert_rank_relaying() {
    for r in [1, 2, 48] {
        let topo = relayed(32, 48, 96, r);
        let rec = run_relayed::<bf16>(
            &topo,
            &cfg(16, DType::BF16, 6, 4),
            &wl(78, 4, true),
            2,
            true,
        )
        .unwrap();
        assert_eq!(rec[0].a2e, (32 + r * 48) as u64);
    }
}

/// 160 attention ranks, 288 expert ranks (one expert each), K = 8, every result checked, the
/// records counted on the way. With R = 16 relays an A2E writes 160 + 16 x 288 = 4,768 records
/// against the direct path's 46,080: 10.35% (checked with the decode shape in
/// `decode_shape_160_by_288_direct_and_relayed_with_one_and_three_domains`; the "-90%" of the
/// design notes is rounded); R = 15 (4,480 records, 9.7%) meets a strict 10% bound.
#[test]
fn relays_at_160_by_288_write_about_a_tenth_of_the_direct_records() {
    let (m, n, r) = (160, 288, 15);
    let direct = (m * n) as u64;
    let topo = relayed(m, n, 288, r);
    let mut c = cfg(16, DType::BF16, 8, 2);
    c.max_in_flight = 1;
    c.timeout = Duration::from_secs(120);
    let start = std::time::Instant::now();
    let rec = run_relayed::<bf16>(&topo, &c, &wl(79, 2, false), 2, true).unwrap();
    for x in &rec {
        assert_eq!(x.a2e, (m + r * n) as u64);
        assert_eq!(x.e2a, (m + r * n) as u64);
        assert!(x.a2e * 10 <= direct, "{} records, direct {direct}", x.a2e);
    }
    eprintln!(
        "160x288 R={r}: {} A2E records per call (direct {direct}, {:.2}%), {} E2A; {:?} for \
         2 rounds",
        rec[0].a2e,
        100.0 * rec[0].a2e as f64 / direct as f64,
        rec[0].e2a,
        start.elapsed()
    );
}

#[test]
fn relays_reject_what_they_do_not_support_before_writing() {
    let topo = relayed(1, 2, 4, 1);
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut att = comms.remove(0);
    let x = vec![0f32; 8];
    let err = att
        .a2e_send_with(&x, &[0, 1], &[0.5, 0.5], TransferMode::Pull)
        .unwrap_err();
    assert!(
        err.to_string().contains("not supported through relays"),
        "{err}"
    );
    let err = att.a2e_input::<f32>().unwrap_err();
    assert!(
        err.to_string().contains("not supported through relays"),
        "{err}"
    );
    assert!(att.poisoned().is_none());
    let err = comms[0].a2e_recv_view().map(|_| ()).unwrap_err();
    assert!(
        err.to_string().contains("not supported through relays"),
        "{err}"
    );
    assert!(comms[0].poisoned().is_none());
}

#[test]
fn counters_add_up_between_peers_and_name_the_slowest() {
    let topo = relayed(2, 3, 6, 1);
    let c = cfg(8, DType::F32, 2, 4);
    let comms = Communicator::local_group(&topo, &c).unwrap();
    let wl = wl(80, 4, false);
    let stats = on_every_rank(comms, |mut c| {
        let mut batch = ExpertBatch::new();
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(30));
        }
        match c.role() {
            Role::Attention => attention_round::<f32>(&mut c, &wl, 0),
            Role::Expert => expert_round::<f32>(&mut c, &wl, 0, &mut batch, true),
        }
        .unwrap()
        .unwrap();
        c.total_stats().clone()
    });
    let relay = topo.relay_plan().unwrap().relays()[0];
    for a in 0..2 {
        assert_eq!(
            stats[a].peers[relay].rows_sent,
            stats[relay].peers[a].rows_received
        );
        assert!(stats[a].peers[relay].bytes_put > 0);
        for d in [2, 3, 4] {
            if d != relay {
                assert_eq!(stats[a].peers[d], Default::default(), "fan-out 1");
            }
        }
    }
    // A load/store fabric: every rank reads its rows and replies where they landed on the relay.
    assert_eq!(stats[relay].relay_rows_forwarded, 0);
    // The relay waited for attention rank 1 (30 ms late) far longer than for anyone else.
    assert_eq!(stats[relay].slowest_peer().unwrap().0, 1);
    assert!(stats[relay].peers[1].waited >= Duration::from_millis(20));
}

/// One relayed round at 1A:2E (rank 1 the relay) on a local fabric with or without
/// `load_store`, every result checked; returns each rank's total stats.
fn relayed_round_stats(load_store: bool, rounds: u64) -> Vec<crate::Stats> {
    let topo = relayed(1, 2, 4, 1);
    assert_eq!(topo.relay_plan().unwrap().relays(), &[1]);
    let c = cfg(1024, DType::F32, 2, 8);
    let caps = Capabilities {
        load_store,
        remote_read: true,
        chunk_floor: 0,
    };
    let comms = Communicator::local_group_with(&topo, &c, caps).unwrap();
    let wl = wl(81, 8, false);
    on_every_rank(comms, |mut c| {
        let mut batch = ExpertBatch::new();
        for round in 0..rounds {
            match c.role() {
                Role::Attention => attention_round::<f32>(&mut c, &wl, round),
                Role::Expert => expert_round::<f32>(&mut c, &wl, round, &mut batch, true),
            }
            .unwrap()
            .unwrap();
        }
        c.total_stats().clone()
    })
}

#[test]
fn ranks_that_map_the_relays_window_read_their_rows_and_replies_there_and_nothing_is_forwarded() {
    let row = 1024 * 4;
    // Load/store: the relay puts only its header to rank 2 (the A2E rows stay in its member
    // area) and only records to the attention rank, which sums its replies where they landed
    // on the relay.
    let stats = relayed_round_stats(true, 3);
    let (to_other, to_member) = (stats[1].peers[2].bytes_put, stats[1].peers[0].bytes_put);
    assert!(to_other < 3 * 256, "{to_other} bytes put to rank 2");
    assert!(
        to_member < 3 * 256,
        "{to_member} bytes put to the attention rank"
    );
    assert_eq!(stats[1].relay_rows_forwarded, 0);
    // Without it the relay forwards rank 2's rows and one reduced row per token, and still
    // reads its own rows where they are.
    let stats = relayed_round_stats(false, 3);
    let rows_to_2 = stats[2].peers[1].rows_received;
    assert!(rows_to_2 > 0);
    assert!(stats[1].peers[2].bytes_put >= rows_to_2 * row as u64);
    assert!(stats[1].peers[0].bytes_put >= 3 * 8 * row as u64);
    assert_eq!(stats[1].relay_rows_forwarded, 3 * 8 + rows_to_2);
}

/// Round 0 of a 1A:2E job through relay rank 1, f32, H=16, halfway: the attention rank's A2E
/// and the relay's receive, then `mid` (given the attention rank), then rank 2's whole round and
/// the relay's E2A. Returns the communicators (attention, relay, other expert rank) and the
/// attention rank's E2A receive, which checks its result against the reference.
#[allow(clippy::type_complexity)]
fn relayed_round_until_the_attention_receives(
    seed: u64,
    mid: impl FnOnce(&Communicator),
) -> ([Communicator; 3], Box<dyn FnOnce(&mut Communicator)>) {
    let topo = relayed(1, 2, 4, 1);
    let c = cfg(16, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let (mut other, mut relay, mut att) = (comms.remove(2), comms.remove(1), comms.remove(0));
    let wl = wl(seed, 4, false);
    let call = RelayedCall::send(&topo, &wl, 16, &mut att, &mut relay);
    mid(&att);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut b = ExpertBatch::new();
            expert_round::<f32>(&mut other, &wl, 0, &mut b, true)
                .unwrap()
                .unwrap();
        });
        relay.e2a_send(&call.batch, &call.relay_outputs()).unwrap();
    });
    let receive = move |att: &mut Communicator| call.receive(att);
    ([att, relay, other], Box::new(receive))
}

/// One relayed call of `Workload` `wl` at 1A:2E (rank 1 the relay) from its A2E until the
/// attention rank receives the combine.
struct RelayedCall {
    topo: Topology,
    input: crate::testing::reference::RankInput,
    x: Vec<f32>,
    h: usize,
    handle: crate::A2eHandle,
    /// The relay's received rows.
    batch: ExpertBatch,
}

impl RelayedCall {
    /// The attention rank sends call 0 of `wl`; the relay receives its rows.
    fn send(
        topo: &Topology,
        wl: &Workload,
        h: usize,
        att: &mut Communicator,
        relay: &mut Communicator,
    ) -> Self {
        let input = wl.input(topo, 2, 0, 0);
        let x: Vec<f32> = wl.hidden_states(0, 0, input.num_tokens, h);
        let handle = att
            .a2e_send(&x, &input.topk_idx, &input.topk_weights)
            .unwrap();
        let mut batch = ExpertBatch::new();
        relay.a2e_recv(&mut batch).unwrap();
        RelayedCall {
            topo: topo.clone(),
            input,
            x,
            h,
            handle,
            batch,
        }
    }

    /// The relay's replies: the test experts' outputs for its rows.
    fn relay_outputs(&self) -> Vec<f32> {
        use crate::testing::reference::expert_output;
        let (rows, h): (&[f32], usize) = (self.batch.rows().unwrap(), self.h);
        let mut out = Vec::with_capacity(rows.len());
        for (j, &e) in self.topo.local_experts(1).iter().enumerate() {
            for r in self.batch.expert_rows(j) {
                out.extend(expert_output(&test_expert, e, &rows[r * h..(r + 1) * h]));
            }
        }
        out
    }

    /// The attention rank receives the combine, bit for bit the reference's.
    fn receive(self, att: &mut Communicator) {
        use crate::testing::reference::expected_combine_quant;
        let h = self.h;
        let mut got = vec![0f32; self.input.num_tokens * h];
        att.e2a_recv(&self.handle, &mut got).unwrap();
        let (q, n) = (&test_expert, Quant::None);
        let want = expected_combine_quant(&self.topo, &self.input, &self.x, h, q, n, n);
        assert_eq!(first_difference(&got, &want, h), None);
    }
}

#[test]
fn a_relay_frees_its_members_buffers_only_once_the_ranks_reading_there_have_credited() {
    // The attention rank's A2E credit from the relay (rank 1).
    let credit = |att: &Communicator| {
        let ctx = att.ctx();
        ctx.slot_value(ctx.slots.a2e_credit(1))
    };
    // The relay received and kept rank 2's rows in its member area: no credit yet.
    let ([mut att, ..], receive) = relayed_round_until_the_attention_receives(82, |att| {
        assert_eq!(credit(att), 0, "credited before rank 2 read its rows");
    });
    assert_eq!(credit(&att), 1, "credited once rank 2 had read and replied");
    receive(&mut att);
}

#[test]
fn a_relay_credits_the_expert_ranks_replies_only_once_its_members_have_summed_them() {
    // Rank 2's E2A credit from the relay (rank 1).
    let credit = |other: &Communicator| {
        let ctx = other.ctx();
        ctx.slot_value(ctx.slots.e2a_credit(1))
    };
    let (mut comms, receive) = relayed_round_until_the_attention_receives(83, |_| {});
    // Every token is complete, and the attention rank has not summed them yet.
    assert_eq!(
        credit(&comms[2]),
        0,
        "credited before the member summed its replies"
    );
    receive(&mut comms[0]);
    // The credit goes out with the relay's next E2A.
    let wl = wl(83, 4, false);
    on_every_rank(comms.iter_mut().collect(), |c| {
        let mut b = ExpertBatch::new();
        match c.role() {
            Role::Attention => attention_round::<f32>(c, &wl, 1),
            Role::Expert => expert_round::<f32>(c, &wl, 1, &mut b, true),
        }
        .unwrap()
        .unwrap();
    });
    assert!(credit(&comms[2]) >= 1);
}

#[test]
fn a_relay_header_with_unknown_flags_or_rows_outside_the_members_area_names_the_relay() {
    use crate::moe::record::{Record, WireMode};
    use crate::moe::relay::{entries_hash, read_header};
    let topo = relayed(1, 2, 4, 1);
    let c = cfg(16, DType::F32, 2, 4);
    let comms = Communicator::local_group(&topo, &c).unwrap();
    let ctx = comms[2].ctx();
    let rows = ctx.layout.attention_rows;
    // (count, offset, flags): the rows in place on the relay must lie in the member's area.
    for (count, offset, flags, says) in [
        (2, 0, 4, "unknown flags 0x4"),
        (2, rows - 1, 2, "has 2 rows at offset"),
        (2, 0, 2, ""),
    ] {
        let mut entry = [0u8; 24];
        for (w, v) in entry.chunks_exact_mut(4).zip([count, offset as u32, flags]) {
            w.copy_from_slice(&v.to_le_bytes());
        }
        let at = ctx.layout.relay_header(0, ctx.layout.buffer(1));
        let rec = Record::new(1, count, entries_hash(&entry), WireMode::Push);
        ctx.put(2, at + 32, &entry).unwrap();
        ctx.put_record(2, at, &rec).unwrap();
        let (mut out, mut bytes) = (Vec::new(), Vec::new());
        match read_header(ctx, (1, 0), 1, &mut out, &mut bytes) {
            Err(Error::Protocol { peer: 1, detail }) => {
                assert!(!says.is_empty() && detail.contains(says), "{detail}")
            }
            Ok(_) => assert!(says.is_empty() && out[0].in_place && out[0].offset == 0),
            Err(e) => panic!("{e}"),
        }
    }
}

/// Runs `rounds` calls with DP domains: every expert rank takes part in every call, an attention
/// rank only in its domain's turns. Every mode, layout and buffer kind, checked bit for bit; each
/// expert-major and token-major batch is checked to hold rows of the call's domain only.
fn run_domains<T: Element>(
    topo: &Topology,
    cfg: &MoeConfig,
    wl: &Workload,
    rounds: u64,
) -> Result<(), String> {
    let comms = Communicator::local_group(topo, cfg).map_err(|e| e.to_string())?;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || -> Result<(), String> {
                    let mut batch = ExpertBatch::new();
                    let mut tokens = TokenBatch::new();
                    let topo = c.topology().clone();
                    for round in 0..rounds {
                        c.set_mode(BOTH[(round as usize + c.rank()) % 2]);
                        let buffers = if (round + c.rank() as u64) % 3 == 1 {
                            Buffers::Registered
                        } else {
                            Buffers::Copy
                        };
                        let domain: Vec<u32> = topo
                            .call_sources(round)
                            .iter()
                            .map(|&i| topo.attention_ranks()[i] as u32)
                            .collect();
                        let one_domain = |sources: &[crate::SourceInfo]| match sources
                            .iter()
                            .find(|s| s.count() > 0 && !domain.contains(&(s.rank() as u32)))
                        {
                            Some(s) => Err(format!(
                                "round {round}: rows of rank {} outside domain {domain:?}",
                                s.rank()
                            )),
                            None => Ok(()),
                        };
                        let verdict = match c.role() {
                            Role::Attention if !topo.in_call(c.rank(), round) => continue,
                            Role::Attention => {
                                attention_round_with::<T>(&mut c, wl, round, buffers)
                            }
                            Role::Expert if (round + c.rank() as u64).is_multiple_of(2) => {
                                expert_round::<T>(&mut c, wl, round, &mut batch, true)
                                    .map(|v| v.and_then(|()| one_domain(batch.sources())))
                            }
                            Role::Expert if (round + c.rank() as u64) % 4 == 1 => {
                                expert_round_view::<T>(&mut c, wl, round, true)
                            }
                            Role::Expert => expert_round_tokens_with::<T>(
                                &mut c,
                                wl,
                                round,
                                &mut tokens,
                                true,
                                buffers,
                            )
                            .map(|v| v.and_then(|()| one_domain(tokens.sources()))),
                        };
                        verdict.map_err(|e| format!("rank {}: {e}", c.rank()))??;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "rank panicked".to_string())?)
            .collect::<Result<Vec<()>, String>>()
            .map(|_| ())
    })
}

#[test]
fn dp_domains_take_turns_and_match_the_reference_bit_for_bit() {
    for d in [1, 2, 3] {
        let topo = Topology::contiguous(6, 3, 12)
            .unwrap()
            .with_domains(d)
            .unwrap();
        let mut c = cfg(40, DType::BF16, 3, 10);
        c.max_in_flight = 1;
        run_domains::<bf16>(&topo, &c, &wl(90 + d as u64, 10, true), 12).unwrap();
        let mut c = cfg(24, DType::F32, 4, 8);
        c.max_in_flight = 1;
        run_domains::<f32>(&topo, &c, &wl(95 + d as u64, 8, true), 9).unwrap();
        let mut c = int8_cfg(64, DType::F16, Quant::Int8, Quant::Int8);
        c.max_in_flight = 1;
        run_domains::<f16>(&topo, &c, &wl(99 + d as u64, 12, true), 6).unwrap();
    }
}

/// Window bytes per rank with D = 1, 2, 3 domains at 160 x 288 (attention ranks grouped in
/// domains of 160 / D here, to show the expert-side saving) and at the deployment shape of 3
/// domains of 160 attention ranks.
#[test]
fn dp_domains_size_expert_windows_for_one_domain() {
    let mut c = cfg(7168, DType::BF16, 8, 64);
    c.max_in_flight = 1;
    let mut last = usize::MAX;
    for (m, d) in [(160, 1), (160, 2), (160, 3), (480, 1), (480, 3)] {
        let topo = Topology::contiguous(m, 288, 288)
            .unwrap()
            .with_domains(d)
            .unwrap();
        let lens = Communicator::window_lens(&topo, &c).unwrap();
        let (att, exp) = (lens[0], lens[m]);
        eprintln!(
            "M={m} N=288 D={d}: window bytes per attention rank {att}, per expert rank {exp} \
             ({:.1} MiB)",
            exp as f64 / (1 << 20) as f64
        );
        if m == 160 {
            assert!(exp < last, "expert windows shrink with D");
            last = exp;
        }
    }
    let topo = Topology::contiguous(3, 2, 4)
        .unwrap()
        .with_domains(3)
        .unwrap();
    let two = cfg(8, DType::F32, 2, 4);
    assert!(
        Communicator::local_group(&topo, &two).is_err(),
        "domains need max_in_flight 1"
    );
}

#[test]
fn relays_with_dp_domains_match_the_reference() {
    for (m, n, r, d) in [(3, 2, 2, 3), (6, 4, 2, 2), (5, 3, 1, 3)] {
        let topo = Topology::contiguous(m, n, 4 * n)
            .unwrap()
            .with_relays(Some(r))
            .unwrap()
            .with_domains(d)
            .unwrap();
        let mut c = cfg(32, DType::BF16, 3, 8);
        c.max_in_flight = 1;
        let rec = run_relayed::<bf16>(&topo, &c, &wl(110, 8, true), 9, true).unwrap();
        for (round, x) in rec.iter().enumerate() {
            let members = topo.call_sources(round as u64).len();
            assert_eq!(x.a2e, (members + r * n) as u64, "round {round}");
        }
    }
}

/// The xDeepServe decode shape: 160 attention ranks and 288 expert ranks; 256 routed experts
/// (one per rank on the first 256 expert ranks), one shared expert (id 256) with a replica on
/// each of the last 32 expert ranks, and the 16 hottest routed experts (0..16 under a Zipf skew)
/// replicated there too.
fn decode_shape(relays: usize, domains: usize) -> Topology {
    let (m, n) = (160, 288);
    let mut roles = vec![Role::Attention; m];
    roles.extend(vec![Role::Expert; n]);
    let mut map: Vec<Vec<usize>> = (0..256).map(|e| vec![m + e]).collect();
    for (e, hosts) in map.iter_mut().enumerate().take(16) {
        hosts.push(m + 256 + e);
    }
    map.push((m + 256..m + n).collect());
    let t = TopologyBuilder::new(roles, 257)
        .placement(map)
        .build()
        .unwrap();
    let t = if relays > 0 {
        t.with_relays(Some(relays)).unwrap()
    } else {
        t
    };
    t.with_domains(domains).unwrap()
}

/// The peak resident set of this process so far (`VmHWM`), in KiB.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// The CloudMatrix384 decode shape end to end on the local fabric (448 ranks as threads):
/// K = 8 routed experts of 256 plus the shared one, hot-expert replicas, H = 64, 4 tokens per
/// attention rank; direct and with 16 relays, with D = 1 and 3 DP domains. Every result is
/// checked against the reference bit for bit; the counted records match the plan; the
/// counters and window bytes are printed (`--nocapture`).
#[test]
fn decode_shape_160_by_288_direct_and_relayed_with_one_and_three_domains() {
    let wl = Workload {
        seed: 160_288,
        tokens: 4,
        vary: false,
        skew: Some(1.1),
        shared_experts: 1,
    };
    for (relays, domains) in [(0, 1), (16, 1), (0, 3), (16, 3)] {
        let topo = decode_shape(relays, domains);
        let mut c = cfg(64, DType::BF16, 9, 4);
        c.max_in_flight = 1;
        c.timeout = Duration::from_secs(120);
        let lens = Communicator::window_lens(&topo, &c).unwrap();
        let start = std::time::Instant::now();
        let rounds = if domains == 1 { 2 } else { domains as u64 };
        let rec = run_relayed::<bf16>(&topo, &c, &wl, rounds, true).unwrap();
        let elapsed = start.elapsed();
        for (round, x) in rec.iter().enumerate() {
            let m = (0..160).filter(|&a| topo.in_call(a, round as u64)).count() as u64;
            let want = if relays == 0 { m * 288 } else { m + 16 * 288 };
            assert_eq!(
                (x.a2e, x.e2a),
                (want, want),
                "R={relays} D={domains}: {x:?}"
            );
            if relays > 0 && domains == 1 {
                // 4,768 of 46,080: within 10.4% of the direct path's records.
                assert!(x.a2e * 1000 <= 160 * 288 * 104, "{x:?}");
            }
        }
        let relay_ranks = topo.relay_plan().map_or(vec![], |p| p.relays().to_vec());
        let expert_max = (160..448)
            .filter(|r| !relay_ranks.contains(r))
            .map(|r| lens[r])
            .max()
            .unwrap();
        let relay_max = relay_ranks.iter().map(|&r| lens[r]).max().unwrap_or(0);
        eprintln!(
            "160x288 R={relays} D={domains}: per call {} A2E / {} E2A records, {} bytes put, \
             busiest link {} bytes; window bytes: attention {}, expert {expert_max}, relay \
             {relay_max}; {rounds} rounds in {elapsed:?}; peak RSS {} MiB",
            rec[0].a2e,
            rec[0].e2a,
            rec[0].bytes,
            rec[0].max_link,
            lens[0],
            peak_rss_kib() / 1024
        );
    }
}

/// INT8 E2A through relays: the relay dequantizes its expert ranks' INT8 replies, sums them in
/// f32 in the direct path's order and quantizes the sum once more; the attention rank gets the
/// reference's bits (which replay that), in every dtype, with and without INT8 A2E.
#[test]
fn relays_reduce_int8_replies_and_requantize_once_bit_for_bit() {
    for (m, n, e, r) in [(3, 2, 8, 1), (4, 5, 20, 2), (2, 3, 12, 3)] {
        let topo = relayed(m, n, e, r);
        for a2e in [Quant::None, Quant::Int8] {
            let c = int8_cfg(96, DType::BF16, a2e, Quant::Int8);
            run_relayed::<bf16>(&topo, &c, &wl(120 + r as u64, 12, true), 4, true).unwrap();
            let c = int8_cfg(33, DType::F16, a2e, Quant::Int8);
            run_relayed::<f16>(&topo, &c, &wl(130 + r as u64, 7, true), 3, false).unwrap();
            let c = int8_cfg(40, DType::F32, a2e, Quant::Int8);
            run_relayed::<f32>(&topo, &c, &wl(140 + r as u64, 9, true), 3, true).unwrap();
        }
    }
}

/// A receive capacity below the worst case shrinks every expert window; a call that would send
/// more rows than that to one expert rank fails before writing anything (naming the rank), and
/// the next call goes through and matches the reference. Direct and through a relay.
#[test]
fn a_receive_capacity_below_the_worst_case_is_a_clear_error_never_an_overflow() {
    use crate::testing::reference::{expert_output, RankInput};
    for relays in [0, 1] {
        let topo = match relays {
            0 => Topology::contiguous(1, 2, 4).unwrap(),
            r => relayed(1, 2, 4, r),
        };
        let mut c = cfg(8, DType::F32, 2, 256);
        let worst = Communicator::window_lens(&topo, &c).unwrap();
        c.recv_capacity = 3;
        let capped = Communicator::window_lens(&topo, &c).unwrap();
        assert!(capped[1] < worst[1], "{capped:?} against {worst:?}");
        let mut comms = Communicator::local_group(&topo, &c).unwrap();
        let mut attn = comms.remove(0);
        std::thread::scope(|s| {
            for mut e in comms {
                s.spawn(move || {
                    let mut b = ExpertBatch::new();
                    e.a2e_recv(&mut b).unwrap();
                    let rows = b.rows::<f32>().unwrap().to_vec();
                    let locals = e.topology().local_experts(e.rank()).to_vec();
                    let mut out = Vec::new();
                    for (j, &x) in locals.iter().enumerate() {
                        for r in b.expert_rows(j) {
                            out.extend(expert_output(&test_expert, x, &rows[r * 8..(r + 1) * 8]));
                        }
                    }
                    e.e2a_send(&b, &out).unwrap();
                });
            }
            let x: Vec<f32> = (0..32).map(|i| i as f32 * 0.25 - 3.0).collect();
            let w = [0.5f32; 8];
            // Four tokens for expert rank 1 (experts 0 and 1): one more than it can hold.
            let over = [0, 1, 0, 1, 0, 1, 1, 0];
            let err = attn.a2e_send(&x, &over, &w).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m)
                    if m.contains("4 rows to expert rank 1") && m.contains("capacity of 3")),
                "{err}"
            );
            assert!(attn.poisoned().is_none());
            // Three rows for each expert rank: fits.
            let fits = vec![0, 2, 1, 3, 0, 1, 2, 3];
            let h = attn.a2e_send(&x, &fits, &w).unwrap();
            let mut out = vec![0f32; 32];
            attn.e2a_recv(&h, &mut out).unwrap();
            let input = RankInput {
                rank: 0,
                num_tokens: 4,
                k: 2,
                topk_idx: fits,
                topk_weights: w.to_vec(),
            };
            let want = expected_combine_exact(&topo, &input, &x, 8, &test_expert);
            assert_eq!(first_difference(&out, &want, 8), None);
        });
    }
}

/// Through a relay, one call's INT8 and dtype replies cannot be mixed: the relay fails naming
/// an expert rank and the setting, and every rank learns of it.
#[test]
fn relays_reject_expert_ranks_that_disagree_on_int8_replies() {
    let topo = relayed(1, 2, 4, 1);
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut attn = comms.remove(0);
    comms[1].set_e2a_quant(Quant::Int8);
    let errors: Vec<Error> = std::thread::scope(|s| {
        let experts: Vec<_> = comms
            .into_iter()
            .map(|mut e| {
                s.spawn(move || {
                    let mut b = ExpertBatch::new();
                    e.a2e_recv(&mut b).unwrap();
                    let out = vec![0.5f32; b.num_rows() * 8];
                    e.e2a_send(&b, &out).err()
                })
            })
            .collect();
        let x = vec![1.0f32; 32];
        let h = attn
            .a2e_send(&x, &[0, 2, 1, 3, 0, 3, 1, 2], &[0.5; 8])
            .unwrap();
        let mut out = vec![0f32; 32];
        let mut errors = vec![attn.e2a_recv(&h, &mut out).unwrap_err()];
        errors.extend(experts.into_iter().filter_map(|h| h.join().unwrap()));
        errors
    });
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, Error::Protocol { detail, .. }
            if detail.contains("same e2a_quant"))),
        "{errors:?}"
    );
}

/// An interrupt check that turns true after `after`.
fn interrupt_after(after: Duration) -> std::sync::Arc<dyn Fn() -> bool + Send + Sync> {
    let start = std::time::Instant::now();
    std::sync::Arc::new(move || start.elapsed() >= after)
}

#[test]
fn an_interrupt_stops_a_wait_that_published_nothing_and_the_call_can_be_retried() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    // The expert waits for an A2E that nobody sends: the interrupt ends it, naming the peer.
    expert.set_interrupt_check(Some(interrupt_after(Duration::from_millis(50))));
    let start = std::time::Instant::now();
    let err = expert.a2e_recv(&mut ExpertBatch::new()).unwrap_err();
    assert!(matches!(err, Error::Interrupted { peer: 0, .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert!(expert.poisoned().is_none(), "nothing was published");
    expert.set_interrupt_check(None);
    // The same call again, now with a sender: a normal round.
    let w = wl(13, 4, false);
    std::thread::scope(|s| {
        let e = s.spawn(move || {
            let mut b = ExpertBatch::new();
            expert_round::<f32>(&mut expert, &w, 0, &mut b, true)
                .unwrap()
                .unwrap()
        });
        attention_round::<f32>(&mut attn, &wl(13, 4, false), 0)
            .unwrap()
            .unwrap();
        e.join().unwrap();
    });
}

#[test]
fn an_interrupted_e2a_receive_is_retryable_and_an_interrupt_after_publishing_poisons() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let c = cfg(8, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let handle = attn
        .a2e_send(&[1f32; 16], &[0, 1, 2, 3], &[0.5; 4])
        .unwrap();
    let mut batch = ExpertBatch::new();
    expert.a2e_recv(&mut batch).unwrap();
    // No reply yet: the attention rank's E2A receive waits (publishing nothing) until
    // interrupted, and stays retryable.
    attn.set_interrupt_check(Some(interrupt_after(Duration::from_millis(30))));
    let mut out = [0f32; 16];
    let err = attn.e2a_recv(&handle, &mut out).unwrap_err();
    assert!(matches!(err, Error::Interrupted { peer: 1, .. }), "{err}");
    assert!(attn.poisoned().is_none());
    let rows = batch.rows::<f32>().unwrap().to_vec();
    expert.e2a_send(&batch, &rows).unwrap();
    attn.set_interrupt_check(None);
    attn.e2a_recv(&handle, &mut out).unwrap();
    // A barrier signals every peer before it waits: interrupted there, the call had published,
    // so the communicator is poisoned and the peer's next call fails with the abort.
    attn.set_interrupt_check(Some(interrupt_after(Duration::from_millis(30))));
    let err = attn.barrier().unwrap_err();
    assert!(matches!(err, Error::Interrupted { peer: 1, .. }), "{err}");
    assert!(
        matches!(attn.poisoned(), Some(Error::Interrupted { .. })),
        "{:?}",
        attn.poisoned()
    );
    let err = expert.a2e_recv(&mut batch).unwrap_err();
    assert!(matches!(err, Error::Aborted { by: 0, .. }), "{err}");
}

/// `check_open_calls` (what `xcclCommGetAsyncError` reports): a peer that left is an error
/// only while an unanswered call of this rank needs it, naming the peer and the epoch.
#[test]
fn a_peer_that_left_fails_the_open_call_check_only_while_a_call_needs_it() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let c = cfg(8, DType::F32, 2, 4);
    // Attention rank holding an unanswered handle; the expert rank leaves.
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let (x, idx, w) = (vec![1.0f32; 8], vec![0i32, 1], vec![0.5f32, 0.5]);
    let h = attn.a2e_send(&x, &idx, &w).unwrap();
    let mut b = ExpertBatch::new();
    expert.a2e_recv(&mut b).unwrap();
    attn.check_open_calls().unwrap();
    expert.check_open_calls().unwrap();
    drop(expert);
    match attn.check_open_calls() {
        Err(Error::PeerFailed { peer: 1, detail }) => {
            assert!(detail.contains(&format!("epoch {}", h.epoch())), "{detail}")
        }
        other => panic!("expected the expert rank named, got {other:?}"),
    }
    assert!(attn.poisoned().is_none(), "the check changes nothing");
    // Expert rank holding an unreplied batch; the attention rank leaves.
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    let _h = attn.a2e_send(&x, &idx, &w).unwrap();
    expert.a2e_recv(&mut b).unwrap();
    drop(attn);
    assert!(matches!(
        expert.check_open_calls(),
        Err(Error::PeerFailed { peer: 0, .. })
    ));
    // Nothing open: a peer that left is the normal end, not an error.
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let expert = comms.pop().unwrap();
    let attn = comms.pop().unwrap();
    drop(expert);
    attn.check_open_calls().unwrap();
}

/// Failure-state holes of E2A replies and dropped handles (issue 18): a 2A:1E job over the
/// local fabric with INT8 replies, each attention rank sending 3 tokens of `hidden` 8 f32.
mod reply_holes {
    use super::*;
    use crate::testing::reference::quantize_int8;

    const H: usize = 8;

    fn job() -> Vec<Communicator> {
        let topo = Topology::contiguous(2, 1, 4).unwrap();
        let mut c = cfg(H, DType::F32, 1, 4);
        c.e2a_quant = Quant::Int8;
        Communicator::local_group(&topo, &c).unwrap()
    }

    /// Attention rank `a`'s hidden states (3 tokens).
    fn x_of(a: usize) -> Vec<f32> {
        (0..3 * H)
            .map(|i| (a * 100 + i) as f32 * 0.37 - 5.0)
            .collect()
    }

    /// The expert's reply to a hidden state row.
    fn reply(x: &[f32], out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(x) {
            *o = v * 0.5 + 1.0;
        }
    }

    /// What attention rank `a` must get: each token's reply quantized and dequantized (one
    /// contribution, f32: no rounding after the dequantization).
    fn expected(a: usize) -> Vec<f32> {
        let x = x_of(a);
        let mut out = Vec::new();
        for row in x.chunks(H) {
            let mut r = [0f32; H];
            reply(row, &mut r);
            let (q, scale) = quantize_int8(&r);
            out.extend(q.iter().map(|&v| v as f32 * scale));
        }
        out
    }

    /// Both attention ranks send; returns their handles.
    fn send(comms: &mut [Communicator]) -> Vec<crate::A2eHandle> {
        (0..2)
            .map(|a| comms[a].a2e_send(&x_of(a), &[0, 1, 2], &[1.0; 3]).unwrap())
            .collect()
    }

    /// Nothing of the E2A reached either attention rank, and neither is poisoned.
    fn nothing_arrived(comms: &mut [Communicator], handles: &[crate::A2eHandle]) {
        for a in 0..2 {
            assert!(
                !comms[a].e2a_ready(&handles[a]).unwrap(),
                "attention rank {a} already has rows of the failed reply"
            );
            assert!(comms[a].poisoned().is_none());
        }
    }

    /// Both attention ranks receive the reference bit for bit.
    fn both_receive(comms: &mut [Communicator], handles: &[crate::A2eHandle]) {
        for a in 0..2 {
            let mut out = vec![0f32; 3 * H];
            comms[a].e2a_recv(&handles[a], &mut out).unwrap();
            assert_eq!(first_difference(&out, &expected(a), H), None, "rank {a}");
        }
    }

    fn is_non_finite_error(e: &Error) -> bool {
        matches!(e, Error::InvalidArgument(m) if m.contains("non-finite") && m.contains("nothing was sent"))
    }

    #[test]
    fn a_nan_row_in_an_int8_view_reply_sends_nothing_and_a_retry_with_finite_rows_succeeds() {
        let mut comms = job();
        let handles = send(&mut comms);
        let (attn, expert) = comms.split_at_mut(2);
        let mut view = expert[0].a2e_recv_view().unwrap();
        let src: Vec<u32> = view.meta().src_rank().to_vec();
        // The last attention rank's rows are NaN: the first is served first (rotation from
        // expert index 0), so a reply that quantizes as it sends would have served it.
        let err = view
            .e2a_send::<f32>(TransferMode::Push, |i, x, out| {
                reply(x, out);
                if src[i] == 1 {
                    out[2] = f32::NAN;
                }
            })
            .unwrap_err();
        assert!(is_non_finite_error(&err), "{err}");
        nothing_arrived(attn, &handles);
        view.e2a_send::<f32>(TransferMode::Push, |_, x, out| reply(x, out))
            .unwrap();
        drop(view);
        assert!(expert[0].poisoned().is_none());
        both_receive(attn, &handles);
    }

    #[test]
    fn a_nan_row_in_an_int8_token_or_expert_major_reply_sends_nothing_and_a_retry_succeeds() {
        let mut comms = job();
        // Token-major.
        let handles = send(&mut comms);
        let mut b = TokenBatch::new();
        comms[2].a2e_recv_tokens(&mut b, &mut |_, _| {}).unwrap();
        let rows: &[f32] = b.rows().unwrap();
        let mut reduced = vec![0f32; rows.len()];
        for (x, out) in rows.chunks(H).zip(reduced.chunks_mut(H)) {
            reply(x, out);
        }
        let mut bad = reduced.clone();
        bad[(b.num_tokens() - 1) * H + 5] = f32::INFINITY;
        let err = comms[2].e2a_send_tokens(&b, &bad).unwrap_err();
        assert!(is_non_finite_error(&err), "{err}");
        assert!(comms[2].poisoned().is_none(), "nothing was sent: retryable");
        nothing_arrived(&mut comms, &handles);
        comms[2].e2a_send_tokens(&b, &reduced).unwrap();
        both_receive(&mut comms, &handles);
        // Expert-major (weights 1: the reduction is the expert output itself).
        let handles = send(&mut comms);
        let mut e = ExpertBatch::new();
        comms[2].a2e_recv(&mut e).unwrap();
        let rows: &[f32] = e.rows().unwrap();
        let mut out = vec![0f32; rows.len()];
        for (x, o) in rows.chunks(H).zip(out.chunks_mut(H)) {
            reply(x, o);
        }
        let mut bad = out.clone();
        bad[(e.num_rows() - 1) * H] = f32::NAN;
        let err = comms[2].e2a_send(&e, &bad).unwrap_err();
        assert!(is_non_finite_error(&err), "{err}");
        assert!(comms[2].poisoned().is_none(), "nothing was sent: retryable");
        nothing_arrived(&mut comms, &handles);
        comms[2].e2a_send(&e, &out).unwrap();
        both_receive(&mut comms, &handles);
    }

    #[test]
    fn a_live_a2e_handle_dropped_poisons_its_communicator_and_aborts_every_peer_at_once() {
        let topo = Topology::contiguous(1, 1, 4).unwrap();
        let c = cfg(H, DType::F32, 1, 4);
        let mut comms = Communicator::local_group(&topo, &c).unwrap();
        let mut expert = comms.pop().unwrap();
        let mut attn = comms.pop().unwrap();
        let x = x_of(0);
        std::thread::scope(|s| {
            let e = s.spawn(move || {
                let mut b = TokenBatch::new();
                for _ in 0..2 {
                    expert.a2e_recv_tokens(&mut b, &mut |_, _| {}).unwrap();
                    let rows = b.rows::<f32>().unwrap().to_vec();
                    expert.e2a_send_tokens(&b, &rows).unwrap();
                }
                // Blocks for call 3, which never comes: the abort ends the wait.
                let start = std::time::Instant::now();
                let err = expert.a2e_recv_tokens(&mut b, &mut |_, _| {}).unwrap_err();
                (err, start.elapsed())
            });
            // A handle dropped after its E2A does nothing.
            let h1 = attn.a2e_send(&x, &[0, 1, 2], &[1.0; 3]).unwrap();
            let mut out = vec![0f32; 3 * H];
            attn.e2a_recv(&h1, &mut out).unwrap();
            assert_eq!(out, x);
            drop(h1);
            let h2 = attn.a2e_send(&x, &[0, 1, 2], &[1.0; 3]).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            drop(h2);
            let (err, waited) = e.join().unwrap();
            assert!(
                matches!(&err, Error::Aborted { by: 0, reason } if reason.contains("rank 0 dropped its A2E handle of epoch 2")),
                "{err}"
            );
            assert!(
                waited < Duration::from_secs(5),
                "seen at once ({waited:?}), not at the 20 s deadline"
            );
        });
        let err = attn.a2e_send(&x, &[0, 1, 2], &[1.0; 3]).unwrap_err();
        assert!(
            matches!(&err, Error::Aborted { by: 0, reason } if reason.contains("epoch 2")),
            "{err}"
        );
        assert!(attn.poisoned().is_some());
    }

    #[test]
    fn the_last_batch_of_a_call_dropped_before_its_reply_aborts_every_peer_at_once() {
        let topo = Topology::contiguous(1, 1, 4).unwrap();
        let c = cfg(H, DType::F32, 1, 4);
        let mut comms = Communicator::local_group(&topo, &c).unwrap();
        let mut expert = comms.pop().unwrap();
        let mut attn = comms.pop().unwrap();
        let x = x_of(0);
        let h1 = attn.a2e_send(&x, &[0, 1, 2], &[1.0; 3]).unwrap();
        let mut b = TokenBatch::new();
        expert.a2e_recv_tokens(&mut b, &mut |_, _| {}).unwrap();
        // A clone holds the call too: dropping the original is harmless, the clone replies.
        let mut kept = b.clone();
        drop(b);
        let rows = kept.rows::<f32>().unwrap().to_vec();
        expert.e2a_send_tokens(&kept, &rows).unwrap();
        let mut out = vec![0f32; 3 * H];
        attn.e2a_recv(&h1, &mut out).unwrap();
        assert_eq!(out, x);
        // Refilled after its reply: harmless. Then dropped before the reply of call 2.
        let h2 = attn.a2e_send(&x, &[0, 1, 2], &[1.0; 3]).unwrap();
        expert.a2e_recv_tokens(&mut kept, &mut |_, _| {}).unwrap();
        drop(kept);
        let start = std::time::Instant::now();
        let err = attn.e2a_recv(&h2, &mut out).unwrap_err();
        assert!(
            matches!(&err, Error::Aborted { by: 1, reason } if reason.contains("expert rank 1") && reason.contains("epoch 2")),
            "{err}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "seen at once, not at the 20 s deadline"
        );
        let err = expert.a2e_recv_tokens(&mut TokenBatch::new(), &mut |_, _| {});
        assert!(matches!(err, Err(Error::Aborted { by: 1, .. })), "{err:?}");
        assert!(expert.poisoned().is_some());
    }
}

/// What a peer does between this rank's look at its slot and the liveness check that follows.
type Meanwhile = std::sync::Arc<std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// Every signal a rank sent, in order: (peer, slot, value).
type SignalLog = std::sync::Arc<std::sync::Mutex<Vec<(usize, usize, u64)>>>;

/// A local endpoint with test hooks: its next liveness check of `races.0` first runs what
/// `races.1` holds, every signal it sends goes into `log`, and once `gets_time_out` is raised
/// every get of rows (more than a record) fails as a timeout (a slow remote read on ofi or
/// ascend).
struct Hooked {
    inner: crate::fabric::local::LocalFabric,
    races: Option<(usize, Meanwhile)>,
    log: Option<SignalLog>,
    gets_time_out: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Raised: the next wait fails at once as a timeout (and lowers it).
    next_wait_times_out: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

// SAFETY: forwards every method to a local fabric, adding only a hook that writes no window.
unsafe impl crate::fabric::Fabric for Hooked {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn window_len(&self, rank: usize) -> usize {
        self.inner.window_len(rank)
    }
    fn num_signal_slots(&self) -> usize {
        self.inner.num_signal_slots()
    }
    fn local_window(&self) -> Option<crate::fabric::Window<'_>> {
        self.inner.local_window()
    }
    fn peer_window(&self, peer: usize) -> Option<crate::fabric::Window<'_>> {
        self.inner.peer_window(peer)
    }
    fn put(&self, peer: usize, offset: usize, data: &[u8]) -> crate::Result<()> {
        self.inner.put(peer, offset, data)
    }
    fn get(&self, peer: usize, offset: usize, buf: &mut [u8]) -> crate::Result<()> {
        let fail = |f: &std::sync::atomic::AtomicBool| f.load(std::sync::atomic::Ordering::SeqCst);
        let row = buf.len() > std::mem::size_of::<crate::moe::record::Record>();
        if row && self.gets_time_out.as_deref().is_some_and(fail) {
            return Err(Error::Timeout {
                peer,
                what: "a remote read (injected)".into(),
                waited: Duration::ZERO,
            });
        }
        self.inner.get(peer, offset, buf)
    }
    fn signal(&self, peer: usize, slot: usize, value: u64) -> crate::Result<()> {
        self.inner.signal(peer, slot, value)?;
        if let Some(log) = &self.log {
            log.lock().unwrap().push((peer, slot, value));
        }
        Ok(())
    }
    fn signal_value(&self, slot: usize) -> u64 {
        self.inner.signal_value(slot)
    }
    fn flush(&self) -> crate::Result<()> {
        self.inner.flush()
    }
    fn wait_until(
        &self,
        deadline: std::time::Instant,
        poll: &mut dyn FnMut() -> Option<crate::fabric::Waiting>,
    ) -> crate::Result<()> {
        let once =
            |f: &std::sync::atomic::AtomicBool| f.swap(false, std::sync::atomic::Ordering::SeqCst);
        if self.next_wait_times_out.as_deref().is_some_and(once) {
            return Err(Error::Timeout {
                peer: 0,
                what: "a credit (injected)".into(),
                waited: Duration::ZERO,
            });
        }
        self.inner.wait_until(deadline, poll)
    }
    fn barrier(&self, timeout: Duration) -> crate::Result<()> {
        self.inner.barrier(timeout)
    }
    fn abort_reporting(&self, dead: Option<usize>, reason: &str) {
        self.inner.abort_reporting(dead, reason)
    }
    fn forward_abort(&self, notice: &crate::AbortNotice) {
        self.inner.forward_abort(notice)
    }
    fn aborted(&self) -> Option<crate::AbortNotice> {
        self.inner.aborted()
    }
    fn wait_counters(&self) -> crate::fabric::WaitCounters {
        self.inner.wait_counters()
    }
    fn check_peers(&self) -> crate::Result<()> {
        self.inner.check_peers()
    }
    fn check_peer(&self, peer: usize) -> crate::Result<()> {
        if let Some((racer, meanwhile)) = &self.races {
            if peer == *racer {
                let meanwhile = meanwhile.lock().unwrap().take();
                if let Some(f) = meanwhile {
                    f();
                }
            }
        }
        self.inner.check_peer(peer)
    }
}

/// A peer that reaches the barrier, sees everyone there, returns and drops its communicator
/// between this rank's look at its slot and the liveness check that follows: the barrier is
/// complete, not a failure. The barrier reported "rank 0 failed: left the job" once in a CI-like
/// run of the shrink tests (a survivor's final barrier), as the waits that re-look after the
/// check (`Context::check_awaited_again`) do not.
#[test]
fn a_peer_that_arrives_and_leaves_between_look_and_check_completes_the_barrier() {
    use crate::fabric::local::LocalFabric;
    use std::sync::Arc;
    let topo = Arc::new(Topology::contiguous(1, 1, 4).unwrap());
    let c = cfg(8, DType::F32, 2, 4);
    let lens = Communicator::window_lens(&topo, &c).unwrap();
    let mut fabrics = LocalFabric::group(&lens, Communicator::signal_slots(&topo)).unwrap();
    let f1 = fabrics.pop().unwrap();
    let f0 = fabrics.pop().unwrap();
    let meanwhile = Meanwhile::default();
    let (t1, c1) = (topo.clone(), c.clone());
    let h = std::thread::spawn(move || Communicator::from_fabric(Box::new(f1), t1, c1).unwrap());
    let racing = Hooked {
        inner: f0,
        races: Some((1, meanwhile.clone())),
        log: None,
        gets_time_out: None,
        next_wait_times_out: None,
    };
    let mut rank0 = Communicator::from_fabric(Box::new(racing), topo, c).unwrap();
    let mut rank1 = h.join().unwrap();
    let left = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = left.clone();
    // Rank 0 signals its arrival before it looks at rank 1's slot, so rank 1's barrier returns
    // at once inside the check; then rank 1 leaves the job.
    *meanwhile.lock().unwrap() = Some(Box::new(move || {
        rank1.barrier().expect("rank 0 arrived before it looked");
        drop(rank1);
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
    }));
    rank0.barrier().expect("rank 1 arrived before it left");
    assert!(
        left.load(std::sync::atomic::Ordering::SeqCst),
        "rank 1 left inside the check"
    );
}

/// Where a relay's members sum their replies on it, the relay tells a member of the tokens
/// complete so far after each chunk of its own replies, not once all of them are written (it
/// did: the member then waited for the relay's whole copy before summing anything).
#[test]
fn a_relay_tells_its_members_of_complete_tokens_while_it_still_writes_its_own_replies() {
    use crate::fabric::local::LocalFabric;
    use std::sync::Arc;
    let topo = Arc::new(relayed(1, 2, 4, 1));
    let h = 16;
    let mut c = cfg(h, DType::F32, 2, 8);
    c.chunk_bytes = 1; // a progress signal per row
    let lens = Communicator::window_lens(&topo, &c).unwrap();
    let fabrics = LocalFabric::group(&lens, Communicator::signal_slots(&topo)).unwrap();
    let log = SignalLog::default();
    let mut comms = on_every_rank(fabrics, |f| {
        let log = (crate::fabric::Fabric::rank(&f) == 1).then(|| log.clone());
        let hooked = Hooked {
            inner: f,
            races: None,
            log,
            gets_time_out: None,
            next_wait_times_out: None,
        };
        Communicator::from_fabric(Box::new(hooked), topo.clone(), c.clone()).unwrap()
    });
    let (mut other, mut relay, mut att) = (comms.remove(2), comms.remove(1), comms.remove(0));
    let wl = wl(84, 8, false);
    let call = RelayedCall::send(&topo, &wl, h, &mut att, &mut relay);
    // Rank 2's replies are all in before the relay writes its own.
    expert_round::<f32>(&mut other, &wl, 0, &mut ExpertBatch::new(), true)
        .unwrap()
        .unwrap();
    assert!(call.batch.num_rows() >= 2, "the relay has rows of its own");
    log.lock().unwrap().clear();
    relay.e2a_send(&call.batch, &call.relay_outputs()).unwrap();
    call.receive(&mut att);
    // The relay's progress to itself (its own replies) and to the attention rank (tokens
    // complete), on the relay's E2A slot.
    let slot = relay.ctx().slots.e2a_ready(1);
    let log = log.lock().unwrap();
    let last_own = log.iter().rposition(|&(p, s, _)| (p, s) == (1, slot));
    let first_told = log.iter().position(|&(p, s, _)| (p, s) == (0, slot));
    let (Some(last_own), Some(first_told)) = (last_own, first_told) else {
        panic!("no progress of the relay's own replies or to its member: {log:?}");
    };
    assert!(
        first_told < last_own,
        "the member heard of complete tokens only after the relay's last own reply: {log:?}"
    );
}

/// A member lays its rows out in its relay's wire order: the expert ranks after the relay first,
/// the relay's own rows last (the relay's receive waits for every row anyway; the others then
/// get theirs as early as the direct path's first destination).
#[test]
fn a_member_sends_the_relays_own_rows_last() {
    use crate::moe::relay::read_header;
    let topo = relayed(1, 3, 6, 1);
    let mut comms = Communicator::local_group(&topo, &cfg(16, DType::F32, 2, 8)).unwrap();
    let mut relay = comms.remove(1);
    let call = RelayedCall::send(&topo, &wl(85, 8, false), 16, &mut comms[0], &mut relay);
    // (count, offset) of the member's rows for each expert rank, from the relay's headers.
    let mut placed = Vec::new();
    for ctx in [relay.ctx(), comms[1].ctx(), comms[2].ctx()] {
        let (mut entries, mut bytes) = (Vec::new(), Vec::new());
        read_header(ctx, (1, 0), call.handle.epoch(), &mut entries, &mut bytes).unwrap();
        assert!(entries[0].count > 0, "rank {} has rows", ctx.rank);
        placed.push((entries[0].count, entries[0].offset));
    }
    let [(own, own_at), (c2, at2), (c3, at3)] = placed[..] else {
        unreachable!()
    };
    assert_eq!((at2, at3, own_at), (0, c2, c2 + c3), "own {own}");
}

#[test]
fn a_communicator_refuses_a_timeout_past_the_limit_at_init_and_later() {
    let topo = Topology::contiguous(1, 1, 2).unwrap();
    let long = MoeConfig {
        timeout: Duration::MAX,
        ..cfg(8, DType::F32, 1, 4)
    };
    let err = Communicator::local_group(&topo, &long).err().unwrap();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("365 days")),
        "{err}"
    );
    let mut comms = Communicator::local_group(&topo, &cfg(8, DType::F32, 1, 4)).unwrap();
    let err = comms[0].set_timeout(Duration::MAX).unwrap_err();
    assert!(err.to_string().contains("365 days"), "{err}");
}

/// Found by review: a panic in a user's `on_arrival` (after the call had published, through
/// relays or not) neither poisoned the communicator nor told the peers, who waited out their
/// timeout.
#[test]
fn a_panic_in_an_arrival_callback_poisons_the_communicator_and_aborts_the_job_at_once() {
    let c = MoeConfig {
        timeout: Duration::from_secs(20),
        ..cfg(8, DType::F32, 2, 4)
    };
    let (mut attn, mut expert) = pair(&c);
    let (input, x) = input_of(0);
    let h = attn
        .a2e_send(&x, &input.topk_idx, &input.topk_weights)
        .unwrap();
    let mut batch = TokenBatch::new();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        expert.a2e_recv_tokens(&mut batch, &mut |_, _| panic!("user callback"))
    }));
    assert!(unwound.is_err());
    let poisoned = expert.poisoned().map(|e| e.to_string()).unwrap_or_default();
    assert!(poisoned.contains("panic inside A2E receive"), "{poisoned}");
    assert!(expert.a2e_recv_tokens(&mut batch, &mut |_, _| {}).is_err());
    let start = std::time::Instant::now();
    let mut out = vec![0f32; x.len()];
    let err = attn.e2a_recv(&h, &mut out).unwrap_err();
    assert!(
        matches!(&err, Error::Aborted { by: 1, reason } if reason.contains("panic inside A2E receive")),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(5), "seen at once");
}

/// The attention side's sum starts from its first contribution, not from zero: a token whose
/// two expert ranks both reply `-0.0` combines to `-0.0` (`0.0 + -0.0` would be `+0.0`), and a
/// single contribution comes back with its bits unchanged (a NaN's payload included). The
/// expert ranks reply token-major, so their rows go out as they wrote them.
#[test]
fn combined_rows_keep_the_sign_of_zero_and_a_single_rows_bits() {
    let topo = Topology::contiguous(1, 2, 2).unwrap();
    let cfg = MoeConfig::new(4, DType::F32, 2, 4);
    let mut comms = Communicator::local_group(&topo, &cfg).unwrap();
    let experts: Vec<Communicator> = comms.drain(1..).collect();
    let mut attention = comms.pop().unwrap();
    let nan = f32::from_bits(0x7fa0_1234);
    let threads: Vec<_> = experts
        .into_iter()
        .map(|mut e| {
            std::thread::spawn(move || {
                let mut batch = TokenBatch::new();
                e.a2e_recv_tokens(&mut batch, &mut |_, _| {}).unwrap();
                // Token 0 (every rank has it) replies -0.0, token 1 (rank 0 only) a NaN.
                let reduced: Vec<f32> = (0..batch.num_tokens())
                    .flat_map(|i| [if i == 0 { -0.0 } else { nan }; 4])
                    .collect();
                e.e2a_send_tokens(&batch, &reduced).unwrap();
            })
        })
        .collect();
    // Token 0 to experts 0 and 1 (one on each rank); token 1 to expert 0 alone.
    let x = vec![1.0f32; 2 * 4];
    let handle = attention
        .a2e_send(&x, &[0, 1, 0, -1], &[0.5, 0.5, 1.0, 0.0])
        .unwrap();
    let mut out = vec![1.0f32; 2 * 4];
    attention.e2a_recv(&handle, &mut out).unwrap();
    for t in threads {
        t.join().unwrap();
    }
    for v in &out[..4] {
        assert_eq!(v.to_bits(), (-0.0f32).to_bits(), "token 0: -0.0 + -0.0");
    }
    for v in &out[4..] {
        assert_eq!(
            v.to_bits(),
            nan.to_bits(),
            "token 1's single row, bit for bit"
        );
    }
}

/// Found by review: a later source's record grew the batch's arrays during a token-major
/// receive, so pointers an arrival callback was handed (the C ABI's info pointers, which a
/// callback may keep) dangled. The worst case is reserved when the receive starts.
#[test]
fn what_an_arrival_callback_is_shown_stays_where_it_is_for_the_whole_receive() {
    let topo = Topology::contiguous(3, 1, 2).unwrap();
    let c = cfg(64, DType::F32, 1, 8);
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut handles = Vec::new();
    for a in &mut comms {
        let (idx, w) = ([0i32; 8], [1f32; 8]);
        handles.push(a.a2e_send(&[1f32; 8 * 64], &idx, &w).unwrap());
    }
    type Seen = [usize; 5];
    let at = |b: &TokenBatch| -> Seen {
        [
            b.row_bytes().as_ptr() as usize,
            b.src_rank().as_ptr() as usize,
            b.src_token().as_ptr() as usize,
            b.expert_count.as_ptr() as usize,
            b.weight.as_ptr() as usize,
        ]
    };
    let mut batch = TokenBatch::new();
    let mut shown: Vec<Seen> = Vec::new();
    expert
        .a2e_recv_tokens(&mut batch, &mut |b, _| shown.push(at(b)))
        .unwrap();
    assert_eq!(shown.len(), 3);
    assert_eq!(batch.num_tokens(), 24);
    for s in &shown {
        assert_eq!(*s, at(&batch), "an array moved during the receive");
    }
    expert.abort("test over");
    drop(handles);
}

/// A job over a local fabric whose every endpoint is a [`Hooked`] one: `hook(rank, plain)`
/// returns rank `rank`'s endpoint from one with no hook set.
fn hooked_group(
    topo: &std::sync::Arc<Topology>,
    c: &MoeConfig,
    hook: impl Fn(usize, Hooked) -> Hooked + Sync,
) -> Vec<Communicator> {
    let lens = Communicator::window_lens(topo, c).unwrap();
    let fabrics =
        crate::fabric::local::LocalFabric::group(&lens, Communicator::signal_slots(topo)).unwrap();
    on_every_rank(fabrics, |f| {
        let rank = crate::fabric::Fabric::rank(&f);
        let plain = Hooked {
            inner: f,
            races: None,
            log: None,
            gets_time_out: None,
            next_wait_times_out: None,
        };
        let hooked = hook(rank, plain);
        Communicator::from_fabric(Box::new(hooked), topo.clone(), c.clone()).unwrap()
    })
}

/// Found by review: a view receive whose fetch of unmapped rows failed as retryable (a timeout
/// of a remote read on ofi or ascend) had already taken its call: nobody could reply, and the
/// attention ranks waited out their timeout. Such a failure poisons and aborts now.
#[test]
fn a_view_whose_fetch_fails_after_taking_its_call_poisons_and_aborts_at_once() {
    use std::sync::Arc;
    let topo = Arc::new(Topology::contiguous(1, 1, 4).unwrap());
    let c = MoeConfig {
        timeout: Duration::from_secs(20),
        ..cfg(64, DType::F32, 2, 4)
    };
    let slow = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut comms = hooked_group(&topo, &c, |rank, hooked| Hooked {
        gets_time_out: (rank == 1).then(|| slow.clone()),
        ..hooked
    });
    let (mut expert, mut attn) = (comms.remove(1), comms.remove(0));
    let input = wl(21, 4, false).input(&topo, 2, 0, 0);
    // INT8 rows: a view fetches them (dequantized) into a private buffer.
    attn.set_a2e_quant(Quant::Int8);
    let h = attn
        .a2e_send(&[1f32; 256], &input.topk_idx, &input.topk_weights)
        .unwrap();
    slow.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = expert.a2e_recv_view().err().unwrap();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        expert.poisoned().is_some(),
        "the call was taken: not retryable ({err:?})"
    );
    let start = std::time::Instant::now();
    let err = attn.e2a_recv(&h, &mut [0f32; 256]).unwrap_err();
    assert!(matches!(&err, Error::Aborted { by: 1, .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5), "seen at once");
}

/// Found by review: `e2a_send_output` gave up its prepared output before a send that could
/// still fail retryably (a credit wait timing out, as under DP domains): the documented retry
/// then failed with `InvalidArgument`. The output is given up only once sent.
#[test]
fn a_registered_reply_whose_send_fails_before_writing_can_be_sent_again() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // DP domains: credits are waited for, not implied.
    let topo = Arc::new(
        Topology::contiguous(2, 1, 4)
            .unwrap()
            .with_domains(2)
            .unwrap(),
    );
    let c = MoeConfig {
        max_in_flight: 1,
        ..cfg(8, DType::F32, 2, 4)
    };
    let stall = Arc::new(AtomicBool::new(false));
    let mut comms = hooked_group(&topo, &c, |rank, hooked| Hooked {
        next_wait_times_out: (rank == 2).then(|| stall.clone()),
        ..hooked
    });
    let mut expert = comms.remove(2);
    let locals = topo.local_experts(2).to_vec();
    let mut batch = TokenBatch::new();
    // Calls alternate between the domains; from the second on the buffer is reused and the
    // send waits for its credit.
    for round in 0..4u64 {
        let a = (0..2).find(|&r| topo.in_call(r, round)).unwrap();
        let attn = &mut comms[a];
        let input = wl(31, 4, false).input(&topo, 2, a, round);
        let x = vec![1f32; input.num_tokens * 8];
        let h = attn
            .a2e_send(&x, &input.topk_idx, &input.topk_weights)
            .unwrap();
        expert.a2e_recv_tokens(&mut batch, &mut |_, _| {}).unwrap();
        let out: Vec<f32> = token_replies(&locals, &batch);
        expert
            .e2a_output::<f32>(&batch)
            .unwrap()
            .copy_from_slice(&out);
        if round == 3 {
            stall.store(true, Ordering::SeqCst);
            let err = expert.e2a_send_output(&batch).unwrap_err();
            assert!(matches!(err, Error::Timeout { .. }), "{err}");
            assert!(
                expert.poisoned().is_none(),
                "nothing was written: retryable"
            );
        }
        expert.e2a_send_output(&batch).unwrap();
        let mut got = vec![0f32; input.num_tokens * 8];
        attn.e2a_recv(&h, &mut got).unwrap();
    }
}

/// Found by review: an attention rank whose E2A receive timed out waiting for a stopped expert
/// dropped its handle as the error unwound, and the peers were told "rank 0 dropped its A2E
/// handle" rather than the timeout naming the expert. The abort carries the error now.
#[test]
fn an_abort_that_follows_a_failed_call_tells_the_peers_that_failure() {
    let topo = Topology::contiguous(1, 2, 4).unwrap();
    let c = MoeConfig {
        timeout: Duration::from_millis(300),
        ..cfg(8, DType::F32, 2, 4)
    };
    let mut comms = Communicator::local_group(&topo, &c).unwrap();
    let (_stopped, mut served, mut attn) = (
        comms.pop().unwrap(),
        comms.pop().unwrap(),
        comms.pop().unwrap(),
    );
    let input = wl(21, 4, false).input(&topo, 2, 0, 0);
    let h = attn
        .a2e_send(&[1f32; 32], &input.topk_idx, &input.topk_weights)
        .unwrap();
    let mut batch = TokenBatch::new();
    served.a2e_recv_tokens(&mut batch, &mut |_, _| {}).unwrap();
    let out = vec![0f32; batch.num_tokens() * 8];
    served.e2a_send_tokens(&batch, &out).unwrap();
    // Rank 2 never receives: the E2A receive times out naming it, then the handle is dropped.
    let mut got = [0f32; 32];
    let err = attn.e2a_recv(&h, &mut got).unwrap_err();
    assert!(matches!(err, Error::Timeout { peer: 2, .. }), "{err}");
    drop(h);
    let err = served
        .a2e_recv_tokens(&mut TokenBatch::new(), &mut |_, _| {})
        .unwrap_err();
    let Error::Aborted { by: 0, reason } = &err else {
        panic!("{err}");
    };
    assert!(
        reason.contains("rank 2") && reason.contains("timed out") && reason.contains("dropped"),
        "{reason}"
    );
}
