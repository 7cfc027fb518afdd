//! VMM physical memory stays charged until it is released *and* no longer mapped.
//!
//! The driver keeps a released handle's memory alive for as long as a mapping uses it (the CUDA
//! samples release right after cuMemMap), so giving the charge back at cuMemRelease would let a
//! program create, map and release its way past its quota. This records which charged handles
//! are mapped where, so that a release of a mapped handle is only noted, and the unmap that
//! removes its last mapping gives the charge back.
//!
//! Exported handles: the driver frees the memory only when every handle to it, imported copies
//! included ("shareable counterparts", cuMemRelease), is released and every mapping unmapped.
//! An import may live in another process, out of this one's sight, so an exported handle keeps
//! its charge until this process exits (`Quota::pin_exported`); its mappings are no longer
//! tracked here.
//!
//! Only VMM calls (cuMemMap, cuMemUnmap, cuMemRelease of a mapped handle) come here, never
//! cuMemAlloc/cuMemFree or launches: a process-local mutex is enough, and the hook holds it
//! across the driver's unmap/release so that no other VMM call of this process sees a half-done
//! state.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};

#[derive(Default)]
pub struct Mappings(Mutex<Inner>);

#[derive(Default, Debug)]
pub struct Inner {
    /// Mapping start -> (handle, size).
    maps: BTreeMap<u64, (u64, u64)>,
    /// Charged handles with at least one mapping -> (number of mappings, released).
    handles: HashMap<u64, (u32, bool)>,
}

impl Mappings {
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    /// The driver mapped (charged) `handle` at [va, va + size).
    pub fn map(&mut self, va: u64, size: u64, handle: u64) {
        if self.maps.insert(va, (handle, size)).is_none() {
            self.handles.entry(handle).or_insert((0, false)).0 += 1;
        }
    }

    pub fn is_mapped(&self, handle: u64) -> bool {
        self.handles.contains_key(&handle)
    }

    /// The program released a mapped handle: its memory (and charge) stays until the last unmap.
    pub fn set_released(&mut self, handle: u64) {
        if let Some(s) = self.handles.get_mut(&handle) {
            s.1 = true;
        }
    }

    fn in_range(&self, va: u64, size: u64) -> impl Iterator<Item = (&u64, &(u64, u64))> {
        self.maps.range(va..va.saturating_add(size))
    }

    /// The released handles whose every remaining mapping starts in [va, va + size): unmapping
    /// that range frees their memory.
    pub fn freed_by_unmap(&self, va: u64, size: u64) -> Vec<u64> {
        let mut gone: HashMap<u64, u32> = HashMap::new();
        for (_, (h, _)) in self.in_range(va, size) {
            *gone.entry(*h).or_insert(0) += 1;
        }
        gone.into_iter()
            .filter(|(h, n)| self.handles.get(h) == Some(&(*n, true)))
            .map(|(h, _)| h)
            .collect()
    }

    /// The driver unmapped [va, va + size): forget those mappings, and the handles left with none.
    pub fn unmap(&mut self, va: u64, size: u64) {
        let starts: Vec<u64> = self.in_range(va, size).map(|(s, _)| *s).collect();
        for s in starts {
            let Some((h, _)) = self.maps.remove(&s) else {
                continue;
            };
            if let Some(st) = self.handles.get_mut(&h) {
                st.0 = st.0.saturating_sub(1);
                if st.0 == 0 {
                    self.handles.remove(&h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_released_handle_is_freed_by_its_last_unmap() {
        let m = Mappings::default();
        let mut g = m.lock();
        g.map(0x1000_0000, 4 * MIB, 7);
        g.map(0x2000_0000, 4 * MIB, 7); // mapped twice
        assert!(g.is_mapped(7));
        assert!(
            g.freed_by_unmap(0x1000_0000, 4 * MIB).is_empty(),
            "not released yet"
        );
        g.set_released(7);
        assert!(
            g.freed_by_unmap(0x1000_0000, 4 * MIB).is_empty(),
            "another mapping remains"
        );
        g.unmap(0x1000_0000, 4 * MIB);
        assert!(g.is_mapped(7));
        assert_eq!(g.freed_by_unmap(0x2000_0000, 4 * MIB), vec![7]);
        g.unmap(0x2000_0000, 4 * MIB);
        assert!(!g.is_mapped(7));
        assert!(g.maps.is_empty() && g.handles.is_empty());
    }

    #[test]
    fn one_unmap_can_cover_several_mappings() {
        let m = Mappings::default();
        let mut g = m.lock();
        g.map(0x1000_0000, 2 * MIB, 1);
        g.map(0x1000_0000 + 2 * MIB, 2 * MIB, 2);
        g.map(0x1000_0000 + 4 * MIB, 2 * MIB, 3);
        g.set_released(1);
        g.set_released(3);
        let mut freed = g.freed_by_unmap(0x1000_0000, 6 * MIB);
        freed.sort();
        assert_eq!(freed, vec![1, 3], "2 is not released: it stays charged");
        g.unmap(0x1000_0000, 6 * MIB);
        assert!(!g.is_mapped(1) && !g.is_mapped(2) && !g.is_mapped(3));
    }

    #[test]
    fn an_unreleased_handle_unmapped_is_no_longer_tracked() {
        let m = Mappings::default();
        let mut g = m.lock();
        g.map(0x1000_0000, 2 * MIB, 5);
        g.unmap(0x1000_0000, 2 * MIB);
        assert!(!g.is_mapped(5), "its release then frees it at once");
        g.unmap(0x1000_0000, 2 * MIB); // nothing there: no effect
        assert!(g.handles.is_empty());
    }
}
