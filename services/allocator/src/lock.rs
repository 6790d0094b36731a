//! One owner per store: the allocator holds an exclusive `flock` on
//! `<data-dir>/allocator.lock` for its whole life (the kernel drops it when
//! the process dies, even by `kill -9`, so a crash never leaves it stale).
//! The file says who holds it (pid, host, since) so a second allocator, or
//! `aliquotctl verify --repair-vdev`, refuses at once naming the holder
//! instead of sharing the SQLite files (which handed one extent to two
//! clients in issue 10).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file inside `--data-dir`.
pub const LOCK_FILE: &str = "allocator.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "data dir {dir} is in use by another allocator ({holder}); stop it first, or point --data-dir elsewhere"
    )]
    Held { dir: String, holder: String },
    #[error("cannot lock data dir {dir}: {reason}")]
    Io { dir: String, reason: String },
}

/// The held lock; dropping it (or exiting) releases it.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
    path: PathBuf,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown host".into())
}

impl DataDirLock {
    /// Take the lock on `dir` (created if absent) or fail naming the holder.
    /// `what` says who takes it (written into the file), e.g. "allocator".
    pub fn acquire(dir: &Path, what: &str) -> Result<DataDirLock, LockError> {
        let d = dir.display().to_string();
        let io = |reason: String| LockError::Io {
            dir: d.clone(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(format!("cannot create it: {e}")))?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io(format!("cannot open {}: {e}", path.display())))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(LockError::Held {
                    dir: d,
                    holder: if holder.is_empty() {
                        "holder unknown".into()
                    } else {
                        holder.to_string()
                    },
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(format!("flock: {e}"))),
        }
        let since = crate::convert::unix_ms();
        let line = format!(
            "{what} pid {} on {} since unix ms {since}\n",
            std::process::id(),
            hostname()
        );
        file.set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(line.as_bytes()))
            .and_then(|_| file.sync_all())
            .map_err(|e| io(format!("cannot write {}: {e}", path.display())))?;
        Ok(DataDirLock { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_dir_fails_naming_the_first_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDirLock::acquire(dir.path(), "allocator").unwrap();
        // flock locks belong to the open file description: a second open in
        // this process conflicts exactly as another process would.
        let e = DataDirLock::acquire(dir.path(), "allocator").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        DataDirLock::acquire(dir.path(), "allocator").expect("released on drop");
    }
}
