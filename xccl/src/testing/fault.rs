//! Fault injection: named points inside the library where a test can have this process killed
//! (`SIGKILL`) or stopped (`SIGSTOP`) at an exact moment — mid-stream inside a call, after some
//! but not all of its puts and signals — and the census that tells a harness how often each
//! point is reached.
//!
//! The library marks a point with the crate-internal `fault_point!("a2e.chunk")` macro, which
//! compiles to nothing without the `testing` feature. With it, [`point`] reads [`FAULT_ENV`] once
//! per process:
//! - unset: every point returns at once (one atomic load);
//! - `NAME:N` (`a2e.chunk:3`): the `N`-th time point `NAME` is reached this process prints a line
//!   ([`FIRED_MARK`], the point, the hit and [`now_ns`]) to stderr and raises `SIGKILL`;
//! - `NAME:N:stop`: the same, but raises `SIGSTOP` (a slow peer; it goes on after `SIGCONT`);
//! - `census`: nothing is raised; every hit is counted and [`census`] returns the counts;
//! - anything else: the process prints what is wrong and aborts at the first point (a test
//!   must not run as if it had armed nothing).
//!
//! Points are only where a count of hits does not depend on timing, except where noted in
//! [`POINTS`], so a harness can take the hit counts of one census run as the range of hits to
//! draw from.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// The environment variable read by [`point`].
pub const FAULT_ENV: &str = "XCCL_FAULT";

/// What a process prints to stderr just before it raises the signal of a fault.
pub const FIRED_MARK: &str = "xccl fault fired:";

/// The point a test harness reaches between two calls of a rank (the library has no such
/// place itself: a rank between calls runs the caller's code).
pub const BETWEEN_CALLS: &str = "call.between";

/// Every point the library has, with where it is, and [`BETWEEN_CALLS`]. A harness picks from
/// these.
pub const POINTS: &[(&str, &str)] = &[
    (
        BETWEEN_CALLS,
        "between two calls of a rank (reached by the test harness, not the library)",
    ),
    (
        "init.connected",
        "bootstrap: the rank's hello was accepted by the root",
    ),
    (
        "init.shm.created",
        "shm init: own segment created and formatted, not yet advertised",
    ),
    (
        "init.shm.attached",
        "shm init: every peer segment mapped, outcome not yet exchanged",
    ),
    (
        "init.handshake",
        "communicator init: own handshake written, before the barrier",
    ),
    (
        "a2e.record",
        "A2E send: one destination's record written, its rows not yet",
    ),
    (
        "a2e.chunk",
        "A2E send: a chunk of rows written, its progress signal not yet",
    ),
    (
        "a2e.signal",
        "A2E send: a chunk's progress signalled (later chunks and destinations not yet)",
    ),
    (
        "a2e.credit",
        "A2E receive: rows taken; one source credited, the others not yet (credits implied \
         without relays and DP domains: nothing is signalled)",
    ),
    (
        "e2a.record",
        "E2A send: one destination's record written, its rows not yet",
    ),
    (
        "e2a.chunk",
        "E2A send: a chunk of replies written, its progress signal not yet",
    ),
    (
        "e2a.signal",
        "E2A send: a chunk's progress signalled (later chunks and destinations not yet)",
    ),
    (
        "e2a.credit",
        "E2A receive: rows combined; one expert rank credited, the others not yet (credits \
         implied without relays and DP domains: nothing is signalled)",
    ),
    (
        "relay.forward",
        "relay: rows of one member forwarded to one expert rank (count depends on arrival)",
    ),
    (
        "relay.header",
        "relay: the header for one expert rank written and signalled, the others not yet",
    ),
    (
        "relay.reply",
        "relay: complete tokens of one member written (or, where members sum on the relay, \
         announced) and signalled, the others not yet (count depends on arrival)",
    ),
];

/// What an armed fault does when its hit comes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// `SIGKILL` this process.
    Kill,
    /// `SIGSTOP` this process (it continues after `SIGCONT`).
    Stop,
}

/// A parsed [`FAULT_ENV`] value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Spec {
    /// Act at hit `at` (1-based) of point `name`.
    At {
        /// The point's name.
        name: String,
        /// Which hit acts (1 is the first).
        at: u64,
        /// What happens then.
        action: Action,
    },
    /// Count every hit of every point; raise nothing.
    Census,
}

