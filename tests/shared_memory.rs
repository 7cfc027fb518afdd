//! Memory shared between processes (VMM handles passed as file descriptors, legacy IPC handles),
//! attacked as a tenant would: the exporter exits while an importer still holds the memory.
//! What must hold: the memory stays charged, once, to the container that allocated it, for as
//! long as a process of that container holds it; an importer in another container is charged
//! nothing and can neither double nor remove the allocating container's charge.
//!
//! Each test runs its sides as child processes of this binary on one simulator state, under
//! libcuvisor; a "container" is a ledger directory. File descriptors go from exporter to
//! importer with SCM_RIGHTS over a socket pair the parent made, as NCCL and UCX send them.
mod common;

use common::*;
use cu::CUresult::*;
use cudarc::driver::sys as cu;
use std::ffi::c_void;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{ChildStdout, Stdio};
use std::ptr::null_mut;

const SIZE: u64 = 256 * MIB;

fn ok(r: cu::CUresult) {
    assert_eq!(r, CUDA_SUCCESS);
}

fn setup() {
    let mut ctx = null_mut();
    // SAFETY: the driver API's contract, with valid out-pointers.
    unsafe {
        ok(cu::cuInit(0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 0));
        ok(cu::cuCtxSetCurrent(ctx));
    }
}

fn free_mem() -> u64 {
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) });
    free as u64
}

/// Blocks until the parent writes a line on our stdin.
fn wait_for_parent() {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
}

fn say(what: &str) {
    println!("{what}");
    std::io::stdout().flush().unwrap();
}

// ---- SCM_RIGHTS -----------------------------------------------------------------------------

fn sock() -> i32 {
    std::env::var("SOCK").unwrap().parse().unwrap()
}

fn send_fd(sock: i32, fd: i32) {
    // SAFETY: a msghdr with one byte of data and one SCM_RIGHTS control message, all in buffers
    // of ours that outlive the call.
    unsafe {
        let mut byte = [0u8; 1];
        let mut iov = libc::iovec {
            iov_base: byte.as_mut_ptr() as *mut c_void,
            iov_len: 1,
        };
        let mut control = [0u8; 64];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut c_void;
        msg.msg_controllen = libc::CMSG_SPACE(4) as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut i32, fd);
        assert_eq!(libc::sendmsg(sock, &msg, 0), 1, "sendmsg");
    }
}

fn recv_fd(sock: i32) -> i32 {
    // SAFETY: as in `send_fd`, receiving into buffers of ours.
    unsafe {
        let mut byte = [0u8; 1];
        let mut iov = libc::iovec {
            iov_base: byte.as_mut_ptr() as *mut c_void,
            iov_len: 1,
        };
        let mut control = [0u8; 64];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut c_void;
        msg.msg_controllen = control.len() as _;
        assert_eq!(libc::recvmsg(sock, &mut msg, 0), 1, "recvmsg");
        let c = libc::CMSG_FIRSTHDR(&msg);
        assert!(
            !c.is_null() && (*c).cmsg_type == libc::SCM_RIGHTS,
            "no descriptor came"
        );
        std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32)
    }
}

/// A connected socket pair whose ends children inherit (close-on-exec cleared).
fn socket_pair() -> (i32, i32) {
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two descriptors into our array; fcntl on them.
    unsafe {
        assert_eq!(
            libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()),
            0
        );
        for fd in fds {
            libc::fcntl(fd, libc::F_SETFD, 0);
        }
    }
    (fds[0], fds[1])
}

// ---- the sides --------------------------------------------------------------------------------

fn vmm_prop() -> cu::CUmemAllocationProp {
    // SAFETY: plain data, zero is valid for every field.
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.requestedHandleTypes =
        cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop
}

const FD: cu::CUmemAllocationHandleType =
    cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// Creates SIZE of VMM memory, exports it as a descriptor, sends it; at the parent's word
/// releases its handle, closes the descriptor and exits.
fn vmm_exporter() {
    setup();
    // SAFETY: the driver API's contract, with valid out-pointers and the handle it returned.
    unsafe {
        let mut h = 0;
        ok(cu::cuMemCreate(&mut h, SIZE as usize, &vmm_prop(), 0));
        let mut fd: i32 = -1;
        ok(cu::cuMemExportToShareableHandle(
            &mut fd as *mut i32 as *mut c_void,
            h,
            FD,
            0,
        ));
        send_fd(sock(), fd);
        say("sent");
        wait_for_parent();
        ok(cu::cuMemRelease(h));
        libc::close(fd);
    }
}

