//! Bootstrap frames read as the root and ranks read them, every payload decoder, and the unique id parsers.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| xccl::fuzzing::bootstrap(data));
