//! `cuGetExportTable`, the driver's private tables that NVIDIA's runtime asks for, from a client
//! that calls them the way libcudart does (sources in `crates/sim/cuda/src/export_table.rs`).
//! Each test runs in a child process on its own simulator state.
mod common;

use cu::CUresult::{self as R, *};
use cudarc::driver::sys as cu;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

macro_rules! in_child {
    ($name:literal) => {
        if !common::is_child() {
            common::Child::new($name).run().success();
            return;
        }
    };
}

fn ok(r: R) {
    assert_eq!(r, CUDA_SUCCESS);
}

fn id(s: &str) -> cu::CUuuid {
    let hex: String = s.chars().filter(|c| *c != '-').collect();
    let mut bytes = [0 as std::ffi::c_char; 16];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as std::ffi::c_char;
    }
    cu::CUuuid { bytes }
}

const CUDART_INTERFACE: &str = "6bd5fb6c-5bf4-e74a-8987-d93912fd9df9";
const CALLBACK_HOOKS: &str = "a094798c-2e74-2e74-93f2-0800200c0a66";
const TOOLS_TLS: &str = "42d85a81-23f6-cb47-8298-f6e78a3aecdc";
const CONTEXT_STORAGE: &str = "c693336e-1121-df11-a8c3-68f355d89593";
const CONTEXT_CHECKS: &str = "263e8860-7cd2-6143-92f6-bbd5006dfa7e";
const INTEGRITY: &str = "d4082055-bde6-704b-8d34-ba123c66e1f2";
const TOOLS_CONTEXT: &str = "21318c60-9714-3248-8ca6-41ff7324c8f2";

// SAFETY (for every `unsafe` block in this file): calls into the simulated driver, and into its
// table slots, with arguments of the types the slots are documented to take (export_table.rs),
// valid out-pointers and live handles.

fn table(uuid: &str) -> Result<*const usize, R> {
    let mut t: *const c_void = null_mut();
    let u = id(uuid);
    // SAFETY: see the file-level note.
    match unsafe { cu::cuGetExportTable(&mut t, &u) } {
        CUDA_SUCCESS => Ok(t as *const usize),
        e => {
            assert!(t.is_null(), "a refused table leaves NULL");
            Err(e)
        }
    }
}

fn slot<F: Copy>(t: *const usize, i: usize) -> F {
    // SAFETY: `t` is a table the driver handed out and `i` within its length; the slot holds a
    // function address, reinterpreted as the pointer-sized function type F.
    unsafe { std::mem::transmute_copy(&*t.add(i)) }
}

