//! Tests of the calls engines poll and steer with, over the local fabric: the non-blocking
//! completion tests ([`Communicator::e2a_ready`], [`Communicator::a2e_ready`]) and per-call
//! user tags ([`Communicator::set_next_a2e_tag`]), direct, through relays and with DP domains,
//! on every receive variant.

use std::time::{Duration, Instant};

use crate::moe::config::{MoeConfig, TransferMode};
use crate::topology::{Role, Topology};
use crate::{Communicator, DType, Error, ExpertBatch, TokenBatch};

const HIDDEN: usize = 4;
const TOKENS: usize = 3;
/// The tag of the last round: expert loops end on it.
const STOP: u64 = u64::MAX;

fn cfg() -> MoeConfig {
    let mut c = MoeConfig::new(HIDDEN, DType::F32, 1, 4);
    c.timeout = Duration::from_secs(20);
    c
}

/// The tag attention rank `rank` gives round `round` of `rounds`: every third round none (0
/// must arrive: a tag is consumed by the call that carried it), the last round [`STOP`].
fn tag_of(round: u64, rounds: u64, rank: usize) -> u64 {
    if round + 1 == rounds {
        STOP
    } else if round % 3 == 2 {
        0
    } else {
        0x5a00_0000_0000_0000 | round << 8 | rank as u64
    }
}

/// Runs attention ranks that tag their calls and expert ranks that end their loop on the tag,
/// checking every source's tag and the call's tag (its lowest source's) on each receive. Every
/// token goes to expert 0, so the other expert ranks get 0-row messages that must still carry
/// the tags. Returns the number of calls each expert rank saw.
fn run_tagged(topo: &Topology, rounds: u64, views: bool) -> Vec<u64> {
    let mut c = cfg();
    if topo.num_domains() > 1 {
        c.max_in_flight = 1;
    }
    let comms = Communicator::local_group(topo, &c).unwrap();
    let base = cfg().epoch_base;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || -> u64 {
                    let rank = c.rank();
                    let topo = c.topology().clone();
                    if c.role() == Role::Attention {
                        let x: Vec<f32> = (0..TOKENS * HIDDEN).map(|i| i as f32).collect();
                        let (idx, w) = (vec![0i32; TOKENS], vec![1f32; TOKENS]);
                        let mut out = vec![0f32; TOKENS * HIDDEN];
                        for round in (0..rounds).filter(|&r| topo.in_call(rank, r)) {
                            let tag = tag_of(round, rounds, rank);
                            if tag != 0 {
                                c.set_next_a2e_tag(tag);
                            }
                            if round == 1 {
                                // Rejected before publishing: the tag stays for the next call.
                                let big = vec![0f32; 5 * HIDDEN];
                                let err = c.a2e_send(&big, &[0; 5], &[1.0; 5]).unwrap_err();
                                assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
                            }
                            let h = c.a2e_send(&x, &idx, &w).unwrap();
                            c.e2a_recv(&h, &mut out).unwrap();
                            assert_eq!(out, x, "rank {rank} round {round}");
                        }
                        return 0;
                    }
                    let mut batch = ExpertBatch::new();
                    let mut tokens = TokenBatch::new();
                    let expected = |epoch: u64, sources: &[crate::SourceInfo], tag: u64| {
                        let round = epoch - base - 1;
                        let mut first = None;
                        for s in sources {
                            let want = if topo.in_call(s.rank(), round) {
                                first.get_or_insert(s.rank());
                                tag_of(round, rounds, s.rank())
                            } else {
                                0
                            };
                            assert_eq!(s.tag(), want, "rank {rank}: source {}", s.rank());
                        }
                        let first = first.expect("a call has a source");
                        assert_eq!(
                            tag,
                            tag_of(round, rounds, first),
                            "rank {rank} round {round}"
                        );
                        tag
                    };
                    for n in 0.. {
                        let tag = match n % if views { 3 } else { 2 } {
                            0 => {
                                c.a2e_recv(&mut batch).unwrap();
                                let tag = expected(batch.epoch(), batch.sources(), batch.tag());
                                let rows = batch.rows::<f32>().unwrap().to_vec();
                                c.e2a_send(&batch, &rows).unwrap();
                                tag
                            }
                            1 => {
                                c.a2e_recv_tokens(&mut tokens, &mut |_, _| {}).unwrap();
                                let tag = expected(tokens.epoch(), tokens.sources(), tokens.tag());
                                let rows = tokens.rows::<f32>().unwrap().to_vec();
                                c.e2a_send_tokens(&tokens, &rows).unwrap();
                                tag
                            }
                            _ => {
                                let mut view = c.a2e_recv_view().unwrap();
                                let tag = expected(view.epoch(), view.sources(), view.tag());
                                view.e2a_send(TransferMode::Push, |_, i: &[f32], o| {
                                    o.copy_from_slice(i)
                                })
                                .unwrap();
                                tag
                            }
                        };
                        if tag == STOP {
                            return n + 1;
                        }
                    }
                    unreachable!()
                })
            })
            .collect();
        let seen: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        topo.expert_ranks().iter().map(|&r| seen[r]).collect()
    })
}

#[test]
fn tags_reach_every_expert_rank_with_0_rows_too_and_end_the_expert_loop() {
    let topo = Topology::contiguous(3, 3, 6).unwrap();
    assert_eq!(run_tagged(&topo, 7, true), vec![7; 3]);
}

