//! Fault injection for the package's own tests: `xccl._xccl._inject_panic(site)` makes the next
//! call on a communicator (`"call"`) or the next init/shrink helper thread (`"helper"`) panic
//! once, so that the tests can check that no panic reaches Python and that the job is told.
//! Nothing else reads it; it costs one atomic load per call.

use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::prelude::*;

use crate::errors::invalid;

/// Where an injected panic fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Site {
    /// Inside the next call on a communicator, with its lock held.
    Call = 1,
    /// On the next helper thread of init or shrink, before its work.
    Helper = 2,
}

/// The armed site (0: none).
static ARMED: AtomicU8 = AtomicU8::new(0);

/// Panics if a test armed `site` (once).
pub(crate) fn maybe_panic(site: Site) {
    if ARMED.load(Ordering::Relaxed) == site as u8
        && ARMED
            .compare_exchange(site as u8, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        panic!("a panic injected by a test at {site:?}");
    }
}

/// Arms a panic at `site` (`"call"` or `"helper"`): for the package's tests only.
#[pyfunction]
pub(crate) fn _inject_panic(py: Python<'_>, site: &str) -> PyResult<()> {
    let site = match site {
        "call" => Site::Call,
        "helper" => Site::Helper,
        other => {
            return Err(invalid(
                py,
                format!("unknown site {other:?} (expected \"call\" or \"helper\")"),
            ))
        }
    };
    ARMED.store(site as u8, Ordering::Release);
    Ok(())
}
