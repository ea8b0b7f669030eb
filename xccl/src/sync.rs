//! The concurrency primitives the signal protocol rests on, behind one facade: atomics, fences,
//! spin and yield hints, and the futex doorbell's wait and wake.
//!
//! A normal build uses `std` and the Linux futex system call; nothing here costs anything there
//! (re-exports, and `#[inline]` functions that are the system calls themselves). A build with
//! `--cfg loom` (`ci/loom.sh`) uses [loom](https://docs.rs/loom)'s versions instead, so the control
//! area's protocol (`fabric::signals`) can be model-checked: loom runs a test under every
//! interleaving of its threads (up to a preemption bound) and every value each load may see
//! under the C11 memory model, and fails on a data race, a deadlock or a failed assertion.
//!
//! # The futex under loom
//! A futex wait compares the word with the expected value and goes to sleep as one step with
//! respect to wakes (the kernel does both under its hash-bucket lock), and a wake may be
//! spurious (a signal, a timeout, a wake meant for another word in the bucket): callers re-check
//! their condition after every return. The model keeps exactly that: one model mutex stands for
//! the kernel's bucket lock (one bucket for every word), [`futex_wait`] reads the word under it
//! and waits on a model condition variable only if the word still holds the expected value,
//! [`futex_wake`] takes the lock and wakes every waiter (of every word: the extra ones return
//! spuriously). What the model leaves out is the timeout: a model wait sleeps until it is woken.
//! In production a lost wake-up costs one sleep chunk (20 ms) before the waiter polls again; in
//! the model it leaves the waiter asleep for ever, which loom reports as a deadlock. So a test
//! passes only if no wake-up is ever lost.
//!
//! The lock gives the woken waiter a happens-before edge from the waker, as the kernel's futex
//! does (a futex operation is a full barrier); the protocol never relies on it for data: a
//! waiter re-polls its slots with Acquire loads after every return.
//!
//! # Control memory under loom
//! Production control areas are atomics overlaid on mapped bytes ([`word_u64`] casts an
//! offset). Loom atomics are objects with their own bookkeeping and cannot be overlaid, so under
//! loom a control area's base points to a [`ModelMemory`] that holds one loom atomic for every
//! word the area uses, found by offset. The area's code is the same; only the lookup differs.
//!
//! # Mutants
//! [`weakened`] returns its ordering unchanged, except in a build with both `--cfg loom` and
//! `--cfg xccl_loom_mutant` (`ci/loom.sh --mutate`), where `XCCL_LOOM_MUTANT` may name one
//! [`Mutant`] whose ordering it weakens, to show that the loom tests catch the weakening.
//! Neither cfg is ever set in a normal build, so no mutant can be compiled into one.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use std::ptr::NonNull;
use std::time::Duration;

/// A hint inside a busy-poll loop (`pause` on x86; a yield to the model's scheduler under loom).
#[inline]
pub(crate) fn spin_loop() {
    #[cfg(not(loom))]
    std::hint::spin_loop();
    #[cfg(loom)]
    loom::hint::spin_loop();
}

/// Gives the core to another runnable thread (`sched_yield`; a model yield under loom).
#[inline]
pub(crate) fn yield_now() {
    #[cfg(not(loom))]
    std::thread::yield_now();
    #[cfg(loom)]
    loom::thread::yield_now();
}

/// The 64-bit atomic at byte `off` of the control memory at `base`.
///
/// # Safety
/// `base + off` must be 8-aligned inside memory that stays mapped for `'a` and is only ever
/// accessed atomically (under loom: `base` points to a live [`ModelMemory`] that has a 64-bit
/// word at `off`).
#[cfg(not(loom))]
#[inline]
pub(crate) unsafe fn word_u64<'a>(base: NonNull<u8>, off: usize) -> &'a AtomicU64 {
    // SAFETY: the caller guarantees alignment, bounds, lifetime and atomic-only access.
    unsafe { &*base.as_ptr().add(off).cast::<AtomicU64>() }
}

