//! The data plane's checks: the host backend against the arithmetic the protocol specifies, the
//! stand-in driver's C twins of the kernels against the host backend bit for bit, the ABI's
//! layouts, and the kernels compiling with NVRTC for sm_80 and sm_90.

use std::ffi::c_void;
use std::path::PathBuf;

use half::{bf16, f16};

use super::host::HostPlane;
use super::{CopyRun, DataPlane, QuantRow, SumRow, SumTerm};
use crate::moe::dtype::DType;
use crate::moe::quant::{int8_payload, scale_offset};

/// xorshift64*: deterministic random numbers for the plans.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// A finite f32 of any magnitude or sign (subnormals and signed zeros included), or a
    /// small one, in the dtype's range.
    fn value(&mut self, dtype: DType) -> f32 {
        let v = match self.below(8) {
            0 => 0.0,
            1 => -0.0,
            2 => f32::from_bits(self.next() as u32 & 0x807f_ffff), // subnormal
            3 | 4 => (self.below(2001) as f32 - 1000.0) / 64.0,
            _ => {
                let b = self.next() as u32;
                let exp = (b >> 23) & 0xff;
                f32::from_bits(if exp == 0xff { b & !(1 << 30) } else { b })
            }
        };
        // Sums of a few weighted terms stay finite in f32: no NaN from `inf - inf`, whose
        // payload a GPU canonicalises where the host keeps it.
        match dtype {
            DType::F32 | DType::BF16 => v.clamp(-1.0e37, 1.0e37),
            DType::F16 => v.clamp(-65_000.0, 65_000.0),
        }
    }
}

/// `n` elements of `dtype` as bytes, from `rng`.
fn random_row(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let v = rng.value(dtype);
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

/// Element `i` of a dtype row widened (the spec's reading).
fn elem(dtype: DType, row: &[u8], i: usize) -> f32 {
    let s = dtype.size();
    let b = &row[i * s..(i + 1) * s];
    match dtype {
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap()),
        DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
    }
}

/// `v` rounded to the dtype, as bytes (the spec's rounding).
fn round_to(dtype: DType, v: f32) -> Vec<u8> {
    match dtype {
        DType::F32 => v.to_le_bytes().to_vec(),
        DType::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f32(v).to_le_bytes().to_vec(),
    }
}

/// A random sum plan over host buffers: its rows, terms and the buffers they address (which
/// must outlive the plan's use), plus the destination buffer.
struct SumPlan {
    dtype: DType,
    hidden: usize,
    sources: Vec<Vec<u8>>,
    /// Per source, whether it is an INT8 payload.
    int8: Vec<bool>,
    rows: Vec<SumRow>,
    terms: Vec<SumTerm>,
    /// Per row, its term indices (into `sources`) and weights.
    spec: Vec<(bool, Vec<(usize, f32)>)>,
    out: Vec<u8>,
}

impl SumPlan {
    fn random(rng: &mut Rng, dtype: DType, hidden: usize, nrows: usize) -> SumPlan {
        let mut p = SumPlan {
            dtype,
            hidden,
            sources: Vec::new(),
            int8: Vec::new(),
            rows: Vec::new(),
            terms: Vec::new(),
            spec: Vec::new(),
            out: vec![0xA5; nrows * hidden * dtype.size()],
        };
        let mut plane = HostPlane::new();
        for _ in 0..nrows {
            let init_first = rng.below(2) == 1;
            let n = rng.below(5) as usize;
            let mut spec = Vec::new();
            for _ in 0..n {
                let row = random_row(rng, dtype, hidden);
                // INT8 terms only where the protocol has them: the attention side's combine.
                let int8 = init_first && rng.below(3) == 0;
                let src = if int8 {
                    let mut q = vec![0u8; int8_payload(hidden)];
                    let r = [QuantRow {
                        src: row.as_ptr() as u64,
                        dst: q.as_mut_ptr() as u64,
                    }];
                    // SAFETY: both buffers are alive and sized for one row.
                    unsafe { plane.quantize(dtype, hidden, &r) }.unwrap();
                    q
                } else {
                    row
                };
                let weight = if init_first {
                    1.0
                } else {
                    (rng.below(4001) as f32 - 2000.0) / 1000.0
                };
                spec.push((p.sources.len(), weight));
                p.sources.push(src);
                p.int8.push(int8);
            }
            p.spec.push((init_first, spec));
        }
        // Descriptors last: the sources no longer move.
        let stride = hidden * dtype.size();
        for (r, (init_first, spec)) in p.spec.iter().enumerate() {
            p.rows.push(SumRow {
                dst: p.out.as_ptr() as u64 + (r * stride) as u64,
                first_term: p.terms.len() as u32,
                num_terms: spec.len() as u32,
                init_first: *init_first as u32,
                reserved: 0,
            });
            for &(s, weight) in spec {
                p.terms.push(SumTerm {
                    src: p.sources[s].as_ptr() as u64,
                    weight,
                    int8: p.int8[s] as u32,
                });
            }
        }
        p
    }

