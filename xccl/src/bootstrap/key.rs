//! [`JobKey`]: the secret that gives a job its identity.
//!
//! Every rank of a job holds the same 256-bit key: it comes in the [`UniqueId`](super::UniqueId)
//! (random, made by [`UniqueId::new`](super::UniqueId::new)) or, under a launcher, from the
//! environment ([`KEY_ENV`] in hex, or a file named by [`KEY_FILE_ENV`]). Ranks prove they hold
//! it to the root by a challenge-response HMAC-SHA256 over the rank, the world size, the job id
//! and both sides' nonces, and the root proves it back, so a stranger
//! who can reach the root's port and knows the job id can neither join nor pose as the root, and
//! two jobs sharing one port never accept each other's ranks. The key itself never goes on the
//! wire, into an error, a log line or a `Debug` output.
//!
//! The key also names the job's shared-memory segments (an HMAC under it), so other users of
//! the host cannot predict (and squat) them.

use std::fmt;
use std::io::Read;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{Error, Result};

/// Environment variable carrying the job key in hex (64 digits) under a launcher.
pub const KEY_ENV: &str = "XCCL_JOB_KEY";
/// Environment variable naming a file whose content is the job key in hex (surrounding
/// whitespace allowed); `/proc/self/fd/N` names an inherited file descriptor.
pub const KEY_FILE_ENV: &str = "XCCL_JOB_KEY_FILE";
/// Set to `1` to run a launcher job without a key: anyone who can reach the root's port and
/// knows (or guesses) the job id can then join it. A warning is logged.
pub const INSECURE_ENV: &str = "XCCL_INSECURE_NO_KEY";

/// Size of a nonce in the authentication handshake.
pub(crate) const NONCE_LEN: usize = 32;
/// Size of a MAC in the authentication handshake.
pub(crate) const MAC_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// A job's 256-bit secret. `Debug` prints no key material; compare keys with
/// [`JobKey::same_as`] (constant time).
#[derive(Clone)]
pub struct JobKey([u8; 32]);

/// Constant-time ([`JobKey::same_as`]).
impl PartialEq for JobKey {
    fn eq(&self, other: &JobKey) -> bool {
        self.same_as(other)
    }
}

impl Eq for JobKey {}

impl fmt::Debug for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobKey(<secret>)")
    }
}

/// Who computes a handshake MAC: a rank proving itself to the root, or the root answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Rank,
    Root,
}

impl JobKey {
    /// 256 random bits from the operating system (`/dev/urandom`; should it be unreadable, the
    /// standard library's hasher keys, which the OS's `getrandom` seeds, hashed with SHA-256).
    pub fn random() -> JobKey {
        let mut b = [0u8; 32];
        if random_bytes(&mut b).is_ok() {
            return JobKey(b);
        }
        use std::hash::{BuildHasher, Hasher};
        let mut h = Sha256::new();
        for i in 0..8u64 {
            let mut x = std::collections::hash_map::RandomState::new().build_hasher();
            x.write_u64(i);
            h.update(x.finish().to_le_bytes());
        }
        JobKey(h.finalize().into())
    }

    /// A key from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> JobKey {
        JobKey(bytes)
    }

    /// The 32 bytes (for carrying the key in a [`UniqueId`](super::UniqueId)).
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0
    }

    /// Parses 64 hex digits (surrounding whitespace allowed). The error names `what` (where the
    /// text came from) and the problem, never the text.
    pub fn from_hex(what: &str, text: &str) -> Result<JobKey> {
        let t = text.trim();
        if t.len() != 64 {
            return Err(Error::Bootstrap(format!(
                "{what} must be 64 hex digits (a 256-bit key), got {} characters",
                t.len()
            )));
        }
        let mut b = [0u8; 32];
        for (i, pair) in t.as_bytes().chunks_exact(2).enumerate() {
            let v = std::str::from_utf8(pair)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            b[i] = v.ok_or_else(|| {
                Error::Bootstrap(format!("{what} has a non-hex digit at offset {}", 2 * i))
            })?;
        }
        Ok(JobKey(b))
    }

    /// The key as 64 lower-case hex digits, to hand to a launcher's environment.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A key anyone can compute from `public` text: for jobs that opted out of authentication
    /// ([`INSECURE_ENV`]); it only keeps apart jobs whose texts differ.
    pub(crate) fn insecure(public: &str) -> JobKey {
        let mut h = Sha256::new();
        h.update(b"xccl-insecure-no-key\0");
        h.update(public.as_bytes());
        JobKey(h.finalize().into())
    }

    /// Whether two keys are equal, in constant time (`subtle`).
    pub fn same_as(&self, other: &JobKey) -> bool {
        self.0.ct_eq(&other.0).into()
    }

    fn mac(&self) -> HmacSha256 {
        <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    /// A value derived from the key for `purpose` (domain-separated HMAC of `parts`): shared
    /// memory names, the keys of shrunk generations. Outsiders cannot compute it.
    pub(crate) fn derive(&self, purpose: &str, parts: &[&[u8]]) -> [u8; 32] {
        let mut m = self.mac();
        m.update(b"xccl-derive\0");
        m.update(purpose.as_bytes());
        m.update(b"\0");
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// The key of a shrunk generation `generation` of the job `job_id` this key belongs to.
    pub(crate) fn for_generation(&self, job_id: u64, generation: u64) -> JobKey {
        JobKey(self.derive(
            "generation",
            &[&job_id.to_le_bytes(), &generation.to_le_bytes()],
        ))
    }

    /// The handshake MAC `side` sends: binds the side, job id, rank, world size and both nonces.
    pub(crate) fn hello_mac(&self, side: Side, fields: &HelloFields) -> [u8; MAC_LEN] {
        let mut m = self.mac();
        fields.feed(side, &mut m);
        m.finalize().into_bytes().into()
    }

    /// Checks a handshake MAC in constant time.
    pub(crate) fn verify_hello(&self, side: Side, fields: &HelloFields, mac: &[u8]) -> bool {
        let mut m = self.mac();
        fields.feed(side, &mut m);
        m.verify_slice(mac).is_ok()
    }
}

/// What a handshake MAC covers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HelloFields {
    pub job_id: u64,
    pub rank: u64,
    pub size: u64,
    pub rank_nonce: [u8; NONCE_LEN],
    pub root_nonce: [u8; NONCE_LEN],
}

