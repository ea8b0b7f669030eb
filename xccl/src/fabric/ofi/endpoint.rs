//! The libfabric objects of one rank: fabric, domain, completion queue, address vector,
//! reliable-datagram endpoint and the registration of the rank's memory. Every raw libfabric
//! call of the `ofi` fabric is in this file.

use std::ffi::{c_int, c_void, CStr, CString};
use std::ptr::{null, null_mut, NonNull};

use xccl_sys::ofi::{self as sys, inline as fi, Api};

use crate::{Error, Result};

/// The CQ entry format the endpoint uses (`FI_CQ_FORMAT_DATA`).
pub(super) type CqEntry = sys::fi_cq_data_entry;

/// What libfabric told us about the provider we got.
#[derive(Clone, Debug)]
pub(super) struct ProviderInfo {
    /// `prov_name`, e.g. `tcp;ofi_rxm`.
    pub name: String,
    /// `fabric_attr.name` (e.g. the subnet) and `domain_attr.name` (e.g. the interface).
    pub fabric: String,
    pub domain: String,
    /// The domain's memory-registration mode bits (`FI_MR_*`).
    pub mr_mode: u32,
    /// Bytes of remote CQ data a write can carry.
    pub cq_data_size: usize,
    /// Largest single message/RMA.
    pub max_msg_size: usize,
    /// Whether the CQ has a wait object (`fi_cq_sread` blocks until a completion).
    pub cq_can_block: bool,
    /// The CQ's wait object as a file descriptor (`FI_WAIT_FD`), which the progress thread can
    /// poll without holding the CQ (so waiters may read it meanwhile).
    pub wait_fd: Option<c_int>,
    /// `FI_PROGRESS_MANUAL` data progress (the provider only moves data inside calls).
    pub manual_progress: bool,
    /// RMA writes are placed in order (`FI_ORDER_RMA_WAW` asked for and granted on transmit and
    /// receive), up to this size (`max_order_waw_size`); `None` when they are not.
    pub ordered_writes: Option<usize>,
}

/// One rank's libfabric resources; closed in reverse order on drop.
pub(super) struct Endpoint {
    api: &'static Api,
    info: *mut sys::fi_info,
    fabric: *mut sys::fid_fabric,
    domain: *mut sys::fid_domain,
    cq: *mut sys::fid_cq,
    av: *mut sys::fid_av,
    ep: *mut sys::fid_ep,
    mr: *mut sys::fid_mr,
    pub provider: ProviderInfo,
    /// The key peers use to address the registered region.
    pub key: u64,
    /// The address peers use for byte 0 of the region (its virtual address under
    /// `FI_MR_VIRT_ADDR`, else 0: offsets).
    pub remote_base: u64,
    /// This endpoint's address in the provider's format.
    pub name: Vec<u8>,
}

// SAFETY: the domain is opened with FI_THREAD_SAFE, so every libfabric object here may be used
// from any thread concurrently; the raw pointers are owned by this value and freed only in Drop.
unsafe impl Send for Endpoint {}
// SAFETY: see `Send`.
unsafe impl Sync for Endpoint {}

fn unavailable(detail: String) -> Error {
    Error::FabricUnavailable {
        fabric: "ofi".into(),
        detail,
    }
}

impl Endpoint {
    /// Opens `provider` (a `prov_name` such as `tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`) on the
    /// interface that owns `node` (an address of this host; `None`: the provider's first), and
    /// registers `region_len` bytes at `region` for remote read and write.
    pub fn open(
        provider: &str,
        node: Option<&str>,
        region: NonNull<u8>,
        region_len: usize,
    ) -> Result<Self> {
        let api = Api::get().map_err(|e| unavailable(e.detail))?;
        let mut ep = Endpoint {
            api,
            info: null_mut(),
            fabric: null_mut(),
            domain: null_mut(),
            cq: null_mut(),
            av: null_mut(),
            ep: null_mut(),
            mr: null_mut(),
            provider: ProviderInfo {
                name: provider.to_string(),
                fabric: String::new(),
                domain: String::new(),
                mr_mode: 0,
                cq_data_size: 0,
                max_msg_size: 0,
                cq_can_block: false,
                wait_fd: None,
                manual_progress: true,
                ordered_writes: None,
            },
            key: 0,
            remote_base: 0,
            name: Vec::new(),
        };
        // Ask for write-after-write ordering first (it lets a signal follow puts without waiting
        // for their completion), then take the provider as it is.
        if ep.getinfo(provider, node, true).is_err() {
            ep.getinfo(provider, node, false)?;
        }
        ep.open_objects()?;
        ep.register(region, region_len)?;
        Ok(ep)
    }

