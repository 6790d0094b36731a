//! The write manifest: what `aliquotctl write --manifest FILE` wrote
//! (logical block → the extents of its copies), and the journal of the
//! balancer's mover on top of it. In Aliquot, as in ZFS, the allocator does
//! not own the references to the data: this file does, for the blocks the
//! write command made, so it is what a mover updates.
//!
//! The file is JSON lines. The first line is the header, then one `block`
//! line per block; the mover appends `pending` (a relocation written and
//! about to be committed), then `moved` (committed and durable: the copy
//! lives at `to`) or `dropped` (it never took effect). Every append is
//! fsynced before the step it records goes on, so after a crash the file
//! says exactly which relocations may have been committed; a torn last line
//! is ignored. `compact` rewrites the file (temp file, fsync, rename, fsync
//! of the directory) with the moves folded in.
//!
//! `free` journals its progress in the same way in the `.freeing` file it
//! renames the manifest to: `free_sent` (the Frees of the extents up to
//! there may have taken effect) before it sends them, `freed` once their
//! txg synced, so a rerun after a crash or a takeover knows which extents
//! are certainly still the manifest's, which are certainly freed, and which
//! (at most one chunk) it must look at before freeing them again.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use aliquot_proto::v1::Extent;
use serde::{Deserialize, Serialize};

/// The format version this binary writes and reads.
pub const VERSION: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Ext {
    pub vdev: u32,
    #[serde(with = "string")]
    pub offset: u64,
    #[serde(with = "string")]
    pub size: u64,
}

impl From<&Extent> for Ext {
    fn from(e: &Extent) -> Ext {
        Ext {
            vdev: e.vdev,
            offset: e.offset,
            size: e.size,
        }
    }
}

impl From<Ext> for Extent {
    fn from(e: Ext) -> Extent {
        Extent {
            vdev: e.vdev,
            offset: e.offset,
            size: e.size,
        }
    }
}

impl std::fmt::Display for Ext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}+{}", self.vdev, self.offset, self.size)
    }
}

/// 64-bit integers as JSON strings (as the proto3 JSON mapping does), so
/// jq and JavaScript read them exactly.
mod string {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub aliquot_manifest: u32,
    #[serde(with = "string")]
    pub pool_guid: u64,
    /// The write run's pattern nonce: block b's copies hold
    /// `pattern(nonce, b)` over their first `len` bytes.
    #[serde(with = "string")]
    pub nonce: u64,
    #[serde(with = "string")]
    pub block_size: u64,
}

/// One copy of a block: where it is and how many bytes of it are data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Copy {
    pub at: Ext,
    #[serde(with = "string")]
    pub len: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    #[serde(with = "string")]
    pub block: u64,
    pub copies: Vec<Copy>,
}

/// A journal record of the mover.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Record {
    Block(Block),
    /// Copy `copy` of `block` was written to `to` under relocation
    /// `allocation` (allocator generation `generation`); its Commit may or
    /// may not have taken effect.
    Pending {
        #[serde(with = "string")]
        block: u64,
        copy: usize,
        from: Ext,
        to: Ext,
        #[serde(with = "string")]
        allocation: u64,
        #[serde(with = "string")]
        generation: u64,
    },
    /// The relocation is durable: the copy lives at `to`.
    Moved {
        #[serde(with = "string")]
        allocation: u64,
    },
    /// The relocation never took effect: the copy stays at `from`.
    Dropped {
        #[serde(with = "string")]
        allocation: u64,
    },
    /// `free`: the Frees of the first `to` extents (of [`Manifest::extents`])
    /// are about to be sent: from here on they may have taken effect.
    FreeSent {
        #[serde(with = "string")]
        to: u64,
    },
    /// `free`: the first `to` extents are freed, in a synced txg.
    Freed {
        #[serde(with = "string")]
        to: u64,
    },
}

/// A relocation the journal cannot settle by itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub block: u64,
    pub copy: usize,
    pub from: Ext,
    pub to: Ext,
    pub allocation: u64,
    pub generation: u64,
}

impl Pending {
    /// The journal record that says this move is pending.
    pub fn record(&self) -> Record {
        Record::Pending {
            block: self.block,
            copy: self.copy,
            from: self.from,
            to: self.to,
            allocation: self.allocation,
            generation: self.generation,
        }
    }
}