impl HelloFields {
    fn feed(&self, side: Side, m: &mut HmacSha256) {
        m.update(match side {
            Side::Rank => b"xccl-hello-rank-v2\0",
            Side::Root => b"xccl-hello-root-v2\0",
        });
        m.update(&self.job_id.to_le_bytes());
        m.update(&self.rank.to_le_bytes());
        m.update(&self.size.to_le_bytes());
        m.update(&self.rank_nonce);
        m.update(&self.root_nonce);
    }
}

/// Fills `buf` with random bytes from the operating system.
pub(crate) fn random_bytes(buf: &mut [u8]) -> Result<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| Error::os("reading random bytes from /dev/urandom", e))
}

/// The key of a launcher job, from `get` (the environment): [`KEY_ENV`], else the file named by
/// [`KEY_FILE_ENV`], else (only with [`INSECURE_ENV`]`=1`, warning) one derived from `public`.
/// Errors name the variable, never the key.
pub(crate) fn key_from_env(
    get: &dyn Fn(&str) -> Option<String>,
    public: &str,
) -> Result<(JobKey, bool)> {
    if let Some(hex) = get(KEY_ENV) {
        return Ok((JobKey::from_hex(KEY_ENV, &hex)?, true));
    }
    if let Some(path) = get(KEY_FILE_ENV) {
        let path = path.trim();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Bootstrap(format!(
                "{KEY_FILE_ENV}: cannot read the key file {path}: {e}"
            ))
        })?;
        return Ok((
            JobKey::from_hex(&format!("the key file {path} ({KEY_FILE_ENV})"), &text)?,
            true,
        ));
    }
    if get(INSECURE_ENV).is_some_and(|v| v.trim() == "1") {
        return Ok((JobKey::insecure(public), false));
    }
    Err(Error::Bootstrap(format!(
        "no job key: set {KEY_ENV} to the same 64 hex digits on every rank (e.g. from \
         `openssl rand -hex 32`, passed through the launcher's environment), or {KEY_FILE_ENV} \
         to a file holding them; {INSECURE_ENV}=1 runs without one, letting anyone who can \
         reach the root's port join the job"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::env::tests::env;

    fn fields() -> HelloFields {
        HelloFields {
            job_id: 7,
            rank: 1,
            size: 4,
            rank_nonce: [1; 32],
            root_nonce: [2; 32],
        }
    }

    #[test]
    fn a_mac_binds_every_field_the_side_and_the_key() {
        let k = JobKey::random();
        let f = fields();
        let mac = k.hello_mac(Side::Rank, &f);
        assert!(k.verify_hello(Side::Rank, &f, &mac));
        assert!(!k.verify_hello(Side::Root, &f, &mac));
        assert!(!JobKey::random().verify_hello(Side::Rank, &f, &mac));
        let changed = [
            HelloFields { job_id: 8, ..f },
            HelloFields { rank: 2, ..f },
            HelloFields { size: 5, ..f },
            HelloFields {
                rank_nonce: [3; 32],
                ..f
            },
            HelloFields {
                root_nonce: [3; 32],
                ..f
            },
        ];
        for c in changed {
            assert!(!k.verify_hello(Side::Rank, &c, &mac), "{c:?}");
        }
    }

    #[test]
    fn debug_and_errors_never_show_the_key() {
        let hex = "ab".repeat(32);
        let k = JobKey::from_hex("test", &hex).unwrap();
        assert_eq!(k.to_hex(), hex);
        assert!(!format!("{k:?}").contains("ab"));
        let bad = format!("{}zz", &hex[..62]);
        let err = JobKey::from_hex(KEY_ENV, &bad).unwrap_err().to_string();
        assert!(
            err.contains("offset 62") && !err.contains(&hex[..62]),
            "{err}"
        );
    }

    #[test]
    fn a_launcher_job_without_a_key_is_refused_unless_opted_out() {
        let hex = "0f".repeat(32);
        let (k, secure) = key_from_env(&env(&[(KEY_ENV, &hex)]), "x").unwrap();
        assert!(secure && k.same_as(&JobKey::from_hex("t", &hex).unwrap()));
        let err = key_from_env(&env(&[]), "x").unwrap_err().to_string();
        assert!(err.contains("no job key") && err.contains(KEY_ENV), "{err}");
        let (k, secure) = key_from_env(&env(&[(INSECURE_ENV, "1")]), "x").unwrap();
        assert!(!secure && k.same_as(&JobKey::insecure("x")));
        let dir = std::env::temp_dir().join(format!("xccl-key-{}", std::process::id()));
        std::fs::write(&dir, format!("{hex}\n")).unwrap();
        let (k, _) = key_from_env(&env(&[(KEY_FILE_ENV, dir.to_str().unwrap())]), "x").unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(k.to_hex(), hex);
    }
}