/// Receives the descriptor, imports and maps the memory; at the parent's word checks what its
/// container is shown, unmaps and releases; at the next, exits.
fn vmm_importer() {
    setup();
    // SAFETY: as above.
    unsafe {
        let fd = recv_fd(sock());
        let mut h = 0;
        ok(cu::cuMemImportFromShareableHandle(
            &mut h,
            fd as usize as *mut c_void,
            FD,
        ));
        libc::close(fd); // as PyTorch and NCCL do once imported: the handle holds the memory
        let mut va = 0;
        ok(cu::cuMemAddressReserve(&mut va, SIZE as usize, 0, 0, 0));
        ok(cu::cuMemMap(va, SIZE as usize, 0, h, 0));
        say("imported");
        wait_for_parent();
        assert_eq!(
            free_mem(),
            GIB - SIZE,
            "the exporter is gone; the container is still charged for what this process maps"
        );
        ok(cu::cuMemUnmap(va, SIZE as usize));
        ok(cu::cuMemRelease(h));
        ok(cu::cuMemAddressFree(va, SIZE as usize));
        say("released");
        wait_for_parent();
    }
}

/// Another process of the exporting container: what is left of the quota.
fn probe() {
    setup();
    let want: u64 = std::env::var("LEFT").unwrap().parse().unwrap();
    assert_eq!(free_mem(), want);
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    unsafe {
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, (want + 64 * MIB) as usize),
            CUDA_ERROR_OUT_OF_MEMORY,
            "more than the quota leaves"
        );
        ok(cu::cuMemAlloc_v2(&mut p, want as usize));
        ok(cu::cuMemFree_v2(p));
    }
    say("probed");
}

/// Allocates SIZE, prints its IPC handle; at the parent's word exits (without freeing: its
/// allocations go with it).
fn ipc_exporter() {
    setup();
    // SAFETY: as above.
    unsafe {
        let mut p = 0;
        ok(cu::cuMemAlloc_v2(&mut p, SIZE as usize));
        let mut handle: cu::CUipcMemHandle = std::mem::zeroed();
        ok(cu::cuIpcGetMemHandle(&mut handle, p));
        let hex: String = handle
            .reserved
            .iter()
            .map(|b| format!("{:02x}", *b as u8))
            .collect();
        say(&format!("handle {hex}"));
        wait_for_parent();
    }
}

/// Opens the handle twice (one more reference, the same pointer); at the parent's word closes
/// once, at the next the last time, then exits.
fn ipc_importer() {
    setup();
    let hex = std::env::var("HANDLE").unwrap();
    // SAFETY: as above.
    unsafe {
        let mut handle: cu::CUipcMemHandle = std::mem::zeroed();
        for (i, b) in handle.reserved.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
        }
        let before = free_mem();
        let (mut a, mut b) = (0, 0);
        ok(cu::cuIpcOpenMemHandle_v2(&mut a, handle, 1));
        ok(cu::cuIpcOpenMemHandle_v2(&mut b, handle, 1));
        assert_eq!(a, b, "opened again in one context: the same pointer");
        assert_eq!(
            free_mem(),
            before,
            "opening takes nothing from this container"
        );
        say("opened");
        wait_for_parent();
        ok(cu::cuIpcCloseMemHandle(a));
        say("closed once");
        wait_for_parent();
        ok(cu::cuIpcCloseMemHandle(b));
        say("closed");
        wait_for_parent();
    }
}

fn side() -> bool {
    if !is_child() {
        return false;
    }
    match std::env::var("ROLE").unwrap().as_str() {
        "vmm-exporter" => vmm_exporter(),
        "vmm-importer" => vmm_importer(),
        "probe" => probe(),
        "ipc-exporter" => ipc_exporter(),
        "ipc-importer" => ipc_importer(),
        r => panic!("role {r}"),
    }
    true
}

// ---- the parent -------------------------------------------------------------------------------

struct Side {
    child: std::process::Child,
    out: BufReader<ChildStdout>,
    what: &'static str,
}

impl Side {
    fn start(
        test: &str,
        role: &'static str,
        state: &Path,
        ledger: &Path,
        env: &[(&str, &str)],
    ) -> Side {
        // What is shared and who is charged for it is the subject here, in the simulator's
        // physical use and libcuvisor's ledgers alike; libcuvisor does not count contexts yet,
        // so: a GPU whose contexts take no memory (common::single_without_context_memory).
        let machine = common::single_without_context_memory();
        let mut c = Child::new(test)
            .preset(&machine)
            .state(state)
            .env("ROLE", role);
        for (k, v) in env {
            c = c.env(k, v);
        }
        let mut cmd = c.command();
        cuvisor_env(&mut cmd, ledger, Some("1Gi"));
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Side {
            child,
            out,
            what: role,
        }
    }

    /// Waits for the line containing `marker`; returns it.
    fn expect(&mut self, marker: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.out.read_line(&mut line).unwrap();
            assert!(n > 0, "{} ended before saying {marker:?}", self.what);
            if line.contains(marker) {
                return line;
            }
        }
    }

    fn go(&mut self) {
        writeln!(self.child.stdin.as_mut().unwrap()).unwrap();
    }

    fn passed(mut self) {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.out, &mut rest).unwrap();
        assert!(
            self.child.wait().unwrap().success() && rest.contains("1 passed"),
            "{}: {rest}",
            self.what
        );
    }
}

/// Device memory the simulator shows in use (every process, every container).
fn physical(state: &Path) -> u64 {
    let model = cuvisor_sim::model::Model::load(&common::single_without_context_memory()).unwrap();
    cuvisor_sim::state::Shared::attach_at(&model, state)
        .unwrap()
        .device(0)
        .mem_used
        .load(std::sync::atomic::Ordering::SeqCst)
}

