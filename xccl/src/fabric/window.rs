//! [`Window`]: a bounds-checked view of one rank's registered memory.
//!
//! A window is memory that peers write into and read from while this process runs, so Rust
//! references into it are only sound while the wire protocol guarantees that nobody else touches
//! the range. Copies in and out (`read`, `write`) go through raw pointers and are always safe;
//! borrowing a range as a slice is `unsafe` and each caller says in its `SAFETY:` comment which
//! protocol step makes it exclusive. A `Window` is neither `Copy` nor `Sync`: an exclusive borrow
//! needs `&mut` of the view it came from.

use std::marker::PhantomData;
use std::ptr::NonNull;

use crate::{Error, Result};

/// A view of one rank's window: `len` bytes at `base`, valid for `'a`.
#[derive(Debug)]
pub struct Window<'a> {
    base: NonNull<u8>,
    len: usize,
    rank: usize,
    _life: PhantomData<&'a [u8]>,
}

// SAFETY: a Window is a pointer plus a length into memory shared between ranks; every access
// through it is either a copy of bytes (no aliasing references are created) or an `unsafe` borrow
// whose caller guarantees exclusivity, so moving the view to another thread is sound.
unsafe impl Send for Window<'_> {}

impl<'a> Window<'a> {
    /// Wraps `len` bytes at `base` belonging to `rank`.
    ///
    /// # Safety
    /// `base..base+len` must stay mapped, readable and writable for `'a`.
    pub unsafe fn from_raw(base: NonNull<u8>, len: usize, rank: usize) -> Self {
        Window {
            base,
            len,
            rank,
            _life: PhantomData,
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-sized window.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rank that owns this window.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Base address (for fabrics that register it with a NIC).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Checks that `[offset, offset+len)` lies inside the window.
    pub fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfWindow {
                peer: self.rank,
                offset,
                len,
                window: self.len,
            }),
        }
    }

    /// Copies `data` into the window at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: the range is inside the mapping (checked above) and `data` is ordinary process
        // memory, so the two cannot overlap; a concurrent peer write to the same range is a
        // protocol error that can garble bytes but not memory safety of this process.
        unsafe {
            super::copy::copy_bytes(data.as_ptr(), self.base.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Copies bytes from the window at `offset` into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        // SAFETY: as in `write`, the source range is inside the mapping and `buf` is a distinct
        // exclusive borrow of process memory.
        unsafe {
            super::copy::copy_bytes(self.base.as_ptr().add(offset), buf.as_mut_ptr(), buf.len())
        };
        Ok(())
    }

    /// Borrows `[offset, offset+len)` as a shared slice.
    ///
    /// # Safety
    /// No rank may write the range while the slice lives (the protocol step that hands the range
    /// to this reader must guarantee it).
    pub unsafe fn slice(&self, offset: usize, len: usize) -> Result<&'a [u8]> {
        self.check(offset, len)?;
        // SAFETY: in bounds (checked), mapped for 'a (constructor contract), unaliased by writers
        // (caller contract).
        Ok(unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), len) })
    }

    /// Borrows `[offset, offset+len)` as an exclusive slice.
    ///
    /// # Safety
    /// No rank may read or write the range while the slice lives, and no other borrow of it may
    /// exist in this process.
    pub unsafe fn slice_mut(&mut self, offset: usize, len: usize) -> Result<&'a mut [u8]> {
        self.check(offset, len)?;
        // SAFETY: in bounds (checked), mapped for 'a (constructor contract), exclusive (caller
        // contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) })
    }
}
