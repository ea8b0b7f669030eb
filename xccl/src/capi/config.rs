//! `xcclConfig_t`: the versioned config struct of the C ABI and its translation into a
//! [`Topology`] and a [`MoeConfig`], naming the field of every rejected value.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::time::Duration;

use super::Fail;
use crate::moe::config::MAX_IN_FLIGHT;
use crate::{DType, Error, MoeConfig, Quant, Topology, TopologyBuilder, TransferMode};

/// `XCCL_CONFIG_MAGIC`: `"xccl"` read as a little-endian `u32`.
pub const CONFIG_MAGIC: c_uint = 0x6c63_6378;
/// `XCCL_CONFIG_VERSION`: the newest layout of [`xcclConfig_t`] this library reads (versions 1,
/// without the INT8 fields, and 2, without `recvCapacity`, are read too).
pub const CONFIG_VERSION: c_uint = 3;
/// `XCCL_CONFIG_UNDEF_INT`: an unset integer field.
pub const UNDEF: c_int = c_int::MIN;

/// The C `xcclConfig_t`, version 3 (field for field the header's struct; version 1 ends
/// before `a2eQuant`, version 2 before `recvCapacity`).
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

/// What a config turns into.
pub(crate) struct Parsed {
    pub topo: Topology,
    pub cfg: MoeConfig,
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
    let (m, e) = match (c.numAttentionRanks, c.numExpertRanks) {
        (UNDEF, UNDEF) => return Err(Fail::invalid(
            "config.numAttentionRanks and config.numExpertRanks are both unset; set at least one",
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
    let fabric = if c.fabric.is_null() {
        "shm".to_string()
    } else {
        // SAFETY: non-NULL; the header requires a NUL-terminated string.
        let s = unsafe { CStr::from_ptr(c.fabric) };
        s.to_str()
            .map_err(|_| Fail::invalid("config.fabric is not UTF-8"))?
            .to_string()
    };
    // Checked before any rendezvous, so every rank fails alike and none waits for the others.
    if fabric != "shm" {
        return Err(Fail::from_error(&Error::FabricUnavailable {
            fabric,
            detail: "not available through the C ABI in this build (available: shm)".into(),
        })
        .prefixed("config.fabric"));
    }

    let mut builder = TopologyBuilder::contiguous(m as usize, e as usize, num_experts);
    match (c.placementCounts.is_null(), c.placementRanks.is_null()) {
        (true, true) => {}
        (false, false) => {
            // SAFETY: non-NULL; the header requires `numExperts` ints.
            let counts =
                unsafe { super::slice(c.placementCounts, num_experts, "config.placementCounts")? };
            let mut total = 0usize;
            for (x, &k) in counts.iter().enumerate() {
                if k < 1 || k > e {
                    return Err(Fail::invalid(format!(
                        "config.placementCounts[{x}] = {k} is out of range (1..={e} replicas)"
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
                    if r < m || r >= n {
                        return Err(Fail::invalid(format!(
                            "config.placementRanks lists rank {r} for expert {x}; expert ranks are {m}..{n}"
                        )));
                    }
                    hosts.push(r as usize);
                }
                at += k as usize;
                map.push(hosts);
            }
            builder = builder.placement(map);
        }
        _ => {
            return Err(Fail::invalid(
                "config.placementCounts and config.placementRanks must be both set or both NULL",
            ))
        }
    }
    let topo = builder
        .build()
        .map_err(|err| Fail::from_error(&err).prefixed("config placement"))?;
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
    cfg.validate(&topo)
        .map_err(|err| Fail::from_error(&err).prefixed("config"))?;
    Ok(Parsed { topo, cfg })
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
        assert_eq!(parsed(&config(3, full, UNDEF)).unwrap().recv_capacity, 0);
        assert_eq!(parsed(&config(3, full, 4)).unwrap().recv_capacity, 4);
        let err = parsed(&config(3, full, 17)).unwrap_err();
        assert!(err.contains("recvCapacity"), "{err}");
        let err = parsed(&config(3, CONFIG_V1_SIZE, 4)).unwrap_err();
        assert!(err.contains("config.size"), "{err}");
    }
}