#[test]
fn tables_libcudart_asks_for_are_answered_without_null_slots() {
    in_child!("tables_libcudart_asks_for_are_answered_without_null_slots");
    // Sizes in bytes in slot 0, as Wine's nvcuda relays them; no slot NULL.
    for (uuid, slots) in [
        (CUDART_INTERFACE, 13),
        (CALLBACK_HOOKS, 7),
        (TOOLS_TLS, 4),
        (CONTEXT_CHECKS, 4),
        (INTEGRITY, 3),
        (TOOLS_CONTEXT, 95), // asked for by 13.x runtimes
    ] {
        let t = table(uuid).unwrap();
        // SAFETY: see the file-level note (slot 0 is the size; reading `slots` slots stays in it).
        let s = unsafe { std::slice::from_raw_parts(t, slots) };
        assert_eq!(s[0], 8 * slots, "{uuid}");
        assert!(s.iter().all(|&x| x != 0), "{uuid}");
    }
    let cls = table(CONTEXT_STORAGE).unwrap();
    // SAFETY: see the file-level note.
    assert!(unsafe { std::slice::from_raw_parts(cls, 4) }
        .iter()
        .all(|&x| x != 0));
    // Asked for by libcudart before cuInit, and unknown ids: refused.
    assert_eq!(
        table("f8cff951-2146-8b4e-b9e2-fb469e7c0dd9"),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        table("00000000-0000-0000-0000-000000000000"),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    // SAFETY: see the file-level note.
    unsafe {
        let u = id(CUDART_INTERFACE);
        assert_eq!(
            cu::cuGetExportTable(null_mut(), &u),
            CUDA_ERROR_INVALID_VALUE
        );
    }
    // A slot that is not modeled answers an error instead of crashing.
    let t = table(CUDART_INTERFACE).unwrap();
    let unmodeled: extern "C" fn() -> R = slot(t, 3);
    assert_eq!(unmodeled(), CUDA_ERROR_NOT_SUPPORTED);
}

type CurrentContext = extern "C" fn(*mut cu::CUcontext) -> R;
type ContextId = extern "C" fn(cu::CUcontext, *mut u64) -> R;

/// What cuBLASLt 12.8 calls on every heuristics query (every cuBLAS GEMM).
#[test]
fn tools_slots_answer_the_current_context_and_its_id() {
    in_child!("tools_slots_answer_the_current_context_and_its_id");
    let current: CurrentContext = slot(table(TOOLS_TLS).unwrap(), 2);
    let ctx_id: ContextId = slot(table(TOOLS_CONTEXT).unwrap(), 4);
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        let mut h = cu::CUcontext::from(null_mut());
        ok(current(&mut h));
        assert!(h.is_null(), "no context is current yet");
        let mut primary = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut primary, 0));
        let mut created = null_mut();
        ok(cu::cuCtxCreate_v2(&mut created, 0, 0));
        for c in [created, primary] {
            ok(cu::cuCtxSetCurrent(c));
            ok(current(&mut h));
            assert_eq!(h, c);
            let (mut a, mut b) = (0, 0);
            ok(cu::cuCtxGetId(c, &mut a));
            ok(ctx_id(c, &mut b));
            assert_eq!(a, b);
            ok(ctx_id(null_mut(), &mut b));
            assert_eq!(a, b, "NULL is the current context");
        }
        let (mut a, mut b) = (0, 0);
        ok(ctx_id(created, &mut a));
        ok(ctx_id(primary, &mut b));
        assert_ne!(a, b);
        assert_eq!(current(null_mut()), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(ctx_id(primary, null_mut()), CUDA_ERROR_INVALID_VALUE);
    }
}

type GetPrimary = extern "C" fn(*mut cu::CUcontext, cu::CUdevice) -> R;

#[test]
fn the_primary_context_handle_comes_before_it_is_retained() {
    in_child!("the_primary_context_handle_comes_before_it_is_retained");
    let get: GetPrimary = slot(table(CUDART_INTERFACE).unwrap(), 2);
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        let mut h = null_mut();
        ok(get(&mut h, 0));
        assert!(!h.is_null());
        assert_eq!(get(&mut h, 1), CUDA_ERROR_INVALID_DEVICE);
        let (mut flags, mut active) = (0, 0);
        ok(cu::cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!(active, 0, "getting the handle does not retain the context");
        // What libcudart does next: make it current, then retain it.
        ok(cu::cuCtxSetCurrent(h));
        let mut p = 0;
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, 1 << 20),
            CUDA_ERROR_CONTEXT_IS_DESTROYED,
            "a primary context not yet retained cannot work (cuda.h's text for this error)"
        );
        let mut retained = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut retained, 0));
        assert_eq!(
            retained, h,
            "the handle is the same before and after retaining"
        );
        ok(cu::cuMemAlloc_v2(&mut p, 1 << 20));
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        ok(cu::cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!(active, 0);
        let (mut free, mut total) = (0, 0);
        assert_eq!(
            cu::cuMemGetInfo_v2(&mut free, &mut total),
            CUDA_ERROR_CONTEXT_IS_DESTROYED
        );
        ok(cu::cuDevicePrimaryCtxRetain(&mut retained, 0));
        assert_eq!(retained, h);
        ok(cu::cuMemGetInfo_v2(&mut free, &mut total));
        // Retained again: the context's own memory is all it holds.
        let ctx = cuvisor_sim::model::preset("single").unwrap().devices[0].context_memory;
        assert_eq!(
            free as u64,
            total as u64 - ctx,
            "releasing the last reference freed what it held"
        );
    }
}

type Dtor = extern "C" fn(cu::CUcontext, *mut c_void, *mut c_void);
type Put = extern "C" fn(cu::CUcontext, *mut c_void, *mut c_void, Option<Dtor>) -> R;
type Delete = extern "C" fn(cu::CUcontext, *mut c_void) -> R;
type Get = extern "C" fn(*mut *mut c_void, cu::CUcontext, *mut c_void) -> R;