#[test]
fn a_vmm_handle_passed_as_an_fd_stays_charged_to_the_exporter_after_it_exits() {
    const NAME: &str = "a_vmm_handle_passed_as_an_fd_stays_charged_to_the_exporter_after_it_exits";
    if side() {
        return;
    }
    let state = state_file("fd-pass");
    let ledger = ledger_dir("fd-pass"); // one container: exporter, importer, probe
    let (a, b) = socket_pair();
    let (a, b) = (a.to_string(), b.to_string());
    let mut importer = Side::start(NAME, "vmm-importer", &state, &ledger, &[("SOCK", &b)]);
    let mut exporter = Side::start(NAME, "vmm-exporter", &state, &ledger, &[("SOCK", &a)]);
    exporter.expect("sent");
    importer.expect("imported");
    assert_eq!(ledger_used(&ledger), vec![SIZE], "charged once");
    exporter.go();
    exporter.passed();
    // The exporter is gone; the importer still maps the memory, which the driver keeps.
    assert_eq!(
        physical(&state),
        SIZE,
        "the memory lives on in the importer"
    );
    assert_eq!(
        ledger_used(&ledger),
        vec![SIZE],
        "still charged to the container that allocated it"
    );
    // So a new process of the container cannot take the whole quota again.
    let mut probe = Side::start(
        NAME,
        "probe",
        &state,
        &ledger,
        &[("LEFT", &(GIB - SIZE).to_string())],
    );
    probe.expect("probed");
    probe.passed();
    importer.go();
    importer.expect("released");
    assert_eq!(physical(&state), 0, "the last handle and mapping went");
    assert_eq!(
        ledger_used(&ledger),
        vec![0],
        "given back when the importer let go, while it still runs"
    );
    importer.go();
    importer.passed();
}

#[test]
fn an_ipc_import_in_the_same_container_keeps_the_charge_after_the_exporter_exits() {
    const NAME: &str =
        "an_ipc_import_in_the_same_container_keeps_the_charge_after_the_exporter_exits";
    if side() {
        return;
    }
    let state = state_file("ipc-same");
    let ledger = ledger_dir("ipc-same");
    let mut exporter = Side::start(NAME, "ipc-exporter", &state, &ledger, &[]);
    let hex = exporter.expect("handle ");
    let hex = hex.trim().rsplit("handle ").next().unwrap().to_string();
    let mut importer = Side::start(NAME, "ipc-importer", &state, &ledger, &[("HANDLE", &hex)]);
    importer.expect("opened");
    assert_eq!(ledger_used(&ledger), vec![SIZE], "charged once");
    exporter.go();
    exporter.passed();
    assert_eq!(physical(&state), SIZE, "still open in the importer");
    assert_eq!(ledger_used(&ledger), vec![SIZE], "and still charged");
    importer.go();
    importer.expect("closed once");
    assert_eq!(ledger_used(&ledger), vec![SIZE], "one reference is left");
    importer.go();
    importer.expect("closed");
    assert_eq!(physical(&state), 0);
    assert_eq!(
        ledger_used(&ledger),
        vec![0],
        "the last close gives it back"
    );
    importer.go();
    importer.passed();
}

#[test]
fn an_ipc_import_in_another_container_is_charged_to_no_one_but_the_exporter() {
    const NAME: &str = "an_ipc_import_in_another_container_is_charged_to_no_one_but_the_exporter";
    if side() {
        return;
    }
    let state = state_file("ipc-other");
    let (ours, theirs) = (ledger_dir("ipc-exporting"), ledger_dir("ipc-importing"));
    let mut exporter = Side::start(NAME, "ipc-exporter", &state, &ours, &[]);
    let hex = exporter.expect("handle ");
    let hex = hex.trim().rsplit("handle ").next().unwrap().to_string();
    let mut importer = Side::start(NAME, "ipc-importer", &state, &theirs, &[("HANDLE", &hex)]);
    importer.expect("opened");
    assert_eq!(ledger_used(&ours), vec![SIZE], "the exporter's container");
    assert_eq!(
        ledger_used(&theirs),
        vec![0],
        "the importer's is charged nothing"
    );
    importer.go();
    importer.expect("closed once");
    assert_eq!(
        ledger_used(&ours),
        vec![SIZE],
        "the importer's close neither doubles nor removes the exporter's charge"
    );
    assert_eq!(ledger_used(&theirs), vec![0]);
    // The exporter exits while the other container still has the memory open: the driver keeps
    // it until that close (not documented; reported of NVIDIA's driver, ROCm/hip#3580). What the
    // exporting container is charged from here on is the limit docs/threat-model.md states.
    exporter.go();
    exporter.passed();
    assert_eq!(physical(&state), SIZE, "still open in the other container");
    assert_eq!(
        ledger_used(&theirs),
        vec![0],
        "and still charged nothing there"
    );
    importer.go();
    importer.expect("closed");
    assert_eq!(physical(&state), 0, "the last close frees it");
    importer.go();
    importer.passed();
}
