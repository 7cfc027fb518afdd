//! Memory shared between processes: charged once, to the container that allocated it, for as
//! long as the driver keeps it alive.
//!
//! **What the driver documents.**
//! - VMM (cuMemCreate, cuMemExportToShareableHandle, cuMemImportFromShareableHandle): "The
//!   memory allocation will be freed when all outstanding mappings to the memory are unmapped and
//!   when all outstanding references to the handle (including it's shareable counterparts) are
//!   also released. [...] Each time a recipient process imports a shareable handle, it needs to
//!   pair it with cuMemRelease for the handle to be freed." (CUDA Driver API, cuMemRelease.) And
//!   of the exported handle itself: "Once all shareable handles are closed and the allocation is
//!   released, the allocated memory referenced will be released back to the OS" (cuda.h,
//!   cuMemExportToShareableHandle). So the memory lives while any process holds a handle to it,
//!   a mapping of it, or an open exported file descriptor (which travels by SCM_RIGHTS or
//!   pidfd_getfd: NCCL's cuMem transport, PyTorch's expandable segments, UCX).
//! - Legacy IPC (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle): the opened
//!   memory is the exporter's cuMemAlloc allocation. "Calling cuMemFree on an exported memory
//!   region before calling cuIpcCloseMemHandle in the importing context will result in undefined
//!   behavior" (cuIpcOpenMemHandle); cuIpcCloseMemHandle "decrements the reference count of the
//!   memory [...] When the reference count reaches 0, this API unmaps the memory. The original
//!   allocation in the exporting process as well as imported mappings in other processes will be
//!   unaffected." What happens when the exporter *exits* first is not documented; users report
//!   that on NVIDIA GPUs the memory is released at the importer's close (ROCm/hip#3580, which
//!   expects HIP to behave "as on NVIDIA"). PyTorch's CUDA IPC keeps the producer alive and its
//!   block cached until every consumer has let go, so that it never frees first.
//!
//! **What cuvisor does.** The charge of exported memory moves out of the exporting process's
//! slot into a *share* of its container's ledger (crates/shm `ledger`), which no process owns:
//! every process of the container that holds the memory holds the share (an open-file-
//! description lock, dropped by the kernel when the process dies however it dies), and the
//! charge goes back once nobody holds it.
//! - The exporter holds a VMM share until it exits: the exported descriptor may be anywhere
//!   (in flight in a socket, kept by a process that never imports it), and nothing tells when
//!   its last copy is closed.
//! - The exporter holds an IPC share until it frees the pointer (or exits): by the driver's
//!   contract every importer has closed it by then.
//! - An importer in the same container holds the share while it holds the import: a VMM import
//!   until its handle is released and its last mapping unmapped, an IPC import until its last
//!   cuIpcCloseMemHandle. It finds the share by a key both sides can compute: the file the
//!   exported descriptor is (device and inode), a fabric handle's bytes, the IPC handle's bytes.
//!   It holds the share *before* the driver imports, so that the last other holder letting go
//!   meanwhile cannot take the charge while the import lives. Memory exported under several
//!   keys (exported twice, re-exported by an importer) is then matched by every import of the
//!   container: erring toward counting.
//! - An importer in another container finds no share in its own ledger: it is charged nothing
//!   and holds nothing, so it can neither double the charge nor make it go (it has no access to
//!   the allocating container's ledger). What it cannot do either is keep the charge alive: once
//!   every holder in the allocating container is gone, memory that only another container still
//!   holds is counted nowhere (docs/memory.md, docs/threat-model.md).
//!
//! Only VMM and IPC calls come here (export, import, release, map, unmap, open, close), never
//! cuMemAlloc or launches; cuMemFree of a pointer pays one comparison (its recorded bytes are 0
//! once shared). A process-local mutex serialises these calls: the process has one lock per
//! share, so two threads must not take and drop it at once.
//!
//! No FFI here: [`Holds`] is the ledger (for the hook) or a model of it (for the tests below).

use std::collections::HashMap;
use std::sync::Mutex;

