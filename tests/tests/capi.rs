//! The C ABI (`include/xccl.h`, `libxccl.so`) from C and C++, in real processes.
//!
//! Each test compiles its program with `gcc -std=c11` or `g++ -std=c++17` and `-Wall -Wextra
//! -Werror -pedantic` against the header and the `libxccl.so` next to this test binary
//! (`target/release` under `cargo test --release`), runs its ranks as separate processes
//! (each in its own process group, killed with its children on timeout or panic), and checks
//! every rank's exit status and that the job left nothing in `/dev/shm`.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use xccl::bootstrap::{LaunchEnv, RootConfig, UniqueId};
use xccl::testing::netns::Hosts;
use xccl_tests::{shm_entries, unique_job_id};

/// One job at a time: the machine may have 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

const TIMEOUT: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// `target/<profile>`: this binary is `target/<profile>/deps/capi-<hash>`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// The directory holding `libxccl.so` and `libxccl.a`: `target/<profile>/deps`, where the
/// build of this very test put them (`cargo build` copies them up to `target/<profile>`, which
/// may be older), else `target/<profile>`.
fn lib_dir() -> PathBuf {
    let profile = profile_dir();
    [profile.join("deps"), profile.clone()]
        .into_iter()
        .find(|d| d.join("libxccl.so").exists())
        .unwrap_or_else(|| {
            panic!(
                "no libxccl.so under {}: run `cargo build -p xccl --release`",
                profile.display()
            )
        })
}

fn out_dir() -> PathBuf {
    let d = profile_dir().join("capi-tests");
    std::fs::create_dir_all(&d).expect("creating the capi-tests directory");
    d
}

