//! `TxgSync::preloaded` reports the metaslabs a sync preloaded
//! (`metaslab.c:metaslab_group_preload@zfs-2.4.0`), and nothing else changes.

use metaslab::{Extent, Pool, Tunables, VdevRole, VdevSpec};

#[test]
fn sync_lists_the_metaslabs_it_preloaded_once() {
    let spec = VdevSpec {
        capacity: 16 << 30,
        ashift: 12,
        children: 1,
        parity: 0,
        rotational: false,
        role: VdevRole::Normal,
        metaslab_shift: Some(29),
    };
    let mut pool = Pool::restore_sorted(
        Tunables::default(),
        vec![(0, spec)],
        Vec::<Extent>::new(),
        10,
    )
    .unwrap();
    let first = pool.sync();
    assert_eq!(
        first.preloaded.len(),
        10,
        "metaslab_preload_limit of the group"
    );
    assert!(first.preloaded.iter().all(|&(v, m)| v == 0 && m < 32));
    let second = pool.sync();
    assert!(
        second.preloaded.is_empty(),
        "loaded metaslabs are not listed again"
    );
}

/// The crate unloads idle metaslabs before it preloads (DESIGN.md, "Unload
/// before preload"): preloading skips a loaded metaslab without marking it
/// selected, so once both unload delays pass, the group's best metaslabs
/// are unloaded and preloaded again in one sync, and that sync lists them.
/// (OpenZFS preloads first, marking even loaded ones selected, then evicts,
/// so they would stay loaded and nothing would be listed.)
#[test]
fn an_idle_best_metaslab_is_unloaded_and_preloaded_in_one_sync() {
    let spec = VdevSpec {
        capacity: 16 << 30,
        ashift: 12,
        children: 1,
        parity: 0,
        rotational: false,
        role: VdevRole::Normal,
        metaslab_shift: Some(29),
    };
    let mut pool = Pool::restore_sorted(
        Tunables::default(),
        vec![(0, spec)],
        Vec::<Extent>::new(),
        10,
    )
    .unwrap();
    let mut first = pool.sync_at(0).preloaded;
    first.sort_unstable();
    assert_eq!(first.len(), 10);
    // 40 txgs within 40 s: the unload delay in txgs passes, not the 600 s.
    for i in 1..=40 {
        assert!(pool.sync_at(i * 1000).preloaded.is_empty());
    }
    // Past 600 s: the one sync that unloads them preloads them again.
    let mut again = pool.sync_at(700_000).preloaded;
    again.sort_unstable();
    assert_eq!(again, first, "unloaded and preloaded in the same sync");
    assert_eq!(pool.stats().vdevs[0].loaded_metaslabs, 10);
    assert!(pool.sync_at(701_000).preloaded.is_empty());
}