#[test]
fn tags_travel_through_relays() {
    for relays in [1, 2] {
        let topo = Topology::contiguous(3, 3, 6)
            .unwrap()
            .with_relays(Some(relays))
            .unwrap();
        assert_eq!(run_tagged(&topo, 5, false), vec![5; 3], "{relays} relays");
    }
}

#[test]
fn tags_with_dp_domains_come_from_the_calls_domain() {
    let topo = Topology::contiguous(4, 2, 4)
        .unwrap()
        .with_domains(2)
        .unwrap();
    assert_eq!(run_tagged(&topo, 6, true), vec![6; 2]);
    let relayed = Topology::contiguous(4, 2, 4)
        .unwrap()
        .with_domains(2)
        .unwrap()
        .with_relays(Some(1))
        .unwrap();
    assert_eq!(run_tagged(&relayed, 6, false), vec![6; 2]);
}

/// Polls `ready` until it says true (bounded).
fn poll(what: &str, mut ready: impl FnMut() -> crate::Result<bool>) {
    let start = Instant::now();
    while !ready().unwrap() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what} never ready"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn waited(c: &Communicator) -> Duration {
    c.last_call_stats().peers.iter().map(|p| p.waited).sum()
}

/// One attention rank and the expert ranks of `topo`, stepping through a call with the tests:
/// not ready before the peer acted, ready after, and the call then waits for nobody.
fn ready_steps(topo: &Topology) {
    let comms = Communicator::local_group(topo, &cfg()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let mut rx = Some(rx);
    let relay = topo.relay_plan().map(|p| p.relays()[0]);
    std::thread::scope(|s| {
        let mut attn = None;
        let mut handles = Vec::new();
        for mut c in comms {
            if c.role() == Role::Attention {
                attn = Some(c);
                continue;
            }
            let is_relay = relay == Some(c.rank());
            // Nothing sent yet: not ready.
            assert!(!c.a2e_ready().unwrap(), "rank {}", c.rank());
            // The first expert rank that is not the relay replies only after the go.
            let first = topo.expert_ranks().iter().find(|&&r| Some(r) != relay);
            let go = if Some(&c.rank()) == first {
                rx.take()
            } else {
                None
            };
            handles.push(s.spawn(move || {
                if let Some(go) = go {
                    go.recv().unwrap();
                }
                poll("A2E", || c.a2e_ready());
                let mut b = ExpertBatch::new();
                c.a2e_recv(&mut b).unwrap();
                if !is_relay {
                    assert_eq!(waited(&c), Duration::ZERO, "rank {}", c.rank());
                }
                let rows = b.rows::<f32>().unwrap().to_vec();
                c.e2a_send(&b, &rows).unwrap();
            }));
        }
        let mut attn = attn.unwrap();
        let x: Vec<f32> = (0..TOKENS * HIDDEN).map(|i| i as f32).collect();
        let h = attn.a2e_send(&x, &[0, 1, 2], &[1.0; 3]).unwrap();
        // Expert rank 0 has not replied (it waits for the go): not ready.
        std::thread::sleep(Duration::from_millis(20));
        assert!(!attn.e2a_ready(&h).unwrap());
        tx.send(()).unwrap();
        poll("E2A", || attn.e2a_ready(&h));
        let mut out = vec![0f32; TOKENS * HIDDEN];
        attn.e2a_recv(&h, &mut out).unwrap();
        assert_eq!(out, x);
        assert_eq!(waited(&attn), Duration::ZERO);
        // A used handle: an error that changes nothing.
        let err = attn.e2a_ready(&h).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(attn.poisoned().is_none());
        for h in handles {
            h.join().unwrap();
        }
    });
}

#[test]
fn ready_tests_say_no_before_and_yes_after_and_the_call_then_waits_for_nobody() {
    ready_steps(&Topology::contiguous(1, 2, 4).unwrap());
}

#[test]
fn ready_tests_through_a_relay() {
    ready_steps(
        &Topology::contiguous(1, 2, 4)
            .unwrap()
            .with_relays(Some(1))
            .unwrap(),
    );
}

#[test]
fn ready_tests_on_the_wrong_role_and_after_a_peer_left_are_errors() {
    let topo = Topology::contiguous(1, 1, 4).unwrap();
    let mut comms = Communicator::local_group(&topo, &cfg()).unwrap();
    let mut expert = comms.pop().unwrap();
    let mut attn = comms.pop().unwrap();
    assert!(matches!(attn.a2e_ready(), Err(Error::WrongRole(_))));
    assert!(attn.poisoned().is_none());
    let x = vec![1f32; HIDDEN];
    let h = attn.a2e_send(&x, &[0], &[1.0]).unwrap();
    assert!(matches!(expert.e2a_ready(&h), Err(Error::WrongRole(_))));
    assert!(expert.a2e_ready().unwrap());
    // The expert leaves without replying: the test reports it and poisons.
    drop(expert);
    match attn.e2a_ready(&h) {
        Err(Error::PeerFailed { peer: 1, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(attn.poisoned().is_some());
}

#[test]
fn a_wait_for_a_gone_bootstrap_root_names_the_root_and_its_address_not_rank_0() {
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = gone.local_addr().unwrap();
    drop(gone);
    let key = crate::bootstrap::JobKey::random();
    let id = crate::bootstrap::UniqueId::from_parts(7, &key, addr);
    let err =
        crate::bootstrap::TcpBootstrap::connect(&id, 1, 2, Duration::from_millis(200)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Timeout {
                peer: crate::error::BOOTSTRAP_ROOT,
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("waiting for the bootstrap root")
            && msg.contains(&format!("the bootstrap root at {addr}"))
            && !msg.contains("rank 0"),
        "{msg}"
    );
}