/// Compiles `src` (C11 with gcc, or C++17 with g++ for `.cpp`) into an executable linked
/// against `libxccl.so`; panics with the compiler's output on any warning.
fn compile(src: &Path, name: &str) -> PathBuf {
    let lib = lib_dir();
    let out = out_dir().join(name);
    let cpp = src.extension().is_some_and(|e| e == "cpp");
    let (cc, std) = if cpp {
        ("g++", "-std=c++17")
    } else {
        ("gcc", "-std=c11")
    };
    let output = Command::new(cc)
        .args([std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-O1"])
        .arg("-I")
        .arg(repo().join("include"))
        .arg("-I")
        .arg(repo().join("tests/capi"))
        .arg(src)
        .arg("-o")
        .arg(&out)
        .arg("-L")
        .arg(&lib)
        .arg("-lxccl")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-pthread")
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(
        output.status.success(),
        "{cc} {} failed:\n{}{}",
        src.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    out
}

/// Running ranks; killed (with their process groups) when dropped.
struct Ranks {
    children: Vec<(Child, PathBuf)>,
}

impl Ranks {
    fn spawn(name: &str, cmds: Vec<Command>) -> Ranks {
        let mut ranks = Ranks {
            children: Vec::new(),
        };
        for (r, mut cmd) in cmds.into_iter().enumerate() {
            let log = out_dir().join(format!("{name}.{}.rank{r}.log", std::process::id()));
            let f = File::create(&log).expect("log file");
            // cargo's LD_LIBRARY_PATH outranks the programs' RUNPATH and may name another
            // (older) libxccl.so: point it at the one the programs were linked against.
            let child = cmd
                .env("LD_LIBRARY_PATH", lib_dir())
                .stdin(Stdio::null())
                .stdout(f.try_clone().expect("log file"))
                .stderr(f)
                .process_group(0)
                .spawn()
                .unwrap_or_else(|e| panic!("spawning rank {r}: {e}"));
            ranks.children.push((child, log));
        }
        ranks
    }

    fn kill_all(&mut self) {
        for (c, _) in &mut self.children {
            if let Ok(None) = c.try_wait() {
                // SAFETY: kill(2) on the process group we created for this child.
                unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
                let _ = c.wait();
            }
        }
    }

    /// Waits for every rank; panics with every rank's output unless all exited with 0.
    fn expect_success(mut self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut status = vec![None; self.children.len()];
        while status.iter().any(Option::is_none) && Instant::now() < deadline {
            for (i, (c, _)) in self.children.iter_mut().enumerate() {
                if status[i].is_none() {
                    status[i] = c.try_wait().expect("try_wait");
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let timed_out = status.iter().any(Option::is_none);
        self.kill_all();
        let logs: Vec<String> = self
            .children
            .iter()
            .map(|(_, log)| std::fs::read_to_string(log).unwrap_or_default())
            .collect();
        let failed = status.iter().any(|s| !s.is_some_and(|s| s.success()));
        if timed_out || failed {
            let mut msg = format!("ranks failed (timed out: {timed_out}): {status:?}\n");
            for (r, l) in logs.iter().enumerate() {
                msg.push_str(&format!("--- rank {r}\n{l}"));
            }
            panic!("{msg}");
        }
        for (_, log) in &self.children {
            let _ = std::fs::remove_file(log);
        }
        logs
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn assert_no_leftovers(job_id: u64) {
    let prefix = format!("xccl-{job_id:016x}-");
    let left = shm_entries(&prefix);
    assert!(left.is_empty(), "the job left {left:?} in /dev/shm");
}

/// Runs `exe` as `n` ranks joined by a unique id on the command line (after `first_args`).
fn run_with_unique_id(exe: &Path, n: usize, first_args: &[&str]) {
    run_with_unique_id_env(exe, n, first_args, &|_, _| {});
}

/// [`run_with_unique_id`] with each rank's command adjusted by `customize(rank, cmd)`.
fn run_with_unique_id_env(
    exe: &Path,
    n: usize,
    first_args: &[&str],
    customize: &dyn Fn(usize, &mut Command),
) {
    let job_id = unique_job_id();
    let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
    let (id, _root) = UniqueId::start_root(bind, RootConfig::new(job_id)).expect("bootstrap root");
    let logs = run_ranks(exe, n, first_args, &id, customize);
    for (r, l) in logs.iter().enumerate() {
        assert!(l.contains(&format!("rank {r}: ok")), "rank {r}: {l}");
    }
    assert_no_leftovers(job_id);
}

/// Runs `exe` as `n` ranks of the job `id` (after `first_args`), each command adjusted by
/// `customize(rank, cmd)`; returns every rank's output once all exited with 0.
fn run_ranks(
    exe: &Path,
    n: usize,
    first_args: &[&str],
    id: &UniqueId,
    customize: &dyn Fn(usize, &mut Command),
) -> Vec<String> {
    let cmds = (0..n)
        .map(|r| {
            let mut c = Command::new(exe);
            c.args(first_args)
                .args(["--id", &id.to_string(), "--rank", &r.to_string()])
                .args(["--nranks", &n.to_string()]);
            customize(r, &mut c);
            c
        })
        .collect();
    let name = exe.file_name().unwrap().to_string_lossy().into_owned();
    Ranks::spawn(&name, cmds).expect_success(TIMEOUT)
}

fn free_port() -> u16 {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    l.local_addr().expect("local_addr").port()
}

/// Launcher variables of rank `r` of `n`: `style` is `"xccl"` or `"torchrun"`.
fn launcher_env(style: &str, r: usize, n: usize, port: u16, job: u64) -> BTreeMap<String, String> {
    let root = format!("127.0.0.1:{port}");
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    match style {
        "xccl" => {
            set("XCCL_RANK", r.to_string());
            set("XCCL_SIZE", n.to_string());
            set("XCCL_ROOT", root);
        }
        "torchrun" => {
            set("RANK", r.to_string());
            set("WORLD_SIZE", n.to_string());
            set("LOCAL_RANK", r.to_string());
            set("MASTER_ADDR", "127.0.0.1".into());
            set("MASTER_PORT", port.to_string());
        }
        other => panic!("unknown launcher style {other}"),
    }
    set("XCCL_JOB_ID", format!("{job}"));
    // Every rank of the job holds the same key (here derived from the job number; a real
    // launcher passes a random one, e.g. from `openssl rand -hex 32`).
    set("XCCL_JOB_KEY", format!("{job:064x}"));
    env
}

/// Runs `n` ranks of `argv` under launcher variables of `style`.
fn run_with_launcher_env(argv: &[&str], style: &str, n: usize) -> Vec<String> {
    let port = free_port();
    let job = unique_job_id();
    let envs: Vec<_> = (0..n)
        .map(|r| launcher_env(style, r, n, port, job))
        .collect();
    let job_id = LaunchEnv::detect_with(&|k| envs[0].get(k).cloned())
        .expect("launcher variables")
        .expect("a launcher")
        .job_id;
    let cmds = envs
        .iter()
        .map(|env| {
            let mut c = Command::new(argv[0]);
            c.args(&argv[1..]).envs(env);
            c
        })
        .collect();
    let name = Path::new(argv[argv.len() - 1])
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let logs = Ranks::spawn(&format!("{name}-{style}"), cmds).expect_success(TIMEOUT);
    assert_no_leftovers(job_id);
    logs
}

#[test]
fn c11_program_four_ranks_joined_by_unique_id() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(&repo().join("tests/capi/capi_test.c"), "capi_test_c");
    run_with_unique_id(&exe, 4, &[]);
}

#[test]
fn c11_program_two_ranks_joined_by_launcher_env() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(&repo().join("tests/capi/capi_test.c"), "capi_test_c_env");
    let exe = exe.to_string_lossy().into_owned();
    let logs = run_with_launcher_env(&[&exe, "--env"], "xccl", 2);
    assert!(logs[1].contains("rank 1: ok"), "{logs:?}");
}

#[test]
fn cpp17_program_explicit_placement_and_registered_buffers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(&repo().join("tests/capi/capi_test.cpp"), "capi_test_cpp");
    run_with_unique_id(&exe, 3, &[]);
    run_with_unique_id(&exe, 2, &["--bf16"]);
    let exe = exe.to_string_lossy().into_owned();
    run_with_launcher_env(&[&exe, "--env"], "torchrun", 4);
}

#[test]
fn c11_program_int8_on_the_wire_with_rows_kept_as_int8() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(&repo().join("tests/capi/capi_int8.c"), "capi_int8_c");
    run_with_unique_id(&exe, 2, &[]);
}

#[test]
fn header_included_twice_compiles_clean_as_c_and_cpp() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let src = out_dir().join("header_twice.c");
    std::fs::write(
        &src,
        "#include \"xccl.h\"\n#include \"xccl.h\"\n\
         int main(void) { xcclConfig_t c = XCCL_CONFIG_INITIALIZER; xcclComm_t comm = 0;\n\
         (void)comm; return (int)c.version - XCCL_CONFIG_VERSION + (XCCL_VERSION_CODE < 0); }\n",
    )
    .expect("writing the test source");
    for (cc, std) in [
        ("gcc", "-std=c11"),
        ("gcc", "-std=c99"),
        ("g++", "-std=c++17"),
    ] {
        let mut cmd = Command::new(cc);
        if cc == "g++" {
            cmd.args(["-x", "c++"]);
        }
        let out = cmd
            .args([
                std,
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
                "-fsyntax-only",
            ])
            .arg("-I")
            .arg(repo().join("include"))
            .arg(&src)
            .output()
            .expect("running the compiler");
        assert!(
            out.status.success(),
            "{cc} {std}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn c_example_from_the_readme_runs_four_ranks() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(&repo().join("examples/c/xccl_example.c"), "xccl_example");
    let before = shm_entries("xccl-");
    // The example starts its own ranks (xcclGetUniqueId, then fork/exec of itself).
    let mut launcher = Command::new(&exe);
    launcher.arg("4");
    let logs = Ranks::spawn("xccl_example", vec![launcher]).expect_success(TIMEOUT);
    assert!(logs[0].contains("all 4 ranks ok"), "{}", logs[0]);
    let new: Vec<_> = shm_entries("xccl-")
        .into_iter()
        .filter(|e| !before.contains(e))
        .collect();
    assert!(new.is_empty(), "the example left {new:?} in /dev/shm");
}

#[test]
fn install_step_pkg_config_and_static_library_build_the_example() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let prefix = out_dir().join(format!("prefix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    let st = Command::new(repo().join("ci/install-capi.sh"))
        .arg(&prefix)
        .env("XCCL_LIB_DIR", lib_dir())
        .status()
        .expect("running ci/install-capi.sh");
    assert!(st.success(), "ci/install-capi.sh failed");
    let pkg = |args: &[&str]| {
        let out = Command::new("pkg-config")
            .args(args)
            .arg("xccl")
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
            .output()
            .expect("running pkg-config");
        assert!(out.status.success(), "pkg-config {args:?} xccl failed");
        String::from_utf8(out.stdout).expect("utf-8")
    };
    assert_eq!(pkg(&["--modversion"]).trim(), env!("CARGO_PKG_VERSION"));
    let example = repo().join("examples/c/xccl_example.c");
    // Shared: the README's command line, plus an rpath to the prefix.
    let shared = prefix.join("xccl_example");
    let libdir = prefix.join("lib");
    let mut cc = Command::new("gcc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
        .arg(&example)
        .args(pkg(&["--cflags", "--libs"]).split_whitespace())
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-o")
        .arg(&shared);
    assert!(cc.status().expect("gcc").success(), "{cc:?} failed");
    // Static: libxccl.a and the private libraries pkg-config lists.
    let fully = prefix.join("xccl_example_static");
    let mut cc = Command::new("gcc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
        .arg(&example)
        .args(pkg(&["--cflags"]).split_whitespace())
        .arg(libdir.join("libxccl.a"))
        .args(
            pkg(&["--libs", "--static"])
                .split_whitespace()
                .filter(|a| *a != "-lxccl"),
        )
        .arg("-o")
        .arg(&fully);
    assert!(cc.status().expect("gcc").success(), "{cc:?} failed");
    for exe in [&shared, &fully] {
        let mut launcher = Command::new(exe);
        launcher.arg("2");
        let logs = Ranks::spawn("installed_example", vec![launcher]).expect_success(TIMEOUT);
        assert!(logs[0].contains("all 2 ranks ok"), "{}", logs[0]);
    }
    let _ = std::fs::remove_dir_all(&prefix);
}

#[test]
fn c11_engine_program_roles_tags_ready_tests_stats_and_grown_structs_over_shm() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(&repo().join("tests/capi/capi_engine.c"), "capi_engine_c");
    for n in [2, 3, 4] {
        run_with_unique_id(&exe, n, &[]);
    }
    // A caller compiled against config version 1: the 9-field batch info is not overrun.
    run_with_unique_id(&exe, 2, &["--legacy"]);
}

#[test]
fn c11_engine_program_shrinks_past_a_sigkilled_expert_rank_over_shm() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(
        &repo().join("tests/capi/capi_engine.c"),
        "capi_engine_c_kill",
    );
    let job_id = unique_job_id();
    let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
    let (id, _root) = UniqueId::start_root(bind, RootConfig::new(job_id)).expect("bootstrap root");
    let logs = run_ranks_allowing_kill(&exe, 4, &["--kill", "2"], &id, &|_, _| {});
    for r in [0, 1, 3] {
        assert!(
            logs[r].contains(&format!("rank {r}: ok")),
            "rank {r}: {}",
            logs[r]
        );
    }
    assert!(logs[0].contains("hosting all 8 experts"), "{}", logs[0]);
    assert!(
        logs[0].contains("expert loop ended by the stop tag"),
        "{}",
        logs[0]
    );
}

/// A job's root, bound in host 0 of two network namespaces (`xccl::testing::netns`).
fn root_in_host_0(ns: &Hosts) -> (UniqueId, xccl::bootstrap::RootHandle) {
    ns.start_root(unique_job_id())
        .expect("bootstrap root in host 0")
}

/// Runs rank `rank`'s command in host `rank % 2`, over libfabric's tcp provider on that host's
/// address (through the test programs' `ENGINE_OFI_*` variables).
fn run_in_host(ns: &Hosts, rank: usize, cmd: &mut Command) {
    let host = ns.host_of(rank);
    cmd.env("ENGINE_OFI_PROVIDER", "tcp;ofi_rxm")
        .env("ENGINE_OFI_INTERFACE", ns.addr(host))
        .env_remove("XCCL_OFI_ADDR")
        .env_remove("XCCL_OFI_PROVIDER");
    ns.enter(host, cmd).expect("placing the rank in its host");
}

#[test]
fn c11_engine_program_over_ofi_across_two_network_namespaces() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = match Hosts::create(2) {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!(
                "\n!!!! c11 engine over ofi NOT RUN: cannot create network namespaces ({why})\n"
            );
            return;
        }
    };
    let exe = compile(
        &repo().join("tests/capi/capi_engine.c"),
        "capi_engine_c_ofi",
    );
    let customize = |rank: usize, cmd: &mut Command| run_in_host(&ns, rank, cmd);
    for (n, args) in [
        (2, &["--fabric", "ofi"][..]),
        (4, &["--fabric", "ofi"][..]),
        (4, &["--fabric", "ofi", "--kill", "2"][..]),
    ] {
        let (id, _root) = root_in_host_0(&ns);
        let logs = run_ranks_allowing_kill(&exe, n, args, &id, &customize);
        for (r, l) in logs.iter().enumerate() {
            if args.contains(&"--kill") && r == 2 {
                continue;
            }
            assert!(l.contains(&format!("rank {r}: ok")), "rank {r}: {l}");
        }
    }
}

#[test]
fn c11_engine_program_over_ascend_against_the_standin_runtime() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let home = out_dir().join("ascend-standin");
    xccl::testing::build_ascend_standin(&home).unwrap_or_else(|e| panic!("{e}"));
    let exe = compile(
        &repo().join("tests/capi/capi_engine.c"),
        "capi_engine_c_ascend",
    );
    let job_id = unique_job_id();
    let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
    let (id, _root) = UniqueId::start_root(bind, RootConfig::new(job_id)).expect("bootstrap root");
    let prefix = format!("xccl-acl-c{}", std::process::id());
    let customize = |_: usize, cmd: &mut Command| {
        cmd.env("ASCEND_HOME_PATH", &home)
            .env("ACL_STANDIN_SHM_PREFIX", &prefix)
            .env_remove("ACL_STANDIN_FAIL");
    };
    let logs = run_ranks(&exe, 2, &["--fabric", "ascend"], &id, &customize);
    for (r, l) in logs.iter().enumerate() {
        assert!(l.contains(&format!("rank {r}: ok")), "rank {r}: {l}");
    }
    let left = shm_entries(&format!("{prefix}-"));
    assert!(left.is_empty(), "the stand-in left {left:?}");
    // Without a runtime: xcclUnavailable naming the library and the variable to set.
    let (id, _root) = UniqueId::start_root(bind, RootConfig::new(unique_job_id())).expect("root");
    let cmds = (0..2)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args([
                "--fabric",
                "ascend",
                "--expect-unavailable",
                "--id",
                &id.to_string(),
            ])
            .args(["--rank", &r.to_string(), "--nranks", "2"])
            .env("ASCEND_HOME_PATH", "/nonexistent-ascend-home");
            c
        })
        .collect();
    let logs = Ranks::spawn("capi_engine_no_ascend", cmds).expect_success(TIMEOUT);
    for l in &logs {
        assert!(
            l.contains("libascendcl.so") && l.contains("ASCEND_HOME_PATH"),
            "{l}"
        );
    }
}

/// Runs `exe` like [`run_ranks`]; with `--kill R` among the arguments rank R must die of
/// SIGKILL and the others exit with 0.
fn run_ranks_allowing_kill(
    exe: &Path,
    n: usize,
    args: &[&str],
    id: &UniqueId,
    customize: &dyn Fn(usize, &mut Command),
) -> Vec<String> {
    let Some(k) = args.iter().position(|a| *a == "--kill") else {
        return run_ranks(exe, n, args, id, customize);
    };
    let killed: usize = args[k + 1].parse().expect("--kill R");
    let cmds = (0..n)
        .map(|r| {
            let mut c = Command::new(exe);
            c.args(args)
                .args(["--id", &id.to_string(), "--rank", &r.to_string()])
                .args(["--nranks", &n.to_string()]);
            customize(r, &mut c);
            c
        })
        .collect();
    let mut ranks = Ranks::spawn("capi_engine_kill", cmds);
    let deadline = Instant::now() + TIMEOUT;
    let mut status = vec![None; n];
    while status.iter().any(Option::is_none) && Instant::now() < deadline {
        for (i, (c, _)) in ranks.children.iter_mut().enumerate() {
            if status[i].is_none() {
                status[i] = c.try_wait().expect("try_wait");
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let logs: Vec<String> = (ranks.children.iter())
        .map(|(_, log)| std::fs::read_to_string(log).unwrap_or_default())
        .collect();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status[killed].and_then(|s| s.signal()),
        Some(libc::SIGKILL),
        "rank {killed}: {}",
        logs[killed]
    );
    for r in (0..n).filter(|&r| r != killed) {
        assert!(
            status[r].is_some_and(|s| s.success()),
            "rank {r} ({:?}):\n{}",
            status[r],
            logs[r]
        );
        assert!(
            logs[r].contains(&format!("shrunk to {} ranks", n - 1)),
            "rank {r}: {}",
            logs[r]
        );
    }
    logs
}

#[test]
fn c11_one_ranks_bad_or_different_config_fails_every_rank_at_once_naming_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(
        &repo().join("tests/capi/capi_engine.c"),
        "capi_engine_c_bad",
    );
    for args in [["--bad-rank", "2"], ["--mismatch-rank", "1"]] {
        let job_id = unique_job_id();
        let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
        let (id, _root) = UniqueId::start_root(bind, RootConfig::new(job_id)).expect("root");
        let logs = run_ranks(&exe, 3, &args, &id, &|_, _| {});
        for (r, l) in logs.iter().enumerate() {
            assert!(l.contains(&format!("rank {r}: ok")), "rank {r}: {l}");
            eprintln!(
                "{}",
                l.lines().find(|l| l.contains("init failed")).unwrap_or("")
            );
        }
    }
}

/// Runs `capi_life --leave` for each `(leaver, open)`: 2 ranks (0 attention, 1 expert) with
/// `args`, roots from `root`, commands adjusted by `customize`; returns the survivors' logs.
fn run_leave_cases(
    exe: &Path,
    cases: &[(usize, bool)],
    args: &[&str],
    root: &dyn Fn() -> (UniqueId, xccl::bootstrap::RootHandle),
    customize: &dyn Fn(usize, &mut Command),
) -> Vec<String> {
    let mut survivors = Vec::new();
    for &(leaver, open) in cases {
        let stamp = out_dir().join(format!("life.{}.{leaver}.{open}.stamp", std::process::id()));
        let ready = stamp.with_extension("stamp.ready");
        let _ = std::fs::remove_file(&stamp);
        let _ = std::fs::remove_file(&ready);
        let (id, _root) = root();
        let (l, s) = (leaver.to_string(), stamp.to_string_lossy().into_owned());
        let mut all = vec!["--leave", &l, "--stamp", &s];
        all.extend_from_slice(args);
        if open {
            all.push("--open");
        }
        let logs = run_ranks(exe, 2, &all, &id, customize);
        let _ = std::fs::remove_file(&stamp);
        let _ = std::fs::remove_file(&ready);
        for (r, log) in logs.iter().enumerate() {
            assert!(log.contains(&format!("rank {r}: ok")), "rank {r}: {log}");
        }
        let survivor = logs[1 - leaver].clone();
        let want = if open {
            "async error after"
        } else {
            "no async error after the peer's normal end"
        };
        assert!(
            survivor.contains(want),
            "case ({leaver}, {open}): {survivor}"
        );
        eprintln!("case (leaver {leaver}, open {open}):\n{survivor}");
        survivors.push(survivor);
    }
    survivors
}

/// Issue 18: a peer that destroyed its communicator and exited while this rank's open call
/// needs it is reported by `xcclCommGetAsyncError` (`xcclRemoteError` naming it, at the first
/// look after its destroy returned) and fails that call at once; at the normal end of a job
/// (nothing open) no async error appears, and only a further call that needs the peer fails,
/// naming it. Both directions (attention and expert rank leaving).
#[test]
fn c11_a_peer_that_left_is_an_async_error_only_while_an_open_call_needs_it_over_shm() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(&repo().join("tests/capi/capi_life.c"), "capi_life_c");
    let root = || {
        let bind = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
        UniqueId::start_root(bind, RootConfig::new(unique_job_id())).expect("bootstrap root")
    };
    let cases = [(1, true), (0, true), (1, false), (0, false)];
    run_leave_cases(&exe, &cases, &[], &root, &|_, _| {});
}

/// The same over libfabric's tcp provider across two network namespaces: the departure
/// travels as a message, reported within 5 s.
#[test]
fn c11_a_peer_that_left_is_an_async_error_only_while_an_open_call_needs_it_over_ofi() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = match Hosts::create(2) {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!(
                "\n!!!! c11 departure over ofi NOT RUN: cannot create network namespaces ({why})\n"
            );
            return;
        }
    };
    let exe = compile(&repo().join("tests/capi/capi_life.c"), "capi_life_c_ofi");
    let cases = [(1, true), (0, false)];
    let root = || root_in_host_0(&ns);
    let customize = |rank: usize, cmd: &mut Command| run_in_host(&ns, rank, cmd);
    run_leave_cases(&exe, &cases, &["--fabric", "ofi"], &root, &customize);
}

