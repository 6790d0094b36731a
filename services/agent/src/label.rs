//! The device label: the first [`LABEL_SIZE`] bytes of every device are
//! reserved for it, so that an agent restarted on the same file knows the
//! device (its guid above all: the allocator matches a re-registering vdev by
//! guid) and refuses a file that belongs to something else.
//!
//! Layout (little-endian, in the first 4 KiB): magic "ALQTVDEV", version u32,
//! ashift u32, guid u64, device size u64 (bytes, label included), name length
//! u32 and name bytes, then an FNV-1a 64 checksum of everything before it.

pub const LABEL_SIZE: u64 = 1 << 20;
const MAGIC: &[u8; 8] = b"ALQTVDEV";
const VERSION: u32 = 1;
const MAX_NAME: usize = 256;
/// Bytes of the label area actually read and written.
pub const LABEL_BLOCK: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    pub guid: u64,
    pub device_size: u64,
    pub ashift: u32,
    pub name: String,
}

/// What the first bytes of a device turned out to hold.
#[derive(Debug)]
pub enum Found {
    Label(Label),
    /// All zeros: a new device.
    Blank,
    /// Something that is not an Aliquot label; the string says what.
    Foreign(String),
}

impl Label {
    /// Bytes of the data area: after the label, rounded down to the sector.
    pub fn data_capacity(&self) -> u64 {
        data_capacity(self.device_size, self.ashift)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(LABEL_BLOCK);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.ashift.to_le_bytes());
        b.extend_from_slice(&self.guid.to_le_bytes());
        b.extend_from_slice(&self.device_size.to_le_bytes());
        let name = truncate_name(&self.name);
        b.extend_from_slice(&(name.len() as u32).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        let sum = fnv1a64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b.resize(LABEL_BLOCK, 0);
        b
    }

    pub fn decode(b: &[u8]) -> Found {
        if b.iter().all(|&x| x == 0) {
            return Found::Blank;
        }
        if b.len() < 40 || &b[..8] != MAGIC {
            return Found::Foreign("no Aliquot label (the device holds other data)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Found::Foreign(format!(
                "an Aliquot label of version {version}, this agent reads version {VERSION}"
            ));
        }
        let ashift = u32_at(12);
        let guid = u64_at(16);
        let device_size = u64_at(24);
        let name_len = u32_at(32) as usize;
        if name_len > MAX_NAME || 36 + name_len + 8 > b.len() {
            return Found::Foreign("a corrupt Aliquot label (bad name length)".into());
        }
        let end = 36 + name_len;
        if fnv1a64(&b[..end]) != u64_at(end) {
            return Found::Foreign("a corrupt Aliquot label (checksum mismatch)".into());
        }
        let Ok(name) = String::from_utf8(b[36..end].to_vec()) else {
            return Found::Foreign("a corrupt Aliquot label (name is not UTF-8)".into());
        };
        Found::Label(Label {
            guid,
            device_size,
            ashift,
            name,
        })
    }
}

pub fn data_capacity(device_size: u64, ashift: u32) -> u64 {
    let sector = 1u64 << ashift;
    device_size.saturating_sub(LABEL_SIZE) / sector * sector
}

fn truncate_name(name: &str) -> &str {
    let mut end = name.len().min(MAX_NAME);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

pub(crate) fn fnv1a64(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label() -> Label {
        Label {
            guid: 0x1234_5678_9abc_def0,
            device_size: 3 << 30,
            ashift: 12,
            name: "disk-a".into(),
        }
    }

    #[test]
    fn round_trip() {
        match Label::decode(&label().encode()) {
            Found::Label(l) => assert_eq!(l, label()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn foreign_blank_and_corrupt() {
        assert!(matches!(Label::decode(&[0u8; LABEL_BLOCK]), Found::Blank));
        let mut text = b"#!/bin/sh\necho hello\n".to_vec();
        text.resize(LABEL_BLOCK, 0);
        assert!(matches!(Label::decode(&text), Found::Foreign(_)));
        let mut b = label().encode();
        b[20] ^= 1; // flip a guid bit
        match Label::decode(&b) {
            Found::Foreign(m) => assert!(m.contains("checksum"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn capacity_excludes_label_and_rounds_to_sector() {
        assert_eq!(data_capacity(LABEL_SIZE + 10_000, 12), 8192);
        assert_eq!(data_capacity(LABEL_SIZE - 1, 12), 0);
        assert_eq!(label().data_capacity(), (3 << 30) - LABEL_SIZE);
    }
}
