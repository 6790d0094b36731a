//! OpenZFS's tunables by their OpenZFS names and defaults (`metaslab.c`,
//! `vdev.c`, `spa_misc.c` at zfs-2.4.0; the legacy throttle's at zfs-2.3.0),
//! settable by name from a string and validated against their ranges. Values
//! accept integers, booleans (0/1/true/false) and sizes with a binary suffix
//! ("2MiB", "128K").

use crate::{Error, Result, ThrottlePolicy, TunableInfo};

/// OpenZFS's tunables with their names and defaults; validated on set.
#[derive(Clone, Debug, PartialEq)]
pub struct Tunables {
    /// "unified" | "legacy" | "off".
    pub throttle_policy: ThrottlePolicy,
    /// `None`: the policy's default — 2 MiB under the unified throttle,
    /// 1 MiB under legacy (its value before OpenZFS #17020); see
    /// [`Tunables::aliquot`].
    pub metaslab_aliquot: Option<u64>,
    pub metaslab_bias_enabled: bool,
    pub metaslab_perf_bias: u8,
    pub zio_dva_throttle_enabled: bool,
    pub zfs_embedded_slog_min_ms: u64,
    pub zfs_vdev_async_write_active_min_dirty_percent: u64,
    pub zfs_vdev_async_write_active_max_dirty_percent: u64,
    pub zfs_mg_noalloc_threshold: u64,
    pub zfs_mg_fragmentation_threshold: u64,
    pub zfs_metaslab_fragmentation_threshold: u64,
    pub metaslab_lba_weighting_enabled: bool,
    pub metaslab_fragmentation_factor_enabled: bool,
    pub zfs_metaslab_segment_weight_enabled: bool,
    pub metaslab_df_alloc_threshold: u64,
    pub metaslab_df_free_pct: u64,
    pub metaslab_df_max_search: u64,
    pub metaslab_df_use_largest_segment: bool,
    pub zfs_metaslab_switch_threshold: u64,
    pub zfs_metaslab_find_max_tries: u64,
    pub zfs_metaslab_try_hard_before_gang: bool,
    pub metaslab_unload_delay: u64,
    pub metaslab_unload_delay_ms: u64,
    pub metaslab_preload_enabled: bool,
    pub metaslab_preload_limit: u64,
    pub spa_slop_shift: u64,
    pub zfs_vdev_default_ms_count: u64,
    pub zfs_vdev_min_ms_count: u64,
    pub zfs_vdev_ms_count_limit: u64,
    pub zfs_vdev_default_ms_shift: u64,
    pub zfs_vdev_max_ms_shift: u64,
    pub zfs_vdev_async_write_max_active: u64,
    pub zfs_vdev_queue_depth_pct: u64,
    pub zfs_vdev_def_queue_depth: u64,
    pub spa_num_allocators: u64,
    pub spa_cpus_per_allocator: u64,
}

