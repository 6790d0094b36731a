//! `aliquotctl status`: the pool as `zpool list -v` shows it, plus the
//! throttle's view of each class. Rendering is pure (PoolStatus → text or
//! JSON) so it can be checked without a pool.

use std::fmt::Write as _;

use aliquot_proto::v1::{
    ClassStatus, GetPoolRequest, GroupStatus, PoolStatus, VdevHealth, VdevStatus, WatchPoolRequest,
};
use serde::Serialize;
use units::format_bytes_short as short;

use crate::client::{self, AllocatorArgs};

#[derive(Clone, Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub conn: AllocatorArgs,
    /// Print JSON instead of the table (with --watch: one object per line).
    #[arg(long, env = "ALIQUOT_JSON")]
    pub json: bool,
    /// Keep refreshing, from the allocator's WatchPool stream.
    #[arg(long, short = 'w', env = "ALIQUOT_WATCH")]
    pub watch: bool,
    /// Refresh interval for --watch.
    #[arg(long, env = "ALIQUOT_WATCH_INTERVAL", value_parser = units::duration_arg, default_value = "1s")]
    pub interval: std::time::Duration,
    /// Exact numbers: sizes in bytes (like `zpool list -p`).
    #[arg(short = 'p', long = "parsable", env = "ALIQUOT_STATUS_PARSABLE")]
    pub parsable: bool,
    /// Scripted mode: the vdev table's rows only, no headers or footers,
    /// fields separated by one tab (like `zpool list -H`).
    #[arg(short = 'H', long = "scripted", env = "ALIQUOT_STATUS_SCRIPTED")]
    pub scripted: bool,
    /// Warn when a vdev's fill runs this many percentage points above its
    /// class's (0 turns the warning off).
    #[arg(long, env = "ALIQUOT_STATUS_WARN_AHEAD", default_value_t = 10.0)]
    pub warn_ahead: f64,
}

/// How the table is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Style {
    /// Sizes in bytes, not 1.00G.
    pub exact: bool,
    /// Rows only, tab-separated.
    pub scripted: bool,
    /// Percentage points above the class's fill that earn a warning (0: off).
    pub warn_ahead: f64,
}

impl Default for Style {
    fn default() -> Self {
        Style {
            exact: false,
            scripted: false,
            warn_ahead: 10.0,
        }
    }
}

impl Style {
    fn size(&self, n: u64) -> String {
        if self.exact { n.to_string() } else { short(n) }
    }
}

pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let style = Style {
        exact: args.parsable,
        scripted: args.scripted,
        warn_ahead: args.warn_ahead,
    };
    let mut c = args.conn.connect().await?;
    if !args.watch {
        let st = c
            .get_pool(GetPoolRequest {})
            .await
            .map_err(|s| client::status_msg("get pool", &s))?
            .into_inner();
        print_status(&st, args.json, false, style)?;
        return Ok(());
    }
    let interval_ms = args.interval.as_millis().clamp(1, u32::MAX as u128) as u32;
    let mut stream = c
        .watch_pool(WatchPoolRequest { interval_ms })
        .await
        .map_err(|s| client::status_msg("watch pool", &s))?
        .into_inner();
    loop {
        tokio::select! {
            msg = stream.message() => match msg.map_err(|s| client::status_msg("watch pool", &s))? {
                Some(st) => {
                    // `--watch | head`: the reader left, so stop quietly.
                    // Clear the screen only on a terminal: a file or pipe
                    // gets one table after another.
                    let clear = !args.json
                        && !args.scripted
                        && std::io::IsTerminal::is_terminal(&std::io::stdout());
                    if !print_status(&st, args.json, clear, style)? {
                        return Ok(());
                    }
                }
                None => anyhow::bail!("the allocator ended the watch stream"),
            },
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// Print one status; `Ok(false)` when stdout's reader has gone (a closed
/// pipe is how `| head` says "enough", not an error to report).
fn print_status(st: &PoolStatus, json: bool, clear: bool, style: Style) -> anyhow::Result<bool> {
    use std::io::Write;
    let mut text = String::new();
    if clear {
        // Clear the screen and home the cursor, like `watch`.
        text.push_str("\x1b[2J\x1b[H");
    }
    if json {
        text.push_str(&serde_json::to_string(&PoolJson::from(st))?);
        text.push('\n');
    } else {
        if let (true, Some(f)) = (style.scripted, &st.persist_failure) {
            // Rows only on stdout; the failure still reaches the operator.
            eprintln!("{}", persist_failure_line(st, f));
        }
        text.push_str(&render_table_with(st, style));
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The indirect mapping, as `zpool status` shows a removal's: entries of
/// moved blocks whose old address still answers, and their bytes.
pub fn mapping_line(st: &PoolStatus) -> Option<String> {
    if st.mapping_entries == 0 {
        return None;
    }
    Some(format!(
        "mapping: {} entries for {} of moved blocks' old addresses, {} of mapping in memory",
        st.mapping_entries,
        short(st.mapping_bytes),
        short(st.mapping_memory_bytes)
    ))
}

/// The store refuses a txg: one line no operator can miss.
pub fn persist_failure_line(st: &PoolStatus, f: &aliquot_proto::v1::PersistFailure) -> String {
    let secs = st.time_ms.saturating_sub(f.since_ms) as f64 / 1000.0;
    format!(
        "STORE FAILING: txg {} not persisted for {secs:.1} s ({} attempts): {}. Nothing \
         committed after txg {} is durable; SyncTxg and wait_synced commits wait, and the \
         allocator retries by itself until the store takes it (free space under the store, \
         or bring it back)",
        f.txg, f.attempts, f.error, st.synced_txg
    )
}

/// Health as operators read it; an administratively offline vdev is OFFLINE.
pub fn health_name(h: i32, online: bool) -> &'static str {
    if !online {
        return "offline";
    }
    match VdevHealth::try_from(h).unwrap_or(VdevHealth::Unspecified) {
        VdevHealth::Healthy => "healthy",
        VdevHealth::Degraded => "degraded",
        VdevHealth::Faulted => "faulted",
        VdevHealth::Unavailable => "unavailable",
        VdevHealth::Unspecified => "unknown",
    }
}

fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{}%", (part as u128 * 100 / whole as u128))
    }
}

fn frag(f: i32) -> String {
    if f < 0 { "-".into() } else { format!("{f}%") }
}

/// The table header; tests hold it fixed.
pub const VDEV_HEADER: [&str; 13] = [
    "NAME",
    "SIZE",
    "ALLOC",
    "FREE",
    "CAP",
    "VAR",
    "FRAG",
    "HEALTH",
    "QDEPTH",
    "QTARGET",
    "ALIQUOT",
    "EMBLOG",
    "ALLOC'ABLE",
];
pub const CLASS_HEADER: [&str; 8] = [
    "CLASS",
    "LIMIT",
    "RESERVED",
    "BUSY",
    "WAITING",
    "IO_SIZE",
    "THROTTLE",
    "USED/LIMIT",
];

/// A class the throttle does not bound has no limit to show, whatever
/// `alloc_max` its aliquots add up to.
fn limit(c: &ClassStatus, style: Style) -> String {
    if !c.throttle_enabled {
        "-".into()
    } else {
        style.size(c.alloc_max)
    }
}

fn vdev_of(st: &PoolStatus, id: u32) -> Option<&VdevStatus> {
    st.vdevs.iter().find(|v| v.vdev == id)
}

fn vdev_label(st: &PoolStatus, id: u32) -> String {
    match vdev_of(st, id) {
        Some(v) if !v.name.is_empty() => format!("{} ({id})", v.name),
        _ => format!("vdev {id}"),
    }
}

/// Pool health rolled up from its vdevs as `zpool status` names it: ONLINE
/// when every vdev is healthy and online, SUSPENDED when no vdev is, else
/// DEGRADED; with the vdevs that are not ("file1 offline").
pub fn pool_health(st: &PoolStatus) -> (&'static str, Vec<String>) {
    if st.vdevs.is_empty() {
        return ("SUSPENDED", vec!["no vdevs".into()]);
    }
    let why: Vec<String> = st
        .vdevs
        .iter()
        // A vdev being removed was taken offline on purpose (and its
        // agent may be gone once it is indirect): not a fault.
        .filter(|v| st.evacuation.as_ref().is_none_or(|e| e.vdev != v.vdev))
        .filter_map(|v| {
            let h = health_name(v.health, v.online);
            (h != "healthy").then(|| format!("{} {h}", vdev_label(st, v.vdev)))
        })
        .collect();
    let state = if why.len() == st.vdevs.len() {
        "SUSPENDED"
    } else if why.is_empty() {
        "ONLINE"
    } else {
        "DEGRADED"
    };
    (state, why)
}

/// Balance of a class as `ceph osd df` ends: VAR = a vdev's used fraction
/// over the class's; STDDEV (population) and spread of the used fractions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Balance {
    pub min_var: f64,
    pub max_var: f64,
    pub stddev: f64,
    pub spread: f64,
}

