//! Human units for the command line and scenario files: byte sizes
//! (`128GiB`, `4k`, `1000000`), rates (`500MiB/s`) and durations (`100us`,
//! `5s`). Binary prefixes are powers of 1024; SI ones (`GB`) powers of 1000,
//! as `zpool` and `fio` users expect. Used by every binary, no dependencies.
#![forbid(unsafe_code)]

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error("{0:?} is not a size (try 4096, 128K, 1GiB, 2TB)")]
    Size(String),
    #[error("{0:?} is not a rate (try 500MiB/s)")]
    Rate(String),
    #[error("{0:?} is not a duration (try 100us, 4ms, 5s, 2m, 7d)")]
    Duration(String),
}

fn split_number(s: &str) -> (&str, &str) {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    (&s[..end], s[end..].trim())
}

/// Bytes from `4096`, `4k`, `4K`, `4KiB`, `1.5GiB`, `2TB` (SI), `16M`.
pub fn parse_size(s: &str) -> Result<u64, UnitError> {
    let err = || UnitError::Size(s.to_string());
    let t = s.trim();
    let (num, unit) = split_number(t);
    if num.is_empty() {
        return Err(err());
    }
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "p" | "pib" => 1024f64.powi(5),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "pb" => 1e15,
        _ => return Err(err()),
    };
    let v: f64 = num.replace('_', "").parse().map_err(|_| err())?;
    let bytes = v * mult;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(err());
    }
    Ok(bytes.round() as u64)
}

/// Bytes per second from `500MiB/s`, `1.2GB/s`, `150M` (the `/s` is optional).
pub fn parse_rate(s: &str) -> Result<f64, UnitError> {
    let t = s.trim();
    let t = t
        .strip_suffix("/s")
        .or_else(|| t.strip_suffix("ps"))
        .unwrap_or(t);
    let v = parse_size(t).map_err(|_| UnitError::Rate(s.to_string()))?;
    Ok(v as f64)
}

/// `100us`, `4ms`, `5s`, `1.5s`, `2m`, `3h`, `7d`, `250ns`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, UnitError> {
    let err = || UnitError::Duration(s.to_string());
    let (num, unit) = split_number(s.trim());
    let v: f64 = num.replace('_', "").parse().map_err(|_| err())?;
    let secs = match unit {
        "ns" => v * 1e-9,
        "us" | "µs" => v * 1e-6,
        "ms" => v * 1e-3,
        "" | "s" => v,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        "d" => v * 86400.0,
        _ => return Err(err()),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(err());
    }
    Duration::try_from_secs_f64(secs).map_err(|_| err())
}

/// `1.50 GiB`-style rendering, binary prefixes.
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

/// Compact form for tables, like `zpool list`: `1.5G`, `512M`, `0`.
pub fn format_bytes_short(b: u64) -> String {
    const UNITS: [&str; 6] = ["", "K", "M", "G", "T", "P"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b}")
    } else if v < 10.0 {
        format!("{v:.2}{}", UNITS[i])
    } else if v < 100.0 {
        format!("{v:.1}{}", UNITS[i])
    } else {
        format!("{v:.0}{}", UNITS[i])
    }
}

/// A latency in microseconds, compact for tables: `850us`, `12.3ms`, `1.50s`.
pub fn format_micros(us: u64) -> String {
    if us < 1000 {
        format!("{us}us")
    } else if us < 10_000 {
        format!("{:.2}ms", us as f64 / 1e3)
    } else if us < 1_000_000 {
        format!("{:.1}ms", us as f64 / 1e3)
    } else {
        format!("{:.2}s", us as f64 / 1e6)
    }
}

pub fn format_rate(bytes_per_sec: f64) -> String {
    format!("{}/s", format_bytes(bytes_per_sec.max(0.0) as u64))
}

/// clap value parsers.
pub fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}
pub fn rate_arg(s: &str) -> Result<f64, String> {
    parse_rate(s).map_err(|e| e.to_string())
}
pub fn duration_arg(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros() {
        assert_eq!(format_micros(850), "850us");
        assert_eq!(format_micros(1_234), "1.23ms");
        assert_eq!(format_micros(47_711), "47.7ms");
        assert_eq!(format_micros(1_500_000), "1.50s");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("128GiB").unwrap(), 128 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("2TB").unwrap(), 2_000_000_000_000);
        assert_eq!(parse_size(" 16M ").unwrap(), 16 << 20);
        assert!(parse_size("").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("-1").is_err());
    }

    #[test]
    fn rates_and_durations() {
        assert_eq!(parse_rate("500MiB/s").unwrap(), (500u64 << 20) as f64);
        assert_eq!(parse_rate("150M").unwrap(), (150u64 << 20) as f64);
        assert_eq!(parse_duration("100us").unwrap(), Duration::from_micros(100));
        assert_eq!(parse_duration("4ms").unwrap(), Duration::from_millis(4));
        assert_eq!(parse_duration("5").unwrap(), Duration::from_secs(5));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert!(parse_duration("5 fortnights").is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(3 << 29), "1.50 GiB");
        assert_eq!(format_bytes_short(1 << 30), "1.00G");
        assert_eq!(format_bytes_short(200 << 20), "200M");
    }
}
