//! The C ABI's `xcclConfig_t` parse with any field values.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| xccl::fuzzing::c_config(data));