fn used(g: &GroupStatus) -> f64 {
    g.alloc as f64 / g.capacity as f64
}

fn class_used(c: &ClassStatus) -> f64 {
    let cap: u128 = c.groups.iter().map(|g| u128::from(g.capacity)).sum();
    let alloc: u128 = c
        .groups
        .iter()
        .filter(|g| g.capacity > 0)
        .map(|g| u128::from(g.alloc))
        .sum();
    if cap == 0 {
        0.0
    } else {
        alloc as f64 / cap as f64
    }
}

/// VAR of one group in its class; `None` when either is empty.
fn var(c: &ClassStatus, g: &GroupStatus) -> Option<f64> {
    let cu = class_used(c);
    (g.capacity > 0 && cu > 0.0).then(|| used(g) / cu)
}

pub fn balance(c: &ClassStatus) -> Option<Balance> {
    let fr: Vec<f64> = c
        .groups
        .iter()
        .filter(|g| g.capacity > 0)
        .map(used)
        .collect();
    if fr.is_empty() {
        return None;
    }
    let vars: Vec<f64> = c.groups.iter().filter_map(|g| var(c, g)).collect();
    let mean = fr.iter().sum::<f64>() / fr.len() as f64;
    let sd = (fr.iter().map(|f| (f - mean).powi(2)).sum::<f64>() / fr.len() as f64).sqrt();
    let max = |v: &[f64]| v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    Some(Balance {
        min_var: if vars.is_empty() { 0.0 } else { min(&vars) },
        max_var: if vars.is_empty() { 0.0 } else { max(&vars) },
        stddev: sd,
        spread: max(&fr) - min(&fr),
    })
}

/// `zpool list -v`-like: the pool, each class, each vdev of the class.
/// One line per device waiting for an operator to admit it.
pub fn pending_lines(st: &PoolStatus) -> Vec<String> {
    st.pending_vdevs
        .iter()
        .map(|p| {
            format!(
                "pending: {} ({}{}, device {:#x} at {}, agent certificate {}) waits to join: \
                 `aliquotctl vdev add {}` adds it",
                p.name,
                units::format_bytes(p.capacity),
                if p.log { " log" } else { "" },
                p.device_guid,
                p.endpoint,
                p.agent,
                p.name
            )
        })
        .collect()
}

pub fn render_table(st: &PoolStatus) -> String {
    render_table_with(st, Style::default())
}

/// Freed bytes still counted in ALLOC (deferred frees): a `free` is not
/// seen as missing while they wait out their two txgs.
pub fn deferred_note(st: &PoolStatus, style: Style) -> Option<String> {
    let d: u64 = st.classes.iter().map(|c| c.deferred).sum();
    (d > 0).then(|| {
        format!(
            "frees deferred: {} of ALLOC is freed and reusable once 2 more txgs have synced",
            style.size(d)
        )
    })
}

