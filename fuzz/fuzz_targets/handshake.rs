//! The rank's side of the bootstrap handshake against a root that answers with arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| xccl::fuzzing::handshake(data));
