//! `xcclConfig_t`: the versioned config struct of the C ABI and its translation into a
//! [`Topology`] and a [`MoeConfig`], naming the field of every rejected value.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::time::Duration;

use super::Fail;
use crate::moe::config::MAX_IN_FLIGHT;
use crate::{DType, Error, MoeConfig, Quant, Role, Topology, TopologyBuilder, TransferMode};

/// `XCCL_CONFIG_MAGIC`: `"xccl"` read as a little-endian `u32`.
pub const CONFIG_MAGIC: c_uint = 0x6c63_6378;
/// `XCCL_CONFIG_VERSION`: the newest layout of [`xcclConfig_t`] this library reads (versions 1,
/// without the INT8 fields, 2, without `recvCapacity`, and 3, without `role`, `device`,
/// `ofiProvider` and `ofiInterface`, are read too).
pub const CONFIG_VERSION: c_uint = 4;
/// `XCCL_CONFIG_UNDEF_INT`: an unset integer field.
pub const UNDEF: c_int = c_int::MIN;

/// The C `xcclConfig_t`, version 4 (field for field the header's struct; version 1 ends
/// before `a2eQuant`, version 2 before `recvCapacity`, version 3 before `role`).
#[repr(C)]
#[derive(Debug)]
#[allow(non_camel_case_types, non_snake_case)]
pub struct xcclConfig_t {
    /// `sizeof(xcclConfig_t)` of the caller's header.
    pub size: usize,
    /// `XCCL_CONFIG_MAGIC`.
    pub magic: c_uint,
    /// `XCCL_CONFIG_VERSION` of the caller's header.
    pub version: c_uint,
    /// Attention ranks (global ranks `0..numAttentionRanks`).
    pub numAttentionRanks: c_int,
    /// Expert ranks (the ranks after the attention ranks).
    pub numExpertRanks: c_int,
    /// Global experts.
    pub numExperts: c_int,
    /// Routing entries per token.
    pub topk: c_int,
    /// Elements per row.
    pub hidden: c_int,
    /// Most tokens one attention rank passes to one A2E call.
    pub maxTokensPerRank: c_int,
    /// `xcclDataType_t`.
    pub dtype: c_int,
    /// `xcclTransferMode_t`.
    pub transferMode: c_int,
    /// Calls between A2E and E2A.
    pub maxInFlight: c_int,
    /// Deadline of each call and init step, in milliseconds.
    pub timeoutMs: c_int,
    /// Fabric name; NULL is `"shm"`.
    pub fabric: *const c_char,
    /// Replicas per expert (`numExperts` entries), or NULL for the contiguous placement.
    pub placementCounts: *const c_int,
    /// The global ranks hosting each expert, concatenated in expert order.
    pub placementRanks: *const c_int,
    /// Version 2: `xcclQuant_t` of this rank's A2E sends.
    pub a2eQuant: c_int,
    /// Version 2: `xcclQuant_t` of this rank's E2A replies.
    pub e2aQuant: c_int,
    /// Version 2: keep received A2E rows as INT8 plus scales (1) or not (0).
    pub keepInt8: c_int,
    /// Version 3: rows an expert rank receives from one attention rank per call at most
    /// (`MoeConfig::recv_capacity`; 0 or unset: `maxTokensPerRank`).
    pub recvCapacity: c_int,
    /// Version 4: this rank's `xcclRole_t`, gathered from every rank at init; unset: the
    /// lowest `numAttentionRanks` ranks are attention ranks.
    pub role: c_int,
    /// Version 4: the NPU (fabric `"ascend"`; unset: 0) or GPU (fabric `"cuda"`; unset: rank
    /// modulo the device count) of this rank.
    pub device: c_int,
    /// Version 4: libfabric provider (fabric `"ofi"`); NULL: `XCCL_OFI_PROVIDER`, else
    /// `tcp;ofi_rxm`.
    pub ofiProvider: *const c_char,
    /// Version 4: local address selecting the interface (fabric `"ofi"`); NULL:
    /// `XCCL_OFI_ADDR`, else the provider's first.
    pub ofiInterface: *const c_char,
}

