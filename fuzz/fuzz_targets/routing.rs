//! Routing (expert ids, weights, token counts) into the dispatch layout.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| xccl::fuzzing::routing(data));
