//! Network namespaces as hosts, for the multi-host tests over libfabric's `tcp` provider and
//! `xccl-bench --netns K`: K namespaces ("hosts"), each with one veth interface whose other end
//! is on a bridge in a further namespace (the "switch"), one /24 for all of them: the hosts
//! reach each other only through their veth pairs. A process placed in host `i`
//! ([`Hosts::place`]) opens its ofi endpoint on that host's address (`XCCL_OFI_ADDR`); the
//! bootstrap root can listen in any host ([`Hosts::start_root`]).
//!
//! Every namespace is named `xccl-<pid>-...` and deleted when [`Hosts`] drops (deleting a
//! namespace deletes its veth ends and the bridge), also when the job fails. Needs root
//! (CAP_NET_ADMIN) and iproute2: [`Hosts::create`] says so in its error.

use std::os::fd::AsRawFd;
use std::process::Command;

use crate::bootstrap::{RootConfig, RootHandle, UniqueId};

/// The namespaces of one job.
pub struct Hosts {
    /// Host namespaces, in host order.
    names: Vec<String>,
    /// The switch namespace (holding the bridge); empty until made.
    switch: String,
    /// Each host's address.
    addrs: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// Makes `k` host namespaces joined through a bridge namespace.
    pub fn create(k: usize) -> Result<Hosts, String> {
        let pid = std::process::id();
        // A subnet from the pid, so that concurrent jobs (and the ofi tests' 10.77.x) do not
        // collide.
        let net = format!("10.78.{}", pid % 250);
        let mut hosts = Hosts {
            names: Vec::new(),
            switch: String::new(),
            addrs: Vec::new(),
        };
        // From here on `hosts` drops (deletes) whatever was made.
        let switch = format!("xccl-{pid}-sw");
        ip(&["netns", "add", &switch])?;
        hosts.switch = switch.clone();
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        let tag = pid % 10_000_000;
        for i in 0..k {
            let name = format!("xccl-{pid}-h{i}");
            ip(&["netns", "add", &name])?;
            hosts.names.push(name.clone());
            let (host_end, switch_end) = (format!("xb{tag}h{i}"), format!("xb{tag}s{i}"));
            ip(&[
                "link",
                "add",
                &host_end,
                "netns",
                &name,
                "type",
                "veth",
                "peer",
                "name",
                &switch_end,
                "netns",
                &switch,
            ])?;
            let addr = format!("{net}.{}", i + 1);
            ip(&[
                "-n",
                &name,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                &host_end,
            ])?;
            ip(&["-n", &name, "link", "set", &host_end, "up"])?;
            ip(&["-n", &name, "link", "set", "lo", "up"])?;
            ip(&["-n", &switch, "link", "set", &switch_end, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &switch_end, "up"])?;
            hosts.addrs.push(addr);
        }
        Ok(hosts)
    }

    /// Hosts made.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether no host was made (never, once [`Hosts::create`] returned).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The host of rank `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        rank % self.len()
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> &str {
        &self.addrs[i]
    }

    /// Host `i`'s namespace name.
    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// An open descriptor of host `i`'s namespace (for `setns`).
    pub fn fd(&self, i: usize) -> Result<std::fs::File, String> {
        let path = format!("/run/netns/{}", self.names[i]);
        std::fs::File::open(&path).map_err(|e| format!("opening {path}: {e}"))
    }

    /// The name of host `i`'s veth interface (the domain libfabric's `tcp` provider opens
    /// there).
    pub fn interface(&self, i: usize) -> String {
        format!("xb{}h{i}", std::process::id() % 10_000_000)
    }

    /// Starts the bootstrap root of job `job_id` inside host 0, listening on its address (on a
    /// thread that enters the namespace: the listening socket stays in it).
    pub fn start_root(&self, job_id: u64) -> crate::Result<(UniqueId, RootHandle)> {
        let fd = self.fd(0).map_err(crate::Error::Bootstrap)?;
        let addr = self.addrs[0].clone();
        std::thread::spawn(move || {
            // SAFETY: setns(2) on this thread only, with an open fd of a network namespace this
            // process made; it changes nothing but this thread's network namespace.
            if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(crate::Error::os(
                    "entering host 0's network namespace",
                    std::io::Error::last_os_error(),
                ));
            }
            let bind: std::net::SocketAddr = format!("{addr}:0")
                .parse()
                .map_err(|e| crate::Error::invalid(format!("{addr}: {e}")))?;
            UniqueId::start_root(bind, RootConfig::new(job_id))
        })
        .join()
        .map_err(|_| crate::Error::Bootstrap("the root thread panicked".into()))?
    }

    /// Makes `cmd` start inside host `i` (nothing else).
    pub fn enter(&self, i: usize, cmd: &mut Command) -> Result<(), String> {
        use std::os::unix::process::CommandExt;
        let fd = self.fd(i)?;
        // SAFETY: the closure runs in the forked child before exec and only calls setns(2),
        // which is async-signal-safe; `fd` is moved in and stays open until then.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Makes `cmd` start inside host `i` with its ofi endpoint on the host's address.
    pub fn place(&self, i: usize, cmd: &mut Command) -> Result<(), String> {
        cmd.env(crate::fabric::ofi::ADDR_ENV, &self.addrs[i]);
        self.enter(i, cmd)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in self.names.iter().chain(std::iter::once(&self.switch)) {
            if !n.is_empty() {
                let _ = ip(&["netns", "del", n]);
            }
        }
    }
}