/// The file's text: the header line, then a line per record.
fn render(header: &Header, recs: impl Iterator<Item = Record>) -> String {
    let mut body = serde_json::to_string(header).expect("header serializes");
    body.push('\n');
    for r in recs {
        body.push_str(&serde_json::to_string(&r).expect("record serializes"));
        body.push('\n');
    }
    body
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest {path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("manifest {path}, line {line}: {why}")]
    Bad {
        path: String,
        line: usize,
        why: String,
    },
}

/// A manifest loaded into memory, with its journal replayed.
#[derive(Debug)]
pub struct Manifest {
    path: PathBuf,
    pub header: Header,
    /// Block number → its copies, as of the last journal record.
    pub blocks: BTreeMap<u64, Vec<Copy>>,
    /// Relocations written but not known to be committed or dropped.
    pub pending: BTreeMap<u64, Pending>,
    /// `free`'s progress: the first `freed` extents are free for certain;
    /// the Frees of those up to `free_sent` may have taken effect.
    pub freed: u64,
    pub free_sent: u64,
    journal: Option<File>,
}

impl Manifest {
    /// Write a fresh manifest atomically (temp file, fsync, rename).
    pub fn create(path: &Path, header: Header, blocks: &[Block]) -> Result<(), ManifestError> {
        let recs = blocks.iter().cloned().map(Record::Block);
        replace_file(path, render(&header, recs).as_bytes())
    }

    pub fn load(path: &Path) -> Result<Manifest, ManifestError> {
        let io = |err| ManifestError::Io {
            path: path.display().to_string(),
            err,
        };
        let bad = |line: usize, why: String| ManifestError::Bad {
            path: path.display().to_string(),
            line,
            why,
        };
        let f = File::open(path).map_err(io)?;
        let mut lines = BufReader::new(f).lines().enumerate().peekable();
        let header: Header = match lines.next() {
            Some((_, l)) => serde_json::from_str(&l.map_err(io)?)
                .map_err(|e| bad(1, format!("not a manifest header ({e})")))?,
            None => return Err(bad(1, "empty file".into())),
        };
        if header.aliquot_manifest != VERSION {
            return Err(bad(
                1,
                format!(
                    "format version {} (this aliquotctl reads {VERSION})",
                    header.aliquot_manifest
                ),
            ));
        }
        let mut m = Manifest {
            path: path.to_path_buf(),
            header,
            blocks: BTreeMap::new(),
            pending: BTreeMap::new(),
            freed: 0,
            free_sent: 0,
            journal: None,
        };
        while let Some((i, l)) = lines.next() {
            let l = l.map_err(io)?;
            let last = lines.peek().is_none();
            let rec: Record = match serde_json::from_str(&l) {
                Ok(r) => r,
                // A crash mid-append leaves a torn last line: that record
                // was never acted on (its fsync had not returned).
                Err(_) if last => break,
                Err(e) => return Err(bad(i + 1, e.to_string())),
            };
            m.apply(rec).map_err(|why| bad(i + 1, why))?;
        }
        Ok(m)
    }

    /// Whether `rec` applies to the manifest as it is (nothing changed).
    fn check(&self, rec: &Record) -> Result<(), String> {
        match rec {
            Record::Block(_) => Ok(()),
            Record::Pending {
                block, copy, from, ..
            } => {
                let copies = self
                    .blocks
                    .get(block)
                    .ok_or_else(|| format!("pending move of unknown block {block}"))?;
                if copies.get(*copy).map(|c| c.at) != Some(*from) {
                    return Err(format!(
                        "pending move of block {block} copy {copy} from {from}, which is not \
                         where that copy is"
                    ));
                }
                Ok(())
            }
            Record::Moved { allocation } | Record::Dropped { allocation } => {
                if self.pending.contains_key(allocation) {
                    Ok(())
                } else {
                    Err(format!("move {allocation} was never pending"))
                }
            }
            // A Free is sent from where the certainly freed extents end,
            // and a batch is freed only once sent.
            Record::FreeSent { to } if *to < self.free_sent => Err(format!(
                "free sent up to {to}, less than the {} already sent",
                self.free_sent
            )),
            Record::Freed { to } if *to > self.free_sent || *to < self.freed => Err(format!(
                "freed up to {to}, but sent up to {} and freed up to {}",
                self.free_sent, self.freed
            )),
            Record::FreeSent { .. } | Record::Freed { .. } => Ok(()),
        }
    }