    /// The rows the spec gives (`SumRow`'s docs), written naively.
    fn expected(&self) -> Vec<u8> {
        let (dtype, hidden) = (self.dtype, self.hidden);
        let value = |s: usize, i: usize| -> f32 {
            let src = &self.sources[s];
            if self.int8[s] {
                let at = scale_offset(hidden);
                let scale = f32::from_le_bytes(src[at..at + 4].try_into().unwrap());
                (src[i] as i8) as f32 * scale
            } else {
                elem(dtype, src, i)
            }
        };
        let mut out = Vec::new();
        for (init_first, spec) in &self.spec {
            for i in 0..hidden {
                let bytes = match spec.as_slice() {
                    [] => vec![0; dtype.size()],
                    [(s, _)] if *init_first && !self.int8[*s] => {
                        let z = dtype.size();
                        self.sources[*s][i * z..(i + 1) * z].to_vec()
                    }
                    _ => {
                        let mut acc = if *init_first {
                            value(spec[0].0, i)
                        } else {
                            0.0
                        };
                        for &(s, w) in &spec[*init_first as usize..] {
                            acc += if self.int8[s] {
                                value(s, i)
                            } else {
                                w * value(s, i)
                            };
                        }
                        round_to(dtype, acc)
                    }
                };
                out.extend_from_slice(&bytes);
            }
        }
        out
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn the_host_plane_sums_rows_as_the_spec_says_bit_for_bit() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut plane = HostPlane::new();
    for dtype in DTYPES {
        for hidden in [1, 3, 8, 67, 256] {
            let mut p = SumPlan::random(&mut rng, dtype, hidden, 24);
            // SAFETY: every descriptor addresses a buffer of `p`, alive and sized for it.
            unsafe { plane.sum_rows(dtype, hidden, &p.rows, &p.terms) }.unwrap();
            let want = p.expected();
            assert_eq!(p.out, want, "{dtype:?} hidden {hidden}");
            p.out.fill(0);
        }
    }
}

#[test]
fn the_host_plane_copies_runs_and_round_trips_int8_as_the_quantizer_does() {
    let mut plane = HostPlane::new();
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + i / 13) as u8).collect();
    let mut dst = vec![0u8; 4096];
    let runs = [
        CopyRun {
            src: src.as_ptr() as u64 + 5,
            dst: dst.as_mut_ptr() as u64 + 100,
            len: 3000,
        },
        CopyRun {
            src: src.as_ptr() as u64,
            dst: dst.as_mut_ptr() as u64 + 3200,
            len: 17,
        },
    ];
    // SAFETY: the runs lie in `src` and `dst` and do not overlap.
    unsafe { plane.copy_runs(&runs) }.unwrap();
    assert_eq!(&dst[100..3100], &src[5..3005]);
    assert_eq!(&dst[3200..3217], &src[..17]);
    assert!(dst[..100].iter().chain(&dst[3100..3200]).all(|&b| b == 0));

    // A non-finite element is named by its row and index.
    let hidden = 6;
    let good = random_row(&mut Rng(7), DType::F32, hidden);
    let mut bad = good.clone();
    bad[12..16].copy_from_slice(&f32::INFINITY.to_le_bytes());
    let mut q = vec![0u8; 2 * int8_payload(hidden)];
    let rows = [
        QuantRow {
            src: good.as_ptr() as u64,
            dst: q.as_mut_ptr() as u64,
        },
        QuantRow {
            src: bad.as_ptr() as u64,
            dst: q.as_mut_ptr() as u64 + int8_payload(hidden) as u64,
        },
    ];
    // SAFETY: the rows address live buffers of the right sizes.
    let err = unsafe { plane.quantize(DType::F32, hidden, &rows) }.unwrap_err();
    assert!(err.to_string().contains("row 1"), "{err}");
    assert!(err.to_string().contains("at 3"), "{err}");
}

