//! [`UniqueId`]: the opaque token that names one job's rendezvous point (NCCL's `ncclUniqueId`).
//!
//! One process calls [`UniqueId::new`], which starts a root service in that process, and hands
//! the id to every rank (as [bytes](UniqueId::to_bytes) or as [hex](UniqueId#impl-Display-for-UniqueId)
//! through an environment variable); every rank then calls
//! [`TcpBootstrap::connect`](super::TcpBootstrap::connect) with it.
//!
//! **The id is a secret**: it carries the job's key ([`JobKey`]), and whoever holds the id can
//! join the job. Hand it to the ranks through an environment variable ([`UNIQUE_ID_ENV`]), a
//! file or a pipe, an MPI broadcast; never on a command line, which every user of the host can
//! read in `/proc/<pid>/cmdline`.
//!
//! Layout of the 128 bytes (integers little endian, the rest zero):
//!
//! | bytes  | field                                   |
//! |--------|-----------------------------------------|
//! | 0..4   | magic `b"XCID"`                         |
//! | 4..6   | format version (2)                      |
//! | 6      | address family: 4 or 6                  |
//! | 8..16  | job id (64 random bits; not secret)     |
//! | 16..18 | root port                               |
//! | 20..24 | IPv6 scope id                           |
//! | 24..40 | root IP (IPv4 in the first 4 bytes)     |
//! | 40..72 | job key (256 random bits; secret)       |
//!
//! Version 1 (before authentication) had no key; such ids are refused with an error saying so.

use std::fmt;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::str::FromStr;
use subtle::ConstantTimeEq;

use super::key::JobKey;
use super::root::{RootConfig, RootHandle};
use crate::{Error, Result};

const MAGIC: [u8; 4] = *b"XCID";
const VERSION: u16 = 2;

/// Environment variable a rank may read its [`UniqueId`] (hex) from: the way to hand the id to
/// a process without putting it on a command line (see [`UniqueId::from_env`]).
pub const UNIQUE_ID_ENV: &str = "XCCL_UNIQUE_ID";

/// Environment variable naming the address the root service binds to (an IP, or IP:port).
pub const SOCKET_ADDR_ENV: &str = "XCCL_SOCKET_ADDR";

/// An opaque 128-byte job identifier: magic, format version, random job id, the root
/// service's socket address and the job's secret key. Plain bytes, so it can cross a C ABI or an
/// MPI broadcast unchanged. Treat it as a secret: whoever holds it can join the job; its `Debug`
/// output shows the job id and root only. Ids compare in constant time (`subtle`), and their
/// `Hash` covers the public fields only, never the key.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// The encoded id; build it with the constructors, check foreign bytes with
    /// [`UniqueId::from_bytes`].
    pub internal: [u8; 128],
}

impl UniqueId {
    /// Size of an id in bytes.
    pub const SIZE: usize = 128;

    /// Starts a root service in this process and returns the id naming it.
    ///
    /// The root binds an ephemeral port on the address in `XCCL_SOCKET_ADDR` (default
    /// `127.0.0.1`; set it to an address the other hosts can reach for a multi-host job) and
    /// runs detached until every rank has joined and left, or nobody has been connected for
    /// 5 minutes.
    pub fn new() -> Result<UniqueId> {
        let bind = bind_addr_from(&|k| std::env::var(k).ok())?;
        Self::with_root(bind)
    }

    /// Like [`UniqueId::new`], with the root bound to `addr` (port 0 picks an ephemeral port).
    pub fn with_root(addr: SocketAddr) -> Result<UniqueId> {
        let (id, _detached) = Self::start_root(addr, RootConfig::new(random_job_id()))?;
        Ok(id)
    }

    /// Starts a root service bound to `bind` with `config` and returns the id (carrying
    /// `config.job_id`, `config.key` and the bound address) and the handle of the service.
    pub fn start_root(bind: SocketAddr, config: RootConfig) -> Result<(UniqueId, RootHandle)> {
        let job_id = config.job_id;
        let key = config.key.clone();
        let root = RootHandle::bind(bind, config)?;
        Ok((UniqueId::from_parts(job_id, &key, root.addr()), root))
    }