/// The 32-bit atomic at byte `off` of the control memory at `base`.
///
/// # Safety
/// As [`word_u64`], with 4-byte alignment.
#[cfg(not(loom))]
#[inline]
pub(crate) unsafe fn word_u32<'a>(base: NonNull<u8>, off: usize) -> &'a AtomicU32 {
    // SAFETY: as in `word_u64`.
    unsafe { &*base.as_ptr().add(off).cast::<AtomicU32>() }
}

/// Sleeps while `word` holds `expected`, for at most `timeout`; may return early for any reason.
///
/// Shared between processes (no `FUTEX_PRIVATE_FLAG`), so a waker in another process that maps
/// the same page reaches the sleeper.
#[cfg(not(loom))]
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit atomic for the duration of the call; FUTEX_WAIT
    // without FUTEX_PRIVATE_FLAG so that wakers in other processes mapping the same page reach us.
    // Spurious returns (EAGAIN, EINTR, ETIMEDOUT) are fine: the caller re-polls.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every sleeper on `word` (in any process).
#[cfg(not(loom))]
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid aligned 32-bit atomic; FUTEX_WAKE only reads its address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// An ordering of the protocol that the loom mutation run (`ci/loom.sh --mutate`) may weaken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mutant {
    /// A signal's Release store of its slot, made Relaxed.
    SignalStore,
    /// A waiter's Acquire load of a slot, made Relaxed.
    SignalLoad,
    /// The signaller's SeqCst fence between its slot store and its look at the sleeper count,
    /// made AcqRel.
    SignallerFence,
    /// The sleeper's SeqCst fence between counting itself and its last poll, made AcqRel.
    SleeperFence,
    /// The SeqCst fence of `ControlArea::wake` (after an abort or a departure) between the
    /// caller's stores and its look at the sleeper count, made AcqRel.
    WakerFence,
    /// The Release store of the abort word that publishes the reason, made Relaxed.
    AbortStore,
}

#[cfg(all(loom, xccl_loom_mutant))]
impl Mutant {
    /// The name `XCCL_LOOM_MUTANT` selects it by.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mutant::SignalStore => "signal-store",
            Mutant::SignalLoad => "signal-load",
            Mutant::SignallerFence => "signaller-fence",
            Mutant::SleeperFence => "sleeper-fence",
            Mutant::WakerFence => "waker-fence",
            Mutant::AbortStore => "abort-store",
        }
    }
}

/// `ordering`: the ordering the protocol needs at the point `_mutant` names. Only a loom
/// mutation build weakens it (see the module docs).
#[cfg(not(all(loom, xccl_loom_mutant)))]
#[inline(always)]
pub(crate) const fn weakened(ordering: Ordering, _mutant: Mutant) -> Ordering {
    ordering
}

/// `ordering`, weakened (a store or load to Relaxed, a fence to AcqRel) when `XCCL_LOOM_MUTANT`
/// names `mutant`.
#[cfg(all(loom, xccl_loom_mutant))]
pub(crate) fn weakened(ordering: Ordering, mutant: Mutant) -> Ordering {
    let selected = std::env::var("XCCL_LOOM_MUTANT").ok();
    if selected.as_deref() != Some(mutant.name()) {
        return ordering;
    }
    match ordering {
        Ordering::SeqCst => Ordering::AcqRel,
        _ => Ordering::Relaxed,
    }
}

#[cfg(all(loom, test))]
pub(crate) use model::ModelMemory;
#[cfg(loom)]
pub(crate) use model::{futex_wait, futex_wake, word_u32, word_u64};

/// The loom versions of the control memory and the futex (see the module docs).
#[cfg(loom)]
mod model {
    use super::{AtomicU32, AtomicU64, Duration, NonNull};
    use loom::sync::{Condvar, Mutex};

    /// Marks memory that really is a [`ModelMemory`], so that production memory handed to a
    /// loom build fails loudly instead of being misread.
    const MODEL_MAGIC: u64 = u64::from_le_bytes(*b"LOOMCTRL");

