//! What each live allocation was charged: a fixed-size, lock-free open-addressing hash map from a
//! key (device pointer, VMM handle, array or context handle) to (ledger device entry, bytes).
//!
//! Lock-free because it sits on the allocation hot path and frees may come from any thread.
//! Linear probing; a removed key leaves a tombstone that later inserts reuse. The backing store
//! is anonymous memory reserved at first use and touched only where entries land.

use std::sync::atomic::{AtomicU64, Ordering::*};

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = u64::MAX;
/// A slot being filled: its value is not readable yet.
const BUSY: u64 = u64::MAX - 1;

/// Bits of the value word that hold the byte count; the top 8 hold the ledger device entry.
const BYTES_BITS: u32 = 56;

pub struct Table {
    keys: &'static [AtomicU64],
    vals: &'static [AtomicU64],
    mask: usize,
}

fn hash(k: u64) -> usize {
    // Pointers are 256-byte aligned or more: mix the high bits down (fxhash-style multiply).
    (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize
}

fn alloc_words(n: usize) -> Option<&'static [AtomicU64]> {
    let bytes = n * std::mem::size_of::<AtomicU64>();
    // SAFETY: a fresh private anonymous mapping, zero-filled, never unmapped (the table lives for
    // the life of the process); AtomicU64 has the layout of u64, for which zero is valid.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return None;
        }
        Some(std::slice::from_raw_parts(p as *const AtomicU64, n))
    }
}

impl Table {
    /// A table with room for `capacity` entries (a power of two).
    pub fn new(capacity: usize) -> Option<Table> {
        assert!(capacity.is_power_of_two());
        Some(Table {
            keys: alloc_words(capacity)?,
            vals: alloc_words(capacity)?,
            mask: capacity - 1,
        })
    }

    /// Records `key` -> (entry, bytes). False when the table is full (the caller then refuses
    /// the allocation rather than lose track of a charge).
    pub fn insert(&self, key: u64, entry: usize, bytes: u64) -> bool {
        debug_assert!(key != EMPTY && key != TOMBSTONE && key != BUSY);
        let val = ((entry as u64) << BYTES_BITS) | (bytes & ((1 << BYTES_BITS) - 1));
        let mut i = hash(key) & self.mask;
        for _ in 0..=self.mask {
            let k = self.keys[i].load(Acquire);
            if (k == EMPTY || k == TOMBSTONE)
                && self.keys[i]
                    .compare_exchange(k, BUSY, AcqRel, Acquire)
                    .is_ok()
            {
                self.vals[i].store(val, Relaxed);
                self.keys[i].store(key, Release);
                return true;
            }
            i = (i + 1) & self.mask;
        }
        false
    }

    /// Removes `key`, returning what it recorded.
    pub fn remove(&self, key: u64) -> Option<(usize, u64)> {
        let mut i = hash(key) & self.mask;
        for _ in 0..=self.mask {
            let k = self.keys[i].load(Acquire);
            if k == key {
                let v = self.vals[i].load(Relaxed);
                // Only one thread can own a live key's removal (a double free is the caller's
                // bug): the CAS makes a racing duplicate free see nothing instead of a tombstone.
                if self.keys[i]
                    .compare_exchange(key, TOMBSTONE, AcqRel, Acquire)
                    .is_ok()
                {
                    return Some(((v >> BYTES_BITS) as usize, v & ((1 << BYTES_BITS) - 1)));
                }
                return None;
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// The keys recorded now: a snapshot, for the rare sweeps (entries may come and go meanwhile).
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.keys
            .iter()
            .map(|k| k.load(Acquire))
            .filter(|&k| k != EMPTY && k != TOMBSTONE && k != BUSY)
    }

    pub fn get(&self, key: u64) -> Option<(usize, u64)> {
        let mut i = hash(key) & self.mask;
        for _ in 0..=self.mask {
            let k = self.keys[i].load(Acquire);
            if k == key {
                let v = self.vals[i].load(Relaxed);
                return Some(((v >> BYTES_BITS) as usize, v & ((1 << BYTES_BITS) - 1)));
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn insert_get_remove() {
        let t = Table::new(1 << 10).unwrap();
        assert!(t.insert(0x7f00_0000_0200, 3, 4096));
        assert_eq!(t.get(0x7f00_0000_0200), Some((3, 4096)));
        assert_eq!(t.remove(0x7f00_0000_0200), Some((3, 4096)));
        assert_eq!(
            t.remove(0x7f00_0000_0200),
            None,
            "a second free finds nothing"
        );
        assert_eq!(t.get(0x1234), None);
    }

    #[test]
    fn a_full_table_says_so() {
        let t = Table::new(8).unwrap();
        for k in 1..=8 {
            assert!(t.insert(k * 512, 0, 1));
        }
        assert!(!t.insert(9 * 512, 0, 1));
        t.remove(3 * 512).unwrap();
        let mut keys: Vec<u64> = t.keys().collect();
        keys.sort();
        assert_eq!(keys, [1, 2, 4, 5, 6, 7, 8].map(|k| k * 512));
        assert!(t.insert(9 * 512, 0, 1), "tombstones are reused");
        assert_eq!(t.get(9 * 512), Some((0, 1)));
    }

    #[test]
    fn concurrent_threads_account_exactly() {
        let t = Arc::new(Table::new(1 << 14).unwrap());
        let threads: Vec<_> = (0..8u64)
            .map(|th| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut total = 0u64;
                    for round in 0..2000u64 {
                        let keys: Vec<u64> = (0..8)
                            .map(|i| ((th << 32) | (round << 8) | (i + 1)) << 9)
                            .collect();
                        for (i, k) in keys.iter().enumerate() {
                            assert!(t.insert(*k, th as usize, i as u64 + 1));
                        }
                        for (i, k) in keys.iter().enumerate() {
                            let (e, b) = t.remove(*k).unwrap();
                            assert_eq!((e, b), (th as usize, i as u64 + 1));
                            total += b;
                        }
                    }
                    total
                })
            })
            .collect();
        for th in threads {
            assert_eq!(th.join().unwrap(), 2000 * 36);
        }
    }
}
