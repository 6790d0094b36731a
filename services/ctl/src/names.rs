//! Names, not numbers: operators name vdevs as their agents do (`file0`,
//! `hdd1`) and tunables by OpenZFS's names. This module turns what they type
//! into what the API takes (a vdev id), says `name (id)` back, and suggests
//! the closest name when one is mistyped.

use aliquot_proto::v1::PoolStatus;

/// What a vdev is called in reports: `file0 (2)`.
pub fn vdev_label(id: u32, name: &str) -> String {
    if name.is_empty() {
        format!("vdev {id}")
    } else {
        format!("{name} ({id})")
    }
}

/// The vdev `spec` names in `pool`: its name first (a vdev could be named
/// "1"), else its id. Returns (id, name).
pub fn resolve_vdev(pool: &PoolStatus, spec: &str) -> Result<(u32, String), String> {
    if let Some(v) = pool.vdevs.iter().find(|v| v.name == spec) {
        return Ok((v.vdev, v.name.clone()));
    }
    if let Ok(id) = spec.parse::<u32>()
        && let Some(v) = pool.vdevs.iter().find(|v| v.vdev == id)
    {
        return Ok((v.vdev, v.name.clone()));
    }
    let known: Vec<String> = pool
        .vdevs
        .iter()
        .map(|v| vdev_label(v.vdev, &v.name))
        .collect();
    let hint = match did_you_mean(spec, pool.vdevs.iter().map(|v| v.name.as_str())) {
        Some(n) => format!("did you mean {n:?}? "),
        None => String::new(),
    };
    Err(format!(
        "no vdev named or numbered {spec:?} in pool {}; {hint}the pool has: {}",
        pool.name,
        if known.is_empty() {
            "no vdevs".to_string()
        } else {
            known.join(", ")
        }
    ))
}

/// The candidate closest to `typed`, if it is close enough to be a typo
/// (edits, a swap of two letters counting as one, at most a third of the
/// name: none for names of one or two letters).
pub fn did_you_mean<'a>(typed: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let limit = typed.chars().count() / 3;
    candidates
        .map(|c| (strsim::osa_distance(typed, c), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// `NAME=VALUE` or the two words `NAME VALUE`, as `tunables set` takes them
/// (the first form is what `up --tunable` and the allocator's `--tunable` use).
pub fn split_assignment(name: &str, value: Option<&str>) -> Result<(String, String), String> {
    match (name.split_once('='), value) {
        (Some((n, v)), None) if !n.is_empty() => Ok((n.to_string(), v.to_string())),
        (Some(_), Some(_)) => Err(format!(
            "give either NAME=VALUE or NAME VALUE, not both ({name:?} and a value)"
        )),
        (None, Some(v)) => Ok((name.to_string(), v.to_string())),
        _ => Err(format!(
            "{name:?}: give the new value, as NAME=VALUE or NAME VALUE"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aliquot_proto::v1::VdevStatus;

    fn pool() -> PoolStatus {
        let v = |vdev, name: &str| VdevStatus {
            vdev,
            name: name.into(),
            ..Default::default()
        };
        PoolStatus {
            name: "tank".into(),
            vdevs: vec![v(0, "file0"), v(1, "file1"), v(2, "7")],
            ..Default::default()
        }
    }

    #[test]
    fn names_win_over_ids() {
        let p = pool();
        assert_eq!(resolve_vdev(&p, "file1").unwrap(), (1, "file1".into()));
        assert_eq!(resolve_vdev(&p, "0").unwrap(), (0, "file0".into()));
        // "7" is vdev 2's name, not an id.
        assert_eq!(resolve_vdev(&p, "7").unwrap(), (2, "7".into()));
    }

    #[test]
    fn unknown_vdev_lists_the_pool_and_suggests() {
        let e = resolve_vdev(&pool(), "flie0").unwrap_err();
        assert!(e.contains("did you mean \"file0\""), "{e}");
        assert!(e.contains("file0 (0), file1 (1)"), "{e}");
        let e = resolve_vdev(&pool(), "9").unwrap_err();
        assert!(!e.contains("did you mean"), "{e}");
    }

    #[test]
    fn assignments() {
        assert_eq!(
            split_assignment("zfs_txg_timeout=5", None).unwrap(),
            ("zfs_txg_timeout".into(), "5".into())
        );
        assert_eq!(
            split_assignment("zfs_txg_timeout", Some("5")).unwrap(),
            ("zfs_txg_timeout".into(), "5".into())
        );
        assert!(split_assignment("zfs_txg_timeout", None).is_err());
        assert!(split_assignment("a=1", Some("2")).is_err());
        assert!(split_assignment("=1", None).is_err());
    }

    #[test]
    fn typo_suggestions() {
        let names = ["metaslab_aliquot", "zfs_txg_timeout", "metaslab_perf_bias"];
        assert_eq!(
            did_you_mean("metaslab_aliqout", names.iter().copied()),
            Some("metaslab_aliquot")
        );
        assert_eq!(did_you_mean("nothing_like_it", names.iter().copied()), None);
    }
}
