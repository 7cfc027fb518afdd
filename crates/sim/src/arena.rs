//! Device address space of one process on one simulated device.
//!
//! The arena reserves twice the device's memory as host virtual memory (`MAP_NORESERVE`, so an
//! 80 GiB device costs no RAM until bytes are actually written) and hands out best-fit blocks with
//! coalescing. A device pointer is a host address inside it, so copies are plain memcpy.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// Every block starts on this boundary (cudaMalloc guarantees 256 bytes; the driver gives 512).
pub const ALIGN: u64 = 512;

pub struct Arena {
    base: u64,
    size: u64,
    free: Mutex<FreeList>,
    /// The file the arena maps (`over_file`), shared with other processes that map it, owned
    /// by the arena; -1 for anonymous memory.
    fd: i32,
}

#[derive(Default)]
struct FreeList {
    by_addr: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl FreeList {
    fn insert(&mut self, addr: u64, size: u64) {
        self.by_addr.insert(addr, size);
        self.by_size.insert((size, addr));
    }
    fn remove(&mut self, addr: u64, size: u64) {
        self.by_addr.remove(&addr);
        self.by_size.remove(&(size, addr));
    }
}

pub fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

impl Arena {
    /// Reserves `size` bytes of address space, starting on a 2 MiB boundary. `low`: below
    /// 2 GiB (MAP_32BIT), for 32-bit device pointers. None if the host refuses the reservation.
    pub fn new(size: u64, low: bool) -> Option<Arena> {
        const HUGE: u64 = 1 << 21;
        let size = round_up(size.max(ALIGN), HUGE);
        let extra = if low { libc::MAP_32BIT } else { 0 };
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing; nothing
        // else refers to that range. It is never unmapped (arenas live as long as the process).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                (size + HUGE) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | extra,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = round_up(p as u64, HUGE);
        let mut free = FreeList::default();
        free.insert(base, size);
        Some(Arena {
            base,
            size,
            free: Mutex::new(free),
            fd: -1,
        })
    }

    /// An arena over the first `size` bytes of file `fd`, mapped `MAP_SHARED`: what another
    /// process that maps the same file sees at the same offsets (memory shared between
    /// processes). The arena owns `fd` (also when it fails): dropped, it unmaps and closes it.
    pub fn over_file(fd: i32, size: u64) -> Option<Arena> {
        let size = round_up(size.max(ALIGN), 4096);
        // SAFETY: a new shared mapping of the caller's file at an address of the kernel's choosing;
        // nothing else refers to that range.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            // SAFETY: closing the descriptor handed to us.
            unsafe { libc::close(fd) };
            return None;
        }
        let mut free = FreeList::default();
        free.insert(p as u64, size);
        Some(Arena {
            base: p as u64,
            size,
            free: Mutex::new(free),
            fd,
        })
    }

    /// The first address of the arena.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The file an `over_file` arena maps (-1: anonymous memory). Valid while the arena lives.
    pub fn fd(&self) -> i32 {
        self.fd
    }

