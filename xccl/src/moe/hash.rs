//! FNV-1a, the stable 64-bit hash behind every fingerprint and check word xccl puts on the wire.
//!
//! Stable across platforms and processes (unlike `std`'s hashers), which is what a value compared
//! between ranks needs.

/// An FNV-1a hasher over little-endian words.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fnv(u64);

impl Fnv {
    /// A fresh hasher.
    pub(crate) fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    /// Mixes in the eight little-endian bytes of `v`.
    pub(crate) fn u64(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// The hash so far.
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}