    /// An id for job `job_id` with key `key` whose root is (or will be) at `root`; starts
    /// nothing.
    pub fn from_parts(job_id: u64, key: &JobKey, root: SocketAddr) -> UniqueId {
        let mut b = [0u8; 128];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[8..16].copy_from_slice(&job_id.to_le_bytes());
        b[KEY_BYTES].copy_from_slice(&key.to_bytes());
        b[16..18].copy_from_slice(&root.port().to_le_bytes());
        match root {
            SocketAddr::V4(a) => {
                b[6] = 4;
                b[24..28].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[6] = 6;
                b[20..24].copy_from_slice(&a.scope_id().to_le_bytes());
                b[24..40].copy_from_slice(&a.ip().octets());
            }
        }
        UniqueId { internal: b }
    }

    /// The job id.
    pub fn job_id(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.internal[8..16]);
        u64::from_le_bytes(b)
    }

    /// The job's secret key.
    pub fn key(&self) -> JobKey {
        let mut k = [0u8; 32];
        k.copy_from_slice(&self.internal[KEY_BYTES]);
        JobKey::from_bytes(k)
    }

    /// Reads the id (hex) from [`UNIQUE_ID_ENV`]; `Ok(None)` when it is unset.
    pub fn from_env() -> Result<Option<UniqueId>> {
        match std::env::var(UNIQUE_ID_ENV) {
            Ok(v) => v
                .parse()
                .map(Some)
                .map_err(|e| Error::Bootstrap(format!("{UNIQUE_ID_ENV}: {e}"))),
            Err(_) => Ok(None),
        }
    }

    /// The root service's address. An id that did not come from a constructor or
    /// [`UniqueId::from_bytes`] may hold garbage; it then reads as an IPv6 address.
    pub fn root_addr(&self) -> SocketAddr {
        let b = &self.internal;
        let port = u16::from_le_bytes([b[16], b[17]]);
        if b[6] == 4 {
            let ip = Ipv4Addr::new(b[24], b[25], b[26], b[27]);
            SocketAddr::V4(SocketAddrV4::new(ip, port))
        } else {
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&b[24..40]);
            let scope = u32::from_le_bytes([b[20], b[21], b[22], b[23]]);
            SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, scope))
        }
    }

    /// The 128 bytes.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.internal
    }

    /// Parses and validates 128 bytes (magic, version, address family, port).
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let internal: [u8; 128] = bytes.try_into().map_err(|_| {
            Error::Bootstrap(format!(
                "unique id must be {} bytes, got {}",
                Self::SIZE,
                bytes.len()
            ))
        })?;
        if internal[0..4] != MAGIC {
            return Err(Error::Bootstrap(format!(
                "not an xccl unique id: bad magic {:02x?}",
                &internal[0..4]
            )));
        }
        let version = u16::from_le_bytes([internal[4], internal[5]]);
        if version == 1 {
            return Err(Error::Bootstrap(format!(
                "unique id format version 1 comes from an older xccl whose jobs had no key; \
                 this build reads version {VERSION} (authenticated): make the id with this build"
            )));
        }
        if version != VERSION {
            return Err(Error::Bootstrap(format!(
                "unique id format version {version} is not supported (this build reads {VERSION})"
            )));
        }
        if internal[6] != 4 && internal[6] != 6 {
            return Err(Error::Bootstrap(format!(
                "unique id has unknown address family {}",
                internal[6]
            )));
        }
        let id = UniqueId { internal };
        if id.root_addr().port() == 0 {
            return Err(Error::Bootstrap("unique id has root port 0".into()));
        }
        Ok(id)
    }
}

/// Where the key lies in an id's bytes.
const KEY_BYTES: std::ops::Range<usize> = 40..72;

/// Constant time over all 128 bytes (the key among them).
impl PartialEq for UniqueId {
    fn eq(&self, other: &UniqueId) -> bool {
        self.internal.ct_eq(&other.internal).into()
    }
}

impl Eq for UniqueId {}

/// Hashes the public fields (magic, version, job id, root address) and not the key: a hash
/// table's timing then tells nothing about it. Equal ids hash alike, as `Eq` requires.
impl std::hash::Hash for UniqueId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write(&self.internal[..KEY_BYTES.start]);
        state.write(&self.internal[KEY_BYTES.end..]);
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("job_id", &format_args!("{:016x}", self.job_id()))
            .field("root", &self.root_addr())
            .finish()
    }
}