/// Issue 18: `xcclCommDestroy` from another thread while a call blocks (an A2E receive, an E2A
/// receive, each for a peer that never sends) interrupts that call and returns only after it
/// returned (`xcclInvalidUsage` naming the destroy), so the caller's buffer can be freed at
/// once; repeated to catch races. `xcclCommAbort` from another thread still ends the blocked
/// call with `xcclAborted`.
#[test]
fn c11_destroy_from_another_thread_returns_after_the_blocked_call_and_abort_still_ends_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let exe = compile(
        &repo().join("tests/capi/capi_life.c"),
        "capi_life_c_destroy",
    );
    let mut cmd = Command::new(&exe);
    cmd.args(["--destroy-blocked", "24"]);
    let logs = Ranks::spawn("capi_life_destroy", vec![cmd]).expect_success(TIMEOUT);
    assert!(logs[0].contains("destroy-blocked: ok"), "{}", logs[0]);
    eprintln!("{}", logs[0]);
}

/// `XCCL_TEST_REAL_CUDA=1` (a GPU host, `ci/device-check.sh`): the real driver, one device.
fn real_cuda() -> bool {
    std::env::var("XCCL_TEST_REAL_CUDA").as_deref() == Ok("1")
}

/// The stand-in CUDA driver (`tests/cuda_standin/`), built once per test process.
fn cuda_standin() -> &'static Path {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
        xccl::testing::build_cuda_standin(&dir).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// Runs `tests/capi/capi_cuda.c` in `mode` as `n` ranks, the driver being `library` (the