    fn apply(&mut self, rec: Record) -> Result<(), String> {
        self.check(&rec)?;
        match rec {
            Record::Block(b) => {
                self.blocks.insert(b.block, b.copies);
            }
            Record::Pending {
                block,
                copy,
                from,
                to,
                allocation,
                generation,
            } => {
                self.pending.insert(
                    allocation,
                    Pending {
                        block,
                        copy,
                        from,
                        to,
                        allocation,
                        generation,
                    },
                );
            }
            Record::Moved { allocation } => {
                let p = self.pending.remove(&allocation).expect("checked");
                let c = &mut self.blocks.get_mut(&p.block).expect("checked when pending")[p.copy];
                c.at = p.to;
                // The new copy holds what the mover wrote: the first
                // `to.size` bytes of the old one. Off a RAIDZ vdev it is
                // smaller than the old extent (no parity to carry).
                c.len = c.len.min(p.to.size);
            }
            Record::Dropped { allocation } => {
                self.pending.remove(&allocation);
            }
            Record::FreeSent { to } => self.free_sent = to,
            Record::Freed { to } => self.freed = to,
        }
        Ok(())
    }

    /// Append a record and fsync it, then apply it: once this returns the
    /// record survives a crash.
    pub fn append(&mut self, rec: Record) -> Result<(), ManifestError> {
        self.append_all(vec![rec])
    }

    /// Append several records with one fsync (a batch of moves); all are
    /// checked first, so either all are written or none.
    pub fn append_all(&mut self, recs: Vec<Record>) -> Result<(), ManifestError> {
        let path = self.path.display().to_string();
        let bad = |why| ManifestError::Bad {
            path: path.clone(),
            line: 0,
            why,
        };
        for r in &recs {
            self.check(r).map_err(bad)?;
        }
        let io = |err| ManifestError::Io {
            path: path.clone(),
            err,
        };
        if self.journal.is_none() {
            self.journal = Some(
                OpenOptions::new()
                    .append(true)
                    .open(&self.path)
                    .map_err(io)?,
            );
        }
        let mut body = String::new();
        for r in &recs {
            body.push_str(&serde_json::to_string(r).expect("record serializes"));
            body.push('\n');
        }
        let f = self.journal.as_mut().expect("opened");
        f.write_all(body.as_bytes()).map_err(io)?;
        f.sync_data().map_err(io)?;
        for r in recs {
            self.apply(r).map_err(bad)?;
        }
        Ok(())
    }

    /// Rewrite the file with the journal folded in (pending moves kept).
    pub fn compact(&mut self) -> Result<(), ManifestError> {
        let blocks = self.blocks.iter().map(|(&block, copies)| {
            Record::Block(Block {
                block,
                copies: copies.clone(),
            })
        });
        let pending = self.pending.values().map(Pending::record);
        let progress = (self.free_sent > 0).then_some([
            Record::FreeSent { to: self.free_sent },
            Record::Freed { to: self.freed },
        ]);
        let body = render(
            &self.header,
            blocks.chain(pending).chain(progress.into_iter().flatten()),
        );
        self.journal = None;
        replace_file(&self.path, body.as_bytes())
    }

    /// Every copy, in the order `free` frees them (by block, then copy):
    /// what its `free_sent` and `freed` marks count.
    pub fn extents(&self) -> Vec<(u64, Copy)> {
        self.blocks
            .iter()
            .flat_map(|(&b, copies)| copies.iter().map(move |c| (b, *c)))
            .collect()
    }

