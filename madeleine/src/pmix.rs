//! The PMIx rendezvous: where Open MPI's `mpirun` and Slurm's `srun --mpi=pmix` start the ranks,
//! each rank publishes the TCP address its connection listener has through the launcher's PMIx
//! server and reads everyone's after a fence (`PMIx_Put`, `PMIx_Commit`, `PMIx_Fence`,
//! `PMIx_Get`), so a job spans hosts with no address given by hand.
//!
//! `libpmix` is loaded when a session uses it (by default where the launcher set `PMIX_*`, or
//! `MAD_BOOTSTRAP=pmix`), so a plain build and a machine without PMIx need nothing. Only the few types these calls take are declared, as
//! `pmix_common.h` (PMIx 3 and 4) lays them out.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::net::SocketAddr;

use crate::{MadError, Result};

const PMIX_SUCCESS: c_int = 0;
const PMIX_STRING: u16 = 3;
const PMIX_INT: u16 = 6;
const PMIX_MAX_KEYLEN: usize = 511;
const PMIX_GLOBAL: u8 = 3;
const PMIX_MAX_NSLEN: usize = 255;
/// The key each rank publishes its address under.
const KEY: &[u8] = b"madeleine.addr\0";

/// `pmix_proc_t`: a namespace and a rank.
#[repr(C)]
struct Proc {
    nspace: [c_char; PMIX_MAX_NSLEN + 1],
    rank: u32,
}

/// `pmix_value_t`: a type and a union of at most 24 bytes (8-aligned).
#[repr(C)]
struct Value {
    kind: u16,
    data: [u64; 3],
}

/// `pmix_info_t`: a key, directives, a value.
#[repr(C)]
struct Info {
    key: [c_char; PMIX_MAX_KEYLEN + 1],
    flags: u32,
    value: Value,
}

impl Info {
    /// An integer directive (`key` without its NUL).
    fn int(key: &[u8], v: i32) -> Info {
        let mut info = Info { key: [0; PMIX_MAX_KEYLEN + 1], flags: 0, value: Value { kind: PMIX_INT, data: [0; 3] } };
        for (d, &b) in info.key.iter_mut().zip(key) {
            *d = b as c_char;
        }
        // An `int` is the union's first four bytes.
        info.value.data[0] = v as u32 as u64;
        info
    }
}

type InitFn = unsafe extern "C" fn(*mut Proc, *mut c_void, usize) -> c_int;
type PutFn = unsafe extern "C" fn(u8, *const c_char, *mut Value) -> c_int;
type CommitFn = unsafe extern "C" fn() -> c_int;
type FenceFn = unsafe extern "C" fn(*const Proc, usize, *const Info, usize) -> c_int;
type GetFn = unsafe extern "C" fn(*const Proc, *const c_char, *const c_void, usize, *mut *mut Value) -> c_int;
type FinalizeFn = unsafe extern "C" fn(*const c_void, usize) -> c_int;

fn err(what: &str) -> MadError {
    MadError::Invalid(format!("PMIx rendezvous: {what}"))
}

