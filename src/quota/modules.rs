//! Module and library images: the device memory of their variables, charged before the driver
//! loads them and given back when it unloads them.
//!
//! The driver allocates a module's `__device__` and `__constant__` variables when it loads the
//! image, and frees them when the module is unloaded or its context destroyed ("Destroys the
//! CUDA context specified by ctx ... all resources allocated in it", cuCtxDestroy; the modules
//! loaded in a context are among them). No allocation call shows that memory, so a program that
//! loads an image with a 2 GiB `.global` seven times took 14.5 GiB under a 1 GiB quota. The
//! image says how large its variables are (`cuvisor_image`: PTX, cubins, fat binaries with LZ4
//! and Zstandard entries); that is charged first, and the load refused with
//! CUDA_ERROR_OUT_OF_MEMORY beyond the quota.
//!
//! Where, and for how long:
//! - a module (cuModuleLoad*): in the current context, on its device, until cuModuleUnload or
//!   the context's teardown (cuCtxDestroy, the primary context's last release or reset);
//! - a library (cuLibraryLoadData, CUDA 12.0's context-independent loading): the driver
//!   loads it "eagerly into all contexts at the time of the call and future contexts at the
//!   time of creation" under CUDA_MODULE_LOADING=EAGER, and under LAZY (the default since
//!   CUDA 12.2) into a context "only when a function is needed for that context, such as a
//!   kernel launch" (driver API reference, cuLibraryLoadData). Either way a context of every
//!   device may hold its variables, and which ones will is not known at load: so a library is
//!   charged once on every device the process can see, from the load to cuLibraryUnload
//!   (context teardown does not end it: the library lives on and loads into the next context).
//!   Several contexts of one device each hold a copy on a real driver; that is charged once
//!   (an under-count bounded by the number of contexts, each of which takes the context
//!   reserve).
//!
//! An image whose variables cannot be sized (a compression the reader cannot undo, an extent it
//! cannot read, a size that overflows) is refused with one line; bytes that are no image at all
//! go to the driver, which refuses them (CUDA_ERROR_INVALID_IMAGE) and takes nothing.

use super::{Quota, Refusal};
use std::collections::HashMap;
use std::sync::Mutex;

/// What a loaded module or library was charged: per ledger entry, the bytes; the context it
/// was loaded in (0 for a library) and, where that is a primary context, its device.
#[derive(Debug)]
struct Loaded {
    charges: Vec<(usize, u64)>,
    ctx: u64,
    primary_of: Option<i32>,
    /// A copy of the image the driver was given, kept while the library lives (a file read by
    /// cuvisor and loaded from memory may be referenced by the driver until then).
    _image: Option<Box<[u8]>>,
}

/// What went away with a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gone {
    /// cuCtxDestroy of this context.
    Context(u64),
    /// The primary context of this device (its last release, or a reset).
    Primary(i32),
}

/// Loaded modules and libraries, by handle.
#[derive(Default)]
pub struct Images {
    modules: Mutex<HashMap<u64, Loaded>>,
    libraries: Mutex<HashMap<u64, Loaded>>,
}

/// Why a load did not happen.
#[derive(Debug, PartialEq, Eq)]
pub enum LoadError {
    /// Over the quota (or no ledger entry) on ledger entry .0.
    Refused(usize, Refusal),
    /// The driver's own error.
    Driver(u32),
}

/// Which table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Module,
    Library,
}

/// Where a load is charged.
pub struct Place {
    /// Ledger entries to charge `bytes` on, each.
    pub entries: Vec<usize>,
    pub ctx: u64,
    pub primary_of: Option<i32>,
}