impl Default for Tunables {
    fn default() -> Self {
        Tunables {
            throttle_policy: ThrottlePolicy::Unified,
            metaslab_aliquot: None,
            metaslab_bias_enabled: true,
            metaslab_perf_bias: 1,
            zio_dva_throttle_enabled: true,
            zfs_embedded_slog_min_ms: 64,
            zfs_vdev_async_write_active_min_dirty_percent: 30,
            zfs_vdev_async_write_active_max_dirty_percent: 60,
            zfs_mg_noalloc_threshold: 0,
            zfs_mg_fragmentation_threshold: 95,
            zfs_metaslab_fragmentation_threshold: 77,
            metaslab_lba_weighting_enabled: true,
            metaslab_fragmentation_factor_enabled: true,
            zfs_metaslab_segment_weight_enabled: true,
            metaslab_df_alloc_threshold: 128 << 10,
            metaslab_df_free_pct: 4,
            metaslab_df_max_search: 16 << 20,
            metaslab_df_use_largest_segment: false,
            zfs_metaslab_switch_threshold: 2,
            zfs_metaslab_find_max_tries: 100,
            zfs_metaslab_try_hard_before_gang: false,
            metaslab_unload_delay: 32,
            metaslab_unload_delay_ms: 600_000,
            metaslab_preload_enabled: true,
            metaslab_preload_limit: 10,
            spa_slop_shift: 5,
            zfs_vdev_default_ms_count: 200,
            zfs_vdev_min_ms_count: 16,
            zfs_vdev_ms_count_limit: 131072,
            zfs_vdev_default_ms_shift: 29,
            zfs_vdev_max_ms_shift: 34,
            zfs_vdev_async_write_max_active: 10,
            zfs_vdev_queue_depth_pct: 1000,
            zfs_vdev_def_queue_depth: 32,
            spa_num_allocators: 4,
            spa_cpus_per_allocator: 4,
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Bool,
    Int { min: u64, max: u64 },
    Size { min: u64, max: u64 },
    Policy,
}

struct Def {
    name: &'static str,
    kind: Kind,
    description: &'static str,
}

const fn int(min: u64, max: u64) -> Kind {
    Kind::Int { min, max }
}
const fn size(min: u64, max: u64) -> Kind {
    Kind::Size { min, max }
}

const DEFS: &[Def] = &[
    Def {
        name: "throttle_policy",
        kind: Kind::Policy,
        description: "allocation throttle: unified (OpenZFS #17020), legacy (request-based) or off",
    },
    Def {
        name: "metaslab_aliquot",
        kind: size(512, 1 << 30),
        description: "bytes per data child a group receives per rotor visit",
    },
    Def {
        name: "metaslab_bias_enabled",
        kind: Kind::Bool,
        description: "scale quotas by relative free fraction (0: capacity only, target 2x)",
    },
    Def {
        name: "metaslab_perf_bias",
        kind: int(0, 2),
        description: "0: never run ahead of the quota; 1: only when busy; 2: always",
    },
    Def {
        name: "zio_dva_throttle_enabled",
        kind: Kind::Bool,
        description: "admission throttle for data writes (applied at the next sync)",
    },
    Def {
        name: "zfs_embedded_slog_min_ms",
        kind: int(0, u32::MAX as u64),
        description: "vdevs with more metaslabs than this set one aside for the intent log",
    },
    Def {
        name: "zfs_vdev_async_write_active_min_dirty_percent",
        kind: int(0, 100),
        description: "lower point of the busy threshold (percent)",
    },
    Def {
        name: "zfs_vdev_async_write_active_max_dirty_percent",
        kind: int(0, 100),
        description: "upper point of the busy threshold (percent)",
    },
    Def {
        name: "zfs_mg_noalloc_threshold",
        kind: int(0, 100),
        description: "groups at or below this free percent are not allocatable while others are",
    },
    Def {
        name: "zfs_mg_fragmentation_threshold",
        kind: int(0, 100),
        description: "groups more fragmented than this percent are not allocatable while others are",
    },
    Def {
        name: "zfs_metaslab_fragmentation_threshold",
        kind: int(0, 100),
        description: "loaded metaslabs up to this fragmentation keep their activation (space weights)",
    },
    Def {
        name: "metaslab_lba_weighting_enabled",
        kind: Kind::Bool,
        description: "prefer low LBAs on rotational vdevs (space weights)",
    },
    Def {
        name: "metaslab_fragmentation_factor_enabled",
        kind: Kind::Bool,
        description: "scale space weights by fragmentation",
    },
    Def {
        name: "zfs_metaslab_segment_weight_enabled",
        kind: Kind::Bool,
        description: "weight metaslabs by their largest free segments rather than free space",
    },
    Def {
        name: "metaslab_df_alloc_threshold",
        kind: size(0, 1 << 40),
        description: "below this largest free segment the dynamic-fit allocator uses best fit",
    },
    Def {
        name: "metaslab_df_free_pct",
        kind: int(0, 100),
        description: "below this free percent the dynamic-fit allocator uses best fit",
    },
    Def {
        name: "metaslab_df_max_search",
        kind: size(0, 1 << 40),
        description: "bytes the first-fit cursor search may walk past before best fit",
    },
    Def {
        name: "metaslab_df_use_largest_segment",
        kind: Kind::Bool,
        description: "best-fit fallback takes the largest segment",
    },
    Def {
        name: "zfs_metaslab_switch_threshold",
        kind: int(0, 64),
        description: "buckets a segment weight may drop before switching metaslabs",
    },
    Def {
        name: "zfs_metaslab_try_hard_before_gang",
        kind: Kind::Bool,
        description: "retry ignoring group checks before giving up on any block (otherwise only log blocks and blocks at the minimum size; others fail as FRAGMENTED where OpenZFS would gang)",
    },
    Def {
        name: "zfs_metaslab_find_max_tries",
        kind: int(1, 1 << 32),
        description: "metaslabs examined per group before giving up (unless trying hard)",
    },
    Def {
        name: "spa_num_allocators",
        kind: int(1, 256),
        description: "most allocators (rotor + aliquot counter) per class; the count is fixed when the pool's CPU count is set",
    },
    Def {
        name: "spa_cpus_per_allocator",
        kind: int(1, 4096),
        description: "CPUs per allocator: spa_alloc_count = max(1, min(spa_num_allocators, cpus / this))",
    },
    Def {
        name: "metaslab_unload_delay_ms",
        kind: int(0, 1 << 40),
        description: "ms a metaslab also stays loaded after it was last selected (both delays must pass)",
    },
    Def {
        name: "metaslab_preload_enabled",
        kind: Kind::Bool,
        description: "after each sync, load the best metaslab_preload_limit metaslabs of each group",
    },
    Def {
        name: "metaslab_preload_limit",
        kind: int(0, 1 << 20),
        description: "metaslabs per group preloaded after each sync",
    },
    Def {
        name: "metaslab_unload_delay",
        kind: int(0, 1 << 32),
        description: "txgs a metaslab stays loaded after it was last selected",
    },
    Def {
        name: "spa_slop_shift",
        kind: int(1, 31),
        description: "slop space is 1/2^shift of the pool (bounded)",
    },
    Def {
        name: "zfs_vdev_default_ms_count",
        kind: int(16, 131072),
        description: "target metaslab count per vdev",
    },
    Def {
        name: "zfs_vdev_min_ms_count",
        kind: int(1, 131072),
        description: "minimum metaslab count per vdev",
    },
    Def {
        name: "zfs_vdev_ms_count_limit",
        kind: int(1, 1 << 24),
        description: "maximum metaslab count per vdev",
    },
    Def {
        name: "zfs_vdev_default_ms_shift",
        kind: int(24, 40),
        description: "default metaslab size (log2 bytes)",
    },
    Def {
        name: "zfs_vdev_max_ms_shift",
        kind: int(24, 40),
        description: "maximum metaslab size (log2 bytes)",
    },
    Def {
        name: "zfs_vdev_async_write_max_active",
        kind: int(1, 1000),
        description: "legacy throttle: per-vdev async writes in flight",
    },
    Def {
        name: "zfs_vdev_queue_depth_pct",
        kind: int(1, 100000),
        description: "legacy throttle: group queue depth limit as percent of async_write_max_active",
    },
    Def {
        name: "zfs_vdev_def_queue_depth",
        kind: int(1, 100000),
        description: "legacy throttle: initial per-group queue depth each txg",
    },
];

/// Parse "1", "true", "2097152", "2MiB", "128K", "1 GiB" into an integer.
pub(crate) fn parse_u64(value: &str) -> std::result::Result<u64, String> {
    let v = value.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, suffix) = v.split_at(split);
    if num.is_empty() {
        return Err("expected a number".into());
    }
    let n: u64 = num.parse().map_err(|_| "number too large".to_string())?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        other => return Err(format!("unknown size suffix {other:?}")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| "value too large".to_string())
}

fn parse_bool(value: &str) -> std::result::Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err("expected 0, 1, true or false".into()),
    }
}

