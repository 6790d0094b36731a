//! Device backends behind one blocking trait, called only from the I/O worker
//! threads (never from the async runtime): `file` (a regular file or a block
//! device, positioned I/O with `FileExt`) and `sim` (see [`crate::sim`]).
//! Offsets here are relative to the data area; the label lives before it.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;

use crate::config::{BackendKind, Config, DIRECT_MIN_SIZE_DEFAULT, DirectLargeWrites};
use crate::error::AgentError;
use crate::label::{self, Found, LABEL_BLOCK, LABEL_SIZE, Label};
use crate::sim::SimDevice;

/// One device's data area. Implementations are called from several worker
/// threads at once; the caller has validated range and alignment.
pub trait Device: Send + Sync + 'static {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Write `bufs` back to back from `offset`: an aggregated I/O of
    /// several requests. The default gathers them into one buffer; the file
    /// backend hands them to the kernel as they are (`pwritev`), so the
    /// received payloads are never copied on the way.
    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        self.write_at(offset, &bufs.concat())
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Make every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// How data reaches the medium, for the agent's startup line.
    fn data_io(&self) -> String {
        "memory".into()
    }
}

/// What the agent knows about its device once it is open.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub guid: u64,
    pub name: String,
    pub backend: BackendKind,
    /// Bytes of the data area (label excluded, a multiple of the sector).
    pub capacity: u64,
    pub ashift: u32,
    pub rotational: bool,
    /// A file device's path: its file system is asked for free space after
    /// a write met ENOSPC (None: a simulated device).
    pub path: Option<std::path::PathBuf>,
}

pub struct Opened {
    pub device: Box<dyn Device>,
    pub info: DeviceInfo,
    /// The pool's marks in the device's label area.
    pub uberblocks: crate::uberblock::Uberblocks,
}

/// Open (or create) the device the config names.
pub fn open(cfg: &Config) -> Result<Opened, AgentError> {
    match cfg.backend {
        BackendKind::File => {
            let path = cfg.path.as_deref().ok_or_else(|| {
                AgentError::Config("--backend file needs --path FILE_OR_DEVICE".into())
            })?;
            let LabelledFile {
                file,
                label,
                block_device,
            } = open_file(path, cfg)?;
            let direct = if wants_direct(cfg, block_device) {
                if let Some(min) = cfg.direct_min_size {
                    // Said, not silent: the flag asked for less than this.
                    tracing::warn!(
                        path = %path.display(),
                        "--direct-min-size {min}: ignored, {} is a block device and all its \
                         I/O is direct already",
                        path.display()
                    );
                }
                DirectIo::All(open_direct(path)?)
            } else if cfg.buffered {
                DirectIo::Off
            } else {
                // Large writes only: the file stays usable without it.
                match open_direct(path) {
                    Ok(file) => DirectIo::LargeWrites {
                        file,
                        min: cfg
                            .direct_min_size
                            .unwrap_or(DIRECT_MIN_SIZE_DEFAULT)
                            .max(DIRECT_ALIGN as u64),
                        holes: (cfg.direct_large_writes == DirectLargeWrites::Holes)
                            .then(Holes::default),
                    },
                    // Asked for: said. The default on a filesystem without
                    // O_DIRECT (tmpfs): buffered as always, quietly.
                    Err(e) if cfg.direct_min_size.is_some() => {
                        tracing::warn!("--direct-min-size: large writes stay buffered too: {e}");
                        DirectIo::Off
                    }
                    Err(e) => {
                        tracing::debug!("large writes stay buffered: {e}");
                        DirectIo::Off
                    }
                }
            };
            let name = cfg.name.clone().unwrap_or_else(|| label.name.clone());
            let uberblocks = file
                .try_clone()
                .and_then(crate::uberblock::Uberblocks::open)
                .map_err(|e| {
                    AgentError::Label(format!(
                        "cannot read the pool marks of {}: {e}",
                        path.display()
                    ))
                })?;
            Ok(Opened {
                uberblocks,
                info: DeviceInfo {
                    guid: label.guid,
                    name,
                    backend: BackendKind::File,
                    capacity: label.data_capacity(),
                    ashift: label.ashift,
                    rotational: cfg.rotational,
                    path: Some(path.to_path_buf()),
                },
                device: Box::new(FileDevice {
                    file,
                    direct,
                    writeback: Writeback::default(),
                }),
            })
        }
        BackendKind::Sim => {
            let size = cfg
                .capacity
                .ok_or_else(|| AgentError::Config("--backend sim needs --capacity SIZE".into()))?;
            let capacity = label::data_capacity(size, cfg.ashift);
            Ok(Opened {
                uberblocks: crate::uberblock::Uberblocks::in_memory(),
                info: DeviceInfo {
                    guid: cfg.guid.unwrap_or_else(new_guid),
                    name: cfg.name.clone().unwrap_or_else(|| "sim".into()),
                    backend: BackendKind::Sim,
                    capacity,
                    ashift: cfg.ashift,
                    rotational: cfg.rotational,
                    path: None,
                },
                device: Box::new(SimDevice::new(
                    capacity,
                    cfg.bandwidth,
                    cfg.latency.unwrap_or_default(),
                )),
            })
        }
    }
}