impl Images {
    fn table(&self, kind: Kind) -> std::sync::MutexGuard<'_, HashMap<u64, Loaded>> {
        let t = match kind {
            Kind::Module => &self.modules,
            Kind::Library => &self.libraries,
        };
        t.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Charges `bytes` on every entry of `place`, then runs `load` (the driver's load, which
    /// answers the new handle or its error); gives every charge back if either fails.
    pub fn load(
        &self,
        q: &Quota,
        kind: Kind,
        place: Place,
        bytes: u64,
        image: Option<Box<[u8]>>,
        load: impl FnOnce() -> Result<u64, u32>,
    ) -> Result<u64, LoadError> {
        let mut charges = Vec::with_capacity(place.entries.len());
        let undo = |charges: &[(usize, u64)]| {
            for &(e, b) in charges {
                q.uncharge(e, b);
            }
        };
        if bytes > 0 {
            for &e in &place.entries {
                if let Err(why) = q.charge(e, bytes) {
                    undo(&charges);
                    return Err(LoadError::Refused(e, why));
                }
                charges.push((e, bytes));
            }
        }
        match load() {
            Ok(h) => {
                let old = self.table(kind).insert(
                    h,
                    Loaded {
                        charges,
                        ctx: place.ctx,
                        primary_of: place.primary_of,
                        _image: image,
                    },
                );
                // A handle the driver hands out again was unloaded in a way not seen here
                // (its context went): what it held is gone.
                if let Some(old) = old {
                    undo(&old.charges);
                }
                Ok(h)
            }
            Err(r) => {
                undo(&charges);
                Err(LoadError::Driver(r))
            }
        }
    }

    /// An unload: forgets `h` first (so a handle the driver reuses at once is not confused
    /// with it), unloads, then gives its charges back — or puts the record back if the driver
    /// refused.
    pub fn unload(&self, q: &Quota, kind: Kind, h: u64, unload: impl FnOnce() -> u32) -> u32 {
        let rec = self.table(kind).remove(&h);
        let r = unload();
        if let Some(rec) = rec {
            if r == 0 {
                for &(e, b) in &rec.charges {
                    q.uncharge(e, b);
                }
            } else {
                self.table(kind).insert(h, rec);
            }
        }
        r
    }

    /// A context went, and the modules loaded in it with it: gives their charges back.
    /// Libraries stay (they outlive contexts). Returns how many modules went.
    pub fn context_gone(&self, q: &Quota, gone: Gone) -> usize {
        let mut t = self.table(Kind::Module);
        let keys: Vec<u64> = t
            .iter()
            .filter(|(_, l)| match gone {
                Gone::Context(c) => l.ctx == c,
                Gone::Primary(d) => l.primary_of == Some(d),
            })
            .map(|(k, _)| *k)
            .collect();
        for k in &keys {
            if let Some(l) = t.remove(k) {
                for &(e, b) in &l.charges {
                    q.uncharge(e, b);
                }
            }
        }
        keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::tests::quota;

    const GIB: u64 = 1 << 30;

    fn at(e: usize, ctx: u64, primary_of: Option<i32>) -> Place {
        Place {
            entries: vec![e],
            ctx,
            primary_of,
        }
    }

    #[test]
    fn seven_loads_of_2_gib_are_held_to_a_1_gib_quota_and_unload_gives_back_exactly() {
        let q = quota("images-seven", GIB);
        let e = q.entry(0, || Some([3; 16])).unwrap();
        let imgs = Images::default();
        let mut driver_calls = 0;
        for _ in 0..7 {
            let r = imgs.load(&q, Kind::Module, at(e, 1, None), 2 * GIB, None, || {
                driver_calls += 1;
                Ok(0x100)
            });
            assert!(matches!(r, Err(LoadError::Refused(_, Refusal::Quota(_)))));
        }
        assert_eq!(driver_calls, 0, "the driver never loads what is refused");
        for h in 1..=3u64 {
            let bytes = 300 << 20;
            assert_eq!(
                imgs.load(&q, Kind::Module, at(e, 1, None), bytes, None, || Ok(h)),
                Ok(h)
            );
        }
        assert_eq!(q.view(e, u64::MAX, u64::MAX).used, 900 << 20);
        assert!(imgs
            .load(&q, Kind::Module, at(e, 1, None), 300 << 20, None, || Ok(9))
            .is_err());
        assert_eq!(imgs.unload(&q, Kind::Module, 2, || 0), 0);
        assert_eq!(q.view(e, u64::MAX, u64::MAX).used, 600 << 20);
        assert_eq!(
            imgs.unload(&q, Kind::Module, 2, || 400),
            400,
            "twice: driver's error"
        );
        assert_eq!(
            imgs.unload(&q, Kind::Module, 3, || 1),
            1,
            "refused: still charged"
        );
        assert_eq!(q.view(e, u64::MAX, u64::MAX).used, 600 << 20);
        assert_eq!(imgs.unload(&q, Kind::Module, 3, || 0), 0);
        assert_eq!(q.view(e, u64::MAX, u64::MAX).used, 300 << 20);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn a_failed_load_is_given_back() {
        let q = quota("images-fail", GIB);
        let e = q.entry(0, || Some([4; 16])).unwrap();
        let imgs = Images::default();
        let r = imgs.load(&q, Kind::Library, at(e, 0, None), 100, None, || Err(200));
        assert_eq!(r, Err(LoadError::Driver(200)));
        assert_eq!(q.view(e, u64::MAX, u64::MAX).used, 0);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn context_teardown_gives_back_its_modules_only() {
        let q = quota("images-ctx", GIB);
        let e = q.entry(0, || Some([5; 16])).unwrap();
        let imgs = Images::default();
        let mb = 1 << 20;
        imgs.load(&q, Kind::Module, at(e, 7, None), mb, None, || Ok(1))
            .unwrap();
        imgs.load(&q, Kind::Module, at(e, 8, Some(0)), 2 * mb, None, || Ok(2))
            .unwrap();
        imgs.load(&q, Kind::Library, at(e, 0, None), 4 * mb, None, || Ok(3))
            .unwrap();
        assert_eq!(imgs.context_gone(&q, Gone::Context(7)), 1);
        assert_eq!(q.view(e, u64::MAX, u64::MAX).used, 6 * mb);
        assert_eq!(
            imgs.context_gone(&q, Gone::Primary(1)),
            0,
            "another device's"
        );
        assert_eq!(imgs.context_gone(&q, Gone::Primary(0)), 1);
        assert_eq!(
            q.view(e, u64::MAX, u64::MAX).used,
            4 * mb,
            "the library stays"
        );
        assert_eq!(imgs.unload(&q, Kind::Library, 3, || 0), 0);
        assert_eq!(q.view(e, u64::MAX, u64::MAX).used, 0);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }
}
