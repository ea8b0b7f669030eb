//! Runs the `xccl-bench` binary as a user would: small shapes with `--check` over both fabrics,
//! the JSON report's fields (the `--stats` counters and sizes too), the routing file, the
//! `memory` and `model` subcommands, and bad flags.

use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xccl-bench"))
}

/// Runs `cmd`, asserts it succeeded (showing its stderr when not), returns its stdout.
fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().expect("xccl-bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("xccl-bench-test-{}-{name}", std::process::id()))
}

fn run_checked(extra: &[&str]) -> serde_json::Value {
    run_checked_ranks(2, extra)
}

/// A checked run of `m` attention and 2 expert ranks (8 experts, top-3, H=64, T=1 and 16) with
/// `extra` flags; returns its JSON report.
fn run_checked_ranks(m: usize, extra: &[&str]) -> serde_json::Value {
    let json = tmp(&format!(
        "{m}{}.json",
        extra.join("_").replace(['-', '/'], "")
    ));
    let out = bench()
        .args(["-a", &m.to_string()])
        .args(["-e", "2", "--num-experts", "8", "-k", "3", "--hidden", "64"])
        .args([
            "-t",
            "1,16",
            "--iters",
            "5",
            "--warmup",
            "1",
            "--check",
            "--timeout",
            "60",
        ])
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .expect("xccl-bench runs");
    assert!(
        out.status.success(),
        "xccl-bench {extra:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("valid json");
    std::fs::remove_file(&json).ok();
    v
}

fn assert_report(v: &serde_json::Value) {
    assert_eq!(v["check"], "passed");
    assert!(v["memcpy_gbps"].as_f64().unwrap() > 0.0);
    assert!(v["machine"]["cores"].as_u64().unwrap() >= 1);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 6, "3 ops x 2 token counts");
    for r in results {
        assert!(["a2e", "e2a", "roundtrip"].contains(&r["op"].as_str().unwrap()));
        assert!(r["p50_us"].as_f64().unwrap() > 0.0);
        assert!(r["p99_us"].as_f64().unwrap() >= r["p50_us"].as_f64().unwrap());
        assert_eq!(r["metadata_records"], 4);
        assert!(r["limit_us"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["vs_limit"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(v["floor"]["p50_us"].as_f64().unwrap() > 0.0);
    assert_eq!(v["floor"]["bytes"], 64 * 2, "one bf16 row of H=64");
    // The default 5 blocks, each one measured iteration, alternating with the limits'.
    assert_eq!(v["config"]["blocks"], 5);
}

#[test]
fn checked_run_over_local_fabric_passes_and_reports_json() {
    assert_report(&run_checked(&["--fabric", "local"]));
}

#[test]
fn checked_run_over_shm_processes_passes_in_both_layouts_and_modes() {
    assert_report(&run_checked(&["--fabric", "shm"]));
    assert_report(&run_checked(&[
        "--fabric", "shm", "--layout", "expert", "--mode", "pull",
    ]));
}

#[test]
fn registered_buffers_are_checked_and_timed() {
    assert_report(&run_checked(&[
        "--fabric",
        "shm",
        "--buffers",
        "registered",
    ]));
}

#[test]
fn plot_is_a_well_formed_svg_with_the_limit_and_the_mpi_baseline() {
    let svg = tmp("plot.svg");
    let mpi = tmp("mpi.txt");
    std::fs::write(
        &mpi,
        "MPILIB Open MPI v4.1.4\n\
         MPIBASE tokens=2 bytes_per_rank=256 a2e_p50_us=10 a2e_p99_us=11 e2a_p50_us=12 \
         e2a_p99_us=13 roundtrip_p50_us=22 roundtrip_p99_us=24 check=passed\n",
    )
    .unwrap();
    let out = bench()
        .args([
            "--fabric",
            "local",
            "-a",
            "1",
            "-e",
            "1",
            "--num-experts",
            "4",
            "-k",
            "2",
        ])
        .args([
            "--hidden", "32", "-t", "1,2,8", "--iters", "3", "--warmup", "1",
        ])
        .arg("--plot")
        .arg(&svg)
        .arg("--mpi-baseline")
        .arg(&mpi)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("vs_mpi") && stdout.contains("Open MPI v4.1.4"),
        "{stdout}"
    );
    assert!(stdout.contains("# floor:"), "{stdout}");
    let text = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).ok();
    std::fs::remove_file(&mpi).ok();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    // Balanced elements: every opened tag is closed or self-closing.
    let opened = text.matches('<').count();
    assert_eq!(opened, text.matches('>').count());
    for label in [
        "xccl roundtrip",
        "limit roundtrip",
        "MPI roundtrip",
        "p50 latency (us)",
    ] {
        assert!(text.contains(label), "plot lacks {label:?}");
    }
}

#[test]
fn xccl_debug_levels_are_accepted() {
    for level in ["warn", "info", "debug", "bogus"] {
        let out = bench()
            .env("XCCL_DEBUG", level)
            .args([
                "--fabric",
                "local",
                "-a",
                "1",
                "-e",
                "1",
                "--num-experts",
                "4",
                "-k",
                "2",
            ])
            .args(["--hidden", "8", "-t", "1", "--iters", "1", "--warmup", "0"])
            .output()
            .unwrap();
        assert!(out.status.success(), "XCCL_DEBUG={level}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(level == "bogus", err.contains("XCCL_DEBUG=bogus"), "{err}");
    }
}

#[test]
fn pinned_and_unpinned_rank_processes_both_run() {
    for bind in ["core", "none"] {
        let out = bench()
            .args([
                "--fabric",
                "shm",
                "-a",
                "1",
                "-e",
                "1",
                "--num-experts",
                "4",
                "-k",
                "2",
            ])
            .args([
                "--hidden", "16", "-t", "2", "--iters", "2", "--warmup", "0", "--check",
            ])
            .args(["--bind", bind])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "--bind {bind}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains(&format!("bind {bind}")), "{stdout}");
    }
}

#[test]
fn routing_file_is_written() {
    let path = tmp("routing.bin");
    let out = bench()
        .args([
            "--fabric",
            "local",
            "-a",
            "1",
            "-e",
            "1",
            "--num-experts",
            "4",
            "-k",
            "2",
        ])
        .args(["--hidden", "8", "-t", "4", "--iters", "2", "--warmup", "0"])
        .arg("--routing-out")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(&bytes[..8], b"XCCLRT01");
    // header (8 + 40) + per T: u32 T + 2 iterations x 1 rank x 4 tokens x 2 x (i32 + f32)
    assert_eq!(bytes.len(), 8 + 40 + 4 + 2 * 4 * 2 * 8);
}

/// Found by review: the launcher killed any job longer than `timeout x (2 + points)` (1.5 s
/// here; this job runs 4 s or more) while every rank was healthy; its guard is a liveness check
/// now.
#[test]
fn a_healthy_job_longer_than_a_few_timeouts_runs_to_its_end() {
    let start = std::time::Instant::now();
    let out = stdout_of(
        bench()
            .args(["-a", "1", "-e", "1", "--num-experts", "2", "-k", "1"])
            .args(["--hidden", "2048", "-t", "32", "--warmup", "1"])
            .args(["--iters", "30000", "--timeout", "0.5"]),
    );
    assert!(out.contains("roundtrip T=32"), "{out}");
    eprintln!("ran {:?}", start.elapsed());
}

#[test]
fn bad_flags_are_rejected_with_a_message() {
    for args in [
        &["--dtype", "int3"][..],
        &["--mode", "sideways"],
        &["--tokens", "1,x"],
        &["--fabric", "carrier-pigeon"],
        &["--buffers", "registered", "--layout", "expert"],
        &["--plot", "sweep.png"],
        &["--bind", "socket"],
        &["--domains", "0"],
        &["-a", "2", "--domains", "3"],
        &["model", "--relays", "none"],
        &["memory", "--domains", "1000"],
    ] {
        let out = bench().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}

#[test]
fn quant_both_measures_and_checks_int8_beside_the_dtype_in_one_run() {
    let v = run_checked(&["--fabric", "shm", "--quant", "both"]);
    assert_eq!(v["check"], "passed");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 12, "2 formats x 3 ops x 2 token counts");
    let wire = |q: &str| {
        results
            .iter()
            .find(|r| r["quant"] == q)
            .map(|r| r["wire_bytes_per_token"].as_u64().unwrap())
            .unwrap()
    };
    // H=64 bf16: 128 bytes; INT8: 64 bytes and a 4-byte scale.
    assert_eq!(wire("none"), 128);
    assert_eq!(wire("int8"), 68);
    for r in results.iter().filter(|r| r["quant"] == "int8") {
        assert!(r["p50_us"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn stats_json_counts_the_relayed_records_and_metadata_of_every_domain_and_checks_pass() {
    let v = run_checked_ranks(
        3,
        &[
            "--fabric",
            "local",
            "--relays",
            "2",
            "--domains",
            "3",
            "--stats",
        ],
    );
    assert_eq!(v["check"], "passed");
    assert_eq!(v["config"]["domains"], 3);
    let stats = &v["stats"];
    assert_eq!(stats["ranks"].as_array().unwrap().len(), 5);
    let sizes = stats["sizes"].as_array().unwrap();
    assert_eq!(sizes.len(), 2, "one per token count");
    for s in sizes {
        // Each call has one domain (one attention rank): 1 record to its relay, 2 x 2 headers.
        assert_eq!(s["records_per_call_formula"], 5, "{s}");
        assert_eq!(s["a2e_records_per_call"], 5.0, "{s}");
        assert_eq!(s["e2a_records_per_call"], 5.0, "{s}");
        assert_eq!(s["attention_fan_out"], 1, "{s}");
        let (got, formula) = (
            s["metadata_bytes_per_token"].as_f64().unwrap(),
            s["metadata_bytes_per_token_formula"].as_f64().unwrap(),
        );
        assert!(got > 0.0 && (got - formula).abs() < 1e-9, "{s}");
    }
    let relay = stats["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["relay"] == true)
        .unwrap();
    // The local fabric maps every window: expert ranks read the A2E rows where they landed on
    // the relay and attention ranks sum their replies there, so the relay forwards no row.
    let (a2e, e2a) = (&relay["points"][1]["a2e"], &relay["points"][1]["e2a"]);
    assert_eq!(a2e["relay_rows_forwarded"].as_u64(), Some(0), "{a2e}");
    assert_eq!(e2a["relay_rows_forwarded"].as_u64(), Some(0), "{e2a}");
    assert!(e2a["relay_combine_us"].as_f64().unwrap() > 0.0, "{e2a}");
    assert!(!a2e["peers"].as_array().unwrap().is_empty());
}

#[test]
fn memory_subcommand_prints_the_windows_of_each_relay_and_domain_count() {
    let text = stdout_of(
        bench()
            .args([
                "memory",
                "-a",
                "16",
                "-e",
                "8",
                "--num-experts",
                "16",
                "-k",
                "2",
            ])
            .args([
                "--hidden",
                "128",
                "-t",
                "8",
                "--relays",
                "0,2",
                "--domains",
                "1,4",
            ]),
    );
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 4, "{text}");
    // relays, domains, recv_cap, in_flight, attention, expert, relay, job
    let expert = |i: usize| rows[i][5].parse::<f64>().unwrap();
    assert!(
        expert(1) < expert(0),
        "4 domains shrink the expert window: {text}"
    );
    assert_eq!(rows[0][6], "-", "no relay window direct: {text}");
    assert!(rows[2][6].parse::<f64>().unwrap() > expert(2), "{text}");
}

#[test]
fn model_subcommand_calibrates_against_a_stats_run_and_projects_with_a_plot() {
    let json = tmp("model-input.json");
    stdout_of(
        bench()
            .args([
                "--fabric",
                "local",
                "-a",
                "1",
                "-e",
                "2",
                "--num-experts",
                "4",
            ])
            .args(["-k", "2", "--hidden", "64", "-t", "1,8", "--iters", "5"])
            .args(["--warmup", "1", "--stats", "--json"])
            .arg(&json),
    );
    let (svg, proj) = (tmp("model.svg"), tmp("model.json"));
    let text = stdout_of(
        bench()
            .args(["model", "--calibrate"])
            .arg(&json)
            .args([
                "-a", "4,8", "-e", "12", "--routed", "8", "-k", "2", "-t", "4",
            ])
            .args(["--hidden", "256", "--relays", "2", "--plot"])
            .arg(&svg)
            .arg("--json")
            .arg(&proj),
    );
    assert!(
        text.contains("# calibration:") && text.contains("median |error|"),
        "{text}"
    );
    let fitted = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(" fit "));
    assert_eq!(fitted.count(), 4, "2 token counts x a2e, e2a: {text}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&proj).unwrap()).unwrap();
    let points = doc["projection"]["points"].as_array().unwrap();
    assert_eq!(points.len(), 4, "2 values of M x (direct, R=2)");
    assert_eq!(points[2]["a2e_records"], 96.0, "8 x 12 direct");
    assert_eq!(points[3]["a2e_records"], 32.0, "8 + 2 x 12 relayed");
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("A2E relayed R=2"));
    for f in [json, svg, proj] {
        std::fs::remove_file(f).ok();
    }
}

/// Builds the Ascend stand-in runtime (`tests/ascend_standin`) as `<dir>/lib64/libascendcl.so`;
/// returns `<dir>` (for `ASCEND_HOME_PATH`).
fn ascend_standin() -> std::path::PathBuf {
    let home = tmp("ascend-standin");
    xccl::testing::build_ascend_standin(&home).unwrap_or_else(|e| panic!("{e}"));
    home
}

/// Runs a small checked benchmark over the device fabric `fabric` with `found` set (the
/// stand-in reachable), then again with `missing` set (no runtime): the first passes its check,
/// the second fails with an error containing every word of `named`.
fn device_fabric_bench(
    fabric: &str,
    found: &[(&str, Option<&std::ffi::OsStr>)],
    missing: &[(&str, Option<&std::ffi::OsStr>)],
    named: &[&str],
) {
    let json = tmp(&format!("{fabric}.json"));
    let args = |cmd: &mut Command, env: &[(&str, Option<&std::ffi::OsStr>)]| {
        cmd.args([
            "-a",
            "1",
            "-e",
            "2",
            "--num-experts",
            "8",
            "-k",
            "3",
            "--hidden",
            "64",
        ])
        .args(["-t", "1,16", "--iters", "5", "--warmup", "1", "--check"])
        .args(["--timeout", "60", "--fabric", fabric, "--json"])
        .arg(&json);
        for (k, v) in env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
    };
    let mut cmd = bench();
    args(&mut cmd, found);
    stdout_of(&mut cmd);
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("valid json");
    std::fs::remove_file(&json).ok();
    assert_eq!(v["check"], "passed");
    assert_eq!(v["results"].as_array().unwrap().len(), 6);
    let got = v.pointer("/config/fabric").or(v.get("fabric"));
    assert_eq!(got.and_then(|f| f.as_str()), Some(fabric), "{v}");
    // Without a runtime: a clear error naming the library and the variable to set.
    let mut cmd = bench();
    args(&mut cmd, missing);
    let out = cmd.output().expect("xccl-bench runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(named.iter().all(|w| err.contains(w)), "{err}");
}

#[test]
fn fabric_ascend_runs_checked_against_the_standin_and_names_the_runtime_without_one() {
    let home = ascend_standin();
    let prefix = format!("xccl-acl-bench{}", std::process::id());
    device_fabric_bench(
        "ascend",
        &[
            ("ACL_STANDIN_FAIL", None),
            ("ASCEND_HOME_PATH", Some(home.as_os_str())),
            ("ACL_STANDIN_SHM_PREFIX", Some(prefix.as_ref())),
        ],
        &[
            ("ACL_STANDIN_FAIL", None),
            (
                "ASCEND_HOME_PATH",
                Some("/nonexistent-ascend-home".as_ref()),
            ),
            ("LD_LIBRARY_PATH", None),
        ],
        &["libascendcl.so", "ASCEND_HOME_PATH"],
    );
    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn fabric_cuda_runs_checked_against_the_standin_and_names_the_driver_without_one() {
    let dir = tmp("cuda-standin");
    let lib = xccl::testing::build_cuda_standin(&dir).unwrap_or_else(|e| panic!("{e}"));
    let prefix = format!("xccl-cu-bench{}", std::process::id());
    device_fabric_bench(
        "cuda",
        &[
            ("CUDA_STANDIN_FAIL", None),
            ("XCCL_CUDA_LIBRARY", Some(lib.as_os_str())),
            ("CUDA_STANDIN_SHM_PREFIX", Some(prefix.as_ref())),
        ],
        &[
            (
                "XCCL_CUDA_LIBRARY",
                Some("/nonexistent/libcuda.so.1".as_ref()),
            ),
            ("LD_LIBRARY_PATH", None),
        ],
        &["libcuda.so.1", "XCCL_CUDA_LIBRARY"],
    );
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "stand-in segments left: {left:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fabric_cuda_runs_the_device_buffer_calls_expert_major_checked_and_refuses_host_buffers() {
    let dir = tmp("cuda-standin-expert");
    let lib = xccl::testing::build_cuda_standin(&dir).unwrap_or_else(|e| panic!("{e}"));
    let prefix = format!("xccl-cu-expert{}", std::process::id());
    let json = tmp("cuda-expert.json");
    let run = |extra: &[&str]| {
        let mut cmd = bench();
        cmd.args(["-a", "2", "-e", "2", "--num-experts", "8", "-k", "3"])
            .args([
                "--hidden", "64", "-t", "1,16", "--iters", "5", "--warmup", "1",
            ])
            .args(["--timeout", "60", "--fabric", "cuda", "--json"])
            .arg(&json)
            .args(extra)
            .env_remove("CUDA_STANDIN_FAIL")
            .env("XCCL_CUDA_LIBRARY", &lib)
            .env("CUDA_STANDIN_SHM_PREFIX", &prefix);
        cmd
    };
    stdout_of(&mut run(&["--layout", "expert", "--check"]));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("valid json");
    assert_eq!(v["check"], "passed", "{v}");
    // A view or a registered buffer is host memory: refused before any rank starts.
    for extra in [&["--layout", "view"][..], &["--buffers", "registered"][..]] {
        let out = run(extra).output().expect("runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} accepted");
        assert!(err.contains("device-buffer calls"), "{extra:?}: {err}");
    }
    std::fs::remove_file(&json).ok();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fabric_cuda_limit_is_the_device_to_device_copy_of_the_same_bytes_in_table_and_json() {
    let dir = tmp("cuda-standin-limit");
    let lib = xccl::testing::build_cuda_standin(&dir).unwrap_or_else(|e| panic!("{e}"));
    let prefix = format!("xccl-cu-limit{}", std::process::id());
    let json = tmp("cuda-limit.json");
    let stdout = stdout_of(
        bench()
            .args(["-a", "2", "-e", "2", "--num-experts", "8", "-k", "3"])
            .args([
                "--hidden", "64", "-t", "1,16", "--iters", "5", "--warmup", "1",
            ])
            .args(["--timeout", "60", "--fabric", "cuda", "--json"])
            .arg(&json)
            .env_remove("CUDA_STANDIN_FAIL")
            .env("XCCL_CUDA_LIBRARY", &lib)
            .env("CUDA_STANDIN_SHM_PREFIX", &prefix),
    );
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("valid json");
    std::fs::remove_file(&json).ok();
    std::fs::remove_dir_all(&dir).ok();
    // The table names the limit, per token count.
    for t in [1, 16] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("# limit T={t}:")))
            .unwrap_or_else(|| panic!("no limit line for T={t}:\n{stdout}"));
        assert!(line.contains("device-to-device copy"), "{line}");
    }
    let limit = &v["limit"];
    assert_eq!(limit["kind"], "device-to-device copy", "{v}");
    assert!(limit["copies_per_sample"].as_u64().unwrap() > 1, "{limit}");
    let points = limit["points"].as_array().expect("limit points");
    assert_eq!(points.len(), 2, "{limit}");
    for (p, t) in points.iter().zip([1, 16]) {
        assert_eq!(p["tokens"], t);
        assert!(p["bytes"].as_u64().unwrap() >= 64 * 2, "{p}");
        for op in ["a2e", "e2a", "roundtrip"] {
            let p50 = p["p50_us"][op].as_f64().unwrap();
            assert!(p50 > 0.0 && p["p99_us"][op].as_f64().unwrap() >= p50, "{p}");
        }
    }
    // Every dtype row's limit column holds that limit's positive p50.
    for r in v["results"].as_array().unwrap() {
        let t = r["tokens"].as_u64().unwrap();
        let p = points.iter().find(|p| p["tokens"] == t).unwrap();
        let limit_us = r["limit_us"].as_f64().expect("limit_us");
        assert!(limit_us > 0.0, "{r}");
        assert_eq!(
            limit_us,
            p["p50_us"][r["op"].as_str().unwrap()].as_f64().unwrap()
        );
    }
}
