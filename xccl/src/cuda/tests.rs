//! The CUDA layer against the stand-in driver (`tests/cuda_standin/`, host memory behind the
//! driver calls), loaded into this test process.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use super::*;
use crate::fabric::deadline_after;

/// Builds the stand-in once per test process and loads it as this process's driver.
pub(crate) fn standin_device() -> Device {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(|| {
        // One directory for every run: the build renames a finished library into place.
        let dir = std::env::temp_dir().join("xccl-cuda-standin-unit");
        crate::testing::build_cuda_standin(&dir).unwrap_or_else(|e| panic!("{e}"))
    });
    Driver::get_from(path)
        .and_then(|d| d.device(0))
        .unwrap_or_else(|e| panic!("{e}"))
}

fn soon() -> Instant {
    deadline_after(Duration::from_secs(10))
}

fn what() -> String {
    "a unit test".into()
}

#[test]
fn the_standin_device_reports_its_name_and_compute_capability() {
    let dev = standin_device();
    assert_eq!(dev.name(), "xccl stand-in (host memory)");
    assert_eq!(dev.compute_capability(), (9, 0));
    assert_eq!(dev.ordinal(), 0);
    assert!(dev.driver().device_count().unwrap() >= 1);
    assert!(dev.driver().version().unwrap() >= 12000);
    // A device that does not exist is an argument error naming the count.
    let e = dev.driver().device(64).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

#[test]
fn bytes_written_to_device_memory_read_back_and_copy_between_regions() {
    let dev = standin_device();
    let stream = Stream::new(&dev).unwrap();
    let a = DeviceMemory::alloc(&dev, 4096, what).unwrap();
    let b = DeviceMemory::alloc(&dev, 4096, what).unwrap();
    let data: Vec<u8> = (0..1000).map(|i| (i * 7) as u8).collect();
    stream.write(&a, 100, &data, soon(), 0, &what).unwrap();
    stream.copy(&b, 3000, &a, 100, 1000, &what).unwrap();
    stream.memset(&a, 100, 0xee, 10, &what).unwrap();
    stream.synchronize(soon(), 0, &what).unwrap();
    let mut got = vec![0u8; 1000];
    stream.read(&b, 3000, &mut got, soon(), 0, &what).unwrap();
    assert_eq!(got, data);
    stream.read(&a, 100, &mut got, soon(), 0, &what).unwrap();
    assert_eq!(&got[..10], &[0xee; 10]);
    assert_eq!(&got[10..], &data[10..]);
    assert!(stream.is_idle().unwrap());
}

#[test]
fn several_ranges_read_with_one_wait_land_each_in_its_buffer() {
    let dev = standin_device();
    let stream = Stream::new(&dev).unwrap();
    let a = DeviceMemory::alloc(&dev, 256, what).unwrap();
    let b = DeviceMemory::alloc(&dev, 256, what).unwrap();
    let (da, db): (Vec<u8>, Vec<u8>) = ((0..100).collect(), (100..200).collect());
    stream.write(&a, 10, &da, soon(), 0, &what).unwrap();
    stream.write(&b, 20, &db, soon(), 0, &what).unwrap();
    let (mut ga, mut gb) = (vec![0u8; 100], vec![0u8; 7]);
    stream
        .read_parts(
            &mut [(&a, 10, &mut ga[..]), (&b, 30, &mut gb[..])],
            soon(),
            0,
            &what,
        )
        .unwrap();
    assert_eq!(ga, da);
    assert_eq!(gb, db[10..17]);
    // One range outside its region: refused, and no buffer written.
    let (mut ga, mut gb) = (vec![0u8; 100], vec![0u8; 7]);
    let e = stream
        .read_parts(
            &mut [(&a, 10, &mut ga[..]), (&b, 250, &mut gb[..])],
            soon(),
            0,
            &what,
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!((ga, gb), (vec![0u8; 100], vec![0u8; 7]));
}

#[test]
fn accesses_outside_a_region_are_refused_before_any_copy() {
    let dev = standin_device();
    let stream = Stream::new(&dev).unwrap();
    let a = DeviceMemory::alloc(&dev, 64, what).unwrap();
    let e = stream
        .write(&a, 60, &[0u8; 8], soon(), 0, &what)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = stream
        .read(&a, usize::MAX, &mut [0u8; 2], soon(), 0, &what)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = stream.copy(&a, 0, &a, 1, 64, &what).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(DeviceMemory::alloc(&dev, 0, what).is_err());
}

#[test]
fn device_pointers_are_told_from_host_pointers_and_bounded_by_their_allocation() {
    let dev = standin_device();
    let a = DeviceMemory::alloc(&dev, 256, what).unwrap();
    let p = dev.device_pointer(a.ptr().addr() + 16, 64).unwrap();
    assert_eq!(p, a.ptr().add(16));
    // The last byte of the allocation is in, one more is not.
    dev.device_pointer(a.ptr().addr() + 16, 240).unwrap();
    let e = dev.device_pointer(a.ptr().addr() + 16, 241).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("past the end")),
        "{e}"
    );
    let host = [0u8; 64];
    let e = dev.device_pointer(host.as_ptr() as u64, 64).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("not device memory")),
        "{e}"
    );
}

