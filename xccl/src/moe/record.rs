//! [`Record`]: the 32-byte metadata of one (source, destination) message per call, and
//! [`WireMode`], how that message's rows travel.
//!
//! A sender puts the record into the destination's record area for the call's buffer before any
//! row, then signals progress. The receiver validates it against the epoch it expects, its check
//! word, and the exact region its count and offset may address ([`Record::validate`] plus the
//! region check of the caller), and names the sender in every error.

use bytemuck::{Pod, Zeroable};

use super::config::TransferMode;
use super::hash::Fnv;
use crate::{Error, Result};

/// How a message's rows travel, as its record says (the receiver follows it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireMode {
    /// Full rows (payload + metadata) were written into the receiver's window.
    Push,
    /// Full rows wait in the sender's staging area at the record's offset.
    Pull,
    /// Metadata rows wait in the sender's staging area; each payload is token `t`'s row of the
    /// sender's registered input: the receiver gathers them.
    Gather,
}

impl WireMode {
    fn code(self) -> u32 {
        match self {
            WireMode::Push => 0,
            WireMode::Pull => 1,
            WireMode::Gather => 2,
        }
    }
}

impl From<TransferMode> for WireMode {
    fn from(m: TransferMode) -> Self {
        match m {
            TransferMode::Push => WireMode::Push,
            TransferMode::Pull => WireMode::Pull,
        }
    }
}

/// Bit of [`Record::mode`] set when the message's payloads are INT8 (see `moe::quant`).
pub const INT8_FLAG: u32 = 1 << 8;
/// Lowest bit of the landing buffer in [`Record::mode`] ([`Record::landing`]).
const LANDING_SHIFT: u32 = 16;
/// Bits of [`Record::mode`] holding the landing buffer.
const LANDING_MASK: u32 = 0xff << LANDING_SHIFT;
/// Most buffers a record can name as its landing buffer.
pub const MAX_LANDINGS: usize = 256;

/// The 32-byte metadata record of one (source, destination) pair for one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Record {
    /// The call's epoch (sequence number; the first call is `epoch_base + 1`).
    pub epoch: u64,
    /// Rows in this message (0 is a valid empty message).
    pub count: u32,
    /// Row offset: where the rows start in the sender's staging area (pull, gather) and, for
    /// A2E, where the destination's E2A replies go in the sender's E2A receive area.
    pub offset: u32,
    /// [`WireMode`] of this message in the low byte (0 push, 1 pull, 2 gather), plus
    /// [`INT8_FLAG`] when its payloads are INT8 with a scale, plus (A2E only) the landing buffer
    /// in bits 16..24 ([`Record::landing`]).
    pub mode: u32,
    /// Check word: a hash of every other field; catches torn and stale records.
    pub check: u32,
    /// The sender's user tag for this call (A2E: `Communicator::set_next_a2e_tag`; 0 elsewhere).
    pub tag: u64,
}

impl Record {
    /// A record with its check word filled in (payloads in the dtype).
    pub fn new(epoch: u64, count: u32, offset: u32, mode: impl Into<WireMode>) -> Self {
        Self::with_payload(epoch, count, offset, mode, false)
    }

    /// A record whose payloads are INT8 when `int8`.
    pub fn with_payload(
        epoch: u64,
        count: u32,
        offset: u32,
        mode: impl Into<WireMode>,
        int8: bool,
    ) -> Self {
        let mut r = Record {
            epoch,
            count,
            offset,
            mode: mode.into().code() | if int8 { INT8_FLAG } else { 0 },
            check: 0,
            tag: 0,
        };
        r.check = r.expected_check();
        r
    }

    /// An A2E record: [`Record::with_payload`] naming landing buffer `landing` and carrying
    /// `tag`, as [`Record::landing_in`] and [`Record::tagged`] would make it, with the check
    /// word computed once, not three times (it is a serial chain of 32 multiplies, on the path
    /// of every A2E).
    pub(crate) fn a2e(
        epoch: u64,
        count: u32,
        offset: u32,
        mode: WireMode,
        int8: bool,
        landing: usize,
        tag: u64,
    ) -> Self {
        assert!(
            landing < MAX_LANDINGS,
            "landing buffer {landing} out of range"
        );
        let mut r = Record {
            epoch,
            count,
            offset,
            mode: mode.code()
                | if int8 { INT8_FLAG } else { 0 }
                | (landing as u32) << LANDING_SHIFT,
            check: 0,
            tag,
        };
        r.check = r.expected_check();
        r
    }

    /// This record naming `buffer` as its landing buffer (check word updated): the buffer of the
    /// receiver's A2E receive area its pushed rows are in, and of the sender's E2A receive area
    /// the receiver's replies go to. Only an A2E record names one; every other record names 0.
    pub fn landing_in(mut self, buffer: usize) -> Self {
        assert!(
            buffer < MAX_LANDINGS,
            "landing buffer {buffer} out of range"
        );
        self.mode = (self.mode & !LANDING_MASK) | (buffer as u32) << LANDING_SHIFT;
        self.check = self.expected_check();
        self
    }

    /// The landing buffer this record names ([`Record::landing_in`]), checked by
    /// [`Record::validate`].
    pub fn landing(&self) -> usize {
        ((self.mode & LANDING_MASK) >> LANDING_SHIFT) as usize
    }

    /// This record carrying the user tag `tag` (check word updated).
    pub fn tagged(mut self, tag: u64) -> Self {
        self.tag = tag;
        self.check = self.expected_check();
        self
    }

