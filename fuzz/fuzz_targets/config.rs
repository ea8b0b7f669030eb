//! The dtype / quantization / mode / wait-policy parsers and `MoeConfig::validate` with any numbers.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| xccl::fuzzing::config(data));
