//! Refill rates from the coordinator's slots: plain arithmetic, one function, unit-tested.
//!
//! - `limit` slots get their cap, always (even on an idle GPU).
//! - `share` slots split what the active limit slots leave, by weight, among the slots active
//!   recently; a share slot that does not want more (it is not held back and does not keep work
//!   queued on the GPU) lends the part it does not use to the share slots that want more, in
//!   proportion to their weights (work-conserving). Once it needs its part again it wants more
//!   too and the loan ends within one recomputation.

/// What one slot looks like to the rate computation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct View {
    pub kind: Kind,
    /// Launched within the activity window.
    pub active: bool,
    /// It wants more than it gets: a launching thread had to wait recently, or its work was
    /// queued on the GPU most of the time.
    pub wanting: bool,
    /// Recent use, as a fraction of the GPU's time.
    pub usage: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// A cap, as a fraction of GPU time.
    Limit(f64),
    /// A weight.
    Share(f64),
}

/// The least rate any active slot gets (no thread waits forever).
pub const FLOOR: f64 = 0.001;

/// Rates (fractions of GPU time) for every slot; inactive slots get what they would get if they
/// became active alone among the active (so a returning tenant starts at its fair part).
#[cfg(test)]
pub fn rates(views: &[View]) -> Vec<f64> {
    let mut out = vec![0.0; views.len()];
    rates_into(views, &mut out);
    out
}

/// [`rates`] into `out` (one per view), allocating nothing.
pub fn rates_into(views: &[View], out: &mut [f64]) {
    let reserved: f64 = views
        .iter()
        .filter(|v| v.active)
        .map(|v| match v.kind {
            Kind::Limit(cap) if v.wanting => cap,
            Kind::Limit(cap) => cap.min(v.usage),
            Kind::Share(_) => 0.0,
        })
        .sum();
    let capacity = (1.0 - reserved).max(0.0);
    let weight = |v: &View| match v.kind {
        Kind::Share(w) => w.max(0.0),
        Kind::Limit(_) => 0.0,
    };
    let active_w: f64 = views.iter().filter(|v| v.active).map(weight).sum();
    let fair = |v: &View| {
        let w = weight(v);
        let total = if v.active { active_w } else { active_w + w };
        if total > 0.0 {
            capacity * w / total
        } else {
            0.0
        }
    };
    let mut spare = 0.0;
    let mut wanting_w = 0.0;
    for v in views.iter().filter(|v| v.active) {
        if let Kind::Share(_) = v.kind {
            if v.wanting {
                wanting_w += weight(v);
            } else {
                spare += (fair(v) - v.usage).max(0.0);
            }
        }
    }
    for (v, o) in views.iter().zip(out.iter_mut()) {
        *o = {
            let r = match v.kind {
                Kind::Limit(cap) => cap,
                Kind::Share(_) if v.active && v.wanting && wanting_w > 0.0 => {
                    fair(v) + spare * weight(v) / wanting_w
                }
                Kind::Share(_) => fair(v),
            };
            r.clamp(FLOOR, 1.0)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(w: f64, wanting: bool, usage: f64) -> View {
        View {
            kind: Kind::Share(w),
            active: true,
            wanting,
            usage,
        }
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn busy_tenants_split_by_weight() {
        close(
            &rates(&[share(1.0, true, 0.25), share(3.0, true, 0.75)]),
            &[0.25, 0.75],
        );
        close(
            &rates(&[
                share(1.0, true, 0.1),
                share(2.0, true, 0.2),
                share(5.0, true, 0.5),
            ]),
            &[0.125, 0.25, 0.625],
        );
    }

    #[test]
    fn idle_time_is_lent_and_inactive_tenants_drop_out() {
        // The weight-3 tenant uses 0.1 of its 0.75: the rest goes to the busy one.
        close(
            &rates(&[share(1.0, true, 0.25), share(3.0, false, 0.1)]),
            &[0.9, 0.75],
        );
        let mut gone = share(3.0, false, 0.0);
        gone.active = false;
        close(&rates(&[share(1.0, true, 0.9), gone]), &[1.0, 0.75]);
        close(&rates(&[share(1.0, true, 1.0)]), &[1.0]);
    }

    #[test]
    fn limits_are_caps_and_shares_get_the_rest() {
        let limit = |cap: f64, wanting: bool, usage: f64| View {
            kind: Kind::Limit(cap),
            active: true,
            wanting,
            usage,
        };
        close(&rates(&[limit(0.3, true, 0.3)]), &[0.3]);
        close(
            &rates(&[limit(0.3, true, 0.3), limit(0.7, true, 0.7)]),
            &[0.3, 0.7],
        );
        close(
            &rates(&[limit(0.3, true, 0.3), share(1.0, true, 0.7)]),
            &[0.3, 0.7],
        );
        // A limit tenant using little of its cap leaves the rest to shares.
        close(
            &rates(&[limit(0.3, false, 0.1), share(1.0, true, 0.9)]),
            &[0.3, 0.9],
        );
    }
}