/// stand-in showing `devices` devices), and checks that no stand-in segment is left.
fn run_cuda_program(mode: &str, n: usize, devices: usize, library: &Path) {
    run_cuda_program_env(mode, n, devices, library, &[]);
}

/// [`run_cuda_program`] with `env` added to every rank's environment.
fn run_cuda_program_env(
    mode: &str,
    n: usize,
    devices: usize,
    library: &Path,
    env: &[(&str, &str)],
) {
    let exe = compile(&repo().join("tests/capi/capi_cuda.c"), "capi_cuda_c");
    let segs = xccl_tests::StandinSegments::new("xccl-cucapi");
    let devices = devices.to_string();
    run_with_unique_id_env(
        &exe,
        n,
        &["--mode", mode, "--devices", &devices],
        &|_, cmd| {
            if real_cuda() {
                cmd.env_remove("XCCL_CUDA_LIBRARY")
                    .env_remove("CUDA_STANDIN_DEVICES");
            } else {
                cmd.env("XCCL_CUDA_LIBRARY", library)
                    .env("CUDA_STANDIN_SHM_PREFIX", &segs.0)
                    .env("CUDA_STANDIN_DEVICES", &devices);
            }
            cmd.env_remove("CUDA_STANDIN_FAIL")
                .env_remove("CUDA_STANDIN_MEM_LIMIT")
                .envs(env.iter().copied());
        },
    );
    assert_eq!(segs.left(), Vec::<String>::new(), "stand-in segments left");
}

