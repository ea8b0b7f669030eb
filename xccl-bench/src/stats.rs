//! `--stats`: what each rank's communicator counted over the whole run (records written and
//! polled, rows, bytes and time waited per peer, relay forwards), gathered on rank 0 and printed
//! beside the formula they should match.

use std::fmt::Write as _;
use std::time::Duration;

use xccl::{Communicator, PeerStats, Stats};

/// One rank's counters and window size, as rank 0 receives them.
#[derive(Clone, Debug, Default)]
pub struct RankStats {
    /// Bytes of the rank's window.
    pub window_bytes: u64,
    /// What it counted.
    pub stats: Stats,
}

/// Serialises `comm`'s totals for the bootstrap allgather.
pub fn encode(comm: &Communicator) -> Vec<u8> {
    let s = comm.total_stats();
    let mut w = vec![
        comm.window_bytes() as u64,
        s.calls,
        s.records_written,
        s.records_polled,
        s.relay_rows_forwarded,
        s.peers.len() as u64,
    ];
    for p in &s.peers {
        w.extend([
            p.rows_sent,
            p.rows_received,
            p.bytes_put,
            p.bytes_got,
            p.waited.as_nanos() as u64,
        ]);
    }
    w.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Inverse of [`encode`].
pub fn decode(blob: &[u8]) -> Result<RankStats, String> {
    let w: Vec<u64> = blob
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let get = |i: usize| w.get(i).copied().ok_or("truncated stats".to_string());
    let n = get(5)? as usize;
    let mut peers = Vec::with_capacity(n);
    for p in 0..n {
        let b = 6 + 5 * p;
        peers.push(PeerStats {
            rows_sent: get(b)?,
            rows_received: get(b + 1)?,
            bytes_put: get(b + 2)?,
            bytes_got: get(b + 3)?,
            waited: Duration::from_nanos(get(b + 4)?),
        });
    }
    Ok(RankStats {
        window_bytes: get(0)?,
        stats: Stats {
            calls: get(1)?,
            records_written: get(2)?,
            records_polled: get(3)?,
            relay_rows_forwarded: get(4)?,
            peers,
            ..Stats::default()
        },
    })
}

/// The report: per rank, records, forwards, window bytes, fan-out and the slowest peer; then
/// rank 0's per-peer table. `rounds` A2E+E2A round trips ran (warmup and checks included),
/// `formula` is the records one A2E writes by formula (E2A writes as many).
pub fn table(ranks: &[RankStats], rounds: u64, formula: usize) -> String {
    let mut out = String::new();
    let written: u64 = ranks.iter().map(|r| r.stats.records_written).sum();
    let polled: u64 = ranks.iter().map(|r| r.stats.records_polled).sum();
    let _ = writeln!(
        out,
        "# stats: {written} records written, {polled} polled over {rounds} round trips: {:.1} per \
         A2E+E2A (formula 2 x {formula} = {})",
        written as f64 / rounds.max(1) as f64,
        2 * formula
    );
    let _ = writeln!(
        out,
        "# {:>5} {:>9} {:>9} {:>9} {:>12} {:>7} {:>12} {:>12}",
        "rank", "written", "polled", "forwards", "window_B", "fan_out", "slowest", "waited_us"
    );
    for (r, s) in ranks.iter().enumerate() {
        let fan_out = s
            .stats
            .peers
            .iter()
            .enumerate()
            .filter(|&(p, x)| p != r && x.rows_sent + x.bytes_put > 0)
            .count();
        let (slow, waited) = s.stats.slowest_peer().unwrap_or((r, Duration::ZERO));
        let straggler = if s.stats.straggler().is_some() {
            " straggler"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "# {r:>5} {:>9} {:>9} {:>9} {:>12} {fan_out:>7} {:>12} {:>12.1}{straggler}",
            s.stats.records_written,
            s.stats.records_polled,
            s.stats.relay_rows_forwarded,
            s.window_bytes,
            format!("rank {slow}"),
            waited.as_secs_f64() * 1e6
        );
    }
    if let Some(r0) = ranks.first() {
        let _ = writeln!(
            out,
            "# rank 0 per peer: {:>5} {:>10} {:>10} {:>12} {:>12} {:>11}",
            "peer", "rows_sent", "rows_recv", "bytes_put", "bytes_got", "waited_us"
        );
        for (p, x) in r0.stats.peers.iter().enumerate() {
            if *x == PeerStats::default() {
                continue;
            }
            let _ = writeln!(
                out,
                "#                   {p:>5} {:>10} {:>10} {:>12} {:>12} {:>11.1}",
                x.rows_sent,
                x.rows_received,
                x.bytes_put,
                x.bytes_got,
                x.waited.as_secs_f64() * 1e6
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_round_trip_through_the_encoding() {
        let mut s = Stats {
            calls: 3,
            records_written: 7,
            records_polled: 5,
            relay_rows_forwarded: 11,
            peers: vec![PeerStats::default(); 2],
            ..Stats::default()
        };
        s.peers[1].waited = Duration::from_micros(250);
        s.peers[1].rows_sent = 4;
        let mut w = vec![4096u64, 3, 7, 5, 11, 2];
        for p in &s.peers {
            w.extend([
                p.rows_sent,
                p.rows_received,
                p.bytes_put,
                p.bytes_got,
                p.waited.as_nanos() as u64,
            ]);
        }
        let blob: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = decode(&blob).unwrap();
        assert_eq!(got.stats, s);
        assert_eq!(got.window_bytes, 4096);
        assert!(table(&[got], 1, 3).contains("records written"));
    }
}
