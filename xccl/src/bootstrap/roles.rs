//! [`gather_roles`]: explicit roles, stated by every rank and agreed through the bootstrap (for
//! launchers whose rank order is not "attention ranks first").

use std::time::Duration;

use super::Exchange;
use crate::topology::Role;
use crate::{Error, Result};

/// A blob of [`gather_roles`]: a magic, then the role's code.
const ROLE_MAGIC: &[u8; 7] = b"XCCLROL";

fn code(role: Role) -> u8 {
    match role {
        Role::Attention => b'A',
        Role::Expert => b'E',
    }
}

/// Every rank states its own role (`mine`); every rank gets the list in rank order.
/// Collective over `exchange`: every rank calls it once, with the same `timeout`. Build the
/// topology with `TopologyBuilder::new(roles, num_experts)` afterwards.
///
/// Fails naming the ranks that did not arrive within `timeout`, or the rank whose blob is not a
/// role (a peer running something else in this round).
pub fn gather_roles(exchange: &dyn Exchange, mine: Role, timeout: Duration) -> Result<Vec<Role>> {
    let mut blob = ROLE_MAGIC.to_vec();
    blob.push(code(mine));
    let blobs = exchange.allgather(&blob, timeout)?;
    blobs
        .iter()
        .enumerate()
        .map(|(rank, b)| match b.as_slice() {
            [m @ .., c] if m == ROLE_MAGIC && *c == b'A' => Ok(Role::Attention),
            [m @ .., c] if m == ROLE_MAGIC && *c == b'E' => Ok(Role::Expert),
            _ => Err(match crate::comm::agree::failure_in(b) {
                // A rank whose init failed before stating its role says why.
                Some(reason) => Error::Protocol {
                    peer: rank,
                    detail: format!(
                        "the init of another rank failed, so this job cannot start: rank {rank}: {reason}"
                    ),
                },
                None => Error::Protocol {
                peer: rank,
                detail: format!(
                    "rank {rank} sent {} bytes that are not a role in the roles round",
                    b.len()
                ),
                },
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::ThreadExchange;

    #[test]
    fn every_rank_gets_every_stated_role_in_rank_order() {
        let stated = [Role::Expert, Role::Attention, Role::Expert, Role::Attention];
        let got: Vec<Vec<Role>> = std::thread::scope(|s| {
            let handles: Vec<_> = ThreadExchange::group(4)
                .into_iter()
                .map(|ex| {
                    s.spawn(move || {
                        gather_roles(&ex, stated[ex.rank()], Duration::from_secs(10)).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for roles in got {
            assert_eq!(roles, stated);
        }
    }

    #[test]
    fn a_blob_that_is_not_a_role_names_its_rank() {
        let errs: Vec<Result<Vec<Role>>> = std::thread::scope(|s| {
            let handles: Vec<_> = ThreadExchange::group(2)
                .into_iter()
                .map(|ex| {
                    s.spawn(move || {
                        if ex.rank() == 1 {
                            ex.allgather(b"hello", Duration::from_secs(10))?;
                            return Ok(vec![]);
                        }
                        gather_roles(&ex, Role::Attention, Duration::from_secs(10))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        match &errs[0] {
            Err(Error::Protocol { peer: 1, detail }) => assert!(detail.contains("rank 1")),
            other => panic!("{other:?}"),
        }
    }
}
