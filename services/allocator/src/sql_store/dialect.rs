//! What a database supplies to the SQL store (`super::SqlStore`): a
//! [`Dialect`] runs statements with [`Val`] parameters and reads [`Row`]s of
//! them, and says what differs between SQLite and PostgreSQL.

use futures_util::future::BoxFuture;
use metaslab::Txg;

use super::SqlStore;
use crate::store::StoreError;

/// A bound parameter or a column value. Integers are i64 (u64 values as
/// their bit patterns); the array forms are PostgreSQL's bulk inserts.
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
    Ints(Vec<i64>),
    Blobs(Vec<Vec<u8>>),
}

impl From<i64> for Val {
    fn from(v: i64) -> Val {
        Val::Int(v)
    }
}
impl From<&str> for Val {
    fn from(v: &str) -> Val {
        Val::Text(v.to_string())
    }
}
impl From<&String> for Val {
    fn from(v: &String) -> Val {
        Val::Text(v.clone())
    }
}
impl From<String> for Val {
    fn from(v: String) -> Val {
        Val::Text(v)
    }
}
impl From<Vec<u8>> for Val {
    fn from(v: Vec<u8>) -> Val {
        Val::Blob(v)
    }
}

/// The parameters of a statement, `$1` first.
macro_rules! args {
    ($($v:expr),* $(,)?) => { vec![$($crate::sql_store::Val::from($v)),*] };
}
pub(crate) use args;

/// A result row.
#[derive(Debug)]
pub struct Row(pub Vec<Val>);

impl Row {
    pub fn int(&self, k: usize) -> Result<i64, String> {
        match self.0.get(k) {
            Some(Val::Int(v)) => Ok(*v),
            other => Err(format!("column {k}: expected an integer, got {other:?}")),
        }
    }
    /// An integer column that may be NULL.
    pub fn opt_int(&self, k: usize) -> Result<Option<i64>, String> {
        match self.0.get(k) {
            Some(Val::Null) => Ok(None),
            _ => self.int(k).map(Some),
        }
    }
    pub fn real(&self, k: usize) -> Result<f64, String> {
        match self.0.get(k) {
            Some(Val::Real(v)) => Ok(*v),
            Some(Val::Int(v)) => Ok(*v as f64),
            other => Err(format!("column {k}: expected a number, got {other:?}")),
        }
    }
    pub fn text(&mut self, k: usize) -> Result<String, String> {
        match self.0.get_mut(k) {
            Some(Val::Text(v)) => Ok(std::mem::take(v)),
            other => Err(format!("column {k}: expected text, got {other:?}")),
        }
    }
    /// A blob column (SQLite text is taken as its bytes, as the driver
    /// decodes it).
    pub fn blob(&mut self, k: usize) -> Result<Vec<u8>, String> {
        match self.0.get_mut(k) {
            Some(Val::Blob(v)) => Ok(std::mem::take(v)),
            Some(Val::Text(v)) => Ok(std::mem::take(v).into_bytes()),
            other => Err(format!("column {k}: expected a blob, got {other:?}")),
        }
    }
    pub fn blob_ref(&self, k: usize) -> Result<&[u8], String> {
        match self.0.get(k) {
            Some(Val::Blob(v)) => Ok(v),
            Some(Val::Text(v)) => Ok(v.as_bytes()),
            other => Err(format!("column {k}: expected a blob, got {other:?}")),
        }
    }
}

/// The connection type of a dialect's database.
pub type Conn<D> = <<D as Dialect>::Db as sqlx::Database>::Connection;

/// A row callback of [`Dialect::each`].
pub type EachRow<'c> = &'c mut (dyn FnMut(Row) -> Result<(), String> + Send);

/// What differs between the SQL databases. The executors bind [`Val`]s and
/// read rows into them, so everything else is written once, over any
/// dialect, without the driver's generic bounds.
pub trait Dialect: Send + Sync + Sized + 'static {
    type Db: sqlx::Database;
    /// Insert chunks `($1 pool, $2 vdev, $3 start, $4 width, $5 data)`.
    const INSERT_SPACEMAP: &'static str;
    /// Insert owner maps `($1 pool, $2 rows, $3 data)`: `$2` a JSON array of
    /// `[vdev, start, offset, length]`, each row's data the bytes of `$3` at
    /// that 1-based offset (one statement for many rows).
    const INSERT_OWNER_MAP: &'static str;
    /// The copies `($1 pool, $2 vdev, $3 starts)` of the blocks with a copy
    /// on the vdev at one of the starts, a JSON array (the one list form
    /// both databases read): rows `(start, vdev, offset)` by start.
    const COPIES_ON: &'static str;
    /// Delete the owner maps `($1 pool)` in any of the spans `$2`, a JSON
    /// array of `[vdev, start, end]` (one statement for a txg's windows).
    const DELETE_OWNER_WINDOWS: &'static str;
    /// [`Self::INSERT_SPACEMAP`] takes arrays (one statement per run)
    /// rather than one row.
    const ARRAYS: bool;
    /// The legacy one-row-per-extent table's read and delete, if the
    /// database may hold one (SQLite files from before space maps).
    const LEGACY_EXTENTS: Option<(&'static str, &'static str)>;
    /// Run first in `load`'s transaction (a consistent snapshot).
    const SNAPSHOT: Option<&'static str>;
    /// Opens a txg's transaction. It must be refused, not nested as a
    /// SAVEPOINT, on a connection the driver still counts as inside a
    /// transaction (a plain `BEGIN` there would commit nothing).
    const BEGIN_TXG: &'static str;

    /// Run a statement; rows affected.
    fn exec<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;
    /// Run a query; all its rows.
    fn fetch<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
    ) -> BoxFuture<'c, Result<Vec<Row>, sqlx::Error>>;
    /// Run a query, handing each row to `f` as it streams in (never all
    /// materialised).
    fn each<'c>(
        c: &'c mut Conn<Self>,
        sql: &'static str,
        args: Vec<Val>,
        f: EachRow<'c>,
    ) -> BoxFuture<'c, Result<(), String>>;

    /// First in a txg's transaction: refuse (and remember) a writer that no
    /// longer owns the pool. Stores with one writer by construction pass.
    fn fence<'c>(
        s: &'c SqlStore<Self>,
        c: &'c mut Conn<Self>,
        txg: Txg,
    ) -> BoxFuture<'c, Result<(), StoreError>>;
    /// After a txg's commit, on the connection that committed it. The txg
    /// is durable already: an error here only retires the connection.
    fn after_commit(c: &mut Conn<Self>, txg: Txg) -> BoxFuture<'_, Result<(), StoreError>>;
    /// [`Store::open_generation`].
    fn open_generation(s: &SqlStore<Self>) -> BoxFuture<'_, Result<u64, StoreError>>;
    /// [`Store::fenced`].
    fn fenced(s: &SqlStore<Self>) -> bool;
    /// [`Store::handed_over_cleanly`].
    fn handed_over_cleanly(s: &SqlStore<Self>) -> bool;
}
