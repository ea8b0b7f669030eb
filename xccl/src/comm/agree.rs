//! The init agreement: before any window is sized, every rank sends the fields that must be
//! equal on every rank, **by name**, through one bootstrap allgather, and every rank compares
//! every peer's with its own. A mismatch fails every rank at once with an error naming each
//! field that differs and both values, instead of one rank finding a window too small and the
//! others a peer that left. A rank whose own init failed before (a bad config) sends its
//! reason instead ([`report_failure`]), so the others fail within the round, with that reason,
//! instead of waiting out their timeout.

use std::time::Duration;

use crate::bootstrap::Exchange;
use crate::moe::config::MoeConfig;
use crate::topology::{Role, Topology};
use crate::{Error, Result};

const MAGIC: &str = "XCCLAGREE1";

/// The named fields of this rank: `(name, value)`, in a fixed order.
fn fields(topo: &Topology, cfg: &MoeConfig) -> Vec<(&'static str, String)> {
    let roles: String = (0..topo.world_size())
        .map(|r| match topo.role(r) {
            Role::Attention => 'A',
            Role::Expert => 'E',
        })
        .collect();
    vec![
        ("world size", topo.world_size().to_string()),
        ("roles", roles),
        (
            "numAttentionRanks (attention ranks)",
            topo.attention_ranks().len().to_string(),
        ),
        (
            "numExpertRanks (expert ranks)",
            topo.expert_ranks().len().to_string(),
        ),
        ("numExperts (experts)", topo.num_experts().to_string()),
        (
            "placement (expert placement, replicas, relays, DP domains)",
            format!("{:016x}", topo.fingerprint()),
        ),
        ("hidden", cfg.hidden.to_string()),
        ("dtype", cfg.dtype.name().to_string()),
        ("topk", cfg.topk.to_string()),
        (
            "maxTokensPerRank (max_tokens_per_rank)",
            cfg.max_tokens_per_rank.to_string(),
        ),
        (
            "recvCapacity (rows received per source)",
            cfg.recv_rows_per_source().to_string(),
        ),
        ("maxInFlight (max_in_flight)", cfg.max_in_flight.to_string()),
        ("epoch_base", cfg.epoch_base.to_string()),
    ]
}

