//! The GPU coordinator: how the containers of one physical GPU share its time, with no
//! container able to write anything another one reads as its own.
//!
//! One directory per GPU, `<coord dir>/gpu-<UUID hex>/`, holds:
//! - `board`: who is on the GPU and with what policy. Entry `i` names a container and its
//!   policy (a cap or a weight). Under the device plugin the plugin alone writes it
//!   ([`BoardWriter`]) and containers see the directory through a read-only mount, so no
//!   container can list a tenant, change a policy (its own or another's), take entries or
//!   break the file. Without the plugin (`cuvisor run`, the environment alone), processes claim
//!   entries themselves under the board's flock ([`Coordinator::join_self`]): tenants of one user
//!   who trust each other.
//! - `slot-NN-<container hex>`: entry `NN`'s dynamic state ([`State`]: token bucket, last launch, GPU time
//!   used, when it was last held back, the end of its queued work). Only its own container
//!   writes it and only its own processes map it; under the plugin it reaches the container
//!   through a read-write mount of that one file, while every other container sees it read-only.
//!
//! Every process reads the board and the other entries' states by `pread` into a copy (a few
//! hundred bytes each, at each rate computation: every 10 ms, by the launch that finds it due;
//! see `src/timeslice`), so a
//! file another container truncates, rewrites or replaces can make nothing fault, and what it
//! says is a claim: a state that does not read back whole, with the right magic, index and
//! container, counts as a tenant that wants all its policy allows (see [`Peer`]). A lie in a
//! state can gain a container at most what its board policy allows, never less for the others.
//!
//! Self-service entries are given back when no process of theirs holds the state file's lease
//! (see `lease`) and they have not launched for [`STALE_NS`]; plugin entries when the plugin
//! removes the allocation.
//!
//! The layouts are mirrored in `include/cuvisor.h`; bump [`COORD_VERSION`] on any change.

use crate::lease;
use crate::mapped::{self, Access, Flock, Mapped};
use std::fs::File;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::*};
use std::sync::Mutex;

/// "CUVBORD2"
pub const BOARD_MAGIC: u64 = u64::from_le_bytes(*b"CUVBORD2");
/// "CUVSTAT2"
pub const STATE_MAGIC: u64 = u64::from_le_bytes(*b"CUVSTAT2");
pub const COORD_VERSION: u32 = 2;
/// Entries per GPU.
pub const MAX_SLOTS: usize = 64;

/// Policies: a cap in parts per million of GPU time, never exceeded even when the GPU is idle.
pub const POLICY_LIMIT: u32 = 1;
/// A weight (in thousandths): a share of the GPU among active containers, idle time lent.
pub const POLICY_SHARE: u32 = 2;
/// The largest weight an entry may carry (thousandths; 10^6 as a policy's weight).
pub const MAX_WEIGHT: u64 = 1_000_000_000;

/// A self-service entry unused this long whose state no live process holds is given back (ns).
pub const STALE_NS: u64 = 2_000_000_000;

/// `board`'s header: 64 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BoardHeader {
    pub magic: u64,
    pub version: u32,
    /// sizeof(Board).
    pub size: u32,
    pub max_slots: u32,
    /// 1: written by the device plugin alone; 0: self-service.
    pub managed: u32,
    /// The GPU's UUID.
    pub uuid: [u8; 16],
    pub _reserved: [u64; 3],
}

/// One entry of the board: 32 bytes. All zero: free.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// The container (non-zero).
    pub container: u64,
    /// POLICY_LIMIT or POLICY_SHARE.
    pub policy: u32,
    /// The entry's own position (a check).
    pub index: u32,
    /// POLICY_LIMIT: the cap in ppm of GPU time (1..=10^6); POLICY_SHARE: the weight in
    /// thousandths (1..=[`MAX_WEIGHT`]).
    pub param: u64,
    /// [`Entry::seal`] of the other fields: an entry read while it was being written fails it.
    pub check: u64,
}

/// The board file.
#[repr(C)]
pub struct Board {
    pub header: BoardHeader,
    pub entries: [Entry; MAX_SLOTS],
}