/// The stand-in's kernels (`tests/cuda_standin/kernels.c`) built alone with gcc, called as the
/// stand-in driver's `cuLaunchKernel` calls them.
struct Twins {
    _lib: libloading::Library,
    table: *const TwinEntry,
}

#[repr(C)]
struct TwinEntry {
    name: *const std::ffi::c_char,
    run: Option<unsafe extern "C" fn(*mut *mut c_void, *mut u32, *mut u32)>,
}

impl Twins {
    fn build() -> Twins {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = std::env::temp_dir().join(format!(
            "xccl-twins-{}-{:?}.so",
            std::process::id(),
            std::thread::current().id()
        ));
        let status = std::process::Command::new("gcc")
            .args([
                "-shared",
                "-fPIC",
                "-O2",
                "-ffp-contract=off",
                "-Wall",
                "-Werror",
            ])
            .arg("-I")
            .arg(repo.join("xccl/src/moe/dataplane"))
            .arg("-o")
            .arg(&out)
            .arg(repo.join("tests/cuda_standin/kernels.c"))
            .status()
            .expect("running gcc");
        assert!(status.success(), "building the kernels' C twins failed");
        // SAFETY: a library of plain C functions with no initialisers.
        let lib = unsafe { libloading::Library::new(&out) }.expect("loading the twins");
        let _ = std::fs::remove_file(&out);
        // SAFETY: `xccl_standin_kernels` is the table's array of `TwinEntry` (standin_kernels.h).
        let table = unsafe { lib.get::<*const TwinEntry>(b"xccl_standin_kernels\0") }
            .map(|s| *s)
            .expect("the kernel table");
        Twins { _lib: lib, table }
    }

    /// Runs the twin of kernel `name` with `args` (pointers to each argument's value).
    fn launch(&self, name: &str, args: &mut [*mut c_void]) {
        let mut e = self.table;
        loop {
            // SAFETY: the table ends with a NULL name, and every entry before it is valid.
            let entry = unsafe { &*e };
            assert!(!entry.name.is_null(), "no twin named {name}");
            // SAFETY: a NUL-terminated name from the table.
            let n = unsafe { std::ffi::CStr::from_ptr(entry.name) };
            if n.to_bytes() == name.as_bytes() {
                let (mut grid, mut block) = ([1u32; 3], [256u32, 1, 1]);
                // SAFETY: `args` holds what the kernel's signature reads.
                unsafe {
                    (entry.run.unwrap())(args.as_mut_ptr(), grid.as_mut_ptr(), block.as_mut_ptr())
                };
                return;
            }
            // SAFETY: not the terminator, so the next entry exists.
            e = unsafe { e.add(1) };
        }
    }
}

/// A pointer to `v` as a kernel argument.
fn arg<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

