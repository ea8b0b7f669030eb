//! 8 attention and 8 expert ranks over ofi (libfabric's tcp provider) spread over four network
//! namespaces joined by veth pairs, direct and through 2 relays, run as a user would run the
//! bench (`--fabric ofi --netns 4 --check --stats`): every result checked against the reference
//! bit for bit, every link's records, rows and bytes checked against the routing's plan, the
//! cost model's prediction printed beside the measurement, and no namespace left behind.

use std::process::Command;

/// Namespaces of this test's jobs still present (`xccl-<pid>-...` of a bench it started).
fn namespaces_of(pid: u32) -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output();
    let text = out.map_or(String::new(), |o| {
        String::from_utf8_lossy(&o.stdout).into_owned()
    });
    text.lines()
        .filter(|l| l.starts_with(&format!("xccl-{pid}-")))
        .map(str::to_owned)
        .collect()
}

/// Whether this process may make network namespaces (root with iproute2).
fn can_make_namespaces() -> Result<(), String> {
    let name = format!("xccl-{}-probe", std::process::id());
    let made = Command::new("ip")
        .args(["netns", "add", &name])
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if !made.status.success() {
        return Err(String::from_utf8_lossy(&made.stderr).trim().to_owned());
    }
    let _ = Command::new("ip").args(["netns", "del", &name]).output();
    Ok(())
}

/// Runs the 8A:8E job with `extra` flags; returns its stdout after checking what it printed.
fn run_job(extra: &[&str], links: usize) -> String {
    let child = Command::new(env!("CARGO_BIN_EXE_xccl-bench"))
        .args(["--fabric", "ofi", "--netns", "4", "-a", "8", "-e", "8"])
        .args([
            "--num-experts",
            "16",
            "-k",
            "2",
            "--hidden",
            "64",
            "-t",
            "4",
        ])
        .args(["--iters", "3", "--warmup", "1", "--check", "--stats"])
        .args(["--timeout", "60"])
        .args(extra)
        .env("XCCL_OFI_QUIET", "1")
        .spawn_and_wait();
    let (status, pid, stdout, stderr) = child;
    assert!(
        namespaces_of(pid).is_empty(),
        "namespaces left behind: {:?}",
        namespaces_of(pid)
    );
    assert!(
        status.success(),
        "xccl-bench {extra:?} failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("check passed"), "{stdout}");
    assert!(stdout.contains("# netns: 4 hosts"), "{stdout}");
    let want = format!("# links checked against the plan: {links} links, {links} match (all)");
    assert!(stdout.contains(&want), "expected `{want}`:\n{stdout}");
    for call in ["T=4 a2e", "T=4 e2a"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with("# model:") && l.contains(call))
            .unwrap_or_else(|| panic!("no model line for {call}:\n{stdout}"));
        println!("{line}");
    }
    for line in stdout.lines().filter(|l| l.contains("roundtrip")) {
        println!("{line}");
    }
    stdout
}

trait SpawnAndWait {
    fn spawn_and_wait(&mut self) -> (std::process::ExitStatus, u32, String, String);
}

impl SpawnAndWait for Command {
    /// Runs the command, keeping its pid (the namespaces carry it) and its output.
    fn spawn_and_wait(&mut self) -> (std::process::ExitStatus, u32, String, String) {
        use std::process::Stdio;
        let child = self
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("xccl-bench starts");
        let pid = child.id();
        let out = child.wait_with_output().expect("xccl-bench output");
        (
            out.status,
            pid,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

#[test]
fn ofi_8a_8e_over_four_namespaces_direct_and_through_2_relays_match_reference_and_plan() {
    if let Err(why) = can_make_namespaces() {
        eprintln!(
            "\n!!!!!!!! ofi 8A:8E over four network namespaces NOT RUN !!!!!!!!\n\
             cannot create network namespaces here ({why}); the test needs root \
             (CAP_NET_ADMIN) and iproute2.\n"
        );
        return;
    }
    // Direct: every attention rank writes to all 8 expert ranks and back: 2 x 64 links.
    let direct = run_job(&[], 128);
    assert!(!direct.contains("relays"), "{direct}");
    // Two relays (expert ranks 8 and 12), four members each: A2E 8 member links and 2 x 8
    // relay-to-expert links (its own window included), E2A the mirror: 48 links.
    let relayed = run_job(&["--relays", "2"], 48);
    assert!(relayed.contains("# relays 2"), "{relayed}");
    assert!(relayed.contains("relay phases per call"), "{relayed}");
}
