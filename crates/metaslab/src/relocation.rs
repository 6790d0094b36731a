//! Where a balancer move may place its new copy (`Relocate`): never on the
//! source vdev or the block's other copies (a removal's move may use the
//! other copies' vdevs only when no other vdev has room for it, or the
//! removal could never end), and, while some allocatable
//! vdev of the class is below the class's fill, only on such a vdev — a
//! move onto another over-full vdev would only have to move again
//! (measured: 1.5× the bytes for the same score without this rule). The
//! throttle then places it among those as it places any block
//! (`Pool::allocate_avoiding`).

use std::cmp::Ordering;

use crate::balance_score::{VdevFill, cmp_to_class};
use crate::pool::{NORMAL, Pool};
use crate::{Error, Extent, Health, Result, VdevId, VdevRole};

impl Pool {
    /// The logical size (psize) a move of `from` must place: `psize` when
    /// the caller knows it (the block's length in its manifest), else the
    /// largest block `from`'s allocation can hold on its vdev
    /// ([`crate::vdev::asize_to_psize`]). Never the old asize itself: on
    /// RAIDZ that includes parity and padding, and a block moved with it
    /// would grow at every move. OpenZFS never meets
    /// this: it refuses device removal with parity vdevs
    /// (`vdev_removal.c:spa_vdev_remove_top_check@zfs-2.4.0`).
    pub fn relocation_psize(&self, from: &Extent, psize: u64) -> Result<u64> {
        self.check_present(from.vdev)?;
        let spec = &self.vdevs[from.vdev as usize].spec;
        let most = crate::vdev::asize_to_psize(spec, crate::vdev::Asize(from.size)).0;
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

    /// [`Self::relocation_avoid`] for a move that must happen (a vdev
    /// removal's): the block's other copies `others` are avoided while a
    /// vdev of the class other than `source` and them has `need` bytes free
    /// and can take them once it is reachable: online (an operator's
    /// offline is meant) and not faulted. One that is unavailable for now
    /// (its agent away, or not yet reported to a new leader) counts: the
    /// move then finds no vdev and is tried again later, rather than join
    /// two copies of a block for good. Only when no vdev can, two copies
    /// may share a vdev (OpenZFS's removal does not keep ditto copies apart
    /// either, `vdev_removal.c:spa_vdev_copy_segment@zfs-2.4.0`). Returns
    /// the vdevs to avoid and whether the other copies are among them.
    pub fn removal_avoid(
        &self,
        source: VdevId,
        others: &[VdevId],
        need: u64,
    ) -> Result<(Vec<VdevId>, bool)> {
        let kept_apart = self.relocation_avoid(source, others)?;
        let c = &self.classes[NORMAL];
        let room = self.vdevs.iter().any(|v| {
            !v.removed
                && v.id != source
                && !others.contains(&v.id)
                && v.group(NORMAL).is_some()
                && c.in_ring(v.id)
                && v.online
                && v.health != Health::Faulted
                && v.vs_space().saturating_sub(v.vs_alloc()) >= need
        });
        if room || others.is_empty() {
            Ok((kept_apart, !others.is_empty()))
        } else {
            Ok((self.relocation_avoid(source, &[])?, false))
        }
    }
}