/// Vdevs whose fill runs more than `style.warn_ahead` points above their
/// class's: the ones a balancer (or the operator) should look at first.
pub fn ahead_warnings(st: &PoolStatus, style: Style) -> Vec<String> {
    let mut out = Vec::new();
    if style.warn_ahead <= 0.0 {
        return out;
    }
    for c in st
        .classes
        .iter()
        .filter(|c| c.space > 0 && c.name != "embedded_log")
    {
        let cu = class_used(c);
        for g in c.groups.iter().filter(|g| g.capacity > 0) {
            let ahead = (used(g) - cu) * 100.0;
            if ahead > style.warn_ahead {
                out.push(format!(
                    "warning: {} is {:.0} points ahead of the {} class ({:.0}% full vs {:.0}%)",
                    vdev_label(st, g.vdev),
                    // Truncated, as the CAP column is, so the figures add up.
                    (used(g) * 100.0).floor() - (cu * 100.0).floor(),
                    c.name,
                    (used(g) * 100.0).floor(),
                    (cu * 100.0).floor()
                ));
            }
        }
    }
    out
}

/// The table in a given style (see [`Style`]).
pub fn render_table_with(st: &PoolStatus, style: Style) -> String {
    let short = |n: u64| style.size(n);
    let mut rows: Vec<[String; 13]> = Vec::new();
    let (health, why) = pool_health(st);
    let size: u64 = st.vdevs.iter().map(|v| v.capacity).sum();
    let alloc: u64 = st.vdevs.iter().map(|v| v.alloc).sum();
    let dash = || "-".to_string();
    rows.push([
        st.name.clone(),
        short(size),
        short(alloc),
        short(size.saturating_sub(alloc)),
        pct(alloc, size),
        dash(),
        st.classes
            .iter()
            .find(|c| c.name == "normal")
            .map(|c| frag(c.fragmentation))
            .unwrap_or_else(dash),
        health.to_string(),
        short(
            st.classes
                .iter()
                .flat_map(|c| &c.groups)
                .map(|g| g.queue_depth)
                .sum(),
        ),
        dash(),
        dash(),
        dash(),
        dash(),
    ]);
    for c in &st.classes {
        // A class with no space (e.g. embedded_log on vdevs too small for a
        // log metaslab) has nothing to show per vdev; JSON still lists it.
        if c.groups.is_empty() || c.space == 0 {
            continue;
        }
        rows.push([
            format!("  {}", c.name),
            short(c.space),
            short(c.alloc),
            short(c.space.saturating_sub(c.alloc)),
            pct(c.alloc, c.space),
            dash(),
            frag(c.fragmentation),
            dash(),
            short(c.groups.iter().map(|g| g.queue_depth).sum()),
            dash(),
            dash(),
            dash(),
            dash(),
        ]);
        for g in &c.groups {
            let v = vdev_of(st, g.vdev);
            // A vdev with no embedded log metaslab has no part in that class.
            if c.name == "embedded_log" && v.is_some_and(|v| v.embedded_log_metaslab.is_none()) {
                continue;
            }
            let online = v.map(|v| v.online).unwrap_or(true);
            let emblog = match v.and_then(|v| v.embedded_log_metaslab) {
                Some(ms) => format!("ms {ms}"),
                None => dash(),
            };
            // The embedded log class's groups are whole vdevs (their fill
            // balances it, as in OpenZFS): its row shows the metaslab set
            // aside, whose own allocated bytes GetPool does not break down
            // per vdev (the class line has their sum).
            if c.name == "embedded_log" {
                rows.push([
                    format!("    {}", vdev_label(st, g.vdev)),
                    short(v.map_or(0, |v| v.metaslab_size)),
                    dash(),
                    dash(),
                    dash(),
                    dash(),
                    dash(),
                    health_name(g.health, online).to_uppercase(),
                    short(g.queue_depth),
                    dash(),
                    dash(),
                    emblog,
                    if g.allocatable { "yes" } else { "no" }.to_string(),
                ]);
                continue;
            }
            rows.push([
                format!("    {}", vdev_label(st, g.vdev)),
                short(g.capacity),
                short(g.alloc),
                short(g.capacity.saturating_sub(g.alloc)),
                pct(g.alloc, g.capacity),
                var(c, g).map_or_else(dash, |v| format!("{v:.2}")),
                frag(g.fragmentation),
                health_name(g.health, online).to_uppercase(),
                short(g.queue_depth),
                short(g.queue_target),
                short(g.aliquot),
                emblog,
                if g.allocatable { "yes" } else { "no" }.to_string(),
            ]);
        }
    }
    if style.scripted {
        let mut out = String::new();
        for r in &rows {
            out.push_str(&r.iter().map(|c| c.trim()).collect::<Vec<_>>().join("\t"));
            out.push('\n');
        }
        return out;
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pool {}  guid {}  txg {} (synced {})  generation {}  throttle {}  slop {}",
        st.name,
        st.guid,
        st.open_txg,
        st.synced_txg,
        st.generation,
        st.throttle_policy,
        short(st.slop_space)
    );
    if let Some(f) = &st.persist_failure {
        let _ = writeln!(out, "{}", persist_failure_line(st, f));
    }
    if why.is_empty() {
        let _ = writeln!(out, "health {health}");
    } else {
        let _ = writeln!(out, "health {health}: {}", why.join(", "));
    }
    if let Some(l) = st.leadership.as_ref().filter(|l| l.store == "postgres") {
        let standbys = if l.standbys.is_empty() {
            "no standby seen".to_string()
        } else {
            format!("standbys {}", l.standbys.join(", "))
        };
        let _ = writeln!(
            out,
            "leader {} (store postgres, lease {:.1}/{:.1} s)  {standbys}",
            l.leader,
            l.lease_left_ms as f64 / 1000.0,
            l.lease_ms as f64 / 1000.0
        );
    }
    for l in pending_lines(st) {
        let _ = writeln!(out, "{l}");
    }
    if let Some(m) = mapping_line(st) {
        let _ = writeln!(out, "{m}");
    }
    if let Some(e) = crate::evacuation::evacuation_line(st) {
        let _ = writeln!(out, "{e}");
    }
    if st.claim_window_remaining_ms > 0 {
        let _ = writeln!(
            out,
            "claim window open for {:.1} s after a restart: Claim is served, Allocate waits",
            st.claim_window_remaining_ms as f64 / 1000.0
        );
    }
    for w in ahead_warnings(st, style) {
        let _ = writeln!(out, "{w}");
    }
    if let Some(d) = deferred_note(st, style) {
        let _ = writeln!(out, "{d}");
    }
    out.push('\n');
    out.push_str(&layout(&VDEV_HEADER, &rows));
    for c in &st.classes {
        // The embedded log class's groups are its vdevs (OpenZFS balances
        // them by the vdev's fill), so its VAR line would repeat normal's.
        if c.space == 0 || c.name == "embedded_log" {
            continue;
        }
        if let Some(b) = balance(c) {
            // VAR is a vdev's fill over its class's: undefined while the
            // class holds nothing.
            let var = if class_used(c) <= 0.0 {
                "-/-".to_string()
            } else {
                format!("{:.2}/{:.2}", b.min_var, b.max_var)
            };
            let _ = writeln!(
                out,
                "{}: MIN/MAX VAR: {var}  STDDEV: {:.2}%  SPREAD: {:.2}%  SCORE: {:.3}",
                c.name,
                b.stddev * 100.0,
                b.spread * 100.0,
                c.balance_score
            );
        }
    }
    out.push('\n');
    // A class with no space (no log vdevs; vdevs too small for an embedded
    // log metaslab) has no throttle worth showing.
    let crows: Vec<[String; 8]> = st
        .classes
        .iter()
        .filter(|c| c.space > 0)
        .map(|c| {
            [
                c.name.clone(),
                limit(c, style),
                short(c.reserved),
                if c.busy { "yes" } else { "no" }.to_string(),
                format!("{} ({})", c.waiting, short(c.waiting_bytes)),
                short(c.alloc_io_size),
                if c.throttle_enabled { "on" } else { "off" }.to_string(),
                if c.throttle_enabled {
                    pct(c.reserved, c.alloc_max)
                } else {
                    "-".into()
                },
            ]
        })
        .collect();
    out.push_str(&layout(&CLASS_HEADER, &crows));
    out
}

