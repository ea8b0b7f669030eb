//! [`Slots`]: which signal slot means what.
//!
//! Five groups of `world` slots, each indexed by the peer's global rank, so no two peers ever
//! write the same slot.

/// Signal slot numbering for a job of `world` ranks.
#[derive(Clone, Copy, Debug)]
pub struct Slots {
    world: usize,
}

impl Slots {
    /// Slot numbering for a job of `world` ranks.
    pub fn new(world: usize) -> Self {
        Slots { world }
    }

    /// Total slots a rank needs.
    pub fn count(&self) -> usize {
        5 * self.world
    }

    /// On an expert rank: progress of `src`'s A2E message ([`super::progress::progress`]).
    pub fn a2e_ready(&self, src: usize) -> usize {
        src
    }

    /// On an attention rank: the last A2E epoch expert `dst` has consumed our rows of.
    pub fn a2e_credit(&self, dst: usize) -> usize {
        self.world + dst
    }

    /// On an attention rank: progress of expert `src`'s E2A message.
    pub fn e2a_ready(&self, src: usize) -> usize {
        2 * self.world + src
    }

    /// On an expert rank: the last epoch whose E2A rows attention rank `dst` has consumed.
    pub fn e2a_credit(&self, dst: usize) -> usize {
        3 * self.world + dst
    }

    /// On any rank: the barrier generation `src` has entered.
    pub fn barrier(&self, src: usize) -> usize {
        4 * self.world + src
    }
}
