//! OpenZFS's class balance (`metaslab.c:metaslab_class_balance@zfs-2.4.0`)
//! over a class's ring: each group's aliquot and queue target, and the
//! class's per-allocator budget `alloc_max`, recomputed at every sync and
//! when a larger block raises `alloc_io_size`. The arithmetic, in OpenZFS's
//! integer order, is `throttle::unified::balance`; this file gathers its
//! inputs from the pool and writes the results back to the groups.

use crate::throttle::{legacy, unified};

use crate::pool::*;

impl Pool {
    /// Recount `mc_groups` and `mc_alloc_groups` over the ring.
    pub(crate) fn recount(&mut self, ci: usize) {
        let c = &mut self.classes[ci];
        let (mut groups, mut alloc_groups) = (0, 0);
        for &v in &c.ring {
            let vd = &self.vdevs[v as usize];
            if vd.vs_space() > 0 {
                groups += 1;
            }
            if vd.group(ci).is_some_and(|g| g.allocatable) {
                alloc_groups += 1;
            }
        }
        c.groups = groups;
        c.alloc_groups = alloc_groups;
    }

    /// `metaslab.c:metaslab_class_balance@zfs-2.4.0` over the ring; onsync also
    /// moves `alloc_io_size` and refreshes the throttle flag.
    pub(crate) fn metaslab_class_balance(&mut self, ci: usize, onsync: bool) {
        let t = &self.tun;
        let c = &mut self.classes[ci];
        if onsync || (!c.throttle_initialized && c.groups > 0) {
            if onsync {
                c.alloc_io_size = unified::io_size_onsync(c.alloc_io_size, t.aliquot());
            }
            c.throttle_enabled = !c.is_log && t.zio_dva_throttle_enabled && c.groups > 0;
            c.throttle_initialized = c.groups > 0;
        }
        let mut inputs = std::mem::take(&mut c.inputs);
        let mut quotas = std::mem::take(&mut c.quotas);
        inputs.clear();
        let (mut space, mut alloc) = (0u64, 0u64);
        for &v in &c.ring {
            let vd = &self.vdevs[v as usize];
            let vs_space = vd.vs_space();
            inputs.push(unified::GroupInput {
                data_children: vd.data_children,
                vs_space,
                vs_alloc: vd.vs_alloc(),
            });
            if let Some(g) = vd.group(ci)
                && vs_space > 0
            {
                space += g.space;
                alloc += g.alloc;
            }
        }
        // Offline vdevs left the ring (OpenZFS passivates their groups, so
        // they are not in `mc_groups`), but their metaslabs still count in
        // the class's space until `metaslab_fini`
        // (`metaslab.c:metaslab_group_passivate` and
        // `metaslab_class_balance@zfs-2.4.0`): every group's share of the
        // class is then smaller, as OpenZFS computes it.
        for vd in &self.vdevs {
            if vd.removed || vd.online || c.in_ring(vd.id) {
                continue;
            }
            if let Some(g) = vd.group(ci)
                && vd.vs_space() > 0
            {
                space += g.space;
                alloc += g.alloc;
            }
        }
        let mc = unified::ClassInput {
            groups: c.groups,
            space,
            alloc,
            alloc_io_size: c.alloc_io_size,
            metaslab_aliquot: t.aliquot(),
            bias_enabled: t.metaslab_bias_enabled,
        };
        c.alloc_max = unified::balance(&mc, &inputs, &mut quotas);
        for (i, &v) in c.ring.iter().enumerate() {
            let vd = &mut self.vdevs[v as usize];
            let dc = vd.data_children;
            if let Some(g) = vd.group_mut(ci) {
                let q = quotas.get(i).copied().unwrap_or(unified::GroupQuota {
                    aliquot: 0,
                    queue_target: 0,
                });
                g.aliquot = q.aliquot;
                g.queue_target = q.queue_target;
                g.legacy_aliquot = legacy::group_aliquot(t.aliquot(), dc);
            }
        }
        c.inputs = inputs;
        c.quotas = quotas;
    }
}
