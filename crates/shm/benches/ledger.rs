//! The ledger's own share of the allocation hot path: one `try_charge` + `uncharge` pair on a
//! device entry, with no driver and no interposition around it (benches/overhead.rs measures the
//! whole wrapper). One thread, then four threads of one process on one entry.
//!
//! Run: `cargo bench -p cuvisor-shm --bench ledger`.

use cuvisor_shm::ledger::Ledger;
use std::time::Instant;

const PAIRS: u64 = 5_000_000;
const ROUNDS: usize = 15;

fn pair_ns(l: &Ledger, d: usize, p: usize, pairs: u64) -> f64 {
    let t = Instant::now();
    for _ in 0..pairs {
        l.try_charge(d, p, 1 << 20).expect("within the limit");
        l.uncharge(d, p, 1 << 20);
    }
    t.elapsed().as_nanos() as f64 / pairs as f64
}

fn main() {
    let dir = std::env::temp_dir().join(format!("cuvisor-bench-ledger-{}", std::process::id()));
    let l = Ledger::open_dir(&dir).expect("a scratch ledger");
    let d = l.device_for([1; 16], 1 << 40).expect("a device entry");
    let p = l.claim_proc(std::process::id(), 1).expect("a process slot");
    let best = (0..ROUNDS)
        .map(|_| pair_ns(&l, d, p, PAIRS))
        .fold(f64::MAX, f64::min);
    println!(
        "ledger try_charge + uncharge pair, 1 thread: {best:.1} ns (best of {ROUNDS} x {PAIRS})"
    );
    let threads = 4;
    let best = (0..ROUNDS / 3)
        .map(|_| {
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads)
                    .map(|_| s.spawn(|| pair_ns(&l, d, p, PAIRS / 4)))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("a bench thread"))
                    .fold(0.0, f64::max)
            })
        })
        .fold(f64::MAX, f64::min);
    println!(
        "ledger try_charge + uncharge pair, {threads} threads on one entry: {best:.1} ns per pair per thread (best of {})",
        ROUNDS / 3
    );
    drop(l);
    let _ = std::fs::remove_dir_all(&dir);
}
