//! A metadata record against a window layout: what passes the receiver's checks stays inside its regions.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| xccl::fuzzing::record(data));