#[test]
fn the_kernels_c_twins_give_the_host_planes_bits() {
    let twins = Twins::build();
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    let mut plane = HostPlane::new();
    for dtype in DTYPES {
        for hidden in [1, 5, 64, 130] {
            // Sums.
            let mut p = SumPlan::random(&mut rng, dtype, hidden, 32);
            // SAFETY: the plan's descriptors address its own live buffers.
            unsafe { plane.sum_rows(dtype, hidden, &p.rows, &p.terms) }.unwrap();
            let fresh = vec![0x5A; p.out.len()];
            let host = std::mem::replace(&mut p.out, fresh);
            // The twin writes into a new buffer: the destinations point at it.
            let base = p.out.as_ptr() as u64;
            let stride = (hidden * dtype.size()) as u64;
            for (r, row) in p.rows.iter_mut().enumerate() {
                row.dst = base + r as u64 * stride;
            }
            let (mut rows, mut terms) = (p.rows.as_ptr(), p.terms.as_ptr());
            let (mut n, mut dt, mut h) = (p.rows.len() as u32, dtype as u32, hidden as u32);
            twins.launch(
                "xccl_sum_rows",
                &mut [
                    arg(&mut rows),
                    arg(&mut terms),
                    arg(&mut n),
                    arg(&mut dt),
                    arg(&mut h),
                ],
            );
            assert_eq!(p.out, host, "sum {dtype:?} hidden {hidden}");

            // Quantize and dequantize, one row non-finite where the dtype has infinities.
            let nrows = 9;
            let mut src: Vec<u8> = (0..nrows)
                .flat_map(|_| random_row(&mut rng, dtype, hidden))
                .collect();
            let stride = hidden * dtype.size();
            src[..stride].fill(0); // an all-zero row: scale 0
            let bad_row = 5;
            let inf = round_to(dtype, f32::INFINITY);
            let at = bad_row * stride + (hidden / 2) * dtype.size();
            src[at..at + inf.len()].copy_from_slice(&inf);
            let qlen = int8_payload(hidden);
            let mut q_host = vec![0u8; nrows * qlen];
            let mut q_twin = vec![0u8; nrows * qlen];
            let qrows = |q: &mut Vec<u8>| -> Vec<QuantRow> {
                (0..nrows)
                    .map(|r| QuantRow {
                        src: src.as_ptr() as u64 + (r * stride) as u64,
                        dst: q.as_mut_ptr() as u64 + (r * qlen) as u64,
                    })
                    .collect()
            };
            let (hr, tr) = (qrows(&mut q_host), qrows(&mut q_twin));
            // SAFETY: every row addresses live buffers of the right sizes.
            let err = unsafe { plane.quantize(dtype, hidden, &hr) }.unwrap_err();
            assert!(
                err.to_string().contains(&format!("row {bad_row} ")),
                "{err}"
            );
            let mut bad = u64::MAX;
            let (mut rp, mut n, mut dt, mut h, mut badp) = (
                tr.as_ptr(),
                nrows as u32,
                dtype as u32,
                hidden as u32,
                &mut bad as *mut u64,
            );
            twins.launch(
                "xccl_quantize",
                &mut [
                    arg(&mut rp),
                    arg(&mut n),
                    arg(&mut dt),
                    arg(&mut h),
                    arg(&mut badp),
                ],
            );
            assert_eq!(bad, ((bad_row as u64) << 32) | (hidden / 2) as u64);
            // The host stopped at the bad row: the rows before it must agree.
            assert_eq!(
                q_twin[..bad_row * qlen],
                q_host[..bad_row * qlen],
                "quantize {dtype:?} hidden {hidden}"
            );
            // SAFETY: as above, the rows after the bad one.
            unsafe { plane.quantize(dtype, hidden, &hr[bad_row + 1..]) }.unwrap();
            assert_eq!(
                q_twin[(bad_row + 1) * qlen..],
                q_host[(bad_row + 1) * qlen..]
            );

            let mut d_host = vec![0u8; nrows * stride];
            let mut d_twin = vec![0u8; nrows * stride];
            let drows = |d: &mut Vec<u8>| -> Vec<QuantRow> {
                (0..nrows)
                    .filter(|&r| r != bad_row)
                    .map(|r| QuantRow {
                        src: q_host.as_ptr() as u64 + (r * qlen) as u64,
                        dst: d.as_mut_ptr() as u64 + (r * stride) as u64,
                    })
                    .collect()
            };
            let (hr, tr) = (drows(&mut d_host), drows(&mut d_twin));
            // SAFETY: every row addresses live buffers of the right sizes.
            unsafe { plane.dequantize(dtype, hidden, &hr) }.unwrap();
            let (mut rp, mut n, mut dt, mut h) =
                (tr.as_ptr(), tr.len() as u32, dtype as u32, hidden as u32);
            twins.launch(
                "xccl_dequantize",
                &mut [arg(&mut rp), arg(&mut n), arg(&mut dt), arg(&mut h)],
            );
            assert_eq!(d_twin, d_host, "dequantize {dtype:?} hidden {hidden}");
        }
    }
}

#[test]
fn the_abi_structs_have_the_headers_layout() {
    use std::mem::{offset_of, size_of};
    assert_eq!(size_of::<CopyRun>(), 24);
    assert_eq!(size_of::<SumRow>(), 24);
    assert_eq!(size_of::<SumTerm>(), 16);
    assert_eq!(size_of::<QuantRow>(), 16);
    assert_eq!(offset_of!(SumRow, first_term), 8);
    assert_eq!(offset_of!(SumRow, init_first), 16);
    assert_eq!(offset_of!(SumTerm, weight), 8);
    assert_eq!(offset_of!(SumTerm, int8), 12);
    assert_eq!(DType::F32 as u32, 0);
    assert_eq!(DType::F16 as u32, 1);
    assert_eq!(DType::BF16 as u32, 2);
}