pub(crate) fn parse_policy(value: &str) -> std::result::Result<ThrottlePolicy, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "unified" => Ok(ThrottlePolicy::Unified),
        "legacy" => Ok(ThrottlePolicy::Legacy),
        "off" => Ok(ThrottlePolicy::Off),
        _ => Err("expected unified, legacy or off".into()),
    }
}

pub(crate) fn policy_name(p: ThrottlePolicy) -> &'static str {
    match p {
        ThrottlePolicy::Unified => "unified",
        ThrottlePolicy::Legacy => "legacy",
        ThrottlePolicy::Off => "off",
    }
}

enum Value {
    Bool(bool),
    U64(u64),
    Policy(ThrottlePolicy),
}

impl Tunables {
    fn slot(&mut self, name: &str) -> Option<&mut u64> {
        Some(match name {
            "zfs_embedded_slog_min_ms" => &mut self.zfs_embedded_slog_min_ms,
            "zfs_vdev_async_write_active_min_dirty_percent" => {
                &mut self.zfs_vdev_async_write_active_min_dirty_percent
            }
            "zfs_vdev_async_write_active_max_dirty_percent" => {
                &mut self.zfs_vdev_async_write_active_max_dirty_percent
            }
            "zfs_mg_noalloc_threshold" => &mut self.zfs_mg_noalloc_threshold,
            "zfs_mg_fragmentation_threshold" => &mut self.zfs_mg_fragmentation_threshold,
            "zfs_metaslab_fragmentation_threshold" => {
                &mut self.zfs_metaslab_fragmentation_threshold
            }
            "metaslab_df_alloc_threshold" => &mut self.metaslab_df_alloc_threshold,
            "metaslab_df_free_pct" => &mut self.metaslab_df_free_pct,
            "metaslab_df_max_search" => &mut self.metaslab_df_max_search,
            "zfs_metaslab_switch_threshold" => &mut self.zfs_metaslab_switch_threshold,
            "zfs_metaslab_find_max_tries" => &mut self.zfs_metaslab_find_max_tries,
            "metaslab_unload_delay" => &mut self.metaslab_unload_delay,
            "metaslab_unload_delay_ms" => &mut self.metaslab_unload_delay_ms,
            "metaslab_preload_limit" => &mut self.metaslab_preload_limit,
            "spa_num_allocators" => &mut self.spa_num_allocators,
            "spa_cpus_per_allocator" => &mut self.spa_cpus_per_allocator,
            "spa_slop_shift" => &mut self.spa_slop_shift,
            "zfs_vdev_default_ms_count" => &mut self.zfs_vdev_default_ms_count,
            "zfs_vdev_min_ms_count" => &mut self.zfs_vdev_min_ms_count,
            "zfs_vdev_ms_count_limit" => &mut self.zfs_vdev_ms_count_limit,
            "zfs_vdev_default_ms_shift" => &mut self.zfs_vdev_default_ms_shift,
            "zfs_vdev_max_ms_shift" => &mut self.zfs_vdev_max_ms_shift,
            "zfs_vdev_async_write_max_active" => &mut self.zfs_vdev_async_write_max_active,
            "zfs_vdev_queue_depth_pct" => &mut self.zfs_vdev_queue_depth_pct,
            "zfs_vdev_def_queue_depth" => &mut self.zfs_vdev_def_queue_depth,
            _ => return None,
        })
    }