#[test]
fn opening_an_ipc_handle_of_this_process_is_refused_by_the_driver() {
    let dev = standin_device();
    let a = DeviceMemory::alloc(&dev, 4096, what).unwrap();
    let export = a.export().unwrap();
    assert_eq!((export.len, export.device), (4096, 0));
    match dev.open_ipc(&export, || "its own window".into()) {
        Err(Error::Native {
            call,
            code,
            message,
            context,
            ..
        }) => {
            assert_eq!(call, "cuIpcOpenMemHandle_v2");
            assert_eq!(code, i64::from(sys::CUDA_ERROR_INVALID_CONTEXT));
            assert!(message.contains("CUDA_ERROR_INVALID_CONTEXT"), "{message}");
            assert!(context.contains("its own window"), "{context}");
        }
        other => panic!("expected the driver's refusal, got {other:?}"),
    }
}

#[test]
fn a_kernel_found_by_name_runs_on_the_stream() {
    let dev = standin_device();
    let stream = Stream::new(&dev).unwrap();
    let module = Module::load(&dev, b"// any image\n").unwrap();
    let fill = module.function("xccl_test_fill_u32").unwrap();
    assert_eq!(fill.name(), "xccl_test_fill_u32");
    let mem = DeviceMemory::alloc(&dev, 64 * 4, what).unwrap();
    let (mut p, mut n, mut v) = (mem.ptr().addr(), 64u32, 0xabcd_1234u32);
    let mut params = [
        (&mut p as *mut u64).cast::<c_void>(),
        (&mut n as *mut u32).cast(),
        (&mut v as *mut u32).cast(),
    ];
    // SAFETY: three parameters of the kernel's types, live for the call; the kernel writes
    // 64 u32 into `mem`, which lives until the stream is synchronized below.
    unsafe { stream.launch(&fill, (1, 1, 1), (64, 1, 1), 0, &mut params) }.unwrap();
    let event = Event::new(&dev).unwrap();
    event.record(&stream).unwrap();
    event.wait(soon(), 0, &what).unwrap();
    assert!(event.is_complete().unwrap());
    let other = Stream::new(&dev).unwrap();
    other.wait_event(&event).unwrap();
    let mut got = vec![0u8; 256];
    other.read(&mem, 0, &mut got, soon(), 0, &what).unwrap();
    assert!(got
        .chunks_exact(4)
        .all(|c| u32::from_ne_bytes(c.try_into().unwrap()) == 0xabcd_1234));
}

#[test]
fn an_unknown_kernel_is_the_drivers_not_found_naming_it() {
    let dev = standin_device();
    let module = Module::load(&dev, b"x").unwrap();
    let e = module.function("no_such_kernel").unwrap_err();
    match &e {
        Error::Native { call, code, .. } => {
            assert_eq!(*call, "cuModuleGetFunction");
            assert_eq!(*code, i64::from(sys::CUDA_ERROR_NOT_FOUND));
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("no_such_kernel"), "{e}");
    assert!(Module::load(&dev, b"").is_err());
}

#[test]
fn the_context_is_made_current_on_any_thread() {
    let dev = standin_device();
    let mem = DeviceMemory::alloc(&dev, 64, what).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            // A fresh thread has no current context: every call binds first.
            let stream = Stream::new(&dev).unwrap();
            stream.write(&mem, 0, &[5u8; 64], soon(), 0, &what).unwrap();
        })
        .join()
        .unwrap();
    });
    let mut got = [0u8; 64];
    Stream::new(&dev)
        .unwrap()
        .read(&mem, 0, &mut got, soon(), 0, &what)
        .unwrap();
    assert_eq!(got, [5u8; 64]);
}

#[test]
fn a_borrowed_stream_is_used_but_not_destroyed() {
    let dev = standin_device();
    let owner = Stream::new(&dev).unwrap();
    {
        // SAFETY: `owner`'s stream outlives the borrowed value.
        let borrowed = unsafe { Stream::borrowed(&dev, owner.raw()) };
        assert_eq!(borrowed.raw(), owner.raw());
        borrowed.synchronize(soon(), 0, &what).unwrap();
    }
    // Still a valid stream after the borrowed value dropped.
    owner.synchronize(soon(), 0, &what).unwrap();
}
