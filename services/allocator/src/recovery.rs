//! Recovery and verification: rebuild the pool from what the store
//! persisted (`metaslab::Pool::restore`, which also re-selects the embedded
//! log metaslabs as OpenZFS does at pool open) and check it: no overlaps, no
//! extent outside its vdev, and per-vdev sums that match. The first broken
//! rule is named; nothing is ever repaired. `aliquotctl verify` runs the same
//! check on a store file, like `zdb -b`.

use std::collections::{BTreeMap, HashSet};

use metaslab::{Pool, Tunables, Txg, VdevId};

use crate::store::{AdminState, Persisted};

/// One vdev in a verification report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VdevSummary {
    pub id: VdevId,
    pub guid: u64,
    pub name: String,
    pub endpoint: String,
    pub capacity: u64,
    pub metaslab_shift: u8,
    pub extents: u64,
    pub allocated: u64,
    pub embedded_log_metaslab: Option<u32>,
    /// Removed from the pool (RemoveVdev): its row keeps the id and guid.
    pub removed: bool,
}

/// What a passing verification found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyReport {
    pub pool_guid: u64,
    pub synced_txg: Txg,
    pub vdevs: Vec<VdevSummary>,
    pub extents: u64,
    pub allocated: u64,
}

/// Rebuild the pool from `p` and check it; the error names the first
/// inconsistency.
pub fn rebuild(tunables: Tunables, p: &Persisted) -> Result<Pool, String> {
    let mut guids = HashSet::new();
    for v in &p.vdevs {
        if !guids.insert(v.guid) {
            return Err(format!(
                "device guid {:#x} is recorded for more than one vdev (vdev {} is one)",
                v.guid, v.id
            ));
        }
        if v.spec.metaslab_shift.is_none() {
            return Err(format!("vdev {} has no recorded metaslab shift", v.id));
        }
    }
    let vdevs = p.vdevs.iter().map(|r| (r.id, r.spec.clone())).collect();
    // Streamed from the chunks in store order: nothing is copied out.
    let mut pool = Pool::restore_sorted(tunables, vdevs, p.allocated.iter(), p.synced_txg)
        .map_err(|e| e.to_string())?;
    // Administrative states: offline vdevs (a drain) stay offline, removed
    // ones are forgotten again (they must hold nothing).
    for (&id, &state) in &p.vdev_states {
        match state {
            AdminState::Online => {}
            AdminState::Offline => pool.restore_offline(id).map_err(|e| e.to_string())?,
            AdminState::Removed => {
                pool.restore_offline(id)
                    .and_then(|()| pool.remove_vdev(id))
                    .map_err(|e| format!("removed vdev {id}: {e}"))?;
            }
        }
    }
    pool.verify().map_err(|e| e.to_string())?;
    // The rebuilt pool's accounting against the store's own sums.
    let mut sums: BTreeMap<VdevId, u64> = BTreeMap::new();
    for e in p.allocated.iter() {
        *sums.entry(e.vdev).or_default() += e.size;
    }
    if let Some(id) = sums.keys().find(|id| pool.is_removed(**id)) {
        return Err(format!("removed vdev {id} still has extents in the store"));
    }
    for v in pool.stats().vdevs {
        let want = sums.get(&v.id).copied().unwrap_or(0);
        if v.alloc != want {
            return Err(format!(
                "vdev {}: the store's extents sum to {want} bytes but the rebuilt vdev accounts {}",
                v.id, v.alloc
            ));
        }
    }
    Ok(pool)
}

/// Rebuild and check `p` (default tunables: placement policy does not
/// change what is allocated), and summarize it.
pub fn verify(p: &Persisted) -> Result<VerifyReport, String> {
    let pool = rebuild(Tunables::default(), p)?;
    let stats = pool.stats();
    let mut counts: BTreeMap<VdevId, u64> = BTreeMap::new();
    for e in p.allocated.iter() {
        *counts.entry(e.vdev).or_default() += 1;
    }
    let vdevs: Vec<VdevSummary> = p
        .vdevs
        .iter()
        .map(|r| {
            let s = stats.vdevs.iter().find(|v| v.id == r.id);
            VdevSummary {
                id: r.id,
                guid: r.guid,
                name: r.name.clone(),
                endpoint: r.endpoint.clone(),
                capacity: r.spec.capacity,
                metaslab_shift: r.spec.metaslab_shift.unwrap_or(0),
                extents: counts.get(&r.id).copied().unwrap_or(0),
                allocated: s.map_or(0, |v| v.alloc),
                embedded_log_metaslab: s.and_then(|v| v.embedded_log_metaslab),
                removed: p.vdev_states.get(&r.id) == Some(&AdminState::Removed),
            }
        })
        .collect();
    Ok(VerifyReport {
        pool_guid: p.pool_guid,
        synced_txg: p.synced_txg,
        extents: p.allocated.len() as u64,
        allocated: vdevs.iter().map(|v| v.allocated).sum(),
        vdevs,
    })
}