/// O_DIRECT when asked, and by default on a block device whose sectors
/// are O_DIRECT-sized (as OpenZFS writes to disks without a page cache);
/// `--buffered` keeps the page cache.
fn wants_direct(cfg: &Config, block_device: bool) -> bool {
    let default = cfg!(target_os = "linux") && block_device && cfg.ashift >= 12;
    cfg.direct || (default && !cfg.buffered)
}

/// A random non-zero guid (std's `RandomState` is seeded from the OS).
pub fn new_guid() -> u64 {
    use std::hash::BuildHasher;
    loop {
        let g = std::collections::hash_map::RandomState::new()
            .hash_one((std::time::SystemTime::now(), std::process::id()));
        if g != 0 {
            return g;
        }
    }
}

/// A file or block device opened, locked and labelled.
struct LabelledFile {
    file: File,
    label: Label,
    /// A block device (not a regular file): O_DIRECT by default.
    block_device: bool,
}

fn open_file(path: &Path, cfg: &Config) -> Result<LabelledFile, AgentError> {
    let shown = path.display();
    let io = |what: &str| {
        let what = format!("{what} {shown}");
        move |e: io::Error| AgentError::Label(format!("cannot {what}: {e}"))
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io("open"))?;
    // One agent per device: a second agent on the same file would corrupt it.
    file.try_lock().map_err(|e| {
        AgentError::Label(format!("{shown} is in use (locked by another agent?): {e}"))
    })?;
    let meta = file.metadata().map_err(io("stat"))?;
    let block = meta.file_type().is_block_device();
    let size = if block {
        (&file).seek(SeekFrom::End(0)).map_err(io("size"))?
    } else {
        meta.len()
    };

    let found = if size == 0 {
        Found::Blank
    } else if size < LABEL_BLOCK as u64 {
        Found::Foreign(format!(
            "{size} bytes of other data, too small for a device"
        ))
    } else {
        let mut b = vec![0u8; LABEL_BLOCK];
        file.read_exact_at(&mut b, 0)
            .map_err(io("read the label of"))?;
        match Label::decode(&b) {
            // Blank only if the whole label area is: a ZFS vdev label, for
            // one, starts 16 KiB in, after zeroed boot blocks.
            Found::Blank => {
                let mut area = vec![0u8; size.min(LABEL_SIZE) as usize];
                file.read_exact_at(&mut area, 0)
                    .map_err(io("read the label area of"))?;
                match area.iter().position(|&x| x != 0) {
                    None => Found::Blank,
                    Some(at) => Found::Foreign(format!(
                        "other data at byte {at} of its first MiB (another label or a filesystem?)"
                    )),
                }
            }
            found => found,
        }
    };

    match found {
        Found::Label(l) => {
            if l.ashift != cfg.ashift {
                return Err(AgentError::Label(format!(
                    "{shown} was labelled with ashift {}, not --ashift {}; pass --ashift {}",
                    l.ashift, cfg.ashift, l.ashift
                )));
            }
            if size < l.device_size {
                return Err(AgentError::Label(format!(
                    "{shown} is {size} bytes but its label says {}: the device was truncated",
                    l.device_size
                )));
            }
            if let Some(c) = cfg.capacity
                && c != l.device_size
            {
                return Err(AgentError::Label(format!(
                    "{shown} was created with --capacity {} ({} bytes), not {}; omit --capacity or pass the same",
                    units::format_bytes(l.device_size),
                    l.device_size,
                    units::format_bytes(c)
                )));
            }
            tracing::info!(path = %shown, guid = l.guid, device_size = l.device_size, "opened labelled device");
            Ok(LabelledFile {
                file,
                label: l,
                block_device: block,
            })
        }
        Found::Foreign(why) => Err(AgentError::Label(format!(
            "refusing {shown}: it holds {why}; point --path at a new or empty file, or at this vdev's own device"
        ))),
        Found::Blank => {
            let device_size = match (cfg.capacity, block) {
                (Some(c), true) if c > size => {
                    return Err(AgentError::Label(format!(
                        "--capacity {c} exceeds the block device {shown} ({size} bytes)"
                    )));
                }
                (Some(c), _) => c,
                (None, _) if size > 0 => size,
                (None, _) => {
                    return Err(AgentError::Config(format!(
                        "{shown} is new: pass --capacity SIZE to create it"
                    )));
                }
            };
            if label::data_capacity(device_size, cfg.ashift) == 0 {
                return Err(AgentError::Config(format!(
                    "--capacity {device_size} leaves no room after the {LABEL_SIZE}-byte label"
                )));
            }
            if !block && device_size != size {
                file.set_len(device_size).map_err(io("size"))?;
            }
            let l = Label {
                guid: new_guid(),
                device_size,
                ashift: cfg.ashift,
                name: cfg.name.clone().unwrap_or_else(|| default_name(path)),
            };
            file.write_all_at(&l.encode(), 0)
                .map_err(io("write the label of"))?;
            file.sync_all().map_err(io("sync"))?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
                && let Ok(d) = File::open(dir)
            {
                // Make the new file's directory entry durable too.
                let _ = d.sync_all();
            }
            tracing::info!(path = %shown, guid = l.guid, device_size, "labelled new device");
            Ok(LabelledFile {
                file,
                label: l,
                block_device: block,
            })
        }
    }
}

