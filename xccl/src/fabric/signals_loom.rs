//! Loom models of the signal, credit and epoch protocol on real control areas (`ci/loom.sh`).
//!
//! Each test builds control areas over [`crate::sync::ModelMemory`] and drives them with the
//! production code: [`ControlArea::store`], [`ControlArea::load`], [`ControlArea::set_abort`]
//! and the wait loop [`ControlArea::wait_with`], with the protocol's own epoch arithmetic
//! ([`progress`], [`Progress::of`], [`reuse_credit`]). What stands in for the rest: a window's
//! rows are a loom `UnsafeCell` per chunk (loom reports a read that is not ordered after the
//! write it must see, or a write that races a read), and a rank is a loom thread. Waits use a
//! policy that sleeps on the doorbell after every failed poll, so every wait goes through the
//! sleeper handshake; the model futex never times out (see `crate::sync`), so a lost wake-up
//! is a deadlock loom reports.

use std::sync::Arc;
use std::time::{Duration, Instant};

use loom::cell::UnsafeCell;
use loom::thread;

use super::{ControlArea, WaitPolicy, WaitState, Waiting};
use crate::moe::progress::{progress, reuse_credit, Progress, EPOCH_MASK, PROGRESS_ROW_BITS};
use crate::sync::ModelMemory;
use crate::Error;

/// Sleep on the doorbell after every poll that finds the wait unfinished.
const SLEEP_AT_ONCE: WaitPolicy = WaitPolicy {
    spin_iters: 0,
    yield_for: Duration::ZERO,
};

/// The epoch before the first call: the calls cross the 40-bit wrap of the progress field.
const EPOCH_BASE: u64 = EPOCH_MASK - 1;

const SENDER: usize = 0;
const RECEIVER: usize = 1;
/// On the receiver: the sender's progress. On the sender: the receiver's credit.
const READY: usize = 0;
const CREDIT: usize = 0;

/// One rank's control area over model memory that lives as long as the area is used.
struct Rank {
    area: ControlArea,
    /// Owns the words `area` points to; boxed so they never move.
    _memory: Box<ModelMemory>,
}

impl Rank {
    fn new(rank: usize, num_slots: usize) -> Arc<Rank> {
        let memory = Box::new(ControlArea::model_memory(num_slots));
        // SAFETY: the model memory was built for `num_slots` slots and is owned by the returned
        // `Rank` next to the area, so it outlives every use of the area.
        let area = unsafe { ControlArea::init(memory.base(), num_slots, rank, 8, 1) };
        Arc::new(Rank {
            area,
            _memory: memory,
        })
    }

    /// Waits on this rank's area, without a liveness failure and with a far deadline, until
    /// `poll` is done.
    fn wait(&self, mut poll: impl FnMut() -> Option<Waiting>) -> crate::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(3600);
        self.area.wait_with(
            SLEEP_AT_ONCE,
            &WaitState::default(),
            deadline,
            &mut poll,
            &|_| Ok(()),
        )
    }
}

/// The receive buffers: `max_in_flight` buffers of chunks, each chunk one model cell that the
/// sender writes and the receiver reads.
struct Buffers(Vec<Vec<UnsafeCell<[u64; 2]>>>);

// SAFETY: the cells are shared between the two model threads on purpose: the protocol under test
// is what must keep their accesses apart, and loom checks every access against it.
unsafe impl Sync for Buffers {}

impl std::ops::Index<usize> for Buffers {
    type Output = [UnsafeCell<[u64; 2]>];
    fn index(&self, buffer: usize) -> &Self::Output {
        &self.0[buffer]
    }
}

/// What chunk `chunk` of call `epoch` holds.
fn payload(epoch: u64, chunk: usize) -> [u64; 2] {
    [epoch, !epoch ^ chunk as u64]
}

