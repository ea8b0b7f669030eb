//! [`Stats`]: what a communicator counted — per call and in total.
//!
//! Every figure comes from running the protocol: records are counted where they are written and
//! where they are read, rows where records announce them, bytes at every `put` and `get`, and
//! time waited at every wait, charged to the peer the wait was for (the first one missing each
//! time the wait looked).

use std::time::Duration;

/// What one rank exchanged with one peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerStats {
    /// Metadata records this rank wrote into the peer's window (relay headers included).
    pub records: u64,
    /// Rows this rank announced to the peer in records it wrote.
    pub rows_sent: u64,
    /// Rows the peer announced to this rank in records this rank read.
    pub rows_received: u64,
    /// Bytes this rank wrote into the peer's window (`put`), records and rows.
    pub bytes_put: u64,
    /// Bytes this rank read from the peer's window (`get`: pulled rows).
    pub bytes_got: u64,
    /// Time this rank waited for the peer (signals, records, rows, credits).
    pub waited: Duration,
}

impl PeerStats {
    fn add(&mut self, o: &PeerStats) {
        self.records += o.records;
        self.rows_sent += o.rows_sent;
        self.rows_received += o.rows_received;
        self.bytes_put += o.bytes_put;
        self.bytes_got += o.bytes_got;
        self.waited += o.waited;
    }
}

/// Counters of one rank: of one call ([`crate::Communicator::last_call_stats`]) or of every
/// call so far ([`crate::Communicator::total_stats`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Calls counted.
    pub calls: u64,
    /// Metadata records this rank wrote (one per message, relay headers included).
    pub records_written: u64,
    /// Metadata records this rank read and validated.
    pub records_polled: u64,
    /// Rows this rank forwarded as a relay (A2E rows to final expert ranks and reduced E2A rows
    /// to attention ranks; none on a fabric with load/store access, where those ranks read them
    /// on the relay).
    pub relay_rows_forwarded: u64,
    /// Time this rank spent as a relay forwarding A2E rows (from the start of its forwarding to
    /// its last header), waits included.
    pub relay_forward: Duration,
    /// Time this rank spent as a relay in the E2A (from the start of its reduction to its last
    /// reduced row signalled), waits included.
    pub relay_combine: Duration,
    /// The part of `relay_combine` spent reducing and writing rows (not waiting for replies).
    pub relay_reduce: Duration,
    /// Expert selections (`topk_idx` entries) this attention rank dropped because their expert
    /// has no replica left after a shrink with `ShrinkOptions::drop_orphaned_experts`.
    pub dropped_slots: u64,
    /// Per global rank (this rank's own entry counts writes into its own window).
    pub peers: Vec<PeerStats>,
}

impl Clone for Stats {
    fn clone(&self) -> Self {
        let mut s = Stats::default();
        s.clone_from(self);
        s
    }

    /// Field by field, reusing `self.peers` (every call copies its counters this way: no
    /// allocation once the per-peer table has its size).
    fn clone_from(&mut self, source: &Self) {
        // Destructured, so a field added later cannot be left out.
        let Stats {
            calls,
            records_written,
            records_polled,
            relay_rows_forwarded,
            relay_forward,
            relay_combine,
            relay_reduce,
            dropped_slots,
            peers,
        } = source;
        self.calls = *calls;
        self.records_written = *records_written;
        self.records_polled = *records_polled;
        self.relay_rows_forwarded = *relay_rows_forwarded;
        self.relay_forward = *relay_forward;
        self.relay_combine = *relay_combine;
        self.relay_reduce = *relay_reduce;
        self.dropped_slots = *dropped_slots;
        self.peers.clone_from(peers);
    }
}

/// A peer waited on more than this many times as long as the median of the peers waited on
/// is a straggler ([`Stats::straggler`]).
pub const STRAGGLER_FACTOR: u32 = 4;

/// Waits shorter than this are noise, never a straggler.
pub const STRAGGLER_MIN: Duration = Duration::from_micros(200);

