//! `xccl-bench memory`: the window bytes each kind of rank registers at a shape, direct and with
//! relays and DP domains, computed by the library's own layout
//! ([`Communicator::window_lens`], the function every fabric's init sizes its window with).
//! Nothing is allocated and no rank runs, so the real decode shape (160 x 288, H=7168) is shown
//! on any machine.

use std::fmt::Write as _;

use xccl::{Communicator, MoeConfig, Role, Topology};

use crate::cli::{MemoryArgs, QuantChoice};

/// Window bytes of one variant of the shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// Relays (0: direct).
    pub relays: usize,
    /// DP domains.
    pub domains: usize,
    /// Receive capacity per source (0: the worst case).
    pub recv_capacity: usize,
    /// Calls in flight (buffers per region).
    pub in_flight: usize,
    /// Largest attention rank window.
    pub attention: usize,
    /// Largest window of an expert rank that is not a relay.
    pub expert: usize,
    /// Largest relay window (0 without relays).
    pub relay: usize,
    /// Every rank's window added up.
    pub total: u64,
}

/// The topology and config of one variant: experts contiguous over the expert ranks.
fn shape(
    a: &MemoryArgs,
    relays: usize,
    domains: usize,
    recv_capacity: usize,
) -> xccl::Result<(Topology, MoeConfig, usize)> {
    let topo = Topology::contiguous(a.attention, a.experts, a.num_experts)?;
    let topo = if relays > 0 {
        topo.with_relays(Some(relays))?
    } else {
        topo
    };
    let topo = topo.with_domains(domains)?;
    let mut cfg = MoeConfig::new(a.hidden, a.dtype, a.topk, a.tokens);
    cfg.recv_capacity = recv_capacity;
    // Domains take turns with one call in flight (the library rejects more).
    cfg.max_in_flight = if domains > 1 { 1 } else { a.in_flight };
    if a.quant == QuantChoice::Int8 {
        cfg.a2e_quant = xccl::Quant::Int8;
        cfg.e2a_quant = xccl::Quant::Int8;
    }
    let depth = cfg.max_in_flight;
    Ok((topo, cfg, depth))
}

/// The footprint of every (relays, domains, receive capacity) the flags list, in that order.
pub fn footprints(a: &MemoryArgs) -> xccl::Result<Vec<Footprint>> {
    let mut out = Vec::new();
    let variants = a.relays.iter().flat_map(|&r| {
        a.domains
            .iter()
            .flat_map(move |&d| a.recv_capacity.iter().map(move |&c| (r, d, c)))
    });
    for (relays, domains, recv_capacity) in variants {
        {
            let (topo, cfg, in_flight) = shape(a, relays, domains, recv_capacity)?;
            let lens = Communicator::window_lens(&topo, &cfg)?;
            let is_relay = |r: usize| {
                topo.relay_plan()
                    .is_some_and(|p| p.relay_index(r).is_some())
            };
            let max = |f: &dyn Fn(usize) -> bool| {
                (0..lens.len())
                    .filter(|&r| f(r))
                    .map(|r| lens[r])
                    .max()
                    .unwrap_or(0)
            };
            out.push(Footprint {
                relays,
                domains,
                recv_capacity,
                in_flight,
                attention: max(&|r| topo.role(r) == Role::Attention),
                expert: max(&|r| topo.role(r) == Role::Expert && !is_relay(r)),
                relay: max(&is_relay),
                total: lens.iter().map(|&l| l as u64).sum(),
            });
        }
    }
    Ok(out)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The report printed by `xccl-bench memory`.
pub fn report(a: &MemoryArgs) -> xccl::Result<String> {
    let rows = footprints(a)?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# xccl-bench memory: {}A:{}E, {} experts, top-{}, H={} {}, {} tokens per attention rank, \
         quant {} (windows keep room for either row format)",
        a.attention,
        a.experts,
        a.num_experts,
        a.topk,
        a.hidden,
        a.dtype.name(),
        a.tokens,
        format!("{:?}", a.quant).to_lowercase()
    );
    let _ = writeln!(
        s,
        "# window bytes per rank from Communicator::window_lens (MiB = 2^20 bytes)"
    );
    let _ = writeln!(
        s,
        "# {:>6} {:>7} {:>8} {:>9} {:>14} {:>14} {:>14} {:>12}",
        "relays",
        "domains",
        "recv_cap",
        "in_flight",
        "attention_MiB",
        "expert_MiB",
        "relay_MiB",
        "job_GiB"
    );
    for f in &rows {
        let _ = writeln!(
            s,
            "  {:>6} {:>7} {:>8} {:>9} {:>14.1} {:>14.1} {:>14} {:>12.2}",
            f.relays,
            f.domains,
            if f.recv_capacity == 0 {
                "all".to_string()
            } else {
                f.recv_capacity.to_string()
            },
            f.in_flight,
            mib(f.attention as u64),
            mib(f.expert as u64),
            if f.relays > 0 {
                format!("{:.1}", mib(f.relay as u64))
            } else {
                "-".into()
            },
            f.total as f64 / (1u64 << 30) as f64
        );
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> MemoryArgs {
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            m: MemoryArgs,
        }
        P::parse_from(std::iter::once("memory").chain(extra.iter().copied())).m
    }

    #[test]
    fn expert_windows_shrink_with_domains_and_receive_capacity_and_relays_carry_member_areas() {
        let a = args(&[
            "-a",
            "12",
            "-e",
            "6",
            "--num-experts",
            "12",
            "-k",
            "2",
            "--hidden",
            "1024",
            "-t",
            "8",
            "--relays",
            "0,2",
            "--domains",
            "1,3",
            "--recv-capacity",
            "0,2",
        ]);
        let f = footprints(&a).unwrap();
        assert_eq!(f.len(), 8);
        let (direct1, capped, direct3, relay1) = (&f[0], &f[1], &f[2], &f[4]);
        assert_eq!((capped.recv_capacity, capped.domains), (2, 1));
        // 2 rows per source instead of 8: receive areas and staging shrink (pages round them).
        assert!(
            capped.expert * 2 < direct1.expert,
            "{capped:?} vs {direct1:?}"
        );
        assert_eq!(capped.attention, direct1.attention);
        assert_eq!((direct1.relays, direct1.domains), (0, 1));
        // One domain's receive areas (4 of 12 sources) and one buffer instead of two.
        assert!(
            direct3.expert * 3 < direct1.expert,
            "{direct3:?} vs {direct1:?}"
        );
        assert!(
            relay1.relay > relay1.expert,
            "a relay also holds its members' rows"
        );
        assert_eq!(direct1.relay, 0);
        // The totals are the library's own window sizes added up.
        let (topo, cfg, _) = shape(&a, 2, 1, 0).unwrap();
        let lens = Communicator::window_lens(&topo, &cfg).unwrap();
        assert_eq!(relay1.total, lens.iter().map(|&l| l as u64).sum::<u64>());
        assert!(report(&a).unwrap().contains("attention_MiB"));
    }
}
