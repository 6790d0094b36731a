//! One owner per data dir. Two allocators on one store would hand the same
//! extents to two clients; the lock (an exclusive `flock` on
//! `<data-dir>/allocator.lock`, held for the process's lifetime and dropped
//! by the kernel however the process ends) makes a second one exit at once,
//! naming the holder recorded in the file. `aliquotctl up` takes one of its
//! own (`up.lock`) so a second `up` on a running pool starts nothing.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside `--data-dir`.
pub const LOCK_FILE: &str = "allocator.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "data dir {dir} is in use by another {what} ({holder}); stop it first, or point \
         --data-dir elsewhere"
    )]
    Held {
        dir: String,
        what: String,
        holder: String,
    },
    #[error("cannot lock data dir {dir}: {reason}")]
    Io { dir: String, reason: String },
}

/// Held while the allocator runs.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
    pub path: PathBuf,
}

impl DataDirLock {
    /// The allocator's lock on its data dir.
    pub fn acquire(dir: &Path) -> Result<DataDirLock, LockError> {
        Self::acquire_named(dir, LOCK_FILE, "allocator")
    }

    /// Lock `dir/file` for a `what` (named in the refusal).
    pub fn acquire_named(dir: &Path, file: &str, what: &str) -> Result<DataDirLock, LockError> {
        let io = |reason: String| LockError::Io {
            dir: dir.display().to_string(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(format!("cannot create it: {e}")))?;
        let path = dir.join(file);
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
                    dir: dir.display().to_string(),
                    what: what.to_string(),
                    holder: if holder.is_empty() {
                        "holder unknown".into()
                    } else {
                        holder.to_string()
                    },
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(format!("flock: {e}"))),
        }
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "?".into());
        let who = format!(
            "pid {} on host {host}, since unix time {since}\n",
            std::process::id()
        );
        let write = |f: &mut File| -> std::io::Result<()> {
            f.set_len(0)?;
            f.seek(SeekFrom::Start(0))?;
            f.write_all(who.as_bytes())?;
            f.sync_all()
        };
        write(&mut file).map_err(|e| io(format!("cannot record the holder: {e}")))?;
        Ok(DataDirLock { _file: file, path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDirLock::acquire(dir.path()).unwrap();
        let err = DataDirLock::acquire(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, LockError::Held { .. }), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        DataDirLock::acquire(dir.path()).unwrap();
    }
}