    /// Extent → (block, copy) for every copy.
    pub fn index(&self) -> std::collections::HashMap<Ext, (u64, usize)> {
        let mut m = std::collections::HashMap::new();
        for (&b, copies) in &self.blocks {
            for (i, c) in copies.iter().enumerate() {
                m.insert(c.at, (b, i));
            }
        }
        m
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Where `write` records its manifests by default: `manifests/` beside the
/// certificates `up` made (`aliquot-data/manifests` for the default
/// `--certs-dir aliquot-data/certs`), so every command finds them without a
/// flag.
pub fn default_dir(certs_dir: &Path) -> PathBuf {
    certs_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .join("manifests")
}

/// The manifest files `paths` name: a file is itself, a directory is every
/// `*.jsonl` file in it (sorted; hidden and `.freeing` files are not
/// manifests). A missing directory holds none.
pub fn expand(paths: &[PathBuf]) -> Result<Vec<PathBuf>, ManifestError> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let io = |err| ManifestError::Io {
                path: p.display().to_string(),
                err,
            };
            let mut files: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(io)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    f.is_file()
                        && f.extension().is_some_and(|x| x == "jsonl")
                        && !f
                            .file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
                })
                .collect();
            files.sort();
            out.extend(files);
        } else if p.exists() {
            out.push(p.clone());
        } else {
            return Err(ManifestError::Io {
                path: p.display().to_string(),
                err: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            });
        }
    }
    out.dedup();
    Ok(out)
}

/// Every manifest `paths` name (see [`expand`]), loaded. A file given by
/// name must be of pool `pool_guid`; in a directory, manifests of another
/// pool (an earlier `up` whose data dir was reused) are skipped, and said so
/// on stderr.
pub fn load_all(paths: &[PathBuf], pool_guid: u64) -> anyhow::Result<Vec<Manifest>> {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for p in paths {
        let in_dir = p.is_dir();
        for f in expand(std::slice::from_ref(p))? {
            let m = Manifest::load(&f)?;
            if m.header.pool_guid != pool_guid {
                if in_dir {
                    skipped.push(f.display().to_string());
                    continue;
                }
                anyhow::bail!(
                    "manifest {} is of pool {:#x}, but the allocator serves pool {:#x}",
                    f.display(),
                    m.header.pool_guid,
                    pool_guid
                );
            }
            out.push(m);
        }
    }
    if !skipped.is_empty() {
        eprintln!(
            "skipped {} manifests of another pool: {}",
            skipped.len(),
            skipped.join(", ")
        );
    }
    Ok(out)
}

