//! `xccl::Error` to the Python exceptions of `xccl.errors`: one class per variant, the same
//! message, the peer where there is one, and whether the communicator is now poisoned.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;
use pyo3::IntoPyObjectExt;

/// The module defining the exception classes (pure Python, so that they can inherit from
/// both `XcclError` and a builtin such as `ValueError`).
fn errors_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    MODULE
        .get_or_try_init(py, || py.import("xccl.errors").map(Bound::unbind))
        .map(|m| m.bind(py))
}

/// An exception of class `class` (from `xccl.errors`) with `message`, `peer` and `poisoned`,
/// and the extra attributes in `extra`.
fn raise(
    py: Python<'_>,
    class: &str,
    message: String,
    peer: Option<usize>,
    poisoned: bool,
    extra: &[(&str, Py<PyAny>)],
) -> PyErr {
    let make = || -> PyResult<PyErr> {
        let cls = errors_module(py)?.getattr(class)?;
        // One argument only: OSError subclasses read several positional arguments as errno.
        let exc = cls.call1((message.clone(),))?;
        exc.setattr("peer", peer)?;
        exc.setattr("poisoned", poisoned)?;
        exc.setattr("retryable", !poisoned)?;
        for (name, value) in extra {
            exc.setattr(*name, value)?;
        }
        Ok(PyErr::from_value(exc))
    };
    make().unwrap_or_else(|e| {
        PyRuntimeError::new_err(format!(
            "{message} (and building its exception failed: {e})"
        ))
    })
}

/// The Python exception for `e`; `poisoned` says whether the communicator is poisoned now.
pub(crate) fn to_py(py: Python<'_>, e: &xccl::Error, poisoned: bool) -> PyErr {
    use xccl::Error as E;
    let message = half_open_ranges(&e.to_string());
    let mut extra: Vec<(&str, Py<PyAny>)> = Vec::new();
    let mut add = |name: &'static str, value: PyResult<Py<PyAny>>| {
        if let Ok(v) = value {
            extra.push((name, v));
        }
    };
    let (class, peer) = match e {
        E::InvalidArgument(_) => ("InvalidArgumentError", None),
        E::WrongRole(_) => ("WrongRoleError", None),
        E::Timeout { peer, .. } => ("TimeoutError", Some(*peer)),
        E::PeerFailed { peer, .. } => ("PeerFailedError", Some(*peer)),
        E::Aborted { by, reason } => {
            add("by", by.into_py_any(py));
            add("reason", reason.into_py_any(py));
            ("AbortedError", None)
        }
        E::Protocol { peer, .. } | E::OutOfWindow { peer, .. } => ("ProtocolError", Some(*peer)),
        E::Bootstrap(_) => ("BootstrapError", None),
        E::FabricUnavailable { fabric, .. } => {
            add("fabric", fabric.into_py_any(py));
            ("FabricUnavailableError", None)
        }
        E::ExpertLost { expert, ranks, .. } => {
            add("expert", expert.into_py_any(py));
            add("ranks", ranks.clone().into_py_any(py));
            ("ExpertLostError", None)
        }
        E::Interrupted { peer, .. } => ("InterruptedError", Some(*peer)),
        E::Os { .. } | E::Native { .. } => ("OsError", None),
        _ => ("XcclError", None),
    };
    raise(py, class, message, peer, poisoned, &extra)
}

/// An `XcclError` for a panic inside xccl (a bug), caught before it reaches Python: `what`
/// names where, `message` is the panic's ([`panic_message`]). `poisoned` as for [`to_py`].
pub(crate) fn panicked(py: Python<'_>, what: &str, message: &str, poisoned: bool) -> PyErr {
    raise(
        py,
        "XcclError",
        format!(
            "internal error: {what} panicked ({message}), a bug in xccl{}",
            if poisoned {
                "; the communicator is poisoned and the job aborted"
            } else {
                ""
            }
        ),
        None,
        poisoned,
        &[],
    )
}

/// The text of a panic's payload (a `&str` or `String` message), else a placeholder.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "no message".into()
    }
}

/// An [`xccl::Error::InvalidArgument`] raised by the binding itself (nothing was sent).
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    to_py(py, &xccl::Error::InvalidArgument(message.into()), false)
}

/// `message` with Rust's range notation `a..b` (integers) written as Python readers take it,
/// `[a, b)`: "expert 9 outside 0..8" becomes "expert 9 outside [0, 8)".
fn half_open_ranges(message: &str) -> String {
    let b = message.as_bytes();
    let digits_from = |i: usize| b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
    let mut out = String::with_capacity(message.len() + 8);
    let mut i = 0;
    while i < b.len() {
        let starts_word = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'.');
        let lo = if starts_word { digits_from(i) } else { 0 };
        if lo > 0 && b[i + lo..].starts_with(b"..") {
            let hi = digits_from(i + lo + 2);
            let ends_word = b
                .get(i + lo + 2 + hi)
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || *c == b'.' || *c == b'='));
            if hi > 0 && ends_word {
                out.push('[');
                out.push_str(&message[i..i + lo]);
                out.push_str(", ");
                out.push_str(&message[i + lo + 2..i + lo + 2 + hi]);
                out.push(')');
                i += lo + 2 + hi;
                continue;
            }
        }
        let ch = message[i..].chars().next().unwrap_or(' ');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}
