//! A kept cluster whose parent folder is private (mode 0700, as `mktemp
//! -d` makes it, or `/root`): as root the server runs as another user
//! that may not pass through that folder, and still initdb's, starts, and
//! starts again on what it made (before, initdb failed: "Permission
//! denied"). Not root: the same, as this user.

use std::os::unix::fs::PermissionsExt;

#[test]
fn a_cluster_under_a_private_folder_starts_and_starts_again() {
    let private = tempfile::tempdir().unwrap();
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let dir = private.path().join("pool").join("postgres");
    let mut pg = local_postgres::Postgres::start_in(&dir, 0).expect("initdb and start");
    assert!(dir.join("data").join("PG_VERSION").exists());
    pg.stop_fast();
    drop(pg);
    let pg = local_postgres::Postgres::start_in(&dir, 0).expect("start again on the kept cluster");
    assert!(pg.pid().is_some());
}
