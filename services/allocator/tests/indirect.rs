//! The indirect mapping over real gRPC, on SQLite across restarts: a move
//! committed with Relocate's keep_address leaves the old extent allocated
//! behind a mapping entry; ReadTokens of the old address names the new
//! extent; Free of either address frees both and drops the entry; Remap
//! drops it and frees the old extent; an old address is not moved again,
//! a new home moved keeping its address repoints the entry (one hop);
//! the entries are back after a restart; status counts them.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aliquot_allocator::{SqliteStore, sqlite_store};
use aliquot_proto::v1 as pb;
use common::*;

fn reason(s: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

async fn open(dir: &Path) -> Arc<SqliteStore> {
    Arc::new(
        SqliteStore::open(&dir.join(sqlite_store::DB_FILE), "aliquot", None)
            .await
            .expect("open store"),
    )
}

fn restart_config() -> aliquot_allocator::Config {
    let mut c = config();
    c.claim_window = Duration::ZERO;
    c
}

fn total_alloc(p: &pb::PoolStatus) -> u64 {
    p.vdevs.iter().map(|v| v.alloc).sum()
}

async fn read_at(h: &mut Harness, e: pb::Extent) -> Result<pb::Extent, tonic::Status> {
    h.alloc
        .read_tokens(pb::ReadTokensRequest { extents: vec![e] })
        .await
        .map(|r| r.into_inner().locations[0])
}

async fn free(h: &mut Harness, e: pb::Extent) -> Result<u64, tonic::Status> {
    h.alloc
        .free(pb::FreeRequest { extents: vec![e] })
        .await
        .map(|r| r.into_inner().txg)
}

async fn remap(h: &mut Harness, e: pb::Extent) -> Result<pb::RemapReply, tonic::Status> {
    h.alloc
        .remap(pb::RemapRequest { extents: vec![e] })
        .await
        .map(|r| r.into_inner())
}

/// Move `from` keeping its address; returns its new extent.
async fn move_keeping(h: &mut Harness, from: pb::Extent) -> Result<pb::Extent, tonic::Status> {
    let r = h
        .alloc
        .relocate(pb::RelocateRequest {
            extent: Some(from),
            keep_address: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    h.commit(vec![r.allocation_id]).await?;
    Ok(r.extents[0])
}

/// Sync enough txgs that deferred frees are free.
async fn settle(h: &mut Harness) {
    for _ in 0..3 {
        h.sync().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_address_answers_for_its_moved_block_until_remapped_or_freed() {
    let dir = tempfile::tempdir().unwrap();
    let mut h = start_with(restart_config(), open(dir.path()).await).await;
    let a = h.add_vdev(1, GIB).await;
    let b = h.add_vdev(2, GIB).await;
    let mut blocks = Vec::new();
    while blocks.len() < 4 {
        let r = h.allocate(MIB).await.unwrap();
        h.commit(vec![r.allocation_id]).await.unwrap();
        if r.extents[0].vdev == a {
            blocks.push(r.extents[0]);
        }
    }
    settle(&mut h).await;
    let before = total_alloc(&h.pool().await);

    // Four moves a -> b keeping their addresses.
    let mut new = Vec::new();
    for from in &blocks {
        let to = move_keeping(&mut h, *from).await.expect("move");
        assert_eq!((to.vdev, to.size), (b, from.size));
        new.push(to);
    }
    settle(&mut h).await;
    // Nothing freed: the old extents are held by their entries.
    let p = h.pool().await;
    assert_eq!(total_alloc(&p), before + 4 * MIB);
    assert_eq!((p.mapping_entries, p.mapping_bytes), (4, 4 * MIB));
    assert_eq!(p.mapping_memory_bytes, 4 * 40);
    let on = |p: &pb::PoolStatus, v| {
        p.vdevs
            .iter()
            .find(|s| s.vdev == v)
            .unwrap()
            .mapping_entries
    };
    assert_eq!((on(&p, a), on(&p, b)), (4, 0));
    for (from, to) in blocks.iter().zip(&new) {
        assert_eq!(read_at(&mut h, *from).await.unwrap(), *to);
        // The new extent is an ordinary committed block too.
        assert_eq!(read_at(&mut h, *to).await.unwrap(), *to);
    }
    // The old address does not move again while the entry lives, nor does
    // the new home by a move that frees it (the entry would point at freed
    // space).
    let err = move_keeping(&mut h, blocks[0]).await.unwrap_err();
    assert_eq!(reason(&err), "MAPPED_EXTENT", "{err:?}");
    let err = h
        .alloc
        .relocate(pb::RelocateRequest {
            extent: Some(new[0]),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&err), "MAPPED_EXTENT", "{err:?}");
    // The new home moved keeping its address: the entry points at the
    // newest home (one hop, the count unchanged) and the home it left is
    // freed.
    let newest = move_keeping(&mut h, new[3])
        .await
        .expect("move the new home");
    assert_eq!((newest.vdev, newest.size), (a, new[3].size));
    assert_eq!(read_at(&mut h, blocks[3]).await.unwrap(), newest);
    let err = read_at(&mut h, new[3]).await.unwrap_err();
    assert_eq!(reason(&err), "READ_TOKEN_NOT_COMMITTED", "{err:?}");
    new[3] = newest;
    settle(&mut h).await;
    let p = h.pool().await;
    assert_eq!((p.mapping_entries, p.mapping_bytes), (4, 4 * MIB));
    assert_eq!(total_alloc(&p), before + 4 * MIB);

    // A restart loads the entries back.
    h.server.shutdown().await.unwrap();
    let mut h = start_with(restart_config(), open(dir.path()).await).await;
    assert_eq!(h.rejoin(1, GIB).await, a);
    assert_eq!(h.rejoin(2, GIB).await, b);
    let p = h.pool().await;
    assert_eq!((p.mapping_entries, p.mapping_bytes), (4, 4 * MIB));
    assert_eq!(total_alloc(&p), before + 4 * MIB);
    for (from, to) in blocks.iter().zip(&new) {
        assert_eq!(read_at(&mut h, *from).await.unwrap(), *to);
    }

    // Remap: the new address is acknowledged, the old extent freed.
    let r = remap(&mut h, blocks[0]).await.expect("remap");
    assert_eq!(r.locations, vec![new[0]]);
    let err = remap(&mut h, blocks[0]).await.unwrap_err();
    assert_eq!(reason(&err), "NOT_MAPPED", "{err:?}");
    let err = read_at(&mut h, blocks[0]).await.unwrap_err();
    assert_eq!(reason(&err), "READ_TOKEN_NOT_COMMITTED", "{err:?}");
    assert_eq!(read_at(&mut h, new[0]).await.unwrap(), new[0]);
    // Never mapped: nothing to remap.
    let err = remap(&mut h, new[0]).await.unwrap_err();
    assert_eq!(reason(&err), "NOT_MAPPED", "{err:?}");

    // Free at the old address frees both extents.
    free(&mut h, blocks[1]).await.expect("free the old address");
    // Free at the new address frees both too.
    free(&mut h, new[2]).await.expect("free the new address");
    for e in [blocks[1], new[1], blocks[2], new[2]] {
        let err = read_at(&mut h, e).await.unwrap_err();
        assert_eq!(reason(&err), "READ_TOKEN_NOT_COMMITTED", "{e:?}: {err:?}");
    }
    settle(&mut h).await;
    let p = h.pool().await;
    assert_eq!((p.mapping_entries, p.mapping_bytes), (1, MIB));
    assert_eq!((on(&p, a), on(&p, b)), (1, 0));
    // Moved (one old extent freed by Remap), two blocks freed whole, one
    // old extent still held.
    assert_eq!(total_alloc(&p), before + 4 * MIB - MIB - 4 * MIB);
    // A second Free of either address: already freed.
    let err = free(&mut h, blocks[1]).await.unwrap_err();
    assert_eq!(reason(&err), "NOT_ALLOCATED", "{err:?}");

    // And after another restart exactly the one live entry is back.
    h.server.shutdown().await.unwrap();
    let mut h = start_with(restart_config(), open(dir.path()).await).await;
    h.rejoin(1, GIB).await;
    h.rejoin(2, GIB).await;
    let p = h.pool().await;
    assert_eq!((p.mapping_entries, p.mapping_bytes), (1, MIB));
    assert_eq!(read_at(&mut h, blocks[3]).await.unwrap(), new[3]);
    let err = read_at(&mut h, blocks[2]).await.unwrap_err();
    assert_eq!(reason(&err), "READ_TOKEN_NOT_COMMITTED", "{err:?}");
}