fn encode(fields: &[(&'static str, String)]) -> Vec<u8> {
    let mut s = String::from(MAGIC);
    for (k, v) in fields {
        s.push('\n');
        s.push_str(k);
        s.push('=');
        s.push_str(v);
    }
    s.into_bytes()
}

/// What a peer sent: its fields, or the reason its init failed.
enum Peer {
    Fields(Vec<(String, String)>),
    Failed(String),
}

fn decode(peer: usize, blob: &[u8]) -> Result<Peer> {
    let bad = || Error::Protocol {
        peer,
        detail: format!("rank {peer} sent no init agreement (not an xccl init of this version)"),
    };
    let s = std::str::from_utf8(blob).map_err(|_| bad())?;
    let mut lines = s.split('\n');
    if lines.next() != Some(MAGIC) {
        return Err(bad());
    }
    let mut out = Vec::new();
    for line in lines {
        let (k, v) = line.split_once('=').ok_or_else(bad)?;
        if k == "failed" {
            return Ok(Peer::Failed(v.to_string()));
        }
        out.push((k.to_string(), v.to_string()));
    }
    Ok(Peer::Fields(out))
}

/// The init agreement of this rank (collective: every rank of `exchange` calls it, or
/// [`report_failure`], once, before sizing its window). Fails on every rank when any rank's
/// fields differ, naming each differing field and both values (the first such peer's), or when
/// a rank reported a failed init, with its reason.
pub(crate) fn agree(
    exchange: &dyn Exchange,
    topo: &Topology,
    cfg: &MoeConfig,
    timeout: Duration,
) -> Result<()> {
    let mine = fields(topo, cfg);
    let me = exchange.rank();
    let blobs = exchange.allgather(&encode(&mine), timeout)?;
    let mut failed = Vec::new();
    let mut first_mismatch = None;
    for (peer, blob) in blobs.iter().enumerate() {
        if peer == me {
            continue;
        }
        match decode(peer, blob)? {
            Peer::Failed(reason) => failed.push(format!("rank {peer}: {reason}")),
            Peer::Fields(theirs) if first_mismatch.is_none() => {
                let diffs: Vec<String> = mine
                    .iter()
                    .map(|(k, v)| {
                        let t = theirs.iter().find(|(tk, _)| tk == k).map(|(_, tv)| tv);
                        (k, v, t)
                    })
                    .filter(|(_, v, t)| *t != Some(*v))
                    .map(|(k, v, t)| {
                        let t = t.map_or("(missing)", |t| t.as_str());
                        format!("{k}: rank {peer} has {t}, rank {me} has {v}")
                    })
                    .collect();
                if !diffs.is_empty() {
                    first_mismatch = Some((peer, diffs.join("; ")));
                }
            }
            Peer::Fields(_) => {}
        }
    }
    if !failed.is_empty() {
        let peer = failed[0]
            .trim_start_matches("rank ")
            .split(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(me);
        return Err(Error::Protocol {
            peer,
            detail: format!(
                "the init of another rank failed, so this job cannot start: {}",
                failed.join("; ")
            ),
        });
    }
    if let Some((peer, detail)) = first_mismatch {
        return Err(Error::Protocol {
            peer,
            detail: format!("ranks were initialised with different configs: {detail}"),
        });
    }
    Ok(())
}

/// The reason in a blob of [`report_failure`], if `blob` is one (other rounds that may meet
/// it, such as `bootstrap::gather_roles`, report it too).
pub(crate) fn failure_in(blob: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(blob).ok()?;
    let rest = s.strip_prefix(MAGIC)?.strip_prefix("\nfailed=")?;
    Some(rest.to_string())
}

/// Tells every rank, in the agreement round, that this rank's init failed with `reason`, so
/// that their [`agree`] fails at once with it. Best effort: errors are ignored (the caller
/// returns its own failure either way).
pub(crate) fn report_failure(exchange: &dyn Exchange, reason: &str, timeout: Duration) {
    let blob = format!("{MAGIC}\nfailed={}", reason.replace('\n', " "));
    let _ = exchange.allgather(blob.as_bytes(), timeout);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::ThreadExchange;
    use crate::DType;

    fn run(cfgs: Vec<Option<MoeConfig>>) -> Vec<Result<()>> {
        let topo = Topology::contiguous(1, 2, 4).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = ThreadExchange::group(cfgs.len())
                .into_iter()
                .zip(cfgs)
                .map(|(ex, cfg)| {
                    let topo = &topo;
                    s.spawn(move || match cfg {
                        Some(cfg) => agree(&ex, topo, &cfg, Duration::from_secs(10)),
                        None => {
                            report_failure(&ex, "config.hidden is unset", Duration::from_secs(10));
                            Ok(())
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_names_every_differing_field_and_both_values() {
        let base = MoeConfig::new(64, DType::BF16, 2, 8);
        let mut other = base.clone();
        other.hidden = 128;
        other.max_in_flight = 1;
        other.dtype = DType::F32;
        let results = run(vec![Some(base.clone()), Some(other), Some(base)]);
        for (rank, r) in results.iter().enumerate() {
            let msg = r.as_ref().unwrap_err().to_string();
            for want in ["hidden", "maxInFlight", "dtype", "128", "64", "bf16", "f32"] {
                assert!(msg.contains(want), "rank {rank}: {want} missing from {msg}");
            }
        }
        // Rank 1 names rank 0 (its first differing peer); the others name rank 1.
        assert!(results[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("rank 0 has 64"));
        assert!(results[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("rank 1 has 128"));
    }

    #[test]
    fn a_rank_whose_init_failed_fails_the_others_with_its_reason() {
        let base = MoeConfig::new(64, DType::BF16, 2, 8);
        let results = run(vec![Some(base.clone()), None, Some(base)]);
        for r in [&results[0], &results[2]] {
            match r {
                Err(Error::Protocol { peer: 1, detail }) => {
                    assert!(
                        detail.contains("rank 1: config.hidden is unset"),
                        "{detail}"
                    )
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn equal_configs_agree() {
        let base = MoeConfig::new(64, DType::BF16, 2, 8);
        for r in run(vec![Some(base.clone()), Some(base.clone()), Some(base)]) {
            r.unwrap();
        }
    }
}