#[test]
fn c11_device_buffer_calls_on_the_cuda_fabric_match_the_host_calls_bit_for_bit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The cuda fabric's data plane compiles its kernels with the real NVRTC (the stand-in then
    // runs their C twins).
    assert!(
        std::env::var_os("XCCL_NVRTC_LIBRARY").is_some(),
        "set XCCL_NVRTC_LIBRARY to libnvrtc.so.13 or .12 (ci/test.sh takes the venv's)"
    );
    let standin = cuda_standin();
    let (bf16, int8) = (("XCCL_TEST_DTYPE", "bf16"), ("XCCL_TEST_QUANT", "int8"));
    // 1A:1E on one device, rows of f32, and of bfloat16 with INT8 on the wire both ways.
    run_cuda_program("cuda", 2, 1, standin);
    run_cuda_program_env("cuda", 2, 1, standin, &[bf16, int8]);
    if real_cuda() {
        return;
    }
    // 2A:2E on two devices (the refusals include another GPU's memory), f32 and bfloat16.
    run_cuda_program("cuda", 4, 2, standin);
    run_cuda_program_env("cuda", 4, 2, standin, &[bf16]);
    // 1A:2E with INT8 on the wire both ways.
    run_cuda_program_env("cuda", 3, 2, standin, &[int8]);
}

#[test]
fn c11_device_buffer_calls_on_a_shm_communicator_are_invalid_arguments_naming_the_fabric() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run_cuda_program("shm", 2, 1, cuda_standin());
}

#[test]
fn c11_cuda_fabric_without_the_driver_is_unavailable_naming_libcuda() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if Path::new("/dev/nvidiactl").exists() {
        // A real driver would be found after the missing XCCL_CUDA_LIBRARY.
        println!("skipped: this host has an NVIDIA driver");
        return;
    }
    run_cuda_program("nodriver", 2, 1, Path::new("/nonexistent/libcuda.so.1"));
}
