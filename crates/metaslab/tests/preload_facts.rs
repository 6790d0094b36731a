//! `TxgSync::preloaded` reports the metaslabs a sync preloaded (spec §2.10),
//! and nothing else changes.

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