    fn check(&self, rc: i64, what: impl FnOnce() -> String) -> Result<()> {
        if rc >= 0 {
            Ok(())
        } else {
            Err(unavailable(format!(
                "{} ({}: {})",
                what(),
                rc,
                self.api.error_string(rc)
            )))
        }
    }

    fn getinfo(&mut self, provider: &str, node: Option<&str>, ordered: bool) -> Result<()> {
        if !self.info.is_null() {
            // SAFETY: a list from an earlier fi_getinfo of this value, not used elsewhere.
            unsafe { (self.api.freeinfo)(self.info) };
            self.info = null_mut();
        }
        let prov = CString::new(provider)
            .map_err(|_| Error::invalid(format!("provider name {provider:?} contains NUL")))?;
        let node_c = node
            .map(|n| CString::new(n).map_err(|_| Error::invalid(format!("address {n:?}"))))
            .transpose()?;
        // SAFETY: fi_allocinfo returns a fresh zeroed fi_info with its attribute structs
        // allocated, or NULL; freed below with fi_freeinfo.
        let hints = unsafe { fi::fi_allocinfo(self.api.dupinfo) };
        if hints.is_null() {
            return Err(unavailable("fi_allocinfo failed".into()));
        }
        // SAFETY: `hints` and its attribute structs were allocated by fi_allocinfo; strdup
        // returns malloc'd memory that fi_freeinfo frees with the hints.
        let rc = unsafe {
            let h = &mut *hints;
            h.caps = u64::from(sys::FI_RMA)
                | u64::from(sys::FI_READ)
                | u64::from(sys::FI_WRITE)
                | u64::from(sys::FI_REMOTE_READ)
                | u64::from(sys::FI_REMOTE_WRITE);
            h.mode = 0;
            (*h.ep_attr).type_ = sys::FI_EP_RDM;
            if ordered {
                (*h.tx_attr).msg_order = sys::FI_ORDER_RMA_WAW;
                (*h.rx_attr).msg_order = sys::FI_ORDER_RMA_WAW;
            }
            let d = &mut *h.domain_attr;
            d.threading = sys::FI_THREAD_SAFE;
            // The registration modes this code honours (see `register`).
            d.mr_mode = (sys::FI_MR_VIRT_ADDR
                | sys::FI_MR_ALLOCATED
                | sys::FI_MR_PROV_KEY
                | sys::FI_MR_ENDPOINT) as c_int;
            (*h.fabric_attr).prov_name = libc::strdup(prov.as_ptr());
            let mut info = null_mut();
            let (node_p, flags) = match &node_c {
                Some(n) => (n.as_ptr(), sys::FI_SOURCE),
                None => (null(), 0),
            };
            let rc =
                (self.api.getinfo)(sys::FI_API_VERSION, node_p, null(), flags, hints, &mut info);
            (self.api.freeinfo)(hints);
            self.info = info;
            rc
        };
        if rc != 0 || self.info.is_null() {
            return Err(unavailable(format!(
                "libfabric has no provider {provider:?} with reliable-datagram RMA{} \
                 ({}): `fi_info -p '{provider}'` lists what it offers",
                node.map(|n| format!(" on {n}")).unwrap_or_default(),
                self.api.error_string(i64::from(rc))
            )));
        }
        // SAFETY: fi_getinfo returned a valid list; we read the first entry's attributes.
        unsafe {
            let i = &*self.info;
            let cstr = |p: *const libc::c_char| {
                if p.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            let caps = i.caps;
            if caps & u64::from(sys::FI_RMA) == 0 {
                return Err(unavailable(format!(
                    "provider {provider:?} offers no RMA (FI_RMA)"
                )));
            }
            let d = &*i.domain_attr;
            let waw = |order: u64| order & sys::FI_ORDER_RMA_WAW != 0;
            let ordered_writes = (waw((*i.tx_attr).msg_order)
                && waw((*i.rx_attr).msg_order)
                && (*i.ep_attr).max_order_waw_size > 0)
                .then_some((*i.ep_attr).max_order_waw_size);
            self.provider = ProviderInfo {
                name: cstr((*i.fabric_attr).prov_name),
                fabric: cstr((*i.fabric_attr).name),
                domain: cstr(d.name),
                mr_mode: d.mr_mode as u32,
                cq_data_size: d.cq_data_size,
                max_msg_size: (*i.ep_attr).max_msg_size,
                cq_can_block: false,
                wait_fd: None,
                manual_progress: d.data_progress == sys::FI_PROGRESS_MANUAL,
                ordered_writes,
            };
        }
        if self.provider.mr_mode & sys::FI_MR_LOCAL != 0
            || self.provider.mr_mode & sys::FI_MR_RAW != 0
        {
            return Err(unavailable(format!(
                "provider {} requires memory-registration mode {:#x} (FI_MR_LOCAL/FI_MR_RAW), \
                 which the ofi fabric does not implement yet",
                self.provider.name, self.provider.mr_mode
            )));
        }
        if self.provider.cq_data_size < 4 {
            return Err(unavailable(format!(
                "provider {} carries {} bytes of remote CQ data; signals need 4",
                self.provider.name, self.provider.cq_data_size
            )));
        }
        Ok(())
    }

    fn open_objects(&mut self) -> Result<()> {
        // SAFETY: `self.info` is the valid fi_info from getinfo; every out-pointer is a field of
        // `self`, which Drop closes if set.
        let rc =
            unsafe { (self.api.fabric)((*self.info).fabric_attr, &mut self.fabric, null_mut()) };
        self.check(rc.into(), || "fi_fabric".into())?;
        // SAFETY: as above; `fabric` is open.
        let rc = unsafe { fi::fi_domain(self.fabric, self.info, &mut self.domain, null_mut()) };
        self.check(rc.into(), || "fi_domain".into())?;

        // A CQ that can block (`fi_cq_sread`) if the provider has a wait object, else one that
        // is only polled.
        for wait_obj in [sys::FI_WAIT_FD, sys::FI_WAIT_UNSPEC, sys::FI_WAIT_NONE] {
            // SAFETY: a zeroed fi_cq_attr is the documented default; `domain` is open.
            let rc = unsafe {
                let mut attr: sys::fi_cq_attr = std::mem::zeroed();
                attr.format = sys::FI_CQ_FORMAT_DATA;
                attr.wait_obj = wait_obj;
                attr.size = 0;
                fi::fi_cq_open(self.domain, &mut attr, &mut self.cq, null_mut())
            };
            if rc == 0 {
                self.provider.cq_can_block = wait_obj != sys::FI_WAIT_NONE;
                if wait_obj == sys::FI_WAIT_FD {
                    let mut fd: c_int = -1;
                    // SAFETY: `cq` is open with an fd wait object; FI_GETWAIT writes an int.
                    let rc = unsafe {
                        fi::fi_control(
                            &raw mut (*self.cq).fid,
                            sys::FI_GETWAIT as c_int,
                            (&raw mut fd).cast(),
                        )
                    };
                    self.provider.wait_fd = (rc == 0 && fd >= 0).then_some(fd);
                }
                break;
            }
            if wait_obj == sys::FI_WAIT_NONE {
                self.check(rc.into(), || "fi_cq_open".into())?;
            }
        }
        // SAFETY: zeroed fi_av_attr with FI_AV_UNSPEC is the documented default.
        let rc = unsafe {
            let mut attr: sys::fi_av_attr = std::mem::zeroed();
            attr.type_ = sys::FI_AV_UNSPEC;
            fi::fi_av_open(self.domain, &mut attr, &mut self.av, null_mut())
        };
        self.check(rc.into(), || "fi_av_open".into())?;
        // SAFETY: domain, info, cq and av are open; bind then enable as fi_endpoint(3) says.
        unsafe {
            let rc = fi::fi_endpoint(self.domain, self.info, &mut self.ep, null_mut());
            self.check(rc.into(), || "fi_endpoint".into())?;
            let rc = fi::fi_ep_bind(
                self.ep,
                &raw mut (*self.cq).fid,
                u64::from(sys::FI_TRANSMIT | sys::FI_RECV),
            );
            self.check(rc.into(), || "binding the CQ to the endpoint".into())?;
            let rc = fi::fi_ep_bind(self.ep, &raw mut (*self.av).fid, 0);
            self.check(rc.into(), || "binding the AV to the endpoint".into())?;
            let rc = fi::fi_enable(self.ep);
            self.check(rc.into(), || "fi_enable".into())?;
            let mut buf = vec![0u8; 256];
            let mut len = buf.len();
            let rc = fi::fi_getname(self.ep, buf.as_mut_ptr().cast(), &mut len);
            self.check(rc.into(), || "fi_getname".into())?;
            buf.truncate(len);
            self.name = buf;
        }
        Ok(())
    }

    fn register(&mut self, region: NonNull<u8>, len: usize) -> Result<()> {
        let access =
            u64::from(sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE);
        // SAFETY: `region..region+len` is memory the fabric owns and keeps allocated until after
        // this endpoint is dropped (field order in `Shared`); `domain` is open.
        let rc = unsafe {
            fi::fi_mr_reg(
                self.domain,
                region.as_ptr().cast::<c_void>().cast_const(),
                len,
                access,
                0,
                0,
                0,
                &mut self.mr,
                null_mut(),
            )
        };
        self.check(rc.into(), || format!("registering {len} bytes"))?;
        if self.provider.mr_mode & sys::FI_MR_ENDPOINT != 0 {
            // SAFETY: mr and ep are open.
            unsafe {
                let rc = fi::fi_mr_bind(self.mr, &raw mut (*self.ep).fid, 0);
                self.check(rc.into(), || {
                    "binding the memory region to the endpoint".into()
                })?;
                let rc = fi::fi_mr_enable(self.mr);
                self.check(rc.into(), || "enabling the memory region".into())?;
            }
        }
        // SAFETY: mr is open.
        self.key = unsafe { fi::fi_mr_key(self.mr) };
        if self.key == sys::FI_KEY_NOTAVAIL {
            return Err(unavailable(
                "the provider gave no key for the window".into(),
            ));
        }
        self.remote_base = if self.provider.mr_mode & sys::FI_MR_VIRT_ADDR != 0 {
            region.as_ptr() as u64
        } else {
            0
        };
        Ok(())
    }

    /// Inserts peer addresses (in the provider's format), returns their handles.
    pub fn insert_peer(&self, name: &[u8]) -> Result<sys::fi_addr_t> {
        let mut addr: sys::fi_addr_t = sys::FI_ADDR_NOTAVAIL;
        // SAFETY: `av` is open; `name` holds one address in the AV's format (what a peer's
        // fi_getname returned); `addr` is writable for one handle.
        let rc =
            unsafe { fi::fi_av_insert(self.av, name.as_ptr().cast(), 1, &mut addr, 0, null_mut()) };
        if rc != 1 {
            return Err(unavailable(format!(
                "fi_av_insert returned {rc} ({})",
                self.api.error_string(rc.into())
            )));
        }
        Ok(addr)
    }

    /// Posts an RMA write of `len` bytes at `buf` with `flags` (`FI_DELIVERY_COMPLETE`,
    /// `FI_REMOTE_CQ_DATA` with `data`); returns the libfabric code (`-FI_EAGAIN`: retry after
    /// progress).
    ///
    /// # Safety
    /// `buf..buf+len` must stay readable until the operation's completion is read from the CQ.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_write(
        &self,
        peer: sys::fi_addr_t,
        buf: *const u8,
        len: usize,
        remote: u64,
        key: u64,
        data: Option<u64>,
        context: u64,
    ) -> isize {
        let mut iov = libc::iovec {
            iov_base: buf.cast_mut().cast(),
            iov_len: len,
        };
        let mut rma = sys::fi_rma_iov {
            addr: remote,
            len,
            key,
        };
        let mut desc: *mut c_void = null_mut();
        let msg = sys::fi_msg_rma {
            msg_iov: (&raw mut iov).cast(),
            desc: &mut desc,
            iov_count: 1,
            addr: peer,
            rma_iov: &mut rma,
            rma_iov_count: 1,
            context: context as *mut c_void,
            data: data.unwrap_or(0),
        };
        let mut flags = u64::from(sys::FI_DELIVERY_COMPLETE) | u64::from(sys::FI_COMPLETION);
        if data.is_some() {
            flags |= u64::from(sys::FI_REMOTE_CQ_DATA);
        }
        // SAFETY: `ep` is enabled; `msg` and the iovecs it points to live for the call; the
        // caller keeps the data buffer alive until completion. The context is an integer the
        // provider hands back untouched (no FI_CONTEXT mode was accepted).
        unsafe { fi::fi_writemsg(self.ep, &msg, flags) }
    }