/// One sender streams `epochs` calls of `chunks` chunks each to one receiver through
/// `max_in_flight` buffers, as dispatch and combine do: per call it waits for the credit of its
/// buffer's previous call, then writes each chunk and signals `progress(epoch, chunks so far)`;
/// the receiver waits for each chunk's progress, reads it and checks it, then credits the epoch.
fn stream(max_in_flight: usize, epochs: u64, chunks: usize) {
    loom::model(move || {
        let sender = Rank::new(SENDER, 1);
        let receiver = Rank::new(RECEIVER, 1);
        // As `Communicator::new` does: "call `epoch_base` complete" before any peer signals.
        receiver
            .area
            .store(READY, progress(EPOCH_BASE, 0), RECEIVER)
            .expect("initial progress");
        let buffers = Arc::new(Buffers(
            (0..max_in_flight)
                .map(|_| (0..chunks).map(|_| UnsafeCell::new([0; 2])).collect())
                .collect(),
        ));
        let calls = move || (1..=epochs).map(|i| EPOCH_BASE + i);
        let buffer_of = move |epoch: u64| (epoch % max_in_flight as u64) as usize;

        let send = {
            let (sender, receiver, buffers) = (sender.clone(), receiver.clone(), buffers.clone());
            thread::spawn(move || {
                for epoch in calls() {
                    if let Some(need) = reuse_credit(epoch, EPOCH_BASE, max_in_flight) {
                        sender
                            .wait(|| {
                                (sender.area.load(CREDIT) < need)
                                    .then_some(Waiting::on(RECEIVER, "credit"))
                            })
                            .expect("credit wait");
                    }
                    let credit = sender.area.load(CREDIT);
                    assert!(
                        credit < epoch,
                        "credit {credit} for call {epoch}, which is not sent yet"
                    );
                    for (chunk, cell) in buffers[buffer_of(epoch)].iter().enumerate() {
                        cell.with_mut(|p| {
                            // SAFETY: `p` is the cell's own pointer; that no read races this
                            // write is what the model checks (loom fails the test if one does).
                            unsafe { *p = payload(epoch, chunk) }
                        });
                        receiver
                            .area
                            .store(READY, progress(epoch, chunk + 1), SENDER)
                            .expect("signal");
                    }
                }
            })
        };

        for epoch in calls() {
            for (chunk, cell) in buffers[buffer_of(epoch)].iter().enumerate() {
                receiver
                    .wait(|| {
                        let value = receiver.area.load(READY);
                        // Never a later call than the sender may have reached: it cannot get
                        // `max_in_flight` calls ahead of our credits.
                        let seen = value >> PROGRESS_ROW_BITS;
                        let ahead = seen.wrapping_sub(epoch) & EPOCH_MASK;
                        let behind = epoch.wrapping_sub(seen) & EPOCH_MASK;
                        assert!(
                            (ahead as usize) < max_in_flight || behind <= 1,
                            "waiting for call {epoch:#x}, the slot shows call {seen:#x}"
                        );
                        (Progress::of(value, epoch).rows(chunks) <= chunk)
                            .then_some(Waiting::on(SENDER, "rows"))
                    })
                    .expect("rows wait");
                let got = cell.with(|p| {
                    // SAFETY: `p` is the cell's own pointer; that this read is ordered after the
                    // write it must see is what the model checks (loom fails the test if not).
                    unsafe { *p }
                });
                assert_eq!(
                    got,
                    payload(epoch, chunk),
                    "call {epoch:#x} chunk {chunk}: stale data"
                );
            }
            sender.area.store(CREDIT, epoch, RECEIVER).expect("credit");
        }
        send.join().expect("sender");
    });
}

#[test]
fn loom_two_back_to_back_calls_through_one_buffer_deliver_each_calls_data_and_wait_for_its_credit()
{
    stream(1, 2, 1);
}

#[test]
fn loom_a_call_streamed_in_two_chunks_then_the_next_call_deliver_every_chunk_after_its_signal() {
    stream(1, 2, 2);
}

#[test]
fn loom_three_calls_through_two_buffers_reuse_a_buffer_only_after_its_credit() {
    stream(2, 3, 1);
}

#[test]
fn loom_a_waiter_going_to_sleep_as_the_signal_arrives_is_always_woken() {
    loom::model(|| {
        let receiver = Rank::new(RECEIVER, 1);
        let send = {
            let receiver = receiver.clone();
            thread::spawn(move || receiver.area.store(READY, 1, SENDER).expect("signal"))
        };
        receiver
            .wait(|| (receiver.area.load(READY) != 1).then_some(Waiting::on(SENDER, "a signal")))
            .expect("woken by the signal");
        send.join().expect("sender");
    });
}