/// An entry's dynamic state (`slot-NN`), mapped by its own container's processes only.
#[repr(C)]
pub struct State {
    pub magic: AtomicU64,
    pub version: u32,
    /// sizeof(State).
    pub size: u32,
    /// The board entry this state belongs to.
    pub index: u32,
    pub _pad: u32,
    /// The entry's container.
    pub container: AtomicU64,
    /// The refill rate last computed (ppm of GPU time; for monitors).
    pub grant_ppm: AtomicU64,
    /// The token bucket: GPU-time ns the container may still launch (negative: in debt).
    pub tokens: AtomicI64,
    /// CLOCK_MONOTONIC ns up to which the bucket has been refilled.
    pub refill_at: AtomicU64,
    /// CLOCK_MONOTONIC ns of the container's last launch on this GPU.
    pub last_active: AtomicU64,
    /// CLOCK_MONOTONIC ns at which a launching thread of the container last had to wait.
    pub throttled_at: AtomicU64,
    /// GPU time the container has used on this GPU (ns, estimates corrected by measurement).
    pub consumed_ns: AtomicU64,
    /// Time its threads slept waiting for tokens (ns).
    pub throttled_ns: AtomicU64,
    /// CLOCK_MONOTONIC ns at which the container's launched work should end, by its model of
    /// the GPU queue.
    pub queued_until: AtomicU64,
    pub _reserved: [u64; 6],
}

// SAFETY: atomics and integers only; zero bytes are a file not yet initialised.
unsafe impl mapped::Layout for State {
    const MAGIC: u64 = STATE_MAGIC;
    const WHAT: &'static str = "coordinator slot";
    fn magic(&self) -> &AtomicU64 {
        &self.magic
    }
}

const HEADER_LEN: usize = std::mem::size_of::<BoardHeader>();
const ENTRY_LEN: usize = std::mem::size_of::<Entry>();
/// sizeof(Board).
const BOARD_LEN: usize = std::mem::size_of::<Board>();
/// sizeof(State).
const STATE_LEN: usize = std::mem::size_of::<State>();

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default())
}

impl BoardHeader {
    fn new(uuid: [u8; 16], managed: bool) -> BoardHeader {
        BoardHeader {
            magic: BOARD_MAGIC,
            version: COORD_VERSION,
            size: BOARD_LEN as u32,
            max_slots: MAX_SLOTS as u32,
            managed: u32::from(managed),
            uuid,
            _reserved: [0; 3],
        }
    }
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.magic.to_le_bytes());
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.size.to_le_bytes());
        b[16..20].copy_from_slice(&self.max_slots.to_le_bytes());
        b[20..24].copy_from_slice(&self.managed.to_le_bytes());
        b[24..40].copy_from_slice(&self.uuid);
        b
    }
    fn decode(b: &[u8]) -> BoardHeader {
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[24..40]);
        BoardHeader {
            magic: u64_at(b, 0),
            version: u32_at(b, 8),
            size: u32_at(b, 12),
            max_slots: u32_at(b, 16),
            managed: u32_at(b, 20),
            uuid,
            _reserved: [0; 3],
        }
    }
    /// Why this is not the board of GPU `uuid` of this version, if it is not.
    fn judge(&self, uuid: [u8; 16]) -> Result<(), String> {
        if self.magic != BOARD_MAGIC {
            return Err("not a cuvisor coordinator board".into());
        }
        if self.version != COORD_VERSION
            || self.size as usize != BOARD_LEN
            || self.max_slots as usize != MAX_SLOTS
        {
            return Err(format!(
                "a board of another version ({}), expected {COORD_VERSION}",
                self.version
            ));
        }
        if self.uuid != uuid {
            return Err("another GPU's board".into());
        }
        Ok(())
    }
}

impl Entry {
    /// A sealed entry at `index`.
    pub fn new(index: usize, container: u64, policy: u32, param: u64) -> Entry {
        let mut e = Entry {
            container,
            policy,
            index: index as u32,
            param,
            check: 0,
        };
        e.check = e.seal();
        e
    }
    /// A mix of the fields (never 0), so that a torn or hand-edited entry reads as invalid.
    pub fn seal(&self) -> u64 {
        let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
        for v in [
            self.container,
            u64::from(self.policy) << 32 | u64::from(self.index),
            self.param,
        ] {
            h = (h ^ v).wrapping_mul(0xff51_afd7_ed55_8ccd);
            h ^= h >> 33;
        }
        h | 1
    }
    fn encode(&self) -> [u8; ENTRY_LEN] {
        let mut b = [0u8; ENTRY_LEN];
        b[0..8].copy_from_slice(&self.container.to_le_bytes());
        b[8..12].copy_from_slice(&self.policy.to_le_bytes());
        b[12..16].copy_from_slice(&self.index.to_le_bytes());
        b[16..24].copy_from_slice(&self.param.to_le_bytes());
        b[24..32].copy_from_slice(&self.check.to_le_bytes());
        b
    }
    fn decode(b: &[u8]) -> Entry {
        Entry {
            container: u64_at(b, 0),
            policy: u32_at(b, 8),
            index: u32_at(b, 12),
            param: u64_at(b, 16),
            check: u64_at(b, 24),
        }
    }
    /// Whether this is a whole, sealed, well-formed entry at position `i`.
    pub fn valid_at(&self, i: usize) -> bool {
        self.container != 0
            && self.index as usize == i
            && self.check == self.seal()
            && match self.policy {
                POLICY_LIMIT => (1..=1_000_000).contains(&self.param),
                POLICY_SHARE => (1..=MAX_WEIGHT).contains(&self.param),
                _ => false,
            }
    }
}

