//! Communicator tests over the in-process fabric: every result checked bit for bit against the
//! reference, and every defined failure state (rejected calls, poisoning, aborts, bad peer data).

use std::time::Duration;

use half::{bf16, f16};
use proptest::prelude::*;

use crate::fabric::Capabilities;
use crate::moe::config::{MoeConfig, TransferMode};
use crate::moe::dtype::{DType, Element};
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

#[test]
fn results_are_bitwise_identical_run_to_run() {
    let topo = Topology::contiguous(2, 3, 12).unwrap();
    let c = cfg(16, DType::BF16, 4, 8);
    let run = || {
        let comms = Communicator::local_group(&topo, &c).unwrap();
        let w = wl(12, 8, false);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|mut comm| {
                    let w = w.clone();
                    s.spawn(move || {
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
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
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
    let mut fabrics = LocalFabric::create(&lens, Communicator::signal_slots(&topo)).unwrap();
    let f1 = fabrics.pop().unwrap();
    let f0 = fabrics.pop().unwrap();
    let t2 = topo.clone();
    let h = std::thread::spawn(move || Communicator::new(Box::new(f1), t2, b).err());
    let e0 = Communicator::new(Box::new(f0), topo, a).err();
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
    ) {
        let c = cfg(hidden, dtype, topk, tokens.max(1));
        let w = Workload { seed, tokens, vary: true, skew: skewed.then_some(1.2) };
        let r = match dtype {
            DType::BF16 => run_local::<bf16>(&topo, &c, &w, 3, BOTH),
            _ => run_local::<f32>(&topo, &c, &w, 3, BOTH),
        };
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
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
