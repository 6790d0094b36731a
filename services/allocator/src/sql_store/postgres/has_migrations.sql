SELECT EXISTS (SELECT 1 FROM information_schema.tables
    WHERE table_schema = current_schema() AND table_name = '_sqlx_migrations')::INT
