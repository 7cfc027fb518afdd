//! Placement: GetPreferredAllocation's picks and Allocate's span rule.
//!
//! - Memory units: a request goes onto one GPU when one can hold it, best fit (the GPU with the
//!   fewest free units that still fits, so that big holes stay for big requests; ties: lower
//!   index). Only when no single GPU has enough free units does a request span GPUs, taking the
//!   emptiest first (fewest GPUs).
//! - Whole GPUs: [`crate::topology::Allocator::preferred`] (exact search by topology score).

use crate::inventory::Inventory;
use crate::topology::Weights;
use std::collections::BTreeMap;

/// Free units per GPU (position in the inventory) from a list of available unit IDs, each
/// GPU's units in order of k. Unknown IDs are an error.
fn by_gpu(inv: &Inventory, ids: &[String]) -> Result<BTreeMap<usize, Vec<u32>>, String> {
    let mut m: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for id in ids {
        let (g, k) = inv
            .parse_unit_id(id)
            .ok_or_else(|| format!("unknown memory unit {id:?}"))?;
        m.entry(g).or_default().push(k);
    }
    for v in m.values_mut() {
        v.sort_unstable();
        v.dedup();
    }
    Ok(m)
}

/// GetPreferredAllocation for memory units.
pub fn preferred_memory(
    inv: &Inventory,
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Result<Vec<String>, String> {
    if size == 0 {
        return Err("allocation_size is 0".into());
    }
    let avail = by_gpu(inv, available)?;
    let must = by_gpu(inv, must_include)?;
    let total: usize = avail.values().map(Vec::len).sum();
    if total < size {
        return Err(format!("{size} memory units requested, {total} available"));
    }
    let must_n: usize = must.values().map(Vec::len).sum();
    if must_n > size {
        return Err(format!(
            "{must_n} units must be included in an allocation of {size}"
        ));
    }
    for (g, ks) in &must {
        if ks
            .iter()
            .any(|k| !avail.get(g).is_some_and(|a| a.contains(k)))
        {
            return Err("a must-include unit is not available".into());
        }
    }
    // One GPU: among those that hold every must-include unit and have room, the tightest fit.
    let single = avail
        .iter()
        .filter(|(g, ks)| ks.len() >= size && must.keys().all(|m| m == *g))
        .min_by_key(|(g, ks)| (ks.len(), **g));
    let order: Vec<usize> = match single {
        Some((g, _)) => vec![*g],
        None => {
            // Span: GPUs of the must-include units first, then the emptiest.
            let mut gs: Vec<usize> = avail.keys().copied().collect();
            gs.sort_by_key(|g| (!must.contains_key(g), std::cmp::Reverse(avail[g].len()), *g));
            gs
        }
    };
    let mut out: Vec<String> = Vec::with_capacity(size);
    for (g, ks) in &must {
        out.extend(ks.iter().map(|k| inv.unit_id(*g, *k)));
    }
    'fill: for g in order {
        for k in &avail[&g] {
            if out.len() == size {
                break 'fill;
            }
            if must.get(&g).is_some_and(|m| m.contains(k)) {
                continue;
            }
            out.push(inv.unit_id(g, *k));
        }
    }
    Ok(out)
}

/// GetPreferredAllocation for whole GPUs (device ID = UUID).
pub fn preferred_gpus(
    inv: &Inventory,
    available: &[String],
    must_include: &[String],
    size: usize,
    weights: &Weights,
) -> Result<Vec<String>, String> {
    let idx = |ids: &[String]| -> Result<Vec<usize>, String> {
        ids.iter()
            .map(|id| {
                inv.gpu_by_uuid(id)
                    .ok_or_else(|| format!("unknown GPU {id:?}"))
            })
            .collect()
    };
    let (a, m) = (idx(available)?, idx(must_include)?);
    // The look-ahead plans for the sizes asked for recently (this one included).
    inv.allocator().note_request(size);
    let pick = inv
        .allocator()
        .preferred(&a, &m, size, weights)
        .map_err(|e| format!("{e:?}"))?;
    Ok(pick
        .into_iter()
        .map(|g| inv.gpus()[g].uuid.clone())
        .collect())
}

/// Allocate's rule for memory units: the units (GPU, k) may span GPUs only when no single GPU
/// has as many free units. `free(g)` counts GPU g's units not held by another allocation
/// (this request's own units count as free). Units per GPU on success.
pub fn check_memory_units(
    inv: &Inventory,
    resource: &str,
    ids: &[String],
    free: impl Fn(usize) -> u32,
) -> Result<BTreeMap<usize, u32>, String> {
    if ids.is_empty() {
        return Err(format!("{resource}: no devices in the request"));
    }
    let units = by_gpu(inv, ids).map_err(|e| format!("{resource}: {e}"))?;
    let n: usize = units.values().map(Vec::len).sum();
    if n != ids.len() {
        return Err(format!("{resource}: a memory unit is listed twice"));
    }
    if units.len() > 1 {
        if let Some(g) = (0..inv.gpus().len()).find(|g| free(*g) as usize >= n) {
            let spread = units
                .iter()
                .map(|(g, ks)| format!("{} ({})", inv.gpus()[*g].uuid, ks.len()))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(format!(
                "{resource}: the {n} memory units requested span {} GPUs [{spread}], but GPU {} \
                 alone has {} free units; a memory request must fit on one GPU when one can \
                 hold it (a process sees one GPU's memory at a time). Ask again: \
                 GetPreferredAllocation packs a request onto one GPU.",
                units.len(),
                inv.gpus()[g].uuid,
                free(g)
            ));
        }
    }
    Ok(units
        .into_iter()
        .map(|(g, ks)| (g, ks.len() as u32))
        .collect())
}