/// `gpu-<32 hex digits>`: the coordinator directory of a GPU.
pub fn dir_name(uuid: [u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("gpu-{hex}")
}

/// The board's name in a GPU's directory.
pub const BOARD: &str = "board";

/// `slot-NN-<container hex>`: the state file of container `container` as entry `i` in a GPU's
/// directory. The container is in the name so that a path handed out once (a mount kubelet
/// keeps for a container it restarts) never names another container's state later.
pub fn state_name(i: usize, container: u64) -> String {
    format!("slot-{i:02}-{container:016x}")
}

/// Moves aside a file of an older cuvisor (v1's coordinator was a file where v2's directory
/// goes): processes still mapping it keep it, and the directory can be made.
fn move_v1_aside(dir: &Path) {
    if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_file()) {
        let _ = std::fs::rename(dir, dir.with_extension("v1"));
    }
}

/// Reads a whole board from `file` into a copy: the header and every entry as they read.
fn read_board(file: &File) -> std::io::Result<(BoardHeader, [Entry; MAX_SLOTS])> {
    let mut b = vec![0u8; BOARD_LEN];
    let n = mapped::read_head(file, &mut b)?;
    if n != BOARD_LEN {
        return Err(std::io::Error::other(format!(
            "{n} bytes, expected {BOARD_LEN}"
        )));
    }
    let header = BoardHeader::decode(&b[..HEADER_LEN]);
    let entries = std::array::from_fn(|i| {
        let at = HEADER_LEN + i * ENTRY_LEN;
        Entry::decode(&b[at..at + ENTRY_LEN])
    });
    Ok((header, entries))
}

fn write_entry(file: &File, i: usize, e: &Entry) -> std::io::Result<()> {
    file.write_all_at(&e.encode(), (HEADER_LEN + i * ENTRY_LEN) as u64)
}

/// What a process knows of another entry's state: a copy read a moment ago.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateCopy {
    pub last_active: u64,
    pub throttled_at: u64,
    pub consumed_ns: u64,
    pub queued_until: u64,
    pub grant_ppm: u64,
}

/// Another entry of the GPU as a process sees it at a rate computation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub index: usize,
    /// Its board entry (valid).
    pub entry: Entry,
    /// Its state, or None where it does not read back whole and its own (truncated, replaced,
    /// another version, another container's): then it counts as active and wanting, which
    /// gives it what its policy allows and the others what theirs guarantees.
    pub state: Option<StateCopy>,
}

/// Reads entry `i`'s state from `file`, checked against the board entry.
fn read_state(file: &File, i: usize, entry: &Entry) -> Option<StateCopy> {
    let mut b = [0u8; STATE_LEN];
    if mapped::read_head(file, &mut b).ok()? != STATE_LEN {
        return None;
    }
    use std::mem::offset_of;
    let at = |off: usize| u64_at(&b, off);
    let ok = at(offset_of!(State, magic)) == STATE_MAGIC
        && u32_at(&b, offset_of!(State, version)) == COORD_VERSION
        && u32_at(&b, offset_of!(State, size)) as usize == STATE_LEN
        && u32_at(&b, offset_of!(State, index)) as usize == i
        && at(offset_of!(State, container)) == entry.container;
    ok.then(|| StateCopy {
        last_active: at(offset_of!(State, last_active)),
        throttled_at: at(offset_of!(State, throttled_at)),
        consumed_ns: at(offset_of!(State, consumed_ns)),
        queued_until: at(offset_of!(State, queued_until)),
        grant_ppm: at(offset_of!(State, grant_ppm)),
    })
}

/// The bytes of a new state file for entry `i` of `container` (what the plugin writes).
pub fn new_state_bytes(i: usize, container: u64) -> [u8; STATE_LEN] {
    use std::mem::offset_of;
    let mut b = [0u8; STATE_LEN];
    b[offset_of!(State, magic)..][..8].copy_from_slice(&STATE_MAGIC.to_le_bytes());
    b[offset_of!(State, version)..][..4].copy_from_slice(&COORD_VERSION.to_le_bytes());
    b[offset_of!(State, size)..][..4].copy_from_slice(&(STATE_LEN as u32).to_le_bytes());
    b[offset_of!(State, index)..][..4].copy_from_slice(&(i as u32).to_le_bytes());
    b[offset_of!(State, container)..][..8].copy_from_slice(&container.to_le_bytes());
    b
}