    fn bool_slot(&mut self, name: &str) -> Option<&mut bool> {
        Some(match name {
            "metaslab_bias_enabled" => &mut self.metaslab_bias_enabled,
            "zio_dva_throttle_enabled" => &mut self.zio_dva_throttle_enabled,
            "metaslab_lba_weighting_enabled" => &mut self.metaslab_lba_weighting_enabled,
            "metaslab_fragmentation_factor_enabled" => {
                &mut self.metaslab_fragmentation_factor_enabled
            }
            "zfs_metaslab_segment_weight_enabled" => &mut self.zfs_metaslab_segment_weight_enabled,
            "metaslab_df_use_largest_segment" => &mut self.metaslab_df_use_largest_segment,
            "zfs_metaslab_try_hard_before_gang" => &mut self.zfs_metaslab_try_hard_before_gang,
            "metaslab_preload_enabled" => &mut self.metaslab_preload_enabled,
            _ => return None,
        })
    }

    fn value(&self, name: &str) -> Option<Value> {
        let mut copy = self.clone();
        if name == "throttle_policy" {
            return Some(Value::Policy(self.throttle_policy));
        }
        if name == "metaslab_perf_bias" {
            return Some(Value::U64(self.metaslab_perf_bias as u64));
        }
        if name == "metaslab_aliquot" {
            return Some(Value::U64(self.aliquot()));
        }
        if let Some(b) = copy.bool_slot(name) {
            return Some(Value::Bool(*b));
        }
        copy.slot(name).map(|v| Value::U64(*v))
    }

