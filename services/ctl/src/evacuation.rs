//! A vdev removal's progress as `status` shows it, in the table and in
//! JSON, like `zpool status`'s "remove:" section: what the allocator's
//! mover copied of the vdev, how fast, and what its mapping costs.

use aliquot_proto::v1::{Evacuation, PoolStatus};
use serde::Serialize;
use units::format_bytes_short as short;

use crate::status::as_string;

/// The table's line, while a removal is under way (or its vdev indirect).
pub fn evacuation_line(st: &PoolStatus) -> Option<String> {
    let e = st.evacuation.as_ref()?;
    let who = match e.name.is_empty() {
        true => format!("vdev {}", e.vdev),
        false => format!("{} ({})", e.name, e.vdev),
    };
    let state = if e.done {
        "done, indirect until its last entry is dropped".to_string()
    } else if e.move_rate == 0 {
        "paused (move_rate 0)".to_string()
    } else {
        format!(
            "at {} (limit {})",
            units::format_rate(e.rate),
            units::format_rate(e.move_rate as f64)
        )
    };
    let mut line = format!(
        "remove: {who}: copied {} of {} ({} of {} blocks) {state}, {} entries, {} of mapping",
        short(e.copied_bytes),
        short(e.total_bytes),
        e.copied_extents,
        e.total_extents,
        e.mapping_entries,
        units::format_bytes(e.mapping_bytes)
    );
    if !e.last_error.is_empty() && !e.done {
        line.push_str(&format!("\n  last failed move (retried): {}", e.last_error));
    }
    Some(line)
}

#[derive(Debug, Serialize)]
pub struct EvacuationJson {
    pub vdev: u32,
    pub name: String,
    #[serde(serialize_with = "as_string")]
    pub total_bytes: u64,
    #[serde(serialize_with = "as_string")]
    pub total_extents: u64,
    #[serde(serialize_with = "as_string")]
    pub copied_bytes: u64,
    #[serde(serialize_with = "as_string")]
    pub copied_extents: u64,
    /// Bytes/s over the last seconds.
    pub rate: f64,
    #[serde(serialize_with = "as_string")]
    pub move_rate: u64,
    pub done: bool,
    #[serde(serialize_with = "as_string")]
    pub mapping_entries: u64,
    #[serde(serialize_with = "as_string")]
    pub mapping_bytes: u64,
    pub last_error: String,
    #[serde(serialize_with = "as_string")]
    pub started_ms: u64,
}

impl From<&Evacuation> for EvacuationJson {
    fn from(e: &Evacuation) -> Self {
        EvacuationJson {
            vdev: e.vdev,
            name: e.name.clone(),
            total_bytes: e.total_bytes,
            total_extents: e.total_extents,
            copied_bytes: e.copied_bytes,
            copied_extents: e.copied_extents,
            rate: e.rate,
            move_rate: e.move_rate,
            done: e.done,
            mapping_entries: e.mapping_entries,
            mapping_bytes: e.mapping_bytes,
            last_error: e.last_error.clone(),
            started_ms: e.started_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_what_is_copied_and_the_mapping() {
        let mut st = PoolStatus::default();
        assert_eq!(evacuation_line(&st), None);
        st.evacuation = Some(Evacuation {
            vdev: 2,
            name: "file2".into(),
            total_bytes: 8 << 20,
            total_extents: 8,
            copied_bytes: 2 << 20,
            copied_extents: 2,
            rate: 1048576.0,
            move_rate: 64 << 20,
            mapping_entries: 2,
            mapping_bytes: 64,
            ..Default::default()
        });
        let line = evacuation_line(&st).unwrap();
        assert!(
            line.contains("file2 (2): copied 2.00M of 8.00M (2 of 8 blocks) at 1.00 MiB/s"),
            "{line}"
        );
        assert!(line.contains(", 2 entries, 64 B of mapping"), "{line}");
        let json =
            serde_json::to_value(EvacuationJson::from(st.evacuation.as_ref().unwrap())).unwrap();
        assert_eq!(json["copied_bytes"], "2097152");
        assert_eq!(json["done"], false);
    }
}
