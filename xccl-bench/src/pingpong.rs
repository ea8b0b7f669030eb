//! The ofi limit: libfabric's own benchmark, `fi_pingpong` (package `libfabric-bin`), run by the
//! rank processes of an `--fabric ofi` run after their timed calls, in the same run, as the
//! two-process copy is for shm ([`crate::limit`]).
//!
//! Attention rank 0 starts the server and expert rank `M` the client (`-p tcp -e rdm`, loopback
//! by default: `XCCL_BENCH_FI_ADDR` names another address of rank 0's host), once per message
//! size: one row (the latency figure) and the bytes one attention rank sends in the largest
//! call (the bandwidth figure). fi_pingpong bounces one message back and forth and prints
//! `usec/xfer` (one way) and `MB/sec` (bytes moved both ways over the time): the figures xccl's
//! A2E p50 (one way) and round-trip algbw are set beside. Ranks synchronise through the
//! bootstrap, so no rank touches the fabric meanwhile.

use std::process::{Command, Stdio};
use std::time::Duration;

use xccl::bootstrap::Exchange;

/// One fi_pingpong measurement.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PingPong {
    /// Message bytes.
    pub bytes: usize,
    /// One-way time per transfer, microseconds.
    pub usec_per_xfer: f64,
    /// Bytes moved (both ways) per second over the run, in MB/s (10^6 bytes).
    pub mb_per_sec: f64,
}

/// Parses fi_pingpong's table: a header line starting with `bytes`, then one line per size
/// (`bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec`).
pub fn parse(text: &str) -> Vec<PingPong> {
    let mut out = Vec::new();
    let mut header: Option<Vec<&str>> = None;
    for line in text.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.first() == Some(&"bytes") {
            header = Some(cols);
            continue;
        }
        let Some(h) = &header else { continue };
        if cols.len() != h.len() {
            continue;
        }
        let col = |name: &str| h.iter().position(|&c| c == name).map(|i| cols[i]);
        let (Some(b), Some(mb), Some(us)) = (col("bytes"), col("MB/sec"), col("usec/xfer")) else {
            continue;
        };
        let (Some(bytes), Ok(mb_per_sec), Ok(usec_per_xfer)) = (size(b), mb.parse(), us.parse())
        else {
            continue;
        };
        out.push(PingPong {
            bytes,
            usec_per_xfer,
            mb_per_sec,
        });
    }
    out
}

/// fi_pingpong's size column: `64`, `1k`, `1m`, `1g` (powers of 1024), rounded to one decimal
/// for sizes that are not a whole multiple (`3.4m` for 3,655,680 bytes).
fn size(s: &str) -> Option<usize> {
    let (num, mult) = match s.chars().last()? {
        'k' => (&s[..s.len() - 1], 1u64 << 10),
        'm' => (&s[..s.len() - 1], 1 << 20),
        'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    if let Ok(n) = num.parse::<usize>() {
        return Some(n * mult as usize);
    }
    let x = num
        .parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x >= 0.0)?;
    Some((x * mult as f64).round() as usize)
}

/// Iterations fi_pingpong runs for a message of `bytes` (about 8 MiB each way, 100 to 2000).
fn iterations(bytes: usize) -> usize {
    ((8 << 20) / bytes.max(1)).clamp(100, 2000)
}

/// Runs fi_pingpong for each of `sizes` between rank 0 (server) and rank `client`; every rank
/// of the job calls it. Returns, on rank 0, the measurements or why there are none.
pub fn run(
    exchange: &dyn Exchange,
    rank: usize,
    client: usize,
    sizes: &[usize],
    timeout: Duration,
) -> Result<Vec<PingPong>, String> {
    let port = 20_000 + (exchange.job_id() % 20_000) as u16;
    let addr = std::env::var("XCCL_BENCH_FI_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let mut results = Vec::new();
    let mut why = None;
    for (i, &bytes) in sizes.iter().enumerate() {
        let port = (port + i as u16).to_string();
        let common = [
            "-p".to_string(),
            "tcp".into(),
            "-e".into(),
            "rdm".into(),
            "-I".into(),
            iterations(bytes).to_string(),
            "-S".into(),
            bytes.to_string(),
        ];
        let server = if rank == 0 {
            match Command::new("fi_pingpong")
                .args(&common)
                .args(["-B", &port])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
            {
                Ok(c) => {
                    // The server binds before the client is let go.
                    std::thread::sleep(Duration::from_millis(300));
                    Some(c)
                }
                Err(e) => {
                    why = Some(format!("fi_pingpong not run ({e}; package libfabric-bin)"));
                    None
                }
            }
        } else {
            None
        };
        exchange
            .barrier(timeout)
            .map_err(|e| format!("fi_pingpong: {e}"))?;
        if rank == client {
            // The server may still be binding: a few tries.
            for _ in 0..10 {
                let ok = Command::new("fi_pingpong")
                    .args(&common)
                    .args(["-P", &port, &addr])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if ok {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        if let Some(child) = server {
            match child.wait_with_output() {
                Ok(out) if out.status.success() => {
                    let text = String::from_utf8_lossy(&out.stdout);
                    match parse(&text).first() {
                        // The size asked for, exactly: fi_pingpong prints it rounded
                        // (`1.7m`), and the ratios look its row up by the call's bytes.
                        Some(p) => results.push(PingPong { bytes, ..*p }),
                        None => {
                            why = Some(format!(
                                "fi_pingpong printed no figures for {bytes} B: {:?}",
                                text.trim()
                            ))
                        }
                    }
                }
                Ok(out) => {
                    why = Some(format!(
                        "fi_pingpong server failed ({}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ))
                }
                Err(e) => why = Some(format!("fi_pingpong server: {e}")),
            }
        }
        exchange
            .barrier(timeout)
            .map_err(|e| format!("fi_pingpong: {e}"))?;
    }
    match why {
        Some(w) if rank == 0 => Err(w),
        _ => Ok(results),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_fi_pingpong_rounds_to_one_decimal_still_parses() {
        let text =
            "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
                    3.4m    100     =100     697m        0.20s   3674.79     994.80       0.00\n";
        let rows = parse(text);
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].bytes, (3.4 * (1u64 << 20) as f64).round() as usize);
        assert_eq!(rows[0].usec_per_xfer, 994.80);
        assert_eq!(rows[0].mb_per_sec, 3674.79);
    }

    #[test]
    fn fi_pingpong_tables_parse_with_their_size_suffixes() {
        let text =
            "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
                    64      1k      =1k      125k        6.45s      0.02    3227.29       0.00\n\
                    1m      200     =200     400m       13.88s     30.21   34708.61       0.00\n";
        assert_eq!(
            parse(text),
            vec![
                PingPong {
                    bytes: 64,
                    usec_per_xfer: 3227.29,
                    mb_per_sec: 0.02
                },
                PingPong {
                    bytes: 1 << 20,
                    usec_per_xfer: 34708.61,
                    mb_per_sec: 30.21
                },
            ]
        );
        assert!(parse("no table here\n").is_empty());
    }
}