    /// Control memory for loom: one model atomic for each word a control area uses, by offset.
    #[repr(C)]
    pub(crate) struct ModelMemory {
        magic: u64,
        u64s: Vec<(usize, AtomicU64)>,
        u32s: Vec<(usize, AtomicU32)>,
    }

    impl ModelMemory {
        /// Zeroed words at the given byte offsets.
        #[cfg(test)]
        pub(crate) fn new(u64_offsets: &[usize], u32_offsets: &[usize]) -> Self {
            ModelMemory {
                magic: MODEL_MAGIC,
                u64s: u64_offsets
                    .iter()
                    .map(|&o| (o, AtomicU64::new(0)))
                    .collect(),
                u32s: u32_offsets
                    .iter()
                    .map(|&o| (o, AtomicU32::new(0)))
                    .collect(),
            }
        }

        /// The base pointer a control area over this memory takes.
        #[cfg(test)]
        pub(crate) fn base(&self) -> NonNull<u8> {
            NonNull::from(self).cast()
        }

        /// # Safety
        /// `base` must point to at least 8 readable bytes, and to a live `ModelMemory` if they
        /// hold [`MODEL_MAGIC`].
        unsafe fn at<'a>(base: NonNull<u8>) -> &'a ModelMemory {
            // SAFETY: the caller guarantees 8 readable bytes; `magic` is the first field of a
            // `#[repr(C)]` struct, so a real `ModelMemory` holds it there.
            let magic = unsafe { base.cast::<u64>().as_ptr().read() };
            assert_eq!(
                magic, MODEL_MAGIC,
                "a loom build reached control memory that is not a ModelMemory: only the \
                 loom tests may run in a `--cfg loom` build"
            );
            // SAFETY: the magic says this is a live `ModelMemory` (caller's contract).
            unsafe { base.cast::<ModelMemory>().as_ref() }
        }
    }

    fn find<T>(words: &[(usize, T)], off: usize, width: u32) -> &T {
        words
            .iter()
            .find(|(o, _)| *o == off)
            .map(|(_, w)| w)
            .unwrap_or_else(|| panic!("no {width}-bit model word at offset {off}"))
    }

    /// The model's 64-bit word at `off`.
    ///
    /// # Safety
    /// `base` points to a [`ModelMemory`] that outlives `'a`.
    pub(crate) unsafe fn word_u64<'a>(base: NonNull<u8>, off: usize) -> &'a AtomicU64 {
        // SAFETY: forwarded caller contract.
        find(&unsafe { ModelMemory::at(base) }.u64s, off, 64)
    }

    /// The model's 32-bit word at `off`.
    ///
    /// # Safety
    /// As [`word_u64`].
    pub(crate) unsafe fn word_u32<'a>(base: NonNull<u8>, off: usize) -> &'a AtomicU32 {
        // SAFETY: forwarded caller contract.
        find(&unsafe { ModelMemory::at(base) }.u32s, off, 32)
    }

    /// The kernel's futex hash bucket: its lock and its queue of sleepers.
    struct Bucket {
        lock: Mutex<()>,
        sleepers: Condvar,
    }

    loom::lazy_static! {
        static ref BUCKET: Bucket = Bucket { lock: Mutex::new(()), sleepers: Condvar::new() };
    }

    /// Compares and sleeps as one step against [`futex_wake`]; never times out (module docs).
    pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, _timeout: Duration) {
        let guard = BUCKET.lock.lock().unwrap_or_else(|e| e.into_inner());
        // The kernel reads the word after a full barrier, under the bucket lock.
        if word.load(super::Ordering::SeqCst) != expected {
            return;
        }
        drop(BUCKET.sleepers.wait(guard));
    }

    /// Wakes every model sleeper (those of other words return spuriously).
    pub(crate) fn futex_wake(_word: &AtomicU32) {
        let _guard = BUCKET.lock.lock().unwrap_or_else(|e| e.into_inner());
        BUCKET.sleepers.notify_all();
    }
}