/// Files of the other entries, kept open between rate computations; one that did not read
/// back is not opened again before `retry_at` (so a state kept unreadable costs nothing).
struct PeerFiles {
    files: [Option<(u64, File)>; MAX_SLOTS],
    retry_at: [u64; MAX_SLOTS],
}

/// How long an unreadable state is left alone before it is opened again.
const RETRY_NS: u64 = 1_000_000_000;

/// A process's view of one GPU's coordinator: its own entry and state, the others by copy.
pub struct Coordinator {
    dir: PathBuf,
    board: File,
    index: usize,
    entry: Entry,
    own: Mapped<State>,
    peers: Mutex<PeerFiles>,
}

/// How [`Coordinator::open_state`] checks a state file.
fn state_check(i: usize, container: u64) -> impl FnOnce(&State) -> Result<(), String> {
    move |s: &State| {
        if s.version != COORD_VERSION || s.size as usize != STATE_LEN {
            Err(format!(
                "another version ({}), expected {COORD_VERSION}",
                s.version
            ))
        } else if s.index as usize != i || s.container.load(Acquire) != container {
            Err(format!("not entry {i}'s state"))
        } else {
            Ok(())
        }
    }
}

impl Coordinator {
    /// Joins the GPU `uuid` whose directory `<coord_dir>/gpu-<hex>` the device plugin manages,
    /// as entry `index`, the container's own state mapped from `own` (the read-write mount of
    /// its `slot-NN`). The policy is the board's.
    pub fn join_managed(
        coord_dir: &Path,
        uuid: [u8; 16],
        index: usize,
        own: &Path,
    ) -> Result<Coordinator, String> {
        let dir = coord_dir.join(dir_name(uuid));
        let what = |e: &dyn std::fmt::Display| format!("coordinator {}: {e}", dir.display());
        if index >= MAX_SLOTS {
            return Err(what(&format!("entry {index} is out of range")));
        }
        let board = mapped::open_beneath(&dir, BOARD).map_err(|e| what(&e))?;
        let (header, entries) = read_board(&board).map_err(|e| what(&e))?;
        header.judge(uuid).map_err(|e| what(&e))?;
        if header.managed != 1 {
            return Err(what(&"not managed by the device plugin"));
        }
        let entry = entries[index];
        if !entry.valid_at(index) {
            return Err(what(&format!("entry {index} is not assigned")));
        }
        // The plugin made it whole; others can open (and lock) it, so no lock is waited for.
        let own = mapped::open_existing::<State>(own, state_check(index, entry.container))?;
        Ok(Coordinator::new(dir, board, index, entry, own))
    }

    /// Joins GPU `uuid`'s coordinator in `coord_dir` without a device plugin: finds container
    /// `container`'s entry or claims one (`policy`, `param`) under the board's flock, giving
    /// back a stale one if none is free. A container that has an entry keeps its policy; a lower
    /// cap tightens it.
    ///
    /// What is made here, and what is accepted as found, is `access`'s (see [`Access`]): the
    /// caller's alone (0700, 0600: the environment alone configures cuvisor), a group's where a
    /// setting names one (2770, 0660: the users of that group share the GPU's time), or every
    /// uid's (1777, 0666: under a limits file, a container of several uids). A symbolic link in
    /// place of either directory is refused.
    pub fn join_self(
        coord_dir: &Path,
        uuid: [u8; 16],
        container: u64,
        policy: u32,
        param: u64,
        access: Access,
        now: u64,
    ) -> Result<Coordinator, String> {
        let dir = coord_dir.join(dir_name(uuid));
        let what = |e: &dyn std::fmt::Display| format!("coordinator {}: {e}", dir.display());
        move_v1_aside(&dir);
        mapped::open_dir(coord_dir, access, true).map_err(|e| format!("coordinator {e}"))?;
        let dirf = mapped::open_dir(&dir, access, true).map_err(|e| format!("coordinator {e}"))?;
        let board = mapped::open_in(&dirf, BOARD, access, true).map_err(|e| what(&e))?;
        let lock = Flock::exclusive(&board, mapped::LOCK_WAIT).map_err(|e| what(&e))?;
        if board.metadata().map_err(|e| what(&e))?.len() == 0 {
            board.set_len(BOARD_LEN as u64).map_err(|e| what(&e))?;
            board
                .write_all_at(&BoardHeader::new(uuid, false).encode(), 0)
                .map_err(|e| what(&e))?;
        }
        let (header, entries) = read_board(&board).map_err(|e| what(&e))?;
        header.judge(uuid).map_err(|e| what(&e))?;
        if header.managed != 0 {
            return Err(what(
                &"managed by the device plugin: it is joined through the plugin's limits file",
            ));
        }
        let mine =
            (0..MAX_SLOTS).find(|&i| entries[i].valid_at(i) && entries[i].container == container);
        // An entry of ours whose state no live process holds is claimed afresh, with the
        // policy asked now (a later run of the container may ask another).
        let live = mine.filter(|&i| Self::held(&dir, i, &entries[i]));
        let (index, entry, own) = match live {
            Some(i) => {
                let own = mapped::open_existing::<State>(
                    &dir.join(state_name(i, container)),
                    state_check(i, container),
                )?;
                let mut e = entries[i];
                if policy == POLICY_LIMIT && e.policy == POLICY_LIMIT && param < e.param {
                    e = Entry::new(i, container, policy, param);
                    write_entry(&board, i, &e).map_err(|err| what(&err))?;
                }
                (i, e, own)
            }
            None => {
                let i = mine
                    .or_else(|| (0..MAX_SLOTS).find(|&i| !entries[i].valid_at(i)))
                    .or_else(|| (0..MAX_SLOTS).find(|&i| Self::stale(&dir, i, &entries[i], now)))
                    .ok_or_else(|| what(&format!("all {MAX_SLOTS} entries are in use")))?;
                // The state first, the entry last: a failure leaves the board as it was.
                let own = Self::new_state(&dir, &dirf, access, i, container, now)?;
                let e = Entry::new(i, container, policy, param);
                write_entry(&board, i, &e).map_err(|err| what(&err))?;
                let old = entries[i];
                if old.valid_at(i) && old.container != container {
                    let _ = std::fs::remove_file(dir.join(state_name(i, old.container)));
                }
                (i, e, own)
            }
        };
        // Every process of the container holds a shared lease on its state (a forked child
        // shares its parent's description, and so the lease).
        let _ = lease::try_hold(own.file(), 0, true);
        drop(lock);
        Ok(Coordinator::new(dir, board, index, entry, own))
    }

