//! [`ThreadExchange`]: the bootstrap for ranks that are threads of one process.
//!
//! All ranks of a group share one state behind a mutex and a condition variable. Rounds work
//! like the TCP root's: each rank deposits its blob; the last one to arrive publishes the round's
//! result and wakes the others. A rank whose wait times out, or is cut short by an abort or a
//! departed rank, withdraws its blob, so the round is left as if it had never called and a retry
//! is possible.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::root::MAX_KEPT_ABORTS;
use super::unique_id::random_job_id;
use super::{wire, Exchange, JobKey};
use crate::fabric::deadline_after;
use crate::{AbortNotice, Error, Result};

/// One rank of an in-process group; implements [`Exchange`].
///
/// Dropping it marks the rank as gone: rounds that still need it fail with
/// [`Error::PeerFailed`] instead of waiting for their timeout.
#[derive(Debug)]
pub struct ThreadExchange {
    rank: usize,
    size: usize,
    job_id: u64,
    key: JobKey,
    group: Arc<Group>,
    /// This rank's next round; the mutex also serializes collectives of this rank.
    next_round: Mutex<u64>,
}

#[derive(Debug)]
struct Group {
    state: Mutex<GroupState>,
    cv: Condvar,
}

#[derive(Debug)]
struct GroupState {
    /// The round being gathered.
    round: u64,
    blobs: Vec<Option<Vec<u8>>>,
    contributed: usize,
    /// The last completed round and its result; a rank is never more than one round behind.
    last: Option<(u64, Arc<Vec<Vec<u8>>>)>,
    /// Abort records raised, in order: the first [`MAX_KEPT_ABORTS`].
    aborts: Vec<AbortNotice>,
    left: Vec<bool>,
    /// Ranks that contributed to the current round and withdrew after their own deadline: they
    /// did arrive, so other ranks' timeouts do not blame them.
    gave_up: Vec<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ThreadExchange {
    /// A group of `size` ranks (index = rank) with a fresh random job id. Hand one to each thread.
    pub fn group(size: usize) -> Vec<ThreadExchange> {
        Self::group_with_job_id(size, random_job_id())
    }

    /// A group of `size` ranks sharing `job_id`.
    pub fn group_with_job_id(size: usize, job_id: u64) -> Vec<ThreadExchange> {
        let group = Arc::new(Group {
            state: Mutex::new(GroupState {
                round: 0,
                blobs: vec![None; size],
                contributed: 0,
                last: None,
                aborts: Vec::new(),
                left: vec![false; size],
                gave_up: vec![false; size],
            }),
            cv: Condvar::new(),
        });
        let key = JobKey::random();
        (0..size)
            .map(|rank| ThreadExchange {
                rank,
                size,
                job_id,
                key: key.clone(),
                group: group.clone(),
                next_round: Mutex::new(0),
            })
            .collect()
    }

    fn round(&self, blob: &[u8], timeout: Duration, what: &str) -> Result<Vec<Vec<u8>>> {
        let mut next = lock(&self.next_round);
        let round = *next;
        let start = Instant::now();
        let deadline = deadline_after(timeout);
        let mut st = lock(&self.group.state);
        if let Some(err) = self.abort_error(&st) {
            return Err(err);
        }
        debug_assert_eq!(st.round, round, "rank {} is out of step", self.rank);
        st.blobs[self.rank] = Some(blob.to_vec());
        st.gave_up[self.rank] = false;
        st.contributed += 1;
        if st.contributed == self.size {
            let blobs: Vec<Vec<u8>> = st
                .blobs
                .iter_mut()
                .map(|b| b.take().unwrap_or_default())
                .collect();
            st.last = Some((round, Arc::new(blobs.clone())));
            st.round += 1;
            st.contributed = 0;
            st.gave_up.iter_mut().for_each(|g| *g = false);
            drop(st);
            self.group.cv.notify_all();
            *next += 1;
            return Ok(blobs);
        }
        loop {
            if let Some((r, blobs)) = &st.last {
                if *r == round {
                    let out = blobs.as_ref().clone();
                    *next += 1;
                    return Ok(out);
                }
            }
            let err = if let Some(err) = self.abort_error(&st) {
                Some(err)
            } else if let Some(gone) = (0..self.size).find(|&r| st.left[r] && st.blobs[r].is_none())
            {
                Some(Error::PeerFailed {
                    peer: gone,
                    detail: format!("left the job; bootstrap {what} round {round} cannot complete"),
                })
            } else if Instant::now() >= deadline {
                let absent = |gave_up: bool| -> Vec<usize> {
                    (0..self.size)
                        .filter(|&r| st.blobs[r].is_none() && st.gave_up[r] == gave_up)
                        .collect()
                };
                let missing = absent(false);
                let what = if missing.is_empty() {
                    format!(
                        "bootstrap {what} round {round}: ranks {:?} arrived but gave up after their own timeout",
                        absent(true)
                    )
                } else {
                    format!("bootstrap {what} round {round}: ranks {missing:?} have not arrived")
                };
                let blamed = missing.first().or(absent(true).first()).copied();
                Some(Error::Timeout {
                    peer: blamed.unwrap_or(self.rank),
                    what,
                    waited: start.elapsed(),
                })
            } else {
                None
            };
            if let Some(err) = err {
                // The round has not completed (checked above, under the lock): take the blob
                // back so a retry starts clean.
                st.blobs[self.rank] = None;
                st.contributed -= 1;
                st.gave_up[self.rank] = matches!(err, Error::Timeout { .. });
                return Err(err);
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            st = self
                .group
                .cv
                .wait_timeout(st, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn abort_error(&self, st: &GroupState) -> Option<Error> {
        st.aborts
            .iter()
            .find(|a| a.by != self.rank)
            .map(|a| a.to_error(self.size))
    }
}

impl Exchange for ThreadExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn job_id(&self) -> u64 {
        self.job_id
    }

    fn key(&self) -> &JobKey {
        &self.key
    }

    /// Fails with [`Error::Timeout`] naming the ranks that have not arrived,
    /// [`Error::Aborted`] when another rank has raised an abort, [`Error::PeerFailed`] when a
    /// rank that has not contributed was dropped.
    fn allgather(&self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.round(blob, timeout, "allgather")
    }

    /// An allgather of empty blobs.
    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.round(&[], timeout, "barrier").map(|_| ())
    }

    /// Records the abort for every other rank and wakes their waits (the reason cut to 4 KiB
    /// as on the wire; past [`MAX_KEPT_ABORTS`] records, later ones are dropped: the first
    /// ones already abort every wait).
    fn broadcast_abort_reporting(&self, dead: Option<usize>, reason: &str) -> Result<()> {
        let mut st = lock(&self.group.state);
        if st.aborts.len() < MAX_KEPT_ABORTS {
            st.aborts.push(AbortNotice {
                by: self.rank,
                dead,
                reason: wire::clip(reason).to_string(),
            });
        }
        drop(st);
        self.group.cv.notify_all();
        Ok(())
    }

    /// The first abort raised by another rank, if any (it stays there).
    fn poll_abort(&self) -> Option<AbortNotice> {
        lock(&self.group.state)
            .aborts
            .iter()
            .find(|a| a.by != self.rank)
            .cloned()
    }
}

impl Drop for ThreadExchange {
    fn drop(&mut self) {
        lock(&self.group.state).left[self.rank] = true;
        self.group.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_secs(10);

    /// Runs `f` on every rank of `group`, one thread each; the ranks are dropped only after
    /// every thread has finished.
    fn run<T: Send>(group: Vec<ThreadExchange>, f: impl Fn(&ThreadExchange) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|x| {
                    let f = &f;
                    s.spawn(move || f(x))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn four_threads_allgather_and_barrier() {
        let group = ThreadExchange::group(4);
        let job = group[0].job_id();
        let out = run(group, |x| {
            assert_eq!(x.size(), 4);
            assert_eq!(x.job_id(), job);
            let all = x
                .allgather(format!("r{}", x.rank()).as_bytes(), LONG)
                .unwrap();
            x.barrier(LONG).unwrap();
            all
        });
        let expected: Vec<Vec<u8>> = (0..4).map(|r| format!("r{r}").into_bytes()).collect();
        assert!(out.iter().all(|o| *o == expected));
    }

    #[test]
    fn a_round_with_a_timeout_of_duration_max_saturates() {
        let out = run(ThreadExchange::group(2), |x| {
            x.allgather(&[x.rank() as u8], Duration::MAX).unwrap()
        });
        assert!(out.iter().all(|o| *o == vec![vec![0], vec![1]]));
    }

    #[test]
    fn groups_get_different_job_ids() {
        assert_ne!(
            ThreadExchange::group(1)[0].job_id(),
            ThreadExchange::group(1)[0].job_id()
        );
    }

    #[test]
    fn many_rounds_in_a_row_with_threads() {
        run(ThreadExchange::group(5), |x| {
            for i in 0..500usize {
                let all = x.allgather(&[x.rank() as u8, i as u8], LONG).unwrap();
                for (r, b) in all.iter().enumerate() {
                    assert_eq!(*b, vec![r as u8, i as u8]);
                }
            }
        });
    }

    #[test]
    fn missing_rank_times_out_naming_it() {
        let mut group = ThreadExchange::group(3);
        let late = group.pop().unwrap();
        let timeout = Duration::from_millis(300);
        let errs = run(group, |x| {
            let start = Instant::now();
            let err = x.allgather(b"a", timeout).unwrap_err();
            // Bounded, with room for a loaded CI machine.
            assert!(start.elapsed() >= timeout && start.elapsed() < timeout * 10);
            err
        });
        for err in &errs {
            assert!(
                matches!(err, Error::Timeout { peer: 2, what, .. }
                    if what == "bootstrap allgather round 0: ranks [2] have not arrived"),
                "{err}"
            );
        }
        // Rank 2 was alive all along (just late), so the error is a timeout, not a failure.
        drop(late);
    }

    #[test]
    fn a_retry_after_a_timeout_completes_the_round() {
        let group = ThreadExchange::group(2);
        let (a, b) = (&group[0], &group[1]);
        assert!(a.barrier(Duration::from_millis(100)).is_err());
        std::thread::scope(|s| {
            let h = s.spawn(|| a.allgather(b"a", LONG).unwrap());
            let mine = b.allgather(b"b", LONG).unwrap();
            assert_eq!(mine, h.join().unwrap());
            assert_eq!(mine, vec![b"a".to_vec(), b"b".to_vec()]);
        });
    }

    #[test]
    fn abort_is_seen_by_waiting_and_idle_ranks() {
        let group = ThreadExchange::group(3);
        std::thread::scope(|s| {
            let h = s.spawn(|| group[1].allgather(b"x", LONG).unwrap_err());
            std::thread::sleep(Duration::from_millis(50));
            group[0].broadcast_abort("bad routing table").unwrap();
            let err = h.join().unwrap();
            assert!(
                matches!(&err, Error::Aborted { by: 0, reason } if reason == "bad routing table"),
                "{err}"
            );
        });
        assert_eq!(
            group[2].poll_abort(),
            Some(AbortNotice::raised_by(0, "bad routing table"))
        );
        assert_eq!(group[0].poll_abort(), None);
    }

    #[test]
    fn a_death_report_fails_rounds_naming_the_dead_rank_and_death_like_text_does_not() {
        let group = ThreadExchange::group(3);
        group[1]
            .broadcast_abort("rank 0 died: process 42 exited")
            .unwrap();
        let err = group[2].barrier(LONG).unwrap_err();
        assert!(matches!(err, Error::Aborted { by: 1, .. }), "{err}");
        let group = ThreadExchange::group(3);
        group[1]
            .broadcast_abort_reporting(Some(0), "process 42 exited")
            .unwrap();
        let err = group[2].barrier(LONG).unwrap_err();
        assert!(matches!(err, Error::PeerFailed { peer: 0, .. }), "{err}");
        let group = ThreadExchange::group(3);
        group[1].broadcast_abort_reporting(Some(7), "x").unwrap();
        let err = group[2].barrier(LONG).unwrap_err();
        assert!(matches!(err, Error::Protocol { peer: 1, .. }), "{err}");
    }

    #[test]
    fn a_dropped_rank_fails_the_round_naming_it() {
        let mut group = ThreadExchange::group(3);
        drop(group.pop());
        let errs = run(group, |x| x.barrier(LONG).unwrap_err());
        for err in errs {
            assert!(matches!(err, Error::PeerFailed { peer: 2, .. }), "{err}");
        }
    }
}