/// Left-aligned first column, the others right-aligned, two spaces apart.
fn layout<const N: usize>(header: &[&str; N], rows: &[[String; N]]) -> String {
    let mut w = [0usize; N];
    for (i, h) in header.iter().enumerate() {
        w[i] = h.len();
    }
    for r in rows {
        for (i, cell) in r.iter().enumerate() {
            w[i] = w[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut s = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i == 0 {
                let _ = write!(s, "{cell:<width$}", width = w[0]);
            } else {
                let _ = write!(s, "  {cell:>width$}", width = w[i]);
            }
        }
        out.push_str(s.trim_end());
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

// ---- JSON ------------------------------------------------------------------
//
// The proto3 JSON mapping, as the API's own JSON would be: 64-bit integers
// are strings (a guid or u64::MAX is beyond 2^53, where jq and JavaScript
// round), 32-bit ones and floats are numbers; field names as in the proto.

/// A 64-bit integer as a JSON string (the proto3 JSON mapping), for
/// `#[serde(serialize_with)]` in every report of this crate.
pub(crate) fn as_string<S: serde::Serializer, T: std::fmt::Display>(
    v: &T,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

#[derive(Debug, Serialize)]
pub struct PoolJson {
    pub name: String,
    #[serde(serialize_with = "as_string")]
    pub guid: u64,
    #[serde(serialize_with = "as_string")]
    pub open_txg: u64,
    #[serde(serialize_with = "as_string")]
    pub synced_txg: u64,
    #[serde(serialize_with = "as_string")]
    pub generation: u64,
    #[serde(serialize_with = "as_string")]
    pub claim_window_remaining_ms: u64,
    pub throttle_policy: String,
    #[serde(serialize_with = "as_string")]
    pub slop_space: u64,
    #[serde(serialize_with = "as_string")]
    pub time_ms: u64,
    #[serde(serialize_with = "as_string")]
    pub size: u64,
    #[serde(serialize_with = "as_string")]
    pub alloc: u64,
    #[serde(serialize_with = "as_string")]
    pub free: u64,
    /// ONLINE, DEGRADED or SUSPENDED, as the table's `health` line.
    pub health: String,
    /// The vdevs that are not healthy ("file1 (1) offline").
    pub health_reasons: Vec<String>,
    /// The table's `warning:` lines (vdevs filling well ahead of their
    /// class), as printed.
    pub warnings: Vec<String>,
    /// Who serves the pool: the store, and with PostgreSQL the leader, its
    /// lease and the standbys it has seen (as the table's `leader` line).
    pub leadership: LeadershipJson,
    /// Set (else null) while the store refuses a txg: nothing committed
    /// after `synced_txg` is durable until it takes it.
    pub persist_failure: Option<PersistFailureJson>,
    /// Devices whose agents registered and wait for `vdev add`.
    pub pending_vdevs: Vec<PendingJson>,
    /// The indirect mapping: live entries, the bytes of their old
    /// extents, and the bytes the allocator holds for them.
    pub mapping: MappingJson,
    /// A vdev removal under way (else null): what the mover copied.
    pub evacuation: Option<crate::evacuation::EvacuationJson>,
    pub classes: Vec<ClassJson>,
    pub vdevs: Vec<VdevJson>,
}

#[derive(Debug, Serialize)]
pub struct PendingJson {
    pub name: String,
    #[serde(serialize_with = "as_string")]
    pub device_guid: u64,
    #[serde(serialize_with = "as_string")]
    pub capacity: u64,
    pub log: bool,
    pub endpoint: String,
    /// The name in the agent's certificate.
    pub agent: String,
    #[serde(serialize_with = "as_string")]
    pub since_ms: u64,
}

#[derive(Debug, Serialize)]
pub struct MappingJson {
    #[serde(serialize_with = "as_string")]
    pub entries: u64,
    #[serde(serialize_with = "as_string")]
    pub bytes: u64,
    #[serde(serialize_with = "as_string")]
    pub memory_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct PersistFailureJson {
    #[serde(serialize_with = "as_string")]
    pub txg: u64,
    /// The store's last error.
    pub error: String,
    /// Unix ms of the first failed attempt.
    #[serde(serialize_with = "as_string")]
    pub since_ms: u64,
    #[serde(serialize_with = "as_string")]
    pub attempts: u64,
}

#[derive(Debug, Serialize)]
pub struct LeadershipJson {
    /// "sqlite" (one allocator) or "postgres" (shared; a leader and standbys).
    pub store: String,
    /// The leader's advertised URL (empty with SQLite).
    pub leader: String,
    pub standbys: Vec<String>,
    #[serde(serialize_with = "as_string")]
    pub lease_ms: u64,
    #[serde(serialize_with = "as_string")]
    pub lease_left_ms: u64,
}

/// A class's balance line (`MIN/MAX VAR  STDDEV  SPREAD`), ratios.
#[derive(Debug, Serialize)]
pub struct BalanceJson {
    pub min_var: f64,
    pub max_var: f64,
    pub stddev: f64,
    pub spread: f64,
}

#[derive(Debug, Serialize)]
pub struct ClassJson {
    pub name: String,
    #[serde(serialize_with = "as_string")]
    pub space: u64,
    #[serde(serialize_with = "as_string")]
    pub alloc: u64,
    #[serde(serialize_with = "as_string")]
    pub free: u64,
    #[serde(serialize_with = "as_string")]
    pub reserved: u64,
    #[serde(serialize_with = "as_string")]
    pub alloc_max: u64,
    #[serde(serialize_with = "as_string")]
    pub alloc_io_size: u64,
    /// Of alloc: freed, reusable once 2 more txgs have synced.
    #[serde(serialize_with = "as_string")]
    pub deferred: u64,
    pub busy: bool,
    pub waiting: u32,
    #[serde(serialize_with = "as_string")]
    pub waiting_bytes: u64,
    pub throttle_enabled: bool,
    pub fragmentation: i32,
    /// 0 = every vdev equally full, < 1 (see `aliquotctl balancer eval`).
    pub balance_score: f64,
    /// Absent for a class with no space (and for embedded_log, whose
    /// groups are normal's vdevs).
    pub balance: Option<BalanceJson>,
    pub groups: Vec<GroupJson>,
}

#[derive(Debug, Serialize)]
pub struct GroupJson {
    pub vdev: u32,
    pub name: String,
    #[serde(serialize_with = "as_string")]
    pub capacity: u64,
    #[serde(serialize_with = "as_string")]
    pub alloc: u64,
    #[serde(serialize_with = "as_string")]
    pub free: u64,
    pub free_fraction: f64,
    /// Its used fraction over its class's (the table's VAR).
    pub var: Option<f64>,
    pub children: u32,
    pub parity: u32,
    #[serde(serialize_with = "as_string")]
    pub aliquot: u64,
    #[serde(serialize_with = "as_string")]
    pub queue_target: u64,
    #[serde(serialize_with = "as_string")]
    pub queue_depth: u64,
    pub fragmentation: i32,
    pub health: String,
    pub allocatable: bool,
    pub embedded_log_metaslab: Option<u32>,
}

#[derive(Debug, Serialize)]
pub struct VdevJson {
    pub vdev: u32,
    #[serde(serialize_with = "as_string")]
    pub guid: u64,
    pub name: String,
    pub endpoint: String,
    pub class: String,
    #[serde(serialize_with = "as_string")]
    pub capacity: u64,
    #[serde(serialize_with = "as_string")]
    pub alloc: u64,
    pub ashift: u32,
    #[serde(serialize_with = "as_string")]
    pub metaslab_size: u64,
    pub metaslab_count: u32,
    pub children: u32,
    pub parity: u32,
    pub rotational: bool,
    pub health: String,
    pub online: bool,
    pub embedded_log_metaslab: Option<u32>,
    #[serde(serialize_with = "as_string")]
    pub last_report_age_ms: u64,
    #[serde(serialize_with = "as_string")]
    pub latency_p50_us: u64,
    #[serde(serialize_with = "as_string")]
    pub latency_p99_us: u64,
    pub device_queue_ios: u32,
    #[serde(serialize_with = "as_string")]
    pub device_queue_bytes: u64,
    #[serde(serialize_with = "as_string")]
    pub bytes_written: u64,
    #[serde(serialize_with = "as_string")]
    pub bytes_read: u64,
}

impl From<&PoolStatus> for PoolJson {
    fn from(st: &PoolStatus) -> Self {
        let size: u64 = st.vdevs.iter().map(|v| v.capacity).sum();
        let alloc: u64 = st.vdevs.iter().map(|v| v.alloc).sum();
        let (health, reasons) = pool_health(st);
        PoolJson {
            health: health.to_string(),
            health_reasons: reasons,
            warnings: ahead_warnings(st, Style::default()),
            leadership: {
                let l = st.leadership.clone().unwrap_or_default();
                LeadershipJson {
                    store: if l.store.is_empty() {
                        "sqlite".into()
                    } else {
                        l.store
                    },
                    leader: l.leader,
                    standbys: l.standbys,
                    lease_ms: l.lease_ms,
                    lease_left_ms: l.lease_left_ms,
                }
            },
            persist_failure: st.persist_failure.as_ref().map(|f| PersistFailureJson {
                txg: f.txg,
                error: f.error.clone(),
                since_ms: f.since_ms,
                attempts: f.attempts,
            }),
            pending_vdevs: st
                .pending_vdevs
                .iter()
                .map(|p| PendingJson {
                    name: p.name.clone(),
                    device_guid: p.device_guid,
                    capacity: p.capacity,
                    log: p.log,
                    endpoint: p.endpoint.clone(),
                    agent: p.agent.clone(),
                    since_ms: p.since_ms,
                })
                .collect(),
            mapping: MappingJson {
                entries: st.mapping_entries,
                bytes: st.mapping_bytes,
                memory_bytes: st.mapping_memory_bytes,
            },
            evacuation: st.evacuation.as_ref().map(Into::into),
            name: st.name.clone(),
            guid: st.guid,
            open_txg: st.open_txg,
            synced_txg: st.synced_txg,
            generation: st.generation,
            claim_window_remaining_ms: st.claim_window_remaining_ms,
            throttle_policy: st.throttle_policy.clone(),
            slop_space: st.slop_space,
            time_ms: st.time_ms,
            size,
            alloc,
            free: size.saturating_sub(alloc),
            classes: st.classes.iter().map(|c| class_json(st, c)).collect(),
            vdevs: st.vdevs.iter().map(vdev_json).collect(),
        }
    }
}

fn class_json(st: &PoolStatus, c: &ClassStatus) -> ClassJson {
    ClassJson {
        name: c.name.clone(),
        space: c.space,
        alloc: c.alloc,
        free: c.space.saturating_sub(c.alloc),
        reserved: c.reserved,
        alloc_max: c.alloc_max,
        alloc_io_size: c.alloc_io_size,
        deferred: c.deferred,
        busy: c.busy,
        waiting: c.waiting,
        waiting_bytes: c.waiting_bytes,
        throttle_enabled: c.throttle_enabled,
        fragmentation: c.fragmentation,
        balance_score: c.balance_score,
        balance: (c.space > 0 && c.name != "embedded_log")
            .then(|| balance(c))
            .flatten()
            .map(|b| BalanceJson {
                min_var: b.min_var,
                max_var: b.max_var,
                stddev: b.stddev,
                spread: b.spread,
            }),
        groups: c.groups.iter().map(|g| group_json(st, c, g)).collect(),
    }
}

fn group_json(st: &PoolStatus, c: &ClassStatus, g: &GroupStatus) -> GroupJson {
    let v = vdev_of(st, g.vdev);
    GroupJson {
        vdev: g.vdev,
        name: v.map(|v| v.name.clone()).unwrap_or_default(),
        capacity: g.capacity,
        alloc: g.alloc,
        free: g.capacity.saturating_sub(g.alloc),
        free_fraction: g.free_fraction,
        var: var(c, g),
        children: g.children,
        parity: g.parity,
        aliquot: g.aliquot,
        queue_target: g.queue_target,
        queue_depth: g.queue_depth,
        fragmentation: g.fragmentation,
        health: health_name(g.health, v.map(|v| v.online).unwrap_or(true)).to_string(),
        allocatable: g.allocatable,
        embedded_log_metaslab: v.and_then(|v| v.embedded_log_metaslab),
    }
}

fn vdev_json(v: &VdevStatus) -> VdevJson {
    let r = v.last_report.clone().unwrap_or_default();
    VdevJson {
        vdev: v.vdev,
        guid: v.guid,
        name: v.name.clone(),
        endpoint: v.endpoint.clone(),
        class: v.class.clone(),
        capacity: v.capacity,
        alloc: v.alloc,
        ashift: v.ashift,
        metaslab_size: v.metaslab_size,
        metaslab_count: v.metaslab_count,
        children: v.children,
        parity: v.parity,
        rotational: v.rotational,
        health: health_name(v.health, v.online).to_string(),
        online: v.online,
        embedded_log_metaslab: v.embedded_log_metaslab,
        last_report_age_ms: v.last_report_age_ms,
        latency_p50_us: r.latency_p50_us,
        latency_p99_us: r.latency_p99_us,
        device_queue_ios: r.queue_depth_ios,
        device_queue_bytes: r.queue_depth_bytes,
        bytes_written: r.bytes_written,
        bytes_read: r.bytes_read,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn group(vdev: u32, cap: u64, alloc: u64) -> GroupStatus {
        GroupStatus {
            vdev,
            capacity: cap,
            alloc,
            children: 1,
            parity: 0,
            aliquot: 2 * MIB,
            queue_target: 4 * MIB,
            queue_depth: MIB,
            fragmentation: 3,
            health: VdevHealth::Healthy as i32,
            free_fraction: 1.0 - alloc as f64 / cap as f64,
            allocatable: true,
        }
    }

    #[test]
    fn the_mapping_line_shows_only_with_entries() {
        let mut st = sample();
        assert_eq!(mapping_line(&st), None);
        assert!(!render_table(&st).contains("mapping:"));
        st.mapping_entries = 3;
        st.mapping_bytes = 3 * MIB;
        st.mapping_memory_bytes = 96;
        let line = mapping_line(&st).unwrap();
        assert!(line.starts_with("mapping: 3 entries for 3"), "{line}");
        assert!(render_table(&st).contains(&line));
        let j = serde_json::to_value(PoolJson::from(&st)).unwrap();
        assert_eq!(j["mapping"]["entries"], "3");
        assert_eq!(j["mapping"]["memory_bytes"], "96");
    }

    fn sample() -> PoolStatus {
        let vdev = |id: u32, name: &str, cap: u64, alloc: u64, online: bool| VdevStatus {
            vdev: id,
            guid: 0xabc + id as u64,
            name: name.into(),
            endpoint: format!("http://127.0.0.1:{}", 7001 + id),
            capacity: cap,
            ashift: 12,
            metaslab_size: 128 * MIB,
            metaslab_count: (cap / (128 * MIB)) as u32,
            children: 1,
            parity: 0,
            rotational: false,
            class: "normal".into(),
            health: VdevHealth::Healthy as i32,
            online,
            embedded_log_metaslab: if id == 2 { Some(5) } else { None },
            alloc,
            last_report: None,
            last_report_age_ms: 300,
            mapping_entries: 0,
        };
        let groups = vec![
            group(0, GIB, 100 * MIB),
            group(1, 2 * GIB, 200 * MIB),
            group(2, 4 * GIB, 400 * MIB),
        ];
        PoolStatus {
            leadership: None,
            persist_failure: None,
            pending_vdevs: vec![],
            mapping_entries: 0,
            mapping_bytes: 0,
            mapping_memory_bytes: 0,
            evacuation: None,
            name: "aliquot".into(),
            guid: 0x1234,
            open_txg: 42,
            synced_txg: 41,
            throttle_policy: "unified".into(),
            classes: vec![
                ClassStatus {
                    name: "normal".into(),
                    space: 7 * GIB,
                    alloc: 700 * MIB,
                    reserved: 3 * MIB,
                    alloc_max: 24 * MIB,
                    alloc_io_size: MIB,
                    busy: true,
                    waiting: 2,
                    waiting_bytes: 2 * MIB,
                    throttle_enabled: true,
                    groups,
                    fragmentation: 3,
                    balance_score: 0.091,
                    deferred: 0,
                },
                ClassStatus {
                    name: "log".into(),
                    fragmentation: -1,
                    ..Default::default()
                },
            ],
            vdevs: vec![
                vdev(0, "file0", GIB, 100 * MIB, true),
                vdev(1, "file1", 2 * GIB, 200 * MIB, false),
                vdev(2, "file2", 4 * GIB, 400 * MIB, true),
            ],
            slop_space: 224 * MIB,
            time_ms: 1,
            generation: 3,
            claim_window_remaining_ms: 0,
            max_lease_ms: 300_000,
        }
    }

    #[test]
    fn deferred_frees_are_said() {
        let mut st = sample();
        assert!(!render_table(&st).contains("frees deferred"));
        st.classes[0].deferred = 100 * MIB;
        let t = render_table(&st);
        assert!(
            t.contains("frees deferred: 100M of ALLOC is freed and reusable once 2 more txgs"),
            "{t}"
        );
        let j = serde_json::to_value(PoolJson::from(&st)).unwrap();
        assert_eq!(j["classes"][0]["deferred"], "104857600");
    }

    #[test]
    fn an_empty_pool_has_no_var_and_an_unthrottled_class_no_limit() {
        let mut st = sample();
        for g in &mut st.classes[0].groups {
            g.alloc = 0;
        }
        st.classes[0].alloc = 0;
        st.classes.push(ClassStatus {
            name: "embedded_log".into(),
            space: 48 * MIB,
            alloc_max: 4 * GIB,
            throttle_enabled: false,
            fragmentation: -1,
            ..Default::default()
        });
        let t = render_table(&st);
        assert!(t.contains("normal: MIN/MAX VAR: -/-  STDDEV"), "{t}");
        let row = t
            .lines()
            .find(|l| l.starts_with("embedded_log"))
            .unwrap_or_else(|| panic!("{t}"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[1], "-", "LIMIT of an unthrottled class: {row}");
    }

    #[test]
    fn table_header_and_rows() {
        let t = render_table(&sample());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "pool aliquot  guid 4660  txg 42 (synced 41)  generation 3  throttle unified  slop 224M"
        );
        assert_eq!(lines[1], "health DEGRADED: file1 (1) offline");
        let header: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(header, VDEV_HEADER);
        let pool: Vec<&str> = lines[4].split_whitespace().collect();
        assert_eq!(pool[..5], ["aliquot", "7.00G", "700M", "6.32G", "9%"]);
        assert_eq!(pool[7], "DEGRADED");
        let class: Vec<&str> = lines[5].split_whitespace().collect();
        assert_eq!(class[0], "normal");
        assert!(lines[6].starts_with("    file0 (0)"), "{}", lines[6]);
        let f1: Vec<&str> = lines[7].split_whitespace().collect();
        assert_eq!(
            f1[..8],
            ["file1", "(1)", "2.00G", "200M", "1.80G", "9%", "1.00", "3%"]
        );
        assert_eq!(f1[8], "OFFLINE");
        let f2: Vec<&str> = lines[8].split_whitespace().collect();
        assert_eq!(
            f2[8..],
            ["HEALTHY", "1.00M", "4.00M", "2.00M", "ms", "5", "yes"]
        );
        // The empty log class has no vdev rows but does have a throttle row.
        let chead = lines.iter().position(|l| l.starts_with("CLASS")).unwrap();
        let ch: Vec<&str> = lines[chead].split_whitespace().collect();
        assert_eq!(ch, CLASS_HEADER);
        let normal: Vec<&str> = lines[chead + 1].split_whitespace().collect();
        assert_eq!(
            normal,
            [
                "normal", "24.0M", "3.00M", "yes", "2", "(2.00M)", "1.00M", "on", "12%"
            ]
        );
        // The log class has no space: no throttle row either.
        assert_eq!(lines.len(), chead + 2, "{t}");
        // Columns line up: every vdev row is right-aligned to the header's end.
        let width = lines[3].len();
        for l in &lines[4..9] {
            assert_eq!(l.len(), width, "{l:?}");
        }
    }

    #[test]
    fn a_failing_store_is_said_first_in_the_table_and_in_json() {
        let mut st = sample();
        assert!(serde_json::to_value(PoolJson::from(&st)).unwrap()["persist_failure"].is_null());
        st.time_ms = 61_000;
        st.persist_failure = Some(aliquot_proto::v1::PersistFailure {
            txg: 42,
            error: "database or disk is full".into(),
            since_ms: 1_000,
            attempts: 17,
        });
        let t = render_table(&st);
        let line = t.lines().nth(1).unwrap();
        assert!(
            line.starts_with("STORE FAILING: txg 42 not persisted for 60.0 s (17 attempts): database or disk is full.")
                && line.contains("after txg 41 is durable"),
            "{line}"
        );
        let v = serde_json::to_value(PoolJson::from(&st)).unwrap();
        let f = &v["persist_failure"];
        assert_eq!(f["txg"], "42");
        assert_eq!(f["attempts"], "17");
        assert_eq!(f["since_ms"], "1000");
        assert_eq!(f["error"], "database or disk is full");
    }

    #[test]
    fn json_keys_and_sums() {
        let v = serde_json::to_value(PoolJson::from(&sample())).unwrap();
        assert_eq!(v["leadership"]["store"], "sqlite");
        assert_eq!(v["warnings"], serde_json::json!([]));
        // The table's warning lines, in JSON too.
        let mut ahead = sample();
        ahead.classes[0].groups[0].alloc = 900 * MIB;
        let t = render_table(&ahead);
        let w: Vec<&str> = t.lines().filter(|l| l.starts_with("warning:")).collect();
        assert!(!w.is_empty(), "{t}");
        let j = serde_json::to_value(PoolJson::from(&ahead)).unwrap();
        assert_eq!(j["warnings"], serde_json::json!(w));
        let c = &v["classes"][0];
        for k in [
            "name",
            "space",
            "alloc",
            "reserved",
            "alloc_max",
            "alloc_io_size",
            "busy",
            "groups",
        ] {
            assert!(c.get(k).is_some(), "class key {k}");
        }
        let g = &c["groups"][2];
        for k in [
            "vdev",
            "capacity",
            "alloc",
            "children",
            "parity",
            "aliquot",
            "queue_target",
            "queue_depth",
            "fragmentation",
            "health",
        ] {
            assert!(g.get(k).is_some(), "group key {k}");
        }
        assert_eq!(g["embedded_log_metaslab"], 5);
        assert_eq!(c["groups"][1]["health"], "offline");
        let sum: u64 = c["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["alloc"].as_str().unwrap().parse::<u64>().unwrap())
            .sum();
        assert_eq!(sum.to_string(), c["alloc"].as_str().unwrap());
        assert_eq!(v["alloc"], (700 * MIB).to_string());
        // 64-bit values beyond 2^53 survive as strings; 32-bit ones are numbers.
        assert_eq!(v["vdevs"][0]["guid"], "2748");
        assert_eq!(g["vdev"], 2);
    }

    /// The whole table for a fixed, unbalanced pool (the 88/35/41 % fill
    /// of the issue), byte for byte.
    #[test]
    fn golden_unbalanced_pool() {
        let mut st = sample();
        let allocs = [901 * MIB, 717 * MIB, 1679 * MIB];
        for (g, a) in st.classes[0].groups.iter_mut().zip(allocs) {
            g.alloc = a;
        }
        for (v, a) in st.vdevs.iter_mut().zip(allocs) {
            v.alloc = a;
            v.online = true;
        }
        st.classes[0].alloc = allocs.iter().sum();
        st.vdevs[2].health = VdevHealth::Unavailable as i32;
        st.classes[0].groups[2].health = VdevHealth::Unavailable as i32;
        let want = "\
pool aliquot  guid 4660  txg 42 (synced 41)  generation 3  throttle unified  slop 224M
health DEGRADED: file2 (2) unavailable
warning: file0 (0) is 42 points ahead of the normal class (87% full vs 45%)

NAME            SIZE  ALLOC   FREE  CAP   VAR  FRAG       HEALTH  QDEPTH  QTARGET  ALIQUOT  EMBLOG  ALLOC'ABLE
aliquot        7.00G  3.22G  3.78G  45%     -    3%     DEGRADED   3.00M        -        -       -           -
  normal       7.00G  3.22G  3.78G  45%     -    3%            -   3.00M        -        -       -           -
    file0 (0)  1.00G   901M   123M  87%  1.91    3%      HEALTHY   1.00M    4.00M    2.00M       -         yes
    file1 (1)  2.00G   717M  1.30G  35%  0.76    3%      HEALTHY   1.00M    4.00M    2.00M       -         yes
    file2 (2)  4.00G  1.64G  2.36G  40%  0.89    3%  UNAVAILABLE   1.00M    4.00M    2.00M    ms 5         yes
normal: MIN/MAX VAR: 0.76/1.91  STDDEV: 23.69%  SPREAD: 52.98%  SCORE: 0.091

CLASS   LIMIT  RESERVED  BUSY    WAITING  IO_SIZE  THROTTLE  USED/LIMIT
normal  24.0M     3.00M   yes  2 (2.00M)    1.00M        on         12%
";
        assert_eq!(render_table(&st), want);
    }

    #[test]
    fn parsable_and_scripted() {
        let st = sample();
        let exact = Style {
            exact: true,
            ..Style::default()
        };
        let t = render_table_with(&st, exact);
        let f0 = t
            .lines()
            .find(|l| l.trim_start().starts_with("file0 (0)"))
            .unwrap();
        let cells: Vec<&str> = f0.split_whitespace().collect();
        assert_eq!(
            cells[2..5],
            ["1073741824", "104857600", "968884224"],
            "{f0}"
        );
        let h = render_table_with(
            &st,
            Style {
                scripted: true,
                ..exact
            },
        );
        let rows: Vec<Vec<&str>> = h.lines().map(|l| l.split('\t').collect()).collect();
        // pool, class, three vdevs; no header, no footer.
        assert_eq!(rows.len(), 5, "{h}");
        assert!(rows.iter().all(|r| r.len() == VDEV_HEADER.len()), "{h}");
        assert_eq!(rows[2][..3], ["file0 (0)", "1073741824", "104857600"]);
        assert_eq!(rows[3][7], "OFFLINE");
        // Balanced enough: no warning; off when 0.
        assert!(ahead_warnings(&st, Style::default()).is_empty());
    }
}