    fn new(dir: PathBuf, board: File, index: usize, entry: Entry, own: Mapped<State>) -> Self {
        Coordinator {
            dir,
            board,
            index,
            entry,
            own,
            peers: Mutex::new(PeerFiles {
                files: std::array::from_fn(|_| None),
                retry_at: [0; MAX_SLOTS],
            }),
        }
    }

    /// A new state for container `container` as entry `i` in `dir` (self-service), replacing
    /// any file by its name.
    fn new_state(
        dir: &Path,
        dirf: &File,
        access: Access,
        i: usize,
        container: u64,
        now: u64,
    ) -> Result<Mapped<State>, String> {
        let name = state_name(i, container);
        let path = dir.join(&name);
        let _ = std::fs::remove_file(&path);
        let file = mapped::open_in(dirf, &name, access, true)
            .map_err(|e| format!("coordinator state {}: open: {e}", path.display()))?;
        mapped::open_file::<State>(
            file,
            &path,
            mapped::Open {
                create: true,
                mode: access.file_mode(),
            },
            |s| {
                // SAFETY: a new file, its flock held, the magic unset: no reader trusts it yet.
                unsafe {
                    (*s).version = COORD_VERSION;
                    (*s).size = STATE_LEN as u32;
                    (*s).index = i as u32;
                    (*s).container.store(container, Relaxed);
                    (*s).refill_at.store(now, Relaxed);
                    (*s).last_active.store(now, Relaxed);
                }
            },
            state_check(i, container),
        )
    }

    /// Whether a live process holds the lease of entry `e`'s state (self-service).
    fn held(dir: &Path, i: usize, e: &Entry) -> bool {
        mapped::open_beneath(dir, &state_name(i, e.container))
            .is_ok_and(|f| lease::held(&f, 0, 1).unwrap_or(true))
    }

    /// Whether self-service entry `i` may be given back: no process holds its state's lease and
    /// it has not launched for [`STALE_NS`] (or its state does not read back).
    fn stale(dir: &Path, i: usize, e: &Entry, now: u64) -> bool {
        let Ok(f) = mapped::open_beneath(dir, &state_name(i, e.container)) else {
            return true;
        };
        if lease::held(&f, 0, 1).unwrap_or(true) {
            return false;
        }
        read_state(&f, i, e).is_none_or(|s| now.saturating_sub(s.last_active) >= STALE_NS)
    }

    /// The GPU's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// This container's entry (its position and policy).
    pub fn index(&self) -> usize {
        self.index
    }
    pub fn entry(&self) -> &Entry {
        &self.entry
    }
    /// This container's state, mapped.
    pub fn own(&self) -> &State {
        &self.own
    }