static DESTROYED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn count_destroyed(_c: cu::CUcontext, key: *mut c_void, value: *mut c_void) {
    assert_eq!((key as usize, value as usize), (0x10, 0x20));
    DESTROYED.fetch_add(1, SeqCst);
}

#[test]
fn context_local_storage_is_per_context_and_destroyed_with_it() {
    in_child!("context_local_storage_is_per_context_and_destroyed_with_it");
    let t = table(CONTEXT_STORAGE).unwrap();
    let (put, delete, get): (Put, Delete, Get) = (slot(t, 0), slot(t, 1), slot(t, 2));
    let (key, value) = (0x10 as *mut c_void, 0x20 as *mut c_void);
    let mut v = null_mut();
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        assert_eq!(get(&mut v, null_mut(), key), CUDA_ERROR_INVALID_CONTEXT);
        let mut a = null_mut();
        ok(cu::cuCtxCreate_v2(&mut a, 0, 0));
        assert_eq!(get(&mut v, null_mut(), key), CUDA_ERROR_INVALID_HANDLE);
        // NULL is the current context.
        ok(put(null_mut(), key, value, Some(count_destroyed)));
        ok(get(&mut v, a, key));
        assert_eq!(v, value);
        let mut b = null_mut();
        ok(cu::cuCtxCreate_v2(&mut b, 0, 0));
        assert_eq!(
            get(&mut v, null_mut(), key),
            CUDA_ERROR_INVALID_HANDLE,
            "another context has its own storage"
        );
        ok(put(b, key, 0x30 as *mut c_void, None));
        ok(delete(b, key));
        assert_eq!(get(&mut v, b, key), CUDA_ERROR_INVALID_HANDLE);
        ok(cu::cuCtxDestroy_v2(b));
        assert_eq!(DESTROYED.load(SeqCst), 0);
        ok(cu::cuCtxDestroy_v2(a));
        assert_eq!(
            DESTROYED.load(SeqCst),
            1,
            "destroying the context calls the destructor"
        );
        // The primary context's storage goes when it is released for the last time.
        let mut p = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut p, 0));
        ok(put(p, key, value, Some(count_destroyed)));
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        assert_eq!(DESTROYED.load(SeqCst), 2);
        ok(cu::cuDevicePrimaryCtxRetain(&mut p, 0));
        assert_eq!(get(&mut v, p, key), CUDA_ERROR_INVALID_HANDLE);
    }
}

type Integrity = extern "C" fn(u32, u64, *mut [u64; 2]) -> R;

#[test]
fn the_integrity_check_answers_per_version_and_call() {
    in_child!("the_integrity_check_answers_per_version_and_call");
    let check: Integrity = slot(table(INTEGRITY).unwrap(), 1);
    let mut r = [0u64; 2];
    assert_eq!(check(12092, 1, &mut r), CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: see the file-level note.
    unsafe { ok(cu::cuInit(0)) };
    // The two constant answers ZLUDA records for versions ending in 0 and 1.
    ok(check(12090, 1_700_000_000, &mut r));
    assert_eq!(r, [0x3341181C03CB675C, 0x8ED383AA1F4CD1E8]);
    ok(check(12091, 1_700_000_000, &mut r));
    assert_eq!(r, [0x1841181C03CB675C, 0x8ED383AA1F4CD1E8]);
    // The keyed hash: the same for the same inputs, different for another time or thread.
    let mut a = [0u64; 2];
    let mut b = [0u64; 2];
    ok(check(12092, 1_700_000_000, &mut a));
    ok(check(12092, 1_700_000_000, &mut b));
    assert_eq!(a, b);
    ok(check(12092, 1_700_000_001, &mut b));
    assert_ne!(a, b);
    let other = std::thread::spawn(move || {
        let mut c = [0u64; 2];
        ok(check(12092, 1_700_000_000, &mut c));
        c
    })
    .join()
    .unwrap();
    assert_ne!(a, other, "the calling thread is part of the hash");
    let checks = table(CONTEXT_CHECKS).unwrap();
    let context_check: extern "C" fn(cu::CUcontext, *mut u32, *mut *const c_void) -> R =
        slot(checks, 2);
    let mut flags = 7u32;
    ok(context_check(null_mut(), &mut flags, null_mut()));
    assert_eq!(flags, 0);
}