    /// The arena's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.base && addr < self.base + self.size
    }

    /// Whether [addr, addr + size) lies inside the arena.
    fn holds(&self, addr: u64, size: u64) -> bool {
        self.contains(addr)
            && addr
                .checked_add(size)
                .is_some_and(|e| e <= self.base + self.size)
    }

    /// Maps `size` bytes of file `fd` from `offset` over [addr, addr + size) of the arena,
    /// shared: what other processes mapping the file see (VMM handles and IPC allocations
    /// exported as files). False, with nothing changed, where the range is not the arena's or
    /// the mapping fails.
    pub fn map_file_over(&self, addr: u64, size: u64, fd: i32, offset: u64) -> bool {
        if !self.holds(addr, size) {
            return false;
        }
        // SAFETY: [addr, addr + size) lies inside this arena's own reservation; MAP_FIXED
        // replaces those pages in place and nothing outside the arena is touched.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                offset as libc::off_t,
            )
        };
        p != libc::MAP_FAILED
    }

    /// Gives [addr, addr + size), mapped over by [`Arena::map_file_over`], its private
    /// anonymous memory back before the range is handed out again.
    pub fn unmap_file(&self, addr: u64, size: u64) {
        if !self.holds(addr, size) {
            return;
        }
        // SAFETY: the range lies inside this arena's own reservation and is no longer handed
        // out; it becomes private, unreserved memory again, as the arena made it.
        unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
    }

    /// A block of `size` bytes (already rounded by the caller to ALIGN), or None when the
    /// address space is exhausted.
    pub fn alloc(&self, size: u64) -> Option<u64> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGN));
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let &(bsize, addr) = f.by_size.range((size, 0)..).next()?;
        f.remove(addr, bsize);
        if bsize > size {
            f.insert(addr + size, bsize - size);
        }
        Some(addr)
    }

    /// A block of `size` bytes starting on a multiple of `align` (a power of two), or None.
    pub fn alloc_aligned(&self, size: u64, align: u64) -> Option<u64> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGN) && align.is_power_of_two());
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let &(bsize, addr) = f.by_size.range((size, 0)..).find(|&&(bsize, addr)| {
            let pad = round_up(addr, align) - addr;
            bsize >= size + pad
        })?;
        let start = round_up(addr, align);
        f.remove(addr, bsize);
        if start > addr {
            f.insert(addr, start - addr);
        }
        let end = start + size;
        if addr + bsize > end {
            f.insert(end, addr + bsize - end);
        }
        Some(start)
    }

    /// Makes [addr, addr + len) of a block read as zeros without writing most of it: its whole
    /// pages are dropped (MADV_DONTNEED on the private anonymous mapping: "subsequent accesses
    /// of pages in the range will succeed, but will result in ... zero-fill-on-demand pages",
    /// madvise(2); a hole punched into the arena's own file), the partial pages at its ends
    /// written. Not for a range that another file is mapped over (`map_file_over`).
    pub fn zero(&self, addr: u64, len: u64) {
        const PAGE: u64 = 4096;
        if len == 0 || !self.contains(addr) || !self.contains(addr + len - 1) {
            return;
        }
        let (lo, hi) = (round_up(addr, PAGE), (addr + len) / PAGE * PAGE);
        let write = |a: u64, n: u64| {
            // SAFETY: [a, a + n) lies inside this arena's mapping (checked above), which stays
            // mapped for the life of the process; the caller owns the block.
            unsafe { std::ptr::write_bytes(a as *mut u8, 0, n as usize) };
        };
        if lo >= hi {
            write(addr, len);
            return;
        }
        write(addr, lo - addr);
        write(hi, addr + len - hi);
        if self.fd >= 0 {
            // SAFETY: punching a hole into the arena's own file over pages of the caller's block.
            unsafe {
                libc::fallocate(
                    self.fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    (lo - self.base) as libc::off_t,
                    (hi - lo) as libc::off_t,
                )
            };
        } else {
            // SAFETY: whole pages inside our private anonymous mapping, of the caller's block.
            let r = unsafe {
                libc::madvise(
                    lo as *mut libc::c_void,
                    (hi - lo) as usize,
                    libc::MADV_DONTNEED,
                )
            };
            if r != 0 {
                write(lo, hi - lo);
            }
        }
    }

    /// Returns a block. `dirty` says whether its bytes were written, in which case the host pages
    /// are dropped so that freed device memory stops costing RAM.
    pub fn free(&self, addr: u64, size: u64, dirty: bool) {
        if dirty && self.fd >= 0 {
            // SAFETY: punching a hole into the arena's own file at the block's offset: its pages
            // stop costing RAM (MADV_DONTNEED does not free a shared file's pages).
            unsafe {
                libc::fallocate(
                    self.fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    (addr - self.base) as libc::off_t,
                    size as libc::off_t,
                )
            };
        } else if dirty {
            // SAFETY: [addr, addr+size) lies inside our private mapping and is no longer handed out.
            unsafe {
                libc::madvise(
                    addr as *mut libc::c_void,
                    size as usize,
                    libc::MADV_DONTNEED,
                )
            };
        }
        let mut f = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (mut a, mut s) = (addr, size);
        if let Some((&pa, &ps)) = f.by_addr.range(..a).next_back() {
            if pa + ps == a {
                f.remove(pa, ps);
                a = pa;
                s += ps;
            }
        }
        if let Some(&ns) = f.by_addr.get(&(addr + size)) {
            f.remove(addr + size, ns);
            s += ns;
        }
        f.insert(a, s);
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.fd >= 0 {
            // SAFETY: unmapping the file mapping this arena made and closing its own descriptor;
            // nothing is handed out of it any more (its owners drop it last).
            unsafe {
                libc::munmap(self.base as *mut libc::c_void, self.size as usize);
                libc::close(self.fd);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_and_coalescing_give_the_whole_space_back() {
        let a = Arena::new(64 << 20, false).unwrap();
        let total = a.size;
        let x = a.alloc(ALIGN).unwrap();
        let y = a.alloc(10 * ALIGN).unwrap();
        let z = a.alloc(3 * ALIGN).unwrap();
        assert!(x != y && y != z);
        // Write through the pointer: device memory is host-backed.
        // SAFETY: y is a live block of 10 * ALIGN bytes inside our mapping.
        unsafe { std::ptr::write_bytes(y as *mut u8, 0xab, (10 * ALIGN) as usize) };
        a.free(y, 10 * ALIGN, true);
        a.free(x, ALIGN, false);
        a.free(z, 3 * ALIGN, false);
        // Fully coalesced again: one block of the whole size.
        assert_eq!(a.alloc(total), Some(a.base));
        assert_eq!(a.alloc(ALIGN), None);
    }

    #[test]
    fn aligned_blocks_start_on_their_alignment_and_the_padding_stays_free() {
        let a = Arena::new(64 << 20, false).unwrap();
        let total = a.size;
        let x = a.alloc(ALIGN).unwrap();
        let y = a.alloc_aligned(2 << 20, 2 << 20).unwrap();
        assert_eq!(y % (2 << 20), 0);
        assert!(y > x);
        // The padding between x and y is still free: a small block lands there.
        let z = a.alloc(ALIGN).unwrap();
        assert!(z < y, "{z:#x} {y:#x}");
        a.free(x, ALIGN, false);
        a.free(y, 2 << 20, false);
        a.free(z, ALIGN, false);
        assert_eq!(a.alloc(total), Some(a.base));
    }

    #[test]
    fn a_huge_reservation_costs_no_ram() {
        // 160 GiB of device address space, as an 80 GiB device gets; touching nothing.
        let a = Arena::new(160 << 30, false).expect("MAP_NORESERVE reservation");
        assert!(a.alloc(80 << 30).is_some());
    }

    #[test]
    fn low_arena_fits_32_bit_pointers() {
        let a = Arena::new(64 << 20, true).unwrap();
        let p = a.alloc(ALIGN).unwrap();
        assert!(p < u32::MAX as u64, "{p:#x}");
    }
}