/// What the rules ask of the container's ledger, for this process.
pub trait Holds {
    /// Moves `bytes` this process holds on device entry `e` into a new share known by `key`,
    /// which this process then holds. None when the ledger has no room for one more.
    fn open(&self, e: usize, bytes: u64, key: u64) -> Option<usize>;
    /// Makes this process a holder of every live share known by `key`; returns them.
    fn hold(&self, key: u64) -> Vec<usize>;
    /// Share `share` was exported under `key` too.
    fn widen(&self, share: usize, key: u64);
    /// This process no longer holds `share` (the last holder's letting go gives it back).
    fn let_go(&self, share: usize);
}

/// How an import was made, for the table of imports (handle values and pointers may collide).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Via {
    /// A VMM handle from cuMemImportFromShareableHandle.
    Vmm,
    /// A pointer from cuIpcOpenMemHandle.
    Ipc,
}

#[derive(Default, Debug)]
struct State {
    /// VMM handles this process exported -> their share (held until the process exits).
    vmm_exports: HashMap<u64, usize>,
    /// Device pointers this process IPC-exported -> their share (held until freed).
    ipc_exports: HashMap<u64, usize>,
    /// Imports -> (times opened, the shares they hold).
    imports: HashMap<(Via, u64), (u32, Vec<usize>)>,
    /// Shares this process holds -> how many of the above hold them.
    refs: HashMap<usize, u32>,
}

#[derive(Default)]
pub struct Shared(Mutex<State>);

/// What `export` did with the exported memory's charge.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Exported {
    /// Moved into a share (or it was there already).
    Shared,
    /// The ledger had no room for a share: the charge stays with the process until it exits.
    Pinned,
    /// Nothing to move: memory this process was not charged for (an import re-exported, host
    /// memory, memory allocated before cuvisor was loaded).
    Uncharged,
}

impl State {
    fn take(&mut self, share: usize) {
        *self.refs.entry(share).or_insert(0) += 1;
    }

