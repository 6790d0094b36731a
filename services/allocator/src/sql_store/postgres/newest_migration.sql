SELECT MAX(version) FROM _sqlx_migrations