fn default_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "vdev".into())
}

struct FileDevice {
    /// Holds the lock; all I/O when not direct.
    file: File,
    /// Which data I/O bypasses the page cache.
    direct: DirectIo,
    writeback: Writeback,
}

/// The same file opened a second time with O_DIRECT, and what goes
/// through it.
enum DirectIo {
    /// Nothing: all data I/O through the page cache (files by default).
    Off,
    /// All data I/O, reads and Flush too (`--direct`; block devices by
    /// default).
    All(File),
    /// Writes at least `min` long and 4 KiB-aligned (`--direct-min-size`),
    /// with `holes` only those into ranges never written
    /// (`--direct-large-writes holes`, the default); reads and other writes
    /// use the page cache. Linux keeps the two coherent: a direct write
    /// writes back and drops the cached pages of its range.
    ///
    /// Measured with the `data_path` bench (1 MiB writes, 3 file agents,
    /// interleaved with buffered agents), every large write direct: on new
    /// space agents' CPU per MiB 0.44-0.85x and throughput 1.1-1.5x; on
    /// laid-out files whose pages are cached, agents 0.81-1.10x but
    /// throughput 0.80-0.99x (a direct write waits for the disk where a
    /// buffered one only copied into cached pages). Into holes only, new
    /// space gains and overwrites keep the page cache.
    LargeWrites {
        file: File,
        min: u64,
        holes: Option<Holes>,
    },
}

/// Writeback is started once per `WRITEBACK_CHUNK` written, not per device
/// I/O: a device I/O at least that large starts its own range at once (as
/// before), smaller ones (4 KiB random writes never merge) only add to a
/// count, and when the count reaches the chunk one `sync_file_range` over
/// the whole file starts every dirty page of it (the kernel walks only the
/// dirty-tagged pages). One call per 256 4 KiB writes instead of one each
/// (it was 19 % of the agent's CPU); the durability point is still `Flush`
/// (fdatasync), which this only shortens.
pub(crate) const WRITEBACK_CHUNK: u64 = 1 << 20;

#[derive(Debug, Default)]
struct Writeback {
    /// Bytes written by small I/Os since writeback was last started.
    unstarted: std::sync::atomic::AtomicU64,
    /// `sync_file_range` calls made (tests read it).
    calls: std::sync::atomic::AtomicU64,
}

impl Writeback {
    /// Account a buffered write of `len` bytes at `at` (file offset).
    fn wrote(&self, file: &File, at: u64, len: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if len >= WRITEBACK_CHUNK {
            self.calls.fetch_add(1, Relaxed);
            start_writeback(file, at, len);
            return;
        }
        let before = self.unstarted.fetch_add(len, Relaxed);
        if before + len >= WRITEBACK_CHUNK && self.unstarted.swap(0, Relaxed) >= WRITEBACK_CHUNK {
            self.calls.fetch_add(1, Relaxed);
            // nbytes 0: from `at` 0 to the end of the file.
            start_writeback(file, 0, 0);
        }
    }
}

/// Alignment of O_DIRECT buffers, offsets and lengths: 4 KiB covers 512-byte
/// and 4K-sector devices (the agent's sectors are 1 << ashift, ashift >= 9,
/// and the 1 MiB label keeps data offsets aligned).
const DIRECT_ALIGN: usize = 4096;

