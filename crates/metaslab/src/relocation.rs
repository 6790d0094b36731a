//! Where a balancer move may place its new copy (`Relocate`): never on the
//! source vdev or the block's other copies, and, while some allocatable
//! vdev of the class is below the class's fill, only on such a vdev — a
//! move onto another over-full vdev would only have to move again
//! (measured: 1.5× the bytes for the same score without this rule). The
//! throttle then places it among those as it places any block
//! (`Pool::allocate_avoiding`).

use std::cmp::Ordering;

use crate::balance_score::{VdevFill, cmp_to_class};
use crate::pool::{NORMAL, Pool};
use crate::{Error, Extent, Result, VdevId, VdevRole};

impl Pool {
    /// The logical size (psize) a move of `from` must place: `psize` when
    /// the caller knows it (the block's length in its manifest), else the
    /// largest block `from`'s allocation can hold on its vdev
    /// ([`crate::vdev::asize_to_psize`]). Never the old asize itself: on
    /// RAIDZ that includes parity and padding, and a block moved with it
    /// would grow at every move (issue 29, item 1). OpenZFS never meets
    /// this: it refuses device removal with parity vdevs
    /// (`vdev_removal.c:spa_vdev_remove_top_check@zfs-2.4.0`).
    pub fn relocation_psize(&self, from: &Extent, psize: u64) -> Result<u64> {
        self.check_present(from.vdev)?;
        let spec = &self.vdevs[from.vdev as usize].spec;
        let most = crate::vdev::asize_to_psize(spec, from.size);
        if psize > most || most == 0 {
            return Err(Error::PsizeTooLarge {
                psize,
                extent: *from,
                most,
            });
        }
        Ok(if psize == 0 { most } else { psize })
    }

    /// The vdevs a move of a copy on `source` must avoid, sorted; `others`
    /// are the vdevs of the block's other copies. Fails for an unknown or
    /// removed source and for a log vdev (the balancer moves normal data).
    pub fn relocation_avoid(&self, source: VdevId, others: &[VdevId]) -> Result<Vec<VdevId>> {
        self.check_present(source)?;
        if self.vdevs[source as usize].spec.role != VdevRole::Normal {
            return Err(Error::BadVdev(format!(
                "vdev {source} is a log vdev: the balancer moves normal-class data only"
            )));
        }
        let mut avoid: Vec<VdevId> = others.to_vec();
        avoid.push(source);
        let c = &self.classes[NORMAL];
        let members: Vec<(VdevId, VdevFill, bool)> = self
            .vdevs
            .iter()
            .filter(|v| !v.removed)
            .filter_map(|v| {
                let g = v.group(NORMAL)?;
                let fill = VdevFill {
                    capacity: v.vs_space(),
                    alloc: v.vs_alloc(),
                };
                Some((
                    v.id,
                    fill,
                    c.in_ring(v.id) && g.allocatable && v.vdev_allocatable(),
                ))
            })
            .collect();
        let fills: Vec<VdevFill> = members.iter().map(|m| m.1).collect();
        let over: Vec<VdevId> = members
            .iter()
            .filter(|m| cmp_to_class(&m.1, &fills) != Ordering::Less)
            .map(|m| m.0)
            .collect();
        if members
            .iter()
            .any(|m| m.2 && !avoid.contains(&m.0) && !over.contains(&m.0))
        {
            avoid.extend(over);
        }
        avoid.sort_unstable();
        avoid.dedup();
        Ok(avoid)
    }
}
