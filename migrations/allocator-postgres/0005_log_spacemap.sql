-- The log space map (layout and policy: services/allocator/src/spacemap_log.rs,
-- after OpenZFS's feature@log_spacemap): each txg appends its space changes,
-- one row per metaslab it touched, and flushes a few metaslabs' changes into
-- their `spacemaps` chunks, recording the txg it flushed each at. A restart
-- replays the rows newer than their metaslab's flush txg; a flush deletes its
-- metaslab's rows, in the same transaction.
CREATE TABLE spacemap_log (
    pool      BIGINT  NOT NULL REFERENCES pools (id),
    vdev      BIGINT  NOT NULL,
    metaslab  BIGINT  NOT NULL,
    txg       BIGINT  NOT NULL,
    data      BYTEA   NOT NULL CHECK (length(data) > 0),
    PRIMARY KEY (pool, vdev, metaslab, txg)
);

CREATE TABLE metaslab_flushes (
    pool         BIGINT  NOT NULL REFERENCES pools (id),
    vdev         BIGINT  NOT NULL,
    metaslab     BIGINT  NOT NULL,
    flushed_txg  BIGINT  NOT NULL,
    PRIMARY KEY (pool, vdev, metaslab)
);