/// Every kernel compiles with the real NVRTC for sm_80 and sm_90 into a CUBIN that names each
/// entry point. `ci/test.sh` points `XCCL_NVRTC_LIBRARY` at the venv's `nvidia-cuda-nvrtc`, so
/// this runs on every CI run; without NVRTC it fails saying how to get it.
#[test]
fn the_kernels_compile_with_nvrtc_for_sm_80_and_sm_90() {
    let version = super::nvrtc::version().unwrap_or_else(|e| {
        panic!("{e}\n(run ci/python-env.sh and set XCCL_NVRTC_LIBRARY, as ci/test.sh does)")
    });
    for (major, minor) in [(8, 0), (9, 0)] {
        let image = super::nvrtc::cubin(major, minor)
            .unwrap_or_else(|e| panic!("NVRTC {version:?}, sm_{major}{minor}: {e}"));
        assert_eq!(&image[..4], b"\x7fELF", "a CUBIN is an ELF image");
        for name in super::KERNEL_NAMES {
            assert!(
                image.windows(name.len()).any(|w| w == name.as_bytes()),
                "sm_{major}{minor}: the CUBIN lacks {name}"
            );
        }
        // Cached: the same image again.
        assert!(std::sync::Arc::ptr_eq(
            &image,
            &super::nvrtc::cubin(major, minor).unwrap()
        ));
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_carrying_nvrtcs_log() {
    let bad = "extern \"C\" __global__ void k() { undefined_fn(); }";
    let err = super::nvrtc::compile_source(bad, 9, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nvrtcCompileProgram"), "{err}");
    assert!(err.contains("undefined_fn"), "the log: {err}");
}

/// The CUDA driver the device tests run on: the stand-in (built here with gcc), or the real
/// `libcuda.so.1` when `XCCL_TEST_REAL_CUDA=1` (the GPU machine's `ci/device-check.sh`).
fn test_device() -> crate::cuda::Device {
    if std::env::var("XCCL_TEST_REAL_CUDA").as_deref() == Ok("1") {
        let driver = crate::cuda::Driver::get().expect("the real CUDA driver");
        driver.device(0).expect("device 0")
    } else {
        // The stand-in the CUDA layer's own tests build and load, once per process.
        crate::cuda::tests::standin_device()
    }
}

/// The test device, a stream for the tests' own copies, and a CUDA plane on its own stream.
fn test_plane() -> (
    crate::cuda::Device,
    crate::cuda::Stream,
    super::cuda::CudaPlane,
) {
    use crate::cuda::Stream;
    let device = test_device();
    let io = Stream::new(&device).unwrap();
    let stream = Stream::new(&device).unwrap();
    let timeout = std::time::Duration::from_secs(30);
    let plane = super::cuda::CudaPlane::new(&device, stream, 0, timeout).unwrap();
    (device, io, plane)
}

/// A device copy of `bytes` (at least one byte).
fn upload(
    stream: &crate::cuda::Stream,
    device: &crate::cuda::Device,
    bytes: &[u8],
) -> crate::cuda::DeviceMemory {
    use crate::cuda::DeviceMemory;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mem = DeviceMemory::alloc(device, bytes.len().max(1), || "a test buffer".into()).unwrap();
    stream
        .write(&mem, 0, bytes, deadline, 0, &|| "a test upload".into())
        .unwrap();
    mem
}

/// The bytes of `mem`.
fn download(stream: &crate::cuda::Stream, mem: &crate::cuda::DeviceMemory, len: usize) -> Vec<u8> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut out = vec![0u8; len];
    stream
        .read(mem, 0, &mut out, deadline, 0, &|| "a test download".into())
        .unwrap();
    out
}

/// Every operation of the CUDA plane, on the stand-in driver here and on the real GPU in
/// `ci/device-check.sh`, gives the host plane's bits: sums (both inits, INT8 terms), copies,
/// quantize (a non-finite row named after completion) and dequantize.
#[test]
fn the_cuda_plane_gives_the_host_planes_bits() {
    use crate::cuda::DeviceRegion;
    use std::time::{Duration, Instant};

    let (device, io, mut plane) = test_plane();
    let mut host = HostPlane::new();
    let deadline = || Instant::now() + Duration::from_secs(30);
    let mut rng = Rng(0x5eed_0fca_fe00);
    for dtype in DTYPES {
        for hidden in [1, 7, 256, 7168] {
            let nrows = if hidden > 1000 { 6 } else { 40 };
            // Sums: every source uploaded, the descriptors rebuilt with device addresses.
            let mut p = SumPlan::random(&mut rng, dtype, hidden, nrows);
            // SAFETY: the plan's descriptors address its own live buffers.
            unsafe { host.sum_rows(dtype, hidden, &p.rows, &p.terms) }.unwrap();
            let sources: Vec<_> = p.sources.iter().map(|s| upload(&io, &device, s)).collect();
            let out = upload(&io, &device, &vec![0x5A; p.out.len()]);
            let stride = (hidden * dtype.size()) as u64;
            let rows: Vec<SumRow> = (p.rows.iter().enumerate())
                .map(|(r, row)| SumRow {
                    dst: out.ptr().addr() + r as u64 * stride,
                    ..*row
                })
                .collect();
            let mut terms = Vec::new();
            for (_, spec) in &p.spec {
                for &(s, weight) in spec {
                    terms.push(SumTerm {
                        src: sources[s].ptr().addr(),
                        weight,
                        int8: p.int8[s] as u32,
                    });
                }
            }
            // SAFETY: every address lies in a live device buffer of the right size.
            unsafe { plane.sum_rows(dtype, hidden, &rows, &terms) }.unwrap();
            plane.complete(deadline()).unwrap();
            assert_eq!(
                download(&io, &out, p.out.len()),
                p.out,
                "sum {dtype:?} hidden {hidden}"
            );
            p.out.clear();

            // Copies: the sum's output moved in two runs, one unaligned.
            let len = p.sources.first().map_or(0, |s| s.len());
            let moved = upload(&io, &device, &vec![0; len + 3]);
            if len > 0 {
                let runs = [CopyRun {
                    src: sources[0].ptr().addr(),
                    dst: moved.ptr().addr() + 3,
                    len: len as u64,
                }];
                // SAFETY: both ranges lie in live device buffers and do not overlap.
                unsafe { plane.copy_runs(&runs) }.unwrap();
                plane.complete(deadline()).unwrap();
                assert_eq!(download(&io, &moved, len + 3)[3..], p.sources[0][..]);
            }

            // Quantize with one non-finite row, then dequantize.
            let qrows = 5;
            let mut src: Vec<u8> = (0..qrows)
                .flat_map(|_| random_row(&mut rng, dtype, hidden))
                .collect();
            let row_len = hidden * dtype.size();
            let inf = round_to(dtype, f32::NEG_INFINITY);
            let bad_at = 3 * row_len + (hidden - 1) * dtype.size();
            src[bad_at..bad_at + inf.len()].copy_from_slice(&inf);
            let qlen = int8_payload(hidden);
            let mut q_host = vec![0u8; qrows * qlen];
            let hq: Vec<QuantRow> = (0..qrows)
                .filter(|&r| r != 3)
                .map(|r| QuantRow {
                    src: src.as_ptr() as u64 + (r * row_len) as u64,
                    dst: q_host.as_mut_ptr() as u64 + (r * qlen) as u64,
                })
                .collect();
            // SAFETY: live host buffers of the right sizes.
            unsafe { host.quantize(dtype, hidden, &hq) }.unwrap();
            let (dsrc, dq) = (
                upload(&io, &device, &src),
                upload(&io, &device, &vec![0; qrows * qlen]),
            );
            let rows_of = |from: &crate::cuda::DeviceMemory,
                           to: &crate::cuda::DeviceMemory,
                           from_len: usize,
                           to_len: usize,
                           skip: Option<usize>| {
                (0..qrows)
                    .filter(|&r| Some(r) != skip)
                    .map(|r| QuantRow {
                        src: from.ptr().addr() + (r * from_len) as u64,
                        dst: to.ptr().addr() + (r * to_len) as u64,
                    })
                    .collect::<Vec<_>>()
            };
            let all = rows_of(&dsrc, &dq, row_len, qlen, None);
            // SAFETY: live device buffers of the right sizes.
            unsafe { plane.quantize(dtype, hidden, &all) }.unwrap();
            let err = plane.complete(deadline()).unwrap_err().to_string();
            assert!(
                err.contains("row 3 ") && err.contains(&format!("at {}", hidden - 1)),
                "{err}"
            );
            let good = rows_of(&dsrc, &dq, row_len, qlen, Some(3));
            // SAFETY: as above.
            unsafe { plane.quantize(dtype, hidden, &good) }.unwrap();
            plane.complete(deadline()).unwrap();
            let q_dev = download(&io, &dq, qrows * qlen);
            for r in (0..qrows).filter(|&r| r != 3) {
                assert_eq!(
                    q_dev[r * qlen..(r + 1) * qlen],
                    q_host[r * qlen..(r + 1) * qlen],
                    "quantize {dtype:?} hidden {hidden} row {r}"
                );
            }
            let mut d_host = vec![0u8; qrows * row_len];
            let hd: Vec<QuantRow> = (0..qrows)
                .filter(|&r| r != 3)
                .map(|r| QuantRow {
                    src: q_host.as_ptr() as u64 + (r * qlen) as u64,
                    dst: d_host.as_mut_ptr() as u64 + (r * row_len) as u64,
                })
                .collect();
            // SAFETY: live host buffers of the right sizes.
            unsafe { host.dequantize(dtype, hidden, &hd) }.unwrap();
            let dd = upload(&io, &device, &vec![0; qrows * row_len]);
            let drows = rows_of(&dq, &dd, qlen, row_len, Some(3));
            // SAFETY: live device buffers of the right sizes.
            unsafe { plane.dequantize(dtype, hidden, &drows) }.unwrap();
            plane.complete(deadline()).unwrap();
            let d_dev = download(&io, &dd, qrows * row_len);
            for r in (0..qrows).filter(|&r| r != 3) {
                assert_eq!(
                    d_dev[r * row_len..(r + 1) * row_len],
                    d_host[r * row_len..(r + 1) * row_len],
                    "dequantize {dtype:?} hidden {hidden} row {r}"
                );
            }
        }
    }
}

/// A plan larger than the descriptor staging area is completed in pieces and still right:
/// no descriptor list is overwritten before its kernel ran.
#[test]
fn the_cuda_plane_stages_more_descriptors_than_its_area_holds() {
    use crate::cuda::DeviceRegion;
    use std::time::{Duration, Instant};

    let (device, io, mut plane) = test_plane();
    // 3 * 4000 runs of 24 bytes: more than the initial 64 KiB area, in several operations.
    let n = 4000usize;
    let src: Vec<u8> = (0..3 * n).map(|i| (i * 31 % 251) as u8).collect();
    let dsrc = upload(&io, &device, &src);
    let ddst = upload(&io, &device, &vec![0; 3 * n]);
    for part in 0..3 {
        let runs: Vec<CopyRun> = (0..n)
            .map(|i| {
                let at = (part * n + i) as u64;
                CopyRun {
                    src: dsrc.ptr().addr() + at,
                    // Reversed, so a run done twice or from a stale descriptor shows.
                    dst: ddst.ptr().addr() + (3 * n) as u64 - 1 - at,
                    len: 1,
                }
            })
            .collect();
        // SAFETY: one-byte runs inside live device buffers, no two destinations alike.
        unsafe { plane.copy_runs(&runs) }.unwrap();
    }
    plane
        .complete(Instant::now() + Duration::from_secs(30))
        .unwrap();
    let got = download(&io, &ddst, 3 * n);
    let want: Vec<u8> = src.iter().rev().copied().collect();
    assert_eq!(got, want);
}

/// Scatter puts host bytes at device places and gather brings device bytes back, on both
/// planes, with runs of odd lengths at odd offsets; a run outside its host bytes is an error
/// and queues nothing.
#[test]
fn scatter_and_gather_move_host_bytes_to_device_places_and_back_on_both_planes() {
    use crate::cuda::DeviceRegion;
    use std::time::{Duration, Instant};

    let (device, io, mut plane) = test_plane();
    let deadline = || Instant::now() + Duration::from_secs(30);
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
    // Runs of 1..=37 bytes from scattered offsets of `data` to a reversed order in `dst`.
    let mut runs = Vec::new();
    let (mut at, mut to) = (0u64, 2000u64);
    for len in 1..=37u64 {
        to -= len + 3;
        runs.push(CopyRun {
            src: at,
            dst: to,
            len,
        });
        at += len + 1;
    }
    let dst = upload(&io, &device, &vec![0xEE; 2000]);
    let on_device: Vec<CopyRun> = (runs.iter())
        .map(|r| CopyRun {
            dst: dst.ptr().addr() + r.dst,
            ..*r
        })
        .collect();
    let mut host_dst = vec![0xEEu8; 2000];
    let on_host: Vec<CopyRun> = (runs.iter())
        .map(|r| CopyRun {
            dst: host_dst.as_mut_ptr() as u64 + r.dst,
            ..*r
        })
        .collect();
    // SAFETY: every destination is inside a live 2000-byte buffer, none overlapping.
    unsafe { plane.scatter(&data, &on_device) }.unwrap();
    // SAFETY: the same runs into the live host buffer `host_dst`.
    unsafe { HostPlane::new().scatter(&data, &on_host) }.unwrap();
    plane.complete(deadline()).unwrap();
    assert_eq!(download(&io, &dst, 2000), host_dst, "scatter");

    // Gather the scattered runs back into their places of `data`.
    let back = |base: u64| -> Vec<CopyRun> {
        (runs.iter())
            .map(|r| CopyRun {
                src: base + r.dst,
                dst: r.src,
                len: r.len,
            })
            .collect()
    };
    let mut got = vec![0u8; data.len()];
    let mut want = vec![0u8; data.len()];
    // SAFETY: every source is inside a live 2000-byte buffer.
    unsafe { plane.gather(&back(dst.ptr().addr()), &mut got, deadline()) }.unwrap();
    let host_back = back(host_dst.as_ptr() as u64);
    // SAFETY: every source is inside the live host buffer `host_dst`.
    unsafe { HostPlane::new().gather(&host_back, &mut want, deadline()) }.unwrap();
    for r in &runs {
        let range = r.src as usize..(r.src + r.len) as usize;
        assert_eq!(got[range.clone()], data[range.clone()], "gather (cuda)");
        assert_eq!(want[range.clone()], data[range], "gather (host)");
    }

    // Device copies and a scatter in one launch: each scattered run lands in a second buffer
    // at its place above (all at 1186 and up), and a device copy of what the first scatter put
    // in `dst` goes 1000 bytes lower in it.
    let both = upload(&io, &device, &vec![0xEE; 2000]);
    let base = both.ptr().addr();
    let copies: Vec<CopyRun> = (runs.iter())
        .map(|r| CopyRun {
            src: dst.ptr().addr() + r.dst,
            dst: base + r.dst - 1000,
            len: r.len,
        })
        .collect();
    let scattered: Vec<CopyRun> = (runs.iter())
        .map(|r| CopyRun {
            dst: base + r.dst,
            ..*r
        })
        .collect();
    assert!(
        runs.iter().all(|r| r.dst >= 1000 + r.len),
        "copies below the scattered runs"
    );
    // SAFETY: every destination is inside the live 2000-byte `both`, the copies' under the
    // scattered runs' (checked just above); the copies' sources are in `dst`.
    unsafe { plane.copy_and_scatter(&copies, &data, &scattered) }.unwrap();
    plane.complete(deadline()).unwrap();
    let got = download(&io, &both, 2000);
    for r in &runs {
        let (at, len) = (r.dst as usize, r.len as usize);
        let copied = &got[at - 1000..at - 1000 + len];
        assert_eq!(copied, &host_dst[at..at + len], "copy_and_scatter: copy");
        let scattered = &got[at..at + len];
        assert_eq!(
            scattered,
            &data[r.src as usize..r.src as usize + len],
            "copy_and_scatter"
        );
    }

    // A run past the host bytes: an error, nothing written.
    let bad = [CopyRun {
        src: 990,
        dst: dst.ptr().addr(),
        len: 11,
    }];
    // SAFETY: the destination is live (and the run is refused before any copy).
    let err = unsafe { plane.scatter(&data, &bad) }.unwrap_err();
    assert!(
        err.to_string().contains("outside its 1000 host bytes"),
        "{err}"
    );
    plane.complete(deadline()).unwrap();
    assert_eq!(
        download(&io, &dst, 2000),
        host_dst,
        "a refused scatter wrote"
    );
}