/// Looks `name` up in the library `lib` (opened by `dlopen`).
fn symbol<T>(lib: *mut c_void, name: &[u8]) -> Result<T> {
    // SAFETY: `name` is NUL-terminated; `lib` is a handle from dlopen.
    let p = unsafe { libc::dlsym(lib, name.as_ptr() as *const c_char) };
    if p.is_null() {
        return Err(err(&format!("libpmix has no {}", String::from_utf8_lossy(&name[..name.len() - 1]))));
    }
    // SAFETY: the symbol is the PMIx function of this name, whose C signature `T` declares.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

/// Whether this process was started by a launcher with a PMIx server (its variables are set).
pub fn offered() -> bool {
    std::env::var_os("PMIX_NAMESPACE").is_some() && std::env::var_os("PMIX_RANK").is_some()
}

/// `libpmix`, loaded (it stays loaded for the process's life), if this machine has it.
pub fn load() -> Option<*mut c_void> {
    [&b"libpmix.so.2\0"[..], b"libpmix.so\0"].into_iter().find_map(|name| {
        // SAFETY: a NUL-terminated name.
        let lib = unsafe { libc::dlopen(name.as_ptr() as *const c_char, libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        (!lib.is_null()).then_some(lib)
    })
}

/// Publishes `me` as this rank's address and returns every rank's (by rank). `rank` and `size`
/// are the launcher's; PMIx's own rank must agree. The fence gives up after `timeout` (whole
/// seconds, at least one: PMIx's `PMIX_TIMEOUT`), as when a rank never got there.
pub fn exchange(me: SocketAddr, rank: usize, size: usize, timeout: std::time::Duration) -> Result<Vec<SocketAddr>> {
    let lib = load().ok_or_else(|| err("libpmix is not installed (Debian: libpmix2)"))?;
    let init: InitFn = symbol(lib, b"PMIx_Init\0")?;
    let put: PutFn = symbol(lib, b"PMIx_Put\0")?;
    let commit: CommitFn = symbol(lib, b"PMIx_Commit\0")?;
    let fence: FenceFn = symbol(lib, b"PMIx_Fence\0")?;
    let get: GetFn = symbol(lib, b"PMIx_Get\0")?;
    let finalize: FinalizeFn = symbol(lib, b"PMIx_Finalize\0")?;
    let mut proc = Proc { nspace: [0; PMIX_MAX_NSLEN + 1], rank: 0 };
    // SAFETY: `proc` is a valid pmix_proc_t for PMIx to fill; no info array.
    let rc = unsafe { init(&mut proc, std::ptr::null_mut(), 0) };
    if rc != PMIX_SUCCESS {
        return Err(err(&format!("PMIx_Init failed ({rc}): not started by a PMIx launcher?")));
    }
    let result = (|| {
        if proc.rank as usize != rank {
            return Err(err(&format!("PMIx says rank {}, the launcher's variables {rank}", proc.rank)));
        }
        let text = CString::new(me.to_string()).expect("an address has no NUL");
        let mut v = Value { kind: PMIX_STRING, data: [text.as_ptr() as u64, 0, 0] };
        // SAFETY: a NUL-terminated key and a string value PMIx copies during the call.
        let rc = unsafe { put(PMIX_GLOBAL, KEY.as_ptr() as *const c_char, &mut v) };
        if rc != PMIX_SUCCESS {
            return Err(err(&format!("PMIx_Put failed ({rc})")));
        }
        // SAFETY: plain calls; a NULL proc array fences the whole namespace.
        let rc = unsafe { commit() };
        if rc != PMIX_SUCCESS {
            return Err(err(&format!("PMIx_Commit failed ({rc})")));
        }
        let secs = timeout.as_secs().clamp(1, i32::MAX as u64) as i32;
        let info = Info::int(b"pmix.timeout", secs);
        // SAFETY: a NULL proc array fences the whole namespace; one valid info.
        let rc = unsafe { fence(std::ptr::null(), 0, &info, 1) };
        if rc != PMIX_SUCCESS {
            return Err(err(&format!(
                "PMIx_Fence failed ({rc}; a timeout after {secs} s is -24 in PMIx 3-4): did every rank start?"
            )));
        }
        (0..size)
            .map(|r| {
                let peer = Proc { nspace: proc.nspace, rank: r as u32 };
                let mut out: *mut Value = std::ptr::null_mut();
                // SAFETY: valid proc and key; PMIx allocates the value it returns.
                let rc = unsafe { get(&peer, KEY.as_ptr() as *const c_char, std::ptr::null(), 0, &mut out) };
                if rc != PMIX_SUCCESS || out.is_null() {
                    return Err(err(&format!("PMIx_Get of rank {r}'s address failed ({rc})")));
                }
                // SAFETY: PMIx returned a valid value; a string's pointer is its first word.
                let (kind, ptr) = unsafe { ((*out).kind, (*out).data[0] as usize as *const c_char) };
                if kind != PMIX_STRING || ptr.is_null() {
                    return Err(err(&format!("rank {r} published something else than an address")));
                }
                // SAFETY: a NUL-terminated string owned by the value (left to PMIx: a few bytes
                // per rank, once per session).
                let s = unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned();
                s.parse().map_err(|_| err(&format!("rank {r} published {s:?}, not an address")))
            })
            .collect()
    })();
    // SAFETY: plain call; this process uses PMIx for nothing else.
    unsafe { finalize(std::ptr::null(), 0) };
    result
}

/// The IP this host is reached at by default: the source address of its route to a public
/// address (no packet is sent), else loopback. `MAD_LISTEN_IP` overrides it.
pub fn local_ip() -> std::net::IpAddr {
    let routed = std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| s.connect("192.0.2.1:9").and_then(|()| s.local_addr()))
        .map(|a| a.ip());
    match routed {
        Ok(ip) if !ip.is_unspecified() => ip,
        _ => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_declared_types_have_pmix_common_h_layout() {
        // pmix_value_t: a 2-byte type, then a 24-byte union at offset 8.
        assert_eq!((std::mem::size_of::<Value>(), std::mem::align_of::<Value>()), (32, 8));
        // pmix_info_t: a 512-byte key, 4 bytes of flags, the value at offset 520.
        assert_eq!(std::mem::size_of::<Info>(), 552);
        let i = Info::int(b"pmix.timeout", 30);
        assert_eq!(std::ptr::addr_of!(i.value) as usize - std::ptr::addr_of!(i) as usize, 520);
        assert_eq!(i.key[..13].iter().map(|&c| c as u8).collect::<Vec<_>>(), b"pmix.timeout\0");
        assert_eq!((i.value.kind, i.value.data[0] as u32 as i32), (PMIX_INT, 30));
        assert_eq!(std::mem::size_of::<Proc>(), 260);
    }
}
