//! Runs the multi-process example (`examples/moe_job.rs`) as a user would: its launcher starts
//! real rank processes over shared memory, and the test checks that every rank succeeded.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// The example's binary, which `cargo test` builds next to this test's.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    dir.join("examples").join("moe_job")
}

fn run(args: &[&str]) {
    let bin = example_binary();
    assert!(bin.exists(), "{} not built", bin.display());
    let mut child = Command::new(&bin)
        .args(args)
        .env_remove("RANK")
        .spawn()
        .expect("start the example");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the example did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "example {args:?} failed: {status}");
}

#[test]
fn the_multi_process_example_runs_2_attention_and_2_expert_ranks() {
    run(&[]);
}

#[test]
fn the_multi_process_example_runs_3_attention_ranks_against_1_expert() {
    run(&["3", "1", "10"]);
}

/// The soak example (`examples/soak.rs`, built with the `testing` feature, which the workspace's
/// test crates turn on) for a short run: every result checked, the resident set flat.
#[cfg(feature = "testing")]
#[test]
fn a_short_soak_checks_every_result_and_keeps_memory_flat() {
    let bin = example_binary().with_file_name("soak");
    assert!(bin.exists(), "{} not built", bin.display());
    let out = Command::new(&bin)
        .arg("2000")
        .output()
        .expect("run the soak");
    assert!(
        out.status.success(),
        "soak failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
