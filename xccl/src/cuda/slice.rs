//! Device memory a caller lends to one call: [`DeviceSlice`] (read) and [`DeviceSliceMut`]
//! (write), the device counterparts of `&[u8]` and `&mut [u8]` in the device-buffer calls of a
//! communicator on the cuda fabric (`Communicator::a2e_send_device` and the others).
//!
//! A slice is only an address, a length and a device ordinal with a lifetime: nothing is
//! checked when it is made (see [`crate::cuda::Device::device_pointer`], which every call runs
//! on the slices it takes), and the host never dereferences it. Making one from a raw address
//! is `unsafe`: the caller promises the memory stays allocated, and untouched by others, for
//! the slice's lifetime. [`DeviceMemory::as_slice`] and [`DeviceMemory::as_slice_mut`] make
//! them safely from an allocation of this crate.

use std::marker::PhantomData;
use std::ops::Range;

use super::{DeviceMemory, DevicePtr, DeviceRegion};

/// The accessors both slice types share.
macro_rules! lent_accessors {
    ($t:ident) => {
        impl $t<'_> {
            /// The first byte.
            pub fn ptr(&self) -> DevicePtr {
                self.ptr
            }

            /// Bytes.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether it has no bytes.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }
        }
    };
}

lent_accessors!(DeviceSlice);
lent_accessors!(DeviceSliceMut);

/// `len` bytes of device memory lent for reading (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a> {
    ptr: DevicePtr,
    len: usize,
    _lent: PhantomData<&'a [u8]>,
}

impl<'a> DeviceSlice<'a> {
    /// The `len` bytes at `addr` of device `device`.
    ///
    /// # Safety
    /// When `len > 0`, `addr..addr + len` must be device memory of device `device` that stays
    /// allocated, and that nobody writes (host or device work), while the slice lives.
    pub unsafe fn from_raw(addr: u64, len: usize, device: usize) -> Self {
        DeviceSlice {
            ptr: DevicePtr::new(addr, device),
            len,
            _lent: PhantomData,
        }
    }

    /// Bytes `range` of this slice (`None` when the range is not inside it).
    pub fn range(self, range: Range<usize>) -> Option<DeviceSlice<'a>> {
        let len = checked_len(&range, self.len)?;
        Some(DeviceSlice {
            ptr: self.ptr.add(range.start),
            len,
            _lent: PhantomData,
        })
    }
}

/// The length of `range` when it lies in `0..len`.
fn checked_len(range: &Range<usize>, len: usize) -> Option<usize> {
    (range.start <= range.end && range.end <= len).then(|| range.end - range.start)
}

/// `len` bytes of device memory lent for writing (see the module docs).
#[derive(Debug)]
pub struct DeviceSliceMut<'a> {
    ptr: DevicePtr,
    len: usize,
    _lent: PhantomData<&'a mut [u8]>,
}

impl<'a> DeviceSliceMut<'a> {
    /// The `len` bytes at `addr` of device `device`.
    ///
    /// # Safety
    /// When `len > 0`, `addr..addr + len` must be device memory of device `device` that stays
    /// allocated, and that nobody else reads or writes (host or device work), while the slice
    /// lives.
    pub unsafe fn from_raw(addr: u64, len: usize, device: usize) -> Self {
        DeviceSliceMut {
            ptr: DevicePtr::new(addr, device),
            len,
            _lent: PhantomData,
        }
    }

    /// The same bytes for a shorter borrow (to lend them to one call and keep the slice).
    pub fn reborrow(&mut self) -> DeviceSliceMut<'_> {
        DeviceSliceMut {
            ptr: self.ptr,
            len: self.len,
            _lent: PhantomData,
        }
    }

    /// Bytes `range` of this slice (`None` when the range is not inside it).
    pub fn range(self, range: Range<usize>) -> Option<DeviceSliceMut<'a>> {
        let len = checked_len(&range, self.len)?;
        Some(DeviceSliceMut {
            ptr: self.ptr.add(range.start),
            len,
            _lent: PhantomData,
        })
    }

    /// The same bytes for reading.
    pub fn as_slice(&self) -> DeviceSlice<'_> {
        DeviceSlice {
            ptr: self.ptr,
            len: self.len,
            _lent: PhantomData,
        }
    }
}

// SAFETY: the lender promised (`from_raw`, or the `&mut` borrow of a `DeviceMemory`) that the
// bytes are device memory, allocated and reserved for this slice while it lives.
unsafe impl DeviceRegion for DeviceSliceMut<'_> {
    fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A [`DeviceSlice`] as a region, for this crate's reads only (a region may be written through
/// the safe copies of [`super::Stream`]; a shared slice must not be).
pub(crate) struct ReadRegion<'a>(pub(crate) DeviceSlice<'a>);

// SAFETY: the slice's lender promised the bytes are allocated device memory while it lives;
// the crate only reads through this wrapper (the device-buffer calls' host bounce).
unsafe impl DeviceRegion for ReadRegion<'_> {
    fn ptr(&self) -> DevicePtr {
        self.0.ptr
    }
    fn len(&self) -> usize {
        self.0.len
    }
}

impl DeviceMemory {
    /// The whole allocation, lent for reading.
    pub fn as_slice(&self) -> DeviceSlice<'_> {
        // SAFETY: the allocation lives while `self` is borrowed, and the shared borrow keeps
        // `as_slice_mut` (the only safe writer through this value) from running meanwhile.
        unsafe { DeviceSlice::from_raw(self.ptr().addr(), self.len(), self.ptr().device()) }
    }

    /// The whole allocation, lent for writing.
    pub fn as_slice_mut(&mut self) -> DeviceSliceMut<'_> {
        // SAFETY: the allocation lives while `self` is borrowed, exclusively.
        unsafe { DeviceSliceMut::from_raw(self.ptr().addr(), self.len(), self.ptr().device()) }
    }
}