impl Spec {
    /// Parses `NAME:N`, `NAME:N:stop` or `census`; the error says what is wrong.
    pub fn parse(value: &str) -> Result<Spec, String> {
        if value == "census" {
            return Ok(Spec::Census);
        }
        let parts: Vec<&str> = value.split(':').collect();
        let (name, at, action) = match parts.as_slice() {
            [name, at] => (*name, *at, Action::Kill),
            [name, at, "kill"] => (*name, *at, Action::Kill),
            [name, at, "stop"] => (*name, *at, Action::Stop),
            _ => {
                return Err(format!(
                    "{FAULT_ENV}={value:?}: expected NAME:HIT, NAME:HIT:stop or census"
                ))
            }
        };
        let at: u64 = at
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{FAULT_ENV}={value:?}: the hit must be a number from 1"))?;
        if name.is_empty() {
            return Err(format!("{FAULT_ENV}={value:?}: empty point name"));
        }
        Ok(Spec::At {
            name: name.to_string(),
            at,
            action,
        })
    }
}

/// The armed fault of this process, if [`FAULT_ENV`] set one.
struct Armed {
    spec: Spec,
    /// Hits of the armed point so far.
    hits: AtomicU64,
    /// Hits per point (census only).
    census: Mutex<BTreeMap<&'static str, u64>>,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let value = std::env::var(FAULT_ENV).ok()?;
            let spec = Spec::parse(&value).unwrap_or_else(|e| {
                // A test that sets a malformed value must not run as if it had set none.
                eprintln!("xccl: {e}");
                std::process::abort()
            });
            Some(Armed {
                spec,
                hits: AtomicU64::new(0),
                census: Mutex::new(BTreeMap::new()),
            })
        })
        .as_ref()
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the host, so a harness can
/// subtract the time a fault fired in one process from the time another noticed it.
pub fn now_ns() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(ts) => (ts.tv_sec() as u64) * 1_000_000_000 + ts.tv_nsec() as u64,
        Err(_) => 0,
    }
}

/// Reaches point `name`: acts if [`FAULT_ENV`] armed this point and this is the hit it named,
/// counts it in a census, and otherwise returns at once.
pub fn point(name: &'static str) {
    let Some(armed) = armed() else {
        return;
    };
    match &armed.spec {
        Spec::Census => {
            let mut c = armed.census.lock().unwrap_or_else(|e| e.into_inner());
            *c.entry(name).or_insert(0) += 1;
        }
        Spec::At {
            name: want,
            at,
            action,
        } if want == name => {
            let hit = armed.hits.fetch_add(1, Ordering::Relaxed) + 1;
            if hit == *at {
                fire(name, hit, *action);
            }
        }
        Spec::At { .. } => {}
    }
}

/// Prints the fired line, then raises the action's signal on this process.
fn fire(name: &str, hit: u64, action: Action) {
    let (signal, what) = match action {
        Action::Kill => (nix::sys::signal::Signal::SIGKILL, "kill"),
        Action::Stop => (nix::sys::signal::Signal::SIGSTOP, "stop"),
    };
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "{FIRED_MARK} point={name} hit={hit} action={what} pid={} t_ns={}",
        std::process::id(),
        now_ns()
    );
    let _ = err.flush();
    drop(err);
    // raise(3) directs the signal at this thread, so it takes effect before the call returns
    // (kill(2) on the process may pick another thread, and this one would run on for a few
    // microseconds: past the point). SIGKILL does not return; SIGSTOP returns after SIGCONT.
    let _ = nix::sys::signal::raise(signal);
}

/// The hits of every point reached so far in this process under `XCCL_FAULT=census` (empty
/// otherwise), by name.
pub fn census() -> BTreeMap<&'static str, u64> {
    match armed() {
        Some(a) if a.spec == Spec::Census => {
            a.census.lock().unwrap_or_else(|e| e.into_inner()).clone()
        }
        _ => BTreeMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_specs_parse_and_bad_ones_say_why() {
        assert_eq!(Spec::parse("census"), Ok(Spec::Census));
        assert_eq!(
            Spec::parse("a2e.chunk:3"),
            Ok(Spec::At {
                name: "a2e.chunk".into(),
                at: 3,
                action: Action::Kill
            })
        );
        assert_eq!(
            Spec::parse("e2a.record:1:stop"),
            Ok(Spec::At {
                name: "e2a.record".into(),
                at: 1,
                action: Action::Stop
            })
        );
        for bad in ["a2e.chunk", "a2e.chunk:0", "a2e.chunk:x", ":2", "a:1:pause"] {
            let e = Spec::parse(bad).expect_err(bad);
            assert!(e.contains(FAULT_ENV), "{e}");
        }
    }

    #[test]
    fn every_point_name_is_unique() {
        let mut names: Vec<&str> = POINTS.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), POINTS.len());
    }
}