/// How `paths` read in a message: the one path, or the list.
pub fn describe(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Replace `path` with `body` atomically and durably.
fn replace_file(path: &Path, body: &[u8]) -> Result<(), ManifestError> {
    let io = |err| ManifestError::Io {
        path: path.display().to_string(),
        err,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "manifest".into())
    ));
    {
        let mut f = File::create(&tmp).map_err(io)?;
        f.write_all(body).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(vdev: u32, offset: u64) -> Ext {
        Ext {
            vdev,
            offset,
            size: 4096,
        }
    }

    fn sample(dir: &Path) -> PathBuf {
        let path = dir.join("m.jsonl");
        let header = Header {
            aliquot_manifest: VERSION,
            pool_guid: u64::MAX - 1,
            nonce: 42,
            block_size: 4096,
        };
        let blocks: Vec<Block> = (0..3)
            .map(|b| Block {
                block: b,
                copies: vec![Copy {
                    at: ext(0, b * 4096),
                    len: 4096,
                }],
            })
            .collect();
        Manifest::create(&path, header, &blocks).unwrap();
        path
    }

    #[test]
    fn the_journal_replays_moves_and_keeps_what_is_pending() {
        let dir = tempfile::tempdir().unwrap();
        let path = sample(dir.path());
        let mut m = Manifest::load(&path).unwrap();
        assert_eq!(m.header.pool_guid, u64::MAX - 1, "64-bit values exact");
        let pending = |block, allocation, to| Record::Pending {
            block,
            copy: 0,
            from: ext(0, block * 4096),
            to,
            allocation,
            generation: 1,
        };
        m.append(pending(0, 10, ext(1, 0))).unwrap();
        m.append(Record::Moved { allocation: 10 }).unwrap();
        m.append(pending(1, 11, ext(1, 4096))).unwrap();
        m.append(Record::Dropped { allocation: 11 }).unwrap();
        m.append(pending(2, 12, ext(1, 8192))).unwrap();
        let m = Manifest::load(&path).unwrap();
        assert_eq!(m.blocks[&0][0].at, ext(1, 0));
        assert_eq!(m.blocks[&1][0].at, ext(0, 4096));
        assert_eq!(m.blocks[&2][0].at, ext(0, 8192), "pending: not moved yet");
        assert_eq!(m.pending.keys().copied().collect::<Vec<_>>(), vec![12]);
        assert_eq!(m.index().get(&ext(1, 0)), Some(&(0, 0)));
    }

    /// A move to a smaller extent (off a RAIDZ vdev: the new copy is sized
    /// for the block, not for the old extent's parity) keeps only what the
    /// new copy holds as the block's length; a move to a larger one keeps
    /// the old length (the rest of the new extent holds no pattern).
    #[test]
    fn a_move_keeps_the_length_the_new_copy_holds() {
        let dir = tempfile::tempdir().unwrap();
        let path = sample(dir.path());
        let mut m = Manifest::load(&path).unwrap();
        let small = Ext {
            vdev: 1,
            offset: 0,
            size: 2048,
        };
        m.append(Record::Pending {
            block: 0,
            copy: 0,
            from: ext(0, 0),
            to: small,
            allocation: 20,
            generation: 1,
        })
        .unwrap();
        m.append(Record::Moved { allocation: 20 }).unwrap();
        let big = Ext {
            vdev: 2,
            offset: 0,
            size: 8192,
        };
        m.append(Record::Pending {
            block: 0,
            copy: 0,
            from: small,
            to: big,
            allocation: 21,
            generation: 1,
        })
        .unwrap();
        m.append(Record::Moved { allocation: 21 }).unwrap();
        let m = Manifest::load(&path).unwrap();
        assert_eq!(m.blocks[&0][0], Copy { at: big, len: 2048 });
    }

    #[test]
    fn a_torn_last_line_is_ignored_but_a_torn_middle_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = sample(dir.path());
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"pending":{"block":"0","co"#).unwrap();
        drop(f);
        let mut m = Manifest::load(&path).unwrap();
        assert!(m.pending.is_empty());
        // Compaction drops the torn line; a later append starts clean.
        m.compact().unwrap();
        let mut m = Manifest::load(&path).unwrap();
        m.append(Record::Pending {
            block: 0,
            copy: 0,
            from: ext(0, 0),
            to: ext(1, 0),
            allocation: 5,
            generation: 1,
        })
        .unwrap();
        assert_eq!(Manifest::load(&path).unwrap().pending.len(), 1);
        let body = std::fs::read_to_string(&path).unwrap();
        let broken = body.replacen("\"block\":\"1\"", "\"block\":", 1);
        std::fs::write(&path, broken).unwrap();
        let e = Manifest::load(&path).unwrap_err();
        assert!(e.to_string().contains("line 3"), "{e}");
    }

    /// `free`'s progress replays, survives compaction, and only moves on:
    /// nothing is marked freed that was not sent first.
    #[test]
    fn free_progress_replays_and_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = sample(dir.path());
        let mut m = Manifest::load(&path).unwrap();
        assert_eq!(m.extents().len(), 3);
        let e = m.append(Record::Freed { to: 1 }).unwrap_err();
        assert!(e.to_string().contains("sent up to 0"), "{e}");
        m.append(Record::FreeSent { to: 2 }).unwrap();
        m.append(Record::Freed { to: 2 }).unwrap();
        m.append(Record::FreeSent { to: 3 }).unwrap();
        let e = m.append(Record::FreeSent { to: 1 }).unwrap_err();
        assert!(e.to_string().contains("less than"), "{e}");
        let mut m = Manifest::load(&path).unwrap();
        assert_eq!((m.freed, m.free_sent), (2, 3));
        m.compact().unwrap();
        let m = Manifest::load(&path).unwrap();
        assert_eq!((m.freed, m.free_sent), (2, 3), "kept by compaction");
        assert_eq!(m.extents()[2], (2, m.blocks[&2][0]));
    }

    #[test]
    fn a_pending_move_must_start_where_the_copy_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = sample(dir.path());
        let mut m = Manifest::load(&path).unwrap();
        let e = m
            .append(Record::Pending {
                block: 0,
                copy: 0,
                from: ext(0, 4096),
                to: ext(1, 0),
                allocation: 1,
                generation: 1,
            })
            .unwrap_err();
        assert!(e.to_string().contains("not where that copy is"), "{e}");
    }
}
