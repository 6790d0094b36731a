//! What every Aliquot process shares, server or `aliquotctl`: the lock that
//! gives a data dir one owner ([`lock`]), supervision by a parent that
//! started it ([`watch_parent`]: `aliquotctl up` starts the service
//! binaries as children), the runtime and malloc set-up of `main`, and
//! the arguments of the store tools the CLI forwards to the allocator
//! binary, which owns the stores ([`verify_args`] for `verify`,
//! [`migrate_args`] for `migrate-store`: both binaries parse the same).
//! Small on purpose: the CLI links this, never a server.

pub mod lock;
pub mod migrate_args;
pub mod verify_args;

/// Set in a child's environment by the process that supervises it (`up`):
/// watch stdin, stop at EOF.
pub const SUPERVISED_ENV: &str = "ALIQUOTCTL_SUPERVISED";

/// The supervised side: when `SUPERVISED_ENV` is set and the parent's pipe
/// on stdin closes (the parent exited, however it died), SIGTERM ourselves
/// so the service shuts down by its usual path. Without the variable, a
/// no-op. Call once, early in `main`.
pub fn watch_parent() {
    if std::env::var_os(SUPERVISED_ENV).is_none() {
        return;
    }
    std::thread::spawn(|| {
        use std::io::Read;
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        // SAFETY: kill(2) on our own pid with a valid signal number has no
        // memory effects; getpid cannot fail.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGTERM);
        }
    });
}

/// The multi-threaded runtime every binary runs on: `worker_threads`
/// network threads, or tokio's default (one per core).
pub fn runtime(worker_threads: Option<u16>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = worker_threads {
        b.worker_threads(n.into());
    }
    b.enable_all().build()
}

/// Keep large I/O buffers in malloc's arenas instead of fresh `mmap`s: by
/// default glibc maps (and on free, unmaps) every allocation above 128 KiB,
/// so each 1 MiB write's decode buffers page-fault afresh, 256 faults per
/// MiB. Measured with the agent's seq_write bench: about 10x fewer page
/// faults and a quarter less CPU per MiB. Call once at startup, before any
/// threads.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; it is called before
    // other threads allocate, and invalid values are rejected, not UB.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}