    /// Reads every other valid entry of the board and its state into `out` (at `now`); returns
    /// how many. Also answers whether this container's own entry still stands (false: the
    /// board no longer lists it: the plugin took it off). An unreadable board leaves `out`
    /// empty and keeps the entry.
    pub fn peers(&self, now: u64, out: &mut [Peer; MAX_SLOTS]) -> (usize, bool) {
        let Ok((header, entries)) = read_board(&self.board) else {
            return (0, true);
        };
        if header.magic != BOARD_MAGIC {
            return (0, true);
        }
        let still_mine = entries[self.index] == self.entry;
        let mut files = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        for (i, e) in entries.iter().enumerate() {
            if i == self.index || !e.valid_at(i) {
                files.files[i] = None;
                continue;
            }
            let cached = files.files[i].take().filter(|(c, _)| *c == e.container);
            let file = cached.map(|(_, f)| f).or_else(|| {
                (now >= files.retry_at[i])
                    .then(|| mapped::open_beneath(&self.dir, &state_name(i, e.container)).ok())
                    .flatten()
            });
            let state = file.as_ref().and_then(|f| read_state(f, i, e));
            // A file that does not read back is opened again later (it may be replaced).
            if state.is_some() {
                files.files[i] = file.map(|f| (e.container, f));
            } else if file.is_some() || now >= files.retry_at[i] {
                files.retry_at[i] = now + RETRY_NS;
            }
            out[n] = Peer {
                index: i,
                entry: *e,
                state,
            };
            n += 1;
        }
        (n, still_mine)
    }
}

/// The device plugin's side: it alone writes a managed board, and creates and removes the
/// entries' state files.
pub struct BoardWriter {
    dir: PathBuf,
    file: File,
}

