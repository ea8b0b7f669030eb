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

    /// This error with `who` (such as `"rank 3"`) put before what it says, where it says it in
    /// words: a native call's context, a missing library's detail, an invalid argument's
    /// message. Other errors name their peer already and are returned as they are.
    pub(crate) fn prefixed(self, who: &str) -> Self {
        match self {
            Error::Native {
                library,
                call,
                code,
                message,
                context,
            } => Error::Native {
                library,
                call,
                code,
                message,
                context: format!("{who}: {context}"),
            },
            Error::FabricUnavailable { fabric, detail } => Error::FabricUnavailable {
                fabric,
                detail: format!("{who}: {detail}"),
            },
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{who}: {m}")),
            other => other,
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

/// An abort as a rank receives it: who raised it, which rank's death it reports, and why.
///
/// `dead` is set only by the liveness machinery: a rank that poisons its communicator because it
/// saw a peer die (a dead process, a lost connection) sends the dead rank as its own field of the
/// abort record, so every survivor reports [`Error::PeerFailed`] naming the same rank, whichever
/// noticed first. It is never derived from the reason text: an abort raised by a user
/// ([`crate::Communicator::abort`], `xcclCommAbort`, Python) carries no dead rank, whatever its
/// text says. A peer wrote the record, so it is input: [`AbortNotice::to_error`] checks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortNotice {
    /// The rank that raised the abort.
    pub by: usize,
    /// The rank whose death the abort reports, if it reports one (unchecked: see
    /// [`AbortNotice::to_error`]).
    pub dead: Option<usize>,
    /// Why (free text, bounded by the carrier: 256 bytes in fabric memory, 4 KiB on the
    /// bootstrap's wire).
    pub reason: String,
}

impl AbortNotice {
    /// An abort raised by `by` that reports no death.
    pub fn raised_by(by: usize, reason: impl Into<String>) -> Self {
        AbortNotice {
            by,
            dead: None,
            reason: reason.into(),
        }
    }

    /// The error this abort means to a rank of a job of `world` ranks: [`Error::PeerFailed`]
    /// naming the dead rank for a death report, else [`Error::Aborted`] naming the aborting
    /// rank. A death report naming a rank outside the job, or its own sender, is
    /// [`Error::Protocol`] naming the sender.
    pub fn to_error(&self, world: usize) -> Error {
        let (by, reason) = (self.by, &self.reason);
        match self.dead {
            None => Error::Aborted {
                by,
                reason: reason.clone(),
            },
            Some(d) if d >= world || d == by => Error::Protocol {
                peer: by,
                detail: format!(
                    "its abort reports rank {d} dead, {}; reason: {reason}",
                    if d == by {
                        "itself".to_string()
                    } else {
                        format!("outside the job of {world} ranks")
                    }
                ),
            },
            Some(peer) => Error::PeerFailed {
                peer,
                detail: format!("{reason}; reported through rank {by}'s abort"),
            },
        }
    }
}

impl Error {
    /// The reason rank `me` publishes when it aborts the job because of `self` (text for
    /// people; the dead rank travels apart, see [`Error::dead_rank`]).
    pub(crate) fn abort_reason(&self, me: usize) -> String {
        match self {
            Error::PeerFailed { peer, detail } => {
                format!("rank {peer} died: {detail} (noticed by rank {me})")
            }
            other => format!("rank {me} failed: {other}"),
        }
    }

    /// The rank whose death rank `me` reports when it aborts the job because of `self`: the
    /// failed peer of an [`Error::PeerFailed`] (the liveness machinery's finding), never `me`.
    pub(crate) fn dead_rank(&self, me: usize) -> Option<usize> {
        match self {
            Error::PeerFailed { peer, .. } if *peer != me => Some(*peer),
            _ => None,
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
    fn a_death_report_names_the_dead_rank_at_every_receiver() {
        let died = Error::PeerFailed {
            peer: 7,
            detail: "process 42 exited".into(),
        };
        let notice = AbortNotice {
            by: 3,
            dead: died.dead_rank(3),
            reason: died.abort_reason(3),
        };
        match notice.to_error(8) {
            Error::PeerFailed { peer: 7, detail } => {
                assert!(detail.contains("process 42 exited") && detail.contains("rank 3"))
            }
            other => panic!("expected PeerFailed naming rank 7, got {other:?}"),
        }
    }

    #[test]
    fn an_abort_whose_text_reads_like_a_death_stays_an_abort() {
        let notice =
            AbortNotice::raised_by(1, "rank 0 died: process 42 exited (noticed by rank 1)");
        match notice.to_error(3) {
            Error::Aborted { by: 1, reason } => assert!(reason.starts_with("rank 0 died: ")),
            other => panic!("expected Aborted by rank 1, got {other:?}"),
        }
        let t = Error::Protocol {
            peer: 2,
            detail: "bad record".into(),
        };
        assert_eq!(t.dead_rank(1), None);
    }

    #[test]
    fn a_death_report_outside_the_job_or_of_its_sender_is_a_protocol_error_naming_the_sender() {
        for dead in [3, usize::MAX, 1] {
            let notice = AbortNotice {
                by: 1,
                dead: Some(dead),
                reason: "x".into(),
            };
            let e = notice.to_error(3);
            assert!(matches!(e, Error::Protocol { peer: 1, .. }), "{e}");
        }
        // A rank never reports its own death.
        let own = Error::PeerFailed {
            peer: 2,
            detail: "x".into(),
        };
        assert_eq!(own.dead_rank(2), None);
    }
}