    pub(crate) fn expected_check(&self) -> u32 {
        let mut h = Fnv::new();
        h.u64(self.epoch);
        h.u64(u64::from(self.count) | u64::from(self.offset) << 32);
        h.u64(u64::from(self.mode));
        h.u64(self.tag);
        let v = h.finish();
        (v ^ (v >> 32)) as u32
    }

    /// Checks a received record from `peer` against the epoch the receiver expects, its check
    /// word, the row capacity, and the landing buffers it may name (`landings`: 1 where it may
    /// name none, so the field must be 0); returns its mode. The caller checks the offset
    /// against the exact region it addresses, and the landing buffer against the calls it holds.
    pub fn validate(
        &self,
        peer: usize,
        epoch: u64,
        max_rows: usize,
        landings: usize,
    ) -> Result<WireMode> {
        let bad = |detail: String| Err(Error::Protocol { peer, detail });
        if self.epoch != epoch {
            return bad(format!(
                "record for epoch {} where epoch {epoch} was expected",
                self.epoch
            ));
        }
        if self.check != self.expected_check() {
            return bad(format!("record for epoch {epoch} fails its check word"));
        }
        if self.count as usize > max_rows {
            return bad(format!(
                "record announces {} rows, capacity is {max_rows}",
                self.count
            ));
        }
        if self.landing() >= landings {
            return bad(format!(
                "record for epoch {epoch} names landing buffer {}, of {landings}",
                self.landing()
            ));
        }
        match self.mode & !(INT8_FLAG | LANDING_MASK) {
            0 => Ok(WireMode::Push),
            1 => Ok(WireMode::Pull),
            2 if !self.int8() => Ok(WireMode::Gather),
            m => bad(format!("record has unknown transfer mode {m:#x}")),
        }
    }

    /// Whether the message's payloads are INT8 with a scale.
    pub fn int8(&self) -> bool {
        self.mode & INT8_FLAG != 0
    }

    /// Checks that rows `offset..offset + count` fit a region of `region_rows` rows, naming
    /// `peer` and `what` the region is.
    pub fn check_region(&self, peer: usize, region_rows: usize, what: &str) -> Result<()> {
        let end = self.offset as usize + self.count as usize;
        if end > region_rows {
            return Err(Error::Protocol {
                peer,
                detail: format!(
                    "record for epoch {} addresses rows {}..{end} of {what}, which holds {region_rows}",
                    self.epoch, self.offset
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_is_32_bytes_and_rejects_wrong_epoch_and_torn_fields() {
        assert_eq!(std::mem::size_of::<Record>(), 32);
        let r = Record::new(7, 3, 12, TransferMode::Pull);
        assert_eq!(r.validate(1, 7, 10, 1).unwrap(), WireMode::Pull);
        assert!(matches!(
            r.validate(1, 8, 10, 1),
            Err(Error::Protocol { peer: 1, .. })
        ));
        assert!(r.validate(1, 7, 2, 1).is_err(), "count above capacity");
        let t = r.tagged(u64::MAX - 3);
        assert_eq!(t.validate(1, 7, 10, 1).unwrap(), WireMode::Pull);
        assert_eq!(t.tag, u64::MAX - 3);
        for torn in [
            Record { count: 4, ..r },
            Record { offset: 13, ..r },
            Record { mode: 0, ..r },
            Record { tag: 5, ..r },
            // Differs from the expected epoch only above bit 32.
            Record {
                epoch: 7 + (1 << 40),
                ..r
            },
        ] {
            assert!(torn.validate(1, torn.epoch, 10, 1).is_err(), "{torn:?}");
        }
    }

    #[test]
    fn a_landing_buffer_is_kept_beside_mode_and_int8_and_checked_against_the_buffers() {
        let r = Record::with_payload(7, 3, 12, WireMode::Push, true).landing_in(2);
        assert_eq!((r.landing(), r.int8()), (2, true));
        assert_eq!(r.validate(4, 7, 10, 3).unwrap(), WireMode::Push);
        match r.validate(4, 7, 10, 2) {
            Err(Error::Protocol { peer: 4, detail }) => {
                assert!(detail.contains("landing buffer 2, of 2"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
        // Where none may be named, any but 0 is refused; the field is under the check word.
        assert!(r.validate(4, 7, 10, 1).is_err());
        assert!(Record {
            mode: r.mode & !(1 << 17),
            ..r
        }
        .validate(4, 7, 10, 3)
        .is_err());
        assert_eq!(
            r.landing_in(0).validate(4, 7, 10, 1).unwrap(),
            WireMode::Push
        );
    }

    #[test]
    fn an_a2e_record_built_at_once_has_the_bits_of_the_record_built_step_by_step() {
        for (mode, int8, landing, tag) in [
            (WireMode::Push, false, 0, 0),
            (WireMode::Push, true, 3, 9),
            (WireMode::Pull, false, 255, u64::MAX),
            (WireMode::Gather, true, 1, 1 << 40),
        ] {
            let stepwise = Record::with_payload(11, 5, 40, mode, int8)
                .landing_in(landing)
                .tagged(tag);
            let at_once = Record::a2e(11, 5, 40, mode, int8, landing, tag);
            assert_eq!(bytemuck::bytes_of(&at_once), bytemuck::bytes_of(&stepwise));
        }
    }

    #[test]
    fn region_check_names_the_peer_and_the_rows() {
        let r = Record::new(7, 3, 12, TransferMode::Push);
        r.check_region(4, 15, "the reply area").unwrap();
        match r.check_region(4, 14, "the reply area") {
            Err(Error::Protocol { peer: 4, detail }) => {
                assert!(
                    detail.contains("12..15") && detail.contains("reply area"),
                    "{detail}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