impl BoardWriter {
    /// Opens (creating) the managed board of GPU `uuid` under `coord_dir` (a directory only the
    /// plugin writes). A board in its place that is not a managed board of this GPU and version
    /// is started afresh (its entries belonged to allocations the plugin no longer knows).
    pub fn open(coord_dir: &Path, uuid: [u8; 16]) -> Result<BoardWriter, String> {
        let dir = coord_dir.join(dir_name(uuid));
        let what = |e: &dyn std::fmt::Display| format!("coordinator {}: {e}", dir.display());
        move_v1_aside(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| what(&e))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| what(&e))?;
        let path = dir.join(BOARD);
        let file = mapped::open_regular(&path, true, Some(0o644)).map_err(|e| what(&e))?;
        let fresh = match read_board(&file) {
            Ok((h, _)) => h.judge(uuid).is_err() || h.managed != 1,
            Err(_) => true,
        };
        if fresh {
            file.set_len(0).map_err(|e| what(&e))?;
            file.set_len(BOARD_LEN as u64).map_err(|e| what(&e))?;
            file.write_all_at(&BoardHeader::new(uuid, true).encode(), 0)
                .map_err(|e| what(&e))?;
        }
        Ok(BoardWriter { dir, file })
    }

    /// The GPU's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The valid entries: (index, entry).
    pub fn entries(&self) -> Result<Vec<(usize, Entry)>, String> {
        let (_, entries) =
            read_board(&self.file).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        Ok(entries
            .into_iter()
            .enumerate()
            .filter(|(i, e)| e.valid_at(*i))
            .collect())
    }

    /// Lists `container` with `policy`/`param` in a free entry, with a new state file
    /// ([`state_name`], mode 0666: which container may write it is decided by the mounts) whose
    /// path is returned with the index.
    pub fn assign(
        &self,
        container: u64,
        policy: u32,
        param: u64,
    ) -> Result<(usize, PathBuf), String> {
        let taken = self.entries()?;
        let i = (0..MAX_SLOTS)
            .find(|i| taken.iter().all(|(t, _)| t != i))
            .ok_or_else(|| {
                format!(
                    "{}: all {MAX_SLOTS} coordinator entries are in use",
                    self.dir.display()
                )
            })?;
        let e = Entry::new(i, container, policy, param);
        if !e.valid_at(i) {
            return Err(format!(
                "policy {policy} with parameter {param} is not a valid coordinator entry"
            ));
        }
        // A new inode, in place at once: a container that still maps an old one keeps it.
        let path = self.dir.join(state_name(i, container));
        let tmp = self.dir.join(format!(".{}.tmp", state_name(i, container)));
        let io = |e: std::io::Error| format!("{}: {e}", tmp.display());
        std::fs::write(&tmp, new_state_bytes(i, container)).map_err(io)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o666)).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        write_entry(&self.file, i, &e).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        Ok((i, path))
    }

    /// Takes `container` off entry `i` (if it is there) and removes the state file.
    pub fn release(&self, i: usize, container: u64) -> Result<(), String> {
        if i >= MAX_SLOTS {
            return Ok(());
        }
        let listed = self
            .entries()?
            .into_iter()
            .any(|(t, e)| t == i && e.container == container);
        if listed {
            write_entry(&self.file, i, &Entry::default())
                .map_err(|e| format!("{}: {e}", self.dir.display()))?;
            let _ = std::fs::remove_file(self.dir.join(state_name(i, container)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cuvisor-coord-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    const GPU: [u8; 16] = [7; 16];

    fn peers(c: &Coordinator) -> Vec<Peer> {
        let mut out = [Peer {
            index: 0,
            entry: Entry::default(),
            state: None,
        }; MAX_SLOTS];
        let (n, _) = c.peers(1, &mut out);
        out[..n].to_vec()
    }

    #[test]
    fn entries_are_sealed_and_checked() {
        let e = Entry::new(3, 42, POLICY_LIMIT, 300_000);
        assert!(e.valid_at(3));
        assert!(!e.valid_at(4), "at another position");
        assert_eq!(Entry::decode(&e.encode()), e);
        for bad in [
            Entry {
                param: 999_999,
                ..e
            },
            Entry { container: 43, ..e },
            Entry {
                policy: POLICY_SHARE,
                ..e
            },
            Entry::new(3, 42, POLICY_LIMIT, 2_000_000),
            Entry::new(3, 42, 9, 1),
            Entry::new(3, 0, POLICY_SHARE, 1),
            Entry::default(),
        ] {
            assert!(!bad.valid_at(3), "{bad:?}");
        }
    }

    #[test]
    fn self_service_one_entry_per_container_and_caps_only_tighten() {
        let dir = temp("self");
        let a = Coordinator::join_self(&dir, GPU, 11, POLICY_LIMIT, 300_000, Access::Private, 5)
            .unwrap();
        let b =
            Coordinator::join_self(&dir, GPU, 22, POLICY_SHARE, 2_000, Access::Private, 5).unwrap();
        assert_ne!(a.index(), b.index());
        let again =
            Coordinator::join_self(&dir, GPU, 11, POLICY_LIMIT, 500_000, Access::Private, 6)
                .unwrap();
        assert_eq!(again.index(), a.index());
        assert_eq!(
            again.entry().param,
            300_000,
            "a higher cap does not raise it"
        );
        let lower =
            Coordinator::join_self(&dir, GPU, 11, POLICY_LIMIT, 100_000, Access::Private, 6)
                .unwrap();
        assert_eq!(lower.entry().param, 100_000);
        // The processes of one container share one state.
        a.own().consumed_ns.store(77, Relaxed);
        assert_eq!(lower.own().consumed_ns.load(Relaxed), 77);
        let seen = peers(&b);
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].entry.container, 11);
        assert_eq!(seen[0].entry.param, 100_000);
        assert_eq!(seen[0].state.unwrap().consumed_ns, 77);
        assert!(
            Coordinator::join_self(&dir, [8; 16], 11, POLICY_SHARE, 1, Access::Private, 5).is_ok()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_dead_self_service_entry_is_given_back_once_stale() {
        let dir = temp("stale");
        let gone = Coordinator::join_self(&dir, GPU, 33, POLICY_SHARE, 1_000, Access::Private, 10)
            .unwrap();
        let i = gone.index();
        drop(gone);
        // Every other entry taken by a live container.
        let live: Vec<_> = (0..MAX_SLOTS as u64 - 1)
            .map(|c| {
                Coordinator::join_self(&dir, GPU, 100 + c, POLICY_SHARE, 1, Access::Private, 10)
                    .unwrap()
            })
            .collect();
        assert!(live.iter().all(|c| c.index() != i));
        let not_yet = Coordinator::join_self(
            &dir,
            GPU,
            999,
            POLICY_SHARE,
            1,
            Access::Private,
            10 + STALE_NS / 2,
        );
        assert!(not_yet.err().unwrap().contains("all 64 entries are in use"));
        let (mut t, start) = (10 + STALE_NS, std::time::Instant::now());
        // (A thread forking elsewhere in this binary can hold the closed lease an instant.)
        let took = loop {
            match Coordinator::join_self(&dir, GPU, 999, POLICY_SHARE, 1, Access::Private, t) {
                Ok(c) => break c,
                Err(e) => assert!(start.elapsed().as_secs() < 2, "{e}"),
            }
            t += 1;
        };
        assert_eq!(took.index(), i, "the dead one's entry, never a live one's");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_rerun_of_a_dead_container_claims_its_entry_afresh_with_its_new_policy() {
        let dir = temp("rerun");
        let first =
            Coordinator::join_self(&dir, GPU, 11, POLICY_LIMIT, 100_000, Access::Private, 5)
                .unwrap();
        let i = first.index();
        first.own().consumed_ns.store(5, Relaxed);
        drop(first);
        let start = std::time::Instant::now();
        let again = loop {
            let c = Coordinator::join_self(&dir, GPU, 11, POLICY_SHARE, 3_000, Access::Private, 6)
                .unwrap();
            if c.entry().policy == POLICY_SHARE || start.elapsed().as_secs() >= 2 {
                break c;
            }
        };
        assert_eq!(again.index(), i);
        assert_eq!(
            (again.entry().policy, again.entry().param),
            (POLICY_SHARE, 3_000)
        );
        assert_eq!(again.own().consumed_ns.load(Relaxed), 0, "a fresh state");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Attack: the default self-service coordinator was 1777 with 0666 files, so any local
    /// user could rewrite a GPU's board or another user's state. Now it is the caller's alone.
    #[test]
    fn a_self_service_coordinator_is_private_to_its_user() {
        use std::os::unix::fs::MetadataExt;
        let dir = temp("private");
        let c =
            Coordinator::join_self(&dir, GPU, 11, POLICY_SHARE, 1_000, Access::Private, 5).unwrap();
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(c.dir()), 0o700);
        assert_eq!(mode(&c.dir().join(BOARD)), 0o600);
        assert_eq!(mode(&c.dir().join(state_name(c.index(), 11))), 0o600);
        assert_eq!(
            std::fs::metadata(c.dir().join(BOARD)).unwrap().uid(),
            // SAFETY: geteuid has no preconditions.
            unsafe { libc::geteuid() }
        );
        drop(c);
        // A coordinator directory others can write is refused, with the reason.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = Coordinator::join_self(&dir, GPU, 11, POLICY_SHARE, 1_000, Access::Private, 6)
            .err()
            .unwrap();
        assert!(e.contains("others can write it"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_v1_coordinator_file_is_moved_aside() {
        let dir = temp("v1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(dir_name(GPU)), b"CUVCORD1").unwrap();
        BoardWriter::open(&dir, GPU).unwrap();
        assert!(dir.join(dir_name(GPU)).join(BOARD).is_file());
        assert!(dir.join(format!("{}.v1", dir_name(GPU))).is_file());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Under the plugin: the board is the plugin's, a container maps only its own state, and
    /// whatever it does to its own files the others read a copy of (or nothing), never fault.
    #[test]
    fn managed_entries_come_from_the_plugin_and_a_broken_peer_state_is_only_a_claim() {
        let dir = temp("managed");
        let w = BoardWriter::open(&dir, GPU).unwrap();
        let (a, pa) = w.assign(11, POLICY_LIMIT, 300_000).unwrap();
        let (b, pb) = w.assign(22, POLICY_SHARE, 1_000).unwrap();
        let ca = Coordinator::join_managed(&dir, GPU, a, &pa).unwrap();
        let cb = Coordinator::join_managed(&dir, GPU, b, &pb).unwrap();
        assert_eq!(ca.entry().param, 300_000);
        ca.own().last_active.store(123, Relaxed);
        let p = peers(&cb);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].state.unwrap().last_active, 123);
        // Every container can open (and flock) every state: nobody waits on that lock.
        let holder = std::fs::File::open(&pa).unwrap();
        let _lock = crate::mapped::Flock::try_exclusive(&holder).unwrap();
        let t = std::time::Instant::now();
        let again = Coordinator::join_managed(&dir, GPU, a, &pa).unwrap();
        assert!(t.elapsed() < std::time::Duration::from_millis(500));
        assert_eq!(again.own().last_active.load(Relaxed), 123);
        // An entry given to another container names another file: a path handed out once
        // never leads to the next holder's state.
        w.release(b, 22).unwrap();
        let (b2, pb2) = w.assign(23, POLICY_SHARE, 1_000).unwrap();
        assert_eq!(b2, b);
        assert_ne!(pb2, pb);
        assert!(!pb.exists());
        drop(cb);
        let cb = Coordinator::join_managed(&dir, GPU, b2, &pb2).unwrap();
        // Self-service processes cannot join or write a managed board.
        let e = Coordinator::join_self(&dir, GPU, 33, POLICY_LIMIT, 1_000_000, Access::Private, 1)
            .err()
            .unwrap();
        assert!(e.contains("managed by the device plugin"), "{e}");
        // A wrong index, or one not assigned, is refused.
        assert!(Coordinator::join_managed(&dir, GPU, 5, &pa).is_err());
        assert!(Coordinator::join_managed(&dir, GPU, b, &pa).is_err());
        // The owner truncates its state: the others read no state, and do not fault.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&pa)
            .unwrap()
            .set_len(8)
            .unwrap();
        let p = peers(&cb);
        assert_eq!(p[0].state, None);
        assert_eq!(p[0].entry.param, 300_000, "its policy still the board's");
        // Replaced by a FIFO: still nothing blocks.
        std::fs::remove_file(&pa).unwrap();
        let c = std::ffi::CString::new(pa.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        assert_eq!(peers(&cb)[0].state, None);
        // Released: gone from the board for the others.
        w.release(a, 11).unwrap();
        assert!(peers(&cb).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