    /// Posts an RMA read of `len` bytes into `buf`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay writable, and not otherwise accessed, until the completion.
    pub unsafe fn post_read(
        &self,
        peer: sys::fi_addr_t,
        buf: *mut u8,
        len: usize,
        remote: u64,
        key: u64,
        context: u64,
    ) -> isize {
        // SAFETY: `ep` enabled; buffer contract from the caller.
        unsafe {
            fi::fi_read(
                self.ep,
                buf.cast(),
                len,
                null_mut(),
                peer,
                remote,
                key,
                context as *mut c_void,
            )
        }
    }

    /// Reads up to `out.len()` completions; with `block_ms > 0` (and a CQ that can block) waits
    /// that long for the first. Returns the count, or a negative libfabric code
    /// (`-FI_EAGAIN`: none; `-FI_EAVAIL`: an error completion, read it with [`Self::read_error`]).
    pub fn read_cq(&self, out: &mut [CqEntry], block_ms: i32) -> isize {
        if block_ms > 0 && self.provider.cq_can_block {
            // SAFETY: `cq` open, `out` writable for `out.len()` entries of the CQ's format.
            unsafe {
                fi::fi_cq_sread(
                    self.cq,
                    out.as_mut_ptr().cast(),
                    out.len(),
                    null(),
                    block_ms,
                )
            }
        } else {
            // SAFETY: as above.
            unsafe { fi::fi_cq_read(self.cq, out.as_mut_ptr().cast(), out.len()) }
        }
    }