#[test]
fn loom_a_waiter_sleeping_through_a_quiet_signal_is_woken_by_the_signal_after_it() {
    // A record's own signal is quiet (no wake-up), the rows' signal after it is not: a waiter
    // for the rows never sleeps through both.
    loom::model(|| {
        let receiver = Rank::new(RECEIVER, 1);
        let send = {
            let receiver = receiver.clone();
            thread::spawn(move || {
                receiver
                    .area
                    .store_quiet(READY, 1, SENDER)
                    .expect("quiet signal");
                receiver.area.store(READY, 2, SENDER).expect("signal");
            })
        };
        receiver
            .wait(|| (receiver.area.load(READY) != 2).then_some(Waiting::on(SENDER, "the rows")))
            .expect("woken by the second signal");
        send.join().expect("sender");
    });
}

#[test]
fn loom_a_waiter_for_two_senders_sleeping_between_their_signals_is_woken_by_the_last() {
    loom::model(|| {
        let receiver = Rank::new(RECEIVER, 2);
        let senders: Vec<_> = [0, 2]
            .into_iter()
            .enumerate()
            .map(|(slot, rank)| {
                let receiver = receiver.clone();
                thread::spawn(move || receiver.area.store(slot, 1, rank).expect("signal"))
            })
            .collect();
        receiver
            .wait(|| {
                [(0, 0), (1, 2)]
                    .into_iter()
                    .find(|&(slot, _)| receiver.area.load(slot) != 1)
                    .map(|(_, peer)| Waiting::on(peer, "a signal"))
            })
            .expect("woken by both signals");
        for s in senders {
            s.join().expect("sender");
        }
    });
}

/// 19 bytes: the reason spans three words, so a torn read would show.
const REASON: &str = "expert 3 is on fire";

/// The reason a waiter on `peer` reports for an abort with `reason`.
fn seen(reason: &str, peer: usize) -> String {
    format!("{reason} (seen while waiting for rank {peer})")
}

#[test]
fn loom_a_waiter_always_sees_a_concurrent_abort_with_its_whole_reason() {
    loom::model(|| {
        let waiter = Rank::new(RECEIVER, 1);
        let abort = {
            let waiter = waiter.clone();
            thread::spawn(move || waiter.area.set_abort(2, None, REASON))
        };
        let never = || Some(Waiting::on(SENDER, "a signal that never comes"));
        match waiter.wait(never) {
            Err(Error::Aborted { by: 2, reason }) => assert_eq!(reason, seen(REASON, SENDER)),
            other => panic!("expected the abort by rank 2, got {other:?}"),
        }
        abort.join().expect("aborter");
    });
}

#[test]
fn loom_of_two_concurrent_aborts_the_first_wins_and_its_reason_is_seen_whole() {
    const OTHER: &str = "ranks 4 and 5 disagree";
    loom::model(|| {
        let area = Rank::new(RECEIVER, 1);
        // Rank 3's abort reports rank 1's death: the dead word travels with its reason.
        let aborters: Vec<_> = [(2, None, REASON), (3, Some(1), OTHER)]
            .into_iter()
            .map(|(by, dead, reason)| {
                let area = area.clone();
                thread::spawn(move || area.area.set_abort(by, dead, reason))
            })
            .collect();
        let first = loop {
            if let Some(seen) = area.area.aborted_by() {
                break seen;
            }
            thread::yield_now();
        };
        let by = first.by;
        let whole = match by {
            2 => (None, REASON),
            3 => (Some(1), OTHER),
            _ => panic!("abort by rank {by}, which never aborted"),
        };
        assert_eq!(
            (first.dead, first.reason.as_str()),
            whole,
            "the record of rank {by}'s abort"
        );
        for a in aborters {
            a.join().expect("aborter");
        }
        assert_eq!(
            area.area.aborted_by(),
            Some(first),
            "a later abort changed the first"
        );
    });
}