    fn drop_ref(&mut self, share: usize, h: &impl Holds) {
        if let Some(n) = self.refs.get_mut(&share) {
            *n -= 1;
            if *n == 0 {
                self.refs.remove(&share);
                h.let_go(share);
            }
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// VMM handle `handle` was exported under `key`; `charge` is what it was charged here, taken
    /// out of the handle table by the caller (None if it was not charged here, or already
    /// exported).
    pub fn export_vmm(
        &self,
        handle: u64,
        charge: Option<(usize, u64)>,
        key: u64,
        h: &impl Holds,
    ) -> Exported {
        let mut s = self.lock();
        if let Some(&share) = s.vmm_exports.get(&handle) {
            h.widen(share, key);
            return Exported::Shared;
        }
        if let Some((_, shares)) = s.imports.get(&(Via::Vmm, handle)) {
            for &share in shares {
                h.widen(share, key); // an importer passing it on
            }
            return Exported::Uncharged;
        }
        let Some((e, bytes)) = charge else {
            return Exported::Uncharged;
        };
        match h.open(e, bytes, key) {
            Some(share) => {
                s.vmm_exports.insert(handle, share);
                s.take(share);
                Exported::Shared
            }
            None => Exported::Pinned,
        }
    }

    /// Device pointer `ptr` was IPC-exported under `key`; `charge` as for `export_vmm` (None
    /// when it was exported before: then only the key is noted).
    pub fn export_ipc(
        &self,
        ptr: u64,
        charge: Option<(usize, u64)>,
        key: u64,
        h: &impl Holds,
    ) -> Exported {
        let mut s = self.lock();
        if let Some(&share) = s.ipc_exports.get(&ptr) {
            h.widen(share, key);
            return Exported::Shared;
        }
        let Some((e, bytes)) = charge else {
            return Exported::Uncharged;
        };
        match h.open(e, bytes, key) {
            Some(share) => {
                s.ipc_exports.insert(ptr, share);
                s.take(share);
                Exported::Shared
            }
            None => Exported::Pinned,
        }
    }

    /// The exporter freed IPC-exported pointer `ptr`: it no longer holds its share (importers
    /// of the container may still).
    pub fn freed(&self, ptr: u64, h: &impl Holds) {
        let mut s = self.lock();
        if let Some(share) = s.ipc_exports.remove(&ptr) {
            s.drop_ref(share, h);
        }
    }

    /// Before the driver imports memory known by `key`: hold the container's shares it may be.
    /// Pass the answer to [`Shared::imported`] (the import succeeded) or [`Shared::not_imported`].
    pub fn before_import(&self, key: u64, h: &impl Holds) -> Vec<usize> {
        let mut s = self.lock();
        let shares = h.hold(key);
        for &share in &shares {
            s.take(share);
        }
        shares
    }

    pub fn not_imported(&self, shares: Vec<usize>, h: &impl Holds) {
        let mut s = self.lock();
        for share in shares {
            s.drop_ref(share, h);
        }
    }

    /// The driver imported `obj` (a VMM handle, or an IPC pointer: opened again, the same
    /// pointer with one more reference).
    pub fn imported(&self, via: Via, obj: u64, shares: Vec<usize>, h: &impl Holds) {
        let mut s = self.lock();
        match s.imports.get_mut(&(via, obj)) {
            Some((n, _)) => {
                *n += 1;
                for share in shares {
                    s.drop_ref(share, h); // held once per import, not per open
                }
            }
            None => {
                s.imports.insert((via, obj), (1, shares));
            }
        }
    }

    pub fn is_import(&self, via: Via, obj: u64) -> bool {
        self.lock().imports.contains_key(&(via, obj))
    }

    /// One reference to import `obj` is gone (a VMM import released and unmapped, an IPC
    /// import closed); the last one lets its shares go.
    pub fn import_gone(&self, via: Via, obj: u64, h: &impl Holds) {
        let mut s = self.lock();
        let Some((n, _)) = s.imports.get_mut(&(via, obj)) else {
            return;
        };
        *n -= 1;
        if *n > 0 {
            return;
        }
        if let Some((_, shares)) = s.imports.remove(&(via, obj)) {
            for share in shares {
                s.drop_ref(share, h);
            }
        }
    }

    /// In a child made by fork(): the parent's holds are the parent's (its open file
    /// description holds the locks).
    pub fn forget(&self) {
        *self.lock() = State::default();
    }
}

/// The key of an exported file descriptor: the file it is (device, inode). Never 0.
pub fn file_key(dev: u64, ino: u64) -> u64 {
    mix(mix(0x5348_4152_4546_4431, dev), ino).max(1)
}

/// The key of a handle given as bytes (an IPC handle, a fabric handle). Never 0.
pub fn bytes_key(b: &[u8]) -> u64 {
    // FNV-1a: stable across processes and builds.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h = (h ^ x as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h.clamp(1, u64::MAX - 1)
}

fn mix(h: u64, v: u64) -> u64 {
    (h ^ v)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(29)
        .clamp(1, u64::MAX - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::{BTreeSet, HashMap};

    /// A model of one container's ledger with several processes: who holds which share, and
    /// the device's bytes in use (shares plus what processes hold in their slots).
    #[derive(Default)]
    struct Model {
        used: u64,
        slots: HashMap<u32, u64>,
        /// share -> (key, bytes, holders).
        shares: HashMap<usize, (u64, u64, BTreeSet<u32>)>,
        next: usize,
    }

    struct Proc<'a> {
        pid: u32,
        m: &'a RefCell<Model>,
        rules: Shared,
    }

    impl Holds for Proc<'_> {
        fn open(&self, _e: usize, bytes: u64, key: u64) -> Option<usize> {
            let mut m = self.m.borrow_mut();
            *m.slots.get_mut(&self.pid)? -= bytes;
            let i = m.next;
            m.next += 1;
            m.shares.insert(i, (key, bytes, BTreeSet::from([self.pid])));
            Some(i)
        }
        fn hold(&self, key: u64) -> Vec<usize> {
            let mut m = self.m.borrow_mut();
            let mut v: Vec<usize> = m
                .shares
                .iter_mut()
                .filter(|(_, (k, _, _))| *k == key || *k == u64::MAX)
                .map(|(i, (_, _, who))| {
                    who.insert(self.pid);
                    *i
                })
                .collect();
            v.sort();
            v
        }
        fn widen(&self, share: usize, key: u64) {
            let mut m = self.m.borrow_mut();
            if let Some((k, _, _)) = m.shares.get_mut(&share) {
                if *k != key {
                    *k = u64::MAX;
                }
            }
        }
        fn let_go(&self, share: usize) {
            let mut m = self.m.borrow_mut();
            if let Some((_, _, who)) = m.shares.get_mut(&share) {
                who.remove(&self.pid);
            }
            m.reclaim();
        }
    }

    impl Model {
        fn reclaim(&mut self) {
            let dead: Vec<usize> = self
                .shares
                .iter()
                .filter(|(_, (_, _, who))| who.is_empty())
                .map(|(i, _)| *i)
                .collect();
            for i in dead {
                let (_, b, _) = self.shares.remove(&i).unwrap();
                self.used -= b;
            }
        }
    }

    impl<'a> Proc<'a> {
        fn new(m: &'a RefCell<Model>, pid: u32) -> Self {
            m.borrow_mut().slots.insert(pid, 0);
            Proc {
                pid,
                m,
                rules: Shared::default(),
            }
        }
        fn alloc(&self, bytes: u64) {
            let mut m = self.m.borrow_mut();
            m.used += bytes;
            *m.slots.get_mut(&self.pid).unwrap() += bytes;
        }
        /// The process ends (however): its slot is drained, its holds dropped by the kernel.
        fn dies(self) {
            let mut m = self.m.borrow_mut();
            let held = m.slots.remove(&self.pid).unwrap();
            m.used -= held;
            for (_, _, who) in m.shares.values_mut() {
                who.remove(&self.pid);
            }
            m.reclaim();
        }
    }

    fn used(m: &RefCell<Model>) -> u64 {
        m.borrow().used
    }

    #[test]
    fn an_exported_vmm_allocation_outlives_its_exporter_while_an_importer_of_the_container_holds_it(
    ) {
        let m = RefCell::new(Model::default());
        let exporter = Proc::new(&m, 1);
        let importer = Proc::new(&m, 2);
        exporter.alloc(600);
        let key = file_key(0x1d, 4711);
        assert_eq!(
            exporter
                .rules
                .export_vmm(0xa, Some((0, 600)), key, &exporter),
            Exported::Shared
        );
        assert_eq!(
            m.borrow().slots[&1],
            0,
            "the charge left the exporter's slot"
        );
        let held = importer.rules.before_import(key, &importer);
        assert_eq!(held.len(), 1);
        importer.rules.imported(Via::Vmm, 0x77, held, &importer);
        exporter.dies();
        assert_eq!(used(&m), 600, "the importer keeps it alive: still charged");
        importer.rules.import_gone(Via::Vmm, 0x77, &importer);
        assert_eq!(used(&m), 0, "the last holder let go");
        importer.dies();
    }

    #[test]
    fn an_exported_vmm_allocation_stays_charged_until_its_exporter_exits() {
        let m = RefCell::new(Model::default());
        let exporter = Proc::new(&m, 1);
        exporter.alloc(300);
        let key = file_key(1, 2);
        exporter
            .rules
            .export_vmm(0xa, Some((0, 300)), key, &exporter);
        // Exported again: the same share, the same key.
        assert_eq!(
            exporter.rules.export_vmm(0xa, None, key, &exporter),
            Exported::Shared
        );
        assert_eq!(m.borrow().shares.len(), 1);
        assert_eq!(used(&m), 300, "the descriptor may be anywhere: charged");
        exporter.dies();
        assert_eq!(used(&m), 0);
    }

    #[test]
    fn an_ipc_export_is_held_until_freed_then_by_importers_until_their_last_close() {
        let m = RefCell::new(Model::default());
        let exporter = Proc::new(&m, 1);
        let importer = Proc::new(&m, 2);
        exporter.alloc(256);
        let key = bytes_key(&[7; 64]);
        exporter
            .rules
            .export_ipc(0x1000, Some((0, 256)), key, &exporter);
        // Opened twice (the driver hands back the same pointer with one more reference).
        for _ in 0..2 {
            let held = importer.rules.before_import(key, &importer);
            importer.rules.imported(Via::Ipc, 0x9000, held, &importer);
        }
        exporter.rules.freed(0x1000, &exporter);
        assert_eq!(
            used(&m),
            256,
            "freed while still open elsewhere: kept charged"
        );
        importer.rules.import_gone(Via::Ipc, 0x9000, &importer);
        assert_eq!(used(&m), 256, "one reference left");
        importer.rules.import_gone(Via::Ipc, 0x9000, &importer);
        assert_eq!(used(&m), 0);
        // Never imported: the free gives it back at once.
        exporter.alloc(64);
        exporter
            .rules
            .export_ipc(0x2000, Some((0, 64)), key ^ 1, &exporter);
        exporter.rules.freed(0x2000, &exporter);
        assert_eq!(used(&m), 0);
    }

    #[test]
    fn an_import_of_another_containers_memory_holds_and_charges_nothing() {
        let ours = RefCell::new(Model::default());
        let theirs = RefCell::new(Model::default());
        let exporter = Proc::new(&theirs, 1);
        let importer = Proc::new(&ours, 1);
        exporter.alloc(512);
        let key = bytes_key(&[3; 64]);
        exporter
            .rules
            .export_ipc(0x1000, Some((0, 512)), key, &exporter);
        let held = importer.rules.before_import(key, &importer);
        assert!(held.is_empty(), "no share of ours is that memory");
        importer.rules.imported(Via::Ipc, 0x5000, held, &importer);
        assert_eq!(
            used(&ours),
            0,
            "the importer's container is charged nothing"
        );
        importer.rules.import_gone(Via::Ipc, 0x5000, &importer);
        importer.dies();
        assert_eq!(
            used(&theirs),
            512,
            "and cannot make the exporter's charge go"
        );
        exporter.rules.freed(0x1000, &exporter);
        assert_eq!(used(&theirs), 0);
    }

    #[test]
    fn memory_exported_under_two_keys_is_held_by_any_import_of_the_container() {
        let m = RefCell::new(Model::default());
        let exporter = Proc::new(&m, 1);
        let importer = Proc::new(&m, 2);
        exporter.alloc(100);
        exporter
            .rules
            .export_vmm(0xa, Some((0, 100)), 11, &exporter);
        exporter.rules.export_vmm(0xa, None, 12, &exporter);
        let held = importer.rules.before_import(99, &importer);
        assert_eq!(held.len(), 1, "erring toward counting");
        importer.rules.imported(Via::Vmm, 0x5, held, &importer);
        exporter.dies();
        assert_eq!(used(&m), 100);
        importer.dies();
        assert_eq!(used(&m), 0, "a holder's death lets go as well");
    }

    #[test]
    fn a_failed_import_or_a_ledger_without_room_keeps_the_books_right() {
        let m = RefCell::new(Model::default());
        let exporter = Proc::new(&m, 1);
        let importer = Proc::new(&m, 2);
        exporter.alloc(100);
        exporter.rules.export_vmm(0xa, Some((0, 100)), 5, &exporter);
        let held = importer.rules.before_import(5, &importer);
        importer.rules.not_imported(held, &importer);
        assert!(!importer.rules.is_import(Via::Vmm, 0));
        assert_eq!(
            m.borrow().shares[&0].2,
            BTreeSet::from([1]),
            "only the exporter"
        );
        exporter.dies();
        assert_eq!(used(&m), 0);
        // A re-export by an importer moves nothing (it was charged nothing).
        let (a, b) = (Proc::new(&m, 3), Proc::new(&m, 4));
        a.alloc(10);
        a.rules.export_vmm(1, Some((0, 10)), 20, &a);
        let held = b.rules.before_import(20, &b);
        b.rules.imported(Via::Vmm, 9, held, &b);
        assert_eq!(b.rules.export_vmm(9, None, 21, &b), Exported::Uncharged);
        assert_eq!(
            m.borrow().shares[&1].0,
            u64::MAX,
            "now any import may be it"
        );
    }

    #[test]
    fn keys_are_stable_and_never_the_reserved_values() {
        assert_eq!(bytes_key(&[1, 2, 3]), bytes_key(&[1, 2, 3]));
        assert_ne!(bytes_key(&[1, 2, 3]), bytes_key(&[1, 2, 4]));
        assert_ne!(file_key(1, 2), file_key(1, 3));
        for k in [bytes_key(&[]), file_key(0, 0)] {
            assert!(k != 0 && k != u64::MAX);
        }
    }
}
