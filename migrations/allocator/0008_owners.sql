-- Owners of committed extents (issue 25): the certificate identity that
-- committed them may free or move them (and admins). Kept as runs of one
-- owner's consecutive extents on one vdev, identities numbered once; a txg
-- rewrites only the runs in the windows it changed. See
-- services/allocator/src/extent_owners.rs.
CREATE TABLE owners (
    idx       INTEGER PRIMARY KEY,
    identity  TEXT    NOT NULL UNIQUE
);
CREATE TABLE owner_runs (
    vdev    INTEGER NOT NULL,
    start   INTEGER NOT NULL,
    stop    INTEGER NOT NULL CHECK (stop > start),
    owner   INTEGER NOT NULL REFERENCES owners (idx),
    PRIMARY KEY (vdev, start)
) WITHOUT ROWID;
