//! The slice of `metaslab::Pool` the simulator drives, as a trait so the event
//! loop can be unit-tested against a trivial allocator. The real
//! implementation forwards every call unchanged; the simulator never makes a
//! placement or admission decision itself.

use metaslab::{
    AllocRequest, Allocation, AllocationId, ClassKind, Extent, Pool, Result, Submitted, Ticket,
    Txg, TxgSync, VdevId, VdevSpec,
};

/// What the simulator reads back from the pool at sample points.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolView {
    pub vdevs: Vec<VdevView>,
    /// Normal class space and allocated bytes (asize).
    pub normal_space: u64,
    pub normal_alloc: u64,
    pub normal_fragmentation: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct VdevView {
    pub id: VdevId,
    pub capacity: u64,
    pub alloc: u64,
    pub fragmentation: Option<u32>,
    pub aliquot: u64,
    pub queue_target: u64,
    pub queue_depth: u64,
    pub metaslab_shift: u8,
    pub metaslab_count: u32,
    pub embedded_log_metaslab: Option<u32>,
}

pub trait SimPool {
    fn add_vdev(&mut self, spec: VdevSpec) -> Result<VdevId>;
    fn set_tunable(&mut self, name: &str, value: &str) -> Result<()>;
    fn open_txg(&self) -> Txg;
    fn submit(&mut self, req: AllocRequest) -> Result<Submitted>;
    fn take_admitted(&mut self) -> Vec<Ticket>;
    /// OpenZFS's busy rule from the caller's dirty data
    /// (`Pool::busy_with_dirty`).
    fn busy_with_dirty(&self, dirty: u64, dirty_max: u64) -> bool;
    fn allocate(&mut self, ticket: Ticket, busy: bool) -> Result<Allocation>;
    fn commit(&mut self, id: AllocationId) -> Result<Txg>;
    fn free(&mut self, extents: &[Extent]) -> Result<Txg>;
    fn claim(&mut self, extents: &[Extent]) -> Result<Txg>;
    /// Close the open txg at virtual time `now_ms` (unload delay, preload).
    fn sync(&mut self, now_ms: u64) -> TxgSync;
    fn view(&self) -> PoolView;
}

impl SimPool for Pool {
    fn add_vdev(&mut self, spec: VdevSpec) -> Result<VdevId> {
        Pool::add_vdev(self, spec)
    }
    fn set_tunable(&mut self, name: &str, value: &str) -> Result<()> {
        Pool::set_tunable(self, name, value)
    }
    fn open_txg(&self) -> Txg {
        Pool::open_txg(self)
    }
    fn submit(&mut self, req: AllocRequest) -> Result<Submitted> {
        Pool::submit(self, req)
    }
    fn take_admitted(&mut self) -> Vec<Ticket> {
        Pool::take_admitted(self)
    }
    fn busy_with_dirty(&self, dirty: u64, dirty_max: u64) -> bool {
        Pool::busy_with_dirty(self, dirty, dirty_max)
    }
    fn allocate(&mut self, ticket: Ticket, busy: bool) -> Result<Allocation> {
        Pool::allocate(self, ticket, busy)
    }
    fn commit(&mut self, id: AllocationId) -> Result<Txg> {
        Pool::commit(self, id)
    }
    fn free(&mut self, extents: &[Extent]) -> Result<Txg> {
        Pool::free(self, extents)
    }
    fn claim(&mut self, extents: &[Extent]) -> Result<Txg> {
        Pool::claim(self, extents)
    }
    fn sync(&mut self, now_ms: u64) -> TxgSync {
        Pool::sync_at(self, now_ms)
    }
    fn view(&self) -> PoolView {
        let stats = self.stats();
        let mut view = PoolView::default();
        let normal = stats.classes.iter().find(|c| c.kind == ClassKind::Normal);
        if let Some(c) = normal {
            view.normal_space = c.space;
            view.normal_alloc = c.alloc;
            view.normal_fragmentation = c.fragmentation;
        }
        for v in &stats.vdevs {
            let group = normal.and_then(|c| c.groups.iter().find(|g| g.vdev == v.id));
            view.vdevs.push(VdevView {
                id: v.id,
                capacity: v.spec.capacity,
                alloc: v.alloc,
                fragmentation: group.and_then(|g| g.fragmentation),
                aliquot: group.map(|g| g.aliquot).unwrap_or(0),
                queue_target: group.map(|g| g.queue_target).unwrap_or(0),
                queue_depth: group.map(|g| g.queue_depth).unwrap_or(0),
                metaslab_shift: v.metaslab_shift,
                metaslab_count: v.metaslab_count,
                embedded_log_metaslab: v.embedded_log_metaslab,
            });
        }
        view
    }
}