impl Stats {
    pub(crate) fn new(world: usize) -> Self {
        Stats {
            peers: vec![PeerStats::default(); world],
            ..Stats::default()
        }
    }

    /// Zeroes every counter in place (a call's counters start here; no allocation).
    pub(crate) fn clear(&mut self) {
        let mut peers = std::mem::take(&mut self.peers);
        peers.fill(PeerStats::default());
        *self = Stats {
            peers,
            ..Stats::default()
        };
    }

    pub(crate) fn add(&mut self, o: &Stats) {
        self.calls += o.calls;
        self.records_written += o.records_written;
        self.records_polled += o.records_polled;
        self.relay_rows_forwarded += o.relay_rows_forwarded;
        self.relay_forward += o.relay_forward;
        self.relay_combine += o.relay_combine;
        self.relay_reduce += o.relay_reduce;
        self.dropped_slots += o.dropped_slots;
        if self.peers.len() < o.peers.len() {
            self.peers.resize(o.peers.len(), PeerStats::default());
        }
        for (a, b) in self.peers.iter_mut().zip(&o.peers) {
            a.add(b);
        }
    }

    /// The peer waited on longest, and for how long (`None` when no wait took any time).
    pub fn slowest_peer(&self) -> Option<(usize, Duration)> {
        self.peers
            .iter()
            .enumerate()
            .map(|(p, s)| (p, s.waited))
            .filter(|(_, w)| !w.is_zero())
            .max_by_key(|&(p, w)| (w, std::cmp::Reverse(p)))
    }

    /// The straggler: the slowest peer, when it was waited on at least [`STRAGGLER_MIN`] and
    /// more than [`STRAGGLER_FACTOR`] times the median wait of the peers waited on at all (with
    /// a single peer waited on, as an attention rank with a relay has, there is nothing to
    /// compare: no straggler).
    pub fn straggler(&self) -> Option<usize> {
        let (peer, worst) = self.slowest_peer()?;
        let mut waits: Vec<Duration> = self
            .peers
            .iter()
            .map(|s| s.waited)
            .filter(|w| !w.is_zero())
            .collect();
        waits.sort_unstable();
        let median = waits[waits.len() / 2];
        (worst >= STRAGGLER_MIN && waits.len() > 1 && worst > median * STRAGGLER_FACTOR)
            .then_some(peer)
    }

    /// Total bytes put into peers' windows (this rank's own excluded).
    pub fn bytes_put_to_peers(&self, me: usize) -> u64 {
        self.peers
            .iter()
            .enumerate()
            .filter(|&(p, _)| p != me)
            .map(|(_, s)| s.bytes_put)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn straggler_is_named_only_when_far_slower_than_the_rest() {
        let mut s = Stats::new(4);
        assert_eq!(s.straggler(), None);
        for (p, us) in [(0, 300), (1, 310), (2, 290)] {
            s.peers[p].waited = Duration::from_micros(us);
        }
        assert_eq!(s.slowest_peer(), Some((1, Duration::from_micros(310))));
        assert_eq!(s.straggler(), None);
        s.peers[3].waited = Duration::from_millis(5);
        assert_eq!(s.straggler(), Some(3));
        let mut t = Stats::new(4);
        t.add(&s);
        t.add(&s);
        assert_eq!(t.peers[3].waited, Duration::from_millis(10));
    }

    #[test]
    fn a_copy_of_the_counters_has_every_field_of_its_source() {
        let s = Stats {
            calls: 1,
            records_written: 2,
            records_polled: 3,
            relay_rows_forwarded: 4,
            relay_forward: Duration::from_micros(5),
            relay_combine: Duration::from_micros(6),
            relay_reduce: Duration::from_micros(7),
            dropped_slots: 8,
            peers: vec![
                PeerStats {
                    records: 9,
                    ..PeerStats::default()
                };
                3
            ],
        };
        let mut t = Stats::new(5);
        t.records_polled = 99;
        t.clone_from(&s);
        assert_eq!(t, s);
        assert_eq!(s.clone(), s);
    }
}