impl xcclConfig_t {
    /// A config with every field unset (what `XCCL_CONFIG_INITIALIZER` gives, without the
    /// header fields).
    fn unset() -> Self {
        xcclConfig_t {
            size: 0,
            magic: 0,
            version: 0,
            numAttentionRanks: UNDEF,
            numExpertRanks: UNDEF,
            numExperts: UNDEF,
            topk: UNDEF,
            hidden: UNDEF,
            maxTokensPerRank: UNDEF,
            dtype: UNDEF,
            transferMode: UNDEF,
            maxInFlight: UNDEF,
            timeoutMs: UNDEF,
            fabric: std::ptr::null(),
            placementCounts: std::ptr::null(),
            placementRanks: std::ptr::null(),
            a2eQuant: UNDEF,
            e2aQuant: UNDEF,
            keepInt8: UNDEF,
            recvCapacity: UNDEF,
            role: UNDEF,
            device: UNDEF,
            ofiProvider: std::ptr::null(),
            ofiInterface: std::ptr::null(),
        }
    }

    /// What `XCCL_CONFIG_INITIALIZER` gives: size, magic and version of this layout, every
    /// other field unset.
    pub(crate) fn initializer() -> Self {
        xcclConfig_t {
            size: std::mem::size_of::<xcclConfig_t>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            ..Self::unset()
        }
    }
}

/// Bytes of a version 1 config: everything before `a2eQuant`.
pub const CONFIG_V1_SIZE: usize = std::mem::offset_of!(xcclConfig_t, a2eQuant);
/// Bytes of a version 2 config: everything before `recvCapacity`, padded to the struct's
/// alignment as a C compiler lays it out (on LP64 the same as version 3's: `recvCapacity`
/// took what was tail padding).
pub const CONFIG_V2_SIZE: usize = (std::mem::offset_of!(xcclConfig_t, recvCapacity))
    .next_multiple_of(std::mem::align_of::<xcclConfig_t>());

/// Bytes of a version 3 config: everything before `role`.
pub const CONFIG_V3_SIZE: usize = std::mem::offset_of!(xcclConfig_t, role);

/// The fabric a config asks for.
#[derive(Clone, Debug)]
pub(crate) enum FabricSpec {
    /// Shared memory.
    Shm,
    /// libfabric with these options.
    Ofi(crate::fabric::ofi::OfiOptions),
    /// Ascend on this device.
    Ascend(i32),
    /// CUDA on this device (`None`: rank modulo the device count).
    Cuda(Option<usize>),
}

/// What a config turns into: everything but the topology, which needs the roles (gathered at
/// init when the config sets `role`).
pub(crate) struct Parsed {
    /// This rank's explicit role, when the config sets one.
    pub role: Option<Role>,
    /// Attention and expert ranks as the config says (when set).
    pub counts: (c_int, c_int),
    pub nranks: usize,
    pub num_experts: usize,
    pub placement: Option<Vec<Vec<usize>>>,
    pub cfg: MoeConfig,
    pub fabric: FabricSpec,
    /// The config version the caller compiled against (it selects the layouts of the output
    /// structs of version 1 to 3 callers, which have no `size` field).
    pub version: c_uint,
}

impl Parsed {
    /// The roles when the config sets none: the lowest `numAttentionRanks` ranks attend.
    pub fn default_roles(&self) -> Vec<Role> {
        let mut roles = vec![Role::Attention; self.counts.0 as usize];
        roles.resize(self.nranks, Role::Expert);
        roles
    }

