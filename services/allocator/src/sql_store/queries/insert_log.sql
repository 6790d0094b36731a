-- One log row: a metaslab's space changes of one txg (spacemap_log.rs).
INSERT INTO spacemap_log (pool, vdev, metaslab, txg, data) VALUES ($1, $2, $3, $4, $5)
