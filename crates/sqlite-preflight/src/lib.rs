//! The schema half of the "refuse before touching" rule shared by the
//! allocator's and the metrics service's SQLite stores: on a read-only
//! connection, a database is accepted only if it is empty, or its
//! `_sqlx_migrations` are a prefix of the binary's own (same versions and
//! checksums, all successful) and it holds no tables the binary does not know.
//! Each store keeps its own file-level checks and error type.
#![forbid(unsafe_code)]

use sqlx::migrate::Migrator;
use sqlx::{Row, SqliteConnection};

/// `Ok` for an empty database or one of ours at a version we know; otherwise
/// a sentence saying why, for the caller's refusal error. `binary` names the
/// program to upgrade; `hint` (may be empty) is appended to refusals the
/// operator fixes by pointing at another file.
pub async fn check_schema(
    conn: &mut SqliteConnection,
    migrator: &Migrator,
    our_tables: &[&str],
    binary: &str,
    hint: &str,
) -> Result<(), String> {
    let hint = if hint.is_empty() {
        String::new()
    } else {
        format!("; {hint}")
    };
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| format!("cannot read its schema (corrupt?): {e}"))?;
    if tables.is_empty() {
        return Ok(());
    }
    if !tables.iter().any(|t| t == "_sqlx_migrations") {
        return Err(format!(
            "it is a foreign SQLite database (tables {tables:?}, no _sqlx_migrations){hint}"
        ));
    }
    // Before the migrations: another sqlx program's database is named by its
    // tables, which says more than "migration 1 differs".
    let foreign: Vec<&String> = tables
        .iter()
        .filter(|t| !our_tables.contains(&t.as_str()))
        .collect();
    if !foreign.is_empty() {
        return Err(format!(
            "it is a foreign SQLite database (tables this binary does not know: {foreign:?}){hint}"
        ));
    }
    let applied =
        sqlx::query("SELECT version, checksum, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| format!("cannot read _sqlx_migrations: {e}"))?;
    let known_max = migrator.iter().map(|m| m.version).max().unwrap_or(0);
    for row in applied {
        let version: i64 = row.try_get(0).map_err(|e| e.to_string())?;
        let checksum: Vec<u8> = row.try_get(1).map_err(|e| e.to_string())?;
        let success: bool = row.try_get(2).map_err(|e| e.to_string())?;
        if version > known_max {
            return Err(format!(
                "its schema version {version} is newer than this binary knows ({known_max}); run a newer {binary}"
            ));
        }
        let Some(known) = migrator.iter().find(|m| m.version == version) else {
            return Err(format!(
                "it records migration {version}, which this binary does not have (foreign database){hint}"
            ));
        };
        if *known.checksum != *checksum {
            return Err(format!(
                "its migration {version} ({}) differs from this binary's (foreign or edited database){hint}",
                known.description
            ));
        }
        if !success {
            return Err(format!(
                "migration {version} failed earlier and left the schema dirty; restore a backup{hint}"
            ));
        }
    }
    Ok(())
}