    /// The topology over `roles` (rank order), checked against the config's counts and
    /// placement, and the config checked against it.
    pub fn topology(&self, roles: Vec<Role>) -> Result<Topology, Fail> {
        let m = roles.iter().filter(|r| **r == Role::Attention).count() as c_int;
        let e = roles.len() as c_int - m;
        let (cm, ce) = self.counts;
        if (cm != UNDEF && cm != m) || (ce != UNDEF && ce != e) {
            return Err(Fail::invalid(format!(
                "config.numAttentionRanks ({}) and config.numExpertRanks ({}) do not match the                  roles the ranks stated ({m} attention, {e} expert ranks)",
                show(cm),
                show(ce)
            )));
        }
        let mut builder = TopologyBuilder::new(roles, self.num_experts);
        if let Some(map) = &self.placement {
            builder = builder.placement(map.clone());
        }
        let topo = builder
            .build()
            .map_err(|err| Fail::from_error(&err).prefixed("config placement"))?;
        self.cfg
            .validate(&topo)
            .map_err(|err| Fail::from_error(&err).prefixed("config"))?;
        Ok(topo)
    }
}

fn show(v: c_int) -> String {
    if v == UNDEF {
        "unset".into()
    } else {
        v.to_string()
    }
}

/// The NUL-terminated string field `name` at `p` (NULL: `None`).
///
/// # Safety
/// `p`, when non-NULL, points to a NUL-terminated string.
unsafe fn string_field(name: &str, p: *const c_char) -> Result<Option<String>, Fail> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL; the header requires a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(|s| Some(s.to_string()))
        .map_err(|_| Fail::invalid(format!("config.{name} is not UTF-8")))
}

fn int_field(
    name: &str,
    v: c_int,
    default: Option<c_int>,
    min: c_int,
    max: c_int,
) -> Result<c_int, Fail> {
    let v = match (v, default) {
        (UNDEF, Some(d)) => d,
        (UNDEF, None) => {
            return Err(Fail::invalid(format!(
                "config.{name} is unset (XCCL_CONFIG_UNDEF_INT); it has no default"
            )))
        }
        (v, _) => v,
    };
    if v < min || v > max {
        return Err(Fail::invalid(format!(
            "config.{name} = {v} is out of range ({min}..={max})"
        )));
    }
    Ok(v)
}