/// Lower-case hex of all 128 bytes (256 characters), suitable for an environment variable.
impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.internal {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Parses the hex form written by `Display` (surrounding whitespace allowed) and validates it
/// like [`UniqueId::from_bytes`].
impl FromStr for UniqueId {
    type Err = Error;

    fn from_str(s: &str) -> Result<UniqueId> {
        let s = s.trim();
        if s.len() != 2 * Self::SIZE {
            return Err(Error::Bootstrap(format!(
                "unique id hex must be {} characters, got {}",
                2 * Self::SIZE,
                s.len()
            )));
        }
        let mut bytes = [0u8; 128];
        for (i, pair) in s.as_bytes().chunks_exact(2).enumerate() {
            let hex = std::str::from_utf8(pair).ok();
            bytes[i] = hex
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    Error::Bootstrap(format!("unique id hex has a bad digit at offset {}", 2 * i))
                })?;
        }
        UniqueId::from_bytes(&bytes)
    }
}

/// 64 random bits for a job id, from `/dev/urandom` (falling back to the standard library's
/// randomly seeded hasher mixed with time, pid and a counter).
pub fn random_job_id() -> u64 {
    let mut b = [0u8; 8];
    let from_os = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if from_os.is_ok() {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}

/// The address a root started by [`UniqueId::new`] binds to, from `XCCL_SOCKET_ADDR` as read
/// by `get`: an IP (`10.0.0.1`, `::1`, `[::1]`) or IP:port; unset or empty means `127.0.0.1`.
pub fn bind_addr_from(get: &dyn Fn(&str) -> Option<String>) -> Result<SocketAddr> {
    let Some(raw) = get(SOCKET_ADDR_ENV) else {
        return Ok(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0));
    };
    let v = raw.trim();
    if v.is_empty() {
        return Ok(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0));
    }
    let unbracketed = v
        .strip_prefix('[')
        .and_then(|x| x.strip_suffix(']'))
        .unwrap_or(v);
    if let Ok(ip) = unbracketed.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 0));
    }
    v.parse::<SocketAddr>().map_err(|_| {
        Error::Bootstrap(format!(
            "{SOCKET_ADDR_ENV}={raw:?} is not an IP address or IP:port"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::env::tests::env;

    #[test]
    fn an_ids_hash_does_not_cover_its_key_and_equality_does() {
        use std::hash::BuildHasher;
        let addr: SocketAddr = "10.1.2.3:29500".parse().unwrap();
        let a = UniqueId::from_parts(7, &JobKey::from_bytes([1; 32]), addr);
        let b = UniqueId::from_parts(7, &JobKey::from_bytes([2; 32]), addr);
        let state = std::collections::hash_map::RandomState::new();
        let hash = |id: &UniqueId| state.hash_one(id);
        assert_eq!(hash(&a), hash(&b), "the hash must not depend on the key");
        assert_ne!(a, b, "ids with different keys are different ids");
        assert_eq!(a, UniqueId::from_bytes(&a.to_bytes()).unwrap());
        let other_job = UniqueId::from_parts(8, &JobKey::from_bytes([1; 32]), addr);
        assert_ne!(hash(&a), hash(&other_job));
    }

    #[test]
    fn id_round_trips_through_bytes_and_hex() {
        let addr: SocketAddr = "10.1.2.3:29500".parse().unwrap();
        let id = UniqueId::from_parts(0x0123_4567_89ab_cdef, &JobKey::random(), addr);
        assert_eq!(id.job_id(), 0x0123_4567_89ab_cdef);
        assert_eq!(id.root_addr(), addr);
        let back = UniqueId::from_bytes(&id.to_bytes()).unwrap();
        assert_eq!(back, id);
        let hex = id.to_string();
        assert_eq!(hex.len(), 256);
        assert_eq!(hex.parse::<UniqueId>().unwrap(), id);
        assert_eq!(format!("  {hex}\n").parse::<UniqueId>().unwrap(), id);
    }

    #[test]
    fn the_key_round_trips_through_hex_and_an_old_version_1_id_gets_a_clear_error() {
        let key = JobKey::random();
        let id = UniqueId::from_parts(9, &key, "127.0.0.1:1234".parse().unwrap());
        let back: UniqueId = id.to_string().parse().unwrap();
        assert!(back.key().same_as(&key));
        assert!(!format!("{id:?}").contains(&key.to_hex()[..16]));
        let mut old = id.to_bytes();
        old[4..6].copy_from_slice(&1u16.to_le_bytes());
        old[40..72].fill(0);
        let err = UniqueId::from_bytes(&old).unwrap_err().to_string();
        assert!(err.contains("version 1") && err.contains("no key"), "{err}");
    }

    #[test]
    fn ipv6_root_with_scope_round_trips() {
        let addr = SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 4242, 0, 3));
        let id = UniqueId::from_parts(7, &JobKey::random(), addr);
        let back: UniqueId = id.to_string().parse().unwrap();
        assert_eq!(back.root_addr(), addr);
        assert_eq!(back.job_id(), 7);
    }

    #[test]
    fn bad_magic_version_family_port_and_length_are_rejected() {
        let good = UniqueId::from_parts(1, &JobKey::random(), "127.0.0.1:1234".parse().unwrap())
            .to_bytes();
        let mut b = good;
        b[0] = b'Y';
        assert!(
            matches!(UniqueId::from_bytes(&b), Err(Error::Bootstrap(m)) if m.contains("magic"))
        );
        let mut b = good;
        b[4] = 9;
        assert!(
            matches!(UniqueId::from_bytes(&b), Err(Error::Bootstrap(m)) if m.contains("version"))
        );
        let mut b = good;
        b[6] = 5;
        assert!(
            matches!(UniqueId::from_bytes(&b), Err(Error::Bootstrap(m)) if m.contains("family"))
        );
        let zero_port =
            UniqueId::from_parts(1, &JobKey::random(), "127.0.0.1:0".parse().unwrap()).to_bytes();
        assert!(UniqueId::from_bytes(&zero_port).is_err());
        assert!(UniqueId::from_bytes(&good[..127]).is_err());
        assert!(UniqueId::from_bytes(&[0u8; 128]).is_err());
    }

    #[test]
    fn malformed_hex_is_rejected() {
        let hex = UniqueId::from_parts(1, &JobKey::random(), "127.0.0.1:1234".parse().unwrap())
            .to_string();
        assert!(hex[..254].parse::<UniqueId>().is_err());
        let mut bad = hex.clone();
        bad.replace_range(10..11, "g");
        let err = bad.parse::<UniqueId>().unwrap_err();
        assert!(err.to_string().contains("offset 10"), "{err}");
        assert!("é".repeat(128).parse::<UniqueId>().is_err());
    }

    #[test]
    fn random_job_ids_differ() {
        assert_ne!(random_job_id(), random_job_id());
    }

    #[test]
    fn socket_addr_env_is_parsed() {
        let local = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0);
        assert_eq!(bind_addr_from(&env(&[])).unwrap(), local);
        assert_eq!(
            bind_addr_from(&env(&[("XCCL_SOCKET_ADDR", " ")])).unwrap(),
            local
        );
        assert_eq!(
            bind_addr_from(&env(&[("XCCL_SOCKET_ADDR", "10.0.0.2")])).unwrap(),
            "10.0.0.2:0".parse().unwrap()
        );
        assert_eq!(
            bind_addr_from(&env(&[("XCCL_SOCKET_ADDR", "[::1]")])).unwrap(),
            "[::1]:0".parse().unwrap()
        );
        assert_eq!(
            bind_addr_from(&env(&[("XCCL_SOCKET_ADDR", "10.0.0.2:7000")])).unwrap(),
            "10.0.0.2:7000".parse().unwrap()
        );
        let err = bind_addr_from(&env(&[("XCCL_SOCKET_ADDR", "eth0")])).unwrap_err();
        assert!(err.to_string().contains("XCCL_SOCKET_ADDR"), "{err}");
    }

    #[test]
    fn new_id_names_a_listening_root() {
        let id = UniqueId::with_root("127.0.0.1:0".parse().unwrap()).unwrap();
        assert_ne!(id.root_addr().port(), 0);
        assert!(std::net::TcpStream::connect(id.root_addr()).is_ok());
    }
}
