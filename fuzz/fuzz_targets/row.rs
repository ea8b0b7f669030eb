//! A received A2E row's metadata: decoded rows are in range and re-encode identically.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| xccl::fuzzing::row(data));
