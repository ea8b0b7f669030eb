//! Raw native bindings for xccl.
//!
//! This crate holds the raw declarations for the native libraries that xccl's fabrics talk to
//! (libfabric for the RDMA fabrics, the Ascend ACL runtime for HCCS). Each is opened with `dlopen`
//! at run time, so `libxccl` loads on machines that lack them and reports the missing library by
//! name only when a fabric that needs it is asked for. The shared-memory and in-process fabrics
//! need nothing from here.
//!
//! - [`acl`]: the Ascend runtime (`libascendcl.so`): bindgen output of
//!   `include/acl_rt_subset.h` and the loader that finds and opens the library.

pub mod acl;