    /// Blocks up to `timeout_ms` on the CQ's wait fd, without reading the CQ, if `fi_trywait`
    /// says nothing is pending. Returns at once otherwise (or without a wait fd).
    pub fn wait_for_activity(&self, timeout_ms: i32) {
        let Some(fd) = self.provider.wait_fd else {
            return;
        };
        let mut fids = [self.cq.cast::<sys::fid>()];
        // SAFETY: `fabric` and `cq` are open; `fids` holds one live object with a wait fd.
        let rc = unsafe { fi::fi_trywait(self.fabric, fids.as_mut_ptr(), 1) };
        if rc != 0 {
            return;
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the fd belongs to the open CQ. Errors and EINTR only end
        // the wait early, and the caller reads the CQ next anyway.
        unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    }

    /// The next error completion: its context and a description.
    pub fn read_error(&self) -> Option<(u64, String)> {
        // SAFETY: a zeroed entry (err_data_size 0) is valid input for fi_cq_readerr.
        let mut e: sys::fi_cq_err_entry = unsafe { std::mem::zeroed() };
        // SAFETY: `cq` open, `e` valid.
        let rc = unsafe { fi::fi_cq_readerr(self.cq, &mut e, 0) };
        if rc < 1 {
            return None;
        }
        let mut buf = [0 as libc::c_char; 256];
        // SAFETY: `cq` open; err_data comes from this entry; `buf` writable for its length.
        let prov = unsafe {
            let p = fi::fi_cq_strerror(
                self.cq,
                e.prov_errno,
                e.err_data,
                buf.as_mut_ptr(),
                buf.len(),
            );
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        let detail = format!(
            "{} (error {}, provider error {} {prov})",
            self.api.error_string(e.err.into()),
            e.err,
            e.prov_errno
        );
        Some((e.op_context as u64, detail))
    }

    /// `fi_strerror`.
    pub fn error_string(&self, rc: i64) -> String {
        self.api.error_string(rc)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: each object was opened by this value and is closed once, dependents first
        // (endpoint and region before the AV/CQ they use, the domain before its fabric).
        unsafe {
            for f in [
                self.ep.cast::<sys::fid>(),
                self.mr.cast(),
                self.av.cast(),
                self.cq.cast(),
                self.domain.cast(),
                self.fabric.cast(),
            ] {
                if !f.is_null() {
                    fi::fi_close(f);
                }
            }
            if !self.info.is_null() {
                (self.api.freeinfo)(self.info);
            }
        }
    }
}
