//! The error type every xccl call returns.
//!
//! Variants say what failed and, where a peer is involved, which rank. Waits that give up name the
//! peer they were waiting for, so a hang is never anonymous.

use std::time::Duration;

/// Everything that can go wrong in xccl.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller-supplied argument is out of range or inconsistent; nothing was sent to any peer.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A call was made on a rank whose role does not allow it (e.g. A2E send on an expert rank).
    #[error("wrong role: {0}")]
    WrongRole(String),

    /// A wait passed its deadline before the peer it was waiting for made progress.
    #[error("timed out after {waited:?} waiting for {}: {what}", awaited(*peer))]
    Timeout {
        /// The rank the wait was waiting for ([`BOOTSTRAP_ROOT`] for the bootstrap root, which
        /// is not a rank: its process may host any rank, or none).
        peer: usize,
        /// What was being waited for.
        what: String,
        /// How long the wait lasted.
        waited: Duration,
    },

    /// A peer process or thread is gone (exited, killed, or declared failed).
    #[error("rank {peer} failed: {detail}")]
    PeerFailed {
        /// The rank that failed.
        peer: usize,
        /// How the failure was noticed.
        detail: String,
    },

    /// The communicator was aborted, locally or by a peer.
    #[error("aborted by rank {by}: {reason}")]
    Aborted {
        /// The rank that raised the abort.
        by: usize,
        /// Why.
        reason: String,
    },

    /// A peer sent something that breaks the wire protocol (bad record, wrong epoch, bad size).
    #[error("protocol error from rank {peer}: {detail}")]
    Protocol {
        /// The rank whose data was bad.
        peer: usize,
        /// What was wrong.
        detail: String,
    },

    /// The rendezvous between ranks failed (stranger, version or job mismatch, duplicate rank).
    #[error("bootstrap: {0}")]
    Bootstrap(String),

    /// An access outside a peer's registered window.
    #[error("access [{offset}, {offset}+{len}) is outside rank {peer}'s window of {window} bytes")]
    OutOfWindow {
        /// The rank whose window was addressed.
        peer: usize,
        /// Start of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Size of that rank's window.
        window: usize,
    },

    /// A fabric is not available here (missing library, provider or capability), named.
    #[error("fabric {fabric} unavailable: {detail}")]
    FabricUnavailable {
        /// The fabric asked for.
        fabric: String,
        /// Why it cannot be used.
        detail: String,
    },

    /// A call into a native runtime library returned an error code (e.g. the Ascend runtime's
    /// `aclError`), with the runtime's own message where it has one.
    #[error("{context}: {library} call {call} failed with code {code}: {message}")]
    Native {
        /// The library (`"libascendcl.so"`).
        library: &'static str,
        /// The function that failed (`"aclrtMemcpyAsync"`).
        call: &'static str,
        /// The code it returned.
        code: i64,
        /// The runtime's message (`aclGetRecentErrMsg`), or a note that it gave none.
        message: String,
        /// What xccl was doing (and for which peer).
        context: String,
    },

    /// Shrinking past dead ranks left an expert with no replica on a surviving rank (and
    /// `ShrinkOptions::drop_orphaned_experts` was not set).
    #[error("expert {expert} has no replica left: its ranks {ranks:?} are dead{others}")]
    ExpertLost {
        /// The first expert without a surviving replica.
        expert: usize,
        /// The (dead) ranks that hosted it, before the shrink.
        ranks: Vec<usize>,
        /// A note naming the other lost experts, if any.
        others: String,
    },

    /// The caller's interrupt check (`Communicator::set_interrupt_check`, e.g. Ctrl-C in a
    /// binding) asked a wait to stop. Like any other failure: the call is retryable if it had
    /// published nothing, else the communicator is poisoned and the job aborted.
    #[error("interrupted while waiting for rank {peer}: {what}")]
    Interrupted {
        /// The rank the wait was waiting for.
        peer: usize,
        /// What was being waited for.
        what: String,
    },

    /// The operating system refused something.
    #[error("{what}: {source}")]
    Os {
        /// What xccl was doing.
        what: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

/// The `peer` of a [`Error::Timeout`] whose wait was for the bootstrap root, not for a rank
/// (messages then say "the bootstrap root", and `what` names its address).
pub const BOOTSTRAP_ROOT: usize = usize::MAX;

/// Who a wait waited for, as messages say it.
fn awaited(peer: usize) -> String {
    if peer == BOOTSTRAP_ROOT {
        "the bootstrap root".into()
    } else {
        format!("rank {peer}")
    }
}

impl Error {
    /// Wraps an OS error with a description of what was being done.
    pub fn os(what: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        Error::Os {
            what: what.into(),
            source: source.into(),
        }
    }

    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// The same error again (an OS error keeps its kind and message), for a poisoned
    /// communicator that returns its first error from every later call.
    pub fn duplicate(&self) -> Self {
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
            Error::WrongRole(m) => Error::WrongRole(m.clone()),
            Error::Timeout { peer, what, waited } => Error::Timeout {
                peer: *peer,
                what: what.clone(),
                waited: *waited,
            },
            Error::PeerFailed { peer, detail } => Error::PeerFailed {
                peer: *peer,
                detail: detail.clone(),
            },
            Error::Aborted { by, reason } => Error::Aborted {
                by: *by,
                reason: reason.clone(),
            },
            Error::Protocol { peer, detail } => Error::Protocol {
                peer: *peer,
                detail: detail.clone(),
            },
            Error::Bootstrap(m) => Error::Bootstrap(m.clone()),
            Error::Interrupted { peer, what } => Error::Interrupted {
                peer: *peer,
                what: what.clone(),
            },
            Error::ExpertLost {
                expert,
                ranks,
                others,
            } => Error::ExpertLost {
                expert: *expert,
                ranks: ranks.clone(),
                others: others.clone(),
            },
            Error::OutOfWindow {
                peer,
                offset,
                len,
                window,
            } => Error::OutOfWindow {
                peer: *peer,
                offset: *offset,
                len: *len,
                window: *window,
            },
            Error::FabricUnavailable { fabric, detail } => Error::FabricUnavailable {
                fabric: fabric.clone(),
                detail: detail.clone(),
            },
            Error::Native {
                library,
                call,
                code,
                message,
                context,
            } => Error::Native {
                library,
                call,
                code: *code,
                message: message.clone(),
                context: context.clone(),
            },
            Error::Os { what, source } => Error::Os {
                what: what.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }
}

/// How an abort reason names a dead rank: a rank that poisons its communicator because a peer
/// failed publishes `"rank D died: …"`, and every rank that receives that abort reports
/// [`Error::PeerFailed`] naming D, whichever rank noticed the death first.
const DEAD_RANK_PREFIX: &str = "rank ";
const DEAD_RANK_MARK: &str = " died: ";

impl Error {
    /// The reason rank `me` publishes when it aborts the job because of `self`.
    pub(crate) fn abort_reason(&self, me: usize) -> String {
        match self {
            Error::PeerFailed { peer, detail } => {
                format!("{DEAD_RANK_PREFIX}{peer}{DEAD_RANK_MARK}{detail} (noticed by rank {me})")
            }
            other => format!("rank {me} failed: {other}"),
        }
    }

    /// An abort raised because a peer died becomes [`Error::PeerFailed`] naming the dead rank
    /// (so every survivor reports the same rank); any other error is returned unchanged.
    pub(crate) fn naming_the_dead(self) -> Self {
        let Error::Aborted { by, reason } = &self else {
            return self;
        };
        let dead = reason
            .strip_prefix(DEAD_RANK_PREFIX)
            .and_then(|rest| rest.split_once(DEAD_RANK_MARK))
            .and_then(|(rank, detail)| Some((rank.parse::<usize>().ok()?, detail)));
        match dead {
            Some((peer, detail)) => Error::PeerFailed {
                peer,
                detail: format!("{detail}; reported through rank {by}'s abort"),
            },
            None => self,
        }
    }
}

impl From<nix::errno::Errno> for Error {
    fn from(e: nix::errno::Errno) -> Self {
        Error::os("system call", std::io::Error::from(e))
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_abort_for_a_dead_peer_names_the_dead_rank_at_every_receiver() {
        let died = Error::PeerFailed {
            peer: 7,
            detail: "process 42 exited".into(),
        };
        let reason = died.abort_reason(3);
        match (Error::Aborted { by: 3, reason }).naming_the_dead() {
            Error::PeerFailed { peer: 7, detail } => {
                assert!(detail.contains("process 42 exited") && detail.contains("rank 3"))
            }
            other => panic!("expected PeerFailed naming rank 7, got {other:?}"),
        }
    }

    #[test]
    fn other_aborts_stay_aborts() {
        let t = Error::Protocol {
            peer: 2,
            detail: "bad record".into(),
        };
        let reason = t.abort_reason(1);
        assert!(matches!(
            (Error::Aborted { by: 1, reason }).naming_the_dead(),
            Error::Aborted { by: 1, .. }
        ));
    }
}
