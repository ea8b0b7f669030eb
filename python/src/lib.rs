//! The Python package of xccl (`import xccl`): a PyO3 extension module, `xccl._xccl`, over the
//! Rust API, re-exported by the pure-Python `xccl` package (`python/xccl/`).
//!
//! | module | owns |
//! |---|---|
//! | [`errors`] | `xccl::Error` to the exceptions of `xccl.errors` |
//! | [`tensor`] | tensors in: DLPack import, device, layout, dtype and shape checks |
//! | [`buffer`] | tensors out: `Buffer`, exported through DLPack without a copy |
//! | [`topo`] | `Topology`, `Config`, `UniqueId` |
//! | [`comm`] | `Communicator` and what its calls hand back |
//! | `testing` | support for the package's tests: fault injection (`_inject_panic`), CUDA tensors made and read back with xccl's CUDA layer (`_to_device`, `_to_host`, `_new_stream`) |
//!
//! Logging: the library's `tracing` events reach Python's `logging` (loggers `xccl.*`)
//! through the `log` crate and pyo3-log, at the level `XCCL_DEBUG` names (default `warn`).

use pyo3::prelude::*;

pub mod buffer;
pub mod comm;
pub mod errors;
pub mod tensor;
mod testing;
pub mod topo;

/// The level `XCCL_DEBUG` names (`off`, `error`, `warn`, `info`, `debug`, `trace`; default and
/// for anything else `warn`).
fn debug_level() -> log::LevelFilter {
    match std::env::var("XCCL_DEBUG")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
        .as_str()
    {
        "off" | "none" => log::LevelFilter::Off,
        "error" => log::LevelFilter::Error,
        "info" => log::LevelFilter::Info,
        "debug" => log::LevelFilter::Debug,
        "trace" => log::LevelFilter::Trace,
        _ => log::LevelFilter::Warn,
    }
}

/// The extension module.
#[pymodule]
fn _xccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let level = debug_level();
    // A second import in the same process (subinterpreters, reloads) keeps the first logger.
    let _ = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels)?
        .filter(level)
        .install();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("_debug_level", level.as_str().to_ascii_lowercase())?;
    m.add_class::<buffer::Buffer>()?;
    m.add_class::<topo::PyTopology>()?;
    m.add_class::<topo::PyConfig>()?;
    m.add_class::<topo::PyUniqueId>()?;
    m.add_class::<comm::PyComm>()?;
    m.add_class::<comm::PyA2eHandle>()?;
    m.add_class::<comm::PyExpertBatch>()?;
    m.add_class::<comm::PyTokenBatch>()?;
    m.add_function(wrap_pyfunction!(testing::_inject_panic, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_to_device, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_to_host, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_new_stream, m)?)?;
    Ok(())
}