/// Reads `config` for a job of `nranks` ranks.
///
/// # Safety
/// `config` points to a readable `xcclConfig_t` of at least `config->size` bytes whose
/// non-NULL pointer fields point to what the header says.
pub(crate) unsafe fn parse(config: *const xcclConfig_t, nranks: usize) -> Result<Parsed, Fail> {
    if config.is_null() {
        return Err(Fail::invalid(
            "config is NULL (start from XCCL_CONFIG_INITIALIZER)",
        ));
    }
    if !(config as usize).is_multiple_of(std::mem::align_of::<xcclConfig_t>()) {
        return Err(Fail::invalid("config is not aligned for xcclConfig_t"));
    }
    // SAFETY: non-NULL and aligned (checked above); the caller guarantees it is readable. The
    // header fields are read first, and the rest only once they say the layout is ours.
    let (size, magic, version) = unsafe { ((*config).size, (*config).magic, (*config).version) };
    if magic != CONFIG_MAGIC {
        return Err(Fail::invalid(format!(
            "config.magic = {magic:#x}, expected XCCL_CONFIG_MAGIC ({CONFIG_MAGIC:#x}): start from XCCL_CONFIG_INITIALIZER"
        )));
    }
    let expected = match version {
        1 => CONFIG_V1_SIZE,
        2 => CONFIG_V2_SIZE,
        3 => CONFIG_V3_SIZE,
        CONFIG_VERSION => std::mem::size_of::<xcclConfig_t>(),
        _ => {
            return Err(Fail::invalid(format!(
                "config.version = {version} is unknown to this library (it reads versions 1 to {CONFIG_VERSION})"
            )))
        }
    };
    if size != expected {
        return Err(Fail::invalid(format!(
            "config.size = {size}, but version {version} configs are {expected} bytes"
        )));
    }
    // The caller's `size` bytes over a config whose later fields are unset: an older layout is
    // never read past its end.
    let mut local = xcclConfig_t::unset();
    // SAFETY: magic, version and size say the caller's struct is a prefix of this layout of
    // `size` bytes (at most `size_of::<xcclConfig_t>()`, checked above), readable by the
    // header's contract; `local` is a distinct, writable struct of the full size.
    unsafe {
        std::ptr::copy_nonoverlapping(
            config.cast::<u8>(),
            std::ptr::addr_of_mut!(local).cast::<u8>(),
            size,
        )
    };
    if version < 3 {
        // A version 2 struct is as large (the new field sits in what was its tail padding),
        // so the version, not the size, says whether the field is there.
        local.recvCapacity = UNDEF;
    }
    if version < 4 {
        local.role = UNDEF;
        local.device = UNDEF;
        local.ofiProvider = std::ptr::null();
        local.ofiInterface = std::ptr::null();
    }
    let c = &local;
    let (a2e_quant, e2a_quant, keep_int8) = if version >= 2 {
        let quant = |name: &str, v: c_int| {
            int_field(name, v, Some(0), 0, 1)
                .map(|q| if q == 1 { Quant::Int8 } else { Quant::None })
        };
        (
            quant("a2eQuant", c.a2eQuant)?,
            quant("e2aQuant", c.e2aQuant)?,
            int_field("keepInt8", c.keepInt8, Some(0), 0, 1)? == 1,
        )
    } else {
        (Quant::None, Quant::None, false)
    };
    let n = nranks as c_int;
    let role = match (version >= 4).then_some(c.role) {
        None | Some(UNDEF) => None,
        Some(0) => Some(Role::Attention),
        Some(1) => Some(Role::Expert),
        Some(v) => {
            return Err(Fail::invalid(format!(
                "config.role = {v} is not an xcclRole_t (0 attention, 1 expert)"
            )))
        }
    };
    let (m, e) = if role.is_some() {
        // Explicit roles: the counts, when set, are checked against the gathered roles.
        for (name, v) in [
            ("numAttentionRanks", c.numAttentionRanks),
            ("numExpertRanks", c.numExpertRanks),
        ] {
            if v != UNDEF {
                int_field(name, v, None, 1, n - 1)?;
            }
        }
        (c.numAttentionRanks, c.numExpertRanks)
    } else {
        let (m, e) = match (c.numAttentionRanks, c.numExpertRanks) {
            (UNDEF, UNDEF) => return Err(Fail::invalid(
                "config.numAttentionRanks and config.numExpertRanks are both unset; set at least \
                 one (or config.role on every rank)",
            )),
            (UNDEF, e) => (
                n.saturating_sub(e),
                int_field("numExpertRanks", e, None, 1, n - 1)?,
            ),
            (m, UNDEF) => (int_field("numAttentionRanks", m, None, 1, n - 1)?, n - m),
            (m, e) => (m, e),
        };
        int_field("numAttentionRanks", m, None, 1, n - 1)?;
        int_field("numExpertRanks", e, None, 1, n - 1)?;
        if m + e != n {
            return Err(Fail::invalid(format!(
                "config.numAttentionRanks ({m}) + config.numExpertRanks ({e}) != nranks ({n})"
            )));
        }
        (m, e)
    };
    let num_experts = int_field("numExperts", c.numExperts, None, 1, 1 << 20)? as usize;
    let topk = int_field("topk", c.topk, None, 1, num_experts.min(1 << 10) as c_int)? as usize;
    let hidden = int_field("hidden", c.hidden, None, 1, 1 << 24)? as usize;
    let max_tokens =
        int_field("maxTokensPerRank", c.maxTokensPerRank, None, 1, c_int::MAX)? as usize;
    let dtype = match int_field("dtype", c.dtype, Some(2), 0, 2)? {
        0 => DType::F32,
        1 => DType::F16,
        _ => DType::BF16,
    };
    let mode = match int_field("transferMode", c.transferMode, Some(0), 0, 1)? {
        0 => TransferMode::Push,
        _ => TransferMode::Pull,
    };
    let in_flight = int_field(
        "maxInFlight",
        c.maxInFlight,
        Some(2),
        1,
        MAX_IN_FLIGHT as c_int,
    )?;
    let timeout = int_field("timeoutMs", c.timeoutMs, Some(30_000), 1, c_int::MAX)?;
    // SAFETY: the header requires NUL-terminated strings (or NULL) in these fields.
    let fabric_name = unsafe { string_field("fabric", c.fabric)? }.unwrap_or("shm".into());
    let fabric = match fabric_name.as_str() {
        "shm" => FabricSpec::Shm,
        "ofi" => {
            // SAFETY: as above (version 4 fields are unset, NULL, for older callers).
            let (provider, addr) = unsafe {
                (
                    string_field("ofiProvider", c.ofiProvider)?,
                    string_field("ofiInterface", c.ofiInterface)?,
                )
            };
            FabricSpec::Ofi(crate::fabric::ofi::OfiOptions {
                provider,
                addr,
                timeout: Duration::from_millis(timeout as u64).max(Duration::from_secs(10)),
                ..Default::default()
            })
        }
        "ascend" => FabricSpec::Ascend(int_field("device", c.device, Some(0), 0, 1 << 16)?),
        "cuda" => FabricSpec::Cuda(match c.device {
            UNDEF => None,
            d => Some(int_field("device", d, None, 0, 1 << 16)? as usize),
        }),
        _ => {
            // Checked before any rendezvous, so every rank fails alike.
            return Err(Fail::from_error(&Error::FabricUnavailable {
                fabric: fabric_name,
                detail: "unknown fabric (available: shm, ofi, ascend, cuda)".into(),
            })
            .prefixed("config.fabric"));
        }
    };

    let mut placement = None;
    match (c.placementCounts.is_null(), c.placementRanks.is_null()) {
        (true, true) => {}
        (false, false) => {
            // SAFETY: non-NULL; the header requires `numExperts` ints.
            let counts =
                unsafe { super::slice(c.placementCounts, num_experts, "config.placementCounts")? };
            let mut total = 0usize;
            let most = if e == UNDEF { n - 1 } else { e };
            for (x, &k) in counts.iter().enumerate() {
                if k < 1 || k > most {
                    return Err(Fail::invalid(format!(
                        "config.placementCounts[{x}] = {k} is out of range (1..={most} replicas)"
                    )));
                }
                total += k as usize;
            }
            // SAFETY: non-NULL; the header requires the sum of the counts ints.
            let ranks = unsafe { super::slice(c.placementRanks, total, "config.placementRanks")? };
            let mut map = Vec::with_capacity(num_experts);
            let mut at = 0;
            for (x, &k) in counts.iter().enumerate() {
                let mut hosts = Vec::with_capacity(k as usize);
                for &r in &ranks[at..at + k as usize] {
                    // With explicit roles the topology checks that `r` is an expert rank.
                    let first = if role.is_some() { 0 } else { m };
                    if r < first || r >= n {
                        return Err(Fail::invalid(format!(
                            "config.placementRanks lists rank {r} for expert {x}; expert ranks are {first}..{n}"
                        )));
                    }
                    hosts.push(r as usize);
                }
                at += k as usize;
                map.push(hosts);
            }
            placement = Some(map);
        }
        _ => {
            return Err(Fail::invalid(
                "config.placementCounts and config.placementRanks must be both set or both NULL",
            ))
        }
    }
    let mut cfg = MoeConfig::new(hidden, dtype, topk, max_tokens);
    cfg.mode = mode;
    cfg.max_in_flight = in_flight as usize;
    cfg.timeout = Duration::from_millis(timeout as u64);
    cfg.a2e_quant = a2e_quant;
    cfg.e2a_quant = e2a_quant;
    cfg.keep_int8 = keep_int8;
    cfg.recv_capacity = int_field(
        "recvCapacity",
        c.recvCapacity,
        Some(0),
        0,
        max_tokens.min(c_int::MAX as usize) as c_int,
    )? as usize;
    let parsed = Parsed {
        role,
        counts: (m, e),
        nranks,
        num_experts,
        placement,
        cfg,
        fabric,
        version,
    };
    if role.is_none() {
        // Without explicit roles everything is known now: fail before any rendezvous.
        parsed.topology(parsed.default_roles())?;
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(version: c_uint, size: usize, recv_capacity: c_int) -> xcclConfig_t {
        xcclConfig_t {
            size,
            magic: CONFIG_MAGIC,
            version,
            numAttentionRanks: 1,
            numExperts: 4,
            topk: 2,
            hidden: 8,
            maxTokensPerRank: 16,
            recvCapacity: recv_capacity,
            ..xcclConfig_t::unset()
        }
    }

    fn parsed(c: &xcclConfig_t) -> Result<MoeConfig, String> {
        // SAFETY: `c` is a whole, aligned config that lives across the call.
        unsafe { parse(c, 3) }.map(|p| p.cfg).map_err(|f| f.msg)
    }

    #[test]
    fn every_config_version_is_read_and_never_past_its_size() {
        let full = std::mem::size_of::<xcclConfig_t>();
        // Versions 1 and 2 end before recvCapacity: whatever lies there is not read.
        assert_eq!(
            parsed(&config(1, CONFIG_V1_SIZE, -5))
                .unwrap()
                .recv_capacity,
            0
        );
        assert_eq!(
            parsed(&config(2, CONFIG_V2_SIZE, -5))
                .unwrap()
                .recv_capacity,
            0
        );
        assert_eq!(parsed(&config(4, full, UNDEF)).unwrap().recv_capacity, 0);
        assert_eq!(parsed(&config(4, full, 4)).unwrap().recv_capacity, 4);
        let err = parsed(&config(4, full, 17)).unwrap_err();
        assert!(err.contains("recvCapacity"), "{err}");
        let err = parsed(&config(3, CONFIG_V1_SIZE, 4)).unwrap_err();
        assert!(err.contains("config.size"), "{err}");
        assert_eq!(CONFIG_V3_SIZE, 96);
        assert_eq!(full, 120);
        let mut v3 = config(3, CONFIG_V3_SIZE, 4);
        v3.role = 7; // past a version 3 struct: never read
        assert_eq!(parsed(&v3).unwrap().recv_capacity, 4);
        let mut v4 = config(4, full, 4);
        v4.role = 7;
        let err = parsed(&v4).unwrap_err();
        assert!(err.contains("config.role"), "{err}");
    }

    #[test]
    fn fabric_cuda_takes_config_device_as_the_gpu_and_unset_as_rank_modulo_devices() {
        let full = std::mem::size_of::<xcclConfig_t>();
        let spec = |device: c_int| {
            let mut c = config(4, full, UNDEF);
            c.fabric = c"cuda".as_ptr();
            c.device = device;
            // SAFETY: `c` is a whole, aligned config that lives across the call.
            unsafe { parse(&c, 3) }.map(|p| p.fabric).map_err(|f| f.msg)
        };
        assert!(matches!(spec(UNDEF), Ok(FabricSpec::Cuda(None))));
        assert!(matches!(spec(3), Ok(FabricSpec::Cuda(Some(3)))));
        let err = spec(-1).unwrap_err();
        assert!(err.contains("config.device = -1"), "{err}");
        // Version 3 callers have no `device`: whatever lies there is not read.
        let mut v3 = config(3, CONFIG_V3_SIZE, UNDEF);
        v3.fabric = c"cuda".as_ptr();
        v3.device = 5;
        // SAFETY: as above.
        let p = unsafe { parse(&v3, 3) }.map_err(|f| f.msg).unwrap();
        assert!(matches!(p.fabric, FabricSpec::Cuda(None)));
    }
}