/// Open `path` again for O_DIRECT data I/O (after `open_file` locked and
/// checked it through the buffered descriptor).
fn open_direct(path: &Path) -> Result<File, AgentError> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(|e| {
                AgentError::Config(format!(
                    "cannot open {} with O_DIRECT ({e}); its filesystem may not support it (--buffered uses the page cache)",
                    path.display()
                ))
            })
    }
    #[cfg(not(target_os = "linux"))]
    Err(AgentError::Config(format!(
        "--direct is supported on Linux only ({})",
        path.display()
    )))
}

/// A heap buffer aligned for O_DIRECT, reused by each I/O worker thread
/// (grown on demand, never shrunk: at most the largest I/O, 16 MiB).
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
}

impl AlignedBuf {
    const fn empty() -> AlignedBuf {
        AlignedBuf {
            ptr: std::ptr::NonNull::dangling(),
            cap: 0,
        }
    }

    /// The first `len` bytes (rounded up to the alignment), zero-filled
    /// when newly allocated.
    fn get(&mut self, len: usize) -> &mut [u8] {
        let need = len.div_ceil(DIRECT_ALIGN).max(1) * DIRECT_ALIGN;
        if need > self.cap {
            self.release();
            let layout =
                std::alloc::Layout::from_size_align(need, DIRECT_ALIGN).expect("valid layout");
            // SAFETY: a non-zero size; a null return is handled.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            self.ptr =
                std::ptr::NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
            self.cap = need;
        }
        // SAFETY: `cap` initialised bytes live at `ptr`, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), need) }
    }

    fn release(&mut self) {
        if self.cap > 0 {
            let layout =
                std::alloc::Layout::from_size_align(self.cap, DIRECT_ALIGN).expect("valid layout");
            // SAFETY: allocated in `get` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            self.cap = 0;
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.release();
    }
}

thread_local! {
    static DIRECT_BUF: std::cell::RefCell<AlignedBuf> =
        const { std::cell::RefCell::new(AlignedBuf::empty()) };
}

/// Whether `data` can go to an O_DIRECT descriptor as it is.
fn direct_ready(data: &[u8], at: u64) -> bool {
    (data.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
        && data.len().is_multiple_of(DIRECT_ALIGN)
        && at.is_multiple_of(DIRECT_ALIGN as u64)
}

/// Write `bufs` back to back at `at` through the O_DIRECT descriptor: one
/// copy into the worker's aligned buffer (instead of the page cache's),
/// unless a single buffer is already aligned.
fn direct_write(f: &File, bufs: &[&[u8]], at: u64) -> io::Result<()> {
    if let [one] = bufs
        && direct_ready(one, at)
    {
        return f.write_all_at(one, at);
    }
    let len: usize = bufs.iter().map(|b| b.len()).sum();
    if !len.is_multiple_of(DIRECT_ALIGN) || !at.is_multiple_of(DIRECT_ALIGN as u64) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("--direct: I/O of {len} bytes at {at} is not {DIRECT_ALIGN}-byte aligned"),
        ));
    }
    DIRECT_BUF.with(|b| {
        let mut b = b.borrow_mut();
        let buf = b.get(len);
        let mut pos = 0;
        for s in bufs {
            buf[pos..pos + s.len()].copy_from_slice(s);
            pos += s.len();
        }
        f.write_all_at(&buf[..len], at)
    })
}

fn direct_read(f: &File, out: &mut [u8], at: u64) -> io::Result<()> {
    if direct_ready(out, at) {
        return f.read_exact_at(out, at);
    }
    if !out.len().is_multiple_of(DIRECT_ALIGN) || !at.is_multiple_of(DIRECT_ALIGN as u64) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "--direct: read of {} bytes at {at} is not {DIRECT_ALIGN}-byte aligned",
                out.len()
            ),
        ));
    }
    DIRECT_BUF.with(|b| {
        let mut b = b.borrow_mut();
        let buf = b.get(out.len());
        f.read_exact_at(&mut buf[..out.len()], at)?;
        out.copy_from_slice(&buf[..out.len()]);
        Ok(())
    })
}