    /// Set by OpenZFS name from a string ("1", "true", "2097152", "2MiB" ...).
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let def = DEFS
            .iter()
            .find(|d| d.name == name)
            .ok_or_else(|| Error::UnknownTunable(name.to_string()))?;
        let bad = |reason: String| Error::BadTunableValue {
            name: name.to_string(),
            value: value.to_string(),
            reason,
        };
        match def.kind {
            Kind::Policy => self.throttle_policy = parse_policy(value).map_err(bad)?,
            Kind::Bool => {
                let b = parse_bool(value).map_err(bad)?;
                *self.bool_slot(name).expect("bool tunable") = b;
            }
            Kind::Int { min, max } | Kind::Size { min, max } => {
                let n = match def.kind {
                    // Booleans are accepted where OpenZFS takes 0/1 ints.
                    Kind::Int { .. } => parse_bool(value)
                        .map(u64::from)
                        .or_else(|_| parse_u64(value))
                        .map_err(bad)?,
                    _ => parse_u64(value).map_err(bad)?,
                };
                if n < min || n > max {
                    return Err(bad(format!("must be in {min}..={max}")));
                }
                if name == "metaslab_perf_bias" {
                    self.metaslab_perf_bias = n as u8;
                } else if name == "metaslab_aliquot" {
                    self.metaslab_aliquot = Some(n);
                } else {
                    let mut next = self.clone();
                    *next.slot(name).expect("int tunable") = n;
                    next.check_pairs().map_err(bad)?;
                    *self = next;
                }
            }
        }
        Ok(())
    }

    /// Constraints between tunables.
    fn check_pairs(&self) -> std::result::Result<(), String> {
        if self.zfs_vdev_default_ms_shift > self.zfs_vdev_max_ms_shift {
            return Err("zfs_vdev_default_ms_shift must not exceed zfs_vdev_max_ms_shift".into());
        }
        if self.zfs_vdev_min_ms_count > self.zfs_vdev_default_ms_count {
            return Err("zfs_vdev_min_ms_count must not exceed zfs_vdev_default_ms_count".into());
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Result<String> {
        match self.value(name) {
            Some(Value::Bool(b)) => Ok(if b { "1" } else { "0" }.to_string()),
            Some(Value::U64(n)) => Ok(n.to_string()),
            Some(Value::Policy(p)) => Ok(policy_name(p).to_string()),
            None => Err(Error::UnknownTunable(name.to_string())),
        }
    }

    /// `metaslab_aliquot` in effect: the value set, else the policy's
    /// default (`metaslab_aliquot` was 1 MiB before #17020 raised it to 2 MiB;
    /// a legacy pool compares with the real old policy only with 1 MiB).
    pub fn aliquot(&self) -> u64 {
        self.metaslab_aliquot.unwrap_or(match self.throttle_policy {
            ThrottlePolicy::Legacy => 1 << 20,
            ThrottlePolicy::Unified | ThrottlePolicy::Off => 2 << 20,
        })
    }

    /// Every tunable with its current value; defaults are those of the
    /// throttle policy in effect.
    pub fn list(&self) -> Vec<(TunableInfo, String)> {
        // metaslab_aliquot's default follows the policy in effect.
        let defaults = Tunables {
            throttle_policy: self.throttle_policy,
            ..Tunables::default()
        };
        let policy_default = policy_name(Tunables::default().throttle_policy).to_string();
        DEFS.iter()
            .map(|d| {
                (
                    TunableInfo {
                        name: d.name,
                        default: if d.name == "throttle_policy" {
                            policy_default.clone()
                        } else {
                            defaults.get(d.name).unwrap_or_default()
                        },
                        description: d.description,
                    },
                    self.get(d.name).unwrap_or_default(),
                )
            })
            .collect()
    }

    /// The spec's busy threshold in percent of alloc_max × 2 (preface).
    pub(crate) fn busy_pct_sum(&self) -> u64 {
        self.zfs_vdev_async_write_active_min_dirty_percent
            + self.zfs_vdev_async_write_active_max_dirty_percent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_set_get() {
        let mut t = Tunables::default();
        assert_eq!(t.get("metaslab_aliquot").unwrap(), "2097152");
        assert_eq!(t.get("zfs_embedded_slog_min_ms").unwrap(), "64");
        assert_eq!(t.get("throttle_policy").unwrap(), "unified");
        t.set("metaslab_aliquot", "1MiB").unwrap();
        assert_eq!(t.aliquot(), 1 << 20);
        t.set("metaslab_bias_enabled", "false").unwrap();
        assert!(!t.metaslab_bias_enabled);
        t.set("metaslab_perf_bias", "2").unwrap();
        assert_eq!(t.metaslab_perf_bias, 2);
        t.set("throttle_policy", "legacy").unwrap();
        assert_eq!(t.throttle_policy, ThrottlePolicy::Legacy);
        let before = t.clone();
        assert!(matches!(
            t.set("metaslab_perf_bias", "3"),
            Err(Error::BadTunableValue { .. })
        ));
        assert!(matches!(
            t.set("spa_slop_shift", "0"),
            Err(Error::BadTunableValue { .. })
        ));
        assert!(matches!(t.set("nope", "1"), Err(Error::UnknownTunable(_))));
        assert!(matches!(
            t.set("metaslab_aliquot", "2XB"),
            Err(Error::BadTunableValue { .. })
        ));
        assert_eq!(t, before);
        let list = t.list();
        assert_eq!(list.len(), DEFS.len());
        assert!(list.iter().all(|(i, v)| t.get(i.name).unwrap() == *v));
        // Setting each tunable to its listed default changes nothing.
        for (info, _) in &Tunables::default().list() {
            let mut d = Tunables::default();
            d.set(info.name, &info.default).unwrap();
            assert_eq!(d.list(), Tunables::default().list(), "{}", info.name);
        }
    }

    #[test]
    fn legacy_defaults_to_the_old_aliquot_unless_set() {
        let mut t = Tunables::default();
        assert_eq!(t.aliquot(), 2 << 20);
        t.set("throttle_policy", "legacy").unwrap();
        assert_eq!(t.aliquot(), 1 << 20);
        assert_eq!(t.get("metaslab_aliquot").unwrap(), "1048576");
        let listed = t.list();
        let (info, value) = listed
            .iter()
            .find(|(i, _)| i.name == "metaslab_aliquot")
            .unwrap();
        assert_eq!(
            (info.default.as_str(), value.as_str()),
            ("1048576", "1048576")
        );
        // Set explicitly, it holds whatever the policy.
        t.set("metaslab_aliquot", "4MiB").unwrap();
        t.set("throttle_policy", "unified").unwrap();
        assert_eq!(t.aliquot(), 4 << 20);
        t.set("throttle_policy", "legacy").unwrap();
        assert_eq!(t.aliquot(), 4 << 20);
    }
}