/// Start writing the range to the device now, without waiting for it, as an
/// OpenZFS vdev issues each write when it leaves the queue. Left to the page
/// cache, nothing reaches the disk until `Flush` (a pool's worth of dirty
/// data fits under the kernel's dirty limits), so the fsync then writes it
/// all while the clients wait; started here, the device works while the next
/// writes arrive and `Flush` waits only for the tail. A hint: `Flush` is the
/// durability point either way, so a failure here is not an error.
fn start_writeback(file: &File, at: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on an open descriptor; no memory is passed.
        let r = unsafe {
            libc::sync_file_range(
                file.as_raw_fd(),
                at as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
        if r != 0 {
            tracing::debug!(at, len, error = %io::Error::last_os_error(), "sync_file_range failed");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, at, len);
}

/// `pwritev` until every byte of `bufs` is written at `at` (short writes
/// and EINTR retried, at most `IOV_MAX` buffers a call).
#[cfg(target_os = "linux")]
fn pwritev_all(file: &File, bufs: &[&[u8]], mut at: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    const IOV_MAX: usize = 1024;
    // The first buffer not yet written whole, and how much of it is.
    let (mut first, mut done) = (0usize, 0usize);
    while first < bufs.len() {
        let iov: Vec<libc::iovec> = bufs[first..]
            .iter()
            .take(IOV_MAX)
            .enumerate()
            .map(|(k, b)| {
                let b = if k == 0 { &b[done..] } else { b };
                libc::iovec {
                    iov_base: b.as_ptr() as *mut libc::c_void,
                    iov_len: b.len(),
                }
            })
            .collect();
        // SAFETY: every iovec points into a live borrowed slice of its
        // stated length, which the kernel only reads.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                at as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        let mut n = n as usize;
        at += n as u64;
        while n > 0 {
            let left = bufs[first].len() - done;
            if n >= left {
                n -= left;
                first += 1;
                done = 0;
            } else {
                done += n;
                n = 0;
            }
        }
        // Skip empty buffers so the loop ends.
        while first < bufs.len() && bufs[first].len() == done {
            first += 1;
            done = 0;
        }
    }
    Ok(())
}

impl FileDevice {
    /// The O_DIRECT descriptor if a write of `len` bytes at `at` goes
    /// through it: always when all I/O is direct (alignment is then checked
    /// by `direct_write`), else when it is long enough and aligned.
    fn direct_for(&self, at: u64, len: u64) -> Option<&File> {
        match &self.direct {
            DirectIo::Off => None,
            DirectIo::All(d) => Some(d),
            DirectIo::LargeWrites { file, min, holes } => {
                let aligned = at.is_multiple_of(DIRECT_ALIGN as u64)
                    && len.is_multiple_of(DIRECT_ALIGN as u64);
                let into_hole = || holes.as_ref().is_none_or(|h| h.is_hole(file, at, len));
                (len >= *min && aligned && into_hole()).then_some(file)
            }
        }
    }
}

/// Where the file still has holes, for `--direct-large-writes holes`.
/// Asking costs a `SEEK_DATA` per large write: on laid-out files, asking
/// every time measured 0.96x the throughput of buffered agents.
/// Holes never come back (the agent punches none), so once a `SEEK_HOLE`
/// over the whole data area finds none the question is never asked again:
/// a file laid out in full, or filled, is all overwrites. That check runs
/// once per `RECHECK` overwrites.
#[derive(Debug, Default)]
struct Holes {
    none_left: std::sync::atomic::AtomicBool,
    overwrites: std::sync::atomic::AtomicU32,
}

impl Holes {
    const RECHECK: u32 = 64;

    fn is_hole(&self, file: &File, at: u64, len: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if self.none_left.load(Relaxed) {
            return false;
        }
        if is_hole(file, at, len) {
            return true;
        }
        if self.overwrites.fetch_add(1, Relaxed) % Self::RECHECK == Self::RECHECK - 1
            && !has_hole_after(file, LABEL_SIZE)
        {
            self.none_left.store(true, Relaxed);
        }
        false
    }
}

/// Whether the file has a hole at or after `from` before its end
/// (`SEEK_HOLE` finds one before the end-of-file's implicit hole). On
/// doubt (an error), yes.
#[cfg(target_os = "linux")]
fn has_hole_after(file: &File, from: u64) -> bool {
    use std::os::fd::AsRawFd;
    let (Ok(start), Ok(meta)) = (libc::off_t::try_from(from), file.metadata()) else {
        return true;
    };
    // SAFETY: as in `is_hole`.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), start, libc::SEEK_HOLE) };
    hole < 0 || (hole as u64) < meta.len()
}

#[cfg(not(target_os = "linux"))]
fn has_hole_after(_file: &File, _from: u64) -> bool {
    true
}

/// Whether no byte of `[at, at + len)` has held data: `SEEK_DATA` from `at`
/// finds none before the range's end. A filesystem without hole tracking
/// reports everything as data (so: not a hole, buffered). `file` must be
/// the O_DIRECT descriptor, whose own file position nothing else uses
/// (all I/O is positioned), not one shared through `try_clone`.
#[cfg(target_os = "linux")]
fn is_hole(file: &File, at: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(start) = libc::off_t::try_from(at) else {
        return false;
    };
    // SAFETY: lseek on a descriptor we own; it only moves that
    // description's position.
    let next = unsafe { libc::lseek(file.as_raw_fd(), start, libc::SEEK_DATA) };
    if next < 0 {
        // ENXIO: no data at or after `at`.
        return io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
    }
    next as u64 >= at + len
}

#[cfg(not(target_os = "linux"))]
fn is_hole(_file: &File, _at: u64, _len: u64) -> bool {
    false
}

impl Device for FileDevice {
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let at = LABEL_SIZE + offset;
        if let Some(d) = self.direct_for(at, data.len() as u64) {
            // On its way to the device already: no writeback to start.
            return direct_write(d, &[data], at);
        }
        self.file.write_all_at(data, at)?;
        self.writeback.wrote(&self.file, at, data.len() as u64);
        Ok(())
    }

    #[cfg(target_os = "linux")]
    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> io::Result<()> {
        let at = LABEL_SIZE + offset;
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        if let Some(d) = self.direct_for(at, len) {
            return direct_write(d, bufs, at);
        }
        pwritev_all(&self.file, bufs, at)?;
        self.writeback.wrote(&self.file, at, len);
        Ok(())
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        match &self.direct {
            DirectIo::All(d) => direct_read(d, buf, LABEL_SIZE + offset),
            _ => self.file.read_exact_at(buf, LABEL_SIZE + offset),
        }
    }

    fn data_io(&self) -> String {
        match &self.direct {
            DirectIo::Off => "buffered".into(),
            DirectIo::All(_) => "direct".into(),
            DirectIo::LargeWrites { min, holes, .. } => format!(
                "direct for writes of {} or more{}, else buffered",
                units::format_bytes(*min),
                if holes.is_some() { " into holes" } else { "" }
            ),
        }
    }

    fn flush(&self) -> io::Result<()> {
        // Data only: the size was fixed (and synced) when the label was
        // written. O_DIRECT writes may still sit in the device's cache:
        // fdatasync flushes it, the same durability point either way (one
        // inode: either descriptor's fdatasync covers both kinds of write).
        match &self.direct {
            DirectIo::All(d) => d.sync_data(),
            _ => self.file.sync_data(),
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn pwritev_writes_every_buffer_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(dir.path().join("f"))
            .unwrap();
        // More buffers than one call takes, of uneven sizes, some empty.
        let owned: Vec<Vec<u8>> = (0..2500usize)
            .map(|k| vec![(k % 251) as u8; (k * 7) % 13])
            .collect();
        let bufs: Vec<&[u8]> = owned.iter().map(|b| b.as_slice()).collect();
        pwritev_all(&f, &bufs, 100).unwrap();
        let want = bufs.concat();
        let mut got = vec![0u8; want.len()];
        f.read_exact_at(&mut got, 100).unwrap();
        assert_eq!(got, want);
        assert_eq!(f.metadata().unwrap().len(), 100 + want.len() as u64);
    }

    #[test]
    fn block_devices_default_to_direct_io_files_to_buffered() {
        let mut cfg = Config::new(BackendKind::File);
        assert!(!wants_direct(&cfg, false), "a file stays buffered");
        assert!(wants_direct(&cfg, true), "a block device goes direct");
        cfg.buffered = true;
        assert!(!wants_direct(&cfg, true), "--buffered keeps the page cache");
        cfg.buffered = false;
        cfg.ashift = 9;
        assert!(
            !wants_direct(&cfg, true),
            "512-byte sectors: O_DIRECT needs 4 KiB here"
        );
        cfg.direct = true;
        assert!(wants_direct(&cfg, false), "--direct on a file");
    }

    /// A new, empty file open for reading and writing.
    fn new_file(path: &Path) -> File {
        OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn writeback_starts_once_per_chunk_of_small_writes() {
        use std::sync::atomic::Ordering::Relaxed;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = new_file(&path);
        let dev = FileDevice {
            file,
            direct: DirectIo::Off,
            writeback: Writeback::default(),
        };
        let small = vec![7u8; 4096];
        let per_chunk = WRITEBACK_CHUNK / 4096;
        // Scattered 4 KiB writes: none until a chunk's worth, then one.
        for k in 0..per_chunk - 1 {
            dev.write_at((k * 7919 % 4096) * 4096, &small).unwrap();
        }
        assert_eq!(dev.writeback.calls.load(Relaxed), 0);
        dev.write_at(0, &small).unwrap();
        assert_eq!(dev.writeback.calls.load(Relaxed), 1);
        // Vectored small I/Os count the same way.
        for k in 0..per_chunk / 2 {
            dev.write_vectored_at(k * 8192, &[&small, &small]).unwrap();
        }
        assert_eq!(dev.writeback.calls.load(Relaxed), 2);
        // A chunk-sized I/O starts its own range at once, leaving the
        // small-write count alone.
        dev.write_at(0, &small).unwrap();
        dev.write_at(64 << 20, &vec![1u8; WRITEBACK_CHUNK as usize])
            .unwrap();
        assert_eq!(dev.writeback.calls.load(Relaxed), 3);
        assert_eq!(dev.writeback.unstarted.load(Relaxed), 4096);
        // Flush is still the durability point, and everything reads back.
        dev.flush().unwrap();
        let mut got = vec![0u8; 4096];
        dev.read_at(0, &mut got).unwrap();
        assert_eq!(got, small);
    }

    /// A sparse 16 MiB data area at `path` whose writes of `min` or more go
    /// direct (into holes only with `holes`); None, said, where the file
    /// system refuses O_DIRECT.
    fn large_writes_device(path: &Path, min: u64, holes: Option<Holes>) -> Option<FileDevice> {
        let file = new_file(path);
        file.set_len(LABEL_SIZE + (16 << 20)).unwrap();
        let Ok(direct) = open_direct(path) else {
            eprintln!("this filesystem refuses O_DIRECT: nothing to test");
            return None;
        };
        Some(FileDevice {
            file,
            direct: DirectIo::LargeWrites {
                file: direct,
                min,
                holes,
            },
            writeback: Writeback::default(),
        })
    }

    /// `--direct-min-size`: large aligned writes bypass the page cache,
    /// small or unaligned ones do not, and the two stay coherent whichever
    /// order they overlap in.
    #[test]
    fn large_writes_go_direct_small_ones_buffered_and_both_read_back() {
        use std::sync::atomic::Ordering::Relaxed;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let Some(dev) = large_writes_device(&path, 64 << 10, None) else {
            return;
        };
        let big = |b: u8| vec![b; WRITEBACK_CHUNK as usize];
        let mut expect = vec![0u8; 4 << 20];
        let mut put = |at: usize, d: &[u8]| expect[at..at + d.len()].copy_from_slice(d);
        // Buffered small write, then a direct write over it: the direct
        // data wins (the kernel writes the cached page back first and
        // drops it).
        dev.write_at(8192, &[5u8; 4096]).unwrap();
        put(8192, &[5u8; 4096]);
        dev.write_at(0, &big(1)).unwrap();
        put(0, &big(1));
        // A chunk-sized buffered write would have started writeback: this
        // one went direct.
        assert_eq!(dev.writeback.calls.load(Relaxed), 0, "1 MiB went direct");
        // Direct write, then small buffered writes inside it (one not
        // even sector-aligned): read back from the page cache.
        dev.write_at(4096, &[6u8; 4096]).unwrap();
        put(4096, &[6u8; 4096]);
        dev.write_at(100_000, &[7u8; 333]).unwrap();
        put(100_000, &[7u8; 333]);
        // Large but unaligned: buffered (direct would refuse it).
        dev.write_at((2 << 20) + 512, &big(8)).unwrap();
        put((2 << 20) + 512, &big(8));
        assert_eq!(
            dev.writeback.calls.load(Relaxed),
            1,
            "unaligned went buffered"
        );
        // Vectored, large and aligned: direct, over the buffered one.
        let half = vec![9u8; 512 << 10];
        dev.write_vectored_at(2 << 20, &[&half, &half]).unwrap();
        put(2 << 20, &big(9));
        assert_eq!(dev.writeback.calls.load(Relaxed), 1);
        dev.flush().unwrap();
        let mut got = vec![0u8; expect.len()];
        dev.read_at(0, &mut got).unwrap();
        assert!(got == expect, "read back differs");
        // And what a fresh reader of the file sees after the flush.
        let mut disk = vec![0u8; expect.len()];
        File::open(&path)
            .unwrap()
            .read_exact_at(&mut disk, LABEL_SIZE)
            .unwrap();
        assert!(disk == expect, "file differs");
    }

    /// `--direct-large-writes holes` (the default): a large write goes
    /// direct only into a range that has never held data; once written
    /// (directly, or buffered and not yet on disk), the range's overwrites
    /// are buffered. Everything reads back either way.
    #[test]
    fn only_large_writes_into_holes_go_direct() {
        use std::sync::atomic::Ordering::Relaxed;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let Some(dev) = large_writes_device(&path, DIRECT_MIN_SIZE_DEFAULT, Some(Holes::default()))
        else {
            return;
        };
        let DirectIo::LargeWrites { file, .. } = &dev.direct else {
            unreachable!()
        };
        if !is_hole(file, LABEL_SIZE, 16 << 20) {
            eprintln!("this filesystem does not report holes: nothing to test");
            return;
        }
        let calls = || dev.writeback.calls.load(Relaxed);
        let mib = |b: u8| vec![b; 1 << 20];
        // New space: direct (a buffered 1 MiB write starts writeback).
        dev.write_at(0, &mib(1)).unwrap();
        assert_eq!(calls(), 0, "into a hole: direct");
        // The same range again: it holds data now, so buffered.
        dev.write_at(0, &mib(2)).unwrap();
        assert_eq!(calls(), 1, "an overwrite: buffered");
        // A small buffered write not yet on disk makes its range data
        // (ext4's delayed allocation counts): the large write over it is
        // buffered too.
        dev.write_at((4 << 20) + 8192, &[3u8; 4096]).unwrap();
        dev.write_vectored_at(4 << 20, &[&mib(4)[..512 << 10], &mib(4)[..512 << 10]])
            .unwrap();
        assert_eq!(calls(), 2, "over unflushed data: buffered");
        // A hole right after data: direct.
        dev.write_at(5 << 20, &mib(5)).unwrap();
        assert_eq!(calls(), 2, "the next hole: direct");
        dev.flush().unwrap();
        let mut got = vec![0u8; 6 << 20];
        dev.read_at(0, &mut got).unwrap();
        assert!(got[..1 << 20].iter().all(|&b| b == 2));
        assert!(got[1 << 20..4 << 20].iter().all(|&b| b == 0));
        assert!(got[4 << 20..5 << 20].iter().all(|&b| b == 4));
        assert!(got[5 << 20..].iter().all(|&b| b == 5));

        // Stop asking once no hole is left: while one is, overwrites keep
        // the question open; after the last hole is written, the next
        // recheck closes it.
        let holes = || match &dev.direct {
            DirectIo::LargeWrites { holes: Some(h), .. } => h,
            _ => unreachable!(),
        };
        let none_left = || holes().none_left.load(Relaxed);
        for _ in 0..2 * Holes::RECHECK {
            dev.write_at(0, &mib(6)).unwrap();
        }
        assert!(!none_left(), "holes at 1..4 MiB and 6..16 MiB remain");
        for m in (1..4).chain(6..16) {
            dev.write_at(m << 20, &mib(7)).unwrap();
        }
        assert!(!none_left());
        for _ in 0..Holes::RECHECK {
            dev.write_at(0, &mib(8)).unwrap();
        }
        assert!(none_left(), "the file is all data: no more SEEK_DATA");
        let before = calls();
        dev.write_at(3 << 20, &mib(9)).unwrap();
        assert_eq!(calls(), before + 1, "an overwrite: buffered");
    }

    #[test]
    fn file_device_writes_vectored_after_the_label() {
        for direct in [false, true] {
            file_device_round_trip(direct);
        }
    }

    fn file_device_round_trip(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new(BackendKind::File);
        cfg.path = Some(dir.path().join("dev"));
        cfg.capacity = Some(8 << 20);
        cfg.direct = direct;
        let opened = open(&cfg).unwrap();
        assert_eq!(
            opened.device.write_at(512, &[0u8; 512]).is_err(),
            direct,
            "O_DIRECT refuses I/O it cannot align; buffered takes it"
        );
        let a = vec![1u8; 4096];
        let b = vec![2u8; 8192];
        opened.device.write_vectored_at(4096, &[&a, &b]).unwrap();
        opened.device.flush().unwrap();
        let mut got = vec![0u8; 3 * 4096];
        opened.device.read_at(4096, &mut got).unwrap();
        assert_eq!(got, [a, b].concat());
        // The label in front is untouched.
        let f = File::open(dir.path().join("dev")).unwrap();
        let mut head = vec![0u8; LABEL_BLOCK];
        f.read_exact_at(&mut head, 0).unwrap();
        assert!(matches!(Label::decode(&head), Found::Label(_)));
        // Unaligned buffers of aligned size and offset go through the
        // aligned copy.
        let odd = vec![3u8; 4096 + 1];
        opened.device.write_at(16384, &odd[1..]).unwrap();
        let mut back = vec![0u8; 4097];
        opened.device.read_at(16384, &mut back[1..]).unwrap();
        assert_eq!(&back[1..], &odd[1..]);
    }
}
